"""Pause and resume (``POST /v1/sandboxes:pause`` / ``:resume``) on every backend that
supports them: ``function`` and ``container`` freeze the sandbox's cgroup; ``microvm`` saves
the guest's memory and device state to a file and stops its QEMU (docs/backends.md,
"Pause"). Either way files, processes and a running background command survive."""

from __future__ import annotations

import re
import time
import uuid

import pytest

import sandlot


def _stdout_so_far(p: sandlot.Process) -> bytes:
    got = b""
    for ev in p.output(follow=False, stdout_offset=0, stderr_offset=0):
        if isinstance(ev, sandlot.StdoutChunk):
            got += ev.data
    return got


def _wait_for(p: sandlot.Process, needle: bytes, timeout: float = 60) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        got = _stdout_so_far(p)
        if needle in got:
            return got
        assert time.monotonic() < deadline, f"no {needle!r} in {got[-300:]!r}"
        time.sleep(0.2)


def test_pause_resume_keeps_a_background_process_and_files(make, client):
    tag = uuid.uuid4().hex[:12]
    box = make(labels={"pause-rt": tag})
    box.write_file("/tmp/kept.bin", bytes(range(256)) * 64)
    p = box.spawn("i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done")
    _wait_for(p, b"tick 2\n")
    assert client.pause({"pause-rt": tag}) == [box.id]
    try:
        assert box.refresh().state == "paused"
        with pytest.raises(sandlot.Conflict):
            box.exec("true")
        with pytest.raises(sandlot.Conflict):
            box.read_file("/tmp/kept.bin")
        assert p.wait(timeout=0.5) is None and p.running
    finally:
        assert client.resume({"pause-rt": tag}) == [box.id]
    assert box.refresh().state == "running"
    assert box.read_file("/tmp/kept.bin") == bytes(range(256)) * 64
    # The same background process keeps writing after the resume.
    before = _stdout_so_far(p)
    n = max(int(x) for x in re.findall(rb"tick (\d+)", before))
    _wait_for(p, f"tick {n + 3}\n".encode())
    assert p.running
    r = box.exec(["sh", "-c", "echo after-resume > /tmp/new && cat /tmp/new"])
    assert (r.exit_code, r.stdout) == (0, b"after-resume\n"), r
    p.kill()
    assert p.wait(timeout=30).signal == 9


def test_pause_twice_resume_twice_and_delete_while_paused(make, client):
    tag = uuid.uuid4().hex[:12]
    box = make(labels={"pause-idem": tag})
    assert client.pause({"pause-idem": tag}) == [box.id]
    # Already paused: not matched again (only running sandboxes are paused).
    assert client.pause({"pause-idem": tag}) == []
    box.delete()
    with pytest.raises(sandlot.NotFound):
        box.refresh()
