//! Ingress timeouts (issue 25): an app in a sandbox that accepts and never answers must
//! not hold its connection (a tunnel slot on agent backends) and a server task forever.
//! A real server on a loopback socket over the unit-test `FakeNode`, whose sandbox ports
//! are real TCP listeners of the test (`FakeNode::ports`), and a real HTTP client.
use crate::test_support::data_dir;
use crate::{Server, ServerConfig};
use sandlot_node_fake::FakeNode;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// What the test's app does with each connection.
#[derive(Clone, Copy)]
enum App {
    /// Reads the request (and whatever follows), never writes.
    Silent,
    /// Answers the request head with `101 Switching Protocols`, then stays silent.
    UpgradeThenSilent,
    /// Answers `200 ok` after this long.
    AnswerAfter(Duration),
}

/// A listener running `app` on `127.0.0.1:0`; the counter is its open connections.
async fn app(app: App) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let open = Arc::new(AtomicUsize::new(0));
    let count = open.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let count = count.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                let mut answered = false;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                    if answered || !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        continue;
                    }
                    answered = true;
                    match app {
                        App::Silent => {}
                        App::UpgradeThenSilent => {
                            let _ = s
                                .write_all(
                                    b"HTTP/1.1 101 Switching Protocols\r\n\
                                      Connection: Upgrade\r\nUpgrade: echo\r\n\r\n",
                                )
                                .await;
                        }
                        App::AnswerAfter(d) => {
                            tokio::time::sleep(d).await;
                            let _ = s
                                .write_all(
                                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\
                                      Connection: close\r\n\r\nok",
                                )
                                .await;
                            break;
                        }
                    }
                }
                drop(s);
                count.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (addr, open)
}

struct Running {
    url: String,
    addr: SocketAddr,
    node: Arc<FakeNode>,
    _stop: oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

async fn start(name: &str, response: Duration, idle: Duration) -> Running {
    let dir = data_dir(name);
    let mut cfg = ServerConfig::new(dir.path().to_path_buf());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.shutdown_grace = Duration::from_millis(100);
    cfg.ingress.response_timeout = response;
    cfg.ingress.idle_timeout = idle;
    let node = Arc::new(FakeNode::default());
    let server = Server::bind(cfg, node.clone()).await.expect("bind");
    let addr = server.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    Running {
        url: format!("http://{addr}"),
        addr,
        node,
        _stop: tx,
        _dir: dir,
    }
}

async fn create(http: &reqwest::Client, url: &str) -> String {
    let r = http
        .post(format!("{url}/v1/sandboxes"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let v: serde_json::Value = r.json().await.unwrap();
    v["id"].as_str().unwrap().to_owned()
}

async fn wait_zero(open: &AtomicUsize, within: Duration) {
    let t0 = Instant::now();
    while open.load(Ordering::SeqCst) != 0 {
        assert!(
            t0.elapsed() < within,
            "{} connections into the sandbox still open after {within:?}",
            open.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn an_app_that_never_answers_gets_504_and_its_connection_is_closed() {
    let response = Duration::from_millis(600);
    let srv = start("ingress-silent", response, Duration::from_secs(30)).await;
    let (silent, open) = app(App::Silent).await;
    let (slow_ok, _) = app(App::AnswerAfter(Duration::from_millis(200))).await;
    srv.node.ports.lock().unwrap().insert(9001, silent);
    srv.node.ports.lock().unwrap().insert(9002, slow_ok);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let id = create(&http, &srv.url).await;

    // An app that answers within the bound is served as before.
    let r = http
        .get(format!("{}/v1/sandboxes/{id}/ports/9002/", srv.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "ok");

    // 200 requests (more than an agent's 128 tunnels), 40 at a time, to an app that
    // accepts and never answers: each 504 in about the bound, each connection closed.
    let t0 = Instant::now();
    for _ in 0..5 {
        let mut calls = Vec::new();
        for i in 0..40 {
            let http = http.clone();
            let url = format!("{}/v1/sandboxes/{id}/ports/9001/x{i}", srv.url);
            calls.push(tokio::spawn(async move {
                let t = Instant::now();
                let r = if i % 2 == 0 {
                    http.get(url).send().await.unwrap()
                } else {
                    http.post(url)
                        .body(vec![7u8; 100_000])
                        .send()
                        .await
                        .unwrap()
                };
                (r.status(), r.text().await.unwrap(), t.elapsed())
            }));
        }
        for c in calls {
            let (status, body, took) = c.await.unwrap();
            assert_eq!(status, 504, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], "deadline_exceeded", "{body}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("port 9001"),
                "{body}"
            );
            assert!(took >= response, "answered before the bound: {took:?}");
            assert!(took < response * 5, "504 too late: {took:?}");
        }
        wait_zero(&open, Duration::from_secs(2)).await;
    }
    assert!(t0.elapsed() < Duration::from_secs(15));
}

#[tokio::test]
async fn an_idle_upgraded_connection_is_closed_both_ways() {
    let idle = Duration::from_millis(800);
    let srv = start("ingress-idle", Duration::from_secs(30), idle).await;
    let (upgrade, open) = app(App::UpgradeThenSilent).await;
    srv.node.ports.lock().unwrap().insert(9003, upgrade);
    let http = reqwest::Client::new();
    let id = create(&http, &srv.url).await;

    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(
        format!(
            "GET /v1/sandboxes/{id}/ports/9003/ws HTTP/1.1\r\nHost: t\r\n\
             Connection: Upgrade\r\nUpgrade: echo\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the idle upgraded connection stayed open");
    assert!(
        got.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert!(t0.elapsed() >= idle, "closed before the idle timeout");
    wait_zero(&open, Duration::from_secs(2)).await;
}
