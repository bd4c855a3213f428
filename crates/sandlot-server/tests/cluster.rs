//! Cluster mode end to end: one `sandlot server` (HTTP API over a real socket) in front of
//! three nodes registered in a real etcd (started by `scripts/etcd.sh` into a temp dir).
//! Each node is an in-process node API server (`sandlot_node_remote::serve`) over the
//! unit-test `FakeNode` (no root, no images; the placement, routing, lost-node sweep and
//! reconcile under test are the real ones, as are etcd, HTTP/2 and the store).
//! Without `etcd` on PATH the test prints "SKIPPED: ..." and returns.
use sandlot_cluster::{connect, LeaseConfig, NodeRecord, NodeRegistration, Resources};
use sandlot_node_fake::FakeNode;
use sandlot_node_remote::RemoteOptions;
use sandlot_server::cluster::ClusterNode;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "cluster-test-token";

use sandlot_cluster::testing::LocalEtcd as Etcd;

/// An in-process node: a `FakeNode` behind the node API on 127.0.0.1.
struct TestNode {
    name: String,
    fake: Arc<FakeNode>,
    url: String,
}

async fn start_node(name: &str) -> TestNode {
    let fake = Arc::new(FakeNode::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = sandlot_node_remote::router(fake.clone(), Some(TOKEN.into()));
    tokio::spawn(sandlot_node_remote::serve(listener, app));
    TestNode {
        name: name.into(),
        fake,
        url,
    }
}

fn record(n: &TestNode, started_at: &str) -> NodeRecord {
    NodeRecord {
        name: n.name.clone(),
        advertise_url: n.url.clone(),
        capacity: Resources {
            cpu: 64.0,
            memory_mib: 1 << 20,
            sandboxes: 1000,
        },
        backends: vec![sandlot_api::Backend::Function],
        runtimes: vec!["runc".into()],
        started_at: started_at.into(),
        ..Default::default()
    }
}

async fn register(
    etcd: &sandlot_cluster::Client,
    n: &TestNode,
    started_at: &str,
) -> NodeRegistration {
    NodeRegistration::register(etcd, record(n, started_at), LeaseConfig::new(3).unwrap())
        .await
        .unwrap()
}

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut rb = self.http.request(method, format!("{}{path}", self.base));
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

    async fn state(&self, id: &str) -> String {
        let (s, b) = self
            .call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        assert_eq!(s, 200, "{b}");
        b["state"].as_str().unwrap().to_owned()
    }
}

/// One `sandlot server` over the nodes registered in etcd (`ClusterNode`), serving on
/// 127.0.0.1 with its store in a temp dir, until [`TestServer::stop`].
struct TestServer {
    _dir: tempfile::TempDir,
    cluster: Arc<ClusterNode>,
    base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<()>,
}

impl TestServer {
    async fn start(client: &sandlot_cluster::Client) -> TestServer {
        Self::start_in(client, tempfile::tempdir().unwrap()).await
    }

    /// Stops this server and starts another on its store (a restart).
    async fn restart(self, client: &sandlot_cluster::Client) -> TestServer {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(15), self.serving).await;
        Self::start_in(client, self._dir).await
    }

    async fn start_in(client: &sandlot_cluster::Client, dir: tempfile::TempDir) -> TestServer {
        let mut cfg = sandlot_server::ServerConfig::new(dir.path().to_path_buf());
        cfg.listen = "127.0.0.1:0".parse().unwrap();
        cfg.disk_reserve_bytes = 0;
        let cluster = ClusterNode::start(client, Some(TOKEN.into()), RemoteOptions::default())
            .await
            .unwrap();
        let server = sandlot_server::Server::bind_cluster(cfg, cluster.clone())
            .await
            .unwrap();
        let base = format!("http://{}", server.local_addr().unwrap());
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(async move {
            let _ = server
                .run(async move {
                    let _ = stop_rx.await;
                })
                .await;
        });
        TestServer {
            _dir: dir,
            cluster,
            base,
            stop,
            serving,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(15), self.serving).await;
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_spreads_routes_and_sweeps_over_etcd_nodes() {
    let Some(etcd) = Etcd::start("a_server_spreads_routes_and_sweeps_over_etcd_nodes", 1) else {
        return;
    };
    let client = connect(&etcd.urls).await.unwrap();
    let nodes = [
        start_node("n1").await,
        start_node("n2").await,
        start_node("n3").await,
    ];
    let mut regs = Vec::new();
    for n in &nodes {
        regs.push(Some(register(&client, n, "2026-12-04T10:00:00Z").await));
    }

    let srv = TestServer::start(&client).await;
    let cluster = srv.cluster.clone();
    assert_eq!(cluster.nodes().len(), 3);
    let base = srv.base.clone();
    let api = Api {
        http: reqwest::Client::new(),
        base,
    };
    let (s, health) = api.call(reqwest::Method::GET, "/healthz", None).await;
    assert_eq!(s, 200, "{health}");
    assert_eq!(health["node"], "cluster");
    assert_eq!(health["backends"]["function"], "ok");

    // 20 creates spread over the three nodes; each record names the node that holds it.
    let mut ids = Vec::new();
    for i in 0..20 {
        let (s, b) = api
            .call(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"backend": "function", "labels": {"job": "rl-1", "i": i.to_string()}})),
            )
            .await;
        assert_eq!(s, 201, "{b}");
        ids.push((
            b["id"].as_str().unwrap().to_owned(),
            b["node"].as_str().unwrap().to_owned(),
        ));
    }
    // The nodes' published usage does not move within the burst: the spread comes from the
    // server counting its own recent placements (placement `Candidate::recent`).
    for n in &nodes {
        let held = n.fake.ids();
        assert!(held.len() >= 4, "node {} got {} of 20", n.name, held.len());
        for id in &held {
            let (_, node) = ids.iter().find(|(i, _)| i == id).unwrap();
            assert_eq!(node, &n.name, "record of {id}");
        }
    }
    assert_eq!(nodes.iter().map(|n| n.fake.ids().len()).sum::<usize>(), 20);

    // Exec and files reach the owning node, for a sandbox of each node.
    for n in &nodes {
        let id = n.fake.ids()[0].clone();
        let (s, b) = api
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": ["echo", "hello", n.name.as_str()]})),
            )
            .await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(b["exit_code"], 0, "{b}");
        let execs = n.fake.execs.lock().unwrap().clone();
        assert!(
            execs.iter().any(|(i, _)| i == &id),
            "exec of {id} not on {}",
            n.name
        );
        let resp = api
            .http
            .put(format!(
                "{}/v1/sandboxes/{id}/files?path=note.txt",
                api.base
            ))
            .body(format!("written on {}", n.name))
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{}", resp.text().await.unwrap());
        let got = api
            .http
            .get(format!(
                "{}/v1/sandboxes/{id}/files?path=note.txt",
                api.base
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(got.status().as_u16(), 200);
        assert_eq!(got.text().await.unwrap(), format!("written on {}", n.name));
        let files = n.fake.sandboxes.lock().unwrap()[&id].len();
        assert_eq!(files, 1, "the file lives on {}", n.name);
    }
    let (s, b) = api.call(reqwest::Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, 200);
    assert_eq!(b["sandboxes"].as_array().map(|a| a.len()), Some(20), "{b}");

    // No node offers the backend: 429 resource_exhausted with Retry-After, at once.
    let t0 = Instant::now();
    let resp = api
        .http
        .post(format!("{}/v1/sandboxes", api.base))
        .json(&json!({"backend": "vm"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let b: Value = resp.json().await.unwrap();
    assert_eq!(b["error"]["code"], "resource_exhausted", "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("n1: backend vm unavailable"),
        "{b}"
    );
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());

    // A sandbox that died under n1 (its fake says so) is marked lost by the reaper, which
    // asks each node only for its sandboxes that are not alive; then it is deleted.
    let died = nodes[0].fake.ids()[0].clone();
    nodes[0].fake.dead.lock().unwrap().insert(died.clone());
    eventually(
        "the sandbox that died lost",
        Duration::from_secs(10),
        async || api.state(&died).await == "lost",
    )
    .await;
    let (s, b) = api
        .call(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{died}"),
            None,
        )
        .await;
    assert!(s == 200 || s == 204, "{s} {b}");
    assert!(!nodes[0].fake.ids().contains(&died));

    // A stale route (this server's map names another registered node than the record
    // does, as after another server moved the sandbox): a call that reads the record
    // follows the record's node.
    let id = nodes[0].fake.ids()[0].clone();
    cluster.set_route(&id, &nodes[1].name);
    let (s, b) = api
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["true"]})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        cluster.route_of(&id).as_deref(),
        Some(nodes[0].name.as_str())
    );

    // A dead copy of that sandbox on n2 (as the old node keeps one after a resume on
    // another node) does not mark it lost: only the node its record names counts. A
    // sandbox that died on n2 itself, reported in the same list, is the witness that the
    // reaper saw the copy.
    let witness = nodes[1].fake.ids()[0].clone();
    nodes[1]
        .fake
        .sandboxes
        .lock()
        .unwrap()
        .insert(id.clone(), Default::default());
    nodes[1]
        .fake
        .dead
        .lock()
        .unwrap()
        .extend([id.clone(), witness.clone()]);
    eventually(
        "the sandbox that died on n2 lost",
        Duration::from_secs(10),
        async || api.state(&witness).await == "lost",
    )
    .await;
    // One more pass (1 s) past the one that marked the witness.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        api.state(&id).await,
        "running",
        "a dead copy elsewhere made {id} lost"
    );
    nodes[1].fake.sandboxes.lock().unwrap().remove(&id);
    nodes[1].fake.dead.lock().unwrap().remove(&id);
    let (s, b) = api
        .call(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{witness}"),
            None,
        )
        .await;
    assert!(s == 200 || s == 204, "{s} {b}");

    // n3's registration is revoked: its sandboxes become lost, the others still exec.
    let lost_ids = nodes[2].fake.ids();
    regs[2].take().unwrap().deregister().await.unwrap();
    for id in &lost_ids {
        eventually("n3's sandboxes lost", Duration::from_secs(10), async || {
            api.state(id).await == "lost"
        })
        .await;
    }
    let (s, events) = api
        .call(reqwest::Method::GET, "/v1/events?kind=lost", None)
        .await;
    assert_eq!(s, 200, "{events}");
    assert!(
        events
            .to_string()
            .contains("node n3 left the cluster (lease expired)"),
        "{events}"
    );
    for n in &nodes[..2] {
        for id in n.fake.ids() {
            assert_eq!(api.state(&id).await, "running");
            let (s, b) = api
                .call(
                    reqwest::Method::POST,
                    &format!("/v1/sandboxes/{id}/exec"),
                    Some(json!({"cmd": ["echo", "still"]})),
                )
                .await;
            assert_eq!(s, 200, "{b}");
        }
    }
    let (s, b) = api
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{}/exec", lost_ids[0]),
            Some(json!({"cmd": ["echo", "x"]})),
        )
        .await;
    assert_eq!(s, 409, "exec on a lost sandbox: {b}");
    // New creates go to the two nodes left.
    for _ in 0..4 {
        let (s, b) = api
            .call(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"backend": "function"})),
            )
            .await;
        assert_eq!(s, 201, "{b}");
        assert_ne!(b["node"], "n3", "{b}");
    }

    // n3 comes back (a new registration): its sandboxes, whose records are lost, are
    // orphans and deleted there; a delete of a lost record still works.
    regs[2] = Some(register(&client, &nodes[2], "2026-12-04T10:05:00Z").await);
    eventually(
        "n3's orphans deleted",
        Duration::from_secs(10),
        async || nodes[2].fake.ids().is_empty(),
    )
    .await;
    let (s, b) = api
        .call(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{}", lost_ids[0]),
            None,
        )
        .await;
    assert!(s == 200 || s == 204, "{s} {b}");

    // A restart on the same store reconciles every node from one read of the records: an
    // orphan on n1 (no record) is deleted there, a sandbox n2 no longer has is marked
    // lost, the others stay running.
    let orphan = "sb-0123456789abcdef0123".to_owned();
    nodes[0]
        .fake
        .sandboxes
        .lock()
        .unwrap()
        .insert(orphan.clone(), Default::default());
    let vanished = nodes[1].fake.ids()[0].clone();
    nodes[1].fake.sandboxes.lock().unwrap().remove(&vanished);
    let srv = srv.restart(&client).await;
    let api = Api {
        http: reqwest::Client::new(),
        base: srv.base.clone(),
    };
    assert!(!nodes[0].fake.ids().contains(&orphan), "orphan left on n1");
    assert_eq!(api.state(&vanished).await, "lost");
    for n in &nodes[..2] {
        for id in n.fake.ids() {
            assert_eq!(api.state(&id).await, "running", "{id} on {}", n.name);
        }
    }

    srv.stop().await;
}

/// A retry with the Idempotency-Key of a create that was made answers that sandbox (200)
/// even when no node has room for a new one: placement used to run before the key was
/// looked at, so the retry of an acknowledged create got 429 `resource_exhausted` (seen
/// by a client retrying through another server after the first died, once the cluster
/// had filled up).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idempotent_retry_replays_when_no_node_has_room() {
    let Some(etcd) = Etcd::start("an_idempotent_retry_replays_when_no_node_has_room", 1) else {
        return;
    };
    let client = connect(&etcd.urls).await.unwrap();
    let node = start_node("full1").await;
    let mut rec = record(&node, "2026-12-05T10:00:00Z");
    rec.capacity.sandboxes = 1;
    let reg = NodeRegistration::register(&client, rec, LeaseConfig::new(3).unwrap())
        .await
        .unwrap();

    let srv = TestServer::start(&client).await;
    let cluster = srv.cluster.clone();
    let base = srv.base.clone();
    let http = reqwest::Client::new();
    let create = |key: &'static str, body: Value| {
        let http = http.clone();
        let base = base.clone();
        async move {
            let r = http
                .post(format!("{base}/v1/sandboxes"))
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
                .unwrap();
            let s = r.status().as_u16();
            (s, r.json::<Value>().await.unwrap())
        }
    };
    let body = json!({"backend": "function", "labels": {"k": "1"}});
    let (s, made) = create("retry-1", body.clone()).await;
    assert_eq!(s, 201, "{made}");

    // The node publishes that it is full; a new create is refused.
    reg.update(|r| r.usage.sandboxes = 1).await.unwrap();
    eventually(
        "the server sees the node full",
        Duration::from_secs(10),
        async || cluster.nodes().get("full1").map(|r| r.usage.sandboxes) == Some(1),
    )
    .await;
    let r = http
        .post(format!("{base}/v1/sandboxes"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 429, "{:?}", r.text().await);

    // The retry of the acknowledged create answers its sandbox; another body under the
    // same key is a conflict, as without a full cluster.
    let (s, again) = create("retry-1", body.clone()).await;
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["id"], made["id"]);
    let (s, b) = create("retry-1", json!({"backend": "function"})).await;
    assert_eq!(s, 409, "{b}");
    assert_eq!(node.fake.ids().len(), 1);

    srv.stop().await;
    reg.deregister().await.unwrap();
}

/// A pause or resume by label in a cluster is one bulk call per owning node
/// (`ClusterNode::pause_many` / `resume_many`), with per-id results: a sandbox its node
/// refuses is listed in `failed` and stays `running`. Ids whose node left the cluster, or
/// that no node knows, are not sent to any node: with no node able to take a snapshot
/// over (these nodes run `function` only), each answers `NotFound`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_label_pause_is_one_bulk_call_per_node() {
    let Some(etcd) = Etcd::start("a_label_pause_is_one_bulk_call_per_node", 1) else {
        return;
    };
    let client = connect(&etcd.urls).await.unwrap();
    let nodes = [
        start_node("p1").await,
        start_node("p2").await,
        start_node("p3").await,
    ];
    let mut regs = Vec::new();
    for n in &nodes {
        regs.push(Some(register(&client, n, "2026-12-06T10:00:00Z").await));
    }
    let srv = TestServer::start(&client).await;
    let api = Api {
        http: reqwest::Client::new(),
        base: srv.base.clone(),
    };
    let mut ids = Vec::new();
    for _ in 0..12 {
        let (s, b) = api
            .call(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"backend": "function", "labels": {"job": "bulk"}})),
            )
            .await;
        assert_eq!(s, 201, "{b}");
        ids.push(b["id"].as_str().unwrap().to_owned());
    }
    for n in &nodes {
        assert!(!n.fake.ids().is_empty(), "node {} got none", n.name);
    }
    let bad = nodes[1].fake.ids()[0].clone();
    nodes[1]
        .fake
        .refuse_freeze
        .lock()
        .unwrap()
        .insert(bad.clone());

    let (s, b) = api
        .call(
            reqwest::Method::POST,
            "/v1/sandboxes:pause",
            Some(json!({"labels": {"job": "bulk"}})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["sandboxes"].as_array().unwrap().len(), 11, "{b}");
    assert_eq!(b["failed"][0]["id"], bad.as_str(), "{b}");
    for n in &nodes {
        let held = n.fake.ids().len();
        assert_eq!(
            *n.fake.bulk_calls.lock().unwrap(),
            [("pause", held)],
            "node {}",
            n.name
        );
        for id in n.fake.ids() {
            let want = if id == bad { "running" } else { "paused" };
            assert_eq!(api.state(&id).await, want, "{id} on {}", n.name);
        }
    }
    nodes[1].fake.refuse_freeze.lock().unwrap().clear();

    // p3 leaves: resuming all ids through the cluster resumes p1's and p2's in one call
    // each; p3's are not sent to p3 and, with no node to take them over, answer NotFound.
    let gone = nodes[2].fake.ids();
    regs[2].take().unwrap().deregister().await.unwrap();
    eventually("p3 gone", Duration::from_secs(10), async || {
        srv.cluster.nodes().get("p3").is_none()
    })
    .await;
    let unknown = "sb-no-such-sandbox".to_owned();
    let mut all = ids.clone();
    all.push(unknown.clone());
    let res = sandlot_node_api::Node::resume_many(&*srv.cluster, &all).await;
    assert_eq!(res.len(), all.len());
    for (id, r) in all.iter().zip(&res) {
        if gone.contains(id) || *id == unknown {
            assert!(
                matches!(r, Err(sandlot_node_api::NodeError::NotFound(_))),
                "{id}: {r:?}"
            );
        } else {
            // `bad` too: never paused, its node resumes it as a no-op.
            assert!(r.is_ok(), "{id}: {r:?}");
        }
    }
    for n in &nodes[..2] {
        let calls = n.fake.bulk_calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 2, "node {}: {calls:?}", n.name);
        assert_eq!(calls[1], ("resume", n.fake.ids().len()), "node {}", n.name);
        assert!(n.fake.paused.lock().unwrap().is_empty(), "node {}", n.name);
    }
    assert_eq!(
        *nodes[2].fake.bulk_calls.lock().unwrap(),
        [("pause", gone.len())]
    );
    assert_eq!(nodes[2].fake.paused.lock().unwrap().len(), gone.len());

    // A pause of an unknown id goes to no node either.
    let res =
        sandlot_node_api::Node::pause_many(&*srv.cluster, std::slice::from_ref(&unknown)).await;
    assert!(
        matches!(res[0], Err(sandlot_node_api::NodeError::NotFound(_))),
        "{res:?}"
    );
    let calls: Vec<usize> = nodes
        .iter()
        .map(|n| n.fake.bulk_calls.lock().unwrap().len())
        .collect();
    assert_eq!(calls, [2, 2, 1]);
    srv.stop().await;
}
