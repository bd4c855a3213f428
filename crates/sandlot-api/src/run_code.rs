//! `POST /run_code`, compatible with SandboxFusion's `/run_code`
//! (bytedance/SandboxFusion: `RunCodeRequest`, `RunCodeResponse`, `CommandRunResult`).
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Request of `POST /run_code`. Unknown fields are ignored, as SandboxFusion does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(non_snake_case)]
pub struct RunCodeRequest {
    /// Source code.
    pub code: String,
    /// A language mode (`python`, `cpp`, `go`, `java`, ...; `GET /v1/run_code/languages`
    /// lists them); absent → `python`.
    #[serde(default = "python")]
    pub language: String,
    /// Compile limit in seconds (default 10).
    #[serde(default = "default_timeout")]
    pub compile_timeout: f64,
    /// Run limit in seconds (default 10).
    #[serde(default = "default_timeout")]
    pub run_timeout: f64,
    /// Memory limit in MB; `-1` (default) means the server default.
    #[serde(default = "minus_one")]
    pub memory_limit_MB: i64,
    /// Standard input as text.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Extra files: path (relative to the working directory, or absolute) → base64 content.
    #[serde(default)]
    pub files: BTreeMap<String, Option<String>>,
    /// Paths whose content is returned base64 in `files` of the response.
    #[serde(default)]
    pub fetch_files: Vec<String>,
}

fn default_timeout() -> f64 {
    10.0
}

fn python() -> String {
    "python".into()
}

fn minus_one() -> i64 {
    -1
}

/// Overall verdict of a `run_code` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunStatus {
    /// Compiled (if needed) and ran to exit code 0 within the limits.
    Success,
    /// Compile error, non-zero exit, or a time limit: the program's own failure.
    Failed,
    /// Sandlot itself failed; the program's verdict is unknown.
    SandboxError,
}

/// State of one command (compile or run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandRunStatus {
    /// The command ran and exited (any exit code).
    Finished,
    /// The command could not be run.
    Error,
    /// The command hit its time limit and was killed.
    TimeLimitExceeded,
}

/// Result of one command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandRunResult {
    /// State.
    pub status: CommandRunStatus,
    /// Wall-clock seconds.
    pub execution_time: Option<f64>,
    /// Exit code (128+n for signal n).
    pub return_code: Option<i32>,
    /// Stdout text.
    pub stdout: Option<String>,
    /// Stderr text.
    pub stderr: Option<String>,
}

/// Response of `POST /run_code` (HTTP 200 for every verdict, including `SandboxError`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunCodeResponse {
    /// Verdict.
    pub status: RunStatus,
    /// Explanation for `Failed`/`SandboxError`, empty on success.
    pub message: String,
    /// Compile step, for compiled languages.
    pub compile_result: Option<CommandRunResult>,
    /// Run step; absent when compilation failed.
    pub run_result: Option<CommandRunResult>,
    /// Name of the node that ran it (SandboxFusion's `executor_pod_name`).
    pub executor_pod_name: Option<String>,
    /// Fetched files: path → base64.
    pub files: BTreeMap<String, String>,
}
