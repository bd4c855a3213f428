"""Fixtures of the attack suite (tests/security): every attempt runs once per backend case of
the conformance suite (``function``, ``container-runc``, ``container-runsc``; cases the
session server cannot run are skipped, or failed when ``SANDLOT_REQUIRE_BACKENDS`` names
them — the same probe as tests/conformance/conftest.py).

Fixtures:
    backend   the case (session scope, parametrised).
    target    one sandbox of the case shared by a module's attempts (the payload
              ``attack_payload.py`` uploaded to /workspace), deleted after the module (so
              tests/test_zz_leaks.py, which runs later, finds nothing left).
    make      factory of fresh sandboxes of the case, deleted after the test.
    audit     :class:`Audit` over ``GET /v1/events`` of the session server.
    table     the attempt × backend table; written to tests/artifacts/attack-table.md and
              printed in the pytest summary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import httpx
import pytest

import sandlot
from conformance.conftest import CASES, REQUIRE_ENV, Case, probe, required_cases

HERE = Path(__file__).resolve().parent
IMAGE = os.environ.get("SANDLOT_CONFORMANCE_IMAGE", "python")
ARTIFACT = HERE.parent / "artifacts" / "attack-table.md"

#: Rows of the table: attempt → case → (blocked, event text). Filled by the tests.
ROWS: Dict[str, Dict[str, Tuple[str, str]]] = {}
#: attempt → the isolation layer(s) that stop it.
LAYERS: Dict[str, str] = {}


class Audit:
    """``GET /v1/events`` of one sandbox after a cursor."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)

    def cursor(self) -> str:
        return self.http.get("/v1/events", params={"limit": 1}).json()["next"]

    def since(self, cursor: str, sandbox: Optional[str] = None,
              kind: Optional[str] = None) -> List[Dict[str, Any]]:
        params: Dict[str, Any] = {"since": cursor, "limit": 1000}
        if sandbox:
            params["sandbox"] = sandbox
        if kind:
            params["kind"] = kind
        r = self.http.get("/v1/events", params=params)
        r.raise_for_status()
        return r.json()["events"]


@pytest.fixture(scope="session")
def audit(server) -> Iterator[Audit]:
    a = Audit(server.url)
    yield a
    a.http.close()


@pytest.fixture(scope="session")
def required_backends() -> frozenset:
    try:
        return required_cases(os.environ.get(REQUIRE_ENV))
    except ValueError as e:
        pytest.fail(str(e), pytrace=False)


#: Every backend case. In a microVM the sandbox's root owns its own guest kernel (/proc/sys,
#: /sys, SysRq, the clock and the host name are the guest's), so there "blocked" means: the
#: host is unaffected, checked from the host side (test_attacks.py, ``VM_*``).
SECURITY_CASES = list(CASES)

#: Cases whose sandboxes are virtual machines with a guest kernel of their own (slow boots
#: under TCG; kernel interfaces inside are the guest's).
VM_CASES = ("microvm", "vm")


@pytest.fixture(scope="session", params=SECURITY_CASES, ids=[c.name for c in SECURITY_CASES])
def backend(request, client, server, required_backends) -> Case:
    case: Case = request.param
    why = probe(case, client, server)
    if why is not None:
        if case.name in required_backends:
            pytest.fail(f"{case.name} is required but cannot run here: {why}", pytrace=False)
        pytest.skip(f"{case.name}: {why}")
    return case


@pytest.fixture(scope="module")
def target(backend, client) -> Iterator[sandlot.Sandbox]:
    box = client.create(image=IMAGE, memory_mib=256, ttl_s=1200, **backend.create_args(),
                        labels={"security": backend.name})
    box.write_file("/workspace/attack_payload.py", (HERE / "attack_payload.py").read_bytes())
    yield box
    try:
        box.delete()
    except sandlot.SandlotError as e:
        print(f"cleanup of {box.id} failed: {e}")


#: The one fresh-sandbox stand-in of the VM cases (see ``make``): enough for each test
#: that asks for one (fork bomb: pids_max 32; memory bomb: 128 MiB of guest RAM against a
#: 400 MiB allocation; disk and inode fill: 16 MiB; CPU spin: one core).
SHARED_VM = dict(memory_mib=128, pids_max=32, disk_mib=16, cpu=1, ttl_s=900)


@pytest.fixture(scope="module")
def shared_vm(backend, client) -> Iterator[sandlot.Sandbox]:
    box = client.create(image=IMAGE, labels={"security": backend.name}, **backend.create_args(),
                        **SHARED_VM)
    box.write_file("/workspace/attack_payload.py", (HERE / "attack_payload.py").read_bytes())
    yield box
    try:
        box.delete()
    except sandlot.SandlotError as e:
        print(f"cleanup of {box.id} failed: {e}")


@pytest.fixture
def make(backend, client, request) -> Iterator[Callable[..., sandlot.Sandbox]]:
    """Factory of fresh sandboxes, deleted after the test. microvm, vm: a VM boots in 7-9 s
    under TCG, so every test gets the module's one :data:`SHARED_VM` instead (the attempts
    that use it cannot harm the next: each is contained and checked, and what they leave
    in /tmp is removed after the test) — except a sandbox with a ``network`` policy, which
    is fixed at create: that one is a VM of its own (a cold boot)."""
    boxes: List[sandlot.Sandbox] = []

    def create(**kw: Any) -> sandlot.Sandbox:
        kw.setdefault("image", IMAGE)
        kw.setdefault("ttl_s", 300)
        box = client.create(labels={"security": backend.name}, **backend.create_args(), **kw)
        boxes.append(box)
        box.write_file("/workspace/attack_payload.py",
                       (HERE / "attack_payload.py").read_bytes())
        return box

    if backend.name in VM_CASES:
        vm: sandlot.Sandbox = request.getfixturevalue("shared_vm")
        yield lambda **kw: create(**kw) if "network" in kw else vm
        vm.exec("rm -rf /tmp/fill /tmp/inodes", timeout_s=120)
    else:
        yield create
    for box in boxes:
        try:
            box.delete()
        except sandlot.SandlotError as e:
            print(f"cleanup of {box.id} failed: {e}")


def record(attempt: str, case: str, layer: str, blocked: str, event: str) -> None:
    ROWS.setdefault(attempt, {})[case] = (blocked, event)
    LAYERS.setdefault(attempt, layer)


def render_table() -> str:
    cases = [c.name for c in SECURITY_CASES]
    lines = ["| # | attempt | stopped by | " + " | ".join(cases) + " |",
             "|---|---|---|" + "---|" * len(cases)]
    for i, (attempt, per) in enumerate(ROWS.items(), 1):
        cells = []
        for c in cases:
            if c in per:
                b, e = per[c]
                cells.append(f"{b}; {e}")
            else:
                cells.append("not run")
        lines.append(f"| {i} | `{attempt}` | {LAYERS.get(attempt, '')} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter) -> None:
    if not ROWS:
        return
    text = render_table()
    header = ("# Attack table\n\nWritten by `pytest tests/security` (tests/security/conftest.py). "
              "Cell: *blocked* (the attempt failed: how) ; *event* (the audit event that "
              "recorded it in `GET /v1/events`).\n\n")
    try:
        ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
        ARTIFACT.write_text(header + text + "\n")
    except OSError as e:
        terminalreporter.write_line(f"could not write {ARTIFACT}: {e}")
    terminalreporter.section("attack table (attempt x backend -> blocked; event)")
    for line in text.splitlines():
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"(written to {ARTIFACT})")
