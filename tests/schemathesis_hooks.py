"""Schemathesis hooks for tests/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

One custom check, ``sandlot_no_server_error``, replaces schemathesis' built-in
``not_a_server_error``: every 5xx answer fails, except the documented ``503 unavailable``
that ``POST /v1/sandboxes`` gives for a backend (or a container runtime) this host does not
have (docs/api.md, error table: "backend not built or not usable on this host"). Which are
absent is read from ``GET /healthz`` by the test and passed in
``SANDLOT_UNAVAILABLE_BACKENDS`` / ``SANDLOT_UNAVAILABLE_RUNTIMES`` (comma-separated), so a
503 from one that is usable here still fails.
"""

from __future__ import annotations

import json
import os

import schemathesis

UNAVAILABLE = {b for b in os.environ.get("SANDLOT_UNAVAILABLE_BACKENDS", "").split(",") if b}
UNAVAILABLE_RUNTIMES = {
    r for r in os.environ.get("SANDLOT_UNAVAILABLE_RUNTIMES", "").split(",") if r}


def _expected_unavailable(response, case) -> bool:
    if response.status_code != 503:
        return False
    if case.method.upper() != "POST" or case.path != "/v1/sandboxes":
        return False
    if not isinstance(case.body, dict):
        return False
    absent_runtime = (case.body.get("backend") == "container"
                      and case.body.get("runtime") in UNAVAILABLE_RUNTIMES)
    if case.body.get("backend") not in UNAVAILABLE and not absent_runtime:
        return False
    try:
        err = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return err.get("code") == "unavailable"


@schemathesis.check
def sandlot_no_server_error(ctx, response, case):
    """No 5xx, except 503 `unavailable` for a create on a backend absent from this host."""
    if response.status_code >= 500 and not _expected_unavailable(response, case):
        body = response.content[:300].decode("utf-8", "replace")
        raise AssertionError(f"server error {response.status_code}: {body}")
