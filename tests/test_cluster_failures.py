"""Failures of a real local cluster (issue 21 "Tests"; docs/operations.md "Cluster mode",
"What the failure tests show"): `scripts/cluster.sh up DIR 2 --servers 2` gives 3 etcd
members, PostgreSQL, two `sandlot server --etcd --postgres` and two `sandlot node --etcd`,
each node in its own network namespace. Short leases (node lease 3 s, election 2 s,
transition 3 s) keep the file within its CI budget. In order, on the one cluster:

1. kill -9 of a node holding a sandbox bound to a trajectory: the record turns `lost` within
   lease TTL + 5 s, the sandbox on the other node is untouched, `restore="replay"` rebuilds
   the trajectory on the other node (logged steps answered from the log, then live), and the
   node started again on its data dir rejoins and its orphan is deleted (reconcile).
2. Partition of a node (iptables DROP on its namespace's link): it fences itself (its
   `/v1/health` answers 503 inside its namespace), its sandbox turns `lost`; healed, it
   serves again and the reconcile deletes the orphan: no sandbox is served by two nodes.
3. kill -9 of a server while its node call of a create is in flight: the retry with the same
   Idempotency-Key through the other server (by hand, and by the SDK given both URLs) gets
   one running sandbox once the leader rolled the dead server's create back; the half-made
   one is gone from its node; nothing is left `creating`/`deleting`.
4. A 60 s mixed workload (creates, execs, deletes, trajectory steps) through both servers
   while PostgreSQL is stopped and started, then one etcd member: every call succeeds or
   fails fast with `unavailable` (503), none hangs, all succeed again after each outage;
   nothing acknowledged is lost (sandboxes, exec effects, deletes, logged steps and their
   answers); no record is left `creating` or `deleting`.
5. Two tenants (API keys in PostgreSQL) through the two servers: neither sees, execs in or
   deletes the other's sandbox, and a quota of 1 holds across the servers.

Needs root, etcd and PostgreSQL (scripts/setup.sh installs both); else the module is skipped
with the reason. Tenants go last: once a key exists every call needs one.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Tuple

import httpx
import pytest

import sandlot
from conftest import IMAGES_DIR, wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "cluster.sh")
PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
LEASE_TTL_S = 3
ELECTION_TTL_S = 2
# A server killed mid-create leaves its record `creating`; the leader rolls it back this long
# after the last heartbeat (`sandlot server --transition-ttl-s`, default 30).
TRANSITION_TTL_S = 3
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

    def all_node_ids(self) -> List[str]:
        """Sandbox ids every node reports, together."""
        return [i for name in self.nodes for i in self.node_ids(name)]

    def signal_nodes(self, sig: int) -> None:
        for name in self.nodes:
            os.kill(int((self.dir / f"{name}.pid").read_text()), sig)

    def kill_server(self, i: int) -> None:
        stem = self.dir / ("server" if i == 0 else f"server{i}")
        pid = int(Path(f"{stem}.pid").read_text())
        os.kill(pid, 9)
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or
                 "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3], 10,
                 f"server {i} (pid {pid}) gone")

    def start_server(self, i: int) -> None:
        self.sh(SCRIPT, "server-start", str(self.dir), str(i))

    def sh(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                             env=self.env)
        assert out.returncode == 0, f"{args}: {out.stderr}"
        return out.stdout


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
               SANDLOT_CLUSTER_SERVER_ARGS=f"--election-ttl-s {ELECTION_TTL_S} "
                                           f"--transition-ttl-s {TRANSITION_TTL_S}")
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


@pytest.fixture(autouse=True)
def _delete_leftovers(cluster):
    """After each test (also a failed one), delete what it left: sandboxes it kept would
    take the next test's capacity on the shared nodes."""
    yield
    try:
        c = cluster.client()
        for s in c.list():
            if s.state not in ("deleting", "deleted"):
                s.delete()
    except sandlot.SandlotError as e:
        print(f"leftover clean-up failed: {e}")


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


LIVE = ("creating", "running", "paused")


def records(url: str, label: str) -> List[dict]:
    """Records of the servers' registry (any server: one database) labelled round=label."""
    r = httpx.get(url + "/v1/sandboxes", params={"label": f"round={label}"}, timeout=10)
    r.raise_for_status()
    return r.json()["sandboxes"]


def create_with_key(url: str, key: str, body: dict, seen: set, timeout: float = 40) -> dict:
    """POST the create with ``key`` to ``url`` until it answers a running sandbox: a replay
    of a create still `creating` is polled; one rolled back (its key forgotten) is sent
    again, as the SDK does. Every sandbox id answered goes to ``seen``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.post(url + "/v1/sandboxes", json=body, headers={"Idempotency-Key": key},
                       timeout=30)
        assert r.status_code in (200, 201, 404), (r.status_code, r.text[:300])
        if r.status_code == 404:  # the key's record went between two statements: resend
            time.sleep(0.2)
            continue
        sb = r.json()
        seen.add(sb["id"])
        while sb["state"] == "creating" and time.monotonic() < deadline:
            time.sleep(0.1)
            g = httpx.get(f"{url}/v1/sandboxes/{sb['id']}", timeout=10)
            if g.status_code == 404:
                break
            sb = g.json()
        if sb["state"] == "running":
            return sb
        time.sleep(0.2)  # rolled back (deleting, gone): the key is free again
    pytest.fail(f"no running sandbox for key {key} within {timeout}s (ids seen {seen})")


def kill_mid_create(cluster: Cluster, victim: int, label: str, start) -> Tuple[float, set]:
    """Freeze both nodes, start a create through server ``victim`` (``start()``), wait until
    its record is `creating` (the node call is then sent, the node cannot answer), kill -9
    the server and thaw the nodes. Returns how long the nodes were frozen and the ids of
    the `creating` records."""
    other = cluster.servers[1 - victim]
    cluster.signal_nodes(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        start()
        while not (ids := {r["id"] for r in records(other, label) if r["state"] == "creating"}):
            assert time.monotonic() - t0 < 2, f"no `creating` record for round {label}"
            time.sleep(0.02)
        time.sleep(0.3)  # the server claims the record and sends the node call
        cluster.kill_server(victim)
    finally:
        cluster.signal_nodes(signal.SIGCONT)
    return time.monotonic() - t0, ids


def check_one_sandbox(cluster: Cluster, label: str, final: str, seen: set) -> None:
    """Exactly one live record of round ``label`` (``final``); once the sweep is done, no
    record `creating`/`deleting` and no node holds any other sandbox the round made."""
    url = cluster.servers[0]
    live = [r["id"] for r in records(url, label) if r["state"] in LIVE]
    assert live == [final], (live, final, seen)
    wait_for(lambda: not [r for r in records(url, label) if r["state"] not in LIVE], 20,
             f"round {label}: the rolled-back record removed")
    on_nodes = set(cluster.all_node_ids())
    wait_for(lambda: set(cluster.all_node_ids()) & seen == {final}, 20,
             f"round {label}: only {final} on the nodes (ids seen {seen}, nodes {on_nodes})")


def test_kill_server_mid_create_retry_through_the_other_gets_one_sandbox(cluster):
    """kill -9 of a server while its node call is in flight (both nodes frozen with SIGSTOP
    from the record's insert until the kill, so the node gets the create only after its
    server died): the retry with the same Idempotency-Key through the other server waits
    for the leader's rollback (transition TTL) and gets one running sandbox; the half-made
    one is deleted on its node. Twice with a raw POST and an explicit key, twice through the
    SDK given both URLs (its own key, its own fail-over), killing each server in turn."""
    stats = []
    for rnd in range(4):
        victim = rnd % 2
        label = f"kill{rnd}-{uuid.uuid4().hex[:6]}"
        body = dict(SMALL, labels={"round": label})
        seen: set = set()
        out: list = []
        if rnd < 2:
            key = f"clfail-{label}"

            def first_try():
                try:
                    out.append(httpx.post(cluster.servers[victim] + "/v1/sandboxes", json=body,
                                          headers={"Idempotency-Key": key}, timeout=30))
                except httpx.HTTPError as e:
                    out.append(e)
        else:
            c = sandlot.Client([cluster.servers[victim], cluster.servers[1 - victim]],
                               timeout=30, retries=2)

            def first_try():
                try:
                    out.append(c.create(**SMALL, labels={"round": label}))
                except sandlot.SandlotError as e:
                    out.append(e)
        t = threading.Thread(target=first_try)
        t0 = time.monotonic()
        frozen, first = kill_mid_create(cluster, victim, label, t.start)
        seen |= first
        t.join(timeout=60)
        assert not t.is_alive(), "the create hangs"
        if rnd < 2:
            assert isinstance(out[0], httpx.HTTPError), out  # its server died under it
            sb = create_with_key(cluster.servers[1 - victim], key, body, seen)
            final = sb["id"]
        else:
            sb = out[0]
            assert isinstance(sb, sandlot.Sandbox) and sb.state == "running", out
            final = sb.id
            seen |= {r["id"] for r in records(cluster.servers[1 - victim], label)}
            seen.add(final)
            c.close()
        took = time.monotonic() - t0
        cluster.start_server(victim)
        check_one_sandbox(cluster, label, final, seen)
        assert cluster.client(victim).get(final).exec("echo ok").stdout == b"ok\n"
        cluster.client().delete(final)
        stats.append(f"{took:.1f}s/{len(seen)} ids (frozen {frozen:.1f}s)")
    print("kill -9 of a server mid-create, retry through the other: " + ", ".join(stats))
    c = cluster.client()
    wait_for(lambda: not [s for s in c.list() if s.state in ("creating", "deleting")], 20,
             "no record left creating/deleting")
    ids = {s.id for s in c.list()}
    assert set(cluster.all_node_ids()) <= ids, (cluster.all_node_ids(), ids)


#: Length of the mixed workload (issue 21: "during a 60 s mixed workload") and when, after
#: its start, PostgreSQL and then one etcd member are each stopped for OUTAGE_S.
LOAD_S = float(os.environ.get("SANDLOT_CLFAIL_LOAD_S", "60"))
PG_STOP_AT, ETCD_STOP_AT, OUTAGE_S = 10.0, 30.0, 3.0
#: Sandboxes the workload keeps alive at most (every 10th create until this many): how many
#: creates 60 s hold depends on the host's speed, and an unbounded number filled both nodes'
#: cpu (2 cores × overcommit 8 each, 0.25 cpu per sandbox) in a fast CI run.
MAX_KEPT = 32


def test_postgres_restart_and_etcd_member_loss_under_load(cluster):
    """A 60 s mixed workload through both servers — creates (every 10th kept alive, at most
    MAX_KEPT), execs that append a token to a file, deletes, and two trajectories stepping
    an exec each — while PostgreSQL is stopped for 3 s and started, then one etcd member
    likewise. Every
    call succeeds or fails fast with `unavailable`; afterwards nothing acknowledged is
    lost: each sandbox whose create was answered exists (unless we deleted it), each
    acknowledged exec's token is in its sandbox's file, each acknowledged trajectory step
    is in the log with its exit code and its output comes back from the log (a sample),
    and the steps ran in order, each acknowledged one once."""
    outcomes: List[Tuple[str, float, float, str]] = []  # (call, start, seconds, "ok" | error)
    stop = threading.Event()
    kept: Dict[str, Tuple[sandlot.Sandbox, List[str]]] = {}  # id → (handle, acked tokens)
    deleted: List[str] = []
    steps: Dict[str, List[Tuple[int, str, bytes, int]]] = {}  # T → (step, cmd, stdout, exit)
    retried: set = set()  # (T, step) sent again after an `unavailable` answer
    errors: List[str] = []
    t_start = time.monotonic()

    def call(name, f):
        t = time.monotonic()
        try:
            v = f()
            outcomes.append((name, t - t_start, time.monotonic() - t, "ok"))
            return v, True
        except sandlot.SandlotError as e:
            outcomes.append((name, t - t_start, time.monotonic() - t, f"{type(e).__name__}: {e}"))
            return None, False

    def loop(server: int) -> None:
        c = cluster.client(server, timeout=20)
        n = 0
        try:
            while not stop.is_set():
                n += 1
                sb, ok = call("create", lambda: c.create(image="python", memory_mib=64, cpu=0.25,
                                                         ttl_s=600, labels={"load": "1"}))
                if not ok:
                    time.sleep(0.2)
                    continue
                acked: List[str] = []
                for j in range(2):
                    tok = f"{sb.id}-{j}"
                    r, ok = call("exec", lambda: sb.exec(f"echo {tok} >> acks.txt && echo {tok}"))
                    if ok:
                        assert r.exit_code == 0 and r.stdout == f"{tok}\n".encode(), r
                        acked.append(tok)
                if n % 10 == 0 and len(kept) < MAX_KEPT:
                    kept[sb.id] = (sb, acked)
                    continue
                _, ok = call("delete", sb.delete)
                if ok:
                    deleted.append(sb.id)
                # else: an `unavailable` delete may still finish: neither kept nor deleted
        except Exception as e:  # an assertion in a thread must fail the test
            errors.append(repr(e))

    def trajectory(server: int) -> None:
        c = cluster.client(server, timeout=20)
        tid = f"clfail/load-{server}-{uuid.uuid4().hex[:6]}"
        log = steps.setdefault(tid, [])
        try:
            sb = None
            while sb is None and not stop.is_set():
                sb, _ = call("traj-create", lambda: c.create(trajectory=tid, **SMALL))
                if sb is None:
                    time.sleep(0.2)
            n = 0
            while not stop.is_set():
                cmd = f"echo {n} >> steps.txt && echo step-{n}-$RANDOM"
                r, ok = call("step", lambda: sb.exec(cmd, step=n))
                if ok:
                    log.append((n, cmd, r.stdout, r.exit_code))
                    n += 1
                else:
                    retried.add((tid, n))
                    time.sleep(0.2)  # the same step again: from the log if it was logged
        except Exception as e:
            errors.append(repr(e))

    workers = [threading.Thread(target=loop, args=(i,)) for i in (0, 1)]
    workers += [threading.Thread(target=trajectory, args=(i,)) for i in (0, 1)]
    for w in workers:
        w.start()
    pg_dir, pg_port = str(cluster.dir / "pg"), cluster.pg.rsplit(":", 1)[1].split("/")[0]
    etcd_dir = str(cluster.dir / "etcd")

    def at(t: float) -> None:
        time.sleep(max(0.0, t_start + t - time.monotonic()))

    try:
        at(PG_STOP_AT)
        cluster.sh(str(ROOT / "scripts" / "postgres.sh"), "stop", pg_dir)
        pg_down = time.monotonic() - t_start
        at(PG_STOP_AT + OUTAGE_S)
        cluster.sh(str(ROOT / "scripts" / "postgres.sh"), "start", pg_dir, pg_port)
        pg_up = time.monotonic() - t_start
        at(ETCD_STOP_AT)
        cluster.sh(str(ROOT / "scripts" / "etcd.sh"), "stop-member", etcd_dir, "2")
        etcd_down = time.monotonic() - t_start
        at(ETCD_STOP_AT + OUTAGE_S)
        cluster.sh(str(ROOT / "scripts" / "etcd.sh"), "start-member", etcd_dir, "2")
        etcd_up = time.monotonic() - t_start
        at(LOAD_S)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    assert not any(w.is_alive() for w in workers), "a call hangs"
    assert errors == [], errors
    bad = [o for o in outcomes if o[3] != "ok" and not o[3].startswith("Unavailable")]
    assert bad == [], bad
    failed = [o for o in outcomes if o[3] != "ok"]
    slowest = max(o[2] for o in outcomes)
    slowest_failed = max((o[2] for o in failed), default=0.0)
    assert slowest < 15, f"a call took {slowest:.1f} s"
    assert slowest_failed < 5, f"an `unavailable` answer took {slowest_failed:.1f} s"
    for name in ("create", "exec", "delete", "step"):
        assert any(o[0] == name and o[3] == "ok" and o[1] > pg_up + 2 for o in outcomes), \
            f"no {name} succeeded after PostgreSQL came back"
        assert any(o[0] == name and o[3] == "ok" and o[1] > etcd_up + 2 for o in outcomes), \
            f"no {name} succeeded after the etcd member came back"
    by = {k: sum(o[0] == k and o[3] == "ok" for o in outcomes)
          for k in ("create", "exec", "delete", "step")}
    print(f"{LOAD_S:.0f} s load; PG down {pg_down:.1f}-{pg_up:.1f} s, etcd member down "
          f"{etcd_down:.1f}-{etcd_up:.1f} s: {len(outcomes)} calls ({by} ok), "
          f"{len(failed)} unavailable (slowest of those {slowest_failed:.2f} s), "
          f"slowest call {slowest:.2f} s")

    # Recovery, and nothing half-done.
    c = cluster.client()
    took = wait_for(lambda: c.create(**SMALL).delete() is None, 10, "a create after recovery")
    print(f"recovered: first create {took:.1f} s after the load stopped")
    wait_for(lambda: not [s for s in c.list() if s.state in ("creating", "deleting")], 30,
             "no record left creating/deleting")

    # Nothing acknowledged is lost.
    now = {s.id: s.state for s in c.list()}
    for sid in deleted:
        assert sid not in now, f"{sid}: its delete was acknowledged but the record is {now[sid]}"
    for sid, (sb, acked) in kept.items():
        assert now.get(sid) == "running", f"{sid}: create acknowledged, now {now.get(sid)}"
        have = sb.read_file("acks.txt").decode().split() if acked else []
        assert have == acked, (sid, have, acked)
    node_ids = set(cluster.all_node_ids())
    live = {sid for sid, st in now.items() if st in LIVE}
    assert live == node_ids, ("records vs nodes", live ^ node_ids)
    for tid, log in steps.items():
        assert log, f"{tid}: no step acknowledged"
        info = c.trajectory(tid)
        assert [s.step for s in info.steps[:len(log)]] == [n for n, *_ in log], tid
        assert [s.exit_code for s in info.steps[:len(log)]] == [e for *_, e in log], tid
        sb = c.get(info.sandbox_id)
        # The steps ran in order, each acknowledged one once — but a step executed whose
        # append to the log failed (PostgreSQL gone between the two) was not acknowledged
        # and runs again when re-sent (at-least-once for unacknowledged steps,
        # crates/sandlot-server/src/trajectory.rs).
        ran = [int(x) for x in sb.read_file("steps.txt").decode().split()]
        in_order = [x for i, x in enumerate(ran) if i == 0 or ran[i - 1] != x]
        assert in_order == list(range(info.next_step)), (tid, ran)
        twice = sorted({x for x in ran if ran.count(x) > 1})
        assert all((tid, x) in retried for x in twice), (tid, twice, retried)
        # Answers from the log (one call each, so a sample: every 25th step, the last, and
        # those next to a retried one, where an outage was).
        near = {n + d for (t, n) in retried if t == tid for d in (-1, 0, 1)}
        for n, cmd, out, code in log:
            if n % 25 and n != log[-1][0] and n not in near:
                continue
            r = sb.exec(cmd, step=n)
            assert r.replayed and (r.stdout, r.exit_code) == (out, code), (tid, n, r)
    print(f"checked: {len(kept)} kept sandboxes ({sum(len(a) for _, a in kept.values())} "
          f"exec tokens), {len(deleted)} deletes, "
          f"{sum(len(v) for v in steps.values())} trajectory steps")
    for s in c.list():
        s.delete()
    for tid in steps:
        c.delete_trajectory(tid)


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
