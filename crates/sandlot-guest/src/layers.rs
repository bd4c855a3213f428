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
//! The lower dirs (`…/layers/<digest>`, `…/<image>/rootfs` in the image store) are named
//! by an alias, `/run/sandlot/lower/<h>` ([`ALIAS_DIR`]; `h`: the first 32 hex digits of
//! the SHA-256 of the real path), a symbolic link to the real path that the kernel follows
//! while it parses the option: a sandbox sees `lowerdir=/run/sandlot/lower/3f…`, not the
//! node's store path. The store's garbage collector (`sandlot-node` `images.rs`) tells the
//! layers and retired images still in use by their paths in every mount namespace's
//! mountinfo; it reads the aliases back through their links ([`expand_aliases`]). A
//! descriptor name (as for upper and work) would hide the layers from it, and it would
//! delete layers under running sandboxes. The links are tiny and left in place (`/run` is
//! emptied at boot, when no mount uses them any more).
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
        .map(|l| match lower_alias(l.as_ref()) {
            Ok(a) => a.display().to_string(),
            // No alias (no writable /run): the real path, as before aliases.
            Err(e) => {
                eprintln!(
                    "sandlot-guest: warning: no alias for lower dir {}: {e}",
                    l.as_ref().display()
                );
                l.as_ref().display().to_string()
            }
        })
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

/// Directory of the lower-dir aliases.
pub const ALIAS_DIR: &str = "/run/sandlot/lower";

/// Hex digits of an alias name.
const ALIAS_HEX: usize = 32;

/// The alias name of `real` under `dir`: `dir/<first 32 hex digits of SHA-256(real)>`.
fn alias_path(dir: &Path, real: &Path) -> std::path::PathBuf {
    use sha2::Digest;
    use std::os::unix::ffi::OsStrExt;
    let d = sha2::Sha256::digest(real.as_os_str().as_bytes());
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    dir.join(&hex[..ALIAS_HEX])
}

/// The alias of lower dir `real` ([`ALIAS_DIR`]/`<h>`, a symbolic link to `real`),
/// created when missing (or pointing elsewhere: replaced atomically).
///
/// # Errors
/// Creating [`ALIAS_DIR`] or the link.
pub fn lower_alias(real: &Path) -> std::io::Result<std::path::PathBuf> {
    lower_alias_in(Path::new(ALIAS_DIR), real)
}

fn lower_alias_in(dir: &Path, real: &Path) -> std::io::Result<std::path::PathBuf> {
    let alias = alias_path(dir, real);
    if std::fs::read_link(&alias).is_ok_and(|t| t == real) {
        return Ok(alias);
    }
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)?;
    }
    // Root only: the links name the store's paths.
    match std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700).create(dir)
    {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let tmp = dir.join(format!(
        ".tmp-{}-{}",
        std::process::id(),
        alias.file_name().and_then(|n| n.to_str()).unwrap_or("x")
    ));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(real, &tmp)?;
    std::fs::rename(&tmp, &alias)?;
    Ok(alias)
}

/// `text` (e.g. a mountinfo) with each `/run/sandlot/lower/<h>` alias replaced by the path
/// its link points to (aliases whose link is gone stay as they are).
pub fn expand_aliases(text: &str) -> std::borrow::Cow<'_, str> {
    expand_aliases_in(ALIAS_DIR, text)
}

fn expand_aliases_in<'a>(dir: &str, text: &'a str) -> std::borrow::Cow<'a, str> {
    let needle = format!("{dir}/");
    if !text.contains(&needle) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(&needle) {
        out.push_str(&rest[..i]);
        let after = &rest[i + needle.len()..];
        let h = &after[..after.len().min(ALIAS_HEX)];
        let target = (h.len() == ALIAS_HEX && h.bytes().all(|c| c.is_ascii_hexdigit()))
            .then(|| std::fs::read_link(format!("{needle}{h}")).ok())
            .flatten();
        match target {
            Some(t) => {
                out.push_str(&t.to_string_lossy());
                rest = &after[ALIAS_HEX..];
            }
            None => {
                out.push_str(&needle);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
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

    #[test]
    fn lower_aliases_link_to_the_layer_and_expand_back() {
        let t = tempfile::tempdir().unwrap();
        let real = t.path().join("store/layers/sha256/ab");
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(real.join("f"), b"x").unwrap();
        let dir = t.path().join("run/lower");
        let a = lower_alias_in(&dir, &real).unwrap();
        // Same alias again (idempotent); the name tells nothing of the real path.
        assert_eq!(lower_alias_in(&dir, &real).unwrap(), a);
        let name = a.file_name().unwrap().to_str().unwrap();
        assert_eq!(name.len(), ALIAS_HEX);
        assert_eq!(std::fs::read(a.join("f")).unwrap(), b"x");
        // A link pointing elsewhere is replaced.
        std::fs::remove_file(&a).unwrap();
        std::os::unix::fs::symlink("/nonexistent", &a).unwrap();
        assert_eq!(lower_alias_in(&dir, &real).unwrap(), a);
        assert_eq!(std::fs::read_link(&a).unwrap(), real);
        let d = dir.display().to_string();
        let info = format!(
            "1 2 0:1 / / rw - overlay overlay rw,lowerdir={}:{d}/{},upperdir=/proc/self/fd/3\n",
            a.display(),
            "0".repeat(ALIAS_HEX)
        );
        let x = expand_aliases_in(&d, &info);
        assert!(x.contains(&format!("lowerdir={}:", real.display())), "{x}");
        // An alias without a link stays as it is.
        assert!(x.contains(&format!("{d}/{}", "0".repeat(ALIAS_HEX))), "{x}");
        assert!(matches!(
            expand_aliases_in(&d, "no aliases"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
