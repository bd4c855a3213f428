//! [`DirLock`]: one process per data directory and role (issue 25).
//!
//! The lock is `flock(2)` with `LOCK_EX | LOCK_NB` on a file in the directory
//! ([`NODE_LOCK`] for a [`crate::LocalNode`], [`SERVER_LOCK`] for a server's SQLite store);
//! the holder writes its pid there, read back only for the message of a refused process. The
//! kernel drops the lock when the holder's descriptor closes, also at `kill -9`, so a start
//! after a crash takes it at once; a start beside a live holder waits (a predecessor still
//! stopping after SIGTERM), then fails with [`DirLockError::Held`].
//!
//! The descriptor is `O_CLOEXEC` (std's `File`): a child that execs (runc, QEMU,
//! `sandlot-guest`, the lazy-image mount daemons, which outlive the node) does not inherit
//! it, so no child keeps the lock after the node dies. The node starts children only by
//! `fork` + `exec` (std `Command`, `posix_spawn`); nothing forks without exec.
//!
//! The file is never removed: a waiter could lock the unlinked inode while a newcomer
//! creates and locks a new one, and both would run.
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Lock file of a node's data directory (`sandlot up`, `sandlot node`).
pub const NODE_LOCK: &str = "node.lock";
/// Lock file of a server's data directory when its store is SQLite there (`sandlot up`,
/// `sandlot server` without `--postgres`).
pub const SERVER_LOCK: &str = "server.lock";
/// How long a start waits for a holder to go by default: a predecessor that got SIGTERM
/// may still be finishing its in-flight requests and stopping its warm pools.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);
/// Pause between two tries while waiting.
const RETRY: Duration = Duration::from_millis(100);

/// Why [`DirLock::acquire`] failed.
#[derive(Debug, thiserror::Error)]
pub enum DirLockError {
    /// Another process held the lock for the whole wait.
    #[error(
        "data directory {} is in use by another sandlot process ({} holds {}; waited \
         {:.1?}): one {role} per data directory, stop that process first or give this one \
         another --data-dir",
        dir.display(),
        pid.map_or_else(|| "pid unknown".to_owned(), |p| format!("pid {p}")),
        path.display(),
        waited
    )]
    Held {
        /// The data directory.
        dir: PathBuf,
        /// The lock file.
        path: PathBuf,
        /// What holds it: `node` or `server`.
        role: &'static str,
        /// The holder's pid, as it wrote it (`None` when the file holds none yet).
        pid: Option<u32>,
        /// How long this process waited.
        waited: Duration,
    },
    /// The lock file cannot be opened, locked or written.
    #[error("lock file {}", path.display())]
    Io {
        /// The lock file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// An exclusive lock on a data directory, held until dropped (or the process ends).
#[derive(Debug)]
pub struct DirLock {
    _file: Flock<File>,
    path: PathBuf,
}

impl DirLock {
    /// Lock `dir/name` (created when missing; `dir` must exist), trying again every 100 ms
    /// for up to `wait` while another process holds it; then write this process's pid
    /// into it (`<pid>\n`). `role` (`node`, `server`) names the holder in the error.
    /// Blocking: up to `wait`.
    ///
    /// # Errors
    /// [`DirLockError::Held`] when another open file description (another process, or
    /// another `DirLock` in this one) still holds the lock after `wait`;
    /// [`DirLockError::Io`] when the file cannot be opened, locked or written.
    pub fn acquire(
        dir: &Path,
        name: &str,
        role: &'static str,
        wait: Duration,
    ) -> Result<DirLock, DirLockError> {
        let path = dir.join(name);
        let io = |source| DirLockError::Io {
            path: path.clone(),
            source,
        };
        // O_CLOEXEC: std opens every file with it (see the module docs).
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let start = Instant::now();
        let mut logged = false;
        let lock = loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => break lock,
                Err((f, Errno::EINTR)) => file = f,
                Err((f, Errno::EWOULDBLOCK)) => {
                    file = f;
                    let waited = start.elapsed();
                    let pid = holder_pid(&path);
                    if waited >= wait {
                        return Err(DirLockError::Held {
                            dir: dir.to_path_buf(),
                            path,
                            role,
                            pid,
                            waited,
                        });
                    }
                    if !logged {
                        logged = true;
                        tracing::warn!(lock = %path.display(), ?pid, ?wait, "data directory in use by another process; waiting for it to stop");
                    }
                    std::thread::sleep(RETRY.min(wait - waited));
                }
                Err((_, e)) => return Err(io(std::io::Error::from(e))),
            }
        };
        // The pid is for the message of a refused start only: a full data dir (ENOSPC)
        // must not stop this one (a node starts on a full disk and refuses creates).
        if let Err(e) = write_pid(&lock) {
            tracing::warn!(lock = %path.display(), error = %e, "pid not written into the lock file");
        }
        Ok(DirLock { _file: lock, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Replaces the content of `f` with this process's pid (`<pid>\n`).
fn write_pid(mut f: &File) -> std::io::Result<()> {
    f.set_len(0)?;
    f.write_all(format!("{}\n", std::process::id()).as_bytes())
}

/// The pid the holder of `path` wrote, if it wrote one yet.
fn holder_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_waits_then_fails_naming_the_pid() {
        let tmp = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(tmp.path(), NODE_LOCK, "node", Duration::ZERO).unwrap();
        let written = std::fs::read_to_string(first.path()).unwrap();
        assert_eq!(written, format!("{}\n", std::process::id()));
        // flock locks belong to the open file description: a second open conflicts, also
        // in this process.
        let t0 = Instant::now();
        let err = DirLock::acquire(tmp.path(), NODE_LOCK, "node", Duration::from_millis(300))
            .unwrap_err();
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t0.elapsed()
        );
        let DirLockError::Held { pid, .. } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(*pid, Some(std::process::id()));
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id()))
                && msg.contains(&tmp.path().display().to_string())
                && msg.contains("one node per data directory"),
            "{msg}"
        );
        // The other role's lock is another file.
        DirLock::acquire(tmp.path(), SERVER_LOCK, "server", Duration::ZERO).unwrap();
        // Released on drop; the file stays.
        drop(first);
        DirLock::acquire(tmp.path(), NODE_LOCK, "node", Duration::ZERO).unwrap();
        assert!(tmp.path().join(NODE_LOCK).exists());
    }

    #[test]
    fn a_waiter_gets_the_lock_once_the_holder_lets_go() {
        let tmp = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(tmp.path(), NODE_LOCK, "node", Duration::ZERO).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(first);
        });
        let t0 = Instant::now();
        DirLock::acquire(tmp.path(), NODE_LOCK, "node", Duration::from_secs(10)).unwrap();
        let took = t0.elapsed();
        release.join().unwrap();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(5),
            "{took:?}"
        );
    }

    #[test]
    fn missing_dir_is_an_io_error_with_the_path() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("absent");
        let err = DirLock::acquire(&dir, NODE_LOCK, "node", Duration::ZERO).unwrap_err();
        assert!(matches!(err, DirLockError::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("absent/node.lock"), "{err}");
    }
}
