"""Limits, identical on every backend: memory (OOM flagged, sandbox survives), pids (fork
bombs contained; an exec at the limit is 429, not 500), disk (ENOSPC on upload is 429 naming
the path) and the server's read budget for the files API. What untrusted code does to its own
sandbox comes back as the program's verdict or a clear 4xx/429, never as a 500."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import sandlot
from conftest import wait_until


def test_memory_limit_oom_killed(make, backend, request):
    if backend.name == "container-runsc":
        # Known deviation, kept visible (strict: an XPASS fails the run and this goes): the
        # runsc of Debian 13 (release 20240729) cannot size gVisor's memory to the sandbox
        # (no --total-memory), so the host cgroup's OOM killer ends the whole gVisor sandbox
        # instead of the one process. docs/backends.md says so.
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="gVisor 20240729: a memory-limit OOM kills the whole sandbox"))
    box = make(memory_mib=64, ttl_s=120)
    if backend.backend in ("microvm", "vm"):
        # 1 MiB at a time: in a microVM/VM (a guest of 128 MiB at least) one 400 MiB malloc
        # is refused by the guest kernel's overcommit check (MemoryError, no OOM kill);
        # small ones succeed until the guest's OOM killer ends the program, which the
        # guest agent reports (its `sandbox` cgroup's oom_kill count).
        bomb = "b = [b'x' * (1 << 20) for _ in range(400)]; print(sum(map(len, b)))"
    else:
        bomb = "b = b'x' * (400 << 20); print(len(b))"
    r = box.exec(["python3", "-c", bomb], timeout_s=60)
    assert r.oom_killed, r
    assert r.exit_code != 0 and b"419430400" not in r.stdout
    # The sandbox survives its OOM.
    assert box.exec("echo alive").stdout == b"alive\n"


FORK_BOMB = r"""
import os, sys, time
n = 0
err = None
while n < 3000:           # bounded, so a broken pids limit cannot take the host down
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        os.close(1); os.close(2)
        time.sleep(20)
        os._exit(0)
    n += 1
print(n, err, flush=True)
"""


def test_fork_bomb_contained_by_pids_limit(make):
    box = make(memory_mib=256, pids_max=32, ttl_s=120)
    r = box.exec(["python3", "-c", FORK_BOMB], timeout_s=30)
    n, err = r.stdout.split()
    assert err == b"11", f"fork should fail with EAGAIN: {r}"  # EAGAIN
    assert int(n) < 32
    # A classic shell fork bomb is contained too: the exec ends (timeout kills the
    # tree) and the sandbox answers again afterwards.
    t0 = time.monotonic()
    box.exec("b(){ b | b & }; b; sleep 2", timeout_s=5)
    assert time.monotonic() - t0 < 40

    def answers() -> bool:
        try:
            return box.exec("echo ok", timeout_s=10).stdout == b"ok\n"
        except sandlot.SandlotError:
            return False

    wait_until(answers, 30, what="the sandbox to answer after the fork bomb")


def test_exec_at_the_pids_limit_is_resource_exhausted(make):
    """The sandbox's own processes hold every pid → 429 naming the limit, not 500."""
    box = make(memory_mib=256, pids_max=16, ttl_s=120)
    # The hog keeps every pid it can get: a refused fork is retried, not the end. The limit
    # counts the exec plumbing too (pids cgroup; on runsc gVisor's RLIMIT_NPROC counts every
    # process of uid 0: agent, exec helpers, exec inits), so a fork refused while one of the
    # probe execs below is in flight leaves slots free once that exec has ended; a hog that
    # stopped at its first refusal then let every later probe through (gVisor forks slowly,
    # so that overlap was common on a loaded host).
    code = ("import os, time\n"
            "n = 0\n"
            "end = time.monotonic() + 45\n"
            "while time.monotonic() < end:\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(90); os._exit(0)\n"
            "        n += 1\n"
            "        print('holding', n, flush=True)\n"
            "    except OSError:\n"
            "        time.sleep(0.05)\n")
    hog_result: list = []

    def hog() -> None:
        try:
            hog_result.append(box.exec(["python3", "-c", code], timeout_s=50))
        except sandlot.SandlotError as e:
            hog_result.append(e)  # the sandbox is deleted under it below

    bg = threading.Thread(target=hog)
    bg.start()
    err = None
    try:
        # Generous: on a loaded host gVisor forks slowly before the hog holds every pid.
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            try:
                box.exec(["true"], timeout_s=5)
            except sandlot.ResourceExhausted as e:
                err = e
                break
            time.sleep(0.2)
    finally:
        box.delete()
        bg.join(60)
    assert err is not None, f"exec never hit the pids limit (hog: {hog_result})"
    assert "process limit (pids_max=16)" in str(err), err


def test_upload_past_the_sandbox_space_is_resource_exhausted(make):
    """ENOSPC on upload → 429 resource_exhausted naming the path; the sandbox stays usable."""
    box = make(memory_mib=128, disk_mib=16, ttl_s=120)
    with pytest.raises(sandlot.ResourceExhausted) as ei:
        box.write_file("/tmp/big.bin", b"\0" * (32 << 20))
    assert "/tmp/big.bin" in str(ei.value)
    box.write_file("/tmp/small.txt", b"fits")  # nothing left behind that fills /tmp
    assert box.read_file("/tmp/small.txt") == b"fits"


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_sparse_file_reads_stay_within_the_budget(make, server):
    """A 256 MiB sparse file read 12 times at once must not take GiBs of the server."""
    box = make(memory_mib=128, ttl_s=300)
    size = 268435455
    assert box.exec(["truncate", "-s", str(size), "/workspace/sparse"]).exit_code == 0
    pid = server.proc.pid
    peak = [rss_kib(pid)]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.01)

    t = threading.Thread(target=sample)
    t.start()

    def read(_):
        try:
            data = box.read_file("sparse")
            return len(data) == size and data.count(0) == size
        except sandlot.ResourceExhausted:
            return "429"

    try:
        with ThreadPoolExecutor(12) as ex:
            results = list(ex.map(read, range(12)))
    finally:
        done.set()
        t.join()
    assert all(r is True or r == "429" for r in results), results
    assert results.count(True) >= 1, results
    # 1 GiB budget, plus the client-side answers in flight; the unfixed server reached 3 GiB.
    assert peak[0] < 1900 * 1024, f"server peak RSS {peak[0]} KiB"
