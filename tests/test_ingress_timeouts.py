"""Ingress timeouts (issue 25; docs/api.md "Ports (ingress)", "Timeouts").

An app in a sandbox that accepts a connection and never answers used to hold that
connection (on runsc, microvm and vm one of the guest agent's 128 tunnel slots) and a
server task forever: the 129th such request on an agent backend got 429, and every one
hung its client. A private `sandlot up` runs here with `--ingress-response-timeout-s 2`
and `--ingress-idle-timeout-s 3`: each such request is answered 504 `deadline_exceeded`
after about 2 s and its connection into the sandbox is closed (the app counts its open
connections and reports them on a second port), so 192 of them in a row leave the
sandbox's ingress working; a quiet upgraded (WebSocket-like) connection is closed after
3 s. Runs on function, container-runc and container-runsc (each skipped with the reason
when the host cannot run it).
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

import sandlot
from conftest import Server, private_base, remove_private_base, wait_until
from conformance.test_ports import UPGRADE_ECHO, upgrade_head

RESPONSE_S = 2
IDLE_S = 3

#: Port 8005 accepts, reads and never answers; port 8006 answers the number of 8005's
#: connections still open.
SILENT_APP = r'''
import socket, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
open_conns = 0
lock = threading.Lock()
def hold(c):
    global open_conns
    try:
        while c.recv(65536):
            pass
    except OSError:
        pass
    c.close()
    with lock:
        open_conns -= 1
def silent():
    global open_conns
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 8005)); s.listen(256)
    while True:
        c, _ = s.accept()
        with lock:
            open_conns += 1
        threading.Thread(target=hold, args=(c,), daemon=True).start()
class Count(BaseHTTPRequestHandler):
    def do_GET(self):
        body = str(open_conns).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass
threading.Thread(target=silent, daemon=True).start()
ThreadingHTTPServer(("127.0.0.1", 8006), Count).serve_forever()
'''

CASES = [("function", {"backend": "function"}),
         ("container-runc", {"backend": "container", "runtime": "runc"}),
         ("container-runsc", {"backend": "container", "runtime": "runsc"})]


@pytest.fixture(scope="module")
def srv(binary, log_dir):
    import os
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root")
    base = private_base("sandlot-ingress-")
    s = Server(binary, base / "data", log_dir / "ingress-timeouts.log",
               args=["--warm-pool", "0", "--container-warm-pool", "0",
                     "--ingress-response-timeout-s", str(RESPONSE_S),
                     "--ingress-idle-timeout-s", str(IDLE_S)])
    s.start()
    try:
        yield s
        s.delete_all()
    finally:
        s.stop()
        remove_private_base(base)


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def box(request, srv):
    name, args = request.param
    with sandlot.Client(srv.url, timeout=120, retries=0) as c:
        try:
            sb = c.create(image="python", memory_mib=256, ttl_s=600, **args)
        except (sandlot.NotFound, sandlot.Unavailable, sandlot.InvalidArgument) as e:
            pytest.skip(f"{name}: cannot create a python sandbox here: {e}")
        try:
            yield sb
        finally:
            sb.delete()


def _open_count(base: str) -> int:
    r = httpx.get(f"{base}/8006/", timeout=30)
    assert r.status_code == 200, r.text
    return int(r.text)


def test_an_app_that_never_answers_gets_504_and_frees_its_connection(srv, box):
    base = f"{srv.url}/v1/sandboxes/{box.id}/ports"
    box.write_file("/tmp/silent.py", SILENT_APP.encode())
    app = box.spawn(["python3", "/tmp/silent.py"])
    try:
        wait_until(lambda: httpx.get(f"{base}/8006/", timeout=30).status_code == 200,
                   timeout=60, interval=0.2, what="the counting app in the sandbox")

        def call(i: int):
            t0 = time.monotonic()
            if i % 2:
                r = httpx.post(f"{base}/8005/up{i}", content=b"x" * 200_000, timeout=60)
            else:
                r = httpx.get(f"{base}/8005/get{i}", timeout=60)
            return r.status_code, r.text, time.monotonic() - t0

        # 3 x 64 at once: 192 in all, more than an agent's 128 tunnel slots.
        for _ in range(3):
            with ThreadPoolExecutor(64) as ex:
                answers = list(ex.map(call, range(64)))
            for status, text, took in answers:
                assert status == 504, text
                assert '"deadline_exceeded"' in text, text
                assert RESPONSE_S - 0.1 <= took < RESPONSE_S + 8, took
            wait_until(lambda: _open_count(base) == 0, timeout=10, interval=0.2,
                       what="the app's connections closed")
        # The sandbox's ingress still works.
        assert _open_count(base) == 0
    finally:
        app.kill()


def test_a_quiet_upgraded_connection_is_closed_after_the_idle_timeout(srv, box):
    box.write_file("/tmp/echo.py", UPGRADE_ECHO.encode())
    echo = box.spawn(["python3", "/tmp/echo.py"])
    u = urlparse(srv.url)

    def upgraded():
        s = socket.create_connection((u.hostname, u.port), timeout=30)
        head, _ = upgrade_head(s, f"/v1/sandboxes/{box.id}/ports/8002/ws", u.netloc)
        if not head.startswith(b"HTTP/1.1 101"):
            s.close()
            return None
        return s

    try:
        held = []

        def ready() -> bool:
            s = upgraded()
            if s is not None:
                held.append(s)
            return s is not None
        wait_until(ready, timeout=60, interval=0.3, what="the upgrade echo server")
        s = held[0]
        # Traffic keeps it open past the idle timeout...
        for i in range(3):
            if i:
                time.sleep(IDLE_S / 2)
            s.sendall(b"ping")
            assert s.recv(16) == b"ping"
        # ...quiet, it is closed after it (counted from the last byte).
        t0 = time.monotonic()
        s.settimeout(IDLE_S + 20)
        assert s.recv(16) == b""
        took = time.monotonic() - t0
        assert IDLE_S - 0.5 <= took < IDLE_S + 10, took
        s.close()
    finally:
        echo.kill()
