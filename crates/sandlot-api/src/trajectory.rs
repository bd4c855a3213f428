//! Trajectory log and job-level pause/resume shapes.
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `GET /v1/trajectories/{id}` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrajectoryInfo {
    /// Trajectory id.
    pub id: String,
    /// Live (creating, running or paused) sandbox bound to it, if any.
    pub sandbox_id: Option<String>,
    /// Step number the next new call must carry (= number of logged steps).
    pub next_step: u64,
    /// Logged steps in order.
    pub steps: Vec<TrajectoryStep>,
    /// Sum of `replay_count` over all steps.
    pub replayed_total: u64,
}

/// One logged step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrajectoryStep {
    /// Step number, from 0.
    pub step: u64,
    /// `exec`, `write_file`, `remove_file`, `read_file` or `list_dir`.
    pub kind: String,
    /// Hex SHA-256 of the canonical JSON of the request.
    pub digest: String,
    /// Exit code (exec only, else `null`).
    pub exit_code: Option<i32>,
    /// When it was logged, RFC 3339 UTC.
    pub created_at: String,
    /// How many times it came back from the log.
    pub replay_count: u64,
}

/// `POST /v1/sandboxes:pause` and `:resume` body: sandboxes whose labels contain every
/// pair (at least one pair).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelSelector {
    /// Labels that must all match.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// `POST /v1/sandboxes:pause` and `:resume` answer.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PauseResult {
    /// Ids paused (or resumed) by this call, sorted.
    pub sandboxes: Vec<String>,
    /// Matching sandboxes the node failed to pause (or resume), with the error; absent
    /// when empty. They keep their previous state.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<PauseFailure>,
}

/// A sandbox that could not be paused or resumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseFailure {
    /// Sandbox id.
    pub id: String,
    /// The node's error.
    pub error: crate::ApiError,
}
