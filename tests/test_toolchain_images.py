"""Toolchain images (`sandlot image build lang-<x>`, built by scripts/setup.sh): each is one
layer per toolchain over the `python` image's layer, shared by reference. Sandboxes on them
run the toolchain on the `function` and `container` backends.

Skips with the reason when an image is not in the store (setup.sh builds all of them unless
SANDLOT_TOOLCHAINS says otherwise).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import IMAGES_DIR


def image_json(name: str) -> dict:
    p = Path(IMAGES_DIR) / name / "image.json"
    if not p.is_file():
        pytest.skip(f"no {name} image in {IMAGES_DIR} (sandlot image build {name})")
    return json.loads(p.read_text())


GO_MAIN = 'package main\nimport "fmt"\nfunc main() { fmt.Println(6 * 7) }\n'


@pytest.mark.parametrize("backend", ["function", "container"])
def test_go_builds_and_runs_on_lang_go(client, backend):
    image_json("lang-go")
    with client.create(backend=backend, image="lang-go", memory_mib=512, ttl_s=300) as box:
        box.write_file("/workspace/main.go", GO_MAIN.encode())
        r = box.exec(["sh", "-c", "cd /workspace && go run main.go && go version"], timeout_s=120)
        assert r.exit_code == 0, r
        assert r.stdout.startswith(b"42\ngo version go1."), r


def test_python_packages_on_lang_python(client):
    image_json("lang-python")
    with client.create(backend="function", image="lang-python", memory_mib=1024, ttl_s=300) as box:
        r = box.exec(["python3", "-c",
                      "import numpy, pandas, scipy, sympy, networkx, matplotlib, sklearn; "
                      "print(int(numpy.arange(10).sum()), sympy.factorint(12))"], timeout_s=120)
        assert (r.exit_code, r.stdout) == (0, b"45 {2: 2, 3: 1}\n"), r


def test_layers_are_shared_not_copied(binary):
    """lang-go and lang-java sit on the same base dir (the python image's rootfs); lang-scala
    names lang-java's layer itself; `image ls --layers` prints every layer with its size."""
    go, java = image_json("lang-go"), image_json("lang-java")
    assert go["layers"][-1] == java["layers"][-1] == "python/rootfs"
    assert len(go["layers"]) == len(java["layers"]) == 2
    assert go["layers"][0] != java["layers"][0]
    scala = image_json("lang-scala")
    assert scala["layers"][1:] == java["layers"], scala["layers"]
    out = subprocess.run([str(binary), "image", "ls", "--layers", "--images-dir", IMAGES_DIR],
                         check=True, capture_output=True, text=True).stdout
    assert go["layers"][0] in out and "toolchain go" in out, out


def test_unknown_toolchain_is_refused(binary):
    r = subprocess.run([str(binary), "image", "build", "lang-cobol", "--images-dir", IMAGES_DIR],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "unknown toolchain image" in r.stderr and "lang-go" in r.stderr, r.stderr
