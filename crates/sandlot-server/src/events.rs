//! Audit events: a durable SQLite log (`events.db` in the data directory) fronted by an
//! in-memory ring of the last [`RING_CAPACITY`] events, and
//! `GET /v1/events?sandbox=&kind=&since=&limit=`.
//!
//! **Durable**: each event is inserted (WAL, `synchronous=NORMAL`: it survives a crash of
//! the server process; a power loss may lose the last transactions) before [`EventLog::push`]
//! returns. An event gets its id only when its insert commits (the next after the highest
//! id ever stored: the table is `AUTOINCREMENT`, so an id is never reused, not even after
//! the newest rows are gone), and only committed events are visible, so ids keep increasing
//! across restarts and a cursor taken before a restart stays valid. The log keeps the newest
//! [`RETENTION`] events (older rows are pruned). Queries the ring can answer never touch the
//! database; older ones read it.
//!
//! **Not durable → not silent** (issue 25): an insert that fails (disk full) puts the event,
//! still without an id, in a bounded queue of [`PENDING_CAPACITY`] events that is written
//! first, in order, before every later event and on every reaper pass; while it is not
//! empty every later event joins it. [`EventLog::push`] then answers
//! [`EventNotDurable`], and the call that caused the event fails with `503 unavailable`
//! (a create is rolled back first; an exec has run). Deletes and events with no caller (the
//! reaper's, start-up re-adoption, background process exits) keep their event in the
//! queue and do not fail: deleting is how space comes back. [`EventLog::ready`] (checked
//! before creates and execs) refuses new work while the queue cannot be written.
//! Gauges/counters: `sandlot_events_pending`, `sandlot_events_dropped_total` (queue full:
//! the newest event is dropped, logged at ERROR).
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
//! | `exec` | an exec finished or was replayed | `command_digest` (SHA-256 hex of the JSON of `cmd`; the command itself is not kept), `exit_code`, `signal`, `duration_ms`, `timed_out`, `oom_killed`, `truncated`, `stdout_bytes`, `stderr_bytes`, `violations` (how many `violation` events of this exec precede it), `replayed`, `step` (or null), `source` (`api`\|`run_code`) |
//! | `error` | a node operation failed | `op` (`create`\|`exec`\|`delete`\|`pause`\|`resume`), `code`, `message` |
//! | `violation` | a refused dangerous attempt: a denied syscall reported by the exec's seccomp supervisor or gVisor's sentry log, or a DNS query or packet the network policy refused (all after the exec ends, before its `exec` event), or a files API path that would leave the sandbox | `layer` (`seccomp`\|`dns`\|`network`\|`files_api`); seccomp: `syscall`, `nr`, `pid`, `at` (RFC 3339 time of the refusal, the sandbox's clock), `command_digest`, `action` (`EPERM`); dns: `name`, `qtype`, `at`, `command_digest`, `action` (`REFUSED`); network: `protocol`, `dst`, `at`, `command_digest`, `action` (`DROP`); files_api: `op`, `path`, `code`, `message` |
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
use rusqlite::{params, Connection, OptionalExtension};
use sandlot_api::{ApiError, Backend, ExecRequest, ExecResult};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::Mutex;

/// Events kept in memory (the newest); older ones are read from the database.
pub const RING_CAPACITY: usize = 10_000;
/// Events kept in the database (the newest); older rows are pruned.
pub const RETENTION: u64 = 1_000_000;
/// Pushes between two prunes of the database.
const PRUNE_EVERY: u64 = 1_000;
/// Largest `limit`.
pub const MAX_LIMIT: usize = 1000;
/// Events waiting for a durable write at most (see module docs).
pub const PENDING_CAPACITY: usize = 10_000;

/// An event could not be written to the events database; it waits in the queue of events
/// to write (see module docs).
#[derive(Debug, thiserror::Error)]
#[error(
    "audit event {kind:?} not written to the events database (queued, {pending} waiting): {source}"
)]
pub struct EventNotDurable {
    /// Event kind.
    pub kind: String,
    /// Events waiting now.
    pub pending: usize,
    /// The failed insert (e.g. `database or disk is full`), or the failure that keeps the
    /// queue from draining.
    #[source]
    pub source: rusqlite::Error,
}

impl From<EventNotDurable> for ServerError {
    fn from(e: EventNotDurable) -> Self {
        ServerError::RetryAfter {
            error: ApiError::new(
                sandlot_api::ErrorCode::Unavailable,
                format!("{e}; retry once the data directory has space"),
            ),
            seconds: 5,
        }
    }
}

/// One audit event.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Event {
    /// Increasing id, from 1, kept across restarts (the log is durable).
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

/// The log: ring plus database (a mutex held for one insert or one query, never across an
/// `.await`). [`EventLog::default`] is memory-only (unit tests of other logic).
#[derive(Default)]
pub struct EventLog {
    inner: Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    /// Highest id committed (or ever stored).
    last_id: u64,
    events: VecDeque<Event>,
    /// Events whose insert failed, oldest first, without ids yet.
    pending: VecDeque<Event>,
    /// Events dropped because `pending` was full.
    dropped: u64,
    db: Option<Connection>,
    /// Lowest id still in the database (ids below it were pruned or never existed).
    db_first_id: u64,
    /// Tenant of each live sandbox that has one (sandbox id → tenant id).
    owners: std::collections::HashMap<String, String>,
}

/// Which database rows a query reads: ids in (`after`, `before`), time at or after
/// `from_ms`, at most `limit`, oldest or newest first.
#[derive(Clone, Copy)]
struct Window {
    after: u64,
    from_ms: i64,
    before: u64,
    newest_first: bool,
    limit: usize,
}

impl Window {
    /// Every row, newest first, at most `limit`.
    fn newest(limit: usize) -> Window {
        Window {
            after: 0,
            from_ms: i64::MIN,
            before: u64::MAX,
            newest_first: true,
            limit,
        }
    }
}

impl Ring {
    /// Whether the ring holds every stored event with an id above `id`.
    fn covers_after(&self, id: u64) -> bool {
        match self.events.front() {
            None => true,
            Some(f) => self.db.is_none() || f.id <= id.saturating_add(1).max(self.db_first_id),
        }
    }

    /// Whether the ring holds every stored event (nothing older is in the database).
    fn covers_all(&self) -> bool {
        self.covers_after(0)
    }

    /// Write `e`; SQLite gives it its id (`AUTOINCREMENT`: above every id ever stored, also
    /// by another writer of the file), set on success, and the ring gets it. On failure
    /// nothing changes and no id is used. The `id` column is authoritative; the JSON body is
    /// written with id 0.
    fn insert(&mut self, mut e: Event) -> Result<(), Box<(Event, rusqlite::Error)>> {
        e.id = 0;
        match &self.db {
            None => e.id = self.last_id + 1,
            Some(db) => {
                let body = serde_json::to_string(&e).expect("event serializes");
                let r = db
                    .prepare_cached(
                        "INSERT INTO events (time_ms, kind, sandbox, tenant, body) \
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                    )
                    .and_then(|mut st| {
                        st.execute(params![e.time_ms, e.kind, e.sandbox, e.tenant, body])
                    });
                if let Err(err) = r {
                    return Err(Box::new((e, err)));
                }
                e.id = db.last_insert_rowid() as u64;
            }
        }
        self.committed(e);
        Ok(())
    }

    /// Write every event of `es` in ONE SQLite transaction (one commit for all); each gets
    /// its id as [`Ring::insert`] gives one, and the ring gets them, in order, once the
    /// transaction commits. On failure nothing is written, no id is used, and the events
    /// come back (in order) with the error.
    fn insert_all(
        &mut self,
        mut es: Vec<Event>,
    ) -> Result<Vec<u64>, Box<(Vec<Event>, rusqlite::Error)>> {
        if self.db.is_none() {
            let mut ids = Vec::with_capacity(es.len());
            for mut e in es {
                e.id = self.last_id + 1;
                ids.push(e.id);
                self.committed(e);
            }
            return Ok(ids);
        }
        let db = self.db.as_ref().expect("checked above");
        let written = (|| -> rusqlite::Result<Vec<u64>> {
            let tx = db.unchecked_transaction()?;
            let mut ids = Vec::with_capacity(es.len());
            {
                let mut st = tx.prepare_cached(
                    "INSERT INTO events (time_ms, kind, sandbox, tenant, body) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?;
                for e in es.iter_mut() {
                    e.id = 0;
                    let body = serde_json::to_string(&*e).expect("event serializes");
                    st.execute(params![e.time_ms, e.kind, e.sandbox, e.tenant, body])?;
                    ids.push(tx.last_insert_rowid() as u64);
                }
            }
            tx.commit()?;
            Ok(ids)
        })();
        match written {
            Err(err) => Err(Box::new((es, err))),
            Ok(ids) => {
                for (mut e, id) in es.into_iter().zip(&ids) {
                    e.id = *id;
                    self.committed(e);
                }
                Ok(ids)
            }
        }
    }

    /// Book keeping of an event whose insert committed with its id: the newest id, the
    /// database's pruning, the ring.
    fn committed(&mut self, e: Event) {
        self.last_id = e.id;
        self.prune(e.id);
        if self.events.len() >= RING_CAPACITY {
            self.events.pop_front();
        }
        self.events.push_back(e);
    }

    /// Write the queued events in order; the first failure stops (and is returned).
    fn flush(&mut self) -> Result<(), rusqlite::Error> {
        while let Some(e) = self.pending.pop_front() {
            if let Err(failed) = self.insert(e) {
                let (e, err) = *failed;
                self.pending.push_front(e);
                return Err(err);
            }
        }
        Ok(())
    }

    /// Queue `e` for a later write (the newest is dropped when the queue is full).
    fn queue(&mut self, e: Event) {
        if self.pending.len() >= PENDING_CAPACITY {
            self.dropped += 1;
            tracing::error!(kind = %e.kind, sandbox = ?e.sandbox, "audit event dropped: the queue of events waiting for the events database is full");
            return;
        }
        self.pending.push_back(e);
    }

    fn prune(&mut self, id: u64) {
        let Some(db) = &self.db else { return };
        let e_id = id;
        if e_id.is_multiple_of(PRUNE_EVERY) && e_id > RETENTION {
            let first = e_id - RETENTION + 1;
            match db.execute("DELETE FROM events WHERE id < ?1", params![first]) {
                Ok(_) => self.db_first_id = first,
                Err(err) => tracing::warn!(error = %err, "pruning the events database failed"),
            }
        }
    }

    /// Read the rows of `w` matching `tenant`, `sandbox` and `kind` from the database. Rows
    /// that fail to parse are skipped with a warning.
    fn select(
        &self,
        tenant: Option<&str>,
        sandbox: Option<&str>,
        kind: Option<&str>,
        w: Window,
    ) -> Vec<Event> {
        let Window {
            after,
            from_ms,
            before,
            newest_first,
            limit,
        } = w;
        let Some(db) = &self.db else {
            return Vec::new();
        };
        let sql = format!(
            "SELECT body, time_ms, tenant, id FROM events WHERE (?1 IS NULL OR sandbox = ?1) \
             AND (?2 IS NULL OR kind = ?2) AND id > ?3 AND time_ms >= ?4 AND id < ?5 \
             AND (?7 IS NULL OR tenant = ?7) ORDER BY id {} LIMIT ?6",
            if newest_first { "DESC" } else { "ASC" }
        );
        let rows = db.prepare_cached(&sql).and_then(|mut st| {
            st.query_map(
                params![
                    sandbox,
                    kind,
                    after.min(i64::MAX as u64),
                    from_ms,
                    before.min(i64::MAX as u64),
                    limit as i64,
                    tenant
                ],
                |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, Option<String>>(2)?,
                        r.get::<_, i64>(3)?,
                    ))
                },
            )?
            .collect::<Result<Vec<_>, _>>()
        });
        match rows {
            Ok(rows) => rows
                .into_iter()
                .filter_map(|(body, ms, tenant, id)| match serde_json::from_str::<Event>(&body) {
                    Ok(mut e) => {
                        e.id = id as u64;
                        e.time_ms = ms;
                        e.tenant = tenant;
                        Some(e)
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "unreadable row in the events database skipped");
                        None
                    }
                })
                .collect(),
            Err(err) => {
                tracing::error!(error = %err, "reading the events database failed; answering from memory");
                Vec::new()
            }
        }
    }
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

/// Rebuild an `events` table of an older version (`id INTEGER PRIMARY KEY` without
/// `AUTOINCREMENT`) as `AUTOINCREMENT`, rows kept, in one transaction.
fn migrate_autoincrement(c: &Connection) -> rusqlite::Result<()> {
    let sql: String = c.query_row(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'events'",
        [],
        |r| r.get(0),
    )?;
    if sql.to_ascii_uppercase().contains("AUTOINCREMENT") {
        return Ok(());
    }
    c.execute_batch(
        "BEGIN IMMEDIATE;
         CREATE TABLE events_v2 (
            id INTEGER PRIMARY KEY AUTOINCREMENT, time_ms INTEGER NOT NULL,
            kind TEXT NOT NULL, sandbox TEXT, tenant TEXT, body TEXT NOT NULL);
         INSERT INTO events_v2 (id, time_ms, kind, sandbox, tenant, body)
            SELECT id, time_ms, kind, sandbox, tenant, body FROM events;
         DROP TABLE events;
         ALTER TABLE events_v2 RENAME TO events;
         COMMIT;",
    )
}

impl EventLog {
    /// Open (creating if needed) the events database at `path` and load its newest
    /// [`RING_CAPACITY`] events into the ring; ids continue after the highest stored one.
    ///
    /// # Errors
    /// The file cannot be opened or its schema applied.
    pub fn open(path: &Path) -> anyhow::Result<EventLog> {
        use anyhow::Context;
        let db = Connection::open(path)
            .inspect(|_| crate::store::owner_only(path))
            .and_then(|c| {
                c.execute_batch(
                    "PRAGMA journal_mode=WAL;
                     PRAGMA synchronous=NORMAL;
                     PRAGMA busy_timeout=5000;
                     CREATE TABLE IF NOT EXISTS events (
                        id INTEGER PRIMARY KEY AUTOINCREMENT, time_ms INTEGER NOT NULL,
                        kind TEXT NOT NULL, sandbox TEXT, tenant TEXT, body TEXT NOT NULL);",
                )?;
                migrate_autoincrement(&c)?;
                c.execute_batch(
                    "CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox, id);
                     CREATE INDEX IF NOT EXISTS events_kind ON events(kind, id);
                     CREATE INDEX IF NOT EXISTS events_time ON events(time_ms);",
                )?;
                Ok(c)
            })
            .with_context(|| format!("open events database {}", path.display()))?;
        let (first, last): (Option<u64>, Option<u64>) = db
            .query_row("SELECT MIN(id), MAX(id) FROM events", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()
            .with_context(|| format!("read events database {}", path.display()))?
            .unwrap_or((None, None));
        // The highest id ever stored: AUTOINCREMENT keeps it even when those rows are gone.
        let seq: Option<u64> = db
            .query_row(
                "SELECT seq FROM sqlite_sequence WHERE name = 'events'",
                [],
                |r| r.get(0),
            )
            .optional()
            .with_context(|| format!("read events database {}", path.display()))?;
        let mut ring = Ring {
            last_id: last.unwrap_or(0).max(seq.unwrap_or(0)),
            db_first_id: first.unwrap_or(1),
            db: Some(db),
            ..Ring::default()
        };
        let mut tail = ring.select(None, None, None, Window::newest(RING_CAPACITY));
        tail.reverse();
        ring.events = tail.into();
        Ok(EventLog {
            inner: Mutex::new(ring),
        })
    }

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

    /// Record an event durably (see module docs); returns its id.
    ///
    /// # Errors
    /// [`EventNotDurable`]: the event (or an earlier one still queued) could not be
    /// written; it waits in the queue.
    pub fn push(
        &self,
        kind: &str,
        sandbox: Option<&str>,
        backend: Option<Backend>,
        fields: Map<String, Value>,
    ) -> Result<u64, EventNotDurable> {
        let now = chrono::Utc::now();
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let tenant = match sandbox {
            Some(s) if FINAL_KINDS.contains(&kind) => ring.owners.remove(s),
            Some(s) => ring.owners.get(s).cloned(),
            None => None,
        };
        let e = Event {
            id: 0,
            time: now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            time_ms: now.timestamp_millis(),
            kind: kind.to_owned(),
            sandbox: sandbox.map(str::to_owned),
            backend: backend.map(|b| b.as_str().to_owned()),
            tenant,
            fields,
        };
        let failed = match ring.flush() {
            Err(err) => Some((e, err)),
            Ok(()) => ring.insert(e).err().map(|b| *b),
        };
        match failed {
            None => Ok(ring.last_id),
            Some((e, source)) => {
                tracing::error!(kind, error = %source, pending = ring.pending.len() + 1, "audit event not written to the events database; queued for retry");
                ring.queue(e);
                Err(EventNotDurable {
                    kind: kind.to_owned(),
                    pending: ring.pending.len(),
                    source,
                })
            }
        }
    }

    /// [`EventLog::push`] of several events, written in ONE transaction (a batch create's
    /// chunk, a pause or resume by label's chunk): all of them are durable when this returns
    /// `Ok` (their ids, in order), or none is and all wait in the queue, in order.
    ///
    /// # Errors
    /// [`EventNotDurable`] (kind of the first event): the events (or an earlier one still
    /// queued) could not be written; they wait in the queue.
    pub fn push_many(&self, events: Vec<NewEvent<'_>>) -> Result<Vec<u64>, EventNotDurable> {
        let Some(first_kind) = events.first().map(|e| e.kind.to_owned()) else {
            return Ok(Vec::new());
        };
        let now = chrono::Utc::now();
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let es: Vec<Event> = events
            .into_iter()
            .map(|n| {
                let tenant = match n.sandbox {
                    Some(s) if FINAL_KINDS.contains(&n.kind) => ring.owners.remove(s),
                    Some(s) => ring.owners.get(s).cloned(),
                    None => None,
                };
                Event {
                    id: 0,
                    time: now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                    time_ms: now.timestamp_millis(),
                    kind: n.kind.to_owned(),
                    sandbox: n.sandbox.map(str::to_owned),
                    backend: n.backend.map(|b| b.as_str().to_owned()),
                    tenant,
                    fields: n.fields,
                }
            })
            .collect();
        let written = match ring.flush() {
            Err(err) => Err((es, err)),
            Ok(()) => ring.insert_all(es).map_err(|b| *b),
        };
        match written {
            Ok(ids) => Ok(ids),
            Err((es, source)) => {
                tracing::error!(kind = %first_kind, events = es.len(), error = %source, pending = ring.pending.len() + es.len(), "audit events not written to the events database; queued for retry");
                for e in es {
                    ring.queue(e);
                }
                Err(EventNotDurable {
                    kind: first_kind,
                    pending: ring.pending.len(),
                    source,
                })
            }
        }
    }

    /// Write the queued events now; Ok when none is left waiting.
    ///
    /// # Errors
    /// [`EventNotDurable`] (kind `"queued"`) when the queue still cannot be written.
    pub fn ready(&self) -> Result<(), EventNotDurable> {
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if ring.pending.is_empty() {
            return Ok(());
        }
        ring.flush().map_err(|source| EventNotDurable {
            kind: "queued".into(),
            pending: ring.pending.len(),
            source,
        })?;
        tracing::info!("queued audit events written to the events database");
        Ok(())
    }

    /// Make the database refuse writes (`PRAGMA query_only`, a real SQLite refusal), as a
    /// full disk would: for tests of the not-durable path.
    #[cfg(test)]
    pub(crate) fn refuse_writes_for_test(&self, on: bool) {
        let ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let db = ring.db.as_ref().expect("a database");
        db.pragma_update(None, "query_only", on).unwrap();
    }

    /// (events waiting in the queue, events dropped because it was full).
    pub fn pending(&self) -> (usize, u64) {
        let ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        (ring.pending.len(), ring.dropped)
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
        let newest = ring.last_id;
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
            Since::After(after) => {
                let mut out: Vec<Event> = if ring.covers_after(*after) {
                    ring.events
                        .iter()
                        .filter(keep)
                        .take(limit)
                        .cloned()
                        .collect()
                } else {
                    ring.select(
                        only_tenant,
                        sandbox,
                        kind,
                        Window {
                            after: *after,
                            newest_first: false,
                            ..Window::newest(limit)
                        },
                    )
                };
                out.truncate(limit);
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
                let from_ms = match since {
                    Since::AtOrAfterMs(t) => *t,
                    _ => i64::MIN,
                };
                let ring_reaches_back = ring.events.front().is_some_and(|f| f.time_ms < from_ms);
                if out.len() < limit && !ring.covers_all() && !ring_reaches_back {
                    let w = Window {
                        from_ms,
                        before: ring.events.front().map_or(u64::MAX, |f| f.id),
                        ..Window::newest(limit - out.len())
                    };
                    out.extend(ring.select(only_tenant, sandbox, kind, w));
                }
                out.reverse();
                (out, newest)
            }
        }
    }

    /// Record a failed node operation.
    ///
    /// # Errors
    /// As [`EventLog::push`].
    pub fn error(
        &self,
        op: &str,
        sandbox: Option<&str>,
        backend: Option<Backend>,
        e: ApiError,
    ) -> Result<u64, EventNotDurable> {
        let mut f = Map::new();
        f.insert("op".into(), op.into());
        f.insert(
            "code".into(),
            serde_json::to_value(e.code).unwrap_or(Value::Null),
        );
        f.insert("message".into(), e.message.into());
        self.push("error", sandbox, backend, f)
    }
}

/// One event of [`EventLog::push_many`]: what [`EventLog::push`] takes.
pub struct NewEvent<'a> {
    /// Kind (module table).
    pub kind: &'a str,
    /// Sandbox id, when the event is about one.
    pub sandbox: Option<&'a str>,
    /// Backend of that sandbox, when known.
    pub backend: Option<Backend>,
    /// Fields of the kind.
    pub fields: Map<String, Value>,
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

/// [`exec_event_checked`] for callers that answer their own way when the event is not
/// durable (`run_code` reports the exec's outcome; the event waits in the queue).
pub fn exec_event(
    st: &SharedState,
    info: ExecInfo<'_>,
    out: Result<&ExecResult, ApiError>,
    replayed: bool,
    secs: f64,
) {
    let _ = exec_event_checked(st, info, out, replayed, secs);
}

/// Record the summary of an exec (after its `violation` events) and, when it ran on the
/// node (not replayed), observe `secs` in `sandlot_exec_seconds`.
///
/// # Errors
/// [`EventNotDurable`]: one of its events waits in the queue (module docs).
pub fn exec_event_checked(
    st: &SharedState,
    info: ExecInfo<'_>,
    out: Result<&ExecResult, ApiError>,
    replayed: bool,
    secs: f64,
) -> Result<(), EventNotDurable> {
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
            let mut first_err = None;
            if !replayed {
                for v in &r.violations {
                    if let Err(e) = seccomp_violation(st, sandbox, backend, &digest, v) {
                        first_err.get_or_insert(e);
                    }
                }
            }
            let mut f = Map::new();
            f.insert("command_digest".into(), digest.into());
            f.insert("exit_code".into(), r.exit_code.into());
            f.insert("duration_ms".into(), r.duration_ms.into());
            f.insert("timed_out".into(), r.timed_out.into());
            f.insert("oom_killed".into(), r.oom_killed.into());
            f.insert("signal".into(), r.signal.into());
            f.insert("truncated".into(), r.truncated.into());
            f.insert("stdout_bytes".into(), r.stdout_bytes.into());
            f.insert("stderr_bytes".into(), r.stderr_bytes.into());
            f.insert("violations".into(), r.violations.len().into());
            f.insert("replayed".into(), replayed.into());
            f.insert("step".into(), step.into());
            f.insert("source".into(), source.into());
            let r = record(st, "exec", Some(sandbox), Some(backend), f);
            match first_err {
                Some(e) => Err(e),
                None => r,
            }
        }
        Err(e) => {
            st.metrics.event("error");
            st.events
                .error("exec", Some(sandbox), Some(backend), e)
                .map(|_| ())
        }
    }
}

/// Record a `violation` event of a denied syscall and count it in
/// `sandlot_violations_total`.
fn seccomp_violation(
    st: &SharedState,
    sandbox: &str,
    backend: Backend,
    digest: &str,
    v: &sandlot_api::Violation,
) -> Result<(), EventNotDurable> {
    let at = chrono::DateTime::from_timestamp_millis(v.time_unix_ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
    let mut f = Map::new();
    f.insert("layer".into(), v.layer.clone().into());
    if v.layer == "dns" {
        // A query the network policy's resolver refused.
        st.metrics.violation(backend, &v.layer, "query");
        f.insert("name".into(), v.name.clone().into());
        f.insert("qtype".into(), v.qtype.clone().into());
        f.insert("at".into(), at.into());
        f.insert("command_digest".into(), digest.into());
        f.insert("action".into(), "REFUSED".into());
        return record(st, "violation", Some(sandbox), Some(backend), f);
    }
    if v.layer == "network" {
        // A packet the network policy's nft rules dropped (logged at most 10/s).
        let proto = v.protocol.clone().unwrap_or_default();
        st.metrics.violation(backend, &v.layer, &proto);
        f.insert("protocol".into(), proto.into());
        f.insert("dst".into(), v.dst.clone().into());
        f.insert("at".into(), at.into());
        f.insert("command_digest".into(), digest.into());
        f.insert("action".into(), "DROP".into());
        return record(st, "violation", Some(sandbox), Some(backend), f);
    }
    st.metrics.violation(backend, &v.layer, &v.syscall);
    f.insert("syscall".into(), v.syscall.clone().into());
    f.insert("nr".into(), v.nr.into());
    f.insert("pid".into(), v.pid.into());
    f.insert("at".into(), at.into());
    f.insert("command_digest".into(), digest.into());
    f.insert("action".into(), "EPERM".into());
    record(st, "violation", Some(sandbox), Some(backend), f)
}

/// Record a `violation` event of a files API call refused because its path would leave the
/// sandbox (`..`, a symlink out, a path into the agent's or runtime's own files), and count
/// it in `sandlot_violations_total`.
pub fn files_violation(
    st: &SharedState,
    sandbox: &str,
    backend: Backend,
    op: &str,
    path: &str,
    e: &ApiError,
) {
    st.metrics.violation(backend, "files_api", op);
    let mut f = Map::new();
    f.insert("layer".into(), "files_api".into());
    f.insert("op".into(), op.into());
    f.insert("path".into(), path.into());
    f.insert(
        "code".into(),
        serde_json::to_value(e.code).unwrap_or(Value::Null),
    );
    f.insert("message".into(), e.message.clone().into());
    // The call is refused anyway; a non-durable event waits in the queue.
    let _ = record(st, "violation", Some(sandbox), Some(backend), f);
}

/// Record an event and count it in `sandlot_events_total`.
///
/// # Errors
/// [`EventNotDurable`]: the event waits in the queue (module docs); a caller that has a
/// client fails its call with it, one that has none (the reaper) leaves it there.
pub fn record(
    st: &SharedState,
    kind: &str,
    sandbox: Option<&str>,
    backend: Option<Backend>,
    fields: Map<String, Value>,
) -> Result<(), EventNotDurable> {
    st.metrics.event(kind);
    st.events.push(kind, sandbox, backend, fields).map(|_| ())
}

/// [`record`] of several events in ONE write of the events database (a batch create's
/// chunk, a label pause/resume chunk): all durable, or none (then all wait in the queue and
/// every call they belong to fails, as [`record`]'s). Each is counted in
/// `sandlot_events_total`.
///
/// # Errors
/// [`EventNotDurable`], as [`EventLog::push_many`].
pub fn record_many(st: &SharedState, events: Vec<NewEvent<'_>>) -> Result<(), EventNotDurable> {
    for e in &events {
        st.metrics.event(e.kind);
    }
    st.events.push_many(events).map(|_| ())
}

/// [`record`] for events with no caller to fail (the reaper's, start-up, background
/// process exits, deletes): a non-durable event waits in the queue (logged there).
pub fn record_queued(
    st: &SharedState,
    kind: &str,
    sandbox: Option<&str>,
    backend: Option<Backend>,
    fields: Map<String, Value>,
) {
    let _ = record(st, kind, sandbox, backend, fields);
}

/// Record an `error` event of a failed node operation (the call fails with that error
/// anyway; a non-durable event waits in the queue).
pub fn record_error(
    st: &SharedState,
    op: &str,
    sandbox: Option<&str>,
    backend: Option<Backend>,
    err: &ServerError,
) {
    st.metrics.event("error");
    let _ = st.events.error(op, sandbox, backend, err.api_error());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn push(log: &EventLog, kind: &str) -> Result<u64, EventNotDurable> {
        log.push(kind, Some("sb-1"), None, Map::new())
    }

    fn ids_and_kinds(log: &EventLog) -> Vec<(u64, String)> {
        let (evs, _) = log.query(None, None, None, &Since::All, 1000);
        evs.into_iter().map(|e| (e.id, e.kind)).collect()
    }

    #[test]
    fn an_event_that_cannot_be_written_is_queued_not_shown_and_gets_its_id_on_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.db");
        let log = EventLog::open(&path).unwrap();
        assert_eq!(push(&log, "a").unwrap(), 1);
        assert_eq!(push(&log, "b").unwrap(), 2);
        log.refuse_writes_for_test(true);
        let e = push(&log, "c").unwrap_err();
        assert_eq!(e.pending, 1);
        assert!(push(&log, "d").is_err());
        assert!(log.ready().is_err());
        assert_eq!(log.pending(), (2, 0));
        // Nothing memory-only is visible, and no id was handed out.
        assert_eq!(ids_and_kinds(&log), [(1, "a".into()), (2, "b".into())]);
        log.refuse_writes_for_test(false);
        log.ready().unwrap();
        assert_eq!(log.pending(), (0, 0));
        assert_eq!(
            ids_and_kinds(&log),
            [
                (1, "a".into()),
                (2, "b".into()),
                (3, "c".into()),
                (4, "d".into())
            ]
        );
        drop(log);
        let log = EventLog::open(&path).unwrap();
        assert_eq!(push(&log, "e").unwrap(), 5, "ids continue after a restart");
    }

    fn many<'a>(kinds: &[&'a str]) -> Vec<NewEvent<'a>> {
        kinds
            .iter()
            .map(|k| NewEvent {
                kind: k,
                sandbox: Some("sb-1"),
                backend: None,
                fields: Map::new(),
            })
            .collect()
    }

    #[test]
    fn push_many_writes_all_in_one_transaction_or_queues_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.db");
        let log = EventLog::open(&path).unwrap();
        assert_eq!(push(&log, "a").unwrap(), 1);
        assert_eq!(log.push_many(many(&["b", "c", "d"])).unwrap(), [2, 3, 4]);
        assert_eq!(log.push_many(Vec::new()).unwrap(), Vec::<u64>::new());
        // Not durable: none of them is visible, all wait in the queue, in order.
        log.refuse_writes_for_test(true);
        let e = log.push_many(many(&["e", "f"])).unwrap_err();
        assert_eq!((e.kind.as_str(), e.pending), ("e", 2));
        assert!(log.push_many(many(&["g"])).is_err(), "the queue goes first");
        assert_eq!(log.pending(), (3, 0));
        assert_eq!(ids_and_kinds(&log).len(), 4);
        log.refuse_writes_for_test(false);
        assert_eq!(log.push_many(many(&["h", "i"])).unwrap(), [8, 9]);
        let want: Vec<(u64, String)> = ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
            .iter()
            .enumerate()
            .map(|(i, k)| (i as u64 + 1, k.to_string()))
            .collect();
        assert_eq!(ids_and_kinds(&log), want);
        drop(log);
        // Durable: all of them are in the database after a restart.
        let log = EventLog::open(&path).unwrap();
        assert_eq!(ids_and_kinds(&log), want);
    }

    #[test]
    fn ids_are_never_reused_even_when_the_newest_rows_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.db");
        let log = EventLog::open(&path).unwrap();
        for k in ["a", "b", "c"] {
            push(&log, k).unwrap();
        }
        drop(log);
        let c = Connection::open(&path).unwrap();
        c.execute("DELETE FROM events WHERE id >= 2", []).unwrap();
        drop(c);
        let log = EventLog::open(&path).unwrap();
        assert_eq!(push(&log, "d").unwrap(), 4);
    }

    #[test]
    fn a_database_of_the_previous_schema_is_migrated_with_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.db");
        let c = Connection::open(&path).unwrap();
        c.execute_batch(
            "CREATE TABLE events (id INTEGER PRIMARY KEY, time_ms INTEGER NOT NULL,
               kind TEXT NOT NULL, sandbox TEXT, tenant TEXT, body TEXT NOT NULL);
             INSERT INTO events VALUES (7, 0, 'old', NULL, NULL,
               '{\"id\":7,\"time\":\"1970-01-01T00:00:00.000Z\",\"kind\":\"old\",\"sandbox\":null,\"backend\":null}');",
        )
        .unwrap();
        drop(c);
        let log = EventLog::open(&path).unwrap();
        assert_eq!(push(&log, "new").unwrap(), 8);
        assert_eq!(ids_and_kinds(&log), [(7, "old".into()), (8, "new".into())]);
        drop(log);
        let c = Connection::open(&path).unwrap();
        let sql: String = c
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'events'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(sql.contains("AUTOINCREMENT"), "{sql}");
    }
}
