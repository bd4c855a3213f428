#!/usr/bin/env python3
"""A/B of microVM cold-boot variants at the QEMU level: boots QEMU with the node's exact
command line and times the guest agent's answer to a ping, without the node in the way.

Usage (as root, after scripts/setup.sh and scripts/guest-kit.sh):

    python3 bench/boot_qemu.py [--binary target/release/sandlot] [--n 8]
        [--variants variants.json] [--log]

It starts `sandlot up` (templates off) on a free loopback port, creates one `python`
microVM (memory_mib 256) and takes its QEMU command line from the sandbox's `state.json`
(so: the same kernel, initramfs, image disk, accelerator and options as the node uses), then
deletes the sandbox and, with that server still up (its image disk and initramfs stay),
boots QEMU directly `--n` times per variant, variants interleaved (round-robin, every other
round in reverse order), each on a
fresh sparse ext4 scratch disk, with the agent and QMP sockets bound here and inherited as
fds 3 and 4 as the node does. Per boot it prints:

- `first`: seconds from QEMU's start to the agent's first bytes on `agent.sock` (its
  HTTP/2 SETTINGS; the ping request was written at connect, as the node's readiness check
  does);
- `ans`: seconds to the HEADERS of the ping's answer (what the node's readiness waits for);
- `cpu`: QEMU's user + system CPU seconds at the answer (/proc/PID/stat; 10 ms ticks);
- with `--log`: the guest's own `boot phases (guest uptime, ms)` line (the kernel command
  line gets `loglevel=5 printk.devkmsg=on`, which costs a little console output).

and at the end the medians, minimum and maximum per variant. On a shared host the wall
times vary by ±0.1-0.2 s; QEMU's CPU time is steadier (a TCG boot computes, it never waits).

`--variants` is a JSON object `{name: change}`; a change may hold `add` (words appended to
the kernel command line), `remove` (command-line words or `key`s of `key=value` words to
drop), `cpu` (the `-cpu` value), `machine` (the `-M` value), `initrd` (another initramfs
path, e.g. one with a changed guest agent) and `extra_args` (more QEMU arguments). Default:
`{"base": {}}`. Example:

    {"base": {}, "rcu": {"add": "rcupdate.rcu_expedited=1"}, "erms": {"cpu": "max"}}

Exit status 0; a boot that gets no answer within 8 s is printed with `ans=None` (its
console log stays in the work directory, printed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R

HZ = os.sysconf("SC_CLK_TCK")
ANSWER_TIMEOUT_S = 8.0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(typ: int, flags: int, stream: int, payload: bytes) -> bytes:
    """One HTTP/2 frame (RFC 9113 §4.1)."""
    return (len(payload).to_bytes(3, "big") + bytes([typ, flags])
            + stream.to_bytes(4, "big") + payload)


def ping_headers() -> bytes:
    """HPACK (RFC 7541) of GET http://localhost/v1/ping: indexed :method GET and :scheme
    http, literal :path and :authority without indexing."""
    path, auth = b"/v1/ping", b"localhost"
    return (b"\x82\x86" + b"\x04" + bytes([len(path)]) + path
            + b"\x01" + bytes([len(auth)]) + auth)


def qemu_cpu_s(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / HZ
    except (OSError, IndexError, ValueError):
        return float("nan")


def boot(qemu: str, args: list[str], run_dir: Path, scratch0: Path) -> dict:
    """Boots QEMU once in `run_dir`; the timings of the agent's first bytes and answer."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for n in ("agent.sock", "qmp.sock", "console.log"):
        (run_dir / n).unlink(missing_ok=True)
    subprocess.run(["cp", "--sparse=always", str(scratch0), str(run_dir / "scratch.img")],
                   check=True)
    a = socket.socket(socket.AF_UNIX)
    a.bind(str(run_dir / "agent.sock"))
    a.listen(4)
    q = socket.socket(socket.AF_UNIX)
    q.bind(str(run_dir / "qmp.sock"))
    q.listen(4)

    def fds() -> None:  # in the child: the listening sockets as fds 3 and 4, inheritable
        x, y = os.dup(a.fileno()), os.dup(q.fileno())
        os.dup2(x, 3)
        os.dup2(y, 4)

    t0 = time.monotonic()
    with open(run_dir / "qemu.log", "wb") as log:
        p = subprocess.Popen([qemu, *args], preexec_fn=fds, close_fds=False,
                             stdout=log, stderr=subprocess.STDOUT)
    c = socket.socket(socket.AF_UNIX)
    c.connect(str(run_dir / "agent.sock"))
    c.sendall(PREFACE + frame(4, 0, 0, b"") + frame(1, 0x5, 1, ping_headers()))
    first = ans = cpu = None
    buf = b""
    try:
        while ans is None and time.monotonic() < t0 + ANSWER_TIMEOUT_S:
            r, _, _ = select.select([c], [], [], 0.2)
            if not r:
                if p.poll() is not None:
                    break
                continue
            d = c.recv(65536)
            if not d:
                break
            if first is None:
                first = time.monotonic() - t0
            buf += d
            i = 0
            while i + 9 <= len(buf):
                ln, typ = int.from_bytes(buf[i:i + 3], "big"), buf[i + 3]
                sid = int.from_bytes(buf[i + 5:i + 9], "big") & 0x7FFFFFFF
                if i + 9 + ln > len(buf):
                    break
                if typ == 4 and not buf[i + 4] & 1:
                    c.sendall(frame(4, 1, 0, b""))  # SETTINGS ack
                if typ == 1 and sid == 1:
                    ans, cpu = time.monotonic() - t0, qemu_cpu_s(p.pid)
                i += 9 + ln
            buf = buf[i:]
    finally:
        p.kill()
        p.wait()
        for s in (c, a, q):
            s.close()
    con = run_dir / "console.log"
    text = con.read_text(errors="replace") if con.exists() else ""
    m = re.search(r"boot phases \(guest uptime, ms\): (.*)", text)
    return {"first": first, "ans": ans, "cpu": cpu, "phases": m.group(1).strip() if m else None}


def variant(base: list[str], v: dict, run_dir: Path, log: bool) -> list[str]:
    args = list(base)
    i = args.index("-append") + 1
    remove = set(v.get("remove", []))
    words = [w for w in args[i].split() if w not in remove and w.split("=")[0] not in remove]
    words += v.get("add", "").split()
    if log:
        words += ["loglevel=5", "printk.devkmsg=on"]
    args[i] = " ".join(words)
    for opt, key in (("-cpu", "cpu"), ("-M", "machine"), ("-initrd", "initrd")):
        if key in v:
            args[args.index(opt) + 1] = v[key]
    args = [re.sub(r"file=[^,]*/scratch\.img", f"file={run_dir}/scratch.img", x) for x in args]
    args = [re.sub(r"^file:.*/console\.log$", f"file:{run_dir}/console.log", x) for x in args]
    return args + list(v.get("extra_args", []))


def fmt(x: float | None) -> str:
    return "None" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(R.REPO / "target/release/sandlot"))
    ap.add_argument("--images-dir", default=os.environ.get("SANDLOT_IMAGES_DIR",
                                                           "/var/lib/sandlot/images"))
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    ap.add_argument("--n", type=int, default=8, help="boots per variant (default 8)")
    ap.add_argument("--variants", help="JSON file {name: change} (default {\"base\": {}})")
    ap.add_argument("--log", action="store_true",
                    help="print the guest's boot phases (adds loglevel=5 printk.devkmsg=on)")
    o = ap.parse_args(argv)
    if R.httpx is None:
        print("bench: python3 -m pip install httpx", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench: run as root", file=sys.stderr)
        return 2
    variants = json.loads(Path(o.variants).read_text()) if o.variants else {"base": {}}
    s = R.Server(Path(o.binary), Path(o.images_dir), ["--warm-pool", "0"],
                 ready_timeout_s=60, tmp_parent="/var/tmp",
                 env={"SANDLOT_MICROVM_TEMPLATES": "0"})
    s.start()
    work = Path(tempfile.mkdtemp(prefix="sandlot-bootq.", dir="/var/tmp"))
    c = R.httpx.Client(base_url=s.url, timeout=300)
    res: dict[str, list[dict]] = {k: [] for k in variants}
    try:
        r = c.post("/v1/sandboxes", json={"backend": "microvm", "image": "python",
                                          "memory_mib": 256})
        if r.status_code != 201:
            raise R.BenchError(f"create: {r.status_code} {r.text[:300]}")
        sid = r.json()["id"]
        st = json.loads((s.tmp / "data/microvm/vms" / sid / "state.json").read_text())
        c.delete(f"/v1/sandboxes/{sid}")
        base = st["qemu_args"]
        print("accel:", st.get("accel"), "| -cpu", base[base.index("-cpu") + 1],
              "| -append", base[base.index("-append") + 1], flush=True)
        scratch0 = work / "scratch0.img"
        with open(scratch0, "wb") as f:
            f.truncate(st["spec"]["disk_mib"] << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E",
                        "root_owner=0:0", str(scratch0)], check=True)
        items = list(variants.items())
        for i in range(o.n):
            # Odd rounds in reverse order: on this host the first boot of a round came out
            # up to ~0.2 s slower whichever variant it was (cause not found), so a fixed
            # order biases the comparison.
            for name, v in (items if i % 2 == 0 else items[::-1]):
                rd = work / f"run-{name}"
                x = boot(o.qemu, variant(base, v, rd, o.log), rd, scratch0)
                res[name].append(x)
                print(f"{i} {name:12s} first={fmt(x['first'])} ans={fmt(x['ans'])} "
                      f"cpu={fmt(x['cpu'])} {x['phases'] or ''}", flush=True)
    finally:
        c.close()
        s.stop()
        s.cleanup_dir()
    print("variant: seconds to the ping's answer (wall) and QEMU CPU seconds at it")
    for name, xs in res.items():
        ok = [x for x in xs if x["ans"] is not None]
        if not ok:
            print(f"{name:12s} no answer in {len(xs)} boots; console: {work}/run-{name}")
            continue
        w = sorted(x["ans"] for x in ok)
        u = sorted(x["cpu"] for x in ok)
        print(f"{name:12s} n={len(ok)}/{len(xs)} wall p50 {statistics.median(w):.3f} "
              f"(min {w[0]:.3f}, max {w[-1]:.3f}); cpu p50 {statistics.median(u):.3f} "
              f"(min {u[0]:.2f}, max {u[-1]:.2f})")
    if all(x["ans"] is not None for xs in res.values() for x in xs):
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
