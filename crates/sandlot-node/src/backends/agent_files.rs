//! The file operations of every sandbox whose files are served by its guest agent
//! (`sandlot-guest agent`: `container`, `microvm`, `vm`), written once.
//!
//! A backend says which sandbox a call goes to and checks that it may be served now
//! ([`AgentFiles::file_agent`]: known, not being deleted, not paused, its init or VMM
//! alive); the seven operations ([`AgentFiles::read_file`] … [`AgentFiles::make_dir`]) are
//! the agent's calls of the container agent protocol (`crate::agent_client`), their errors
//! mapped by [`crate::files::node_error`]. [`super::SandboxBackend`]'s file methods call
//! them through [`super::SandboxBackend::agent_files`].
use crate::agent_client::AgentClient;
use crate::files::{file_entry, node_error};
use crate::node::{NodeError, NodeResult};
use async_trait::async_trait;
use sandlot_api::FileEntry;
use std::sync::Arc;

/// One sandbox that holds a connected guest agent.
pub trait HoldsAgent: Send + Sync {
    /// Its agent (one connection, shared by every call on the sandbox).
    fn agent(&self) -> &AgentClient;
}

/// A backend whose sandboxes' files are served by their guest agents.
#[async_trait]
pub trait AgentFiles: Send + Sync {
    /// The sandbox a file call on `id` goes to, held for the call.
    ///
    /// # Errors
    /// `NotFound` (unknown or being deleted), `Conflict` (paused, or its init / VMM is gone).
    async fn file_agent(&self, id: &str) -> NodeResult<Arc<dyn HoldsAgent>>;

    /// The bytes of the file at `path` (absolute, or relative to `/workspace`), at most
    /// `max_bytes` of them.
    ///
    /// # Errors
    /// As [`Self::file_agent`]; the agent's (`NotFound`, `InvalidArgument` for a file over
    /// `max_bytes` or a bad path, `Internal`).
    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        let s = self.file_agent(id).await?;
        let r = s.agent().read_file(path, max_bytes).await;
        settled(self, id, r.map_err(node_error)).await
    }

    /// The size in bytes of the regular file at `path`.
    ///
    /// # Errors
    /// As [`Self::read_file`]; `InvalidArgument` for anything but a regular file.
    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        let s = self.file_agent(id).await?;
        let r = super::agent_exec::file_size(s.agent(), path).await;
        settled(self, id, r).await
    }

    /// Writes `data` to the file at `path` (created or replaced).
    ///
    /// # Errors
    /// As [`Self::read_file`].
    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()> {
        let s = self.file_agent(id).await?;
        let r = s.agent().write_file(path, &data, u64::MAX).await;
        settled(self, id, r.map_err(node_error)).await
    }

    /// Streams `body` to the file at `path` (created or replaced; at most `max_bytes`,
    /// enforced here and by the agent), answering the bytes sent.
    ///
    /// # Errors
    /// As [`Self::read_file`]; `InvalidArgument` over `max_bytes` or when the body broke
    /// off (the agent then drops its temp file).
    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        let s = self.file_agent(id).await?;
        let r = s.agent().write_file_stream(path, body, max_bytes).await;
        settled(self, id, r).await
    }

    /// The bytes of the file at `path` as a stream (at most `max_bytes`).
    ///
    /// # Errors
    /// As [`Self::read_file`], for what the agent answers before the first byte.
    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        let s = self.file_agent(id).await?;
        let r = s.agent().read_file_stream(path, max_bytes).await;
        settled(self, id, r.map_err(node_error)).await
    }

    /// The entries of the directory at `path`.
    ///
    /// # Errors
    /// As [`Self::read_file`].
    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        let s = self.file_agent(id).await?;
        let r = s.agent().list_dir(path).await;
        let v = settled(self, id, r.map_err(node_error)).await?;
        Ok(v.into_iter().map(file_entry).collect())
    }

    /// Removes the file or directory tree at `path`.
    ///
    /// # Errors
    /// As [`Self::read_file`].
    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        let s = self.file_agent(id).await?;
        let r = s.agent().remove(path).await;
        settled(self, id, r.map_err(node_error)).await
    }

    /// The facts of `path`.
    ///
    /// # Errors
    /// As [`Self::read_file`].
    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        let s = self.file_agent(id).await?;
        let r = s.agent().stat(path).await;
        settled(self, id, r.map(file_entry).map_err(node_error)).await
    }

    /// Creates the directory `path` (its missing parents too with `parents`).
    ///
    /// # Errors
    /// As [`Self::read_file`].
    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        let s = self.file_agent(id).await?;
        let r = s.agent().mkdir(path, parents).await;
        settled(self, id, r.map_err(node_error)).await
    }
}

/// `res` of an agent call on sandbox `id` of `files`, except that an `Internal` failure of
/// a sandbox that can no longer be served when it comes back (deleted, being deleted or
/// paused while the call ran: its agent went away under it) answers that reason instead,
/// as [`AgentFiles::file_agent`] gives it (`NotFound`, `Conflict`).
async fn settled<T, F: AgentFiles + ?Sized>(
    files: &F,
    id: &str,
    res: NodeResult<T>,
) -> NodeResult<T> {
    match res {
        Err(e @ NodeError::Internal { .. }) => Err(files.file_agent(id).await.err().unwrap_or(e)),
        r => r,
    }
}
