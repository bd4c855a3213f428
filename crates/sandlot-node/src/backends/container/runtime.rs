//! Running the OCI runtime's CLI (`runc`, `crun`, `runsc`; spec: the OCI runtime
//! specification's "Runtime and Lifecycle" and runc's `man/runc-*.8.md` for the commands
//! and exit statuses) and its failures as [`RuntimeError`].
//!
//! The backend issues two commands, through the [`OciRuntimeCli`] trait:
//!
//! * `run --detach --bundle DIR --pid-file DIR/init.pid [--preserve-fds 1] ID` — create and
//!   start in one step ([`RunRequest`]); the runtime's output goes to the agent log;
//! * `delete --force ID` — kill and forget a container (any state; an unknown id is the
//!   runtime's failure, which the caller ignores).
//!
//! Both carry the global flags of [`HostRuntime::command`]: `--root DATA/runtime/<name>`,
//! and for runsc `--platform=systrap --network=none --ignore-cgroups --overlay2=none
//! --file-access=shared --host-uds=create`. [`HostRuntime`] runs the binaries; unit tests
//! use a recording fake, so the backend's start and clean-up logic (pid file, died-at-start,
//! which runtime deletes which id) is tested without root.
use super::Runtime;
use crate::node::NodeError;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

/// How long one runtime command (`run --detach`, `delete --force`) may take.
pub(super) const RUNTIME_TIMEOUT: Duration = Duration::from_secs(60);

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

/// One `run --detach` of container `id` from bundle `bundle`.
#[derive(Debug)]
pub(crate) struct RunRequest<'a> {
    /// Which runtime.
    pub(crate) runtime: Runtime,
    /// Its binary.
    pub(crate) bin: &'a Path,
    /// The container id (the runtime's name for it).
    pub(crate) id: &'a str,
    /// The OCI bundle (`config.json`, `rootfs/`).
    pub(crate) bundle: &'a Path,
    /// Where the runtime writes the container init's host pid (`--pid-file`).
    pub(crate) pid_file: &'a Path,
    /// Global flags after the runtime's own (runsc: the debug log, `--network=host`).
    pub(crate) flags: Vec<OsString>,
    /// A listening socket handed to the container as its fd 3 (`--preserve-fds 1`).
    pub(crate) listen_fd: Option<BorrowedFd<'a>>,
    /// `cgroup.procs` files the runtime process writes itself into before `execve`
    /// (runsc, which runs with `--ignore-cgroups`: its sandbox and gofer are its children).
    pub(crate) join_procs: Vec<PathBuf>,
    /// The runtime's stdout and stderr (the agent log, opened for appending).
    pub(crate) log: std::fs::File,
    /// That log's path: its last 2000 bytes go into [`RuntimeError::Failed`].
    pub(crate) log_path: &'a Path,
}

/// The OCI runtime commands the container backend issues (see the module docs).
#[async_trait::async_trait]
pub(crate) trait OciRuntimeCli: std::fmt::Debug + Send + Sync {
    /// `run --detach`: create and start the container; returns when the runtime exited
    /// (the container keeps running), within [`RUNTIME_TIMEOUT`].
    ///
    /// # Errors
    /// [`RuntimeError::Spawn`], [`RuntimeError::Timeout`], [`RuntimeError::Failed`] (a
    /// failure status, with the end of the log).
    async fn run(&self, req: RunRequest<'_>) -> Result<(), RuntimeError>;

    /// `delete --force id`: kill the container's processes and remove the runtime's state
    /// of it, within [`RUNTIME_TIMEOUT`]. Output is discarded.
    ///
    /// # Errors
    /// [`RuntimeError::Spawn`], [`RuntimeError::Timeout`], [`RuntimeError::Failed`] (also
    /// when the runtime knows no container `id`; an empty log).
    async fn delete_force(
        &self,
        runtime: Runtime,
        bin: &Path,
        id: &str,
    ) -> Result<(), RuntimeError>;
}

/// [`OciRuntimeCli`] running the runtimes' binaries, each with its state under
/// `state_root/<name>`.
#[derive(Debug, Clone)]
pub(crate) struct HostRuntime {
    state_root: PathBuf,
}

impl HostRuntime {
    /// Runtimes keeping their state under `state_root` (`DATA/runtime`).
    pub(crate) fn new(state_root: PathBuf) -> Self {
        HostRuntime { state_root }
    }

    /// `bin` with runtime `r`'s global flags; stdin is `/dev/null`.
    pub(crate) fn command(&self, r: Runtime, bin: &Path) -> std::process::Command {
        let mut cmd = std::process::Command::new(bin);
        cmd.arg("--root").arg(self.state_root.join(r.name()));
        if r == Runtime::Runsc {
            // systrap: no KVM needed; the node owns networking (none) and cgroups; writes go
            // to the host overlay (so the disk quota and accounting see them).
            cmd.args([
                "--platform=systrap",
                "--network=none",
                "--ignore-cgroups",
                "--overlay2=none",
                // No caching that assumes exclusive access to the host overlay. The files
                // API now goes through the agent (inside gVisor); kept until measured
                // without it.
                "--file-access=shared",
                // The agent binds its socket in a host directory (see `agent_socket`).
                "--host-uds=create",
            ]);
        }
        cmd.stdin(Stdio::null());
        cmd
    }

    /// The whole `run --detach` command of `req`: argv, the log as stdout and stderr, and
    /// (in the child, before `execve`) the listening socket on fd 3 and the cgroup joins.
    ///
    /// # Errors
    /// Duplicating the log's descriptor.
    pub(crate) fn run_command(
        &self,
        req: &RunRequest<'_>,
    ) -> std::io::Result<std::process::Command> {
        let mut cmd = self.command(req.runtime, req.bin);
        cmd.args(&req.flags)
            .arg("run")
            .arg("--detach")
            .arg("--bundle")
            .arg(req.bundle)
            .arg("--pid-file")
            .arg(req.pid_file)
            // The listening socket as the container's fd 3.
            .args(
                req.listen_fd
                    .map(|_| ["--preserve-fds", "1"])
                    .into_iter()
                    .flatten(),
            )
            .arg(req.id)
            .stdout(req.log.try_clone()?)
            .stderr(req.log.try_clone()?);
        let lfd = req.listen_fd.map(|l| l.as_raw_fd());
        let procs: Vec<std::ffi::CString> = req
            .join_procs
            .iter()
            .map(|p| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()))
            .collect::<Result<_, _>>()?;
        // SAFETY: runs in the forked child before execve; only async-signal-safe calls
        // (dup2, open, write, close) on data prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(lfd) = lfd {
                    if libc::dup2(lfd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                    libc::close(fd);
                    if !ok {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// The `delete --force id` command; its output is discarded.
    pub(crate) fn delete_command(&self, r: Runtime, bin: &Path, id: &str) -> std::process::Command {
        let mut cmd = self.command(r, bin);
        cmd.args(["delete", "--force", id])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }
}

#[async_trait::async_trait]
impl OciRuntimeCli for HostRuntime {
    async fn run(&self, req: RunRequest<'_>) -> Result<(), RuntimeError> {
        let cmd = self
            .run_command(&req)
            .map_err(|source| RuntimeError::Spawn {
                program: req.bin.display().to_string(),
                source,
            })?;
        // The command holds the log's duplicates until it is dropped (after the wait).
        let status = run_with_timeout(cmd, RUNTIME_TIMEOUT).await?;
        if status.success() {
            return Ok(());
        }
        let log = std::fs::read_to_string(req.log_path).unwrap_or_default();
        Err(RuntimeError::Failed {
            runtime: req.runtime.name(),
            verb: "run",
            id: req.id.to_string(),
            status,
            log: tail(&log, 2000).to_string(),
        })
    }

    async fn delete_force(
        &self,
        runtime: Runtime,
        bin: &Path,
        id: &str,
    ) -> Result<(), RuntimeError> {
        let status =
            run_with_timeout(self.delete_command(runtime, bin, id), RUNTIME_TIMEOUT).await?;
        if status.success() {
            return Ok(());
        }
        Err(RuntimeError::Failed {
            runtime: runtime.name(),
            verb: "delete",
            id: id.to_string(),
            status,
            log: String::new(),
        })
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

/// A recording fake of [`OciRuntimeCli`] (unit tests only).
#[cfg(test)]
pub(crate) mod fake {
    use super::*;
    use std::collections::VecDeque;
    use std::io::Write as _;
    use std::os::unix::process::ExitStatusExt as _;
    use std::sync::{Arc, Mutex};

    /// One command the fake saw, with the arguments that matter.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) enum Call {
        /// `run --detach`.
        Run {
            runtime: Runtime,
            id: String,
            bundle: PathBuf,
            pid_file: PathBuf,
            flags: Vec<OsString>,
            /// Whether a listening socket was handed over (`--preserve-fds 1`).
            preserve_fd: bool,
            join_procs: Vec<PathBuf>,
        },
        /// `delete --force`.
        Delete {
            runtime: Runtime,
            bin: PathBuf,
            id: String,
        },
    }

    /// How the fake answers one command.
    #[derive(Debug, Clone)]
    pub(crate) enum Answer {
        /// Success; `run` appends `log` to the log and writes `pid` (when given) to the
        /// pid file, as a runtime whose container started.
        Ok { pid: Option<i32>, log: &'static str },
        /// Exit status 1; `run` appends `log` to the log first.
        Fail { log: &'static str },
        /// [`RuntimeError::Timeout`] after 60 s.
        Timeout,
    }

    /// Records each command and answers from a script, in order; with the script spent,
    /// every command succeeds (a `run` then writes no pid file).
    #[derive(Debug, Default)]
    pub(crate) struct RecordingRuntime {
        calls: Mutex<Vec<Call>>,
        script: Mutex<VecDeque<Answer>>,
    }

    impl RecordingRuntime {
        /// A fake answering `script`.
        pub(crate) fn new(script: impl IntoIterator<Item = Answer>) -> Arc<Self> {
            Arc::new(RecordingRuntime {
                calls: Mutex::default(),
                script: Mutex::new(script.into_iter().collect()),
            })
        }

        /// The commands seen so far.
        pub(crate) fn calls(&self) -> Vec<Call> {
            self.calls.lock().unwrap().clone()
        }

        fn next(&self) -> Answer {
            let next = self.script.lock().unwrap().pop_front();
            next.unwrap_or(Answer::Ok { pid: None, log: "" })
        }
    }

    fn failed(runtime: Runtime, verb: &'static str, id: &str, log: &str) -> RuntimeError {
        RuntimeError::Failed {
            runtime: runtime.name(),
            verb,
            id: id.to_string(),
            status: ExitStatus::from_raw(1 << 8),
            log: log.to_string(),
        }
    }

    fn timeout(bin: &Path) -> RuntimeError {
        RuntimeError::Timeout {
            program: bin.display().to_string(),
            timeout: RUNTIME_TIMEOUT,
        }
    }

    #[async_trait::async_trait]
    impl OciRuntimeCli for RecordingRuntime {
        async fn run(&self, mut req: RunRequest<'_>) -> Result<(), RuntimeError> {
            self.calls.lock().unwrap().push(Call::Run {
                runtime: req.runtime,
                id: req.id.to_string(),
                bundle: req.bundle.to_path_buf(),
                pid_file: req.pid_file.to_path_buf(),
                flags: req.flags.clone(),
                preserve_fd: req.listen_fd.is_some(),
                join_procs: req.join_procs.clone(),
            });
            match self.next() {
                Answer::Ok { pid, log } => {
                    req.log.write_all(log.as_bytes()).unwrap();
                    if let Some(pid) = pid {
                        std::fs::write(req.pid_file, format!("{pid}")).unwrap();
                    }
                    Ok(())
                }
                Answer::Fail { log } => {
                    req.log.write_all(log.as_bytes()).unwrap();
                    Err(failed(req.runtime, "run", req.id, log))
                }
                Answer::Timeout => Err(timeout(req.bin)),
            }
        }

        async fn delete_force(
            &self,
            runtime: Runtime,
            bin: &Path,
            id: &str,
        ) -> Result<(), RuntimeError> {
            self.calls.lock().unwrap().push(Call::Delete {
                runtime,
                bin: bin.to_path_buf(),
                id: id.to_string(),
            });
            match self.next() {
                Answer::Ok { .. } => Ok(()),
                Answer::Fail { log } => Err(failed(runtime, "delete", id, log)),
                Answer::Timeout => Err(timeout(bin)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

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

    fn args(cmd: &std::process::Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    fn request<'a>(
        runtime: Runtime,
        bin: &'a Path,
        dir: &'a Path,
        log_path: &'a Path,
        listen_fd: Option<BorrowedFd<'a>>,
    ) -> RunRequest<'a> {
        RunRequest {
            runtime,
            bin,
            id: "sb-1",
            bundle: dir,
            pid_file: Box::leak(dir.join("init.pid").into_boxed_path()),
            flags: Vec::new(),
            listen_fd,
            join_procs: Vec::new(),
            log: std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log_path)
                .unwrap(),
            log_path,
        }
    }

    #[test]
    fn each_runtime_gets_its_state_root_and_runsc_its_flags() {
        let host = HostRuntime::new(PathBuf::from("/d/runtime"));
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("agent.log");
        let b = dir.path().display().to_string();
        let bin = Path::new("/usr/bin/runc");
        let fd = std::fs::File::open("/dev/null").unwrap();
        let req = request(Runtime::Runc, bin, dir.path(), &log, Some(fd.as_fd()));
        let cmd = host.run_command(&req).unwrap();
        assert_eq!(cmd.get_program(), "/usr/bin/runc");
        assert_eq!(
            args(&cmd),
            [
                "--root",
                "/d/runtime/runc",
                "run",
                "--detach",
                "--bundle",
                &b,
                "--pid-file",
                &format!("{b}/init.pid"),
                "--preserve-fds",
                "1",
                "sb-1"
            ]
        );
        let mut req = request(Runtime::Runsc, bin, dir.path(), &log, None);
        req.flags = vec!["--debug".into(), "--network=host".into()];
        assert_eq!(
            args(&host.run_command(&req).unwrap()),
            [
                "--root",
                "/d/runtime/runsc",
                "--platform=systrap",
                "--network=none",
                "--ignore-cgroups",
                "--overlay2=none",
                "--file-access=shared",
                "--host-uds=create",
                "--debug",
                "--network=host",
                "run",
                "--detach",
                "--bundle",
                &b,
                "--pid-file",
                &format!("{b}/init.pid"),
                "sb-1"
            ]
        );
        assert_eq!(
            args(&host.delete_command(Runtime::Crun, Path::new("/bin/crun"), "cp-ab")),
            ["--root", "/d/runtime/crun", "delete", "--force", "cp-ab"]
        );
    }

    /// A shell script standing in for a runtime binary: prints its arguments and whether
    /// it has an fd 3, then `exit_code` (after `noise` bytes of output on stderr).
    fn script(dir: &Path, exit_code: i32, noise: usize) -> PathBuf {
        use std::os::unix::fs::PermissionsExt as _;
        let p = dir.join("fake-runc");
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\necho \"$@\"\n[ -e /proc/$$/fd/3 ] && echo has-fd3\nhead -c {noise} /dev/zero | tr '\\0' x >&2\necho ' boom' >&2\nexit {exit_code}\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// `run`, retried while the script is busy (`ETXTBSY`: another test's fork may still
    /// hold the descriptor it was written through).
    async fn run_retrying(
        host: &HostRuntime,
        mk: impl Fn() -> RunRequest<'static>,
    ) -> Result<(), RuntimeError> {
        for _ in 0..50 {
            match host.run(mk()).await {
                Err(RuntimeError::Spawn { source, .. })
                    if source.raw_os_error() == Some(libc::ETXTBSY) =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                r => return r,
            }
        }
        panic!("script stayed busy");
    }

    fn leak(p: PathBuf) -> &'static Path {
        Box::leak(p.into_boxed_path())
    }

    #[tokio::test]
    async fn a_run_writes_to_the_log_gets_fd_3_and_joins_the_cgroups_first() {
        let dir = tempfile::tempdir().unwrap();
        let d = leak(dir.path().to_path_buf());
        let bin = leak(script(d, 0, 0));
        let log = leak(d.join("agent.log"));
        // A plain file standing in for `cgroup.procs`: the child writes "0" (itself) to it.
        let procs = d.join("cgroup.procs");
        std::fs::write(&procs, "").unwrap();
        let listener: &'static std::os::unix::net::UnixListener = Box::leak(Box::new(
            std::os::unix::net::UnixListener::bind(d.join("agent.sock")).unwrap(),
        ));
        let fd: BorrowedFd<'static> = listener.as_fd();
        let host = HostRuntime::new(d.join("runtime"));
        run_retrying(&host, || {
            let mut req = request(Runtime::Runc, bin, d, log, Some(fd));
            req.join_procs = vec![procs.clone()];
            req
        })
        .await
        .unwrap();
        let out = std::fs::read_to_string(log).unwrap();
        assert!(out.contains("run --detach --bundle"), "{out}");
        assert!(out.ends_with(" sb-1\nhas-fd3\n boom\n"), "{out}");
        assert_eq!(std::fs::read_to_string(&procs).unwrap(), "0");
    }

    #[tokio::test]
    async fn a_failed_run_keeps_the_end_of_its_log_and_a_failed_delete_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let d = leak(dir.path().to_path_buf());
        let bin = leak(script(d, 3, 3000));
        let log = leak(d.join("agent.log"));
        let host = HostRuntime::new(d.join("runtime"));
        let e = run_retrying(&host, || request(Runtime::Runc, bin, d, log, None))
            .await
            .unwrap_err();
        let RuntimeError::Failed {
            runtime,
            verb,
            id,
            status,
            log: tail,
        } = &e
        else {
            panic!("{e:?}")
        };
        assert_eq!((*runtime, *verb, id.as_str()), ("runc", "run", "sb-1"));
        assert_eq!(status.code(), Some(3));
        assert!(tail.len() <= 2000 && tail.ends_with("xxx boom"), "{tail}");
        assert!(e
            .to_string()
            .starts_with("runc run sb-1: exit status: 3; xxx"));
        // delete: output discarded, the status named.
        let e = loop {
            match host.delete_force(Runtime::Runc, bin, "cp-ab").await {
                Err(RuntimeError::Spawn { source, .. })
                    if source.raw_os_error() == Some(libc::ETXTBSY) =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                r => break r.unwrap_err(),
            }
        };
        assert_eq!(e.to_string(), "runc delete cp-ab: exit status: 3; ");
    }

    #[test]
    fn tail_cuts_on_a_char_boundary() {
        assert_eq!(tail("ab\u{e9}cd ", 3), "cd");
        assert_eq!(tail("\u{e9}x", 2), "x");
    }
}
