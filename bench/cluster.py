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
    args = p.parse_args(argv)
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
