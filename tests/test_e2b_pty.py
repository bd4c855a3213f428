"""Terminals through the unmodified `e2b` Python SDK (`sandbox.pty`): `pty.create`,
`send_stdin`, `resize`, `kill`, `wait`, on the function backend (the shared server) and
on the container backend (a server of this module with `--e2b-backend container`), in a
busybox image: the pty is allocated inside the sandbox (`tty` names /dev/pts/N there).
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

from conftest import Server, private_base, remove_private_base, wait_until

e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (scripts/setup.sh)")
from e2b import CommandExitException, Sandbox  # noqa: E402
from e2b.sandbox.commands.command_handle import PtySize  # noqa: E402


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


def test_pty_on_function(server, e2b_env_shared):
    sb = _busybox(server.url)
    try:
        _drive_a_terminal(sb)
    finally:
        sb.kill()


def test_pty_on_container(container_server, monkeypatch):
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
