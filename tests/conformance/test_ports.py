"""Ingress (issue 26 item 4, docs/api.md "Ports"): `/v1/sandboxes/{id}/ports/{port}/…` reaches
a server listening on the sandbox's own loopback, with no network given to the sandbox, on
every backend — function and runc through the sandbox's network namespace, runsc, microvm
and vm through the guest agent's tunnel (`POST /v1/connect`, agent_proto.rs)."""

from __future__ import annotations

import hashlib
import os
import socket
from urllib.parse import urlparse

import httpx

from conftest import wait_until

#: A raw `Upgrade` echo server (what a WebSocket server does, minus the framing) on 8002.
UPGRADE_ECHO = r'''
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8002)); s.listen(8)
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(4096)
    assert b"upgrade: echo" in head.lower(), head
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
    while True:
        d = c.recv(65536)
        if not d:
            break
        c.sendall(d)
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''


def upgrade_head(s: socket.socket, path: str, host: str) -> tuple[bytes, bytes]:
    """Sends `GET path` asking to upgrade to `echo` (Host: `host`) on the connected socket
    `s` and reads the response head: (head, bytes already read after it)."""
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
              "Connection: Upgrade\r\nUpgrade: echo\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        d = s.recv(4096)
        if not d:
            break
        head += d
    head, _, rest = head.partition(b"\r\n\r\n")
    return head, rest


def upgrade_echo(s: socket.socket, path: str, host: str, msgs: tuple[bytes, ...]) -> bool:
    """One upgraded connection on `s` ([`upgrade_head`]): False while nothing listens
    (502), else asserts that each of `msgs` comes back, in order."""
    head, rest = upgrade_head(s, path, host)
    if head.startswith(b"HTTP/1.1 502"):
        return False
    assert head.startswith(b"HTTP/1.1 101"), head
    for msg in msgs:
        s.sendall(msg)
        back = rest
        while len(back) < len(msg):
            d = s.recv(65536)
            assert d, "connection closed before the echo came back"
            back += d
        rest = b""
        assert back == msg
    return True


def _upgrade_echo(url: str, sandbox_id: str) -> bool:
    """One upgraded connection through ingress to port 8002, small and large messages."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        return upgrade_echo(s, f"/v1/sandboxes/{sandbox_id}/ports/8002/ws", u.netloc,
                            (b"ping\n", os.urandom(300_000)))


def test_ingress_reaches_a_server_on_the_sandbox_loopback(sb, server):
    base = f"{server.url}/v1/sandboxes/{sb.id}/ports"
    # Nothing listens on 8001: 502 `unavailable`, whatever carries the connection.
    r = httpx.get(f"{base}/8001/", timeout=30)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "unavailable"
    assert "nothing listens on port 8001" in r.json()["error"]["message"]

    big = os.urandom(3 * 1024 * 1024)  # past every window and pipe buffer on the way
    sb.write_file("/tmp/site/hello.txt", b"hello through ingress\n")
    sb.write_file("/tmp/site/a b?c.txt", b"escaped\n")
    sb.write_file("/tmp/site/big.bin", big)
    web = sb.spawn("cd /tmp/site && exec python3 -m http.server 8000 --bind 127.0.0.1")
    echo = None
    try:
        got = {}

        def served() -> bool:
            got["r"] = httpx.get(f"{base}/8000/hello.txt", timeout=30)
            return got["r"].status_code != 502
        wait_until(served, timeout=60, interval=0.2, what="http.server in the sandbox")
        assert got["r"].status_code == 200, got["r"].text
        assert got["r"].text == "hello through ingress\n"
        # The path reaches the app as sent, percent-escapes and all.
        r = httpx.get(f"{base}/8000/a%20b%3Fc.txt", timeout=30)
        assert (r.status_code, r.text) == (200, "escaped\n")
        r = httpx.get(f"{base}/8000/big.bin", timeout=60)
        assert r.status_code == 200
        assert hashlib.sha256(r.content).hexdigest() == hashlib.sha256(big).hexdigest()

        sb.write_file("/tmp/echo.py", UPGRADE_ECHO.encode())
        echo = sb.spawn(["python3", "/tmp/echo.py"])
        wait_until(lambda: _upgrade_echo(server.url, sb.id), timeout=60, interval=0.2,
                   what="the upgrade echo server in the sandbox")
    finally:
        web.kill()
        if echo is not None:
            echo.kill()
        sb.exec("rm -rf /tmp/site /tmp/echo.py")
