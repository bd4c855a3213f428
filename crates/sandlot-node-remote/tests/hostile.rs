//! Hostile clients of the node API port, which anyone who reaches it can open before the
//! token is checked: a node out of file descriptors keeps serving (it once ended `serve`
//! and with it `sandlot node`), and connections that make no authenticated call are
//! closed after `AUTH_DEADLINE`. Its own test binary: it lowers the process's
//! `RLIMIT_NOFILE`.
use sandlot_node_api::Node;
use sandlot_node_fake::FakeNode;
use sandlot_node_remote::{router, serve, RemoteNode, AUTH_DEADLINE};
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_neither_end_nor_block_the_node() {
    let fake = Arc::new(FakeNode::default());
    let id = common::new_id();
    fake.create(&common::spec(&id)).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let url = format!("http://{addr}");
    let server = tokio::spawn(serve(listener, router(fake, Some("t".into()))));
    let node = RemoteNode::connect(&url, Some("t".into())).await.unwrap();
    assert_eq!(node.list().await.unwrap().len(), 1);

    // 256 descriptors for the whole process (this test's sockets and the node's).
    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, 256, hard).unwrap();
    // Idle connections (no byte sent) until this process runs out of descriptors: the
    // node's accepts then fail with EMFILE.
    let mut idle = Vec::new();
    while let Ok(s) = std::net::TcpStream::connect(addr) {
        idle.push(s);
        if idle.len() > 400 {
            break;
        }
    }
    assert!(idle.len() < 400, "the descriptor limit was not reached");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!server.is_finished(), "serve ended: {:?}", server.await);

    // Descriptors back: the node serves again (its pending accepts go through). Two thirds
    // are freed: the node's pending accepts of the connections still held take one
    // descriptor each, so freeing fewer (once: 20) left none for this test's own connects.
    idle.truncate(idle.len() / 3);
    let t = Instant::now();
    let r = loop {
        let fresh = RemoteNode::connect(&url, Some("t".into())).await;
        match async { fresh?.list().await }.await {
            Ok(l) => break l,
            Err(e) if t.elapsed() < Duration::from_secs(5) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("node not serving again: {e}"),
        }
    };
    assert_eq!(r.len(), 1);

    // The idle connections (and one that sent only half a request head) are closed by the
    // node after AUTH_DEADLINE; the authenticated client's connection stays.
    let mut half = std::net::TcpStream::connect(addr).unwrap();
    std::io::Write::write_all(&mut half, b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n").unwrap();
    idle.push(half);
    tokio::time::sleep(AUTH_DEADLINE + Duration::from_secs(1)).await;
    let closed = tokio::task::spawn_blocking(move || {
        idle.iter_mut()
            .filter(|s| {
                s.set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                let mut b = [0u8; 512];
                // EOF or a reset: closed by the node (after an HTTP/1.1 408, for the half
                // request). A timeout: still open.
                for _ in 0..4 {
                    match (&**s).read(&mut b) {
                        Ok(0) => return true,
                        Ok(_) => continue,
                        Err(e) => {
                            return !matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            )
                        }
                    }
                }
                false
            })
            .count()
            == idle.len()
    })
    .await
    .unwrap();
    assert!(closed, "some unauthenticated connections are still open");
    assert_eq!(node.list().await.unwrap().len(), 1);
}
