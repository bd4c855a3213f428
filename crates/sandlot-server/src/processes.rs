//! Background processes: `/v1/sandboxes/{id}/processes[/{pid}[/output|/wait|/signal|/stdin|/resize]]`.
//!
//! | route | answer |
//! |---|---|
//! | `POST …/processes` ([`SpawnRequest`]) | 201 [`Process`] |
//! | `GET …/processes` | [`ProcessList`] |
//! | `GET …/processes/{pid}` | [`Process`] |
//! | `GET …/processes/{pid}/output?stdout_offset=&stderr_offset=&follow=` | NDJSON [`sandlot_api::ProcessEvent`] |
//! | `POST …/processes/{pid}/wait?timeout_s=` | [`Process`] (still `running` after the timeout) |
//! | `POST …/processes/{pid}/signal` ([`SignalRequest`]) | 204 |
//! | `POST …/processes/{pid}/stdin?eof=` raw body | 204 |
//! | `POST …/processes/{pid}/resize` ([`sandlot_api::PtySize`]) | 204 (a terminal process: started with `pty`) |
//! | `DELETE …/processes/{pid}` | 204 (kills the whole tree, forgets the handle) |
//!
//! The processes live on the sandbox's node (the `process_*` calls of
//! [`sandlot_node_api::Node`]; semantics, signals and bounds in `sandlot_node::processes`),
//! not in the request or in this server: a client may go away and a new one pick them up
//! by handle, through any server that reaches the node (cluster mode). They are not
//! trajectory steps (a spawn carries no `step` and is never logged or replayed). They end
//! with their sandbox, and a restart of the node's process (`sandlot up`, `sandlot node`)
//! ends them all: their handles then answer 404.
use crate::error::{ApiResult, Json, Path, Query, ServerError};
use crate::sandboxes::running;
use crate::SharedState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use sandlot_api::{ErrorCode, Process, ProcessEvent, ProcessList, SignalRequest, SpawnRequest};
use sandlot_node_api::{NodeError, NodeResult, OutputCursor};
use serde::Deserialize;
use std::time::Duration;

/// Longest `wait` in one call, seconds (clients loop for longer waits).
pub const MAX_WAIT_S: f64 = 300.0;
/// Largest stdin body in one call (1 MiB).
pub const MAX_STDIN_BYTES: usize = 1 << 20;

/// The sandbox must exist (any state but gone) for the calls on its processes.
async fn known(st: &SharedState, id: &str) -> ApiResult<sandlot_api::Backend> {
    match st.store.get(id).await? {
        Some(rec) => Ok(rec.backend),
        None => Err(ServerError::no_sandbox(id)),
    }
}

/// Signals, stdin and kills need the sandbox's processes thawed: a frozen tree cannot act
/// on them (and a SIGKILL of a frozen cgroup v1 tree waits for the thaw).
async fn not_paused(st: &SharedState, id: &str) -> ApiResult<()> {
    match st.store.get(id).await? {
        Some(rec) if rec.state == sandlot_api::SandboxState::Paused => Err(ServerError::new(
            ErrorCode::Conflict,
            format!("sandbox is paused: {id} (resume it with POST /v1/sandboxes:resume)"),
        )),
        Some(_) => Ok(()),
        None => Err(ServerError::no_sandbox(id)),
    }
}

/// `POST /v1/sandboxes/{id}/processes` → 201 [`Process`]. 404 unknown sandbox, 409 not
/// running, 429 at the per-sandbox limit of running processes.
pub async fn spawn(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Json(req): Json<SpawnRequest>,
) -> ApiResult<Response> {
    // The command's own checks (empty argv, blank shell string) are exec's.
    crate::exec::validate(&sandlot_api::ExecRequest::new(req.cmd.clone()))?;
    let rec = running(&st, &id).await?;
    // Its retained output goes to the data directory (unlinked files).
    crate::disk_reserve::check(&st)?;
    let p = match st.node.process_spawn(&id, req).await {
        Ok(p) => p,
        Err(e) => {
            let e = ServerError::from(e);
            crate::events::record_error(&st, "spawn", Some(&id), Some(rec.backend), &e);
            return Err(e);
        }
    };
    let mut f = serde_json::Map::new();
    f.insert("process".into(), p.id.clone().into());
    watch_exit(&st, &id, rec.backend, &p.id);
    crate::events::record(&st, "process_spawned", Some(&id), Some(rec.backend), f)?;
    Ok((StatusCode::CREATED, Json(p)).into_response())
}

/// Longest wait of one node call of [`watch_exit`] (it calls again while the process runs).
const WATCH_WAIT: Duration = Duration::from_secs(60);
/// Failed node calls in a row (transport, node unavailable, one second apart) after which
/// [`watch_exit`] gives up.
const WATCH_TRIES: u32 = 300;

/// Records a `process_exited` audit event when the process ends (waiting on its node; a
/// process removed or gone with its sandbox first records none).
pub(crate) fn watch_exit(st: &SharedState, id: &str, backend: sandlot_api::Backend, pid: &str) {
    let st = st.clone();
    let id = id.to_owned();
    let pid = pid.to_owned();
    tokio::spawn(async move {
        let mut failed = 0;
        loop {
            let p = match st.node.process_wait(&id, &pid, WATCH_WAIT).await {
                Ok(p) => {
                    failed = 0;
                    p
                }
                Err(e @ (NodeError::Transport(_) | NodeError::Unavailable(_)))
                    if failed < WATCH_TRIES =>
                {
                    failed += 1;
                    tracing::debug!(sandbox_id = %id, process = %pid, error = %e, "waiting for a process");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                Err(_) => return,
            };
            if p.state == sandlot_api::ProcessState::Exited {
                let mut f = serde_json::Map::new();
                f.insert("process".into(), p.id.clone().into());
                if let Some(r) = &p.result {
                    f.insert("exit_code".into(), r.exit_code.into());
                    f.insert("timed_out".into(), r.timed_out.into());
                }
                if let Some(e) = &p.error {
                    f.insert("error".into(), e.code.as_str().into());
                }
                crate::events::record_queued(&st, "process_exited", Some(&id), Some(backend), f);
                return;
            }
        }
    });
}

/// `GET /v1/sandboxes/{id}/processes` → [`ProcessList`].
pub async fn list(
    State(st): State<SharedState>,
    Path(id): Path<String>,
) -> ApiResult<Json<ProcessList>> {
    known(&st, &id).await?;
    Ok(Json(ProcessList {
        processes: st.node.process_list(&id).await?,
    }))
}

/// `GET /v1/sandboxes/{id}/processes/{pid}` → [`Process`].
pub async fn get_one(
    State(st): State<SharedState>,
    Path((id, pid)): Path<(String, String)>,
) -> ApiResult<Json<Process>> {
    known(&st, &id).await?;
    Ok(Json(st.node.process_get(&id, &pid).await?))
}

/// Query of the output route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    /// First stdout byte wanted (default 0).
    #[serde(default)]
    pub stdout_offset: u64,
    /// First stderr byte wanted (default 0).
    #[serde(default)]
    pub stderr_offset: u64,
    /// Keep streaming until the process ends (default false: what is retained now).
    #[serde(default)]
    pub follow: bool,
}

/// `GET /v1/sandboxes/{id}/processes/{pid}/output` → NDJSON events.
pub async fn output(
    State(st): State<SharedState>,
    Path((id, pid)): Path<(String, String)>,
    Query(q): Query<OutputQuery>,
) -> ApiResult<Response> {
    known(&st, &id).await?;
    let cursor = OutputCursor {
        stdout_offset: q.stdout_offset,
        stderr_offset: q.stderr_offset,
        follow: q.follow,
    };
    let events = st.node.process_output(&id, &pid, cursor).await?;
    let lines = futures::StreamExt::map(events, |ev| {
        let mut v = serde_json::to_vec(&ev).expect("event serializes");
        v.push(b'\n');
        Ok::<Bytes, std::convert::Infallible>(Bytes::from(v))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// Query of the wait route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// Longest wait in seconds (default 30, range [0, 300]).
    #[serde(default)]
    pub timeout_s: Option<f64>,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/wait` → [`Process`], once it ended or the
/// timeout passed.
pub async fn wait(
    State(st): State<SharedState>,
    Path((id, pid)): Path<(String, String)>,
    Query(q): Query<WaitQuery>,
) -> ApiResult<Json<Process>> {
    let t = q.timeout_s.unwrap_or(30.0);
    if !(t.is_finite() && (0.0..=MAX_WAIT_S).contains(&t)) {
        return Err(ServerError::invalid(format!(
            "timeout_s = {t} must be in [0, {MAX_WAIT_S}]"
        )));
    }
    known(&st, &id).await?;
    let t = Duration::from_secs_f64(t);
    Ok(Json(st.node.process_wait(&id, &pid, t).await?))
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal` → 204. 409 when it already exited or
/// the sandbox is paused.
pub async fn signal(
    State(st): State<SharedState>,
    Path((id, pid)): Path<(String, String)>,
    Json(req): Json<SignalRequest>,
) -> ApiResult<StatusCode> {
    let n = req.signal.number().map_err(ServerError::invalid)?;
    not_paused(&st, &id).await?;
    st.node.process_signal(&id, &pid, n).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Query of the stdin route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdinQuery {
    /// Close stdin after this body.
    #[serde(default)]
    pub eof: bool,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/stdin?eof=` raw body → 204. 409 when stdin is
/// not open or the sandbox is paused; 504 when the process has not read its stdin for 10 s.
pub async fn stdin(
    State(st): State<SharedState>,
    Path((id, pid)): Path<(String, String)>,
    Query(q): Query<StdinQuery>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    not_paused(&st, &id).await?;
    if body.len() > MAX_STDIN_BYTES {
        return Err(ServerError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "stdin body of {} bytes is over {MAX_STDIN_BYTES}; send it in several calls",
                body.len()
            ),
        ));
    }
    st.node.process_stdin(&id, &pid, body, q.eof).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/resize` ([`sandlot_api::PtySize`]) → 204: the
/// terminal of a process started with `pty` takes the new size (its foreground process
/// group gets SIGWINCH). 400 for a process without a terminal or a size out of 1..=1000;
/// 409 when it already exited or the sandbox is paused.
pub async fn resize(
    State(st): State<SharedState>,
    Path((id, pid)): Path<(String, String)>,
    Json(size): Json<sandlot_api::PtySize>,
) -> ApiResult<StatusCode> {
    not_paused(&st, &id).await?;
    st.node.process_resize(&id, &pid, size).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /v1/sandboxes/{id}/processes/{pid}` → 204: kills the whole tree and forgets the
/// handle. 409 while the sandbox is paused.
pub async fn delete(
    State(st): State<SharedState>,
    Path((id, pid)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    not_paused(&st, &id).await?;
    st.node.process_remove(&id, &pid).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// How often [`ProcRef::follow`] reconnects to a node whose output stream broke before the
/// process's end, at most, before it gives up.
const FOLLOW_RECONNECTS: u32 = 20;

/// A background process on its sandbox's node, by handle: the `process_*` calls of
/// [`crate::AppState::node`] for it (no copy of its state is kept here). For the E2B
/// surface, which holds processes across requests.
#[derive(Clone)]
pub struct ProcRef {
    node: std::sync::Arc<dyn sandlot_node_api::Node>,
    sandbox: String,
    id: String,
}

impl ProcRef {
    /// Process `id` (`pr-…`) of `sandbox`.
    pub fn new(st: &SharedState, sandbox: &str, id: &str) -> Self {
        ProcRef {
            node: st.node.clone(),
            sandbox: sandbox.to_owned(),
            id: id.to_owned(),
        }
    }

    /// Its handle.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its record. Errors as [`sandlot_node_api::Node::process_get`].
    pub async fn info(&self) -> NodeResult<Process> {
        self.node.process_get(&self.sandbox, &self.id).await
    }

    /// Writes stdin. Errors as [`sandlot_node_api::Node::process_stdin`].
    pub async fn write_stdin(&self, data: Bytes, eof: bool) -> NodeResult<()> {
        self.node
            .process_stdin(&self.sandbox, &self.id, data, eof)
            .await
    }

    /// Kills and forgets it. Errors as [`sandlot_node_api::Node::process_remove`].
    pub async fn remove(&self) -> NodeResult<()> {
        self.node.process_remove(&self.sandbox, &self.id).await
    }

    /// Its output from the offsets until it ends (`follow`), as
    /// [`sandlot_node_api::Node::process_output`]; a node stream that breaks before the
    /// `exit` (or `error`) event is opened again from the offsets reached (up to 20 times,
    /// one second apart), so a reader sees every retained byte once.
    ///
    /// # Errors
    /// The first call's error (`NotFound`, `InvalidArgument` for an offset past the end).
    pub async fn follow(
        &self,
        stdout_offset: u64,
        stderr_offset: u64,
    ) -> NodeResult<impl futures::Stream<Item = ProcessEvent> + Send + 'static> {
        let cursor = OutputCursor {
            stdout_offset,
            stderr_offset,
            follow: true,
        };
        let first = self
            .node
            .process_output(&self.sandbox, &self.id, cursor)
            .await?;
        let state = (self.clone(), cursor, Some(first), 0u32);
        Ok(futures::stream::unfold(
            state,
            |(me, mut cursor, mut events, mut tries)| async move {
                loop {
                    if let Some(ev_stream) = events.as_mut() {
                        match futures::StreamExt::next(ev_stream).await {
                            Some(ev) => {
                                let last = matches!(
                                    ev,
                                    ProcessEvent::Exit { .. } | ProcessEvent::Error { .. }
                                );
                                advance(&mut cursor, &ev);
                                let events = if last { None } else { events };
                                tries = if last { FOLLOW_RECONNECTS } else { 0 };
                                return Some((ev, (me, cursor, events, tries)));
                            }
                            None => events = None,
                        }
                    }
                    if tries >= FOLLOW_RECONNECTS {
                        return None;
                    }
                    tries += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    match me.node.process_output(&me.sandbox, &me.id, cursor).await {
                        Ok(s) => events = Some(s),
                        Err(NodeError::Transport(_) | NodeError::Unavailable(_)) => {}
                        Err(e) => {
                            tracing::debug!(process = %me.id, error = %e, "process output ended");
                            return None;
                        }
                    }
                }
            },
        ))
    }
}

/// Moves `cursor` past the bytes of `ev`.
fn advance(cursor: &mut OutputCursor, ev: &ProcessEvent) {
    let len = |data: &str, b64: &Option<String>| -> u64 {
        use base64::Engine as _;
        match b64 {
            Some(b) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .map(|v| v.len() as u64)
                .unwrap_or(data.len() as u64),
            None => data.len() as u64,
        }
    };
    match ev {
        ProcessEvent::Stdout {
            data,
            data_b64,
            offset,
        } => cursor.stdout_offset = offset + len(data, data_b64),
        ProcessEvent::Stderr {
            data,
            data_b64,
            offset,
        } => cursor.stderr_offset = offset + len(data, data_b64),
        ProcessEvent::Skipped { stream, to, .. } => match stream {
            sandlot_api::StreamName::Stdout => cursor.stdout_offset = *to,
            sandlot_api::StreamName::Stderr => cursor.stderr_offset = *to,
        },
        ProcessEvent::Exit { .. } | ProcessEvent::Error { .. } => {}
    }
}
