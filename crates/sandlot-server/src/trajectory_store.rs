//! The trajectory log behind the [`TrajectoryStore`] trait, with its SQLite implementation
//! [`SqliteTrajectoryStore`] (embedded mode, `DATA/trajectories.db`).
//!
//! An entry is (trajectory id, step, kind, request digest, request, result, created_at,
//! replay_count). The trait speaks in domain types ([`StepRequest`], [`StepResult`]) and
//! holds no SQL, so a PostgreSQL implementation (cluster mode) slots in beside SQLite; the
//! routes in [`crate::trajectory`] only call the trait. Its methods are `async` for that
//! reason; the SQLite implementation runs its statements inline (each takes microseconds on
//! a prepared, cached statement behind one mutex-held connection, so a `spawn_blocking` hop
//! would cost more than the statement).
//!
//! [`PgTrajectoryStore`] (cluster mode) keeps the same tables in PostgreSQL.
//!
//! SQLite schema (version 1):
//! - `trajectories(id TEXT PK, next_step INTEGER, replayed_total INTEGER, created_at INTEGER
//!   ms, last_activity INTEGER ms)`;
//! - `steps(trajectory, step, kind, digest, request TEXT json, result TEXT json, exit_code
//!   INTEGER NULL, created_at INTEGER ms, replay_count INTEGER, PK (trajectory, step))`;
//! - `blobs(sha256 TEXT PK, data BLOB)` — written data and exec output streams over
//!   [`INLINE_MAX`] bytes, stored once by content hash; `step_blobs(trajectory, step,
//!   sha256)` records which steps use which blob so deleting a trajectory drops unused blobs.
//!
//! Durability: WAL mode; [`TrajectoryStore::append`] is one transaction, committed before it
//! returns (so before the call is answered). With `synchronous=NORMAL` (default) a commit
//! survives a crash of the server process; with `fsync = true` (`synchronous=FULL`) it also
//! survives power loss, at the cost of an fsync per step.
use async_trait::async_trait;
use base64::Engine as _;
use bytes::Bytes;
use rusqlite::{params, Connection, OptionalExtension};
use sandlot_api::{ExecRequest, ExecResult, FileEntry};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[path = "trajectory_store_pg.rs"]
mod pg;
pub use pg::PgTrajectoryStore;

/// Exec output streams longer than this many bytes go to the `blobs` table.
pub const INLINE_MAX: usize = 1024;

/// Errors of a trajectory store.
#[derive(Debug, thiserror::Error)]
pub enum TrajectoryStoreError {
    /// Opening or migrating the database failed.
    #[error("open trajectory log {path}")]
    Open {
        /// Database file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: rusqlite::Error,
    },
    /// A statement failed.
    #[error("trajectory log: sqlite {op}")]
    Sql {
        /// What was being done.
        op: &'static str,
        /// Cause.
        #[source]
        source: rusqlite::Error,
    },
    /// A PostgreSQL statement failed ([`PgTrajectoryStore`]).
    #[error("trajectory log: postgres {op}")]
    Pg {
        /// What was being done.
        op: &'static str,
        /// Cause.
        #[source]
        source: tokio_postgres::Error,
    },
    /// No database connection could be had (PostgreSQL down or the pool exhausted past its
    /// timeout): the call may be retried later.
    #[error("trajectory log unavailable: {0}")]
    Unavailable(String),
    /// An append for a step other than the next one (another writer got there first).
    #[error(
        "step {step} of trajectory {trajectory:?} cannot be appended: the next step is {next}"
    )]
    NotNext {
        /// Trajectory id.
        trajectory: String,
        /// Step of the append.
        step: u64,
        /// The log's next step.
        next: u64,
    },
    /// A stored entry does not decode (corrupt or written by a newer version).
    #[error("trajectory log entry {trajectory:?} step {step}: {what}")]
    Corrupt {
        /// Trajectory id.
        trajectory: String,
        /// Step.
        step: u64,
        /// What is wrong.
        what: String,
    },
}

type Result<T> = std::result::Result<T, TrajectoryStoreError>;

fn sql(op: &'static str) -> impl FnOnce(rusqlite::Error) -> TrajectoryStoreError {
    move |source| TrajectoryStoreError::Sql { op, source }
}

/// Kind of a logged step (wire names of `GET /v1/trajectories/{id}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// `POST …/exec`.
    Exec,
    /// `PUT …/files`.
    WriteFile,
    /// `DELETE …/files`.
    RemoveFile,
    /// `GET …/files` with `step`.
    ReadFile,
    /// `GET …/files/list` with `step`.
    ListDir,
}

impl StepKind {
    /// Wire name, e.g. `"write_file"`.
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Exec => "exec",
            StepKind::WriteFile => "write_file",
            StepKind::RemoveFile => "remove_file",
            StepKind::ReadFile => "read_file",
            StepKind::ListDir => "list_dir",
        }
    }

    /// True for the kinds a `restore="replay"` re-executes (exec, write_file, remove_file).
    pub fn is_mutating(self) -> bool {
        matches!(
            self,
            StepKind::Exec | StepKind::WriteFile | StepKind::RemoveFile
        )
    }
}

/// A call that may be logged as a step.
#[derive(Debug, Clone, PartialEq)]
pub enum StepRequest {
    /// An exec (its `step` field is not part of the digest).
    Exec(ExecRequest),
    /// A file write.
    WriteFile {
        /// Path inside the sandbox.
        path: String,
        /// Bytes written.
        data: Bytes,
    },
    /// A file (or directory) removal.
    RemoveFile {
        /// Path inside the sandbox.
        path: String,
    },
    /// A file read.
    ReadFile {
        /// Path inside the sandbox.
        path: String,
    },
    /// A directory listing.
    ListDir {
        /// Path inside the sandbox.
        path: String,
    },
}

/// Hex SHA-256.
pub fn sha256_hex(data: &[u8]) -> String {
    let d = Sha256::digest(data);
    let mut s = String::with_capacity(64);
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Canonical exec request: fields in alphabetical order (serde writes struct fields in
/// declaration order), `env` a sorted map, stdin by hash.
#[derive(Serialize)]
struct ExecCanon<'a> {
    cmd: Vec<String>,
    cwd: &'a Option<String>,
    env: &'a BTreeMap<String, String>,
    kind: &'static str,
    max_output_bytes: Option<u64>,
    stdin_sha256: Option<String>,
    timeout_s: Option<f64>,
    user: &'a Option<String>,
}

/// Canonical file request, fields in alphabetical order.
#[derive(Serialize)]
struct FileCanon<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    data_sha256: Option<String>,
    kind: &'static str,
    path: &'a str,
}

impl StepRequest {
    /// Its kind.
    pub fn kind(&self) -> StepKind {
        match self {
            StepRequest::Exec(_) => StepKind::Exec,
            StepRequest::WriteFile { .. } => StepKind::WriteFile,
            StepRequest::RemoveFile { .. } => StepKind::RemoveFile,
            StepRequest::ReadFile { .. } => StepKind::ReadFile,
            StepRequest::ListDir { .. } => StepKind::ListDir,
        }
    }

    /// Hex SHA-256 of the canonical JSON of the request: for exec `{cmd (argv list form),
    /// cwd, env (sorted), kind, max_output_bytes, stdin_sha256 (of the decoded bytes),
    /// timeout_s, user}`, for files `{data_sha256 (writes only), kind, path}`; keys sorted,
    /// absent values `null`, no whitespace (serde_json's compact form).
    pub fn digest(&self) -> String {
        let json = match self {
            StepRequest::Exec(r) => {
                let stdin_sha256 = r.stdin_b64.as_ref().map(|b| {
                    match base64::engine::general_purpose::STANDARD.decode(b) {
                        Ok(raw) => sha256_hex(&raw),
                        Err(_) => sha256_hex(b.as_bytes()),
                    }
                });
                serde_json::to_vec(&ExecCanon {
                    cmd: r.cmd.to_argv(),
                    cwd: &r.cwd,
                    env: &r.env,
                    kind: "exec",
                    max_output_bytes: r.max_output_bytes,
                    stdin_sha256,
                    timeout_s: r.timeout_s,
                    user: &r.user,
                })
            }
            StepRequest::WriteFile { path, data } => serde_json::to_vec(&FileCanon {
                data_sha256: Some(sha256_hex(data)),
                kind: "write_file",
                path,
            }),
            StepRequest::RemoveFile { path }
            | StepRequest::ReadFile { path }
            | StepRequest::ListDir { path } => serde_json::to_vec(&FileCanon {
                data_sha256: None,
                kind: self.kind().as_str(),
                path,
            }),
        }
        .expect("canonical request serialises");
        sha256_hex(&json)
    }
}

/// The logged outcome of a step.
#[derive(Debug, Clone, PartialEq)]
pub enum StepResult {
    /// An exec's result (`replayed` false as logged).
    Exec(ExecResult),
    /// A write or remove that succeeded (nothing to return).
    Done,
    /// The bytes of a read.
    Data(Bytes),
    /// The entries of a listing.
    List(Vec<FileEntry>),
}

impl StepResult {
    /// Exit code of an exec result, else `None`.
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            StepResult::Exec(r) => Some(r.exit_code),
            _ => None,
        }
    }
}

/// One logged step with its result.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedStep {
    /// Step number.
    pub step: u64,
    /// Kind.
    pub kind: StepKind,
    /// Request digest.
    pub digest: String,
    /// Logged result.
    pub result: StepResult,
}

/// One logged step without its result (`GET /v1/trajectories/{id}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSummary {
    /// Step number.
    pub step: u64,
    /// Kind, wire name.
    pub kind: String,
    /// Request digest.
    pub digest: String,
    /// Exit code (exec only).
    pub exit_code: Option<i32>,
    /// When logged, Unix milliseconds.
    pub created_at_ms: i64,
    /// Times it came back from the log.
    pub replay_count: u64,
}

/// A whole log without results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSummary {
    /// Next step number.
    pub next_step: u64,
    /// Steps in order.
    pub steps: Vec<StepSummary>,
    /// Sum of replay counts.
    pub replayed_total: u64,
}

/// Durable per-trajectory log of steps. Implementations serialise nothing themselves beyond
/// their own consistency: the server holds a per-trajectory lock around lookup + execute +
/// append, and [`TrajectoryStore::append`] re-checks `step == next_step` inside its
/// transaction (so two writers can never log the same step twice).
#[async_trait]
pub trait TrajectoryStore: Send + Sync + 'static {
    /// The step number the next new call must carry (0 for an unknown trajectory).
    ///
    /// # Errors
    /// Store failures.
    async fn next_step(&self, trajectory: &str) -> Result<u64>;

    /// A logged step with its result.
    ///
    /// # Errors
    /// Store failures or an undecodable entry.
    async fn get_step(&self, trajectory: &str, step: u64) -> Result<Option<LoggedStep>>;

    /// Count one replay of `step` (its `replay_count` and the trajectory's total).
    ///
    /// # Errors
    /// Store failures.
    async fn record_replay(&self, trajectory: &str, step: u64, now_ms: i64) -> Result<()>;

    /// Append `step` (which must equal the next step) with its request and result, in one
    /// transaction committed before returning.
    ///
    /// # Errors
    /// [`TrajectoryStoreError::NotNext`] when `step` is not the next step; store failures.
    async fn append(
        &self,
        trajectory: &str,
        step: u64,
        request: &StepRequest,
        digest: &str,
        result: &StepResult,
        now_ms: i64,
    ) -> Result<()>;

    /// The whole log without results; `None` for an unknown trajectory.
    ///
    /// # Errors
    /// Store failures.
    async fn summary(&self, trajectory: &str) -> Result<Option<LogSummary>>;

    /// Every logged mutating step (exec, write_file, remove_file) in order, with request and
    /// result, for a restore.
    ///
    /// # Errors
    /// Store failures or an undecodable entry.
    async fn mutating_steps(&self, trajectory: &str)
        -> Result<Vec<(u64, StepRequest, StepResult)>>;

    /// Delete the log of a trajectory. Returns whether it existed.
    ///
    /// # Errors
    /// Store failures.
    async fn delete(&self, trajectory: &str) -> Result<bool>;

    /// Ids of trajectories whose last activity (append or replay) is before `before_ms`.
    ///
    /// # Errors
    /// Store failures.
    async fn inactive_since(&self, before_ms: i64) -> Result<Vec<String>>;
}

// ---- stored encodings (JSON in the `request` and `result` columns) ----

#[derive(Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
enum StoredRequest {
    Exec { r: ExecRequest },
    WriteFile { path: String, data_blob: String },
    RemoveFile { path: String },
    ReadFile { path: String },
    ListDir { path: String },
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
enum StoredResult {
    Exec {
        r: ExecResult,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stdout_blob: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stderr_blob: Option<String>,
    },
    Done,
    Data {
        blob: String,
    },
    List {
        entries: Vec<FileEntry>,
    },
}

/// Blobs to store: (sha256, bytes).
type Blobs = Vec<(String, Bytes)>;

fn blob(blobs: &mut Blobs, data: Bytes) -> String {
    let h = sha256_hex(&data);
    blobs.push((h.clone(), data));
    h
}

fn encode_request(req: &StepRequest, blobs: &mut Blobs) -> String {
    let s = match req {
        StepRequest::Exec(r) => {
            let mut r = r.clone();
            r.step = None;
            StoredRequest::Exec { r }
        }
        StepRequest::WriteFile { path, data } => StoredRequest::WriteFile {
            path: path.clone(),
            data_blob: blob(blobs, data.clone()),
        },
        StepRequest::RemoveFile { path } => StoredRequest::RemoveFile { path: path.clone() },
        StepRequest::ReadFile { path } => StoredRequest::ReadFile { path: path.clone() },
        StepRequest::ListDir { path } => StoredRequest::ListDir { path: path.clone() },
    };
    serde_json::to_string(&s).expect("request serialises")
}

fn encode_result(res: &StepResult, blobs: &mut Blobs) -> String {
    let s = match res {
        StepResult::Exec(r) => {
            let mut r = r.clone();
            r.replayed = false;
            let mut stdout_blob = None;
            let mut stderr_blob = None;
            if r.stdout.len() > INLINE_MAX {
                stdout_blob = Some(blob(blobs, r.stdout_raw().into()));
                r.stdout.clear();
                r.stdout_b64 = None;
            }
            if r.stderr.len() > INLINE_MAX {
                stderr_blob = Some(blob(blobs, r.stderr_raw().into()));
                r.stderr.clear();
                r.stderr_b64 = None;
            }
            StoredResult::Exec {
                r,
                stdout_blob,
                stderr_blob,
            }
        }
        StepResult::Done => StoredResult::Done,
        StepResult::Data(d) => StoredResult::Data {
            blob: blob(blobs, d.clone()),
        },
        StepResult::List(entries) => StoredResult::List {
            entries: entries.clone(),
        },
    };
    serde_json::to_string(&s).expect("result serialises")
}

fn kind_of(s: &str) -> Option<StepKind> {
    Some(match s {
        "exec" => StepKind::Exec,
        "write_file" => StepKind::WriteFile,
        "remove_file" => StepKind::RemoveFile,
        "read_file" => StepKind::ReadFile,
        "list_dir" => StepKind::ListDir,
        _ => return None,
    })
}

/// SQLite implementation of [`TrajectoryStore`]. Cheap to share behind an `Arc`.
pub struct SqliteTrajectoryStore {
    conn: Mutex<Connection>,
}

impl SqliteTrajectoryStore {
    /// Open (creating if needed) the log at `path`. `fsync`: `synchronous=FULL` (a commit
    /// survives power loss) instead of `NORMAL` (survives a process crash).
    ///
    /// # Errors
    /// [`TrajectoryStoreError::Open`] with the path.
    pub fn open(path: &Path, fsync: bool) -> Result<SqliteTrajectoryStore> {
        let open_err = |source| TrajectoryStoreError::Open {
            path: path.to_owned(),
            source,
        };
        let conn = Connection::open(path).map_err(open_err)?;
        crate::store::owner_only(path);
        conn.execute_batch(&format!(
            "PRAGMA journal_mode=WAL;
             PRAGMA synchronous={};
             PRAGMA busy_timeout=5000;
             CREATE TABLE IF NOT EXISTS trajectories (
                id TEXT PRIMARY KEY, next_step INTEGER NOT NULL,
                replayed_total INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL,
                last_activity INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS trajectories_activity ON trajectories(last_activity);
             CREATE TABLE IF NOT EXISTS steps (
                trajectory TEXT NOT NULL, step INTEGER NOT NULL, kind TEXT NOT NULL,
                digest TEXT NOT NULL, request TEXT NOT NULL, result TEXT NOT NULL,
                exit_code INTEGER, created_at INTEGER NOT NULL,
                replay_count INTEGER NOT NULL DEFAULT 0,
                PRIMARY KEY (trajectory, step)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS blobs (sha256 TEXT PRIMARY KEY, data BLOB NOT NULL);
             CREATE TABLE IF NOT EXISTS step_blobs (
                trajectory TEXT NOT NULL, step INTEGER NOT NULL, sha256 TEXT NOT NULL);
             CREATE INDEX IF NOT EXISTS step_blobs_traj ON step_blobs(trajectory);
             CREATE INDEX IF NOT EXISTS step_blobs_sha ON step_blobs(sha256);",
            if fsync { "FULL" } else { "NORMAL" }
        ))
        .map_err(open_err)?;
        Ok(SqliteTrajectoryStore {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // Each statement is atomic, so a lock poisoned by a panic is still usable.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn load_blob(conn: &Connection, t: &str, step: u64, h: &str) -> Result<Bytes> {
        conn.prepare_cached("SELECT data FROM blobs WHERE sha256 = ?1")
            .map_err(sql("prepare blob"))?
            .query_row([h], |r| r.get::<_, Vec<u8>>(0))
            .optional()
            .map_err(sql("select blob"))?
            .map(Bytes::from)
            .ok_or_else(|| TrajectoryStoreError::Corrupt {
                trajectory: t.into(),
                step,
                what: format!("blob {h} missing"),
            })
    }

    fn decode_result(conn: &Connection, t: &str, step: u64, json: &str) -> Result<StepResult> {
        let bad = |what: String| TrajectoryStoreError::Corrupt {
            trajectory: t.into(),
            step,
            what,
        };
        let s: StoredResult =
            serde_json::from_str(json).map_err(|e| bad(format!("result: {e}")))?;
        Ok(match s {
            StoredResult::Exec {
                mut r,
                stdout_blob,
                stderr_blob,
            } => {
                if let Some(h) = stdout_blob {
                    let raw = Self::load_blob(conn, t, step, &h)?;
                    (r.stdout, r.stdout_b64) = sandlot_api::text_and_b64(&raw);
                }
                if let Some(h) = stderr_blob {
                    let raw = Self::load_blob(conn, t, step, &h)?;
                    (r.stderr, r.stderr_b64) = sandlot_api::text_and_b64(&raw);
                }
                StepResult::Exec(r)
            }
            StoredResult::Done => StepResult::Done,
            StoredResult::Data { blob } => StepResult::Data(Self::load_blob(conn, t, step, &blob)?),
            StoredResult::List { entries } => StepResult::List(entries),
        })
    }

    fn decode_request(conn: &Connection, t: &str, step: u64, json: &str) -> Result<StepRequest> {
        let s: StoredRequest =
            serde_json::from_str(json).map_err(|e| TrajectoryStoreError::Corrupt {
                trajectory: t.into(),
                step,
                what: format!("request: {e}"),
            })?;
        Ok(match s {
            StoredRequest::Exec { r } => StepRequest::Exec(r),
            StoredRequest::WriteFile { path, data_blob } => StepRequest::WriteFile {
                data: Self::load_blob(conn, t, step, &data_blob)?,
                path,
            },
            StoredRequest::RemoveFile { path } => StepRequest::RemoveFile { path },
            StoredRequest::ReadFile { path } => StepRequest::ReadFile { path },
            StoredRequest::ListDir { path } => StepRequest::ListDir { path },
        })
    }

    fn next_step_in(conn: &Connection, t: &str) -> Result<u64> {
        Ok(conn
            .prepare_cached("SELECT next_step FROM trajectories WHERE id = ?1")
            .map_err(sql("prepare next step"))?
            .query_row([t], |r| r.get::<_, i64>(0))
            .optional()
            .map_err(sql("select next step"))?
            .unwrap_or(0) as u64)
    }
}

#[async_trait]
impl TrajectoryStore for SqliteTrajectoryStore {
    async fn next_step(&self, trajectory: &str) -> Result<u64> {
        Self::next_step_in(&self.conn(), trajectory)
    }

    async fn get_step(&self, trajectory: &str, step: u64) -> Result<Option<LoggedStep>> {
        let conn = self.conn();
        let row: Option<(String, String, String)> = conn
            .prepare_cached(
                "SELECT kind, digest, result FROM steps WHERE trajectory = ?1 AND step = ?2",
            )
            .map_err(sql("prepare step"))?
            .query_row(params![trajectory, step as i64], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .optional()
            .map_err(sql("select step"))?;
        let Some((kind, digest, result)) = row else {
            return Ok(None);
        };
        let kind = kind_of(&kind).ok_or_else(|| TrajectoryStoreError::Corrupt {
            trajectory: trajectory.into(),
            step,
            what: format!("kind {kind:?}"),
        })?;
        let result = Self::decode_result(&conn, trajectory, step, &result)?;
        Ok(Some(LoggedStep {
            step,
            kind,
            digest,
            result,
        }))
    }

    async fn record_replay(&self, trajectory: &str, step: u64, now_ms: i64) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql("begin"))?;
        tx.prepare_cached(
            "UPDATE steps SET replay_count = replay_count + 1 WHERE trajectory = ?1 AND step = ?2",
        )
        .map_err(sql("prepare replay count"))?
        .execute(params![trajectory, step as i64])
        .map_err(sql("update replay count"))?;
        tx.prepare_cached(
            "UPDATE trajectories SET replayed_total = replayed_total + 1, last_activity = ?2
             WHERE id = ?1",
        )
        .map_err(sql("prepare replay total"))?
        .execute(params![trajectory, now_ms])
        .map_err(sql("update replay total"))?;
        tx.commit().map_err(sql("commit"))
    }

    async fn append(
        &self,
        trajectory: &str,
        step: u64,
        request: &StepRequest,
        digest: &str,
        result: &StepResult,
        now_ms: i64,
    ) -> Result<()> {
        let mut blobs = Blobs::new();
        let req_json = encode_request(request, &mut blobs);
        let res_json = encode_result(result, &mut blobs);
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql("begin"))?;
        let next = Self::next_step_in(&tx, trajectory)?;
        if next != step {
            return Err(TrajectoryStoreError::NotNext {
                trajectory: trajectory.into(),
                step,
                next,
            });
        }
        for (h, data) in &blobs {
            tx.prepare_cached("INSERT OR IGNORE INTO blobs (sha256, data) VALUES (?1, ?2)")
                .map_err(sql("prepare blob insert"))?
                .execute(params![h, &data[..]])
                .map_err(sql("insert blob"))?;
            tx.prepare_cached(
                "INSERT INTO step_blobs (trajectory, step, sha256) VALUES (?1, ?2, ?3)",
            )
            .map_err(sql("prepare step blob"))?
            .execute(params![trajectory, step as i64, h])
            .map_err(sql("insert step blob"))?;
        }
        tx.prepare_cached(
            "INSERT INTO steps (trajectory, step, kind, digest, request, result, exit_code,
             created_at, replay_count) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 0)",
        )
        .map_err(sql("prepare step insert"))?
        .execute(params![
            trajectory,
            step as i64,
            request.kind().as_str(),
            digest,
            req_json,
            res_json,
            result.exit_code(),
            now_ms
        ])
        .map_err(sql("insert step"))?;
        tx.prepare_cached(
            "INSERT INTO trajectories (id, next_step, replayed_total, created_at, last_activity)
             VALUES (?1, ?2, 0, ?3, ?3)
             ON CONFLICT(id) DO UPDATE SET next_step = ?2, last_activity = ?3",
        )
        .map_err(sql("prepare trajectory upsert"))?
        .execute(params![trajectory, (step + 1) as i64, now_ms])
        .map_err(sql("upsert trajectory"))?;
        tx.commit().map_err(sql("commit"))
    }

    async fn summary(&self, trajectory: &str) -> Result<Option<LogSummary>> {
        let conn = self.conn();
        let head: Option<(i64, i64)> = conn
            .query_row(
                "SELECT next_step, replayed_total FROM trajectories WHERE id = ?1",
                [trajectory],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(sql("select trajectory"))?;
        let Some((next, total)) = head else {
            return Ok(None);
        };
        let mut stmt = conn
            .prepare(
                "SELECT step, kind, digest, exit_code, created_at, replay_count FROM steps
                 WHERE trajectory = ?1 ORDER BY step",
            )
            .map_err(sql("prepare steps"))?;
        let steps = stmt
            .query_map([trajectory], |r| {
                Ok(StepSummary {
                    step: r.get::<_, i64>(0)? as u64,
                    kind: r.get(1)?,
                    digest: r.get(2)?,
                    exit_code: r.get(3)?,
                    created_at_ms: r.get(4)?,
                    replay_count: r.get::<_, i64>(5)? as u64,
                })
            })
            .map_err(sql("select steps"))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(sql("read steps"))?;
        Ok(Some(LogSummary {
            next_step: next as u64,
            steps,
            replayed_total: total as u64,
        }))
    }

    async fn mutating_steps(
        &self,
        trajectory: &str,
    ) -> Result<Vec<(u64, StepRequest, StepResult)>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT step, request, result FROM steps WHERE trajectory = ?1
                 AND kind IN ('exec', 'write_file', 'remove_file') ORDER BY step",
            )
            .map_err(sql("prepare mutating steps"))?;
        let rows = stmt
            .query_map([trajectory], |r| {
                Ok((
                    r.get::<_, i64>(0)? as u64,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(sql("select mutating steps"))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(sql("read mutating steps"))?;
        rows.into_iter()
            .map(|(step, req, res)| {
                Ok((
                    step,
                    Self::decode_request(&conn, trajectory, step, &req)?,
                    Self::decode_result(&conn, trajectory, step, &res)?,
                ))
            })
            .collect()
    }

    async fn delete(&self, trajectory: &str) -> Result<bool> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql("begin"))?;
        let n = tx
            .execute("DELETE FROM trajectories WHERE id = ?1", [trajectory])
            .map_err(sql("delete trajectory"))?;
        tx.execute("DELETE FROM steps WHERE trajectory = ?1", [trajectory])
            .map_err(sql("delete steps"))?;
        let hashes: Vec<String> = {
            let mut st = tx
                .prepare("SELECT DISTINCT sha256 FROM step_blobs WHERE trajectory = ?1")
                .map_err(sql("prepare blob refs"))?;
            let v = st
                .query_map([trajectory], |r| r.get(0))
                .map_err(sql("select blob refs"))?
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(sql("read blob refs"))?;
            v
        };
        tx.execute("DELETE FROM step_blobs WHERE trajectory = ?1", [trajectory])
            .map_err(sql("delete blob refs"))?;
        for h in hashes {
            tx.execute(
                "DELETE FROM blobs WHERE sha256 = ?1
                 AND NOT EXISTS (SELECT 1 FROM step_blobs WHERE sha256 = ?1)",
                [&h],
            )
            .map_err(sql("delete blob"))?;
        }
        tx.commit().map_err(sql("commit"))?;
        Ok(n == 1)
    }

    async fn inactive_since(&self, before_ms: i64) -> Result<Vec<String>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT id FROM trajectories WHERE last_activity < ?1 ORDER BY id")
            .map_err(sql("prepare inactive"))?;
        let v = stmt
            .query_map([before_ms], |r| r.get(0))
            .map_err(sql("select inactive"))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(sql("read inactive"))?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandlot_api::{Cmd, Output};
    use std::sync::Arc;

    /// `(guard, DIR/trajectories.db)` in a fresh temporary directory, removed with the guard.
    fn tmpdb(name: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix(&format!("sandlot-traj-test-{name}-"))
            .tempdir()
            .unwrap();
        let path = dir.path().join("trajectories.db");
        (dir, path)
    }

    fn exec_result(code: i32, out: &[u8]) -> StepResult {
        let mut r = ExecResult {
            exit_code: code,
            ..Default::default()
        };
        let o = |d: &[u8]| Output {
            data: d.to_vec(),
            total: d.len() as u64,
            truncated: false,
        };
        r.set_output(&o(out), &o(b""));
        StepResult::Exec(r)
    }

    async fn log_two(s: &dyn TrajectoryStore, t: &str, big: &[u8]) {
        let e = StepRequest::Exec(ExecRequest::new(Cmd::Shell("echo hi".into())));
        s.append(t, 0, &e, &e.digest(), &exec_result(0, b"hi\n"), 1)
            .await
            .unwrap();
        let w = StepRequest::WriteFile {
            path: "/workspace/a".into(),
            data: Bytes::copy_from_slice(big),
        };
        s.append(t, 1, &w, &w.digest(), &StepResult::Done, 2)
            .await
            .unwrap();
    }

    // ---- one suite, run against both backends ----

    /// Writes through `w`, then reads back through `r` (the same log reopened: SQLite after
    /// a reopen, PostgreSQL through a second pool as another server would).
    async fn suite_roundtrip(w: &dyn TrajectoryStore, r: &dyn TrajectoryStore) {
        let big: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        log_two(w, "t/1", &big).await;
        // Not the next step: refused inside the transaction.
        let e = StepRequest::RemoveFile { path: "/x".into() };
        assert!(matches!(
            w.append("t/1", 1, &e, &e.digest(), &StepResult::Done, 3)
                .await,
            Err(TrajectoryStoreError::NotNext { next: 2, .. })
        ));
        // A refused first append leaves no trajectory behind.
        assert!(matches!(
            w.append("t/none", 3, &e, &e.digest(), &StepResult::Done, 3)
                .await,
            Err(TrajectoryStoreError::NotNext { next: 0, .. })
        ));
        assert!(r.summary("t/none").await.unwrap().is_none());
        let out = vec![b'y'; 3000];
        let e = StepRequest::Exec(ExecRequest::new(Cmd::Argv(vec!["big".into()])));
        w.append("t/1", 2, &e, &e.digest(), &exec_result(1, &out), 4)
            .await
            .unwrap();

        let s = r;
        assert_eq!(s.next_step("t/1").await.unwrap(), 3);
        assert_eq!(s.next_step("other").await.unwrap(), 0);
        assert!(s.get_step("t/1", 7).await.unwrap().is_none());
        let got = s.get_step("t/1", 0).await.unwrap().unwrap();
        assert_eq!(got.kind, StepKind::Exec);
        assert_eq!(got.result, exec_result(0, b"hi\n"));
        match s.get_step("t/1", 2).await.unwrap().unwrap().result {
            StepResult::Exec(r) => {
                assert_eq!(r.stdout.len(), 3000);
                assert_eq!(r.exit_code, 1);
            }
            other => panic!("{other:?}"),
        }
        let m = s.mutating_steps("t/1").await.unwrap();
        assert_eq!(m.len(), 3);
        match &m[1].1 {
            StepRequest::WriteFile { data, .. } => assert_eq!(&data[..], &big[..]),
            other => panic!("{other:?}"),
        }
        s.record_replay("t/1", 0, 9).await.unwrap();
        let sum = s.summary("t/1").await.unwrap().unwrap();
        assert_eq!(sum.next_step, 3);
        assert_eq!(sum.replayed_total, 1);
        assert_eq!(sum.steps[0].replay_count, 1);
        assert_eq!(sum.steps[1].kind, "write_file");
        assert_eq!(sum.steps[2].exit_code, Some(1));
        assert_eq!(sum.steps[2].created_at_ms, 4);
        // Activity: t/1 last touched at 9.
        assert_eq!(s.inactive_since(10).await.unwrap(), vec!["t/1".to_string()]);
        assert!(s.inactive_since(9).await.unwrap().is_empty());
        // A second trajectory sharing a blob keeps it when the first is deleted.
        log_two(w, "t/2", &big).await;
        assert!(s.delete("t/1").await.unwrap());
        assert!(!s.delete("t/1").await.unwrap());
        assert!(s.summary("t/1").await.unwrap().is_none());
        match &s.mutating_steps("t/2").await.unwrap()[1].1 {
            StepRequest::WriteFile { data, .. } => assert_eq!(&data[..], &big[..]),
            other => panic!("{other:?}"),
        }
        assert!(s.delete("t/2").await.unwrap());
    }

    /// `n` writers race to log step 0, then step 1, of one trajectory: exactly one wins each
    /// step, the others get `NotNext`.
    async fn suite_racing_writers(stores: Vec<Arc<dyn TrajectoryStore>>) {
        for step in 0..2u64 {
            let tasks: Vec<_> = stores
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let s = s.clone();
                    tokio::spawn(async move {
                        let e =
                            StepRequest::Exec(ExecRequest::new(Cmd::Shell(format!("echo {i}"))));
                        s.append("race", step, &e, &e.digest(), &StepResult::Done, 1)
                            .await
                    })
                })
                .collect();
            let mut won = 0;
            for t in tasks {
                match t.await.unwrap() {
                    Ok(()) => won += 1,
                    Err(TrajectoryStoreError::NotNext { next, .. }) => assert_eq!(next, step + 1),
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            assert_eq!(won, 1, "step {step}: exactly one writer logs it");
        }
        let sum = stores[0].summary("race").await.unwrap().unwrap();
        assert_eq!(sum.next_step, 2);
        assert_eq!(sum.steps.len(), 2);
    }

    #[tokio::test]
    async fn sqlite_roundtrip() {
        let (_tmp, path) = tmpdb("reopen");
        {
            let w = SqliteTrajectoryStore::open(&path, false).unwrap();
            let r = SqliteTrajectoryStore::open(&path, false).unwrap();
            suite_roundtrip(&w, &r).await;
        }
        let s = SqliteTrajectoryStore::open(&path, false).unwrap();
        // Delete dropped the logs and their unused blobs.
        let blobs: i64 = s
            .conn()
            .query_row("SELECT count(*) FROM blobs", [], |r| r.get(0))
            .unwrap();
        assert_eq!(blobs, 0);
    }

    #[tokio::test]
    async fn sqlite_racing_writers() {
        let (_tmp, path) = tmpdb("race");
        let stores: Vec<Arc<dyn TrajectoryStore>> = (0..4)
            .map(|_| {
                Arc::new(SqliteTrajectoryStore::open(&path, false).unwrap())
                    as Arc<dyn TrajectoryStore>
            })
            .collect();
        suite_racing_writers(stores).await;
    }

    /// A migrated PostgreSQL store on a fresh database, or `None` (skipped).
    async fn pg_store(test: &str, pool_size: usize) -> Option<(String, PgTrajectoryStore)> {
        let url = crate::pg::testing::fresh_database(test).await?;
        let pool = crate::pg::connect(&url, pool_size).await.unwrap();
        Some((url, PgTrajectoryStore::new(pool)))
    }

    #[tokio::test]
    async fn pg_roundtrip() {
        let Some((url, w)) = pg_store("pg_roundtrip", 2).await else {
            return;
        };
        // A second pool on the same database: another server.
        let r = PgTrajectoryStore::new(crate::pg::connect(&url, 2).await.unwrap());
        suite_roundtrip(&w, &r).await;
        assert_eq!(w.blob_count().await, 0);
        // Migrations applied once: connecting again is a no-op.
        crate::pg::connect(&url, 1).await.unwrap();
    }

    #[tokio::test]
    async fn pg_racing_writers() {
        let Some((url, first)) = pg_store("pg_racing_writers", 1).await else {
            return;
        };
        let mut stores: Vec<Arc<dyn TrajectoryStore>> = vec![Arc::new(first)];
        for _ in 0..7 {
            let pool = crate::pg::connect(&url, 1).await.unwrap();
            stores.push(Arc::new(PgTrajectoryStore::new(pool)));
        }
        suite_racing_writers(stores).await;
    }

    #[tokio::test]
    async fn committed_entry_visible_after_crash() {
        let (_tmp, path) = tmpdb("crash");
        let s = SqliteTrajectoryStore::open(&path, false).unwrap();
        log_two(&s, "c", b"data").await;
        // Simulated crash: the connection is never closed (no checkpoint, WAL left as is).
        std::mem::forget(s);
        assert!(path.with_extension("db-wal").exists(), "WAL file in use");
        let s2 = SqliteTrajectoryStore::open(&path, false).unwrap();
        assert_eq!(s2.next_step("c").await.unwrap(), 2);
        let e = StepRequest::Exec(ExecRequest::new(Cmd::Shell("echo hi".into())));
        let got = s2.get_step("c", 0).await.unwrap().unwrap();
        assert_eq!(got.digest, e.digest());
        assert_eq!(got.result, exec_result(0, b"hi\n"));
    }

    #[test]
    fn digest_is_canonical() {
        let mut a = ExecRequest::new(Cmd::Shell("x".into()));
        a.env.insert("B".into(), "2".into());
        a.env.insert("A".into(), "1".into());
        let mut b = ExecRequest::new(Cmd::Argv(vec!["/bin/sh".into(), "-c".into(), "x".into()]));
        b.env.insert("A".into(), "1".into());
        b.env.insert("B".into(), "2".into());
        b.step = Some(7);
        // Shell string = its argv form; env order and `step` do not matter.
        assert_eq!(
            StepRequest::Exec(a.clone()).digest(),
            StepRequest::Exec(b).digest()
        );
        let mut c = a.clone();
        c.timeout_s = Some(5.0);
        assert_ne!(StepRequest::Exec(a).digest(), StepRequest::Exec(c).digest());
        let w = |d: &'static [u8]| StepRequest::WriteFile {
            path: "/p".into(),
            data: Bytes::from_static(d),
        };
        assert_ne!(w(b"1").digest(), w(b"2").digest());
        assert_ne!(
            StepRequest::ReadFile { path: "/p".into() }.digest(),
            StepRequest::ListDir { path: "/p".into() }.digest()
        );
    }
}
