"""The warm pool of ready runc containers (`sandlot up --container-warm-pool N`): a create
with runtime runc, network none, the default disk and no checkpoint is served by handing
over an already-started container (crates/sandlot-node/src/backends/container/pool.rs).

Real runc, real cgroups, a private `sandlot up` per module (data dir under /var/tmp: the
containers' host uids must walk down to their rootfs). Checked: the hand-over is visible in
the sandbox's state.json (runtime id and cgroup keep the pooled name ``cp-<hex>``), the host
name is the sandbox id, the spec's limits are in the group, env reaches execs, the files API
works, two hand-overs differ in machine-id and host name, delete leaves nothing, kill -9 +
restart re-adopts a handed-over container and sweeps the pooled leftovers, other specs fall
back to a cold create, a container pooled before its (built-in) image was removed and built
again is never handed over, and a pool of 0 creates cold.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List

import httpx
import pytest

import conftest
import sandlot
from conftest import (
    Server, count_leaks, image_cli, node_cgroup_parent, private_base, remove_private_base,
    wait_no_leaks, wait_until,
)

IMAGE = "busybox"
POOL = 2


def pool_ready(data_dir: Path) -> List[str]:
    """Pooled containers that finished building (their state.json exists)."""
    d = data_dir / "container-pool"
    try:
        return sorted(p.name for p in d.iterdir() if (p / "state.json").is_file())
    except OSError:
        return []


def wait_pool_full(srv: Server, n: int = POOL) -> List[str]:
    wait_until(lambda: len(pool_ready(srv.data_dir)) >= n, 60,
               what=f"{n} ready pooled containers in {srv.data_dir}/container-pool")
    return pool_ready(srv.data_dir)


def state_of(srv: Server, sid: str) -> dict:
    return json.loads((srv.data_dir / "containers" / sid / "state.json").read_text())


def cgroup_file(srv: Server, cgroup: str, v1: str, v2: str) -> str:
    parent = node_cgroup_parent(srv.data_dir) + "-ctr"
    root = Path("/sys/fs/cgroup")
    for p in [root / ctrl / parent / cgroup / v1 for ctrl in ("memory", "cpu", "pids", "cpuset")] \
            + [root / parent / cgroup / v2]:
        if p.is_file():
            return p.read_text().strip()
    raise AssertionError(f"no {v1} / {v2} for cgroup {cgroup}")


def cgroup_exists(srv: Server, cgroup: str) -> bool:
    parent = node_cgroup_parent(srv.data_dir) + "-ctr"
    root = Path("/sys/fs/cgroup")
    return any(p.is_dir() for p in [root / parent / cgroup]
               + [c / parent / cgroup for c in root.iterdir() if c.is_dir()])


def runc_ids(data_dir: Path) -> List[str]:
    r = subprocess.run(["runc", "--root", str(data_dir / "runtime" / "runc"), "list", "-q"],
                       capture_output=True, text=True, timeout=30, check=False)
    return [x.strip() for x in r.stdout.splitlines() if x.strip()]


def sh(box: sandlot.Sandbox, script: str) -> str:
    r = box.exec(["sh", "-c", script], timeout_s=60)
    assert r.exit_code == 0, f"{box.id}: {script!r} → {r}"
    return r.stdout.decode()


def private_server(binary: Path, log_dir: Path, name: str, pool: int) -> Server:
    if os.geteuid() != 0:
        pytest.skip("container tests need root (runc, overlay and loop mounts, cgroups)")
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    base = private_base(f"sandlot-{name}-")
    srv = Server(binary, base / "data", log_dir / f"{name}.log",
                 args=["--warm-pool", "0", "--warm-pool-images", IMAGE,
                       "--container-warm-pool", str(pool)])
    try:
        srv.start()
    except RuntimeError as e:
        pytest.fail(f"could not start `sandlot up`: {e}")
    with sandlot.Client(srv.url, timeout=60) as c:
        try:
            c.create(backend="container", runtime="runc", image=IMAGE, disk_mib=64,
                     ttl_s=60).delete()
        except (sandlot.NotFound, sandlot.Unavailable) as e:
            srv.stop()
            pytest.skip(f"no runc container from image {IMAGE!r}: {e}")
    return srv


def finish(srv: Server) -> None:
    try:
        srv.delete_all()
    except Exception as e:  # noqa: BLE001 - best-effort cleanup
        print(f"cleanup of the private node failed: {e}")
    try:
        srv.stop()
    except RuntimeError as e:
        print(e)
    # A stopped server destroys its pool: nothing of the node may remain.
    left = count_leaks(srv.data_dir)
    pool_left = list((srv.data_dir / "container-pool").glob("cp-*"))
    base = srv.data_dir.parent
    remove_private_base(base)
    assert not pool_left, f"pooled containers left after stop: {pool_left}"
    assert left["mounts"] == 0 and left["cgroups"] == 0, f"left after stop: {left}"


@pytest.fixture(scope="module")
def node(binary, log_dir) -> Iterator[Server]:
    srv = private_server(binary, log_dir, "container-pool", POOL)
    yield srv
    finish(srv)


@pytest.fixture
def client(node) -> Iterator[sandlot.Client]:
    c = sandlot.Client(node.url, timeout=120)
    yield c
    c.close()


@pytest.fixture
def baseline(node) -> Dict[str, int]:
    return count_leaks(node.data_dir)


def test_create_is_handed_over_with_limits_env_and_hostname(node, client, baseline):
    pooled = wait_pool_full(node)
    box = client.create(backend="container", runtime="runc", image=IMAGE, cpu=0.5,
                        memory_mib=96, pids_max=40, env={"GREETING": "hello pool"},
                        ttl_s=300)
    try:
        st = state_of(node, box.id)
        assert st["id"] == box.id
        assert st.get("runtime_id", "").startswith("cp-"), st
        assert st["runtime_id"] in pooled and st["cgroup"] == st["runtime_id"], (st, pooled)
        cg = st["cgroup"]
        assert not (node.data_dir / "container-pool" / cg).exists()
        assert sh(box, "hostname").strip() == box.id
        assert sh(box, "echo $GREETING").strip() == "hello pool"
        assert cgroup_file(node, cg, "memory.limit_in_bytes", "memory.max") == str(96 << 20)
        assert cgroup_file(node, cg, "pids.max", "pids.max") == "40"
        quota = cgroup_file(node, cg, "cpu.cfs_quota_us", "cpu.max").split()[0]
        period = cgroup_file(node, cg, "cpu.cfs_period_us", "cpu.max").split()[-1]
        assert int(quota) * 2 == int(period), (quota, period)
        # The files API reaches the handed-over container's agent at its new socket path.
        box.write_file("/tmp/pool.txt", b"from the pool\n")
        assert box.read_file("/tmp/pool.txt") == b"from the pool\n"
        assert sh(box, "cat /tmp/pool.txt") == "from the pool\n"
        init = st["init_pid"]
    finally:
        box.delete()
    wait_until(lambda: not Path(f"/proc/{init}").exists(), 20, what="the container's init gone")
    assert not cgroup_exists(node, cg)
    assert cg not in runc_ids(node.data_dir)
    wait_no_leaks(node.data_dir, baseline, what="a handed-over container's delete")


def test_two_hand_overs_differ(node, client, baseline):
    wait_pool_full(node)
    boxes = [client.create(backend="container", runtime="runc", image=IMAGE, ttl_s=300)
             for _ in range(2)]
    try:
        ids = [sh(b, "cat /etc/machine-id; hostname").split() for b in boxes]
        assert all(state_of(node, b.id).get("runtime_id", "").startswith("cp-") for b in boxes)
        assert ids[0][0] != ids[1][0], ids
        assert [i[1] for i in ids] == [b.id for b in boxes]
    finally:
        for b in boxes:
            b.delete()
    wait_no_leaks(node.data_dir, baseline, what="two handed-over containers' deletes")
    # The pool refills after the hand-overs.
    wait_pool_full(node)


def test_other_specs_are_created_cold(node, client, baseline):
    wait_pool_full(node)
    before = set(pool_ready(node.data_dir))
    box = client.create(backend="container", runtime="runc", image=IMAGE, disk_mib=256,
                        ttl_s=300)
    try:
        st = state_of(node, box.id)
        assert "runtime_id" not in st and "cgroup" not in st, st
        assert sh(box, "hostname").strip() == box.id
        assert box.id in runc_ids(node.data_dir)
        assert before <= set(pool_ready(node.data_dir))
    finally:
        box.delete()
    wait_no_leaks(node.data_dir, baseline, what="a cold container's delete")


def test_dead_pooled_container_is_destroyed_and_the_create_goes_cold(node, client, baseline):
    """A hand-over that fails (here: the pooled containers' agents were killed from the
    host) destroys the pooled container and creates cold; nothing of it is left."""
    pooled = wait_pool_full(node)
    for name in pooled:
        st = json.loads((node.data_dir / "container-pool" / name / "state.json").read_text())
        os.kill(st["init_pid"], 9)
    box = client.create(backend="container", runtime="runc", image=IMAGE, env={"X": "1"},
                        ttl_s=300)
    try:
        st = state_of(node, box.id)
        assert "runtime_id" not in st, st
        assert sh(box, "echo $X; hostname").split() == ["1", box.id]
        # The dead pooled container taken by this create is gone entirely.
        gone = [n for n in pooled if not (node.data_dir / "container-pool" / n).exists()]
        assert gone, pooled
        for name in gone:
            assert name not in runc_ids(node.data_dir)
            assert not cgroup_exists(node, name)
    finally:
        box.delete()
    # The other dead one goes with the next create that takes it; drain it the same way.
    box = client.create(backend="container", runtime="runc", image=IMAGE, ttl_s=300)
    box.delete()
    wait_until(lambda: not set(pooled) & set(pool_ready(node.data_dir)), 30,
               what="the dead pooled containers destroyed")
    wait_no_leaks(node.data_dir, baseline, what="creates after failed hand-overs")
    wait_pool_full(node)


def test_kill9_restart_readopts_handed_over_and_sweeps_pool(node, client, baseline):
    wait_pool_full(node)
    box = client.create(backend="container", runtime="runc", image=IMAGE, env={"K": "v"},
                        ttl_s=600)
    st = state_of(node, box.id)
    assert st.get("runtime_id", "").startswith("cp-"), st
    box.write_file("/root/kept.txt", b"kept\n")
    wait_pool_full(node)
    old_pool = pool_ready(node.data_dir)
    node.kill()
    node.start()
    try:
        with sandlot.Client(node.url, timeout=120) as c:
            again = c.get(box.id)
            assert again.state == "running"
            assert sh(again, "cat /root/kept.txt; echo $K; hostname").split() == \
                ["kept", "v", box.id]
        # The previous process's pooled containers are swept (runc state, cgroups, dirs)
        # and the pool is refilled with new ones.
        wait_until(lambda: not set(old_pool) & set(pool_ready(node.data_dir)), 60,
                   what="old pooled containers swept")
        for name in old_pool:
            assert name not in runc_ids(node.data_dir), name
            assert not (node.data_dir / "container-pool" / name).exists()
            wait_until(lambda n=name: not cgroup_exists(node, n), 20, what=f"cgroup {name} gone")
        # The handed-over container's cgroup (pooled name) was not swept.
        assert cgroup_exists(node, st["cgroup"])
        wait_pool_full(node)
    finally:
        client.get(box.id).delete()
    wait_no_leaks(node.data_dir, baseline, what="delete after kill -9 + restart")
    assert st["runtime_id"] not in runc_ids(node.data_dir)


def test_metrics_show_the_pool(node, client, baseline):
    """`/metrics` has the pool's ready members per image and its hand-overs and misses: a
    create served by the pool adds one hand-over; one the pool cannot serve (another disk
    size) is no miss, it was never the pool's."""
    def sample(name: str, **labels: str) -> float:
        text = httpx.get(f"{node.url}/metrics", timeout=30).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(name + "{") and line.split("}")[0].split("{")[1] == want:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    wait_pool_full(node)
    assert sample("sandlot_warm_pool_ready", backend="container", image=IMAGE) == POOL
    before = sample("sandlot_warm_pool_handovers_total", backend="container")
    misses = sample("sandlot_warm_pool_misses_total", backend="container")
    with client.create(backend="container", runtime="runc", image=IMAGE, ttl_s=300) as box:
        assert state_of(node, box.id).get("runtime_id", "").startswith("cp-")
    with client.create(backend="container", runtime="runc", image=IMAGE, disk_mib=64,
                       ttl_s=300):
        pass
    assert sample("sandlot_warm_pool_handovers_total", backend="container") == before + 1
    assert sample("sandlot_warm_pool_misses_total", backend="container") == misses
    wait_no_leaks(node.data_dir, baseline, what="two creates")


def test_each_delete_reaches_the_node_once(node, client, baseline):
    """A DELETE runs one node delete. The reaper retries the deletes of records left
    `deleting`; it must not start a second delete of a container whose first one is still
    running (two `runc delete --force` of one container at once race, and once left its
    runc-made cgroups — blkio, devices, systemd, unified — behind). Handed-over and cold
    containers alike: the node logs one `sandbox deleted` per sandbox."""
    wait_pool_full(node)
    ids = []
    for i in range(30):
        box = client.create(backend="container", runtime="runc", image=IMAGE,
                            disk_mib=1024 if i % 2 else 64, ttl_s=300)
        box.delete()
        ids.append(box.id)
    time.sleep(1.5)  # one more reaper pass
    log = node.log_path.read_text(errors="replace")
    twice = {i: n for i in ids
             if (n := log.count(f"backends: sandbox deleted sandbox={i} backend=\"container\"")) != 1}
    assert not twice, f"node deletes per sandbox (want 1 each): {twice}"
    wait_no_leaks(node.data_dir, baseline, what="30 creates and deletes")


@pytest.fixture(scope="module")
def node_off(binary, log_dir) -> Iterator[Server]:
    srv = private_server(binary, log_dir, "container-pool-off", 0)
    yield srv
    finish(srv)


def test_pool_off_creates_cold(node_off):
    baseline = count_leaks(node_off.data_dir)
    with sandlot.Client(node_off.url, timeout=120) as c:
        box = c.create(backend="container", runtime="runc", image=IMAGE, env={"A": "b"},
                       ttl_s=300)
        try:
            st = state_of(node_off, box.id)
            assert "runtime_id" not in st, st
            assert sh(box, "echo $A; hostname").split() == ["b", box.id]
            # A pool of 0 never starts: no pool directory, no pooled container.
            assert not (node_off.data_dir / "container-pool").exists()
        finally:
            box.delete()
    wait_no_leaks(node_off.data_dir, baseline, what="delete with the pool off")


def test_pooled_container_of_a_rebuilt_image_is_not_handed_over(binary, log_dir, monkeypatch):
    """`sandlot image rm` + `sandlot image build` of a built-in image re-create its layer
    directory (`busybox/rootfs`) under the same path, while the containers pooled before
    still mount the old one (retired, see the next test). A create must not get one of them: they are
    destroyed when taken and the create goes cold (or gets one the refill built from the new
    build meanwhile); the refilled pool serves the new build."""
    base = private_base("sandlot-pool-rebuild-")
    images = base / "images"
    image = image_cli(binary, base)

    image("build", IMAGE)
    # This node's own image store: the shared one is never changed by tests.
    monkeypatch.setattr(conftest, "IMAGES_DIR", str(images))
    srv = private_server(binary, log_dir, "container-pool-rebuild", POOL)
    try:
        baseline = count_leaks(srv.data_dir)
        with sandlot.Client(srv.url, timeout=120) as c:
            old = wait_pool_full(srv)
            image("rm", IMAGE)
            image("build", IMAGE)
            box = c.create(backend="container", runtime="runc", image=IMAGE, ttl_s=300)
            try:
                # Cold, or a container the refill built from the new build meanwhile.
                assert state_of(srv, box.id).get("runtime_id") not in old, "stale hand-over"
                assert sh(box, "ls /bin/sh >/dev/null && hostname").strip() == box.id
            finally:
                box.delete()
            wait_until(lambda: not set(old) & set(pool_ready(srv.data_dir)), 30,
                       what="the stale pooled containers destroyed")
            for name in old:
                assert name not in runc_ids(srv.data_dir), name
            # The pool refills from the new build, and those are handed over again.
            wait_pool_full(srv)
            box = c.create(backend="container", runtime="runc", image=IMAGE, ttl_s=300)
            try:
                assert state_of(srv, box.id).get("runtime_id", "").startswith("cp-")
                assert sh(box, "ls /bin/sh >/dev/null && hostname").strip() == box.id
            finally:
                box.delete()
        wait_no_leaks(srv.data_dir, baseline, what="creates after an image rebuild")
    finally:
        finish(srv)
        remove_private_base(base)


def test_image_rm_and_forced_build_keep_a_running_sandboxs_rootfs(binary, log_dir, monkeypatch):
    """A built-in image's rootfs is its only layer and lives in the image's directory.
    `sandlot image rm` and `sandlot image build --force` while sandboxes (container and
    function) run on it must not delete it under them: the old directory is retired, the
    sandboxes keep working, `gc` keeps it while mounted and deletes it after the last
    sandbox is gone."""
    base = private_base("sandlot-image-retire-")
    images = base / "images"
    image = image_cli(binary, base)

    image("build", IMAGE)
    monkeypatch.setattr(conftest, "IMAGES_DIR", str(images))
    srv = private_server(binary, log_dir, "image-retire", 0)
    retired = images / "retired"
    try:
        baseline = count_leaks(srv.data_dir)
        with sandlot.Client(srv.url, timeout=120) as c:
            boxes = [c.create(backend="container", runtime="runc", image=IMAGE, ttl_s=300),
                     c.create(backend="function", image=IMAGE, ttl_s=300)]
            try:
                image("build", "--force", IMAGE)
                assert len(list(retired.iterdir())) == 1, list(retired.iterdir())
                # The rebuilt image has the same path, which the running sandboxes' mounts
                # name: it is retired too (kept too long rather than deleted under them).
                image("rm", IMAGE)
                assert len(list(retired.iterdir())) == 2, list(retired.iterdir())
                for box in boxes:
                    assert sh(box, "ls /bin/sh && echo ok").strip().endswith("ok"), box.id
                out = image("gc")
                assert "kept 2 " in out, out
                assert len(list(retired.iterdir())) == 2, out
            finally:
                for box in boxes:
                    box.delete()
            out = image("gc")
            assert not any(retired.iterdir()), (out, list(retired.iterdir()))
        wait_no_leaks(srv.data_dir, baseline, what="sandboxes on a retired image")
    finally:
        finish(srv)
        remove_private_base(base)
