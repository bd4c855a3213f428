//! The accelerator QEMU runs guests with ([`Accel`]) and the KVM probe boot that picks it
//! (`probe_kvm`); decided once per node by [`super::AccelProbe`].
use super::{run_as, Jail};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// How long a KVM probe boot may take to reach init before the node falls back to TCG.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
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

/// Boots the guest kernel (`vmlinuz`) under KVM with `sandlot.probe`, QEMU confined to
/// `jail`'s uid and groups as every VM's is; KVM when the probe mark appears within
/// [`PROBE_TIMEOUT`], else TCG. Returns the choice and why.
pub(crate) fn probe_kvm(qemu: &Path, kit: &Path, initrd: &Path, jail: &Jail) -> (Accel, String) {
    use std::io::Read;
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return (Accel::Tcg, format!("/dev/kvm: {e}"));
    }
    let mut cmd = std::process::Command::new(qemu);
    run_as(&mut cmd, jail);
    let child = cmd
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
        // The bzImage, as the `vm` backend boots it: the decision is shared, and a host whose
        // KVM runs the PVH entry of `vmlinux` but not a bzImage's real-mode setup (the nested
        // KVM of ENVIRONMENT.md stops at "Probing EDD", a real-mode step) must not pick KVM
        // for `vm`.
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
