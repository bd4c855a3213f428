//! The `vm` backend: one QEMU `-M q35` virtual machine per sandbox (PCI virtio devices:
//! `virtio-blk-pci`, `virtio-serial-pci`, `virtio-rng-pci`), booting a whole disk image.
//!
//! Host layout (`DATA/vm/`):
//!
//! * `initramfs.cpio` — the same initramfs as the `microvm` backend's (the static
//!   `sandlot-guest` as `/init` plus the guest kit's modules: q35 needs `virtio_pci`, the
//!   Debian cloud kernel has it as a module, so the root disk cannot be found without it).
//! * `images/<key>.qcow2` — the image's disk, built once per image: the image's layers
//!   merged by a read-only overlay mount, written by `mkfs.ext4 -d` (no mount, no loop
//!   device) into a raw file sized for the content plus slack ([`make_ext4`]), then
//!   `qemu-img convert`ed to qcow2; read-only (mode 0444), shared as the backing file of
//!   every VM of that image. It holds nothing of Sandlot: the agent is the initramfs's
//!   `/init`, which stays pid 1 after switching to the disk. `<key>` hashes the image name,
//!   creation time and layer paths. Removed once no image in the store maps to it and no
//!   chain of a VM or checkpoint backs onto it (`collect_disks`).
//! * `images/lazy-<index hex>/image.ext4` — instead, for a lazy image whose lazy form has
//!   an ext4 disk (`sandlot image convert` makes it with [`make_ext4`], see
//!   `images::lazy::format`): that raw disk, served by a FUSE daemon that fetches its chunks
//!   on first read ([`ImageStore::mount_lazy_vm_disk`]), so a VM reads only the blocks its
//!   task touches; every VM's first layer backs onto it as a raw file. Why a disk made at
//!   conversion and not here: building one on the node reads every file of the image
//!   (every chunk fetched); a disk without the agent is the same for every node. A lazy
//!   image converted without one is converted eagerly (logged).
//! * `vms/<id>/` — one sandbox: `disk.qcow2` (`qemu-img create -f qcow2 -b <base> -F
//!   qcow2|raw`, virtual size = the base's + `disk_mib` MiB; the guest grows its ext4 to it
//!   online), after checkpoints or in a fork more qcow2 layers (`layer-<hex>.qcow2`, see
//!   `chain`), `agent.sock`, `qmp.sock`, `console.log`, `qemu.log`, `boot.json` /
//!   `state.json` — as for `microvm`, owners included (QEMU runs as the sandbox's
//!   unprivileged uid and owns only its active layer and `console.log`; frozen layers are
//!   root's, readable by the QEMUs' shared group: see `chain` and [`super`]).
//! * `failed/<id>.console.log` — the console of a VM that did not become ready (last 20).
//!
//! Boot: direct kernel boot (`-kernel` = the kit's kernel, `-initrd` = the initramfs,
//! `sandlot.root=disk` on the command line) after SeaBIOS, q35's default firmware; no boot
//! loader in the disk (under TCG a GRUB stage would add seconds to every boot for nothing:
//! the kernel is the node's anyway). The initramfs's `/init` loads the modules, mounts the
//! disk with virtio serial `root` read-write, makes it `/` and, still pid 1, grows the
//! disk's ext4 and serves the container agent protocol on the virtio-serial port
//! `org.sandlot.agent` (see `sandlot-guest`'s `vm` module). Disks built before this by
//! older nodes still hold `/.sandlot/sandlot-guest`; it is no longer run.
//!
//! Accelerator, jailing (own cgroup with limits, `-sandbox on`, own session, re-adoption
//! after a node restart), readiness deadline, failed-boot consoles, pause with memory
//! (the agent relay and the save/restore steps of `snapshot`; the `-drive` of the resume's
//! command line is brought up to the active disk layer at each pause) and delete are the
//! `microvm` backend's ([`super::microvm`], [`super`]). With a shared snapshot store a pause
//! also copies the VM's own layers and the image's base disk there, so that another node
//! resumes it ([`super::store`]: `publish`, `restore_claimed`, `chain::copy_out`/`copy_in`).
//!
//! Disk checkpoints and forks: live external qcow2 snapshots over QMP; a fork's disk is a
//! new layer on the checkpoint's chain, shared by hard links, not copied (`chain`).
mod chain;

use super::sandbox::{Boot, Booted, Machine, QemuCore, QemuVm};
use super::snapshot::Relay;
use super::state::{write_json, VmState};
use super::store;
use super::{find_binary, spawn_qemu, Accel};
use super::{fresh_identity, AccelProbe, DiskHold, ImageDisks, QemuUids, AGENT_SOCK, CONSOLE_LOG};
use crate::agent_client::AgentClient;
use crate::backends::saved::StoredSpec;
use crate::cgroups::CgroupRoot;
use crate::checkpoints::Captured;
use crate::images::disks::{make_ext4, run_tool};
use crate::images::{fnv, Image, ImageStore};
use crate::node::{NodeError, NodeResult};
use crate::sys::spawn_blocking;
use async_trait::async_trait;
use sandlot_api::Backend;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Boot → agent ready deadline under KVM.
const READY_TIMEOUT_KVM: Duration = Duration::from_secs(60);
/// Boot → agent ready deadline under TCG (firmware + PCI probing are slow there).
const READY_TIMEOUT_TCG: Duration = Duration::from_secs(180);
/// Tasks (threads) allowed to one QEMU: vCPUs, main loop, and the block layer's worker
/// pool (up to 64 threads per AioContext under heavy disk I/O, e.g. the guest's online
/// resize; at the limit QEMU aborts in `qemu_thread_create`).
const QEMU_PIDS: u64 = 160;
/// QEMU's option whose value names the root disk (rewritten at pause: see `pause`).
const DRIVE_FLAG: &str = "-drive";

/// Static configuration of the vm backend.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// `DATA/vm`.
    pub dir: PathBuf,
    /// The guest kit (`vmlinuz`, `modules/`), built by `scripts/guest-kit.sh`.
    pub kit_dir: PathBuf,
    /// The statically linked `sandlot-guest` (the initramfs's `/init`, the guest's pid 1
    /// and agent).
    pub agent_bin: PathBuf,
    /// The node's accelerator decision, shared with the `microvm` backend.
    pub probe: Arc<AccelProbe>,
    /// Host uids of the QEMUs (one per sandbox), shared with the `microvm` backend.
    pub uids: Arc<QemuUids>,
    /// The node's image store: which image disks a create may still ask for (collection of
    /// the others, [`super::collect_image_disks`]).
    pub images: ImageStore,
    /// `DATA/checkpoints`: a checkpoint's qcow2 chain keeps its image disk.
    pub checkpoints_dir: PathBuf,
    /// The node's network policies (shared with the other backends); `None`: allow
    /// policies are refused.
    pub net: Option<Arc<crate::net::NodeNet>>,
    /// The shared snapshot store pauses with memory write to (`--snapshot-dir`;
    /// [`super::store`]), so that another node can resume the VM; `None`: pauses stay on
    /// this node.
    pub snapshot_store: Option<super::store::SnapshotStore>,
}

/// The vm backend: q35 VMs by id.
pub struct VmBackend {
    cfg: VmConfig,
    /// Directory, QEMU, cgroups, uids and the table of VMs.
    core: QemuCore,
    qemu_img: PathBuf,
    /// Image disk builds (one at a time) and the disks creates in flight hold.
    disks: ImageDisks,
}

/// The `-drive` value of the root disk whose active layer is `DIR/<stem>.qcow2`; the node
/// name is the stem, so checkpoints find the active layer by it ([`chain`]).
fn drive_arg(dir: &Path, stem: &str) -> String {
    format!(
        "id=root,node-name={stem},file={},format=qcow2,if=none,discard=unmap",
        chain::layer_path(dir, stem).display()
    )
}

/// The stem of the active layer named by the root `-drive` of `args` (its `node-name`,
/// see [`drive_arg`]).
fn drive_stem(args: &[String]) -> Option<&str> {
    args.windows(2)
        .filter(|w| w[0] == DRIVE_FLAG && w[1].starts_with("id=root,"))
        .find_map(|w| w[1].split(',').find_map(|kv| kv.strip_prefix("node-name=")))
}

/// The virtual size in bytes of a qcow2 file (header field `size`, bytes 24..32, big
/// endian: QEMU's `docs/interop/qcow2.txt`).
fn qcow2_size(path: &Path) -> NodeResult<u64> {
    use std::io::Read;
    let mut hdr = [0u8; 32];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut hdr))
        .map_err(|e| NodeError::io(format!("read {}", path.display()), e))?;
    if &hdr[..4] != b"QFI\xfb" {
        return Err(NodeError::io(
            format!("{} is not a qcow2 file", path.display()),
            std::io::Error::other("bad magic"),
        ));
    }
    Ok(u64::from_be_bytes(hdr[24..32].try_into().expect("8 bytes")))
}

/// Builds the image's disk `out` (qcow2) from `layers` (top-most first): [`make_ext4`],
/// then `qemu-img convert`; everything in progress lives beside `out` with `.tmp` /
/// `.merge` suffixes and is removed on return.
fn make_disk(qemu_img: &Path, layers: &[PathBuf], out: &Path) -> NodeResult<()> {
    let raw = out.with_extension("raw.tmp");
    let tmp = out.with_extension("qcow2.tmp");
    let res = (|| -> NodeResult<()> {
        make_ext4(layers, &raw)?;
        run_tool(
            std::process::Command::new(qemu_img)
                .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
                .arg(&raw)
                .arg(&tmp),
            "qemu-img convert",
        )?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444))
                .map_err(|e| NodeError::io(format!("chmod {}", tmp.display()), e))?;
        }
        std::fs::rename(&tmp, out)
            .map_err(|e| NodeError::io(format!("rename {}", tmp.display()), e))
    })();
    let _ = std::fs::remove_file(&raw);
    let _ = std::fs::remove_file(&tmp);
    res
}

impl VmBackend {
    /// A backend storing its files under `cfg.dir`, its QEMU cgroups under `cgroups`.
    ///
    /// # Errors
    /// `Unavailable` when QEMU, qemu-img, mkfs.ext4, the guest kit or a static agent is
    /// missing; `Internal` when the directories or the initramfs cannot be written.
    pub fn new(mut cfg: VmConfig, cgroups: CgroupRoot) -> NodeResult<Self> {
        let missing = |tool: &str| {
            NodeError::Unavailable(format!(
                "{tool} is not installed (scripts/guest-kit.sh installs it)"
            ))
        };
        let qemu =
            find_binary("qemu-system-x86_64").ok_or_else(|| missing("qemu-system-x86_64"))?;
        let qemu_img = find_binary("qemu-img").ok_or_else(|| missing("qemu-img"))?;
        if find_binary("mkfs.ext4").is_none() {
            return Err(missing("mkfs.ext4"));
        }
        let kernel = cfg.kit_dir.join("vmlinuz");
        super::check_guest("vm", &kernel, &mut cfg.agent_bin)?;
        let order = std::fs::read_to_string(cfg.kit_dir.join("modules/order")).unwrap_or_default();
        if !order.lines().any(|l| l.trim() == "virtio_pci.ko") {
            return Err(NodeError::Unavailable(format!(
                "the guest kit in {} has no virtio_pci module (re-run scripts/guest-kit.sh)",
                cfg.kit_dir.display()
            )));
        }
        // Unprivileged QEMUs reach their VM directory and the shared read-only files only
        // (see `super::qemu`).
        super::prepare_backend_dir(&cfg.dir, &kernel, cfg.uids.group())?;
        let agent = std::fs::read(&cfg.agent_bin)
            .map_err(|e| NodeError::io(format!("read {}", cfg.agent_bin.display()), e))?;
        let mut entries = super::initramfs_entries(agent);
        let mods = cfg.kit_dir.join("modules");
        for m in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let data = std::fs::read(mods.join(m))
                .map_err(|e| NodeError::io(format!("read kit module {m}"), e))?;
            entries.push((format!("modules/{m}"), 0o644, Some(data)));
        }
        entries.push(("modules/order".into(), 0o644, Some(order.into_bytes())));
        let initrd = cfg.dir.join("initramfs.cpio");
        super::write_initramfs(&initrd, &entries)?;
        let mut core = QemuCore::new(Backend::Vm, &cfg.dir, qemu, cgroups, &cfg.uids)?;
        core.net = cfg.net.clone();
        core.store = cfg.snapshot_store.clone();
        cfg.probe.start(&core.qemu, &cfg.kit_dir, &initrd);
        let disks = ImageDisks::new("vm", cfg.dir.join("images"), "qcow2", cfg.images.clone());
        Ok(VmBackend {
            cfg,
            core,
            qemu_img,
            disks,
        })
    }

    /// Where the image's qcow2 base disk is (or will be): `images/<key>.qcow2`.
    fn disk_path(&self, image: &Image) -> PathBuf {
        // "ext4 v2": disks without the agent (v1 disks' keys hashed the agent binary).
        let mut parts: Vec<&[u8]> = vec![
            b"ext4 v2",
            image.name.as_bytes(),
            image.created_at.as_bytes(),
        ];
        parts.extend(
            image
                .layers
                .iter()
                .map(|l| l.as_os_str().as_encoded_bytes()),
        );
        self.disks.path(&format!("{:016x}", fnv(&parts)))
    }

    /// The image's base disk, its format for QEMU (`qcow2`, or `raw` for a lazy image's
    /// ext4 disk) and the create's hold on it (kept until the sandbox's first layer names
    /// it; see [`ImageDisks::image_disk`]).
    ///
    /// A lazy image whose lazy form has an ext4 disk: that disk, served by a FUSE daemon
    /// mounted at `images/lazy-<index hex>/` (mode 0755 root, `image.ext4` mode 0444;
    /// reached only through `images/`, root:QEMU group 0710, like the eager disks) and
    /// read chunk by chunk on demand ([`ImageStore::mount_lazy_vm_disk`]). A lazy image
    /// without one is converted eagerly as any other image (which fetches every chunk).
    async fn image_disk(&self, image: &Image) -> NodeResult<(PathBuf, DiskHold, &'static str)> {
        let dir = self.cfg.dir.join("images");
        if let Some(out) = self.cfg.images.lazy_vm_disk_path(image, &dir)? {
            let (images, img) = (self.cfg.images.clone(), image.clone());
            let make = move |_: &Path| images.mount_lazy_vm_disk(&img, &dir).map(|_| ());
            let collect = || self.collect_disks(false);
            let (p, hold) = (self.disks)
                .image_disk(image, out, "lazy ext4 disk mounted", make, collect)
                .await?;
            return Ok((p, hold, "raw"));
        }
        if matches!(image.source, crate::images::ImageSource::Lazy { .. }) {
            tracing::info!(
                image = %image.name,
                "lazy image without an ext4 disk (converted by an older Sandlot or without mkfs.ext4): building its vm disk eagerly, which fetches every chunk"
            );
        }
        let layers = image.layers.clone();
        let qemu_img = self.qemu_img.clone();
        let make = move |out: &Path| make_disk(&qemu_img, &layers, out);
        let (out, collect) = (self.disk_path(image), || self.collect_disks(false));
        let (p, hold) = (self.disks)
            .image_disk(image, out, "image disk built (qcow2)", make, collect)
            .await?;
        Ok((p, hold, "qcow2"))
    }

    /// The accelerator sandbox `id` runs with.
    pub fn accel_of(&self, id: &str) -> Option<Accel> {
        self.core.get(id).ok().map(|v| v.state.accel)
    }
}

#[async_trait]
impl Machine for VmBackend {
    fn core(&self) -> &QemuCore {
        &self.core
    }

    /// A checkpoint of VM `id` (see [`chain`]): `sync` in the guest (its page cache reaches
    /// the disk), then the active qcow2 layer is frozen under a new one (QMP
    /// `blockdev-snapshot`) and its chain linked into `dest`.
    async fn capture(&self, vm: Arc<QemuVm>, id: &str, dest: &Path) -> NodeResult<Captured> {
        let _life = vm.lifecycle.lock().await;
        self.core.sync_guest(&vm, id).await?;
        // No delete while the layers change.
        let guard = vm.deleting.read().await;
        if *guard {
            return Err(NodeError::NotFound(format!(
                "sandbox {id} is being deleted"
            )));
        }
        let (qemu_img, dir, dest) = (
            self.qemu_img.clone(),
            self.core.vm_dir(id),
            dest.to_path_buf(),
        );
        let owners = chain::Owners {
            qemu: vm.state.qemu_uid,
            group: self.cfg.uids.group(),
        };
        let started = Instant::now();
        spawn_blocking(move || chain::snapshot(&qemu_img, &dir, &dest, owners)).await?;
        drop(guard);
        tracing::info!(sandbox = %id, backend = "vm", ms = started.elapsed().as_millis() as u64, "disk layer frozen for a checkpoint");
        Ok(Captured {
            backend: Backend::Vm,
            image: vm.state.image.clone(),
            runtime: None,
            uid_base: None,
            disk_mib: vm.state.spec.disk_mib.max(16),
            // A fork reads the parent's own base disk (its layers' backing file).
            image_version: None,
        })
    }

    /// Checkpoints may have moved the disk to a newer layer: the restored QEMU must open
    /// the one QEMU writes to now.
    async fn before_pause(&self, vm: &QemuVm) -> NodeResult<()> {
        let dir = self.core.vm_dir(&vm.state.id);
        let d = dir.clone();
        let active = spawn_blocking(move || chain::active_layer(&d)).await?;
        let drive = drive_arg(&dir, &active);
        let mut args = vm.args.lock().unwrap();
        if let Some(i) = args.iter().position(|a| a == DRIVE_FLAG) {
            if let Some(v) = args.get_mut(i + 1) {
                *v = drive;
            }
        }
        Ok(())
    }

    /// [`Machine::boot`] of a q35 VM.
    async fn boot(&self, b: Boot<'_>) -> NodeResult<Booted> {
        let accel = self.cfg.probe.wait().await;
        let (spec, image, cg, seed) = (b.spec, b.image, b.cg, b.seed);
        let dir = self.core.vm_dir(&spec.id);
        let mib = spec.disk_mib.max(16);
        let active = if let Some(ck) = seed {
            // A fork: a new layer on the checkpoint's chain (its disk can only grow).
            if mib < ck.meta.disk_mib {
                return Err(NodeError::InvalidArgument(format!(
                    "disk_mib {mib} is smaller than checkpoint {}'s disk ({} MiB)",
                    ck.meta.id, ck.meta.disk_mib
                )));
            }
            // A lazy image's disk is a FUSE mount that may be gone (a host reboot, a
            // killed daemon) while checkpoints still name it: when the checkpoint backs
            // onto this image's disk and it is missing, mount it again (held until the
            // fork's layers name it). An eager base stays while a layer names it; a
            // checkpoint of an older build of the image keeps its own base.
            let d = ck.dir.clone();
            let base = spawn_blocking(move || chain::base_of(&d)).await?;
            let lazy = self
                .cfg
                .images
                .lazy_vm_disk_path(image, &self.cfg.dir.join("images"))?;
            let _hold = match (base, lazy) {
                (Some(b), Some(l)) if b == l && !super::disk_present(&b) => {
                    Some(self.image_disk(image).await?.1)
                }
                _ => None,
            };
            let (qemu_img, ck_dir, d) = (self.qemu_img.clone(), ck.dir.clone(), dir.clone());
            let grow = (mib - ck.meta.disk_mib) << 20;
            let group = self.cfg.uids.group();
            spawn_blocking(move || chain::seed_fork(&qemu_img, &ck_dir, &d, grow, group)).await?
        } else {
            // Held until the first layer (made next) names it (see `collect_disks`).
            let (base, _hold, format) = self.image_disk(image).await?;
            let (disk, qemu_img) = (chain::layer_path(&dir, chain::FIRST), self.qemu_img.clone());
            let extra = mib << 20;
            spawn_blocking(move || {
                let size = if format == "raw" {
                    std::fs::metadata(&base)
                        .map_err(|e| NodeError::io(format!("stat {}", base.display()), e))?
                        .len()
                } else {
                    qcow2_size(&base)?
                } + extra;
                run_tool(
                    std::process::Command::new(qemu_img)
                        .args(["create", "-q", "-f", "qcow2", "-F", format, "-b"])
                        .arg(&base)
                        .arg(&disk)
                        .arg(size.to_string()),
                    "qemu-img create",
                )
            })
            .await?;
            chain::FIRST.to_string()
        };
        // Its QEMU's uid: the VM directory (root:uid 0710) and the active layer (uid's,
        // 0600) are its; the layers below stay root's, readable by the QEMUs' group.
        let uid = self.cfg.uids.take(&spec.id)?;
        {
            let (d, disk) = (dir.clone(), chain::layer_path(&dir, &active));
            spawn_blocking(move || super::prepare_vm_files(&d, &[&disk], uid)).await?;
        }
        let memory_mib = spec.memory_mib.max(128);
        super::create_vmm_cgroup(cg, memory_mib, spec.cpu, QEMU_PIDS)?;
        // An allow policy: the network namespace QEMU starts in, with its tap bridged to
        // the node's veth, before QEMU starts.
        let net = self.core.attach_net(spec, uid, &self.cfg.kit_dir).await?;
        let smp = (spec.cpu.ceil() as u64).clamp(1, 16);
        let sock = dir.join(AGENT_SOCK);
        let mut append = format!(
            "console=ttyS0 panic=-1 quiet {} sandlot.pids_max={}",
            "sandlot.root=disk", spec.pids_max
        );
        if let Ok(extra) = std::env::var("SANDLOT_VM_APPEND") {
            append.push(' ');
            append.push_str(&extra);
        }
        if let Some((_, arg)) = &net {
            // No IPv6 at all in the guest: the host drops a sandbox's IPv6 anyway.
            append.push_str(&format!(" {} ipv6.disable=1", arg.to_arg()));
        }
        let netns = net.map(|(ns, _)| ns);
        let mut args = super::machine_args("q35", accel);
        args.extend(super::boot_args(
            smp,
            memory_mib,
            &self.cfg.kit_dir.join("vmlinuz"),
            &self.cfg.dir.join("initramfs.cpio"),
            &append,
            &dir.join(CONSOLE_LOG),
        ));
        args.extend([
            DRIVE_FLAG.into(),
            drive_arg(&dir, &active),
            "-device".into(),
            "virtio-blk-pci,drive=root,serial=root".into(),
            "-device".into(),
            "virtio-rng-pci".into(),
        ]);
        if netns.is_some() {
            args.extend(super::net_args("virtio-net-pci"));
        }
        args.extend(super::control_args("virtio-serial-pci"));
        let jail = self.core.jail(Some(uid), accel).in_netns(netns.as_deref());
        let (pid, starttime) = spawn_qemu(&self.core.qemu, &args, &dir, cg, false, &jail)?;
        let state = VmState {
            id: spec.id.clone(),
            image: image.name.clone(),
            image_env: image.env.clone(),
            image_version: Some(image.version()),
            accel,
            qemu_pid: pid,
            qemu_starttime: starttime,
            spec: StoredSpec::from(spec),
            // A resume restarts QEMU with these (the drive's layer brought up to date at
            // pause, see `pause`).
            qemu_args: args,
            memory_saved: false,
            started_from: "cold".into(),
            qemu_uid: Some(uid),
            netns,
        };
        // Written before readiness so that a failed boot is cleaned up by pid too.
        write_json(&dir.join("boot.json"), &state)?;
        let relay = Relay::new(sock.clone());
        let agent = AgentClient::with_connector(&sock, relay.connector());
        let started = Instant::now();
        let timeouts = (READY_TIMEOUT_KVM, READY_TIMEOUT_TCG);
        self.core
            .wait_booted(&agent, &spec.id, accel, timeouts, (pid, starttime))
            .await?;
        agent.set_identity(&fresh_identity(&spec.id)).await?;
        super::sync_clock(&agent, &spec.id, "vm").await;
        tracing::info!(sandbox = %spec.id, backend = "vm", accel = accel.as_str(), ms = started.elapsed().as_millis() as u64, "VM agent ready");
        write_json(&dir.join("state.json"), &state)?;
        Ok((state, (agent, relay)))
    }

    async fn remount_lazy_disk(&self, vm: &QemuVm) -> NodeResult<Option<DiskHold>> {
        let (images, dir) = (self.cfg.images.clone(), self.cfg.dir.join("images"));
        let vm_dir = self.core.vm_dir(&vm.state.id);
        let gone = spawn_blocking(move || {
            // The chain's bottom layer names the image's disk (absolute backing file).
            let bases = std::fs::read_dir(&vm_dir)
                .map_err(|e| NodeError::io(format!("read {}", vm_dir.display()), e))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "qcow2"))
                .filter_map(|layer| chain::backing_of(&layer).transpose())
                .collect::<NodeResult<Vec<String>>>()?;
            let bases = bases.into_iter().filter(|b| b.starts_with('/'));
            super::lazy_image_gone(&images, bases.map(PathBuf::from), |i| {
                images.lazy_vm_disk_path(i, &dir)
            })
        })
        .await?;
        match gone {
            Some(img) => Ok(Some(self.image_disk(&img).await?.1)),
            None => Ok(None),
        }
    }

    /// Removes the base disks of images no longer in the store (and those of older nodes,
    /// keyed with their agent binary) that no chain uses: the absolute backing file of any qcow2 layer in a VM's
    /// directory (running or paused) or a checkpoint's; with `partial`, also builds cut
    /// short. A layer whose header cannot be read stops the collection (logged).
    fn collect_disks(&self, partial: bool) {
        let used = || {
            let holders = [self.cfg.dir.join("vms"), self.cfg.checkpoints_dir.clone()];
            holders
                .iter()
                .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
                .flat_map(|h| std::fs::read_dir(h.path()).into_iter().flatten().flatten())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "qcow2"))
                .filter_map(|layer| match chain::backing_of(&layer) {
                    Ok(Some(b)) if b.starts_with('/') => Some(Ok(PathBuf::from(b))),
                    Ok(_) => None,
                    Err(e) => Some(Err(e.to_string())),
                })
                .collect()
        };
        self.disks.collect(|i| self.disk_path(i), used, partial);
    }

    /// The shared store's copy of what another node needs besides the memory file (see
    /// [`super::store`]): the VM's own qcow2 layers (sparse copies, the chain as
    /// [`Self::before_pause`] left it), the image's base disk (once per node and image, in
    /// `DIR/images/<node>/`) with the bottom layer pointed at that copy, and the manifest.
    async fn publish(&self, vm: &QemuVm, dir: &Path) -> NodeResult<()> {
        let Some(store) = self.core.store.clone() else {
            return Ok(());
        };
        let id = vm.state.id.clone();
        let vm_dir = self.core.vm_dir(&id);
        let (d, backend_dir, kit_dir, qemu_img) = (
            dir.to_path_buf(),
            self.cfg.dir.clone(),
            self.cfg.kit_dir.clone(),
            self.qemu_img.clone(),
        );
        // The command line the pause brought up to date (the active layer's `-drive`).
        let state = VmState {
            qemu_args: vm.args.lock().unwrap().clone(),
            memory_saved: true,
            ..vm.state.clone()
        };
        spawn_blocking(move || {
            let active = drive_stem(&state.qemu_args).ok_or_else(|| {
                NodeError::io(
                    format!("sandbox {id}: no root -drive with a node name"),
                    std::io::Error::other("unexpected QEMU arguments"),
                )
            })?;
            let (layers, base) = chain::copy_out(&vm_dir, active, &d)?;
            let images = backend_dir.join("images");
            if let Some(base) = base.filter(|b| b.starts_with(&images)) {
                let copy = store.put_image(&base, &images)?;
                chain::set_backing(&qemu_img, &d.join(&layers[layers.len() - 1]), &copy)?;
            }
            let m = store::Manifest::new(
                store.node(),
                "vm",
                state,
                (backend_dir, kit_dir, vm_dir),
                layers,
            );
            store.finish(&d, &m)
        })
        .await
    }

    async fn node_accel(&self) -> Accel {
        self.cfg.probe.wait().await
    }

    /// [`Machine::restore_claimed`] of a q35 VM: VM directory, uid, cgroup, copies of the
    /// snapshot's qcow2 layers (the bottom one backed by the store's image disk; the
    /// frozen ones root's and shared read-only, the active one the uid's), `state.json`,
    /// then the resume from `claimed/memory.state`.
    async fn restore_claimed(
        &self,
        id: &str,
        claimed: &Path,
        m: store::Manifest,
    ) -> NodeResult<()> {
        let dir = self.core.vm_dir(id);
        let want = drive_stem(&m.state.qemu_args).map(|s| format!("{s}.qcow2"));
        let active = match m.layers.first() {
            Some(a) if Some(a) == want.as_ref() => dir.join(a),
            _ => {
                return Err(NodeError::InvalidArgument(format!(
                    "the snapshot of {id} lists layers {:?} that its QEMU command line does not start from",
                    m.layers
                )))
            }
        };
        super::create_vm_dir(&dir, id)?;
        let uid = self.cfg.uids.take(id)?;
        {
            let (src, d, names, group) = (
                claimed.to_path_buf(),
                dir.clone(),
                m.layers.clone(),
                self.cfg.uids.group(),
            );
            spawn_blocking(move || {
                chain::copy_in(&src, &d, &names, group)?;
                super::prepare_vm_files(&d, &[&active], uid)
            })
            .await?;
        }
        let cg = self.core.cgroups.sandbox(id);
        let memory_mib = m.state.spec.memory_mib.max(128);
        super::create_vmm_cgroup(&cg, memory_mib, m.state.spec.cpu, QEMU_PIDS)?;
        self.core
            .resume_claimed(claimed, m, uid, &self.cfg.dir, &self.cfg.kit_dir)
            .await
    }
}

impl Drop for VmBackend {
    /// Removes the backend's parent cgroups if no VM is left in them (running VMs keep them
    /// busy, EBUSY, and stay for re-adoption).
    fn drop(&mut self) {
        let _ = self.core.cgroups.remove_parent();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qcow2_size_reads_the_header() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.qcow2");
        let mut hdr = vec![0u8; 64];
        hdr[..4].copy_from_slice(b"QFI\xfb");
        hdr[24..32].copy_from_slice(&(5u64 << 30).to_be_bytes());
        std::fs::write(&p, &hdr).unwrap();
        assert_eq!(qcow2_size(&p).unwrap(), 5 << 30);
        std::fs::write(&p, [0u8; 64]).unwrap();
        assert!(qcow2_size(&p).is_err());
    }

    /// `debugfs -R "cat PATH" raw`: the file's bytes inside the ext4 `raw`.
    fn ext4_cat(raw: &Path, path: &str) -> Vec<u8> {
        let out = std::process::Command::new("debugfs")
            .arg("-R")
            .arg(format!("cat {path}"))
            .arg(raw)
            .output()
            .unwrap();
        out.stdout
    }

    #[test]
    fn make_ext4_writes_the_merged_layers() {
        if find_binary("mkfs.ext4").is_none() || find_binary("debugfs").is_none() {
            eprintln!("skipped: no mkfs.ext4 or debugfs on this host");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let (upper, lower) = (d.path().join("upper"), d.path().join("lower"));
        for (dir, a, b) in [(&lower, "old", "kept"), (&upper, "new", "")] {
            std::fs::create_dir_all(dir.join("etc")).unwrap();
            std::fs::write(dir.join("etc/a"), a).unwrap();
            if !b.is_empty() {
                std::fs::write(dir.join("etc/b"), b).unwrap();
            }
        }
        // One layer: read as it is (no mount).
        let one = d.path().join("one.raw");
        make_ext4(std::slice::from_ref(&lower), &one).unwrap();
        let mut magic = [0u8; 2];
        {
            use std::io::{Read, Seek};
            let mut f = std::fs::File::open(&one).unwrap();
            f.seek(std::io::SeekFrom::Start(1080)).unwrap();
            f.read_exact(&mut magic).unwrap();
        }
        assert_eq!(u16::from_le_bytes(magic), 0xEF53, "ext4 superblock magic");
        assert_eq!(ext4_cat(&one, "/etc/a"), b"old");
        assert!(!one.with_extension("merge").exists());
        // Two layers: the overlay mount needs root.
        if !nix::unistd::geteuid().is_root() {
            eprintln!("two-layer part skipped: an overlay mount needs root");
            return;
        }
        let two = d.path().join("two.raw");
        make_ext4(&[upper, lower], &two).unwrap();
        assert_eq!(ext4_cat(&two, "/etc/a"), b"new");
        assert_eq!(ext4_cat(&two, "/etc/b"), b"kept");
        assert!(!two.with_extension("merge").exists());
    }

    #[test]
    fn tree_usage_counts_entries_and_blocks() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("a")).unwrap();
        std::fs::write(d.path().join("a/f"), [1u8; 5000]).unwrap();
        let (bytes, entries) = crate::images::disks::tree_usage(d.path());
        assert_eq!(entries, 2);
        assert!(bytes >= 8192 + 4096);
    }
}
