"""Checkpoints outlive `sandlot up` (issue 5, build item 6): a checkpoint taken before a
restart (SIGTERM, then kill -9) is still listed after it, forks from it see the parent's
files, and its files under DATA/checkpoints go with DELETE. Its own `sandlot up` on a data
dir under /var/tmp (sandbox uids must walk down to their layers); function backend.
"""

from __future__ import annotations

import os
import signal
from typing import Iterator

import pytest

import sandlot
from conftest import Server, count_leaks, private_base, remove_private_base, wait_no_leaks


@pytest.fixture(scope="module")
def node(binary, log_dir) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("the function backend needs root (namespaces, cgroups, overlay)")
    base = private_base("sandlot-ck-restart-")
    srv = Server(binary, base / "data", log_dir / "checkpoint-restart.log")
    srv.start()
    yield srv
    srv.stop()
    remove_private_base(base)


def test_checkpoints_survive_restarts(node):
    before = count_leaks(node.data_dir)
    c = sandlot.Client(node.url, timeout=60)
    parent = c.create(image="python", ttl_s=300)
    parent.write_file("/workspace/kept.txt", b"before the restart")
    ck = parent.checkpoint()
    files = node.data_dir / "checkpoints" / ck.id
    assert (files / "meta.json").is_file() and (files / "layer").is_dir()
    c.close()

    for sig in (signal.SIGTERM, signal.SIGKILL):
        node.restart(sig)
        c = sandlot.Client(node.url, timeout=60)
        assert [k.id for k in c.checkpoints()] == [ck.id], node.log_tail()
        assert c.get_checkpoint(ck.id).raw == ck.raw
        fork = c.create(checkpoint=ck, ttl_s=300)
        assert fork.read_file("/workspace/kept.txt") == b"before the restart"
        fork.delete()
        c.close()

    c = sandlot.Client(node.url, timeout=60)
    c.delete_checkpoint(ck)
    assert not files.exists()
    assert c.checkpoints() == []
    c.delete(parent.id)
    wait_no_leaks(node.data_dir, before, what="checkpoint restart test")
    c.close()


def test_kill_9_during_a_checkpoint_leaves_the_sandbox_running(node):
    """The copy freezes the sandbox; a node killed mid-copy must not leave it frozen for
    good (its record says running, so no resume would ever thaw it): the next start thaws
    it from the marker in the half-made checkpoint (found by a break test)."""
    c = sandlot.Client(node.url, timeout=120)
    box = c.create(image="python", ttl_s=300)
    # Enough files that the copy takes a while (seconds on this host).
    box.exec(["sh", "-c", "mkdir -p /workspace/many && cd /workspace/many && "
              "for i in $(seq 1 30000); do : > f$i; done"], timeout_s=300)
    ck_dir = node.data_dir / "checkpoints"
    import threading
    t = threading.Thread(target=lambda: _ignore(lambda: box.checkpoint()), daemon=True)
    t.start()
    deadline = __import__("time").monotonic() + 60
    while not any(p.name.endswith(".tmp") and (p / "frozen-groups").exists()
                  for p in ck_dir.iterdir()):
        assert __import__("time").monotonic() < deadline, "no checkpoint copy under way"
    node.restart(signal.SIGKILL)
    t.join(timeout=60)
    c = sandlot.Client(node.url, timeout=60)
    assert c.get(box.id).state == "running"
    r = c.get(box.id).exec(["echo", "alive"], timeout_s=60)
    assert r.exit_code == 0 and r.stdout == b"alive\n", r
    assert not [p for p in ck_dir.iterdir() if p.name.endswith(".tmp")]
    c.get(box.id).delete()


def _ignore(f):
    try:
        f()
    except Exception:  # the server is killed under the call
        pass
