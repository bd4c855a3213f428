#!/usr/bin/env python3
"""Sandlot `microvm` backend benchmarks: cold boot, template start, pause with memory and
resume, host memory per idle microVM, exec round trip. Reuses bench/run.py's server
runner, percentiles, machine facts and BENCHMARKS.md writer.

Usage (as root, after scripts/setup.sh and scripts/guest-kit.sh; starts its own
`sandlot up` servers on free loopback ports with data dirs under /var/tmp; deletes
everything it created):

    python3 bench/microvm.py [--quick] [--write BENCHMARKS.md] [--json out.json]
        [--binary target/release/sandlot] [--cold 5] [--template 8] [--pauses 5]
        [--idle 4] [--execs 40] [--touch-mib 256]

Sections:
  M1  cold boot: `POST /v1/sandboxes` (the node answers once the guest agent answered a
      ping: "agent ready") and then the first exec `true` ("first exec result"), both
      reported, on a server with SANDLOT_MICROVM_TEMPLATES=0.
  M2  template start: the same on a server with templates on, after the first create made
      the template snapshot (waited for); every timed create is checked to have started
      from the template (`state.json` `started_from`).
  M3  pause with memory (`POST /v1/sandboxes:pause`: stop, save memory + devices to a
      file, QEMU killed) and resume (`:resume`: QEMU restarted, state loaded, `cont`) of a
      microVM whose guest touched `--touch-mib` MiB; the saved file's size, pause time per
      GiB saved.
  M4  host memory per idle microVM: PSS and RSS of each QEMU (/proc/PID/smaps_rollup) of
      `--idle` template-started microVMs (memory_mib 256); and their host CPU while idle:
      each QEMU's user + system time (/proc/PID/stat) over IDLE_CPU_S seconds without execs.
  M5  exec round trip of `true` in a live microVM, concurrency 1.

The accelerator (KVM or TCG) the node chose is read from its log and printed next to every
figure. Targets (under TCG, issue 5): cold boot ≤ 1.5 s, template start and resume ≤ 0.5 s.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R

TARGET_COLD_S = 1.5
TARGET_TEMPLATE_S = 0.5
TARGET_RESUME_S = 0.5


class Bench:
    def __init__(self, server: R.Server, run_id: str):
        self.s = server
        self.c = R.httpx.Client(base_url=server.url, timeout=300)
        self.run_id = run_id
        self.live: set[str] = set()

    def create(self, memory_mib: int = 256) -> tuple[str, float]:
        t = time.monotonic()
        r = self.c.post(
            "/v1/sandboxes",
            json={
                "backend": "microvm",
                "image": "python",
                "memory_mib": memory_mib,
                "ttl_s": 1800,
                "labels": {"sandlot-bench": self.run_id},
            },
        )
        if r.status_code != 201:
            raise R.BenchError(f"create: {r.status_code} {r.text[:300]}")
        sid = r.json()["id"]
        self.live.add(sid)
        return sid, time.monotonic() - t

    def exec(self, sid: str, cmd) -> dict:
        r = self.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_s": 120})
        if r.status_code != 200:
            raise R.BenchError(f"exec: {r.status_code} {r.text[:300]}")
        return r.json()

    def delete(self, sid: str) -> None:
        self.c.delete(f"/v1/sandboxes/{sid}")
        self.live.discard(sid)

    def vm_state(self, sid: str) -> dict:
        return json.loads((self.s.tmp / "data" / "microvm" / "vms" / sid / "state.json").read_text())

    def accel(self) -> str:
        m = re.search(r'accel="(kvm|tcg)"', self.s.log_path.read_text(errors="replace"))
        return m.group(1).upper() if m else "?"

    def close(self) -> None:
        for sid in list(self.live):
            try:
                self.delete(sid)
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
        self.c.close()


def pct(v: list[float], q: float) -> float | None:
    return R.percentile(v, q) if v else None


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


def start_server(binary: Path, images: Path, env: dict) -> R.Server:
    s = R.Server(binary, images, ["--warm-pool", "0"], ready_timeout_s=60,
                 tmp_parent="/var/tmp", env=env)
    s.start()
    return s


def templates_ready(s: R.Server) -> bool:
    d = s.tmp / "data" / "microvm" / "templates"
    # Finished templates only: a partial one is built in `<key>.tmp/` and renamed when done.
    return d.is_dir() and any(
        not p.parent.name.endswith(".tmp") for p in d.glob("*/memory.state")
    )


def qemu_mem(pid: int) -> tuple[int, int]:
    pss = rss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
            elif line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
    return pss, rss


#: Seconds over which M4 counts the idle QEMUs' host CPU time.
IDLE_CPU_S = 10.0


def qemu_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat fields 14, 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write", metavar="PATH")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    ap.add_argument("--images-dir", default=os.environ.get("SANDLOT_IMAGES_DIR",
                                                           "/var/lib/sandlot/images"))
    ap.add_argument("--cold", type=int, help="cold boots (default 5, quick 2)")
    ap.add_argument("--template", type=int, help="template starts (default 8, quick 3)")
    ap.add_argument("--pauses", type=int, help="pause/resume cycles (default 5, quick 2)")
    ap.add_argument("--idle", type=int, help="idle microVMs for M4 (default 4, quick 2)")
    ap.add_argument("--execs", type=int, help="execs in M5 (default 40, quick 10)")
    ap.add_argument("--touch-mib", type=int, default=256,
                    help="guest memory touched before M3's pauses (MiB, default 256)")
    args = ap.parse_args(argv)
    if R.httpx is None:
        print("bench: python3 -m pip install httpx", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench: run as root", file=sys.stderr)
        return 2
    q = args.quick
    n_cold = args.cold or (2 if q else 5)
    n_tpl = args.template or (3 if q else 8)
    n_pause = args.pauses or (2 if q else 5)
    n_idle = args.idle or (2 if q else 4)
    n_exec = args.execs or (10 if q else 40)
    run_id = f"{int(time.time())}-{os.getpid()}"
    now = _dt.datetime.now(_dt.UTC)
    mode = "quick" if q else "full"
    meta = {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "mode": mode,
        "command": "python3 " + shlex.join([os.path.relpath(sys.argv[0], R.REPO)
                                            if Path(sys.argv[0]).exists() else sys.argv[0],
                                            *(argv if argv is not None else sys.argv[1:])]),
        "machine": R.machine(),
    }
    res: dict = {}
    binary, images = Path(args.binary), Path(args.images_dir)

    # M1: cold boots, templates off.
    s = start_server(binary, images, {"SANDLOT_MICROVM_TEMPLATES": "0"})
    b = Bench(s, run_id)
    try:
        sid, _ = b.create()  # EROFS conversion + accelerator probe: untimed
        b.delete(sid)
        cold, cold_ready = [], []
        for _ in range(n_cold):
            t = time.monotonic()
            sid, ready = b.create()
            b.exec(sid, ["true"])
            cold.append(time.monotonic() - t)
            cold_ready.append(ready)
            b.delete(sid)
        res["accel"] = b.accel()
        res["cold_s"] = cold
        res["cold_ready_s"] = cold_ready
    finally:
        b.close()
        s.stop()
        s.cleanup_dir()

    # M2-M5: templates on.
    s = start_server(binary, images, {})
    b = Bench(s, run_id)
    try:
        sid, _ = b.create()
        t0 = time.monotonic()
        while not templates_ready(s) and time.monotonic() - t0 < 300:
            time.sleep(0.5)
        if not templates_ready(s):
            raise R.BenchError(f"no template snapshot within 300 s:\n{s.tail()}")
        res["template_build_wait_s"] = time.monotonic() - t0
        b.delete(sid)
        tpl, tpl_ready, froms = [], [], []
        for _ in range(n_tpl):
            t = time.monotonic()
            sid, ready = b.create()
            b.exec(sid, ["true"])
            tpl.append(time.monotonic() - t)
            tpl_ready.append(ready)
            froms.append(b.vm_state(sid)["started_from"])
            b.delete(sid)
        res["template_s"] = tpl
        res["template_ready_s"] = tpl_ready
        res["template_started_from"] = froms

        # M3: pause / resume of a guest that touched memory.
        sid, _ = b.create(memory_mib=max(1024, 2 * args.touch_mib + 256))
        r = b.exec(sid, ["python3", "-c",
                         "f=open('/dev/shm/fill','wb')\n"
                         f"for i in range({args.touch_mib}): f.write(bytes([i % 251 + 1]) * (1 << 20))"])
        if r["exit_code"] != 0:
            raise R.BenchError(f"touch: {r}")
        sel = {"labels": {"sandlot-bench": run_id}}
        pauses, resumes, sizes = [], [], []
        mem = s.tmp / "data" / "microvm" / "vms" / sid / "memory.state"
        for _ in range(n_pause):
            t = time.monotonic()
            rp = b.c.post("/v1/sandboxes:pause", json=sel)
            pauses.append(time.monotonic() - t)
            if rp.status_code != 200 or sid not in rp.json()["sandboxes"]:
                raise R.BenchError(f"pause: {rp.status_code} {rp.text[:300]}")
            sizes.append(mem.stat().st_size)
            t = time.monotonic()
            rr = b.c.post("/v1/sandboxes:resume", json=sel)
            resumes.append(time.monotonic() - t)
            if rr.status_code != 200:
                raise R.BenchError(f"resume: {rr.status_code} {rr.text[:300]}")
            if b.exec(sid, ["test", "-s", "/dev/shm/fill"])["exit_code"] != 0:
                raise R.BenchError("the guest lost /dev/shm/fill over pause/resume")
        res["pause_s"], res["resume_s"], res["state_bytes"] = pauses, resumes, sizes
        b.delete(sid)

        # M4 + M5: idle microVMs.
        ids = [b.create()[0] for _ in range(n_idle)]
        time.sleep(3)
        mems = [qemu_mem(b.vm_state(i)["qemu_pid"]) for i in ids]
        res["idle_pss"] = [m[0] for m in mems]
        res["idle_rss"] = [m[1] for m in mems]
        pids = [b.vm_state(i)["qemu_pid"] for i in ids]
        cpu0 = [qemu_cpu_s(p) for p in pids]
        time.sleep(IDLE_CPU_S)
        res["idle_cpu"] = [(qemu_cpu_s(p) - c) / IDLE_CPU_S for p, c in zip(pids, cpu0)]
        ex = []
        for i in range(n_exec + 3):
            t = time.monotonic()
            b.exec(ids[0], ["true"])
            if i >= 3:
                ex.append(time.monotonic() - t)
        res["exec_s"] = ex
        res["accel_tpl"] = b.accel()
    finally:
        b.close()
        meta["load_end"] = R.loadavg()
        log_copy = Path(f"/var/tmp/sandlot-bench-microvm-{run_id}.log")
        try:
            log_copy.write_bytes(s.log_path.read_bytes())
        except OSError:
            pass
        s.stop()
        s.cleanup_dir()

    A = res.get("accel", "?")
    m = meta["machine"]
    L = [f"## {meta['date']} — microvm backend ({mode}), {A}", "",
         f"- Command: `{meta['command']}`",
         f"- Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel {m['kernel']}, "
         f"cgroup {m['cgroup']}, load average at start {m['loadavg']}, at end {meta['load_end']}; "
         f"accelerator **{A}** (the node's probe: this host's nested KVM cannot boot the guest kernel)",
         f"- Tree: commit {m['commit']}; servers started with `--warm-pool 0`; image `python`; "
         "client-side wall time per call; server log copied to "
         f"`/var/tmp/sandlot-bench-microvm-{run_id}.log`.", ""]

    def row(name, v, target=None, cols=5):
        p50, p99 = pct(v, 50), pct(v, 99)
        t = (" | —" if cols == 5 else "") if target is None else (
            f" | ≤ {target * 1000:.0f} ms: {R.verdict(p50 is not None and p50 <= target)}")
        return f"| {name} | {len(v)} | {ms(p50)} ({A}) | {ms(p99)} ({A}){t} |"

    L += ["### M1/M2. Create → agent ready (the create's answer) and → first exec result (`true`), concurrency 1", "",
          "Issue 5's targets are for boot → agent ready; the stricter create + first exec is "
          "held to the same figure.", "",
          "| subject | n | p50 | p99 | target (p50) |", "|---|---|---|---|---|",
          row("cold boot (templates off) → agent ready", res["cold_ready_s"], TARGET_COLD_S),
          row("cold boot → first exec result", res["cold_s"], TARGET_COLD_S),
          row("template start → agent ready", res["template_ready_s"], TARGET_TEMPLATE_S),
          row("template start → first exec result", res["template_s"], TARGET_TEMPLATE_S), "",
          f"Template starts checked: started_from = {sorted(set(res['template_started_from']))}; "
          f"the template snapshot was ready {res['template_build_wait_s']:.1f} s after the first "
          "create returned (one more cold boot in the background, then the save).", ""]
    gib = [sz / 2**30 for sz in res["state_bytes"]]
    per_gib = [p / g for p, g in zip(res["pause_s"], gib) if g > 0]
    L += [f"### M3. Pause with memory / resume (memory_mib {max(1024, 2 * args.touch_mib + 256)}; the guest filled {args.touch_mib} MiB of /dev/shm)", "",
          "| step | n | p50 | p99 | target (p50) |", "|---|---|---|---|---|",
          row("pause (stop + save + QEMU killed)", res["pause_s"]),
          row("resume (QEMU start + load + cont)", res["resume_s"], TARGET_RESUME_S), "",
          f"- Saved state: {sum(res['state_bytes']) / len(res['state_bytes']) / 2**20:.0f} MiB per pause "
          f"(zero pages are not written); pause time per GiB saved: p50 {pct(per_gib, 50):.2f} s/GiB ({A}).", ""]
    L += [f"### M4. Host memory per idle microVM ({len(res['idle_pss'])} template-started, memory_mib 256)", "",
          f"- QEMU PSS: mean {sum(res['idle_pss']) / len(res['idle_pss']) / 2**20:.0f} MiB, "
          f"RSS: mean {sum(res['idle_rss']) / len(res['idle_rss']) / 2**20:.0f} MiB per microVM ({A}; "
          "guest RAM the guest touched + QEMU + TCG translation cache).",
          f"- QEMU CPU while idle: mean {100 * sum(res['idle_cpu']) / len(res['idle_cpu']):.1f} % "
          f"of a host core per microVM over {IDLE_CPU_S:.0f} s ({A}; no exec meanwhile).", ""]
    L += ["### M5. Exec round trip (`true` in a live microVM), concurrency 1", "",
          "| subject | n | p50 | p99 |", "|---|---|---|---|",
          row("exec true", res["exec_s"], cols=4), ""]
    report = "\n".join(L)
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": res}, indent=2))
    if args.write:
        p = Path(args.write)
        old = p.read_text() if p.exists() else ""
        key = f"{now.strftime('%Y-%m-%d')} microvm {mode}"
        p.write_text(R.upsert_section(old, key, report))
        print(f"bench: wrote section '{key}' to {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
