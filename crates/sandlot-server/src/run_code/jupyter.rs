//! `POST /run_jupyter`, compatible with SandboxFusion's `/run_jupyter`
//! (bytedance/SandboxFusion `sandbox/server/sandbox_api.py`, `sandbox/runners/jupyter.py`;
//! shapes in [`sandlot_api::RunJupyterRequest`]).
//!
//! One call is one `run_code`-style run on the `lang-python` image (ipykernel and
//! jupyter_client are in it; there is no fallback image): the same admission gate, quota,
//! ephemeral sandbox, `files`/`fetch_files` handling and answer-at-delete-mark as
//! [`super::run_code`]. The program is a driver ([`DRIVER_PY`], written to
//! `/tmp/.sandlot-jupyter/driver.py`) that starts one kernel in `/workspace`, runs the cells
//! in order and writes every cell's stdout, stderr, `display` MIME bundles (`text/plain`,
//! `image/png` base64, `text/html`, ...) and `error`s (`ename`, `evalue`, `traceback`) to a
//! JSON file the server fetches and removes from `files`.
//!
//! Limits: `total_timeout` (default 45 s) for all cells, `cell_timeout` (> 0) per cell; the
//! driver process itself gets `total_timeout + 15` s (kernel start). Output: each cell's
//! stdout and stderr keep their first 1 MiB characters, MIME bundles 32 Mi characters over
//! all cells (a cut is noted at the end of the cell's stderr). Memory:
//! `memory_limit_MB` as `run_code`, default 1024 MiB.
//!
//! Verdicts: every cell ran (a cell that raised counts as run; its `error` says so) →
//! `Success`; a cell over its limit → `Failed`, the cells so far (the last one with a
//! `TimeoutError` error) and message `cell time limit exceeded`; a kernel that dies in a cell
//! (`os._exit`, a segfault, the OOM killer) → `Failed` at once, the cells so far (the last one
//! with a `DeadKernelError` error) and message `the kernel died`; the driver over its own limit
//! → `Failed`, no cells; the driver dying without its answer after its kernel started (a cell
//! killed it) → `Failed`, no cells, message `the jupyter driver died while running the cells
//! (exit code N)`; `lang-python` missing, or the driver dying before its kernel answered →
//! HTTP 200 `SandboxError` with the reason. Bad input (not JSON,
//! `cells` missing, `kernel` other than `python3`, bad base64, a timeout out of range) →
//! HTTP 400 `invalid_argument`.
use super::languages::{ClassFrom, Language, Layout};
use super::{execute, sandbox_error, sandbox_path, Plan};
use crate::auth::Principal;
use crate::error::{ApiResult, Json, ServerError};
use crate::SharedState;
use axum::extract::State;
use axum::Extension;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use sandlot_api::{
    CellRunResult, RunCodeRequest, RunJupyterRequest, RunJupyterResponse, RunStatus,
};

/// The driver program (Python, run with `python3 driver.py INPUT OUTPUT`).
pub const DRIVER_PY: &str = include_str!("jupyter_driver.py");

const INPUT: &str = "/tmp/.sandlot-jupyter/input.json";
const OUTPUT: &str = "/tmp/.sandlot-jupyter/output.json";

/// The driver as a language row: the generic executor runs it like any program.
static DRIVER: Language = Language {
    name: "jupyter",
    aliases: &[],
    image: "lang-python",
    fallback_image: None,
    file: "/tmp/.sandlot-jupyter/driver.py",
    compile: None,
    run: &["python3", "{file}", INPUT, OUTPUT],
    env: &[
        ("JUPYTER_RUNTIME_DIR", "/tmp/.sandlot-jupyter/runtime"),
        ("MPLCONFIGDIR", "/tmp/.sandlot-jupyter/mpl"),
        ("PYDEVD_DISABLE_FILE_VALIDATION", "1"),
    ],
    layout: Layout::Program,
    class_from: ClassFrom::None,
    memory_mib: 1024,
    php_tag: false,
    prelude: "",
    support: &[],
};

/// Seconds the driver gets beyond `total_timeout` (kernel start and shutdown).
const DRIVER_SLACK_S: f64 = 15.0;

#[derive(serde::Deserialize)]
struct DriverOutput {
    status: String,
    cells: Vec<CellRunResult>,
}

fn plan(req: &RunJupyterRequest) -> Result<(RunCodeRequest, Plan), String> {
    if req.kernel != "python3" {
        return Err(format!(
            "kernel {:?} is not supported; only \"python3\"",
            req.kernel
        ));
    }
    sandlot_api::check_timeout_s("total_timeout", req.total_timeout)?;
    if req.cell_timeout != 0.0 {
        sandlot_api::check_timeout_s("cell_timeout", req.cell_timeout)?;
    }
    // `/etc/hosts` as every run_code call's (see `super::ETC_HOSTS`).
    let mut files = vec![(
        "/etc/hosts".to_owned(),
        super::ETC_HOSTS.as_bytes().to_vec(),
    )];
    for (path, content) in &req.files {
        let Some(content) = content else { continue };
        let data = B64
            .decode(content)
            .map_err(|e| format!("files[{path:?}] is not valid base64: {e}"))?;
        files.push((sandbox_path(path), data));
    }
    let input = serde_json::json!({
        "kernel": req.kernel,
        "cells": req.cells,
        "cell_timeout": req.cell_timeout,
        "total_timeout": req.total_timeout,
    });
    files.push((INPUT.to_string(), input.to_string().into_bytes()));
    files.push((DRIVER.file.to_string(), DRIVER_PY.as_bytes().to_vec()));
    let mut fetch_files = req.fetch_files.clone();
    fetch_files.push(OUTPUT.to_string());
    let run = RunCodeRequest {
        code: DRIVER_PY.to_string(),
        language: DRIVER.name.to_string(),
        compile_timeout: 10.0,
        run_timeout: req.total_timeout + DRIVER_SLACK_S,
        memory_limit_MB: req.memory_limit_MB,
        stdin: None,
        files: Default::default(),
        fetch_files,
    };
    Ok((
        run,
        Plan {
            lang: &DRIVER,
            files,
        },
    ))
}

/// `POST /run_jupyter` → [`RunJupyterResponse`] (see module docs for statuses).
pub async fn run_jupyter(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Json(req): Json<RunJupyterRequest>,
) -> ApiResult<Json<RunJupyterResponse>> {
    let (run, plan) = plan(&req).map_err(ServerError::invalid)?;
    let permit = match st.run_code_gate.admit(st.cfg.run_code_wait).await {
        Ok(p) => p,
        Err(e) => {
            st.metrics.run_code_done("Rejected");
            return Err(e);
        }
    };
    let st2 = st.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _permit = permit;
        execute(&st2, &who, run, plan, tx).await
    });
    let resp = match rx.await {
        Ok(Ok(resp)) => resp,
        Ok(Err(quota)) => {
            st.metrics.run_code_done("Rejected");
            return Err(quota);
        }
        Err(_) => sandbox_error(&st, "run_jupyter task failed before answering".into()),
    };
    let mut files = resp.files;
    let output = files.remove(OUTPUT);
    let mut out = RunJupyterResponse {
        status: resp.status,
        message: resp.message,
        driver: resp.run_result,
        cells: Vec::new(),
        executor_pod_name: resp.executor_pod_name,
        files,
    };
    if out.status != RunStatus::SandboxError {
        // SECURITY (reward hacking): OUTPUT is trusted only from a driver that exited 0; the
        // driver kills every other process of the sandbox before it writes OUTPUT, so a file
        // a cell left there (and then killed the driver) or rewrote later is never read.
        let driver_ok = out.driver.as_ref().is_some_and(|d| {
            d.status == sandlot_api::CommandRunStatus::Finished && d.return_code == Some(0)
        });
        let parsed = output
            .as_deref()
            .filter(|_| driver_ok)
            .and_then(|b| B64.decode(b).ok())
            .and_then(|b| serde_json::from_slice::<DriverOutput>(&b).ok());
        let driver_tle = out
            .driver
            .as_ref()
            .is_some_and(|d| d.status == sandlot_api::CommandRunStatus::TimeLimitExceeded);
        match parsed {
            Some(o) if o.status == "Finished" => {
                out.status = RunStatus::Success;
                out.message.clear();
                out.cells = o.cells;
            }
            Some(o) => {
                out.status = RunStatus::Failed;
                out.message = if o.status == "KernelDied" {
                    "the kernel died".into()
                } else {
                    "cell time limit exceeded".into()
                };
                out.cells = o.cells;
            }
            None if driver_tle => {
                out.status = RunStatus::Failed;
                out.message = format!(
                    "total time limit exceeded (driver killed after {} s)",
                    req.total_timeout + DRIVER_SLACK_S
                );
            }
            None if driver_saw_kernel_ready(&out) => {
                // SECURITY (reward hacking): the kernel was up, so the driver died at the
                // cells' hands (`os.kill(os.getppid(), 9)`): the program's failure, not
                // SandboxError (which trainers retry).
                let code = out.driver.as_ref().and_then(|d| d.return_code);
                out.status = RunStatus::Failed;
                out.message = format!(
                    "the jupyter driver died while running the cells (exit code {})",
                    code.map_or("unknown".into(), |c| c.to_string())
                );
            }
            None => {
                let stderr = out
                    .driver
                    .as_ref()
                    .and_then(|d| d.stderr.as_deref())
                    .unwrap_or("");
                let tail: String = {
                    let chars: Vec<char> = stderr.chars().collect();
                    chars[chars.len().saturating_sub(2000)..].iter().collect()
                };
                out.status = RunStatus::SandboxError;
                out.message = format!("jupyter driver ended without an answer: {tail}");
            }
        }
    }
    let status = serde_json::to_value(out.status).unwrap_or_default();
    st.metrics
        .run_code_done(status.as_str().unwrap_or("SandboxError"));
    Ok(Json(out))
}

/// The line the driver prints once its kernel answers (`jupyter_driver.py` KERNEL_READY).
const KERNEL_READY: &str = "sandlot-jupyter: kernel ready";

/// Whether the driver got as far as a running kernel (its stdout has [`KERNEL_READY`]).
fn driver_saw_kernel_ready(out: &RunJupyterResponse) -> bool {
    out.driver
        .as_ref()
        .and_then(|d| d.stdout.as_deref())
        .is_some_and(|s| s.lines().any(|l| l == KERNEL_READY))
}
