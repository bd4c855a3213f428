//! Wire types of the Sandlot HTTP API v1.
//!
//! These are the JSON shapes of `docs/openapi.json` (served at `/openapi.json`) and of
//! `../shared/DESIGN.md` ("HTTP API v1"). The server, the node, the Rust client and the CLI
//! all use them, so a field changes in exactly one place. `run_code` follows SandboxFusion's
//! `/run_code` schema (bytedance/SandboxFusion, `sandbox/server/sandbox_api.py`).
#![deny(missing_docs)]

mod batch;
mod checkpoint;
mod error;
mod exec;
mod files;
mod network;
mod process;
mod run_code;
mod run_jupyter;
mod sandbox;
mod trajectory;

pub use batch::{BatchCreateRequest, BatchCreateResponse, BatchItem, MAX_BATCH};
pub use checkpoint::{Checkpoint, CheckpointList};
pub use error::{ApiError, ErrorBody, ErrorCode};
pub use exec::{
    check_timeout_s, text_and_b64, Cmd, ExecEvent, ExecRequest, ExecResult, Output, PtySize,
    Violation, MAX_TIMEOUT_S,
};
pub use files::{FileEntry, FileList, FileType};
pub use network::{AllowEntry, AllowPolicy, NetworkPolicy, MAX_ALLOW_ENTRIES};
pub use process::{
    Process, ProcessEvent, ProcessList, ProcessState, SignalName, SignalRequest, SpawnRequest,
    StreamName, FIRST_PROCESS_NUMBER, MAX_META_BYTES, MAX_TAG_BYTES, SIGNALS,
};
pub use run_code::{
    CommandRunResult, CommandRunStatus, RunCodeRequest, RunCodeResponse, RunStatus,
};
pub use run_jupyter::{CellRunResult, RunJupyterRequest, RunJupyterResponse};
pub use sandbox::{
    Backend, CreateSandboxRequest, KeepaliveRequest, RestoreMismatch, RestoreMode, RestoreReport,
    Sandbox, SandboxList, SandboxState, SandboxSummary, StateCount,
};
pub use trajectory::{LabelSelector, PauseFailure, PauseResult, TrajectoryInfo, TrajectoryStep};
