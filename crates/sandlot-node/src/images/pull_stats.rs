//! Counters of image pulls, kept in the image store so that every process that pulls into
//! it (the node on a create's first use, `sandlot image pull`) adds to the same figures;
//! the server reads them at scrape (`sandlot_image_pulls_total`,
//! `sandlot_image_pull_bytes_total`, docs/api.md "Metrics").
//!
//! File: `<images>/stats/pulls.json`, `{"version": 1, "pulls": {MODE: {OUTCOME: n}},
//! "blob_bytes": {MODE: n}}` with MODE `eager` (the whole image, [`ImageStore::pull`]) or
//! `lazy` (manifest, config and chunk index only, [`ImageStore::pull_lazy`]; the chunks a
//! lazy image reads later are `sandlot_image_bytes_fetched_total`) and OUTCOME `ok`,
//! `not_found` (the registry has no such image or lazy form: a create's probe for a lazy
//! form ends so when there is none) or `error`. `blob_bytes` counts the bytes of blobs
//! downloaded from a registry (blobs already in the store are not fetched, so not counted;
//! a failed pull counts what it downloaded). Updated under an exclusive `flock` of
//! `<images>/stats/pulls.lock` by writing a temp file and renaming it over the old one, so a
//! reader without the lock sees one whole version. Counting never fails nor stalls a pull:
//! it runs on a blocking thread, gives up (logged) when the lock stays taken for
//! [`LOCK_WAIT`], and any other failure only logs. A file that is not a regular file of at
//! most [`MAX_FILE_BYTES`], or not this format, reads as all zero (the next pull starts it
//! again); counters saturate at `u64::MAX`.
//!
//! [`ImageStore::pull`]: super::ImageStore::pull
//! [`ImageStore::pull_lazy`]: super::ImageStore::pull_lazy
use crate::node::{NodeError, NodeResult};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::path::Path;

/// Directory of the pull counters, relative to the image store.
pub const STATS_DIR: &str = "stats";
const FILE: &str = "pulls.json";
const LOCK: &str = "pulls.lock";
/// How long a pull waits for the counters' lock before it leaves its count out.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// Largest counters file read (the real one is under 1 KiB).
pub const MAX_FILE_BYTES: u64 = 64 * 1024;
/// The modes and outcomes counted: the only keys [`read`] keeps (the metric's labels).
pub const MODES: [&str; 2] = ["eager", "lazy"];
/// See [`MODES`].
pub const OUTCOMES: [&str; 3] = ["ok", "not_found", "error"];

/// What a pull fetched: the whole image or its lazy form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullMode {
    /// Every blob ([`ImageStore::pull`](super::ImageStore::pull)).
    Eager,
    /// Manifest, config and chunk index ([`ImageStore::pull_lazy`](super::ImageStore::pull_lazy)).
    Lazy,
}

impl PullMode {
    /// `eager` or `lazy`: the file's key and the metric's `mode` label.
    pub fn as_str(self) -> &'static str {
        match self {
            PullMode::Eager => "eager",
            PullMode::Lazy => "lazy",
        }
    }
}

/// The counters of `<images>/stats/pulls.json` (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PullStats {
    /// Format version, 1.
    #[serde(default)]
    pub version: u32,
    /// Pulls by mode (`eager`, `lazy`), then outcome (`ok`, `not_found`, `error`).
    #[serde(default)]
    pub pulls: BTreeMap<String, BTreeMap<String, u64>>,
    /// Bytes of blobs downloaded from registries, by mode.
    #[serde(default)]
    pub blob_bytes: BTreeMap<String, u64>,
}

/// The metric's `outcome` label of a pull's result.
pub fn outcome<T>(r: &NodeResult<T>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(NodeError::NotFound(_)) => "not_found",
        Err(_) => "error",
    }
}

/// Read the counters of image store `images_dir` (blocking: a small regular file); all zero
/// when the file is missing, not a regular file, over [`MAX_FILE_BYTES`] or not this
/// format. Keys other than [`MODES`] and [`OUTCOMES`] are dropped.
pub fn read(images_dir: &Path) -> PullStats {
    let path = images_dir.join(STATS_DIR).join(FILE);
    // Checked before the open: opening a FIFO would block.
    let Ok(m) = fs::symlink_metadata(&path) else {
        return PullStats::default();
    };
    if !m.is_file() || m.len() > MAX_FILE_BYTES {
        return PullStats::default();
    }
    let mut s: PullStats = fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    s.pulls.retain(|m, _| MODES.contains(&m.as_str()));
    for o in s.pulls.values_mut() {
        o.retain(|k, _| OUTCOMES.contains(&k.as_str()));
    }
    s.blob_bytes.retain(|m, _| MODES.contains(&m.as_str()));
    s
}

/// Count one pull of `mode` with `outcome` (one of [`OUTCOMES`]) that downloaded `bytes`
/// of blobs into the store at `images_dir`, on a blocking thread; returns when it is
/// written or given up (at most about [`LOCK_WAIT`]). Failures are logged, never returned.
pub async fn record(images_dir: &Path, mode: PullMode, outcome: &'static str, bytes: u64) {
    let dir = images_dir.to_path_buf();
    let r = tokio::task::spawn_blocking(move || update(&dir, mode, outcome, bytes))
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r);
    if let Err(e) = r {
        tracing::warn!(dir = %images_dir.display(), error = %e, "cannot count an image pull");
    }
}

fn update(images_dir: &Path, mode: PullMode, outcome: &str, bytes: u64) -> std::io::Result<()> {
    let dir = images_dir.join(STATS_DIR);
    fs::create_dir_all(&dir)?;
    let mut lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK))?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    let _lock = loop {
        match nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(l) => break l,
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if std::time::Instant::now() < deadline => {
                lock = f;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err((_, e)) => {
                return Err(std::io::Error::other(format!(
                    "lock {}: {e}",
                    dir.join(LOCK).display()
                )))
            }
        }
    };
    let mut s = read(images_dir);
    s.version = 1;
    let n = s
        .pulls
        .entry(mode.as_str().into())
        .or_default()
        .entry(outcome.into())
        .or_default();
    *n = n.saturating_add(1);
    let b = s.blob_bytes.entry(mode.as_str().into()).or_default();
    *b = b.saturating_add(bytes);
    let tmp = dir.join(format!("{FILE}.tmp{}", std::process::id()));
    let mut f = fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(&s).map_err(std::io::Error::other)?)?;
    drop(f);
    fs::rename(&tmp, dir.join(FILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record_now(dir: &Path, mode: PullMode, outcome: &str, bytes: u64) {
        update(dir, mode, outcome, bytes).unwrap();
    }

    #[test]
    fn pulls_add_up_across_writers_and_a_bad_file_starts_from_zero() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read(d.path()), PullStats::default());
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let p = d.path().to_path_buf();
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        record_now(&p, PullMode::Eager, if i == 0 { "error" } else { "ok" }, 10);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        record_now(d.path(), PullMode::Lazy, "not_found", 0);
        let s = read(d.path());
        assert_eq!(s.version, 1);
        assert_eq!(s.pulls["eager"]["ok"], 75);
        assert_eq!(s.pulls["eager"]["error"], 25);
        assert_eq!(s.pulls["lazy"]["not_found"], 1);
        assert_eq!(s.blob_bytes["eager"], 1000);
        assert_eq!(s.blob_bytes["lazy"], 0);
        fs::write(d.path().join(STATS_DIR).join(FILE), b"{not json").unwrap();
        assert_eq!(read(d.path()), PullStats::default());
        record_now(d.path(), PullMode::Eager, "ok", 1);
        assert_eq!(read(d.path()).pulls["eager"]["ok"], 1);
        // Unknown keys (label values the metrics would carry) are dropped; counts saturate.
        let path = d.path().join(STATS_DIR).join(FILE);
        fs::write(
            &path,
            r#"{"version":1,"pulls":{"eager":{"ok":18446744073709551615,"x\"}":1},"evil\"":{"ok":1}},"blob_bytes":{"y":1}}"#,
        )
        .unwrap();
        let s = read(d.path());
        assert_eq!(s.pulls.len(), 1);
        assert_eq!(s.pulls["eager"].len(), 1);
        assert!(s.blob_bytes.is_empty());
        record_now(d.path(), PullMode::Eager, "ok", 5);
        assert_eq!(read(d.path()).pulls["eager"]["ok"], u64::MAX);
        // Not a regular file (a FIFO would block an open), or too large: zero, at once.
        fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(read(d.path()), PullStats::default());
        fs::remove_file(&path).unwrap();
        fs::write(&path, vec![b' '; MAX_FILE_BYTES as usize + 1]).unwrap();
        assert_eq!(read(d.path()), PullStats::default());
    }

    #[tokio::test]
    async fn a_held_lock_delays_a_count_by_at_most_the_wait_and_loses_only_it() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join(STATS_DIR)).unwrap();
        let f = fs::File::create(d.path().join(STATS_DIR).join(LOCK)).unwrap();
        let held = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).unwrap();
        let t = std::time::Instant::now();
        record(d.path(), PullMode::Eager, "ok", 1).await;
        assert!(
            t.elapsed() >= LOCK_WAIT && t.elapsed() < LOCK_WAIT * 3,
            "{:?}",
            t.elapsed()
        );
        assert_eq!(read(d.path()), PullStats::default());
        drop(held);
        record(d.path(), PullMode::Eager, "ok", 1).await;
        assert_eq!(read(d.path()).pulls["eager"]["ok"], 1);
    }

    #[test]
    fn outcomes_follow_the_error_kind() {
        assert_eq!(outcome(&Ok::<(), NodeError>(())), "ok");
        assert_eq!(
            outcome::<()>(&Err(NodeError::NotFound("x".into()))),
            "not_found"
        );
        assert_eq!(
            outcome::<()>(&Err(NodeError::Unavailable("x".into()))),
            "error"
        );
    }
}
