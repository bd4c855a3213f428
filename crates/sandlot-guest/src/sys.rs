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
/// Callers must be single-threaded (`sandlot-guest` never starts a thread), so the child
/// may run arbitrary code, not only async-signal-safe functions.
pub fn fork() -> io::Result<Forked> {
    // SAFETY: the process is single-threaded (no tokio, no std::thread anywhere in this
    // binary), so no lock can be held by another thread across the fork.
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
