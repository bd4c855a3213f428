//! Slow request bodies and one address's share of the in-flight slots (issue 25): a real
//! server on a loopback socket (over the unit-test `FakeNode`) and raw TCP clients.
use crate::conn::ConnLimits;
use crate::test_support::data_dir;
use crate::{Server, ServerConfig, SharedState};
use sandlot_node_fake::FakeNode;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::oneshot;

/// A server on `127.0.0.1:0` with `limits`; stops when the returned sender is dropped.
struct Running {
    addr: SocketAddr,
    st: SharedState,
    _stop: oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

async fn start(name: &str, limits: ConnLimits) -> Running {
    let dir = data_dir(name);
    let mut cfg = ServerConfig::new(dir.path().to_path_buf());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.conn = limits;
    cfg.shutdown_grace = Duration::from_millis(100);
    let server = Server::bind(cfg, Arc::new(FakeNode::default()))
        .await
        .expect("bind");
    let addr = server.local_addr().unwrap();
    let st = server.state.clone();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    Running {
        addr,
        st,
        _stop: tx,
        _dir: dir,
    }
}

fn ip(n: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, n])
}

/// A TCP connection to `to` from source address `from` (127.0.0.2 is as local as .1).
async fn connect_from(from: IpAddr, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(from, 0)).unwrap();
    s.connect(to).await.unwrap()
}

/// Request head of a JSON POST announcing `len` body bytes.
fn post_head(len: usize) -> String {
    format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {len}\r\n\r\n"
    )
}

/// Read one response: until its head and `Content-Length` body arrived, or EOF; panics
/// after `within`.
async fn read_response(s: &mut TcpStream, within: Duration) -> String {
    let mut buf = Vec::new();
    let read = async {
        let mut chunk = [0u8; 4096];
        loop {
            let text = String::from_utf8_lossy(&buf).into_owned();
            if let Some(end) = text.find("\r\n\r\n") {
                let len = text[..end]
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len {
                    return text;
                }
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return String::from_utf8_lossy(&buf).into_owned(),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(within, read)
        .await
        .unwrap_or_else(|_| panic!("no response within {within:?}"))
}

/// `GET path` on a fresh connection from `from`; the whole response.
async fn get_from(from: IpAddr, to: SocketAddr, path: &str) -> String {
    let mut s = connect_from(from, to).await;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    read_response(&mut s, Duration::from_secs(10)).await
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn metric(r: &Running, line_prefix: &str) -> f64 {
    let text = get_from(ip(1), r.addr, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn status_of(resp: &str) -> &str {
    resp.split(' ').nth(1).unwrap_or("")
}

/// The attack of issue 25 on one slot: a request head, then a body that never comes (or
/// comes a byte at a time). The request is answered `408 deadline_exceeded` within the
/// bound, its connection closed, and the only in-flight slot is free again.
#[tokio::test]
async fn a_trickled_body_is_answered_408_and_its_slot_is_released() {
    let r = start(
        "slowbody-408",
        ConnLimits {
            max_requests_in_flight: 1,
            body_read_timeout: Duration::from_secs(1),
            body_min_rate: 1024,
            ..Default::default()
        },
    )
    .await;
    // (a) nothing after the head: the read timeout; (b) a byte every 300 ms, which the
    // read timeout alone never catches: the rate floor after the 1 s grace period.
    for (case, gap) in [("silent", None), ("trickle", Some(300u64))] {
        let mut slow = connect_from(ip(1), r.addr).await;
        slow.write_all(post_head(100).as_bytes()).await.unwrap();
        let started = Instant::now();
        wait_until("the slow request to take the slot", || {
            r.st.conns.requests_from(ip(1)) == 1
        })
        .await;
        // The slot is taken: another address is shed meanwhile (global limit 1).
        let shed = get_from(ip(2), r.addr, "/v1/ping").await;
        assert_eq!(status_of(&shed), "503", "{case}: {shed}");
        let (mut rd, mut wr) = slow.into_split();
        let trickler = tokio::spawn(async move {
            // (Dropping the write half would send a FIN: keep it open, silent.)
            let Some(gap) = gap else {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                drop(wr);
                return;
            };
            for b in b"{\"backend\": \"function\"".iter().cycle() {
                if wr.write_all(&[*b]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(gap)).await;
            }
        });
        // Read to EOF: the server answers and closes the connection.
        let resp = {
            let mut buf = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), rd.read_to_end(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("{case}: connection still open after 5 s"));
            String::from_utf8_lossy(&buf).into_owned()
        };
        let took = started.elapsed();
        trickler.abort();
        assert_eq!(status_of(&resp), "408", "{case}: {resp}");
        assert!(resp.contains("\"deadline_exceeded\""), "{case}: {resp}");
        assert!(
            resp.to_ascii_lowercase().contains("connection: close"),
            "{case}: {resp}"
        );
        assert!(
            took < Duration::from_secs(4),
            "{case}: answered after {took:?}"
        );
        assert!(
            took >= Duration::from_millis(900),
            "{case}: too early, {took:?}"
        );
        wait_until("the slot to be given back", || {
            r.st.conns.requests_from(ip(1)) == 0
        })
        .await;
        let ok = get_from(ip(2), r.addr, "/v1/ping").await;
        assert_eq!(status_of(&ok), "200", "{case}: slot free again: {ok}");
    }
    assert_eq!(metric(&r, "sandlot_request_body_timeouts_total").await, 2.0);
}

/// A body at a normal pace is not touched: 64 KiB in 4 KiB pieces every 20 ms, with a
/// 500 ms read timeout and the default floor, arrives whole (the handler answers, not
/// the pacing).
#[tokio::test]
async fn a_body_at_a_normal_pace_is_not_affected() {
    let r = start(
        "slowbody-normal",
        ConnLimits {
            body_read_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .await;
    let mut body = br#"{"backend": "function", "env": {"PAD": ""#.to_vec();
    body.resize(64 << 10, b'x');
    body.extend_from_slice(br#""}}"#);
    let mut s = connect_from(ip(1), r.addr).await;
    s.write_all(post_head(body.len()).as_bytes()).await.unwrap();
    for piece in body.chunks(4096) {
        s.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = read_response(&mut s, Duration::from_secs(10)).await;
    assert_ne!(status_of(&resp), "408", "{resp}");
    assert!(!resp.contains("deadline_exceeded"), "{resp}");
    assert_eq!(metric(&r, "sandlot_request_body_timeouts_total").await, 0.0);
}

/// One address holding its share of the slots (a quarter of the total by default) with
/// bodies that never come is shed `503` with `Retry-After` beyond it, while another address
/// is still answered.
#[tokio::test]
async fn one_address_cannot_take_every_slot() {
    let r = start(
        "slowbody-per-ip",
        ConnLimits {
            max_requests_in_flight: 8,
            body_read_timeout: Duration::from_secs(30),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(r.st.conns.limits().per_ip_requests(), 2, "a quarter of 8");
    let mut held = Vec::new();
    for n in 1..=2 {
        let mut s = connect_from(ip(1), r.addr).await;
        s.write_all(post_head(100).as_bytes()).await.unwrap();
        wait_until("the slow request to take a slot", || {
            r.st.conns.requests_from(ip(1)) == n
        })
        .await;
        held.push(s);
    }
    // Over its share: shed at once, like the global limit.
    let mut third = connect_from(ip(1), r.addr).await;
    third
        .write_all(b"GET /v1/ping HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let resp = read_response(&mut third, Duration::from_secs(5)).await;
    assert_eq!(status_of(&resp), "503", "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("retry-after: 1"),
        "{resp}"
    );
    assert!(resp.contains("\"unavailable\""), "{resp}");
    assert!(resp.contains("from your address"), "{resp}");
    // Another address is answered meanwhile.
    for _ in 0..3 {
        let ok = get_from(ip(2), r.addr, "/v1/ping").await;
        assert_eq!(status_of(&ok), "200", "{ok}");
    }
    assert_eq!(r.st.conns.requests_from(ip(1)), 2, "the held ones stay");
    // /metrics from 127.0.0.1 would itself be shed: read the counter from .2.
    let text = get_from(ip(2), r.addr, "/metrics").await;
    assert!(
        text.contains("sandlot_requests_shed_total{reason=\"per_ip\"} 1"),
        "{text}"
    );
    // Closing the slow connections gives the address its share back.
    drop(held);
    wait_until("the address's slots to be given back", || {
        r.st.conns.requests_from(ip(1)) == 0
    })
    .await;
    let ok = get_from(ip(1), r.addr, "/v1/ping").await;
    assert_eq!(status_of(&ok), "200", "{ok}");
}

/// Slow bodies from many addresses, each within its own share, fill only the share of
/// requests with a body still arriving (three quarters): a further request with a body is
/// shed `503`, requests without a body from anyone are still answered, and a body read to
/// its end gives its slot back at once.
#[tokio::test]
async fn slow_bodies_from_many_addresses_leave_room_for_requests_without_one() {
    let r = start(
        "slowbody-many",
        ConnLimits {
            max_requests_in_flight: 8,
            body_read_timeout: Duration::from_secs(30),
            ..Default::default()
        },
    )
    .await;
    let limits = r.st.conns.limits();
    assert_eq!((limits.per_ip_requests(), limits.body_requests()), (2, 6));
    let mut held = Vec::new();
    for n in 1..=3u8 {
        for k in 1..=2 {
            let mut s = connect_from(ip(n), r.addr).await;
            s.write_all(post_head(100).as_bytes()).await.unwrap();
            wait_until("the slow request to take a slot", || {
                r.st.conns.requests_from(ip(n)) == k
            })
            .await;
            held.push(s);
        }
    }
    // A seventh body, from a fresh address within its own share: shed.
    let post = || async {
        let mut body = connect_from(ip(4), r.addr).await;
        body.write_all(post_head(2).as_bytes()).await.unwrap();
        body.write_all(b"{}").await.unwrap();
        read_response(&mut body, Duration::from_secs(5)).await
    };
    let resp = post().await;
    assert_eq!(status_of(&resp), "503", "{resp}");
    assert!(resp.contains("with a body in flight"), "{resp}");
    // Requests without a body still get the two slots kept for them, one after another.
    for n in [4, 5, 6] {
        let ok = get_from(ip(n), r.addr, "/v1/ping").await;
        assert_eq!(status_of(&ok), "200", "{ok}");
    }
    let text = get_from(ip(5), r.addr, "/metrics").await;
    assert!(
        text.contains("sandlot_requests_shed_total{reason=\"body\"} 1"),
        "{text}"
    );
    // One slow body completes: its body slot is free although the other five still wait.
    let mut first = held.remove(0);
    first.write_all(&[b' '; 100]).await.unwrap();
    let done = read_response(&mut first, Duration::from_secs(5)).await;
    assert_ne!(status_of(&done), "503", "{done}");
    let resp = post().await;
    assert_ne!(status_of(&resp), "503", "{resp}");
}

/// A client that never takes an answer's bytes (an HTTP/2 stream window of 0: the heads
/// arrive, no body byte can) cannot hold request slots: after the write-stall timeout the
/// connection is closed and its slots are free, while an answer that fits the client's
/// window is not cut however late the client reads it.
#[tokio::test]
async fn answers_a_client_never_takes_end_with_their_connection() {
    let r = start(
        "slowread",
        ConnLimits {
            max_requests_in_flight: 8,
            write_stall_timeout: Duration::from_secs(1),
            ..Default::default()
        },
    )
    .await;
    // An HTTP/2 client from `from` with stream window `window`, its connection driven by
    // the returned task.
    let h2 = |from: u8, window: u32| async move {
        let tcp = connect_from(ip(from), r.addr).await;
        let (send, conn) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .initial_stream_window_size(window)
                .handshake::<_, axum::body::Body>(hyper_util::rt::TokioIo::new(tcp))
                .await
                .unwrap();
        (send, tokio::spawn(conn))
    };
    let (mut send, driver) = h2(7, 0).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let req = hyper::Request::get("http://t/healthz")
            .body(axum::body::Body::empty())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        held.push(resp);
    }
    assert_eq!(
        r.st.conns.requests_from(ip(7)),
        2,
        "both answers wait for the client"
    );
    let t = Instant::now();
    wait_until("the stalled connection to be closed", || {
        r.st.conns.requests_from(ip(7)) == 0
    })
    .await;
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    let _ = tokio::time::timeout(Duration::from_secs(5), driver)
        .await
        .unwrap();
    assert_eq!(
        metric(
            &r,
            "sandlot_connections_closed_total{reason=\"write_stall\"}"
        )
        .await,
        1.0
    );
    drop(held);

    // A client with an open window that reads its answer 1.5 s late, on the same limits:
    // the answer went out into the window at once, so nothing waited for the client.
    let (mut send, _driver) = h2(8, 65_535).await;
    let req = hyper::Request::get("http://t/healthz")
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let body = axum::body::to_bytes(axum::body::Body::new(resp.into_body()), 1 << 20)
        .await
        .unwrap();
    assert!(!body.is_empty());
    assert_eq!(
        metric(
            &r,
            "sandlot_connections_closed_total{reason=\"write_stall\"}"
        )
        .await,
        1.0
    );
}
