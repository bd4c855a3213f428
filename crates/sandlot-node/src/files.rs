//! File operations inside a sandbox, done from the host (the `function` backend).
//!
//! The path rules and the security model live in [`sandlot_guest::sandbox_fs`], shared with
//! the guest agent (which serves the same operations inside containers and VMs). This
//! module adapts them to the node: [`SandboxFs`] opens a sandbox root from the host —
//! normally `/proc/<init pid>/root` — with the host-side policy (overlayfs and tmpfs only,
//! [`ALLOWED_FS`]) and answers [`NodeError`]s and API [`FileEntry`]s.
use crate::node::{NodeError, NodeResult};
use sandlot_api::{FileEntry, FileType};
use sandlot_guest::sandbox_fs::{self as sfs, FileInfo, FileKind, FsCode, FsError};
use std::path::Path;

pub use sandlot_guest::sandbox_fs::{ALLOWED_FS, MAX_REMOVE_DEPTH, WORKDIR};

/// Directories of the sandbox that [`SandboxFs::remove`] never removes themselves.
pub use sandlot_guest::sandbox_fs::PROTECTED_DIRS;

/// The node error of a file-operation error (same code; `PayloadTooLarge`, a file over the
/// caller's `max_bytes`, is `InvalidArgument` as the node's API has always answered).
pub fn node_error(e: FsError) -> NodeError {
    match e.code {
        FsCode::NotFound => NodeError::NotFound(e.message),
        FsCode::InvalidArgument | FsCode::PayloadTooLarge => NodeError::InvalidArgument(e.message),
        FsCode::PermissionDenied => NodeError::PermissionDenied(e.message),
        FsCode::Conflict => NodeError::Conflict(e.message),
        FsCode::ResourceExhausted => NodeError::ResourceExhausted(e.message),
        FsCode::Internal => NodeError::io(
            e.message,
            std::io::Error::other(e.cause.unwrap_or_else(|| "internal error".into())),
        ),
    }
}

/// The API entry of a [`FileInfo`].
pub fn file_entry(i: FileInfo) -> FileEntry {
    FileEntry {
        name: i.name,
        kind: match i.kind {
            FileKind::File => FileType::File,
            FileKind::Dir => FileType::Dir,
            FileKind::Symlink => FileType::Symlink,
            FileKind::Other => FileType::Other,
        },
        size: i.size,
        mode: i.mode,
        mtime: i.mtime,
        link_target: i.link_target,
    }
}

/// A sandbox root opened from the host. See [`sandlot_guest::sandbox_fs`] for the rules;
/// each method is the one of [`sfs::SandboxFs`] with node errors.
#[derive(Debug)]
pub struct SandboxFs(sfs::SandboxFs);

impl SandboxFs {
    /// Open a sandbox root (normally `/proc/<init pid>/root`; any directory works).
    ///
    /// `uid`/`gid` are the host ids that files and directories created here get (the ids
    /// the sandbox's user maps to).
    ///
    /// # Errors
    /// `NotFound` when `root` does not exist (e.g. the sandbox's init is gone), `Internal`
    /// with the host path otherwise.
    pub fn open(root: &Path, uid: u32, gid: u32) -> NodeResult<SandboxFs> {
        sfs::SandboxFs::open(root, uid, gid)
            .map(SandboxFs)
            .map_err(node_error)
    }

    /// Size in bytes (`st_size`) of the regular file at `path`.
    ///
    /// # Errors
    /// As [`read`](Self::read), without the size limit.
    pub fn size(&self, path: &str) -> NodeResult<u64> {
        self.0.size(path).map_err(node_error)
    }

    /// Read a whole regular file of at most `max_bytes` bytes.
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` when not a regular file, on a special
    /// file system, larger than `max_bytes` ("file is N bytes; limit M"), or a bad path;
    /// `Internal` on I/O failure.
    pub fn read(&self, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        self.0.read(path, max_bytes).map_err(node_error)
    }

    /// Write a file atomically and durably (temp file, fsync, rename, directory fsync),
    /// creating missing parents.
    ///
    /// # Errors
    /// `InvalidArgument` when the path names a directory or lies on a special file system;
    /// `NotFound` when a parent vanishes concurrently; `ResourceExhausted` when the
    /// sandbox's space is used up; `PermissionDenied`; `Internal` on other I/O failures.
    pub fn write(&self, path: &str, data: &[u8]) -> NodeResult<()> {
        self.0.write(path, data).map_err(node_error)
    }

    /// A streamed [`write`](Self::write) of at most `max_bytes` bytes, fed from `rx` on
    /// this (blocking) thread: [`Piece::Data`] chunks are appended, [`Piece::End`] commits;
    /// an `Err` or a closed channel without `End` (the feeder was dropped: the client went
    /// away) removes the temp file and leaves the target untouched. Answers the bytes
    /// written. See [`feed`] for the async side.
    ///
    /// # Errors
    /// As [`write`](Self::write); `InvalidArgument` over `max_bytes` or when the upload
    /// broke off or was abandoned.
    pub fn write_from(
        &self,
        path: &str,
        max_bytes: u64,
        mut rx: tokio::sync::mpsc::Receiver<NodeResult<Piece>>,
    ) -> NodeResult<u64> {
        let mut w = self.0.begin_write(path, max_bytes).map_err(node_error)?;
        loop {
            match rx.blocking_recv() {
                Some(Ok(Piece::Data(b))) => w.write(&b).map_err(node_error)?,
                Some(Ok(Piece::End)) => {
                    let n = w.written();
                    w.commit().map_err(node_error)?;
                    return Ok(n);
                }
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(NodeError::InvalidArgument(format!(
                        "upload of {path} was abandoned; nothing written"
                    )))
                }
            }
        }
    }

    /// Open a regular file for a streamed read (see [`read`](Self::read) for the rules).
    ///
    /// # Errors
    /// As [`read`](Self::read) (a file already over `max_bytes` fails here).
    pub fn open_read(&self, path: &str, max_bytes: u64) -> NodeResult<sfs::FileReader> {
        self.0.open_read(path, max_bytes).map_err(node_error)
    }

    /// [`write`](Self::write) without the fsyncs: atomic, not durable.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub fn write_volatile(&self, path: &str, data: &[u8]) -> NodeResult<()> {
        self.0.write_volatile(path, data).map_err(node_error)
    }

    /// List a directory, sorted by name (entries `lstat`ed).
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` when not a directory or on a special file
    /// system; `Internal` on I/O failure.
    pub fn list(&self, path: &str) -> NodeResult<Vec<FileEntry>> {
        self.0
            .list(path)
            .map(|v| v.into_iter().map(file_entry).collect())
            .map_err(node_error)
    }

    /// Facts of one path (symlinks followed inside the root).
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` for a bad path or a special file system;
    /// `Internal` on I/O failure.
    pub fn stat(&self, path: &str) -> NodeResult<FileEntry> {
        self.0.stat(path).map(file_entry).map_err(node_error)
    }

    /// Create a directory (`parents`: `mkdir -p`).
    ///
    /// # Errors
    /// `NotFound` (missing parent without `parents`), `Conflict` (exists, or a
    /// non-directory is in the way), `InvalidArgument`, `PermissionDenied`,
    /// `ResourceExhausted`, `Internal`.
    pub fn mkdir(&self, path: &str, parents: bool) -> NodeResult<()> {
        self.0.mkdir(path, parents).map_err(node_error)
    }

    /// Remove a file, a symlink (never its target), or a directory with everything in it.
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` for `/`, a mount point, a protected
    /// directory, a special file system or a too-deep tree; `Conflict` when the sandbox
    /// keeps filling a directory; `Internal` on other failures.
    pub fn remove(&self, path: &str) -> NodeResult<()> {
        self.0.remove(path).map_err(node_error)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_contract_names_the_guest_agents_workdir() {
        assert_eq!(sandlot_node_api::WORKDIR, super::WORKDIR);
    }
}

/// One message of an upload's feeder to [`SandboxFs::write_from`].
#[derive(Debug)]
pub enum Piece {
    /// The next bytes.
    Data(bytes::Bytes),
    /// The body ended: commit.
    End,
}

/// Chunks in flight between an upload's body and its writing thread (each at most what
/// the body's producer hands out, e.g. 16 KiB–1 MiB for an HTTP body).
pub const FEED_DEPTH: usize = 4;

/// The async side of a streamed write: runs `write` (which owns the receiving end, e.g. a
/// blocking [`SandboxFs::write_from`]) while it pulls `body` into the channel, at most
/// [`FEED_DEPTH`] chunks ahead. Stops reading the body as soon as the writer is gone
/// (failed, e.g. over its limit). `path` names the file in messages.
///
/// # Errors
/// `write`'s.
pub async fn feed<W>(
    write: impl FnOnce(tokio::sync::mpsc::Receiver<NodeResult<Piece>>) -> W,
    mut body: sandlot_node_api::ByteStream,
    path: &str,
) -> NodeResult<u64>
where
    W: std::future::Future<Output = NodeResult<u64>>,
{
    let (tx, rx) = tokio::sync::mpsc::channel(FEED_DEPTH);
    let write = write(rx);
    let pump = async move {
        loop {
            let item = tokio::select! {
                _ = tx.closed() => return,
                c = sandlot_node_api::next_chunk(&mut body) => c,
            };
            let (msg, last) = match item {
                Some(Ok(b)) => (Ok(Piece::Data(b)), false),
                Some(Err(e)) => (Err(sandlot_node_api::broke_off(path, &e)), true),
                None => (Ok(Piece::End), true),
            };
            if tx.send(msg).await.is_err() || last {
                return;
            }
        }
    };
    let (r, ()) = tokio::join!(write, pump);
    r
}

/// The bytes of `reader` as a stream of [`sandlot_node_api::STREAM_CHUNK`]-byte chunks,
/// read on a blocking thread at most a few chunks ahead of the consumer; a read error ends
/// the stream with an `Err` item. Dropping the stream stops the thread.
pub fn reader_stream(mut reader: sfs::FileReader) -> sandlot_node_api::ByteStream {
    let (tx, rx) = tokio::sync::mpsc::channel(FEED_DEPTH);
    tokio::task::spawn_blocking(move || loop {
        let mut buf = vec![0u8; sandlot_node_api::STREAM_CHUNK];
        let msg = match reader.read_chunk(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                buf.truncate(n);
                Ok(bytes::Bytes::from(buf))
            }
            Err(e) => Err(std::io::Error::other(e.to_string())),
        };
        let last = msg.is_err();
        if tx.blocking_send(msg).is_err() || last {
            return;
        }
    });
    sandlot_node_api::from_receiver(rx)
}
