//! Disk checkpoints of sandboxes and the forks made from them (DSec's `pack_diff`).
//!
//! A checkpoint is the sandbox's **writable layer only**, incremental on its image:
//!
//! * `function` / `container`: a copy of the overlayfs upper dir (`cp -a`: modes, owners,
//!   times, hard links, sparse files and every xattr, `trusted.overlay.*` included), so the
//!   overlay's own markers travel with it: a deleted image file is a whiteout (a character
//!   device 0/0) and a directory replaced after a delete is opaque
//!   (`trusted.overlay.opaque=y`), see the kernel's `Documentation/filesystems/overlayfs.rst`
//!   ("whiteouts and opaque directories"). Stored as `DATA/checkpoints/<ck>/layer/`.
//! * `microvm`: the scratch disk (a raw ext4 image holding the guest's overlay upper dir),
//!   after a `sync` in the guest, copied sparsely while the VM's cgroup is frozen: stored
//!   as `DATA/checkpoints/<ck>/disk.img`.
//! * `vm`: hard links to the VM's frozen qcow2 layers (`top.qcow2` and the layers below
//!   it), frozen by a live external snapshot; forks are new layers on that chain, sharing
//!   it by hard links instead of copying (`backends/qemu/vm/chain.rs`).
//!
//! `meta.json` ([`CheckpointMeta`]) sits next to the content; a checkpoint is built in
//! `<ck>.tmp/` and renamed into place, so a crash leaves no half-made checkpoint (leftover
//! `*.tmp` directories are removed by [`CheckpointStore::open`]).
//!
//! **Forks** copy the checkpoint into their own writable layer at create (the function
//! and container upper dir; the microVM's scratch disk, grown with `resize2fs` when the
//! fork asks for a larger disk). Decision, against a shared extra lower dir or a qcow2
//! overlay per fork: the layer's files are owned by the parent's host uid range, and every
//! sandbox has its own range ([`crate::backends::uids`]), so a shared lower dir would show
//! the fork's root files it does not own (an idmapped mount per fork would fix that, a
//! later step); one copy per fork keeps forks fully independent of the checkpoint, so a
//! checkpoint can be deleted while forks of it live (no refcount), and a fork of a fork
//! checkpoints exactly like any sandbox. The cost is one copy of the diff per fork
//! (the diff, not the image). Owners in the parent's range are shifted to the fork's
//! ([`copy_layer`]).
//!
//! The `vm` backend keeps the same lifetimes without copies: every holder (VM or
//! checkpoint directory) has its own hard link to each layer of its chain.
//!
//! While a create copies from a checkpoint, deleting it answers `Conflict`
//! ([`CheckpointStore::acquire`]).
use crate::node::{NodeError, NodeResult};
use sandlot_api::Backend;
use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Facts of one checkpoint, kept in `DATA/checkpoints/<ck>/meta.json`.
pub use sandlot_node_api::CheckpointMeta;

/// What a backend's checkpoint step reports ([`crate::backends::SandboxBackend::checkpoint`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Captured {
    /// Backend of the sandbox.
    pub backend: Backend,
    /// Its image.
    pub image: String,
    /// Container runtime.
    pub runtime: Option<String>,
    /// Parent's first host uid (see [`CheckpointMeta::uid_base`]).
    pub uid_base: Option<u32>,
    /// Parent's disk size in MiB.
    pub disk_mib: u64,
    /// See [`CheckpointMeta::image_version`].
    pub image_version: Option<String>,
}

/// A checkpoint a create copies from: its directory and facts.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// `DATA/checkpoints/<ck>`.
    pub dir: PathBuf,
    /// Its `meta.json`.
    pub meta: CheckpointMeta,
}

impl Checkpoint {
    /// The upper-dir copy (function, container).
    pub fn layer(&self) -> PathBuf {
        self.dir.join("layer")
    }

    /// The scratch-disk copy (microvm).
    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk.img")
    }
}

/// The node's checkpoints under `DATA/checkpoints`.
pub struct CheckpointStore {
    dir: PathBuf,
    /// Creates copying from each checkpoint right now.
    users: Arc<Mutex<HashMap<String, usize>>>,
}

/// Held while a create copies from a checkpoint; delete answers `Conflict` meanwhile.
pub struct CheckpointUse {
    id: String,
    users: Arc<Mutex<HashMap<String, usize>>>,
}

impl Drop for CheckpointUse {
    fn drop(&mut self) {
        let mut u = self.users.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = u.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                u.remove(&self.id);
            }
        }
    }
}

pub use sandlot_node_api::check_checkpoint_id as check_id;

impl CheckpointStore {
    /// Open (create, mode 0700) `dir`, removing half-made `*.tmp` checkpoints (and thawing
    /// the sandbox a copy of one had frozen when the node was killed).
    ///
    /// # Errors
    /// `Internal` when the directory cannot be created.
    pub fn open(dir: PathBuf) -> NodeResult<CheckpointStore> {
        std::fs::create_dir_all(&dir)
            .and_then(|_| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| NodeError::io(format!("create {}", dir.display()), e))?;
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().ends_with(".tmp") {
                    thaw_interrupted(&e.path());
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(CheckpointStore {
            dir,
            users: Default::default(),
        })
    }

    /// Directory of checkpoint `id` (need not exist).
    pub fn path(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// A fresh, empty `<id>.tmp` directory to build checkpoint `id` in.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad id; `Conflict` when the checkpoint exists; `Internal`.
    pub fn begin(&self, id: &str) -> NodeResult<PathBuf> {
        check_id(id)?;
        if self.path(id).exists() {
            return Err(NodeError::Conflict(format!(
                "checkpoint {id} already exists"
            )));
        }
        let tmp = self.dir.join(format!("{id}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir(&tmp)
            .and_then(|_| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| NodeError::io(format!("create {}", tmp.display()), e))?;
        Ok(tmp)
    }

    /// Write `meta.json` into `tmp` and rename it to the checkpoint's directory.
    ///
    /// # Errors
    /// `Internal` on I/O failures (then `tmp` is removed).
    pub fn commit(&self, tmp: &Path, meta: &CheckpointMeta) -> NodeResult<()> {
        let json = serde_json::to_vec_pretty(meta).expect("CheckpointMeta serialises");
        let res = std::fs::write(tmp.join("meta.json"), json)
            .and_then(|_| std::fs::rename(tmp, self.path(&meta.id)))
            .map_err(|e| NodeError::io(format!("commit checkpoint {}", meta.id), e));
        if res.is_err() {
            let _ = std::fs::remove_dir_all(tmp);
        }
        res
    }

    /// Checkpoint `id`, marked in use until the returned guard drops.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad id; `NotFound` when there is no such checkpoint.
    pub fn acquire(&self, id: &str) -> NodeResult<(Checkpoint, CheckpointUse)> {
        check_id(id)?;
        let guard = {
            let mut u = self.users.lock().unwrap_or_else(|p| p.into_inner());
            *u.entry(id.to_string()).or_default() += 1;
            CheckpointUse {
                id: id.to_string(),
                users: self.users.clone(),
            }
        };
        let dir = self.path(id);
        let meta: CheckpointMeta = std::fs::read(dir.join("meta.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| {
                NodeError::NotFound(format!("checkpoint {id} not found on this node"))
            })?;
        Ok((Checkpoint { dir, meta }, guard))
    }

    /// Remove checkpoint `id`; an unknown id is fine.
    ///
    /// # Errors
    /// `Conflict` while a create copies from it; `Internal` when removal fails.
    pub fn delete(&self, id: &str) -> NodeResult<()> {
        if check_id(id).is_err() {
            return Ok(());
        }
        if self
            .users
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(id)
        {
            return Err(NodeError::Conflict(format!(
                "checkpoint {id} is being copied into a new sandbox; retry when that create ends"
            )));
        }
        // Renamed out of sight at once (a `.tmp` name, which a node start sweeps away),
        // removed in the background: a big tree takes seconds, and no caller waits for it.
        let dir = self.path(id);
        let trash = self.dir.join(format!("{id}.deleted.tmp"));
        match std::fs::rename(&dir, &trash) {
            Ok(()) => {
                std::thread::spawn(move || {
                    if let Err(e) = std::fs::remove_dir_all(&trash) {
                        tracing::warn!(path = %trash.display(), error = %e, "removing a deleted checkpoint failed");
                    }
                });
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(NodeError::io(format!("remove {}", dir.display()), e)),
        }
    }

    /// Ids of the checkpoints on disk.
    pub fn list(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| check_id(n).is_ok())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

/// Allocated bytes of every file under `p` (like `du -s --block-size=1`; hard links once).
pub fn disk_usage(p: &Path) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(md) = std::fs::symlink_metadata(&d) else {
            continue;
        };
        if md.nlink() > 1 && !md.is_dir() && !seen.insert((md.dev(), md.ino())) {
            continue;
        }
        total += md.blocks() * 512;
        if md.is_dir() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                stack.extend(rd.flatten().map(|e| e.path()));
            }
        }
    }
    total
}

/// Runs a copy tool (`cp`, `resize2fs`) to its end. It dies with the thread that waits for
/// it (`PR_SET_PDEATHSIG`): a node killed mid-copy leaves no copy writing on into a
/// half-made checkpoint that the next start removes.
fn run(cmd: &mut std::process::Command) -> NodeResult<()> {
    use std::os::unix::process::CommandExt;
    let what = format!("{cmd:?}");
    // SAFETY: after fork, before exec: prctl(2) only.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| NodeError::io(format!("run {what}"), e))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    // A full destination file system is the caller's size choice, not a node fault.
    if err.contains("No space left on device") {
        return Err(NodeError::ResourceExhausted(format!(
            "the checkpoint does not fit the new sandbox's disk: {}",
            err.trim()
        )));
    }
    Err(NodeError::io(
        format!("{what}: {}", err.trim()),
        std::io::Error::other(format!("exit {}", out.status)),
    ))
}

/// Copy the tree `src` into the directory `dst` (created when missing; merged into when it
/// exists) with `cp -a --sparse=always` (modes, owners, times, hard links, sparse files,
/// every xattr: overlay whiteouts and opaque markers survive), then, with `shift = Some((from,
/// to))`, re-own every entry whose uid (gid) lies in `from..from+65536` to the same offset
/// in `to..`; set-id bits cleared by the kernel's chown are restored. Blocking.
///
/// # Errors
/// `ResourceExhausted` when `dst`'s file system is full; `Conflict` when the tree holds a
/// path too long for `cp` to name on either side (`too_long_path`); `Internal` otherwise.
pub fn copy_layer(src: &Path, dst: &Path, shift: Option<(u32, u32)>) -> NodeResult<()> {
    std::fs::create_dir_all(dst)
        .map_err(|e| NodeError::io(format!("create {}", dst.display()), e))?;
    let mut from = src.as_os_str().to_owned();
    from.push("/.");
    let copied = run(std::process::Command::new("cp")
        .args(["-a", "--sparse=always", "--no-target-directory"])
        .arg(&from)
        .arg(dst));
    if let Err(NodeError::Internal { .. }) = &copied {
        // A sandbox may nest directories deeper than any full path can name (PATH_MAX);
        // `cp` works with full paths. The sandbox's content, not a node fault: say which.
        let base = from.len().max(dst.as_os_str().len());
        if let Some(rel) = too_long_path(src, base) {
            let shown: String = rel.to_string_lossy().chars().take(80).collect();
            return Err(NodeError::Conflict(format!(
                "the sandbox holds a path too long to checkpoint (over {} bytes): /{shown}…; \
                 remove or shorten it and retry",
                libc::PATH_MAX - 1 - base as i32
            )));
        }
    }
    copied?;
    if let Some((a, b)) = shift.filter(|(a, b)| a != b) {
        shift_owners(dst, a, b)?;
    }
    Ok(())
}

/// The first entry under `root` (relative to it) whose path, after a prefix of `base` bytes
/// (the longer of the copy's two roots), would not fit in `PATH_MAX` (4096 bytes, the
/// terminating NUL included); `None` when every one fits. Descends only while the
/// directory's own path fits, so every `read_dir` here is itself nameable. Blocking.
fn too_long_path(root: &Path, base: usize) -> Option<PathBuf> {
    let limit = (libc::PATH_MAX as usize).saturating_sub(1 + base);
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(root.join(&rel)) else {
            continue;
        };
        for e in rd.flatten() {
            let child = rel.join(e.file_name());
            // `/` between the prefix and the relative path.
            if child.as_os_str().len() + 1 > limit {
                return Some(child);
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(child);
            }
        }
    }
    None
}

/// See [`copy_layer`]: re-own the entries under `root` (itself included) from the id range
/// at `from` to the one at `to` (65536 ids each).
pub fn shift_owners(root: &Path, from: u32, to: u32) -> NodeResult<()> {
    use std::os::unix::fs::lchown;
    let map = |id: u32| {
        if id >= from && id - from < crate::backends::uids::UID_COUNT {
            Some(id - from + to)
        } else {
            None
        }
    };
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = std::fs::symlink_metadata(&p)
            .map_err(|e| NodeError::io(format!("stat {}", p.display()), e))?;
        let (uid, gid) = (map(md.uid()), map(md.gid()));
        if uid.is_some() || gid.is_some() {
            lchown(
                &p,
                Some(uid.unwrap_or(md.uid())),
                Some(gid.unwrap_or(md.gid())),
            )
            .map_err(|e| NodeError::io(format!("chown {}", p.display()), e))?;
            // chown(2) clears set-user-ID and set-group-ID bits of non-directories.
            if !md.is_symlink() && md.mode() & 0o6000 != 0 && !md.is_dir() {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(md.mode() & 0o7777))
                    .map_err(|e| NodeError::io(format!("chmod {}", p.display()), e))?;
            }
        }
        if md.is_dir() {
            let rd = std::fs::read_dir(&p)
                .map_err(|e| NodeError::io(format!("read {}", p.display()), e))?;
            stack.extend(rd.flatten().map(|e| e.path()));
        }
    }
    Ok(())
}

/// Sparse copy of a disk image file `src` to `dst` (`cp --reflink=auto --sparse=always`:
/// shares extents where the file system can). Blocking.
///
/// # Errors
/// `Internal` (or `ResourceExhausted` when the node's disk is full).
pub fn copy_disk(src: &Path, dst: &Path) -> NodeResult<()> {
    run(std::process::Command::new("cp")
        .args(["--reflink=auto", "--sparse=always"])
        .arg(src)
        .arg(dst))
}

/// Grow the ext4 image `img` to `mib` MiB (`truncate` + `resize2fs`); smaller or equal sizes
/// leave it as it is. Blocking.
///
/// # Errors
/// `Internal` when resizing fails.
pub fn grow_ext4(img: &Path, mib: u64) -> NodeResult<()> {
    let len = std::fs::metadata(img)
        .map_err(|e| NodeError::io(format!("stat {}", img.display()), e))?
        .len();
    if mib << 20 <= len {
        return Ok(());
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(img)
        .and_then(|f| f.set_len(mib << 20))
        .map_err(|e| NodeError::io(format!("grow {}", img.display()), e))?;
    run(std::process::Command::new("resize2fs").arg("-f").arg(img))
}

/// A fresh `/etc/machine-id` value: 32 lowercase hex digits of 128 random bits, the format
/// of machine-id(5).
pub fn new_machine_id() -> String {
    let b: [u8; 16] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Write a fresh machine-id(5) into the overlay upper dir `upper` as `etc/machine-id`
/// (mode 0444, owned by `uid` = root inside the sandbox), replacing any a checkpoint
/// carried. `upper/etc` is created owned by host root (0755) when missing, as the image's
/// `/etc` is, so `/etc` stays read-only to a function sandbox. Blocking.
///
/// # Errors
/// `Internal` on I/O failures.
pub fn write_machine_id(upper: &Path, uid: u32) -> NodeResult<()> {
    let etc = upper.join("etc");
    // Never through a symlink (a fork's seed is sandbox-written): `etc` that is not a
    // directory is replaced by one.
    match std::fs::symlink_metadata(&etc) {
        Ok(md) if md.is_dir() => {}
        found => {
            if found.is_ok() {
                std::fs::remove_file(&etc)
                    .map_err(|e| NodeError::io(format!("remove {}", etc.display()), e))?;
            }
            std::fs::create_dir(&etc)
                .and_then(|_| {
                    std::fs::set_permissions(&etc, std::fs::Permissions::from_mode(0o755))
                })
                .map_err(|e| NodeError::io(format!("create {}", etc.display()), e))?;
        }
    }
    let f = etc.join("machine-id");
    let tmp = etc.join(".machine-id.sandlot");
    let _ = std::fs::remove_file(&tmp);
    std::fs::write(&tmp, format!("{}\n", new_machine_id()))
        .and_then(|_| std::os::unix::fs::chown(&tmp, Some(uid), Some(uid)))
        .and_then(|_| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444)))
        .and_then(|_| std::fs::rename(&tmp, &f))
        .map_err(|e| NodeError::io(format!("write {}", f.display()), e))
}

/// How long freezing a sandbox for a checkpoint may take.
const FREEZE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Freezer transitions of every sandbox of this node, serialised: pause, resume and the
/// freeze/thaw around checkpoint copies ([`frozen_copy`]), so none of them undoes another.
/// Value: the checkpoint copies under way per sandbox id.
pub(crate) static FREEZER: std::sync::LazyLock<
    tokio::sync::Mutex<std::collections::HashMap<String, usize>>,
> = std::sync::LazyLock::new(Default::default);

/// Whether a checkpoint copy of `id` is under way (its group stays frozen until the last
/// one ends; a resume meanwhile only clears `paused`, and that copy's end thaws).
pub(crate) fn copying(f: &std::collections::HashMap<String, usize>, id: &str) -> bool {
    f.get(id).is_some_and(|n| *n > 0)
}

/// One copy of `id` ended: the number still under way.
fn release(f: &mut std::collections::HashMap<String, usize>, id: &str) -> usize {
    let n = f.get_mut(id).map_or(0, |n| {
        *n -= 1;
        *n
    });
    if n == 0 {
        f.remove(id);
    }
    n
}

/// Run the blocking `copy` while `group` is frozen, under the read side of the sandbox's
/// lifecycle lock `deleting` so no delete runs meanwhile: the copy sees the writable layer
/// at one instant of the sandbox's processes. The first of overlapping copies freezes the
/// group (unless it is frozen already: a paused sandbox), the last one thaws it
/// unless the sandbox is `paused` by then (a pause during the copy keeps it frozen). File
/// API writes made from the host at the same moment may or may not be in it.
///
/// # Errors
/// `NotFound` when the sandbox is being deleted; the freezer's or `copy`'s error.
pub(crate) async fn frozen_copy<T: Send + 'static>(
    id: &str,
    dest: &Path,
    deleting: &tokio::sync::RwLock<bool>,
    paused: &std::sync::atomic::AtomicBool,
    group: &crate::cgroups::Cgroup,
    copy: impl FnOnce() -> NodeResult<T> + Send + 'static,
) -> NodeResult<T> {
    use crate::sys::spawn_blocking;
    use std::sync::atomic::Ordering::SeqCst;
    let guard = deleting.read().await;
    if *guard {
        return Err(NodeError::NotFound(format!(
            "sandbox {id} is being deleted"
        )));
    }
    // While the copy holds the group frozen, `dest/FROZEN_MARKER` names it: a node killed
    // mid-copy thaws it at its next start ([`CheckpointStore::open`]) instead of leaving a
    // running sandbox frozen for good.
    let marker = dest.join(FROZEN_MARKER);
    {
        let mut f = FREEZER.lock().await;
        // The group's own state, not `paused`: a pause sets that before it waits for the
        // set-ups this copy's read side counts among ([`crate::backends::pause`]), so it
        // may be set while the group still runs. Exact under FREEZER (every freeze and
        // thaw holds it).
        let frozen = group.freeze_requested();
        if !frozen {
            let dirs: Vec<String> = group.dirs().map(|d| d.display().to_string()).collect();
            std::fs::write(&marker, dirs.join("\n"))
                .map_err(|e| NodeError::io(format!("write {}", marker.display()), e))?;
        }
        let n = f.entry(id.to_owned()).or_insert(0);
        *n += 1;
        if *n == 1 && !frozen {
            let g = group.clone();
            let frozen =
                spawn_blocking(move || Ok(g.freeze(std::time::Instant::now() + FREEZE_TIMEOUT)?))
                    .await;
            if let Err(e) = frozen {
                release(&mut f, id);
                return Err(e);
            }
        }
    }
    let out = spawn_blocking(copy).await;
    let thawed = {
        let mut f = FREEZER.lock().await;
        if release(&mut f, id) == 0 && !paused.load(SeqCst) {
            let g = group.clone();
            spawn_blocking(move || Ok(g.thaw()?)).await
        } else {
            Ok(())
        }
    };
    drop(guard);
    let _ = std::fs::remove_file(&marker);
    let out = out?;
    thawed?;
    Ok(out)
}

/// File in a checkpoint's build directory naming the cgroup directories its copy froze.
const FROZEN_MARKER: &str = "frozen-groups";

/// Thaws the groups named by `tmp`'s [`FROZEN_MARKER`] (a copy the node was killed in).
fn thaw_interrupted(tmp: &Path) {
    let Ok(list) = std::fs::read_to_string(tmp.join(FROZEN_MARKER)) else {
        return;
    };
    for d in list.lines().map(Path::new) {
        let (file, value) = if d.join("freezer.state").exists() {
            ("freezer.state", "THAWED")
        } else {
            ("cgroup.freeze", "0")
        };
        match std::fs::write(d.join(file), value) {
            Ok(()) => {
                tracing::warn!(group = %d.display(), "thawed a sandbox a checkpoint copy froze when the node was killed")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(group = %d.display(), error = %e, "could not thaw a group an interrupted checkpoint froze")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    fn cstr(p: &Path) -> std::ffi::CString {
        std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap()
    }

    fn set_xattr(p: &Path, name: &str, v: &[u8]) {
        let (p, n) = (cstr(p), std::ffi::CString::new(name).unwrap());
        // SAFETY: valid NUL-terminated strings and a buffer of v.len() bytes.
        let r = unsafe { libc::lsetxattr(p.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    }

    /// A directory chain `root/d…/d…/…` of `depth` names of 200 bytes, made with
    /// mkdirat(2) relative to each parent's descriptor (the full path outgrows PATH_MAX).
    fn deep_tree(root: &Path, depth: usize) {
        use nix::fcntl::{open, openat, OFlag};
        use nix::sys::stat::Mode;
        let name = "d".repeat(200);
        let mut fd = open(root, OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        for _ in 0..depth {
            nix::sys::stat::mkdirat(&fd, name.as_str(), Mode::from_bits_truncate(0o755)).unwrap();
            fd = openat(&fd, name.as_str(), OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        }
    }

    #[test]
    fn a_path_too_long_to_copy_is_a_conflict_naming_it() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("upper");
        std::fs::create_dir_all(src.join("etc")).unwrap();
        std::fs::write(src.join("etc/keep"), b"x").unwrap();
        // Fits: found by neither the check nor cp.
        assert_eq!(too_long_path(&src, src.as_os_str().len()), None);
        copy_layer(&src, &t.path().join("ok"), None).unwrap();
        assert_eq!(std::fs::read(t.path().join("ok/etc/keep")).unwrap(), b"x");
        // The prefix counts: after 4090 bytes of it, `etc` fits and `etc/keep` does not.
        assert_eq!(too_long_path(&src, 4090), Some(PathBuf::from("etc/keep")));
        // 25 levels of 200 bytes: ~5 KB below the root.
        deep_tree(&src, 25);
        match copy_layer(&src, &t.path().join("deep"), None) {
            Err(NodeError::Conflict(m)) => {
                assert!(m.contains("path too long to checkpoint"), "{m}");
                assert!(m.contains(&"d".repeat(80)), "names the path: {m}");
                assert!(
                    !m.contains(&*t.path().to_string_lossy()),
                    "no host path: {m}"
                );
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
    }

    fn get_xattr(p: &Path, name: &str) -> Vec<u8> {
        let (p, n) = (cstr(p), std::ffi::CString::new(name).unwrap());
        let mut buf = vec![0u8; 256];
        // SAFETY: valid NUL-terminated strings and a writable buffer of buf.len() bytes.
        let r =
            unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        assert!(r >= 0, "{}", std::io::Error::last_os_error());
        buf.truncate(r as usize);
        buf
    }

    #[test]
    fn ids_are_checked() {
        assert!(check_id("ck-0123456789abcdef0123").is_ok());
        for bad in [
            "",
            "ck-",
            "ck-0123456789ABCDEF0123",
            "sb-0123456789abcdef0123",
            "ck-../x",
        ] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    /// Whiteouts (char 0/0), opaque markers (`trusted.overlay.opaque`), owners in the
    /// parent's range and set-id bits survive a copy with an owner shift.
    #[test]
    fn copy_keeps_overlay_markers_and_shifts_owners() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIP: needs root (mknod, chown, trusted.* xattrs)");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        let dst = t.path().join("dst");
        std::fs::create_dir_all(src.join("opaque")).unwrap();
        std::fs::write(src.join("opaque/f"), b"x").unwrap();
        set_xattr(&src.join("opaque"), "trusted.overlay.opaque", b"y");
        nix::sys::stat::mknod(
            &src.join("gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::empty(),
            0,
        )
        .unwrap();
        std::fs::write(src.join("mine"), b"y").unwrap();
        std::os::unix::fs::chown(src.join("mine"), Some(200_005), Some(200_005)).unwrap();
        std::fs::set_permissions(src.join("mine"), std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        std::fs::write(src.join("hosts"), b"z").unwrap();
        copy_layer(&src, &dst, Some((200_000, 300_000))).unwrap();
        let md = std::fs::symlink_metadata(dst.join("gone")).unwrap();
        assert!(md.file_type().is_char_device() && md.rdev() == 0);
        assert_eq!(
            get_xattr(&dst.join("opaque"), "trusted.overlay.opaque"),
            b"y"
        );
        let mine = std::fs::metadata(dst.join("mine")).unwrap();
        assert_eq!((mine.uid(), mine.gid()), (300_005, 300_005));
        assert_eq!(mine.mode() & 0o7777, 0o4755);
        assert_eq!(std::fs::metadata(dst.join("hosts")).unwrap().uid(), 0);
        assert!(disk_usage(&dst) > 0);
        write_machine_id(&dst, 300_000).unwrap();
        let id = std::fs::read_to_string(dst.join("etc/machine-id")).unwrap();
        assert_eq!(id.trim().len(), 32);
    }
}
