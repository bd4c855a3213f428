#!/usr/bin/env python3
"""Sandlot `container` backend benchmarks (runc and gVisor runsc), side by side with bare
OCI runtime baselines measured in the same run. Reuses bench/run.py's load driver,
percentiles, API client, host-memory readers and BENCHMARKS.md writer.

Usage (as root; starts its own `sandlot up` on a free loopback port with a data dir under
/var/tmp, which containers' unprivileged host uids can walk; deletes everything it created):

    python3 bench/containers.py [--quick] [--write BENCHMARKS.md] [--json out.json]
        [--binary target/release/sandlot] [--agent-bin PATH] [--guest-bin PATH]
        [--runtimes runc,runsc] [--idle-runc 1000] [--idle-runsc 100] [--skip SECTIONS]

Sections (--skip takes their names):
  create  container create -> first exec result (`true`) through the API, p50/p99, per
          runtime, vs `RUNTIME run --bundle B ID` of an equivalent bundle to its exit (the
          config.json of a live container of the same run with args `/bin/true`, rootfs an
          overlay of the same image layers). Concurrency 1; the delete is untimed. Two
          API rows for runc: cold (the main server, `--container-warm-pool 0`) and pooled
          (a second server with the container warm pool on at its default size, 2; before
          each timed create the harness waits, untimed, until the pool is full again).
  rate    create+delete cycles/s at concurrency 8 per runtime (create latency p50/p99 too),
          with bare `runc run` at concurrency 8 as reference.
  exec    exec round trip of `true` in a live container through the agent, c1, per runtime,
          and in a live `function` sandbox for comparison.
  idle    N concurrent idle containers per runtime: host memory per sandbox
          (MemTotal-MemAvailable delta) and the sum of their cgroups' memory charge; all
          deleted after, then checked gone (API listing, DATA/containers entries, runtime
          state dirs, cgroups, processes, host mounts naming the data dir).
  noisy   noisy neighbour: container A execs `true` in a loop; quiet blocks alternate with
          noisy blocks during which container B (memory_mib 256, pids_max 64) runs at the
          same time a memory bomb, a fork bomb and a CPU spin (each its own exec loop, with
          timeouts). A's p99 noisy / quiet is the figure (target <= 2x).

Every loop is bounded by a count and a deadline; sandboxes carry the `sandlot-bench=<run>`
label and a TTL; bare bundles, their mounts, runtime state and cgroups are removed at exit.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R

# Targets (the only place they live): printed next to the figures, never asserted.
TARGET_CREATE_VS_BARE = 1.5  # API create -> first exec p50 <= 1.5 x bare `runc run` p50
SECTIONS = ("create", "rate", "exec", "idle", "noisy")  # what --skip names
TARGET_EXEC_P50_MS = 3.0  # exec round trip through the agent, p50
TARGET_IDLE_RUNC_MIB = 4.0  # host overhead per idle runc container
TARGET_NOISY_P99_RATIO = 2.0  # A's exec p99 with the noisy neighbour <= 2 x quiet p99

RUNTIME_BINS = {"runc": "/usr/sbin/runc", "runsc": "/usr/local/bin/runsc"}
# The global flags the node gives runsc (crates/sandlot-node/src/backends/container.rs,
# `runtime_cmd`): the bare baseline runs with the same ones.
RUNSC_FLAGS = [
    "--platform=systrap",
    "--network=none",
    "--ignore-cgroups",
    "--overlay2=none",
    "--file-access=shared",
    "--host-uds=create",
]

# Commands of the noisy neighbour B (each one exec, looped; timeouts in seconds).
NOISE = {
    # Allocates and touches 16 MiB chunks past B's 256 MiB limit: OOM-killed every time.
    "memory bomb": (
        [
            "python3",
            "-c",
            "a=[]\nwhile True:\n b=bytearray(16<<20)\n b[::4096]=b'x'*len(b[::4096])\n a.append(b)",
        ],
        20.0,
    ),
    # Classic shell fork bomb; B's pids_max (64) caps it, the exec timeout ends it.
    "fork bomb": (["sh", "-c", "b(){ b | b & }; b; sleep 5"], 4.0),
    # Two spinning processes (B's cpu quota is 1 core by default).
    "cpu spin": (["sh", "-c", "(while :; do :; done) & while :; do :; done"], 4.0),
}


class Unavailable(Exception):
    """The server has no usable container backend (exit status 3, nothing written)."""


def runtime_bin(name: str) -> str | None:
    p = shutil.which(name) or RUNTIME_BINS.get(name)
    return p if p and os.access(p, os.X_OK) else None


# ----------------------------------------------------------------------------- bare bundles


def overlay_lowerdir(rootfs: Path) -> str | None:
    """The `lowerdir=` option of the overlay mounted at `rootfs` (/proc/self/mountinfo)."""
    want = str(rootfs)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == want and " - overlay " in line:
                for opt in line.split(" - ", 1)[1].split()[-1].split(","):
                    if opt.startswith("lowerdir="):
                        return opt[len("lowerdir=") :]
    return None


def bare_config(template: dict, runtime: str, bundle: Path, cgroup_parent: str) -> dict:
    """A live container's config.json turned into the baseline's: `/bin/true` instead of the
    agent, its own hostname, cgroupsPath under `cgroup_parent` for runc (runc creates and
    removes the group, the node does the same for its containers), none for runsc (run with
    --ignore-cgroups, as the node does); a bind-mount source inside the container's bundle
    (runsc's agent socket dir) is moved to the baseline's bundle."""
    c = json.loads(json.dumps(template))
    c["process"]["args"] = ["/bin/true"]
    c["hostname"] = "bench-bare"
    linux = c.setdefault("linux", {})
    if runtime == "runsc":
        linux.pop("cgroupsPath", None)
    else:
        linux["cgroupsPath"] = (
            f"/{cgroup_parent}/bare"  # replaced per run, see BareRuntime
        )
    for m in c.get("mounts", []):
        if m.get("destination") == "/.sandlot/run":
            m["source"] = str(bundle / "run")
    return c


class BareRuntime:
    """`RUNTIME --root STATE [flags] run --bundle B ID` of an equivalent bundle, to its exit."""

    def __init__(
        self,
        runtime: str,
        binary: str,
        template: dict,
        lowerdir: str,
        workdir: Path,
        run_id: str,
    ):
        self.runtime = runtime
        self.binary = binary
        self.dir = workdir / f"bare-{runtime}"
        self.bundle = self.dir / "bundle"
        self.state = self.dir / "state"
        self.cgroup_parent = f"sandlot-bench-bare-{run_id}"
        self.flags = RUNSC_FLAGS if runtime == "runsc" else []
        self.counter = 0
        self.lock = threading.Lock()
        self.mounted = False
        uid = int(template["linux"]["uidMappings"][0]["hostID"])
        for d in ("upper", "work", "rootfs", "run"):
            (self.bundle / d).mkdir(parents=True, exist_ok=True)
        for d in ("upper", "work", "run"):
            os.chown(self.bundle / d, uid, uid)
        self.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o711)
        os.chmod(self.bundle, 0o711)
        opts = f"lowerdir={lowerdir},upperdir={self.bundle / 'upper'},workdir={self.bundle / 'work'}"
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                opts + ",nodev",
                str(self.bundle / "rootfs"),
            ],
            check=True,
            timeout=30,
        )
        self.mounted = True
        self.config = bare_config(template, runtime, self.bundle, self.cgroup_parent)
        (self.bundle / "config.json").write_text(json.dumps(self.config))
        self.example = shlex.join(
            [binary, "--root", "STATE", *self.flags, "run", "--bundle", "BUNDLE", "ID"]
        )

    def call(self) -> float:
        """One run to its exit. Each id gets its own small bundle dir (config.json only:
        root.path points at the shared overlay, cgroupsPath at its own group), written
        before the timed window, so concurrent runs do not share a cgroup."""
        with self.lock:
            self.counter += 1
            cid = f"bench-bare-{self.runtime}-{self.counter}"
        bdir = self.dir / "b" / cid
        bdir.mkdir(parents=True)
        os.chmod(bdir, 0o711)
        cfg = json.loads(json.dumps(self.config))
        cfg["root"]["path"] = str(self.bundle / "rootfs")
        if self.runtime != "runsc":
            cfg["linux"]["cgroupsPath"] = f"/{self.cgroup_parent}/{cid}"
        (bdir / "config.json").write_text(json.dumps(cfg))
        cmd = [
            self.binary,
            "--root",
            str(self.state),
            *self.flags,
            "run",
            "--bundle",
            str(bdir),
            cid,
        ]
        try:
            t0 = time.perf_counter()
            p = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=60,
                check=False,
            )
            lat = time.perf_counter() - t0
        finally:
            shutil.rmtree(bdir, ignore_errors=True)
        if p.returncode != 0:
            raise R.BenchError(
                f"{self.runtime} run exit {p.returncode}: {p.stderr[-300:]!r}"
            )
        return lat

    def close(self) -> list[str]:
        """Delete leftover containers, unmount, remove the cgroup parent and the files.
        Returns what could not be removed."""
        problems = []
        try:
            for cid in os.listdir(self.state):
                if cid.startswith("bench-bare-"):
                    subprocess.run(
                        [
                            self.binary,
                            "--root",
                            str(self.state),
                            *self.flags,
                            "delete",
                            "--force",
                            cid,
                        ],
                        capture_output=True,
                        timeout=30,
                        check=False,
                    )
        except OSError:
            pass
        if self.mounted:
            r = subprocess.run(
                ["umount", str(self.bundle / "rootfs")],
                capture_output=True,
                timeout=30,
                check=False,
            )
            if r.returncode != 0:
                problems.append(
                    f"umount {self.bundle / 'rootfs'}: {r.stderr.decode(errors='replace')[:200]}"
                )
            else:
                self.mounted = False
        R.remove_empty_cgroup_parent(self.cgroup_parent)
        if not self.mounted:
            shutil.rmtree(self.dir, ignore_errors=True)
        return problems


# ----------------------------------------------------------------------------- helpers


class Ctx:
    """What every section needs: the API client, the server, the run's scratch dir."""

    def __init__(self, api: R.Api, server: R.Server, image: str, run_id: str):
        self.api = api
        self.server = server
        self.image = image
        self.run_id = run_id
        self.data = server.tmp / "data"
        self.containers_dir = self.data / "containers"
        self.lock = threading.Lock()

    def create(self, runtime: str | None, **extra) -> str:
        if runtime is None:
            return self.api.create(self.image, ttl_s=1800)
        return self.api.create(
            self.image, ttl_s=1800, backend="container", runtime=runtime, **extra
        )

    def exec_true(self, sid: str) -> dict:
        res = self.api.exec(sid, ["true"])
        if res.get("exit_code") != 0:
            raise R.BenchError(f"exec true answered {json.dumps(res)[:300]}")
        return res


def mounts_naming(path: Path) -> list[str]:
    """Host mount points (/proc/self/mountinfo) under `path` or whose options name it."""
    out = []
    want = str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if want in line:
                out.append(line.split()[4])
    return out


def server_log_problems(log_text: str, limit: int = 8) -> list[tuple[int, str]]:
    """WARN/ERROR lines of a server log grouped by kind (timestamp dropped, sandbox ids,
    paths and numbers normalised): [(count, first line of that kind)], most frequent first,
    at most `limit` kinds."""
    kinds: dict[str, list] = {}
    for ln in log_text.splitlines():
        m = re.search(r"\b(WARN|ERROR)\b", ln)
        if not m:
            continue
        body = ln[m.start() :]
        key = re.sub(r"sb-[0-9a-f]{20}", "sb-*", body)
        key = re.sub(r"/\S+", "PATH", key)
        key = re.sub(r"\d+", "N", key)
        k = kinds.setdefault(key, [0, ln[:500]])
        k[0] += 1
    return sorted(((c, ex) for c, ex in kinds.values()), key=lambda t: -t[0])[:limit]


def phase_p(vals: list[float], q: float) -> float | None:
    return R.percentile(vals, q) * 1000.0 if vals else None


# ----------------------------------------------------------------------------- sections


#: `sandlot up --container-warm-pool` default: ready runc containers per pooled image.
CONTAINER_POOL_SIZE = 2


def pool_ready(ctx: Ctx) -> int:
    """Pooled containers of `ctx`'s server that finished building (DATA/container-pool/
    cp-*/state.json)."""
    try:
        return sum(
            1 for p in (ctx.data / "container-pool").iterdir() if (p / "state.json").is_file()
        )
    except OSError:
        return 0


def wait_pool_full(ctx: Ctx, n: int = CONTAINER_POOL_SIZE, timeout_s: float = 60.0) -> None:
    """Poll (untimed, 5 ms) until the server's container pool holds `n` ready containers."""
    end = time.monotonic() + timeout_s
    while pool_ready(ctx) < n:
        if time.monotonic() > end or R.STOP.is_set():
            raise R.BenchError(f"container pool not refilled to {n} within {timeout_s:.0f}s")
        time.sleep(0.005)


def section_create(
    ctx: Ctx,
    runtimes: list[str],
    bares: dict[str, BareRuntime],
    n: int,
    rounds: int,
    deadline_s: float,
    pooled: Ctx | None = None,
) -> dict:
    """Create -> first exec (`true`) through the API vs the bare runtime run, c1. With
    `pooled` (a server whose container warm pool is on), a second runc row whose every
    create finds a full pool (waited for, untimed, before the timed window)."""
    phases: dict[str, dict[str, list[float]]] = {}
    served = {"pool": 0, "cold": 0}

    def make(rt: str, c: Ctx = ctx, key: str | None = None) -> Callable[[], float]:
        ph = phases.setdefault(key or rt, {"create": [], "exec": [], "delete": []})

        def cycle() -> float:
            if key is not None:
                wait_pool_full(c)
            t0 = time.perf_counter()
            sid = c.create(rt)
            t1 = time.perf_counter()
            if key is not None:
                # Untimed: was it handed over by the pool (state.json names a cp- runtime id)?
                try:
                    st = json.loads((c.containers_dir / sid / "state.json").read_text())
                    hit = str(st.get("runtime_id", "")).startswith("cp-")
                except (OSError, ValueError):
                    hit = False
                with c.lock:
                    served["pool" if hit else "cold"] += 1
            try:
                c.exec_true(sid)
                t2 = time.perf_counter()
            finally:
                t3 = time.perf_counter()
                c.api.delete(sid)
                t4 = time.perf_counter()
            with c.lock:
                ph["create"].append(t1 - t0)
                ph["exec"].append(t2 - t1)
                ph["delete"].append(t4 - t3)
            return t2 - t0

        return cycle

    subjects: list[tuple[str, Callable[[], float]]] = []
    for rt in runtimes:
        subjects.append((f"bare {rt} run", bares[rt].call))
        subjects.append((f"{rt} create+exec", make(rt)))
        if rt == "runc" and pooled is not None:
            subjects.append(
                ("runc pooled create+exec", make(rt, pooled, "runc pooled"))
            )
    print(
        f"  [create] c1: {n} per subject in {rounds} rounds ({[s for s, _ in subjects]}) ...",
        flush=True,
    )
    samples = R.interleaved(subjects, n, 1, rounds, deadline_s, warmup=2)
    return {
        "samples": samples,
        "phases": {
            rt: {k: (phase_p(v[2:], 50), phase_p(v[2:], 99)) for k, v in ph.items()}
            for rt, ph in phases.items()
        },
        "bare_cmd": {rt: b.example for rt, b in bares.items()},
        "pool_served": served if pooled is not None else None,
    }


def section_rate(
    ctx: Ctx,
    runtimes: list[str],
    bares: dict[str, BareRuntime],
    n: int,
    rounds: int,
    deadline_s: float,
) -> dict:
    """create+delete cycles/s at concurrency 8; the latency is the create's."""

    def make(rt: str) -> Callable[[], float]:
        def cycle() -> float:
            t0 = time.perf_counter()
            sid = ctx.create(rt)
            lat = time.perf_counter() - t0
            ctx.api.delete(sid)
            return lat

        return cycle

    subjects: list[tuple[str, Callable[[], float]]] = []
    if "runc" in bares:
        subjects.append(("bare runc run", bares["runc"].call))
    for rt in runtimes:
        subjects.append((f"{rt} create+delete", make(rt)))
    print(f"  [rate] c8: {n} per subject in {rounds} rounds ...", flush=True)
    return {"samples": R.interleaved(subjects, n, 8, rounds, deadline_s, warmup=1)}


def section_exec(
    ctx: Ctx, live: dict[str, str], n: int, rounds: int, deadline_s: float
) -> dict:
    """Exec round trip of `true` in a live sandbox, c1; server-reported duration_ms too."""
    server_ms: dict[str, list[float]] = {}

    def make(name: str, sid: str) -> Callable[[], float]:
        def call() -> float:
            t0 = time.perf_counter()
            res = ctx.exec_true(sid)
            lat = time.perf_counter() - t0
            if isinstance(res.get("duration_ms"), (int, float)):
                with ctx.lock:
                    server_ms.setdefault(name, []).append(res["duration_ms"])
            return lat

        return call

    subjects = [
        (f"exec true: {name}", make(f"exec true: {name}", sid))
        for name, sid in live.items()
    ]
    print(f"  [exec] c1: {n} per subject in {rounds} rounds ...", flush=True)
    samples = R.interleaved(subjects, n, 1, rounds, deadline_s, warmup=5)
    return {
        "samples": samples,
        "server_ms": {
            k: (R.percentile(v, 50), R.percentile(v, 99))
            for k, v in server_ms.items()
            if v
        },
    }


def section_idle(
    ctx: Ctx, runtime: str, count: int, concurrency: int, deadline_s: float
) -> dict:
    """`count` idle containers alive at once: host memory per sandbox, cgroup charge; then all
    deleted and checked gone."""
    api = ctx.api
    res: dict = {"runtime": runtime, "requested": count, "image": ctx.image}
    time.sleep(1.0)
    before = R.host_used_bytes()
    parts_before = R.meminfo_parts()
    pid = ctx.server.proc.pid if ctx.server.proc else None
    rss_before = R.rss_bytes(pid) if pid else None
    ids: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    issued = {"n": 0}
    end_at = time.monotonic() + deadline_s

    def worker() -> None:
        while not R.STOP.is_set() and time.monotonic() < end_at:
            with lock:
                if issued["n"] >= count or len(errors) >= 10:
                    return
                issued["n"] += 1
            try:
                sid = ctx.create(runtime)
                with lock:
                    ids.append(sid)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:400])

    print(
        f"  [idle] creating {count} idle {runtime} containers (c{concurrency}) ...",
        flush=True,
    )
    t0 = time.perf_counter()
    R.join_all([R.spawn(worker) for _ in range(concurrency)])
    res["create_wall_s"] = time.perf_counter() - t0
    res["created"] = len(ids)
    res["errors"] = errors
    if not ids:
        return res
    probe_fail = 0
    for sid in ids[:: max(1, len(ids) // 10)]:
        try:
            ctx.exec_true(sid)
        except Exception as e:  # noqa: BLE001
            probe_fail += 1
            errors.append(f"probe exec {sid}: {e}"[:300])
    res["probe_execs_failed"] = probe_fail
    time.sleep(3.0)
    after = R.host_used_bytes()
    parts_after = R.meminfo_parts()
    id_set = set(ids)
    cgs = R.sandbox_cgroups(id_set)
    res["host_before_mib"] = before / 2**20
    res["host_after_mib"] = after / 2**20
    res["per_sandbox_host_mib"] = (after - before) / len(ids) / 2**20
    res["cgroups_found"] = len(cgs)
    res["cgroup_sum_mib"] = sum(cgs.values()) / 2**20
    res["per_sandbox_cgroup_mib"] = (
        (sum(cgs.values()) / len(cgs) / 2**20) if cgs else None
    )
    res["parts_per_sandbox_kib"] = {
        k: (parts_after[k] - parts_before[k]) / len(ids) / 1024 for k in R.MEMINFO_PARTS
    }
    rss_after = R.rss_bytes(pid) if pid else None
    res["server_rss_delta_mib"] = (
        (rss_after - rss_before) / 2**20 if rss_before and rss_after else None
    )
    res["procs_alive"] = R.procs_in(id_set)
    res["mounts_alive"] = len(mounts_naming(ctx.data))
    res["dirs_alive"] = R.dirs_named(ctx.containers_dir, id_set)
    print(f"  [idle] deleting {len(ids)} {runtime} containers ...", flush=True)
    t1 = time.perf_counter()
    failed = api.delete_all(concurrency=concurrency, deadline_s=deadline_s)
    res["delete_wall_s"] = time.perf_counter() - t1
    res["delete_failed"] = len(failed)
    state_root = ctx.data / "runtime" / runtime
    deadline = time.monotonic() + 30
    while True:
        listed = [
            s
            for s in api.list_mine()
            if s["id"] in id_set and s.get("state") != "deleted"
        ]
        left = {
            "listed": len(listed),
            "cgroups": len(R.sandbox_cgroups(id_set)),
            "procs": R.procs_in(id_set),
            "containers_dir_entries": len(os.listdir(ctx.containers_dir))
            if ctx.containers_dir.exists()
            else 0,
            "runtime_state_entries": R.dirs_named(state_root, id_set) or 0,
            "mounts_naming_data_dir": len(mounts_naming(ctx.data)),
        }
        gone = not any(left.values())
        if gone or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    res["left"] = left
    res["all_gone"] = gone
    time.sleep(1.0)
    res["host_after_delete_mib"] = R.host_used_bytes() / 2**20
    return res


def section_noisy(
    ctx: Ctx, runtime: str, n: int, rounds: int, deadline_s: float
) -> dict:
    """A's `true` exec latency, quiet blocks alternating with noisy blocks (B's bombs)."""
    a = ctx.create(runtime)
    b = ctx.create(runtime, memory_mib=256, pids_max=64)
    quiet = R.Sample(f"A quiet ({runtime})", 1)
    noisy = R.Sample(f"A with noisy B ({runtime})", 1)
    noise_log: dict[str, dict] = {
        k: {
            "execs": 0,
            "oom_killed": 0,
            "timed_out": 0,
            "errors": 0,
            "exit_codes": {},
            "err_msgs": [],
        }
        for k in NOISE
    }
    noise_on = threading.Event()
    noise_lock = threading.Lock()

    def noise_loop(name: str) -> None:
        cmd, tmo = NOISE[name]
        st = noise_log[name]
        while noise_on.is_set() and not R.STOP.is_set():
            try:
                r = ctx.api.exec(b, cmd, timeout_s=tmo)
                with noise_lock:
                    st["execs"] += 1
                    st["oom_killed"] += bool(r.get("oom_killed"))
                    st["timed_out"] += bool(r.get("timed_out"))
                    k = str(r.get("exit_code"))
                    st["exit_codes"][k] = st["exit_codes"].get(k, 0) + 1
            except Exception as e:  # noqa: BLE001
                with noise_lock:
                    st["errors"] += 1
                    if len(st["err_msgs"]) < 2:
                        st["err_msgs"].append(f"{type(e).__name__}: {e}"[:300])
                time.sleep(0.2)

    def a_call() -> float:
        t0 = time.perf_counter()
        ctx.exec_true(a)
        return time.perf_counter() - t0

    try:
        for _ in range(5):
            a_call()
        per = [n // rounds + (1 if r < n % rounds else 0) for r in range(rounds)]
        for r in range(rounds):
            order = ["quiet", "noisy"] if r % 2 == 0 else ["noisy", "quiet"]
            for kind in order:
                if R.STOP.is_set():
                    break
                print(
                    f"  [noisy {runtime}] round {r + 1}/{rounds}: {kind} block of {per[r]} ...",
                    flush=True,
                )
                if kind == "quiet":
                    R.run_block(
                        quiet,
                        a_call,
                        per[r],
                        1,
                        deadline_s / rounds / 2,
                        max(5, n // 10),
                    )
                    continue
                noise_on.set()
                threads = [R.spawn(lambda k=k: noise_loop(k)) for k in NOISE]
                time.sleep(1.5)  # let the bombs get going
                R.run_block(
                    noisy, a_call, per[r], 1, deadline_s / rounds / 2, max(5, n // 10)
                )
                noise_on.clear()
                R.join_all(threads)
                time.sleep(1.0)  # B's leftovers die down before the next quiet block
        # B must still be usable after the bombs.
        try:
            ok = (
                ctx.api.exec(b, ["echo", "alive"], timeout_s=30).get("stdout")
                == "alive\n"
            )
        except Exception as e:  # noqa: BLE001
            ok = f"{type(e).__name__}: {e}"[:200]
    finally:
        noise_on.clear()
        for sid in (a, b):
            try:
                ctx.api.delete(sid)
            except Exception as e:  # noqa: BLE001 - the final delete_all retries it
                print(f"bench: delete {sid}: {e}", file=sys.stderr)
    return {
        "runtime": runtime,
        "quiet": quiet,
        "noisy": noisy,
        "noise": noise_log,
        "b_alive_after": ok,
    }


# ----------------------------------------------------------------------------- report


def one_line(cmd: list[str]) -> str:
    """`cmd` as a shell line with newlines shown as \\n (inline Markdown code)."""
    return shlex.join(cmd).replace("\n", "\\n")


def fm(v: float | None) -> str:
    return R.fmt_ms(v)


def render(meta: dict, res: dict, notes: list[str]) -> str:
    L: list[str] = []
    m = meta["machine"]
    L.append(f"## {meta['date']} — Container backend ({meta['mode']})")
    L.append("")
    L.append(f"- Command: `{meta['command']}`")
    L.append(
        f"- Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel {m['kernel']}, cgroup {m['cgroup']}, "
        f"load average at start {m['loadavg']}; no VM involved (KVM/TCG irrelevant here)"
    )
    L.append(f"- Tree: commit {m['commit']}; server: {meta['server']}")
    if meta.get("pool_server"):
        L.append(f"- C1 pooled row: second server {meta['pool_server']} (container warm pool on, default size)")
    L.append(f"- Runtimes: {meta['runtimes']}; image `{meta['image']}`")
    L.append(
        f"- Method: subjects interleaved in {meta['rounds']} rounds (rotated order), warm-up calls discarded; latency = "
        "client-side wall time per call; sandboxes created with default limits (cpu 1, 512 MiB, pids 256) unless stated."
    )
    for n in notes:
        L.append(f"- {n}")
    L.append("")
    cr = res.get("create")
    if cr:
        s = cr["samples"]
        L.append("### C1. Container create → first exec result (`true`), concurrency 1")
        L.append("")
        L.append(
            "Timed window = `POST /v1/sandboxes` + `POST …/exec` (the delete follows, untimed). Baseline = "
            + "; ".join(f"`{c}`" for c in cr["bare_cmd"].values())
            + " to its exit, with the config.json of a live container of this run (args `/bin/true`) and an overlay "
            "of the same image layers as rootfs (it includes the runtime's own delete; the API figure does not)."
            " `runc create+exec` is the cold path: a server with `--container-warm-pool 0`, so every create runs "
            "`runc run`. `runc pooled create+exec` is a second server with the container warm pool on at its "
            f"default size ({CONTAINER_POOL_SIZE}): before each timed create the harness waits, untimed, until the "
            "pool is full again (polling DATA/container-pool), so every create is a hand-over of an already-started "
            "container; its delete is untimed too."
        )
        L.append("")
        L.append(
            "| subject | ok | errors | p50 ms | p99 ms | p50 / bare same runtime | p99 / bare | create p50 ms | exec p50 ms | delete p50 ms (untimed) |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, smp in s.items():
            rt = name.split()[0] if not name.startswith("bare") else name.split()[1]
            bare = s.get(f"bare {rt} run")
            key = name.rsplit(" ", 1)[0]
            ph = cr["phases"].get(key, {}) if not name.startswith("bare") else {}
            ex = (
                f"{fm(ph['create'][0])} | {fm(ph['exec'][0])} | {fm(ph['delete'][0])}"
                if ph
                else "— | — | —"
            )
            L.append(
                f"| {name} | {smp.ok} | {smp.errors} | {fm(smp.p(50))} | {fm(smp.p(99))} | "
                f"{R.fmt_ratio(R.ratio(smp.p(50), bare.p(50) if bare else None))} | "
                f"{R.fmt_ratio(R.ratio(smp.p(99), bare.p(99) if bare else None))} | {ex} |"
            )
        L.append("")
        for rt in meta["runtimes"]:
            api_s, bare = s.get(f"{rt} create+exec"), s.get(f"bare {rt} run")
            if not api_s or not bare:
                continue
            r = R.ratio(api_s.p(50), bare.p(50))
            L.append(
                f"- {rt}: create→first exec p50 {fm(api_s.p(50))} ms vs bare `{rt} run` {fm(bare.p(50))} ms = "
                f"{R.fmt_ratio(r)} (target ≤ {TARGET_CREATE_VS_BARE}×"
                + (
                    " of bare runc"
                    if rt == "runc"
                    else " — the issue's target names runc; applied to runsc vs bare runsc for reference"
                )
                + f": {R.verdict(None if r is None else r <= TARGET_CREATE_VS_BARE)})"
            )
        pooled_s, bare = s.get("runc pooled create+exec"), s.get("bare runc run")
        if pooled_s and bare:
            r = R.ratio(pooled_s.p(50), bare.p(50))
            sv = cr.get("pool_served") or {}
            L.append(
                f"- runc, warm pool on: create→first exec p50 {fm(pooled_s.p(50))} ms vs bare `runc run` "
                f"{fm(bare.p(50))} ms = {R.fmt_ratio(r)} (target ≤ {TARGET_CREATE_VS_BARE}× of bare runc: "
                f"{R.verdict(None if r is None else r <= TARGET_CREATE_VS_BARE)}); creates served by the pool: "
                f"{sv.get('pool', 0)}, cold: {sv.get('cold', 0)} (warm-up included). The cold row above is the "
                "path of every create the pool cannot serve (runsc, network allow policies, other disk sizes, forks, "
                "an empty pool)."
            )
        if (
            "runsc" in meta["runtimes"]
            and s.get("runsc create+exec")
            and s.get("bare runc run")
        ):
            L.append(
                f"- runsc create→first exec vs bare runc run: "
                f"{R.fmt_ratio(R.ratio(s['runsc create+exec'].p(50), s['bare runc run'].p(50)))} (no target)"
            )
        L.extend(R.error_lines({1: s}))
        L.append("")
    ra = res.get("rate")
    if ra:
        s = ra["samples"]
        L.append("### C2. Creates per second at concurrency 8 (create + delete loop)")
        L.append("")
        L.append(
            "Latency = the create call; rate = completed create+delete cycles / wall time (bare: `runc run` to exit)."
        )
        L.append("")
        L.append(
            "| subject | ok | errors | create p50 ms | create p99 ms | cycles/s | rate / bare runc run |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        bare = s.get("bare runc run")
        for name, smp in s.items():
            L.append(
                f"| {name} | {smp.ok} | {smp.errors} | {fm(smp.p(50))} | {fm(smp.p(99))} | {R.fmt_rate(smp.rate)} | "
                f"{R.fmt_ratio(R.ratio(smp.rate, bare.rate if bare else None))} |"
            )
        L.extend(R.error_lines({8: s}))
        L.append("")
    ex = res.get("exec")
    if ex:
        s = ex["samples"]
        L.append("### C3. Exec round trip (`true` in a live sandbox), concurrency 1")
        L.append("")
        L.append(
            "| subject | ok | errors | p50 ms | p99 ms | server duration_ms p50 / p99 | target p50 ≤ 3 ms |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---|")
        for name, smp in s.items():
            sv = ex["server_ms"].get(name)
            tgt = (
                "—"
                if "function" in name
                else R.verdict(
                    None if smp.p(50) is None else smp.p(50) <= TARGET_EXEC_P50_MS
                )
            )
            L.append(
                f"| {name} | {smp.ok} | {smp.errors} | {fm(smp.p(50))} | {fm(smp.p(99))} | "
                f"{'—' if not sv else f'{fm(sv[0])} / {fm(sv[1])}'} | {tgt} |"
            )
        L.extend(R.error_lines({1: s}))
        L.append("")
    for idle in res.get("idle", []):
        rt = idle["runtime"]
        L.append(
            f"### C4. {idle.get('created', 0)} concurrent idle `{rt}` containers (requested {idle['requested']}), image `{idle['image']}`"
        )
        L.append("")
        if idle.get("created"):
            per = idle["per_sandbox_host_mib"]
            cg = idle.get("per_sandbox_cgroup_mib")
            L.append("| measure | value |")
            L.append("|---|---:|")
            L.append(
                f"| created / requested (create wall s) | {idle['created']} / {idle['requested']} ({idle['create_wall_s']:.1f} s) |"
            )
            L.append(
                f"| probe execs failed (every ~10th container) | {idle['probe_execs_failed']} |"
            )
            L.append(
                f"| host used before / with all alive (MemTotal−MemAvailable, MiB) | {idle['host_before_mib']:.0f} / {idle['host_after_mib']:.0f} |"
            )
            L.append(f"| **host memory per container (MiB)** | **{per:.2f}** |")
            L.append(
                f"| sum of the containers' cgroup memory charge (MiB; {idle['cgroups_found']} cgroups) / per container | "
                f"{idle['cgroup_sum_mib']:.0f} / {'—' if cg is None else f'{cg:.2f}'} |"
            )
            srv = idle.get("server_rss_delta_mib")
            srv_per = "—" if srv is None else f"{srv / idle['created']:.3f}"
            L.append(f"| server RSS growth per container (MiB) | {srv_per} |")
            L.append(
                f"| host processes in their cgroups (per container) | {idle['procs_alive']} ({idle['procs_alive'] / idle['created']:.1f}) |"
            )
            L.append(
                f"| DATA/containers entries / host mounts naming the data dir, while alive | {idle['dirs_alive']} / {idle['mounts_alive']} |"
            )
            L.append(
                "| /proc/meminfo growth per container (KiB) | "
                + ", ".join(
                    f"{k} {v:.0f}" for k, v in idle["parts_per_sandbox_kib"].items()
                )
                + " |"
            )
            L.append(
                f"| delete wall s / failed deletes | {idle['delete_wall_s']:.1f} / {idle['delete_failed']} |"
            )
            left = idle["left"]
            L.append(
                "| left after delete: "
                + " / ".join(left)
                + " | "
                + " / ".join(str(v) for v in left.values())
                + f" → {'all gone' if idle['all_gone'] else 'LEFTOVERS'} |"
            )
            L.append(
                f"| host used after delete (MiB) | {idle['host_after_delete_mib']:.0f} |"
            )
            L.append("")
            if rt == "runc":
                L.append(
                    f"- runc: {per:.2f} MiB host memory per idle container (target ≤ {TARGET_IDLE_RUNC_MIB} MiB: "
                    f"{R.verdict(per <= TARGET_IDLE_RUNC_MIB) if per > 0 else 'n/a (not positive: noise exceeded the signal)'})"
                )
            else:
                L.append(
                    f"- {rt}: {per:.2f} MiB host memory per idle container (no target)"
                )
        if idle.get("errors"):
            L.append(
                f"- errors ({len(idle['errors'])}): {'; '.join(idle['errors'][:3])}"
            )
        L.append("")
    for nz in res.get("noisy", []):
        q, z = nz["quiet"], nz["noisy"]
        rt = nz["runtime"]
        L.append(
            f"### C5. Noisy neighbour ({rt}): A's `true` exec latency, quiet vs while B runs bombs"
        )
        L.append("")
        L.append(
            "B = a container of the same runtime with memory_mib 256, pids_max 64 (cpu 1). During A's noisy blocks B runs, "
            "at the same time, three exec loops: "
            + "; ".join(
                f"{k} `{one_line(c)}` (timeout {t:.0f} s)"
                for k, (c, t) in NOISE.items()
            )
            + ". Quiet and noisy blocks alternate (quiet first on even rounds)."
        )
        L.append("")
        L.append("| A's exec | ok | errors | p50 ms | p99 ms | max ms |")
        L.append("|---|---:|---:|---:|---:|---:|")
        for smp in (q, z):
            mx = max(smp.latencies) * 1000 if smp.latencies else None
            L.append(
                f"| {smp.name} | {smp.ok} | {smp.errors} | {fm(smp.p(50))} | {fm(smp.p(99))} | {fm(mx)} |"
            )
        L.append("")
        r99 = R.ratio(z.p(99), q.p(99))
        ran = sum(st["execs"] for st in nz["noise"].values())
        v = R.verdict(None if r99 is None else r99 <= TARGET_NOISY_P99_RATIO)
        if not ran:
            v = "n/a: none of B's noise execs completed (see below), so A was not measured under load"
        L.append(
            f"- p99 noisy / quiet = {R.fmt_ratio(r99)} (target ≤ {TARGET_NOISY_P99_RATIO}×: {v}); p50 noisy / quiet = "
            f"{R.fmt_ratio(R.ratio(z.p(50), q.p(50)))}"
        )
        parts = []
        for k, st in nz["noise"].items():
            parts.append(
                f"{k}: {st['execs']} execs, {st['oom_killed']} OOM-flagged, {st['timed_out']} timed out, exit codes {st['exit_codes']}"
                + (
                    f", {st['errors']} errors ({'; '.join(st['err_msgs'])})"
                    if st["errors"]
                    else ""
                )
            )
        L.append("- B's noise: " + "; ".join(parts))
        L.append(f"- B usable after the bombs (`echo alive`): {nz['b_alive_after']}")
        L.extend(R.error_lines({1: {q.name: q, z.name: z}}))
        L.append("")
    kinds = res.get("server_log_kinds")
    if kinds:
        L.append("### Server log: WARN/ERROR lines by kind")
        L.append("")
        L.append("| count | first line of the kind |")
        L.append("|---:|---|")
        for c, ex in kinds:
            L.append(f"| {c} | `{ex.replace('|', '/').replace('`', '')}` |")
        L.append("")
    return "\n".join(L).rstrip() + "\n"


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="small counts (smoke run; noisy figures)"
    )
    ap.add_argument(
        "--write",
        metavar="PATH",
        help="insert/replace this run's section in PATH (BENCHMARKS.md)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write raw figures as JSON")
    ap.add_argument(
        "--binary",
        default=str(R.REPO / "target/release/sandlot"),
        help="sandlot binary",
    )
    ap.add_argument(
        "--agent-bin",
        default=os.environ.get("SANDLOT_AGENT_BIN"),
        help="static guest agent for containers (SANDLOT_AGENT_BIN of the server; default: the server's own choice)",
    )
    ap.add_argument(
        "--guest-bin",
        default=os.environ.get("SANDLOT_GUEST_BIN"),
        help="SANDLOT_GUEST_BIN of the server",
    )
    ap.add_argument(
        "--images-dir",
        default=os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"),
    )
    ap.add_argument("--image", default="python")
    ap.add_argument(
        "--runtimes", default="runc,runsc", help="comma list (default runc,runsc)"
    )
    ap.add_argument(
        "-n",
        "--calls",
        type=int,
        help="calls per subject in C1/C3 (default 60, quick 10)",
    )
    ap.add_argument(
        "--rate-calls", type=int, help="cycles per subject in C2 (default 80, quick 16)"
    )
    ap.add_argument(
        "--idle-runc",
        type=int,
        help="idle runc containers in C4 (default 1000, quick 20)",
    )
    ap.add_argument(
        "--idle-runsc",
        type=int,
        help="idle runsc containers in C4 (default 100, quick 5)",
    )
    ap.add_argument(
        "--noisy-calls",
        type=int,
        help="A's execs per state in C5, runc (default 300, quick 20); runsc a third",
    )
    ap.add_argument(
        "--noisy-runtimes", default=None, help="runtimes of C5 (default: --runtimes)"
    )
    ap.add_argument(
        "--rounds", type=int, help="interleaving rounds (default 4, quick 2)"
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of sections to skip: " + ",".join(SECTIONS),
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=600.0,
        help="seconds per section (default 600)",
    )
    args = ap.parse_args(argv)

    if R.httpx is None:
        print("bench: python3 -m pip install httpx", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print(
            "bench: run as root (bare runtime baselines, mounts and cgroup reads need it)",
            file=sys.stderr,
        )
        return 2
    runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    missing = [r for r in runtimes if not runtime_bin(r)]
    if missing:
        print(f"bench: runtime(s) {missing} not installed", file=sys.stderr)
        return 2
    q = args.quick
    n = args.calls or (10 if q else 60)
    rate_n = args.rate_calls or (16 if q else 80)
    idle = {
        "runc": args.idle_runc or (20 if q else 1000),
        "runsc": args.idle_runsc or (5 if q else 100),
    }
    noisy_n = args.noisy_calls or (20 if q else 300)
    rounds = args.rounds or (2 if q else 4)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SECTIONS):
        ap.error(f"--skip: unknown sections {sorted(skip - set(SECTIONS))}; known: {','.join(SECTIONS)}")
    noisy_rts = [
        r.strip()
        for r in (args.noisy_runtimes or args.runtimes).split(",")
        if r.strip()
    ]

    def on_term(signum, frame):
        R.STOP.set()
        raise KeyboardInterrupt

    old_handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    run_id = f"{int(time.time())}-{os.getpid()}"
    now = _dt.datetime.now(_dt.UTC)
    mode = "quick" if q else "full"
    if skip:
        # A partial run gets a section of its own (never replaces the day's full run).
        mode += ", only " + ",".join(x for x in SECTIONS if x not in skip)
    meta = {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "mode": mode,
        "command": "python3 "
        + shlex.join(
            [
                os.path.relpath(sys.argv[0], R.REPO)
                if Path(sys.argv[0]).exists()
                else sys.argv[0],
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "machine": R.machine(),
        "rounds": rounds,
        "runtimes": runtimes,
        "image": args.image,
    }
    env = {}
    if args.agent_bin:
        env["SANDLOT_AGENT_BIN"] = args.agent_bin
    if args.guest_bin:
        env["SANDLOT_GUEST_BIN"] = args.guest_bin
    server = R.Server(
        Path(args.binary),
        Path(args.images_dir),
        ["--warm-pool", "0", "--container-warm-pool", "0"],
        ready_timeout_s=60,
        tmp_parent="/var/tmp",
        env=env,
    )
    # C1's pooled runc row: a second server with the container warm pool on.
    pool_server: R.Server | None = None
    pool_api: R.Api | None = None
    envs = " ".join(f"{k}={v}" for k, v in env.items())
    notes: list[str] = []
    res: dict = {}
    api: R.Api | None = None
    bares: dict[str, BareRuntime] = {}
    live: dict[str, str] = {}
    rcode = 0
    try:
        print(
            f"bench: starting {server.binary} up on {server.url} (log {server.log_path}) ...",
            flush=True,
        )
        server.start()
        built = _dt.datetime.fromtimestamp(
            server.binary.stat().st_mtime, _dt.UTC
        ).strftime("%Y-%m-%d %H:%M UTC")
        meta["server"] = (
            f"`{envs + ' ' if envs else ''}{shlex.join(server.cmd)}` (binary built {built}; warm pools off)"
        )
        api = R.Api(server.url, run_id)
        api.prewarm(9)
        health = api.request("GET", "/healthz").json()
        ctr = (health.get("backends") or {}).get("container", "absent")
        if ctr != "ok":
            raise Unavailable(f"container backend {ctr}")
        ctx = Ctx(api, server, args.image, run_id)
        # Live sandboxes: exec subjects (C3) and templates of the bare bundles (C1, C2).
        for rt in runtimes:
            live[rt] = ctx.create(rt)
            ctx.exec_true(live[rt])
        live["function"] = ctx.create(None)
        ctx.exec_true(live["function"])
        if not {"create", "rate"} <= skip:
            for rt in runtimes:
                d = ctx.containers_dir / live[rt]
                template = json.loads((d / "config.json").read_text())
                lower = overlay_lowerdir(d / "rootfs")
                if lower is None:
                    raise SystemExit(f"bench: no overlay mounted at {d / 'rootfs'}")
                bares[rt] = BareRuntime(
                    rt, runtime_bin(rt), template, lower, server.tmp, run_id
                )
                bares[rt].call()  # the bundle works
        if "create" not in skip:
            pctx = None
            if "runc" in runtimes:
                pool_server = R.Server(
                    Path(args.binary),
                    Path(args.images_dir),
                    [
                        "--warm-pool",
                        "0",
                        "--container-warm-pool",
                        str(CONTAINER_POOL_SIZE),
                        "--warm-pool-images",
                        args.image,
                    ],
                    ready_timeout_s=60,
                    tmp_parent="/var/tmp",
                    env=env,
                )
                pool_server.start()
                pool_api = R.Api(pool_server.url, run_id)
                pool_api.prewarm(2)
                pctx = Ctx(pool_api, pool_server, args.image, run_id)
                wait_pool_full(pctx, timeout_s=120)
                meta["pool_server"] = f"`{shlex.join(pool_server.cmd)}`"
            try:
                res["create"] = section_create(
                    ctx, runtimes, bares, n, rounds, args.deadline, pctx
                )
            finally:
                if pool_api is not None:
                    left = pool_api.delete_all()
                    if left:
                        notes.append(f"Pool server: could not delete {left[:5]}")
                    pool_api.close()
                    pool_api = None
                if pool_server is not None:
                    # A stopped server destroys its pooled containers.
                    pool_server.stop()
                    left_mounts = mounts_naming(pool_server.tmp)
                    if left_mounts:
                        notes.append(
                            f"LEFTOVER host mounts of the pool server: {left_mounts[:5]}"
                        )
                        rcode = rcode or 1
                    else:
                        pool_server.cleanup_dir()
                        R.remove_empty_cgroup_parent(
                            R.cgroup_parent_name(pool_server.tmp / "data") + "-ctr"
                        )
                    pool_server = None
        if "rate" not in skip:
            res["rate"] = section_rate(
                ctx, runtimes, bares, rate_n, rounds, args.deadline
            )
        if "exec" not in skip:
            res["exec"] = section_exec(
                ctx,
                {f"{rt} container": live[rt] for rt in runtimes}
                | {"function sandbox": live["function"]},
                n * 2,
                rounds,
                args.deadline,
            )
        for sid in list(live.values()):
            api.delete(sid)
        live.clear()
        if "noisy" not in skip:
            res["noisy"] = []
            for rt in noisy_rts:
                nn = noisy_n if rt == "runc" else max(10, noisy_n // 3)
                res["noisy"].append(section_noisy(ctx, rt, nn, rounds, args.deadline))
        if "idle" not in skip:
            res["idle"] = []
            for rt in runtimes:
                res["idle"].append(section_idle(ctx, rt, idle[rt], 8, args.deadline))
                if R.STOP.is_set():
                    break
    except Unavailable as e:
        print(f"bench: {e}", file=sys.stderr)
        notes.append(f"Not measured: {e}")
        rcode = 3
    except KeyboardInterrupt:
        R.STOP.set()
        print("\nbench: interrupted; cleaning up", file=sys.stderr)
        notes.append("Interrupted: partial figures.")
        rcode = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        interrupted = R.STOP.is_set()
        R.STOP.set()
        R.join_workers(deadline_s=(api.timeout_s + 5) if api else 5)
        if not interrupted:
            R.STOP.clear()
        for b in bares.values():
            for p in b.close():
                print(f"bench: WARNING: {p}", file=sys.stderr)
                notes.append(f"Cleanup problem: {p}")
        if api is not None:
            left = api.delete_all()
            if left:
                print(
                    f"bench: WARNING: could not delete {len(left)} sandboxes: {left[:5]}",
                    file=sys.stderr,
                )
                notes.append(
                    f"Could not delete {len(left)} sandboxes at the end: {left[:5]}"
                )
                rcode = rcode or 1
            api.close()
        meta.setdefault("server", "(not started)")
        if pool_api is not None:
            pool_api.delete_all()
            pool_api.close()
        if pool_server is not None:
            pool_server.stop()
        server.stop()
        try:
            log_text = server.log_path.read_text(errors="replace")
            kept = Path(f"/var/tmp/sandlot-bench-containers-{run_id}.log")
            kept.write_text(log_text)
            notes.append(f"Server log kept at `{kept}` (this machine).")
        except OSError:
            log_text = ""
        kinds = server_log_problems(log_text)
        if kinds:
            res["server_log_kinds"] = kinds
        else:
            notes.append("Server log: no WARN/ERROR lines.")
        leftover_mounts = mounts_naming(server.tmp)
        if leftover_mounts:
            notes.append(
                f"LEFTOVER host mounts under the data dir after the server stopped: {leftover_mounts[:5]}"
            )
            print(
                f"bench: WARNING: mounts left under {server.tmp}: {leftover_mounts[:5]}; data dir kept",
                file=sys.stderr,
            )
            rcode = rcode or 1
        else:
            if rcode:
                print(f"bench: server log tail:\n{server.tail()}", file=sys.stderr)
            server.cleanup_dir()
            R.remove_empty_cgroup_parent(
                R.cgroup_parent_name(server.tmp / "data") + "-ctr"
            )
    signal.signal(signal.SIGINT, old_handlers[0])
    signal.signal(signal.SIGTERM, old_handlers[1])
    notes.append(
        "Load average at end: "
        + R.loadavg()
        + " (2 cores shared with other builds: figures above ~2 mean contention)."
    )
    report = render(meta, res, notes)
    print()
    print(report)
    if args.json:

        def js(v):
            if isinstance(v, R.Sample):
                return v.to_json()
            if isinstance(v, dict):
                return {str(k): js(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [js(x) for x in v]
            return v

        Path(args.json).write_text(
            json.dumps(
                {"meta": meta, "results": js(res), "notes": notes},
                indent=2,
                default=str,
            )
        )
    if args.write:
        if rcode in (3, 130):
            print("bench: interrupted or unmeasured run not written", file=sys.stderr)
        else:
            p = Path(args.write)
            old = p.read_text() if p.exists() else ""
            key = f"{now.strftime('%Y-%m-%d')} containers {mode}"
            p.write_text(R.upsert_section(old, key, report))
            print(f"bench: wrote section '{key}' to {p}")
    return rcode


if __name__ == "__main__":
    sys.exit(main())
