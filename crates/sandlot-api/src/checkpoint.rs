//! Checkpoint resource: a sandbox's writable layer saved on its node, the seed of forks.
use crate::sandbox::Backend;
use serde::{Deserialize, Serialize};

/// `POST /v1/sandboxes/{id}/checkpoints` → 201, `GET /v1/checkpoints/{checkpoint_id}`.
///
/// A checkpoint holds the sandbox's writable layer only (incremental on its image); create
/// a fork with `POST /v1/sandboxes {"checkpoint": checkpoint_id}`. It belongs to the API
/// key that made it and lives until `DELETE /v1/checkpoints/{checkpoint_id}` (forks do not
/// depend on it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Opaque id, `ck-` followed by 20 lowercase hex digits.
    pub checkpoint_id: String,
    /// The sandbox it was taken from (which may be gone since).
    pub sandbox_id: String,
    /// That sandbox's backend; forks use the same.
    pub backend: Backend,
    /// That sandbox's image; forks use the same.
    pub image: String,
    /// OCI runtime of a `container` sandbox; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// The parent's `disk_mib`: the default for forks (a microVM fork may not ask for less).
    pub disk_mib: u64,
    /// Bytes it occupies on the node's disk.
    pub size_bytes: u64,
    /// Creation time, RFC 3339 UTC with milliseconds.
    pub created_at: String,
}

/// `GET /v1/checkpoints` → the caller's checkpoints, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CheckpointList {
    /// Checkpoints.
    pub checkpoints: Vec<Checkpoint>,
}
