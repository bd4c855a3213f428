"""Fixtures of the conformance suite: every test here runs once per backend case.

Cases (the test id names the case, e.g. ``test_stdin[container-runsc]``):

    function          backend="function"
    container-runc    backend="container", runtime="runc"
    container-runsc   backend="container", runtime="runsc"
    microvm           backend="microvm" (QEMU; under TCG each boot takes seconds, so only
                      the tests in ``REDUCED[microvm]`` run: at least one per category;
                      the others skip with that reason)
    vm                backend="vm" (QEMU q35 booting a whole disk; slower still: the
                      smaller subset ``REDUCED[vm]``, one or more per category, about ten
                      boots in all)

A case the session server cannot run is skipped with the reason: ``GET /healthz`` lists the
backend as ``"unavailable: why"``, or a probe create answers ``unavailable`` (runtime not
installed, crun on cgroup v1), ``not_found`` (no such image for that backend) or refuses the
``runtime`` field (a server that predates it). When the environment variable
``SANDLOT_REQUIRE_BACKENDS`` (comma list of case names; ``container`` stands for every
``container-*`` case) names the case, the same reason fails every test of the case instead.

Fixtures:
    backend     the case (session scope, parametrised); probe passed.
    sb          one sandbox of the case shared by the tests of a module (256 MiB, 20 min TTL):
                for tests that leave it as they found it.
    make        factory of fresh sandboxes of the case (``make(memory_mib=64, ...)``), all
                deleted after the test.
    leak_baseline  host resources of the node (tests/conftest.py ``count_leaks``) taken
                before the case's first test; test_zz_leaks.py checks them after its last.

Every sandbox carries the label ``conformance=<case>``.

Against a cluster (issue 21: "server A creates, server B execs and reads files, server A
deletes"): with ``SANDLOT_CONFORMANCE_CLUSTER=DIR``, DIR a cluster started by
``scripts/cluster.sh up DIR 1 --postgres --servers 2`` (one node, so the leak counts and
the tests that look into a sandbox's directory read ``DIR/node0``), the session's
``server`` is that cluster (``url``: server A, ``data_dir``: the node's, ``log_tail``: the
servers' and the node's logs) and ``client`` is a :class:`SplitClient`: creates and
sandbox deletes go to server A, every other call (exec, streaming, files, processes,
pause, checkpoints, get, list) to server B, so each handle is served by both. Only
``CLUSTER_CASES`` run there (the microvm and vm cases boot under TCG on the test hosts:
too slow for the CI budget), and of their tests only ``CLUSTER_SUBSET`` (every category).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional

import pytest

import sandlot
from conftest import count_leaks, wait_until

#: Image of every conformance sandbox (the local `python` image built by scripts/setup.sh).
IMAGE = os.environ.get("SANDLOT_CONFORMANCE_IMAGE", "python")
REQUIRE_ENV = "SANDLOT_REQUIRE_BACKENDS"


@dataclass(frozen=True)
class Case:
    """One backend configuration the suite runs against."""

    name: str
    backend: str
    runtime: Optional[str] = None

    def create_args(self) -> Dict[str, Any]:
        """``backend=`` and, when set, ``runtime=`` of the create call."""
        args: Dict[str, Any] = {"backend": self.backend}
        if self.runtime is not None:
            args["runtime"] = self.runtime
        return args

    @property
    def labels(self) -> Dict[str, str]:
        return {"conformance": self.name}


CASES: List[Case] = [
    Case("function", "function"),
    Case("container-runc", "container", "runc"),
    Case("container-runsc", "container", "runsc"),
    Case("microvm", "microvm"),
    Case("vm", "vm"),
]

#: Cases that run only a subset of the suite (slow boots), by test function name: every
#: category (errors, exec, files, lifecycle, limits, processes, pause, checkpoint, ports) has at least
#: one test.
REDUCED: Dict[str, FrozenSet[str]] = {
    "microvm": frozenset({
        "test_unknown_image_is_not_found",
        "test_bad_exec_requests",
        "test_echo_cwd_env_defaults",
        "test_argv_is_not_a_shell_string",
        "test_loopback_is_up",
        "test_stdin_binary_and_text",
        "test_non_utf8_bytes_exact",
        "test_timeout_kills_background_children",
        "test_missing_command_is_127",
        "test_killed_by_signal_is_128_plus_n",
        "test_streaming_yields_chunks_then_result",
        "test_backend_and_runtime_are_the_ones_asked_for",
        # background processes (test_processes.py)
        "test_output_later_and_reconnect_with_a_new_client",
        "test_signal_term_and_a_trapping_shell",
        "test_kill_ends_the_whole_tree",
        "test_stdin_interaction",
        "test_create_get_list_defaults",
        "test_delete_twice_and_unknown",
        "test_delete_during_running_exec",
        "test_env_of_sandbox_and_exec_override",
        "test_fork_bomb_contained_by_pids_limit",
        "test_memory_limit_oom_killed",
        "test_binary_round_trip",
        "test_list_dir_entries",
        "test_dotdot_read_cannot_escape",
        "test_symlink_escapes_refused",
        "test_stat_reports_files_dirs_and_links",
        # pause (test_pause.py): memory saved to a file, QEMU stopped, restored
        "test_pause_resume_keeps_a_background_process_and_files",
        "test_pause_twice_resume_twice_and_delete_while_paused",
        # checkpoint (test_checkpoint.py): one case, 5 boots
        "test_checkpoint_forks_three_sandboxes",
        # ingress (test_ports.py): through the guest agent's tunnel; one boot
        "test_ingress_reaches_a_server_on_the_sandbox_loopback",
    }),
    # Each module's shared `sb` is one boot, each `make`/create test one more: 18 tests,
    # ~15 boots of ~8 s each under TCG.
    "vm": frozenset({
        "test_unknown_image_is_not_found",
        "test_bad_exec_requests",
        "test_echo_cwd_env_defaults",
        "test_loopback_is_up",
        "test_stdin_binary_and_text",
        "test_timeout_kills_background_children",
        "test_missing_command_is_127",
        "test_streaming_yields_chunks_then_result",
        "test_backend_and_runtime_are_the_ones_asked_for",
        "test_create_get_list_defaults",
        "test_delete_during_running_exec",
        "test_kill_ends_the_whole_tree",
        "test_fork_bomb_contained_by_pids_limit",
        "test_memory_limit_oom_killed",
        "test_binary_round_trip",
        "test_symlink_escapes_refused",
        # pause (test_pause.py): memory saved to a file, QEMU stopped, restored
        "test_pause_resume_keeps_a_background_process_and_files",
        "test_pause_twice_resume_twice_and_delete_while_paused",
        # checkpoint (test_checkpoint.py): qcow2 layer snapshot, 4 boots + the parent's
        "test_checkpoint_forks_three_sandboxes",
        # ingress (test_ports.py): through the guest agent's tunnel; one boot
        "test_ingress_reaches_a_server_on_the_sandbox_loopback",
    }),
}


CLUSTER_ENV = "SANDLOT_CONFORMANCE_CLUSTER"
#: The cases run against a cluster (``SANDLOT_CONFORMANCE_CLUSTER``).
CLUSTER_CASES = frozenset({"function", "container-runc"})
#: The tests run against a cluster, for each of ``CLUSTER_CASES``: the microvm subset (one or
#: more per category: errors, exec, files, lifecycle, limits, processes, pause, checkpoint, ports),
#: so both cases fit CI's budget (the whole suite on `function` alone takes ~60 s there),
#: the per-case check that nothing is left behind on the node, and E2B pids across servers
#: (test_e2b_cluster.py; cluster-only, on the E2B backend's case).
# Ingress is not carried over the node API wire yet: a cluster's servers answer 503 for
# `/ports/` (docs/operations.md, cluster mode), so test_ports stays out of this subset.
CLUSTER_SUBSET: FrozenSet[str] = (REDUCED["microvm"] - {
    "test_ingress_reaches_a_server_on_the_sandbox_loopback"}) | {
    "test_nothing_left_after_the_case", "test_e2b_pids_and_tags_reach_across_servers",
    "test_e2b_code_contexts_reach_across_servers",
    "test_e2b_snapshot_names_reach_across_servers"}

#: Known failures against a cluster, by test name (strict: a pass fails the run, so the
#: entry goes when the cause is fixed).
CLUSTER_XFAIL: Dict[str, str] = {}


def cluster_dir() -> Optional[Path]:
    """The cluster directory named by ``SANDLOT_CONFORMANCE_CLUSTER``, or None."""
    d = os.environ.get(CLUSTER_ENV)
    return Path(d) if d else None


@pytest.fixture(autouse=True)
def _reduced_case(request):
    """Skips a test outside a reduced case's subset (or, against a cluster, a case outside
    ``CLUSTER_CASES``), with the reason."""
    if "backend" not in request.fixturenames:
        return
    case = request.getfixturevalue("backend")
    if cluster_dir() is not None:
        name = request.function.__name__
        if name not in CLUSTER_SUBSET:
            pytest.skip(f"{case.name}: not in the subset run against a cluster "
                        "(conftest CLUSTER_SUBSET)")
        if name in CLUSTER_XFAIL:
            request.applymarker(pytest.mark.xfail(reason=CLUSTER_XFAIL[name], strict=True))
        return
    subset = REDUCED.get(case.name)
    if subset is not None and request.function.__name__ not in subset:
        pytest.skip(f"{case.name}: not in the reduced set of this slow case (conftest REDUCED)")


class SplitClient(sandlot.Client):
    """A client of two servers of one cluster: creates (``POST /v1/sandboxes``, batch) and
    sandbox deletes (``DELETE /v1/sandboxes/{id}``) go to ``creator`` (server A), every
    other call — including streams, which use the connection pool directly — to ``url``
    (server B). Handles it returns are bound to it, so one sandbox is created by A, used
    through B and deleted by A."""

    def __init__(self, creator: str, url: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.creator = sandlot.Client(creator, **kw)

    def _request(self, method: str, path: str, **kw: Any):
        lifecycle = (method == "POST" and path in ("/v1/sandboxes", "/v1/sandboxes:batch")) \
            or (method == "DELETE" and path.startswith("/v1/sandboxes/") and path.count("/") == 3)
        if lifecycle:
            return self.creator._request(method, path, **kw)
        return super()._request(method, path, **kw)

    def close(self) -> None:
        self.creator.close()
        super().close()


class ClusterServer:
    """What the suite needs of its ``server`` fixture, for a local cluster (see the module
    docstring): ``url`` (server A), ``urls`` (A, B), ``data_dir`` (the one node's)."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.urls = [(d / "server.url").read_text().strip(), (d / "server1.url").read_text().strip()]
        self.url = self.urls[0]
        self.data_dir = d / "node0"
        #: Server B's process (``pid``): file reads go through it (test_limits.py samples
        #: its memory).
        self.proc = SimpleNamespace(pid=int((d / "server1.pid").read_text()))
        if not self.data_dir.is_dir() or (d / "node1").exists():
            pytest.fail(f"{CLUSTER_ENV}={d}: expected `cluster.sh up {d} 1 --servers 2` "
                        "(one node)", pytrace=False)

    def log_tail(self, n: int = 60) -> str:
        out = []
        for log in ("server.log", "server1.log", "node0.log"):
            try:
                lines = (self.dir / log).read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"--- tail of {self.dir / log} ---\n" + "\n".join(lines[-n // 3:]))
        return "\n".join(out) or "(no log)"


@pytest.fixture(scope="session")
def server(request) -> Iterator[Any]:
    """The session's `sandlot up` (tests/conftest.py's ``server``, which this overrides), or
    the cluster of ``SANDLOT_CONFORMANCE_CLUSTER``."""
    d = cluster_dir()
    if d is None:
        yield request.getfixturevalue("server")  # the parent fixture of the same name
    else:
        yield ClusterServer(d)


@pytest.fixture(scope="session")
def client(server, request) -> Iterator[sandlot.Client]:
    """tests/conftest.py's ``client``; against a cluster a :class:`SplitClient` (A, B)."""
    if not isinstance(server, ClusterServer):
        yield request.getfixturevalue("client")  # the parent fixture of the same name
        return
    c = SplitClient(server.urls[0], server.urls[1], timeout=60)
    yield c
    c.close()


def required_cases(value: Optional[str]) -> FrozenSet[str]:
    """Case names required by a ``SANDLOT_REQUIRE_BACKENDS`` value.

    Raises:
        ValueError: a name that is neither a case nor ``container``.
    """
    names = {n.strip() for n in (value or "").split(",") if n.strip()}
    known = {c.name for c in CASES}
    out = set()
    for n in names:
        if n in known:
            out.add(n)
        elif n == "container":
            out |= {c.name for c in CASES if c.backend == "container"}
        else:
            raise ValueError(f"{REQUIRE_ENV}={value!r}: unknown case {n!r} "
                             f"(known: {', '.join(sorted(known))}, container)")
    return frozenset(out)


def probe(case: Case, client: sandlot.Client, server) -> Optional[str]:
    """None when ``case`` runs on the session server, else the reason it cannot.

    A backend that says it works but cannot run `python3` in its probe sandbox is a failure,
    not a skip.
    """
    health = client._request("GET", "/healthz").json()
    status = health.get("backends", {}).get(case.backend)
    if status is None:
        return f"/healthz lists no backend {case.backend!r}: {health.get('backends')}"
    if status != "ok":
        return f"/healthz: {case.backend}: {status}"
    try:
        box = client.create(image=IMAGE, memory_mib=128, ttl_s=120,
                            labels={**case.labels, "probe": "1"}, **case.create_args())
    except sandlot.Unavailable as e:
        return f"create answered unavailable: {e.message}"
    except sandlot.NotFound as e:
        return (f"no image {IMAGE!r} for backend {case.backend} "
                f"(run scripts/setup.sh): {e.message}")
    except sandlot.InvalidArgument as e:
        if case.runtime is not None and "runtime" in e.message:
            return f"the server does not take runtime={case.runtime!r}: {e.message}"
        pytest.fail(f"{case.name}: the probe create was refused: {e}", pytrace=False)
    except sandlot.SandlotError as e:
        pytest.fail(f"{case.name}: /healthz lists backend {case.backend} as ok but the probe "
                    f"create failed: {e}\n{server.log_tail(20)}", pytrace=False)
    try:
        r = box.exec(["python3", "-c", "print('ready')"], timeout_s=60)
        if r.exit_code != 0 or r.stdout != b"ready\n":
            pytest.fail(f"{case.name}: the backend is listed as ok but its probe sandbox "
                        f"cannot run python3: {r}\n{server.log_tail()}")
    finally:
        box.delete()
    sb_dir = server.data_dir / "sandboxes" / box.id
    wait_until(lambda: not sb_dir.exists(), 30, what=f"the probe sandbox {box.id} to go")
    return None


@pytest.fixture(scope="session")
def required_backends() -> FrozenSet[str]:
    try:
        return required_cases(os.environ.get(REQUIRE_ENV))
    except ValueError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session", params=CASES, ids=[c.name for c in CASES])
def backend(request, client, server, required_backends) -> Case:
    """The backend case of the test; skipped (or, when required, failed) with the reason
    when the session server cannot run it."""
    case: Case = request.param
    if cluster_dir() is not None and case.name not in CLUSTER_CASES:
        pytest.skip(f"{case.name}: not run against a cluster ({CLUSTER_ENV}; "
                    f"CLUSTER_CASES: {', '.join(sorted(CLUSTER_CASES))})")
    why = probe(case, client, server)
    if why is not None:
        if case.name in required_backends:
            pytest.fail(f"{case.name} is required ({REQUIRE_ENV}="
                        f"{os.environ.get(REQUIRE_ENV)}) but cannot run here: {why}",
                        pytrace=False)
        pytest.skip(f"{case.name}: {why}")
    return case


@pytest.fixture(scope="session", autouse=True)
def leak_baseline(backend, server) -> Dict[str, int]:
    """Host resources of the node before the case's first test (see ``count_leaks``)."""
    return count_leaks(server.data_dir)


@pytest.fixture
def make(backend, client, request) -> Iterator[Callable[..., sandlot.Sandbox]]:
    """Factory: ``make(**create_kwargs)`` creates a sandbox of the case (image, backend,
    runtime and labels filled in, TTL 5 min unless given); all are deleted after the test."""
    boxes: List[sandlot.Sandbox] = []

    def create(**kw: Any) -> sandlot.Sandbox:
        labels = {**backend.labels, "test": request.node.name[:60], **kw.pop("labels", {})}
        kw.setdefault("image", IMAGE)
        kw.setdefault("ttl_s", 300)
        box = client.create(labels=labels, **backend.create_args(), **kw)
        boxes.append(box)
        return box

    yield create
    for box in boxes:
        try:
            box.delete()
        except sandlot.SandlotError as e:
            print(f"cleanup of {box.id} failed: {e}")


@pytest.fixture(scope="module")
def sb(backend, client, request) -> Iterator[sandlot.Sandbox]:
    """One sandbox of the case shared by a module's tests (256 MiB, 20 min TTL). Tests on it
    work in their own paths and leave no process behind."""
    box = client.create(image=IMAGE, memory_mib=256, ttl_s=1200, **backend.create_args(),
                        labels={**backend.labels, "module": request.module.__name__[-60:]})
    yield box
    try:
        box.delete()
    except sandlot.SandlotError as e:
        print(f"cleanup of {box.id} failed: {e}")


def _case_of(nodeid: str) -> Optional[str]:
    if "conformance/" not in nodeid or "[" not in nodeid:
        return None
    params = nodeid[nodeid.index("[") + 1:]
    for c in sorted(CASES, key=lambda c: -len(c.name)):
        if params == f"{c.name}]" or params.startswith(f"{c.name}-"):
            return c.name
    return None


def pytest_terminal_summary(terminalreporter) -> None:
    """One line per backend case: its outcome counts and, when skipped or failed in its
    fixture, why (the `-rs` list repeats the reason once per test)."""
    counts: Dict[str, Dict[str, int]] = {}
    why: Dict[str, str] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for rep in terminalreporter.stats.get(outcome, []):
            case = _case_of(getattr(rep, "nodeid", ""))
            if case is None or (outcome == "passed" and rep.when != "call"):
                continue
            c = counts.setdefault(case, {})
            c[outcome] = c.get(outcome, 0) + 1
            if outcome == "skipped" and isinstance(rep.longrepr, tuple):
                why.setdefault(case, rep.longrepr[2].removeprefix("Skipped: "))
            elif outcome == "error" and case not in why:
                crash = getattr(rep.longrepr, "reprcrash", None)
                why[case] = (crash.message if crash is not None else str(rep.longrepr))[:300]
    if not counts:
        return
    terminalreporter.section("conformance cases")
    for case in [c.name for c in CASES if c.name in counts]:
        line = ", ".join(f"{n} {o}" for o, n in counts[case].items())
        reason = f" — {why[case]}" if case in why else ""
        terminalreporter.write_line(f"{case}: {line}{reason}")
