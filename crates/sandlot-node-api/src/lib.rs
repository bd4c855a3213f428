//! The contract between a Sandlot server and a node (DESIGN.md "Components", "Cluster
//! mode"): the [`Node`] trait with its request and answer types and its typed errors.
//!
//! A server drives sandboxes only through [`Node`]: the lifecycle calls (create, delete,
//! pause, resume, checkpoint, list, readopt) and the I/O calls (exec with streaming and live
//! stdin/signals, files) and background processes (`process_*`: they live on the node, so
//! every server reaching it sees them). Implementations: `sandlot_node::LocalNode` (in-process, the
//! embedded `sandlot up`), `sandlot_node_remote`'s client of a `sandlot node` (cluster mode),
//! and `sandlot_node_fake::FakeNode` (a unit-test fake that runs nothing).
//!
//! Errors: [`NodeError`], one wire [`ErrorCode`] each. [`NodeError::Transport`] means the
//! outcome is unknown (the call or its answer was lost between server and node): retryable,
//! and never a reason to declare a sandbox `lost` — only [`Liveness::Dead`], reported by a
//! node that answered, is.
//!
//! This crate depends on `sandlot-api`, serde and what the trait's signatures need (tokio's
//! channels, bytes), so a server can be built without the node's backends.
#![deny(missing_docs)]

use async_trait::async_trait;
use sandlot_api::{
    Backend, ErrorCode, ExecEvent, ExecRequest, ExecResult, FileEntry, NetworkPolicy, Process,
    ProcessEvent, PtySize, SpawnRequest,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tokio::sync::mpsc;

/// Working directory of execs and of relative file paths inside every sandbox.
pub const WORKDIR: &str = "/workspace";

/// Default cap on the bytes of each output stream an exec keeps (1 MiB), when the request
/// gives no `max_output_bytes`.
pub const DEFAULT_MAX_OUTPUT: u64 = 1 << 20;

/// Liveness of a sandbox (of its init process or its QEMU) as far as the node can tell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Liveness {
    /// Its process runs (or, for a microVM saved to its memory file, its state is kept).
    Alive,
    /// Evidence that its processes are gone.
    Dead,
    /// The node could not tell; the reason (an error of the node's own, e.g. `EMFILE`).
    /// Callers must treat it as "not dead".
    Unknown(String),
}

impl Liveness {
    /// True only for [`Liveness::Alive`].
    pub fn is_alive(&self) -> bool {
        matches!(self, Liveness::Alive)
    }

    /// True only for [`Liveness::Dead`] (evidence the processes are gone).
    pub fn is_dead(&self) -> bool {
        matches!(self, Liveness::Dead)
    }
}

/// Facts of one checkpoint (a node keeps them in `DATA/checkpoints/<ck>/meta.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// `ck-` + 20 lowercase hex digits.
    pub id: String,
    /// The sandbox it was taken from.
    pub sandbox_id: String,
    /// Backend of that sandbox (forks must use the same).
    pub backend: Backend,
    /// Image of that sandbox (forks must use the same).
    pub image: String,
    /// OCI runtime of a container sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// First host uid of the parent's id range (function, container): owners in
    /// `uid_base..uid_base+65536` are shifted to the fork's range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid_base: Option<u32>,
    /// The parent's writable-layer size in MiB.
    pub disk_mib: u64,
    /// The image's version (`sandlot_node::images::Image::version`) the parent was created
    /// on, where its forks lay the checkpoint over the image's files (function, container,
    /// microvm): a fork is refused (`Conflict`) once the image has another version. Absent
    /// for `vm` (its forks read the parent's own base disk) and in checkpoints of older
    /// nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_version: Option<String>,
    /// Bytes the checkpoint occupies on the node's disk (allocated blocks).
    pub size_bytes: u64,
    /// Creation time, Unix milliseconds.
    pub created_at_ms: i64,
}

/// Check a checkpoint id: `ck-` + 20 lowercase hex digits.
///
/// # Errors
/// `InvalidArgument` with the rule.
pub fn check_checkpoint_id(id: &str) -> NodeResult<()> {
    let ok = id.strip_prefix("ck-").is_some_and(|h| {
        h.len() == 20 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    });
    if ok {
        Ok(())
    } else {
        Err(NodeError::InvalidArgument(format!(
            "checkpoint id {id:?} is not ck- followed by 20 lowercase hex digits"
        )))
    }
}

/// Everything a node needs to create a sandbox. The server has validated ranges and filled
/// defaults; the node still refuses what it cannot honour.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// `lo`. `Allow`: the node sets the sandbox's namespace up (veth, nftables, DNS filter)
    /// before the sandbox's own processes start.
    pub network: NetworkPolicy,
    /// OCI runtime of a `container` sandbox (`runc`, `crun`, `runsc`); `None` = the node's
    /// default. Ignored by other backends.
    pub runtime: Option<String>,
}

/// What the node knows about a sandbox it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxStatus {
    /// Sandbox id.
    pub id: String,
    /// Isolation level.
    pub backend: Backend,
    /// Whether its processes are alive: [`Liveness::Dead`] only on evidence they are
    /// gone, [`Liveness::Unknown`] when the node could not tell (an error of its own).
    pub liveness: Liveness,
}

/// Node facts shown by the server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// A file's bytes in chunks (uploads into [`Node::write_file_stream`], downloads out of
/// [`Node::read_file_stream`]). An `Err` item means the bytes broke off: the consumer
/// must not take what came before it as the whole file.
pub type ByteStream = std::pin::Pin<
    Box<dyn futures_core::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static>,
>;

/// Size in bytes of the chunks that streamed file calls hand out (256 KiB): the memory a
/// streamed read or write holds per chunk in flight.
pub const STREAM_CHUNK: usize = 256 << 10;

/// The next item of `s` (a `StreamExt::next` without the `futures` dependency).
pub async fn next_chunk(s: &mut ByteStream) -> Option<std::io::Result<bytes::Bytes>> {
    std::future::poll_fn(|cx| s.as_mut().poll_next(cx)).await
}

/// The whole of `body`, failing with `InvalidArgument` past `max_bytes` (before the bytes
/// over it are kept) or when it broke off. `path` names the file in messages.
///
/// # Errors
/// `InvalidArgument` ("over N bytes", "upload broke off").
pub async fn collect_stream(
    mut body: ByteStream,
    max_bytes: u64,
    path: &str,
) -> NodeResult<bytes::Bytes> {
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        let chunk = chunk.map_err(|e| broke_off(path, &e))?;
        if (buf.len() + chunk.len()) as u64 > max_bytes {
            return Err(over_limit(path, max_bytes));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// `InvalidArgument` of an upload to `path` over `max_bytes` (the wording every node uses).
pub fn over_limit(path: &str, max_bytes: u64) -> NodeError {
    NodeError::InvalidArgument(format!(
        "data is over {max_bytes} bytes; limit {max_bytes}: {path}"
    ))
}

/// `InvalidArgument` of an upload to `path` whose body broke off with `e`.
pub fn broke_off(path: &str, e: &std::io::Error) -> NodeError {
    NodeError::InvalidArgument(format!("upload broke off, nothing written to {path}: {e}"))
}

/// `data` as a [`ByteStream`] of [`STREAM_CHUNK`]-byte slices (no copies).
pub fn chunked(data: bytes::Bytes) -> ByteStream {
    let mut off = 0;
    Box::pin(futures_core_iter(move || {
        if off >= data.len() {
            return None;
        }
        let end = (off + STREAM_CHUNK).min(data.len());
        let c = data.slice(off..end);
        off = end;
        Some(Ok(c))
    }))
}

/// The chunks sent into `rx`, as a [`ByteStream`] (ends when every sender is gone).
pub fn from_receiver(rx: mpsc::Receiver<std::io::Result<bytes::Bytes>>) -> ByteStream {
    struct Rx(mpsc::Receiver<std::io::Result<bytes::Bytes>>);
    impl futures_core::Stream for Rx {
        type Item = std::io::Result<bytes::Bytes>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            self.0.poll_recv(cx)
        }
    }
    Box::pin(Rx(rx))
}

/// A stream whose items come from `f` until it answers `None`.
fn futures_core_iter<T, F: FnMut() -> Option<T> + Unpin>(
    f: F,
) -> impl futures_core::Stream<Item = T> {
    struct FromFn<F>(F);
    impl<T, F: FnMut() -> Option<T> + Unpin> futures_core::Stream for FromFn<F> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready((self.0)())
        }
    }
    FromFn(f)
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
    /// The call did not reach the node or its answer did not come back (connection
    /// refused or reset, a remote node's timeout): **the outcome is unknown**. Retryable
    /// (an idempotent call may be sent again; a create with the same id is answered from
    /// the node's own state). Never evidence that a sandbox is gone: callers must not turn
    /// it into `lost` (only [`Liveness::Dead`] from a node that answered does that).
    #[error("node transport failed, outcome unknown: {0}")]
    Transport(String),
    /// Host-side failure (mount, cgroup, spawn), with the path or step in the message.
    #[error("{context}")]
    Internal {
        /// What failed, with the path (a module error's message: `write "1" to
        /// /sys/fs/cgroup/…/pids.max`).
        context: String,
        /// Cause (an `io::Error`, a QMP or OCI runtime answer), when there is one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// An operation failed, and so did the cleanup (rollback) that was to leave nothing
    /// half-created behind. The wire code is `error`'s; the message names both (so
    /// neither is a `source`: [`chain`] of each is what [`NodeError::to_wire`] sends).
    #[error("{error}; cleanup also failed: {cleanup}")]
    CleanupFailed {
        /// The original failure.
        error: Box<NodeError>,
        /// The failure of the cleanup that followed.
        cleanup: Box<NodeError>,
    },
}

impl NodeError {
    /// Wrap an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        NodeError::Internal {
            context: context.into(),
            source: Some(Box::new(source)),
        }
    }

    /// An `Internal` error of a module error type (`CgroupError`, `QmpError`, …):
    /// `context` is its message, `source` its own cause (so a walk of the source chain
    /// names each step once).
    pub fn internal(
        context: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        NodeError::Internal {
            context: context.into(),
            source,
        }
    }

    /// `error`, unless `cleanup` failed too: then [`NodeError::CleanupFailed`] with both
    /// (the wire code stays `error`'s).
    pub fn with_cleanup(self, cleanup: NodeResult<()>) -> Self {
        match cleanup {
            Ok(()) => self,
            Err(c) => NodeError::CleanupFailed {
                error: Box::new(self),
                cleanup: Box::new(c),
            },
        }
    }

    /// The original failure: `self`, or for [`NodeError::CleanupFailed`] the error whose
    /// cleanup failed.
    pub fn original(&self) -> &NodeError {
        match self {
            NodeError::CleanupFailed { error, .. } => error.original(),
            e => e,
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
            NodeError::Transport(_) => ErrorCode::Unavailable,
            NodeError::Internal { .. } => ErrorCode::Internal,
            NodeError::CleanupFailed { error, .. } => error.code(),
        }
    }

    /// Whether sending the call again may succeed without any change by the caller: a
    /// transport failure, an unavailable node, or a node at capacity.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.original(),
            NodeError::Transport(_) | NodeError::Unavailable(_) | NodeError::ResourceExhausted(_)
        )
    }

    /// The wire shape of this error, for a remote node API.
    pub fn to_wire(&self) -> WireError {
        let kind = match self.original() {
            NodeError::NotFound(_) => "not_found",
            NodeError::InvalidArgument(_) => "invalid_argument",
            NodeError::Unavailable(_) => "unavailable",
            NodeError::ResourceExhausted(_) => "resource_exhausted",
            NodeError::Conflict(_) => "conflict",
            NodeError::DeadlineExceeded(_) => "deadline_exceeded",
            NodeError::PermissionDenied(_) => "permission_denied",
            NodeError::Transport(_) => "transport",
            NodeError::Internal { .. } => "internal",
            NodeError::CleanupFailed { .. } => unreachable!("original() unwraps it"),
        };
        let message = match self {
            NodeError::Internal { .. } => chain(self),
            NodeError::CleanupFailed { error, cleanup } => format!(
                "{}; cleanup also failed: {}",
                error.to_wire().message,
                cleanup.to_wire().message
            ),
            NodeError::Transport(m)
            | NodeError::NotFound(m)
            | NodeError::InvalidArgument(m)
            | NodeError::Unavailable(m)
            | NodeError::ResourceExhausted(m)
            | NodeError::Conflict(m)
            | NodeError::DeadlineExceeded(m)
            | NodeError::PermissionDenied(m) => m.clone(),
        };
        WireError {
            kind: kind.into(),
            message,
        }
    }

    /// The error a [`WireError`] carries. An unknown `kind` (a newer node) is `Internal`
    /// with the kind in the message; `internal` comes back as `Internal` whose context is
    /// the message (the node's context and cause) and whose source says "on the node".
    pub fn from_wire(w: WireError) -> NodeError {
        let m = w.message;
        match w.kind.as_str() {
            "not_found" => NodeError::NotFound(m),
            "invalid_argument" => NodeError::InvalidArgument(m),
            "unavailable" => NodeError::Unavailable(m),
            "resource_exhausted" => NodeError::ResourceExhausted(m),
            "conflict" => NodeError::Conflict(m),
            "deadline_exceeded" => NodeError::DeadlineExceeded(m),
            "permission_denied" => NodeError::PermissionDenied(m),
            "transport" => NodeError::Transport(m),
            "internal" => NodeError::internal(m, Some("on the node".into())),
            other => NodeError::internal(
                format!("node error of unknown kind {other:?}"),
                Some(m.into()),
            ),
        }
    }
}

/// `e` and each of its sources, joined by `": "` (what a log line or a remote client
/// should see of an `Internal` error).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A [`NodeError`] on the wire of a remote node API: `{"kind": "not_found", "message": …}`.
/// `kind` is the variant in snake case (the [`ErrorCode`] names, plus `transport`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    /// The variant: `not_found`, `invalid_argument`, `unavailable`, `resource_exhausted`,
    /// `conflict`, `deadline_exceeded`, `permission_denied`, `transport`, `internal`.
    pub kind: String,
    /// Human-readable message (for `internal`: the context and its cause).
    pub message: String,
}

/// Result of node operations.
pub type NodeResult<T> = Result<T, NodeError>;

/// Where a streamed exec sends its chunks (stdout/stderr events only; the final result is
/// the return value of [`Node::exec`]). A closed receiver does not stop the exec.
pub type ExecSink = mpsc::Sender<ExecEvent>;

/// Live control of a running exec, for background processes (`sandlot_node::processes`): stdin
/// that stays open and signals.
#[derive(Debug)]
pub struct ExecControl {
    /// Stdin chunks sent after the request's own `stdin_b64`; the command's stdin closes
    /// (EOF) when every sender is dropped. `None`: stdin is `stdin_b64` alone (or
    /// `/dev/null`).
    pub stdin: Option<mpsc::Receiver<bytes::Bytes>>,
    /// Signals to deliver, Linux numbers: SIGKILL (9) ends the whole process tree; the
    /// others the guest agent forwards (`sandlot_guest::spec::FORWARDED_SIGNALS`) go to the
    /// command's process group. Other numbers are ignored (the caller validates).
    pub signals: mpsc::UnboundedReceiver<i32>,
    /// A name for the exec, unique on the node (the guest agent's exec handle).
    pub handle: String,
    /// Opaque JSON kept with the exec where a guest agent runs it (its exec table, at most
    /// `sandlot_guest::agent_proto::MAX_LABELS_BYTES`) and given back in
    /// [`AgentExec::labels`]: what `sandlot_node::processes` needs to list a re-found
    /// process as it was started (`tag`, `meta`, `number`). Not carried by
    /// `sandlot-node-remote` (its processes live in the node itself). `None`: nothing will
    /// forget the exec later ([`Node::agent_forget`]), so the agent is told to forget it
    /// as soon as its end has been read.
    pub labels: Option<serde_json::Value>,
}

/// A background exec a sandbox's guest agent still holds ([`Node::agent_execs`]): started
/// by this node's previous process (before its restart or kill -9), or by another node
/// before a paused sandbox moved here, and not yet forgotten ([`Node::agent_forget`]):
/// running, or ended (whether or not a node read its end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentExec {
    /// Its handle ([`ExecControl::handle`]: the background process's id).
    pub handle: String,
    /// Its argv.
    pub argv: Vec<String>,
    /// When it started, milliseconds since the Unix epoch (the sandbox's clock).
    pub started_unix_ms: u64,
    /// `None` while running; its exit code once it ended.
    pub exit_code: Option<i32>,
    /// Its [`ExecControl::labels`]; `None` when none were given or its agent predates them.
    pub labels: Option<serde_json::Value>,
}

/// What [`Node::agent_execs`] answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentExecs {
    /// The execs the agent holds.
    pub execs: Vec<AgentExec>,
    /// The highest `number` label the agent ever held (deleted processes' included), so
    /// that new processes are numbered past it; `None` when none had one or the agent
    /// predates it.
    pub max_number: Option<u32>,
}

/// Reading an [`AgentExec`] again ([`Node::exec_reattach`]).
#[derive(Debug)]
pub struct ExecReattach {
    /// Its handle.
    pub handle: String,
    /// Signals to deliver, as [`ExecControl::signals`].
    pub signals: mpsc::UnboundedReceiver<i32>,
    /// Gets, before any output reaches the sink, the offsets within the exec's whole
    /// stdout and stderr at which that output starts (what the agent still held: the
    /// bytes before are lost).
    pub offsets: tokio::sync::oneshot::Sender<(u64, u64)>,
}

/// A full-duplex byte stream to a TCP port inside a sandbox ([`Node::connect_port`]):
/// what is written reaches the sandbox's listener as a TCP client's bytes would, and what
/// it sends comes back. Shutting down the write half half-closes the TCP connection;
/// dropping the stream closes it.
pub trait PortStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> PortStream for T {}

/// How the message of [`NodeError::Unavailable`] from [`Node::connect_port`] starts when
/// the sandbox is fine but nothing listens on the port (connection refused inside it, or
/// no accept in time): the server answers 502 for it instead of 503.
pub const PORT_NOT_LISTENING: &str = "nothing listens on port";

/// A boxed [`PortStream`].
pub type PortConn = Box<dyn PortStream>;

/// The output of a background process as [`ProcessEvent`]s ([`Node::process_output`]):
/// chunks from the cursor's offsets, `skipped` where output fell out of what is retained,
/// then `exit` (or `error`) once it ended. Dropping it stops the reading, not the process.
pub type ProcessEvents =
    std::pin::Pin<Box<dyn futures_core::Stream<Item = ProcessEvent> + Send + 'static>>;

/// Where a reader of a background process's output starts ([`Node::process_output`]):
/// byte offsets into each stream (a reconnecting client passes the offsets it reached, so
/// it reads on from there), and whether to keep streaming until the process ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputCursor {
    /// First stdout byte wanted (absolute offset in the stream; default 0).
    #[serde(default)]
    pub stdout_offset: u64,
    /// First stderr byte wanted (absolute offset in the stream; default 0).
    #[serde(default)]
    pub stderr_offset: u64,
    /// Keep streaming until the process ends (default false: what is retained now).
    #[serde(default)]
    pub follow: bool,
}

/// Calls of one [`Node::pause_many`] / [`Node::resume_many`] that the default (and a
/// real node) runs at once: each is a cgroup freezer write or a QMP command, so a few
/// dozen in flight keep the node's threads busy without a burst of thousands.
pub const BULK_CONCURRENCY: usize = 32;

/// Most ids one [`Node::pause_many`] / [`Node::resume_many`] call carries over the remote
/// node API (4,096; a server sends a pause by label to each node in chunks far below it).
pub const BULK_MAX_IDS: usize = 4096;

/// Runs `calls` (one per id of a bulk call, not started yet), [`BULK_CONCURRENCY`] at a
/// time; their results in the order of `calls`.
pub async fn bulk<Fut>(calls: Vec<Fut>) -> Vec<NodeResult<()>>
where
    Fut: std::future::Future<Output = NodeResult<()>>,
{
    use futures_util::StreamExt;
    futures_util::stream::iter(calls)
        .buffered(BULK_CONCURRENCY)
        .collect()
        .await
}

fn no_processes<T>() -> NodeResult<T> {
    Err(NodeError::Unavailable(
        "background processes are not supported by this node".into(),
    ))
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
    /// (`sandlot_node::processes::ProcessTable`).
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

    /// Write a file atomically from a stream of chunks (temp file in the target's directory,
    /// fsync, rename; parents created), holding only a few chunks in memory at a time;
    /// answers the bytes written.
    ///
    /// The body is complete only when `body` ends (`None`): a chunk that is an `Err` (the
    /// client broke off), or this future dropped before the end, leaves the target as it
    /// was and no temp file behind. More than `max_bytes` bytes fail as soon as they are
    /// seen, with nothing written. The default collects the body (bounded by `max_bytes`)
    /// and calls [`Node::write_file`]; nodes that can stream override it.
    ///
    /// # Errors
    /// As [`Node::write_file`]; `InvalidArgument` when the body is over `max_bytes`
    /// ("over N bytes") or broke off ("upload broke off").
    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        let data = collect_stream(body, max_bytes, path).await?;
        let n = data.len() as u64;
        self.write_file(id, path, data).await?;
        Ok(n)
    }

    /// Read a file as a stream of chunks (at most `max_bytes` bytes; a file over it, or one
    /// growing past it while read, fails). Errors found before the first byte (missing,
    /// not a regular file, over `max_bytes`) are the call's; later ones end the stream with
    /// an `Err` item (so a consumer that sees the stream end without one has every byte).
    /// The default reads the whole file with [`Node::read_file`] and hands it out in
    /// [`STREAM_CHUNK`]-byte chunks; nodes that can stream override it.
    ///
    /// # Errors
    /// As [`Node::read_file`].
    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<ByteStream> {
        let data = self.read_file(id, path, max_bytes).await?;
        Ok(chunked(bytes::Bytes::from(data)))
    }

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

    /// [`Node::pause`] of every id of `ids` in one call (a pause by label: one call per
    /// node per chunk). Answers one result per id, in the order of `ids`; a failed id does
    /// not stop or fail the others. At most [`BULK_MAX_IDS`] ids make sense per call (the
    /// remote node API refuses more). The default pauses the ids one by one through
    /// [`Node::pause`], [`BULK_CONCURRENCY`] at a time; nodes that can do better (one
    /// request over the wire, one lock for all) override it.
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        bulk(ids.iter().map(|id| self.pause(id)).collect()).await
    }

    /// [`Node::resume`] of every id of `ids` in one call; per-id results in order, as
    /// [`Node::pause_many`] (and the same default: [`Node::resume`] per id,
    /// [`BULK_CONCURRENCY`] at a time).
    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        bulk(ids.iter().map(|id| self.resume(id)).collect()).await
    }

    /// Takes over sandbox `id` from the node's shared snapshot store (cluster mode's
    /// cross-node resume, `sandlot node --snapshot-dir`): the snapshot a pause with memory
    /// wrote there on another node (memory and device state, the writable disk, the image
    /// disk it was running on) is claimed, restored here and resumed with the same id; the
    /// snapshot is removed from the store once the sandbox runs. Only for a sandbox whose
    /// own node is gone (or cannot take it back): the caller must not resume it there too.
    ///
    /// # Errors
    /// `NotFound` when the store holds no snapshot of `id` (or this node has no store: the
    /// default); `Conflict` when another node claimed it first or `id` already runs here;
    /// `Unavailable` when this node cannot run it (backend, accelerator); `Internal` for a
    /// restore that failed (the snapshot is put back for another try).
    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        Err(NodeError::NotFound(format!(
            "no shared snapshot of sandbox {id}: this node has no snapshot store"
        )))
    }

    /// Kill every process of the sandbox and remove all its host resources (mounts,
    /// cgroups, directories). Idempotent: an unknown id is not an error.
    async fn delete(&self, id: &str) -> NodeResult<()>;

    /// Sandboxes this node has (alive or not).
    async fn list(&self) -> NodeResult<Vec<SandboxStatus>>;

    /// The sandboxes of [`Node::list`] whose liveness is not [`Liveness::Alive`] (dead, or
    /// the node cannot tell): what a server's reaper asks every node each pass, without
    /// moving every live sandbox's status each time. Default: `list`, filtered.
    async fn list_not_alive(&self) -> NodeResult<Vec<SandboxStatus>> {
        let mut all = self.list().await?;
        all.retain(|s| !s.liveness.is_alive());
        Ok(all)
    }

    /// After a restart: find sandboxes left running by the previous process from on-disk
    /// state, adopt those whose id is in `keep` and alive, and delete every other one
    /// (half-created or unknown leftovers). Returns the ids adopted. A leftover that cannot
    /// be removed is logged and left for the next start, not an error.
    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>>;

    /// Checkpoint sandbox `id`'s writable layer as checkpoint `checkpoint_id` (`ck-` + 20
    /// hex digits, chosen by the server) on this node's disk (`sandlot_node::checkpoints`); the
    /// sandbox keeps running (its processes are frozen during the copy).
    ///
    /// # Errors
    /// `NotFound` (sandbox); `InvalidArgument` (bad checkpoint id); `Conflict` (checkpoint
    /// exists, or the sandbox's state forbids it); `Unavailable` where the backend or node
    /// cannot checkpoint (the default); `Internal`.
    async fn checkpoint(&self, id: &str, checkpoint_id: &str) -> NodeResult<CheckpointMeta> {
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

    /// Open a TCP connection to `127.0.0.1:port` **inside** sandbox `id` (its own network
    /// namespace: the sandbox needs no network of its own and no policy), for ingress
    /// (`/v1/sandboxes/{id}/ports/{port}/…`, E2B's `<port>-<id>.<domain>`).
    ///
    /// # Errors
    /// `NotFound` (unknown or deleting sandbox); `Conflict` (paused, or its init is gone);
    /// `Unavailable` when nothing listens on the port (connection refused: the message
    /// says so) or the node or backend cannot reach sandbox ports (the default);
    /// `InvalidArgument` for port 0; `Internal`.
    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<PortConn> {
        let _ = (id, port);
        Err(NodeError::Unavailable(
            "reaching ports inside sandboxes is not supported by this node".into(),
        ))
    }

    /// Start a background process in sandbox `id` (the caller checked the sandbox runs):
    /// it lives on the node, not in the call, so any server reaching this node can read its
    /// output, wait for, signal, feed and remove it by its handle (`pr-` + 20 hex digits).
    /// Semantics, signals and bounds: `sandlot_node::processes`.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad request (the exec's checks, `timeout_s`,
    /// `max_output_bytes` over 16 MiB, a bad `pty` size); `ResourceExhausted` at the
    /// per-sandbox limit of running processes or when the output cannot be kept; the
    /// exec's own refusal (`NotFound`, `Conflict` for a paused sandbox); `Unavailable` where
    /// the node has no process table (the default).
    async fn process_spawn(&self, id: &str, req: SpawnRequest) -> NodeResult<Process> {
        let _ = (id, req);
        no_processes()
    }

    /// The background processes of sandbox `id`, oldest first (empty for a sandbox with
    /// none, known or not).
    ///
    /// # Errors
    /// `Unavailable` where the node has no process table (the default).
    async fn process_list(&self, id: &str) -> NodeResult<Vec<Process>> {
        let _ = id;
        no_processes()
    }

    /// The record of process `pid` of sandbox `id`.
    ///
    /// # Errors
    /// `NotFound` for an unknown handle (or one of another sandbox); `Unavailable` (the
    /// default).
    async fn process_get(&self, id: &str, pid: &str) -> NodeResult<Process> {
        let _ = (id, pid);
        no_processes()
    }

    /// The output of process `pid` from `cursor`'s offsets ([`ProcessEvents`]): without
    /// `follow` what is retained now (and `exit` if it ended), with `follow` until it ends.
    ///
    /// # Errors
    /// `NotFound` (unknown handle); `InvalidArgument` for an offset past the bytes written
    /// so far; `Unavailable` (the default).
    async fn process_output(
        &self,
        id: &str,
        pid: &str,
        cursor: OutputCursor,
    ) -> NodeResult<ProcessEvents> {
        let _ = (id, pid, cursor);
        no_processes()
    }

    /// Waits until process `pid` ends or `timeout` passes, then answers its record (still
    /// `running` after a timeout, which is not an error).
    ///
    /// # Errors
    /// `NotFound` (unknown handle); `Unavailable` (the default).
    async fn process_wait(
        &self,
        id: &str,
        pid: &str,
        timeout: std::time::Duration,
    ) -> NodeResult<Process> {
        let _ = (id, pid, timeout);
        no_processes()
    }

    /// Sends Linux signal number `signal` (validated by the caller) to process `pid`:
    /// SIGKILL ends its whole tree, others go to its process group.
    ///
    /// # Errors
    /// `NotFound` (unknown handle); `Conflict` when it already ended; `Unavailable` (the
    /// default).
    async fn process_signal(&self, id: &str, pid: &str, signal: i32) -> NodeResult<()> {
        let _ = (id, pid, signal);
        no_processes()
    }

    /// Writes `data` to the stdin of process `pid`, then closes its stdin when `eof`.
    ///
    /// # Errors
    /// `NotFound` (unknown handle); `Conflict` when its stdin is not open;
    /// `DeadlineExceeded` when it has not read its stdin for 10 s; `Unavailable` (the
    /// default).
    async fn process_stdin(
        &self,
        id: &str,
        pid: &str,
        data: bytes::Bytes,
        eof: bool,
    ) -> NodeResult<()> {
        let _ = (id, pid, data, eof);
        no_processes()
    }

    /// Resizes the terminal of process `pid` (started with `pty`).
    ///
    /// # Errors
    /// `NotFound` (unknown handle); `InvalidArgument` (no terminal, size out of range);
    /// `Conflict` when it ended; `DeadlineExceeded`; `Unavailable` (the default).
    async fn process_resize(&self, id: &str, pid: &str, size: PtySize) -> NodeResult<()> {
        let _ = (id, pid, size);
        no_processes()
    }

    /// Kills the whole tree of process `pid` (SIGKILL), waits a few seconds at most for it
    /// to end, and forgets its handle.
    ///
    /// # Errors
    /// `NotFound` (unknown handle); `Unavailable` (the default).
    async fn process_remove(&self, id: &str, pid: &str) -> NodeResult<()> {
        let _ = (id, pid);
        no_processes()
    }

    /// The background execs sandbox `id`'s guest agent still holds (issue 25): what
    /// [`Node::exec_reattach`] can take up after this node's process restarted. Empty
    /// where there is no agent, or one too old to keep them (the default).
    ///
    /// # Errors
    /// `NotFound` (no such sandbox), `Conflict` (paused or not running), `Internal` (the
    /// agent cannot be reached or fails).
    async fn agent_execs(&self, id: &str) -> NodeResult<AgentExecs> {
        let _ = id;
        Ok(AgentExecs::default())
    }

    /// Makes sandbox `id`'s guest agent forget the background exec `handle` (its process
    /// record was deleted or evicted), so a later [`Node::agent_execs`] no longer lists
    /// it. Unknown handles, no agent, and agents too old to keep ended execs are fine
    /// (the default does nothing).
    ///
    /// # Errors
    /// `NotFound` (no such sandbox), `Conflict` (paused or not running), `Internal` (the
    /// agent cannot be reached or fails).
    async fn agent_forget(&self, id: &str, handle: &str) -> NodeResult<()> {
        let _ = (id, handle);
        Ok(())
    }

    /// Takes up an [`AgentExec`] of sandbox `id` as [`Node::exec_controlled`] runs one:
    /// output from where the agent's ring starts (see [`ExecReattach::offsets`]) to `sink`,
    /// signals delivered, the result at its end (at once for one that already ended).
    ///
    /// # Errors
    /// `NotFound` (no such sandbox or exec), `Conflict` (another node reads it), as
    /// [`Node::exec_controlled`] otherwise; `Unavailable` where the node cannot (the
    /// default).
    async fn exec_reattach(
        &self,
        id: &str,
        sink: Option<ExecSink>,
        reattach: ExecReattach,
    ) -> NodeResult<ExecResult> {
        let _ = (id, sink, reattach);
        Err(NodeError::Unavailable(
            "re-attaching background execs is not supported by this node".into(),
        ))
    }

    /// The accelerator (`"kvm"` or `"tcg"`) microvm and vm sandboxes get on this node,
    /// waiting for the start-up probe if it is still running; `None` on a node without a
    /// QEMU backend.
    async fn accel(&self) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn streams_chunk_collect_and_refuse_over_the_limit() {
        let data = bytes::Bytes::from(vec![7u8; STREAM_CHUNK * 2 + 5]);
        let mut s = chunked(data.clone());
        let mut sizes = Vec::new();
        while let Some(c) = next_chunk(&mut s).await {
            sizes.push(c.unwrap().len());
        }
        assert_eq!(sizes, [STREAM_CHUNK, STREAM_CHUNK, 5]);
        let n = data.len() as u64;
        assert_eq!(
            collect_stream(chunked(data.clone()), n, "/f")
                .await
                .unwrap(),
            data
        );
        let e = collect_stream(chunked(data.clone()), n - 1, "/f")
            .await
            .unwrap_err();
        assert!(
            matches!(e, NodeError::InvalidArgument(ref m) if m.contains("over")),
            "{e}"
        );
        let (tx, rx) = mpsc::channel(2);
        tx.send(Ok(bytes::Bytes::from_static(b"ab"))).await.unwrap();
        tx.send(Err(std::io::Error::other("gone"))).await.unwrap();
        drop(tx);
        let e = collect_stream(from_receiver(rx), 10, "/f")
            .await
            .unwrap_err();
        assert!(e.to_string().contains("broke off"), "{e}");
    }

    #[test]
    fn every_error_crosses_the_wire_with_its_kind_and_message() {
        let errors = [
            NodeError::NotFound("no sandbox sb-1".into()),
            NodeError::InvalidArgument("bad path".into()),
            NodeError::Unavailable("backend vm".into()),
            NodeError::ResourceExhausted("full".into()),
            NodeError::Conflict("paused".into()),
            NodeError::DeadlineExceeded("stdin".into()),
            NodeError::PermissionDenied("read".into()),
            NodeError::Transport("reset".into()),
            NodeError::io("mount /x", std::io::Error::other("EBUSY")),
        ];
        for e in errors {
            let json = serde_json::to_string(&e.to_wire()).unwrap();
            let back = NodeError::from_wire(serde_json::from_str(&json).unwrap());
            assert_eq!(back.code(), e.code(), "{json}");
            if matches!(e, NodeError::Internal { .. }) {
                // The node's context and cause, as one context here.
                assert_eq!(back.to_string(), "mount /x: EBUSY");
            } else {
                assert_eq!(back.to_wire(), e.to_wire(), "{json}");
            }
        }
        let w = NodeError::io("mount /x", std::io::Error::other("EBUSY")).to_wire();
        assert_eq!(
            (w.kind.as_str(), w.message.as_str()),
            ("internal", "mount /x: EBUSY")
        );
        let newer = NodeError::from_wire(WireError {
            kind: "brand_new".into(),
            message: "m".into(),
        });
        assert_eq!(newer.code(), ErrorCode::Internal);
        assert!(newer.to_string().contains("brand_new"), "{newer}");
    }

    #[test]
    fn a_failed_cleanup_keeps_both_errors_and_the_original_code() {
        let orig = NodeError::ResourceExhausted("disk full".into());
        assert!(matches!(
            NodeError::ResourceExhausted("x".into()).with_cleanup(Ok(())),
            NodeError::ResourceExhausted(_)
        ));
        let e = orig.with_cleanup(Err(NodeError::io(
            "remove cgroup /sys/fs/cgroup/sandlot/sb-1",
            std::io::Error::from_raw_os_error(libc_ebusy()),
        )));
        assert_eq!(e.code(), ErrorCode::ResourceExhausted);
        assert!(e.is_retryable());
        assert!(matches!(e.original(), NodeError::ResourceExhausted(_)));
        let shown = e.to_string();
        assert!(
            shown.starts_with("disk full; cleanup also failed: remove cgroup"),
            "{shown}"
        );
        let w = e.to_wire();
        assert_eq!(w.kind, "resource_exhausted");
        assert!(
            w.message
                .ends_with("sb-1: Device or resource busy (os error 16)"),
            "{}",
            w.message
        );
        let back = NodeError::from_wire(w.clone());
        assert_eq!(back.code(), ErrorCode::ResourceExhausted);
        assert_eq!(back.to_string(), w.message);
    }

    fn libc_ebusy() -> i32 {
        16
    }

    #[test]
    fn transport_is_unavailable_and_retryable_but_not_found_is_not() {
        let t = NodeError::Transport("reset".into());
        assert_eq!(t.code(), ErrorCode::Unavailable);
        assert!(t.is_retryable());
        assert!(t.to_string().contains("outcome unknown"));
        assert!(!NodeError::NotFound("x".into()).is_retryable());
    }

    #[test]
    fn contract_types_round_trip_through_json() {
        let spec = SandboxSpec {
            id: "sb-0123456789abcdef0123".into(),
            backend: Backend::Container,
            image: "python".into(),
            cpu: 0.5,
            memory_mib: 256,
            disk_mib: 1024,
            pids_max: 64,
            env: [("A".to_string(), "1".to_string())].into(),
            network: NetworkPolicy::None,
            runtime: Some("runsc".into()),
        };
        let back: SandboxSpec =
            serde_json::from_str(&serde_json::to_string(&spec).unwrap()).unwrap();
        assert_eq!(back, spec);
        let st = SandboxStatus {
            id: spec.id.clone(),
            backend: Backend::Function,
            liveness: Liveness::Unknown("EMFILE".into()),
        };
        let back: SandboxStatus =
            serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
        assert_eq!(back, st);
        assert!(check_checkpoint_id("ck-0123456789abcdef0123").is_ok());
        assert!(check_checkpoint_id("ck-0123456789ABCDEF0123").is_err());
    }
}
