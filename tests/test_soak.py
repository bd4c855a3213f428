"""Short soak under hostile load (issue 25; `bench/soak.py`, whose module doc lists the
load and the faults): ~2.5 minutes of creates/deletes on `function` and runc, 16 MiB exec
floods, background processes, run_code, trajectories, 1000 idle connections and clients
that never read their answers, creates that pull from a private registry, and three faults:
that registry stopped, a full data dir and a kill -9 of the server.

Asserted: no sandbox is ever `lost` (they are all alive); with the registry stopped a create
that must pull answers 503 `unavailable` and leaves no sandbox, and once it is back the same
reference pulls and runs; the full data dir answers a
create with 429 `resource_exhausted` while an exec still works; after the kill -9 the
server answers within 30 s and every long-lived sandbox execs again; no call fails except
with `resource_exhausted` (a budget or the disk reserve), around the kill with a transport
error, or (the `pull` load only) while the registry is down; server RSS stays under its documented bound; after deleting everything no sandbox
dir, mount, cgroup or process of the node is left. The well-behaved client's loaded p99
against its quiet p99 is printed, not asserted (CI shares two cores between the server, the
sandboxes and the load; BENCHMARKS.md "Soak" has the figures).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import soak  # noqa: E402  (bench/soak.py)

DURATION_S = float(os.environ.get("SANDLOT_SOAK_S", "150"))


def test_soak_under_hostile_load(binary, log_dir):
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root")
    try:
        res = soak.run_soak(binary, DURATION_S, log_dir / "soak.log", quiet_s=15,
                            idle_conns=1000)
    except RuntimeError as e:
        if "cannot mount a tmpfs" in str(e):
            pytest.skip(str(e))
        raise
    print(json.dumps(res, indent=1))
    assert not res["threads_stuck"], res["threads_stuck"]
    assert res["false_lost"] == {}, res["false_lost"]
    full = res["faults"]["disk_full"]
    assert (full.get("create_status"), full.get("create_code")) == (429, "resource_exhausted"), full
    assert full["exec_on_full_disk"] == 0, full
    k = res["faults"]["kill9"]
    assert k["ping_s"] < 30 and k["sandboxes_back"] == "3/3", k
    reg = res["faults"].get("registry", {})
    if "skipped" not in reg:
        assert (reg.get("create_status"), reg.get("create_code")) == (503, "unavailable"), reg
        assert reg["left_behind"] == [] and reg.get("exec_after") == 0, reg
    assert res["images_left"] == [], res["images_left"]
    bad = {e: n for e, n in res["errors"].items()
           if not (":resource_exhausted" in e or e.endswith(":during_restart")
                   or (e.startswith("pull:") and e.endswith(":registry_down")))}
    assert not bad, res["errors"]
    for what in ("good", "churn0", "churn1", "flood", "bg", "run_code", "never_reads",
                 *(() if "skipped" in reg else ("pull",))):
        assert res["ops"].get(what, 0) > 0, (what, res["ops"])
    assert res["rss_mib"]["peak"] < res["rss_mib"]["bound"], res["rss_mib"]
    # veths are host-wide (other test runs on the host add and remove theirs).
    leaked = {k: n for k, n in res["leaked"].items() if k != "veths"}
    assert not leaked, (res["leaks_before"], res["leaks_after"])
    g = res["good_exec_ms"]
    print(f"good client exec p99: quiet {g['quiet_p99']} ms, loaded {g['loaded_p99']} ms "
          f"(x{g['p99_ratio']}; target x3, not asserted)")
    if "skipped" in reg:
        pytest.skip(f"everything else passed; the registry fault did not run: {reg['skipped']}")
