"""The unmodified `e2b` Python SDK (PyPI, installed by scripts/setup.sh) against `sandlot
up`: E2B's control plane and envd protocol as Sandlot serves them (docs/e2b.md), on three
backends.

The SDK finds Sandlot through E2B_API_URL and E2B_SANDBOX_URL, both the server's URL;
E2B_API_KEY is any string while the server runs without keys. Sandboxes are created from
template `base` (`--e2b-base-image`, default python) on the backend of the test's case
(`e2b_target` in tests/conftest.py: `function` on the shared server, `container` (runc) and
`microvm` on a private `sandlot up --e2b-backend X` each). A backend the host cannot run
skips with the reason (fails when SANDLOT_REQUIRE_BACKENDS names it).

Which test runs where (`e2b_only` markers, the reason in each): what the server alone does
(parsing Connect envelopes and uploads, TTL expiry, unknown ids) runs on `function` only;
`microvm` boots under TCG in CI (seconds per boot), so it runs a reduced set — commands,
files, pause/connect with a live process, create/list/kill, `get_host` — on one sandbox
shared by the module's `box` tests, and the e2b pty (tests/test_pty.py has it on the other
two).
"""

from __future__ import annotations

import time
from typing import Iterator

import httpx
import pytest

from conftest import wait_until
from conformance.test_ports import UPGRADE_ECHO, upgrade_echo

e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (scripts/setup.sh)")
from e2b import CommandExitException, Sandbox, SandboxQuery, SandboxState  # noqa: E402

#: `e2b_only` reasons shared by several tests.
SERVER_ONLY = "backend-independent (the server alone answers it)"
REDUCED = ("not in microvm's reduced set (TCG: CI time); the node file calls it makes are "
           "covered there by test_files_read_write_list_stat_move_remove")
BUSYBOX_BOOT = "a second (busybox) sandbox: each microvm boot takes seconds under TCG"


@pytest.fixture(autouse=True)
def _python_image(e2b_target, request) -> None:
    """On the shared server, skip unless a `python` sandbox can be made (conftest)."""
    if e2b_target.backend == "function":
        request.getfixturevalue("python_image")


@pytest.fixture(scope="module")
def shared_box(e2b_target) -> Iterator[Sandbox]:
    """microvm: one sandbox for the module's `box` tests (they leave it as they found it)."""
    sb = Sandbox.create(template="base", timeout=900, metadata={"test": "shared"},
                        api_url=e2b_target.url, sandbox_url=e2b_target.url,
                        api_key="e2b_sandlot_no_auth")
    yield sb
    sb.kill()


@pytest.fixture
def box(e2b_env, e2b_target, request) -> Iterator[Sandbox]:
    """A fresh `base` sandbox for the test (on microvm: the module's shared one)."""
    if e2b_target.backend == "microvm":
        yield request.getfixturevalue("shared_box")
        return
    sb = Sandbox.create(template="base", timeout=300,
                        metadata={"test": request.node.name[:60]})
    yield sb
    try:
        sb.kill()
    except Exception as e:  # cleanup only
        print(f"cleanup of {sb.sandbox_id} failed: {e}")


def test_create_run_list_timeout_kill(e2b_env, request):
    t0 = time.monotonic()
    sb = Sandbox.create(template="base", timeout=120, metadata={"job": request.node.name},
                        envs={"GREETING": "hello from envVars"})
    try:
        r = sb.commands.run("echo $GREETING; pwd; echo to-stderr >&2; python3 -c 'print(6*7)'")
        first = time.monotonic() - t0
        assert r.exit_code == 0
        assert r.stdout == "hello from envVars\n/home/user\n42\n"
        assert r.stderr == "to-stderr\n"
        print(f"create -> first command: {first * 1000:.0f} ms")

        with pytest.raises(CommandExitException) as ei:
            sb.commands.run("echo partial; exit 3")
        assert ei.value.exit_code == 3 and ei.value.stdout == "partial\n"

        found = Sandbox.list(query=SandboxQuery(metadata={"job": request.node.name}))
        ids = [s.sandbox_id for s in found.next_items()]
        assert ids == [sb.sandbox_id]
        none = Sandbox.list(query=SandboxQuery(metadata={"job": "no-such-job"}))
        assert none.next_items() == []

        info = sb.get_info()
        assert info.template_id == "base" and info.metadata == {"job": request.node.name}
        sb.set_timeout(30)
        left = (sb.get_info().end_at.timestamp() - time.time())
        assert 20 < left <= 31, left
        assert sb.is_running()
    finally:
        assert sb.kill() is True
    assert Sandbox.kill(sb.sandbox_id) is False, "killing twice answers False"
    assert not sb.is_running()


def test_streaming_callbacks_and_env(box):
    out, err = [], []
    r = box.commands.run("for i in 1 2 3; do echo out$i; echo err$i >&2; done",
                         envs={"X": "y"}, on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "out1\nout2\nout3\n" == r.stdout
    assert "".join(err) == "err1\nerr2\nerr3\n" == r.stderr
    assert box.commands.run("echo $X", envs={"X": "per-command"}).stdout == "per-command\n"
    assert box.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    # A relative cwd resolves against the user's home, `~` too (envd's ExpandAndResolve).
    box.files.make_dir("/home/user/rel/sub")
    assert box.commands.run("pwd", cwd="rel/sub").stdout == "/home/user/rel/sub\n"
    assert box.commands.run("pwd", cwd="~/rel/../rel").stdout == "/home/user/rel\n"
    assert box.commands.run("echo $HOME", user="root").stdout == "/root\n"


def test_background_connect_list_kill_and_stdin(box):
    h = box.commands.run("echo started; sleep 60", background=True)
    assert h.pid >= 1000
    wait_until(lambda: any(p.pid == h.pid for p in box.commands.list()), timeout=10)
    p = next(p for p in box.commands.list() if p.pid == h.pid)
    assert p.cmd == "/bin/bash" and p.args[-1] == "echo started; sleep 60"
    again = box.commands.connect(h.pid)
    assert box.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as ei:
        again.wait()
    assert ei.value.exit_code == -1
    assert box.commands.kill(h.pid) is False, "an ended process is not found"
    assert all(p.pid != h.pid for p in box.commands.list())

    cat = box.commands.run("cat; echo done", background=True, stdin=True)
    box.commands.send_stdin(cat.pid, "line one\n")
    box.commands.send_stdin(cat.pid, "line two\n")
    box.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "line one\nline two\ndone\n"


@pytest.mark.e2b_only("function", why="backend-independent (the stream's end when the "
                      "sandbox record goes)")
def test_sandbox_killed_during_run_ends_the_stream(e2b_env):
    """As E2B's `test_sandbox_killed_during_run.py`: a command whose sandbox is killed
    ends its stream with `unavailable`; the SDK's health probe then says the sandbox is
    gone."""
    sb = Sandbox.create(template="base", timeout=120)
    cmd = sb.commands.run("sleep 60", background=True)
    sb.kill()
    with pytest.raises(e2b.TimeoutException) as ei:
        cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(ei.value)


def test_command_timeout_kills(box):
    t = time.monotonic()
    with pytest.raises(e2b.TimeoutException):
        box.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t < 10
    # The process's deadline was the stream's: nothing of it is left running.
    wait_until(lambda: box.commands.list() == [], timeout=10)


def test_pause_and_connect_keep_files_and_processes(box):
    """Files and memory survive pause + connect: a background process that keeps a counter
    in its memory goes on counting from where it was (cgroup freezer on function and
    container; on microvm the VM's memory is saved to a file and restored)."""
    box.commands.run("echo kept > /home/user/f.txt")
    counter = box.commands.run(
        "n=0; while read -r l; do n=$((n + 1)); echo $n > /tmp/count; done; echo final $n",
        background=True, stdin=True)

    def count() -> str:
        return box.files.read("/tmp/count") if box.files.exists("/tmp/count") else ""

    box.commands.send_stdin(counter.pid, "a\nb\n")
    wait_until(lambda: count() == "2\n", 30, what="the counter to count to 2")
    box.pause()
    assert box.get_info().state.value == "paused"
    states = {s.sandbox_id: s.state.value
              for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()}
    assert states.get(box.sandbox_id) == "paused"
    same = Sandbox.connect(box.sandbox_id, timeout=600)
    assert same.get_info().state.value == "running"
    assert same.commands.run("cat /home/user/f.txt").stdout == "kept\n"
    same.commands.send_stdin(counter.pid, "c\n")
    same.commands.close_stdin(counter.pid)
    assert counter.wait().stdout == "final 3\n", "the process kept its memory"


@pytest.mark.e2b_only("function", why="backend-independent (the server's TTL reaper)")
def test_timeout_expiry_deletes(e2b_env):
    sb = Sandbox.create(template="base", timeout=60)
    sb.set_timeout(1)
    wait_until(lambda: not sb.is_running(), timeout=20)
    with pytest.raises(e2b.NotFoundException):
        sb.get_info()


@pytest.mark.e2b_only("function", why="backend-independent (checkpoints have their own "
                      "per-backend tests in test_checkpoints*.py)")
def test_snapshots_fork_paging_and_unsupported_routes(box, e2b_target, request):
    """E2B's snapshot, fork and list-paging calls over Sandlot checkpoints (docs/e2b.md)."""
    box.files.write("/home/user/state.txt", "before")
    snap = box.create_snapshot(name=f"snap-{box.sandbox_id}")
    assert snap.snapshot_id.startswith("ck-") and snap.names == [f"snap-{box.sandbox_id}"]
    listed = Sandbox.list_snapshots(sandbox_id=box.sandbox_id).next_items()
    assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
    named = Sandbox.list_snapshots(name=f"snap-{box.sandbox_id}").next_items()
    assert [s.snapshot_id for s in named] == [snap.snapshot_id]
    child = Sandbox.create(snap.snapshot_id, timeout=60)
    try:
        assert child.files.read("/home/user/state.txt") == "before"
        child.files.write("/home/user/state.txt", "child")
        assert box.files.read("/home/user/state.txt") == "before"
    finally:
        child.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    assert Sandbox.list_snapshots(name=f"snap-{box.sandbox_id}").next_items() == []
    long = httpx.post(f"{e2b_target.url}/sandboxes/{box.sandbox_id}/snapshots",
                      json={"name": "n" * 257}, headers={"X-API-KEY": "k"}, timeout=30)
    assert long.status_code == 400 and "256" in long.text, long.text
    assert Sandbox.list_snapshots(sandbox_id=box.sandbox_id).next_items() == [], \
        "a refused name leaves no snapshot"

    forks = box.fork(count=2, timeout=60)
    try:
        assert len({f.sandbox_id for f in forks} | {box.sandbox_id}) == 3
        assert all(f.files.read("/home/user/state.txt") == "before" for f in forks)
        assert all(f.get_info().template_id == "base" for f in forks), "the parent's template"
    finally:
        for f in forks:
            f.kill()
    assert Sandbox.list_snapshots(sandbox_id=box.sandbox_id).next_items() == [], \
        "a fork's checkpoint is deleted after the forks are made"

    # connect with a shorter timeout keeps a running sandbox's end.
    end = box.get_info().end_at
    Sandbox.connect(box.sandbox_id, timeout=5)
    assert box.get_info().end_at == end

    # Paging: newest first by default, one per page, X-Next-Token between pages.
    job = {"job": request.node.name}
    older = Sandbox.create(template="base", timeout=60, metadata=job)
    newer = Sandbox.create(template="base", timeout=60, metadata=job)
    try:
        pages = Sandbox.list(query=SandboxQuery(metadata=job), limit=1)
        first = pages.next_items()
        assert [s.sandbox_id for s in first] == [newer.sandbox_id] and pages.has_next
        assert [s.sandbox_id for s in pages.next_items()] == [older.sandbox_id]
        assert not pages.has_next
        asc = Sandbox.list(query=SandboxQuery(metadata=job), order="asc").next_items()
        assert [s.sandbox_id for s in asc] == [older.sandbox_id, newer.sandbox_id]
        none = Sandbox.list(query=SandboxQuery(metadata=job, template="other")).next_items()
        assert none == []
    finally:
        older.kill()
        newer.kill()

    # A route Sandlot does not serve answers E2B's error shape (the SDK raises its own
    # exception, not a KeyError on the body).
    with pytest.raises(e2b.SandboxException) as ei:
        box.get_metrics()
    assert "not supported" in str(ei.value)


@pytest.mark.e2b_only("function", why=SERVER_ONLY)
def test_unknown_template_and_sandbox(e2b_env):
    with pytest.raises(e2b.SandboxException):
        Sandbox.create(template="no-such-image", timeout=30)
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_info("sb-00000000000000000000")
    with pytest.raises(e2b.NotFoundException):
        Sandbox.connect("sb-00000000000000000000")


@pytest.mark.e2b_only("function", why=SERVER_ONLY)
def test_bad_connect_input_gets_connect_errors(box):
    """Malformed envelopes, wrong codecs and unknown methods: clear Connect errors, no 5xx."""
    url = box.envd_api_url
    h = {"E2b-Sandbox-Id": box.sandbox_id}
    with httpx.Client(base_url=url, timeout=30) as c:
        def post(path, body, ct):
            return c.post(path, content=body, headers={**h, "Content-Type": ct})

        r = post("/process.Process/Start", b"\x00\x00", "application/connect+json")
        assert r.status_code == 200 and r.content[0] == 2, r.content
        assert b'"invalid_argument"' in r.content
        r = post("/process.Process/Start", b"\x01\x00\x00\x00\x02{}", "application/connect+json")
        assert b"compressed" in r.content
        r = post("/process.Process/Start", b"\x00\xff\xff\xff\xff{}", "application/connect+json")
        assert b'"resource_exhausted"' in r.content
        r = post("/process.Process/List", b"{}", "application/xml")
        assert r.status_code == 415 and r.json()["code"] == "unimplemented"
        r = post("/process.Process/List", b"[1]", "application/json")
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = post("/process.Process/Nope", b"{}", "application/json")
        assert r.status_code == 404 and r.json()["code"] == "unimplemented"
        r = post("/process.Process/SendSignal",
                 b'{"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}', "application/json")
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = c.post("/process.Process/List", content=b"{}",
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "E2b-Sandbox-Id" in r.json()["message"]
        r = c.post("/v2/sandboxes", content=b"[]", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["code"] == 400


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


@pytest.mark.e2b_only("function", "container",
                      why="50 MB each way: TCG makes it slow and the path is the same node call")
def test_files_50mb_bytes_round_trip(box, e2b_target):
    """50 MB through `files.write`/`files.read(format="bytes")`: byte-identical, and the
    server's RSS grows by a bounded amount (a multipart upload is parsed as it arrives and
    held once, within the file budget: docs/e2b.md)."""
    import hashlib
    import os

    blob = os.urandom(1 << 20) * 50  # 50 MiB; random 1 MiB repeated (cheap to make)
    pid = e2b_target.server.proc.pid
    before = _rss_kib(pid)
    box.files.write("/tmp/big.bin", blob)
    assert box.commands.run("wc -c < /tmp/big.bin").stdout.strip() == str(len(blob))
    got = bytes(box.files.read("/tmp/big.bin", format="bytes"))
    assert len(got) == len(blob)
    assert hashlib.sha256(got).digest() == hashlib.sha256(blob).digest()
    grown_mib = (_rss_kib(pid) - before) / 1024
    print(f"server RSS grew {grown_mib:.0f} MiB over a 50 MiB upload + download")
    assert grown_mib < 400, f"server RSS grew {grown_mib:.0f} MiB"
    box.files.remove("/tmp/big.bin")


def test_files_read_write_list_stat_move_remove(box):
    from e2b import FileType
    from e2b.exceptions import FileNotFoundException

    info = box.files.write("notes/a.txt", "hello files\n")  # relative: the user's home
    assert info.path == "/home/user/notes/a.txt" and info.name == "a.txt"
    assert box.files.read("/home/user/notes/a.txt") == "hello files\n"
    assert box.commands.run("cat ~/notes/a.txt").stdout == "hello files\n"
    blob = bytes(range(256)) * 64
    box.files.write("/tmp/blob.bin", blob)
    assert bytes(box.files.read("/tmp/blob.bin", format="bytes")) == blob
    many = box.files.write_files([{"path": "/tmp/m/1.txt", "data": "one"},
                                  {"path": "/tmp/m/2.txt", "data": b"two"}])
    assert sorted(w.path for w in many) == ["/tmp/m/1.txt", "/tmp/m/2.txt"]

    st = box.files.get_info("/tmp/blob.bin")
    assert st.type == FileType.FILE and st.size == len(blob) and st.name == "blob.bin"
    assert st.permissions.startswith("-r") and st.modified_time.year >= 2024
    assert box.files.exists("/tmp/m/2.txt") and not box.files.exists("/tmp/m/3.txt")
    assert st.symlink_target is None
    box.commands.run("ln -s blob.bin /tmp/blob.link")
    link = box.files.get_info("/tmp/blob.link")  # followed, as envd's Stat
    assert link.type == FileType.FILE and link.symlink_target == "/tmp/blob.bin"
    box.files.remove("/tmp/blob.link")

    assert box.files.make_dir("/tmp/m/sub/deeper") is True
    assert box.files.make_dir("/tmp/m/sub") is False, "exists already"
    names = {(e.name, e.type) for e in box.files.list("/tmp/m")}
    assert names == {("1.txt", FileType.FILE), ("2.txt", FileType.FILE), ("sub", FileType.DIR)}
    deep = {e.path for e in box.files.list("/tmp/m", depth=3)}
    assert "/tmp/m/sub/deeper" in deep and "/tmp/m/1.txt" in deep

    moved = box.files.rename("/tmp/m/1.txt", "/tmp/n/one.txt")
    assert moved.path == "/tmp/n/one.txt" and moved.type == FileType.FILE
    assert box.files.read("/tmp/n/one.txt") == "one"
    assert not box.files.exists("/tmp/m/1.txt")

    box.files.remove("/tmp/m")
    assert not box.files.exists("/tmp/m/2.txt")
    with pytest.raises(FileNotFoundException):
        box.files.read("/tmp/m/2.txt")
    with pytest.raises(FileNotFoundException):
        box.files.get_info("/no/such/file")
    box.files.remove("/no/such/file")  # envd's os.RemoveAll: missing is fine
    with pytest.raises(e2b.InvalidArgumentException):
        box.files.list("/tmp/n/one.txt")


@pytest.mark.e2b_only("function", why=SERVER_ONLY)
def test_bad_files_input_gets_clear_errors(box):
    url = box.envd_api_url
    h = {"E2b-Sandbox-Id": box.sandbox_id}
    # No keep-alive: an upload refused before its body is read ends its connection.
    with httpx.Client(base_url=url, timeout=30,
                      limits=httpx.Limits(max_keepalive_connections=0)) as c:
        r = c.get("/files", headers=h)
        assert r.status_code == 400 and "path" in r.json()["message"]
        r = c.post("/files", params={"path": "/tmp/x"}, content=b"x",
                   headers={**h, "Content-Type": "multipart/form-data"})
        assert r.status_code == 400 and "boundary" in r.json()["message"]
        r = c.post("/files", content=b"x",
                   headers={**h, "Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and "path" in r.json()["message"]
        r = c.post("/files", params={"path": "/tmp/x"}, content=b"x",
                   headers={**h, "Content-Type": "application/octet-stream",
                            "Content-Encoding": "gzip"})
        assert r.status_code == 400 and "not gzip" in r.json()["message"]
        r = c.post("/files", params={"path": "/tmp/x"}, content=b"x",
                   headers={**h, "Content-Type": "application/octet-stream",
                            "Content-Encoding": "br"})
        assert r.status_code == 400 and "br" in r.json()["message"]
        r = c.post("/filesystem.Filesystem/Stat", content=b'{"path": ""}',
                   headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = c.post("/filesystem.Filesystem/WatchDir", content=b"{}",
                   headers={**h, "Content-Type": "application/connect+json"})
        assert r.status_code == 200 and r.content[0] == 2 and b"invalid_argument" in r.content
        r = c.post("/filesystem.Filesystem/GetWatcherEvents", content=b'{"watcherId": "w-x"}',
                   headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = c.post("/filesystem.Filesystem/Nope", content=b"{}",
                   headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 404
        r = c.get("/files", params={"path": "/etc/hostname"})
        assert r.status_code == 400 and "E2b-Sandbox-Id" in r.json()["message"]


@pytest.mark.e2b_only("function", "container", why=REDUCED)
def test_files_gzip_upload_download_and_bomb(box):
    """`gzip=True` of the SDK both ways; an upload inflating past the limit gets 413."""
    import gzip
    import os
    import zlib

    data = ("gzip me " * 5000).encode()
    info = box.files.write("/tmp/gz/a.txt", data, gzip=True)
    assert info.path == "/tmp/gz/a.txt"
    assert box.commands.run("wc -c < /tmp/gz/a.txt").stdout.strip() == str(len(data))
    assert bytes(box.files.read("/tmp/gz/a.txt", format="bytes", gzip=True)) == data
    assert box.files.read("/tmp/gz/a.txt") == data.decode()

    url = box.envd_api_url
    h = {"E2b-Sandbox-Id": box.sandbox_id}
    with httpx.Client(base_url=url, timeout=120,
                      limits=httpx.Limits(max_keepalive_connections=0)) as c:
        r = c.get("/files", params={"path": "/tmp/gz/a.txt"},
                  headers={**h, "Accept-Encoding": "gzip"})
        assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
        assert r.content == data  # httpx inflates
        assert r.num_bytes_downloaded < len(data) // 10  # streamed, no Content-Length
        # Incompressible data goes out as it is, whatever Accept-Encoding says (httpx
        # under the SDK accepts gzip on every request).
        noise = os.urandom(256 * 1024)
        box.files.write("/tmp/gz/noise.bin", noise)
        r = c.get("/files", params={"path": "/tmp/gz/noise.bin"},
                  headers={**h, "Accept-Encoding": "gzip"})
        assert "content-encoding" not in r.headers and r.content == noise
        assert int(r.headers["content-length"]) == len(noise)
        r = c.get("/files", params={"path": "/tmp/gz/a.txt"},
                  headers={**h, "Accept-Encoding": "gzip;q=0, identity"})
        assert "content-encoding" not in r.headers and r.content == data
        # Multipart inside gzip works too (Content-Encoding covers the whole body).
        boundary = "b0und"
        mp = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
              f"filename=\"/tmp/gz/m.txt\"\r\n\r\nmultipart-gz\r\n--{boundary}--\r\n").encode()
        r = c.post("/files", content=gzip.compress(mp),
                   headers={**h, "Content-Encoding": "gzip",
                            "Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert r.status_code == 200, r.text
        assert box.files.read("/tmp/gz/m.txt") == "multipart-gz"

        # A gzip bomb: 257 MiB of zeros (the server's limit is 256 MiB) in ~260 KiB.
        comp = zlib.compressobj(9, zlib.DEFLATED, 31)
        chunk = bytes(1 << 20)
        bomb = b"".join(comp.compress(chunk) for _ in range(257)) + comp.flush()
        assert len(bomb) < 1 << 20
        r = c.post("/files", params={"path": "/tmp/gz/bomb"}, content=bomb,
                   headers={**h, "Content-Type": "application/octet-stream",
                            "Content-Encoding": "gzip"})
        assert r.status_code == 413 and "inflates" in r.json()["message"], r.text
    assert not box.files.exists("/tmp/gz/bomb")


@pytest.mark.e2b_only("function", "container", why=REDUCED)
def test_watch_dir_sync_and_async(box):
    """`files.watch_dir` (CreateWatcher/GetWatcherEvents) and the async SDK's (WatchDir)."""
    import asyncio

    from e2b import AsyncSandbox, FilesystemEventType as T

    box.files.make_dir("/tmp/w/sub")
    h = box.files.watch_dir("/tmp/w")
    hr = box.files.watch_dir("/tmp/w", recursive=True)
    box.commands.run("echo hello > /tmp/w/a.txt && echo deep > /tmp/w/sub/d.txt")
    seen = []
    wait_until(lambda: bool(seen.extend(h.get_new_events())) or
               (("a.txt", T.CREATE) in {(e.name, e.type) for e in seen}
                and ("a.txt", T.WRITE) in {(e.name, e.type) for e in seen}),
               10, what="create+write of a.txt")
    box.commands.run("mv /tmp/w/a.txt /tmp/w/b.txt && chmod 600 /tmp/w/b.txt")
    wait_until(lambda: bool(seen.extend(h.get_new_events())) or
               {("a.txt", T.REMOVE), ("b.txt", T.CREATE)} <= {(e.name, e.type) for e in seen},
               10, what="rename as remove+create")
    assert not any(e.name.startswith("sub/") for e in seen), "not recursive"
    rec = []
    wait_until(lambda: bool(rec.extend(hr.get_new_events())) or
               ("sub/d.txt", T.CREATE) in {(e.name, e.type) for e in rec},
               10, what="recursive event")
    box.commands.run("echo more >> /tmp/w/b.txt")
    wait_until(lambda: bool(seen.extend(h.get_new_events())) or
               seen[-1].name == "b.txt" and seen[-1].type == T.WRITE, 10, what="append")
    # A change made before get_new_events is in its answer (E2B's own tests rely on it).
    box.files.write("/tmp/w/b.txt", "rewritten, another size")
    assert ("b.txt", T.WRITE) in {(e.name, e.type) for e in h.get_new_events()}
    h.stop()
    hr.stop()
    with pytest.raises(e2b.SandboxException):
        h.get_new_events()

    # At most 16 watchers per sandbox.
    hs = [box.files.watch_dir("/tmp/w") for _ in range(16)]
    with pytest.raises(e2b.SandboxException) as ei:
        box.files.watch_dir("/tmp/w")
    assert "watchers" in str(ei.value)
    for x in hs:
        x.stop()
    with pytest.raises(e2b.SandboxException):
        box.files.watch_dir("/tmp/w/b.txt")  # not a directory

    async def watch_async():
        sb = await AsyncSandbox.connect(box.sandbox_id)
        got = []
        wh = await sb.files.watch_dir("/tmp/w", on_event=got.append, timeout=60)
        await sb.commands.run("echo x > /tmp/w/async.txt")
        for _ in range(100):
            if ("async.txt", T.CREATE) in {(e.name, e.type) for e in got}:
                break
            await asyncio.sleep(0.1)
        await wh.stop()
        return got

    got = asyncio.run(watch_async())
    assert ("async.txt", T.CREATE) in {(e.name, e.type) for e in got}, got

    # The stopped stream gave its watcher slot back: 16 watchers fit again.
    def sixteen_fit():
        hs = []
        try:
            for _ in range(16):
                hs.append(box.files.watch_dir("/tmp/w"))
            return True
        except e2b.SandboxException:
            return False
        finally:
            for x in hs:
                x.stop()

    wait_until(sixteen_fit, 10, what="the stream's watcher slot to be freed")


def test_stream_input_client_stream(box):
    """`commands.stream_input` (Connect client stream): input reaches the process as it is
    sent, before the request ends; async handle too; bad streams get Connect errors."""
    import asyncio

    from e2b import AsyncSandbox

    h = box.commands.run("while read -r l; do echo \"$l\" >> /tmp/si.txt; done",
                         background=True, stdin=True)

    def got():
        return box.files.read("/tmp/si.txt") if box.files.exists("/tmp/si.txt") else ""

    def chunks():
        yield "first\n"
        # The second chunk is only sent once the first reached the process: the server
        # must hand each message to stdin as it arrives, not at the end of the body.
        wait_until(lambda: got() == "first\n", 15, what="first chunk in the process")
        yield b"second\n"

    box.commands.stream_input(h.pid, chunks())
    wait_until(lambda: got() == "first\nsecond\n", 15, what="second chunk")

    async def via_async():
        sb = await AsyncSandbox.connect(box.sandbox_id)
        async with sb.commands.stream_input(h.pid) as ih:
            await ih.send("third\n")
        with pytest.raises(e2b.NotFoundException):
            async with sb.commands.stream_input(999999) as bad:
                await bad.send("x")

    asyncio.run(via_async())
    wait_until(lambda: got().endswith("third\n"), 15, what="async chunk")
    box.commands.close_stdin(h.pid)
    assert h.wait().exit_code == 0

    with httpx.Client(base_url=box.envd_api_url, timeout=30) as c:
        hd = {"E2b-Sandbox-Id": box.sandbox_id, "Content-Type": "application/connect+json"}
        r = c.post("/process.Process/StreamInput", content=b"", headers=hd)
        assert r.status_code == 200 and b"no start message" in r.content, r.content
        r = c.post("/process.Process/StreamInput", content=b"\x00\x00\x00\x00\x02{}", headers=hd)
        assert b"exactly one of" in r.content, r.content
        r = c.post("/process.Process/StreamInput", content=b'\x00\x00\x00\x00\x05{"a"', headers=hd)
        assert b"invalid_argument" in r.content, r.content


@pytest.mark.e2b_only("microvm", why="tests/test_pty.py drives the e2b SDK's pty on function "
                                      "and container")
def test_pty_on_microvm(box):
    """`sb.pty` on a microvm sandbox (the terminal allocated in the guest): create, type,
    `tty`/`stty size`, resize, exit code, kill; the same steps as tests/test_pty.py."""
    from test_pty import _drive_a_terminal

    _drive_a_terminal(box)


@pytest.mark.e2b_only("function", "container", why=BUSYBOX_BOOT)
def test_watch_gzip_stream_input_in_busybox(e2b_env):
    """Nothing in the image serves these: a busybox sandbox has them all the same."""
    from e2b import FilesystemEventType as T

    try:
        sb = Sandbox.create(template="busybox", timeout=120)
    except e2b.SandboxException as e:
        pytest.skip(f"no busybox image here: {e}")
    try:
        sb.files.make_dir("/tmp/bw")
        h = sb.files.watch_dir("/tmp/bw")
        sb.commands.run("echo hi > /tmp/bw/f")
        seen = []
        wait_until(lambda: bool(seen.extend(h.get_new_events())) or
                   ("f", T.CREATE) in {(e.name, e.type) for e in seen}, 10, what="event")
        h.stop()
        sb.files.write("/tmp/bw/g", "zipped", gzip=True)
        assert sb.files.read("/tmp/bw/g", gzip=True) == "zipped"
        p = sb.commands.run("cat > /tmp/bw/in", background=True, stdin=True)
        sb.commands.stream_input(p.pid, ["a", "b"])
        sb.commands.close_stdin(p.pid)
        p.wait()
        assert sb.files.read("/tmp/bw/in") == "ab"
    finally:
        sb.kill()




def test_get_host_reaches_a_server_in_the_sandbox(box, e2b_env):
    """Ingress: `get_host(port)` names `<port>-<id>.<domain>`; Sandlot routes that host
    name (here sent as `Host` to its own listener, as a wildcard DNS name would) and
    `/v1/sandboxes/{id}/ports/{port}/…` to the port inside the sandbox, which has no
    network of its own."""
    box.files.write("/home/user/site/hello.txt", "hello through ingress\n")
    srv = box.commands.run("cd /home/user/site && exec python3 -m http.server 8000",
                           background=True)
    host = box.get_host(8000)
    assert host.startswith(f"8000-{box.sandbox_id}."), host

    # Nothing on port 8001: 502 with Sandlot's error body.
    r = httpx.get(f"{e2b_env}/hello.txt", headers={"Host": box.get_host(8001)}, timeout=10)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "unavailable"
    assert "nothing listens on port 8001" in r.json()["error"]["message"]

    got = {}

    def fetched() -> bool:
        r = httpx.get(f"{e2b_env}/hello.txt?x=1", headers={"Host": host}, timeout=10)
        got["r"] = r
        return r.status_code != 502
    wait_until(fetched, timeout=30, what="http.server in the sandbox")
    r = got["r"]
    assert r.status_code == 200, r.text
    assert r.text == "hello through ingress\n"

    by_path = httpx.get(f"{e2b_env}/v1/sandboxes/{box.sandbox_id}/ports/8000/hello.txt",
                        timeout=10)
    assert by_path.status_code == 200 and by_path.text == "hello through ingress\n"
    listing = httpx.get(f"{e2b_env}/v1/sandboxes/{box.sandbox_id}/ports/8000/", timeout=10)
    assert listing.status_code == 200 and "hello.txt" in listing.text

    # Unknown sandbox: 404 on both forms.
    unknown = "sb-00000000000000000000"
    r = httpx.get(f"{e2b_env}/", headers={"Host": f"8000-{unknown}.sandlot.test"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{e2b_env}/v1/sandboxes/{unknown}/ports/8000/", timeout=10)
    assert r.status_code == 404

    # Concurrent requests through ingress.
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        codes = list(ex.map(
            lambda _: httpx.get(f"{e2b_env}/hello.txt", headers={"Host": host},
                                timeout=30).status_code, range(64)))
    assert codes == [200] * 64

    # An HTTP upgrade (what a WebSocket does) becomes a byte pipe both ways.
    box.files.write("/home/user/echo.py", UPGRADE_ECHO)
    box.commands.run("exec python3 /home/user/echo.py", background=True)
    import socket
    from urllib.parse import urlparse
    u = urlparse(e2b_env)

    def upgraded() -> bool:
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            return upgrade_echo(s, "/ws", box.get_host(8002), (b"ping\n", b"x" * 100_000))
    wait_until(upgraded, timeout=30, what="the upgrade echo server in the sandbox")
    srv.kill()
