"""The unmodified `e2b-code-interpreter` SDK (PyPI, installed by scripts/setup.sh) against
`sandlot up`: `run_code` on a stateful kernel served by Sandlot (docs/e2b.md, "Code
interpreter"). Needs the lang-python image (ipykernel, jupyter_client, matplotlib).

Backend cases as in test_e2b_sdk.py (`e2b_target`, tests/conftest.py): the full test on
`function` and `container` (runc); on `microvm` (TCG in CI: a boot and the kernel's start take
seconds) one shorter test of state, streams, an error and a command in the same sandbox."""
from __future__ import annotations

import base64
import os

import httpx
import pytest

ci = pytest.importorskip("e2b_code_interpreter",
                         reason="e2b-code-interpreter is not installed (scripts/setup.sh)")
from e2b_code_interpreter import Sandbox  # noqa: E402

from conftest import IMAGES_DIR  # noqa: E402

NO_MICROVM = ("microvm runs the shorter test_microvm_state_streams_error (TCG: CI time; "
              "matplotlib's import alone takes ~7 s in the guest)")


@pytest.fixture
def sbx(e2b_env):
    if not os.path.isdir(os.path.join(IMAGES_DIR, "lang-python")):
        pytest.skip("image lang-python is not installed (sandlot image build lang-python)")
    sb = Sandbox.create(timeout=120)
    yield sb
    sb.kill()


@pytest.mark.e2b_only("function", "container", why=NO_MICROVM)
def test_state_streams_error_png_files_contexts(sbx):
    out = []
    e = sbx.run_code("x = 41\nimport sys\nprint('hi'); print('oops', file=sys.stderr)",
                     on_stdout=lambda m: out.append(m.line), on_stderr=lambda m: out.append(m.line))
    assert e.logs.stdout == ["hi\n"] and e.logs.stderr == ["oops\n"] and out == ["hi\n", "oops\n"]
    assert sbx.run_code("x + 1").text == "42"
    e = sbx.run_code("1/0")
    assert e.error.name == "ZeroDivisionError" and "division" in e.error.value
    assert "ZeroDivisionError" in e.error.traceback
    e = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    png = base64.b64decode([r.png for r in e.results if r.png][0])
    assert png.startswith(b"\x89PNG")
    sbx.files.write("/home/user/a.txt", "data")
    assert sbx.run_code("open('a.txt').read()").text == "data"
    assert sbx.commands.run("echo cmd").stdout == "cmd\n"
    assert sbx.run_code("import os; os.environ.get('K')", envs={"K": "v"}).text == "v"
    c = sbx.create_code_context()
    assert sbx.run_code("'x' in dir()", context=c).text == "False"
    assert c.id in [k.id for k in sbx.list_code_contexts()]
    sbx.remove_code_context(c)


@pytest.mark.e2b_only("microvm", why="the fuller test above covers this backend")
def test_microvm_state_streams_error(sbx, e2b_target):
    """The interpreter on a microvm sandbox: the kernel runs in the guest (one bridge + one
    ipykernel process there), keeps state between cells, streams stdout/stderr and reports
    an error; files and commands reach the same VM."""
    out = []
    e = sbx.run_code("import os, sys\nx = 41\nprint('hi'); print('oops', file=sys.stderr)",
                     on_stdout=lambda m: out.append(m.line), on_stderr=lambda m: out.append(m.line),
                     timeout=90)
    assert e.error is None, e.error
    assert e.logs.stdout == ["hi\n"] and e.logs.stderr == ["oops\n"] and out == ["hi\n", "oops\n"]
    assert sbx.run_code("x + 1").text == "42"
    assert sbx.run_code("1/0").error.name == "ZeroDivisionError"
    sbx.files.write("/home/user/a.txt", "vm")
    assert sbx.run_code("open('a.txt').read() + str(os.getpid() > 1)").text == "vmTrue"
    # the kernel is a process of the guest: the VM's own process table lists it
    assert "ipykernel" in sbx.commands.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout


@pytest.mark.e2b_only("function", why="backend-independent (the server alone answers it)")
def test_bad_input_is_a_clear_error(sbx, e2b_env):
    h = {"E2b-Sandbox-Id": sbx.sandbox_id}
    r = httpx.post(f"{e2b_env}/execute", json={"code": "1", "language": "cobol"}, headers=h)
    assert r.status_code == 400 and "cobol" in r.text
    r = httpx.post(f"{e2b_env}/execute", json={"code": "1", "context_id": "ctx-nope"},
                   headers=h)
    assert r.status_code == 404
    r = httpx.post(f"{e2b_env}/execute", content=b"{not json", headers=h)
    assert r.status_code == 400
    r = httpx.post(f"{e2b_env}/execute", json={"code": "1"},
                   headers={"E2b-Sandbox-Id": "sb-00000000000000000000"})
    assert r.status_code == 404
