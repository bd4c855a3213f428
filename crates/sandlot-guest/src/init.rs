//! `sandlot-guest init`: builds a function sandbox and leaves its pid 1 running.
//!
//! Protocol: [`sandlot_guest::spec::InitSpec`] JSON on stdin, one
//! [`sandlot_guest::spec::InitReady`] JSON line on stdout, exit 0; on failure a message
//! naming the step and path on stderr, exit 1, and no process left behind.
//!
//! Two processes take part: the *outer* (the process the node started, host root in the
//! host namespaces) and the *init* (its child, pid 1 of the new pid namespace). They talk
//! over two pipes: init → outer carries one-byte tags (`U`: user namespace created, write
//! my id maps; `R`: ready) or `E` followed by an error text up to EOF; outer → init carries
//! `G` (maps written, go on).
//!
//! The outer only unshares the pid namespace (a fork is needed to enter it); the init
//! unshares mount, net, ipc, uts and cgroup itself. That keeps the outer out of the
//! sandbox's mount namespace: pivot_root(2) moves the root of *every* process of the
//! namespace that sits at the old root, which would otherwise include the outer, whose
//! /proc would then stop showing the host pid it must write id maps for.
//!
//! Security model: every namespace except the user namespace is created by host root and
//! so owned by the host user namespace; the user namespace is created last, after all
//! mounts and the host name are set, and by the sandbox's own host uid (`uid_base`, a
//! range of its own per sandbox), not by host root: the init drops to that uid/gid in the
//! host namespace right before the unshare, so the namespace is owned by it and
//! everything the kernel counts per user inside the sandbox (inotify instances, ...) is
//! charged to it, never to host root (see `become_sandbox_host_ids`). Root inside the sandbox therefore holds capabilities
//! only over its own user namespace: it cannot unmount, remount, mount, set the host name
//! or configure the network, because those need capabilities in the namespace's owner
//! (mount_namespaces(7): mounts made in a more privileged namespace are locked).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd};
use std::os::unix::fs::{chown, symlink};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use nix::fcntl::{open, OFlag};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{kill, Signal};
use nix::sys::stat::Mode;
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::{
    chdir, pipe2, pivot_root, setgroups, sethostname, setresgid, setresuid, Gid, Pid, Uid,
};
use sandlot_guest::procview;
use sandlot_guest::spec::{InitReady, InitSpec};

use crate::host;
use crate::sys::{self, Forked};

/// Entry point; returns the process exit code.
pub fn main() -> i32 {
    let mut input = String::new();
    let spec: Result<InitSpec> = std::io::stdin()
        .read_to_string(&mut input)
        .context("reading InitSpec from stdin")
        .and_then(|_| serde_json::from_str(&input).context("parsing InitSpec JSON from stdin"));
    let result = spec.and_then(|s| outer(&s));
    match result {
        Ok(ready) => {
            let line = serde_json::to_string(&ready).expect("InitReady serialises");
            let mut out = std::io::stdout().lock();
            if writeln!(out, "{line}").and_then(|_| out.flush()).is_err() {
                // The node is gone; nobody will ever learn the init's pid. Do not leak it.
                let _ = kill(Pid::from_raw(ready.pid), Signal::SIGKILL);
                return 1;
            }
            0
        }
        Err(e) => {
            eprintln!("sandlot-guest init: {e:#}");
            1
        }
    }
}

/// Checks what the kernel would otherwise misparse: overlayfs options are separated by
/// `,` and lower layers by `:`, so paths holding them (or `=`-free garbage) could inject
/// extra mount options.
fn validate(spec: &InitSpec) -> Result<()> {
    ensure!(!spec.lowerdirs.is_empty(), "InitSpec: lowerdirs is empty");
    for p in spec
        .lowerdirs
        .iter()
        .chain([&spec.upperdir, &spec.workdir, &spec.rootfs])
    {
        ensure!(p.starts_with('/'), "InitSpec: path {p:?} is not absolute");
        ensure!(
            !p.contains([',', ':', '\\', '\0', '\n']),
            "InitSpec: path {p:?} contains a character overlayfs options cannot carry"
        );
    }
    ensure!(
        !spec.hostname.is_empty() && spec.hostname.len() <= 64,
        "InitSpec: hostname must be 1..=64 bytes"
    );
    ensure!(spec.uid_count > 0, "InitSpec: uid_count is 0");
    ensure!(spec.tmp_mib > 0, "InitSpec: tmp_mib is 0");
    for (name, _) in &spec.proc_views {
        ensure!(
            procview::VIEW_FILES.contains(&name.as_str()),
            "InitSpec: proc_views names {name:?}, not one of {:?}",
            procview::VIEW_FILES
        );
    }
    Ok(())
}

fn outer(spec: &InitSpec) -> Result<InitReady> {
    validate(spec)?;
    host::join_cgroups(&spec.cgroup_procs)?;
    let (from_init_r, from_init_w) = pipe2(OFlag::O_CLOEXEC).context("pipe2")?;
    let (to_init_r, to_init_w) = pipe2(OFlag::O_CLOEXEC).context("pipe2")?;
    unshare(CloneFlags::CLONE_NEWPID).context("unshare(CLONE_NEWPID)")?;
    match sys::fork().context("fork of the init")? {
        Forked::Child => {
            drop(from_init_r);
            drop(to_init_w);
            let err = match init(spec, to_init_r, &from_init_w) {
                Ok(never) => match never {},
                Err(e) => e,
            };
            let mut w = std::fs::File::from(from_init_w);
            let _ = write!(w, "E{err:#}");
            drop(w);
            // Nothing is buffered in this child (it never printed), so exit() is fine.
            std::process::exit(1)
        }
        Forked::Parent(pid) => {
            drop(from_init_w);
            drop(to_init_r);
            match handshake(spec, pid, from_init_r, to_init_w) {
                Ok(ready) => Ok(ready),
                Err(e) => {
                    let _ = kill(pid, Signal::SIGKILL);
                    let _ = waitpid(pid, None);
                    Err(e)
                }
            }
        }
    }
}

/// Reads one tag byte; `E` turns the rest of the stream into the error.
fn read_tag(r: &mut std::fs::File, waiting_for: &str) -> Result<u8> {
    let mut b = [0u8; 1];
    loop {
        match r.read(&mut b) {
            Ok(0) => bail!("init exited without a message while {waiting_for}"),
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).context("reading from the init's pipe"),
        }
    }
    if b[0] == b'E' {
        let mut msg = String::new();
        let _ = r.read_to_string(&mut msg);
        bail!("{msg}");
    }
    Ok(b[0])
}

fn handshake(spec: &InitSpec, pid: Pid, from_init: OwnedFd, to_init: OwnedFd) -> Result<InitReady> {
    let mut r = std::fs::File::from(from_init);
    let mut w = std::fs::File::from(to_init);
    let tag = read_tag(&mut r, "building the sandbox")?;
    ensure!(tag == b'U', "init protocol: expected U, got {tag:?}");
    // The outer is host root with CAP_SETUID/CAP_SETGID in the parent user namespace, so
    // it may write any single-line map and a gid_map without first writing "deny" to
    // setgroups (user_namespaces(7), "Defining user and group ID mappings").
    let map = format!("0 {} {}\n", spec.uid_base, spec.uid_count);
    for file in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{file}");
        std::fs::write(&path, &map).with_context(|| format!("writing {map:?} to {path}"))?;
    }
    w.write_all(b"G").context("signalling the init")?;
    let tag = read_tag(&mut r, "dropping privileges")?;
    ensure!(tag == b'R', "init protocol: expected R, got {tag:?}");
    let dir = open(
        format!("/proc/{pid}").as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening /proc/{pid}"))?;
    let starttime = host::starttime_at(&dir, &format!("/proc/{pid}"))?;
    Ok(InitReady {
        pid: pid.as_raw(),
        starttime,
    })
}

/// `mount` with the step and target in the error.
fn mnt(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<()> {
    mount(src, target, fstype, flags, data).with_context(|| {
        format!(
            "mounting {} (type {}, source {}, options {:?}) on {}",
            fstype.unwrap_or("bind"),
            fstype.unwrap_or("-"),
            src.unwrap_or("-"),
            data.unwrap_or(""),
            target.display()
        )
    })
}

fn mkdir_p(p: &Path) -> Result<()> {
    std::fs::create_dir_all(p).with_context(|| format!("creating directory {}", p.display()))
}

/// Mounts the overlay of the image layers and the sandbox's upper dir at `root`.
///
/// Security: the options name the upper and work dirs through `/proc/self/fd/N`
/// descriptors ([`sandlot_guest::layers`]), not by their data-directory paths: the sandbox
/// reads its own mountinfo.
fn mount_overlay(spec: &InitSpec, root: &Path) -> Result<()> {
    let opts = sandlot_guest::layers::layer_options(
        &spec.lowerdirs,
        Path::new(&spec.upperdir),
        Path::new(&spec.workdir),
    )
    .context("opening the overlay's layer directories")?;
    // nosuid: setuid binaries of an image never grant anything (no_new_privs also
    // blocks them; belt and braces). nodev: device nodes from an image are inert.
    mnt(
        Some("overlay"),
        root,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&opts.options),
    )
    .with_context(|| {
        format!(
            "overlay of lowerdirs {:?}, upperdir {}, workdir {}",
            spec.lowerdirs, spec.upperdir, spec.workdir
        )
    })
}

/// Runs as pid 1 of the new pid namespace; returns only on error.
fn init(spec: &InitSpec, go: OwnedFd, report: &OwnedFd) -> Result<std::convert::Infallible> {
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWCGROUP,
    )
    .context("unshare(CLONE_NEWNS|CLONE_NEWNET|CLONE_NEWIPC|CLONE_NEWUTS|CLONE_NEWCGROUP)")?;
    // Nothing mounted from here on may propagate back to the host (a shared / would make
    // the overlay and every tmpfs appear in the host's mount table).
    mnt(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;

    let root = PathBuf::from(&spec.rootfs);
    mount_overlay(spec, &root)?;

    let owner = format!("uid={0},gid={0}", spec.uid_base);
    for d in ["proc", "tmp", "dev", "workspace"] {
        mkdir_p(&root.join(d))?;
    }
    let ws = root.join("workspace");
    // Owned by the sandbox's root so commands can write there (host root made it).
    chown(&ws, Some(spec.uid_base), Some(spec.uid_base))
        .with_context(|| format!("chown {} to {}", ws.display(), spec.uid_base))?;

    let proc_dir = root.join("proc");
    mnt(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    mnt(
        Some("tmpfs"),
        &root.join("tmp"),
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&format!("mode=1777,size={}m,{owner}", spec.tmp_mib)),
    )?;
    setup_dev(&root, spec, &owner)?;
    mask_proc(&proc_dir, &root.join("dev"), &spec.proc_views)?;

    sys::loopback_up().context("bringing up lo (SIOCSIFFLAGS IFF_UP)")?;
    sethostname(&spec.hostname).with_context(|| format!("sethostname({:?})", spec.hostname))?;

    chdir(&root).with_context(|| format!("chdir {}", root.display()))?;
    pivot_root(".", ".").with_context(|| format!("pivot_root into {}", root.display()))?;
    // The old root is now stacked under the new one at "."; detach it so no host path
    // stays reachable from the sandbox.
    umount2(".", MntFlags::MNT_DETACH).context("detaching the old root")?;
    chdir("/").context("chdir / after pivot_root")?;

    // The OOM killer must pick the user's memory hog, never pid 1 (whose death would end
    // the sandbox). Lowering needs CAP_SYS_RESOURCE, which only host root has: do it now.
    // Best effort: a node running without CAP_SYS_RESOURCE (some CI containers) gets
    // EACCES; the sandbox still works, pid 1 just keeps the default score (its RSS is tiny,
    // so it is an unlikely pick anyway).
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        eprintln!("sandlot-guest init: warning: writing -1000 to /proc/self/oom_score_adj: {e}");
    }

    become_sandbox_host_ids(spec.uid_base)?;
    unshare(CloneFlags::CLONE_NEWUSER).context(
        "unshare(CLONE_NEWUSER) as the sandbox's host uid (a kernel or LSM that refuses \
         user namespaces to non-root uids even with CAP_SYS_ADMIN would refuse it)",
    )?;
    nix::unistd::write(report, b"U").context("signalling the outer (U)")?;
    let mut go = std::fs::File::from(go);
    let mut b = [0u8; 1];
    match go.read(&mut b) {
        Ok(1) if b[0] == b'G' => {}
        _ => bail!("the outer did not confirm the id maps"),
    }

    setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0))
        .context("setresgid(0) in the user namespace")?;
    setgroups(&[]).context("setgroups([]) in the user namespace")?;
    setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0))
        .context("setresuid(0) in the user namespace")?;
    // Commands run with the same host uid; a non-dumpable pid 1 cannot be ptraced or have
    // its /proc files read by them (prctl(2) PR_SET_DUMPABLE). After setresuid, which
    // resets the flag anyway.
    sys::set_non_dumpable().context("prctl(PR_SET_DUMPABLE, 0)")?;
    sys::set_no_new_privs().context("prctl(PR_SET_NO_NEW_PRIVS)")?;
    // The init only reaps; it needs no capability, not even in its own namespace.
    sys::drop_bounding_and_ambient().context("dropping the capability bounding set")?;
    sys::clear_capabilities().context("capset(0)")?;

    // Keep only the report pipe; stdin/out/err become /dev/null so the node's pipes see
    // EOF when the outer exits, and nothing else inherited stays open in pid 1.
    let null = open("/dev/null", OFlag::O_RDWR, Mode::empty()).context("opening /dev/null")?;
    let null = null.into_raw_fd();
    for fd in 0..3 {
        sys::dup_onto(null, fd).context("dup2 /dev/null onto stdio")?;
    }
    let _ = go.into_raw_fd(); // closed below with everything else
    let keep = report.as_raw_fd();
    if keep > 3 {
        sys::close_fds(3, (keep - 1) as libc::c_uint).context("closing inherited descriptors")?;
    }
    sys::close_fds(keep + 1, libc::c_uint::MAX).context("closing inherited descriptors")?;

    let chld = sys::ChildSignal::block().context("blocking SIGCHLD")?;
    nix::unistd::write(report, b"R").context("signalling the outer (R)")?;
    reap_forever(&chld)
}

/// Turns the init, still in the host user namespace, into the sandbox's own host
/// uid/gid `base` (no supplementary groups) just before it creates the user namespace.
///
/// Security: the owner of a user namespace is the euid of the process that creates it
/// (user_namespaces(7)), and the kernel charges the per-user counts of everything made
/// inside it (inotify instances and watches, nested user namespaces, ...: the "ucounts"
/// of kernel/ucount.c, whose `inc_ucount` walks up through each namespace's owner) at the
/// top level to that owner's uid, under the host-wide limits (`fs.inotify.*`,
/// `user.max_*`). Created by host root, a sandbox's inotify instances counted against
/// host root's `fs.inotify.max_user_instances`: one sandbox could exhaust it for host
/// root, the node and every other sandbox. Owned by `base` (which the node gives to this
/// sandbox alone), a sandbox can only exhaust its own share.
///
/// Only CAP_SYS_ADMIN is kept (PR_SET_KEEPCAPS, then capset), for the unshare alone: hosts
/// that restrict unprivileged user namespaces (Debian's `kernel.unprivileged_userns_clone
/// = 0`, Ubuntu's `kernel.apparmor_restrict_unprivileged_userns = 1`) let a creator with
/// CAP_SYS_ADMIN through, and the namespace's owner is still the euid `base`. No other
/// host capability survives, and entering the new namespace replaces the process's
/// capabilities with a set that is valid only inside it (and clears keep-caps).
///
/// Everything that needs host root (mounts, pivot_root, sethostname, oom_score_adj) is
/// done before this. The outer, host root with CAP_SETUID/CAP_SETGID in the parent
/// namespace, may still write the id maps (user_namespaces(7)); that the init is no longer
/// dumpable (the euid change resets it) only makes its /proc files root-owned.
fn become_sandbox_host_ids(base: u32) -> Result<()> {
    const CAP_SYS_ADMIN: u64 = 21; // linux/capability.h
    setgroups(&[]).context("setgroups([]) in the host user namespace")?;
    let gid = Gid::from_raw(base);
    setresgid(gid, gid, gid)
        .with_context(|| format!("setresgid({base}) in the host user namespace"))?;
    sys::set_keep_caps(true).context("prctl(PR_SET_KEEPCAPS, 1)")?;
    let uid = Uid::from_raw(base);
    setresuid(uid, uid, uid)
        .with_context(|| format!("setresuid({base}) in the host user namespace"))?;
    sys::set_keep_caps(false).context("prctl(PR_SET_KEEPCAPS, 0)")?;
    sys::set_capabilities(1 << CAP_SYS_ADMIN)
        .context("capset(CAP_SYS_ADMIN only) before creating the user namespace")
}

/// pid 1's only job: reap orphans. As pid 1 of its namespace it gets no signal from
/// inside the namespace it has no handler for (not even SIGKILL), so sandbox code cannot
/// kill it; the node kills it (and with it the whole namespace) from outside.
fn reap_forever(chld: &sys::ChildSignal) -> ! {
    loop {
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(nix::sys::wait::WaitStatus::StillAlive) => break,
                Ok(_) => continue,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => break, // ECHILD: nothing to reap right now
            }
        }
        chld.wait();
    }
}

/// A minimal /dev: a tmpfs holding bind mounts of a few host character devices, the usual
/// symlinks, a private devpts and a /dev/shm tmpfs. No other device is reachable.
fn setup_dev(root: &Path, spec: &InitSpec, owner: &str) -> Result<()> {
    let dev = root.join("dev");
    // nodev on the tmpfs itself: device nodes created there later would be inert (the
    // sandbox cannot mknod anyway); the bind mounts below are separate mounts with the
    // host /dev's flags, so they keep working.
    mnt(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV,
        Some(&format!("mode=755,size=1m,{owner}")),
    )?;
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(name);
        std::fs::File::create(&target).with_context(|| format!("creating {}", target.display()))?;
        let src = format!("/dev/{name}");
        mnt(Some(&src), &target, None, MsFlags::MS_BIND, None)?;
    }
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let p = dev.join(link);
        symlink(to, &p).with_context(|| format!("symlink {} -> {to}", p.display()))?;
    }
    let pts = dev.join("pts");
    mkdir_p(&pts)?;
    // A new devpts instance: the sandbox sees only its own ptys. Optional: a missing
    // devpts only disables ptys.
    let _ = mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    );
    let shm = dev.join("shm");
    mkdir_p(&shm)?;
    mnt(
        Some("tmpfs"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&format!("mode=1777,size={}m,{owner}", spec.tmp_mib)),
    )?;
    Ok(())
}

/// Like runc's default `readonlyPaths` and `maskedPaths`, and more. The proc mount shows
/// the sandbox's own pid namespace, but some of its files are global, not namespaced:
/// /proc/sys (kernel tunables; writes are already refused to a non-host root, read-only
/// makes it certain), /proc/sysrq-trigger (host-wide SysRq), /proc/irq and /proc/bus
/// (hardware) are bound read-only; the files of [`procview::MASKED_PROC_FILES`] (the host
/// kernel command line, block devices, kernel memory and keyrings, host tasks and kernel
/// addresses: information leaks across namespaces) read as empty (`/dev/null` over them);
/// the directories of [`procview::MASKED_PROC_DIRS`] (/proc/pressure: host-wide PSI) are
/// an empty read-only tmpfs; `views` (the sandbox's own meminfo, cpuinfo, stat, loadavg,
/// see [`procview`]) are written to a private tmpfs staged under `dev_dir` and bound over
/// their /proc files; the staging mount is then detached, so only the binds remain (their
/// mountinfo root is `/<name>` on that tmpfs, no host path). The stand-ins are owned by
/// host root, mode 0444: the sandbox's root (whose user namespace does not map host uid 0)
/// cannot write them; the node rewrites them through `/proc/<init>/root/proc/<name>` when
/// a pooled jail is handed over. Missing entries are skipped (sched_debug moved to debugfs
/// in 5.13; /proc/pressure needs CONFIG_PSI).
fn mask_proc(proc_dir: &Path, dev_dir: &Path, views: &[(String, String)]) -> Result<()> {
    for name in ["sys", "sysrq-trigger", "irq", "bus"] {
        let p = proc_dir.join(name);
        if !p.exists() {
            continue;
        }
        let ps = p.to_str().context("non-UTF-8 rootfs path")?;
        mnt(Some(ps), &p, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;
        mnt(
            None,
            &p,
            None,
            MsFlags::MS_BIND
                | MsFlags::MS_REMOUNT
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC,
            None,
        )?;
    }
    if !views.is_empty() {
        let stage = dev_dir.join(".sandlot-views");
        mkdir_p(&stage)?;
        mnt(
            Some("sandlot-views"),
            &stage,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("mode=0755,size=1m"),
        )?;
        for (name, content) in views {
            let (file, target) = (stage.join(name), proc_dir.join(name));
            std::fs::write(&file, content)
                .with_context(|| format!("writing {}", file.display()))?;
            std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o444))
                .with_context(|| format!("chmod 0444 {}", file.display()))?;
            mnt(
                Some(file.to_str().context("non-UTF-8 rootfs path")?),
                &target,
                None,
                MsFlags::MS_BIND,
                None,
            )?;
        }
        umount2(&stage, MntFlags::MNT_DETACH)
            .with_context(|| format!("detaching {}", stage.display()))?;
        std::fs::remove_dir(&stage).with_context(|| format!("removing {}", stage.display()))?;
    }
    for name in procview::MASKED_PROC_FILES {
        let p = proc_dir.join(name);
        if p.exists() && !views.iter().any(|(v, _)| v == name) {
            mnt(Some("/dev/null"), &p, None, MsFlags::MS_BIND, None)?;
        }
    }
    for name in procview::MASKED_PROC_DIRS {
        let p = proc_dir.join(name);
        if p.is_dir() {
            mnt(
                Some("tmpfs"),
                &p,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("size=0"),
            )?;
        }
    }
    Ok(())
}
