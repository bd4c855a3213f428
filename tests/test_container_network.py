"""Network policies of runc and runsc containers, of `function` sandboxes and of microVMs (one
shared ``NodeNet`` in crates/sandlot-node/src/net.rs; issue 3 "Network policy", issue 25) against a
small "internet" built on this machine: a network namespace ``sl-inet-<rand>`` joined to the host by a
veth pair (host side 10.98.K.1/30, "internet" side 10.98.K.2/30) that runs an HTTP server
on 10.98.K.2:8080 and a DNS server on 10.98.K.2:53 answering every ``*.test`` name with
10.98.K.2 and logging the names it was asked.

The node forwards allowed names to the first ``nameserver`` of /etc/resolv.conf
(``NetConfig::new`` → ``default_upstream`` in crates/sandlot-node/src/net.rs; no setting
overrides it). So that this module's `sandlot up` uses the test DNS server without touching
the host's resolver, it runs in a mount namespace of its own (``unshare --mount
--propagation slave``) where /etc/resolv.conf is bind-mounted over by a file naming
10.98.K.2; host mounts still propagate into it, its own mounts (container rootfs, scratch,
netns files) stay in it and are counted there (``/proc/<server pid>/mountinfo``). The
server listens on 0.0.0.0 so that its port on the host's addresses is a real target.

Checked: an allowed IP is reachable over HTTP, a disallowed one is not; an allowed name
resolves (the upstream saw it) and is reachable, a denied name does not resolve and never
reaches the upstream; 169.254.169.254, every address of the host (incl. the sandbox's own
gateway and the "internet" veth's host side) and the Sandlot server port are unreachable
from any policy; ``network: "none"`` has only ``lo``; after delete no veth, nft chain or
set, netns file, mount or DATA/net/<id>.json of the sandbox remains.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

import sandlot
from conftest import (
    IMAGES_DIR, Server, count_leaks, node_cgroup_parent, pooled_names, private_base,
    remove_private_base, wait_until,
)

IMAGE = "python"
HTTP_PORT = 8080
TOKEN = f"sandlot-inet-{random.getrandbits(48):012x}"

DNS_SERVER = r'''
import socket, struct, sys
addr, answer_ip, log = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((addr, 53))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(4096)
    if len(data) < 12:
        continue
    qid, flags, qd = struct.unpack(">HHH", data[:6])
    i, labels = 12, []
    while i < len(data) and data[i]:
        labels.append(data[i + 1:i + 1 + data[i]].decode("ascii", "replace"))
        i += 1 + data[i]
    qtype, qclass = struct.unpack(">HH", data[i + 1:i + 5])
    question = data[12:i + 5]
    name = ".".join(labels).lower()
    with open(log, "a") as f:
        f.write(f"{name} {qtype}\n")
    ok = name.endswith(".test")
    rcode = 0 if ok else 3
    answers = b""
    if ok and qtype == 1:
        answers = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 30, 4) + socket.inet_aton(answer_ip)
    hdr = struct.pack(">HHHHHH", qid, 0x8180 | rcode, 1, 1 if answers else 0, 0, 0)
    s.sendto(hdr + question + answers, peer)
'''

#: `python3 -m http.server` without its reverse lookup of the bind address (getfqdn, which
#: hangs ~10 s in a namespace without a reachable DNS server).
HTTP_SERVER = r'''
import http.server, os, socketserver, sys
ip, port, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.chdir(root)
class Server(http.server.ThreadingHTTPServer):
    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = ip, port
Server((ip, port), http.server.SimpleHTTPRequestHandler).serve_forever()
'''

#: Run inside the container: each check of argv[1] (JSON list of [kind, target]) in a
#: thread; prints {"kind target": "ok..." | "err..."}.
PROBE = r'''
import json, socket, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
def tcp(t):
    host, port = t.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3)
    s.close()
    return "ok"
def http(url):
    return "ok:" + urllib.request.urlopen(url, timeout=4).read().decode()
def resolve(name):
    return "ok:" + ",".join(sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)}))
def dns(name):
    # One raw A query to the resolver of /etc/resolv.conf: "rcode:N".
    import random, struct
    ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
    qid = random.randrange(65536)
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.sendto(q, (ns, 53))
    data = s.recv(4096)
    assert struct.unpack(">H", data[:2])[0] == qid
    return "rcode:%d" % (struct.unpack(">H", data[2:4])[0] & 0xF)
def run(check):
    kind, target = check
    try:
        return {"tcp": tcp, "http": http, "resolve": resolve, "dns": dns}[kind](target)
    except Exception as e:
        return "err:" + type(e).__name__ + ": " + str(e)
checks = json.loads(sys.argv[1])
with ThreadPoolExecutor(len(checks)) as ex:
    out = dict(zip([k + " " + t for k, t in checks], ex.map(run, checks)))
print(json.dumps(out))
'''


@dataclass
class Inet:
    ns: str
    host_if: str
    host_ip: str    # 10.98.K.1, the host's side
    ip: str         # 10.98.K.2, the "internet" host
    dns_log: Path

    def dns_seen(self) -> List[str]:
        try:
            return [line.split()[0] for line in self.dns_log.read_text().splitlines()]
        except OSError:
            return []


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.returncode} {r.stderr.strip()}")
    return r


@pytest.fixture(scope="module")
def inet(tmp_path_factory) -> Iterator[Inet]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and nftables need root")
    for tool in ("ip", "nft", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed (iproute2 / nftables / util-linux)")
    used = sh("ip", "-4", "-o", "addr", "show").stdout
    free = [k for k in range(1, 250) if f"10.98.{k}." not in used]
    k = random.choice(free)
    tag = f"{random.getrandbits(24):06x}"
    ns, host_if, peer = f"sl-inet-{tag}", f"slti{tag}", f"sltp{tag}"
    host_ip, ip = f"10.98.{k}.1", f"10.98.{k}.2"
    work = tmp_path_factory.mktemp("inet")
    (work / "www").mkdir()
    (work / "www" / "hello.txt").write_text(TOKEN)
    (work / "inet_dns.py").write_text(DNS_SERVER)
    (work / "inet_httpd.py").write_text(HTTP_SERVER)
    dns_log = work / "dns.log"
    procs: List[subprocess.Popen] = []
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", ns)
        sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        nsx = ["ip", "netns", "exec", ns]
        sh(*nsx, "ip", "link", "set", "lo", "up")
        sh(*nsx, "ip", "addr", "add", f"{ip}/30", "dev", peer)
        sh(*nsx, "ip", "link", "set", peer, "up")
        sh(*nsx, "ip", "route", "add", "default", "via", host_ip)
        procs.append(subprocess.Popen(
            nsx + ["python3", str(work / "inet_httpd.py"), ip, str(HTTP_PORT),
                   str(work / "www")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        dns = subprocess.Popen(nsx + ["python3", str(work / "inet_dns.py"), ip, ip,
                                      str(dns_log)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(dns)
        assert dns.stdout.readline().strip() == "ready", "test DNS server did not start"

        def http_up() -> bool:
            try:
                with socket.create_connection((ip, HTTP_PORT), timeout=1):
                    return True
            except OSError:
                return False

        wait_until(http_up, 15, what=f"the test HTTP server on {ip}:{HTTP_PORT}")
        # The host reaches the "internet" (so a failure from a sandbox is the policy's).
        import urllib.request
        assert urllib.request.urlopen(f"http://{ip}:{HTTP_PORT}/hello.txt",
                                      timeout=5).read().decode() == TOKEN
        yield Inet(ns, host_if, host_ip, ip, dns_log)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        sh("ip", "link", "del", host_if, check=False)
        sh("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def node(binary, log_dir, inet, tmp_path_factory) -> Iterator[Server]:
    """`sandlot up` in its own mount namespace whose /etc/resolv.conf names the test DNS
    server, listening on 0.0.0.0."""
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    base = private_base("sandlot-net-")
    resolv = base / "resolv.conf"
    resolv.write_text(f"nameserver {inet.ip}\n")
    wrapper = base / "sandlot-in-ns"
    # `unshare` and `sh` exec in place: the Popen pid is the server's. --listen 127.0.0.1:P
    # becomes 0.0.0.0:P.
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec unshare --mount --propagation slave sh -c '"
        f"mount --bind {resolv} /etc/resolv.conf || exit 99\n"
        f"bin=$1; shift; for a in \"$@\"; do shift; case $a in 127.0.0.1:*) "
        f"a=0.0.0.0:${{a#127.0.0.1:}};; esac; set -- \"$@\" \"$a\"; done\n"
        f"exec \"$bin\" \"$@\"' sh {binary} \"$@\"\n")
    wrapper.chmod(0o755)
    # Off loopback `sandlot up` needs an API key first (it refuses to serve 0.0.0.0 without
    # one); the tests use an admin key.
    made = subprocess.run([str(binary), "key", "create", "--data-dir", str(base / "data"),
                           "--name", "network-tests", "--admin"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    api_key = made.stdout.strip()
    srv = Server(wrapper, base / "data", log_dir / "container-network.log")
    srv.api_key = api_key
    try:
        srv.start()
    except RuntimeError as e:
        pytest.fail(f"could not start `sandlot up` in its own mount namespace: {e}")
    ns_resolv = Path(f"/proc/{srv.proc.pid}/root/etc/resolv.conf").read_text()
    assert inet.ip in ns_resolv, ns_resolv
    c = sandlot.Client(srv.url, timeout=60, api_key=api_key)
    try:
        c.create(backend="container", runtime="runc", image=IMAGE, memory_mib=64,
                 ttl_s=60).delete()
    except (sandlot.NotFound, sandlot.Unavailable) as e:
        srv.stop()
        pytest.skip(f"no runc container from image {IMAGE!r} in {IMAGES_DIR}: {e}")
    yield srv
    try:
        for b in c.list():
            b.delete()
    except sandlot.SandlotError as e:
        print(f"cleanup failed: {e}")
    c.close()
    try:
        srv.stop()
    except RuntimeError as e:
        print(e)
    remove_private_base(base)


@pytest.fixture(scope="module")
def host_listener() -> Iterator[int]:
    """A TCP listener of the host on 0.0.0.0 (every host address); returns its port."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    s.listen(64)
    stop = threading.Event()

    def serve():
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = s.accept()
                conn.close()
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield s.getsockname()[1]
    stop.set()
    t.join()
    s.close()


@pytest.fixture(scope="module")
def client(node) -> Iterator[sandlot.Client]:
    c = sandlot.Client(node.url, timeout=120, api_key=node.api_key)
    yield c
    c.close()


def host_addresses() -> List[str]:
    """IPv4 addresses of the host's own interfaces (sandbox veths and loopback left out:
    127.0.0.1 inside a sandbox is its own)."""
    out = []
    for line in sh("ip", "-4", "-o", "addr", "show").stdout.splitlines():
        f = line.split()
        if not f[1].startswith("slv") and not f[3].startswith("127."):
            out.append(f[3].split("/")[0])
    return out


def probe(box: sandlot.Sandbox, checks: List[List[str]]) -> Dict[str, str]:
    r = box.exec(["python3", "-c", PROBE, json.dumps(checks)], timeout_s=60)
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


def net_state(node: Server, sid: str) -> dict:
    return json.loads((node.data_dir / "net" / f"{sid}.json").read_text())


def server_mounts(node: Server, needle: str) -> List[str]:
    """Mounts of the server's mount namespace whose line names ``needle``."""
    try:
        return [line for line in open(f"/proc/{node.proc.pid}/mountinfo") if needle in line]
    except OSError:
        return []


def unreachable_checks(node: Server, gw: str, listen_port: int) -> List[List[str]]:
    """Targets no policy may reach: metadata, every host address (the host listener on
    0.0.0.0 and the Sandlot server port), the sandbox's gateway."""
    checks = [["tcp", "169.254.169.254:80"], ["http", "http://169.254.169.254/latest/"]]
    for a in sorted(set(host_addresses() + [gw])):
        checks += [["tcp", f"{a}:{listen_port}"], ["tcp", f"{a}:{node.port}"]]
    return checks


def host_can_reach(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=2):
            return True
    except OSError:
        return False


def assert_unreachable(results: Dict[str, str], checks: List[List[str]]) -> None:
    reached = {f"{k} {t}": results[f"{k} {t}"] for k, t in checks
               if results[f"{k} {t}"].startswith("ok")}
    assert not reached, f"reachable from the sandbox despite the policy: {reached}"


def assert_torn_down(node: Server, sid: str, host_if: str) -> None:
    """Nothing of sandbox ``sid`` (host veth ``host_if``) is left once it is deleted."""
    def gone() -> bool:
        return (sh("ip", "link", "show", host_if, check=False).returncode != 0
                and not (node.data_dir / "net" / f"{sid}.json").exists()
                and not (node.data_dir / "containers" / sid).exists()
                and not (node.data_dir / "microvm" / "vms" / sid).exists()
                and not (node.data_dir / "vm" / "vms" / sid).exists()
                and not (node.data_dir / "sandboxes" / sid).exists())
    wait_until(gone, 30, what=f"veth {host_if}, DATA/net/{sid}.json, the sandbox dir of {sid}")
    table = sh("nft", "list", "table", "inet", "sandlot", check=False).stdout
    assert host_if not in table, f"nft still names {host_if}:\n{table}"
    assert not server_mounts(node, sid), server_mounts(node, sid)
    assert not [line for line in sh("losetup", "-a").stdout.splitlines() if sid in line]
    assert not [p for p in Path("/proc").glob("[0-9]*")
                if sid.encode() in _cmdline(p)], f"a process still names {sid}"


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def make_box(client, network, runtime="runc", **kw) -> sandlot.Sandbox:
    """A sandbox of ``runtime``: "runc"/"runsc" containers, or "function" / "microvm" / "vm"
    (the backend of that name; skips when that backend or its network is unavailable)."""
    if runtime in ("microvm", "vm"):
        try:
            return client.create(backend=runtime, image=IMAGE, memory_mib=256, ttl_s=300,
                                 network=network, **kw)
        except sandlot.Unavailable as e:
            pytest.skip(f"{runtime} cannot run this sandbox here: {e}")
    if runtime == "function":
        return client.create(backend="function", image=IMAGE, memory_mib=128, ttl_s=300,
                             network=network, **kw)
    return client.create(backend="container", runtime=runtime, image=IMAGE, memory_mib=128,
                         ttl_s=300, network=network, **kw)


#: Allow policies work on both runtimes, on `function` and on `microvm`: runc and function
#: sandboxes use the kernel's stack in a network namespace made by host root, gVisor its
#: hostinet in the node's namespace, a microVM its guest kernel's stack on a virtio-net tap
#: bridged to the veth in a namespace made by host root; all four on the same veth +
#: nftables + resolver. The `vm` backend (the same tap and guest set-up on q35, a boot of
#: ~20 s under TCG) runs the first test only (CI time).
RUNTIMES = pytest.mark.parametrize("runtime", ["runc", "runsc", "function", "microvm"])


def _attached(node: Server, box: sandlot.Sandbox) -> dict:
    """The sandbox's net state, checked against the host: its veth exists, nft has its
    chains, its netns file is there, its resolv.conf names its resolver."""
    st = net_state(node, box.id)
    host_if = st["host_if"]
    assert host_if.startswith("slv") and len(host_if) <= 15, st
    assert sh("ip", "link", "show", host_if, check=False).returncode == 0
    table = sh("nft", "list", "table", "inet", "sandlot").stdout
    assert f"{host_if}_fwd" in table, table
    if box.backend == "function":
        # The namespace of the jail's init, made by host root before its user namespace.
        assert re.fullmatch(r"/proc/[0-9]+/ns/net", st["netns"]), st
        assert Path(st["netns"]).exists(), st
    elif box.backend in ("microvm", "vm"):
        # The VM's namespace file, its QEMU inside it on the tap bridged to the veth.
        assert st["netns"] == str(node.data_dir / box.backend / "vms" / box.id / "netns"), st
        # (mounted in the server's mount namespace: entered through it)
        links = sh("nsenter", "-t", str(node.proc.pid), "-m", "--", "nsenter",
                   f"--net={st['netns']}", "ip", "-o", "link").stdout
        assert "tap0" in links and "master br0" in links, links
    else:
        assert (node.data_dir / "containers" / box.id / "netns").exists()
    resolv = box.exec("cat /etc/resolv.conf").stdout.decode()
    assert f"nameserver {st['host_addr']}" in resolv, resolv
    return st


@pytest.mark.parametrize("runtime", ["runc", "runsc", "function", "microvm", "vm"])
def test_allow_ip_reaches_only_that_address(node, client, inet, host_listener, runtime):
    """allow [10.98.K.2]: HTTP to it works; metadata, every host address (listener and
    Sandlot port, gateway included) are unreachable; any name is refused by the resolver
    and never reaches the upstream; delete leaves nothing."""
    for a in host_addresses():
        assert host_can_reach(a, host_listener), f"host listener not reachable on {a}"
    assert host_can_reach(inet.host_ip, node.port), "the server does not listen on 0.0.0.0"
    box = make_box(client, {"allow": [inet.ip]}, runtime)
    st = _attached(node, box)
    checks = [["http", f"http://{inet.ip}:{HTTP_PORT}/hello.txt"],
              ["resolve", "good.test"], ["resolve", "bad.test"], ["dns", "bad.test"]]
    bad = unreachable_checks(node, st["host_addr"], host_listener)
    res = probe(box, checks + bad)
    print(json.dumps(res, indent=1))
    assert res[f"http http://{inet.ip}:{HTTP_PORT}/hello.txt"] == f"ok:{TOKEN}", res
    assert res["resolve good.test"].startswith("err"), res
    assert res["resolve bad.test"].startswith("err"), res
    # Denied names: NXDOMAIN (3) or REFUSED (5) from the node's resolver, nothing else.
    assert res["dns bad.test"] in ("rcode:3", "rcode:5"), res
    assert_unreachable(res, bad)
    assert not {"good.test", "bad.test"} & set(inet.dns_seen()), inet.dns_seen()
    box.delete()
    assert_torn_down(node, box.id, st["host_if"])


@RUNTIMES
def test_allow_other_cidr_blocks_everything_else(node, client, inet, host_listener, runtime):
    """allow [10.97.0.0/24]: the "internet" host 10.98.K.2 (HTTP and its DNS port) is
    unreachable, as are metadata and the host; delete leaves nothing."""
    box = make_box(client, {"allow": ["10.97.0.0/24"]}, runtime)
    st = _attached(node, box)
    bad = [["http", f"http://{inet.ip}:{HTTP_PORT}/hello.txt"], ["tcp", f"{inet.ip}:53"]]
    bad += unreachable_checks(node, st["host_addr"], host_listener)
    res = probe(box, bad + [["resolve", "good.test"]])
    print(json.dumps(res, indent=1))
    assert_unreachable(res, bad)
    assert res["resolve good.test"].startswith("err"), res
    box.delete()
    assert_torn_down(node, box.id, st["host_if"])


@RUNTIMES
def test_allow_names_resolve_only_those(node, client, inet, host_listener, runtime):
    """allow [good.test, *.wild.test]: good.test and a.wild.test resolve to 10.98.K.2
    through the node's resolver and the test upstream, HTTP by name works; bad.test and
    wild.test-lookalikes are refused without reaching the upstream; the host stays
    unreachable; delete leaves nothing."""
    box = make_box(client, {"allow": ["good.test", "*.wild.test"]}, runtime)
    st = _attached(node, box)
    before = len(inet.dns_seen())
    ok = [["resolve", "good.test"], ["resolve", "a.wild.test"]]
    res = probe(box, ok + [["resolve", "bad.test"], ["resolve", "wild.test.evil.test"],
                           ["resolve", "x.bad.test"], ["dns", "good.test"],
                           ["dns", "x.bad.test"]])
    print(json.dumps(res, indent=1))
    for k, t in ok:
        assert res[f"{k} {t}"] == f"ok:{inet.ip}", res
    for name in ("bad.test", "wild.test.evil.test", "x.bad.test"):
        assert res[f"resolve {name}"].startswith("err"), res
    assert res["dns good.test"] == "rcode:0", res
    assert res["dns x.bad.test"] in ("rcode:3", "rcode:5"), res
    seen = inet.dns_seen()[before:]
    assert "good.test" in seen and "a.wild.test" in seen, seen
    assert not {"bad.test", "wild.test.evil.test", "x.bad.test"} & set(seen), seen
    # Resolved: now reachable by name (the answer was added to the sandbox's set).
    bad = unreachable_checks(node, st["host_addr"], host_listener)
    res = probe(box, [["http", f"http://good.test:{HTTP_PORT}/hello.txt"]] + bad)
    assert res[f"http http://good.test:{HTTP_PORT}/hello.txt"] == f"ok:{TOKEN}", res
    assert_unreachable(res, bad)
    box.delete()
    assert_torn_down(node, box.id, st["host_if"])


@pytest.mark.parametrize("runtime", ["runc", "function"])
def test_network_none_has_only_lo(node, client, inet, host_listener, runtime):
    """network "none": /proc/net/dev lists only `lo`; nothing outside is reachable and no
    name resolves; no veth, nft chain or net state is created for it."""
    veths_before = set(sh("ip", "-o", "link", "show", "type", "veth").stdout.split())
    box = make_box(client, "none", runtime)
    devs = box.exec("cat /proc/net/dev").stdout.decode().splitlines()[2:]
    assert [d.split(":")[0].strip() for d in devs] == ["lo"], devs
    assert not (node.data_dir / "net" / f"{box.id}.json").exists()
    bad = [["http", f"http://{inet.ip}:{HTTP_PORT}/hello.txt"], ["tcp", "169.254.169.254:80"]]
    bad += [["tcp", f"{a}:{host_listener}"] for a in host_addresses()]
    res = probe(box, bad + [["resolve", "good.test"]])
    assert_unreachable(res, bad)
    assert res["resolve good.test"].startswith("err"), res
    box.delete()
    wait_until(lambda: not (node.data_dir / "containers" / box.id).exists()
               and not (node.data_dir / "sandboxes" / box.id).exists(), 30,
               what=f"the sandbox dir of {box.id} to go")
    assert not server_mounts(node, box.id)
    new = set(sh("ip", "-o", "link", "show", "type", "veth").stdout.split()) - veths_before
    assert not [w for w in new if w.startswith("slv")], new


def test_zz_nothing_left(node, client):
    """After every sandbox of the module is deleted: no sandbox dir, no net state file, no
    mount in the server's namespace naming the data dir's containers, no cgroup or process
    of the node, no slv veth of this node's sandboxes, no chain of them in nft."""
    assert client.list() == []
    leaks = count_leaks(node.data_dir)
    # Processes are counted here, not by count_leaks: the function backend's warm-pool
    # jails live under DATA/warm-pool/<name> mounts that only the server's mount namespace
    # sees, so count_leaks cannot tell them apart. A container leftover is in the node's
    # `-ctr` cgroups or names DATA/containers or DATA/runtime on its command line.
    leaks.pop("processes")
    assert {k: v for k, v in leaks.items() if k != "veths" and v} == {}, leaks
    ctr_group = f"/{node_cgroup_parent(node.data_dir)}-ctr/"
    needles = [os.fsencode(str(node.data_dir / d)) for d in ("containers", "runtime")]
    left: List[tuple] = []

    def none_left() -> bool:
        left.clear()
        for p in Path("/proc").glob("[0-9]*"):
            try:
                grp = (p / "cgroup").read_text()
                status = (p / "status").read_text().splitlines()
            except OSError:
                continue
            cl = _cmdline(p)
            # Pooled containers (DATA/container-pool/cp-*) are the server's warm pool.
            if any(f"{ctr_group}{name}\n" in grp or f"{ctr_group}{name}/" in grp
                   for name in pooled_names(node.data_dir)):
                continue
            if ctr_group in grp or any(n in cl for n in needles):
                left.append((p.name, cl[:200], status[:3]))
        return not left

    # Polled: a deleted container's init can be a zombie for a moment until the host's
    # pid 1 reaps it (it is reparented there by `runc run --detach`).
    try:
        wait_until(none_left, 20, what="no container process of the node")
    except BaseException:
        print(f"left: {left}")
        raise
    net = node.data_dir / "net"
    assert not (net.is_dir() and [p for p in net.iterdir() if p.suffix == ".json"])
    assert not server_mounts(node, str(node.data_dir / "containers"))
