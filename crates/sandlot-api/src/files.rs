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
    /// For a symbolic link: the absolute path inside the sandbox of its final target (every
    /// link on the way resolved inside the sandbox). Absent for anything else and for a
    /// dangling link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

/// `GET /v1/sandboxes/{id}/files/list` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileList {
    /// Entries sorted by name.
    pub entries: Vec<FileEntry>,
}
