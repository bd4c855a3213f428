#!/usr/bin/env python3
"""Cross-node vs same-node resume of a paused microVM or VM (issue 22, "Benchmarks": "Real
nodes: cross-node resume of a paused microVM vs same-node resume (ratio)").

Usage (as root, after scripts/setup.sh; etcd installed; no other local cluster up):

    .venv/bin/python bench/xresume.py [--binary target/release/sandlot] [--rounds 3]
                                      [--backend microvm|vm] [--write BENCHMARKS.md]

Starts `scripts/cluster.sh up DIR 2` (nodes with `--snapshot-dir DIR/snapshots`, node lease
3 s, templates off), creates one microVM (or, with `--backend vm`, one q35 VM; image
`python`, 256 MiB) with a background loop, then per round, on the same sandbox:

  same:  pause, resume (its node alive: the fast path, memory read from the store).
  cross: pause, kill -9 of its node, wait until it left etcd, resume (timed: the other node
         claims the snapshot, copies the disk (a vm: its qcow2 layers), restores),
         `cluster.sh node-start` of the
         killed node (its orphan is deleted by the rejoin reconcile).

Times are the `POST /v1/sandboxes:resume` call through the server (client wall time).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import sandlot  # noqa: E402

SCRIPT = str(ROOT / "scripts" / "cluster.sh")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "sandlot"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", choices=["microvm", "vm"], default="microvm")
    ap.add_argument("--write")
    a = ap.parse_args()
    d = Path(f"/var/tmp/sandlot-xresume-bench-{os.getpid()}")
    env = dict(os.environ, SANDLOT_BIN=str(Path(a.binary).resolve()),
               SANDLOT_MICROVM_TEMPLATES="0",
               SANDLOT_CLUSTER_NODE_ARGS="--lease-ttl-s 3 --warm-pool 0 --container-warm-pool 0")
    up = subprocess.run([SCRIPT, "up", str(d), "2"], capture_output=True, text=True, env=env,
                        timeout=300)
    if up.returncode != 0:
        sys.exit(up.stderr)
    url = next(ln.split()[1] for ln in up.stdout.splitlines() if ln.startswith("server "))
    same, cross = [], []
    try:
        c = sandlot.Client(url, timeout=300, retries=0)
        tag = uuid.uuid4().hex[:12]
        box = c.create(backend=a.backend, image="python", memory_mib=256, ttl_s=900,
                       labels={"xrb": tag})
        box.spawn(["sh", "-c", "while :; do date >> /workspace/t; sleep 0.2; done"],
                  timeout_s=900)
        for _ in range(a.rounds):
            assert c.pause({"xrb": tag}) == [box.id]
            t0 = time.monotonic()
            assert c.resume({"xrb": tag}) == [box.id]
            same.append(time.monotonic() - t0)
            assert box.exec("true").exit_code == 0
            node = c.get(box.id).node
            assert c.pause({"xrb": tag}) == [box.id]
            os.kill(int((d / f"{node}.pid").read_text()), 9)
            while True:
                with urllib.request.urlopen(url + "/v1/nodes", timeout=5) as r:
                    if node not in [n["name"] for n in json.load(r)["nodes"]]:
                        break
                time.sleep(0.1)
            t0 = time.monotonic()
            assert c.resume({"xrb": tag}) == [box.id]
            cross.append(time.monotonic() - t0)
            assert c.get(box.id).node != node
            assert box.exec("true").exit_code == 0
            i = node.removeprefix("node")
            subprocess.run([SCRIPT, "node-start", str(d), i], check=True, env=env,
                           capture_output=True, timeout=120)
            time.sleep(1.5)
        box.delete()
    finally:
        subprocess.run([SCRIPT, "down", str(d)], capture_output=True, env=env, timeout=300)
        shutil.rmtree(d, ignore_errors=True)
    ms = lambda xs: ", ".join(f"{x * 1000:.0f}" for x in xs)  # noqa: E731
    ratio = statistics.median(cross) / statistics.median(same)
    what, flag = ("microVM", "") if a.backend == "microvm" else ("VM (q35)", " --backend vm")
    out = (f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — cross-node vs "
           f"same-node resume of a paused {what} (TCG)\n\n"
           f"Command: `.venv/bin/python bench/xresume.py --rounds {a.rounds}{flag}`; this 2-core "
           "host (Debian 12, TCG), `scripts/cluster.sh up DIR 2` (both nodes and the shared "
           f"store `DIR/snapshots` on one local disk), {what} `python` 256 MiB with a "
           "background loop; time of `POST /v1/sandboxes:resume` through the server.\n\n"
           "| resume | runs (ms) | median (ms) |\n|---|---|---|\n"
           f"| same node (node alive) | {ms(same)} | {statistics.median(same) * 1000:.0f} |\n"
           f"| other node (own node killed) | {ms(cross)} | "
           f"{statistics.median(cross) * 1000:.0f} |\n\n"
           f"Ratio cross / same (medians): **{ratio:.2f}x**.\n")
    print(out)
    if a.write:
        import run as R  # bench/run.py: sections between `bench:begin`/`bench:end` markers

        p = Path(a.write)
        key = f"{time.strftime('%Y-%m-%d', time.gmtime())} xresume"
        if a.backend != "microvm":
            key += f" {a.backend}"
        p.write_text(R.upsert_section(p.read_text() if p.exists() else "", key, out.strip()))

if __name__ == "__main__":
    main()
