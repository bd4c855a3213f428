"""`run_code` on warm toolchain pools, answering before teardown (issue 27 item 5, issue 24).

`sandlot up --run-code-pool-images` (default `lang-python,lang-cpp,lang-java`) keeps
`--warm-pool` ready function jails of each listed toolchain image that is built; an image
that is not built is logged (`run_code pool image is not built; skipped`) and left out. A
`run_code` call on a pooled image hands a jail over, counted per image by
`sandlot_warm_pool_image_handovers_total{backend,image}`. The call answers once its
sandbox is marked `deleting` (the quota is free from that mark) and the node delete
finishes after the answer, so a caller at its quota never gets a false 429 and nothing is
left behind (docs/api.md `POST /run_code`).

One private `sandlot up` with keys: `t` (quota: 1 sandbox) and `ops` (admin).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from pathlib import Path
from typing import Dict, Iterator

import httpx
import pytest

from conftest import (IMAGES_DIR, Server, count_leaks, private_base, remove_private_base,
                      wait_no_leaks, wait_until)
from test_tenants import key_create

POOL = "lang-python,lang-cpp,lang-nope"
NOT_BUILT = "lang-nope"


def built(image: str) -> bool:
    return (Path(IMAGES_DIR) / image / "image.json").is_file()


@pytest.fixture(scope="module")
def node(binary, log_dir) -> Iterator[Dict[str, object]]:
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root")
    if not built("lang-python"):
        pytest.skip(f"no lang-python image in {IMAGES_DIR} (sandlot image build lang-python)")
    assert not built(NOT_BUILT)
    root = private_base("sandlot-rcpool-")
    data = root / "data"
    keys = {"t": key_create(binary, data, "t", "--max-sandboxes", "1"),
            "ops": key_create(binary, data, "ops", "--admin")}
    srv = Server(binary, data, log_dir / "sandlot-up-run-code-pool.log",
                 args=["--warm-pool", "2", "--container-warm-pool", "0",
                       "--run-code-pool-images", POOL])
    srv.start()
    http = {n: httpx.Client(base_url=srv.url, timeout=120,
                            headers={"Authorization": f"Bearer {k}"}) for n, k in keys.items()}
    before = count_leaks(data)
    yield {"server": srv, "http": http, "data": data, "before": before}
    for c in http.values():
        c.close()
    srv.stop()
    remove_private_base(root)


def metric(node, name: str, **labels: str) -> float:
    """One sample of `/metrics` (0 when absent)."""
    text = node["http"]["ops"].get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name:
            got = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
            if got == want:
                return float(m.group(3))
    return 0.0


def run_code(node, key: str, code: str, language: str = "python", **kw) -> httpx.Response:
    return node["http"][key].post("/run_code", json={"code": code, "language": language, **kw})


def test_handover_is_counted_per_image(node):
    images = ["lang-python"] + (["lang-cpp"] if built("lang-cpp") else [])
    for image in images:
        wait_until(lambda: metric(node, "sandlot_warm_pool_ready", backend="function",
                                  image=image) >= 1, 60, what=f"a ready {image} jail")
    counted = {i: metric(node, "sandlot_warm_pool_image_handovers_total", backend="function",
                         image=i) for i in images}
    r = run_code(node, "ops", "print(6*7)")
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    assert r.json()["run_result"]["stdout"] == "42\n"
    if "lang-cpp" in images:
        r = run_code(node, "ops", "#include <cstdio>\nint main() { std::puts(\"42\"); }\n", "cpp")
        assert r.json()["status"] == "Success", r.text
        assert r.json()["run_result"]["stdout"] == "42\n"
    for image in images:
        assert metric(node, "sandlot_warm_pool_image_handovers_total", backend="function",
                      image=image) == counted[image] + 1, image


def test_an_image_not_built_is_skipped_with_a_log_line(node):
    log = Path(node["server"].log_path).read_text(errors="replace")
    line = [ln for ln in log.splitlines() if NOT_BUILT in ln]
    assert line and "run_code pool image is not built; skipped" in line[0], log[-3000:]
    assert metric(node, "sandlot_warm_pool_ready", backend="function", image=NOT_BUILT) == 0
    assert f'image="{NOT_BUILT}"' not in node["http"]["ops"].get("/metrics").text
    # The built ones of the same list are pooled.
    wait_until(lambda: metric(node, "sandlot_warm_pool_ready", backend="function",
                              image="lang-python") >= 1, 60, what="a ready lang-python jail")


def test_a_caller_at_its_quota_never_gets_a_false_429(node):
    """Key `t` may hold one sandbox: each answer arrives with the sandbox already released,
    so the next call (and a create right after the answer) is admitted every time."""
    t = node["http"]["t"]
    for i in range(8):
        r = run_code(node, "t", f"print({i} * 2)")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "Success" and r.json()["run_result"]["stdout"] == f"{i * 2}\n"
        c = t.post("/v1/sandboxes", json={"image": "python", "memory_mib": 128, "ttl_s": 120})
        assert c.status_code == 201, c.text
        d = t.delete(f"/v1/sandboxes/{c.json()['id']}")
        assert d.status_code in (200, 204), d.text


def test_concurrent_answers_are_each_their_own(node):
    """24 calls at once, python/bash/cpp mixed, each with its own stdin and token: every
    answer is a Success carrying exactly its own output (or a fast 429/504, none expected
    at this size)."""
    langs = ["python", "bash"] + (["cpp"] if built("lang-cpp") else [])
    progs = {
        "python": "import sys\nprint('tok', sys.stdin.read().strip())\n",
        "bash": "read x; echo tok $x\n",
        "cpp": "#include <iostream>\n#include <string>\nint main() { std::string s; std::cin >> s;"
               " std::cout << \"tok \" << s << std::endl; }\n",
    }

    def one(i: int):
        lang = langs[i % len(langs)]
        r = run_code(node, "ops", progs[lang], lang, stdin=f"n{i}\n")
        return i, lang, r

    with concurrent.futures.ThreadPoolExecutor(24) as ex:
        results = list(ex.map(one, range(24)))
    for i, lang, r in results:
        assert r.status_code == 200, (lang, r.status_code, r.text)
        body = r.json()
        assert body["status"] == "Success", (lang, body)
        assert body["run_result"]["stdout"] == f"tok n{i}\n", (i, lang, body)


def test_nothing_is_left_behind(node):
    ops = node["http"]["ops"]

    def no_sandboxes() -> bool:
        r = ops.get("/v1/sandboxes")
        return r.status_code == 200 and not r.json()["sandboxes"]

    wait_until(no_sandboxes, 60, what="every run_code sandbox deleted")
    wait_no_leaks(node["data"], node["before"], timeout=60, what="after pooled run_code calls")


def test_stop_removes_the_ready_jails(node):
    """SIGTERM stops the server for good: the warm pools' ready jails are not sandboxes, so
    nothing of them (directory, mount, cgroup, process) stays behind (docs/operations.md
    "Shutdown, restart, crash"). Last in the module: it stops the module's server."""
    data: Path = node["data"]
    pool_dir = data / "warm-pool"

    def ready() -> list:
        return sorted(p.name for p in pool_dir.glob("wp-*") if (p / "state.json").is_file())

    wait_until(lambda: len(ready()) >= 2, 120, what="ready pooled jails")
    names = ready()
    assert node["server"].stop() == 0
    left = [p.name for p in pool_dir.glob("wp-*")]
    assert not left, f"pooled jails left after SIGTERM: {left}"
    # With the pool directory empty, count_leaks counts every group, mount and process of
    # the node (the sandboxes of this module's earlier tests are all deleted).
    left = count_leaks(data)
    assert (left["mounts"], left["cgroups"], left["processes"]) == (0, 0, 0), \
        f"left after SIGTERM by the pooled jails {names}: {left}"
