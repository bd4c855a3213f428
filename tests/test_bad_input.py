"""Bad input: each answer is a clear error with a stable code, and nothing is left behind
(host resources are counted before and after every test of this file)."""

from __future__ import annotations

import json

import httpx
import pytest

import sandlot
from conftest import count_leaks

ERROR_STATUS = {"invalid_argument": 400, "not_found": 404, "payload_too_large": 413}


@pytest.fixture(autouse=True)
def no_leaks(server, python_image):
    before = count_leaks(server.data_dir)
    yield
    import time
    deadline = time.monotonic() + 15
    while True:
        after = count_leaks(server.data_dir)
        if all(after[k] <= before[k] for k in before) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(after[k] <= before[k] for k in before), f"leaked: before {before}, after {after}"


@pytest.fixture
def raw(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        yield h


def assert_error(resp: httpx.Response, code: str) -> dict:
    """The answer is `{"error": {"code": code, "message": non-empty}}` with code's status."""
    assert resp.status_code == ERROR_STATUS[code], (resp.status_code, resp.text[:300])
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert err["code"] == code and err["message"], err
    return err


def test_unknown_backend(client, raw):
    with pytest.raises(sandlot.InvalidArgument) as e:
        client.create(backend="teleport")
    assert "teleport" in e.value.message
    assert_error(raw.post("/v1/sandboxes", json={"backend": "teleport"}), "invalid_argument")


def test_unknown_image(client):
    with pytest.raises(sandlot.NotFound) as e:
        client.create(image="no-such-image-xyz")
    assert "no-such-image-xyz" in e.value.message and e.value.status == 404


@pytest.mark.parametrize("field,value", [
    ("memory_mib", 1), ("memory_mib", 10 ** 9), ("pids_max", 1), ("cpu", 0),
    ("cpu", -1), ("ttl_s", 10 ** 9), ("memory_mib", "lots"),
])
def test_create_out_of_range(raw, field, value):
    err = assert_error(raw.post("/v1/sandboxes", json={field: value}), "invalid_argument")
    assert field in err["message"] or str(value) in err["message"], err


def test_unknown_field_refused(raw):
    assert_error(raw.post("/v1/sandboxes", json={"memroy_mib": 64}), "invalid_argument")


def test_invalid_json(raw, sb):
    assert_error(raw.post("/v1/sandboxes", content=b"{not json",
                          headers={"content-type": "application/json"}), "invalid_argument")
    assert_error(raw.post(f"/v1/sandboxes/{sb.id}/exec", content=b'{"cmd": ',
                          headers={"content-type": "application/json"}), "invalid_argument")
    assert_error(raw.post("/run_code", content=b"[1,2",
                          headers={"content-type": "application/json"}), "invalid_argument")


@pytest.mark.parametrize("timeout", [-1, 0, 10 ** 9, float("inf")])
def test_bad_exec_timeout(sb, raw, timeout):
    if timeout == float("inf"):
        # JSON has no infinity; send the nearest thing a buggy client would.
        resp = raw.post(f"/v1/sandboxes/{sb.id}/exec",
                        content=b'{"cmd": "true", "timeout_s": 1e999}',
                        headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_argument"
        return
    with pytest.raises(sandlot.InvalidArgument) as e:
        sb.exec("true", timeout_s=timeout)
    assert "timeout" in e.value.message


@pytest.mark.parametrize("run_timeout", [-1, 10 ** 9])
def test_bad_run_code_timeout(client, run_timeout):
    with pytest.raises(sandlot.InvalidArgument):
        client.run_code("print(1)", run_timeout=run_timeout)


def test_unknown_language(client, raw):
    with pytest.raises(sandlot.InvalidArgument):
        client.run_code("print(1)", language="klingon")
    assert_error(raw.post("/run_code", json={"code": "1", "language": "klingon"}),
                 "invalid_argument")


def test_oversize_json_body_is_413(sb, raw, client):
    # The JSON body limit is 16 MiB (ServerConfig::max_json_bytes); 17 MiB of stdin.
    body = json.dumps({"cmd": "cat", "stdin_b64": "A" * (17 << 20)}).encode()
    assert_error(raw.post(f"/v1/sandboxes/{sb.id}/exec", content=body,
                          headers={"content-type": "application/json"}),
                 "payload_too_large")
    with pytest.raises(sandlot.PayloadTooLarge):
        client.run_code("x = 1\n" * (3 << 20))  # an 18 MiB program


def test_unknown_routes_and_ids(raw, client):
    assert_error(raw.get("/v1/no-such-route"), "not_found")
    with pytest.raises(sandlot.NotFound):
        client.get("sb-00000000000000000000")
    with pytest.raises((sandlot.NotFound, sandlot.InvalidArgument)):
        client.get("../../etc")
    assert_error(raw.post("/v1/sandboxes/sb-00000000000000000000/exec", json={"cmd": "true"}),
                 "not_found")


def test_bad_exec_requests(sb, raw):
    assert_error(raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": []}), "invalid_argument")
    assert_error(raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "true",
                                                               "stdin_b64": "!!notb64"}),
                 "invalid_argument")
    assert_error(raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": 5}), "invalid_argument")
