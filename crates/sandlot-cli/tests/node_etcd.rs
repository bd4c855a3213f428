//! `sandlot node --etcd` against a real etcd member started by `scripts/etcd.sh` into a
//! temp dir: the node registers its record (advertise URL, capacity, backends); its usage
//! follows a create made through `RemoteNode`; with the etcd member paused (SIGSTOP) longer
//! than the lease TTL the node refuses calls with `unavailable` before the TTL has passed
//! (fenced), and after the member resumes it serves again under a new lease (higher
//! epoch) with the earlier `function` sandbox still there; SIGTERM deletes its key. TTL 3 s
//! (`SANDLOT_TEST_LEASE_TTL_S` changes it).
//!
//! Without `etcd` on PATH the test prints "SKIPPED: ..." and returns (scripts/setup.sh
//! installs Debian's etcd-server). The sandbox part needs what `tests/node.rs` needs (root,
//! cgroups, `sandlot-guest`); without it that part prints "SKIPPED: ..." too.
use sandlot_api::{Backend, Cmd, ExecRequest, NetworkPolicy};
use sandlot_cluster::{Client, NodeRecord};
use sandlot_node_api::{Node, NodeError, SandboxSpec};
use sandlot_node_remote::RemoteNode;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::{cannot_run, Proc, BIN};
/// Lease TTL of the node under test: 3 s, or `SANDLOT_TEST_LEASE_TTL_S` (to measure the
/// fence at other TTLs, e.g. the default 5).
fn ttl_s() -> u64 {
    std::env::var("SANDLOT_TEST_LEASE_TTL_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}
const TOKEN: &str = "etcd-n0de-t0ken";
const NAME: &str = "etcd-node-1";

use sandlot_cluster::testing::LocalEtcd as Etcd;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The node's record in etcd and the lease it is under, if the key exists.
async fn read_record(client: &Client) -> Option<(NodeRecord, i64)> {
    let key = sandlot_cluster::node_key(NAME).unwrap();
    let resp = client.kv_client().get(key, None).await.expect("etcd get");
    resp.kvs()
        .first()
        .map(|kv| (serde_json::from_slice(kv.value()).unwrap(), kv.lease()))
}

/// `GET /v1/health` over HTTP/1.1: the status and the JSON body.
async fn health(addr: &str) -> (u16, serde_json::Value) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "GET /v1/health HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(body).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandlot_node_registers_fences_and_comes_back() {
    let Some(etcd) = Etcd::start("sandlot node --etcd", 1) else {
        return;
    };
    let ttl = ttl_s();
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    let why_not = cannot_run(&images);
    let token_file = tmp.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let data = tmp.path().join("data");
    let addr = format!("127.0.0.1:{}", free_port());
    let url = format!("http://{addr}");

    let mut child = Command::new(BIN)
        .args([
            "node",
            "--name",
            NAME,
            "--listen",
            &addr,
            "--advertise",
            &url,
        ])
        .args(["--etcd", &etcd.urls[0], "--lease-ttl-s", &ttl.to_string()])
        .args([
            "--max-sandboxes",
            "64",
            "--cpu-overcommit",
            "1.5",
            "--warm-pool",
            "0",
        ])
        .args(["--container-warm-pool", "0", "--run-code-pool-images", ""])
        .arg("--data-dir")
        .arg(&data)
        .arg("--images-dir")
        .arg(&images)
        .arg("--token-file")
        .arg(&token_file)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut proc = Proc(child, data.clone());
    let line = tokio::task::spawn_blocking(move || {
        let mut l = String::new();
        BufReader::new(stdout).read_line(&mut l).unwrap();
        l
    })
    .await
    .unwrap();
    assert_eq!(line.trim(), format!("sandlot node listening on {url}"));

    // Registered before it says it listens: the record is there with what the host has.
    let client = sandlot_cluster::connect(&etcd.urls[..1]).await.unwrap();
    let (rec, lease1) = read_record(&client).await.expect("node key after start");
    assert_eq!(rec.name, NAME);
    assert_eq!(rec.advertise_url, url);
    let cpus = std::thread::available_parallelism().unwrap().get() as f64;
    assert_eq!((rec.capacity.cpu, rec.capacity.sandboxes), (cpus * 1.5, 64));
    assert!(rec.capacity.memory_mib > 0, "{rec:?}");
    assert_eq!(rec.usage.sandboxes, 0, "{rec:?}");
    assert!(!rec.started_at.is_empty(), "{rec:?}");
    assert_ne!(lease1, 0);
    let (status, h) = health(&addr).await;
    assert_eq!(status, 200, "{h}");
    assert_eq!(
        (
            h["serving"].as_bool(),
            h["epoch"].as_u64(),
            h["lease_id"].as_i64()
        ),
        (Some(true), Some(1), Some(lease1))
    );

    let node = RemoteNode::connect(&url, Some(TOKEN.into())).await.unwrap();
    let id = "sb-e7cd00000000000000e1";
    let run_sandbox = why_not.is_none();
    match &why_not {
        Some(why) => {
            println!("SKIPPED: sandbox create, usage and survival through the fence: {why}")
        }
        None => {
            assert!(rec.backends.contains(&Backend::Function), "{rec:?}");
            assert!(rec.cached_images.iter().any(|i| i == "busybox"), "{rec:?}");
            let spec = SandboxSpec {
                id: id.into(),
                backend: Backend::Function,
                image: "busybox".into(),
                cpu: 1.0,
                memory_mib: 256,
                disk_mib: 64,
                pids_max: 128,
                env: Default::default(),
                network: NetworkPolicy::None,
                runtime: None,
            };
            node.create(&spec).await.expect("create through the node");
            // The usage follows within a few update periods (1 s each).
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let (r, _) = read_record(&client).await.unwrap();
                if (r.usage.sandboxes, r.usage.cpu, r.usage.memory_mib) == (1, 1.0, 256) {
                    break;
                }
                assert!(Instant::now() < deadline, "usage not updated: {r:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    // Pause the only etcd member (a hung/partitioned etcd) for longer than the TTL: the
    // node must refuse calls before the TTL has passed since the pause.
    etcd.member("pause-member", 0);
    let paused = Instant::now();
    let fenced_after = loop {
        match node.list().await {
            Ok(_) => {}
            Err(NodeError::Unavailable(m)) => {
                assert!(m.contains("fenced"), "{m}");
                break paused.elapsed();
            }
            Err(e) => panic!("while etcd is paused: {e:?}"),
        }
        assert!(
            paused.elapsed() < Duration::from_secs(ttl),
            "node still serving {ttl} s (the TTL) after etcd stopped answering"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!(
        "MEASURED: fenced {fenced_after:?} after the etcd member was paused (lease TTL {ttl} s)"
    );
    assert!(fenced_after < Duration::from_secs(ttl));
    let (status, h) = health(&addr).await;
    assert_eq!((status, h["serving"].as_bool()), (503, Some(false)), "{h}");
    if run_sandbox {
        let r = node
            .exec(id, &ExecRequest::new(Cmd::Shell("true".into())), None)
            .await;
        assert!(matches!(r, Err(NodeError::Unavailable(_))), "{r:?}");
    }
    // Still fenced past the TTL.
    tokio::time::sleep(Duration::from_secs(ttl + 1).saturating_sub(paused.elapsed())).await;
    assert!(matches!(node.list().await, Err(NodeError::Unavailable(_))));

    etcd.member("resume-member", 0);
    let resumed = Instant::now();
    let deadline = resumed + Duration::from_secs(20);
    while node.list().await.is_err() {
        assert!(
            Instant::now() < deadline,
            "node not serving 20 s after etcd resumed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "MEASURED: serving again {:?} after the etcd member resumed",
        resumed.elapsed()
    );
    let (status, h) = health(&addr).await;
    assert_eq!(status, 200, "{h}");
    assert_eq!(h["epoch"].as_u64(), Some(2), "{h}");
    let (rec, lease2) = read_record(&client).await.expect("node key after rejoin");
    assert_ne!(lease2, lease1);
    assert_eq!(h["lease_id"].as_i64(), Some(lease2));
    assert_eq!(rec.advertise_url, url);

    if run_sandbox {
        // The function sandbox lived through the fence.
        assert_eq!(rec.usage.sandboxes, 1, "{rec:?}");
        let mut req = ExecRequest::new(Cmd::Argv(vec!["echo".into(), "still here".into()]));
        req.timeout_s = Some(30.0);
        let r = node.exec(id, &req, None).await;
        let del = node.delete(id).await;
        assert_eq!(r.expect("exec after the rejoin").stdout, "still here\n");
        del.expect("delete");
    }

    // SIGTERM: the node deletes its key before it exits.
    let status = proc.term();
    assert!(status.success(), "{status:?}");
    assert!(
        read_record(&client).await.is_none(),
        "key left after SIGTERM"
    );
}

/// Bad cluster flags fail at start, before anything listens (no etcd needed).
#[test]
fn bad_cluster_flags_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let token_file = tmp.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let run = |extra: &[&str]| {
        Command::new(BIN)
            .args(["node", "--listen", "127.0.0.1:0", "--warm-pool", "0"])
            .args(["--container-warm-pool", "0", "--run-code-pool-images", ""])
            .arg("--data-dir")
            .arg(tmp.path().join("data"))
            .arg("--token-file")
            .arg(&token_file)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--etcd", "http://127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(2), "no --advertise: {out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--advertise"));
    for (extra, says) in [
        (&["--lease-ttl-s", "1"][..], "lease ttl"),
        (&["--cpu-overcommit", "0"][..], "--cpu-overcommit"),
        (&["--advertise", "https://x:1"][..], "not http://"),
        (
            &["--advertise", "http://x:1", "--name", "a/b"][..],
            "--name",
        ),
    ] {
        let mut args = vec!["--etcd", "http://127.0.0.1:1"];
        if !extra.contains(&"--advertise") {
            args.extend(["--advertise", "http://127.0.0.1:2"]);
        }
        args.extend(extra);
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(out.stdout.is_empty(), "{extra:?} listened");
    }
}
