"""vm disk checkpoints as qcow2 layers (issue 5, build item 6), across a kill -9 of
`sandlot up`: a checkpoint freezes the VM's active qcow2 layer under a new one (QMP
``blockdev-snapshot``) and links the chain into ``DATA/checkpoints/<ck>/``; a fork is a new
layer on that chain (hard links, no copy). Checked here:

* two checkpoints in a row give the parent a three-layer chain; after kill -9 and a restart
  the parent is re-adopted, keeps writing, and checkpoints again (the active layer is found
  from QEMU's node names, not from node memory);
* a fork of the second checkpoint sees the files of both, not the parent's later writes;
* pause with memory after checkpoints restarts QEMU on the layer it wrote last (read-write),
  never on a frozen one, also when the node is killed while the VM is paused;
* owners (QEMU runs as an unprivileged uid per sandbox): each VM's active layer is its QEMU
  uid's (0600), every frozen layer root's with the QEMUs' shared group (0440), so a fork's
  QEMU (another uid) reads its whole backing chain and writes none of it;
* deleting the checkpoint and the parent while the fork runs leaves the fork's disk whole
  (its own links keep the layers), a fork of that fork boots on the same chain, and after
  everything is deleted no layer file remains.

One private `sandlot up` (VMs boot in seconds under TCG: one test, three boots).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import sandlot
from conftest import Server, count_leaks, private_base, remove_private_base, wait_no_leaks

IMAGE = "python"


@pytest.fixture(scope="module")
def node(binary, log_dir) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("vm tests need root (cgroups, QEMU)")
    base = private_base("sandlot-vmck-")
    srv = Server(binary, base / "data", log_dir / "vm-checkpoint.log")
    try:
        srv.start()
    except RuntimeError as e:
        pytest.fail(f"could not start `sandlot up`: {e}")
    with sandlot.Client(srv.url, timeout=60) as c:
        status = c._request("GET", "/healthz").json().get("backends", {}).get("vm")
    if status != "ok":
        srv.stop()
        remove_private_base(base)
        pytest.skip(f"backend vm is not available here: {status}")
    yield srv
    try:
        srv.delete_all()
        srv.stop()
    finally:
        remove_private_base(base)


def sh(box: sandlot.Sandbox, script: str) -> str:
    r = box.exec(["sh", "-c", script], timeout_s=120)
    assert r.exit_code == 0, f"{box.id}: {script!r} → {r}"
    return r.stdout.decode()


def chain(top: Path) -> list:
    """Files of the qcow2 chain of ``top`` (``qemu-img info --backing-chain``, -U: QEMU
    holds them)."""
    r = subprocess.run(["qemu-img", "info", "-U", "--backing-chain", str(top)],
                       capture_output=True, text=True, timeout=60, check=True)
    return [line.split(": ", 1)[1] for line in r.stdout.splitlines()
            if line.startswith("image: ")]


def open_layers(pid: int) -> dict:
    """``{path: read-write?}`` of the qcow2 files QEMU ``pid`` holds open."""
    out = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.endswith(".qcow2"):
            flags = int(Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().split()[3], 8)
            out[target] = out.get(target, False) or (flags & os.O_ACCMODE) == os.O_RDWR
    return out


def assert_layer_owners(data_dir: Path, vmdir: Path) -> int:
    """Every qcow2 file of ``vmdir``: the active one (the one QEMU holds read-write) is the
    QEMU uid's, mode 0600; the others (frozen) root's, group = the QEMUs' shared group (the
    group of ``images/``), mode 0440. Returns the QEMU uid."""
    st = json.loads((vmdir / "state.json").read_text())
    uid = st["qemu_uid"]
    assert uid, st
    group = os.stat(data_dir / "vm" / "images").st_gid
    assert group not in (0, uid)
    held = open_layers(st["qemu_pid"])
    active = [p for p, rw in held.items() if rw]
    assert len(active) == 1, held
    for f in vmdir.glob("*.qcow2"):
        m = f.stat()
        got = (m.st_uid, m.st_gid, m.st_mode & 0o7777)
        if str(f) == active[0]:
            assert got == (uid, uid, 0o600), f"{f}: active layer {got}"
        else:
            assert got == (0, group, 0o440), f"{f}: frozen layer {got}"
    return uid


def test_layers_survive_kill_9_and_outlive_their_holders(node):
    before = count_leaks(node.data_dir)
    c = sandlot.Client(node.url, timeout=180)
    parent = c.create(backend="vm", image=IMAGE, memory_mib=256, ttl_s=900,
                      labels={"vmck": "p"})
    vmdir = node.data_dir / "vm" / "vms" / parent.id
    parent.write_file("/workspace/one.txt", b"first\n")
    ck1 = parent.checkpoint()
    sh(parent, "echo second > /workspace/two.txt && rm /root/.bashrc")
    ck2 = parent.checkpoint()
    assert ck2.backend == "vm" and ck2.size_bytes > 0
    ck2_dir = node.data_dir / "checkpoints" / ck2.id
    # base ← disk ← layer(ck2's top) : the checkpoint holds its own links to its layers.
    files = chain(ck2_dir / "top.qcow2")
    assert len(files) == 3, files
    assert sorted(p.name for p in ck2_dir.glob("*.qcow2")) == ["disk.qcow2", "top.qcow2"]
    assert (ck2_dir / "top.qcow2").stat().st_mode & 0o222 == 0, "a frozen layer is writable"
    parent_uid = assert_layer_owners(node.data_dir, vmdir)
    assert len(list(vmdir.glob("*.qcow2"))) == 3

    node.restart(signal.SIGKILL)
    c = sandlot.Client(node.url, timeout=180)
    parent = c.get(parent.id)
    assert parent.state == "running", node.log_tail()
    sh(parent, "echo after > /workspace/after.txt")
    ck3 = parent.checkpoint()  # the active layer is found again after the restart
    assert len(list(vmdir.glob("*.qcow2"))) == 4

    # Pause with memory after the checkpoints, kill -9 while paused, resume: the new QEMU
    # writes to the newest layer only.
    sh(parent, "echo paused > /workspace/p.txt && sync")
    assert c.pause({"vmck": "p"}) == [parent.id], node.log_tail()
    st = json.loads((vmdir / "state.json").read_text())
    assert st["memory_saved"] is True and (vmdir / "memory.state").is_file(), st
    m = (vmdir / "memory.state").stat()  # root's: QEMU had it only as a passed fd
    assert (m.st_uid, m.st_mode & 0o7777) == (0, 0o600), (m.st_uid, oct(m.st_mode))
    node.restart(signal.SIGKILL)
    c = sandlot.Client(node.url, timeout=180)
    assert c.get(parent.id).state == "paused"
    assert c.resume({"vmck": "p"}) == [parent.id], node.log_tail()
    st = json.loads((vmdir / "state.json").read_text())
    held = open_layers(st["qemu_pid"])
    writable = [p for p, rw in held.items() if rw]
    assert len(writable) == 1, held
    assert os.stat(writable[0]).st_mode & 0o222, f"QEMU writes a frozen layer: {held}"
    # base ← disk ← ck2 ← ck3 ← active
    assert Path(writable[0]).parent == vmdir and len(held) == 5, held
    parent = c.get(parent.id)
    assert parent.read_file("/workspace/p.txt") == b"paused\n"
    sh(parent, "echo resumed > /workspace/r.txt && sync")

    fork = c.create(checkpoint=ck2, memory_mib=256, ttl_s=900)
    assert fork.backend == "vm"
    assert fork.read_file("/workspace/one.txt") == b"first\n"
    assert fork.read_file("/workspace/two.txt") == b"second\n"
    assert fork.exec(["test", "-e", "/workspace/after.txt"]).exit_code == 1
    assert fork.exec(["test", "-e", "/root/.bashrc"]).exit_code == 1
    assert sh(fork, "hostname").strip() == fork.id
    # The fork's QEMU (another uid) reads the checkpoint's chain and writes only its own layer.
    fork_dir = node.data_dir / "vm" / "vms" / fork.id
    assert assert_layer_owners(node.data_dir, fork_dir) != parent_uid
    assert assert_layer_owners(node.data_dir, vmdir) == parent_uid

    # The fork's layers are its own links: checkpoints and parent may go.
    for k in (ck1, ck2, ck3):
        c.delete_checkpoint(k)
    parent.delete()
    sh(fork, "(echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; cat /workspace/one.txt /workspace/two.txt "
             "> /dev/null && echo mine > /workspace/f && sync")
    assert fork.read_file("/workspace/f") == b"mine\n"
    # A fork of the fork: its chain runs through layers whose other holders are gone.
    ck4 = fork.checkpoint()
    fork2 = c.create(checkpoint=ck4, memory_mib=256, ttl_s=900)
    assert fork2.read_file("/workspace/f") == b"mine\n"
    assert fork2.read_file("/workspace/one.txt") == b"first\n"
    c.delete_checkpoint(ck4)
    fork2.delete()
    fork.delete()
    wait_no_leaks(node.data_dir, before, timeout=60, what="vm checkpoint layers")
    left = [p for p in (node.data_dir / "vm" / "vms").rglob("*.qcow2")]
    left += [p for p in (node.data_dir / "checkpoints").rglob("*.qcow2")]
    assert left == [], left
    c.close()
