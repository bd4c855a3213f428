//! The chunk fetcher: tiers node disk cache → OCI registry.
//!
//! - **Disk cache** `<images dir>/chunks/sha256/<hex>`: one file per chunk, named by the
//!   SHA-256 of its bytes, written to a temp file and renamed into place, so it survives
//!   node restarts and is never half-written. Every chunk read from it is hashed before it
//!   is served; a mismatch (a corrupted file) deletes it, counts in
//!   [`Stats::corrupt`], and the chunk is fetched again.
//! - **Registry**: a byte range of the layer's data blob (HTTP `Range` on the blob GET of the
//!   OCI distribution API, through `oci-client`'s `pull_blob_stream_partial`, so the same
//!   auth as a pull), verified by digest before it is stored or served.
//!
//! Concurrent readers of one chunk cause one fetch (a per-chunk async mutex: the others wait
//! and then find it in the cache). A fetch has a per-attempt timeout and a bounded number of
//! attempts ([`FetchConfig`]); when all fail the caller gets `Unavailable` (the FUSE layer
//! answers `EIO`), never wrong bytes and never an unbounded wait.
use super::format::{chunk_digest, ChunkRef};
use crate::images::oci::{digest_hex, registry_client};
use crate::node::{NodeError, NodeResult};
use futures::StreamExt as _;
use std::collections::HashMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Directory of cached chunks, relative to the image store.
pub const CHUNKS_DIR: &str = "chunks/sha256";

/// Timeouts and retries of registry fetches.
#[derive(Debug, Clone)]
pub struct FetchConfig {
    /// Limit of one attempt (request + body), default 10 s
    /// (`$SANDLOT_LAZY_FETCH_TIMEOUT_MS`).
    pub timeout: Duration,
    /// Attempts per chunk before giving up, default 3 (`$SANDLOT_LAZY_FETCH_ATTEMPTS`).
    pub attempts: u32,
    /// Pause between attempts, default 200 ms.
    pub backoff: Duration,
}

impl Default for FetchConfig {
    fn default() -> Self {
        let env = |k: &str, d: u64| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        FetchConfig {
            timeout: Duration::from_millis(env("SANDLOT_LAZY_FETCH_TIMEOUT_MS", 10_000)),
            attempts: env("SANDLOT_LAZY_FETCH_ATTEMPTS", 3).clamp(1, 10) as u32,
            backoff: Duration::from_millis(200),
        }
    }
}

/// Counters of one process's chunk traffic (all monotonic).
#[derive(Debug, Default)]
pub struct Stats {
    /// Bytes fetched from the registry tier (`sandlot_image_bytes_fetched_total{tier="registry"}`).
    pub registry_bytes: AtomicU64,
    /// Bytes served from the disk cache (`sandlot_image_bytes_fetched_total{tier="disk"}`).
    pub disk_bytes: AtomicU64,
    /// Chunk reads answered by the disk cache.
    pub hits: AtomicU64,
    /// Chunk reads that had to fetch from the registry.
    pub misses: AtomicU64,
    /// Cached chunks that failed their digest check (deleted and refetched).
    pub corrupt: AtomicU64,
    /// Registry fetches that failed all attempts.
    pub failures: AtomicU64,
    /// Sum of successful registry fetch latencies, microseconds.
    pub fetch_us_sum: AtomicU64,
    /// Successful registry fetches.
    pub fetches: AtomicU64,
}

impl Stats {
    /// Prometheus text exposition (format 0.0.4) of these counters.
    pub fn prometheus(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "# TYPE sandlot_image_bytes_fetched_total counter\n\
             sandlot_image_bytes_fetched_total{{tier=\"registry\"}} {}\n\
             sandlot_image_bytes_fetched_total{{tier=\"disk\"}} {}\n\
             # TYPE sandlot_image_chunk_cache_hits_total counter\n\
             sandlot_image_chunk_cache_hits_total {}\n\
             # TYPE sandlot_image_chunk_cache_misses_total counter\n\
             sandlot_image_chunk_cache_misses_total {}\n\
             # TYPE sandlot_image_chunk_corrupt_total counter\n\
             sandlot_image_chunk_corrupt_total {}\n\
             # TYPE sandlot_image_chunk_fetch_failures_total counter\n\
             sandlot_image_chunk_fetch_failures_total {}\n\
             # TYPE sandlot_image_chunk_fetch_seconds summary\n\
             sandlot_image_chunk_fetch_seconds_sum {}\n\
             sandlot_image_chunk_fetch_seconds_count {}\n",
            g(&self.registry_bytes),
            g(&self.disk_bytes),
            g(&self.hits),
            g(&self.misses),
            g(&self.corrupt),
            g(&self.failures),
            g(&self.fetch_us_sum) as f64 / 1e6,
            g(&self.fetches),
        )
    }
}

/// A registry repository to fetch data-blob ranges from.
pub struct Remote {
    client: oci_client::Client,
    reference: oci_client::Reference,
    auth: oci_client::secrets::RegistryAuth,
}

impl Remote {
    /// For image `reference` (e.g. `127.0.0.1:5000/sandlot/big:lazy`): plain HTTP for
    /// loopback registries, HTTPS otherwise; anonymous or HTTP Basic from
    /// `$SANDLOT_REGISTRY_USERNAME` / `$SANDLOT_REGISTRY_PASSWORD`, as pulls do.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad reference.
    pub fn new(reference: &str) -> NodeResult<Remote> {
        let reference = crate::images::parse_reference(reference)?;
        let (client, auth) = registry_client(&reference, Duration::from_secs(5));
        Ok(Remote {
            client,
            reference,
            auth,
        })
    }

    /// Bytes `[offset, offset + len)` of blob `blob`. A registry that ignores `Range` and
    /// sends the whole blob is read up to the range's end.
    async fn range(&self, blob: &str, offset: u64, len: u64) -> Result<Vec<u8>, String> {
        use oci_client::client::BlobResponse;
        self.client
            .store_auth_if_needed(self.reference.resolve_registry(), &self.auth)
            .await;
        let desc = oci_client::manifest::OciDescriptor {
            digest: blob.to_string(),
            ..Default::default()
        };
        let resp = self
            .client
            .pull_blob_stream_partial(&self.reference, &desc, offset, Some(len))
            .await
            .map_err(|e| e.to_string())?;
        let (mut stream, mut skip) = match resp {
            BlobResponse::Partial(s) => (s, 0u64),
            BlobResponse::Full(s) => (s, offset),
        };
        let mut out = Vec::with_capacity(len as usize);
        while let Some(part) = stream.next().await {
            let part = part.map_err(|e| e.to_string())?;
            let mut p = &part[..];
            if skip > 0 {
                let s = skip.min(p.len() as u64);
                p = &p[s as usize..];
                skip -= s;
            }
            let want = (len - out.len() as u64).min(p.len() as u64) as usize;
            out.extend_from_slice(&p[..want]);
            if out.len() as u64 == len {
                break;
            }
        }
        Ok(out)
    }
}

/// Chunks of lazy layers for one process: the disk cache and, when set, a registry.
pub struct ChunkStore {
    dir: PathBuf,
    remote: Option<Remote>,
    config: FetchConfig,
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Traffic counters.
    pub stats: Stats,
}

impl ChunkStore {
    /// The chunk cache of image store `images_dir` (created when missing, mode 0700: chunks
    /// are image file contents), fetching misses from `remote` when given.
    ///
    /// # Errors
    /// `Internal` when the directory cannot be created.
    pub fn new(
        images_dir: &Path,
        remote: Option<Remote>,
        config: FetchConfig,
    ) -> NodeResult<ChunkStore> {
        let dir = images_dir.join(CHUNKS_DIR);
        fs::create_dir_all(&dir)
            .map_err(|e| NodeError::io(format!("create {}", dir.display()), e))?;
        use std::os::unix::fs::PermissionsExt;
        let _ = fs::set_permissions(images_dir.join("chunks"), fs::Permissions::from_mode(0o700));
        Ok(ChunkStore {
            dir,
            remote,
            config,
            gates: Mutex::new(HashMap::new()),
            stats: Stats::default(),
        })
    }

    /// Path of the cached copy of chunk `digest` (whether present or not).
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed digest.
    pub fn chunk_path(&self, digest: &str) -> NodeResult<PathBuf> {
        Ok(self.dir.join(digest_hex(digest)?))
    }

    /// The bytes of chunk `c` of data blob `data_blob`: from the disk cache when present
    /// and intact, else fetched (one fetch however many callers ask at once), verified,
    /// stored, and returned.
    ///
    /// # Errors
    /// `Unavailable` when the chunk is not cached and cannot be fetched (no registry, all
    /// attempts failed or timed out, or the registry's bytes do not match the digest);
    /// `InvalidArgument` for a malformed digest.
    pub async fn get(&self, data_blob: &str, c: &ChunkRef) -> NodeResult<Vec<u8>> {
        let path = self.chunk_path(&c.digest)?;
        if let Some(b) = self.cached(&path, c) {
            return Ok(b);
        }
        let gate = {
            let mut g = self.gates.lock().unwrap_or_else(|p| p.into_inner());
            g.entry(c.digest.clone()).or_default().clone()
        };
        let held = gate.lock().await;
        let out = match self.cached(&path, c) {
            Some(b) => Ok(b),
            None => self.fetch(data_blob, c, &path).await,
        };
        drop(held);
        let mut g = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        if Arc::strong_count(&gate) == 2 {
            g.remove(&c.digest);
        }
        out
    }

    /// The cached chunk when present and its digest matches; a corrupt file is removed.
    fn cached(&self, path: &Path, c: &ChunkRef) -> Option<Vec<u8>> {
        let b = fs::read(path).ok()?;
        if b.len() as u64 == c.len && chunk_digest(&b) == c.digest {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            self.stats
                .disk_bytes
                .fetch_add(b.len() as u64, Ordering::Relaxed);
            return Some(b);
        }
        self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(chunk = %c.digest, path = %path.display(), "cached chunk failed its digest check; removed, fetching again");
        let _ = fs::remove_file(path);
        None
    }

    async fn fetch(&self, data_blob: &str, c: &ChunkRef, path: &Path) -> NodeResult<Vec<u8>> {
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        let Some(remote) = &self.remote else {
            return Err(NodeError::Unavailable(format!(
                "chunk {} is not cached and no registry is configured",
                c.digest
            )));
        };
        let mut last = String::new();
        for attempt in 1..=self.config.attempts {
            if attempt > 1 {
                tokio::time::sleep(self.config.backoff).await;
            }
            let t0 = Instant::now();
            let r = tokio::time::timeout(
                self.config.timeout,
                remote.range(data_blob, c.offset, c.len),
            )
            .await;
            match r {
                Ok(Ok(b)) if b.len() as u64 == c.len && chunk_digest(&b) == c.digest => {
                    self.stats
                        .fetch_us_sum
                        .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                    self.stats.fetches.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .registry_bytes
                        .fetch_add(b.len() as u64, Ordering::Relaxed);
                    self.store(path, &b);
                    return Ok(b);
                }
                Ok(Ok(b)) => {
                    last = format!(
                        "registry sent {} bytes that do not match chunk digest {}",
                        b.len(),
                        c.digest
                    )
                }
                Ok(Err(e)) => last = e,
                Err(_) => last = format!("timed out after {:?}", self.config.timeout),
            }
            tracing::warn!(chunk = %c.digest, attempt, error = %last, "chunk fetch failed");
        }
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        tracing::error!(chunk = %c.digest, blob = data_blob, error = %last, "chunk fetch gave up; readers get EIO");
        Err(NodeError::Unavailable(format!(
            "fetch chunk {} of {data_blob}: {last} ({} attempts)",
            c.digest, self.config.attempts
        )))
    }

    /// Write a verified chunk into the cache (temp file + rename); failures only log: the
    /// bytes are still served.
    fn store(&self, path: &Path, b: &[u8]) {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let r = (|| {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(b)?;
            fs::rename(&tmp, path)
        })();
        if let Err(e) = r {
            let _ = fs::remove_file(&tmp);
            tracing::warn!(path = %path.display(), error = %e, "cannot cache chunk");
        }
    }
}

/// Bytes of `chunks` present in the disk cache of `images_dir` (each distinct digest
/// counted once; presence only, not verified).
pub fn cached_bytes<'a>(images_dir: &Path, chunks: impl Iterator<Item = &'a ChunkRef>) -> u64 {
    let dir = images_dir.join(CHUNKS_DIR);
    let mut seen = std::collections::HashSet::new();
    chunks
        .filter(|c| seen.insert(c.digest.as_str()))
        .filter(|c| {
            digest_hex(&c.digest)
                .map(|h| dir.join(h).is_file())
                .unwrap_or(false)
        })
        .map(|c| c.len)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(data: &[u8]) -> ChunkRef {
        ChunkRef {
            digest: chunk_digest(data),
            offset: 0,
            len: data.len() as u64,
        }
    }

    #[tokio::test]
    async fn cache_serves_intact_chunks_and_drops_corrupt_ones() {
        let d = tempfile::tempdir().unwrap();
        // No registry: a miss is Unavailable, never wrong bytes.
        let s = ChunkStore::new(d.path(), None, FetchConfig::default()).unwrap();
        let good = chunk(b"hello chunk");
        fs::write(s.chunk_path(&good.digest).unwrap(), b"hello chunk").unwrap();
        assert_eq!(s.get("sha256:x", &good).await.unwrap(), b"hello chunk");
        assert_eq!(s.stats.hits.load(Ordering::Relaxed), 1);
        assert_eq!(cached_bytes(d.path(), [&good].into_iter()), 11);

        let bad = chunk(b"other chunk");
        let p = s.chunk_path(&bad.digest).unwrap();
        fs::write(&p, b"OTHER CHUNK").unwrap();
        let err = s.get("sha256:x", &bad).await.unwrap_err();
        assert!(matches!(err, NodeError::Unavailable(_)), "{err}");
        assert_eq!(s.stats.corrupt.load(Ordering::Relaxed), 1);
        assert!(!p.exists(), "a corrupt chunk is removed");
        assert!(s
            .stats
            .prometheus()
            .contains("sandlot_image_chunk_corrupt_total 1"));
    }
}
