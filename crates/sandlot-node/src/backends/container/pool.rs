//! The `container` backend's member of the warm pool ([`crate::backends::pool`]): ready runc
//! containers, so that a create only has to hand one over instead of running `runc run` in
//! the request.
//!
//! A pooled container is an ordinary runc container (same bundle, seccomp profile, user
//! namespace, capabilities, agent, cgroup, scratch disk of [`POOL_DISK_MIB`] MiB and agent
//! socket; network `none`) built ahead of time with the pool's limits under an internal
//! name `cp-<hex>`, which is its runc container id and its cgroup name:
//!
//! * bundle directory `DATA/container-pool/<name>/` (sibling of `DATA/containers`, same
//!   file system); a node restart removes every leftover (`runc delete --force <name>`,
//!   unmount, cgroups, directory) before the pool refills;
//! * cgroup `<parent>-ctr/<name>` in every hierarchy;
//! * a host uid range of its own from the node's table, passed on to the sandbox unchanged
//!   at hand-over.
//!
//! Hand-over, for a create with runtime runc, network `none`, no checkpoint seed,
//! `disk_mib` equal to [`POOL_DISK_MIB`] (see [`spec_compatible`]) and an image that has a
//! ready container built from the same layers: as the pool describes (the limits written
//! are memory, cpu quota and cpuset placement, pids), onto the sandbox's claimed directory
//! `DATA/containers/<id>`.
//!
//! What keeps the pooled name, and why it still works after the rename:
//!
//! * runc's container id and the cgroup: runc has no rename, and cgroup v2 does not
//!   implement rename(2) of cgroup directories. Both are recorded in `state.json`
//!   (`runtime_id`, `cgroup`), and every runtime call and cgroup lookup of the backend
//!   (delete, destroy, readopt, pause, OOM counting, checkpoint) goes through them.
//! * the host mounts (rootfs overlay, scratch disk) move with their parent directory (a
//!   mount hangs on its dentry); the container's own mount namespace holds them by
//!   reference. The overlay's options name its upper and work dirs by `/proc/self/fd/N`
//!   (no path to go stale, none shown to the container).
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
use super::{write_proc_views, ContainerState, Core, Runtime};
use crate::backends::pool::{pool_spec, PoolMember, WarmPool};
use crate::backends::saved::SavedSandbox;
use crate::cgroups::CgroupRoot;
use crate::images::Image;
use crate::node::{NodeResult, SandboxSpec};
use sandlot_api::Backend;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Prefix of pooled containers' names (runc id, directory and cgroup).
pub const POOL_PREFIX: &str = "cp-";
/// Scratch disk of a pooled container, MiB: the API's default `disk_mib`. Only creates
/// asking for this size are served from the pool (the disk image is fixed at build).
pub const POOL_DISK_MIB: u64 = 1024;

/// The warm pool of the container backend.
pub type ContainerPool = WarmPool<Containers>;

/// Pooled runc containers: the [`PoolMember`] of the container backend.
pub struct Containers {
    pub(crate) core: Arc<Core>,
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

impl PoolMember for Containers {
    type State = ContainerState;
    const PREFIX: &'static str = POOL_PREFIX;
    const WHAT: &'static str = "container";
    const NAME: &'static str = "container pool";

    fn cgroups(&self) -> &CgroupRoot {
        &self.core.cgroups
    }

    async fn build(
        &self,
        name: &str,
        image: &Image,
        dir: &Path,
        uid_base: u32,
    ) -> NodeResult<ContainerState> {
        let bin = self.core.runtime_bin(Runtime::Runc)?;
        let spec = SandboxSpec {
            runtime: Some(Runtime::Runc.name().into()),
            ..pool_spec(name, Backend::Container, image, POOL_DISK_MIB)
        };
        let cg = self.core.cgroups.sandbox(name);
        self.core
            .create_inner(dir, &spec, image, Runtime::Runc, &bin, uid_base, &cg, None)
            .await
    }

    /// `runc delete --force <name>`, unmount, cgroups, directory.
    async fn destroy(&self, name: &str, dir: &Path) -> NodeResult<()> {
        self.core
            .destroy_at(dir, name, name, Some(Runtime::Runc), None)
            .await
    }

    fn handed_over(
        &self,
        name: &str,
        built: &ContainerState,
        spec: &SandboxSpec,
        image: &Image,
    ) -> ContainerState {
        ContainerState {
            saved: SavedSandbox::handed_over(name, &built.saved, spec, image),
            runtime: Runtime::Runc,
            runtime_id: Some(name.to_string()),
        }
    }

    fn saved(state: &ContainerState) -> &SavedSandbox {
        &state.saved
    }

    fn write_proc_views(dir: &Path, _state: &ContainerState, spec: &SandboxSpec) -> NodeResult<()> {
        write_proc_views(dir, &crate::backends::function::proc_views(spec)?)
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
