//! Unpacking one OCI layer (a tar stream, maybe compressed) into a directory that becomes an
//! overlayfs lower dir.
//!
//! Format: OCI Image Format Specification v1.1, "Image Layer Filesystem Changeset"
//! (`layer.md`): a tar archive of changes; `.wh.<name>` deletes `<name>` from the layers
//! below; `.wh..wh..opq` in a directory hides every entry the layers below have in it. They
//! are written the way overlayfs (Documentation/filesystems/overlayfs.rst, "whiteouts and
//! opaque directories") reads them in a lower dir: a whiteout is a character device 0/0 with
//! the name, an opaque directory carries the xattr `trusted.overlay.opaque=y`.
//!
//! The archive is hostile input. Our code, not the `tar` crate's `unpack`, decides what is
//! written (`tar` only parses):
//! - entry names are made relative (a leading `/` is dropped) and an entry whose name has a
//!   `..` component fails the whole layer (`InvalidArgument`); hard-link targets the same;
//! - every path is resolved one component at a time from a directory fd with `O_NOFOLLOW`
//!   (`openat(2)`), so a symlink planted by an earlier entry is never followed while writing
//!   (the classic "symlink then write through it" escape, e.g. CVE-2019-14271 style tar
//!   breakouts); a symlink where a directory is needed fails the layer;
//! - hard links must point at an entry of the same layer (resolved the same way);
//! - block and character devices are skipped (only the whiteout devices above are made);
//!   FIFOs are created; extended attributes in the archive (PAX `SCHILY.xattr.*`) are not
//!   applied, so a layer cannot set `trusted.overlay.*` or file capabilities;
//! - uid, gid, mode (setuid, setgid and sticky bits included) and mtime are kept as the
//!   archive says. The layer directories live below a root-only (0700) directory, so host
//!   users cannot reach a setuid file of an image; sandboxes mount layers `nosuid`.
use nix::errno::Errno;
use nix::fcntl::{openat, AtFlags, OFlag};
use nix::sys::stat::{fstatat, futimens, mkdirat, mknodat, utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchown, fchownat, linkat, symlinkat, unlinkat, Gid, Uid, UnlinkatFlags};
use sandlot_node_api::{NodeError, NodeResult};
use sha2::{Digest as _, Sha256};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

/// Name prefix of a whiteout entry (OCI image spec, layer.md "Whiteouts").
pub const WHITEOUT_PREFIX: &str = ".wh.";
/// Name of the opaque-directory marker entry (OCI image spec, layer.md "Opaque Whiteout").
pub const OPAQUE_MARKER: &str = ".wh..wh..opq";
/// The xattr overlayfs reads to treat a lower directory as opaque.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar stream.
    None,
    /// gzip (RFC 1952), possibly several members.
    Gzip,
    /// zstd (RFC 8878).
    Zstd,
}

impl Compression {
    /// The compression a layer media type names (OCI image spec, media-types.md; Docker
    /// image manifest v2 schema 2). `application/vnd.docker.image.rootfs.diff.tar` (no
    /// suffix, from `docker save`) is `None`.
    ///
    /// # Errors
    /// `InvalidArgument` for a media type that is not a tar layer (e.g. a foreign-layer URL
    /// type, or an artifact), naming it.
    pub fn from_media_type(media_type: &str) -> NodeResult<Compression> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Ok(Compression::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Ok(Compression::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => {
                Ok(Compression::Zstd)
            }
            other => Err(NodeError::InvalidArgument(format!(
                "unsupported layer media type {other:?} (expected an OCI or Docker tar layer, plain, gzip or zstd)"
            ))),
        }
    }

    /// Guess from the first bytes (gzip `1f 8b`, zstd `28 b5 2f fd`, else plain tar); used
    /// for `docker save` layers, which carry no media type.
    pub fn sniff(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// What [`unpack_layer`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnpackStats {
    /// Entries written (files, dirs, links, whiteouts, opaque markers).
    pub entries: u64,
    /// Entries skipped (device nodes, unknown types, aufs `.wh..wh.` metadata).
    pub skipped: u64,
    /// Bytes of the uncompressed tar stream.
    pub tar_bytes: u64,
    /// `sha256:<hex>` of the uncompressed tar stream (the layer's DiffID).
    pub diff_id: String,
}

/// A reader that hashes (SHA-256) and counts what passes through.
struct HashReader<R> {
    inner: R,
    hash: Sha256,
    n: u64,
}

impl<R: Read> Read for HashReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.n += n as u64;
        Ok(n)
    }
}

/// Unpack the layer blob `blob` into `dest`, which must not exist yet (it is created, mode
/// 0755, owned by root). The uncompressed stream's SHA-256 must equal `expected_diff_id`
/// (`sha256:<hex>`, the image config's `rootfs.diff_ids` entry) when given.
///
/// On any error `dest` is removed again, so a failed unpack leaves nothing behind. The
/// caller unpacks into a temp dir and renames it into place (see the image store).
///
/// # Errors
/// `InvalidArgument` for a corrupt or hostile archive (bad compression, `..` in a name, a
/// write through a symlink, a hard link out of the layer, a DiffID mismatch);
/// `Internal` with the path for host I/O failures (also when not run as root: whiteouts
/// need `CAP_MKNOD`, opaque dirs `CAP_SYS_ADMIN` for `trusted.*` xattrs).
pub fn unpack_layer(
    blob: impl Read,
    compression: Compression,
    expected_diff_id: Option<&str>,
    dest: &Path,
) -> NodeResult<UnpackStats> {
    std::fs::create_dir(dest)
        .map_err(|e| NodeError::io(format!("create {}", dest.display()), e))?;
    let r = (|| {
        let root = openat(
            nix::fcntl::AT_FDCWD,
            dest,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| NodeError::io(format!("open {}", dest.display()), e.into()))?;
        nix::sys::stat::fchmod(&root, Mode::from_bits_truncate(0o755))
            .map_err(|e| NodeError::io(format!("chmod {}", dest.display()), e.into()))?;
        let stream: Box<dyn Read> = match compression {
            Compression::None => Box::new(BufReader::with_capacity(1 << 16, blob)),
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(
                BufReader::with_capacity(1 << 16, blob),
            )),
            Compression::Zstd => Box::new(
                ruzstd::decoding::StreamingDecoder::new(BufReader::with_capacity(1 << 16, blob))
                    .map_err(|e| {
                        NodeError::InvalidArgument(format!("layer is not valid zstd: {e}"))
                    })?,
            ),
        };
        let mut hr = HashReader {
            inner: stream,
            hash: Sha256::new(),
            n: 0,
        };
        let mut stats = Unpacker {
            root,
            dest,
            dirs: Vec::new(),
            stats: UnpackStats::default(),
        }
        .run(&mut hr)?;
        // The tar end marker may be followed by padding: the DiffID covers all of it.
        io::copy(&mut hr, &mut io::sink()).map_err(bad_stream)?;
        stats.tar_bytes = hr.n;
        stats.diff_id = format!("sha256:{}", hex(&hr.hash.finalize()));
        if let Some(want) = expected_diff_id {
            if want != stats.diff_id {
                return Err(NodeError::InvalidArgument(format!(
                    "layer content does not match its DiffID: expected {want}, got {}",
                    stats.diff_id
                )));
            }
        }
        Ok(stats)
    })();
    if r.is_err() {
        // std's remove_dir_all does not follow symlinks (CVE-2022-21658 fixed in 1.58.1).
        if let Err(e) = std::fs::remove_dir_all(dest) {
            tracing::warn!(path = %dest.display(), error = %e, "cannot remove failed layer");
        }
    }
    r
}

/// Lowercase hex of bytes, as a digest is written after `sha256:` (OCI image-spec `descriptor.md`).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn bad_stream(e: io::Error) -> NodeError {
    NodeError::InvalidArgument(format!("cannot read layer archive: {e}"))
}

struct Unpacker<'a> {
    root: OwnedFd,
    dest: &'a Path,
    /// Directories and their mtimes, applied at the end (creating children changes them).
    dirs: Vec<(Vec<OsString>, u64)>,
    stats: UnpackStats,
}

/// Make `name` relative and split it into components; `..` is refused.
fn clean(name: &Path) -> Result<Vec<OsString>, String> {
    let mut out = Vec::new();
    for c in name.components() {
        match c {
            Component::Prefix(_) | Component::RootDir | Component::CurDir => {}
            Component::ParentDir => return Err(format!("{:?} has a `..` component", name)),
            Component::Normal(s) => out.push(s.to_os_string()),
        }
    }
    Ok(out)
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

impl Unpacker<'_> {
    fn run(mut self, stream: &mut dyn Read) -> NodeResult<UnpackStats> {
        let mut ar = tar::Archive::new(stream);
        let entries = ar.entries().map_err(bad_stream)?;
        for ent in entries {
            let mut ent = ent.map_err(bad_stream)?;
            self.entry(&mut ent)?;
        }
        for (comps, mtime) in std::mem::take(&mut self.dirs) {
            // Re-resolve without following symlinks: a later entry may have replaced a
            // directory with a symlink.
            if let Ok(fd) = self.walk(&comps, false) {
                let t = TimeSpec::new(mtime as i64, 0);
                let _ = futimens(&fd, &t, &t);
            }
        }
        Ok(self.stats)
    }

    fn shown(&self, comps: &[OsString]) -> String {
        let mut p = self.dest.to_path_buf();
        p.extend(comps);
        p.display().to_string()
    }

    fn io_err(&self, what: &str, comps: &[OsString], e: Errno) -> NodeError {
        NodeError::io(format!("{what} {}", self.shown(comps)), e.into())
    }

    /// Open directory `comps` below the root without following any symlink; missing
    /// directories are created (0755, root) when `create`.
    fn walk(&self, comps: &[OsString], create: bool) -> NodeResult<OwnedFd> {
        let mut cur = openat(&self.root, ".", dir_flags(), Mode::empty())
            .map_err(|e| self.io_err("open", &[], e))?;
        for (i, c) in comps.iter().enumerate() {
            let next = match openat(&cur, c.as_os_str(), dir_flags(), Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) if create => {
                    match mkdirat(&cur, c.as_os_str(), Mode::from_bits_truncate(0o755)) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(e) => return Err(self.io_err("mkdir", &comps[..=i], e)),
                    }
                    openat(&cur, c.as_os_str(), dir_flags(), Mode::empty())
                        .map_err(|e| self.refuse(&comps[..=i], e))?
                }
                Err(e) => return Err(self.refuse(&comps[..=i], e)),
            };
            cur = next;
        }
        Ok(cur)
    }

    fn refuse(&self, comps: &[OsString], e: Errno) -> NodeError {
        match e {
            Errno::ELOOP | Errno::ENOTDIR => NodeError::InvalidArgument(format!(
                "layer writes through {:?}, which is a symlink or not a directory; refused",
                comps.iter().collect::<std::path::PathBuf>()
            )),
            Errno::ENOENT => NodeError::InvalidArgument(format!(
                "layer refers to {:?}, which is not in the layer",
                comps.iter().collect::<std::path::PathBuf>()
            )),
            e => self.io_err("open", comps, e),
        }
    }

    /// Make room for a new entry `name` in `parent`: nothing to do when absent, or when both
    /// the old and the new entry are directories (merge); otherwise the old one goes.
    fn clear(&self, parent: &OwnedFd, name: &OsStr, new_is_dir: bool) -> NodeResult<()> {
        match fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(NodeError::io(format!("stat {name:?}"), e.into())),
            Ok(st) => {
                let is_dir =
                    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR;
                if is_dir && new_is_dir {
                    Ok(())
                } else if is_dir {
                    remove_tree_at(parent.as_fd(), name)
                } else {
                    unlinkat(parent, name, UnlinkatFlags::NoRemoveDir)
                        .map_err(|e| NodeError::io(format!("unlink {name:?}"), e.into()))
                }
            }
        }
    }

    fn entry(&mut self, ent: &mut tar::Entry<'_, &mut dyn Read>) -> NodeResult<()> {
        let path = ent.path().map_err(bad_stream)?.into_owned();
        let comps = clean(&path)
            .map_err(|why| NodeError::InvalidArgument(format!("layer entry {why}; refused")))?;
        let h = ent.header();
        let kind = h.entry_type();
        let uid = h.uid().map_err(bad_stream)?;
        let gid = h.gid().map_err(bad_stream)?;
        let (uid, gid) = match (u32::try_from(uid), u32::try_from(gid)) {
            (Ok(u), Ok(g)) => (Uid::from_raw(u), Gid::from_raw(g)),
            _ => {
                return Err(NodeError::InvalidArgument(format!(
                    "layer entry {path:?} has uid/gid {uid}/{gid} beyond 32 bits"
                )))
            }
        };
        let mode = Mode::from_bits_truncate((h.mode().map_err(bad_stream)? & 0o7777) as _);
        let mtime = h.mtime().unwrap_or(0);
        let Some((name, parent_comps)) = comps.split_last() else {
            // The layer root itself (`./`): only its metadata.
            if kind.is_dir() {
                let fd = self.walk(&[], false)?;
                self.meta(&fd, uid, gid, mode, &[])?;
                self.dirs.push((Vec::new(), mtime));
                self.stats.entries += 1;
            } else {
                self.stats.skipped += 1;
            }
            return Ok(());
        };
        let name_b = name.as_bytes();
        if name_b == OPAQUE_MARKER.as_bytes() {
            let dir = self.walk(parent_comps, true)?;
            set_xattr(&dir, OPAQUE_XATTR, b"y")
                .map_err(|e| self.io_err("set trusted.overlay.opaque on", parent_comps, e))?;
            self.stats.entries += 1;
            return Ok(());
        }
        if name_b.starts_with(b".wh..wh.") {
            // aufs metadata (`.wh..wh.plnk`, `.wh..wh.aufs`): meaningless here.
            self.stats.skipped += 1;
            return Ok(());
        }
        if let Some(hidden) = name_b.strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(NodeError::InvalidArgument(format!(
                    "layer has a whiteout {path:?} that names no file; refused"
                )));
            }
            let hidden = OsStr::from_bytes(hidden);
            let dir = self.walk(parent_comps, true)?;
            self.clear(&dir, hidden, false)?;
            mknodat(
                &dir,
                hidden,
                SFlag::S_IFCHR,
                Mode::empty(),
                nix::sys::stat::makedev(0, 0),
            )
            .map_err(|e| self.io_err("mknod whiteout", &comps, e))?;
            self.stats.entries += 1;
            return Ok(());
        }
        match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                let dir = self.walk(parent_comps, true)?;
                self.clear(&dir, name, false)?;
                let fd = openat(
                    &dir,
                    name.as_os_str(),
                    OFlag::O_WRONLY
                        | OFlag::O_CREAT
                        | OFlag::O_EXCL
                        | OFlag::O_NOFOLLOW
                        | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(|e| self.io_err("create", &comps, e))?;
                let mut f = File::from(fd);
                io::copy(ent, &mut f).map_err(|e| {
                    if e.kind() == io::ErrorKind::InvalidData
                        || e.kind() == io::ErrorKind::UnexpectedEof
                    {
                        bad_stream(e)
                    } else {
                        NodeError::io(format!("write {}", self.shown(&comps)), e)
                    }
                })?;
                self.meta(&f, uid, gid, mode, &comps)?;
                let t = TimeSpec::new(mtime as i64, 0);
                futimens(&f, &t, &t).map_err(|e| self.io_err("set times of", &comps, e))?;
            }
            tar::EntryType::Directory => {
                let dir = self.walk(parent_comps, true)?;
                self.clear(&dir, name, true)?;
                match mkdirat(&dir, name.as_os_str(), Mode::from_bits_truncate(0o700)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err(self.io_err("mkdir", &comps, e)),
                }
                let fd = openat(&dir, name.as_os_str(), dir_flags(), Mode::empty())
                    .map_err(|e| self.refuse(&comps, e))?;
                self.meta(&fd, uid, gid, mode, &comps)?;
                self.dirs.push((comps.clone(), mtime));
            }
            tar::EntryType::Symlink => {
                let target = ent
                    .link_name_bytes()
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| {
                        NodeError::InvalidArgument(format!("symlink {path:?} has no target"))
                    })?
                    .into_owned();
                let dir = self.walk(parent_comps, true)?;
                self.clear(&dir, name, false)?;
                // The target text is stored as is: it is only ever resolved inside a
                // sandbox's own root, never by us.
                symlinkat(OsStr::from_bytes(&target), &dir, name.as_os_str())
                    .map_err(|e| self.io_err("symlink", &comps, e))?;
                fchownat(
                    &dir,
                    name.as_os_str(),
                    Some(uid),
                    Some(gid),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| self.io_err("chown", &comps, e))?;
                let t = TimeSpec::new(mtime as i64, 0);
                utimensat(
                    &dir,
                    name.as_os_str(),
                    &t,
                    &t,
                    UtimensatFlags::NoFollowSymlink,
                )
                .map_err(|e| self.io_err("set times of", &comps, e))?;
            }
            tar::EntryType::Link => {
                let target = ent
                    .link_name()
                    .map_err(bad_stream)?
                    .ok_or_else(|| {
                        NodeError::InvalidArgument(format!("hard link {path:?} has no target"))
                    })?
                    .into_owned();
                let tcomps = clean(&target).map_err(|why| {
                    NodeError::InvalidArgument(format!(
                        "hard link {path:?} points outside the layer: {why}; refused"
                    ))
                })?;
                let Some((tname, tparent)) = tcomps.split_last() else {
                    return Err(NodeError::InvalidArgument(format!(
                        "hard link {path:?} points at the layer root; refused"
                    )));
                };
                if tcomps == comps {
                    self.stats.skipped += 1;
                    return Ok(());
                }
                let tdir = self.walk(tparent, false)?;
                match fstatat(&tdir, tname.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                    Ok(st)
                        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT
                            != SFlag::S_IFDIR => {}
                    Ok(_) => {
                        return Err(NodeError::InvalidArgument(format!(
                            "hard link {path:?} points at directory {target:?}; refused"
                        )))
                    }
                    Err(e) => return Err(self.refuse(&tcomps, e)),
                }
                let dir = self.walk(parent_comps, true)?;
                self.clear(&dir, name, false)?;
                // No AT_SYMLINK_FOLLOW: a link to a symlink links the symlink itself.
                linkat(
                    &tdir,
                    tname.as_os_str(),
                    &dir,
                    name.as_os_str(),
                    AtFlags::empty(),
                )
                .map_err(|e| self.io_err("hard link", &comps, e))?;
            }
            tar::EntryType::Fifo => {
                let dir = self.walk(parent_comps, true)?;
                self.clear(&dir, name, false)?;
                mknodat(&dir, name.as_os_str(), SFlag::S_IFIFO, mode, 0)
                    .map_err(|e| self.io_err("mkfifo", &comps, e))?;
                fchownat(
                    &dir,
                    name.as_os_str(),
                    Some(uid),
                    Some(gid),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| self.io_err("chown", &comps, e))?;
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                // SECURITY: an image must not carry device nodes into a lower dir; sandboxes
                // get their own /dev.
                tracing::debug!(path = %path.display(), "skipping device node in layer");
                self.stats.skipped += 1;
                return Ok(());
            }
            other => {
                tracing::debug!(path = %path.display(), kind = ?other, "skipping tar entry");
                self.stats.skipped += 1;
                return Ok(());
            }
        }
        self.stats.entries += 1;
        Ok(())
    }

    /// chown then chmod (chown clears setuid/setgid bits, so the mode comes last).
    fn meta(
        &self,
        fd: &impl AsFd,
        uid: Uid,
        gid: Gid,
        mode: Mode,
        comps: &[OsString],
    ) -> NodeResult<()> {
        fchown(fd.as_fd(), Some(uid), Some(gid)).map_err(|e| self.io_err("chown", comps, e))?;
        nix::sys::stat::fchmod(fd.as_fd(), mode).map_err(|e| self.io_err("chmod", comps, e))
    }
}

/// Remove the tree `name` in `parent` without following symlinks.
fn remove_tree_at(parent: BorrowedFd<'_>, name: &OsStr) -> NodeResult<()> {
    let fd = openat(parent, name, dir_flags(), Mode::empty())
        .map_err(|e| NodeError::io(format!("open {name:?}"), e.into()))?;
    let mut d = nix::dir::Dir::from_fd(fd)
        .map_err(|e| NodeError::io(format!("read {name:?}"), e.into()))?;
    let mut children = Vec::new();
    for ent in d.iter() {
        let ent = ent.map_err(|e| NodeError::io(format!("read {name:?}"), e.into()))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            children.push(OsStr::from_bytes(n).to_os_string());
        }
    }
    // SAFETY: `d` owns a valid open directory fd for the whole scope; the borrow does not
    // outlive `d`.
    let dfd = unsafe { BorrowedFd::borrow_raw(d.as_raw_fd()) };
    for c in children {
        match fstatat(dfd, c.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR => {
                remove_tree_at(dfd, &c)?
            }
            _ => unlinkat(dfd, c.as_os_str(), UnlinkatFlags::NoRemoveDir)
                .map_err(|e| NodeError::io(format!("unlink {c:?}"), e.into()))?,
        }
    }
    unlinkat(parent, name, UnlinkatFlags::RemoveDir)
        .map_err(|e| NodeError::io(format!("rmdir {name:?}"), e.into()))
}

/// `fsetxattr(2)` on an open fd.
fn set_xattr(fd: &OwnedFd, name: &str, value: &[u8]) -> Result<(), Errno> {
    let cname = std::ffi::CString::new(name).map_err(|_| Errno::EINVAL)?;
    // SAFETY: fd is a valid open fd; cname is NUL-terminated; value points at value.len()
    // readable bytes; the kernel copies both and keeps no pointer.
    let r = unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            cname.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    Errno::result(r).map(drop)
}
