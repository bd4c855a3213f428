//! Pause/resume of the `function` backend on the real cgroup freezer: a real `LocalNode`,
//! the real `sandlot-guest`, a busybox image. Needs root, cgroups and the guest binary
//! (`SANDLOT_GUEST_BIN`, else `target/{release,debug}/sandlot-guest` of this build's
//! profile); each test prints why it skips.
use sandlot_api::{Backend, Cmd, ExecRequest};
use sandlot_node::cgroups::CgroupRoot;
use sandlot_node::{LocalNode, Node, NodeConfig, NodeError, SandboxSpec};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

struct Env {
    node: Arc<LocalNode>,
    cfg: NodeConfig,
    _tmp: tempfile::TempDir,
}

impl Env {
    fn cgroups(&self) -> CgroupRoot {
        support::cgroups(&self.cfg)
    }
}

fn setup(test: &str) -> Option<Env> {
    let guest = support::host_ready(test, support::BUILD_GUEST_HINT)?;
    let (mut cfg, tmp) = support::node_config(guest);
    cfg.name = "test-node".into();
    cfg.cgroup_parent = support::unique_cgroup_parent("sandlot-test-pause");
    let node = LocalNode::open(cfg.clone()).unwrap();
    if !support::build_busybox(test, &node) {
        return None;
    }
    Some(Env {
        node: Arc::new(node),
        cfg,
        _tmp: tmp,
    })
}

fn spec(id: &str) -> SandboxSpec {
    SandboxSpec {
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
    }
}

fn sh(script: &str, timeout_s: f64) -> ExecRequest {
    let mut r = ExecRequest::new(Cmd::Shell(script.into()));
    r.timeout_s = Some(timeout_s);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_freezes_cpu_and_refuses_calls_resume_thaws() {
    let Some(env) = setup("pause_freezes_cpu_and_refuses_calls_resume_thaws") else {
        return;
    };
    let node = env.node.clone();
    let id = "sb-0000000000000000ab01";
    node.create(&spec(id)).await.unwrap();
    let group = env.cgroups().sandbox(id).group().clone();

    // A busy counter running inside an exec in flight (exec trees live as long as the exec).
    let n2 = node.clone();
    let busy = tokio::spawn(async move {
        n2.exec(id, &sh("i=0; while :; do i=$((i+1)); done", 60.0), None)
            .await
    });
    let t0 = group.cpu_usage_ns().expect("cpu usage readable");
    let end = Instant::now() + Duration::from_secs(10);
    while group.cpu_usage_ns().unwrap() < t0 + 50_000_000 {
        assert!(Instant::now() < end, "the counter never used 50 ms of CPU");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    node.pause(id).await.unwrap();
    assert!(
        group.is_frozen(),
        "cgroup freezer reports FROZEN after pause"
    );
    // The kernel's own file says so too (v1 `freezer.state`, v2 `cgroup.freeze`).
    let state = group
        .dirs()
        .map(|d| d.join("freezer.state"))
        .chain(group.dirs().map(|d| d.join("cgroup.freeze")))
        .find(|f| f.exists())
        .map(|f| std::fs::read_to_string(f).unwrap())
        .expect("a freezer file");
    assert!(
        state.trim() == "FROZEN" || state.trim() == "1",
        "freezer file says {state:?}"
    );
    // Calls on a paused sandbox answer Conflict.
    match node.exec(id, &sh("echo hi", 5.0), None).await {
        Err(NodeError::Conflict(m)) => assert!(m.contains("paused"), "{m}"),
        other => panic!("exec on a paused sandbox: {other:?}"),
    }
    match node.write_file(id, "/workspace/x", "y".into()).await {
        Err(NodeError::Conflict(_)) => {}
        other => panic!("write on a paused sandbox: {other:?}"),
    }
    // A paused sandbox uses no CPU: the counter does not advance over 300 ms.
    let before = group.cpu_usage_ns().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = group.cpu_usage_ns().unwrap();
    assert!(
        after - before < 1_000_000,
        "paused sandbox used {} ns of CPU in 300 ms",
        after - before
    );
    // Pausing twice is a no-op.
    node.pause(id).await.unwrap();

    node.resume(id).await.unwrap();
    assert!(!group.is_frozen());
    let r = node.exec(id, &sh("echo back", 10.0), None).await.unwrap();
    assert_eq!(r.stdout, "back\n");
    let before = group.cpu_usage_ns().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = group.cpu_usage_ns().unwrap();
    assert!(
        after - before > 50_000_000,
        "resumed counter used only {} ns in 300 ms",
        after - before
    );

    // Delete works on a paused sandbox (thaw, kill, remove) and ends the busy exec.
    node.pause(id).await.unwrap();
    node.delete(id).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(15), busy)
        .await
        .expect("busy exec ends after delete")
        .unwrap();
    if let Ok(r) = r {
        assert_ne!(r.exit_code, 0);
    }
    assert!(!group.exists(), "cgroup removed after delete");
    assert!(matches!(node.pause(id).await, Err(NodeError::NotFound(_))));
    let _ = env.cgroups().remove_parent();
}
