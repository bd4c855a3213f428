"""`sandlot server` in front of a `sandlot node` in another process (cluster mode's first
cut: one node over the node API, docs/operations.md "Cluster mode"): the public API works
through the node API, and a node that goes away answers 503 without losing sandboxes."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import sandlot
from conftest import IMAGES_DIR, Server, free_port, private_base, remove_private_base


class Node:
    """One `sandlot node` process (its own data directory, a token file)."""

    def __init__(self, binary: Path, base: Path, log_path: Path) -> None:
        self.binary, self.base, self.log_path = binary, base, log_path
        self.token_file = base / "node.token"
        self.token_file.write_text(os.urandom(16).hex() + "\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.binary), "node", "--listen", f"127.0.0.1:{self.port}",
             "--data-dir", str(self.base / "node"), "--images-dir", IMAGES_DIR,
             "--token-file", str(self.token_file), "--name", "remote-1",
             "--warm-pool", "1", "--run-code-pool-images", "", "--container-warm-pool", "0"],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        line = self.proc.stdout.readline().decode()
        assert line.startswith("sandlot node listening on"), (line, self.log_tail())

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="module")
def cluster(binary, log_dir):
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root (namespaces, cgroups, overlay mounts)")
    base = private_base("sandlot-remote-")
    node = Node(binary, base, log_dir / "sandlot-node.log")
    node.start()
    srv = Server(binary, base / "server", log_dir / "sandlot-server.log", mode="server",
                 args=["--node", node.url, "--node-token-file", str(node.token_file)])
    try:
        srv.start()
        yield node, srv
    finally:
        try:
            if node.proc.poll() is None and srv.proc.poll() is None:
                srv.delete_all()
        finally:
            srv.stop()
            node.stop()
            remove_private_base(base)


def test_the_api_works_through_a_remote_node(cluster):
    node, srv = cluster
    with sandlot.Client(srv.url, timeout=60) as c:
        sb = c.create(image="python", memory_mib=128, ttl_s=300, labels={"t": "remote"})
        assert sb.node == "remote-1"
        r = sb.exec(["python3", "-c", "import sys; print(sys.stdin.read().upper())"],
                    stdin=b"through the node api")
        assert (r.exit_code, r.stdout) == (0, b"THROUGH THE NODE API\n")
        sb.write_file("/work/a.txt", b"\x00\x01bytes")
        assert sb.read_file("/work/a.txt") == b"\x00\x01bytes"
        assert [e.name for e in sb.list_dir("/work")] == ["a.txt"]
        # Background process: stdin streamed and output followed over the node API.
        p = sb.spawn(["sh", "-c", "read x; echo got $x; exit 3"], stdin_open=True)
        p.write_stdin(b"hello\n", eof=True)
        done = p.wait(timeout=30)
        assert done is not None and done.exit_code == 3, done
        assert done.stdout == b"got hello\n", done
        assert c.pause(labels={"t": "remote"}) == [sb.id]
        assert c.get(sb.id).state == "paused"
        assert c.resume(labels={"t": "remote"}) == [sb.id]
        ck = sb.checkpoint()
        fork = c.create(checkpoint=ck, ttl_s=300)
        assert fork.read_file("/work/a.txt") == b"\x00\x01bytes"
        fork.delete()
        c.delete_checkpoint(ck)
        rc = c.run_code("print(6 * 7)")
        assert (rc.status, rc.run_result.stdout) == ("Success", "42\n"), rc
        sb.delete()
        assert [b.id for b in c.list(labels={"t": "remote"})] == []


def test_large_file_streams_through_a_remote_node(cluster):
    """A 48 MiB upload and download through `sandlot server` and the node wire (both
    streamed: chunked HTTP bodies, no whole file held per call) come back byte-identical;
    an upload over the server's limit (Content-Length unknown) is 413 and leaves nothing."""
    import hashlib
    import httpx
    node, srv = cluster
    data = os.urandom(1 << 20) * 48
    with sandlot.Client(srv.url, timeout=120) as c:
        sb = c.create(image="python", memory_mib=128, disk_mib=512, ttl_s=300)
        try:
            sb.write_file("/work/big.bin", data)
            got = sb.read_file("/work/big.bin")
            assert len(got) == len(data)
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
            r = sb.exec(["sha256sum", "/work/big.bin"])
            assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()

            def chunks():
                # 257 MiB of zero pages: over the default 256 MiB limit.
                z = bytes(1 << 20)
                for _ in range(257):
                    yield z
            r = httpx.put(f"{srv.url}/v1/sandboxes/{sb.id}/files",
                          params={"path": "/work/over.bin"}, content=chunks(), timeout=120)
            assert r.status_code == 413, r.text
            assert [e.name for e in sb.list_dir("/work")] == ["big.bin"]
        finally:
            sb.delete()


def test_a_node_that_goes_away_is_unavailable_and_loses_nothing(cluster):
    node, srv = cluster
    with sandlot.Client(srv.url, timeout=60, retries=0) as c:
        sb = c.create(image="python", memory_mib=128, ttl_s=300)
        node.kill()
        with pytest.raises(sandlot.Unavailable) as e:
            sb.exec(["true"])
        assert "outcome unknown" in str(e.value), e.value
        time.sleep(3)  # reaper passes while the node is down: nothing becomes lost
        assert c.get(sb.id).state == "running"
        # The node restarted alone re-adopts its live sandboxes: the server (still
        # running) finds the same sandbox there, running.
        node.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                r = sb.exec(["echo", "back"])
                break
            except sandlot.Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert r.stdout == b"back\n"
        time.sleep(3)  # reaper passes against the restarted node
        assert c.get(sb.id).state == "running"
        # A server restart reconciles too (its readopt keeps what it has records of).
        srv.stop()
        srv.start()
        r = sb.exec(["echo", "back"])
        assert r.stdout == b"back\n"
        assert c.get(sb.id).state == "running"
        sb.delete()
