//! Lazy images (issue 23, first slice): layers converted once into a chunked,
//! content-addressed form ([`mod@format`]), pushed to an OCI registry next to the image, and
//! served on demand on the node: chunks are fetched on first read ([`fetch`]) and cached on
//! the node's disk.
pub mod fetch;
pub mod format;
pub mod fs;
pub mod trace;

use super::oci::{
    digest_hex, env_pairs, registry_client, sha256_digest, NoProgress, MAX_JSON_BYTES,
};
use super::{ImageJson, ImageSource, ImageStore};
use crate::node::{NodeError, NodeResult};
use format::{
    LazyIndex, DATA_MEDIA_TYPE, DISK_FILE, DISK_INDEX_MEDIA_TYPE, INDEX_MEDIA_TYPE, VM_DISK_FILE,
    VM_DISK_INDEX_MEDIA_TYPE,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Directory of lazy mounts and their daemons' logs, relative to the store:
/// `lazy/mnt/<index hex>/` (a FUSE mount point), `lazy/<index hex>.log`.
pub const LAZY_DIR: &str = "lazy";
/// Tag suffix of the lazy form of `REPO:TAG`: it is pushed as `REPO:TAG-lazy`.
pub const TAG_SUFFIX: &str = "-lazy";
/// Annotation on a lazy manifest (value: format version) and on each index layer
/// (`org.sandlot.lazy.diff_id`: the DiffID of the layer it was made from).
pub const ANNOTATION: &str = "org.sandlot.lazy";
/// First argument that makes the `sandlot` binary run [`serve_main`] (a FUSE daemon).
pub const DAEMON_ARG: &str = "__lazy-mount";
/// OCI image manifest media type.
const MANIFEST_MT: &str = "application/vnd.oci.image.manifest.v1+json";

/// The reference of the lazy form of `reference`: same repository, tag + [`TAG_SUFFIX`]
/// (`127.0.0.1:5000/x/big:1` → `127.0.0.1:5000/x/big:1-lazy`).
///
/// # Errors
/// `InvalidArgument` for a bad reference or one by digest only.
pub fn lazy_reference(reference: &str) -> NodeResult<String> {
    let r = super::parse_reference(reference)?;
    if r.digest().is_some() && r.tag().is_none() {
        return Err(NodeError::InvalidArgument(format!(
            "{reference}: a lazy form is found by tag; give REPO:TAG"
        )));
    }
    Ok(format!(
        "{}/{}:{}{TAG_SUFFIX}",
        r.resolve_registry(),
        r.repository(),
        r.tag().unwrap_or("latest")
    ))
}

fn reg_err(what: &str, e: oci_client::errors::OciDistributionError) -> NodeError {
    use oci_client::errors::OciDistributionError as E;
    match e {
        E::ImageManifestNotFoundError(_) | E::RegistryError { .. } => {
            NodeError::NotFound(format!("{what}: {e}"))
        }
        E::ServerError { code: 404, .. } => NodeError::NotFound(format!("{what}: {e}")),
        e => NodeError::Unavailable(format!("{what}: {e}")),
    }
}

/// What [`ImageStore::convert_lazy`] pushed.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    /// Reference of the lazy form (`REPO:TAG-lazy`).
    pub reference: String,
    /// Digest of its manifest.
    pub manifest: String,
    /// Sum of the layers' regular file bytes.
    pub files_bytes: u64,
    /// Sum of the data blobs' bytes (after chunk deduplication).
    pub data_bytes: u64,
    /// Bytes of the image's EROFS disk ([`format::DISK_FILE`]); `None` when none was made
    /// (no `mkfs.erofs` on this host).
    pub disk_bytes: Option<u64>,
    /// Bytes of the image's raw ext4 disk for the `vm` backend ([`format::VM_DISK_FILE`]);
    /// `None` when none was made (no `mkfs.ext4` on this host).
    pub vm_disk_bytes: Option<u64>,
}

/// How much of a lazy image is on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalBytes {
    /// Bytes of its distinct chunks in the node's chunk cache.
    pub cached: u64,
    /// Bytes of all its distinct chunks.
    pub total: u64,
    /// Of its EROFS disk (the microVM backend's image disk): bytes of its distinct chunks in
    /// the chunk cache; 0 when it has none.
    pub disk_cached: u64,
    /// Bytes of all the distinct chunks of its EROFS disk; 0 when it has none.
    pub disk_total: u64,
    /// Of its ext4 disk (the `vm` backend's base disk): bytes of its distinct chunks in the
    /// chunk cache; 0 when it has none.
    pub vm_disk_cached: u64,
    /// Bytes of all the distinct chunks of its ext4 disk; 0 when it has none.
    pub vm_disk_total: u64,
}

/// A converted blob: its index's digest, size and contents.
type ConvertedBlob = (String, u64, LazyIndex);

impl ImageStore {
    fn lazy_dir(&self) -> PathBuf {
        self.dir.join(LAZY_DIR)
    }

    /// Mount point of the lazy layer with index blob `index` (whether mounted or not).
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed digest.
    pub fn lazy_mount_point(&self, index: &str) -> NodeResult<PathBuf> {
        Ok(self.lazy_dir().join("mnt").join(digest_hex(index)?))
    }

    /// Read and check index blob `digest` from the blob store.
    ///
    /// # Errors
    /// `Internal` when it cannot be read; `InvalidArgument` when it is not a valid index.
    pub fn lazy_index(&self, digest: &str) -> NodeResult<LazyIndex> {
        let p = self.blob_path(digest)?;
        let b = std::fs::read(&p).map_err(|e| NodeError::io(format!("read {}", p.display()), e))?;
        LazyIndex::parse(&b)
    }

    /// Convert each layer of image `reference` (pulled or imported into this store) into
    /// the lazy format ([`mod@format`]) and push the result to `REPO:TAG-lazy` in the image's
    /// registry: an OCI image manifest whose config is the image's own config blob and
    /// whose layers are, bottom-most first, `(index, data)` pairs of media types
    /// [`INDEX_MEDIA_TYPE`] and [`DATA_MEDIA_TYPE`], annotated [`ANNOTATION`], then the
    /// image's EROFS disk for the microVM backend as one more pair, media types
    /// [`DISK_INDEX_MEDIA_TYPE`] and [`DATA_MEDIA_TYPE`] (see [`mod@format`]; left out, with a
    /// warning, when this host has no `mkfs.erofs`), then its raw ext4 disk for the `vm`
    /// backend, media types [`VM_DISK_INDEX_MEDIA_TYPE`] and [`DATA_MEDIA_TYPE`] (left out,
    /// with a warning, without `mkfs.ext4`). Converting again reuses blobs already made
    /// (content-addressed; the disks are made anew each time).
    ///
    /// A tag, not the referrers API, links the two forms: the Debian registry (distribution
    /// 2.8) has no referrers API, and a tag suffix is how eStargz and Nydus images are
    /// published next to their originals.
    ///
    /// # Errors
    /// `NotFound` when the image is not in the store; `InvalidArgument` when it is a
    /// built-in image (no config blob) or a layer cannot be represented (non-UTF-8 names);
    /// `Unavailable` when the registry fails; `Internal` on local I/O or when `mkfs.erofs`
    /// or `mkfs.ext4` fails.
    pub async fn convert_lazy(&self, reference: &str) -> NodeResult<ConvertReport> {
        let img = self.get(reference)?;
        let config = img
            .source
            .config_digest()
            .map(str::to_string)
            .ok_or_else(|| {
                NodeError::InvalidArgument(format!(
                    "{reference} is a built-in image; only registry or archive images convert"
                ))
            })?;
        let lazy_ref = lazy_reference(reference)?;
        let r = super::parse_reference(&lazy_ref)?;
        // Layers bottom-most first, as a manifest lists them.
        let mut pairs = Vec::new();
        let mut files_bytes = 0;
        let mut data_bytes = 0;
        for dir in img.layers.iter().rev() {
            let diff_id = dir
                .strip_prefix(self.dir.join(super::oci::LAYERS_DIR))
                .ok()
                .map(|h| format!("sha256:{}", h.display()));
            let (idx_digest, idx_size, idx) = {
                let this = self.clone();
                let dir2 = dir.clone();
                tokio::task::spawn_blocking(move || this.convert_layer(&dir2, diff_id))
                    .await
                    .map_err(|e| NodeError::Unavailable(format!("convert task failed: {e}")))??
            };
            files_bytes += idx.files_bytes;
            data_bytes += idx.data_size;
            pairs.push((idx_digest, idx_size, idx));
        }
        let disk = self
            .disk_if_tool(
                &img.layers,
                "mkfs.erofs",
                reference,
                "EROFS disk (microVMs of it convert eagerly)",
                Self::convert_disk,
            )
            .await?;
        let vm_disk = self
            .disk_if_tool(
                &img.layers,
                "mkfs.ext4",
                reference,
                "ext4 disk (vm sandboxes of it build their disk eagerly)",
                Self::convert_vm_disk,
            )
            .await?;
        let (client, auth) = registry_client(&r, Duration::from_secs(10));
        client
            .store_auth_if_needed(r.resolve_registry(), &auth)
            .await;
        let lazy_ref_s = lazy_ref.as_str();
        let push = |digest: String| {
            let client = &client;
            let r = &r;
            async move {
                if client.blob_exists(r, &digest).await.unwrap_or(false) {
                    return Ok(());
                }
                let p = self.blob_path(&digest)?;
                let data = tokio::fs::read(&p)
                    .await
                    .map_err(|e| NodeError::io(format!("read {}", p.display()), e))?;
                client
                    .push_blob(r, data, &digest)
                    .await
                    .map(|_| ())
                    .map_err(|e| reg_err(&format!("push blob {digest} to {lazy_ref_s}"), e))
            }
        };
        let mut layers = Vec::new();
        for (idx_digest, idx_size, idx) in &pairs {
            push(idx_digest.clone()).await?;
            push(idx.data_digest.clone()).await?;
            let mut ann = serde_json::Map::new();
            ann.insert(ANNOTATION.into(), "1".into());
            if let Some(d) = &idx.diff_id {
                ann.insert(format!("{ANNOTATION}.diff_id"), d.clone().into());
            }
            layers.push(serde_json::json!({
                "mediaType": INDEX_MEDIA_TYPE, "digest": idx_digest, "size": idx_size,
                "annotations": ann,
            }));
            layers.push(serde_json::json!({
                "mediaType": DATA_MEDIA_TYPE, "digest": idx.data_digest, "size": idx.data_size,
            }));
        }
        let disks = [
            (DISK_INDEX_MEDIA_TYPE, &disk),
            (VM_DISK_INDEX_MEDIA_TYPE, &vm_disk),
        ];
        for (media_type, d) in disks {
            let Some((idx_digest, idx_size, idx)) = d else {
                continue;
            };
            push(idx_digest.clone()).await?;
            push(idx.data_digest.clone()).await?;
            layers.push(serde_json::json!({
                "mediaType": media_type, "digest": idx_digest, "size": idx_size,
                "annotations": { ANNOTATION: "1" },
            }));
            layers.push(serde_json::json!({
                "mediaType": DATA_MEDIA_TYPE, "digest": idx.data_digest, "size": idx.data_size,
            }));
        }
        push(config.clone()).await?;
        let config_size = std::fs::metadata(self.blob_path(&config)?)
            .map(|m| m.len())
            .unwrap_or(0);
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MT,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config, "size": config_size,
            },
            "layers": layers,
            "annotations": { ANNOTATION: "1", "org.opencontainers.image.ref.name": reference },
        });
        let body = serde_json::to_vec(&manifest).expect("manifest serializes");
        let digest = sha256_digest(&body);
        client
            .push_manifest_raw(&r, body, hyper::http::HeaderValue::from_static(MANIFEST_MT))
            .await
            .map_err(|e| reg_err(&format!("push manifest {lazy_ref}"), e))?;
        Ok(ConvertReport {
            reference: lazy_ref,
            manifest: digest,
            files_bytes,
            data_bytes,
            disk_bytes: disk.map(|(_, _, idx)| idx.files_bytes),
            vm_disk_bytes: vm_disk.map(|(_, _, idx)| idx.files_bytes),
        })
    }

    /// `make(layers)` on a blocking thread when this host has `tool`; `None` with a warning
    /// (naming `reference` and `what` the lazy form then lacks) when it has not.
    ///
    /// # Errors
    /// Those of `make`; `Unavailable` when its thread fails.
    async fn disk_if_tool(
        &self,
        layers: &[PathBuf],
        tool: &str,
        reference: &str,
        what: &str,
        make: fn(&Self, &[PathBuf]) -> NodeResult<ConvertedBlob>,
    ) -> NodeResult<Option<ConvertedBlob>> {
        if crate::sys::find_binary(tool).is_none() {
            tracing::warn!(
                reference,
                "no {tool} on this host: the lazy form has no {what}"
            );
            return Ok(None);
        }
        let (this, layers) = (self.clone(), layers.to_vec());
        tokio::task::spawn_blocking(move || make(&this, &layers))
            .await
            .map_err(|e| NodeError::Unavailable(format!("convert task failed: {e}")))?
            .map(Some)
    }

    /// The image's EROFS disk (`mkfs.erofs` of the merged `layers`, top-most first, as the
    /// microVM backend makes it) converted like a layer: a one-file tree [`DISK_FILE`]
    /// (mode 0444) in a root of mode 0755, made in a temporary directory under the store's
    /// `lazy/` and removed after. Returns the index's digest, size and contents.
    fn convert_disk(&self, layers: &[PathBuf]) -> NodeResult<(String, u64, LazyIndex)> {
        self.convert_disk_file(DISK_FILE, |out| super::disks::make_erofs(layers, out))
    }

    /// The image's raw ext4 disk (`vm::make_ext4` of the merged `layers`, top-most first,
    /// as the `vm` backend makes its eager disks, without the agent) converted like
    /// [`convert_disk`](Self::convert_disk): a one-file tree [`VM_DISK_FILE`] (mode 0444).
    fn convert_vm_disk(&self, layers: &[PathBuf]) -> NodeResult<(String, u64, LazyIndex)> {
        self.convert_disk_file(VM_DISK_FILE, |out| {
            super::disks::make_ext4(layers, out)?;
            super::set_mode(out, 0o444)
        })
    }

    /// A one-file tree `file` made by `make(path)` in a temporary directory (mode 0755)
    /// under the store's `lazy/`, converted like a layer and removed after.
    fn convert_disk_file(
        &self,
        file: &str,
        make: impl FnOnce(&Path) -> NodeResult<()>,
    ) -> NodeResult<(String, u64, LazyIndex)> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self
            .lazy_dir()
            .join(format!("disk-{}-{n}.tmp", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)
            .map_err(|e| NodeError::io(format!("create {}", tmp.display()), e))?;
        super::set_mode(&self.lazy_dir(), 0o700)?;
        let res = super::set_mode(&tmp, 0o755)
            .and_then(|_| make(&tmp.join(file)))
            .and_then(|_| self.convert_layer(&tmp, None));
        let _ = std::fs::remove_dir_all(&tmp);
        res
    }

    /// Convert one unpacked layer directory: data blob and index blob into the blob store.
    /// Returns the index's digest, size and contents.
    fn convert_layer(
        &self,
        dir: &Path,
        diff_id: Option<String>,
    ) -> NodeResult<(String, u64, LazyIndex)> {
        struct W(super::oci::BlobWriter);
        impl std::io::Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0
                    .write(b)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut w = std::io::BufWriter::with_capacity(1 << 20, W(self.blob_writer(None)?));
        let mut idx = format::convert_dir(dir, &mut w)?;
        let W(bw) = w
            .into_inner()
            .map_err(|e| NodeError::io("flush lazy data blob", e.into_error()))?;
        bw.commit(Some(&idx.data_digest))?;
        idx.diff_id = diff_id;
        let json = serde_json::to_vec(&idx).expect("index serializes");
        let (digest, size) = self.put_blob(
            &json[..],
            None,
            Some(json.len() as u64),
            &NoProgress,
            "index",
        )?;
        Ok((digest, size, idx))
    }

    /// Pull the lazy form of `reference` (`REPO:TAG-lazy`, see [`convert_lazy`]) and store it
    /// as `name` (default: the normalised `reference`): only the manifest, config and index
    /// blobs are fetched; file data comes chunk by chunk when read. The image's layers are
    /// the lazy mount points, mounted on [`resolve`](Self::resolve) (or [`mount_lazy`]).
    ///
    /// [`convert_lazy`]: Self::convert_lazy
    /// [`mount_lazy`]: Self::mount_lazy
    ///
    /// # Errors
    /// `NotFound` when the registry has no lazy form; `InvalidArgument` for a bad manifest
    /// or index; `Unavailable` when the registry fails; `Internal` on local I/O. Each call
    /// is counted with its outcome and the blob bytes it downloaded ([`super::pull_stats`]).
    pub async fn pull_lazy(&self, reference: &str, name: Option<&str>) -> NodeResult<super::Image> {
        let mut fetched = 0;
        let r = self.pull_lazy_form(reference, name, &mut fetched).await;
        let outcome = super::pull_stats::outcome(&r);
        super::pull_stats::record(
            &self.dir,
            super::pull_stats::PullMode::Lazy,
            outcome,
            fetched,
        )
        .await;
        r
    }

    /// [`pull_lazy`](Self::pull_lazy), adding the bytes of the blobs it downloads to
    /// `fetched`.
    async fn pull_lazy_form(
        &self,
        reference: &str,
        name: Option<&str>,
        fetched: &mut u64,
    ) -> NodeResult<super::Image> {
        let whole = super::parse_reference(reference)?.whole();
        let name = match name {
            Some(n) => {
                super::parse_image_name(n)?;
                n.to_string()
            }
            None => whole.clone(),
        };
        let lazy_ref = lazy_reference(reference)?;
        let r = super::parse_reference(&lazy_ref)?;
        let (client, auth) = registry_client(&r, Duration::from_secs(10));
        let (bytes, _) = client
            .pull_manifest_raw(&r, &auth, &[MANIFEST_MT])
            .await
            .map_err(|e| reg_err(&format!("pull {lazy_ref}"), e))?;
        if bytes.len() as u64 > MAX_JSON_BYTES {
            return Err(NodeError::InvalidArgument(format!(
                "{lazy_ref}: manifest too large"
            )));
        }
        let manifest_digest = sha256_digest(&bytes);
        let m: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| NodeError::InvalidArgument(format!("{lazy_ref}: bad manifest: {e}")))?;
        if m["annotations"][ANNOTATION].as_str() != Some("1") {
            return Err(NodeError::InvalidArgument(format!(
                "{lazy_ref} is not a Sandlot lazy image (no {ANNOTATION} annotation)"
            )));
        }
        let config = m["config"]["digest"].as_str().unwrap_or("").to_string();
        let mut indexes = Vec::new();
        let (mut disk, mut vm_disk) = (None, None);
        for l in m["layers"].as_array().into_iter().flatten() {
            let digest = l["digest"].as_str().unwrap_or("").to_string();
            match l["mediaType"].as_str() {
                Some(INDEX_MEDIA_TYPE) => indexes.push(digest),
                Some(DISK_INDEX_MEDIA_TYPE) => disk = Some(digest),
                Some(VM_DISK_INDEX_MEDIA_TYPE) => vm_disk = Some(digest),
                _ => {}
            }
        }
        let _lock = self.lock(false)?;
        self.put_blob(
            &bytes[..],
            Some(&manifest_digest),
            None,
            &NoProgress,
            "manifest",
        )?;
        let mut size = 0;
        let mut rels = Vec::new();
        for d in indexes
            .iter()
            .chain(std::iter::once(&config))
            .chain(disk.iter())
            .chain(vm_disk.iter())
        {
            digest_hex(d)?;
            if !self.blob_path(d)?.is_file() {
                let mut buf = Vec::new();
                let desc = oci_client::manifest::OciDescriptor {
                    digest: d.clone(),
                    ..Default::default()
                };
                client
                    .pull_blob(&r, &desc, &mut buf)
                    .await
                    .map_err(|e| reg_err(&format!("pull blob {d} of {lazy_ref}"), e))?;
                *fetched += buf.len() as u64;
                self.put_blob(&buf[..], Some(d), None, &NoProgress, d)?;
            }
        }
        for d in &indexes {
            let idx = self.lazy_index(d)?;
            size += idx.files_bytes;
            rels.push(format!("{LAZY_DIR}/mnt/{}", digest_hex(d)?));
        }
        for (d, file, what) in [
            (&disk, DISK_FILE, "EROFS"),
            (&vm_disk, VM_DISK_FILE, "ext4"),
        ] {
            let Some(d) = d else { continue };
            let idx = self.lazy_index(d)?;
            if idx.entries.len() != 2 || idx.entries[1].path != file {
                return Err(NodeError::InvalidArgument(format!(
                    "{lazy_ref}: its {what} disk index {d} is not the one file {file}"
                )));
            }
        }
        rels.reverse();
        let cfg: super::oci::ImageConfig = serde_json::from_slice(
            &std::fs::read(self.blob_path(&config)?)
                .map_err(|e| NodeError::io(format!("read config {config}"), e))?,
        )
        .map_err(|e| NodeError::InvalidArgument(format!("{lazy_ref}: bad config: {e}")))?;
        let exec = cfg.config.unwrap_or_default();
        let mut blobs = indexes.clone();
        blobs.extend(disk.clone());
        blobs.extend(vm_disk.clone());
        blobs.push(config.clone());
        blobs.push(manifest_digest.clone());
        let meta = ImageJson {
            name: name.clone(),
            env: env_pairs(exec.env),
            workdir: exec.working_dir.filter(|w| !w.is_empty()),
            user: exec.user.filter(|u| !u.is_empty()),
            created_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            size_bytes: size,
            source: ImageSource::Lazy {
                reference: whole,
                lazy_reference: lazy_ref,
                manifest: manifest_digest,
                config,
                indexes,
                disk,
                vm_disk,
            },
            layers: rels,
            blobs,
        };
        self.install_meta(&name, &meta)
    }

    /// Mount every lazy layer of `img` not mounted yet (one FUSE daemon per layer, shared by
    /// every image and sandbox using it; the layers' daemons start at the same time). A
    /// no-op for other images.
    ///
    /// # Errors
    /// `Unavailable` when a daemon does not mount within 10 s (its log is quoted; the first
    /// failing layer's error is returned, the other layers stay mounted for the next try).
    pub fn mount_lazy(&self, img: &super::Image) -> NodeResult<()> {
        let ImageSource::Lazy {
            lazy_reference,
            indexes,
            ..
        } = &img.source
        else {
            return Ok(());
        };
        std::thread::scope(|s| {
            let started: Vec<_> = indexes
                .iter()
                .map(|d| {
                    s.spawn(move || {
                        self.ensure_mounted(d, lazy_reference, &self.lazy_mount_point(d)?)
                    })
                })
                .collect();
            started
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(NodeError::Unavailable("lazy mount thread panicked".into()))
                    })
                })
                .collect::<NodeResult<Vec<_>>>()
        })?;
        Ok(())
    }

    /// Mount the EROFS disk of lazy image `img` (see [`mod@format`]) at `dir/lazy-<index
    /// hex>` unless it is mounted there, and return the disk file's path
    /// (`dir/lazy-<hex>/image.erofs`, mode 0444 in a root of mode 0755, readable through the
    /// mount by every user that can reach `dir`); `None` when `img` is not lazy or its lazy
    /// form has no disk. One FUSE daemon per mount point, shared by every VM of the image;
    /// it fetches the chunks under each read, as for the layers.
    ///
    /// # Errors
    /// `Unavailable` when the daemon does not mount within 10 s; `Internal` on local I/O.
    pub fn mount_lazy_disk(&self, img: &super::Image, dir: &Path) -> NodeResult<Option<PathBuf>> {
        let ImageSource::Lazy {
            lazy_reference,
            disk: Some(d),
            ..
        } = &img.source
        else {
            return Ok(None);
        };
        let mp = dir.join(format!("lazy-{}", digest_hex(d)?));
        self.ensure_mounted(d, lazy_reference, &mp)?;
        Ok(Some(mp.join(DISK_FILE)))
    }

    /// As [`mount_lazy_disk`](Self::mount_lazy_disk) for the raw ext4 disk of lazy image
    /// `img` (the `vm` backend's base disk): mounted at `dir/lazy-<index hex>`, returns
    /// `dir/lazy-<hex>/image.ext4`; `None` when `img` is not lazy or has no ext4 disk.
    ///
    /// # Errors
    /// `Unavailable` when the daemon does not mount within 10 s; `Internal` on local I/O.
    pub fn mount_lazy_vm_disk(
        &self,
        img: &super::Image,
        dir: &Path,
    ) -> NodeResult<Option<PathBuf>> {
        let ImageSource::Lazy {
            lazy_reference,
            vm_disk: Some(d),
            ..
        } = &img.source
        else {
            return Ok(None);
        };
        let mp = dir.join(format!("lazy-{}", digest_hex(d)?));
        self.ensure_mounted(d, lazy_reference, &mp)?;
        Ok(Some(mp.join(VM_DISK_FILE)))
    }

    /// Where [`mount_lazy_vm_disk`](Self::mount_lazy_vm_disk) puts the ext4 disk of `img`
    /// under `dir` (mounted or not); `None` when it has none.
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed digest.
    pub fn lazy_vm_disk_path(&self, img: &super::Image, dir: &Path) -> NodeResult<Option<PathBuf>> {
        match &img.source {
            ImageSource::Lazy {
                vm_disk: Some(d), ..
            } => Ok(Some(
                dir.join(format!("lazy-{}", digest_hex(d)?))
                    .join(VM_DISK_FILE),
            )),
            _ => Ok(None),
        }
    }

    /// Where [`mount_lazy_disk`](Self::mount_lazy_disk) puts the EROFS disk of `img` under
    /// `dir` (mounted or not); `None` when it has none.
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed digest.
    pub fn lazy_disk_path(&self, img: &super::Image, dir: &Path) -> NodeResult<Option<PathBuf>> {
        match &img.source {
            ImageSource::Lazy { disk: Some(d), .. } => Ok(Some(
                dir.join(format!("lazy-{}", digest_hex(d)?)).join(DISK_FILE),
            )),
            _ => Ok(None),
        }
    }

    /// How much of lazy image `img` is in the chunk cache; `None` for other images.
    pub fn lazy_local_bytes(&self, img: &super::Image) -> Option<LocalBytes> {
        let ImageSource::Lazy {
            indexes,
            disk,
            vm_disk,
            ..
        } = &img.source
        else {
            return None;
        };
        let count = |ds: &mut dyn Iterator<Item = &String>| -> Option<(u64, u64)> {
            let mut all = Vec::new();
            for d in ds {
                let idx = self.lazy_index(d).ok()?;
                all.extend(idx.entries.into_iter().flat_map(|e| e.chunks));
            }
            let mut seen = std::collections::HashSet::new();
            let total = all
                .iter()
                .filter(|c| seen.insert(c.digest.clone()))
                .map(|c| c.len)
                .sum();
            Some((fetch::cached_bytes(&self.dir, all.iter()), total))
        };
        let (cached, total) = count(&mut indexes.iter())?;
        let (disk_cached, disk_total) = count(&mut disk.iter())?;
        let (vm_disk_cached, vm_disk_total) = count(&mut vm_disk.iter())?;
        Some(LocalBytes {
            cached,
            total,
            disk_cached,
            disk_total,
            vm_disk_cached,
            vm_disk_total,
        })
    }

    /// Mount lazy index `index` (chunks from `reference`'s repository) at `mp` unless a
    /// live mount is there.
    fn ensure_mounted(&self, index: &str, reference: &str, mp: &Path) -> NodeResult<PathBuf> {
        let mp = mp.to_path_buf();
        // One mounter at a time per layer (creates of one image run at once, in this
        // process and others): the others wait, then find the mount live.
        let lock_path = mp.with_extension("lock");
        if let Some(d) = lock_path.parent() {
            std::fs::create_dir_all(d)
                .map_err(|e| NodeError::io(format!("create {}", d.display()), e))?;
        }
        let lock_file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| NodeError::io(format!("open {}", lock_path.display()), e))?;
        let _held = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| NodeError::io(format!("flock {}", lock_path.display()), e.into()))?;
        match fuse_mount_state(&mp) {
            MountState::Live => return Ok(mp),
            MountState::Dead => {
                tracing::warn!(mount = %mp.display(), "lazy mount's daemon is gone; remounting");
                let _ = nix::mount::umount2(&mp, nix::mount::MntFlags::MNT_DETACH);
            }
            MountState::None => {}
        }
        std::fs::create_dir_all(&mp)
            .map_err(|e| NodeError::io(format!("create {}", mp.display()), e))?;
        // SECURITY: like layers/, only root may walk to the mounts: they show image files
        // with the image's owners and setuid bits (mounted nosuid all the same).
        super::set_mode(&self.lazy_dir(), 0o700)?;
        let log = self.lazy_dir().join(format!("{}.log", digest_hex(index)?));
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| NodeError::io(format!("open {}", log.display()), e))?;
        let exe = std::env::var_os("SANDLOT_LAZY_EXE")
            .map(PathBuf::from)
            .or_else(|| std::env::current_exe().ok())
            .ok_or_else(|| NodeError::Unavailable("cannot find the sandlot binary".into()))?;
        let mut cmd = std::process::Command::new(&exe);
        cmd.arg(DAEMON_ARG)
            .arg(&self.dir)
            .arg(index)
            .arg(reference)
            .arg(&mp)
            .stdin(std::process::Stdio::null())
            .stdout(logf.try_clone().map_err(|e| NodeError::io("dup log", e))?)
            .stderr(logf);
        use std::os::unix::process::CommandExt;
        // SAFETY: setsid is async-signal-safe; the daemon leaves the node's session and
        // process group, so it outlives a kill -9 (or a Ctrl-C) of the node.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| NodeError::io(format!("start {}", exe.display()), e))?;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if fuse_mount_state(&mp) == MountState::Live {
                // Reap it when it ends, so no zombie stays behind.
                std::thread::spawn(move || child.wait());
                tracing::info!(mount = %mp.display(), index, "lazy layer mounted");
                return Ok(mp);
            }
            if let Ok(Some(st)) = child.try_wait() {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: String = tail.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                return Err(NodeError::Unavailable(format!(
                    "lazy mount of {index} failed ({st}): {tail}"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        Err(NodeError::Unavailable(format!(
            "lazy mount of {index} did not come up within 10 s (log {})",
            log.display()
        )))
    }
}

#[derive(Debug, PartialEq, Eq)]
enum MountState {
    None,
    Live,
    Dead,
}

/// Is a FUSE file system mounted at `mp`, and does its daemon answer?
fn fuse_mount_state(mp: &Path) -> MountState {
    let want = mp.to_string_lossy().to_string();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // Fields (proc(5)): id parent major:minor root MOUNTPOINT options ... - FSTYPE source ...
    let found = info.lines().any(|line| {
        line.split(' ').nth(4) == Some(want.as_str())
            && line
                .split_once(" - ")
                .is_some_and(|(_, rest)| rest.starts_with("fuse"))
    });
    if !found {
        return MountState::None;
    }
    // statfs, not stat: FUSE answers a stat from its attribute cache (the daemon's TTL is
    // an hour) without asking the daemon, while every statfs is a request, which fails
    // with ENOTCONN once the daemon is gone.
    match nix::sys::statfs::statfs(mp) {
        Err(nix::errno::Errno::ENOTCONN) => MountState::Dead,
        _ => MountState::Live,
    }
}

/// Kernel read-ahead of a lazy mount, KiB, default 1024 (one chunk;
/// `$SANDLOT_LAZY_READ_AHEAD_KIB`, 0 leaves the kernel's default, 128 KiB): FUSE's INIT
/// can only lower it, so the daemon writes it into the mount's
/// `/sys/class/bdi/MAJOR:MINOR/read_ahead_kb` once the mount answers.
pub const READ_AHEAD_KIB_ENV: &str = "SANDLOT_LAZY_READ_AHEAD_KIB";

/// Wait (up to 10 s) until `mp` is a mount of its own that answers, then set its
/// read-ahead (see [`READ_AHEAD_KIB_ENV`]). Failures only log: reads work without it.
fn raise_read_ahead(mp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let kib: u64 = std::env::var(READ_AHEAD_KIB_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    if kib == 0 {
        return;
    }
    let parent = mp.parent().and_then(|p| std::fs::metadata(p).ok());
    for _ in 0..200 {
        // A stat of the mount root waits for FUSE's INIT, after which the value sticks.
        match (std::fs::metadata(mp), &parent) {
            (Ok(m), Some(pm)) if m.dev() != pm.dev() => {
                let dev = m.dev();
                let p = format!(
                    "/sys/class/bdi/{}:{}/read_ahead_kb",
                    libc::major(dev),
                    libc::minor(dev)
                );
                if let Err(e) = std::fs::write(&p, format!("{kib}\n")) {
                    tracing::warn!(path = p, error = %e, "cannot raise the lazy mount's read-ahead");
                }
                return;
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    tracing::warn!(mount = %mp.display(), "lazy mount did not answer: read-ahead left as is");
}

/// Body of the FUSE daemon (`sandlot __lazy-mount STORE INDEX REFERENCE MOUNTPOINT`):
/// serve lazy layer `INDEX` of store `STORE` at `MOUNTPOINT`, fetching misses from the
/// registry of `REFERENCE`. Returns when the file system is unmounted.
///
/// # Errors
/// `InvalidArgument` for bad arguments or index; `Internal` when mounting fails.
pub fn serve_main(args: &[std::ffi::OsString]) -> NodeResult<()> {
    let [store, index, reference, mp] = args else {
        return Err(NodeError::InvalidArgument(format!(
            "usage: sandlot {DAEMON_ARG} STORE INDEX REFERENCE MOUNTPOINT"
        )));
    };
    let index = index.to_string_lossy().to_string();
    let reference = reference.to_string_lossy().to_string();
    let store = ImageStore::open(PathBuf::from(store))?;
    let idx = store.lazy_index(&index)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| NodeError::io("start runtime", e))?;
    let remote = fetch::Remote::new(&reference)?;
    let chunks = std::sync::Arc::new(fetch::ChunkStore::new(
        store.dir(),
        Some(remote),
        fetch::FetchConfig::default(),
    )?);
    // Counters for /metrics, continued across restarts of this layer's daemon.
    let _stats = chunks.persist_stats(
        store
            .dir()
            .join(fetch::STATS_DIR)
            .join(format!("{}.json", digest_hex(&index)?)),
        rt.handle(),
    );
    // A prefetch trace of this layer: fetched ahead now; none yet: this mount records one.
    let mut recorder = None;
    if let Some(window) = trace::window() {
        let path = trace::path(store.dir(), digest_hex(&index)?);
        let ahead = trace::load(&path, &idx);
        if ahead.is_empty() {
            recorder = trace::Recorder::new(path, window);
        } else {
            let (store, blob) = (chunks.clone(), idx.data_digest.clone());
            rt.spawn(async move {
                let n = trace::prefetch(store, blob, ahead).await;
                tracing::info!(chunks = n, "prefetch trace fetched ahead");
            });
        }
    }
    let lazy = fs::LazyFs::new(idx, chunks, rt.handle().clone())?.recording(recorder);
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        fuser::MountOption::FSName(format!("sandlot-lazy-{}", super::oci::short(&index))),
        fuser::MountOption::RO,
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoDev,
        fuser::MountOption::DefaultPermissions,
    ];
    cfg.acl = fuser::SessionACL::All;
    cfg.n_threads = Some(4);
    tracing::info!(index, mount = %Path::new(mp).display(), "serving lazy layer");
    let mp2 = PathBuf::from(mp);
    std::thread::spawn(move || raise_read_ahead(&mp2));
    fuser::mount(lazy, mp, &cfg).map_err(|e| NodeError::io(format!("fuse mount {:?}", mp), e))
}
