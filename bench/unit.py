#!/usr/bin/env python3
"""A whole simulated unit in one run: 384,000 sandboxes in 160 SIMULATED nodes (issue 22,
"Benchmarks").

Usage (no root needed; as root PostgreSQL runs as the `postgres` user; etcd and Debian's
PostgreSQL installed, scripts/setup.sh):

    .venv/bin/python bench/unit.py [--fill 384000] [--write BENCHMARKS.md]
    .venv/bin/python bench/unit.py --fill 40000             # a quick smaller run
    .venv/bin/python bench/unit.py --from-json RUN.json --write BENCHMARKS.md  # re-render

Starts, all on this machine, in a temporary directory: one etcd member (scripts/etcd.sh),
PostgreSQL (scripts/postgres.sh), `--procs` processes of `sandlot node --simulate
NODES/PROCS` (so one process, 16 identities by default, can be SIGKILLed alone: the
identities of one process share its runtime and cannot be killed one by one) and one
`sandlot server --etcd --postgres`. Then, in this order:

  U1. fill to `--fill` live sandboxes through the API: `--n-single` single creates (`POST
      /v1/sandboxes`, 64 client threads), then batches (`POST /v1/sandboxes:batch` of 1000,
      `--batch-conc` calls at once) up to `--fill` - `--job`; wall time, creates/s (whole
      phase and its last quarter, "sustained"), CPU and memory of server, PostgreSQL, etcd
      and the simulation per phase. Targets: batch >= 5,000/s, single >= 1,000/s.
  U2. one job of `--job` (32,768) sandboxes labelled `job=big` as batches, `--batch-conc`
      calls at once: time until every one is `running` (confirmed by a list by label).
      Target <= 15 s.
  U3. at `--fill` live: GET and exec (`/bin/true`) of random sandboxes through the server,
      concurrency 1, p50/p99 (target p99 <= 50 ms each); list by label of the 32k job
      (`GET /v1/sandboxes?label=job=big`) p50/p99; pause and resume of the job by label
      (`POST /v1/sandboxes:pause|:resume`), seconds each (target <= 10 s).
  U4. SIGKILL of one simulation process (16 nodes) at full load: seconds until every one of
      its sandboxes is `lost` (`sandlot_sandboxes{state="lost"}` on /metrics), execs on the
      other nodes during that window (errors, p99), and afterwards a sample of the others
      still `running` and the lost count exactly the killed nodes' sandboxes.

Also the per-sandbox costs an extrapolation needs (server RSS per 1k sandboxes, PostgreSQL
commits, rows and bytes per create, etcd puts per create; docs/operations.md "Extrapolation
to a real DSec-size unit"). Targets are printed next to the figures, never asserted. The
whole cluster is thrown away at the end (nothing is deleted one by one).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster as C  # noqa: E402  (bench/cluster.py: SimCluster)
import run as R  # noqa: E402  (bench/run.py: machine, upsert_section, percentile)

# Targets (the only place they live): printed next to the figures, never asserted.
T_BATCH_PER_S = 5000.0
T_SINGLE_PER_S = 1000.0
T_ROUTE_P99_MS = 50.0
T_PAUSE_S = 10.0
T_JOB_READY_S = 15.0
CONC_SINGLE = 64
BATCH = 1000  # sandlot_api::MAX_BATCH
BODY = {"cpu": 0.1, "memory_mib": 64, "ttl_s": 0}


class UnitCluster(C.SimCluster):
    """SimCluster with PostgreSQL for the server's registry and the simulation split over
    `procs` processes (`sandlot node --simulate nodes/procs --name uP`, identities `uP-000`
    ...), so that one process can be killed."""

    def __init__(self, binary: Path, nodes: int, cap: int, create_delay_ms: int, procs: int):
        super().__init__(binary, nodes, cap, create_delay_ms)
        self.postgres = True
        self.nprocs = procs
        self.sim_name = "u"

    def pids(self) -> dict[str, list[int]]:
        """Live pids by component (PostgreSQL: the postmaster and its children)."""
        out: dict[str, list[int]] = {"server": [], "postgres": [], "etcd": [], "sim": []}
        if self.server and self.server.poll() is None:
            out["server"] = [self.server.pid]
        out["sim"] = [s.pid for s in self.sims if s.poll() is None]
        for f in (self.dir / "etcd").glob("m*.pid"):
            try:
                out["etcd"].append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        try:
            pm = int((self.pg_dir / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return out
        out["postgres"] = [pm] + [p for p in _all_pids() if _ppid(p) == pm]
        return out

    def psql(self, sql: str) -> list[str]:
        """One row of `sql`'s answer, fields split on `|` (psql -tA)."""
        bindir = next((Path(f"/usr/lib/postgresql/{v}/bin") for v in (17, 16, 15)
                       if Path(f"/usr/lib/postgresql/{v}/bin/psql").exists()), None)
        exe = str(bindir / "psql") if bindir else "psql"
        r = subprocess.run([exe, self.pg, "-tA", "-c", sql], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise R.BenchError(f"psql: {r.stderr[-500:]}")
        return r.stdout.strip().split("|")


# ----------------------------------------------------------------------------- sampling


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _mem_kib(pid: int) -> int:
    """Proportional set size (PSS, shared pages split between sharers) of `pid` in KiB, or
    its RSS where smaps_rollup cannot be read."""
    for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


class Sampler(threading.Thread):
    """Every `period` s: CPU seconds (cumulative per pid, so an exited PostgreSQL backend's
    time is kept) and memory (PSS, KiB) per component. `mark(name)` opens a phase;
    `phases()` gives per phase: wall s, CPU cores used on average, peak memory MiB."""

    def __init__(self, cluster: UnitCluster, period: float = 1.0):
        super().__init__(daemon=True)
        self.c, self.period = cluster, period
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.cpu_by_pid: dict[tuple[str, int], float] = {}
        self.marks: list[tuple[str, float, dict[str, float]]] = []
        self.peak: dict[str, dict[str, int]] = {}
        self.cur = ""
        self.last_mem: dict[str, int] = {}

    def _sample(self) -> None:
        mem: Counter = Counter()
        for comp, pids in self.c.pids().items():
            for p in pids:
                t = C.cpu_s(p)
                if t:
                    self.cpu_by_pid[(comp, p)] = t
                mem[comp] += _mem_kib(p)
        with self.lock:
            self.last_mem = dict(mem)
            pk = self.peak.setdefault(self.cur, {})
            for k, v in mem.items():
                pk[k] = max(pk.get(k, 0), v)
            pk["load1"] = max(pk.get("load1", 0), int(os.getloadavg()[0] * 1024))

    def cpu_totals(self) -> dict[str, float]:
        tot: Counter = Counter()
        for (comp, _), t in self.cpu_by_pid.items():
            tot[comp] += t
        return dict(tot)

    def mark(self, name: str) -> None:
        self._sample()
        with self.lock:
            self.marks.append((name, time.monotonic(), self.cpu_totals()))
            self.cur = name

    def mem_now(self) -> dict[str, int]:
        self._sample()
        with self.lock:
            return dict(self.last_mem)

    def run(self) -> None:
        while not self.stop_ev.wait(self.period):
            self._sample()

    def phases(self) -> list[dict]:
        out = []
        for (name, t0, c0), (_, t1, c1) in zip(self.marks, self.marks[1:]):
            wall = t1 - t0
            out.append({"phase": name, "wall_s": wall,
                        "cores": {k: (c1.get(k, 0.0) - c0.get(k, 0.0)) / wall
                                  for k in ("server", "postgres", "etcd", "sim")},
                        "peak_mib": {k: v / 1024 for k, v in self.peak.get(name, {}).items()}})
        return out


# ----------------------------------------------------------------------------- stats


def pg_stats(c: UnitCluster) -> dict:
    """Cumulative counters of database `sandlot` (pg_stat_database) and its size, bytes."""
    v = c.psql("SELECT xact_commit, tup_inserted, tup_updated, tup_deleted, "
               "pg_database_size('sandlot'), w.wal_records, w.wal_bytes, w.wal_sync "
               "FROM pg_stat_database, pg_stat_wal w WHERE datname = 'sandlot'")
    return dict(zip(("commits", "inserted", "updated", "deleted", "bytes", "wal_records",
                     "wal_bytes", "wal_syncs"), map(int, v)))


def etcd_stats(url: str) -> dict:
    """etcd's puts, committed proposals and database size from its /metrics."""
    text = R.httpx.get(f"{url}/metrics", timeout=30).text
    want = {"etcd_mvcc_put_total": "puts", "etcd_server_proposals_committed_total": "proposals",
            "etcd_mvcc_db_total_size_in_bytes": "bytes", "etcd_mvcc_txn_total": "txns"}
    out = {}
    for line in text.splitlines():
        k = line.split(" ")[0]
        if k in want:
            out[want[k]] = float(line.split()[-1])
    return out


def lost_count(url: str, client=None) -> int:
    """`sandlot_sandboxes{state="lost"}` summed over backends, from the server's /metrics."""
    text = (client or R.httpx).get(f"{url}/metrics", timeout=60).text
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("sandlot_sandboxes{") and 'state="lost"' in line))


def pcts(lat: list[float]) -> dict:
    """p50/p99/max in ms of latencies in seconds."""
    if not lat:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(lat), "p50_ms": R.percentile(lat, 50) * 1e3,
            "p99_ms": R.percentile(lat, 99) * 1e3, "max_ms": max(lat) * 1e3}


# ----------------------------------------------------------------------------- load


class Ledger:
    """Every created sandbox's (id, node), and creates per 10 s window."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ids: list[tuple[str, str]] = []
        self.done_at: list[float] = []

    def add(self, sid: str, node: str) -> None:
        with self.lock:
            self.ids.append((sid, node))
            self.done_at.append(time.monotonic())


def fill_single(url: str, n: int, labels: dict, led: Ledger) -> tuple[float, int]:
    """`n` single creates from CONC_SINGLE threads: (seconds, errors)."""
    return C.sim_single(url, n, CONC_SINGLE, labels,
                        on_created=lambda j: led.add(j["id"], j.get("node") or ""))


def fill_batches(url: str, n: int, conc: int, label_of, led: Ledger,
                 max_rounds: int = 5) -> tuple[float, int, int]:
    """`n` creates as batches of BATCH, `conc` calls at once; `label_of(i)` labels batch i.
    Failed items are sent again (up to `max_rounds` passes). (seconds, created, failed
    items summed over passes)."""
    failed_total = 0
    created = [0]
    t0 = time.perf_counter()
    want = n
    for _ in range(max_rounds):
        if want <= 0:
            break
        sizes = [BATCH] * (want // BATCH) + ([want % BATCH] if want % BATCH else [])
        q = list(enumerate(sizes))
        lock = threading.Lock()
        failed = [0]
        errs: list[str] = []

        def worker() -> None:
            with R.httpx.Client(base_url=url, timeout=600) as cl:
                while True:
                    with lock:
                        if not q:
                            return
                        i, k = q.pop(0)
                    r = cl.post("/v1/sandboxes:batch",
                                json={**BODY, "count": k, "labels": label_of(i)})
                    if r.status_code != 200:
                        with lock:
                            failed[0] += k
                            errs.append(f"HTTP {r.status_code} {r.text[:200]}")
                        continue
                    j = r.json()
                    for it in j["results"]:
                        if it["status"] in (200, 201):
                            led.add(it["sandbox"]["id"], it["sandbox"].get("node") or "")
                    with lock:
                        failed[0] += j["failed"]
                        created[0] += j["created"]
                        if j["failed"] and len(errs) < 5:
                            errs.append(next((json.dumps(it.get("error")) for it in j["results"]
                                              if it["status"] not in (200, 201)), ""))
        ts = [threading.Thread(target=worker) for _ in range(conc)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if failed[0]:
            print(f"bench: {failed[0]} batch items failed ({errs[:2]}); sending them again",
                  flush=True)
        failed_total += failed[0]
        want = failed[0]
    return time.perf_counter() - t0, created[0], failed_total


def timed_calls(fn, n: int) -> tuple[list[float], int, list[str]]:
    lat, errors, msgs = [], 0, []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            fn()
            lat.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 (counted and shown)
            errors += 1
            if len(msgs) < 3:
                msgs.append(str(e)[:200])
    return lat, errors, msgs


# ----------------------------------------------------------------------------- run


def run_unit(args: argparse.Namespace) -> dict:
    binary = Path(args.binary)
    c = UnitCluster(binary, args.nodes, args.capacity, args.sim_create_delay_ms, args.procs)
    res: dict = {"nodes": args.nodes, "procs": args.procs, "capacity": args.capacity}
    led = Ledger()
    sampler = Sampler(c)
    rng = random.Random(22)
    try:
        print(f"bench: etcd + PostgreSQL + {args.procs} x `sandlot node --simulate "
              f"{args.nodes // args.procs}` + a server in {c.dir}", flush=True)
        c.up()
        url = c.url
        sampler.start()
        cl = R.httpx.Client(base_url=url, timeout=600)
        pg0, et0, mem0 = pg_stats(c), etcd_stats(c.etcd), sampler.mem_now()
        # An idle minute's worth of baseline: etcd/PostgreSQL/server load of the 160
        # identities' keep-alives and usage updates with no API traffic.
        sampler.mark("idle")
        time.sleep(args.idle_s)

        # U1: fill.
        n_job = min(args.job, args.fill)
        n_single = min(args.n_single, args.fill - n_job)
        n_batch = args.fill - n_job - n_single
        sampler.mark("fill: single creates")
        s_t, s_err = fill_single(url, n_single, {"job": "single"}, led)
        res["single"] = {"n": n_single, "s": s_t, "errors": s_err,
                         "per_s": (n_single - s_err) / s_t if s_t else None}
        print(f"U1 single: {n_single} in {s_t:.1f} s = {res['single']['per_s']:.0f}/s, "
              f"{s_err} errors", flush=True)
        sampler.mark("fill: batches")
        pg1, et1 = pg_stats(c), etcd_stats(c.etcd)
        mark0 = len(led.done_at)
        t_b0 = time.monotonic()
        b_t, b_made, b_failed = fill_batches(
            url, n_batch, args.batch_conc, lambda i: {"job": f"fill-{i * BATCH // 32768}"}, led)
        t_b1 = time.monotonic()
        # Sustained: the last quarter of the batch phase's wall time.
        q0 = t_b1 - (t_b1 - t_b0) / 4
        last_q = sum(1 for t in led.done_at[mark0:] if t >= q0)
        res["batch"] = {"n": n_batch, "made": b_made, "s": b_t, "failed_items": b_failed,
                        "per_s": b_made / b_t if b_t else None,
                        "last_quarter_per_s": last_q / ((t_b1 - t_b0) / 4) if b_t else None}
        pg2, et2 = pg_stats(c), etcd_stats(c.etcd)
        print(f"U1 batch: {b_made} in {b_t:.1f} s = {res['batch']['per_s']:.0f}/s "
              f"(last quarter {res['batch']['last_quarter_per_s']:.0f}/s), "
              f"{b_failed} failed items", flush=True)

        # U2: the 32k job.
        sampler.mark(f"job: batch of {n_job:,}")
        j_t, j_made, j_failed = fill_batches(url, n_job, args.batch_conc,
                                             lambda i: {"job": "big"}, led)
        t = time.perf_counter()
        lst = cl.get("/v1/sandboxes", params={"label": "job=big"}).json()["sandboxes"]
        running = sum(1 for s in lst if s["state"] == "running")
        j_total = j_t + (time.perf_counter() - t)
        res["job"] = {"n": n_job, "made": j_made, "failed_items": j_failed, "s": j_total,
                      "running": running}
        print(f"U2 job of {n_job}: {running} running after {j_total:.1f} s "
              f"({j_failed} failed items)", flush=True)
        pg3, et3 = pg_stats(c), etcd_stats(c.etcd)
        live = cl.get("/healthz").json().get("sandboxes")
        res["live"] = live
        res["fill_wall_s"] = s_t + b_t + j_t
        mem_full = sampler.mem_now()

        # U3: at full load.
        sampler.mark("at full load: get/exec/list/pause/resume")
        ids = [sid for sid, _ in led.ids]
        sample = [rng.choice(ids) for _ in range(args.n_route)]
        it = iter(sample)

        def get_one() -> None:
            r = cl.get(f"/v1/sandboxes/{next(it)}")
            if r.status_code != 200:
                raise R.BenchError(f"get: HTTP {r.status_code} {r.text[:200]}")
        lat, err, msgs = timed_calls(get_one, args.n_route)
        res["get"] = {**pcts(lat), "errors": err, "msgs": msgs}
        it2 = iter([rng.choice(ids) for _ in range(args.n_route)])

        def exec_one() -> None:
            r = cl.post(f"/v1/sandboxes/{next(it2)}/exec", json={"cmd": ["/bin/true"]})
            if r.status_code != 200 or r.json().get("exit_code") != 0:
                raise R.BenchError(f"exec: HTTP {r.status_code} {r.text[:200]}")
        lat, err, msgs = timed_calls(exec_one, args.n_route)
        res["exec"] = {**pcts(lat), "errors": err, "msgs": msgs}
        print(f"U3 get {res['get']}, exec {res['exec']}", flush=True)

        sizes = []

        def list_one() -> None:
            r = cl.get("/v1/sandboxes", params={"label": "job=big"})
            if r.status_code != 200:
                raise R.BenchError(f"list: HTTP {r.status_code}")
            sizes.append(len(r.json()["sandboxes"]))
        lat, err, msgs = timed_calls(list_one, args.n_list)
        res["list"] = {**pcts(lat), "errors": err, "msgs": msgs,
                       "size": sizes[0] if sizes else 0}
        for verb in ("pause", "resume"):
            t = time.perf_counter()
            r = cl.post(f"/v1/sandboxes:{verb}", json={"labels": {"job": "big"}})
            d = time.perf_counter() - t
            j = r.json() if r.status_code == 200 else {}
            why = Counter((f.get("error") or {}).get("message", "")[:160]
                          for f in j.get("failed", []))
            res[verb] = {"s": d, "status": r.status_code, "changed": len(j.get("sandboxes", [])),
                         "failed": len(j.get("failed", [])), "why": why.most_common(3)}
            print(f"U3 {verb} by label: {res[verb]}", flush=True)
        print(f"U3 list by label: {res['list']}", flush=True)

        # U4: kill one simulation process.
        victim = 0
        prefix = f"u{victim}-"
        on_victim = [sid for sid, node in led.ids if node.startswith(prefix)]
        others = [sid for sid, node in led.ids if not node.startswith(prefix)]
        lost_before = lost_count(url, cl)
        sampler.mark(f"kill {args.nodes // args.procs} nodes -> lost")
        stop = threading.Event()
        during: list[float] = []
        during_err = [0]

        def exec_others() -> None:
            with R.httpx.Client(base_url=url, timeout=120) as c2:
                while not stop.is_set():
                    sid = rng.choice(others)
                    t0 = time.perf_counter()
                    r = c2.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["/bin/true"]})
                    if r.status_code == 200 and r.json().get("exit_code") == 0:
                        during.append(time.perf_counter() - t0)
                    else:
                        during_err[0] += 1
                    time.sleep(0.02)
        ex = threading.Thread(target=exec_others, daemon=True)
        ex.start()
        t_kill = time.monotonic()
        c.sims[victim].send_signal(signal.SIGKILL)
        c.sims[victim].wait()
        first = None
        seen = lost_before
        deadline = t_kill + args.lost_timeout_s
        while time.monotonic() < deadline:
            seen = lost_count(url, cl)
            now = time.monotonic() - t_kill
            if first is None and seen > lost_before:
                first = now
            if seen - lost_before >= len(on_victim):
                break
            # /metrics counts every record (a GROUP BY over the table): poll gently so the
            # poll does not compete with the sweep it measures.
            time.sleep(1.0)
        all_lost = time.monotonic() - t_kill if seen - lost_before >= len(on_victim) else None
        stop.set()
        ex.join()
        time.sleep(2)
        final_lost = lost_count(url, cl) - lost_before
        chk = rng.sample(others, min(args.n_check, len(others)))
        still = sum(1 for sid in chk
                    if cl.get(f"/v1/sandboxes/{sid}").json().get("state") == "running")
        res["kill"] = {"nodes": args.nodes // args.procs, "sandboxes": len(on_victim),
                       "first_lost_s": first, "all_lost_s": all_lost, "lost": final_lost,
                       "lost_when_stopped": seen - lost_before,
                       "timeout_s": args.lost_timeout_s, "checked": len(chk),
                       "checked_running": still, "exec_during": pcts(during),
                       "exec_during_errors": during_err[0]}
        print(f"U4 kill: {res['kill']}", flush=True)
        sampler.mark("end")
        pg4, et4 = pg_stats(c), etcd_stats(c.etcd)
        res["phases"] = sampler.phases()
        res["pg"] = [pg0, pg1, pg2, pg3, pg4]
        res["etcd"] = [et0, et1, et2, et3, et4]
        res["mem0_kib"], res["mem_full_kib"] = mem0, mem_full
        res["pg_settings"] = c.psql("SELECT current_setting('synchronous_commit'), "
                                    "current_setting('fsync'), current_setting('shared_buffers')")
        res["rows_by_state"] = c.psql(
            "SELECT string_agg(relname || '=' || n_live_tup, ',') FROM pg_stat_user_tables "
            "WHERE n_live_tup > 1000")
        cl.close()
    finally:
        sampler.stop_ev.set()
        if args.keep:
            print(f"bench: --keep: cluster left up in {c.dir}", flush=True)
        else:
            c.down()
    return res


# ----------------------------------------------------------------------------- render


def _f(v, fmt="{:.1f}", none="—"):
    return none if v is None else fmt.format(v)


def costs(res: dict) -> dict:
    """Per-create and per-sandbox costs over the whole fill (single + batch + job creates:
    counters pg[0] -> pg[3], etcd[0] -> etcd[3]; memory growth from idle to full); CPU cores
    of the batch phase (or of the job phase when there was no batch phase)."""
    n = max(res.get("live") or 1, 1)
    p0, p3 = res["pg"][0], res["pg"][3]
    e0, e3 = res["etcd"][0], res["etcd"][3]
    wall = max(res["fill_wall_s"], 1e-9)
    m0, m1 = res["mem0_kib"], res["mem_full_kib"]
    ph = {p["phase"]: p for p in res["phases"]}
    bp = ph.get("fill: batches", {}) if res["batch"]["made"] else next(
        (p for p in res["phases"] if p["phase"].startswith("job:")), {})
    rows = (p3["inserted"] - p0["inserted"]) + (p3["updated"] - p0["updated"]) + (
        p3["deleted"] - p0["deleted"])
    wal = {k: (p3.get(k, 0) - p0.get(k, 0)) for k in ("wal_records", "wal_bytes", "wal_syncs")}
    return {
        "pg_wal_bytes_per_create": wal["wal_bytes"] / n,
        "pg_wal_syncs_per_s": wal["wal_syncs"] / wall,
        "pg_wal_syncs_per_create": wal["wal_syncs"] / n,
        "pg_commits_per_create": (p3["commits"] - p0["commits"]) / n,
        "pg_rows_per_create": rows / n,
        "pg_bytes_per_sandbox": (p3["bytes"] - p0["bytes"]) / n,
        "etcd_puts_per_create": (e3.get("puts", 0) - e0.get("puts", 0)) / n,
        "etcd_db_mib": e3.get("bytes", 0) / 2**20,
        "server_mib_per_1k": (m1.get("server", 0) - m0.get("server", 0)) / 1024 / (n / 1000),
        "pg_mib_per_1k": (m1.get("postgres", 0) - m0.get("postgres", 0)) / 1024 / (n / 1000),
        "sim_mib_per_1k": (m1.get("sim", 0) - m0.get("sim", 0)) / 1024 / (n / 1000),
        "server_cores": bp.get("cores", {}).get("server"),
        "pg_cores": bp.get("cores", {}).get("postgres"),
        "etcd_cores": bp.get("cores", {}).get("etcd"),
        "pg_commits_per_s": (p3["commits"] - p0["commits"]) / wall,
        "pg_rows_per_s": rows / wall,
        "creates_per_s": n / wall,
    }


def render(meta: dict, res: dict) -> str:
    m = meta["machine"]
    k = res["kill"]
    cs = costs(res)
    has_wal = "wal_syncs" in res["pg"][0]
    per = res["nodes"] // res["procs"]
    L = [f"## {meta['date']} UTC — a simulated unit: {res['live']:,} sandboxes in "
         f"{res['nodes']} SIMULATED nodes, PostgreSQL + etcd (issue 22)", ""]
    L.append(f"Command: `{meta['command']}`. Machine: {m['nproc']} cores ({m['cpu']}), "
             f"{m['mem_gib']} GiB, kernel {m['kernel']}; load {meta['load_before']} before / "
             f"{meta['load_after']} after (shared with other work); commit {m['commit']}.")
    L.append(f"All on this machine: one etcd member (scripts/etcd.sh), PostgreSQL 15 "
             f"(scripts/postgres.sh; synchronous_commit={res['pg_settings'][0]}, "
             f"fsync={res['pg_settings'][1]}, shared_buffers={res['pg_settings'][2]}), "
             f"{res['procs']} processes of `sandlot node --simulate {per} --max-sandboxes "
             f"{res['capacity']}` (SIMULATED nodes: each sandbox is an in-memory record, exec "
             "runs nothing; one process per 16 identities so that 16 can be SIGKILLed at "
             "once — the identities of one process cannot be killed one by one) and one "
             "`sandlot server --etcd --postgres`. Client: this script's Python threads (httpx) "
             "on the same 2 cores. Creates: cpu 0.1, 64 MiB, no TTL.")
    L.append("")
    L.append("| measurement | figure | target | |")
    L.append("|---|---:|---|---|")
    s, b, j = res["single"], res["batch"], res["job"]
    L.append(f"| U1. fill to {res['live']:,} live: wall time | {res['fill_wall_s']:.0f} s | | |")
    L.append(f"| U1. single creates (`POST /v1/sandboxes`), concurrency {CONC_SINGLE}, "
             f"n={s['n']:,} ({s['errors']} errors) | {_f(s['per_s'])}/s | ≥ 1,000/s | "
             f"{R.verdict(s['per_s'] is not None and s['per_s'] >= T_SINGLE_PER_S)} |")
    L.append(f"| U1. batch creates (1000 per call, {meta['batch_conc']} calls at once), "
             f"n={b['made']:,} ({b['failed_items']} items failed and were resent): whole "
             f"phase | {_f(b['per_s'])}/s | ≥ 5,000/s | "
             f"{R.verdict(b['per_s'] is not None and b['per_s'] >= T_BATCH_PER_S)} |")
    L.append(f"| U1. batch creates, sustained (last quarter of the phase) | "
             f"{_f(b['last_quarter_per_s'])}/s | ≥ 5,000/s | "
             f"{R.verdict(b['last_quarter_per_s'] is not None and b['last_quarter_per_s'] >= T_BATCH_PER_S)} |")
    L.append(f"| U2. one job of {j['n']:,} (`job=big`, {-(-j['n'] // BATCH)} batch calls, "
             f"{meta['batch_conc']} at once) → all `running` ({j['running']:,} listed "
             f"running) | {j['s']:.1f} s | ≤ 15 s | "
             f"{R.verdict(j['s'] <= T_JOB_READY_S and j['running'] == j['n'])} |")
    for key, what in (("get", "GET /v1/sandboxes/{id}"), ("exec", "exec `/bin/true`")):
        g = res[key]
        L.append(f"| U3. {what} of a random sandbox at {res['live']:,} live, conc 1, "
                 f"n={g['n']} ({g['errors']} errors): p50 / p99 | {_f(g['p50_ms'], '{:.2f}')} / "
                 f"{_f(g['p99_ms'], '{:.2f}')} ms | p99 ≤ 50 ms | "
                 f"{R.verdict(g['p99_ms'] is not None and g['p99_ms'] <= T_ROUTE_P99_MS and not g['errors'])} |")
    g = res["list"]
    L.append(f"| U3. list by label of the job (`GET /v1/sandboxes?label=job=big`, "
             f"{g['size']:,} sandboxes), n={g['n']}: p50 / p99 | {_f(g['p50_ms'], '{:.0f}')} / "
             f"{_f(g['p99_ms'], '{:.0f}')} ms | | |")
    for verb in ("pause", "resume"):
        g = res[verb]
        L.append(f"| U3. {verb} the job by label (`POST /v1/sandboxes:{verb}`; {g['changed']:,} "
                 f"changed, {g['failed']} failed, HTTP {g['status']}) | {g['s']:.1f} s | "
                 f"≤ 10 s | {R.verdict(g['s'] <= T_PAUSE_S and g['changed'] == j['n'])} |")
    not_all = (f"not within {k['timeout_s']:.0f} s "
               f"({k['lost_when_stopped']:,} lost by then)")
    L.append(f"| U4. SIGKILL of one simulation process ({k['nodes']} nodes, "
             f"{k['sandboxes']:,} sandboxes; lease TTL 5 s): first `lost` / all `lost` | "
             f"{_f(k['first_lost_s'])} / {_f(k['all_lost_s'], none=not_all)} s | "
             "(no target) | |")
    if k["first_lost_s"] is not None and k["lost_when_stopped"]:
        end = k["all_lost_s"] or k["timeout_s"]
        # Polled once a second: a sweep within one poll has no rate to show.
        rate = ("all at the first poll that saw any (one sweep, under the 1 s poll period)"
                if end - k["first_lost_s"] < 1.0 else
                f"{k['lost_when_stopped'] / (end - k['first_lost_s']):.0f} sandboxes/s")
        L.append(f"| U4. lost-node sweep rate (first → last `lost`) | {rate} | | |")
    ed = k["exec_during"]
    L.append(f"| U4. the rest: exec on other nodes during that window, n={ed['n']}, "
             f"{k['exec_during_errors']} errors: p50 / p99 | {_f(ed['p50_ms'], '{:.2f}')} / "
             f"{_f(ed['p99_ms'], '{:.2f}')} ms | unaffected | "
             f"{R.verdict(k['exec_during_errors'] == 0)} |")
    L.append(f"| U4. afterwards: lost = killed nodes' sandboxes; others sampled `running` | "
             f"{k['lost']:,} of {k['sandboxes']:,}; {k['checked_running']} of {k['checked']} | "
             f"exact; all | {R.verdict(k['lost'] == k['sandboxes'] and k['checked_running'] == k['checked'])} |")
    for verb in ("pause", "resume"):
        if res[verb]["failed"]:
            L.append("")
            L.append(f"{verb.capitalize()} failures by message (count): " + "; ".join(
                f"{n} × {m!r}" for m, n in res[verb].get("why", [])) + ".")
    L.append("")
    L.append("Resources per phase (CPU: cores used on average over the phase, from "
             "/proc/PID/stat; memory: peak PSS, MiB; PostgreSQL = postmaster + backends):")
    L.append("")
    L.append("| phase | wall s | server cores | MiB | PostgreSQL cores | MiB | etcd cores | MiB "
             "| simulation cores | MiB | peak 1-min load |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in res["phases"]:
        c, pk = p["cores"], p["peak_mib"]
        L.append(f"| {p['phase']} | {p['wall_s']:.0f} | " + " | ".join(
            f"{c.get(x, 0):.2f} | {pk.get(x, 0):.0f}" for x in ("server", "postgres", "etcd", "sim"))
            + f" | {pk.get('load1', 0):.1f} |")
    L.append("")
    L.append("Costs for an extrapolation (docs/operations.md \"Extrapolation to a real DSec-size "
             "unit\"), over the whole fill: "
             f"{cs['pg_commits_per_create']:.2f} PostgreSQL transactions (xact_commit, "
             f"read-only ones included), {cs['pg_rows_per_create']:.2f} rows written "
             f"(inserted + updated + deleted)"
             + (f", {cs['pg_wal_bytes_per_create']:.0f} bytes of WAL and "
                f"{cs['pg_wal_syncs_per_create']:.3f} WAL fsyncs" if has_wal else "")
             + f" per create ({cs['pg_commits_per_s']:.0f} transactions/s, "
             f"{cs['pg_rows_per_s']:.0f} rows/s"
             + (f", {cs['pg_wal_syncs_per_s']:.0f} WAL fsyncs/s" if has_wal else "")
             + " at "
             f"{cs['creates_per_s']:.0f} creates/s); "
             f"{cs['pg_bytes_per_sandbox']:.0f} bytes of database per live sandbox; "
             f"{cs['etcd_puts_per_create']:.3f} etcd puts per create (etcd database "
             f"{cs['etcd_db_mib']:.1f} MiB); memory per 1,000 live sandboxes: server "
             f"{cs['server_mib_per_1k']:.2f} MiB, PostgreSQL {cs['pg_mib_per_1k']:.2f} MiB, "
             f"simulation {cs['sim_mib_per_1k']:.2f} MiB. Tables: {res['rows_by_state'][0]}.")
    L += [""] + meta["notes"]
    return "\n".join(L).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    p.add_argument("--nodes", type=int, default=160, help="simulated nodes")
    p.add_argument("--procs", type=int, default=10, help="simulation processes (nodes / procs "
                   "identities each; U4 kills one)")
    p.add_argument("--capacity", type=int, default=2560,
                   help="sandboxes per simulated node (headroom over 2,400 so that placement "
                   "near full does not refuse)")
    p.add_argument("--fill", type=int, default=384000, help="live sandboxes to reach")
    p.add_argument("--job", type=int, default=32768, help="U2's job size (the last creates)")
    p.add_argument("--n-single", type=int, default=10000, help="U1's single creates")
    p.add_argument("--batch-conc", type=int, default=4, help="batch calls at once")
    p.add_argument("--n-route", type=int, default=500, help="U3 gets and execs each")
    p.add_argument("--n-list", type=int, default=10, help="U3 lists by label")
    p.add_argument("--n-check", type=int, default=1000, help="U4 survivors checked")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle baseline phase, s")
    p.add_argument("--lost-timeout-s", type=float, default=600.0)
    p.add_argument("--sim-create-delay-ms", type=int, default=0)
    p.add_argument("--json", help="write the raw figures here")
    p.add_argument("--write", help="upsert the section into this BENCHMARKS.md")
    p.add_argument("--keep", action="store_true", help="leave the cluster up (debugging)")
    p.add_argument("--note", action="append", default=[], help="a line added to the section")
    p.add_argument("--from-json", help="render the section of an earlier run's --json file "
                   "(its command, date and figures; --note lines are added) instead of running")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        meta, res = saved["meta"], saved["res"]
        meta["notes"] = meta.get("notes", []) + args.note
        return _emit(meta, res, args.write)
    if R.httpx is None:
        raise SystemExit("bench: httpx missing (use .venv/bin/python)")
    if not shutil.which("etcd"):
        raise SystemExit("bench: etcd not installed (scripts/setup.sh)")

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "command": ".venv/bin/python bench/unit.py " + " ".join(
                shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "load_before": R.loadavg(), "machine": R.machine(), "batch_conc": args.batch_conc,
            "notes": args.note}
    res = run_unit(args)
    meta["load_after"] = R.loadavg()
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "res": res}, indent=1))
    return _emit(meta, res, args.write)


def _emit(meta: dict, res: dict, write: str | None) -> int:
    """Print the section of one run and, with `--write FILE`, put it into FILE."""
    text = render(meta, res)
    print(text)
    if write:
        path = Path(write)
        old = path.read_text() if path.exists() else ""
        path.write_text(R.upsert_section(old, f"{meta['date'][:10]} unit", text))
        print(f"bench: wrote the section into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
