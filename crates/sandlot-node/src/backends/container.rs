//! The `container` backend: OCI containers started through an OCI runtime CLI — `runc`
//! (default), `crun` (cgroup v2 hosts only), `runsc` (gVisor) — with `sandlot-guest agent`
//! as pid 1 serving execs over HTTP/2 on a unix socket (no `runc exec` per command).
//!
//! Host layout of one sandbox (`DATA/containers/<id>/`, which is also the OCI bundle):
//!
//! * `config.json` — the OCI runtime spec, generated with `oci-spec` (below).
//! * `disk.img` + `scratch/` — the writable layer's file system: a sparse ext4 image of
//!   `disk_mib` MiB loop-mounted at `scratch/` (the disk quota, see `crate::disk::mount_scratch`);
//!   `scratch/upper/`, `scratch/work/` — the overlayfs writable layer, owned by the
//!   container's root (`uid_base`); `rootfs/` — the overlay of the image layers +
//!   `scratch/upper/`, mounted on the host by the node (so it survives node restarts with
//!   the container).
//! * `agent.sock` (runc) — a unix socket bound and listened on by the NODE in the bundle
//!   directory (`0710 root:<uid_base>`); its listening fd is handed to the container
//!   (`--preserve-fds 1`, fd 3), where the agent accepts on it. Nothing in the container can
//!   reach, replace or redirect it, and after a node restart the node reconnects to the same
//!   path. `run/agent.sock` (runsc, which cannot take a listening fd) — bound by the agent
//!   in a host directory shared in gVisor's host-UDS mode, then made `0600` and owned by
//!   uid 65533 inside (as is `run/`), so commands (uid 0, no capabilities) cannot connect to
//!   or replace it.
//! * `netns` — with an allow policy: the network namespace the node made (see
//!   [`crate::net`]).
//! * `agent.log` — stdout/stderr of the container's pid 1 (the agent's own messages).
//! * `state.json` — [`ContainerState`], written once the agent answered; a directory without
//!   it is a half-created sandbox and is removed by `readopt`.
//!
//! The spec: namespaces pid, ipc, uts, mount, network (only `lo`, or `netns`), cgroup and
//! user, with uid/gid 0..65536 inside mapped to the sandbox's own host range (see
//! [`super::uids`]);
//! runc's default masked and read-only paths; a seccomp profile over the calls the agent
//! never needs (kernel modules, kexec, bpf, perf, keyrings, reboot, swap, handle-based
//! opens, userfaultfd, io_uring, clock setting, ...): ERRNO for those the exec filter does
//! not cover, LOG for those it refuses and reports (`REPORTED_BY_EXEC`: an ERRNO would
//! pre-empt the report); the agent keeps Docker's default
//! capability set plus `CAP_SYS_ADMIN` (inside the user namespace only) so it can give each
//! exec a pid namespace; every exec then runs `sandlot-guest exec` in `own_pid_ns` mode,
//! which drops every capability, sets no_new_privs and applies the function backend's
//! seccomp deny list before execve — commands see the same privileges on both backends.
//! Landlock is not applied in containers: their root may write its whole rootfs.
//!
//! Cgroups: the node creates the sandbox's group (`<parent>-ctr/<id>`, limits from the
//! spec, the same code as the function backend) and names it as `cgroupsPath`, so runc
//! joins it; runsc runs with `--ignore-cgroups` and is itself started inside the group, so
//! its sandbox and gofer are accounted there. Pause freezes that group. runc also makes the
//! container's group in the v1 hierarchies the node does not use (blkio, devices, ...);
//! delete removes those too ([`CgroupRoot::runtime_groups`]), as runc gives up on them while
//! exiting processes still hold them.
//!
//! Warm pool ([`pool`]): a runc create that the pool can serve takes a
//! ready container built under `DATA/container-pool/cp-<hex>` and renamed onto
//! `DATA/containers/<id>`; its runc id and cgroup keep the pooled name, recorded in
//! [`ContainerState`] (`runtime_id`, `cgroup`), through which every runtime call and cgroup
//! lookup goes.
//!
//! Runtime commands: `run --detach` and `delete --force`, through the `OciRuntimeCli`
//! trait of `container/runtime.rs` (the binaries; a recording fake in the unit tests, which
//! cover the pid-file and died-at-start checks and which runtime deletes which id).
//!
//! Exit and OOM: the agent reports each exec's status; `oom_killed` is the delta of the
//! container group's `oom_kill` counter over the exec (an overlapping exec's OOM kill is
//! counted too).
pub mod pool;
mod runtime;

use super::agent_exec;
use super::agent_files::{AgentFiles, HoldsAgent};
use super::check_id;
use super::function::{destroy_blocking, make_layer_dirs, own_dir};
use super::gvisor_audit;
use super::pause::{check_live, freeze, thaw};
use super::pool::WarmPool;
use super::saved::{self, SavedSandbox};
use super::uids::{UidLease, UidSlots};
use super::{ExecIo, SandboxBackend};
use crate::agent_client::AgentClient;
use crate::cgroups::{CgroupRoot, Limits, SandboxCgroup};
use crate::checkpoints::{Captured, Checkpoint};
use crate::images::Image;
use crate::net::{NetworkManager, NodeNet};
use crate::node::{NodeError, NodeResult, SandboxSpec, SandboxStatus};
use crate::sys::find_binary;
use crate::sys::{proc_starttime, spawn_blocking};
use async_trait::async_trait;
use pool::{pool_dir, spec_compatible, ContainerPool, Containers};
pub use runtime::RuntimeError;
use runtime::{tail, HostRuntime, OciRuntimeCli, RunRequest};
use sandlot_api::{Backend, ExecRequest, ExecResult};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, RwLock};

/// How long the agent may take to answer its first ping after the runtime returned.
const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long killing and removing cgroups may take.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// Where the agent binary is bind-mounted inside the container (read-only).
const AGENT_PATH: &str = "/.sandlot/sandlot-guest";
/// Memory (MiB) a runsc sandbox's cgroup gets on top of `memory_mib`: gVisor's sentry and
/// gofer live in it too.
const RUNSC_EXTRA_MIB: u64 = 96;
/// Tasks a runsc sandbox's cgroup gets on top of `pids_max`: the Go runtimes of the sentry
/// and gofer (about 25 threads idle) and their growth under load.
const RUNSC_EXTRA_PIDS: u64 = 128;
/// Uid (inside) owning runsc's agent socket directory: not 0, so commands (uid 0 without
/// capabilities) cannot replace the socket.
const AGENT_UID: u32 = 65_533;
/// Where runsc's agent socket directory is bind-mounted inside the container.
const AGENT_RUN_DIR: &str = "/.sandlot/run";

/// An OCI runtime CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    /// runc (default here).
    Runc,
    /// crun: needs a unified cgroup v2 host.
    Crun,
    /// gVisor's runsc: a user-space kernel between the container and the host.
    Runsc,
}

impl Runtime {
    /// Every runtime, in preference order.
    pub const ALL: [Runtime; 3] = [Runtime::Runc, Runtime::Crun, Runtime::Runsc];

    /// Its CLI name (`runc`, `crun`, `runsc`).
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Runc => "runc",
            Runtime::Crun => "crun",
            Runtime::Runsc => "runsc",
        }
    }

    /// Parses a CLI name.
    pub fn parse(s: &str) -> Option<Runtime> {
        Runtime::ALL.into_iter().find(|r| r.name() == s)
    }
}

/// Static configuration of the container backend.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// `DATA/containers`: one bundle directory per sandbox.
    pub dir: PathBuf,
    /// `DATA/runtime`: each runtime's state root (`--root DATA/runtime/<name>`).
    pub state_root: PathBuf,
    /// `DATA/disk-templates`: one formatted scratch-disk image per size ([`crate::disk`]).
    pub disk_templates: PathBuf,
    /// The statically linked `sandlot-guest` (bind-mounted into every container).
    pub agent_bin: PathBuf,
    /// Runtime used when a create names none.
    pub default_runtime: Runtime,
}

/// On-disk state of a running container: `DATA/containers/<id>/state.json` (see
/// [`saved`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContainerState {
    /// What every sandbox records (its `init_pid` is the agent's pid, for runsc the
    /// sandbox process's).
    #[serde(flatten)]
    pub saved: SavedSandbox,
    /// Which runtime runs it.
    pub runtime: Runtime,
    /// The OCI runtime's container id, where it is not `id`: a container handed over by
    /// the container pool keeps the id it was started under (`cp-<hex>`, see
    /// [`pool`]). Absent (older state files too) = `id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_id: Option<String>,
}

impl ContainerState {
    /// The OCI runtime's container id (`runtime_id`, else `id`).
    pub fn runtime_id(&self) -> &str {
        self.runtime_id.as_deref().unwrap_or(&self.saved.id)
    }
}

struct Container {
    state: ContainerState,
    _uids: UidLease,
    cgroup: SandboxCgroup,
    agent: AgentClient,
    deleting: RwLock<bool>,
    killed: watch::Sender<bool>,
    paused: AtomicBool,
    /// runsc: gVisor's debug log, where the sentry reports the exec filter's refusals.
    sentry: Option<Arc<gvisor_audit::SentryLog>>,
}

/// What the container backend and its pool share: configuration, cgroups, runtimes and
/// network policies (the pool's refill thread builds containers with it).
pub(crate) struct Core {
    pub(crate) cfg: ContainerConfig,
    /// Network policies (`network: {"allow": ...}`): the node's one manager, shared with
    /// the function backend and swept by [`crate::LocalNode`]'s readopt.
    net: Arc<NodeNet>,
    pub(crate) cgroups: CgroupRoot,
    /// Each runtime's binary, or why it cannot run here.
    runtimes: Vec<(Runtime, Result<PathBuf, String>)>,
    /// Runs the runtimes' commands ([`HostRuntime`]; unit tests: a recording fake).
    cli: Arc<dyn OciRuntimeCli>,
}

/// The container backend: containers by id.
pub struct ContainerBackend {
    core: Arc<Core>,
    uids: Arc<UidSlots>,
    boxes: Mutex<HashMap<String, Arc<Container>>>,
    /// The warm pool of ready runc containers, once started
    /// ([`ContainerBackend::start_warm_pool`]).
    pool: std::sync::OnceLock<ContainerPool>,
}

/// Where [`agent_copy`] puts the agent the containers bind-mount.
pub const AGENT_COPY_DIR: &str = "/run/sandlot/agent";

/// A copy of the agent binary `bin` named by its content, `dir/<first 32 hex digits of its
/// SHA-256>` (mode 0555; kept when already there), so that a container's
/// `/proc/self/mountinfo` names that file rather than the node's build or install path.
/// Copies of other builds are left (one per agent version a node ran since boot).
///
/// # Errors
/// Reading `bin`, creating `dir` or writing the copy.
pub fn agent_copy(bin: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    use sha2::Digest as _;
    use std::os::unix::fs::PermissionsExt;
    let data = std::fs::read(bin)?;
    let hex = crate::images::unpack::hex(&sha2::Sha256::digest(&data));
    let out = dir.join(&hex[..32]);
    if std::fs::read(&out).is_ok_and(|d| d == data) {
        return Ok(out);
    }
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".tmp-{}-{}", std::process::id(), &hex[..32]));
    std::fs::write(&tmp, &data)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o555))?;
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}

/// True when the ELF file at `p` has no program interpreter (statically linked): it must
/// run in images without a libc.
pub fn is_static_elf(p: &Path) -> bool {
    // The ELF header and the program headers sit at the file's start (read at node start,
    // several times: not the whole multi-MiB binary).
    use std::io::Read as _;
    let mut data = Vec::new();
    let Ok(f) = std::fs::File::open(p) else {
        return false;
    };
    if f.take(64 * 1024).read_to_end(&mut data).is_err() {
        return false;
    }
    // ELF64 little-endian: e_phoff at 0x20, e_phentsize at 0x36, e_phnum at 0x38; PT_INTERP = 3.
    if data.len() < 0x40 || &data[..4] != b"\x7fELF" || data[4] != 2 {
        return false;
    }
    let rd16 = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[0x20..0x28].try_into().unwrap()) as usize;
    let (size, n) = (rd16(0x36), rd16(0x38));
    (0..n).all(|i| {
        let o = phoff + i * size;
        o + 4 <= data.len() && u32::from_le_bytes(data[o..o + 4].try_into().unwrap()) != 3
    })
}

impl ContainerBackend {
    /// An exec through the agent; with `control`, stdin streams and signals reach it.
    async fn run_exec(&self, id: &str, req: &ExecRequest, io: ExecIo) -> NodeResult<ExecResult> {
        let c = self.get(id)?;
        let life = (&c.deleting, &c.killed, &c.paused);
        let (guard, mut killed, mut plan) =
            agent_exec::begin(id, life, &c.state.saved.image_env, &c.state.saved.spec, req).await?;
        if c.state.runtime == Runtime::Runsc {
            // gVisor's processes are invisible to the host pids cgroup (which also holds
            // gVisor itself): its own RLIMIT_NPROC bounds the sandbox's processes instead.
            plan.spec.rlimits.push(sandlot_guest::spec::Rlimit {
                resource: sandlot_guest::spec::RlimitResource::Nproc,
                value: c.state.saved.spec.pids_max,
            });
        }
        let oom_before = c.cgroup.group().oom_kills();
        let (pid, start) = (c.state.saved.init_pid, c.state.saved.init_starttime);
        let died = move || proc_starttime(pid) != Some(start);
        let target = agent_exec::Target {
            id,
            kind: "container",
            agent: &c.agent,
            pids_max: c.state.saved.spec.pids_max,
            died: &died,
        };
        let window = c.sentry.as_ref().map(|s| s.begin());
        let started = gvisor_audit::now_ms();
        let mut res =
            agent_exec::run(target, plan, guard, &mut killed, io.sink, io.control).await?;
        if let Some(w) = window {
            res.violations.extend(w.finish());
        }
        // What the network policy refused while this exec ran (DNS queries, packets).
        if let Some(net) = self.core.net.started() {
            let room =
                sandlot_guest::spec::MAX_VIOLATIONS_PER_EXEC.saturating_sub(res.violations.len());
            let refused = net.violations(id, started, gvisor_audit::now_ms());
            res.violations.extend(refused.into_iter().take(room));
        }
        res.oom_killed = match (oom_before, c.cgroup.group().oom_kills()) {
            (Some(a), Some(b)) => b > a,
            _ => false,
        };
        Ok(res)
    }

    /// A backend storing bundles under `cfg.dir`, cgroups under `cgroups` (a parent of
    /// their own: the function backend removes groups it does not know under its parent),
    /// host uid ranges from `uids` (shared with the function backend).
    ///
    /// # Errors
    /// `Unavailable` when the agent binary is missing or not static, or no runtime exists;
    /// `Internal` when the directories cannot be created.
    pub fn new(
        mut cfg: ContainerConfig,
        cgroups: CgroupRoot,
        uids: Arc<UidSlots>,
        net: Arc<NodeNet>,
    ) -> NodeResult<Self> {
        // The bundle's bind mount needs an absolute source (runc would resolve a relative
        // one against the bundle).
        if let Ok(abs) = std::fs::canonicalize(&cfg.agent_bin) {
            cfg.agent_bin = abs;
        }
        if !is_static_elf(&cfg.agent_bin) {
            return Err(NodeError::Unavailable(format!(
                "the container backend needs a statically linked sandlot-guest; {} is missing or dynamic (scripts/setup.sh builds one, or set SANDLOT_AGENT_BIN)",
                cfg.agent_bin.display()
            )));
        }
        // Security: the bind mount's source path shows in the container's mountinfo
        // (`/work/…/target/…/sandlot-guest` told a sandbox the node's build tree).
        match agent_copy(&cfg.agent_bin, Path::new(AGENT_COPY_DIR)) {
            Ok(p) => cfg.agent_bin = p,
            Err(e) => tracing::warn!(
                agent = %cfg.agent_bin.display(),
                error = %e,
                "no content-addressed copy of the agent under {AGENT_COPY_DIR}; containers bind-mount it from its own path, which their mountinfo shows"
            ),
        }
        let v2 = cgroups.version() == crate::cgroups::CgroupVersion::V2;
        let runtimes: Vec<(Runtime, Result<PathBuf, String>)> = Runtime::ALL
            .into_iter()
            .map(|r| {
                let found = find_binary(r.name())
                    .ok_or_else(|| format!("runtime {} is not installed", r.name()));
                let ok = match (r, found) {
                    (Runtime::Crun, Ok(_)) if !v2 => Err(
                        "runtime crun needs a unified cgroup v2 host (this host is cgroup v1)"
                            .to_string(),
                    ),
                    (_, f) => f,
                };
                (r, ok)
            })
            .collect();
        if !runtimes.iter().any(|(_, b)| b.is_ok()) {
            return Err(NodeError::Unavailable(
                "no OCI runtime (runc, crun, runsc) is installed".into(),
            ));
        }
        // runc pivots into the rootfs as the container's root, an unprivileged host uid: it
        // must be able to walk down to DATA/containers/<id>/rootfs.
        let abs = std::path::absolute(&cfg.dir).unwrap_or_else(|_| cfg.dir.clone());
        for a in abs.ancestors().skip(1) {
            if let Ok(md) = std::fs::metadata(a) {
                if md.permissions().mode() & 0o001 == 0 {
                    return Err(NodeError::Unavailable(format!(
                        "{} (mode {:o}) is not searchable by other users; containers run as unprivileged host uids that must reach {}: use a data directory whose parents are o+x",
                        a.display(),
                        md.permissions().mode() & 0o7777,
                        abs.display()
                    )));
                }
            }
        }
        for d in [&cfg.dir, &cfg.state_root] {
            std::fs::create_dir_all(d)
                .map_err(|e| NodeError::io(format!("create {}", d.display()), e))?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711))
                .map_err(|e| NodeError::io(format!("chmod {}", d.display()), e))?;
        }
        cgroups.ensure_parent()?;
        Ok(ContainerBackend {
            core: Arc::new(Core {
                net,
                cli: Arc::new(HostRuntime::new(cfg.state_root.clone())),
                cfg,
                cgroups,
                runtimes,
            }),
            uids,
            boxes: Mutex::new(HashMap::new()),
            pool: std::sync::OnceLock::new(),
        })
    }

    /// Each runtime with its binary or the reason it is unavailable.
    pub fn runtimes(&self) -> &[(Runtime, Result<PathBuf, String>)] {
        &self.core.runtimes
    }

    fn get(&self, id: &str) -> NodeResult<Arc<Container>> {
        self.boxes
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("sandbox {id} not found")))
    }
}

impl Core {
    pub(crate) fn runtime_bin(&self, r: Runtime) -> NodeResult<PathBuf> {
        match self.runtimes.iter().find(|(k, _)| *k == r) {
            Some((_, Ok(p))) => Ok(p.clone()),
            Some((_, Err(why))) => Err(NodeError::Unavailable(why.clone())),
            None => Err(NodeError::Unavailable(format!(
                "runtime {} unknown",
                r.name()
            ))),
        }
    }

    /// The node's network manager, created on first use (state in `DATA/net`).
    async fn net(&self) -> NodeResult<Arc<NetworkManager>> {
        self.net.get().await
    }

    pub(crate) fn dir_of(&self, id: &str) -> PathBuf {
        self.cfg.dir.join(id)
    }

    #[allow(clippy::too_many_arguments)]
    /// Build and start container `spec.id` in the claimed bundle directory `dir` with
    /// cgroup `cg` (named `spec.id`: it is the bundle's `cgroupsPath`) and host uid range
    /// `uid_base`; its writable layer is seeded from `seed` (a fork). Used by cold creates
    /// and by the warm pool (`spec.id` = the pooled name). On error whatever was made is
    /// left for the caller's destroy.
    ///
    /// # Errors
    /// `Unavailable` (network policies), `InvalidArgument` (a seed larger than the disk),
    /// `Internal` (mounts, cgroups, the runtime, the agent not answering).
    pub(crate) async fn create_inner(
        &self,
        dir: &Path,
        spec: &SandboxSpec,
        image: &Image,
        runtime: Runtime,
        bin: &Path,
        uid_base: u32,
        cg: &SandboxCgroup,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<ContainerState> {
        let dir = dir.to_path_buf();
        // Phase timings for the debug log (where a create's time goes).
        let t0 = Instant::now();
        // runsc: gVisor's own processes and threads (sentry, gofer, one stub process per
        // guest process) share the group, so it gets room for them on top of the spec.
        let (extra_mib, extra_pids) = match runtime {
            Runtime::Runsc => (RUNSC_EXTRA_MIB, RUNSC_EXTRA_PIDS),
            _ => (0, 0),
        };
        let limits = Limits {
            memory_bytes: (spec.memory_mib + extra_mib) << 20,
            cpu: spec.cpu,
            pids_max: spec.pids_max + extra_pids,
        };
        {
            let (dir, cg) = (dir.clone(), cg.clone());
            let lowers: Vec<PathBuf> = image.layers.clone();
            let disk_mib = spec.disk_mib;
            let templates = self.cfg.disk_templates.clone();
            // A fork: the checkpoint's layer, re-owned from the parent's id range to ours.
            let seed = seed.map(|ck| (ck.layer(), ck.meta.uid_base.map(|f| (f, uid_base))));
            // gVisor shows a /proc and /sys of its own (no host facts): runc and crun only.
            let views = match runtime {
                Runtime::Runsc => None,
                _ => Some(super::function::proc_views(spec)?),
            };
            // The cgroup does not depend on the disk: made at the same time (on a failure
            // the caller's destroy removes whatever of both exists).
            let cgroup = spawn_blocking(move || Ok(cg.create(&limits)?));
            let disk = spawn_blocking(move || {
                // Only root and the container's root (group `uid_base`) may walk in: no other
                // host user reaches the rootfs, the scratch disk or the socket.
                std::os::unix::fs::chown(&dir, Some(0), Some(uid_base))
                    .and_then(|_| {
                        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o710))
                    })
                    .map_err(|e| NodeError::io(format!("chmod {}", dir.display()), e))?;
                crate::disk::mount_scratch(&templates, &dir, disk_mib)?;
                if let Some((layer, shift)) = &seed {
                    // The copy goes into the fork's own disk: full means disk_mib is too
                    // small for the checkpoint, the caller's choice (400), not the node's.
                    crate::checkpoints::copy_layer(layer, &dir.join("scratch/upper"), *shift)
                        .map_err(|e| match e {
                            NodeError::ResourceExhausted(m) => NodeError::InvalidArgument(format!(
                                "disk_mib {disk_mib} is too small: {m}"
                            )),
                            e => e,
                        })?;
                }
                make_layer_dirs(&dir.join("scratch"), uid_base)?;
                if let Some(views) = &views {
                    write_proc_views(&dir, views)?;
                }
                // A machine-id(5) of its own (a fork's replaces its checkpoint's).
                crate::checkpoints::write_machine_id(&dir.join("scratch/upper"), uid_base)?;
                own_dir(&dir.join("rootfs"), uid_base, 0o755)?;
                mount_overlay(&dir, &lowers)?;
                // /tmp lives on the writable layer (under the disk quota), world-writable.
                // (`symlink_metadata`: a symlink there is replaced, never followed.)
                let tmp = dir.join("rootfs/tmp");
                if !std::fs::symlink_metadata(&tmp).is_ok_and(|m| m.is_dir()) {
                    own_dir(&tmp, uid_base, 0o1777)?;
                }
                Ok(())
            });
            let (disk, cgroup) = tokio::join!(disk, cgroup);
            disk?;
            cgroup?;
        }
        // runc: the node binds the socket and hands the listening fd over. runsc cannot take
        // a listening socket, so its agent binds one in `run/`, a host directory shared with
        // the sandbox (gVisor's host-UDS mode) that only the agent may write: it is owned by
        // uid 65533 inside, and commands run as uid 0 without capabilities.
        let t_prep = t0.elapsed();
        let listener = if runtime == Runtime::Runsc {
            let run = dir.join("run");
            std::fs::create_dir(&run)
                .and_then(|_| {
                    std::os::unix::fs::chown(
                        &run,
                        Some(uid_base + AGENT_UID),
                        Some(uid_base + AGENT_UID),
                    )
                })
                .and_then(|_| {
                    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755))
                })
                .map_err(|e| NodeError::io(format!("create {}", run.display()), e))?;
            None
        } else {
            Some(
                std::os::unix::net::UnixListener::bind(agent_socket(&dir, runtime))
                    .map_err(|e| NodeError::io(format!("bind {}/agent.sock", dir.display()), e))?,
            )
        };
        // An allow policy: a network namespace of our own with the veth, firewall and
        // resolver ready before any process of the sandbox starts.
        let netns = match &spec.network {
            sandlot_api::NetworkPolicy::None => None,
            sandlot_api::NetworkPolicy::Allow(policy) => {
                let net = self.net().await?;
                let path = dir.join("netns");
                let p = path.clone();
                spawn_blocking(move || crate::net::create_netns(&p)).await?;
                let att = net.attach(&spec.id, &path, policy).await?;
                // Resolved inside the rootfs (image and fork layers are untrusted: an `etc`
                // symlink must not lead the write to a host path).
                let rootfs = dir.join("rootfs");
                sandlot_guest::sandbox_fs::SandboxFs::open(&rootfs, uid_base, uid_base)
                    .and_then(|fs| fs.write("/etc/resolv.conf", att.resolv_conf().as_bytes()))
                    .map_err(|e| {
                        NodeError::io(
                            format!("write {}/etc/resolv.conf", rootfs.display()),
                            std::io::Error::other(e.to_string()),
                        )
                    })?;
                Some(path)
            }
        };
        let cfg = bundle_spec(
            &spec.id,
            runtime,
            uid_base,
            &format!("/{}/{}", self.cgroups.parent(), spec.id),
            &self.cfg.agent_bin,
            &dir,
            netns.as_deref(),
        )?;
        cfg.save(dir.join("config.json")).map_err(|e| {
            NodeError::io("write config.json", std::io::Error::other(e.to_string()))
        })?;

        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))
            .map_err(|e| NodeError::io(format!("create {}/agent.log", dir.display()), e))?;
        let mut flags = Vec::new();
        if runtime == Runtime::Runsc {
            // The sentry's refusals of the exec deny list, through its debug log.
            gvisor_audit::prepare(&dir)
                .map_err(|e| NodeError::io(format!("mkfifo {}", dir.display()), e))?;
            flags.extend(gvisor_audit::runsc_run_args(&dir));
        }
        if runtime == Runtime::Runsc && netns.is_some() {
            // gVisor's sentry joins the namespace the node made and uses the kernel's
            // network stack there (hostinet; the later flag wins over `--network=none`).
            // Its own netstack (`--network=sandbox`) would be the deeper layer, but
            // runsc 20240729 refuses it on this kernel: it takes any namespace that has
            // /proc/sys/net/core/rmem_default for the host's (fixed in gVisor 20240801).
            flags.push("--network=host".into());
        }
        let t_spawn = t0.elapsed();
        let (pid_file, log_path) = (dir.join("init.pid"), dir.join("agent.log"));
        let (pid, starttime) = self
            .start(RunRequest {
                runtime,
                bin,
                id: &spec.id,
                bundle: &dir,
                pid_file: &pid_file,
                flags,
                listen_fd: listener.as_ref().map(|l| l.as_fd()),
                join_procs: match runtime {
                    Runtime::Runsc => cg.group().procs_files(),
                    _ => Vec::new(),
                },
                log,
                log_path: &log_path,
            })
            .await?;
        let t_runtime = t0.elapsed();
        drop(listener);
        let agent = AgentClient::new(agent_socket(&dir, runtime));
        agent
            .wait_ready(Instant::now() + AGENT_READY_TIMEOUT)
            .await?;
        let t_ready = t0.elapsed();
        tracing::debug!(
            sandbox = %spec.id,
            prep_ms = t_prep.as_secs_f64() * 1e3,
            bundle_ms = (t_spawn - t_prep).as_secs_f64() * 1e3,
            runtime_ms = (t_runtime - t_spawn).as_secs_f64() * 1e3,
            ready_ms = (t_ready - t_runtime).as_secs_f64() * 1e3,
            "container create phases"
        );
        let state = ContainerState {
            saved: SavedSandbox::new(spec, image, (pid, starttime), uid_base),
            runtime,
            runtime_id: None,
        };
        saved::write(&dir, &state)?;
        Ok(state)
    }

    /// `run --detach` of `req`, then the container's init as `(host pid, start time)`: the
    /// pid from the runtime's pid file, alive right after the runtime returned.
    ///
    /// # Errors
    /// The runtime's ([`OciRuntimeCli::run`]); [`RuntimeError::NoPidFile`] when it succeeded
    /// without a readable pid file; [`RuntimeError::DiedAtStart`] (with the end of the log)
    /// when that process is already gone.
    async fn start(&self, req: RunRequest<'_>) -> Result<(i32, u64), RuntimeError> {
        let (runtime, id) = (req.runtime, req.id.to_string());
        let (pid_file, log_path) = (req.pid_file.to_path_buf(), req.log_path.to_path_buf());
        self.cli.run(req).await?;
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or(RuntimeError::NoPidFile {
                runtime: runtime.name(),
                path: pid_file,
            })?;
        let starttime = proc_starttime(pid).ok_or_else(|| RuntimeError::DiedAtStart {
            id,
            log: tail(
                &std::fs::read_to_string(&log_path).unwrap_or_default(),
                2000,
            )
            .to_string(),
        })?;
        Ok((pid, starttime))
    }

    /// Runtime delete of container `runtime_id` (every runtime when `runtime` is unknown),
    /// removal of network `net_id` (when given), then the host resources: the mounts under
    /// `dir`, cgroup `cgroup` and `dir` itself.
    pub(crate) async fn destroy_at(
        &self,
        dir: &Path,
        runtime_id: &str,
        cgroup: &str,
        runtime: Option<Runtime>,
        net_id: Option<&str>,
    ) -> NodeResult<()> {
        let dir = dir.to_path_buf();
        let cg = self.cgroups.sandbox(cgroup);
        let runtime_cg = self.cgroups.runtime_groups(cgroup);
        // Thaw first: a frozen container cannot be killed on cgroup v1.
        let _ = cg.group().thaw();
        let candidates: Vec<Runtime> = match runtime {
            Some(r) => vec![r],
            None => Runtime::ALL.to_vec(),
        };
        for r in candidates {
            if let Ok(bin) = self.runtime_bin(r) {
                // Best effort: a container the runtime does not know (never started, or
                // already deleted) fails here, and the host clean-up goes on.
                let _ = self.cli.delete_force(r, &bin, runtime_id).await;
            }
        }
        gvisor_audit::forget(&dir);
        let net = match (self.net.started(), net_id) {
            (Some(net), Some(id)) => net.teardown(id).await,
            _ => Ok(()),
        };
        let host = spawn_blocking(move || {
            // The rootfs overlay and the scratch disk are this backend's own host mounts
            // (expected, so no warning); anything else left is reported by the shared
            // cleanup. Detached: a runtime process may still hold them for a moment.
            for m in ["rootfs", "scratch"] {
                let _ = nix::mount::umount2(&dir.join(m), nix::mount::MntFlags::MNT_DETACH);
            }
            let host = destroy_blocking(&cg, &dir);
            // After the processes are gone (destroy_blocking waited for them in `cg`).
            let runtime = runtime_cg.remove(Instant::now() + KILL_TIMEOUT);
            host.and(runtime.map_err(NodeError::from))
        })
        .await;
        host.and(net)
    }
}

impl ContainerBackend {
    /// Whether cgroup `name` belongs to a known container (under another name: handed
    /// over by the pool) or to the container pool itself.
    fn cgroup_in_use(&self, name: &str) -> bool {
        self.boxes
            .lock()
            .unwrap()
            .values()
            .any(|c| c.state.saved.cgroup_name() == name)
            || self.pool.get().is_some_and(|p| p.owns(name))
    }

    /// Start the warm pool of ready runc containers (see [`pool`]); a
    /// second call does nothing, nor does a pool of size 0, no image, or no runc. Call it
    /// after `readopt`, which clears the previous process's cgroups first.
    ///
    /// # Errors
    /// `Internal` when the pool directory or its thread cannot be created.
    pub fn start_warm_pool(
        &self,
        images: crate::images::ImageStore,
        cfg: super::pool::PoolConfig,
    ) -> NodeResult<()> {
        if cfg.per_image > 0 && !cfg.images.is_empty() {
            if let Err(e) = self.core.runtime_bin(Runtime::Runc) {
                tracing::info!(error = %e, "container pool off: it keeps runc containers only");
                return Ok(());
            }
        }
        let containers = Containers {
            core: self.core.clone(),
        };
        let dir = pool_dir(&self.core.cfg.dir);
        WarmPool::start_once(&self.pool, containers, dir, self.uids.clone(), images, cfg)
    }

    /// The container pool, when started.
    pub fn warm_pool(&self) -> Option<&ContainerPool> {
        self.pool.get()
    }

    fn adopt(&self, state: ContainerState, uids: UidLease) -> Arc<Container> {
        let c = Arc::new(Container {
            cgroup: self.core.cgroups.sandbox(state.saved.cgroup_name()),
            agent: AgentClient::new(agent_socket(
                &self.core.dir_of(&state.saved.id),
                state.runtime,
            )),
            _uids: uids,
            deleting: RwLock::new(false),
            killed: watch::channel(false).0,
            paused: AtomicBool::new(false),
            sentry: match state.runtime {
                Runtime::Runsc => gvisor_audit::attach(&self.core.dir_of(&state.saved.id)),
                _ => None,
            },
            state,
        });
        c.paused
            .store(c.cgroup.group().is_frozen(), Ordering::SeqCst);
        self.boxes
            .lock()
            .unwrap()
            .insert(c.state.saved.id.clone(), c.clone());
        c
    }

    /// Runtime delete (kills and forgets the container), then the host resources. The
    /// runtime id and cgroup come from the known container or its `state.json` (a container
    /// handed over by the pool keeps its pooled names), else they are `id`.
    async fn destroy(&self, id: &str, runtime: Option<Runtime>) -> NodeResult<()> {
        let dir = self.core.dir_of(id);
        let known = self
            .boxes
            .lock()
            .unwrap()
            .get(id)
            .map(|c| c.state.clone())
            .or_else(|| saved::read::<ContainerState>(&dir));
        let runtime = runtime.or(known.as_ref().map(|s| s.runtime));
        let (rid, cg) = known
            .as_ref()
            .map_or((id, id), |s| (s.runtime_id(), s.saved.cgroup_name()));
        self.core.destroy_at(&dir, rid, cg, runtime, Some(id)).await
    }
}

/// Host path of the agent's socket of the container in `dir`.
fn agent_socket(dir: &Path, runtime: Runtime) -> PathBuf {
    match runtime {
        Runtime::Runsc => dir.join("run").join("agent.sock"),
        _ => dir.join("agent.sock"),
    }
}

/// Writes the sandbox's `/proc` stand-ins ([`sandlot_guest::procview`], `(name, content)`)
/// to `dir/scratch/procview/<name>`, in place when they exist (the container's bind mounts
/// hold their inodes: a warm-pool hand-over rewrites them for the sandbox's limits).
///
/// They live on the scratch disk, a file system of its own, so the binds' root in the
/// container's mountinfo is `/procview/<name>`, not a host path. Owned by host root, mode
/// 0444, outside the overlay's upper dir: the container cannot reach or change them.
pub(crate) fn write_proc_views(dir: &Path, views: &[(String, String)]) -> NodeResult<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let d = dir.join("scratch/procview");
    match std::fs::create_dir(&d) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(NodeError::io(format!("create {}", d.display()), e)),
    }
    for (name, content) in views {
        let p = d.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o444)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&p)
            .and_then(|mut f| f.write_all(content.as_bytes()))
            .map_err(|e| NodeError::io(format!("write {}", p.display()), e))?;
    }
    Ok(())
}

/// Mounts the overlay of `lowers` (top-most first) + `dir/scratch/upper` at `dir/rootfs`.
///
/// Security: the options name the upper and work dirs through `/proc/self/fd/N`
/// descriptors ([`sandlot_guest::layers`]), not by their data-directory paths: the
/// container reads its mountinfo.
fn mount_overlay(dir: &Path, lowers: &[PathBuf]) -> NodeResult<()> {
    let opts = sandlot_guest::layers::layer_options(
        lowers,
        &dir.join("scratch/upper"),
        &dir.join("scratch/work"),
    )
    .map_err(|e| NodeError::io(format!("open the layers of {}/rootfs", dir.display()), e))?;
    nix::mount::mount(
        Some("overlay"),
        &dir.join("rootfs"),
        Some("overlay"),
        // nosuid: the mount is on the host, where a setuid file of the image or of the
        // sandbox must never run with its owner's rights.
        nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOSUID,
        Some(opts.options.as_str()),
    )
    .map_err(|e| {
        NodeError::io(
            format!("mount overlay at {}/rootfs", dir.display()),
            e.into(),
        )
    })
}

/// Syscalls the container's seccomp profile refuses (EPERM) for every process in it, the
/// agent included: none of them is needed to run commands, and each is a known path to
/// the host kernel's most sensitive code (Docker's default profile denies them too).
/// Execs add the function backend's stricter filter on top.
const DENIED: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fanotify_init",
    "get_kernel_syms",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "iopl",
    "ioperm",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "perf_event_open",
    "process_vm_readv",
    "process_vm_writev",
    "query_module",
    "quotactl",
    "reboot",
    "request_key",
    "settimeofday",
    "stime",
    "swapoff",
    "swapon",
    "sysfs",
    "_sysctl",
    "uselib",
    "userfaultfd",
    "ustat",
    "vm86",
    "vm86old",
];

/// Calls of [`DENIED`] that every exec's own filter (`sandlot-guest exec`, crate
/// `sandlot-guest` `seccomp.rs`) refuses and *reports* (SECCOMP_RET_USER_NOTIF). The
/// container profile answers these with `SCMP_ACT_LOG` instead of ERRNO: the kernel keeps
/// the highest-precedence verdict of all filters (seccomp(2): ERRNO > USER_NOTIF > LOG), so
/// an ERRNO here would refuse them before the exec's supervisor hears of them. Commands
/// always run under the exec filter (it is installed before execve and cannot be removed),
/// so they are still refused; only the agent itself, which never makes these calls, is
/// logged (kernel audit log) rather than refused.
const REPORTED_BY_EXEC: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "delete_module",
    "fanotify_init",
    "finit_module",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "name_to_handle_at",
    "open_by_handle_at",
    "perf_event_open",
    "process_vm_readv",
    "process_vm_writev",
    "quotactl",
    "reboot",
    "request_key",
    "settimeofday",
    "swapoff",
    "swapon",
    "userfaultfd",
];

/// The OCI runtime spec of one container (runtime-spec 1.0, `config.json`).
fn bundle_spec(
    id: &str,
    runtime: Runtime,
    uid_base: u32,
    cgroups_path: &str,
    agent_bin: &Path,
    bundle_dir: &Path,
    netns: Option<&Path>,
) -> NodeResult<oci_spec::runtime::Spec> {
    use oci_spec::runtime::*;
    let bad = |e: oci_spec::OciSpecError| {
        NodeError::io("build OCI spec", std::io::Error::other(e.to_string()))
    };
    let mut spec = Spec::default();
    let caps: std::collections::HashSet<Capability> = [
        Capability::Chown,
        Capability::DacOverride,
        Capability::Fsetid,
        Capability::Fowner,
        Capability::Mknod,
        Capability::NetRaw,
        Capability::Setgid,
        Capability::Setuid,
        Capability::Setfcap,
        Capability::Setpcap,
        Capability::NetBindService,
        Capability::SysChroot,
        Capability::Kill,
        Capability::AuditWrite,
        Capability::SysAdmin,
    ]
    .into_iter()
    .collect();
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(
            UserBuilder::default()
                .uid(0u32)
                .gid(0u32)
                .build()
                .map_err(bad)?,
        )
        .args(if runtime == Runtime::Runsc {
            vec![
                AGENT_PATH.to_string(),
                "agent".into(),
                "--listen".into(),
                format!("{AGENT_RUN_DIR}/agent.sock"),
                "--socket-owner".into(),
                AGENT_UID.to_string(),
            ]
        } else {
            vec![
                AGENT_PATH.to_string(),
                "agent".into(),
                "--listen-fd".into(),
                "3".into(),
            ]
        })
        .env(vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        ])
        .cwd("/")
        .no_new_privileges(true)
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(caps.clone())
                .effective(caps.clone())
                .permitted(caps)
                .build()
                .map_err(bad)?,
        )
        .rlimits(vec![PosixRlimitBuilder::default()
            .typ(PosixRlimitType::RlimitNofile)
            .hard(1024u64)
            .soft(1024u64)
            .build()
            .map_err(bad)?])
        .build()
        .map_err(bad)?;
    spec.set_process(Some(process));
    spec.set_root(Some(
        RootBuilder::default()
            .path("rootfs")
            .readonly(false)
            .build()
            .map_err(bad)?,
    ));
    spec.set_hostname(Some(id.to_string()));
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    if netns.is_some() {
        // A network namespace made by the node belongs to the host's user namespace, where
        // the container may not mount sysfs; bind the host's read-only, as rootless runc
        // does (/sys/firmware stays masked).
        for m in mounts
            .iter_mut()
            .filter(|m| m.destination() == Path::new("/sys"))
        {
            *m = MountBuilder::default()
                .destination("/sys")
                .typ("none")
                .source("/sys")
                .options(vec![
                    "rbind".into(),
                    "nosuid".into(),
                    "noexec".into(),
                    "nodev".into(),
                    "ro".into(),
                ])
                .build()
                .map_err(bad)?;
        }
    }
    if runtime == Runtime::Runsc {
        mounts.push(
            MountBuilder::default()
                .destination(AGENT_RUN_DIR)
                .typ("bind")
                .source(bundle_dir.join("run"))
                .options(vec![
                    "bind".into(),
                    "rw".into(),
                    "nosuid".into(),
                    "nodev".into(),
                    "noexec".into(),
                ])
                .build()
                .map_err(bad)?,
        );
        // gVisor mounts a tmpfs of its own on /tmp unless the spec names one; bind the
        // rootfs's /tmp instead, so /tmp is on the writable layer (and its quota) as in runc.
        mounts.push(
            MountBuilder::default()
                .destination("/tmp")
                .typ("bind")
                .source(bundle_dir.join("rootfs/tmp"))
                .options(vec![
                    "bind".into(),
                    "rw".into(),
                    "nosuid".into(),
                    "nodev".into(),
                ])
                .build()
                .map_err(bad)?,
        );
    }
    mounts.push(
        MountBuilder::default()
            .destination(AGENT_PATH)
            .typ("bind")
            .source(agent_bin)
            .options(vec![
                "bind".into(),
                "ro".into(),
                "nosuid".into(),
                "nodev".into(),
            ])
            .build()
            .map_err(bad)?,
    );
    if runtime != Runtime::Runsc {
        // The sandbox's own meminfo, cpuinfo, stat and loadavg (`write_proc_views`); runc
        // allows binds onto exactly such /proc files (its `checkProcMount` list).
        for name in sandlot_guest::procview::VIEW_FILES {
            mounts.push(
                MountBuilder::default()
                    .destination(format!("/proc/{name}"))
                    .typ("bind")
                    .source(bundle_dir.join("scratch/procview").join(name))
                    .options(vec![
                        "bind".into(),
                        "ro".into(),
                        "nosuid".into(),
                        "nodev".into(),
                        "noexec".into(),
                    ])
                    .build()
                    .map_err(bad)?,
            );
        }
    }
    spec.set_mounts(Some(mounts));
    let map = LinuxIdMappingBuilder::default()
        .container_id(0u32)
        .host_id(uid_base)
        .size(super::uids::UID_COUNT)
        .build()
        .map_err(bad)?;
    let mut linux = Linux::default();
    let mut namespaces = linux.namespaces().clone().unwrap_or_default();
    namespaces.retain(|n| n.typ() != LinuxNamespaceType::User);
    if let Some(path) = netns {
        namespaces.retain(|n| n.typ() != LinuxNamespaceType::Network);
        namespaces.push(
            LinuxNamespaceBuilder::default()
                .typ(LinuxNamespaceType::Network)
                .path(path)
                .build()
                .map_err(bad)?,
        );
    }
    namespaces.push(
        LinuxNamespaceBuilder::default()
            .typ(LinuxNamespaceType::User)
            .build()
            .map_err(bad)?,
    );
    if !namespaces
        .iter()
        .any(|n| n.typ() == LinuxNamespaceType::Cgroup)
    {
        namespaces.push(
            LinuxNamespaceBuilder::default()
                .typ(LinuxNamespaceType::Cgroup)
                .build()
                .map_err(bad)?,
        );
    }
    linux.set_namespaces(Some(namespaces));
    if runtime != Runtime::Runsc {
        // Host facts (`sandlot_guest::procview`): runc binds /dev/null over a masked file
        // and an empty read-only tmpfs over a masked directory, after every mount; entries
        // missing on this kernel are skipped. gVisor's /proc and /sys are its own.
        use sandlot_guest::procview::{MASKED_PROC_DIRS, MASKED_PROC_FILES, MASKED_SYS_DIRS};
        let mut masked = linux.masked_paths().clone().unwrap_or_default();
        masked.extend(
            MASKED_PROC_FILES
                .iter()
                .chain(MASKED_PROC_DIRS)
                .map(|n| format!("/proc/{n}"))
                .chain(MASKED_SYS_DIRS.iter().map(|n| format!("/sys/{n}"))),
        );
        masked.sort();
        masked.dedup();
        linux.set_masked_paths(Some(masked));
    }
    linux.set_uid_mappings(Some(vec![map]));
    linux.set_gid_mappings(Some(vec![map]));
    if runtime != Runtime::Runsc {
        linux.set_cgroups_path(Some(PathBuf::from(cgroups_path)));
    }
    linux.set_resources(Some(
        LinuxResourcesBuilder::default()
            .devices(vec![LinuxDeviceCgroupBuilder::default()
                .allow(false)
                .access("rwm")
                .build()
                .map_err(bad)?])
            .build()
            .map_err(bad)?,
    ));
    linux.set_seccomp(Some(
        LinuxSeccompBuilder::default()
            .default_action(LinuxSeccompAction::ScmpActAllow)
            .architectures(vec![
                Arch::ScmpArchX86_64,
                Arch::ScmpArchX86,
                Arch::ScmpArchX32,
            ])
            .syscalls(vec![
                LinuxSyscallBuilder::default()
                    .names(
                        DENIED
                            .iter()
                            .filter(|s| !REPORTED_BY_EXEC.contains(s))
                            .map(|s| s.to_string())
                            .collect::<Vec<_>>(),
                    )
                    .action(LinuxSeccompAction::ScmpActErrno)
                    .errno_ret(libc::EPERM as u32)
                    .build()
                    .map_err(bad)?,
                LinuxSyscallBuilder::default()
                    .names(
                        REPORTED_BY_EXEC
                            .iter()
                            .map(|s| s.to_string())
                            .collect::<Vec<_>>(),
                    )
                    .action(LinuxSeccompAction::ScmpActLog)
                    .build()
                    .map_err(bad)?,
            ])
            .build()
            .map_err(bad)?,
    ));
    spec.set_linux(Some(linux));
    Ok(spec)
}

#[async_trait]
impl AgentFiles for ContainerBackend {
    async fn file_agent(&self, id: &str) -> NodeResult<Arc<dyn HoldsAgent>> {
        Ok(self.fs_target(id).await?)
    }
}

impl HoldsAgent for Container {
    fn agent(&self) -> &AgentClient {
        &self.agent
    }
}

#[async_trait]
impl SandboxBackend for ContainerBackend {
    fn kind(&self) -> Backend {
        Backend::Container
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<()> {
        check_id(&spec.id)?;
        let runtime = match spec.runtime.as_deref() {
            None => self.core.cfg.default_runtime,
            Some(name) => Runtime::parse(name).ok_or_else(|| {
                NodeError::InvalidArgument(format!(
                    "unknown runtime {name:?}: expected runc, crun or runsc"
                ))
            })?,
        };
        let bin = self.core.runtime_bin(runtime)?;
        let dir = self.core.dir_of(&spec.id);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(NodeError::Conflict(format!(
                    "sandbox {} already exists",
                    spec.id
                )))
            }
            Err(e) => return Err(NodeError::io(format!("create {}", dir.display()), e)),
        }
        // Warm pool: hand a ready container over; on any failure fall through to a cold
        // create in the same (still empty) claimed directory.
        if let Some(pool) = self
            .pool
            .get()
            .filter(|_| seed.is_none() && spec_compatible(spec, runtime))
        {
            let adopt = |state, uids| drop(self.adopt(state, uids));
            if pool.create(spec, image, &dir, adopt).await {
                return Ok(());
            }
        }
        let uids = match self.uids.allocate() {
            Ok(u) => u,
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
        };
        let cg = self.core.cgroups.sandbox(&spec.id);
        match self
            .core
            .create_inner(&dir, spec, image, runtime, &bin, uids.base(), &cg, seed)
            .await
        {
            Ok(state) => {
                self.adopt(state, uids);
                tracing::info!(sandbox = %spec.id, backend = "container", runtime = runtime.name(), "sandbox created");
                Ok(())
            }
            // Nothing half-created stays: a failed removal is part of the answer
            // (`CleanupFailed`, with the create's own code).
            Err(e) => Err(e.with_cleanup(self.destroy(&spec.id, Some(runtime)).await)),
        }
    }

    async fn checkpoint(&self, id: &str, dest: &Path) -> NodeResult<Captured> {
        let c = self.get(id)?;
        let upper = self.core.dir_of(id).join("scratch/upper");
        let layer = dest.join("layer");
        crate::checkpoints::frozen_copy(
            id,
            dest,
            &c.deleting,
            &c.paused,
            c.cgroup.group(),
            move || crate::checkpoints::copy_layer(&upper, &layer, None),
        )
        .await?;
        Ok(Captured {
            backend: Backend::Container,
            image: c.state.saved.image.clone(),
            runtime: Some(c.state.runtime.name().to_string()),
            uid_base: Some(c.state.saved.uid_base),
            disk_mib: c.state.saved.spec.disk_mib,
            image_version: c.state.saved.image_version.clone(),
        })
    }

    fn has(&self, id: &str) -> bool {
        self.boxes.lock().unwrap().contains_key(id)
    }

    async fn exec(&self, id: &str, req: &ExecRequest, io: ExecIo) -> NodeResult<ExecResult> {
        self.run_exec(id, req, io).await
    }

    fn agent_files(&self) -> Option<&dyn AgentFiles> {
        Some(self)
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        let c = self.get(id)?;
        freeze(id, "container", &c.deleting, &c.paused, c.cgroup.group()).await
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        let c = self.get(id)?;
        thaw(id, "container", &c.deleting, &c.paused, c.cgroup.group()).await
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        super::delete_from(
            id,
            "container",
            &self.boxes,
            |c| (&c.deleting, &c.killed),
            |c| self.destroy(id, c.map(|c| c.state.runtime)),
        )
        .await
    }

    fn list(&self) -> Vec<SandboxStatus> {
        self.boxes
            .lock()
            .unwrap()
            .values()
            .map(|c| SandboxStatus {
                id: c.state.saved.id.clone(),
                backend: Backend::Container,
                liveness: crate::liveness::proc_liveness(
                    c.state.saved.init_pid,
                    c.state.saved.init_starttime,
                ),
            })
            .collect()
    }

    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        let c = self.fs_target(id).await?;
        if c.state.runtime == Runtime::Runsc {
            // gVisor's network stack lives in its sentry, not in the kernel namespace: the
            // guest agent, inside the sandbox, connects for us (as in a VM).
            return c.agent.connect_port(id, port).await;
        }
        let s = crate::ports::connect_in_netns(
            id,
            c.state.saved.init_pid,
            c.state.saved.init_starttime,
            port,
        )
        .await?;
        Ok(Box::new(s))
    }

    async fn agent_execs(&self, id: &str) -> NodeResult<crate::node::AgentExecs> {
        let c = self.fs_target(id).await?;
        agent_exec::agent_execs(id, &c.agent).await
    }

    async fn agent_forget(&self, id: &str, handle: &str) -> NodeResult<()> {
        self.fs_target(id).await?.agent.forget_exec(handle).await
    }

    async fn exec_reattach(
        &self,
        id: &str,
        sink: Option<crate::node::ExecSink>,
        reattach: crate::node::ExecReattach,
    ) -> NodeResult<ExecResult> {
        let c = self.fs_target(id).await?;
        let mut killed = c.killed.subscribe();
        let (pid, start) = (c.state.saved.init_pid, c.state.saved.init_starttime);
        let died = move || proc_starttime(pid) != Some(start);
        let target = agent_exec::Target {
            id,
            kind: "container",
            agent: &c.agent,
            pids_max: c.state.saved.spec.pids_max,
            died: &died,
        };
        agent_exec::reattach(target, &mut killed, sink, reattach).await
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let mut adopted = Vec::new();
        let mut errors = Vec::new();
        let names: Vec<String> = std::fs::read_dir(&self.core.cfg.dir)
            .map_err(|e| NodeError::io(format!("read {}", self.core.cfg.dir.display()), e))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| check_id(n).is_ok())
            .collect();
        for name in names {
            if self.has(&name) {
                adopted.push(name);
                continue;
            }
            let state: Option<ContainerState> =
                std::fs::read(self.core.dir_of(&name).join("state.json"))
                    .ok()
                    .and_then(|s| serde_json::from_slice(&s).ok());
            let alive = state.as_ref().is_some_and(|s| {
                s.saved.id == name
                    && proc_starttime(s.saved.init_pid) == Some(s.saved.init_starttime)
            });
            match state {
                Some(state) if alive && keep.contains(&name) => {
                    let uids = self.uids.reserve(state.saved.uid_base);
                    self.adopt(state, uids);
                    tracing::info!(sandbox = %name, backend = "container", "sandbox re-adopted");
                    adopted.push(name);
                }
                state => {
                    tracing::info!(sandbox = %name, backend = "container", "removing leftover sandbox");
                    if let Err(e) = self.destroy(&name, state.map(|s| s.runtime)).await {
                        errors.push(e.to_string());
                    }
                }
            }
        }
        // Their networks come back in `LocalNode::readopt`, which sweeps `DATA/net` once
        // with the ids every backend kept.
        for id in self.core.cgroups.list_sandboxes() {
            if !self.cgroup_in_use(&id) {
                let cg = self.core.cgroups.sandbox(&id);
                if let Err(e) = spawn_blocking(move || Ok(cg.group().destroy(KILL_TIMEOUT)?)).await
                {
                    errors.push(e.to_string());
                }
            }
        }
        // runc's groups in the other hierarchies, left by a runc delete that failed half-way.
        for g in self
            .core
            .cgroups
            .sweep_other_hierarchies(|id| self.cgroup_in_use(id))
        {
            errors.push(format!("cannot remove cgroup {}", g.display()));
        }
        Ok(super::readopt_done("container", adopted, &errors))
    }
}

impl ContainerBackend {
    /// The container a file call goes to: its guest agent serves the call inside the
    /// container (paths resolve in the container's own root, as its root user).
    ///
    /// # Errors
    /// `NotFound` (unknown or being deleted), `Conflict` (paused, or its init is gone).
    async fn fs_target(&self, id: &str) -> NodeResult<Arc<Container>> {
        let c = self.get(id)?;
        check_live(id, *c.deleting.read().await, &c.paused)?;
        if proc_starttime(c.state.saved.init_pid) != Some(c.state.saved.init_starttime) {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is not running (its init {} is gone)",
                c.state.saved.init_pid
            )));
        }
        Ok(c)
    }
}

impl Drop for ContainerBackend {
    /// Removes the backend's parent cgroup where it is empty: the hierarchies the node
    /// manages, and (v1) the others runc created it in (net_cls, perf_event, ...).
    fn drop(&mut self) {
        // The pool destroys its containers first (they hold groups under the parent).
        drop(self.pool.take());
        let _ = self.core.cgroups.remove_parent();
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for e in rd.flatten() {
                let _ = std::fs::remove_dir(e.path().join(self.core.cgroups.parent()));
            }
        }
    }
}

/// The backend's start and clean-up logic over a recording fake of the runtime CLI
/// ([`runtime::fake::RecordingRuntime`]), without root. What needs root (the bundle's
/// mounts, cgroup limits, the agent) is covered by the integration tests.
#[cfg(test)]
mod fake_runtime_tests {
    use super::runtime::fake::{Answer, Call, RecordingRuntime};
    use super::*;
    use crate::backends::saved::StoredSpec;
    use crate::cgroups::{CgroupVersion, HostFs};

    /// A core with runc and runsc "installed" (crun not), cgroups under a plain directory
    /// (no group exists: thaw, kill and remove have nothing to do) and `fake` as the CLI.
    fn core(dir: &Path, fake: Arc<RecordingRuntime>) -> Core {
        Core {
            cfg: ContainerConfig {
                dir: dir.join("containers"),
                state_root: dir.join("runtime"),
                disk_templates: dir.join("disk-templates"),
                agent_bin: dir.join("sandlot-guest"),
                default_runtime: Runtime::Runc,
            },
            net: NodeNet::new(dir.join("net")),
            cgroups: CgroupRoot::with_fs(
                CgroupVersion::V2,
                vec![("unified", dir.join("cgroup"))],
                Arc::new(HostFs),
            ),
            runtimes: vec![
                (Runtime::Runc, Ok(PathBuf::from("/fake/runc"))),
                (Runtime::Crun, Err("runtime crun is not installed".into())),
                (Runtime::Runsc, Ok(PathBuf::from("/fake/runsc"))),
            ],
            cli: fake,
        }
    }

    fn delete(runtime: Runtime, id: &str) -> Call {
        Call::Delete {
            runtime,
            bin: PathBuf::from(format!("/fake/{}", runtime.name())),
            id: id.into(),
        }
    }

    /// `start` of `sb-1` in bundle `dir`.
    async fn start(core: &Core, dir: &Path) -> Result<(i32, u64), RuntimeError> {
        let (pid_file, log_path) = (dir.join("init.pid"), dir.join("agent.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        core.start(RunRequest {
            runtime: Runtime::Runc,
            bin: Path::new("/fake/runc"),
            id: "sb-1",
            bundle: dir,
            pid_file: &pid_file,
            flags: Vec::new(),
            listen_fd: None,
            join_procs: Vec::new(),
            log,
            log_path: &log_path,
        })
        .await
    }

    #[tokio::test]
    async fn start_takes_the_init_from_the_pid_file_when_it_lives() {
        let tmp = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        let fake = RecordingRuntime::new([Answer::Ok {
            pid: Some(me),
            log: "",
        }]);
        let core = core(tmp.path(), fake.clone());
        let got = start(&core, tmp.path()).await.unwrap();
        assert_eq!(got, (me, proc_starttime(me).unwrap()));
        assert_eq!(
            fake.calls(),
            [Call::Run {
                runtime: Runtime::Runc,
                id: "sb-1".into(),
                bundle: tmp.path().into(),
                pid_file: tmp.path().join("init.pid"),
                flags: vec![],
                preserve_fd: false,
                join_procs: vec![],
            }]
        );
    }

    #[tokio::test]
    async fn a_start_without_pid_file_or_with_a_dead_init_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        // A pid that was just reaped.
        let dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id() as i32;
        dead.wait_with_output().unwrap();
        let fake = RecordingRuntime::new([
            Answer::Ok { pid: None, log: "" },
            Answer::Ok {
                pid: Some(dead_pid),
                log: "sandlot-guest: accept: bad file descriptor\n",
            },
        ]);
        let core = core(tmp.path(), fake);
        let e = start(&core, tmp.path()).await.unwrap_err();
        assert!(
            matches!(&e, RuntimeError::NoPidFile { runtime: "runc", path } if *path == tmp.path().join("init.pid")),
            "{e:?}"
        );
        let e = start(&core, tmp.path()).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "container sb-1 died at start; sandlot-guest: accept: bad file descriptor"
        );
    }

    #[tokio::test]
    async fn a_failed_or_slow_run_is_the_nodes_internal_error_with_the_log() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = RecordingRuntime::new([
            Answer::Fail {
                log: "runc run failed: unable to start container process",
            },
            Answer::Timeout,
        ]);
        let core = core(tmp.path(), fake);
        let e = NodeError::from(start(&core, tmp.path()).await.unwrap_err());
        assert!(matches!(e, NodeError::Internal { .. }), "{e:?}");
        assert_eq!(
            sandlot_node_api::chain(&e),
            "runc run sb-1: exit status: 1; runc run failed: unable to start container process"
        );
        let e = NodeError::from(start(&core, tmp.path()).await.unwrap_err());
        assert_eq!(
            sandlot_node_api::chain(&e),
            "/fake/runc did not finish in 60s"
        );
    }

    #[tokio::test]
    async fn destroy_deletes_with_the_given_runtime_only_then_removes_the_bundle() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = RecordingRuntime::new([]);
        let core = core(tmp.path(), fake.clone());
        let dir = tmp.path().join("containers/cp-ab");
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        core.destroy_at(&dir, "cp-ab", "cp-ab", Some(Runtime::Runsc), None)
            .await
            .unwrap();
        assert_eq!(fake.calls(), [delete(Runtime::Runsc, "cp-ab")]);
        assert!(!dir.exists());
    }

    #[tokio::test]
    async fn destroy_without_a_runtime_tries_each_installed_one_and_a_refused_delete_is_fine() {
        let tmp = tempfile::tempdir().unwrap();
        // runc knows no such container; runsc hangs.
        let fake = RecordingRuntime::new([
            Answer::Fail {
                log: "container does not exist",
            },
            Answer::Timeout,
        ]);
        let core = core(tmp.path(), fake.clone());
        let dir = tmp.path().join("containers/sb-1");
        std::fs::create_dir_all(&dir).unwrap();
        core.destroy_at(&dir, "sb-1", "sb-1", None, None)
            .await
            .unwrap();
        // crun is not installed: not asked.
        assert_eq!(
            fake.calls(),
            [
                delete(Runtime::Runc, "sb-1"),
                delete(Runtime::Runsc, "sb-1")
            ]
        );
        assert!(!dir.exists());
    }

    fn backend(core: Core) -> ContainerBackend {
        ContainerBackend {
            core: Arc::new(core),
            uids: UidSlots::new(1 << 20),
            boxes: Mutex::new(HashMap::new()),
            pool: std::sync::OnceLock::new(),
        }
    }

    /// A create's rollback is `destroy(id, Some(runtime))`: the runtime deletes the id the
    /// container was started under — the sandbox id, or the pooled name a hand-over kept.
    #[tokio::test]
    async fn the_rollback_deletes_the_id_the_runtime_knows() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = RecordingRuntime::new([]);
        let b = backend(core(tmp.path(), fake.clone()));
        // A failed cold create: no state file yet.
        let cold = tmp.path().join("containers/sb-1");
        std::fs::create_dir_all(&cold).unwrap();
        b.destroy("sb-1", Some(Runtime::Runc)).await.unwrap();
        // A container handed over by the pool: its state names runc id and cgroup `cp-ab`.
        let handed = tmp.path().join("containers/sb-2");
        std::fs::create_dir_all(&handed).unwrap();
        let state = ContainerState {
            saved: SavedSandbox {
                id: "sb-2".into(),
                image: "busybox".into(),
                image_env: vec![],
                image_version: None,
                init_pid: 0,
                init_starttime: 0,
                uid_base: 1 << 20,
                spec: StoredSpec {
                    cpu: 1.0,
                    memory_mib: 256,
                    disk_mib: 512,
                    pids_max: 64,
                    env: Default::default(),
                },
                cgroup: Some("cp-ab".into()),
            },
            runtime: Runtime::Runc,
            runtime_id: Some("cp-ab".into()),
        };
        saved::write(&handed, &state).unwrap();
        // The runtime comes from the state file.
        b.destroy("sb-2", None).await.unwrap();
        assert_eq!(
            fake.calls(),
            [
                delete(Runtime::Runc, "sb-1"),
                delete(Runtime::Runc, "cp-ab")
            ]
        );
        assert!(!cold.exists() && !handed.exists());
    }
}
