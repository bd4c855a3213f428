//! overlayfs layer options that name no path of the node's data directory.
//!
//! overlayfs keeps its `lowerdir=`, `upperdir=` and `workdir=` option strings as given and
//! shows them in `/proc/<pid>/mountinfo` and `/proc/mounts` to every process that sees the
//! mount, the sandbox's own processes included: `upperdir=DATA/warm-pool/wp-…/upper` told a
//! sandbox the node's data directory and its own warm-pool name (issue 25). Here the upper
//! and work dirs are named `/proc/self/fd/N` of an `O_PATH` descriptor of the caller's; the
//! kernel resolves the magic link while it parses the option, so the layers are the same,
//! and the text shown inside is `upperdir=/proc/self/fd/6,workdir=/proc/self/fd/7`. The
//! descriptors may be closed once the mount exists (the overlay holds its own references).
//!
//! The lower dirs keep their paths in the image store (`…/layers/<digest>`,
//! `…/<image>/rootfs`) on purpose: the store's garbage collector (`sandlot-node`
//! `images.rs`) tells the layers and retired images still in use by those paths in every
//! mount namespace's mountinfo, and a descriptor name would hide them from it (it would
//! delete layers under running sandboxes). A store-relative name that the collector can
//! still match exactly is the way to hide them too; not built (docs/SECURITY.md).
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Open descriptors and the option strings that name them (valid while `self` lives, in
/// the process that opened them).
#[derive(Debug)]
pub struct LayerOptions {
    _fds: Vec<OwnedFd>,
    /// The whole option string: `lowerdir=…,upperdir=…,workdir=…`.
    pub options: String,
}

fn open_path(p: &Path) -> std::io::Result<OwnedFd> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(p)
        .map(OwnedFd::from)
        .map_err(|e| std::io::Error::new(e.kind(), format!("open {}: {e}", p.display())))
}

/// Opens `upper` and `work` and builds the overlay options for lower dirs `lowers`
/// (top-most first, by path), `upper` and `work` (by descriptor). Paths should be absolute
/// and free of `,` `:` `\`.
///
/// # Errors
/// Opening a directory (the error names its path).
pub fn layer_options<P: AsRef<Path>>(
    lowers: &[P],
    upper: &Path,
    work: &Path,
) -> std::io::Result<LayerOptions> {
    let names: Vec<String> = lowers
        .iter()
        .map(|l| l.as_ref().display().to_string())
        .collect();
    let (u, w) = (open_path(upper)?, open_path(work)?);
    let options = format!(
        "lowerdir={},upperdir=/proc/self/fd/{},workdir=/proc/self/fd/{}",
        names.join(":"),
        u.as_raw_fd(),
        w.as_raw_fd()
    );
    Ok(LayerOptions {
        _fds: vec![u, w],
        options,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_and_work_are_named_by_descriptor() {
        let t = std::env::temp_dir().join(format!("sandlot-layers-{}", std::process::id()));
        for d in ["store/layers/aa", "data/up", "data/wk"] {
            std::fs::create_dir_all(t.join(d)).unwrap();
        }
        let o = layer_options(
            &[t.join("store/layers/aa")],
            &t.join("data/up"),
            &t.join("data/wk"),
        )
        .unwrap();
        assert!(!o.options.contains("data"), "{}", o.options);
        let upper = o.options.split(',').nth(1).unwrap();
        let name = upper.trim_start_matches("upperdir=");
        use std::os::unix::fs::MetadataExt;
        let (a, b) = (
            std::fs::metadata(name).unwrap(),
            std::fs::metadata(t.join("data/up")).unwrap(),
        );
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));
        std::fs::remove_dir_all(&t).unwrap();
    }
}
