//! Disk images of an image's layers for the VM backends, made on the node (eager) or at
//! `sandlot image convert` (a lazy image's disks, see [`super::lazy`]): the `microvm`
//! backend's EROFS disk ([`make_erofs`]) and the `vm` backend's ext4 root file system
//! ([`make_ext4`]), both of the layers merged by a read-only overlay mount
//! ([`mount_layers`]). Here, below the image store, so that the store and the QEMU backends
//! both use them without depending on each other.
use crate::node::{NodeError, NodeResult};
use std::path::{Path, PathBuf};

/// Mounts the read-only overlay of `layers` (the first on top) at the existing directory
/// `at` (unmounted by the caller with `MNT_DETACH`).
///
/// # Errors
/// `Internal` naming the number of layers when the mount fails.
pub fn mount_layers<'a>(
    layers: impl IntoIterator<Item = &'a PathBuf>,
    at: &Path,
) -> NodeResult<()> {
    let lower: Vec<String> = layers
        .into_iter()
        .map(|l| l.display().to_string())
        .collect();
    nix::mount::mount(
        Some("overlay"),
        at,
        Some("overlay"),
        nix::mount::MsFlags::MS_RDONLY,
        Some(format!("lowerdir={}", lower.join(":")).as_str()),
    )
    .map_err(|e| NodeError::io(format!("overlay mount of {} layers", lower.len()), e.into()))
}

/// `mkfs.erofs` of the image's merged layers (`layers`, the top-most first) into `out`
/// (via a temp file), mode 0444: the `microvm` backend's image disk, and a lazy image's
/// EROFS disk at convert time ([`ImageStore::convert_lazy`](super::ImageStore::convert_lazy)).
///
/// # Errors
/// `Internal` when the overlay mount or `mkfs.erofs` fails (its stderr is quoted).
pub fn make_erofs(layers: &[PathBuf], out: &Path) -> NodeResult<()> {
    let tmp = out.with_extension("erofs.tmp");
    let merged_dir = out.with_extension("merge");
    let src = if layers.len() == 1 {
        layers[0].clone()
    } else {
        std::fs::create_dir_all(&merged_dir)
            .map_err(|e| NodeError::io(format!("create {}", merged_dir.display()), e))?;
        mount_layers(layers, &merged_dir)?;
        merged_dir.clone()
    };
    let res = std::process::Command::new("mkfs.erofs")
        .arg("--quiet")
        .arg(&tmp)
        .arg(&src)
        .output();
    if layers.len() != 1 {
        let _ = nix::mount::umount2(&merged_dir, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&merged_dir);
    }
    let out_ = res.map_err(|e| NodeError::io("run mkfs.erofs", e))?;
    if !out_.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(NodeError::io(
            format!(
                "mkfs.erofs {}: {}",
                src.display(),
                String::from_utf8_lossy(&out_.stderr)
            ),
            std::io::Error::other("mkfs.erofs failed"),
        ));
    }
    // Read by every microVM's QEMU (unprivileged uids), written by nobody.
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o444))
        .and_then(|_| std::fs::rename(&tmp, out))
        .map_err(|e| NodeError::io(format!("rename {}", tmp.display()), e))
}

/// Writes the ext4 file system of the image whose layers are `layers` (top-most first) as
/// the raw disk `raw` (no partition table, label `sandlot-root`, no journal, root owned by
/// 0:0): the layers merged by a read-only overlay mount at `raw` + `.merge` (one layer is
/// read as it is: overlayfs wants two lower layers without an upper one), then
/// `mkfs.ext4 -d` of that tree into a file of the content's size + 25 % + 64 MiB. Used for
/// the `vm` backend's image disks, eagerly here and at `sandlot image convert` for a lazy
/// image's ext4 disk. The mount is removed on return; `raw` is left as made (the caller
/// removes it on error).
///
/// # Errors
/// `Internal` when the overlay cannot be mounted or `mkfs.ext4` fails.
pub fn make_ext4(layers: &[PathBuf], raw: &Path) -> NodeResult<()> {
    let merged = raw.with_extension("merge");
    let _ = nix::mount::umount2(&merged, nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir_all(&merged);
    let res = (|| -> NodeResult<()> {
        let src = if let [one] = layers {
            one.clone()
        } else {
            std::fs::create_dir_all(&merged)
                .map_err(|e| NodeError::io(format!("create {}", merged.display()), e))?;
            mount_layers(layers, &merged)?;
            merged.clone()
        };
        let (bytes, entries) = tree_usage(&src);
        // Content + 25 % + 64 MiB: the ext4 metadata, and room so that a sandbox with a
        // small disk_mib still has the base's own slack.
        let size_mib = (bytes + bytes / 4).div_ceil(1 << 20) + 64;
        let inodes = entries * 2 + 16384;
        run_tool(
            std::process::Command::new("mkfs.ext4")
                .args(["-q", "-F", "-O", "^has_journal", "-L", "sandlot-root"])
                .arg("-N")
                .arg(inodes.to_string())
                .arg("-E")
                .arg("root_owner=0:0")
                .arg("-d")
                .arg(&src)
                .arg(raw)
                .arg(format!("{size_mib}M")),
            "mkfs.ext4 -d",
        )
    })();
    let _ = nix::mount::umount2(&merged, nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir(&merged);
    res
}

/// Bytes (rounded to 4 KiB blocks, plus one block per entry) and entries under `root`,
/// not following symlinks.
pub(crate) fn tree_usage(root: &Path) -> (u64, u64) {
    let (mut bytes, mut entries) = (0u64, 0u64);
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            entries += 1;
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            bytes += md.len().div_ceil(4096) * 4096 + 4096;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (bytes, entries)
}

/// Runs `cmd` (a host tool such as `mkfs.ext4` or `qemu-img`) to completion.
///
/// # Errors
/// `Internal` naming `what` when it cannot start or exits non-zero (its stderr quoted).
pub(crate) fn run_tool(cmd: &mut std::process::Command, what: &str) -> NodeResult<()> {
    let out = cmd
        .output()
        .map_err(|e| NodeError::io(format!("run {what}"), e))?;
    if !out.status.success() {
        return Err(NodeError::io(
            format!("{what}: {}", String::from_utf8_lossy(&out.stderr).trim()),
            std::io::Error::other(format!("{what} failed")),
        ));
    }
    Ok(())
}
