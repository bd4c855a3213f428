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
//! cold instead.
//!
//! Collection ([`sweep`], at node start and after each new template): partial templates
//! (`*.tmp`, start only); templates made from other boot files than the node's now (their
//! `inputs` file differs from [`MicrovmBackend`]'s: another kernel, guest agent/initramfs or
//! QEMU binary, so no create can ever hit them again); templates no create has started from
//! for [`UNUSED_TTL`] (the `used` file's mtime, else the build's), which also collects the
//! shapes of an older QEMU command line. Each holds about the guest's touched RAM plus its
//! scratch disk (~60-100 MiB).
use super::{make_scratch, MicrovmBackend, QEMU_PIDS};
use crate::agent_client::AgentClient;
use crate::backends::qemu::snapshot::{
    kill_and_wait, load_memory, save_memory, Relay, MEMORY_FILE, QMP_SOCK,
};
use crate::backends::qemu::state::{write_json, VmState};
use crate::backends::qemu::{self, Jail};
use crate::backends::qemu::{spawn_qemu, tail_of, Accel};
use crate::cgroups::SandboxCgroup;
use crate::node::{NodeError, NodeResult};
use crate::qmp::Qmp;
use crate::sys::spawn_blocking;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// How long the template's guest gets to notice the node disconnected before it is saved.
const SETTLE: Duration = Duration::from_millis(500);
/// How long a restored guest may take to answer before the create boots cold instead.
const TEMPLATE_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// A template no create started from for this long is removed by [`sweep`].
pub(super) const UNUSED_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// In a template's directory: the boot files it was made from ([`MicrovmBackend`]'s
/// `template_inputs`, text).
const INPUTS_FILE: &str = "inputs";
/// In a template's directory: an empty file whose mtime is the last start (or attempt) from it.
const USED_FILE: &str = "used";

/// Whether templates are on: `SANDLOT_MICROVM_TEMPLATES` unset, `1`, `on` or `true`.
pub(super) fn enabled_from_env() -> bool {
    !matches!(
        std::env::var("SANDLOT_MICROVM_TEMPLATES").as_deref(),
        Ok("0") | Ok("off") | Ok("false") | Ok("no")
    )
}

/// Removes from the template directory `dir` what no create can use (see the module docs):
/// templates whose `inputs` file is not `inputs`, those last used (or made) more than
/// `ttl` before `now`, and with `partial` the unfinished `*.tmp` ones (only at node start:
/// later they are builds under way). Returns the names removed.
pub(super) fn sweep(
    dir: &Path,
    inputs: &str,
    ttl: Duration,
    now: SystemTime,
    partial: bool,
) -> Vec<String> {
    let mut removed = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let p = e.path();
        let gone = if name.ends_with(".tmp") {
            partial
        } else {
            let stale =
                std::fs::read_to_string(p.join(INPUTS_FILE)).ok().as_deref() != Some(inputs);
            let last = std::fs::metadata(p.join(USED_FILE))
                .or_else(|_| std::fs::metadata(p.join(INPUTS_FILE)))
                .and_then(|m| m.modified())
                .ok();
            stale || last.is_none_or(|t| now.duration_since(t).unwrap_or_default() > ttl)
        };
        if gone && std::fs::remove_dir_all(&p).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// `path:size:mtime` of `p` (empty when it cannot be read).
pub(super) fn file_id(p: &Path) -> String {
    std::fs::metadata(p)
        .map(|m| {
            use std::os::unix::fs::MetadataExt;
            format!("{}:{}:{}", p.display(), m.len(), m.mtime())
        })
        .unwrap_or_default()
}

/// The template key of a VM with QEMU arguments `args` whose files live in `dir`: a hash of
/// the arguments with `dir` taken out, the image disk's size and mtime (a disk collected
/// and made again under the same name is another disk: a guest restored over it would
/// read stale cached blocks), the scratch size and the node's boot files
/// (`template_inputs`: the kernel's and QEMU's size and mtime, the initramfs's content,
/// which the node writes anew at each start).
pub(super) fn key(
    b: &MicrovmBackend,
    dir: &Path,
    args: &[String],
    disk: &Path,
    scratch_mib: u64,
) -> String {
    let d = dir.display().to_string();
    let shape: Vec<String> = args.iter().map(|a| a.replace(&d, "VMDIR")).collect();
    let (disk, scratch) = (file_id(disk), scratch_mib.to_string());
    let mut parts: Vec<&[u8]> = shape.iter().map(|s| s.as_bytes()).collect();
    parts.extend([
        disk.as_bytes(),
        b.template_inputs.as_bytes(),
        scratch.as_bytes(),
    ]);
    format!("{:016x}", crate::images::fnv(&parts))
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
        // The last use, for `sweep`, marked first: a sweep after another template's build
        // must not take this one from under the copy below.
        let _ = std::fs::File::create(tpl.join(USED_FILE));
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
        let jail = self.core.jail(state.qemu_uid, state.accel);
        let (pid, start) = spawn_qemu(&self.core.qemu, &a, dir, cg, false, &jail)?;
        state.qemu_pid = pid;
        state.qemu_starttime = start;
        state.started_from = "template".into();
        write_json(&dir.join("boot.json"), state)?;
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
                    tail_of(&dir.join("qemu.log"), 400)
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
        let qemu = self.core.qemu.clone();
        let cg = self.core.cgroups.sandbox(&format!("tpl-{key}"));
        let building = self.templates_building.clone();
        let uids = self.cfg.uids.clone();
        let inputs = self.template_inputs.clone();
        let templates = self.cfg.dir.join("templates");
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
                    let jail = crate::backends::qemu::sandbox::qemu_jail(&uids, Some(uid), accel);
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
                        &inputs,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            uids.release(&owner);
            match res {
                Ok(bytes) => {
                    tracing::info!(backend = "microvm", template = %key, ms = started.elapsed().as_millis() as u64, bytes, "template snapshot made");
                    let swept = spawn_blocking(move || {
                        Ok(sweep(
                            &templates,
                            &inputs,
                            UNUSED_TTL,
                            SystemTime::now(),
                            false,
                        ))
                    })
                    .await
                    .unwrap_or_default();
                    if !swept.is_empty() {
                        tracing::info!(backend = "microvm", removed = ?swept, "unused template snapshots removed");
                    }
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
    inputs: &str,
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
        // The guest agent starts its exec-helper zygote and spare helper just after its
        // first identity call (see sandlot-guest's `Shared::spare_pending`): made here,
        // they are in the template's memory (within SETTLE), so a start from it has them
        // at once. Each start sets its own identity over this one.
        agent
            .set_identity(&qemu::fresh_identity("template"))
            .await?;
        relay.detach().await;
        drop(agent);
        tokio::time::sleep(SETTLE).await;
        let d = tmp.to_path_buf();
        spawn_blocking(move || save_memory(&d, &d)).await
    }
    .await;
    spawn_blocking(move || {
        kill_and_wait(pid, start);
        Ok(())
    })
    .await?;
    let g = cg.group().clone();
    let _ = spawn_blocking(move || Ok(g.destroy(Duration::from_secs(10))?)).await;
    let size = res?;
    for f in [QMP_SOCK, "agent.sock"] {
        let _ = std::fs::remove_file(tmp.join(f));
    }
    // The template is root's alone from now on: its builder's uid goes to other sandboxes.
    for f in ["scratch.img", qemu::CONSOLE_LOG] {
        let p = tmp.join(f);
        let _ = std::os::unix::fs::lchown(&p, Some(0), Some(0));
    }
    std::fs::write(tmp.join(INPUTS_FILE), inputs)
        .and_then(|_| std::os::unix::fs::chown(tmp, Some(0), Some(0)))
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
    /// re-adoption destroys the leftover group and `sweep` the directory.) Then
    /// removes the backend's parent cgroups if no microVM is left in them (running ones
    /// stay for re-adoption: EBUSY).
    fn drop(&mut self) {
        let keys: Vec<String> = self.templates_building.lock().unwrap().drain().collect();
        for key in keys {
            let cg = self.core.cgroups.sandbox(&format!("tpl-{key}"));
            if let Err(e) = cg.group().destroy(Duration::from_secs(10)) {
                tracing::warn!(backend = "microvm", template = %key, error = %e, "could not stop a template build");
            }
            let _ =
                std::fs::remove_dir_all(self.cfg.dir.join("templates").join(format!("{key}.tmp")));
        }
        let _ = self.core.cgroups.remove_parent();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A finished template `name` in `dir` made from `inputs`, last used `age` ago (no
    /// `used` file when `None`).
    fn template(dir: &Path, name: &str, inputs: &str, used_age: Option<Duration>) {
        let t = dir.join(name);
        std::fs::create_dir_all(&t).unwrap();
        std::fs::write(t.join("memory.state"), b"m").unwrap();
        std::fs::write(t.join(INPUTS_FILE), inputs).unwrap();
        if let Some(age) = used_age {
            let f = std::fs::File::create(t.join(USED_FILE)).unwrap();
            f.set_modified(SystemTime::now() - age).unwrap();
        }
    }

    #[test]
    fn sweep_removes_stale_unused_and_partial_templates() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let day = Duration::from_secs(24 * 3600);
        template(dir, "fresh", "now", None);
        template(dir, "used-lately", "now", Some(day));
        template(dir, "unused", "now", Some(8 * day));
        template(dir, "other-kernel", "before", Some(Duration::ZERO));
        std::fs::create_dir_all(dir.join("old-format")).unwrap(); // no `inputs` file
        std::fs::create_dir_all(dir.join("building.tmp")).unwrap();
        let names = |mut v: Vec<String>| {
            v.sort();
            v
        };
        // While the node runs, a `.tmp` is a build under way and stays.
        let removed = sweep(dir, "now", UNUSED_TTL, SystemTime::now(), false);
        assert_eq!(names(removed), ["old-format", "other-kernel", "unused"]);
        assert!(dir.join("building.tmp").is_dir());
        // At start it is a crash's leftover.
        let removed = sweep(dir, "now", UNUSED_TTL, SystemTime::now(), true);
        assert_eq!(removed, ["building.tmp"]);
        let mut left: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["fresh", "used-lately"]);
        // A week later without use the fresh one goes too; a missing directory is no error.
        let later = SystemTime::now() + 8 * day;
        assert_eq!(
            names(sweep(dir, "now", UNUSED_TTL, later, true)),
            ["fresh", "used-lately"]
        );
        assert!(sweep(&dir.join("none"), "now", UNUSED_TTL, later, true).is_empty());
    }
}
