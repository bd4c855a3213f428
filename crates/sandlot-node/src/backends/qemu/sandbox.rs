//! One QEMU sandbox, written once for the `microvm` and `vm` backends.
//!
//! What the two backends share lives here: the table of running VMs ([`QemuCore`]), one
//! VM's handles ([`QemuVm`]: its state as created, its current QEMU, the agent link that
//! survives pause and resume, its lifecycle flags), create-with-rollback, exec, delete,
//! list, pause/resume with memory (the steps of `microvm::snapshot`) and
//! re-adoption after a node restart. What differs is a `Machine`: how a VM boots (`-M
//! microvm` + an EROFS image disk + a scratch disk, optionally from a template snapshot;
//! or `-M q35` + a qcow2 chain), how a checkpoint captures its disk, what a pause must bring
//! up to date first, and which image disks are still in use. Every `Machine` is a
//! [`SandboxBackend`] and an [`AgentFiles`] through the blanket impls below.
//!
//! On-disk state is unchanged: `vms/<id>/state.json` / `boot.json` hold a
//! [`VmState`]; a node upgraded in place re-adopts the VMs of the previous one.
use super::snapshot::{self, ProcCell, QemuProc, Relay};
use super::state::VmState;
use super::Accel;
use super::{Jail, QemuUids, AGENT_FD, AGENT_SOCK, QMP_FD, QMP_SOCK};
use crate::agent_client::AgentClient;
use crate::backends::agent_exec;
use crate::backends::agent_files::{AgentFiles, HoldsAgent};
use crate::backends::check_id;
use crate::backends::pause::{check_live, freeze, thaw};
use crate::backends::{ExecIo, SandboxBackend};
use crate::cgroups::{CgroupRoot, SandboxCgroup};
use crate::checkpoints::{Captured, Checkpoint};
use crate::images::Image;
use crate::liveness::Liveness;
use crate::node::{NodeError, NodeResult, SandboxSpec, SandboxStatus};
use crate::sys::{proc_starttime, spawn_blocking};
use async_trait::async_trait;
use sandlot_api::{Backend, ExecRequest, ExecResult};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, RwLock};

/// How often a boot checks whether its QEMU has exited ([`QemuCore::wait_booted`]).
const EXIT_POLL: Duration = Duration::from_millis(100);

/// The jail of a QEMU running as `uid` under `uids` (agent and QMP sockets bound by the
/// node and handed over as fds; none for a root QEMU of an older node, whose command line
/// opens them by path).
pub(super) fn qemu_jail(uids: &QemuUids, uid: Option<u32>, accel: Accel) -> Jail {
    uids.jail(uid, accel, &[(AGENT_SOCK, AGENT_FD), (QMP_SOCK, QMP_FD)])
}

/// One running (or paused with memory) VM.
pub struct QemuVm {
    /// As created (`qemu_pid`: the first QEMU's, see `proc_`; `qemu_args`: see `args`).
    pub(super) state: VmState,
    /// The QEMU it runs in now (a resume starts a new one).
    pub(super) proc_: ProcCell,
    /// The agent link that survives pause and resume.
    pub(super) relay: Arc<Relay>,
    /// QEMU's command line for the next resume (`vm`: its `-drive` names the active disk
    /// layer as of the last pause; `microvm`: `state.qemu_args`, never changed).
    pub(super) args: Mutex<Vec<String>>,
    /// Its QEMU's cgroup.
    pub(super) cgroup: SandboxCgroup,
    /// Its guest agent (one connection, shared by every call).
    pub(super) agent: AgentClient,
    /// Set (write side) by a delete; execs and file calls hold the read side.
    pub(super) deleting: RwLock<bool>,
    /// Sent `true` by a delete: running execs end.
    pub(super) killed: watch::Sender<bool>,
    /// Paused (with memory, or frozen for a VM of an older node).
    pub(super) paused: AtomicBool,
    /// Serialises pause, resume and (`vm`) checkpoints.
    pub(super) lifecycle: tokio::sync::Mutex<()>,
}

impl HoldsAgent for QemuVm {
    fn agent(&self) -> &AgentClient {
        &self.agent
    }
}

/// The part of a QEMU backend that does not depend on the machine: its directory, QEMU
/// binary, cgroups, host uids and the table of its VMs.
pub struct QemuCore {
    /// Backend name in logs and errors (`"microvm"`, `"vm"`).
    name: &'static str,
    /// What a VM is called in messages (`"microVM"`, `"VM"`).
    label: &'static str,
    /// Which backend this is.
    backend: Backend,
    /// `DATA/<name>`: `vms/<id>/` holds each VM's files.
    pub(super) dir: PathBuf,
    /// `qemu-system-x86_64`.
    pub(super) qemu: PathBuf,
    /// The backend's QEMU cgroups.
    pub(super) cgroups: CgroupRoot,
    /// Host uids of the QEMUs (one per sandbox).
    pub(super) uids: Arc<QemuUids>,
    /// The shared snapshot store pauses with memory write to (`--snapshot-dir`).
    pub(super) store: Option<super::store::SnapshotStore>,
    /// The node's network policies (`network: {"allow": ...}`, shared with the function
    /// and container backends); `None`: allow policies are refused.
    pub(super) net: Option<Arc<crate::net::NodeNet>>,
    vms: Mutex<HashMap<String, Arc<QemuVm>>>,
}

impl QemuCore {
    /// An empty table of backend `backend` (`microvm` or `vm`) with its files under `dir`,
    /// its QEMU cgroups' parents made under `cgroups`.
    ///
    /// # Errors
    /// `Internal` when the parent cgroups cannot be made.
    pub(super) fn new(
        backend: Backend,
        dir: &Path,
        qemu: PathBuf,
        cgroups: CgroupRoot,
        uids: &Arc<QemuUids>,
    ) -> NodeResult<Self> {
        let (name, label) = match backend {
            Backend::Microvm => ("microvm", "microVM"),
            _ => ("vm", "VM"),
        };
        cgroups.ensure_parent()?;
        Ok(QemuCore {
            name,
            label,
            backend,
            dir: dir.to_path_buf(),
            qemu,
            cgroups,
            uids: uids.clone(),
            store: None,
            net: None,
            vms: Mutex::new(HashMap::new()),
        })
    }

    /// The snapshot directory of `id` in the shared store, when there is one.
    pub(super) fn snapshot_dir(&self, id: &str) -> Option<PathBuf> {
        self.store.as_ref().map(|s| s.sandbox_dir(id))
    }

    /// `DIR/vms/<id>`.
    pub(super) fn vm_dir(&self, id: &str) -> PathBuf {
        self.dir.join("vms").join(id)
    }

    /// VM `id`.
    ///
    /// # Errors
    /// `NotFound` when this backend does not run it.
    pub(super) fn get(&self, id: &str) -> NodeResult<Arc<QemuVm>> {
        self.vms
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("sandbox {id} not found")))
    }

    /// Drops `id` from the table (a takeover that failed; its files go with `destroy`).
    pub(super) fn forget(&self, id: &str) {
        self.vms.lock().unwrap().remove(id);
    }

    /// True when this backend runs `id`.
    pub(super) fn has(&self, id: &str) -> bool {
        self.vms.lock().unwrap().contains_key(id)
    }

    /// The jail of a QEMU of this backend running as `uid` (agent and QMP sockets bound by
    /// the node and handed over as fds; none for a root QEMU of an older node, whose
    /// command line opens them by path).
    pub(super) fn jail(&self, uid: Option<u32>, accel: Accel) -> Jail {
        qemu_jail(&self.uids, uid, accel)
    }

    /// Registers a running (or paused with memory) VM; `agent`: the connected client and
    /// relay of its create (a new one would be a second connection on the guest's one
    /// stream).
    pub(super) fn adopt(
        &self,
        state: VmState,
        agent: Option<(AgentClient, Arc<Relay>)>,
    ) -> Arc<QemuVm> {
        if let Some(uid) = state.qemu_uid {
            self.uids.keep(&state.id, uid);
        }
        let sock = self.vm_dir(&state.id).join(AGENT_SOCK);
        let (agent, relay) = agent.unwrap_or_else(|| {
            let relay = Relay::new(sock.clone());
            (AgentClient::with_connector(&sock, relay.connector()), relay)
        });
        let vm = Arc::new(QemuVm {
            cgroup: self.cgroups.sandbox(&state.id),
            proc_: Arc::new(Mutex::new(QemuProc {
                pid: state.qemu_pid,
                start: state.qemu_starttime,
                saved: state.memory_saved,
            })),
            relay,
            args: Mutex::new(state.qemu_args.clone()),
            agent,
            deleting: RwLock::new(false),
            killed: watch::channel(false).0,
            paused: AtomicBool::new(state.memory_saved),
            lifecycle: tokio::sync::Mutex::new(()),
            state,
        });
        self.vms
            .lock()
            .unwrap()
            .insert(vm.state.id.clone(), vm.clone());
        vm
    }

    /// The VM of a file call: known, not being deleted, not paused, QEMU alive.
    ///
    /// # Errors
    /// `NotFound` (unknown or being deleted), `Conflict` (paused, or its QEMU is gone).
    pub(super) async fn fs_target(&self, id: &str) -> NodeResult<Arc<QemuVm>> {
        let vm = self.get(id)?;
        check_live(id, *vm.deleting.read().await, &vm.paused)?;
        let cur = *vm.proc_.lock().unwrap();
        if !cur.exists() {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is not running (its QEMU {} is gone)",
                cur.pid
            )));
        }
        Ok(vm)
    }

    /// One exec through the VM's agent ([`crate::backends::agent_exec`]). The guest kernel's OOM
    /// kills are invisible from the host: `oom_killed` comes from the agent, which reads
    /// its `sandbox` cgroup's `oom_kill` counter around the exec.
    ///
    /// # Errors
    /// `NotFound` (unknown or being deleted), `Conflict` (paused), the exec's own.
    pub(super) async fn run_exec(
        &self,
        id: &str,
        req: &ExecRequest,
        io: ExecIo,
    ) -> NodeResult<ExecResult> {
        let vm = self.get(id)?;
        let life = (&vm.deleting, &vm.killed, &vm.paused);
        let (spec, env) = (&vm.state.spec, &vm.state.image_env);
        let (guard, mut killed, plan) = agent_exec::begin(id, life, env, spec, req).await?;
        let cell = vm.proc_.clone();
        let died = move || !cell.lock().unwrap().exists();
        let target = agent_exec::Target {
            id,
            kind: self.label,
            agent: &vm.agent,
            pids_max: vm.state.spec.pids_max,
            died: &died,
        };
        let started = crate::backends::gvisor_audit::now_ms();
        let mut res =
            agent_exec::run(target, plan, guard, &mut killed, io.sink, io.control).await?;
        // What the network policy refused while this exec ran (DNS queries, packets), as
        // the container backend reports it.
        if let (Some(_), Some(net)) = (&vm.state.netns, self.net.as_ref().and_then(|n| n.started()))
        {
            let room =
                sandlot_guest::spec::MAX_VIOLATIONS_PER_EXEC.saturating_sub(res.violations.len());
            let refused = net.violations(id, started, crate::backends::gvisor_audit::now_ms());
            res.violations.extend(refused.into_iter().take(room));
        }
        Ok(res)
    }

    /// With an allow policy in `spec`: the network of the VM `spec.id` whose QEMU will run
    /// as host uid `uid`: the namespace file `vms/<id>/netns` ([`crate::net::create_netns`]),
    /// the node's veth, nftables and resolver on it ([`crate::net::NetworkManager::attach`]),
    /// and the tap [`super::TAP_IF`] bridged to the veth ([`crate::net::bridge_tap`]).
    /// Returns the namespace (QEMU starts in it: [`Jail::in_netns`]) and the guest's
    /// `sandlot.net=` argument; `None` for `network: "none"` (no network device at all).
    /// What it made is removed by [`QemuCore::destroy`] (the create's rollback).
    ///
    /// # Errors
    /// `InvalidArgument` when this backend has no network manager; `Unavailable` when the
    /// guest kit `kit` has no `virtio_net` module (a kit built before it was listed: rerun
    /// `scripts/guest-kit.sh`); the manager's errors (`Unavailable` without `ip`/`nft`,
    /// `ResourceExhausted` when the pool is full).
    pub(super) async fn attach_net(
        &self,
        spec: &SandboxSpec,
        uid: u32,
        kit: &Path,
    ) -> NodeResult<Option<(PathBuf, sandlot_guest::vm_net::NetArg)>> {
        let sandlot_api::NetworkPolicy::Allow(policy) = &spec.network else {
            return Ok(None);
        };
        let module = kit.join("modules").join("virtio_net.ko");
        if !module.is_file() {
            return Err(NodeError::Unavailable(format!(
                "network allow policies on {} need the guest kit's virtio_net module, and {} is missing (rerun scripts/guest-kit.sh)",
                self.name,
                module.display()
            )));
        }
        let Some(net) = &self.net else {
            return Err(NodeError::InvalidArgument(format!(
                "network allow policies are not enforced by the {} backend on this node",
                self.name
            )));
        };
        let net = net.get().await?;
        let path = self.vm_dir(&spec.id).join("netns");
        let p = path.clone();
        spawn_blocking(move || crate::net::create_netns(&p)).await?;
        let att = net.attach(&spec.id, &path, policy).await?;
        crate::net::bridge_tap(&path, super::TAP_IF, uid).await?;
        Ok(Some((
            path,
            sandlot_guest::vm_net::NetArg {
                addr: att.sandbox_addr,
                prefix: 30,
                gateway: att.resolver,
            },
        )))
    }

    /// Waits until the agent of the VM being created as `id` (its QEMU `proc_`) answers,
    /// within `timeouts.0` under KVM or `timeouts.1` under TCG. A QEMU that exits first
    /// (a bad option, a device it cannot open) ends the wait at once (checked every
    /// [`EXIT_POLL`]), not at the timeout.
    ///
    /// # Errors
    /// `Internal` naming the boot's failure with the console's tail (see
    /// [`super::boot_failure`]; the console is kept under `failed/`).
    pub(super) async fn wait_booted(
        &self,
        agent: &AgentClient,
        id: &str,
        accel: Accel,
        timeouts: (Duration, Duration),
        proc_: (i32, u64),
    ) -> NodeResult<()> {
        let timeout = match accel {
            Accel::Kvm => timeouts.0,
            Accel::Tcg => timeouts.1,
        };
        let started = Instant::now();
        let exited = async {
            while crate::liveness::proc_liveness(proc_.0, proc_.1) != Liveness::Dead {
                tokio::time::sleep(EXIT_POLL).await;
            }
            Err(NodeError::io(
                format!("the boot ended after {} ms", started.elapsed().as_millis()),
                std::io::Error::other("QEMU exited"),
            ))
        };
        let ready = tokio::select! {
            r = agent.wait_ready_single(started + timeout) => r,
            r = exited => r,
        };
        match ready {
            Ok(_) => Ok(()),
            Err(e) => Err(super::boot_failure(
                &self.dir,
                &self.vm_dir(id),
                &format!("{} {id}", self.label),
                id,
                timeout,
                accel,
                proc_,
                &e,
            )),
        }
    }

    /// `sync` in the guest of VM `id` before a checkpoint (its page cache reaches the
    /// disk).
    ///
    /// # Errors
    /// `Conflict` when the VM is paused; the exec's errors; `Internal` when `sync` fails.
    pub(super) async fn sync_guest(&self, vm: &QemuVm, id: &str) -> NodeResult<()> {
        if vm.paused.load(Ordering::SeqCst) {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is paused; resume it before a checkpoint (the guest must flush its disk first)"
            )));
        }
        let mut req = ExecRequest::new(sandlot_api::Cmd::Argv(vec!["sync".into()]));
        req.timeout_s = Some(60.0);
        let r = self.run_exec(id, &req, ExecIo::default()).await?;
        if r.exit_code != 0 {
            return Err(NodeError::io(
                format!(
                    "sync in {} {id}: exit {}: {}",
                    self.label, r.exit_code, r.stderr
                ),
                std::io::Error::other("guest sync failed"),
            ));
        }
        Ok(())
    }

    /// The last steps of a resume on this node from `claimed`, a snapshot of the shared
    /// store claimed for `id` ([`super::store`]), once the machine has made the VM
    /// directory, its uid `uid`, its cgroup and its disks: the manifest's QEMU arguments
    /// with the source node's directories replaced by this node's (`backend_dir`,
    /// `kit_dir`, the VM directory), `state.json`, the VM registered as paused with memory,
    /// then resumed from `claimed/memory.state`.
    ///
    /// # Errors
    /// Writing `state.json`; those of [`snapshot::resume`] (the caller renames the claim
    /// back).
    pub(super) async fn resume_claimed(
        &self,
        claimed: &Path,
        m: super::store::Manifest,
        uid: u32,
        backend_dir: &Path,
        kit_dir: &Path,
    ) -> NodeResult<()> {
        let dir = self.vm_dir(&m.state.id);
        let args = super::store::rebase_args(
            &m.state.qemu_args,
            &[
                (m.vm_dir.as_path(), dir.as_path()),
                (m.backend_dir.as_path(), backend_dir),
                (m.kit_dir.as_path(), kit_dir),
            ],
        );
        let state = VmState {
            qemu_args: args,
            qemu_uid: Some(uid),
            memory_saved: true,
            ..m.state
        };
        super::state::write_json(&dir.join("state.json"), &state)?;
        let vm = self.adopt(state, None);
        let _life = vm.lifecycle.lock().await;
        let mut target = self.target(&vm);
        target.snapshot = Some(claimed.to_path_buf());
        snapshot::resume(&target).await
    }

    /// The pause/resume [`snapshot::Target`] of `vm` (its QEMU restarted with `vm.args`).
    pub(super) fn target<'a>(&'a self, vm: &'a QemuVm) -> snapshot::Target<'a> {
        snapshot::Target {
            backend: self.name,
            dir: self.vm_dir(&vm.state.id),
            qemu: &self.qemu,
            cgroup: &vm.cgroup,
            state: VmState {
                qemu_args: vm.args.lock().unwrap().clone(),
                ..vm.state.clone()
            },
            deleting: &vm.deleting,
            paused: &vm.paused,
            relay: &vm.relay,
            agent: &vm.agent,
            proc_: &vm.proc_,
            // The same uid as before the pause (`qemu_uid`, held by the sandbox), in the
            // same network namespace.
            jail: self
                .jail(vm.state.qemu_uid, vm.state.accel)
                .in_netns(vm.state.netns.as_deref()),
            snapshot: self.snapshot_dir(&vm.state.id),
        }
    }

    /// Kills the QEMU of `id` (from `state.json` or `boot.json`), removes its network
    /// (veth, nftables, resolver, the namespace file in its directory; idempotent), its
    /// cgroup and directory (for `vm` its qcow2 layers' links with it; shared image disks
    /// stay), gives its uid back.
    ///
    /// # Errors
    /// `Internal` when the network, the cgroup or the directory cannot be removed.
    pub(super) async fn destroy(&self, id: &str) -> NodeResult<()> {
        let dir = self.vm_dir(id);
        let cg = self.cgroups.sandbox(id);
        let (uids, id_) = (self.uids.clone(), id.to_string());
        let d = dir.clone();
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
            Ok(())
        })
        .await?;
        // The network goes before the directory: its namespace file is mounted in there.
        if let Some(net) = self.net.as_ref().and_then(|n| n.started()) {
            net.teardown(id).await?;
        }
        let dir = d;
        spawn_blocking(move || {
            // Kills anything left in the group (a QEMU whose state file was lost) too.
            cg.group().destroy(Duration::from_secs(10))?;
            // A namespace file left by a create whose network attach failed half-way.
            crate::net::remove_netns(&dir.join("netns"))?;
            // No process of the uid is left: once its files are gone it may go to another
            // sandbox.
            super::remove_vm_dir(&uids, &id_, &dir)
        })
        .await?;
        if let Some(store) = &self.store {
            // Its paused state in the shared store (not one another node has claimed).
            store.remove(id);
        }
        Ok(())
    }

    /// Re-adopts the VMs of `DIR/vms/` named in `keep` whose QEMU still runs (or that are
    /// paused with their memory file), removes every other VM directory and the cgroups of
    /// VMs not adopted. The ids adopted, and the errors of removals.
    async fn readopt_vms(&self, keep: &[String]) -> NodeResult<(Vec<String>, Vec<String>)> {
        let mut adopted = Vec::new();
        let mut errors = Vec::new();
        let vms = self.dir.join("vms");
        let names: Vec<String> = std::fs::read_dir(&vms)
            .map_err(|e| NodeError::io(format!("read {}", vms.display()), e))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| check_id(n).is_ok())
            .collect();
        let backend = self.name;
        for name in names {
            if self.has(&name) {
                adopted.push(name);
                continue;
            }
            let dir = self.vm_dir(&name);
            let state: Option<VmState> = std::fs::read(dir.join("state.json"))
                .ok()
                .and_then(|s| serde_json::from_slice(&s).ok());
            match state {
                Some(st)
                    if st.id == name
                        && keep.contains(&name)
                        && st.memory_saved
                        && (dir.join(snapshot::MEMORY_FILE).is_file()
                            || self
                                .snapshot_dir(&name)
                                .is_some_and(|d| d.join(snapshot::MEMORY_FILE).is_file())) =>
                {
                    // Paused with memory: a QEMU left from a pause cut short goes.
                    let (pid, start) = (st.qemu_pid, st.qemu_starttime);
                    spawn_blocking(move || {
                        snapshot::kill_and_wait(pid, start);
                        Ok(())
                    })
                    .await?;
                    self.adopt(st, None);
                    tracing::info!(sandbox = %name, backend, "sandbox re-adopted (paused with memory file)");
                    adopted.push(name);
                }
                Some(st)
                    if st.id == name
                        && keep.contains(&name)
                        && !st.memory_saved
                        && proc_starttime(st.qemu_pid) == Some(st.qemu_starttime) =>
                {
                    if !st.qemu_args.is_empty() {
                        // A pause cut short between `stop` and `state.json`: run it again.
                        let d = dir.clone();
                        spawn_blocking(move || {
                            snapshot::continue_if_stopped(&d);
                            Ok(())
                        })
                        .await?;
                    }
                    self.adopt(st, None);
                    tracing::info!(sandbox = %name, backend, "sandbox re-adopted");
                    adopted.push(name);
                }
                _ => {
                    tracing::info!(sandbox = %name, backend, "removing leftover sandbox");
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
                    spawn_blocking(move || Ok(cg.group().destroy(Duration::from_secs(10))?)).await
                {
                    errors.push(e.to_string());
                }
            }
        }
        Ok((adopted, errors))
    }
}

/// One create's boot ([`Machine::boot`]): VM `spec` of `image` in cgroup `cg`, a fork of
/// `seed` when given.
pub(crate) struct Boot<'a> {
    pub spec: &'a SandboxSpec,
    pub image: &'a Image,
    pub cg: &'a SandboxCgroup,
    pub seed: Option<&'a Checkpoint>,
}

/// A booted VM: its state (`state.json` written) and its connected agent with the relay
/// behind it.
pub(crate) type Booted = (VmState, (AgentClient, Arc<Relay>));

/// What differs between the QEMU backends; every `Machine` is a [`SandboxBackend`]
/// (create with rollback, exec, files, pause/resume, delete, list, re-adoption written once
/// here) whose machine-specific steps are these.
#[async_trait]
pub(crate) trait Machine: Send + Sync {
    /// The shared part: directory, QEMU, cgroups, uids, the VM table.
    fn core(&self) -> &QemuCore;

    /// Boots VM `spec` of `image` in cgroup `cg` (a fork of `seed` when given) in its
    /// directory (already made, empty); its state (`state.json` written) and its connected
    /// agent. On error the caller destroys what is left.
    ///
    /// # Errors
    /// `InvalidArgument` (e.g. a disk smaller than the checkpoint's), `Unavailable`, the
    /// boot's failures (`Internal`, with the console's tail).
    async fn boot(&self, b: Boot<'_>) -> NodeResult<Booted>;

    /// A checkpoint of VM `vm` (id `id`) into `dest` (see [`crate::checkpoints`]).
    ///
    /// # Errors
    /// `Conflict` (paused), `NotFound` (being deleted), copy / QMP failures.
    async fn capture(&self, vm: Arc<QemuVm>, id: &str, dest: &Path) -> NodeResult<Captured>;

    /// Brings `vm.args` up to date before a pause with memory (the `vm` backend's
    /// `-drive`: checkpoints may have moved the disk to a newer layer). Nothing by
    /// default.
    ///
    /// # Errors
    /// Whatever reading the VM's files fails with.
    async fn before_pause(&self, _vm: &QemuVm) -> NodeResult<()> {
        Ok(())
    }

    /// Removes the image disks no VM, checkpoint or create in flight uses (with `partial`,
    /// also builds cut short); failures are logged.
    fn collect_disks(&self, partial: bool);

    /// Before paused `vm`'s QEMU starts again from its saved memory (and opens its disks
    /// anew): when a lazy image disk its files name is gone (its FUSE mount lost to a host
    /// reboot or a killed daemon), mounts it again as a create does and returns the hold
    /// on it (kept until QEMU has it open). `None` when nothing was missing or no image
    /// of the store has that disk (the resume then fails with QEMU's error).
    ///
    /// # Errors
    /// Reading the VM's files; the mount's (`Unavailable` after 10 s).
    async fn remount_lazy_disk(&self, vm: &QemuVm) -> NodeResult<Option<super::DiskHold>>;

    /// After a pause with memory into the shared store's directory `dir` (QEMU stopped):
    /// adds what another node needs (disks, manifest; see [`super::store`]).
    ///
    /// # Errors
    /// Copy failures.
    async fn publish(&self, vm: &QemuVm, dir: &Path) -> NodeResult<()>;

    /// The accelerator this node's VMs run with (a snapshot resumes only under the one
    /// it was taken with).
    async fn node_accel(&self) -> Accel;

    /// The steps of [`crate::Node::adopt_snapshot`] after the claim of `id`'s snapshot
    /// directory `claimed` (manifest `m`, already checked): VM directory, uid, cgroup,
    /// disk copies, `state.json`, then the resume from `claimed/memory.state`. On error
    /// the caller removes what was made and gives the claim back.
    ///
    /// # Errors
    /// Copy, cgroup and restore failures.
    async fn restore_claimed(
        &self,
        id: &str,
        claimed: &Path,
        m: super::store::Manifest,
    ) -> NodeResult<()>;

    /// [`crate::Node::adopt_snapshot`] on this backend: claims the snapshot of `id` in the
    /// shared store, checks that this node can run it (backend, no network policy, the
    /// same accelerator), rebuilds and resumes it ([`Self::restore_claimed`]); on failure
    /// removes what was made and gives the claim back (another node, or a later try, may
    /// take it).
    ///
    /// # Errors
    /// `NotFound` (no shared store, no complete snapshot of `id`), `Conflict` (runs here
    /// already, claimed by another node), `InvalidArgument` (a snapshot of another backend),
    /// `Unavailable` (network policy, other accelerator), the restore's errors.
    async fn adopt_from_store(&self, id: &str) -> NodeResult<()> {
        let core = self.core();
        let Some(store) = core.store.clone() else {
            return Err(NodeError::NotFound(format!(
                "no shared snapshot of sandbox {id}: node has no --snapshot-dir"
            )));
        };
        check_id(id)?;
        if core.has(id) {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} already runs on this node"
            )));
        }
        let t0 = Instant::now();
        let (claimed, m) = {
            let (s, i) = (store.clone(), id.to_owned());
            spawn_blocking(move || s.claim(&i)).await?
        };
        let accel = self.node_accel().await;
        let refuse = if m.backend != core.name || m.state.id != id {
            Some(NodeError::InvalidArgument(format!(
                "the snapshot of {id} is of backend {} / sandbox {}; this is the {} backend",
                m.backend, m.state.id, core.name
            )))
        } else if m.state.netns.is_some() {
            // Its network (veth, nftables, resolver, address) lives on the node it was
            // created on.
            Some(NodeError::Unavailable(format!(
                "sandbox {id} has a network allow policy: it resumes only on the node that created it"
            )))
        } else if m.state.accel != accel {
            Some(NodeError::Unavailable(format!(
                "the snapshot of {id} was taken under {}; this node runs {}",
                m.state.accel.as_str(),
                accel.as_str()
            )))
        } else {
            None
        };
        if let Some(e) = refuse {
            store.unclaim(id);
            return Err(e);
        }
        match self.restore_claimed(id, &claimed, m).await {
            Ok(()) => {
                tracing::info!(sandbox = %id, backend = core.name, ms = t0.elapsed().as_millis() as u64, "sandbox taken over from the shared snapshot store and resumed");
                Ok(())
            }
            Err(e) => {
                core.forget(id);
                if let Err(c) = core.destroy(id).await {
                    tracing::warn!(sandbox = %id, error = %c, "cleanup after a failed takeover");
                }
                store.unclaim(id);
                Err(e)
            }
        }
    }
}

/// Creates `spec` on `m` (see [`Machine::boot`]); on error everything made is removed
/// (a failed removal is logged).
async fn create_with<M: Machine + ?Sized>(
    m: &M,
    spec: &SandboxSpec,
    image: &Image,
    seed: Option<&Checkpoint>,
) -> NodeResult<()> {
    let core = m.core();
    check_id(&spec.id)?;
    super::create_vm_dir(&core.vm_dir(&spec.id), &spec.id)?;
    let cg = core.cgroups.sandbox(&spec.id);
    let cg = &cg;
    match m
        .boot(Boot {
            spec,
            image,
            cg,
            seed,
        })
        .await
    {
        Ok((state, agent)) => {
            core.adopt(state, Some(agent));
            tracing::info!(sandbox = %spec.id, backend = core.name, "sandbox created");
            Ok(())
        }
        // A failed rollback is part of the answer (NodeError::CleanupFailed), not only a log.
        Err(e) => Err(e.with_cleanup(core.destroy(&spec.id).await)),
    }
}

#[async_trait]
impl<M: Machine> AgentFiles for M {
    async fn file_agent(&self, id: &str) -> NodeResult<Arc<dyn HoldsAgent>> {
        Ok(self.core().fs_target(id).await?)
    }
}

#[async_trait]
impl<M: Machine> SandboxBackend for M {
    fn kind(&self) -> Backend {
        self.core().backend
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        image: &Image,
        seed: Option<&Checkpoint>,
    ) -> NodeResult<()> {
        create_with(self, spec, image, seed).await
    }

    async fn checkpoint(&self, id: &str, dest: &Path) -> NodeResult<Captured> {
        let vm = self.core().get(id)?;
        self.capture(vm, id, dest).await
    }

    fn has(&self, id: &str) -> bool {
        self.core().has(id)
    }

    async fn exec(&self, id: &str, req: &ExecRequest, io: ExecIo) -> NodeResult<ExecResult> {
        self.core().run_exec(id, req, io).await
    }

    fn agent_files(&self) -> Option<&dyn AgentFiles> {
        Some(self)
    }

    async fn agent_execs(&self, id: &str) -> NodeResult<crate::node::AgentExecs> {
        let vm = self.core().fs_target(id).await?;
        agent_exec::agent_execs(id, &vm.agent).await
    }

    async fn agent_forget(&self, id: &str, handle: &str) -> NodeResult<()> {
        self.core()
            .fs_target(id)
            .await?
            .agent
            .forget_exec(handle)
            .await
    }

    async fn exec_reattach(
        &self,
        id: &str,
        sink: Option<crate::node::ExecSink>,
        reattach: crate::node::ExecReattach,
    ) -> NodeResult<ExecResult> {
        let core = self.core();
        let vm = core.fs_target(id).await?;
        let mut killed = vm.killed.subscribe();
        let cell = vm.proc_.clone();
        let died = move || !cell.lock().unwrap().exists();
        let target = agent_exec::Target {
            id,
            kind: core.label,
            agent: &vm.agent,
            pids_max: vm.state.spec.pids_max,
            died: &died,
        };
        agent_exec::reattach(target, &mut killed, sink, reattach).await
    }

    /// Through the guest agent ([`AgentClient::connect_port`]): the guest's loopback is
    /// reachable only from inside the VM.
    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        let vm = self.core().fs_target(id).await?;
        vm.agent.connect_port(id, port).await
    }

    /// Saves memory and device state to `memory.state` and stops QEMU (see
    /// `microvm::snapshot`); a VM without QEMU arguments on record (created by an older node, no
    /// QMP socket) is frozen in its cgroup instead.
    async fn pause(&self, id: &str) -> NodeResult<()> {
        let core = self.core();
        let vm = core.get(id)?;
        let _life = vm.lifecycle.lock().await;
        if vm.state.qemu_args.is_empty() {
            return freeze(id, core.name, &vm.deleting, &vm.paused, vm.cgroup.group()).await;
        }
        let running = !vm.paused.load(Ordering::SeqCst) && vm.proc_.lock().unwrap().exists();
        if running {
            self.before_pause(&vm).await?;
        }
        let mut target = core.target(&vm);
        if !running {
            return snapshot::pause(&target).await;
        }
        let shared = match &core.store {
            Some(store) => match store.begin(id) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "shared snapshot store unusable; pausing to the node's disk");
                    None
                }
            },
            None => None,
        };
        target.snapshot = shared.clone();
        if let Err(e) = snapshot::pause(&target).await {
            if let Some(store) = &core.store {
                store.remove(id);
            }
            return Err(e);
        }
        if let Some(d) = shared {
            let t0 = Instant::now();
            match self.publish(&vm, &d).await {
                Ok(()) => {
                    tracing::info!(sandbox = %id, ms = t0.elapsed().as_millis() as u64, dir = %d.display(), "snapshot published to the shared store")
                }
                // Still paused (its memory is there); only another node cannot take it.
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "snapshot not published to the shared store; it resumes on this node only")
                }
            }
        }
        Ok(())
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        let core = self.core();
        let vm = core.get(id)?;
        let _life = vm.lifecycle.lock().await;
        if vm.state.qemu_args.is_empty() {
            return thaw(id, core.name, &vm.deleting, &vm.paused, vm.cgroup.group()).await;
        }
        let _disk = match vm.paused.load(std::sync::atomic::Ordering::SeqCst) {
            true => self.remount_lazy_disk(&vm).await?,
            false => None,
        };
        snapshot::resume(&core.target(&vm)).await
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        let core = self.core();
        crate::backends::delete_from(
            id,
            core.name,
            &core.vms,
            |vm| (&vm.deleting, &vm.killed),
            |_| core.destroy(id),
        )
        .await
    }

    fn list(&self) -> Vec<SandboxStatus> {
        let core = self.core();
        core.vms
            .lock()
            .unwrap()
            .values()
            .map(|v| SandboxStatus {
                id: v.state.id.clone(),
                backend: core.backend,
                liveness: v.proc_.lock().unwrap().liveness(),
            })
            .collect()
    }

    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        self.adopt_from_store(id).await
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let (adopted, errors) = self.core().readopt_vms(keep).await?;
        self.collect_disks(true);
        Ok(crate::backends::readopt_done(
            self.core().name,
            adopted,
            &errors,
        ))
    }
}
