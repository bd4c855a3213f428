"""Batch create (`POST /v1/sandboxes:batch`, SDK `create_many`) end to end (issue 22):

- on the session's `sandlot up` (real `function` sandboxes): n alike, a list with a bad
  item (it fails alone, with its stable code; the others run), the async client;
- on a simulated cluster (one etcd member, `sandlot node --simulate 4 --max-sandboxes 5`,
  one `sandlot server --etcd` with API keys): a batch larger than the key's quota admits
  exactly the quota and answers the rest `resource_exhausted` (429); a batch larger than
  the nodes' free capacity fills them (no node past its capacity) and answers the rest 429.

The simulated part needs `etcd` (scripts/setup.sh installs Debian's etcd-server), no root.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest

import sandlot
from conftest import Server, private_base, remove_private_base

ROOT = Path(__file__).resolve().parent.parent


def test_create_many_live(client, python_image):
    tag = uuid.uuid4().hex[:8]
    common = dict(image=python_image, memory_mib=128, ttl_s=120, labels={"batch": tag})
    made = []
    try:
        res = client.create_many(3, **common)
        assert [type(r) for r in res.results] == [sandlot.Sandbox] * 3, res.results
        made += res.sandboxes
        assert len({s.id for s in made}) == 3 and all(s.state == "running" for s in made)
        r = made[0].exec(["python3", "-c", "print(6*7)"], timeout_s=30)
        assert (r.exit_code, r.stdout) == (0, b"42\n")

        res = client.create_many(items=[{}, {"cpu": 999}, {"memory_mib": 64}], **common)
        made += res.sandboxes
        assert isinstance(res.results[0], sandlot.Sandbox)
        assert isinstance(res.results[1], sandlot.InvalidArgument), res.results[1]
        assert res.results[1].status == 400 and "cpu" in res.results[1].message
        assert res.results[2].memory_mib == 64
        assert [i for i, _ in res.errors] == [1]
        assert len(client.list(labels={"batch": tag})) == 5, "the bad item left nothing"

        async def go():
            async with sandlot.AsyncClient(client.url, timeout=60) as ac:
                return await ac.create_many(2, **common)
        ares = asyncio.run(go())
        assert len(ares.sandboxes) == 2 and not ares.errors
        made += [client.get(s.id) for s in ares.sandboxes]
        with pytest.raises(ValueError):
            client.create_many(0)
        with pytest.raises(sandlot.InvalidArgument):
            client.create_many(2, image=python_image, cpu=999)

        # The whole job goes with one call: delete by label (paused ones too).
        assert client.pause({"batch": tag}) != []
        fresh = client.create(**common)
        made.append(fresh)
        deleted = client.delete_labeled({"batch": tag})
        assert sorted(deleted) == sorted(s.id for s in made) and not deleted.failed
        assert client.list(labels={"batch": tag}) == []
        with pytest.raises(ValueError):
            client.delete_labeled({})
    finally:
        for s in made:
            s.delete()


@pytest.fixture(scope="module")
def sim_cluster(binary, log_dir) -> Iterator[dict]:
    """etcd + 4 simulated nodes of 5 sandboxes + a server with keys: small (quota 7) and
    ops (admin)."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd (scripts/setup.sh installs Debian's etcd-server)")
    base = private_base("sandlot-batch-")
    etcd_sh = str(ROOT / "scripts" / "etcd.sh")
    procs = []
    server = None
    try:
        out = subprocess.run(["bash", etcd_sh, "start", str(base / "etcd"), "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        etcd = ",".join(line.split(" ", 1)[1] for line in out.stdout.splitlines()
                        if line.startswith("etcd "))
        token = base / "node-token"
        token.write_text("batch-t0ken\n")
        sim_log = open(log_dir / "sandlot-batch-sim.log", "ab")
        sim = subprocess.Popen([str(binary), "node", "--simulate", "4", "--name", "bsim",
                                "--etcd", etcd, "--max-sandboxes", "5",
                                "--sim-create-delay-ms", "1", "--token-file", str(token)],
                               stdout=subprocess.PIPE, stderr=sim_log, text=True)
        procs.append(sim)
        for line in sim.stdout:
            if "simulated nodes ready" in line:
                break
        data = base / "server"
        keys = {}
        for name, args in (("small", ["--max-sandboxes", "7"]), ("ops", ["--admin"])):
            out = subprocess.run([str(binary), "key", "create", "--data-dir", str(data),
                                  "--name", name, *args], capture_output=True, text=True,
                                 timeout=30)
            assert out.returncode == 0, out.stderr
            keys[name] = out.stdout.strip()
        server = Server(binary, data, log_dir / "sandlot-batch-server.log", mode="server",
                        args=["--etcd", etcd, "--node-token-file", str(token)])
        server.start()
        yield {"url": server.url, "keys": keys}
    finally:
        if server is not None:
            server.stop()
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(["bash", etcd_sh, "stop", str(base / "etcd")], capture_output=True,
                       timeout=60)
        remove_private_base(base)


def test_batch_over_quota_and_capacity(sim_cluster):
    url, keys = sim_cluster["url"], sim_cluster["keys"]
    with sandlot.Client(url, timeout=60, retries=0, api_key=keys["small"]) as small, \
            sandlot.Client(url, timeout=60, retries=0, api_key=keys["ops"]) as ops:
        # Until the server sees all 4 nodes.
        deadline = time.monotonic() + 20
        while True:
            n = httpx.get(f"{url}/v1/nodes", timeout=10,
                          headers={"Authorization": f"Bearer {keys['ops']}"}).json()
            if len(n["nodes"]) == 4:
                break
            assert time.monotonic() < deadline, n
            time.sleep(0.1)
        assert n["simulated"] == 4 and n["real"] == 0, n
        assert {x["kind"] for x in n["nodes"]} == {"simulated"}

        res = small.create_many(12, cpu=0.1, memory_mib=64, labels={"who": "small"})
        codes = [r.status if isinstance(r, sandlot.SandlotError) else 201
                 for r in res.results]
        assert codes.count(201) == 7, codes
        assert codes.count(429) == 5, codes
        assert all(isinstance(e, sandlot.ResourceExhausted) for _, e in res.errors)
        assert len(small.list()) == 7

        # 20 places in all, 7 taken: at most 13 more fit, the rest are refused for
        # capacity. Not exactly 13: placement reads each node's usage from etcd (published
        # each second) and a node that filled meanwhile refuses the item (429) without a
        # retry on another node.
        res = ops.create_many(20, cpu=0.1, memory_mib=64, labels={"who": "ops"})
        assert 1 <= len(res.sandboxes) <= 13, [str(e) for _, e in res.errors]
        assert len(res.sandboxes) + len(res.errors) == 20
        assert all(isinstance(e, sandlot.ResourceExhausted) for _, e in res.errors)
        live = ops.list()
        assert len(live) == 7 + len(res.sandboxes), "a refused item left nothing behind"
        per_node = {}
        for s in live:
            per_node[s.node] = per_node.get(s.node, 0) + 1
        assert max(per_node.values()) <= 5, per_node


def test_batch_body_and_result_unit():
    """SDK only (no server): the body forms and the mapping of per-item results."""
    from sandlot.models import batch_body, batch_result
    assert batch_body(2, None, {"cpu": 0.5}) == {
        "backend": "function", "image": "python", "cpu": 0.5, "count": 2}
    assert batch_body(None, [{}, {"image": "busybox"}], {"memory_mib": 64}) == {"items": [
        {"backend": "function", "image": "python", "memory_mib": 64},
        {"backend": "function", "image": "busybox", "memory_mib": 64}]}
    for n, items in ((None, None), (1, [{}]), (0, None), (1001, None), (True, None),
                     (None, [])):
        with pytest.raises(ValueError):
            batch_body(n, items, {})
    for bad in ({"trajectory": "t"}, {"restore": "replay"}, {"nosuch": 1}):
        with pytest.raises(TypeError):
            batch_body(1, None, bad)
    res = batch_result({"results": [
        {"index": 0, "status": 201, "sandbox": {"id": "sb-1"}},
        {"index": 1, "status": 429,
         "error": {"code": "resource_exhausted", "message": "quota"}},
    ], "created": 1, "failed": 1}, lambda d: d["id"])
    assert res.sandboxes == ["sb-1"]
    [(i, e)] = res.errors
    assert i == 1 and isinstance(e, sandlot.ResourceExhausted) and e.status == 429
    with pytest.raises(sandlot.ProtocolError):
        batch_result({"nope": 1}, lambda d: d)
