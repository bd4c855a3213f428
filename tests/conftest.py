"""End-to-end fixtures: drive the real `sandlot up` binary through the Python SDK.

Environment:
    SANDLOT_BIN         the `sandlot` binary (default target/release/sandlot, else
                        target/debug/sandlot).
    SANDLOT_IMAGES_DIR  image store passed to `sandlot up --images-dir`
                        (default /var/lib/sandlot/images).
    SANDLOT_E2E_LOG_DIR where server logs are kept (default: a pytest temp dir).
    SANDLOT_REQUIRE_BACKENDS  backend cases of the conformance suite (tests/conformance)
                        that must run: a named case the server cannot run fails instead of
                        being skipped (comma list: function, container-runc,
                        container-runsc; `container` = both container cases).

Tests that need something missing (the binary, root, the `python` image) call pytest.skip
with the reason, so `pytest -rs` lists every skip and why.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sdk" / "python"))  # works without `pip install -e sdk/python`

import sandlot  # noqa: E402

IMAGES_DIR = os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images")
READY_DEADLINE_S = 60.0


def find_binary() -> Optional[Path]:
    """SANDLOT_BIN, else target/release/sandlot, else target/debug/sandlot."""
    env = os.environ.get("SANDLOT_BIN")
    if env:
        return Path(env) if Path(env).is_file() else None
    for p in (REPO / "target" / "release" / "sandlot", REPO / "target" / "debug" / "sandlot"):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def _ephemeral_ports() -> Tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free on every address, chosen below the kernel's ephemeral range.

    A port the kernel hands out itself (bind to 0) lies in the ephemeral range, where any
    outgoing connection of the test run may take it before `sandlot up` binds it (CI saw
    `Address already in use`). Ports below the range are never given to connect()."""
    lo, _ = _ephemeral_ports()
    first = 20000 if lo > 21000 else 1024
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(first, max(first + 1, lo))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.05,
               what: str = "condition") -> None:
    """Poll ``pred`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
        interval = min(interval * 1.5, 1.0)


class Server:
    """One `sandlot up` process on a free port with its own data directory (``mode``
    ``"server"``: `sandlot server`, whose ``args`` then name its node)."""

    def __init__(self, binary: Path, data_dir: Path, log_path: Path,
                 port: Optional[int] = None, args: Optional[List[str]] = None,
                 preexec: Optional[Callable[[], None]] = None, mode: str = "up") -> None:
        self.binary = binary
        self.mode = mode
        self.preexec = preexec  # run in the child before exec (e.g. a lower RLIMIT_NOFILE)
        self.args = list(args or [])
        self.data_dir = data_dir
        self.log_path = log_path
        self.auto_port = port is None
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        """Start and wait for `/v1/ping`; a port taken meanwhile by another process is
        replaced by a fresh one (up to 3 times) when this server chose its own port."""
        for attempt in range(3):
            try:
                return self._start_once()
            except RuntimeError as e:
                if not (self.auto_port and "Address already in use" in str(e)) or attempt == 2:
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"

    def _start_once(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n===== start {time.strftime('%H:%M:%S')} =====\n".encode())
        log.flush()
        cmd = [str(self.binary), self.mode, "--listen", f"127.0.0.1:{self.port}",
               "--data-dir", str(self.data_dir), "--images-dir", IMAGES_DIR, *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=self.preexec)
        log.close()
        client = sandlot.Client(self.url, timeout=2, retries=0)
        deadline = time.monotonic() + READY_DEADLINE_S
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"`{' '.join(cmd)}` exited with {self.proc.returncode}"
                                       f"\n{self.log_tail()}")
                try:
                    if client.ping():
                        return
                except sandlot.SandlotError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"`sandlot up` not ready after {READY_DEADLINE_S}s"
                                       f"\n{self.log_tail()}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> Optional[int]:
        """Send ``sig`` and wait for the exit; SIGKILL after ``timeout``. Returns the code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"`sandlot up` ignored signal {sig} for {timeout}s; killed"
                               f"\n{self.log_tail()}") from e

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def delete_all(self) -> None:
        """Cleanup at the end of a private node's tests: starts the node again if it is down,
        then deletes every sandbox and checkpoint through the API."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        with sandlot.Client(self.url, timeout=60) as c:
            for b in c.list():
                b.delete()
            for k in c.checkpoints():
                c.delete_checkpoint(k)

    def restart(self, sig: int = signal.SIGTERM) -> None:
        if sig == signal.SIGKILL:
            self.kill()
        else:
            self.stop(sig)
        self.start()

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return f"--- tail of {self.log_path} ---\n" + "\n".join(lines[-n:])


def node_cgroup_parent(data_dir: Path) -> str:
    """Name of the parent cgroup of the node whose data dir is ``data_dir``: ``sandlot-`` +
    12 hex digits of FNV-1a 64 of the absolute path (``default_cgroup_parent`` in
    crates/sandlot-node/src/local.rs)."""
    h = 0xcbf29ce484222325
    for b in os.fsencode(os.path.abspath(data_dir)):
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"sandlot-{h & 0xFFFFFFFFFFFF:012x}"


# Python source run inside a sandbox (`python3 -c`): defines `zombies()`, the number of
# processes in state Z in the sandbox's /proc. Used by the tests that check its reaper.
ZOMBIES_PY = r"""
import glob

def zombies():
    z = 0
    for p in glob.glob('/proc/[0-9]*/stat'):
        try:
            s = open(p).read()
        except OSError:
            continue
        if s[s.rindex(')') + 2] == 'Z':
            z += 1
    return z
"""


def count_leaks(data_dir: Path) -> Dict[str, int]:
    """Host resources of the node with data dir ``data_dir`` that outlive its sandboxes if
    cleanup is broken. Every backend is counted the same way:

    ``sandbox_dirs``: entries of DATA/sandboxes and DATA/containers. ``mounts``: mountinfo lines naming DATA
    (overlays, binds, the per-sandbox upper layers). ``cgroups``: groups below the node's
    parent group P (:func:`node_cgroup_parent`) and below its per-backend siblings ``P-*``
    (the container backend's ``P-ctr``) in every hierarchy: /sys/fs/cgroup/<ctrl>/P… on v1,
    /sys/fs/cgroup/P… on v2. ``processes``: processes in those groups, plus processes whose
    command line names DATA (an OCI runtime's ``--root``, a bundle path), the `sandlot`
    server itself left out. ``veths``: veth devices of the host network namespace (host-wide:
    a sandbox's network policy adds one pair per sandbox).

    Ready warm-pool jails (DATA/warm-pool/<name>) and pooled runc containers
    (DATA/container-pool/<name>) are not leaks: the server refills its pools in the
    background at any moment, so their cgroups, processes and host mounts (a container's
    rootfs and scratch disk, a jail's scratch disk) are left out. A container handed over by the pool keeps its pooled name for its cgroup, but
    its directory has left the pool directory, so it is counted like any sandbox.
    """
    pooled = pooled_names(data_dir)
    pool_prefixes = (str(data_dir / "container-pool") + "/", str(data_dir / "warm-pool") + "/")
    parent = node_cgroup_parent(data_dir)
    cg = 0
    root = Path("/sys/fs/cgroup")
    for base in list(root.glob(f"{parent}*")) + list(root.glob(f"*/{parent}*")):
        if base.is_dir():
            for _dirpath, dirnames, _ in os.walk(base):
                dirnames[:] = [d for d in dirnames if d not in pooled]
                cg += len(dirnames)
    dirs = sum(len(list(d.iterdir())) for d in (data_dir / "sandboxes", data_dir / "containers")
               if d.is_dir())
    data_s = str(data_dir)
    data_b = os.fsencode(data_s)
    try:
        mounts = sum(1 for line in open("/proc/self/mountinfo")
                     if data_s in line and not line.split()[4].startswith(pool_prefixes))
    except OSError:
        mounts = 0
    procs = 0
    for p in Path("/proc").glob("[0-9]*"):
        try:
            groups = (p / "cgroup").read_text()
            cmdline = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if any(f"/{name}\n" in groups or f"/{name}/" in groups for name in pooled):
            continue
        in_node = f"/{parent}/" in groups or f"/{parent}-" in groups
        argv0 = os.path.basename(cmdline.split(b"\0", 1)[0])
        if in_node or (data_b in cmdline and argv0 != b"sandlot"):
            procs += 1
    return {"sandbox_dirs": dirs, "mounts": mounts, "cgroups": cg, "processes": procs,
            "veths": count_veths()}


def pooled_names(data_dir: Path) -> set:
    """Names of the entries of DATA/warm-pool and DATA/container-pool (ready or being
    built pooled jails and containers: ``wp-<hex>``, ``cp-<hex>``)."""
    names = set()
    for d in (data_dir / "warm-pool", data_dir / "container-pool"):
        try:
            names.update(os.listdir(d))
        except OSError:
            pass
    return names


def count_veths() -> int:
    """veth devices in this (the host's) network namespace; 0 without iproute2."""
    try:
        out = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.strip())


def wait_no_leaks(data_dir: Path, before: Dict[str, int], timeout: float = 30.0,
                  what: str = "") -> Dict[str, int]:
    """Poll :func:`count_leaks` until no count exceeds ``before``; fail after ``timeout``
    with both counts. Returns the last count."""
    last: Dict[str, int] = {}

    def clean() -> bool:
        last.update(count_leaks(data_dir))
        return all(last[k] <= before.get(k, 0) for k in last)

    deadline = time.monotonic() + timeout
    while not clean():
        if time.monotonic() > deadline:
            pytest.fail(f"leaked{' ' + what if what else ''}: before {before}, after {last}")
        time.sleep(0.2)
    return dict(last)


#: HTTP status of each wire error code (crates/sandlot-server/src/error.rs).
ERROR_STATUS = {"invalid_argument": 400, "not_found": 404, "payload_too_large": 413}


def private_base(prefix: str) -> Path:
    """A fresh directory under /var/tmp (mode 0711) for a private node's data dir: not
    under pytest's private temp dir (0700), because containers run as unprivileged host
    uids that must walk down to DATA/containers/<id>/rootfs. Remove it with
    `remove_private_base`."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    os.chmod(base, 0o711)
    return base


def image_cli(binary: Path, base: Path) -> Callable[..., str]:
    """`sandlot image ARGS…` on the private image store `base/images` (data dir
    `base/image-data`); the returned function gives stdout and raises on a failure."""
    def run(*args: str) -> str:
        return subprocess.run([str(binary), "image", *args, "--data-dir", str(base / "image-data"),
                               "--images-dir", str(base / "images")], check=True,
                              capture_output=True, text=True, timeout=120).stdout
    return run


@contextlib.contextmanager
def private_image_node(binary: Path, log_path: Path, monkeypatch,
                       prefix: str) -> Iterator[Tuple[Server, Callable[..., str]]]:
    """A private `sandlot up` on its own image store (`image_cli`), with a built-in
    `busybox` built there: for tests that rebuild or remove images, which must never change
    the shared store. The guest kit stays the shared one (by default it lies beside the
    image store). Yields the started server and its `image_cli`; afterwards deletes every
    sandbox and checkpoint, stops the node and removes its directory."""
    base = private_base(prefix)
    image = image_cli(binary, base)
    try:
        image("build", "busybox")
        monkeypatch.setenv("SANDLOT_GUEST_KIT_DIR", os.environ.get(
            "SANDLOT_GUEST_KIT_DIR", str(Path(IMAGES_DIR).parent / "guest-kit")))
        monkeypatch.setattr(sys.modules[__name__], "IMAGES_DIR", str(base / "images"))
        srv = Server(binary, base / "data", log_path)
        try:
            srv.start()
            yield srv, image
            srv.delete_all()
        finally:
            srv.stop()
    finally:
        remove_private_base(base)


def remove_private_base(base: Path) -> None:
    """Removes `base` unless something is still mounted below it (a leak is reported by
    the tests that count leaks, never deleted through)."""
    with open("/proc/self/mountinfo") as f:
        if any(str(base) in line for line in f):
            print(f"{base} kept: something is still mounted below it")
            return
    shutil.rmtree(base, ignore_errors=True)


def assert_error(resp, code: str) -> dict:
    """``resp`` (an httpx.Response) is ``{"error": {"code": code, "message": non-empty}}``
    with code's HTTP status; returns the error object."""
    assert resp.status_code == ERROR_STATUS[code], (resp.status_code, resp.text[:300])
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert err["code"] == code and err["message"], err
    return err


def host_processes_matching(needle: bytes) -> List[int]:
    """Pids of host processes whose NUL-joined cmdline contains ``needle``."""
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except (OSError, ValueError):
            pass
    return out


@pytest.fixture(scope="session")
def binary() -> Path:
    b = find_binary()
    if b is None:
        pytest.skip("no `sandlot` binary: set SANDLOT_BIN or run `cargo build -p sandlot-cli`")
    return b


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    d = os.environ.get("SANDLOT_E2E_LOG_DIR")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        return Path(d)
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def server(binary, tmp_path_factory, log_dir) -> Iterator[Server]:
    """The shared `sandlot up` of the session (SIGTERM at the end; log tail on failure)."""
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root (namespaces, cgroups, overlay mounts)")
    data = private_base("sandlot-e2e-")
    srv = Server(binary, data / "data", log_dir / "sandlot-up.log")
    try:
        srv.start()
    except RuntimeError as e:
        pytest.fail(f"could not start `sandlot up`: {e}")
    yield srv
    try:
        code = srv.stop()
        print(f"\n`sandlot up` exited with {code}; log: {srv.log_path}")
    except RuntimeError as e:
        print(e)
    remove_private_base(data)


@pytest.fixture(scope="session")
def client(server) -> Iterator[sandlot.Client]:
    c = sandlot.Client(server.url, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="session")
def python_image(client, server) -> str:
    """Skip unless a `python` sandbox can be created here (image present, backend works)."""
    try:
        sb = client.create(image="python", memory_mib=128, ttl_s=120)
    except (sandlot.NotFound, sandlot.Unavailable) as e:
        pytest.skip(f"no usable `python` image in {IMAGES_DIR} "
                    f"(run scripts/setup.sh or `sandlot image build python`): {e}")
    try:
        r = sb.exec(["python3", "-c", "print('ready')"], timeout_s=30)
        if r.exit_code != 0:
            pytest.fail(f"python image present but python3 fails: {r}\n{server.log_tail()}")
    finally:
        sb.delete()
    return "python"


@pytest.fixture
def sb(client, python_image, server, request) -> Iterator[sandlot.Sandbox]:
    """A fresh python sandbox (128 MiB, 1 core, 5 min TTL), deleted after the test."""
    box = client.create(image=python_image, memory_mib=128, ttl_s=300,
                        labels={"test": request.node.name[:60]})
    yield box
    try:
        box.delete()
    except sandlot.SandlotError as e:
        print(f"cleanup of {box.id} failed: {e}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failed test, print the tail of the server log (kept in the log dir)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed:
        srv = item.funcargs.get("server") if hasattr(item, "funcargs") else None
        if isinstance(srv, Server):
            rep.sections.append(("sandlot up log", srv.log_tail()))


# --- The E2B SDK tests on three backends (tests/test_e2b_sdk.py, test_e2b_code_interpreter.py)

#: Backends the E2B SDK tests run on, each through a `sandlot up` whose E2B sandboxes are of
#: that backend (`--e2b-backend`): `function` is the shared session server (its default),
#: `container` (runc) and `microvm` get a private server each.
E2B_BACKENDS = ("function", "container", "microvm")


class E2bTarget:
    """One backend case of the E2B SDK tests: ``backend`` and the ``server`` whose E2B API
    creates sandboxes of it (``url``)."""

    def __init__(self, backend: str, server: Server) -> None:
        self.backend = backend
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    def __repr__(self) -> str:
        return f"E2bTarget({self.backend}, {self.url})"


def e2b_backend_required(backend: str) -> bool:
    """Whether ``SANDLOT_REQUIRE_BACKENDS`` (the conformance suite's comma list) names
    ``backend``: ``container`` counts when it names ``container`` or ``container-runc``."""
    names = {n.strip() for n in os.environ.get("SANDLOT_REQUIRE_BACKENDS", "").split(",")}
    if backend == "container":
        return bool(names & {"container", "container-runc"})
    return backend in names


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "e2b_only(*backends, why): an E2B SDK test that runs only on these of "
        "E2B_BACKENDS (the others skip with `why`)")


def pytest_collection_modifyitems(config, items) -> None:
    """Skips the E2B backend cases a test's `e2b_only` marker leaves out, with its reason
    (before any fixture runs, so a left-out case costs nothing)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = params.get("e2b_target")
        mark = item.get_closest_marker("e2b_only")
        if backend is None or mark is None or backend in mark.args:
            continue
        why = mark.kwargs.get("why", "not run on this backend")
        item.add_marker(pytest.mark.skip(reason=f"e2b on {backend}: {why} "
                                                f"(runs on {', '.join(mark.args)})"))


@pytest.fixture(scope="session", params=E2B_BACKENDS)
def e2b_target(request, binary, server, log_dir) -> Iterator[E2bTarget]:
    """The backend case of an E2B SDK test (session scope, parametrised over
    :data:`E2B_BACKENDS`). A backend the host cannot run (its ``/healthz`` entry is not
    ``ok``) skips with the reason, or fails when ``SANDLOT_REQUIRE_BACKENDS`` names it."""
    backend = request.param
    if backend == "function":
        yield E2bTarget(backend, server)
        return
    data = private_base(f"sandlot-e2b-{backend}-")
    # No function warm pools on these servers (their E2B sandboxes are not functions); the
    # container server keeps the default container pool of `python` (E2B's `base`).
    args = ["--e2b-backend", backend, "--warm-pool", "0", "--run-code-pool-images", ""]
    if backend != "container":
        args += ["--container-warm-pool", "0"]
    srv = Server(binary, data / "data", log_dir / f"sandlot-up-e2b-{backend}.log", args=args)
    try:
        try:
            srv.start()
        except RuntimeError as e:
            pytest.fail(f"could not start `sandlot up --e2b-backend {backend}`: {e}")
        with sandlot.Client(srv.url, timeout=30) as c:
            status = c._request("GET", "/healthz").json().get("backends", {}).get(backend)
        if status != "ok":
            why = f"e2b on {backend}: /healthz says {status!r}"
            if e2b_backend_required(backend):
                pytest.fail(f"{why}, but SANDLOT_REQUIRE_BACKENDS names it", pytrace=False)
            pytest.skip(why)
        yield E2bTarget(backend, srv)
        srv.delete_all()
    finally:
        try:
            srv.stop()
        finally:
            remove_private_base(data)


@pytest.fixture
def e2b_env(e2b_target, monkeypatch) -> str:
    """Points the e2b SDKs at ``e2b_target``'s server (E2B_API_URL and E2B_SANDBOX_URL both
    its URL, any API key: it runs without keys); returns the URL."""
    monkeypatch.setenv("E2B_API_URL", e2b_target.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_target.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_sandlot_no_auth")
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return e2b_target.url


def wait_for(pred, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll ``pred`` every ``interval`` seconds (exceptions count as false) until it is true;
    the seconds it took. Fails the test after ``timeout`` seconds, naming ``what``."""
    t0 = time.monotonic()
    while True:
        try:
            if pred():
                return time.monotonic() - t0
        except Exception:
            pass
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def scrape(url: str) -> Dict[str, float]:
    """`GET {url}/metrics` as {series: value}, each series written as the text format has
    it (name, then its labels in braces)."""
    import httpx
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def process_stdout(proc, until: bytes, timeout: float = 30) -> tuple:
    """Reads ``proc``'s output from offset 0 (following) until ``until`` is in its stdout:
    (stdout bytes from where the server still has them, the OutputSkipped events)."""
    out, skipped = bytearray(), []
    deadline = time.monotonic() + timeout
    events = proc.output(follow=True, stdout_offset=0, stderr_offset=0)
    try:
        for ev in events:
            if isinstance(ev, sandlot.OutputSkipped):
                skipped.append(ev)
            elif isinstance(ev, sandlot.StdoutChunk):
                out += ev.data
            if until in out:
                break
            assert time.monotonic() < deadline, f"no {until!r} in {bytes(out)!r}"
    finally:
        events.close()
    return bytes(out), skipped
