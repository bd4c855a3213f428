"""Cross-node resume (issue 22 item 4, must-show 2; docs/operations.md "Cross-node resume"):
a paused microVM (and a paused q35 `vm`, whose disk is a qcow2 chain over the image's base
disk) with a running background process, its node killed (-9), resumed through the API on
the other node from the shared snapshot store: same id, the process still runs (it keeps
appending to its file after the resume), and the files written before the pause (disk and
guest RAM) are there. Each test first restarts a node an earlier test killed
(`cluster.sh node-start`), so both nodes are up.

`scripts/cluster.sh up DIR 2` gives 3 etcd members, one `sandlot server --etcd` and two
`sandlot node --etcd --snapshot-dir DIR/snapshots`, each node in its own network namespace
(the shared directory stands for an NFS mount). Short leases keep the file within its CI
budget; (micro)VMs run under TCG here. Needs root, etcd and the microvm backend; else skipped
with the reason.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

import sandlot
from conftest import IMAGES_DIR, wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "cluster.sh")
LEASE_TTL_S = 3
LOOP = ("i=0; while :; do i=$((i+1)); echo $i >> /workspace/ticks; sleep 0.2; done")


@pytest.fixture(scope="module")
def cluster(binary, log_dir):
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network namespaces, QEMU jails)")
    if shutil.which("etcd") is None:
        pytest.skip("no etcd (scripts/setup.sh installs Debian's etcd-server)")
    d = Path(f"/var/tmp/sandlot-clresume-{os.getpid()}")
    env = dict(os.environ, SANDLOT_BIN=str(Path(binary).resolve()), SANDLOT_IMAGES_DIR=IMAGES_DIR,
               # No template snapshot built in the background: it would take the CPU the
               # test's two TCG guests need.
               SANDLOT_MICROVM_TEMPLATES="0",
               SANDLOT_CLUSTER_NODE_ARGS=f"--lease-ttl-s {LEASE_TTL_S} --warm-pool 0 "
                                         "--container-warm-pool 0")
    up = subprocess.run([SCRIPT, "up", str(d), "2"], capture_output=True, text=True,
                        timeout=300, env=env)
    try:
        assert up.returncode == 0, up.stderr + "\n" + up.stdout
        lines = up.stdout.splitlines()
        server = next(ln.split()[1] for ln in lines if ln.startswith("server "))
        nodes = [ln.split()[1] for ln in lines if ln.startswith("node ")]
        assert len(nodes) == 2, lines
        yield d, server
    finally:
        subprocess.run([SCRIPT, "down", str(d)], capture_output=True, text=True, timeout=300,
                       env=env)
        for log in d.glob("*.log"):
            shutil.copy(log, log_dir / f"clresume-{log.name}")
        shutil.rmtree(d, ignore_errors=True)


def ticks(box) -> int:
    return len(box.read_file("/workspace/ticks").split())


def nodes_up(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/nodes", timeout=5) as r:
        return [n["name"] for n in json.load(r)["nodes"]]


def restart_killed_nodes(d: Path, url: str) -> None:
    """Starts again the nodes an earlier test killed, and waits until they are registered."""
    for i in range(2):
        name = f"node{i}"
        pid = int((d / f"{name}.pid").read_text())
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        r = subprocess.run([SCRIPT, "node-start", str(d), str(i)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr + "\n" + r.stdout
        wait_for(lambda: name in nodes_up(url), 30, f"{name} to rejoin the cluster")


def resume_on_another_node(cluster, backend: str, timeout: float) -> None:
    """The shared body: create `backend` sandbox, a background loop, a file on disk and one
    in guest RAM; pause (to the shared store); kill its node; resume by label elsewhere;
    the loop is listed there under its old handle and killed through it."""
    d, url = cluster
    c = sandlot.Client(url, timeout=timeout, retries=0)
    status = c._request("GET", "/healthz").json().get("backends", {}).get(backend)
    if status != "ok":
        pytest.skip(f"backend {backend} is not available on the cluster: {status}")
    restart_killed_nodes(d, url)
    tag = uuid.uuid4().hex[:12]
    t0 = time.monotonic()
    box = c.create(backend=backend, image="python", memory_mib=256, ttl_s=900,
                   labels={"xresume": tag})
    print(f"{backend} create: {time.monotonic() - t0:.1f} s on {box.node}")
    victim = box.node
    r = box.exec("echo in-memory > /dev/shm/m && echo on-disk > /workspace/before.txt && sync")
    assert r.exit_code == 0, r
    proc = box.spawn(["sh", "-c", LOOP], timeout_s=900)
    wait_for(lambda: ticks(box) >= 3, 60, "the background loop to tick")

    t0 = time.monotonic()
    assert c.pause({"xresume": tag}) == [box.id]
    print(f"{backend} pause (to the shared store): {time.monotonic() - t0:.1f} s")
    snap = d / "snapshots" / "sandboxes" / box.id
    manifest = json.loads((snap / "snapshot.json").read_text())
    assert manifest["node"] == victim and manifest["backend"] == backend, manifest
    assert (snap / "memory.state").stat().st_size > 1 << 20
    if backend == "vm":
        # The sandbox's own qcow2 layers, the bottom one backed by the store's copy of the
        # image's base disk (not the source node's data dir).
        assert manifest["layers"] and all((snap / n).is_file() for n in manifest["layers"])
        info = subprocess.run(["qemu-img", "info", "-U", "--output=json",
                               str(snap / manifest["layers"][-1])],
                              capture_output=True, text=True, check=True)
        base = json.loads(info.stdout)["backing-filename"]
        assert base.startswith(str(d / "snapshots" / "images" / victim)), base

    os.kill(int((d / f"{victim}.pid").read_text()), 9)
    wait_for(lambda: victim not in nodes_up(url), LEASE_TTL_S + 10,
             f"{victim} to leave the cluster")
    # Paused with its snapshot in the shared store: not `lost`.
    assert c.get(box.id).state == "paused"

    t0 = time.monotonic()
    assert c.resume({"xresume": tag}) == [box.id]
    print(f"{backend} cross-node resume: {time.monotonic() - t0:.1f} s")
    moved = c.get(box.id)
    assert moved.state == "running" and moved.node != victim, (moved.state, moved.node)
    # Files from before the pause: the disk's and the guest RAM's.
    r = box.exec("cat /workspace/before.txt /dev/shm/m")
    assert (r.exit_code, r.stdout) == (0, b"on-disk\nin-memory\n"), r
    # The background process still runs: its file keeps growing after the resume.
    n1 = ticks(box)
    wait_for(lambda: ticks(box) >= n1 + 3, 30, "the loop to tick on the new node")
    # The new node found it in the guest agent's table: listed under its old handle, and a
    # kill through that handle ends it.
    wait_for(lambda: [p.id for p in box.processes()] == [proc.id], 30,
             "the background process to be listed on the new node")
    box.process(proc.id).kill()
    res = box.process(proc.id).wait(timeout=30)
    assert res is not None and res.signal == 9, res
    n2 = ticks(box)
    time.sleep(1)
    assert ticks(box) == n2, "the loop still runs after its kill"
    assert not snap.exists(), "the snapshot stays in the store after the resume"
    # The disk stays writable on the new node (its active layer is the sandbox's own).
    r = box.exec("echo after > /workspace/after.txt && sync && cat /workspace/after.txt")
    assert (r.exit_code, r.stdout) == (0, b"after\n"), r
    del proc
    box.delete()


def test_paused_microvm_resumes_on_another_node_after_its_node_is_killed(cluster):
    resume_on_another_node(cluster, "microvm", 120)


def test_paused_vm_resumes_on_another_node_after_its_node_is_killed(cluster):
    # A q35 VM under TCG: the first create builds the image's base disk and boots through
    # SeaBIOS (tens of seconds here).
    resume_on_another_node(cluster, "vm", 300)
