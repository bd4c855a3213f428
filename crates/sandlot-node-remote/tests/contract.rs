//! One contract suite (`common::run_all`), three nodes: the unit-test fake `FakeNode`
//! itself, `RemoteNode` in front of a `FakeNode` (the node API on 127.0.0.1), and
//! `RemoteNode` in front of a real `LocalNode` with the `function` backend (needs root,
//! cgroups, the guest binary and the busybox image; prints `SKIPPED: <why>` otherwise).
use sandlot_node::{LocalNode, Node};
use sandlot_node_fake::FakeNode;
use sandlot_node_remote::RemoteNode;
use std::sync::Arc;

mod common;
use common::with_processes;

#[path = "../../sandlot-node/tests/support/mod.rs"]
mod support;

#[tokio::test]
async fn contract_on_the_fake_node() {
    let node = with_processes(Arc::new(FakeNode::default()));
    common::run_all(&*node, &common::Profile::fake()).await;
    common::numbers_across_clients(&*node, &*node).await;
}

#[tokio::test]
async fn contract_on_a_remote_fake_node() {
    let fake = Arc::new(FakeNode::default());
    let (url, _server) = common::start(with_processes(fake.clone()), Some("s3cret".into())).await;
    let remote = RemoteNode::connect(&url, Some("s3cret".into()))
        .await
        .unwrap();
    assert_eq!(remote.info(), fake.info());
    common::run_all(&remote, &common::Profile::fake()).await;
    // A second client (another server of a cluster) resolves the first one's processes.
    let other = RemoteNode::connect(&url, Some("s3cret".into()))
        .await
        .unwrap();
    common::numbers_across_clients(&remote, &other).await;
    // The calls went through to the fake.
    assert!(fake.execs.lock().unwrap().len() >= 3);
}

/// `list_not_alive` over the node API: only the dead and the unknown, the same as the
/// node's own answer; a filter the node does not know is a 400 with a stable code.
#[tokio::test]
async fn list_not_alive_sends_only_those_not_alive() {
    let fake = Arc::new(FakeNode::default());
    for id in ["sb-alive", "sb-dead", "sb-unknown"] {
        fake.create(&common::spec(id)).await.unwrap();
    }
    fake.dead.lock().unwrap().insert("sb-dead".into());
    fake.unknown
        .lock()
        .unwrap()
        .insert("sb-unknown".into(), "EMFILE".into());
    let (url, _server) = common::start(fake.clone(), Some("s3cret".into())).await;
    let remote = RemoteNode::connect(&url, Some("s3cret".into()))
        .await
        .unwrap();
    let mut ids: Vec<String> = remote
        .list_not_alive()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    ids.sort();
    assert_eq!(ids, ["sb-dead", "sb-unknown"]);
    assert_eq!(remote.list().await.unwrap().len(), 3);
    let r = reqwest::Client::new()
        .get(format!("{url}/v1/sandboxes?liveness=dead"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["kind"], "invalid_argument", "{body}");
}

/// Deletes what the test left and the test's cgroup parent.
struct Cleanup {
    node: Arc<LocalNode>,
    cfg: sandlot_node::NodeConfig,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        support::delete_all(&self.node);
        let parent = self.cfg.cgroup_parent.clone();
        for suffix in ["", "-ctr", "-q35", "-vm"] {
            let mut cfg = self.cfg.clone();
            cfg.cgroup_parent = format!("{parent}{suffix}");
            let _ = support::cgroups(&cfg).remove_parent();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_on_a_remote_local_node() {
    let test = "contract_on_a_remote_local_node";
    let Some(guest) = support::host_ready(test, support::BUILD_GUEST_HINT) else {
        println!("SKIPPED: this host cannot run the function backend (see SKIP above)");
        return;
    };
    let (mut cfg, _tmp) = support::node_config(guest);
    cfg.name = "remote-contract".into();
    cfg.cgroup_parent = support::unique_cgroup_parent("sandlot-remote-test");
    let node = Arc::new(LocalNode::open(cfg.clone()).unwrap());
    let _cleanup = Cleanup {
        node: node.clone(),
        cfg,
    };
    if !support::build_busybox(test, &node) {
        println!("SKIPPED: no busybox image (see SKIP above)");
        return;
    }
    let (url, _server) = common::start(with_processes(node.clone()), Some("tok".into())).await;
    let remote = RemoteNode::connect(&url, Some("tok".into())).await.unwrap();
    assert_eq!(remote.info().name, "remote-contract");
    common::run_all(&remote, &common::Profile::real()).await;
    let other = RemoteNode::connect(&url, Some("tok".into())).await.unwrap();
    common::numbers_across_clients(&remote, &other).await;
}

/// The calls the contract cases leave out (readopt deletes what it does not keep, so it
/// does not run on a live `LocalNode` here), and a file over axum's default 2 MiB body.
#[tokio::test]
async fn readopt_accel_and_large_files_over_the_wire() {
    let fake = Arc::new(FakeNode::default());
    let (url, _server) = common::start(fake.clone(), None).await;
    let remote = RemoteNode::connect(&url, None).await.unwrap();
    let (a, b) = (common::new_id(), common::new_id());
    remote.create(&common::spec(&a)).await.unwrap();
    remote.create(&common::spec(&b)).await.unwrap();
    let keep = std::slice::from_ref(&a);
    assert_eq!(remote.readopt(keep).await.unwrap(), keep);
    assert_eq!(fake.ids(), keep);
    assert_eq!(remote.accel().await, None);

    let big = bytes::Bytes::from(vec![7u8; 9 << 20]);
    remote
        .write_file(&a, "/workspace/big", big.clone())
        .await
        .unwrap();
    assert_eq!(
        remote.file_size(&a, "/workspace/big").await.unwrap(),
        9 << 20
    );
    assert_eq!(
        remote
            .read_file(&a, "/workspace/big", 10 << 20)
            .await
            .unwrap(),
        big
    );
}
