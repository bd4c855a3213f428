"""Unit tests of the SDK's pure logic (wire parsing, error mapping, request shapes).

These need no server: the HTTP layer is a named fake (`FakeServer`, an httpx.MockTransport
handler) that records requests and answers canned JSON in the wire shapes of
crates/sandlot-api. Everything end-to-end lives in the other test files.
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

import sandlot
from sandlot.errors import error_from_response
from sandlot.models import parse_exec_event

SB = {"id": "sb-0123456789abcdef0123", "backend": "function", "image": "python",
      "state": "running", "node": "n1", "created_at": "2026-01-01T00:00:00Z",
      "expires_at": None, "cpu": 1.0, "memory_mib": 512, "disk_mib": 1024, "pids_max": 256,
      "ttl_s": 0, "labels": {"a": "b"}, "network": "none", "trajectory": None}


class FakeServer:
    """Fake HTTP layer for unit tests only: records requests, replies from `routes`."""

    def __init__(self, routes):
        self.routes = routes
        self.requests = []

    def __call__(self, req: httpx.Request) -> httpx.Response:
        self.requests.append(req)
        return self.routes(req)


def fake_client(routes, **kw) -> tuple:
    fake = FakeServer(routes)
    c = sandlot.Client("http://fake", **kw)
    c._http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(fake))
    return c, fake


def test_error_body_maps_to_class_and_fields():
    e = error_from_response(404, b'{"error":{"code":"not_found","message":"no sb-1"}}', {})
    assert isinstance(e, sandlot.NotFound) and e.code == "not_found"
    assert e.message == "no sb-1" and e.status == 404
    e = error_from_response(429, b'{"error":{"code":"resource_exhausted","message":"busy"}}',
                            {"retry-after": "2"})
    assert isinstance(e, sandlot.ResourceExhausted) and e.retry_after == 2.0
    # A body that is not the API's shape falls back on the status.
    e = error_from_response(413, b"length limit exceeded", {})
    assert isinstance(e, sandlot.PayloadTooLarge) and "length limit" in e.message
    e = error_from_response(502, b"", {})
    assert isinstance(e, sandlot.InternalError)
    # An unknown code stays visible.
    e = error_from_response(400, b'{"error":{"code":"brand_new","message":"m"}}', {})
    assert isinstance(e, sandlot.InvalidArgument) and e.code == "brand_new"


def test_every_wire_code_has_a_class():
    codes = ["invalid_argument", "not_found", "conflict", "resource_exhausted",
             "deadline_exceeded", "unavailable", "permission_denied", "unauthenticated",
             "payload_too_large", "internal"]
    for code in codes:
        body = json.dumps({"error": {"code": code, "message": "x"}}).encode()
        e = error_from_response(400, body, {})
        assert e.code == code and type(e) is not sandlot.SandlotError


def test_exec_result_prefers_exact_b64_bytes():
    raw = b"\xff\xfe ok \x80"
    r = sandlot.ExecResult.from_json({
        "exit_code": 3, "signal": None, "timed_out": False, "oom_killed": False,
        "duration_ms": 1.5, "stdout": raw.decode("utf-8", "replace"),
        "stdout_b64": base64.b64encode(raw).decode(), "stderr": "é\n", "stdout_bytes": 7,
        "stderr_bytes": 3, "truncated": False, "replayed": False})
    assert r.stdout == raw and r.stderr == "é\n".encode() and r.stderr_text == "é\n"
    assert r.exit_code == 3 and not r.ok and r.stdout_bytes == 7


def test_stream_events_parse_and_error_event_raises():
    assert parse_exec_event('{"type":"stdout","data":"hi"}') == sandlot.StdoutChunk(b"hi")
    ev = parse_exec_event('{"type":"stderr","data":"?","data_b64":"/w=="}')
    assert ev == sandlot.StderrChunk(b"\xff")
    ev = parse_exec_event('{"type":"exit","result":{"exit_code":0,"duration_ms":1,'
                          '"stdout":"","stderr":"","stdout_bytes":2,"stderr_bytes":0,'
                          '"timed_out":false,"oom_killed":false,"truncated":false,'
                          '"replayed":false,"signal":null}}')
    assert isinstance(ev, sandlot.ExecResult) and ev.stdout_bytes == 2
    with pytest.raises(sandlot.Unavailable):
        parse_exec_event('{"type":"error","error":{"code":"unavailable","message":"gone"}}')
    with pytest.raises(sandlot.ProtocolError):
        parse_exec_event("not json")


def test_list_follows_pages_until_no_token():
    # Fake transport (unit test of the SDK's paging only): three pages, the last without
    # a token; every call carries limit and, after the first, the previous token.
    pages = {None: (["sb-1", "sb-2"], "t1"), "t1": (["sb-3", "sb-4"], "t2"), "t2": (["sb-5"], None)}

    def routes(req):
        token = req.url.params.get("page_token")
        ids, nxt = pages[token]
        body = {"sandboxes": [{**SB, "id": i} for i in ids]}
        if nxt:
            body["next_page_token"] = nxt
        return httpx.Response(200, json=body)

    c, fake = fake_client(routes)
    assert [s.id for s in c.list(labels={"job": "j"})] == ["sb-1", "sb-2", "sb-3", "sb-4", "sb-5"]
    assert [r.url.params.get("page_token") for r in fake.requests] == [None, "t1", "t2"]
    assert all(r.url.params["limit"] == "1000" and r.url.params["label"] == "job=j"
               for r in fake.requests)

    def bad(req):
        return httpx.Response(200, json={"sandboxes": [], "next_page_token": 7})

    c, _ = fake_client(bad)
    with pytest.raises(sandlot.ProtocolError):
        c.list()


def test_request_shapes_match_the_wire_types():
    def routes(req):
        if req.url.path == "/v1/sandboxes" and req.method == "POST":
            return httpx.Response(201, json=SB)
        if req.url.path.endswith("/exec"):
            return httpx.Response(200, json={"exit_code": 0, "duration_ms": 1, "stdout": "",
                                             "stderr": "", "stdout_bytes": 0,
                                             "stderr_bytes": 0, "truncated": False,
                                             "replayed": False, "timed_out": False,
                                             "oom_killed": False, "signal": None})
        if req.url.path == "/run_code":
            return httpx.Response(200, json={"status": "Success", "message": "",
                                             "compile_result": None, "run_result": None,
                                             "executor_pod_name": "n1",
                                             "files": {"o.txt": "aGk="}})
        if req.url.path == "/v1/sandboxes":
            return httpx.Response(200, json={"sandboxes": [SB]})
        return httpx.Response(204)

    c, fake = fake_client(routes)
    sb = c.create(memory_mib=64, labels={"k": "v"}, idempotency_key="key-1")
    assert sb.id == SB["id"] and sb.labels == {"a": "b"} and sb.state == "running"
    create = fake.requests[-1]
    assert json.loads(create.content) == {"backend": "function", "image": "python",
                                          "memory_mib": 64, "labels": {"k": "v"}}
    assert create.headers["idempotency-key"] == "key-1"
    sb.exec(["cat"], stdin=b"\x00\xff", timeout_s=2.5, env={"A": "1"})
    body = json.loads(fake.requests[-1].content)
    assert body == {"cmd": ["cat"], "env": {"A": "1"}, "stdin_b64": "AP8=", "timeout_s": 2.5}
    sb.exec("echo hi")
    assert json.loads(fake.requests[-1].content) == {"cmd": "echo hi"}
    sb.write_file("dir with space/ü.txt", "x")
    put = fake.requests[-1]
    assert put.method == "PUT" and put.url.params["path"] == "dir with space/ü.txt"
    res = c.run_code("print(1)", files={"in.txt": b"\x01"}, fetch_files=["o.txt"])
    body = json.loads(fake.requests[-1].content)
    assert body["memory_limit_MB"] == -1 and body["files"] == {"in.txt": "AQ=="}
    assert res.success and res.files == {"o.txt": b"hi"}
    assert [s.id for s in c.list(labels={"a": "b", "c": "d"})] == [SB["id"]]
    assert fake.requests[-1].url.params.get_list("label") == ["a=b", "c=d"]


def test_create_runtime_and_network_fields():
    """`runtime` and `network` go on the wire as given; unset, they are left out (a server
    that predates them still accepts the body); the Sandbox reports `runtime` when the
    server returns it, else None."""
    answer = dict(SB, backend="container", runtime="runsc",
                  network={"allow": ["10.1.2.0/24", "pypi.example"]})
    c, fake = fake_client(lambda req: httpx.Response(201, json=answer))
    sb = c.create(backend="container", runtime="runsc",
                  network={"allow": ("10.1.2.0/24", "pypi.example")})
    assert json.loads(fake.requests[-1].content) == {
        "backend": "container", "image": "python", "runtime": "runsc",
        "network": {"allow": ["10.1.2.0/24", "pypi.example"]}}
    assert sb.runtime == "runsc" and sb.network == {"allow": ["10.1.2.0/24", "pypi.example"]}
    c.create(network="none")
    assert json.loads(fake.requests[-1].content) == {"backend": "function", "image": "python",
                                                     "network": "none"}
    c.create()
    body = json.loads(fake.requests[-1].content)
    assert "runtime" not in body and "network" not in body
    c, _ = fake_client(lambda req: httpx.Response(201, json=SB))
    assert c.create().runtime is None  # a server that does not report it
    for bad in ({"allow": "10.0.0.1"}, {"allow": [1]}, {"deny": []}, ["10.0.0.1"], 5):
        with pytest.raises(TypeError):
            c.create(network=bad)
    with pytest.raises(TypeError):
        c.create(runtime=1)

    async def main():
        fake = FakeServer(lambda req: httpx.Response(201, json=answer))
        ac = sandlot.AsyncClient("http://fake")
        ac._http = httpx.AsyncClient(base_url="http://fake", transport=httpx.MockTransport(fake))
        box = await ac.create(backend="container", runtime="runc", network="none")
        assert json.loads(fake.requests[-1].content) == {
            "backend": "container", "image": "python", "runtime": "runc", "network": "none"}
        assert box.runtime == "runsc"  # what the server answered
        await ac.aclose()

    asyncio.run(main())


def test_429_is_retried_after_retry_after():
    calls = []

    def routes(req):
        calls.append(1)
        if len(calls) < 3:
            return httpx.Response(429, headers={"Retry-After": "0"},
                                  json={"error": {"code": "resource_exhausted", "message": "b"}})
        return httpx.Response(200, json={"status": "Success", "message": "", "files": {}})

    c, _ = fake_client(routes, retries=3)
    assert c.run_code("print(1)").success and len(calls) == 3
    c, _ = fake_client(routes, retries=0)
    calls.clear()
    with pytest.raises(sandlot.ResourceExhausted):
        c.run_code("x")


def test_transport_error_when_nothing_listens():
    with socket_closed_port() as port:
        c = sandlot.Client(f"http://127.0.0.1:{port}", timeout=2, retries=1)
        with pytest.raises(sandlot.TransportError):
            c.ping()


def test_async_client_mirrors_sync():
    async def main():
        fake = FakeServer(lambda req: httpx.Response(201, json=SB) if req.method == "POST"
                          else httpx.Response(404, json={"error": {"code": "not_found",
                                                                   "message": "gone"}}))
        c = sandlot.AsyncClient("http://fake")
        c._http = httpx.AsyncClient(base_url="http://fake", transport=httpx.MockTransport(fake))
        sb = await c.create()
        assert isinstance(sb, sandlot.AsyncSandbox) and sb.id == SB["id"]
        with pytest.raises(sandlot.NotFound):
            await sb.refresh()
        await c.aclose()

    asyncio.run(main())


class socket_closed_port:
    """A port number that nothing listens on (bound then closed)."""

    def __enter__(self):
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False


def test_stale_keepalive_connection_is_retried_only_for_idempotent_methods():
    """A server that closed a kept-alive connection before answering (as after a 413 on
    that connection) costs an idempotent call one retry; a POST is never re-sent."""
    calls = {"DELETE": 0, "POST": 0}

    def routes(req):
        calls[req.method] += 1
        if calls[req.method] == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(204)

    client, _fake = fake_client(routes)
    client.delete(SB["id"])
    assert calls["DELETE"] == 2
    with pytest.raises(sandlot.TransportError):
        client._request("POST", "/v1/sandboxes/x/exec", json={"cmd": "true"})
    assert calls["POST"] == 1


def test_create_body_with_and_without_checkpoint():
    from sandlot.models import Checkpoint, create_body
    args = (None, None, None, None, None, None, None, None)
    assert create_body(*args[:2], *args[2:], None) == {"backend": "function", "image": "python"}
    ck = Checkpoint.from_json({"checkpoint_id": "ck-0123456789abcdef0123", "sandbox_id": SB["id"],
                               "backend": "container", "image": "python", "runtime": "runsc",
                               "disk_mib": 64, "size_bytes": 4096,
                               "created_at": "2026-01-01T00:00:00Z"})
    # With a checkpoint, backend and image are left to the checkpoint unless given.
    assert create_body(*args, None, checkpoint=ck) == {"checkpoint": ck.id}
    assert create_body("container", None, *args[2:], None, checkpoint=ck.id) == {
        "checkpoint": ck.id, "backend": "container"}
    with pytest.raises(TypeError):
        create_body(*args, None, checkpoint=5)
    with pytest.raises(sandlot.ProtocolError):
        Checkpoint.from_json({"checkpoint_id": "x"})


def test_run_jupyter_and_languages_shapes_sync_and_async():
    png = base64.b64encode(b"\x89PNG").decode()
    wire = {"status": "Success", "message": "", "executor_pod_name": "n1",
            "driver": {"status": "Finished", "execution_time": 1.5, "return_code": 0,
                       "stdout": "", "stderr": ""},
            "cells": [{"stdout": "1\n", "stderr": "", "display": [{"image/png": png}],
                       "error": [{"ename": "E", "evalue": "v", "traceback": ["t"]}]}],
            "files": {"out.txt": base64.b64encode(b"x").decode()}}
    langs = {"languages": [{"language": "java", "aliases": [], "image": "lang-java",
                            "file": "Main.java", "compile": ["javac", "Main.java"],
                            "run": ["java", "Main"], "env": {}, "layout": "program",
                            "memory_mib": 1024, "installed": False}]}

    def routes(req):
        return httpx.Response(200, json=wire if req.url.path == "/run_jupyter" else langs)

    c, fake = fake_client(routes)
    r = c.run_jupyter(["print(1)"], cell_timeout=2, files={"in.txt": b"a"},
                      fetch_files=["out.txt"])
    body = json.loads(fake.requests[0].content)
    assert body == {"cells": ["print(1)"], "cell_timeout": 2, "total_timeout": 45,
                    "memory_limit_MB": -1, "kernel": "python3",
                    "files": {"in.txt": base64.b64encode(b"a").decode()},
                    "fetch_files": ["out.txt"]}
    assert r.success and r.driver.return_code == 0 and r.files == {"out.txt": b"x"}
    assert r.cells[0] == sandlot.JupyterCell(stdout="1\n", display=[{"image/png": png}],
                                             error=[{"ename": "E", "evalue": "v",
                                                     "traceback": ["t"]}])
    [java] = c.run_code_languages()
    assert java.compile == ["javac", "Main.java"] and not java.installed
    with pytest.raises(TypeError):
        c.run_jupyter("print(1)")

    async def main():
        a = sandlot.AsyncClient("http://fake")
        a._http = httpx.AsyncClient(base_url="http://fake",
                                    transport=httpx.MockTransport(FakeServer(routes)))
        ar = await a.run_jupyter(["print(1)"])
        assert ar == r
        assert [l.language for l in await a.run_code_languages()] == ["java"]
        await a.aclose()

    asyncio.run(main())


def test_several_urls_fail_over_to_the_next_server():
    """A server whose connection fails is left for the next one, at once and for the
    following calls; a comma-separated string is the same as a list."""
    seen = []

    def routes(req):
        seen.append(req.url.host)
        if req.url.host == "a":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, text="pong")

    for urls in (["http://a", "http://b/"], "http://a, http://b"):
        seen.clear()
        c = sandlot.Client(urls, retries=0)
        assert c.urls == ["http://a", "http://b"] and c.url == "http://a"
        c._http = httpx.Client(base_url=c.url, transport=httpx.MockTransport(FakeServer(routes)))
        assert c.ping() and c.ping()
        assert seen == ["a", "b", "b"] and c.url == "http://b"
    with pytest.raises(ValueError):
        sandlot.Client(" , ")


def test_every_server_down_is_one_transport_error_after_the_retries():
    calls = []

    def routes(req):
        calls.append(req.url.host)
        raise httpx.ConnectError("connection refused")

    c = sandlot.Client(["http://a", "http://b"], retries=1)
    c._http = httpx.Client(base_url=c.url, transport=httpx.MockTransport(FakeServer(routes)))
    with pytest.raises(sandlot.TransportError):
        c.ping()
    # Both servers, a pause, both again.
    assert calls == ["a", "b", "a", "b"]


def test_a_replayed_create_that_gets_rolled_back_is_sent_again():
    """A create answered as the replay of a half-done create (`creating`, another server
    died during it) that the leader then rolls back (`deleting`, then gone) is sent again
    with the same key, and returns the new sandbox instead of a dead handle; rolled back on
    every attempt -> Unavailable. Sync and async."""
    def script(states, replays=1):
        """POST answers: `replays` × 200 `creating`, then 201 running; GET answers
        `states` in order (a state, or 404)."""
        posts, gets = [], list(states)

        def routes(req):
            if req.method == "POST":
                posts.append(req.headers.get("idempotency-key"))
                if len(posts) <= replays:
                    return httpx.Response(200, json={**SB, "state": "creating"})
                return httpx.Response(201, json={**SB, "id": "sb-new0000000000000000"})
            st = gets.pop(0)
            if st == 404:
                return httpx.Response(404, json={"error": {"code": "not_found",
                                                           "message": "gone"}})
            return httpx.Response(200, json={**SB, "state": st})
        return routes, posts

    for states in (["deleting"], [404], ["creating", "lost"]):
        routes, posts = script(states)
        c, _ = fake_client(routes)
        sb = c.create()
        assert (sb.id, sb.state) == ("sb-new0000000000000000", "running"), states
        assert len(posts) == 2 and posts[0] == posts[1] and posts[0].startswith("sdk-")

    routes, posts = script(["deleting"] * 3, replays=3)
    c, _ = fake_client(routes)
    with pytest.raises(sandlot.Unavailable, match="rolled back 3 times"):
        c.create(idempotency_key="k")
    assert posts == ["k"] * 3

    async def main():
        routes, posts = script([404])
        a = sandlot.AsyncClient("http://fake")
        a._http = httpx.AsyncClient(base_url="http://fake",
                                    transport=httpx.MockTransport(FakeServer(routes)))
        sb = await a.create()
        assert (sb.id, sb.state, len(posts)) == ("sb-new0000000000000000", "running", 2)
        await a.aclose()

    asyncio.run(main())


def test_create_carries_its_own_idempotency_key_and_is_resent_after_a_broken_answer():
    """A create without a caller's key gets the SDK's own; a connection that breaks before
    the answer (server killed mid-create) sends the same key again, to the next server.
    An exec (a POST without a key) is never re-sent."""
    keys = []

    def routes(req):
        if req.method == "POST" and req.url.path == "/v1/sandboxes":
            keys.append((req.url.host, req.headers.get("idempotency-key")))
            if req.url.host == "a":
                raise httpx.ReadError("connection reset by peer")
            return httpx.Response(200, json=SB)
        raise httpx.ReadError("connection reset by peer")

    c = sandlot.Client(["http://a", "http://b"], retries=0)
    c._http = httpx.Client(base_url=c.url, transport=httpx.MockTransport(FakeServer(routes)))
    sb = c.create()
    assert [h for h, _ in keys] == ["a", "b"]
    assert keys[0][1] == keys[1][1] and keys[0][1].startswith("sdk-")
    # A 200 replay of the SDK's own key is this call's retry, not a reattach.
    assert sb.id == SB["id"] and sb.reattached is False
    keys.clear()
    c.create(idempotency_key="mine")
    assert keys == [("b", "mine")]
    keys.clear()
    c.create(trajectory="t1")
    assert keys == [("b", None)]
    with pytest.raises(sandlot.TransportError):
        c._request("POST", "/v1/sandboxes/x/exec", json={"cmd": "true"})
