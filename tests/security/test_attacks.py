"""The attack suite: attempts a model rewarded for success might make to leave its sandbox or
hurt the node, run on every backend case; each test asserts that the attempt FAILS and that
it left an audit event in ``GET /v1/events`` (docs/SECURITY.md has the threat model).

Events expected, by the layer that stops the attempt:

* denied syscalls (seccomp deny list of ``sandlot-guest exec``): a ``violation`` event
  (``layer: seccomp``, ``syscall``, ``nr``, ``pid``, ``at``, the exec's ``command_digest``),
  reported through seccomp user notification. gVisor (runsc 20240729) refuses
  ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` (EINVAL, measured): there the filter answers EPERM
  itself and the node reads the refusal from gVisor's sentry debug log
  (``sandlot-node`` ``backends/gvisor_audit.rs``) — same event, ``pid`` in gVisor's root
  pid namespace;
* files API paths that leave the sandbox: a ``violation`` event (``layer: files_api``);
* attempts stopped by namespaces, read-only mounts, the device cgroup, no_new_privs, the
  network namespace or cgroup limits: the kernel reports nothing per call, so the record is
  the ``exec`` event of the command (digest, exit status, ``oom_killed``, ``timed_out``,
  ``truncated``, output sizes); the table says so.

The table (attempt × backend → blocked; event) is written to tests/artifacts/attack-table.md
and printed in the pytest summary (tests/security/conftest.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid
from typing import Dict, Iterable, List, Optional, Tuple

import pytest

import sandlot
from conformance.test_limits import FORK_BOMB
from security.conftest import VM_CASES, record

#: attempt → syscalls whose violation event it must produce (payload name = attempt name).
SECCOMP: Dict[str, Iterable[str]] = {
    "mount": ["mount"], "umount2": ["umount2"], "pivot_root": ["pivot_root"],
    "unshare": ["unshare"], "clone_newuser": ["clone"], "setns": ["setns"],
    "ptrace": ["ptrace"], "process_vm_readv": ["process_vm_readv"], "bpf": ["bpf"],
    "perf_event_open": ["perf_event_open"], "keyctl": ["keyctl"], "add_key": ["add_key"],
    "init_module": ["init_module"], "finit_module": ["finit_module"],
    "delete_module": ["delete_module"], "kexec_load": ["kexec_load"],
    "kexec_file_load": ["kexec_file_load"], "reboot": ["reboot"], "swapon": ["swapon"],
    "open_by_handle_at": ["open_by_handle_at"], "userfaultfd": ["userfaultfd"],
    "raw_socket": ["socket"], "packet_socket": ["socket"], "settimeofday": ["settimeofday"],
    "clock_settime": ["clock_settime"], "sethostname": ["sethostname"],
    "setdomainname": ["setdomainname"], "io_uring_setup": ["io_uring_setup"],
    "personality": ["personality"], "acct": ["acct"], "iopl": ["iopl"], "syslog": ["syslog"],
    "fsopen": ["fsopen"], "open_tree": ["open_tree"], "mknod_device": ["mknod", "mknodat"],
}

#: In-sandbox attempts stopped by a layer that does not report per call: attempt → layer.
KERNEL_LAYERS: Dict[str, str] = {
    "proc_sys_write": "read-only /proc/sys (mount ns; gVisor: its own procfs)",
    "sysrq_trigger": "masked /proc/sysrq-trigger",
    "sys_write": "read-only or absent /sys",
    "hardlink_escape": "mount boundaries (EXDEV)",
    "setuid_upper": "no_new_privs, empty bounding set, nosuid overlay",
    "dns_exfil": "net namespace without a route (runc policies: the DNS proxy)",
}


def payload(box: sandlot.Sandbox, name: str, *args: str,
            timeout_s: float = 60) -> Tuple[str, sandlot.ExecResult]:
    r = box.exec(["python3", "/workspace/attack_payload.py", name, *args], timeout_s=timeout_s)
    line = r.stdout.decode(errors="replace").strip().splitlines()
    verdict = line[-1] if line else ""
    return verdict, r


def assert_blocked(verdict: str, r: sandlot.ExecResult) -> str:
    assert r.exit_code == 0 and verdict.startswith("BLOCKED"), \
        f"attempt not blocked: {verdict!r} {r}"
    return verdict.removeprefix("BLOCKED ").strip()


def exec_events(audit, cursor: str, box: sandlot.Sandbox) -> List[dict]:
    return audit.since(cursor, sandbox=box.id, kind="exec")


def exec_event_text(ev: dict) -> str:
    bits = [f"exit {ev['exit_code']}"]
    for k in ("oom_killed", "timed_out", "truncated"):
        if ev.get(k):
            bits.append(k)
    return f"`exec` ({', '.join(bits)})"


@pytest.fixture(scope="session")
def host_marker() -> Iterable[str]:
    """A file on the host's root file system that no sandbox may see."""
    path = f"/var/tmp/sandlot-attack-marker-{uuid.uuid4().hex[:12]}"
    with open(path, "w") as f:
        f.write("host")
    yield path
    os.unlink(path)


@pytest.fixture(scope="module")
def seccomp_batch(backend, target, audit) -> Dict[str, object]:
    """microvm: every SECCOMP attempt in one exec (``attack_payload.py batch``; one python
    start instead of 35 under TCG). Returns the verdict line per attempt, the exec result
    and the events of that exec."""
    cur = audit.cursor()
    r = target.exec(["python3", "/workspace/attack_payload.py", "batch", *SECCOMP],
                    timeout_s=300)
    lines = dict(ln.split("\t", 1) for ln in r.stdout.decode(errors="replace").splitlines()
                 if "\t" in ln)
    return {"verdicts": lines, "result": r, "events": audit.since(cur, sandbox=target.id)}


@pytest.mark.parametrize("attempt", list(SECCOMP))
def test_denied_syscall_is_refused_and_reported(attempt, backend, target, audit, request):
    host_name = socket.gethostname()
    if backend.name in VM_CASES:
        b = request.getfixturevalue("seccomp_batch")
        verdict, r, evs = b["verdicts"].get(attempt, ""), b["result"], b["events"]
    else:
        cur = audit.cursor()
        verdict, r = payload(target, attempt)
        evs = audit.since(cur, sandbox=target.id)
    how = assert_blocked(verdict, r)
    assert socket.gethostname() == host_name
    execs = [e for e in evs if e["kind"] == "exec"]
    assert len(execs) == 1, evs
    viol = [e for e in evs if e["kind"] == "violation" and e.get("layer") == "seccomp"]
    errno_name = how.split()[-1]
    hits = [v for v in viol if v["syscall"] in SECCOMP[attempt]]
    assert hits, f"no violation event for {attempt}: {evs}"
    v = hits[0]
    assert v["sandbox"] == target.id and v["action"] == "EPERM"
    assert v["command_digest"] == execs[0]["command_digest"]
    assert v["at"] and v["nr"] > 0 and v["id"] < execs[0]["id"]
    assert execs[0]["violations"] == len(viol)
    assert r.violations and v["syscall"] in [x["syscall"] for x in r.violations]
    via = {"container-runsc": " (gVisor sentry log)",
           "microvm": " (guest kernel's seccomp notification; one exec for all 35)",
           "vm": " (guest kernel's seccomp notification; one exec for all 35)"
           }.get(backend.name, "")
    record(attempt, backend.name, "seccomp", f"blocked ({errno_name})",
           f"`violation` seccomp `{v['syscall']}`{via}")


def host_sysrq_lines() -> int:
    """Lines of the host kernel's log that SysRq wrote (``sysrq:``)."""
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout
    return sum("sysrq" in ln.lower() for ln in out.splitlines())


def read_host(path: str) -> str:
    with open(path) as f:
        return f.read()


#: microvm: attempts on kernel interfaces that the guest kernel owns. Root inside the VM may
#: write its own /proc/sys, SysRq and /sys (the guest's, not masked there); "blocked" means
#: the host is unaffected, checked from the host side: attempt → (what is checked, probe
#: taken before and after, layer).
VM_GUEST_OWNED = {
    "proc_sys_write": ("host /proc/sys/kernel/hostname unchanged",
                       lambda: read_host("/proc/sys/kernel/hostname"),
                       "separate guest kernel (its own /proc/sys)"),
    "sysrq_trigger": ("no SysRq line in the host's kernel log", host_sysrq_lines,
                      "separate guest kernel (SysRq acts on the guest)"),
    "sys_write": ("host /sys/kernel/mm/transparent_hugepage/enabled unchanged",
                  lambda: read_host("/sys/kernel/mm/transparent_hugepage/enabled"),
                  "separate guest kernel (its own sysfs)"),
}


@pytest.mark.parametrize("attempt", list(KERNEL_LAYERS))
def test_kernel_layer_attempt_is_refused(attempt, backend, target, audit):
    guest_owned = VM_GUEST_OWNED.get(attempt) if backend.name in VM_CASES else None
    before = guest_owned[1]() if guest_owned else None
    cur = audit.cursor()
    verdict, r = payload(target, attempt)
    layer = KERNEL_LAYERS[attempt]
    if guest_owned:
        what, probe_host, vm_layer = guest_owned
        assert r.exit_code == 0 and verdict.split(" ", 1)[0] in ("BLOCKED", "ESCAPED"), \
            (verdict, r)
        assert probe_host() == before, f"{what}: host changed after {attempt} in a {backend.name}"
        in_guest = "write reached the guest kernel" if verdict.startswith("ESCAPED") else \
            f"refused in the guest ({verdict[8:50]})"
        blocked = f"host unaffected ({in_guest}; {what})"
        layer += f"; {backend.name}: " + vm_layer
    else:
        blocked = f"blocked ({assert_blocked(verdict, r)[-60:]})"
    ev = exec_events(audit, cur, target)
    assert len(ev) == 1, ev
    record(attempt, backend.name, layer, blocked,
           exec_event_text(ev[0]) + "; no per-call report from this layer")


def test_proc1_root_and_dotdot_do_not_reach_the_host(backend, target, audit, host_marker):
    for attempt, layer in [("proc1_root", "pid + mount ns (/proc/1 is the sandbox's init)"),
                           ("dotdot_inside", "mount ns + pivot_root/chroot"),
                           ("leaked_fds", "fds swept before execve (close_range CLOEXEC)")]:
        cur = audit.cursor()
        verdict, r = payload(target, attempt, host_marker)
        how = assert_blocked(verdict, r)
        ev = exec_events(audit, cur, target)
        assert len(ev) == 1, ev
        record(attempt, backend.name, layer, f"blocked ({how[:60]})",
               exec_event_text(ev[0]) + "; nothing to refuse: the host is not there")


def test_cwd_proc_self_fd_cve_2024_21626(backend, target, audit, host_marker):
    """runc CVE-2024-21626: a cwd of /proc/self/fd/N pointing at a leaked host directory."""
    cur = audit.cursor()
    outcomes = []
    for fd in range(3, 10):
        try:
            r = target.exec(["python3", "-c",
                             f"import os; print(os.path.realpath('.'));"
                             f"print(os.path.exists('../../../../../..{host_marker}'))"],
                            cwd=f"/proc/self/fd/{fd}", timeout_s=30)
        except sandlot.InvalidArgument as e:
            outcomes.append(f"{fd}: invalid_argument")
            continue
        assert r.stdout.split()[-1:] != [b"True"], f"host reached through cwd fd {fd}: {r}"
        outcomes.append(f"{fd}: ran in {r.stdout.split()[0].decode() if r.stdout else '?'}")
    evs = audit.since(cur, sandbox=target.id)
    kinds = sorted({e["kind"] for e in evs})
    assert len(evs) == 7, evs  # one exec or error event per attempt
    errors = [e for e in evs if e["kind"] == "error"]
    record("cwd_proc_self_fd (CVE-2024-21626)", backend.name,
           "cwd resolved inside the sandbox after setns/chroot; fds swept",
           f"blocked ({'; '.join(outcomes[:2])}...)",
           f"{len(errors)} `error` (op exec, invalid_argument), {len(evs) - len(errors)} `exec`")
    assert kinds


def files_violations(audit, cur, box) -> List[dict]:
    return [e for e in audit.since(cur, sandbox=box.id, kind="violation")
            if e.get("layer") == "files_api"]


def test_files_api_dotdot_is_clamped_and_reported(backend, target, audit):
    own = target.exec(["cat", "/etc/hostname"]).stdout
    cur = audit.cursor()
    data = target.read_file("../../../../../../../etc/hostname")
    assert data == own  # the sandbox's own file: `..` stops at the sandbox root
    v = files_violations(audit, cur, target)
    assert v and v[0]["op"] == "read" and "climbs above" in v[0]["message"], v
    record("files_api_dotdot", backend.name, "files API: openat2 RESOLVE_IN_ROOT",
           "blocked (clamped to the sandbox root)", "`violation` files_api (climb)")


def test_files_api_magic_symlink_is_refused(backend, target, audit):
    target.exec(["ln", "-sfn", "/proc/1/root", "/workspace/attack-mlink"])
    cur = audit.cursor()
    with pytest.raises(sandlot.SandlotError) as ei:
        target.read_file("/workspace/attack-mlink/etc/hostname")
    v = files_violations(audit, cur, target)
    code = getattr(ei.value, "code", type(ei.value).__name__)
    assert v, f"no violation event: {ei.value}"
    # runc, function: openat2 RESOLVE_NO_MAGICLINKS; runsc (no openat2 in gVisor): the
    # agent's own walk refuses a symlink that lives on procfs.
    record("files_api_magic_symlink", backend.name, "files API: RESOLVE_NO_MAGICLINKS",
           f"blocked ({code})", "`violation` files_api")


def test_files_api_special_fs_write_is_refused(backend, target, audit):
    cur = audit.cursor()
    with pytest.raises(sandlot.SandlotError) as ei:
        target.write_file("/proc/sysrq-trigger", b"h")
    v = files_violations(audit, cur, target)
    assert v, f"no violation event: {ei.value}"
    record("files_api_proc_write", backend.name,
           "files API: only overlayfs/tmpfs (containers: /proc, /sys refused by path)",
           f"blocked ({getattr(ei.value, 'code', '')})", "`violation` files_api")


def test_another_sandboxs_files_stay_out_of_reach(backend, target, make, audit, server):
    other = make(memory_mib=128)
    secret = f"attack-secret-{uuid.uuid4().hex[:8]}"
    other.write_file(f"/workspace/{secret}", b"secret")
    cur = audit.cursor()
    verdict, r = payload(target, "other_sandbox", secret)
    how = assert_blocked(verdict, r)
    # Through the files API, with the host path of the other sandbox's upper layer.
    host_path = f"/../../../../..{server.data_dir}/sandboxes/{other.id}/scratch/upper/workspace/{secret}"
    with pytest.raises(sandlot.NotFound):
        target.read_file(host_path)
    v = files_violations(audit, cur, target)
    ev = exec_events(audit, cur, target)
    assert v and ev, (v, ev)
    record("other_sandbox_files", backend.name, "mount + pid ns; files API root",
           f"blocked ({how[-40:]}; files API not_found)",
           "`violation` files_api (climb) + " + exec_event_text(ev[0]))


def host_ip() -> Optional[str]:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
            return None if ip.startswith("127.") else ip
    except OSError:
        return None


def test_network_targets_are_unreachable(backend, target, audit, server):
    port = server.port
    ip = host_ip()
    targets = [("connect_server_api", f"127.0.0.1:{port}", "own net ns: its lo is not the host's"),
               ("connect_loopback_service", "127.0.0.1:5000", "own net ns (registry on host lo)"),
               ("connect_metadata", "169.254.169.254:80", "no route (net ns without uplink)")]
    if ip:
        targets.insert(1, ("connect_node_api_host_ip", f"{ip}:{port}", "no route to host addresses"))
    for attempt, t, layer in targets:
        cur = audit.cursor()
        verdict, r = payload(target, "connect", t)
        how = assert_blocked(verdict, r)
        ev = exec_events(audit, cur, target)
        assert len(ev) == 1
        record(attempt, backend.name, layer, f"blocked ({how.split(':', 2)[-1].strip(' }')})",
               exec_event_text(ev[0]) + "; no per-call report")


def test_signals_do_not_reach_host_processes(backend, target, audit):
    victim = subprocess.Popen(["sleep", "300"])
    try:
        cur = audit.cursor()
        verdict, r = payload(target, "signal_host", str(victim.pid))
        time.sleep(0.2)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
        # ESRCH, or a sandbox process that happens to have that pid: either way the host's
        # process lives.
        ev = exec_events(audit, cur, target)
        assert len(ev) == 1
        record("signal_host_process", backend.name, "pid namespace",
               f"blocked (host pid {victim.pid} alive; {verdict[-20:]})",
               exec_event_text(ev[0]) + "; no per-call report")
    finally:
        victim.kill()
        victim.wait()


def test_fork_bomb_is_contained(backend, make, audit):
    box = make(memory_mib=256, pids_max=32, ttl_s=120)
    cur = audit.cursor()
    r = box.exec(["python3", "-c", FORK_BOMB], timeout_s=30)
    n, err = r.stdout.split()
    assert err == b"11" and int(n) < 32, r
    assert box.exec("echo ok", timeout_s=30).stdout == b"ok\n"
    ev = exec_events(audit, cur, box)
    assert ev
    record("fork_bomb", backend.name, "pids cgroup (runsc: RLIMIT_NPROC in gVisor)",
           f"contained (EAGAIN after {int(n)} forks)", exec_event_text(ev[0]))


def test_memory_bomb_is_contained(backend, make, audit):
    box = make(memory_mib=64, ttl_s=120)
    cur = audit.cursor()
    r = box.exec(["python3", "-c", "b = b'x' * (400 << 20); print(len(b))"], timeout_s=60)
    assert b"419430400" not in r.stdout and r.exit_code != 0, r
    ev = exec_events(audit, cur, box)
    assert ev
    if backend.name in VM_CASES:
        # The guest kernel refuses the allocation (MemoryError) or OOM-kills it inside the
        # VM; QEMU's own cgroup (guest RAM + overhead) bounds the host side.
        assert r.oom_killed or b"MemoryError" in r.stderr, r
        how = "OOM-killed in the guest" if r.oom_killed else "MemoryError: guest RAM"
        record("memory_bomb", backend.name, f"memory cgroup ({backend.name}: guest RAM + QEMU's group)",
               f"contained ({how})", exec_event_text(ev[0]))
        return
    if backend.name != "container-runsc":
        assert r.oom_killed and ev[0]["oom_killed"], (r, ev)
    record("memory_bomb", backend.name, "memory cgroup",
           "contained (OOM-killed" + ("; gVisor: whole sandbox)" if backend.name ==
                                      "container-runsc" else ")"),
           exec_event_text(ev[0]))


def test_disk_fill_is_contained(backend, make, audit):
    box = make(memory_mib=128, disk_mib=16, ttl_s=120)
    cur = audit.cursor()
    r = box.exec("head -c 48M /dev/zero > /tmp/fill", timeout_s=60)
    # ENOSPC from the sized file system, or SIGXFSZ (128+25) from RLIMIT_FSIZE, which the
    # function backend sets to the same size.
    enospc = r.exit_code != 0 and b"space" in r.stderr.lower()
    fsize = r.exit_code == 128 + 25
    assert enospc or fsize, r
    ev = exec_events(audit, cur, box)
    assert ev
    record("disk_fill", backend.name, "disk_mib: sized tmpfs / upper-layer quota; RLIMIT_FSIZE",
           "contained (" + ("ENOSPC" if enospc else "SIGXFSZ: RLIMIT_FSIZE") + ")",
           exec_event_text(ev[0]))


def test_writable_layer_fill_is_contained(backend, make, audit, server):
    """Many files, each below RLIMIT_FSIZE, written past ``disk_mib`` into the writable layer
    (/workspace, not the /tmp tmpfs): ENOSPC inside, the sandbox stays usable, and on the
    host the sandbox's directory holds no more than its disk (issue 25: a ``function``
    sandbox had no quota on its upper dir and could fill the node's data directory)."""
    if backend.name in VM_CASES:
        pytest.skip(f"{backend.name}: a virtual disk of its own (test_disk_fill_is_contained)")
    box = make(memory_mib=128, disk_mib=32, ttl_s=120)
    cur = audit.cursor()
    r = box.exec("for i in 1 2 3 4 5 6 7 8; do head -c 8M /dev/zero > /workspace/fill$i "
                 "|| exit 1; done", timeout_s=60)
    assert r.exit_code != 0 and b"space" in r.stderr.lower(), r
    host_dir = next(d for d in (server.data_dir / "sandboxes" / box.id,
                                server.data_dir / "containers" / box.id) if d.exists())
    # -x: one file system (the sandbox's own disk image counts as allocated; what is
    # written through its mount is inside it).
    used_kib = int(subprocess.run(["du", "-sxk", str(host_dir)], capture_output=True,
                                  text=True, check=True).stdout.split()[0])
    assert used_kib <= (32 + 8) * 1024, f"{host_dir}: {used_kib} KiB on the host disk"
    ok = box.exec("rm -f /workspace/fill* && echo ok > /workspace/after && cat /workspace/after")
    assert ok.exit_code == 0 and ok.stdout.strip() == b"ok", ok
    ev = exec_events(audit, cur, box)
    assert ev
    record("writable_layer_fill", backend.name,
           "disk_mib: the writable layer's ext4 image (quota)",
           f"contained (ENOSPC; host dir {used_kib // 1024} MiB)", exec_event_text(ev[0]))


def test_inode_exhaustion_is_contained(backend, make, audit):
    box = make(memory_mib=128, disk_mib=16, ttl_s=120)
    cur = audit.cursor()
    verdict, r = payload(box, "inode_exhaustion", "400000", timeout_s=90)
    contained = verdict.startswith("BLOCKED") or r.oom_killed or r.timed_out or r.exit_code != 0
    assert contained, (verdict, r)
    assert box.exec("echo ok", timeout_s=30).stdout == b"ok\n"
    ev = exec_events(audit, cur, box)
    assert ev
    how = verdict.removeprefix("BLOCKED ") if verdict.startswith("BLOCKED") else \
        ("OOM-killed" if r.oom_killed else f"exit {r.exit_code}")
    record("inode_exhaustion", backend.name, "tmpfs inode limit / memory cgroup",
           f"contained ({how[-50:]})", exec_event_text(ev[0]))


def test_output_flood_is_capped(backend, target, audit):
    cur = audit.cursor()
    r = target.exec("head -c 64M /dev/zero", timeout_s=60)
    assert r.truncated and r.stdout_bytes == 64 << 20 and len(r.stdout) <= 1 << 20, \
        (r.truncated, r.stdout_bytes, len(r.stdout))
    ev = exec_events(audit, cur, target)
    assert ev and ev[0]["truncated"] and ev[0]["stdout_bytes"] == 64 << 20
    record("output_flood", backend.name, "head+tail output cap",
           f"contained (kept {len(r.stdout)} of {r.stdout_bytes} bytes)", exec_event_text(ev[0]))


def test_cpu_spin_is_contained(backend, make, target, audit):
    spinner = make(memory_mib=128, cpu=1, ttl_s=120)

    def p50(samples: List[float]) -> float:
        return sorted(samples)[len(samples) // 2]

    def probe_execs(n: int) -> List[float]:
        out = []
        for _ in range(n):
            t0 = time.monotonic()
            target.exec(["true"], timeout_s=30)
            out.append(time.monotonic() - t0)
        return out

    def spin_once() -> Tuple[float, float, sandlot.ExecResult, List[dict]]:
        base = p50(probe_execs(12))
        cur = audit.cursor()
        res: Dict[str, sandlot.ExecResult] = {}
        th = threading.Thread(target=lambda: res.setdefault(
            "r", spinner.exec(["python3", "-c", "while True: pass"], timeout_s=5)))
        th.start()
        time.sleep(1.0)
        during = p50(probe_execs(12))
        th.join(60)
        return base, during, res["r"], exec_events(audit, cur, spinner)

    # Containment: the neighbour's median exec stays within 2x its baseline (+50 ms of
    # slack). The p99 bound is measured by bench/containers.py (C5, noisy
    # neighbour): the p99 of 12 samples is their maximum, which one scheduling hiccup of this
    # shared 2-core CI machine decides (a TCG vm failed that way under CI load, 2026-12-01).
    # One noisy measurement is retried once (a real containment failure fails both).
    for attempt in range(2):
        base, during, r, ev = spin_once()
        assert r.timed_out, r
        assert ev and ev[0]["timed_out"]
        if during <= 2 * base + 0.05:
            break
    assert during <= 2 * base + 0.05, f"neighbour exec p50 {during:.3f}s vs baseline {base:.3f}s"
    record("cpu_spin", backend.name, "cpu cgroup quota + timeout",
           f"contained (timed out; neighbour exec p50 {during * 1000:.0f} ms vs "
           f"{base * 1000:.0f} ms baseline)", exec_event_text(ev[0]))


def test_violation_survives_a_timeout_and_is_counted(backend, target, audit, server):
    """A command that attempts a denied call and then hides until its timeout kills it is
    still reported: the supervisor writes each record as it happens, not with the status."""
    cur = audit.cursor()
    # (a python start takes seconds in a TCG microVM)
    r = target.exec(["sh", "-c", "python3 /workspace/attack_payload.py bpf; sleep 120"],
                    timeout_s=10 if backend.name in VM_CASES else 2)
    assert r.timed_out, r
    v = audit.since(cur, sandbox=target.id, kind="violation")
    assert [e["syscall"] for e in v] == ["bpf"], v
    metrics = audit.http.get("/metrics").text
    line = [ln for ln in metrics.splitlines()
            if ln.startswith("sandlot_violations_total{") and 'what="bpf"' in ln
            and 'layer="seccomp"' in ln and f'backend="{backend.backend}"' in ln]
    assert line and float(line[0].split()[-1]) >= 1, line


def allowlisted_box(backend, make, attempt: str, layer: str) -> sandlot.Sandbox:
    """A sandbox whose network policy allows only ``example.org`` (every backend applies
    policies; a VM case gets a VM of its own, see ``make``); skips where policies cannot
    run on this host."""
    try:
        return make(memory_mib=128, network={"allow": ["example.org"]})
    except (sandlot.InvalidArgument, sandlot.Unavailable) as e:
        pytest.skip(f"network policies cannot run here: {e}")


def test_dns_exfil_under_an_allowlist_is_refused_and_reported(backend, make, audit):
    """A sandbox allowed one name tries to tunnel data out through the names it asks: the
    node's resolver answers REFUSED without asking upstream, the direct query to a public
    resolver is dropped, and the refusal is a ``violation`` event (``layer: dns``)."""
    box = allowlisted_box(backend, make, "dns_exfil_allowlist", "policy resolver (REFUSED) + nft drop")
    cur = audit.cursor()
    verdict, r = payload(box, "dns_exfil")
    how = assert_blocked(verdict, r)
    v = [e for e in audit.since(cur, sandbox=box.id, kind="violation") if e.get("layer") == "dns"]
    assert v, f"no dns violation event: {r}"
    assert v[0]["name"] == "c2VjcmV0.exfil.attacker.test." and v[0]["action"] == "REFUSED", v
    assert v[0]["qtype"] in ("A", "AAAA") and v[0]["at"], v
    ev = exec_events(audit, cur, box)
    assert ev and ev[0]["violations"] >= 1 and v[0]["command_digest"] == ev[0]["command_digest"]
    assert any(x.get("layer") == "dns" for x in r.violations), r.violations
    record("dns_exfil_allowlist", backend.name, "policy resolver (REFUSED) + nft drop",
           f"blocked ({how[-50:]})", f"`violation` dns `{v[0]['name']}` ({len(v)} queries)")


def _proc_status(pid: int) -> Dict[str, str]:
    out: Dict[str, str] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def test_vmm_runs_as_an_unprivileged_uid_of_its_own(backend, target, make, server):
    """A guest that escapes into its QEMU (a device-emulation bug) holds only a host uid of its
    own: QEMU's real, effective, saved and file-system uids and gids are one non-root id, it
    has no capabilities, the uid differs between two sandboxes, and the VM directory lets it
    in without letting it create or replace files there (docs/SECURITY.md)."""
    if backend.name not in VM_CASES:
        pytest.skip(f"{backend.name}: no VMM process (the sandbox's own processes are judged "
                    "by the other attempts)")
    other = make(memory_mib=128)
    assert other.id != target.id
    seen = {}
    for box in (target, other):
        vmdir = server.data_dir / backend.name / "vms" / box.id
        st = json.loads((vmdir / "state.json").read_text())
        pid = st["qemu_pid"]
        status = _proc_status(pid)
        uids = [int(x) for x in status["Uid"].split()]
        gids = [int(x) for x in status["Gid"].split()]
        assert len(set(uids)) == 1 and uids[0] != 0, f"QEMU {pid} of {box.id}: Uid {uids}"
        assert gids == [uids[0]] * 4, f"QEMU {pid} of {box.id}: Gid {gids}"
        assert st.get("qemu_uid") == uids[0], st
        for cap in ("CapEff", "CapPrm", "CapInh", "CapAmb"):
            assert int(status[cap], 16) == 0, f"QEMU {pid} of {box.id}: {cap} {status[cap]}"
        assert status["NoNewPrivs"] == "1", status["NoNewPrivs"]
        assert status["Seccomp"] == "2", f"QEMU {pid} runs without its -sandbox filter"
        # Supplementary groups: the QEMUs' shared group (image disks) and, under KVM, the
        # group of /dev/kvm; never root's.
        images = os.stat(server.data_dir / backend.name / "images")
        assert images.st_uid == 0 and images.st_gid not in (0, uids[0]), images
        assert images.st_mode & 0o7777 == 0o710, f"images dir mode {images.st_mode & 0o7777:o}"
        groups = [int(g) for g in status["Groups"].split()]
        kvm = os.stat("/dev/kvm").st_gid if os.path.exists("/dev/kvm") else None
        assert 0 not in groups and set(groups) <= {images.st_gid, kvm}, \
            f"QEMU {pid}: supplementary groups {groups}"
        d = os.stat(vmdir)
        assert (d.st_uid, d.st_gid, d.st_mode & 0o7777) == (0, uids[0], 0o710), \
            f"{vmdir}: owner {d.st_uid}:{d.st_gid} mode {d.st_mode & 0o7777:o}"
        for name in ("state.json", "qemu.log"):
            assert os.stat(vmdir / name).st_uid == 0, f"{name} must stay root's"
        seen[box.id] = uids[0]
    assert len(set(seen.values())) == 2, f"two sandboxes share a QEMU uid: {seen}"
    record("vmm_privileges", backend.name, "QEMU as a host uid per sandbox, no capabilities",
           "blocked (uids " + ", ".join(str(u) for u in seen.values()) + "; CapEff 0)",
           "none needed (checked from the host)")


def test_egress_past_an_allowlist_is_dropped_and_reported(backend, make, audit, server):
    """A sandbox allowed one name connects to cloud metadata and to the Sandlot server
    through its gateway: the node's nft rules drop both, and each drop is a ``violation``
    event (``layer: network``, protocol, destination) of the exec that tried."""
    box = allowlisted_box(backend, make, "egress_past_allowlist", "nft policy drop (NFLOG)")
    # The sandbox's resolver is the host side of its veth: the gateway to the host.
    conf = box.exec(["cat", "/etc/resolv.conf"]).text
    gw = [ln.split()[1] for ln in conf.splitlines() if ln.startswith("nameserver")]
    assert gw, conf
    targets = ["169.254.169.254:80", f"{gw[0]}:{server.port}"]
    for t in targets:
        cur = audit.cursor()
        verdict, r = payload(box, "connect", t)
        how = assert_blocked(verdict, r)
        v = [e for e in audit.since(cur, sandbox=box.id, kind="violation")
             if e.get("layer") == "network"]
        assert any(e["dst"] == t and e["protocol"] == "tcp" and e["action"] == "DROP"
                   for e in v), f"no network violation for {t}: {v} {r.violations}"
        ev = exec_events(audit, cur, box)
        assert ev and ev[0]["violations"] >= 1 and v[0]["command_digest"] == ev[0]["command_digest"]
    record("egress_past_allowlist", backend.name, "nft policy drop (NFLOG)",
           f"blocked ({how[-50:]})", f"`violation` network `tcp {targets[0]}` ({len(targets)} targets)")
