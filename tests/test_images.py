"""OCI images end to end: pull from the local registry (scripts/registry.sh, started and
filled by scripts/setup.sh), create sandboxes from pulled images through the SDK, and the
`sandlot image pull | ls | rm | gc` CLI on a store of its own.

Needs the registry on 127.0.0.1:5000 holding sandlot/python:latest and
sandlot/busybox:latest; skips with the reason when it is not there.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import sandlot
from conftest import IMAGES_DIR, scrape

REGISTRY = os.environ.get("SANDLOT_REGISTRY_ADDR", "127.0.0.1:5000")
PY_REF = f"{REGISTRY}/sandlot/python:latest"
BB_REF = f"{REGISTRY}/sandlot/busybox:latest"
ACCEPT = ", ".join([
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])


def registry_has(repo: str) -> bool:
    req = urllib.request.Request(f"http://{REGISTRY}/v2/{repo}/manifests/latest",
                                 headers={"Accept": ACCEPT}, method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def registry() -> str:
    try:
        urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=5).close()
    except (urllib.error.URLError, OSError) as e:
        pytest.skip(f"no registry on {REGISTRY} ({e}); run scripts/registry.sh start && "
                    f"scripts/registry.sh push (scripts/setup.sh does both)")
    for repo in ("sandlot/python", "sandlot/busybox"):
        if not registry_has(repo):
            pytest.skip(f"registry {REGISTRY} has no {repo}:latest; run scripts/registry.sh push")
    return REGISTRY


def cli(binary: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        pytest.fail(f"`sandlot {' '.join(args)}` exited {p.returncode}\n"
                    f"stdout: {p.stdout}\nstderr: {p.stderr}")
    return p


def test_create_from_registry_reference_pulls_on_first_use(binary, client, server, registry):
    # Start from "not in the store", so the create itself has to pull.
    cli(binary, "image", "rm", PY_REF, "--images-dir", IMAGES_DIR, check=False)
    with client.create(backend="function", image=PY_REF, memory_mib=128, ttl_s=300) as box:
        assert box.image == PY_REF
        r = box.exec(["python3", "-c", "print(2+2)"], timeout_s=60)
        assert (r.exit_code, r.stdout) == (0, b"4\n"), r
        # The image config's Env reached the process.
        r = box.exec(["sh", "-c", "echo $LANG"], timeout_s=30)
        assert r.stdout == b"C.UTF-8\n", r
        # The lower layers are read-only to the sandbox, its own writes land in its upper.
        r = box.exec(["sh", "-c", "echo x > /usr/bin/python3"], timeout_s=30)
        assert r.exit_code != 0
    # Cached now: listed under the reference, and a second create does not pull again.
    ls = cli(binary, "image", "ls", "--images-dir", IMAGES_DIR).stdout
    assert PY_REF in ls, ls
    with client.create(backend="function", image=PY_REF, memory_mib=128, ttl_s=120) as box:
        assert box.exec(["python3", "-c", "print(6*7)"], timeout_s=60).stdout == b"42\n"
    # The normalised form finds it too (tag `latest` implied).
    with client.create(backend="function", image=f"{registry}/sandlot/python",
                       memory_mib=128, ttl_s=120) as box:
        assert box.exec(["python3", "-V"], timeout_s=60).exit_code == 0


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_container_from_a_pulled_image(client, server, registry, runtime):
    """The pulled OCI image runs as a container too (its layers as the overlay's lower
    dirs), through the same SDK call with only `backend`/`runtime` changed."""
    health = client._request("GET", "/healthz").json()
    required = os.environ.get("SANDLOT_REQUIRE_BACKENDS", "").split(",")
    if health["backends"].get("container") != "ok" and not (
            "container" in required or f"container-{runtime}" in required):
        pytest.skip(f"container backend: {health['backends'].get('container')}")
    with client.create(backend="container", runtime=runtime, image=PY_REF, memory_mib=256,
                       ttl_s=120) as box:
        assert box.image == PY_REF
        r = box.exec(["python3", "-c", "print(2+2)"], timeout_s=60)
        assert (r.exit_code, r.stdout) == (0, b"4\n"), r
        r = box.exec(["sh", "-c", "echo $LANG"], timeout_s=30)
        assert r.stdout == b"C.UTF-8\n", r


def test_bad_and_disallowed_references(client, registry):
    with pytest.raises(sandlot.InvalidArgument):
        client.create(image="Bad/Ref:x")
    # Not in the store and not a registry the node may pull from on create: a clear 404.
    with pytest.raises(sandlot.NotFound) as e:
        client.create(image="registry.example.com/nothing:1")
    assert "sandlot image pull" in e.value.message
    # The loopback registry does not have it: 404 too.
    with pytest.raises(sandlot.NotFound):
        client.create(image=f"{registry}/sandlot/no-such-image:latest")


def test_cli_pull_ls_rm_gc(binary, registry, tmp_path):
    store = tmp_path / "images"
    d = ["--images-dir", str(store)]
    out = cli(binary, "image", "pull", BB_REF, *d)
    assert out.stdout.startswith(BB_REF + " "), out.stdout
    # Not a terminal: plain progress lines, no bar escapes.
    assert "download" in out.stderr and "\x1b[" not in out.stderr, out.stderr
    layers = store / "layers" / "sha256"
    blobs = store / "blobs" / "sha256"
    assert len(list(layers.iterdir())) == 1
    assert oct(layers.stat().st_mode & 0o777) == oct(0o700), "layers are root-only"
    # Pulled again unchanged: it keeps its creation time and so its version (a checkpoint
    # of a sandbox on it stays forkable, its microVM disk stays in use).
    listed = cli(binary, "image", "ls", *d).stdout
    time.sleep(1.1)
    cli(binary, "image", "pull", BB_REF, *d)
    assert cli(binary, "image", "ls", *d).stdout == listed
    # A second name for the same image: no new blob, no new layer.
    n_blobs = len(list(blobs.iterdir()))
    out = cli(binary, "image", "pull", BB_REF, "--name", "bb", *d)
    assert "already present" in out.stderr, out.stderr
    assert len(list(layers.iterdir())) == 1 and len(list(blobs.iterdir())) == n_blobs
    ls = cli(binary, "image", "ls", *d).stdout.splitlines()
    assert [line.split()[0] for line in ls[1:]] == sorted([BB_REF, "bb"]), ls
    # gc keeps everything an image references.
    assert "removed 0 blobs and 0 layers" in cli(binary, "image", "gc", *d).stdout
    cli(binary, "image", "rm", BB_REF, *d)
    assert "removed 0 blobs and 0 layers" in cli(binary, "image", "gc", *d).stdout
    cli(binary, "image", "rm", "bb", *d)
    out = cli(binary, "image", "gc", *d).stdout
    assert "and 1 layers" in out, out
    assert list(layers.iterdir()) == [] and list(blobs.iterdir()) == []
    # rm of an absent image is a clear error.
    p = cli(binary, "image", "rm", "bb", *d, check=False)
    assert p.returncode == 1 and "not found" in p.stderr


def test_import_of_a_skopeo_oci_archive(binary, registry, tmp_path):
    """`skopeo copy docker://... oci-archive:` output imports under the given name."""
    if subprocess.run(["which", "skopeo"], capture_output=True).returncode != 0:
        pytest.skip("skopeo not installed (scripts/setup.sh installs it)")
    archive = tmp_path / "bb.tar"
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                    f"docker://{BB_REF}", f"oci-archive:{archive}:latest"],
                   check=True, capture_output=True, timeout=300)
    store = tmp_path / "images"
    out = cli(binary, "image", "import", str(archive), "--name", "imported-bb",
              "--images-dir", str(store))
    assert out.stdout.startswith("imported-bb "), out.stdout
    meta = json.loads((store / "imported-bb" / "image.json").read_text())
    assert meta["source"]["kind"] == "archive" and len(meta["layers"]) == 1
    assert ["PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] in meta["env"]


def _layout_blob(root: Path, media: str, data: bytes) -> dict:
    import hashlib
    d = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / d).write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{d}", "size": len(data)}


def _tar(members: list, gz: bool = True) -> bytes:
    """members: (name, kind, data_or_target) with kind 'file' | 'dir' | 'tree' (a host dir)."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as t:
        for name, kind, payload in members:
            if kind == "tree":
                t.add(str(payload), arcname=name, recursive=True)
                continue
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                t.addfile(info)
            else:
                info.mode, info.size = 0o644, len(payload)
                t.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def test_whiteouts_and_opaque_dirs_work_in_a_sandbox(binary, client, server, tmp_path):
    """A two-layer image imported from an OCI layout: the upper layer's whiteout hides a file
    of the lower one and its opaque dir hides the lower dir's entries, inside a real
    function sandbox (overlayfs reads what the unpacker wrote)."""
    import gzip
    import hashlib
    busybox = Path(IMAGES_DIR) / "busybox" / "rootfs"
    if not busybox.is_dir():
        pytest.skip(f"no busybox image in {IMAGES_DIR} (sandlot image build busybox)")
    layout = tmp_path / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    l1 = _tar([(".", "tree", busybox), ("data", "dir", None), ("data/old", "file", b"o"),
               ("gone", "file", b"g"), ("kept", "file", b"k")])
    l2 = _tar([(".wh.gone", "file", b""), ("data", "dir", None),
               ("data/.wh..wh..opq", "file", b""), ("data/new", "file", b"n")])
    gzmt = "application/vnd.oci.image.layer.v1.tar+gzip"
    diff_ids = [f"sha256:{hashlib.sha256(gzip.decompress(x)).hexdigest()}" for x in (l1, l2)]
    layers = [_layout_blob(layout, gzmt, x) for x in (l1, l2)]
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/bin", "FROM_IMAGE=yes"]},
              "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cd = _layout_blob(layout, "application/vnd.oci.image.config.v1+json",
                      json.dumps(config).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": cd, "layers": layers}
    md = _layout_blob(layout, "application/vnd.oci.image.manifest.v1+json",
                      json.dumps(manifest).encode())
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [md]}))
    name = "e2e-whiteout-test"
    d = ["--images-dir", IMAGES_DIR]
    cli(binary, "image", "import", str(layout), "--name", name, *d)
    meta = json.loads((Path(IMAGES_DIR) / name / "image.json").read_text())
    layer_dirs = [Path(IMAGES_DIR) / rel for rel in meta["layers"]]
    try:
        with client.create(backend="function", image=name, memory_mib=64, ttl_s=120) as box:
            r = box.exec(["sh", "-c", "ls /data; test -e /gone && echo gone-visible; "
                                      "cat /kept; echo; echo $FROM_IMAGE"], timeout_s=30)
            assert (r.exit_code, r.stdout) == (0, b"new\nk\nyes\n"), r
            # Removing the image and collecting while the sandbox runs keeps its layers
            # (they are mounted), and the sandbox keeps working.
            cli(binary, "image", "rm", name, *d)
            out = cli(binary, "image", "gc", *d).stdout
            assert all(p.is_dir() for p in layer_dirs), out
            assert "kept 2 unreferenced layers or retired images still mounted" in out, out
            assert box.exec(["cat", "/kept"], timeout_s=30).stdout == b"k"
        # Sandbox gone: the next gc frees them.
        cli(binary, "image", "gc", *d)
        assert not any(p.exists() for p in layer_dirs)
    finally:
        cli(binary, "image", "rm", name, *d, check=False)


def test_pulls_are_counted_by_mode_and_outcome(binary, server, registry, tmp_path):
    """Every pull into a store is counted in its `stats/pulls.json`, whichever process made
    it, and the server's `/metrics` reads its store's counters at scrape; the process and
    host figures are there too."""
    own = tmp_path / "images"
    cli(binary, "image", "pull", "--eager", BB_REF, "--images-dir", str(own))
    missing = f"{registry}/sandlot/no-such-image:latest"
    assert cli(binary, "image", "pull", "--eager", missing, "--images-dir", str(own),
               check=False).returncode != 0
    stats = json.loads((own / "stats" / "pulls.json").read_text())
    assert stats["pulls"]["eager"] == {"ok": 1, "not_found": 1}, stats
    # A fresh store downloads every blob of the image: config + layers, at least 1 KiB.
    assert stats["blob_bytes"]["eager"] > 1024, stats

    before = scrape(server.url)
    ok = 'sandlot_image_pulls_total{mode="eager",outcome="ok"}'
    nf = 'sandlot_image_pulls_total{mode="eager",outcome="not_found"}'
    cli(binary, "image", "pull", "--eager", BB_REF, "--name", "pull-metrics-bb",
        "--images-dir", IMAGES_DIR)
    cli(binary, "image", "pull", "--eager", missing, "--images-dir", IMAGES_DIR, check=False)
    after = scrape(server.url)
    assert after[ok] == before.get(ok, 0) + 1, (before.get(ok), after[ok])
    assert after[nf] == before.get(nf, 0) + 1
    assert 'sandlot_image_pull_bytes_total{mode="eager"}' in after
    cli(binary, "image", "rm", "pull-metrics-bb", "--images-dir", IMAGES_DIR)

    assert after["process_cpu_seconds_total"] > 0
    assert after["process_resident_memory_bytes"] > 1 << 20
    assert after["process_open_fds"] > 0
    assert after["sandlot_host_cpus"] == os.cpu_count()
    total = after['sandlot_host_memory_bytes{kind="total"}']
    assert 0 < after['sandlot_host_memory_bytes{kind="available"}'] <= total
    assert after['sandlot_host_cpu_seconds_total{mode="idle"}'] > 0
    assert "sandlot_host_load1" in after
