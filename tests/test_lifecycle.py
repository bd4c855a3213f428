"""Sandbox lifecycle end to end: create/get/list/keepalive/delete, TTL, idempotency,
concurrency, and restarts of `sandlot up` (SIGTERM and kill -9) on the same data dir."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import sandlot
from conftest import Server, count_leaks, wait_until


def _gone(client, sid) -> bool:
    try:
        return client.get(sid).state == "deleted"
    except sandlot.NotFound:
        return True


def test_create_get_list_defaults(client, python_image):
    tag = uuid.uuid4().hex
    with client.create(image=python_image, labels={"suite": tag, "k": "v"}) as box:
        assert box.id.startswith("sb-") and len(box.id) == 23
        assert (box.backend, box.image, box.state) == ("function", "python", "running")
        assert (box.cpu, box.memory_mib, box.pids_max, box.ttl_s) == (1.0, 512, 256, 600)
        assert box.expires_at and box.created_at and box.node
        got = client.get(box.id)
        assert got.id == box.id and got.labels == {"suite": tag, "k": "v"}
        assert [s.id for s in client.list(labels={"suite": tag})] == [box.id]
        assert client.list(labels={"suite": tag, "k": "other"}) == []
        assert box.id in [s.id for s in client.list()]
    assert _gone(client, box.id)
    assert all(s.state == "deleted" for s in client.list(labels={"suite": tag}))


def test_keepalive_moves_expiry(client, python_image):
    with client.create(image=python_image, memory_mib=64, ttl_s=30) as box:
        before = box.expires_at
        time.sleep(1.1)
        box.keepalive(ttl_s=3600)
        assert box.expires_at > before
        assert box.refresh().expires_at == box.expires_at


def test_ttl_expiry_deletes(client, python_image, server):
    box = client.create(image=python_image, memory_mib=64, ttl_s=2)
    sb_dir = server.data_dir / "sandboxes" / box.id
    assert box.exec("echo hi").stdout == b"hi\n"
    wait_until(lambda: _gone(client, box.id), 30, what=f"TTL expiry of {box.id}")
    with pytest.raises((sandlot.NotFound, sandlot.Conflict)):
        box.exec("true")
    wait_until(lambda: not sb_dir.exists(), 15, what=f"{sb_dir} to be removed")


def test_delete_twice_and_unknown(client, python_image):
    box = client.create(image=python_image, memory_mib=64, ttl_s=60)
    box.delete()
    box.delete()  # 204 also when already gone
    client.delete("sb-00000000000000000000")
    assert _gone(client, box.id)
    with pytest.raises(sandlot.NotFound):
        client.get("sb-ffffffffffffffffffff")


def test_delete_during_running_exec(client, python_image, server):
    box = client.create(image=python_image, memory_mib=64, ttl_s=120)
    outcome = {}

    def run():
        t0 = time.monotonic()
        try:
            outcome["result"] = box.exec("echo started; sleep 300", timeout_s=120)
        except sandlot.SandlotError as e:
            outcome["error"] = e
        outcome["elapsed"] = time.monotonic() - t0

    th = threading.Thread(target=run)
    th.start()
    time.sleep(1.0)  # let the exec start; the assertion below does not depend on timing
    t0 = time.monotonic()
    box.delete()
    assert time.monotonic() - t0 < 30
    th.join(60)
    assert not th.is_alive(), "exec still hanging 60 s after its sandbox was deleted"
    assert outcome["elapsed"] < 60
    if "result" in outcome:
        r = outcome["result"]
        assert r.exit_code != 0 or r.signal is not None, r
    else:
        assert isinstance(outcome["error"], (sandlot.NotFound, sandlot.Conflict,
                                             sandlot.Unavailable)), outcome["error"]
    assert _gone(client, box.id)
    wait_until(lambda: not (server.data_dir / "sandboxes" / box.id).exists(), 15,
               what="the sandbox directory to be removed")


def test_idempotency_key_returns_same_sandbox(client, python_image):
    key = uuid.uuid4().hex
    a = client.create(image=python_image, memory_mib=64, ttl_s=60, idempotency_key=key)
    try:
        b = client.create(image=python_image, memory_mib=64, ttl_s=60, idempotency_key=key)
        assert b.id == a.id
        c = client.create(image=python_image, memory_mib=64, ttl_s=60,
                          idempotency_key=uuid.uuid4().hex)
        assert c.id != a.id
        c.delete()
    finally:
        a.delete()


def test_env_of_sandbox_and_exec_override(client, python_image):
    with client.create(image=python_image, memory_mib=64, ttl_s=60,
                       env={"A": "sandbox", "B": "kept"}) as box:
        assert box.exec("echo $A $B").stdout == b"sandbox kept\n"
        assert box.exec("echo $A $B", env={"A": "exec"}).stdout == b"exec kept\n"


def test_sandboxes_are_isolated_from_each_other(client, python_image):
    with client.create(image=python_image, memory_mib=64, ttl_s=60) as a, \
            client.create(image=python_image, memory_mib=64, ttl_s=60) as b:
        a.exec("sleep 30 >/dev/null 2>&1 &")
        procs = b.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert b"sleep 30" not in procs
        assert a.exec("hostname").stdout != b"" and b.exec("echo $$").exit_code == 0


def test_200_sandboxes_concurrently(client, python_image, server):
    tag = uuid.uuid4().hex

    def one(i: int) -> str:
        box = client.create(image=python_image, memory_mib=32, pids_max=16, ttl_s=300,
                            labels={"suite": tag})
        try:
            r = box.exec(["sh", "-c", f"echo {i}; cat"], stdin=f"in-{i}", timeout_s=60)
            assert r.exit_code == 0 and r.stdout == f"{i}\nin-{i}".encode(), r
            box.write_file("n.txt", str(i))
            assert box.read_file("n.txt") == str(i).encode()
            return box.id
        finally:
            box.delete()

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as pool:
        ids = list(pool.map(one, range(200)))
    elapsed = time.monotonic() - t0
    print(f"\n200 sandboxes created, used and deleted in {elapsed:.1f}s (32 threads)")
    assert len(set(ids)) == 200
    live = [s for s in client.list(labels={"suite": tag}) if s.state != "deleted"]
    assert live == []
    sb_dir = server.data_dir / "sandboxes"
    wait_until(lambda: not any((sb_dir / i).exists() for i in ids), 30,
               what="all 200 sandbox directories to be removed")


def test_200_sandboxes_asyncio(server, python_image):
    import asyncio

    async def main():
        async with sandlot.AsyncClient(server.url, timeout=120) as ac:
            sem = asyncio.Semaphore(32)

            async def one(i):
                async with sem:
                    async with await ac.create(image=python_image, memory_mib=32,
                                               pids_max=16, ttl_s=300) as box:
                        r = await box.exec(f"echo {i}")
                        return r.stdout

            outs = await asyncio.gather(*(one(i) for i in range(200)))
            assert outs == [f"{i}\n".encode() for i in range(200)]

    asyncio.run(main())


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_restart_readopts_sandboxes(binary, tmp_path, python_image, how):
    srv = Server(binary, tmp_path / "data", tmp_path / "restart.log")
    srv.start()
    try:
        c = sandlot.Client(srv.url, timeout=60)
        boxes = [c.create(image=python_image, memory_mib=64, ttl_s=600,
                          labels={"n": str(i)}) for i in range(3)]
        ps = "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"
        for i, box in enumerate(boxes):
            box.write_file("state.txt", f"before-{i}")
            box.exec("sleep 1000 >/dev/null 2>&1 &")
        # Whether a background process outlives its exec is not fixed by the API; when it
        # does, it must also outlive the restart (the sandbox keeps running).
        bg_lives = b"sleep 1000" in boxes[0].exec(ps).stdout
        deleted = boxes.pop()
        deleted.delete()
        srv.restart(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
        for i, box in enumerate(boxes):
            got = c.get(box.id)
            assert got.state == "running", got.raw
            assert got.labels == {"n": str(i)}
            assert box.read_file("state.txt") == f"before-{i}".encode()
            # The sandbox kept running across the restart: its background process lives.
            if bg_lives:
                assert b"sleep 1000" in box.exec(ps).stdout
            assert box.exec(["python3", "-c", "print(7*6)"]).stdout == b"42\n"
            box.write_file("after.txt", "x")
            assert "after.txt" in [e.name for e in box.list_dir(".")]
        assert _gone(c, deleted.id)
        # New sandboxes work after the restart too.
        with c.create(image=python_image, memory_mib=64, ttl_s=60) as fresh:
            assert fresh.exec("echo new").stdout == b"new\n"
        for box in boxes:
            box.delete()
        wait_until(lambda: count_leaks(srv.data_dir)["sandbox_dirs"] == 0
                   and count_leaks(srv.data_dir)["mounts"] == 0, 30,
                   what="no sandbox dirs or mounts left after deleting all")
        c.close()
    except Exception:
        print(srv.log_tail())
        raise
    finally:
        srv.stop()
