//! The node's image store: named root file systems that sandboxes mount as read-only
//! overlay lower layers.
//!
//! Images are named two ways:
//!
//! - a **short name** `[a-z0-9][a-z0-9._-]{0,63}` (`python`, `busybox`, or any name given
//!   with `pull --name` / `import --name`): only ever looked up in the store;
//! - a full **reference** (`127.0.0.1:5000/sandlot/python:latest`, `busybox:1.36`, anything
//!   with a `/`, `:` or `@`), normalised as Docker does (`busybox` → `docker.io/library/
//!   busybox:latest`): looked up by its normalised form; on create ([`ImageStore::resolve`])
//!   an absent reference is pulled first when its registry is allowed (see [`PullPolicy`]).
//!
//! Layout under the store directory (`DATA/images`):
//!
//! ```text
//! <dir>/<name>/image.json        metadata of a short-named image (ImageJson below: name, env,
//!                                workdir, user, created_at, size_bytes, source, layers, blobs)
//! <dir>/<name>/rootfs/           the single layer of a built-in image (busybox, python)
//! <dir>/refs/<sha256>/image.json an image named by a reference; the directory name is the
//!                                SHA-256 of the normalised reference (image.json holds it)
//! <dir>/blobs/sha256/<hex>       content-addressed blobs (see [`oci`])
//! <dir>/layers/sha256/<hex>/     unpacked OCI layers by DiffID, shared by images (see [`oci`])
//! <dir>/stats/pulls.json         counters of pulls into the store (see [`pull_stats`])
//! <dir>/.<name>.tmp-<pid>/       an image being built (never listed; a leading dot is never a
//!                                valid image name, so it cannot clash with one)
//! ```
//!
//! `refs`, `blobs`, `layers`, `stats` and the other [`RESERVED`] names cannot be short names.
//!
//! An image is built in its temp directory, `image.json` is written last (temp file, fsync,
//! rename), and the directory is then renamed into place, so a half-built image is never
//! seen. Temp directories left by dead processes are removed by [`ImageStore::open`].
//!
//! Images come from two local builders ([`ImageSource::Busybox`],
//! [`ImageSource::Debootstrap`]) with one layer each, and from OCI registries and archives
//! ([`ImageSource::Registry`], [`ImageSource::Archive`]) whose layers are content-addressed
//! directories unpacked once and shared; the rest of the node consumes [`Image::layers`] as
//! an overlay lowerdir list either way.
pub mod disks;
mod error;
pub mod lazy;
pub mod oci;
pub mod pull_stats;
pub mod toolchain;
// Layer unpacking lives in its own crate, so the fuzz target builds only that.
pub use sandlot_layer as unpack;

use crate::node::{NodeError, NodeResult};
pub use error::ImageError;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};

/// Name of the metadata file in an image directory.
pub const IMAGE_JSON: &str = "image.json";
/// Name of the root file system directory in an image directory.
pub const ROOTFS_DIR: &str = "rootfs";
/// `PATH` given to every built-in image.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Host binary copied into the `busybox` image (Debian package `busybox-static`).
pub const HOST_BUSYBOX: &str = "/bin/busybox";
/// Stamp file marking a complete debootstrap cache directory (JSON of the spec it was made
/// from). A cache directory without it is never used.
pub const CACHE_STAMP: &str = ".sandlot-cache-complete";

/// A named image ready to be mounted.
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    /// Image name: a short name (`[a-z0-9][a-z0-9._-]{0,63}`) or a normalised reference
    /// (`127.0.0.1:5000/sandlot/python:latest`).
    pub name: String,
    /// Host directories to stack as overlay lower dirs, top-most first. Read-only to
    /// sandboxes; owned by host root.
    pub layers: Vec<PathBuf>,
    /// Default environment of processes in the image, in order.
    pub env: Vec<(String, String)>,
    /// Default working directory inside the image.
    pub workdir: Option<String>,
    /// Default user of processes (image config `User`: `name`, `uid`, `uid:gid`, ...);
    /// `None` means root. The container backend honours it; the function backend does not
    /// (yet): its commands run as the sandbox's root.
    pub user: Option<String>,
    /// Apparent size of all layers in bytes (hard links counted once).
    pub size_bytes: u64,
    /// Creation time, RFC 3339 UTC (e.g. `2026-11-29T10:00:00Z`).
    pub created_at: String,
    /// How the image came to be.
    pub source: ImageSource,
}

impl Image {
    /// This version of the image, 16 lowercase hex digits: a hash of its name, creation
    /// time and layer paths. A rebuild (`image build --force`), a moved tag pulled again or
    /// a re-import gives a new version. Names the microVM backend's image disk, and a
    /// checkpoint records its parent's ([`crate::checkpoints::CheckpointMeta::image_version`]).
    pub fn version(&self) -> String {
        let mut parts: Vec<&[u8]> = vec![self.name.as_bytes(), self.created_at.as_bytes()];
        parts.extend(self.layers.iter().map(|l| l.as_os_str().as_encoded_bytes()));
        format!("{:016x}", fnv(&parts))
    }
}

/// FNV-1a (64-bit) over `parts`, each followed by a NUL byte. For keys of files the node
/// makes itself (image disks, templates), not for anything an attacker chooses.
pub fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter().chain(&[0u8]) {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// How an image came to be (recorded in `image.json` as `{"kind": ..., ...}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ImageSource {
    /// A static busybox binary plus one symlink per applet.
    Busybox {
        /// Host path of the binary copied in.
        binary: PathBuf,
    },
    /// A Debian root file system made by `debootstrap`, hard-linked from a cache.
    Debootstrap(DebootstrapSpec),
    /// Pulled from a registry.
    Registry {
        /// Normalised reference pulled, e.g. `127.0.0.1:5000/sandlot/python:latest`.
        reference: String,
        /// Digest of the (platform) image manifest.
        manifest: String,
        /// Digest of the image config.
        config: String,
    },
    /// Built by [`ImageStore::build_toolchain`]: one toolchain layer (and those of its
    /// lowers) over the `python` image's layer.
    Toolchain {
        /// Row of [`toolchain::TOOLCHAINS`].
        toolchain: String,
        /// Debian packages installed in its layer.
        apt: Vec<String>,
        /// PyPI packages installed in its layer.
        pip: Vec<String>,
        /// npm packages installed in its layer.
        npm: Vec<String>,
    },
    /// Pulled in lazy form ([`lazy`]): layers are FUSE mounts of lazy indexes whose file
    /// data is fetched chunk by chunk when read.
    Lazy {
        /// Normalised reference asked for, e.g. `127.0.0.1:5000/sandlot/big:latest`.
        reference: String,
        /// Reference of the lazy form pulled (`...:latest-lazy`); chunks are fetched from
        /// its repository.
        lazy_reference: String,
        /// Digest of the lazy manifest.
        manifest: String,
        /// Digest of the image config (the original image's).
        config: String,
        /// Index blobs of the layers, bottom-most first.
        indexes: Vec<String>,
        /// Index blob of the image's EROFS disk (the microVM backend's image disk, see
        /// [`lazy::format`]); `None` for a lazy form converted without one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disk: Option<String>,
        /// Index blob of the image's raw ext4 disk (the `vm` backend's base disk, see
        /// [`lazy::format`]); `None` for a lazy form converted without one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vm_disk: Option<String>,
    },
    /// Imported from an OCI layout directory or a `docker save` / OCI archive.
    Archive {
        /// Path imported from.
        path: PathBuf,
        /// Digest of the image manifest (empty for a `docker save` archive without one).
        manifest: String,
        /// Digest of the image config.
        config: String,
    },
}

impl ImageSource {
    /// Digest of the image config (registry and archive images); `None` for built-ins.
    pub fn config_digest(&self) -> Option<&str> {
        match self {
            ImageSource::Registry { config, .. }
            | ImageSource::Archive { config, .. }
            | ImageSource::Lazy { config, .. } => Some(config),
            ImageSource::Busybox { .. }
            | ImageSource::Debootstrap(_)
            | ImageSource::Toolchain { .. } => None,
        }
    }
}

/// What `debootstrap` builds; also the identity of a cache directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DebootstrapSpec {
    /// Debian suite, e.g. `bookworm`.
    pub suite: String,
    /// `--variant`, e.g. `minbase`.
    pub variant: String,
    /// `--include` packages.
    pub include: Vec<String>,
    /// Debian mirror URL.
    pub mirror: String,
    /// Directory name of the cache under the cache dir, e.g. `python-bookworm`.
    pub cache_name: String,
    /// Paths (relative to the rootfs) that must exist after the build, e.g. `usr/bin/python3`.
    pub must_exist: Vec<String>,
}

impl DebootstrapSpec {
    /// The `python` image: minbase bookworm with `python3` and `g++`. The mirror is
    /// `$SANDLOT_DEBIAN_MIRROR` or `http://deb.debian.org/debian`.
    pub fn python_bookworm() -> DebootstrapSpec {
        DebootstrapSpec {
            suite: "bookworm".into(),
            variant: "minbase".into(),
            include: vec!["python3".into(), "g++".into()],
            mirror: std::env::var("SANDLOT_DEBIAN_MIRROR")
                .unwrap_or_else(|_| "http://deb.debian.org/debian".into()),
            cache_name: "python-bookworm".into(),
            must_exist: vec!["usr/bin/python3".into(), "usr/bin/g++".into()],
        }
    }
}

/// `image.json` as stored on disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ImageJson {
    name: String,
    env: Vec<(String, String)>,
    workdir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    created_at: String,
    size_bytes: u64,
    source: ImageSource,
    /// Layer directories relative to the store directory, top-most first.
    #[serde(default)]
    layers: Vec<String>,
    /// Blobs (`sha256:<hex>`) the image needs kept: index, manifest, config, layer blobs.
    #[serde(default)]
    blobs: Vec<String>,
}

/// Store directories that cannot be image names.
pub const RESERVED: &[&str] = &[
    "refs",
    "blobs",
    "layers",
    RETIRED_DIR,
    lazy::LAZY_DIR,
    "chunks",
    pull_stats::STATS_DIR,
];

/// Directory (under the store) of removed or replaced built-in images whose `rootfs` a
/// running sandbox still has mounted: `retired/<name>.<ns>/` with the image's files and an
/// `origin` file naming the rootfs path the mounts refer to. [`ImageStore::gc`] deletes an
/// entry once no mount names that path.
pub const RETIRED_DIR: &str = "retired";

/// Check a short image name: `[a-z0-9][a-z0-9._-]{0,63}`, not one of [`RESERVED`].
///
/// # Errors
/// `InvalidArgument` naming the rule.
pub fn validate_name(name: &str) -> NodeResult<()> {
    let b = name.as_bytes();
    let ok_first = b
        .first()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok_rest = b[..]
        .iter()
        .skip(1)
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'-'));
    if RESERVED.contains(&name) {
        Err(NodeError::InvalidArgument(format!(
            "invalid image name {name:?}: reserved for the store's own directories"
        )))
    } else if ok_first && ok_rest && b.len() <= 64 {
        Ok(())
    } else {
        Err(NodeError::InvalidArgument(format!(
            "invalid image name {name:?}: must match [a-z0-9][a-z0-9._-]{{0,63}}"
        )))
    }
}

/// An image name as a user writes it, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageName {
    /// A short local name (`python`).
    Short(String),
    /// A registry reference, normalised (`docker.io/library/busybox:latest`).
    Reference(oci_client::Reference),
}

impl ImageName {
    /// The name the store keeps the image under: the short name or the normalised reference.
    pub fn key(&self) -> String {
        match self {
            ImageName::Short(s) => s.clone(),
            ImageName::Reference(r) => r.whole(),
        }
    }
}

/// Parse an OCI reference (distribution/reference grammar: `[host[:port]/]path[:tag][@digest]`,
/// lowercase path, tag `latest` when neither tag nor digest is given).
///
/// # Errors
/// `InvalidArgument` naming the problem.
pub fn parse_reference(s: &str) -> NodeResult<oci_client::Reference> {
    if s.len() > 512 {
        return Err(NodeError::InvalidArgument(
            "invalid image name: a reference is at most 512 bytes".into(),
        ));
    }
    let r = oci_client::Reference::try_from(s).map_err(|e| {
        NodeError::InvalidArgument(format!(
            "invalid image name {s:?}: not a short name and not a valid OCI reference: {e}"
        ))
    })?;
    // The grammar lets an upper-case first component through as a "domain" that
    // normalisation then moves into the repository (`A/b` → `docker.io/A/b`); Docker refuses
    // such names, so do we.
    if r.repository().bytes().any(|c| c.is_ascii_uppercase()) {
        return Err(NodeError::InvalidArgument(format!(
            "invalid image name {s:?}: the repository of a reference must be lowercase"
        )));
    }
    Ok(r)
}

/// Classify an image name: a valid short name is [`ImageName::Short`]; anything containing
/// `/`, `:` or `@` must be a valid reference.
///
/// # Errors
/// `InvalidArgument`: the short-name rule for names without `/ : @`, the reference rule
/// otherwise.
pub fn parse_image_name(s: &str) -> NodeResult<ImageName> {
    if s.contains(['/', ':', '@']) {
        parse_reference(s).map(ImageName::Reference)
    } else {
        validate_name(s).map(|()| ImageName::Short(s.to_string()))
    }
}

/// Check an image name as the API accepts it (short name or reference); see
/// [`parse_image_name`].
///
/// # Errors
/// `InvalidArgument` naming the rule.
pub fn validate_ref(s: &str) -> NodeResult<()> {
    parse_image_name(s).map(drop)
}

/// Which registries [`ImageStore::resolve`] may pull from when a create names a reference
/// that is not in the store. `sandlot image pull` is not limited by it.
///
/// A pull on create makes the node send HTTP requests to a host a caller chose, so the
/// default allows loopback registries only (`localhost`, `127.0.0.0/8`, `[::1]`, any port).
/// Set from `$SANDLOT_PULL_REGISTRIES`: `loopback` (default), `none`, `*` (any), or a
/// comma-separated list of `host[:port]` (`loopback` may be one of the items).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullPolicy {
    /// Never pull on create.
    None,
    /// Any registry.
    Any,
    /// Loopback registries, plus these `host[:port]`.
    Allow {
        /// Whether loopback registries are allowed.
        loopback: bool,
        /// Other allowed registries, exactly as written in references.
        hosts: Vec<String>,
    },
}

impl PullPolicy {
    /// Parse the `$SANDLOT_PULL_REGISTRIES` syntax (see the type).
    pub fn parse(s: &str) -> PullPolicy {
        match s.trim() {
            "" | "loopback" => PullPolicy::Allow {
                loopback: true,
                hosts: vec![],
            },
            "none" => PullPolicy::None,
            "*" => PullPolicy::Any,
            list => {
                let items: Vec<&str> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|x| !x.is_empty())
                    .collect();
                PullPolicy::Allow {
                    loopback: items.contains(&"loopback"),
                    hosts: items
                        .into_iter()
                        .filter(|x| *x != "loopback")
                        .map(str::to_string)
                        .collect(),
                }
            }
        }
    }

    /// From `$SANDLOT_PULL_REGISTRIES` (default `loopback`).
    pub fn from_env() -> PullPolicy {
        PullPolicy::parse(&std::env::var("SANDLOT_PULL_REGISTRIES").unwrap_or_default())
    }

    /// May a create pull from `registry` (`host[:port]`)?
    pub fn allows(&self, registry: &str) -> bool {
        match self {
            PullPolicy::None => false,
            PullPolicy::Any => true,
            PullPolicy::Allow { loopback, hosts } => {
                (*loopback && oci::is_loopback(registry)) || hosts.iter().any(|h| h == registry)
            }
        }
    }
}

/// What [`ImageStore::gc`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Blobs removed.
    pub blobs: u64,
    /// Layer directories removed (and retired built-in images, see [`RETIRED_DIR`]).
    pub layers: u64,
    /// Bytes freed (apparent sizes).
    pub bytes: u64,
    /// Layers no image references, and retired built-in images, kept because a mount
    /// still uses them.
    pub in_use: u64,
}

/// A directory of named images. Cheap to clone the path; all state is on disk, so several
/// stores (or processes) may share one directory.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
    pull_policy: PullPolicy,
}

impl ImageStore {
    /// Open (and create) the store at `dir`, removing temp directories left by dead builders.
    ///
    /// # Errors
    /// `Internal` with the path when the directory cannot be created or read.
    pub fn open(dir: impl Into<PathBuf>) -> NodeResult<ImageStore> {
        let dir = dir.into();
        fs::create_dir_all(&dir)
            .map_err(|e| NodeError::io(format!("create image store {}", dir.display()), e))?;
        remove_stale_tmp(&dir)?;
        for sub in ["refs", oci::BLOBS_DIR, oci::LAYERS_DIR] {
            let p = dir.join(sub);
            if p.is_dir() {
                remove_stale_tmp(&p)?;
            }
        }
        Ok(ImageStore {
            dir,
            pull_policy: PullPolicy::from_env(),
        })
    }

    /// Create `refs/`, `blobs/sha256/` and `layers/sha256/` when missing (on first OCI
    /// use, so a store of built-in images only stays as it was).
    pub(crate) fn ensure_oci_dirs(&self) -> NodeResult<()> {
        // SECURITY: blobs and layers hold image files with the image's own owners and
        // setuid bits; only root may reach them (sandboxes see them through overlay mounts
        // made by root, which do not walk these paths with the sandbox's credentials).
        for (sub, mode) in [
            ("refs", 0o755),
            ("blobs", 0o700),
            (oci::BLOBS_DIR, 0o700),
            ("layers", 0o700),
            (oci::LAYERS_DIR, 0o700),
        ] {
            let p = self.dir.join(sub);
            if !p.is_dir() {
                fs::create_dir_all(&p)
                    .map_err(|e| NodeError::io(format!("create {}", p.display()), e))?;
                set_mode(&p, mode)?;
            }
        }
        Ok(())
    }

    /// The same store with another pull-on-create policy.
    pub fn with_pull_policy(mut self, policy: PullPolicy) -> ImageStore {
        self.pull_policy = policy;
        self
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Directory of image `name` (short name or reference; see the module docs).
    fn image_dir(&self, name: &ImageName) -> PathBuf {
        match name {
            ImageName::Short(s) => self.dir.join(s),
            ImageName::Reference(r) => self.dir.join("refs").join(ref_hash(&r.whole())),
        }
    }

    /// Look an image up by name: a short name, or a reference (normalised first, so
    /// `127.0.0.1:5000/x` finds `127.0.0.1:5000/x:latest`). Never pulls; see
    /// [`resolve`](Self::resolve).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad name; `NotFound` (`image "x" not found; available: a, b`);
    /// `Internal` when its `image.json` is unreadable or corrupt.
    pub fn get(&self, name: &str) -> NodeResult<Image> {
        let parsed = parse_image_name(name)?;
        match self.load(&parsed)? {
            Some(img) => Ok(img),
            None => {
                let names: Vec<String> = self.list()?.into_iter().map(|i| i.name).collect();
                let available = if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                };
                Err(NodeError::NotFound(format!(
                    "image \"{name}\" not found; available: {available}"
                )))
            }
        }
    }

    /// The create path's one call: [`get`](Self::get), and when `name` is a reference that
    /// is not in the store and the [`PullPolicy`] allows its registry, pull it first (its lazy
    /// form when the registry has one; then it is cached). Concurrent resolves of the same
    /// reference in this process pull once. A lazy image's layers are mounted before it is
    /// returned.
    ///
    /// # Errors
    /// As [`get`](Self::get); a disallowed registry is `NotFound` with a hint to pull first;
    /// pull failures as [`pull`](Self::pull).
    pub async fn resolve(&self, name: &str) -> NodeResult<Image> {
        let parsed = parse_image_name(name)?;
        let ImageName::Reference(r) = &parsed else {
            return self.get(name);
        };
        if let Some(img) = self.load(&parsed)? {
            if matches!(img.source, ImageSource::Lazy { .. }) {
                let this = self.clone();
                let i2 = img.clone();
                tokio::task::spawn_blocking(move || this.mount_lazy(&i2))
                    .await
                    .map_err(|e| NodeError::Unavailable(format!("lazy mount task: {e}")))??;
            }
            return Ok(img);
        }
        let registry = r.resolve_registry().to_string();
        if !self.pull_policy.allows(&registry) {
            return Err(NodeError::NotFound(format!(
                "image \"{}\" is not in the node's store and pulling on create from {registry} is not allowed \
                 (SANDLOT_PULL_REGISTRIES); pull it first with `sandlot image pull {}`",
                r.whole(),
                r.whole()
            )));
        }
        let key = format!("{}\0{}", self.dir.display(), r.whole());
        let gate = {
            let mut m = PULLS.lock().unwrap_or_else(|p| p.into_inner());
            m.entry(key.clone())
                .or_insert_with(|| std::sync::Arc::new(tokio::sync::Mutex::new(())))
                .clone()
        };
        let _held = gate.lock().await;
        let out = match self.load(&parsed)? {
            Some(img) => Ok(img),
            None => self.pull_on_create(&r.whole()).await,
        };
        PULLS.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        match out {
            Ok(img) if matches!(img.source, ImageSource::Lazy { .. }) => {
                let this = self.clone();
                let i2 = img.clone();
                tokio::task::spawn_blocking(move || this.mount_lazy(&i2))
                    .await
                    .map_err(|e| NodeError::Unavailable(format!("lazy mount task: {e}")))??;
                Ok(img)
            }
            out => out,
        }
    }

    /// A create's pull of `reference`: its lazy form (`REF-lazy`, see [`lazy`]) when the
    /// registry has one (the caller mounts it), so the sandbox starts from metadata alone;
    /// otherwise the whole image ([`pull`](Self::pull)). `$SANDLOT_PULL_LAZY=0` always pulls
    /// the whole image.
    async fn pull_on_create(&self, reference: &str) -> NodeResult<Image> {
        if std::env::var("SANDLOT_PULL_LAZY").as_deref() != Ok("0") {
            match self.pull_lazy(reference, None).await {
                Ok(img) => {
                    tracing::info!(image = %reference, "pulled the lazy form on first use");
                    return Ok(img);
                }
                Err(e) => {
                    tracing::debug!(image = %reference, error = %e, "no lazy form; pulling whole")
                }
            }
        }
        tracing::info!(image = %reference, "pulling image on first use");
        self.pull(reference, None, &oci::NoProgress).await
    }

    /// All complete images (short-named and by reference), sorted by name. Broken entries
    /// are skipped with a warning.
    ///
    /// # Errors
    /// `Internal` when the store directory cannot be read.
    pub fn list(&self) -> NodeResult<Vec<Image>> {
        let mut out = Vec::new();
        for (sub, is_ref) in [(self.dir.clone(), false), (self.dir.join("refs"), true)] {
            let rd = match fs::read_dir(&sub) {
                Ok(rd) => rd,
                Err(e) if e.kind() == io::ErrorKind::NotFound && is_ref => continue,
                Err(e) => {
                    return Err(NodeError::io(
                        format!("read image store {}", sub.display()),
                        e,
                    ))
                }
            };
            for ent in rd {
                let ent = ent
                    .map_err(|e| NodeError::io(format!("read image store {}", sub.display()), e))?;
                let Some(fname) = ent.file_name().to_str().map(str::to_string) else {
                    continue;
                };
                let loaded = if is_ref {
                    if fname.len() != 64 || !fname.bytes().all(|c| c.is_ascii_hexdigit()) {
                        continue;
                    }
                    self.load_dir(&ent.path(), None)
                } else {
                    if validate_name(&fname).is_err() {
                        continue;
                    }
                    self.load(&ImageName::Short(fname.clone()))
                };
                match loaded {
                    Ok(Some(img)) => out.push(img),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(image = %fname, error = %e, "skipping broken image"),
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Remove an image (its name; blobs and layers stay until [`gc`](Self::gc)). Sandboxes
    /// still using it keep working as long as its layers are not garbage-collected; the
    /// caller must not remove images in use.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad name; `NotFound` when absent; `Internal` on I/O failure.
    pub fn remove(&self, name: &str) -> NodeResult<()> {
        let parsed = parse_image_name(name)?;
        let path = self.image_dir(&parsed);
        if self.load(&parsed)?.is_none() {
            return Err(NodeError::NotFound(format!("image \"{name}\" not found")));
        }
        // Rename first so the image disappears atomically; then delete at leisure.
        let doomed = self.tmp_path(&parsed, "rm");
        fs::rename(&path, &doomed)
            .map_err(|e| NodeError::io(format!("rename {}", path.display()), e))?;
        self.discard(&doomed, &path)
    }

    /// Delete `old`, a removed or replaced image directory that was at `origin`. A built-in
    /// image's directory holds its `rootfs`, which running sandboxes mount as a lower
    /// layer by the path `origin/rootfs`: while any mount names that path, the directory is
    /// moved to [`RETIRED_DIR`] instead, for `gc` to delete later (the rename keeps the
    /// mounts intact). A path reused by a newer image keeps its retired predecessors until
    /// neither is mounted: kept too long, never deleted under a sandbox.
    fn discard(&self, old: &Path, origin: &Path) -> NodeResult<()> {
        let rootfs = origin.join(ROOTFS_DIR);
        if old.join(ROOTFS_DIR).is_dir() && path_mounted(&rootfs) {
            let retired = self.dir.join(RETIRED_DIR);
            fs::create_dir_all(&retired)
                .map_err(|e| NodeError::io(format!("create {}", retired.display()), e))?;
            let base = origin.file_name().unwrap_or_default().to_string_lossy();
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            let to = retired.join(format!("{base}.{nanos}"));
            write_atomic(&old.join("origin"), rootfs.as_os_str().as_encoded_bytes())?;
            fs::rename(old, &to)
                .map_err(|e| NodeError::io(format!("rename {}", old.display()), e))?;
            tracing::info!(image = %origin.display(), kept = %to.display(), "image removed while sandboxes use its rootfs: kept until gc finds it unused");
            return Ok(());
        }
        fs::remove_dir_all(old).map_err(|e| NodeError::io(format!("remove {}", old.display()), e))
    }

    /// Remove every blob and unpacked layer that no image's `image.json` references, and
    /// leftovers of dead pulls. Holds the store lock exclusively, so it waits for running
    /// pulls/imports (which hold it shared) and they wait for it.
    ///
    /// Layers still mounted by a sandbox are kept even when no image references them any
    /// more: every mount namespace on the host is read (`/proc/<pid>/mountinfo`, one
    /// process per namespace) and layer directories named in a mount's options (overlay
    /// `lowerdir=`) count as referenced. So removing an image while sandboxes run on it and
    /// then collecting is safe; the layers go at the first `gc` after the last such sandbox.
    ///
    /// # Errors
    /// `Internal` on I/O failure.
    pub fn gc(&self) -> NodeResult<GcReport> {
        let _lock = self.lock(true)?;
        let mut keep_blobs = HashSet::new();
        let mut keep_layers = HashSet::new();
        let mut dirs = vec![];
        for (sub, is_ref) in [(self.dir.clone(), false), (self.dir.join("refs"), true)] {
            let rd = match fs::read_dir(&sub) {
                Ok(rd) => rd,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(NodeError::io(format!("read {}", sub.display()), e)),
            };
            for ent in rd.flatten() {
                let n = ent.file_name().to_string_lossy().to_string();
                if n.starts_with('.') || (!is_ref && RESERVED.contains(&n.as_str())) {
                    continue;
                }
                dirs.push(ent.path());
            }
        }
        for d in dirs {
            let p = d.join(IMAGE_JSON);
            let Ok(bytes) = fs::read(&p) else { continue };
            let meta: ImageJson = serde_json::from_slice(&bytes).map_err(|e| {
                NodeError::io(
                    format!("corrupt {}: {e}; refusing to gc", p.display()),
                    io::ErrorKind::InvalidData.into(),
                )
            })?;
            keep_blobs.extend(
                meta.blobs
                    .iter()
                    .filter_map(|b| oci::digest_hex(b).ok().map(str::to_string)),
            );
            for l in &meta.layers {
                if let Some(h) = l.strip_prefix(&format!("{}/", oci::LAYERS_DIR)) {
                    keep_layers.insert(h.to_string());
                }
            }
        }
        let mut report = GcReport::default();
        let retired = self.dir.join(RETIRED_DIR);
        for ent in fs::read_dir(&retired).into_iter().flatten().flatten() {
            let p = ent.path();
            let origin = fs::read(p.join("origin")).unwrap_or_default();
            if !origin.is_empty() && path_mounted(Path::new(&*String::from_utf8_lossy(&origin))) {
                report.in_use += 1;
                continue;
            }
            report.bytes += tree_size(&p).unwrap_or(0);
            report.layers += 1;
            fs::remove_dir_all(&p)
                .map_err(|e| NodeError::io(format!("remove {}", p.display()), e))?;
        }
        // Mounts name layers of every store on the host (another data dir's, a test's):
        // only this store's count as kept.
        let layers_dir = self.layers_dir();
        for h in layers_mounted() {
            if layers_dir.join(&h).is_dir() && keep_layers.insert(h) {
                report.in_use += 1;
            }
        }
        for (sub, keep, is_layer) in [
            (self.blobs_dir(), &keep_blobs, false),
            (self.layers_dir(), &keep_layers, true),
        ] {
            if !sub.is_dir() {
                continue;
            }
            remove_stale_tmp(&sub)?;
            let rd = fs::read_dir(&sub)
                .map_err(|e| NodeError::io(format!("read {}", sub.display()), e))?;
            for ent in rd.flatten() {
                let n = ent.file_name().to_string_lossy().to_string();
                if n.starts_with('.') || keep.contains(&n) {
                    continue;
                }
                let p = ent.path();
                let r = if is_layer {
                    report.bytes += tree_size(&p).unwrap_or(0);
                    report.layers += 1;
                    fs::remove_dir_all(&p)
                } else {
                    report.bytes += ent.metadata().map(|m| m.len()).unwrap_or(0);
                    report.blobs += 1;
                    fs::remove_file(&p)
                };
                r.map_err(|e| NodeError::io(format!("remove {}", p.display()), e))?;
            }
        }
        Ok(report)
    }

    /// Build (or reuse) the `busybox` image from [`HOST_BUSYBOX`]; takes well under a second.
    ///
    /// # Errors
    /// See [`build_busybox_with`](Self::build_busybox_with).
    pub fn build_busybox(&self) -> NodeResult<Image> {
        self.build_busybox_with(false)
    }

    /// Build the `busybox` image; an existing one is kept unless `force`.
    ///
    /// The rootfs has `bin/busybox`, a symlink per applet in `bin/` (`busybox --list`),
    /// `proc dev sys tmp(1777) etc root(0700) workspace usr/bin`, and `etc/passwd`,
    /// `etc/group`, `etc/hostname`.
    ///
    /// # Errors
    /// `Unavailable` when `/bin/busybox` is missing or dynamically linked (install
    /// `busybox-static`); `Internal` with the path on I/O failure.
    pub fn build_busybox_with(&self, force: bool) -> NodeResult<Image> {
        let name = "busybox";
        if !force {
            if let Some(img) = self.load(&ImageName::Short(name.to_string()))? {
                return Ok(img);
            }
        }
        let binary = PathBuf::from(HOST_BUSYBOX);
        check_static_elf(&binary)?;
        let env = vec![("PATH".to_string(), DEFAULT_PATH.to_string())];
        let source = ImageSource::Busybox {
            binary: binary.clone(),
        };
        self.install(name, source, env, Some("/workspace".into()), |rootfs| {
            fill_busybox(rootfs, &binary)
        })
    }

    /// Build (or reuse) the `python` image (Debian bookworm minbase + python3 + g++).
    ///
    /// # Errors
    /// See [`build_python_with`](Self::build_python_with).
    pub fn build_python(&self, cache_dir: &Path) -> NodeResult<Image> {
        self.build_python_with(cache_dir, false)
    }

    /// Build the `python` image; an existing one is kept unless `force`.
    ///
    /// The Debian tree is made once by `debootstrap` into `<cache_dir>/python-bookworm/`
    /// (about a minute and ~570 MB; progress goes to stderr), then each build hard-links it
    /// (about a second), drops `/dev` nodes and apt lists, and adds `/workspace`.
    ///
    /// # Errors
    /// `Unavailable` when `debootstrap` is missing or not run as root; `Internal` when
    /// debootstrap fails (its output is on stderr) or on I/O failure.
    pub fn build_python_with(&self, cache_dir: &Path, force: bool) -> NodeResult<Image> {
        self.build_debootstrap(
            "python",
            cache_dir,
            &DebootstrapSpec::python_bookworm(),
            force,
        )
    }

    /// Build image `name` from a debootstrap tree described by `spec`, cached at
    /// `<cache_dir>/<spec.cache_name>/`; an existing image is kept unless `force`.
    /// [`build_python`](Self::build_python) is this with [`DebootstrapSpec::python_bookworm`].
    ///
    /// The cache is built into a temp dir, checked (`spec.must_exist`), stamped with
    /// [`CACHE_STAMP`] and renamed into place; a cache dir without the stamp is never used
    /// (it is removed and rebuilt). Env: `PATH`, `LANG=C.UTF-8`; workdir `/workspace`.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad name; `Unavailable` when `debootstrap` is missing or not
    /// run as root; `Internal` when debootstrap fails (its output is on stderr) or on I/O
    /// failure.
    pub fn build_debootstrap(
        &self,
        name: &str,
        cache_dir: &Path,
        spec: &DebootstrapSpec,
        force: bool,
    ) -> NodeResult<Image> {
        validate_name(name)?;
        if !force {
            if let Some(img) = self.load(&ImageName::Short(name.to_string()))? {
                return Ok(img);
            }
        }
        let cache = ensure_debootstrap_cache(cache_dir, spec)?;
        let env = vec![
            ("PATH".to_string(), DEFAULT_PATH.to_string()),
            ("LANG".to_string(), "C.UTF-8".to_string()),
        ];
        self.install(
            name,
            ImageSource::Debootstrap(spec.clone()),
            env,
            Some("/workspace".into()),
            |rootfs| fill_from_cache(rootfs, &cache),
        )
    }

    /// Build image `name` into a temp dir with `fill(rootfs)`, write `image.json` last, and
    /// move it into place (replacing an existing image atomically).
    fn install(
        &self,
        name: &str,
        source: ImageSource,
        env: Vec<(String, String)>,
        workdir: Option<String>,
        fill: impl FnOnce(&Path) -> NodeResult<()>,
    ) -> NodeResult<Image> {
        validate_name(name)?;
        let key = ImageName::Short(name.to_string());
        let tmp = self.tmp_path(&key, "tmp");
        if tmp.exists() {
            fs::remove_dir_all(&tmp)
                .map_err(|e| NodeError::io(format!("remove {}", tmp.display()), e))?;
        }
        let result = (|| {
            let rootfs = tmp.join(ROOTFS_DIR);
            fs::create_dir_all(&rootfs)
                .map_err(|e| NodeError::io(format!("create {}", rootfs.display()), e))?;
            set_mode(&rootfs, 0o755)?;
            fill(&rootfs)?;
            let meta = ImageJson {
                name: name.to_string(),
                env,
                workdir,
                user: None,
                // Milliseconds: two builds within a second are still two versions.
                created_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                size_bytes: tree_size(&rootfs)?,
                source,
                layers: vec![format!("{name}/{ROOTFS_DIR}")],
                blobs: vec![],
            };
            let json = serde_json::to_vec_pretty(&meta).expect("image.json serializes");
            write_atomic(&tmp.join(IMAGE_JSON), &json)?;
            self.publish(&key, &tmp)
        })();
        if result.is_err() && tmp.exists() {
            // Keep the original error; a failed cleanup is retried by the next open().
            if let Err(e) = fs::remove_dir_all(&tmp) {
                tracing::warn!(path = %tmp.display(), error = %e, "cannot remove failed build");
            }
        }
        result?;
        self.load(&key)?.ok_or_else(|| {
            NodeError::io(
                format!("image {name} vanished right after being built"),
                io::ErrorKind::NotFound.into(),
            )
        })
    }

    /// Write an image that has no rootfs of its own (its layers are shared): a temp dir
    /// holding only `image.json`, moved into place (replacing an existing image atomically).
    fn install_meta(&self, name: &str, meta: &ImageJson) -> NodeResult<Image> {
        let key = parse_image_name(name)?;
        let tmp = self.tmp_path(&key, "tmp");
        if tmp.exists() {
            fs::remove_dir_all(&tmp)
                .map_err(|e| NodeError::io(format!("remove {}", tmp.display()), e))?;
        }
        let result = (|| {
            fs::create_dir_all(&tmp)
                .map_err(|e| NodeError::io(format!("create {}", tmp.display()), e))?;
            set_mode(&tmp, 0o755)?;
            let json = serde_json::to_vec_pretty(meta).expect("image.json serializes");
            write_atomic(&tmp.join(IMAGE_JSON), &json)?;
            self.publish(&key, &tmp)
        })();
        if result.is_err() && tmp.exists() {
            let _ = fs::remove_dir_all(&tmp);
        }
        result?;
        self.load(&key)?.ok_or_else(|| {
            NodeError::io(
                format!("image {name} vanished right after being installed"),
                io::ErrorKind::NotFound.into(),
            )
        })
    }

    /// Move a complete temp image dir to its place.
    fn publish(&self, name: &ImageName, tmp: &Path) -> NodeResult<()> {
        let dst = self.image_dir(name);
        let parent = dst.parent().unwrap_or(&self.dir).to_path_buf();
        match fs::rename(tmp, &dst) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) => {
                // Replace: swap the directories atomically (renameat2 RENAME_EXCHANGE), so
                // readers see either the old or the new image, then delete the old one.
                nix::fcntl::renameat2(
                    nix::fcntl::AT_FDCWD,
                    tmp,
                    nix::fcntl::AT_FDCWD,
                    &dst,
                    nix::fcntl::RenameFlags::RENAME_EXCHANGE,
                )
                .map_err(|e| {
                    NodeError::io(format!("swap {} into place", dst.display()), e.into())
                })?;
                self.discard(tmp, &dst)?;
            }
            Err(e) => return Err(NodeError::io(format!("rename to {}", dst.display()), e)),
        }
        fsync_dir(&parent)
    }

    /// `.<dirname>.<what><n>-<pid>` next to the image's directory.
    fn tmp_path(&self, name: &ImageName, what: &str) -> PathBuf {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let dst = self.image_dir(name);
        let base = dst
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        dst.with_file_name(format!(".{base}.{what}{n}-{}", std::process::id()))
    }

    /// Read the `image.json` of `name`; `None` when there is none.
    fn load(&self, name: &ImageName) -> NodeResult<Option<Image>> {
        self.load_dir(&self.image_dir(name), Some(&name.key()))
    }

    /// Read `<dir>/image.json`; `None` when there is none or (when `expect` is given) it
    /// names another image.
    fn load_dir(&self, dir: &Path, expect: Option<&str>) -> NodeResult<Option<Image>> {
        let path = dir.join(IMAGE_JSON);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(NodeError::io(format!("read {}", path.display()), e)),
        };
        let corrupt = |why: String| {
            NodeError::io(
                format!("corrupt {}: {why}", path.display()),
                io::ErrorKind::InvalidData.into(),
            )
        };
        let meta: ImageJson = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if expect.is_some_and(|n| meta.name != n) {
            // A directory renamed by hand, or a temp dir: not this image.
            return Ok(None);
        }
        if expect.is_none() {
            // Listed from refs/: the directory must be the hash of the name inside.
            let ok = matches!(parse_image_name(&meta.name), Ok(ImageName::Reference(_)))
                && dir.file_name().and_then(|s| s.to_str()) == Some(ref_hash(&meta.name).as_str());
            if !ok {
                return Ok(None);
            }
        }
        let rels = if meta.layers.is_empty() {
            vec![format!("{}/{ROOTFS_DIR}", meta.name)]
        } else {
            meta.layers.clone()
        };
        let mut layers = Vec::new();
        for rel in rels {
            // Layers must stay inside the store: no absolute paths, no `..`.
            let p = Path::new(&rel);
            if !p.components().all(|c| matches!(c, Component::Normal(_))) {
                return Err(corrupt(format!("layer path {rel:?} leaves the store")));
            }
            layers.push(self.dir.join(p));
        }
        Ok(Some(Image {
            name: meta.name,
            layers,
            env: meta.env,
            workdir: meta.workdir,
            user: meta.user,
            size_bytes: meta.size_bytes,
            created_at: meta.created_at,
            source: meta.source,
        }))
    }
}

/// Pulls in flight in this process, by store dir and reference ([`ImageStore::resolve`]).
static PULLS: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>>,
> = std::sync::LazyLock::new(Default::default);

/// Layer digests (hex) that appear as `…/layers/sha256/<hex>` in any mount of any mount
/// namespace (overlay `lowerdir=` options list them), reading `/proc/<pid>/mountinfo` once
/// per mount namespace. The match ignores which store the path is in (a relative or
/// symlinked store path would not match literally); keeping too much is the safe side.
/// Unreadable processes (gone meanwhile) are skipped.
fn layers_mounted() -> HashSet<String> {
    let mut out = HashSet::new();
    let needle = format!("/{}/", oci::LAYERS_DIR);
    each_mountinfo(|info| {
        let mut rest = info;
        while let Some(i) = rest.find(&needle) {
            rest = &rest[i + needle.len()..];
            let hex: String = rest.chars().take(64).collect();
            if hex.len() == 64 && hex.bytes().all(|c| c.is_ascii_hexdigit()) {
                out.insert(hex);
            }
        }
        false
    });
    out
}

/// Whether any mount of any mount namespace names `path` (as a source, mount point or an
/// option such as overlay's `lowerdir=`), followed by a separator (`,` `:` space, line end).
fn path_mounted(path: &Path) -> bool {
    let needle = path.to_string_lossy().into_owned();
    let mut found = false;
    each_mountinfo(|info| {
        found = info.match_indices(&needle).any(|(i, _)| {
            matches!(
                info.as_bytes().get(i + needle.len()),
                None | Some(b',' | b':' | b' ' | b'\n')
            )
        });
        found
    });
    found
}

/// Calls `f` with the `/proc/PID/mountinfo` text of one process per mount namespace (lower
/// dir aliases expanded to their store paths), until `f` answers true.
fn each_mountinfo(mut f: impl FnMut(&str) -> bool) {
    let mut seen_ns = HashSet::new();
    let Ok(rd) = fs::read_dir("/proc") else {
        return;
    };
    for ent in rd.flatten() {
        let name = ent.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|c| c.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(ns) = fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
            continue;
        };
        if !seen_ns.insert(ns) {
            continue;
        }
        let Ok(info) = fs::read_to_string(format!("/proc/{pid}/mountinfo")) else {
            continue;
        };
        // Sandboxes' overlays name their lower dirs by alias (`/run/sandlot/lower/<h>`,
        // sandlot_guest::layers): read back as the store paths they link to.
        if f(&sandlot_guest::layers::expand_aliases(&info)) {
            return;
        }
    }
}

/// Directory name of a reference image: lowercase hex SHA-256 of the normalised reference.
fn ref_hash(whole: &str) -> String {
    use sha2::Digest as _;
    unpack::hex(&sha2::Sha256::digest(whole.as_bytes()))
}

/// Remove `.<name>.<what>-<pid>` entries (directories or files) whose process is gone.
fn remove_stale_tmp(dir: &Path) -> NodeResult<()> {
    let rd = fs::read_dir(dir)
        .map_err(|e| NodeError::io(format!("read image store {}", dir.display()), e))?;
    for ent in rd.flatten() {
        let fname = ent.file_name();
        let Some(s) = fname.to_str() else { continue };
        if !s.starts_with('.') {
            continue;
        }
        let Some(pid) = s.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let path = ent.path();
            tracing::info!(path = %path.display(), "removing leftover of a dead build");
            let removed = unmount_under(&path).and_then(|()| {
                if path.is_dir() {
                    fs::remove_dir_all(&path)
                } else {
                    fs::remove_file(&path)
                }
                .map_err(|e| NodeError::io(format!("remove {}", path.display()), e))
            });
            if let Err(e) = removed {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove leftover");
            }
        }
    }
    Ok(())
}

/// Refuse a missing or dynamically linked binary (it would not run inside a bare image).
fn check_static_elf(path: &Path) -> NodeResult<()> {
    let data = match fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(NodeError::Unavailable(format!(
                "{} not found; install the Debian package busybox-static",
                path.display()
            )))
        }
        Err(e) => return Err(NodeError::io(format!("read {}", path.display()), e)),
    };
    if elf64_has_interp(&data) != Some(false) {
        return Err(NodeError::Unavailable(format!(
            "{} is not a static x86-64/ELF64 binary; install the Debian package busybox-static",
            path.display()
        )));
    }
    Ok(())
}

/// For a little-endian ELF64 file: does it have a `PT_INTERP` program header (i.e. is it
/// dynamically linked)? `None` when it is not such a file. Format: ELF-64 Object File
/// Format 1.5, "ELF Header" (e_phoff at 0x20, e_phentsize at 0x36, e_phnum at 0x38) and
/// "Program Header" (p_type at 0, PT_INTERP = 3).
fn elf64_has_interp(data: &[u8]) -> Option<bool> {
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 || data[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(data.get(o..o + 2)?.try_into().ok()?));
    let phoff = u64::from_le_bytes(data.get(0x20..0x28)?.try_into().ok()?) as usize;
    let phentsize = u16_at(0x36)? as usize;
    let phnum = u16_at(0x38)? as usize;
    for i in 0..phnum {
        let off = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let p_type = u32::from_le_bytes(data.get(off..off + 4)?.try_into().ok()?);
        if p_type == 3 {
            return Some(true);
        }
    }
    Some(false)
}

/// Lay out the busybox rootfs.
fn fill_busybox(rootfs: &Path, binary: &Path) -> NodeResult<()> {
    for (d, mode) in [
        ("bin", 0o755),
        ("proc", 0o755),
        ("dev", 0o755),
        ("sys", 0o755),
        ("tmp", 0o1777),
        ("etc", 0o755),
        ("root", 0o700),
        ("workspace", 0o755),
        ("usr", 0o755),
        ("usr/bin", 0o755),
    ] {
        let p = rootfs.join(d);
        fs::create_dir_all(&p).map_err(|e| NodeError::io(format!("create {}", p.display()), e))?;
        // Explicit chmod: create_dir_all is subject to the umask, and tmp needs the sticky bit.
        set_mode(&p, mode)?;
    }
    let dst = rootfs.join("bin/busybox");
    fs::copy(binary, &dst)
        .map_err(|e| NodeError::io(format!("copy {} to {}", binary.display(), dst.display()), e))?;
    set_mode(&dst, 0o755)?;
    let out = Command::new(binary)
        .arg("--list")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NodeError::io(format!("run {} --list", binary.display()), e))?;
    if !out.status.success() {
        return Err(NodeError::io(
            format!("{} --list exited with {}", binary.display(), out.status),
            io::ErrorKind::Other.into(),
        ));
    }
    let mut applets: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && !a.contains('/') && *a != "busybox" && *a != "." && *a != "..")
        .map(str::to_string)
        .collect();
    if !applets.iter().any(|a| a == "sh") {
        applets.push("sh".into());
    }
    for a in applets {
        let link = rootfs.join("bin").join(&a);
        match std::os::unix::fs::symlink("busybox", &link) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(NodeError::io(format!("symlink {}", link.display()), e)),
        }
    }
    for (f, body, mode) in [
        (
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
            0o644,
        ),
        ("etc/group", "root:x:0:\nnogroup:x:65534:\n", 0o644),
        ("etc/hostname", "sandbox\n", 0o644),
    ] {
        let p = rootfs.join(f);
        fs::write(&p, body).map_err(|e| NodeError::io(format!("write {}", p.display()), e))?;
        set_mode(&p, mode)?;
    }
    Ok(())
}

/// Make sure `<cache_dir>/<spec.cache_name>` holds a complete debootstrap tree; build it
/// when missing. Returns its path.
fn ensure_debootstrap_cache(cache_dir: &Path, spec: &DebootstrapSpec) -> NodeResult<PathBuf> {
    // The cache name becomes a path component: same rule as image names (no `/`, no `..`).
    validate_name(&spec.cache_name)?;
    let dst = cache_dir.join(&spec.cache_name);
    if dst.join(CACHE_STAMP).exists() {
        return Ok(dst);
    }
    fs::create_dir_all(cache_dir)
        .map_err(|e| NodeError::io(format!("create cache dir {}", cache_dir.display()), e))?;
    remove_stale_tmp(cache_dir)?;
    if dst.exists() {
        // No stamp: an interrupted or foreign tree. Never use it; move it aside and drop it.
        tracing::warn!(path = %dst.display(), "cache dir without completeness stamp; rebuilding");
        let stale = cache_dir.join(format!(".{}.stale-{}", spec.cache_name, std::process::id()));
        unmount_under(&dst)?;
        fs::rename(&dst, &stale)
            .map_err(|e| NodeError::io(format!("move aside {}", dst.display()), e))?;
        fs::remove_dir_all(&stale)
            .map_err(|e| NodeError::io(format!("remove {}", stale.display()), e))?;
    }
    if !nix::unistd::Uid::effective().is_root() {
        return Err(NodeError::Unavailable(
            "building a debootstrap image needs root".into(),
        ));
    }
    let tmp = cache_dir.join(format!(".{}.tmp-{}", spec.cache_name, std::process::id()));
    if tmp.exists() {
        unmount_under(&tmp)?;
        fs::remove_dir_all(&tmp)
            .map_err(|e| NodeError::io(format!("remove {}", tmp.display()), e))?;
    }
    let result = (|| {
        run_debootstrap(spec, &tmp)?;
        for p in &spec.must_exist {
            if fs::symlink_metadata(tmp.join(p)).is_err() {
                return Err(NodeError::io(
                    format!(
                        "debootstrap finished but {} is missing in {}",
                        p,
                        tmp.display()
                    ),
                    io::ErrorKind::NotFound.into(),
                ));
            }
        }
        let stamp = serde_json::json!({
            "spec": spec,
            "created_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        });
        write_atomic(&tmp.join(CACHE_STAMP), stamp.to_string().as_bytes())?;
        match fs::rename(&tmp, &dst) {
            Ok(()) => fsync_dir(cache_dir),
            // Another builder finished first; theirs is complete too.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) => {
                fs::remove_dir_all(&tmp)
                    .map_err(|e| NodeError::io(format!("remove {}", tmp.display()), e))
            }
            Err(e) => Err(NodeError::io(format!("rename to {}", dst.display()), e)),
        }
    })();
    if result.is_err() && tmp.exists() {
        if let Err(e) = unmount_under(&tmp).and_then(|()| {
            fs::remove_dir_all(&tmp)
                .map_err(|e| NodeError::io(format!("remove {}", tmp.display()), e))
        }) {
            tracing::warn!(path = %tmp.display(), error = %e, "cannot remove failed debootstrap");
        }
    }
    result.map(|()| dst)
}

/// Detach every mount at or below `dir` (deepest first). debootstrap mounts `proc` and
/// `sys` inside its target while it runs; if it dies midway they stay mounted, and a
/// recursive delete must never walk into the host's procfs/sysfs through them.
fn unmount_under(dir: &Path) -> NodeResult<()> {
    for p in crate::mountinfo::mounts_under(dir) {
        nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH)
            .map_err(|e| NodeError::io(format!("unmount {}", p.display()), e.into()))?;
    }
    Ok(())
}

/// Run debootstrap into `target`, its output streamed to our stderr so a user sees progress.
fn run_debootstrap(spec: &DebootstrapSpec, target: &Path) -> NodeResult<()> {
    let mut cmd = Command::new("debootstrap");
    cmd.arg(format!("--variant={}", spec.variant));
    if !spec.include.is_empty() {
        cmd.arg(format!("--include={}", spec.include.join(",")));
    }
    cmd.arg(&spec.suite)
        .arg(target)
        .arg(&spec.mirror)
        .stdin(Stdio::null())
        .stdout(io::stderr())
        .stderr(Stdio::inherit());
    tracing::info!(suite = %spec.suite, target = %target.display(), mirror = %spec.mirror,
        "running debootstrap (about a minute)");
    let status = match cmd.status() {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(NodeError::Unavailable(
                "debootstrap not found; install the Debian package debootstrap".into(),
            ))
        }
        Err(e) => return Err(NodeError::io("run debootstrap", e)),
    };
    if !status.success() {
        return Err(NodeError::io(
            format!(
                "debootstrap {} into {} failed ({status}); its log is above and in {}/debootstrap/debootstrap.log",
                spec.suite,
                target.display(),
                target.display()
            ),
            io::ErrorKind::Other.into(),
        ));
    }
    Ok(())
}

/// Hard-link the cache into `rootfs`, then trim what an image should not carry.
///
/// Hard links are safe here: image layers are overlay *lower* dirs, mounted read-only and
/// owned by host root; overlayfs copies a file up into the sandbox's upper dir before any
/// change, so no sandbox can ever write to these shared inodes, and nothing else writes to
/// the cache after its stamp is set.
fn fill_from_cache(rootfs: &Path, cache: &Path) -> NodeResult<()> {
    let status = Command::new("cp")
        .arg("-a")
        .arg("--link")
        .arg("--no-target-directory")
        .arg(cache)
        .arg(rootfs)
        .stdin(Stdio::null())
        .status()
        .map_err(|e| NodeError::io("run cp", e))?;
    if !status.success() {
        return Err(NodeError::io(
            format!(
                "cp -al {} {} failed ({status})",
                cache.display(),
                rootfs.display()
            ),
            io::ErrorKind::Other.into(),
        ));
    }
    // Unlinking names in the copy never touches the cache's own names.
    remove_if_exists(&rootfs.join(CACHE_STAMP))?;
    // SECURITY: debootstrap creates real device nodes in /dev (null, zero, tty, console,
    // ...). A lower layer must not carry device nodes: the jail gives each sandbox its own
    // /dev, and a node inside the image would be one more way to reach a host device
    // should a mount ever lack nodev.
    empty_dir(&rootfs.join("dev"))?;
    // Apt indexes and caches: tens of MB, useless without network.
    empty_dir(&rootfs.join("var/lib/apt/lists"))?;
    empty_dir(&rootfs.join("var/cache/apt"))?;
    let ws = rootfs.join("workspace");
    fs::create_dir_all(&ws).map_err(|e| NodeError::io(format!("create {}", ws.display()), e))?;
    set_mode(&ws, 0o755)
}

/// Remove everything inside `dir` (not `dir` itself); a missing dir is fine.
fn empty_dir(dir: &Path) -> NodeResult<()> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(NodeError::io(format!("read {}", dir.display()), e)),
    };
    for ent in rd {
        let ent = ent.map_err(|e| NodeError::io(format!("read {}", dir.display()), e))?;
        let p = ent.path();
        let ft = ent
            .file_type()
            .map_err(|e| NodeError::io(format!("stat {}", p.display()), e))?;
        // file_type() does not follow symlinks, so a symlink to a dir is unlinked, not walked.
        let r = if ft.is_dir() {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_file(&p)
        };
        r.map_err(|e| NodeError::io(format!("remove {}", p.display()), e))?;
    }
    Ok(())
}

fn remove_if_exists(p: &Path) -> NodeResult<()> {
    match fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NodeError::io(format!("remove {}", p.display()), e)),
    }
}

fn set_mode(p: &Path, mode: u32) -> NodeResult<()> {
    fs::set_permissions(p, fs::Permissions::from_mode(mode))
        .map_err(|e| NodeError::io(format!("chmod {:o} {}", mode, p.display()), e))
}

/// Write `path` via a temp file in the same directory, fsync, rename, fsync the directory.
fn write_atomic(path: &Path, data: &[u8]) -> NodeResult<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|s| s.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    let mut f = fs::File::create(&tmp)
        .map_err(|e| NodeError::io(format!("create {}", tmp.display()), e))?;
    f.write_all(data)
        .and_then(|()| f.sync_all())
        .map_err(|e| NodeError::io(format!("write {}", tmp.display()), e))?;
    set_mode(&tmp, 0o644)?;
    fs::rename(&tmp, path)
        .map_err(|e| NodeError::io(format!("rename to {}", path.display()), e))?;
    fsync_dir(dir)
}

pub(crate) fn fsync_dir(dir: &Path) -> NodeResult<()> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| NodeError::io(format!("fsync {}", dir.display()), e))
}

/// Apparent size of a tree: regular files and symlinks, each inode counted once.
fn tree_size(root: &Path) -> NodeResult<u64> {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd =
            fs::read_dir(&dir).map_err(|e| NodeError::io(format!("read {}", dir.display()), e))?;
        for ent in rd {
            let ent = ent.map_err(|e| NodeError::io(format!("read {}", dir.display()), e))?;
            let md = fs::symlink_metadata(ent.path())
                .map_err(|e| NodeError::io(format!("stat {}", ent.path().display()), e))?;
            if md.is_dir() {
                stack.push(ent.path());
            } else if (md.is_file() || md.file_type().is_symlink())
                && seen.insert((md.dev(), md.ino()))
            {
                total += md.len();
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["busybox", "python", "a", "0", "py3.11_x-y", &"a".repeat(64)] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Busybox",
            ".x",
            "-x",
            "_x",
            "a/b",
            "..",
            "a b",
            &"a".repeat(65),
            "é",
        ] {
            assert!(
                matches!(validate_name(bad), Err(NodeError::InvalidArgument(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn image_names_and_references() {
        assert_eq!(
            parse_image_name("python").unwrap(),
            ImageName::Short("python".into())
        );
        for (given, whole) in [
            (
                "127.0.0.1:5000/sandlot/python:latest",
                "127.0.0.1:5000/sandlot/python:latest",
            ),
            (
                "127.0.0.1:5000/sandlot/python",
                "127.0.0.1:5000/sandlot/python:latest",
            ),
            ("busybox:1.36", "docker.io/library/busybox:1.36"),
            ("localhost/x", "localhost/x:latest"),
        ] {
            assert_eq!(parse_image_name(given).unwrap().key(), whole, "{given}");
        }
        for bad in [
            "Python:3",
            "A/b",
            "a b/c",
            "x@sha256:00",
            "refs",
            "blobs",
            "a/../b",
        ] {
            assert!(
                matches!(parse_image_name(bad), Err(NodeError::InvalidArgument(_))),
                "{bad}"
            );
        }
        assert!(validate_ref(&format!("a/{}", "b".repeat(600))).is_err());
    }

    #[test]
    fn pull_policy() {
        let lo = PullPolicy::parse("");
        assert!(lo.allows("127.0.0.1:5000") && lo.allows("localhost") && lo.allows("[::1]:5000"));
        assert!(!lo.allows("docker.io") && !lo.allows("10.0.0.1:5000"));
        assert!(!PullPolicy::parse("none").allows("127.0.0.1:5000"));
        assert!(PullPolicy::parse("*").allows("registry.example.com"));
        let list = PullPolicy::parse("registry.example.com:443, loopback");
        assert!(list.allows("registry.example.com:443") && list.allows("127.0.0.2:1"));
        assert!(!list.allows("registry.example.com"));
        assert!(!PullPolicy::parse("r.example").allows("127.0.0.1:5000"));
    }

    #[test]
    fn elf_interp_detection() {
        // Not ELF.
        assert_eq!(elf64_has_interp(b"#!/bin/sh\n"), None);
        // A minimal ELF64 header with one program header of the given type.
        let elf = |p_type: u32| {
            let mut d = vec![0u8; 64 + 56];
            d[..4].copy_from_slice(b"\x7fELF");
            d[4] = 2;
            d[5] = 1;
            d[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
            d[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
            d[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
            d[64..68].copy_from_slice(&p_type.to_le_bytes());
            d
        };
        assert_eq!(elf64_has_interp(&elf(3)), Some(true));
        assert_eq!(elf64_has_interp(&elf(1)), Some(false));
        // Truncated program header table.
        let mut t = elf(3);
        t.truncate(66);
        assert_eq!(elf64_has_interp(&t), None);
        // The real host binaries, when present.
        if let Ok(d) = fs::read("/bin/ls") {
            assert_eq!(elf64_has_interp(&d), Some(true), "/bin/ls is dynamic");
        }
    }

    #[test]
    fn image_json_round_trip() {
        let j = ImageJson {
            name: "python".into(),
            env: vec![("PATH".into(), DEFAULT_PATH.into())],
            workdir: Some("/workspace".into()),
            user: None,
            created_at: "2026-11-29T10:00:00Z".into(),
            size_bytes: 5,
            source: ImageSource::Debootstrap(DebootstrapSpec::python_bookworm()),
            layers: vec!["python/rootfs".into()],
            blobs: vec![],
        };
        let s = serde_json::to_string(&j).unwrap();
        assert!(s.contains("\"kind\":\"debootstrap\""), "{s}");
        let back: ImageJson = serde_json::from_str(&s).unwrap();
        assert_eq!(back.source, j.source);
        assert_eq!(back.env, j.env);
    }

    #[test]
    fn version_changes_with_a_rebuild_only() {
        let img = Image {
            name: "busybox".into(),
            layers: vec![PathBuf::from("/i/busybox/rootfs")],
            env: vec![],
            workdir: None,
            user: None,
            size_bytes: 1,
            created_at: "2026-12-01T10:00:00.000Z".into(),
            source: ImageSource::Busybox {
                binary: HOST_BUSYBOX.into(),
            },
        };
        let v = img.version();
        assert!(
            v.len() == 16 && v.bytes().all(|b| b.is_ascii_hexdigit()),
            "{v}"
        );
        // Env and size are not part of it; a new build time or other layers are.
        let same = Image {
            env: vec![("A".into(), "b".into())],
            size_bytes: 2,
            ..img.clone()
        };
        assert_eq!(same.version(), v);
        let rebuilt = Image {
            created_at: "2026-12-01T10:00:00.001Z".into(),
            ..img.clone()
        };
        assert_ne!(rebuilt.version(), v);
        let repulled = Image {
            layers: vec![PathBuf::from("/i/layers/sha256/ab")],
            ..img
        };
        assert_ne!(repulled.version(), v);
    }
}
