#!/usr/bin/env python3
"""Run SandboxFusion's own runner tests against a Sandlot server's `/run_code`.

SandboxFusion (github.com/bytedance/SandboxFusion, Apache-2.0) tests its runners in
`sandbox/tests/runners/test_*.py`: each test builds a `RunCodeRequest` (or
`RunJupyterRequest`), posts it with FastAPI's in-process `TestClient(app)` and asserts on
the `RunCodeResponse`. This harness loads those files unchanged from a checkout of that
repository (never committed here) and redirects the calls to Sandlot over HTTP:

- `sandbox.runners` is the checkout's own `sandbox/runners/types.py` (the pydantic
  models and `CommandRunStatus`), loaded without the runner implementations;
- `sandbox.server.sandbox_api` is the checkout's own `sandbox/server/sandbox_api.py`
  (request/response models, `RunStatus`), executed with stand-ins for `fastapi.APIRouter`
  and `structlog` when those are not installed; its handlers are never called;
- `sandbox.server.server.app` is the Sandlot URL, and `fastapi.testclient.TestClient(app)`
  posts to `URL + path` with httpx (timeout 600 s).

Tests of modes Sandlot leaves out (julia, swift, lean, cuda, python_gpu: no Debian 12,
PyPI or npm package, or a GPU) and the one test that needs internet access are skipped,
each with its reason. Async tests run in `asyncio.run` (SandboxFusion runs them with
pytest-asyncio's auto mode).

Usage (not run in CI, it needs the checkout):

    .venv/bin/python tests/external/sandboxfusion_runners.py \\
        --checkout /tmp/sfx-src --url http://127.0.0.1:PORT [-k EXPR] [--file test_go.py]

Prints one line per test file (passed/failed/skipped) and the totals; exit status 0 when
nothing failed. Extra arguments after `--` go to pytest.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import sys
import types
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

# Test files whose mode Sandlot does not run, and why (docs/api.md, run_code).
LEFT_OUT = {
    "test_julia.py": "julia: no Debian 12 / PyPI / npm package",
    "test_swift.py": "swift: no Debian 12 / PyPI / npm package",
    "test_lean.py": "lean: Lean 4 and Mathlib have no Debian 12 package",
    "test_cuda.py": "cuda: needs an NVIDIA GPU and the CUDA toolkit",
    "test_python_gpu.py": "python_gpu: needs an NVIDIA GPU and torch with CUDA",
}
# Single tests that cannot pass here, and why.
SKIP_TESTS = {
    "test_isolation_network_external_access":
        "needs internet access (fetches https://www.sina.com.cn)",
}


def _load(name: str, path: Path, pre: dict | None = None) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if pre:
        mod.__dict__.update(pre)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _package(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so submodules import
    sys.modules[name] = mod
    return mod


class _Router:
    """Stand-in for `fastapi.APIRouter`: the route decorators return the function as is."""

    def __getattr__(self, _name):
        return lambda *a, **k: (lambda f: f)


class TestClient:
    """Stand-in for `fastapi.testclient.TestClient`: posts to the Sandlot URL over HTTP."""

    __test__ = False  # not a pytest class

    def __init__(self, app, *_, **__):
        self._http = httpx.Client(base_url=str(app), timeout=600.0)

    def post(self, path, json=None, **kw):
        return self._http.post(path, json=json, **kw)

    def get(self, path, **kw):
        return self._http.get(path, **kw)


def install_shims(checkout: Path, url: str) -> None:
    """Make `sandbox.*` and `fastapi.testclient` importable as the test files expect."""
    src = checkout / "sandbox"
    _package("sandbox").__path__ = []
    runners = _package("sandbox.runners")
    rtypes = _load("sandbox.runners.types", src / "runners" / "types.py")
    for k in ("CellRunResult", "CodeRunArgs", "CodeRunResult", "CommandRunResult",
              "CommandRunStatus", "Language", "RunJupyterRequest", "RunJupyterResult"):
        if hasattr(rtypes, k):
            setattr(runners, k, getattr(rtypes, k))
    runners.CODE_RUNNERS = {}

    async def run_jupyter(*_a, **_k):  # never called: requests go to Sandlot
        raise RuntimeError("in-process runner called; the harness posts to Sandlot")

    runners.run_jupyter = run_jupyter
    try:
        import fastapi  # noqa: F401
    except ImportError:
        fa = _package("fastapi")
        fa.APIRouter = _Router
    try:
        import structlog  # noqa: F401
    except ImportError:
        sl = types.ModuleType("structlog")
        sl.stdlib = types.SimpleNamespace(get_logger=lambda *a, **k: None)
        sys.modules["structlog"] = sl
    tc = types.ModuleType("fastapi.testclient")
    tc.TestClient = TestClient
    sys.modules["fastapi.testclient"] = tc
    _package("sandbox.server")
    _load("sandbox.server.sandbox_api", src / "server" / "sandbox_api.py")
    srv = types.ModuleType("sandbox.server.server")
    srv.app = url.rstrip("/")
    sys.modules["sandbox.server.server"] = srv


class Report:
    """pytest plugin: skips, async tests, and per-file counts."""

    def __init__(self):
        self.counts = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0})
        self.failed = []
        self.skipped = []

    def pytest_collection_modifyitems(self, items):
        for item in items:
            fname = Path(str(item.fspath)).name
            why = LEFT_OUT.get(fname) or SKIP_TESTS.get(item.originalname or item.name)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        fn = pyfuncitem.obj
        if inspect.iscoroutinefunction(fn):
            names = pyfuncitem._fixtureinfo.argnames
            asyncio.run(fn(**{n: pyfuncitem.funcargs[n] for n in names}))
            return True
        return None

    def pytest_runtest_logreport(self, report):
        fname = Path(report.fspath).name
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome
            self.counts[fname][outcome] += 1
            if outcome == "failed":
                self.failed.append(report.nodeid)
            elif outcome == "skipped":
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
                self.skipped.append(f"{report.nodeid}: {reason}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", required=True, type=Path,
                    help="a checkout of bytedance/SandboxFusion")
    ap.add_argument("--url", required=True, help="Sandlot base URL, e.g. http://127.0.0.1:7070")
    ap.add_argument("--file", action="append", default=[],
                    help="only this test file (repeatable), e.g. test_go.py")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("-n", "--workers", type=int, default=1,
                    help="unused; tests run one at a time")
    ap.add_argument("rest", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()
    tests_dir = args.checkout / "sandbox" / "tests" / "runners"
    if not tests_dir.is_dir():
        print(f"no {tests_dir}: --checkout must be a SandboxFusion checkout", file=sys.stderr)
        return 2
    install_shims(args.checkout, args.url)
    files = [tests_dir / f for f in args.file] or sorted(tests_dir.glob("test_*.py"))
    # -o addopts=: the checkout's pyproject.toml asks for pytest-cov.
    pargs = ["-q", "-rfE", "--noconftest", "-o", "addopts=", "-p", "no:cacheprovider", "--rootdir",
             str(tests_dir), "-W", "ignore::pytest.PytestUnknownMarkWarning",
             *map(str, files), *args.rest]
    if args.k:
        pargs += ["-k", args.k]
    rep = Report()
    rc = pytest.main(pargs, plugins=[rep])
    print("\nSandboxFusion runner tests against", args.url)
    print(f"{'file':28} {'passed':>6} {'failed':>6} {'skipped':>7}")
    tot = {"passed": 0, "failed": 0, "skipped": 0}
    for fname in sorted(rep.counts):
        c = rep.counts[fname]
        print(f"{fname:28} {c['passed']:6} {c['failed']:6} {c['skipped']:7}")
        for k in tot:
            tot[k] += c[k]
    print(f"{'total':28} {tot['passed']:6} {tot['failed']:6} {tot['skipped']:7}")
    for s in rep.skipped:
        print("skipped", s)
    for f in rep.failed:
        print("FAILED", f)
    return 0 if tot["failed"] == 0 and rc in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
