"""Errors, identical on every backend: each bad request is a clear error with a stable code
(`{"error": {"code", "message"}}`), and the sandbox stays usable. Requests the server refuses
before any backend sees them (unknown fields, invalid JSON bodies of create and run_code,
unknown routes) are in tests/test_bad_input.py."""

from __future__ import annotations

import json

import httpx
import pytest

import sandlot
from conftest import assert_error


@pytest.fixture
def raw(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        yield h


def test_unknown_image_is_not_found(client, backend):
    with pytest.raises(sandlot.NotFound) as e:
        client.create(image="no-such-image-xyz", **backend.create_args())
    assert "no-such-image-xyz" in e.value.message and e.value.status == 404


@pytest.mark.parametrize("field,value", [
    ("memory_mib", 1), ("memory_mib", 10 ** 9), ("pids_max", 1), ("cpu", 0),
    ("cpu", -1), ("ttl_s", 10 ** 9), ("memory_mib", "lots"),
])
def test_create_out_of_range(raw, backend, field, value):
    body = {**backend.create_args(), field: value}
    err = assert_error(raw.post("/v1/sandboxes", json=body), "invalid_argument")
    assert field in err["message"] or str(value) in err["message"], err


@pytest.mark.parametrize("timeout", [-1, 0, 10 ** 9, float("inf")])
def test_bad_exec_timeout(sb, raw, timeout):
    if timeout == float("inf"):
        # JSON has no infinity; send the nearest thing a buggy client would.
        resp = raw.post(f"/v1/sandboxes/{sb.id}/exec",
                        content=b'{"cmd": "true", "timeout_s": 1e999}',
                        headers={"content-type": "application/json"})
        assert_error(resp, "invalid_argument")
        return
    with pytest.raises(sandlot.InvalidArgument) as e:
        sb.exec("true", timeout_s=timeout)
    assert "timeout" in e.value.message


def test_bad_exec_requests(sb, raw):
    path = f"/v1/sandboxes/{sb.id}/exec"
    assert_error(raw.post(path, json={"cmd": []}), "invalid_argument")
    assert_error(raw.post(path, json={"cmd": "true", "stdin_b64": "!!notb64"}),
                 "invalid_argument")
    assert_error(raw.post(path, json={"cmd": 5}), "invalid_argument")
    assert_error(raw.post(path, content=b'{"cmd": ',
                          headers={"content-type": "application/json"}), "invalid_argument")
    assert sb.exec("echo still-fine").stdout == b"still-fine\n"


def test_oversize_exec_body_is_413(sb, raw):
    # The JSON body limit is 16 MiB (ServerConfig::max_json_bytes); 17 MiB of stdin.
    body = json.dumps({"cmd": "cat", "stdin_b64": "A" * (17 << 20)}).encode()
    assert_error(raw.post(f"/v1/sandboxes/{sb.id}/exec", content=body,
                          headers={"content-type": "application/json"}),
                 "payload_too_large")


def test_standard_dirs_and_dev_null_cannot_be_replaced_or_removed(sb):
    """The files API refuses to replace or remove /dev/null and to remove the sandbox's
    standard directories; afterwards all of them still work."""
    for call in (lambda: sb.write_file("/dev/null", b"x"), lambda: sb.remove("/dev/null")):
        with pytest.raises(sandlot.InvalidArgument):
            call()
    for d in ("/workspace", "/tmp", "/dev", "/workspace/../tmp"):
        with pytest.raises(sandlot.InvalidArgument):
            sb.remove(d)
    r = sb.exec("test -d /workspace && test -d /tmp && test -c /dev/null && "
                "echo gone > /dev/null && cat /dev/null | wc -c")
    assert r.exit_code == 0 and r.stdout.strip() == b"0", r
