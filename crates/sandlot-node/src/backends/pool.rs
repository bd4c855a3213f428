//! Warm pool of ready `function` jails, so that `create` only has to hand one over.
//!
//! A pooled jail is an ordinary function jail (same `sandlot-guest init`, same namespaces,
//! seccomp, landlock and cgroups) built ahead of time with the pool's own limits
//! ([`POOL_CPU`] core, [`POOL_MEMORY_MIB`] MiB, [`POOL_PIDS_MAX`] tasks, no environment,
//! a [`POOL_TMP_MIB`] MiB /tmp) under an internal name `wp-<hex>`:
//!
//! * directory `DATA/warm-pool/<name>/` (sibling of `DATA/sandboxes`, same file system),
//!   so pooled jails never show up as sandboxes: `list()` does not see them, `readopt`
//!   never adopts them, and a node restart removes every leftover of the pool before it
//!   refills;
//! * cgroup `<parent>/<name>` in every hierarchy;
//! * a host uid range of its own from the backend's table ([`super::uids`]), like any
//!   jail; the hand-over passes it on to the sandbox unchanged (the jail's files and user
//!   namespace already belong to it). Ranges of a previous process's leftovers stay taken
//!   until the start-up sweep has killed them.
//!
//! Hand-over ([`WarmPool::hand_over`]), for a create whose image has a ready jail built
//! from the same layers and whose /tmp bound matches (see [`tmp_compatible`]): the spec's
//! limits are written to the jail's cgroup (lowering memory below the jail's usage is
//! checked: the init must still be alive afterwards), the host name inside is set to the
//! sandbox id (setns(2) into the jail's UTS namespace from a short-lived thread), the real
//! `state.json` is written into the pooled directory, and the directory is renamed onto the
//! sandbox's claimed (empty) directory `DATA/sandboxes/<id>` (rename(2) replaces an empty
//! directory atomically). Any failure destroys the pooled jail and the caller falls back
//! to a cold create.
//!
//! The cgroup keeps the pooled name, recorded in `state.json` (`cgroup`): cgroup v2 does not
//! implement rename(2) of cgroup directories (the kernel's v2 `kernfs_syscall_ops` has no
//! `rename`; v1 has `cgroup1_rename`), so one path that works on both is used. Nothing else
//! of a jail depends on its birth name: exec and files reach the sandbox through its init
//! pid (`/proc/PID/ns/*`, `/proc/PID/root`); the overlay mount inside the sandbox's mount
//! namespace holds the upper/work directories by reference, so renaming them on the host
//! does not disturb it.
//!
//! Refill: one thread of its own (a current-thread tokio runtime) keeps `per_image` ready
//! jails for each listed image, building one jail at a time so that it never takes more
//! than one core away from real creates; it is woken by every hand-over, backs off on
//! failures (a missing image: up to a minute between tries), and on drop of the pool stops,
//! finishes the build in flight and destroys every jail it holds. Pooled jails are real
//! processes, cgroups and directories and count toward the host's resources.
use super::function::{
    build_jail, destroy_blocking, proc_starttime, write_state, FunctionConfig, JailState,
    StoredSpec,
};
use super::uids::{UidLease, UidSlots};
use crate::cgroups::{CgroupRoot, Limits};
use crate::images::{Image, ImageStore};
use crate::node::{NodeError, NodeResult, SandboxSpec};
use sandlot_api::Backend;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The image layers a pooled sandbox was built from: each layer directory's path with its
/// device, inode and change time (ns). Equal paths alone do not prove a pooled sandbox is
/// current: a built-in image's layer is a directory inside the image (`busybox/rootfs`),
/// which `sandlot image rm` and `sandlot image build --force` delete and re-create under
/// the same path, while a pooled sandbox's overlay still holds the deleted one (an empty
/// tree once removed). Shared by this pool and the container pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LayerStamp(Vec<(PathBuf, Option<DirId>)>);

/// A directory's device, inode and change time (seconds, nanoseconds).
type DirId = (u64, u64, i64, i64);

impl LayerStamp {
    /// Stamp `layers` as they are now on disk (`None` for a layer that cannot be read).
    pub(crate) fn of(layers: &[PathBuf]) -> LayerStamp {
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
    pub(crate) fn matches(&self, layers: &[PathBuf]) -> bool {
        self.0.iter().all(|(_, id)| id.is_some()) && *self == LayerStamp::of(layers)
    }
}

/// Prefix of pooled jails' names (directory and cgroup).
pub const POOL_PREFIX: &str = "wp-";
/// CPU quota of a pooled jail before hand-over, cores.
pub const POOL_CPU: f64 = 1.0;
/// Memory limit of a pooled jail before hand-over, MiB.
pub const POOL_MEMORY_MIB: u64 = 512;
/// Task limit of a pooled jail before hand-over.
pub const POOL_PIDS_MAX: u64 = 256;
/// Size of a pooled jail's /tmp and /dev/shm tmpfs, MiB (fixed at init; see
/// [`tmp_compatible`]).
pub const POOL_TMP_MIB: u64 = 1024;
/// Longest back-off between failed builds of one image.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What the pool keeps ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Ready jails kept per image (0 = no pool).
    pub per_image: usize,
    /// Image names to keep jails of (names in the node's image store).
    pub images: Vec<String>,
}

/// Whether a pooled jail (tmpfs of [`POOL_TMP_MIB`] MiB) can serve `spec` with the same
/// effective /tmp bound as a cold create. A cold create sizes /tmp at
/// `min(disk_mib, memory_mib)`; tmpfs pages are charged to the sandbox's memory cgroup, so
/// the effective bound is the smaller of the tmpfs size and the memory limit. The pooled
/// jail fits when `min(POOL_TMP_MIB, memory) == min(disk, memory)`.
pub fn tmp_compatible(spec: &SandboxSpec) -> bool {
    POOL_TMP_MIB.min(spec.memory_mib) == spec.disk_mib.min(spec.memory_mib)
}

/// One ready pooled jail.
pub(crate) struct Pooled {
    /// `wp-<hex>`: directory and cgroup name.
    pub name: String,
    /// `DATA/warm-pool/<name>`.
    pub dir: PathBuf,
    /// Its state as built (id = name).
    pub state: JailState,
    /// Image layers it was built from (paths and directory identities).
    pub layers: LayerStamp,
    /// Its host uid range (`state.uid_base`); handed over with the jail.
    pub uids: UidLease,
}

struct Shared {
    cfg: FunctionConfig,
    cgroups: CgroupRoot,
    /// The backend's uid ranges: pooled jails hold theirs like sandboxes do.
    uids: Arc<UidSlots>,
    /// Ranges of a previous process's pooled jails, held until the start-up sweep has
    /// killed them (so that no new jail shares a range with a still-running leftover).
    leftover_uids: Mutex<HashMap<String, UidLease>>,
    images: ImageStore,
    pool: PoolConfig,
    dir: PathBuf,
    ready: Mutex<HashMap<String, VecDeque<Pooled>>>,
    /// Names whose directory or cgroup belongs to the pool (building, ready, or being
    /// handed over): `readopt`'s sweep of unknown cgroups leaves them alone.
    owned: Mutex<HashSet<String>>,
    stop: AtomicBool,
    wake: tokio::sync::Notify,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// The warm pool of one function backend (see the module docs).
pub struct WarmPool {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// `DATA/warm-pool`, next to `DATA/sandboxes`.
pub fn pool_dir(sandboxes_dir: &Path) -> PathBuf {
    sandboxes_dir
        .parent()
        .map(|p| p.join("warm-pool"))
        .unwrap_or_else(|| sandboxes_dir.join("..warm-pool"))
}

impl WarmPool {
    /// Start the refill thread. It first removes every leftover under `DATA/warm-pool`
    /// (jails of a previous process), then builds.
    ///
    /// # Errors
    /// `Internal` when the pool directory or the thread cannot be created.
    pub(crate) fn start(
        cfg: FunctionConfig,
        cgroups: CgroupRoot,
        uids: Arc<UidSlots>,
        images: ImageStore,
        pool: PoolConfig,
    ) -> NodeResult<WarmPool> {
        let dir = pool_dir(&cfg.sandboxes_dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| NodeError::io(format!("create {}", dir.display()), e))?;
        let leftover_uids = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let st = super::function::read_state(&e.path())?;
                Some((name, uids.reserve(st.uid_base)))
            })
            .collect();
        // Same as DATA/sandboxes: the sandbox uid must traverse to its upper dir.
        let _ = std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o711));
        let shared = Arc::new(Shared {
            cfg,
            cgroups,
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
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("sandlot-warm-pool".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "warm pool: no runtime; pool disabled");
                        return;
                    }
                };
                rt.block_on(refill_loop(&s));
                s.drain();
            })
            .map_err(|e| NodeError::io("spawn the warm-pool thread", e))?;
        tracing::info!(
            per_image = shared.pool.per_image,
            images = ?shared.pool.images,
            "warm pool started"
        );
        Ok(WarmPool {
            shared,
            thread: Some(thread),
        })
    }

    /// Whether `cgroup_name` belongs to the pool (building, ready or being handed over).
    pub(crate) fn owns(&self, cgroup_name: &str) -> bool {
        self.shared.owned.lock().unwrap().contains(cgroup_name)
    }

    /// Ready jails per image.
    pub fn ready(&self) -> BTreeMap<String, usize> {
        let r = self.shared.ready.lock().unwrap();
        self.shared
            .pool
            .images
            .iter()
            .map(|i| (i.clone(), r.get(i).map_or(0, |q| q.len())))
            .collect()
    }

    /// Hand-overs done and creates that found no usable pooled jail, since start.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.shared.hits.load(Ordering::Relaxed),
            self.shared.misses.load(Ordering::Relaxed),
        )
    }

    /// A ready jail for `spec` (built from `image`'s current layers, /tmp compatible), or
    /// `None` (the caller creates cold). A pooled jail of stale layers is destroyed.
    pub(crate) async fn take(&self, spec: &SandboxSpec, image: &Image) -> Option<Pooled> {
        if !self.shared.pool.images.contains(&image.name) || !tmp_compatible(spec) {
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
                self.shared.misses.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            if p.layers.matches(&image.layers) {
                return Some(p);
            }
            tracing::info!(pooled = %p.name, image = %image.name, "pooled jail of an older image build: destroyed");
            self.discard(p).await;
        }
    }

    /// Turn pooled jail `p` into sandbox `spec.id` in the claimed empty directory `dst`
    /// (see the module docs). On error the pooled jail is destroyed; `dst` is left as it
    /// was (empty), for a cold create.
    pub(crate) async fn hand_over(
        &self,
        p: Pooled,
        spec: &SandboxSpec,
        image: &Image,
        dst: &Path,
    ) -> NodeResult<(JailState, UidLease)> {
        let cg = self.shared.cgroups.sandbox(&p.name);
        let state = JailState {
            id: spec.id.clone(),
            backend: Backend::Function,
            image: image.name.clone(),
            image_env: image.env.clone(),
            init_pid: p.state.init_pid,
            init_starttime: p.state.init_starttime,
            uid_base: p.state.uid_base,
            cgroup: Some(p.name.clone()),
            spec: StoredSpec {
                cpu: spec.cpu,
                memory_mib: spec.memory_mib,
                disk_mib: spec.disk_mib,
                pids_max: spec.pids_max,
                env: spec.env.clone(),
            },
        };
        let limits = Limits {
            memory_bytes: spec.memory_mib.saturating_mul(1 << 20),
            cpu: spec.cpu,
            pids_max: spec.pids_max,
        };
        let (src, dst2, st, name) = (
            p.dir.clone(),
            dst.to_path_buf(),
            state.clone(),
            p.name.clone(),
        );
        let res = tokio::task::spawn_blocking(move || -> NodeResult<()> {
            cg.apply(&limits)?;
            // A memory limit below the jail's usage may have OOM-killed its init (v2
            // reclaims, then OOM-kills; v1 refuses the write with EBUSY).
            if proc_starttime(st.init_pid) != Some(st.init_starttime) {
                return Err(NodeError::io(
                    format!("pooled jail {name}: init gone after applying the limits"),
                    std::io::Error::other("pooled jail died"),
                ));
            }
            set_hostname(st.init_pid, &st.id)?;
            write_state(&src, &st)?;
            std::fs::rename(&src, &dst2).map_err(|e| {
                NodeError::io(format!("rename {} to {}", src.display(), dst2.display()), e)
            })
        })
        .await
        .unwrap_or_else(|e| {
            Err(NodeError::io(
                "hand-over task",
                std::io::Error::other(e.to_string()),
            ))
        });
        match res {
            Ok(()) => {
                self.shared.hits.fetch_add(1, Ordering::Relaxed);
                Ok((state, p.uids))
            }
            Err(e) => {
                self.discard(p).await;
                Err(e)
            }
        }
    }

    /// Forget `name` once its hand-over ended (the sandbox now owns the cgroup, or the
    /// jail was destroyed).
    pub(crate) fn release(&self, name: &str) {
        self.shared.owned.lock().unwrap().remove(name);
    }

    async fn discard(&self, p: Pooled) {
        let s = self.shared.clone();
        let _ = tokio::task::spawn_blocking(move || s.destroy(&p.name, &p.dir)).await;
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            // Finishes the build in flight (bounded by the init timeout), then destroys
            // every pooled jail.
            let _ = t.join();
        }
    }
}

impl Shared {
    fn destroy(&self, name: &str, dir: &Path) {
        let cg = self.cgroups.sandbox(name);
        if let Err(e) = destroy_blocking(&cg, dir) {
            tracing::warn!(pooled = %name, error = %e, "removing a pooled jail failed");
        }
        self.owned.lock().unwrap().remove(name);
    }

    /// Destroy every ready jail of this pool. Leftovers of other processes are swept only
    /// at start: a pool that stops must not touch the jails of a newer process.
    fn drain(&self) {
        let all: Vec<Pooled> = self
            .ready
            .lock()
            .unwrap()
            .drain()
            .flat_map(|(_, q)| q)
            .collect();
        for p in all {
            self.destroy(&p.name, &p.dir);
        }
    }

    /// Remove every entry of the pool directory that no hand-over holds.
    fn sweep_dir(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with(POOL_PREFIX) || self.owned.lock().unwrap().contains(&name) {
                continue;
            }
            tracing::info!(pooled = %name, "removing a leftover pooled jail");
            self.destroy(&name, &e.path());
            // Dead now (or failed to die: then it keeps its range until the next start).
            if !e.path().exists() {
                self.leftover_uids.lock().unwrap().remove(&name);
            }
        }
    }

    fn ready_count(&self, image: &str) -> usize {
        self.ready.lock().unwrap().get(image).map_or(0, |q| q.len())
    }

    async fn build_one(&self, image: &Image) -> NodeResult<Pooled> {
        let name = new_name(POOL_PREFIX);
        let dir = self.dir.join(&name);
        // Registered before its cgroup exists: readopt's sweep never takes it for a leftover.
        self.owned.lock().unwrap().insert(name.clone());
        if let Err(e) = std::fs::create_dir(&dir) {
            self.owned.lock().unwrap().remove(&name);
            return Err(NodeError::io(format!("create {}", dir.display()), e));
        }
        let spec = SandboxSpec {
            id: name.clone(),
            backend: Backend::Function,
            image: image.name.clone(),
            cpu: POOL_CPU,
            memory_mib: POOL_MEMORY_MIB,
            disk_mib: POOL_TMP_MIB,
            pids_max: POOL_PIDS_MAX,
            env: BTreeMap::new(),
            network: sandlot_api::NetworkPolicy::None,
            runtime: None,
        };
        // Before the build: a layer replaced meanwhile makes the jail stale, never current.
        let layers = LayerStamp::of(&image.layers);
        let cg = self.cgroups.sandbox(&name);
        let mut ready = None;
        // On failure the lease is dropped only after the half-built jail is destroyed.
        let mut uids = None;
        let built = match self.uids.allocate() {
            Ok(u) => {
                let base = uids.insert(u).base();
                build_jail(
                    &self.cfg,
                    &spec,
                    image,
                    &dir,
                    &cg,
                    POOL_TMP_MIB,
                    base,
                    &mut ready,
                )
                .await
            }
            Err(e) => Err(e),
        };
        match built {
            Ok(mut state) => {
                let uids = uids.expect("allocated above");
                state.cgroup = Some(name.clone());
                Ok(Pooled {
                    name,
                    dir,
                    state,
                    layers,
                    uids,
                })
            }
            Err(e) => {
                // build_jail leaves its half-built jail to the caller (as create does).
                let (d, cg) = (dir.clone(), self.cgroups.sandbox(&name));
                let _ = tokio::task::spawn_blocking(move || destroy_blocking(&cg, &d)).await;
                drop(uids);
                self.owned.lock().unwrap().remove(&name);
                Err(e)
            }
        }
    }
}

async fn refill_loop(s: &Shared) {
    {
        // Leftovers of a previous process (the node's readopt already removed their
        // cgroups when it ran first; destroy covers both anyway).
        s.sweep_dir();
    }
    let mut backoff: HashMap<String, (tokio::time::Instant, Duration)> = HashMap::new();
    while !s.stop.load(Ordering::SeqCst) {
        let now = tokio::time::Instant::now();
        let next = s.pool.images.iter().find(|i| {
            s.ready_count(i) < s.pool.per_image
                && backoff.get(*i).is_none_or(|(until, _)| *until <= now)
        });
        let Some(name) = next.cloned() else {
            // Nothing to do: wait for a hand-over, or for the earliest back-off to end.
            let wait = backoff
                .values()
                .map(|(u, _)| u.saturating_duration_since(now))
                .filter(|d| !d.is_zero())
                .min()
                .unwrap_or(Duration::from_secs(5));
            tokio::select! {
                _ = s.wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
            continue;
        };
        let built = match s.images.get(&name) {
            Ok(image) => s.build_one(&image).await,
            Err(e) => Err(e),
        };
        match built {
            Ok(p) => {
                backoff.remove(&name);
                if s.stop.load(Ordering::SeqCst) {
                    s.destroy(&p.name, &p.dir);
                    break;
                }
                s.ready
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
                tracing::warn!(image = %name, error = %e, retry_in_s = d.as_secs(), "warm pool: building a jail failed");
                backoff.insert(name, (tokio::time::Instant::now() + d, d));
            }
        }
    }
}

/// A fresh pooled name: `prefix` + hex digits of the time, the process id and a counter.
pub(crate) fn new_name(prefix: &str) -> String {
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
pub(crate) fn set_hostname(pid: i32, name: &str) -> NodeResult<()> {
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
    use super::LayerStamp;

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
