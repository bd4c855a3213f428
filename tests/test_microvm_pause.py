"""microvm pause with memory across a crash of `sandlot up` (issue 5, build item 5): a
paused microVM is only files (``state.json`` with ``memory_saved``, ``memory.state``) and no
QEMU; kill -9 of `sandlot up` and a restart on the same data dir re-adopt it as paused; the
resume restores memory (a file on the guest's tmpfs ``/dev/shm`` lives only in guest RAM)
and disk; deleting a paused microVM removes its memory file.

One private `sandlot up` for the module (microVMs boot in seconds under TCG: few tests).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

import sandlot
from conftest import Server, private_base, process_stdout, remove_private_base, wait_until

IMAGE = "python"


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def node(binary, log_dir) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("microVM tests need root (cgroups, QEMU)")
    base = private_base("sandlot-mvpause-")
    srv = Server(binary, base / "data", log_dir / "microvm-pause.log")
    try:
        srv.start()
    except RuntimeError as e:
        pytest.fail(f"could not start `sandlot up`: {e}")
    with sandlot.Client(srv.url, timeout=60) as c:
        status = c._request("GET", "/healthz").json().get("backends", {}).get("microvm")
    if status != "ok":
        srv.stop()
        pytest.skip(f"backend microvm is not available here: {status}")
    yield srv
    try:
        srv.delete_all()
        srv.stop()
    finally:
        remove_private_base(base)


def qemu_uid(pid: int) -> int:
    """The real uid of QEMU ``pid`` (all four ids of ``Uid:`` must agree)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith("Uid:"))
    ids = set(line.split()[1:])
    assert len(ids) == 1, line
    return int(ids.pop())


def test_kill9_while_paused_then_resume_and_delete_paused(node):
    tag = uuid.uuid4().hex[:12]
    c = sandlot.Client(node.url, timeout=120)
    box = c.create(backend="microvm", image=IMAGE, memory_mib=256, ttl_s=900,
                   labels={"mvpause": tag})
    r = box.exec("echo in-memory > /dev/shm/m && echo on-disk > /tmp/d && sync")
    assert r.exit_code == 0, r
    vmdir = node.data_dir / "microvm" / "vms" / box.id
    st = json.loads((vmdir / "state.json").read_text())
    uid = qemu_uid(st["qemu_pid"])
    assert uid != 0 and st["qemu_uid"] == uid, st
    assert c.pause({"mvpause": tag}) == [box.id]
    st = json.loads((vmdir / "state.json").read_text())
    assert st["memory_saved"] is True
    assert (vmdir / "memory.state").stat().st_size > 1 << 20
    assert not pid_alive(st["qemu_pid"]), "QEMU still runs after a pause with memory"

    node.restart(signal.SIGKILL)
    c.close()
    c = sandlot.Client(node.url, timeout=120)
    box = c.get(box.id)
    assert box.state == "paused"
    with pytest.raises(sandlot.Conflict):
        box.exec("true")
    assert c.resume({"mvpause": tag}) == [box.id]
    r = box.exec("cat /dev/shm/m /tmp/d")
    assert (r.exit_code, r.stdout) == (0, b"in-memory\non-disk\n"), r
    assert not (vmdir / "memory.state").exists()
    st = json.loads((vmdir / "state.json").read_text())
    assert st["memory_saved"] is False and pid_alive(st["qemu_pid"])
    # The restored QEMU (new process, after a node restart) runs as the same uid.
    assert qemu_uid(st["qemu_pid"]) == uid == st["qemu_uid"], st

    # Paused again, then deleted: the memory file goes with the VM directory.
    assert c.pause({"mvpause": tag}) == [box.id]
    assert (vmdir / "memory.state").is_file()
    box.delete()
    wait_until(lambda: not vmdir.exists(), 30, what=f"{vmdir} to go")
    c.close()


def test_kill9_refinds_background_processes(node):
    """Issue 25 on microvm: background processes run by the guest agent outlive a kill -9
    of `sandlot up` (QEMU and the guest go on) and are listed again under their old
    handles after the restart: a counter printing every 0.2 s goes on from the same
    offsets (what it printed meanwhile from the agent's ring, every line in order) and
    ends when killed through its handle; one that exited meanwhile is `exited` with its
    exit code and output."""
    c = sandlot.Client(node.url, timeout=120)
    box = c.create(backend="microvm", image=IMAGE, memory_mib=256, ttl_s=900)
    try:
        counter = box.spawn("i=0; while true; do echo n$i; date +%s%N > /tmp/hb; "
                            "i=$((i+1)); sleep 0.2; done")
        before, _ = process_stdout(counter, b"n3\n", timeout=60)
        short = box.spawn("sleep 2; echo bye >&2; exit 7")
        node.kill()
        time.sleep(4)  # the short one ends while no server runs
        node.start()
        c.close()
        c = sandlot.Client(node.url, timeout=120)
        box = c.get(box.id)

        procs = {p.id: p for p in box.processes()}
        assert set(procs) == {counter.id, short.id}, procs
        p, s = procs[counter.id], procs[short.id]
        assert p.state == "running", p.__dict__
        assert s.state == "exited" and s.result is not None and s.result.exit_code == 7, s
        assert box.process(short.id).wait(timeout=30).stderr == b"bye\n"
        after, skipped = process_stdout(p, b"n25\n", timeout=60)
        gap = skipped[0].to if skipped else 0
        assert gap <= len(before), (gap, len(before))
        lines = (before[:gap] + after).decode().splitlines()
        assert lines == [f"n{i}" for i in range(len(lines))], lines
        p.kill()
        res = p.wait(timeout=30)
        assert res is not None and res.signal == 9, res
        a = box.read_file("/tmp/hb")
        time.sleep(0.6)
        assert box.read_file("/tmp/hb") == a, "the counter still runs"
    finally:
        box.delete()
        c.close()


def _templates(node) -> list:
    d = node.data_dir / "microvm" / "templates"
    # Finished templates only: a partial one is built in `<key>.tmp/` and renamed when done.
    return ([p for p in d.glob("*/memory.state") if not p.parent.name.endswith(".tmp")]
            if d.is_dir() else [])


def _wall_clock_skew(box) -> tuple[float, float]:
    """(guest's wall-clock time minus the host's, in s; half the exec's round trip): the
    guest's reading lies somewhere within the round trip."""
    t0 = time.time()
    r = box.exec(["date", "+%s.%N"])
    t1 = time.time()
    assert r.exit_code == 0, r
    return float(r.stdout) - (t0 + t1) / 2, (t1 - t0) / 2


def test_template_start_gives_each_guest_a_fresh_identity(node):
    """Item 7: the first cold boot of a shape makes a template snapshot in the background;
    later creates restore it and each gets its own hostname, machine id and entropy, and
    the host's wall-clock time (not the template's)."""
    c = sandlot.Client(node.url, timeout=120)
    first = c.create(backend="microvm", image=IMAGE, memory_mib=192, ttl_s=600)
    wait_until(lambda: _templates(node), 120, interval=0.5,
               what="a template snapshot under DATA/microvm/templates")
    time.sleep(3)  # the template's clock is now >= 3 s behind the host's
    boxes = [c.create(backend="microvm", image=IMAGE, memory_mib=192, ttl_s=600)
             for _ in range(2)]
    seen = []
    for b in boxes:
        st = json.loads((node.data_dir / "microvm" / "vms" / b.id / "state.json").read_text())
        assert st["started_from"] == "template", st
        assert qemu_uid(st["qemu_pid"]) == st["qemu_uid"] != 0, st
        r = b.exec(["sh", "-c", "hostname; cat /etc/machine-id; "
                    "python3 -c 'import os; print(os.urandom(16).hex())'"])
        assert r.exit_code == 0, r
        host, mid, rnd = r.stdout.decode().split()
        assert host == b.id
        seen.append((mid, rnd))
        skew, half = _wall_clock_skew(b)
        assert abs(skew) <= half + 0.5, f"guest wall clock {skew:+.2f} s off the host's"
        b.write_file("/tmp/mine", b.id.encode())
    assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1], seen
    # Each got its own copy of the template's scratch disk.
    assert boxes[0].read_file("/tmp/mine") == boxes[0].id.encode()
    assert boxes[1].read_file("/tmp/mine") == boxes[1].id.encode()
    st = json.loads((node.data_dir / "microvm" / "vms" / first.id / "state.json").read_text())
    assert st["started_from"] == "cold"
    # Templates are root's once made (their builder's uid went back to the table).
    for t in _templates(node):
        assert t.parent.stat().st_uid == 0 and t.parent.stat().st_mode & 0o777 == 0o700
        assert (t.parent / "scratch.img").stat().st_uid == 0
    for b in [first, *boxes]:
        b.delete()
    c.close()


def test_templates_outlive_a_restart_and_stale_ones_are_collected(node):
    """A restart of `sandlot up` keeps its templates usable (the key follows the initramfs's
    content, which the node writes anew at each start, not its mtime) and removes at start
    the templates of other boot files and partial ones."""
    c = sandlot.Client(node.url, timeout=120)
    c.create(backend="microvm", image=IMAGE, memory_mib=192, ttl_s=600).delete()
    wait_until(lambda: _templates(node), 120, interval=0.5,
               what="a template snapshot under DATA/microvm/templates")
    before = sorted(t.parent.name for t in _templates(node))
    d = node.data_dir / "microvm" / "templates"
    stale = d / "00000000000000ff"  # as made by another kernel or guest agent
    stale.mkdir()
    (stale / "memory.state").write_bytes(b"x" * 4096)
    (stale / "inputs").write_text("kernel /old/vmlinux:1:1\n")
    partial = d / "00000000000000fe.tmp"  # a build a crash interrupted
    partial.mkdir()
    (partial / "scratch.img").write_bytes(b"")
    c.close()

    node.restart(signal.SIGKILL)
    assert not stale.exists() and not partial.exists()
    assert sorted(t.parent.name for t in _templates(node)) == before
    c = sandlot.Client(node.url, timeout=120)
    box = c.create(backend="microvm", image=IMAGE, memory_mib=192, ttl_s=600)
    st = json.loads((node.data_dir / "microvm" / "vms" / box.id / "state.json").read_text())
    assert st["started_from"] == "template", st
    assert any((d / n / "used").is_file() for n in before), "no template marked used"
    assert box.exec("true").exit_code == 0
    box.delete()
    # No new template for the same shape after the restart.
    assert sorted(t.parent.name for t in _templates(node)) == before
    c.close()


def _cpu_group(box_id: str) -> Path | None:
    """The sandbox's group in the cgroup v1 `cpu` hierarchy (None on cgroup v2)."""
    found = list(Path("/sys/fs/cgroup/cpu").glob(f"*/{box_id}")) \
        if Path("/sys/fs/cgroup/cpu").is_dir() else []
    return found[0] if found else None


def _vcpu_tids(pid: int) -> set[int]:
    """Threads of QEMU ``pid`` named ``CPU <n>/TCG`` or ``CPU <n>/KVM``."""
    out = set()
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            if t.joinpath("comm").read_text().startswith("CPU "):
                out.add(int(t.name))
        except OSError:
            pass
    return out


def _tasks(group: Path) -> set[int]:
    return {int(x) for x in (group / "tasks").read_text().split()}


def test_vcpus_are_held_to_the_sandbox_cpu(node):
    """Item 8 (the VMM in its own cgroup with limits): QEMU's vCPU threads sit in the
    group's ``vcpu`` child, limited to the sandbox's ``cpu`` (0.5 core: a 5 ms quota per
    10 ms period), QEMU's other threads in the group itself with 0.5 core of headroom (1.0
    core); a resumed QEMU's vCPU lands there too."""
    c = sandlot.Client(node.url, timeout=120)
    tag = uuid.uuid4().hex[:12]
    box = c.create(backend="microvm", image=IMAGE, memory_mib=192, cpu=0.5, ttl_s=600,
                   labels={"vcpu": tag})
    try:
        group = _cpu_group(box.id)
        if group is None:
            pytest.skip("cgroup v2 host: QEMU's vCPU threads are not split from its own")
        vmdir = node.data_dir / "microvm" / "vms" / box.id
        for _ in range(2):  # as created, then after a pause with memory and a resume
            pid = json.loads((vmdir / "state.json").read_text())["qemu_pid"]
            vcpus = _vcpu_tids(pid)
            assert len(vcpus) == 1, f"QEMU {pid} threads: {os.listdir(f'/proc/{pid}/task')}"
            wait_until(lambda: _tasks(group / "vcpu") == vcpus, 10,
                       what=f"vCPU thread {vcpus} in {group}/vcpu")
            assert pid in _tasks(group) and not vcpus & _tasks(group)
            assert (group / "vcpu" / "cpu.cfs_quota_us").read_text().split() == ["5000"]
            assert (group / "vcpu" / "cpu.cfs_period_us").read_text().split() == ["10000"]
            assert (group / "cpu.cfs_quota_us").read_text().split() == ["10000"]
            assert c.pause({"vcpu": tag}) == [box.id]
            assert c.resume({"vcpu": tag}) == [box.id]
    finally:
        box.delete()
        c.close()


def test_the_guest_clock_keeps_time_on_the_tsc(node):
    """A guest held to half a core keeps time across a pause with memory and a resume: its
    wall clock is the host's again after the resume, its clock runs at the host's rate (under TCG its kernel is told the host's TSC rate) and
    stays on the TSC (under TCG the clocksource watchdog's only reference is jiffies, which
    lose ticks while the vCPU waits for the host CPU; the kernel is told `tsc=reliable`)."""
    c = sandlot.Client(node.url, timeout=120)
    tag = uuid.uuid4().hex[:12]
    box = c.create(backend="microvm", image=IMAGE, memory_mib=192, cpu=0.5, ttl_s=600,
                   labels={"clock": tag})
    try:
        assert c.pause({"clock": tag}) == [box.id]
        time.sleep(3)
        assert c.resume({"clock": tag}) == [box.id]
        # The wall clock is the host's again, not 3 s behind.
        skew, half = _wall_clock_skew(box)
        assert abs(skew) <= half + 0.5, f"guest wall clock {skew:+.2f} s off the host's"

        def uptime() -> tuple[float, float, float]:
            t0 = time.monotonic()
            r = box.exec(["cat", "/proc/uptime"])
            t1 = time.monotonic()
            assert r.exit_code == 0, r
            return (t0 + t1) / 2, (t1 - t0) / 2, float(r.stdout.split()[0])

        h0, e0, g0 = uptime()
        time.sleep(5)
        h1, e1, g1 = uptime()
        # Each reading is somewhere within its exec's round trip.
        assert abs((g1 - g0) - (h1 - h0)) <= e0 + e1 + 0.02 * (h1 - h0), \
            f"guest clock {g1 - g0:.3f} s over {h1 - h0:.3f} s of host time"
        if box.accel == "tcg":
            # Seconds of a throttled vCPU later (the watchdog checks every 0.5 s).
            r = box.exec(["cat", "/sys/devices/system/clocksource/clocksource0/"
                                 "current_clocksource"])
            assert r.stdout.split() == [b"tsc"], r
    finally:
        box.delete()
        c.close()
