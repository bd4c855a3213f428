"""API fuzzing: schemathesis against the session server's own /openapi.json.

Property-based requests for every operation of the OpenAPI document (examples, coverage,
fuzzing and stateful phases) with a fixed seed, a bounded example count and an overall
time budget. The run fails on any 5xx (except the documented 503 `unavailable` for a
backend this host lacks, see schemathesis_hooks.py), on a status code, content type or
response header the document does not declare, on a response body that violates its
schema, and on a request that hangs past the per-request timeout.

Sandboxes that the fuzzer creates are deleted through the SDK at the end, and host
resources (cgroups, sandbox dirs, mounts, guest processes) are counted before and after,
as in test_bad_input.py.

Reproduce a failure by hand with the command line printed in the failure message against a
`sandlot up` of your own (Python 3 venv with `pip install -e 'sdk/python[test]'`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import sandlot
from conftest import count_leaks

HERE = Path(__file__).resolve().parent
SEED = 20261130
MAX_EXAMPLES = 10          # per operation and phase
TIME_BUDGET_S = 45         # schemathesis --max-time: fuzzing/stateful stop when spent
REQUEST_TIMEOUT_S = 30     # one request past this is a hang (reported as an error)
HARD_LIMIT_S = 180         # the whole subprocess; past this the test fails as hung

CHECKS = ",".join([
    "sandlot_no_server_error",          # custom (schemathesis_hooks.py): no 5xx
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
])


def schemathesis_cli() -> str:
    """The `schemathesis` next to this interpreter (the venv's), else one on PATH."""
    exe = Path(sys.executable).parent / "schemathesis"
    if exe.is_file():
        return str(exe)
    found = shutil.which("schemathesis")
    if found is None:
        pytest.skip("schemathesis is not installed: pip install -e 'sdk/python[test]'")
    return found


def test_schemathesis_finds_nothing(server, client, python_image, tmp_path):
    cli = schemathesis_cli()
    health = httpx.get(f"{server.url}/healthz", timeout=10).json()
    unavailable = sorted(b for b, s in health["backends"].items() if s != "ok")
    absent_runtimes = sorted(r for r, s in health.get("runtimes", {}).items() if s != "ok")
    before_ids = {b.id for b in client.list()}
    before = count_leaks(server.data_dir)

    cmd = [cli, "run", f"{server.url}/openapi.json",
           "--checks", CHECKS,
           "--seed", str(SEED),
           "--max-examples", str(MAX_EXAMPLES),
           "--max-time", str(TIME_BUDGET_S),
           "--request-timeout", str(REQUEST_TIMEOUT_S),
           "--generation-database", "none",
           "--workers", "1",
           # A batch may ask for 1000 real sandboxes per generated case; its validation
           # and per-item errors are tested in crates/sandlot-server/src/tests_batch.rs and
           # tests/test_batch.py instead.
           "--exclude-operation-id", "createSandboxBatch",
           "--no-color"]
    env = dict(os.environ,
               SCHEMATHESIS_HOOKS="schemathesis_hooks",
               SANDLOT_UNAVAILABLE_BACKENDS=",".join(unavailable),
               SANDLOT_UNAVAILABLE_RUNTIMES=",".join(absent_runtimes),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=HARD_LIMIT_S)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        out, code = out + f"\n(killed after {HARD_LIMIT_S}s)", None
    finally:
        elapsed = time.monotonic() - t0
        leftovers = [b for b in client.list()
                     if b.id not in before_ids and b.state != "deleted"]
        for box in leftovers:
            try:
                box.delete()
            except sandlot.SandlotError as e:
                print(f"cleanup of {box.id} failed: {e}")
    print(f"\nschemathesis ran {elapsed:.1f}s, created {len(leftovers)} live sandboxes "
          f"(deleted); unavailable backends: {unavailable}\n{out[-3000:]}")

    assert code == 0, f"schemathesis failed (exit {code}) in {elapsed:.0f}s:\n{out[-20000:]}"

    deadline = time.monotonic() + 30
    while True:
        after = count_leaks(server.data_dir)
        if all(after[k] <= before[k] for k in before) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(after[k] <= before[k] for k in before), f"leaked: before {before}, after {after}"
