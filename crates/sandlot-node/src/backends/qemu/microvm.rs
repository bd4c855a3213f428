//! The `microvm` backend: one QEMU `-M microvm` virtual machine per sandbox, with its own
//! guest kernel (the Debian cloud kernel of the guest kit, see `scripts/guest-kit.sh`),
//! direct kernel boot of its uncompressed `vmlinux` through the PVH entry (`kit_kernel`),
//! no PCI, no firmware beyond microvm's, no network device unless the sandbox has a network
//! allow policy (then one `virtio-net-device` on a tap bridged to the node's veth, see
//! `QemuCore::attach_net` in `sandbox.rs`; such a microVM always boots cold: a template's
//! device set has no network). docs/backends.md ("Cold boot")
//! has the boot's time breakdown behind the kernel command line.
//!
//! Host layout (`DATA/microvm/`):
//!
//! * `initramfs.cpio` — built by the node at start (newc format): `/init` = the static
//!   `sandlot-guest` (pid 1 of the guest, see `sandlot-guest`'s `vm` module), the kit's
//!   modules a microVM needs (`VM_ONLY_MODULES` left out), their signatures stripped
//!   (`strip_module_signature`), and `/modules/order`.
//! * `images/<key>.erofs` — an image converted once by `mkfs.erofs` (the layers are merged
//!   through a read-only overlay mount first), shared read-only by every microVM of that
//!   image; `<key>` hashes the image name, creation time and layer paths. Removed once no
//!   image in the store maps to it and no microVM names it (`collect_disks`).
//! * `vms/<id>/` — one sandbox (owner root, group = its QEMU's uid, mode 0710):
//!   `scratch.img` (owned by its QEMU's uid, mode 0600; a sparse ext4 file of `disk_mib` MiB made
//!   with `mkfs.ext4`: the overlay's writable layer inside the guest), `agent.sock` (the
//!   unix socket behind the guest's virtio-serial port `org.sandlot.agent`, bound by the node
//!   and served by QEMU on the inherited fd: the agent protocol of containers runs over it),
//!   `qmp.sock` (QMP, likewise), `console.log` (the guest's serial
//!   console), `qemu.log` (QEMU's own messages), `state.json` (written once the agent
//!   answered: a directory without it is a half-created sandbox and is removed by
//!   `readopt`).
//! * `failed/<id>.console.log` — the console of a microVM that did not become ready (the
//!   last 20 are kept).
//!
//! Accelerator: KVM when `/dev/kvm` opens and a probe boot of the guest kernel reaches init
//! within [`super::accel::PROBE_TIMEOUT`] (some hosts' nested KVM cannot boot a stock kernel), else TCG;
//! decided once per node process (in the background from node start, shared with the `vm`
//! backend: [`super::AccelProbe`]), logged, shown in node info and each sandbox's
//! info; `SANDLOT_VM_ACCEL=kvm|tcg` (or the older `SANDLOT_MICROVM_ACCEL`) forces it.
//!
//! Jailing: every QEMU runs in its own cgroup (memory = the guest's plus
//! [`QEMU_OVERHEAD_MIB`](super::QEMU_OVERHEAD_MIB); its vCPU threads held to the sandbox's CPU, QEMU as a whole to
//! that plus [`super::VMM_CPU_HEADROOM`] on cgroup v1; [`QEMU_PIDS`] tasks) with `-sandbox on`
//! (QEMU's seccomp filter: no spawning, no privilege changes, no obsolete calls, no
//! resource control calls), in a session of its own, so it outlives a node restart and
//! is re-adopted, and as an unprivileged host uid of its own that reaches only its own
//! files and the shared read-only ones (see [`super`]).
use super::sandbox::{Boot, Booted, Machine, QemuCore, QemuVm};
use super::snapshot::Relay;
use super::state::{write_json, VmState};
use super::store;
use super::{find_binary, spawn_qemu, Accel};
use super::{DiskHold, ImageDisks, QemuUids, CONSOLE_LOG};
use crate::agent_client::AgentClient;
use crate::backends::saved::StoredSpec;
use crate::cgroups::CgroupRoot;
use crate::checkpoints::{Captured, Checkpoint};
use crate::images::disks::make_erofs;
use crate::images::{fnv, Image, ImageStore};
use crate::node::{NodeError, NodeResult};
use crate::sys::spawn_blocking;
use async_trait::async_trait;
use sandlot_api::Backend;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod template;

/// Boot → agent ready deadline under KVM.
const READY_TIMEOUT_KVM: Duration = Duration::from_secs(30);
/// Boot → agent ready deadline under TCG (slow, and slower on a loaded host).
const READY_TIMEOUT_TCG: Duration = Duration::from_secs(120);

/// Built-in kernel initcalls a microVM's kernel skips (`initcall_blacklist=`): each costs
/// 5-70 ms under TCG and serves nothing a sandbox's guest uses. Self-tests
/// (`crypto_kdf108_init`, `blake2s_mod_init`: they run despite `cryptomgr.notests`), kprobe
/// events in tracefs (`init_kprobe_trace`), the built-in X.509 certificates
/// (`load_system_certificate_list`: they verify module signatures, which this kernel does not
/// enforce and the node strips), and the registrations of BPF kernel functions, the first of
/// which parses all of vmlinux's BTF (~50 ms): BPF programs in the guest cannot call those
/// kfuncs, and TCP in the guest uses Reno instead of CUBIC (`cubictcp_register` is one of
/// them). The kit's modules carry no BTF either (`scripts/guest-kit.sh`), so no boot parses
/// it. Names are Linux 6.1's (Debian 12's cloud kernel); an unknown name is ignored.
pub const SKIPPED_INITCALLS: &[&str] = &[
    "init_kprobe_trace",
    "crypto_kdf108_init",
    "blake2s_mod_init",
    "load_system_certificate_list",
    "cubictcp_register",
    "bpf_rstat_kfunc_init",
    "bpf_key_sig_kfuncs_init",
    "kfunc_init",
    "bpf_prog_test_run_init",
    "bpf_tcp_ca_kfunc_init",
];
/// Tasks (threads) allowed to one QEMU.
pub const QEMU_PIDS: u64 = 64;

/// Static configuration of the microvm backend.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// `DATA/microvm`.
    pub dir: PathBuf,
    /// The guest kit (`vmlinux`, `vmlinuz`, `modules/`), built by `scripts/guest-kit.sh`.
    pub kit_dir: PathBuf,
    /// The statically linked `sandlot-guest` (the guest's `/init`).
    pub agent_bin: PathBuf,
    /// The node's accelerator decision (forced or probed), shared with the `vm` backend.
    pub probe: Arc<super::AccelProbe>,
    /// Host uids of the QEMUs (one per sandbox), shared with the `vm` backend.
    pub uids: Arc<QemuUids>,
    /// The node's image store: which image disks a create may still ask for (collection of
    /// the others, [`super::collect_image_disks`]).
    pub images: ImageStore,
    /// The shared snapshot store pauses write to (`--snapshot-dir`; [`super::store`]), so
    /// another node can resume a paused microVM; `None`: pauses stay on this node's disk.
    pub snapshot_store: Option<super::store::SnapshotStore>,
    /// The node's network policies (shared with the other backends); `None`: allow
    /// policies are refused.
    pub net: Option<Arc<crate::net::NodeNet>>,
}

/// The microvm backend: microVMs by id.
pub struct MicrovmBackend {
    cfg: MicrovmConfig,
    /// Directory, QEMU, cgroups, uids and the table of microVMs.
    core: QemuCore,
    /// Serialises image conversions (one `mkfs.erofs` at a time).
    /// Image disk conversions (one at a time) and the disks creates in flight hold.
    disks: ImageDisks,
    /// Template snapshots in use (`SANDLOT_MICROVM_TEMPLATES`, default on).
    templates_enabled: bool,
    /// Template keys being built now.
    templates_building: Arc<Mutex<std::collections::HashSet<String>>>,
    /// The boot files templates depend on (kernel and QEMU `path:size:mtime`, a hash of the
    /// initramfs's content): part of every template key, and kept in each template's
    /// `inputs` file so that templates of other files are collected (`template::sweep`).
    template_inputs: String,
}

/// The kernel `microvm` boots from the guest kit `kit`: `vmlinux`, the uncompressed ELF
/// with a PVH entry note that `scripts/guest-kit.sh` cuts out of `vmlinuz`, when present
/// (QEMU jumps straight to its PVH entry, under KVM as under TCG: no self-decompression of
/// a bzImage, ~0.2 s of CPU per boot under TCG), else `vmlinuz` (an older kit).
pub(crate) fn kit_kernel(kit: &Path) -> PathBuf {
    let elf = kit.join("vmlinux");
    if elf.is_file() {
        elf
    } else {
        kit.join("vmlinuz")
    }
}

/// Modules of the kit that only the `vm` backend needs (virtio-pci is q35's bus,
/// virtio-rng its entropy device): a microVM has neither, so its initramfs leaves them out
/// (each module load costs 5-50 ms of guest time under TCG).
const VM_ONLY_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio-rng",
    "virtio_rng",
];

/// Whether the kit module file `name` (e.g. `virtio_blk.ko`) goes into a microVM's
/// initramfs.
fn microvm_module(name: &str) -> bool {
    !VM_ONLY_MODULES.contains(&name.trim_end_matches(".ko"))
}

/// `module` without its appended signature (`scripts/sign-file` format: the signature,
/// then a 12-byte `struct module_signature` whose last 4 bytes are the signature's length,
/// big-endian, then the marker `~Module signature appended~\n`); unchanged when unsigned or
/// malformed. The guest kernel then skips the check (SHA-256 + RSA under TCG, ~50 ms over a
/// microVM's modules) and taints itself `E`: Debian's kernel does not enforce signatures
/// (`CONFIG_MODULE_SIG_FORCE` is off, no lockdown), so the check gates nothing in the guest.
fn strip_module_signature(module: &[u8]) -> &[u8] {
    const MARKER: &[u8] = b"~Module signature appended~\n";
    let Some(body) = module.strip_suffix(MARKER) else {
        return module;
    };
    let Some(info) = body.len().checked_sub(12).map(|i| &body[i..]) else {
        return module;
    };
    let sig_len = u32::from_be_bytes([info[8], info[9], info[10], info[11]]) as usize;
    match body.len().checked_sub(12 + sig_len) {
        Some(end) => &module[..end],
        None => module,
    }
}

impl MicrovmBackend {
    /// A backend storing its files under `cfg.dir`, its QEMU cgroups under `cgroups`.
    ///
    /// # Errors
    /// `Unavailable` when QEMU, mkfs.erofs, mkfs.ext4, the guest kit or a static agent is
    /// missing; `Internal` when the directories or the initramfs cannot be written.
    pub fn new(mut cfg: MicrovmConfig, cgroups: CgroupRoot) -> NodeResult<Self> {
        let qemu = find_binary("qemu-system-x86_64").ok_or_else(|| {
            NodeError::Unavailable(
                "qemu-system-x86_64 is not installed (scripts/guest-kit.sh installs it)".into(),
            )
        })?;
        for tool in ["mkfs.erofs", "mkfs.ext4"] {
            if find_binary(tool).is_none() {
                return Err(NodeError::Unavailable(format!(
                    "{tool} is not installed (scripts/guest-kit.sh installs it)"
                )));
            }
        }
        let kernel = kit_kernel(&cfg.kit_dir);
        super::check_guest("microvm", &kernel, &mut cfg.agent_bin)?;
        // QEMU runs as an unprivileged uid per sandbox: it walks down to its own VM
        // directory (0710, group = its uid) and opens the shared read-only files by name
        // (0711 directories: nobody lists them). Failed consoles stay root's.
        super::prepare_backend_dir(&cfg.dir, &kernel, cfg.uids.group())?;
        super::ensure_dir_mode(&cfg.dir.join("templates"), 0o711)?;
        let agent = std::fs::read(&cfg.agent_bin)
            .map_err(|e| NodeError::io(format!("read {}", cfg.agent_bin.display()), e))?;
        let mut entries = super::initramfs_entries(agent);
        let mods = cfg.kit_dir.join("modules");
        if let Ok(order) = std::fs::read_to_string(mods.join("order")) {
            let mut ours = String::new();
            for m in order
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && microvm_module(l))
            {
                let data = std::fs::read(mods.join(m))
                    .map_err(|e| NodeError::io(format!("read kit module {m}"), e))?;
                let data = strip_module_signature(&data).to_vec();
                entries.push((format!("modules/{m}"), 0o644, Some(data)));
                ours.push_str(m);
                ours.push('\n');
            }
            entries.push(("modules/order".into(), 0o644, Some(ours.into_bytes())));
        }
        let initrd = cfg.dir.join("initramfs.cpio");
        super::write_initramfs(&initrd, &entries)?;
        let initramfs_hash = {
            let mut parts: Vec<&[u8]> = Vec::new();
            let modes: Vec<String> = entries.iter().map(|(_, m, _)| m.to_string()).collect();
            for ((path, _, data), mode) in entries.iter().zip(&modes) {
                parts.extend([
                    path.as_bytes(),
                    mode.as_bytes(),
                    data.as_deref().unwrap_or(b""),
                ]);
            }
            fnv(&parts)
        };
        let template_inputs = format!(
            "kernel {}\ninitramfs {initramfs_hash:016x}\nqemu {}\n",
            template::file_id(&kernel),
            template::file_id(&qemu)
        );
        let swept = template::sweep(
            &cfg.dir.join("templates"),
            &template_inputs,
            template::UNUSED_TTL,
            std::time::SystemTime::now(),
            true,
        );
        if !swept.is_empty() {
            tracing::info!(backend = "microvm", removed = ?swept, "stale template snapshots removed");
        }
        let mut core = QemuCore::new(Backend::Microvm, &cfg.dir, qemu, cgroups, &cfg.uids)?;
        core.store = cfg.snapshot_store.clone();
        core.net = cfg.net.clone();
        cfg.probe.start(&core.qemu, &cfg.kit_dir, &initrd);
        let disks = ImageDisks::new(
            "microvm",
            cfg.dir.join("images"),
            "erofs",
            cfg.images.clone(),
        );
        Ok(MicrovmBackend {
            cfg,
            core,
            disks,
            templates_enabled: template::enabled_from_env(),
            templates_building: Arc::new(Mutex::new(Default::default())),
            template_inputs,
        })
    }

    /// The accelerator, when decided (forced, or probed in the background since start).
    pub fn accel(&self) -> Option<Accel> {
        self.cfg.probe.get()
    }

    async fn resolve_accel(&self) -> Accel {
        self.cfg.probe.wait().await
    }

    /// Where the image's EROFS disk is (or will be): `images/<key>.erofs`.
    fn disk_path(&self, image: &Image) -> PathBuf {
        self.disks.path(&image.version())
    }

    /// The image's EROFS disk, made once, and the create's hold on it (kept until the
    /// sandbox's `boot.json` names it; see [`ImageDisks::image_disk`]).
    ///
    /// A lazy image whose lazy form has an EROFS disk: that disk, served by a FUSE daemon
    /// mounted at `images/lazy-<index hex>/` (mode 0755 root, `image.erofs` mode 0444;
    /// reached only through `images/`, root:QEMU group 0710, like the eager disks) and
    /// read chunk by chunk on demand ([`ImageStore::mount_lazy_disk`]). A lazy image
    /// without one is converted eagerly as any other image (which fetches every chunk).
    async fn image_disk(&self, image: &Image) -> NodeResult<(PathBuf, DiskHold)> {
        if let crate::images::ImageSource::Lazy { disk, .. } = &image.source {
            if disk.is_some() {
                let dir = self.cfg.dir.join("images");
                let out = (self.cfg.images)
                    .lazy_disk_path(image, &dir)?
                    .expect("a lazy image with a disk");
                let (images, img) = (self.cfg.images.clone(), image.clone());
                let make = move |_: &Path| images.mount_lazy_disk(&img, &dir).map(|_| ());
                let collect = || self.collect_disks(false);
                return (self.disks)
                    .image_disk(image, out, "lazy EROFS disk mounted", make, collect)
                    .await;
            }
            tracing::info!(
                image = %image.name,
                "lazy image without an EROFS disk (converted by an older Sandlot): converting it eagerly, which fetches every chunk"
            );
        }
        let layers = image.layers.clone();
        let make = move |out: &Path| make_erofs(&layers, out);
        let (out, collect) = (self.disk_path(image), || self.collect_disks(false));
        (self.disks)
            .image_disk(image, out, "image converted to EROFS", make, collect)
            .await
    }

    /// QEMU's command line for a VM whose files are in `dir` (`scratch.img`,
    /// `console.log`; its `agent.sock` and `qmp.sock` are inherited as fds) over the image
    /// disk `disk`.
    #[allow(clippy::too_many_arguments)]
    fn qemu_args(
        &self,
        accel: Accel,
        smp: u64,
        memory_mib: u64,
        append: &str,
        disk: &Path,
        dir: &Path,
    ) -> Vec<String> {
        // `rtc=on`: the CMOS RTC is the guest's wall clock at boot. `pit=off`: no i8254
        // timer, whose presence makes the kernel time its CPU clock against it at boot
        // (~50 ms under TCG); the TSC and the local APIC timer are the guest's clocks.
        let mut args = super::machine_args("microvm,rtc=on,pit=off", accel);
        args.extend(super::boot_args(
            smp,
            memory_mib,
            &kit_kernel(&self.cfg.kit_dir),
            &self.cfg.dir.join("initramfs.cpio"),
            append,
            &dir.join(CONSOLE_LOG),
        ));
        let p = |x: &Path| x.display().to_string();
        // `rerror=report` (QEMU's default, spelled out): a failed host read of the image
        // disk, e.g. a lazy disk's chunk the registry cannot serve, reaches the guest as an
        // I/O error of that request; the VM neither stops nor retries (`stop` would pause
        // it until a QMP `cont`).
        args.extend([
            "-drive".into(),
            format!(
                "id=image,file={},format=raw,if=none,readonly=on,rerror=report",
                p(disk)
            ),
            "-device".into(),
            "virtio-blk-device,drive=image,serial=image".into(),
            "-drive".into(),
            format!(
                "id=scratch,file={},format=raw,if=none",
                p(&dir.join("scratch.img"))
            ),
            "-device".into(),
            "virtio-blk-device,drive=scratch,serial=scratch".into(),
        ]);
        args.extend(super::control_args("virtio-serial-device"));
        args
    }
}

/// A sparse ext4 file of `mib` MiB at `s` (the guest's writable layer).
fn make_scratch(s: &Path, mib: u64) -> NodeResult<()> {
    let f = std::fs::File::create(s)
        .map_err(|e| NodeError::io(format!("create {}", s.display()), e))?;
    f.set_len(mib << 20)
        .map_err(|e| NodeError::io(format!("size {}", s.display()), e))?;
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-O", "^has_journal", "-E", "root_owner=0:0"])
        .arg(s)
        .output()
        .map_err(|e| NodeError::io("run mkfs.ext4", e))?;
    if !out.status.success() {
        return Err(NodeError::io(
            format!(
                "mkfs.ext4 {}: {}",
                s.display(),
                String::from_utf8_lossy(&out.stderr)
            ),
            std::io::Error::other("mkfs.ext4 failed"),
        ));
    }
    Ok(())
}

/// A fork's scratch disk: a sparse copy of the checkpoint's, grown to `mib` MiB.
///
/// # Errors
/// `InvalidArgument` when `mib` is below the checkpoint's disk; copy or resize failures.
async fn seed_scratch(ck: &Checkpoint, scratch: &Path, mib: u64) -> NodeResult<()> {
    if mib < ck.meta.disk_mib {
        return Err(NodeError::InvalidArgument(format!(
            "disk_mib {mib} is smaller than checkpoint {}'s disk ({} MiB)",
            ck.meta.id, ck.meta.disk_mib
        )));
    }
    let (src, dst) = (ck.disk(), scratch.to_path_buf());
    spawn_blocking(move || {
        crate::checkpoints::copy_disk(&src, &dst)?;
        crate::checkpoints::grow_ext4(&dst, mib)
    })
    .await
}

#[async_trait]
impl Machine for MicrovmBackend {
    fn core(&self) -> &QemuCore {
        &self.core
    }

    /// [`Machine::boot`] of a microVM.
    async fn boot(&self, b: Boot<'_>) -> NodeResult<Booted> {
        let Boot {
            spec,
            image,
            cg,
            seed,
        } = b;
        let t0 = Instant::now();
        let accel = self.resolve_accel().await;
        // Held until `boot.json` / `state.json` name the disk (see `collect_disks`).
        let (disk, _hold) = self.image_disk(image).await?;
        let dir = self.core.vm_dir(&spec.id);
        let scratch = dir.join("scratch.img");
        let mib = spec.disk_mib.max(16);
        let memory_mib = spec.memory_mib.max(128);
        let uid = self.cfg.uids.take(&spec.id)?;
        {
            let d = dir.clone();
            spawn_blocking(move || super::prepare_vm_dir(&d, uid)).await?;
        }
        super::create_vmm_cgroup(cg, memory_mib, spec.cpu, QEMU_PIDS)?;
        // An allow policy: the network namespace QEMU starts in, with its tap bridged to
        // the node's veth, before QEMU starts.
        let net = self.core.attach_net(spec, uid, &self.cfg.kit_dir).await?;
        let smp = (spec.cpu.ceil() as u64).clamp(1, 16);
        let sock = dir.join("agent.sock");
        // The guest agent puts every exec in a guest cgroup with this pids limit.
        // `cryptomgr.notests`: the kernel skips the self-tests of its crypto algorithms at
        // boot (they check the implementations against known answers, ~0.3 s under TCG; the
        // kernel is Debian's build, the same for every boot). See docs/backends.md for the
        // boot breakdown behind each choice.
        let mut append = format!(
            "console=ttyS0 panic=-1 quiet cryptomgr.notests initcall_blacklist={} sandlot.pids_max={}",
            SKIPPED_INITCALLS.join(","),
            spec.pids_max
        );
        // Debugging aid: e.g. `loglevel=5` shows the guest agent's messages on the console.
        if let Ok(extra) = std::env::var("SANDLOT_MICROVM_APPEND") {
            append.push(' ');
            append.push_str(&extra);
        }
        if accel == Accel::Tcg {
            // TCG's microvm has no PIT/HPET to calibrate the TSC against; without these
            // the kernel stops at "Marking TSC unstable". The guest's TSC is the host's
            // (TCG's `rdtsc` reads the host counter), so its rate is the host's: a fixed
            // guess (2 GHz) made the guest's clocks run 1.3x fast on a 2.6 GHz host.
            let (khz, invariant) =
                spawn_blocking(|| Ok((super::host_tsc_khz(), super::host_tsc_invariant()))).await?;
            append.push_str(&format!(" tsc_early_khz={khz} no_timer_check"));
            if invariant {
                // No clocksource watchdog on the TSC: its only reference here is jiffies,
                // which lose ticks whenever the vCPU thread waits for the host CPU, and the
                // guest would fall back to a 4 ms jiffies clock (docs/backends.md
                // "Accelerator").
                append.push_str(" tsc=reliable");
            }
            // Debian's kernel zeroes every kernel allocation (CONFIG_INIT_ON_ALLOC_DEFAULT_ON,
            // hardening against leaks of stale kernel memory to user space); under TCG that
            // costs ~50 ms of a boot. Everything in the guest is one sandbox's and its RAM
            // starts zeroed by QEMU, so a stale page holds nothing of anyone else; under KVM
            // the zeroing is cheap and stays on.
            append.push_str(" init_on_alloc=0");
            if smp == 1 {
                // A single vCPU under TCG: the kernel would rewrite every LOCK prefix of its
                // text for a uniprocessor, one `text_poke` (a page-table switch and TLB flush,
                // slow under TCG) per site, ~0.1 s of a boot; `noreplace-smp` keeps them.
                // (Not taken: `nolapic_timer`, which would skip the APIC timer's 100 ms
                // calibration, leaves microvm's guest without timer interrupts.)
                append.push_str(" noreplace-smp");
            }
        }
        if let Some((_, arg)) = &net {
            // No IPv6 at all in the guest: the host drops a sandbox's IPv6 anyway.
            append.push_str(&format!(" {} ipv6.disable=1", arg.to_arg()));
        }
        let mut args = self.qemu_args(accel, smp, memory_mib, &append, &disk, &dir);
        let netns = net.map(|(ns, _)| ns);
        if netns.is_some() {
            args.extend(super::net_args("virtio-net-device"));
        }
        let mut state = VmState {
            id: spec.id.clone(),
            image: image.name.clone(),
            image_env: image.env.clone(),
            image_version: Some(image.version()),
            accel,
            qemu_pid: 0,
            qemu_starttime: 0,
            spec: StoredSpec::from(spec),
            qemu_args: args.clone(),
            memory_saved: false,
            started_from: String::new(),
            qemu_uid: Some(uid),
            netns: netns.clone(),
        };
        let relay = Relay::new(sock.clone());
        let agent = AgentClient::with_connector(&sock, relay.connector());
        let started = Instant::now();
        let key = template::key(self, &dir, &args, &disk, mib);
        let mut from_template = false;
        // A fork boots on its checkpoint's disk, never from a template; a microVM with a
        // network neither (a template has no network device).
        let templates = self.templates_enabled && netns.is_none();
        if templates && seed.is_none() {
            match self
                .start_from_template(&key, &args, &dir, cg, &agent, &relay, &mut state)
                .await
            {
                Ok(true) => from_template = true,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(sandbox = %spec.id, backend = "microvm", error = %e, "template start failed; cold boot instead");
                    // Leaves the directory as a cold boot expects it.
                    let _ = std::fs::remove_file(&scratch);
                    let _ = std::fs::remove_file(dir.join("qemu.log"));
                    let d = dir.clone();
                    spawn_blocking(move || {
                        let _ = std::fs::remove_file(d.join(CONSOLE_LOG));
                        super::prepare_vm_dir(&d, uid)
                    })
                    .await?;
                }
            }
        }
        // Cold boots: QEMU started (after the directory, cgroup and scratch disk).
        let mut t_spawn = started;
        if !from_template {
            if let Some(ck) = seed {
                seed_scratch(ck, &scratch, mib).await?;
            } else {
                let s = scratch.clone();
                spawn_blocking(move || make_scratch(&s, mib)).await?;
            }
            super::give_file(&scratch, uid)?;
            let (pid, starttime) = spawn_qemu(
                &self.core.qemu,
                &args,
                &dir,
                cg,
                false,
                &self.core.jail(Some(uid), accel).in_netns(netns.as_deref()),
            )?;
            t_spawn = Instant::now();
            state.qemu_pid = pid;
            state.qemu_starttime = starttime;
            state.started_from = "cold".into();
            // Written before readiness so that a failed boot is cleaned up by pid too.
            write_json(&dir.join("boot.json"), &state)?;
            let timeouts = (READY_TIMEOUT_KVM, READY_TIMEOUT_TCG);
            self.core
                .wait_booted(&agent, &spec.id, accel, timeouts, (pid, starttime))
                .await?;
        }
        let t_ready = Instant::now();
        agent.set_identity(&super::fresh_identity(&spec.id)).await?;
        super::sync_clock(&agent, &spec.id, "microvm").await;
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
        let now = Instant::now();
        // Phases of a cold boot: `prep` (disk, directory, cgroup, scratch disk, QEMU
        // spawned), `boot` (QEMU to the agent's first answer), `identity` (the identity and
        // clock calls).
        tracing::info!(sandbox = %spec.id, backend = "microvm", accel = accel.as_str(), start = %state.started_from, ms = started.elapsed().as_millis() as u64,
            prep_ms = ms(t0, t_spawn), boot_ms = ms(t_spawn, t_ready), identity_ms = ms(t_ready, now), "microVM agent ready");
        write_json(&dir.join("state.json"), &state)?;
        if templates && !from_template {
            // `init_on_free=1` for the template's boot only: freed guest pages are zeroed,
            // and zero pages are not written to a saved state, so the template holds what
            // the guest uses, not the leftovers of initramfs unpacking and freed kernel init
            // memory (58 instead of 67 MiB here; every template start loads it). It costs a
            // clearing of all guest memory at boot (~0.25 s per 256 MiB under TCG), which a
            // cold boot does not pay. A template-started guest keeps the template's kernel
            // command line (its memory is the template's).
            let tpl_append = format!("{append} init_on_free=1");
            self.build_template_in_background(key, accel, smp, memory_mib, tpl_append, disk, mib);
        }
        Ok((state, (agent, relay)))
    }

    /// A checkpoint of microVM `id` (see [`crate::checkpoints`]): `sync` in the guest (its
    /// page cache reaches the scratch disk), then a sparse copy of `scratch.img` to
    /// `dest/disk.img` while QEMU's cgroup is frozen (no guest write lands mid-copy).
    async fn capture(&self, vm: Arc<QemuVm>, id: &str, dest: &Path) -> NodeResult<Captured> {
        self.core.sync_guest(&vm, id).await?;
        let scratch = self.core.vm_dir(id).join("scratch.img");
        let disk = dest.join("disk.img");
        crate::checkpoints::frozen_copy(
            id,
            dest,
            &vm.deleting,
            &vm.paused,
            vm.cgroup.group(),
            move || crate::checkpoints::copy_disk(&scratch, &disk),
        )
        .await?;
        Ok(Captured {
            backend: Backend::Microvm,
            image: vm.state.image.clone(),
            runtime: None,
            uid_base: None,
            disk_mib: vm.state.spec.disk_mib.max(16),
            image_version: vm.state.image_version.clone(),
        })
    }

    /// The shared store's copy of what another node needs besides the memory file: the
    /// scratch disk (`disk.img`, sparse), the image's EROFS disk (`DIR/images/<node>/`) and
    /// the manifest (QEMU's command line reading that copy).
    async fn publish(&self, vm: &QemuVm, dir: &Path) -> NodeResult<()> {
        let Some(store) = self.core.store.clone() else {
            return Ok(());
        };
        let id = vm.state.id.clone();
        let vm_dir = self.core.vm_dir(&id);
        let (d, backend_dir, kit_dir) = (
            dir.to_path_buf(),
            self.cfg.dir.clone(),
            self.cfg.kit_dir.clone(),
        );
        let mut state = vm.state.clone();
        state.memory_saved = true;
        spawn_blocking(move || {
            crate::checkpoints::copy_disk(&vm_dir.join("scratch.img"), &d.join(store::DISK))?;
            let images = backend_dir.join("images");
            for f in super::drive_files(&state.qemu_args.clone()) {
                if f.starts_with(&images) {
                    let copy = store.put_image(&f, &images)?;
                    state.qemu_args =
                        store::rebase_args(&state.qemu_args, &[(f.as_path(), copy.as_path())]);
                }
            }
            let m = store::Manifest::new(
                store.node(),
                "microvm",
                state,
                (backend_dir, kit_dir, vm_dir),
                Vec::new(),
            );
            store.finish(&d, &m)
        })
        .await
    }

    async fn node_accel(&self) -> Accel {
        self.resolve_accel().await
    }

    /// [`Machine::restore_claimed`] of a microVM: VM directory, uid, cgroup, a copy of its
    /// scratch disk, `state.json`, then the resume from `claimed/memory.state`.
    async fn restore_claimed(
        &self,
        id: &str,
        claimed: &Path,
        m: store::Manifest,
    ) -> NodeResult<()> {
        let dir = self.core.vm_dir(id);
        super::create_vm_dir(&dir, id)?;
        let uid = self.cfg.uids.take(id)?;
        {
            let d = dir.clone();
            spawn_blocking(move || super::prepare_vm_dir(&d, uid)).await?;
        }
        let cg = self.core.cgroups.sandbox(id);
        let memory_mib = m.state.spec.memory_mib.max(128);
        super::create_vmm_cgroup(&cg, memory_mib, m.state.spec.cpu, QEMU_PIDS)?;
        let scratch = dir.join("scratch.img");
        {
            let (src, dst) = (claimed.join(store::DISK), scratch.clone());
            spawn_blocking(move || crate::checkpoints::copy_disk(&src, &dst)).await?;
        }
        super::give_file(&scratch, uid)?;
        self.core
            .resume_claimed(claimed, m, uid, &self.cfg.dir, &self.cfg.kit_dir)
            .await
    }

    async fn remount_lazy_disk(&self, vm: &QemuVm) -> NodeResult<Option<DiskHold>> {
        let (images, dir) = (self.cfg.images.clone(), self.cfg.dir.join("images"));
        let args = vm.args.lock().unwrap().clone();
        let gone = spawn_blocking(move || {
            super::lazy_image_gone(&images, super::drive_files(&args), |i| {
                images.lazy_disk_path(i, &dir)
            })
        })
        .await?;
        match gone {
            Some(img) => Ok(Some(self.image_disk(&img).await?.1)),
            None => Ok(None),
        }
    }

    /// Removes the EROFS disks of images no longer in the store that no microVM uses
    /// (running or paused: the `-drive file=` of its QEMU arguments in `state.json` or
    /// `boot.json`) and no create in flight holds; with `partial`, also conversions cut
    /// short. Nothing is removed while a VM's state names no QEMU arguments (written by a
    /// node before pause with memory).
    fn collect_disks(&self, partial: bool) {
        let used = || {
            let mut used = HashSet::new();
            for e in std::fs::read_dir(self.cfg.dir.join("vms"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let state: Option<VmState> = ["state.json", "boot.json"].iter().find_map(|f| {
                    let s = std::fs::read(e.path().join(f)).ok()?;
                    serde_json::from_slice(&s).ok()
                });
                let Some(st) = state else { continue };
                if st.qemu_args.is_empty() {
                    return Err(format!("sandbox {}'s state names no QEMU arguments", st.id));
                }
                used.extend(super::drive_files(&st.qemu_args));
            }
            Ok(used)
        };
        self.disks.collect(|i| self.disk_path(i), used, partial);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_signature_is_stripped() {
        let mut signed = b"\x7fELF-module-body".to_vec();
        let body_len = signed.len();
        signed.extend_from_slice(b"SIGNATURE");
        // struct module_signature: algo, hash, id_type, signer_len, key_id_len, pad[3], sig_len (BE).
        signed.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 9]);
        signed.extend_from_slice(b"~Module signature appended~\n");
        assert_eq!(strip_module_signature(&signed), &signed[..body_len]);
        let plain = b"\x7fELF-unsigned".to_vec();
        assert_eq!(strip_module_signature(&plain), &plain[..]);
        // A marker with a length larger than the file: left as is.
        let mut bad = vec![0u8; 12];
        bad[11] = 200;
        bad.extend_from_slice(b"~Module signature appended~\n");
        assert_eq!(strip_module_signature(&bad), &bad[..]);
    }

    #[test]
    fn microvm_leaves_out_vm_only_modules() {
        assert!(microvm_module("virtio_blk.ko"));
        assert!(microvm_module("erofs.ko"));
        assert!(!microvm_module("virtio_pci.ko"));
        assert!(!microvm_module("virtio_pci_modern_dev.ko"));
        assert!(!microvm_module("virtio-rng.ko"));
    }

    #[test]
    fn accel_env_values() {
        assert_eq!(Accel::Kvm.as_str(), "kvm");
        assert_eq!(Accel::Tcg.as_str(), "tcg");
    }
}
