//! `POST /v1/sandboxes/{id}/exec[?stream=true]`.
//!
//! Without `stream`, the answer is one `ExecResult`. With `stream=true` the answer is
//! `application/x-ndjson`: one [`ExecEvent`] JSON object per line — `stdout`/`stderr` chunks
//! as the node produces them, then exactly one `exit` line (the result with empty
//! `stdout`/`stderr`, byte totals kept) or one `error` line (`{"type":"error","error":
//! {"code","message"}}`) when the node failed. Errors found before the exec starts
//! (validation, unknown sandbox) are ordinary HTTP errors. The exec runs in its own task:
//! a client that goes away does not stop it before its timeout.
//!
//! `step` (trajectory log): see [`crate::trajectory`]. A replayed step answers the logged
//! result with `replayed: true`; streamed, it sends the logged stdout and stderr as one
//! chunk each and then the `exit` line. An executed step is logged before the `exit` line
//! is sent (a failure to log becomes the `error` line).
use crate::error::{ApiResult, Json, Path, Query, ServerError};
use crate::events::{exec_event, exec_event_checked, ExecInfo};
use crate::sandboxes::running;
use crate::trajectory::{self, Begin, Pending};
use crate::trajectory_store::{StepRequest, StepResult};
use crate::SharedState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use sandlot_api::{ApiError, Backend, ErrorCode, ExecEvent, ExecRequest, ExecResult};
use serde::Deserialize;
use tokio::sync::mpsc;

/// Largest `max_output_bytes` (64 MiB).
pub const MAX_OUTPUT_BYTES: u64 = 64 << 20;

/// Query of the exec route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecQuery {
    /// `true` for NDJSON streaming.
    #[serde(default)]
    pub stream: bool,
}

/// Check the fields the server owns (the node validates too).
///
/// # Errors
/// `invalid_argument` for a timeout outside (0, 86400], an empty argv or a blank shell
/// string.
pub fn validate(req: &ExecRequest) -> ApiResult<()> {
    if let Some(t) = req.timeout_s {
        sandlot_api::check_timeout_s("timeout_s", t).map_err(ServerError::invalid)?;
    }
    if let Some(m) = req.max_output_bytes {
        if m > MAX_OUTPUT_BYTES {
            return Err(ServerError::invalid(format!(
                "max_output_bytes = {m} is over {MAX_OUTPUT_BYTES}"
            )));
        }
    }
    match &req.cmd {
        sandlot_api::Cmd::Argv(v) if v.is_empty() => {
            Err(ServerError::invalid("cmd must not be an empty list"))
        }
        // `sh -c ""` would "succeed" doing nothing: as meaningless as an empty argv.
        sandlot_api::Cmd::Shell(s) if s.trim().is_empty() => Err(ServerError::invalid(
            "cmd must not be an empty or blank shell string",
        )),
        _ => Ok(()),
    }
}

/// Run an exec to completion in its own task (see module docs).
///
/// # Errors
/// The node's error.
pub async fn run_exec(st: &SharedState, id: &str, req: ExecRequest) -> ApiResult<ExecResult> {
    let node = st.node.clone();
    let id = id.to_owned();
    tokio::spawn(async move { node.exec(&id, &req, None).await })
        .await
        .map_err(|e| ServerError::new(ErrorCode::Internal, format!("exec task failed: {e}")))?
        .map_err(ServerError::from)
}

fn line(ev: &ExecEvent) -> Bytes {
    let mut v = serde_json::to_vec(ev).expect("event serializes");
    v.push(b'\n');
    Bytes::from(v)
}

/// The `exit` record of a stream: the result without the already streamed text.
pub fn exit_event(mut r: ExecResult) -> ExecEvent {
    r.stdout.clear();
    r.stderr.clear();
    r.stdout_b64 = None;
    r.stderr_b64 = None;
    ExecEvent::Exit { result: r }
}

fn ndjson(body: Body) -> Response {
    ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}

/// A replayed step as a stream: logged stdout, stderr, then `exit` with `replayed: true`.
fn replayed_stream(mut r: ExecResult) -> Response {
    r.replayed = true;
    let mut out = Vec::new();
    let (o, e) = (r.stdout_raw(), r.stderr_raw());
    if !o.is_empty() {
        out.extend_from_slice(&line(&ExecEvent::stdout(&o)));
    }
    if !e.is_empty() {
        out.extend_from_slice(&line(&ExecEvent::stderr(&e)));
    }
    out.extend_from_slice(&line(&exit_event(r)));
    ndjson(Body::from(out))
}

fn stream(
    st: &SharedState,
    id: String,
    backend: Backend,
    req: ExecRequest,
    pending: Option<Pending>,
) -> Response {
    let (ev_tx, mut ev_rx) = mpsc::channel::<ExecEvent>(64);
    let (out_tx, out_rx) = mpsc::channel::<Bytes>(64);
    let node = st.node.clone();
    let st = st.clone();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let exec = node.exec(&id, &req, Some(ev_tx));
        tokio::pin!(exec);
        // A gone client only makes the sends fail; the exec itself continues.
        let result = loop {
            tokio::select! {
                biased;
                Some(ev) = ev_rx.recv() => { let _ = out_tx.send(line(&ev)).await; }
                r = &mut exec => break r,
            }
        };
        while let Ok(ev) = ev_rx.try_recv() {
            let _ = out_tx.send(line(&ev)).await;
        }
        let info = ExecInfo::new(&id, backend, &req, "api");
        let secs = started.elapsed().as_secs_f64();
        let durable = match &result {
            Ok(r) => exec_event_checked(&st, info, Ok(r), false, secs),
            Err(e) => exec_event_checked(
                &st,
                info,
                Err(ApiError::new(e.code(), e.to_string())),
                false,
                secs,
            ),
        };
        if let Err(e) = durable {
            // The exec ran, but its audit event is not durable: the call fails.
            let error = ServerError::from(e).api_error();
            let _ = out_tx.send(line(&ExecEvent::Error { error })).await;
            return;
        }
        let result = match (result, &pending) {
            (Ok(r), Some(p)) => {
                let step = StepResult::Exec(r);
                match p.commit(&st, &StepRequest::Exec(req.clone()), &step).await {
                    Ok(()) => match step {
                        StepResult::Exec(r) => Ok(r),
                        _ => unreachable!("built as Exec above"),
                    },
                    Err(e) => {
                        let _ = out_tx
                            .send(line(&ExecEvent::Error {
                                error: e.api_error(),
                            }))
                            .await;
                        return;
                    }
                }
            }
            (r, _) => r,
        };
        drop(pending);
        let last = match result {
            Ok(r) => exit_event(r),
            Err(e) => {
                tracing::info!(sandbox_id = %id, error = %crate::error::chain(&e), "streamed exec failed");
                ExecEvent::Error {
                    error: ServerError::from(e).api_error(),
                }
            }
        };
        let _ = out_tx.send(line(&last)).await;
    });
    let body = futures::stream::unfold(out_rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    });
    ndjson(Body::from_stream(body))
}

/// `POST /v1/sandboxes/{id}/exec` → `ExecResult`, or NDJSON events with `?stream=true`.
/// 404 for an unknown sandbox, 409 when it is not running.
pub async fn exec(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<ExecQuery>,
    Json(req): Json<ExecRequest>,
) -> ApiResult<Response> {
    validate(&req)?;
    let rec = running(&st, &id).await?;
    // No exec while its audit event could not be written (events module docs).
    st.events.ready()?;
    if q.stream {
        let pending = match req.step {
            None => None,
            Some(s) => {
                match trajectory::begin(&st, &rec, s, &StepRequest::Exec(req.clone())).await? {
                    Begin::Replayed(StepResult::Exec(r)) => {
                        let info = ExecInfo::new(&id, rec.backend, &req, "api");
                        exec_event(&st, info, Ok(&r), true, 0.0);
                        return Ok(replayed_stream(r));
                    }
                    Begin::Replayed(_) => return Err(wrong_kind(s)),
                    Begin::Execute(p) => Some(p),
                }
            }
        };
        return Ok(stream(&st, id, rec.backend, req, pending));
    }
    let step = req.step;
    let info = ExecInfo::new(&id, rec.backend, &req, "api");
    let started = std::time::Instant::now();
    let out = trajectory::call_held(&st, &rec, step, StepRequest::Exec(req)).await;
    let secs = started.elapsed().as_secs_f64();
    match out {
        Ok((StepResult::Exec(mut r), replayed, share)) => {
            r.replayed = replayed;
            exec_event_checked(&st, info, Ok(&r), replayed, secs)?;
            // The output stays charged to the exec budget until it has been sent.
            Ok((
                [(header::CONTENT_TYPE, "application/json")],
                crate::budget::exec_json_body(r, share),
            )
                .into_response())
        }
        Ok(_) => Err(wrong_kind(step.unwrap_or(0))),
        // Only node failures are exec outcomes; a refused step (400/409) never ran.
        Err(e @ ServerError::Node(_)) => {
            exec_event(&st, info, Err(e.api_error()), false, secs);
            Err(e)
        }
        Err(e) => Err(e),
    }
}

/// Same digest but another kind cannot happen (the kind is part of the digest).
fn wrong_kind(step: u64) -> ServerError {
    ServerError::new(
        ErrorCode::Internal,
        format!("logged step {step} is not an exec"),
    )
}
