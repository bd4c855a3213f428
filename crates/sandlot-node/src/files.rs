//! File operations inside a sandbox, done from the host.
//!
//! [`SandboxFs`] works on a sandbox root opened from the host — normally
//! `/proc/<init pid>/root` of the sandbox's init process, which is the sandbox's own view of
//! its mount tree (overlay rootfs, its `/tmp`, its `/dev/shm`). The node runs as **host
//! root** and the tree is controlled by the sandbox, so everything here treats the tree as
//! hostile:
//!
//! - every path is resolved with `openat2(2)` and `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`
//!   (Linux 5.6+) against the root fd: absolute symlinks and `..` are clamped to the sandbox
//!   root, and `/proc/<pid>/root`-style magic links (which would jump to another root) are
//!   refused;
//! - whatever is opened is checked with `fstatfs(2)`: only overlayfs and tmpfs are accepted
//!   (see [`ALLOWED_FS`]), so the sandbox's `/proc`, `/sys`, and bind-mounted host devices or
//!   files are never read or written by host root;
//!   Note that devtmpfs reports the tmpfs magic too: device nodes are stopped by the
//!   regular-file check below, and writes never open an existing target (temp file +
//!   rename); the node must never mount the host's devtmpfs into a sandbox;
//! - files are opened `O_PATH` first and checked (regular file, allowed file system) before a
//!   real open, so opening cannot trigger device side effects or hang on a FIFO;
//! - recursive removal walks with directory fds and `unlinkat(2)`, never re-resolving path
//!   strings, and never follows symlinks or crosses mount points.
//!
//! Relative paths are relative to `/workspace`. Error messages show the absolute path inside
//! the sandbox (e.g. `/workspace/x`), never a host path.
//!
//! Reference: openat2(2), open_how(2type), fstatfs(2), unlinkat(2), renameat(2).
use crate::node::{NodeError, NodeResult};
use nix::errno::Errno;
use nix::fcntl::{openat2, renameat, AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fchmod, fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::sys::statfs::{fstatfs, FsType, OVERLAYFS_SUPER_MAGIC, TMPFS_MAGIC};
use nix::unistd::{fchown, fsync, unlinkat, Gid, Uid, UnlinkatFlags};
use sandlot_api::{FileEntry, FileType};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// File systems that host root may touch inside a sandbox: the overlay rootfs and tmpfs
/// mounts (`/tmp`, `/dev/shm`). Everything else is refused. This is an allowlist on
/// purpose: procfs (`/proc/sys/*`, `/proc/sysrq-trigger` act on the HOST kernel when written
/// by host root), sysfs, cgroupfs, devtmpfs and bind mounts of host files/devices must
/// never be reachable, and new special file systems appear with new kernels.
pub const ALLOWED_FS: &[FsType] = &[OVERLAYFS_SUPER_MAGIC, TMPFS_MAGIC];

/// Working directory that relative paths are resolved against.
pub const WORKDIR: &str = "/workspace";

/// Deepest directory nesting [`SandboxFs::remove`] descends into. The walk holds one fd per
/// level, so a hostile tree of unbounded depth must not exhaust the node's fds or stack.
pub const MAX_REMOVE_DEPTH: usize = 256;

/// How many times a resolution is retried when `openat2` answers `EAGAIN` (a concurrent
/// rename or mount inside the root, which `RESOLVE_IN_ROOT` refuses to race with).
const EAGAIN_RETRIES: usize = 16;

/// Prefix of temp files made by [`SandboxFs::write`] next to their target.
const TMP_PREFIX: &str = ".sandlot-tmp-";

/// A sandbox root opened from the host. See the module docs for the security model.
#[derive(Debug)]
pub struct SandboxFs {
    /// `O_PATH | O_DIRECTORY` fd of the root; every resolution starts here.
    root: OwnedFd,
    /// Owner given to files and directories this module creates (the host uid that the
    /// sandbox's user maps to).
    uid: Uid,
    /// Group of created files and directories.
    gid: Gid,
}

/// A path inside the sandbox, checked and made absolute.
#[derive(Debug, Clone)]
struct SbPath {
    /// Absolute path inside the sandbox, as given (`..` not collapsed; the kernel clamps).
    abs: String,
}

impl SbPath {
    /// Validate a user path: any UTF-8, not empty, no NUL; relative → under `/workspace`.
    fn parse(path: &str) -> NodeResult<SbPath> {
        if path.is_empty() {
            return Err(NodeError::InvalidArgument("path is empty".into()));
        }
        if path.contains('\0') {
            return Err(NodeError::InvalidArgument(
                "path contains a NUL byte".into(),
            ));
        }
        let abs = if path.starts_with('/') {
            path.to_string()
        } else {
            format!("{WORKDIR}/{path}")
        };
        Ok(SbPath { abs })
    }

    /// Split into (parent path, last component). The last component is `None` for `/`,
    /// a path ending in `/`, `.` or `..` — those name a directory by its path, not an
    /// entry in a parent.
    fn split(&self) -> (String, Option<String>) {
        let trimmed = self.abs.trim_end_matches('/');
        if trimmed.is_empty() || self.abs.ends_with('/') {
            return (self.abs.clone(), None);
        }
        let (parent, name) = match trimmed.rfind('/') {
            Some(i) => (&trimmed[..i], &trimmed[i + 1..]),
            None => ("", trimmed),
        };
        if name == "." || name == ".." {
            return (self.abs.clone(), None);
        }
        let parent = if parent.is_empty() { "/" } else { parent };
        (parent.to_string(), Some(name.to_string()))
    }

    /// Components of the path (empty ones and `.` dropped; `..` kept for the kernel).
    fn components(&self) -> Vec<&str> {
        self.abs
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect()
    }
}

/// Map an errno met while working on `path` (an absolute path inside the sandbox).
fn map_errno(e: Errno, what: &str, path: &str) -> NodeError {
    match e {
        Errno::ENOENT => NodeError::NotFound(format!("no such file: {path}")),
        Errno::EACCES | Errno::EPERM => {
            NodeError::PermissionDenied(format!("permission denied: {what} {path}"))
        }
        Errno::EISDIR => NodeError::InvalidArgument(format!("is a directory: {path}")),
        Errno::ENOTDIR => NodeError::InvalidArgument(format!("not a directory: {path}")),
        // ELOOP: too many symlinks, a magic link (RESOLVE_NO_MAGICLINKS), or O_NOFOLLOW on a
        // symlink. EXDEV: resolution tried to leave the root. Both are the caller's path.
        Errno::ELOOP => NodeError::InvalidArgument(format!(
            "too many levels of symbolic links or a forbidden link: {path}"
        )),
        Errno::EXDEV => NodeError::InvalidArgument(format!("path escapes the sandbox: {path}")),
        Errno::ENAMETOOLONG => NodeError::InvalidArgument(format!("path too long: {path}")),
        Errno::ENOTEMPTY => NodeError::Conflict(format!("directory not empty: {path}")),
        // The sandbox's own space (disk_mib quota, tmpfs size, inodes, file size limit) is
        // used up: the caller's resource, not a host failure.
        Errno::ENOSPC | Errno::EDQUOT | Errno::EFBIG => NodeError::ResourceExhausted(format!(
            "no space left in the sandbox ({}) while writing {path}",
            e.desc()
        )),
        Errno::EBUSY => NodeError::InvalidArgument(format!("path is a mount point: {path}")),
        other => NodeError::io(format!("{what} {path}"), std::io::Error::from(other)),
    }
}

/// `openat2` with `how`, retried on `EAGAIN` (see [`EAGAIN_RETRIES`]).
fn openat2_retry(dir: BorrowedFd<'_>, path: &str, how: OpenHow) -> Result<OwnedFd, Errno> {
    let mut last = Errno::EAGAIN;
    for _ in 0..EAGAIN_RETRIES {
        match openat2(dir, path, how) {
            Err(Errno::EAGAIN) | Err(Errno::EINTR) => last = Errno::EAGAIN,
            other => return other,
        }
    }
    Err(last)
}

/// Resolution flags for a path from the sandbox root.
// SECURITY: RESOLVE_IN_ROOT makes `/` and `..` stop at the root fd, so neither absolute
// symlinks nor `..` can leave the sandbox; RESOLVE_NO_MAGICLINKS refuses procfs magic links
// (`/proc/<pid>/root`, `/proc/self/fd/N`), which would otherwise jump to any file or root
// the referenced process holds — including host ones.
fn in_root() -> ResolveFlag {
    ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS
}

/// Resolution flags for one plain name under a directory fd we already trust.
// SECURITY: a single component relative to a checked directory; no symlink of any kind is
// followed and no mount point is crossed (a sandbox mount of procfs over a subdirectory is
// not entered).
fn one_name() -> ResolveFlag {
    ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_XDEV
}

/// Refuse anything that is not on an allowed file system (see [`ALLOWED_FS`]).
fn check_fs(fd: BorrowedFd<'_>, path: &str) -> NodeResult<()> {
    let st = fstatfs(fd).map_err(|e| map_errno(e, "fstatfs", path))?;
    if ALLOWED_FS.contains(&st.filesystem_type()) {
        Ok(())
    } else {
        Err(NodeError::InvalidArgument(format!(
            "path is on a special file system: {path}"
        )))
    }
}

/// File type of a stat result.
fn kind_of(st: &FileStat) -> FileType {
    match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => FileType::File,
        SFlag::S_IFDIR => FileType::Dir,
        SFlag::S_IFLNK => FileType::Symlink,
        _ => FileType::Other,
    }
}

impl SandboxFs {
    /// Open a sandbox root (normally `/proc/<init pid>/root`; any directory works).
    ///
    /// `uid`/`gid` are the host ids that files and directories created by [`write`](Self::write)
    /// get (the ids the sandbox's user maps to).
    ///
    /// # Errors
    /// `NotFound` when `root` does not exist (e.g. the sandbox's init is gone), `Internal`
    /// with the host path otherwise.
    pub fn open(root: &Path, uid: u32, gid: u32) -> NodeResult<SandboxFs> {
        // Host-side path given by the node itself (trusted), so a plain open is right here;
        // `/proc/<pid>/root` is a magic link we mean to follow.
        let root_fd = nix::fcntl::open(
            root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::ENOENT => {
                NodeError::NotFound(format!("sandbox root {} does not exist", root.display()))
            }
            other => NodeError::io(
                format!("open sandbox root {}", root.display()),
                other.into(),
            ),
        })?;
        Ok(SandboxFs {
            root: root_fd,
            uid: Uid::from_raw(uid),
            gid: Gid::from_raw(gid),
        })
    }

    /// Resolve `path` to an `O_PATH` fd of a regular file on an allowed file system, with
    /// its stat.
    fn open_regular(&self, p: &SbPath) -> NodeResult<(OwnedFd, FileStat)> {
        // SECURITY: O_PATH first — no open side effects (device open hooks, FIFO blocking,
        // tty acquisition) happen before we know this is a regular file on an allowed fs.
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(in_root());
        let opath = openat2_retry(self.root.as_fd(), &p.abs, how)
            .map_err(|e| map_errno(e, "open", &p.abs))?;
        check_fs(opath.as_fd(), &p.abs)?;
        let st = fstat(opath.as_fd()).map_err(|e| map_errno(e, "fstat", &p.abs))?;
        match kind_of(&st) {
            FileType::File => Ok((opath, st)),
            FileType::Dir => Err(NodeError::InvalidArgument(format!(
                "is a directory: {}",
                p.abs
            ))),
            _ => Err(NodeError::InvalidArgument(format!(
                "not a regular file: {}",
                p.abs
            ))),
        }
    }

    /// Size in bytes (`st_size`) of the regular file at `path`, resolved as
    /// [`read`](Self::read) does. A sparse file reports its apparent size.
    ///
    /// # Errors
    /// As [`read`](Self::read), without the size limit.
    pub fn size(&self, path: &str) -> NodeResult<u64> {
        let p = SbPath::parse(path)?;
        Ok(self.open_regular(&p)?.1.st_size as u64)
    }

    /// Read a whole regular file.
    ///
    /// `path` is absolute inside the sandbox or relative to `/workspace`; symlinks are
    /// followed but stay inside the root. Memory grows with the bytes actually read, never
    /// reserved up front from `st_size` (which the sandbox controls: a sparse file can
    /// claim any size for free).
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` when not a regular file, on a special
    /// file system, larger than `max_bytes` ("file is N bytes; limit M"), or a bad path;
    /// `Internal` on I/O failure.
    pub fn read(&self, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        let p = SbPath::parse(path)?;
        let (opath, st) = self.open_regular(&p)?;
        let size = st.st_size as u64;
        if size > max_bytes {
            return Err(NodeError::InvalidArgument(format!(
                "file is {size} bytes; limit {max_bytes}: {}",
                p.abs
            )));
        }
        // Re-open the very inode pinned by the O_PATH fd (no path is resolved again, so
        // the sandbox cannot swap the file in between). O_NONBLOCK as a second guard so a
        // FIFO could never hang the host thread; O_NOCTTY so a tty never becomes ours.
        let proc_path = format!("/proc/self/fd/{}", opath.as_raw_fd());
        let fd = nix::fcntl::open(
            proc_path.as_str(),
            OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| map_errno(e, "open", &p.abs))?;
        let mut file = File::from(fd);
        // SECURITY: no `with_capacity(st_size)`: growth follows the data read (see above).
        let mut buf = Vec::new();
        // Read at most max+1 bytes: a file growing after fstat is still caught.
        (&mut file)
            .take(max_bytes.saturating_add(1))
            .read_to_end(&mut buf)
            .map_err(|e| NodeError::io(format!("read {}", p.abs), e))?;
        if buf.len() as u64 > max_bytes {
            return Err(NodeError::InvalidArgument(format!(
                "file is over {max_bytes} bytes; limit {max_bytes}: {}",
                p.abs
            )));
        }
        Ok(buf)
    }

    /// Write a file atomically and durably.
    ///
    /// Missing parent directories are created (owner `uid:gid`, mode 0755). The data goes
    /// to a temp file in the target's directory, which is written, chowned to `uid:gid`,
    /// set to mode 0644, fsynced, renamed over the target, and the directory fsynced; the
    /// call returns only after that. A symlink at the target is replaced, not written
    /// through.
    ///
    /// # Errors
    /// `InvalidArgument` when the path names a directory or lies on a special file system,
    /// or a parent is not a directory, or the target is a mount point; `NotFound` when a
    /// parent vanishes concurrently; `ResourceExhausted` when the sandbox's space is used up
    /// (`ENOSPC`, `EDQUOT`, `EFBIG`); `Internal` on other I/O failures.
    pub fn write(&self, path: &str, data: &[u8]) -> NodeResult<()> {
        let p = SbPath::parse(path)?;
        let (parent_path, name) = p.split();
        let Some(name) = name else {
            return Err(NodeError::InvalidArgument(format!(
                "is a directory: {}",
                p.abs
            )));
        };
        let parent = self.ensure_dir(&SbPath { abs: parent_path })?;
        let tmp_name = format!("{TMP_PREFIX}{}-{:x}", std::process::id(), rand_suffix());
        // SECURITY: O_CREAT|O_EXCL never opens an existing file or follows a planted
        // symlink; the temp file is created by us, in a directory fd we checked.
        let how = OpenHow::new()
            .flags(
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
            )
            .mode(Mode::from_bits_truncate(0o600))
            .resolve(one_name());
        let fd = openat2_retry(parent.as_fd(), &tmp_name, how)
            .map_err(|e| map_errno(e, "create temp file in", &p.abs))?;
        let result = (|| {
            let mut file = File::from(fd);
            file.write_all(data).map_err(|e| match e.raw_os_error() {
                Some(n) => map_errno(Errno::from_raw(n), "write", &p.abs),
                None => NodeError::io(format!("write {}", p.abs), e),
            })?;
            fchown(file.as_fd(), Some(self.uid), Some(self.gid))
                .map_err(|e| map_errno(e, "chown", &p.abs))?;
            fchmod(file.as_fd(), Mode::from_bits_truncate(0o644))
                .map_err(|e| map_errno(e, "chmod", &p.abs))?;
            fsync(file.as_fd()).map_err(|e| map_errno(e, "fsync", &p.abs))?;
            // SECURITY: renaming over a mount point (e.g. the bind-mounted /dev/null) is
            // allowed from the host's mount namespace and detaches the sandbox's mount.
            refuse_mount_point(parent.as_fd(), &name, &p.abs)?;
            // rename(2) replaces a file or a symlink atomically; over a directory it fails
            // with EISDIR (or EEXIST/ENOTEMPTY for a non-empty one), mapped below.
            renameat(
                parent.as_fd(),
                tmp_name.as_str(),
                parent.as_fd(),
                name.as_str(),
            )
            .map_err(|e| match e {
                Errno::EEXIST | Errno::ENOTEMPTY => {
                    NodeError::InvalidArgument(format!("is a directory: {}", p.abs))
                }
                other => map_errno(other, "rename into", &p.abs),
            })?;
            Ok(())
        })();
        if let Err(e) = result {
            // Best effort: the temp file is ours; failing to remove it leaves only a
            // dot-file behind, and the original error is what the caller needs.
            let _ = unlinkat(
                parent.as_fd(),
                tmp_name.as_str(),
                UnlinkatFlags::NoRemoveDir,
            );
            return Err(e);
        }
        // Durability of the rename itself.
        fsync(parent.as_fd()).map_err(|e| map_errno(e, "fsync directory of", &p.abs))?;
        Ok(())
    }

    /// List a directory (symlinks to directories are followed for the directory itself),
    /// sorted by name. Entries are `lstat`ed: a symlink is reported as a symlink with the
    /// link's own size and mode. Entries that vanish during the listing are skipped; names
    /// that are not UTF-8 are converted lossily.
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` when not a directory or on a special file
    /// system; `Internal` on I/O failure.
    pub fn list(&self, path: &str) -> NodeResult<Vec<FileEntry>> {
        let p = SbPath::parse(path)?;
        let dir = self.open_dir(&p.abs)?;
        let mut entries = Vec::new();
        for name in read_names(&dir, &p.abs)? {
            // SECURITY: AT_SYMLINK_NOFOLLOW — stat the entry itself, never a link target.
            let st = match fstatat(dir.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(map_errno(e, "stat", &format!("{}/{name}", p.abs))),
            };
            entries.push(FileEntry {
                name: name.clone(),
                kind: kind_of(&st),
                size: st.st_size as u64,
                mode: st.st_mode & 0o7777,
                mtime: st.st_mtime,
            });
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    /// Remove a file, a symlink (never its target), or a directory with everything in it.
    ///
    /// The walk uses directory fds and `unlinkat(2)`, does not follow symlinks and does not
    /// descend into mount points, and stops at [`MAX_REMOVE_DEPTH`] levels.
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` for `/`, `.`/`..`-terminated paths, a
    /// mount point (anywhere in the tree), one of [`PROTECTED_DIRS`] itself, a special file
    /// system or a too-deep tree; `Conflict` when the sandbox keeps filling a
    /// directory during removal; `Internal` on other failures (e.g. a mount point inside).
    pub fn remove(&self, path: &str) -> NodeResult<()> {
        let p = SbPath::parse(path)?;
        let (parent_path, name) = p.split();
        let Some(name) = name else {
            return Err(NodeError::InvalidArgument(format!(
                "refusing to remove {} (name a directory entry, not / or a path ending in /, . or ..)",
                p.abs
            )));
        };
        let parent = self.open_dir(&parent_path)?;
        let st = fstatat(parent.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| map_errno(e, "stat", &p.abs))?;
        refuse_mount_point(parent.as_fd(), &name, &p.abs)?;
        // The sandbox's standard directories are its working area, not content: refuse
        // them by inode, so no symlink or `..` spelling gets around the check.
        for keep in PROTECTED_DIRS {
            let how = OpenHow::new()
                .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
                .resolve(in_root());
            if let Ok(fd) = openat2_retry(self.root.as_fd(), keep, how) {
                if let Ok(k) = fstat(fd.as_fd()) {
                    if (k.st_dev, k.st_ino) == (st.st_dev, st.st_ino) {
                        return Err(NodeError::InvalidArgument(format!(
                            "refusing to remove {keep} (named as {})",
                            p.abs
                        )));
                    }
                }
            }
        }
        if kind_of(&st) == FileType::Dir {
            remove_tree(parent.as_fd(), &name, &p.abs, 0)
        } else {
            unlinkat(parent.as_fd(), name.as_str(), UnlinkatFlags::NoRemoveDir)
                .map_err(|e| map_errno(e, "unlink", &p.abs))
        }
    }

    /// Open a directory for reading (following symlinks inside the root) and check its fs.
    fn open_dir(&self, abs: &str) -> NodeResult<OwnedFd> {
        // O_DIRECTORY makes the kernel refuse non-directories before any open hook runs.
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
            .resolve(in_root());
        let fd =
            openat2_retry(self.root.as_fd(), abs, how).map_err(|e| map_errno(e, "open", abs))?;
        check_fs(fd.as_fd(), abs)?;
        Ok(fd)
    }

    /// `mkdir -p`: return an fd of directory `dir`, creating missing components (owned
    /// `uid:gid`, mode 0755). Existing components are resolved by the kernel (symlinks
    /// followed inside the root, `..` clamped).
    fn ensure_dir(&self, dir: &SbPath) -> NodeResult<OwnedFd> {
        match self.open_dir(&dir.abs) {
            Err(NodeError::NotFound(_)) => {}
            other => return other,
        }
        // Walk from the deepest existing ancestor down. Each prefix is resolved from the
        // root fd as a whole, so `..` and symlinks keep their kernel meaning.
        let comps = dir.components();
        let mut existing = 0;
        for i in (0..comps.len()).rev() {
            let prefix = format!("/{}", comps[..i].join("/"));
            match self.open_dir(&prefix) {
                Ok(_) => {
                    existing = i;
                    break;
                }
                Err(NodeError::NotFound(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        let mut cur = self.open_dir(&format!("/{}", comps[..existing].join("/")))?;
        for (i, comp) in comps.iter().enumerate().skip(existing) {
            let here = format!("/{}", comps[..=i].join("/"));
            if *comp == ".." {
                // Exists by definition once its parent does; let the kernel resolve it.
                cur = self.open_dir(&here)?;
                continue;
            }
            // Only a directory made here gets our owner and mode; one that exists (made
            // meanwhile, or reached through `..`) is the sandbox's and stays as it is.
            let created = match mkdirat(cur.as_fd(), *comp, Mode::from_bits_truncate(0o755)) {
                Ok(()) => true,
                Err(Errno::EEXIST) => false,
                Err(e) => return Err(map_errno(e, "mkdir", &here)),
            };
            // SECURITY: open the new name without following anything: if the sandbox
            // swapped it for a symlink meanwhile we fail (ELOOP) instead of chowning a
            // target elsewhere.
            let how = OpenHow::new()
                .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                .resolve(one_name());
            let next =
                openat2_retry(cur.as_fd(), comp, how).map_err(|e| map_errno(e, "open", &here))?;
            check_fs(next.as_fd(), &here)?;
            if created {
                // fchown/fchmod on the fd (not the name): umask does not apply, no race.
                fchown(next.as_fd(), Some(self.uid), Some(self.gid))
                    .map_err(|e| map_errno(e, "chown", &here))?;
                fchmod(next.as_fd(), Mode::from_bits_truncate(0o755))
                    .map_err(|e| map_errno(e, "chmod", &here))?;
            }
            cur = next;
        }
        Ok(cur)
    }
}

/// Names in a directory (without `.` and `..`). The fd is duplicated for `fdopendir`, so
/// the caller keeps using its own.
fn read_names(dir: &OwnedFd, abs: &str) -> NodeResult<Vec<String>> {
    let dup = dir
        .try_clone()
        .map_err(|e| NodeError::io(format!("dup fd of {abs}"), e))?;
    let mut d = nix::dir::Dir::from_fd(dup).map_err(|e| map_errno(e, "opendir", abs))?;
    let mut names = Vec::new();
    for ent in d.iter() {
        let ent = ent.map_err(|e| map_errno(e, "readdir", abs))?;
        let name = String::from_utf8_lossy(ent.file_name().to_bytes()).into_owned();
        if name != "." && name != ".." {
            names.push(name);
        }
    }
    Ok(names)
}

/// Remove directory `name` under `parent` with everything in it.
fn remove_tree(parent: BorrowedFd<'_>, name: &str, abs: &str, depth: usize) -> NodeResult<()> {
    if depth >= MAX_REMOVE_DEPTH {
        return Err(NodeError::InvalidArgument(format!(
            "directory tree deeper than {MAX_REMOVE_DEPTH} levels: {abs}"
        )));
    }
    // SECURITY: one plain name, no symlinks, no mount crossing (a mount point is left for
    // rmdir to refuse with EBUSY rather than emptied).
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(one_name());
    let dir = openat2_retry(parent, name, how).map_err(|e| map_errno(e, "open", abs))?;
    check_fs(dir.as_fd(), abs)?;
    // A sandbox process may keep creating entries; a few passes, then give up.
    for _ in 0..4 {
        let dfd = dir.as_fd();
        for n in read_names(&dir, abs)? {
            let child = format!("{abs}/{n}");
            let st = match fstatat(dfd, n.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(map_errno(e, "stat", &child)),
            };
            let res = if let Err(e) = refuse_mount_point(dfd, &n, &child) {
                Err(e)
            } else if kind_of(&st) == FileType::Dir {
                remove_tree(dfd, &n, &child, depth + 1)
            } else {
                unlinkat(dfd, n.as_str(), UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| map_errno(e, "unlink", &child))
            };
            match res {
                Err(NodeError::NotFound(_)) | Ok(()) => {}
                Err(e) => return Err(e),
            }
        }
        match unlinkat(parent, name, UnlinkatFlags::RemoveDir) {
            Ok(()) => return Ok(()),
            Err(Errno::ENOTEMPTY) => continue,
            Err(e) => return Err(map_errno(e, "rmdir", abs)),
        }
    }
    Err(NodeError::Conflict(format!(
        "directory keeps changing during removal: {abs}"
    )))
}

/// Directories of the sandbox that [`SandboxFs::remove`] never removes themselves (their
/// contents may be removed).
pub const PROTECTED_DIRS: &[&str] = &["/workspace", "/tmp", "/dev", "/dev/shm", "/proc", "/sys"];

/// `InvalidArgument("path is a mount point")` when entry `name` of `dir` is the root of a
/// mount; `Ok` when it is not or does not exist.
///
/// SECURITY: the node works from the host's mount namespace, where unlink/rename/rmdir of a
/// path that is a mount point only in the *sandbox's* namespace succeed and silently detach
/// that mount (mount_namespaces(7), "MS_PRIVATE ... unlink"), e.g. the sandbox's bind-mounted
/// `/dev/null`. Detection: `statx(2)` `STATX_ATTR_MOUNT_ROOT` (Linux 5.8+), and, for older
/// kernels, a device number differing from the directory's.
fn refuse_mount_point(dir: BorrowedFd<'_>, name: &str, abs: &str) -> NodeResult<()> {
    let refuse = || {
        Err(NodeError::InvalidArgument(format!(
            "path is a mount point: {abs}"
        )))
    };
    let Ok(cname) = std::ffi::CString::new(name) else {
        return Err(NodeError::InvalidArgument(format!(
            "path contains a NUL byte: {abs}"
        )));
    };
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `dir` is a live fd, `cname` a NUL-terminated string that outlives the call,
    // and `stx` points to writable memory of the size statx(2) fills.
    let rc = unsafe {
        libc::statx(
            dir.as_raw_fd(),
            cname.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT,
            libc::STATX_BASIC_STATS,
            stx.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return match Errno::last() {
            Errno::ENOENT => Ok(()),
            e => Err(map_errno(e, "statx", abs)),
        };
    }
    // SAFETY: statx returned 0, so the kernel filled the struct (zeroed before anyway).
    let stx = unsafe { stx.assume_init() };
    let root_bit = libc::STATX_ATTR_MOUNT_ROOT as u64;
    if stx.stx_attributes_mask & root_bit != 0 {
        return if stx.stx_attributes & root_bit != 0 {
            refuse()
        } else {
            Ok(())
        };
    }
    // Fallback only: overlayfs without `xino` may give non-directories the st_dev of their
    // layer, so this can refuse a plain file on such kernels (safe side).
    let parent = fstat(dir).map_err(|e| map_errno(e, "fstat", abs))?;
    let dev = libc::makedev(stx.stx_dev_major, stx.stx_dev_minor);
    if dev != parent.st_dev {
        return refuse();
    }
    Ok(())
}

/// A cheap unique-enough suffix for temp names (O_EXCL catches the rare clash).
fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0);
    (nanos << 20) ^ COUNTER.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_live_under_workspace() {
        assert_eq!(SbPath::parse("a/b").unwrap().abs, "/workspace/a/b");
        assert_eq!(SbPath::parse("/etc/x").unwrap().abs, "/etc/x");
        assert!(matches!(
            SbPath::parse(""),
            Err(NodeError::InvalidArgument(_))
        ));
        assert!(matches!(
            SbPath::parse("a\0b"),
            Err(NodeError::InvalidArgument(_))
        ));
    }

    #[test]
    fn split_names_the_last_entry() {
        let s = |p: &str| SbPath::parse(p).unwrap().split();
        assert_eq!(s("/a/b"), ("/a".into(), Some("b".into())));
        assert_eq!(s("/a"), ("/".into(), Some("a".into())));
        assert_eq!(s("x"), ("/workspace".into(), Some("x".into())));
        assert_eq!(s("/"), ("/".into(), None));
        assert_eq!(s("/a/"), ("/a/".into(), None));
        assert_eq!(s("/a/.."), ("/a/..".into(), None));
        assert_eq!(s("/a/."), ("/a/.".into(), None));
        assert_eq!(s("/a b/ü"), ("/a b".into(), Some("ü".into())));
    }

    #[test]
    fn errno_mapping() {
        assert!(matches!(
            map_errno(Errno::ENOENT, "open", "/workspace/x"),
            NodeError::NotFound(m) if m == "no such file: /workspace/x"
        ));
        assert!(matches!(
            map_errno(Errno::EISDIR, "open", "/x"),
            NodeError::InvalidArgument(_)
        ));
        assert!(matches!(
            map_errno(Errno::ENOTDIR, "open", "/x"),
            NodeError::InvalidArgument(_)
        ));
        match map_errno(Errno::EIO, "read", "/x") {
            NodeError::Internal { context, .. } => assert_eq!(context, "read /x"),
            other => panic!("unexpected {other:?}"),
        }
    }
}
