"""Terminals (PTY sessions) in a busybox image on every backend (function, container,
microvm, vm through Sandlot's SDK; function and container through the e2b SDK):
the pty is allocated inside the sandbox (`tty` names /dev/pts/N there, `stty size` prints
its size). Through Sandlot's SDK (`sb.pty(...)`: write, read, resize, wait, kill) and
through the unmodified `e2b` Python SDK (`sandbox.pty`: `create`, `send_stdin`, `resize`,
`kill`, `wait`; on containers through a server of this module with `--e2b-backend
container`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from typing import Iterator

import pytest

from conftest import Server, private_base, remove_private_base, wait_until

import sandlot

try:
    import e2b
    from e2b import CommandExitException, Sandbox
    from e2b.sandbox.commands.command_handle import PtySize
except ImportError:  # the Sandlot SDK tests still run
    e2b = None


def _need_e2b() -> None:
    if e2b is None:
        pytest.skip("the e2b SDK is not installed (scripts/setup.sh)")


@pytest.mark.parametrize("backend", ["function", "container", "microvm", "vm"])
def test_sandlot_sdk_pty(client, backend):
    try:
        sb = client.create(backend=backend, image="busybox", memory_mib=128, ttl_s=120)
    except (sandlot.NotFound, sandlot.Unavailable) as e:
        pytest.skip(f"no busybox {backend} sandbox here: {e}")
    try:
        term = sb.pty(rows=24, cols=80, timeout_s=60)
        seen = bytearray()

        def got(*needles: str) -> bool:
            seen.extend(term.read(timeout=0.5))
            text = seen.decode(errors="replace")
            return all(n in text for n in needles)

        term.write("tty; stty size\n")
        wait_until(lambda: got("/dev/pts/", "24 80"), 15,
                   what=f"tty and stty size in the terminal output: {bytes(seen)!r}")
        term.resize(50, 132)
        term.write(b"stty size; echo $TERM; exit 3\n")
        r = term.wait(timeout=30)
        assert r is not None and r.exit_code == 3, r
        out = r.stdout.decode(errors="replace")
        assert "50 132" in out and "xterm-256color" in out, out
        assert not r.stderr
        with pytest.raises(sandlot.Conflict):
            term.resize(10, 10)

        # Bad sizes, a process without a terminal, kill.
        with pytest.raises(sandlot.InvalidArgument):
            sb.spawn(["sh"], pty=(0, 80))
        plain = sb.spawn(["sleep", "100"])
        with pytest.raises(sandlot.InvalidArgument):
            plain.resize(10, 10)
        plain.kill()
        term2 = sb.pty(["sh"], rows=5, cols=20)
        term2.write("sleep 1000\n")
        time.sleep(0.3)
        term2.kill()
        r = term2.wait(timeout=15)
        assert r is not None and r.signal == 9, r
    finally:
        sb.delete()


def _point_at(url: str, monkeypatch) -> None:
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_sandlot_no_auth")
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)


@pytest.fixture(scope="module")
def container_server(binary, log_dir) -> Iterator[Server]:
    """A `sandlot up` whose E2B sandboxes are containers."""
    import os
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root")
    data = private_base("sandlot-e2b-pty-")
    srv = Server(binary, data / "data", log_dir / "sandlot-up-e2b-pty-container.log",
                 args=["--e2b-backend", "container"])
    try:
        srv.start()
    except RuntimeError as e:
        pytest.fail(f"could not start `sandlot up --e2b-backend container`: {e}")
    yield srv
    srv.stop()
    remove_private_base(data)


def _busybox(srv_url: str) -> Sandbox:
    try:
        return Sandbox.create(template="busybox", timeout=120)
    except e2b.SandboxException as e:
        pytest.skip(f"no busybox sandbox on {srv_url}: {e}")


def _drive_a_terminal(sb: Sandbox) -> None:
    out = bytearray()
    lock = threading.Lock()

    def on_pty(data: bytes) -> None:
        with lock:
            out.extend(data)

    def text() -> str:
        with lock:
            return out.decode(errors="replace")

    h = sb.pty.create(PtySize(rows=24, cols=80), timeout=60)
    result: dict = {}

    def wait() -> None:
        try:
            result["r"] = h.wait(on_pty=on_pty)
        except CommandExitException as e:
            result["e"] = e
        except Exception as e:  # reported by the assertions below
            result["x"] = e

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    sb.pty.send_stdin(h.pid, b"tty; stty size\n")
    wait_until(lambda: "/dev/pts/" in text() and "24 80" in text(), 15,
               what=f"tty and stty size in the pty output: {text()!r}")
    sb.pty.resize(h.pid, PtySize(rows=40, cols=100))
    sb.pty.send_stdin(h.pid, b"stty size; exit 3\n")
    t.join(30)
    assert not t.is_alive(), f"the pty did not end: {text()!r}"
    assert "x" not in result, result
    assert "e" in result and result["e"].exit_code == 3, (result, text())
    assert "40 100" in text(), text()

    # kill: the whole terminal ends; a second kill finds nothing.
    h2 = sb.pty.create(PtySize(rows=10, cols=40), timeout=60)
    sb.pty.send_stdin(h2.pid, b"sleep 1000\n")
    time.sleep(0.3)
    assert sb.pty.kill(h2.pid) is True
    t0 = time.monotonic()
    try:
        r = h2.wait()
        code = r.exit_code
    except CommandExitException as e:
        code = e.exit_code
    assert code != 0 and time.monotonic() - t0 < 10
    assert sb.pty.kill(h2.pid) is False


def test_e2b_pty_on_function(server, e2b_env_shared):
    _need_e2b()
    sb = _busybox(server.url)
    try:
        _drive_a_terminal(sb)
    finally:
        sb.kill()


def test_e2b_pty_on_container(container_server, monkeypatch):
    _need_e2b()
    _point_at(container_server.url, monkeypatch)
    sb = _busybox(container_server.url)
    try:
        _drive_a_terminal(sb)
    finally:
        sb.kill()


@pytest.fixture
def e2b_env_shared(server, monkeypatch) -> str:
    _point_at(server.url, monkeypatch)
    return server.url


def test_sandlot_shell_cli(client, server, binary):
    """`sandlot shell ID`: piped input typed into a login shell (end of input = Ctrl-D) and,
    under `script` (a real local terminal: raw mode, the local window size), the command's
    exit code and the sandbox's terminal of that size."""
    sb = client.create(image="busybox", memory_mib=64, ttl_s=120)
    env = {**os.environ, "SANDLOT_URL": server.url}
    try:
        r = subprocess.run([str(binary), "shell", sb.id], input=b"tty; echo hi-$((6*7)); exit 7\n",
                           capture_output=True, timeout=60, env=env)
        out = r.stdout.decode(errors="replace")
        assert r.returncode == 7, (r.returncode, out, r.stderr)
        assert "hi-42" in out and "/dev/pts/" in out, out
        # No `exit`: the end of input (Ctrl-D) ends `cat` and the shell's exit code is its.
        r = subprocess.run([str(binary), "shell", sb.id, "--", "cat"], input=b"abc\n",
                           capture_output=True, timeout=60, env=env)
        assert r.returncode == 0 and b"abc" in r.stdout, (r.returncode, r.stdout, r.stderr)

        script = shutil.which("script")
        if script is None:
            pytest.skip("no `script` (util-linux) to give the CLI a local terminal")
        line = f"stty rows 30 cols 100; {binary} shell {sb.id}; echo shell-rc=$?"
        p = subprocess.Popen([script, "-qec", line, "/dev/null"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        time.sleep(3)  # raw mode on before the keys: in raw mode `\r` is Enter
        out, _ = p.communicate(b"stty size; exit 5\r", timeout=60)
        text = out.decode(errors="replace")
        assert "30 100" in text and "shell-rc=5" in text, text
    finally:
        sb.delete()
