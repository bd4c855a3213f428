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
