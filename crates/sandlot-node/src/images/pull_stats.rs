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
//! reader without the lock sees one whole version. A failure to update only logs: counting
//! never fails a pull.
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

/// Read the counters of image store `images_dir`; all zero when the file is missing or
/// unreadable (a corrupt file is counted from zero again by the next pull).
pub fn read(images_dir: &Path) -> PullStats {
    fs::read(images_dir.join(STATS_DIR).join(FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Count one pull of `mode` with `outcome` that downloaded `bytes` of blobs into the store
/// at `images_dir`. Blocking file I/O of a few hundred bytes under a lock held for as long;
/// failures are logged, never returned.
pub fn record(images_dir: &Path, mode: PullMode, outcome: &str, bytes: u64) {
    if let Err(e) = update(images_dir, mode, outcome, bytes) {
        tracing::warn!(dir = %images_dir.display(), error = %e, "cannot count an image pull");
    }
}

fn update(images_dir: &Path, mode: PullMode, outcome: &str, bytes: u64) -> std::io::Result<()> {
    let dir = images_dir.join(STATS_DIR);
    fs::create_dir_all(&dir)?;
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK))?;
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| std::io::Error::from(e))?;
    let mut s = read(images_dir);
    s.version = 1;
    *s.pulls
        .entry(mode.as_str().into())
        .or_default()
        .entry(outcome.into())
        .or_default() += 1;
    *s.blob_bytes.entry(mode.as_str().into()).or_default() += bytes;
    let tmp = dir.join(format!("{FILE}.tmp{}", std::process::id()));
    let mut f = fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(&s).map_err(std::io::Error::other)?)?;
    drop(f);
    fs::rename(&tmp, dir.join(FILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulls_add_up_across_writers_and_a_bad_file_starts_from_zero() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read(d.path()), PullStats::default());
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let p = d.path().to_path_buf();
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        record(&p, PullMode::Eager, if i == 0 { "error" } else { "ok" }, 10);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        record(d.path(), PullMode::Lazy, "not_found", 0);
        let s = read(d.path());
        assert_eq!(s.version, 1);
        assert_eq!(s.pulls["eager"]["ok"], 75);
        assert_eq!(s.pulls["eager"]["error"], 25);
        assert_eq!(s.pulls["lazy"]["not_found"], 1);
        assert_eq!(s.blob_bytes["eager"], 1000);
        assert_eq!(s.blob_bytes["lazy"], 0);
        fs::write(d.path().join(STATS_DIR).join(FILE), b"{not json").unwrap();
        assert_eq!(read(d.path()), PullStats::default());
        record(d.path(), PullMode::Eager, "ok", 1);
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
