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
//! **Where contexts live**: on the sandbox's node, not in a server. A context is its bridge
//! process, tagged `e2b-context:<id>` with `{"e2b_context": {language, cwd, default}}` as
//! its `meta` ([`CONTEXT_TAG_PREFIX`], [`ContextMeta`]); every call finds it by listing the
//! sandbox's processes, so in a cluster a context made through one server is listed, run
//! in, restarted and removed through any other. A server keeps only its attachment to a
//! bridge (a reader following its output from where it joined; [`Interpreters`]). Cell ids
//! are random, so the outputs of cells sent through two servers never mix; the bridge runs
//! the cells of every server in arrival order.
//!
//! Semantics: without `context_id`, the sandbox's default python context (made on first
//! use, cwd `/home/user`; when two servers make it at once, the older one wins and the
//! other is removed). Cells of one context run one at a time, in arrival order; state
//! (variables, imports) persists between them. `env_vars` are set for that cell only. A
//! client that goes away mid-cell (the SDK's `timeout`) interrupts the kernel
//! (`KeyboardInterrupt`). A kernel that dies in a cell gets the cell a `DeadKernelError`
//! and is restarted. Errors (Sandlot's `{"error": {code, message}}`): bad JSON or a
//! language other than `python` 400, unknown context 404, sandbox not running 409, a kernel
//! that cannot start (no ipykernel in the image) 503 `unavailable` with the bridge's reason.
//! Bounds: [`MAX_CONTEXTS`] contexts per sandbox (429; checked by each server under its own
//! lock, so two servers creating at once may pass it by one each), one output line at most
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

/// Tag prefix of a context's bridge process on the node: the tag is
/// `e2b-context:<context id>`, and the record's `meta` is `{"e2b_context": {"language",
/// "cwd", "default"}}` ([`ContextMeta`]). Contexts are found by listing the sandbox's
/// processes, so any server of a cluster reaches a context another server made.
pub const CONTEXT_TAG_PREFIX: &str = "e2b-context:";

/// What a context's bridge process record keeps in its `meta` (under `e2b_context`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct ContextMeta {
    /// Always `python`.
    pub language: String,
    /// Working directory of the kernel.
    pub cwd: String,
    /// Whether it is the sandbox's default context (the one `POST /execute` without
    /// `context_id` uses).
    #[serde(default)]
    pub default: bool,
}

/// A context as its node's process record tells it.
#[derive(Debug, Clone, PartialEq)]
struct Found {
    /// Context id (`ctx-…`).
    id: String,
    meta: ContextMeta,
    /// Handle of the bridge process.
    proc_id: String,
    /// The node's number of the process (orders the contexts, oldest first).
    number: u32,
    stdout_bytes: u64,
    stderr_bytes: u64,
}

impl Found {
    fn of(p: &sandlot_api::Process) -> Option<Found> {
        if p.state != sandlot_api::ProcessState::Running {
            return None;
        }
        let id = p.tag.as_deref()?.strip_prefix(CONTEXT_TAG_PREFIX)?;
        let meta: ContextMeta =
            serde_json::from_value(p.meta.as_ref()?.get("e2b_context")?.clone()).ok()?;
        Some(Found {
            id: id.to_owned(),
            meta,
            proc_id: p.id.clone(),
            number: p.number,
            stdout_bytes: p.stdout_bytes,
            stderr_bytes: p.stderr_bytes,
        })
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"id": self.id, "language": self.meta.language, "cwd": self.meta.cwd})
    }
}

/// The live contexts of `sandbox`, from its node's process records, oldest first.
///
/// # Errors
/// The node's error.
async fn node_contexts(st: &SharedState, sandbox: &str) -> ApiResult<Vec<Found>> {
    let mut v: Vec<Found> = st
        .node
        .process_list(sandbox)
        .await
        .map_err(ServerError::from)?
        .iter()
        .filter_map(Found::of)
        .collect();
    v.sort_by_key(|f| (f.number, f.proc_id.clone()));
    Ok(v)
}

/// One context as this server reaches it: the bridge process, followed by a reader, and
/// the cells this server waits for.
pub struct Context {
    /// Context id (`ctx-…`).
    pub id: String,
    proc: ProcRef,
    /// Held by the running cell: cells sent through one server run one at a time (the
    /// bridge queues cells of every server in arrival order).
    run_lock: tokio::sync::Mutex<()>,
    waiters: Mutex<HashMap<u64, mpsc::UnboundedSender<Msg>>>,
    dead: Mutex<Option<String>>,
}

impl Context {
    fn dead(&self) -> Option<String> {
        self.dead.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// This server's attachments to contexts' bridge processes, by sandbox and process handle:
/// a cache only (what contexts exist is the node's process list, `node_contexts`);
/// entries of ended processes are dropped when next seen.
#[derive(Default)]
pub struct Interpreters {
    sandboxes: Mutex<HashMap<String, HashMap<String, Arc<Context>>>>,
    /// Per sandbox: held while this server creates a context there.
    creating: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Interpreters {
    fn cached(&self, sandbox: &str, proc_id: &str) -> Option<Arc<Context>> {
        let mut m = self.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
        let s = m.get_mut(sandbox)?;
        s.retain(|_, c| c.dead().is_none());
        s.get(proc_id).cloned()
    }

    fn insert(&self, sandbox: &str, ctx: Arc<Context>) {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(sandbox.to_owned())
            .or_default()
            .insert(ctx.proc.id().to_owned(), ctx);
    }

    fn forget(&self, sandbox: &str, proc_id: &str) {
        if let Some(s) = self
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(sandbox)
        {
            s.remove(proc_id);
        }
    }

    fn creation_lock(&self, sandbox: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.creating
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(sandbox.to_owned())
            .or_default()
            .clone()
    }

    /// Forget the attachments of sandboxes not in `keep` (their processes end with them).
    pub fn retain_sandboxes(&self, keep: impl Fn(&str) -> bool) {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|k, _| keep(k));
        self.creating
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

/// A cell id no other server picks (random, below 2^53 so every JSON reader keeps it).
fn new_cell_id() -> u64 {
    rand::random::<u64>() >> 11
}

fn check_language(language: Option<&str>) -> ApiResult<()> {
    match language {
        None | Some("python") | Some("python3") | Some("") => Ok(()),
        Some(other) => Err(ServerError::invalid(format!(
            "language {other:?} is not supported by Sandlot's code interpreter; only \"python\""
        ))),
    }
}

fn new_context(st: &SharedState, sandbox: &str, id: &str, proc_id: &str) -> Arc<Context> {
    Arc::new(Context {
        id: id.to_owned(),
        proc: ProcRef::new(st, sandbox, proc_id),
        run_lock: tokio::sync::Mutex::new(()),
        waiters: Mutex::new(HashMap::new()),
        dead: Mutex::new(None),
    })
}

/// This server's attachment to context `f` of `sandbox`: the cached one, else a reader
/// that follows the bridge's output from the offsets the listing saw (earlier output is
/// other cells').
async fn attach(st: &SharedState, sandbox: &str, f: &Found) -> ApiResult<Arc<Context>> {
    if let Some(c) = st.e2b.interpreters.cached(sandbox, &f.proc_id) {
        return Ok(c);
    }
    let ctx = new_context(st, sandbox, &f.id, &f.proc_id);
    let stream = ctx
        .proc
        .follow(f.stdout_bytes, f.stderr_bytes)
        .await
        .map_err(ServerError::from)?;
    let (ready_tx, _) = tokio::sync::oneshot::channel();
    tokio::spawn(read_bridge(ctx.clone(), stream, ready_tx));
    st.e2b.interpreters.insert(sandbox, ctx.clone());
    Ok(ctx)
}

/// Starts a bridge in `sandbox` with `cwd` (context id `id`, else a new one), tagged and
/// described on the node ([`CONTEXT_TAG_PREFIX`]), and waits until its kernel answers.
async fn start_context(
    st: &SharedState,
    sandbox: &str,
    cwd: &str,
    user: Option<&str>,
    id: Option<String>,
    default: bool,
) -> ApiResult<(Arc<Context>, Found)> {
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
    let id = id.unwrap_or_else(new_context_id);
    let meta = ContextMeta {
        language: "python".into(),
        cwd: cwd.to_owned(),
        default,
    };
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
        tag: Some(format!("{CONTEXT_TAG_PREFIX}{id}")),
        meta: Some(serde_json::json!({ "e2b_context": meta })),
    };
    if let Err(e) = spawn.check_labels() {
        return Err(ServerError::invalid(format!(
            "context working directory: {e}"
        )));
    }
    let p = st
        .node
        .process_spawn(sandbox, spawn)
        .await
        .map_err(ServerError::from)?;
    crate::processes::watch_exit(st, sandbox, rec.backend, &p.id);
    let ctx = new_context(st, sandbox, &id, &p.id);
    let found = Found {
        id,
        meta,
        proc_id: p.id.clone(),
        number: p.number,
        stdout_bytes: 0,
        stderr_bytes: 0,
    };
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    match ctx.proc.follow(0, 0).await {
        Ok(stream) => {
            tokio::spawn(read_bridge(ctx.clone(), stream, ready_tx));
        }
        Err(e) => {
            let _ = ctx.proc.remove().await;
            return Err(ServerError::from(e));
        }
    }
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
        Ok(Ok(Ok(()))) => {
            st.e2b.interpreters.insert(sandbox, ctx.clone());
            Ok((ctx, found))
        }
        Ok(Ok(Err(why))) => {
            let _ = ctx.proc.remove().await;
            // A sandbox going away (deleted, its TTL reaped) kills the bridge too (exit
            // 137): say that, not that the image lacks a kernel.
            crate::sandboxes::running(st, sandbox).await?;
            Err(fail(why))
        }
        Ok(Err(_)) => {
            crate::sandboxes::running(st, sandbox).await?;
            Err(fail("the bridge ended".into()))
        }
        Err(_) => {
            let _ = ctx.proc.remove().await;
            Err(fail(format!("no answer within {} s", READY_WAIT.as_secs())))
        }
    }
}

/// Reads the bridge's stdout for the life of the process: the ready line, then the output
/// of cells, handed to their waiters; at the end every waiter learns that it died.
async fn read_bridge(
    ctx: Arc<Context>,
    stream: impl futures::Stream<Item = ProcessEvent> + Send + 'static,
    ready: tokio::sync::oneshot::Sender<Result<(), String>>,
) {
    let mut ready = Some(ready);
    let mut stderr_tail: Vec<u8> = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut overlong = false;
    let reason = {
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

fn not_found(id: &str) -> ServerError {
    ServerError::new(ErrorCode::NotFound, format!("context {id} not found"))
}

/// Context `id` of `sandbox`, from its node's records.
///
/// # Errors
/// 404 for an unknown (or ended) context; the node's error.
async fn find(st: &SharedState, sandbox: &str, id: &str) -> ApiResult<Found> {
    node_contexts(st, sandbox)
        .await?
        .into_iter()
        .find(|f| f.id == id)
        .ok_or_else(|| not_found(id))
}

/// The sandbox's default context: the oldest live one marked `default`.
fn default_of(list: &[Found]) -> Option<&Found> {
    list.iter().find(|f| f.meta.default)
}

/// The context `id` of `sandbox`, or its default one (made now when missing or dead).
/// When two servers make the default at once, the oldest wins and the other's kernel is
/// removed.
async fn context_of(
    st: &SharedState,
    sandbox: &str,
    id: Option<&str>,
    user: Option<&str>,
) -> ApiResult<Arc<Context>> {
    if let Some(id) = id {
        let f = find(st, sandbox, id).await?;
        return attach(st, sandbox, &f).await;
    }
    if let Some(d) = default_of(&node_contexts(st, sandbox).await?) {
        return attach(st, sandbox, d).await;
    }
    let lock = st.e2b.interpreters.creation_lock(sandbox);
    let _creating = lock.lock().await;
    let list = node_contexts(st, sandbox).await?;
    if let Some(d) = default_of(&list) {
        return attach(st, sandbox, d).await;
    }
    if list.len() >= MAX_CONTEXTS {
        return Err(too_many());
    }
    let (ctx, mine) = start_context(st, sandbox, &home_of(user), user, None, true).await?;
    let list = node_contexts(st, sandbox).await?;
    match default_of(&list) {
        Some(d) if d.proc_id != mine.proc_id => {
            let _ = ctx.proc.remove().await;
            st.e2b.interpreters.forget(sandbox, &mine.proc_id);
            attach(st, sandbox, d).await
        }
        _ => Ok(ctx),
    }
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
    let id = new_cell_id();
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
    let lock = st.e2b.interpreters.creation_lock(&sandbox);
    let _creating = lock.lock().await;
    if node_contexts(&st, &sandbox).await?.len() >= MAX_CONTEXTS {
        return Err(too_many());
    }
    let (_, found) = start_context(&st, &sandbox, &cwd, user, None, false).await?;
    Ok(axum::Json(found.json()).into_response())
}

/// `GET /contexts` → the sandbox's live contexts (from its node: every server lists the
/// same ones), oldest first.
pub async fn list_contexts(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let sandbox = running_sandbox_of(&st, &who, &headers).await?;
    let list: Vec<_> = node_contexts(&st, &sandbox)
        .await?
        .iter()
        .map(Found::json)
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
    let f = find(&st, &sandbox, &context_id).await?;
    st.e2b.interpreters.forget(&sandbox, &f.proc_id);
    let _ = ProcRef::new(&st, &sandbox, &f.proc_id).remove().await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /contexts/{id}/restart` → 204: the context keeps its id, cwd and being the
/// default or not, with a fresh kernel (a new bridge process).
pub async fn restart_context(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    user: Option<Extension<E2bUser>>,
    headers: HeaderMap,
    Path(context_id): Path<String>,
) -> ApiResult<Response> {
    let sandbox = running_sandbox_of(&st, &who, &headers).await?;
    let old = find(&st, &sandbox, &context_id).await?;
    st.e2b.interpreters.forget(&sandbox, &old.proc_id);
    let _ = ProcRef::new(&st, &sandbox, &old.proc_id).remove().await;
    start_context(
        &st,
        &sandbox,
        &old.meta.cwd,
        user_of(&user),
        Some(old.id.clone()),
        old.meta.default,
    )
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
