//! [`LocalNode`]: the in-process [`Node`] over this host's backends, images and cgroups.
//!
//! ```no_run
//! # async fn demo() -> sandlot_node::NodeResult<()> {
//! use sandlot_node::{LocalNode, Node, NodeConfig};
//! let node = LocalNode::open(NodeConfig::new("/var/lib/sandlot"))?;
//! node.readopt(&[]).await?; // clean up leftovers of a previous process
//! # Ok(()) }
//! ```
use crate::backends::container::{ContainerBackend, ContainerConfig, Runtime};
use crate::backends::function::{FunctionBackend, FunctionConfig};
use crate::backends::pool::PoolConfig;
use crate::backends::qemu::microvm::{MicrovmBackend, MicrovmConfig};
use crate::backends::qemu::vm::{VmBackend, VmConfig};
use crate::backends::qemu::AccelProbe;
use crate::backends::AnyBackend;
use crate::backends::ExecIo;
use crate::cgroups::CgroupRoot;
use crate::checkpoints::{CheckpointMeta, CheckpointStore};
use crate::images::ImageStore;
use crate::node::{
    ExecControl, ExecSink, Node, NodeError, NodeInfo, NodeResult, SandboxSpec, SandboxStatus,
    WarmPoolInfo,
};
use async_trait::async_trait;
use sandlot_api::{Backend, ExecRequest, ExecResult, FileEntry};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Configuration of a [`LocalNode`].
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Node name shown by the server (the host name by default).
    pub name: String,
    /// Data directory; sandboxes live in `DATA/sandboxes/<id>`.
    pub data_dir: PathBuf,
    /// Image store directory (`DATA/images` by default).
    pub images_dir: PathBuf,
    /// The `sandlot-guest` binary (see [`default_guest_bin`]).
    pub guest_bin: PathBuf,
    /// A statically linked `sandlot-guest`, the agent of containers (see
    /// [`default_agent_bin`]).
    pub agent_bin: PathBuf,
    /// First host uid (and gid) of the sandboxes' id ranges (default 100000): each
    /// function jail gets a range of 65536 ids of its own, `uid_base + slot × 65536 ..`
    /// (lowest free slot; see [`crate::backends::uids`]), so its uids `0..65536` map there.
    pub uid_base: u32,
    /// Name of the parent cgroup of this node's sandboxes (default from
    /// [`default_cgroup_parent`]: one per data directory). Two nodes on one host need
    /// different names: `readopt` removes every group under its parent that it does not know.
    pub cgroup_parent: String,
    /// Ready `function` jails kept per image in [`NodeConfig::warm_pool_images`] (default 0:
    /// no warm pool). The pool starts after the first [`Node::readopt`]; see
    /// [`crate::backends::pool`].
    pub warm_pool: usize,
    /// Image names the warm pools keep jails and containers of (default empty).
    pub warm_pool_images: Vec<String>,
    /// More image names the `function` warm pool (only) keeps jails of, [`NodeConfig::warm_pool`]
    /// each: `run_code`'s toolchain images (`lang-python`, ...), which only `function`
    /// sandboxes use (default empty).
    pub function_pool_images: Vec<String>,
    /// Ready runc containers kept per image in [`NodeConfig::warm_pool_images`] (default 0:
    /// no container pool; `sandlot up` defaults to 2). The pool starts after the first
    /// [`Node::readopt`]; see [`crate::backends::container::pool`].
    pub container_warm_pool: usize,
    /// Members each warm pool builds at once while it refills (default 2; at least 1, at
    /// most the members the pool keeps: [`crate::backends::pool::PoolConfig::builds`]).
    pub warm_pool_builds: usize,
    /// OCI runtime of `container` sandboxes created without one (default runc).
    pub default_runtime: Runtime,
    /// The microvm guest kit (kernel + modules, built by `scripts/guest-kit.sh`):
    /// `$SANDLOT_GUEST_KIT_DIR`, else `guest-kit/` beside the images directory.
    pub guest_kit_dir: PathBuf,
    /// The shared snapshot store (`--snapshot-dir`, default `$SANDLOT_SNAPSHOT_DIR`): a
    /// directory every node of the cluster mounts at the same absolute path, where a
    /// microVM's pause with memory writes its snapshot so another node can resume it
    /// ([`crate::backends::qemu::store`]). `None`: pauses stay on this node's disk.
    pub snapshot_dir: Option<PathBuf>,
    /// How long [`LocalNode::open`] waits for another process to release the data
    /// directory's lock (`DATA/node.lock`, [`crate::dirlock`]) before it fails (default
    /// [`crate::dirlock::DEFAULT_WAIT`], 10 s). `None`: take no lock, for a test that opens
    /// a second node on the directory of a first one it keeps in place (a crashed
    /// predecessor whose lock the kernel would have dropped).
    pub lock_wait: Option<std::time::Duration>,
}

impl NodeConfig {
    /// Defaults under `data_dir`: images in `DATA/images`, guest from [`default_guest_bin`],
    /// uid base 100000, name = host name.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        let data_dir = data_dir.into();
        let images_dir = data_dir.join("images");
        NodeConfig {
            guest_kit_dir: default_guest_kit_dir(&images_dir),
            name: nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "localhost".into()),
            images_dir,
            cgroup_parent: default_cgroup_parent(&data_dir),
            data_dir,
            guest_bin: default_guest_bin(),
            agent_bin: default_agent_bin(),
            uid_base: 100_000,
            warm_pool: 0,
            warm_pool_images: Vec::new(),
            function_pool_images: Vec::new(),
            container_warm_pool: 0,
            warm_pool_builds: 2,
            default_runtime: Runtime::Runc,
            snapshot_dir: std::env::var_os("SANDLOT_SNAPSHOT_DIR")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            lock_wait: Some(crate::dirlock::DEFAULT_WAIT),
        }
    }
}

/// `sandlot-` followed by 12 hex digits of a hash (FNV-1a 64) of the data directory's
/// absolute path: stable across restarts and versions, distinct for two nodes on one host
/// that use different data directories.
pub fn default_cgroup_parent(data_dir: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let abs = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in abs.as_os_str().as_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{}-{:012x}", crate::cgroups::PARENT, h & 0xffff_ffff_ffff)
}

/// `$SANDLOT_GUEST_KIT_DIR`, else `guest-kit/` beside `images_dir` (the layout
/// `scripts/guest-kit.sh` writes: `/var/lib/sandlot/guest-kit` next to
/// `/var/lib/sandlot/images`).
pub fn default_guest_kit_dir(images_dir: &std::path::Path) -> PathBuf {
    if let Some(p) = std::env::var_os("SANDLOT_GUEST_KIT_DIR") {
        return PathBuf::from(p);
    }
    images_dir
        .parent()
        .unwrap_or(std::path::Path::new("/"))
        .join("guest-kit")
}

/// `$SANDLOT_GUEST_BIN`; else the statically linked `sandlot-guest` when there is one
/// (`static_guest_bin`); else `sandlot-guest` next to the running executable.
///
/// The static build is preferred because the function backend starts one `sandlot-guest
/// exec` per exec: without a dynamic loader to run it starts faster (function exec of
/// `true`, round trip p50 29.2 → 26.0 ms on the 2-core dev host under load, A/B of two
/// servers, 80 interleaved calls each); the code is the same.
pub fn default_guest_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDLOT_GUEST_BIN") {
        return PathBuf::from(p);
    }
    static_guest_bin(true).unwrap_or_else(guest_beside_exe)
}

/// `$SANDLOT_AGENT_BIN`; else the statically linked `sandlot-guest` (`static_guest_bin`);
/// else [`default_guest_bin`] (the container backend then reports that it needs a static
/// build).
pub fn default_agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("SANDLOT_AGENT_BIN") {
        return PathBuf::from(p);
    }
    static_guest_bin(false).unwrap_or_else(default_guest_bin)
}

/// A statically linked `sandlot-guest`: `$SANDLOT_GUEST_BIN` when static, else the one next
/// to the running executable when static, else the static build cargo leaves beside a
/// release/debug directory (`target/x86_64-unknown-linux-gnu/<profile>/sandlot-guest`, made
/// by scripts/setup.sh with `-C target-feature=+crt-static`) when it exists — with `fresh`,
/// only when it is not older than the `sandlot-guest` next to the executable (a plain
/// `cargo build` remakes that one, not the static build: a stale guest would ignore new
/// spec fields).
fn static_guest_bin(fresh: bool) -> Option<PathBuf> {
    use crate::backends::container::is_static_elf;
    if let Some(p) = std::env::var_os("SANDLOT_GUEST_BIN").map(PathBuf::from) {
        if is_static_elf(&p) {
            return Some(p);
        }
    }
    let beside = guest_beside_exe();
    if is_static_elf(&beside) {
        return Some(beside);
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let profile = dir.file_name()?;
    let cand = dir
        .parent()?
        .join("x86_64-unknown-linux-gnu")
        .join(profile)
        .join("sandlot-guest");
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let stale = fresh && matches!((mtime(&beside), mtime(&cand)), (Some(b), Some(c)) if b > c);
    (cand.is_file() && !stale).then_some(cand)
}

/// `sandlot-guest` next to the running executable.
fn guest_beside_exe() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("sandlot-guest")))
        .unwrap_or_else(|| PathBuf::from("sandlot-guest"))
}

/// A node running sandboxes on this host.
pub struct LocalNode {
    name: String,
    data_dir: std::path::PathBuf,
    cgroup_version: String,
    images: ImageStore,
    backends: Vec<AnyBackend>,
    pool: PoolConfig,
    container_pool: PoolConfig,
    checkpoints: CheckpointStore,
    /// The accelerator decision of the QEMU backends (`None` when the configuration is bad).
    accel: Option<std::sync::Arc<AccelProbe>>,
    /// Network policies of every backend that applies them (state in `DATA/net`).
    net: std::sync::Arc<crate::net::NodeNet>,
    /// The shared snapshot store (`--snapshot-dir`), when given and usable.
    snapshot_store: Option<crate::backends::qemu::store::SnapshotStore>,
    /// `DATA/node.lock`, held while the node lives (unless [`NodeConfig::lock_wait`] is
    /// `None`).
    _lock: Option<crate::dirlock::DirLock>,
}

/// Backends that apply `network: {"allow": [...]}` (veth, nftables and the filtering
/// resolver of [`crate::net`]).
pub const NETWORK_POLICY_BACKENDS: [Backend; 4] = [
    Backend::Function,
    Backend::Container,
    Backend::Microvm,
    Backend::Vm,
];

/// `Ok` when `backend` can honour `network`; otherwise `InvalidArgument` saying so (400,
/// not 503: the request cannot succeed on this node whatever its state), never a sandbox
/// silently without its network.
///
/// # Errors
/// `InvalidArgument` for an allow policy on a backend not in [`NETWORK_POLICY_BACKENDS`]
/// (every backend applies them now; kept for a backend added later).
pub fn check_network_backend(
    backend: Backend,
    network: &sandlot_api::NetworkPolicy,
) -> NodeResult<()> {
    if *network == sandlot_api::NetworkPolicy::None || NETWORK_POLICY_BACKENDS.contains(&backend) {
        return Ok(());
    }
    Err(NodeError::InvalidArgument(format!(
        "network allow policies are not enforced by the {backend} backend yet (a VM has no network device); use \"none\", or backend \"function\", \"container\", \"microvm\" or \"vm\""
    )))
}

impl LocalNode {
    /// Stop the warm pools of the `function` and `container` backends and destroy their
    /// ready members (see [`crate::backends::pool::WarmPool::stop`]); blocks until done
    /// (call it from a blocking task). For a node that stops for good (`sandlot up` and
    /// `sandlot node` on SIGTERM/SIGINT): sandboxes stay for re-adoption, pool members are
    /// not sandboxes and would only be swept at the next start. Later creates build cold.
    pub fn stop_warm_pools(&self) {
        if let Some(p) = self.function().and_then(|f| f.warm_pool()) {
            p.stop();
        }
        if let Some(p) = self.container().and_then(|c| c.warm_pool()) {
            p.stop();
        }
    }

    /// Ids of the sandboxes a previous process of this node left in its data directory
    /// (alive or not; warm-pool members excluded), sorted. `sandlot node` passes them all
    /// to [`Node::readopt`] at start, so a restarted node keeps every live sandbox until a
    /// server reconciles it with its records (a server's own `readopt` then deletes the
    /// ones it has no record of).
    pub fn sandboxes_on_disk(&self) -> Vec<String> {
        let pools = [
            crate::backends::function::pool::POOL_PREFIX,
            crate::backends::container::pool::POOL_PREFIX,
        ];
        let mut ids: Vec<String> = ["sandboxes", "containers", "microvm", "vm"]
            .iter()
            .filter_map(|d| std::fs::read_dir(self.data_dir.join(d)).ok())
            .flat_map(|rd| rd.flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| crate::backends::check_id(n).is_ok())
            .filter(|n| !pools.iter().any(|p| n.starts_with(p)))
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Open the node: lock the data directory, create its directories, detect cgroups,
    /// check the guest binary.
    ///
    /// The lock (`DATA/node.lock`, [`crate::dirlock`]) comes first, before anything in the
    /// directory is read or changed: while another process holds it, `open` waits up to
    /// [`NodeConfig::lock_wait`] (blocking), then fails. It is held until the node is
    /// dropped or the process ends.
    ///
    /// A missing host feature (no cgroups, no executable guest binary, not root) does not fail
    /// the node: the function backend is then listed as unavailable with the reason.
    ///
    /// # Errors
    /// `Conflict` when another process holds the data directory's lock for the whole wait
    /// (the message names the directory and the holder's pid); `Internal` when the data or
    /// image directory or the lock file cannot be created.
    pub fn open(cfg: NodeConfig) -> NodeResult<LocalNode> {
        std::fs::create_dir_all(&cfg.data_dir)
            .map_err(|e| NodeError::io(format!("create {}", cfg.data_dir.display()), e))?;
        let lock = cfg
            .lock_wait
            .map(|wait| {
                use crate::dirlock::{DirLock, DirLockError, NODE_LOCK};
                DirLock::acquire(&cfg.data_dir, NODE_LOCK, "node", wait).map_err(|e| match e {
                    DirLockError::Held { .. } => NodeError::Conflict(e.to_string()),
                    DirLockError::Io { path, source } => {
                        NodeError::io(format!("lock file {}", path.display()), source)
                    }
                })
            })
            .transpose()?;
        let images = ImageStore::open(cfg.images_dir.clone())?;
        tracing::info!(guest = %cfg.guest_bin.display(), agent = %cfg.agent_bin.display(), "sandlot-guest binaries (function backend; agent of containers and VMs)");
        let cgroups = CgroupRoot::detect().map(|c| c.with_parent(&cfg.cgroup_parent));
        let cgroup_version = match &cgroups {
            Ok(c) => c.version().as_str().to_string(),
            Err(_) => "none".to_string(),
        };
        let net = crate::net::NodeNet::new(cfg.data_dir.join("net"));
        let function = (|| -> Result<FunctionBackend, String> {
            if !nix::unistd::Uid::effective().is_root() {
                return Err("the function backend needs root (namespaces, cgroups)".into());
            }
            let cg = cgroups.map_err(|e| e.to_string())?;
            check_executable(&cfg.guest_bin)?;
            FunctionBackend::new(
                FunctionConfig {
                    sandboxes_dir: cfg.data_dir.join("sandboxes"),
                    guest_bin: cfg.guest_bin.clone(),
                    uid_base: cfg.uid_base,
                },
                cg,
                net.clone(),
            )
            .map_err(|e| e.to_string())
        })();
        let uids = match &function {
            Ok(f) => f.uid_slots(),
            Err(_) => crate::backends::uids::UidSlots::new(cfg.uid_base),
        };
        let container = (|| -> Result<ContainerBackend, String> {
            if !nix::unistd::Uid::effective().is_root() {
                return Err("the container backend needs root (mounts, cgroups)".into());
            }
            let cg = CgroupRoot::detect()
                .map_err(|e| e.to_string())?
                .with_parent(&format!("{}-ctr", cfg.cgroup_parent));
            ContainerBackend::new(
                ContainerConfig {
                    dir: cfg.data_dir.join("containers"),
                    state_root: cfg.data_dir.join("runtime"),
                    disk_templates: cfg.data_dir.join("disk-templates"),
                    agent_bin: cfg.agent_bin.clone(),
                    default_runtime: cfg.default_runtime,
                },
                cg,
                uids.clone(),
                net.clone(),
            )
            .map_err(|e| e.to_string())
        })();
        // QEMUs take their uids from the same table as function and container sandboxes.
        let qemu_uids = crate::backends::qemu::QemuUids::new(uids.clone());
        let probe = crate::backends::qemu::accel_from_env()
            .map(|forced| AccelProbe::new(forced, qemu_uids.clone()));
        // One store for both QEMU backends (`--snapshot-dir`); a bad one makes them
        // unavailable with the reason.
        let snapshot_store = cfg
            .snapshot_dir
            .as_ref()
            .map(|d| crate::backends::qemu::store::SnapshotStore::open(d, &cfg.name))
            .transpose()
            .map_err(|e| format!("snapshot dir: {e}"));
        let microvm = (|| -> Result<MicrovmBackend, String> {
            if !nix::unistd::Uid::effective().is_root() {
                return Err("the microvm backend needs root (cgroups)".into());
            }
            let cg = CgroupRoot::detect()
                .map_err(|e| e.to_string())?
                .with_parent(&format!("{}-vm", cfg.cgroup_parent));
            MicrovmBackend::new(
                MicrovmConfig {
                    dir: cfg.data_dir.join("microvm"),
                    kit_dir: cfg.guest_kit_dir.clone(),
                    agent_bin: cfg.agent_bin.clone(),
                    probe: probe.clone()?,
                    uids: qemu_uids.clone(),
                    images: images.clone(),
                    snapshot_store: snapshot_store.clone()?,
                    net: Some(net.clone()),
                },
                cg,
            )
            .map_err(|e| e.to_string())
        })();
        let vm = (|| -> Result<VmBackend, String> {
            if !nix::unistd::Uid::effective().is_root() {
                return Err("the vm backend needs root (cgroups, disk builds)".into());
            }
            // Its own parent group: each backend's readopt removes unknown groups under its
            // parent.
            let cg = CgroupRoot::detect()
                .map_err(|e| e.to_string())?
                .with_parent(&format!("{}-q35", cfg.cgroup_parent));
            VmBackend::new(
                VmConfig {
                    dir: cfg.data_dir.join("vm"),
                    kit_dir: cfg.guest_kit_dir.clone(),
                    agent_bin: cfg.agent_bin.clone(),
                    probe: probe.clone()?,
                    uids: qemu_uids.clone(),
                    images: images.clone(),
                    checkpoints_dir: cfg.data_dir.join("checkpoints"),
                    net: Some(net.clone()),
                    snapshot_store: snapshot_store.clone()?,
                },
                cg,
            )
            .map_err(|e| e.to_string())
        })();
        let unavailable = |kind: Backend, why: String| {
            tracing::warn!(backend = %kind, %why, "backend unavailable");
            AnyBackend::Unavailable {
                kind,
                why: format!("backend {kind} is unavailable: {why}"),
            }
        };
        let mut backends = vec![
            match function {
                Ok(f) => AnyBackend::Function(f),
                Err(why) => unavailable(Backend::Function, why),
            },
            match container {
                Ok(c) => AnyBackend::Container(c),
                Err(why) => unavailable(Backend::Container, why),
            },
            match microvm {
                Ok(m) => AnyBackend::Microvm(m),
                Err(why) => unavailable(Backend::Microvm, why),
            },
            match vm {
                Ok(v) => AnyBackend::Vm(v),
                Err(why) => unavailable(Backend::Vm, why),
            },
        ];
        backends.extend(AnyBackend::not_built());
        let checkpoints = CheckpointStore::open(cfg.data_dir.join("checkpoints"))?;
        Ok(LocalNode {
            checkpoints,
            data_dir: cfg.data_dir.clone(),
            name: cfg.name,
            cgroup_version,
            images,
            backends,
            container_pool: PoolConfig {
                per_image: cfg.container_warm_pool,
                images: cfg.warm_pool_images.clone(),
                max_builds: cfg.warm_pool_builds,
            },
            pool: PoolConfig {
                per_image: cfg.warm_pool,
                images: {
                    let mut images = cfg.warm_pool_images;
                    for i in cfg.function_pool_images {
                        if !images.contains(&i) {
                            images.push(i);
                        }
                    }
                    images
                },
                max_builds: cfg.warm_pool_builds,
            },
            accel: probe.ok(),
            net,
            snapshot_store: snapshot_store.ok().flatten(),
            _lock: lock,
        })
    }

    /// The node's image store.
    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    /// Ready warm-pool jails per image (empty when the pool is off or not started yet).
    pub fn warm_pool_ready(&self) -> std::collections::BTreeMap<String, usize> {
        self.function()
            .and_then(|f| f.warm_pool())
            .map(|p| p.ready())
            .unwrap_or_default()
    }

    /// Warm-pool hand-overs and creates that found no usable pooled jail, since start.
    pub fn warm_pool_stats(&self) -> (u64, u64) {
        self.function()
            .and_then(|f| f.warm_pool())
            .map(|p| p.stats())
            .unwrap_or_default()
    }

    /// Ready pooled runc containers per image (empty when the container pool is off or not
    /// started yet).
    pub fn container_pool_ready(&self) -> std::collections::BTreeMap<String, usize> {
        self.container()
            .and_then(|c| c.warm_pool())
            .map(|p| p.ready())
            .unwrap_or_default()
    }

    /// Container-pool hand-overs and creates that found no ready container of their
    /// image, since start.
    pub fn container_pool_stats(&self) -> (u64, u64) {
        self.container()
            .and_then(|c| c.warm_pool())
            .map(|p| p.stats())
            .unwrap_or_default()
    }

    /// [`NodeInfo::warm_pools`]: the function and container pools that were started.
    fn warm_pools(&self) -> Vec<WarmPoolInfo> {
        let function = self.function().and_then(|f| f.warm_pool()).map(|p| {
            let (handovers, misses) = p.stats();
            let by_image = p.handovers_by_image();
            (Backend::Function, p.ready(), handovers, misses, by_image)
        });
        let container = self.container().and_then(|c| c.warm_pool()).map(|p| {
            let (handovers, misses) = p.stats();
            let by_image = p.handovers_by_image();
            (Backend::Container, p.ready(), handovers, misses, by_image)
        });
        [function, container]
            .into_iter()
            .flatten()
            .map(
                |(backend, ready, handovers, misses, handovers_by_image)| WarmPoolInfo {
                    backend,
                    ready,
                    handovers,
                    handovers_by_image,
                    misses,
                },
            )
            .collect()
    }

    fn container(&self) -> Option<&ContainerBackend> {
        self.backends.iter().find_map(|b| match b {
            AnyBackend::Container(c) => Some(c),
            _ => None,
        })
    }

    fn function(&self) -> Option<&FunctionBackend> {
        self.backends.iter().find_map(|b| match b {
            AnyBackend::Function(f) => Some(f),
            _ => None,
        })
    }

    fn backend(&self, kind: Backend) -> NodeResult<&dyn crate::backends::SandboxBackend> {
        self.backends
            .iter()
            .find(|b| b.kind() == kind)
            .ok_or_else(|| NodeError::Unavailable(format!("backend {kind} is not compiled in")))?
            .get()
    }

    fn owner(&self, id: &str) -> NodeResult<&dyn crate::backends::SandboxBackend> {
        self.backends
            .iter()
            .filter_map(|b| b.get().ok())
            .find(|b| b.has(id))
            .ok_or_else(|| {
                NodeError::NotFound(format!("sandbox {id} not found on node {}", self.name))
            })
    }
}

fn check_executable(p: &std::path::Path) -> Result<(), String> {
    let md = std::fs::metadata(p).map_err(|e| {
        format!(
            "guest helper {} is missing ({e}); build it with `cargo build -p sandlot-guest` or set SANDLOT_GUEST_BIN",
            p.display()
        )
    })?;
    if !md.is_file() || md.permissions().mode() & 0o111 == 0 {
        return Err(format!(
            "guest helper {} is not an executable file",
            p.display()
        ));
    }
    Ok(())
}

#[async_trait]
impl Node for LocalNode {
    fn info(&self) -> NodeInfo {
        NodeInfo {
            name: self.name.clone(),
            backends: self
                .backends
                .iter()
                .map(|b| (b.kind(), b.availability()))
                .collect(),
            cgroup_version: self.cgroup_version.clone(),
            accel: self.accel.as_ref().and_then(|p| {
                let qemu_backend = self
                    .backends
                    .iter()
                    .any(|b| matches!(b, AnyBackend::Microvm(_) | AnyBackend::Vm(_)));
                qemu_backend.then(|| (p.get().map(|a| a.as_str().to_string()), p.why()))
            }),
            runtimes: self
                .backends
                .iter()
                .find_map(|b| match b {
                    AnyBackend::Container(c) => Some(c.runtimes()),
                    _ => None,
                })
                .unwrap_or_default()
                .iter()
                .map(|(r, bin)| {
                    (
                        r.name().to_string(),
                        bin.as_ref().map(|_| ()).map_err(Clone::clone),
                    )
                })
                .collect(),
            warm_pools: self.warm_pools(),
        }
    }

    async fn accel(&self) -> Option<String> {
        let qemu_backend = self
            .backends
            .iter()
            .any(|b| matches!(b, AnyBackend::Microvm(_) | AnyBackend::Vm(_)));
        match &self.accel {
            Some(p) if qemu_backend => Some(p.wait().await.as_str().to_string()),
            _ => None,
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()> {
        let backend = self.backend(spec.backend)?;
        if self.owner(&spec.id).is_ok() {
            return Err(NodeError::Conflict(format!(
                "sandbox {} already exists",
                spec.id
            )));
        }
        check_network_backend(spec.backend, &spec.network)?;
        let image = self.images.resolve(&spec.image).await?;
        backend.create(spec, &image, None).await
    }

    async fn checkpoint(&self, id: &str, checkpoint_id: &str) -> NodeResult<CheckpointMeta> {
        let backend = self.owner(id)?;
        let tmp = self.checkpoints.begin(checkpoint_id)?;
        let captured = match backend.checkpoint(id, &tmp).await {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
        };
        let t = tmp.clone();
        let size_bytes =
            crate::sys::spawn_blocking(move || Ok(crate::checkpoints::disk_usage(&t))).await?;
        let meta = CheckpointMeta {
            id: checkpoint_id.to_string(),
            sandbox_id: id.to_string(),
            backend: captured.backend,
            image: captured.image,
            runtime: captured.runtime,
            uid_base: captured.uid_base,
            disk_mib: captured.disk_mib,
            image_version: captured.image_version,
            size_bytes,
            created_at_ms: chrono::Utc::now().timestamp_millis(),
        };
        self.checkpoints.commit(&tmp, &meta)?;
        tracing::info!(sandbox = %id, checkpoint = %checkpoint_id, size_bytes, "checkpoint taken");
        Ok(meta)
    }

    async fn create_from_checkpoint(
        &self,
        spec: &SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        let backend = self.backend(spec.backend)?;
        let (ck, _in_use) = self.checkpoints.acquire(checkpoint_id)?;
        if ck.meta.backend != spec.backend || ck.meta.image != spec.image {
            return Err(NodeError::InvalidArgument(format!(
                "checkpoint {checkpoint_id} is of backend {} and image {:?}; the sandbox asks for {} and {:?}",
                ck.meta.backend, ck.meta.image, spec.backend, spec.image
            )));
        }
        if self.owner(&spec.id).is_ok() {
            return Err(NodeError::Conflict(format!(
                "sandbox {} already exists",
                spec.id
            )));
        }
        check_network_backend(spec.backend, &spec.network)?;
        let image = self.images.resolve(&spec.image).await?;
        let Some(taken_on) = ck.meta.image_version.clone() else {
            return backend.create(spec, &image, Some(&ck)).await;
        };
        let changed = |now: &str| {
            NodeError::Conflict(format!(
                "checkpoint {checkpoint_id} was taken on version {taken_on} of image {:?}, which is now version {now} (rebuilt, re-pulled or re-imported since); a fork would lay the checkpoint's files over the other version's, so take a new checkpoint",
                spec.image
            ))
        };
        if image.version() != taken_on {
            return Err(changed(&image.version()));
        }
        backend.create(spec, &image, Some(&ck)).await?;
        // A built-in image is mounted by its path: a rebuild between the check and the
        // fork's mount shows as a newer version now (versions never come back).
        let now = self.images.get(&spec.image).map(|i| i.version());
        if now.as_deref().is_ok_and(|v| *v == taken_on) {
            return Ok(());
        }
        let removed = backend.delete(&spec.id).await;
        Err(changed(now.as_deref().unwrap_or("gone")).with_cleanup(removed))
    }

    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        self.checkpoints.delete(checkpoint_id)
    }

    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        Ok(self.checkpoints.list())
    }

    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        let io = ExecIo {
            sink,
            control: None,
        };
        self.owner(id)?.exec(id, req, io).await
    }

    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: ExecControl,
    ) -> NodeResult<ExecResult> {
        let io = ExecIo {
            sink,
            control: Some(control),
        };
        self.owner(id)?.exec(id, req, io).await
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        self.owner(id)?.read_file(id, path, max_bytes).await
    }

    async fn agent_execs(&self, id: &str) -> NodeResult<crate::node::AgentExecs> {
        self.owner(id)?.agent_execs(id).await
    }

    async fn agent_forget(&self, id: &str, handle: &str) -> NodeResult<()> {
        self.owner(id)?.agent_forget(id, handle).await
    }

    async fn exec_reattach(
        &self,
        id: &str,
        sink: Option<ExecSink>,
        reattach: crate::node::ExecReattach,
    ) -> NodeResult<ExecResult> {
        self.owner(id)?.exec_reattach(id, sink, reattach).await
    }

    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        self.owner(id)?.file_size(id, path).await
    }

    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()> {
        self.owner(id)?.write_file(id, path, data).await
    }

    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        self.owner(id)?
            .write_file_stream(id, path, body, max_bytes)
            .await
    }

    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        self.owner(id)?.read_file_stream(id, path, max_bytes).await
    }

    async fn write_files_volatile(
        &self,
        id: &str,
        files: Vec<(String, bytes::Bytes)>,
    ) -> NodeResult<()> {
        self.owner(id)?.write_files_volatile(id, files).await
    }

    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        self.owner(id)?.list_dir(id, path).await
    }

    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        self.owner(id)?.remove_file(id, path).await
    }

    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        self.owner(id)?.stat_file(id, path).await
    }

    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        self.owner(id)?.make_dir(id, path, parents).await
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.owner(id)?.pause(id).await
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.owner(id)?.resume(id).await
    }

    /// The backend the snapshot's manifest names (`microvm`, `vm`) takes it over.
    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        let Some(store) = self.snapshot_store.clone() else {
            return Err(NodeError::NotFound(format!(
                "no shared snapshot of sandbox {id}: node has no --snapshot-dir"
            )));
        };
        crate::backends::check_id(id)?;
        let i = id.to_owned();
        let kind = match crate::sys::spawn_blocking(move || store.backend_of(&i))
            .await?
            .as_str()
        {
            "vm" => Backend::Vm,
            _ => Backend::Microvm,
        };
        match self.backend(kind) {
            Ok(b) => b.adopt_snapshot(id).await,
            Err(e) => Err(NodeError::NotFound(format!(
                "no shared snapshot of sandbox {id} can be taken here: {e}"
            ))),
        }
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        match self.owner(id) {
            Ok(b) => b.delete(id).await,
            // Unknown id: still let every backend clean up leftovers of that id on disk.
            Err(_) => {
                for b in self.backends.iter().filter_map(|b| b.get().ok()) {
                    b.delete(id).await?;
                }
                Ok(())
            }
        }
    }

    async fn list(&self) -> NodeResult<Vec<SandboxStatus>> {
        Ok(self
            .backends
            .iter()
            .filter_map(|b| b.get().ok())
            .flat_map(|b| b.list())
            .collect())
    }

    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        self.owner(id)?.connect_port(id, port).await
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let mut all = Vec::new();
        for b in self.backends.iter().filter_map(|b| b.get().ok()) {
            all.extend(b.readopt(keep).await?);
        }
        // Networks of the sandboxes every backend kept come back (nft objects re-applied,
        // resolvers restarted); every other leftover (veth, nft objects, netns file, state
        // file) goes. Once, after all backends: the pool and table are the node's.
        if let Err(e) = self.net.sweep(&all).await {
            match e {
                NodeError::Unavailable(_) => {
                    tracing::warn!(error = %e, "no network policies on this node")
                }
                e => {
                    tracing::error!(error = %e, "network sweep: leftovers not removed (retried at the next start)")
                }
            }
        }
        // The warm pool starts once the previous process's leftovers are gone.
        if let Some(f) = self.function() {
            f.start_warm_pool(self.images.clone(), self.pool.clone())?;
        }
        if let Some(c) = self.container() {
            c.start_warm_pool(self.images.clone(), self.container_pool.clone())?;
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandlot_api::NetworkPolicy;

    #[test]
    fn allow_policies_on_every_backend() {
        let allow: NetworkPolicy =
            serde_json::from_value(serde_json::json!({"allow": ["10.1.2.0/24"]})).unwrap();
        for b in [
            Backend::Function,
            Backend::Container,
            Backend::Microvm,
            Backend::Vm,
        ] {
            assert!(check_network_backend(b, &allow).is_ok(), "{b}");
            assert!(
                check_network_backend(b, &NetworkPolicy::None).is_ok(),
                "{b}"
            );
        }
    }
}
