//! `POST /run_jupyter`, compatible with SandboxFusion's `/run_jupyter`
//! (bytedance/SandboxFusion: `RunJupyterRequest`, `RunJupyterResponse`, `CellRunResult`).
use crate::{CommandRunResult, RunStatus};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Request of `POST /run_jupyter`: cells run in order in one Python kernel. Unknown fields
/// are ignored, as SandboxFusion does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(non_snake_case)]
pub struct RunJupyterRequest {
    /// Code of each cell.
    pub cells: Vec<String>,
    /// Limit per cell in seconds; `0` (default) → only the total limit applies.
    #[serde(default)]
    pub cell_timeout: f64,
    /// Limit for all cells together in seconds (default 45).
    #[serde(default = "default_total")]
    pub total_timeout: f64,
    /// Memory limit in MB; `-1` (default) means the server default (1024).
    #[serde(default = "minus_one")]
    pub memory_limit_MB: i64,
    /// Kernel name; only `python3`.
    #[serde(default = "python3")]
    pub kernel: String,
    /// Extra files: path (relative to `/workspace`, or absolute) → base64 content.
    #[serde(default)]
    pub files: BTreeMap<String, Option<String>>,
    /// Paths whose content is returned base64 in `files` of the response.
    #[serde(default)]
    pub fetch_files: Vec<String>,
}

fn default_total() -> f64 {
    45.0
}

fn minus_one() -> i64 {
    -1
}

fn python3() -> String {
    "python3".into()
}

/// What one cell produced, in the kernel's own shapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellRunResult {
    /// Text the cell wrote to stdout.
    pub stdout: String,
    /// Text the cell wrote to stderr.
    pub stderr: String,
    /// One MIME bundle per `display_data` / `execute_result` (`text/plain`, `image/png`
    /// base64, `text/html`, ...).
    pub display: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Errors raised: `{"ename", "evalue", "traceback": [..]}`.
    pub error: Vec<serde_json::Map<String, serde_json::Value>>,
}

/// Response of `POST /run_jupyter` (HTTP 200 for every verdict, including `SandboxError`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunJupyterResponse {
    /// `Success` when every cell ran within its limits (a cell that raised still counts as
    /// run: its `error` says so, as SandboxFusion does); `Failed` on a time limit.
    pub status: RunStatus,
    /// Explanation for `Failed`/`SandboxError`, empty on success.
    pub message: String,
    /// The driver process that ran the kernel.
    pub driver: Option<CommandRunResult>,
    /// One result per cell run.
    pub cells: Vec<CellRunResult>,
    /// Name of the node that ran it.
    pub executor_pod_name: Option<String>,
    /// Fetched files: path → base64.
    pub files: BTreeMap<String, String>,
}
