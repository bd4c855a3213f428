"""Conformance, category ``checkpoint``: disk checkpoints and forks (issue 5, build item 6,
DSec's ``pack_diff``).

A checkpoint saves a sandbox's writable layer (incremental on its image); forks start from
a copy of it (vm: a new qcow2 layer on it). Each fork sees the parent's files, not the image file the parent deleted
(an overlay whiteout), and on the microVM not the contents of a directory the parent
replaced (an opaque directory); each fork has its own entropy, hostname (= its id) and
/etc/machine-id; a write in one fork shows in no other sandbox. After the forks and the
checkpoint are deleted, no mount, loop device, sandbox directory or checkpoint file of
them remains.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

import sandlot
from conftest import count_leaks, wait_no_leaks, wait_until

from .conftest import IMAGE

#: A file of the `python` image the parent deletes (in /root, which its root may write).
IMAGE_FILE = "/root/.bashrc"

#: Entropy twice (the kernel's CSPRNG through Python; the kernel's random UUID, which
#: gVisor does not serve, so Python's uuid4 there), /etc/machine-id, the hostname.
IDENTITY = ("python3 -c 'import os;print(os.urandom(16).hex())'; "
            "cat /proc/sys/kernel/random/uuid 2>/dev/null "
            "|| python3 -c 'import uuid;print(uuid.uuid4())'; "
            "cat /etc/machine-id; hostname")


def loop_devices_under(data_dir: Path) -> List[str]:
    """``losetup -a`` lines whose backing file lies under ``data_dir``, those of pooled
    containers and jails (DATA/container-pool/, DATA/warm-pool/, refilled in the background)
    left out."""
    r = subprocess.run(["losetup", "-a"], capture_output=True, text=True, timeout=30,
                       check=False)
    pools = (str(data_dir / "container-pool") + "/", str(data_dir / "warm-pool") + "/")
    return [line for line in r.stdout.splitlines()
            if str(data_dir) in line and not any(p in line for p in pools)]


def host_counts(data_dir: Path) -> Dict[str, int]:
    c = count_leaks(data_dir)
    c["loops"] = len(loop_devices_under(data_dir))
    ck_dir = data_dir / "checkpoints"
    c["checkpoints"] = len(list(ck_dir.iterdir())) if ck_dir.is_dir() else 0
    return c


def sh(box: sandlot.Sandbox, script: str) -> str:
    r = box.exec(["sh", "-c", script], timeout_s=120)
    assert r.exit_code == 0, f"{box.id}: {script!r} → {r}"
    return r.stdout.decode()


def test_checkpoint_forks_three_sandboxes(backend, make, client, server):
    before = host_counts(server.data_dir)
    parent = make(memory_mib=256)
    parent.write_file("/workspace/a.txt", b"from the parent\n")
    sh(parent, f"mkdir -p /workspace/d/e && echo deep > /workspace/d/e/f && rm {IMAGE_FILE}")
    opaque = backend.backend == "microvm"  # the only case whose root may replace /etc/apt
    if opaque:
        sh(parent, "rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only")
    parent_id = sh(parent, IDENTITY).split()

    ck = parent.checkpoint()
    assert ck.id.startswith("ck-") and len(ck.id) == 23, ck
    assert (ck.sandbox_id, ck.backend, ck.image) == (parent.id, backend.backend, IMAGE)
    assert ck.size_bytes > 0 and ck.created_at.endswith("Z")
    assert ck.id in [c.id for c in client.checkpoints()]
    assert client.get_checkpoint(ck.id).raw == ck.raw
    # The parent keeps running and its later writes are its own.
    parent.write_file("/workspace/after.txt", b"later")

    forks = [make(checkpoint=ck, memory_mib=256) for _ in range(3)]
    ids = []
    for f in forks:
        assert f.backend == backend.backend and f.image == IMAGE
        assert f.read_file("/workspace/a.txt") == b"from the parent\n"
        assert f.read_file("/workspace/d/e/f") == b"deep\n"
        r = f.exec(["test", "-e", IMAGE_FILE])
        assert r.exit_code == 1, f"{f.id}: the deleted image file is back: {r}"
        r = f.exec(["test", "-e", "/workspace/after.txt"])
        assert r.exit_code == 1, f"{f.id} sees a write the parent made after the checkpoint"
        if opaque:
            assert sh(f, "ls /etc/apt").split() == ["only"], "the opaque directory leaked"
        rnd, uuid, machine_id, host = sh(f, IDENTITY).split()
        assert host == f.id, f"hostname {host!r} of fork {f.id}"
        assert len(machine_id) == 32 and machine_id != parent_id[2], machine_id
        ids.append((rnd, uuid, machine_id))
    for i in range(3):
        assert len({x[i] for x in ids} | {parent_id[i]}) == 4, f"shared identity field {i}: {ids}"

    # Writes in one fork show nowhere else.
    forks[0].write_file("/workspace/a.txt", b"fork 0\n")
    sh(forks[0], "echo mine > /workspace/only0")
    for other in (parent, forks[1], forks[2]):
        assert other.read_file("/workspace/a.txt") == b"from the parent\n"
        assert other.exec(["test", "-e", "/workspace/only0"]).exit_code == 1

    # Forks do not depend on the checkpoint; afterwards nothing of any of them remains.
    client.delete_checkpoint(ck)
    with pytest.raises(sandlot.NotFound):
        client.get_checkpoint(ck.id)
    assert forks[1].read_file("/workspace/d/e/f") == b"deep\n"
    for box in [parent, *forks]:
        box.delete()
    wait_no_leaks(server.data_dir, before, timeout=60, what="checkpoint forks")
    wait_until(lambda: all(host_counts(server.data_dir)[k] <= before[k]
                           for k in ("loops", "checkpoints")), 30,
               what=f"loop devices and checkpoint files back to {before}")


def test_checkpoint_bad_input(backend, make, client):
    box = make(memory_mib=128)
    ck = box.checkpoint()
    other_image = "busybox" if IMAGE != "busybox" else "python"
    other_backend = "function" if backend.backend != "function" else "container"
    with pytest.raises(sandlot.InvalidArgument, match="image"):
        client.create(checkpoint=ck, image=other_image, ttl_s=60)
    with pytest.raises(sandlot.InvalidArgument, match="backend"):
        client.create(checkpoint=ck, backend=other_backend, ttl_s=60)
    with pytest.raises(sandlot.InvalidArgument):
        client.create(checkpoint="ck-not-an-id", ttl_s=60)
    with pytest.raises(sandlot.NotFound):
        client.create(checkpoint="ck-00000000000000000000", ttl_s=60)
    with pytest.raises(sandlot.NotFound):
        client.get_checkpoint("ck-00000000000000000000")
    client.delete_checkpoint("ck-00000000000000000000")  # unknown: fine
    with pytest.raises(sandlot.NotFound):
        client._request("POST", "/v1/sandboxes/sb-00000000000000000000/checkpoints")
    client.delete_checkpoint(ck)
    client.delete_checkpoint(ck)  # twice: fine


def test_fork_smaller_than_its_checkpoint_is_the_callers_error(backend, make, client):
    """A fork whose ``disk_mib`` cannot hold the checkpoint's writable layer is refused with
    400 (the caller's size choice), not 429 (the node is not out of anything)."""
    if backend.backend not in ("container", "microvm", "function"):
        pytest.skip(f"{backend.name}: the fork's disk_mib is not a quota that the copy fills")
    box = make(memory_mib=128, disk_mib=128)
    sh(box, "head -c 48M /dev/urandom > /root/big && sync")
    ck = box.checkpoint()
    try:
        with pytest.raises(sandlot.InvalidArgument, match="disk_mib"):
            client.create(checkpoint=ck, disk_mib=16, ttl_s=60)
    finally:
        client.delete_checkpoint(ck)


def test_fork_never_follows_symlinks_planted_in_the_layer(backend, make, client, tmp_path):
    """A sandbox replaces /workspace, /root, /tmp and /etc by symlinks to host paths, then
    is checkpointed and forked: the node prepares the fork's layer as host root, and must
    replace those entries, never chown/chmod/write through them (found by a break test:
    host files became world-writable)."""
    host_dirs = [tmp_path / n for n in ("ws", "root", "etc")]
    for d in host_dirs:
        d.mkdir(mode=0o700)
    host_file = tmp_path / "secret"
    host_file.write_bytes(b"host\n")
    host_file.chmod(0o600)
    watched = [tmp_path, *host_dirs, host_file]
    before = {p: p.stat() for p in watched}
    parent = make(memory_mib=128)
    ws, root, etc = host_dirs
    # `function` sandboxes cannot replace these (their / is read-only): each `||` keeps going.
    parent.exec(["sh", "-c", f"cd / && for p in workspace:{ws} root:{root} tmp:{host_file} "
                 f"etc:{etc}; do n=${{p%%:*}}; rm -rf /$n 2>/dev/null && "
                 f"ln -s ${{p#*:}} /$n || true; done"], timeout_s=60)
    ck = parent.checkpoint()
    fork = client.create(checkpoint=ck, ttl_s=120, labels=backend.labels)
    try:
        r = fork.exec(["sh", "-c", "test -d /workspace && test -d /tmp && echo ok"],
                      timeout_s=60)
        assert r.stdout.strip() == b"ok", r
        assert fork.exec(["cat", "/etc/machine-id"], timeout_s=60).exit_code == 0
    finally:
        fork.delete()
        client.delete_checkpoint(ck)
    for p, st in before.items():
        now = p.stat()
        assert (now.st_uid, now.st_gid, now.st_mode) == (st.st_uid, st.st_gid, st.st_mode), p
    assert host_file.read_bytes() == b"host\n"
    assert [x.name for x in etc.iterdir()] == []
