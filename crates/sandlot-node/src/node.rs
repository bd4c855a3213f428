//! The server↔node boundary.
use async_trait::async_trait;
use sandlot_api::{
    Backend, ErrorCode, ExecEvent, ExecRequest, ExecResult, FileEntry, NetworkPolicy,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use tokio::sync::mpsc;

/// Everything a node needs to create a sandbox. The server has validated ranges and filled
/// defaults; the node still refuses what it cannot honour.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxSpec {
    /// Id chosen by the server (`sb-` + 20 hex digits); unique on the node.
    pub id: String,
    /// Isolation level.
    pub backend: Backend,
    /// Image name in the node's image store.
    pub image: String,
    /// CPU quota in cores.
    pub cpu: f64,
    /// Memory limit in MiB.
    pub memory_mib: u64,
    /// Writable-layer limit in MiB.
    pub disk_mib: u64,
    /// Process/thread limit.
    pub pids_max: u64,
    /// Environment for every exec.
    pub env: BTreeMap<String, String>,
    /// Network policy (validated by the server). `None`: a network namespace with only
    /// `lo`. `Allow`: the backend sets the sandbox's namespace up with
    /// [`crate::net::NetworkManager::attach`] before the sandbox's own processes start.
    pub network: NetworkPolicy,
    /// OCI runtime of a `container` sandbox (`runc`, `crun`, `runsc`); `None` = the node's
    /// default. Ignored by other backends.
    pub runtime: Option<String>,
}

/// What the node knows about a sandbox it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxStatus {
    /// Sandbox id.
    pub id: String,
    /// Isolation level.
    pub backend: Backend,
    /// Whether its processes are alive: [`crate::Liveness::Dead`] only on evidence they are
    /// gone, [`crate::Liveness::Unknown`] when the node could not tell (an error of its own).
    pub liveness: crate::Liveness,
}

/// Node facts shown by the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Node name (the host name by default).
    pub name: String,
    /// Backends this node can run, with the reason for each one it cannot.
    pub backends: Vec<(Backend, Result<(), String>)>,
    /// `"v1"` or `"v2"`.
    pub cgroup_version: String,
    /// OCI runtimes of the container backend (`runc`, `crun`, `runsc`), with the reason for
    /// each one this node cannot run; empty when the container backend is unavailable.
    pub runtimes: Vec<(String, Result<(), String>)>,
    /// The accelerator of the QEMU backends (`microvm`, `vm`): `(Some("kvm"|"tcg"), why)`,
    /// `(None, "probing")` while the start-up probe runs; `None` without a QEMU backend.
    pub accel: Option<(Option<String>, String)>,
    /// The warm pools that run (function jails, runc containers); empty when none does.
    pub warm_pools: Vec<WarmPoolInfo>,
}

/// A warm pool's figures since the node started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmPoolInfo {
    /// The backend whose creates it serves (`function` or `container`).
    pub backend: Backend,
    /// Ready members per image of the pool's image list.
    pub ready: std::collections::BTreeMap<String, usize>,
    /// Creates served by a hand-over of a ready member.
    pub handovers: u64,
    /// [`WarmPoolInfo::handovers`] per image (images with none left out).
    pub handovers_by_image: std::collections::BTreeMap<String, u64>,
    /// Creates the pool could serve that found no usable member and went cold.
    pub misses: u64,
}

/// Errors of node operations. Each maps to exactly one wire [`ErrorCode`].
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// No sandbox (or file, or image) of that name on this node.
    #[error("{0}")]
    NotFound(String),
    /// Bad input the server could not catch (bad path, file too large, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// The backend or a host feature is missing; the message says why.
    #[error("{0}")]
    Unavailable(String),
    /// Node capacity exhausted.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The sandbox is in a state that does not allow the call (e.g. being deleted).
    #[error("{0}")]
    Conflict(String),
    /// The call did not finish in time (a background process that does not read its
    /// stdin).
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The sandbox's own permissions refuse the call (a file its root may not read or
    /// write).
    #[error("{0}")]
    PermissionDenied(String),
    /// Host-side failure (mount, cgroup, spawn), with the path or step in the message.
    #[error("{context}")]
    Internal {
        /// What was being done, with the path.
        context: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl NodeError {
    /// Wrap an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        NodeError::Internal {
            context: context.into(),
            source,
        }
    }

    /// The wire error code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            NodeError::NotFound(_) => ErrorCode::NotFound,
            NodeError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            NodeError::Unavailable(_) => ErrorCode::Unavailable,
            NodeError::ResourceExhausted(_) => ErrorCode::ResourceExhausted,
            NodeError::Conflict(_) => ErrorCode::Conflict,
            NodeError::PermissionDenied(_) => ErrorCode::PermissionDenied,
            NodeError::DeadlineExceeded(_) => ErrorCode::DeadlineExceeded,
            NodeError::Internal { .. } => ErrorCode::Internal,
        }
    }
}

/// Result of node operations.
pub type NodeResult<T> = Result<T, NodeError>;

/// Where a streamed exec sends its chunks (stdout/stderr events only; the final result is
/// the return value of [`Node::exec`]). A closed receiver does not stop the exec.
pub type ExecSink = mpsc::Sender<ExecEvent>;

/// Live control of a running exec, for background processes (`crate::processes`): stdin
/// that stays open and signals.
#[derive(Debug)]
pub struct ExecControl {
    /// Stdin chunks sent after the request's own `stdin_b64`; the command's stdin closes
    /// (EOF) when every sender is dropped. `None`: stdin is `stdin_b64` alone (or
    /// `/dev/null`).
    pub stdin: Option<mpsc::Receiver<bytes::Bytes>>,
    /// Signals to deliver, Linux numbers: SIGKILL (9) ends the whole process tree; the
    /// others ([`sandlot_guest::spec::FORWARDED_SIGNALS`]) go to the command's process
    /// group. Other numbers are ignored (the caller validates).
    pub signals: mpsc::UnboundedReceiver<i32>,
    /// A name for the exec, unique on the node (the guest agent's exec handle).
    pub handle: String,
}

/// The operations every node honours, whatever backend runs the sandbox.
///
/// All paths are paths inside the sandbox; they resolve inside the sandbox root only
/// (symlinks and `..` cannot escape).
#[async_trait]
pub trait Node: Send + Sync + 'static {
    /// Node facts.
    fn info(&self) -> NodeInfo;

    /// Create and start a sandbox; on error nothing of it is left behind.
    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()>;

    /// Run a command to completion (or timeout). With `sink`, output chunks are also sent
    /// there as they come.
    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult>;

    /// [`Node::exec`] with live control ([`ExecControl`]): stdin streamed while the command
    /// runs and signals delivered to it. The engine of background processes
    /// ([`crate::processes::ProcessTable`]).
    ///
    /// # Errors
    /// As [`Node::exec`]; `Unavailable` where the node does not support it (the default).
    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: ExecControl,
    ) -> NodeResult<ExecResult> {
        let _ = (id, req, sink, control);
        Err(NodeError::Unavailable(
            "background processes are not supported by this node".into(),
        ))
    }

    /// Read a whole file; files over `max_bytes` give `InvalidArgument`.
    ///
    /// Memory grows with the bytes read (never pre-reserved from the file's claimed size);
    /// callers that hold many reads at once budget them with [`Node::file_size`] first.
    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>>;

    /// Size in bytes of the regular file at `path` (its `st_size`; symlinks followed inside
    /// the root), so a caller can reserve memory before [`Node::read_file`]. The sandbox may
    /// change the file in between: the size is a hint, `read_file`'s `max_bytes` the bound.
    ///
    /// # Errors
    /// As [`Node::read_file`]: `NotFound`, `InvalidArgument` (not a regular file, special
    /// file system, bad path), `Internal`.
    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64>;

    /// Write a file atomically (temp file + fsync + rename), creating parent directories.
    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()>;

    /// Write `files` (path, content) in order, each atomically but not durably (no fsync),
    /// for a sandbox that never outlives a crash of this node (`run_code`'s). The default
    /// writes them one by one with [`Node::write_file`]; the `function` backend writes them
    /// in one pass without fsyncs.
    ///
    /// # Errors
    /// As [`Node::write_file`], for the first file that fails (the later ones are not
    /// written).
    async fn write_files_volatile(
        &self,
        id: &str,
        files: Vec<(String, bytes::Bytes)>,
    ) -> NodeResult<()> {
        for (path, data) in files {
            self.write_file(id, &path, data).await?;
        }
        Ok(())
    }

    /// List a directory, sorted by name.
    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>>;

    /// Remove a file, or a directory recursively.
    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()>;

    /// Facts of the file or directory at `path` (symlinks followed inside the root; `name`
    /// is the path's last component, `/` for the root).
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` (bad path, special file system, refused
    /// directory); `PermissionDenied`; `Internal`.
    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry>;

    /// Create the directory `path` (owned by the sandbox's root, mode 0755). `parents`:
    /// create missing ancestors too and accept an existing directory (`mkdir -p`).
    ///
    /// # Errors
    /// `NotFound` (missing parent without `parents`); `Conflict` (exists without
    /// `parents`, or a non-directory is in the way); `InvalidArgument`; `PermissionDenied`;
    /// `ResourceExhausted` (the sandbox's space); `Internal`.
    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()>;

    /// Pause: freeze every process of the sandbox (cgroup freezer; later backends: the VM's
    /// vCPUs). A paused sandbox uses no CPU; exec and file calls answer
    /// [`NodeError::Conflict`] ("sandbox is paused") until [`Node::resume`]; an exec already
    /// running is frozen with it and continues after resume. Pausing a paused sandbox is a
    /// no-op. [`Node::delete`] works on a paused sandbox.
    ///
    /// # Errors
    /// `NotFound` for an unknown or deleting sandbox; `Internal` when the freezer fails.
    async fn pause(&self, id: &str) -> NodeResult<()>;

    /// Resume: thaw a paused sandbox. Resuming a running sandbox is a no-op.
    ///
    /// # Errors
    /// `NotFound` for an unknown or deleting sandbox; `Internal` when the freezer fails.
    async fn resume(&self, id: &str) -> NodeResult<()>;

    /// Kill every process of the sandbox and remove all its host resources (mounts,
    /// cgroups, directories). Idempotent: an unknown id is not an error.
    async fn delete(&self, id: &str) -> NodeResult<()>;

    /// Sandboxes this node has (alive or not).
    async fn list(&self) -> NodeResult<Vec<SandboxStatus>>;

    /// After a restart: find sandboxes left running by the previous process from on-disk
    /// state, adopt those whose id is in `keep` and alive, and delete every other one
    /// (half-created or unknown leftovers). Returns the ids adopted. A leftover that cannot
    /// be removed is logged and left for the next start, not an error.
    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>>;

    /// Checkpoint sandbox `id`'s writable layer as checkpoint `checkpoint_id` (`ck-` + 20
    /// hex digits, chosen by the server) on this node's disk ([`crate::checkpoints`]); the
    /// sandbox keeps running (its processes are frozen during the copy).
    ///
    /// # Errors
    /// `NotFound` (sandbox); `InvalidArgument` (bad checkpoint id); `Conflict` (checkpoint
    /// exists, or the sandbox's state forbids it); `Unavailable` where the backend or node
    /// cannot checkpoint (the default); `Internal`.
    async fn checkpoint(
        &self,
        id: &str,
        checkpoint_id: &str,
    ) -> NodeResult<crate::checkpoints::CheckpointMeta> {
        let _ = (id, checkpoint_id);
        Err(NodeError::Unavailable(
            "checkpoints are not supported by this node".into(),
        ))
    }

    /// [`Node::create`] a fork of checkpoint `checkpoint_id`: its writable layer starts as
    /// a copy of the checkpoint's. `spec.backend` and `spec.image` must be the checkpoint's.
    ///
    /// # Errors
    /// As `create`; `NotFound` for an unknown checkpoint; `InvalidArgument` for a backend
    /// or image other than the checkpoint's or a smaller microVM disk.
    async fn create_from_checkpoint(
        &self,
        spec: &SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        let _ = (spec, checkpoint_id);
        Err(NodeError::Unavailable(
            "checkpoints are not supported by this node".into(),
        ))
    }

    /// Remove checkpoint `checkpoint_id`; an unknown id is fine. Forks never depend on
    /// their checkpoint (each holds its own copy; a vm fork its own hard links to the
    /// checkpoint's qcow2 layers), so live forks do not block it.
    ///
    /// # Errors
    /// `Conflict` while a create copies from it; `Internal`.
    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        let _ = checkpoint_id;
        Ok(())
    }

    /// Ids of the checkpoints on this node's disk (the server removes those it has no
    /// record of at start).
    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        Ok(Vec::new())
    }

    /// The accelerator (`"kvm"` or `"tcg"`) microvm and vm sandboxes get on this node,
    /// waiting for the start-up probe if it is still running; `None` on a node without a
    /// QEMU backend.
    async fn accel(&self) -> Option<String> {
        None
    }
}

/// Host paths a node uses under its data directory.
#[derive(Debug, Clone)]
pub struct NodePaths {
    /// `DATA/images`: the image store.
    pub images: PathBuf,
    /// `DATA/sandboxes`: one directory per sandbox.
    pub sandboxes: PathBuf,
}
