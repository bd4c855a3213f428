//! On-disk state of a QEMU sandbox (`microvm` and `vm`): `vms/<id>/state.json`.
use super::Accel;
use crate::backends::saved::StoredSpec;
use crate::node::{NodeError, NodeResult};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// On-disk state of a running microVM or VM: `vms/<id>/state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmState {
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
    /// Accelerator it runs with.
    pub accel: Accel,
    /// Host pid of its QEMU.
    pub qemu_pid: i32,
    /// Its start time (field 22 of `/proc/PID/stat`).
    pub qemu_starttime: u64,
    /// Limits and environment.
    pub spec: StoredSpec,
    /// QEMU's arguments (a restore runs the same plus `-incoming defer`); empty in state
    /// written before pause with memory existed.
    #[serde(default)]
    pub qemu_args: Vec<String>,
    /// Paused with memory: the state is in `memory.state`, no QEMU runs (`qemu_pid` is the
    /// last one).
    #[serde(default)]
    pub memory_saved: bool,
    /// How it started: `cold` (kernel boot) or `template` (restored from the image's
    /// template snapshot, see `template`).
    #[serde(default)]
    pub started_from: String,
    /// Host uid (= gid) its QEMU runs as (every QEMU of this sandbox: after a pause, a
    /// template start, a node restart); `None` in state of a node version that ran QEMU as
    /// root (such a VM keeps running as root).
    #[serde(default)]
    pub qemu_uid: Option<u32>,
    /// The network namespace every QEMU of this sandbox runs in (a network allow policy:
    /// `vms/<id>/netns`, with the tap of [`crate::net::bridge_tap`]); `None`: no network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<std::path::PathBuf>,
}

/// Writes `st` as pretty JSON to `path` atomically (a temp file renamed over it).
///
/// # Errors
/// `Internal` with the path when writing or renaming fails.
pub(crate) fn write_json(path: &Path, st: &VmState) -> NodeResult<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(st).expect("VmState serialises"),
    )
    .and_then(|_| std::fs::rename(&tmp, path))
    .map_err(|e| NodeError::io(format!("write {}", path.display()), e))
}
