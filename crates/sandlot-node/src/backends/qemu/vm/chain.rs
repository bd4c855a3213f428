//! Disk checkpoints and forks of the `vm` backend: qcow2 backing chains held together by
//! hard links.
//!
//! A VM's disk is a chain of qcow2 files (QEMU's `docs/interop/qcow2.txt`: each file's
//! header names its backing file): the image's shared read-only base, then zero or more
//! frozen layers, then the one writable **active** layer QEMU writes to.
//!
//! **Holders.** Every directory that uses a chain holds a hard link to each file of it
//! except the shared base, so files live exactly as long as someone uses them, without a
//! reference count: a sandbox directory (`vms/<id>/`), a checkpoint directory
//! (`checkpoints/<ck>/`). Layer files are named `disk.qcow2` (a cold-booted VM's first
//! layer) or `layer-<16 hex>.qcow2` (random, unique in a chain); each names its backing
//! file by that *relative* name (resolved in the file's own directory, qcow2.txt "backing
//! file name"), the bottom layer the base by its absolute path. So a chain resolves in any
//! holder that links the same names, and deleting a checkpoint while forks use it, or its
//! source while the checkpoint lives, removes only that holder's links.
//!
//! **Checkpoint** ([`snapshot`]): after a guest `sync`, a new empty layer is created on
//! top of the active one (`qemu-img create -u -b <active>`), added to the running QEMU
//! (QMP `blockdev-add` with `"backing": null`) and installed as the device's new active
//! layer (QMP `blockdev-snapshot`, which drains in-flight I/O first, so the old layer is
//! the disk at one instant; QEMU reopens it read-only). The old active layer is now frozen
//! (mode 0444); its chain is linked into the checkpoint directory, the frozen top as
//! [`TOP`]. The guest keeps running throughout: vCPUs are not stopped (a node killed
//! mid-checkpoint can then never leave the guest stopped); the disk is crash-consistent at
//! the snapshot instant, and everything written before the request is in it (the `sync`).
//!
//! **Fork** ([`seed_fork`]): the checkpoint's chain is linked into the fork's directory
//! (the top under a fresh layer name) and a new active layer is created on top, sized for
//! the fork's `disk_mib` (a qcow2 layer may be larger than its backing file; the guest
//! grows its ext4 online at boot).
//!
//! **Owners** (QEMU runs as an unprivileged uid per sandbox, see [`crate::backends::qemu`]):
//! the VM directory is root's (group = the VM's uid, mode 0710), so QEMU cannot create a
//! layer itself: the node creates it as root and hands it to the uid (owner and group =
//! uid, mode 0600, [`crate::backends::qemu::give_file`]) before `blockdev-add`. A frozen
//! layer becomes root's, group = the QEMUs' shared group, mode 0440
//! ([`crate::backends::qemu::share_read_only`]): its own QEMU and every fork's (other uids,
//! all in that group) read it as a backing file, none writes it. Hard links share the
//! inode, so the checkpoint's links (in `DATA/checkpoints/`, root only) and every holder's
//! have the same owner and mode; a QEMU reaches only the links in its own VM directory.
//!
//! QEMU's node names are the layer file stems (`-drive node-name=`, `blockdev-add
//! node-name`), so `query-block` tells which file is active now, after any number of
//! checkpoints and node restarts, without extra state on disk.
use crate::node::{NodeError, NodeResult};
use crate::qmp::Qmp;
use serde_json::{json, Value};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Name of a checkpoint's frozen top layer in its directory.
pub const TOP: &str = "top.qcow2";
/// File stem of a cold-booted VM's first layer.
pub const FIRST: &str = "disk";
use crate::backends::qemu::QMP_SOCK;
/// How long one QMP answer may take (a `blockdev-snapshot` drains the disk's I/O).
const QMP_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest chain followed (a loop in corrupt headers stops here).
const MAX_CHAIN: usize = 4096;

/// Who gets a chain's files (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Owners {
    /// The running VM's QEMU uid (its new active layer is given to it); `None`: QEMU runs
    /// as root (a VM of an older node).
    pub qemu: Option<u32>,
    /// The group of every QEMU (frozen layers' group), [`QemuUids::group`].
    ///
    /// [`QemuUids::group`]: crate::backends::qemu::QemuUids::group
    pub group: Option<u32>,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> NodeError {
    NodeError::io(
        format!("{}: {why}", path.display()),
        std::io::Error::other("bad qcow2 chain"),
    )
}

/// A fresh `layer-<16 hex>` stem.
pub fn new_layer() -> String {
    format!("layer-{:016x}", rand::random::<u64>())
}

/// Whether `stem` is a layer stem this backend makes (`disk`, `layer-<16 hex>`): nothing
/// else is ever resolved as a sibling file.
pub fn is_layer(stem: &str) -> bool {
    stem == FIRST
        || stem.strip_prefix("layer-").is_some_and(|h| {
            h.len() == 16 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
}

/// The backing file name in the header of the qcow2 file `path` (qcow2.txt: header bytes
/// 8..16 `backing_file_offset`, 16..20 `backing_file_size`, big-endian); `None` when it
/// has none.
///
/// # Errors
/// `Internal` when the file is unreadable or not qcow2.
pub fn backing_of(path: &Path) -> NodeResult<Option<String>> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| NodeError::io(format!("open {}", path.display()), e))?;
    let mut hdr = [0u8; 20];
    f.read_exact(&mut hdr)
        .map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
    if &hdr[..4] != b"QFI\xfb" {
        return Err(bad(path, "not a qcow2 file"));
    }
    let off = u64::from_be_bytes(hdr[8..16].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(hdr[16..20].try_into().expect("4 bytes")) as usize;
    if off == 0 || len == 0 {
        return Ok(None);
    }
    if len > 1023 {
        return Err(bad(path, "backing file name longer than 1023 bytes"));
    }
    let mut name = vec![0u8; len];
    f.seek(SeekFrom::Start(off))
        .and_then(|_| f.read_exact(&mut name))
        .map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
    String::from_utf8(name)
        .map(Some)
        .map_err(|_| bad(path, "backing file name is not UTF-8"))
}

/// The sibling layer files below `top` (which lies in `dir`), nearest first, up to the
/// first absolute backing name (the image's base, not included).
///
/// # Errors
/// `Internal` on an unreadable header, a sibling name this backend never writes, or a
/// chain longer than [`MAX_CHAIN`].
pub fn ancestors(dir: &Path, top: &Path) -> NodeResult<Vec<String>> {
    let mut out = Vec::new();
    let mut cur = top.to_path_buf();
    while let Some(name) = backing_of(&cur)? {
        if name.starts_with('/') {
            return Ok(out);
        }
        let stem = name.strip_suffix(".qcow2").unwrap_or("");
        if !is_layer(stem) || out.len() >= MAX_CHAIN {
            return Err(bad(&cur, format!("unexpected backing file {name:?}")));
        }
        cur = dir.join(&name);
        out.push(name);
    }
    Ok(out)
}

/// The image base the chain of the checkpoint in `ck_dir` backs onto: the absolute
/// backing file of its bottom layer (`None` for a chain without one). Blocking.
///
/// # Errors
/// As [`ancestors`].
pub fn base_of(ck_dir: &Path) -> NodeResult<Option<PathBuf>> {
    let top = ck_dir.join(TOP);
    let bottom = match ancestors(ck_dir, &top)?.pop() {
        Some(name) => ck_dir.join(name),
        None => top,
    };
    Ok(backing_of(&bottom)?
        .filter(|b| b.starts_with('/'))
        .map(PathBuf::from))
}

/// Hard-links `src` to `dst`, copying (sparse, reflinked where possible) when they lie on
/// different file systems.
fn link(src: &Path, dst: &Path) -> NodeResult<()> {
    match std::fs::hard_link(src, dst) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => crate::checkpoints::copy_disk(src, dst),
        Err(e) => Err(NodeError::io(
            format!("link {} to {}", src.display(), dst.display()),
            e,
        )),
    }
}

/// Runs `qemu-img create -q -f qcow2 -u -F qcow2 -b <backing> <out> <size>` (`-u`: the
/// backing file is not opened, QEMU holds it).
fn create_layer(qemu_img: &Path, backing: &str, out: &Path, size: u64) -> NodeResult<()> {
    super::run_tool(
        std::process::Command::new(qemu_img)
            .args(["create", "-q", "-f", "qcow2", "-u", "-F", "qcow2", "-b"])
            .arg(backing)
            .arg(out)
            .arg(size.to_string()),
        "qemu-img create",
    )
}

/// The stem of the layer QEMU writes to now: the node name of the device `root`
/// (`query-block`); an automatic name (`#block…`, a VM started before node names) means
/// the first layer.
fn active_stem(q: &mut Qmp) -> NodeResult<String> {
    let blocks = q.execute("query-block", None)?;
    let node = blocks
        .as_array()
        .into_iter()
        .flatten()
        .find(|b| b.get("device").and_then(Value::as_str) == Some("root"))
        .and_then(|b| b.pointer("/inserted/node-name"))
        .and_then(Value::as_str)
        .unwrap_or("");
    if node.starts_with('#') || node.is_empty() {
        return Ok(FIRST.into());
    }
    if !is_layer(node) {
        return Err(NodeError::io(
            format!("the VM's disk node {node:?} is not a layer of this backend"),
            std::io::Error::other("unexpected node name"),
        ));
    }
    Ok(node.to_string())
}

/// The stem of the layer the running VM in `dir` writes to now (QMP `query-block`).
/// Blocking.
///
/// # Errors
/// `Internal` when QMP fails.
pub fn active_layer(dir: &Path) -> NodeResult<String> {
    let mut q = Qmp::connect(
        &dir.join(QMP_SOCK),
        Instant::now() + Duration::from_secs(5),
        QMP_TIMEOUT,
    )?;
    active_stem(&mut q)
}

/// Freezes the active layer of the running VM in `dir` (QMP socket [`QMP_SOCK`]) and links
/// its chain into the empty directory `dest` (see the module docs); the new active layer
/// goes to `owners.qemu`, the frozen one to root and `owners.group`. Blocking.
///
/// # Errors
/// `Conflict` when the VM has no QMP socket (started by an older node); `Internal` on QMP
/// or file failures (a layer that could not be installed is removed again).
pub fn snapshot(qemu_img: &Path, dir: &Path, dest: &Path, owners: Owners) -> NodeResult<()> {
    let sock = dir.join(QMP_SOCK);
    if !sock.exists() {
        return Err(NodeError::Conflict(
            "this VM was started by an older node without a QMP socket; it cannot be checkpointed (create it again)".into(),
        ));
    }
    let mut q = Qmp::connect(&sock, Instant::now() + Duration::from_secs(5), QMP_TIMEOUT)?;
    let active = active_stem(&mut q)?;
    let frozen = dir.join(format!("{active}.qcow2"));
    let size = super::qcow2_size(&frozen)?;
    let next = new_layer();
    let next_path = dir.join(format!("{next}.qcow2"));
    create_layer(qemu_img, &format!("{active}.qcow2"), &next_path, size)?;
    // QEMU opens the new layer by name as its uid (it cannot create files in `dir`).
    if let Some(uid) = owners.qemu {
        if let Err(e) = crate::backends::qemu::give_file(&next_path, uid) {
            let _ = std::fs::remove_file(&next_path);
            return Err(e);
        }
    }
    let added = q.execute(
        "blockdev-add",
        Some(json!({
            "driver": "qcow2",
            "node-name": next,
            "discard": "unmap",
            "file": {"driver": "file", "filename": next_path.to_string_lossy()},
            "backing": null,
        })),
    );
    if let Err(e) = added {
        let _ = std::fs::remove_file(&next_path);
        return Err(e.into());
    }
    if let Err(e) = q.execute(
        "blockdev-snapshot",
        Some(json!({"node": "root", "overlay": next})),
    ) {
        let _ = q.execute("blockdev-del", Some(json!({"node-name": next})));
        let _ = std::fs::remove_file(&next_path);
        return Err(e.into());
    }
    drop(q);
    // QEMU reopened it read-only (`blockdev-snapshot`); it must not write it again.
    crate::backends::qemu::share_read_only(&frozen, owners.group)?;
    for name in ancestors(dir, &frozen)? {
        // Already so, unless an earlier checkpoint failed between its switch and its chown.
        crate::backends::qemu::share_read_only(&dir.join(&name), owners.group)?;
        link(&dir.join(&name), &dest.join(&name))?;
    }
    link(&frozen, &dest.join(TOP))
}

/// Links the chain of the checkpoint in `ck_dir` into the new VM directory `dir` and
/// creates the fork's active layer on it, `grow` bytes larger than the checkpoint's top;
/// the active layer's stem. Every linked layer is root's, group `group`, mode 0440 (already
/// so unless a link had to be a copy across file systems); the active layer is root's
/// until the caller gives it to the fork's uid. Blocking.
///
/// # Errors
/// `Internal` on a damaged checkpoint chain or file failures.
pub fn seed_fork(
    qemu_img: &Path,
    ck_dir: &Path,
    dir: &Path,
    grow: u64,
    group: Option<u32>,
) -> NodeResult<String> {
    let top = ck_dir.join(TOP);
    for name in ancestors(ck_dir, &top)? {
        link(&ck_dir.join(&name), &dir.join(&name))?;
        crate::backends::qemu::share_read_only(&dir.join(&name), group)?;
    }
    let below = new_layer();
    link(&top, &dir.join(format!("{below}.qcow2")))?;
    crate::backends::qemu::share_read_only(&dir.join(format!("{below}.qcow2")), group)?;
    let size = super::qcow2_size(&top)? + grow;
    let active = new_layer();
    create_layer(
        qemu_img,
        &format!("{below}.qcow2"),
        &dir.join(format!("{active}.qcow2")),
        size,
    )?;
    Ok(active)
}

/// `DIR/<stem>.qcow2`.
pub fn layer_path(dir: &Path, stem: &str) -> PathBuf {
    dir.join(format!("{stem}.qcow2"))
}

/// Copies (sparse) the chain of the stopped VM in `dir` whose active layer is `active` (a
/// stem) into the empty directory `dest` under the same names, for the shared snapshot
/// store ([`crate::backends::qemu::store`]): the file names, active layer first, down to the
/// bottom layer, and the bottom layer's backing file (the image disk, absolute; `None`
/// for a disk without one). Blocking.
///
/// # Errors
/// `Internal` on a damaged chain or copy failures.
pub fn copy_out(
    dir: &Path,
    active: &str,
    dest: &Path,
) -> NodeResult<(Vec<String>, Option<PathBuf>)> {
    if !is_layer(active) {
        return Err(bad(&layer_path(dir, active), "not a layer of this backend"));
    }
    let top = layer_path(dir, active);
    let mut names = vec![format!("{active}.qcow2")];
    names.extend(ancestors(dir, &top)?);
    for n in &names {
        crate::checkpoints::copy_disk(&dir.join(n), &dest.join(n))?;
    }
    let bottom = dest.join(names.last().expect("at least the active layer"));
    let base = backing_of(&bottom)?.map(PathBuf::from);
    Ok((names, base))
}

/// The format recorded in qcow2 file `path` for its backing file: the header extension
/// "backing file format name" (type `0xe2792aca`; QEMU's `docs/interop/qcow2.txt`), which
/// this backend always writes (`qemu-img create -F`, `rebase -F`). `None` when absent.
///
/// # Errors
/// `Internal` on an unreadable file, one that is not qcow2, or a malformed extension.
pub fn backing_format_of(path: &Path) -> NodeResult<Option<String>> {
    const BACKING_FORMAT: u32 = 0xe279_2aca;
    let mut f = std::fs::File::open(path)
        .map_err(|e| NodeError::io(format!("open {}", path.display()), e))?;
    let mut hdr = [0u8; 104];
    f.read_exact(&mut hdr)
        .map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
    let be32 = |b: &[u8]| u32::from_be_bytes(b[..4].try_into().expect("4 bytes"));
    if &hdr[..4] != b"QFI\xfb" {
        return Err(bad(path, "not a qcow2 file"));
    }
    // Extensions follow the header: 72 bytes in version 2, `header_length` in version 3.
    let mut off = if be32(&hdr[4..]) >= 3 {
        be32(&hdr[100..]) as u64
    } else {
        72
    };
    for _ in 0..64 {
        let mut ext = [0u8; 8];
        f.seek(SeekFrom::Start(off))
            .and_then(|_| f.read_exact(&mut ext))
            .map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
        let (kind, len) = (be32(&ext[..4]), be32(&ext[4..]) as usize);
        if kind == 0 {
            return Ok(None);
        }
        if len > 4096 {
            return Err(bad(path, "header extension longer than 4096 bytes"));
        }
        if kind == BACKING_FORMAT {
            let mut name = vec![0u8; len];
            f.read_exact(&mut name)
                .map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
            return String::from_utf8(name)
                .map(Some)
                .map_err(|_| bad(path, "backing format name is not UTF-8"));
        }
        off += 8 + len.next_multiple_of(8) as u64;
    }
    Err(bad(path, "more than 64 header extensions"))
}

/// Points the qcow2 file `layer` at the backing file `backing` (the same content under
/// another path: `qemu-img rebase -u`, nothing is read or copied), keeping the backing
/// format `layer` records ([`backing_format_of`]). The format is never guessed from
/// `backing`'s bytes: a lazy image's raw disk comes from a registry, and raw bytes that
/// look like a qcow2 header could name a backing file of their own.
///
/// # Errors
/// `Internal` when `layer` records no backing format or `qemu-img` fails.
pub fn set_backing(qemu_img: &Path, layer: &Path, backing: &Path) -> NodeResult<()> {
    let fmt = backing_format_of(layer)?.ok_or_else(|| bad(layer, "no backing format recorded"))?;
    if !matches!(fmt.as_str(), "raw" | "qcow2") {
        return Err(bad(layer, "backing format is neither raw nor qcow2"));
    }
    super::run_tool(
        std::process::Command::new(qemu_img)
            .args(["rebase", "-q", "-u", "-F", &fmt, "-b"])
            .arg(backing)
            .arg(layer),
        "qemu-img rebase -u",
    )
}

/// Copies (sparse) the layer files `names` (active first, as [`copy_out`] lists them) from
/// the snapshot directory `src` into the VM directory `dir`, after checking that they are
/// one chain of this backend's layer names: the frozen ones become root's, readable by
/// `group` ([`crate::backends::qemu::share_read_only`]); the active one stays root's until
/// the caller gives it to the VM's uid. The bottom layer's backing file must exist (an
/// image disk in the shared store, or one every node has). Blocking.
///
/// # Errors
/// `InvalidArgument` for names that are not this backend's layers or not one chain;
/// `Unavailable` when the image disk is missing; `Internal` on copy failures.
pub fn copy_in(src: &Path, dir: &Path, names: &[String], group: Option<u32>) -> NodeResult<()> {
    let stems: Option<Vec<&str>> = names
        .iter()
        .map(|n| n.strip_suffix(".qcow2").filter(|s| is_layer(s)))
        .collect();
    let Some(stems) = stems.filter(|s| !s.is_empty()) else {
        return Err(NodeError::InvalidArgument(format!(
            "snapshot layers {names:?} are not qcow2 layers of the vm backend"
        )));
    };
    if ancestors(src, &layer_path(src, stems[0]))? != names[1..] {
        return Err(NodeError::InvalidArgument(format!(
            "snapshot layers {names:?} are not the chain of {} in {}",
            names[0],
            src.display()
        )));
    }
    if let Some(base) = backing_of(&src.join(&names[names.len() - 1]))? {
        if !Path::new(&base).is_file() {
            return Err(NodeError::Unavailable(format!(
                "the snapshot's image disk {base} is not reachable from this node"
            )));
        }
    }
    for n in names {
        crate::checkpoints::copy_disk(&src.join(n), &dir.join(n))?;
    }
    for n in &names[1..] {
        crate::backends::qemu::share_read_only(&dir.join(n), group)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img() -> Option<PathBuf> {
        crate::backends::qemu::find_binary("qemu-img")
    }

    #[test]
    fn layer_names() {
        assert!(is_layer("disk") && is_layer(&new_layer()));
        for bad in [
            "",
            "layer-",
            "layer-0123456789ABCDEF",
            "../disk",
            "layer-0123456789abcdef0",
        ] {
            assert!(!is_layer(bad), "{bad}");
        }
    }

    /// A chain base ← disk ← layer-a in one directory, linked into a checkpoint-like
    /// directory and forked: headers name siblings relatively, ancestors are found in
    /// order, and each holder's chain resolves on its own (`qemu-img info --backing-chain`).
    #[test]
    fn chains_resolve_in_every_holder() {
        let Some(img) = qemu_img() else {
            eprintln!("SKIP: qemu-img is not installed");
            return;
        };
        let t = tempfile::tempdir().unwrap();
        let (vm, ck, fork) = (
            t.path().join("vm"),
            t.path().join("ck"),
            t.path().join("fork"),
        );
        for d in [&vm, &ck, &fork] {
            std::fs::create_dir(d).unwrap();
        }
        let base = t.path().join("base.qcow2");
        super::super::run_tool(
            std::process::Command::new(&img)
                .args(["create", "-q", "-f", "qcow2"])
                .arg(&base)
                .arg("1M"),
            "qemu-img create",
        )
        .unwrap();
        create_layer(
            &img,
            base.to_str().unwrap(),
            &vm.join("disk.qcow2"),
            2 << 20,
        )
        .unwrap();
        let a = new_layer();
        create_layer(&img, "disk.qcow2", &layer_path(&vm, &a), 2 << 20).unwrap();
        assert_eq!(backing_of(&base).unwrap(), None);
        assert_eq!(
            backing_of(&layer_path(&vm, &a)).unwrap().as_deref(),
            Some("disk.qcow2")
        );
        assert_eq!(
            ancestors(&vm, &layer_path(&vm, &a)).unwrap(),
            vec!["disk.qcow2".to_string()]
        );
        // What `snapshot` links for a frozen `a`.
        link(&vm.join("disk.qcow2"), &ck.join("disk.qcow2")).unwrap();
        link(&layer_path(&vm, &a), &ck.join(TOP)).unwrap();
        let active = seed_fork(&img, &ck, &fork, 1 << 20, None).unwrap();
        assert_eq!(
            super::super::qcow2_size(&layer_path(&fork, &active)).unwrap(),
            3 << 20
        );
        // The source and the checkpoint go; the fork's chain still resolves.
        std::fs::remove_dir_all(&vm).unwrap();
        std::fs::remove_dir_all(&ck).unwrap();
        let out = std::process::Command::new(&img)
            .args(["info", "--backing-chain"])
            .arg(layer_path(&fork, &active))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s = String::from_utf8_lossy(&out.stdout);
        assert_eq!(s.matches("image: ").count(), 4, "{s}");
        assert_eq!(
            ancestors(&fork, &layer_path(&fork, &active)).unwrap().len(),
            2
        );
    }

    /// A chain base ← disk ← layer-a copied out for the shared store, its bottom rebased
    /// onto a copy of the base, and copied into another VM directory: the copy resolves to
    /// the base's copy; bad layer lists and a missing base are refused.
    #[test]
    fn chains_copy_out_and_in_over_a_copied_base() {
        let Some(img) = qemu_img() else {
            eprintln!("SKIP: qemu-img is not installed");
            return;
        };
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIP: needs root (frozen layers become root's)");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let (vm, snap, other, store) = (
            t.path().join("vm"),
            t.path().join("snap"),
            t.path().join("other"),
            t.path().join("store"),
        );
        for d in [&vm, &snap, &other, &store] {
            std::fs::create_dir(d).unwrap();
        }
        let base = t.path().join("base.qcow2");
        super::super::run_tool(
            std::process::Command::new(&img)
                .args(["create", "-q", "-f", "qcow2"])
                .arg(&base)
                .arg("1M"),
            "qemu-img create",
        )
        .unwrap();
        create_layer(
            &img,
            base.to_str().unwrap(),
            &vm.join("disk.qcow2"),
            2 << 20,
        )
        .unwrap();
        let a = new_layer();
        create_layer(&img, "disk.qcow2", &layer_path(&vm, &a), 2 << 20).unwrap();

        let (names, bottom_base) = copy_out(&vm, &a, &snap).unwrap();
        assert_eq!(names, vec![format!("{a}.qcow2"), "disk.qcow2".to_string()]);
        assert_eq!(bottom_base.as_deref(), Some(base.as_path()));
        let base_copy = store.join("base.qcow2");
        std::fs::copy(&base, &base_copy).unwrap();
        set_backing(&img, &snap.join("disk.qcow2"), &base_copy).unwrap();
        assert_eq!(
            backing_of(&snap.join("disk.qcow2")).unwrap().as_deref(),
            base_copy.to_str()
        );
        assert_eq!(
            backing_format_of(&snap.join("disk.qcow2"))
                .unwrap()
                .as_deref(),
            Some("qcow2")
        );
        // A raw base whose bytes start like a qcow2 header stays raw: the format is the
        // layer's own record, not a guess from the base's content.
        let raw_base = t.path().join("raw.img");
        let mut bytes = b"QFI\xfb".to_vec();
        bytes.resize(1 << 20, 0);
        std::fs::write(&raw_base, &bytes).unwrap();
        let top = t.path().join("over-raw.qcow2");
        super::super::run_tool(
            std::process::Command::new(&img)
                .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
                .arg(&raw_base)
                .arg(&top),
            "qemu-img create",
        )
        .unwrap();
        set_backing(&img, &top, &raw_base).unwrap();
        assert_eq!(backing_format_of(&top).unwrap().as_deref(), Some("raw"));

        // Not a chain of this backend's layer names, or not in that order.
        for bad in [
            vec![],
            vec!["../x.qcow2".to_string()],
            vec!["disk.qcow2".to_string(), format!("{a}.qcow2")],
            vec![format!("{a}.qcow2")],
        ] {
            assert!(
                matches!(
                    copy_in(&snap, &other, &bad, None),
                    Err(NodeError::InvalidArgument(_))
                ),
                "{bad:?}"
            );
        }
        copy_in(&snap, &other, &names, None).unwrap();
        let out = std::process::Command::new(&img)
            .args(["info", "--backing-chain"])
            .arg(layer_path(&other, &a))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s = String::from_utf8_lossy(&out.stdout);
        assert_eq!(s.matches("image: ").count(), 3, "{s}");
        assert!(s.contains(base_copy.to_str().unwrap()), "{s}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(other.join("disk.qcow2"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o444, "a frozen layer is shared read-only");

        // The image disk is gone: refused before anything is copied.
        std::fs::remove_file(&base_copy).unwrap();
        let third = t.path().join("third");
        std::fs::create_dir(&third).unwrap();
        assert!(matches!(
            copy_in(&snap, &third, &names, None),
            Err(NodeError::Unavailable(_))
        ));
        assert_eq!(std::fs::read_dir(&third).unwrap().count(), 0);
    }

    #[test]
    fn foreign_backing_names_are_refused() {
        let Some(img) = qemu_img() else {
            eprintln!("SKIP: qemu-img is not installed");
            return;
        };
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("x.qcow2");
        create_layer(&img, "../etc.qcow2", &p, 1 << 20).unwrap();
        assert!(ancestors(t.path(), &p).is_err());
    }
}
