//! Root integration tests of network policies ([`sandlot_node::net`]) with real network
//! namespaces, veths, nftables and the filtering DNS resolver.
//!
//! Each test builds its own small "internet": a network namespace `inet-<tag>` joined to the
//! host by a veth, with three addresses on its `lo` (A allowed by CIDR, B never allowed, C
//! reachable only after its allowed name resolved) and a TCP listener on each; plus an
//! upstream DNS server on the host's loopback that answers a few names and records every
//! query it sees. Names (netns, veth prefix, nft table, address pool) are unique per test, so
//! the tests run in parallel (`--test-threads=2`). Without root, `ip` or `nft` a test prints
//! `SKIP <test>: <why>` and passes.
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use sandlot_api::AllowPolicy;
use sandlot_node::net::{create_netns, remove_netns, NetConfig, NetworkManager};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn skip(test: &str) -> bool {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("SKIP {test}: needs root (network namespaces, nftables)");
        return true;
    }
    if let Err(e) = sandlot_node::net::tools_available() {
        eprintln!("SKIP {test}: {e}");
        return true;
    }
    false
}

fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `f` on a fresh thread inside the network namespace at `ns` (setns(2)); sockets it
/// creates belong to that namespace.
async fn in_ns<T: Send + 'static>(ns: &Path, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_owned();
    tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || {
            let file = std::fs::File::open(&ns).unwrap();
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
        .join()
        .unwrap()
    })
    .await
    .unwrap()
}

/// Connects to `ip:port`, returns what the peer sends, or the error (1 s connect timeout).
fn tcp_get(ip: Ipv4Addr, port: u16) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::from((ip, port)), Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// One DNS query for the A records of `name` to `server` over UDP or TCP; the response code
/// and addresses, or `None` without an answer in 3 s.
fn dns_a(server: Ipv4Addr, name: &str, tcp: bool) -> Option<(ResponseCode, Vec<Ipv4Addr>)> {
    let mut m = Message::new();
    m.set_id(4242)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    let q = m.to_vec().unwrap();
    let raw = if tcp {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::from((server, 53)), Duration::from_secs(3))
                .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut framed = (q.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&q);
        s.write_all(&framed).ok()?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len).ok()?;
        let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
        s.read_exact(&mut buf).ok()?;
        buf
    } else {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        s.send_to(&q, (server, 53)).ok()?;
        let mut buf = vec![0u8; 4096];
        let n = s.recv(&mut buf).ok()?;
        buf.truncate(n);
        buf
    };
    let r = Message::from_vec(&raw).unwrap();
    assert_eq!(r.id(), 4242);
    let addrs = r
        .answers()
        .iter()
        .filter_map(|rec| match rec.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect();
    Some((r.response_code(), addrs))
}

/// TTLs of the A records in the UDP answer for `name`.
fn dns_ttls(server: Ipv4Addr, name: &str) -> Vec<u32> {
    let mut m = Message::new();
    m.set_id(7)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    s.send_to(&m.to_vec().unwrap(), (server, 53)).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.recv(&mut buf).unwrap();
    let r = Message::from_vec(&buf[..n]).unwrap();
    r.answers().iter().map(|rec| rec.ttl()).collect()
}

/// Elements of the sandbox's resolved-address set with their timeouts in seconds.
fn dns_set(table: &str, host_if: &str) -> BTreeMap<Ipv4Addr, u64> {
    let out = sh(&[
        "nft",
        "-j",
        "list",
        "set",
        "inet",
        table,
        &format!("{host_if}_dns"),
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut m = BTreeMap::new();
    for item in v["nftables"].as_array().unwrap() {
        for e in item["set"]["elem"].as_array().into_iter().flatten() {
            let ip = e["elem"]["val"].as_str().unwrap().parse().unwrap();
            m.insert(ip, e["elem"]["timeout"].as_u64().unwrap());
        }
    }
    m
}

/// Interface names in the namespace at `ns`.
fn links_in(ns: &Path) -> Vec<String> {
    let out = sh(&[
        "nsenter",
        &format!("--net={}", ns.display()),
        "ip",
        "-j",
        "link",
        "show",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut names: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["ifname"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

/// Host links whose name starts with `prefix`.
fn host_links(prefix: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&sh(&["ip", "-j", "link", "show"])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["ifname"].as_str())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

/// Names of chains, sets, maps and counters in `inet <table>`.
fn nft_objects(table: &str) -> Vec<String> {
    let out = sh(&["nft", "-j", "list", "table", "inet", table]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut names = Vec::new();
    for item in v["nftables"].as_array().unwrap() {
        for kind in ["chain", "set", "map", "counter"] {
            if let Some(n) = item[kind]["name"].as_str() {
                names.push(n.to_owned());
            }
        }
    }
    names.sort();
    names
}

/// The base objects every node table has.
const BASE_OBJECTS: [&str; 6] = [
    "forward",
    "fwd_vmap",
    "in_vmap",
    "input",
    "postrouting",
    "protected",
];

/// Sockets listening on `addr:53` (UDP or TCP) on the host.
fn dns_listeners(addr: Ipv4Addr) -> usize {
    let out = sh(&["ss", "-H", "-lnut"]);
    out.lines()
        .filter(|l| l.contains(&format!("{addr}:53 ")))
        .count()
}

/// The test's "internet" and node network manager.
struct World {
    tag: String,

    uplink: String,
    /// Allowed by CIDR.
    a: Ipv4Addr,
    /// Never allowed.
    b: Ipv4Addr,
    /// What `ok.<tag>.test` and `*.w.<tag>.test` resolve to.
    c: Ipv4Addr,
    /// A link-local address (inside the protected 169.254.0.0/16).
    d: Ipv4Addr,
    /// Host address on the uplink.
    host_uplink: Ipv4Addr,
    /// Names the upstream DNS server has seen (lowercase, with trailing dot).
    seen: Arc<Mutex<Vec<String>>>,
    /// Connections accepted per service address.
    accepted: Arc<Mutex<BTreeMap<Ipv4Addr, usize>>>,
    cfg: NetConfig,
    dir: tempfile::TempDir,
}

const PORT: u16 = 8080;

impl World {
    async fn new() -> World {
        let r: u32 = rand::random();
        let tag = format!("{:04x}", r & 0xffff);
        let (o2, o3) = (64 + (r >> 16) % 64, (r >> 22) % 256);
        let net = |last: u8| Ipv4Addr::new(100, o2 as u8, o3 as u8, last);
        let (host_uplink, inet_addr) = (net(1), net(2));
        let (a, b, c) = (net(10), net(11), net(12));
        // A link-local service (not the metadata address): reachable only when listed.
        let d = Ipv4Addr::new(169, 254, 100 + (r % 100) as u8, 1 + ((r >> 8) % 250) as u8);
        let inet = format!("inet-{tag}");
        let uplink = format!("tu{tag}");
        sh(&["ip", "netns", "add", &inet]);
        let inet_ns = PathBuf::from(format!("/run/netns/{inet}"));
        sh(&[
            "ip", "link", "add", &uplink, "type", "veth", "peer", "name", "eth0", "netns", &inet,
        ]);
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{host_uplink}/30"),
            "dev",
            &uplink,
        ]);
        sh(&["ip", "link", "set", &uplink, "up"]);
        for cmd in [
            format!("addr add {inet_addr}/30 dev eth0"),
            "link set eth0 up".into(),
            "link set lo up".into(),
            format!("addr add {a}/32 dev lo"),
            format!("addr add {b}/32 dev lo"),
            format!("addr add {c}/32 dev lo"),
            format!("addr add {d}/32 dev lo"),
        ] {
            let mut args = vec!["ip", "-n", &inet];
            args.extend(cmd.split(' '));
            sh(&args);
        }
        sh(&[
            "ip",
            "route",
            "add",
            &format!("{}/29", net(8)),
            "via",
            &inet_addr.to_string(),
        ]);
        sh(&[
            "ip",
            "route",
            "add",
            &format!("{d}/32"),
            "via",
            &inet_addr.to_string(),
        ]);

        // TCP listeners inside the internet: "hello from <ip>".
        let accepted = Arc::new(Mutex::new(BTreeMap::new()));
        for ip in [a, b, c, d] {
            let l = in_ns(&inet_ns, move || {
                std::net::TcpListener::bind((ip, PORT)).unwrap()
            })
            .await;
            l.set_nonblocking(true).unwrap();
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            let accepted = accepted.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                while let Ok((mut s, _)) = l.accept().await {
                    *accepted.lock().unwrap().entry(ip).or_insert(0) += 1;
                    let _ = s.write_all(format!("hello from {ip}\n").as_bytes()).await;
                }
            });
        }

        // Upstream DNS on the host's loopback.
        let seen = Arc::new(Mutex::new(Vec::new()));
        // One port for DNS over UDP and TCP: a free UDP port may be taken for TCP by
        // another process (CI: AddrInUse), so pick again until both bind.
        let (udp, tcp) = {
            let mut tries = 0;
            loop {
                let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
                match tokio::net::TcpListener::bind(udp.local_addr().unwrap()).await {
                    Ok(tcp) => break (udp, tcp),
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 20 => tries += 1,
                    Err(e) => panic!("bind the upstream DNS server: {e}"),
                }
            }
        };
        let upstream = udp.local_addr().unwrap();
        let zone: BTreeMap<String, (Ipv4Addr, u32)> = [
            (format!("ok.{tag}.test."), (c, 300)),
            (format!("x.w.{tag}.test."), (c, 300)),
            (format!("w.{tag}.test."), (c, 300)),
            (format!("long.{tag}.test."), (a, 86_400)),
            (format!("denied.{tag}.test."), (b, 300)),
            (format!("local.{tag}.test."), (Ipv4Addr::LOCALHOST, 300)),
        ]
        .into();
        let answer = {
            let seen = seen.clone();
            Arc::new(move |raw: &[u8]| -> Option<Vec<u8>> {
                let q = Message::from_vec(raw).ok()?;
                let query = q.queries()[0].clone();
                let name = query.name().to_ascii().to_lowercase();
                seen.lock().unwrap().push(name.clone());
                let mut r = Message::new();
                r.set_id(q.id())
                    .set_message_type(MessageType::Response)
                    .set_op_code(OpCode::Query)
                    .set_recursion_desired(q.recursion_desired())
                    .set_recursion_available(true)
                    .add_query(query.clone());
                match zone.get(&name) {
                    Some((ip, ttl)) if query.query_type() == RecordType::A => {
                        r.add_answer(Record::from_rdata(
                            query.name().clone(),
                            *ttl,
                            RData::A(A(*ip)),
                        ));
                    }
                    Some(_) => {}
                    None => {
                        r.set_response_code(ResponseCode::NXDomain);
                    }
                }
                r.to_vec().ok()
            })
        };
        let answer2 = answer.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok((n, peer)) = udp.recv_from(&mut buf).await {
                if let Some(r) = answer2(&buf[..n]) {
                    let _ = udp.send_to(&r, peer).await;
                }
            }
        });
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = tcp.accept().await {
                let answer = answer.clone();
                tokio::spawn(async move {
                    while let Ok(len) = s.read_u16().await {
                        let mut q = vec![0u8; len as usize];
                        if s.read_exact(&mut q).await.is_err() {
                            return;
                        }
                        let Some(r) = answer(&q) else { return };
                        let mut out = (r.len() as u16).to_be_bytes().to_vec();
                        out.extend_from_slice(&r);
                        if s.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });

        let dir = tempfile::tempdir().unwrap();
        let pool = format!("10.{}.{}.0/24", 201 + (r >> 8) % 50, r % 256);
        let cfg = NetConfig {
            pool: pool.parse().unwrap(),
            upstream,
            table: format!("sandlot_t{tag}"),
            veth_prefix: format!("t{tag}"),
            state_dir: dir.path().join("net"),
        };
        World {
            tag,

            uplink,
            a,
            b,
            c,
            d,
            host_uplink,
            seen,
            accepted,
            cfg,
            dir,
        }
    }

    fn policy(&self, entries: &[String]) -> AllowPolicy {
        serde_json::from_value(serde_json::json!({ "allow": entries })).unwrap()
    }

    fn netns_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.netns"))
    }

    fn seen_contains(&self, needle: &str) -> bool {
        self.seen.lock().unwrap().iter().any(|n| n.contains(needle))
    }

    fn accepted(&self, ip: Ipv4Addr) -> usize {
        self.accepted.lock().unwrap().get(&ip).copied().unwrap_or(0)
    }

    /// Leftovers of this test's node: host links with the prefix, per-sandbox nft objects,
    /// state files, netns files in the temp dir.
    fn leftovers(&self) -> (Vec<String>, Vec<String>, usize, usize) {
        let objs: Vec<String> = nft_objects(&self.cfg.table)
            .into_iter()
            .filter(|n| !BASE_OBJECTS.contains(&n.as_str()))
            .collect();
        let states = std::fs::read_dir(&self.cfg.state_dir)
            .map(|d| d.count())
            .unwrap_or(0);
        let netns = std::fs::read_dir(self.dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".netns")
            })
            .count();
        (host_links(&self.cfg.veth_prefix), objs, states, netns)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Best effort, also after a failed assertion.
        let _ = Command::new("ip")
            .args(["netns", "del", &format!("inet-{}", self.tag)])
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.uplink])
            .status();
        let _ = Command::new("ip")
            .args(["route", "del", &format!("{}/32", self.d)])
            .status();
        for l in host_links(&self.cfg.veth_prefix) {
            let _ = Command::new("ip").args(["link", "del", &l]).status();
        }
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.cfg.table])
            .status();
        if let Ok(d) = std::fs::read_dir(self.dir.path()) {
            for e in d.flatten() {
                if e.file_name().to_string_lossy().ends_with(".netns") {
                    let _ = remove_netns(&e.path());
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn allow_policy_filters_egress_dns_and_the_host() {
    if skip("allow_policy_filters_egress_dns_and_the_host") {
        return;
    }
    let w = World::new().await;
    let tag = w.tag.clone();
    let mgr = NetworkManager::new(w.cfg.clone()).await.unwrap();
    assert_eq!(mgr.sweep(&[]).await.unwrap(), Vec::<String>::new());
    let ns = w.netns_path("sb1");
    create_netns(&ns).unwrap();
    let policy = w.policy(&[
        format!("{}/32", w.a),
        format!("ok.{tag}.test"),
        format!("*.w.{tag}.test"),
        format!("local.{tag}.test"),
        format!("long.{tag}.test"),
        w.d.to_string(),
    ]);
    let att = mgr.attach("sb-net-1", &ns, &policy).await.unwrap();
    assert_eq!(links_in(&ns), vec!["eth0".to_string(), "lo".to_string()]);
    let res = att.resolver;
    assert_eq!(att.resolv_conf(), format!("nameserver {res}\n"));

    // Allowed CIDR reachable; other address blocked (and never reached).
    let (a, b, c) = (w.a, w.b, w.c);
    let got = in_ns(&ns, move || tcp_get(a, PORT)).await.unwrap();
    assert_eq!(got, format!("hello from {a}\n"));
    let blocked = in_ns(&ns, move || tcp_get(b, PORT)).await;
    assert!(blocked.is_err(), "B must be blocked: {blocked:?}");
    assert_eq!(w.accepted(b), 0);
    // A link-local address listed explicitly is reachable.
    let d = w.d;
    let got = in_ns(&ns, move || tcp_get(d, PORT)).await.unwrap();
    assert_eq!(got, format!("hello from {d}\n"));
    // C is not allowed before its name resolved.
    assert!(in_ns(&ns, move || tcp_get(c, PORT)).await.is_err());
    assert_eq!(w.accepted(c), 0);

    // Allowed name resolves (UDP) and its address becomes reachable.
    let name = format!("ok.{tag}.test");
    let r = in_ns(&ns, move || dns_a(res, &name, false)).await;
    assert_eq!(r, Some((ResponseCode::NoError, vec![c])));
    let got = in_ns(&ns, move || tcp_get(c, PORT)).await.unwrap();
    assert_eq!(got, format!("hello from {c}\n"));

    // Wildcard over TCP: a subdomain is allowed, the suffix itself is not.
    let name = format!("x.w.{tag}.test");
    let r = in_ns(&ns, move || dns_a(res, &name, true)).await;
    assert_eq!(r, Some((ResponseCode::NoError, vec![c])));
    let name = format!("w.{tag}.test");
    let r = in_ns(&ns, move || dns_a(res, &name, false)).await;
    assert_eq!(r, Some((ResponseCode::Refused, vec![])));
    assert!(
        !w.seen_contains(&format!(" w.{tag}"))
            && !w.seen.lock().unwrap().contains(&format!("w.{tag}.test."))
    );

    // Denied names: REFUSED, and the upstream never saw them (no exfiltration by lookup).
    for (name, tcp) in [
        (format!("denied.{tag}.test"), false),
        (format!("c2VjcmV0.exfil-{tag}.example"), false),
        (format!("c2VjcmV0.exfil-{tag}.example"), true),
    ] {
        let n = name.clone();
        let r = in_ns(&ns, move || dns_a(res, &n, tcp)).await;
        assert_eq!(r, Some((ResponseCode::Refused, vec![])), "{name}");
    }
    assert!(!w.seen_contains("denied."), "{:?}", w.seen.lock().unwrap());
    assert!(!w.seen_contains("exfil-"), "{:?}", w.seen.lock().unwrap());
    assert!(w.seen_contains(&format!("ok.{tag}.test.")));
    // TTLs: the set element lives as long as the answer's TTL (300 s); a TTL above the
    // node's maximum (1 h) is shortened in the answer and in the set.
    let name = format!("long.{tag}.test");
    let ttls = in_ns(&ns, move || dns_ttls(res, &name)).await;
    assert_eq!(ttls, vec![3600]);
    let timeouts = dns_set(&w.cfg.table, &att.host_if);
    assert_eq!(timeouts.get(&c), Some(&300), "{timeouts:?}");
    assert_eq!(timeouts.get(&w.a), Some(&3600), "{timeouts:?}");
    let stats = mgr.dns_stats("sb-net-1").unwrap();
    assert_eq!((stats.forwarded, stats.refused), (3, 4), "{stats:?}");
    // The refusals are kept for the audit (`violation` events, layer dns) and taken once.
    let refused = mgr.dns_refusals("sb-net-1", 0, u64::MAX);
    assert!(
        refused
            .iter()
            .any(|r| r.name == format!("c2VjcmV0.exfil-{tag}.example.") && r.qtype == "A"),
        "{refused:?}"
    );
    assert!(mgr.dns_refusals("sb-net-1", 0, u64::MAX).is_empty());

    // An allowed name that resolves to loopback does not open the host (no DNS rebinding).
    let name = format!("local.{tag}.test");
    let r = in_ns(&ns, move || dns_a(res, &name, false)).await;
    assert_eq!(r, Some((ResponseCode::NoError, vec![Ipv4Addr::LOCALHOST])));

    // The host: a service on all its addresses is unreachable through the gateway, the
    // uplink address and the host's main address; so is cloud metadata.
    let host_srv = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = host_srv.local_addr().unwrap().port();
    let route = sh(&["ip", "-j", "route", "get", "192.0.2.200"]);
    let main_src: Option<Ipv4Addr> = serde_json::from_str::<serde_json::Value>(&route)
        .ok()
        .and_then(|v| v[0]["prefsrc"].as_str().and_then(|s| s.parse().ok()));
    let mut host_addrs = vec![res, w.host_uplink];
    host_addrs.extend(main_src);
    let drops_before = mgr.drop_count("sb-net-1").await.unwrap();
    let since = now_ms();
    for ip in host_addrs {
        let r = in_ns(&ns, move || tcp_get(ip, port)).await;
        assert!(
            r.is_err(),
            "host address {ip}:{port} must be unreachable: {r:?}"
        );
    }
    let r = in_ns(&ns, move || tcp_get(Ipv4Addr::new(169, 254, 169, 254), 80)).await;
    assert!(r.is_err(), "metadata must be unreachable");
    let drops = mgr.drop_count("sb-net-1").await.unwrap();
    assert!(
        drops > drops_before,
        "drops are counted: {drops_before} -> {drops}"
    );
    // ... and reported one by one (NFLOG), with protocol and destination, exactly once.
    let v = mgr.violations("sb-net-1", since, now_ms());
    let net: Vec<_> = v.iter().filter(|v| v.layer == "network").collect();
    assert!(
        net.iter().any(|v| v.protocol.as_deref() == Some("tcp")
            && v.dst.as_deref() == Some("169.254.169.254:80")),
        "the metadata connect is a network violation: {v:?}"
    );
    assert!(
        net.iter()
            .any(|v| v.dst.as_deref() == Some(&format!("{res}:{port}"))),
        "the connect to the host through the gateway is one too: {v:?}"
    );
    assert!(mgr
        .violations("sb-net-1", since, now_ms())
        .iter()
        .all(|v| v.layer != "network"));
    drop(host_srv);

    // Teardown leaves nothing: no veth, no per-sandbox nft object, no state, no netns
    // file, no resolver socket.
    assert_eq!(dns_listeners(res), 2);
    mgr.teardown("sb-net-1").await.unwrap();
    mgr.teardown("sb-net-1").await.unwrap(); // idempotent
    assert_eq!(w.leftovers(), (vec![], vec![], 0, 0));
    assert_eq!(dns_listeners(res), 0);
    assert!(mgr.attached().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn none_policy_namespace_has_only_lo() {
    if skip("none_policy_namespace_has_only_lo") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ns = dir.path().join("none.netns");
    create_netns(&ns).unwrap();
    assert!(create_netns(&ns).is_err(), "an existing file is refused");
    assert_eq!(links_in(&ns), vec!["lo".to_string()]);
    // Nothing reachable at all, not even the host.
    let r = in_ns(&ns, || tcp_get(Ipv4Addr::new(192, 0, 2, 1), 80)).await;
    assert!(r.is_err());
    remove_netns(&ns).unwrap();
    remove_netns(&ns).unwrap();
    assert!(!ns.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sandboxes_are_isolated_and_sweep_readopts_after_a_crash() {
    if skip("sandboxes_are_isolated_and_sweep_readopts_after_a_crash") {
        return;
    }
    let w = World::new().await;
    let tag = w.tag.clone();
    let mgr = NetworkManager::new(w.cfg.clone()).await.unwrap();
    mgr.sweep(&[]).await.unwrap();
    let (ns1, ns2) = (w.netns_path("s1"), w.netns_path("s2"));
    create_netns(&ns1).unwrap();
    create_netns(&ns2).unwrap();
    // s1 allows "everything": still not the other sandbox nor the host.
    let p1 = w.policy(&["0.0.0.0/0".into(), format!("ok.{tag}.test")]);
    let p2 = w.policy(&[w.a.to_string()]);
    let s1 = mgr.attach("sb-s1", &ns1, &p1).await.unwrap();
    let s2 = mgr.attach("sb-s2", &ns2, &p2).await.unwrap();
    assert!(
        mgr.attach("sb-s2", &ns2, &p2).await.is_err(),
        "attached twice"
    );
    assert_ne!(s1.sandbox_addr, s2.sandbox_addr);
    let s2_addr = s2.sandbox_addr;
    let l2 = in_ns(&ns2, move || {
        std::net::TcpListener::bind((s2_addr, 9000)).unwrap()
    })
    .await;
    l2.set_nonblocking(true).unwrap();
    let (a, b) = (w.a, w.b);
    assert!(in_ns(&ns1, move || tcp_get(a, PORT)).await.is_ok());
    assert!(
        in_ns(&ns1, move || tcp_get(b, PORT)).await.is_ok(),
        "0.0.0.0/0 allows B"
    );
    let r = in_ns(&ns1, move || tcp_get(s2_addr, 9000)).await;
    assert!(r.is_err(), "other sandbox reachable: {r:?}");
    assert!(l2.accept().is_err(), "s2 saw no connection");
    let gw = s1.resolver;
    assert!(in_ns(&ns1, move || tcp_get(gw, 22)).await.is_err());
    let r = in_ns(&ns1, move || tcp_get(Ipv4Addr::new(169, 254, 169, 254), 80)).await;
    assert!(r.is_err(), "0.0.0.0/0 does not open metadata");
    let d = w.d;
    let r = in_ns(&ns1, move || tcp_get(d, PORT)).await;
    assert!(r.is_err(), "0.0.0.0/0 does not open link-local: {r:?}");
    assert_eq!(w.accepted(d), 0);

    // A stray veth with the prefix (a half-created leftover).
    let stray = format!("{}zzzzzzzzzz", w.cfg.veth_prefix);
    let stray_peer = format!("{}yyyyyyyyyy", w.cfg.veth_prefix);
    sh(&[
        "ip",
        "link",
        "add",
        &stray,
        "type",
        "veth",
        "peer",
        "name",
        &stray_peer,
    ]);

    // "kill -9": the manager goes away without teardown; resolvers die with it.
    drop(mgr);
    let name = format!("ok.{tag}.test");
    let n = name.clone();
    let r = in_ns(&ns1, move || dns_a(gw, &n, false)).await;
    assert_eq!(r, None, "resolver is gone with the node");

    // Restart: keep s1 only.
    let mgr = NetworkManager::new(w.cfg.clone()).await.unwrap();
    let adopted = mgr.sweep(&["sb-s1".to_string()]).await.unwrap();
    assert_eq!(adopted, vec!["sb-s1".to_string()]);
    assert_eq!(host_links(&w.cfg.veth_prefix), vec![mgr.host_if("sb-s1")]);
    assert!(!ns2.exists(), "s2's netns file removed by the sweep");
    let n = name.clone();
    let r = in_ns(&ns1, move || dns_a(gw, &n, false)).await;
    assert_eq!(
        r,
        Some((ResponseCode::NoError, vec![w.c])),
        "resolver re-created"
    );
    assert!(
        in_ns(&ns1, move || tcp_get(a, PORT)).await.is_ok(),
        "network kept working"
    );
    // A new sandbox does not get s1's (re-adopted) address.
    let ns3 = w.netns_path("s3");
    create_netns(&ns3).unwrap();
    let s3 = mgr.attach("sb-s3", &ns3, &p2).await.unwrap();
    assert_ne!(s3.sandbox_addr, s1.sandbox_addr);

    mgr.teardown("sb-s1").await.unwrap();
    mgr.teardown("sb-s3").await.unwrap();
    assert_eq!(w.leftovers(), (vec![], vec![], 0, 0));

    // A delete that arrives while the attach runs waits for it, then removes everything.
    let ns4 = w.netns_path("s4");
    create_netns(&ns4).unwrap();
    let (attached, torn) = tokio::join!(mgr.attach("sb-s4", &ns4, &p2), async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        mgr.teardown("sb-s4").await
    });
    attached.unwrap();
    torn.unwrap();
    assert!(mgr.attached().is_empty());
    assert_eq!(w.leftovers(), (vec![], vec![], 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_pool_answers_resource_exhausted_and_frees_on_teardown() {
    if skip("a_full_pool_answers_resource_exhausted_and_frees_on_teardown") {
        return;
    }
    let r: u32 = rand::random();
    let tag = format!("{:04x}", r & 0xffff);
    let dir = tempfile::tempdir().unwrap();
    let cfg = NetConfig {
        // A /29: two /30 slots.
        pool: format!(
            "10.{}.{}.{}/29",
            201 + (r >> 8) % 50,
            r % 256,
            8 * ((r >> 16) % 32)
        )
        .parse()
        .unwrap(),
        upstream: "127.0.0.1:53".parse().unwrap(),
        table: format!("sandlot_p{tag}"),
        veth_prefix: format!("p{tag}"),
        state_dir: dir.path().join("net"),
    };
    let mgr = NetworkManager::new(cfg.clone()).await.unwrap();
    let policy: AllowPolicy =
        serde_json::from_value(serde_json::json!({"allow": ["192.0.2.0/24"]})).unwrap();
    let mut addrs = Vec::new();
    for i in 0..3 {
        let ns = dir.path().join(format!("{i}.netns"));
        create_netns(&ns).unwrap();
        let r = mgr.attach(&format!("sb-p{i}"), &ns, &policy).await;
        if i < 2 {
            addrs.push(r.unwrap().sandbox_addr);
        } else {
            let e = r.unwrap_err();
            assert_eq!(e.code(), sandlot_api::ErrorCode::ResourceExhausted, "{e}");
            assert!(e.to_string().contains("is full"), "{e}");
            remove_netns(&ns).unwrap();
        }
    }
    assert_ne!(addrs[0], addrs[1]);
    mgr.teardown("sb-p0").await.unwrap();
    let ns = dir.path().join("again.netns");
    create_netns(&ns).unwrap();
    let again = mgr.attach("sb-p3", &ns, &policy).await.unwrap();
    assert_eq!(again.sandbox_addr, addrs[0], "the freed slot is reused");
    mgr.teardown("sb-p1").await.unwrap();
    mgr.teardown("sb-p3").await.unwrap();
    assert!(host_links(&cfg.veth_prefix).is_empty());
    let objs: Vec<String> = nft_objects(&cfg.table)
        .into_iter()
        .filter(|n| !BASE_OBJECTS.contains(&n.as_str()))
        .collect();
    assert!(objs.is_empty(), "{objs:?}");
    assert_eq!(std::fs::read_dir(&cfg.state_dir).unwrap().count(), 0);
    let netns_left = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "netns")
        })
        .count();
    assert_eq!(netns_left, 0);
    sh(&["nft", "delete", "table", "inet", &cfg.table]);
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}
