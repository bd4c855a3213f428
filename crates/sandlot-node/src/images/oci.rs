//! OCI images: the content-addressed blob and layer store, registry pulls (OCI Distribution
//! Specification v1.1 through `oci-client`) and imports of OCI image layouts and
//! `docker save` / OCI archives (OCI Image Format Specification v1.1: `image-layout.md`,
//! `manifest.md`, `image-index.md`, `config.md`; Docker Image Specification v1.2 for the
//! `manifest.json` of `docker save`).
//!
//! Layout under the store directory (see also [`super`]):
//!
//! ```text
//! blobs/sha256/<hex>         manifests, configs and layer blobs as fetched, file name = the
//!                            SHA-256 of the content (verified before the rename that
//!                            publishes it); 0700 directory
//! layers/sha256/<hex>/       one unpacked layer per DiffID (SHA-256 of the uncompressed
//!                            tar), an overlay lower dir shared by every image using it;
//!                            0700 directory, so host users cannot reach image files
//! .lock                      flock: pulls/imports hold it shared, `gc` exclusive
//! ```
use super::unpack::{self, hex, Compression};
use super::{ImageError, ImageJson, ImageSource, ImageStore};
use crate::node::{NodeError, NodeResult};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Directory of blobs, relative to the store.
pub const BLOBS_DIR: &str = "blobs/sha256";
/// Directory of unpacked layers, relative to the store.
pub const LAYERS_DIR: &str = "layers/sha256";
/// Largest manifest, index or config accepted (bytes); the distribution spec suggests 4 MiB.
pub const MAX_JSON_BYTES: u64 = 4 << 20;

/// Media types accepted for manifests and indexes (OCI and Docker schema 2).
pub const MANIFEST_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// Progress of a pull or import, reported per blob or layer. Implemented by the CLI with
/// progress bars; the node's create path uses [`NoProgress`].
pub trait Progress: Send + Sync {
    /// Work on item `id` (a short digest) began: `what` is e.g. `"download"` or
    /// `"unpack"`, `total` its size in bytes when known.
    fn start(&self, id: &str, what: &str, total: Option<u64>);
    /// `bytes` more of item `id` are done.
    fn advance(&self, id: &str, bytes: u64);
    /// Item `id` is finished; `note` says how (e.g. `"done"`, `"already present"`).
    fn finish(&self, id: &str, note: &str);
}

/// A [`Progress`] that reports nothing (debug logs only).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, id: &str, what: &str, total: Option<u64>) {
        tracing::debug!(id, what, ?total, "image: start");
    }
    fn advance(&self, _id: &str, _bytes: u64) {}
    fn finish(&self, id: &str, note: &str) {
        tracing::debug!(id, note, "image: finish");
    }
}

/// The hex part of a `sha256:<64 lowercase hex>` digest.
///
/// # Errors
/// `InvalidArgument` for another algorithm or a malformed digest.
pub fn digest_hex(digest: &str) -> NodeResult<&str> {
    match digest.split_once(':') {
        Some(("sha256", h))
            if h.len() == 64
                && h.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) =>
        {
            Ok(h)
        }
        Some(("sha256", _)) | None => Err(ImageError::MalformedDigest {
            digest: digest.to_string(),
        }
        .into()),
        Some((algo, _)) => Err(ImageError::UnsupportedDigest {
            algorithm: algo.to_string(),
            digest: digest.to_string(),
        }
        .into()),
    }
}

/// `sha256:<hex>` of bytes.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(data)))
}

/// A content descriptor (OCI image spec, descriptor.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Media type of the referenced content.
    #[serde(default)]
    pub media_type: String,
    /// `sha256:<hex>` of the content.
    pub digest: String,
    /// Size of the content in bytes.
    #[serde(default)]
    pub size: i64,
    /// Platform (indexes only).
    #[serde(default)]
    pub platform: Option<Platform>,
    /// Annotations, e.g. `org.opencontainers.image.ref.name`.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// A platform of an index entry (OCI image spec, image-index.md).
#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    /// CPU architecture, e.g. `amd64`.
    pub architecture: String,
    /// Operating system, e.g. `linux`.
    pub os: String,
}

/// A manifest or an index: both parse into this (the fields tell them apart).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ManifestOrIndex {
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
}

/// The parts of an image config the store uses (OCI image spec, config.md).
#[derive(Debug, Clone, Deserialize, Default)]
pub struct ImageConfig {
    /// CPU architecture.
    #[serde(default)]
    pub architecture: String,
    /// Operating system.
    #[serde(default)]
    pub os: String,
    /// Execution defaults.
    #[serde(default)]
    pub config: Option<ExecConfig>,
    /// Layer DiffIDs, bottom-most first.
    pub rootfs: RootFs,
}

/// `config` of an image config: execution defaults.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct ExecConfig {
    /// `KEY=VALUE` entries.
    #[serde(rename = "Env", default)]
    pub env: Option<Vec<String>>,
    /// Default working directory.
    #[serde(rename = "WorkingDir", default)]
    pub working_dir: Option<String>,
    /// Default user (`name`, `uid`, `uid:gid`, `name:group`).
    #[serde(rename = "User", default)]
    pub user: Option<String>,
}

/// `rootfs` of an image config.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RootFs {
    /// Always `layers`.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// `sha256:<hex>` of each uncompressed layer, bottom-most first.
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

fn is_index(m: &ManifestOrIndex) -> bool {
    m.manifests.is_some()
        || matches!(
            m.media_type.as_deref(),
            Some("application/vnd.oci.image.index.v1+json")
                | Some("application/vnd.docker.distribution.manifest.list.v2+json")
        )
}

/// Pick the linux/amd64 entry of an index (the only platform this node runs).
fn pick_platform<'a>(entries: &'a [Descriptor], what: &str) -> NodeResult<&'a Descriptor> {
    entries
        .iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .ok_or_else(|| {
            let have: Vec<String> = entries
                .iter()
                .filter_map(|d| d.platform.as_ref())
                .map(|p| format!("{}/{}", p.os, p.architecture))
                .collect();
            NodeError::NotFound(format!(
                "{what} has no linux/amd64 image (platforms: {})",
                if have.is_empty() {
                    "none".into()
                } else {
                    have.join(", ")
                }
            ))
        })
}

fn parse_json<T: for<'de> Deserialize<'de>>(data: &[u8], what: &str) -> NodeResult<T> {
    serde_json::from_slice(data).map_err(|source| {
        ImageError::Json {
            what: what.to_string(),
            source,
        }
        .into()
    })
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// `.<stem>.tmp<n>-<pid>`: unique per process and call; the pid last, so
/// [`super::remove_stale_tmp`] can clear it once the process is gone.
fn tmp_name(stem: &str) -> String {
    format!(
        ".{stem}.tmp{}-{}",
        TMP_SEQ.fetch_add(1, Ordering::Relaxed),
        std::process::id()
    )
}

/// A blob being written into the store: temp file, hashed as it goes; [`commit`](Self::commit)
/// verifies and renames it into place; dropped uncommitted, the temp file is removed.
pub struct BlobWriter {
    dir: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
    hash: Sha256,
    n: u64,
    limit: Option<u64>,
}

impl BlobWriter {
    /// Write `data`.
    ///
    /// # Errors
    /// `InvalidArgument` when more bytes arrive than the descriptor's size; `Internal` on
    /// I/O failure.
    pub fn write(&mut self, data: &[u8]) -> NodeResult<()> {
        self.n += data.len() as u64;
        if let Some(l) = self.limit {
            if self.n > l {
                return Err(NodeError::InvalidArgument(format!(
                    "blob is larger than its descriptor says ({l} bytes)"
                )));
            }
        }
        self.hash.update(data);
        self.file
            .as_mut()
            .expect("file present until commit")
            .write_all(data)
            .map_err(|e| NodeError::io(format!("write {}", self.tmp.display()), e))
    }

    /// fsync, check the digest (and size) and publish as `blobs/sha256/<hex>`. Returns the
    /// digest and size.
    ///
    /// # Errors
    /// `InvalidArgument` on a digest or size mismatch (nothing is kept); `Internal` on I/O.
    pub fn commit(mut self, expected: Option<&str>) -> NodeResult<(String, u64)> {
        // The file stays in `self.file` until the rename: an early return drops `self`,
        // whose Drop removes the temp file.
        self.file
            .as_ref()
            .expect("file present until commit")
            .sync_all()
            .map_err(|e| NodeError::io(format!("fsync {}", self.tmp.display()), e))?;
        let got = format!("sha256:{}", hex(&self.hash.clone().finalize()));
        if let Some(want) = expected {
            if want != got {
                return Err(ImageError::DigestMismatch {
                    expected: want.to_string(),
                    got,
                }
                .into());
            }
        }
        if let Some(l) = self.limit {
            if self.n != l {
                return Err(NodeError::InvalidArgument(format!(
                    "blob {got} has {} bytes, its descriptor says {l}",
                    self.n
                )));
            }
        }
        let dst = self.dir.join(&got["sha256:".len()..]);
        fs::rename(&self.tmp, &dst)
            .map_err(|e| NodeError::io(format!("rename to {}", dst.display()), e))?;
        self.file = None;
        super::fsync_dir(&self.dir)?;
        Ok((got, self.n))
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Where an import reads from: an OCI layout directory or a tar archive of one (or of a
/// `docker save`), addressed by relative paths.
enum Source {
    Dir(PathBuf),
    /// Uncompressed tar: regular files by cleaned path → (data offset, size); symlinks by
    /// cleaned path → cleaned target path.
    Tar {
        path: PathBuf,
        files: BTreeMap<String, (u64, u64)>,
        links: BTreeMap<String, String>,
    },
}

fn clean_rel(p: &str) -> Option<String> {
    let mut out: Vec<String> = Vec::new();
    for c in Path::new(p).components() {
        match c {
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir => {
                out.pop()?;
            }
            Component::Normal(s) => out.push(s.to_str()?.to_string()),
            Component::Prefix(_) => return None,
        }
    }
    Some(out.join("/"))
}

impl Source {
    fn open(path: &Path) -> NodeResult<Source> {
        let md = fs::metadata(path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => {
                NodeError::NotFound(format!("{} does not exist", path.display()))
            }
            _ => NodeError::io(format!("stat {}", path.display()), e),
        })?;
        if md.is_dir() {
            return Ok(Source::Dir(path.to_path_buf()));
        }
        let mut f =
            File::open(path).map_err(|e| NodeError::io(format!("open {}", path.display()), e))?;
        let mut head = [0u8; 4];
        let n = f.read(&mut head).unwrap_or(0);
        if Compression::sniff(&head[..n]) != Compression::None {
            return Err(NodeError::InvalidArgument(format!(
                "{} is compressed; decompress it first (gunzip / unzstd): import reads plain tar archives",
                path.display()
            )));
        }
        f.seek(SeekFrom::Start(0))
            .map_err(|e| NodeError::io(format!("seek {}", path.display()), e))?;
        let mut ar = tar::Archive::new(f);
        let mut files = BTreeMap::new();
        let mut links = BTreeMap::new();
        let bad = |e: io::Error| {
            NodeError::InvalidArgument(format!("{} is not a tar archive: {e}", path.display()))
        };
        for ent in ar.entries().map_err(bad)? {
            let ent = ent.map_err(bad)?;
            let p = ent.path().map_err(bad)?;
            let Some(name) = p.to_str().and_then(clean_rel) else {
                continue;
            };
            match ent.header().entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    files.insert(name, (ent.raw_file_position(), ent.size()));
                }
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    let Some(t) = ent.link_name().ok().flatten() else {
                        continue;
                    };
                    let t = t.to_string_lossy().to_string();
                    let target = if ent.header().entry_type() == tar::EntryType::Symlink {
                        let parent = Path::new(&name)
                            .parent()
                            .map(|p| p.to_string_lossy().to_string())
                            .unwrap_or_default();
                        clean_rel(&format!("{parent}/{t}"))
                    } else {
                        clean_rel(&t)
                    };
                    if let Some(target) = target {
                        links.insert(name, target);
                    }
                }
                _ => {}
            }
        }
        Ok(Source::Tar {
            path: path.to_path_buf(),
            files,
            links,
        })
    }

    fn exists(&self, rel: &str) -> bool {
        match self {
            Source::Dir(d) => d.join(rel).is_file(),
            Source::Tar { files, links, .. } => files.contains_key(rel) || links.contains_key(rel),
        }
    }

    /// Open `rel` (a relative path from a manifest) for reading; returns its size too.
    fn read(&self, rel: &str) -> NodeResult<(Box<dyn Read + Send>, u64)> {
        let Some(clean) = clean_rel(rel).filter(|c| {
            !c.is_empty() && !rel.starts_with('/') && !rel.split('/').any(|c| c == "..")
        }) else {
            return Err(NodeError::InvalidArgument(format!(
                "path {rel:?} in the archive leaves it"
            )));
        };
        match self {
            Source::Dir(d) => {
                let p = d.join(&clean);
                let f = File::open(&p).map_err(|e| match e.kind() {
                    io::ErrorKind::NotFound => {
                        NodeError::InvalidArgument(format!("{} is missing", p.display()))
                    }
                    _ => NodeError::io(format!("open {}", p.display()), e),
                })?;
                let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                Ok((Box::new(f), len))
            }
            Source::Tar { path, files, links } => {
                let mut key = clean;
                for _ in 0..8 {
                    match links.get(&key) {
                        Some(t) => key = t.clone(),
                        None => break,
                    }
                }
                let (off, size) = *files.get(&key).ok_or_else(|| {
                    NodeError::InvalidArgument(format!("{rel} is missing from {}", path.display()))
                })?;
                let mut f = File::open(path)
                    .map_err(|e| NodeError::io(format!("open {}", path.display()), e))?;
                f.seek(SeekFrom::Start(off))
                    .map_err(|e| NodeError::io(format!("seek {}", path.display()), e))?;
                Ok((Box::new(f.take(size)), size))
            }
        }
    }

    fn read_small(&self, rel: &str) -> NodeResult<Vec<u8>> {
        let (r, _) = self.read(rel)?;
        let mut v = Vec::new();
        r.take(MAX_JSON_BYTES + 1)
            .read_to_end(&mut v)
            .map_err(|e| NodeError::io(format!("read {rel}"), e))?;
        if v.len() as u64 > MAX_JSON_BYTES {
            return Err(NodeError::InvalidArgument(format!(
                "{rel} is larger than {MAX_JSON_BYTES} bytes"
            )));
        }
        Ok(v)
    }
}

/// `docker save` manifest.json entry (Docker Image Specification v1.2, "Combined Image JSON
/// + Filesystem Changeset Format").
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerSaveEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// A layer to make present: its blob and DiffID.
struct LayerPlan {
    blob: String,
    media_type: String,
    diff_id: String,
}

impl ImageStore {
    pub(super) fn blobs_dir(&self) -> PathBuf {
        self.dir.join(BLOBS_DIR)
    }

    pub(super) fn layers_dir(&self) -> PathBuf {
        self.dir.join(LAYERS_DIR)
    }

    /// Path of blob `digest` (whether present or not).
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed digest.
    pub fn blob_path(&self, digest: &str) -> NodeResult<PathBuf> {
        Ok(self.blobs_dir().join(digest_hex(digest)?))
    }

    /// Directory of the unpacked layer with DiffID `diff_id` (whether present or not).
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed digest.
    pub fn layer_path(&self, diff_id: &str) -> NodeResult<PathBuf> {
        Ok(self.layers_dir().join(digest_hex(diff_id)?))
    }

    /// Start writing a blob; `limit` is the descriptor's size when known.
    ///
    /// # Errors
    /// `Internal` when the temp file cannot be created.
    pub fn blob_writer(&self, limit: Option<u64>) -> NodeResult<BlobWriter> {
        self.ensure_oci_dirs()?;
        let dir = self.blobs_dir();
        let tmp = dir.join(tmp_name("blob"));
        let file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| NodeError::io(format!("create {}", tmp.display()), e))?;
        Ok(BlobWriter {
            dir,
            tmp,
            file: Some(file),
            hash: Sha256::new(),
            n: 0,
            limit,
        })
    }

    /// Copy `r` into the blob store, verifying it against `expected` (`sha256:<hex>`) when
    /// given; a blob already present is not rewritten (its bytes are still read through and
    /// checked). Returns `(digest, size)`.
    ///
    /// # Errors
    /// `InvalidArgument` on a digest/size mismatch (nothing is kept); `Internal` on I/O.
    pub fn put_blob(
        &self,
        mut r: impl Read,
        expected: Option<&str>,
        size: Option<u64>,
        progress: &dyn Progress,
        id: &str,
    ) -> NodeResult<(String, u64)> {
        if let Some(d) = expected {
            let p = self.blob_path(d)?;
            if p.is_file() {
                progress.finish(id, "already present");
                return Ok((
                    d.to_string(),
                    fs::metadata(&p).map(|m| m.len()).unwrap_or(0),
                ));
            }
        }
        let mut w = self.blob_writer(size)?;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = r
                .read(&mut buf)
                .map_err(|e| NodeError::io(format!("read blob {id}"), e))?;
            if n == 0 {
                break;
            }
            w.write(&buf[..n])?;
            progress.advance(id, n as u64);
        }
        let r = w.commit(expected)?;
        progress.finish(id, "done");
        Ok(r)
    }

    /// Make the layer with DiffID `diff_id` present, unpacking blob `blob` (of layer media
    /// type `media_type`; an empty type means "sniff the bytes") once. A layer directory that
    /// exists is complete (it is renamed into place only after a verified unpack), so a
    /// second image with the same layer skips the work. Returns `(dir, unpacked_now)`.
    ///
    /// # Errors
    /// `InvalidArgument` for an unsupported media type or a bad/hostile archive (see
    /// [`unpack::unpack_layer`]); `Internal` on I/O.
    pub fn ensure_layer(
        &self,
        diff_id: &str,
        blob: &str,
        media_type: &str,
    ) -> NodeResult<(PathBuf, bool)> {
        let dst = self.layer_path(diff_id)?;
        if dst.is_dir() {
            return Ok((dst, false));
        }
        self.ensure_oci_dirs()?;
        let src = self.blob_path(blob)?;
        let mut f =
            File::open(&src).map_err(|e| NodeError::io(format!("open {}", src.display()), e))?;
        let comp = if media_type.is_empty() {
            let mut head = [0u8; 4];
            let n = f
                .read(&mut head)
                .map_err(|e| NodeError::io(format!("read {}", src.display()), e))?;
            f.seek(SeekFrom::Start(0))
                .map_err(|e| NodeError::io(format!("seek {}", src.display()), e))?;
            Compression::sniff(&head[..n])
        } else {
            Compression::from_media_type(media_type)?
        };
        let tmp = self.layers_dir().join(tmp_name(digest_hex(diff_id)?));
        let stats = unpack::unpack_layer(f, comp, Some(diff_id), &tmp)?;
        let done = (|| {
            let d = File::open(&tmp)
                .map_err(|e| NodeError::io(format!("open {}", tmp.display()), e))?;
            nix::unistd::syncfs(&d)
                .map_err(|e| NodeError::io(format!("syncfs {}", tmp.display()), e.into()))?;
            match fs::rename(&tmp, &dst) {
                Ok(()) => super::fsync_dir(&self.layers_dir()).map(|()| true),
                // Another unpack of the same layer finished first; theirs is as good.
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) =>
                {
                    Ok(false)
                }
                Err(e) => Err(NodeError::io(format!("rename to {}", dst.display()), e)),
            }
        })();
        if !matches!(done, Ok(true)) {
            let _ = fs::remove_dir_all(&tmp);
        }
        let now = done?;
        tracing::info!(
            diff_id,
            entries = stats.entries,
            skipped = stats.skipped,
            bytes = stats.tar_bytes,
            "layer unpacked"
        );
        Ok((dst, now))
    }

    /// Shared lock for pulls/imports (gc takes it exclusively), on `<dir>/.lock`.
    pub(super) fn lock(&self, exclusive: bool) -> NodeResult<nix::fcntl::Flock<File>> {
        self.ensure_oci_dirs()?;
        let p = self.dir.join(".lock");
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| NodeError::io(format!("open {}", p.display()), e))?;
        let arg = if exclusive {
            nix::fcntl::FlockArg::LockExclusive
        } else {
            nix::fcntl::FlockArg::LockShared
        };
        nix::fcntl::Flock::lock(f, arg)
            .map_err(|(_, e)| NodeError::io(format!("flock {}", p.display()), e.into()))
    }

    /// Record image `name` from a stored manifest and config: unpack missing layers and
    /// write `image.json` (env, workdir, user from the config).
    fn install_oci(
        &self,
        name: &str,
        config_digest: &str,
        layers: &[LayerPlan],
        mut blobs: Vec<String>,
        source: ImageSource,
        progress: &dyn Progress,
    ) -> NodeResult<super::Image> {
        let cfg_bytes = fs::read(self.blob_path(config_digest)?)
            .map_err(|e| NodeError::io(format!("read config {config_digest}"), e))?;
        let cfg: ImageConfig = parse_json(&cfg_bytes, "image config")?;
        if (!cfg.os.is_empty() && cfg.os != "linux")
            || (!cfg.architecture.is_empty() && cfg.architecture != "amd64")
        {
            return Err(NodeError::InvalidArgument(format!(
                "image is {}/{}; this node runs linux/amd64 only",
                cfg.os, cfg.architecture
            )));
        }
        blobs.push(config_digest.to_string());
        let mut rels = Vec::new();
        let mut size = 0u64;
        for l in layers {
            let short = short(&l.diff_id);
            progress.start(&short, "unpack", None);
            let (dir, now) = self.ensure_layer(&l.diff_id, &l.blob, &l.media_type)?;
            progress.finish(&short, if now { "unpacked" } else { "already unpacked" });
            size += super::tree_size(&dir)?;
            rels.push(format!("{LAYERS_DIR}/{}", digest_hex(&l.diff_id)?));
            blobs.push(l.blob.clone());
        }
        // Overlay lowerdir order: top-most first; the config lists bottom-most first.
        rels.reverse();
        let exec = cfg.config.unwrap_or_default();
        let env = env_pairs(exec.env);
        // The same image again (same config, same layers) keeps its creation time and so
        // its `Image::version`: pulling or importing it once more leaves its checkpoints
        // forkable and its microVM disk in use.
        let unchanged = |old: &super::Image| {
            old.source.config_digest() == Some(config_digest)
                && old.layers.len() == rels.len()
                && old
                    .layers
                    .iter()
                    .zip(&rels)
                    .all(|(l, r)| *l == self.dir.join(r))
        };
        let created_at = match self.get(name) {
            Ok(old) if unchanged(&old) => old.created_at,
            _ => chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        };
        let meta = ImageJson {
            name: name.to_string(),
            env,
            workdir: exec.working_dir.filter(|w| !w.is_empty()),
            user: exec.user.filter(|u| !u.is_empty()),
            created_at,
            size_bytes: size,
            source,
            layers: rels,
            blobs,
        };
        self.install_meta(name, &meta)
    }

    /// Pull `reference` (e.g. `127.0.0.1:5000/sandlot/python:latest`) from its registry and
    /// store it as `name` (default: the normalised reference). A multi-platform index
    /// resolves to its linux/amd64 image. Blobs already in the store are not fetched again,
    /// layers already unpacked are not unpacked again. Plain HTTP is used only for loopback
    /// registries (`localhost`, `127.0.0.0/8`, `[::1]`), HTTPS otherwise; anonymous access,
    /// or HTTP Basic from `$SANDLOT_REGISTRY_USERNAME` / `$SANDLOT_REGISTRY_PASSWORD`
    /// (bearer tokens are fetched by `oci-client` when the registry asks for them).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad reference or name, a digest mismatch or a bad image;
    /// `NotFound` when the registry does not have it (or refuses access); `Unavailable`
    /// when the registry cannot be reached; `Internal` on local I/O failure. Each call is
    /// counted with its outcome and the blob bytes it downloaded ([`super::pull_stats`]).
    pub async fn pull(
        &self,
        reference: &str,
        name: Option<&str>,
        progress: &dyn Progress,
    ) -> NodeResult<super::Image> {
        let mut fetched = 0;
        let r = self
            .pull_whole(reference, name, progress, &mut fetched)
            .await;
        let outcome = super::pull_stats::outcome(&r);
        super::pull_stats::record(
            &self.dir,
            super::pull_stats::PullMode::Eager,
            outcome,
            fetched,
        )
        .await;
        r
    }

    /// [`pull`](Self::pull), adding the bytes of the blobs it downloads to `fetched`.
    async fn pull_whole(
        &self,
        reference: &str,
        name: Option<&str>,
        progress: &dyn Progress,
        fetched: &mut u64,
    ) -> NodeResult<super::Image> {
        let r = super::parse_reference(reference)?;
        let name = match name {
            Some(n) => {
                super::parse_image_name(n)?;
                n.to_string()
            }
            None => r.whole(),
        };
        let _lock = self.lock(false)?;
        let registry = r.resolve_registry().to_string();
        let (client, auth) = registry_client(&r, std::time::Duration::from_secs(10));
        let whole = r.whole();
        let map = |e: oci_client::errors::OciDistributionError| pull_error(&whole, &registry, e);

        let (mut bytes, _) = client
            .pull_manifest_raw(&r, &auth, MANIFEST_MEDIA_TYPES)
            .await
            .map_err(map)?;
        let mut digest = sha256_digest(&bytes);
        if let Some(want) = r.digest() {
            if want != digest {
                return Err(NodeError::InvalidArgument(format!(
                    "manifest of {whole} has digest {digest}, the reference says {want}"
                )));
            }
        }
        let mut m: ManifestOrIndex = parse_json(&bytes, "manifest")?;
        let mut blobs = Vec::new();
        if is_index(&m) {
            self.put_blob(&bytes[..], Some(&digest), None, &NoProgress, "index")?;
            blobs.push(digest.clone());
            let entry = pick_platform(m.manifests.as_deref().unwrap_or_default(), &whole)?.clone();
            digest_hex(&entry.digest)?;
            let child = oci_client::Reference::with_digest(
                r.registry().to_string(),
                r.repository().to_string(),
                entry.digest.clone(),
            );
            bytes = client
                .pull_manifest_raw(&child, &auth, MANIFEST_MEDIA_TYPES)
                .await
                .map_err(map)?
                .0;
            digest = sha256_digest(&bytes);
            if digest != entry.digest {
                return Err(NodeError::InvalidArgument(format!(
                    "manifest {} of {whole} has digest {digest}",
                    entry.digest
                )));
            }
            m = parse_json(&bytes, "manifest")?;
            if is_index(&m) {
                return Err(NodeError::InvalidArgument(format!(
                    "{whole}: nested index; not supported"
                )));
            }
        }
        self.put_blob(&bytes[..], Some(&digest), None, &NoProgress, "manifest")?;
        blobs.push(digest.clone());
        let (config, layers) = manifest_parts(m, &whole)?;
        for d in std::iter::once(&config).chain(layers.iter()) {
            let dg = &d.digest;
            digest_hex(dg)?;
            let id = short(dg);
            if self.blob_path(dg)?.is_file() {
                progress.finish(&id, "already present");
                continue;
            }
            // Blobs are kept (gc frees them with their last image), so a layer blob is
            // fetched even when a layer with its DiffID is already unpacked.
            let size = u64::try_from(d.size).ok().filter(|s| *s > 0);
            progress.start(&id, "download", size);
            let desc = oci_client::manifest::OciDescriptor {
                media_type: d.media_type.clone(),
                digest: dg.clone(),
                size: d.size,
                ..Default::default()
            };
            let mut stream = client.pull_blob_stream(&r, &desc).await.map_err(map)?;
            let mut w = self.blob_writer(size)?;
            while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
                let chunk = chunk.map_err(|e| {
                    NodeError::Unavailable(format!(
                        "pull {whole}: reading blob {dg} from {registry}: {e}"
                    ))
                })?;
                w.write(&chunk)?;
                *fetched += chunk.len() as u64;
                progress.advance(&id, chunk.len() as u64);
            }
            w.commit(Some(dg))?;
            progress.finish(&id, "downloaded");
        }
        let plan = layer_plan(self, &config, &layers)?;
        let store = self.clone();
        let source = ImageSource::Registry {
            reference: whole.clone(),
            manifest: digest.clone(),
            config: config.digest.clone(),
        };
        let cfg_digest = config.digest.clone();
        // Unpacking is blocking file-system work: off the async runtime.
        let pending: Vec<String> = plan
            .iter()
            .filter(|l| self.layer_path(&l.diff_id).is_ok_and(|p| !p.is_dir()))
            .map(|l| short(&l.diff_id))
            .collect();
        for id in &pending {
            progress.start(id, "unpack", None);
        }
        let progress_name = name.clone();
        let img = tokio::task::spawn_blocking(move || {
            store.install_oci(
                &progress_name,
                &cfg_digest,
                &plan,
                blobs,
                source,
                &NoProgress,
            )
        })
        .await
        .map_err(|source| ImageError::UnpackTask {
            reference: whole.clone(),
            source,
        })??;
        for id in &pending {
            progress.finish(id, "unpacked");
        }
        progress.finish(&short(&digest), "installed");
        Ok(img)
    }

    /// Import an image from `path`: an OCI image layout directory (`oci-layout`,
    /// `index.json`, `blobs/`), a tar archive of one (`skopeo copy ... oci-archive:`), or a
    /// `docker save` archive (`manifest.json` + layer tars; newer Docker writes both). The
    /// image is stored as `name`, else as the `org.opencontainers.image.ref.name`
    /// annotation when it is a full reference, else the first `RepoTags` entry of a
    /// `docker save` archive. An index with several images is narrowed to linux/amd64 or,
    /// when `name` is given, to the entry whose ref-name annotation matches it. Every blob is
    /// digest-checked as it is copied into the store.
    ///
    /// # Errors
    /// `NotFound` when `path` is missing; `InvalidArgument` for a malformed layout/archive,
    /// a digest mismatch, no usable name, or an ambiguous index; `Internal` on I/O.
    pub fn import(
        &self,
        path: &Path,
        name: Option<&str>,
        progress: &dyn Progress,
    ) -> NodeResult<super::Image> {
        if let Some(n) = name {
            super::parse_image_name(n)?;
        }
        let src = Source::open(path)?;
        let _lock = self.lock(false)?;
        let shown = path.display().to_string();
        if src.exists("index.json") {
            let idx_bytes = src.read_small("index.json")?;
            let idx: ManifestOrIndex = parse_json(&idx_bytes, "index.json")?;
            let entries = idx.manifests.unwrap_or_default();
            let chosen = choose_entry(&entries, name, &shown)?;
            let ref_name = chosen
                .annotations
                .get("org.opencontainers.image.ref.name")
                .cloned();
            let mut blobs = Vec::new();
            let mut desc = chosen.clone();
            let mut m: ManifestOrIndex;
            loop {
                let b = self.copy_json_blob(&src, &desc.digest)?;
                blobs.push(desc.digest.clone());
                m = parse_json(&b, "manifest")?;
                if !is_index(&m) {
                    break;
                }
                desc = pick_platform(m.manifests.as_deref().unwrap_or_default(), &shown)?.clone();
                if blobs.len() > 4 {
                    return Err(NodeError::InvalidArgument(format!(
                        "{shown}: indexes nested too deep"
                    )));
                }
            }
            let manifest = desc.digest.clone();
            let (config, layers) = manifest_parts(m, &shown)?;
            self.copy_json_blob(&src, &config.digest)?;
            for l in &layers {
                let rel = format!("blobs/sha256/{}", digest_hex(&l.digest)?);
                let (r, size) = src.read(&rel)?;
                let id = short(&l.digest);
                progress.start(&id, "copy", Some(size));
                self.put_blob(
                    r,
                    Some(&l.digest),
                    u64::try_from(l.size).ok().filter(|s| *s > 0),
                    progress,
                    &id,
                )?;
            }
            let name = match name {
                Some(n) => n.to_string(),
                None => ref_name
                    .filter(|r| super::parse_reference(r).is_ok() && (r.contains('/') || r.contains(':')))
                    .map(|r| super::parse_reference(&r).map(|x| x.whole()))
                    .transpose()?
                    .ok_or_else(|| NodeError::InvalidArgument(format!(
                        "{shown} names no full image reference (org.opencontainers.image.ref.name); pass a name"
                    )))?,
            };
            let plan = layer_plan(self, &config, &layers)?;
            let source = ImageSource::Archive {
                path: path.to_path_buf(),
                manifest,
                config: config.digest.clone(),
            };
            return self.install_oci(&name, &config.digest, &plan, blobs, source, progress);
        }
        if src.exists("manifest.json") {
            let mb = src.read_small("manifest.json")?;
            let entries: Vec<DockerSaveEntry> = parse_json(&mb, "manifest.json")?;
            let e = match entries.len() {
                1 => &entries[0],
                0 => {
                    return Err(NodeError::InvalidArgument(format!(
                        "{shown}: manifest.json lists no image"
                    )))
                }
                _ => entries
                    .iter()
                    .find(|e| name.is_some_and(|n| e.repo_tags.iter().flatten().any(|t| t == n)))
                    .ok_or_else(|| {
                        NodeError::InvalidArgument(format!(
                            "{shown} holds {} images; pass the name of one of its RepoTags",
                            entries.len()
                        ))
                    })?,
            };
            let (cr, csize) = src.read(&e.config)?;
            let (config_digest, _) = self.put_blob(
                cr.take(MAX_JSON_BYTES),
                None,
                Some(csize).filter(|_| csize <= MAX_JSON_BYTES),
                &NoProgress,
                "config",
            )?;
            // The config's own name in a docker save archive is its digest (`<hex>.json` or
            // `blobs/sha256/<hex>`); when it is, it must match.
            if let Some(stem) = Path::new(&e.config).file_name().and_then(|s| s.to_str()) {
                let stem = stem.trim_end_matches(".json");
                if stem.len() == 64 && stem != digest_hex(&config_digest)? {
                    return Err(NodeError::InvalidArgument(format!(
                        "{shown}: config {} has digest {config_digest}",
                        e.config
                    )));
                }
            }
            let mut layers = Vec::new();
            for rel in &e.layers {
                let (r, size) = src.read(rel)?;
                let id = rel.chars().take(19).collect::<String>();
                progress.start(&id, "copy", Some(size));
                // No digest to check here: the DiffID check at unpack verifies the content.
                let (d, _) = self.put_blob(r, None, None, progress, &id)?;
                layers.push(Descriptor {
                    media_type: String::new(),
                    digest: d,
                    size: size as i64,
                    platform: None,
                    annotations: BTreeMap::new(),
                });
            }
            let config = Descriptor {
                media_type: String::new(),
                digest: config_digest.clone(),
                size: 0,
                platform: None,
                annotations: BTreeMap::new(),
            };
            let name = match name {
                Some(n) => n.to_string(),
                None => e
                    .repo_tags
                    .iter()
                    .flatten()
                    .next()
                    .map(|t| super::parse_reference(t).map(|r| r.whole()))
                    .transpose()?
                    .ok_or_else(|| {
                        NodeError::InvalidArgument(format!("{shown} has no RepoTags; pass a name"))
                    })?,
            };
            let plan = layer_plan(self, &config, &layers)?;
            let source = ImageSource::Archive {
                path: path.to_path_buf(),
                manifest: String::new(),
                config: config_digest.clone(),
            };
            return self.install_oci(&name, &config_digest, &plan, vec![], source, progress);
        }
        Err(NodeError::InvalidArgument(format!(
            "{shown} is neither an OCI image layout (index.json) nor a docker save archive (manifest.json)"
        )))
    }

    /// Copy a small JSON blob (manifest, index, config) from an import source into the
    /// store (digest-checked) and return its bytes.
    fn copy_json_blob(&self, src: &Source, digest: &str) -> NodeResult<Vec<u8>> {
        let b = src.read_small(&format!("blobs/sha256/{}", digest_hex(digest)?))?;
        self.put_blob(&b[..], Some(digest), None, &NoProgress, "json")?;
        let got = sha256_digest(&b);
        if got != digest {
            return Err(ImageError::DigestMismatch {
                expected: digest.to_string(),
                got,
            }
            .into());
        }
        Ok(b)
    }
}

/// Which index entry an import uses: the only one; else the one whose ref-name annotation
/// matches `name` (in full or as its tag); else the only linux/amd64 one.
fn choose_entry<'a>(
    entries: &'a [Descriptor],
    name: Option<&str>,
    shown: &str,
) -> NodeResult<&'a Descriptor> {
    if entries.len() == 1 {
        return Ok(&entries[0]);
    }
    if entries.is_empty() {
        return Err(NodeError::InvalidArgument(format!(
            "{shown}: index.json lists no manifest"
        )));
    }
    if let Some(n) = name {
        let tag = n.rsplit_once(':').map(|(_, t)| t).unwrap_or(n);
        if let Some(e) = entries.iter().find(|e| {
            e.annotations
                .get("org.opencontainers.image.ref.name")
                .is_some_and(|r| r == n || r == tag)
        }) {
            return Ok(e);
        }
    }
    let amd: Vec<&Descriptor> = entries
        .iter()
        .filter(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .collect();
    if amd.len() == 1 {
        return Ok(amd[0]);
    }
    let names: Vec<&str> = entries
        .iter()
        .filter_map(|e| {
            e.annotations
                .get("org.opencontainers.image.ref.name")
                .map(String::as_str)
        })
        .collect();
    Err(NodeError::InvalidArgument(format!(
        "{shown} holds {} images; pass a name matching one of their ref names ({})",
        entries.len(),
        names.join(", ")
    )))
}

fn manifest_parts(m: ManifestOrIndex, what: &str) -> NodeResult<(Descriptor, Vec<Descriptor>)> {
    let config = m
        .config
        .ok_or_else(|| NodeError::InvalidArgument(format!("manifest of {what} has no config")))?;
    Ok((config, m.layers.unwrap_or_default()))
}

/// Pair each layer blob with its DiffID from the config (which must be in the store).
fn layer_plan(
    store: &ImageStore,
    config: &Descriptor,
    layers: &[Descriptor],
) -> NodeResult<Vec<LayerPlan>> {
    let cfg_bytes = fs::read(store.blob_path(&config.digest)?)
        .map_err(|e| NodeError::io(format!("read config {}", config.digest), e))?;
    let cfg: ImageConfig = parse_json(&cfg_bytes, "image config")?;
    if cfg.rootfs.diff_ids.len() != layers.len() {
        return Err(NodeError::InvalidArgument(format!(
            "image config lists {} layer DiffIDs, the manifest {} layers",
            cfg.rootfs.diff_ids.len(),
            layers.len()
        )));
    }
    layers
        .iter()
        .zip(cfg.rootfs.diff_ids.iter())
        .map(|(l, d)| {
            digest_hex(d)?;
            digest_hex(&l.digest)?;
            if !l.media_type.is_empty() {
                Compression::from_media_type(&l.media_type)?;
            }
            Ok(LayerPlan {
                blob: l.digest.clone(),
                media_type: l.media_type.clone(),
                diff_id: d.clone(),
            })
        })
        .collect()
}

/// An image config's `Env` (`["K=V", …]`, OCI image spec "config") as (K, V) pairs; an
/// entry without `=` is dropped.
pub(crate) fn env_pairs(env: Option<Vec<String>>) -> Vec<(String, String)> {
    env.unwrap_or_default()
        .into_iter()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

/// An OCI distribution client for `r`'s registry: plain HTTP for loopback registries,
/// HTTPS otherwise; `connect` connect timeout, 120 s read timeout; anonymous, or HTTP Basic
/// from `$SANDLOT_REGISTRY_USERNAME` / `$SANDLOT_REGISTRY_PASSWORD` when both are set.
pub(crate) fn registry_client(
    r: &oci_client::Reference,
    connect: std::time::Duration,
) -> (oci_client::Client, oci_client::secrets::RegistryAuth) {
    let registry = r.resolve_registry().to_string();
    let protocol = if is_loopback(&registry) {
        oci_client::client::ClientProtocol::HttpsExcept(vec![registry])
    } else {
        oci_client::client::ClientProtocol::Https
    };
    let client = oci_client::Client::new(oci_client::client::ClientConfig {
        protocol,
        connect_timeout: Some(connect),
        read_timeout: Some(std::time::Duration::from_secs(120)),
        ..Default::default()
    });
    let auth = match (
        std::env::var("SANDLOT_REGISTRY_USERNAME"),
        std::env::var("SANDLOT_REGISTRY_PASSWORD"),
    ) {
        (Ok(u), Ok(p)) => oci_client::secrets::RegistryAuth::Basic(u, p),
        _ => oci_client::secrets::RegistryAuth::Anonymous,
    };
    (client, auth)
}

/// `sha256:0123456789ab` (first 12 hex digits), for progress lines.
pub fn short(digest: &str) -> String {
    digest.chars().take("sha256:".len() + 12).collect()
}

/// Is a registry host (with optional port) on the loopback interface?
pub fn is_loopback(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        registry
            .rsplit_once(':')
            .map(|(h, _)| h)
            .unwrap_or(registry)
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Map an `oci-client` error to a node error: the registry said no → `NotFound`; digest
/// problems → `InvalidArgument`; anything on the way there → `Unavailable`.
fn pull_error(
    reference: &str,
    registry: &str,
    e: oci_client::errors::OciDistributionError,
) -> NodeError {
    use oci_client::errors::OciDistributionError as E;
    let (reference, registry) = (reference.to_string(), registry.to_string());
    match e {
        E::ImageManifestNotFoundError(_)
        | E::RegistryError { .. }
        | E::AuthenticationFailure(_)
        | E::UnauthorizedError { .. } => ImageError::NoSuchImage {
            reference,
            registry,
            source: e,
        },
        E::ServerError { code, .. } if (400..500).contains(&code) => ImageError::NoSuchImage {
            reference,
            registry,
            source: e,
        },
        E::DigestError(_) | E::ManifestParsingError(_) | E::SpecViolationError(_) => {
            ImageError::BadContent {
                reference,
                registry,
                source: e,
            }
        }
        e => ImageError::RegistryUnavailable {
            reference,
            registry,
            source: e,
        },
    }
    .into()
}
