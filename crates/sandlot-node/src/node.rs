//! The server↔node boundary: the contract lives in the `sandlot-node-api` crate; this
//! module re-exports it for the node's own code.
pub use sandlot_node_api::{
    AgentExec, AgentExecs, ExecControl, ExecReattach, ExecSink, Node, NodeError, NodeInfo,
    NodeResult, SandboxSpec, SandboxStatus, WarmPoolInfo, WireError,
};
use std::path::PathBuf;

/// Host paths a node uses under its data directory.
#[derive(Debug, Clone)]
pub struct NodePaths {
    /// `DATA/images`: the image store.
    pub images: PathBuf,
    /// `DATA/sandboxes`: one directory per sandbox.
    pub sandboxes: PathBuf,
}
