//! Template snapshots: start a microVM by restoring a guest that already booted.
//!
//! When: the first cold boot of a machine shape (image disk, memory, vCPUs, scratch size,
//! pids limit, accelerator, kernel, initramfs, QEMU) starts, in the background, one more
//! boot of the same shape in `templates/<key>.tmp/`; once its agent answers, the node
//! disconnects from it (so the template's guest has no agent connection), waits
//! [`SETTLE`] for the guest to see that, `stop`s it and saves memory and devices
//! (`memory.state`, as a pause does) next to its scratch disk as it is at that moment;
//! the directory is renamed to `templates/<key>/`. Every later create of that shape copies
//! the template's scratch disk (`cp --reflink=auto --sparse=always`), starts QEMU with its
//! own command line plus `-incoming defer`, loads the template's state, `cont`s and
//! connects. `SANDLOT_MICROVM_TEMPLATES=0` turns templates off.
//!
//! Identity: after every start (template or cold) the node sends the guest a fresh
//! hostname (= sandbox id), `/etc/machine-id` and 64 random bytes that the agent credits to
//! the kernel's entropy pool and reseeds the CRNG with
//! ([`sandlot_guest::agent_proto::PATH_IDENTITY`]).
//!
//! A template start that fails (missing or stale files, QEMU refusing the state, no agent
//! answer within [`TEMPLATE_READY_TIMEOUT`]) is logged with the reason and the create boots
//! cold instead. Templates are kept until the data directory goes; partial ones
//! (`*.tmp`) are removed at node start.
use super::snapshot::{kill_and_wait, load_memory, save_memory, Relay, MEMORY_FILE, QMP_SOCK};
use super::{make_scratch, spawn_qemu, Accel, MicrovmBackend, VmState, QEMU_PIDS};
use crate::agent_client::AgentClient;
use crate::backends::function::spawn_blocking;
use crate::backends::qemu::{self, Jail};
use crate::cgroups::SandboxCgroup;
use crate::node::{NodeError, NodeResult};
use crate::qmp::Qmp;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long the template's guest gets to notice the node disconnected before it is saved.
const SETTLE: Duration = Duration::from_millis(500);
/// How long a restored guest may take to answer before the create boots cold instead.
const TEMPLATE_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether templates are on: `SANDLOT_MICROVM_TEMPLATES` unset, `1`, `on` or `true`.
pub(super) fn enabled_from_env() -> bool {
    !matches!(
        std::env::var("SANDLOT_MICROVM_TEMPLATES").as_deref(),
        Ok("0") | Ok("off") | Ok("false") | Ok("no")
    )
}

/// Removes partial templates (`templates/*.tmp`) a crash left.
pub(super) fn sweep_partial(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().ends_with(".tmp") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn file_id(p: &Path) -> String {
    std::fs::metadata(p)
        .map(|m| {
            use std::os::unix::fs::MetadataExt;
            format!("{}:{}:{}", p.display(), m.len(), m.mtime())
        })
        .unwrap_or_default()
}

/// The template key of a VM with QEMU arguments `args` whose files live in `dir`: a hash of
/// the arguments with `dir` taken out, the scratch size and the identity (size, mtime) of
/// the kernel, initramfs and QEMU binary.
pub(super) fn key(b: &MicrovmBackend, dir: &Path, args: &[String], scratch_mib: u64) -> String {
    let d = dir.display().to_string();
    let shape: Vec<String> = args.iter().map(|a| a.replace(&d, "VMDIR")).collect();
    let ids = [
        file_id(&super::kit_kernel(&b.cfg.kit_dir)),
        file_id(&b.cfg.dir.join("initramfs.cpio")),
        file_id(&b.qemu),
        scratch_mib.to_string(),
    ];
    let mut parts: Vec<&[u8]> = shape.iter().map(|s| s.as_bytes()).collect();
    parts.extend(ids.iter().map(|s| s.as_bytes()));
    format!("{:016x}", super::fnv(&parts))
}

impl MicrovmBackend {
    fn template_dir(&self, key: &str) -> PathBuf {
        self.cfg.dir.join("templates").join(key)
    }

    /// Starts the VM of `state` (files in `dir`, QEMU arguments `args`) from the template
    /// `key`: `Ok(false)` when there is none, `Ok(true)` once the restored guest's agent
    /// answered (`state` then names its QEMU), an error when the restore failed (its QEMU
    /// is gone again; the caller boots cold).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start_from_template(
        &self,
        key: &str,
        args: &[String],
        dir: &Path,
        cg: &SandboxCgroup,
        agent: &AgentClient,
        relay: &Relay,
        state: &mut VmState,
    ) -> NodeResult<bool> {
        let tpl = self.template_dir(key);
        let mem = tpl.join(MEMORY_FILE);
        if !mem.is_file() {
            return Ok(false);
        }
        let t0 = Instant::now();
        let (src, dst) = (tpl.join("scratch.img"), dir.join("scratch.img"));
        let uid = state.qemu_uid;
        spawn_blocking(move || {
            crate::checkpoints::copy_disk(&src, &dst)?;
            match uid {
                Some(uid) => crate::backends::qemu::give_file(&dst, uid),
                None => Ok(()),
            }
        })
        .await?;
        let copy_ms = t0.elapsed().as_millis() as u64;
        let mut a = args.to_vec();
        a.extend(["-incoming".to_string(), "defer".to_string()]);
        let jail = super::microvm_jail(&self.cfg.uids, state.qemu_uid, state.accel);
        let (pid, start) = self.spawn_qemu(&a, dir, cg, false, &jail)?;
        state.qemu_pid = pid;
        state.qemu_starttime = start;
        state.started_from = "template".into();
        super::write_json(&dir.join("boot.json"), state)?;
        let mut qmp_ms = 0;
        let mut load_ms = 0;
        let res: NodeResult<()> = async {
            let d = dir.to_path_buf();
            let (a, b) = spawn_blocking(move || {
                let t = Instant::now();
                let mut q = Qmp::connect(
                    &d.join(QMP_SOCK),
                    Instant::now() + Duration::from_secs(30),
                    Duration::from_secs(30),
                )?;
                let a = t.elapsed().as_millis() as u64;
                load_memory(&mut q, &mem)?;
                Ok((a, t.elapsed().as_millis() as u64 - a))
            })
            .await?;
            (qmp_ms, load_ms) = (a, b);
            agent
                .wait_ready_single(Instant::now() + TEMPLATE_READY_TIMEOUT)
                .await
        }
        .await;
        if let Err(e) = res {
            relay.detach().await;
            spawn_blocking(move || {
                kill_and_wait(pid, start);
                Ok(())
            })
            .await?;
            let _ = std::fs::remove_file(dir.join("boot.json"));
            return Err(NodeError::io(
                format!(
                    "template {key}: {e}; QEMU said: {}",
                    super::tail_of(&dir.join("qemu.log"), 400)
                ),
                std::io::Error::other("template start failed"),
            ));
        }
        tracing::info!(sandbox = %state.id, backend = "microvm", template = %key, copy_ms, qmp_ms, load_ms, ready_ms = t0.elapsed().as_millis() as u64 - copy_ms - qmp_ms - load_ms, "microVM restored from template");
        Ok(true)
    }

    /// Makes the template `key` in the background when it is neither there nor being made
    /// (see the module docs).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn build_template_in_background(
        &self,
        key: String,
        accel: Accel,
        smp: u64,
        memory_mib: u64,
        append: String,
        disk: PathBuf,
        scratch_mib: u64,
    ) {
        let fin = self.template_dir(&key);
        if fin.exists() || !self.templates_building.lock().unwrap().insert(key.clone()) {
            return;
        }
        let tmp = self.cfg.dir.join("templates").join(format!("{key}.tmp"));
        let args = self.qemu_args(accel, smp, memory_mib, &append, &disk, &tmp);
        let qemu = self.qemu.clone();
        let cg = self.cgroups.sandbox(&format!("tpl-{key}"));
        let building = self.templates_building.clone();
        let uids = self.cfg.uids.clone();
        let timeout = match accel {
            Accel::Kvm => super::READY_TIMEOUT_KVM,
            Accel::Tcg => super::READY_TIMEOUT_TCG,
        };
        tokio::spawn(async move {
            let started = Instant::now();
            // The build's QEMU has a uid of its own, given back when the build ends.
            let owner = format!("tpl-{key}");
            let res = match uids.take(&owner) {
                Ok(uid) => {
                    let jail = super::microvm_jail(&uids, Some(uid), accel);
                    build(
                        &qemu,
                        &cg,
                        &tmp,
                        &fin,
                        &args,
                        scratch_mib,
                        memory_mib,
                        timeout,
                        &jail,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            uids.release(&owner);
            match res {
                Ok(bytes) => {
                    tracing::info!(backend = "microvm", template = %key, ms = started.elapsed().as_millis() as u64, bytes, "template snapshot made")
                }
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&tmp);
                    tracing::warn!(backend = "microvm", template = %key, error = %e, "template snapshot failed; creates keep booting cold")
                }
            }
            building.lock().unwrap().remove(&key);
        });
    }
}

#[allow(clippy::too_many_arguments)]
async fn build(
    qemu: &Path,
    cg: &SandboxCgroup,
    tmp: &Path,
    fin: &Path,
    args: &[String],
    scratch_mib: u64,
    memory_mib: u64,
    timeout: Duration,
    jail: &Jail,
) -> NodeResult<u64> {
    let _ = std::fs::remove_dir_all(tmp);
    std::fs::create_dir_all(tmp)
        .map_err(|e| NodeError::io(format!("create {}", tmp.display()), e))?;
    let s = tmp.join("scratch.img");
    let (d, uid) = (tmp.to_path_buf(), jail.uid);
    spawn_blocking(move || {
        make_scratch(&s, scratch_mib)?;
        if let Some(uid) = uid {
            qemu::prepare_vm_dir(&d, uid)?;
            qemu::give_file(&s, uid)?;
        }
        Ok(())
    })
    .await?;
    qemu::create_vmm_cgroup(cg, memory_mib, 1.0, QEMU_PIDS)?;
    let (pid, start) = spawn_qemu(qemu, args, tmp, cg, false, jail)?;
    let res: NodeResult<u64> = async {
        let relay = Relay::new(tmp.join("agent.sock"));
        let agent = AgentClient::with_connector(tmp.join("agent.sock"), relay.connector());
        agent.wait_ready_single(Instant::now() + timeout).await?;
        relay.detach().await;
        drop(agent);
        tokio::time::sleep(SETTLE).await;
        let d = tmp.to_path_buf();
        spawn_blocking(move || save_memory(&d)).await
    }
    .await;
    spawn_blocking(move || {
        kill_and_wait(pid, start);
        Ok(())
    })
    .await?;
    let g = cg.group().clone();
    let _ = spawn_blocking(move || g.destroy(Duration::from_secs(10))).await;
    let size = res?;
    for f in [QMP_SOCK, "agent.sock"] {
        let _ = std::fs::remove_file(tmp.join(f));
    }
    // The template is root's alone from now on: its builder's uid goes to other sandboxes.
    for f in ["scratch.img", qemu::CONSOLE_LOG] {
        let p = tmp.join(f);
        let _ = std::os::unix::fs::lchown(&p, Some(0), Some(0));
    }
    std::os::unix::fs::chown(tmp, Some(0), Some(0))
        .and_then(|_| {
            std::fs::set_permissions(tmp, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        })
        .map_err(|e| NodeError::io(format!("chmod {}", tmp.display()), e))?;
    std::fs::rename(tmp, fin).map_err(|e| NodeError::io(format!("rename {}", tmp.display()), e))?;
    Ok(size)
}

impl Drop for MicrovmBackend {
    /// Stops the template builds under way: their QEMU (cgroup `tpl-<key>`) would outlive
    /// the node, and a partial template is worth nothing. (After a kill -9 the next start's
    /// re-adoption destroys the leftover group and `sweep_partial` the directory.) Then
    /// removes the backend's parent cgroups if no microVM is left in them (running ones
    /// stay for re-adoption: EBUSY).
    fn drop(&mut self) {
        let keys: Vec<String> = self.templates_building.lock().unwrap().drain().collect();
        for key in keys {
            let cg = self.cgroups.sandbox(&format!("tpl-{key}"));
            if let Err(e) = cg.group().destroy(Duration::from_secs(10)) {
                tracing::warn!(backend = "microvm", template = %key, error = %e, "could not stop a template build");
            }
            let _ =
                std::fs::remove_dir_all(self.cfg.dir.join("templates").join(format!("{key}.tmp")));
        }
        let _ = self.cgroups.remove_parent();
    }
}
