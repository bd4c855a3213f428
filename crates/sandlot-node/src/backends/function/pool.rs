//! The `function` backend's member of the warm pool ([`crate::backends::pool`]): ready jails, so that
//! `create` only has to hand one over.
//!
//! A pooled jail is an ordinary function jail (same `sandlot-guest init`, same namespaces,
//! seccomp, landlock and cgroups) built ahead of time with the pool's limits and a
//! [`POOL_TMP_MIB`] MiB /tmp under an internal name `wp-<hex>`:
//!
//! * directory `DATA/warm-pool/<name>/` (sibling of `DATA/sandboxes`, same file system);
//! * cgroup `<parent>/<name>` in every hierarchy;
//! * a host uid range of its own from the backend's table; the hand-over passes it on to
//!   the sandbox unchanged (the jail's files and user namespace already belong to it).
//!
//! Hand-over, for a create whose image has a ready jail built from the same layers and
//! whose /tmp bound matches (see [`tmp_compatible`]): as the pool describes. Nothing of a
//! jail depends on its birth name but the cgroup (kept, recorded in `state.json`): exec and
//! files reach the sandbox through its init pid (`/proc/PID/ns/*`, `/proc/PID/root`); the
//! overlay mount inside the sandbox's mount namespace holds the upper/work directories by
//! reference, so renaming them on the host does not disturb it.
use super::{
    build_jail, destroy_blocking, disk_templates, pooled_standby, rewrite_proc_views,
    FunctionConfig, JailState, Standby,
};
use crate::backends::pool::{pool_spec, PoolMember, WarmPool};
use crate::backends::saved::SavedSandbox;
use crate::cgroups::CgroupRoot;
use crate::images::Image;
use crate::node::{NodeResult, SandboxSpec};
use crate::sys::spawn_blocking;
use sandlot_api::Backend;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Prefix of pooled jails' names (directory and cgroup).
pub const POOL_PREFIX: &str = "wp-";
/// Size of a pooled jail's disk image and of its /tmp and /dev/shm tmpfs, MiB (fixed at
/// build; see [`tmp_compatible`]).
pub const POOL_TMP_MIB: u64 = 1024;

/// The warm pool of the function backend.
pub type FunctionPool = WarmPool<Jails>;

/// Pooled function jails: the [`PoolMember`] of the function backend.
pub struct Jails {
    pub(crate) cfg: FunctionConfig,
    pub(crate) cgroups: CgroupRoot,
    /// Each ready jail's standby exec helper, by pooled name (see
    /// [`super::pooled_standby`]); handed over with the jail.
    pub(crate) standbys: Mutex<HashMap<String, Standby>>,
}

impl Jails {
    /// The standby helper of pooled jail `name` (its cgroup name), if it has a live one.
    pub(crate) fn take_standby(&self, name: &str) -> Option<Standby> {
        self.standbys.lock().unwrap().remove(name)
    }
}

/// `DATA/warm-pool`, next to `DATA/sandboxes`.
pub fn pool_dir(sandboxes_dir: &Path) -> PathBuf {
    sandboxes_dir
        .parent()
        .map(|p| p.join("warm-pool"))
        .unwrap_or_else(|| sandboxes_dir.join("..warm-pool"))
}

/// Whether a pooled jail (tmpfs of [`POOL_TMP_MIB`] MiB) can serve `spec` with the same
/// effective /tmp bound as a cold create. A cold create sizes /tmp at
/// `min(disk_mib, memory_mib)`; tmpfs pages are charged to the sandbox's memory cgroup, so
/// the effective bound is the smaller of the tmpfs size and the memory limit. The pooled
/// jail fits when `min(POOL_TMP_MIB, memory) == min(disk, memory)`.
/// The jail's disk image has [`POOL_TMP_MIB`] MiB too (its size is fixed at build), so
/// `disk_mib` must be that size.
pub fn tmp_compatible(spec: &SandboxSpec) -> bool {
    spec.disk_mib == POOL_TMP_MIB
        && POOL_TMP_MIB.min(spec.memory_mib) == spec.disk_mib.min(spec.memory_mib)
}

impl PoolMember for Jails {
    type State = JailState;
    const PREFIX: &'static str = POOL_PREFIX;
    const WHAT: &'static str = "jail";
    const NAME: &'static str = "warm pool";

    fn cgroups(&self) -> &CgroupRoot {
        &self.cgroups
    }

    async fn build(
        &self,
        name: &str,
        image: &Image,
        dir: &Path,
        uid_base: u32,
    ) -> NodeResult<JailState> {
        let spec = pool_spec(name, Backend::Function, image, POOL_TMP_MIB);
        let (templates, d) = (disk_templates(&self.cfg), dir.to_path_buf());
        spawn_blocking(move || crate::disk::mount_scratch(&templates, &d, POOL_TMP_MIB)).await?;
        let cg = self.cgroups.sandbox(name);
        let mut state = build_jail(
            &self.cfg,
            &spec,
            image,
            dir,
            &cg,
            POOL_TMP_MIB,
            uid_base,
            &mut None,
        )
        .await?;
        state.saved.cgroup = Some(name.to_string());
        // Without a standby the jail still serves; its first exec joins its group itself.
        // The standby serves the first exec on both exec paths: no guest agent starts while
        // the jail waits; the handed-over sandbox starts one at its second exec.
        match pooled_standby(&self.cfg.guest_bin, &cg).await {
            Ok(s) => {
                self.standbys.lock().unwrap().insert(name.to_string(), s);
            }
            Err(e) => tracing::debug!(pooled = %name, error = %e, "no standby exec helper"),
        }
        Ok(state)
    }

    fn destroy(&self, name: &str, dir: &Path) -> impl Future<Output = NodeResult<()>> + Send {
        // Its helper dies with the jail's cgroup below (dropping it kills it first).
        drop(self.take_standby(name));
        let (cg, dir) = (self.cgroups.sandbox(name), dir.to_path_buf());
        spawn_blocking(move || destroy_blocking(&cg, &dir))
    }

    fn handed_over(
        &self,
        name: &str,
        built: &JailState,
        spec: &SandboxSpec,
        image: &Image,
    ) -> JailState {
        JailState {
            saved: SavedSandbox::handed_over(name, &built.saved, spec, image),
            backend: Backend::Function,
        }
    }

    fn saved(state: &JailState) -> &SavedSandbox {
        &state.saved
    }

    fn write_proc_views(_dir: &Path, state: &JailState, spec: &SandboxSpec) -> NodeResult<()> {
        rewrite_proc_views(state.saved.init_pid, spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_dir_is_a_sibling_of_the_sandboxes_dir() {
        assert_eq!(
            pool_dir(Path::new("/d/sandboxes")),
            PathBuf::from("/d/warm-pool")
        );
    }
}
