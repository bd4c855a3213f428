//! Audit events: an in-memory ring of the last [`RING_CAPACITY`] events and
//! `GET /v1/events?sandbox=&kind=&since=&limit=`.
//!
//! **Not durable**: the ring lives in the server process; a restart empties it and ids start
//! again at 1 (clients holding a cursor from before the restart get everything after that
//! id of the new process). Operators who need a permanent record should scrape the route or
//! ship the JSON logs, which carry the same facts.
//!
//! Event (JSON): `{"id": N, "time": RFC 3339 UTC with ms, "kind": K, "sandbox": ID|null,
//! "backend": B|null, ...fields of the kind}`. Kinds and their fields:
//!
//! | kind | when | fields |
//! |---|---|---|
//! | `created` | a sandbox is running | `image` |
//! | `deleted` | a sandbox was deleted on the node | |
//! | `expired` | the reaper found its TTL over (a `deleted` follows) | |
//! | `paused`, `resumed` | `POST /v1/sandboxes:pause` / `:resume` | |
//! | `readopted` | re-adopted at server start | |
//! | `lost` | at server start: record not re-adopted, removed | `state` (the record's) |
//! | `exec` | an exec finished or was replayed | `command_digest` (SHA-256 hex of the JSON of `cmd`; the command itself is not kept), `exit_code`, `duration_ms`, `timed_out`, `oom_killed`, `replayed`, `step` (or null), `source` (`api`\|`run_code`) |
//! | `error` | a node operation failed | `op` (`create`\|`exec`\|`delete`\|`pause`\|`resume`), `code`, `message` |
//!
//! Tenants ([`crate::auth`]): each event about a sandbox carries (internally, not in the
//! JSON) the tenant of that sandbox, learnt when the sandbox was created or re-adopted; a
//! caller with a non-admin API key sees only its own tenant's events (events about no
//! sandbox are admin-only).
//!
//! Query: `sandbox` and `kind` filter exactly; `since` is either an event id (a cursor:
//! events with a larger id) or an RFC 3339 time (events at or after it); `limit` 1–1000
//! (default 100). Events come oldest first. When more than `limit` match, a query with a
//! cursor gets the oldest `limit` after it (paging forward) and one without gets the newest
//! `limit` (a dashboard tail). Answer: `{"events": [...], "next": "N"}`: pass `next` as
//! `since` to get only what came after this answer.
use crate::auth::Principal;
use crate::error::{ApiResult, Json, Query, ServerError};
use crate::SharedState;
use axum::extract::State;
use axum::Extension;
use sandlot_api::{ApiError, Backend, ExecRequest, ExecResult};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::sync::Mutex;

/// Events kept in memory; older ones are dropped.
pub const RING_CAPACITY: usize = 10_000;
/// Largest `limit`.
pub const MAX_LIMIT: usize = 1000;

/// One audit event.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    /// Increasing id, from 1 per server process.
    pub id: u64,
    /// RFC 3339 UTC time with milliseconds.
    pub time: String,
    /// Unix milliseconds of `time` (not serialized).
    #[serde(skip)]
    pub time_ms: i64,
    /// Kind (module table).
    pub kind: String,
    /// Sandbox id, when the event is about one.
    pub sandbox: Option<String>,
    /// Backend of that sandbox, when known.
    pub backend: Option<String>,
    /// Tenant of that sandbox (not serialized).
    #[serde(skip)]
    pub tenant: Option<String>,
    /// Fields of the kind.
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// The ring (a mutex held only for pushes and copies, never across an `.await`).
#[derive(Default)]
pub struct EventLog {
    inner: Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    next_id: u64,
    events: VecDeque<Event>,
    /// Tenant of each live sandbox that has one (sandbox id → tenant id).
    owners: std::collections::HashMap<String, String>,
}

/// Kinds after which a sandbox is gone: its owner entry is dropped once tagged.
const FINAL_KINDS: [&str; 2] = ["deleted", "lost"];

/// SHA-256 hex of the JSON of an exec's `cmd` (argv list or shell string).
pub fn command_digest(req: &ExecRequest) -> String {
    let json = serde_json::to_vec(&req.cmd).expect("cmd serializes");
    Sha256::digest(&json)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl EventLog {
    /// Remember that `sandbox` belongs to `tenant` (its later events are tagged with it).
    pub fn set_owner(&self, sandbox: &str, tenant: Option<&str>) {
        if let Some(t) = tenant {
            let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            ring.owners.insert(sandbox.to_owned(), t.to_owned());
        }
    }

    /// Forget the owner of `sandbox` (its create failed).
    pub fn forget_owner(&self, sandbox: &str) {
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        ring.owners.remove(sandbox);
    }

    /// Record an event; returns its id.
    pub fn push(
        &self,
        kind: &str,
        sandbox: Option<&str>,
        backend: Option<Backend>,
        fields: Map<String, Value>,
    ) -> u64 {
        let now = chrono::Utc::now();
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        ring.next_id += 1;
        let id = ring.next_id;
        let tenant = match sandbox {
            Some(s) if FINAL_KINDS.contains(&kind) => ring.owners.remove(s),
            Some(s) => ring.owners.get(s).cloned(),
            None => None,
        };
        if ring.events.len() >= RING_CAPACITY {
            ring.events.pop_front();
        }
        ring.events.push_back(Event {
            id,
            time: now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            time_ms: now.timestamp_millis(),
            kind: kind.to_owned(),
            sandbox: sandbox.map(str::to_owned),
            backend: backend.map(|b| b.as_str().to_owned()),
            tenant,
            fields,
        });
        id
    }

    /// Events matching the filters (see module docs) and the `next` cursor; with
    /// `only_tenant`, only events tagged with that tenant.
    pub fn query(
        &self,
        only_tenant: Option<&str>,
        sandbox: Option<&str>,
        kind: Option<&str>,
        since: &Since,
        limit: usize,
    ) -> (Vec<Event>, u64) {
        let ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let newest = ring.next_id;
        let keep = |e: &&Event| {
            only_tenant.is_none_or(|t| e.tenant.as_deref() == Some(t))
                && sandbox.is_none_or(|s| e.sandbox.as_deref() == Some(s))
                && kind.is_none_or(|k| e.kind == k)
                && match since {
                    Since::All => true,
                    Since::After(id) => e.id > *id,
                    Since::AtOrAfterMs(t) => e.time_ms >= *t,
                }
        };
        match since {
            Since::After(_) => {
                let out: Vec<Event> = ring
                    .events
                    .iter()
                    .filter(keep)
                    .take(limit)
                    .cloned()
                    .collect();
                let next = if out.len() == limit {
                    out.last().map_or(newest, |e| e.id)
                } else {
                    newest
                };
                (out, next)
            }
            _ => {
                let mut out: Vec<Event> = ring
                    .events
                    .iter()
                    .rev()
                    .filter(keep)
                    .take(limit)
                    .cloned()
                    .collect();
                out.reverse();
                (out, newest)
            }
        }
    }

    /// Record a failed node operation.
    pub fn error(&self, op: &str, sandbox: Option<&str>, backend: Option<Backend>, e: ApiError) {
        let mut f = Map::new();
        f.insert("op".into(), op.into());
        f.insert(
            "code".into(),
            serde_json::to_value(e.code).unwrap_or(Value::Null),
        );
        f.insert("message".into(), e.message.into());
        self.push("error", sandbox, backend, f);
    }
}

/// Parsed `since`.
#[derive(Debug, Clone, PartialEq)]
pub enum Since {
    /// No `since`.
    All,
    /// Events with an id above this.
    After(u64),
    /// Events at or after this Unix ms.
    AtOrAfterMs(i64),
}

impl Since {
    /// Parse `since`: digits → cursor, else RFC 3339.
    ///
    /// # Errors
    /// 400 `invalid_argument` for anything else.
    pub fn parse(s: Option<&str>) -> ApiResult<Since> {
        let Some(s) = s else { return Ok(Since::All) };
        if let Ok(id) = s.parse::<u64>() {
            return Ok(Since::After(id));
        }
        chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| Since::AtOrAfterMs(t.timestamp_millis()))
            .map_err(|e| {
                ServerError::invalid(format!(
                    "since {s:?} must be an event id or an RFC 3339 time: {e}"
                ))
            })
    }
}

/// What an exec event says about its request.
pub struct ExecInfo<'a> {
    /// Sandbox id.
    pub sandbox: &'a str,
    /// Its backend.
    pub backend: Backend,
    /// [`command_digest`] of the request.
    pub digest: String,
    /// Trajectory step, if any.
    pub step: Option<u64>,
    /// `api` or `run_code`.
    pub source: &'static str,
}

impl<'a> ExecInfo<'a> {
    /// Info of `req` on `sandbox`.
    pub fn new(
        sandbox: &'a str,
        backend: Backend,
        req: &ExecRequest,
        source: &'static str,
    ) -> Self {
        ExecInfo {
            sandbox,
            backend,
            digest: command_digest(req),
            step: req.step,
            source,
        }
    }
}

/// Record the summary of an exec and, when it ran on the node (not replayed), observe
/// `secs` in `sandlot_exec_seconds`.
pub fn exec_event(
    st: &SharedState,
    info: ExecInfo<'_>,
    out: Result<&ExecResult, ApiError>,
    replayed: bool,
    secs: f64,
) {
    let ExecInfo {
        sandbox,
        backend,
        digest,
        step,
        source,
    } = info;
    if !replayed {
        let outcome = crate::metrics::exec_outcome(out.as_ref().ok().copied());
        st.metrics.exec_done(backend, outcome, secs);
    }
    match out {
        Ok(r) => {
            let mut f = Map::new();
            f.insert("command_digest".into(), digest.into());
            f.insert("exit_code".into(), r.exit_code.into());
            f.insert("duration_ms".into(), r.duration_ms.into());
            f.insert("timed_out".into(), r.timed_out.into());
            f.insert("oom_killed".into(), r.oom_killed.into());
            f.insert("replayed".into(), replayed.into());
            f.insert("step".into(), step.into());
            f.insert("source".into(), source.into());
            record(st, "exec", Some(sandbox), Some(backend), f);
        }
        Err(e) => {
            st.metrics.event("error");
            st.events.error("exec", Some(sandbox), Some(backend), e);
        }
    }
}

/// Record an event and count it in `sandlot_events_total`.
pub fn record(
    st: &SharedState,
    kind: &str,
    sandbox: Option<&str>,
    backend: Option<Backend>,
    fields: Map<String, Value>,
) {
    st.metrics.event(kind);
    st.events.push(kind, sandbox, backend, fields);
}

/// Record an `error` event of a failed node operation.
pub fn record_error(
    st: &SharedState,
    op: &str,
    sandbox: Option<&str>,
    backend: Option<Backend>,
    err: &ServerError,
) {
    st.metrics.event("error");
    st.events.error(op, sandbox, backend, err.api_error());
}

/// Query of `GET /v1/events`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Only events of this sandbox.
    pub sandbox: Option<String>,
    /// Only events of this kind.
    pub kind: Option<String>,
    /// Event id (cursor) or RFC 3339 time.
    pub since: Option<String>,
    /// Most events answered (1–1000, default 100).
    pub limit: Option<usize>,
}

/// `GET /v1/events` → `{"events": [...], "next": "N"}` (module docs).
pub async fn list(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Query(q): Query<EventsQuery>,
) -> ApiResult<Json<Value>> {
    let since = Since::parse(q.since.as_deref())?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ServerError::invalid(format!(
            "limit = {limit} must be in [1, {MAX_LIMIT}]"
        )));
    }
    let (events, next) = st.events.query(
        who.only_tenant(),
        q.sandbox.as_deref(),
        q.kind.as_deref(),
        &since,
        limit,
    );
    Ok(Json(serde_json::json!({
        "events": events,
        "next": next.to_string(),
    })))
}
