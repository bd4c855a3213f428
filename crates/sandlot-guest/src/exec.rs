//! `sandlot-guest exec`: runs one command inside a sandbox built by `init`.
//!
//! Protocol: [`ExecSpec`] JSON on fd 3 (to EOF); the command's stdin/stdout/stderr are
//! this process's; one [`ExecStatus`] JSON document on fd 4 when it has ended; exit 0.
//!
//! The process joins the sandbox's cgroups and every namespace but the user namespace,
//! then forks (a pid namespace is entered only by children). The parent stays host root
//! in the host user namespace, waits and reports. The child applies the resource limits
//! (while it still has host privileges, so limits above the node's own hard limits work),
//! joins the user namespace, becomes the requested uid/gid, and locks itself down in this
//! order: no_new_privs, landlock, capabilities, signals, seccomp (last, so that the
//! set-up calls above are not themselves filtered), then execve.
//!
//! Pre-started (`sandlot-guest exec --own-pid-ns`, the guest agent's helpers): the pid
//! namespace and its exec init exist, and the exec init has installed the seccomp filters,
//! before the spec arrives; the command inherits them (see `run_prestarted`).
//!
//! Signals: the [`sys::FORWARDED`] signals this process receives go to the command's
//! process group (through the exec init in `own_pid_ns` mode); they are blocked from the
//! start (the spawner blocks them before execve) and stay pending until the command exists,
//! so one sent during set-up is delivered, not lost. SIGKILL of this process ends the whole
//! tree as before.
//!
//! Seccomp reports: the child installs the deny list with a user-notification listener and
//! sends it (SCM_RIGHTS) over a socket pair made before the first fork to this process,
//! which is outside the filter; while it waits for its child it runs a
//! [`seccomp::Supervisor`] that answers each denied call with EPERM and writes a
//! `violation` record on fd 4 ahead of the status (see `crate::seccomp`). The wait is one
//! poll(2) loop over the child's error pipe, the supervisor's descriptor and a signalfd for
//! SIGCHLD.
//!
//! Set-up errors in the child travel to the parent over a close-on-exec pipe (a byte `U`
//! for the caller's fault or `I` for an internal one, then the text); EOF without data
//! means execve succeeded or failed in the command's own way (127/126 with a message on
//! the command's stderr, like a shell).

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use anyhow::Context;
use nix::errno::Errno;
use nix::fcntl::{open, openat, OFlag};
use nix::sched::{setns, CloneFlags};
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::stat::Mode;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{
    chdir, chroot, fchdir, pipe2, setgroups, setresgid, setresuid, setsid, Gid, Pid, Uid,
};
use sandlot_guest::spec::{ExecSpec, ExecStatus, RlimitResource};

use crate::host;
use crate::sys::{self, Forked};
use crate::{fsrules, seccomp};

/// A failed set-up step.
struct SetupError {
    message: String,
    user_error: bool,
    resource_exhausted: bool,
}

impl SetupError {
    fn user(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            user_error: true,
            resource_exhausted: false,
        }
    }
}

impl From<anyhow::Error> for SetupError {
    fn from(e: anyhow::Error) -> Self {
        Self {
            message: format!("{e:#}"),
            user_error: false,
            resource_exhausted: false,
        }
    }
}

impl From<SetupError> for ExecStatus {
    fn from(e: SetupError) -> Self {
        ExecStatus::SetupFailed {
            message: e.message,
            user_error: e.user_error,
            resource_exhausted: e.resource_exhausted,
        }
    }
}

/// Entry point; returns the process exit code (0 once a status was written).
/// `prestart` (`sandlot-guest exec --own-pid-ns`, the guest agent's helpers): see
/// [`run_prestarted`].
pub fn main(prestart: bool) -> i32 {
    main_with(prestart, None)
}

/// [`main`] of a pre-started helper made by the guest agent's zygote (`crate::zygote`),
/// which built the filters once for all its helpers: the same steps, from a fork of the
/// zygote instead of a fresh execve.
pub fn main_prestarted(filters: seccomp::Filters) -> i32 {
    main_with(true, Some(filters))
}

fn main_with(prestart: bool, filters: Option<seccomp::Filters>) -> i32 {
    // Signals for the command stay pending until it exists (see `sys::start_forwarding`);
    // without the handler they would only be lost, so a failure here is not fatal.
    if let Err(e) = sys::start_forwarding() {
        eprintln!("sandlot-guest exec: signal forwarding: {e}");
    }
    let status_fd = match sys::inherited_fd(4) {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("sandlot-guest exec: fd 4 (ExecStatus output) is not open: {e}");
            return 1;
        }
    };
    // The command must not inherit the status pipe (it could forge a status).
    if let Err(e) = sys::set_cloexec(4) {
        eprintln!("sandlot-guest exec: FD_CLOEXEC on fd 4: {e}");
        return 1;
    }
    let mut out = std::fs::File::from(status_fd);
    // The supervisor's copy (close-on-exec, like fd 4): violation records go out as they
    // happen, the status after them.
    let sup_out = match out.try_clone() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("sandlot-guest exec: dup of fd 4: {e}");
            return 1;
        }
    };
    let status = match if prestart {
        run_prestarted(sup_out, filters)
    } else {
        run(sup_out)
    } {
        Ok(s) => s,
        Err(e) => e.into(),
    };
    let json = serde_json::to_vec(&status).expect("ExecStatus serialises");
    if let Err(e) = out.write_all(&json) {
        eprintln!("sandlot-guest exec: writing ExecStatus to fd 4: {e}");
        return 1;
    }
    0
}

fn read_spec() -> Result<ExecSpec, SetupError> {
    let fd = sys::inherited_fd(3).context("fd 3 (ExecSpec input) is not open")?;
    let mut s = String::new();
    std::fs::File::from(fd)
        .read_to_string(&mut s)
        .context("reading ExecSpec from fd 3")?;
    Ok(serde_json::from_str(&s).context("parsing ExecSpec JSON from fd 3")?)
}

/// Everything the child needs, prepared before the fork so that input errors are found
/// early and the child allocates little.
struct Prepared {
    argv: Vec<CString>,
    envp: Vec<CString>,
    path: String,
    cwd: CString,
    filters: seccomp::Filters,
}

fn cstring(what: &str, s: &str) -> Result<CString, SetupError> {
    CString::new(s).map_err(|_| SetupError::user(format!("{what} contains a NUL byte: {s:?}")))
}

fn prepare(spec: &ExecSpec, filters: seccomp::Filters) -> Result<Prepared, SetupError> {
    if spec.argv.is_empty() {
        return Err(SetupError::user("argv is empty"));
    }
    let argv = spec
        .argv
        .iter()
        .map(|a| cstring("argv", a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut envp = Vec::with_capacity(spec.env.len());
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') {
            return Err(SetupError::user(format!(
                "invalid environment variable name {k:?}"
            )));
        }
        envp.push(cstring("env", &format!("{k}={v}"))?);
    }
    // glibc's default search path when PATH is unset (confstr _CS_PATH).
    let path = spec
        .env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| "/bin:/usr/bin".to_string());
    Ok(Prepared {
        argv,
        envp,
        path,
        cwd: cstring("cwd", &spec.cwd)?,
        filters,
    })
}

/// Makes `/dev/null` this process's stdin (and so the command's), see
/// [`ExecSpec::stdin_null`].
fn stdin_from_dev_null() -> Result<(), SetupError> {
    let null = open(
        "/dev/null",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .context("opening /dev/null for stdin")?;
    // SAFETY: dup2 onto fd 0; `null` stays owned and is closed on drop.
    if unsafe { libc::dup2(null.as_raw_fd(), 0) } < 0 {
        return Err(anyhow::Error::from(std::io::Error::last_os_error())
            .context("dup2 /dev/null onto stdin")
            .into());
    }
    Ok(())
}

/// The sandbox's init, pinned: `/proc/PID` opened once, so every later lookup refers to
/// the same process even if the pid were reused (the directory fd then answers ESRCH).
struct Target {
    ns: Vec<(OwnedFd, CloneFlags, &'static str)>,
    user: OwnedFd,
    root: OwnedFd,
}

fn open_target(spec: &ExecSpec) -> Result<Target, SetupError> {
    open_target_of(spec.init_pid, spec.init_starttime)
}

fn open_target_of(init_pid: i32, init_starttime: u64) -> Result<Target, SetupError> {
    let what = format!("/proc/{init_pid}");
    let dir = open(
        what.as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SetupError::from(anyhow::anyhow!("sandbox gone: opening {what}: {e}")))?;
    let t = host::starttime_at(&dir, &what).context("sandbox gone")?;
    if t != init_starttime {
        return Err(anyhow::anyhow!(
            "sandbox gone: {what} has starttime {t}, expected {init_starttime} (pid reused)"
        )
        .into());
    }
    let open_ns = |name: &str| -> Result<OwnedFd, SetupError> {
        Ok(openat(
            &dir,
            format!("ns/{name}").as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .with_context(|| format!("opening {what}/ns/{name}"))?)
    };
    // setns order: the user namespace last, so that the others are joined with host
    // privileges (their owner is the host user namespace); mnt after pid and the rest,
    // since it changes what paths mean.
    let mut ns = Vec::new();
    for (name, flag) in [
        ("ipc", CloneFlags::CLONE_NEWIPC),
        ("uts", CloneFlags::CLONE_NEWUTS),
        ("net", CloneFlags::CLONE_NEWNET),
        ("cgroup", CloneFlags::CLONE_NEWCGROUP),
        ("pid", CloneFlags::CLONE_NEWPID),
        ("mnt", CloneFlags::CLONE_NEWNS),
    ] {
        ns.push((open_ns(name)?, flag, name));
    }
    let user = open_ns("user")?;
    let root = openat(
        &dir,
        "root",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening {what}/root"))?;
    Ok(Target { ns, user, root })
}

/// Moves the calling process into a function sandbox to become its long-lived guest agent
/// (`sandlot-guest agent --jail ...`): joins the cgroups whose `cgroup.procs` files are
/// `cgroup_procs` (host root), every namespace of the sandbox's init `init_pid` (checked
/// against `init_starttime`) but the user namespace, and its root (like `exec`); then
/// forks, because a pid namespace is entered only by children. The parent returns
/// `Ok(Some(host pid of the child))` (it reports the pid and exits; the child is
/// reparented to the sandbox's init, which reaps it).
/// The child joins the user namespace, becomes root there (the sandbox's own unprivileged
/// root, holding capabilities only over that namespace, which the exec helpers need to
/// unshare their pid namespaces), starts a session of its own, turns non-dumpable (no
/// ptrace or `/proc` access by commands) and returns `Ok(None)`: it then serves.
///
/// Must run single-threaded (setns into a user namespace).
///
/// # Errors
/// The step that failed (sandbox gone, cgroup write, setns, chroot, fork, uid change).
pub fn enter_jail(
    init_pid: i32,
    init_starttime: u64,
    cgroup_procs: &[String],
) -> anyhow::Result<Option<i32>> {
    let as_anyhow = |e: SetupError| anyhow::anyhow!(e.message);
    host::join_cgroups(cgroup_procs)?;
    let target = open_target_of(init_pid, init_starttime).map_err(as_anyhow)?;
    for (fd, flag, name) in &target.ns {
        setns(fd, *flag)
            .with_context(|| format!("setns({name}) into /proc/{init_pid}/ns/{name}"))?;
    }
    fchdir(&target.root).context("fchdir to the init's root")?;
    chroot(".").context("chroot to the init's root")?;
    match sys::fork().context("fork")? {
        Forked::Parent(pid) => Ok(Some(pid.as_raw())),
        Forked::Child => {
            // stdout carries the launcher's report to the node, which reads it to EOF: the
            // agent's own messages go to stderr only.
            // SAFETY: plain dup2 of two open descriptors.
            if unsafe { libc::dup2(2, 1) } < 0 {
                return Err(std::io::Error::last_os_error()).context("dup2(2, 1)");
            }
            setns(target.user.as_fd(), CloneFlags::CLONE_NEWUSER)
                .with_context(|| format!("setns(user) into /proc/{init_pid}/ns/user"))?;
            drop(target);
            setgroups(&[]).context("setgroups([])")?;
            let root_gid = Gid::from_raw(0);
            let root_uid = Uid::from_raw(0);
            setresgid(root_gid, root_gid, root_gid).context("setresgid(0)")?;
            setresuid(root_uid, root_uid, root_uid).context("setresuid(0)")?;
            setsid().context("setsid")?;
            chdir("/").context("chdir /")?;
            sys::set_non_dumpable().context("prctl(PR_SET_DUMPABLE, 0)")?;
            Ok(None)
        }
    }
}

/// The two ends of the socket pair that carries the command's seccomp listener from the
/// command's child (`send`) to this process (`recv`).
struct ListenerChannel {
    recv: OwnedFd,
    send: OwnedFd,
}

fn listener_channel() -> Result<ListenerChannel, SetupError> {
    let (recv, send) = sys::socketpair().context("socketpair (seccomp listener)")?;
    Ok(ListenerChannel { recv, send })
}

fn run(sup_out: std::fs::File) -> Result<ExecStatus, SetupError> {
    // What needs no spec comes first: the guest agent starts its next helper ahead of time,
    // so this work is done while it waits for the spec on fd 3.
    let filters = seccomp::build()?;
    let chan = listener_channel()?;
    let spec = read_spec()?;
    if spec.stdin_null {
        stdin_from_dev_null()?;
    }
    let prepared = prepare(&spec, filters)?;
    if spec.own_pid_ns {
        return run_in_own_pid_ns(&spec, &prepared, chan, sup_out);
    }
    host::join_cgroups(&spec.cgroup_procs)?;
    let target = open_target(&spec)?;
    for (fd, flag, name) in &target.ns {
        setns(fd, *flag)
            .with_context(|| format!("setns({name}) into /proc/{}/ns/{name}", spec.init_pid))?;
    }
    // Like `nsenter -r`: take the init's root (the pivoted overlay) as ours.
    fchdir(&target.root).context("fchdir to the init's root")?;
    chroot(".").context("chroot to the init's root")?;

    let (err_r, err_w) = pipe2(OFlag::O_CLOEXEC).context("pipe2")?;
    // This process already sits in the sandbox's cgroups: when the sandbox's own
    // processes hold every pid of its pids limit, this fork is the one refused (EAGAIN).
    // That is the sandbox's state, not a node failure.
    let forked = match sys::fork() {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
            return Err(SetupError {
                message: format!("fork: {e}"),
                user_error: false,
                resource_exhausted: true,
            })
        }
        Err(e) => return Err(anyhow::Error::from(e).context("fork").into()),
    };
    match forked {
        Forked::Child => {
            drop(err_r);
            drop(chan.recv);
            match child(&spec, &prepared, Some(&target), Some(&chan.send)) {
                Ok(never) => match never {},
                Err(e) => report_setup_error(err_w, e),
            }
        }
        Forked::Parent(pid) => {
            drop(err_w);
            drop(target);
            drop(chan.send);
            // The command calls setsid(2): its process group gets what we catch.
            let _ = sys::forward_to(pid, true);
            wait_setup(err_r, pid, seccomp::Supervisor::new(chan.recv, sup_out))
        }
    }
}

/// The `own_pid_ns` mode (guest agent inside a container or VM): this process is already
/// inside the sandbox. It unshares a pid namespace and forks its init ("exec init"), which
/// forks the command as its pid 2, reaps everything, and reports the command's status over
/// a pipe before it exits. When the exec init exits (or is killed: it has
/// `PR_SET_PDEATHSIG=SIGKILL`, so killing this process kills it), the kernel kills every
/// process left in the namespace, so background children never outlive the exec.
///
/// Relay format (exec init → this process): one byte `E` (exited) or `S` (signaled), then
/// the code or signal as a little-endian i32.
fn run_in_own_pid_ns(
    spec: &ExecSpec,
    p: &Prepared,
    chan: ListenerChannel,
    sup_out: std::fs::File,
) -> Result<ExecStatus, SetupError> {
    nix::sched::unshare(CloneFlags::CLONE_NEWPID).context("unshare(CLONE_NEWPID)")?;
    let (err_r, err_w) = pipe2(OFlag::O_CLOEXEC).context("pipe2")?;
    let (relay_r, relay_w) = pipe2(OFlag::O_CLOEXEC).context("pipe2")?;
    let exhausted = |e: std::io::Error| SetupError {
        message: format!("fork: {e}"),
        user_error: false,
        resource_exhausted: true,
    };
    match sys::fork().map_err(exhausted)? {
        Forked::Child => {
            drop(err_r);
            drop(relay_r);
            drop(chan.recv);
            drop(sup_out);
            exec_init(spec, p, err_w, relay_w, Some(chan.send))
        }
        Forked::Parent(init) => {
            drop(err_w);
            drop(relay_w);
            drop(chan.send);
            // The exec init passes what we catch on to the command's process group.
            let _ = sys::forward_to(init, false);
            // Returns once the exec init has exited: every process of its pid namespace is
            // gone then, so every notification was answered.
            let init_status =
                wait_setup(err_r, init, seccomp::Supervisor::new(chan.recv, sup_out))?;
            relay_status(init_status, relay_r)
        }
    }
}

/// `own_pid_ns` mode started before the spec exists (the guest agent keeps such a helper
/// ready for its next exec): everything that does not depend on the spec happens first —
/// the filters are built, the pid namespace is unshared and the exec init forked, and the
/// exec init installs the filters (with its listener sent to this process's supervisor)
/// while it waits for the spec on fd 3. The command, forked by the exec init once the spec
/// came, inherits the filters: none of its set-up calls is on the deny list, so installing
/// them first changes nothing it can do, and the exec's critical path loses a fork, the
/// unshare and the filter installation. The process limit still bites at the exec: the
/// command's fork is the one refused.
///
/// `filters`: already built (by the zygote), else built here.
fn run_prestarted(
    sup_out: std::fs::File,
    filters: Option<seccomp::Filters>,
) -> Result<ExecStatus, SetupError> {
    let filters = match filters {
        Some(f) => f,
        None => seccomp::build()?,
    };
    let chan = listener_channel()?;
    nix::sched::unshare(CloneFlags::CLONE_NEWPID).context("unshare(CLONE_NEWPID)")?;
    let (err_r, err_w) = pipe2(OFlag::O_CLOEXEC).context("pipe2")?;
    let (relay_r, relay_w) = pipe2(OFlag::O_CLOEXEC).context("pipe2")?;
    let exhausted = |e: std::io::Error| SetupError {
        message: format!("fork: {e}"),
        user_error: false,
        resource_exhausted: true,
    };
    match sys::fork().map_err(exhausted)? {
        Forked::Child => {
            drop(err_r);
            drop(relay_r);
            drop(chan.recv);
            drop(sup_out);
            // Die with the helper; if it died before the prctl, the relay pipe has no reader.
            if sys::set_parent_death_signal(libc::SIGKILL).is_err() || sys::reader_gone(&relay_w) {
                sys::exit_now(125)
            }
            let ready = sys::set_no_new_privs()
                .context("prctl(PR_SET_NO_NEW_PRIVS)")
                .map_err(SetupError::from)
                .and_then(|_| install(&filters, &chan.send));
            drop(chan.send);
            if let Err(e) = ready {
                report_setup_error(err_w, e)
            }
            let prepared = read_spec().and_then(|spec| {
                if spec.stdin_null {
                    stdin_from_dev_null()?;
                }
                let p = prepare(&spec, filters)?;
                Ok((spec, p))
            });
            match prepared {
                Ok((spec, p)) => exec_init(&spec, &p, err_w, relay_w, None),
                Err(e) => report_setup_error(err_w, e),
            }
        }
        Forked::Parent(init) => {
            drop(err_w);
            drop(relay_w);
            drop(chan.send);
            // The spec is the exec init's to read.
            // SAFETY: fd 3 is the inherited spec pipe, not owned by anything here.
            unsafe { libc::close(3) };
            let _ = sys::forward_to(init, false);
            let init_status =
                wait_setup(err_r, init, seccomp::Supervisor::new(chan.recv, sup_out))?;
            relay_status(init_status, relay_r)
        }
    }
}

/// The command's status from the exec init's exit status and its relay pipe (format in
/// [`run_in_own_pid_ns`]).
fn relay_status(init_status: ExecStatus, relay_r: OwnedFd) -> Result<ExecStatus, SetupError> {
    let mut relay = Vec::new();
    let _ = std::fs::File::from(relay_r).read_to_end(&mut relay);
    match (init_status, relay.as_slice()) {
        (ExecStatus::Exited { code: 0 }, [tag, a, b, c, d]) => {
            let n = i32::from_le_bytes([*a, *b, *c, *d]);
            Ok(if *tag == b'S' {
                ExecStatus::Signaled { signal: n }
            } else {
                ExecStatus::Exited { code: n }
            })
        }
        // The exec init was killed (timeout, delete): the command with it.
        (ExecStatus::Signaled { signal }, _) => Ok(ExecStatus::Signaled { signal }),
        (other, _) => Err(anyhow::anyhow!(
            "exec init ended without a status ({other:?}, relay {relay:?})"
        )
        .into()),
    }
}

/// Pid 1 of the exec's own pid namespace: forks the command, reaps every process until the
/// command is reaped, relays its status, exits (which kills what is left).
fn exec_init(
    spec: &ExecSpec,
    p: &Prepared,
    err_w: OwnedFd,
    relay_w: OwnedFd,
    listener_send: Option<OwnedFd>,
) -> ! {
    // Die with the helper; if it died before the prctl, the relay pipe has no reader.
    if sys::set_parent_death_signal(libc::SIGKILL).is_err() || sys::reader_gone(&relay_w) {
        sys::exit_now(125)
    }
    // A process limit counts the sandbox's processes of the uid: the fork of the command is
    // the one refused at the limit, so no capability may exempt it.
    if let Some(l) = spec
        .rlimits
        .iter()
        .find(|l| l.resource == RlimitResource::Nproc)
    {
        let lowered = setrlimit(Resource::RLIMIT_NPROC, l.value, l.value)
            .map_err(std::io::Error::from)
            .and_then(|_| sys::get_capabilities())
            .and_then(|caps| {
                sys::set_capabilities(
                    // CAP_SYS_ADMIN = 21, CAP_SYS_RESOURCE = 24 (linux/capability.h).
                    caps & !(1 << 21) & !(1 << 24),
                )
            });
        if let Err(e) = lowered {
            let e = anyhow::Error::from(e).context("applying RLIMIT_NPROC");
            report_setup_error(err_w, e.into())
        }
    }
    let cmd = match sys::fork() {
        Ok(Forked::Child) => {
            drop(relay_w);
            match child(spec, p, None, listener_send.as_ref()) {
                Ok(never) => match never {},
                Err(e) => report_setup_error(err_w, e),
            }
        }
        Ok(Forked::Parent(pid)) => {
            let _ = sys::forward_to(pid, true);
            // Only the command's child may send a listener.
            drop(listener_send);
            pid
        }
        Err(e) => report_setup_error(
            err_w,
            SetupError {
                message: format!("fork: {e}"),
                user_error: false,
                resource_exhausted: e.raw_os_error() == Some(libc::EAGAIN),
            },
        ),
    };
    drop(err_w);
    let (tag, n) = loop {
        match waitpid(None::<Pid>, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == cmd => break (b'E', code),
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == cmd => break (b'S', sig as i32),
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => break (b'S', libc::SIGKILL),
        }
    };
    let mut relay = [tag, 0, 0, 0, 0];
    relay[1..].copy_from_slice(&n.to_le_bytes());
    let _ = std::fs::File::from(relay_w).write_all(&relay);
    sys::exit_now(0)
}

/// In a forked child whose set-up failed: the error to the parent over `err_w` (one tag
/// byte, `U` for the caller's fault, `R` for the sandbox's process limit, else `I`, then the
/// text), then exit 125.
fn report_setup_error(err_w: OwnedFd, e: SetupError) -> ! {
    let tag = if e.user_error {
        "U"
    } else if e.resource_exhausted {
        "R"
    } else {
        "I"
    };
    let _ = write!(std::fs::File::from(err_w), "{tag}{}", e.message);
    sys::exit_now(125)
}

/// The parent's side of a fork: reads the child's error pipe to EOF (execve closed it, or
/// the child wrote a set-up error and exited) and waits for the child, answering the seccomp
/// supervisor's descriptor meanwhile (the command may sit in a notified syscall).
fn wait_setup(
    err_r: OwnedFd,
    pid: Pid,
    mut sup: seccomp::Supervisor,
) -> Result<ExecStatus, SetupError> {
    use nix::sys::signal::{SigSet, Signal};
    use nix::sys::signalfd::{SfdFlags, SignalFd};
    use nix::sys::wait::WaitPidFlag;
    // SIGCHLD is blocked only here, after the fork (the child keeps the old mask), and read
    // through a signalfd; a child that ended before the block is found by the WNOHANG wait
    // below (its SIGCHLD was discarded: SIG_DFL).
    let mut set = SigSet::empty();
    set.add(Signal::SIGCHLD);
    set.thread_block().context("blocking SIGCHLD")?;
    let sfd = SignalFd::with_flags(&set, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .context("signalfd(SIGCHLD)")?;
    let mut err = Some(std::fs::File::from(err_r));
    let mut msg = Vec::new();
    let mut status = None;
    loop {
        if status.is_none() {
            status = match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(_, code)) => Some(ExecStatus::Exited { code }),
                Ok(WaitStatus::Signaled(_, sig, _)) => {
                    Some(ExecStatus::Signaled { signal: sig as i32 })
                }
                Ok(_) | Err(Errno::EINTR) => None,
                Err(e) => return Err(anyhow::anyhow!("waitpid({pid}): {e}").into()),
            };
        }
        if status.is_some() && err.is_none() {
            break;
        }
        let fds = [
            err.as_ref().map_or(-1, |f| f.as_raw_fd()),
            sup.fd().unwrap_or(-1),
            sfd.as_raw_fd(),
        ];
        let ev = sys::poll_in(&fds).context("poll (exec wait)")?;
        if ev[0] != 0 {
            if let Some(f) = err.as_mut() {
                let mut buf = [0u8; 4096];
                match f.read(&mut buf) {
                    Ok(0) => err = None,
                    Ok(n) => msg.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Err(anyhow::anyhow!("reading the child's error pipe: {e}").into())
                    }
                }
            }
        }
        if fds[1] >= 0 {
            sup.ready(ev[1]);
        }
        if ev[2] != 0 {
            while let Ok(Some(_)) = sfd.read_signal() {}
        }
    }
    let status = status.expect("loop ends with a status");
    if let Some((&tag, text)) = msg.split_first() {
        return Err(SetupError {
            message: String::from_utf8_lossy(text).into_owned(),
            user_error: tag == b'U',
            resource_exhausted: tag == b'R',
        });
    }
    Ok(status)
}

fn rlimit_resource(r: RlimitResource) -> Resource {
    match r {
        RlimitResource::Nofile => Resource::RLIMIT_NOFILE,
        RlimitResource::Core => Resource::RLIMIT_CORE,
        RlimitResource::Fsize => Resource::RLIMIT_FSIZE,
        RlimitResource::Stack => Resource::RLIMIT_STACK,
        RlimitResource::Memlock => Resource::RLIMIT_MEMLOCK,
        RlimitResource::Msgqueue => Resource::RLIMIT_MSGQUEUE,
        RlimitResource::Nproc => Resource::RLIMIT_NPROC,
    }
}

/// The forked child: returns only on a set-up error; execve failures end it with
/// 127/126 directly.
///
/// `target` is the sandbox to join (function backend); `None` when this process is already
/// inside the sandbox (`own_pid_ns` mode).
fn child(
    spec: &ExecSpec,
    p: &Prepared,
    target: Option<&Target>,
    listener_send: Option<&OwnedFd>,
) -> Result<std::convert::Infallible, SetupError> {
    // Limits first, with host privileges: raising a hard limit needs CAP_SYS_RESOURCE in
    // the initial user namespace, which is gone after setns(user).
    for l in &spec.rlimits {
        setrlimit(rlimit_resource(l.resource), l.value, l.value)
            .with_context(|| format!("setrlimit({:?}, {})", l.resource, l.value))?;
    }
    if let Some(target) = target {
        setns(target.user.as_fd(), CloneFlags::CLONE_NEWUSER)
            .with_context(|| format!("setns(user) into /proc/{}/ns/user", spec.init_pid))?;
    }
    // A session of its own: no controlling terminal of the node, and the node can signal
    // the whole process group.
    setsid().context("setsid")?;
    // Needs CAP_SETPCAP, which a non-zero uid loses at setresuid: do it before.
    sys::drop_bounding_and_ambient().context("dropping the capability bounding set")?;
    let uid = Uid::from_raw(spec.uid);
    let gid = Gid::from_raw(spec.gid);
    let unmapped = |e: Errno, what: &str, id: u32| -> SetupError {
        if e == Errno::EINVAL {
            SetupError::user(format!("{what} {id} is not mapped in the sandbox"))
        } else {
            anyhow::anyhow!("{what}({id}): {e}").into()
        }
    };
    setgroups(&[]).context("setgroups([])")?;
    setresgid(gid, gid, gid).map_err(|e| unmapped(e, "setresgid", spec.gid))?;
    setresuid(uid, uid, uid).map_err(|e| unmapped(e, "setresuid", spec.uid))?;
    // As the target user, so permissions are checked as they will apply to the command.
    if let Err(e) = chdir(p.cwd.as_c_str()) {
        return Err(SetupError::user(format!(
            "cwd {}: {}",
            spec.cwd,
            sys::strerror(e as i32)
        )));
    }
    if let Some(size) = spec.pty {
        // Returns in the command's process only (the relay never returns).
        pty_split(size)?;
    }
    // Nothing inherited from the node (or opened above) may reach the command; the error
    // pipe stays usable until execve closes it.
    sys::cloexec_from(3).context("close_range(3.., CLOEXEC)")?;
    sys::set_no_new_privs().context("prctl(PR_SET_NO_NEW_PRIVS)")?;
    if spec.landlock {
        fsrules::restrict()?;
    }
    sys::clear_capabilities().context("capset(0)")?;
    sys::reset_signals().context("resetting signal dispositions")?;
    // `None`: the exec init installed the filters before forking us (see
    // `run_prestarted`); they are inherited.
    if let Some(send) = listener_send {
        install_filters(p, send)?;
    }
    exec_search(p)
}

/// Installs the exec filters on the calling thread and hands the listener (if the kernel
/// gives one) to the supervisor over `send`.
fn install_filters(p: &Prepared, send: &OwnedFd) -> Result<(), SetupError> {
    install(&p.filters, send)
}

fn install(filters: &seccomp::Filters, send: &OwnedFd) -> Result<(), SetupError> {
    match seccomp::apply(filters)? {
        seccomp::Installed::Listener(fd) => {
            // Without a supervisor the denied calls would fail with ENOSYS and go
            // unreported: a send failure is an internal error, never a silent run.
            sys::send_fd(send, fd.as_raw_fd())
                .context("sending the seccomp listener to the supervisor")?;
        }
        // gVisor and old kernels: the deny list answers EPERM itself (not reported).
        seccomp::Installed::Silent => {}
    }
    Ok(())
}

/// execve with a PATH search of our own (glibc's execvp would search the PATH of this
/// process's environment, not the command's). Mirrors glibc execvpe: an entry without `/`
/// is tried in each PATH element; EACCES is remembered and the search goes on; ENOENT and
/// ENOTDIR go on; any other error stops it. Never returns.
fn exec_search(p: &Prepared) -> ! {
    let name = p.argv[0].to_string_lossy().into_owned();
    let try_exec = |path: &CString| -> Errno {
        match nix::unistd::execve(path, &p.argv, &p.envp) {
            Ok(never) => match never {},
            Err(e) => e,
        }
    };
    let err = if name.contains('/') {
        try_exec(&p.argv[0])
    } else {
        let mut seen_eacces = false;
        let mut last = Errno::ENOENT;
        for dir in p.path.split(':') {
            let dir = if dir.is_empty() { "." } else { dir };
            let Ok(full) = CString::new(format!("{dir}/{name}")) else {
                continue;
            };
            match try_exec(&full) {
                Errno::EACCES => seen_eacces = true,
                Errno::ENOENT
                | Errno::ENOTDIR
                | Errno::ESTALE
                | Errno::ENODEV
                | Errno::ETIMEDOUT => {}
                e => {
                    last = e;
                    break;
                }
            }
        }
        if last == Errno::ENOENT && seen_eacces {
            Errno::EACCES
        } else {
            last
        }
    };
    let mut stderr = std::io::stderr();
    if err == Errno::ENOENT {
        let what = if name.contains('/') {
            "No such file or directory"
        } else {
            "command not found"
        };
        let _ = writeln!(stderr, "sandlot: {name}: {what}");
        sys::exit_now(127)
    } else {
        let _ = writeln!(stderr, "sandlot: {name}: {}", sys::strerror(err as i32));
        sys::exit_now(126)
    }
}

/// Terminal mode ([`ExecSpec::pty`]), as the sandbox's user, inside its namespaces and
/// root: opens a pseudo-terminal on the sandbox's own devpts (`/dev/ptmx`) with `size`,
/// then forks. The child (the command) starts a session of its own with the slave as its
/// controlling terminal and its stdin, stdout and stderr, and returns to finish the set-up
/// and execve. This process becomes the relay ([`pty_relay`]) and never returns: the
/// process the caller waits for and signals, ending as the command ends.
fn pty_split(size: sandlot_guest::spec::PtySize) -> Result<(), SetupError> {
    use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt};
    let master = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)
        .map_err(|e| SetupError::user(format!("opening /dev/ptmx in the sandbox: {e}")))?;
    grantpt(&master).context("grantpt")?;
    unlockpt(&master).context("unlockpt")?;
    let slave_path = ptsname_r(&master).context("ptsname")?;
    set_winsize(master.as_raw_fd(), size).context("TIOCSWINSZ")?;
    let master: OwnedFd = master.into();
    let exhausted = |e: std::io::Error| SetupError {
        message: format!("fork: {e}"),
        user_error: false,
        resource_exhausted: true,
    };
    match sys::fork().map_err(exhausted)? {
        Forked::Child => {
            drop(master);
            setsid().context("setsid (pty)")?;
            let slave = open(
                slave_path.as_str(),
                OFlag::O_RDWR | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .with_context(|| format!("opening {slave_path}"))?;
            // SAFETY: ioctl with an integer argument on a descriptor we own.
            if unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCSCTTY, 0) } < 0 {
                return Err(anyhow::Error::from(std::io::Error::last_os_error())
                    .context("TIOCSCTTY")
                    .into());
            }
            for fd in 0..3 {
                sys::dup_onto(slave.as_raw_fd(), fd).context("dup2 of the pty slave")?;
            }
            Ok(())
        }
        Forked::Parent(pid) => pty_relay(master, pid),
    }
}

/// TIOCSWINSZ on a terminal descriptor.
fn set_winsize(fd: std::os::fd::RawFd, size: sandlot_guest::spec::PtySize) -> std::io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize through a valid pointer.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The relay of terminal mode: framed input on stdin (`sandlot_guest::spec::pty_frames_take`)
/// goes to the master (bytes) or resizes it; the master's output goes to stdout; forwarded
/// signals go to the command's process group. Once the command has ended and the output is
/// drained (EOF/EIO on the master, or nothing more for a moment: a background child may
/// keep the slave open), it ends the same way: the same exit code, or killed by the same
/// signal.
fn pty_relay(master: OwnedFd, cmd: Pid) -> ! {
    use sandlot_guest::spec::{pty_frames_take, PtyFrame};
    // Keep only stdin, stdout, stderr and the master: the error pipe, the seccomp
    // socket and the rest must not be held open by the relay.
    let m = 3;
    if master.as_raw_fd() != m {
        if sys::dup_onto(master.as_raw_fd(), m).is_err() {
            sys::exit_now(125);
        }
        drop(master);
    } else {
        std::mem::forget(master);
    }
    let _ = sys::close_fds(4, u32::MAX);
    let _ = sys::forward_to(cmd, true);
    let mut input = Vec::new();
    let mut stdin_open = true;
    let mut master_open = true;
    let mut status: Option<WaitStatus> = None;
    let mut buf = vec![0u8; 64 * 1024];
    let mut quiet_rounds = 0;
    loop {
        if status.is_none() {
            match waitpid(cmd, Some(nix::sys::wait::WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(s @ (WaitStatus::Exited(..) | WaitStatus::Signaled(..))) => status = Some(s),
                Ok(_) => {}
                Err(_) => status = Some(WaitStatus::Exited(cmd, 255)),
            }
        }
        if let Some(s) = status {
            if !master_open || quiet_rounds >= 2 {
                match s {
                    WaitStatus::Signaled(_, sig, _) => {
                        let _ = sys::reset_signals();
                        // SAFETY: raising a signal on ourselves.
                        unsafe { libc::kill(libc::getpid(), sig as i32) };
                        sys::exit_now(128 + sig as i32)
                    }
                    WaitStatus::Exited(_, c) => sys::exit_now(c),
                    _ => sys::exit_now(255),
                }
            }
        }
        let mut p = [
            libc::pollfd {
                fd: if stdin_open && status.is_none() {
                    0
                } else {
                    -1
                },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: if master_open { m } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let timeout = if status.is_some() { 50 } else { 100 };
        // SAFETY: `p` is a valid array of two pollfds.
        let n = unsafe { libc::poll(p.as_mut_ptr(), 2, timeout) };
        if n < 0 {
            continue; // EINTR (a forwarded signal)
        }
        if n == 0 {
            if status.is_some() {
                quiet_rounds += 1;
            }
            continue;
        }
        quiet_rounds = 0;
        if p[1].revents != 0 {
            // SAFETY: read into a valid buffer of its length.
            let r = unsafe { libc::read(m, buf.as_mut_ptr().cast(), buf.len()) };
            if r > 0 {
                if write_all_fd(1, &buf[..r as usize]).is_err() {
                    // Nobody reads the output any more: drain silently.
                }
            } else if r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)
            {
                // EIO: every slave descriptor is closed.
                master_open = false;
            }
        }
        if p[0].revents != 0 {
            // SAFETY: read into a valid buffer of its length.
            let r = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
            if r > 0 {
                input.extend_from_slice(&buf[..r as usize]);
                match pty_frames_take(&mut input) {
                    Ok(frames) => {
                        for f in frames {
                            match f {
                                PtyFrame::Data(d) => {
                                    let _ = write_all_fd(m, &d);
                                }
                                PtyFrame::Resize(size) => {
                                    let _ = set_winsize(m, size);
                                }
                            }
                        }
                    }
                    Err(_) => stdin_open = false,
                }
            } else if r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)
            {
                stdin_open = false;
            }
        }
    }
}

/// write(2) until all of `data` is written (EINTR retried).
fn write_all_fd(fd: std::os::fd::RawFd, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        // SAFETY: write from a valid buffer of its length.
        let r = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        data = &data[r as usize..];
    }
    Ok(())
}
