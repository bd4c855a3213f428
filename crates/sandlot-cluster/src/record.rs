//! The membership record a node publishes in etcd.
use sandlot_api::Backend;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Amounts of a node's resources: its capacity, or what its sandboxes hold now.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Resources {
    /// CPU cores (for usage: the sum of the sandboxes' `cpu`).
    pub cpu: f64,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Number of sandboxes.
    pub sandboxes: u64,
}

/// What a node tells the cluster about itself: the JSON value of `/sandlot/nodes/<name>`.
///
/// Example (serde JSON, the wire format; fields absent on read take their defaults, so a
/// newer node's record with extra fields still decodes on an older server):
/// ```json
/// {"name":"node-1","advertise_url":"http://10.0.0.5:7070",
///  "capacity":{"cpu":32.0,"memory_mib":131072,"sandboxes":500},
///  "usage":{"cpu":2.0,"memory_mib":1024,"sandboxes":4},
///  "backends":["function","container"],"runtimes":["runc"],"accelerator":"kvm",
///  "cached_images":["127.0.0.1:5000/sandlot/python:latest"],
///  "cached_layers":["sha256:ab12..."],"labels":{"zone":"a"},"jobs":{"rl-7":3},
///  "started_at":"2026-12-04T04:00:00Z","simulated":false}
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeRecord {
    /// Node name, unique in the cluster; the last segment of its key (no `/`).
    pub name: String,
    /// URL at which servers reach the node API (e.g. `http://10.0.0.5:7070`).
    pub advertise_url: String,
    /// What the node offers to sandboxes.
    pub capacity: Resources,
    /// What its sandboxes hold now (updated by [`crate::NodeRegistration::update`]).
    pub usage: Resources,
    /// Backends the node can run.
    pub backends: Vec<Backend>,
    /// OCI runtimes of its `container` backend (`runc`, `runsc`, `crun`).
    pub runtimes: Vec<String>,
    /// Accelerator of its QEMU backends (`kvm`, `tcg`); `None` without one.
    pub accelerator: Option<String>,
    /// Image references in its image store (names as users give them).
    pub cached_images: Vec<String>,
    /// Digests (`sha256:<hex>`) of the image layers in its image store.
    pub cached_layers: BTreeSet<String>,
    /// Operator labels of the node (`zone=a`, ...).
    pub labels: BTreeMap<String, String>,
    /// Its live sandboxes per `job` label value (spread of a job across nodes).
    pub jobs: BTreeMap<String, u64>,
    /// When this node process started, RFC 3339 UTC (a restart shows as a new value).
    pub started_at: String,
    /// True for a node identity of `sandlot node --simulate` (issue 22): its sandboxes are
    /// in-memory records, its exec runs nothing. Absent in records of older nodes: `false`.
    pub simulated: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_without_simulated_is_a_real_node() {
        let old = r#"{"name":"n1","advertise_url":"http://10.0.0.5:7070","started_at":"x"}"#;
        let r: NodeRecord = serde_json::from_str(old).unwrap();
        assert!(!r.simulated);
        let sim = NodeRecord {
            name: "sim-000".into(),
            simulated: true,
            ..Default::default()
        };
        let back: NodeRecord = serde_json::from_str(&serde_json::to_string(&sim).unwrap()).unwrap();
        assert_eq!(back, sim);
        assert!(serde_json::to_string(&sim)
            .unwrap()
            .contains(r#""simulated":true"#));
    }
}
