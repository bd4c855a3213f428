//! Control groups for sandboxes, on cgroup v1 (one hierarchy per controller) and v2 (unified).
//!
//! Layout (kernel docs: `Documentation/admin-guide/cgroup-v1/*.rst`, `cgroup-v2.rst`):
//!
//! * v1: `/sys/fs/cgroup/<ctrl>/sandlot/<id>` in each of `memory`, `cpu`, `cpuacct` (when it
//!   is a separate hierarchy), `pids` and `freezer`; per-exec children
//!   `/sys/fs/cgroup/<ctrl>/sandlot/<id>/x<n>` in every one of them. The exec's memory child
//!   has no limit of its own: with `memory.use_hierarchy=1` it is charged against the
//!   sandbox's limit.
//! * v2: `/sys/fs/cgroup/sandlot/<id>` with `+memory +cpu +pids` enabled in the
//!   `cgroup.subtree_control` of `/sys/fs/cgroup` and `/sys/fs/cgroup/sandlot`; per-exec
//!   children `/sys/fs/cgroup/sandlot/<id>/x<n>` without controllers of their own (so the
//!   sandbox's init may stay in the sandbox group itself: the "no internal processes" rule
//!   only applies once controllers are enabled for children).
//!
//! CPU placement: each sandbox group also gets a cpuset of `ceil(cpu)` host CPUs, those that
//! hold the fewest sandbox groups ([`CpuSpread`]; v1 `cpuset` hierarchy, v2 `cpuset`
//! controller; skipped where neither exists). The CFS quota bounds how much CPU time a
//! sandbox gets; the cpuset bounds *where*: a sandbox spinning on every thread it can start
//! occupies its own cores and leaves the others to its neighbours and to the node.
//!
//! Killing a group: v2 writes `1` to `cgroup.kill`; v1 freezes the group (`freezer.state`
//! `FROZEN`), sends SIGKILL to every pid of `cgroup.procs`, thaws, and repeats until the
//! group is empty. Freezing first means no process can fork a new one between our read of
//! `cgroup.procs` and the kill (a fork bomb cannot outrun the loop).
//!
//! Every read and write of a control file, and every `mkdir`/`rmdir` of a group, goes
//! through [`CgroupFs`] (the host in [`HostFs`]; a recording fake in the unit tests), and
//! fails as a [`CgroupError`] that names the path and keeps the kernel's answer as its
//! source.
use crate::node::NodeError;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Failures of cgroup operations. Each names the path; the kernel's answer, when there is
/// one, is the [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// cgroup v2 is mounted but a controller a sandbox needs is not offered.
    #[error("cgroup v2 at {} lacks the {controller} controller (has: {have:?})", root.display())]
    MissingController {
        /// The mount point.
        root: PathBuf,
        /// `memory`, `cpu` or `pids`.
        controller: &'static str,
        /// Contents of `cgroup.controllers`.
        have: String,
    },
    /// cgroup v1: a required controller's hierarchy is not mounted.
    #[error("cgroup v1 controller {controller} is not mounted at {}", path.display())]
    NotMounted {
        /// `memory`, `cpu`, `pids` or `freezer`.
        controller: &'static str,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// cgroup v1: the directory is not a cgroup hierarchy (no `cgroup.procs`).
    #[error("{} is not a cgroup v1 hierarchy", path.display())]
    NotAHierarchy {
        /// The directory.
        path: PathBuf,
    },
    /// `mkdir` of a group failed.
    #[error("create cgroup {}", path.display())]
    Create {
        /// The group's directory.
        path: PathBuf,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
    /// `rmdir` of a group failed (other than "not found", and "busy" past the deadline).
    #[error("remove cgroup {}", path.display())]
    Remove {
        /// The group's directory.
        path: PathBuf,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
    /// Writing a control file failed (the kernel refused the value, or the file is gone).
    #[error("write {value:?} to {}", path.display())]
    Write {
        /// The control file.
        path: PathBuf,
        /// What was written.
        value: String,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
    /// The group has no freezer (v1: no `freezer` hierarchy).
    #[error("freeze: no freezer hierarchy for this cgroup")]
    NoFreezer,
    /// The group was not frozen by the deadline (it was thawed again).
    #[error("cgroup {} did not freeze before the deadline", path.display())]
    FreezeTimeout {
        /// The freezer control file.
        path: PathBuf,
    },
    /// Processes were still in the group at the kill deadline.
    #[error("processes remain in cgroup {} after the kill deadline", path.display())]
    KillTimeout {
        /// The group's directory.
        path: PathBuf,
    },
}

/// Result of cgroup operations.
pub type CgroupResult<T> = Result<T, CgroupError>;

/// The node's error of a cgroup failure: `Unavailable` when the host lacks cgroups a
/// sandbox needs (detection), `Internal` otherwise, with the message as context and the
/// kernel's answer as source.
impl From<CgroupError> for NodeError {
    fn from(e: CgroupError) -> Self {
        // The messages do not repeat the source: context and cause are each named once.
        let context = e.to_string();
        match e {
            CgroupError::MissingController { .. }
            | CgroupError::NotMounted { .. }
            | CgroupError::NotAHierarchy { .. } => NodeError::Unavailable(context),
            CgroupError::Create { source, .. }
            | CgroupError::Remove { source, .. }
            | CgroupError::Write { source, .. } => {
                NodeError::internal(context, Some(Box::new(source)))
            }
            CgroupError::NoFreezer
            | CgroupError::FreezeTimeout { .. }
            | CgroupError::KillTimeout { .. } => NodeError::internal(context, None),
        }
    }
}

/// The host effects of cgroup management: reading and writing control files, creating
/// and removing group directories. [`HostFs`] is the real one; unit tests use a recording
/// fake, so the limit-writing logic (file names of v1 and v2, values, order) is tested
/// without root.
pub trait CgroupFs: std::fmt::Debug + Send + Sync {
    /// Write `value` to the control file `path` (one `write(2)`; the kernel parses it).
    ///
    /// # Errors
    /// The kernel's answer (`EINVAL` for a value it refuses, `ENOENT` for a missing group).
    fn write(&self, path: &Path, value: &str) -> io::Result<()>;
    /// The contents of the control file `path`.
    ///
    /// # Errors
    /// The kernel's answer.
    fn read(&self, path: &Path) -> io::Result<String>;
    /// Create the group directory `path` (its parent must exist).
    ///
    /// # Errors
    /// The kernel's answer (`EEXIST` when it exists).
    fn mkdir(&self, path: &Path) -> io::Result<()>;
    /// Remove the (empty) group directory `path`.
    ///
    /// # Errors
    /// The kernel's answer (`EBUSY` while tasks are in it, `ENOENT`).
    fn rmdir(&self, path: &Path) -> io::Result<()>;
    /// Whether `path` (a control file or a group) exists.
    fn exists(&self, path: &Path) -> bool;
}

/// [`CgroupFs`] on the host's cgroup file systems.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostFs;

impl CgroupFs for HostFs {
    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        fs::write(path, value)
    }
    fn read(&self, path: &Path) -> io::Result<String> {
        fs::read_to_string(path)
    }
    fn mkdir(&self, path: &Path) -> io::Result<()> {
        fs::create_dir(path)
    }
    fn rmdir(&self, path: &Path) -> io::Result<()> {
        fs::remove_dir(path)
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
}

fn host_fs() -> Arc<dyn CgroupFs> {
    Arc::new(HostFs)
}

/// Name of the parent group under which every sandbox group lives.
pub const PARENT: &str = "sandlot";

/// CFS period used for the CPU quota, microseconds: 10 ms. A short period bounds how long
/// a sandbox may run on every core at once before it is throttled (with the kernel default of
/// 100 ms, a 1-CPU sandbox with two busy threads holds both cores of a 2-core node for 50 ms,
/// which is a neighbour's p99 exec latency); see [`cpu_period_quota_us`].
pub const CPU_PERIOD_US: u64 = 10_000;

/// Smallest CFS quota the kernel accepts, microseconds.
const CPU_QUOTA_MIN_US: u64 = 1_000;

/// `(period, quota)` in microseconds for `cpu` cores: period [`CPU_PERIOD_US`], stretched
/// for small shares so that the quota is at least the kernel's 1 ms minimum (cpu 0.01 →
/// 1 ms per 100 ms), at most 1 s (the kernel's maximum period).
pub fn cpu_period_quota_us(cpu: f64) -> (u64, u64) {
    let cpu = cpu.max(0.001);
    let period = ((CPU_QUOTA_MIN_US as f64 / cpu).ceil() as u64).clamp(CPU_PERIOD_US, 1_000_000);
    let quota = ((cpu * period as f64).round() as u64).max(CPU_QUOTA_MIN_US);
    (period, quota)
}

/// Which cgroup interface the host offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// One hierarchy per controller under `/sys/fs/cgroup/<ctrl>`.
    V1,
    /// The unified hierarchy at `/sys/fs/cgroup`.
    V2,
}

impl CgroupVersion {
    /// `"v1"` or `"v2"`.
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }
}

/// v1 controllers a sandbox uses; `cpuacct` only when it is its own hierarchy.
const V1_CONTROLLERS: [&str; 6] = ["memory", "cpu", "cpuacct", "pids", "freezer", "cpuset"];
const V1_REQUIRED: [&str; 4] = ["memory", "cpu", "pids", "freezer"];

/// Resource limits of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Memory limit in bytes (swap is not allowed on top of it).
    pub memory_bytes: u64,
    /// CPU quota in cores (e.g. `0.5`).
    pub cpu: f64,
    /// Maximum number of tasks (processes and threads).
    pub pids_max: u64,
}

/// The host's cgroup mount: version and the hierarchies a sandbox uses.
#[derive(Debug, Clone)]
pub struct CgroupRoot {
    version: CgroupVersion,
    /// v1: `(controller, hierarchy mount)`; v2: one entry `("unified", /sys/fs/cgroup)`.
    hierarchies: Vec<(&'static str, PathBuf)>,
    /// Name of the parent group of every sandbox group ([`PARENT`] by default).
    parent: String,
    /// Where control files are read and written.
    fs: Arc<dyn CgroupFs>,
}

impl CgroupRoot {
    /// Use `name` instead of [`PARENT`] as the parent group (one per node: a node's
    /// `readopt` sweeps every group under its parent that it does not know).
    pub fn with_parent(mut self, name: &str) -> Self {
        self.parent = name.to_string();
        self
    }

    /// A root over given hierarchies whose control files `fs` reads and writes (unit
    /// tests: a recording fake).
    #[cfg(test)]
    pub(crate) fn with_fs(
        version: CgroupVersion,
        hierarchies: Vec<(&'static str, PathBuf)>,
        fs: Arc<dyn CgroupFs>,
    ) -> CgroupRoot {
        CgroupRoot {
            version,
            hierarchies,
            parent: PARENT.to_string(),
            fs,
        }
    }

    /// Name of the parent group.
    pub fn parent(&self) -> &str {
        &self.parent
    }

    /// Detect the cgroup version under `/sys/fs/cgroup`.
    ///
    /// # Errors
    /// `Unavailable` when neither a v2 mount with controllers nor the v1 controllers
    /// memory, cpu, pids and freezer are present.
    pub fn detect() -> CgroupResult<CgroupRoot> {
        Self::detect_at(Path::new("/sys/fs/cgroup"))
    }

    /// [`CgroupRoot::detect`] with another mount point (for hosts that mount it elsewhere).
    ///
    /// # Errors
    /// As [`CgroupRoot::detect`].
    pub fn detect_at(root: &Path) -> CgroupResult<CgroupRoot> {
        // v2 = the mount point itself is cgroup2 and offers controllers.
        let is_cgroup2 = nix::sys::statfs::statfs(root)
            .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
            .unwrap_or(false);
        if is_cgroup2 {
            let ctrls = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            let have: Vec<&str> = ctrls.split_whitespace().collect();
            for need in ["memory", "cpu", "pids"] {
                if !have.contains(&need) {
                    return Err(CgroupError::MissingController {
                        root: root.to_path_buf(),
                        controller: need,
                        have: ctrls,
                    });
                }
            }
            return Ok(CgroupRoot {
                version: CgroupVersion::V2,
                hierarchies: vec![("unified", root.to_path_buf())],
                parent: PARENT.to_string(),
                fs: host_fs(),
            });
        }
        let mut hierarchies: Vec<(&'static str, PathBuf)> = Vec::new();
        for ctrl in V1_CONTROLLERS {
            let p = root.join(ctrl);
            // `cpu` and `cpuacct` may be links to one `cpu,cpuacct` hierarchy: dedupe.
            let Ok(canon) = fs::canonicalize(&p) else {
                if V1_REQUIRED.contains(&ctrl) {
                    return Err(CgroupError::NotMounted {
                        controller: ctrl,
                        path: p,
                    });
                }
                continue;
            };
            if !canon.join("cgroup.procs").exists() {
                if V1_REQUIRED.contains(&ctrl) {
                    return Err(CgroupError::NotAHierarchy { path: canon });
                }
                continue;
            }
            if !hierarchies.iter().any(|(_, h)| *h == canon) {
                hierarchies.push((ctrl, canon));
            }
        }
        Ok(CgroupRoot {
            version: CgroupVersion::V1,
            hierarchies,
            parent: PARENT.to_string(),
            fs: host_fs(),
        })
    }

    /// The detected version.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// Remove the (empty) parent groups; a parent that still has sandboxes stays (EBUSY).
    ///
    /// # Errors
    /// `Internal` with the directory, except for "not found" and "busy".
    pub fn remove_parent(&self) -> CgroupResult<()> {
        for (_, h) in &self.hierarchies {
            let d = h.join(&self.parent);
            match self.fs.rmdir(&d) {
                Ok(()) => {}
                Err(e)
                    if e.kind() == io::ErrorKind::NotFound
                        || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(source) => return Err(CgroupError::Remove { path: d, source }),
            }
        }
        Ok(())
    }

    /// The group of sandbox `id` (not created yet).
    pub fn sandbox(&self, id: &str) -> SandboxCgroup {
        SandboxCgroup {
            group: Cgroup {
                version: self.version,
                fs: self.fs.clone(),
                dirs: self
                    .hierarchies
                    .iter()
                    .map(|(c, h)| (*c, h.join(&self.parent).join(id)))
                    .collect(),
            },
        }
    }

    /// Ids of every sandbox group that exists under `sandlot/` in any hierarchy.
    pub fn list_sandboxes(&self) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for (_, h) in &self.hierarchies {
            let Ok(rd) = fs::read_dir(h.join(&self.parent)) else {
                continue;
            };
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if !ids.contains(&name) {
                        ids.push(name);
                    }
                }
            }
        }
        ids.sort();
        ids
    }

    /// v1 only: the mounted hierarchies this root does not use itself (blkio, devices,
    /// `systemd`, `unified`, …), where an OCI runtime also makes its container's group
    /// (runc makes one in every mounted hierarchy). Empty on v2.
    fn other_hierarchies(&self) -> Vec<PathBuf> {
        if self.version != CgroupVersion::V1 {
            return Vec::new();
        }
        let Some(mount_root) = self.hierarchies.first().and_then(|(_, h)| h.parent()) else {
            return Vec::new();
        };
        let mut other: Vec<PathBuf> = Vec::new();
        for h in fs::read_dir(mount_root).into_iter().flatten().flatten() {
            let Ok(h) = fs::canonicalize(h.path()) else {
                continue;
            };
            if !self.hierarchies.iter().any(|(_, o)| *o == h) && !other.contains(&h) {
                other.push(h);
            }
        }
        other
    }

    /// v1 only: the groups `<hierarchy>/<parent>/<id>` an OCI runtime made for container
    /// `id` in the hierarchies this root does not use ([`CgroupRoot::sandbox`] covers the
    /// others). runc removes them at `runc delete`, but gives up after a few hundred ms of
    /// `EBUSY` while the container's processes are still exiting; [`Cgroup::remove`] on
    /// this group waits for them. No directories (nothing to do) on v2.
    pub fn runtime_groups(&self, id: &str) -> Cgroup {
        Cgroup {
            version: self.version,
            fs: self.fs.clone(),
            dirs: self
                .other_hierarchies()
                .into_iter()
                .map(|h| ("other", h.join(&self.parent).join(id)))
                .collect(),
        }
    }

    /// v1 only: remove the groups `<hierarchy>/<parent>/<id>` an OCI runtime left in the
    /// hierarchies this root does not use (see [`CgroupRoot::runtime_groups`]) for each
    /// `id` where `in_use(id)` is false. `rmdir` only: a group with processes stays.
    /// Returns the groups that could not be removed.
    pub fn sweep_other_hierarchies(&self, in_use: impl Fn(&str) -> bool) -> Vec<PathBuf> {
        let mut failed = Vec::new();
        for h in self.other_hierarchies() {
            for g in fs::read_dir(h.join(&self.parent))
                .into_iter()
                .flatten()
                .flatten()
            {
                let id = g.file_name().to_string_lossy().into_owned();
                if g.file_type().is_ok_and(|t| t.is_dir()) && !in_use(&id) {
                    if let Err(e) = fs::remove_dir(g.path()) {
                        tracing::warn!(group = %g.path().display(), error = %e, "cannot remove a leftover cgroup");
                        failed.push(g.path());
                    }
                }
            }
        }
        failed
    }

    /// Create the `sandlot` parent groups (v2: and enable the controllers for children).
    ///
    /// # Errors
    /// `Internal` with the path that could not be created or written.
    pub fn ensure_parent(&self) -> CgroupResult<()> {
        for (ctrl, h) in &self.hierarchies {
            let parent = h.join(&self.parent);
            fs_mkdir(&*self.fs, &parent)?;
            match self.version {
                CgroupVersion::V1 => {
                    if *ctrl == "memory" {
                        // Children must be charged against their parents' limits. It is the
                        // default on recent kernels (and cannot be changed there).
                        let _ = fs_write(&*self.fs, &parent.join("memory.use_hierarchy"), "1");
                    }
                    if *ctrl == "cpuset" {
                        // A new v1 cpuset group starts with no CPUs and no memory nodes (no
                        // task may join it) unless its parent has `cgroup.clone_children`.
                        for f in ["cpuset.cpus", "cpuset.mems"] {
                            if fs_read_trimmed(&*self.fs, &parent.join(f)).is_empty() {
                                fs_write(
                                    &*self.fs,
                                    &parent.join(f),
                                    &fs_read_trimmed(&*self.fs, &h.join(f)),
                                )?;
                            }
                        }
                        fs_write(&*self.fs, &parent.join("cgroup.clone_children"), "1")?;
                    }
                }
                CgroupVersion::V2 => {
                    fs_write(
                        &*self.fs,
                        &h.join("cgroup.subtree_control"),
                        "+memory +cpu +pids",
                    )?;
                    fs_write(
                        &*self.fs,
                        &parent.join("cgroup.subtree_control"),
                        "+memory +cpu +pids",
                    )?;
                    // Placement only: a host without the cpuset controller runs unpinned.
                    if fs_write(&*self.fs, &h.join("cgroup.subtree_control"), "+cpuset").is_ok() {
                        let _ =
                            fs_write(&*self.fs, &parent.join("cgroup.subtree_control"), "+cpuset");
                    }
                }
            }
        }
        // Groups left by a previous run of the node (re-adopted sandboxes) hold their CPUs.
        for id in self.list_sandboxes() {
            let g = self.sandbox(&id).group;
            if let Some(d) = g.cpuset_dir() {
                let cpus = parse_cpu_list(&fs_read_trimmed(&*self.fs, &d.join("cpuset.cpus")));
                if !cpus.is_empty() {
                    lock_spread().hold(d, cpus);
                }
            }
        }
        Ok(())
    }
}

/// A set of directories that form one logical group: one per v1 hierarchy, or one v2 dir.
#[derive(Debug, Clone)]
pub struct Cgroup {
    version: CgroupVersion,
    dirs: Vec<(&'static str, PathBuf)>,
    fs: Arc<dyn CgroupFs>,
}

impl Cgroup {
    fn dir(&self, ctrl: &str) -> Option<&Path> {
        match self.version {
            CgroupVersion::V2 => self.dirs.first().map(|(_, d)| d.as_path()),
            CgroupVersion::V1 => self
                .dirs
                .iter()
                .find(|(c, _)| *c == ctrl)
                .map(|(_, d)| d.as_path()),
        }
    }

    /// The directory whose `cpuset.cpus` places this group: v1 `cpuset` hierarchy, v2 the
    /// group's dir when its parent enabled the controller. `None` when neither applies.
    fn cpuset_dir(&self) -> Option<&Path> {
        match self.version {
            CgroupVersion::V1 => self.dir("cpuset"),
            CgroupVersion::V2 => self.dir("unified").filter(|d| {
                d.parent().is_some_and(|p| {
                    fs_read_trimmed(&*self.fs, &p.join("cgroup.subtree_control"))
                        .split_whitespace()
                        .any(|c| c == "cpuset")
                })
            }),
        }
    }

    /// Directories of this group (one per hierarchy).
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.dirs.iter().map(|(_, d)| d.as_path())
    }

    /// The `cgroup.procs` files a process writes its pid into to join this group (one per
    /// hierarchy).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, d)| d.join("cgroup.procs"))
            .collect()
    }

    /// Whether any directory of the group exists.
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|(_, d)| self.fs.exists(d))
    }

    fn create(&self) -> CgroupResult<()> {
        for (_, d) in &self.dirs {
            fs_mkdir(&*self.fs, d)?;
        }
        Ok(())
    }

    /// Host pids of the processes in this group (not in its children), over all hierarchies.
    pub fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for (_, d) in &self.dirs {
            if let Ok(s) = self.fs.read(&d.join("cgroup.procs")) {
                for p in s.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    if !pids.contains(&p) {
                        pids.push(p);
                    }
                }
            }
        }
        pids
    }

    /// True when no process is in the group or its children (a missing group is empty).
    pub fn is_empty(&self) -> bool {
        match self.version {
            CgroupVersion::V2 => match self.dirs.first() {
                Some((_, d)) => match self.fs.read(&d.join("cgroup.events")) {
                    Ok(s) => !s.lines().any(|l| l.trim() == "populated 1"),
                    Err(_) => true,
                },
                None => true,
            },
            CgroupVersion::V1 => {
                self.pids().is_empty() && self.children().iter().all(|c| c.is_empty())
            }
        }
    }

    /// Child groups (named the same in every hierarchy).
    fn children(&self) -> Vec<Cgroup> {
        let mut names: Vec<String> = Vec::new();
        for (_, d) in &self.dirs {
            if let Ok(rd) = fs::read_dir(d) {
                for e in rd.flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        let n = e.file_name().to_string_lossy().into_owned();
                        if !names.contains(&n) {
                            names.push(n);
                        }
                    }
                }
            }
        }
        names.iter().map(|n| self.child(n)).collect()
    }

    fn child(&self, name: &str) -> Cgroup {
        Cgroup {
            version: self.version,
            dirs: self.dirs.iter().map(|(c, d)| (*c, d.join(name))).collect(),
            fs: self.fs.clone(),
        }
    }

    /// OOM kills counted for this group and its descendants (`oom_kill` of
    /// `memory.oom_control` on v1, of `memory.events` on v2). `None` when unreadable.
    pub fn oom_kills(&self) -> Option<u64> {
        let (file, _) = match self.version {
            CgroupVersion::V1 => (self.dir("memory")?.join("memory.oom_control"), ()),
            CgroupVersion::V2 => (self.dir("unified")?.join("memory.events"), ()),
        };
        let s = self.fs.read(&file).ok()?;
        parse_counter(&s, "oom_kill")
    }

    /// Kill every process of the group and of its children, and wait until it is empty.
    ///
    /// # Errors
    /// `Internal` with the path when the group cannot be frozen/killed, or when processes
    /// are still there at `deadline`.
    pub fn kill(&self, deadline: Instant) -> CgroupResult<()> {
        if !self.exists() {
            return Ok(());
        }
        match self.version {
            CgroupVersion::V2 => self.kill_v2(deadline),
            CgroupVersion::V1 => {
                // Children first, then this group's own processes (v1 `cgroup.procs` lists
                // only the group's direct members).
                for c in self.children() {
                    c.kill(deadline)?;
                }
                self.kill_v1(deadline)
            }
        }
    }

    /// Kill every process of the group (not of its children) except `spare`, and wait until
    /// only `spare` is left (or the deadline passes).
    ///
    /// Used on an exec's group to spare the `sandlot-guest exec` helper: it then reaps its
    /// killed child itself, so no zombie is handed to the host's init (the helper lives in
    /// the host pid namespace, so its orphans would be reparented there).
    ///
    /// # Errors
    /// `Internal` with the path when the group cannot be frozen or thawed.
    pub fn kill_except(&self, spare: i32, deadline: Instant) -> CgroupResult<()> {
        let freeze = match self.version {
            CgroupVersion::V1 => self
                .dir("freezer")
                .map(|d| (d.join("freezer.state"), "FROZEN", "THAWED")),
            CgroupVersion::V2 => self
                .dir("unified")
                .map(|d| (d.join("cgroup.freeze"), "1", "0")),
        };
        loop {
            let others: Vec<i32> = self.pids().into_iter().filter(|p| *p != spare).collect();
            if others.is_empty() {
                return Ok(());
            }
            if let Some((f, on, _)) = &freeze {
                if self.fs.exists(f) {
                    fs_write(&*self.fs, f, on)?;
                    if self.version == CgroupVersion::V1 {
                        while self
                            .fs
                            .read(f)
                            .map(|s| s.trim() != "FROZEN")
                            .unwrap_or(false)
                            && Instant::now() < deadline
                        {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                }
            }
            for p in self.pids().into_iter().filter(|p| *p != spare) {
                sigkill(p);
            }
            if let Some((f, _, off)) = &freeze {
                if self.fs.exists(f) {
                    fs_write(&*self.fs, f, off)?;
                }
            }
            if Instant::now() > deadline {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn kill_v2(&self, deadline: Instant) -> CgroupResult<()> {
        let Some(d) = self.dir("unified") else {
            return Ok(());
        };
        let kill_file = d.join("cgroup.kill");
        loop {
            if self.is_empty() {
                return Ok(());
            }
            if self.fs.exists(&kill_file) {
                match fs_write(&*self.fs, &kill_file, "1") {
                    Ok(()) => {}
                    Err(_) if !self.fs.exists(d) => return Ok(()),
                    Err(e) => return Err(e),
                }
            } else {
                // Kernels before 5.14 have no cgroup.kill: freeze, kill, thaw.
                let _ = fs_write(&*self.fs, &d.join("cgroup.freeze"), "1");
                for p in self.pids() {
                    sigkill(p);
                }
                let _ = fs_write(&*self.fs, &d.join("cgroup.freeze"), "0");
            }
            if Instant::now() > deadline {
                return Err(still_there(d));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn kill_v1(&self, deadline: Instant) -> CgroupResult<()> {
        let freezer = self.dir("freezer").map(|d| d.join("freezer.state"));
        loop {
            if self.pids().is_empty() {
                return Ok(());
            }
            if let Some(f) = &freezer {
                // A concurrent delete may remove the group between two steps: a vanished
                // control file means there is nothing left to kill.
                if fs_write_if_present(&*self.fs, f, "FROZEN")? {
                    // Wait until every task is frozen (FREEZING → FROZEN), with the deadline.
                    loop {
                        match self.fs.read(f) {
                            Ok(s) if s.trim() == "FROZEN" => break,
                            Ok(_) => {}
                            Err(_) => break,
                        }
                        if Instant::now() > deadline {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            for p in self.pids() {
                sigkill(p);
            }
            if let Some(f) = &freezer {
                // Frozen tasks die once thawed.
                fs_write_if_present(&*self.fs, f, "THAWED")?;
            }
            if self.pids().is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(still_there(
                    self.dirs
                        .first()
                        .map(|(_, d)| d.as_path())
                        .unwrap_or(Path::new("?")),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The freezer control file of the group and its (frozen, thawed) values: v1
    /// `freezer.state` (`FROZEN`/`THAWED`), v2 `cgroup.freeze` (`1`/`0`).
    fn freezer(&self) -> Option<(PathBuf, &'static str, &'static str)> {
        match self.version {
            CgroupVersion::V1 => self
                .dir("freezer")
                .map(|d| (d.join("freezer.state"), "FROZEN", "THAWED")),
            CgroupVersion::V2 => self
                .dir("unified")
                .map(|d| (d.join("cgroup.freeze"), "1", "0")),
        }
    }

    /// Freeze every process of the group and of its children (cgroup freezer: v1
    /// `freezer.state`, `Documentation/admin-guide/cgroup-v1/freezer-subsystem.rst`; v2
    /// `cgroup.freeze`, `cgroup-v2.rst` "Core Interface Files") and wait until the kernel
    /// reports the group frozen (v1 `FREEZING` → `FROZEN`; v2 `frozen 1` in `cgroup.events`).
    /// Frozen tasks use no CPU until [`Cgroup::thaw`].
    ///
    /// # Errors
    /// `Internal` with the path when the freezer file is missing or cannot be written, or
    /// when the group is not frozen by `deadline` (the group is thawed again then).
    pub fn freeze(&self, deadline: Instant) -> CgroupResult<()> {
        let (f, on, _) = self.freezer().ok_or(CgroupError::NoFreezer)?;
        // v1 only tries to freeze each task once per write: a task that was running in the
        // kernel or being ptraced (gVisor's sentry ptraces its stubs) can keep the group in
        // `FREEZING`. Like runc's v1 freezer, write `FROZEN` again on every poll and thaw
        // for a moment every 50 polls so that stuck tasks get another chance.
        let mut i = 0u32;
        loop {
            i = i.wrapping_add(1);
            if i.is_multiple_of(50) && self.version == CgroupVersion::V1 {
                let _ = fs_write(&*self.fs, &f, "THAWED");
                std::thread::sleep(Duration::from_millis(10));
            }
            if i == 1 || self.version == CgroupVersion::V1 {
                fs_write(&*self.fs, &f, on)?;
            }
            if self.is_frozen() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = self.thaw();
                return Err(CgroupError::FreezeTimeout { path: f });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Thaw the group (undo [`Cgroup::freeze`]). A missing group is fine.
    ///
    /// # Errors
    /// `Internal` with the path when the freezer file exists but cannot be written.
    pub fn thaw(&self) -> CgroupResult<()> {
        match self.freezer() {
            Some((f, _, off)) if self.fs.exists(&f) => fs_write(&*self.fs, &f, off),
            _ => Ok(()),
        }
    }

    /// True when the kernel reports the whole group frozen (v1 `freezer.state` = `FROZEN`,
    /// v2 `frozen 1` in `cgroup.events`). A missing group is not frozen.
    pub fn is_frozen(&self) -> bool {
        match self.version {
            CgroupVersion::V1 => self
                .dir("freezer")
                .and_then(|d| self.fs.read(&d.join("freezer.state")).ok())
                .is_some_and(|s| s.trim() == "FROZEN"),
            CgroupVersion::V2 => self
                .dir("unified")
                .and_then(|d| self.fs.read(&d.join("cgroup.events")).ok())
                .is_some_and(|s| parse_counter(&s, "frozen") == Some(1)),
        }
    }

    /// True when freezing was requested for this group itself (v1 `freezer.state` is
    /// `FREEZING` or `FROZEN`; v2 `cgroup.freeze` is `1`), even if not complete yet.
    pub fn freeze_requested(&self) -> bool {
        match self.freezer() {
            Some((f, on, _)) => self.fs.read(&f).is_ok_and(|s| {
                let s = s.trim();
                s == on || s == "FREEZING"
            }),
            None => false,
        }
    }

    /// CPU time used by the group and its children, nanoseconds (v1 `cpuacct.usage`, v2
    /// `usage_usec` of `cpu.stat` × 1000). `None` when unreadable.
    pub fn cpu_usage_ns(&self) -> Option<u64> {
        match self.version {
            CgroupVersion::V1 => {
                let d = self.dir("cpuacct").or_else(|| self.dir("cpu"))?;
                self.fs
                    .read(&d.join("cpuacct.usage"))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            }
            CgroupVersion::V2 => {
                let s = self.fs.read(&self.dir("unified")?.join("cpu.stat")).ok()?;
                parse_counter(&s, "usage_usec").map(|us| us * 1000)
            }
        }
    }

    /// Remove the group's directories, children first. Missing directories are fine; EBUSY
    /// (tasks still exiting) is retried until `deadline`.
    ///
    /// # Errors
    /// `Internal` with the directory that could not be removed.
    pub fn remove(&self, deadline: Instant) -> CgroupResult<()> {
        for c in self.children() {
            c.remove(deadline)?;
        }
        if let Some(d) = self.cpuset_dir() {
            lock_spread().release(d);
        }
        for (_, d) in &self.dirs {
            loop {
                match self.fs.rmdir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(source) => {
                        return Err(CgroupError::Remove {
                            path: d.clone(),
                            source,
                        })
                    }
                }
            }
        }
        Ok(())
    }

    /// [`Cgroup::kill`] then [`Cgroup::remove`] with one deadline `timeout` from now.
    ///
    /// # Errors
    /// As those two.
    pub fn destroy(&self, timeout: Duration) -> CgroupResult<()> {
        let deadline = Instant::now() + timeout;
        self.kill(deadline)?;
        self.remove(deadline)
    }
}

/// The child group of a VMM's sandbox group that holds its vCPU threads (cgroup v1, `cpu`
/// hierarchy only; see [`SandboxCgroup::create_vmm`]).
pub const VCPU_GROUP: &str = "vcpu";

/// The cgroup of one sandbox (all its processes, init included).
#[derive(Debug, Clone)]
pub struct SandboxCgroup {
    group: Cgroup,
}

impl SandboxCgroup {
    /// The underlying group.
    pub fn group(&self) -> &Cgroup {
        &self.group
    }

    /// Create the group and apply `limits`.
    ///
    /// # Errors
    /// `Internal` with the path that could not be created or written.
    pub fn create(&self, limits: &Limits) -> CgroupResult<()> {
        self.group.create()?;
        self.apply(limits)
    }

    /// (Re-)apply `limits` to an existing group.
    ///
    /// # Errors
    /// `Internal` with the file that could not be written.
    pub fn apply(&self, limits: &Limits) -> CgroupResult<()> {
        let g = &self.group;
        let (period, quota) = cpu_period_quota_us(limits.cpu);
        match g.version {
            CgroupVersion::V1 => {
                let mem = g.dir("memory").expect("memory hierarchy");
                let limit = mem.join("memory.limit_in_bytes");
                // Same value for memory+swap, so swap cannot extend the limit. The file is
                // absent when the kernel has no swap accounting. The kernel keeps
                // memory <= memory+swap at every write, so raising an existing limit
                // (re-apply, warm-pool hand-over) writes memory+swap first.
                let memsw = mem.join("memory.memsw.limit_in_bytes");
                let v = limits.memory_bytes.to_string();
                let raising = self
                    .group
                    .fs
                    .read(&limit)
                    .ok()
                    .and_then(|c| c.trim().parse::<u64>().ok())
                    .is_some_and(|cur| limits.memory_bytes > cur);
                if raising && self.group.fs.exists(&memsw) {
                    fs_write(&*self.group.fs, &memsw, &v)?;
                    fs_write(&*self.group.fs, &limit, &v)?;
                } else {
                    fs_write(&*self.group.fs, &limit, &v)?;
                    if self.group.fs.exists(&memsw) {
                        fs_write(&*self.group.fs, &memsw, &v)?;
                    }
                }
                let cpu = g.dir("cpu").expect("cpu hierarchy");
                fs_write(
                    &*self.group.fs,
                    &cpu.join("cpu.cfs_period_us"),
                    &period.to_string(),
                )?;
                fs_write(
                    &*self.group.fs,
                    &cpu.join("cpu.cfs_quota_us"),
                    &quota.to_string(),
                )?;
                let pids = g.dir("pids").expect("pids hierarchy");
                fs_write(
                    &*self.group.fs,
                    &pids.join("pids.max"),
                    &limits.pids_max.to_string(),
                )?;
            }
            CgroupVersion::V2 => {
                let d = g.dir("unified").expect("v2 dir");
                fs_write(
                    &*self.group.fs,
                    &d.join("memory.max"),
                    &limits.memory_bytes.to_string(),
                )?;
                let swap = d.join("memory.swap.max");
                if self.group.fs.exists(&swap) {
                    fs_write(&*self.group.fs, &swap, "0")?;
                }
                fs_write(
                    &*self.group.fs,
                    &d.join("cpu.max"),
                    &format!("{quota} {period}"),
                )?;
                fs_write(
                    &*self.group.fs,
                    &d.join("pids.max"),
                    &limits.pids_max.to_string(),
                )?;
            }
        }
        self.place(limits.cpu);
        Ok(())
    }

    /// Set only the group's `pids.max` to `n` tasks (the function backend's guest agent
    /// adds its standing processes when it starts; see `backends::function::agent`). A
    /// value below the current count is allowed: it only refuses new forks.
    ///
    /// # Errors
    /// `Internal` with the file that could not be written.
    pub fn set_pids_max(&self, n: u64) -> CgroupResult<()> {
        let g = &self.group;
        let dir = match g.version {
            CgroupVersion::V1 => g.dir("pids").expect("pids hierarchy"),
            CgroupVersion::V2 => g.dir("unified").expect("v2 dir"),
        };
        fs_write(&*self.group.fs, &dir.join("pids.max"), &n.to_string())
    }

    /// Narrow the group's cpuset to the `ceil(cpu)` allowed CPUs that hold the fewest
    /// sandbox groups ([`CpuSpread`]). Best effort: placement is a latency policy, not a
    /// limit (the CFS quota is), so a host without a cpuset controller, or a write the
    /// kernel refuses (v1: an exec child group still holds other CPUs), leaves the group on
    /// its parent's CPUs with a warning.
    fn place(&self, cpu: f64) {
        let Some(d) = self.group.cpuset_dir() else {
            return;
        };
        let Some(parent) = d.parent() else {
            return;
        };
        let effective = match self.group.version {
            CgroupVersion::V1 => "cpuset.effective_cpus",
            CgroupVersion::V2 => "cpuset.cpus.effective",
        };
        let allowed = parse_cpu_list(&fs_read_trimmed(&*self.group.fs, &parent.join(effective)));
        if allowed.is_empty() {
            return;
        }
        let want = (cpu.ceil().max(1.0) as usize).min(allowed.len());
        let mut spread = lock_spread();
        let cpus = spread.pick(d, &allowed, want);
        let list = cpus
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let mut written = fs_write(&*self.group.fs, &d.join("cpuset.cpus"), &list);
        if self.group.version == CgroupVersion::V1 {
            // Exec children made later copy the sandbox's CPUs.
            let _ = fs_write(&*self.group.fs, &d.join("cgroup.clone_children"), "1");
            // Those made earlier (a warm-pool member's standby exec group, placed for the
            // pool's 1 core) keep their own CPUs on v1, and a group's CPUs must cover its
            // children's: narrow the children first, widen them after.
            let children: Vec<PathBuf> = self
                .group
                .children()
                .iter()
                .filter_map(|c| c.cpuset_dir().map(Path::to_path_buf))
                .collect();
            if written.is_err() {
                for c in &children {
                    let _ = fs_write(&*self.group.fs, &c.join("cpuset.cpus"), &list);
                }
                written = fs_write(&*self.group.fs, &d.join("cpuset.cpus"), &list);
            }
            if written.is_ok() {
                for c in &children {
                    let _ = fs_write(&*self.group.fs, &c.join("cpuset.cpus"), &list);
                }
            }
        }
        match written {
            Ok(()) => spread.hold(d, cpus),
            Err(e) => {
                tracing::warn!(cgroup = %d.display(), error = %e, "cpuset placement skipped");
                spread.hold(d, allowed);
            }
        }
    }

    /// Create the group of a VMM (QEMU) whose guest may use `limits.cpu` cores: on cgroup v1
    /// the group gets `limits` with `headroom` more cores (and the CPUs of its cpuset for
    /// them), and a child [`VCPU_GROUP`] in the `cpu` hierarchy for the vCPU threads
    /// ([`SandboxCgroup::move_vcpu_thread`]), limited to `limits.cpu` (a CFS quota when that
    /// is a fraction of a core; a whole number of cores is the bound the VMM's vCPU count,
    /// at most `limits.cpu`, already sets). The guest stays at its limit;
    /// QEMU's own threads (device emulation, I/O, the main loop) run beside it instead of
    /// sharing its quota and its CPU. On cgroup v2, where the threads of one process can
    /// only be split in a threaded subtree (not done), the whole group gets `limits`.
    ///
    /// # Errors
    /// `Internal` with the path that could not be created or written.
    pub fn create_vmm(&self, limits: &Limits, headroom: f64) -> CgroupResult<()> {
        let cpu_dir = match self.group.version {
            CgroupVersion::V1 => self.group.dir("cpu").map(Path::to_path_buf),
            CgroupVersion::V2 => None,
        };
        let Some(cpu_dir) = cpu_dir else {
            return self.create(limits);
        };
        self.create(&Limits {
            cpu: limits.cpu + headroom,
            ..*limits
        })?;
        let vcpu = cpu_dir.join(VCPU_GROUP);
        fs_mkdir(&*self.group.fs, &vcpu)?;
        // A whole number of cores is the guest's vCPU count (`-smp`): its vCPU threads
        // cannot use more, and a quota equal to what they can use only throttles them by
        // the kernel's accounting slack (25-36 throttled 10 ms periods in a 1.7 s TCG
        // boot). A fraction of a core needs the quota.
        if limits.cpu.fract() != 0.0 {
            let (period, quota) = cpu_period_quota_us(limits.cpu);
            fs_write(
                &*self.group.fs,
                &vcpu.join("cpu.cfs_period_us"),
                &period.to_string(),
            )?;
            fs_write(
                &*self.group.fs,
                &vcpu.join("cpu.cfs_quota_us"),
                &quota.to_string(),
            )?;
        }
        Ok(())
    }

    /// Move the thread `tid` (a VMM's vCPU thread) into the group's [`VCPU_GROUP`] made by
    /// [`SandboxCgroup::create_vmm`] (cgroup v1 `tasks` takes one thread).
    ///
    /// # Errors
    /// `Internal` with the file when the kernel refuses (no such group, the thread is gone).
    pub fn move_vcpu_thread(&self, tid: i32) -> CgroupResult<()> {
        let Some(cpu_dir) = self.group.dir("cpu") else {
            return Ok(());
        };
        fs_write(
            &*self.group.fs,
            &cpu_dir.join(VCPU_GROUP).join("tasks"),
            &tid.to_string(),
        )
    }

    /// The per-exec child group `x<n>` (not created yet).
    pub fn exec_child(&self, n: u64) -> ExecCgroup {
        ExecCgroup {
            group: self.group.child(&format!("x{n}")),
        }
    }

    /// Every existing exec child group.
    pub fn exec_children(&self) -> Vec<Cgroup> {
        self.group.children()
    }

    /// Kill every process of the sandbox (children first) within `timeout`.
    ///
    /// # Errors
    /// `Internal` with the path when processes survive.
    pub fn kill_all(&self, timeout: Duration) -> CgroupResult<()> {
        self.group.kill(Instant::now() + timeout)
    }

    /// Remove the sandbox group and its children, retrying EBUSY within `timeout`.
    ///
    /// # Errors
    /// `Internal` with the directory that could not be removed.
    pub fn remove(&self, timeout: Duration) -> CgroupResult<()> {
        self.group.remove(Instant::now() + timeout)
    }
}

/// The cgroup of one exec: every process the command starts lands here, so the whole tree
/// can be killed at once.
#[derive(Debug, Clone)]
pub struct ExecCgroup {
    group: Cgroup,
}

impl ExecCgroup {
    /// The underlying group.
    pub fn group(&self) -> &Cgroup {
        &self.group
    }

    /// Create the directories (v1: in every hierarchy; no limits of their own).
    ///
    /// # Errors
    /// `Internal` with the directory that could not be created.
    pub fn create(&self) -> CgroupResult<()> {
        self.group.create()
    }
}

fn still_there(d: &Path) -> CgroupError {
    CgroupError::KillTimeout {
        path: d.to_path_buf(),
    }
}

fn sigkill(pid: i32) {
    if pid > 0 {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

fn fs_mkdir(fs: &dyn CgroupFs, d: &Path) -> CgroupResult<()> {
    match fs.mkdir(d) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CgroupError::Create {
            path: d.to_path_buf(),
            source,
        }),
    }
}

fn fs_write(fs: &dyn CgroupFs, path: &Path, value: &str) -> CgroupResult<()> {
    fs.write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
    })
}

fn fs_write_if_present(fs: &dyn CgroupFs, path: &Path, value: &str) -> CgroupResult<bool> {
    match fs_write(fs, path, value) {
        Ok(()) => Ok(true),
        Err(CgroupError::Write { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

fn fs_read_trimmed(fs: &dyn CgroupFs, p: &Path) -> String {
    fs.read(p).map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Write `value` to a cgroup (or any) file of the host; the error carries the path.
///
/// # Errors
/// [`CgroupError::Write`] with the path and the kernel's answer.
pub fn write_file(path: &Path, value: &str) -> CgroupResult<()> {
    fs_write(&HostFs, path, value)
}

/// Like [`write_file`], but a control file that does not exist (its group was removed
/// meanwhile) is `Ok(false)` instead of an error.
///
/// # Errors
/// As [`write_file`].
pub fn write_if_present(path: &Path, value: &str) -> CgroupResult<bool> {
    fs_write_if_present(&HostFs, path, value)
}

/// Which host CPUs each sandbox group was placed on, for the whole node process (CPUs are
/// a host-wide resource, so every backend's groups count). Keyed by the group's cpuset
/// directory; an entry is dropped when [`Cgroup::remove`] removes the group, and entries
/// whose directory vanished otherwise are pruned on the next placement.
#[derive(Debug, Default)]
pub struct CpuSpread {
    held: std::collections::HashMap<PathBuf, Vec<usize>>,
}

static SPREAD: std::sync::LazyLock<std::sync::Mutex<CpuSpread>> =
    std::sync::LazyLock::new(Default::default);

fn lock_spread() -> std::sync::MutexGuard<'static, CpuSpread> {
    SPREAD.lock().unwrap_or_else(|p| p.into_inner())
}

impl CpuSpread {
    /// The `want` CPUs of `allowed` that the fewest *other* groups hold, lowest CPU number
    /// first among equals (the group `dir`'s own previous placement does not count).
    pub fn pick(&mut self, dir: &Path, allowed: &[usize], want: usize) -> Vec<usize> {
        self.held.retain(|d, _| d.as_path() != dir && d.exists());
        let mut load: Vec<(usize, usize)> = allowed
            .iter()
            .map(|&c| {
                let n = self.held.values().filter(|v| v.contains(&c)).count();
                (n, c)
            })
            .collect();
        load.sort_unstable();
        let mut cpus: Vec<usize> = load.into_iter().take(want).map(|(_, c)| c).collect();
        cpus.sort_unstable();
        cpus
    }

    /// Record that the group at `dir` runs on `cpus`.
    pub fn hold(&mut self, dir: &Path, cpus: Vec<usize>) {
        self.held.insert(dir.to_path_buf(), cpus);
    }

    /// Forget the group at `dir`.
    pub fn release(&mut self, dir: &Path) {
        self.held.remove(dir);
    }
}

/// Parse the kernel's CPU list format (`0-3,8,10-11`; `Documentation/admin-guide/
/// cgroup-v1/cpusets.rst`); malformed parts are skipped.
pub fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b.min(a + 4096));
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
fn read_trimmed(p: &Path) -> String {
    fs_read_trimmed(&HostFs, p)
}

/// Value of the line `key N` in a flat-keyed cgroup file (`memory.events`, `oom_control`).
pub fn parse_counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        if it.next() == Some(key) {
            it.next()?.parse().ok()
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {

    #[test]
    fn cpu_period_is_short_and_the_quota_never_below_the_kernel_minimum() {
        assert_eq!(cpu_period_quota_us(1.0), (10_000, 10_000));
        assert_eq!(cpu_period_quota_us(2.5), (10_000, 25_000));
        assert_eq!(cpu_period_quota_us(0.1), (10_000, 1_000));
        assert_eq!(cpu_period_quota_us(0.05), (20_000, 1_000));
        assert_eq!(cpu_period_quota_us(0.01), (100_000, 1_000));
        let (p, q) = cpu_period_quota_us(0.0001);
        assert_eq!((p, q), (1_000_000, 1_000));
    }

    use super::*;

    #[test]
    fn parses_the_kernel_cpu_list_format() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("1"), vec![1]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("x,2,3-y"), vec![2]);
    }

    #[test]
    fn spread_puts_each_group_on_the_least_held_cpus() {
        // Directories that do not exist are pruned on each pick, so use real ones.
        let tmp = std::env::temp_dir().join(format!("spread-{}", std::process::id()));
        let dirs: Vec<PathBuf> = (0..4).map(|i| tmp.join(format!("g{i}"))).collect();
        for d in &dirs {
            fs::create_dir_all(d).unwrap();
        }
        let mut s = CpuSpread::default();
        let all = [0, 1, 2, 3];
        let a = s.pick(&dirs[0], &all, 1);
        s.hold(&dirs[0], a.clone());
        let b = s.pick(&dirs[1], &all, 2);
        s.hold(&dirs[1], b.clone());
        assert_eq!((a.as_slice(), b.as_slice()), (&[0][..], &[1, 2][..]));
        // CPU 3 is free; then 0..3 each hold one group, so the lowest number wins.
        assert_eq!(s.pick(&dirs[2], &all, 1), vec![3]);
        s.hold(&dirs[2], vec![3]);
        assert_eq!(s.pick(&dirs[3], &all, 2), vec![0, 1]);
        // Re-placing a group ignores its own old CPUs; a removed group frees its CPUs.
        assert_eq!(s.pick(&dirs[1], &all, 2), vec![1, 2]);
        s.hold(&dirs[1], vec![1, 2]);
        s.release(&dirs[0]);
        fs::remove_dir(&dirs[2]).unwrap();
        assert_eq!(s.pick(&dirs[3], &all, 2), vec![0, 3]);
        fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn parses_flat_keyed_counters() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_counter(v1, "oom_kill"), Some(3));
        assert_eq!(parse_counter(v1, "under_oom"), Some(0));
        let v2 = "low 0\nhigh 0\nmax 5\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(parse_counter(v2, "oom_kill"), Some(1));
        assert_eq!(parse_counter(v2, "oom"), Some(2));
        assert_eq!(parse_counter("", "oom_kill"), None);
    }

    #[test]
    fn detects_this_host_and_kills_a_process_tree() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIP detects_this_host_and_kills_a_process_tree: needs root");
            return;
        }
        let root = match CgroupRoot::detect() {
            Ok(r) => r,
            Err(e) => {
                eprintln!("SKIP: no usable cgroups: {e}");
                return;
            }
        };
        root.ensure_parent().unwrap();
        let id = format!("unit-{}", std::process::id());
        let sb = root.sandbox(&id);
        sb.create(&Limits {
            memory_bytes: 64 << 20,
            cpu: 0.5,
            pids_max: 32,
        })
        .unwrap();
        if let Some(d) = sb.group().cpuset_dir() {
            // cpu 0.5 → one CPU, and the exec child made below inherits it.
            assert_eq!(
                parse_cpu_list(&read_trimmed(&d.join("cpuset.cpus"))).len(),
                1
            );
        }
        let x = sb.exec_child(1);
        x.create().unwrap();
        if let (Some(d), Some(xd)) = (sb.group().cpuset_dir(), x.group().cpuset_dir()) {
            assert_eq!(
                read_trimmed(&xd.join("cpuset.cpus")),
                read_trimmed(&d.join("cpuset.cpus"))
            );
        }
        // A shell that joins the exec group, then leaves a background child behind.
        let files: Vec<String> = x
            .group()
            .procs_files()
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        let script = format!(
            "for f in {}; do echo $$ > $f; done; sleep 100 & sleep 100",
            files.join(" ")
        );
        let mut child = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(script)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while x.group().pids().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            x.group().pids().len() >= 2,
            "processes joined the exec group"
        );
        assert!(!sb.group().is_empty());
        sb.kill_all(Duration::from_secs(5)).unwrap();
        let st = child.wait().unwrap();
        assert!(!st.success());
        assert!(sb.group().is_empty());
        sb.remove(Duration::from_secs(5)).unwrap();
        assert!(!sb.group().exists());
        assert!(!root.list_sandboxes().contains(&id));
    }
}

/// The limit-writing logic on a recording fake of the host's cgroup file systems.
#[cfg(test)]
mod fake_tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Mutex;

    /// One host effect the fake saw, in order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Op {
        Write(PathBuf, String),
        Mkdir(PathBuf),
        Rmdir(PathBuf),
    }

    /// A recording fake of [`CgroupFs`] (unit tests only): directories and control files
    /// in memory, every write/mkdir/rmdir recorded; a write to a file in a missing group is
    /// `ENOENT` as on the host, and [`FakeCgroupFs::refuse`] makes the kernel refuse a path.
    #[derive(Debug, Default)]
    struct FakeCgroupFs {
        state: Mutex<FakeState>,
    }

    #[derive(Debug, Default)]
    struct FakeState {
        dirs: BTreeSet<PathBuf>,
        files: BTreeMap<PathBuf, String>,
        refused: BTreeMap<PathBuf, i32>,
        ops: Vec<Op>,
    }

    impl FakeCgroupFs {
        fn with_dirs(dirs: &[&str]) -> Arc<FakeCgroupFs> {
            let f = FakeCgroupFs::default();
            f.state.lock().unwrap().dirs = dirs.iter().map(PathBuf::from).collect();
            Arc::new(f)
        }
        /// A control file the kernel offers (e.g. `memory.swap.max` with swap accounting).
        fn seed(&self, path: &str, value: &str) {
            let mut st = self.state.lock().unwrap();
            st.files.insert(path.into(), value.into());
        }
        /// Answer `errno` to every write, mkdir or rmdir of `path`.
        fn refuse(&self, path: &str, errno: i32) {
            self.state
                .lock()
                .unwrap()
                .refused
                .insert(path.into(), errno);
        }
        fn ops(&self) -> Vec<Op> {
            std::mem::take(&mut self.state.lock().unwrap().ops)
        }
        fn check(st: &FakeState, path: &Path) -> io::Result<()> {
            if let Some(e) = st.refused.get(path) {
                return Err(io::Error::from_raw_os_error(*e));
            }
            if !path.parent().is_some_and(|p| st.dirs.contains(p)) {
                return Err(io::Error::from_raw_os_error(libc::ENOENT));
            }
            Ok(())
        }
    }

    impl CgroupFs for FakeCgroupFs {
        fn write(&self, path: &Path, value: &str) -> io::Result<()> {
            let mut st = self.state.lock().unwrap();
            Self::check(&st, path)?;
            st.ops.push(Op::Write(path.into(), value.into()));
            st.files.insert(path.into(), value.into());
            Ok(())
        }
        fn read(&self, path: &Path) -> io::Result<String> {
            let st = self.state.lock().unwrap();
            st.files
                .get(path)
                .cloned()
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
        }
        fn mkdir(&self, path: &Path) -> io::Result<()> {
            let mut st = self.state.lock().unwrap();
            Self::check(&st, path)?;
            if !st.dirs.insert(path.into()) {
                return Err(io::Error::from_raw_os_error(libc::EEXIST));
            }
            st.ops.push(Op::Mkdir(path.into()));
            Ok(())
        }
        fn rmdir(&self, path: &Path) -> io::Result<()> {
            let mut st = self.state.lock().unwrap();
            if let Some(e) = st.refused.get(path) {
                return Err(io::Error::from_raw_os_error(*e));
            }
            if !st.dirs.remove(path) {
                return Err(io::Error::from_raw_os_error(libc::ENOENT));
            }
            st.ops.push(Op::Rmdir(path.into()));
            Ok(())
        }
        fn exists(&self, path: &Path) -> bool {
            let st = self.state.lock().unwrap();
            st.dirs.contains(path) || st.files.contains_key(path)
        }
    }

    fn w(path: &str, value: &str) -> Op {
        Op::Write(path.into(), value.into())
    }

    const MIB: u64 = 1 << 20;

    fn v2(fs: &Arc<FakeCgroupFs>) -> CgroupRoot {
        CgroupRoot::with_fs(
            CgroupVersion::V2,
            vec![("unified", "/cg".into())],
            fs.clone(),
        )
    }

    fn v1(fs: &Arc<FakeCgroupFs>) -> CgroupRoot {
        let h = ["memory", "cpu", "pids", "freezer"]
            .into_iter()
            .map(|c| (c, PathBuf::from(format!("/cg/{c}"))))
            .collect();
        CgroupRoot::with_fs(CgroupVersion::V1, h, fs.clone())
    }

    #[test]
    fn v2_create_writes_memory_cpu_and_pids_max_in_the_unified_group() {
        let fs = FakeCgroupFs::with_dirs(&["/cg", "/cg/sandlot"]);
        let sb = v2(&fs).sandbox("sb-1");
        let limits = Limits {
            memory_bytes: 256 * MIB,
            cpu: 0.5,
            pids_max: 64,
        };
        sb.create(&limits).unwrap();
        assert_eq!(
            fs.ops(),
            [
                Op::Mkdir("/cg/sandlot/sb-1".into()),
                w("/cg/sandlot/sb-1/memory.max", "268435456"),
                w("/cg/sandlot/sb-1/cpu.max", "5000 10000"),
                w("/cg/sandlot/sb-1/pids.max", "64"),
            ]
        );
        // With swap accounting the kernel offers memory.swap.max: no swap on top.
        fs.seed("/cg/sandlot/sb-1/memory.swap.max", "max");
        sb.apply(&Limits {
            cpu: 0.005,
            ..limits
        })
        .unwrap();
        assert_eq!(
            fs.ops(),
            [
                w("/cg/sandlot/sb-1/memory.max", "268435456"),
                w("/cg/sandlot/sb-1/memory.swap.max", "0"),
                // 0.005 cores: the period stretches so the quota is the kernel's 1 ms.
                w("/cg/sandlot/sb-1/cpu.max", "1000 200000"),
                w("/cg/sandlot/sb-1/pids.max", "64"),
            ]
        );
        sb.set_pids_max(80).unwrap();
        assert_eq!(fs.ops(), [w("/cg/sandlot/sb-1/pids.max", "80")]);
    }

    #[test]
    fn v1_create_uses_each_hierarchy_and_raises_memsw_before_the_limit() {
        let fs = FakeCgroupFs::with_dirs(&[
            "/cg/memory/sandlot",
            "/cg/cpu/sandlot",
            "/cg/pids/sandlot",
            "/cg/freezer/sandlot",
        ]);
        let sb = v1(&fs).sandbox("sb-2");
        let limits = Limits {
            memory_bytes: 128 * MIB,
            cpu: 2.0,
            pids_max: 32,
        };
        sb.group().create().unwrap();
        fs.ops();
        // The kernel's swap accounting file exists: memory+swap gets the same limit.
        fs.seed("/cg/memory/sandlot/sb-2/memory.memsw.limit_in_bytes", "max");
        sb.apply(&limits).unwrap();
        assert_eq!(
            fs.ops(),
            [
                w("/cg/memory/sandlot/sb-2/memory.limit_in_bytes", "134217728"),
                w(
                    "/cg/memory/sandlot/sb-2/memory.memsw.limit_in_bytes",
                    "134217728"
                ),
                w("/cg/cpu/sandlot/sb-2/cpu.cfs_period_us", "10000"),
                w("/cg/cpu/sandlot/sb-2/cpu.cfs_quota_us", "20000"),
                w("/cg/pids/sandlot/sb-2/pids.max", "32"),
            ]
        );
        // Raising: memory <= memory+swap must hold at every write, so memsw goes first.
        sb.apply(&Limits {
            memory_bytes: 512 * MIB,
            ..limits
        })
        .unwrap();
        let ops = fs.ops();
        assert_eq!(
            ops[..2],
            [
                w(
                    "/cg/memory/sandlot/sb-2/memory.memsw.limit_in_bytes",
                    "536870912"
                ),
                w("/cg/memory/sandlot/sb-2/memory.limit_in_bytes", "536870912"),
            ]
        );
        sb.set_pids_max(40).unwrap();
        assert_eq!(fs.ops(), [w("/cg/pids/sandlot/sb-2/pids.max", "40")]);
    }

    #[test]
    fn v1_vmm_group_gets_headroom_and_a_vcpu_child_with_the_guest_quota() {
        let fs = FakeCgroupFs::with_dirs(&[
            "/cg/memory/sandlot",
            "/cg/cpu/sandlot",
            "/cg/pids/sandlot",
            "/cg/freezer/sandlot",
        ]);
        let sb = v1(&fs).sandbox("sb-3");
        let limits = Limits {
            memory_bytes: 64 * MIB,
            cpu: 0.5,
            pids_max: 16,
        };
        sb.create_vmm(&limits, 0.25).unwrap();
        let ops = fs.ops();
        assert!(ops.contains(&w("/cg/cpu/sandlot/sb-3/cpu.cfs_quota_us", "7500")));
        let tail = &ops[ops.len() - 3..];
        assert_eq!(
            tail,
            [
                Op::Mkdir("/cg/cpu/sandlot/sb-3/vcpu".into()),
                w("/cg/cpu/sandlot/sb-3/vcpu/cpu.cfs_period_us", "10000"),
                w("/cg/cpu/sandlot/sb-3/vcpu/cpu.cfs_quota_us", "5000"),
            ]
        );
        sb.move_vcpu_thread(4242).unwrap();
        assert_eq!(fs.ops(), [w("/cg/cpu/sandlot/sb-3/vcpu/tasks", "4242")]);
        // A whole number of cores: the vCPU count bounds the guest, no quota of its own.
        let sb = v1(&fs).sandbox("sb-4");
        sb.create_vmm(&Limits { cpu: 1.0, ..limits }, 0.25).unwrap();
        assert_eq!(
            fs.ops().last(),
            Some(&Op::Mkdir("/cg/cpu/sandlot/sb-4/vcpu".into()))
        );
    }

    #[test]
    fn a_refused_write_names_the_file_and_keeps_the_kernels_answer() {
        let fs = FakeCgroupFs::with_dirs(&["/cg", "/cg/sandlot"]);
        fs.refuse("/cg/sandlot/sb-5/pids.max", libc::EINVAL);
        let sb = v2(&fs).sandbox("sb-5");
        let err = sb
            .create(&Limits {
                memory_bytes: MIB,
                cpu: 1.0,
                pids_max: 7,
            })
            .unwrap_err();
        let CgroupError::Write {
            path,
            value,
            source,
        } = &err
        else {
            panic!("{err:?}")
        };
        assert_eq!(path, Path::new("/cg/sandlot/sb-5/pids.max"));
        assert_eq!(value, "7");
        assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
        let node: NodeError = err.into();
        assert_eq!(node.code(), sandlot_api::ErrorCode::Internal);
        assert_eq!(node.to_string(), "write \"7\" to /cg/sandlot/sb-5/pids.max");
        assert_eq!(
            sandlot_node_api::chain(&node),
            "write \"7\" to /cg/sandlot/sb-5/pids.max: Invalid argument (os error 22)"
        );
        // A group whose directory is gone: writes fail with the path, `_if_present` not.
        let gone = v2(&fs).sandbox("sb-6");
        assert!(matches!(
            gone.set_pids_max(1),
            Err(CgroupError::Write { ref source, .. }) if source.raw_os_error() == Some(libc::ENOENT)
        ));
    }

    #[test]
    fn remove_tolerates_a_missing_group_and_reports_a_refused_rmdir() {
        let fs = FakeCgroupFs::with_dirs(&["/cg", "/cg/sandlot"]);
        let sb = v2(&fs).sandbox("sb-7");
        sb.remove(Duration::ZERO).unwrap();
        sb.group().create().unwrap();
        fs.refuse("/cg/sandlot/sb-7", libc::EACCES);
        let err = sb.remove(Duration::ZERO).unwrap_err();
        assert!(
            matches!(&err, CgroupError::Remove { path, .. } if path == Path::new("/cg/sandlot/sb-7")),
            "{err:?}"
        );
        fs.state.lock().unwrap().refused.clear();
        fs.ops();
        sb.remove(Duration::ZERO).unwrap();
        assert_eq!(fs.ops(), [Op::Rmdir("/cg/sandlot/sb-7".into())]);
    }

    #[test]
    fn a_host_without_cgroups_is_unavailable_with_the_missing_controller() {
        let tmp = std::env::temp_dir().join(format!("sandlot-cg-none-{}", std::process::id()));
        fs::create_dir_all(&tmp).unwrap();
        let err = CgroupRoot::detect_at(&tmp).unwrap_err();
        assert!(
            matches!(
                &err,
                CgroupError::NotMounted {
                    controller: "memory",
                    ..
                }
            ),
            "{err:?}"
        );
        let node = NodeError::from(err);
        assert_eq!(node.code(), sandlot_api::ErrorCode::Unavailable);
        assert!(node.to_string().contains("memory is not mounted"), "{node}");
        fs::remove_dir_all(&tmp).unwrap();
    }
}

/// A real failure on this host's cgroups, seen as the node sees it.
#[cfg(test)]
mod host_tests {
    use super::*;

    #[test]
    fn a_write_to_a_missing_group_names_the_file_and_the_kernels_answer() {
        let root = match CgroupRoot::detect() {
            Ok(r) => r,
            Err(e) => {
                eprintln!("SKIP: no usable cgroups on this host: {e}");
                return;
            }
        };
        let sb = root.sandbox(&format!("sb-missing-{}", std::process::id()));
        let err = sb.set_pids_max(1).unwrap_err();
        assert!(
            matches!(&err, CgroupError::Write { source, .. } if source.raw_os_error() == Some(libc::ENOENT)),
            "{err:?}"
        );
        let node = NodeError::from(err);
        let chain = sandlot_node_api::chain(&node);
        eprintln!("{chain}");
        assert!(
            chain.contains("pids.max: No such file or directory"),
            "{chain}"
        );
        assert_eq!(node.to_wire().message, chain);
    }

    #[test]
    fn a_failed_rollback_keeps_both_real_failures_with_the_original_code() {
        // Real syscalls on a plain directory: a write into a missing group, then an rmdir
        // of a group directory that is not empty.
        let tmp = tempfile::tempdir().unwrap();
        let root = CgroupRoot::with_fs(
            CgroupVersion::V2,
            vec![("unified", tmp.path().to_path_buf())],
            Arc::new(HostFs),
        );
        let sb = root.sandbox("sb-1");
        let failed = NodeError::from(sb.set_pids_max(1).unwrap_err());
        fs::create_dir_all(tmp.path().join("sandlot/sb-1")).unwrap();
        fs::write(tmp.path().join("sandlot/sb-1/left"), "").unwrap();
        let cleanup = sb.remove(Duration::ZERO).map_err(NodeError::from);
        let e = failed.with_cleanup(cleanup);
        assert_eq!(e.code(), sandlot_api::ErrorCode::Internal);
        let w = e.to_wire();
        eprintln!("{e}\n{}", w.message);
        assert!(
            w.message.contains("pids.max: No such file or directory (os error 2); cleanup also failed: remove cgroup"),
            "{}",
            w.message
        );
        assert!(
            w.message
                .ends_with("sandlot/sb-1: Directory not empty (os error 39)"),
            "{}",
            w.message
        );
    }
}
