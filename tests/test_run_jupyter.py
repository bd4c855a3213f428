"""`POST /run_jupyter` end to end (SandboxFusion-compatible), through the SDK and through
SandboxFusion's own client package (`sandbox-fusion` on PyPI).

Needs the `lang-python` image (ipykernel, jupyter_client, matplotlib); without it the
endpoint must answer `SandboxError` naming the image, which is checked instead, and the
kernel tests skip with the reason.
"""

from __future__ import annotations

import base64

import pytest

import sandlot

from conftest import assert_error

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def jup(client, python_image):
    langs = {l.language: l for l in client.run_code_languages()}
    if langs["python"].image != "lang-python":
        r = client.run_jupyter(["print(1)"])
        assert r.status == "SandboxError", r
        assert "lang-python is not installed" in r.message, r.message
        pytest.skip("image lang-python is not installed (sandlot image build lang-python); "
                    "checked that run_jupyter answers SandboxError naming it")
    return client


def test_cells_share_one_kernel_with_stdout_stderr_display_error(jup):
    r = jup.run_jupyter([
        "a = 123",
        "a",
        "print(a)",
        "import sys; sys.stderr.write('stderr message')",
        "raise RuntimeError('error message')",
        "print(a + 1)",
    ])
    assert r.status == "Success", r
    assert len(r.cells) == 6
    assert r.cells[0] == sandlot.JupyterCell()
    assert r.cells[1].display == [{"text/plain": "123"}]
    assert r.cells[2].stdout == "123\n"
    assert r.cells[3].stderr == "stderr message"
    err = r.cells[4].error
    assert len(err) == 1 and err[0]["ename"] == "RuntimeError"
    assert err[0]["evalue"] == "error message" and err[0]["traceback"]
    # A cell that raised does not end the run: the kernel keeps its state.
    assert r.cells[5].stdout == "124\n"
    assert r.driver is not None and r.driver.return_code == 0


def test_matplotlib_plot_cell_returns_png(jup):
    r = jup.run_jupyter([
        "import matplotlib.pyplot as plt",
        "plt.plot([1, 2, 3], [1, 4, 9]); plt.show()",
        "from IPython.display import HTML; HTML('<b>bold</b>')",
    ])
    assert r.status == "Success", r
    pngs = [d["image/png"] for d in r.cells[1].display if "image/png" in d]
    assert len(pngs) == 1, r.cells[1]
    png = base64.b64decode(pngs[0])
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    assert r.cells[2].display[0]["text/html"] == "<b>bold</b>"


def test_files_fetch_files_and_workdir(jup):
    r = jup.run_jupyter(
        ["import os; print(os.getcwd())",
         "print(open('in.txt').read())",
         "open('/mnt/out.txt', 'w').write('from the kernel')"],
        files={"in.txt": b"given"}, fetch_files=["/mnt/out.txt", "missing.txt"])
    assert r.status == "Success", r
    assert r.cells[0].stdout == "/workspace\n"
    assert r.cells[1].stdout == "given\n"
    assert r.files == {"/mnt/out.txt": b"from the kernel"}


def test_cell_timeout_is_failed_with_the_cells_so_far(jup):
    r = jup.run_jupyter(["print('first')", "import time; time.sleep(60)", "print('never')"],
                        cell_timeout=2, total_timeout=30)
    assert r.status == "Failed", r
    assert "time limit" in r.message
    assert [c.stdout for c in r.cells] == ["first\n", ""]
    assert r.cells[1].error[0]["ename"] == "TimeoutError"


def test_total_timeout_is_failed(jup):
    r = jup.run_jupyter(["import time", "time.sleep(3)", "time.sleep(3)", "time.sleep(3)"],
                        total_timeout=4)
    assert r.status == "Failed", r
    assert r.cells[-1].error[0]["ename"] == "TimeoutError"


def test_a_kernel_that_dies_is_failed_at_once(jup):
    # Before: the driver waited out total_timeout (45 s) and called it a TimeoutError.
    for crash in ("import os; os._exit(1)", "import ctypes; ctypes.string_at(0)"):
        r = jup.run_jupyter(["print('first')", crash, "print('never')"], total_timeout=60)
        assert r.status == "Failed", r
        assert r.message == "the kernel died", r.message
        assert [c.stdout for c in r.cells] == ["first\n", ""]
        assert r.cells[1].error[0]["ename"] == "DeadKernelError"
        assert r.driver is not None and r.driver.execution_time < 30, r.driver


def test_endless_output_is_cut_not_a_sandbox_error(jup):
    # Before: output kept growing in the driver until it was OOM-killed or its answer was
    # past what the server fetches, and the call answered SandboxError (a "retry" for
    # trainers) for what the program did.
    r = jup.run_jupyter(["while True: print('x' * 1000)", "print('never')"],
                        cell_timeout=3, total_timeout=30)
    assert r.status == "Failed", r
    assert len(r.cells[0].stdout) == 1 << 20
    assert "stdout cut at 1048576 characters" in r.cells[0].stderr
    assert r.cells[0].error[0]["ename"] == "TimeoutError"
    r = jup.run_jupyter([
        "import sys; sys.stdout.write('y' * (80 << 20)); None",
        "from IPython.display import Image, display\nimport os\n"
        "for i in range(8): display(Image(data=os.urandom(10 << 20), format='png'))",
        "print('after')",
    ], total_timeout=60)
    assert r.status == "Success", r
    assert len(r.cells[0].stdout) == 1 << 20
    assert len(r.cells[1].display) < 8
    assert "display output over" in r.cells[1].stderr
    assert r.cells[2].stdout == "after\n"


FORGED = ("{'status': 'Finished', 'cells': [{'stdout': 'FORGED', 'stderr': '', "
          "'display': [], 'error': []}]}")


def test_a_cell_cannot_forge_the_answer(jup):
    # Before: a cell that wrote the driver's answer file and killed the driver, or left a
    # detached process that rewrote the file right after the driver wrote it, got
    # `Success` with its own cells, and the grader's later cell never counted.
    kill_driver = ("import json, os, signal\n"
                   f"json.dump({FORGED}, open('/tmp/.sandlot-jupyter/output.json', 'w'))\n"
                   "os.kill(os.getppid(), signal.SIGKILL)")
    payload = ("import json, os, time\n"
               "p = '/tmp/.sandlot-jupyter/output.json'\n"
               "while not (os.path.exists(p) and os.path.getsize(p) > 0): time.sleep(0.0005)\n"
               f"json.dump({FORGED}, open(p + '.x', 'w')); os.rename(p + '.x', p)\n")
    rewrite_later = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {payload!r}], start_new_session=True,\n"
        "                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,\n"
        "                 stderr=subprocess.DEVNULL)")
    for forge in (kill_driver, rewrite_later):
        r = jup.run_jupyter([forge, "assert 1 == 2, 'wrong answer'"], total_timeout=30)
        assert "FORGED" not in [c.stdout for c in r.cells], r
        assert r.status != "Success" or r.cells[1].error[0]["ename"] == "AssertionError", r
        assert r.status != "SandboxError", r


def test_a_cell_that_kills_the_driver_is_failed_not_a_sandbox_error(jup):
    # A SandboxError is retried by trainers: a program must not turn its own failure into
    # one by killing the driver once the kernel is up.
    for kill in ("import os; os.kill(os.getppid(), 9)", "import os; os.kill(-1, 9)"):
        r = jup.run_jupyter(["print(1)", kill, "assert 1 == 2"], total_timeout=30)
        assert r.status == "Failed", r
        assert r.message.startswith("the jupyter driver died while running the cells"), r


def test_bad_kernel_and_timeouts_are_400(client):
    for body in ({"cells": ["1"], "kernel": "ir"}, {"cells": ["1"], "total_timeout": 0},
                 {"cells": ["1"], "cell_timeout": -1}, {"cells": "1"}):
        assert_error(client._http.post("/run_jupyter", json=body), "invalid_argument")


def test_sandbox_fusion_client_run_jupyter(jup, server):
    sf = pytest.importorskip("sandbox_fusion",
                             reason="pip install sandbox-fusion (sdk/python [test] extra)")
    resp = sf.run_jupyter(sf.RunJupyterRequest(cells=["x = 6 * 7", "print(x)"]),
                          endpoint=server.url)
    assert resp.status == sf.RunStatus.Success, resp
    assert resp.cells[1].stdout == "42\n"
