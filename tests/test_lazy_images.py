"""Lazy images (issue 23, first slice) end to end, with a real registry and real FUSE:
an image (the built-in busybox rootfs + 256 MiB of random files) is imported, converted
(`sandlot image convert`, pushed as REPO:TAG-lazy), pulled lazily into a fresh store, and a
function, a container, a microVM and a vm sandbox (when the host has the backend; they boot
from the image's lazily served EROFS and ext4 disks) read ~5 % of it: the bytes fetched
stay under 10 % of the image and the bytes read equal the originals. A lazy form converted
without the disks (an older Sandlot's: the test strips them from the manifest) still runs
on microvm and vm: their disks are then built eagerly, said so in the node's log. The registry stopped mid-read fails the
reading command with an I/O error within its timeout (the sandbox stays usable, reads work
again once the registry is back); a corrupted chunk of the disk cache is detected by its
digest and fetched again; after a kill -9 of the node the re-adopted sandbox keeps
reading.

A registry of its own (scripts/registry.sh on a free port, storage in a temp dir), so
stopping it never disturbs the shared one on :5000.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import sandlot
from conftest import REPO, free_port, private_image_node, scrape

MIB = 1 << 20
# 256 MiB of random files: a vm sandbox fetches about 16 chunks of its ext4 disk whatever
# the image's size (the kernel mounting it, the guest's first writes copying 64 KiB qcow2
# clusters, the online grow, busybox, the task's reads). Measured: 16 MiB of the 139 MiB
# disk (11.5 %) with 128 MiB of files, 16 MiB of 268 MiB (6.0 %) with 256 MiB; at the
# issue's 1 GiB it would be ~1.5 %.
N_FILES = 64
FILE_MIB = 4


def registry_sh(addr: str, rdir: Path, cmd: str) -> None:
    env = dict(os.environ, SANDLOT_REGISTRY_ADDR=addr, SANDLOT_REGISTRY_DIR=str(rdir))
    subprocess.run(["bash", str(REPO / "scripts" / "registry.sh"), cmd], env=env, check=True,
                   capture_output=True, timeout=60)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def tar_dir(root: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for p in sorted(root.rglob("*")):
            t.add(p, arcname=str(p.relative_to(root)), recursive=False)
    return buf.getvalue()


def tar_files(files: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        d = tarfile.TarInfo("data")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        t.addfile(d)
        for name, data in files.items():
            i = tarfile.TarInfo(f"data/{name}")
            i.size, i.mode = len(data), 0o644
            t.addfile(i, io.BytesIO(data))
    return buf.getvalue()


def oci_layout(out: Path, layers: list) -> None:
    """An OCI image layout (image-layout.md) with uncompressed `layers` (bottom first)."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(b: bytes) -> dict:
        (blobs / sha(b)).write_bytes(b)
        return {"digest": f"sha256:{sha(b)}", "size": len(b)}

    descs = [dict(put(l), mediaType="application/vnd.oci.image.layer.v1.tar") for l in layers]
    cfg = json.dumps({"architecture": "amd64", "os": "linux",
                      "config": {"Env": ["PATH=/bin:/usr/bin"]},
                      "rootfs": {"type": "layers",
                                 "diff_ids": [d["digest"] for d in descs]}}).encode()
    man = json.dumps({"schemaVersion": 2,
                      "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": dict(put(cfg),
                                     mediaType="application/vnd.oci.image.config.v1+json"),
                      "layers": descs}).encode()
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        dict(put(man), mediaType="application/vnd.oci.image.manifest.v1+json")]}))


def local_bytes(image, ref: str, what: str = "local") -> tuple:
    """(cached, total) bytes of `ref` from `image ls`: its layers' chunks (`local`), its
    EROFS disk's (`EROFS disk`) or its ext4 disk's (`ext4 disk`)."""
    for line in image("ls").splitlines():
        if line.startswith(ref + " ") or line.startswith(ref + ":"):
            m = re.search(what + r" (\d+)/(\d+) bytes", line)
            assert m, line
            return int(m.group(1)), int(m.group(2))
    raise AssertionError(f"{ref} not in `image ls`")


def microvm_checks(c, image, ref: str, want: dict, read: str, addr: str, rdir: Path,
                   data_dir: Path) -> None:
    """A microVM of the lazy image boots from its EROFS disk served by the FUSE daemon
    (QEMU opens the mounted file): the task's output equals the eager bytes and the disk
    chunks fetched stay under 10 % of the disk; with the registry stopped a read of an
    unfetched part fails with EIO in the guest (QEMU's `rerror=report`), the VM keeps
    answering and reads work again once the registry is back; paused, it resumes after
    the disk's daemon was killed (the resume mounts it again). Skipped (said so) without the
    backend."""
    status = c._request("GET", "/healthz").json().get("backends", {}).get("microvm")
    if status != "ok":
        print(f"microvm part skipped: backend microvm is not available here: {status}")
        return
    cached0, total = local_bytes(image, ref, "EROFS disk")
    assert cached0 == 0 and total >= N_FILES * FILE_MIB * MIB, (cached0, total)
    t = time.monotonic()
    with c.create(backend="microvm", image=ref, memory_mib=256, ttl_s=300,
                  labels={"lazy": "microvm"}) as box:
        r = box.exec(["sh", "-c", read.format(f="f03")], timeout_s=120)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f03"], r
        r = box.exec(["sh", "-c", "stat -c %s /data/f04"], timeout_s=60)
        assert r.exit_code == 0 and r.stdout == f"{FILE_MIB * MIB}\n".encode(), r
        cached, total = local_bytes(image, ref, "EROFS disk")
        print(f"microvm: create + task {time.monotonic() - t:.1f} s; EROFS disk fetched "
              f"{cached} of {total} bytes ({100 * cached / total:.1f} %)")
        assert 0 < cached <= total // 10, (cached, total)

        registry_sh(addr, rdir, "stop")
        try:
            t = time.monotonic()
            r = box.exec(["dd", "if=/data/f07", "of=/dev/null", "bs=1M", "skip=2",
                          "count=1"], timeout_s=60)
            took = time.monotonic() - t
            print(f"microvm: read with the registry down failed after {took:.1f} s: {r}")
            assert r.exit_code != 0 and b"Input/output error" in r.stderr, r
            assert took < 45, took
            r = box.exec(["sh", "-c", "echo alive"], timeout_s=30)
            assert r.stdout == b"alive\n", r
        finally:
            registry_sh(addr, rdir, "start")
        r = box.exec(["sh", "-c", "dd if=/data/f07 bs=1M skip=2 count=1 2>/dev/null"
                      " | sha256sum"], timeout_s=120)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f07@2"], r
        resume_after_daemon_kill(c, box, data_dir, "microvm")
        r = box.exec(["sh", "-c", read.format(f="f11")], timeout_s=120)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f11"], r


def backend_ok(c, backend: str) -> bool:
    """Whether the node has `backend`; says so when not."""
    status = c._request("GET", "/healthz").json().get("backends", {}).get(backend)
    if status != "ok":
        print(f"{backend} part skipped: backend {backend} is not available here: {status}")
    return status == "ok"


def lazy_disk_mount(data_dir: Path, backend: str) -> str:
    """The one FUSE mount point of a lazy image disk under the node's `backend` dir."""
    with open("/proc/self/mountinfo") as f:
        mps = [ln.split()[4] for ln in f if f" {data_dir}/{backend}/images/lazy-" in ln]
    assert len(mps) == 1, mps
    return mps[0]


def resume_after_daemon_kill(c, box, data_dir: Path, backend: str) -> None:
    """Pauses `box` (created with labels {"lazy": backend}; a QEMU backend saves its
    memory and stops QEMU), kill -9s the FUSE daemon serving its lazy disk (the mount is
    left dead: ENOTCONN) and resumes it: the resume mounts the disk again before QEMU
    reopens it."""
    assert c.pause({"lazy": backend}) == [box.id]
    mp = lazy_disk_mount(data_dir, backend)
    daemons = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and mp.encode() in (p / "cmdline").read_bytes().split(b"\0"):
                daemons.append(int(p.name))
        except OSError:
            pass  # exited meanwhile
    assert len(daemons) == 1, daemons
    os.kill(daemons[0], signal.SIGKILL)

    def dead() -> bool:
        try:
            os.statvfs(mp)  # a stat answers from FUSE's attribute cache
        except OSError as e:
            return e.errno == errno.ENOTCONN
        return False

    def holders() -> list:
        out = []
        for p in Path("/proc").iterdir():
            try:
                for fd in (p / "fd").iterdir():
                    t = os.readlink(fd)
                    if t.startswith(mp) or t == "/dev/fuse":
                        out.append((p.name, (p / "cmdline").read_bytes()[:80], t))
            except OSError:
                pass
        return out
    assert wait_for(dead), holders()
    assert c.resume({"lazy": backend}) == [box.id]
    assert lazy_disk_mount(data_dir, backend) == mp


def vm_checks(c, image, ref: str, want: dict, read: str, data_dir: Path) -> None:
    """A vm sandbox of the lazy image boots from a qcow2 layer backed by its raw ext4 disk
    served by the FUSE daemon: the task's output equals the eager bytes and the ext4 disk's
    chunks fetched (boot, the online grow, the task) stay under 10 % of the disk. The paused
    VM resumes after the disk's daemon was killed, and a fork of its checkpoint boots
    after the disk was unmounted (a host reboot): each mounts it again."""
    if not backend_ok(c, "vm"):
        return
    cached0, total = local_bytes(image, ref, "ext4 disk")
    assert cached0 == 0 and total >= N_FILES * FILE_MIB * MIB, (cached0, total)
    t = time.monotonic()
    with c.create(backend="vm", image=ref, memory_mib=256, ttl_s=600,
                  labels={"lazy": "vm"}) as box:
        r = box.exec(["sh", "-c", read.format(f="f08")], timeout_s=180)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f08"], r
        r = box.exec(["sh", "-c", "stat -c %s /data/f09 && echo w > /data/new && cat /data/new"],
                     timeout_s=60)
        assert r.exit_code == 0 and r.stdout == f"{FILE_MIB * MIB}\nw\n".encode(), r
        cached, total = local_bytes(image, ref, "ext4 disk")
        print(f"vm: create + task {time.monotonic() - t:.1f} s; ext4 disk fetched "
              f"{cached} of {total} bytes ({100 * cached / total:.1f} %)")
        assert 0 < cached <= total // 10, (cached, total)
        ck = box.checkpoint()
        resume_after_daemon_kill(c, box, data_dir, "vm")
        r = box.exec(["sh", "-c", "cat /data/new && " + read.format(f="f10")], timeout_s=180)
        assert r.exit_code == 0 and r.stdout.decode().split()[:2] == ["w", want["f10"]], r
    subprocess.run(["umount", lazy_disk_mount(data_dir, "vm")], check=True)
    try:
        with c.create(checkpoint=ck, memory_mib=256, ttl_s=600) as fork:
            r = fork.exec(["sh", "-c", "cat /data/new && " + read.format(f="f09")],
                          timeout_s=180)
            assert r.exit_code == 0, r
            assert r.stdout.decode().split()[:2] == ["w", want["f09"]], r
    finally:
        c.delete_checkpoint(ck)


def strip_disks(addr: str, repo: str, tag: str, new_tag: str) -> None:
    """Pushes `repo:new_tag-lazy`: the lazy manifest of `repo:tag` without its disks (the
    form an older Sandlot converted), through the registry's HTTP API (distribution spec:
    GET/PUT /v2/<name>/manifests/<reference>)."""
    import httpx
    mt = "application/vnd.oci.image.manifest.v1+json"
    url = f"http://{addr}/v2/{repo}/manifests"
    m = httpx.get(f"{url}/{tag}-lazy", headers={"Accept": mt}, timeout=30).json()
    keep, skip = [], False
    for l in m["layers"]:
        if skip:
            skip = False
            continue
        if "erofs-index" in l["mediaType"] or "ext4-index" in l["mediaType"]:
            skip = True  # and its data blob, next
            continue
        keep.append(l)
    assert len(keep) == len(m["layers"]) - 4, m["layers"]
    m["layers"] = keep
    r = httpx.put(f"{url}/{new_tag}-lazy", content=json.dumps(m).encode(),
                  headers={"Content-Type": mt}, timeout=30)
    assert r.status_code == 201, r.text


def fallback_checks(c, image, addr: str, want: dict, read: str, log: Path) -> None:
    """A lazy form without the EROFS and ext4 disks (as converted before they existed):
    a microVM and a vm of it still run the task with the right bytes, their disks built
    eagerly from the lazy layers (the node logs why), and `image ls` shows no disk."""
    backends = [b for b in ("microvm", "vm") if backend_ok(c, b)]
    if not backends:
        return
    strip_disks(addr, "sandlot-test/big", "v1", "old")
    ref = f"{addr}/sandlot-test/big:old"
    assert "(lazy)" in image("pull", ref)
    line = [l for l in image("ls").splitlines() if l.startswith(ref + " ")][0]
    assert "disk" not in line, line
    for backend in backends:
        t = time.monotonic()
        with c.create(backend=backend, image=ref, memory_mib=256, ttl_s=600) as box:
            r = box.exec(["sh", "-c", read.format(f="f10")], timeout_s=180)
            assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f10"], r
        print(f"{backend} fallback (eager disk of an old lazy form): create + task "
              f"{time.monotonic() - t:.1f} s")
    text = log.read_text(errors="replace")
    for backend, what in (("microvm", "without an EROFS disk"), ("vm", "without an ext4 disk")):
        if backend in backends:
            assert f"lazy image {what}" in text, f"no fallback log line for {backend}"


def kernel_has_fuse_passthrough() -> bool:
    """CONFIG_FUSE_PASSTHROUGH=y where /proc/config.gz says, else kernel >= 6.9."""
    import gzip
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return any(ln.strip() == "CONFIG_FUSE_PASSTHROUGH=y" for ln in f)
    except OSError:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
        return (major, minor) >= (6, 9)


def wait_for(cond, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def passthrough_checks(srv, box, store: Path, data: bytes) -> None:
    """/data/f03 (`data`) read whole: the node makes a verified complete copy of it in the
    chunk cache (named as fetch.rs's `file_key` says), and a later open reads it through
    FUSE passthrough (the kernel reads the copy: no daemon round trip); a copy corrupted
    in place is never served: the read goes through the chunks, and the copy is checked,
    removed and made again."""
    full = ["sh", "-c", "sha256sum /data/f03"]
    r = box.exec(full, timeout_s=60)
    assert r.exit_code == 0 and r.stdout.decode().split()[0] == sha(data), r
    text = "sandlot-lazy-file-v1\n%d\n" % len(data) + "".join(
        "sha256:%s\n" % sha(data[i:i + MIB]) for i in range(0, len(data), MIB))
    copy = store / "chunks" / "sha256" / sha(text.encode())
    assert wait_for(copy.is_file), f"no complete copy {copy}"
    assert wait_for(lambda: copy.read_bytes() == data)
    r = box.exec(full, timeout_s=60)
    assert r.exit_code == 0 and r.stdout.decode().split()[0] == sha(data), r
    if kernel_has_fuse_passthrough():
        assert wait_for(lambda: scrape(srv.url).get(
            "sandlot_image_passthrough_opens_total", 0) >= 1), scrape(srv.url)
        assert scrape(srv.url)["sandlot_image_complete_files_total"] >= 1
    else:
        print("this kernel has no FUSE passthrough: passthrough opens not checked")
    # The release of the last open (it ends the copy's use as a backing file) reaches
    # the daemon just after the reader exits: a copy changed while it is a backing file
    # is read as it is (docs/SECURITY.md "Lazy image chunks").
    time.sleep(1)
    bad = bytearray(data)
    bad[MIB + 5] ^= 0xFF
    copy.write_bytes(bytes(bad))
    r = box.exec(full, timeout_s=60)
    assert r.exit_code == 0 and r.stdout.decode().split()[0] == sha(data), r
    assert wait_for(lambda: copy.is_file() and copy.read_bytes() == data), \
        "the corrupted copy was not replaced"
    r = box.exec(full, timeout_s=60)
    assert r.exit_code == 0 and r.stdout.decode().split()[0] == sha(data), r


def lazy_checks(binary, srv, image, tmp_path: Path, addr: str, rdir: Path) -> None:
    """The checks of the module docstring on a private node `srv` (store base/images)."""
    base = srv.data_dir.parent
    store = base / "images"
    # The test image: busybox rootfs + 64 x 4 MiB random files + `dup`, one chunk
    # equal to f00's second MiB (same digest, another inode).
    rnd = {f"f{i:02}": os.urandom(FILE_MIB * MIB) for i in range(N_FILES)}
    rnd["dup"] = rnd["f00"][MIB:2 * MIB]
    oci = tmp_path / "oci"
    oci_layout(oci, [tar_dir(store / "busybox" / "rootfs"), tar_files(rnd)])
    ref = f"{addr}/sandlot-test/big:v1"
    src = base / "src-images"
    subprocess.run([str(binary), "image", "import", str(oci), "--name", ref,
                    "--data-dir", str(base / "image-data"), "--images-dir", str(src)],
                   check=True, capture_output=True, timeout=120)
    out = subprocess.run([str(binary), "image", "convert", ref,
                          "--data-dir", str(base / "image-data"),
                          "--images-dir", str(src)],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert f"{ref}-lazy" in out, out

    # Lazy pull into the node's (fresh) store: metadata only.
    assert "(lazy)" in image("pull", ref)
    cached, total = local_bytes(image, ref)
    assert cached == 0 and total >= N_FILES * FILE_MIB * MIB, (cached, total)


    c = sandlot.Client(srv.url)
    want = {f"f{i:02}": sha(rnd[f"f{i:02}"][MIB:2 * MIB]) for i in range(N_FILES)}
    read = "dd if=/data/{f} bs=1M skip=1 count=1 2>/dev/null | sha256sum"
    with c.create(backend="function", image=ref, memory_mib=128, ttl_s=300) as box:
        r = box.exec(["sh", "-c", read.format(f="f01")], timeout_s=60)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f01"], r
        r = box.exec(["sh", "-c", "ls -ln /data/f02 && stat -c %s /data/f03"],
                     timeout_s=30)
        assert r.exit_code == 0 and str(FILE_MIB * MIB) in r.stdout.decode(), r
        passthrough_checks(srv, box, store, rnd["f03"])
    microvm_checks(c, image, ref, dict(want, **{"f07@2": sha(rnd["f07"][2 * MIB:3 * MIB])}),
                   read, addr, rdir, srv.data_dir)
    vm_checks(c, image, ref, want, read, srv.data_dir)
    with c.create(backend="container", image=ref, memory_mib=128, ttl_s=300) as box:
        r = box.exec(["sh", "-c", read.format(f="f02")], timeout_s=60)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f02"], r

        # Corrupt the cached chunk f00[1 MiB..2 MiB) after reading it; `dup` has the
        # same chunk: it is read from the disk cache, fails its digest, is refetched.
        r = box.exec(["sh", "-c", read.format(f="f00")], timeout_s=60)
        assert r.stdout.decode().split()[0] == want["f00"], r
        chunk = store / "chunks" / "sha256" / want["f00"]
        assert chunk.is_file()
        chunk.write_bytes(b"x" * MIB)
        r = box.exec(["sh", "-c", "sha256sum /data/dup"], timeout_s=60)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f00"], r
        assert sha(chunk.read_bytes()) == want["f00"]

        # Kernel readahead fetches the chunk after each one read, and every command maps
        # the busybox binary: still well under 10 %.
        cached, total = local_bytes(image, ref)
        print(f"fetched {cached} of {total} bytes ({100 * cached / total:.1f} %)")
        assert 0 < cached <= total // 10, (cached, total)

        # Registry down: a read of an unfetched chunk fails with EIO within its
        # timeout; the sandbox still answers; reads work again after a restart.
        registry_sh(addr, rdir, "stop")
        t = time.monotonic()
        r = box.exec(["dd", "if=/data/f05", "of=/dev/null", "bs=1M", "skip=1",
                          "count=1"], timeout_s=60)
        assert time.monotonic() - t < 30
        assert r.exit_code != 0 and b"Input/output error" in r.stderr, r
        r = box.exec(["sh", "-c", "echo alive"], timeout_s=30)
        assert r.stdout == b"alive\n", r
        registry_sh(addr, rdir, "start")
        r = box.exec(["sh", "-c", read.format(f="f05")], timeout_s=60)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f05"], r

        # kill -9 of the node: the lazy daemons run in sessions of their own, so the
        # re-adopted sandbox keeps reading chunks it never read before.
        srv.kill()
        srv.start()
        r = box.exec(["sh", "-c", read.format(f="f06")], timeout_s=60)
        assert r.exit_code == 0 and r.stdout.decode().split()[0] == want["f06"], r
    fallback_checks(c, image, addr, want, read, srv.log_path)
    c.close()


def unmount_lazy(base: Path) -> None:
    """The lazy daemons outlive the node by design: unmount the mounts under `base`
    (their daemons then exit)."""
    with open("/proc/self/mountinfo") as f:
        mps = [ln.split()[4] for ln in f if f" {base}/images/lazy/mnt/" in ln
               or (f" {base}/" in ln and "/images/lazy-" in ln)]
    for mp in mps:
        subprocess.run(["umount", "-l", mp], check=False)


def test_lazy_pull_reads_on_demand(binary, tmp_path, log_dir, monkeypatch):
    t0 = time.monotonic()
    addr = f"127.0.0.1:{free_port()}"
    rdir = tmp_path / "registry"
    registry_sh(addr, rdir, "start")
    # Short fetch timeouts so the registry-down case ends fast (the daemons inherit them).
    monkeypatch.setenv("SANDLOT_LAZY_FETCH_TIMEOUT_MS", "1500")
    monkeypatch.setenv("SANDLOT_LAZY_FETCH_ATTEMPTS", "2")
    # No memory tier: the corrupted-cache check needs the chunk read from disk again.
    monkeypatch.setenv("SANDLOT_LAZY_MEMORY_CHUNKS", "0")
    try:
        with private_image_node(binary, log_dir / "lazy-node.log", monkeypatch,
                                "sandlot-lazy-") as (srv, image):
            try:
                lazy_checks(binary, srv, image, tmp_path, addr, rdir)
            finally:
                srv.delete_all()
                unmount_lazy(srv.data_dir.parent)
    finally:
        registry_sh(addr, rdir, "stop")
    print(f"lazy test took {time.monotonic() - t0:.1f} s")


class RangeProxy:
    """A small HTTP proxy in front of the test registry (GET/HEAD only: pulls and chunk
    fetches go through it, pushes go to the registry itself). It counts the ranged blob
    GETs (the chunk fetches) per (blob, Range), and corrupts answers on request: a body
    whose SHA-256 is in `corrupt` (hex → how many more times) goes out with one byte
    flipped, as a broken shared store would serve it."""

    def __init__(self, upstream: str):
        import http.client
        import http.server
        import threading
        self.ranges: dict = {}
        self.corrupt: dict = {}
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def forward(self, body: bool):
                host, port = upstream.rsplit(":", 1)
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                hdrs = {k: v for k, v in self.headers.items()
                        if k.lower() in ("range", "accept", "authorization")}
                try:
                    conn.request(self.command, self.path, headers=hdrs)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:
                    self.send_error(502)
                    return
                finally:
                    conn.close()
                rng = self.headers.get("Range")
                if rng and "/blobs/" in self.path:
                    with proxy.lock:
                        k = (self.path.rsplit("/", 1)[-1], rng)
                        proxy.ranges[k] = proxy.ranges.get(k, 0) + 1
                        h = sha(data)
                        if proxy.corrupt.get(h, 0) > 0:
                            proxy.corrupt[h] -= 1
                            data = bytes([data[0] ^ 0xFF]) + data[1:]
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "connection",
                                         "transfer-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_GET(self):
                self.forward(True)

            def do_HEAD(self):
                self.forward(False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def push_lazy(binary, base: Path, oci: Path, ref: str, files: dict) -> None:
    """Build an image of busybox (from the private store under `base`) + `files` in /data
    as an OCI layout at `oci`, import it as `ref` into a store of its own and convert it
    (pushes `ref` and its lazy form to the registry)."""
    oci_layout(oci, [tar_dir(base / "images" / "busybox" / "rootfs"), tar_files(files)])
    for cmd in (["import", str(oci), "--name", ref], ["convert", ref]):
        subprocess.run([str(binary), "image", *cmd, "--data-dir", str(base / "image-data"),
                        "--images-dir", str(base / "src-images")], check=True,
                       capture_output=True, timeout=120)


def scale_checks(binary, srv, image, tmp_path: Path, addr: str, n_boxes: int) -> None:
    """Steps 2-4 of the issue's second slice on a private node `srv` whose disk chunk
    cache is capped at CAP_MIB: `n_boxes` sandboxes of one cold lazy image created at once
    read the same files, every chunk is fetched once; corrupted registry answers are never
    served; the cache stays under its cap, evicting, with every read still correct."""
    import concurrent.futures
    base = srv.data_dir.parent
    store = base / "images"
    rnd = {f"g{i:02}": os.urandom(2 * MIB) for i in range(12)}
    push_lazy(binary, base, tmp_path / "oci-scale", f"{addr}/sandlot-test/scale:v1", rnd)
    proxy = RangeProxy(addr)
    try:
        pref = f"{proxy.addr}/sandlot-test/scale:v1"
        c = sandlot.Client(srv.url)
        want = {k: sha(v) for k, v in rnd.items()}

        # n_boxes sandboxes at once of an image the node has not pulled (one batch: the
        # server creates them concurrently; the first pulls the lazy form, the mounts
        # race), then all read g00 and g01 at once.
        t = time.monotonic()
        res = c.create_many(n_boxes, backend="function", image=pref, memory_mib=64,
                            ttl_s=300)
        assert not res.errors, res.errors[:3]
        boxes = res.sandboxes
        cmd = ["sh", "-c", "sha256sum /data/g00 /data/g01"]
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            outs = list(ex.map(lambda b: b.exec(cmd, timeout_s=120), boxes))
        print(f"{n_boxes} cold creates + reads: {time.monotonic() - t:.1f} s")
        assert f"lazy {pref}" in image("ls"), image("ls")
        for r in outs:
            got = dict(reversed(l.split()) for l in r.stdout.decode().splitlines())
            assert r.exit_code == 0 and got == {"/data/g00": want["g00"],
                                                "/data/g01": want["g01"]}, r
        counts = dict(proxy.ranges)
        assert counts and all(n == 1 for n in counts.values()), counts
        fetched = sum(int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1
                      for (_, r) in counts)
        # The daemons' counters agree (written to their stats files each second).
        deadline = time.monotonic() + 10
        while True:
            m = scrape(srv.url)
            if m.get("sandlot_image_chunk_cache_misses_total") == len(counts) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert m["sandlot_image_chunk_cache_misses_total"] == len(counts), m
        assert m['sandlot_image_bytes_fetched_total{tier="registry"}'] == fetched, m
        assert m["sandlot_image_chunk_fetch_seconds_count"] == len(counts), m
        assert 0 < m["sandlot_image_chunk_cache_hit_ratio"] <= 1, m
        for b in boxes[1:]:
            b.delete()
        box = boxes[0]

        # A corrupted answer of the shared store: once → refetched, right bytes; always
        # → EIO, never wrong bytes, and the sandbox stays usable.
        read = "dd if=/data/{f} bs=1M skip=1 count=1 2>/dev/null | sha256sum"
        proxy.corrupt[sha(rnd["g02"][MIB:])] = 1
        r = box.exec(["sh", "-c", read.format(f="g02")], timeout_s=60)
        assert r.stdout.decode().split()[0] == sha(rnd["g02"][MIB:]), r
        proxy.corrupt[sha(rnd["g03"][MIB:])] = 1000
        r = box.exec(["dd", "if=/data/g03", "of=/dev/null", "bs=1M", "skip=1", "count=1"],
                     timeout_s=60)
        assert r.exit_code != 0 and b"Input/output error" in r.stderr, r
        assert not (store / "chunks" / "sha256" / sha(rnd["g03"][MIB:])).exists()
        proxy.corrupt.clear()
        r = box.exec(["sh", "-c", read.format(f="g03")], timeout_s=60)
        assert r.stdout.decode().split()[0] == sha(rnd["g03"][MIB:]), r

        # Read everything: 24 MiB through a cache capped at CAP_MIB: evictions, the
        # cache stays under its cap, every byte right.
        r = box.exec(["sh", "-c", "sha256sum /data/g*"], timeout_s=120)
        got = {l.split()[1][len("/data/"):]: l.split()[0]
               for l in r.stdout.decode().splitlines()}
        assert r.exit_code == 0 and got == want, r
        # Chunk files and complete-file copies (made in the background once all of a
        # file's chunks are cached, for passthrough) share the cache and its cap; wait
        # until the accounting and the directory agree (copies being made).
        chunks = store / "chunks" / "sha256"
        deadline = time.monotonic() + 15
        while True:
            time.sleep(1.5)
            on_disk = sum(p.stat().st_size for p in chunks.iterdir() if len(p.name) == 64)
            m = scrape(srv.url)
            if m["sandlot_image_cache_bytes"] == on_disk or time.monotonic() > deadline:
                break
        assert on_disk <= CAP_MIB * MIB, on_disk
        assert m["sandlot_image_chunk_evictions_total"] > 0, m
        assert m['sandlot_image_chunk_corrupt_total{tier="registry"}'] >= 2, m
        assert m["sandlot_image_chunk_fetch_failures_total"] >= 1, m
        assert m["sandlot_image_cache_limit_bytes"] == CAP_MIB * MIB, m
        assert m["sandlot_image_cache_bytes"] == on_disk, (m, on_disk)
        cached, total = local_bytes(image, pref)
        assert 0 < cached <= CAP_MIB * MIB and total >= 24 * MIB, (cached, total)
        box.delete()
        c.close()
    finally:
        proxy.close()


CAP_MIB = 12


def test_lazy_scale_corruption_and_cache_cap(binary, tmp_path, log_dir, monkeypatch):
    t0 = time.monotonic()
    n_boxes = int(os.environ.get("SANDLOT_TEST_LAZY_BOXES", "64"))
    addr = f"127.0.0.1:{free_port()}"
    rdir = tmp_path / "registry"
    registry_sh(addr, rdir, "start")
    monkeypatch.setenv("SANDLOT_LAZY_FETCH_TIMEOUT_MS", "3000")
    monkeypatch.setenv("SANDLOT_LAZY_FETCH_ATTEMPTS", "2")
    monkeypatch.setenv("SANDLOT_IMAGE_CACHE_MIB", str(CAP_MIB))
    try:
        with private_image_node(binary, log_dir / "lazy-scale-node.log", monkeypatch,
                                "sandlot-lazy-scale-") as (srv, image):
            try:
                scale_checks(binary, srv, image, tmp_path, addr, n_boxes)
            finally:
                srv.delete_all()
                unmount_lazy(srv.data_dir.parent)
    finally:
        registry_sh(addr, rdir, "stop")
    print(f"lazy scale test ({n_boxes} sandboxes) took {time.monotonic() - t0:.1f} s")


def test_prefetch_trace_fetches_ahead_on_the_next_mount(binary, tmp_path, log_dir,
                                                        monkeypatch):
    """Issue 23 item 4: the chunks a lazy layer served in the first seconds after its
    first read (a 5 s window here) are written as its prefetch trace; the next mount of the
    layer on the node (here after its mounts were taken down and its chunk cache emptied)
    fetches them ahead before any read, each once, so the next sandbox's same reads fetch
    nothing, and read the right bytes."""
    addr = f"127.0.0.1:{free_port()}"
    rdir = tmp_path / "registry"
    registry_sh(addr, rdir, "start")
    monkeypatch.setenv("SANDLOT_LAZY_TRACE_S", "5")
    try:
        with private_image_node(binary, log_dir / "lazy-trace-node.log", monkeypatch,
                                "sandlot-lazy-trace-") as (srv, image):
            base = srv.data_dir.parent
            store = base / "images"
            try:
                rnd = {f"t{i}": os.urandom(3 * MIB) for i in range(4)}
                push_lazy(binary, base, tmp_path / "oci-trace",
                          f"{addr}/sandlot-test/trace:v1", rnd)
                proxy = RangeProxy(addr)
                try:
                    pref = f"{proxy.addr}/sandlot-test/trace:v1"
                    c = sandlot.Client(srv.url)
                    read = ["sh", "-c", "head -c 2097152 /data/t1 | sha256sum"]
                    want = sha(rnd["t1"][:2 * MIB])
                    box = c.create(backend="function", image=pref, memory_mib=64, ttl_s=300)
                    r = box.exec(read, timeout_s=60)
                    assert r.exit_code == 0 and r.stdout.decode().split()[0] == want, r
                    assert proxy.ranges, "the first read fetched nothing"
                    traces = store / "lazy" / "traces"
                    deadline = time.monotonic() + 20
                    while len(list(traces.glob("*.json"))) < 2 \
                            and time.monotonic() < deadline:
                        time.sleep(0.3)
                    # One trace per layer (busybox and the data files).
                    assert len(list(traces.glob("*.json"))) == 2, list(traces.iterdir())
                    box.delete()

                    # The layers' mounts go (their daemons exit) and the chunk cache is
                    # emptied: the next create mounts them again and prefetches.
                    unmount_lazy(base)
                    for p in (store / "chunks" / "sha256").iterdir():
                        p.unlink()
                    proxy.ranges.clear()
                    box = c.create(backend="function", image=pref, memory_mib=64, ttl_s=300)
                    deadline = time.monotonic() + 20
                    seen = -1
                    while time.monotonic() < deadline:
                        n = len(proxy.ranges)
                        if n == seen and n > 0:
                            break
                        seen = n
                        time.sleep(1.0)
                    ahead = dict(proxy.ranges)
                    assert ahead and all(v == 1 for v in ahead.values()), ahead
                    r = box.exec(read, timeout_s=60)
                    assert r.exit_code == 0 and r.stdout.decode().split()[0] == want, r
                    assert dict(proxy.ranges) == ahead, "the traced read fetched again"
                    box.delete()
                    c.close()
                finally:
                    proxy.close()
            finally:
                srv.delete_all()
                unmount_lazy(base)
    finally:
        registry_sh(addr, rdir, "stop")
