//! Sandbox resource: create request, state and listing.
use crate::network::NetworkPolicy;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// Isolation level, chosen per sandbox with `backend=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// Namespace jail built by Sandlot itself (user, mount, pid, net, ipc, uts, cgroup ns).
    #[default]
    Function,
    /// OCI container through an OCI runtime CLI (runc, crun, runsc).
    Container,
    /// QEMU `-M microvm` with its own kernel.
    Microvm,
    /// Full VM: QEMU q35 booting a disk image.
    Vm,
}

impl Backend {
    /// Wire name, e.g. `"function"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Function => "function",
            Backend::Container => "container",
            Backend::Microvm => "microvm",
            Backend::Vm => "vm",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "function" => Ok(Backend::Function),
            "container" => Ok(Backend::Container),
            "microvm" => Ok(Backend::Microvm),
            "vm" => Ok(Backend::Vm),
            other => Err(format!(
                "unknown backend {other:?}; expected one of function, container, microvm, vm"
            )),
        }
    }
}

/// `POST /v1/sandboxes` body. Every field is optional; defaults are in the field docs.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Isolation level (default `function`).
    #[serde(default)]
    pub backend: Backend,
    /// Image name as listed by `sandlot image ls` (default `"python"`).
    #[serde(default)]
    pub image: Option<String>,
    /// CPU quota in cores, e.g. `0.5` (default 1.0; range 0.01–64).
    #[serde(default)]
    pub cpu: Option<f64>,
    /// Memory limit in MiB (default 512; range 16–65536).
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// Writable-layer size limit in MiB (default 1024). Enforced by later backends; recorded now.
    #[serde(default)]
    pub disk_mib: Option<u64>,
    /// Maximum number of processes and threads (default 256; range 8–65536).
    #[serde(default)]
    pub pids_max: Option<u64>,
    /// Seconds until the sandbox is deleted unless kept alive (default 600; 0 = no TTL;
    /// max 604800).
    #[serde(default)]
    pub ttl_s: Option<u64>,
    /// Environment given to every exec (exec `env` overrides per key).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Free-form labels for selection (`GET /v1/sandboxes?label=k=v`); keys starting with
    /// `sandlot.` are reserved (the server answers 400 `invalid_argument`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Network policy (default `"none"`).
    #[serde(default)]
    pub network: NetworkPolicy,
    /// OCI runtime of a `container` sandbox: `"runc"` (default), `"crun"` (cgroup v2 hosts)
    /// or `"runsc"` (gVisor). Only valid with `backend: "container"`.
    #[serde(default)]
    pub runtime: Option<String>,
    /// Trajectory id binding this sandbox to a trajectory log: 1–200 characters of
    /// `[A-Za-z0-9._:/-]`. When a live sandbox is already bound to it, create answers that
    /// sandbox (200, the reattach) whatever the other fields say.
    #[serde(default)]
    pub trajectory: Option<String>,
    /// What to do when `trajectory` has logged steps but its sandbox is gone (default
    /// `fail`). Only meaningful with `trajectory`.
    #[serde(default)]
    pub restore: Option<RestoreMode>,
    /// Create a fork of this checkpoint (`ck-…`, from `POST /v1/sandboxes/{id}/checkpoints`):
    /// the sandbox's writable layer starts as the checkpoint's. `backend`, `image` (and a
    /// container's `runtime`, `disk_mib`) default to the checkpoint's; a different `backend`
    /// or `image` → 400 `invalid_argument`; an unknown checkpoint → 404 `not_found`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
}

/// `restore=` of a create with a trajectory whose sandbox is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RestoreMode {
    /// Answer 409 `conflict` (the default).
    #[default]
    Fail,
    /// Build a new sandbox and re-execute every logged mutating step in order.
    Replay,
}

/// Outcome of a `restore="replay"` create.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RestoreReport {
    /// Number of logged mutating steps (exec, write_file, remove_file) re-executed.
    pub replayed_steps: u64,
    /// Execs whose exit code differs from the logged one, in step order.
    pub mismatches: Vec<RestoreMismatch>,
}

/// One exec of a restore whose exit code differs from the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreMismatch {
    /// Step number.
    pub step: u64,
    /// Exit code in the log.
    pub logged_exit_code: i32,
    /// Exit code of the re-execution.
    pub exit_code: i32,
}

/// Lifecycle state of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Being set up by its node.
    Creating,
    /// Ready for exec and file calls.
    Running,
    /// Being torn down.
    Deleting,
    /// Gone (kept in listings only until its record is purged).
    Deleted,
    /// Its node lost it (e.g. the host rebooted); only delete is valid.
    Lost,
    /// Frozen by `POST /v1/sandboxes:pause`: uses no CPU; exec, file calls and keepalive
    /// answer 409 `conflict` until `:resume`; delete works. The TTL keeps counting.
    Paused,
}

impl SandboxState {
    /// Wire name, e.g. `"running"`.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Deleting => "deleting",
            SandboxState::Deleted => "deleted",
            SandboxState::Lost => "lost",
            SandboxState::Paused => "paused",
        }
    }
}

impl FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "creating" => SandboxState::Creating,
            "running" => SandboxState::Running,
            "deleting" => SandboxState::Deleting,
            "deleted" => SandboxState::Deleted,
            "lost" => SandboxState::Lost,
            "paused" => SandboxState::Paused,
            other => return Err(format!("unknown sandbox state {other:?}")),
        })
    }
}

/// A sandbox as returned by the API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sandbox {
    /// Opaque id, `sb-` followed by 20 lowercase hex digits.
    pub id: String,
    /// Isolation level.
    pub backend: Backend,
    /// Image name.
    pub image: String,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Name of the node that runs it.
    pub node: String,
    /// Creation time, RFC 3339 UTC.
    pub created_at: String,
    /// Expiry time, RFC 3339 UTC; `null` when the sandbox has no TTL.
    pub expires_at: Option<String>,
    /// CPU quota in cores.
    pub cpu: f64,
    /// Memory limit in MiB.
    pub memory_mib: u64,
    /// Writable-layer size limit in MiB.
    pub disk_mib: u64,
    /// Process limit.
    pub pids_max: u64,
    /// TTL in seconds (0 = none).
    pub ttl_s: u64,
    /// Labels.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Network policy.
    pub network: NetworkPolicy,
    /// OCI runtime (`runc`, `crun`, `runsc`); present for `container` sandboxes only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Accelerator of a `microvm` or `vm` sandbox: `"kvm"` or `"tcg"` (QEMU's binary
    /// translator, slow); absent for other backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<String>,
    /// Trajectory id, if bound to one.
    pub trajectory: Option<String>,
    /// Present only on the answer of a `restore="replay"` create that rebuilt the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreReport>,
}

/// `GET /v1/sandboxes` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxList {
    /// Matching sandboxes, oldest first (ties in creation time by id when paged).
    pub sandboxes: Vec<Sandbox>,
    /// Paged calls (`limit` given) only: pass it as `page_token` to get the next page;
    /// absent when this page is the last. Opaque.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// `GET /v1/sandboxes:summary` body: counts over every sandbox in the registry (an
/// operator's view; admin only).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SandboxSummary {
    /// All sandboxes.
    pub total: u64,
    /// Per backend and state (only pairs with at least one sandbox).
    pub by_state: Vec<StateCount>,
    /// Per node name (only nodes with at least one sandbox in the registry).
    pub by_node: BTreeMap<String, u64>,
    /// Sandboxes bound to a trajectory.
    pub with_trajectory: u64,
}

/// One row of [`SandboxSummary::by_state`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateCount {
    /// Backend name (`function`, `container`, `microvm`, `vm`).
    pub backend: String,
    /// Sandbox state (`creating`, `running`, ...).
    pub state: String,
    /// Sandboxes in it.
    pub count: u64,
}

/// `POST /v1/sandboxes/{id}/keepalive` body.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeepaliveRequest {
    /// New TTL in seconds counted from now (default: the sandbox's own `ttl_s`).
    #[serde(default)]
    pub ttl_s: Option<u64>,
}
