//! The shared snapshot store (`sandlot node --snapshot-dir DIR`, `SANDLOT_SNAPSHOT_DIR`):
//! a directory every node of a cluster mounts at the same path (NFS, 3FS, CephFS; in tests
//! one local directory shared by the namespaced nodes of `scripts/cluster.sh`), where a
//! pause with memory of a `microvm` or a `vm` writes what another node needs to resume it:
//!
//! ```text
//! DIR/sandboxes/<id>/memory.state   QEMU's migration stream (memory + device state)
//! DIR/sandboxes/<id>/disk.img       microvm: sparse copy of the writable disk (ext4
//!                                   scratch.img)
//! DIR/sandboxes/<id>/<layer>.qcow2  vm: sparse copies of the sandbox's own qcow2 layers
//!                                   (the active one and the frozen ones below it, names
//!                                   as in its VM directory: `disk.qcow2`,
//!                                   `layer-<16 hex>.qcow2`; each names the next by that
//!                                   relative name), the bottom one rebased (`qemu-img
//!                                   rebase -u`) onto the store's copy of the image disk
//! DIR/sandboxes/<id>/snapshot.json  [`Manifest`], written last: the snapshot is complete
//! DIR/images/<node>/<stamp>-<file>  the image disk the guest ran on, byte for byte, named
//!                                   by the source file's identity (`<stamp>`: device,
//!                                   inode, size and times hashed) and its path below
//!                                   `DATA/<backend>/images/` (`/` as `_`): the microvm's
//!                                   EROFS `<version>.erofs` (a lazy image's
//!                                   `lazy-<digest>_image.erofs`), the vm's qcow2 base
//!                                   `<key>.qcow2` or a lazy image's raw
//!                                   `lazy-<digest>_image.ext4` (a guest's page cache holds
//!                                   blocks of it, and a vm's layers hold only the clusters
//!                                   the guest wrote over it; another node's build of the
//!                                   same image differs in its UUID and build time), copied
//!                                   once per node and source file, mode 0444
//! ```
//!
//! A lazy image's disk (a FUSE mount `lazy-<index hex>/` below `images/`) is copied too,
//! which reads it whole. A disk already in the store (the base of a VM resumed from it) is
//! its own copy. The bottom layer's backing format is kept from its own header, never
//! guessed from the base's bytes ([`super::vm`]'s `chain::set_backing`).
//!
//! A resume on the same node reads `memory.state` there (the fast path: no copy, its own
//! disk). A resume on another node ([`crate::Node::adopt_snapshot`]) first **claims** the
//! snapshot by renaming `DIR/sandboxes/<id>` to `DIR/sandboxes/.claimed-<id>` (an atomic
//! rename: of two nodes only one wins), copies the disk files (`disk.img`, or the layers
//! the manifest lists) into its own VM directory, runs QEMU with the manifest's command
//! line with the source node's directories replaced by its own and the image disk read
//! from `DIR/images/`, restores the memory and removes the claimed directory. A failed
//! restore renames it back. Image disks in `DIR/images/` are never removed by a node (a
//! resumed guest keeps reading them); an operator removes those of image versions no
//! sandbox runs any more.
//!
//! Directories are mode 0711 (QEMU, an unprivileged uid, opens image disks by path;
//! nobody lists), files root's: memory states 0600 (passed to QEMU as descriptors).
use super::state::VmState;
use crate::node::{NodeError, NodeResult};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The manifest of one snapshot: `DIR/sandboxes/<id>/snapshot.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version (1).
    pub version: u32,
    /// The node that paused it (its `--name`).
    pub node: String,
    /// Backend (`microvm`, `vm`).
    pub backend: String,
    /// The VM's state at the pause; `qemu_args` name the image disk in `DIR/images/` and
    /// the source node's directories below.
    pub state: VmState,
    /// The source node's backend directory (`DATA/microvm`).
    pub backend_dir: PathBuf,
    /// The source node's guest kit directory.
    pub kit_dir: PathBuf,
    /// The source node's VM directory (`DATA/microvm/vms/<id>`).
    pub vm_dir: PathBuf,
    /// When the pause finished, Unix milliseconds.
    pub saved_at_ms: i64,
    /// `vm`: the qcow2 layer files in the snapshot directory, the active layer (the one
    /// `qemu_args`' root `-drive` names) first, then each one's backing file down to the
    /// bottom one (backed by the image disk). Empty for `microvm` (its disk is [`DISK`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
}

impl Manifest {
    /// The manifest of a pause on node `node` of a `backend` VM in `state`, with the source
    /// node's `(backend_dir, kit_dir, vm_dir)` and the VM's own disk `layers` (`vm`; empty
    /// for `microvm`), saved now.
    pub fn new(
        node: &str,
        backend: &str,
        state: VmState,
        (backend_dir, kit_dir, vm_dir): (PathBuf, PathBuf, PathBuf),
        layers: Vec<String>,
    ) -> Self {
        Manifest {
            version: 1,
            node: node.to_owned(),
            backend: backend.to_owned(),
            state,
            backend_dir,
            kit_dir,
            vm_dir,
            saved_at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
            layers,
        }
    }
}

/// File names inside a snapshot directory.
pub const MANIFEST: &str = "snapshot.json";
/// The writable disk's copy in a snapshot directory.
pub const DISK: &str = "disk.img";

/// One node's handle on the shared store.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    root: PathBuf,
    node: String,
}

fn mkdir_0711(d: &Path) -> NodeResult<()> {
    std::fs::create_dir_all(d)
        .and_then(|_| std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711)))
        .map_err(|e| NodeError::io(format!("create {}", d.display()), e))
}

impl SnapshotStore {
    /// The store at `root` (absolute; created with its `sandboxes/` and `images/` when
    /// missing) as node `node` sees it.
    ///
    /// # Errors
    /// `InvalidArgument` for a relative path; `Internal` when the directories cannot be
    /// made.
    pub fn open(root: &Path, node: &str) -> NodeResult<Self> {
        if !root.is_absolute() {
            return Err(NodeError::InvalidArgument(format!(
                "snapshot dir {} must be an absolute path (every node mounts it at the same one)",
                root.display()
            )));
        }
        for d in [
            root.to_path_buf(),
            root.join("sandboxes"),
            root.join("images"),
        ] {
            mkdir_0711(&d)?;
        }
        Ok(SnapshotStore {
            root: root.to_path_buf(),
            node: node.to_owned(),
        })
    }

    /// The store's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// `DIR/sandboxes/<id>`: where a pause of `id` writes.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.root.join("sandboxes").join(id)
    }

    fn claimed_dir(&self, id: &str) -> PathBuf {
        self.root.join("sandboxes").join(format!(".claimed-{id}"))
    }

    /// Makes `DIR/sandboxes/<id>` (empty) for a pause: a leftover of an earlier one goes.
    ///
    /// # Errors
    /// `Internal` on file-system failures.
    pub fn begin(&self, id: &str) -> NodeResult<PathBuf> {
        let d = self.sandbox_dir(id);
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d)
            .and_then(|_| std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| NodeError::io(format!("create {}", d.display()), e))?;
        Ok(d)
    }

    /// The copy of image disk `src`, a file under the backend's image directory `images`
    /// (`DATA/<backend>/images`), in `DIR/images/<node>/`, named by the identity of `src`
    /// (device, inode, size, modification and change times, hashed) and its path below
    /// `images` with `/` as `_` ([`copy_name`]): `<hex>-<key>.qcow2`,
    /// `<hex>-lazy-<digest>_image.erofs`. Made once per identity: a disk rebuilt under the
    /// same name (an image removed and pulled again: a new UUID and checksum seeds at the
    /// same size) gets a copy of its own instead of reusing the old one under layers
    /// written over the new one. Copies go through a temp file of their own (unique per
    /// call) renamed into place, so two pauses copying the same disk at once never expose
    /// a half-written copy. A disk already in the store is its own copy.
    ///
    /// # Errors
    /// `InvalidArgument` for a `src` not below `images`; `Internal` when `src` cannot be
    /// read or the copy fails.
    pub fn put_image(&self, src: &Path, images: &Path) -> NodeResult<PathBuf> {
        use std::os::unix::fs::MetadataExt;
        static TMP_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if src.starts_with(&self.root) {
            return Ok(src.to_path_buf());
        }
        let name = copy_name(src, images).ok_or_else(|| {
            NodeError::InvalidArgument(format!(
                "image disk {} is not below {}",
                src.display(),
                images.display()
            ))
        })?;
        let m = std::fs::metadata(src)
            .map_err(|e| NodeError::io(format!("stat {}", src.display()), e))?;
        let identity = [
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime() as u64,
            m.mtime_nsec() as u64,
            m.ctime() as u64,
            m.ctime_nsec() as u64,
        ]
        .map(u64::to_le_bytes);
        let stamp = crate::images::fnv(&identity.iter().map(|b| &b[..]).collect::<Vec<_>>());
        let dir = self.root.join("images").join(&self.node);
        mkdir_0711(&dir)?;
        let dst = dir.join(format!("{stamp:016x}-{name}"));
        if dst.exists() {
            return Ok(dst);
        }
        let seq = TMP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}-{seq}.tmp", std::process::id()));
        let r = std::fs::copy(src, &tmp)
            .and_then(|_| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444)))
            .and_then(|_| std::fs::rename(&tmp, &dst));
        if let Err(e) = r {
            let _ = std::fs::remove_file(&tmp);
            return Err(NodeError::io(
                format!("copy {} to {}", src.display(), dst.display()),
                e,
            ));
        }
        Ok(dst)
    }

    /// Writes the manifest into snapshot directory `dir` (last step of a pause).
    ///
    /// # Errors
    /// `Internal` when it cannot be written.
    pub fn finish(&self, dir: &Path, m: &Manifest) -> NodeResult<()> {
        let p = dir.join(MANIFEST);
        let tmp = dir.join(format!("{MANIFEST}.tmp"));
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(m).expect("Manifest serialises"),
        )
        .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|_| std::fs::rename(&tmp, &p))
        .map_err(|e| NodeError::io(format!("write {}", p.display()), e))?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// The backend (`microvm`, `vm`) of the complete snapshot of `id` (not claimed), read
    /// from its manifest without claiming it: which backend of a node takes it over.
    ///
    /// # Errors
    /// As [`Self::claim`]: `NotFound` (no complete snapshot), `Conflict` (claimed by a
    /// node); `Internal` for a manifest that cannot be read.
    pub fn backend_of(&self, id: &str) -> NodeResult<String> {
        let p = self.sandbox_dir(id).join(MANIFEST);
        match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice::<Manifest>(&b)
                .map(|m| m.backend)
                .map_err(|e| {
                    NodeError::io(format!("parse {}", p.display()), std::io::Error::other(e))
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if self.claimed_dir(id).exists() {
                    return Err(NodeError::Conflict(format!(
                        "the snapshot of sandbox {id} is being restored by another node"
                    )));
                }
                Err(NodeError::NotFound(format!(
                    "no complete snapshot of sandbox {id} in the shared store {}",
                    self.root.display()
                )))
            }
            Err(e) => Err(NodeError::io(format!("read {}", p.display()), e)),
        }
    }

    /// Claims the snapshot of `id` for this node (see the module docs): its claimed
    /// directory and manifest.
    ///
    /// # Errors
    /// `NotFound` when the store holds no complete snapshot of `id`; `Conflict` when another
    /// node holds the claim.
    pub fn claim(&self, id: &str) -> NodeResult<(PathBuf, Manifest)> {
        let (from, to) = (self.sandbox_dir(id), self.claimed_dir(id));
        if !from.join(MANIFEST).is_file() {
            if to.exists() {
                return Err(NodeError::Conflict(format!(
                    "the snapshot of sandbox {id} is being restored by another node"
                )));
            }
            return Err(NodeError::NotFound(format!(
                "no complete snapshot of sandbox {id} in the shared store {}",
                self.root.display()
            )));
        }
        match std::fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(NodeError::Conflict(format!(
                    "the snapshot of sandbox {id} was claimed by another node"
                )))
            }
            Err(e) => return Err(NodeError::io(format!("claim {}", from.display()), e)),
        }
        let m = std::fs::read(to.join(MANIFEST))
            .map_err(|e| NodeError::io(format!("read {}", to.join(MANIFEST).display()), e))
            .and_then(|b| {
                serde_json::from_slice::<Manifest>(&b).map_err(|e| {
                    NodeError::io(
                        format!("parse {}", to.join(MANIFEST).display()),
                        std::io::Error::other(e),
                    )
                })
            });
        match m {
            Ok(m) => Ok((to, m)),
            Err(e) => {
                self.unclaim(id);
                Err(e)
            }
        }
    }

    /// Gives a claim back (a restore that failed).
    pub fn unclaim(&self, id: &str) {
        if let Err(e) = std::fs::rename(self.claimed_dir(id), self.sandbox_dir(id)) {
            tracing::warn!(sandbox = %id, error = %e, "could not give the snapshot claim back");
        }
    }

    /// Removes the snapshot of `id` (not one claimed by a node restoring it).
    pub fn remove(&self, id: &str) {
        let d = self.sandbox_dir(id);
        match std::fs::remove_dir_all(&d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, dir = %d.display(), "could not remove a snapshot")
            }
        }
    }
}

/// The name of image disk `src`'s copy in the store: its path below `images` with `/` as
/// `_` (disks in subdirectories, such as a lazy image's FUSE mount `lazy-<digest>/`, have
/// the same file name); `None` when `src` is not below `images` or not UTF-8.
pub fn copy_name(src: &Path, images: &Path) -> Option<String> {
    let rel = src.strip_prefix(images).ok()?.to_str()?;
    (!rel.is_empty() && !rel.split('/').any(|c| c == ".." || c == "."))
        .then(|| rel.replace('/', "_"))
}

/// `args` with every occurrence of each `(from, to)` path prefix replaced, in order (give
/// longer, more specific paths first).
pub fn rebase_args(args: &[String], map: &[(&Path, &Path)]) -> Vec<String> {
    args.iter()
        .map(|a| {
            let mut a = a.clone();
            for (from, to) in map {
                let (f, t) = (from.to_string_lossy(), to.to_string_lossy());
                if !f.is_empty() && a.contains(f.as_ref()) {
                    a = a.replace(f.as_ref(), t.as_ref());
                }
            }
            a
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebase_replaces_the_source_dirs() {
        let args = vec![
            "-kernel".to_string(),
            "/a/kit/vmlinuz".into(),
            "id=scratch,file=/a/n0/microvm/vms/sb-1/scratch.img,format=raw".into(),
            "/a/n0/microvm/initramfs.cpio".into(),
        ];
        let out = rebase_args(
            &args,
            &[
                (
                    Path::new("/a/n0/microvm/vms/sb-1"),
                    Path::new("/b/vms/sb-1"),
                ),
                (Path::new("/a/n0/microvm"), Path::new("/b")),
                (Path::new("/a/kit"), Path::new("/k")),
            ],
        );
        assert_eq!(out[1], "/k/vmlinuz");
        assert_eq!(out[2], "id=scratch,file=/b/vms/sb-1/scratch.img,format=raw");
        assert_eq!(out[3], "/b/initramfs.cpio");
    }

    #[test]
    fn image_copies_are_named_by_their_path_below_the_images_dir() {
        let images = Path::new("/d/vm/images");
        assert_eq!(
            copy_name(Path::new("/d/vm/images/0123abcd.qcow2"), images).as_deref(),
            Some("0123abcd.qcow2")
        );
        assert_eq!(
            copy_name(Path::new("/d/vm/images/lazy-ab/image.erofs"), images).as_deref(),
            Some("lazy-ab_image.erofs")
        );
        for bad in ["/d/vm/other.qcow2", "/d/vm/images", "/d/vm/images/../x"] {
            assert_eq!(copy_name(Path::new(bad), images), None, "{bad}");
        }
        let d = tempfile::tempdir().unwrap();
        let s = SnapshotStore::open(&d.path().join("store"), "n0").unwrap();
        let imgs = d.path().join("images");
        std::fs::create_dir_all(imgs.join("lazy-ab")).unwrap();
        std::fs::write(imgs.join("lazy-ab/image.erofs"), b"disk bytes").unwrap();
        let copy = s
            .put_image(&imgs.join("lazy-ab/image.erofs"), &imgs)
            .unwrap();
        assert_eq!(copy.parent(), Some(s.root().join("images/n0").as_path()));
        let file = copy.file_name().unwrap().to_str().unwrap();
        assert!(file.ends_with("-lazy-ab_image.erofs"), "{file}");
        assert_eq!(std::fs::read(&copy).unwrap(), b"disk bytes");
        assert_eq!(
            s.put_image(&imgs.join("lazy-ab/image.erofs"), &imgs)
                .unwrap(),
            copy,
            "the same disk is copied once"
        );
        // Rebuilt under the same name and size: a copy of its own, the old one untouched.
        std::fs::remove_file(imgs.join("lazy-ab/image.erofs")).unwrap();
        std::fs::write(imgs.join("lazy-ab/image.erofs"), b"disk BYTES").unwrap();
        let again = s
            .put_image(&imgs.join("lazy-ab/image.erofs"), &imgs)
            .unwrap();
        assert_ne!(again, copy);
        assert_eq!(std::fs::read(&again).unwrap(), b"disk BYTES");
        assert_eq!(std::fs::read(&copy).unwrap(), b"disk bytes");
        // No temp file is left behind.
        let names: Vec<_> = std::fs::read_dir(s.root().join("images/n0"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        assert_eq!(
            std::fs::metadata(&copy).unwrap().permissions().mode() & 0o777,
            0o444
        );
        assert_eq!(
            s.put_image(&copy, &imgs).unwrap(),
            copy,
            "a copy is its own copy"
        );
        assert!(s.put_image(&d.path().join("elsewhere"), &imgs).is_err());
    }

    #[test]
    fn claim_is_exclusive_and_can_be_given_back() {
        let d = tempfile::tempdir().unwrap();
        let s = SnapshotStore::open(d.path(), "n0").unwrap();
        let id = "sb-0123456789abcdef0123";
        assert!(matches!(s.claim(id), Err(NodeError::NotFound(_))));
        let dir = s.begin(id).unwrap();
        // Not complete yet: no manifest.
        assert!(matches!(s.claim(id), Err(NodeError::NotFound(_))));
        std::fs::write(dir.join(MANIFEST), b"{not json").unwrap();
        assert!(s.claim(id).is_err());
        assert!(dir.join(MANIFEST).is_file(), "a bad claim is given back");
        std::fs::remove_file(dir.join(MANIFEST)).unwrap();
        let st: VmState = serde_json::from_value(serde_json::json!({
            "id": id, "image": "python", "image_env": [], "accel": "tcg",
            "qemu_pid": 1, "qemu_starttime": 1,
            "spec": {"cpu": 1.0, "memory_mib": 256, "disk_mib": 64, "pids_max": 64, "env": {}}
        }))
        .unwrap_or_else(|e| panic!("VmState fixture: {e}"));
        let m = Manifest {
            version: 1,
            node: "n0".into(),
            backend: "microvm".into(),
            state: st,
            backend_dir: "/x".into(),
            kit_dir: "/k".into(),
            vm_dir: "/x/vms/id".into(),
            saved_at_ms: 0,
            layers: Vec::new(),
        };
        s.finish(&dir, &m).unwrap();
        assert_eq!(s.backend_of(id).unwrap(), "microvm");
        let (claimed, got) = s.claim(id).unwrap();
        assert_eq!(got.node, "n0");
        assert!(matches!(s.claim(id), Err(NodeError::Conflict(_))));
        assert!(matches!(s.backend_of(id), Err(NodeError::Conflict(_))));
        s.unclaim(id);
        assert!(!claimed.exists());
        s.claim(id).unwrap();
    }
}
