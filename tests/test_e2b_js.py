"""E2B's JavaScript SDK (npm `e2b`, pinned in tests/e2b_js/package.json and installed there
by scripts/setup.sh with `npm ci`) against the test session's `sandlot up`, through node:
tests/e2b_js/e2b_sdk.mjs creates a `base` sandbox with metadata and envs, runs commands
(foreground, a non-zero exit, background + kill), reads and writes files, lists by metadata
and kills, then prints one JSON object this test checks (docs/e2b.md).

Skips when `node` is not installed; with node present, missing node_modules is a failure
(setup.sh installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

JS_DIR = Path(__file__).resolve().parent / "e2b_js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None, reason="node is not installed (scripts/setup.sh installs nodejs and npm)")


def test_e2b_js_sdk_create_commands_files(server, python_image, request):
    if not (JS_DIR / "node_modules" / "e2b" / "package.json").is_file():
        pytest.fail(f"{JS_DIR}/node_modules has no `e2b`: run `npm ci` there "
                    "(scripts/setup.sh does)", pytrace=False)
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_DOMAIN", "E2B_DEBUG")}
    env.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url,
               E2B_API_KEY="e2b_sandlot_no_auth")
    tag = f"{request.node.name}-{os.getpid()}"
    try:
        p = subprocess.run([NODE, "e2b_sdk.mjs", tag], cwd=JS_DIR, env=env,
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"node ran over 60 s; its steps:\n{err}")
    assert p.returncode == 0, f"node exited with {p.returncode}\n{p.stderr}\n{p.stdout}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"JS SDK create -> first command: {out['firstCommandMs']} ms")

    assert out["run"] == {"exitCode": 0, "stdout": "hello from js\n/home/user\n",
                          "stderr": "to-stderr\n"}
    assert out["streamed"] == "line1\nline2\nline3\n"
    assert out["nonZero"] == {"raised": True, "exitCode": 3, "stdout": "partial\n"}

    bg = out["background"]
    assert bg["pid"] >= 1000 and bg["listed"] and bg["killed"] is True, bg
    assert bg["waitRaised"] is True, "wait() after kill raises CommandExitError"
    assert bg["stdout"] == "started\n"
    assert bg["listedAfterKill"] is False and bg["killedAgain"] is False, bg

    files = out["files"]
    assert files["written"] == "/tmp/js/hello.txt"
    assert files["read"] == "hi from node\n"
    assert files["bytes"] == [0, 1, 2, 255]
    assert files["list"] == [["bytes.bin", "file", 4], ["hello.txt", "file", 13]]
    assert files["existsBefore"] is True and files["existsAfter"] is False
    assert files["cat"] == "0   1   2 255"

    meta = {"job": tag}
    assert out["list"] == [{"id": out["sandboxId"], "metadata": meta, "state": "running"}]
    assert out["info"] == {"templateId": "base", "metadata": meta}
    assert out["killed"] is True and out["killedAgain"] is False
    assert out["runningAfterKill"] is False
