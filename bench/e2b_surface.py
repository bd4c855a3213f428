#!/usr/bin/env python3
"""The E2B-compatible surface vs Sandlot's own API, and ingress vs a direct loopback
connection (issue 26, "Benchmarks"). Not named `e2b.py`: the script's own directory comes first on
sys.path, so that name would shadow the `e2b` package it drives.

Usage (as root, after scripts/setup.sh; the `e2b` SDK is in .venv):

    .venv/bin/python bench/e2b_surface.py [--backends container,function] [--n 30] [--rounds 3]
                                  [--write BENCHMARKS.md] [--json OUT]

Per backend, one `sandlot up --e2b-backend BACKEND` (warm pools as the defaults for the
`python` image: 4 function jails, 2 runc containers; no run_code pools), and on it, in one
run, interleaved in rounds at concurrency 1 (bench/run.py `interleaved`):

  create -> first command  e2b: `Sandbox.create("base")` + `commands.run("echo hi")`;
                           sandlot: `Client.create(backend, image="python")` +
                           `exec(["/bin/bash", "-l", "-c", "echo hi"])` (what envd's
                           `commands.run` starts, so both run the same process). The kill /
                           delete follows outside the timed window.
  command round trip       the same command in one live sandbox of each SDK.
  1 MiB write + read       `files.write` + `files.read(format="bytes")` vs `write_file` +
                           `read_file` of 1 MiB of random bytes (checked equal).
  ingress HTTP GET         a 13-byte file from `python3 -m http.server` in a sandbox, through
                           `/v1/sandboxes/{id}/ports/8000/` and through host-name routing
                           (`Host: 8000-<id>.e2b.app` to Sandlot's URL), vs a direct
                           loopback GET of the same file from `python3 -m http.server` on the
                           host (one keep-alive httpx client per subject; http.server closes
                           each connection, so every GET opens one to it either way).

Targets (printed and recorded, never asserted): the E2B surface within 1.2x of Sandlot's own
(p50); create -> first command p50 <= 100 ms through E2B on `container`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R  # noqa: E402

sys.path.insert(0, str(R.REPO / "sdk" / "python"))
import httpx  # noqa: E402
import sandlot  # noqa: E402
from e2b import Sandbox  # noqa: E402

TARGET_E2B_VS_OWN = 1.2
TARGET_CREATE_FIRST_P50_MS = 100.0  # on container
KEY = "e2b_sandlot_no_auth"  # any key: the bench's servers run without keys
CMD = "echo hi"
MIB = os.urandom(1 << 20)


def timed(fn):
    """A subject call: ``fn()`` returns (latency_s, answer ok); a wrong answer raises."""
    def call() -> float:
        lat, ok = fn()
        if not ok:
            raise R.BenchError("wrong answer")
        return lat
    return call


def subjects_for(backend: str, url: str, client: sandlot.Client, live_e2b: Sandbox,
                 live_own: sandlot.Sandbox, run_id: str) -> list:
    conn = dict(api_url=url, sandbox_url=url, api_key=KEY)

    def e2b_create():
        t0 = time.perf_counter()
        sb = Sandbox.create(template="base", timeout=120, metadata={"bench": run_id}, **conn)
        r = sb.commands.run(CMD)
        lat = time.perf_counter() - t0
        sb.kill()
        return lat, r.stdout == "hi\n"

    def own_create():
        t0 = time.perf_counter()
        sb = client.create(backend=backend, image="python", ttl_s=120,
                           labels={"bench": run_id})
        r = sb.exec(["/bin/bash", "-l", "-c", CMD])
        lat = time.perf_counter() - t0
        sb.delete()
        return lat, r.stdout == b"hi\n"

    def e2b_cmd():
        t0 = time.perf_counter()
        r = live_e2b.commands.run(CMD)
        return time.perf_counter() - t0, r.stdout == "hi\n"

    def own_cmd():
        t0 = time.perf_counter()
        r = live_own.exec(["/bin/bash", "-l", "-c", CMD])
        return time.perf_counter() - t0, r.stdout == b"hi\n"

    def e2b_file():
        t0 = time.perf_counter()
        live_e2b.files.write("/tmp/bench.bin", MIB)
        back = live_e2b.files.read("/tmp/bench.bin", format="bytes")
        return time.perf_counter() - t0, bytes(back) == MIB

    def own_file():
        t0 = time.perf_counter()
        live_own.write_file("/tmp/bench.bin", MIB)
        back = live_own.read_file("/tmp/bench.bin")
        return time.perf_counter() - t0, back == MIB

    return [
        ("e2b create->first command", timed(e2b_create)),
        ("sandlot create->first command", timed(own_create)),
        ("e2b command round trip", timed(e2b_cmd)),
        ("sandlot command round trip", timed(own_cmd)),
        ("e2b 1 MiB write+read", timed(e2b_file)),
        ("sandlot 1 MiB write+read", timed(own_file)),
    ]


PAIRS = [("create->first command", "e2b create->first command", "sandlot create->first command"),
         ("command round trip", "e2b command round trip", "sandlot command round trip"),
         ("1 MiB write+read", "e2b 1 MiB write+read", "sandlot 1 MiB write+read")]


def ingress_subjects(url: str, sid: str, host_url: str) -> list:
    via_path, via_host, direct = (httpx.Client(timeout=30) for _ in range(3))

    def get(c: httpx.Client, u: str, **kw):
        def fn():
            t0 = time.perf_counter()
            r = c.get(u, **kw)
            return time.perf_counter() - t0, r.status_code == 200 and r.text == "hello ingress"
        return timed(fn)

    return [
        ("ingress /v1/.../ports/8000/",
         get(via_path, f"{url}/v1/sandboxes/{sid}/ports/8000/hello.txt")),
        ("ingress Host: 8000-<id>", get(via_host, f"{url}/hello.txt",
                                        headers={"Host": f"8000-{sid}.e2b.app"})),
        ("direct loopback", get(direct, f"{host_url}/hello.txt")),
    ]


def wait_http(u: str, what: str, **kw) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(u, timeout=2, **kw).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"bench: {what} did not answer within 30 s")


def run_backend(backend: str, a, host_url: str) -> dict:
    server = R.Server(Path(a.binary), Path(a.images_dir),
                      ["--e2b-backend", backend, "--warm-pool-images", "python",
                       "--run-code-pool-images", ""], 60.0, tmp_parent="/var/tmp")
    run_id = f"e2bbench-{os.getpid()}"
    res: dict = {"backend": backend}
    try:
        server.start()
        client = sandlot.Client(server.url, timeout=60, retries=0)
        live_e2b = Sandbox.create(template="base", timeout=900, api_url=server.url,
                                  sandbox_url=server.url, api_key=KEY)
        live_own = client.create(backend=backend, image="python", ttl_s=900)
        live_own.write_file("/tmp/site/hello.txt", b"hello ingress")
        live_own.spawn(["/bin/sh", "-c", "cd /tmp/site && exec python3 -m http.server 8000"],
                       timeout_s=900)
        wait_http(f"{server.url}/v1/sandboxes/{live_own.id}/ports/8000/hello.txt",
                  "http.server in the sandbox")
        subjects = subjects_for(backend, server.url, client, live_e2b, live_own, run_id)
        subjects += ingress_subjects(server.url, live_own.id, host_url)
        res["load_before"] = R.loadavg()
        samples = R.interleaved(subjects, a.n, 1, a.rounds, 600.0, warmup=2)
        res["load_after"] = R.loadavg()
        res["samples"] = {k: v.to_json() for k, v in samples.items()}
        live_e2b.kill()
        live_own.delete()
        for b in client.list():
            b.delete()
        client.close()
    finally:
        server.stop()
        server.cleanup_dir()
    return res


def p(res: dict, name: str, q: str = "p50_ms"):
    return res["samples"][name][q]


def render(results: list[dict], a, meta: dict, started: str) -> str:
    m = meta
    lines = [
        f"## {started} — E2B surface vs Sandlot's own SDK; ingress vs direct loopback (issue 26)",
        "",
        f"Command: `.venv/bin/python bench/e2b_surface.py --backends {a.backends} --n {a.n} "
        f"--rounds {a.rounds}`; commit {m['commit']}; {m['nproc']} cores, {m['mem_gib']} GiB, "
        f"{m['cpu']}, kernel {m['kernel']}, cgroup {m['cgroup']}; `e2b` {a.e2b_version} "
        "(Python SDK) against one `sandlot up --e2b-backend BACKEND` per backend (default "
        "warm pools of `python`: 4 function jails, 2 runc containers); both SDKs in the same "
        "run on the same server, interleaved in rounds at concurrency 1; n per subject "
        f"{a.n}. Shared machine: other helpers were building (load per backend below).",
        "",
    ]
    for res in results:
        b = res["backend"]
        lines += [f"**{b}** (load average before / after: {res['load_before']} / "
                  f"{res['load_after']})", "",
                  "| measurement | e2b p50 | e2b p99 | sandlot p50 | sandlot p99 "
                  "| e2b / sandlot (p50) | target |",
                  "|---|---|---|---|---|---|---|"]
        for label, e, s in PAIRS:
            r = R.ratio(p(res, e), p(res, s))
            ok = None if r is None else r <= TARGET_E2B_VS_OWN
            target = f"≤ {TARGET_E2B_VS_OWN}×: {R.verdict(ok)}"
            if label.startswith("create") and b == "container":
                e50 = p(res, e)
                target += (f"; e2b p50 ≤ {TARGET_CREATE_FIRST_P50_MS:.0f} ms: "
                           f"{R.verdict(None if e50 is None else e50 <= TARGET_CREATE_FIRST_P50_MS)}")
            lines.append(f"| {label} | {R.fmt_ms(p(res, e))} ms "
                         f"| {R.fmt_ms(p(res, e, 'p99_ms'))} ms "
                         f"| {R.fmt_ms(p(res, s))} ms | {R.fmt_ms(p(res, s, 'p99_ms'))} ms "
                         f"| {R.fmt_ratio(r)} | {target} |")
        d = p(res, "direct loopback")
        lines += ["", "| ingress GET (13 B, `python3 -m http.server`) | p50 | p99 "
                  "| vs direct loopback (p50) |",
                  "|---|---|---|---|"]
        for name in ("ingress /v1/.../ports/8000/", "ingress Host: 8000-<id>", "direct loopback"):
            lines.append(f"| {name} | {R.fmt_ms(p(res, name))} ms | "
                         f"{R.fmt_ms(p(res, name, 'p99_ms'))} ms | "
                         f"{R.fmt_ratio(R.ratio(p(res, name), d))} |")
        errs = {k: (v["errors"], v["error_msgs"][:1]) for k, v in res["samples"].items()
                if v["errors"] or v["aborted"]}
        if errs:
            lines += ["", f"Errors: {json.dumps(errs)[:600]}"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    ap.add_argument("--images-dir", default="/var/lib/sandlot/images")
    ap.add_argument("--backends", default="container,function")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import importlib.metadata as md
    a.e2b_version = md.version("e2b")
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = R.machine()
    with tempfile.TemporaryDirectory(prefix="sandlot-e2bbench-") as site:
        Path(site, "hello.txt").write_text("hello ingress")
        port = R.free_loopback_port()
        host_srv = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
             "--directory", site], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            host_url = f"http://127.0.0.1:{port}"
            wait_http(f"{host_url}/hello.txt", "http.server on the host")
            results = [run_backend(b, a, host_url) for b in a.backends.split(",")]
        finally:
            host_srv.terminate()
            host_srv.wait(timeout=10)
    out = render(results, a, meta, started)
    print(out)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if a.write:
        path = Path(a.write)
        key = f"{started[:10]} e2b"
        path.write_text(R.upsert_section(path.read_text() if path.exists() else "", key, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
