//! envd's `process.Process` service (`spec/envd/process/process.proto`) over Sandlot's
//! background processes (on the sandbox's node, [`crate::processes::ProcRef`]), so it works
//! on every backend and in any image.
//!
//! | method | kind | Sandlot |
//! |---|---|---|
//! | `Start {process: {cmd, args, envs, cwd}, tag, stdin}` | server stream | spawn; events `start {pid}`, `data {stdout\|stderr}` (base64), `keepalive`, then `end {exitCode, exited, status, error}` |
//! | `Connect {process: {pid\|tag}}` | server stream | follow its output from now on |
//! | `List {}` | unary | its running processes |
//! | `SendInput {process, input: {stdin}}` | unary | write stdin (started with `stdin: true`) |
//! | `CloseStdin {process}` | unary | close stdin |
//! | `SendSignal {process, signal: SIGNAL_SIGTERM\|SIGNAL_SIGKILL}` | unary | signal (SIGKILL ends the whole tree) |
//!
//! | `StreamInput` (`start {process}`, then `data {input: {stdin}}` / `keepalive` messages) | client stream | each `data` written to stdin as it arrives; answers `{}` when the body ends (stdin stays open) |
//! | `Update {process, pty: {size: {rows, cols}}}` | unary | resize the process's terminal |
//!
//! Terminals: `Start` with `pty: {size: {rows, cols}}` runs the command on a
//! pseudo-terminal allocated inside the sandbox (Sandlot's background process with `pty`);
//! its output is sent as `data {pty}` events, input (`input: {pty}` or `{stdin}`) goes to
//! the terminal, `Update` resizes it. `StreamInput` waits at most [`STREAM_INPUT_IDLE_S`]
//! s for its next message (and at most its `Connect-Timeout-Ms` in all).
//!
//! **Pids** are the numbers the sandbox's node gives its processes
//! ([`sandlot_api::Process::number`], from 1000 per sandbox); a start's `tag`, its
//! `ProcessConfig` and whether it runs on a terminal are kept in the node's process record
//! (`tag`, `meta` = [`E2bMeta`]). Every call resolves its pid or tag by listing the
//! node's processes of the sandbox, so a process started through one server of a cluster
//! is reached through any other: no server keeps a table of its own. The stream's deadline
//! (`Connect-Timeout-Ms`, the SDK's command `timeout`) is also the process's timeout: when
//! it passes, the process tree is killed. A stream whose client goes away leaves the
//! process running (`commands.connect` reattaches). `cmd: "/bin/bash"` (what
//! `commands.run` sends) falls back to `/bin/sh` in images without bash, dropping `-l`.
//! Keepalive events are sent every `Keepalive-Ping-Interval` seconds (default 50).
//! `cwd` resolves as envd resolves it ([`cwd_of`]): relative to the user's home, `~` expanded.
//! Stdout and stderr keep their own order; their interleaving is not kept exactly.
use super::connect::{
    check_kind, end_stream, message, stream_error, stream_from, stream_request, stream_response,
    unary_ok, unary_request, CallKind, ConnectError,
};
use super::{ensure_home, home_of, E2bUser};
use crate::auth::Principal;
use crate::processes::ProcRef;
use crate::SharedState;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::StreamExt;
use sandlot_api::{Cmd, ExecResult, ProcessEvent, SpawnRequest};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// Default interval of keepalive events, seconds (the SDK asks for 50).
pub const KEEPALIVE_S: u64 = 50;
/// Longest wait of `StreamInput` for its next message, seconds (clients send keepalives
/// more often).
pub const STREAM_INPUT_IDLE_S: u64 = 300;

/// What a process started through `Start` keeps in its record's `meta` on the node
/// (`{"e2b": {"config": …, "pty": …}}`): what `List` reports and whether its output is
/// envd's `pty` stream.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct E2bMeta {
    /// The start request's `ProcessConfig`, as sent.
    pub config: ProcessConfig,
    /// Started with `pty`.
    #[serde(default)]
    pub pty: bool,
}

impl E2bMeta {
    /// The `meta` JSON of a process started with `config`, within
    /// [`sandlot_api::MAX_META_BYTES`]: where the whole config does not fit, its `envs` are
    /// left out, then its `args` (`List` then reports them empty; the process gets them all).
    fn bounded(mut config: ProcessConfig, pty: bool) -> serde_json::Value {
        loop {
            let v = serde_json::json!({ "e2b": E2bMeta { config: config.clone(), pty } });
            let fits = serde_json::to_vec(&v).is_ok_and(|b| b.len() <= sandlot_api::MAX_META_BYTES);
            if fits {
                return v;
            }
            if !config.envs.is_empty() {
                config.envs.clear();
            } else if !config.args.is_empty() {
                config.args.clear();
            } else {
                // Only a huge `cmd` or `cwd` is left: keep the terminal flag.
                config.cmd = String::new();
                config.cwd = None;
                return serde_json::json!({ "e2b": E2bMeta { config, pty } });
            }
        }
    }

    /// The E2B part of a record's `meta`; `None` for a process not started through `Start`.
    fn of(p: &sandlot_api::Process) -> Option<E2bMeta> {
        let v = p.meta.as_ref()?.get("e2b")?;
        serde_json::from_value(v.clone()).ok()
    }
}

/// A process a selector named, as its node's record tells it.
struct Found {
    /// E2B's pid (the record's `number`).
    pid: u32,
    /// The record on the node.
    rec: sandlot_api::Process,
    /// Runs on a terminal.
    pty: bool,
}

/// `process.ProcessConfig`.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ProcessConfig {
    /// Program.
    pub cmd: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment.
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    /// Working directory (default the user's home).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Deserialize)]
struct StartRequest {
    #[serde(default)]
    process: Option<ProcessConfig>,
    #[serde(default)]
    pty: Option<Pty>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct Selected {
    #[serde(default)]
    process: Option<Selector>,
    #[serde(default)]
    input: Option<Input>,
    #[serde(default)]
    signal: Option<serde_json::Value>,
    #[serde(default)]
    pty: Option<Pty>,
}

/// `process.PTY`: `{size: {rows, cols}}` (envd's default 24×80 where `size` is absent).
#[derive(Debug, Default, Deserialize)]
struct Pty {
    #[serde(default)]
    size: Option<PtySizeMsg>,
}

#[derive(Debug, Default, Deserialize)]
struct PtySizeMsg {
    #[serde(default)]
    rows: u32,
    #[serde(default)]
    cols: u32,
}

impl Pty {
    /// The terminal size, checked (1..=1000 rows and cols).
    fn size(&self) -> Result<sandlot_api::PtySize, ConnectError> {
        let (rows, cols) = match &self.size {
            Some(s) => (s.rows, s.cols),
            None => (24, 80),
        };
        let size = sandlot_api::PtySize {
            rows: u16::try_from(rows).unwrap_or(0),
            cols: u16::try_from(cols).unwrap_or(0),
        };
        size.validate().map_err(ConnectError::invalid)?;
        Ok(size)
    }
}

#[derive(Debug, Default, Deserialize)]
struct Selector {
    #[serde(default)]
    pid: Option<serde_json::Value>,
    #[serde(default)]
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct Input {
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    pty: Option<String>,
}

/// `POST /process.Process/{method}`: the methods of the module docs.
pub async fn dispatch(
    State(st): State<SharedState>,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    let who = req
        .extensions()
        .get::<Principal>()
        .cloned()
        .unwrap_or_else(Principal::anonymous);
    let user = req.extensions().get::<E2bUser>().map(|u| u.0.clone());
    let (parts, body) = req.into_parts();
    let headers = parts.headers;
    let streaming = matches!(method.as_str(), "Start" | "Connect" | "StreamInput");
    let fail = |e: ConnectError| {
        if streaming && e.status.is_none() {
            stream_error(e)
        } else {
            e.into_response()
        }
    };
    let kind = if streaming {
        CallKind::Stream
    } else {
        CallKind::Unary
    };
    if !matches!(
        method.as_str(),
        "Start"
            | "Connect"
            | "List"
            | "SendInput"
            | "CloseStdin"
            | "SendSignal"
            | "StreamInput"
            | "Update"
    ) {
        let mut e = ConnectError::new(
            "unimplemented",
            format!("no method process.Process/{method}"),
        );
        e.status = Some(axum::http::StatusCode::NOT_FOUND);
        return e.into_response();
    }
    if let Err(e) = check_kind(&headers, kind) {
        return fail(e);
    }
    if method == "StreamInput" {
        let id = match super::running_sandbox_of(&st, &who, &headers).await {
            Ok(id) => id,
            Err(e) => return fail(e.into()),
        };
        return match stream_input(&st, &id, &headers, body).await {
            Ok(()) => stream_response(Body::from(
                [message(&serde_json::json!({})), end_stream(None)].concat(),
            )),
            Err(e) => stream_error(e),
        };
    }
    let body = match axum::body::to_bytes(body, st.cfg.max_json_bytes).await {
        Ok(b) => b,
        Err(e) => {
            return fail(ConnectError::new(
                "resource_exhausted",
                format!("request body: {e}"),
            ))
        }
    };
    let id = match super::running_sandbox_of(&st, &who, &headers).await {
        Ok(id) => id,
        Err(e) => return fail(e.into()),
    };
    let out = match method.as_str() {
        "Start" => start(&st, &id, user.as_deref(), &headers, &body).await,
        "Connect" => reconnect(&st, &id, &headers, &body).await,
        "List" => list(&st, &id, &body).await,
        "SendInput" => send_input(&st, &id, &body).await,
        "CloseStdin" => close_stdin(&st, &id, &body).await,
        "SendSignal" => send_signal(&st, &id, &body).await,
        "Update" => update(&st, &id, &body).await,
        _ => unreachable!("checked above"),
    };
    out.unwrap_or_else(fail)
}

/// The argv of a `ProcessConfig`: `/bin/bash` falls back to `/bin/sh` where bash is absent.
pub fn argv_of(cfg: &ProcessConfig) -> Vec<String> {
    if cfg.cmd == "/bin/bash" || cfg.cmd == "bash" {
        let mut v = vec![
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            "if [ -x /bin/bash ]; then exec /bin/bash \"$@\"; fi; \
             while [ \"$1\" = -l ]; do shift; done; exec /bin/sh \"$@\""
                .to_owned(),
            "bash".to_owned(),
        ];
        v.extend(cfg.args.iter().cloned());
        return v;
    }
    let mut v = vec![cfg.cmd.clone()];
    v.extend(cfg.args.iter().cloned());
    v
}

/// Seconds of the request's `Connect-Timeout-Ms`, if any.
fn deadline_s(h: &HeaderMap) -> Result<Option<f64>, ConnectError> {
    let Some(v) = h.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let ms: u64 = v
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| ConnectError::invalid("Connect-Timeout-Ms must be a whole number"))?;
    if ms == 0 {
        return Ok(None);
    }
    let s = (ms as f64 / 1000.0).min(sandlot_api::MAX_TIMEOUT_S);
    Ok(Some(s.max(0.001)))
}

/// The interval of a server stream's keepalive events: the request's
/// `Keepalive-Ping-Interval` header (whole seconds, 1–3600; E2B's SDKs send it), else
/// [`KEEPALIVE_S`].
pub(super) fn keepalive_of(h: &HeaderMap) -> Duration {
    let s = h
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(KEEPALIVE_S)
        .clamp(1, 3600);
    Duration::from_secs(s)
}

/// The working directory of a `Start` as envd resolves it (`ExpandAndResolve`): none or
/// empty → the user's home; `~` and `~/x` → in the home; a relative path → joined to the
/// home; the result made absolute and lexically clean (`.` and `..` folded, `..` stopping
/// at `/`).
///
/// # Errors
/// `invalid_argument` for `~other` (another user's home, which envd cannot expand either).
pub fn cwd_of(cwd: Option<&str>, home: &str) -> Result<String, ConnectError> {
    let raw = match cwd {
        None | Some("") => return Ok(home.to_owned()),
        Some(c) if c.starts_with('~') && c != "~" && !c.starts_with("~/") => {
            return Err(ConnectError::invalid(format!(
                "cwd {c:?}: cannot expand another user's home directory"
            )))
        }
        Some(c) => super::filesystem::resolve(c, home)?,
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in raw.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

async fn start(
    st: &SharedState,
    id: &str,
    user: Option<&str>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    let req: StartRequest = stream_request(body)?;
    let pty = req.pty.as_ref().map(Pty::size).transpose()?;
    let cfg = req
        .process
        .ok_or_else(|| ConnectError::invalid("process is required"))?;
    if cfg.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd must not be empty"));
    }
    let is_pty = pty.is_some();
    let meta = E2bMeta::bounded(cfg.clone(), is_pty);
    if let Some(t) = &req.tag {
        if t.len() > sandlot_api::MAX_TAG_BYTES {
            return Err(ConnectError::invalid(format!(
                "tag is {} bytes, over the limit of {}",
                t.len(),
                sandlot_api::MAX_TAG_BYTES
            )));
        }
    }
    let home = home_of(user);
    let mut env = BTreeMap::from([
        ("HOME".to_owned(), home.clone()),
        ("USER".to_owned(), user.unwrap_or("user").to_owned()),
    ]);
    env.extend(cfg.envs.clone());
    ensure_home(st, id, &home).await?;
    let cmd = Cmd::Argv(argv_of(&cfg));
    crate::exec::validate(&sandlot_api::ExecRequest::new(cmd.clone()))?;
    crate::disk_reserve::check(st)?;
    let spawn = SpawnRequest {
        cmd,
        cwd: Some(cwd_of(cfg.cwd.as_deref(), &home)?),
        env,
        stdin_b64: None,
        stdin: req.stdin.unwrap_or(false),
        timeout_s: deadline_s(headers)?,
        max_output_bytes: None,
        user: None,
        pty,
        tag: req.tag,
        meta: Some(meta),
    };
    let rec = crate::sandboxes::running(st, id).await?;
    let p = match st.node.process_spawn(id, spawn).await {
        Ok(p) => p,
        Err(e) => {
            let e = crate::error::ServerError::from(e);
            crate::events::record_error(st, "spawn", Some(id), Some(rec.backend), &e);
            return Err(e.into());
        }
    };
    let mut f = serde_json::Map::new();
    f.insert("process".into(), p.id.clone().into());
    f.insert("api".into(), "e2b".into());
    crate::processes::watch_exit(st, id, rec.backend, &p.id);
    crate::events::record(st, "process_spawned", Some(id), Some(rec.backend), f)
        .map_err(crate::error::ServerError::from)?;
    if p.number == 0 {
        // A node that does not number its processes: no pid could reach this one again.
        return Err(ConnectError::new(
            "unimplemented",
            "the sandbox's node does not number its processes (upgrade it)",
        ));
    }
    let handle = ProcRef::new(st, id, &p.id);
    Ok(follow(
        st,
        id,
        handle,
        is_pty,
        p.number,
        0,
        0,
        keepalive_of(headers),
    ))
}

/// The process a selector names (`pid`: the record's number; `tag`: the newest record
/// with that tag), from the node's records of the sandbox.
async fn select(st: &SharedState, id: &str, sel: Option<&Selector>) -> Result<Found, ConnectError> {
    let sel = sel.ok_or_else(|| ConnectError::invalid("process selector is required"))?;
    let pid = match (&sel.pid, &sel.tag) {
        (Some(p), _) => Some(
            p.as_u64()
                .or_else(|| p.as_str().and_then(|s| s.parse().ok()))
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| ConnectError::invalid(format!("pid {p} is not a uint32")))?,
        ),
        (None, Some(_)) => None,
        (None, None) => return Err(ConnectError::invalid("process selector needs pid or tag")),
    };
    let procs = st.node.process_list(id).await.map_err(node_error)?;
    let rec = match (pid, &sel.tag) {
        (Some(0), _) => None,
        (Some(pid), _) => procs.into_iter().find(|p| p.number == pid),
        (None, Some(t)) => procs
            .into_iter()
            .rev()
            .find(|p| p.tag.as_deref() == Some(t.as_str())),
        (None, None) => None,
    };
    let rec = rec.ok_or_else(|| ConnectError::new("not_found", "process not found"))?;
    Ok(Found {
        pid: rec.number,
        pty: E2bMeta::of(&rec).is_some_and(|m| m.pty),
        rec,
    })
}

/// The process `found` on the sandbox's node (only a handle: its calls go to the node).
fn handle_of(st: &SharedState, id: &str, found: &Found) -> ProcRef {
    ProcRef::new(st, id, &found.rec.id)
}

/// A node error of a process call; an unknown handle is envd's "process not found".
fn node_error(e: sandlot_node_api::NodeError) -> ConnectError {
    match e {
        sandlot_node_api::NodeError::NotFound(_) => {
            ConnectError::new("not_found", "process not found")
        }
        e => crate::error::ServerError::from(e).into(),
    }
}

async fn reconnect(
    st: &SharedState,
    id: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    let req: Selected = stream_request(body)?;
    let found = select(st, id, req.process.as_ref()).await?;
    let h = handle_of(st, id, &found);
    let info = h.info().await.map_err(node_error)?;
    Ok(follow(
        st,
        id,
        h,
        found.pty,
        found.pid,
        info.stdout_bytes,
        info.stderr_bytes,
        keepalive_of(headers),
    ))
}

fn event(e: serde_json::Value) -> Bytes {
    message(&serde_json::json!({ "event": e }))
}

fn data(stream: &str, raw: &[u8]) -> Bytes {
    let b64 = base64::engine::general_purpose::STANDARD.encode(raw);
    event(serde_json::json!({"data": {stream: b64}}))
}

fn raw_of(text: &str, b64: &Option<String>) -> Vec<u8> {
    match b64 {
        Some(b) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .unwrap_or_else(|_| text.as_bytes().to_vec()),
        None => text.as_bytes().to_vec(),
    }
}

/// envd's `EndEvent` of a Sandlot exit record: a signal death is `exitCode -1`,
/// `exited: false`, `status "signal: N"` (as Go's `ProcessState` reports it).
pub fn end_event(r: &ExecResult) -> serde_json::Value {
    let mut end = match r.signal {
        Some(sig) => serde_json::json!({
            "exitCode": -1,
            "exited": false,
            "status": format!("signal: {}", signal_name(sig)),
        }),
        None => serde_json::json!({
            "exitCode": r.exit_code,
            "exited": true,
            "status": format!("exit status {}", r.exit_code),
        }),
    };
    if r.timed_out {
        end["error"] = "the command's timeout passed: its process tree was killed".into();
        end["exitCode"] = (-1).into();
    } else if r.oom_killed {
        end["error"] = "out of memory: the process was killed".into();
    }
    serde_json::json!({ "end": end })
}

fn signal_name(sig: i32) -> String {
    match sig {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        n => n.to_string(),
    }
}

/// Whether sandbox `id` is gone or going (no record, or `deleting`/`deleted`/`lost`): a
/// stream whose process ended for that reason ends as envd's does when its sandbox is
/// killed mid-command — an `unavailable` error, which the SDK answers with a health probe
/// (502 then) and `SandboxNotRunningException` ("killed or reached its end of life"),
/// not with the process's end.
async fn sandbox_gone(st: &SharedState, id: &str) -> bool {
    use sandlot_api::SandboxState as S;
    match st.store.get(id).await {
        Ok(None) => true,
        Ok(Some(r)) => matches!(r.state, S::Deleting | S::Deleted | S::Lost),
        Err(_) => false,
    }
}

/// The error a stream ends with when its sandbox went away under it ([`sandbox_gone`]).
fn sandbox_gone_error(id: &str) -> ConnectError {
    ConnectError::new(
        "unavailable",
        format!("the connection to sandbox {id} ended before the stream completed: the sandbox is being deleted"),
    )
}

/// The stream of a process: `start {pid}`, its output from the offsets, keepalives, `end`.
#[allow(clippy::too_many_arguments)]
fn follow(
    st: &SharedState,
    id: &str,
    h: ProcRef,
    pty: bool,
    pid: u32,
    out_off: u64,
    err_off: u64,
    keepalive: Duration,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    // A terminal's output is one stream, envd's `data {pty}`.
    let out_name = if pty { "pty" } else { "stdout" };
    let (st, id) = (st.clone(), id.to_owned());
    tokio::spawn(async move {
        if tx
            .send(event(serde_json::json!({"start": {"pid": pid}})))
            .await
            .is_err()
        {
            return;
        }
        let out = match h.follow(out_off, err_off).await {
            Ok(o) => o,
            Err(e) => {
                let _ = tx.send(end_stream(Some(&node_error(e)))).await;
                return;
            }
        };
        tokio::pin!(out);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        loop {
            tokio::select! {
                ev = out.next() => {
                    let (msg, last) = match ev {
                        Some(ProcessEvent::Stdout { data: d, data_b64, .. }) => {
                            (data(out_name, &raw_of(&d, &data_b64)), false)
                        }
                        Some(ProcessEvent::Stderr { data: d, data_b64, .. }) => {
                            (data("stderr", &raw_of(&d, &data_b64)), false)
                        }
                        Some(ProcessEvent::Skipped { .. }) => continue,
                        _ if sandbox_gone(&st, &id).await => {
                            let _ = tx.send(end_stream(Some(&sandbox_gone_error(&id)))).await;
                            return;
                        }
                        Some(ProcessEvent::Exit { result }) => (event(end_event(&result)), true),
                        Some(ProcessEvent::Error { error }) => {
                            let e = ConnectError::new(super::connect::code_of(error.code), error.message);
                            let _ = tx.send(end_stream(Some(&e))).await;
                            return;
                        }
                        None => {
                            let _ = tx.send(end_stream(None)).await;
                            return;
                        }
                    };
                    if tx.send(msg).await.is_err() {
                        return; // client gone; the process runs on
                    }
                    if last {
                        let _ = tx.send(end_stream(None)).await;
                        return;
                    }
                }
                _ = tick.tick() => {
                    if tx.send(event(serde_json::json!({"keepalive": {}}))).await.is_err() {
                        return;
                    }
                }
                _ = tx.closed() => return,
            }
        }
    });
    stream_from(rx)
}

#[derive(Debug, Default, Deserialize)]
struct StreamInputMsg {
    #[serde(default)]
    start: Option<Selected>,
    #[serde(default)]
    data: Option<Selected>,
    #[serde(default)]
    keepalive: Option<serde_json::Value>,
}

/// `StreamInput`: messages of the request body as they arrive (module docs).
async fn stream_input(
    st: &SharedState,
    id: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<(), ConnectError> {
    let deadline =
        deadline_s(headers)?.map(|s| tokio::time::Instant::now() + Duration::from_secs_f64(s));
    let idle = Duration::from_secs(STREAM_INPUT_IDLE_S);
    let mut chunks = body.into_data_stream();
    let mut env = super::connect::Envelopes::default();
    let mut target: Option<ProcRef> = None;
    loop {
        while let Some(m) = env.next_message::<StreamInputMsg>()? {
            match (m.start, m.data, m.keepalive) {
                (Some(s), None, None) => {
                    if target.is_some() {
                        return Err(ConnectError::invalid("a second start message"));
                    }
                    let found = select(st, id, s.process.as_ref()).await?;
                    let h = handle_of(st, id, &found);
                    h.info().await.map_err(node_error)?;
                    target = Some(h);
                }
                (None, Some(d), None) => {
                    let h = target.as_ref().ok_or_else(|| {
                        ConnectError::invalid("the first message must be start {process}")
                    })?;
                    let raw = stdin_bytes(d.input.unwrap_or_default())?;
                    h.write_stdin(Bytes::from(raw), false)
                        .await
                        .map_err(ended_is_not_found)?;
                }
                (None, None, Some(_)) => {}
                _ => {
                    return Err(ConnectError::invalid(
                        "a StreamInput message holds exactly one of start, data, keepalive",
                    ))
                }
            }
        }
        let wait = match deadline {
            Some(d) => (d - tokio::time::Instant::now().min(d)).min(idle),
            None => idle,
        };
        match tokio::time::timeout(wait, chunks.next()).await {
            Ok(Some(Ok(c))) => env.push(&c),
            Ok(Some(Err(e))) => {
                return Err(ConnectError::new(
                    "canceled",
                    format!("reading the request body: {e}"),
                ))
            }
            Ok(None) => break,
            Err(_) => {
                return Err(ConnectError::new(
                    "deadline_exceeded",
                    "no input message within the stream's deadline or the idle limit",
                ))
            }
        }
    }
    env.finish()?;
    if target.is_none() {
        return Err(ConnectError::invalid("the stream had no start message"));
    }
    Ok(())
}

async fn list(st: &SharedState, id: &str, body: &Bytes) -> Result<Response, ConnectError> {
    // `ListRequest` has no fields; parsing still rejects a body that is not an object.
    let _: serde_json::Map<String, serde_json::Value> = unary_request(body)?;
    let mut procs = Vec::new();
    for rec in st.node.process_list(id).await.map_err(node_error)? {
        if rec.state != sandlot_api::ProcessState::Running || rec.number == 0 {
            continue;
        }
        // Only what `Start` started (not the REST API's or the interpreter's processes).
        let Some(m) = E2bMeta::of(&rec) else {
            continue;
        };
        let mut p = serde_json::json!({"config": m.config, "pid": rec.number});
        if let Some(t) = rec.tag {
            p["tag"] = t.into();
        }
        procs.push(p);
    }
    Ok(unary_ok(serde_json::json!({ "processes": procs })))
}

/// The input bytes of a `ProcessInput` (`stdin` or `pty`, base64; both go to the process's
/// input: its stdin pipe, or its terminal).
///
/// # Errors
/// `invalid_argument` for bad base64.
fn stdin_bytes(input: Input) -> Result<Vec<u8>, ConnectError> {
    let (field, b64) = match (input.pty, input.stdin) {
        (Some(p), _) => ("pty", p),
        (None, s) => ("stdin", s.unwrap_or_default()),
    };
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| ConnectError::invalid(format!("input.{field} is not base64: {e}")))
}

/// `Update {process, pty: {size}}`: resizes the process's terminal.
async fn update(st: &SharedState, id: &str, body: &Bytes) -> Result<Response, ConnectError> {
    let req: Selected = unary_request(body)?;
    let found = select(st, id, req.process.as_ref()).await?;
    let h = handle_of(st, id, &found);
    let Some(pty) = req.pty.as_ref() else {
        h.info().await.map_err(node_error)?;
        return Ok(unary_ok(serde_json::json!({})));
    };
    let size = pty.size()?;
    if !found.pty {
        return Err(ConnectError::new(
            "failed_precondition",
            "the process has no terminal (start it with pty)",
        ));
    }
    st.node
        .process_resize(id, h.id(), size)
        .await
        .map_err(ended_is_not_found)?;
    Ok(unary_ok(serde_json::json!({})))
}

async fn send_input(st: &SharedState, id: &str, body: &Bytes) -> Result<Response, ConnectError> {
    let req: Selected = unary_request(body)?;
    let raw = stdin_bytes(req.input.unwrap_or_default())?;
    let found = select(st, id, req.process.as_ref()).await?;
    let h = handle_of(st, id, &found);
    h.write_stdin(Bytes::from(raw), false)
        .await
        .map_err(ended_is_not_found)?;
    Ok(unary_ok(serde_json::json!({})))
}

async fn close_stdin(st: &SharedState, id: &str, body: &Bytes) -> Result<Response, ConnectError> {
    let req: Selected = unary_request(body)?;
    let found = select(st, id, req.process.as_ref()).await?;
    let h = handle_of(st, id, &found);
    h.write_stdin(Bytes::new(), true)
        .await
        .map_err(ended_is_not_found)?;
    Ok(unary_ok(serde_json::json!({})))
}

/// A process that already ended is "not found" to envd's clients (the SDK's `kill`
/// answers `False` for it).
fn ended_is_not_found(e: sandlot_node_api::NodeError) -> ConnectError {
    if matches!(e, sandlot_node_api::NodeError::NotFound(_)) {
        return node_error(e);
    }
    let c: ConnectError = e.into();
    if c.code == "failed_precondition" && c.message.contains("exited") {
        ConnectError::new("not_found", c.message)
    } else {
        c
    }
}

/// The Linux number of a `process.Signal` (name or number).
fn signal_of(v: Option<&serde_json::Value>) -> Result<i32, ConnectError> {
    match v {
        Some(serde_json::Value::String(s)) if s == "SIGNAL_SIGKILL" => Ok(9),
        Some(serde_json::Value::String(s)) if s == "SIGNAL_SIGTERM" => Ok(15),
        Some(serde_json::Value::Number(n)) if n.as_i64() == Some(9) => Ok(9),
        Some(serde_json::Value::Number(n)) if n.as_i64() == Some(15) => Ok(15),
        other => Err(ConnectError::invalid(format!(
            "signal {} is not one of SIGNAL_SIGTERM, SIGNAL_SIGKILL",
            other
                .map(|v| v.to_string())
                .unwrap_or_else(|| "(none)".into())
        ))),
    }
}

async fn send_signal(st: &SharedState, id: &str, body: &Bytes) -> Result<Response, ConnectError> {
    let req: Selected = unary_request(body)?;
    let sig = signal_of(req.signal.as_ref())?;
    let _ = &req.pty;
    let found = select(st, id, req.process.as_ref()).await?;
    st.node
        .process_signal(id, &found.rec.id, sig)
        .await
        .map_err(ended_is_not_found)?;
    Ok(unary_ok(serde_json::json!({})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bash_falls_back_to_sh() {
        let cfg = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), "echo hi".into()],
            envs: BTreeMap::new(),
            cwd: None,
        };
        let v = argv_of(&cfg);
        assert_eq!(v[0], "/bin/sh");
        assert_eq!(&v[3..], ["bash", "-l", "-c", "echo hi"]);
        let cfg = ProcessConfig {
            cmd: "/usr/bin/env".into(),
            ..cfg
        };
        assert_eq!(argv_of(&cfg)[0], "/usr/bin/env");
    }

    #[test]
    fn meta_keeps_the_config_within_the_limit() {
        let cfg = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-c".into(), "echo hi".into()],
            envs: BTreeMap::from([("A".into(), "1".into())]),
            cwd: Some("/tmp".into()),
        };
        let rec = |meta: serde_json::Value| sandlot_api::Process {
            meta: Some(meta),
            ..serde_json::from_value(serde_json::json!({
                "id": "pr-00000000000000000000", "sandbox_id": "sb-1", "cmd": "x",
                "state": "running", "started_at": "", "ended_at": null, "stdin_open": false,
                "stdout_bytes": 0, "stderr_bytes": 0, "result": null
            }))
            .unwrap()
        };
        let m = E2bMeta::of(&rec(E2bMeta::bounded(cfg.clone(), true))).unwrap();
        assert!(m.pty);
        assert_eq!((m.config.args, m.config.envs.len()), (cfg.args.clone(), 1));
        // Big envs are left out first, then big args; the flag stays.
        let big = "x".repeat(sandlot_api::MAX_META_BYTES);
        let mut env_heavy = cfg.clone();
        env_heavy.envs.insert("BIG".into(), big.clone());
        let m = E2bMeta::of(&rec(E2bMeta::bounded(env_heavy, false))).unwrap();
        assert!(m.config.envs.is_empty() && m.config.args == cfg.args);
        let mut arg_heavy = cfg;
        arg_heavy.args.push(big);
        let v = E2bMeta::bounded(arg_heavy, true);
        assert!(serde_json::to_vec(&v).unwrap().len() <= sandlot_api::MAX_META_BYTES);
        let m = E2bMeta::of(&rec(v)).unwrap();
        assert!(m.config.args.is_empty() && m.pty);
        // A record without E2B meta (REST, interpreter) is not E2B's.
        assert!(E2bMeta::of(&rec(serde_json::json!({"other": 1}))).is_none());
    }

    #[test]
    fn cwd_resolves_like_envd() {
        let h = "/home/user";
        assert_eq!(cwd_of(None, h).unwrap(), h);
        assert_eq!(cwd_of(Some(""), h).unwrap(), h);
        assert_eq!(cwd_of(Some("~"), h).unwrap(), h);
        assert_eq!(cwd_of(Some("~/a/b"), h).unwrap(), "/home/user/a/b");
        assert_eq!(cwd_of(Some("sub/dir"), h).unwrap(), "/home/user/sub/dir");
        assert_eq!(cwd_of(Some("./x/../y/"), h).unwrap(), "/home/user/y");
        assert_eq!(cwd_of(Some("../../../.."), h).unwrap(), "/");
        assert_eq!(cwd_of(Some("/tmp//a/./b/.."), h).unwrap(), "/tmp/a");
        assert!(cwd_of(Some("~root/x"), h).is_err());
    }

    #[test]
    fn end_events() {
        let r = ExecResult {
            exit_code: 3,
            ..Default::default()
        };
        assert_eq!(end_event(&r)["end"]["exitCode"], 3);
        assert_eq!(end_event(&r)["end"]["status"], "exit status 3");
        let r = ExecResult {
            exit_code: 137,
            signal: Some(9),
            ..Default::default()
        };
        assert_eq!(end_event(&r)["end"]["exitCode"], -1);
        assert_eq!(end_event(&r)["end"]["status"], "signal: killed");
        assert_eq!(signal_of(Some(&"SIGNAL_SIGKILL".into())).unwrap(), 9);
        assert!(signal_of(Some(&"SIGNAL_SIGHUP".into())).is_err());
    }
}
