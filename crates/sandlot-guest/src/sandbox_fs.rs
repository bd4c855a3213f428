//! File operations inside a sandbox's root, shared by the node (the `function` backend,
//! working from the host on `/proc/<init pid>/root`) and the guest agent (`sandlot-guest
//! agent`, working on its own `/` inside a container or VM) — one copy of the path rules.
//!
//! [`SandboxFs`] works on a root directory fd. The tree under it is controlled by the
//! sandbox, and the caller is more privileged than the sandbox's commands (host root on the
//! node; the agent, pid 1 and unconfined by landlock/seccomp, in a guest), so everything
//! here treats the tree as hostile:
//!
//! - every path is resolved with `openat2(2)` and `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`
//!   (Linux 5.6+) against the root fd: absolute symlinks and `..` are clamped to the sandbox
//!   root, and `/proc/<pid>/root`-style magic links (which would jump to another root) are
//!   refused;
//! - whatever is opened is checked with `fstatfs(2)` against the [`FsPolicy`]: only the
//!   listed file systems are accepted (host side: overlayfs and tmpfs, [`ALLOWED_FS`]), so
//!   the sandbox's `/proc`, `/sys`, and bind-mounted host devices or files are never read
//!   or written; the policy can also refuse whole top-level directories and devices (the
//!   agent refuses `/dev`, `/proc`, `/sys` and its own `/.sandlot`).
//!   Note that devtmpfs reports the tmpfs magic too: device nodes are stopped by the
//!   regular-file check below, and writes never open an existing target (temp file +
//!   rename); the node must never mount the host's devtmpfs into a sandbox;
//! - files are opened `O_PATH` first and checked (regular file, allowed file system) before a
//!   real open, so opening cannot trigger device side effects or hang on a FIFO;
//! - recursive removal walks with directory fds and `unlinkat(2)`, never re-resolving path
//!   strings, and never follows symlinks or crosses mount points.
//!
//! Relative paths are relative to `/workspace`. Error messages show the absolute path inside
//! the sandbox (e.g. `/workspace/x`), never a host path. Errors carry a stable [`FsCode`]
//! (the wire error codes of the HTTP API).
//!
//! Reference: openat2(2), open_how(2type), fstatfs(2), unlinkat(2), renameat(2).
use nix::errno::Errno;
use nix::fcntl::{openat, openat2, readlinkat, renameat, AtFlags, OFlag, ResolveFlag};
use nix::sys::stat::{fchmod, fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::sys::statfs::{fstatfs, FsType, OVERLAYFS_SUPER_MAGIC, PROC_SUPER_MAGIC, TMPFS_MAGIC};
use nix::unistd::{fchown, fsync, unlinkat, Gid, Uid, UnlinkatFlags};
use serde::{Deserialize, Serialize};
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

/// gVisor's gofer file system (`V9FS_MAGIC`, what `statfs(2)` reports inside a runsc
/// sandbox for the rootfs and bind mounts served from the host).
pub const V9FS_MAGIC: FsType = FsType(0x0102_1997);

/// Stable error code of a file operation (serialised snake_case, the HTTP API's codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsCode {
    /// No such file or directory.
    NotFound,
    /// Bad path, wrong file type (is a directory, not a directory, not a regular file), a
    /// special file system, a mount point, a refused directory.
    InvalidArgument,
    /// The sandbox's own permissions refuse it (`EACCES`, `EPERM`).
    PermissionDenied,
    /// A directory that is not empty or keeps changing, an existing non-directory in the
    /// way of `mkdir`.
    Conflict,
    /// The sandbox's space is used up (`ENOSPC`, `EDQUOT`, `EFBIG`).
    ResourceExhausted,
    /// A file larger than the caller's `max_bytes`.
    PayloadTooLarge,
    /// Anything else (I/O errors); the message says what was being done.
    Internal,
}

/// A failed file operation: its code and a message naming the path inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsError {
    /// Stable code.
    pub code: FsCode,
    /// What happened, with the path inside the sandbox (never a host path).
    pub message: String,
    /// For [`FsCode::Internal`]: the underlying OS error's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
}

impl FsError {
    /// An error of `code` with `message`.
    pub fn new(code: FsCode, message: impl Into<String>) -> FsError {
        FsError {
            code,
            message: message.into(),
            cause: None,
        }
    }

    /// An [`FsCode::Internal`] error: `context` says what was being done, `e` why it failed.
    pub fn io(context: impl Into<String>, e: std::io::Error) -> FsError {
        FsError {
            code: FsCode::Internal,
            message: context.into(),
            cause: Some(e.to_string()),
        }
    }
}

impl std::fmt::Display for FsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.cause {
            Some(c) => write!(f, "{}: {c}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for FsError {}

/// Result of file operations.
pub type FsResult<T> = Result<T, FsError>;

/// Kind of a directory entry (serialised `file`, `dir`, `symlink`, `other`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link (never followed when listed).
    Symlink,
    /// Anything else (device, FIFO, socket).
    Other,
}

/// One file's facts: a directory entry or a `stat` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Entry name (the last path component; `/` for the root).
    pub name: String,
    /// Kind.
    #[serde(rename = "type")]
    pub kind: FileKind,
    /// Size in bytes (`st_size`; a symlink's is its target's length).
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`), e.g. `0o644` = 420.
    pub mode: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    /// Where a symbolic link leads: the absolute path inside the sandbox of its final
    /// target, every link on the way resolved inside the root (as E2B's envd reports
    /// `symlinkTarget`). `None` for anything that is not a symlink, and for a link whose
    /// target does not exist (dangling) or resolves through a special file system.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

/// What a [`SandboxFs`] accepts beyond the path rules.
#[derive(Debug, Clone)]
pub struct FsPolicy {
    /// File systems (`statfs` magic) whose files may be touched; everything else is
    /// `InvalidArgument` ("special file system").
    pub allowed_fs: Vec<FsType>,
    /// Top-level directories refused outright (after lexical `..` collapsing), e.g. `/proc`.
    pub refused_tops: Vec<String>,
    /// `st_dev` values refused (mounts the caller must not touch, e.g. the agent's own).
    pub refused_devs: Vec<u64>,
}

impl Default for FsPolicy {
    /// The node's host-side policy: [`ALLOWED_FS`], nothing else refused.
    fn default() -> FsPolicy {
        FsPolicy {
            allowed_fs: ALLOWED_FS.to_vec(),
            refused_tops: Vec::new(),
            refused_devs: Vec::new(),
        }
    }
}

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
    /// File systems, directories and devices accepted.
    policy: FsPolicy,
}

/// A path inside the sandbox, checked and made absolute.
#[derive(Debug, Clone)]
struct SbPath {
    /// Absolute path inside the sandbox, as given (`..` not collapsed; the kernel clamps).
    abs: String,
}

impl SbPath {
    /// Validate a user path: any UTF-8, not empty, no NUL; relative → under `/workspace`.
    fn parse(path: &str) -> FsResult<SbPath> {
        if path.is_empty() {
            return Err(FsError::new(FsCode::InvalidArgument, "path is empty"));
        }
        if path.contains('\0') {
            return Err(FsError::new(
                FsCode::InvalidArgument,
                "path contains a NUL byte",
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
fn map_errno(e: Errno, what: &str, path: &str) -> FsError {
    match e {
        Errno::ENOENT => FsError::new(FsCode::NotFound, format!("no such file: {path}")),
        Errno::EACCES | Errno::EPERM => FsError::new(
            FsCode::PermissionDenied,
            format!("permission denied: {what} {path}"),
        ),
        Errno::EISDIR => FsError::new(FsCode::InvalidArgument, format!("is a directory: {path}")),
        Errno::ENOTDIR => FsError::new(FsCode::InvalidArgument, format!("not a directory: {path}")),
        // ELOOP: too many symlinks, a magic link (RESOLVE_NO_MAGICLINKS), or O_NOFOLLOW on a
        // symlink. EXDEV: resolution tried to leave the root. Both are the caller's path.
        Errno::ELOOP => FsError::new(
            FsCode::InvalidArgument,
            format!("too many levels of symbolic links or a forbidden link: {path}"),
        ),
        Errno::EXDEV => FsError::new(
            FsCode::InvalidArgument,
            format!("path escapes the sandbox: {path}"),
        ),
        Errno::ENAMETOOLONG => {
            FsError::new(FsCode::InvalidArgument, format!("path too long: {path}"))
        }
        Errno::ENOTEMPTY => FsError::new(FsCode::Conflict, format!("directory not empty: {path}")),
        // The sandbox's own space (disk_mib quota, tmpfs size, inodes, file size limit) is
        // used up: the caller's resource, not a host failure.
        Errno::ENOSPC | Errno::EDQUOT | Errno::EFBIG => FsError::new(
            FsCode::ResourceExhausted,
            format!(
                "no space left in the sandbox ({}) while writing {path}",
                e.desc()
            ),
        ),
        Errno::EBUSY => FsError::new(
            FsCode::InvalidArgument,
            format!("path is a mount point: {path}"),
        ),
        other => FsError::io(format!("{what} {path}"), std::io::Error::from(other)),
    }
}

/// What to open and how to resolve it: the arguments of `openat2(2)` (`struct open_how`).
#[derive(Debug, Clone, Copy)]
struct OpenHow {
    flags: OFlag,
    mode: Mode,
    resolve: ResolveFlag,
}

impl OpenHow {
    fn new() -> OpenHow {
        OpenHow {
            flags: OFlag::empty(),
            mode: Mode::empty(),
            resolve: ResolveFlag::empty(),
        }
    }
    fn flags(mut self, flags: OFlag) -> OpenHow {
        self.flags = flags;
        self
    }
    fn mode(mut self, mode: Mode) -> OpenHow {
        self.mode = mode;
        self
    }
    fn resolve(mut self, resolve: ResolveFlag) -> OpenHow {
        self.resolve = resolve;
        self
    }
}

/// Set once `openat2(2)` answered `ENOSYS` (gVisor's kernel, Linux < 5.6): every later
/// resolution uses [`resolve_by_hand`].
static NO_OPENAT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `openat2` with `how`, retried on `EAGAIN` (see [`EAGAIN_RETRIES`]); where the kernel has
/// no `openat2`, the same resolution done component by component ([`resolve_by_hand`]).
fn openat2_retry(dir: BorrowedFd<'_>, path: &str, how: OpenHow) -> Result<OwnedFd, Errno> {
    use std::sync::atomic::Ordering;
    if NO_OPENAT2.load(Ordering::Relaxed) {
        return resolve_by_hand(dir, path, how);
    }
    let nix_how = nix::fcntl::OpenHow::new()
        .flags(how.flags)
        .mode(how.mode)
        .resolve(how.resolve);
    let mut last = Errno::EAGAIN;
    for _ in 0..EAGAIN_RETRIES {
        match openat2(dir, path, nix_how) {
            Err(Errno::EAGAIN) | Err(Errno::EINTR) => last = Errno::EAGAIN,
            Err(Errno::ENOSYS) => {
                NO_OPENAT2.store(true, Ordering::Relaxed);
                return resolve_by_hand(dir, path, how);
            }
            other => return other,
        }
    }
    Err(last)
}

/// Most symlinks one resolution follows (the kernel's limit, `MAXSYMLINKS`).
const MAX_SYMLINKS: usize = 40;

/// `openat2` semantics without `openat2`, for the two resolutions this module uses:
///
/// * `RESOLVE_IN_ROOT` (with `RESOLVE_NO_MAGICLINKS`): the path is walked one component at
///   a time from `dir` with `openat(O_PATH | O_NOFOLLOW)`; `..` pops to the previous
///   directory and stops at `dir`; a symlink's target is read and walked in its place (an
///   absolute one from `dir`), at most [`MAX_SYMLINKS`] of them (`ELOOP`). A symlink on
///   procfs (a "magic" link) is refused with `ELOOP`, as `RESOLVE_NO_MAGICLINKS` does.
///   The final object is then re-opened through `/proc/self/fd/N` with the real flags.
/// * `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV` on one name: `openat` with
///   `O_NOFOLLOW`; names with `/` or `..` are refused (`EXDEV`), and a directory on another
///   device than `dir` (a mount point) is refused with `EXDEV`.
fn resolve_by_hand(dir: BorrowedFd<'_>, path: &str, how: OpenHow) -> Result<OwnedFd, Errno> {
    let open_flags = how.flags | OFlag::O_CLOEXEC;
    if !how.resolve.contains(ResolveFlag::RESOLVE_IN_ROOT) {
        if path.is_empty() || path.contains('/') || path == ".." || path == "." {
            return Err(Errno::EXDEV);
        }
        let fd = openat(dir, path, open_flags | OFlag::O_NOFOLLOW, how.mode)?;
        if how.resolve.contains(ResolveFlag::RESOLVE_NO_XDEV) {
            let (a, b) = (fstat(dir)?, fstat(fd.as_fd())?);
            if a.st_dev != b.st_dev {
                return Err(Errno::EXDEV);
            }
        }
        return Ok(fd);
    }
    let mut pending: std::collections::VecDeque<String> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(str::to_string)
        .collect();
    // Directories walked below `dir`; empty = at `dir`.
    let mut stack: Vec<OwnedFd> = Vec::new();
    let mut links = 0;
    while let Some(comp) = pending.pop_front() {
        if comp == ".." {
            stack.pop();
            continue;
        }
        let cur = stack.last().map(|f| f.as_fd()).unwrap_or(dir);
        let fd = openat(
            cur,
            comp.as_str(),
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        let st = fstat(fd.as_fd())?;
        let fmt = st.st_mode & SFlag::S_IFMT.bits();
        if fmt == SFlag::S_IFLNK.bits() {
            let last = pending.is_empty();
            if last && how.flags.contains(OFlag::O_NOFOLLOW) {
                if how.flags.contains(OFlag::O_PATH) {
                    return Ok(fd);
                }
                return Err(Errno::ELOOP);
            }
            // RESOLVE_NO_MAGICLINKS: a link of procfs (`/proc/<pid>/root`, `/proc/self/fd/N`)
            // is refused like openat2 refuses it, not followed as its text.
            if fstatfs(fd.as_fd()).is_ok_and(|f| f.filesystem_type() == PROC_SUPER_MAGIC) {
                return Err(Errno::ELOOP);
            }
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(Errno::ELOOP);
            }
            let target = readlinkat(cur, comp.as_str())?;
            let target = target.to_str().ok_or(Errno::EINVAL)?.to_string();
            if target.starts_with('/') {
                stack.clear();
            }
            for c in target
                .split('/')
                .filter(|c| !c.is_empty() && *c != ".")
                .rev()
            {
                pending.push_front(c.to_string());
            }
            continue;
        }
        if !pending.is_empty() && fmt != SFlag::S_IFDIR.bits() {
            return Err(Errno::ENOTDIR);
        }
        stack.push(fd);
    }
    let target = stack.last().map(|f| f.as_fd()).unwrap_or(dir);
    if how.flags.contains(OFlag::O_PATH) && !how.flags.contains(OFlag::O_DIRECTORY) {
        return target
            .try_clone_to_owned()
            .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)));
    }
    if how.flags.contains(OFlag::O_DIRECTORY) {
        let st = fstat(target)?;
        if st.st_mode & SFlag::S_IFMT.bits() != SFlag::S_IFDIR.bits() {
            return Err(Errno::ENOTDIR);
        }
    }
    if how.flags.contains(OFlag::O_CREAT) {
        // Creation is only ever done by name (the one-name branch above).
        return Err(Errno::EINVAL);
    }
    // Re-open the very object walked to (no path is resolved again).
    let proc_path = format!("/proc/self/fd/{}", target.as_raw_fd());
    nix::fcntl::open(
        proc_path.as_str(),
        open_flags & !OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
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

/// Refuse anything that is not on an allowed file system or is on a refused device (see
/// [`FsPolicy`]).
fn check_fs(policy: &FsPolicy, fd: BorrowedFd<'_>, path: &str) -> FsResult<()> {
    let st = fstatfs(fd).map_err(|e| map_errno(e, "fstatfs", path))?;
    if !policy.allowed_fs.contains(&st.filesystem_type()) {
        return Err(FsError::new(
            FsCode::InvalidArgument,
            format!("path is on a special file system: {path}"),
        ));
    }
    if !policy.refused_devs.is_empty() {
        let st = fstat(fd).map_err(|e| map_errno(e, "fstat", path))?;
        if policy.refused_devs.contains(&(st.st_dev as u64)) {
            return Err(FsError::new(
                FsCode::InvalidArgument,
                format!("path is on a file system the sandbox's file API does not serve: {path}"),
            ));
        }
    }
    Ok(())
}

/// File type of a stat result.
fn kind_of(st: &FileStat) -> FileKind {
    match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => FileKind::File,
        SFlag::S_IFDIR => FileKind::Dir,
        SFlag::S_IFLNK => FileKind::Symlink,
        _ => FileKind::Other,
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
    pub fn open(root: &Path, uid: u32, gid: u32) -> FsResult<SandboxFs> {
        // Host-side path given by the node itself (trusted), so a plain open is right here;
        // `/proc/<pid>/root` is a magic link we mean to follow.
        let root_fd = nix::fcntl::open(
            root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::ENOENT => FsError::new(
                FsCode::NotFound,
                format!("sandbox root {} does not exist", root.display()),
            ),
            other => FsError::io(
                format!("open sandbox root {}", root.display()),
                other.into(),
            ),
        })?;
        Ok(SandboxFs {
            root: root_fd,
            uid: Uid::from_raw(uid),
            gid: Gid::from_raw(gid),
            policy: FsPolicy::default(),
        })
    }

    /// The same root with another [`FsPolicy`].
    pub fn with_policy(mut self, policy: FsPolicy) -> SandboxFs {
        self.policy = policy;
        self
    }

    /// Parse a caller's path and apply [`FsPolicy::refused_tops`] (lexically, `..`
    /// collapsed; resolution then checks file systems and devices on what is opened).
    fn path(&self, path: &str) -> FsResult<SbPath> {
        let p = SbPath::parse(path)?;
        if !self.policy.refused_tops.is_empty() {
            let mut parts: Vec<&str> = Vec::new();
            for c in p.abs.split('/') {
                match c {
                    "" | "." => {}
                    ".." => {
                        parts.pop();
                    }
                    c => parts.push(c),
                }
            }
            if let Some(top) = parts.first() {
                if let Some(t) = self
                    .policy
                    .refused_tops
                    .iter()
                    .find(|t| t.trim_start_matches('/') == *top)
                {
                    return Err(FsError::new(
                        FsCode::InvalidArgument,
                        format!("{}: {t} is not served by the sandbox's file API", p.abs),
                    ));
                }
            }
        }
        Ok(p)
    }

    /// Resolve `path` to an `O_PATH` fd of a regular file on an allowed file system, with
    /// its stat.
    fn open_regular(&self, p: &SbPath) -> FsResult<(OwnedFd, FileStat)> {
        // SECURITY: O_PATH first — no open side effects (device open hooks, FIFO blocking,
        // tty acquisition) happen before we know this is a regular file on an allowed fs.
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(in_root());
        let opath = openat2_retry(self.root.as_fd(), &p.abs, how)
            .map_err(|e| map_errno(e, "open", &p.abs))?;
        check_fs(&self.policy, opath.as_fd(), &p.abs)?;
        let st = fstat(opath.as_fd()).map_err(|e| map_errno(e, "fstat", &p.abs))?;
        match kind_of(&st) {
            FileKind::File => Ok((opath, st)),
            FileKind::Dir => Err(FsError::new(
                FsCode::InvalidArgument,
                format!("is a directory: {}", p.abs),
            )),
            _ => Err(FsError::new(
                FsCode::InvalidArgument,
                format!("not a regular file: {}", p.abs),
            )),
        }
    }

    /// Size in bytes (`st_size`) of the regular file at `path`, resolved as
    /// [`read`](Self::read) does. A sparse file reports its apparent size.
    ///
    /// # Errors
    /// As [`read`](Self::read), without the size limit.
    pub fn size(&self, path: &str) -> FsResult<u64> {
        let p = self.path(path)?;
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
    /// file system or a bad path; `PayloadTooLarge` when larger than `max_bytes` ("file is
    /// N bytes; limit M"); `Internal` on I/O failure.
    pub fn read(&self, path: &str, max_bytes: u64) -> FsResult<Vec<u8>> {
        let mut r = self.open_read(path, max_bytes)?;
        // SECURITY: no `with_capacity(st_size)`: growth follows the data read (see above).
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let n = r.read_chunk(&mut chunk)?;
            if n == 0 {
                return Ok(buf);
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Open a regular file for a streamed read of at most `max_bytes` bytes (see
    /// [`read`](Self::read) for the rules); take the data with [`FileReader::read_chunk`].
    ///
    /// # Errors
    /// As [`read`](Self::read) (a file already over `max_bytes` fails here).
    pub fn open_read(&self, path: &str, max_bytes: u64) -> FsResult<FileReader> {
        let p = self.path(path)?;
        let (opath, st) = self.open_regular(&p)?;
        let size = st.st_size as u64;
        if size > max_bytes {
            return Err(FsError::new(
                FsCode::PayloadTooLarge,
                format!("file is {size} bytes; limit {max_bytes}: {}", p.abs),
            ));
        }
        // Re-open the very inode pinned by the O_PATH fd (no path is resolved again, so
        // the sandbox cannot swap the file in between). O_NONBLOCK as a second guard so a
        // FIFO could never hang the thread; O_NOCTTY so a tty never becomes ours.
        let proc_path = format!("/proc/self/fd/{}", opath.as_raw_fd());
        let fd = nix::fcntl::open(
            proc_path.as_str(),
            OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| map_errno(e, "open", &p.abs))?;
        Ok(FileReader {
            file: File::from(fd),
            abs: p.abs,
            max_bytes,
            done: 0,
        })
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
    pub fn write(&self, path: &str, data: &[u8]) -> FsResult<()> {
        let mut w = self.begin_write(path, u64::MAX)?;
        w.write(data)?;
        w.commit()
    }

    /// [`write`](Self::write) without the two fsyncs (file and directory): atomic, not
    /// durable. For sandboxes that never outlive a crash of their node (`run_code`'s), where
    /// a flush of the sandbox's disk per file is pure cost.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub fn write_volatile(&self, path: &str, data: &[u8]) -> FsResult<()> {
        let mut w = self.begin_write(path, u64::MAX)?;
        w.write(data)?;
        w.finish(false)
    }

    /// Start a streamed [`write`](Self::write): parents are created and the temp file
    /// made now; feed the bytes with [`FileWriter::write`] and finish with
    /// [`FileWriter::commit`]. Dropping the writer without committing removes the temp
    /// file and leaves the target untouched. More than `max_bytes` bytes fail with
    /// `PayloadTooLarge`.
    ///
    /// # Errors
    /// As [`write`](Self::write), for the parts done here.
    pub fn begin_write(&self, path: &str, max_bytes: u64) -> FsResult<FileWriter> {
        let p = self.path(path)?;
        let (parent_path, name) = p.split();
        let Some(name) = name else {
            return Err(FsError::new(
                FsCode::InvalidArgument,
                format!("is a directory: {}", p.abs),
            ));
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
        Ok(FileWriter {
            file: Some(File::from(fd)),
            parent,
            tmp_name,
            name,
            abs: p.abs,
            uid: self.uid,
            gid: self.gid,
            max_bytes,
            written: 0,
        })
    }

    /// Facts of the file, directory or other entry at `path`. Symlinks are followed inside
    /// the root (the answer describes the target); `name` is the last component of `path`
    /// (`/` for the root).
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` for a bad path or a special file system;
    /// `Internal` on I/O failure.
    pub fn stat(&self, path: &str) -> FsResult<FileInfo> {
        let p = self.path(path)?;
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(in_root());
        let fd = openat2_retry(self.root.as_fd(), &p.abs, how)
            .map_err(|e| map_errno(e, "open", &p.abs))?;
        check_fs(&self.policy, fd.as_fd(), &p.abs)?;
        let st = fstat(fd.as_fd()).map_err(|e| map_errno(e, "fstat", &p.abs))?;
        let name = p
            .abs
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .filter(|n| !n.is_empty())
            .unwrap_or("/")
            .to_string();
        let mut info = info_of(name, &st);
        if self.is_symlink(&p.abs) {
            info.link_target = self.path_in_root(fd.as_fd());
        }
        Ok(info)
    }

    /// Whether `abs` itself (its last component not followed) is a symbolic link.
    fn is_symlink(&self, abs: &str) -> bool {
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(in_root());
        openat2_retry(self.root.as_fd(), abs, how)
            .and_then(|fd| fstat(fd.as_fd()))
            .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK)
    }

    /// Final target of the symlink `abs`, resolved inside the root (see
    /// [`FileInfo::link_target`]).
    fn link_target(&self, abs: &str) -> Option<String> {
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(in_root());
        let fd = openat2_retry(self.root.as_fd(), abs, how).ok()?;
        check_fs(&self.policy, fd.as_fd(), abs).ok()?;
        self.path_in_root(fd.as_fd())
    }

    /// The absolute path inside the sandbox of `fd` (opened under the root): the kernel's
    /// name of it (`/proc/self/fd/N`, proc(5)) with the root's own name taken off the
    /// front. `None` when the name is not under the root's (a file the kernel names from
    /// another mount namespace) or is not UTF-8.
    fn path_in_root(&self, fd: BorrowedFd<'_>) -> Option<String> {
        let name = |fd: BorrowedFd<'_>| {
            std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .ok()?
                .into_os_string()
                .into_string()
                .ok()
        };
        let root = name(self.root.as_fd())?;
        let full = name(fd)?;
        if root == "/" {
            return Some(full);
        }
        match full.strip_prefix(root.as_str())? {
            "" => Some("/".to_owned()),
            rest if rest.starts_with('/') => Some(rest.to_owned()),
            _ => None,
        }
    }

    /// Create directory `path` (owner `uid:gid`, mode 0755). With `parents`, missing
    /// ancestors are created too and an existing directory is fine (`mkdir -p`); without,
    /// the parent must exist and the directory must not.
    ///
    /// # Errors
    /// `NotFound` when the parent is missing (without `parents`); `Conflict` when the path
    /// exists (without `parents`) or names a non-directory; `InvalidArgument` for a bad
    /// path, a parent that is not a directory, a special file system; `PermissionDenied`;
    /// `ResourceExhausted` when the sandbox's space is used up; `Internal` otherwise.
    pub fn mkdir(&self, path: &str, parents: bool) -> FsResult<()> {
        let p = self.path(path)?;
        if parents {
            if let Ok(st) = self.stat(path) {
                if st.kind != FileKind::Dir {
                    return Err(FsError::new(
                        FsCode::Conflict,
                        format!("exists and is not a directory: {}", p.abs),
                    ));
                }
            }
            self.ensure_dir(&p).map(|_| ())
        } else {
            let (parent_path, name) = p.split();
            let Some(name) = name else {
                return Err(FsError::new(
                    FsCode::Conflict,
                    format!("already exists: {}", p.abs),
                ));
            };
            let parent = self.open_dir(&parent_path)?;
            match mkdirat(
                parent.as_fd(),
                name.as_str(),
                Mode::from_bits_truncate(0o755),
            ) {
                Ok(()) => {}
                Err(Errno::EEXIST) => {
                    return Err(FsError::new(
                        FsCode::Conflict,
                        format!("already exists: {}", p.abs),
                    ))
                }
                Err(e) => return Err(map_errno(e, "mkdir", &p.abs)),
            }
            // SECURITY: open the new name without following anything (see ensure_dir).
            let how = OpenHow::new()
                .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                .resolve(one_name());
            let fd = openat2_retry(parent.as_fd(), &name, how)
                .map_err(|e| map_errno(e, "open", &p.abs))?;
            fchown(fd.as_fd(), Some(self.uid), Some(self.gid))
                .map_err(|e| map_errno(e, "chown", &p.abs))?;
            fchmod(fd.as_fd(), Mode::from_bits_truncate(0o755))
                .map_err(|e| map_errno(e, "chmod", &p.abs))?;
            fsync(parent.as_fd()).map_err(|e| map_errno(e, "fsync directory of", &p.abs))
        }
    }

    /// List a directory (symlinks to directories are followed for the directory itself),
    /// sorted by name. Entries are `lstat`ed: a symlink is reported as a symlink with the
    /// link's own size and mode. Entries that vanish during the listing are skipped; names
    /// that are not UTF-8 are converted lossily.
    ///
    /// # Errors
    /// `NotFound` when missing; `InvalidArgument` when not a directory or on a special file
    /// system; `Internal` on I/O failure.
    pub fn list(&self, path: &str) -> FsResult<Vec<FileInfo>> {
        let p = self.path(path)?;
        let dir = self.open_dir(&p.abs)?;
        let mut entries = Vec::new();
        for name in read_names(&dir, &p.abs)? {
            // SECURITY: AT_SYMLINK_NOFOLLOW — stat the entry itself, never a link target.
            let st = match fstatat(dir.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(map_errno(e, "stat", &format!("{}/{name}", p.abs))),
            };
            let mut info = info_of(name, &st);
            if info.kind == FileKind::Symlink {
                info.link_target =
                    self.link_target(&format!("{}/{}", p.abs.trim_end_matches('/'), info.name));
            }
            entries.push(info);
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
    pub fn remove(&self, path: &str) -> FsResult<()> {
        let p = self.path(path)?;
        let (parent_path, name) = p.split();
        let Some(name) = name else {
            return Err(FsError::new(FsCode::InvalidArgument, format!(
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
                        return Err(FsError::new(
                            FsCode::InvalidArgument,
                            format!("refusing to remove {keep} (named as {})", p.abs),
                        ));
                    }
                }
            }
        }
        if kind_of(&st) == FileKind::Dir {
            remove_tree(&self.policy, parent.as_fd(), &name, &p.abs, 0)
        } else {
            unlinkat(parent.as_fd(), name.as_str(), UnlinkatFlags::NoRemoveDir)
                .map_err(|e| map_errno(e, "unlink", &p.abs))
        }
    }

    /// Open a directory for reading (following symlinks inside the root) and check its fs.
    fn open_dir(&self, abs: &str) -> FsResult<OwnedFd> {
        // O_DIRECTORY makes the kernel refuse non-directories before any open hook runs.
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
            .resolve(in_root());
        let fd =
            openat2_retry(self.root.as_fd(), abs, how).map_err(|e| map_errno(e, "open", abs))?;
        check_fs(&self.policy, fd.as_fd(), abs)?;
        Ok(fd)
    }

    /// `mkdir -p`: return an fd of directory `dir`, creating missing components (owned
    /// `uid:gid`, mode 0755). Existing components are resolved by the kernel (symlinks
    /// followed inside the root, `..` clamped).
    fn ensure_dir(&self, dir: &SbPath) -> FsResult<OwnedFd> {
        match self.open_dir(&dir.abs) {
            Err(e) if e.code == FsCode::NotFound => {}
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
                Err(e) if e.code == FsCode::NotFound => continue,
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
            check_fs(&self.policy, next.as_fd(), &here)?;
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

/// [`FileInfo`] of a stat result.
fn info_of(name: String, st: &FileStat) -> FileInfo {
    FileInfo {
        name,
        kind: kind_of(st),
        size: st.st_size as u64,
        mode: st.st_mode & 0o7777,
        mtime: st.st_mtime,
        link_target: None,
    }
}

/// A streamed read opened by [`SandboxFs::open_read`].
#[derive(Debug)]
pub struct FileReader {
    file: File,
    abs: String,
    max_bytes: u64,
    done: u64,
}

impl FileReader {
    /// Reads the next bytes into `buf`; 0 at the end of the file.
    ///
    /// # Errors
    /// `PayloadTooLarge` when the file grew past `max_bytes` since it was opened;
    /// `Internal` on I/O failure.
    pub fn read_chunk(&mut self, buf: &mut [u8]) -> FsResult<usize> {
        // Read at most max+1 bytes in all: a file growing after fstat is still caught.
        let left = self.max_bytes.saturating_add(1).saturating_sub(self.done);
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if want == 0 && !buf.is_empty() {
            return Err(self.too_large());
        }
        let n = loop {
            match self.file.read(&mut buf[..want]) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(FsError::io(format!("read {}", self.abs), e)),
            }
        };
        self.done += n as u64;
        if self.done > self.max_bytes {
            return Err(self.too_large());
        }
        Ok(n)
    }

    fn too_large(&self) -> FsError {
        FsError::new(
            FsCode::PayloadTooLarge,
            format!(
                "file is over {m} bytes; limit {m}: {}",
                self.abs,
                m = self.max_bytes
            ),
        )
    }
}

/// A streamed write started by [`SandboxFs::begin_write`]: bytes go to a temp file next to
/// the target; [`commit`](Self::commit) makes them the target. Dropped uncommitted, the
/// temp file is removed.
#[derive(Debug)]
pub struct FileWriter {
    file: Option<File>,
    parent: OwnedFd,
    tmp_name: String,
    name: String,
    abs: String,
    uid: Uid,
    gid: Gid,
    max_bytes: u64,
    written: u64,
}

impl FileWriter {
    /// Appends `data`.
    ///
    /// # Errors
    /// `PayloadTooLarge` past `max_bytes`; `ResourceExhausted` when the sandbox's space is
    /// used up; `Internal` on other I/O failures. The writer is then useless (drop it).
    pub fn write(&mut self, data: &[u8]) -> FsResult<()> {
        self.written = self.written.saturating_add(data.len() as u64);
        if self.written > self.max_bytes {
            return Err(FsError::new(
                FsCode::PayloadTooLarge,
                format!(
                    "data is over {m} bytes; limit {m}: {}",
                    self.abs,
                    m = self.max_bytes
                ),
            ));
        }
        let Some(file) = self.file.as_mut() else {
            return Err(FsError::new(FsCode::Internal, "write after commit"));
        };
        file.write_all(data).map_err(|e| match e.raw_os_error() {
            Some(n) => map_errno(Errno::from_raw(n), "write", &self.abs),
            None => FsError::io(format!("write {}", self.abs), e),
        })
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Makes the data the target's: chown to `uid:gid`, mode 0644, fsync, rename over the
    /// target, fsync the directory. Durable when this returns `Ok`.
    ///
    /// # Errors
    /// `InvalidArgument` when the target is a directory or a mount point;
    /// `ResourceExhausted`; `Internal` on other I/O failures. The temp file is removed.
    pub fn commit(self) -> FsResult<()> {
        self.finish(true)
    }

    /// [`commit`](Self::commit), with the fsyncs only when `durable`.
    fn finish(mut self, durable: bool) -> FsResult<()> {
        let file = self.file.take().expect("FileWriter committed once");
        let abs = self.abs.clone();
        let result = (|| {
            fchown(file.as_fd(), Some(self.uid), Some(self.gid))
                .map_err(|e| map_errno(e, "chown", &abs))?;
            fchmod(file.as_fd(), Mode::from_bits_truncate(0o644))
                .map_err(|e| map_errno(e, "chmod", &abs))?;
            if durable {
                fsync(file.as_fd()).map_err(|e| map_errno(e, "fsync", &abs))?;
            }
            // SECURITY: renaming over a mount point (e.g. the bind-mounted /dev/null) is
            // allowed from the host's mount namespace and detaches the sandbox's mount.
            refuse_mount_point(self.parent.as_fd(), &self.name, &abs)?;
            // rename(2) replaces a file or a symlink atomically; over a directory it fails
            // with EISDIR (or EEXIST/ENOTEMPTY for a non-empty one), mapped below.
            renameat(
                self.parent.as_fd(),
                self.tmp_name.as_str(),
                self.parent.as_fd(),
                self.name.as_str(),
            )
            .map_err(|e| match e {
                Errno::EEXIST | Errno::ENOTEMPTY => {
                    FsError::new(FsCode::InvalidArgument, format!("is a directory: {abs}"))
                }
                other => map_errno(other, "rename into", &abs),
            })
        })();
        drop(file);
        if let Err(e) = result {
            self.remove_temp();
            return Err(e);
        }
        self.tmp_name.clear();
        if !durable {
            return Ok(());
        }
        // Durability of the rename itself.
        fsync(self.parent.as_fd()).map_err(|e| map_errno(e, "fsync directory of", &abs))
    }

    fn remove_temp(&mut self) {
        if !self.tmp_name.is_empty() {
            // Best effort: the temp file is ours; failing to remove it leaves only a
            // dot-file behind, and the original error is what the caller needs.
            let _ = unlinkat(
                self.parent.as_fd(),
                self.tmp_name.as_str(),
                UnlinkatFlags::NoRemoveDir,
            );
            self.tmp_name.clear();
        }
    }
}

impl Drop for FileWriter {
    fn drop(&mut self) {
        self.remove_temp();
    }
}

/// Names in a directory (without `.` and `..`). The fd is duplicated for `fdopendir`, so
/// the caller keeps using its own.
fn read_names(dir: &OwnedFd, abs: &str) -> FsResult<Vec<String>> {
    let dup = dir
        .try_clone()
        .map_err(|e| FsError::io(format!("dup fd of {abs}"), e))?;
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
fn remove_tree(
    policy: &FsPolicy,
    parent: BorrowedFd<'_>,
    name: &str,
    abs: &str,
    depth: usize,
) -> FsResult<()> {
    if depth >= MAX_REMOVE_DEPTH {
        return Err(FsError::new(
            FsCode::InvalidArgument,
            format!("directory tree deeper than {MAX_REMOVE_DEPTH} levels: {abs}"),
        ));
    }
    // SECURITY: one plain name, no symlinks, no mount crossing (a mount point is left for
    // rmdir to refuse with EBUSY rather than emptied).
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(one_name());
    let dir = openat2_retry(parent, name, how).map_err(|e| map_errno(e, "open", abs))?;
    check_fs(policy, dir.as_fd(), abs)?;
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
            } else if kind_of(&st) == FileKind::Dir {
                remove_tree(policy, dfd, &n, &child, depth + 1)
            } else {
                unlinkat(dfd, n.as_str(), UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| map_errno(e, "unlink", &child))
            };
            match res {
                Ok(()) => {}
                Err(e) if e.code == FsCode::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        match unlinkat(parent, name, UnlinkatFlags::RemoveDir) {
            Ok(()) => return Ok(()),
            Err(Errno::ENOTEMPTY) => continue,
            Err(e) => return Err(map_errno(e, "rmdir", abs)),
        }
    }
    Err(FsError::new(
        FsCode::Conflict,
        format!("directory keeps changing during removal: {abs}"),
    ))
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
fn refuse_mount_point(dir: BorrowedFd<'_>, name: &str, abs: &str) -> FsResult<()> {
    let refuse = || {
        Err(FsError::new(
            FsCode::InvalidArgument,
            format!("path is a mount point: {abs}"),
        ))
    };
    let Ok(cname) = std::ffi::CString::new(name) else {
        return Err(FsError::new(
            FsCode::InvalidArgument,
            format!("path contains a NUL byte: {abs}"),
        ));
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
        assert_eq!(SbPath::parse("").unwrap_err().code, FsCode::InvalidArgument);
        assert_eq!(
            SbPath::parse("a\0b").unwrap_err().code,
            FsCode::InvalidArgument
        );
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
        let e = map_errno(Errno::ENOENT, "open", "/workspace/x");
        assert_eq!(e.code, FsCode::NotFound);
        assert_eq!(e.message, "no such file: /workspace/x");
        assert_eq!(
            map_errno(Errno::EISDIR, "open", "/x").code,
            FsCode::InvalidArgument
        );
        assert_eq!(
            map_errno(Errno::ENOTDIR, "open", "/x").code,
            FsCode::InvalidArgument
        );
        let e = map_errno(Errno::EIO, "read", "/x");
        assert_eq!((e.code, e.message.as_str()), (FsCode::Internal, "read /x"));
    }

    #[test]
    fn refused_tops_are_lexical_after_dotdot() {
        let fs = SandboxFs::open(Path::new("/"), 0, 0)
            .unwrap()
            .with_policy(FsPolicy {
                refused_tops: vec!["/proc".into(), "/.sandlot".into()],
                ..FsPolicy::default()
            });
        for bad in [
            "/proc/self/environ",
            "/workspace/../proc",
            "../../proc/1",
            "/.sandlot/run",
        ] {
            assert_eq!(
                fs.path(bad).unwrap_err().code,
                FsCode::InvalidArgument,
                "{bad}"
            );
        }
        for ok in ["/procx", "/workspace/proc", "x/../y"] {
            assert!(fs.path(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn symlinks_report_their_final_target_inside_the_root() {
        use std::os::unix::fs::symlink;
        // On tmpfs, one of the file systems the default policy accepts.
        let tmp = tempfile::tempdir_in("/dev/shm").unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("a/d")).unwrap();
        std::fs::write(root.join("a/t.txt"), b"x").unwrap();
        symlink("t.txt", root.join("a/rel")).unwrap();
        symlink("/a/rel", root.join("a/chain")).unwrap();
        symlink("../../../../a/d", root.join("a/up")).unwrap();
        symlink("missing", root.join("a/dangling")).unwrap();
        let fs = SandboxFs::open(&root, 0, 0).unwrap();
        let st = fs.stat("/a/chain").unwrap();
        assert_eq!(st.kind, FileKind::File, "stat follows the link");
        assert_eq!(st.link_target.as_deref(), Some("/a/t.txt"));
        assert_eq!(
            fs.stat("/a/up").unwrap().link_target.as_deref(),
            Some("/a/d"),
            "`..` past the root is clamped to it"
        );
        assert_eq!(fs.stat("/a/t.txt").unwrap().link_target, None);
        assert_eq!(fs.stat("/a/d").unwrap().link_target, None);
        let list = fs.list("/a").unwrap();
        let target = |n: &str| {
            let e = list.iter().find(|e| e.name == n).unwrap();
            (e.kind, e.link_target.clone())
        };
        assert_eq!(target("rel"), (FileKind::Symlink, Some("/a/t.txt".into())));
        assert_eq!(target("up"), (FileKind::Symlink, Some("/a/d".into())));
        assert_eq!(target("dangling"), (FileKind::Symlink, None));
        assert_eq!(target("t.txt"), (FileKind::File, None));
        let json = serde_json::to_value(fs.stat("/a/t.txt").unwrap()).unwrap();
        assert!(
            json.get("link_target").is_none(),
            "left out when not a link"
        );
    }

    #[test]
    fn resolution_without_openat2_stays_in_the_root() {
        use std::os::unix::fs::symlink;
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f"), b"in").unwrap();
        std::fs::write(tmp.path().join("secret"), b"out").unwrap();
        symlink("/a/b", root.join("abs")).unwrap();
        symlink("../../../../secret", root.join("a/up")).unwrap();
        symlink("loop", root.join("loop")).unwrap();
        let rfd =
            nix::fcntl::open(&root, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        let read = |path: &str| -> Result<Vec<u8>, Errno> {
            let how = OpenHow::new().flags(OFlag::O_RDONLY).resolve(in_root());
            let fd = resolve_by_hand(rfd.as_fd(), path, how)?;
            let mut v = Vec::new();
            File::from(fd).read_to_end(&mut v).unwrap();
            Ok(v)
        };
        assert_eq!(read("/a/b/f").unwrap(), b"in");
        assert_eq!(read("/abs/f").unwrap(), b"in");
        assert_eq!(read("/../../a/./b/../b/f").unwrap(), b"in");
        assert_eq!(read("/a/up"), Err(Errno::ENOENT));
        assert_eq!(read("/loop"), Err(Errno::ELOOP));
        assert_eq!(read("/a/b/f/x"), Err(Errno::ENOTDIR));
        let dir = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY)
            .resolve(in_root());
        assert_eq!(
            resolve_by_hand(rfd.as_fd(), "/a/b/f", dir).unwrap_err(),
            Errno::ENOTDIR
        );
        assert!(resolve_by_hand(rfd.as_fd(), "/", dir).is_ok());
        let one = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW)
            .resolve(one_name());
        for bad in ["a/b", "..", ".", ""] {
            assert_eq!(
                resolve_by_hand(rfd.as_fd(), bad, one).unwrap_err(),
                Errno::EXDEV,
                "{bad}"
            );
        }
        // A symlink is never followed: O_NOFOLLOW|O_DIRECTORY answers ENOTDIR (openat2
        // would say ELOOP); both are invalid_argument.
        assert!(matches!(
            resolve_by_hand(rfd.as_fd(), "abs", one),
            Err(Errno::ENOTDIR | Errno::ELOOP)
        ));
        assert!(resolve_by_hand(rfd.as_fd(), "a", one).is_ok());
    }
}
