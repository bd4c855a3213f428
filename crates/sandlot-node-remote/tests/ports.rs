//! `Node::connect_port` over the node API: `RemoteNode` in front of a real `LocalNode`
//! with the `function` backend (needs root, cgroups, the guest binary and the busybox
//! image; prints `SKIPPED: <why>` otherwise), and the fake node's errors carried over the wire.
use sandlot_api::{Backend, Cmd, ExecRequest};
use sandlot_node::{LocalNode, Node, NodeError, SandboxSpec};
use sandlot_node_fake::FakeNode;
use sandlot_node_remote::RemoteNode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
#[path = "../../sandlot-node/tests/support/mod.rs"]
mod support;

#[tokio::test]
async fn a_fake_node_answers_unavailable_and_not_found_over_the_wire() {
    let fake = Arc::new(FakeNode::default());
    let (url, _server) = common::start(fake, None).await;
    let remote = RemoteNode::connect(&url, None).await.unwrap();
    // No such sandbox: not_found; a sandbox where nothing listens on the port: unavailable.
    assert!(matches!(
        remote.connect_port("sb-00000000000000000001", 80).await,
        Err(NodeError::NotFound(_))
    ));
    remote
        .create(&common::spec("sb-00000000000000000002"))
        .await
        .unwrap();
    assert!(matches!(
        remote.connect_port("sb-00000000000000000002", 80).await,
        Err(NodeError::Unavailable(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_port_through_a_remote_local_node() {
    let test = "connect_port_through_a_remote_local_node";
    let Some(guest) = support::host_ready(test, support::BUILD_GUEST_HINT) else {
        println!("SKIPPED: this host cannot run the function backend (see SKIP above)");
        return;
    };
    let (mut cfg, _tmp) = support::node_config(guest);
    cfg.name = "remote-ports".into();
    cfg.cgroup_parent = support::unique_cgroup_parent("sandlot-remote-ports");
    let node = Arc::new(LocalNode::open(cfg.clone()).unwrap());
    if !support::build_busybox(test, &node) {
        println!("SKIPPED: no busybox image (see SKIP above)");
        return;
    }
    let (url, _server) = common::start(node.clone(), Some("tok".into())).await;
    let remote = Arc::new(RemoteNode::connect(&url, Some("tok".into())).await.unwrap());
    let id = "sb-0000000000000000c101";
    remote
        .create(&SandboxSpec {
            id: id.into(),
            backend: Backend::Function,
            image: "busybox".into(),
            cpu: 1.0,
            memory_mib: 128,
            disk_mib: 64,
            pids_max: 64,
            env: Default::default(),
            network: sandlot_api::NetworkPolicy::None,
            runtime: None,
        })
        .await
        .unwrap();
    let result = async {
        match remote.connect_port(id, 8000).await {
            Err(NodeError::Unavailable(m)) => {
                assert!(m.starts_with(sandlot_node_api::PORT_NOT_LISTENING), "{m}")
            }
            Err(e) => panic!("expected Unavailable, got {e:?}"),
            Ok(_) => panic!("expected Unavailable, got a connection"),
        }
        assert!(matches!(
            remote.connect_port("sb-0000000000000000ffff", 8000).await,
            Err(NodeError::NotFound(_))
        ));
        let r2 = remote.clone();
        let server = tokio::spawn(async move {
            let mut r = ExecRequest::new(Cmd::Shell("exec nc -l -p 8000 -e cat".into()));
            r.timeout_s = Some(60.0);
            r2.exec(id, &r, None).await
        });
        let end = Instant::now() + Duration::from_secs(20);
        let mut conn = loop {
            match remote.connect_port(id, 8000).await {
                Ok(c) => break c,
                Err(NodeError::Unavailable(_)) if Instant::now() < end => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => panic!("connect_port: {e:?}"),
            }
        };
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
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
        let ((), back) = tokio::time::timeout(Duration::from_secs(30), async {
            tokio::join!(writer, reader)
        })
        .await
        .expect("echo through the node API finishes");
        assert!(
            back == payload,
            "echoed {} bytes, sent {}",
            back.len(),
            payload.len()
        );
        let r = tokio::time::timeout(Duration::from_secs(20), server)
            .await
            .expect("nc exits after the echo")
            .unwrap()
            .unwrap();
        assert_eq!(r.exit_code, 0, "{r:?}");
    }
    .await;
    let _ = node.delete(id).await;
    let _ = support::cgroups(&cfg).remove_parent();
    result
}
