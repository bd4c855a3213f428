//! The seccomp-bpf deny list applied to every command right before execve.
//!
//! Modelled on Docker's default profile (moby `profiles/seccomp/default.json`), written as
//! a deny list (default action Allow): the namespaces, user namespace and dropped
//! capabilities already make most of these calls fail, so the filter is defence in depth
//! against kernel bugs reachable through them. Denied calls fail with EPERM, except clone3,
//! which returns ENOSYS so that glibc falls back to clone(2), whose flags a classic BPF
//! filter can inspect (clone3 passes them in a struct behind a pointer).
//!
//! **Reporting.** The deny list's verdict is `SECCOMP_RET_USER_NOTIF` (seccomp_unotify(2),
//! Linux 5.0): the command's child installs it with `SECCOMP_FILTER_FLAG_NEW_LISTENER` and
//! passes the listener over a socket pair (SCM_RIGHTS) to the `sandlot-guest exec` process
//! that forked it, which is outside the filter. Its [`Supervisor`] (in the helper's wait
//! loop) answers every
//! notification with `-EPERM` (the command sees exactly what a plain `SECCOMP_RET_ERRNO`
//! gives) and writes a [`Violation`] record on fd 4 at once, so the node learns of the
//! attempt even when the exec later times out. The filter is never relaxed: the supervisor
//! only ever answers EPERM, and if it is gone (killed, listener closed) the kernel fails the
//! call with ENOSYS. Where the kernel refuses the listener flag (gVisor's sentry, kernels
//! before 5.0) the same list is installed with `SECCOMP_RET_ERRNO(EPERM)`: still refused,
//! not reported ([`Installed::Silent`]).
//!
//! Precedence: the kernel runs every filter of the task and keeps the highest-precedence
//! verdict (seccomp(2), "Filter return values": KILL > TRAP > ERRNO > USER_NOTIF > TRACE >
//! LOG > ALLOW), so any outer filter that answers ERRNO for a call of this list pre-empts the
//! report. The container backend's OCI profile therefore answers `SCMP_ACT_LOG`, not ERRNO,
//! for the calls listed here (`sandlot-node` `backends/container.rs`).
//!
//! Two filters are installed because seccompiler gives one match action per filter (and
//! knows no USER_NOTIF action: the notify program is the EPERM program with its return
//! instructions rewritten); no syscall is matched by both.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use sandlot_guest::spec::{Violation, MAX_VIOLATIONS_PER_EXEC};
use sandlot_guest::syscalls::{denied_syscalls, syscall_name};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::sys;

/// clone(2) namespace flags: NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID |
/// NEWNET (Docker's mask 0x7E020000). CLONE_NEWTIME (0x80) is not in the list: for clone(2)
/// that bit is part of the exit signal, and a new time namespace needs clone3 or unshare,
/// both refused.
const CLONE_NEW_FLAGS: [u64; 7] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
];

/// personality(2) values Docker allows: PER_LINUX, PER_LINUX32 (8), UNAME26 (0x20000),
/// PER_LINUX32|UNAME26, and 0xffffffff (query). Anything else (e.g. ADDR_NO_RANDOMIZE,
/// READ_IMPLIES_EXEC) weakens exploit mitigations.
const PERSONALITY_ALLOWED: [u64; 5] = [0, 8, 0x20000, 0x20008, 0xffff_ffff];

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition> {
    SeccompCondition::new(arg, len, op, value).context("seccomp: building a condition")
}

/// The exec filters, built before the fork ([`build`]).
#[derive(Clone)]
pub struct Filters {
    /// The deny list, verdict `SECCOMP_RET_USER_NOTIF`.
    notify: BpfProgram,
    /// The same list, verdict `SECCOMP_RET_ERRNO(EPERM)` (where no listener can be had).
    eperm: BpfProgram,
    /// clone3 → ENOSYS.
    enosys: BpfProgram,
}

/// Builds the exec filters for the running architecture.
///
/// # Errors
/// Unknown architecture or an invalid rule (a bug).
pub fn build() -> Result<Filters> {
    let arch = TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| anyhow::anyhow!("seccomp: architecture {}: {e:?}", std::env::consts::ARCH))?;

    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (nr, _) in denied_syscalls() {
        rules.insert(nr, vec![]);
    }
    // clone: refuse when any namespace flag is set. Rules are OR'ed, one per flag. Flags
    // are arg0 on x86_64 and aarch64.
    let mut clone_rules = Vec::new();
    for flag in CLONE_NEW_FLAGS {
        clone_rules.push(SeccompRule::new(vec![cond(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )?])?);
    }
    rules.insert(libc::SYS_clone, clone_rules);
    // personality: refuse any value outside the allow list (conditions are AND'ed).
    let mut pers = Vec::new();
    for v in PERSONALITY_ALLOWED {
        pers.push(cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, v)?);
    }
    rules.insert(libc::SYS_personality, vec![SeccompRule::new(pers)?]);
    // socket: no packet sockets and no raw IP sockets (sniffing/spoofing if a network is
    // ever attached). SOCK_RAW is the low 4 bits of the type (the rest are SOCK_CLOEXEC
    // etc.). Raw *netlink* sockets stay allowed: glibc's getaddrinfo (AI_ADDRCONFIG) and
    // getifaddrs, `ip` and Python's socket module open AF_NETLINK/SOCK_RAW, and netlink in
    // a namespace owned by the host user namespace grants the sandbox nothing.
    let raw_ip = |family: i32| -> Result<SeccompRule> {
        Ok(SeccompRule::new(vec![
            cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, family as u64)?,
            cond(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xf),
                libc::SOCK_RAW as u64,
            )?,
        ])?)
    };
    // mknod/mknodat of character and block devices (CAP_MKNOD is gone too; this makes the
    // attempt reported). FIFOs, sockets and regular files stay allowed.
    let device = |arg: u8| -> Result<Vec<SeccompRule>> {
        [libc::S_IFCHR, libc::S_IFBLK]
            .into_iter()
            .map(|t| {
                Ok(SeccompRule::new(vec![cond(
                    arg,
                    SeccompCmpArgLen::Dword,
                    SeccompCmpOp::MaskedEq(libc::S_IFMT as u64),
                    t as u64,
                )?])?)
            })
            .collect()
    };
    rules.insert(libc::SYS_mknod, device(1)?);
    rules.insert(libc::SYS_mknodat, device(2)?);
    rules.insert(
        libc::SYS_socket,
        vec![
            SeccompRule::new(vec![cond(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                libc::AF_PACKET as u64,
            )?])?,
            raw_ip(libc::AF_INET)?,
            raw_ip(libc::AF_INET6)?,
        ],
    );
    let eperm = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;

    let mut enosys_rules = BTreeMap::new();
    enosys_rules.insert(libc::SYS_clone3, vec![]);
    let enosys = SeccompFilter::new(
        enosys_rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    let eperm: BpfProgram = eperm.try_into()?;
    let notify = with_verdict(
        &eperm,
        libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        libc::SECCOMP_RET_USER_NOTIF,
    )?;
    Ok(Filters {
        notify,
        eperm,
        enosys: enosys.try_into()?,
    })
}

/// `prog` with every `BPF_RET K` returning `from` changed to return `to`.
fn with_verdict(prog: &BpfProgram, from: u32, to: u32) -> Result<BpfProgram> {
    const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K (linux/bpf_common.h)
    let mut out = prog.clone();
    let mut n = 0;
    for ins in &mut out {
        if ins.code == BPF_RET_K && ins.k == from {
            ins.k = to;
            n += 1;
        }
    }
    anyhow::ensure!(n > 0, "seccomp: no return of {from:#x} in the deny program");
    Ok(out)
}

/// What [`apply`] installed.
pub enum Installed {
    /// The deny list reports through this user-notification listener (to be sent to the
    /// supervisor).
    Listener(OwnedFd),
    /// The deny list answers EPERM itself, unreported: the kernel refused
    /// `SECCOMP_FILTER_FLAG_NEW_LISTENER` (EINVAL from gVisor's sentry and kernels before
    /// 5.0; EBUSY when an outer filter of the task already has a listener).
    Silent,
}

/// Installs the filters on the calling thread. Requires no_new_privs (or CAP_SYS_ADMIN).
///
/// # Errors
/// The kernel refused a filter (other than the listener flag, which falls back to
/// [`Installed::Silent`]).
pub fn apply(f: &Filters) -> Result<Installed> {
    seccompiler::apply_filter(&f.enosys).context("seccomp: installing the clone3 filter")?;
    match sys::seccomp_new_listener(&f.notify) {
        Ok(fd) => Ok(Installed::Listener(fd)),
        Err(_) => {
            seccompiler::apply_filter(&f.eperm).context("seccomp: installing the deny filter")?;
            Ok(Installed::Silent)
        }
    }
}

/// The seccomp supervisor of one exec, driven by the exec helper's wait loop (no thread:
/// after setns(pid) or unshare(CLONE_NEWPID) the kernel refuses CLONE_THREAD, clone(2)
/// EINVAL). It receives the command's listener over a socket, answers each notification
/// with EPERM and writes one [`Violation`] JSON document per attempt (up to
/// [`MAX_VIOLATIONS_PER_EXEC`]) on the status output at once.
pub struct Supervisor {
    /// The parent's end of the socket pair, until the listener (or EOF) came.
    sock: Option<OwnedFd>,
    listener: Option<OwnedFd>,
    out: std::fs::File,
    reported: usize,
}

impl Supervisor {
    /// `sock`: the parent's end of the socket pair the command's child sends its listener
    /// on; `out`: a duplicate of the status descriptor (fd 4).
    pub fn new(sock: OwnedFd, out: std::fs::File) -> Self {
        Self {
            sock: Some(sock),
            listener: None,
            out,
            reported: 0,
        }
    }

    /// The descriptor to poll for `POLLIN` now, if any.
    pub fn fd(&self) -> Option<RawFd> {
        self.listener
            .as_ref()
            .or(self.sock.as_ref())
            .map(|f| f.as_raw_fd())
    }

    /// Handles the `revents` poll(2) gave for [`Supervisor::fd`].
    pub fn ready(&mut self, revents: libc::c_short) {
        if revents == 0 {
            return;
        }
        if let Some(listener) = &self.listener {
            if revents & libc::POLLIN != 0 {
                match sys::notif_recv(listener) {
                    Ok(n) => {
                        // ENOENT: the caller died or was interrupted; nothing to answer.
                        let _ = sys::notif_send_errno(listener, n.id, libc::EPERM);
                        self.report(&n);
                    }
                    // The target died between poll and receive, or a signal.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINTR)) => {}
                    Err(_) => self.listener = None,
                }
            } else {
                // POLLHUP: every task under the filter is gone.
                self.listener = None;
            }
            return;
        }
        if let Some(sock) = &self.sock {
            match sys::recv_fd(sock) {
                Ok(Some(fd)) => {
                    self.listener = Some(fd);
                    self.sock = None;
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // EOF: the command's child ended or installed no listener (gVisor).
                _ => self.sock = None,
            }
        }
    }

    fn report(&mut self, n: &libc::seccomp_notif) {
        if self.reported >= MAX_VIOLATIONS_PER_EXEC {
            return;
        }
        self.reported += 1;
        let v = Violation {
            syscall: syscall_name(i64::from(n.data.nr))
                .map_or_else(|| format!("syscall_{}", n.data.nr), str::to_owned),
            nr: n.data.nr,
            arch: n.data.arch,
            pid: n.pid,
            time_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        };
        let mut doc = serde_json::to_value(&v).expect("Violation serialises");
        doc["kind"] = "violation".into();
        let mut line = serde_json::to_vec(&doc).expect("JSON serialises");
        line.push(b'\n');
        let _ = self.out.write_all(&line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_compile_for_this_arch() {
        let f = build().unwrap();
        // arch check + at least one instruction per denied syscall
        assert!(f.eperm.len() > denied_syscalls().len());
        assert!(!f.enosys.is_empty());
        // the notify program is the EPERM one with its verdict swapped, nothing else
        assert_eq!(f.notify.len(), f.eperm.len());
        let ret = |p: &BpfProgram, k: u32| p.iter().filter(|i| i.code == 0x06 && i.k == k).count();
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        assert!(ret(&f.eperm, eperm) > 0);
        assert_eq!(ret(&f.notify, eperm), 0);
        assert_eq!(
            ret(&f.notify, libc::SECCOMP_RET_USER_NOTIF),
            ret(&f.eperm, eperm)
        );
    }
}
