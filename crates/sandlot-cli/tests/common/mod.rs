//! Shared by the tests that run `sandlot node` as a process (node.rs, node_etcd.rs).
#![allow(dead_code)] // each test crate uses its own part

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// The `sandlot` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_sandlot");

/// The node process; SIGTERM and wait on drop, then its cgroup parents go.
pub struct Proc(pub Child, pub PathBuf);

impl Proc {
    pub fn term(&mut self) -> std::process::ExitStatus {
        if let Ok(Some(done)) = self.0.try_wait() {
            return done;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        self.0.wait().unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.term();
        let parent = sandlot_node::local::default_cgroup_parent(&self.1);
        if let Ok(root) = sandlot_node::cgroups::CgroupRoot::detect() {
            for suffix in ["", "-ctr", "-q35", "-vm"] {
                let _ = root
                    .clone()
                    .with_parent(&format!("{parent}{suffix}"))
                    .remove_parent();
            }
        }
    }
}

/// Why this host cannot run a `function` sandbox through the node, if it cannot.
pub fn cannot_run(images: &Path) -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("needs root (namespaces, cgroups)".into());
    }
    let guest = Path::new(BIN).with_file_name("sandlot-guest");
    if std::env::var_os("SANDLOT_GUEST_BIN").is_none() && !guest.exists() {
        return Some(format!(
            "{} missing; run `cargo build -p sandlot-guest`",
            guest.display()
        ));
    }
    let out = Command::new(BIN)
        .args(["image", "build", "busybox", "--images-dir"])
        .arg(images)
        .output()
        .unwrap();
    if !out.status.success() {
        return Some(format!(
            "cannot build the busybox image: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    None
}
