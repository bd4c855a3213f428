//! Warm pools: ready sandboxes built ahead of time, so that a create only has to hand one
//! over. One generic pool ([`WarmPool`]) serves the `function` backend
//! ([`super::function::pool`]: jails `wp-<hex>`) and the `container` backend
//! ([`super::container::pool`]: runc containers `cp-<hex>`); a small trait,
//! [`PoolMember`], supplies what differs (build, destroy, the state file, the state after
//! hand-over).
//!
//! A member is an ordinary sandbox of its backend built with the pool's own limits
//! ([`POOL_CPU`] core, [`POOL_MEMORY_MIB`] MiB, [`POOL_PIDS_MAX`] tasks, no environment)
//! under an internal name `<prefix><hex>` ([`PoolMember::PREFIX`]), its directory and
//! cgroup name:
//!
//! * its directory lies in the pool's own directory next to the backend's sandboxes (same
//!   file system), so members never show up as sandboxes: `list()` does not see them,
//!   `readopt` never adopts them, and a node restart removes every leftover of the pool
//!   before it refills;
//! * a host uid range of its own from the node's table ([`super::uids`]), passed on to the
//!   sandbox unchanged at hand-over. Ranges of a previous process's leftovers stay taken
//!   until the start-up sweep has removed them.
//!
//! Hand-over (`WarmPool::create`), for a create whose image has a ready member built from
//! the same layers (the backend decides beforehand which specs a member can serve): the
//! spec's limits are written to the member's cgroup (a memory limit below its usage is
//! checked: the init must still be alive afterwards), the host name inside is set to the
//! sandbox id (`set_hostname`), the `/proc` stand-ins are rewritten for the spec's limits, the real `state.json` is written into the pooled
//! directory, and the directory is renamed onto the sandbox's claimed (empty) directory
//! (rename(2) replaces an empty directory atomically). Any failure destroys the member and
//! the caller falls back to a cold create in the same directory.
//!
//! The cgroup keeps the pooled name, recorded in `state.json` (`cgroup`): cgroup v2 does not
//! implement rename(2) of cgroup directories (the kernel's v2 `kernfs_syscall_ops` has no
//! `rename`; v1 has `cgroup1_rename`), so one path that works on both is used.
//!
//! Refill: one thread per pool (a current-thread tokio runtime) keeps `per_image` ready
//! members for each listed image, building up to [`PoolConfig::builds`] at once (`sandlot
//! up --warm-pool-builds`, default 2), the image that misses the most members first. A
//! build spends most of its wall time waiting on the kernel (mounts, namespaces, cgroup
//! moves), so one build at a time fell behind concurrent creates, which then built their
//! jail cold; a small bound keeps the refill from taking the cores real creates need. The
//! loop is woken by every hand-over, backs off on failures (a missing image: up to a minute
//! between tries), and on drop of the pool stops, finishes the builds in flight and
//! destroys every member it holds. Members are real processes, cgroups and directories and
//! count toward the host's resources.
use super::saved::{self, SavedSandbox};
use super::uids::{UidLease, UidSlots};
use crate::cgroups::{CgroupRoot, Limits};
use crate::images::{Image, ImageStore};
use crate::node::{NodeError, NodeResult, SandboxSpec};
use crate::sys::{proc_starttime, spawn_blocking};
use sandlot_api::Backend;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// CPU quota of a pooled member before hand-over, cores.
pub const POOL_CPU: f64 = 1.0;
/// Memory limit of a pooled member before hand-over, MiB.
pub const POOL_MEMORY_MIB: u64 = 512;
/// Task limit of a pooled member before hand-over.
pub const POOL_PIDS_MAX: u64 = 256;
/// Longest back-off between failed builds of one image.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What a pool keeps ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Ready members kept per image (0 = no pool).
    pub per_image: usize,
    /// Image names to keep members of (names in the node's image store).
    pub images: Vec<String>,
    /// Members built at once, at most ([`PoolConfig::builds`] bounds it to 1 ..=
    /// `per_image` × images).
    pub max_builds: usize,
}

impl PoolConfig {
    /// Members the refill builds at once: `max_builds`, at least 1 and at most the number
    /// of members the pool keeps (`per_image` × images).
    pub fn builds(&self) -> usize {
        self.max_builds
            .min(self.per_image.saturating_mul(self.images.len()))
            .max(1)
    }
}

/// What a [`WarmPool`] needs of its backend: how to build, destroy and hand over one
/// member.
pub trait PoolMember: Send + Sync + 'static {
    /// The backend's `state.json` contents (embedding a [`SavedSandbox`]).
    type State: Clone + Send + serde::Serialize + 'static;
    /// Prefix of the members' names (directory and cgroup; `wp-`, `cp-`).
    const PREFIX: &'static str;
    /// What one member is, for logs (`jail`, `container`).
    const WHAT: &'static str;
    /// The pool's name, for logs and its thread (`warm pool`, `container pool`).
    const NAME: &'static str;

    /// The node's cgroups: a member's group is `sandbox(name)`.
    fn cgroups(&self) -> &CgroupRoot;

    /// Build member `name` (spec: `pool_spec`) from `image` in the empty directory `dir`,
    /// as host uid range `uid_base`.
    ///
    /// # Errors
    /// Those of the backend's create; whatever was made is left to [`PoolMember::destroy`].
    fn build(
        &self,
        name: &str,
        image: &Image,
        dir: &Path,
        uid_base: u32,
    ) -> impl Future<Output = NodeResult<Self::State>> + Send;

    /// Remove member `name` in `dir` entirely (processes, mounts, cgroups, directory).
    ///
    /// # Errors
    /// What could not be removed.
    fn destroy(&self, name: &str, dir: &Path) -> impl Future<Output = NodeResult<()>> + Send;

    /// The state of sandbox `spec` made of member `name`, built as `built` (its common part:
    /// [`SavedSandbox::handed_over`]).
    fn handed_over(
        &self,
        name: &str,
        built: &Self::State,
        spec: &SandboxSpec,
        image: &Image,
    ) -> Self::State;

    /// The common part of a member's state (its init's pid and start time, its uid base).
    fn saved(state: &Self::State) -> &SavedSandbox;

    /// Rewrite the member's per-sandbox `/proc` stand-ins (`sandlot_guest::procview`),
    /// built for the pool's limits, for `spec`'s (the member is still in `dir`).
    ///
    /// # Errors
    /// `Internal` when a stand-in cannot be written.
    fn write_proc_views(dir: &Path, state: &Self::State, spec: &SandboxSpec) -> NodeResult<()>;
}

/// The spec a member `name` of `backend` is built with: the pool's limits, no environment,
/// network `none`, a `disk_mib` MiB disk (or /tmp).
pub(crate) fn pool_spec(name: &str, backend: Backend, image: &Image, disk_mib: u64) -> SandboxSpec {
    SandboxSpec {
        id: name.to_string(),
        backend,
        image: image.name.clone(),
        cpu: POOL_CPU,
        memory_mib: POOL_MEMORY_MIB,
        disk_mib,
        pids_max: POOL_PIDS_MAX,
        env: BTreeMap::new(),
        network: sandlot_api::NetworkPolicy::None,
        runtime: None,
    }
}

/// The image layers a pooled sandbox was built from: each layer directory's path with its
/// device, inode and change time (ns). Equal paths alone do not prove a pooled sandbox is
/// current: a built-in image's layer is a directory inside the image (`busybox/rootfs`),
/// which `sandlot image rm` and `sandlot image build --force` delete and re-create under
/// the same path, while a pooled sandbox's overlay still holds the deleted one (an empty
/// tree once removed).
#[derive(Debug, Clone, PartialEq, Eq)]
struct LayerStamp(Vec<(PathBuf, Option<DirId>)>);

/// A directory's device, inode and change time (seconds, nanoseconds).
type DirId = (u64, u64, i64, i64);

impl LayerStamp {
    /// Stamp `layers` as they are now on disk (`None` for a layer that cannot be read).
    fn of(layers: &[PathBuf]) -> LayerStamp {
        use std::os::unix::fs::MetadataExt;
        LayerStamp(
            layers
                .iter()
                .map(|l| {
                    let id = std::fs::metadata(l)
                        .ok()
                        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()));
                    (l.clone(), id)
                })
                .collect(),
        )
    }

    /// Whether `layers` are still the very directories this stamp was taken of (a layer
    /// that could not be read then or now never matches).
    fn matches(&self, layers: &[PathBuf]) -> bool {
        self.0.iter().all(|(_, id)| id.is_some()) && *self == LayerStamp::of(layers)
    }
}

/// One ready member.
struct Pooled<M: PoolMember> {
    /// `<prefix><hex>`: directory and cgroup name.
    name: String,
    /// `<pool dir>/<name>`.
    dir: PathBuf,
    /// Its state as built (id = name).
    state: M::State,
    /// Image layers it was built from (paths and directory identities).
    layers: LayerStamp,
    /// Its host uid range; handed over with the member.
    uids: UidLease,
}

struct Shared<M: PoolMember> {
    member: M,
    /// The node's uid ranges: members hold theirs like sandboxes do.
    uids: Arc<UidSlots>,
    /// Ranges of a previous process's members, held until the start-up sweep has removed
    /// them (so that no new member shares a range with a still-running leftover).
    leftover_uids: Mutex<HashMap<String, UidLease>>,
    images: ImageStore,
    pool: PoolConfig,
    dir: PathBuf,
    ready: Mutex<HashMap<String, VecDeque<Pooled<M>>>>,
    /// Names whose directory or cgroup belongs to the pool (building, ready, or being
    /// handed over): `readopt`'s sweep of unknown cgroups leaves them alone.
    owned: Mutex<HashSet<String>>,
    stop: AtomicBool,
    wake: tokio::sync::Notify,
    hits: AtomicU64,
    misses: AtomicU64,
    /// Hand-overs per image name.
    hits_by_image: Mutex<BTreeMap<String, u64>>,
}

/// The warm pool of one backend (see the module docs).
pub struct WarmPool<M: PoolMember> {
    shared: Arc<Shared<M>>,
    /// The refill thread; taken by [`WarmPool::stop`].
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl<M: PoolMember> WarmPool<M> {
    /// Start the pool of `member` in directory `dir` into `slot`, unless one runs there
    /// already or `pool` keeps nothing. Its refill thread first removes every leftover in
    /// `dir` (members of a previous process), then builds. Call it after the backend's
    /// `readopt`, which clears the previous process's cgroups first.
    ///
    /// # Errors
    /// `Internal` when the pool directory or the thread cannot be created.
    pub(crate) fn start_once(
        slot: &OnceLock<Self>,
        member: M,
        dir: PathBuf,
        uids: Arc<UidSlots>,
        images: ImageStore,
        pool: PoolConfig,
    ) -> NodeResult<()> {
        // Serialised: a second pool starting in parallel would sweep the first one's members.
        static START: Mutex<()> = Mutex::new(());
        let _once = START.lock().unwrap_or_else(|e| e.into_inner());
        if slot.get().is_some() || pool.per_image == 0 || pool.images.is_empty() {
            return Ok(());
        }
        std::fs::create_dir_all(&dir)
            .map_err(|e| NodeError::io(format!("create {}", dir.display()), e))?;
        // As the sandboxes' directory: a sandbox's root must traverse to its files.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .map_err(|e| NodeError::io(format!("chmod {}", dir.display()), e))?;
        let leftover_uids = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                Some((
                    name,
                    uids.reserve(saved::read::<SavedSandbox>(&e.path())?.uid_base),
                ))
            })
            .collect();
        let shared = Arc::new(Shared {
            member,
            uids,
            leftover_uids: Mutex::new(leftover_uids),
            images,
            pool,
            dir,
            ready: Mutex::new(HashMap::new()),
            owned: Mutex::new(HashSet::new()),
            stop: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            hits_by_image: Mutex::new(BTreeMap::new()),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sandlot-{}", M::NAME.replace(' ', "-")))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "{}: no runtime; pool disabled", M::NAME);
                        return;
                    }
                };
                rt.block_on(async {
                    s.refill_loop().await;
                    s.drain().await;
                });
            })
            .map_err(|e| NodeError::io(format!("spawn the {} thread", M::NAME), e))?;
        tracing::info!(
            per_image = shared.pool.per_image,
            images = ?shared.pool.images,
            "{} started",
            M::NAME
        );
        let _ = slot.set(WarmPool {
            shared,
            thread: Mutex::new(Some(thread)),
        });
        Ok(())
    }

    /// The backend's member implementation.
    pub(crate) fn member(&self) -> &M {
        &self.shared.member
    }

    /// Whether `cgroup_name` belongs to the pool (building, ready or being handed over).
    pub(crate) fn owns(&self, cgroup_name: &str) -> bool {
        self.shared.owned.lock().unwrap().contains(cgroup_name)
    }

    /// Ready members per image.
    pub fn ready(&self) -> BTreeMap<String, usize> {
        let r = self.shared.ready.lock().unwrap();
        self.shared
            .pool
            .images
            .iter()
            .map(|i| (i.clone(), r.get(i).map_or(0, |q| q.len())))
            .collect()
    }

    /// Hand-overs done and creates that found no ready member of their image, since start.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.shared.hits.load(Ordering::Relaxed),
            self.shared.misses.load(Ordering::Relaxed),
        )
    }

    /// Hand-overs done per image since start (images with none left out).
    pub fn handovers_by_image(&self) -> BTreeMap<String, u64> {
        self.shared.hits_by_image.lock().unwrap().clone()
    }

    /// Create sandbox `spec.id` from a ready member of `image` in the claimed empty
    /// directory `dst` (see the module docs), passing its state and uid range to `adopt`
    /// (the backend's table of sandboxes). The caller has checked that a member can serve
    /// `spec`. Returns `false` when there is no usable member (none ready, or the
    /// hand-over failed: the member is destroyed); `dst` is then still empty, for a cold
    /// create.
    pub(crate) async fn create(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        dst: &Path,
        adopt: impl FnOnce(M::State, UidLease),
    ) -> bool {
        let Some(p) = self.take(image).await else {
            return false;
        };
        let name = p.name.clone();
        let done = match self.hand_over(p, spec, image, dst).await {
            Ok((state, uids)) => {
                adopt(state, uids);
                tracing::info!(sandbox = %spec.id, backend = %spec.backend, image = %image.name, pooled = %name, "sandbox created from the {}", M::NAME);
                true
            }
            Err(e) => {
                tracing::warn!(sandbox = %spec.id, pooled = %name, error = %e, "pooled {} unusable; creating cold", M::WHAT);
                false
            }
        };
        // After adopt: the cgroup belongs to the sandbox now (or is gone).
        self.shared.owned.lock().unwrap().remove(&name);
        done
    }

    /// A ready member built from `image`'s current layers, or `None`. A member of stale
    /// layers is destroyed.
    async fn take(&self, image: &Image) -> Option<Pooled<M>> {
        if !self.shared.pool.images.contains(&image.name) {
            return None;
        }
        loop {
            let p = self
                .shared
                .ready
                .lock()
                .unwrap()
                .get_mut(&image.name)
                .and_then(|q| q.pop_front());
            self.shared.wake.notify_one();
            let Some(p) = p else {
                tracing::debug!(image = %image.name, "{}: no ready {} for this create", M::NAME, M::WHAT);
                self.shared.misses.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            if p.layers.matches(&image.layers) {
                return Some(p);
            }
            tracing::info!(pooled = %p.name, image = %image.name, "pooled {} of an older image build: destroyed", M::WHAT);
            self.shared.destroy(&p.name, &p.dir).await;
        }
    }

    /// Turn member `p` into sandbox `spec.id` in `dst`. On error the member is destroyed.
    async fn hand_over(
        &self,
        p: Pooled<M>,
        spec: &SandboxSpec,
        image: &Image,
        dst: &Path,
    ) -> NodeResult<(M::State, UidLease)> {
        let cg = self.shared.member.cgroups().sandbox(&p.name);
        let state = self
            .shared
            .member
            .handed_over(&p.name, &p.state, spec, image);
        let limits = Limits {
            memory_bytes: spec.memory_mib.saturating_mul(1 << 20),
            cpu: spec.cpu,
            pids_max: spec.pids_max,
        };
        let (init_pid, init_starttime) = (
            M::saved(&p.state).init_pid,
            M::saved(&p.state).init_starttime,
        );
        let (src, dst, st, name, id, sp) = (
            p.dir.clone(),
            dst.to_path_buf(),
            state.clone(),
            p.name.clone(),
            spec.id.clone(),
            spec.clone(),
        );
        let res = spawn_blocking(move || {
            cg.apply(&limits)?;
            // A memory limit below the member's usage may have OOM-killed its init (v2
            // reclaims, then OOM-kills; v1 refuses the write with EBUSY).
            if proc_starttime(init_pid) != Some(init_starttime) {
                return Err(NodeError::io(
                    format!(
                        "pooled {} {name}: init gone after applying the limits",
                        M::WHAT
                    ),
                    std::io::Error::other(format!("pooled {} died", M::WHAT)),
                ));
            }
            set_hostname(init_pid, &id)?;
            M::write_proc_views(&src, &st, &sp)?;
            saved::write(&src, &st)?;
            std::fs::rename(&src, &dst).map_err(|e| {
                NodeError::io(format!("rename {} to {}", src.display(), dst.display()), e)
            })
        })
        .await;
        match res {
            Ok(()) => {
                self.shared.hits.fetch_add(1, Ordering::Relaxed);
                *self
                    .shared
                    .hits_by_image
                    .lock()
                    .unwrap()
                    .entry(image.name.clone())
                    .or_default() += 1;
                Ok((state, p.uids))
            }
            Err(e) => {
                self.shared.destroy(&p.name, &p.dir).await;
                Err(e)
            }
        }
    }
}

impl<M: PoolMember> WarmPool<M> {
    /// Stop refilling and destroy every ready member; blocks until done (the builds in
    /// flight are finished and destroyed first, bounded by the backend's timeouts). Later creates find no
    /// member and build their own. Idempotent. A node stopping for good calls it so that
    /// its ready members (processes, mounts, loop devices, cgroups) do not outlive it; a
    /// node that is killed leaves them to the next start's sweep.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_one();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl<M: PoolMember> Drop for WarmPool<M> {
    fn drop(&mut self) {
        self.stop();
    }
}

impl<M: PoolMember> Shared<M> {
    async fn destroy(&self, name: &str, dir: &Path) {
        if let Err(e) = self.member.destroy(name, dir).await {
            tracing::warn!(pooled = %name, error = %e, "removing a pooled {} failed", M::WHAT);
        }
        self.owned.lock().unwrap().remove(name);
    }

    /// Destroy every ready member of this pool. Leftovers of other processes are swept only
    /// at start: a pool that stops must not touch the members of a newer process.
    async fn drain(&self) {
        let all: Vec<Pooled<M>> = self
            .ready
            .lock()
            .unwrap()
            .drain()
            .flat_map(|(_, q)| q)
            .collect();
        // At once: a node stopping waits for this (members are at most per_image × images).
        futures::future::join_all(all.iter().map(|p| self.destroy(&p.name, &p.dir))).await;
    }

    /// Remove every entry of the pool directory that no hand-over holds.
    async fn sweep_dir(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with(M::PREFIX) || self.owned.lock().unwrap().contains(&name) {
                continue;
            }
            tracing::info!(pooled = %name, "removing a leftover pooled {}", M::WHAT);
            self.destroy(&name, &e.path()).await;
            // Gone now (or failed to go: then it keeps its range until the next start).
            if !e.path().exists() {
                self.leftover_uids.lock().unwrap().remove(&name);
            }
        }
    }

    fn ready_count(&self, image: &str) -> usize {
        self.ready.lock().unwrap().get(image).map_or(0, |q| q.len())
    }

    async fn build_one(&self, image: &Image) -> NodeResult<Pooled<M>> {
        let name = new_name(M::PREFIX);
        let dir = self.dir.join(&name);
        // Registered before its cgroup exists: readopt's sweep never takes it for a leftover.
        self.owned.lock().unwrap().insert(name.clone());
        if let Err(e) = std::fs::create_dir(&dir) {
            self.owned.lock().unwrap().remove(&name);
            return Err(NodeError::io(format!("create {}", dir.display()), e));
        }
        // Before the build: a layer replaced meanwhile makes the member stale, never current.
        let layers = LayerStamp::of(&image.layers);
        // On failure the lease is dropped only after the half-built member is gone.
        let mut uids = None;
        let started = std::time::Instant::now();
        let built = match self.uids.allocate() {
            Ok(u) => {
                let base = uids.insert(u).base();
                self.member.build(&name, image, &dir, base).await
            }
            Err(e) => Err(e),
        };
        tracing::debug!(pooled = %name, image = %image.name, ok = built.is_ok(), ms = started.elapsed().as_millis() as u64, "{}: built a {}", M::NAME, M::WHAT);
        match built {
            Ok(state) => Ok(Pooled {
                name,
                dir,
                state,
                layers,
                uids: uids.expect("allocated above"),
            }),
            Err(e) => {
                self.destroy(&name, &dir).await;
                drop(uids);
                Err(e)
            }
        }
    }

    /// The image to build a member of next (see [`most_missing`]), counting ready members
    /// and those in `building`.
    fn next_image(
        &self,
        building: &HashMap<String, usize>,
        backoff: &HashMap<String, (tokio::time::Instant, Duration)>,
        now: tokio::time::Instant,
    ) -> Option<String> {
        most_missing(
            &self.pool.images,
            self.pool.per_image,
            |i| self.ready_count(i) + building.get(i).copied().unwrap_or(0),
            |i| backoff.get(i).is_some_and(|(until, _)| *until > now),
        )
        .cloned()
    }

    async fn refill_loop(&self) {
        use futures::StreamExt as _;
        // Leftovers of a previous process (the node's readopt already removed their cgroups
        // when it ran first; destroy covers both anyway).
        self.sweep_dir().await;
        let mut backoff: HashMap<String, (tokio::time::Instant, Duration)> = HashMap::new();
        // Builds in flight (at most `builds`), and how many of each image.
        let mut inflight = futures::stream::FuturesUnordered::new();
        let mut building: HashMap<String, usize> = HashMap::new();
        let builds = self.pool.builds();
        while !self.stop.load(Ordering::SeqCst) {
            let now = tokio::time::Instant::now();
            while inflight.len() < builds {
                let Some(name) = self.next_image(&building, &backoff, now) else {
                    break;
                };
                *building.entry(name.clone()).or_default() += 1;
                inflight.push(async move {
                    let built = match self.images.get(&name) {
                        Ok(image) => self.build_one(&image).await,
                        Err(e) => Err(e),
                    };
                    (name, built)
                });
            }
            // Wait for a build to finish, a hand-over (or stop), or the earliest back-off
            // to end.
            let wait = backoff
                .values()
                .map(|(u, _)| u.saturating_duration_since(now))
                .filter(|d| !d.is_zero())
                .min()
                .unwrap_or(Duration::from_secs(5));
            let done = tokio::select! {
                Some(done) = inflight.next(), if !inflight.is_empty() => done,
                _ = self.wake.notified() => continue,
                _ = tokio::time::sleep(wait) => continue,
            };
            let (name, built) = done;
            if let Some(n) = building.get_mut(&name) {
                *n = n.saturating_sub(1);
            }
            match built {
                Ok(p) => {
                    backoff.remove(&name);
                    if self.stop.load(Ordering::SeqCst) {
                        self.destroy(&p.name, &p.dir).await;
                        break;
                    }
                    self.ready
                        .lock()
                        .unwrap()
                        .entry(name)
                        .or_default()
                        .push_back(p);
                }
                Err(e) => {
                    let d = backoff
                        .get(&name)
                        .map_or(Duration::from_secs(1), |(_, d)| (*d * 2).min(MAX_BACKOFF));
                    tracing::warn!(image = %name, error = %e, retry_in_s = d.as_secs(), "{}: building a {} failed", M::NAME, M::WHAT);
                    backoff.insert(name, (tokio::time::Instant::now() + d, d));
                }
            }
        }
        // Stopping: finish the builds in flight and destroy what they made.
        while let Some((_, built)) = inflight.next().await {
            if let Ok(p) = built {
                self.destroy(&p.name, &p.dir).await;
            }
        }
    }
}

/// Of `images` with fewer than `per_image` members (`have`: ready plus being built) and not
/// `backing_off`, the one missing the most (ties: the first listed), so that the image
/// creates drain is refilled first; `None` when every image is full or backing off.
fn most_missing(
    images: &[String],
    per_image: usize,
    have: impl Fn(&str) -> usize,
    backing_off: impl Fn(&str) -> bool,
) -> Option<&String> {
    let mut best: Option<(&String, usize)> = None;
    for i in images {
        let missing = per_image.saturating_sub(have(i));
        if missing == 0 || backing_off(i) {
            continue;
        }
        if best.is_none_or(|(_, m)| missing > m) {
            best = Some((i, missing));
        }
    }
    best.map(|(i, _)| i)
}

/// A fresh pooled name: `prefix` + hex digits of the time, the process id and a counter.
fn new_name(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!(
        "{prefix}{:x}{:06x}",
        t ^ (u64::from(std::process::id()) << 40),
        N.fetch_add(1, Ordering::Relaxed) & 0xff_ffff
    )
}

/// Set the host name inside the UTS namespace of `pid` (the sandbox's init).
///
/// Security: a fresh thread joins only the sandbox's UTS namespace (no user, mount or pid
/// namespace), calls sethostname(2) and exits; it touches nothing of the sandbox's files
/// and its namespace membership dies with it. Host root holds CAP_SYS_ADMIN over the
/// sandbox's user namespace, which owns that UTS namespace.
fn set_hostname(pid: i32, name: &str) -> NodeResult<()> {
    let path = format!("/proc/{pid}/ns/uts");
    let f = std::fs::File::open(&path).map_err(|e| NodeError::io(format!("open {path}"), e))?;
    let name = name.to_string();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWUTS)
                .map_err(|e| NodeError::io(format!("setns {path}"), e.into()))?;
            nix::unistd::sethostname(&name)
                .map_err(|e| NodeError::io(format!("sethostname {name:?} in {path}"), e.into()))
        })
        .join()
        .unwrap_or_else(|_| {
            Err(NodeError::io(
                "sethostname thread panicked",
                std::io::Error::other("panic"),
            ))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::{most_missing, LayerStamp, PoolConfig};

    #[test]
    fn builds_at_once_are_bounded_by_what_the_pool_keeps() {
        let cfg = |per_image, n: usize, max_builds| PoolConfig {
            per_image,
            images: (0..n).map(|i| format!("i{i}")).collect(),
            max_builds,
        };
        assert_eq!(cfg(4, 4, 2).builds(), 2);
        assert_eq!(cfg(4, 4, 0).builds(), 1, "at least one");
        assert_eq!(cfg(1, 2, 8).builds(), 2, "never more than the members kept");
        assert_eq!(cfg(4, 1, 100).builds(), 4);
    }

    #[test]
    fn the_image_missing_the_most_members_is_built_first() {
        let images: Vec<String> = ["python", "lang-python", "lang-cpp"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let pick = |have: &[usize], off: &[&str]| {
            most_missing(
                &images,
                4,
                |i| have[images.iter().position(|x| x == i).unwrap()],
                |i| off.contains(&i),
            )
            .map(String::as_str)
        };
        assert_eq!(pick(&[4, 1, 3], &[]), Some("lang-python"));
        assert_eq!(
            pick(&[2, 2, 4], &[]),
            Some("python"),
            "ties: the first listed"
        );
        assert_eq!(pick(&[4, 1, 3], &["lang-python"]), Some("lang-cpp"));
        assert_eq!(pick(&[4, 4, 4], &[]), None);
        assert_eq!(pick(&[5, 4, 4], &[]), None, "more than per_image is full");
        assert_eq!(
            pick(&[0, 0, 0], &["python", "lang-python", "lang-cpp"]),
            None
        );
    }

    #[test]
    fn a_layer_recreated_under_the_same_path_is_stale() {
        let tmp = tempfile::tempdir().unwrap();
        let layer = tmp.path().join("busybox/rootfs");
        std::fs::create_dir_all(layer.join("bin")).unwrap();
        let layers = vec![layer.clone()];
        let stamp = LayerStamp::of(&layers);
        assert!(stamp.matches(&layers));
        // Reading it, or another stamp of the same tree, changes nothing.
        let _ = std::fs::read_dir(&layer).unwrap().count();
        assert!(LayerStamp::of(&layers).matches(&layers));
        // `image rm` + `image build`: the same path, another directory.
        std::fs::remove_dir_all(&layer).unwrap();
        assert!(!stamp.matches(&layers), "a removed layer must not match");
        std::fs::create_dir_all(layer.join("bin")).unwrap();
        assert!(!stamp.matches(&layers), "a re-created layer must not match");
        // A layer that could not be read when stamped never matches.
        let missing = vec![tmp.path().join("nope")];
        assert!(!LayerStamp::of(&missing).matches(&missing));
    }
}
