#!/usr/bin/env python3
"""Trajectory-log benchmark (issue 4): fast-forward cost of a replayed step, log write
overhead per executed step, and logged/replayed steps per second.

Usage (root, on the host of the server; requests stay on 127.0.0.1):

    python3 bench/trajectory.py --start [--quick] [--write BENCHMARKS.md]
    python3 bench/trajectory.py --url http://127.0.0.1:7070 [--quick]

Measurements (every call is one `POST /v1/sandboxes/{id}/exec`, client-side wall time,
over a minimal keep-alive HTTP/1.1 client so the client's own CPU stays small on a
2-core host that also runs the server):
  1. Concurrency 1, `python3 -c 'print(1)'` in the python image: exec without trajectory,
     the same exec as a logged step (new step each call), and the same steps replayed
     (`replayed: true`, nothing executed). Replay p50/p99 vs exec p50/p99 and their ratio.
  2. Log write overhead, `true` (argv form): the same exec with vs without a trajectory,
     interleaved in rounds, at 1 and at 100 concurrent trajectories (each its own sandbox);
     overhead = p50(logged) - p50(plain). The rate of the logged blocks at 100 is the logged
     steps/s throughput (bounded by the exec itself).
  3. Replays/s: every step logged in 2 replayed by 100 concurrent clients (the pure log
     read path, no exec). Server CPU per call (from /proc/PID/stat, --start only) says
     where the time goes.
Targets (printed, never asserted): replayed step p50 <= 1 ms and >= 10x faster than the
exec; log overhead <= 1 ms per executed step at 100 concurrent trajectories; 10,000 steps/s.

Every loop is bounded by a call count and a deadline; sandboxes carry the label
`sandlot-bench=<run id>` and a TTL, and are deleted at the end (also on error / Ctrl-C).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import shlex
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk" / "python"))

import run as benchrun  # noqa: E402  (bench/run.py: Server, machine, percentile, upsert)

import sandlot  # noqa: E402

REPO = benchrun.REPO
PY_CMD = ["python3", "-c", "print(1)"]
TRUE_CMD = ["true"]
TARGET_REPLAY_P50_MS = 1.0
TARGET_REPLAY_SPEEDUP = 10.0
TARGET_OVERHEAD_MS = 1.0
TARGET_STEPS_PER_S = 10_000


class BenchError(Exception):
    pass


# ----------------------------------------------------------------------------- raw client


class Conn:
    """One keep-alive HTTP/1.1 connection (asyncio streams); JSON in, (status, body) out.
    Hand-rolled so that the client costs far less CPU per call than httpx."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.r: Optional[asyncio.StreamReader] = None
        self.w: Optional[asyncio.StreamWriter] = None

    async def call(self, method: str, path: str, body: Optional[dict] = None,
                   timeout: float = 60.0) -> tuple[int, bytes]:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection(self.host, self.port)
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        self.w.write(head.encode() + data)
        try:
            return await asyncio.wait_for(self._read(), timeout)
        except BaseException:
            self.close()
            raise

    async def _read(self) -> tuple[int, bytes]:
        assert self.r is not None
        status = int((await self.r.readline()).split()[1])
        length, chunked = 0, False
        while True:
            line = await self.r.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
        if not chunked:
            return status, await self.r.readexactly(length)
        out = b""
        while True:
            n = int((await self.r.readline()).split(b";")[0], 16)
            if n == 0:
                await self.r.readline()
                return status, out
            out += await self.r.readexactly(n)
            await self.r.readline()

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        self.r = self.w = None


def server_cpu_s(pid: Optional[int]) -> Optional[float]:
    """utime+stime of the server process (all threads), seconds; None without a pid."""
    if pid is None:
        return None
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Block:
    """Latencies (ms) of one subject, with wall time, errors and server CPU."""

    def __init__(self, name: str):
        self.name = name
        self.lat: list[float] = []
        self.wall = 0.0
        self.errors: list[str] = []
        self.cpu = 0.0
        self.cpu_known = True
        self.client_cpu = 0.0

    def p(self, q: float) -> Optional[float]:
        return benchrun.percentile(self.lat, q) if self.lat else None

    def rate(self) -> Optional[float]:
        return len(self.lat) / self.wall if self.wall else None

    def client_cpu_per_call_ms(self) -> Optional[float]:
        return self.client_cpu / len(self.lat) * 1e3 if self.lat else None

    def cpu_per_call_ms(self) -> Optional[float]:
        return self.cpu / len(self.lat) * 1e3 if self.cpu_known and self.lat else None


async def run_block(block: Block, conns: list[Conn], reqs: list[list[tuple]],
                    pid: Optional[int], check, deadline_s: float) -> None:
    """Worker i sends reqs[i] (method, path, body) in order on conns[i]; all in parallel."""
    cpu0 = server_cpu_s(pid)
    ccpu0 = time.process_time()
    t0 = time.perf_counter()
    end = time.monotonic() + deadline_s

    async def worker(i: int) -> None:
        for method, path, body in reqs[i]:
            if time.monotonic() > end:
                block.errors.append("deadline")
                return
            s = time.perf_counter()
            try:
                status, data = await conns[i].call(method, path, body)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
                block.errors.append(f"{type(e).__name__}: {e}")
                continue
            dt = (time.perf_counter() - s) * 1e3
            why = check(status, data)
            if why:
                block.errors.append(why)
            else:
                block.lat.append(dt)

    await asyncio.gather(*(worker(i) for i in range(len(conns))))
    block.wall += time.perf_counter() - t0
    block.client_cpu += time.process_time() - ccpu0
    cpu1 = server_cpu_s(pid)
    if cpu0 is None or cpu1 is None:
        block.cpu_known = False
    else:
        block.cpu += cpu1 - cpu0


def expect(replayed: bool):
    want = b'"replayed":true' if replayed else b'"replayed":false'

    def check(status: int, data: bytes) -> Optional[str]:
        if status != 200:
            return f"HTTP {status} {data[:200]!r}"
        if want not in data.replace(b" ", b""):
            return f"expected {want.decode()} in {data[:200]!r}"
        if b'"exit_code":0' not in data.replace(b" ", b""):
            return f"non-zero exit {data[:200]!r}"
        return None
    return check


def exec_path(sid: str) -> str:
    return f"/v1/sandboxes/{urllib.parse.quote(sid, safe='')}/exec"


# ----------------------------------------------------------------------------- sections


def create_many(client: sandlot.Client, n: int, run_id: str, trajectory_prefix: Optional[str]
                ) -> list[sandlot.Sandbox]:
    def one(i: int) -> sandlot.Sandbox:
        t = None if trajectory_prefix is None else f"{trajectory_prefix}/{i}"
        return client.create(image="python", memory_mib=64, pids_max=32, ttl_s=1800,
                             labels={benchrun.BENCH_LABEL: run_id}, trajectory=t)
    with ThreadPoolExecutor(8) as ex:
        return list(ex.map(one, range(n)))


async def section_replay(host: str, port: int, plain: sandlot.Sandbox, traj: sandlot.Sandbox,
                         n: int, rounds: int, pid: Optional[int], deadline: float) -> dict:
    """Concurrency 1, python print(1): plain exec vs logged exec (interleaved) vs replay."""
    conn = Conn(host, port)
    ex, logged, rep = Block("exec"), Block("logged exec"), Block("replayed")
    per = max(1, n // rounds)
    step = 0
    # Warm-up, discarded.
    await conn.call("POST", exec_path(plain.id), {"cmd": PY_CMD})
    for r in range(rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for which in order:
            if which == 0:
                await run_block(ex, [conn], [[("POST", exec_path(plain.id), {"cmd": PY_CMD})]
                                             * per], pid, expect(False), deadline)
            else:
                reqs = [("POST", exec_path(traj.id), {"cmd": PY_CMD, "step": step + k})
                        for k in range(per)]
                await run_block(logged, [conn], [reqs], pid, expect(False), deadline)
                step += per
    reqs = [("POST", exec_path(traj.id), {"cmd": PY_CMD, "step": k}) for k in range(step)]
    await run_block(rep, [conn], [reqs], pid, expect(True), deadline)
    conn.close()
    return {"exec": ex, "logged": logged, "replayed": rep}


async def section_overhead(host: str, port: int, plains: list[sandlot.Sandbox],
                           trajs: list[sandlot.Sandbox], per: int, rounds: int,
                           pid: Optional[int], deadline: float) -> dict:
    """`true` with vs without trajectory, interleaved, len(plains) concurrent workers."""
    c = len(plains)
    pc = [Conn(host, port) for _ in range(c)]
    tc = [Conn(host, port) for _ in range(c)]
    plain, logged = Block("exec"), Block("logged exec")
    nxt = [0] * c
    await asyncio.gather(*(pc[i].call("POST", exec_path(plains[i].id), {"cmd": TRUE_CMD})
                           for i in range(c)))
    for r in range(rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for which in order:
            if which == 0:
                reqs = [[("POST", exec_path(plains[i].id), {"cmd": TRUE_CMD})] * per
                        for i in range(c)]
                await run_block(plain, pc, reqs, pid, expect(False), deadline)
            else:
                reqs = [[("POST", exec_path(trajs[i].id), {"cmd": TRUE_CMD, "step": nxt[i] + k})
                         for k in range(per)] for i in range(c)]
                await run_block(logged, tc, reqs, pid, expect(False), deadline)
                nxt = [x + per for x in nxt]
    for x in pc + tc:
        x.close()
    return {"exec": plain, "logged": logged, "steps": nxt}


async def section_replays(host: str, port: int, trajs: list[sandlot.Sandbox], steps: list[int],
                          pid: Optional[int], deadline: float) -> Block:
    conns = [Conn(host, port) for _ in trajs]
    b = Block("replayed")
    reqs = [[("POST", exec_path(t.id), {"cmd": TRUE_CMD, "step": k}) for k in range(steps[i])]
            for i, t in enumerate(trajs)]
    await run_block(b, conns, reqs, pid, expect(True), deadline)
    for x in conns:
        x.close()
    return b


# ----------------------------------------------------------------------------- report


def fmt(v: Optional[float]) -> str:
    return benchrun.fmt_ms(v)


def row(label: str, conc: int, b: Block) -> str:
    cpu, ccpu = b.cpu_per_call_ms(), b.client_cpu_per_call_ms()
    return (f"| {label} | {conc} | {len(b.lat)} | {len(b.errors)} | {fmt(b.p(50))} | "
            f"{fmt(b.p(99))} | {benchrun.fmt_rate(b.rate())} | "
            f"{'—' if cpu is None else f'{cpu:.2f}'} | "
            f"{'—' if ccpu is None else f'{ccpu:.2f}'} |")


def verdict(ok: Optional[bool]) -> str:
    return benchrun.verdict(ok)


def render(meta: dict, a: dict, over: dict[int, dict], reps: Block, notes: list[str]) -> str:
    m = meta["machine"]
    L = [f"## {meta['date']} — trajectory log ({meta['mode']})", ""]
    L.append(f"- Command: `{meta['command']}`")
    L.append(f"- Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel "
             f"{m['kernel']}, cgroup {m['cgroup']}, load average at start {m['loadavg']}")
    L.append(f"- Tree: commit {m['commit']}; server: {meta['server']}")
    L.append("- Method: client-side wall time per `POST /v1/sandboxes/{id}/exec` over a "
             "minimal keep-alive HTTP/1.1 client (asyncio); logged and plain blocks "
             "interleaved in rounds; server CPU = utime+stime of the `sandlot up` process "
             "(all threads, not the exec helpers) over the block, per call.")
    L.append("")
    L.append("| subject | conc | calls ok | errors | p50 ms | p99 ms | calls/s "
             "| server CPU ms/call | client CPU ms/call |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    L.append(row("exec `python3 -c 'print(1)'`, no trajectory", 1, a["exec"]))
    L.append(row("same, logged step", 1, a["logged"]))
    L.append(row("same, replayed step", 1, a["replayed"]))
    for c, o in over.items():
        L.append(row("exec `true`, no trajectory", c, o["exec"]))
        L.append(row("exec `true`, logged step", c, o["logged"]))
    L.append(row("replayed `true` steps (log read path)", len(over[max(over)]["steps"]), reps))
    L.append("")
    rp50, ep50 = a["replayed"].p(50), a["exec"].p(50)
    speed = benchrun.ratio(ep50, rp50)
    L.append(f"- Replayed step p50 {fmt(rp50)} ms / p99 {fmt(a['replayed'].p(99))} ms vs exec "
             f"p50 {fmt(ep50)} ms / p99 {fmt(a['exec'].p(99))} ms: "
             f"{'—' if speed is None else f'{speed:.0f}'}× faster "
             f"(targets ≤ {TARGET_REPLAY_P50_MS} ms: "
             f"{verdict(None if rp50 is None else rp50 <= TARGET_REPLAY_P50_MS)}; "
             f"≥ {TARGET_REPLAY_SPEEDUP:.0f}×: "
             f"{verdict(None if speed is None else speed >= TARGET_REPLAY_SPEEDUP)}).")
    for c, o in over.items():
        lp, pp = o["logged"].p(50), o["exec"].p(50)
        d = None if lp is None or pp is None else lp - pp
        cpu_l, cpu_p = o["logged"].cpu_per_call_ms(), o["exec"].cpu_per_call_ms()
        cpu_d = "" if cpu_l is None or cpu_p is None else \
            f"; server CPU per call {cpu_l - cpu_p:+.2f} ms"
        rl, rp = o["logged"].rate(), o["exec"].rate()
        if rl and rp:
            cpu_d += f"; service time per call (1/rate) {1e3 / rl - 1e3 / rp:+.2f} ms"
        L.append(f"- Log write overhead at {c} concurrent trajectories: p50 {fmt(lp)} − "
                 f"{fmt(pp)} = {'—' if d is None else f'{d:+.2f}'} ms per executed step"
                 f"{cpu_d} (target ≤ {TARGET_OVERHEAD_MS} ms: "
                 f"{verdict(None if d is None else d <= TARGET_OVERHEAD_MS)} on p50)."
                 + (" At this concurrency p50 is mostly queueing (latency ≈ concurrency / "
                    "rate), so the server-CPU and 1/rate deltas are the per-step cost."
                    if c > 1 else ""))
    top = over[max(over)]
    L.append(f"- Logged steps/s with {max(over)} concurrent trajectories running `true`: "
             f"{benchrun.fmt_rate(top['logged'].rate())} (plain exec "
             f"{benchrun.fmt_rate(top['exec'].rate())}/s); replays/s (log read path, no "
             f"exec): {benchrun.fmt_rate(reps.rate())}. Target {TARGET_STEPS_PER_S:,} steps/s: "
             f"logged {verdict((top['logged'].rate() or 0) >= TARGET_STEPS_PER_S)}, replayed "
             f"{verdict((reps.rate() or 0) >= TARGET_STEPS_PER_S)}.")
    L.extend(f"- {n}" for n in notes)
    errs = []
    for name, b in [("conc-1 " + k, v) for k, v in a.items()] + \
            [(f"conc-{c} {k}", o[k]) for c, o in over.items() for k in ("exec", "logged")] + \
            [("replays", reps)]:
        if b.errors:
            errs.append(f"{name}: {len(b.errors)} errors, e.g. {b.errors[0][:200]}")
    if errs:
        L.append("- Errors: " + "; ".join(errs))
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--url", help="base URL of a running server (loopback only)")
    g.add_argument("--start", action="store_true", help="start target/release/sandlot up")
    ap.add_argument("--quick", action="store_true", help="fewer calls (smoke run)")
    ap.add_argument("--write", metavar="PATH", help="insert/replace this run's section in PATH")
    ap.add_argument("--json", metavar="PATH", help="also write raw figures as JSON")
    ap.add_argument("--binary", default=str(REPO / "target/release/sandlot"))
    ap.add_argument("--images-dir",
                    default=os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"))
    ap.add_argument("--conc", type=int, default=100, help="concurrent trajectories (default 100)")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds per block (default 120)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 and args.start:
        print("bench: --start needs root", file=sys.stderr)
        return 2
    n = 60 if args.quick else 300          # conc-1 calls per subject
    rounds = 2 if args.quick else 4
    per = 3 if args.quick else 10          # calls per worker per block at --conc
    run_id = f"traj-{int(time.time())}-{os.getpid()}"
    now = _dt.datetime.now(_dt.timezone.utc)
    meta = {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "quick" if args.quick else "full",
        "command": "python3 bench/trajectory.py " + shlex.join(
            argv if argv is not None else sys.argv[1:]),
        "machine": benchrun.machine(),
    }
    server = None
    client = None
    rc = 0
    try:
        if args.start:
            server = benchrun.Server(Path(args.binary), Path(args.images_dir), [],
                                     ready_timeout_s=60)
            server.start()
            meta["server"] = f"`{shlex.join(server.cmd)}` (started by the harness)"
            url = server.url
        else:
            benchrun.check_loopback(args.url)
            url = args.url.rstrip("/")
            meta["server"] = f"{url} (already running)"
        pid = server.proc.pid if server and server.proc else None
        u = urllib.parse.urlsplit(url)
        host, port = u.hostname or "127.0.0.1", u.port or 80
        client = sandlot.Client(url, timeout=60)
        print(f"bench: {url}; conc-1 {n} calls x 3 subjects; {args.conc} trajectories x "
              f"{per} calls x {rounds} rounds", flush=True)
        one_plain = create_many(client, 1, run_id, None)[0]
        one_traj = create_many(client, 1, run_id, f"bench/{run_id}/py")[0]
        a = asyncio.run(section_replay(host, port, one_plain, one_traj, n, rounds, pid,
                                       args.deadline))
        print(f"bench: conc 1 done: exec p50 {fmt(a['exec'].p(50))} ms, replay p50 "
              f"{fmt(a['replayed'].p(50))} ms", flush=True)
        over: dict[int, dict] = {}
        for c in (1, args.conc):
            plains = create_many(client, c, run_id, None)
            trajs = create_many(client, c, run_id, f"bench/{run_id}/c{c}")
            over[c] = asyncio.run(section_overhead(host, port, plains, trajs,
                                                   per * (5 if c == 1 else 1), rounds, pid,
                                                   args.deadline))
            print(f"bench: overhead conc {c}: plain p50 {fmt(over[c]['exec'].p(50))} ms, "
                  f"logged p50 {fmt(over[c]['logged'].p(50))} ms, logged rate "
                  f"{benchrun.fmt_rate(over[c]['logged'].rate())}/s", flush=True)
            if c == args.conc:
                reps = asyncio.run(section_replays(host, port, trajs, over[c]["steps"], pid,
                                                   args.deadline))
                print(f"bench: replays/s {benchrun.fmt_rate(reps.rate())}", flush=True)
        notes = []
        if pid is None:
            notes.append("Server CPU unknown (--url): run with --start for the CPU column.")
        text = render(meta, a, over, reps, notes)
        print(text)
        if args.write:
            p = Path(args.write)
            old = p.read_text() if p.exists() else ""
            p.write_text(benchrun.upsert_section(old, f"{meta['date']} trajectory", text))
            print(f"bench: wrote section to {p}")
        if args.json:
            def dump(b: Block) -> dict:
                return {"n": len(b.lat), "errors": len(b.errors), "p50": b.p(50),
                        "p99": b.p(99), "rate": b.rate(), "cpu_ms": b.cpu_per_call_ms()}
            Path(args.json).write_text(json.dumps({
                "meta": meta, "conc1": {k: dump(v) for k, v in a.items()},
                "overhead": {c: {k: dump(o[k]) for k in ("exec", "logged")}
                             for c, o in over.items()},
                "replays": dump(reps)}, indent=1, default=str))
    except (BenchError, sandlot.SandlotError) as e:
        print(f"bench: {e}", file=sys.stderr)
        rc = 1
    finally:
        if client is not None:
            try:
                left = client.list(labels={benchrun.BENCH_LABEL: run_id})
                with ThreadPoolExecutor(8) as ex:
                    list(ex.map(lambda s: s.delete(), left))
            except sandlot.SandlotError as e:
                print(f"bench: cleanup failed: {e}", file=sys.stderr)
            client.close()
        if server is not None:
            server.stop()
            server.cleanup_dir()
    return rc


if __name__ == "__main__":
    sys.exit(main())
