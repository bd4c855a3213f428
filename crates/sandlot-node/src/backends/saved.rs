//! The state file of a sandbox, `state.json` in its directory: what a restarted node needs
//! to re-adopt it (see each backend's `readopt`).
//!
//! [`SavedSandbox`] holds the fields the process-based backends share; `function`'s
//! [`JailState`](super::function::JailState) and `container`'s
//! [`ContainerState`](super::container::ContainerState) embed it with `#[serde(flatten)]`,
//! so a file stays one flat JSON object, readable by and from older nodes. [`write`] and
//! [`read`] store any backend's state.
use crate::images::Image;
use crate::node::{NodeError, NodeResult, SandboxSpec};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The file name of a sandbox's state in its directory.
pub const STATE_FILE: &str = "state.json";

/// Spec fields kept in `state.json` (serialisable copy of [`SandboxSpec`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredSpec {
    /// CPU quota in cores.
    pub cpu: f64,
    /// Memory limit in MiB.
    pub memory_mib: u64,
    /// Writable-layer limit in MiB (enforced per file through RLIMIT_FSIZE for now).
    pub disk_mib: u64,
    /// Process/thread limit.
    pub pids_max: u64,
    /// Sandbox environment.
    pub env: BTreeMap<String, String>,
}

/// The stored part of a spec (limits and environment).
impl From<&SandboxSpec> for StoredSpec {
    fn from(spec: &SandboxSpec) -> StoredSpec {
        StoredSpec {
            cpu: spec.cpu,
            memory_mib: spec.memory_mib,
            disk_mib: spec.disk_mib,
            pids_max: spec.pids_max,
            env: spec.env.clone(),
        }
    }
}

/// What every process-based sandbox records: its identity, image, first process and limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedSandbox {
    /// Sandbox id.
    pub id: String,
    /// Image name.
    pub image: String,
    /// Environment of the image (applied before the sandbox's).
    pub image_env: Vec<(String, String)>,
    /// [`Image::version`](crate::images::Image::version) of the image it was created on
    /// (recorded in its checkpoints); absent in state of older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_version: Option<String>,
    /// Host pid of the sandbox's pid 1 (a container's agent; for runsc the sandbox process).
    pub init_pid: i32,
    /// Its start time (field 22 of `/proc/PID/stat`): with `init_pid`, tells the same
    /// process from a later one that reused the pid.
    pub init_starttime: u64,
    /// Host uid/gid of root inside: the start of the sandbox's own range of 65536 ids
    /// (function state of older versions holds the node's shared base, which re-adoption
    /// keeps).
    pub uid_base: u32,
    /// Limits and environment.
    pub spec: StoredSpec,
    /// Name of its cgroup (under the backend's parent group) when it is not the id: a
    /// sandbox handed over by a warm pool keeps the cgroup it was built in (`wp-<hex>`,
    /// `cp-<hex>`; see [`super::pool`]). Absent in older files and for cold creates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
}

impl SavedSandbox {
    /// The state of sandbox `spec` created from `image` (its current version), its first
    /// process `init` (host pid, start time) running as host uid range `uid_base`, in the
    /// cgroup named by its id.
    pub fn new(spec: &SandboxSpec, image: &Image, init: (i32, u64), uid_base: u32) -> Self {
        SavedSandbox {
            id: spec.id.clone(),
            image: image.name.clone(),
            image_env: image.env.clone(),
            image_version: Some(image.version()),
            init_pid: init.0,
            init_starttime: init.1,
            uid_base,
            spec: StoredSpec::from(spec),
            cgroup: None,
        }
    }

    /// The state of sandbox `spec` of `image` made of warm-pool member `name`, built as
    /// `built`: the member's init, uid range and cgroup, the sandbox's id and limits. (A
    /// member is handed over only while its layer stamp matches the image's lower
    /// directories, so the image version is the image's.)
    pub fn handed_over(
        name: &str,
        built: &SavedSandbox,
        spec: &SandboxSpec,
        image: &Image,
    ) -> Self {
        SavedSandbox {
            cgroup: Some(name.to_string()),
            ..Self::new(
                spec,
                image,
                (built.init_pid, built.init_starttime),
                built.uid_base,
            )
        }
    }

    /// Name of the sandbox's cgroup under the node's parent group (`cgroup`, else `id`).
    pub fn cgroup_name(&self) -> &str {
        self.cgroup.as_deref().unwrap_or(&self.id)
    }
}

/// Writes `state` as pretty JSON to `dir/state.json` atomically (a temp file renamed over
/// it), without fsync: the file only has to outlive the node process, not the host. The
/// page cache survives a process crash; after a host crash every sandbox process is dead
/// anyway, and a torn or missing file makes `readopt` remove the directory as a leftover.
/// (An fsync here cost ~13 ms per create on an ext4 virtual disk, most of a create.)
///
/// # Errors
/// `Internal` naming the path when the write or the rename fails.
pub(crate) fn write<T: Serialize>(dir: &Path, state: &T) -> NodeResult<()> {
    let tmp = dir.join("state.json.tmp");
    let json = serde_json::to_vec_pretty(state).expect("sandbox state serialises");
    std::fs::write(&tmp, json)
        .and_then(|_| std::fs::rename(&tmp, dir.join(STATE_FILE)))
        .map_err(|e| NodeError::io(format!("write {}/{STATE_FILE}", dir.display()), e))
}

/// Reads `dir/state.json`; `None` when it is missing, unreadable or not a `T`.
pub fn read<T: DeserializeOwned>(dir: &Path) -> Option<T> {
    let s = std::fs::read(dir.join(STATE_FILE)).ok()?;
    serde_json::from_slice(&s).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::container::{ContainerState, Runtime};

    fn saved() -> SavedSandbox {
        SavedSandbox {
            id: "sb-1".into(),
            image: "python".into(),
            image_env: vec![("PATH".into(), "/usr/bin".into())],
            image_version: None,
            init_pid: 42,
            init_starttime: 7,
            uid_base: 165536,
            spec: StoredSpec {
                cpu: 1.0,
                memory_mib: 256,
                disk_mib: 512,
                pids_max: 64,
                env: BTreeMap::new(),
            },
            cgroup: Some("cp-ab".into()),
        }
    }

    #[test]
    fn a_state_file_is_one_flat_object_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let st = ContainerState {
            saved: saved(),
            runtime: Runtime::Runc,
            runtime_id: None,
        };
        write(dir.path(), &st).unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(STATE_FILE)).unwrap()).unwrap();
        // The fields of older nodes' files, at the top level (no nested `saved`).
        assert_eq!(v["id"], "sb-1");
        assert_eq!(v["init_pid"], 42);
        assert_eq!(v["cgroup"], "cp-ab");
        assert!(v.get("saved").is_none());
        assert!(!dir.path().join("state.json.tmp").exists());
        assert_eq!(read::<ContainerState>(dir.path()), Some(st));
        assert_eq!(read::<ContainerState>(&dir.path().join("missing")), None);
    }

    #[test]
    fn an_older_file_without_the_optional_fields_reads() {
        let dir = tempfile::tempdir().unwrap();
        let old = r#"{"id":"sb-2","image":"busybox","image_env":[],"runtime":"runc",
            "uid_base":100000,"init_pid":9,"init_starttime":3,
            "spec":{"cpu":0.5,"memory_mib":64,"disk_mib":64,"pids_max":32,"env":{}}}"#;
        std::fs::write(dir.path().join(STATE_FILE), old).unwrap();
        let st: ContainerState = read(dir.path()).unwrap();
        assert_eq!(st.saved.cgroup_name(), "sb-2");
        assert_eq!(st.runtime_id(), "sb-2");
        assert_eq!(st.saved.image_version, None);
    }
}
