#!/usr/bin/env python3
"""Soak under hostile load (issue 25): a mixed workload plus an abusive client and faults,
then the invariants a node must keep.

Usage (root, on the host; starts its own `sandlot up` on 127.0.0.1 with a tmpfs data dir):

    .venv/bin/python bench/soak.py --duration 1800 --out bench/results/soak-30min.json

`tests/test_soak.py` runs it for ~2.5 minutes in CI.

Load (threads, each its own client, until the end):
  - `good`: a well-behaved client in its own process (not sharing the load's GIL),
    `exec ["true"]` in its own function sandbox; its latency
    alone first (`--quiet-s`, the quiet p50/p99), then under load (loaded p50/p99).
  - `churn` x2: create (function, runc container with disk_mib 256, and every third a
    sandbox bound to a trajectory), exec, upload 1 MiB, read it back, delete.
  - `flood`: execs printing 16 MiB (`max_output_bytes` 16 MiB) in one sandbox.
  - `bg`: background processes each writing ~20 MB (more than the 64 records a sandbox
    keeps: old ones are evicted).
  - `run_code`: `print(1)` through `POST /run_code`.
  - `pull`: a function sandbox from a tag never pulled before (`PullSource`: a private
    registry with busybox, re-tagged by one manifest PUT per create), `exec true`, delete.
  - abusive, from 127.0.0.2 (its own per-address connection limit): `--idle-conns` idle
    TCP connections held open (re-opened when the server closes them), and clients that
    ask for 8 MiB of exec output and never read the answer (held 5 s).
Faults: at 20% of the run the private registry is stopped for ~5 s: a create that must pull
answers 503 `unavailable` (and leaves nothing behind), the `pull` loop's calls fail meanwhile
(counted apart), and once the registry is back the same reference pulls and runs. At 40%
the data dir is filled to 64 MiB free (below the 256 MiB reserve): a create must answer 429
`resource_exhausted`; the filler is removed 10 s later.
At 60% the server is killed with SIGKILL and started again: recovery time = until
`/v1/ping` answers, and until every long-lived sandbox answers an exec.
Sampled: server RSS every second (VmRSS), sandbox states every 5 s (any `lost` sandbox is
false: all of them are alive). After: every sandbox deleted, then the node's sandbox dirs,
mounts, cgroups, processes and veths are counted (tests/conftest.py `count_leaks`) until
they are back to the count before the load (60 s at most).

Not covered: streamed uploads (uploads are buffered whole, charged to the file budget).

Output: one JSON object (stdout, and `--out`). RSS bound = 100 MiB + the exec output budget
+ the file data budget (docs/operations.md "Server memory").
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "sdk" / "python"))

import sandlot  # noqa: E402
from conftest import (IMAGES_DIR, Server, count_leaks, find_binary,  # noqa: E402
                      free_port, private_base, remove_private_base)

MiB = 1 << 20
IDLE_MIB = 100
EXEC_BUDGET_MIB = 1024
FILE_BUDGET_MIB = 1024
RSS_BOUND_MIB = IDLE_MIB + EXEC_BUDGET_MIB + FILE_BUDGET_MIB
ABUSER_ADDR = "127.0.0.2"
LEAK_KEYS = ("sandbox_dirs", "mounts", "cgroups", "processes", "veths")


def pct(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def rss_mib(pid: int) -> Optional[float]:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


SHARED_REGISTRY = os.environ.get("SANDLOT_REGISTRY_ADDR", "127.0.0.1:5000")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json, "
                  "application/vnd.docker.distribution.manifest.v2+json")


class PullSource:
    """A private registry for the `pull` load and the registry fault: `scripts/registry.sh`
    (Debian's docker-registry) on a free loopback port, storage under `rdir`, holding
    `sandlot/busybox:latest` copied with skopeo from the shared test registry
    (`scripts/registry.sh push`). `tag()` gives the image a new tag (one
    manifest PUT, Distribution spec "Pushing manifests"), so a create from it must pull
    (manifest and config; the layer is in the image store already).

    Raises `RuntimeError` when the registry cannot be started or the image copied."""

    def __init__(self, rdir: Path) -> None:
        self.rdir, self.addr = rdir, f"127.0.0.1:{free_port()}"
        self.refs: List[str] = []  # every reference tagged (a create may have pulled it)
        self.sh("start")
        try:
            src = f"docker://{SHARED_REGISTRY}/sandlot/busybox:latest"
            r = subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                                "--dest-tls-verify=false", src,
                                f"docker://{self.addr}/sandlot/busybox:latest"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"skopeo copy {src}: {r.stderr.strip()[-300:]} "
                                   "(scripts/registry.sh start && scripts/registry.sh push)")
            url = f"http://{self.addr}/v2/sandlot/busybox/manifests/latest"
            req = urllib.request.Request(url, headers={"Accept": MANIFEST_TYPES})
            with urllib.request.urlopen(req, timeout=10) as resp:
                self.manifest, self.media_type = resp.read(), resp.headers["Content-Type"]
        except BaseException:
            try:
                self.sh("stop")
            except RuntimeError:
                pass
            raise

    def sh(self, cmd: str) -> None:
        env = dict(os.environ, SANDLOT_REGISTRY_ADDR=self.addr,
                   SANDLOT_REGISTRY_DIR=str(self.rdir))
        r = subprocess.run(["bash", str(REPO / "scripts" / "registry.sh"), cmd], env=env,
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"registry.sh {cmd}: {(r.stdout + r.stderr).strip()[-300:]}")

    def tag(self, tag: str) -> str:
        """Tags the image `tag` and returns its reference, also kept in `refs` (`OSError`
        while stopped)."""
        req = urllib.request.Request(
            f"http://{self.addr}/v2/sandlot/busybox/manifests/{tag}", data=self.manifest,
            method="PUT", headers={"Content-Type": self.media_type})
        urllib.request.urlopen(req, timeout=10).close()
        ref = f"{self.addr}/sandlot/busybox:{tag}"
        self.refs.append(ref)  # list.append is atomic: the pull loop and a fault tag
        return ref


class Soak:
    def __init__(self, binary: Path, duration_s: float, quiet_s: float, idle_conns: int,
                 backends: List[str], log_path: Path, tmpfs_mib: int) -> None:
        self.binary, self.duration_s, self.quiet_s = binary, duration_s, quiet_s
        self.idle_conns, self.backends, self.tmpfs_mib = idle_conns, backends, tmpfs_mib
        self.base = private_base("sandlot-soak-")
        self.data = self.base / "data"
        self.data.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_mib}m,mode=0711",
                            "tmpfs", str(self.data)], capture_output=True, text=True)
        if r.returncode != 0:
            remove_private_base(self.base)
            raise RuntimeError(f"cannot mount a tmpfs data dir: {r.stderr.strip()}")
        self.srv = Server(binary, self.data, log_path,
                          args=["--warm-pool", "1", "--container-warm-pool", "1",
                                "--exec-output-budget-mib", str(EXEC_BUDGET_MIB)])
        self.stop = threading.Event()
        # Set while the server is being killed/restarted; read by the good client's process.
        self.down = mp.get_context("spawn").Event()
        self.good_stop = mp.get_context("spawn").Event()
        self.lock = threading.Lock()
        self.ops: Counter = Counter()
        self.errors: Counter = Counter()
        self.good: List[tuple] = []  # (t, seconds, phase)
        self.rss: List[tuple] = []  # (t, MiB)
        self.lost: Dict[str, str] = {}
        self.faults: Dict[str, Any] = {}
        self.t0 = time.monotonic()
        self.long_lived: List[str] = []
        self.pulls: Optional[PullSource] = None
        self.registry_down = threading.Event()

    # -- helpers -------------------------------------------------------------------------
    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def client(self) -> sandlot.Client:
        return sandlot.Client(self.srv.url, timeout=120, retries=2)

    def count(self, what: str, err: Optional[BaseException] = None) -> None:
        with self.lock:
            if err is None:
                self.ops[what] += 1
            else:
                code = getattr(err, "code", type(err).__name__)
                key = f"{what}:{code}" + (":during_restart" if self.down.is_set() else "")
                if what == "pull" and self.registry_down.is_set():
                    key += ":registry_down"
                self.errors[key] += 1

    def loop(self, name: str, body: Callable[[sandlot.Client], None], pause: float = 0.0
             ) -> threading.Thread:
        def run() -> None:
            c = self.client()
            try:
                while not self.stop.is_set():
                    try:
                        body(c)
                        self.count(name)
                    except Exception as e:  # noqa: BLE001 -- counted, the soak goes on
                        self.count(name, e)
                        self.stop.wait(0.5)
                    if pause:
                        self.stop.wait(pause)
            finally:
                c.close()
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    # -- workers -------------------------------------------------------------------------
    def good_client(self, box_id: str) -> threading.Thread:
        """Starts the well-behaved client in its own process (`_good_loop`: a thread here
        measured this process's GIL, held by the load's threads decoding 16 MiB answers,
        as much as the server) and returns the thread that gathers its calls."""
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_good_loop, name="good", daemon=True,
                           args=(self.srv.url, box_id, self.t0 + self.quiet_s,
                                 self.good_stop, self.down, out))
        proc.start()

        def gather() -> None:
            while True:
                try:
                    item = out.get(timeout=1.0)
                except queue.Empty:
                    if proc.is_alive():
                        continue
                    # Died without its last item (killed, crashed): counted, not waited for.
                    with self.lock:
                        self.errors[f"good:process_exit_{proc.exitcode}"] += 1
                    break
                if item is None:
                    break
                kind, t, value, phase = item
                if kind == "ok":
                    with self.lock:
                        self.good.append((round(t - self.t0, 2), value, phase))
                        self.ops["good"] += 1
                else:
                    with self.lock:
                        self.errors[value] += 1
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

        t = threading.Thread(target=gather, name="good", daemon=True)
        t.start()
        return t

    def churn_body(self, i: int) -> Callable[[sandlot.Client], None]:
        n = [0]

        def body(c: sandlot.Client) -> None:
            n[0] += 1
            backend = self.backends[(n[0] + i) % len(self.backends)]
            kw: Dict[str, Any] = {"ttl_s": 600, "labels": {"soak": "churn"}}
            if backend == "container":
                kw.update(backend="container", runtime="runc", disk_mib=256)
            else:
                kw.update(backend=backend)
            if n[0] % 3 == 0:
                kw["trajectory"] = f"soak-{uuid.uuid4().hex[:12]}"
            box = c.create(**kw)
            try:
                r = box.exec(["sh", "-c", "echo hi"], timeout_s=30)
                assert r.stdout == b"hi\n", r
                blob = os.urandom(MiB)
                box.write_file("/tmp/blob", blob)
                assert box.read_file("/tmp/blob") == blob
            finally:
                box.delete()
        return body

    def flood_body(self, box_id: str) -> Callable[[sandlot.Client], None]:
        def body(c: sandlot.Client) -> None:
            r = c.get(box_id).exec(["head", "-c", str(16 * MiB), "/dev/zero"],
                                   timeout_s=60, max_output_bytes=16 * MiB)
            assert len(r.stdout) == 16 * MiB, len(r.stdout)
        return body

    def bg_body(self, box_id: str) -> Callable[[sandlot.Client], None]:
        def body(c: sandlot.Client) -> None:
            c.get(box_id).spawn(["sh", "-c", "head -c 20000000 /dev/urandom | od -An | head -c 20000000"],
                                timeout_s=120, max_output_bytes=16 * MiB)
        return body

    def pull_body(self, c: sandlot.Client) -> None:
        assert self.pulls is not None
        ref = self.pulls.tag(f"soak-{uuid.uuid4().hex[:12]}")
        with c.create(backend="function", image=ref, ttl_s=120,
                      labels={"soak": "pull"}) as box:
            assert box.exec(["true"], timeout_s=30).exit_code == 0

    def run_code_body(self, c: sandlot.Client) -> None:
        r = c.run_code("print(1)")
        if r.status == "SandboxError" and "resource_exhausted" in (r.message or ""):
            raise sandlot.SandlotError("run_code: " + r.message)
        assert r.status == "Success", r

    def abuser_idle(self) -> threading.Thread:
        def run() -> None:
            conns: List[socket.socket] = []
            while not self.stop.is_set():
                conns = [s for s in conns if _alive(s)]
                while len(conns) < self.idle_conns and not self.stop.is_set():
                    try:
                        s = socket.socket()
                        s.bind((ABUSER_ADDR, 0))
                        s.settimeout(2)
                        s.connect(("127.0.0.1", self.srv.port))
                        s.setblocking(False)
                        conns.append(s)
                    except OSError:
                        s.close()
                        self.count("idle_conn", OSError("connect"))
                        break
                with self.lock:
                    self.ops["idle_conns_open_max"] = max(self.ops["idle_conns_open_max"],
                                                          len(conns))
                self.stop.wait(1.0)
            for s in conns:
                s.close()
        t = threading.Thread(target=run, name="idle", daemon=True)
        t.start()
        return t

    def abuser_never_reads(self, box_id: str) -> threading.Thread:
        body = json.dumps({"cmd": ["head", "-c", str(8 * MiB), "/dev/zero"],
                           "max_output_bytes": 8 * MiB}).encode()

        def run() -> None:
            while not self.stop.is_set():
                socks = []
                for _ in range(4):
                    try:
                        s = socket.socket()
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                        s.bind((ABUSER_ADDR, 0))
                        s.settimeout(2)
                        s.connect(("127.0.0.1", self.srv.port))
                        s.sendall(b"POST /v1/sandboxes/%s/exec HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                  % (box_id.encode(), len(body)) + body)
                        socks.append(s)
                        self.count("never_reads")
                    except OSError as e:
                        s.close()
                        self.count("never_reads", e)
                self.stop.wait(5.0)
                for s in socks:
                    s.close()
        t = threading.Thread(target=run, name="never_reads", daemon=True)
        t.start()
        return t

    def sampler(self) -> threading.Thread:
        def run() -> None:
            last_states = 0.0
            c = sandlot.Client(self.srv.url, timeout=10, retries=0)
            while not self.stop.is_set():
                proc = self.srv.proc
                if proc is not None and proc.poll() is None:
                    m = rss_mib(proc.pid)
                    if m is not None:
                        with self.lock:
                            self.rss.append((self.now(), round(m, 1)))
                if time.monotonic() - last_states >= 5 and not self.down.is_set():
                    last_states = time.monotonic()
                    try:
                        resp = c._http.get("/v1/sandboxes")
                        if resp.status_code == 200:
                            for b in resp.json().get("sandboxes", []):
                                if b.get("state") == "lost":
                                    with self.lock:
                                        self.lost.setdefault(b["id"], f"t={self.now()}")
                    except Exception:  # noqa: BLE001 -- a busy server: next round
                        pass
                self.stop.wait(1.0)
            c.close()
        t = threading.Thread(target=run, name="sampler", daemon=True)
        t.start()
        return t

    # -- faults --------------------------------------------------------------------------
    def disk_full(self) -> None:
        filler = self.data / "soak-filler"

        def room() -> int:
            st = os.statvfs(self.data)
            return st.f_bavail * st.f_frsize - 64 * MiB

        # Free space is measured before every MiB: the load writes beside the filler, and a
        # size computed once would leave nothing free (all calls then fail, by design, on
        # their audit events) when the filler is slow (a busy CI host).
        with open(filler, "wb") as f:
            chunk = b"\0" * MiB
            try:
                while (left := room()) > 0:
                    f.write(chunk[:min(MiB, left)])
                    f.flush()
            except OSError:
                pass
        st = os.statvfs(self.data)
        answer: Dict[str, Any] = {"free_mib": st.f_bavail * st.f_frsize // MiB}
        with self.client() as c:
            try:
                b = c.create(backend="function", ttl_s=60)
                answer["create"] = "201 (created: reserve not enforced)"
                b.delete()
            except sandlot.SandlotError as e:
                answer.update(create_status=e.status, create_code=e.code,
                              retry_after=e.retry_after)
            try:
                r = c.get(self.long_lived[0]).exec(["true"], timeout_s=30)
                answer["exec_on_full_disk"] = r.exit_code
            except sandlot.SandlotError as e:
                answer["exec_on_full_disk"] = f"{e.status} {e.code}"
        self.stop.wait(10)
        filler.unlink()
        self.faults["disk_full"] = answer

    def registry_stop(self) -> None:
        """Stops the private registry ~5 s: a create that must pull fails `unavailable`
        (how fast, what it left); then the same reference must pull once it is back."""
        if self.pulls is None:
            return
        ans: Dict[str, Any] = {}
        ref = self.pulls.tag("soak-while-down")  # tagged while up, never pulled yet
        self.registry_down.set()
        self.pulls.sh("stop")
        with self.client() as c:
            t = time.monotonic()
            try:
                c.create(backend="function", image=ref, ttl_s=60,
                         labels={"soak": "pull"}).delete()
                ans["create_while_down"] = "created (the registry was not down?)"
            except sandlot.SandlotError as e:
                ans.update(create_status=e.status, create_code=e.code)
            ans["create_while_down_s"] = round(time.monotonic() - t, 2)
            ans["left_behind"] = [b.id for b in c.list(labels={"soak": "pull"})
                                  if b.image == ref and b.state != "deleting"]
            self.stop.wait(max(0.0, 5 - (time.monotonic() - t)))
            self.pulls.sh("start")
            # Calls in flight while it was down end by now; later errors are not its.
            self.stop.wait(2.0)
            self.registry_down.clear()
            t = time.monotonic()
            while True:
                try:
                    with c.create(backend="function", image=ref, ttl_s=60,
                                  labels={"soak": "pull"}) as box:
                        ans["exec_after"] = box.exec(["true"], timeout_s=30).exit_code
                    ans["pull_after_s"] = round(time.monotonic() - t, 2)
                    break
                except sandlot.SandlotError as e:
                    if time.monotonic() - t > 60:
                        ans["pull_after"] = f"{e.status} {e.code}: {e}"
                        break
                    time.sleep(1.0)
        self.faults["registry"] = ans

    def kill9(self) -> None:
        self.down.set()
        at_s = self.now()
        t = time.monotonic()
        self.srv.kill()
        try:
            self.srv.start()
        except BaseException:
            self.down.clear()
            raise
        ping_s = time.monotonic() - t
        ok = set()
        deadline = time.monotonic() + 120
        with self.client() as c:
            while len(ok) < len(self.long_lived) and time.monotonic() < deadline:
                for sid in self.long_lived:
                    if sid in ok:
                        continue
                    try:
                        if c.get(sid).exec(["true"], timeout_s=30).exit_code == 0:
                            ok.add(sid)
                    except sandlot.SandlotError:
                        pass
                time.sleep(0.1)
        # Calls in flight at the kill (and their SDK retries) end by now; later errors
        # are not the restart's.
        self.stop.wait(2.0)
        self.down.clear()
        self.faults["kill9"] = {"at_s": at_s, "ping_s": round(ping_s, 2),
                                "all_exec_s": round(time.monotonic() - t, 2),
                                "sandboxes_back": f"{len(ok)}/{len(self.long_lived)}"}

    def forget_pulled(self) -> List[str]:
        """Stops the private registry and removes the references the load pulled from the
        shared image store (`sandlot image rm`); returns those that could not be."""
        if self.pulls is None:
            return []
        try:
            self.pulls.sh("stop")
        except RuntimeError:
            pass
        left = []
        for ref in self.pulls.refs:
            r = subprocess.run([str(self.binary), "image", "rm", ref, "--images-dir",
                                IMAGES_DIR], capture_output=True, text=True, timeout=120,
                               stdin=subprocess.DEVNULL)
            if r.returncode != 0 and "not found" not in (r.stdout + r.stderr).lower():
                left.append(f"{ref}: {(r.stdout + r.stderr).strip()[-200:]}")
        return left

    # -- the run -------------------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        self.srv.start()
        time.sleep(2)  # pools start filling; their members are not counted as leaks
        before = count_leaks(self.data)
        threads: List[threading.Thread] = []
        result: Dict[str, Any] = {}
        try:
            with self.client() as c:
                good = c.create(backend="function", ttl_s=0, labels={"soak": "good"})
                flood = c.create(backend="function", ttl_s=0, labels={"soak": "flood"})
                bg = c.create(backend="function", ttl_s=0, labels={"soak": "bg"})
                self.long_lived = [good.id, flood.id, bg.id]
            try:
                self.pulls = PullSource(self.base / "registry")
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                self.faults["registry"] = {"skipped": str(e)}
            self.t0 = time.monotonic()
            threads.append(self.sampler())
            threads.append(self.good_client(good.id))
            self.stop.wait(self.quiet_s)
            threads += [self.loop("churn0", self.churn_body(0)),
                        self.loop("churn1", self.churn_body(1)),
                        self.loop("flood", self.flood_body(flood.id), pause=0.2),
                        self.loop("bg", self.bg_body(bg.id), pause=1.0),
                        self.loop("run_code", self.run_code_body, pause=1.0),
                        self.abuser_idle(), self.abuser_never_reads(flood.id)]
            if self.pulls is not None:
                threads.append(self.loop("pull", self.pull_body, pause=1.0))
            load_s = self.duration_s - self.quiet_s
            plan = [(0.2, self.registry_stop), (0.4, self.disk_full), (0.6, self.kill9)]
            for frac, fault in plan:
                at = self.t0 + self.quiet_s + frac * load_s
                self.stop.wait(max(0.0, at - time.monotonic()))
                fault()
            self.stop.wait(max(0.0, self.t0 + self.duration_s - time.monotonic()))
        finally:
            self.stop.set()
            self.good_stop.set()
            for t in threads:
                t.join(timeout=150)
            result["threads_stuck"] = [t.name for t in threads if t.is_alive()]
            t_del = time.monotonic()
            self.srv.delete_all()
            after: Dict[str, int] = {}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                after = count_leaks(self.data)
                if all(after[k] <= before.get(k, 0) for k in after):
                    break
                time.sleep(0.5)
            result["cleanup_s"] = round(time.monotonic() - t_del, 1)
            result["leaks_before"], result["leaks_after"] = before, after
            result["leaked"] = {k: after[k] - before.get(k, 0) for k in after
                                if after[k] > before.get(k, 0)}
            try:
                self.srv.stop()
            finally:
                subprocess.run(["umount", "-l", str(self.data)], check=False)
                result["images_left"] = self.forget_pulled()
                remove_private_base(self.base)
        quiet = [s for _, s, p in self.good if p == "quiet"]
        loaded = [s for _, s, p in self.good if p == "loaded"]
        ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
        peak = max((m for _, m in self.rss), default=None)
        result.update({
            "duration_s": self.duration_s, "quiet_s": self.quiet_s,
            "backends": self.backends, "idle_conns": self.idle_conns,
            "good_exec_ms": {"quiet_n": len(quiet), "quiet_p50": ms(pct(quiet, 50)),
                             "quiet_p99": ms(pct(quiet, 99)), "loaded_n": len(loaded),
                             "loaded_p50": ms(pct(loaded, 50)),
                             "loaded_p99": ms(pct(loaded, 99))},
            "rss_mib": {"peak": peak, "bound": RSS_BOUND_MIB,
                        "first": self.rss[0][1] if self.rss else None,
                        "last": self.rss[-1][1] if self.rss else None,
                        "every_10s": [m for i, (_, m) in enumerate(self.rss) if i % 10 == 0]},
            "ops": dict(self.ops), "errors": dict(self.errors),
            "false_lost": self.lost, "faults": self.faults,
        })
        q, lp = result["good_exec_ms"]["quiet_p99"], result["good_exec_ms"]["loaded_p99"]
        result["good_exec_ms"]["p99_ratio"] = round(lp / q, 1) if q and lp else None
        return result


def _good_loop(url: str, box_id: str, quiet_until: float, stop: Any, down: Any,
               out: Any) -> None:
    """The well-behaved client (run in its own process): `exec ["true"]` in sandbox
    `box_id` every 0.1 s until `stop` is set; puts `("ok", started, seconds, phase)` or
    `("err", started, "good:<code>[:during_restart]", phase)` on `out` (monotonic clock,
    shared by processes on Linux; phase `quiet` before `quiet_until`), then `None`."""
    c = None
    try:
        c = sandlot.Client(url, timeout=120, retries=2)
        box = c.get(box_id)
        while not stop.is_set():
            t = time.monotonic()
            phase = "quiet" if t < quiet_until else "loaded"
            try:
                r = box.exec(["true"], timeout_s=30)
                assert r.exit_code == 0, r
                out.put(("ok", t, time.monotonic() - t, phase))
            except Exception as e:  # noqa: BLE001 -- counted, the soak goes on
                code = getattr(e, "code", type(e).__name__)
                during = ":during_restart" if down.is_set() else ""
                out.put(("err", t, f"good:{code}{during}", phase))
                stop.wait(0.5)
            stop.wait(0.1)
    finally:
        try:
            if c is not None:
                c.close()
        finally:
            out.put(None)


def _alive(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        s.close()
        return False


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_soak(binary: Path, duration_s: float, log_path: Path, quiet_s: float = 15,
             idle_conns: int = 2000, backends: Optional[List[str]] = None,
             tmpfs_mib: int = 2048) -> Dict[str, Any]:
    """Run the soak (see the module doc) and return its figures."""
    raise_nofile()
    s = Soak(binary, duration_s, quiet_s, idle_conns, backends or ["function", "container"],
             log_path, tmpfs_mib)
    return s.run()


def markdown(res: Dict[str, Any], cmd: str, commit: str) -> str:
    """The BENCHMARKS.md section of one soak result (between `bench:begin soak` markers)."""
    g, r, h = res["good_exec_ms"], res["rss_mib"], res.get("host", {})
    k, d = res["faults"].get("kill9", {}), res["faults"].get("disk_full", {})
    reg = res["faults"].get("registry", {})
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    lb = h.get("loadavg_before")
    la = h.get("loadavg_after")
    fmt_load = lambda v: " ".join(f"{x:.1f}" for x in v) if v else "?"  # noqa: E731
    leaked = {n: v for n, v in res["leaked"].items() if n != "veths"}
    lines = [
        "<!-- bench:begin soak -->",
        f"## {res['started_utc'][:10]} {res['started_utc'][11:16]} UTC — soak under hostile "
        f"load ({res['duration_s'] / 60:.0f} min)",
        "",
        f"Command (release build at {commit}): `{cmd}`. Machine: {h.get('cores')} cores, "
        f"{h.get('mem_total_mib')} MiB; load average before {fmt_load(lb)}, after "
        f"{fmt_load(la)} (the host was shared with other test runs). Backends: "
        f"{', '.join(res['backends'])}; {res['idle_conns']} idle connections and 4 clients "
        "that never read 8 MiB answers (every 5 s) from 127.0.0.2; the load and faults are "
        "listed in `bench/soak.py`. Full figures: the `--out` JSON.",
        "",
        "| figure | value | target | |",
        "|---|---|---|---|",
        f"| well-behaved client `true` exec p50 / p99, quiet ({g['quiet_n']} calls) | "
        f"{g['quiet_p50']} / {g['quiet_p99']} ms | | |",
        f"| same, under load ({g['loaded_n']} calls) | {g['loaded_p50']} / "
        f"{g['loaded_p99']} ms ({g['p99_ratio']}× quiet p99) | ≤ 3× quiet p99 | "
        f"{ok(g['p99_ratio'] is not None and g['p99_ratio'] <= 3)} |",
        f"| server RSS first / peak / last | {r['first']} / {r['peak']} / {r['last']} MiB | "
        f"< {r['bound']} MiB | {ok(r['peak'] is not None and r['peak'] < r['bound'])} |",
        f"| sandboxes falsely `lost` | {len(res['false_lost'])} | 0 | "
        f"{ok(not res['false_lost'])} |",
        f"| kill -9 at {k.get('at_s')} s → `/v1/ping` answers / every long-lived sandbox "
        f"execs | {k.get('ping_s')} s / {k.get('all_exec_s')} s ({k.get('sandboxes_back')}) "
        f"| | |",
        f"| data dir full ({d.get('free_mib')} MiB free) → create | {d.get('create_status')} "
        f"`{d.get('create_code')}` (Retry-After {d.get('retry_after')}); exec exit "
        f"{d.get('exec_on_full_disk')} | 429 | {ok(d.get('create_status') == 429)} |",
        f"| registry stopped → create that must pull | {reg.get('create_status')} "
        f"`{reg.get('create_code')}` in {reg.get('create_while_down_s')} s, left "
        f"{len(reg.get('left_behind', []))}; back → the same reference runs after "
        f"{reg.get('pull_after_s')} s | 503, nothing left | "
        f"{ok(reg.get('create_status') == 503 and not reg.get('left_behind'))} |"
        if "skipped" not in reg else f"| registry fault | not run: {reg['skipped']} | | |",
        f"| left after deleting everything ({res['cleanup_s']} s) | "
        f"{leaked or 'nothing'} (before {res['leaks_before']}, after {res['leaks_after']}) "
        f"| nothing | {ok(not leaked)} |",
        "",
        "Server RSS every 10 s (MiB): " + ", ".join(f"{m:.0f}" for m in r["every_10s"]),
        "",
        "Calls that succeeded: " + ", ".join(f"{n} {v}" for n, v in sorted(res["ops"].items()))
        + ". Failed: " + (", ".join(f"{n} {v}" for n, v in sorted(res["errors"].items()))
                          or "none") + ".",
        "<!-- bench:end soak -->",
    ]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace the soak section of `path` (or insert it before the first section)."""
    text = path.read_text()
    b, e = "<!-- bench:begin soak -->", "<!-- bench:end soak -->\n"
    if b in text and e in text:
        text = text[:text.index(b)] + section + text[text.index(e) + len(e):]
    else:
        i = text.index("<!-- bench:begin")
        text = text[:i] + section + "\n" + text[i:]
    path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800, help="seconds of the whole run")
    ap.add_argument("--quiet-s", type=float, default=30)
    ap.add_argument("--idle-conns", type=int, default=2000)
    ap.add_argument("--backends", default="function,container")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log", type=Path, default=Path("/tmp/sandlot-soak.log"))
    ap.add_argument("--write", type=Path, help="BENCHMARKS.md: replace its soak section")
    ap.add_argument("--render", type=Path, help="only render --write from this result JSON")
    args = ap.parse_args()
    if args.render:
        res = json.loads(args.render.read_text())
        write_section(args.write, markdown(res, res.get("command", "?"), res.get("commit", "?")))
        return 0
    binary = find_binary()
    if binary is None:
        print("no sandlot binary (SANDLOT_BIN or target/release/sandlot)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    res = run_soak(binary, args.duration, args.log, args.quiet_s, args.idle_conns,
                   args.backends.split(","))
    res["started_utc"] = started
    res["command"] = "python3 bench/soak.py " + " ".join(sys.argv[1:])
    res["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                   capture_output=True, text=True).stdout.strip()
    res["host"] = {"cores": os.cpu_count(), "loadavg_before": load_before,
                   "loadavg_after": os.getloadavg(),
                   "mem_total_mib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MiB}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.write:
        write_section(args.write, markdown(res, res["command"], res["commit"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
