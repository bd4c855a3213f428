//! What the QEMU backends (`microvm`, `vm`) share: the accelerator decision of the node
//! ([`AccelProbe`]) and starting a QEMU inside its own cgroup and session
//! ([`spawn_in_cgroup`]).
use super::microvm::{probe_kvm, Accel};
use crate::cgroups::SandboxCgroup;
use crate::node::{NodeError, NodeResult};
use sandlot_guest::agent_proto::IdentityRequest;
use std::os::unix::process::CommandExt;
use std::path::Path;
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
/// a probe boot ([`probe_kvm`]) that runs in a background thread started by the first QEMU
/// backend built (node start is not held up). Logged once.
#[derive(Debug)]
pub struct AccelProbe {
    forced: Option<Accel>,
    started: AtomicBool,
    decided: watch::Sender<Option<Accel>>,
    why: Mutex<String>,
}

impl AccelProbe {
    /// A probe; `forced`: the configured accelerator (no probe boot then).
    pub fn new(forced: Option<Accel>) -> Arc<Self> {
        Arc::new(AccelProbe {
            forced,
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
            let (accel, why) = std::panic::catch_unwind(|| probe_kvm(&qemu, &kit, &initrd))
                .unwrap_or((Accel::Tcg, "the probe panicked".into()));
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

/// Starts `cmd` (a QEMU) in a session of its own (it outlives the node and is re-adopted)
/// and, before it runs, in the cgroup `cg` (its limits apply from its first instruction).
/// Returns the child; the caller reaps it.
///
/// # Errors
/// `Internal` when it cannot be started or put in the cgroup.
pub fn spawn_in_cgroup(
    cmd: &mut std::process::Command,
    cg: &SandboxCgroup,
) -> NodeResult<std::process::Child> {
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
    cmd.spawn()
        .map_err(|e| NodeError::io(format!("start {:?}", cmd.get_program()), e))
}

/// Starts QEMU's `cmd` with stdout and stderr into `dir/qemu.log` (appended when `append`,
/// e.g. a restore after a pause; truncated otherwise), in its own session and in the cgroup
/// `cg` ([`spawn_in_cgroup`]), and reaps it from a thread when it exits.
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
    let mut child = spawn_in_cgroup(cmd, cg)?;
    let pid = child.id() as i32;
    // QEMU is our child until this process ends: reap it when it exits.
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok((pid, super::function::proc_starttime(pid).unwrap_or(0)))
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
    let console = dir.join("console.log");
    let failed = data_dir.join("failed");
    let keep = failed.join(format!("{id}.console.log"));
    let _ = std::fs::copy(&console, &keep);
    super::microvm::prune_failed(&failed);
    let alive = super::function::proc_starttime(pid) == Some(starttime);
    NodeError::io(
        format!(
            "{what} did not become ready within {}s ({}; QEMU {}; {err}): console kept at {}; QEMU said: {}; console tail: {}",
            timeout.as_secs(),
            accel.as_str(),
            if alive { "still running" } else { "exited" },
            keep.display(),
            super::microvm::tail_of(&dir.join("qemu.log"), 400),
            super::microvm::tail_of(&console, 800)
        ),
        std::io::Error::other("boot failed"),
    )
}
