//! Running the OCI runtime's CLI (`runc`, `crun`, `runsc`; spec: the OCI runtime
//! specification's "Runtime and Lifecycle" and runc's `man/runc-*.8.md` for the commands
//! and exit statuses) and its failures as [`RuntimeError`].
use crate::node::NodeError;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// Failures of an OCI runtime call. The program or the container id is named; an I/O
/// failure to start the program is the [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The runtime binary could not be started.
    #[error("run {program}")]
    Spawn {
        /// The binary.
        program: String,
        /// The I/O error of `fork`/`execve`.
        #[source]
        source: std::io::Error,
    },
    /// The runtime did not exit in time (it was killed).
    #[error("{program} did not finish in {timeout:?}")]
    Timeout {
        /// The binary.
        program: String,
        /// The limit.
        timeout: Duration,
    },
    /// The runtime exited with a failure status; `log` is the end of its output.
    #[error("{runtime} {verb} {id}: {status}; {log}")]
    Failed {
        /// `runc`, `crun` or `runsc`.
        runtime: &'static str,
        /// The command (`run`, `delete`, …).
        verb: &'static str,
        /// The container id.
        id: String,
        /// Its exit status.
        status: ExitStatus,
        /// The last 2000 bytes of its log.
        log: String,
    },
    /// The runtime succeeded but left no readable pid file.
    #[error("{runtime}: no pid file {}", path.display())]
    NoPidFile {
        /// `runc`, `crun` or `runsc`.
        runtime: &'static str,
        /// The `--pid-file` given.
        path: PathBuf,
    },
    /// The container's init was gone right after a successful start.
    #[error("container {id} died at start; {log}")]
    DiedAtStart {
        /// The container id.
        id: String,
        /// The last 2000 bytes of the agent's log.
        log: String,
    },
}

/// Every runtime failure is the node's `Internal`: the message as context, a failure to
/// start the binary as source.
impl From<RuntimeError> for NodeError {
    fn from(e: RuntimeError) -> Self {
        let context = e.to_string();
        match e {
            RuntimeError::Spawn { source, .. } => {
                NodeError::internal(context, Some(Box::new(source)))
            }
            _ => NodeError::internal(context, None),
        }
    }
}

/// Runs `cmd` (whose stdio the caller set: never pipes, which a container would inherit
/// and hold open) to its end, killing it at `timeout`.
///
/// # Errors
/// [`RuntimeError::Spawn`], [`RuntimeError::Timeout`].
pub(super) async fn run_with_timeout(
    cmd: std::process::Command,
    timeout: Duration,
) -> Result<ExitStatus, RuntimeError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    match tokio::time::timeout(timeout, cmd.status()).await {
        Ok(r) => r.map_err(|source| RuntimeError::Spawn { program, source }),
        Err(_) => Err(RuntimeError::Timeout { program, timeout }),
    }
}

/// The last `n` bytes of `s` (from a char boundary), trimmed.
pub(super) fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_binary_and_a_slow_one_are_typed_with_the_program() {
        let e = run_with_timeout(
            std::process::Command::new("/nonexistent/runc"),
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&e, RuntimeError::Spawn { program, source }
                if program == "/nonexistent/runc" && source.kind() == std::io::ErrorKind::NotFound),
            "{e:?}"
        );
        let node = NodeError::from(e);
        assert_eq!(
            sandlot_node_api::chain(&node),
            "run /nonexistent/runc: No such file or directory (os error 2)"
        );
        let mut sleep = std::process::Command::new("sleep");
        sleep.arg("5");
        let e = run_with_timeout(sleep, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, RuntimeError::Timeout { .. }), "{e:?}");
        assert_eq!(e.to_string(), "sleep did not finish in 50ms");
    }

    #[test]
    fn tail_cuts_on_a_char_boundary() {
        assert_eq!(tail("ab\u{e9}cd ", 3), "cd");
        assert_eq!(tail("\u{e9}x", 2), "x");
    }
}
