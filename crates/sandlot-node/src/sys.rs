//! Host helpers shared by the backends and the node's other modules: running blocking work
//! off the async runtime (`spawn_blocking`) and a process's start time
//! ([`proc_starttime`]), which together with its pid names one process for good (a pid is
//! reused, a (pid, start time) pair is not).
use crate::node::{NodeError, NodeResult};

/// Start time of `pid` (field 22 of `/proc/PID/stat`, clock ticks since boot; proc(5)),
/// `None` when there is no such process or it is a zombie.
pub fn proc_starttime(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may contain spaces and ')': fields after the last ')' start at 3.
    let rest = &s[s.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.first() == Some(&"Z") || fields.first() == Some(&"X") {
        return None;
    }
    fields.get(22 - 3)?.parse().ok()
}

/// Runs the blocking `f` (file system work, cgroup writes, `/proc` reads, child processes)
/// on tokio's blocking thread pool and awaits its result, so no async worker waits on it.
///
/// # Errors
/// `f`'s error; `Internal` ("blocking task") when the task panicked or was cancelled.
pub(crate) async fn spawn_blocking<T: Send + 'static>(
    f: impl FnOnce() -> NodeResult<T> + Send + 'static,
) -> NodeResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| NodeError::io("blocking task", std::io::Error::other(e.to_string())))?
}

/// The first executable file `name` found in `PATH` or the usual system directories
/// (`/usr/local/sbin`, `/usr/local/bin`, `/usr/sbin`, `/usr/bin`, `/sbin`).
pub fn find_binary(name: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain([
            "/usr/local/sbin",
            "/usr/local/bin",
            "/usr/sbin",
            "/usr/bin",
            "/sbin",
        ])
        .filter(|d| !d.is_empty())
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| {
            std::fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        });
    found
}
