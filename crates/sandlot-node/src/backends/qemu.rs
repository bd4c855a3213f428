//! What the QEMU backends (`microvm`, `vm`) share: the accelerator decision of the node
//! ([`AccelProbe`]) and starting a QEMU inside its own cgroup and session
//! ([`spawn_in_cgroup`]).
use super::microvm::{probe_kvm, Accel};
use crate::cgroups::SandboxCgroup;
use crate::node::{NodeError, NodeResult};
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
