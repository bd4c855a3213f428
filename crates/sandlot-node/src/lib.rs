//! Sandlot node agent.
//!
//! A node runs sandboxes on one host. The server talks to it only through the [`Node`] trait
//! ([`LocalNode`] is the in-process implementation used by `sandlot up`; cluster mode adds a
//! transport, not a rewrite). Backends live in [`backends`], images in [`images`], cgroup
//! handling for v1 and v2 in [`cgroups`], background processes in [`processes`], network policies (veth, nftables, filtering DNS)
//! in [`net`] and [`dns`].
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod agent_client;
pub mod backends;
pub mod cgroups;
pub mod checkpoints;
pub mod dirlock;
pub mod disk;
pub mod dns;
pub mod files;
pub mod images;
pub mod liveness;
pub mod local;
pub mod mountinfo;
pub mod net;
pub mod net_audit;
pub mod node;
pub mod output;
pub mod ports;
pub mod processes;
pub mod qmp;
pub mod sys;

pub use images::validate_name as validate_image_name;
pub use images::validate_ref as validate_image_ref;
pub use liveness::Liveness;
pub use local::{default_agent_bin, default_guest_bin, LocalNode, NodeConfig};
pub use node::{
    ExecControl, ExecSink, Node, NodeError, NodeInfo, NodeResult, SandboxSpec, SandboxStatus,
    WarmPoolInfo,
};
pub use processes::WithProcesses;
