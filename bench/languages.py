#!/usr/bin/env python3
"""Per-language `run_code` benchmark: hello world through `POST /run_code` against the same
toolchain run bare with `chroot` on the same image, measured in the same run.

Usage (as root, on the host that runs the server; every request stays on 127.0.0.1):

    python3 bench/languages.py --start [--n 12] [--langs python,cpp,go] [--write BENCHMARKS.md]
    python3 bench/languages.py --url http://127.0.0.1:7070 [...]

What it measures, per language of the server's table (`GET /v1/run_code/languages`) whose
image is in the image store:
  - run_code: `POST /run_code` with a hello-world program (compile + run for compiled
    languages, as the server does it); the client-side latency of the whole call.
  - bare: the same files and the same compile and run argv (taken from the table, not
    written twice) run with `chroot` into an overlay of the same image layers, with the
    image's environment; compile and run are two processes, timed together. No namespaces,
    cgroups, seccomp or landlock: what the toolchain costs by itself.
Calls are interleaved in rounds (run_code block, bare block, order rotated), so a noisy
host weighs on both sides. Target (printed, never asserted): run_code p50 ≤ 1.3 × bare p50
+ 5 ms. The image section lists each image's layers with their sizes (du, hard links once)
and the disk the layers share.

Robustness: every call has a timeout, every loop a count and a deadline; the overlay
mounts are removed on exit (also on Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R  # noqa: E402  (the harness: statistics, interleaving, server, sections)

TARGET_RATIO = 1.3
TARGET_PLUS_MS = 5.0

# Hello-world programs; each prints exactly "hello\n". Languages not listed here are not
# measured (test-style modes: pytest, junit, go_test, jest, gtest, D_ut).
HELLO: dict[str, str] = {
    "python": 'print("hello")\n',
    "bash": "echo hello\n",
    "cpp": '#include <iostream>\nint main() { std::cout << "hello" << std::endl; }\n',
    "nodejs": 'console.log("hello");\n',
    "typescript": 'const s: string = "hello";\nconsole.log(s);\n',
    "go": 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }\n',
    "java": 'public class Main { public static void main(String[] a) { System.out.println("hello"); } }\n',
    "rust": 'fn main() { println!("hello"); }\n',
    "php": '<?php echo "hello\\n";\n',
    "ruby": 'puts "hello"\n',
    "lua": 'print("hello")\n',
    "perl": 'print "hello\\n";\n',
    "R": 'cat("hello\\n")\n',
    "csharp": 'class P { static void Main() { System.Console.WriteLine("hello"); } }\n',
    "scala": 'object Main { def main(a: Array[String]): Unit = println("hello") }\n',
    "kotlin_script": 'println("hello")\n',
    "racket": '#lang racket\n(displayln "hello")\n',
    "verilog": 'module tb; initial begin $display("hello"); $finish; end endmodule\n',
    "sql": "SELECT 'hello';\n",
}


def image_layers(images_dir: Path, image: str) -> tuple[list[Path], dict[str, str]]:
    """Layer directories (top-most first) and environment of short-named `image` from its
    `image.json` (crates/sandlot-node/src/images.rs). Raises FileNotFoundError when absent."""
    meta = json.loads((images_dir / image / "image.json").read_text())
    layers = [images_dir / rel for rel in meta.get("layers") or [f"{image}/rootfs"]]
    return layers, {k: v for k, v in meta.get("env", [])}


def du_bytes(path: Path, seen: set[tuple[int, int]]) -> int:
    """Apparent bytes under `path`, each inode counted once across calls sharing `seen`."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_size
    return total


class BareRoot:
    """A writable overlay of an image's layers with /proc and /dev, for chroot baselines."""

    def __init__(self, layers: list[Path]):
        self.tmp = Path(tempfile.mkdtemp(prefix="sandlot-bench-lang."))
        self.root = self.tmp / "root"
        for d in ("upper", "work", "root"):
            (self.tmp / d).mkdir()
        lower = ":".join(str(p) for p in layers)
        opts = f"lowerdir={lower},upperdir={self.tmp / 'upper'},workdir={self.tmp / 'work'}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(self.root)], check=True)
        self.mounts = [self.root]
        for src, dst, kind in (("proc", "proc", "proc"), ("/dev", "dev", None)):
            target = self.root / dst
            target.mkdir(exist_ok=True)
            cmd = ["mount", "-t", kind, src, str(target)] if kind else ["mount", "--rbind", src, str(target)]
            subprocess.run(cmd, check=True)
            self.mounts.append(target)
        self.seq = 0

    def call(self, entry: dict, code: str, env: dict[str, str], timeout_s: float):
        """A timed call: write the source, run compile argv (if any) then run argv."""

        def call() -> float:
            self.seq += 1
            rel = f"bench-{os.getpid()}-{self.seq}"
            d = self.root / "tmp" / rel
            d.mkdir(parents=True)
            inside = f"/tmp/{rel}"

            def enter() -> None:
                os.chroot(self.root)
                os.chdir(inside)

            t0 = time.perf_counter()
            (d / entry["file"]).write_text(code)
            out = b""
            for argv in [a for a in (entry.get("compile"), entry["run"]) if a]:
                p = subprocess.run(argv, preexec_fn=enter, env=env, capture_output=True,
                                   stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
                if p.returncode != 0:
                    raise R.BenchError(f"{argv[0]} exit {p.returncode}: {p.stderr[-300:]!r}")
                out = p.stdout
            lat = time.perf_counter() - t0
            shutil.rmtree(d, ignore_errors=True)
            if out.decode(errors="replace").strip() != "hello":
                raise R.BenchError(f"bare stdout {out[:100]!r}")
            return lat

        return call

    def close(self) -> None:
        for m in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(m)], check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_code_call(api: R.Api, language: str, code: str, timeout_s: float):
    def call() -> float:
        body = {"code": code, "language": language, "compile_timeout": timeout_s,
                "run_timeout": timeout_s}
        t0 = time.perf_counter()
        r = api.request("POST", "/run_code", json=body)
        lat = time.perf_counter() - t0
        if r.status_code != 200:
            raise R.BenchError(f"HTTP {r.status_code}: {r.text[:200]}")
        j = r.json()
        out = (j.get("run_result") or {}).get("stdout") or ""
        if j.get("status") != "Success" or out.strip() != "hello":
            raise R.BenchError(f"{j.get('status')}: {j.get('message')!r} stdout {out[:80]!r}")
        return lat

    return call


def measure(args, api: R.Api, table: list[dict], images_dir: Path) -> list[dict]:
    rows = []
    wanted = set(args.langs.split(",")) if args.langs else None
    for entry in table:
        lang = entry["language"]
        if lang not in HELLO or (wanted and lang not in wanted):
            continue
        row = {"language": lang, "image": entry["image"]}
        try:
            layers, env = image_layers(images_dir, entry["image"])
        except FileNotFoundError:
            row["skipped"] = f"image {entry['image']} not in {images_dir}"
            rows.append(row)
            continue
        env = {**env, **(entry.get("env") or {})}
        bare = BareRoot(layers)
        try:
            samples = R.interleaved(
                [("run_code", run_code_call(api, lang, HELLO[lang], args.timeout)),
                 ("bare", bare.call(entry, HELLO[lang], env, args.timeout))],
                n=args.n, concurrency=1, rounds=args.rounds,
                deadline_s=args.deadline, warmup=1,
            )
        finally:
            bare.close()
        row.update({k: s.to_json() for k, s in samples.items()})
        rows.append(row)
        rc, b = samples["run_code"].p(50), samples["bare"].p(50)
        print(f"{lang:14s} run_code p50 {R.fmt_ms(rc)}  bare p50 {R.fmt_ms(b)}  ratio {R.fmt_ratio(R.ratio(rc, b))}",
              flush=True)
    return rows


def wait_pools_ready(api: R.Api, deadline_s: float) -> None:
    """Wait (at most `deadline_s`) until every function warm-pool image has a ready jail
    (`sandlot_warm_pool_ready` on /metrics), so the first calls do not measure a pool that
    is still filling at start."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        r = api.request("GET", "/metrics")
        ready = [float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
                 if line.startswith('sandlot_warm_pool_ready{backend="function"')]
        if r.status_code == 200 and all(n >= 1 for n in ready):
            return
        time.sleep(0.5)
    print("bench: warm pools not all ready; measuring anyway", file=sys.stderr)


def image_rows(images_dir: Path, table: list[dict]) -> list[dict]:
    """Each table image's layers with sizes; a layer shared by images is sized once."""
    seen_layers: dict[Path, int] = {}
    out = []
    for image in sorted({e["image"] for e in table}):
        try:
            layers, _ = image_layers(images_dir, image)
        except FileNotFoundError:
            continue
        sizes = []
        for layer in layers:
            if layer not in seen_layers:
                seen_layers[layer] = du_bytes(layer, set())
            sizes.append((layer.relative_to(images_dir).as_posix(), seen_layers[layer]))
        out.append({"image": image, "layers": sizes})
    return out


def render(meta: dict, rows: list[dict], images: list[dict]) -> str:
    lines = [
        f"## {meta['date']} — run_code per language vs bare chroot",
        "",
        f"Command: `{meta['command']}`. Machine: {meta['machine']['nproc']} cores "
        f"({meta['machine']['cpu']}), kernel {meta['machine']['kernel']}, cgroup {meta['machine']['cgroup']}, "
        f"load {meta['machine']['loadavg']}; commit {meta['machine']['commit']}.",
        "Hello world per language, concurrency 1, interleaved rounds; bare = the same files and the "
        "table's compile + run argv under `chroot` into an overlay of the same image layers (no isolation). "
        "run_code on an image of the server's `--run-code-pool-images` hands a warm jail over; the others "
        "create a jail cold. "
        f"Target: run_code p50 ≤ {TARGET_RATIO} × bare p50 + {TARGET_PLUS_MS:g} ms.",
        "",
        "| language | image | run_code p50 ms | p99 ms | bare p50 ms | p99 ms | p50 ratio | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['language']} | {r['image']} | — | — | — | — | — | skipped: {r['skipped']} |")
            continue
        rc, b = r["run_code"], r["bare"]
        ok = None
        if rc["p50_ms"] is not None and b["p50_ms"] is not None:
            ok = rc["p50_ms"] <= TARGET_RATIO * b["p50_ms"] + TARGET_PLUS_MS
        errs = "; ".join(f"{k}: {r[k]['errors']} errors {r[k]['error_msgs'][:1]}" for k in ("run_code", "bare")
                         if r[k]["errors"])
        lines.append(
            f"| {r['language']} | {r['image']} | {R.fmt_ms(rc['p50_ms'])} | {R.fmt_ms(rc['p99_ms'])} | "
            f"{R.fmt_ms(b['p50_ms'])} | {R.fmt_ms(b['p99_ms'])} | {R.fmt_ratio(R.ratio(rc['p50_ms'], b['p50_ms']))} | "
            f"{R.verdict(ok)}{' (' + errs + ')' if errs else ''} |"
        )
    if images:
        total = {}
        for im in images:
            for name, size in im["layers"]:
                total[name] = size
        lines += ["", "Image layers (apparent size, hard links once per layer; a layer shared by images counted once "
                  f"in the total): total on disk {sum(total.values()) / 2**20:.0f} MiB.", "",
                  "| image | layers (top-most first) |", "|---|---|"]
        for im in images:
            desc = ", ".join(f"`{n}` {s / 2**20:.0f} MiB" for n, s in im["layers"])
            lines.append(f"| {im['image']} | {desc} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: --start one)")
    p.add_argument("--start", action="store_true",
                   help="start `sandlot up` on a free loopback port (more server flags from env "
                   "BENCH_SERVER_ARGS, e.g. \"--run-code-cpu 1\")")
    p.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    p.add_argument("--images-dir", default=os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"))
    p.add_argument("--langs", help="comma list of languages (default: every one with an image)")
    p.add_argument("--n", type=int, default=12, help="calls per subject per language (default 12)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per compile/run (default 60)")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds per language and subject")
    p.add_argument("--pool-images", default=None,
                   help="with --start: `sandlot up --run-code-pool-images` (comma list; default: "
                        "the server's own default, lang-python,lang-cpp,lang-java)")
    p.add_argument("--json", help="write raw results here")
    p.add_argument("--write", help="upsert the section into this BENCHMARKS.md")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: run as root (chroot and overlay mounts need it)", file=sys.stderr)
        return 2
    if R.httpx is None:
        print("bench: httpx missing (.venv/bin/python has it)", file=sys.stderr)
        return 2
    images_dir = Path(args.images_dir)
    server = None
    if args.start or not args.url:
        extra = [] if args.pool_images is None else ["--run-code-pool-images", args.pool_images]
        extra += os.environ.get("BENCH_SERVER_ARGS", "").split()
        server = R.Server(Path(args.binary), images_dir, extra, ready_timeout_s=60)
        server.start()
        url = server.url
    else:
        R.check_loopback(args.url)
        url = args.url
    api = R.Api(url, run_id=f"lang-{os.getpid()}", timeout_s=args.timeout * 3)
    try:
        r = api.request("GET", "/v1/run_code/languages")
        if r.status_code != 200:
            print(f"bench: GET /v1/run_code/languages: HTTP {r.status_code}", file=sys.stderr)
            return 1
        table = r.json()["languages"]
        wait_pools_ready(api, deadline_s=120)
        rows = measure(args, api, table, images_dir)
        images = image_rows(images_dir, table)
    finally:
        if server:
            server.stop()
            server.cleanup_dir()
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python3 bench/languages.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": R.machine(),
    }
    body = render(meta, rows, images)
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "images": images}, indent=2))
    if args.write:
        path = Path(args.write)
        text = path.read_text() if path.exists() else ""
        path.write_text(R.upsert_section(text, "languages", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
