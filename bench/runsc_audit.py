#!/usr/bin/env python3
"""Cost of gVisor seccomp reports (`sandlot-node` `backends/gvisor_audit.rs`): the exec round
trip in a live runsc sandbox with the reports on (default) and off (`SANDLOT_GVISOR_AUDIT=0`),
the same binary, two `sandlot up` servers side by side, calls interleaved round by round so
that both see the same host load.

Usage (as root):

    python3 bench/runsc_audit.py [--binary target/release/sandlot] [--agent-bin PATH]
        [--rounds 80] [--write BENCHMARKS.md]

Prints (and with --write prepends to BENCHMARKS.md) p50/p90 in ms of `true` and
`python3 -c pass` per setting. Everything it creates (two data dirs under /var/tmp, one
sandbox per server) is deleted at exit.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sdk" / "python"))

import sandlot  # noqa: E402

SETTINGS = {"reports on": {}, "reports off": {"SANDLOT_GVISOR_AUDIT": "0"}}
COMMANDS = [["true"], ["python3", "-c", "pass"]]


def wait_listening(proc: subprocess.Popen, log: Path, deadline_s: float = 60) -> str:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if line.startswith("sandlot listening on "):
                return line.split()[-1]
        if proc.poll() is not None:
            raise SystemExit(f"sandlot up exited: {text[-2000:]}")
        time.sleep(0.1)
    raise SystemExit("sandlot up did not start in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=str(REPO / "target/release/sandlot"))
    ap.add_argument("--agent-bin",
                    default=str(REPO / "target/x86_64-unknown-linux-gnu/release/sandlot-guest"))
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--write", help="prepend the results to this markdown file")
    a = ap.parse_args()

    procs, dirs, boxes = [], [], {}
    try:
        for name, extra in SETTINGS.items():
            d = Path(tempfile.mkdtemp(prefix="sandlot-bench-gvisor-", dir="/var/tmp"))
            os.chmod(d, 0o711)  # containers' host uids must walk it
            dirs.append(d)
            log = d / "up.log"
            env = dict(os.environ, SANDLOT_AGENT_BIN=a.agent_bin, **extra)
            p = subprocess.Popen([a.binary, "up", "--listen", "127.0.0.1:0", "--data-dir",
                                  str(d / "data"), "--images-dir", "/var/lib/sandlot/images",
                                  "--warm-pool", "0"],
                                 env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
            procs.append(p)
            url = wait_listening(p, log)
            c = sandlot.Client(url, timeout=60)
            boxes[name] = c.create(image="python", backend="container", runtime="runsc",
                                   ttl_s=1800, labels={"sandlot-bench": "gvisor-audit"})
        rows = []
        for cmd in COMMANDS:
            t = {k: [] for k in boxes}
            for b in boxes.values():
                b.exec(cmd)  # warm-up
            for _ in range(a.rounds):
                for k, b in boxes.items():
                    t0 = time.monotonic()
                    b.exec(cmd)
                    t[k].append((time.monotonic() - t0) * 1000)
            for k, v in t.items():
                s = sorted(v)
                rows.append((" ".join(cmd), k, len(s), statistics.median(s),
                             s[int(len(s) * 0.9)]))
        on = {r[0]: r[3] for r in rows if r[1] == "reports on"}
        off = {r[0]: r[3] for r in rows if r[1] == "reports off"}
        load = os.getloadavg()[0]
        now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        md = [f"## {now} — runsc seccomp reports (gVisor sentry log): exec round trip, on vs off",
              "",
              f"`python3 bench/runsc_audit.py --rounds {a.rounds}`: two `sandlot up` of the same "
              "binary, one with `SANDLOT_GVISOR_AUDIT=0`; one live runsc sandbox each; calls "
              f"interleaved round by round (same host load; 1-min load average at the end "
              f"{load:.1f} on this 2-core host).",
              "",
              "| command | setting | n | p50 ms | p90 ms |",
              "|---|---|---:|---:|---:|"]
        md += [f"| `{c}` | {k} | {n} | {p50:.1f} | {p90:.1f} |" for c, k, n, p50, p90 in rows]
        md += [""] + [f"- `{c}`: reports on costs {on[c] - off[c]:+.1f} ms p50 "
                      f"({(on[c] / off[c] - 1) * 100:+.0f}%)" for c in on] + [""]
        text = "\n".join(md)
        print(text)
        if a.write:
            path = Path(a.write)
            old = path.read_text()
            head, sep, rest = old.partition("\n## ")
            path.write_text(head + "\n" + text + "\n" + sep.lstrip("\n") + rest
                            if sep else old + "\n" + text)
    finally:
        for b in boxes.values():
            try:
                b.delete()
            except sandlot.SandlotError as e:
                print(f"delete {b.id}: {e}", file=sys.stderr)
        for p in procs:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
