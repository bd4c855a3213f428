//! The `microvm` backend: one QEMU `-M microvm` virtual machine per sandbox, with its own
//! guest kernel (the Debian cloud kernel of the guest kit, see `scripts/guest-kit.sh`),
//! direct kernel boot, no PCI, no firmware beyond microvm's, no network device.
//!
//! Host layout (`DATA/microvm/`):
//!
//! * `initramfs.cpio` — built by the node at start (newc format): `/init` = the static
//!   `sandlot-guest` (pid 1 of the guest, see `sandlot-guest`'s `vm` module), the kit's
//!   modules and `/modules/order`.
//! * `images/<key>.erofs` — an image converted once by `mkfs.erofs` (the layers are merged
//!   through a read-only overlay mount first), shared read-only by every microVM of that
//!   image; `<key>` hashes the image name, creation time and layer paths.
//! * `vms/<id>/` — one sandbox: `scratch.img` (a sparse ext4 file of `disk_mib` MiB made
//!   with `mkfs.ext4`: the overlay's writable layer inside the guest), `agent.sock` (QEMU's
//!   unix socket server behind the guest's virtio-serial port `org.sandlot.agent`: the
//!   agent protocol of containers runs over it), `console.log` (the guest's serial
//!   console), `qemu.log` (QEMU's own messages), `state.json` (written once the agent
//!   answered: a directory without it is a half-created sandbox and is removed by
//!   `readopt`).
//! * `failed/<id>.console.log` — the console of a microVM that did not become ready (the
//!   last 20 are kept).
//!
//! Accelerator: KVM when `/dev/kvm` opens and a probe boot of the guest kernel reaches init
//! within [`PROBE_TIMEOUT`] (some hosts' nested KVM cannot boot a stock kernel), else TCG;
//! decided once per node process (in the background from node start, shared with the `vm`
//! backend: [`super::qemu::AccelProbe`]), logged, shown in node info and each sandbox's
//! info; `SANDLOT_VM_ACCEL=kvm|tcg` (or the older `SANDLOT_MICROVM_ACCEL`) forces it.
//!
//! Jailing: every QEMU runs in its own cgroup (memory = the guest's plus
//! [`QEMU_OVERHEAD_MIB`], the sandbox's CPU quota, [`QEMU_PIDS`] tasks) with `-sandbox on`
//! (QEMU's seccomp filter: no spawning, no privilege changes, no obsolete calls, no
//! resource control calls) and in a session of its own, so it outlives a node restart and
//! is re-adopted.
use super::function::{
    check_id, check_not_paused, freeze, proc_starttime, spawn_blocking, thaw, ExecPlan, StoredSpec,
};
use super::SandboxBackend;
use crate::agent_client::AgentClient;
use crate::cgroups::{CgroupRoot, Limits, SandboxCgroup};
use crate::checkpoints::{Captured, Checkpoint};
use crate::files::{file_entry, node_error};
use crate::images::Image;
use crate::node::{ExecControl, ExecSink, NodeError, NodeResult, SandboxSpec, SandboxStatus};
use async_trait::async_trait;
use sandlot_api::{Backend, ExecRequest, ExecResult, FileEntry};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, RwLock};

/// How long a KVM probe boot may take to reach init before the node falls back to TCG.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Boot → agent ready deadline under KVM.
const READY_TIMEOUT_KVM: Duration = Duration::from_secs(30);
/// Boot → agent ready deadline under TCG (slow, and slower on a loaded host).
const READY_TIMEOUT_TCG: Duration = Duration::from_secs(120);
/// Host memory allowed to QEMU on top of the guest's RAM (device emulation, TCG's
/// translation cache of `tb-size=64` MiB).
pub const QEMU_OVERHEAD_MIB: u64 = 192;
/// Tasks (threads) allowed to one QEMU.
pub const QEMU_PIDS: u64 = 64;
/// Failed-boot console logs kept.
const FAILED_KEPT: usize = 20;
/// Name of the guest's agent port.
const AGENT_PORT: &str = "org.sandlot.agent";
/// Marker a probe boot prints (see `sandlot-guest`'s `vm::PROBE_MARK`).
const PROBE_MARK: &str = "SANDLOT-PROBE-OK";

/// The accelerator QEMU runs guests with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation through `/dev/kvm`.
    Kvm,
    /// QEMU's binary translator (slow, needs no host support).
    Tcg,
}

impl Accel {
    /// `"kvm"` or `"tcg"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Static configuration of the microvm backend.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// `DATA/microvm`.
    pub dir: PathBuf,
    /// The guest kit (`vmlinuz`, `modules/`), built by `scripts/guest-kit.sh`.
    pub kit_dir: PathBuf,
    /// The statically linked `sandlot-guest` (the guest's `/init`).
    pub agent_bin: PathBuf,
    /// The node's accelerator decision (forced or probed), shared with the `vm` backend.
    pub probe: Arc<super::qemu::AccelProbe>,
}

/// On-disk state of a running microVM: `vms/<id>/state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmState {
    /// Sandbox id.
    pub id: String,
    /// Image name.
    pub image: String,
    /// Environment of the image (applied before the sandbox's).
    pub image_env: Vec<(String, String)>,
    /// Accelerator it runs with.
    pub accel: Accel,
    /// Host pid of its QEMU.
    pub qemu_pid: i32,
    /// Its start time (field 22 of `/proc/PID/stat`).
    pub qemu_starttime: u64,
    /// Limits and environment.
    pub spec: StoredSpec,
}

struct Vm {
    state: VmState,
    cgroup: SandboxCgroup,
    agent: AgentClient,
    deleting: RwLock<bool>,
    killed: watch::Sender<bool>,
    paused: AtomicBool,
}

/// The microvm backend: microVMs by id.
pub struct MicrovmBackend {
    cfg: MicrovmConfig,
    qemu: PathBuf,
    cgroups: CgroupRoot,
    /// Serialises image conversions (one `mkfs.erofs` at a time).
    convert: tokio::sync::Mutex<()>,
    vms: Mutex<HashMap<String, Arc<Vm>>>,
}

pub(crate) fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain([
            "/usr/local/sbin",
            "/usr/local/bin",
            "/usr/sbin",
            "/usr/bin",
            "/sbin",
        ])
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found
}

/// Writes a newc cpio archive: `(path in archive, mode, contents)`; directories have
/// `None` contents; `dev/console` is added as a character device (5, 1).
pub(crate) fn write_cpio(
    out: &Path,
    entries: &[(String, u32, Option<Vec<u8>>)],
) -> std::io::Result<()> {
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

pub(crate) fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter().chain(&[0u8]) {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

pub(crate) fn tail_of(path: &Path, n: usize) -> String {
    let s = std::fs::read(path).unwrap_or_default();
    let s = String::from_utf8_lossy(&s[s.len().saturating_sub(n)..]).into_owned();
    s.trim().to_string()
}

impl MicrovmBackend {
    /// One exec through the VM's agent ([`super::agent_exec`]). The guest kernel's OOM
    /// killer is invisible from the host, so `oom_killed` stays false here.
    async fn run_exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: Option<ExecControl>,
    ) -> NodeResult<ExecResult> {
        let vm = self.get(id)?;
        let mut killed = vm.killed.subscribe();
        let guard = vm.deleting.read().await;
        if *guard || *killed.borrow() {
            return Err(NodeError::NotFound(format!(
                "sandbox {id} is being deleted"
            )));
        }
        check_not_paused(&vm.paused, id)?;
        let mut plan = ExecPlan::build(&vm.state.image_env, &vm.state.spec, req)?;
        plan.spec.own_pid_ns = true;
        plan.spec.landlock = false;
        let (pid, start) = (vm.state.qemu_pid, vm.state.qemu_starttime);
        let died = move || proc_starttime(pid) != Some(start);
        let target = super::agent_exec::Target {
            id,
            kind: "microVM",
            agent: &vm.agent,
            pids_max: vm.state.spec.pids_max,
            died: &died,
        };
        super::agent_exec::run(target, plan, guard, &mut killed, sink, control).await
    }

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
        let kernel = cfg.kit_dir.join("vmlinuz");
        if !kernel.is_file() {
            return Err(NodeError::Unavailable(format!(
                "no guest kernel at {} (run scripts/guest-kit.sh, or set SANDLOT_GUEST_KIT_DIR)",
                kernel.display()
            )));
        }
        if let Ok(abs) = std::fs::canonicalize(&cfg.agent_bin) {
            cfg.agent_bin = abs;
        }
        if !super::container::is_static_elf(&cfg.agent_bin) {
            return Err(NodeError::Unavailable(format!(
                "the microvm backend needs a statically linked sandlot-guest as the guest's init; {} is missing or dynamic",
                cfg.agent_bin.display()
            )));
        }
        for d in ["vms", "images", "failed"] {
            let p = cfg.dir.join(d);
            std::fs::create_dir_all(&p)
                .map_err(|e| NodeError::io(format!("create {}", p.display()), e))?;
        }
        let mut entries: Vec<(String, u32, Option<Vec<u8>>)> = vec![
            ("dev".into(), 0o755, None),
            ("proc".into(), 0o555, None),
            ("sys".into(), 0o555, None),
            ("mnt".into(), 0o755, None),
            ("modules".into(), 0o755, None),
        ];
        let agent = std::fs::read(&cfg.agent_bin)
            .map_err(|e| NodeError::io(format!("read {}", cfg.agent_bin.display()), e))?;
        entries.push(("init".into(), 0o755, Some(agent)));
        let mods = cfg.kit_dir.join("modules");
        if let Ok(order) = std::fs::read_to_string(mods.join("order")) {
            for m in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
                let data = std::fs::read(mods.join(m))
                    .map_err(|e| NodeError::io(format!("read kit module {m}"), e))?;
                entries.push((format!("modules/{m}"), 0o644, Some(data)));
            }
            entries.push(("modules/order".into(), 0o644, Some(order.into_bytes())));
        }
        let initrd = cfg.dir.join("initramfs.cpio");
        write_cpio(&initrd, &entries)
            .map_err(|e| NodeError::io(format!("write {}", initrd.display()), e))?;
        cgroups.ensure_parent()?;
        cfg.probe.start(&qemu, &cfg.kit_dir, &initrd);
        Ok(MicrovmBackend {
            cfg,
            qemu,
            cgroups,
            convert: tokio::sync::Mutex::new(()),
            vms: Mutex::new(HashMap::new()),
        })
    }

    /// The accelerator, when decided (forced, or probed in the background since start).
    pub fn accel(&self) -> Option<Accel> {
        self.cfg.probe.get()
    }

    async fn resolve_accel(&self) -> Accel {
        self.cfg.probe.wait().await
    }

    fn vm_dir(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("vms").join(id)
    }

    fn get(&self, id: &str) -> NodeResult<Arc<Vm>> {
        self.vms
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("sandbox {id} not found")))
    }

    /// The image's EROFS disk, made once.
    async fn image_disk(&self, image: &Image) -> NodeResult<PathBuf> {
        let layers: Vec<&[u8]> = image
            .layers
            .iter()
            .map(|l| l.as_os_str().as_encoded_bytes())
            .collect();
        let mut parts: Vec<&[u8]> = vec![image.name.as_bytes(), image.created_at.as_bytes()];
        parts.extend(layers);
        let key = format!("{:016x}", fnv(&parts));
        let out = self.cfg.dir.join("images").join(format!("{key}.erofs"));
        if out.is_file() {
            return Ok(out);
        }
        let _g = self.convert.lock().await;
        if out.is_file() {
            return Ok(out);
        }
        let layers = image.layers.clone();
        let o = out.clone();
        let started = Instant::now();
        spawn_blocking(move || make_erofs(&layers, &o)).await?;
        tracing::info!(backend = "microvm", image = %image.name, ms = started.elapsed().as_millis() as u64, "image converted to EROFS");
        Ok(out)
    }

    async fn create_inner(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        cg: &SandboxCgroup,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<(VmState, AgentClient)> {
        let accel = self.resolve_accel().await;
        let disk = self.image_disk(image).await?;
        let dir = self.vm_dir(&spec.id);
        let scratch = dir.join("scratch.img");
        let mib = spec.disk_mib.max(16);
        if let Some(ck) = seed {
            seed_scratch(ck, &scratch, mib).await?;
        } else {
            let s = scratch.clone();
            spawn_blocking(move || {
                let f = std::fs::File::create(&s)
                    .map_err(|e| NodeError::io(format!("create {}", s.display()), e))?;
                f.set_len(mib << 20)
                    .map_err(|e| NodeError::io(format!("size {}", s.display()), e))?;
                let out = std::process::Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-O", "^has_journal", "-E", "root_owner=0:0"])
                    .arg(&s)
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
            })
            .await?;
        }
        let memory_mib = spec.memory_mib.max(128);
        cg.create(&Limits {
            memory_bytes: (memory_mib + QEMU_OVERHEAD_MIB) << 20,
            cpu: spec.cpu,
            pids_max: QEMU_PIDS,
        })?;
        let smp = (spec.cpu.ceil() as u64).clamp(1, 16);
        let sock = dir.join("agent.sock");
        // The guest agent puts every exec in a guest cgroup with this pids limit.
        let mut append = format!(
            "console=ttyS0 panic=-1 quiet sandlot.pids_max={} sandlot.hostname={}",
            spec.pids_max, spec.id
        );
        // Debugging aid: e.g. `loglevel=5` shows the guest agent's messages on the console.
        if let Ok(extra) = std::env::var("SANDLOT_MICROVM_APPEND") {
            append.push(' ');
            append.push_str(&extra);
        }
        let mut cmd = std::process::Command::new(&self.qemu);
        cmd.args([
            "-M",
            "microvm,rtc=on",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ]);
        match accel {
            Accel::Kvm => {
                cmd.args(["-accel", "kvm", "-cpu", "host"]);
            }
            Accel::Tcg => {
                cmd.args(["-accel", "tcg,thread=multi,tb-size=64", "-cpu", "max"]);
                // TCG's microvm has no PIT/HPET to calibrate the TSC against; without these
                // the kernel stops at "Marking TSC unstable".
                append.push_str(" tsc_early_khz=2000000 no_timer_check");
            }
        }
        cmd.arg("-smp")
            .arg(smp.to_string())
            .arg("-m")
            .arg(format!("{memory_mib}M"))
            .arg("-kernel")
            .arg(self.cfg.kit_dir.join("vmlinuz"))
            .arg("-initrd")
            .arg(self.cfg.dir.join("initramfs.cpio"))
            .arg("-append")
            .arg(&append)
            .arg("-serial")
            .arg(format!("file:{}", dir.join("console.log").display()))
            .arg("-drive")
            .arg(format!(
                "id=image,file={},format=raw,if=none,readonly=on",
                disk.display()
            ))
            .args(["-device", "virtio-blk-device,drive=image,serial=image"])
            .arg("-drive")
            .arg(format!(
                "id=scratch,file={},format=raw,if=none",
                scratch.display()
            ))
            .args(["-device", "virtio-blk-device,drive=scratch,serial=scratch"])
            .args(["-device", "virtio-serial-device"])
            .arg("-chardev")
            .arg(format!(
                "socket,id=agent,path={},server=on,wait=off",
                sock.display()
            ))
            .arg("-device")
            .arg(format!("virtserialport,chardev=agent,name={AGENT_PORT}"))
            .args([
                "-sandbox",
                "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            ]);
        let log = std::fs::File::create(dir.join("qemu.log"))
            .map_err(|e| NodeError::io("create qemu.log", e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| NodeError::io("dup qemu.log", e))?;
        cmd.stdin(Stdio::null()).stdout(log).stderr(log2);
        let procs: Vec<std::ffi::CString> = cg
            .group()
            .procs_files()
            .into_iter()
            .filter_map(|p| std::ffi::CString::new(p.into_os_string().into_encoded_bytes()).ok())
            .collect();
        // SAFETY: after fork, before exec: only async-signal-safe calls (setsid, getpid,
        // open, write, close) on data prepared before the fork.
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
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| NodeError::io(format!("start {}", self.qemu.display()), e))?;
        let pid = child.id() as i32;
        // QEMU is our child until this process ends: reap it when it exits.
        std::thread::spawn(move || {
            let _ = child.wait();
        });
        let starttime = proc_starttime(pid).unwrap_or(0);
        let state = VmState {
            id: spec.id.clone(),
            image: image.name.clone(),
            image_env: image.env.clone(),
            accel,
            qemu_pid: pid,
            qemu_starttime: starttime,
            spec: StoredSpec {
                cpu: spec.cpu,
                memory_mib: spec.memory_mib,
                disk_mib: spec.disk_mib,
                pids_max: spec.pids_max,
                env: spec.env.clone(),
            },
        };
        // Written before readiness so that a failed boot is cleaned up by pid too.
        write_json(&dir.join("boot.json"), &state)?;
        let agent = AgentClient::new(&sock);
        let timeout = match accel {
            Accel::Kvm => READY_TIMEOUT_KVM,
            Accel::Tcg => READY_TIMEOUT_TCG,
        };
        let started = Instant::now();
        let ready = agent.wait_ready_single(Instant::now() + timeout).await;
        if let Err(e) = ready {
            let console = dir.join("console.log");
            let keep = self
                .cfg
                .dir
                .join("failed")
                .join(format!("{}.console.log", spec.id));
            let _ = std::fs::copy(&console, &keep);
            prune_failed(&self.cfg.dir.join("failed"));
            let alive = proc_starttime(pid) == Some(starttime);
            return Err(NodeError::io(
                format!(
                    "microVM {} did not become ready within {}s ({}; QEMU {}; {}): console kept at {}; QEMU said: {}; console tail: {}",
                    spec.id,
                    timeout.as_secs(),
                    accel.as_str(),
                    if alive { "still running" } else { "exited" },
                    e,
                    keep.display(),
                    tail_of(&dir.join("qemu.log"), 400),
                    tail_of(&console, 800)
                ),
                std::io::Error::other("boot failed"),
            ));
        }
        tracing::info!(sandbox = %spec.id, backend = "microvm", accel = accel.as_str(), ms = started.elapsed().as_millis() as u64, "microVM agent ready");
        write_json(&dir.join("state.json"), &state)?;
        Ok((state, agent))
    }

    /// Registers a running microVM; `agent`: the connected client of its create (a new one
    /// would be a second connection on the guest's one stream).
    /// Create `spec`, its scratch disk copied from `seed` when given (a fork).
    async fn create_with(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<()> {
        check_id(&spec.id)?;
        let dir = self.vm_dir(&spec.id);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(NodeError::Conflict(format!(
                    "sandbox {} already exists",
                    spec.id
                )))
            }
            Err(e) => return Err(NodeError::io(format!("create {}", dir.display()), e)),
        }
        let cg = self.cgroups.sandbox(&spec.id);
        match self.create_inner(spec, image, &cg, seed).await {
            Ok((state, agent)) => {
                self.adopt(state, Some(agent));
                tracing::info!(sandbox = %spec.id, backend = "microvm", "sandbox created");
                Ok(())
            }
            Err(e) => {
                if let Err(c) = self.destroy(&spec.id).await {
                    tracing::warn!(sandbox = %spec.id, error = %c, "cleanup after a failed create");
                }
                Err(e)
            }
        }
    }

    /// A checkpoint of microVM `id` (see [`crate::checkpoints`]): `sync` in the guest (its
    /// page cache reaches the scratch disk), then a sparse copy of `scratch.img` to
    /// `dest/disk.img` while QEMU's cgroup is frozen (no guest write lands mid-copy).
    async fn checkpoint_scratch(&self, id: &str, dest: &Path) -> NodeResult<Captured> {
        let vm = self.get(id)?;
        if vm.paused.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is paused; resume it before a checkpoint (the guest must flush its disk first)"
            )));
        }
        let mut req = ExecRequest::new(sandlot_api::Cmd::Argv(vec!["sync".into()]));
        req.timeout_s = Some(60.0);
        let r = self.run_exec(id, &req, None, None).await?;
        if r.exit_code != 0 {
            return Err(NodeError::io(
                format!("sync in microVM {id}: exit {}: {}", r.exit_code, r.stderr),
                std::io::Error::other("guest sync failed"),
            ));
        }
        let scratch = self.vm_dir(id).join("scratch.img");
        let disk = dest.join("disk.img");
        crate::checkpoints::frozen_copy(
            id,
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
        })
    }

    fn adopt(&self, state: VmState, agent: Option<AgentClient>) -> Arc<Vm> {
        let vm = Arc::new(Vm {
            cgroup: self.cgroups.sandbox(&state.id),
            agent: agent
                .unwrap_or_else(|| AgentClient::new(self.vm_dir(&state.id).join("agent.sock"))),
            deleting: RwLock::new(false),
            killed: watch::channel(false).0,
            paused: AtomicBool::new(false),
            state,
        });
        self.vms
            .lock()
            .unwrap()
            .insert(vm.state.id.clone(), vm.clone());
        vm
    }

    /// The microVM of a file call: known, not being deleted, not paused, QEMU alive.
    async fn fs_target(&self, id: &str) -> NodeResult<Arc<Vm>> {
        let vm = self.get(id)?;
        if *vm.deleting.read().await {
            return Err(NodeError::NotFound(format!(
                "sandbox {id} is being deleted"
            )));
        }
        check_not_paused(&vm.paused, id)?;
        if proc_starttime(vm.state.qemu_pid) != Some(vm.state.qemu_starttime) {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is not running (its QEMU {} is gone)",
                vm.state.qemu_pid
            )));
        }
        Ok(vm)
    }

    /// Kills the QEMU of `id` (from `state.json` or `boot.json`), removes its cgroup and
    /// directory.
    async fn destroy(&self, id: &str) -> NodeResult<()> {
        let dir = self.vm_dir(id);
        let cg = self.cgroups.sandbox(id);
        spawn_blocking(move || {
            let st: Option<VmState> = ["state.json", "boot.json"].iter().find_map(|f| {
                std::fs::read(dir.join(f))
                    .ok()
                    .and_then(|s| serde_json::from_slice(&s).ok())
            });
            if let Some(st) = st {
                if proc_starttime(st.qemu_pid) == Some(st.qemu_starttime) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(st.qemu_pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while proc_starttime(st.qemu_pid) == Some(st.qemu_starttime)
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            // Kills anything left in the group (a QEMU whose state file was lost) too.
            cg.group().destroy(Duration::from_secs(10))?;
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(NodeError::io(format!("remove {}", dir.display()), e)),
            }
        })
        .await
    }
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

pub(crate) fn write_json(path: &Path, st: &VmState) -> NodeResult<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(st).expect("VmState serialises"),
    )
    .and_then(|_| std::fs::rename(&tmp, path))
    .map_err(|e| NodeError::io(format!("write {}", path.display()), e))
}

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

/// `mkfs.erofs` of the image's merged layers into `out` (via a temp file).
fn make_erofs(layers: &[PathBuf], out: &Path) -> NodeResult<()> {
    let tmp = out.with_extension("erofs.tmp");
    let merged_dir = out.with_extension("merge");
    let src = if layers.len() == 1 {
        layers[0].clone()
    } else {
        std::fs::create_dir_all(&merged_dir)
            .map_err(|e| NodeError::io(format!("create {}", merged_dir.display()), e))?;
        let lower = layers
            .iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        nix::mount::mount(
            Some("overlay"),
            &merged_dir,
            Some("overlay"),
            nix::mount::MsFlags::MS_RDONLY,
            Some(format!("lowerdir={lower}").as_str()),
        )
        .map_err(|e| {
            NodeError::io(
                format!("overlay mount of {} layers", layers.len()),
                e.into(),
            )
        })?;
        merged_dir.clone()
    };
    let res = std::process::Command::new("mkfs.erofs")
        .arg("--quiet")
        .arg(&tmp)
        .arg(&src)
        .output();
    if layers.len() != 1 {
        let _ = nix::mount::umount2(&merged_dir, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&merged_dir);
    }
    let out_ = res.map_err(|e| NodeError::io("run mkfs.erofs", e))?;
    if !out_.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(NodeError::io(
            format!(
                "mkfs.erofs {}: {}",
                src.display(),
                String::from_utf8_lossy(&out_.stderr)
            ),
            std::io::Error::other("mkfs.erofs failed"),
        ));
    }
    std::fs::rename(&tmp, out).map_err(|e| NodeError::io(format!("rename {}", tmp.display()), e))
}

/// Boots the guest kernel under KVM with `sandlot.probe`; KVM when the probe mark appears
/// within [`PROBE_TIMEOUT`], else TCG. Returns the choice and why.
pub(crate) fn probe_kvm(qemu: &Path, kit: &Path, initrd: &Path) -> (Accel, String) {
    use std::io::Read;
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return (Accel::Tcg, format!("/dev/kvm: {e}"));
    }
    let child = std::process::Command::new(qemu)
        .args([
            "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256M", "-smp", "1",
        ])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(kit.join("vmlinuz"))
        .arg("-initrd")
        .arg(initrd)
        .args([
            "-append",
            "console=ttyS0 panic=-1 quiet sandlot.probe",
            "-serial",
            "stdio",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return (Accel::Tcg, format!("probe: start QEMU: {e}")),
    };
    let mut out = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&all).contains(PROBE_MARK) {
                let _ = tx.send(true);
                return;
            }
        }
        let _ = tx.send(false);
    });
    let started = Instant::now();
    let ok = rx.recv_timeout(PROBE_TIMEOUT).unwrap_or(false);
    let _ = child.kill();
    let _ = child.wait();
    if ok {
        (
            Accel::Kvm,
            format!(
                "probe boot reached init in {} ms",
                started.elapsed().as_millis()
            ),
        )
    } else {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        (
            Accel::Tcg,
            format!(
                "a KVM probe boot of the guest kernel did not reach init within {}s (nested or paravirtual KVM?){}",
                PROBE_TIMEOUT.as_secs(),
                if err.trim().is_empty() { String::new() } else { format!(": {}", err.trim()) }
            ),
        )
    }
}

#[async_trait]
impl SandboxBackend for MicrovmBackend {
    fn kind(&self) -> Backend {
        Backend::Microvm
    }

    async fn create(&self, spec: &SandboxSpec, image: &Image) -> NodeResult<()> {
        self.create_with(spec, image, None).await
    }

    async fn create_from(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        checkpoint: &Checkpoint,
    ) -> NodeResult<()> {
        self.create_with(spec, image, Some(checkpoint)).await
    }

    async fn checkpoint(&self, id: &str, dest: &Path) -> NodeResult<Captured> {
        self.checkpoint_scratch(id, dest).await
    }

    fn has(&self, id: &str) -> bool {
        self.vms.lock().unwrap().contains_key(id)
    }

    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        self.run_exec(id, req, sink, None).await
    }

    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: ExecControl,
    ) -> NodeResult<ExecResult> {
        self.run_exec(id, req, sink, Some(control)).await
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        let vm = self.fs_target(id).await?;
        vm.agent
            .read_file(path, max_bytes)
            .await
            .map_err(node_error)
    }

    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        let vm = self.fs_target(id).await?;
        super::agent_exec::file_size(&vm.agent, path).await
    }

    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()> {
        let vm = self.fs_target(id).await?;
        vm.agent
            .write_file(path, &data, u64::MAX)
            .await
            .map_err(node_error)
    }

    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        let vm = self.fs_target(id).await?;
        let v = vm.agent.list_dir(path).await.map_err(node_error)?;
        Ok(v.into_iter().map(file_entry).collect())
    }

    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        let vm = self.fs_target(id).await?;
        vm.agent.remove(path).await.map_err(node_error)
    }

    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        let vm = self.fs_target(id).await?;
        vm.agent
            .stat(path)
            .await
            .map(file_entry)
            .map_err(node_error)
    }

    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        let vm = self.fs_target(id).await?;
        vm.agent.mkdir(path, parents).await.map_err(node_error)
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        let vm = self.get(id)?;
        freeze(id, "microvm", &vm.deleting, &vm.paused, vm.cgroup.group()).await
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        let vm = self.get(id)?;
        thaw(id, "microvm", &vm.deleting, &vm.paused, vm.cgroup.group()).await
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        if check_id(id).is_err() {
            return Ok(());
        }
        let vm = self.vms.lock().unwrap().get(id).cloned();
        if let Some(vm) = &vm {
            *vm.deleting.write().await = true;
            let _ = vm.killed.send(true);
        }
        let res = self.destroy(id).await;
        if res.is_ok() {
            self.vms.lock().unwrap().remove(id);
            if vm.is_some() {
                tracing::info!(sandbox = %id, backend = "microvm", "sandbox deleted");
            }
        }
        res
    }

    fn list(&self) -> Vec<SandboxStatus> {
        self.vms
            .lock()
            .unwrap()
            .values()
            .map(|v| SandboxStatus {
                id: v.state.id.clone(),
                backend: Backend::Microvm,
                alive: proc_starttime(v.state.qemu_pid) == Some(v.state.qemu_starttime),
            })
            .collect()
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let mut adopted = Vec::new();
        let mut errors = Vec::new();
        let vms = self.cfg.dir.join("vms");
        let names: Vec<String> = std::fs::read_dir(&vms)
            .map_err(|e| NodeError::io(format!("read {}", vms.display()), e))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| check_id(n).is_ok())
            .collect();
        for name in names {
            if self.has(&name) {
                adopted.push(name);
                continue;
            }
            let state: Option<VmState> = std::fs::read(self.vm_dir(&name).join("state.json"))
                .ok()
                .and_then(|s| serde_json::from_slice(&s).ok());
            match state {
                Some(st)
                    if st.id == name
                        && keep.contains(&name)
                        && proc_starttime(st.qemu_pid) == Some(st.qemu_starttime) =>
                {
                    self.adopt(st, None);
                    tracing::info!(sandbox = %name, backend = "microvm", "sandbox re-adopted");
                    adopted.push(name);
                }
                _ => {
                    tracing::info!(sandbox = %name, backend = "microvm", "removing leftover sandbox");
                    if let Err(e) = self.destroy(&name).await {
                        errors.push(e.to_string());
                    }
                }
            }
        }
        for id in self.cgroups.list_sandboxes() {
            if !self.has(&id) {
                let cg = self.cgroups.sandbox(&id);
                if let Err(e) =
                    spawn_blocking(move || cg.group().destroy(Duration::from_secs(10))).await
                {
                    errors.push(e.to_string());
                }
            }
        }
        if errors.is_empty() {
            Ok(adopted)
        } else {
            Err(NodeError::io(
                format!("microvm readopt: {}", errors.join("; ")),
                std::io::Error::other("cleanup"),
            ))
        }
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
    fn accel_env_values() {
        assert_eq!(Accel::Kvm.as_str(), "kvm");
        assert_eq!(Accel::Tcg.as_str(), "tcg");
    }
}
