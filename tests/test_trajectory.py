"""Trajectory log (issue 4, contract in notes/traj-spec.md): SDK unit tests over a named
fake HTTP layer, then end-to-end tests against the real `sandlot up`.

End-to-end (root, the `python` image, the `sandlot` binary; each prints why it skips):
  * kill-and-rerun: tests/traj_agent.py (30 non-idempotent steps) is SIGKILLed at a
    seeded-random step (pre-arranged self-kill or an outside kill at a random time) and rerun
    from the start, 20 times; observations and final state equal an uninterrupted run,
    steps before the kill come back `replayed`, the append counter proves none ran twice.
    Seed: env SANDLOT_TRAJ_SEED (default 4242), printed.
  * kill -9 of `sandlot up` under concurrent trajectories (own server on one data dir):
    acknowledged steps survive with their exit codes and digests, none is logged twice.
    Iterations: env SANDLOT_CRASH_ITERS (default 100) within SANDLOT_CRASH_BUDGET_S (150).
  * divergence 409, step gap 400, unknown trajectory 404, restore replay (match and
    mismatch) and restore fail 409, reattach, delete of a log, pause/resume of 50 sandboxes.

Run: python3 -m pytest -q -rs tests/test_trajectory.py   (-k unit for the unit part only)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import sandlot
from conftest import Server, wait_until

import traj_agent

# ----------------------------------------------------------------------------- SDK unit tests
# No server: the HTTP layer is a named fake (`FakeTrajectoryServer`, an httpx.MockTransport
# handler) that keeps a step log like the contract's and records every request.

SB_WIRE = {"id": "sb-0123456789abcdef0123", "backend": "function", "image": "python",
           "state": "running", "node": "n1", "created_at": "2026-01-01T00:00:00Z",
           "expires_at": None, "cpu": 1.0, "memory_mib": 512, "disk_mib": 1024,
           "pids_max": 256, "ttl_s": 0, "labels": {}, "network": "none", "trajectory": None}


def _err(status: int, code: str, msg: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": msg}})


class FakeTrajectoryServer:
    """Fake HTTP layer for unit tests only: one sandbox, a step log keyed by step number
    (digest = the request's JSON minus `step`), answers in the wire shapes of the contract."""

    def __init__(self, trajectory="job/1", live=False):
        self.trajectory = trajectory
        self.live = live
        self.log = {}  # step -> (digest, result json)
        self.requests = []
        self.fail_next = None  # (status, code) answered once to the next mutating call

    def __call__(self, req: httpx.Request) -> httpx.Response:
        self.requests.append(req)
        path = req.url.path
        if path == "/v1/sandboxes" and req.method == "POST":
            body = json.loads(req.content)
            sb = dict(SB_WIRE, trajectory=body.get("trajectory"))
            if body.get("restore") == "replay":
                sb["restore"] = {"replayed_steps": 2, "mismatches": [
                    {"step": 1, "logged_exit_code": 0, "exit_code": 1}]}
            return httpx.Response(200 if self.live else 201, json=sb)
        if path == f"/v1/sandboxes/{SB_WIRE['id']}" and req.method == "GET":
            return httpx.Response(200, json=dict(SB_WIRE, trajectory=self.trajectory))
        if path.startswith("/v1/trajectories/"):
            if req.url.raw_path.decode() != "/v1/trajectories/job%2F1":
                return _err(404, "not_found", "unknown trajectory")
            if req.method == "DELETE":
                return httpx.Response(204)
            return httpx.Response(200, json={
                "id": "job/1", "sandbox_id": SB_WIRE["id"], "next_step": len(self.log),
                "steps": [{"step": s, "kind": "exec", "digest": d, "exit_code": 0,
                           "created_at": "2026-01-01T00:00:00Z", "replay_count": 1}
                          for s, (d, _) in sorted(self.log.items())],
                "replayed_total": len(self.log)})
        if path in ("/v1/sandboxes:pause", "/v1/sandboxes:resume"):
            labels = json.loads(req.content)["labels"]
            return httpx.Response(200, json={
                "sandboxes": [SB_WIRE["id"]] if labels else [],
                "failed": [{"id": "sb-x", "error": {"code": "unavailable", "message": "m"}}]})
        if self.fail_next is not None:
            status, code = self.fail_next
            self.fail_next = None
            return _err(status, code, "injected")
        if path.endswith("/exec"):
            body = json.loads(req.content)
            step = body.pop("step", None)
            result = {"exit_code": 0, "stdout": body["cmd"] if isinstance(body["cmd"], str)
                      else " ".join(body["cmd"]), "replayed": False}
            return self._logged(step, json.dumps(body, sort_keys=True), result,
                                lambda r: httpx.Response(200, json=r))
        if path.endswith("/files") or path.endswith("/files/list"):
            step = req.url.params.get("step")
            digest = f"{req.method} {req.url.params['path']} {req.content!r}"
            return self._logged(None if step is None else int(step), digest, {},
                                lambda r: httpx.Response(
                                    200 if req.method == "GET" else 204,
                                    content=b'{"entries": []}' if path.endswith("list")
                                    else b"" if req.method != "GET" else b"data",
                                    headers={"Sandlot-Replayed": "true"} if r.get("replayed")
                                    else {}))
        return _err(404, "not_found", path)

    def _logged(self, step, digest, result, answer):
        if step is None:
            return answer(result)
        nxt = len(self.log)
        if step < nxt:
            logged_digest, logged = self.log[step]
            if logged_digest != digest:
                return _err(409, "conflict", f"step {step} diverges")
            return answer(dict(logged, replayed=True))
        if step > nxt:
            return _err(400, "invalid_argument", f"step {step} is beyond the next step {nxt}")
        self.log[step] = (digest, result)
        return answer(result)

    def steps_sent(self):
        """Step of every exec/file request, in order (None = unlogged)."""
        out = []
        for r in self.requests:
            if r.url.path.endswith("/exec"):
                out.append(json.loads(r.content).get("step"))
            elif "/files" in r.url.path:
                s = r.url.params.get("step")
                out.append(None if s is None else int(s))
        return out


def _fake_sync(fake):
    c = sandlot.Client("http://fake", retries=0)
    c._http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(fake))
    return c


def _fake_async(fake):
    c = sandlot.AsyncClient("http://fake", retries=0)
    c._http = httpx.AsyncClient(base_url="http://fake", transport=httpx.MockTransport(fake))
    return c


def test_unit_create_body_carries_trajectory_and_restore():
    fake = FakeTrajectoryServer()
    c = _fake_sync(fake)
    sb = c.create(trajectory="job/1", restore="replay", memory_mib=64)
    body = json.loads(fake.requests[-1].content)
    assert body["trajectory"] == "job/1" and body["restore"] == "replay"
    assert body["memory_mib"] == 64
    assert sb.trajectory == "job/1" and sb.next_step == 0 and not sb.reattached
    assert sb.restore is not None and sb.restore.replayed_steps == 2 and not sb.restore.ok
    assert sb.restore.mismatches[0] == sandlot.RestoreMismatch(1, 0, 1)
    sb.refresh()  # a later answer without `restore` keeps the report
    assert sb.restore is not None
    with pytest.raises(ValueError):
        c.create(trajectory="job/1", restore="sometimes")
    # Without a trajectory neither field is sent (older servers reject unknown fields).
    c.create()
    assert "trajectory" not in json.loads(fake.requests[-1].content)
    assert "restore" not in json.loads(fake.requests[-1].content)


def test_unit_attach_sends_only_the_trajectory_and_sees_reattach():
    fake = FakeTrajectoryServer(live=True)
    c = _fake_sync(fake)
    sb = c.attach("job/1")
    assert json.loads(fake.requests[-1].content) == {"trajectory": "job/1"}
    assert sb.reattached and sb.next_step == 0


def test_unit_steps_are_numbered_and_replayed():
    fake = FakeTrajectoryServer()
    c = _fake_sync(fake)
    sb = c.create(trajectory="job/1")
    assert sb.exec("mkdir a").replayed is False            # step 0
    sb.write_file("f.txt", "x")                            # step 1
    assert sb.last_replayed is False
    assert sb.read_file("f.txt") == b"data"                # unlogged read
    sb.list_dir(".")                                       # unlogged
    sb.remove("f.txt")                                     # step 2
    assert sb.read_file("f.txt", step=3) == b"data"        # a read logged on request
    assert sb.next_step == 4
    assert fake.steps_sent() == [0, 1, None, None, 2, 3]
    # The trainer restarts: a new handle replays from step 0.
    sb2 = c.attach("job/1")
    r = sb2.exec("mkdir a")
    assert r.replayed and sb2.last_replayed and r.stdout == b"mkdir a"
    sb2.write_file("f.txt", "x")
    assert sb2.last_replayed
    # An explicit step moves the counter.
    sb2.exec("mkdir a", step=0)
    assert sb2.next_step == 1
    sb2.exec("echo new", step=4)
    assert sb2.next_step == 5 and sb2.last_replayed is False


def test_unit_failed_call_gives_its_step_back():
    fake = FakeTrajectoryServer()
    c = _fake_sync(fake)
    sb = c.create(trajectory="job/1")
    sb.exec("echo a")
    with pytest.raises(sandlot.Conflict):
        sb.exec("echo DIFFERENT", step=0)
    assert sb.next_step == 1
    fake.fail_next = (503, "unavailable")
    with pytest.raises(sandlot.Unavailable):
        sb.exec("echo b")
    assert sb.next_step == 1  # a retry carries the same step
    sb.exec("echo b")
    assert fake.steps_sent()[-1] == 1 and sb.next_step == 2
    with pytest.raises(sandlot.InvalidArgument, match="beyond"):
        sb.exec("echo c", step=7)
    assert sb.next_step == 2
    with pytest.raises(ValueError):
        sb.exec("echo c", step=-1)
    fake.fail_next = (500, "internal")
    with pytest.raises(sandlot.InternalError):
        sb.write_file("x", "y")
    assert sb.next_step == 2


def test_unit_stream_exec_numbers_steps():
    def routes(req):
        body = json.loads(req.content)
        ev = {"type": "exit", "result": {"exit_code": 0, "replayed": body.get("step") == 0}}
        return httpx.Response(200, content=json.dumps(ev).encode() + b"\n")

    c = _fake_sync(routes)
    sb = sandlot.Sandbox(c, dict(SB_WIRE, trajectory="t"))
    evs = list(sb.exec_stream("echo hi"))
    assert evs[-1].replayed and sb.last_replayed and sb.next_step == 1


def test_unit_unbound_sandbox_sends_no_step_unless_asked():
    fake = FakeTrajectoryServer()
    c = _fake_sync(fake)
    sb = c.create()
    sb.exec("true")
    sb.write_file("a", "b")
    sb.exec("true", step=0)  # passed through; a real server answers 400
    assert fake.steps_sent() == [None, None, 0]


def test_unit_trajectory_info_pause_resume():
    fake = FakeTrajectoryServer()
    c = _fake_sync(fake)
    sb = c.create(trajectory="job/1")
    sb.exec("true")
    sb.exec("false")
    info = c.trajectory("job/1")  # the `/` travels percent-encoded
    assert info.id == "job/1" and info.next_step == 2 and info.sandbox_id == SB_WIRE["id"]
    assert [s.step for s in info.steps] == [0, 1] and info.steps[0].kind == "exec"
    assert info.replayed_total == 2
    with pytest.raises(sandlot.NotFound):
        c.trajectory("other")
    c.delete_trajectory("job/1")
    assert fake.requests[-1].method == "DELETE"
    paused = c.pause(labels={"job": "42"})
    assert paused == [SB_WIRE["id"]]
    assert isinstance(paused.failed["sb-x"], sandlot.Unavailable)
    assert json.loads(fake.requests[-1].content) == {"labels": {"job": "42"}}
    assert c.resume(labels={"job": "42"}) == [SB_WIRE["id"]]
    assert fake.requests[-1].url.path == "/v1/sandboxes:resume"
    with pytest.raises(ValueError):
        c.pause(labels={})


def test_unit_async_mirrors_trajectory_features():
    async def main():
        fake = FakeTrajectoryServer()
        c = _fake_async(fake)
        sb = await c.create(trajectory="job/1")
        assert (await sb.exec("mkdir a")).replayed is False
        await sb.write_file("f", "x")
        await sb.remove("f")
        assert await sb.read_file("f") == b"data"
        sb2 = await c.attach("job/1")
        assert (await sb2.exec("mkdir a")).replayed
        await sb2.write_file("f", "x")
        assert sb2.last_replayed and sb2.next_step == 2
        fake.fail_next = (503, "unavailable")
        with pytest.raises(sandlot.Unavailable):
            await sb2.remove("f")
        assert sb2.next_step == 2
        info = await c.trajectory("job/1")
        assert info.next_step == 3
        assert await c.pause(labels={"a": "b"}) == [SB_WIRE["id"]]
        assert await c.resume(labels={"a": "b"}) == [SB_WIRE["id"]]
        await c.delete_trajectory("job/1")
        assert fake.steps_sent() == [0, 1, 2, None, 0, 1, 2]
        await c.aclose()

    asyncio.run(main())


# ----------------------------------------------------------------------------- e2e helpers

AGENT = Path(__file__).resolve().parent / "traj_agent.py"
RUN_ID = f"{int(time.time())}-{os.getpid()}"
STATE_CMD = ("cd /workspace && find . | sort && echo --- && "
             "find . -type f | sort | xargs -r sha256sum && echo --- && cat counter")


def tid(name: str) -> str:
    """A trajectory id unique to this test run (ids may contain `/` and `:`)."""
    return f"e2e/{RUN_ID}/{name}"


def unlogged(url: str, sb_id: str, method: str, suffix: str, **kw) -> httpx.Response:
    """A call without `step` (the contract's unlogged escape hatch), bypassing the SDK's
    automatic step numbering."""
    r = httpx.request(method, f"{url}/v1/sandboxes/{sb_id}{suffix}", timeout=60, **kw)
    assert r.status_code < 300, (r.status_code, r.text)
    return r


def state_of(url: str, sb_id: str) -> str:
    """Listing, content hashes and counter of /workspace, read without logging."""
    r = unlogged(url, sb_id, "POST", "/exec", json={"cmd": STATE_CMD})
    body = r.json()
    assert body["exit_code"] == 0, body
    return body["stdout"]


def run_agent(url: str, trajectory: str, kill_after=None, kill_delay=None):
    """Run tests/traj_agent.py; returns (events, returncode). ``kill_after``: the agent
    SIGKILLs itself after that step; ``kill_delay``: SIGKILL from here after that many s."""
    env = dict(os.environ)
    env.pop("SANDLOT_AGENT_KILL_AFTER", None)
    if kill_after is not None:
        env["SANDLOT_AGENT_KILL_AFTER"] = str(kill_after)
    p = subprocess.Popen([sys.executable, str(AGENT), url, trajectory], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if kill_delay is not None:
        try:
            p.wait(timeout=kill_delay)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    events = []
    lines = out.decode().splitlines()
    for n, line in enumerate(lines):
        try:
            events.append(json.loads(line))
        except ValueError:
            # Only an outside kill can cut a line short, and only the last one.
            assert kill_delay is not None and n == len(lines) - 1, line
    if p.returncode not in (0, -signal.SIGKILL):
        pytest.fail(f"agent exited {p.returncode}: {err.decode()[-3000:]}")
    return events, p.returncode, err.decode()


def step_events(events):
    return [e for e in events if e.get("event") == "step"]


def sandbox_event(events):
    for e in events:
        if e.get("event") == "sandbox":
            return e
    return None


@pytest.fixture
def tclient(server, python_image):
    c = sandlot.Client(server.url, timeout=60)
    yield c
    c.close()


# ----------------------------------------------------------------------------- kill-and-rerun

def test_kill_and_rerun_agent_20_times(server, tclient, python_image):
    seed = int(os.environ.get("SANDLOT_TRAJ_SEED", "4242"))
    rng = random.Random(seed)
    print(f"\nkill-and-rerun seed {seed} (SANDLOT_TRAJ_SEED)")
    t0 = time.monotonic()
    ref_events, rc, _ = run_agent(server.url, tid("ref"))
    ref_wall = time.monotonic() - t0
    assert rc == 0 and ref_events[-1] == {"event": "done"}
    ref_steps = step_events(ref_events)
    assert len(ref_steps) == traj_agent.N_STEPS
    assert not any(s["replayed"] for s in ref_steps)
    ref_sb = sandbox_event(ref_events)["id"]
    ref_state = state_of(server.url, ref_sb)
    appends = traj_agent.append_steps()
    assert ref_state.rstrip("\n").split("---\n")[-1].split() == [str(a) for a in appends]
    ref_obs = [s["obs"] for s in ref_steps]
    # The uninterrupted run did what a non-idempotent loop does once: mkdir succeeded.
    assert all(s["obs"]["exit_code"] == 0 for s in ref_steps if s["obs"] is not None)
    tclient.delete(ref_sb)

    # Iterations 0..13: the agent kills itself after step k; 14..19: killed from outside.
    plan = []
    ks = rng.sample(range(traj_agent.N_STEPS - 1), 14)
    for k in ks:
        plan.append(("self", k))
    for _ in range(6):
        plan.append(("outside", rng.uniform(0.3, max(0.4, ref_wall))))
    print(f"reference run {ref_wall:.2f}s; plan {[(m, round(v, 2)) for m, v in plan]}")
    for it, (mode, val) in enumerate(plan):
        t = tid(f"kill-{it}")
        ev1, rc1, err1 = run_agent(server.url, t, kill_after=val if mode == "self" else None,
                                   kill_delay=val if mode == "outside" else None)
        s1 = step_events(ev1)
        m = len(s1)
        if mode == "self":
            assert rc1 == -signal.SIGKILL and m == val + 1, (rc1, m, err1[-2000:])
        # What the killed run saw is the reference's prefix, executed (fresh trajectory).
        assert [s["obs"] for s in s1] == ref_obs[:m]
        assert not any(s["replayed"] for s in s1)
        ev2, rc2, err2 = run_agent(server.url, t)
        assert rc2 == 0 and ev2[-1] == {"event": "done"}, err2[-3000:]
        s2 = step_events(ev2)
        where = f"iteration {it} ({mode} {val}), killed run printed {m} steps"
        assert [s["obs"] for s in s2] == ref_obs, where
        replayed = [s["replayed"] for s in s2]
        assert all(replayed[:m]), (where, replayed)
        if mode == "self":
            assert replayed == [True] * m + [False] * (traj_agent.N_STEPS - m), (where, replayed)
            assert sandbox_event(ev2)["reattached"], where
        else:
            # The step in flight at the kill may have been logged; nothing after it.
            assert not any(replayed[m + 1:]), (where, replayed)
        sb_id = sandbox_event(ev2)["id"]
        if sandbox_event(ev1) is not None:
            assert sandbox_event(ev1)["id"] == sb_id, where
        assert state_of(server.url, sb_id) == ref_state, where
        info = tclient.trajectory(t)
        assert info.sandbox_id == sb_id and info.next_step == traj_agent.N_STEPS
        assert [s.step for s in info.steps] == list(range(traj_agent.N_STEPS))
        assert [s.replay_count for s in info.steps] == [int(r) for r in replayed], where
        assert info.replayed_total == sum(replayed)
        kinds = [s.kind for s in info.steps]
        assert kinds == [{"write": "write_file", "remove": "remove_file"}.get(k, "exec")
                         for k, _ in traj_agent.steps()]
        assert [s.exit_code for s in info.steps] == [
            None if o is None else o["exit_code"] for o in ref_obs]
        if it == 0:
            print("GET /v1/trajectories/{id} of a real run (first 3 steps):\n"
                  + json.dumps(dict(info.raw, steps=info.raw["steps"][:3]), indent=1))
        tclient.delete(sb_id)
        tclient.delete_trajectory(t)
    print(f"20 kill-and-rerun iterations in {time.monotonic() - t0:.1f}s")


# ----------------------------------------------------------------------------- server kill -9

def _cmd(t: int, s: int) -> str:
    return f"echo {s} >> /workspace/steps; echo t{t}s{s}; exit {s % 3}"


def test_kill9_server_under_concurrent_trajectories(binary, tmp_path, python_image, log_dir):
    """kill -9 of `sandlot up` at random moments while 4 trajectories run steps (each a
    non-idempotent append to /workspace/steps); restart on the same data dir; check every
    acknowledged step is logged with its exit code and an unchanged digest, step numbers
    are unique and contiguous from 0, a re-issued acknowledged step is replayed, and only a
    step in flight at a kill may have run twice. 100 iterations (SANDLOT_CRASH_ITERS) or as
    many as fit in SANDLOT_CRASH_BUDGET_S (default 150 s; at least 20 required)."""
    iters = int(os.environ.get("SANDLOT_CRASH_ITERS", "100"))
    budget = float(os.environ.get("SANDLOT_CRASH_BUDGET_S", "150"))
    seed = int(os.environ.get("SANDLOT_TRAJ_SEED", "4242"))
    rng = random.Random(seed + 1)
    srv = Server(binary, tmp_path / "data", log_dir / f"crash-{RUN_ID}.log")
    srv.start()
    n_traj, per_iter = 4, 6
    c = sandlot.Client(srv.url, timeout=20, retries=0)
    try:
        ts = [tid(f"crash-{i}") for i in range(n_traj)]
        boxes = [c.create(image=python_image, memory_mib=64, ttl_s=900, trajectory=t)
                 for t in ts]
        acked = [dict() for _ in ts]        # step -> (exit_code, stdout)
        inflight = [set() for _ in ts]      # steps whose call failed at a kill
        digests = [dict() for _ in ts]      # step -> digest first seen
        unacked_logged = set()              # (trajectory, step) logged though the call failed
        t0 = time.monotonic()
        done = 0
        for it in range(iters):
            if time.monotonic() - t0 > budget:
                break

            def worker(i: int) -> None:
                sb = boxes[i]
                for _ in range(per_iter):
                    s = sb.next_step
                    try:
                        r = sb.exec(_cmd(i, s), timeout_s=10)
                    except sandlot.SandlotError:
                        inflight[i].add(s)
                        return
                    assert r.exit_code == s % 3 and r.stdout == f"t{i}s{s}\n".encode(), r
                    if s in acked[i]:
                        assert (r.exit_code, r.stdout) == acked[i][s]
                    acked[i][s] = (r.exit_code, r.stdout)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_traj)]
            for th in threads:
                th.start()
            time.sleep(rng.uniform(0.0, 0.25))
            srv.kill()
            for th in threads:
                th.join(30)
                assert not th.is_alive()
            srv.start()
            for i, t in enumerate(ts):
                info = c.trajectory(t)
                nums = [s.step for s in info.steps]
                assert nums == list(range(len(nums))), (it, t, nums)
                assert info.next_step == len(nums)
                missing = sorted(set(acked[i]) - set(nums))
                assert not missing, f"iteration {it}: acknowledged steps {missing} of {t} lost"
                for st in info.steps:
                    if st.step in acked[i]:
                        assert st.exit_code == acked[i][st.step][0], (it, t, st)
                    else:
                        assert st.step in inflight[i], (it, t, st, "logged, never sent")
                        unacked_logged.add((i, st.step))
                    assert digests[i].setdefault(st.step, st.digest) == st.digest, (it, t, st)
                # A re-issued acknowledged step comes back from the log, unchanged.
                if acked[i]:
                    s = rng.choice(sorted(acked[i]))
                    again = c.attach(t).exec(_cmd(i, s), step=s, timeout_s=10)
                    assert again.replayed and (again.exit_code, again.stdout) == acked[i][s]
            done = it + 1
        wall = time.monotonic() - t0
        print(f"\nkill -9 iterations: {done} in {wall:.1f}s (seed {seed + 1}); logged steps "
              f"{[len(a) for a in acked]}; steps in flight at a kill {[len(f) for f in inflight]}, "
              f"of which logged before the answer was lost: {len(unacked_logged)}")
        assert done >= min(iters, 20), f"only {done} iterations fit in {budget}s"
        for i, sb in enumerate(boxes):
            lines = sb.read_file("steps").decode().split()
            counts = {}
            for x in lines:
                counts[int(x)] = counts.get(int(x), 0) + 1
            n = c.trajectory(ts[i]).next_step
            assert all(counts.get(s, 0) >= 1 for s in range(n)), "a logged step never ran"
            twice = {s for s, k in counts.items() if k > 1}
            assert twice <= inflight[i], f"acknowledged steps ran twice: {twice - inflight[i]}"
            sb.delete()
    except Exception:
        print(srv.log_tail())
        raise
    finally:
        c.close()
        srv.stop()


# ----------------------------------------------------------------------------- semantics

def test_divergence_gap_unknown_and_reattach(server, tclient, python_image):
    t = tid("semantics")
    sb = tclient.create(image=python_image, memory_mib=64, ttl_s=300, trajectory=t,
                        labels={"test": "traj-semantics"})
    try:
        assert sb.trajectory == t and not sb.reattached
        assert sb.exec("echo a").stdout == b"a\n"                     # step 0
        sb.write_file("f.txt", "v1")                                  # step 1
        # Same step, other request → 409 naming the step and both digests; counter kept.
        with pytest.raises(sandlot.Conflict) as ei:
            sb.exec("echo b", step=0)
        assert "step 0" in ei.value.message
        assert len(re.findall(r"\b[0-9a-f]{64}\b", ei.value.message)) == 2, ei.value.message
        with pytest.raises(sandlot.Conflict, match="step 1"):
            sb.write_file("f.txt", "v2", step=1)
        # Beyond the next step → 400.
        with pytest.raises(sandlot.InvalidArgument) as ei:
            sb.exec("echo c", step=5)
        assert "5" in ei.value.message and "2" in ei.value.message
        assert sb.next_step == 2
        # A replayed write does not touch the file: change it unlogged, replay step 1.
        unlogged(server.url, sb.id, "PUT", "/files", params={"path": "f.txt"},
                 content=b"changed")
        sb2 = tclient.create(image=python_image, memory_mib=999, trajectory=t)  # reattach
        assert sb2.id == sb.id and sb2.reattached and sb2.memory_mib == 64
        r = sb2.exec("echo a")
        assert r.replayed and r.stdout == b"a\n"
        sb2.write_file("f.txt", "v1")
        assert sb2.last_replayed
        assert sb2.read_file("f.txt") == b"changed"
        # Step 2 runs; a read given a step is logged as read_file.
        sb2.remove("f.txt")
        assert not sb2.last_replayed
        sb2.write_file("g.txt", "g")
        assert sb2.read_file("g.txt", step=4) == b"g"
        assert [e.name for e in sb2.list_dir(".", step=5)] == ["g.txt"]
        info = tclient.trajectory(t)
        assert [s.kind for s in info.steps] == ["exec", "write_file", "remove_file",
                                                "write_file", "read_file", "list_dir"]
        assert info.steps[0].exit_code == 0 and info.steps[1].exit_code is None
        assert [s.replay_count for s in info.steps] == [1, 1, 0, 0, 0, 0]
        assert info.replayed_total == 2 and info.next_step == 6
        assert all(re.fullmatch(r"[0-9a-f]{64}", s.digest) for s in info.steps)
        # A logged read replays from the log even when the file changed since.
        unlogged(server.url, sb.id, "PUT", "/files", params={"path": "g.txt"}, content=b"G2")
        sb3 = tclient.attach(t)
        assert sb3.read_file("g.txt", step=4) == b"g" and sb3.last_replayed
        # No step on a trajectory sandbox: runs unlogged (raw call, the SDK would number it).
        unlogged(server.url, sb.id, "POST", "/exec", json={"cmd": "true"})
        assert tclient.trajectory(t).next_step == 6
        # Unknown trajectory → 404; DELETE of an unknown one → 204.
        with pytest.raises(sandlot.NotFound):
            tclient.trajectory(tid("never-seen"))
        tclient.delete_trajectory(tid("never-seen"))
        # Bad ids → 400.
        for bad in ("", "x" * 201, "sp ace", "semi;colon"):
            with pytest.raises(sandlot.InvalidArgument):
                tclient.create(image=python_image, memory_mib=64, trajectory=bad)
        # DELETE of the log: sandbox keeps running, log restarts at step 0.
        tclient.delete_trajectory(t)
        # The log is gone; T stays known through its live sandbox, with no steps.
        info = tclient.trajectory(t)
        assert info.steps == [] and info.next_step == 0 and info.sandbox_id == sb.id
        assert tclient.get(sb.id).state == "running"
        sb4 = tclient.attach(t)
        assert sb4.id == sb.id
        r = sb4.exec("echo a")
        assert not r.replayed
        assert tclient.trajectory(t).next_step == 1
    finally:
        sb.delete()


def test_step_on_sandbox_without_trajectory_is_400(tclient, python_image):
    with tclient.create(image=python_image, memory_mib=64, ttl_s=120) as sb:
        with pytest.raises(sandlot.InvalidArgument):
            sb.exec("true", step=0)
        with pytest.raises(sandlot.InvalidArgument):
            sb.write_file("a", "b", step=0)
        assert sb.exec("true").exit_code == 0


def test_restore_replay_match_mismatch_and_fail(server, tclient, python_image):
    t_ok, t_bad = tid("restore-ok"), tid("restore-bad")
    a = tclient.create(image=python_image, memory_mib=64, ttl_s=300, trajectory=t_ok)
    a.write_file("src/x.txt", "hello")
    assert a.exec("mkdir out && cp src/x.txt out/y.txt").exit_code == 0
    assert a.exec("echo 1 >> counter").exit_code == 0
    a.write_file("tmp.txt", "t")
    a.remove("tmp.txt")
    assert a.exec("test -e tmp.txt").exit_code == 1
    b = tclient.create(image=python_image, memory_mib=64, ttl_s=300, trajectory=t_bad)
    # The step reads a file written outside the log, so a replay cannot reproduce it.
    unlogged(server.url, b.id, "PUT", "/files", params={"path": "secret"}, content=b"s")
    assert b.exec("cat secret").exit_code == 0
    assert b.exec("echo after").exit_code == 0
    a.delete()
    b.delete()
    for t, n in ((t_ok, 6), (t_bad, 2)):
        # Sandbox gone, steps logged: restore="fail" (default, and attach) → 409.
        with pytest.raises(sandlot.Conflict) as ei:
            tclient.create(image=python_image, memory_mib=64, trajectory=t)
        assert str(n) in ei.value.message and "replay" in ei.value.message, ei.value.message
        with pytest.raises(sandlot.Conflict):
            tclient.create(image=python_image, memory_mib=64, trajectory=t, restore="fail")
        with pytest.raises(sandlot.Conflict):
            tclient.attach(t)
        assert tclient.trajectory(t).sandbox_id is None
    ra = tclient.create(image=python_image, memory_mib=64, ttl_s=300, trajectory=t_ok,
                        restore="replay")
    rb = tclient.create(image=python_image, memory_mib=64, ttl_s=300, trajectory=t_bad,
                        restore="replay")
    try:
        assert ra.restore is not None and ra.restore.replayed_steps == 6, ra.raw
        assert ra.restore.mismatches == [] and ra.restore.ok
        assert ra.read_file("out/y.txt") == b"hello" and ra.read_file("counter") == b"1\n"
        assert "tmp.txt" not in [e.name for e in ra.list_dir(".")]
        assert rb.restore is not None and rb.restore.replayed_steps == 2, rb.raw
        assert rb.restore.mismatches == [sandlot.RestoreMismatch(0, 0, 1)], rb.raw
        # The log is unchanged by a restore; the agent's rerun replays from it.
        info = tclient.trajectory(t_ok)
        assert info.sandbox_id == ra.id and info.next_step == 6
        assert [s.replay_count for s in info.steps] == [0] * 6
        again = tclient.attach(t_ok)
        assert again.id == ra.id
        again.write_file("src/x.txt", "hello")
        assert again.last_replayed
        r = again.exec("mkdir out && cp src/x.txt out/y.txt")
        assert r.replayed and r.exit_code == 0
        assert again.exec("echo 1 >> counter").replayed
        assert again.read_file("counter") == b"1\n"
        assert rb.exec("echo new", step=2).replayed is False
    finally:
        ra.delete()
        rb.delete()


def test_pause_resume_50_sandboxes_by_label(server, tclient, python_image):
    job = f"pause-{RUN_ID}"
    with ThreadPoolExecutor(8) as ex:
        boxes = list(ex.map(lambda i: tclient.create(
            image=python_image, memory_mib=32, pids_max=32, ttl_s=300,
            labels={"job": job, "test": "traj-pause"}), range(50)))
        others = list(ex.map(lambda i: tclient.create(
            image=python_image, memory_mib=32, pids_max=32, ttl_s=300,
            labels={"job": job + "-other", "test": "traj-pause"}), range(3)))
    ids = {b.id for b in boxes}
    try:
        with pytest.raises(sandlot.InvalidArgument):
            r = httpx.post(f"{server.url}/v1/sandboxes:pause", json={"labels": {}}, timeout=30)
            raise sandlot.errors.error_from_response(r.status_code, r.content, r.headers)
        # A process printing every 50 ms in one sandbox proves the freeze: no output while
        # paused (a frozen cgroup gets no CPU), output again after resume.
        ticks = []

        def ticker():
            code = "import time\nfor i in range(300):\n print(i, flush=True)\n time.sleep(0.05)"
            for ev in boxes[0].exec_stream(["python3", "-u", "-c", code], timeout_s=60):
                if isinstance(ev, sandlot.StdoutChunk):
                    ticks.append(time.monotonic())
        th = threading.Thread(target=ticker, daemon=True)
        th.start()
        wait_until(lambda: len(ticks) >= 5, 30, what="ticker output")
        paused = tclient.pause(labels={"job": job})
        t_paused = time.monotonic()
        assert set(paused) == ids and paused.failed == {}
        assert all(b.state == "paused" for b in tclient.list(labels={"job": job}))
        assert all(b.state == "running" for b in tclient.list(labels={"job": job + "-other"}))
        time.sleep(1.0)
        frozen_ticks = [x for x in ticks if t_paused + 0.3 < x]
        assert frozen_ticks == [], f"{len(frozen_ticks)} outputs while paused"
        with pytest.raises(sandlot.Conflict, match="paused"):
            boxes[1].exec("true")
        with pytest.raises(sandlot.Conflict):
            boxes[1].write_file("a", "b")
        with pytest.raises(sandlot.Conflict):
            boxes[1].keepalive()
        assert others[0].exec("echo up").stdout == b"up\n"
        # Delete works on a paused sandbox.
        victim = boxes.pop()
        victim.delete()
        try:
            assert tclient.get(victim.id).state in ("deleting", "deleted")
        except sandlot.NotFound:
            pass
        n_before = len(ticks)
        resumed = tclient.resume(labels={"job": job})
        assert set(resumed) == {b.id for b in boxes}
        wait_until(lambda: len(ticks) > n_before + 3, 30, what="ticker output after resume")
        assert all(b.state == "running" for b in tclient.list(labels={"job": job}))
        with ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda b: b.exec(f"echo {b.id}").stdout, boxes))
        assert outs == [f"{b.id}\n".encode() for b in boxes]
    finally:
        tclient.resume(labels={"job": job})
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda b: b.delete(), boxes + others))
