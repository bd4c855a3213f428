//! The chunk fetcher: tiers memory → node disk cache → OCI registry.
//!
//! - **Memory**: each daemon keeps its last few chunks it fetched or verified (so a chunk
//!   that cannot be stored on disk is not fetched again for every FUSE read of it).
//! - **Disk cache** `<images dir>/chunks/sha256/<hex>`: one file per chunk, named by the
//!   SHA-256 of its bytes, written to a temp file and renamed into place, so it survives
//!   node restarts and is never half-written. A daemon hashes a chunk file the first time
//!   it reads it (or writes it, after the registry's bytes matched the digest) and remembers
//!   the file's identity then (device, inode, size, ctime); later reads of that file `pread`
//!   only the requested range without hashing, as long as the identity is unchanged. Any
//!   write, truncate, rename over or `utimes` of the file through the file system changes
//!   its ctime, so such a file is hashed again before it is served; a mismatch (a corrupted
//!   file) deletes it, counts in [`StatsSnapshot::corrupt_disk`], and the chunk is fetched
//!   again. What this trusts: the node's own disk below the file system (a bit flipped on
//!   the device after the check, with no write through the kernel, is not noticed by a
//!   daemon that already checked the file). With a size cap
//!   ([`LIMIT_FILE`]) the least recently used chunks not being read are evicted
//!   ([`evict`]); the daemons sharing the cache account for it under one `flock`.
//! - **Registry**: a byte range of the layer's data blob (HTTP `Range` on the blob GET of the
//!   OCI distribution API, through `oci-client`'s `pull_blob_stream_partial`, so the same
//!   auth as a pull), verified by digest before it is stored or served (a mismatch counts
//!   in [`StatsSnapshot::corrupt_registry`] and is retried like a failed attempt).
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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

/// Upper bounds (seconds) of the buckets of the registry fetch latency histogram
/// (`sandlot_image_chunk_fetch_seconds`); a last bucket `+Inf` follows.
pub const FETCH_BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Counters of one daemon's chunk traffic (all monotonic; see [`StatsSnapshot`] for what each
/// one counts).
#[derive(Debug, Default)]
pub struct Stats {
    registry_bytes: AtomicU64,
    disk_bytes: AtomicU64,
    memory_hits: AtomicU64,
    disk_hits: AtomicU64,
    misses: AtomicU64,
    corrupt_disk: AtomicU64,
    corrupt_registry: AtomicU64,
    failures: AtomicU64,
    evictions: AtomicU64,
    evicted_bytes: AtomicU64,
    fetch_us_sum: AtomicU64,
    fetches: AtomicU64,
    complete_files: AtomicU64,
    passthrough_opens: AtomicU64,
    fetch_buckets: [AtomicU64; FETCH_BUCKETS.len() + 1],
}

/// A copy of [`Stats`], summable across daemons, stored as JSON in
/// `<images>/lazy/stats/<index hex>.json` by each lazy mount daemon (so the server can read
/// them at scrape, and a restarted daemon continues its counts).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct StatsSnapshot {
    /// Bytes fetched from the registry tier (verified), `sandlot_image_bytes_fetched_total{tier="registry"}`.
    pub registry_bytes: u64,
    /// Bytes read from the node's disk cache (verified), `{tier="disk"}`.
    pub disk_bytes: u64,
    /// Chunk lookups answered by the daemon's memory tier (recently used chunks).
    pub memory_hits: u64,
    /// Chunk lookups answered by the disk cache.
    pub disk_hits: u64,
    /// Chunk lookups that went to the registry.
    pub misses: u64,
    /// Cached chunk files that failed their digest check (deleted, fetched again).
    pub corrupt_disk: u64,
    /// Registry answers whose bytes did not match the chunk digest (never served; retried).
    pub corrupt_registry: u64,
    /// Chunk fetches that failed every attempt (the readers got `EIO`).
    pub failures: u64,
    /// Chunk files evicted from the disk cache by its size cap.
    pub evictions: u64,
    /// Bytes of those files.
    pub evicted_bytes: u64,
    /// Sum of successful registry fetch latencies, microseconds.
    pub fetch_us_sum: u64,
    /// Successful registry fetches.
    pub fetches: u64,
    /// Complete-file copies this daemon assembled from verified cached chunks
    /// ([`ChunkStore::complete`]).
    pub complete_files: u64,
    /// Opens answered with FUSE passthrough to a verified complete-file copy (the kernel
    /// then reads that file itself, with no daemon round trip).
    pub passthrough_opens: u64,
    /// Successful fetches per latency bucket of [`FETCH_BUCKETS`] (not cumulative; the last
    /// one is `+Inf`).
    pub fetch_buckets: Vec<u64>,
}

impl StatsSnapshot {
    /// Add `o`'s counts to these.
    pub fn add(&mut self, o: &StatsSnapshot) {
        self.registry_bytes += o.registry_bytes;
        self.disk_bytes += o.disk_bytes;
        self.memory_hits += o.memory_hits;
        self.disk_hits += o.disk_hits;
        self.misses += o.misses;
        self.corrupt_disk += o.corrupt_disk;
        self.corrupt_registry += o.corrupt_registry;
        self.failures += o.failures;
        self.evictions += o.evictions;
        self.evicted_bytes += o.evicted_bytes;
        self.fetch_us_sum += o.fetch_us_sum;
        self.fetches += o.fetches;
        self.complete_files += o.complete_files;
        self.passthrough_opens += o.passthrough_opens;
        self.fetch_buckets.resize(FETCH_BUCKETS.len() + 1, 0);
        for (a, b) in self.fetch_buckets.iter_mut().zip(&o.fetch_buckets) {
            *a += b;
        }
    }
}

impl Stats {
    fn fields(&self) -> [&AtomicU64; 14] {
        [
            &self.registry_bytes,
            &self.disk_bytes,
            &self.memory_hits,
            &self.disk_hits,
            &self.misses,
            &self.corrupt_disk,
            &self.corrupt_registry,
            &self.failures,
            &self.evictions,
            &self.evicted_bytes,
            &self.fetch_us_sum,
            &self.fetches,
            &self.complete_files,
            &self.passthrough_opens,
        ]
    }

    /// The current counts.
    pub fn snapshot(&self) -> StatsSnapshot {
        let v: Vec<u64> = self
            .fields()
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        StatsSnapshot {
            registry_bytes: v[0],
            disk_bytes: v[1],
            memory_hits: v[2],
            disk_hits: v[3],
            misses: v[4],
            corrupt_disk: v[5],
            corrupt_registry: v[6],
            failures: v[7],
            evictions: v[8],
            evicted_bytes: v[9],
            fetch_us_sum: v[10],
            fetches: v[11],
            complete_files: v[12],
            passthrough_opens: v[13],
            fetch_buckets: self
                .fetch_buckets
                .iter()
                .map(|a| a.load(Ordering::Relaxed))
                .collect(),
        }
    }

    /// Add `s`'s counts (a restarted daemon continues from its stats file).
    pub fn seed(&self, s: &StatsSnapshot) {
        let v = [
            s.registry_bytes,
            s.disk_bytes,
            s.memory_hits,
            s.disk_hits,
            s.misses,
            s.corrupt_disk,
            s.corrupt_registry,
            s.failures,
            s.evictions,
            s.evicted_bytes,
            s.fetch_us_sum,
            s.fetches,
            s.complete_files,
            s.passthrough_opens,
        ];
        for (a, n) in self.fields().iter().zip(v) {
            a.fetch_add(n, Ordering::Relaxed);
        }
        for (a, n) in self.fetch_buckets.iter().zip(&s.fetch_buckets) {
            a.fetch_add(*n, Ordering::Relaxed);
        }
    }

    fn fetched(&self, bytes: u64, took: Duration) {
        self.registry_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.fetch_us_sum
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        let i = FETCH_BUCKETS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(FETCH_BUCKETS.len());
        self.fetch_buckets[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// Directory of the daemons' stats files, relative to the image store.
pub const STATS_DIR: &str = "lazy/stats";

/// What `/metrics` shows of the lazy image tiers of one image store (see
/// [`read_metrics`]).
#[derive(Debug, Clone, Default)]
pub struct LazyMetrics {
    /// The daemons' counters, summed.
    pub stats: StatsSnapshot,
    /// Bytes in the disk cache (its accounting file; see [`cache_usage`]).
    pub cache_bytes: u64,
    /// The disk cache's size cap, bytes (`None`: uncapped).
    pub cache_limit: Option<u64>,
}

/// Sum the stats files of every lazy mount daemon of image store `images_dir` (those
/// running and those gone: the counts are since the store was made) and read the disk
/// cache's size and cap. Unreadable files are skipped.
pub fn read_metrics(images_dir: &Path) -> LazyMetrics {
    let mut out = LazyMetrics {
        cache_limit: cache_limit(images_dir),
        ..Default::default()
    };
    out.stats.fetch_buckets = vec![0; FETCH_BUCKETS.len() + 1];
    if let Ok(rd) = fs::read_dir(images_dir.join(STATS_DIR)) {
        for e in rd.flatten() {
            if e.path().extension().is_some_and(|x| x == "json") {
                if let Some(s) = fs::read(e.path())
                    .ok()
                    .and_then(|b| serde_json::from_slice::<StatsSnapshot>(&b).ok())
                {
                    out.stats.add(&s);
                }
            }
        }
    }
    out.cache_bytes = fs::read_to_string(images_dir.join(USAGE_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    out
}

/// File holding the disk cache's size cap in bytes (decimal text), relative to the image
/// store; absent: no cap. Written by the node at start ([`set_cache_limit`]), read by the
/// daemons each time they add a chunk, so a node restarted with another cap applies it to
/// running daemons too.
pub const LIMIT_FILE: &str = "chunks/limit";
/// File holding the disk cache's accounted size in bytes (decimal text), updated under
/// [`LOCK_FILE`]; recomputed from the directory when missing and at each eviction.
pub const USAGE_FILE: &str = "chunks/usage";
/// `flock` serializing the accounting and eviction of the daemons sharing a cache.
pub const LOCK_FILE: &str = "chunks/lock";

/// Set (or with `None` remove) the disk cache's size cap of image store `images_dir`
/// (`sandlot up|node --image-cache-mib`). The cap applies at the next chunk a daemon adds.
///
/// # Errors
/// `Internal` when the file cannot be written.
pub fn set_cache_limit(images_dir: &Path, limit: Option<u64>) -> NodeResult<()> {
    let p = images_dir.join(LIMIT_FILE);
    match limit {
        None => match fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(NodeError::io(format!("remove {}", p.display()), e))
            }
            _ => Ok(()),
        },
        Some(n) => {
            let dir = images_dir.join(CHUNKS_DIR);
            fs::create_dir_all(&dir)
                .map_err(|e| NodeError::io(format!("create {}", dir.display()), e))?;
            fs::write(&p, format!("{n}\n"))
                .map_err(|e| NodeError::io(format!("write {}", p.display()), e))
        }
    }
}

/// The disk cache's size cap of image store `images_dir`, bytes (`None`: uncapped).
pub fn cache_limit(images_dir: &Path) -> Option<u64> {
    fs::read_to_string(images_dir.join(LIMIT_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// One chunk file of the disk cache, as the eviction sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// File name (the chunk digest's hex).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Last use: the file's mtime, nanoseconds since the epoch (set when the chunk is
    /// stored and, at most once a second, when it is read).
    pub used_ns: i128,
}

/// Chunk files of cache directory `dir` (names of 64 hex digits; temp files are not
/// counted).
fn scan(dir: &Path) -> Vec<CacheEntry> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if name.len() != 64 || !name.bytes().all(|c| c.is_ascii_hexdigit()) {
            continue;
        }
        if let Ok(m) = e.metadata() {
            out.push(CacheEntry {
                name,
                size: m.len(),
                used_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            });
        }
    }
    out
}

/// Least recently used first (ties by name, so the order is total).
pub fn eviction_order(entries: &mut [CacheEntry]) {
    entries.sort_by(|a, b| a.used_ns.cmp(&b.used_ns).then_with(|| a.name.cmp(&b.name)));
}

/// Evict least recently used chunk files of cache directory `dir` until the files total at
/// most `target` bytes, skipping chunks in use (a reader holds a shared `flock` on the
/// file while it reads it; eviction takes an exclusive one without waiting, so a chunk
/// being read is never removed under its reader). Returns the bytes left and the
/// (files, bytes) evicted.
pub fn evict(dir: &Path, target: u64) -> (u64, u64, u64) {
    let mut entries = scan(dir);
    let mut total: u64 = entries.iter().map(|e| e.size).sum();
    eviction_order(&mut entries);
    let (mut n, mut bytes) = (0, 0);
    for e in entries {
        if total <= target {
            break;
        }
        let p = dir.join(&e.name);
        let Ok(f) = fs::File::open(&p) else {
            total = total.saturating_sub(e.size);
            continue;
        };
        let Ok(held) = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock)
        else {
            continue; // in use
        };
        if fs::remove_file(&p).is_ok() {
            total = total.saturating_sub(e.size);
            n += 1;
            bytes += e.size;
        }
        drop(held);
    }
    (total, n, bytes)
}

/// The exclusive accounting lock of image store `images_dir`'s chunk cache.
fn lock_cache(images_dir: &Path) -> Option<nix::fcntl::Flock<fs::File>> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(images_dir.join(LOCK_FILE))
        .ok()?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).ok()
}

/// Bytes of chunk files in the disk cache of `images_dir`: the accounting file, or a scan
/// when it is missing or unreadable.
pub fn cache_usage(images_dir: &Path) -> u64 {
    fs::read_to_string(images_dir.join(USAGE_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            scan(&images_dir.join(CHUNKS_DIR))
                .iter()
                .map(|e| e.size)
                .sum()
        })
}

/// A registry repository to fetch data-blob ranges from.
pub struct Remote {
    client: oci_client::Client,
    reference: oci_client::Reference,
    auth: oci_client::secrets::RegistryAuth,
    /// Set once the registry answered 401: from then on every request goes through
    /// `oci-client`'s stored credentials (token or Basic). Until then requests carry no
    /// credentials, because a stored `RegistryAuth` makes `oci-client` probe `GET /v2/`
    /// before every request that has no cached token, which for a registry that never
    /// challenges (no token to cache) doubled the round trips of every chunk fetch.
    auth_stored: std::sync::atomic::AtomicBool,
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
            auth_stored: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Bytes `[offset, offset + len)` of blob `blob`. A registry that ignores `Range` and
    /// sends the whole blob is read up to the range's end.
    async fn range(&self, blob: &str, offset: u64, len: u64) -> Result<Vec<u8>, String> {
        use oci_client::client::BlobResponse;
        let desc = oci_client::manifest::OciDescriptor {
            digest: blob.to_string(),
            ..Default::default()
        };
        let mut resp = None;
        if !self.auth_stored.load(Ordering::Relaxed) {
            // No credentials: one round trip on registries that need none.
            match self
                .client
                .pull_blob_stream_partial(&self.reference, &desc, offset, Some(len))
                .await
            {
                Ok(r) => resp = Some(r),
                Err(oci_client::errors::OciDistributionError::UnauthorizedError { .. }) => {
                    self.auth_stored.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        let resp = match resp {
            Some(r) => r,
            None => {
                self.client
                    .store_auth_if_needed(self.reference.resolve_registry(), &self.auth)
                    .await;
                self.client
                    .pull_blob_stream_partial(&self.reference, &desc, offset, Some(len))
                    .await
                    .map_err(|e| e.to_string())?
            }
        };
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

/// Chunks of lazy layers for one process: a small memory tier of recently used chunks, the
/// disk cache and, when set, a registry.
pub struct ChunkStore {
    images_dir: PathBuf,
    dir: PathBuf,
    remote: Option<Remote>,
    config: FetchConfig,
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Recently fetched or verified chunks, most recent last.
    memory: Mutex<std::collections::VecDeque<(String, Arc<Vec<u8>>)>>,
    memory_chunks: usize,
    /// Chunk files this process hashed and found intact, by chunk digest → the file's
    /// identity at that time; at most [`MAX_VERIFIED`] entries (then it starts over).
    verified: Arc<Mutex<HashMap<String, FileId>>>,
    /// Traffic counters.
    pub stats: Arc<Stats>,
}

/// Entries of a [`ChunkStore`]'s verified-file table before it is cleared (about 100 bytes
/// each; a cleared entry only costs one more hash of that chunk file).
pub const MAX_VERIFIED: usize = 1 << 18;

/// Identity of a chunk file when it was hashed: device, inode, size, ctime (seconds,
/// nanoseconds). A write, truncate, rename over or `utimes` changes at least one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId(u64, u64, u64, i64, i64);

impl FileId {
    fn of(m: &fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId(m.dev(), m.ino(), m.len(), m.ctime(), m.ctime_nsec())
    }
}

/// Chunks the memory tier of one daemon keeps, default 16 (`$SANDLOT_LAZY_MEMORY_CHUNKS`,
/// 0 turns it off).
fn memory_chunks() -> usize {
    std::env::var("SANDLOT_LAZY_MEMORY_CHUNKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
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
            images_dir: images_dir.to_path_buf(),
            dir,
            remote,
            config,
            gates: Mutex::new(HashMap::new()),
            memory: Mutex::new(Default::default()),
            memory_chunks: memory_chunks(),
            verified: Default::default(),
            stats: Default::default(),
        })
    }

    /// Path of the cached copy of chunk `digest` (whether present or not).
    ///
    /// # Errors
    /// `InvalidArgument` for a malformed digest.
    pub fn chunk_path(&self, digest: &str) -> NodeResult<PathBuf> {
        Ok(self.dir.join(digest_hex(digest)?))
    }

    /// Bytes `[from, to)` of chunk `c` of data blob `data_blob` (clipped to the chunk's
    /// length): from the memory tier, else a `pread` of just that range from the disk cache
    /// when this process already verified the chunk file and it is unchanged since, else as
    /// [`get`](Self::get) (verify or fetch the whole chunk).
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn read(
        &self,
        data_blob: &str,
        c: &ChunkRef,
        from: u64,
        to: u64,
    ) -> NodeResult<Vec<u8>> {
        let to = to.min(c.len);
        let from = from.min(to);
        if let Some(b) = self.in_memory(&c.digest) {
            return Ok(b.get(from as usize..to as usize).unwrap_or(&[]).to_vec());
        }
        let path = self.chunk_path(&c.digest)?;
        if let Some(v) = self.cached_range(&path, c, from, to) {
            return Ok(v);
        }
        let b = self.get(data_blob, c).await?;
        Ok(b.get(from as usize..to as usize).unwrap_or(&[]).to_vec())
    }

    /// Ask the kernel to read chunk `c`'s cache file into the page cache in the
    /// background (`POSIX_FADV_WILLNEED`; read-ahead of a sequential reader). Returns
    /// whether the file is there (nothing is verified or fetched here).
    pub fn advise(&self, c: &ChunkRef) -> bool {
        let Ok(f) = self.chunk_path(&c.digest).and_then(|p| {
            fs::File::open(&p).map_err(|e| NodeError::io(format!("open {}", p.display()), e))
        }) else {
            return false;
        };
        let _ = nix::fcntl::posix_fadvise(
            &f,
            0,
            c.len as i64,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
        );
        true
    }

    /// Fetch (or verify) chunk `c` ahead of its read, as [`get`](Self::get) does (one fetch
    /// however many ask). Errors are dropped: the real read reports them.
    pub async fn prefetch(&self, data_blob: &str, c: &ChunkRef) {
        let _ = self.get(data_blob, c).await;
    }

    fn is_verified(&self, digest: &str, id: FileId) -> bool {
        let v = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        v.get(digest) == Some(&id)
    }

    fn mark_verified(&self, digest: &str, id: FileId) {
        mark_verified(&self.verified, digest, id)
    }

    /// Refresh the LRU clock (mtime) of open chunk file `f` at most once a second; when the
    /// file was verified as `id`, its new identity (the ctime moved) stays verified.
    fn touch(&self, f: &fs::File, digest: &str, m: &fs::Metadata, verified: bool) {
        use std::os::unix::fs::MetadataExt;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        if m.mtime() < now - 1 {
            use nix::sys::time::TimeSpec;
            let _ = nix::sys::stat::futimens(f, &TimeSpec::UTIME_OMIT, &TimeSpec::UTIME_NOW);
            if verified {
                if let Ok(m2) = f.metadata() {
                    self.mark_verified(digest, FileId::of(&m2));
                }
            }
        }
    }

    /// Bytes `[from, to)` of the cached chunk file when this process verified it and it is
    /// unchanged since (read under a shared `flock`, so eviction leaves it alone meanwhile);
    /// `None` otherwise (absent, never verified here, or changed: the caller verifies it).
    fn cached_range(&self, path: &Path, c: &ChunkRef, from: u64, to: u64) -> Option<Vec<u8>> {
        use std::os::unix::fs::FileExt as _;
        let f = fs::File::open(path).ok()?;
        let f = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockShared).ok()?;
        let m = f.metadata().ok()?;
        if m.len() != c.len || !self.is_verified(&c.digest, FileId::of(&m)) {
            return None;
        }
        let mut b = vec![0u8; (to - from) as usize];
        f.read_exact_at(&mut b, from).ok()?;
        self.stats.disk_hits.fetch_add(1, Ordering::Relaxed);
        self.stats
            .disk_bytes
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        self.touch(&f, &c.digest, &m, true);
        Some(b)
    }

    /// The bytes of chunk `c` of data blob `data_blob`: from the memory tier, else from the
    /// disk cache when present and intact, else fetched (one fetch however many callers of
    /// this process ask at once), verified, stored, and returned.
    ///
    /// # Errors
    /// `Unavailable` when the chunk is not cached and cannot be fetched (no registry, all
    /// attempts failed or timed out, or the registry's bytes do not match the digest);
    /// `InvalidArgument` for a malformed digest.
    pub async fn get(&self, data_blob: &str, c: &ChunkRef) -> NodeResult<Arc<Vec<u8>>> {
        if let Some(b) = self.in_memory(&c.digest) {
            return Ok(b);
        }
        let path = self.chunk_path(&c.digest)?;
        if let Some(b) = self.cached(&path, c) {
            return Ok(self.remember(c, b));
        }
        let gate = {
            let mut g = self.gates.lock().unwrap_or_else(|p| p.into_inner());
            g.entry(c.digest.clone()).or_default().clone()
        };
        let held = gate.lock().await;
        let out = match self.in_memory(&c.digest) {
            Some(b) => Ok(b),
            None => match self.cached(&path, c) {
                Some(b) => Ok(self.remember(c, b)),
                None => self
                    .fetch(data_blob, c, &path)
                    .await
                    .map(|b| self.remember(c, b)),
            },
        };
        drop(held);
        let mut g = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        if Arc::strong_count(&gate) == 2 {
            g.remove(&c.digest);
        }
        out
    }

    fn in_memory(&self, digest: &str) -> Option<Arc<Vec<u8>>> {
        let mut m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let i = m.iter().position(|(d, _)| d == digest)?;
        let e = m.remove(i)?;
        let b = e.1.clone();
        m.push_back(e);
        self.stats.memory_hits.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }

    fn remember(&self, c: &ChunkRef, b: impl Into<Arc<Vec<u8>>>) -> Arc<Vec<u8>> {
        let b = b.into();
        if self.memory_chunks > 0 {
            let mut m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
            if !m.iter().any(|(d, _)| *d == c.digest) {
                if m.len() >= self.memory_chunks {
                    m.pop_front();
                }
                m.push_back((c.digest.clone(), b.clone()));
            }
        }
        b
    }

    /// The cached chunk when present and intact (read under a shared `flock`, so eviction
    /// leaves it alone meanwhile; its mtime, the LRU clock, is refreshed): hashed unless this
    /// process verified the same unchanged file before; a corrupt file is removed.
    fn cached(&self, path: &Path, c: &ChunkRef) -> Option<Vec<u8>> {
        use std::io::Read as _;
        let f = fs::File::open(path).ok()?;
        let mut f = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockShared).ok()?;
        let m = f.metadata().ok()?;
        let id = FileId::of(&m);
        let mut b = Vec::with_capacity(c.len as usize);
        f.read_to_end(&mut b).ok()?;
        let known = self.is_verified(&c.digest, id);
        if b.len() as u64 == c.len && (known || chunk_digest(&b) == c.digest) {
            if !known {
                self.mark_verified(&c.digest, id);
            }
            self.stats.disk_hits.fetch_add(1, Ordering::Relaxed);
            self.stats
                .disk_bytes
                .fetch_add(b.len() as u64, Ordering::Relaxed);
            self.touch(&f, &c.digest, &m, true);
            return Some(b);
        }
        self.stats.corrupt_disk.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(chunk = %c.digest, path = %path.display(), "cached chunk failed its digest check; removed, fetching again");
        if fs::remove_file(path).is_ok() {
            self.account(-(b.len() as i64));
        }
        None
    }

    async fn fetch(&self, data_blob: &str, c: &ChunkRef, path: &Path) -> NodeResult<Arc<Vec<u8>>> {
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
                    self.stats.fetched(b.len() as u64, t0.elapsed());
                    let b = Arc::new(b);
                    self.store(path, b.clone(), &c.digest);
                    return Ok(b);
                }
                Ok(Ok(b)) => {
                    self.stats.corrupt_registry.fetch_add(1, Ordering::Relaxed);
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

    /// Count one open answered with FUSE passthrough (see [`StatsSnapshot::passthrough_opens`]).
    pub fn passthrough_opened(&self) {
        self.stats.passthrough_opens.fetch_add(1, Ordering::Relaxed);
    }

    /// The verified complete-file copy `key` ([`file_key`]) of a file of `size` bytes,
    /// opened read-only under a shared `flock` (eviction skips it while the lock is held;
    /// its LRU clock is refreshed): `None` when it is absent, of another size, or not
    /// hashed by this process as the file is now (see [`complete`](Self::complete)).
    pub fn open_complete(&self, key: &str, size: u64) -> Option<nix::fcntl::Flock<fs::File>> {
        let f = fs::File::open(self.chunk_path(key).ok()?).ok()?;
        let f = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockShared).ok()?;
        let m = f.metadata().ok()?;
        if m.len() != size || !self.is_verified(key, FileId::of(&m)) {
            return None;
        }
        self.touch(&f, key, &m, true);
        Some(f)
    }

    /// Make sure the file of `size` bytes made of `chunks` (in order) has a verified
    /// complete-file copy in the disk cache, named by [`file_key`]; returns whether it has.
    /// Blocking file I/O: call it off the async workers. A one-chunk file's copy is its
    /// chunk file (checked as a read of it is). An existing copy that this process has not
    /// hashed as it is now is hashed chunk range by chunk range against `chunks`; a
    /// mismatch removes it (counted in [`StatsSnapshot::corrupt_disk`]). A missing copy is
    /// assembled from the cached chunks, each checked as a read of it is, into a temp file
    /// renamed into place, accounted in the cache's size and evicted by its cap like a
    /// chunk. Nothing is fetched: when a chunk is not cached, `false`.
    pub fn complete(&self, key: &str, size: u64, chunks: &[ChunkRef]) -> bool {
        use std::os::unix::fs::FileExt as _;
        let Ok(path) = self.chunk_path(key) else {
            return false;
        };
        if let [c] = chunks {
            return c.digest == key && c.len == size && self.cached(&path, c).is_some();
        }
        if let Some(f) = fs::File::open(&path)
            .ok()
            .and_then(|f| nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockShared).ok())
        {
            if let Ok(m) = f.metadata() {
                let id = FileId::of(&m);
                let mut buf = Vec::new();
                let intact = m.len() == size
                    && (self.is_verified(key, id)
                        || chunks.iter().enumerate().all(|(i, c)| {
                            buf.resize(c.len as usize, 0);
                            f.read_exact_at(&mut buf, i as u64 * super::format::CHUNK_SIZE)
                                .is_ok()
                                && chunk_digest(&buf) == c.digest
                        }));
                if intact {
                    self.mark_verified(key, id);
                    return true;
                }
                self.stats.corrupt_disk.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(file = key, path = %path.display(), "complete-file copy failed its digest check; removed");
                drop(f);
                if fs::remove_file(&path).is_ok() {
                    self.account(-(m.len() as i64));
                }
            }
        }
        let paths: Vec<PathBuf> = chunks
            .iter()
            .filter_map(|c| self.chunk_path(&c.digest).ok())
            .collect();
        if paths.len() != chunks.len() {
            return false;
        }
        // The last chunks read may still be on their way to disk (`store` writes in the
        // background): wait for pending writes, at most 1 s, before giving up.
        let deadline = Instant::now() + Duration::from_secs(1);
        while !paths.iter().all(|p| p.is_file()) {
            if BACKGROUND_WRITES.load(Ordering::Acquire) == 0 || Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let r = (|| -> std::io::Result<Option<fs::Metadata>> {
            let mut f = fs::File::create(&tmp)?;
            for (c, p) in chunks.iter().zip(&paths) {
                let Some(b) = self.cached(p, c) else {
                    return Ok(None);
                };
                f.write_all(&b)?;
            }
            fs::rename(&tmp, &path)?;
            // The same inode, after the rename (which moves its ctime).
            f.metadata().map(Some)
        })();
        match r {
            Ok(Some(m)) if m.len() == size => {
                self.mark_verified(key, FileId::of(&m));
                self.stats.complete_files.fetch_add(1, Ordering::Relaxed);
                self.account(size as i64);
                true
            }
            Ok(_) => {
                let _ = fs::remove_file(&tmp);
                false
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                tracing::warn!(path = %path.display(), error = %e, "cannot write complete-file copy");
                false
            }
        }
    }

    /// Write verified chunk `digest` into the cache (temp file + rename), remember the file
    /// as verified, and account for it; failures only log: the bytes are still served.
    ///
    /// With a memory tier (the usual case) and a tokio runtime, this runs on a blocking
    /// thread after the caller already has the bytes: the file write, rename and the
    /// accounting under the cache `flock` (about 3–5 ms per 1 MiB chunk on a busy host)
    /// stay off the reader's path. A reader of the same chunk meanwhile gets it from the
    /// memory tier; one that misses both only fetches it again (digest-checked as ever).
    /// Nothing is `fsync`ed: a chunk file lost in a crash only costs a refetch, and the
    /// rename means a file under the chunk's name is never half-written.
    ///
    /// At most [`MAX_BACKGROUND_WRITES`] writes wait or run in the background per process
    /// (each holds its chunk's bytes); beyond that the caller writes inline, so a disk
    /// slower than the registry slows readers down instead of growing memory.
    fn store(&self, path: &Path, b: Arc<Vec<u8>>, digest: &str) {
        let w = self.writer();
        let (path, digest) = (path.to_path_buf(), digest.to_string());
        let background = self.memory_chunks > 0
            && BACKGROUND_WRITES
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < MAX_BACKGROUND_WRITES).then_some(n + 1)
                })
                .is_ok();
        if !background {
            return w.store(&path, &b, &digest);
        }
        /// Gives the slot back however the write ends (a panic included).
        struct Slot;
        impl Drop for Slot {
            fn drop(&mut self) {
                BACKGROUND_WRITES.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let slot = Slot;
        let write = move || {
            let _slot = slot;
            w.store(&path, &b, &digest);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(write);
            }
            Err(_) => write(),
        }
    }

    /// Add `delta` bytes to the cache's accounted size (see [`CacheWriter::account`]).
    fn account(&self, delta: i64) {
        self.writer().account(delta)
    }

    fn writer(&self) -> CacheWriter {
        CacheWriter {
            images_dir: self.images_dir.clone(),
            dir: self.dir.clone(),
            verified: self.verified.clone(),
            stats: self.stats.clone(),
        }
    }

    /// Keep this store's counters in `path` (a JSON [`StatsSnapshot`]): load what a previous
    /// daemon of the same layer counted into them, then write them every second while they
    /// change, on runtime `rt`. Returns a handle that writes them once more when dropped.
    pub fn persist_stats(
        self: &Arc<Self>,
        path: PathBuf,
        rt: &tokio::runtime::Handle,
    ) -> StatsWriter {
        if let Some(prev) = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<StatsSnapshot>(&b).ok())
        {
            self.stats.seed(&prev);
        }
        if let Some(d) = path.parent() {
            let _ = fs::create_dir_all(d);
        }
        let w = StatsWriter {
            store: self.clone(),
            path,
        };
        let w2 = StatsWriter {
            store: self.clone(),
            path: w.path.clone(),
        };
        rt.spawn(async move {
            let mut last = StatsSnapshot::default();
            loop {
                let now = w2.store.stats.snapshot();
                if now != last {
                    w2.write_now(&now);
                    last = now;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        w
    }
}

/// Writes a [`ChunkStore`]'s counters to its stats file (see [`ChunkStore::persist_stats`]).
pub struct StatsWriter {
    store: Arc<ChunkStore>,
    path: PathBuf,
}

impl StatsWriter {
    fn write_now(&self, s: &StatsSnapshot) {
        let tmp = self.path.with_extension("tmp");
        let body = serde_json::to_vec(s).expect("stats serialize");
        if fs::write(&tmp, body)
            .and_then(|_| fs::rename(&tmp, &self.path))
            .is_err()
        {
            tracing::warn!(path = %self.path.display(), "cannot write lazy stats");
        }
    }
}

impl Drop for StatsWriter {
    fn drop(&mut self) {
        let s = self.store.stats.snapshot();
        self.write_now(&s);
    }
}

/// Name of the complete-file copy of a file of `size` bytes made of `chunks` (in order) in
/// the disk cache ([`ChunkStore::complete`]): a one-chunk file's chunk digest (its chunk
/// file is the copy); for more chunks `sha256:` + the SHA-256 of the text
/// `sandlot-lazy-file-v1\n`, the size in decimal and each chunk digest, each followed by
/// `\n` (so files with the same chunks share one copy); `None` for an empty file or chunks
/// that are not whole [`CHUNK_SIZE`](super::format::CHUNK_SIZE) pieces (but the last)
/// adding up to `size`.
pub fn file_key(size: u64, chunks: &[ChunkRef]) -> Option<String> {
    let whole = |c: &ChunkRef| c.len == super::format::CHUNK_SIZE;
    if chunks.is_empty()
        || chunks.iter().map(|c| c.len).sum::<u64>() != size
        || !chunks[..chunks.len() - 1].iter().all(whole)
    {
        return None;
    }
    if let [c] = chunks {
        return Some(c.digest.clone());
    }
    let mut s = format!("sandlot-lazy-file-v1\n{size}\n");
    for c in chunks {
        s.push_str(&c.digest);
        s.push('\n');
    }
    Some(chunk_digest(s.as_bytes()))
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

/// Remember that chunk file `digest` was hashed as `id` (the table starts over at
/// [`MAX_VERIFIED`] entries).
fn mark_verified(verified: &Mutex<HashMap<String, FileId>>, digest: &str, id: FileId) {
    let mut v = verified.lock().unwrap_or_else(|p| p.into_inner());
    if v.len() >= MAX_VERIFIED && !v.contains_key(digest) {
        v.clear();
    }
    v.insert(digest.to_string(), id);
}

/// What writing a chunk into the disk cache needs of a [`ChunkStore`], owned, so that it
/// can run on a blocking thread.
struct CacheWriter {
    images_dir: PathBuf,
    dir: PathBuf,
    verified: Arc<Mutex<HashMap<String, FileId>>>,
    stats: Arc<Stats>,
}

/// Chunk writes a process may have waiting or running in the background (×1 MiB of
/// memory at most, the chunk size).
const MAX_BACKGROUND_WRITES: usize = 32;

/// Chunk writes now waiting or running in the background (see [`ChunkStore::store`]).
static BACKGROUND_WRITES: AtomicUsize = AtomicUsize::new(0);

/// Temp-file suffixes of chunk writes in this process (two writes of one chunk never share
/// a temp file).
static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl CacheWriter {
    fn store(&self, path: &Path, b: &[u8], digest: &str) {
        let tmp = path.with_extension(format!(
            "tmp{}-{}",
            std::process::id(),
            TMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let r = (|| {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(b)?;
            fs::rename(&tmp, path)?;
            // The same inode, after the rename (which moves its ctime).
            f.metadata()
        })();
        match r {
            Ok(m) => {
                mark_verified(&self.verified, digest, FileId::of(&m));
                self.account(b.len() as i64)
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                tracing::warn!(path = %path.display(), error = %e, "cannot cache chunk");
            }
        }
    }

    /// Add `delta` bytes to the cache's accounted size and, when it is over the cap,
    /// evict least recently used chunks down to 90 % of the cap (under the cache's
    /// `flock`, so the daemons sharing the cache account and evict one at a time).
    fn account(&self, delta: i64) {
        let Some(_lock) = lock_cache(&self.images_dir) else {
            return;
        };
        let usage_path = self.images_dir.join(USAGE_FILE);
        let mut usage = match fs::read_to_string(&usage_path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
        {
            Some(u) => u.saturating_add_signed(delta),
            // Missing (first use, or a store from before the accounting): count the files,
            // the one just stored included.
            None => scan(&self.dir).iter().map(|e| e.size).sum(),
        };
        if let Some(limit) = cache_limit(&self.images_dir) {
            if usage > limit {
                let (left, n, bytes) = evict(&self.dir, limit - limit / 10);
                self.stats.evictions.fetch_add(n, Ordering::Relaxed);
                self.stats.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
                tracing::info!(
                    evicted = n,
                    bytes,
                    left,
                    limit,
                    "chunk cache over its cap: evicted least recently used chunks"
                );
                usage = left;
            }
        }
        let _ = fs::write(&usage_path, format!("{usage}\n"));
    }
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
        assert_eq!(&**s.get("sha256:x", &good).await.unwrap(), b"hello chunk");
        assert_eq!(s.stats.snapshot().disk_hits, 1);
        // The second read comes from the memory tier.
        assert_eq!(&**s.get("sha256:x", &good).await.unwrap(), b"hello chunk");
        assert_eq!(s.stats.snapshot().memory_hits, 1);
        assert_eq!(cached_bytes(d.path(), [&good].into_iter()), 11);

        let bad = chunk(b"other chunk");
        let p = s.chunk_path(&bad.digest).unwrap();
        fs::write(&p, b"OTHER CHUNK").unwrap();
        let err = s.get("sha256:x", &bad).await.unwrap_err();
        assert!(matches!(err, NodeError::Unavailable(_)), "{err}");
        let snap = s.stats.snapshot();
        assert_eq!((snap.corrupt_disk, snap.misses), (1, 1));
        assert!(!p.exists(), "a corrupt chunk is removed");
    }

    #[tokio::test]
    async fn verified_chunk_files_are_read_by_range_and_rechecked_when_changed() {
        let d = tempfile::tempdir().unwrap();
        let mut s = ChunkStore::new(d.path(), None, FetchConfig::default()).unwrap();
        s.memory_chunks = 0;
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let c = chunk(&data);
        let p = s.chunk_path(&c.digest).unwrap();
        fs::write(&p, &data).unwrap();
        // Never checked by this store: a range read hashes the whole file first.
        assert!(s.cached_range(&p, &c, 0, 10).is_none());
        assert_eq!(
            s.read("sha256:x", &c, 100, 200).await.unwrap(),
            &data[100..200]
        );
        // Checked and unchanged: ranges are read straight from the file, clipped at its end.
        assert_eq!(
            s.cached_range(&p, &c, 1000, 1010).unwrap(),
            &data[1000..1010]
        );
        assert_eq!(
            s.read("sha256:x", &c, 4000, 9000).await.unwrap(),
            &data[4000..]
        );
        let snap = s.stats.snapshot();
        assert_eq!((snap.disk_hits, snap.corrupt_disk, snap.misses), (3, 0, 0));
        // Corrupted in place through the file system (same size, same inode): its ctime
        // moves, so the next read hashes it again, drops it and (no registry) fails.
        // The pause keeps a coarse ctime clock from giving the write the check's tick.
        std::thread::sleep(Duration::from_millis(20));
        let mut bad = data.clone();
        bad[150] ^= 1;
        fs::write(&p, &bad).unwrap();
        let err = s.read("sha256:x", &c, 100, 200).await.unwrap_err();
        assert!(matches!(err, NodeError::Unavailable(_)), "{err}");
        assert_eq!(s.stats.snapshot().corrupt_disk, 1);
        assert!(!p.exists(), "a corrupt chunk is removed");
        // A chunk this store wrote after a (simulated) verified fetch is trusted at once.
        s.writer().store(&p, &data, &c.digest);
        assert_eq!(s.cached_range(&p, &c, 0, 4).unwrap(), &data[..4]);
    }

    #[test]
    fn complete_file_copies_are_assembled_from_cached_chunks_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let s = ChunkStore::new(d.path(), None, FetchConfig::default()).unwrap();
        let size = super::super::format::CHUNK_SIZE as usize;
        let parts: Vec<Vec<u8>> = (0..3u8)
            .map(|i| {
                let n = if i == 2 { 1000 } else { size };
                (0..n).map(|j| (j as u8).wrapping_mul(i + 3)).collect()
            })
            .collect();
        let chunks: Vec<ChunkRef> = parts.iter().map(|p| chunk(p)).collect();
        let total = (2 * size + 1000) as u64;
        let key = file_key(total, &chunks).unwrap();
        assert!(chunks.iter().all(|c| c.digest != key));
        // Not whole chunks but the last, a wrong size, no chunks: no copy.
        assert_eq!(file_key(total - 1, &chunks), None);
        assert_eq!(file_key(0, &[]), None);
        let short = [chunks[2].clone(), chunks[0].clone()];
        assert_eq!(file_key(size as u64 + 1000, &short), None);
        // A one-chunk file's copy is its chunk file.
        assert_eq!(file_key(1000, &chunks[2..]).unwrap(), chunks[2].digest);

        // A chunk missing: nothing is made (and nothing fetched).
        for (c, p) in chunks.iter().zip(&parts).take(2) {
            fs::write(s.chunk_path(&c.digest).unwrap(), p).unwrap();
        }
        assert!(!s.complete(&key, total, &chunks));
        assert!(s.open_complete(&key, total).is_none());
        fs::write(s.chunk_path(&chunks[2].digest).unwrap(), &parts[2]).unwrap();
        assert!(s.complete(&key, total, &chunks));
        let copy = s.chunk_path(&key).unwrap();
        assert_eq!(fs::read(&copy).unwrap(), parts.concat());
        assert!(s.open_complete(&key, total).is_some());
        assert!(s.open_complete(&key, total + 1).is_none());
        assert_eq!(s.stats.snapshot().complete_files, 1);
        // Counted in the cache (with the chunks it came from).
        assert_eq!(cache_usage(d.path()), 2 * total);

        // Another process finds it and hashes it before use.
        let s2 = ChunkStore::new(d.path(), None, FetchConfig::default()).unwrap();
        assert!(s2.open_complete(&key, total).is_none());
        assert!(s2.complete(&key, total, &chunks));
        assert!(s2.open_complete(&key, total).is_some());
        assert_eq!(s2.stats.snapshot().complete_files, 0);

        // Changed in place: neither store trusts it; checking it removes it, and it is
        // made again from the chunks.
        std::thread::sleep(Duration::from_millis(20));
        let mut bad = parts.concat();
        bad[size + 7] ^= 1;
        fs::write(&copy, &bad).unwrap();
        assert!(s.open_complete(&key, total).is_none());
        assert!(s2.open_complete(&key, total).is_none());
        assert!(s2.complete(&key, total, &chunks));
        assert_eq!(s2.stats.snapshot().corrupt_disk, 1);
        assert_eq!(fs::read(&copy).unwrap(), parts.concat());
        assert!(s2.open_complete(&key, total).is_some());
    }

    fn set_age(p: &Path, secs_ago: u64) {
        let t = std::time::SystemTime::now() - Duration::from_secs(secs_ago);
        fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(t)
            .unwrap();
    }

    #[test]
    fn eviction_takes_least_recently_used_and_skips_chunks_in_use() {
        let d = tempfile::tempdir().unwrap();
        let names: Vec<String> = (0..5).map(|i| format!("{i:064x}")).collect();
        for (i, n) in names.iter().enumerate() {
            let p = d.path().join(n);
            fs::write(&p, [i as u8; 100]).unwrap();
            set_age(&p, 100 - 10 * i as u64); // names[0] oldest
        }
        fs::write(d.path().join("x.tmp1"), [0u8; 1000]).unwrap(); // not a chunk
                                                                  // The oldest is being read: a shared flock, as ChunkStore::cached holds.
        let reader = nix::fcntl::Flock::lock(
            fs::File::open(d.path().join(&names[0])).unwrap(),
            nix::fcntl::FlockArg::LockShared,
        )
        .unwrap();
        let mut all = scan(d.path());
        eviction_order(&mut all);
        let order: Vec<&str> = all.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(order, names.iter().map(String::as_str).collect::<Vec<_>>());
        let (left, n, bytes) = evict(d.path(), 250);
        assert_eq!((left, n, bytes), (200, 3, 300));
        let kept: Vec<bool> = names.iter().map(|n| d.path().join(n).exists()).collect();
        assert_eq!(kept, [true, false, false, false, true]);
        drop(reader);
        // Nothing to do under the target.
        assert_eq!(evict(d.path(), 250), (200, 0, 0));
    }

    #[tokio::test]
    async fn capped_cache_keeps_recently_read_chunks_and_its_accounting() {
        let d = tempfile::tempdir().unwrap();
        set_cache_limit(d.path(), Some(350)).unwrap();
        let mut s = ChunkStore::new(d.path(), None, FetchConfig::default()).unwrap();
        s.memory_chunks = 0;
        let data: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 100]).collect();
        let refs: Vec<ChunkRef> = data.iter().map(|b| chunk(b)).collect();
        for (i, (b, c)) in data.iter().zip(&refs).take(3).enumerate() {
            let p = s.chunk_path(&c.digest).unwrap();
            s.writer().store(&p, b, &c.digest);
            set_age(&p, 100 - 10 * i as u64);
        }
        assert_eq!(cache_usage(d.path()), 300);
        // Reading the oldest makes it the most recently used.
        assert_eq!(&**s.get("sha256:x", &refs[0]).await.unwrap(), &data[0][..]);
        // Two more: 500 > 350, down to <= 315: the two least recently used go.
        for (b, c) in data.iter().zip(&refs).skip(3) {
            s.writer()
                .store(&s.chunk_path(&c.digest).unwrap(), b, &c.digest);
        }
        let kept: Vec<bool> = refs
            .iter()
            .map(|c| s.chunk_path(&c.digest).unwrap().exists())
            .collect();
        assert_eq!(kept, [true, false, false, true, true]);
        assert_eq!(cache_usage(d.path()), 300);
        let m = read_metrics(d.path());
        assert_eq!((m.cache_bytes, m.cache_limit), (300, Some(350)));
        let snap = s.stats.snapshot();
        assert_eq!((snap.evictions, snap.evicted_bytes), (2, 200));
        // The counters survive a daemon restart through the stats file.
        let s = Arc::new(s);
        let rt = tokio::runtime::Handle::current();
        let stats = d.path().join(STATS_DIR).join("a.json");
        drop(s.persist_stats(stats.clone(), &rt));
        let s2 = Arc::new(ChunkStore::new(d.path(), None, FetchConfig::default()).unwrap());
        let _w = s2.persist_stats(stats, &rt);
        assert_eq!(s2.stats.snapshot().evictions, 2);
        assert_eq!(read_metrics(d.path()).stats.evictions, 2);
        set_cache_limit(d.path(), None).unwrap();
        assert_eq!(cache_limit(d.path()), None);
    }
}
