//! Isolation backends behind one narrow trait.
//!
//! [`SandboxBackend`] holds the operations every backend honours; [`AnyBackend`] is the enum
//! over the backends compiled into this node. A backend that is not built yet, or that the
//! host cannot run, is still listed ([`AnyBackend::Unavailable`]) and answers every call with
//! `NodeError::Unavailable` and the reason, instead of vanishing.
mod agent_exec;
pub mod agent_files;
pub mod container;
mod exec_plan;
pub mod function;
pub mod gvisor_audit;
mod pause;
pub mod pool;
pub mod qemu;
pub mod saved;
mod spawn;
pub mod uids;

use crate::checkpoints::{Captured, Checkpoint};
use crate::images::Image;
use crate::node::{ExecControl, ExecSink, NodeError, NodeResult, SandboxSpec, SandboxStatus};
use agent_files::AgentFiles;
use async_trait::async_trait;
use sandlot_api::{Backend, ExecRequest, ExecResult, FileEntry};
use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::{watch, RwLock};

/// Ids become path components and cgroup names: only `[A-Za-z0-9_-]`, 1–64 chars.
pub(crate) fn check_id(id: &str) -> NodeResult<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(NodeError::InvalidArgument(format!(
            "bad sandbox id {id:?}: expected 1-64 of [A-Za-z0-9_-]"
        )))
    }
}

/// Where one exec's output goes ([`ExecSink`], `None`: only the result) and, for
/// [`crate::Node::exec_controlled`], what steers it while it runs ([`ExecControl`]: stdin,
/// signals). `ExecIo::default()`: neither.
#[derive(Default)]
pub struct ExecIo {
    /// Receives the output as it comes.
    pub sink: Option<ExecSink>,
    /// Stdin and signals while the command runs.
    pub control: Option<ExecControl>,
}

/// Operations of one backend. Every sandbox id belongs to exactly one backend.
#[async_trait]
pub trait SandboxBackend: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> Backend;

    /// Create and start sandbox `spec` from `image`, its writable layer seeded from `seed`
    /// when given (a fork of a checkpoint); on error nothing is left behind.
    async fn create(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<()>;

    /// True when this backend runs sandbox `id`.
    fn has(&self, id: &str) -> bool;

    /// Run a command (see [`crate::Node::exec`]); with `io.control`, stdin streams and
    /// signals reach it (see [`crate::Node::exec_controlled`]).
    async fn exec(&self, id: &str, req: &ExecRequest, io: ExecIo) -> NodeResult<ExecResult>;

    /// The agent-backed file operations of this backend, where its sandboxes' files are
    /// served by their guest agents: the seven file methods below default to them. `None`
    /// (the default) for a backend that implements those methods itself.
    fn agent_files(&self) -> Option<&dyn AgentFiles> {
        None
    }

    /// Read a file inside the sandbox (`max_bytes` cap).
    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        files_of(self)?.read_file(id, path, max_bytes).await
    }

    /// Size of a regular file inside the sandbox (see [`crate::Node::file_size`]).
    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        files_of(self)?.file_size(id, path).await
    }

    /// Write a file inside the sandbox.
    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()> {
        files_of(self)?.write_file(id, path, data).await
    }

    /// Write a file from a stream (see [`crate::Node::write_file_stream`]): the agent's
    /// streamed write where the agent serves files; others override it.
    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        files_of(self)?
            .write_file_stream(id, path, body, max_bytes)
            .await
    }

    /// Read a file as a stream (see [`crate::Node::read_file_stream`]): the agent's
    /// streamed read where the agent serves files; others override it.
    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        files_of(self)?.read_file_stream(id, path, max_bytes).await
    }

    /// Write files in order, not durably (see [`crate::Node::write_files_volatile`]).
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

    /// List a directory inside the sandbox.
    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        files_of(self)?.list_dir(id, path).await
    }

    /// Remove a file or directory inside the sandbox.
    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        files_of(self)?.remove_file(id, path).await
    }

    /// Facts of one path inside the sandbox (see [`crate::Node::stat_file`]).
    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        files_of(self)?.stat_file(id, path).await
    }

    /// Create a directory inside the sandbox (see [`crate::Node::make_dir`]).
    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        files_of(self)?.make_dir(id, path, parents).await
    }

    /// Freeze every process of the sandbox (see [`crate::Node::pause`]).
    async fn pause(&self, id: &str) -> NodeResult<()>;

    /// Thaw a paused sandbox (see [`crate::Node::resume`]).
    async fn resume(&self, id: &str) -> NodeResult<()>;

    /// Take sandbox `id` over from the shared snapshot store (see
    /// [`crate::Node::adopt_snapshot`]); `NotFound` for backends that do not use it.
    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        Err(NodeError::NotFound(format!(
            "no shared snapshot of sandbox {id} for the {} backend",
            self.kind()
        )))
    }

    /// Kill and remove a sandbox and every host resource of it; unknown ids are fine.
    async fn delete(&self, id: &str) -> NodeResult<()>;

    /// Sandboxes of this backend.
    fn list(&self) -> Vec<SandboxStatus>;

    /// Re-adopt sandboxes in `keep` found alive on disk, clean up every other leftover.
    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>>;

    /// The background execs sandbox `id`'s guest agent still holds (see
    /// [`crate::Node::agent_execs`]); none by default (no agent).
    async fn agent_execs(&self, id: &str) -> NodeResult<crate::node::AgentExecs> {
        let _ = id;
        Ok(Default::default())
    }

    /// Forgets one of them (see [`crate::Node::agent_forget`]); nothing by default.
    async fn agent_forget(&self, id: &str, handle: &str) -> NodeResult<()> {
        let _ = (id, handle);
        Ok(())
    }

    /// Takes up one of them (see [`crate::Node::exec_reattach`]); `Unavailable` by
    /// default.
    async fn exec_reattach(
        &self,
        id: &str,
        sink: Option<ExecSink>,
        reattach: crate::node::ExecReattach,
    ) -> NodeResult<ExecResult> {
        let _ = (id, sink, reattach);
        Err(NodeError::Unavailable(format!(
            "the {} backend cannot re-attach background execs",
            self.kind().as_str()
        )))
    }

    /// A TCP connection to `127.0.0.1:port` inside sandbox `id` (ingress, see
    /// [`crate::ports`]).
    ///
    /// # Errors
    /// As [`sandlot_node_api::Node::connect_port`]; `Unavailable` where the backend cannot
    /// (the default).
    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        let _ = (id, port);
        Err(NodeError::Unavailable(format!(
            "the {} backend cannot reach ports inside its sandboxes yet",
            self.kind()
        )))
    }

    /// Copy sandbox `id`'s writable layer into the empty directory `dest` (see
    /// [`crate::checkpoints`] for the layout per backend).
    ///
    /// # Errors
    /// `InvalidArgument` where the backend cannot checkpoint (the default: a request this
    /// sandbox can never satisfy, like a network policy on `function`); `NotFound`;
    /// `Conflict` when the sandbox's state forbids it; `Internal`.
    async fn checkpoint(&self, id: &str, dest: &Path) -> NodeResult<Captured> {
        let _ = (id, dest);
        Err(NodeError::InvalidArgument(format!(
            "the {} backend cannot checkpoint sandboxes",
            self.kind()
        )))
    }
}

/// The delete of every backend ([`SandboxBackend::delete`]) on its table of sandboxes
/// `table`: an id that can never have been created has nothing to delete (`Ok`); a sandbox
/// this process knows is marked being deleted (`deleting`'s write side: after the execs
/// that are setting up) and its running execs are stopped (`killed`, both from `flags`);
/// then `destroy` (given the sandbox, if known) removes what it has on the host, and only
/// when that succeeded does `id` leave `table` (a failed delete can be tried again). `kind`
/// names the backend in the log line of a deleted known sandbox.
///
/// # Errors
/// `destroy`'s.
pub(crate) async fn delete_from<T, F>(
    id: &str,
    kind: &str,
    table: &Mutex<HashMap<String, Arc<T>>>,
    flags: impl Fn(&T) -> (&RwLock<bool>, &watch::Sender<bool>),
    destroy: impl FnOnce(Option<Arc<T>>) -> F,
) -> NodeResult<()>
where
    F: Future<Output = NodeResult<()>>,
{
    if check_id(id).is_err() {
        return Ok(());
    }
    let known = table.lock().unwrap().get(id).cloned();
    if let Some(sb) = &known {
        let (deleting, killed) = flags(sb);
        *deleting.write().await = true;
        let _ = killed.send(true);
    }
    let was_known = known.is_some();
    let res = destroy(known).await;
    if res.is_ok() {
        table.lock().unwrap().remove(id);
        if was_known {
            tracing::info!(sandbox = %id, backend = kind, "sandbox deleted");
        }
    }
    res
}

/// `b`'s agent-backed file operations ([`SandboxBackend::agent_files`]).
///
/// # Errors
/// `Unavailable` for a backend without them that did not implement its file methods.
fn files_of<B: SandboxBackend + ?Sized>(b: &B) -> NodeResult<&dyn AgentFiles> {
    b.agent_files().ok_or_else(|| {
        NodeError::Unavailable(format!("the {} backend has no file operations", b.kind()))
    })
}

/// The backends compiled into this node.
pub enum AnyBackend {
    /// The namespace jail (`backend=function`).
    Function(function::FunctionBackend),
    /// OCI containers (`backend=container`).
    Container(container::ContainerBackend),
    /// QEMU microVMs (`backend=microvm`).
    Microvm(qemu::microvm::MicrovmBackend),
    /// QEMU q35 VMs (`backend=vm`).
    Vm(qemu::vm::VmBackend),
    /// A backend this node cannot run, with the reason.
    Unavailable {
        /// Which backend.
        kind: Backend,
        /// Why it cannot run here.
        why: String,
    },
}

impl AnyBackend {
    /// The backends that are not built yet, each with the issue that tracks it (none now;
    /// kept for the next one).
    pub fn not_built() -> Vec<AnyBackend> {
        Vec::new()
    }

    /// Which backend this is.
    pub fn kind(&self) -> Backend {
        match self {
            AnyBackend::Function(_) => Backend::Function,
            AnyBackend::Container(_) => Backend::Container,
            AnyBackend::Microvm(_) => Backend::Microvm,
            AnyBackend::Vm(_) => Backend::Vm,
            AnyBackend::Unavailable { kind, .. } => *kind,
        }
    }

    /// `Ok` when usable, else the reason.
    pub fn availability(&self) -> Result<(), String> {
        match self {
            AnyBackend::Function(_)
            | AnyBackend::Container(_)
            | AnyBackend::Microvm(_)
            | AnyBackend::Vm(_) => Ok(()),
            AnyBackend::Unavailable { why, .. } => Err(why.clone()),
        }
    }

    /// The backend's operations.
    ///
    /// # Errors
    /// `Unavailable` with the reason when this backend cannot run here.
    pub fn get(&self) -> NodeResult<&dyn SandboxBackend> {
        match self {
            AnyBackend::Function(f) => Ok(f),
            AnyBackend::Container(c) => Ok(c),
            AnyBackend::Microvm(m) => Ok(m),
            AnyBackend::Vm(v) => Ok(v),
            AnyBackend::Unavailable { why, .. } => Err(NodeError::Unavailable(why.clone())),
        }
    }
}

/// The guest's seccomp reports ([`sandlot_guest::spec::Violation`]) as wire
/// [`sandlot_api::Violation`]s (`layer` = `seccomp`).
pub fn violations_from_guest(
    v: Vec<sandlot_guest::spec::Violation>,
) -> Vec<sandlot_api::Violation> {
    v.into_iter()
        .map(|x| sandlot_api::Violation {
            layer: "seccomp".into(),
            syscall: x.syscall,
            nr: x.nr,
            pid: x.pid,
            time_unix_ms: x.time_unix_ms,
            ..Default::default()
        })
        .collect()
}

/// The end of a backend's `readopt`: leftovers that could not be removed (a process stuck
/// in the kernel, a busy mount) are logged at error level and tried again at the next
/// start, never returned as an error: one stuck leftover must not keep the node from
/// starting or make it forget the sandboxes it did re-adopt. Returns `adopted`.
pub(crate) fn readopt_done(backend: &str, adopted: Vec<String>, errors: &[String]) -> Vec<String> {
    if !errors.is_empty() {
        tracing::error!(
            backend,
            errors = %errors.join("; "),
            "re-adoption: leftovers not removed (retried at the next start)"
        );
    }
    adopted
}
