"""`scripts/cluster.sh up|down` (docs/operations.md "Cluster mode", "A local cluster"): three
etcd members, three `sandlot node --etcd` processes, each in its own network namespace with
its own data directory, and one `sandlot server --etcd` in front of them. Through that
server: the README's SDK example and HumanEval's `run_code` (164/164, negative control
0/164), with the sandboxes spread over the nodes; then `down` leaves no namespace, bridge,
mount or cgroup of the nodes behind."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sandlot

ROOT = Path(__file__).resolve().parent.parent


def _cgroup_parent(data_dir: str) -> str:
    """The node's cgroup parent (`default_cgroup_parent`, crates/sandlot-node/src/local.rs)."""
    h = 0xCBF29CE484222325
    for b in os.path.abspath(data_dir).encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "sandlot-%012x" % (h & 0xFFFFFFFFFFFF)


@pytest.fixture(scope="module")
def cluster(binary):
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network namespaces, the nodes' jails)")
    if shutil.which("etcd") is None:
        pytest.skip("no etcd (scripts/setup.sh installs Debian's etcd-server)")
    d = Path(tempfile.mkdtemp(prefix="sandlot-cluster-", dir="/var/tmp"))
    script = str(ROOT / "scripts" / "cluster.sh")
    env = dict(os.environ, SANDLOT_BIN=str(Path(binary).resolve()))
    up = subprocess.run([script, "up", str(d), "3"], capture_output=True, text=True,
                        timeout=300, env=env)
    try:
        assert up.returncode == 0, up.stderr + "\n" + up.stdout
        lines = up.stdout.splitlines()
        yield d, lines
    finally:
        down = subprocess.run([script, "down", str(d)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert down.returncode == 0, down.stderr
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "slc-node" not in left, left
        assert subprocess.run(["ip", "link", "show", "slcbr0"],
                              capture_output=True).returncode != 0, "bridge left behind"
        with open("/proc/self/mountinfo") as f:
            mounts = [line for line in f if str(d) in line]
        assert mounts == [], mounts
        for i in range(3):
            parent = _cgroup_parent(str(d / f"node{i}"))
            assert not list(Path("/sys/fs/cgroup").glob(f"*/{parent}*")), parent
        shutil.rmtree(d, ignore_errors=True)


def test_the_readme_and_humaneval_run_on_a_local_cluster(cluster):
    d, lines = cluster
    kinds = [line.split()[0] for line in lines]
    assert kinds == ["etcd"] * 3 + ["server"] + ["node"] * 3, lines
    url = next(line.split()[1] for line in lines if line.startswith("server "))
    nodes = {line.split()[1] for line in lines if line.startswith("node ")}
    with sandlot.Client(url, timeout=60) as c:
        # The README's SDK example (docs: README "Quick start").
        with c.create(image="python", memory_mib=256, ttl_s=300) as sb:
            sb.write_file("hello.py", "print('hi from', __import__('socket').gethostname())")
            r = sb.exec(["python3", "hello.py"], timeout_s=10)
            assert (r.exit_code, r.stdout.decode()) == (0, f"hi from {sb.id}\n")
        assert c.run_code("print(1+1)", language="python").status == "Success"
        sb = c.create(image="python", trajectory="cluster/ep-1")
        sb.write_file("a.txt", "x")
        assert sb.exec("cat a.txt >> log.txt").replayed is False
        again = c.attach("cluster/ep-1")
        again.write_file("a.txt", "x")
        assert again.exec("cat a.txt >> log.txt").replayed is True
        assert sb.read_file("log.txt") == b"x"
        sb.delete()
        # Sandboxes land on more than one node (placement spreads a job's sandboxes).
        many = [c.create(image="python", memory_mib=128, ttl_s=300, labels={"job": "spread"})
                for _ in range(6)]
        assert {s.node for s in many} <= nodes and len({s.node for s in many}) >= 2, \
            [s.node for s in many]
        for s in many:
            assert s.exec(["echo", "ok"]).stdout == b"ok\n"
            s.delete()
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "humaneval.py"),
                          "--url", url], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT: OK (positive 164/164" in out.stdout, out.stdout[-3000:]


REGISTRY = os.environ.get("SANDLOT_REGISTRY_ADDR", "127.0.0.1:5000")
IMAGES_DIR = os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images")


def test_a_node_pulls_from_the_hosts_loopback_registry(cluster, binary):
    """A node's 127.0.0.1 is its own network namespace's; cluster.sh forwards the registry
    port to the host's loopback registry (scripts/registry.sh), so a create naming
    `127.0.0.1:5000/...` pulls on the node, for a container as for a function sandbox."""
    import urllib.request
    try:
        urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=5).close()
    except OSError as e:
        pytest.skip(f"no registry on {REGISTRY} ({e}); scripts/registry.sh start && push")
    if shutil.which("skopeo") is None:
        pytest.skip("no skopeo (scripts/setup.sh installs it)")
    # A tag of this test's own, dropped from the shared image store first, so the create
    # has to fetch the manifest and layers from the node's namespace.
    ref = f"{REGISTRY}/sandlot/busybox:cluster-pull"
    subprocess.run(["skopeo", "copy", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{REGISTRY}/sandlot/busybox:latest", f"docker://{ref}"],
                   check=True, capture_output=True, timeout=120)
    _, lines = cluster
    url = next(line.split()[1] for line in lines if line.startswith("server "))
    with sandlot.Client(url, timeout=120) as c:
        backends = c._request("GET", "/healthz").json()["backends"]
        todo = ["function"] + (["container"] if backends.get("container") == "ok" else [])
        for backend in todo:
            subprocess.run([str(binary), "image", "rm", ref, "--images-dir", IMAGES_DIR],
                           capture_output=True, timeout=60)
            with c.create(backend=backend, image=ref, memory_mib=128, ttl_s=120) as sb:
                r = sb.exec(["sh", "-c", "echo pulled"], timeout_s=30)
                assert (r.exit_code, r.stdout) == (0, b"pulled\n"), (backend, r)
    subprocess.run([str(binary), "image", "rm", ref, "--images-dir", IMAGES_DIR],
                   capture_output=True, timeout=60)
    if "container" not in todo:
        pytest.skip(f"function pulled; container backend on the nodes: {backends.get('container')}")
