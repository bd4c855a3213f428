//! The node ↔ `sandlot-guest` contract for the `function` backend.
//!
//! The node starts `sandlot-guest init` to build a sandbox (namespaces, overlay rootfs,
//! pivot_root, user namespace) whose pid 1 is a small reaper, and `sandlot-guest exec` for
//! each command (join the namespaces of that pid 1, drop privileges, apply seccomp and
//! landlock, execve). The JSON shapes below are the whole protocol between the two.
#![deny(missing_docs)]

pub mod agent_proto;
pub mod exec_table;
pub mod layers;
pub mod procview;
pub mod sandbox_fs;
pub mod spec;
pub mod syscalls;
pub mod vm_net;
