//! The guest agent's exec-helper zygote: `sandlot-guest exec --zygote`.
//!
//! Every exec of the guest agent runs in a pre-started `sandlot-guest exec --own-pid-ns`
//! helper (see `agent`). Started as a fresh process, a helper costs a fork of the agent, an
//! execve of this (static) binary, glibc's and Rust's start-up (in a VM, glibc's start-up
//! alone runs CPUID dozens of times, each a VM exit) and building the seccomp filters;
//! on a sandbox with one CPU that work competes with the next exec. The zygote does it
//! once: the agent starts it at start-up with the same set-up as a helper (environment
//! cleared, the microVM's `sandbox` cgroup joined, the forwarded signals blocked), it
//! builds the filters, then waits on a unix `SOCK_SEQPACKET` socket (its fd 3) for
//! requests. A request is one byte and five descriptors (SCM_RIGHTS): the helper's stdin,
//! stdout, stderr, spec (fd 3) and status (fd 4). For each the zygote clones itself with
//! `CLONE_PARENT` and answers with the new process's pid (or `-errno`, e.g. `-EAGAIN` at
//! the pids limit); the clone moves the five descriptors onto 0-4, closes everything else
//! and continues exactly like a helper started with execve (`exec::main_prestarted`).
//!
//! **Why `CLONE_PARENT`.** The helper's parent is then the agent, as for a helper the agent
//! forked itself: the agent's reaper collects it, its SIGCHLD goes to the agent, and the
//! agent's kill of the helper (timeout, dropped connection, delete) works unchanged. The
//! helper is a copy of the zygote, not of the agent: same credentials, capabilities,
//! cgroup, namespaces, seccomp state (the container's own profile only), empty
//! environment and the forwarded signals blocked, as a helper the agent starts with
//! execve; it holds no descriptor but its 0-4. What differs is the memory: a copy of the
//! zygote's (the same binary, already started), so every helper and exec init shares the
//! zygote's address-space layout (the command itself is started by execve and gets its
//! own). The clone is safe because the zygote is single-threaded and holds no lock when it
//! clones (see `sys::clone_parent`). The kernel refuses `CLONE_PARENT` only to the init of
//! a pid namespace, which the zygote never is (the agent is).
//!
//! **Lifetime.** The zygote exits when its socket reads EOF, i.e. when the agent (the only
//! holder of the other end, close-on-exec) is gone; it cannot use `PR_SET_PDEATHSIG`, which
//! fires when the *thread* that forked it ends (the agent starts it from a short-lived
//! thread). When it is gone (killed, OOM) or fails, the agent starts helpers itself as
//! before and starts a new zygote at a later refill.
//!
//! **Cost.** One more process in the sandbox (its pids limit; it sits in the same cgroup as
//! the helpers) and its private memory (~0.1 MiB measured: the relocated data of the
//! binary, the filters).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::sys::{self, Forked};
use crate::{exec, seccomp};

/// The request byte (the descriptors ride along).
const REQUEST: u8 = b'H';
/// Descriptors per request: the helper's 0-4.
const HELPER_FDS: usize = 5;

/// Entry point of `sandlot-guest exec --zygote`; returns the exit code (0: the agent is
/// gone).
pub fn main() -> i32 {
    // The request socket, moved out of the way of the helpers' 0-4.
    let sock = match sys::inherited_fd(3).and_then(|fd| sys::dup_at_least(fd.as_raw_fd(), 10)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sandlot-guest exec --zygote: fd 3 (request socket): {e}");
            return 1;
        }
    };
    // A failure here is reported by each helper, which then builds them itself.
    let filters = seccomp::build().ok();
    // The greeting: 0, or -errno and exit (ENOTSUP: `CLONE_PARENT` is not honoured).
    let hello = match clone_parent_works() {
        Ok(true) => 0,
        Ok(false) => -libc::ENOTSUP,
        Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
    };
    if sys::send_fds(&sock, &hello.to_ne_bytes(), &[]).is_err() || hello != 0 {
        return 0;
    }
    let mut buf = [0u8; 16];
    loop {
        let (n, fds) = match sys::recv_fds(&sock, &mut buf) {
            Ok((0, _)) => return 0,
            Ok(r) => r,
            Err(e) if agent_gone(&e) => return 0,
            Err(e) => {
                eprintln!("sandlot-guest exec --zygote: recvmsg: {e}");
                return 1;
            }
        };
        let answer: i32 = if n != 1 || buf[0] != REQUEST || fds.len() != HELPER_FDS {
            -libc::EINVAL
        } else {
            match sys::clone_parent() {
                Ok(Forked::Child) => {
                    drop(sock);
                    helper(fds, filters)
                }
                Ok(Forked::Parent(pid)) => pid.as_raw(),
                Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
            }
        };
        // The helper's descriptors are the helper's alone (its stdout must reach EOF when
        // it ends).
        drop(fds);
        match sys::send_fds(&sock, &answer.to_ne_bytes(), &[]) {
            Ok(()) => {}
            Err(e) if agent_gone(&e) => return 0,
            Err(e) => {
                eprintln!("sandlot-guest exec --zygote: send: {e}");
                return 1;
            }
        }
    }
}

/// Whether a `CLONE_PARENT` clone really is the parent's child: gVisor (seen with runsc
/// 0.0~20240729.0, Debian's) accepts the flag but makes the caller the parent; the agent
/// would never reap those helpers (each exec left a zombie). The probe clone exits at once: when it is ours,
/// waitpid reaps it; when it is the agent's, waitpid answers ECHILD (the agent reaps it).
fn clone_parent_works() -> std::io::Result<bool> {
    match sys::clone_parent()? {
        Forked::Child => sys::exit_now(0),
        Forked::Parent(pid) => loop {
            match nix::sys::wait::waitpid(pid, None) {
                Ok(_) => return Ok(false),
                Err(nix::errno::Errno::ECHILD) => return Ok(true),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        },
    }
}

/// The errors of a socket whose peer (the agent) is gone.
fn agent_gone(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET))
}

/// The cloned helper: `fds` onto 0-4, nothing else open, then a pre-started exec helper.
fn helper(fds: Vec<OwnedFd>, filters: Option<seccomp::Filters>) -> ! {
    // First above 0-4 (a received descriptor may have any number), then onto 0-4.
    let high: std::io::Result<Vec<OwnedFd>> = fds
        .iter()
        .map(|fd| sys::dup_at_least(fd.as_raw_fd(), 10))
        .collect();
    drop(fds);
    let moved = high.and_then(|high| {
        for (target, fd) in high.iter().enumerate() {
            sys::dup_onto(fd.as_raw_fd(), target as RawFd)?;
        }
        Ok(())
    });
    if moved.is_err() {
        // No status pipe to report on: the agent sees EOF on fd 4 and a dead helper.
        sys::exit_now(125)
    }
    // Nothing of the zygote's stays open (it held only its stdio and the socket, both gone
    // by now; this is a safety net, best effort where close_range(2) is missing).
    let _ = sys::close_fds(HELPER_FDS as RawFd, libc::c_uint::MAX);
    let code = match filters {
        Some(f) => exec::main_prestarted(f),
        None => exec::main(true),
    };
    sys::exit_now(code)
}

/// The agent's handle on a running zygote.
pub struct Zygote {
    sock: OwnedFd,
    pid: i32,
}

/// Why [`Zygote::helper`] gave no helper.
pub enum RequestError {
    /// The zygote answered: it could not make the process (the errno of its clone, e.g.
    /// EAGAIN at the pids limit). It is still usable.
    Refused(std::io::Error),
    /// The zygote is gone or misbehaves (no answer within a second): drop it.
    Gone(std::io::Error),
}

/// A helper made by the zygote: its pid and the agent's ends of its descriptors.
pub struct Made {
    /// The helper's pid (a child of the agent).
    pub pid: i32,
    /// Write end of its stdin.
    pub stdin: OwnedFd,
    /// Read end of its stdout.
    pub stdout: OwnedFd,
    /// Read end of its stderr.
    pub stderr: OwnedFd,
    /// Write end of its fd 3 (the spec).
    pub spec_w: OwnedFd,
    /// Read end of its fd 4 (violations, then the status).
    pub status_r: OwnedFd,
}

impl Zygote {
    /// Starts `/proc/self/exe exec --zygote` with its request socket on fd 3; `setup` runs
    /// in the forked child before execve (the helpers' set-up: cgroup, signal mask). Waits
    /// for its greeting (up to a second).
    ///
    /// # Errors
    /// ENOTSUP where the zygote cannot work (`CLONE_PARENT` not honoured, see
    /// [`clone_parent_works`]): do not start another. Else the spawn's or the greeting's.
    ///
    /// # Safety
    /// `setup` runs between fork and execve: async-signal-safe calls only.
    pub unsafe fn spawn(
        setup: impl FnMut() -> std::io::Result<()> + Send + Sync + 'static,
    ) -> std::io::Result<Zygote> {
        use std::os::unix::process::CommandExt;
        use std::process::{Command, Stdio};
        let (ours, theirs) = sys::seqpacket_pair()?;
        let theirs = sys::dup_at_least(theirs.as_raw_fd(), 10)?;
        // A zygote that stopped answering must not stall an exec for long.
        let tv = nix::sys::time::TimeVal::new(1, 0);
        nix::sys::socket::setsockopt(&ours, nix::sys::socket::sockopt::ReceiveTimeout, &tv)?;
        nix::sys::socket::setsockopt(&ours, nix::sys::socket::sockopt::SendTimeout, &tv)?;
        let tfd = theirs.as_raw_fd();
        let mut setup = setup;
        let mut cmd = Command::new("/proc/self/exe");
        cmd.args(["exec", "--zygote"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .env_clear();
        // SAFETY: the caller's `setup` is async-signal-safe; dup2 is; `tfd` is a CLOEXEC
        // descriptor >= 10 that stays open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                sys::dup_onto(tfd, 3)?;
                setup()
            });
        }
        let child = cmd.spawn()?;
        drop(theirs);
        let z = Zygote {
            sock: ours,
            pid: child.id() as i32,
        };
        match z.answer()? {
            0 => Ok(z),
            n if n < 0 => Err(std::io::Error::from_raw_os_error(-n)),
            _ => Err(std::io::Error::from_raw_os_error(libc::EPROTO)),
        }
    }

    /// The next 4-byte answer on the socket (EPIPE: the zygote is gone; ETIMEDOUT: no
    /// answer within the socket's one-second timeout, which recvmsg reports as EAGAIN, an
    /// errno the agent reserves for the pids limit).
    fn answer(&self) -> std::io::Result<i32> {
        let mut buf = [0u8; 8];
        let got = sys::recv_fds(&self.sock, &mut buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::WouldBlock {
                std::io::Error::from_raw_os_error(libc::ETIMEDOUT)
            } else {
                e
            }
        })?;
        match got {
            (4, fds) if fds.is_empty() => Ok(i32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]])),
            (0, _) => Err(std::io::Error::from_raw_os_error(libc::EPIPE)),
            _ => Err(std::io::Error::from_raw_os_error(libc::EPROTO)),
        }
    }

    /// The zygote's pid (a child of the agent).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Asks for a helper: makes its five pipes, sends the far ends, waits for the pid.
    pub fn helper(&self) -> Result<Made, RequestError> {
        let pipes = || -> std::io::Result<_> {
            let p = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC);
            Ok((p()?, p()?, p()?, p()?, p()?))
        };
        let (
            (stdin_r, stdin_w),
            (stdout_r, stdout_w),
            (stderr_r, stderr_w),
            (spec_r, spec_w),
            (status_r, status_w),
        ) = pipes().map_err(RequestError::Refused)?;
        let far = [
            stdin_r.as_raw_fd(),
            stdout_w.as_raw_fd(),
            stderr_w.as_raw_fd(),
            spec_r.as_raw_fd(),
            status_w.as_raw_fd(),
        ];
        sys::send_fds(&self.sock, &[REQUEST], &far).map_err(RequestError::Gone)?;
        // Our copies of the far ends go now: the helper holds the only ones.
        drop((stdin_r, stdout_w, stderr_w, spec_r, status_w));
        let answer = self.answer().map_err(RequestError::Gone)?;
        if answer <= 0 {
            return Err(RequestError::Refused(std::io::Error::from_raw_os_error(
                -answer,
            )));
        }
        Ok(Made {
            pid: answer,
            stdin: stdin_w,
            stdout: stdout_r,
            stderr: stderr_r,
            spec_w,
            status_r,
        })
    }
}
