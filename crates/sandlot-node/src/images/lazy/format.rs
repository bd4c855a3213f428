//! The lazy layer format (Sandlot's own, version 1): one OCI layer becomes two blobs.
//!
//! - **Data blob** (media type [`DATA_MEDIA_TYPE`]): the contents of the layer's regular
//!   files, uncompressed, each file cut at [`CHUNK_SIZE`] (1 MiB) boundaries of the file;
//!   every distinct chunk (by SHA-256 of its bytes) is stored once, chunks laid end to end in
//!   first-seen order. Nothing else is in it: a byte range of the blob is a chunk.
//! - **Index blob** (media type [`INDEX_MEDIA_TYPE`], JSON of [`LazyIndex`]): the file tree,
//!   one [`Entry`] per path in depth-first name order, parents before children: type, mode
//!   (permission bits with setuid/setgid/sticky), uid, gid, mtime, size, symlink target,
//!   hard links (a later path naming the first path of the same inode), overlayfs whiteouts
//!   (character device 0/0) and opaque directories (`trusted.overlay.opaque=y`) exactly as
//!   [`super::super::unpack`] writes them, and per regular file its chunk list (digest,
//!   offset in the data blob, length; file offset = position in the list × chunk size).
//!
//! A reader needs the index (small, fetched whole) and then only the byte ranges of the
//! chunks it reads, each verified against its digest.
//!
//! Why our own chunk index served by FUSE rather than EROFS-on-FUSE: EROFS would need the
//! data laid out as an EROFS image (mkfs.erofs over the unpacked tree, then a FUSE file
//! exposing the image with the same chunk fetches underneath, then a file-backed EROFS
//! mount), i.e. two layers of indirection and an external tool at convert time, and its
//! block addressing does not deduplicate across images at our chunk size. A FUSE file
//! system serving this index directly answers metadata from memory, fetches exactly the
//! chunks a read touches, and is one Rust crate (`fuser`).
//!
//! **The EROFS disk (microVM backend).** A microVM reads its image as a virtio-blk EROFS
//! disk, not as a file tree, so [`ImageStore::convert_lazy`](crate::images::ImageStore::convert_lazy)
//! also makes that disk (the same `mkfs.erofs` run over the merged layers as the eager
//! microVM path, `backends::qemu::microvm::make_erofs`) and stores it in this same format as
//! a one-file tree ([`DISK_FILE`], mode 0444, in a root directory of mode 0755): an extra
//! `(index, data)` blob pair whose index has media type [`DISK_INDEX_MEDIA_TYPE`]. The node
//! serves it with the same FUSE daemon, chunk fetches, digest checks and disk cache as the
//! layers, and QEMU opens `<mount>/image.erofs` read-only: a guest read of a block becomes a
//! host read of the file, which fetches the 1 MiB chunk(s) under it. Why a whole disk
//! rather than a block device assembled from the layers' chunks: the guest needs no change
//! and QEMU no new block driver, at the cost of storing the image's bytes twice in the
//! registry (EROFS lays file data at 4 KiB, not 1 MiB, boundaries, so disk chunks do not
//! deduplicate with file chunks). Older nodes skip the unknown media type; a lazy image
//! converted before the disk existed falls back to the eager conversion (which reads every
//! chunk).
//!
//! **The ext4 disk (`vm` backend).** Likewise for a `vm` sandbox, whose root is a whole
//! read-write ext4 disk (a per-sandbox qcow2 over the image's base): the converter also
//! makes the raw ext4 disk of the merged layers (`backends::qemu::vm::make_ext4`, the same
//! function as the eager `vm` path; no agent in it: the guest's agent runs from the
//! initramfs) and stores it as a one-file tree ([`VM_DISK_FILE`], mode 0444) with index
//! media type [`VM_DISK_INDEX_MEDIA_TYPE`]. The node FUSE-mounts it as the EROFS disk and
//! each VM's first qcow2 layer backs onto `<mount>/image.ext4` as a raw file: the guest's
//! writes go to its qcow2, reads of untouched blocks fetch chunks. The ext4 file is sparse
//! where mkfs wrote nothing; its all-zero chunks share one digest and are fetched once.
//! Older nodes skip the media type; a lazy image without it builds its `vm` disk eagerly.
use crate::images::unpack::{hex, OPAQUE_XATTR};
use crate::node::{NodeError, NodeResult};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// Chunk size in bytes (1 MiB): files are cut at multiples of it.
pub const CHUNK_SIZE: u64 = 1 << 20;
/// Media type of an index blob (JSON of [`LazyIndex`]).
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.sandlot.lazy.index.v1+json";
/// Media type of a data blob (chunks end to end).
pub const DATA_MEDIA_TYPE: &str = "application/vnd.sandlot.lazy.data.v1";
/// Media type of the index blob of an image's EROFS disk (JSON of [`LazyIndex`]: a root
/// directory holding the one file [`DISK_FILE`]); its data blob has [`DATA_MEDIA_TYPE`].
pub const DISK_INDEX_MEDIA_TYPE: &str = "application/vnd.sandlot.lazy.erofs-index.v1+json";
/// Name of the EROFS disk file in the root of its lazy tree.
pub const DISK_FILE: &str = "image.erofs";
/// Media type of the index blob of an image's raw ext4 disk (the `vm` backend's base disk;
/// a root directory holding the one file [`VM_DISK_FILE`]); its data blob has
/// [`DATA_MEDIA_TYPE`].
pub const VM_DISK_INDEX_MEDIA_TYPE: &str = "application/vnd.sandlot.lazy.ext4-index.v1+json";
/// Name of the raw ext4 disk file in the root of its lazy tree.
pub const VM_DISK_FILE: &str = "image.ext4";
/// Format version written into [`LazyIndex::version`].
pub const FORMAT_VERSION: u32 = 1;

/// Kind of a file tree entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A directory.
    Dir,
    /// A regular file (contents in chunks).
    File,
    /// A symbolic link ([`Entry::target`] is its target).
    Symlink,
    /// A hard link to the earlier entry [`Entry::target`] (a path in the same index).
    Hardlink,
    /// A FIFO.
    Fifo,
    /// An overlayfs whiteout: a character device 0/0.
    Whiteout,
}

/// One chunk of a regular file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// `sha256:<hex>` of the chunk's bytes.
    pub digest: String,
    /// Offset of the chunk in the data blob, bytes.
    pub offset: u64,
    /// Length in bytes (≤ [`CHUNK_SIZE`]; only a file's last chunk is shorter).
    pub len: u64,
}

/// One path of the layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Path relative to the layer root, `/`-separated, UTF-8; `""` is the root directory.
    pub path: String,
    /// What it is.
    pub kind: Kind,
    /// Permission bits (`0o7777` mask: with setuid, setgid, sticky).
    pub mode: u32,
    /// Owner uid as the layer has it (not remapped).
    pub uid: u32,
    /// Owner gid as the layer has it (not remapped).
    pub gid: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    /// Nanoseconds part of the modification time.
    #[serde(default)]
    pub mtime_nsec: u32,
    /// Size in bytes: file length, or symlink target length; 0 otherwise.
    pub size: u64,
    /// Symlink target, or for a hard link the path of the entry it links to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// A directory the layers below are hidden in (overlayfs opaque directory).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque: bool,
    /// Chunks of a regular file, in file order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<ChunkRef>,
}

/// The index blob: a layer's file tree and where its file contents are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LazyIndex {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// Chunk size in bytes ([`CHUNK_SIZE`]).
    pub chunk_size: u64,
    /// `sha256:<hex>` of the data blob.
    pub data_digest: String,
    /// Size of the data blob in bytes.
    pub data_size: u64,
    /// DiffID of the layer this was made from (`sha256:<hex>` of its uncompressed tar),
    /// when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff_id: Option<String>,
    /// Sum of the sizes of the regular files (hard links counted once), bytes.
    pub files_bytes: u64,
    /// Entries, parents before children.
    pub entries: Vec<Entry>,
}

impl LazyIndex {
    /// Parse and check an index blob: version, chunk size, chunk lengths and offsets within
    /// the data blob, hard-link targets naming earlier regular files.
    ///
    /// # Errors
    /// `InvalidArgument` naming what is wrong.
    pub fn parse(data: &[u8]) -> NodeResult<LazyIndex> {
        let idx: LazyIndex = serde_json::from_slice(data)
            .map_err(|e| NodeError::InvalidArgument(format!("bad lazy index: {e}")))?;
        if idx.version != FORMAT_VERSION || idx.chunk_size != CHUNK_SIZE {
            return Err(NodeError::InvalidArgument(format!(
                "lazy index version {} chunk size {} is not supported (want {FORMAT_VERSION}, {CHUNK_SIZE})",
                idx.version, idx.chunk_size
            )));
        }
        let mut files = std::collections::HashSet::new();
        for e in &idx.entries {
            let mut total = 0u64;
            for (i, c) in e.chunks.iter().enumerate() {
                let last = i + 1 == e.chunks.len();
                if c.len == 0
                    || c.len > CHUNK_SIZE
                    || (!last && c.len != CHUNK_SIZE)
                    || c.offset
                        .checked_add(c.len)
                        .is_none_or(|end| end > idx.data_size)
                    || c.digest.len() != 71
                {
                    return Err(NodeError::InvalidArgument(format!(
                        "bad lazy index: chunk {i} of {:?}",
                        e.path
                    )));
                }
                total += c.len;
            }
            match e.kind {
                Kind::File if total != e.size => {
                    return Err(NodeError::InvalidArgument(format!(
                        "bad lazy index: chunks of {:?} sum to {total}, size is {}",
                        e.path, e.size
                    )))
                }
                Kind::File => {
                    files.insert(e.path.as_str());
                }
                Kind::Hardlink if !e.target.as_deref().is_some_and(|t| files.contains(t)) => {
                    return Err(NodeError::InvalidArgument(format!(
                        "bad lazy index: hard link {:?} names no earlier file",
                        e.path
                    )));
                }
                _ => {}
            }
        }
        Ok(idx)
    }
}

/// `sha256:<hex>` of `data`.
pub fn chunk_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(data)))
}

/// Convert the unpacked layer directory `root` (as [`super::super::unpack`] writes it) into
/// an index, writing the data blob's bytes to `data` as it goes. The returned index has
/// `data_digest` set from the bytes written (the caller need not hash them again).
///
/// # Errors
/// `InvalidArgument` for a path or symlink target that is not UTF-8, or a device other than
/// a whiteout; `Internal` on I/O.
pub fn convert_dir(root: &Path, data: &mut dyn Write) -> NodeResult<LazyIndex> {
    let mut c = Converter {
        data,
        hash: Sha256::new(),
        size: 0,
        seen: HashMap::new(),
        inodes: HashMap::new(),
        entries: Vec::new(),
        files_bytes: 0,
    };
    c.walk(root, "")?;
    Ok(LazyIndex {
        version: FORMAT_VERSION,
        chunk_size: CHUNK_SIZE,
        data_digest: format!("sha256:{}", hex(&c.hash.finalize())),
        data_size: c.size,
        diff_id: None,
        files_bytes: c.files_bytes,
        entries: c.entries,
    })
}

struct Converter<'a> {
    data: &'a mut dyn Write,
    hash: Sha256,
    size: u64,
    /// Chunk digest → (offset, len) of its one copy in the data blob.
    seen: HashMap<String, (u64, u64)>,
    /// (dev, ino) of regular files with several links → first path.
    inodes: HashMap<(u64, u64), String>,
    entries: Vec<Entry>,
    files_bytes: u64,
}

impl Converter<'_> {
    fn walk(&mut self, path: &Path, rel: &str) -> NodeResult<()> {
        let md = fs::symlink_metadata(path)
            .map_err(|e| NodeError::io(format!("stat {}", path.display()), e))?;
        let ft = md.file_type();
        let mut e = Entry {
            path: rel.to_string(),
            kind: Kind::Dir,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            mtime: md.mtime(),
            mtime_nsec: md.mtime_nsec().clamp(0, 999_999_999) as u32,
            size: 0,
            target: None,
            opaque: false,
            chunks: Vec::new(),
        };
        if ft.is_dir() {
            e.opaque = matches!(xattr_get(path, OPAQUE_XATTR), Some(v) if v == b"y");
            self.entries.push(e);
            let mut names: Vec<_> = fs::read_dir(path)
                .map_err(|e| NodeError::io(format!("read dir {}", path.display()), e))?
                .map(|d| d.map(|d| d.file_name()))
                .collect::<Result<_, _>>()
                .map_err(|e| NodeError::io(format!("read dir {}", path.display()), e))?;
            names.sort();
            for n in names {
                let name = n.to_str().ok_or_else(|| not_utf8(path, &n))?;
                let child = if rel.is_empty() {
                    name.to_string()
                } else {
                    format!("{rel}/{name}")
                };
                self.walk(&path.join(&n), &child)?;
            }
            return Ok(());
        }
        if ft.is_symlink() {
            let t = fs::read_link(path)
                .map_err(|e| NodeError::io(format!("readlink {}", path.display()), e))?;
            let t = t
                .to_str()
                .ok_or_else(|| not_utf8(path, t.as_os_str()))?
                .to_string();
            e.kind = Kind::Symlink;
            e.size = t.len() as u64;
            e.target = Some(t);
        } else if ft.is_fifo() {
            e.kind = Kind::Fifo;
        } else if ft.is_char_device() && md.rdev() == 0 {
            e.kind = Kind::Whiteout;
        } else if ft.is_file() {
            let key = (md.dev(), md.ino());
            if md.nlink() > 1 {
                if let Some(first) = self.inodes.get(&key) {
                    e.kind = Kind::Hardlink;
                    e.target = Some(first.clone());
                    e.size = md.len();
                    self.entries.push(e);
                    return Ok(());
                }
                self.inodes.insert(key, rel.to_string());
            }
            e.kind = Kind::File;
            e.size = md.len();
            e.chunks = self.file_chunks(path, md.len())?;
            self.files_bytes += md.len();
        } else {
            return Err(NodeError::InvalidArgument(format!(
                "{} is a device or socket; a lazy layer holds none",
                path.display()
            )));
        }
        self.entries.push(e);
        Ok(())
    }

    fn file_chunks(&mut self, path: &Path, len: u64) -> NodeResult<Vec<ChunkRef>> {
        let mut f = fs::File::open(path)
            .map_err(|e| NodeError::io(format!("open {}", path.display()), e))?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; CHUNK_SIZE as usize];
        let mut left = len;
        while left > 0 {
            let want = left.min(CHUNK_SIZE) as usize;
            f.read_exact(&mut buf[..want])
                .map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
            let chunk = &buf[..want];
            let digest = chunk_digest(chunk);
            let (offset, l) = match self.seen.get(&digest) {
                Some(&v) => v,
                None => {
                    self.data
                        .write_all(chunk)
                        .map_err(|e| NodeError::io("write lazy data blob", e))?;
                    self.hash.update(chunk);
                    let v = (self.size, want as u64);
                    self.size += want as u64;
                    self.seen.insert(digest.clone(), v);
                    v
                }
            };
            out.push(ChunkRef {
                digest,
                offset,
                len: l,
            });
            left -= want as u64;
        }
        Ok(out)
    }
}

fn not_utf8(dir: &Path, name: &std::ffi::OsStr) -> NodeError {
    NodeError::InvalidArgument(format!(
        "{}: name or target {name:?} is not UTF-8; the lazy format needs UTF-8 paths",
        dir.display()
    ))
}

/// `lgetxattr(2)` of `name` on `path`; `None` when absent or unreadable.
fn xattr_get(path: &Path, name: &str) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let n = std::ffi::CString::new(name).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: valid NUL-terminated strings and a buffer of the length passed.
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (r >= 0).then(|| buf[..r as usize].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn convert_dedups_chunks_and_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        fs::create_dir_all(root.join("a/b")).unwrap();
        let big: Vec<u8> = (0..(2 * CHUNK_SIZE + 10))
            .map(|i| (i % 251) as u8)
            .collect();
        fs::write(root.join("a/big"), &big).unwrap();
        fs::write(root.join("a/b/copy"), &big).unwrap();
        fs::write(root.join("small"), b"hello").unwrap();
        fs::hard_link(root.join("small"), root.join("z-link")).unwrap();
        std::os::unix::fs::symlink("a/big", root.join("sym")).unwrap();
        fs::set_permissions(root.join("small"), fs::Permissions::from_mode(0o4755)).unwrap();
        let mut data = Vec::new();
        let idx = convert_dir(&root, &mut data).unwrap();
        // big and copy share all 3 chunks; small adds one.
        assert_eq!(idx.data_size, 2 * CHUNK_SIZE + 10 + 5);
        assert_eq!(data.len() as u64, idx.data_size);
        assert_eq!(idx.data_digest, chunk_digest(&data));
        let json = serde_json::to_vec(&idx).unwrap();
        let idx = LazyIndex::parse(&json).unwrap();
        let by = |p: &str| idx.entries.iter().find(|e| e.path == p).unwrap().clone();
        assert_eq!(idx.entries[0].path, "");
        let read = |e: &Entry| {
            let mut v = Vec::new();
            for c in &e.chunks {
                let s = &data[c.offset as usize..(c.offset + c.len) as usize];
                assert_eq!(chunk_digest(s), c.digest);
                v.extend_from_slice(s);
            }
            v
        };
        assert_eq!(read(&by("a/big")), big);
        assert_eq!(read(&by("a/b/copy")), big);
        assert_eq!(read(&by("small")), b"hello");
        assert_eq!(by("small").mode, 0o4755);
        assert_eq!(by("z-link").kind, Kind::Hardlink);
        assert_eq!(by("z-link").target.as_deref(), Some("small"));
        assert_eq!(by("sym").kind, Kind::Symlink);
        assert_eq!(by("sym").target.as_deref(), Some("a/big"));
        assert_eq!(idx.files_bytes, 2 * big.len() as u64 + 5);
    }

    #[test]
    fn parse_refuses_bad_chunks() {
        let mut data = Vec::new();
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("f"), b"abc").unwrap();
        let mut idx = convert_dir(d.path(), &mut data).unwrap();
        idx.entries[1].chunks[0].offset = 10;
        let err = LazyIndex::parse(&serde_json::to_vec(&idx).unwrap()).unwrap_err();
        assert!(err.to_string().contains("chunk 0"), "{err}");
    }
}
