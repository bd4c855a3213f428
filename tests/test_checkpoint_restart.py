"""Checkpoints outlive `sandlot up` (issue 5, build item 6): a checkpoint taken before a
restart (SIGTERM, then kill -9) is still listed after it, forks from it see the parent's
files, and its files under DATA/checkpoints go with DELETE. Its own `sandlot up` on a data
dir under /var/tmp (sandbox uids must walk down to their layers); function backend.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

import sandlot
from conftest import Server, count_leaks, wait_no_leaks


@pytest.fixture(scope="module")
def node(binary, log_dir) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("the function backend needs root (namespaces, cgroups, overlay)")
    base = Path(tempfile.mkdtemp(prefix="sandlot-ck-restart-", dir="/var/tmp"))
    os.chmod(base, 0o711)
    srv = Server(binary, base / "data", log_dir / "checkpoint-restart.log")
    srv.start()
    yield srv
    srv.stop()


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
