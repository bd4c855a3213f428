//! The few raw syscalls that nix does not wrap (or wraps behind `unsafe`): fork, loopback
//! up, capability dropping, fd sweeping, signal reset. Every `unsafe` block of the binary
//! lives here; each returns `io::Result` at once.
#![warn(clippy::undocumented_unsafe_blocks)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::unistd::{ForkResult, Pid};

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Which side of a fork we are on.
pub enum Forked {
    /// The parent, with the child's pid.
    Parent(Pid),
    /// The child.
    Child,
}

/// fork(2).
///
/// Callers must be single-threaded, so the child may run arbitrary code, not only
/// async-signal-safe functions. `sandlot-guest init` and `exec` never fork once a thread
/// exists: `exec` starts its one extra thread (the seccomp supervisor,
/// [`crate::seccomp::Supervisor`]) in the parent after its last fork.
pub fn fork() -> io::Result<Forked> {
    // SAFETY: the process is single-threaded (`init` and `exec` start no thread; the
    // agent never calls this), so no lock can be held by another thread across the fork.
    match unsafe { nix::unistd::fork() }.map_err(io::Error::from)? {
        ForkResult::Parent { child } => Ok(Forked::Parent(child)),
        ForkResult::Child => Ok(Forked::Child),
    }
}

/// prctl(PR_SET_PDEATHSIG, sig): `sig` is delivered when the parent thread exits.
pub fn set_parent_death_signal(sig: libc::c_int) -> io::Result<()> {
    prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong).map(|_| ())
}

/// True when the read end of the pipe whose write end is `w` is closed everywhere
/// (poll(2) reports `POLLERR` on such a write end).
pub fn reader_gone(w: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: w.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd; timeout 0 never blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n == 1 && pfd.revents & libc::POLLERR != 0
}

/// Sets IFF_UP on the interface `lo` of the current network namespace (SIOCSIFFLAGS on
/// an AF_INET datagram socket, netdevice(7)).
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: plain socket(2) call; the result is checked and owned at once.
    let fd = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` is a fresh descriptor we exclusively own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: `req` is a valid ifreq with a NUL-terminated name; the kernel fills
    // ifru_flags.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: SIOCGIFFLAGS succeeded, so ifru_flags is the active union member.
    unsafe {
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
    }
    // SAFETY: as above; the kernel reads ifr_name and ifru_flags.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) })?;
    Ok(())
}

fn prctl(option: libc::c_int, arg2: libc::c_ulong) -> io::Result<libc::c_int> {
    // SAFETY: prctl with integer arguments only; no pointers are passed.
    cvt(unsafe {
        libc::prctl(
            option,
            arg2,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    })
}

/// PR_SET_DUMPABLE 0: the process cannot be ptraced by processes of the same uid and its
/// /proc files become owned by root (prctl(2)).
pub fn set_non_dumpable() -> io::Result<()> {
    prctl(libc::PR_SET_DUMPABLE, 0).map(drop)
}

/// PR_SET_NO_NEW_PRIVS 1: execve can never grant privileges again (setuid bits, file
/// capabilities); also required for unprivileged seccomp and landlock.
pub fn set_no_new_privs() -> io::Result<()> {
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1).map(drop)
}

/// Removes every capability from the bounding set (PR_CAPBSET_DROP for 0..=last cap) and
/// clears the ambient set. Needs CAP_SETPCAP in the current user namespace, so it must
/// run before switching to a non-zero uid.
pub fn drop_bounding_and_ambient() -> io::Result<()> {
    // Loop until the kernel says EINVAL: that is one past the last capability it knows
    // (avoids depending on /proc/sys/kernel/cap_last_cap being visible).
    for cap in 0..=63 {
        match prctl(libc::PR_CAPBSET_DROP, cap) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
            Err(e) => return Err(e),
        }
    }
    // SAFETY: integer-only prctl.
    let cleared = cvt(unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    });
    match cleared {
        // A kernel without ambient capabilities (gVisor answers EINVAL) has none to clear.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        r => r.map(|_| ()),
    }
}

/// PR_SET_KEEPCAPS: whether the permitted capabilities survive a change of all uids from
/// 0 to non-zero (prctl(2), capabilities(7) "Effect of user ID changes on capabilities").
/// The kernel resets the flag on execve and when the process enters a new user namespace.
pub fn set_keep_caps(keep: bool) -> io::Result<()> {
    prctl(libc::PR_SET_KEEPCAPS, keep as libc::c_ulong).map(drop)
}

/// capset(2) with effective, permitted and inheritable all empty (version 3 header, two
/// 32-bit data words, linux/capability.h).
pub fn clear_capabilities() -> io::Result<()> {
    set_capabilities(0)
}

/// capget(2): the permitted set of this thread (bit n = capability n).
pub fn get_capabilities() -> io::Result<u64> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: v3 header and two data words, as capget(2) requires; both outlive the call.
    let ret = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    cvt(ret as libc::c_int)?;
    Ok(u64::from(data[0].permitted) | (u64::from(data[1].permitted) << 32))
}

/// capset(2): effective and permitted become exactly `caps` (bit n = capability n,
/// linux/capability.h), inheritable empty. Only lowers: the kernel refuses (EPERM) a
/// capability that is not already permitted.
pub fn set_capabilities(caps: u64) -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let word = |i: u32| (caps >> (32 * i)) as u32;
    let data = [
        Data {
            effective: word(0),
            permitted: word(0),
            inheritable: 0,
        },
        Data {
            effective: word(1),
            permitted: word(1),
            inheritable: 0,
        },
    ];
    // SAFETY: header and data match the kernel's v3 layout; data has the two elements v3
    // requires; both outlive the call.
    let ret = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    cvt(ret as libc::c_int).map(drop)
}

/// Marks every descriptor >= `from` close-on-exec (close_range(2) with
/// CLOSE_RANGE_CLOEXEC, Linux 5.11), so nothing inherited leaks into the command while
/// the descriptors this process still needs keep working until execve.
pub fn cloexec_from(from: RawFd) -> io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range with integer arguments; it does not close anything here.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            from as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    };
    match cvt(ret as libc::c_int) {
        Ok(_) => Ok(()),
        // Kernels without CLOSE_RANGE_CLOEXEC (before 5.11, gVisor): flag each open fd.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
            let fds: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")?
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .filter(|fd| *fd >= from)
                .collect();
            for fd in fds {
                // EBADF: the read_dir fd itself, closed by now.
                match set_cloexec(fd) {
                    Err(e) if e.raw_os_error() == Some(libc::EBADF) => {}
                    r => r?,
                }
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Closes every descriptor in `from..=to` (close_range(2)).
pub fn close_fds(from: RawFd, to: libc::c_uint) -> io::Result<()> {
    // SAFETY: close_range on descriptors this process owns; the caller moved the ones it
    // still needs outside the range and holds no Rust owner of the closed ones.
    let ret = unsafe { libc::syscall(libc::SYS_close_range, from as libc::c_uint, to, 0u32) };
    cvt(ret as libc::c_int).map(drop)
}

/// dup2(2) then forget the source; the target descriptor is not close-on-exec.
pub fn dup_onto(fd: RawFd, target: RawFd) -> io::Result<()> {
    // SAFETY: dup2 on raw integers; no Rust owner of `target` exists in the caller.
    cvt(unsafe { libc::dup2(fd, target) }).map(drop)
}

/// Sets FD_CLOEXEC on one descriptor.
pub fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) }).map(drop)
}

/// Restores every signal's disposition to SIG_DFL and empties the signal mask, so the
/// command starts as if from a clean shell: SIG_IGN survives execve (signal(7)) and Rust's
/// runtime ignores SIGPIPE, which a command must not inherit.
pub fn reset_signals() -> io::Result<()> {
    for sig in 1..libc::SIGRTMAX() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: installing SIG_DFL never runs Rust code in a handler; errors (EINVAL on
        // signals glibc reserves) are ignored on purpose.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
    // glibc refuses its own internal signals (SIGCANCEL and SIGSETXID, 32 and 33: signal(2)
    // answers EINVAL), but its posix_spawn(3) leaves them ignored in the child, and an
    // ignored signal stays ignored across execve: the kernel's rt_sigaction resets them
    // (the kernel's `struct sigaction`: handler, flags, restorer, mask; all zero = SIG_DFL).
    #[repr(C)]
    struct KernelSigaction {
        handler: usize,
        flags: libc::c_ulong,
        restorer: usize,
        mask: u64,
    }
    let dfl = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    for sig in 32..libc::SIGRTMIN() {
        // SAFETY: the kernel reads `dfl` (valid for the call) and writes nothing (null old
        // action); SIG_DFL runs no code.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                &dfl as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                std::mem::size_of::<u64>(),
            );
        }
    }
    unblock_all_signals()
}

/// Empties the signal mask.
pub fn unblock_all_signals() -> io::Result<()> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it; sigprocmask reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        cvt(libc::sigprocmask(
            libc::SIG_SETMASK,
            &set,
            std::ptr::null_mut(),
        ))?;
    }
    Ok(())
}

/// Blocks SIGCHLD and waits for one (sigwait(3)); used by the init's reaping loop so it
/// sleeps while there is nothing to reap (waitpid(-1) alone would spin on ECHILD while
/// the sandbox has no orphan yet).
pub struct ChildSignal {
    set: libc::sigset_t,
}

impl ChildSignal {
    /// Sets SIGCHLD to SIG_DFL (not SIG_IGN, which would auto-reap and hide exits) and
    /// blocks it so it stays pending until [`ChildSignal::wait`].
    pub fn block() -> io::Result<Self> {
        // SAFETY: as in reset_signals; sigset_t initialised by sigemptyset before use.
        unsafe {
            libc::signal(libc::SIGCHLD, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGCHLD);
            cvt(libc::sigprocmask(
                libc::SIG_BLOCK,
                &set,
                std::ptr::null_mut(),
            ))?;
            Ok(Self { set })
        }
    }

    /// Sleeps until a SIGCHLD is pending, then consumes it.
    pub fn wait(&self) {
        let mut sig: libc::c_int = 0;
        // SAFETY: `self.set` is an initialised sigset; `sig` is a valid out pointer.
        unsafe {
            libc::sigwait(&self.set, &mut sig);
        }
    }
}

/// strerror-like text of an errno value, without the " (os error N)" suffix std adds.
pub fn strerror(errno: i32) -> String {
    let s = io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Takes ownership of a descriptor the process inherited (e.g. fd 3 and 4 of
/// `sandlot-guest exec`), after checking that it is open.
///
/// # Errors
/// EBADF when the parent did not pass it.
pub fn inherited_fd(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_GETFD only queries the descriptor's flags.
    cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: the descriptor is open and nothing else in this process owns it: it was
    // inherited and this function is called once per number at startup.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Terminates the process at once without running exit handlers (_exit(2)); used in a
/// forked child after a failed execve.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit has no preconditions and never returns.
    unsafe { libc::_exit(code) }
}

/// Signals an exec helper forwards (see [`sandlot_guest::spec::FORWARDED_SIGNALS`]).
pub const FORWARDED: [libc::c_int; 11] = sandlot_guest::spec::FORWARDED_SIGNALS;

/// Where [`forward_handler`] sends what it catches: a pid (> 0) or nothing yet (0).
static FORWARD_TO: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// Whether the target is a process group leader (`kill(-pid)` first).
static FORWARD_GROUP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn forward_handler(sig: libc::c_int) {
    use std::sync::atomic::Ordering;
    let to = FORWARD_TO.load(Ordering::SeqCst);
    if to <= 0 {
        return;
    }
    // SAFETY: kill(2) is async-signal-safe; errno is saved and restored around it so the
    // interrupted code never sees it change.
    unsafe {
        let errno = *libc::__errno_location();
        if !FORWARD_GROUP.load(Ordering::SeqCst) || libc::kill(-to, sig) != 0 {
            // Before setsid(2) the group does not exist yet: the leader alone (it has the
            // signal blocked until it resets its dispositions, then dies of it).
            libc::kill(to, sig);
        }
        *libc::__errno_location() = errno;
    }
}

fn forwarded_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before sigaddset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in FORWARDED {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the [`FORWARDED`] signals and installs the forwarding handler for them (with
/// `SA_RESTART`). They stay pending until [`forward_to`] names the target: a signal sent
/// while the command is being set up is delivered, never lost. Children forked while they
/// are blocked inherit the mask; [`reset_signals`] (just before execve) restores the
/// defaults and delivers what is pending.
pub fn start_forwarding() -> io::Result<()> {
    let set = forwarded_set();
    // SAFETY: `set` is initialised; the sigaction struct is zeroed then filled; the
    // handler only calls async-signal-safe functions.
    unsafe {
        cvt(libc::sigprocmask(
            libc::SIG_BLOCK,
            &set,
            std::ptr::null_mut(),
        ))?;
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = forward_handler as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigfillset(&mut sa.sa_mask);
        for s in FORWARDED {
            cvt(libc::sigaction(s, &sa, std::ptr::null_mut()))?;
        }
    }
    Ok(())
}

/// Names the process (`group`: and its process group) that caught signals go to, then
/// unblocks them, which delivers the pending ones.
pub fn forward_to(pid: Pid, group: bool) -> io::Result<()> {
    use std::sync::atomic::Ordering;
    FORWARD_GROUP.store(group, Ordering::SeqCst);
    FORWARD_TO.store(pid.as_raw(), Ordering::SeqCst);
    let set = forwarded_set();
    // SAFETY: `set` is initialised.
    unsafe {
        cvt(libc::sigprocmask(
            libc::SIG_UNBLOCK,
            &set,
            std::ptr::null_mut(),
        ))?;
    }
    Ok(())
}

/// For a spawner's `pre_exec`: blocks the [`FORWARDED`] signals in the forked child, so a
/// helper cannot die of one before [`start_forwarding`] runs. Async-signal-safe.
pub fn block_forwarded_raw() -> io::Result<()> {
    let set = forwarded_set();
    // SAFETY: `set` is initialised; sigprocmask is async-signal-safe.
    cvt(unsafe { libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) }).map(|_| ())
}

/// seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, prog): installs the
/// filter on the calling thread and returns its user-notification listener
/// (seccomp_unotify(2), Linux 5.0). Requires no_new_privs.
///
/// # Errors
/// The kernel's: EINVAL where the flag is unknown (older kernels; gVisor), EBUSY when a
/// filter of this task already has a listener.
pub fn seccomp_new_listener(prog: &[seccompiler::sock_filter]) -> io::Result<OwnedFd> {
    let len = u16::try_from(prog.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let fprog = libc::sock_fprog {
        len,
        // seccompiler::sock_filter is #[repr(C)] {u16, u8, u8, u32}, the layout of
        // libc::sock_filter (linux/filter.h); the kernel only reads through the pointer.
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `fprog` points at `prog`, which outlives the call; the kernel copies it.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &fprog as *const libc::sock_fprog,
        )
    };
    let fd = cvt(ret as libc::c_int)?;
    // SAFETY: a new descriptor the kernel just returned; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_cloexec(fd.as_raw_fd())?;
    Ok(fd)
}

/// A unix stream socket pair, both ends close-on-exec.
pub fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid out array of two ints.
    cvt(unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    })?;
    // SAFETY: two new descriptors owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

const FD_CMSG_SPACE: usize = 64;

/// Sends one byte and `fd` (SCM_RIGHTS, unix(7)) over the socket `sock`.
pub fn send_fd(sock: &OwnedFd, fd: RawFd) -> io::Result<()> {
    let mut byte = [b'L'];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; FD_CMSG_SPACE / 8];
    // SAFETY: msghdr is plain data; every pointer set below refers to live locals; the
    // CMSG_* macros stay within `cbuf` (CMSG_SPACE(4) = 24 <= 64 bytes).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        let n = libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Receives what [`send_fd`] sent: `Ok(None)` on EOF or a message without a descriptor.
pub fn recv_fd(sock: &OwnedFd) -> io::Result<Option<OwnedFd>> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; FD_CMSG_SPACE / 8];
    // SAFETY: as in send_fd; the kernel writes at most msg_controllen bytes into `cbuf`;
    // a received descriptor is owned by nothing else yet.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = FD_CMSG_SPACE as _;
        let n = libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Ok(None);
        }
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            return Ok(None);
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
        Ok(Some(OwnedFd::from_raw_fd(fd)))
    }
}

/// poll(2) for `POLLIN` on each descriptor (negative ones are ignored, poll(2)), without a
/// timeout; returns each one's `revents`. EINTR is retried.
pub fn poll_in(fds: &[RawFd]) -> io::Result<Vec<libc::c_short>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `p` is a valid array of `p.len()` pollfds.
        let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, -1) };
        if n >= 0 {
            return Ok(p.iter().map(|x| x.revents).collect());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// SECCOMP_IOCTL_NOTIF_RECV: the next pending notification of `listener`
/// (seccomp_unotify(2)). ENOENT: the target died before it was received.
pub fn notif_recv(listener: &OwnedFd) -> io::Result<libc::seccomp_notif> {
    // SAFETY: seccomp_notif is plain data and must be zeroed before RECV (the kernel
    // checks); the ioctl writes at most size_of::<seccomp_notif>() bytes into it.
    unsafe {
        let mut n: libc::seccomp_notif = std::mem::zeroed();
        cvt(libc::ioctl(
            listener.as_raw_fd(),
            libc::SECCOMP_IOCTL_NOTIF_RECV,
            &mut n as *mut libc::seccomp_notif,
        ))?;
        Ok(n)
    }
}

/// SECCOMP_IOCTL_NOTIF_SEND: the notified syscall `id` fails with `errno` in its caller.
/// ENOENT: the target died (or its syscall was interrupted) meanwhile.
pub fn notif_send_errno(listener: &OwnedFd, id: u64, errno: i32) -> io::Result<()> {
    let mut resp = libc::seccomp_notif_resp {
        id,
        val: 0,
        error: -errno,
        flags: 0,
    };
    // SAFETY: `resp` is a valid seccomp_notif_resp the kernel only reads.
    cvt(unsafe {
        libc::ioctl(
            listener.as_raw_fd(),
            libc::SECCOMP_IOCTL_NOTIF_SEND,
            &mut resp as *mut libc::seccomp_notif_resp,
        )
    })
    .map(drop)
}

/// clone(2) with `CLONE_PARENT`, otherwise like fork(2): the child's parent is the
/// caller's parent, not the caller (the guest agent's zygote makes exec helpers that are
/// the agent's children, see `crate::zygote`). The exit signal is the caller's own
/// (SIGCHLD for a forked caller; clone(2): "CLONE_PARENT ... the exit signal of the
/// calling process"). The kernel refuses it (EINVAL) to the init of a pid namespace.
///
/// Same contract as [`fork`]: the caller must be single-threaded. Unlike glibc's fork this
/// runs no atfork handlers and leaves glibc's cached thread id of the child at the
/// caller's value; neither matters to a single-threaded caller that holds no lock (glibc
/// ≥ 2.34 asks the kernel for the thread id in raise/abort, and its next fork stores the
/// right one again).
pub fn clone_parent() -> io::Result<Forked> {
    // SAFETY: clone without CLONE_VM and with a null stack duplicates the caller like
    // fork(2): the child continues on its own copy of the stack, returning 0 from the
    // syscall wrapper. The caller is single-threaded (see above).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    match ret {
        r if r < 0 => Err(io::Error::last_os_error()),
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(Pid::from_raw(pid as i32))),
    }
}

/// A unix `SOCK_SEQPACKET` socket pair (message boundaries kept, EOF when the peer is
/// gone), both ends close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid out array of two ints.
    cvt(unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    })?;
    // SAFETY: two new descriptors owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Most descriptors [`recv_fds`] takes in one message.
pub const MAX_FDS: usize = 8;

/// Sends `data` with `fds` (SCM_RIGHTS, unix(7)) as one message over `sock`; never raises
/// SIGPIPE (EPIPE when the peer is gone). EINTR is retried.
pub fn send_fds(sock: &OwnedFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    if fds.len() > MAX_FDS || data.is_empty() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let iov = [io::IoSlice::new(data)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    loop {
        match sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one message of [`send_fds`] into `buf`: its length (0 on EOF) and the
/// descriptors it carried (close-on-exec). EINTR is retried; EMSGSIZE when it carried more
/// than [`MAX_FDS`] (the descriptors that did arrive then stay open: only a peer that
/// breaks the protocol sends that many, and a helper closes all but its 0-4).
pub fn recv_fds(sock: &OwnedFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut cbuf = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg = loop {
        match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cbuf),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
    }
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: descriptors the kernel just installed for us, owned by nothing else.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok((msg.bytes, fds))
}

/// F_DUPFD_CLOEXEC: a close-on-exec copy of `fd` numbered `min` or higher.
pub fn dup_at_least(fd: RawFd, min: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl with integer arguments; a new descriptor is owned by nothing else.
    let n = cvt(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, min) })?;
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}
