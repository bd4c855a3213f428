//! The exec deny lists: the syscalls every `sandlot-guest exec` refuses with EPERM and
//! reports (seccomp user notification, see the binary's `seccomp` module), as
//! `(number, name)` tables. The node reads them too, to name the refusals gVisor's sentry
//! logs (`backends/gvisor_audit.rs`), so there is one list.

/// `(number, name)` entries of the syscall tables below, from `libc::SYS_*` constants
/// (the name keeps its `SYS_` prefix; [`syscall_name`] drops it).
macro_rules! sys_entry {
    ($($name:ident),* $(,)?) => { [$((libc::$name, stringify!($name))),*] };
}

/// Syscalls refused outright (EPERM, reported), with their names.
pub fn denied_syscalls() -> Vec<(i64, &'static str)> {
    let mut v = sys_entry![
        // file systems and namespaces: the sandbox's view is fixed by the node
        SYS_mount,
        SYS_umount2,
        SYS_pivot_root,
        SYS_unshare,
        SYS_setns,
        SYS_open_by_handle_at, // CVE-2014-3519 style escapes ("shocker")
        SYS_name_to_handle_at,
        SYS_fsopen,
        SYS_fsconfig,
        SYS_fsmount,
        SYS_fspick,
        SYS_move_mount,
        SYS_open_tree,
        SYS_mount_setattr,
        SYS_quotactl,
        SYS_swapon,
        SYS_swapoff,
        SYS_acct,
        // kernel attack surface with a long CVE history
        SYS_bpf,
        SYS_perf_event_open,
        // io_uring: a large kernel attack surface with a history of privilege escalations
        // (e.g. CVE-2022-29582, CVE-2023-2598); Docker's default profile denies it too.
        SYS_io_uring_setup,
        SYS_io_uring_enter,
        SYS_io_uring_register,
        SYS_userfaultfd,
        SYS_keyctl,
        SYS_add_key,
        SYS_request_key,
        SYS_lookup_dcookie,
        SYS_fanotify_init,
        SYS_kcmp,
        SYS_mbind,
        SYS_set_mempolicy,
        SYS_move_pages,
        // modules, kexec, reboot
        SYS_init_module,
        SYS_finit_module,
        SYS_delete_module,
        SYS_kexec_load,
        SYS_kexec_file_load,
        SYS_reboot,
        // other processes' memory
        SYS_ptrace,
        SYS_process_vm_readv,
        SYS_process_vm_writev,
        // host-wide state: clocks, names, kernel log
        SYS_settimeofday,
        SYS_clock_settime,
        SYS_clock_adjtime,
        SYS_adjtimex,
        SYS_sethostname,
        SYS_setdomainname,
        SYS_syslog,
        SYS_vhangup,
    ]
    .to_vec();
    #[cfg(target_arch = "x86_64")]
    v.extend(sys_entry![SYS_iopl, SYS_ioperm]);
    v
}

/// Syscalls refused only with some arguments (EPERM, reported), with their names.
pub const CONDITIONAL: [(i64, &str); 5] = sys_entry![
    SYS_clone,
    SYS_personality,
    SYS_socket,
    SYS_mknod,
    SYS_mknodat
];

/// Name of a syscall of the deny lists (`None` for any other number).
pub fn syscall_name(nr: i64) -> Option<&'static str> {
    denied_syscalls()
        .into_iter()
        .chain(CONDITIONAL)
        .find(|(n, _)| *n == nr)
        .map(|(_, name)| name.trim_start_matches("SYS_"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_denied_syscall_has_a_name() {
        assert_eq!(syscall_name(libc::SYS_mount), Some("mount"));
        assert_eq!(syscall_name(libc::SYS_mknodat), Some("mknodat"));
        assert_eq!(syscall_name(libc::SYS_read), None);
        for (nr, name) in denied_syscalls() {
            assert_eq!(syscall_name(nr), name.strip_prefix("SYS_"));
        }
    }
}
