"""A fork never mixes image versions (function, container; microvm in
test_image_disks.py): a checkpoint holds only the parent's writable layer, and a fork lays
it over the image's files. Once the image is rebuilt (`sandlot image build --force`), a
re-pulled tag or a re-import, the files under the checkpoint are not the parent's any
more, so the fork is refused with `409 conflict` ("take a new checkpoint") and nothing of
it is left behind. The version that counts is the one the parent was *created* on: a
parent still running on the old version checkpoints the old version. A `vm` fork reads the
parent's own base disk and is not affected. Pulling or importing the same image again
(same config, same layers) keeps its version.

One private `sandlot up` per backend on a private image store (conftest
`private_image_node`).
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from typing import Callable, Iterator, Tuple

import pytest

import sandlot
from conftest import Server, private_image_node

IMAGE = "busybox"


@pytest.fixture(params=["function", "container"])
def node(request, binary, log_dir, monkeypatch) -> Iterator[Tuple[Server, str, Callable[..., str]]]:
    backend = request.param
    if os.geteuid() != 0:
        pytest.skip(f"{backend} tests need root (namespaces, cgroups)")
    with private_image_node(binary, log_dir / f"ck-image-version-{backend}.log", monkeypatch,
                            f"sandlot-ck-version-{backend}-") as (srv, image):
        yield srv, backend, image


def test_a_fork_is_refused_once_the_image_changed(node):
    srv, backend, image = node
    c = sandlot.Client(srv.url, timeout=120)
    parent = c.create(backend=backend, image=IMAGE, ttl_s=600)
    parent.write_file("/workspace/kept.txt", b"v1")
    ck = parent.checkpoint()
    # Same version: the fork sees the parent's file.
    fork = c.create(checkpoint=ck, ttl_s=600)
    assert fork.read_file("/workspace/kept.txt") == b"v1"
    fork.delete()

    image("build", IMAGE, "--force")
    # The parent still runs on the old version, so a checkpoint taken now records it too.
    late = parent.checkpoint()
    sandboxes_dir = srv.data_dir / ("sandboxes" if backend == "function" else "containers")
    for k in (ck, late):
        with pytest.raises(sandlot.Conflict, match="take a new checkpoint"):
            c.create(checkpoint=k, ttl_s=600)
    # Nothing of the refused forks is left: no sandbox, no directory.
    assert [b.id for b in c.list()] == [parent.id]
    assert [p.name for p in sandboxes_dir.iterdir()] == [parent.id]

    # The record outlives a node restart (the checkpoint's meta.json).
    srv.restart()
    c.close()
    c = sandlot.Client(srv.url, timeout=120)
    with pytest.raises(sandlot.Conflict, match="take a new checkpoint"):
        c.create(checkpoint=ck, ttl_s=600)

    # A sandbox of the new version checkpoints and forks as usual.
    fresh = c.create(backend=backend, image=IMAGE, ttl_s=600)
    fresh.write_file("/workspace/kept.txt", b"v2")
    fork = c.create(checkpoint=fresh.checkpoint(), ttl_s=600)
    assert fork.read_file("/workspace/kept.txt") == b"v2"
    c.close()


def test_an_unchanged_re_pull_keeps_checkpoints_forkable(node):
    srv, backend, image = node
    registry = os.environ.get("SANDLOT_REGISTRY_ADDR", "127.0.0.1:5000")
    ref = f"{registry}/sandlot/busybox:latest"
    try:
        urllib.request.urlopen(f"http://{registry}/v2/sandlot/busybox/tags/list", timeout=5).close()
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"no {ref} in a registry here ({e}); scripts/registry.sh start && push")
    image("pull", ref)
    with sandlot.Client(srv.url, timeout=120) as c:
        parent = c.create(backend=backend, image=ref, ttl_s=600)
        parent.write_file("/workspace/kept.txt", b"pulled")
        ck = parent.checkpoint()
        time.sleep(1.1)  # a new pull would get a later creation time
        image("pull", ref)
        fork = c.create(checkpoint=ck, ttl_s=600)
        assert fork.read_file("/workspace/kept.txt") == b"pulled"
