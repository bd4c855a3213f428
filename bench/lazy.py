#!/usr/bin/env python3
"""Lazy images vs eager pull + unpack (issue 23): one run, side by side, per backend.

Usage (as root, after `scripts/setup.sh`; never in CI: it writes several GiB):

    .venv/bin/python bench/lazy.py [--binary target/release/sandlot] [--gib 1]
        [--backends function,container,microvm] [--concurrent 64] [--concurrent-vm 4]
        [--write BENCHMARKS.md]

What it does:
  1. Builds an image of about `--gib` GiB locally: the built-in busybox rootfs of the shared
     image store plus 16 files of random data under /data, as an OCI image layout; imports
     it (`sandlot image import`), converts it (`sandlot image convert`, pushes REPO:TAG-lazy)
     and copies the plain image to the same registry (`skopeo copy`). The registry is its
     own (scripts/registry.sh on a free port, storage in the bench's temp dir).
  2. Per backend and mode (lazy, eager) a fresh `sandlot up` with an empty image store:
     - cold: `sandlot image pull [--eager] REF` + create + first exec result of the task
       (sha256 of the first 3 MiB of each of the 16 files: about 5 % of the image);
     - warm: 3 more creates + task on the same node (chunks cached / layers unpacked),
       median;
     - disk written: growth of the image store after the cold start (blobs, layers,
       chunks), plus for microvm its image disks (`DATA/microvm/images`: the eager EROFS
       conversion; a lazy image's EROFS disk is a FUSE mount there, its chunks are in the
       store);
     - bytes fetched: lazy, `sandlot_image_bytes_fetched_total{tier="registry"}`; eager,
       the blobs pulled;
     - read throughput once cached: page cache dropped (`echo 3 > drop_caches`), then
       `cat` of one whole 1/16 file in a warm sandbox (one exec, its round trip
       included), median of 3 (microvm: the guest's own page cache is not dropped).
  3. Per backend and mode, concurrent cold starts on another fresh `sandlot up`:
     `sandlot image pull [--eager] REF`, then `--concurrent` sandboxes (default 64;
     `--concurrent-vm`, default 4, for microvm and vm: QEMU on TCG here) created in one
     batch call and the task's reads (without the hashing: `wc -c` of the same bytes)
     run in all of them at once; time until the last result, and
     bytes fetched (lazy: from the registry, to compare with one cold start's: each chunk
     once; eager: the blobs pulled).
  Every temp dir, registry and server is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "sdk" / "python"))
import run as R  # noqa: E402
import sandlot  # noqa: E402

MIB = 1 << 20
N_FILES = 16
READ_MIB = 3
TASK = ("for f in /data/f*; do head -c %d $f | sha256sum; done | sha256sum" % (READ_MIB * MIB))
# The concurrent starts read the same bytes without hashing them: N sandboxes hashing
# 48 MiB each would measure this host's CPU, not the image's loading.
READ_TASK = ("for f in /data/f*; do head -c %d $f; done | wc -c" % (READ_MIB * MIB))


def sh(*cmd, env=None, timeout=3600) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    if r.returncode != 0:
        raise SystemExit(f"bench: {' '.join(map(str, cmd))} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def du(p: Path) -> int:
    if not p.exists():
        return 0
    # A chunk's temp file may vanish while du walks (a fetch finishing): du then exits 1
    # but still prints the total of what it found.
    r = subprocess.run(["du", "-sbx", "--apparent-size", str(p)], capture_output=True, text=True)
    if r.returncode not in (0, 1) or not r.stdout.strip():
        raise SystemExit(f"bench: du {p} failed:\n{r.stderr}")
    return int(r.stdout.split()[0])


def build_image(tmp: Path, gib: float, busybox_rootfs: Path) -> tuple[Path, int]:
    """OCI layout with two uncompressed layers: busybox rootfs, /data/f00..f15 random."""
    import hashlib
    file_bytes = int(gib * (1 << 30)) // N_FILES // MIB * MIB
    blobs = tmp / "oci" / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put_file(path: Path) -> dict:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while b := f.read(MIB):
                h.update(b)
        d = h.hexdigest()
        size = path.stat().st_size
        path.rename(blobs / d)
        return {"digest": f"sha256:{d}", "size": size,
                "mediaType": "application/vnd.oci.image.layer.v1.tar"}

    def put(b: bytes, mt: str) -> dict:
        d = hashlib.sha256(b).hexdigest()
        (blobs / d).write_bytes(b)
        return {"digest": f"sha256:{d}", "size": len(b), "mediaType": mt}

    l1 = tmp / "l1.tar"
    with tarfile.open(l1, "w", format=tarfile.PAX_FORMAT) as t:
        for p in sorted(busybox_rootfs.rglob("*")):
            t.add(p, arcname=str(p.relative_to(busybox_rootfs)), recursive=False)
    l2 = tmp / "l2.tar"
    with tarfile.open(l2, "w", format=tarfile.PAX_FORMAT) as t:
        d = tarfile.TarInfo("data")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        t.addfile(d)
        for i in range(N_FILES):
            src = tmp / "rnd"
            with open(src, "wb") as f:
                for _ in range(file_bytes // MIB):
                    f.write(os.urandom(MIB))
            t.add(src, arcname=f"data/f{i:02}")
            src.unlink()
    layers = [put_file(l1), put_file(l2)]
    cfg = json.dumps({"architecture": "amd64", "os": "linux",
                      "config": {"Env": ["PATH=/bin:/usr/bin"]},
                      "rootfs": {"type": "layers",
                                 "diff_ids": [x["digest"] for x in layers]}}).encode()
    man = json.dumps({"schemaVersion": 2,
                      "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": put(cfg, "application/vnd.oci.image.config.v1+json"),
                      "layers": layers}).encode()
    m = put(man, "application/vnd.oci.image.manifest.v1+json")
    (tmp / "oci" / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (tmp / "oci" / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        dict(m, annotations={"org.opencontainers.image.ref.name": "v1"})]}))
    return tmp / "oci", sum(x["size"] for x in layers)


def registry_bytes(url: str) -> int:
    import httpx
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('sandlot_image_bytes_fetched_total{tier="registry"}'):
            return int(float(line.split()[-1]))
    return 0


def one_start(c, backend: str, ref: str) -> tuple:
    t = time.monotonic()
    box = c.create(backend=backend, image=ref, memory_mib=256, ttl_s=900)
    r = box.exec(["sh", "-c", TASK], timeout_s=600)
    took = time.monotonic() - t
    if r.exit_code != 0:
        raise SystemExit(f"bench: task failed on {backend}: {r}")
    return took, box, r.stdout


def stop_and_unmount(srv, images: Path) -> None:
    """Stop the node, unmount its image store's lazy mounts and microvm/vm's lazy disk
    mounts in its data dir (the daemons outlive a node by design), remove both dirs."""
    srv.stop()
    mps = [ln.split()[4] for ln in open("/proc/self/mountinfo")
           if str(images) in ln or str(srv.tmp) in ln]
    for mp in mps:
        subprocess.run(["umount", "-l", mp], check=False)
    srv.cleanup_dir()
    shutil.rmtree(images, ignore_errors=True)


def run_mode(binary: Path, tmp: Path, backend: str, mode: str, ref: str) -> dict:
    images = tmp / f"images-{backend}-{mode}"
    images.mkdir()
    # The guest kit stays the shared one (it lies beside the default image store).
    env = {"SANDLOT_GUEST_KIT_DIR": os.environ.get("SANDLOT_GUEST_KIT_DIR",
                                                   "/var/lib/sandlot/guest-kit")}
    shutil.copytree("/var/lib/sandlot/images/busybox", images / "busybox", symlinks=True)
    srv = R.Server(binary, images, [], 60, tmp_parent="/var/tmp", env=env)
    srv.start()
    out: dict = {"backend": backend, "mode": mode}
    vm_disks = srv.tmp / "data" / backend / "images"
    try:
        c = sandlot.Client(srv.url)
        before = du(images) + du(vm_disks)
        t = time.monotonic()
        pull = sh(binary, "image", "pull", "--eager" if mode == "eager" else "--lazy", ref,
                  "--images-dir", images, "--data-dir", srv.tmp / "data")
        out["pull_s"] = time.monotonic() - t
        took, box, digest = one_start(c, backend, ref)
        out["cold_s"] = out["pull_s"] + took
        out["digest"] = digest.decode().strip()
        out["disk_bytes"] = du(images) + du(vm_disks) - before
        time.sleep(1.5)  # the lazy daemons write their counters each second
        out["fetched"] = registry_bytes(srv.url) if mode == "lazy" else du(images / "blobs")
        box.delete()
        warm = []
        last = None
        for _ in range(3):
            w, b, _ = one_start(c, backend, ref)
            warm.append(w)
            if last is not None:
                last.delete()
            last = b
        out["warm_s"] = statistics.median(warm)
        # Read throughput once cached: f15 read once (chunks on disk), then 3 times with the
        # page cache dropped before each; the median (one exec each: its round trip counts).
        last.exec(["sh", "-c", "cat /data/f15 > /dev/null"], timeout_s=600)
        size = int(last.exec(["stat", "-c", "%s", "/data/f15"]).stdout)
        reads = []
        for _ in range(3):
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
            t = time.monotonic()
            last.exec(["sh", "-c", "cat /data/f15 > /dev/null"], timeout_s=600)
            reads.append(size / MIB / (time.monotonic() - t))
        out["read_mib_s"] = statistics.median(reads)
        last.delete()
        c.close()
        out["pull_out"] = pull.strip()
    finally:
        stop_and_unmount(srv, images)
    return out


def run_concurrent(binary: Path, tmp: Path, backend: str, mode: str, ref: str, n: int) -> dict:
    """Pull + `n` creates in one batch + the task in all of them at once, on a fresh node."""
    import concurrent.futures
    images = tmp / f"images-{backend}-{mode}-x{n}"
    images.mkdir()
    env = {"SANDLOT_GUEST_KIT_DIR": os.environ.get("SANDLOT_GUEST_KIT_DIR",
                                                   "/var/lib/sandlot/guest-kit")}
    shutil.copytree("/var/lib/sandlot/images/busybox", images / "busybox", symlinks=True)
    srv = R.Server(binary, images, [], 60, tmp_parent="/var/tmp", env=env)
    srv.start()
    out: dict = {"backend": backend, "mode": mode, "n": n}
    try:
        c = sandlot.Client(srv.url, timeout=900)
        t = time.monotonic()
        sh(binary, "image", "pull", "--eager" if mode == "eager" else "--lazy", ref,
           "--images-dir", images, "--data-dir", srv.tmp / "data")
        res = c.create_many(n, backend=backend, image=ref, memory_mib=128, ttl_s=900)
        if res.errors:
            raise SystemExit(f"bench: {len(res.errors)} of {n} creates failed: {res.errors[:3]}")
        with concurrent.futures.ThreadPoolExecutor(n) as ex:
            outs = list(ex.map(lambda b: b.exec(["sh", "-c", READ_TASK], timeout_s=900),
                               res.sandboxes))
        out["all_s"] = time.monotonic() - t
        bad = [r for r in outs if r.exit_code != 0]
        if bad:
            raise SystemExit(f"bench: task failed in {len(bad)} of {n} sandboxes: {bad[0]}")
        out["counts"] = sorted({r.stdout.decode().strip() for r in outs})
        if out["counts"] != [str(N_FILES * READ_MIB * MIB)]:
            raise SystemExit(f"bench: the sandboxes read {out['counts']} bytes")
        time.sleep(1.5)  # the lazy daemons write their counters each second
        out["fetched"] = registry_bytes(srv.url) if mode == "lazy" else du(images / "blobs")
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda b: b.delete(), res.sandboxes))
        c.close()
    finally:
        stop_and_unmount(srv, images)
    return out


def render_concurrent(rows: list[dict], crows: list[dict]) -> list[str]:
    if not crows:
        return []
    one = {(r["backend"], r["mode"]): r for r in rows}
    lines = ["", "Concurrent cold starts (fresh node: `image pull` + N creates in one batch call "
             "+ the task's reads, without the hashing (`head -c` piped to `wc -c`), in all N at "
             "once; time until the last result; bytes fetched vs one cold start's; microvm and "
             "vm run fewer: QEMU on TCG here):", "",
             "| backend | mode | N | all done | per start | bytes fetched | vs one cold start |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in crows:
        single = one.get((r["backend"], r["mode"]), {}).get("fetched") or 0
        lines.append(f"| {r['backend']} | {r['mode']} | {r['n']} | {r['all_s']:.2f} s "
                     f"| {r['all_s'] / r['n'] * 1000:.0f} ms | {r['fetched'] / MIB:.1f} MiB "
                     f"| {r['fetched'] / max(single, 1):.2f}× |")
    by = {(r["backend"], r["mode"]): r for r in crows}
    ratios = []
    for b in sorted({r["backend"] for r in crows}):
        lz, eg = by.get((b, "lazy")), by.get((b, "eager"))
        if lz and eg:
            ratios.append(f"- {b}: {lz['n']} concurrent cold starts, eager / lazy time "
                          f"{eg['all_s'] / lz['all_s']:.2f}×")
    return lines + ([""] + ratios if ratios else [])


def render(meta: dict, rows: list[dict], image_bytes: int, cmd: str, gib: float,
           crows: list[dict] | None = None) -> str:
    when = _dt.datetime.now(_dt.timezone.utc)
    m = R.machine()
    lines = [f"## {when:%Y-%m-%d %H:%M} UTC — lazy images vs eager pull + unpack ({gib:g} GiB image)",
             "",
             f"Command: `{cmd}` (commit {m['commit']}). Machine: {m['nproc']} cores ({m['cpu']}), "
             f"{m['mem_gib']} GiB, kernel {m['kernel']}, load average at the end {m['loadavg']}. "
             f"Image: busybox rootfs + {N_FILES} files of random data, {image_bytes / MIB:.0f} MiB of "
             f"layers (uncompressed); the task reads the first {READ_MIB} MiB of each file "
             f"({100 * N_FILES * READ_MIB * MIB / image_bytes:.1f} %) and hashes it. Registry: "
             "`docker-registry` on loopback. Cold = `sandlot image pull` + create + first exec "
             "result; warm = create + first exec result on the same node afterwards (median of "
             "3); disk = growth of the node's image store after the cold start (`du -sbx`: FUSE mounts not counted); read = `cat` of a "
             "whole file after `drop_caches` (one exec, median of 3), its chunks/layer on the node's disk.",
             "",
             "| backend | mode | cold start | warm start | disk written | bytes fetched | read once cached |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['mode']} | {r['cold_s']:.2f} s | {r['warm_s'] * 1000:.0f} ms "
                     f"| {r['disk_bytes'] / MIB:.1f} MiB | {r['fetched'] / MIB:.1f} MiB "
                     f"| {r['read_mib_s']:.0f} MiB/s |")
    lines += ["", "Ratios (lazy / eager, same backend; targets from issue 23):", ""]
    by = {(r["backend"], r["mode"]): r for r in rows}
    for b in sorted({r["backend"] for r in rows}):
        lz, eg = by.get((b, "lazy")), by.get((b, "eager"))
        if not (lz and eg):
            continue
        lines.append(
            f"- {b}: cold start {eg['cold_s'] / lz['cold_s']:.1f}× faster lazy (target ≥ 5×); "
            f"warm start {lz['warm_s'] / eg['warm_s']:.2f}× (target ≤ 1.1×); disk written "
            f"{lz['disk_bytes'] / max(eg['disk_bytes'], 1):.3f}×; bytes fetched "
            f"{lz['fetched'] / max(eg['fetched'], 1):.3f}×; read once cached "
            f"{lz['read_mib_s'] / eg['read_mib_s']:.2f}× (target ≥ 0.8×)")
    lines += render_concurrent(rows, crows or [])
    same = {r["digest"] for r in rows}
    lines += ["", f"The task's output was identical in every row: {'yes' if len(same) == 1 else 'NO'}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default=str(REPO / "target" / "release" / "sandlot"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--backends", default="function,container")
    ap.add_argument("--concurrent", type=int, default=64,
                    help="concurrent cold starts per backend and mode (0: none)")
    ap.add_argument("--concurrent-vm", type=int, default=4,
                    help="as --concurrent for microvm and vm (QEMU on TCG here)")
    ap.add_argument("--write", help="upsert the section into this BENCHMARKS.md")
    a = ap.parse_args()
    binary = Path(a.binary).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="sandlot-bench-lazy.", dir="/var/tmp"))
    os.chmod(tmp, 0o711)
    addr = f"127.0.0.1:{R.free_loopback_port()}"
    renv = {"SANDLOT_REGISTRY_ADDR": addr, "SANDLOT_REGISTRY_DIR": str(tmp / "registry")}
    rows = []
    crows = []
    try:
        sh("bash", REPO / "scripts" / "registry.sh", "start", env=renv)
        t = time.monotonic()
        oci, image_bytes = build_image(tmp, a.gib, Path("/var/lib/sandlot/images/busybox/rootfs"))
        ref = f"{addr}/bench/lazy:v1"
        src = ["--images-dir", tmp / "src-images", "--data-dir", tmp / "src-data"]
        sh(binary, "image", "import", oci, "--name", ref, *src)
        sh(binary, "image", "convert", ref, *src)
        sh("skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{oci}:v1",
           f"docker://{ref}")
        shutil.rmtree(oci)
        shutil.rmtree(tmp / "src-images", ignore_errors=True)
        print(f"image built, converted and pushed in {time.monotonic() - t:.0f} s", flush=True)
        for backend in a.backends.split(","):
            for mode in ("lazy", "eager"):
                r = run_mode(binary, tmp, backend, mode, ref)
                print(json.dumps({k: v for k, v in r.items() if k != "pull_out"}), flush=True)
                rows.append(r)
            n = a.concurrent_vm if backend in ("microvm", "vm") else a.concurrent
            for mode in ("lazy", "eager") if n > 0 else ():
                r = run_concurrent(binary, tmp, backend, mode, ref, n)
                print(json.dumps(r), flush=True)
                crows.append(r)
    finally:
        subprocess.run(["bash", REPO / "scripts" / "registry.sh", "stop"],
                       env={**os.environ, **renv}, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    cmd = ".venv/bin/python bench/lazy.py " + " ".join(sys.argv[1:])
    body = render({}, rows, image_bytes, cmd.strip(), a.gib, crows)
    print(body)
    if a.write:
        p = Path(a.write)
        p.write_text(R.upsert_section(p.read_text() if p.exists() else "",
                                      f"{_dt.date.today()} lazy", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
