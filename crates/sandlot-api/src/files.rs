//! Files API shapes.
use serde::{Deserialize, Serialize};

/// Kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link (not followed).
    Symlink,
    /// Anything else (fifo, socket, device).
    Other,
}

/// One entry of `GET /v1/sandboxes/{id}/files/list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name (not the full path).
    pub name: String,
    /// Entry kind.
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits, e.g. `0o644` = 420.
    pub mode: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
}

/// `GET /v1/sandboxes/{id}/files/list` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileList {
    /// Entries sorted by name.
    pub entries: Vec<FileEntry>,
}
