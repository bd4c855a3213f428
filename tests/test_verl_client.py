"""verl's SandboxFusion reward client scores Sandlot's `/run_code` answers as verl expects.

verl (PyPI `verl`, installed by scripts/setup.sh with `--no-deps`) computes code rewards
with `verl/utils/reward_score/sandbox_fusion/{__init__,utils}.py`: `check_correctness`
posts each test case to `<url>/run_code` and maps the answer to True (right output), False
(wrong output), -1 (API or sandbox error), -2 (runtime error), -3 (timeout) or -4 (compile
error, and every later case marked `compile_error_skipped`); `compute_score` averages the
True cases. The two files are loaded here on their own (their imports are the standard
library and `requests`), without importing `verl` and its dependencies (torch, ray, ...).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import types
from pathlib import Path

import httpx
import pytest


def _load_verl_sandbox_fusion():
    spec = importlib.util.find_spec("verl")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (scripts/setup.sh: pip install --no-deps verl)")
    pkg_dir = Path(list(spec.submodule_search_locations)[0]) / "utils" / "reward_score" / "sandbox_fusion"
    if not (pkg_dir / "utils.py").is_file():
        pytest.skip(f"this verl has no {pkg_dir}")
    name = "verl_sandbox_fusion"  # a stand-alone package holding just these two files
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(pkg_dir)]
    sys.modules[name] = pkg
    uspec = importlib.util.spec_from_file_location(f"{name}.utils", pkg_dir / "utils.py")
    utils = importlib.util.module_from_spec(uspec)
    sys.modules[uspec.name] = utils
    uspec.loader.exec_module(utils)
    ispec = importlib.util.spec_from_file_location(name, pkg_dir / "__init__.py",
                                                   submodule_search_locations=[str(pkg_dir)])
    init = importlib.util.module_from_spec(ispec)
    sys.modules[name] = init
    ispec.loader.exec_module(init)
    assert "torch" not in sys.modules or "verl" not in sys.modules
    return init, utils


@pytest.fixture(scope="module")
def verl(server):
    init, utils = _load_verl_sandbox_fusion()
    rows = httpx.get(f"{server.url}/v1/run_code/languages", timeout=10).json()["languages"]
    installed = {r["language"] for r in rows if r["installed"]}
    return types.SimpleNamespace(init=init, utils=utils, url=f"{server.url}/run_code",
                                 installed=installed)


def need(verl, language: str) -> None:
    if language not in verl.installed:
        pytest.skip(f"run_code language {language} has no installed image")


SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
IO = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]}


def test_correct_program_scores_one(verl):
    need(verl, "python")
    score, meta = verl.init.compute_score(verl.url, threading.Semaphore(4), 512,
                                          f"```python\n{SUM}```", json.dumps(IO))
    assert score == 1.0, meta
    assert [m["status"] for m in meta] == ["success", "success"]


def test_wrong_and_partial_answers(verl):
    need(verl, "python")
    res, meta = verl.utils.check_correctness(verl.url, {"inputs": IO["inputs"], "outputs": ["3", "31"]},
                                             SUM, timeout=10)
    assert res == [True, False], meta
    assert meta[1]["status"] == "wrong_answer"
    score, _ = verl.init.compute_score(verl.url, None, 512, "```python\nprint(3)\n```", IO)
    assert score == 0.5


def test_timeout_is_minus_three(verl):
    need(verl, "python")
    res, meta = verl.utils.check_correctness(verl.url, {"inputs": [""], "outputs": ["x"]},
                                             "while True:\n    pass\n", timeout=2)
    assert res == [-3], meta
    assert meta[0]["status"] == "timeout" and meta[0]["run_status"] == "TimeLimitExceeded"


def test_runtime_error_is_minus_two(verl):
    need(verl, "python")
    res, meta = verl.utils.check_correctness(verl.url, {"inputs": [""], "outputs": ["x"]},
                                             "raise SystemExit(3)\n", timeout=10)
    assert res == [-2], meta
    assert meta[0]["status"] == "runtime_error" and meta[0]["exit_code"] == 3


def test_cpp_compile_error_is_minus_four_for_every_case(verl):
    need(verl, "cpp")
    res, meta = verl.utils.check_correctness(verl.url, IO, "int main() { return undefined; }",
                                             timeout=60, language="cpp")
    assert res == [-4, -4], meta
    assert {m["status"] for m in meta} <= {"compile_error", "compile_error_skipped"}
    assert meta[0]["api_response"] is None or meta[0]["api_response"]["run_result"] is None


def test_cpp_correct(verl):
    need(verl, "cpp")
    code = "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }\n"
    res, meta = verl.utils.check_correctness(verl.url, IO, code, timeout=60, language="cpp")
    assert res == [True, True], meta


def test_fn_name_and_assert_case(verl):
    need(verl, "python")
    # LeetCode-style: a function called with JSON arguments, one per stdin line.
    code = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
    res, meta = verl.utils.check_correctness(
        verl.url, {"inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"], "fn_name": "add"},
        code, timeout=10)
    assert res == [True, True], meta
    # assert_case: the assert appended to the program decides.
    tc = {"assert_case": ["assert f(2) == 4", "assert f(3) == 10"]}
    score, meta = verl.init.compute_score(verl.url, None, 512, "```python\ndef f(x):\n    return x * x\n```", tc)
    assert score == 0.5, meta
    assert [m["status"] for m in meta] == ["success", "runtime_error"]


def test_unknown_language_and_unreachable_sandbox_are_errors_not_scores(verl):
    res, meta = verl.utils.check_correctness(verl.url, IO, SUM, timeout=10, language="cobol")
    assert res == [-1, -1]
    res, meta = verl.utils.check_correctness("http://127.0.0.1:9/run_code", {"inputs": [""], "outputs": ["x"]},
                                             SUM, timeout=1)
    assert res == [-1] and meta[0]["status"] == "api_error"
