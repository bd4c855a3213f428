"""`sandlot server --postgres URL` (docs/operations.md "Cluster mode"): the sandbox registry,
API keys, trajectory owners, checkpoints and the trajectory log live in a real PostgreSQL
(started here by scripts/postgres.sh), so a server keeps nothing of value in its data
directory: a replacement server with an empty data directory takes over the sandboxes,
the trajectory log and the keys of one killed with SIGKILL. Without --etcd, one server per
database: a second one is refused while the first holds the database's server lock
(several servers with --etcd: tests/test_server_multi.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import sandlot
from conftest import Server, free_port, private_base, remove_private_base
from test_server_remote_node import Node

ROOT = Path(__file__).resolve().parent.parent
PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))


@pytest.fixture(scope="module")
def postgres():
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root (namespaces, cgroups, overlay mounts)")
    if not (PG_BIN / "postgres").exists():
        pytest.skip(f"no PostgreSQL at {PG_BIN} (scripts/setup.sh installs Debian's postgresql)")
    d = Path(f"/var/tmp/sandlot-pg-{os.getpid()}")
    script = str(ROOT / "scripts" / "postgres.sh")
    out = subprocess.run(["bash", script, "start", str(d), str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    url = next(line.split(" ", 1)[1] for line in out.stdout.splitlines()
               if line.startswith("postgres "))
    try:
        yield url
    finally:
        subprocess.run(["bash", script, "stop", str(d)], capture_output=True, timeout=60)
        shutil.rmtree(d, ignore_errors=True)


def test_a_replacement_server_takes_over_from_postgres(binary, log_dir, postgres):
    base = private_base("sandlot-pg-")
    node = Node(binary, base, log_dir / "sandlot-node-pg.log")
    node.start()
    args = ["--node", node.url, "--node-token-file", str(node.token_file),
            "--postgres", postgres]
    a = Server(binary, base / "server-a", log_dir / "sandlot-server-pg-a.log",
               mode="server", args=args)
    b = Server(binary, base / "server-b", log_dir / "sandlot-server-pg-b.log",
               mode="server", args=args)
    key = None
    try:
        a.start()
        with sandlot.Client(a.url, timeout=60) as c:
            sb = c.create(image="python", memory_mib=128, ttl_s=600, trajectory="pg/ep-1")
            r = sb.exec("echo one > one && cat one")
            assert (r.exit_code, r.stdout) == (0, b"one\n"), r
            sb.write_file("/work/two", b"two")
        # The database is taken: a second server is refused, with the reason.
        with pytest.raises(RuntimeError, match="another sandlot server runs on this PostgreSQL"):
            b.start()
        # SIGKILL: nothing runs on exit; PostgreSQL drops the lock with the connection.
        a.stop(sig=9)
        deadline = time.monotonic() + 30
        while True:
            try:
                b.start()
                break
            except RuntimeError as e:
                if "another sandlot server" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        with sandlot.Client(b.url, timeout=60) as c:
            got = c.get(sb.id)
            assert (got.state, got.node) == ("running", "remote-1")
            assert c.get(sb.id).read_file("/work/two") == b"two"
            # The trajectory log came along: a trainer that reattaches replays step 0 and
            # then goes on live on the same sandbox.
            t = c.attach("pg/ep-1")
            assert t.id == sb.id and t.reattached
            r = t.exec("echo one > one && cat one")
            assert r.replayed and r.stdout == b"one\n"
            t.write_file("/work/two", b"two")
            assert t.last_replayed
            r = t.exec("cat one /work/two")
            assert (r.replayed, r.stdout) == (False, b"one\ntwo")
        # Nothing of the registry or the log was written under the new data directory.
        for f in ("sandlot.db", "trajectories.db"):
            assert not (base / "server-b" / f).exists(), f
        # API keys live in PostgreSQL too: one made with `sandlot key create --postgres`
        # switches authentication on for the running server.
        out = subprocess.run([str(binary), "key", "create", "--postgres", postgres,
                              "--name", "ops", "--admin"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        key = out.stdout.strip()
        with sandlot.Client(b.url, timeout=60, retries=0) as anon:
            with pytest.raises(sandlot.Unauthenticated):
                anon.list()
        with sandlot.Client(b.url, timeout=60, api_key=key) as c:
            assert [s.id for s in c.list()] == [sb.id]
            c.get(sb.id).delete()
            assert c.list() == []
    finally:
        try:
            live = [s for s in (b, a) if s.proc is not None and s.proc.poll() is None]
            if live and node.proc.poll() is None:
                with sandlot.Client(live[0].url, timeout=60, api_key=key) as c:
                    for s in c.list():
                        s.delete()
        finally:
            for s in (a, b):
                s.stop()
            node.stop()
        remove_private_base(base)
