//! pid 1 of a microVM: `/init` of the initramfs the node builds (see the node's
//! `backends::qemu::microvm`). Steps, each failure printed to the console (the node keeps the
//! console log of a failed boot):
//!
//! 1. mount `/proc`, `/sys`, `/dev` (devtmpfs) in the initramfs;
//! 2. load the kernel modules listed in `/modules/order` (dependencies first; the Debian
//!    cloud kernel has virtio, virtio-mmio, virtio-blk, virtio-console, erofs and overlay
//!    as modules) with finit_module(2);
//! 3. find the two disks by their virtio serial (`/sys/block/vdX/serial`): `image` (the
//!    image's EROFS file system, mounted read-only at `/mnt/image`) and `scratch` (an ext4
//!    file system made by the node, mounted at `/mnt/scratch`); overlay `image` +
//!    `scratch/upper` at `/mnt/root`, with `/workspace`, `/root` and `/tmp` made there;
//! 4. move `/proc`, `/sys`, `/dev` into it and make it `/` (`mount --move` + chroot, the
//!    initramfs way: pivot_root cannot leave the initramfs); mount `/dev/pts`, `/dev/shm`;
//! 5. with `sandlot.net=…` on the command line (a sandbox with a network allow policy),
//!    configure `eth0`, `lo` and `/etc/resolv.conf` ([`sandlot_guest::vm_net`]; its
//!    modules are loaded in step 2 only then);
//! 6. serve the agent protocol ([`crate::agent`]) over the virtio-serial port named
//!    `org.sandlot.agent`, which QEMU connects to a unix socket on the host.
//!
//! With `sandlot.root=disk` on the kernel command line (the `vm` backend: a q35 VM whose
//! root is a whole ext4 disk, see [`disk_root`]) steps 3–4 are instead: mount the virtio
//! disk with serial `root` read-write at `/mnt/root` and make it `/`; this process (the
//! initramfs's `/init`, still pid 1) then grows the file system to the disk's size in a
//! thread and does steps 5–6, as in a microVM. The disk holds nothing of Sandlot: the agent
//! runs from the initramfs (its exec helpers re-exec `/proc/self/exe`, which names the
//! initramfs file even though no path reaches it after the switch), so one disk — e.g. an
//! image's ext4 disk served lazily by the node — serves nodes with any agent version.
//!
//! With `sandlot.probe` on the kernel command line it only prints [`PROBE_MARK`] to the
//! console and powers off: the node's accelerator probe boots that to learn whether KVM can
//! run the guest kernel.
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};

/// Printed on the console by a probe boot once the guest kernel reached init.
pub const PROBE_MARK: &str = "SANDLOT-PROBE-OK";

/// Name of the virtio-serial port the agent serves on.
pub const AGENT_PORT: &str = "org.sandlot.agent";

fn log(msg: &str) {
    eprintln!("sandlot-guest vm-init: {msg}");
}

/// Milliseconds since the guest kernel booted (`CLOCK_BOOTTIME`).
fn uptime_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

/// Guest uptime (ms) at each step of a microVM boot, logged once before the agent serves:
/// the boot breakdown in docs/backends.md. stderr is `/dev/kmsg` ([`stdio_to_kmsg`]), so
/// the line reaches the console only above `quiet`'s loglevel, e.g. with
/// `SANDLOT_MICROVM_APPEND="loglevel=5 printk.devkmsg=on"` on the node.
#[derive(Default)]
struct Phases(Vec<(&'static str, u64)>);

impl Phases {
    fn mark(&mut self, what: &'static str) {
        self.0.push((what, uptime_ms()));
    }

    fn log(&self) {
        let parts: Vec<String> = self.0.iter().map(|(w, t)| format!("{w}={t}")).collect();
        log(&format!(
            "boot phases (guest uptime, ms): {}",
            parts.join(" ")
        ));
    }
}

/// Points stdout and stderr at `/dev/kmsg`: the kernel prints those lines on the console
/// itself (polled), whereas a process writing to the serial tty blocks once its buffer is
/// full when the UART's transmit interrupt never comes (seen under TCG on `-M microvm`).
fn stdio_to_kmsg() {
    use std::os::fd::IntoRawFd;
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open("/dev/kmsg") {
        let fd = f.into_raw_fd();
        // SAFETY: dup2 onto the standard descriptors with a valid source fd.
        unsafe {
            libc::dup2(fd, 1);
            libc::dup2(fd, 2);
            libc::close(fd);
        }
    }
}

/// Entry point of `/init`; never returns on success (serves until the VM is killed).
pub fn main() -> i32 {
    if let Err(e) = boot() {
        log(&format!("boot failed: {e}"));
        power_off();
    }
    // The agent serves until QEMU is killed; reaching here means it gave up.
    power_off();
    1
}

fn power_off() {
    // SAFETY: sync and reboot(2) take no pointers.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
}

fn mnt(
    src: &str,
    dst: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), String> {
    let _ = std::fs::create_dir_all(dst);
    mount(Some(src), dst, Some(fstype), flags, data)
        .map_err(|e| format!("mount {fstype} {src} on {dst}: {e}"))
}

fn boot() -> Result<(), String> {
    let mut phases = Phases::default();
    phases.mark("init");
    let none = MsFlags::empty();
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mnt("proc", "/proc", "proc", nosuid, None)?;
    mnt("sysfs", "/sys", "sysfs", nosuid, None)?;
    mnt(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    stdio_to_kmsg();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    if cmdline.split_whitespace().any(|w| w == "sandlot.probe") {
        // The mark comes after a timed sleep: it proves the guest's timers fire too.
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(50));
        println!("{PROBE_MARK} slept {:?}", t.elapsed());
        return Ok(());
    }
    let net = sandlot_guest::vm_net::NetArg::from_cmdline(&cmdline);
    load_modules(net.is_some())?;
    phases.mark("modules");
    if cmdline.split_whitespace().any(|w| w == DISK_ROOT_ARG) {
        return disk_root(&cmdline);
    }
    let image = wait_disk("image")?;
    let scratch = wait_disk("scratch")?;
    phases.mark("disks");
    mnt(&image, "/mnt/image", "erofs", MsFlags::MS_RDONLY, None)?;
    mnt(&scratch, "/mnt/scratch", "ext4", MsFlags::MS_NOATIME, None)?;
    for (d, mode) in [("/mnt/scratch/upper", 0o755), ("/mnt/scratch/work", 0o700)] {
        mkdir_mode(Path::new(d), mode)?;
    }
    mnt(
        "overlay",
        "/mnt/root",
        "overlay",
        none,
        Some("lowerdir=/mnt/image,upperdir=/mnt/scratch/upper,workdir=/mnt/scratch/work"),
    )?;
    enter_root()?;
    phases.mark("root");
    serve_in_root(&cmdline, Some(phases))
}

/// The last steps of every guest's pid 1, once `/` is the sandbox's root with `/proc`,
/// `/sys` and `/dev` in it: `/dev/pts`, `/dev/shm`, the host name, the sandbox cgroup, then
/// the agent on [`AGENT_PORT`] (never returns on success). `phases`: the boot's timings,
/// logged once the port is found.
fn serve_in_root(cmdline: &str, phases: Option<Phases>) -> Result<(), String> {
    IN_VM.store(true, std::sync::atomic::Ordering::SeqCst);
    mnt(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    mnt(
        "shm",
        "/dev/shm",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    let _ = nix::unistd::sethostname("sandlot");
    // `lo` starts down in the guest kernel; programs reach their own servers on 127.0.0.1
    // with or without a network policy.
    crate::sys::loopback_up().map_err(|e| format!("bringing up lo: {e}"))?;
    if let Some(net) = sandlot_guest::vm_net::NetArg::from_cmdline(cmdline) {
        sandlot_guest::vm_net::configure(&net)?;
        sandlot_guest::vm_net::write_resolv_conf(&net)?;
    }
    sandbox_cgroup(cmdline)?;
    let port = find_port(AGENT_PORT)?;
    if let Some(mut p) = phases {
        p.mark("agent");
        p.log();
    }
    std::process::exit(crate::agent::serve_vm(&port));
}

/// Path of the guest cgroup every exec joins (made by [`sandbox_cgroup`]).
pub const SANDBOX_CGROUP_PROCS: &str = "/sys/fs/cgroup/sandbox/cgroup.procs";

/// The `sandbox` group's memory events (`oom_kill N`: its processes the OOM killer ended).
pub const SANDBOX_MEMORY_EVENTS: &str = "/sys/fs/cgroup/sandbox/memory.events";

/// Mounts cgroup2 and makes the `sandbox` group every exec joins, with `pids.max` from
/// `sandlot.pids_max=N` on the kernel command line (the sandbox's process limit: kernel
/// threads and the agent stay outside it).
fn sandbox_cgroup(cmdline: &str) -> Result<(), String> {
    mnt(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    let _ = std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+pids +memory");
    std::fs::create_dir_all("/sys/fs/cgroup/sandbox")
        .map_err(|e| format!("mkdir sandbox cgroup: {e}"))?;
    if let Some(n) = cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix("sandlot.pids_max="))
    {
        std::fs::write("/sys/fs/cgroup/sandbox/pids.max", n)
            .map_err(|e| format!("pids.max {n}: {e}"))?;
    }
    Ok(())
}

fn mkdir_mode(p: &Path, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::create_dir_all(p) {
        Ok(()) => {}
        Err(e) => return Err(format!("mkdir {}: {e}", p.display())),
    }
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod {}: {e}", p.display()))
}

/// Loads the modules of `/modules/order`; those of
/// [`NET_MODULES`](sandlot_guest::vm_net::NET_MODULES) only when `with_net` (each load costs
/// guest time under TCG; a VM without a network has no virtio-net device).
fn load_modules(with_net: bool) -> Result<(), String> {
    let order = match std::fs::read_to_string("/modules/order") {
        Ok(s) => s,
        Err(_) => return Ok(()), // a kernel with everything built in
    };
    for name in order
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .filter(|l| with_net || !sandlot_guest::vm_net::NET_MODULES.contains(l))
    {
        let path = format!("/modules/{name}");
        let f = std::fs::File::open(&path).map_err(|e| format!("open {path}: {e}"))?;
        let params = CString::new("").expect("no NUL");
        // SAFETY: finit_module(fd, "", 0) with a valid fd and a NUL-terminated string.
        let r = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), params.as_ptr(), 0) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(format!("load module {name}: {e}"));
            }
        }
    }
    Ok(())
}

/// `/dev/vdX` of the virtio disk whose serial is `serial`, waiting up to 10 s for it.
fn wait_disk(serial: &str) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(rd) = std::fs::read_dir("/sys/block") {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let s = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
                if s.trim() == serial {
                    let dev = format!("/dev/{name}");
                    if Path::new(&dev).exists() {
                        return Ok(dev);
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(format!("no virtio disk with serial {serial:?} within 10 s"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `/dev/vportNpM` of the virtio-serial port named `name`, waiting up to 10 s.
fn find_port(name: &str) -> Result<PathBuf, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(rd) = std::fs::read_dir("/sys/class/virtio-ports") {
            for e in rd.flatten() {
                let n = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
                if n.trim() == name {
                    let dev = Path::new("/dev").join(e.file_name());
                    if dev.exists() {
                        return Ok(dev);
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(format!("no virtio-serial port named {name:?} within 10 s"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Set once this process is the agent of a microVM or VM (pid 1 of its guest): the file
/// calls then also accept ext4, the `vm` root disk's file system.
pub static IN_VM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Kernel command line word that selects the `vm` boot: the root is a whole disk.
pub const DISK_ROOT_ARG: &str = "sandlot.root=disk";

/// `EXT4_IOC_RESIZE_FS` = `_IOW('f', 16, __u64)` (linux/fs/ext4/ext4.h): online grow of a
/// mounted ext4 to the given block count (what resize2fs does on a mounted file system).
const EXT4_IOC_RESIZE_FS: libc::c_ulong = 0x4008_6610;

/// Makes the sandbox directories missing from the root file system mounted at `/mnt/root`,
/// moves `/proc`, `/sys` and `/dev` into it and makes it the root (`MS_MOVE` onto `/` +
/// chroot, as an initramfs `switch_root` does; the initramfs stays reachable to no one).
fn enter_root() -> Result<(), String> {
    for (d, mode) in [
        ("/mnt/root/workspace", 0o755),
        ("/mnt/root/root", 0o700),
        ("/mnt/root/tmp", 0o1777),
        ("/mnt/root/proc", 0o555),
        ("/mnt/root/sys", 0o555),
        ("/mnt/root/dev", 0o755),
    ] {
        if !Path::new(d).exists() {
            mkdir_mode(Path::new(d), mode)?;
        }
    }
    for d in ["/proc", "/sys", "/dev"] {
        let to = format!("/mnt/root{d}");
        mount(
            Some(d),
            to.as_str(),
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(|e| format!("move {d} to {to}: {e}"))?;
    }
    std::env::set_current_dir("/mnt/root").map_err(|e| format!("chdir /mnt/root: {e}"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|e| format!("move /mnt/root to /: {e}"))?;
    nix::unistd::chroot(".").map_err(|e| format!("chroot: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))?;
    Ok(())
}

/// The `vm` boot from the initramfs: mount the `root` disk read-write, make it `/`, grow
/// its ext4 to the disk's size in a thread (the grow takes a fraction of a second for a few
/// GiB but minutes for a TiB under TCG; until it ends the sandbox has the base file
/// system's free space), then serve the agent as pid 1 ([`serve_in_root`]). Never returns
/// on success.
fn disk_root(cmdline: &str) -> Result<(), String> {
    let dev = wait_disk("root")?;
    // noinit_itable: no background zeroing of the inode tables that the online grow adds
    // (gigabytes of writes for a large disk_mib; the disk is the sandbox's own, thrown away
    // on delete, and uninitialised groups are marked as such in their descriptors).
    mnt(
        &dev,
        "/mnt/root",
        "ext4",
        MsFlags::MS_NOATIME,
        Some("noinit_itable"),
    )?;
    enter_root()?;
    std::thread::spawn(move || grow_ext4(&dev, "/"));
    serve_in_root(cmdline, None)
}

/// Grows the ext4 at `mountpoint` to the size of `dev` (the node makes the per-sandbox
/// qcow2 overlay larger than the image's file system: `disk_mib` more). Failure is logged,
/// not fatal: the sandbox then has the base file system's free space.
fn grow_ext4(dev: &str, mountpoint: &str) {
    let name = dev.trim_start_matches("/dev/");
    let sectors: u64 = std::fs::read_to_string(format!("/sys/block/{name}/size"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let Ok(st) = nix::sys::statvfs::statvfs(mountpoint) else {
        log("statvfs of the root disk failed; not grown");
        return;
    };
    let bsize = st.block_size().max(1024);
    let mut blocks: u64 = sectors * 512 / bsize;
    let Ok(f) = std::fs::File::open(mountpoint) else {
        return;
    };
    let t = Instant::now();
    // SAFETY: EXT4_IOC_RESIZE_FS reads one u64 through the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), EXT4_IOC_RESIZE_FS, &mut blocks as *mut u64) };
    if r != 0 {
        log(&format!(
            "grow {dev} to {blocks} blocks: {}",
            std::io::Error::last_os_error()
        ));
    } else {
        log(&format!(
            "grew {dev} to {blocks} blocks in {:?}",
            t.elapsed()
        ));
    }
}
