//! The `function` backend: a namespace jail built by `sandlot-guest`.
//!
//! Host layout of one sandbox (`DATA/sandboxes/<id>/`):
//!
//! * `disk.img` + `scratch/` — the writable layer's file system and its **disk quota**: a
//!   sparse ext4 image of `disk_mib` MiB ([`crate::disk`], the container backend's code)
//!   loop-mounted on the host at `scratch/` (`nosuid,nodev,noatime`); writing past it gives
//!   ENOSPC inside, the sandbox stays usable and deleting files frees space.
//! * `scratch/upper/` — overlayfs upper dir, the sandbox's only writable layer. Owned by the
//!   jail's `uid_base` (the host uid of root inside the sandbox), mode 0755;
//!   `upper/workspace` (0755) and `upper/root` (0700) are pre-created with the same owner so
//!   the sandbox's root can write its home and workspace; so are
//!   `upper/{mnt,opt,srv,media,home}` (0755, `SCRATCH_DIRS`), directories a program may
//!   write (`/home` so that users' homes, such as E2B's `/home/user`, can be made).
//!   Everything else of the rootfs comes from the image's lower dirs, which are owned by
//!   host root: inside the user namespace they show up as owned by `nobody`, so they are
//!   read-only to the sandbox
//!   (security: an image layer shared by every sandbox can never be modified by one of them;
//!   writes go to the upper dir by copy-up only where the directory is writable, i.e.
//!   `/workspace`, `/root`, the scratch directories and the tmpfs mounts). Sandboxes
//!   re-adopted from a version before the disk have `upper/` and `work/` directly in the
//!   sandbox directory (`upper_dir`).
//! * `scratch/work/` — overlayfs work dir (same file system as `upper/`), owned by
//!   `uid_base`.
//! * `rootfs/` — empty mount point for the overlay. The overlay is mounted only inside the
//!   sandbox's own mount namespace, so nothing is mounted in the host's namespace and the
//!   mount disappears with the sandbox's init.
//! * `state.json` — [`JailState`], written atomically once the sandbox runs; a directory
//!   without it is a half-created sandbox and is removed by `readopt`.
//!
//! Host ids: every jail (sandbox or pooled) has a host uid/gid range of its own,
//! `uid_base .. uid_base + 65536` with `uid_base = FunctionConfig::uid_base + slot × 65536`,
//! the slot being the lowest one no live jail holds ([`super::uids`]); it is recorded in
//! `state.json` and rebuilt from there when sandboxes are re-adopted. The sandbox's user
//! namespace is created, and so owned, by that base uid (`sandlot-guest init` drops to it
//! before the unshare), so everything the kernel counts per user inside the sandbox
//! (inotify instances, ...) is charged to the sandbox's own uid, never to host root or to
//! another sandbox. The files API writes as the jail's base uid/gid too.
//!
//! Processes: `sandlot-guest init` (contract: `sandlot_guest::spec`) makes the sandbox's
//! pid 1 inside the sandbox cgroup; each exec runs `sandlot-guest exec` in a fresh child
//! cgroup `x<n>` that it joins before entering the namespaces, so the exec's whole process
//! tree can be killed at once. An exec's process tree never outlives the exec: the exec
//! cgroup is killed and removed when the exec ends, which also ends background children
//! (`sleep 100 &`). Long-lived background processes need the (later) background-process API.
//!
//! Standby helpers (opt-in, `SANDLOT_EXEC_STANDBY=1` in the node's environment): joining a
//! cgroup (writing `cgroup.procs`) waits for an RCU grace period on cgroup v1 (7–15 ms on a
//! loaded 2-core host, most of an exec's own cost), so once a sandbox has run
//! `STANDBY_AFTER_EXECS` execs the node starts the next exec's helper right after an exec
//! ends, in the next exec group `x<n>` (the node writes the helper's pid into it), blocked
//! on its spec. The next exec without stdin hands it its spec (with no `cgroup_procs`) and
//! skips the join. While it waits, the helper is one more task in the sandbox's cgroups
//! (counted against `pids_max`); delete kills it with the sandbox. See `Standby`.
//!
//! Exec results: the status comes from fd 4 of the helper (`Exited` → its code, `Signaled`
//! n → 128+n); a timeout kills the exec's tree and gives 137/SIGKILL with `timed_out`; EOF
//! on fd 4 without a status (the helper was killed: sandbox deleted during the exec, or an
//! OOM kill of the helper) is reported as 137/SIGKILL too. `SetupFailed` is an error, not a
//! result: `InvalidArgument` when the caller's input caused it (`user_error`), else
//! `Internal`.
//!
//! Pause/resume: pause freezes the sandbox cgroup (v1 `freezer.state`, v2 `cgroup.freeze`;
//! the freeze is hierarchical, so every exec group is frozen with it) and marks the jail
//! paused: new execs and file calls answer `Conflict` ("sandbox is paused") until resume
//! thaws it. An exec already running is frozen mid-flight and continues after resume; its
//! timeout is wall-clock, so it keeps counting while paused. Delete thaws first, then kills.
//! A re-adopted sandbox whose group is still frozen comes back paused.
//!
//! Known approximations:
//! * disk: `disk_mib` bounds the writable layer (the ext4 image), each file
//!   (RLIMIT_FSIZE) and the /tmp tmpfs, each on its own: /tmp and /dev/shm are tmpfs of
//!   `min(disk_mib, memory_mib)` MiB charged to memory, not to the disk image;
//! * OOM on cgroup v2: exec groups have no memory controller, so `oom_killed` is the delta
//!   of the sandbox's `oom_kill` counter over the exec, which also counts OOM kills of an
//!   overlapping exec in the same sandbox (v1 reads the exec group's own counter: exact);
//! * the sandbox's init is re-parented to the host's init when `sandlot-guest init` exits,
//!   so after a delete the host's init reaps it (a host init that reaps lazily shows it as
//!   a zombie for a while; it holds no memory, cgroup or mount).
mod agent;
pub use agent::{enabled as agent_enabled, EXTRA_PIDS as AGENT_EXTRA_PIDS};
pub mod pool;

use super::check_id;
use super::pause::{check_not_paused, freeze, thaw, FREEZE_TIMEOUT};
use super::pool::WarmPool;
use super::saved::{self, SavedSandbox};
use super::spawn::{cloexec_pipe, dup_high, SpawnedChild};
use super::uids::{UidLease, UidSlots, UID_COUNT};
use super::{ExecIo, SandboxBackend};
use crate::cgroups::{Cgroup, CgroupRoot, Limits, SandboxCgroup};
use crate::checkpoints::{Captured, Checkpoint};
use crate::files::SandboxFs;
use crate::images::Image;
use crate::node::{ExecControl, ExecSink, NodeError, NodeResult, SandboxSpec, SandboxStatus};
use crate::output::Capture;
use crate::sys::{proc_starttime, spawn_blocking};
use async_trait::async_trait;
use pool::{pool_dir, tmp_compatible, FunctionPool, Jails};
use sandlot_api::{Backend, ExecEvent, ExecRequest, ExecResult, FileEntry};
use sandlot_guest::spec::{ExecStatus, InitReady, InitSpec};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{watch, RwLock};

pub(crate) use super::exec_plan::ExecPlan;
pub use super::exec_plan::{DEFAULT_MAX_OUTPUT, DEFAULT_TIMEOUT_S, MAX_MAX_OUTPUT, NOFILE};

/// How long `sandlot-guest init` may take.
const INIT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long killing and removing cgroups may take.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// After the command ended: how long to wait for the output pipes to reach EOF before the
/// exec cgroup is killed (it holds background children that keep the pipes open).
const PIPE_GRACE: Duration = Duration::from_millis(50);
/// After the exec cgroup is empty: how long to wait for the pipes (a process outside the
/// cgroup could still hold them; we stop reading then).
const DRAIN_GRACE: Duration = Duration::from_millis(500);
/// A sandbox gets a standby exec helper once it has run this many execs (a one-shot
/// sandbox such as `run_code`'s never pays for a helper it will not use).
const STANDBY_AFTER_EXECS: u64 = 2;

/// Static configuration of the function backend.
#[derive(Debug, Clone)]
pub struct FunctionConfig {
    /// `DATA/sandboxes`: one directory per sandbox.
    pub sandboxes_dir: PathBuf,
    /// The `sandlot-guest` binary.
    pub guest_bin: PathBuf,
    /// First host uid (and gid) of the sandboxes' ranges: root inside the jail of slot `s`
    /// maps to `uid_base + s × 65536` (see [`super::uids`]).
    pub uid_base: u32,
}

/// On-disk state of a running sandbox: `DATA/sandboxes/<id>/state.json` (see [`saved`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JailState {
    /// What every sandbox records.
    #[serde(flatten)]
    pub saved: SavedSandbox,
    /// Always `function` here.
    pub backend: Backend,
}

/// One running sandbox.
struct Jail {
    state: JailState,
    /// Its host uid range (`state.uid_base`), held while the jail is known.
    _uids: UidLease,
    cgroup: SandboxCgroup,
    /// `true` once delete has begun. Exec set-up holds the read side so that delete
    /// (write side) never races an exec that is creating its cgroup.
    deleting: RwLock<bool>,
    /// Fires when the sandbox is deleted, so running execs stop at once.
    killed: watch::Sender<bool>,
    next_exec: AtomicU64,
    /// Execs that ran to an end (any result but a delete); a standby helper is prepared
    /// only once this reaches [`STANDBY_AFTER_EXECS`].
    execs_done: AtomicU64,
    /// A `sandlot-guest exec` helper started ahead of time and already in its exec
    /// cgroup, waiting for its spec (see [`Standby`]); taken by the next exec without stdin.
    standby: Mutex<Option<Standby>>,
    /// `true` while a task prepares a standby helper (at most one per sandbox).
    standby_busy: std::sync::atomic::AtomicBool,
    /// `true` while the sandbox's cgroup is frozen ([`SandboxBackend::pause`]); exec and
    /// file calls answer `Conflict` then.
    paused: std::sync::atomic::AtomicBool,
    /// The guest agent inside the jail (default; `SANDLOT_FUNCTION_AGENT=0` turns it off;
    /// see [`agent`]).
    agent: agent::AgentSlot,
    /// Execs asked of this sandbox on any path (counted by [`FunctionBackend::agent_of`]):
    /// its agent starts from the second one.
    execs_asked: AtomicU64,
}

impl Jail {
    fn check_not_paused(&self) -> NodeResult<()> {
        check_not_paused(&self.paused, &self.state.saved.id)
    }
}

/// The function backend: sandboxes by id.
pub struct FunctionBackend {
    cfg: FunctionConfig,
    cgroups: CgroupRoot,
    jails: Mutex<HashMap<String, Arc<Jail>>>,
    /// Host uid ranges of live jails, shared with the warm pool.
    uids: Arc<UidSlots>,
    /// The warm pool, once started ([`FunctionBackend::start_warm_pool`]).
    pool: std::sync::OnceLock<FunctionPool>,
    /// Whether sandboxes get a standby exec helper ([`Standby`]; `SANDLOT_EXEC_STANDBY=1`).
    exec_standby: bool,
    /// Whether execs go through a guest agent inside the jail ([`agent`]; default, off
    /// with `SANDLOT_FUNCTION_AGENT=0`).
    exec_agent: bool,
    /// Network policies (`network: {"allow": ...}`): the node's one manager, shared with
    /// the container backend and swept by [`crate::LocalNode`]'s readopt.
    net: Arc<crate::net::NodeNet>,
}

impl FunctionBackend {
    /// A backend storing sandboxes under `cfg.sandboxes_dir` and cgroups under `cgroups`;
    /// allow policies go through `net` (the node's one [`crate::net::NodeNet`]).
    ///
    /// # Errors
    /// `Internal` when the sandboxes directory or the `sandlot` cgroups cannot be created.
    pub fn new(
        cfg: FunctionConfig,
        cgroups: CgroupRoot,
        net: Arc<crate::net::NodeNet>,
    ) -> NodeResult<Self> {
        std::fs::create_dir_all(&cfg.sandboxes_dir)
            .map_err(|e| NodeError::io(format!("create {}", cfg.sandboxes_dir.display()), e))?;
        // Sandboxes' uids must traverse to their upper dirs but not list other sandboxes.
        let _ =
            std::fs::set_permissions(&cfg.sandboxes_dir, std::fs::Permissions::from_mode(0o711));
        cgroups.ensure_parent()?;
        Ok(FunctionBackend {
            uids: UidSlots::new(cfg.uid_base),
            cfg,
            cgroups,
            jails: Mutex::new(HashMap::new()),
            pool: std::sync::OnceLock::new(),
            exec_standby: std::env::var_os("SANDLOT_EXEC_STANDBY").is_some_and(|v| v == "1"),
            exec_agent: agent_enabled(),
            net,
        })
    }

    /// The jail of sandbox `id` (not paused) and its in-jail agent: the one this node
    /// started, else one found answering in the jail's directory (a node restarted since);
    /// `None` when none answers.
    ///
    /// # Errors
    /// As [`Self::jail`]; `Conflict` when paused.
    async fn jail_agent(&self, id: &str) -> NodeResult<(Arc<Jail>, Option<agent::JailAgent>)> {
        let jail = self.jail(id)?;
        jail.check_not_paused()?;
        let a = match jail.agent.ready() {
            Some(a) => Some(agent::JailAgent::Held(a)),
            None => agent::answering(&self.dir_of(id))
                .await
                .map(agent::JailAgent::Found),
        };
        Ok((jail, a))
    }

    fn jail(&self, id: &str) -> NodeResult<Arc<Jail>> {
        self.jails
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("sandbox {id} not found on this node")))
    }

    fn dir_of(&self, id: &str) -> PathBuf {
        self.cfg.sandboxes_dir.join(id)
    }

    /// `jail`'s guest agent when execs go through one and it answers; otherwise `None`,
    /// and (with the agent path on) a start is kicked off for the next exec — from the
    /// sandbox's second exec on: a sandbox's first exec (cold-created or handed over by
    /// the warm pool, which keeps its standby helper) takes the helper path without an
    /// agent starting next to it (a `run_code` sandbox runs one exec and is deleted; its
    /// agent would only cost CPU and a delete that waits for the launch). Re-adopted
    /// sandboxes reconnect to theirs at adoption.
    fn agent_of(&self, jail: &Arc<Jail>) -> Option<Arc<agent::Agent>> {
        if !self.exec_agent {
            return None;
        }
        let asked_before = jail.execs_asked.fetch_add(1, Ordering::SeqCst);
        let a = jail.agent.ready();
        if a.is_none() && asked_before >= 1 {
            agent::kick(
                &self.cfg.guest_bin,
                &self.dir_of(&jail.state.saved.id),
                jail,
            );
        }
        a
    }

    /// Starts the guest agent of sandbox `id` in the background (agent path on only).
    fn kick_agent(&self, id: &str) {
        if !self.exec_agent {
            return;
        }
        if let Ok(jail) = self.jail(id) {
            agent::kick(&self.cfg.guest_bin, &self.dir_of(id), &jail);
        }
    }

    /// Open the sandbox root for the files module, on a blocking thread.
    async fn with_fs<T: Send + 'static>(
        &self,
        id: &str,
        f: impl FnOnce(&SandboxFs) -> NodeResult<T> + Send + 'static,
    ) -> NodeResult<T> {
        let jail = self.jail(id)?;
        if *jail.deleting.read().await {
            return Err(NodeError::NotFound(format!(
                "sandbox {id} is being deleted"
            )));
        }
        jail.check_not_paused()?;
        let pid = jail.state.saved.init_pid;
        let start = jail.state.saved.init_starttime;
        let uid = jail.state.saved.uid_base;
        let id = id.to_string();
        spawn_blocking(move || {
            if proc_starttime(pid) != Some(start) {
                return Err(NodeError::Conflict(format!(
                    "sandbox {id} is not running (its init {pid} is gone)"
                )));
            }
            // The sandbox root as its init sees it; files resolves every path inside it.
            let fs = SandboxFs::open(Path::new(&format!("/proc/{pid}/root")), uid, uid)?;
            f(&fs)
        })
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn create_inner(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        dir: &Path,
        cg: &SandboxCgroup,
        uids: &mut Option<UidLease>,
        ready: &mut Option<InitReady>,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<JailState> {
        // Held by the caller until its rollback has killed a half-built jail.
        let base = uids.insert(self.uids.allocate()?).base();
        {
            let (templates, d, disk_mib) =
                (disk_templates(&self.cfg), dir.to_path_buf(), spec.disk_mib);
            spawn_blocking(move || crate::disk::mount_scratch(&templates, &d, disk_mib)).await?;
        }
        if let Some(ck) = seed {
            // A fork: the checkpoint's layer becomes this jail's upper dir, re-owned from the
            // parent's id range to this jail's. It goes into the fork's own disk: full means
            // disk_mib is too small for the checkpoint, the caller's choice (400).
            let (layer, upper) = (ck.layer(), dir.join("scratch/upper"));
            let shift = ck.meta.uid_base.map(|from| (from, base));
            let disk_mib = spec.disk_mib;
            spawn_blocking(move || {
                crate::checkpoints::copy_layer(&layer, &upper, shift).map_err(|e| match e {
                    NodeError::ResourceExhausted(m) => {
                        NodeError::InvalidArgument(format!("disk_mib {disk_mib} is too small: {m}"))
                    }
                    e => e,
                })
            })
            .await?;
        }
        // tmpfs pages are charged to the sandbox's memory cgroup, so the memory limit
        // bounds /tmp too; disk_mib bounds it further.
        let tmp_mib = spec.disk_mib.min(spec.memory_mib).max(1);
        build_jail(&self.cfg, spec, image, dir, cg, tmp_mib, base, ready).await
    }

    /// Register a running jail; `uids` holds its host uid range (`state.uid_base`).
    fn adopt(&self, state: JailState, uids: UidLease) -> Arc<Jail> {
        let (killed, _) = watch::channel(false);
        let cgroup = self.cgroups.sandbox(state.saved.cgroup_name());
        // A sandbox paused by a previous process stays paused (the kernel keeps it frozen).
        let paused = std::sync::atomic::AtomicBool::new(cgroup.group().freeze_requested());
        let jail = Arc::new(Jail {
            _uids: uids,
            cgroup,
            paused,
            state,
            deleting: RwLock::new(false),
            killed,
            next_exec: AtomicU64::new(1),
            execs_done: AtomicU64::new(0),
            standby: Mutex::new(None),
            standby_busy: std::sync::atomic::AtomicBool::new(false),
            agent: agent::AgentSlot::default(),
            execs_asked: AtomicU64::new(0),
        });
        self.jails
            .lock()
            .unwrap()
            .insert(jail.state.saved.id.clone(), jail.clone());
        jail
    }

    /// Whether cgroup `name` belongs to a known sandbox (under another name: handed over
    /// by the warm pool) or to the warm pool itself.
    fn cgroup_in_use(&self, name: &str) -> bool {
        self.jails
            .lock()
            .unwrap()
            .values()
            .any(|j| j.state.saved.cgroup_name() == name)
            || self.pool.get().is_some_and(|p| p.owns(name))
    }

    /// The host uid ranges of this node's sandboxes (shared with the container backend, so
    /// no two sandboxes of any backend get overlapping ranges).
    pub fn uid_slots(&self) -> Arc<UidSlots> {
        self.uids.clone()
    }

    /// Start the warm pool (see [`pool`]); a second call does nothing, nor
    /// does a pool of size 0 or no image. Call it after `readopt`, which clears the
    /// previous process's cgroups first.
    ///
    /// # Errors
    /// `Internal` when the pool directory or its thread cannot be created.
    pub fn start_warm_pool(
        &self,
        images: crate::images::ImageStore,
        cfg: super::pool::PoolConfig,
    ) -> NodeResult<()> {
        let jails = Jails {
            cfg: self.cfg.clone(),
            cgroups: self.cgroups.clone(),
            standbys: Default::default(),
        };
        let dir = pool_dir(&self.cfg.sandboxes_dir);
        WarmPool::start_once(&self.pool, jails, dir, self.uids.clone(), images, cfg)
    }

    /// The warm pool, when started.
    pub fn warm_pool(&self) -> Option<&FunctionPool> {
        self.pool.get()
    }

    /// Gives the just-created jail of `spec` its network when the policy is an allow list:
    /// veth, nft rules and resolver on the network namespace of its init (made by host
    /// root, so the sandbox cannot reconfigure it), then `/etc/resolv.conf` naming its
    /// resolver. No process of the sandbox runs yet (execs start later), so none sees a
    /// half-made network. On error the jail is deleted again (network included) and the
    /// error returned.
    async fn attach_network(&self, spec: &SandboxSpec) -> NodeResult<()> {
        let sandlot_api::NetworkPolicy::Allow(policy) = &spec.network else {
            return Ok(());
        };
        let res = async {
            let jail = self.jail(&spec.id)?;
            let net = self.net.get().await?;
            let pid = jail.state.saved.init_pid;
            let netns = PathBuf::from(format!("/proc/{pid}/ns/net"));
            let att = net.attach(&spec.id, &netns, policy).await?;
            // The init must still be the one the namespace path named (pids are reused).
            if proc_starttime(pid) != Some(jail.state.saved.init_starttime) {
                return Err(NodeError::io(
                    format!(
                        "sandbox {} lost its init {pid} while its network was set up",
                        spec.id
                    ),
                    std::io::Error::other("sandbox init exited"),
                ));
            }
            let uid = jail.state.saved.uid_base;
            let resolv = att.resolv_conf();
            spawn_blocking(move || {
                // Through the init's root: the overlay exists only in its mount namespace.
                SandboxFs::open(Path::new(&format!("/proc/{pid}/root")), uid, uid)?
                    .write("/etc/resolv.conf", resolv.as_bytes())
            })
            .await
        }
        .await;
        if let Err(err) = res {
            return Err(err.with_cleanup(self.delete(&spec.id).await));
        }
        Ok(())
    }

    /// `res` with what the network policy refused while the exec ran (DNS queries, packets;
    /// from `started_ms` on), as the container backend reports them.
    fn with_net_violations(
        &self,
        id: &str,
        started_ms: u64,
        res: NodeResult<ExecResult>,
    ) -> NodeResult<ExecResult> {
        let mut res = res?;
        if let Some(net) = self.net.started() {
            let room =
                sandlot_guest::spec::MAX_VIOLATIONS_PER_EXEC.saturating_sub(res.violations.len());
            let refused = net.violations(id, started_ms, crate::backends::gvisor_audit::now_ms());
            res.violations.extend(refused.into_iter().take(room));
        }
        Ok(res)
    }

    /// Kill everything of sandbox `id` and remove its cgroups and directory.
    async fn destroy(&self, id: &str) -> NodeResult<()> {
        let dir = self.dir_of(id);
        // The cgroup may carry another name (handed over by the warm pool): the jail's or
        // the state file's record, else the id.
        let known = self
            .jails
            .lock()
            .unwrap()
            .get(id)
            .map(|j| j.state.saved.cgroup_name().to_string());
        let name = known
            .or_else(|| saved::read::<JailState>(&dir).and_then(|s| s.saved.cgroup))
            .unwrap_or_else(|| id.to_string());
        let cg = self.cgroups.sandbox(&name);
        let host = spawn_blocking(move || destroy_blocking(&cg, &dir)).await;
        // After the processes (the veth goes with the namespace; nft, resolver and state
        // file are removed here). Without a running manager there is nothing of this
        // process's; a previous process's leftovers go in the node's sweep.
        let net = match self.net.started() {
            Some(net) if net.knows(id) => net.teardown(id).await,
            _ => Ok(()),
        };
        host.and(net)
    }
}

#[async_trait]
impl SandboxBackend for FunctionBackend {
    fn kind(&self) -> Backend {
        Backend::Function
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<()> {
        check_id(&spec.id)?;
        if spec.backend != Backend::Function {
            return Err(NodeError::InvalidArgument(format!(
                "the function backend cannot create a {} sandbox",
                spec.backend
            )));
        }
        if !(spec.cpu.is_finite() && spec.cpu > 0.0) || spec.memory_mib == 0 || spec.pids_max == 0 {
            return Err(NodeError::InvalidArgument(format!(
                "cpu ({}), memory_mib ({}) and pids_max ({}) must be positive",
                spec.cpu, spec.memory_mib, spec.pids_max
            )));
        }
        let dir = self.dir_of(&spec.id);
        // create_dir (not create_dir_all) is the atomic claim of the id on this node.
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(NodeError::Conflict(format!(
                    "sandbox {} already exists on this node",
                    spec.id
                )))
            }
            Err(e) => return Err(NodeError::io(format!("create {}", dir.display()), e)),
        }
        // Warm pool: hand a ready jail over; on any failure fall through to a cold create
        // in the same (still empty) claimed directory.
        if let Some(pool) = self
            .pool
            .get()
            .filter(|_| seed.is_none() && tmp_compatible(spec))
        {
            let adopt = |state: JailState, uids| {
                // The pooled jail's standby helper comes along (its group lies in the
                // jail's cgroup, which keeps its pooled name).
                let standby = pool.member().take_standby(state.saved.cgroup_name());
                let jail = self.adopt(state, uids);
                *jail.standby.lock().unwrap() = standby;
            };
            if pool.create(spec, image, &dir, adopt).await {
                self.attach_network(spec).await?;
                // No agent yet (pooled jails wait without one): like a cold-created
                // sandbox's, it starts at the second exec ([`Self::agent_of`]).
                return Ok(());
            }
        }
        let started = std::time::Instant::now();
        let cg = self.cgroups.sandbox(&spec.id);
        let mut ready = None;
        let mut uids = None;
        match self
            .create_inner(spec, image, &dir, &cg, &mut uids, &mut ready, seed)
            .await
        {
            Ok(state) => {
                let uid_base = state.saved.uid_base;
                let uids = uids.expect("create_inner allocated a uid range");
                self.adopt(state, uids);
                self.attach_network(spec).await?;
                // No agent yet: it starts at the second exec ([`Self::agent_of`]).
                tracing::info!(sandbox = %spec.id, backend = "function", image = %image.name, uid_base, ms = started.elapsed().as_millis() as u64, "sandbox created");
                Ok(())
            }
            Err(err) => {
                // Rollback: kill whatever started (the init is in the sandbox cgroup), remove
                // cgroups and directories; keep both errors when the cleanup fails too.
                Err(err.with_cleanup(self.destroy(&spec.id).await))
            }
        }
    }

    async fn checkpoint(&self, id: &str, dest: &Path) -> NodeResult<Captured> {
        let jail = self.jail(id)?;
        let upper = upper_dir(&self.dir_of(id));
        let layer = dest.join("layer");
        crate::checkpoints::frozen_copy(
            id,
            dest,
            &jail.deleting,
            &jail.paused,
            jail.cgroup.group(),
            move || crate::checkpoints::copy_layer(&upper, &layer, None),
        )
        .await?;
        Ok(Captured {
            backend: Backend::Function,
            image: jail.state.saved.image.clone(),
            runtime: None,
            uid_base: Some(jail.state.saved.uid_base),
            disk_mib: jail.state.saved.spec.disk_mib,
            image_version: jail.state.saved.image_version.clone(),
        })
    }

    fn has(&self, id: &str) -> bool {
        self.jails.lock().unwrap().contains_key(id)
    }

    async fn exec(&self, id: &str, req: &ExecRequest, io: ExecIo) -> NodeResult<ExecResult> {
        let jail = self.jail(id)?;
        jail.check_not_paused()?;
        let plan = ExecPlan::new(&jail.state, req)?;
        let started = crate::backends::gvisor_audit::now_ms();
        let ExecIo { sink, control } = io;
        if let Some(a) = self.agent_of(&jail) {
            let res = agent::exec(&jail, &a.client, plan, sink, control).await;
            return self.with_net_violations(id, started, res);
        }
        let standby = self.exec_standby.then_some(self.cfg.guest_bin.as_path());
        let res = run_exec(&self.cfg.guest_bin, &jail, plan, sink, standby, control).await;
        self.with_net_violations(id, started, res)
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        let path = path.to_string();
        self.with_fs(id, move |fs| fs.read(&path, max_bytes)).await
    }

    /// Background processes that went through the in-jail agent outlive the node's
    /// process (the agent does); those of the helper path (a sandbox's first exec) die
    /// with it.
    async fn agent_execs(&self, id: &str) -> NodeResult<crate::node::AgentExecs> {
        match self.jail_agent(id).await? {
            (_, Some(a)) => super::agent_exec::agent_execs(id, a.client()).await,
            (_, None) => Ok(Default::default()),
        }
    }

    async fn agent_forget(&self, id: &str, handle: &str) -> NodeResult<()> {
        match self.jail_agent(id).await? {
            (_, Some(a)) => a.client().forget_exec(handle).await,
            (_, None) => Ok(()),
        }
    }

    async fn exec_reattach(
        &self,
        id: &str,
        sink: Option<crate::node::ExecSink>,
        reattach: crate::node::ExecReattach,
    ) -> NodeResult<ExecResult> {
        let (jail, Some(a)) = self.jail_agent(id).await? else {
            return Err(NodeError::NotFound(format!(
                "sandbox {id} has no guest agent to take exec {} up from",
                reattach.handle
            )));
        };
        agent::reattach(&jail, a.client(), sink, reattach).await
    }

    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        let path = path.to_string();
        self.with_fs(id, move |fs| fs.size(&path)).await
    }

    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()> {
        let path = path.to_string();
        self.with_fs(id, move |fs| fs.write(&path, &data)).await
    }

    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        let p = path.to_string();
        crate::files::feed(
            |rx| self.with_fs(id, move |fs| fs.write_from(&p, max_bytes, rx)),
            body,
            path,
        )
        .await
    }

    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        let path = path.to_string();
        let reader = self
            .with_fs(id, move |fs| fs.open_read(&path, max_bytes))
            .await?;
        Ok(crate::files::reader_stream(reader))
    }

    async fn write_files_volatile(
        &self,
        id: &str,
        files: Vec<(String, bytes::Bytes)>,
    ) -> NodeResult<()> {
        self.with_fs(id, move |fs| {
            files
                .iter()
                .try_for_each(|(path, data)| fs.write_volatile(path, data))
        })
        .await
    }

    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        let path = path.to_string();
        self.with_fs(id, move |fs| fs.list(&path)).await
    }

    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        let path = path.to_string();
        self.with_fs(id, move |fs| fs.remove(&path)).await
    }

    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        let path = path.to_string();
        self.with_fs(id, move |fs| fs.stat(&path)).await
    }

    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        let path = path.to_string();
        self.with_fs(id, move |fs| fs.mkdir(&path, parents)).await
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        super::delete_from(
            id,
            "function",
            &self.jails,
            |j| (&j.deleting, &j.killed),
            |_| self.destroy(id),
        )
        .await
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        let j = self.jail(id)?;
        freeze(id, "function", &j.deleting, &j.paused, j.cgroup.group()).await
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        let j = self.jail(id)?;
        thaw(id, "function", &j.deleting, &j.paused, j.cgroup.group()).await
    }

    fn list(&self) -> Vec<SandboxStatus> {
        let mut v: Vec<SandboxStatus> = self
            .jails
            .lock()
            .unwrap()
            .values()
            .map(|j| SandboxStatus {
                id: j.state.saved.id.clone(),
                backend: Backend::Function,
                liveness: crate::liveness::proc_liveness(
                    j.state.saved.init_pid,
                    j.state.saved.init_starttime,
                ),
            })
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        let jail = self.jail(id)?;
        if *jail.deleting.read().await {
            return Err(NodeError::NotFound(format!(
                "sandbox {id} is being deleted"
            )));
        }
        jail.check_not_paused()?;
        let s = crate::ports::connect_in_netns(
            id,
            jail.state.saved.init_pid,
            jail.state.saved.init_starttime,
            port,
        )
        .await?;
        Ok(Box::new(s))
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let mut adopted = Vec::new();
        let mut errors = Vec::new();
        let entries: Vec<String> = match std::fs::read_dir(&self.cfg.sandboxes_dir) {
            Ok(rd) => rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
            Err(e) => {
                return Err(NodeError::io(
                    format!("read {}", self.cfg.sandboxes_dir.display()),
                    e,
                ))
            }
        };
        for name in entries {
            if check_id(&name).is_err() {
                continue;
            }
            if self.has(&name) {
                adopted.push(name);
                continue;
            }
            let state = saved::read::<JailState>(&self.dir_of(&name));
            let alive = state
                .as_ref()
                .map(|s| {
                    s.saved.id == name
                        && proc_starttime(s.saved.init_pid) == Some(s.saved.init_starttime)
                })
                .unwrap_or(false);
            if let (Some(state), true, true) = (state, alive, keep.contains(&name)) {
                // Its uid range stays its own: no new jail may get an overlapping one.
                let uids = self.uids.reserve(state.saved.uid_base);
                let jail = self.adopt(state, uids);
                // Execs of the previous process lost their caller: end them.
                let cg = jail.cgroup.clone();
                let was_paused = jail.paused.load(Ordering::SeqCst);
                let stale =
                    spawn_blocking(move || {
                        // v1: tasks of a frozen parent cannot die; thaw for the cleanup and
                        // freeze again afterwards.
                        if was_paused {
                            cg.group().thaw()?;
                        }
                        let mut max = 0;
                        for c in cg.exec_children() {
                            if let Some(n) = c.dirs().next().and_then(|d| {
                                d.file_name()?.to_str()?.strip_prefix('x')?.parse().ok()
                            }) {
                                max = max.max(n);
                            }
                            c.destroy(KILL_TIMEOUT)?;
                        }
                        if was_paused {
                            cg.group().freeze(Instant::now() + FREEZE_TIMEOUT)?;
                        }
                        Ok(max)
                    })
                    .await;
                match stale {
                    Ok(max) => jail.next_exec.store(max + 1, Ordering::SeqCst),
                    Err(e) => errors.push(e.to_string()),
                }
                tracing::info!(sandbox = %name, backend = "function", "sandbox re-adopted");
                if !jail.paused.load(Ordering::SeqCst) {
                    // Reconnects to the agent the previous process started, if it lives.
                    self.kick_agent(&name);
                }
                adopted.push(name);
            } else {
                tracing::info!(sandbox = %name, backend = "function", "removing leftover sandbox");
                if let Err(e) = self.destroy(&name).await {
                    errors.push(e.to_string());
                }
            }
        }
        // Cgroups without a sandbox directory (e.g. the directory was removed by hand).
        for id in self.cgroups.list_sandboxes() {
            if !adopted.contains(&id) && !self.has(&id) && !self.cgroup_in_use(&id) {
                let cg = self.cgroups.sandbox(&id);
                if let Err(e) = spawn_blocking(move || Ok(cg.group().destroy(KILL_TIMEOUT)?)).await
                {
                    errors.push(e.to_string());
                }
            }
        }
        adopted.sort();
        Ok(super::readopt_done("function", adopted, &errors))
    }
}

/// Build and start a jail for `spec` in the claimed directory `dir` (its scratch disk
/// already mounted: [`crate::disk::mount_scratch`]) with cgroup `cg`, a
/// /tmp tmpfs of `tmp_mib` MiB and host uid/gid range `uid_base..uid_base+65536` (the
/// caller holds its [`UidLease`]); writes `state.json`. On error the caller removes what
/// was left (directory and cgroup). Used by cold creates and by the warm pool.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn build_jail(
    cfg: &FunctionConfig,
    spec: &SandboxSpec,
    image: &Image,
    dir: &Path,
    cg: &SandboxCgroup,
    tmp_mib: u64,
    uid_base: u32,
    ready: &mut Option<InitReady>,
) -> NodeResult<JailState> {
    let uid = uid_base;
    let d = dir.to_path_buf();
    let limits = Limits {
        memory_bytes: spec.memory_mib.saturating_mul(1 << 20),
        cpu: spec.cpu,
        pids_max: spec.pids_max,
    };
    let cg2 = cg.clone();
    spawn_blocking(move || {
        make_dirs(&d, uid)?;
        // A machine-id(5) of its own (a fork's replaces the one its checkpoint carried).
        crate::checkpoints::write_machine_id(&d.join("scratch/upper"), uid)?;
        Ok(cg2.create(&limits)?)
    })
    .await?;

    let init = InitSpec {
        lowerdirs: image
            .layers
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        upperdir: dir.join("scratch/upper").display().to_string(),
        workdir: dir.join("scratch/work").display().to_string(),
        rootfs: dir.join("rootfs").display().to_string(),
        hostname: spec.id.clone(),
        uid_base: uid,
        uid_count: UID_COUNT,
        cgroup_procs: cg
            .group()
            .procs_files()
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        tmp_mib,
        proc_views: proc_views(spec)?,
    };
    let r = run_init(&cfg.guest_bin, &init).await?;
    *ready = Some(r.clone());

    let state = JailState {
        saved: SavedSandbox::new(spec, image, (r.pid, r.starttime), uid),
        backend: Backend::Function,
    };
    let st = state.clone();
    let d = dir.to_path_buf();
    spawn_blocking(move || saved::write(&d, &st)).await?;
    Ok(state)
}

/// The stand-ins of `/proc/meminfo`, `cpuinfo`, `stat` and `loadavg` for `spec`'s limits
/// ([`sandlot_guest::procview`]), as `(name, content)`.
///
/// # Errors
/// `Internal` when the host's `/proc/cpuinfo` or `/proc/stat` cannot be read.
pub(crate) fn proc_views(spec: &SandboxSpec) -> NodeResult<Vec<(String, String)>> {
    use sandlot_guest::procview::{render_host, ViewLimits};
    let host_cpus = std::thread::available_parallelism().map_or(0, |n| n.get() as u32);
    let limits = ViewLimits::new(spec.memory_mib, spec.cpu, host_cpus);
    Ok(render_host(limits)
        .map_err(|e| {
            NodeError::io(
                "read /proc/cpuinfo and /proc/stat for the sandbox's views",
                e,
            )
        })?
        .into_iter()
        .map(|(n, c)| (n.to_string(), c))
        .collect())
}

/// Rewrites the `/proc` stand-ins of the running jail whose init is `init_pid` for `spec`
/// (a pooled jail built with the pool's limits, handed over to a sandbox with its own).
///
/// Security: written in place (the bind mounts inside hold the files' inodes) through
/// `/proc/<init_pid>/root/proc/<name>`: `/proc` inside is a procfs mount and the names
/// are bind mounts of the jail's private tmpfs, which the sandbox cannot unmount, rename
/// or replace (its mounts are locked: mount_namespaces(7)); `O_NOFOLLOW` refuses a symlink
/// in the last component all the same.
///
/// # Errors
/// `Internal` when a file cannot be opened or written.
pub(crate) fn rewrite_proc_views(init_pid: i32, spec: &SandboxSpec) -> NodeResult<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    for (name, content) in proc_views(spec)? {
        let path = format!("/proc/{init_pid}/root/proc/{name}");
        std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|mut f| f.write_all(content.as_bytes()))
            .map_err(|e| NodeError::io(format!("rewrite {path}"), e))?;
    }
    Ok(())
}

/// An exec plan for this jail: [`ExecPlan::build`] aimed at its init.
impl ExecPlan {
    fn new(state: &JailState, req: &ExecRequest) -> NodeResult<ExecPlan> {
        let mut plan = ExecPlan::build(&state.saved.image_env, &state.saved.spec, req)?;
        plan.spec.init_pid = state.saved.init_pid;
        plan.spec.init_starttime = state.saved.init_starttime;
        Ok(plan)
    }
}

/// Kills and removes the exec cgroup if the exec future is dropped before it cleaned up
/// (client disconnected): the exec's processes never outlive it.
struct ExecGuard {
    group: Option<Cgroup>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for ExecGuard {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        if let Some(g) = self.group.take() {
            // A plain thread: this may run outside a tokio runtime.
            std::thread::spawn(move || {
                if let Err(e) = g.destroy(KILL_TIMEOUT) {
                    tracing::warn!(error = %e, "cleanup of a dropped exec failed");
                }
            });
        }
    }
}

/// How the command ended, as seen from the status pipe.
enum Ending {
    Status(ExecStatus),
    /// EOF on the status pipe with nothing written: the helper was killed.
    Killed,
    TimedOut,
    /// The sandbox was deleted during the exec.
    Deleted,
}

/// A running `sandlot-guest exec` helper: the node's ends of its spec (fd 3) and status
/// (fd 4) pipes.
struct Helper {
    child: SpawnedChild,
    spec_w: OwnedFd,
    status_r: OwnedFd,
}

/// Start `sandlot-guest exec` (with `posix_spawn`: see [`super::spawn`]); it reads its spec
/// from fd 3 (blocking until the node writes it) and writes its status to fd 4. stdin is a
/// pipe when `stdin_piped`, else /dev/null. Signals for the command are blocked in it
/// until it can forward them (`sandlot_guest::spec::FORWARDED_SIGNALS`).
fn spawn_helper(guest_bin: &Path, stdin_piped: bool) -> NodeResult<Helper> {
    let io = |what: &str, e: std::io::Error| NodeError::io(what.to_string(), e);
    let (spec_r, spec_w) = cloexec_pipe().map_err(|e| io("pipe2", e))?;
    let (status_r, status_w) = cloexec_pipe().map_err(|e| io("pipe2", e))?;
    // Above the target numbers (see `SpawnedChild::spawn`).
    let spec_r = dup_high(&spec_r).map_err(|e| io("fcntl(F_DUPFD_CLOEXEC)", e))?;
    let status_w = dup_high(&status_w).map_err(|e| io("fcntl(F_DUPFD_CLOEXEC)", e))?;
    let child = SpawnedChild::spawn(
        guest_bin,
        &["exec"],
        stdin_piped,
        &[(&spec_r, 3), (&status_w, 4)],
        &sandlot_guest::spec::FORWARDED_SIGNALS,
    )
    .map_err(|e| io(&format!("spawn {} exec", guest_bin.display()), e))?;
    // The parent's copies of the child's ends must go (here, as they drop), or EOF never
    // comes.
    drop(spec_r);
    drop(status_w);
    Ok(Helper {
        child,
        spec_w,
        status_r,
    })
}

/// An exec helper started ahead of time, already a member of its own exec cgroup `x<n>`
/// and blocked reading its spec.
///
/// Why: on cgroup v1 the first write to a `cgroup.procs` file takes the global
/// `cgroup_threadgroup_rwsem` for writing, which waits for an RCU grace period (measured
/// 7–15 ms on the 2-core dev host, most of an exec's overhead); a standby pays it between
/// execs instead of inside one. Its exec then gets an `ExecSpec` whose `cgroup_procs` is
/// empty (already joined: the node wrote the helper's pid into them). Nothing about the
/// exec changes: same helper, same cgroup per exec, same set-up order in the helper; only
/// the join moves from the helper to the node, before the spec is sent.
///
/// Costs: one idle process per sandbox that ran [`STANDBY_AFTER_EXECS`] execs; it is in
/// the sandbox's cgroups, so it counts as one task against `pids_max` while it waits.
/// Delete kills it with the rest of the sandbox's cgroup; a node restart leaves it to read
/// EOF and exit, and `readopt` removes its empty group.
pub(crate) struct Standby {
    helper: Helper,
    xcg: crate::cgroups::ExecCgroup,
}

/// The exec group number of a pooled jail's standby helper ([`pooled_standby`]): no exec of
/// the sandbox takes it, theirs start at 1.
const POOLED_STANDBY_EXEC: u64 = 0;

/// A standby helper for the pooled jail of cgroup `cgroup`, made while the jail waits in
/// the warm pool, so that the first exec after hand-over (`run_code`'s run, or its compile)
/// skips the cgroup join too. Handed over with the jail ([`FunctionBackend::create`]).
///
/// # Errors
/// Those of the exec group's creation and the helper's spawn and join (the group is
/// removed then).
pub(crate) async fn pooled_standby(
    guest_bin: &Path,
    cgroup: &SandboxCgroup,
) -> NodeResult<Standby> {
    standby_in(guest_bin, cgroup.exec_child(POOLED_STANDBY_EXEC)).await
}

/// Create exec group `xcg`, spawn a helper and write its pid into the group.
async fn standby_in(guest_bin: &Path, xcg: crate::cgroups::ExecCgroup) -> NodeResult<Standby> {
    let x = xcg.clone();
    spawn_blocking(move || Ok(x.create()?)).await?;
    let joined = match spawn_helper(guest_bin, false) {
        Ok(helper) => {
            let pid = helper.child.id().to_string();
            let procs = xcg.group().procs_files();
            let res = spawn_blocking(move || {
                for f in &procs {
                    crate::cgroups::write_file(f, &pid)?;
                }
                Ok(())
            })
            .await;
            res.map(|()| helper)
        }
        Err(e) => Err(e),
    };
    match joined {
        Ok(helper) => Ok(Standby { helper, xcg }),
        Err(e) => {
            // The helper (if any) was killed on drop; remove the group.
            let g = xcg.group().clone();
            let _ = spawn_blocking(move || Ok(g.destroy(KILL_TIMEOUT)?)).await;
            Err(e)
        }
    }
}

impl Jail {
    /// The standby helper, when there is one and it is still alive (a dead one, e.g.
    /// OOM-killed while waiting, is discarded and its group removed).
    fn take_standby(&self) -> Option<Standby> {
        let mut s = self.standby.lock().unwrap().take()?;
        if matches!(s.helper.child.try_wait(), Ok(None)) {
            return Some(s);
        }
        let g = s.xcg.group().clone();
        std::thread::spawn(move || {
            let _ = g.destroy(KILL_TIMEOUT);
        });
        None
    }
}

/// Prepare a standby helper for `jail` in the background unless one exists or is being
/// prepared.
fn kick_standby(guest_bin: &Path, jail: &Arc<Jail>) {
    if jail.standby.lock().unwrap().is_some() || jail.standby_busy.swap(true, Ordering::SeqCst) {
        return;
    }
    let jail = jail.clone();
    let bin = guest_bin.to_path_buf();
    tokio::spawn(async move {
        if let Err(e) = prepare_standby(&bin, &jail).await {
            tracing::debug!(sandbox = %jail.state.saved.id, error = %e, "no standby exec helper");
        }
        jail.standby_busy.store(false, Ordering::SeqCst);
    });
}

async fn prepare_standby(guest_bin: &Path, jail: &Arc<Jail>) -> NodeResult<()> {
    // Under the read side of the lifecycle lock, like an exec's set-up: a delete waits for
    // it, or it sees the delete and does nothing.
    let lock = jail.deleting.read().await;
    if *lock || *jail.killed.borrow() {
        return Ok(());
    }
    let n = jail.next_exec.fetch_add(1, Ordering::SeqCst);
    let standby = standby_in(guest_bin, jail.cgroup.exec_child(n)).await?;
    *jail.standby.lock().unwrap() = Some(standby);
    Ok(())
}

async fn run_exec(
    guest_bin: &Path,
    jail: &Arc<Jail>,
    mut plan: ExecPlan,
    sink: Option<ExecSink>,
    standby_bin: Option<&Path>,
    control: Option<ExecControl>,
) -> NodeResult<ExecResult> {
    let (more_stdin, mut signals) = match control {
        Some(c) => (c.stdin, Some(c.signals)),
        None => (None, None),
    };
    let stdin_piped = plan.stdin.is_some() || more_stdin.is_some();
    let mut killed_rx = jail.killed.subscribe();
    let id = &jail.state.saved.id;

    // --- set-up, under the read side of the lifecycle lock ---
    let setup = jail.deleting.read().await;
    // `paused` again under the lock: a pause waits for set-ups holding it, not for one
    // that checked before and takes it after ([`super::pause`]).
    super::pause::check_live(id, *setup || *killed_rx.borrow(), &jail.paused)?;
    // A standby helper has /dev/null as stdin: only for execs without stdin.
    let standby = if !stdin_piped {
        jail.take_standby()
    } else {
        None
    };
    let mut guard = ExecGuard {
        group: None,
        tasks: Vec::new(),
    };
    let (xcg, start, helper) = match standby {
        Some(s) => {
            guard.group = Some(s.xcg.group().clone());
            // Already a member of every exec cgroup (joined by the node).
            plan.spec.cgroup_procs = Vec::new();
            (s.xcg, Instant::now(), s.helper)
        }
        None => {
            let n = jail.next_exec.fetch_add(1, Ordering::SeqCst);
            let xcg = jail.cgroup.exec_child(n);
            guard.group = Some(xcg.group().clone());
            {
                let x = xcg.clone();
                spawn_blocking(move || Ok(x.create()?)).await?;
            }
            plan.spec.cgroup_procs = xcg
                .group()
                .procs_files()
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            let start = Instant::now();
            let helper = spawn_helper(guest_bin, stdin_piped)?;
            (xcg, start, helper)
        }
    };
    let Helper {
        mut child,
        spec_w,
        status_r,
    } = helper;
    let oom_before = jail.cgroup.group().oom_kills();
    let spec_json = serde_json::to_vec(&plan.spec).expect("ExecSpec serialises");
    drop(setup);

    // Spec on fd 3, then EOF.
    let spec_task = tokio::spawn(async move {
        if let Ok(mut w) = tokio::net::unix::pipe::Sender::from_owned_fd(spec_w) {
            let _ = w.write_all(&spec_json).await;
        }
    });
    guard.tasks.push(spec_task.abort_handle());
    if let Some(mut w) = child.stdin.take() {
        let data = plan.stdin.take();
        let mut more = more_stdin;
        let t = tokio::spawn(async move {
            // EPIPE (the command does not read its stdin) is not an error.
            if let Some(data) = data {
                if w.write_all(&data).await.is_err() {
                    return;
                }
            }
            if let Some(rx) = more.as_mut() {
                while let Some(chunk) = rx.recv().await {
                    if w.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            }
            // Dropping `w` is the command's EOF.
        });
        guard.tasks.push(t.abort_handle());
    }
    let out_cap = Arc::new(Mutex::new(Capture::new(plan.cap)));
    let err_cap = Arc::new(Mutex::new(Capture::new(plan.cap)));
    let out_task = tokio::spawn(pump(
        child.stdout.take().expect("piped stdout"),
        out_cap.clone(),
        sink.clone(),
        true,
    ));
    let err_task = tokio::spawn(pump(
        child.stderr.take().expect("piped stderr"),
        err_cap.clone(),
        sink.clone(),
        false,
    ));
    guard.tasks.push(out_task.abort_handle());
    guard.tasks.push(err_task.abort_handle());

    let status_rx = tokio::net::unix::pipe::Receiver::from_owned_fd(status_r)
        .map_err(|e| NodeError::io("status pipe of sandlot-guest exec", e))?;
    // Kept (pinned) until the end: the helper may still write its status after a timeout,
    // and must not get EPIPE.
    let violations = std::sync::Mutex::new(Vec::new());
    let mut status_fut = std::pin::pin!(sandlot_guest::spec::read_exec_status(
        status_rx,
        &violations
    ));
    let group = xcg.group().clone();
    let helper_pid = child.id();
    let timeout = tokio::time::sleep(plan.timeout);
    tokio::pin!(timeout);
    let ending = loop {
        let sig = tokio::select! {
            s = status_fut.as_mut() => break match s { Some(s) => Ending::Status(s), None => Ending::Killed },
            _ = &mut timeout => break Ending::TimedOut,
            _ = killed_rx.wait_for(|k| *k) => break Ending::Deleted,
            Some(sig) = async { match signals.as_mut() { Some(r) => r.recv().await, None => std::future::pending().await } } => sig,
        };
        deliver_signal(&group, helper_pid, sig).await;
    };
    let duration_ms = start.elapsed().as_secs_f64() * 1000.0;

    if !matches!(ending, Ending::Status(_)) {
        // Timeout or delete: the whole process tree goes, not only the leader. The helper
        // is spared a moment so that it reaps its child itself (see `kill_except`).
        kill_tree(&group, helper_pid, &mut child).await;
        // Violation records the helper wrote before it was killed (EOF follows at once
        // when it is gone). Not after `Killed`: that future has completed.
        if matches!(ending, Ending::TimedOut | Ending::Deleted) {
            let _ = tokio::time::timeout(PIPE_GRACE, status_fut.as_mut()).await;
        }
    }
    // Output: until EOF; past a short grace, kill the exec cgroup (background children hold
    // the pipes) and read what is left until EOF or a last grace.
    let mut readers = std::pin::pin!(futures_join(out_task, err_task));
    if tokio::time::timeout(PIPE_GRACE, readers.as_mut())
        .await
        .is_err()
    {
        kill_tree(&group, helper_pid, &mut child).await;
        let _ = tokio::time::timeout(DRAIN_GRACE, readers.as_mut()).await;
    }
    // OOM: the exec group's own counter (v1 memory child; exact even when execs overlap);
    // where the exec group has no memory controller (v2 here) the sandbox counter's delta,
    // which may also count an OOM kill of an overlapping exec.
    let oom_killed = match group.oom_kills() {
        Some(n) => n > 0,
        None => match (oom_before, jail.cgroup.group().oom_kills()) {
            (Some(a), Some(b)) => b > a,
            _ => false,
        },
    };
    // Always end the exec's processes and remove its cgroup. The usual end: the helper
    // exits right after its status, its command reaped, and the group is empty; then the
    // answer need not wait for the removal of the group's directories (a few ms of cgroupfs
    // work), which goes on in the background. Otherwise kill first, and wait for it.
    let helper_gone = matches!(ending, Ending::Status(_))
        && matches!(
            tokio::time::timeout(PIPE_GRACE, child.wait()).await,
            Ok(Ok(_))
        );
    let g = group.clone();
    let empty = helper_gone
        && spawn_blocking(move || Ok(g.is_empty()))
            .await
            .unwrap_or(false);
    let cleanup = if empty {
        let (g, id) = (group.clone(), id.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(e) = g.remove(Instant::now() + KILL_TIMEOUT) {
                tracing::warn!(sandbox = %id, error = %e, "exec cgroup cleanup failed");
            }
        });
        Ok(())
    } else {
        kill_tree(&group, helper_pid, &mut child).await;
        let g = group.clone();
        spawn_blocking(move || Ok(g.destroy(KILL_TIMEOUT)?)).await
    };
    guard.group = None;
    let _ = child.start_kill();
    let _ = child.wait().await;
    for t in &guard.tasks {
        t.abort();
    }
    if let Err(e) = cleanup {
        tracing::warn!(sandbox = %id, error = %e, "exec cgroup cleanup failed");
    }
    if let Some(bin) = standby_bin {
        if !matches!(ending, Ending::Deleted)
            && jail.execs_done.fetch_add(1, Ordering::SeqCst) + 1 >= STANDBY_AFTER_EXECS
        {
            kick_standby(bin, jail);
        }
    }

    let mut res = ExecResult {
        duration_ms,
        violations: super::violations_from_guest(std::mem::take(
            &mut *violations.lock().unwrap_or_else(|p| p.into_inner()),
        )),
        ..Default::default()
    };
    match ending {
        Ending::Status(ExecStatus::Exited { code }) => res.exit_code = code,
        Ending::Status(ExecStatus::Signaled { signal }) => {
            res.exit_code = 128 + signal;
            res.signal = Some(signal);
        }
        Ending::Status(ExecStatus::SetupFailed {
            message,
            user_error,
            resource_exhausted,
        }) => {
            return Err(if resource_exhausted {
                NodeError::ResourceExhausted(format!(
                    "sandbox is at its process limit (pids_max={}): {message}",
                    jail.state.saved.spec.pids_max
                ))
            } else if user_error {
                NodeError::InvalidArgument(message)
            } else {
                NodeError::io(
                    format!("sandlot-guest exec in sandbox {id}: {message}"),
                    std::io::Error::other("exec set-up failed"),
                )
            })
        }
        // EOF without a status: the helper was killed under us (sandbox deleted, OOM kill of
        // the helper itself, ...): reported like a SIGKILL of the command.
        Ending::Killed | Ending::Deleted => {
            res.exit_code = 137;
            res.signal = Some(9);
        }
        Ending::TimedOut => {
            res.exit_code = 137;
            res.signal = Some(9);
            res.timed_out = true;
        }
    }
    res.oom_killed = oom_killed;
    let out = take_capture(&out_cap, plan.cap);
    let err = take_capture(&err_cap, plan.cap);
    res.set_output(&out, &err);
    Ok(res)
}

/// A signal for a running exec: SIGKILL kills its whole exec cgroup (helper included, so
/// the exec ends as killed by signal 9); a forwarded signal goes to the helper, which
/// passes it to the command's process group (`sandlot-guest exec`); others are ignored.
///
/// SIGKILL goes to the helper itself first: a helper still setting up has not joined the
/// exec cgroup yet, so killing the group alone missed it and the command started after the
/// kill was acknowledged (a kill right after a spawn: 19 of 20 kept running). A dead helper
/// forks nothing more; whatever it forked is in the group, which is killed next.
async fn deliver_signal(group: &Cgroup, helper_pid: i32, sig: i32) {
    if sig == libc::SIGKILL {
        if helper_pid > 0 {
            // Our child, not yet reaped: the pid cannot have been reused.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(helper_pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let g = group.clone();
        let _ = spawn_blocking(move || Ok(g.kill(Instant::now() + KILL_TIMEOUT)?)).await;
    } else if helper_pid > 0 && sandlot_guest::spec::FORWARDED_SIGNALS.contains(&sig) {
        // The helper is our child and not yet reaped (`child.wait` runs after the exec
        // ends), so its pid cannot have been reused.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(helper_pid),
            nix::sys::signal::Signal::try_from(sig).ok(),
        );
    }
}

/// Kill every process of the exec group but the helper, give the helper a moment to reap
/// its child and exit by itself, then kill whatever is left (the helper included).
async fn kill_tree(group: &Cgroup, helper_pid: i32, child: &mut SpawnedChild) {
    let g = group.clone();
    let _ =
        spawn_blocking(move || Ok(g.kill_except(helper_pid, Instant::now() + KILL_TIMEOUT)?)).await;
    let _ = tokio::time::timeout(Duration::from_millis(200), child.wait()).await;
    let g = group.clone();
    let _ = spawn_blocking(move || Ok(g.kill(Instant::now() + KILL_TIMEOUT)?)).await;
    let _ = child.start_kill();
}

fn take_capture(c: &Arc<Mutex<Capture>>, cap: usize) -> sandlot_api::Output {
    std::mem::replace(&mut *c.lock().unwrap(), Capture::new(cap)).finish()
}

/// Await two join handles; output of both is in their shared captures.
async fn futures_join(a: tokio::task::JoinHandle<()>, b: tokio::task::JoinHandle<()>) {
    let _ = a.await;
    let _ = b.await;
}

/// Read one stream to EOF into `cap`, forwarding chunks to `sink`.
async fn pump(
    mut r: impl tokio::io::AsyncRead + Unpin,
    cap: Arc<Mutex<Capture>>,
    sink: Option<ExecSink>,
    stdout: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        cap.lock().unwrap().push(&buf[..n]);
        if let Some(s) = &sink {
            let ev = if stdout {
                ExecEvent::stdout(&buf[..n])
            } else {
                ExecEvent::stderr(&buf[..n])
            };
            // A closed receiver does not stop the exec.
            let _ = s.send(ev).await;
        }
    }
}

/// Run `sandlot-guest init` with `spec` on stdin; returns its `InitReady` line.
async fn run_init(guest_bin: &Path, spec: &InitSpec) -> NodeResult<InitReady> {
    let mut child = tokio::process::Command::new(guest_bin)
        .arg("init")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_clear()
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| NodeError::io(format!("spawn {} init", guest_bin.display()), e))?;
    let json = serde_json::to_vec(spec).expect("InitSpec serialises");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut stderr = child.stderr.take().expect("piped stderr");
    let errbuf = Arc::new(Mutex::new(Vec::new()));
    let eb = errbuf.clone();
    let err_task = tokio::spawn(async move {
        let mut b = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut b).await {
            if n == 0 {
                break;
            }
            let mut v = eb.lock().unwrap();
            if v.len() < 64 * 1024 {
                v.extend_from_slice(&b[..n]);
            }
        }
    });
    let work = async {
        stdin
            .write_all(&json)
            .await
            .map_err(|e| NodeError::io("write InitSpec to sandlot-guest init", e))?;
        drop(stdin);
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .await
            .map_err(|e| NodeError::io("read InitReady from sandlot-guest init", e))?;
        // Wait for the helper itself (not for EOF: the sandbox's pid 1 lives on).
        let status = child
            .wait()
            .await
            .map_err(|e| NodeError::io("wait for sandlot-guest init", e))?;
        Ok::<_, NodeError>((line, status))
    };
    let res = tokio::time::timeout(INIT_TIMEOUT, work).await;
    // Let stderr arrive, without waiting on a pid 1 that may hold it.
    let _ = tokio::time::timeout(Duration::from_millis(200), err_task).await;
    let stderr = String::from_utf8_lossy(&errbuf.lock().unwrap())
        .trim()
        .to_string();
    let (line, status) = match res {
        Err(_) => {
            return Err(NodeError::io(
                format!("sandlot-guest init did not finish in {INIT_TIMEOUT:?}; stderr: {stderr}"),
                std::io::Error::from(std::io::ErrorKind::TimedOut),
            ))
        }
        Ok(r) => r?,
    };
    if !status.success() {
        return Err(NodeError::io(
            format!("sandlot-guest init failed ({status}): {stderr}"),
            std::io::Error::other("sandbox init failed"),
        ));
    }
    serde_json::from_str::<InitReady>(line.trim()).map_err(|e| {
        NodeError::io(
            format!("sandlot-guest init printed {line:?}, not InitReady; stderr: {stderr}"),
            std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        )
    })
}

/// The sandbox's layer directories: `scratch/upper`, `scratch/work` (on the mounted disk,
/// see [`crate::disk::mount_scratch`]) and `rootfs/`, owned by `uid`.
pub(crate) fn make_dirs(dir: &Path, uid: u32) -> NodeResult<()> {
    // The sandbox dir itself stays host-root owned; 0711 lets the sandbox's uid reach its
    // upper dir without listing anything.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .map_err(|e| NodeError::io(format!("chmod {}", dir.display()), e))?;
    make_layer_dirs(&dir.join("scratch"), uid)?;
    own_dir(&dir.join("rootfs"), uid, 0o755)
}

/// `DATA/disk-templates` (shared with the container backend): one formatted image per size.
pub(crate) fn disk_templates(cfg: &FunctionConfig) -> PathBuf {
    cfg.sandboxes_dir
        .parent()
        .unwrap_or(&cfg.sandboxes_dir)
        .join("disk-templates")
}

/// The upper dir of the sandbox in `dir`: `scratch/upper`, or `upper` for a sandbox made
/// before the disk quota (re-adopted after an upgrade).
pub(crate) fn upper_dir(dir: &Path) -> PathBuf {
    let old = dir.join("upper");
    if std::fs::symlink_metadata(&old).is_ok_and(|m| m.is_dir()) {
        old
    } else {
        dir.join("scratch/upper")
    }
}

/// The writable layer's directories in `dir`, owned by `uid` (root inside the sandbox):
/// `upper/` (0755) with `upper/workspace` (0755), `upper/root` (0700) and the scratch
/// mount points [`SCRATCH_DIRS`] (0755), and `work/` (0700).
pub(crate) fn make_layer_dirs(dir: &Path, uid: u32) -> NodeResult<()> {
    own_dir(&dir.join("upper"), uid, 0o755)?;
    own_dir(&dir.join("upper/workspace"), uid, 0o755)?;
    own_dir(&dir.join("upper/root"), uid, 0o700)?;
    for d in SCRATCH_DIRS {
        own_dir(&dir.join("upper").join(d), uid, 0o755)?;
    }
    own_dir(&dir.join("work"), uid, 0o700)
}

/// Top-level directories that Debian leaves empty for local use (`/mnt`, `/opt`, `/srv`,
/// `/media`, `/home`), made the sandbox root's in its writable layer so a program may write
/// there (SandboxFusion's `run_code` programs write e.g. `/mnt/out`; E2B's SDK works in
/// `/home/user`, which the node makes through the files API: on `container` that runs as
/// the sandbox's root, so it needs a writable `/home`). The overlay shows an upper
/// directory's owner and mode over the image's, and the image's own files beneath them
/// (say `/opt/sandlot/node`) stay owned by host root, so read-only: the shared layer is
/// never written. `sandlot-guest`'s landlock rules allow writing beneath the same paths.
pub(crate) const SCRATCH_DIRS: [&str; 5] = ["mnt", "opt", "srv", "media", "home"];

/// Creates `p` as a directory (if missing) owned by `uid:uid` with `mode`. Never follows a
/// symlink: an entry at `p` that is not a directory (a symlink or file that a sandbox left
/// in a writable layer a fork is seeded from, or that an image carries) is removed first,
/// so the chown and chmod act on `p` itself, never on a host path it points to.
pub(crate) fn own_dir(p: &Path, uid: u32, mode: u32) -> NodeResult<()> {
    match std::fs::symlink_metadata(p) {
        Ok(md) if md.is_dir() => {}
        Ok(_) => std::fs::remove_file(p)
            .and_then(|_| std::fs::create_dir(p))
            .map_err(|e| NodeError::io(format!("replace {} by a directory", p.display()), e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir(p)
            .map_err(|e| NodeError::io(format!("create {}", p.display()), e))?,
        Err(e) => return Err(NodeError::io(format!("stat {}", p.display()), e)),
    }
    std::os::unix::fs::lchown(p, Some(uid), Some(uid))
        .map_err(|e| NodeError::io(format!("chown {} to {uid}", p.display()), e))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| NodeError::io(format!("chmod {}", p.display()), e))
}

/// Kill, remove cgroups, unmount the scratch disk and anything else left under `dir` (the
/// overlay lives in the sandbox's mount namespace), remove `dir`.
pub(crate) fn destroy_blocking(cg: &SandboxCgroup, dir: &Path) -> NodeResult<()> {
    let mut errs: Vec<NodeError> = Vec::new();
    // A paused (frozen) sandbox is thawed first: on cgroup v1 frozen tasks do not die of
    // SIGKILL until thawed, and freezing/thawing a child of a frozen parent has no effect.
    if let Err(e) = cg.group().thaw() {
        errs.push(e.into());
    }
    if let Err(e) = cg.kill_all(KILL_TIMEOUT) {
        errs.push(e.into());
    }
    if let Err(e) = cg.remove(KILL_TIMEOUT) {
        errs.push(e.into());
    }
    // Never recurse into a mount: remove_dir_all would then delete through it. The mount
    // table is read once more only when an unmount failed (each read walks every mount of
    // the host's namespace).
    let scratch = dir.join("scratch");
    let mut all_unmounted = true;
    for m in mounts_under(dir) {
        if m != scratch {
            tracing::warn!(path = %m.display(), "unmounting a leftover host mount of a sandbox");
        }
        if let Err(e) = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
            all_unmounted = false;
            // EINVAL: not a mount point (any more): a concurrent cleanup was first.
            if e == nix::errno::Errno::EINVAL && !mounts_under(dir).contains(&m) {
                continue;
            }
            errs.push(NodeError::io(
                format!("unmount {}", m.display()),
                std::io::Error::from(e),
            ));
        }
    }
    if all_unmounted || mounts_under(dir).is_empty() {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => errs.push(NodeError::io(format!("remove {}", dir.display()), e)),
        }
    }
    match errs.len() {
        0 => Ok(()),
        1 => Err(errs.pop().unwrap()),
        _ => {
            let first = errs.remove(0);
            let rest: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
            Err(first.with_cleanup(Err(NodeError::internal(rest.join("; "), None))))
        }
    }
}

pub use crate::mountinfo::mounts_under;

impl Drop for FunctionBackend {
    /// Stops the warm pool (which destroys its jails), then removes the node's parent
    /// cgroups if nothing is left in them. Sandboxes left running for re-adoption keep the
    /// parents busy (EBUSY), and they stay.
    fn drop(&mut self) {
        drop(self.pool.take());
        if let Err(e) = self.cgroups.remove_parent() {
            tracing::warn!(error = %e, "could not remove the node's parent cgroups");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::saved::StoredSpec;
    use base64::Engine as _;
    use sandlot_guest::spec::{Rlimit, RlimitResource};
    use std::collections::BTreeMap;

    /// The standby helper's process and exec group: `(host pid, group dirs)`, once it is
    /// ready (within 10 s).
    async fn wait_standby(jail: &Jail) -> (i32, Vec<PathBuf>) {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = jail.standby.lock().unwrap().as_ref() {
                let pid = s.helper.child.id();
                return (pid, s.xcg.group().dirs().map(Path::to_path_buf).collect());
            }
            assert!(Instant::now() < end, "no standby helper within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Kills and removes a test sandbox's cgroup and the test's parent group when dropped,
    /// so that a failed assertion midway leaves nothing behind.
    struct CgroupCleanup(CgroupRoot, &'static str);

    impl Drop for CgroupCleanup {
        fn drop(&mut self) {
            let _ = self
                .0
                .sandbox(self.1)
                .group()
                .destroy(Duration::from_secs(5));
            let _ = self.0.remove_parent();
        }
    }

    /// Standby exec helpers (`SANDLOT_EXEC_STANDBY=1`): the next exec without stdin takes
    /// the pre-joined helper, with unchanged results (exit code, output, background
    /// children killed, timeout, OOM); an exec with stdin leaves it alone; delete kills it.
    /// Needs root, cgroups and the guest binary (`SANDLOT_GUEST_BIN` or target/debug).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn standby_helper_serves_execs_with_unchanged_semantics() {
        let test = "standby_helper_serves_execs_with_unchanged_semantics";
        const ID: &str = "sb-standby";
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIP {test}: needs root (namespaces, cgroups)");
            return;
        }
        let Ok(cgroups) = CgroupRoot::detect() else {
            eprintln!("SKIP {test}: no usable cgroups");
            return;
        };
        let guest_bin = std::env::var_os("SANDLOT_GUEST_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/sandlot-guest")
            });
        if !guest_bin.exists() {
            eprintln!("SKIP {test}: {} missing", guest_bin.display());
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = crate::images::ImageStore::open(tmp.path().join("images")).unwrap();
        let image = match store.build_busybox() {
            Ok(i) => i,
            Err(e) => {
                eprintln!("SKIP {test}: cannot build the busybox image: {e}");
                return;
            }
        };
        let cgroups = cgroups.with_parent(&format!("sandlot-unit-standby-{}", std::process::id()));
        let _cleanup = CgroupCleanup(cgroups.clone(), ID);
        let mut be = FunctionBackend::new(
            FunctionConfig {
                sandboxes_dir: tmp.path().join("sandboxes"),
                guest_bin,
                uid_base: 100_000,
            },
            cgroups,
            crate::net::NodeNet::new(tmp.path().join("net")),
        )
        .unwrap();
        // The standby belongs to the helper path (no guest agent).
        be.exec_standby = true;
        be.exec_agent = false;
        let spec = SandboxSpec {
            id: ID.into(),
            backend: Backend::Function,
            image: "busybox".into(),
            cpu: 1.0,
            memory_mib: 64,
            disk_mib: 64,
            pids_max: 64,
            env: BTreeMap::new(),
            network: sandlot_api::NetworkPolicy::None,
            runtime: None,
        };
        be.create(&spec, &image, None).await.unwrap();
        let sh = |script: &str, timeout_s: f64| {
            let mut r = ExecRequest::new(sandlot_api::Cmd::Shell(script.into()));
            r.timeout_s = Some(timeout_s);
            r
        };
        let jail = be.jail(ID).unwrap();
        // No standby before the second exec.
        for _ in 0..STANDBY_AFTER_EXECS {
            assert!(jail.standby.lock().unwrap().is_none());
            let r = be
                .exec(ID, &sh("true", 10.0), ExecIo::default())
                .await
                .unwrap();
            assert_eq!(r.exit_code, 0, "{r:?}");
        }

        // Exit code, output, and a background child that does not outlive the exec.
        let (pid, dirs) = wait_standby(&jail).await;
        assert!(dirs.iter().all(|d| d.exists()));
        let r = be
            .exec(
                ID,
                &sh("sleep 100 & echo out; echo err >&2; exit 7", 10.0),
                ExecIo::default(),
            )
            .await
            .unwrap();
        assert_eq!(
            (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
            (7, "out\n", "err\n")
        );
        assert!(!r.timed_out && !r.oom_killed, "{r:?}");
        assert!(
            proc_starttime(pid).is_none(),
            "the standby helper {pid} ran the exec"
        );
        // (an empty exec group is removed in the background after the answer)
        let end = Instant::now() + Duration::from_secs(5);
        while dirs.iter().any(|d| d.exists()) && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            dirs.iter().all(|d| !d.exists()),
            "its exec group is removed"
        );
        let ps = be
            .exec(ID, &sh("ps -o comm", 10.0), ExecIo::default())
            .await
            .unwrap();
        assert!(!ps.stdout.contains("sleep"), "{ps:?}");

        // An exec with stdin spawns its own helper and leaves the standby alone.
        let (pid, _) = wait_standby(&jail).await;
        let mut req = ExecRequest::new(sandlot_api::Cmd::Argv(vec!["cat".into()]));
        req.stdin_b64 = Some(base64::engine::general_purpose::STANDARD.encode("piped"));
        let r = be.exec(ID, &req, ExecIo::default()).await.unwrap();
        assert_eq!((r.exit_code, r.stdout.as_str()), (0, "piped"));
        assert!(proc_starttime(pid).is_some(), "standby kept");
        // And a standby exec's stdin is /dev/null.
        let r = be
            .exec(ID, &sh("cat; echo end", 10.0), ExecIo::default())
            .await
            .unwrap();
        assert_eq!((r.exit_code, r.stdout.as_str()), (0, "end\n"));
        assert!(proc_starttime(pid).is_none());

        // Timeout kills the whole tree.
        wait_standby(&jail).await;
        let r = be
            .exec(
                ID,
                &sh("echo before; sleep 100 & sleep 100", 1.0),
                ExecIo::default(),
            )
            .await
            .unwrap();
        assert!(r.timed_out, "{r:?}");
        assert_eq!(
            (r.exit_code, r.signal, r.stdout.as_str()),
            (137, Some(9), "before\n")
        );

        // OOM is reported from the exec group's own counter, and only for that exec.
        wait_standby(&jail).await;
        let r = be
            .exec(
                ID,
                &sh("head -c 200m /dev/zero | tail", 30.0),
                ExecIo::default(),
            )
            .await
            .unwrap();
        assert!(r.oom_killed && r.exit_code != 0, "{r:?}");
        wait_standby(&jail).await;
        let r = be
            .exec(ID, &sh("echo fine", 10.0), ExecIo::default())
            .await
            .unwrap();
        assert!(!r.oom_killed && r.exit_code == 0, "{r:?}");

        // Delete kills a waiting standby and removes its group.
        let (pid, dirs) = wait_standby(&jail).await;
        drop(jail);
        be.delete(ID).await.unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while proc_starttime(pid).is_some() && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            proc_starttime(pid).is_none(),
            "standby {pid} survived the delete"
        );
        assert!(dirs.iter().all(|d| !d.exists()));
    }

    #[test]
    fn starttime_of_self_and_missing() {
        let me = std::process::id() as i32;
        assert!(proc_starttime(me).is_some());
        assert_eq!(proc_starttime(me), proc_starttime(me));
        assert_eq!(proc_starttime(i32::MAX), None);
        assert_eq!(proc_starttime(0), None);
    }

    #[test]
    fn ids_are_checked() {
        assert!(check_id("sb-0123456789abcdef0123").is_ok());
        for bad in ["", "../x", "a/b", "a b", ".", ".."] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    fn state() -> JailState {
        JailState {
            backend: Backend::Function,
            saved: SavedSandbox {
                id: "sb-1".into(),
                image: "busybox".into(),
                image_env: vec![("A".into(), "img".into()), ("PATH".into(), "/img".into())],
                image_version: None,
                init_pid: 1,
                init_starttime: 1,
                uid_base: 100000,
                cgroup: None,
                spec: StoredSpec {
                    cpu: 1.0,
                    memory_mib: 64,
                    disk_mib: 10,
                    pids_max: 64,
                    env: [
                        ("A".to_string(), "sb".to_string()),
                        ("B".to_string(), "sb".to_string()),
                    ]
                    .into_iter()
                    .collect(),
                },
            },
        }
    }

    #[test]
    fn exec_plan_merges_env_and_validates() {
        let mut req = ExecRequest::new(sandlot_api::Cmd::Shell("echo hi".into()));
        req.env.insert("B".into(), "exec".into());
        let p = ExecPlan::new(&state(), &req).unwrap();
        let get = |k: &str| {
            p.spec
                .env
                .iter()
                .find(|(a, _)| a == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("PATH"), Some("/img"));
        assert_eq!(get("A"), Some("sb"));
        assert_eq!(get("B"), Some("exec"));
        assert_eq!(get("HOME"), Some("/root"));
        assert_eq!(p.spec.argv, ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(p.spec.cwd, "/workspace");
        assert_eq!(p.timeout, Duration::from_secs(60));
        assert_eq!(p.cap, 1 << 20);
        assert!(p.spec.rlimits.contains(&Rlimit {
            resource: RlimitResource::Fsize,
            value: 10 << 20
        }));

        for (t, ok) in [
            (0.0, false),
            (-1.0, false),
            (86400.0, true),
            (86400.5, false),
            (f64::NAN, false),
        ] {
            let mut r = req.clone();
            r.timeout_s = Some(t);
            assert_eq!(ExecPlan::new(&state(), &r).is_ok(), ok, "timeout {t}");
        }
        let mut r = req.clone();
        r.max_output_bytes = Some(MAX_MAX_OUTPUT + 1);
        assert!(ExecPlan::new(&state(), &r).is_err());
        let mut r = req.clone();
        r.user = Some("nobody".into());
        assert!(ExecPlan::new(&state(), &r).is_err());
        let mut r = req.clone();
        r.stdin_b64 = Some("!!".into());
        assert!(ExecPlan::new(&state(), &r).is_err());
        let mut r = req.clone();
        r.cmd = sandlot_api::Cmd::Argv(vec![]);
        assert!(ExecPlan::new(&state(), &r).is_err());
    }
}
