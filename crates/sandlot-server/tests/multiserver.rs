//! Several API servers on one PostgreSQL database and one etcd (issue 21 items 3 and 4):
//! transition owners, the singleton election, quotas across servers.
//!
//! Real PostgreSQL (`scripts/postgres.sh`, or `SANDLOT_TEST_POSTGRES_URL`) and real etcd
//! (`scripts/etcd.sh`). Each server runs on its own tokio runtime in its own thread, with its
//! own etcd client and connection pool, so "kill -9" is that runtime shut down at once
//! (no resign, no cleanup: its election lease and transition deadlines lapse). The node is
//! an in-process node API server over the unit-test `FakeNode` (as in `tests/cluster.rs`).
//! Without etcd or PostgreSQL a test prints "SKIPPED: ..." and returns.
use sandlot_cluster::{connect, LeaseConfig, NodeRecord, NodeRegistration, Resources};
use sandlot_node_fake::FakeNode;
use sandlot_node_remote::RemoteOptions;
use sandlot_server::cluster::ClusterNode;
use serde_json::{json, Value};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandlot_cluster::testing::LocalEtcd as Etcd;

const TOKEN: &str = "multiserver-test-token";

/// A PostgreSQL server for one test: started by `scripts/postgres.sh` in a temp dir and
/// stopped on drop, or the one of `SANDLOT_TEST_POSTGRES_URL`; a fresh database in it.
struct Pg {
    dir: Option<tempfile::TempDir>,
    url: String,
}

fn pg_script() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/postgres.sh").to_owned()
}

impl Pg {
    async fn start(test: &str) -> Option<Pg> {
        let (dir, server) = match std::env::var("SANDLOT_TEST_POSTGRES_URL") {
            Ok(u) => (None, u),
            Err(_) => {
                let dir = tempfile::Builder::new()
                    .prefix("sandlot-pg-ms-")
                    .tempdir()
                    .unwrap();
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port();
                let out = Command::new("bash")
                    .arg(pg_script())
                    .arg("start")
                    .arg(dir.path())
                    .arg(port.to_string())
                    .output()
                    .unwrap();
                if !out.status.success() {
                    println!(
                        "SKIPPED: {test}: no PostgreSQL (scripts/postgres.sh: {})",
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                    return None;
                }
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let url = text
                    .lines()
                    .find_map(|l| l.strip_prefix("postgres "))
                    .expect("postgres.sh prints a URL")
                    .to_owned();
                (Some(dir), url)
            }
        };
        let name = format!("t_{:016x}", rand::random::<u64>());
        let (client, conn) = tokio_postgres::connect(&server, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let base = server.split('?').next().unwrap();
        let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
        Some(Pg {
            dir,
            url: format!("{base}/{name}"),
        })
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        if let Some(d) = &self.dir {
            let _ = Command::new("bash")
                .arg(pg_script())
                .arg("stop")
                .arg(d.path())
                .output();
        }
    }
}

/// An in-process node: a `FakeNode` behind the node API, registered in etcd.
async fn start_node(etcd: &sandlot_cluster::Client) -> (Arc<FakeNode>, NodeRegistration) {
    let fake = Arc::new(FakeNode::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = sandlot_node_remote::router(fake.clone(), Some(TOKEN.into()));
    tokio::spawn(sandlot_node_remote::serve(listener, app));
    let rec = NodeRecord {
        name: "n1".into(),
        advertise_url: url,
        capacity: Resources {
            cpu: 64.0,
            memory_mib: 1 << 20,
            sandboxes: 1000,
        },
        backends: vec![sandlot_api::Backend::Function],
        runtimes: vec!["runc".into()],
        started_at: "2026-12-04T10:00:00Z".into(),
        ..Default::default()
    };
    let reg = NodeRegistration::register(etcd, rec, LeaseConfig::new(3).unwrap())
        .await
        .unwrap();
    (fake, reg)
}

/// One etcd member, a PostgreSQL and one node registered in etcd ([`start_node`]), or
/// `None` (the reason printed; the test counts as skipped) when etcd or PostgreSQL is
/// missing.
async fn start_cluster(test: &str) -> Option<(Etcd, Pg, Arc<FakeNode>, NodeRegistration)> {
    let etcd = Etcd::start(test, 1)?;
    let pg = Pg::start(test).await?;
    let client = connect(&etcd.urls).await.unwrap();
    let (fake, reg) = start_node(&client).await;
    Some((etcd, pg, fake, reg))
}

/// A server on its own runtime and thread (see the module docs).
struct TestServer {
    base: String,
    kill: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    fn start(pg: &str, etcd: &[String], name: &str) -> TestServer {
        let (pg, etcd, name) = (pg.to_owned(), etcd.to_vec(), name.to_owned());
        let (base_tx, base_rx) = std::sync::mpsc::channel();
        let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let client = connect(&etcd).await.unwrap();
                let dir = tempfile::tempdir().unwrap().keep();
                let mut cfg = sandlot_server::ServerConfig::new(dir);
                cfg.listen = "127.0.0.1:0".parse().unwrap();
                cfg.disk_reserve_bytes = 0;
                cfg.postgres_url = Some(pg);
                cfg.server_id = name;
                cfg.transition_ttl = Duration::from_secs(2);
                cfg.election = Some(sandlot_server::leader::ElectionConfig {
                    client: client.clone(),
                    lease: LeaseConfig::new(2).unwrap(),
                });
                let cluster =
                    ClusterNode::start(&client, Some(TOKEN.into()), RemoteOptions::default())
                        .await
                        .unwrap();
                let server = sandlot_server::Server::bind_cluster(cfg, cluster)
                    .await
                    .unwrap();
                base_tx
                    .send(format!("http://{}", server.local_addr().unwrap()))
                    .unwrap();
                tokio::spawn(server.run(std::future::pending()));
            });
            let _ = kill_rx.recv();
            // kill -9: every task of this server stops where it is.
            rt.shutdown_background();
        });
        let base = base_rx.recv().expect("server started");
        TestServer {
            base,
            kill: Some(kill_tx),
            thread: Some(thread),
        }
    }

    fn kill(&mut self) {
        self.kill.take();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn call(
    http: &reqwest::Client,
    base: &str,
    method: reqwest::Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut rb = http.request(method, format!("{base}{path}"));
    if let Some(k) = key {
        rb = rb.bearer_auth(k);
    }
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let resp = rb.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn is_leader(http: &reqwest::Client, base: &str) -> bool {
    let (s, h) = call(http, base, reqwest::Method::GET, "/healthz", None, None).await;
    assert_eq!(s, 200, "{h}");
    h["leader"] == true
}

async fn eventually(what: &str, within: Duration, mut f: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within {within:?}");
}

/// A creates, B execs and deletes; kill -9 of the leader A mid-create: B leads within the
/// election TTL, a TTL still expires, and the create A left half-done is rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_servers_share_a_database_and_the_leader_fails_over() {
    let test = "two_servers_share_a_database_and_the_leader_fails_over";
    let Some((etcd, pg, fake, _reg)) = start_cluster(test).await else {
        return;
    };
    let mut a = TestServer::start(&pg.url, &etcd.urls, "server-a");
    let http = reqwest::Client::new();
    eventually("A leads", Duration::from_secs(10), async || {
        is_leader(&http, &a.base).await
    })
    .await;
    let b = TestServer::start(&pg.url, &etcd.urls, "server-b");
    assert!(!is_leader(&http, &b.base).await, "two leaders");
    let (_, ha) = call(&http, &a.base, reqwest::Method::GET, "/healthz", None, None).await;
    assert_eq!(ha["server_id"], "server-a");

    // A creates, B execs and deletes.
    let post = reqwest::Method::POST;
    let (s, sb) = call(
        &http,
        &a.base,
        post.clone(),
        "/v1/sandboxes",
        None,
        Some(json!({"backend": "function"})),
    )
    .await;
    assert_eq!(s, 201, "{sb}");
    let id = sb["id"].as_str().unwrap().to_owned();
    let (s, out) = call(
        &http,
        &b.base,
        post.clone(),
        &format!("/v1/sandboxes/{id}/exec"),
        None,
        Some(json!({"cmd": ["echo", "hi"]})),
    )
    .await;
    assert_eq!(s, 200, "{out}");
    assert_eq!(out["exit_code"], 0, "{out}");
    let del = reqwest::Method::DELETE;
    let (s, _) = call(
        &http,
        &b.base,
        del,
        &format!("/v1/sandboxes/{id}"),
        None,
        None,
    )
    .await;
    assert_eq!(s, 204);
    let (s, _) = call(
        &http,
        &a.base,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}"),
        None,
        None,
    )
    .await;
    assert_eq!(s, 404);
    assert!(!fake.ids().contains(&id));

    // A sandbox whose TTL runs out after A is gone.
    let (s, sb) = call(
        &http,
        &a.base,
        post.clone(),
        "/v1/sandboxes",
        None,
        Some(json!({"backend": "function", "ttl_s": 6})),
    )
    .await;
    assert_eq!(s, 201, "{sb}");
    let ttl_id = sb["id"].as_str().unwrap().to_owned();

    // A create through A that is still on the node when A dies.
    *fake.create_delay.lock().unwrap() = Duration::from_secs(2);
    let (http2, a_base) = (http.clone(), a.base.clone());
    let cut = tokio::spawn(async move {
        let _ = http2
            .post(format!("{a_base}/v1/sandboxes"))
            .json(&json!({"backend": "function", "labels": {"half": "yes"}}))
            .send()
            .await;
    });
    let half = async || {
        let (_, l) = call(
            &http,
            &b.base,
            reqwest::Method::GET,
            "/v1/sandboxes?label=half=yes",
            None,
            None,
        )
        .await;
        l["sandboxes"].as_array().unwrap().clone()
    };
    eventually(
        "the create is recorded",
        Duration::from_secs(5),
        async || !half().await.is_empty(),
    )
    .await;
    assert_eq!(half().await[0]["state"], "creating");
    let killed = Instant::now();
    a.kill();
    let _ = cut.await;
    *fake.create_delay.lock().unwrap() = Duration::ZERO;

    // B takes over within the election TTL (2 s) plus slack for the campaign.
    eventually("B leads", Duration::from_secs(6), async || {
        is_leader(&http, &b.base).await
    })
    .await;
    println!("B leads {:?} after A was killed", killed.elapsed());
    // The TTL still expires (B's reaper).
    eventually("TTL reaped by B", Duration::from_secs(15), async || {
        let (s, _) = call(
            &http,
            &b.base,
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{ttl_id}"),
            None,
            None,
        )
        .await;
        s == 404
    })
    .await;
    assert!(!fake.ids().contains(&ttl_id));
    // The half-done create is rolled back: no record, nothing on the node.
    eventually(
        "stale create rolled back",
        Duration::from_secs(15),
        async || half().await.is_empty(),
    )
    .await;
    eventually(
        "nothing left on the node",
        Duration::from_secs(5),
        async || fake.ids().is_empty(),
    )
    .await;
}

/// A tenant with a quota of 1 sandbox, 20 creates through each of two servers at once:
/// exactly one admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quota_holds_across_two_servers() {
    let test = "quota_holds_across_two_servers";
    let Some((etcd, pg, fake, _reg)) = start_cluster(test).await else {
        return;
    };
    // The key, written before the servers start (they then require authentication).
    let pool = sandlot_server::pg::connect(&pg.url, 2).await.unwrap();
    let reg = sandlot_server::registry::PgRegistry::new(pool);
    let quota = sandlot_server::store::Quota {
        max_sandboxes: Some(1),
        ..Default::default()
    };
    let (_, key) = sandlot_server::auth::create_key(&reg, "tenant-1", false, quota)
        .await
        .unwrap();
    let a = TestServer::start(&pg.url, &etcd.urls, "server-a");
    let b = TestServer::start(&pg.url, &etcd.urls, "server-b");
    let http = reqwest::Client::new();
    let mut calls = Vec::new();
    for i in 0..40 {
        let base = if i % 2 == 0 { &a.base } else { &b.base }.clone();
        let (http, key) = (http.clone(), key.clone());
        calls.push(tokio::spawn(async move {
            call(
                &http,
                &base,
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(&key),
                Some(json!({"backend": "function"})),
            )
            .await
        }));
    }
    let mut admitted = 0;
    for c in calls {
        let (s, b) = c.await.unwrap();
        match s {
            201 => admitted += 1,
            429 => assert_eq!(b["error"]["code"], "resource_exhausted", "{b}"),
            _ => panic!("{s} {b}"),
        }
    }
    assert_eq!(admitted, 1);
    assert_eq!(fake.ids().len(), 1);
}
