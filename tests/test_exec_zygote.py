"""The guest agent's exec-helper zygote in a real runc container (docs/backends.md,
containers; `crates/sandlot-guest/src/zygote.rs`): the agent's spare exec helper is a clone
of the zygote (no execve) and still the agent's child; after the zygote is SIGKILLed from
the host every exec still runs (the agent starts helpers itself) and a new zygote takes
over; under runsc, whose clone ignores CLONE_PARENT, no zygote runs and no exec leaves a
zombie.

The container's processes are found from the host: the agent is the `sandlot-guest agent`
whose root holds a marker file the test's exec wrote.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

import sandlot
from conftest import ZOMBIES_PY, host_processes_matching, wait_until

IMAGE = "python"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _ppid_state(pid: int) -> Tuple[int, str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1, "X"
    rest = stat.rsplit(")", 1)[1].split()
    return int(rest[1]), rest[0]


def _pidns_for_children(pid: int) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid_for_children")
    except OSError:
        return None


def _children(agent: int) -> List[Tuple[int, str, bool]]:
    """(pid, cmdline, made its own pid namespace) of the agent's live children."""
    own = _pidns_for_children(agent)
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        pid = int(p.name)
        ppid, state = _ppid_state(pid)
        if ppid == agent and state != "Z":
            out.append((pid, _cmdline(pid), _pidns_for_children(pid) != own))
    return out


def _agent_of(box: sandlot.Sandbox) -> int:
    marker = f"zygote-test-{uuid.uuid4().hex}"
    box.exec(["touch", f"/tmp/{marker}"])
    for pid in host_processes_matching(b"sandlot-guest\0agent"):
        if Path(f"/proc/{pid}/root/tmp/{marker}").exists():
            return pid
    pytest.fail("the sandbox's agent is not among the host's processes")


def _zygotes(children) -> List[int]:
    return [p for p, cmd, own_ns in children if not own_ns and cmd.endswith("exec --zygote")]


def _from_zygote(children) -> bool:
    return any(own_ns and cmd.endswith("exec --zygote") for _, cmd, own_ns in children)


@pytest.fixture
def runc_box(client, python_image) -> sandlot.Sandbox:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    box = client.create(image=IMAGE, backend="container", runtime="runc",
                        memory_mib=256, ttl_s=300)
    yield box
    box.delete()


def test_helpers_come_from_the_zygote_and_a_killed_zygote_is_replaced(runc_box):
    box = runc_box
    agent = _agent_of(box)
    assert box.exec(["true"]).exit_code == 0
    wait_until(lambda: len(_zygotes(_children(agent))) == 1 and _from_zygote(_children(agent)),
               10, what="one zygote and a spare helper cloned from it, both the agent's children")
    kids = _children(agent)
    zygote = _zygotes(kids)[0]
    assert not any("--own-pid-ns" in cmd for _, cmd, _ in kids), kids

    os.kill(zygote, 9)
    wait_until(lambda: zygote not in [p for p, _, _ in _children(agent)], 10,
               what="the killed zygote to be reaped")
    direct = False
    deadline = time.monotonic() + 15
    while True:
        r = box.exec("echo ok")
        assert r.stdout == b"ok\n" and r.exit_code == 0, r
        time.sleep(0.1)
        kids = _children(agent)
        direct |= any("--own-pid-ns" in cmd for _, cmd, _ in kids)
        new = [z for z in _zygotes(kids) if z != zygote]
        if new and _from_zygote(kids):
            break
        assert time.monotonic() < deadline, f"no new zygote took over: {kids}"
    assert direct, "no helper was started directly while the zygote was gone"
    assert len(_zygotes(kids)) == 1, kids


ZOMBIES = ZOMBIES_PY + "print(zombies())\n"


def test_runsc_runs_no_zygote_and_leaves_no_zombie_helper(client, python_image):
    if shutil.which("runsc") is None:
        pytest.skip("runsc is not installed")
    box = client.create(image=IMAGE, backend="container", runtime="runsc",
                        memory_mib=256, ttl_s=300)
    try:
        for _ in range(5):
            assert box.exec(["true"]).exit_code == 0
        # The sandbox's /proc is its own (gVisor's): no zygote in it, and the five helpers
        # above were all reaped (a helper whose parent was a zygote would stay a zombie).
        cmds = box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert b"--zygote" not in cmds, cmds
        # A helper is reaped just after its exec answered: give the agent a moment.
        deadline = time.monotonic() + 10
        while True:
            r = box.exec(["python3", "-c", ZOMBIES])
            if r.stdout == b"0\n" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.stdout == b"0\n", f"zombies in the sandbox: {r}"
    finally:
        box.delete()
