"""Failures of a real local cluster (issue 21 "Tests"; docs/operations.md "Cluster mode",
"What the failure tests show"): `scripts/cluster.sh up DIR 2 --servers 2` gives 3 etcd
members, PostgreSQL, two `sandlot server --etcd --postgres` and two `sandlot node --etcd`,
each node in its own network namespace. Short leases (node lease 3 s, election 2 s) keep the
file within its CI budget. In order, on the one cluster:

1. kill -9 of a node holding a sandbox bound to a trajectory: the record turns `lost` within
   lease TTL + 5 s, the sandbox on the other node is untouched, `restore="replay"` rebuilds
   the trajectory on the other node (logged steps answered from the log, then live), and the
   node started again on its data dir rejoins and its orphan is deleted (reconcile).
2. Partition of a node (iptables DROP on its namespace's link): it fences itself (its
   `/v1/health` answers 503 inside its namespace), its sandbox turns `lost`; healed, it
   serves again and the reconcile deletes the orphan: no sandbox is served by two nodes.
3. PostgreSQL stopped and started, then one etcd member stopped and started, while a client
   creates, execs in and deletes sandboxes in a loop: every call succeeds or fails with
   `unavailable` (503) and none hangs; creates succeed again within seconds; no record is
   left `creating` or `deleting`.
4. Two tenants (API keys in PostgreSQL) through the two servers: neither sees, execs in or
   deletes the other's sandbox, and a quota of 1 holds across the servers.

Needs root, etcd and PostgreSQL (scripts/setup.sh installs both); else the module is skipped
with the reason. Tenants go last: once a key exists every call needs one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import sandlot
from conftest import IMAGES_DIR

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "cluster.sh")
PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
LEASE_TTL_S = 3
ELECTION_TTL_S = 2
SUBNET = os.environ.get("SANDLOT_CLUSTER_SUBNET", "10.213.0")
SMALL = dict(image="python", memory_mib=128, ttl_s=300)


class Cluster:
    """What `cluster.sh up` printed, and the helpers the tests share."""

    def __init__(self, d: Path, lines: List[str], env: Dict[str, str]) -> None:
        self.dir, self.env = d, env
        self.etcd = [ln.split()[1] for ln in lines if ln.startswith("etcd ")]
        self.pg = next(ln.split()[1] for ln in lines if ln.startswith("postgres "))
        self.servers = [ln.split()[1] for ln in lines if ln.startswith("server ")]
        self.nodes = {ln.split()[1]: ln.split()[2] for ln in lines if ln.startswith("node ")}
        self.token = (d / "node-token").read_text().strip()

    def client(self, server: int = 0, **kw) -> sandlot.Client:
        kw.setdefault("timeout", 30)
        kw.setdefault("retries", 0)
        return sandlot.Client(self.servers[server], **kw)

    def node_ids(self, name: str) -> List[str]:
        """Sandbox ids the node itself reports (node API, from the host over the bridge)."""
        req = urllib.request.Request(self.nodes[name] + "/v1/sandboxes",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return [s["id"] for s in json.load(r)]

    def nodes_seen(self, server: int = 0) -> list:
        """`GET /v1/nodes` of a server: (name, usage) of each node it places on."""
        with urllib.request.urlopen(self.servers[server] + "/v1/nodes", timeout=5) as r:
            return [(n["name"], n.get("usage")) for n in json.load(r)["nodes"]]

    def node_health_inside(self, name: str) -> int:
        """HTTP status of the node's /v1/health, asked from inside its own namespace (so a
        partition of its link does not hide the answer)."""
        i = int(name.removeprefix("node"))
        out = subprocess.run(
            ["nsenter", f"--net=/run/netns/slc-node{i}", "curl", "-s", "-o", "/dev/null",
             "-w", "%{http_code}", "--max-time", "3", "-H", f"Authorization: Bearer {self.token}",
             self.nodes[name] + "/v1/health"], capture_output=True, text=True, timeout=10)
        return int(out.stdout or 0)

    def sh(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                             env=self.env)
        assert out.returncode == 0, f"{args}: {out.stderr}"
        return out.stdout


def wait_for(pred, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll ``pred`` (exceptions count as false); the seconds it took."""
    t0 = time.monotonic()
    while True:
        try:
            if pred():
                return time.monotonic() - t0
        except Exception:
            pass
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# Nodes publish their usage every second (crates/sandlot-cli/src/cluster.rs USAGE_PERIOD) and
# placement reads the published usage, so creates within one period may all go to one node.
USAGE_PERIOD_S = 1.0


def spread_create(c: sandlot.Client, before: list) -> sandlot.Sandbox:
    """A small sandbox, created at least one usage period after the previous one in
    ``before``, so placement sees the previous one counted."""
    if before:
        time.sleep(USAGE_PERIOD_S + 0.3)
    return c.create(**SMALL)


def state_of(c: sandlot.Client, sid: str) -> str:
    return c.get(sid).state


@pytest.fixture(scope="module")
def cluster(binary, log_dir):
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network namespaces, the nodes' jails)")
    if shutil.which("etcd") is None:
        pytest.skip("no etcd (scripts/setup.sh installs Debian's etcd-server)")
    if not (PG_BIN / "postgres").exists():
        pytest.skip(f"no PostgreSQL at {PG_BIN} (scripts/setup.sh installs Debian's postgresql)")
    d = Path(f"/var/tmp/sandlot-clfail-{os.getpid()}")
    env = dict(os.environ, SANDLOT_BIN=str(Path(binary).resolve()), SANDLOT_IMAGES_DIR=IMAGES_DIR,
               SANDLOT_CLUSTER_NODE_ARGS=f"--lease-ttl-s {LEASE_TTL_S} --warm-pool 0 "
                                         "--container-warm-pool 0",
               SANDLOT_CLUSTER_SERVER_ARGS=f"--election-ttl-s {ELECTION_TTL_S}")
    up = subprocess.run([SCRIPT, "up", str(d), "2", "--servers", "2"], capture_output=True,
                        text=True, timeout=300, env=env)
    try:
        assert up.returncode == 0, up.stderr + "\n" + up.stdout
        lines = up.stdout.splitlines()
        assert [ln.split()[0] for ln in lines] == \
            ["etcd"] * 3 + ["postgres"] + ["server"] * 2 + ["node"] * 2, lines
        yield Cluster(d, lines, env)
    finally:
        down = subprocess.run([SCRIPT, "down", str(d)], capture_output=True, text=True,
                              timeout=300, env=env)
        for log in list(d.glob("*.log")) + list(d.glob("pg/*.log")):
            shutil.copy(log, log_dir / f"clfail-{log.name}")
        assert down.returncode == 0, down.stderr
        assert "slc-node" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                text=True).stdout
        with open("/proc/self/mountinfo") as f:
            assert [ln for ln in f if str(d) in ln] == []
        shutil.rmtree(d, ignore_errors=True)


def test_kill_node_lost_then_replay_on_another_node_and_rejoin(cluster):
    c = cluster.client()
    sb = c.create(trajectory="clfail/ep-1", **SMALL)
    victim = sb.node
    sb.write_file("a.txt", "one\n")
    assert sb.exec("echo two >> a.txt").exit_code == 0
    # A sandbox on the other node must not be affected.
    others = []
    while not any(o.node != victim for o in others):
        assert len(others) < 6, f"placement put every sandbox on {victim}"
        others.append(spread_create(c, others))
    bystander = next(o for o in others if o.node != victim)
    for o in others:
        if o is not bystander:
            o.delete()

    pid = int((cluster.dir / f"{victim}.pid").read_text())
    os.kill(pid, 9)
    took = wait_for(lambda: state_of(c, sb.id) == "lost", LEASE_TTL_S + 5 + 5,
                    f"{sb.id} lost after kill -9 of {victim}")
    print(f"kill -9 {victim}: lost after {took:.1f} s")
    assert state_of(c, bystander.id) == "running"
    assert bystander.exec("echo ok").stdout == b"ok\n"
    # A lost sandbox is served by no one.
    with pytest.raises(sandlot.SandlotError):
        sb.exec("true")

    # Rebuilt from the log on the surviving node, through the other server.
    c1 = cluster.client(1)
    again = c1.create(trajectory="clfail/ep-1", restore="replay", **SMALL)
    assert again.id != sb.id and again.node != victim and again.state == "running"
    assert again.restore is not None and again.restore.replayed_steps == 2
    assert again.restore.mismatches == []
    # The agent loop from its start: the logged steps come from the log, then live.
    again.write_file("a.txt", "one\n")
    assert again.last_replayed
    assert again.exec("echo two >> a.txt").replayed
    r = again.exec("echo three >> a.txt && cat a.txt")
    assert not r.replayed and r.stdout == b"one\ntwo\nthree\n"

    # The node started again on its data dir rejoins; the reconcile deletes its orphan.
    cluster.sh(SCRIPT, "node-start", str(cluster.dir), victim.removeprefix("node"))
    took = wait_for(lambda: sb.id not in cluster.node_ids(victim), 20,
                    f"orphan {sb.id} deleted on {victim}")
    print(f"{victim} restarted: orphan deleted {took:.1f} s after it answered")
    assert state_of(c, sb.id) == "lost"
    again.delete()
    bystander.delete()


def test_partitioned_node_fences_and_reconciles_after_healing(cluster):
    c = cluster.client()
    # Sandboxes until one is on node0 (placement spreads over the two nodes).
    made = [spread_create(c, [])]
    while made[-1].node != "node0":
        assert len(made) < 6, "placement never chose node0"
        made.append(spread_create(c, made))
    sb = made.pop()
    for o in made:
        o.delete()
    assert sb.exec("echo in").stdout == b"in\n"

    ns = "--net=/run/netns/slc-node0"
    rules = [["INPUT", "-i", "eth0", "-j", "DROP"], ["OUTPUT", "-o", "eth0", "-j", "DROP"]]
    for r in rules:
        subprocess.run(["nsenter", ns, "iptables", "-I", *r], check=True, timeout=10)
    t0 = time.monotonic()
    try:
        fenced = wait_for(lambda: cluster.node_health_inside("node0") == 503, LEASE_TTL_S + 5,
                          "node0 fences itself")
        wait_for(lambda: state_of(c, sb.id) == "lost", LEASE_TTL_S + 10,
                 f"{sb.id} lost after the partition")
        print(f"partition: node0 fenced after {fenced:.1f} s, sandbox lost "
              f"{time.monotonic() - t0:.1f} s after the partition")
        with pytest.raises(sandlot.SandlotError):
            sb.exec("true")
    finally:
        for r in rules:
            subprocess.run(["nsenter", ns, "iptables", "-D", *r], timeout=10)
    took = wait_for(lambda: cluster.node_health_inside("node0") == 200, 20, "node0 serves again")
    wait_for(lambda: sb.id not in cluster.node_ids("node0"), 20, f"orphan {sb.id} deleted")
    print(f"healed: node0 serving after {took:.1f} s, orphan deleted")
    assert state_of(c, sb.id) == "lost"
    # It takes new sandboxes again.
    made = []
    while not any(m.node == "node0" for m in made):
        assert len(made) < 6, ("node0 gets no sandbox after healing", [m.node for m in made],
                               cluster.nodes_seen())
        made.append(spread_create(c, made))
    for m in made:
        assert m.exec("echo ok").stdout == b"ok\n"
        m.delete()


def test_postgres_restart_and_etcd_member_loss_under_load(cluster):
    outcomes: List[Tuple[str, float, str]] = []  # (call, seconds, "ok" | error class)
    stop = threading.Event()
    created: List[str] = []

    def call(name, f):
        t = time.monotonic()
        try:
            v = f()
            outcomes.append((name, time.monotonic() - t, "ok"))
            return v
        except sandlot.SandlotError as e:
            outcomes.append((name, time.monotonic() - t, f"{type(e).__name__}: {e}"))
            return None

    def loop(server: int) -> None:
        c = cluster.client(server, timeout=20)
        while not stop.is_set():
            sb = call("create", lambda: c.create(image="python", memory_mib=64, ttl_s=120))
            if sb is None:
                time.sleep(0.2)
                continue
            created.append(sb.id)
            call("exec", lambda: sb.exec("echo hi"))
            call("delete", sb.delete)

    workers = [threading.Thread(target=loop, args=(i,)) for i in (0, 1)]
    for w in workers:
        w.start()
    pg_dir, pg_port = str(cluster.dir / "pg"), cluster.pg.rsplit(":", 1)[1].split("/")[0]
    try:
        time.sleep(2)
        cluster.sh(str(ROOT / "scripts" / "postgres.sh"), "stop", pg_dir)
        pg_down = time.monotonic()
        time.sleep(3)
        cluster.sh(str(ROOT / "scripts" / "postgres.sh"), "start", pg_dir, pg_port)
        pg_up = time.monotonic()
        n_before = len(outcomes)
        cluster.sh(str(ROOT / "scripts" / "etcd.sh"), "stop-member", str(cluster.dir / "etcd"), "2")
        time.sleep(3)
        cluster.sh(str(ROOT / "scripts" / "etcd.sh"), "start-member", str(cluster.dir / "etcd"),
                   "2")
        time.sleep(2)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    assert not any(w.is_alive() for w in workers), "a call hangs"
    bad = [o for o in outcomes if o[2] != "ok" and not o[2].startswith("Unavailable")]
    assert bad == [], bad
    slowest = max(o[1] for o in outcomes)
    assert slowest < 15, f"a call took {slowest:.1f} s"
    failed = sum(o[2] != "ok" for o in outcomes)
    assert sum(o[2] == "ok" for o in outcomes[n_before:]) > 0, "nothing succeeded after PG start"
    print(f"PG down {pg_up - pg_down:.1f} s + etcd member down 3 s: {len(outcomes)} calls, "
          f"{failed} unavailable, slowest {slowest:.1f} s")

    # Recovery, and nothing half-done.
    c = cluster.client()
    took = wait_for(lambda: c.create(**SMALL).delete() is None, 10, "a create after recovery")
    print(f"recovered: first create {took:.1f} s after the load stopped")
    wait_for(lambda: not [s for s in c.list() if s.state in ("creating", "deleting")], 30,
             "no record left creating/deleting")
    for s in c.list():
        if s.id in created:
            s.delete()


def key_create(cluster: Cluster, binary: Path, name: str, *args: str) -> str:
    out = cluster.sh(str(binary), "key", "create", "--postgres", cluster.pg, "--data-dir",
                     str(cluster.dir / "keys"), "--name", name, *args)
    return out.strip()


def test_two_tenants_through_two_servers(cluster, binary):
    a_key = key_create(cluster, binary, "a", "--max-sandboxes", "1")
    b_key = key_create(cluster, binary, "b")
    a0 = cluster.client(0, api_key=a_key)
    a1 = cluster.client(1, api_key=a_key)
    b1 = cluster.client(1, api_key=b_key)
    with pytest.raises(sandlot.Unauthenticated):
        cluster.client(1).list()
    sa = a0.create(**SMALL)
    try:
        assert [s.id for s in a1.list()] == [sa.id]
        assert b1.list() == []
        with pytest.raises(sandlot.NotFound):
            b1.get(sa.id)
        b1.delete(sa.id)  # answered as for an unknown id (no error), and a's stays
        assert a1.get(sa.id).state == "running"
        handle = type(sa)(b1, sa.raw)  # b's key on a's sandbox id
        with pytest.raises(sandlot.NotFound):
            handle.exec("true")
        # The quota of 1 holds across servers.
        with pytest.raises(sandlot.ResourceExhausted):
            a1.create(**SMALL)
        assert a0.get(sa.id).exec("echo mine").stdout == b"mine\n"
    finally:
        a0.delete(sa.id)
