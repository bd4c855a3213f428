//! Warm pool of ready runc containers, so that a `container` create only has to hand one
//! over instead of running `runc run` in the request. The same design as the function
//! backend's pool ([`super::pool`]): same hand-over rules, refill thread and start-up sweep.
//!
//! A pooled container is an ordinary runc container (same bundle, seccomp profile, user
//! namespace, capabilities, agent, cgroup, scratch disk of [`POOL_DISK_MIB`] MiB and agent
//! socket; network `none`) built ahead of time with the pool's own limits
//! ([`POOL_CPU`] core, [`POOL_MEMORY_MIB`] MiB, [`POOL_PIDS_MAX`] tasks, no environment)
//! under an internal name `cp-<hex>`, which is its runc container id and its cgroup name:
//!
//! * bundle directory `DATA/container-pool/<name>/` (sibling of `DATA/containers`, same
//!   file system), so pooled containers never show up as sandboxes: `list()` does not see
//!   them, `readopt` never adopts them, and a node restart removes every leftover of the
//!   pool (`runc delete --force <name>`, unmount, cgroups, directory) before it refills;
//! * cgroup `<parent>-ctr/<name>` in every hierarchy;
//! * a host uid range of its own from the node's table ([`super::uids`]), passed on to the
//!   sandbox unchanged at hand-over.
//!
//! Hand-over ([`ContainerPool::hand_over`]), for a create with runtime runc, network
//! `none`, no checkpoint seed, `disk_mib` equal to [`POOL_DISK_MIB`] and an image that has
//! a ready container built from the same layers: the spec's limits are written to the
//! container's cgroup (memory, cpu quota and cpuset placement, pids; a memory limit below
//! the container's usage is checked: its init must still be alive afterwards), the host
//! name inside is set to the sandbox id (setns(2) into the container's UTS namespace, as
//! the function pool does), the real `state.json` is written into the pooled directory and
//! the directory is renamed onto the sandbox's claimed (empty) directory
//! `DATA/containers/<id>` (rename(2) replaces an empty directory atomically). Any failure
//! destroys the pooled container and the caller falls back to a cold create.
//!
//! What keeps the pooled name, and why it still works after the rename:
//!
//! * runc's container id and the cgroup: runc has no rename, and cgroup v2 does not
//!   implement rename(2) of cgroup directories. Both are recorded in `state.json`
//!   (`runtime_id`, `cgroup`), and every runtime call and cgroup lookup of the backend
//!   (delete, destroy, readopt, pause, OOM counting, checkpoint) goes through them.
//! * the host mounts (rootfs overlay, scratch disk) move with their parent directory (a
//!   mount hangs on its dentry); the container's own mount namespace holds them by
//!   reference. The overlay's `upperdir=` option text in mountinfo keeps the old path.
//! * the agent socket: a unix socket is reached through its inode, so the node connects to
//!   `DATA/containers/<id>/agent.sock` after the rename; the listening socket the agent
//!   accepts on is the same.
//! * runc's own state (`DATA/runtime/runc/<name>/state.json`) still names the old bundle
//!   path; `runc delete` does not use it (no hooks are configured).
//! * environment: the sandbox's `env` is applied per exec by the agent (as for every
//!   container), so the pooled agent's empty environment does not matter.
//!
//! Everything else (runsc, crun, a network allow policy, another disk size, a fork of a
//! checkpoint, an image outside the pool list) is created cold as before.
//!
//! Refill: one thread of its own (a current-thread tokio runtime) keeps `per_image` ready
//! containers for each listed image, one build at a time (so it never takes more than about
//! one core from real creates); it is woken by every hand-over, backs off on failures (up
//! to a minute), and on drop of the pool stops, finishes the build in flight and destroys
//! every container it holds.
use super::container::{read_state, write_state, ContainerState, Core, Runtime};
use super::function::{proc_starttime, StoredSpec};
use super::pool::LayerStamp;
pub use super::pool::{PoolConfig, POOL_CPU, POOL_MEMORY_MIB, POOL_PIDS_MAX};
use super::uids::{UidLease, UidSlots};
use crate::cgroups::Limits;
use crate::images::{Image, ImageStore};
use crate::node::{NodeError, NodeResult, SandboxSpec};
use sandlot_api::Backend;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Prefix of pooled containers' names (runc id, directory and cgroup).
pub const POOL_PREFIX: &str = "cp-";
/// Scratch disk of a pooled container, MiB: the API's default `disk_mib`. Only creates
/// asking for this size are served from the pool (the disk image is fixed at build).
pub const POOL_DISK_MIB: u64 = 1024;
/// Longest back-off between failed builds of one image.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// One ready pooled container.
pub(crate) struct Pooled {
    /// `cp-<hex>`: runc id, directory and cgroup name.
    pub name: String,
    /// `DATA/container-pool/<name>`.
    pub dir: PathBuf,
    /// Its state as built (id = name).
    pub state: ContainerState,
    /// Image layers it was built from (paths and directory identities).
    pub layers: LayerStamp,
    /// Its host uid range (`state.uid_base`); handed over with the container.
    pub uids: UidLease,
}

struct Shared {
    core: Arc<Core>,
    uids: Arc<UidSlots>,
    /// Ranges of a previous process's pooled containers, held until the start-up sweep
    /// has removed them.
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

/// The warm pool of the container backend (see the module docs).
pub struct ContainerPool {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// `DATA/container-pool`, next to `DATA/containers`.
pub fn pool_dir(containers_dir: &Path) -> PathBuf {
    containers_dir
        .parent()
        .map(|p| p.join("container-pool"))
        .unwrap_or_else(|| containers_dir.join("..container-pool"))
}

/// Whether a create of `spec` with `runtime` may be served by a pooled container (apart
/// from the image): runc, network `none`, the pool's disk size.
pub fn spec_compatible(spec: &SandboxSpec, runtime: Runtime) -> bool {
    runtime == Runtime::Runc
        && spec.network == sandlot_api::NetworkPolicy::None
        && spec.disk_mib == POOL_DISK_MIB
}

impl ContainerPool {
    /// Start the refill thread. It first removes every leftover under
    /// `DATA/container-pool` (containers of a previous process), then builds.
    ///
    /// # Errors
    /// `Internal` when the pool directory or the thread cannot be created.
    pub(crate) fn start(
        core: Arc<Core>,
        uids: Arc<UidSlots>,
        images: ImageStore,
        pool: PoolConfig,
    ) -> NodeResult<ContainerPool> {
        let dir = pool_dir(&core.cfg.dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| NodeError::io(format!("create {}", dir.display()), e))?;
        // Same as DATA/containers: the container's root must traverse to its rootfs.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .map_err(|e| NodeError::io(format!("chmod {}", dir.display()), e))?;
        let leftover_uids = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let st = read_state(&e.path())?;
                Some((name, uids.reserve(st.uid_base)))
            })
            .collect();
        let shared = Arc::new(Shared {
            core,
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
            .name("sandlot-container-pool".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "container pool: no runtime; pool disabled");
                        return;
                    }
                };
                rt.block_on(async {
                    refill_loop(&s).await;
                    s.drain().await;
                });
            })
            .map_err(|e| NodeError::io("spawn the container-pool thread", e))?;
        tracing::info!(
            per_image = shared.pool.per_image,
            images = ?shared.pool.images,
            "container pool started"
        );
        Ok(ContainerPool {
            shared,
            thread: Some(thread),
        })
    }

    /// Whether `cgroup_name` belongs to the pool (building, ready or being handed over).
    pub(crate) fn owns(&self, cgroup_name: &str) -> bool {
        self.shared.owned.lock().unwrap().contains(cgroup_name)
    }

    /// Ready containers per image.
    pub fn ready(&self) -> BTreeMap<String, usize> {
        let r = self.shared.ready.lock().unwrap();
        self.shared
            .pool
            .images
            .iter()
            .map(|i| (i.clone(), r.get(i).map_or(0, |q| q.len())))
            .collect()
    }

    /// Hand-overs done and creates that found no ready container of their image, since
    /// start.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.shared.hits.load(Ordering::Relaxed),
            self.shared.misses.load(Ordering::Relaxed),
        )
    }

    /// A ready container for `spec` (see [`spec_compatible`]; built from `image`'s current
    /// layers), or `None` (the caller creates cold). A pooled container of stale layers is
    /// destroyed.
    pub(crate) async fn take(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        runtime: Runtime,
    ) -> Option<Pooled> {
        if !self.shared.pool.images.contains(&image.name) || !spec_compatible(spec, runtime) {
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
            tracing::info!(pooled = %p.name, image = %image.name, "pooled container of an older image build: destroyed");
            self.shared.destroy(&p.name, &p.dir).await;
        }
    }

    /// Turn pooled container `p` into sandbox `spec.id` in the claimed empty directory
    /// `dst` (see the module docs). On error the pooled container is destroyed; `dst` is
    /// left as it was (empty), for a cold create.
    ///
    /// # Errors
    /// `Internal` when a limit, the host name, the state file or the rename fails, or the
    /// container died (e.g. a memory limit below its usage).
    pub(crate) async fn hand_over(
        &self,
        p: Pooled,
        spec: &SandboxSpec,
        image: &Image,
        dst: &Path,
    ) -> NodeResult<(ContainerState, UidLease)> {
        let cg = self.shared.core.cgroups.sandbox(&p.name);
        let state = ContainerState {
            id: spec.id.clone(),
            image: image.name.clone(),
            image_env: image.env.clone(),
            runtime: Runtime::Runc,
            uid_base: p.state.uid_base,
            init_pid: p.state.init_pid,
            init_starttime: p.state.init_starttime,
            spec: StoredSpec {
                cpu: spec.cpu,
                memory_mib: spec.memory_mib,
                disk_mib: spec.disk_mib,
                pids_max: spec.pids_max,
                env: spec.env.clone(),
            },
            runtime_id: Some(p.name.clone()),
            cgroup: Some(p.name.clone()),
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
            // A memory limit below the container's usage may have OOM-killed its agent
            // (v2 reclaims, then OOM-kills; v1 refuses the write with EBUSY).
            if proc_starttime(st.init_pid) != Some(st.init_starttime) {
                return Err(NodeError::io(
                    format!("pooled container {name}: init gone after applying the limits"),
                    std::io::Error::other("pooled container died"),
                ));
            }
            super::pool::set_hostname(st.init_pid, &st.id)?;
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
                self.shared.destroy(&p.name, &p.dir).await;
                Err(e)
            }
        }
    }

    /// Forget `name` once its hand-over ended (the sandbox now owns the cgroup, or the
    /// container was destroyed).
    pub(crate) fn release(&self, name: &str) {
        self.shared.owned.lock().unwrap().remove(name);
    }
}

impl Drop for ContainerPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            // Finishes the build in flight (bounded by the runtime and agent timeouts),
            // then destroys every pooled container.
            let _ = t.join();
        }
    }
}

impl Shared {
    /// `runc delete --force <name>`, unmount, cgroups, directory.
    async fn destroy(&self, name: &str, dir: &Path) {
        if let Err(e) = self
            .core
            .destroy_at(dir, name, name, Some(Runtime::Runc), None)
            .await
        {
            tracing::warn!(pooled = %name, error = %e, "removing a pooled container failed");
        }
        self.owned.lock().unwrap().remove(name);
    }

    /// Destroy every ready container of this pool. Leftovers of other processes are swept
    /// only at start: a pool that stops must not touch the containers of a newer process.
    async fn drain(&self) {
        let all: Vec<Pooled> = self
            .ready
            .lock()
            .unwrap()
            .drain()
            .flat_map(|(_, q)| q)
            .collect();
        for p in all {
            self.destroy(&p.name, &p.dir).await;
        }
    }

    /// Remove every entry of the pool directory that no hand-over holds.
    async fn sweep_dir(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with(POOL_PREFIX) || self.owned.lock().unwrap().contains(&name) {
                continue;
            }
            tracing::info!(pooled = %name, "removing a leftover pooled container");
            self.destroy(&name, &e.path()).await;
            if !e.path().exists() {
                self.leftover_uids.lock().unwrap().remove(&name);
            }
        }
    }

    fn ready_count(&self, image: &str) -> usize {
        self.ready.lock().unwrap().get(image).map_or(0, |q| q.len())
    }

    async fn build_one(&self, image: &Image) -> NodeResult<Pooled> {
        let bin = self.core.runtime_bin(Runtime::Runc)?;
        let name = super::pool::new_name(POOL_PREFIX);
        let dir = self.dir.join(&name);
        // Registered before its cgroup exists: readopt's sweep never takes it for a leftover.
        self.owned.lock().unwrap().insert(name.clone());
        if let Err(e) = std::fs::create_dir(&dir) {
            self.owned.lock().unwrap().remove(&name);
            return Err(NodeError::io(format!("create {}", dir.display()), e));
        }
        let spec = SandboxSpec {
            id: name.clone(),
            backend: Backend::Container,
            image: image.name.clone(),
            cpu: POOL_CPU,
            memory_mib: POOL_MEMORY_MIB,
            disk_mib: POOL_DISK_MIB,
            pids_max: POOL_PIDS_MAX,
            env: BTreeMap::new(),
            network: sandlot_api::NetworkPolicy::None,
            runtime: Some(Runtime::Runc.name().into()),
        };
        // Before the build: a layer replaced meanwhile makes the container stale, never current.
        let layers = LayerStamp::of(&image.layers);
        let cg = self.core.cgroups.sandbox(&name);
        // On failure the lease is dropped only after the half-built container is gone.
        let mut uids = None;
        let built = match self.uids.allocate() {
            Ok(u) => {
                let base = uids.insert(u).base();
                self.core
                    .create_inner(&dir, &spec, image, Runtime::Runc, &bin, base, &cg, None)
                    .await
            }
            Err(e) => Err(e),
        };
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
}

async fn refill_loop(s: &Shared) {
    // Leftovers of a previous process (the node's readopt already removed their cgroups
    // when it ran first; destroy covers both anyway).
    s.sweep_dir().await;
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
                    s.destroy(&p.name, &p.dir).await;
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
                tracing::warn!(image = %name, error = %e, retry_in_s = d.as_secs(), "container pool: building a container failed");
                backoff.insert(name, (tokio::time::Instant::now() + d, d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn spec(disk_mib: u64) -> SandboxSpec {
        SandboxSpec {
            id: "sb-1".into(),
            backend: Backend::Container,
            image: "busybox".into(),
            cpu: 1.0,
            memory_mib: 256,
            disk_mib,
            pids_max: 64,
            env: BTreeMap::new(),
            network: sandlot_api::NetworkPolicy::None,
            runtime: None,
        }
    }

    #[test]
    fn only_runc_network_none_and_the_pool_disk_size_are_served() {
        assert!(spec_compatible(&spec(POOL_DISK_MIB), Runtime::Runc));
        assert!(!spec_compatible(&spec(POOL_DISK_MIB), Runtime::Runsc));
        assert!(!spec_compatible(&spec(POOL_DISK_MIB), Runtime::Crun));
        assert!(!spec_compatible(&spec(512), Runtime::Runc));
        let mut s = spec(POOL_DISK_MIB);
        s.network = sandlot_api::NetworkPolicy::Allow(Default::default());
        assert!(!spec_compatible(&s, Runtime::Runc));
    }

    #[test]
    fn pool_dir_is_a_sibling_of_the_containers_dir() {
        assert_eq!(
            pool_dir(Path::new("/d/containers")),
            PathBuf::from("/d/container-pool")
        );
    }
}
