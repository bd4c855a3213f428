//! The seccomp-bpf deny list applied to every command right before execve.
//!
//! Modelled on Docker's default profile (moby `profiles/seccomp/default.json`), written as
//! a deny list (default action Allow): the namespaces, user namespace and dropped
//! capabilities already make most of these calls fail, so the filter is defence in depth
//! against kernel bugs reachable through them. Denied calls return EPERM, except clone3,
//! which returns ENOSYS so that glibc falls back to clone(2), whose flags a classic BPF
//! filter can inspect (clone3 passes them in a struct behind a pointer).
//!
//! Two filters are installed because seccompiler gives one match action per filter; the
//! kernel runs both and keeps the most restrictive verdict (seccomp(2), "Filter return
//! values"), and no syscall is matched by both.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

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

/// Syscalls refused outright (EPERM).
fn denied_syscalls() -> Vec<i64> {
    let mut v = vec![
        // file systems and namespaces: the sandbox's view is fixed by the node
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_open_by_handle_at, // CVE-2014-3519 style escapes ("shocker")
        libc::SYS_name_to_handle_at,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_move_mount,
        libc::SYS_open_tree,
        libc::SYS_mount_setattr,
        libc::SYS_quotactl,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_acct,
        // kernel attack surface with a long CVE history
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        // io_uring: a large kernel attack surface with a history of privilege escalations
        // (e.g. CVE-2022-29582, CVE-2023-2598); Docker's default profile denies it too.
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_userfaultfd,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_lookup_dcookie,
        libc::SYS_fanotify_init,
        libc::SYS_kcmp,
        libc::SYS_mbind,
        libc::SYS_set_mempolicy,
        libc::SYS_move_pages,
        // modules, kexec, reboot
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_reboot,
        // other processes' memory
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        // host-wide state: clocks, names, kernel log
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_adjtimex,
        libc::SYS_sethostname,
        libc::SYS_setdomainname,
        libc::SYS_syslog,
        libc::SYS_vhangup,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([libc::SYS_iopl, libc::SYS_ioperm]);
    v
}

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition> {
    SeccompCondition::new(arg, len, op, value).context("seccomp: building a condition")
}

/// Builds the two BPF programs (EPERM list, ENOSYS list) for the running architecture.
///
/// # Errors
/// Unknown architecture or an invalid rule (a bug).
pub fn build() -> Result<[BpfProgram; 2]> {
    let arch = TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| anyhow::anyhow!("seccomp: architecture {}: {e:?}", std::env::consts::ARCH))?;

    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in denied_syscalls() {
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
    Ok([eperm.try_into()?, enosys.try_into()?])
}

/// Installs the programs built by [`build`] on the calling thread. Requires
/// no_new_privs (or CAP_SYS_ADMIN).
///
/// # Errors
/// The kernel refused the filter.
pub fn apply(progs: &[BpfProgram; 2]) -> Result<()> {
    for p in progs {
        seccompiler::apply_filter(p).context("seccomp: installing the filter")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_compile_for_this_arch() {
        let [a, b] = build().unwrap();
        // arch check + at least one instruction per denied syscall
        assert!(a.len() > denied_syscalls().len());
        assert!(!b.is_empty());
    }
}
