"""Idle and slow connections cannot starve the server (issue 25, item 1).

A flood of idle TCP connections (no API key needed: keys are checked per request) used to
exhaust the server's file descriptors: `accept` failed with EMFILE, `/v1/ping` hung, and the
node's `/proc` reads failed, so every running sandbox was marked `lost` while its processes
lived. The server here runs with a low descriptor limit (soft = hard = NOFILE, so it cannot
raise it) and default connection settings; the flood comes from other loopback addresses
(127.0.0.2 …) than the well-behaved client (127.0.0.1), as separate peers would.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from pathlib import Path

import httpx
import pytest

import sandlot
from conftest import Server, private_base, remove_private_base, wait_until

NOFILE = 1024
FLOOD = 3000          # idle connections, about 3x the server's descriptor limit
PEERS = 30           # source addresses 127.0.0.2 … 127.0.0.31 (100 each)
PING_DEADLINE_S = 5.0


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _raise_own_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < need:
        pytest.skip(f"the test process needs {need} descriptors; hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _flood(port: int) -> list:
    """FLOOD non-blocking connects that never send a byte."""
    socks = []
    for i in range(FLOOD):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((f"127.0.0.{2 + i % PEERS}", 0))
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


def _timed_ping(url: str) -> float:
    t0 = time.monotonic()
    r = httpx.get(f"{url}/v1/ping", timeout=PING_DEADLINE_S)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


@pytest.fixture
def low_fd_server(binary, log_dir):
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root")
    base = private_base("sandlot-conn-")
    srv = Server(binary, base / "data", log_dir / "conn-limits.log",
                 args=["--warm-pool", "0", "--container-warm-pool", "0"], preexec=_low_nofile)
    srv.start()
    try:
        yield srv
        srv.delete_all()
    finally:
        srv.stop()
        remove_private_base(base)


def test_idle_connection_flood_neither_starves_the_server_nor_loses_sandboxes(low_fd_server):
    srv = low_fd_server
    _raise_own_nofile(FLOOD + 256)
    with sandlot.Client(srv.url, timeout=60) as c:
        try:
            box = c.create(backend="function", image="busybox", memory_mib=64, ttl_s=600)
        except (sandlot.NotFound, sandlot.Unavailable) as e:
            pytest.skip(f"no usable busybox function sandbox here: {e}")
        assert box.exec(["echo", "before"]).stdout == b"before\n"
    socks = _flood(srv.port)
    try:
        pings = []
        # Several reaper passes (1 s apart) run under the flood; each ping is a new client.
        end = time.monotonic() + 6
        while time.monotonic() < end:
            try:
                pings.append(_timed_ping(srv.url))
            except httpx.TimeoutException:
                pytest.fail(f"/v1/ping gave no answer within {PING_DEADLINE_S}s under a flood of "
                            f"{FLOOD} idle connections\n{srv.log_tail()}")
            time.sleep(0.5)
        print(f"ping under flood: max {max(pings)*1000:.0f} ms over {len(pings)} pings")
        with sandlot.Client(srv.url, timeout=30, retries=0) as c:
            got = c.get(box.id)
            assert got.state == "running", f"sandbox went {got.state} under the flood"
            assert got.exec(["echo", "during"]).stdout == b"during\n"
            events = httpx.get(f"{srv.url}/v1/events", params={"kind": "lost"}, timeout=10)
            assert events.json()["events"] == [], events.text
            metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        for s in socks:
            s.close()
    evicted = [l for l in metrics.splitlines()
               if l.startswith('sandlot_connections_closed_total{reason="evicted"}')]
    assert evicted and float(evicted[0].split()[-1]) > 0, "no idle connection was evicted"
    with sandlot.Client(srv.url, timeout=30) as c:
        assert c.get(box.id).exec(["echo", "after"]).stdout == b"after\n"


@pytest.fixture
def short_timeout_server(binary, log_dir):
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root")
    base = private_base("sandlot-conn-")
    srv = Server(binary, base / "data", log_dir / "conn-timeouts.log",
                 args=["--warm-pool", "0", "--container-warm-pool", "0",
                       "--header-read-timeout-s", "2", "--idle-timeout-s", "3",
                       "--max-connections-per-ip", "8"])
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        remove_private_base(base)


def _closed_by_peer(s: socket.socket, within: float) -> float:
    """Seconds until the server closed ``s`` (EOF or reset); fails after ``within``."""
    s.settimeout(within)
    t0 = time.monotonic()
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail(f"connection still open after {within}s")
    return time.monotonic() - t0


def test_slow_header_and_idle_connections_are_closed_and_peers_limited(short_timeout_server):
    srv = short_timeout_server
    # Slow loris: half a request head, then nothing.
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n")
    took = _closed_by_peer(s, 8)
    assert took < 6, took
    # A keep-alive connection that answered one request and then stays quiet.
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200" in s.recv(4096).split(b"\r\n")[0]
    took = _closed_by_peer(s, 10)
    assert 2 <= took < 8, took
    # Per-peer limit 8: more idle connections from one address evict that address's oldest;
    # a request from another address is unaffected.
    socks = [socket.create_connection(("127.0.0.1", srv.port), source_address=("127.0.0.2", 0))
             for _ in range(12)]
    try:
        wait_until(lambda: _metric(srv, 'sandlot_connections_closed_total{reason="evicted"}') >= 4,
                   timeout=10, what="4 evictions")
        assert httpx.get(f"{srv.url}/v1/ping", timeout=5).status_code == 200
    finally:
        for x in socks:
            x.close()


def _metric(srv: Server, name: str) -> float:
    for line in httpx.get(f"{srv.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0
