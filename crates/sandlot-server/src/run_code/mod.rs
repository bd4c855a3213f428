//! `POST /run_code`, compatible with SandboxFusion's `/run_code`
//! (bytedance/SandboxFusion `sandbox/server/sandbox_api.py`; shapes in
//! [`sandlot_api::RunCodeRequest`]).
//!
//! Each call creates an ephemeral `function` sandbox on the language's toolchain image
//! (memory `memory_limit_MB` clamped to 16–65536 when > 0, else the language's default; TTL
//! = compile timeout plus run timeout plus 120 s, a safety net should this process die
//! mid-call; label `sandlot.kind=run_code`), writes `files` (base64) and the code to
//! `/workspace`, compiles and runs it, fetches `fetch_files`, marks the sandbox `deleting`
//! (which frees the caller's quota at once) and answers; the node delete finishes after the
//! answer, with the call's admission slot held until it has. The work runs in its own task,
//! so a client disconnect still ends in cleanup. The toolchain images of
//! `sandlot up --run-code-pool-images` (default `lang-python,lang-cpp,lang-java`) have
//! ready jails in the function warm pool, so such a call only hands one over.
//!
//! Languages are data: [`languages::LANGUAGES`] holds one row per SandboxFusion mode (file,
//! compile and run argv, image, default memory, test-style layout), listed by
//! `GET /v1/run_code/languages` ([`list_languages`]). `language` absent → `python`. An
//! unknown language is HTTP 400; a known one whose image is not installed is HTTP 200
//! `SandboxError` `toolchain image lang-<x> is not installed (sandlot image build lang-<x>)`.
//! `python`, `bash`, `cpp` and `perl` fall back to the base `python` image (python3, g++,
//! bash, perl) when their `lang-*` image is absent.
//!
//! Verdicts as SandboxFusion (test-style modes: the test runner's exit code): compile exit ≠ 0 → `Failed`, `compile_result` `Finished`, no
//! `run_result`; compile timeout → `Failed`, `compile_result` `TimeLimitExceeded`; run exit 0
//! → `Success`; exit ≠ 0 → `Failed` (`run_result` `Finished`); run timeout → `Failed`
//! (`run_result` `TimeLimitExceeded`). `execution_time` is in seconds.
//!
//! Error policy: a request that can never succeed — not JSON, `code`/`language` missing, an
//! unknown language, bad base64 in `files`, a timeout out of (0, 86400] — is HTTP 400
//! `invalid_argument` before any sandbox exists (SandboxFusion answers such requests with
//! a 4xx validation error too). Every infrastructure failure after that is **HTTP 200 with
//! `status: SandboxError`** and a message, never a silent `Failed`. Overload: at most `run_code_concurrency` calls run at once; up to
//! `run_code_queue` more wait at most `run_code_wait`. A full queue answers 429
//! `resource_exhausted` at once, a wait that timed out 504 `deadline_exceeded`; both carry
//! `Retry-After: 1`. Paths in `files`/`fetch_files` are relative to `/workspace` unless
//! absolute; fetch paths that do not exist are left out of `files`, as SandboxFusion does.
//! Fetch paths the program made unreadable (a directory, FIFO, device, a link into `/proc`,
//! a file over `max_file_bytes`) or past the per-call total `run_code_fetch_bytes` are left
//! out too and named in `message`; the verdict stays the run's (never `SandboxError`, which
//! is for infrastructure failures only).
//!
//! Tenants ([`crate::auth`]): the ephemeral sandbox belongs to the caller's API key and
//! counts against its quota while it exists; a full quota answers HTTP 429
//! `resource_exhausted` with `Retry-After: 1` (no sandbox made), not a `SandboxError`.
use crate::auth::Principal;
use crate::error::{ApiResult, Json, ServerError};
use crate::sandboxes::{create_sandbox, start_delete};
use crate::SharedState;
use axum::extract::State;
use axum::Extension;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use sandlot_api::{
    ApiError, Cmd, CommandRunResult, CommandRunStatus, CreateSandboxRequest, ErrorCode,
    ExecRequest, ExecResult, RunCodeRequest, RunCodeResponse, RunStatus,
};
use sandlot_node_api::{NodeError, DEFAULT_MAX_OUTPUT};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Admission control: a semaphore of running slots plus a bounded count of waiters.
pub struct Gate {
    sem: Arc<Semaphore>,
    slots: usize,
    queue: usize,
    waiting: AtomicUsize,
}

struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Gate {
    /// `slots` calls at once, `queue` waiting.
    pub fn new(slots: usize, queue: usize) -> Self {
        Gate {
            sem: Arc::new(Semaphore::new(slots)),
            slots,
            queue,
            waiting: AtomicUsize::new(0),
        }
    }

    /// `(running, waiting)` right now.
    pub fn load(&self) -> (usize, usize) {
        (
            self.slots - self.sem.available_permits(),
            self.waiting.load(Ordering::SeqCst),
        )
    }

    /// A running slot, waiting at most `wait`.
    ///
    /// # Errors
    /// 429 `resource_exhausted` when the queue is full; 504 `deadline_exceeded` after
    /// `wait`; both with `Retry-After: 1`.
    pub async fn admit(&self, wait: Duration) -> ApiResult<OwnedSemaphorePermit> {
        if let Ok(p) = self.sem.clone().try_acquire_owned() {
            return Ok(p);
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ServerError::RetryAfter {
                error: ApiError::new(
                    ErrorCode::ResourceExhausted,
                    format!(
                        "run_code overloaded: {} running, {} waiting",
                        self.slots, self.queue
                    ),
                ),
                seconds: 1,
            });
        }
        let _w = Waiting(&self.waiting);
        match tokio::time::timeout(wait, self.sem.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(_)) => Err(ServerError::new(
                ErrorCode::Unavailable,
                "server shutting down",
            )),
            Err(_) => Err(ServerError::RetryAfter {
                error: ApiError::new(
                    ErrorCode::DeadlineExceeded,
                    format!("no run_code slot free within {wait:?}"),
                ),
                seconds: 1,
            }),
        }
    }
}

/// `POST /run_code` → `RunCodeResponse` (see module docs for statuses).
pub async fn run_code(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Json(req): Json<RunCodeRequest>,
) -> ApiResult<Json<RunCodeResponse>> {
    let plan = plan(&req).map_err(ServerError::invalid)?;
    let arrived = std::time::Instant::now();
    let permit = match st.run_code_gate.admit(st.cfg.run_code_wait).await {
        Ok(p) => {
            tracing::debug!(
                wait_ms = arrived.elapsed().as_millis() as u64,
                "run_code: admitted"
            );
            p
        }
        Err(e) => {
            st.metrics.run_code_done("Rejected");
            return Err(e);
        }
    };
    let st2 = st.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    // The task deletes the sandbox and then answers through `tx`, holding the admission
    // permit throughout; a client that disconnects does not stop the cleanup.
    tokio::spawn(async move {
        let _permit = permit;
        execute(&st2, &who, req, plan, tx).await
    });
    let resp = match rx.await {
        Ok(Ok(resp)) => resp,
        Ok(Err(quota)) => {
            st.metrics.run_code_done("Rejected");
            return Err(quota);
        }
        Err(_) => sandbox_error(&st, "run_code task failed before answering".into()),
    };
    let status = serde_json::to_value(resp.status).unwrap_or_default();
    st.metrics
        .run_code_done(status.as_str().unwrap_or("SandboxError"));
    Ok(Json(resp))
}

fn sandbox_error(st: &SharedState, message: String) -> RunCodeResponse {
    RunCodeResponse {
        status: RunStatus::SandboxError,
        message,
        compile_result: None,
        run_result: None,
        executor_pod_name: Some(st.node_name.clone()),
        files: BTreeMap::new(),
    }
}

pub mod jupyter;
pub mod languages;

use languages::Language;

struct Plan {
    lang: &'static Language,
    files: Vec<(String, Vec<u8>)>,
}

/// Whether image `name` is in the node's image store (`true` when the server was started
/// without an image store to look at; the create then reports a missing image itself).
fn installed(st: &SharedState, name: &str) -> bool {
    match &st.cfg.images_dir {
        Some(dir) => dir.join(name).join("image.json").is_file(),
        None => true,
    }
}

/// The image `lang` runs on: its own, else its fallback, else the `SandboxError` message.
fn image_for(st: &SharedState, lang: &Language) -> Result<&'static str, String> {
    if st.cfg.images_dir.is_none() {
        // No store to look at (a node without images, e.g. a test double): the create
        // reports a missing image itself.
        return Ok(lang.fallback_image.unwrap_or(lang.image));
    }
    if installed(st, lang.image) {
        return Ok(lang.image);
    }
    match lang.fallback_image {
        Some(f) if installed(st, f) => Ok(f),
        _ => Err(format!(
            "toolchain image {0} is not installed (sandlot image build {0})",
            lang.image
        )),
    }
}

/// One row of `GET /v1/run_code/languages`.
#[derive(Debug, serde::Serialize)]
pub struct LanguageInfo {
    /// Mode name (`python`, `go_test`, ...).
    pub language: &'static str,
    /// Other accepted names.
    pub aliases: &'static [&'static str],
    /// The image a call runs on now (the fallback when the own image is absent).
    pub image: &'static str,
    /// Source file name in `/workspace` for code that declares no class (Java `junit`
    /// and Scala use the declared class name instead of `Main`).
    pub file: String,
    /// Compile argv as run for that file, or null.
    pub compile: Option<Vec<String>>,
    /// Run argv as run for that file.
    pub run: Vec<String>,
    /// Environment over the image's.
    pub env: BTreeMap<&'static str, &'static str>,
    /// `program` or `tests` (Success = every test passes).
    pub layout: languages::Layout,
    /// Default memory limit in MiB.
    pub memory_mib: u64,
    /// Whether the image is installed on this node.
    pub installed: bool,
}

/// `GET /v1/run_code/languages` → `{"languages": [LanguageInfo]}`, in table order.
pub async fn list_languages(State(st): State<SharedState>) -> Json<serde_json::Value> {
    let rows: Vec<LanguageInfo> = languages::LANGUAGES
        .iter()
        .map(|l| {
            let image = image_for(&st, l);
            LanguageInfo {
                language: l.name,
                aliases: l.aliases,
                image: image.as_ref().copied().unwrap_or(l.image),
                file: l.file_name(""),
                compile: l.compile.map(|c| l.expand(c, "")),
                run: l.expand(l.run, ""),
                env: l.env.iter().copied().collect(),
                layout: l.layout,
                memory_mib: l.memory_mib,
                installed: image.is_ok(),
            }
        })
        .collect();
    Json(serde_json::json!({ "languages": rows }))
}

const WORKDIR: &str = "/workspace";

/// `/etc/hosts` of every `run_code` sandbox: `localhost` on the loopback addresses, as in
/// SandboxFusion's runner (its programs reach their own servers at `localhost`).
const ETC_HOSTS: &str = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";

fn sandbox_path(p: &str) -> String {
    if p.starts_with('/') {
        p.to_owned()
    } else {
        format!("{WORKDIR}/{p}")
    }
}

fn plan(req: &RunCodeRequest) -> Result<Plan, String> {
    let Some(lang) = languages::find(&req.language) else {
        return Err(format!(
            "unsupported language {:?}; supported: {}",
            req.language,
            languages::names().join(", ")
        ));
    };
    sandlot_api::check_timeout_s("compile_timeout", req.compile_timeout)?;
    sandlot_api::check_timeout_s("run_timeout", req.run_timeout)?;
    // Per-call setup first, so the request's own `files` may replace it: `/etc/hosts`
    // (images have none, so `localhost` did not resolve), then the row's support files.
    let mut files = vec![("/etc/hosts".to_owned(), ETC_HOSTS.as_bytes().to_vec())];
    files.extend(
        lang.support
            .iter()
            .map(|(p, c)| ((*p).to_owned(), c.as_bytes().to_vec())),
    );
    for (path, content) in &req.files {
        let Some(content) = content else { continue };
        let data = B64
            .decode(content)
            .map_err(|e| format!("files[{path:?}] is not valid base64: {e}"))?;
        files.push((sandbox_path(path), data));
    }
    let main = lang.file_name(&req.code);
    files.push((sandbox_path(&main), lang.source(&req.code).into_bytes()));
    Ok(Plan { lang, files })
}

fn command_result(r: &ExecResult) -> CommandRunResult {
    CommandRunResult {
        status: if r.timed_out {
            CommandRunStatus::TimeLimitExceeded
        } else {
            CommandRunStatus::Finished
        },
        execution_time: Some(r.duration_ms / 1000.0),
        return_code: Some(r.exit_code),
        stdout: Some(r.stdout.clone()),
        stderr: Some(r.stderr.clone()),
    }
}

fn exec_req(lang: &Language, cmd: Cmd, timeout: f64, stdin: Option<&str>) -> ExecRequest {
    let mut e = ExecRequest::new(cmd);
    e.env = lang
        .env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    e.cwd = Some(WORKDIR.into());
    e.timeout_s = Some(timeout);
    // Empty stdin is sent as none (the program reads EOF from /dev/null instead of an empty
    // pipe), so the exec may take a pooled jail's standby helper, which has no stdin pipe.
    e.stdin_b64 = stdin
        .filter(|s| !s.is_empty())
        .map(|s| B64.encode(s.as_bytes()));
    e
}

/// Run one `run_code` request to its response (never an `Err`: infrastructure failures
/// become `SandboxError`). Creates and always deletes one sandbox.
///
/// The response goes to `answer` once the sandbox is marked `deleting`, so it no longer
/// counts against the caller's quota when the answer arrives; the node delete finishes
/// after the answer (the admission permit is held until then). A failed delete is left to
/// the reaper (the sandbox is `deleting`).
async fn execute(
    st: &SharedState,
    who: &Principal,
    req: RunCodeRequest,
    plan: Plan,
    answer: tokio::sync::oneshot::Sender<ApiResult<RunCodeResponse>>,
) {
    let image = match image_for(st, plan.lang) {
        Ok(i) => i,
        Err(m) => {
            let _ = answer.send(Ok(sandbox_error(st, m)));
            return;
        }
    };
    let memory_mib = if req.memory_limit_MB > 0 {
        (req.memory_limit_MB as u64).clamp(16, 65536)
    } else {
        plan.lang.memory_mib
    };
    let ttl = (req.compile_timeout + req.run_timeout).ceil() as u64 + 120;
    let cpu = match who.quota.as_ref().and_then(|q| q.max_cpu) {
        Some(_) => st.cfg.run_code_cpu.min(1.0),
        None => st.cfg.run_code_cpu,
    };
    let create = CreateSandboxRequest {
        image: Some(image.into()),
        cpu: Some(cpu),
        memory_mib: Some(memory_mib),
        ttl_s: Some(ttl.min(crate::sandboxes::MAX_TTL_S)),
        ..Default::default()
    };
    let labels = BTreeMap::from([("sandlot.kind".to_string(), "run_code".to_string())]);
    let started = std::time::Instant::now();
    let id = match create_sandbox(st, who, create, labels, None).await {
        Ok((rec, _)) => rec.id,
        // The caller's quota is full: HTTP 429, to be retried, not a verdict on the code.
        Err(e @ ServerError::RetryAfter { .. }) => {
            let _ = answer.send(Err(e));
            return;
        }
        Err(e) => {
            let _ = answer.send(Ok(sandbox_error(
                st,
                format!("create sandbox: {}", e.api_error()),
            )));
            return;
        }
    };
    // Budget shares of the fetched files, kept until the answer is handed over.
    let mut held = Vec::new();
    let created = started.elapsed();
    let out = run_in(st, &id, &req, plan, &mut held).await;
    let ran = started.elapsed();
    // Answer once the sandbox is marked `deleting` (its quota is free from that mark), and
    // finish the node delete afterwards, still holding the admission permit so that at most
    // `run_code_concurrency` sandboxes exist for run_code at once.
    let task = match start_delete(st, &id).await {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(sandbox_id = %id, error = %crate::error::chain(&e), "run_code: marking for delete failed; the TTL reaper removes it");
            None
        }
    };
    let _ = answer.send(Ok(match out {
        Ok(r) => r,
        Err(e) => sandbox_error(st, e.to_string()),
    }));
    drop(held);
    let done = match task {
        Some(t) => t.await.unwrap_or_else(|e| {
            Err(ServerError::new(
                ErrorCode::Internal,
                format!("delete task failed: {e}"),
            ))
        }),
        None => Ok(()),
    };
    if let Err(e) = done {
        tracing::warn!(sandbox_id = %id, error = %crate::error::chain(&e), "run_code: delete failed; the reaper retries");
    }
    // Where a call's wall time goes (the admission slot is held through all three).
    tracing::debug!(
        sandbox_id = %id,
        create_ms = created.as_millis() as u64,
        run_ms = (ran - created).as_millis() as u64,
        delete_ms = (started.elapsed() - ran).as_millis() as u64,
        "run_code: done"
    );
}

/// An exec on the node with its audit event and latency observation.
async fn observed_exec(
    st: &SharedState,
    id: &str,
    r: ExecRequest,
    held: &mut Vec<tokio::sync::OwnedSemaphorePermit>,
) -> Result<ExecResult, NodeError> {
    let info = crate::events::ExecInfo::new(id, sandlot_api::Backend::Function, &r, "run_code");
    let started = std::time::Instant::now();
    // The output budget share is kept with the answer, as fetched files' shares are.
    let out = match st.budget_node.exec_held(id, &r, None).await {
        Ok((res, share)) => {
            held.extend(share);
            Ok(res)
        }
        Err(e) => Err(e),
    };
    let secs = started.elapsed().as_secs_f64();
    let ev = match &out {
        Ok(res) => Ok(res),
        Err(e) => Err(ApiError::new(e.code(), e.to_string())),
    };
    crate::events::exec_event(st, info, ev, false, secs);
    out
}

async fn run_in(
    st: &SharedState,
    id: &str,
    req: &RunCodeRequest,
    plan: Plan,
    held: &mut Vec<tokio::sync::OwnedSemaphorePermit>,
) -> Result<RunCodeResponse, NodeError> {
    // Not fsynced: the sandbox never outlives a crash of this process.
    let files = plan.files.into_iter().map(|(p, d)| (p, d.into())).collect();
    st.node.write_files_volatile(id, files).await?;
    let mut resp = RunCodeResponse {
        status: RunStatus::Success,
        message: String::new(),
        compile_result: None,
        run_result: None,
        executor_pod_name: Some(st.node_name.clone()),
        files: BTreeMap::new(),
    };
    let lang = plan.lang;
    if let Some(compile) = lang.compile {
        let compile = Cmd::Argv(lang.expand(compile, &req.code));
        let c = observed_exec(
            st,
            id,
            exec_req(lang, compile, req.compile_timeout, None),
            held,
        )
        .await?;
        resp.compile_result = Some(command_result(&c));
        if c.timed_out || c.exit_code != 0 {
            resp.status = RunStatus::Failed;
            resp.message = if c.timed_out {
                "compile time limit exceeded".into()
            } else {
                format!("compilation failed with exit code {}", c.exit_code)
            };
            add_note(&mut resp.message, truncation_note("compile", &c));
            return Ok(resp);
        }
    }
    let run_cmd = Cmd::Argv(lang.expand(lang.run, &req.code));
    let r = observed_exec(
        st,
        id,
        exec_req(lang, run_cmd, req.run_timeout, req.stdin.as_deref()),
        held,
    )
    .await?;
    resp.run_result = Some(command_result(&r));
    if r.timed_out {
        resp.status = RunStatus::Failed;
        resp.message = "run time limit exceeded".into();
    } else if r.exit_code != 0 {
        resp.status = RunStatus::Failed;
        resp.message = format!("program exited with code {}", r.exit_code);
    }
    add_note(&mut resp.message, truncation_note("run", &r));
    // SECURITY (reward hacking): the program controls what the fetched paths are — a
    // symlink into /proc, a FIFO, a directory, a huge sparse file. Such a path is the
    // program's doing: it is left out of `files` and the verdict stays what the run decided.
    // Only infrastructure failures (Internal, Unavailable, ...) turn into SandboxError, which
    // trainers treat as "retry", so a program cannot launder its own failure into one.
    let mut left = st.cfg.run_code_fetch_bytes;
    let mut left_out = Vec::new();
    for path in &req.fetch_files {
        let max = (st.cfg.max_file_bytes as u64).min(left);
        match st
            .budget_node
            .read_file_held(id, &sandbox_path(path), max)
            .await
        {
            Ok((data, permit)) => {
                held.push(permit);
                left -= data.len() as u64;
                resp.files.insert(path.clone(), B64.encode(data));
            }
            // Missing files are left out silently, as SandboxFusion does.
            Err(NodeError::NotFound(_)) => {}
            Err(NodeError::InvalidArgument(m)) => {
                let over_total = max < st.cfg.max_file_bytes as u64
                    && st
                        .node
                        .file_size(id, &sandbox_path(path))
                        .await
                        .is_ok_and(|n| n > max);
                let why = if over_total {
                    format!(
                        "{m} (fetch_files returns at most {} bytes per call)",
                        st.cfg.run_code_fetch_bytes
                    )
                } else {
                    m
                };
                left_out.push(format!("{path:?}: {why}"));
            }
            Err(e) => return Err(e),
        }
    }
    if !left_out.is_empty() {
        let note = format!("fetch_files left out {}", left_out.join("; "));
        add_note(&mut resp.message, Some(note));
    }
    Ok(resp)
}

/// Appends `note` to a response's `message` (`; ` between parts).
fn add_note(message: &mut String, note: Option<String>) {
    if let Some(note) = note {
        if !message.is_empty() {
            message.push_str("; ");
        }
        message.push_str(&note);
    }
}

/// The note that says a stage's output was cut by the exec's head+tail cap
/// ([`DEFAULT_MAX_OUTPUT`] per stream; the middle is dropped without a marker in the text),
/// e.g. `run stdout truncated: 3145728 bytes written, the first and last 512 KiB kept`;
/// `None` when nothing was cut.
fn truncation_note(stage: &str, r: &ExecResult) -> Option<String> {
    let cut: Vec<String> = [("stdout", r.stdout_bytes), ("stderr", r.stderr_bytes)]
        .into_iter()
        .filter(|&(_, total)| total > DEFAULT_MAX_OUTPUT)
        .map(|(name, total)| format!("{stage} {name} truncated: {total} bytes written"))
        .collect();
    (r.truncated && !cut.is_empty()).then(|| {
        format!(
            "{}, the first and last {} KiB kept",
            cut.join(", "),
            DEFAULT_MAX_OUTPUT / 2 / 1024
        )
    })
}
