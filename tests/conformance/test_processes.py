"""Background processes (DESIGN.md, "Exec semantics": handles, wait, signal, stream later,
reconnect after a client restart, stdin only when asked for), identical on every backend."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

import sandlot
from conftest import assert_error, host_processes_matching, wait_until


def _read_until(p: sandlot.Process, needle: bytes, timeout: float = 30) -> bytes:
    """Follow ``p``'s stdout until ``needle`` appears; returns what was read."""
    got = b""
    deadline = time.monotonic() + timeout
    for ev in p.output(follow=True):
        if isinstance(ev, sandlot.StdoutChunk):
            got += ev.data
            if needle in got:
                return got
        assert time.monotonic() < deadline, f"no {needle!r} in {got[-300:]!r}"
        if isinstance(ev, sandlot.ExecResult):
            break
    pytest.fail(f"process ended before writing {needle!r}: {got[-300:]!r}")


def _heartbeat(tag: str) -> str:
    """Shell that starts a detached child (own session) writing a counter to /tmp/hb-TAG
    every 0.1 s, and a plain background sleep; then waits."""
    return (f"(setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/hb-{tag}; "
            f"sleep 0.1; done' &) ; sleep {tag} & echo started; wait")


def _start_heartbeat(sb: sandlot.Sandbox, tag: str) -> sandlot.Process:
    p = sb.spawn(_heartbeat(tag))
    _read_until(p, b"started\n")
    wait_until(lambda: sb.exec(f"test -s /tmp/hb-{tag}").exit_code == 0, 10,
               what="the heartbeat")
    return p


def _assert_heartbeat_stopped(sb: sandlot.Sandbox, tag: str) -> None:
    """The heartbeat child is dead: its counter no longer moves (checked inside the
    sandbox, so it holds on runsc too, whose processes the host cannot see)."""
    def still() -> bool:
        a = sb.read_file(f"/tmp/hb-{tag}")
        time.sleep(0.5)
        return a == sb.read_file(f"/tmp/hb-{tag}")
    wait_until(still, 10, what="the detached child to die")


def test_spawn_wait_and_list(sb):
    p = sb.spawn("echo out; echo err >&2; exit 3")
    assert p.id.startswith("pr-") and p.sandbox_id == sb.id and p.started_at
    r = p.wait(timeout=30)
    assert r is not None and (r.exit_code, r.signal, r.timed_out) == (3, None, False)
    assert r.stdout == b"out\n" and r.stderr == b"err\n"
    assert (r.stdout_bytes, r.stderr_bytes, r.truncated) == (4, 4, False)
    assert p.state == "exited" and p.ended_at and not p.running
    assert p.id in [q.id for q in sb.processes()]
    again = sb.process(p.id)
    assert again.state == "exited" and again.result.exit_code == 3
    p.delete()
    with pytest.raises(sandlot.NotFound):
        sb.process(p.id)


def test_output_later_and_reconnect_with_a_new_client(sb, server):
    p = sb.spawn("for i in $(seq 1 8); do echo line$i; echo e$i >&2; sleep 0.2; done")
    first = _read_until(p, b"line2\n")
    off = p.stdout_offset
    assert off == len(first)
    # A new client object (a restarted trainer) picks up where the first one left.
    with sandlot.Client(server.url) as c2:
        p2 = c2.get(sb.id).process(p.id)
        rest, err, last = b"", b"", None
        for ev in p2.output(follow=True, stdout_offset=off):
            if isinstance(ev, sandlot.StdoutChunk):
                rest += ev.data
            elif isinstance(ev, sandlot.StderrChunk):
                err += ev.data
            elif isinstance(ev, sandlot.ExecResult):
                last = ev
        want = b"".join(b"line%d\n" % i for i in range(1, 9))
        assert first + rest == want
        assert err == b"".join(b"e%d\n" % i for i in range(1, 9))
        assert last is not None and last.exit_code == 0 and last.stdout_bytes == len(want)
        # Later, without follow: everything retained from offset 0, then the exit record.
        evs = list(p2.output(follow=False, stdout_offset=0, stderr_offset=0))
        assert isinstance(evs[-1], sandlot.ExecResult)
        assert b"".join(e.data for e in evs if isinstance(e, sandlot.StdoutChunk)) == want


def test_retained_window_says_what_was_skipped(sb):
    p = sb.spawn("seq 1 20000", max_output_bytes=1000)
    r = p.wait(timeout=30)
    total = sum(len(str(i)) + 1 for i in range(1, 20001))
    assert r.exit_code == 0 and r.stdout_bytes == total and r.truncated
    assert len(r.stdout) == 1000 and r.stdout.endswith(b"19999\n20000\n")
    evs = list(p.output(follow=False, stdout_offset=0))
    assert evs[0] == sandlot.OutputSkipped("stdout", 0, total - 1000)
    with pytest.raises(sandlot.InvalidArgument):
        list(p.output(follow=False, stdout_offset=total + 1))


def test_signal_term_and_a_trapping_shell(sb):
    p = sb.spawn(["sleep", "60"])
    time.sleep(0.2)
    p.signal("SIGTERM")
    r = p.wait(timeout=20)
    assert (r.exit_code, r.signal, r.timed_out) == (143, 15, False), r
    # The signal reaches the command's process group: the shell's trap runs.
    p = sb.spawn("trap 'echo got TERM; exit 7' TERM; echo ready; "
                 "while true; do sleep 0.1; done")
    _read_until(p, b"ready\n")
    p.signal(15)
    r = p.wait(timeout=20)
    assert r.exit_code == 7 and r.signal is None and r.stdout == b"ready\ngot TERM\n", r
    with pytest.raises(sandlot.Conflict):
        p.signal("TERM")
    with pytest.raises(sandlot.InvalidArgument):
        sb.spawn("true").signal("SIGSTOP")


def test_signal_right_after_spawn_is_not_lost(sb):
    # Sent while the command is still being set up: delivered once it exists.
    p = sb.spawn(["sleep", "60"])
    p.signal("INT")
    r = p.wait(timeout=20)
    assert (r.exit_code, r.signal) == (130, 2), r


def test_kill_right_after_spawn_ends_it(sb):
    # SIGKILL while the command is still being set up. On `function` the helper had not
    # joined the exec cgroup yet, the group kill missed it and `sleep` ran on: 19 of 20 before
    # the fix (the E2B JS SDK's `commands.kill` right after a start found it).
    for _ in range(5):
        p = sb.spawn(["sleep", "60"])
        p.kill()
        r = p.wait(timeout=20)
        assert r is not None, "the killed process still runs"
        assert (r.exit_code, r.signal) == (137, 9), r


def test_kill_ends_the_whole_tree(sb):
    tag = f"{uuid.uuid4().int % 900000 + 100000}"
    p = _start_heartbeat(sb, tag)
    p.kill()
    r = p.wait(timeout=20)
    assert (r.exit_code, r.signal) == (137, 9), r
    _assert_heartbeat_stopped(sb, tag)
    wait_until(lambda: not host_processes_matching(f"sleep\x00{tag}".encode()), 10,
               what=f"the `sleep {tag}` processes to die")
    p.kill()  # already exited: no error


def test_delete_kills_and_forgets(sb):
    tag = f"{uuid.uuid4().int % 900000 + 100000}"
    p = _start_heartbeat(sb, tag)
    p.delete()
    with pytest.raises(sandlot.NotFound):
        p.refresh()
    _assert_heartbeat_stopped(sb, tag)


def test_wait_timeout_is_not_an_error(sb):
    p = sb.spawn("sleep 30")
    t0 = time.monotonic()
    assert p.wait(timeout=1) is None
    assert 0.9 <= time.monotonic() - t0 < 10
    assert p.running and p.result is None
    p.kill()
    assert p.wait(timeout=20).signal == 9


def test_stdin_interaction(sb):
    code = ("import sys\nfor l in sys.stdin:\n    print(l.strip().upper(), flush=True)\n"
            "print('bye')\n")
    p = sb.spawn(["python3", "-u", "-c", code], stdin="first\n", stdin_open=True)
    assert p.stdin_open
    _read_until(p, b"FIRST\n")
    p.write_stdin("hello\n")
    _read_until(p, b"HELLO\n")
    p.write_stdin(b"x\n", eof=True)
    r = p.wait(timeout=30)
    assert r.exit_code == 0 and r.stdout == b"FIRST\nHELLO\nX\nbye\n", r
    assert not p.stdin_open
    with pytest.raises(sandlot.Conflict):
        p.write_stdin("late\n")
    # Without stdin_open: initial bytes, then EOF; and no stdin calls.
    q = sb.spawn("cat; echo end", stdin="abc")
    assert q.wait(timeout=30).stdout == b"abcend\n"
    with pytest.raises(sandlot.Conflict):
        q.write_stdin("x")


def test_running_process_cap_is_429(make):
    box = make()
    procs = [box.spawn(["sleep", "120"]) for _ in range(16)]
    with pytest.raises(sandlot.ResourceExhausted):
        box.spawn(["sleep", "120"])
    procs[0].kill()
    procs[0].wait(timeout=20)
    box.spawn(["sleep", "120"]).kill()


def test_sandbox_delete_kills_its_processes(make, client):
    box = make()
    tag = f"{uuid.uuid4().int % 900000 + 100000}"
    p = box.spawn(f"sleep {tag} & sleep {tag}; echo never")
    box.exec("true")
    box.delete()
    wait_until(lambda: not host_processes_matching(f"sleep\x00{tag}".encode()), 15,
               what=f"the `sleep {tag}` processes to die")
    with pytest.raises(sandlot.NotFound):
        box.process(p.id)


def test_unknown_ids_and_bad_requests(sb, server):
    with pytest.raises(sandlot.NotFound):
        sb.process("pr-00000000000000000000")
    base = f"{server.url}/v1/sandboxes"
    with httpx.Client() as h:
        assert_error(h.get(f"{base}/sb-nope/processes"), "not_found")
        assert_error(h.post(f"{base}/sb-nope/processes", json={"cmd": "true"}), "not_found")
        pid = "pr-00000000000000000000"
        assert_error(h.post(f"{base}/{sb.id}/processes/{pid}/signal",
                            json={"signal": "TERM"}), "not_found")
        assert_error(h.post(f"{base}/{sb.id}/processes/{pid}/wait"), "not_found")
        assert_error(h.get(f"{base}/{sb.id}/processes/{pid}/output"), "not_found")
        assert_error(h.delete(f"{base}/{sb.id}/processes/{pid}"), "not_found")
        assert_error(h.post(f"{base}/{sb.id}/processes", json={"cmd": []}), "invalid_argument")
        assert_error(h.post(f"{base}/{sb.id}/processes",
                            json={"cmd": "true", "step": 0}), "invalid_argument")
        assert_error(h.post(f"{base}/{sb.id}/processes",
                            json={"cmd": "true", "max_output_bytes": 1 << 30}),
                     "invalid_argument")
        p = sb.spawn("true")
        assert_error(h.post(f"{base}/{sb.id}/processes/{p.id}/signal",
                            json={"signal": 99}), "invalid_argument")
        assert_error(h.post(f"{base}/{sb.id}/processes/{p.id}/wait",
                            params={"timeout_s": -1}), "invalid_argument")
        p.wait(timeout=20)


def test_asyncio_sdk(sb, server):
    import asyncio

    async def main():
        async with sandlot.AsyncClient(server.url) as ac:
            box = await ac.get(sb.id)
            p = await box.spawn(["python3", "-u", "-c",
                                 "import sys; print(sys.stdin.readline().strip()[::-1])"],
                                stdin_open=True)
            await p.write_stdin("olleh\n", eof=True)
            chunks = [ev.data async for ev in p.output(follow=True)
                      if isinstance(ev, sandlot.StdoutChunk)]
            assert b"".join(chunks) == b"hello\n"
            r = await p.wait(timeout=30)
            assert r.exit_code == 0 and r.stdout == b"hello\n"
            q = await box.spawn(["sleep", "60"])
            assert await q.wait(timeout=0.5) is None
            await q.kill()
            assert (await q.wait(timeout=20)).signal == 9
            assert {p.id, q.id} <= {x.id for x in await box.processes()}
            assert (await box.process(q.id)).state == "exited"

    asyncio.run(main())


def test_paused_sandbox_keeps_its_processes(make, client):
    tag = uuid.uuid4().hex[:12]
    box = make(labels={"procs-pause": tag})
    p = box.spawn("echo up; sleep 60")
    _read_until(p, b"up\n")
    assert client.pause({"procs-pause": tag}) == [box.id]
    try:
        with pytest.raises(sandlot.Conflict):
            p.signal("TERM")
        with pytest.raises(sandlot.Conflict):
            box.spawn("true")
        assert p.wait(timeout=0.5) is None and p.running
    finally:
        client.resume({"procs-pause": tag})
    p.signal("TERM")
    r = p.wait(timeout=20)
    assert (r.exit_code, r.signal) == (143, 15), r
