//! E2B's code-interpreter protocol (what the `e2b-code-interpreter` SDK's `run_code` and
//! `*_code_context` call on port 49999), served by Sandlot itself: each context is one
//! background process in the sandbox running [`BRIDGE_PY`] (a stateful ipykernel driven
//! over stdin/stdout), so nothing has to listen inside the image and it works on every
//! backend where background processes with stdin work. The image needs `python3`,
//! `ipykernel` and `jupyter_client` (`lang-python` has them, with matplotlib); E2B's
//! templates `code-interpreter-v1` / `code-interpreter` map to [`IMAGE`].
//!
//! Source of the protocol: the SDK (`e2b_code_interpreter` 2.11.5,
//! `code_interpreter_sync.py` and `models.py`) and E2B's server in `e2b-dev/code-interpreter`
//! (`template/server`), read for the shapes only.
//!
//! | route | answer |
//! |---|---|
//! | `POST /execute` `{code, context_id?, language?, env_vars?}` | 200 NDJSON: `{"type": "stdout"\|"stderr", "text", "timestamp"}` (ns), `{"type": "result", "text", "png", "html", …, "is_main_result", "extra"}`, `{"type": "error", "name", "value", "traceback"}`, `{"type": "number_of_executions", "execution_count"}` |
//! | `POST /contexts` `{language?, cwd?}` | 200 `{"id", "language", "cwd"}` |
//! | `GET /contexts` | 200 `[{"id", "language", "cwd"}]` |
//! | `DELETE /contexts/{id}` | 204 (the kernel is killed) |
//! | `POST /contexts/{id}/restart` | 204 (a fresh kernel, state gone) |
//!
//! The sandbox is named as for envd ([`super::sandbox_of`]: `E2b-Sandbox-Id`, or the host
//! name `49999-<id>.<domain>`); credentials a Sandlot key as `X-Access-Token` or
//! `E2B-Traffic-Access-Token` (what the SDK sends), tenants as every E2B route.
//!
//! Semantics: without `context_id`, the sandbox's default python context (made on first
//! use, cwd `/home/user`). Cells of one context run one at a time, in arrival order; state
//! (variables, imports) persists between them. `env_vars` are set for that cell only. A
//! client that goes away mid-cell (the SDK's `timeout`) interrupts the kernel
//! (`KeyboardInterrupt`). A kernel that dies in a cell gets the cell a `DeadKernelError`
//! and is restarted. Errors (Sandlot's `{"error": {code, message}}`): bad JSON or a
//! language other than `python` 400, unknown context 404, sandbox not running 409, a kernel
//! that cannot start (no ipykernel in the image) 503 `unavailable` with the bridge's reason.
//! Bounds: [`MAX_CONTEXTS`] contexts per sandbox (429), one output line at most
//! [`MAX_LINE`] bytes (a longer one is replaced by an error line).
use super::{ensure_home, home_of, running_sandbox_of, E2bUser};
use crate::auth::Principal;
use crate::error::{ApiResult, Json, ServerError};
use crate::processes::ProcRef;
use crate::SharedState;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::StreamExt;
use sandlot_api::{Cmd, ErrorCode, ProcessEvent, SpawnRequest};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// The bridge program (Python, run with `python3 BRIDGE_PATH` in the context's cwd).
pub const BRIDGE_PY: &str = include_str!("interpreter_bridge.py");
/// Where the bridge is written in the sandbox.
pub const BRIDGE_PATH: &str = "/tmp/.sandlot-ci/bridge.py";
/// E2B's code-interpreter port (`49999-<id>.<domain>`).
pub const JUPYTER_PORT: u16 = 49999;
/// Image of E2B's code-interpreter templates.
pub const IMAGE: &str = "lang-python";
/// E2B template ids that mean the code interpreter (the SDK's default is the first).
pub const TEMPLATES: [&str; 2] = ["code-interpreter-v1", "code-interpreter"];
/// Most contexts per sandbox (the default one included).
pub const MAX_CONTEXTS: usize = 8;
/// Longest output line from the bridge, bytes (a base64 PNG of a large figure fits).
pub const MAX_LINE: usize = 32 << 20;
/// How long a new context may take to answer (kernel start).
const READY_WAIT: Duration = Duration::from_secs(60);
/// Output the bridge process keeps per stream: the node's largest for a background
/// process (16 MiB, `sandlot_node::processes::MAX_RETAIN`).
const MAX_RETAIN: u64 = 16 << 20;

/// What a context's reader hands the cell waiting for it.
enum Msg {
    /// One E2B output object.
    Out(serde_json::Value),
    /// The cell finished.
    Done,
    /// The bridge ended (reason).
    Dead(String),
}

/// One context: a bridge process and the cells waiting for its output.
pub struct Context {
    /// Context id (`ctx-…`).
    pub id: String,
    /// Always `python`.
    pub language: String,
    /// Working directory of the kernel.
    pub cwd: String,
    proc: ProcRef,
    /// Held by the running cell: cells of a context run one at a time.
    run_lock: tokio::sync::Mutex<()>,
    next: AtomicU64,
    waiters: Mutex<HashMap<u64, mpsc::UnboundedSender<Msg>>>,
    dead: Mutex<Option<String>>,
}

impl Context {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({"id": self.id, "language": self.language, "cwd": self.cwd})
    }

    fn dead(&self) -> Option<String> {
        self.dead.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[derive(Default)]
struct Contexts {
    default: Option<String>,
    by_id: BTreeMap<String, Arc<Context>>,
}

/// The code-interpreter contexts of every sandbox.
#[derive(Default)]
pub struct Interpreters {
    sandboxes: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Contexts>>>>,
}

impl Interpreters {
    fn of(&self, sandbox: &str) -> Arc<tokio::sync::Mutex<Contexts>> {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(sandbox.to_owned())
            .or_default()
            .clone()
    }

    /// Forget the contexts of sandboxes not in `keep` (their processes end with them).
    pub fn retain_sandboxes(&self, keep: impl Fn(&str) -> bool) {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|k, _| keep(k));
    }
}

fn new_context_id() -> String {
    let bytes: [u8; 8] = rand::random();
    let mut s = String::from("ctx-");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn check_language(language: Option<&str>) -> ApiResult<()> {
    match language {
        None | Some("python") | Some("python3") | Some("") => Ok(()),
        Some(other) => Err(ServerError::invalid(format!(
            "language {other:?} is not supported by Sandlot's code interpreter; only \"python\""
        ))),
    }
}

/// Starts a bridge in `sandbox` with `cwd` (context id `id`, else a new one) and waits
/// until its kernel answers.
async fn start_context(
    st: &SharedState,
    sandbox: &str,
    cwd: &str,
    user: Option<&str>,
    id: Option<String>,
) -> ApiResult<Arc<Context>> {
    let home = home_of(user);
    ensure_home(st, sandbox, &home).await?;
    if cwd != home {
        st.node.make_dir(sandbox, cwd, true).await?;
    }
    st.node
        .write_file(
            sandbox,
            BRIDGE_PATH,
            Bytes::from_static(BRIDGE_PY.as_bytes()),
        )
        .await?;
    let env = BTreeMap::from([
        ("HOME".to_owned(), home.clone()),
        ("USER".to_owned(), user.unwrap_or("user").to_owned()),
        (
            "JUPYTER_RUNTIME_DIR".to_owned(),
            "/tmp/.sandlot-ci/runtime".to_owned(),
        ),
        ("MPLCONFIGDIR".to_owned(), "/tmp/.sandlot-ci/mpl".to_owned()),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
    ]);
    crate::disk_reserve::check(st)?;
    let rec = crate::sandboxes::running(st, sandbox).await?;
    let spawn = SpawnRequest {
        cmd: Cmd::Argv(vec!["python3".into(), BRIDGE_PATH.into()]),
        cwd: Some(cwd.to_owned()),
        env,
        stdin_b64: None,
        stdin: true,
        timeout_s: Some(sandlot_api::MAX_TIMEOUT_S),
        max_output_bytes: Some(MAX_RETAIN),
        user: None,
        pty: None,
        tag: None,
        meta: None,
    };
    let p = st
        .node
        .process_spawn(sandbox, spawn)
        .await
        .map_err(ServerError::from)?;
    crate::processes::watch_exit(st, sandbox, rec.backend, &p.id);
    let proc = ProcRef::new(st, sandbox, &p.id);
    let ctx = Arc::new(Context {
        id: id.unwrap_or_else(new_context_id),
        language: "python".into(),
        cwd: cwd.to_owned(),
        proc: proc.clone(),
        run_lock: tokio::sync::Mutex::new(()),
        next: AtomicU64::new(1),
        waiters: Mutex::new(HashMap::new()),
        dead: Mutex::new(None),
    });
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(read_bridge(ctx.clone(), ready_tx));
    let fail = |why: String| {
        ServerError::new(
            ErrorCode::Unavailable,
            format!(
                "the code interpreter could not start in sandbox {sandbox} (it needs python3 \
                 with ipykernel and jupyter_client, as in the {IMAGE} image): {why}"
            ),
        )
    };
    match tokio::time::timeout(READY_WAIT, ready_rx).await {
        Ok(Ok(Ok(()))) => Ok(ctx),
        Ok(Ok(Err(why))) => {
            let _ = proc.remove().await;
            Err(fail(why))
        }
        Ok(Err(_)) => Err(fail("the bridge ended".into())),
        Err(_) => {
            let _ = proc.remove().await;
            Err(fail(format!("no answer within {} s", READY_WAIT.as_secs())))
        }
    }
}

/// Reads the bridge's stdout for the life of the process: the ready line, then the output
/// of cells, handed to their waiters; at the end every waiter learns that it died.
async fn read_bridge(ctx: Arc<Context>, ready: tokio::sync::oneshot::Sender<Result<(), String>>) {
    let mut ready = Some(ready);
    let mut stderr_tail: Vec<u8> = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut overlong = false;
    let reason = match ctx.proc.follow(0, 0).await {
        Err(e) => format!("{e}"),
        Ok(stream) => {
            let mut stream = Box::pin(stream);
            let mut reason = "the code interpreter process ended".to_owned();
            while let Some(ev) = stream.next().await {
                match ev {
                    ProcessEvent::Stdout { data, data_b64, .. } => {
                        let bytes = chunk_bytes(data, data_b64);
                        for &b in &bytes {
                            if b == b'\n' {
                                if overlong {
                                    overlong = false;
                                    route_overlong(&ctx);
                                } else {
                                    route_line(&ctx, &buf, &mut ready);
                                }
                                buf.clear();
                            } else if buf.len() < MAX_LINE {
                                buf.push(b);
                            } else {
                                overlong = true;
                            }
                        }
                    }
                    ProcessEvent::Stderr { data, data_b64, .. } => {
                        stderr_tail.extend(chunk_bytes(data, data_b64));
                        let cut = stderr_tail.len().saturating_sub(2000);
                        stderr_tail.drain(..cut);
                    }
                    ProcessEvent::Skipped { .. } => {
                        buf.clear();
                    }
                    ProcessEvent::Exit { result } => {
                        reason = format!(
                            "the code interpreter process ended (exit code {})",
                            result.exit_code
                        );
                    }
                    ProcessEvent::Error { error } => {
                        reason = format!("the code interpreter process failed: {}", error.message);
                    }
                }
            }
            reason
        }
    };
    let tail = String::from_utf8_lossy(&stderr_tail).trim().to_owned();
    let reason = if tail.is_empty() {
        reason
    } else {
        format!("{reason}: {tail}")
    };
    *ctx.dead.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
    if let Some(r) = ready.take() {
        let _ = r.send(Err(reason.clone()));
    }
    let waiters: Vec<_> = ctx
        .waiters
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
        .collect();
    for (_, w) in waiters {
        let _ = w.send(Msg::Dead(reason.clone()));
    }
}

fn chunk_bytes(data: String, data_b64: Option<String>) -> Vec<u8> {
    use base64::Engine as _;
    match data_b64 {
        Some(b) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .unwrap_or_else(|_| data.into_bytes()),
        None => data.into_bytes(),
    }
}

fn route_overlong(ctx: &Context) {
    // The cell it belongs to cannot be read from a cut line: the one running gets it.
    let w = ctx.waiters.lock().unwrap_or_else(|p| p.into_inner());
    for tx in w.values() {
        let _ = tx.send(Msg::Out(serde_json::json!({
            "type": "error", "name": "OutputTooLarge",
            "value": format!("one output of this cell was over {MAX_LINE} bytes and was dropped"),
            "traceback": "",
        })));
    }
}

fn route_line(
    ctx: &Context,
    line: &[u8],
    ready: &mut Option<tokio::sync::oneshot::Sender<Result<(), String>>>,
) {
    let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice::<serde_json::Value>(line)
    else {
        return;
    };
    if m.contains_key("ready") {
        if let Some(r) = ready.take() {
            let _ = r.send(Ok(()));
        }
        return;
    }
    if let Some(f) = m.get("fatal") {
        if let Some(r) = ready.take() {
            let _ = r.send(Err(f.as_str().unwrap_or("").to_owned()));
        }
        return;
    }
    let Some(id) = m.get("id").and_then(|v| v.as_u64()) else {
        return;
    };
    let mut w = ctx.waiters.lock().unwrap_or_else(|p| p.into_inner());
    if m.get("done").and_then(|v| v.as_bool()) == Some(true) {
        if let Some(tx) = w.remove(&id) {
            let _ = tx.send(Msg::Done);
        }
    } else if let (Some(out @ serde_json::Value::Object(_)), Some(tx)) =
        (m.remove("out"), w.get(&id))
    {
        let _ = tx.send(Msg::Out(out));
    }
}

/// The context `id` of `sandbox`, or its default one (made now when missing or dead).
async fn context_of(
    st: &SharedState,
    sandbox: &str,
    id: Option<&str>,
    user: Option<&str>,
) -> ApiResult<Arc<Context>> {
    let cell = st.e2b.interpreters.of(sandbox);
    let mut c = cell.lock().await;
    if let Some(id) = id {
        return c.by_id.get(id).cloned().ok_or_else(|| {
            ServerError::new(ErrorCode::NotFound, format!("context {id} not found"))
        });
    }
    if let Some(d) = c.default.clone().and_then(|d| c.by_id.get(&d).cloned()) {
        if d.dead().is_none() {
            return Ok(d);
        }
        c.by_id.remove(&d.id);
    }
    if c.by_id.len() >= MAX_CONTEXTS {
        return Err(too_many());
    }
    let ctx = start_context(st, sandbox, &home_of(user), user, None).await?;
    c.default = Some(ctx.id.clone());
    c.by_id.insert(ctx.id.clone(), ctx.clone());
    Ok(ctx)
}

fn too_many() -> ServerError {
    ServerError::new(
        ErrorCode::ResourceExhausted,
        format!("at most {MAX_CONTEXTS} code contexts per sandbox; remove one first"),
    )
}

fn user_of(u: &Option<Extension<E2bUser>>) -> Option<&str> {
    u.as_ref().map(|Extension(E2bUser(n))| n.as_str())
}

/// Body of `POST /execute`.
#[derive(Debug, Deserialize)]
pub struct ExecuteRequest {
    /// The cell.
    pub code: String,
    /// Context to run in (default: the sandbox's default python context).
    #[serde(default)]
    pub context_id: Option<String>,
    /// Language (only `python`); with `context_id` the SDK sends none.
    #[serde(default)]
    pub language: Option<String>,
    /// Environment variables for this cell only.
    #[serde(default)]
    pub env_vars: Option<BTreeMap<String, String>>,
}

/// `POST /execute` → NDJSON output of one cell (module docs).
pub async fn execute(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    user: Option<Extension<E2bUser>>,
    headers: HeaderMap,
    Json(req): Json<ExecuteRequest>,
) -> ApiResult<Response> {
    let sandbox = running_sandbox_of(&st, &who, &headers).await?;
    if req.context_id.is_none() {
        check_language(req.language.as_deref())?;
    }
    let ctx = context_of(&st, &sandbox, req.context_id.as_deref(), user_of(&user)).await?;
    if let Some(why) = ctx.dead() {
        return Err(ServerError::new(
            ErrorCode::Conflict,
            format!("context {} is gone: {why}", ctx.id),
        ));
    }
    let (body_tx, body_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(run_cell(ctx, req.code, req.env_vars, body_tx));
    let stream = futures::stream::unfold(body_rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let body = Body::from_stream(stream);
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        body,
    )
        .into_response())
}

/// Runs one cell in `ctx` (after the cells before it), sending its output lines to `out`;
/// when the client went away, interrupts the kernel and drains the rest.
async fn run_cell(
    ctx: Arc<Context>,
    code: String,
    env_vars: Option<BTreeMap<String, String>>,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let _turn = ctx.run_lock.lock().await;
    let line = |v: &serde_json::Value| {
        let mut s = v.to_string();
        s.push('\n');
        Ok(Bytes::from(s))
    };
    let error = |name: &str, value: &str| serde_json::json!({"type": "error", "name": name, "value": value, "traceback": ""});
    if let Some(why) = ctx.dead() {
        let _ = out.send(line(&error("ContextGone", &why))).await;
        return;
    }
    let id = ctx.next.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel();
    ctx.waiters
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, tx);
    let mut req = serde_json::json!({"id": id, "code": code, "env_vars": env_vars}).to_string();
    req.push('\n');
    if let Err(e) = ctx.proc.write_stdin(Bytes::from(req), false).await {
        ctx.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        let _ = out
            .send(line(&error(
                "ContextGone",
                &format!("cannot reach the kernel: {e}"),
            )))
            .await;
        return;
    }
    let mut client_gone = false;
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Out(v) => {
                if !client_gone && out.send(line(&v)).await.is_err() {
                    client_gone = true;
                    let mut irq = serde_json::json!({ "interrupt": id }).to_string();
                    irq.push('\n');
                    let _ = ctx.proc.write_stdin(Bytes::from(irq), false).await;
                }
            }
            Msg::Done => return,
            Msg::Dead(why) => {
                if !client_gone {
                    let _ = out.send(line(&error("DeadKernelError", &why))).await;
                }
                return;
            }
        }
        if !client_gone && out.is_closed() {
            client_gone = true;
            let mut irq = serde_json::json!({ "interrupt": id }).to_string();
            irq.push('\n');
            let _ = ctx.proc.write_stdin(Bytes::from(irq), false).await;
        }
    }
}

/// Body of `POST /contexts`.
#[derive(Debug, Default, Deserialize)]
pub struct CreateContext {
    /// Only `python` (or absent).
    #[serde(default)]
    pub language: Option<String>,
    /// Working directory (default the user's home, `/home/user`).
    #[serde(default)]
    pub cwd: Option<String>,
}

/// `POST /contexts` → `{"id", "language", "cwd"}`: a new kernel.
pub async fn create_context(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    user: Option<Extension<E2bUser>>,
    headers: HeaderMap,
    Json(req): Json<CreateContext>,
) -> ApiResult<Response> {
    let sandbox = running_sandbox_of(&st, &who, &headers).await?;
    check_language(req.language.as_deref())?;
    let user = user_of(&user);
    let cwd = match req.cwd.as_deref() {
        None | Some("") => home_of(user),
        Some(p) if p.starts_with('/') => p.to_owned(),
        Some(p) => format!("{}/{}", home_of(user), p.trim_start_matches("~/")),
    };
    let cell = st.e2b.interpreters.of(&sandbox);
    let mut c = cell.lock().await;
    c.by_id.retain(|_, x| x.dead().is_none());
    if c.by_id.len() >= MAX_CONTEXTS {
        return Err(too_many());
    }
    let ctx = start_context(&st, &sandbox, &cwd, user, None).await?;
    c.by_id.insert(ctx.id.clone(), ctx.clone());
    Ok(axum::Json(ctx.json()).into_response())
}

/// `GET /contexts` → the sandbox's live contexts.
pub async fn list_contexts(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let sandbox = running_sandbox_of(&st, &who, &headers).await?;
    let cell = st.e2b.interpreters.of(&sandbox);
    let c = cell.lock().await;
    let list: Vec<_> = c
        .by_id
        .values()
        .filter(|x| x.dead().is_none())
        .map(|x| x.json())
        .collect();
    Ok(axum::Json(list).into_response())
}

/// `DELETE /contexts/{id}` → 204; the kernel is killed.
pub async fn remove_context(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
    Path(context_id): Path<String>,
) -> ApiResult<Response> {
    let sandbox = running_sandbox_of(&st, &who, &headers).await?;
    let cell = st.e2b.interpreters.of(&sandbox);
    let mut c = cell.lock().await;
    let Some(ctx) = c.by_id.remove(&context_id) else {
        return Err(ServerError::new(
            ErrorCode::NotFound,
            format!("context {context_id} not found"),
        ));
    };
    if c.default.as_deref() == Some(context_id.as_str()) {
        c.default = None;
    }
    drop(c);
    let _ = ctx.proc.remove().await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /contexts/{id}/restart` → 204: the context keeps its id and cwd, with a fresh
/// kernel (a new bridge process).
pub async fn restart_context(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    user: Option<Extension<E2bUser>>,
    headers: HeaderMap,
    Path(context_id): Path<String>,
) -> ApiResult<Response> {
    let sandbox = running_sandbox_of(&st, &who, &headers).await?;
    let cell = st.e2b.interpreters.of(&sandbox);
    let mut c = cell.lock().await;
    let Some(old) = c.by_id.get(&context_id).cloned() else {
        return Err(ServerError::new(
            ErrorCode::NotFound,
            format!("context {context_id} not found"),
        ));
    };
    let _ = old.proc.remove().await;
    c.by_id.remove(&context_id);
    let fresh = start_context(
        &st,
        &sandbox,
        &old.cwd,
        user_of(&user),
        Some(old.id.clone()),
    )
    .await?;
    c.by_id.insert(old.id.clone(), fresh);
    Ok(StatusCode::NO_CONTENT.into_response())
}
