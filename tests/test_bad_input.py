"""Bad input the server refuses before any backend sees it: each answer is a clear error with
a stable code, and nothing is left behind (host resources are counted before and after
every test of this file). Errors that involve a backend's sandbox (unknown image, limits out
of range, bad exec requests) run on every backend in conformance/test_errors.py."""

from __future__ import annotations

import httpx
import pytest

import sandlot
from conftest import assert_error, count_leaks, wait_no_leaks


@pytest.fixture(autouse=True)
def no_leaks(server):
    before = count_leaks(server.data_dir)
    yield
    wait_no_leaks(server.data_dir, before, 15)


@pytest.fixture
def raw(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        yield h


def test_unknown_backend(client, raw):
    with pytest.raises(sandlot.InvalidArgument) as e:
        client.create(backend="teleport")
    assert "teleport" in e.value.message
    assert_error(raw.post("/v1/sandboxes", json={"backend": "teleport"}), "invalid_argument")


def test_unknown_field_refused(raw):
    assert_error(raw.post("/v1/sandboxes", json={"memroy_mib": 64}), "invalid_argument")


def test_invalid_json(raw):
    assert_error(raw.post("/v1/sandboxes", content=b"{not json",
                          headers={"content-type": "application/json"}), "invalid_argument")
    assert_error(raw.post("/run_code", content=b"[1,2",
                          headers={"content-type": "application/json"}), "invalid_argument")


@pytest.mark.parametrize("run_timeout", [-1, 10 ** 9])
def test_bad_run_code_timeout(client, run_timeout):
    with pytest.raises(sandlot.InvalidArgument):
        client.run_code("print(1)", run_timeout=run_timeout)


def test_unknown_language(client, raw):
    with pytest.raises(sandlot.InvalidArgument):
        client.run_code("print(1)", language="klingon")
    assert_error(raw.post("/run_code", json={"code": "1", "language": "klingon"}),
                 "invalid_argument")


def test_oversize_run_code_is_413(client):
    # The JSON body limit is 16 MiB (ServerConfig::max_json_bytes); an 18 MiB program.
    with pytest.raises(sandlot.PayloadTooLarge):
        client.run_code("x = 1\n" * (3 << 20))


def test_unknown_routes_and_ids(raw, client):
    assert_error(raw.get("/v1/no-such-route"), "not_found")
    with pytest.raises(sandlot.NotFound):
        client.get("sb-00000000000000000000")
    with pytest.raises((sandlot.NotFound, sandlot.InvalidArgument)):
        client.get("../../etc")
    assert_error(raw.post("/v1/sandboxes/sb-00000000000000000000/exec", json={"cmd": "true"}),
                 "not_found")
