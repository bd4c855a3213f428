//! Test support: local etcd members for the cluster tests of every crate.
//!
//! The members are started by the project's `scripts/etcd.sh` (Debian's etcd-server, which
//! `scripts/setup.sh` installs) under a temporary directory and stopped when the handle is
//! dropped. Real etcd, not a fake: only the starting and stopping are shared here.
use std::path::{Path, PathBuf};
use std::process::Command;

/// Local etcd members under a temporary directory; stopped (SIGTERM, then SIGKILL after
/// 10 s) on drop.
pub struct LocalEtcd {
    dir: tempfile::TempDir,
    /// Client URLs of the members, `http://127.0.0.1:PORT`, in member order.
    pub urls: Vec<String>,
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/etcd.sh")
}

fn etcd_sh(args: &[&str]) -> String {
    let out = Command::new(script())
        .args(args)
        .output()
        .expect("run scripts/etcd.sh");
    assert!(
        out.status.success(),
        "etcd.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("etcd.sh prints UTF-8")
}

impl LocalEtcd {
    /// Start `members` members and wait until each is healthy. `None`, after printing
    /// `SKIPPED: {test}: …` (the test then counts as skipped), when `etcd` is not installed.
    ///
    /// # Panics
    /// When `scripts/etcd.sh start` fails or prints fewer URLs than `members`.
    pub fn start(test: &str, members: usize) -> Option<LocalEtcd> {
        let found = Command::new("sh")
            .args(["-c", "command -v etcd"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            println!(
                "SKIPPED: {test}: `etcd` not installed (Debian etcd-server; scripts/setup.sh installs it)"
            );
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path().to_str().expect("UTF-8 temp dir").to_owned();
        let out = etcd_sh(&["start", &d, &members.to_string()]);
        let urls: Vec<String> = out
            .lines()
            .filter_map(|l| l.strip_prefix("etcd ").map(str::to_owned))
            .collect();
        assert_eq!(urls.len(), members, "etcd.sh start: {out}");
        Some(LocalEtcd { dir, urls })
    }

    /// Run `scripts/etcd.sh VERB DIR I` on member `i`: `stop-member`, `start-member`,
    /// `pause-member` (SIGSTOP: connections stay open, nothing answers), `resume-member`.
    ///
    /// # Panics
    /// When the script fails.
    pub fn member(&self, verb: &str, i: usize) {
        etcd_sh(&[verb, self.dir().to_str().expect("UTF-8"), &i.to_string()]);
    }

    /// The directory holding the members' data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .args(["stop", self.dir().to_str().unwrap_or_default()])
            .output();
    }
}
