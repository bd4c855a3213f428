"""Unit tests of the conformance suite's own machinery (tests/conformance/conftest.py): which
cases SANDLOT_REQUIRE_BACKENDS names, and the reason a case is skipped, for each way a server
can say it cannot run it. No server: the HTTP layer is the FakeServer of test_sdk_unit."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from conformance.conftest import CASES, Case, probe, required_cases
from test_sdk_unit import SB, fake_client

RUNSC = Case("container-runsc", "container", "runsc")
HEALTH_OK = {"status": "ok", "backends": {"function": "ok", "container": "ok"}}


def error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


def fake_server(tmp_path):
    return SimpleNamespace(url="http://fake", data_dir=tmp_path, log_tail=lambda n=60: "")


def run_probe(tmp_path, case, health, create):
    """probe() against a server answering ``health`` to /healthz and ``create()`` to the
    create; exec answers `ready`. Returns (reason, requests)."""
    def routes(req):
        if req.url.path == "/healthz":
            return httpx.Response(200, json=health)
        if req.url.path == "/v1/sandboxes":
            return create()
        if req.url.path.endswith("/exec"):
            return httpx.Response(200, json={"exit_code": 0, "duration_ms": 1,
                                             "stdout": "ready\n", "stderr": "",
                                             "stdout_bytes": 6, "stderr_bytes": 0,
                                             "truncated": False, "replayed": False,
                                             "timed_out": False, "oom_killed": False,
                                             "signal": None})
        return httpx.Response(204)

    c, fake = fake_client(routes, retries=0)
    return probe(case, c, fake_server(tmp_path)), fake.requests


def test_required_cases():
    assert required_cases(None) == frozenset() and required_cases(" ") == frozenset()
    assert required_cases("function") == {"function"}
    assert required_cases("function, container-runc") == {"function", "container-runc"}
    assert required_cases("container") == {"container-runc", "container-runsc"}
    with pytest.raises(ValueError, match="container-crun"):
        required_cases("function,container-crun")
    assert [c.name for c in CASES] == ["function", "container-runc", "container-runsc",
                                       "microvm", "vm"]
    assert RUNSC.create_args() == {"backend": "container", "runtime": "runsc"}
    assert CASES[0].create_args() == {"backend": "function"}


def test_backend_unavailable_in_healthz_is_the_reason(tmp_path):
    health = {"backends": {"function": "ok",
                           "container": "unavailable: backend container is not built yet"}}
    why, reqs = run_probe(tmp_path, RUNSC, health, lambda: httpx.Response(500))
    assert why == "/healthz: container: unavailable: backend container is not built yet"
    assert [r.url.path for r in reqs] == ["/healthz"]  # no create tried
    why, _ = run_probe(tmp_path, RUNSC, {"backends": {"function": "ok"}},
                       lambda: httpx.Response(500))
    assert why.startswith("/healthz lists no backend 'container'")


def test_runtime_unavailable_on_create_is_the_reason(tmp_path):
    why, reqs = run_probe(tmp_path, RUNSC, HEALTH_OK, lambda: error(
        503, "unavailable", "runtime runsc: /usr/local/bin/runsc not found"))
    assert why == "create answered unavailable: runtime runsc: /usr/local/bin/runsc not found"
    body = json.loads(reqs[-1].content)
    assert (body["backend"], body["runtime"], body["labels"]["conformance"]) == (
        "container", "runsc", "container-runsc")


def test_server_without_runtime_field_or_image_is_a_reason(tmp_path):
    why, _ = run_probe(tmp_path, RUNSC, HEALTH_OK, lambda: error(
        400, "invalid_argument", "unknown field `runtime`"))
    assert why == "the server does not take runtime='runsc': unknown field `runtime`"
    why, _ = run_probe(tmp_path, RUNSC, HEALTH_OK, lambda: error(
        404, "not_found", 'image "python" not found'))
    assert why.startswith("no image 'python' for backend container")


def test_other_create_errors_fail_the_case(tmp_path):
    for status, code, msg in [(400, "invalid_argument", "memory_mib out of range"),
                              (500, "internal", "runsc run sb-1: exit status: 128")]:
        with pytest.raises(pytest.fail.Exception) as ei:
            run_probe(tmp_path, RUNSC, HEALTH_OK, lambda: error(status, code, msg))
        assert msg in str(ei.value)


def test_a_case_that_runs_has_no_reason_and_its_probe_is_deleted(tmp_path):
    answer = dict(SB, backend="container", runtime="runsc")
    why, reqs = run_probe(tmp_path, RUNSC, HEALTH_OK, lambda: httpx.Response(201, json=answer))
    assert why is None
    assert [(r.method, r.url.path) for r in reqs] == [
        ("GET", "/healthz"), ("POST", "/v1/sandboxes"),
        ("POST", f"/v1/sandboxes/{SB['id']}/exec"), ("DELETE", f"/v1/sandboxes/{SB['id']}")]
