//! A child process started with `posix_spawn(3)` and awaited through a pidfd.
//!
//! Why not `tokio::process::Command`: a command that maps extra fds or sets a signal mask
//! needs `pre_exec`, and with `pre_exec` the standard library forks. `fork(2)` of the
//! server copies the page tables of its whole address space (~380 MiB mapped, 6 threads)
//! and every page it writes afterwards takes a copy-on-write fault; glibc's `posix_spawn`
//! runs the child on the parent's memory (`CLONE_VM | CLONE_VFORK`) until its `execve`, so
//! starting a `sandlot-guest exec` helper costs the same whatever the server's size
//! (function backend, an exec's critical path: measured in docs/backends.md).
//!
//! Contract: stdin is a pipe or `/dev/null`, stdout and stderr are pipes; `fds` maps the
//! caller's descriptors onto fixed numbers in the child (their `FD_CLOEXEC` cleared there;
//! each source must be numbered above every target, see [`dup_high`]);
//! the environment is empty; the signals in `blocked` are blocked in the child and SIGPIPE
//! has its default action. The child is waited for through `pidfd_open(2)` (Linux 5.3+);
//! without it, by polling `waitpid(2)`. Dropping a child that was not reaped kills it
//! (SIGKILL through the pidfd) and reaps it on a thread of its own.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use nix::spawn::{posix_spawn, PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;

/// A spawned child; see the module docs.
pub(crate) struct SpawnedChild {
    pid: Pid,
    pidfd: Option<AsyncFd<OwnedFd>>,
    /// The wait status once reaped.
    status: Option<WaitStatus>,
    /// The write end of the child's stdin, when it is a pipe.
    pub stdin: Option<pipe::Sender>,
    /// The read end of the child's stdout.
    pub stdout: Option<pipe::Receiver>,
    /// The read end of the child's stderr.
    pub stderr: Option<pipe::Receiver>,
}

impl SpawnedChild {
    /// Starts `path` with `args` (argv\[1..\]); see the module docs for the child's stdio,
    /// fds, environment and signal mask. Must run inside a tokio runtime (the pipes and the
    /// pidfd register with its reactor).
    ///
    /// # Errors
    /// The `posix_spawn` error (e.g. `ENOENT`, `EACCES` for `path`), one of creating the
    /// pipes, or `InvalidInput` when a source fd of `fds` is not above every target.
    pub fn spawn(
        path: &Path,
        args: &[&str],
        stdin_piped: bool,
        fds: &[(&OwnedFd, RawFd)],
        blocked: &[i32],
    ) -> std::io::Result<SpawnedChild> {
        let (in_r, in_w) = if stdin_piped {
            let (r, w) = cloexec_pipe()?;
            (Some(dup_high(&r)?), Some(w))
        } else {
            (None, None)
        };
        let (out_r, out_w) = cloexec_pipe()?;
        let (err_r, err_w) = cloexec_pipe()?;
        // Above every target number, so that no dup2 of the file actions overwrites a
        // source still to be copied.
        let out_w = dup_high(&out_w)?;
        let err_w = dup_high(&err_w)?;

        let mut actions = PosixSpawnFileActions::init()?;
        match &in_r {
            Some(r) => actions.add_dup2(r.as_raw_fd(), 0)?,
            None => actions.add_open(
                0,
                c"/dev/null",
                nix::fcntl::OFlag::O_RDONLY,
                nix::sys::stat::Mode::empty(),
            )?,
        }
        actions.add_dup2(out_w.as_raw_fd(), 1)?;
        actions.add_dup2(err_w.as_raw_fd(), 2)?;
        let top = fds.iter().map(|(_, t)| *t).max().unwrap_or(2).max(2);
        for (fd, target) in fds {
            if fd.as_raw_fd() <= top {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "fd {} would be overwritten by the fd mapping",
                        fd.as_raw_fd()
                    ),
                ));
            }
            actions.add_dup2(fd.as_raw_fd(), *target)?;
        }
        let mut attr = PosixSpawnAttr::init()?;
        let mut mask = SigSet::empty();
        for s in blocked {
            mask.add(Signal::try_from(*s)?);
        }
        attr.set_sigmask(&mask)?;
        let mut default = SigSet::empty();
        default.add(Signal::SIGPIPE);
        attr.set_sigdefault(&default)?;
        attr.set_flags(
            PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF,
        )?;

        let prog = CString::new(path.as_os_str().as_bytes())?;
        let mut argv = vec![prog.clone()];
        for a in args {
            argv.push(CString::new(*a)?);
        }
        let env: [CString; 0] = [];
        let pid = posix_spawn(prog.as_c_str(), &actions, &attr, &argv, &env)?;
        // Our child, not reaped yet: its pid cannot have been reused.
        let pidfd = pidfd_open(pid).and_then(|fd| {
            // SAFETY: the OwnedFd is the AsyncFd's inner value, so the fd stays open and the
            // same for the AsyncFd's whole life.
            unsafe { AsyncFd::register(fd) }.ok()
        });
        let mut child = SpawnedChild {
            pid,
            pidfd,
            status: None,
            stdin: None,
            stdout: None,
            stderr: None,
        };
        // From here on a failure drops `child`, which kills and reaps it.
        child.stdin = in_w.map(pipe::Sender::from_owned_fd).transpose()?;
        child.stdout = Some(pipe::Receiver::from_owned_fd(out_r)?);
        child.stderr = Some(pipe::Receiver::from_owned_fd(err_r)?);
        Ok(child)
    }

    /// The child's pid (host pid namespace).
    pub fn id(&self) -> i32 {
        self.pid.as_raw()
    }

    /// The wait status when the child has exited (reaping it), `None` while it runs.
    ///
    /// # Errors
    /// The `waitpid(2)` error.
    pub fn try_wait(&mut self) -> std::io::Result<Option<WaitStatus>> {
        if self.status.is_none() {
            match waitpid(self.pid, Some(WaitPidFlag::WNOHANG))? {
                WaitStatus::StillAlive => {}
                s => self.status = Some(s),
            }
        }
        Ok(self.status)
    }

    /// Waits until the child has exited and reaps it.
    ///
    /// # Errors
    /// The `waitpid(2)` error.
    pub async fn wait(&mut self) -> std::io::Result<WaitStatus> {
        let mut backoff = Duration::from_millis(1);
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(s);
            }
            match &self.pidfd {
                // Readable once the process has exited (pidfd_open(2)).
                Some(fd) => {
                    let mut ready = fd.readable().await?;
                    ready.clear_ready();
                }
                None => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                }
            }
        }
    }

    /// Sends SIGKILL unless the child was reaped already.
    ///
    /// # Errors
    /// The `pidfd_send_signal(2)` / `kill(2)` error.
    pub fn start_kill(&mut self) -> std::io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        let r = match &self.pidfd {
            Some(fd) => {
                // SAFETY: plain syscall on a pidfd we own; no pointers but the null siginfo.
                let r = unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        fd.as_fd().as_raw_fd(),
                        libc::SIGKILL,
                        std::ptr::null::<libc::siginfo_t>(),
                        0,
                    )
                };
                if r < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(())
                }
            }
            // Not reaped yet, so the pid is still ours.
            None => nix::sys::signal::kill(self.pid, Signal::SIGKILL).map_err(Into::into),
        };
        match r {
            // ESRCH: it exited already (a zombie is not an error).
            Err(e) if e.raw_os_error() != Some(libc::ESRCH) => Err(e),
            _ => Ok(()),
        }
    }
}

impl Drop for SpawnedChild {
    fn drop(&mut self) {
        if self.status.is_some() || matches!(self.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = self.start_kill();
        let pid = self.pid;
        std::thread::spawn(move || {
            let _ = waitpid(pid, None);
        });
    }
}

fn pidfd_open(pid: Pid) -> Option<OwnedFd> {
    // SAFETY: plain syscall without pointers.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), libc::O_NONBLOCK) };
    if fd < 0 {
        return None;
    }
    // SAFETY: pidfd_open returned a new fd that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A pipe, both ends `O_CLOEXEC`.
pub(crate) fn cloexec_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}

/// A `O_CLOEXEC` copy of `fd` numbered 10 or above.
pub(crate) fn dup_high(fd: &OwnedFd) -> std::io::Result<OwnedFd> {
    let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))?;
    // SAFETY: F_DUPFD_CLOEXEC returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn maps_fds_pipes_stdio_and_reports_the_exit() {
        // fd 3 of the child = the write end of our pipe; the shell writes to it, echoes its
        // stdin to stdout, a word to stderr, and exits 7.
        let (r, w0) = cloexec_pipe().unwrap();
        let w = dup_high(&w0).unwrap();
        drop(w0);
        let mut c = SpawnedChild::spawn(
            Path::new("/bin/sh"),
            &["-c", "echo fd3 >&3; cat; echo err >&2; exit 7"],
            true,
            &[(&w, 3)],
            &[libc::SIGTERM],
        )
        .unwrap();
        drop(w);
        let mut stdin = c.stdin.take().unwrap();
        stdin.write_all(b"hello").await.unwrap();
        drop(stdin);
        let mut out = String::new();
        c.stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        let mut err = String::new();
        c.stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .await
            .unwrap();
        let mut fd3 = String::new();
        pipe::Receiver::from_owned_fd(r)
            .unwrap()
            .read_to_string(&mut fd3)
            .await
            .unwrap();
        assert_eq!(
            (out.as_str(), err.as_str(), fd3.as_str()),
            ("hello", "err\n", "fd3\n")
        );
        let st = c.wait().await.unwrap();
        assert_eq!(st, WaitStatus::Exited(Pid::from_raw(c.id()), 7));
    }

    #[tokio::test]
    async fn blocked_signals_stay_blocked_and_kill_ends_the_child() {
        // The mask reaches the program (stdin is /dev/null, not read here).
        let mut c = SpawnedChild::spawn(
            Path::new("/bin/grep"),
            &["SigBlk", "/proc/self/status"],
            false,
            &[],
            &[libc::SIGTERM],
        )
        .unwrap();
        let mut blk = String::new();
        c.stdout
            .take()
            .unwrap()
            .read_to_string(&mut blk)
            .await
            .unwrap();
        let mask = u64::from_str_radix(blk.split_whitespace().nth(1).unwrap(), 16).unwrap();
        assert_eq!(mask, 1 << (libc::SIGTERM - 1), "{blk}");
        assert_eq!(
            c.wait().await.unwrap(),
            WaitStatus::Exited(Pid::from_raw(c.id()), 0)
        );

        // A blocked SIGTERM does not end the child; SIGKILL does.
        let mut c = SpawnedChild::spawn(
            Path::new("/bin/sleep"),
            &["30"],
            false,
            &[],
            &[libc::SIGTERM],
        )
        .unwrap();
        nix::sys::signal::kill(Pid::from_raw(c.id()), Signal::SIGTERM).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(c.try_wait().unwrap(), None, "SIGTERM is blocked");
        c.start_kill().unwrap();
        let st = c.wait().await.unwrap();
        assert_eq!(
            st,
            WaitStatus::Signaled(Pid::from_raw(c.id()), Signal::SIGKILL, false)
        );
    }

    #[tokio::test]
    async fn drop_kills_and_reaps() {
        let c = SpawnedChild::spawn(Path::new("/bin/sleep"), &["30"], false, &[], &[]).unwrap();
        let pid = c.id();
        drop(c);
        let gone = async {
            // Reaped: /proc/PID disappears (or belongs to another process, never a zombie
            // of ours).
            while std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains("(sleep)"))
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .expect("the dropped child is killed and reaped");
    }

    #[tokio::test]
    async fn a_missing_program_is_an_error() {
        let e = SpawnedChild::spawn(Path::new("/nonexistent/prog"), &[], false, &[], &[])
            .err()
            .expect("spawn fails");
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }
}
