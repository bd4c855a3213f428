//! What the QEMU backends (`microvm`, `vm`) share: the accelerator decision of the node
//! ([`AccelProbe`]) and starting a QEMU jailed ([`spawn_in_cgroup`]): in its own cgroup
//! and session, as an unprivileged host user of its own ([`QemuUids`], [`Jail`]), with its
//! unix sockets bound by the node and handed over as file descriptors.
//!
//! Security (why QEMU is not root): a guest that escapes into its QEMU (a device-emulation
//! bug, e.g. CVE-2015-3456 "VENOM", CVE-2020-14364) then holds only a host uid of its own,
//! no capabilities, QEMU's seccomp filter (`-sandbox on`), and can reach:
//!
//! * its VM directory `vms/<id>/` (owner root, group = its uid, mode 0710: it may walk in,
//!   not list, create, rename or remove — so it cannot swap a file the node reads or
//!   writes as root, e.g. `state.json`, `qemu.log`, for a symlink); in it only the files it
//!   owns (mode 0600): the scratch disk or qcow2 overlay and `console.log`;
//! * its sockets, which it never opens by path: the node binds `agent.sock` (and `qmp.sock`)
//!   and QEMU inherits the listening sockets as fds [`AGENT_FD`] / [`QMP_FD`]
//!   (`-chardev socket,fd=N,server=on`);
//! * files every QEMU reads: the guest kit and the initramfs (mode 0444), image disks
//!   (EROFS, qcow2 bases; mode 0444 in `images/`, mode 0710 for the group every QEMU has as
//!   a supplementary group, [`QemuUids::group`]); the directories above are 0711 (openable
//!   by name, not listable);
//! * memory states (pause, templates) only as descriptors the node passes over QMP
//!   (`getfd`): they stay root's;
//! * `/dev/kvm` through its group (under KVM only).
//!
//! One uid per sandbox (the first id of a slot of the node's [`UidSlots`], shared with the
//! `function` and `container` backends, so no other sandbox ever holds it): two QEMUs cannot
//! signal, ptrace or read each other's `/proc`, memory or files. The uid is kept in
//! `state.json` (`qemu_uid`): a pause/resume or template start (a new QEMU) and a node
//! restart (re-adoption reserves it again) keep the same uid.
//!
//! QEMU's own `-runas` cannot be used: it calls setgid/setuid after `-sandbox
//! elevateprivileges=deny` is in force and dies of SIGSYS (QEMU 7.2), so the node drops to
//! the uid between fork and exec instead.
pub mod accel;
pub mod microvm;
pub mod sandbox;
pub(crate) mod snapshot;
pub mod state;
pub mod store;
pub mod vm;

use crate::agent_client::AgentClient;
use crate::backends::uids::{UidLease, UidSlots};
use crate::cgroups::{Limits, SandboxCgroup};
use crate::images::{Image, ImageStore};
use crate::node::{NodeError, NodeResult};
pub(crate) use crate::sys::find_binary;
use accel::probe_kvm;
pub use accel::Accel;
use sandlot_guest::agent_proto::IdentityRequest;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Reads the forced accelerator: `SANDLOT_VM_ACCEL`, else the older name
/// `SANDLOT_MICROVM_ACCEL` (`kvm`, `tcg`; `auto` or unset = probe). It applies to both the
/// `microvm` and the `vm` backend.
///
/// # Errors
/// A message naming the variable for any other value.
pub fn accel_from_env() -> Result<Option<Accel>, String> {
    for var in ["SANDLOT_VM_ACCEL", "SANDLOT_MICROVM_ACCEL"] {
        match std::env::var(var).as_deref() {
            Err(_) | Ok("") => continue,
            Ok("auto") => return Ok(None),
            Ok("kvm") => return Ok(Some(Accel::Kvm)),
            Ok("tcg") => return Ok(Some(Accel::Tcg)),
            Ok(v) => return Err(format!("{var} must be kvm, tcg or auto, got {v:?}")),
        }
    }
    Ok(None)
}

/// The node's accelerator, decided once per node process: forced by configuration, or by
/// a probe boot (`probe_kvm`) that runs in a background thread started by the first QEMU
/// backend built (node start is not held up). Logged once.
#[derive(Debug)]
pub struct AccelProbe {
    forced: Option<Accel>,
    /// The probe's QEMU runs as an unprivileged uid too (so KVM is chosen only when such a
    /// QEMU can use `/dev/kvm`).
    uids: Arc<QemuUids>,
    started: AtomicBool,
    decided: watch::Sender<Option<Accel>>,
    why: Mutex<String>,
}

impl AccelProbe {
    /// A probe; `forced`: the configured accelerator (no probe boot then); `uids`: where
    /// the probe's QEMU takes its uid from.
    pub fn new(forced: Option<Accel>, uids: Arc<QemuUids>) -> Arc<Self> {
        Arc::new(AccelProbe {
            forced,
            uids,
            started: AtomicBool::new(false),
            decided: watch::channel(forced).0,
            why: Mutex::new(match forced {
                Some(_) => "forced by SANDLOT_VM_ACCEL / SANDLOT_MICROVM_ACCEL".into(),
                None => "probing".into(),
            }),
        })
    }

    /// Starts the decision (once; later calls do nothing): logs a forced choice, or boots
    /// `kernel` + `initrd` under KVM in a background thread.
    pub fn start(self: &Arc<Self>, qemu: &Path, kit: &Path, initrd: &Path) {
        if self.started.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(a) = self.forced {
            tracing::info!(accel = a.as_str(), "accelerator: {} (forced)", a.as_str());
            return;
        }
        let me = self.clone();
        let (qemu, kit, initrd) = (qemu.to_owned(), kit.to_owned(), initrd.to_owned());
        std::thread::spawn(move || {
            const PROBE_ID: &str = "kvm-probe";
            // The shared group's id as uid: no sandbox's QEMU has it.
            let (accel, why) = match me.uids.group().map_or_else(|| me.uids.take(PROBE_ID), Ok) {
                Ok(uid) => {
                    let jail = Jail::new(Some(uid), Accel::Kvm, &[]);
                    let r = std::panic::catch_unwind(|| probe_kvm(&qemu, &kit, &initrd, &jail))
                        .unwrap_or((Accel::Tcg, "the probe panicked".into()));
                    me.uids.release(PROBE_ID);
                    r
                }
                Err(e) => (Accel::Tcg, format!("no uid for the probe: {e}")),
            };
            match accel {
                Accel::Kvm => tracing::info!(accel = "kvm", "accelerator: KVM ({why})"),
                Accel::Tcg => tracing::warn!(accel = "tcg", "accelerator: TCG, slow ({why})"),
            }
            *me.why.lock().unwrap() = why;
            me.decided.send_replace(Some(accel));
        });
    }

    /// The accelerator once decided (`None` while the probe runs).
    pub fn get(&self) -> Option<Accel> {
        *self.decided.borrow()
    }

    /// Why this accelerator (the probe's finding, or "forced …").
    pub fn why(&self) -> String {
        self.why.lock().unwrap().clone()
    }

    /// Waits for the decision. A probe that was never started (no QEMU backend was built)
    /// answers TCG at once.
    pub async fn wait(&self) -> Accel {
        if !self.started.load(Ordering::SeqCst) && self.forced.is_none() {
            return Accel::Tcg;
        }
        let mut rx = self.decided.subscribe();
        let v = rx.wait_for(Option::is_some).await.map(|v| *v);
        v.ok().flatten().unwrap_or(Accel::Tcg)
    }
}

/// File descriptor of the agent's listening socket in QEMU (`-chardev socket,fd=3`).
pub const AGENT_FD: RawFd = 3;
/// File descriptor of the QMP listening socket in QEMU (`-chardev socket,fd=4`).
pub const QMP_FD: RawFd = 4;
/// File descriptor of the tap device in the QEMU of a VM with a network allow policy
/// (`-netdev tap,fd=5`, [`TAP_IF`] opened by the node).
pub const TAP_FD: RawFd = 5;
/// The agent socket's name in a VM directory.
pub const AGENT_SOCK: &str = "agent.sock";
/// The QMP socket's name in a VM directory.
pub const QMP_SOCK: &str = "qmp.sock";
/// The guest's serial console log in a VM directory (written by QEMU).
pub const CONSOLE_LOG: &str = "console.log";

/// `-cpu` under TCG: QEMU's `max` model without ERMS and FSRM ("enhanced/fast short
/// `rep movsb`"). With them the guest kernel copies and clears memory with `rep movsb` /
/// `rep stosb` (memcpy, clear_page, copy_to/from_user), and so does glibc above 2 KiB;
/// TCG runs a `rep` string instruction one element per iteration of a translated loop, so a
/// byte-wise `rep` costs several times the `rep movsq`/`stosq` (8 bytes a step) the kernel
/// uses without them. Measured (docs/backends.md, Cold boot): a cold microVM boot's agent answers ~0.1 s
/// sooner at the QEMU level (within the host's noise through the node). KVM keeps
/// `-cpu host`, where the hardware runs `rep movsb` fast.
pub const TCG_CPU: &str = "max,-erms,-fsrm";

/// CPU cores a VMM's own threads may use on top of its guest's `cpu` (cgroup v1; see
/// [`SandboxCgroup::create_vmm`]): QEMU's main loop and I/O emulate the guest's devices
/// beside its vCPUs instead of taking their time. Under TCG a cold microVM boot reads its
/// disks and console through them while the vCPU thread translates; sharing one quota and
/// one CPU with the vCPU cost ~0.2 s of a 1.7 s boot (docs/backends.md, Cold boot).
pub const VMM_CPU_HEADROOM: f64 = 0.5;

/// `-name` of every QEMU the node starts: `debug-threads=on` names the vCPU threads
/// `CPU <n>/TCG` or `CPU <n>/KVM`, which is how [`spawn_logged`] finds them to move them into
/// the sandbox's vCPU group.
pub const QEMU_NAME: &str = "sandlot,debug-threads=on";

/// Create the cgroup of a QEMU whose guest has `memory_mib` MiB and `cpu` cores: the
/// memory limit adds [`QEMU_OVERHEAD_MIB`], the vCPU
/// threads are held to `cpu` and QEMU as a whole to `cpu` + [`VMM_CPU_HEADROOM`] (cgroup
/// v1; on v2 all of QEMU to `cpu`), at most `pids_max` tasks.
///
/// # Errors
/// `Internal` with the cgroup path that could not be created or written.
pub fn create_vmm_cgroup(
    cg: &SandboxCgroup,
    memory_mib: u64,
    cpu: f64,
    pids_max: u64,
) -> NodeResult<()> {
    let limits = Limits {
        memory_bytes: (memory_mib + QEMU_OVERHEAD_MIB) << 20,
        cpu,
        pids_max,
    };
    Ok(cg.create_vmm(&limits, VMM_CPU_HEADROOM)?)
}

/// The vCPU threads of QEMU process `pid` (named by [`QEMU_NAME`]'s `debug-threads=on`).
fn vcpu_threads(pid: i32) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let tid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            comm.starts_with("CPU ").then_some(tid)
        })
        .collect()
}

/// Moves the `n` vCPU threads of QEMU `pid` into `cg`'s vCPU group once they exist (QEMU
/// creates them while it sets the machine up, before the guest runs). Gives up after
/// 5 s (a QEMU started without [`QEMU_NAME`], e.g. a sandbox from an older node whose
/// stored command line lacks it, or one that exited): its vCPUs stay in the group itself,
/// limited with QEMU's headroom.
fn confine_vcpus(cg: &SandboxCgroup, pid: i32, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let tids = vcpu_threads(pid);
        if tids.len() >= n.max(1) {
            for tid in tids {
                if let Err(e) = cg.move_vcpu_thread(tid) {
                    tracing::warn!(pid, tid, error = %e, "vCPU thread not moved to its cgroup");
                }
            }
            return;
        }
        if std::time::Instant::now() >= deadline {
            tracing::debug!(
                pid,
                found = tids.len(),
                "vCPU threads not found; left in the VMM's group"
            );
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The host's TSC rate in kHz, rounded to whole MHz (so that a guest's kernel command line,
/// and with it the key of its template snapshot, is the same at every node start): counted
/// once per process against `CLOCK_MONOTONIC_RAW` over 50 ms. Under TCG a guest's `rdtsc`
/// reads the host's counter (QEMU 7.2 `cpu_get_ticks` without `-icount`), so this is the
/// rate its kernel must be told (`tsc_early_khz=`) for its clocks to keep time. 2 GHz when
/// the host has no TSC (not x86_64).
pub fn host_tsc_khz() -> u64 {
    static KHZ: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *KHZ.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let now = || {
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: clock_gettime with a valid clock id and a valid out-pointer.
                unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_RAW, &mut ts) };
                ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
            };
            // SAFETY: `rdtsc` has no preconditions on x86_64.
            let tsc = || unsafe { core::arch::x86_64::_rdtsc() } as u128;
            let (t0, c0) = (now(), tsc());
            std::thread::sleep(std::time::Duration::from_millis(50));
            let (t1, c1) = (now(), tsc());
            let khz = (c1 - c0) * 1_000_000 / (t1 - t0).max(1);
            let mhz = ((khz + 500) / 1000) as u64;
            if mhz > 0 {
                return mhz * 1000;
            }
        }
        2_000_000
    })
}

/// Whether the host's TSC is invariant: `constant_tsc` and `nonstop_tsc` among the flags of
/// `/proc/cpuinfo` (read once per process). A TCG guest reads that counter, so its kernel
/// may then be told to trust it (`tsc=reliable`, see the microvm backend).
pub fn host_tsc_invariant() -> bool {
    static INVARIANT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INVARIANT.get_or_init(|| {
        std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|s| tsc_invariant_in(&s))
    })
}

/// [`host_tsc_invariant`] for the text of `/proc/cpuinfo` (its first `flags` line).
fn tsc_invariant_in(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .is_some_and(|l| {
            let flags: Vec<&str> = l.split_whitespace().collect();
            flags.contains(&"constant_tsc") && flags.contains(&"nonstop_tsc")
        })
}

/// `-chardev` value of a socket server on the inherited listening socket `fd`.
pub fn chardev_on_fd(id: &str, fd: RawFd) -> String {
    format!("socket,id={id},fd={fd},server=on,wait=off")
}

/// How one QEMU is confined beyond its cgroup and `-sandbox on`.
#[derive(Debug, Clone, Default)]
pub struct Jail {
    /// Host uid = gid it runs as; `None`: host root (a VM re-adopted from a node version that
    /// ran QEMU as root keeps its command line, which opens its sockets by path).
    pub uid: Option<u32>,
    /// Supplementary groups (the group of `/dev/kvm` under KVM).
    pub groups: Vec<u32>,
    /// Unix sockets the node binds in the VM directory and hands over listening:
    /// (file name, descriptor number in QEMU).
    pub sockets: Vec<(&'static str, RawFd)>,
    /// The network namespace QEMU starts in (a sandbox with an allow policy: the nsfs file
    /// of [`crate::net::create_netns`]), whose tap [`TAP_IF`] ([`crate::net::bridge_tap`])
    /// the node opens and hands over as [`TAP_FD`]; `None`: the node's, no tap.
    pub netns: Option<std::path::PathBuf>,
}

impl Jail {
    /// The jail of a QEMU running as `uid` with `accel`, serving `sockets`.
    pub fn new(uid: Option<u32>, accel: Accel, sockets: &[(&'static str, RawFd)]) -> Jail {
        Jail {
            uid,
            groups: match accel {
                Accel::Kvm => kvm_group().into_iter().collect(),
                Accel::Tcg => Vec::new(),
            },
            sockets: if uid.is_some() {
                sockets.to_vec()
            } else {
                Vec::new()
            },
            netns: None,
        }
    }

    /// This jail, its QEMU started in the network namespace `netns` (when given).
    pub fn in_netns(mut self, netns: Option<&Path>) -> Jail {
        self.netns = netns.map(Path::to_path_buf);
        self
    }
}

/// The group of `/dev/kvm` when it grants read and write to its group and is not root's
/// group (membership of gid 0 would be a privilege of its own).
pub fn kvm_group() -> Option<u32> {
    let md = std::fs::metadata("/dev/kvm").ok()?;
    (md.gid() != 0 && md.mode() & 0o060 == 0o060).then_some(md.gid())
}

/// Host uids of QEMU processes: one slot of the node's [`UidSlots`] per sandbox (or
/// template build), by sandbox id; and one group every QEMU has as a supplementary group
/// (the first id of the highest free slot, held for the node's life): the image disks are
/// readable through it and by nobody else. Shared by the `microvm` and `vm` backends.
#[derive(Debug)]
pub struct QemuUids {
    slots: Arc<UidSlots>,
    held: Mutex<HashMap<String, UidLease>>,
    group: Option<UidLease>,
}

impl QemuUids {
    /// Uids from `slots` (the table the `function` and `container` backends use). Without
    /// a free slot for the shared group, image directories fall back to mode 0711.
    pub fn new(slots: Arc<UidSlots>) -> Arc<QemuUids> {
        let group = slots.allocate_highest().ok();
        Arc::new(QemuUids {
            slots,
            held: Mutex::new(HashMap::new()),
            group,
        })
    }

    /// The group of every QEMU (see the type's docs).
    pub fn group(&self) -> Option<u32> {
        self.group.as_ref().map(UidLease::base)
    }

    /// The jail of a QEMU of `uid` (see [`Jail::new`]) with the shared group added.
    pub fn jail(&self, uid: Option<u32>, accel: Accel, sockets: &[(&'static str, RawFd)]) -> Jail {
        let mut j = Jail::new(uid, accel, sockets);
        if uid.is_some() {
            j.groups.extend(self.group());
        }
        j
    }

    /// The uid of `id`: the one it holds, else the first id of a newly allocated slot.
    ///
    /// # Errors
    /// `ResourceExhausted` when every slot is held.
    pub fn take(&self, id: &str) -> NodeResult<u32> {
        let mut held = self.held.lock().unwrap();
        if let Some(l) = held.get(id) {
            return Ok(l.base());
        }
        let lease = self.slots.allocate()?;
        let uid = lease.base();
        held.insert(id.to_string(), lease);
        Ok(uid)
    }

    /// Re-adoption: `id` holds `uid` again (its slot is skipped by later allocations).
    pub fn keep(&self, id: &str, uid: u32) {
        let mut held = self.held.lock().unwrap();
        if !held.contains_key(id) {
            held.insert(id.to_string(), self.slots.reserve(uid));
        }
    }

    /// Gives `id`'s uid back; call only once no process of it is left.
    pub fn release(&self, id: &str) {
        self.held.lock().unwrap().remove(id);
    }
}

/// Removes the VM directory `dir` of sandbox `id`, *then* gives `id`'s uid back (call once
/// no process of the uid is left). The directory is group-owned by the uid and holds the
/// uid's own files (disk, console): were the uid handed out first, the next sandbox's QEMU
/// could walk into it. A directory that cannot be removed keeps the uid held (a slot stays
/// in use; nothing is exposed). Blocking.
///
/// # Errors
/// `Internal` when `dir` cannot be removed (a missing one is fine).
pub fn remove_vm_dir(uids: &QemuUids, id: &str, dir: &Path) -> NodeResult<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(NodeError::io(format!("remove {}", dir.display()), e)),
    }
    uids.release(id);
    Ok(())
}

/// Creates the VM directory `dir` of a new sandbox `id` (its parent must exist).
///
/// # Errors
/// `Conflict` when it exists (the id is taken); `Internal` on other failures.
pub fn create_vm_dir(dir: &Path, id: &str) -> NodeResult<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            Err(NodeError::Conflict(format!("sandbox {id} already exists")))
        }
        Err(e) => Err(NodeError::io(format!("create {}", dir.display()), e)),
    }
}

/// Makes `dir` the VM directory of a QEMU running as `uid`: owner root, group `uid`, mode
/// 0710 (it may walk in; it may not list, create, rename or remove), with `console.log`
/// created for it (owner `uid`, mode 0600; QEMU opens it by path). Blocking.
///
/// # Errors
/// `Internal` on chown/chmod/create failures.
pub fn prepare_vm_dir(dir: &Path, uid: u32) -> NodeResult<()> {
    std::os::unix::fs::chown(dir, Some(0), Some(uid))
        .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710)))
        .map_err(|e| NodeError::io(format!("chmod {}", dir.display()), e))?;
    let console = dir.join(CONSOLE_LOG);
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&console)
        .map_err(|e| NodeError::io(format!("create {}", console.display()), e))?;
    give_file(&console, uid)
}

/// [`prepare_vm_dir`] of `dir` plus [`give_file`] of each of `files` (its disks). Blocking.
///
/// # Errors
/// `Internal` on chown/chmod/create failures.
pub fn prepare_vm_files(dir: &Path, files: &[&Path], uid: u32) -> NodeResult<()> {
    prepare_vm_dir(dir, uid)?;
    files.iter().try_for_each(|f| give_file(f, uid))
}

/// Sets up a QEMU backend's directory `dir` (`DATA/microvm`, `DATA/vm`) for unprivileged
/// QEMUs: checks that `dir` and the guest `kernel` are reachable ([`check_reachable`]) and
/// the kernel readable by other users;
/// `dir` and `dir/vms` mode 0711 (open by name, no listing); `dir/images` owner root,
/// group `group` (every QEMU's, [`QemuUids::group`]), mode 0710 (0711 without a group),
/// the image disks in it mode 0444; `dir/failed` (kept consoles) 0700.
///
/// # Errors
/// `Unavailable` when a parent is not searchable or the kernel not readable by other
/// users; `Internal` on create/chmod failures.
pub fn prepare_backend_dir(dir: &Path, kernel: &Path, group: Option<u32>) -> NodeResult<()> {
    check_reachable(dir, "the VM files")?;
    check_reachable(kernel, "the guest kernel")?;
    if let Ok(md) = std::fs::metadata(kernel) {
        if md.permissions().mode() & 0o004 == 0 {
            return Err(NodeError::Unavailable(format!(
                "the guest kernel {} (mode {:o}) is not readable by other users; QEMU runs as an unprivileged host uid (chmod o+r it, or re-run scripts/guest-kit.sh)",
                kernel.display(),
                md.permissions().mode() & 0o7777
            )));
        }
    }
    ensure_dir_mode(dir, 0o711)?;
    for (d, mode) in [("vms", 0o711), ("failed", 0o700)] {
        ensure_dir_mode(&dir.join(d), mode)?;
    }
    let images = dir.join("images");
    ensure_dir_mode(&images, if group.is_some() { 0o710 } else { 0o711 })?;
    std::os::unix::fs::chown(&images, Some(0), Some(group.unwrap_or(0)))
        .map_err(|e| NodeError::io(format!("chown {}", images.display()), e))?;
    for e in std::fs::read_dir(dir.join("images"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o444));
        }
    }
    Ok(())
}

/// Hands the file `path` (a disk, a console) to `uid`: owner and group `uid`, mode 0600.
///
/// # Errors
/// `Internal` on chown/chmod failures.
pub fn give_file(path: &Path, uid: u32) -> NodeResult<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))
        .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)))
        .map_err(|e| NodeError::io(format!("chown {}", path.display()), e))
}

/// Makes `path` (a frozen qcow2 layer: a checkpoint's, a fork's backing file) readable by
/// every QEMU that reaches it and writable by none: owner root, group `group` (every QEMU's
/// supplementary group, [`QemuUids::group`]), mode 0440; without a group, root:root 0444.
/// A QEMU reaches only the layers linked into its own VM directory (0710, root:its uid),
/// so the group grants no more than a sandbox's own chain.
///
/// # Errors
/// `Internal` on chown/chmod failures.
pub fn share_read_only(path: &Path, group: Option<u32>) -> NodeResult<()> {
    let mode = if group.is_some() { 0o440 } else { 0o444 };
    std::os::unix::fs::lchown(path, Some(0), Some(group.unwrap_or(0)))
        .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)))
        .map_err(|e| NodeError::io(format!("chown {}", path.display()), e))
}

/// Creates `dir` if needed and sets its mode to `mode` (e.g. 0711: other users may open
/// what they know the name of, not list it).
///
/// # Errors
/// `Internal` on create/chmod failures.
pub fn ensure_dir_mode(dir: &Path, mode: u32) -> NodeResult<()> {
    std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)))
        .map_err(|e| NodeError::io(format!("chmod {}", dir.display()), e))
}

/// The files of QEMU arguments' `-drive` values (`file=PATH`).
pub fn drive_files(args: &[String]) -> impl Iterator<Item = PathBuf> + '_ {
    args.windows(2)
        .filter(|w| w[0] == "-drive")
        .filter_map(|w| w[1].split(',').find_map(|kv| kv.strip_prefix("file=")))
        .map(PathBuf::from)
}

/// Whether image disk `path` is there to open: a file, on a file system that answers
/// (`statfs`). A lazy disk whose FUSE daemon died still `stat`s as a file from the
/// kernel's attribute cache (the daemon's TTL is an hour) until its mount is replaced,
/// but every `statfs` reaches the daemon and fails (`ENOTCONN`). Blocking.
pub fn disk_present(path: &Path) -> bool {
    path.is_file() && nix::sys::statfs::statfs(path).is_ok()
}

/// The image of `images` whose lazy disk (`lazy_path` of it under the backend's
/// `images/` directory) is one of `files` and is missing — its FUSE mount is gone (a host
/// reboot) or dead (a killed daemon: `statfs` answers `ENOTCONN`; a `stat` may still
/// answer from the attribute cache). `None` when every lazy disk among `files` is there
/// or no image has it. Blocking (lists the store).
///
/// # Errors
/// Listing the image store.
pub fn lazy_image_gone(
    images: &ImageStore,
    files: impl IntoIterator<Item = PathBuf>,
    lazy_path: impl Fn(&Image) -> NodeResult<Option<PathBuf>>,
) -> NodeResult<Option<Image>> {
    let gone: Vec<PathBuf> = files
        .into_iter()
        .filter(|f| {
            f.parent()
                .and_then(|d| d.file_name())
                .is_some_and(|n| n.to_string_lossy().starts_with("lazy-"))
                && !disk_present(f)
        })
        .collect();
    if gone.is_empty() {
        return Ok(None);
    }
    for img in images.list()? {
        if lazy_path(&img)?.is_some_and(|p| gone.contains(&p)) {
            return Ok(Some(img));
        }
    }
    Ok(None)
}

/// The image disks that creates in flight have picked (`image_disk`) but not yet recorded
/// on disk (`boot.json`, a qcow2 layer): a collection keeps them. Taking a hold and a whole
/// collection exclude each other, so a disk is either held before the collection looks or
/// looked up again (and made anew if it was removed) after it.
#[derive(Clone, Default)]
pub struct DiskHolds(Arc<Mutex<HashMap<PathBuf, usize>>>);

/// A QEMU backend's image disks `dir/<key>.<ext>` (`DATA/microvm/images/*.erofs`,
/// `DATA/vm/images/*.qcow2`): made once per image, one build at a time, held by creates in
/// flight ([`DiskHolds`]) and collected when nothing needs them ([`Self::collect`]).
pub struct ImageDisks {
    /// The backend's name in logs (`microvm`, `vm`).
    backend: &'static str,
    /// `DATA/<backend>/images`.
    dir: PathBuf,
    /// The disks' file extension (`erofs`, `qcow2`).
    ext: &'static str,
    /// The node's image store: which images a create may still ask a disk for.
    images: ImageStore,
    build: tokio::sync::Mutex<()>,
    holds: DiskHolds,
}

impl ImageDisks {
    /// The disks of `backend` in `dir` (`<key>.<ext>`) for the images of `images`.
    pub fn new(backend: &'static str, dir: PathBuf, ext: &'static str, images: ImageStore) -> Self {
        ImageDisks {
            backend,
            dir,
            ext,
            images,
            build: Default::default(),
            holds: Default::default(),
        }
    }

    /// Where the disk of key `key` is (or will be): `dir/<key>.<ext>`.
    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.{}", self.ext))
    }

    /// The image disk `out` of `image` and a create's hold on it (kept until the sandbox's
    /// files name it), made first by `make(out)` on a blocking thread when missing (logged
    /// as `made` with its milliseconds); each new disk is followed by `collect` (a
    /// collection of the disks nothing needs any more, [`Self::collect`]).
    ///
    /// # Errors
    /// `make`'s.
    pub async fn image_disk(
        &self,
        image: &Image,
        out: PathBuf,
        made: &str,
        make: impl FnOnce(&Path) -> NodeResult<()> + Send + 'static,
        collect: impl FnOnce(),
    ) -> NodeResult<(PathBuf, DiskHold)> {
        let o = out.clone();
        let build = async {
            let started = std::time::Instant::now();
            crate::sys::spawn_blocking(move || make(&o)).await?;
            let ms = started.elapsed().as_millis() as u64;
            tracing::info!(backend = self.backend, image = %image.name, ms, "{made}");
            Ok(())
        };
        let (out, hold, made) = self.get(out, build).await?;
        if made {
            collect();
        }
        Ok((out, hold))
    }

    /// [`collect_image_disks`] of these disks: `disk_path` names the disk of an image of the
    /// store, `used` the disks sandboxes or checkpoints use.
    pub fn collect(
        &self,
        disk_path: impl Fn(&Image) -> PathBuf,
        used: impl FnOnce() -> Result<HashSet<PathBuf>, String>,
        partial: bool,
    ) {
        collect_image_disks(
            self.backend,
            &self.dir,
            self.ext,
            &self.images,
            disk_path,
            self,
            used,
            partial,
        );
    }

    /// The image disk `out` with a create's hold on it, made by `build` first when it is
    /// missing or dead ([`disk_present`]; one build at a time per backend; the hold is
    /// taken before the disk is looked for, see [`DiskHolds`]). The flag is `true` when
    /// this call made it.
    ///
    /// # Errors
    /// `build`'s.
    pub async fn get(
        &self,
        out: PathBuf,
        build: impl std::future::Future<Output = NodeResult<()>>,
    ) -> NodeResult<(PathBuf, DiskHold, bool)> {
        let hold = self.holds.hold(&out);
        // `statfs` of a lazy disk is a request to its FUSE daemon: not on this worker.
        let present = |p: &Path| {
            let p = p.to_path_buf();
            crate::sys::spawn_blocking(move || Ok(disk_present(&p)))
        };
        if present(&out).await? {
            return Ok((out, hold, false));
        }
        let _one_build = self.build.lock().await;
        if present(&out).await? {
            return Ok((out, hold, false));
        }
        build.await?;
        Ok((out, hold, true))
    }
}

/// One create's hold on an image disk ([`DiskHolds`]); released on drop.
pub struct DiskHold {
    holds: DiskHolds,
    path: PathBuf,
}

impl DiskHolds {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds `path` until the returned guard is dropped (waits for a running collection).
    fn hold(&self, path: &Path) -> DiskHold {
        *self.lock().entry(path.to_path_buf()).or_default() += 1;
        DiskHold {
            holds: self.clone(),
            path: path.to_path_buf(),
        }
    }
}

impl Drop for DiskHold {
    fn drop(&mut self) {
        let mut m = self.holds.lock();
        if let Some(n) = m.get_mut(&self.path) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.path);
            }
        }
    }
}

/// Collects a QEMU backend's image disks `images_dir/<key>.<ext>`: removes those that no
/// create will ask for and nothing uses — neither the disk of an image in `images` now
/// (`disk_path`: a create may boot it), nor held by a create in flight (`disks`), nor in
/// what `used` returns (the files named by VMs' states or qcow2 backing chains; `Err(why)`
/// when that cannot be told, which collects nothing). Files are compared by device and
/// inode, so another spelling of the data directory (a symlink, a relative path) in older
/// records still counts. With `partial`, also the leftovers of disk builds cut short
/// (`*.tmp` files, `*.merge` mount points, `*.kit` directories: only when no build can be
/// running, at node start). Each removal is logged.
#[allow(clippy::too_many_arguments)]
pub fn collect_image_disks(
    backend: &str,
    images_dir: &Path,
    ext: &str,
    images: &ImageStore,
    disk_path: impl Fn(&Image) -> PathBuf,
    disks: &ImageDisks,
    used: impl FnOnce() -> Result<HashSet<PathBuf>, String>,
    partial: bool,
) {
    let held = disks.holds.lock();
    let keep = match (images.list(), used()) {
        (Ok(list), Ok(used)) => list
            .iter()
            .map(disk_path)
            .chain(used)
            .chain(held.keys().cloned())
            .collect::<Vec<_>>(),
        (Err(e), _) => {
            tracing::warn!(backend, error = %e, "image disks not collected: the image store cannot be listed");
            return;
        }
        (_, Err(why)) => {
            tracing::warn!(backend, %why, "image disks not collected");
            return;
        }
    };
    for (disk, bytes) in remove_unneeded_disks(images_dir, ext, &keep, partial) {
        tracing::info!(backend, %disk, bytes, "unused image disk removed");
    }
}

/// The removals of [`collect_image_disks`]: every `*.<ext>` file in `images_dir` that is
/// none of the files `keep` names (by device and inode), and with `partial` the build
/// leftovers. Returns `(file name, bytes)` per entry removed; one that cannot be removed is
/// logged and kept.
fn remove_unneeded_disks(
    images_dir: &Path,
    ext: &str,
    keep: &[PathBuf],
    partial: bool,
) -> Vec<(String, u64)> {
    let kept: HashSet<(u64, u64)> = keep
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect();
    let suffix = format!(".{ext}");
    let mut removed = Vec::new();
    for e in std::fs::read_dir(images_dir)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let p = e.path();
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        let leftover = [".tmp", ".merge", ".kit"].iter().any(|s| name.ends_with(s));
        let res = if leftover && partial {
            // A build's overlay mount point first: never delete through a mount.
            let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
            if meta.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            }
        } else if !leftover
            && name.ends_with(&suffix)
            && meta.is_file()
            && !kept.contains(&(meta.dev(), meta.ino()))
        {
            std::fs::remove_file(&p)
        } else {
            continue;
        };
        match res {
            Ok(()) => removed.push((name, meta.len())),
            Err(err) => {
                tracing::warn!(disk = %p.display(), error = %err, "unused image disk not removed")
            }
        }
    }
    removed
}

/// Checks that every parent of `path` is searchable by other users (`o+x`): unprivileged
/// QEMUs must walk down to it.
///
/// # Errors
/// `Unavailable` naming the first parent that is not.
pub fn check_reachable(path: &Path, what: &str) -> NodeResult<()> {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    for a in abs.ancestors().skip(1) {
        if let Ok(md) = std::fs::metadata(a) {
            if md.permissions().mode() & 0o001 == 0 {
                return Err(NodeError::Unavailable(format!(
                    "{} (mode {:o}) is not searchable by other users; QEMU runs as an unprivileged host uid that must reach {} ({what}): use directories whose parents are o+x",
                    a.display(),
                    md.permissions().mode() & 0o7777,
                    abs.display()
                )));
            }
        }
    }
    Ok(())
}

/// Makes `cmd` drop to `jail`'s uid, gid and supplementary groups before exec (no cgroup,
/// no sockets: the accelerator probe).
pub fn run_as(cmd: &mut std::process::Command, jail: &Jail) {
    let Some(uid) = jail.uid else { return };
    let groups: Vec<libc::gid_t> = jail.groups.clone();
    // SAFETY: after fork, before exec: only async-signal-safe calls (setgroups, setresgid,
    // setresuid) on data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setresgid(uid, uid, uid) != 0
                || libc::setresuid(uid, uid, uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Starts `cmd` (a QEMU) jailed by `jail` in a session of its own (it outlives the node and
/// is re-adopted) and, before it runs, in the cgroup `cg` (its limits apply from its first
/// instruction). Between fork and exec, in this order: new session, cgroup, the node-bound
/// listening sockets of `jail` moved to their descriptor numbers, `jail`'s network
/// namespace (setns(2), while still root), supplementary groups,
/// gid, uid (real, effective and saved: no capabilities are left, see capabilities(7)
/// "Effect of user ID changes on capabilities"). Returns the child; the caller reaps it.
///
/// # Errors
/// `Internal` when a socket or the network namespace cannot be opened, or QEMU cannot be
/// started, put in the cgroup, its namespace or given its uid.
pub fn spawn_in_cgroup(
    cmd: &mut std::process::Command,
    cg: &SandboxCgroup,
    dir: &Path,
    jail: &Jail,
) -> NodeResult<std::process::Child> {
    let procs: Vec<std::ffi::CString> = cg
        .group()
        .procs_files()
        .into_iter()
        .filter_map(|p| std::ffi::CString::new(p.into_os_string().into_encoded_bytes()).ok())
        .collect();
    // Sockets: bound here (stale ones of an earlier QEMU removed first: a connect must reach
    // the new QEMU's), dropped in this process once QEMU has them.
    let mut listeners = Vec::new();
    for (name, fd) in &jail.sockets {
        let path = dir.join(name);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(NodeError::io(format!("remove {}", path.display()), e)),
        }
        let l = std::os::unix::net::UnixListener::bind(&path)
            .map_err(|e| NodeError::io(format!("bind {}", path.display()), e))?;
        listeners.push((l, *fd));
    }
    let tap = match &jail.netns {
        Some(ns) => Some(
            crate::net::open_tap(ns, TAP_IF)
                .map_err(|e| NodeError::io(format!("open tap {TAP_IF} in {}", ns.display()), e))?,
        ),
        None => None,
    };
    let moves: Vec<(RawFd, RawFd)> = listeners
        .iter()
        .map(|(l, fd)| (l.as_raw_fd(), *fd))
        .chain(tap.as_ref().map(|t| (t.as_raw_fd(), TAP_FD)))
        .collect();
    let user = jail.uid;
    let groups: Vec<libc::gid_t> = jail.groups.clone();
    // Opened here (close-on-exec), joined in the child.
    let netns = match &jail.netns {
        Some(p) => Some(
            std::fs::File::open(p)
                .map_err(|e| NodeError::io(format!("open network namespace {}", p.display()), e))?,
        ),
        None => None,
    };
    let netns_fd = netns.as_ref().map(|f| f.as_raw_fd());
    // SAFETY: after fork, before exec: only async-signal-safe calls (setsid, getpid,
    // open, write, close, fcntl, dup2, setns, setgroups, setresgid, setresuid) on data
    // prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            let pid = libc::getpid();
            let mut buf = [0u8; 16];
            let mut n = pid as u32;
            let mut i = buf.len();
            loop {
                i -= 1;
                buf[i] = b'0' + (n % 10) as u8;
                n /= 10;
                if n == 0 {
                    break;
                }
            }
            for p in &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let w = libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i);
                libc::close(fd);
                if w < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Copies above every target number first, so that moving one onto its number
            // never closes another still to be moved; dup2 clears close-on-exec.
            let mut high = [(-1, -1); 8];
            for (i, (src, dst)) in moves.iter().take(high.len()).enumerate() {
                let h = libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, 64);
                if h < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                high[i] = (h, *dst);
            }
            for (h, dst) in high.iter().filter(|(h, _)| *h >= 0) {
                if libc::dup2(*h, *dst) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(*h);
            }
            if let Some(fd) = netns_fd {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(uid) = user {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setresgid(uid, uid, uid) != 0
                    || libc::setresuid(uid, uid, uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| NodeError::io(format!("start {:?}", cmd.get_program()), e));
    drop(listeners);
    drop(netns);
    drop(tap);
    child
}

/// Starts QEMU's `cmd` with stdout and stderr into `dir/qemu.log` (appended when `append`,
/// e.g. a restore after a pause; truncated otherwise; the node opens it, QEMU inherits it),
/// jailed by `jail` in its own session and in the cgroup `cg` ([`spawn_in_cgroup`]), and
/// reaps it from a thread when it exits.
/// Returns its pid and start time (`/proc/PID/stat` field 22, to recognise it after a node
/// restart).
///
/// # Errors
/// `Internal` when the log cannot be opened or QEMU cannot be started.
pub fn spawn_logged(
    cmd: &mut std::process::Command,
    dir: &Path,
    cg: &SandboxCgroup,
    append: bool,
    jail: &Jail,
) -> NodeResult<(i32, u64)> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(dir.join("qemu.log"))
        .map_err(|e| NodeError::io("open qemu.log", e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| NodeError::io("dup qemu.log", e))?;
    cmd.stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2);
    let vcpus = smp_of(cmd);
    let mut child = spawn_in_cgroup(cmd, cg, dir, jail)?;
    let pid = child.id() as i32;
    let cg = cg.clone();
    // QEMU is our child until this process ends: reap it when it exits.
    std::thread::spawn(move || {
        confine_vcpus(&cg, pid, vcpus);
        let _ = child.wait();
    });
    Ok((pid, crate::sys::proc_starttime(pid).unwrap_or(0)))
}

/// The vCPU count of a QEMU command line (`-smp N[,…]`; 1 without `-smp`).
fn smp_of(cmd: &std::process::Command) -> usize {
    let args: Vec<_> = cmd.get_args().collect();
    args.iter()
        .position(|a| *a == "-smp")
        .and_then(|i| args.get(i + 1)?.to_str())
        .and_then(|v| {
            v.split(',')
                .next()?
                .trim_start_matches("cpus=")
                .parse()
                .ok()
        })
        .unwrap_or(1)
}

/// Sets the guest's wall clock to the host's ([`AgentClient::set_clock`]) after a start or
/// a resume, waiting at most 10 s; a failure is logged, not fatal: the guest keeps the
/// clock it had.
pub async fn sync_clock(agent: &AgentClient, id: &str, backend: &str) {
    let wait = std::time::Duration::from_secs(10);
    let error = match tokio::time::timeout(wait, agent.set_clock()).await {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 10 s".to_string(),
    };
    tracing::warn!(sandbox = %id, backend, error = %error, "guest clock not set");
}

/// Hostname = `id`, a random machine id and 64 random bytes of entropy.
pub fn fresh_identity(id: &str) -> IdentityRequest {
    let mid: [u8; 16] = rand::random();
    let (a, b): ([u8; 32], [u8; 32]) = (rand::random(), rand::random());
    IdentityRequest {
        hostname: id.to_string(),
        machine_id: mid.iter().map(|b| format!("{b:02x}")).collect(),
        entropy: [a, b].concat(),
    }
}

/// The error of a boot whose agent did not answer within `timeout`: the console log of
/// `dir` is kept as `DATA/failed/<id>.console.log` (older ones pruned) and the message
/// carries the accelerator, whether QEMU (`pid`, start time) still runs, `err`, and the
/// tails of `qemu.log` and the console. `what`: e.g. "microVM ID".
#[allow(clippy::too_many_arguments)]
pub fn boot_failure(
    data_dir: &Path,
    dir: &Path,
    what: &str,
    id: &str,
    timeout: std::time::Duration,
    accel: Accel,
    (pid, starttime): (i32, u64),
    err: &dyn std::fmt::Display,
) -> NodeError {
    let console = dir.join(CONSOLE_LOG);
    let failed = data_dir.join("failed");
    let keep = failed.join(format!("{id}.console.log"));
    let _ = std::fs::copy(&console, &keep);
    prune_failed(&failed);
    let alive = crate::sys::proc_starttime(pid) == Some(starttime);
    tracing::warn!(sandbox = %id, console = %keep.display(), "boot failed; console kept");
    let said = tail_of(&dir.join("qemu.log"), 400);
    // The message goes to the API caller: the kept console is named relative to the
    // node's data directory, never by its host path.
    NodeError::io(
        format!(
            "{what} did not become ready (limit {} s, {}; QEMU {}; {err}); its console is kept \
             on the node as failed/{id}.console.log; QEMU said: {}; console tail: {}",
            timeout.as_secs(),
            accel.as_str(),
            if alive { "still running" } else { "exited" },
            if said.trim().is_empty() {
                "(nothing)"
            } else {
                said.as_str()
            },
            tail_of(&console, 800)
        ),
        std::io::Error::other("boot failed"),
    )
}

/// Host memory allowed to QEMU on top of the guest's RAM (device emulation, TCG's
/// translation cache of `tb-size=64` MiB).
pub const QEMU_OVERHEAD_MIB: u64 = 192;

/// Failed-boot console logs kept.
const FAILED_KEPT: usize = 20;

/// Name of the guest's agent port (virtio-serial), the same in every QEMU backend.
pub const AGENT_PORT: &str = "org.sandlot.agent";

/// The start of every sandbox QEMU's command line: machine `machine` (`-M`), the process
/// name [`QEMU_NAME`], no default devices, no user config, no display, exit instead of
/// reboot, and the accelerator: `-accel kvm -cpu host`, or multi-threaded TCG with a
/// 64 MiB translation cache and [`TCG_CPU`].
pub(crate) fn machine_args(machine: &str, accel: Accel) -> Vec<String> {
    let accel: [&str; 4] = match accel {
        Accel::Kvm => ["-accel", "kvm", "-cpu", "host"],
        Accel::Tcg => ["-accel", "tcg,thread=multi,tb-size=64", "-cpu", TCG_CPU],
    };
    [
        "-M",
        machine,
        "-name",
        QEMU_NAME,
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]
    .into_iter()
    .chain(accel)
    .map(String::from)
    .collect()
}

/// A direct kernel boot: `smp` vCPUs, `memory_mib` MiB of guest RAM, `kernel` and `initrd`
/// with command line `append`, the serial console written to the file `console`.
pub(crate) fn boot_args(
    smp: u64,
    memory_mib: u64,
    kernel: &Path,
    initrd: &Path,
    append: &str,
    console: &Path,
) -> Vec<String> {
    vec![
        "-smp".into(),
        smp.to_string(),
        "-m".into(),
        format!("{memory_mib}M"),
        "-kernel".into(),
        kernel.display().to_string(),
        "-initrd".into(),
        initrd.display().to_string(),
        "-append".into(),
        append.into(),
        "-serial".into(),
        format!("file:{}", console.display()),
    ]
}

/// The end of every sandbox QEMU's command line: the agent port [`AGENT_PORT`] on the
/// inherited socket [`AGENT_FD`] and QMP on [`QMP_FD`] (both bound by the node, see
/// [`Jail`]; pause with memory, templates and checkpoints drive QEMU through QMP), and
/// QEMU's seccomp filter (`-sandbox on`, no obsolete calls, privilege changes, spawning or
/// resource control). `serial_bus` is the virtio-serial controller of the machine
/// (`virtio-serial-device` on microvm, `virtio-serial-pci` on q35).
pub(crate) fn control_args(serial_bus: &str) -> Vec<String> {
    vec![
        "-device".into(),
        serial_bus.into(),
        "-chardev".into(),
        chardev_on_fd("agent", AGENT_FD),
        "-device".into(),
        format!("virtserialport,chardev=agent,name={AGENT_PORT}"),
        "-chardev".into(),
        chardev_on_fd("qmp", QMP_FD),
        "-mon".into(),
        "chardev=qmp,mode=control".into(),
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
    ]
}

/// Name of the tap device a VM with a network allow policy gets in its network namespace
/// ([`crate::net::bridge_tap`]).
pub const TAP_IF: &str = "tap0";

/// QEMU arguments of the one network device of a VM with an allow policy: the tap
/// [`TAP_IF`] of its namespace, opened by the node and inherited as [`TAP_FD`] (see
/// [`Jail::netns`]; no helper scripts: `-sandbox on` forbids spawning) behind the
/// virtio-net device `device` (`virtio-net-device` on microvm, `virtio-net-pci` on q35).
/// No vhost: user-space virtio keeps the device in QEMU's jail.
pub(crate) fn net_args(device: &str) -> Vec<String> {
    vec![
        "-netdev".into(),
        format!("tap,id=net0,fd={TAP_FD},vhost=off"),
        "-device".into(),
        format!("{device},netdev=net0"),
    ]
}

/// One initramfs entry for [`write_cpio`]: path, mode, content (`None`: a directory).
pub(crate) type CpioEntry = (String, u32, Option<Vec<u8>>);

/// The entries every QEMU backend's initramfs starts with: the mount points of the guest's
/// init (`dev`, `proc`, `sys`, `mnt`, `modules`) and `/init` = `agent` (the static
/// `sandlot-guest`); the kit's modules and `modules/order` follow.
pub(crate) fn initramfs_entries(agent: Vec<u8>) -> Vec<CpioEntry> {
    let dir = |name: &str, mode| (name.to_string(), mode, None);
    vec![
        dir("dev", 0o755),
        dir("proc", 0o555),
        dir("sys", 0o555),
        dir("mnt", 0o755),
        dir("modules", 0o755),
        ("init".into(), 0o755, Some(agent)),
    ]
}

/// Writes the initramfs `path` from `entries` ([`write_cpio`]), read-only (mode 0444: the
/// QEMUs of every sandbox read it).
///
/// # Errors
/// `Internal` when it cannot be written.
pub(crate) fn write_initramfs(path: &Path, entries: &[CpioEntry]) -> NodeResult<()> {
    write_cpio(path, entries)
        .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444)))
        .map_err(|e| NodeError::io(format!("write {}", path.display()), e))
}

/// Checks what a QEMU backend's guest boots: the kit's kernel `kernel` is there and
/// `agent_bin` (made absolute when it can be) is a statically linked `sandlot-guest`.
///
/// # Errors
/// `Unavailable` naming what is missing and how to get it.
pub(crate) fn check_guest(backend: &str, kernel: &Path, agent_bin: &mut PathBuf) -> NodeResult<()> {
    if !kernel.is_file() {
        return Err(NodeError::Unavailable(format!(
            "no guest kernel at {} (run scripts/guest-kit.sh, or set SANDLOT_GUEST_KIT_DIR)",
            kernel.display()
        )));
    }
    if let Ok(abs) = std::fs::canonicalize(&*agent_bin) {
        *agent_bin = abs;
    }
    if !crate::backends::container::is_static_elf(agent_bin) {
        return Err(NodeError::Unavailable(format!(
            "the {backend} backend needs a statically linked sandlot-guest as the guest's init; {} is missing or dynamic",
            agent_bin.display()
        )));
    }
    Ok(())
}

/// Writes a newc cpio archive: `(path in archive, mode, contents)`; directories have
/// `None` contents; `dev/console` is added as a character device (5, 1).
pub(crate) fn write_cpio(out: &Path, entries: &[CpioEntry]) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = out.with_extension("tmp");
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    let mut ino = 1u32;
    let mut put = |w: &mut std::io::BufWriter<std::fs::File>,
                   name: &str,
                   mode: u32,
                   data: &[u8],
                   rdev: (u32, u32)|
     -> std::io::Result<()> {
        let nlink = if mode & 0o040000 != 0 { 2 } else { 1 };
        let hdr = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            ino,
            mode,
            0,
            0,
            nlink,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() + 1,
            0
        );
        ino += 1;
        w.write_all(hdr.as_bytes())?;
        w.write_all(name.as_bytes())?;
        w.write_all(&[0])?;
        let pad = (4 - (110 + name.len() + 1) % 4) % 4;
        w.write_all(&[0u8; 4][..pad])?;
        w.write_all(data)?;
        w.write_all(&[0u8; 4][..(4 - data.len() % 4) % 4])?;
        Ok(())
    };
    for (name, mode, data) in entries {
        match data {
            None => put(&mut w, name, 0o040000 | mode, &[], (0, 0))?,
            Some(d) => put(&mut w, name, 0o100000 | mode, d, (0, 0))?,
        }
    }
    put(&mut w, "dev/console", 0o020600, &[], (5, 1))?;
    put(&mut w, "TRAILER!!!", 0, &[], (0, 0))?;
    w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, out)
}

/// The last `n` bytes of the file at `path` (lossy UTF-8, trimmed); empty when unreadable.
pub(crate) fn tail_of(path: &Path, n: usize) -> String {
    let s = std::fs::read(path).unwrap_or_default();
    let s = String::from_utf8_lossy(&s[s.len().saturating_sub(n)..]).into_owned();
    s.trim().to_string()
}

/// Starts the QEMU binary `qemu` with `args` in `dir` ([`spawn_logged`]: its log in
/// `dir/qemu.log`, appended to when `append`), in cgroup `cg`, jailed by `jail`; returns
/// its pid and start time.
///
/// # Errors
/// `Internal` when the log cannot be opened or QEMU cannot be started.
pub(crate) fn spawn_qemu(
    qemu: &Path,
    args: &[String],
    dir: &Path,
    cg: &SandboxCgroup,
    append: bool,
    jail: &Jail,
) -> NodeResult<(i32, u64)> {
    let mut cmd = std::process::Command::new(qemu);
    cmd.args(args);
    spawn_logged(&mut cmd, dir, cg, append, jail)
}

/// Removes the oldest files of `dir` (by modification time) beyond the newest
/// [`FAILED_KEPT`].
pub(crate) fn prune_failed(dir: &Path) {
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    files.sort();
    let excess = files.len().saturating_sub(FAILED_KEPT);
    for (_, p) in files.into_iter().take(excess) {
        let _ = std::fs::remove_file(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_is_newc_with_trailer() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("x.cpio");
        write_cpio(
            &out,
            &[
                ("a".into(), 0o755, None),
                ("a/b".into(), 0o644, Some(b"hello".to_vec())),
            ],
        )
        .unwrap();
        let data = std::fs::read(&out).unwrap();
        assert!(data.starts_with(b"070701"));
        assert_eq!(data.len() % 4, 0);
        let s = String::from_utf8_lossy(&data);
        assert!(s.contains("a/b\0"));
        assert!(s.contains("hello"));
        assert!(s.contains("dev/console\0"));
        assert!(s.contains("TRAILER!!!\0"));
    }

    #[test]
    fn command_line_pieces_keep_their_order() {
        // Each option stands before its value, the machine first, the accelerator last.
        let m = machine_args("q35", Accel::Tcg);
        let after = |o: &str| m.iter().position(|a| a == o).map(|i| m[i + 1].as_str());
        assert_eq!(m.len(), 13);
        assert_eq!(&m[..2], ["-M", "q35"]);
        assert_eq!(after("-name"), Some(QEMU_NAME));
        assert_eq!(after("-display"), Some("none"));
        assert_eq!(after("-accel"), Some("tcg,thread=multi,tb-size=64"));
        assert_eq!(m.last().map(String::as_str), Some(TCG_CPU));
        for flag in ["-nodefaults", "-no-user-config", "-no-reboot"] {
            assert!(m.iter().any(|a| a == flag), "{flag} missing from {m:?}");
        }
        assert_eq!(
            machine_args("q35", Accel::Kvm)[9..],
            ["-accel", "kvm", "-cpu", "host"]
        );
        let b = boot_args(
            2,
            512,
            Path::new("/k"),
            Path::new("/i"),
            "quiet",
            Path::new("/c"),
        );
        assert_eq!(
            b,
            [
                "-smp", "2", "-m", "512M", "-kernel", "/k", "-initrd", "/i", "-append", "quiet",
                "-serial", "file:/c"
            ]
        );
        let c = control_args("virtio-serial-pci");
        assert_eq!(c[..2], ["-device", "virtio-serial-pci"]);
        assert_eq!(
            c[4..6],
            [
                "-device",
                "virtserialport,chardev=agent,name=org.sandlot.agent"
            ]
        );
        assert_eq!(c[c.len() - 2], "-sandbox");
    }

    #[test]
    fn tsc_is_invariant_only_with_both_flags() {
        let info = |flags: &str| format!("processor\t: 0\nflags\t\t: fpu tsc {flags} msr\n");
        assert!(tsc_invariant_in(&info("constant_tsc nonstop_tsc")));
        assert!(!tsc_invariant_in(&info("constant_tsc")));
        assert!(!tsc_invariant_in(&info("nonstop_tsc")));
        assert!(!tsc_invariant_in("processor\t: 0\n"));
        // Only whole words count.
        assert!(!tsc_invariant_in(&info("constant_tsc_x nonstop_tsc")));
    }

    #[test]
    fn drive_files_are_the_file_values_of_drive_arguments() {
        let args: Vec<String> = [
            "-M",
            "microvm",
            "-drive",
            "id=image,file=/d/images/ab.erofs,format=raw,if=none,readonly=on",
            "-append",
            "file=/not/a/drive",
            "-drive",
            "id=scratch,file=/d/vms/x/scratch.img,format=raw",
        ]
        .map(String::from)
        .to_vec();
        let files: Vec<PathBuf> = drive_files(&args).collect();
        assert_eq!(
            files,
            [
                PathBuf::from("/d/images/ab.erofs"),
                PathBuf::from("/d/vms/x/scratch.img")
            ]
        );
    }

    #[test]
    fn collection_keeps_named_disks_by_inode_and_build_leftovers_only_when_asked() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n);
        for n in ["kept.erofs", "stale.erofs", "cut.erofs.tmp", "other.qcow2"] {
            std::fs::write(p(n), b"disk").unwrap();
        }
        std::fs::create_dir_all(p("cut.merge")).unwrap();
        // Named through another spelling of the directory: still the same file.
        let alias = tempfile::tempdir().unwrap();
        let link = alias.path().join("data");
        std::os::unix::fs::symlink(d.path(), &link).unwrap();
        let keep = [link.join("kept.erofs"), p("absent.erofs")];
        let removed = remove_unneeded_disks(d.path(), "erofs", &keep, false);
        assert_eq!(removed, [("stale.erofs".to_string(), 4)]);
        assert!(p("cut.erofs.tmp").exists() && p("cut.merge").exists());
        let mut removed = remove_unneeded_disks(d.path(), "erofs", &keep, true);
        removed.sort();
        let names: Vec<&str> = removed.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["cut.erofs.tmp", "cut.merge"]);
        assert!(p("kept.erofs").exists() && p("other.qcow2").exists());
    }

    #[test]
    fn a_disk_held_by_a_create_outlives_collections_until_released() {
        let d = tempfile::tempdir().unwrap();
        let store = ImageStore::open(d.path().join("store")).unwrap();
        let images = d.path().join("images");
        std::fs::create_dir_all(&images).unwrap();
        let disk = images.join("old.erofs");
        std::fs::write(&disk, b"disk").unwrap();
        let disks = ImageDisks::new("t", images.clone(), "erofs", store.clone());
        let collect = || {
            let used = || Ok(HashSet::new());
            collect_image_disks(
                "t",
                &images,
                "erofs",
                &store,
                |_| PathBuf::new(),
                &disks,
                used,
                false,
            )
        };
        let (a, b) = (disks.holds.hold(&disk), disks.holds.hold(&disk));
        collect();
        drop(a);
        collect();
        assert!(disk.exists(), "removed while a create held it");
        drop(b);
        assert!(disks.holds.lock().is_empty());
        collect();
        assert!(!disk.exists(), "kept with no image, user or hold");
    }

    #[test]
    fn vcpu_count_from_a_command_line() {
        let cmd = |args: &[&str]| {
            let mut c = std::process::Command::new("qemu");
            c.args(args);
            c
        };
        assert_eq!(smp_of(&cmd(&["-m", "256M", "-smp", "4"])), 4);
        assert_eq!(smp_of(&cmd(&["-smp", "cpus=2,maxcpus=2"])), 2);
        assert_eq!(smp_of(&cmd(&["-smp", "3,sockets=1"])), 3);
        assert_eq!(smp_of(&cmd(&["-m", "256M"])), 1);
        assert_eq!(smp_of(&cmd(&["-smp"])), 1);
    }

    #[test]
    fn host_tsc_rate_is_whole_mhz() {
        let khz = host_tsc_khz();
        assert_eq!(khz % 1000, 0);
        assert!((100_000..=10_000_000).contains(&khz), "{khz} kHz");
        assert_eq!(host_tsc_khz(), khz, "counted once");
    }

    #[test]
    fn chardev_on_an_inherited_listening_socket() {
        assert_eq!(
            chardev_on_fd("agent", AGENT_FD),
            "socket,id=agent,fd=3,server=on,wait=off"
        );
    }

    #[test]
    fn a_root_qemu_gets_no_sockets_handed_over() {
        let j = Jail::new(None, Accel::Tcg, &[(AGENT_SOCK, AGENT_FD)]);
        assert!(j.sockets.is_empty() && j.groups.is_empty());
        let j = Jail::new(Some(200_000), Accel::Tcg, &[(AGENT_SOCK, AGENT_FD)]);
        assert_eq!(j.sockets, vec![(AGENT_SOCK, AGENT_FD)]);
    }

    #[test]
    fn uids_are_per_sandbox_kept_and_released() {
        let u = QemuUids::new(UidSlots::new(100_000));
        let g = u.group().expect("a shared group");
        let a = u.take("a").unwrap();
        let b = u.take("b").unwrap();
        assert!(a != b && a != g && b != g);
        assert_eq!(u.take("a").unwrap(), a, "the same sandbox keeps its uid");
        u.release("a");
        u.keep("c", a);
        assert_ne!(
            u.take("d").unwrap(),
            a,
            "a re-adopted uid is not handed out again"
        );
        let j = u.jail(Some(b), Accel::Tcg, &[]);
        assert_eq!(j.groups, vec![g]);
    }

    #[test]
    fn a_uid_is_given_back_only_once_its_vm_dir_is_gone() {
        let u = QemuUids::new(UidSlots::new(100_000));
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("vm-a");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("disk.qcow2"), b"x").unwrap();
        let a = u.take("a").unwrap();
        remove_vm_dir(&u, "a", &dir).unwrap();
        assert!(!dir.exists());
        assert_eq!(u.take("b").unwrap(), a, "the uid is free again");
        // Not removable (here: not a directory): the uid stays with its sandbox.
        let f = t.path().join("vm-b");
        std::fs::write(&f, b"x").unwrap();
        assert!(remove_vm_dir(&u, "b", &f).is_err());
        assert_ne!(u.take("c").unwrap(), a, "b still holds it");
        // A directory already gone is fine.
        remove_vm_dir(&u, "b", &t.path().join("nothing")).unwrap();
        assert_eq!(u.take("d").unwrap(), a);
    }

    /// Needs root (chown).
    #[test]
    fn vm_dir_lets_the_uid_in_but_not_write() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root (chown)");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let disk = d.path().join("scratch.img");
        std::fs::write(&disk, b"x").unwrap();
        prepare_vm_files(d.path(), &[&disk], 4_000_000).unwrap();
        let md = std::fs::metadata(d.path()).unwrap();
        assert_eq!(
            (md.uid(), md.gid(), md.mode() & 0o7777),
            (0, 4_000_000, 0o710)
        );
        for f in [disk, d.path().join(CONSOLE_LOG)] {
            let md = std::fs::metadata(&f).unwrap();
            assert_eq!(
                (md.uid(), md.gid(), md.mode() & 0o7777),
                (4_000_000, 4_000_000, 0o600),
                "{}",
                f.display()
            );
        }
    }
}
