//! Ingress of the `function` backend ([`Node::connect_port`]): a real `LocalNode`, the real
//! `sandlot-guest`, a busybox image, a sandbox **without network** whose process listens
//! on its own loopback. Needs root, cgroups and the guest binary (`SANDLOT_GUEST_BIN`, else
//! `target/{release,debug}/sandlot-guest` of this build's profile); each test prints why
//! it skips.
use sandlot_api::{Cmd, ExecRequest};
use sandlot_node::{Node, NodeError};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod support;

fn setup(test: &str) -> Option<support::BusyboxNode> {
    support::BusyboxNode::start(test, "sandlot-test-ports")
}

fn sh(script: &str, timeout_s: f64) -> ExecRequest {
    let mut r = ExecRequest::new(Cmd::Shell(script.into()));
    r.timeout_s = Some(timeout_s);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_port_reaches_a_listener_inside_a_sandbox_without_network() {
    let Some(env) = setup("connect_port_reaches_a_listener_inside_a_sandbox_without_network")
    else {
        return;
    };
    let node = env.node.clone();
    let id = "sb-0000000000000000c001";
    node.create(&support::function_spec(id)).await.unwrap();

    // Nothing listens yet: a clear Unavailable, not a hang.
    let t = Instant::now();
    match node.connect_port(id, 8000).await {
        Err(NodeError::Unavailable(m)) => {
            assert!(m.contains("nothing listens on port 8000"), "{m}")
        }
        Err(e) => panic!("expected Unavailable, got {e:?}"),
        Ok(_) => panic!("expected Unavailable, got a connection"),
    }
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(matches!(
        node.connect_port(id, 0).await,
        Err(NodeError::InvalidArgument(_))
    ));
    assert!(matches!(
        node.connect_port("sb-0000000000000000ffff", 8000).await,
        Err(NodeError::NotFound(_))
    ));

    // An echo server on the sandbox's loopback (the sandbox has no network at all).
    let n2 = node.clone();
    let server = tokio::spawn(async move {
        n2.exec(id, &sh("exec nc -l -p 8000 -e cat", 60.0), None)
            .await
    });
    let end = Instant::now() + Duration::from_secs(20);
    let mut conn = loop {
        match node.connect_port(id, 8000).await {
            Ok(c) => break c,
            Err(NodeError::Unavailable(_)) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("connect_port: {e:?}"),
        }
    };
    // Bytes both ways, then a half-close: the echo ends and so does the stream.
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let (mut rd, mut wr) = tokio::io::split(&mut conn);
    let writer = async {
        wr.write_all(&payload).await.unwrap();
        wr.shutdown().await.unwrap();
    };
    let reader = async {
        let mut back = Vec::new();
        rd.read_to_end(&mut back).await.unwrap();
        back
    };
    let ((), back) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(writer, reader)
    })
    .await
    .expect("echo finishes");
    assert_eq!(back.len(), payload.len());
    assert!(back == payload, "echoed bytes differ");
    let r = tokio::time::timeout(Duration::from_secs(20), server)
        .await
        .expect("nc exits after the echo")
        .unwrap()
        .unwrap();
    assert_eq!(r.exit_code, 0, "{r:?}");

    // A paused sandbox refuses; after resume the answer is about the port again.
    node.pause(id).await.unwrap();
    assert!(matches!(
        node.connect_port(id, 8000).await,
        Err(NodeError::Conflict(_))
    ));
    node.resume(id).await.unwrap();
    assert!(matches!(
        node.connect_port(id, 8000).await,
        Err(NodeError::Unavailable(_))
    ));
    node.delete(id).await.unwrap();
    assert!(matches!(
        node.connect_port(id, 8000).await,
        Err(NodeError::NotFound(_))
    ));
}
