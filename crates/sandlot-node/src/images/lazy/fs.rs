//! The lazy mount: a read-only FUSE file system (`fuser`, kernel FUSE protocol) presenting
//! one lazy layer's [`LazyIndex`] as the directory tree [`crate::images::unpack`] would
//! have written, so overlayfs can stack it as a lower dir: same owners (not remapped), modes,
//! mtimes, symlinks, hard links (one inode), whiteouts (character device 0/0) and opaque
//! directories (`trusted.overlay.opaque=y` through `getxattr`). Metadata is answered from
//! memory; file data is read chunk by chunk through [`ChunkStore`] (disk cache, then the
//! registry). A chunk that cannot be had fails the read with `EIO`.
//!
//! Mounted with `allow_other` (sandboxes' processes reach it through overlay) and
//! `default_permissions` (the kernel checks modes), `ro,nosuid,nodev`; opened files keep
//! their page cache (`FOPEN_KEEP_CACHE`: the index is immutable, and only bytes that
//! matched their chunk digest are ever answered, so the page cache never holds a corrupted
//! chunk), so all sandboxes of a node share one cached copy. FUSE requests carry up to
//! 1 MiB ([`MAX_REQUEST`], one chunk) and the daemon raises the mount's kernel read-ahead
//! (see [`super::READ_AHEAD_KIB_ENV`]). On top of the kernel's read-ahead, a sequential
//! reader reaching the second half of a chunk makes the daemon advise the cache files of
//! the next [`read_ahead_chunks`] chunks into the page cache (`POSIX_FADV_WILLNEED`: the
//! disk reads them in parallel, nothing is fetched), and fetch the next
//! [`fetch_ahead_chunks`] of them that are not cached yet, in the background (at most
//! [`MAX_PREFETCHES`] read-ahead steps at a time, more are skipped; off by default: it costs registry bytes a reader may never
//! read).
//!
//! **Passthrough** (FUSE_PASSTHROUGH, kernel ≥ 6.9, `CONFIG_FUSE_PASSTHROUGH`; on unless
//! `$SANDLOT_LAZY_PASSTHROUGH=0`): once every chunk of a file is in the disk cache, the
//! daemon makes (in the background, at most [`MAX_COMPLETING`] at a time) a verified
//! complete-file copy of it in the cache ([`ChunkStore::complete`], named by
//! [`super::fetch::file_key`]: files with the same chunks share one), and later opens of
//! that file register the copy as the open's backing file (`FUSE_DEV_IOC_BACKING_OPEN`,
//! root only): the kernel then reads and maps it straight from the node's disk, with no
//! daemon round trip. The kernel wants one I/O mode per inode at a time, so an inode with
//! opens through the daemon (cached mode) gets no passthrough open until they are all
//! released, and all passthrough opens of an inode share one backing file. The daemon
//! holds a shared `flock` on a copy while it is a backing file (eviction skips it). The
//! mount then has a stacking depth of 1 (the kernel's maximum is 2), so it can still be an
//! overlayfs lower layer, and its backing files must not be on a stacked file system
//! (overlayfs, FUSE): if the kernel refuses one, the daemon logs it and stops using
//! passthrough.
use super::fetch::{file_key, ChunkStore};
use super::format::{Kind, LazyIndex, CHUNK_SIZE};
use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyXattr, Request,
};
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, UNIX_EPOCH};

/// Attribute/entry cache time given to the kernel: the tree never changes.
const TTL: Duration = Duration::from_secs(3600);

/// Largest FUSE read/write request asked of the kernel, bytes (one chunk).
pub const MAX_REQUEST: u32 = CHUNK_SIZE as u32;

/// Background prefetches of one daemon in flight at most (more are skipped, not queued).
pub const MAX_PREFETCHES: usize = 4;

/// Inodes whose last read end a daemon remembers for read-ahead (then it starts over).
const MAX_TRACKED: usize = 4096;

/// Complete-file copies one daemon makes or checks at a time (more are skipped, and tried
/// again at a later open or release of the file).
pub const MAX_COMPLETING: usize = 2;

/// Whether lazy mounts ask the kernel for FUSE passthrough (`$SANDLOT_LAZY_PASSTHROUGH`,
/// default on; `0` turns it off: every read goes through the daemon).
pub fn passthrough_wanted() -> bool {
    std::env::var("SANDLOT_LAZY_PASSTHROUGH").map_or(true, |v| v != "0")
}

/// A complete-file copy registered with the kernel as a backing file: the registration is
/// dropped (`FUSE_DEV_IOC_BACKING_CLOSE`) before the file and its shared `flock`.
struct Backing {
    id: BackingId,
    _file: nix::fcntl::Flock<std::fs::File>,
}

/// I/O mode of one inode's open files, as the daemon answered them.
#[derive(Default)]
struct InodeIo {
    /// Opens answered in cached mode (reads through the daemon) not released yet.
    cached: u32,
    /// The backing file of its passthrough opens, while any is open.
    backing: Weak<Backing>,
}

/// Open files by handle (regular files; handle 0 for other kinds).
#[derive(Default)]
struct OpenFiles {
    next_fh: u64,
    /// Handle → (inode, its backing file when opened with passthrough).
    handles: HashMap<u64, (u64, Option<Arc<Backing>>)>,
    inodes: HashMap<u64, InodeIo>,
}

fn env_chunks(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        .min(64)
}

/// Cached chunks advised into the page cache ahead of a sequential reader, default 8
/// (`$SANDLOT_LAZY_READ_AHEAD_CHUNKS`, 0 off, at most 64).
pub fn read_ahead_chunks() -> u64 {
    env_chunks("SANDLOT_LAZY_READ_AHEAD_CHUNKS", 8)
}

/// Missing chunks fetched ahead of a sequential reader, default 0
/// (`$SANDLOT_LAZY_FETCH_AHEAD_CHUNKS`; at most [`read_ahead_chunks`]).
pub fn fetch_ahead_chunks() -> u64 {
    env_chunks("SANDLOT_LAZY_FETCH_AHEAD_CHUNKS", 0).min(read_ahead_chunks())
}

struct Node {
    /// Index of the entry holding the metadata (the first path of a hard-linked file).
    entry: usize,
    parent: u64,
    /// Children by name → inode (directories only), in index order.
    children: Vec<(Vec<u8>, u64)>,
    nlink: u32,
}

/// A FUSE file system serving one lazy layer.
pub struct LazyFs {
    index: LazyIndex,
    /// Inode `i` is `nodes[i - 1]`; inode 1 is the root.
    nodes: Vec<Node>,
    names: Vec<HashMap<Vec<u8>, u64>>,
    chunks: Arc<ChunkStore>,
    rt: tokio::runtime::Handle,
    /// End offset of the last read and the first chunk not yet read ahead, by inode
    /// (read-ahead only follows sequential readers).
    last_end: Mutex<HashMap<u64, (u64, u64)>>,
    prefetching: Arc<AtomicUsize>,
    ahead_chunks: u64,
    fetch_ahead: u64,
    /// FUSE passthrough agreed at INIT and not refused since.
    passthrough: AtomicBool,
    files: Mutex<OpenFiles>,
    /// Keys of the complete-file copies being made or checked now.
    completing: Arc<Mutex<HashSet<String>>>,
    /// Records this mount's first reads as the layer's prefetch trace.
    trace: Option<Arc<super::trace::Recorder>>,
}

impl LazyFs {
    /// Build the inode table of `index` (checked with [`LazyIndex::parse`]); reads go
    /// through `chunks` on runtime `rt`.
    ///
    /// # Errors
    /// `InvalidArgument` when the index has no root directory first, or a path whose parent
    /// is missing or not a directory.
    pub fn new(
        index: LazyIndex,
        chunks: Arc<ChunkStore>,
        rt: tokio::runtime::Handle,
    ) -> crate::node::NodeResult<LazyFs> {
        let bad =
            |why: String| crate::node::NodeError::InvalidArgument(format!("lazy index: {why}"));
        if index
            .entries
            .first()
            .is_none_or(|e| e.path.is_empty() && e.kind != Kind::Dir)
            || index.entries.first().is_some_and(|e| !e.path.is_empty())
        {
            return Err(bad("the first entry is not the root directory".into()));
        }
        let mut nodes: Vec<Node> = Vec::new();
        let mut by_path: HashMap<&str, u64> = HashMap::new();
        for (i, e) in index.entries.iter().enumerate() {
            let (parent_path, name) = match e.path.rsplit_once('/') {
                Some((p, n)) => (p, n),
                None => ("", e.path.as_str()),
            };
            if i == 0 {
                nodes.push(Node {
                    entry: 0,
                    parent: 1,
                    children: Vec::new(),
                    nlink: 2,
                });
                by_path.insert("", 1);
                continue;
            }
            let Some(&parent) = by_path.get(parent_path) else {
                return Err(bad(format!("{:?} has no parent directory", e.path)));
            };
            if index.entries[nodes[parent as usize - 1].entry].kind != Kind::Dir {
                return Err(bad(format!("parent of {:?} is not a directory", e.path)));
            }
            let ino = if e.kind == Kind::Hardlink {
                let t = e.target.as_deref().unwrap_or("");
                let Some(&ino) = by_path.get(t) else {
                    return Err(bad(format!("hard link {:?} names no file", e.path)));
                };
                nodes[ino as usize - 1].nlink += 1;
                ino
            } else {
                nodes.push(Node {
                    entry: i,
                    parent,
                    children: Vec::new(),
                    nlink: if e.kind == Kind::Dir { 2 } else { 1 },
                });
                let ino = nodes.len() as u64;
                by_path.insert(e.path.as_str(), ino);
                if e.kind == Kind::Dir {
                    nodes[parent as usize - 1].nlink += 1;
                }
                ino
            };
            nodes[parent as usize - 1]
                .children
                .push((name.as_bytes().to_vec(), ino));
        }
        let names = nodes
            .iter()
            .map(|n| n.children.iter().cloned().collect())
            .collect();
        Ok(LazyFs {
            index,
            nodes,
            names,
            chunks,
            rt,
            last_end: Mutex::new(HashMap::new()),
            prefetching: Arc::new(AtomicUsize::new(0)),
            ahead_chunks: read_ahead_chunks(),
            fetch_ahead: fetch_ahead_chunks(),
            passthrough: AtomicBool::new(false),
            files: Mutex::new(OpenFiles::default()),
            completing: Arc::new(Mutex::new(HashSet::new())),
            trace: None,
        })
    }

    /// Record this mount's first reads with `trace` ([`super::trace`]).
    pub fn recording(mut self, trace: Option<Arc<super::trace::Recorder>>) -> LazyFs {
        self.trace = trace;
        self
    }

    fn node(&self, ino: INodeNo) -> Option<&Node> {
        self.nodes.get((ino.0 as usize).checked_sub(1)?)
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let n = self.nodes.get(ino as usize - 1)?;
        let e = &self.index.entries[n.entry];
        let (kind, size) = match e.kind {
            Kind::Dir => (FileType::Directory, 4096),
            Kind::File | Kind::Hardlink => (FileType::RegularFile, e.size),
            Kind::Symlink => (FileType::Symlink, e.size),
            Kind::Fifo => (FileType::NamedPipe, 0),
            Kind::Whiteout => (FileType::CharDevice, 0),
        };
        let t = if e.mtime >= 0 {
            UNIX_EPOCH + Duration::new(e.mtime as u64, e.mtime_nsec)
        } else {
            UNIX_EPOCH
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind,
            perm: (e.mode & 0o7777) as u16,
            nlink: n.nlink,
            uid: e.uid,
            gid: e.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    /// Bytes `[offset, offset + size)` of regular file `ino` (clipped at its end).
    fn read_range(&self, ino: INodeNo, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        let n = self.node(ino).ok_or(Errno::from_i32(libc::ENOENT))?;
        let e = &self.index.entries[n.entry];
        if e.kind != Kind::File {
            return Err(Errno::from_i32(libc::EINVAL));
        }
        let end = offset.saturating_add(size as u64).min(e.size);
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        let mut pos = offset;
        while pos < end {
            let i = (pos / CHUNK_SIZE) as usize;
            let c = e.chunks.get(i).ok_or(Errno::from_i32(libc::EIO))?;
            let base = i as u64 * CHUNK_SIZE;
            let to = (end - base).min(c.len);
            let bytes = self
                .rt
                .block_on(self.chunks.read(&self.index.data_digest, c, pos - base, to))
                .map_err(|err| {
                    tracing::error!(path = %e.path, chunk = %c.digest, error = %err, "lazy read failed: EIO");
                    Errno::from_i32(libc::EIO)
                })?;
            if bytes.len() as u64 != to - (pos - base) {
                tracing::error!(path = %e.path, chunk = %c.digest, "chunk shorter than its index entry: EIO");
                return Err(Errno::from_i32(libc::EIO));
            }
            out.extend_from_slice(&bytes);
            pos = base + to;
        }
        if let (Some(t), true) = (&self.trace, end > offset) {
            let chunks = (offset / CHUNK_SIZE) as usize..=((end - 1) / CHUNK_SIZE) as usize;
            t.read(n.entry, chunks, &self.rt);
        }
        self.read_ahead(ino.0, offset, end, &e.chunks);
        if end == e.size {
            self.complete_later(n.entry);
        }
        Ok(out)
    }

    /// In the background, make sure index entry `entry` (a regular file) has a verified
    /// complete-file copy ([`ChunkStore::complete`]) when all its chunks are cached, so
    /// that its later opens can use passthrough; skipped while [`MAX_COMPLETING`] others
    /// run or one for the same copy does, and while passthrough is off (nothing would
    /// use the copy).
    fn complete_later(&self, entry: usize) {
        if !self.passthrough.load(Ordering::Relaxed) {
            return;
        }
        let e = &self.index.entries[entry];
        let Some(key) = file_key(e.size, &e.chunks) else {
            return;
        };
        {
            let mut busy = self.completing.lock().unwrap_or_else(|p| p.into_inner());
            if busy.len() >= MAX_COMPLETING || !busy.insert(key.clone()) {
                return;
            }
        }
        let (store, busy) = (self.chunks.clone(), self.completing.clone());
        let (size, chunks) = (e.size, e.chunks.clone());
        self.rt.spawn_blocking(move || {
            store.complete(&key, size, &chunks);
            busy.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        });
    }

    /// After a read of `[offset, end)` of `ino`: when it continues the previous read of that
    /// inode (within one chunk) and reaches the second half of its chunk, advise the next
    /// [`read_ahead_chunks`] chunk files not advised yet, and fetch the missing ones among
    /// the next [`fetch_ahead_chunks`] in the background.
    fn read_ahead(&self, ino: u64, offset: u64, end: u64, chunks: &[super::format::ChunkRef]) {
        if self.ahead_chunks == 0 || end <= offset {
            return;
        }
        let last = (end - 1) / CHUNK_SIZE;
        let past_half = (end - 1) % CHUNK_SIZE >= CHUNK_SIZE / 2;
        let first = {
            let mut m = self.last_end.lock().unwrap_or_else(|p| p.into_inner());
            if m.len() >= MAX_TRACKED && !m.contains_key(&ino) {
                m.clear();
            }
            let prev = m.get(&ino).copied();
            let sequential =
                offset == 0 || prev.is_some_and(|(p, _)| p.abs_diff(offset) <= CHUNK_SIZE);
            let done = if sequential {
                prev.map_or(0, |(_, d)| d)
            } else {
                0
            };
            let upto = last + 1 + self.ahead_chunks;
            m.insert(
                ino,
                (end, if sequential && past_half { upto } else { done }),
            );
            if !(sequential && past_half) {
                return;
            }
            done.max(last + 1)
        };
        // Opening a chunk file may itself wait for the disk (its inode), so the advice is
        // given off the reader's path, by one background task per read-ahead step.
        // Chunks not advised yet, and those in the fetch window even when advised before
        // (a chunk that was missing then is fetched once the reader comes close).
        let fetch_upto = last + self.fetch_ahead;
        let todo: Vec<(u64, super::format::ChunkRef)> = (last + 1..last + 1 + self.ahead_chunks)
            .filter(|j| *j >= first || *j <= fetch_upto)
            .map_while(|j| chunks.get(j as usize).map(|c| (j, c.clone())))
            .collect();
        if todo.is_empty() || self.prefetching.fetch_add(1, Ordering::AcqRel) >= MAX_PREFETCHES {
            if !todo.is_empty() {
                self.prefetching.fetch_sub(1, Ordering::AcqRel);
            }
            return;
        }
        let (store, busy) = (self.chunks.clone(), self.prefetching.clone());
        let blob = self.index.data_digest.clone();
        self.rt.spawn(async move {
            let missing: Vec<_> = {
                let store = store.clone();
                tokio::task::spawn_blocking(move || {
                    todo.into_iter()
                        .filter(|(j, c)| !store.advise(c) && *j <= fetch_upto)
                        .map(|(_, c)| c)
                        .collect()
                })
                .await
                .unwrap_or_default()
            };
            for c in missing {
                store.prefetch(&blob, &c).await;
            }
            busy.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

fn file_type(k: Kind) -> FileType {
    match k {
        Kind::Dir => FileType::Directory,
        Kind::File | Kind::Hardlink => FileType::RegularFile,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Whiteout => FileType::CharDevice,
    }
}

impl Filesystem for LazyFs {
    fn init(&mut self, _req: &Request, config: &mut fuser::KernelConfig) -> std::io::Result<()> {
        // Requests of up to one chunk (the kernel caps them at its own maximum), and room
        // for the kernel's read-ahead requests in flight.
        let _ = config.set_max_write(MAX_REQUEST);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        if passthrough_wanted() {
            // Depth 1: the mount can be an overlayfs lower layer; backing files must be on
            // a file system that is not stacked itself.
            match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
                Ok(()) if config.set_max_stack_depth(1).is_ok() => {
                    self.passthrough.store(true, Ordering::Relaxed);
                    tracing::info!("FUSE passthrough on: complete files are read by the kernel");
                }
                _ => tracing::info!(
                    "this kernel offers no FUSE passthrough: every read goes through the daemon"
                ),
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = self
            .names
            .get((parent.0 as usize).wrapping_sub(1))
            .and_then(|m| m.get(name.as_bytes()))
            .and_then(|&ino| self.attr(ino));
        match found {
            Some(a) => reply.entry(&TTL, &a, Generation(0)),
            None => reply.error(Errno::from_i32(libc::ENOENT)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.node(ino).and_then(|_| self.attr(ino.0)) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::from_i32(libc::ENOENT)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.node(ino).map(|n| &self.index.entries[n.entry]) {
            Some(e) if e.kind == Kind::Symlink => {
                reply.data(e.target.as_deref().unwrap_or("").as_bytes())
            }
            _ => reply.error(Errno::from_i32(libc::EINVAL)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::from_i32(libc::EROFS));
        }
        let Some(n) = self.node(ino) else {
            return reply.error(Errno::from_i32(libc::ENOENT));
        };
        let e = &self.index.entries[n.entry];
        if e.kind != Kind::File {
            return reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
        }
        // Off (by setting, or after the kernel refused a backing file): no new backing
        // files, but an inode whose passthrough opens are still live keeps its backing
        // (the kernel refuses a cached-mode open of an inode in passthrough mode: EIO).
        let passthrough = self.passthrough.load(Ordering::Relaxed);
        let mut guard = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let files = &mut *guard;
        files.next_fh += 1;
        let fh = files.next_fh;
        let io = files.inodes.entry(ino.0).or_default();
        let mut backing = io.backing.upgrade();
        if backing.is_none() && io.cached == 0 && passthrough {
            let copy =
                file_key(e.size, &e.chunks).and_then(|k| self.chunks.open_complete(&k, e.size));
            if let Some(file) = copy {
                use std::os::fd::AsFd as _;
                match reply.open_backing(file.as_fd()) {
                    Ok(id) => {
                        let b = Arc::new(Backing { id, _file: file });
                        io.backing = Arc::downgrade(&b);
                        backing = Some(b);
                    }
                    Err(err) => {
                        tracing::warn!(path = %e.path, error = %err, "the kernel refused a passthrough backing file: reads go through the daemon from now on");
                        self.passthrough.store(false, Ordering::Relaxed);
                    }
                }
            }
        }
        match backing {
            Some(b) => {
                files.handles.insert(fh, (ino.0, Some(b.clone())));
                drop(guard);
                self.chunks.passthrough_opened();
                reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &b.id);
            }
            None => {
                io.cached += 1;
                files.handles.insert(fh, (ino.0, None));
                drop(guard);
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE);
                self.complete_later(n.entry);
            }
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut last_cached = None;
        {
            let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((ino, backing)) = files.handles.remove(&fh.0) {
                if let Some(io) = files.inodes.get_mut(&ino) {
                    if backing.is_none() {
                        io.cached = io.cached.saturating_sub(1);
                    }
                    // The last passthrough open of the inode closes its backing file.
                    drop(backing);
                    if io.cached == 0 && io.backing.strong_count() == 0 {
                        files.inodes.remove(&ino);
                        last_cached = Some(ino);
                    }
                }
            }
        }
        reply.ok();
        if let Some(n) = last_cached.and_then(|ino| self.node(INodeNo(ino))) {
            self.complete_later(n.entry);
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.read_range(ino, offset, size) {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(n) = self.node(ino) else {
            return reply.error(Errno::from_i32(libc::ENOENT));
        };
        let mut all: Vec<(u64, FileType, &[u8])> = vec![
            (ino.0, FileType::Directory, b"."),
            (n.parent, FileType::Directory, b".."),
        ];
        for (name, child) in &n.children {
            let k = self.index.entries[self.nodes[*child as usize - 1].entry].kind;
            all.push((*child, file_type(k), name));
        }
        for (i, (child, kind, name)) in all.iter().enumerate().skip(offset as usize) {
            if reply.add(
                INodeNo(*child),
                i as u64 + 1,
                *kind,
                OsStr::from_bytes(name),
            ) {
                break;
            }
        }
        reply.ok();
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let opaque = self
            .node(ino)
            .is_some_and(|n| self.index.entries[n.entry].opaque);
        if opaque && name.as_bytes() == crate::images::unpack::OPAQUE_XATTR.as_bytes() {
            if size == 0 {
                reply.size(1);
            } else {
                reply.data(b"y");
            }
        } else {
            reply.error(Errno::from_i32(libc::ENODATA));
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let opaque = self
            .node(ino)
            .is_some_and(|n| self.index.entries[n.entry].opaque);
        let mut v = Vec::new();
        if opaque {
            v.extend_from_slice(crate::images::unpack::OPAQUE_XATTR.as_bytes());
            v.push(0);
        }
        if size == 0 {
            reply.size(v.len() as u32);
        } else if (size as usize) < v.len() {
            reply.error(Errno::from_i32(libc::ERANGE));
        } else {
            reply.data(&v);
        }
    }
}
