//! Setup shared by the root integration tests of the `function` backend (`function.rs`,
//! `pool.rs`, `pause.rs`, `uids.rs`): where the guest binary is, the host checks with their
//! `SKIP <test>: ...` lines, unique cgroup parents, a node config over a temp dir, the
//! busybox image and the end-of-test sweep. Most test files keep their own `Env`;
//! [`BusyboxNode`] and [`function_spec`] serve those that need nothing more.
//!
//! Used with `mod support;`; each test binary compiles this module on its own and not every
//! file uses every helper, hence the `dead_code` allowance.
#![allow(dead_code)]

use sandlot_node::cgroups::CgroupRoot;
use sandlot_node::{LocalNode, Node, NodeConfig, SandboxSpec};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// Hint printed after `<guest> missing;` by most files.
pub const BUILD_GUEST_HINT: &str = "run `cargo build -p sandlot-guest` or set SANDLOT_GUEST_BIN";

/// The `sandlot-guest` binary: `SANDLOT_GUEST_BIN` if set, else the static build
/// `target/x86_64-unknown-linux-gnu/{profile}/sandlot-guest` (setup.sh makes it; `sandlot up`
/// picks it too) when it exists, else `target/{profile}/sandlot-guest`, with `{profile}` the
/// build profile of this test binary, so `cargo test --release` never silently runs a stale
/// debug guest. A dynamically linked guest cannot start inside a busybox rootfs (no dynamic
/// loader there: "No such file or directory").
pub fn guest_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDLOT_GUEST_BIN") {
        return PathBuf::from(p);
    }
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    let fixed = target.join(format!("x86_64-unknown-linux-gnu/{profile}/sandlot-guest"));
    if fixed.exists() {
        return fixed;
    }
    target.join(format!("{profile}/sandlot-guest"))
}

/// Root, usable cgroups and an existing guest binary: the guest's path, or `None` after
/// printing `SKIP {test}: ...` (`guest_hint` follows `<path> missing;`).
pub fn host_ready(test: &str, guest_hint: &str) -> Option<PathBuf> {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("SKIP {test}: needs root (namespaces, cgroups)");
        return None;
    }
    if let Err(e) = CgroupRoot::detect() {
        eprintln!("SKIP {test}: no usable cgroups: {e}");
        return None;
    }
    let guest = guest_bin();
    if !guest.exists() {
        eprintln!("SKIP {test}: {} missing; {guest_hint}", guest.display());
        return None;
    }
    Some(guest)
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// `{prefix}-{pid}-{n}`: one cgroup parent per test node, so parallel tests never sweep
/// each other.
pub fn unique_cgroup_parent(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}

/// A `NodeConfig` with its data dir at `<tmp>/data` and `guest` as the guest binary; the
/// `TempDir` must outlive the node.
pub fn node_config(guest: PathBuf) -> (NodeConfig, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = NodeConfig::new(tmp.path().join("data"));
    cfg.guest_bin = guest;
    (cfg, tmp)
}

/// Builds the busybox image in `node`'s store; `false` after printing `SKIP {test}: ...`.
pub fn build_busybox(test: &str, node: &LocalNode) -> bool {
    if let Err(e) = node.images().build_busybox() {
        eprintln!("SKIP {test}: cannot build the busybox image: {e}");
        return false;
    }
    true
}

/// The cgroup root of `cfg`'s node (under its `cgroup_parent`).
pub fn cgroups(cfg: &NodeConfig) -> CgroupRoot {
    CgroupRoot::detect()
        .unwrap()
        .with_parent(&cfg.cgroup_parent)
}

/// Deletes every sandbox `node` lists, on a thread and runtime of its own (this may run in
/// a `Drop` inside the test's runtime).
pub fn delete_all(node: &LocalNode) {
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for sb in node.list().await.unwrap() {
                    let _ = node.delete(&sb.id).await;
                }
            })
        })
        .join()
        .unwrap()
    });
}

/// A node with the busybox image built, its sandboxes deleted on drop.
pub struct BusyboxNode {
    pub node: std::sync::Arc<LocalNode>,
    _cfg: NodeConfig,
    _tmp: tempfile::TempDir,
}

impl BusyboxNode {
    /// A fresh node over a temp data dir under cgroup parent `cgroup_prefix-…`, or `None`
    /// (the reason printed) when this host cannot run the test.
    pub fn start(test: &str, cgroup_prefix: &str) -> Option<BusyboxNode> {
        let guest = host_ready(test, BUILD_GUEST_HINT)?;
        let (mut cfg, tmp) = node_config(guest);
        cfg.name = "test-node".into();
        cfg.cgroup_parent = unique_cgroup_parent(cgroup_prefix);
        let node = LocalNode::open(cfg.clone()).unwrap();
        if !build_busybox(test, &node) {
            return None;
        }
        Some(BusyboxNode {
            node: std::sync::Arc::new(node),
            _cfg: cfg,
            _tmp: tmp,
        })
    }
}

impl Drop for BusyboxNode {
    fn drop(&mut self) {
        delete_all(&self.node);
    }
}

/// A `function` sandbox `id` of the busybox image: 1 cpu, 128 MiB, 64 MiB disk, 64 pids,
/// no network.
pub fn function_spec(id: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        backend: sandlot_api::Backend::Function,
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

/// A `function` sandbox `id` of the busybox image as `function.rs` and `function_agent.rs`
/// check it: 1 cpu, 256 MiB, 64 MiB disk, 128 pids, env `SB_VAR=from-sandbox`, no network.
pub fn function_spec_with_env(id: &str) -> SandboxSpec {
    SandboxSpec {
        memory_mib: 256,
        pids_max: 128,
        env: [("SB_VAR".to_string(), "from-sandbox".to_string())]
            .into_iter()
            .collect(),
        ..function_spec(id)
    }
}

/// An exec of shell `script` with a timeout of `timeout_s` seconds.
pub fn sh_req(script: &str, timeout_s: f64) -> sandlot_api::ExecRequest {
    let mut r = sandlot_api::ExecRequest::new(sandlot_api::Cmd::Shell(script.into()));
    r.timeout_s = Some(timeout_s);
    r
}

/// Runs shell `script` in sandbox `id` (30 s timeout); panics when the exec call fails.
pub async fn sh(node: &LocalNode, id: &str, script: &str) -> sandlot_api::ExecResult {
    node.exec(id, &sh_req(script, 30.0), None)
        .await
        .unwrap_or_else(|e| panic!("exec {script:?}: {e}"))
}
