"""E2B state across the servers of a cluster (issue 21): a process started with the
unmodified `e2b` SDK through server A is listed, followed, fed stdin and killed by its pid
through server B, and found by its `tag` there; a code-interpreter context made through A
is run in, restarted and removed through B; a snapshot named through A is listed by that
name, created from and deleted through B. Pids and contexts are the sandbox's node's
tagged processes, snapshot names rows of the shared registry (docs/e2b.md), so no server
keeps a table of its own.

Runs only against a cluster of two servers (``SANDLOT_CONFORMANCE_CLUSTER``, as
scripts/conformance-cluster.sh starts it), in the ``function`` case (the suite parametrises
every test by case; E2B sandboxes are made on the servers' E2B backend, default function);
elsewhere it skips with the reason. Template = the suite's image; the test deletes it.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict

import httpx
import pytest

from conftest import wait_until

e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (scripts/setup.sh)")
from e2b import CommandExitException, Sandbox  # noqa: E402

#: Any key: the cluster's servers run without API keys.
KEY = "e2b_sandlot_no_auth"
#: The suite's image (tests/conformance/conftest.py IMAGE) as the E2B template.
TEMPLATE = os.environ.get("SANDLOT_CONFORMANCE_IMAGE", "python")


def _envelope(msg: Dict[str, Any]) -> bytes:
    """One Connect stream message: flags 0, big-endian length, JSON."""
    raw = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(raw)) + raw


def _start_tagged(url: str, sandbox_id: str, tag: str) -> int:
    """`process.Process/Start` of `sleep 60` with `tag` through ``url`` (the SDK has no
    `tag` argument); reads the `start` event and leaves the stream: the process runs on."""
    body = _envelope({"process": {"cmd": "sleep", "args": ["60"]}, "tag": tag})
    headers = {"E2b-Sandbox-Id": sandbox_id, "Content-Type": "application/connect+json",
               "Connect-Protocol-Version": "1"}
    with httpx.stream("POST", f"{url}/process.Process/Start", content=body, headers=headers,
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        buf = b""
        for chunk in r.iter_bytes():
            buf += chunk
            if len(buf) >= 5:
                n = struct.unpack(">I", buf[1:5])[0]
                if len(buf) >= 5 + n:
                    return json.loads(buf[5:5 + n])["event"]["start"]["pid"]
    pytest.fail(f"no start event: {buf!r}")


def _unary(url: str, sandbox_id: str, method: str, msg: Dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/process.Process/{method}", json=msg, timeout=30,
                      headers={"E2b-Sandbox-Id": sandbox_id, "Connect-Protocol-Version": "1"})


def test_e2b_pids_and_tags_reach_across_servers(server, backend):
    a, b = _cluster_urls(server, backend)
    on_a = Sandbox.create(template=TEMPLATE, timeout=120, api_url=a, sandbox_url=a, api_key=KEY,
                          metadata={"test": "e2b-cluster-pids"})
    try:
        on_b = Sandbox.connect(on_a.sandbox_id, api_url=b, sandbox_url=b, api_key=KEY)
        cat = on_a.commands.run("cat; echo done", background=True, stdin=True)
        assert cat.pid >= 1000
        listed = {p.pid: p for p in on_b.commands.list()}
        assert cat.pid in listed, f"B does not list A's pid {cat.pid}: {listed}"
        assert listed[cat.pid].cmd == "/bin/bash"
        assert listed[cat.pid].args[-1] == "cat; echo done"
        follower = on_b.commands.connect(cat.pid)
        on_b.commands.send_stdin(cat.pid, "through b\n")
        on_b.commands.close_stdin(cat.pid)
        assert follower.wait().stdout == "through b\ndone\n"
        assert cat.wait().stdout == "through b\ndone\n", "A's own stream saw B's input"

        sleeper = on_a.commands.run("echo up; sleep 60", background=True)
        assert sleeper.pid > cat.pid, "pids count up per sandbox"
        assert on_b.commands.kill(sleeper.pid) is True
        with pytest.raises(CommandExitException) as ei:
            sleeper.wait()
        assert ei.value.exit_code == -1
        assert on_b.commands.kill(sleeper.pid) is False, "an ended process is not found"
        assert on_a.commands.kill(sleeper.pid) is False

        pid = _start_tagged(a, on_a.sandbox_id, "svc-cluster")
        tags = {p.tag: p.pid for p in on_b.commands.list()}
        assert tags.get("svc-cluster") == pid
        r = _unary(b, on_a.sandbox_id, "SendSignal",
                   {"process": {"tag": "svc-cluster"}, "signal": "SIGNAL_SIGKILL"})
        assert r.status_code == 200, r.text
        wait_until(lambda: all(p.pid != pid for p in on_a.commands.list()), 10,
                   what="the process killed by tag through B to end")
        r = _unary(b, on_a.sandbox_id, "SendSignal",
                   {"process": {"pid": 999_999}, "signal": "SIGNAL_SIGKILL"})
        assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    finally:
        on_a.kill()


def _cluster_urls(server, backend):
    urls = getattr(server, "urls", None)
    if not urls or len(urls) < 2:
        pytest.skip("needs a cluster of two servers (SANDLOT_CONFORMANCE_CLUSTER: "
                    "scripts/conformance-cluster.sh)")
    if backend.name != "function":
        pytest.skip(f"{backend.name}: E2B sandboxes are made on the E2B backend "
                    "(`--e2b-backend`, default function): runs in the function case")
    return urls[0], urls[1]


def test_e2b_code_contexts_reach_across_servers(server, backend):
    """A code-interpreter context made through server A is listed, run in, restarted and
    removed through server B: contexts are the node's tagged processes (docs/e2b.md)."""
    ci = pytest.importorskip("e2b_code_interpreter",
                             reason="e2b-code-interpreter is not installed (scripts/setup.sh)")
    from conftest import IMAGES_DIR
    if not os.path.isdir(os.path.join(IMAGES_DIR, "lang-python")):
        pytest.skip("image lang-python is not installed (sandlot image build lang-python)")
    a, b = _cluster_urls(server, backend)
    on_a = ci.Sandbox.create(timeout=120, api_url=a, sandbox_url=a, api_key=KEY,
                             metadata={"test": "e2b-cluster-contexts"})
    try:
        on_b = ci.Sandbox.connect(on_a.sandbox_id, api_url=b, sandbox_url=b, api_key=KEY)
        # The default context: state set through A is seen through B.
        assert on_a.run_code("x = 41").error is None
        assert on_b.run_code("x + 1").text == "42"
        c = on_a.create_code_context(cwd="/tmp")
        assert c.id in [k.id for k in on_b.list_code_contexts()], "B does not list A's context"
        assert on_a.run_code("y = 'from a'", context=c).error is None
        assert on_b.run_code("y", context=c).text == "from a"
        assert on_b.run_code("import os; os.getcwd()", context=c).text == "/tmp"
        on_b.restart_code_context(c)
        assert on_a.run_code("'y' in dir()", context=c).text == "False", "restart kept state"
        on_b.remove_code_context(c)
        assert c.id not in [k.id for k in on_a.list_code_contexts()]
        with pytest.raises(Exception):
            on_a.run_code("1", context=c)
    finally:
        on_a.kill()


def test_e2b_snapshot_names_reach_across_servers(server, backend):
    """A snapshot made with a name through server A is listed by that name, and sandboxes
    are created from it, through server B: names are kept in the shared registry."""
    a, b = _cluster_urls(server, backend)
    on_a = Sandbox.create(template=TEMPLATE, timeout=120, api_url=a, sandbox_url=a, api_key=KEY,
                          metadata={"test": "e2b-cluster-snapshots"})
    snap = None
    try:
        on_a.files.write("/home/user/mark.txt", "snapped")
        name = f"snap-{on_a.sandbox_id}"
        snap = on_a.create_snapshot(name=name)
        assert snap.names == [name]
        listed = Sandbox.list_snapshots(name=name, api_url=b, api_key=KEY).next_items()
        assert [(s.snapshot_id, s.names) for s in listed] == [(snap.snapshot_id, [name])], \
            "B does not know the name A gave"
        by_box = Sandbox.list_snapshots(sandbox_id=on_a.sandbox_id, api_url=b,
                                        api_key=KEY).next_items()
        assert [s.names for s in by_box] == [[name]]
        child = Sandbox.create(template=snap.snapshot_id, timeout=60, api_url=b, sandbox_url=b,
                               api_key=KEY)
        try:
            assert child.files.read("/home/user/mark.txt") == "snapped"
        finally:
            child.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_url=b, api_key=KEY) is True
        snap = None
        assert Sandbox.list_snapshots(name=name, api_url=a, api_key=KEY).next_items() == []
    finally:
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id, api_url=a, api_key=KEY)
        on_a.kill()
