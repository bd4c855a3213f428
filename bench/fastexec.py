#!/usr/bin/env python3
"""Exec round trip in a live `function` sandbox vs bare `chroot` (issue 24 item 5).

Usage (as root): python3 bench/fastexec.py [--binary target/release/sandlot] [--n 60]
    [--conc 8] [--json FILE] [--write BENCHMARKS.md]

Subjects, interleaved in rounds at concurrency 1 (and `--conc` if given), in one run:
exec `true` and `python3 -c 'print(1)'` in one live function sandbox (POST
/v1/sandboxes/{id}/exec, keep-alive HTTP) of a default `sandlot up` (execs through the guest
agent inside the jail), the same in a second `sandlot up` with `SANDLOT_FUNCTION_AGENT=0`
(the helper path, "helper"), and the same argv under `chroot ROOTFS`; plus `run_code`
python `print(1)` on each server (create, run, delete; warm pool as configured). Prints
p50/p99 per subject and the ratios; `--json` writes the raw figures; `--write` upserts the
section `fastexec` into that BENCHMARKS.md, only when no subject had an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    p.add_argument("--images-dir", default="/var/lib/sandlot/images")
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conc", type=int, default=0, help="also measure at this concurrency")
    p.add_argument("--json")
    p.add_argument("--write", help="upsert the section into this BENCHMARKS.md (clean runs only)")
    args = p.parse_args(argv)
    rootfs = R.find_rootfs(None)
    servers = {
        "": R.Server(Path(args.binary), Path(args.images_dir), [], 60.0),
        "helper ": R.Server(Path(args.binary), Path(args.images_dir), [], 60.0,
                            env={"SANDLOT_FUNCTION_AGENT": "0"}),
    }
    apis: dict = {}
    out: dict = {"machine": R.machine(), "load": R.loadavg(), "by_conc": {}}
    try:
        for tag, server in servers.items():
            server.start()
            apis[tag] = R.Api(server.url, "fastexec")
        sids = {tag: api.create("python") for tag, api in apis.items()}
        py = ["/usr/bin/python3", "-c", "print(1)"]

        def ex(api, sid: str, cmd: list[str], want: str):
            def call() -> float:
                t0 = R.time.perf_counter()
                res = api.exec(sid, cmd)
                lat = R.time.perf_counter() - t0
                if res.get("exit_code") != 0 or res.get("stdout") != want:
                    raise R.BenchError(f"exec answered {json.dumps(res)[:300]}")
                return lat
            return call

        subjects = [
            ("chroot true", R.subprocess_call(["chroot", str(rootfs), "/bin/true"], "", 30)),
            ("chroot python", R.subprocess_call(["chroot", str(rootfs), *py], "1\n", 30)),
        ]
        def rc(api):
            def call() -> float:
                t0 = R.time.perf_counter()
                res = api.run_code("print(1)")
                lat = R.time.perf_counter() - t0
                rr = res.get("run_result") or {}
                if res.get("status") != "Success" or rr.get("stdout") != "1\n":
                    raise R.BenchError(f"run_code answered {json.dumps(res)[:300]}")
                return lat
            return call

        for tag, api in apis.items():
            subjects += [
                (f"{tag}exec true", ex(api, sids[tag], ["/bin/true"], "")),
                (f"{tag}exec python", ex(api, sids[tag], py, "1\n")),
                (f"{tag}run_code python", rc(api)),
            ]
        concs = [1] + ([args.conc] if args.conc > 1 else [])
        for conc in concs:
            res = R.interleaved(subjects, args.n, conc, args.rounds, 300.0, warmup=3)
            out["by_conc"][conc] = {k: v.to_json() for k, v in res.items()}
            print(f"concurrency {conc} (load {R.loadavg()}):")
            for k, v in res.items():
                print(f"  {k:24s} p50 {R.fmt_ms(v.p(50)):>8s} ms  p99 {R.fmt_ms(v.p(99)):>8s} ms  "
                      f"rate {R.fmt_rate(v.rate):>8s}/s  errors {v.errors} {v.error_msgs[:1]}")
            for what in ("true", "python", "run_code"):
                a, s = (f"exec {what}", f"helper exec {what}") if what != "run_code" else (
                    "run_code python", "helper run_code python")
                b = f"chroot {what}" if what != "run_code" else "chroot python"
                for x, y in ((a, b), (s, b), (a, s)):
                    print(f"  {x} / {y}: p50 "
                          f"{R.fmt_ratio(R.ratio(res[x].p(50), res[y].p(50)))}")
        for tag, api in apis.items():
            api.delete(sids[tag])
    finally:
        for api in apis.values():
            api.close()
        for server in servers.values():
            server.stop()
            server.cleanup_dir()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.write:
        errors = sum(v["errors"] + bool(v["aborted"])
                     for c in out["by_conc"].values() for v in c.values())
        if errors:
            print(f"fastexec: {errors} errors: BENCHMARKS.md left as it is", file=sys.stderr)
            return 1
        path = Path(args.write)
        text = path.read_text() if path.exists() else ""
        path.write_text(R.upsert_section(text, "fastexec", render(out, argv)))
    return 0


def render(out: dict, argv: list[str] | None) -> str:
    """The BENCHMARKS.md section of one run: p50 (p99) per subject and the ratios."""
    date = R._dt.datetime.now(R._dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python3 bench/fastexec.py " + " ".join(argv if argv is not None else sys.argv[1:])
    m = out["machine"]
    lines = [
        f"## {date} — function exec: guest agent in the jail (default) vs helper path "
        "(`SANDLOT_FUNCTION_AGENT=0`) vs bare chroot",
        "",
        f"Command: `{cmd}`. Machine: {m['nproc']} cores ({m['cpu']}), {m['mem_gib']} GiB, "
        f"kernel {m['kernel']}, cgroup {m['cgroup']}, commit {m['commit']}; load "
        f"{out['load']} before. Two "
        "`sandlot up` in one run (default = agent; `SANDLOT_FUNCTION_AGENT=0` = helper), one "
        "live `function` sandbox (image `python`) in each, plus `run_code` python `print(1)` "
        "on each; subjects interleaved; baseline bare `chroot ROOTFS` in the same run.",
        "",
    ]

    def p50(d: dict) -> float | None:
        return d.get("p50_ms")

    for conc, res in out["by_conc"].items():
        lines += [f"| concurrency {conc} | p50 ms | p99 ms | calls/s | p50 vs chroot "
                  "| p50 agent / helper |",
                  "|---|---:|---:|---:|---:|---:|"]
        for what in ("true", "python", "run_code"):
            base = res[f"chroot {what}" if what != "run_code" else "chroot python"]
            names = ([f"chroot {what}"] if what != "run_code" else []) + (
                [f"exec {what}", f"helper exec {what}"] if what != "run_code"
                else ["run_code python", "helper run_code python"])
            for k in names:
                v = res[k]
                vs = "" if k.startswith("chroot") else R.fmt_ratio(R.ratio(p50(v), p50(base)))
                ah = ""
                if k in ("exec " + what, "run_code python"):
                    h = res["helper " + k]
                    ah = R.fmt_ratio(R.ratio(p50(v), p50(h)))
                lines.append(f"| {k} | {R.fmt_ms(p50(v))} | {R.fmt_ms(v.get('p99_ms'))} "
                             f"| {R.fmt_rate(v.get('rate_per_s'))} | {vs} | {ah} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
