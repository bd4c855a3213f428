"""The image disks of the QEMU backends are collected (issue 5, build items 3 and 4): the
EROFS disk a microVM boots and the qcow2 base of a `vm` are made once per image version
(`DATA/microvm/images/<key>.erofs`, `DATA/vm/images/<key>.qcow2`). Once the image is
rebuilt, the old version's disk stays while something still uses it — a paused microVM
(no QEMU, only its state), a `vm` checkpoint's qcow2 chain — and goes at the next
collection (node start, or the next conversion) after the last user.

One private `sandlot up` per backend, on a private image store with a built-in `busybox`
that the test rebuilds (`sandlot image build --force`); two boots per backend.
"""

from __future__ import annotations

import os
import uuid
from typing import Callable, Iterator, List, Tuple

import pytest

import sandlot
from conftest import Server, private_image_node

IMAGE = "busybox"
EXT = {"microvm": "erofs", "vm": "qcow2"}


@pytest.fixture(params=["microvm", "vm"])
def node(request, binary, log_dir, monkeypatch) -> Iterator[Tuple[Server, str, Callable[..., str]]]:
    backend = request.param
    if os.geteuid() != 0:
        pytest.skip(f"{backend} tests need root (cgroups, QEMU)")
    # No template boots in the background (each would be one more boot on this host).
    monkeypatch.setenv("SANDLOT_MICROVM_TEMPLATES", "0")
    with private_image_node(binary, log_dir / f"image-disks-{backend}.log", monkeypatch,
                            f"sandlot-disks-{backend}-") as (srv, image):
        with sandlot.Client(srv.url, timeout=60) as c:
            status = c._request("GET", "/healthz").json().get("backends", {}).get(backend)
        if status != "ok":
            pytest.skip(f"backend {backend} is not available here: {status}")
        yield srv, backend, image


def disks(srv: Server, backend: str) -> List[str]:
    return sorted(p.name for p in (srv.data_dir / backend / "images").iterdir())


def test_an_old_image_disk_lives_as_long_as_its_last_user(node):
    srv, backend, image = node
    c = sandlot.Client(srv.url, timeout=300)
    tag = uuid.uuid4().hex[:12]
    old_box = c.create(backend=backend, image=IMAGE, memory_mib=256, ttl_s=900,
                       labels={"disks": tag})
    [old] = disks(srv, backend)
    assert old.endswith("." + EXT[backend]), old
    # The user that outlives the old box's QEMU: a paused microVM is only files; a vm
    # checkpoint's chain names the old base as its backing file.
    ck = None
    if backend == "microvm":
        assert c.pause({"disks": tag}) == [old_box.id]
    else:
        old_box.write_file("/workspace/kept.txt", b"old image")
        ck = old_box.checkpoint()
        old_box.delete()

    image("build", IMAGE, "--force")
    new_box = c.create(backend=backend, image=IMAGE, memory_mib=256, ttl_s=900)
    # The new version's disk was made, and its collection kept the old one (in use).
    now = disks(srv, backend)
    assert old in now and len(now) == 2, now
    [new] = [d for d in now if d != old]

    if backend == "microvm":
        assert c.resume({"disks": tag}) == [old_box.id]
        assert old_box.exec("echo resumed").stdout == b"resumed\n"
        # Its checkpoint records the old version: a fork would lay it over the new disk.
        old_ck = old_box.checkpoint()
        with pytest.raises(sandlot.Conflict, match="take a new checkpoint"):
            c.create(checkpoint=old_ck, ttl_s=900)
        c.delete_checkpoint(old_ck)
        old_box.delete()
    else:
        # A vm fork reads the parent's own base (its chain), so the rebuild does not matter.
        fork = c.create(checkpoint=ck, ttl_s=900)
        assert fork.read_file("/workspace/kept.txt") == b"old image"
        fork.delete()
        c.delete_checkpoint(ck)
    c.close()

    # The last user is gone: the next collection (node start) removes the old disk only.
    srv.restart()
    assert disks(srv, backend) == [new], srv.log_tail()
    assert "unused image disk removed" in srv.log_path.read_text()
    with sandlot.Client(srv.url, timeout=300) as c:
        box = c.get(new_box.id)
        assert box.exec("echo still").stdout == b"still\n"
        box.delete()
        # A create after the collection boots from the kept disk; nothing is converted.
        again = c.create(backend=backend, image=IMAGE, memory_mib=256, ttl_s=900)
        assert again.exec("echo again").stdout == b"again\n"
        again.delete()
    assert disks(srv, backend) == [new]
