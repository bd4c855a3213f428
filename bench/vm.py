#!/usr/bin/env python3
"""Sandlot QEMU backends: cold boot -> guest agent ready, p50/p99, for `vm` (q35, a whole
disk) and, side by side, `microvm`; plus exec round trip in a live VM. Every figure is
labelled with the accelerator the node chose (`/healthz` `accel`: TCG on hosts whose KVM
cannot boot the guest kernel, e.g. this project's nested-PVM development machines).

Usage (as root, after scripts/setup.sh; starts its own `sandlot up` on a free loopback port
with a temporary data dir; deletes everything it created):

    python3 bench/vm.py [--quick] [--write BENCHMARKS.md] [--json out.json]
        [--backends vm,microvm] [-n 10] [--image python] [--binary target/release/sandlot]

Figures per backend:
  boot     the node's own "agent ready" time (QEMU started -> the guest agent answered
           `GET /v1/ping`, from the node log line `... agent ready ... ms=N`), p50/p99 over
           n sequential creates (concurrency 1; each sandbox deleted untimed).
  create   the API create call (POST /v1/sandboxes -> 201, sandbox running): boot plus the
           per-sandbox disk (qcow2 overlay for vm, mkfs.ext4 scratch for microvm), cgroup.
  first    the first create of the run, which also builds the image's disk (qcow2 base for
           vm, EROFS for microvm) in a fresh data dir: once per image on a node.
  exec     round trip of `true` through the agent in one live sandbox, p50/p99.

With `--ops` (instead of the boot figures; section "QEMU backends: checkpoint, fork,
pause"), per backend, in one sandbox of 512 MiB, `rounds` times: write 16 MiB of new data
(untimed), then time `POST /v1/sandboxes/{id}/checkpoints`, `POST /v1/sandboxes:pause`
(memory saved, QEMU stopped) and `:resume`; then time the API create of a fork of the last
checkpoint (boot included) and report the checkpoint's `size_bytes`.

`measure_backend()` and `measure_ops()` are the reusable parts (e.g. for bench/microvm.py).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R  # noqa: E402

READY_RE = re.compile(r"sandbox=(sb-[0-9a-f]+) backend=\"(\w+)\" accel=\"(\w+)\" ms=(\d+)")


def agent_ready_ms(log_text: str) -> dict[str, tuple[str, int]]:
    """`{sandbox id: (accel, ms)}` from the node's "agent ready" log lines."""
    out = {}
    for line in log_text.splitlines():
        if "agent ready" in line:
            m = READY_RE.search(line)
            if m:
                out[m.group(1)] = (m.group(3), int(m.group(4)))
    return out


def measure_backend(
    api: R.Api, server: R.Server, backend: str, image: str, n: int, exec_calls: int
) -> dict:
    """n sequential cold creates of `backend` (first one separately: it may build the image
    disk), then `exec_calls` execs of `true` in the last one. Returns ms figures."""
    creates, ids = [], []
    first_ms = None
    for i in range(n + 1):
        t = time.monotonic()
        sid = api.create(image, backend=backend, ttl_s=600, memory_mib=512)
        ms = (time.monotonic() - t) * 1000
        if i == 0:
            first_ms = ms
        else:
            creates.append(ms)
        ids.append(sid)
        if i < n:
            api.delete(sid)
    last = ids[-1]
    execs = []
    for _ in range(exec_calls):
        t = time.monotonic()
        r = api.exec(last, ["true"])
        execs.append((time.monotonic() - t) * 1000)
        if r.get("exit_code") != 0:
            raise R.BenchError(f"exec true in {backend}: {r}")
    api.delete(last)
    ready = agent_ready_ms(server.log_path.read_text(errors="replace"))
    boots = [ready[s][1] for s in ids[1:] if s in ready]
    accels = sorted({ready[s][0] for s in ids if s in ready})
    pq = lambda v, q: R.percentile(v, q) if v else None  # noqa: E731
    return {
        "backend": backend,
        "accel": ",".join(accels) or "?",
        "n": n,
        "boot_p50_ms": pq(boots, 50),
        "boot_p99_ms": pq(boots, 99),
        "create_p50_ms": pq(creates, 50),
        "create_p99_ms": pq(creates, 99),
        "first_create_ms": first_ms,
        "exec_p50_ms": pq(execs, 50),
        "exec_p99_ms": pq(execs, 99),
    }


def measure_ops(api: R.Api, backend: str, image: str, rounds: int) -> dict:
    """Checkpoint, pause and resume times of one `backend` sandbox over `rounds` rounds,
    then one fork create (see the module docs). Returns ms figures."""
    sid = api.create(image, backend=backend, ttl_s=900, memory_mib=512)
    sel = {"labels": {R.BENCH_LABEL: api.run_id}}
    cks, pauses, resumes, cids = [], [], [], []
    size = None
    try:
        for i in range(rounds):
            r = api.exec(sid, ["sh", "-c", f"head -c 16777216 /dev/urandom > /tmp/b{i} && sync"],
                         timeout_s=120)
            if r.get("exit_code") != 0:
                raise R.BenchError(f"write in {backend}: {r}")
            t = time.monotonic()
            resp = api.request("POST", f"/v1/sandboxes/{sid}/checkpoints")
            cks.append((time.monotonic() - t) * 1000)
            api._check(resp, (201,), "checkpoint")
            cids.append(resp.json()["checkpoint_id"])
            size = resp.json()["size_bytes"]
            for path, acc in (("pause", pauses), ("resume", resumes)):
                t = time.monotonic()
                resp = api.request("POST", f"/v1/sandboxes:{path}", json=sel)
                acc.append((time.monotonic() - t) * 1000)
                api._check(resp, (200,), path)
                if resp.json().get("sandboxes") != [sid]:
                    raise R.BenchError(f"{path} {backend}: {resp.json()}")
        t = time.monotonic()
        fork = api.create(image, backend=backend, ttl_s=900, memory_mib=512,
                          checkpoint=cids[-1])
        fork_ms = (time.monotonic() - t) * 1000
        api.delete(fork)
    finally:
        api.delete(sid)
        for c in cids:
            api.request("DELETE", f"/v1/checkpoints/{c}")
    pq = lambda v, q: R.percentile(v, q) if v else None  # noqa: E731
    return {
        "backend": backend,
        "rounds": rounds,
        "checkpoint_p50_ms": pq(cks, 50),
        "checkpoint_max_ms": max(cks),
        "checkpoint_size_mib": (size or 0) / (1 << 20),
        "pause_p50_ms": pq(pauses, 50),
        "pause_max_ms": max(pauses),
        "resume_p50_ms": pq(resumes, 50),
        "resume_max_ms": max(resumes),
        "fork_create_ms": fork_ms,
    }


def render_ops(meta: dict, rows: list[dict]) -> str:
    f = R.fmt_ms
    lines = [
        f"## QEMU backends: checkpoint, fork, pause ({meta['date']}, {meta['accels']})",
        "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']}; load average at start {meta['load']}",
        f"- Accelerator: **{meta['accels']}** (`/healthz` accel: {meta['accel_why']})",
        "",
        "| backend | accel | rounds | checkpoint p50 ms | max ms | last checkpoint size MiB | pause p50 ms | max ms | resume p50 ms | max ms | fork create ms (boot included) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['backend']}` | {meta['accels']} | {r['rounds']} | {f(r['checkpoint_p50_ms'])} | "
            f"{f(r['checkpoint_max_ms'])} | {r['checkpoint_size_mib']:.1f} | {f(r['pause_p50_ms'])} | "
            f"{f(r['pause_max_ms'])} | {f(r['resume_p50_ms'])} | {f(r['resume_max_ms'])} | "
            f"{f(r['fork_create_ms'])} |"
        )
    lines += [
        "",
        "One 512 MiB sandbox per backend; each round writes 16 MiB of new data, then "
        "checkpoints, pauses (memory to a file, QEMU stopped) and resumes it; API wall times. "
        "`vm` checkpoints freeze a qcow2 layer (no copy: the size is the whole chain's "
        "allocation, shared with the parent); `microvm` copies its scratch disk. Under TCG: "
        "not KVM figures.",
    ]
    return "\n".join(lines) + "\n"


def render(meta: dict, rows: list[dict]) -> str:
    f = R.fmt_ms
    lines = [
        f"## QEMU backends: boot -> agent ready ({meta['date']}, {meta['accels']})",
        "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']}; load average at start {meta['load']}",
        f"- Accelerator: **{meta['accels']}** (`/healthz` accel: {meta['accel_why']})",
        "",
        "| backend | accel | n | boot→ready p50 ms | p99 ms | API create p50 ms | p99 ms | first create ms (builds the image disk) | exec `true` p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['backend']}` | {r['accel'].upper()} | {r['n']} | {f(r['boot_p50_ms'])} | "
            f"{f(r['boot_p99_ms'])} | {f(r['create_p50_ms'])} | {f(r['create_p99_ms'])} | "
            f"{f(r['first_create_ms'])} | {f(r['exec_p50_ms'])} | {f(r['exec_p99_ms'])} |"
        )
    lines += [
        "",
        "boot→ready: QEMU started → the guest agent answered (node log); API create adds the "
        "per-sandbox disk and cgroup. Sequential creates, concurrency 1. Under TCG every "
        "instruction of firmware, kernel and agent is translated: these are not KVM figures. "
        "The load average is other work on the same host (the exec figures suffer most).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="n=3, 10 execs")
    ap.add_argument("-n", type=int, help="timed creates per backend (default 10)")
    ap.add_argument("--backends", default="vm,microvm")
    ap.add_argument("--image", default="python")
    ap.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    ap.add_argument("--images-dir", default="/var/lib/sandlot/images")
    ap.add_argument("--write", metavar="PATH")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--ops", action="store_true",
                    help="checkpoint/fork/pause figures instead of boot figures")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --ops (default 5)")
    args = ap.parse_args(argv)
    n = args.n or (3 if args.quick else 10)
    exec_calls = 10 if args.quick else 50
    server = R.Server(Path(args.binary), Path(args.images_dir), [], ready_timeout_s=60)
    run_id = uuid.uuid4().hex[:12]
    load = R.loadavg()
    server.start()
    api = R.Api(server.url, run_id, timeout_s=300)
    rows = []
    try:
        health = api.request("GET", "/healthz").json()
        for b in [x for x in args.backends.split(",") if x]:
            if health["backends"].get(b) != "ok":
                print(f"bench/vm.py: skipping {b}: {health['backends'].get(b)}", file=sys.stderr)
                continue
            if args.ops:
                row = measure_ops(api, b, args.image, args.rounds)
            else:
                row = measure_backend(api, server, b, args.image, n, exec_calls)
            print(json.dumps(row), flush=True)
            rows.append(row)
        health = api.request("GET", "/healthz").json()
    finally:
        api.delete_all()
        api.close()
        server.stop()
        server.cleanup_dir()
    accel = (health.get("accel") or {})
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python3 bench/vm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": "{nproc} CPUs ({cpu}), {mem_gib} GiB RAM, kernel {kernel}, commit {commit}".format(
            **R.machine()
        ),
        "load": load,
        "accels": (accel.get("name") or "?").upper(),
        "accel_why": (accel.get("why") or "")[:120],
    }
    text = render_ops(meta, rows) if args.ops else render(meta, rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.write:
        p = Path(args.write)
        old = p.read_text() if p.exists() else ""
        kind = "vm-ops" if args.ops else "vm-boot"
        key = f"{kind} {meta['date'][:10]} {meta['accels']}"
        p.write_text(R.upsert_section(old, key, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
