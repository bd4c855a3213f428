#!/usr/bin/env python3
"""Cluster mode vs `sandlot up`, side by side in one run (issue 21, "Benchmarks").

Usage (as root, after scripts/setup.sh; etcd installed; no other local cluster up):

    .venv/bin/python bench/cluster.py [--binary target/release/sandlot] [--write BENCHMARKS.md]

Starts `scripts/cluster.sh up DIR 3` (3 etcd members, 3 `sandlot node`s each in its own
network namespace, one `sandlot server --etcd` on 127.0.0.1) and a `sandlot up` on
127.0.0.1 with the same binary, image store and defaults, then measures on both, in
interleaved rounds (bench/run.py's driver), `function` backend, image `python`:

  K1. create -> first exec result (`true`), concurrency 1, p50/p99 (delete after the
      timed window). Through the cluster the exec goes server -> node over the node API.
      Target: cluster <= 1.3 x embedded + 2 ms (p50 and p99).
  K2. exec round trip (`true`) in one live sandbox, concurrency 1, p50/p99; also the same
      exec sent by the client straight to the sandbox's node API (HTTP/1.1, bearer token),
      so cluster - node is the server's hop. Target: cluster p50 <= embedded p50 + 1 ms.
  K3. creates per second at concurrency 32 (create + delete loop; the rate counts both,
      the latency is the create's), and how the cluster's creates spread over the nodes.

`--simulate N` (issue 22; no root): instead, one etcd member, `sandlot node --simulate N` and
one `sandlot server --etcd`; single creates at concurrency 64 vs `POST /v1/sandboxes:batch`
in the same run (`--rounds` rounds of `--n-single` then `--n-batch`), and with
`--screenshot PATH` a headless-chromium PNG of the server's web page with the N nodes.
With `--baseline B` it runs B's binary and `--binary` alternately (`--alternate` sessions
each, B first, same load) and reports both binaries' creates/s and the ratio.

Every sandbox carries `sandlot-bench=<run id>` and a TTL and is deleted at the end (also on
error, Ctrl-C or SIGTERM); `scripts/cluster.sh down` then removes the cluster. Targets are
printed next to the figures, never asserted.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R  # noqa: E402  (bench/run.py: Server, Api, interleaved, machine, upsert)

CLUSTER_SH = R.REPO / "scripts" / "cluster.sh"
NODES = 3
# Targets (the only place they live): printed next to the figures, never asserted.
TARGET_CREATE_EXEC_RATIO = 1.3  # cluster <= 1.3 x embedded + 2 ms
TARGET_CREATE_EXEC_PLUS_MS = 2.0
TARGET_EXEC_PLUS_MS = 1.0  # cluster exec p50 <= embedded p50 + 1 ms


class Cluster:
    """`scripts/cluster.sh up DIR NODES` / `down DIR` in a temporary directory."""

    def __init__(self, binary: Path, images_dir: Path, nodes: int):
        self.binary = binary
        self.env = dict(os.environ, SANDLOT_BIN=str(binary.resolve()),
                        SANDLOT_IMAGES_DIR=str(images_dir))
        self.nodes = nodes
        self.dir = Path(tempfile.mkdtemp(prefix="sandlot-bench-cluster.", dir="/var/tmp"))
        self.lines: list[str] = []
        self.url = ""

    def up(self) -> None:
        r = subprocess.run([str(CLUSTER_SH), "up", str(self.dir), str(self.nodes)],
                           capture_output=True, text=True, timeout=300, env=self.env)
        if r.returncode != 0:
            raise SystemExit(f"bench: cluster.sh up failed ({r.returncode}):\n{r.stderr[-3000:]}")
        self.lines = r.stdout.splitlines()
        self.url = next(x.split()[1] for x in self.lines if x.startswith("server "))
        R.check_loopback(self.url)

    def node_urls(self) -> dict[str, str]:
        return {x.split()[1]: x.split()[2] for x in self.lines if x.startswith("node ")}

    def down(self) -> None:
        r = subprocess.run([str(CLUSTER_SH), "down", str(self.dir)], capture_output=True,
                           text=True, timeout=300, env=self.env)
        if r.returncode != 0:
            print(f"bench: cluster.sh down failed ({r.returncode}):\n{r.stderr[-2000:]}",
                  file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


class ClusterApi(R.Api):
    """R.Api that also records which node each create landed on (the create's `node`)."""

    def __init__(self, url: str, run_id: str):
        super().__init__(url, run_id)
        self.placed: Counter = Counter()

    def create(self, image: str, ttl_s: int = 900, backend: str = "function", **extra) -> str:
        body = {"backend": backend, "image": image, "ttl_s": ttl_s,
                "labels": {R.BENCH_LABEL: self.run_id}, **extra}
        r = self.request("POST", "/v1/sandboxes", json=body)
        self._check(r, (200, 201), "create")
        j = r.json()
        with self._lock:
            self.live.add(j["id"])
            self.placed[j.get("node") or "(none)"] += 1
        return j["id"]


def create_exec_call(api: R.Api) -> Callable[[], float]:
    """create -> exec `true` timed; delete after the window."""
    def call() -> float:
        t0 = time.perf_counter()
        sid = api.create("python", ttl_s=600)
        res = api.exec(sid, ["/bin/true"])
        lat = time.perf_counter() - t0
        api.delete(sid)
        if res.get("exit_code") != 0:
            raise R.BenchError(f"exec answered {json.dumps(res)[:300]}")
        return lat
    return call


def exec_call(api: R.Api, sid: str) -> Callable[[], float]:
    """exec `true` in the live sandbox `sid`, timed."""
    def call() -> float:
        t0 = time.perf_counter()
        res = api.exec(sid, ["/bin/true"])
        lat = time.perf_counter() - t0
        if res.get("exit_code") != 0:
            raise R.BenchError(f"exec answered {json.dumps(res)[:300]}")
        return lat
    return call


def node_exec_call(node_url: str, token: str, sid: str) -> Callable[[], float]:
    """exec `true` in `sid` straight through its node's API (client -> node, no server):
    `POST /v1/sandboxes/{id}/exec` with `{"request": ExecRequest, "stream": false}`, answered
    by one ndjson frame `{"result": ExecResult}` (crates/sandlot-node-remote/src/wire.rs)."""
    client = R.httpx.Client(base_url=node_url, timeout=60.0,
                            headers={"Authorization": f"Bearer {token}"})
    body = {"request": {"cmd": ["/bin/true"], "timeout_s": 30}, "stream": False}

    def call() -> float:
        t0 = time.perf_counter()
        r = client.post(f"/v1/sandboxes/{sid}/exec", json=body)
        lat = time.perf_counter() - t0
        last = json.loads(r.text.strip().splitlines()[-1]) if r.status_code == 200 else {}
        if (last.get("result") or {}).get("exit_code") != 0:
            raise R.BenchError(f"node exec: HTTP {r.status_code} {r.text[:300]}")
        return lat
    return call


def create_call(api: R.Api) -> Callable[[], float]:
    """create timed; delete after the window (counted in the wall time, so in the rate)."""
    def call() -> float:
        t0 = time.perf_counter()
        sid = api.create("python", ttl_s=600)
        lat = time.perf_counter() - t0
        api.delete(sid)
        return lat
    return call


def render(meta: dict, k1: dict, k2: dict, k3: dict, placed: dict, notes: list[str]) -> str:
    """The BENCHMARKS.md section of one run (K1-K3 as `Sample.to_json` dicts per subject)."""
    m = meta["machine"]
    L = [f"## {meta['date']} UTC — cluster mode (3 nodes) vs `sandlot up`, function backend", ""]
    L.append(f"Command: `{meta['command']}`. Machine: {m['nproc']} cores ({m['cpu']}), "
             f"{m['mem_gib']} GiB, kernel {m['kernel']}, cgroup {m['cgroup']}, load "
             f"{meta['load_before']} before / {meta['load_after']} after; commit {m['commit']}.")
    L.append("Subjects in one run on one host: `scripts/cluster.sh up DIR 3` (3 etcd members, "
             "3 `sandlot node --etcd` in their own network namespaces behind the bridge "
             "`slcbr0`, one `sandlot server --etcd` on 127.0.0.1: every exec goes client -> "
             "server -> node API over the bridge) and `sandlot up` (embedded), same binary, "
             "image store and defaults (warm pool 4 python jails per node / per `up`). "
             f"Image `python`, interleaved rounds of bench/run.py's driver.")
    L.append("")
    L.append("| | cluster p50 ms | p99 ms | embedded p50 ms | p99 ms | p50 ratio | target | |")
    L.append("|---|---:|---:|---:|---:|---:|---|---|")
    c, e = k1["cluster"], k1["embedded"]
    t50 = TARGET_CREATE_EXEC_RATIO * e["p50_ms"] + TARGET_CREATE_EXEC_PLUS_MS
    t99 = TARGET_CREATE_EXEC_RATIO * e["p99_ms"] + TARGET_CREATE_EXEC_PLUS_MS
    L.append(f"| K1. create → first exec (`true`), conc 1, n={c['ok']}/{e['ok']} | "
             f"{R.fmt_ms(c['p50_ms'])} | {R.fmt_ms(c['p99_ms'])} | {R.fmt_ms(e['p50_ms'])} | "
             f"{R.fmt_ms(e['p99_ms'])} | {R.fmt_ratio(R.ratio(c['p50_ms'], e['p50_ms']))} | "
             f"≤ 1.3× + 2 ms: p50 ≤ {R.fmt_ms(t50)}, p99 ≤ {R.fmt_ms(t99)} | "
             f"p50 {R.verdict(c['p50_ms'] <= t50)}, p99 {R.verdict(c['p99_ms'] <= t99)} |")
    c, e = k2["cluster"], k2["embedded"]
    t = e["p50_ms"] + TARGET_EXEC_PLUS_MS
    L.append(f"| K2. exec round trip (`true`), conc 1, n={c['ok']}/{e['ok']} | "
             f"{R.fmt_ms(c['p50_ms'])} | {R.fmt_ms(c['p99_ms'])} | {R.fmt_ms(e['p50_ms'])} | "
             f"{R.fmt_ms(e['p99_ms'])} | {R.fmt_ratio(R.ratio(c['p50_ms'], e['p50_ms']))} | "
             f"p50 ≤ embedded + 1 ms = {R.fmt_ms(t)} | {R.verdict(c['p50_ms'] <= t)} |")
    d = k2["node"]
    L.append(f"| K2'. the same exec straight to the node's API (client → node, no server), "
             f"n={d['ok']} | {R.fmt_ms(d['p50_ms'])} | {R.fmt_ms(d['p99_ms'])} | | | "
             f"{R.fmt_ratio(R.ratio(d['p50_ms'], e['p50_ms']))} | server hop = cluster − node "
             f"p50 = {R.fmt_ms(c['p50_ms'] - d['p50_ms'])} ms | |")
    L.append("")
    c, e = k3["cluster"], k3["embedded"]
    L.append(f"| K3. creates at concurrency {meta['conc']} (create + delete loop) | creates/s | create p50 ms "
             "| p99 ms | errors |")
    L.append("|---|---:|---:|---:|---:|")
    L.append(f"| cluster (3 nodes), n={c['ok']} | {R.fmt_rate(c['rate_per_s'])} | "
             f"{R.fmt_ms(c['p50_ms'])} | {R.fmt_ms(c['p99_ms'])} | {c['errors']} |")
    L.append(f"| embedded, n={e['ok']} | {R.fmt_rate(e['rate_per_s'])} | "
             f"{R.fmt_ms(e['p50_ms'])} | {R.fmt_ms(e['p99_ms'])} | {e['errors']} |")
    L.append(f"| cluster / embedded | {R.fmt_ratio(R.ratio(c['rate_per_s'], e['rate_per_s']))} "
             "| | | |")
    L.append("")
    L.append("Cluster creates per node (K1 + K3): "
             + ", ".join(f"{k} {v}" for k, v in sorted(placed.items())) + ".")
    for s in (k1, k2, k3):
        for who in s:
            if s[who]["errors"] or s[who]["aborted"]:
                L.append(f"Errors ({who}): {s[who]['errors']} {s[who]['error_msgs'][:2]} "
                         f"{s[who]['aborted']}")
    L += [""] + notes
    return "\n".join(L).rstrip() + "\n"



# ----------------------------------------------------------------------------- --simulate

SIM_IMG = R.REPO / "docs" / "img" / "cluster-160-simulated.png"
SIM_CONC_SINGLE = 64
SIM_BATCH = 1000


def cpu_s(pid: int) -> float:
    """utime + stime of `pid`, seconds (proc(5) fields 14, 15); 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


# --simulate: seconds without any client call after the rounds, over which the server's and
# the simulation's CPU are measured (what the server's background work costs at the fill).
SIM_IDLE_S = 10


class SimCluster:
    """One etcd member (scripts/etcd.sh), `sandlot node --simulate N` and one `sandlot server
    --etcd` in a temporary directory; no root, no images. Set before `up()`: `postgres`
    (the server's registry on scripts/postgres.sh instead of SQLite), `nprocs` (the
    simulation split over that many processes, `--name {sim_name}P`, so that one can be
    killed; N must be a multiple)."""

    def __init__(self, binary: Path, nodes: int, cap: int, create_delay_ms: int):
        self.binary, self.nodes, self.cap, self.delay = binary, nodes, cap, create_delay_ms
        self.dir = Path(tempfile.mkdtemp(prefix="sandlot-bench-sim."))
        self.procs: list[subprocess.Popen] = []
        self.sims: list[subprocess.Popen] = []
        self.server: subprocess.Popen | None = None
        self.url = ""
        self.etcd = ""
        self.postgres = False
        self.pg = ""
        self.pg_dir = self.dir / "pg"
        self.nprocs = 1
        self.sim_name = "sim"
        # Set by up(): seconds from the server's spawn to its `listening` line (it reads the
        # node set and asks every node for its sandboxes first), and its RSS then (MiB).
        self.server_start_s = 0.0
        self.server_rss_mib = 0.0

    def _etcd(self, *a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(R.REPO / "scripts" / "etcd.sh"), *a],
                              capture_output=True, text=True, timeout=120)

    def _start_postgres(self) -> None:
        """As scripts/cluster.sh --postgres does; sets `self.pg` (its URL)."""
        import socket
        if os.geteuid() == 0:
            os.chmod(self.dir, 0o755)  # postgres.sh runs the server as `postgres`: let it in
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        r = subprocess.run(["bash", str(R.REPO / "scripts" / "postgres.sh"), "start",
                            str(self.pg_dir), str(port)],
                           capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            raise SystemExit(f"bench: postgres.sh start failed:\n{r.stderr[-2000:]}")
        self.pg = next(x.split()[1] for x in r.stdout.splitlines() if x.startswith("postgres "))

    def up(self) -> None:
        if self.nodes % self.nprocs:
            raise SystemExit(f"bench: {self.nodes} nodes is not a multiple of {self.nprocs} "
                             "simulation processes")
        r = self._etcd("start", str(self.dir / "etcd"), "1")
        if r.returncode != 0:
            raise SystemExit(f"bench: etcd.sh start failed:\n{r.stderr[-2000:]}")
        self.etcd = next(x.split()[1] for x in r.stdout.splitlines() if x.startswith("etcd "))
        if self.postgres:
            self._start_postgres()
        token = self.dir / "node-token"
        token.write_text("bench-sim-token\n")
        env = dict(os.environ, RUST_LOG="error")
        per = self.nodes // self.nprocs
        for p in range(self.nprocs):
            name = self.sim_name if self.nprocs == 1 else f"{self.sim_name}{p}"
            log = open(self.dir / f"{name}.log", "ab")
            sim = subprocess.Popen(
                [str(self.binary), "node", "--simulate", str(per), "--name", name,
                 "--etcd", self.etcd, "--max-sandboxes", str(self.cap),
                 "--sim-create-delay-ms", str(self.delay), "--token-file", str(token)],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            self.procs.append(sim)
            self.sims.append(sim)
            assert sim.stdout is not None
            for line in sim.stdout:
                if "simulated nodes ready" in line:
                    break
            else:
                raise SystemExit(f"bench: the simulation exited; see {self.dir / name}.log")
        slog = open(self.dir / "server.log", "ab")
        pg_args = ["--postgres", self.pg] if self.postgres else []
        t0 = time.perf_counter()
        srv = subprocess.Popen(
            [str(self.binary), "server", "--listen", "127.0.0.1:0", "--etcd", self.etcd,
             "--data-dir", str(self.dir / "server"), "--node-token-file", str(token),
             *pg_args],
            stdout=subprocess.PIPE, stderr=slog, text=True, env=env)
        self.procs.append(srv)
        self.server = srv
        assert srv.stdout is not None
        for line in srv.stdout:
            if line.startswith("sandlot listening on "):
                self.url = line.split()[-1]
                self.server_start_s = time.perf_counter() - t0
                self.server_rss_mib = (R.rss_bytes(srv.pid) or 0) / 2**20
                break
        else:
            raise SystemExit(f"bench: the server exited; see {self.dir / 'server.log'}")
        deadline = time.monotonic() + 120
        while True:
            n = R.httpx.get(f"{self.url}/v1/nodes", timeout=30).json()
            if len(n["nodes"]) >= self.nodes:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: server sees {len(n['nodes'])} of {self.nodes} nodes")
            time.sleep(0.2)

    def down(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
            p.wait()
        self._etcd("stop", str(self.dir / "etcd"))
        if self.postgres:
            subprocess.run(["bash", str(R.REPO / "scripts" / "postgres.sh"), "stop",
                            str(self.pg_dir)], capture_output=True, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)


def sim_single(url: str, n: int, conc: int, labels: dict,
               on_created=None) -> tuple[float, int]:
    """`n` single creates (`POST /v1/sandboxes`, cpu 0.1, 64 MiB, no TTL) from `conc`
    threads: (seconds, errors). `on_created(sandbox_json)` is called for each 201."""
    import threading
    left = [n]
    lock = threading.Lock()
    errors = [0]

    def worker() -> None:
        with R.httpx.Client(base_url=url, timeout=120) as c:
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                r = c.post("/v1/sandboxes", json={"cpu": 0.1, "memory_mib": 64, "ttl_s": 0,
                                                  "labels": labels})
                if r.status_code == 201:
                    if on_created is not None:
                        on_created(r.json())
                else:
                    with lock:
                        errors[0] += 1
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, errors[0]


def sim_batch(url: str, n: int, size: int, labels: dict) -> tuple[float, int]:
    """`n` creates through `POST /v1/sandboxes:batch` of `size` each, one call at a time:
    (seconds, failed items)."""
    failed = 0
    t0 = time.perf_counter()
    with R.httpx.Client(base_url=url, timeout=600) as c:
        left = n
        while left > 0:
            k = min(size, left)
            r = c.post("/v1/sandboxes:batch", json={"count": k, "cpu": 0.1, "memory_mib": 64,
                                                    "ttl_s": 0, "labels": labels})
            if r.status_code != 200:
                raise R.BenchError(f"batch: HTTP {r.status_code} {r.text[:300]}")
            failed += r.json()["failed"]
            left -= k
    return time.perf_counter() - t0, failed


def sim_screenshot(url: str, out: Path) -> None:
    exe = shutil.which("chromium")
    if exe is None:
        print("bench: no chromium; screenshot skipped", file=sys.stderr)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sandlot-chromium-") as profile:
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                            "--no-first-run", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync",
                            f"--user-data-dir={profile}", "--window-size=1400,2200",
                            "--hide-scrollbars", "--virtual-time-budget=8000",
                            f"--screenshot={out}", url + "/"],
                           capture_output=True, text=True, timeout=180)
    if r.returncode != 0 or not out.is_file():
        raise R.BenchError(f"chromium screenshot failed: {r.stderr[-1500:]}")
    print(f"bench: screenshot {out} ({out.stat().st_size} bytes)", flush=True)


def sim_session(binary: Path, args: argparse.Namespace,
                screenshot: str | None = None
                ) -> tuple[list[tuple], int, tuple[float, float], tuple[float, float]]:
    """One simulated cluster on `binary`: `args.rounds` rounds of single then batch creates;
    (per-round (single s, errors, batch s, failed), live sandboxes at the end, (the server's
    start in s, its RSS then in MiB), (server, simulation) cores used over SIM_IDLE_S
    seconds without calls at the end)."""
    c = SimCluster(binary, args.simulate, args.sim_capacity, args.sim_create_delay_ms)
    c.postgres = args.postgres
    rows = []
    try:
        print(f"bench: etcd + {args.simulate} simulated nodes + a server ({binary}) in {c.dir}",
              flush=True)
        c.up()
        labels = {R.BENCH_LABEL: f"sim-{os.getpid()}"}
        for rnd in range(args.rounds):
            s_t, s_err = sim_single(c.url, args.n_single, SIM_CONC_SINGLE, labels)
            b_t, b_err = sim_batch(c.url, args.n_batch, args.batch_size, labels)
            rows.append((s_t, s_err, b_t, b_err))
            print(f"round {rnd}: single {args.n_single / s_t:.1f}/s ({s_err} errors), "
                  f"batch {args.n_batch / b_t:.1f}/s ({b_err} failed)", flush=True)
        live = R.httpx.get(f"{c.url}/healthz", timeout=30).json()["sandboxes"]
        assert c.server is not None
        pids = [c.server.pid] + [s.pid for s in c.sims]
        before = [cpu_s(p) for p in pids]
        time.sleep(SIM_IDLE_S)
        used = [cpu_s(p) - b for p, b in zip(pids, before)]
        idle = (used[0] / SIM_IDLE_S, sum(used[1:]) / SIM_IDLE_S)
        print(f"idle at {live} live: server {idle[0]:.3f} cores, simulation {idle[1]:.3f} cores",
              flush=True)
        if screenshot:
            sim_screenshot(c.url, Path(screenshot))
    finally:
        c.down()
    return rows, live, (c.server_start_s, c.server_rss_mib), idle


def sim_rates(rows: list[tuple], args: argparse.Namespace) -> tuple[float, float]:
    """(single creates/s, batch creates/s) over `rows` (total creates / total seconds)."""
    return (args.n_single * len(rows) / sum(r[0] for r in rows),
            args.n_batch * len(rows) / sum(r[2] for r in rows))


def main_sim_baseline(args: argparse.Namespace, argv: list[str] | None) -> int:
    """`--simulate N --baseline B`: B's binary and `--binary`, alternating (`--alternate`
    sessions each, B first), same load; creates/s of each and the ratio."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    command = ".venv/bin/python bench/cluster.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    load_before = R.loadavg()
    m = R.machine()
    subjects = {"baseline": Path(args.baseline), "candidate": Path(args.binary)}
    rows: dict[str, list[tuple]] = {k: [] for k in subjects}
    starts: dict[str, list[tuple[float, float]]] = {k: [] for k in subjects}
    idles: dict[str, list[tuple[float, float]]] = {k: [] for k in subjects}
    lives: dict[str, list[int]] = {k: [] for k in subjects}
    for i in range(args.alternate):
        for name, binary in subjects.items():
            print(f"bench: session {i + 1}/{args.alternate}: {name}", flush=True)
            r, live, start, idle = sim_session(binary, args)
            rows[name] += r
            starts[name].append(start)
            idles[name].append(idle)
            lives[name].append(live)
    rates = {k: sim_rates(v, args) for k, v in rows.items()}
    L = [f"## {date} UTC — creates into {args.simulate} simulated nodes, candidate vs baseline",
         ""]
    L.append(f"Command: `{command}`. Machine: {m['nproc']} cores ({m['cpu']}), {m['mem_gib']} "
             f"GiB, kernel {m['kernel']}; load {load_before} before / {R.loadavg()} after; "
             f"commit {m['commit']}. Baseline `{subjects['baseline']}`, candidate "
             f"`{subjects['candidate']}`, {args.alternate} sessions each, alternating "
             f"(baseline first); each session: one etcd member, `sandlot node --simulate "
             f"{args.simulate}` (SIMULATED nodes) and one `sandlot server --etcd` ("
             f"{'PostgreSQL' if args.postgres else 'SQLite'} "
             f"registry), {args.rounds} rounds of {args.n_single} single creates (concurrency "
             f"{SIM_CONC_SINGLE}) then {args.n_batch} batch creates ({args.batch_size} per call).")
    L.append("")
    start = {k: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
             for k, v in starts.items()}
    L.append("| | single creates/s | batch creates/s | errors | server start (median) | "
             "server RSS at start (median) |")
    L.append("|---|---:|---:|---:|---:|---:|")
    for k in subjects:
        err = sum(r[1] + r[3] for r in rows[k])
        L.append(f"| {k} | {rates[k][0]:.1f} | {rates[k][1]:.1f} | {err} | "
                 f"{start[k][0]:.2f} s | {start[k][1]:.1f} MiB |")
    L.append(f"| candidate / baseline | {rates['candidate'][0] / rates['baseline'][0]:.2f}× | "
             f"{rates['candidate'][1] / rates['baseline'][1]:.2f}× | | "
             f"{start['candidate'][0] / start['baseline'][0]:.2f}× | "
             f"{start['candidate'][1] / start['baseline'][1]:.2f}× |")
    L.append("")
    L.append("Server start: from spawning `sandlot server` to its `listening` line (it reads "
             "the node set from etcd and asks every node for its sandboxes and checkpoints "
             "first; the nodes hold no sandboxes then); RSS (VmRSS) at that moment. Per "
             "session: " + "; ".join(f"{k} " + ", ".join(f"{a:.2f} s / {b:.0f} MiB"
                                                          for a, b in v)
                                     for k, v in starts.items()) + ".")
    L.append("")
    L.append(f"Idle at the fill: cores used by the server and by the simulation over {SIM_IDLE_S} s "
             "without any client call after the last round (the server's reaper and sweeps, "
             "the nodes' usage publication), per session: " + "; ".join(
                 f"{k} " + ", ".join(f"{a:.3f} / {b:.3f} at {n} live"
                                     for (a, b), n in zip(v, lives[k]))
                 for k, v in idles.items()) + ".")
    L += [""] + args.note
    text = "\n".join(L).rstrip() + "\n"
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": date, "nodes": args.simulate, "subjects": {k: str(v) for k, v in subjects.items()},
            "rows": rows, "server_start_s_rss_mib": starts, "idle_cores_server_sim": idles,
            "live": lives,
            "single_per_s": {k: v[0] for k, v in rates.items()},
            "batch_per_s": {k: v[1] for k, v in rates.items()}}, indent=1))
    if args.write:
        path = Path(args.write)
        old = path.read_text() if path.exists() else ""
        path.write_text(R.upsert_section(old, f"{date[:10]} cluster-sim-ab", text))
        print(f"bench: wrote the section into {path}")
    return 0


def main_simulated(args: argparse.Namespace, argv: list[str] | None) -> int:
    """`--simulate N`: single vs batch creates into N simulated nodes, same run; screenshot."""
    if args.baseline:
        return main_sim_baseline(args, argv)
    binary = Path(args.binary)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    command = ".venv/bin/python bench/cluster.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    load_before = R.loadavg()
    m = R.machine()
    rows, live, (start_s, rss_mib), idle = sim_session(binary, args, args.screenshot)
    st = sum(r[0] for r in rows)
    bt = sum(r[2] for r in rows)
    ns, nb = args.n_single * len(rows), args.n_batch * len(rows)
    single_rate, batch_rate = ns / st, nb / bt
    L = [f"## {date} UTC — batch vs single creates into {args.simulate} simulated nodes", ""]
    L.append(f"Command: `{command}`. Machine: {m['nproc']} cores ({m['cpu']}), {m['mem_gib']} "
             f"GiB, kernel {m['kernel']}; load {load_before} before / {R.loadavg()} after; "
             f"commit {m['commit']}.")
    L.append(f"One etcd member (scripts/etcd.sh), `sandlot node --simulate {args.simulate} "
             f"--max-sandboxes {args.sim_capacity} --sim-create-delay-ms "
             f"{args.sim_create_delay_ms}` (one process; SIMULATED nodes: each sandbox is a "
             "record, nothing runs) and one `sandlot server --etcd` with its "
             f"{'PostgreSQL' if args.postgres else 'SQLite'} registry, "
             "all on this machine. Each round: single creates (`POST /v1/sandboxes`) from "
             f"{SIM_CONC_SINGLE} client threads, then batch creates (`POST "
             f"/v1/sandboxes:batch`, {args.batch_size} per call, one call at a time; the "
             "server runs a batch in chunks of 64, 16 chunks at once). cpu 0.1, 64 MiB, no TTL.")
    L.append("")
    L.append("| | creates | seconds | creates/s | errors |")
    L.append("|---|---:|---:|---:|---:|")
    L.append(f"| single, concurrency {SIM_CONC_SINGLE} | {ns} | {st:.1f} | "
             f"{single_rate:.1f} | {sum(r[1] for r in rows)} |")
    L.append(f"| batch of {args.batch_size} | {nb} | {bt:.1f} | {batch_rate:.1f} | "
             f"{sum(r[3] for r in rows)} |")
    L.append(f"| batch / single | | | {batch_rate / single_rate:.2f}× | |")
    L.append("")
    L.append(f"Server start (spawn → `listening`, the nodes empty): {start_s:.2f} s, RSS then "
             f"{rss_mib:.1f} MiB. Idle at the end ({SIM_IDLE_S} s without calls): server "
             f"{idle[0]:.3f} cores, simulation {idle[1]:.3f} cores.")
    L.append(f"Live sandboxes at the end: {live} (in {args.simulate} simulated nodes). "
             "Per-round figures: " + "; ".join(
                 f"single {args.n_single / r[0]:.1f}/s, batch {args.n_batch / r[2]:.1f}/s"
                 for r in rows) + ".")
    L += [""] + args.note
    text = "\n".join(L).rstrip() + "\n"
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": date, "nodes": args.simulate, "single_creates": ns, "single_s": st,
            "single_per_s": single_rate, "batch_creates": nb, "batch_s": bt,
            "batch_per_s": batch_rate, "rounds": rows, "live": live,
            "server_start_s": start_s, "server_rss_mib": rss_mib,
            "idle_cores_server_sim": idle}, indent=1))
    if args.write:
        path = Path(args.write)
        old = path.read_text() if path.exists() else ""
        path.write_text(R.upsert_section(old, f"{date[:10]} cluster-sim", text))
        print(f"bench: wrote the section into {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    p.add_argument("--images-dir", default="/var/lib/sandlot/images")
    p.add_argument("--n-create", type=int, default=100, help="K1 calls per subject")
    p.add_argument("--n-exec", type=int, default=300, help="K2 calls per subject")
    p.add_argument("--n-conc", type=int, default=320, help="K3 creates per subject")
    p.add_argument("--conc", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", help="write the raw figures here")
    p.add_argument("--write", help="upsert the section into this BENCHMARKS.md")
    p.add_argument("--note", action="append", default=[], help="a line added to the section")
    p.add_argument("--simulate", type=int, metavar="N",
                   help="instead: single vs batch creates into N simulated nodes (no root)")
    p.add_argument("--sim-capacity", type=int, default=2400, help="sandboxes per simulated node")
    p.add_argument("--sim-create-delay-ms", type=int, default=0)
    p.add_argument("--n-single", type=int, default=1000, help="--simulate: single creates per round")
    p.add_argument("--n-batch", type=int, default=3000, help="--simulate: batch creates per round")
    p.add_argument("--batch-size", type=int, default=SIM_BATCH)
    p.add_argument("--baseline", help="--simulate: also run this binary, alternating with "
                   "--binary (same load), and report both and the ratio")
    p.add_argument("--alternate", type=int, default=2,
                   help="--baseline: sessions per binary (default 2)")
    p.add_argument("--postgres", action="store_true",
                   help="--simulate: the server's registry on a PostgreSQL started by "
                   "scripts/postgres.sh (as scripts/cluster.sh --postgres)")
    p.add_argument("--screenshot", help="--simulate: keep a PNG of the web page here "
                   f"(e.g. {SIM_IMG.relative_to(R.REPO)})")
    args = p.parse_args(argv)
    if args.simulate:
        if R.httpx is None:
            raise SystemExit("bench: httpx missing (use .venv/bin/python)")
        return main_simulated(args, argv)
    if R.httpx is None:
        raise SystemExit("bench: httpx missing (use .venv/bin/python after scripts/setup.sh)")
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root (cluster.sh's namespaces, the jails)")
    binary = Path(args.binary)

    def on_term(signum, _frame):
        R.STOP.set()
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    run_id = f"cluster-{os.getpid()}-{int(time.time())}"
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    meta = {"date": date, "conc": args.conc, "load_before": R.loadavg(), "machine": R.machine(),
            "command": ".venv/bin/python bench/cluster.py " + " ".join(
                shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))}
    cluster = Cluster(binary, Path(args.images_dir), NODES)
    embedded = R.Server(binary, Path(args.images_dir), [], 60.0, tmp_parent="/var/tmp")
    apis: list[R.Api] = []
    out: dict = {"meta": meta}
    try:
        print(f"bench: starting the cluster in {cluster.dir} and sandlot up", flush=True)
        cluster.up()
        embedded.start()
        capi = ClusterApi(cluster.url, run_id)
        eapi = R.Api(embedded.url, run_id)
        apis += [capi, eapi]
        capi.prewarm(args.conc)
        eapi.prewarm(args.conc)
        # The nodes' warm pools fill in the background after start; give both a moment.
        time.sleep(5)

        k1 = R.interleaved([("cluster", create_exec_call(capi)),
                            ("embedded", create_exec_call(eapi))],
                           args.n_create, 1, args.rounds, 600.0, warmup=3)
        out["k1"] = {k: v.to_json() for k, v in k1.items()}
        print("K1 create->exec:", {k: (R.fmt_ms(v.p(50)), R.fmt_ms(v.p(99))) for k, v in k1.items()},
              flush=True)

        csid, esid = capi.create("python", ttl_s=900), eapi.create("python", ttl_s=900)
        node = capi.request("GET", f"/v1/sandboxes/{csid}").json()["node"]
        token = (cluster.dir / "node-token").read_text().strip()
        k2 = R.interleaved([("cluster", exec_call(capi, csid)),
                            ("embedded", exec_call(eapi, esid)),
                            ("node", node_exec_call(cluster.node_urls()[node], token, csid))],
                           args.n_exec, 1, args.rounds, 600.0, warmup=5)
        capi.delete(csid)
        eapi.delete(esid)
        out["k2"] = {k: v.to_json() for k, v in k2.items()}
        print("K2 exec:", {k: (R.fmt_ms(v.p(50)), R.fmt_ms(v.p(99))) for k, v in k2.items()},
              flush=True)

        k3 = R.interleaved([("cluster", create_call(capi)),
                            ("embedded", create_call(eapi))],
                           args.n_conc, args.conc, 2, 600.0, warmup=0)
        out["k3"] = {k: v.to_json() for k, v in k3.items()}
        print("K3 creates/s:", {k: R.fmt_rate(v.rate) for k, v in k3.items()}, flush=True)
        out["placed"] = dict(capi.placed)
        print("placed:", dict(capi.placed), flush=True)
        meta["load_after"] = R.loadavg()
        text = render(meta, out["k1"], out["k2"], out["k3"], out["placed"], args.note)
        print(text)
        if args.write:
            path = Path(args.write)
            old = path.read_text() if path.exists() else ""
            path.write_text(R.upsert_section(old, f"{date[:10]} cluster", text))
            print(f"bench: wrote the section into {path}")
    finally:
        R.STOP.set()
        R.join_workers(30.0)
        R.STOP.clear()
        for api in apis:
            failed = api.delete_all()
            if failed:
                print(f"bench: {len(failed)} sandboxes not deleted: {failed[:5]}", file=sys.stderr)
            api.close()
        embedded.stop()
        embedded.cleanup_dir()
        cluster.down()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
