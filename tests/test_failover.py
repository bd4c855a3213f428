"""Client fail-over across several server URLs, against a real `sandlot up`.

Cluster mode runs stateless `sandlot server` replicas; the SDK takes several URLs and
moves to the next when a connection fails. Here the "other replica" is a dead port or a
TCP relay in front of the real server that forwards a call and then drops the
connection before the answer, as a server killed after doing the work would.
"""

from __future__ import annotations

import socket
import threading
import uuid

import sandlot
from conftest import free_port


class AnswerDroppingRelay:
    """Relays each request to `upstream` (host, port), reads the whole answer, then closes
    the client's connection without sending it: the call ran, its answer is lost."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.relayed = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                req = self._read_request(conn)
                if req is None:
                    continue
                with socket.create_connection(("127.0.0.1", self.upstream_port)) as up:
                    up.sendall(req)
                    while up.recv(65536):
                        pass
                self.relayed += 1

    @staticmethod
    def _read_request(conn: socket.socket):
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            body += conn.recv(65536)
        # HTTP/1.1 to the server, one request per connection.
        return head + b"\r\nConnection: close\r\n\r\n" + body

    def close(self) -> None:
        self.sock.close()


def test_a_dead_first_server_is_skipped(server, python_image):
    c = sandlot.Client([f"http://127.0.0.1:{free_port()}", server.url], timeout=60)
    try:
        sb = c.create(image=python_image, memory_mib=128, ttl_s=120)
        try:
            assert c.url == server.url
            assert sb.exec("echo hi").stdout == b"hi\n"
        finally:
            sb.delete()
    finally:
        c.close()


def test_a_create_whose_answer_was_lost_is_not_made_twice(server, python_image):
    """The first server runs the create and dies before answering; the SDK resends with
    its own Idempotency-Key to the next server and gets the same sandbox."""
    relay = AnswerDroppingRelay(server.port)
    label = {"failover": uuid.uuid4().hex[:12]}
    c = sandlot.Client([relay.url, server.url], timeout=60, retries=0)
    try:
        sb = c.create(image=python_image, memory_mib=128, ttl_s=120, labels=label)
        try:
            assert relay.relayed == 1, "the first attempt reached the server"
            assert c.url == server.url and sb.state == "running"
            assert sb.reattached is False
            assert [s.id for s in c.list(labels=label)] == [sb.id]
        finally:
            sb.delete()
    finally:
        c.close()
        relay.close()
