"""Several `sandlot server --etcd URLS --postgres URL` processes on one database and one etcd
(docs/operations.md "Several servers"): both start (no server lock with --etcd), exactly one
leads (`/healthz` `leader`, `sandlot_server_leader`), and after SIGKILL of the leader the other
leads within the election TTL. No node is registered: the singletons and the election are
what is under test here (creates, deletes and failover with a node are in
crates/sandlot-server/tests/multiserver.rs)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import Server, free_port, private_base, remove_private_base

ROOT = Path(__file__).resolve().parent.parent
PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
ELECTION_TTL_S = 2


@pytest.fixture(scope="module")
def services():
    if os.geteuid() != 0:
        pytest.skip("scripts/postgres.sh runs PostgreSQL as the postgres user only as root")
    if not (PG_BIN / "postgres").exists():
        pytest.skip(f"no PostgreSQL at {PG_BIN} (scripts/setup.sh installs Debian's postgresql)")
    if shutil.which("etcd") is None:
        pytest.skip("no etcd (scripts/setup.sh installs Debian's etcd-server)")
    d = Path(f"/var/tmp/sandlot-multi-{os.getpid()}")
    pg_sh, etcd_sh = str(ROOT / "scripts" / "postgres.sh"), str(ROOT / "scripts" / "etcd.sh")
    out = subprocess.run(["bash", pg_sh, "start", str(d / "pg"), str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pg = next(line.split(" ", 1)[1] for line in out.stdout.splitlines()
              if line.startswith("postgres "))
    try:
        out = subprocess.run(["bash", etcd_sh, "start", str(d / "etcd"), "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        etcd = ",".join(line.split(" ", 1)[1] for line in out.stdout.splitlines()
                        if line.startswith("etcd "))
        yield pg, etcd
    finally:
        subprocess.run(["bash", etcd_sh, "stop", str(d / "etcd")], capture_output=True, timeout=60)
        subprocess.run(["bash", pg_sh, "stop", str(d / "pg")], capture_output=True, timeout=60)
        shutil.rmtree(d, ignore_errors=True)


def health(s: Server) -> dict:
    with urllib.request.urlopen(f"{s.url}/healthz", timeout=5) as r:
        return json.loads(r.read())


def metric(s: Server, name: str) -> str:
    with urllib.request.urlopen(f"{s.url}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return line.split()[1]
    raise AssertionError(f"no {name} in /metrics")


def test_two_servers_one_leader_and_failover(binary, log_dir, services):
    pg, etcd = services
    base = private_base("sandlot-multi-")
    token = base / "node-token"
    token.write_text("multi-token\n")
    servers = []
    for name in ("srv-a", "srv-b"):
        args = ["--etcd", etcd, "--postgres", pg, "--node-token-file", str(token),
                "--name", name, "--election-ttl-s", str(ELECTION_TTL_S)]
        servers.append(Server(binary, base / name, log_dir / f"sandlot-multi-{name}.log",
                              mode="server", args=args))
    a, b = servers
    try:
        a.start()
        b.start()  # not refused: with --etcd there is no server lock
        deadline = time.monotonic() + 15
        while not any(health(s)["leader"] for s in servers):
            assert time.monotonic() < deadline, "no leader"
            time.sleep(0.2)
        time.sleep(1)
        hs = [health(s) for s in servers]
        # --name N gives the id N-RANDOM (8 hex digits).
        assert [h["server_id"][:-9] for h in hs] == ["srv-a", "srv-b"]
        assert all(len(h["server_id"]) == len("srv-a-") + 8 for h in hs)
        assert sum(h["leader"] for h in hs) == 1, hs
        leader, other = (a, b) if hs[0]["leader"] else (b, a)
        assert metric(leader, "sandlot_server_leader") == "1"
        assert metric(other, "sandlot_server_leader") == "0"
        leader.stop(sig=9)
        killed = time.monotonic()
        while not health(other)["leader"]:
            # Within the election TTL, plus slack for a loaded CI host.
            assert time.monotonic() - killed < ELECTION_TTL_S + 8, "no takeover"
            time.sleep(0.1)
        assert metric(other, "sandlot_server_leader") == "1"
    finally:
        for s in servers:
            s.stop()
        remove_private_base(base)
