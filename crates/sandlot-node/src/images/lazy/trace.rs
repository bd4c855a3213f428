//! Prefetch traces: which chunks of a lazy layer were read in the first seconds after the
//! layer's first read on this node (the first sandbox's start), so that a later mount of the
//! layer (after a node restart, a remount, or once the disk cache has evicted its chunks)
//! fetches them ahead, several at a time, instead of one by one as the next sandbox reads
//! them. DSec and Nydus prefetch the same way.
//!
//! File `<images dir>/lazy/traces/<hex of the index digest>.json`:
//! `{"version": 1, "chunks": [[entry, chunk], …]}` — per chunk in the order first read, the
//! position of the file in the layer's index (`LazyIndex::entries`) and of the chunk in
//! that file's chunk list (the index is content-addressed, so positions never change
//! meaning). At most [`MAX_TRACE`] chunks. The first complete recording of a layer on a
//! node is kept (written to a temp file and renamed: never half-written); a mount that finds
//! one prefetches it and records nothing. A trace naming positions the index does not have
//! is skipped for those positions (it only ever costs fetches, never wrong bytes: every
//! chunk is checked against its digest as any read's is).
//!
//! `$SANDLOT_LAZY_TRACE_S` sets the recording window in seconds (default 10; `0` turns
//! traces off: nothing recorded, nothing prefetched).
use super::fetch::ChunkStore;
use super::format::{ChunkRef, LazyIndex};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Directory of the traces, relative to the image store.
pub const TRACES_DIR: &str = "lazy/traces";
/// Most chunks one trace holds (4 GiB of reads at 1 MiB chunks).
pub const MAX_TRACE: usize = 4096;
/// Chunks of a trace fetched at once when a mount prefetches it.
pub const PREFETCH_CONCURRENCY: usize = 8;

#[derive(serde::Serialize, serde::Deserialize)]
struct TraceFile {
    version: u32,
    chunks: Vec<(usize, usize)>,
}

/// The recording window (`$SANDLOT_LAZY_TRACE_S`, default 10 s; `None`: traces off).
pub fn window() -> Option<Duration> {
    let s: f64 = std::env::var("SANDLOT_LAZY_TRACE_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10.0);
    (s.is_finite() && s > 0.0).then(|| Duration::from_secs_f64(s.min(3600.0)))
}

/// Path of the trace of the layer whose index digest has hex `index_hex`.
pub fn path(images_dir: &Path, index_hex: &str) -> PathBuf {
    images_dir
        .join(TRACES_DIR)
        .join(format!("{index_hex}.json"))
}

/// The chunks of the trace at `path` as `index` has them, in trace order, without repeats;
/// empty when there is no readable trace.
pub fn load(path: &Path, index: &LazyIndex) -> Vec<ChunkRef> {
    let Ok(t) = std::fs::read(path)
        .map_err(|_| ())
        .and_then(|b| serde_json::from_slice::<TraceFile>(&b).map_err(|_| ()))
    else {
        return Vec::new();
    };
    let mut seen = HashSet::new();
    t.chunks
        .iter()
        .take(MAX_TRACE)
        .filter_map(|&(e, c)| index.entries.get(e)?.chunks.get(c))
        .filter(|c| seen.insert(c.digest.clone()))
        .cloned()
        .collect()
}

/// Fetch the chunks of `trace` that are not in the disk cache, [`PREFETCH_CONCURRENCY`] at
/// a time (those that are get `POSIX_FADV_WILLNEED`: the page cache warms up too); returns
/// how many were fetched or found. Failures are dropped: the real read reports them.
pub async fn prefetch(store: Arc<ChunkStore>, data_blob: String, trace: Vec<ChunkRef>) -> usize {
    use futures::StreamExt as _;
    let n = trace.len();
    futures::stream::iter(trace)
        .for_each_concurrent(PREFETCH_CONCURRENCY, |c| {
            let (store, blob) = (store.clone(), data_blob.clone());
            async move {
                if !store.advise(&c) {
                    store.prefetch(&blob, &c).await;
                }
            }
        })
        .await;
    n
}

/// Records the chunks read during the window that starts at the first read, then writes
/// them as the layer's trace (unless one exists by then).
pub struct Recorder {
    path: PathBuf,
    window: Duration,
    /// `None` once the window has ended.
    state: Mutex<Option<Recording>>,
}

#[derive(Default)]
struct Recording {
    started: bool,
    seen: HashSet<(usize, usize)>,
    chunks: Vec<(usize, usize)>,
}

impl Recorder {
    /// A recorder for the trace at `path` with a window of `window` ([`window`]), or
    /// `None` when the trace exists (then [`load`] it instead).
    pub fn new(path: PathBuf, window: Duration) -> Option<Arc<Recorder>> {
        if path.exists() {
            return None;
        }
        Some(Arc::new(Recorder {
            path,
            window,
            state: Mutex::new(Some(Recording::default())),
        }))
    }

    /// Note a read of chunks `chunks` of index entry `entry`. The first call starts the
    /// window on `rt`; after the window nothing is noted.
    pub fn read(
        self: &Arc<Self>,
        entry: usize,
        chunks: std::ops::RangeInclusive<usize>,
        rt: &tokio::runtime::Handle,
    ) {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(r) = g.as_mut() else {
            return;
        };
        if !r.started {
            r.started = true;
            let me = self.clone();
            rt.spawn(async move {
                tokio::time::sleep(me.window).await;
                let done = me.state.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(r) = done {
                    let path = me.path.clone();
                    let _ = tokio::task::spawn_blocking(move || write(&path, r.chunks)).await;
                }
            });
        }
        for c in chunks {
            if r.chunks.len() >= MAX_TRACE {
                break;
            }
            if r.seen.insert((entry, c)) {
                r.chunks.push((entry, c));
            }
        }
    }
}

/// Write `chunks` as the trace at `path` unless one exists (temp file + rename).
fn write(path: &Path, chunks: Vec<(usize, usize)>) {
    if chunks.is_empty() || path.exists() {
        return;
    }
    let r = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let body =
            serde_json::to_vec(&TraceFile { version: 1, chunks }).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, body)?;
        std::fs::rename(&tmp, path)
    })();
    match r {
        Ok(()) => tracing::info!(trace = %path.display(), "prefetch trace written"),
        Err(e) => tracing::warn!(trace = %path.display(), error = %e, "prefetch trace not written"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::lazy::format::{Entry, Kind};

    fn entry(path: &str, kind: Kind, chunks: &[(&str, u64)]) -> Entry {
        Entry {
            path: path.into(),
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 0,
            mtime_nsec: 0,
            size: chunks.len() as u64 * (1 << 20),
            target: None,
            opaque: false,
            chunks: chunks
                .iter()
                .map(|(d, o)| ChunkRef {
                    digest: format!("sha256:{d}"),
                    offset: *o << 20,
                    len: 1 << 20,
                })
                .collect(),
        }
    }

    fn index() -> LazyIndex {
        LazyIndex {
            version: 1,
            chunk_size: 1 << 20,
            data_digest: "sha256:data".into(),
            data_size: 3 << 20,
            diff_id: None,
            files_bytes: 4 << 20,
            entries: vec![
                entry("", Kind::Dir, &[]),
                entry("a", Kind::File, &[("a0", 0), ("a1", 1)]),
                // Same content as a's first chunk: fetched once.
                entry("b", Kind::File, &[("a0", 0), ("b1", 2)]),
            ],
        }
    }

    /// A recording keeps the first read order without repeats, is written once its window
    /// ends (never over an existing trace), and loads back as the index's chunks without
    /// repeated digests and without positions the index does not have.
    #[tokio::test]
    async fn a_recording_is_written_after_its_window_and_loads_as_chunks() {
        let d = tempfile::tempdir().unwrap();
        let p = path(d.path(), "abc");
        let rt = tokio::runtime::Handle::current();
        let w = Duration::from_millis(200);
        let rec = Recorder::new(p.clone(), w).expect("no trace yet");
        rec.read(2, 0..=1, &rt);
        rec.read(1, 0..=0, &rt);
        rec.read(2, 1..=1, &rt);
        assert!(!p.exists(), "written before the window ended");
        tokio::time::sleep(Duration::from_millis(700)).await;
        rec.read(1, 1..=1, &rt); // after the window: not noted
        let t: TraceFile = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(t.chunks, [(2, 0), (2, 1), (1, 0)]);
        assert!(
            Recorder::new(p.clone(), w).is_none(),
            "a trace exists: nothing to record"
        );

        std::fs::write(
            &p,
            br#"{"version": 1, "chunks": [[2, 0], [2, 1], [1, 0], [9, 0], [1, 7], [1, 1]]}"#,
        )
        .unwrap();
        let got: Vec<String> = load(&p, &index()).into_iter().map(|c| c.digest).collect();
        assert_eq!(got, ["sha256:a0", "sha256:b1", "sha256:a1"]);
        std::fs::write(&p, b"not json").unwrap();
        assert!(load(&p, &index()).is_empty());
    }
}
