"""Background processes across a restart of `sandlot up` on the function backend when they
run on its helper path (a sandbox's first exec): the sandbox is re-adopted, its background
processes are gone (killed with the old process's execs; their table was in its memory),
and their handles answer 404 (docs/api.md, "Background processes"). Processes that run
through a guest agent (container, tests/test_container_restart.py; a function sandbox's
later execs, below) outlive the restart and are found again."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

import sandlot
from conftest import Server, host_processes_matching, private_base, remove_private_base, wait_until


@pytest.mark.parametrize("backend", ["function"])
def test_restart_ends_background_processes(binary, tmp_path, python_image, backend):
    base = private_base("sandlot-procs-")
    srv = Server(binary, base / "data", tmp_path / "restart.log")
    srv.start()
    try:
        c = sandlot.Client(srv.url, timeout=60)
        try:
            box = c.create(backend=backend, image=python_image, memory_mib=64, ttl_s=600)
        except sandlot.Unavailable as e:
            pytest.skip(f"backend {backend} unavailable here: {e.message}")
        tag = f"{uuid.uuid4().int % 900000 + 100000}"
        p = box.spawn(f"(setsid sh -c 'while true; do date +%s%N > /tmp/hb; sleep 0.1; done' &);"
                      f" sleep {tag}")
        wait_until(lambda: box.exec("test -s /tmp/hb").exit_code == 0, 15, what="heartbeat")
        assert [q.id for q in box.processes()] == [p.id]
        srv.restart(signal.SIGKILL)
        assert c.get(box.id).state == "running"
        assert box.processes() == []
        with pytest.raises(sandlot.NotFound):
            box.process(p.id)
        with pytest.raises(sandlot.NotFound):
            p.refresh()

        def stopped() -> bool:
            a = box.read_file("/tmp/hb")
            time.sleep(0.5)
            return a == box.read_file("/tmp/hb")
        wait_until(stopped, 15, what="the old background process tree to die")
        wait_until(lambda: not host_processes_matching(f"sleep\x00{tag}".encode()), 15,
                   what=f"`sleep {tag}` to die")
        # New background processes work after the restart.
        q = box.spawn("echo again")
        assert q.wait(timeout=30).stdout == b"again\n"
        box.delete()
        c.close()
    except Exception:
        print(srv.log_tail())
        raise
    finally:
        srv.stop()
        remove_private_base(base)


def test_restart_refinds_function_agent_processes(binary, tmp_path, python_image):
    """A function sandbox's background process started through its in-jail guest agent
    (from its second exec on) outlives a kill -9 of `sandlot up` and is listed again under
    its old id, running, its output going on; a kill through the handle ends it."""
    base = private_base("sandlot-procs-")
    srv = Server(binary, base / "data", tmp_path / "restart-agent.log")
    srv.start()
    try:
        c = sandlot.Client(srv.url, timeout=60)
        box = c.create(backend="function", image=python_image, memory_mib=64, ttl_s=600)
        # The agent starts from the second exec on (docs/backends.md).
        assert box.exec("true").exit_code == 0
        assert box.exec("true").exit_code == 0
        pid_file = srv.data_dir / "sandboxes" / box.id / "agent.pid"
        wait_until(pid_file.exists, 15, what="the function sandbox's agent")
        time.sleep(0.5)
        assert box.exec("true").exit_code == 0
        tag = f"{uuid.uuid4().int % 900000 + 100000}"
        p = box.spawn(f": agentcounter-{tag}; i=0; while true; do echo n$i; i=$((i+1)); "
                      f"sleep 0.2; done")
        wait_until(lambda: p.refresh().stdout_bytes >= 9, 15, what="the counter's output")
        srv.restart(signal.SIGKILL)
        assert [q.id for q in box.processes()] == [p.id]
        q = box.process(p.id)
        assert q.state == "running"
        wait_until(lambda: q.refresh().stdout_bytes >= 60, 20, what="the counter to go on")
        q.kill()
        res = q.wait(timeout=30)
        assert res is not None and res.signal == 9, res
        wait_until(lambda: not host_processes_matching(f"agentcounter-{tag}".encode()), 15,
                   what="the counter to die")
        box.delete()
        c.close()
    except Exception:
        print(srv.log_tail())
        raise
    finally:
        srv.stop()
        remove_private_base(base)
