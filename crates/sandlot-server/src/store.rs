//! Durable records of sandboxes and idempotency keys, in SQLite (`DATA/sandlot.db`).
//!
//! Schema (version 1):
//! - `sandboxes(id TEXT PK, backend, image, state, node, created_at INTEGER ms, expires_at
//!   INTEGER ms NULL, spec TEXT json, labels TEXT json)`; `spec` is [`SpecJson`].
//! - `idempotency(key TEXT PK, digest TEXT, sandbox_id TEXT, created_at INTEGER ms)`.
//! - `sandboxes.tenant TEXT NULL` (added to older databases on open): the id of the API key
//!   that created the sandbox; `NULL` when created without authentication.
//! - `api_keys(id TEXT PK, name, digest TEXT UNIQUE = SHA-256 hex of the key, admin INTEGER,
//!   max_sandboxes INTEGER NULL, max_cpu REAL NULL, max_memory_mib INTEGER NULL, created_at
//!   INTEGER ms, revoked_at INTEGER ms NULL)`: [`KeyRow`]; the key itself is never stored.
//! - `trajectory_owners(trajectory TEXT PK, tenant TEXT)`: which tenant a trajectory id
//!   belongs to (claimed by its first create with authentication).
//! - `sandboxes.owner TEXT NULL, sandboxes.deadline INTEGER ms NULL` (added on open): the
//!   server running a `creating` / `deleting` transition and when another may take it over
//!   ([`Store::set_transition`], [`Store::stale_transitions`]; cluster mode's registry,
//!   [`crate::registry::PgRegistry`], has the same columns).
//! - `checkpoints(id TEXT PK, sandbox_id, backend, image, runtime NULL, disk_mib, size_bytes,
//!   created_at INTEGER ms, tenant NULL)`: [`crate::checkpoints::CheckpointRow`].
//!
//! The database runs in WAL mode with `synchronous=NORMAL` (a commit survives a process
//! crash; a power loss may lose the last commits, which the node's re-adoption tolerates).
//! One connection sits behind a `std::sync::Mutex`; every statement is a primary-key or
//! small indexed access taking microseconds, so handlers call the store inline instead of
//! paying a `spawn_blocking` hop per call.
use rusqlite::{params, Connection, OptionalExtension};
use sandlot_api::{Backend, NetworkPolicy, Sandbox, SandboxState};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Opening or migrating the database file failed.
    #[error("open {path}")]
    Open {
        /// Database file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: rusqlite::Error,
    },
    /// A statement failed.
    #[error("sqlite {op}")]
    Sql {
        /// What was being done.
        op: &'static str,
        /// Cause.
        #[source]
        source: rusqlite::Error,
    },
    /// A PostgreSQL statement failed ([`crate::registry::PgRegistry`]).
    #[error("postgres {op}")]
    Pg {
        /// What was being done.
        op: &'static str,
        /// Cause.
        #[source]
        source: tokio_postgres::Error,
    },
    /// No database connection could be had (PostgreSQL down, or the pool exhausted past its
    /// timeout): the call may be retried later.
    #[error("registry unavailable: {0}")]
    Unavailable(String),
    /// A stored row does not decode (corrupt or written by a newer version).
    #[error("bad record {id}: {what}")]
    Corrupt {
        /// Row id.
        id: String,
        /// What is wrong.
        what: String,
    },
}

type Result<T> = std::result::Result<T, StoreError>;

pub(crate) fn sql(op: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
    move |source| StoreError::Sql { op, source }
}

/// The `spec` column: every create parameter not in its own column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecJson {
    /// CPU quota in cores.
    pub cpu: f64,
    /// Memory limit in MiB.
    pub memory_mib: u64,
    /// Writable-layer limit in MiB.
    pub disk_mib: u64,
    /// Process limit.
    pub pids_max: u64,
    /// TTL in seconds (0 = none).
    pub ttl_s: u64,
    /// Environment of every exec.
    pub env: BTreeMap<String, String>,
    /// Network policy.
    pub network: NetworkPolicy,
    /// OCI runtime of a container sandbox (absent in rows of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Accelerator of a microvm / vm sandbox (`kvm`, `tcg`; absent for other backends and
    /// in rows of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<String>,
    /// Trajectory id.
    pub trajectory: Option<String>,
    /// Checkpoint the sandbox was forked from (absent otherwise and in older rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
}

/// One sandbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// `sb-` + 20 hex.
    pub id: String,
    /// Isolation level.
    pub backend: Backend,
    /// Image name.
    pub image: String,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Node name.
    pub node: String,
    /// Creation time, Unix milliseconds.
    pub created_at_ms: i64,
    /// Expiry, Unix milliseconds; `None` without TTL.
    pub expires_at_ms: Option<i64>,
    /// Other parameters.
    pub spec: SpecJson,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Id of the API key (tenant) that created it; `None` without authentication.
    pub tenant: Option<String>,
}

pub(crate) fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl Record {
    /// The wire shape of this record.
    pub fn to_api(&self) -> Sandbox {
        Sandbox {
            id: self.id.clone(),
            backend: self.backend,
            image: self.image.clone(),
            state: self.state,
            node: self.node.clone(),
            created_at: rfc3339(self.created_at_ms),
            expires_at: self.expires_at_ms.map(rfc3339),
            cpu: self.spec.cpu,
            memory_mib: self.spec.memory_mib,
            disk_mib: self.spec.disk_mib,
            pids_max: self.spec.pids_max,
            ttl_s: self.spec.ttl_s,
            labels: self.labels.clone(),
            network: self.spec.network.clone(),
            runtime: self.spec.runtime.clone(),
            accel: self.spec.accel.clone(),
            trajectory: self.spec.trajectory.clone(),
            restore: None,
        }
    }
}

/// What [`Store::insert_with_key`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyOutcome {
    /// The record (and key, if any) were inserted.
    Inserted,
    /// The key was used before with the same request digest, for this sandbox id.
    Replay(String),
    /// The key was used before with another request.
    Mismatch,
    /// The tenant's quota does not admit the sandbox; the message says which limit.
    OverQuota(String),
}

/// Limits of one API key over its sandboxes that exist (any state); `None` = unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Quota {
    /// Most sandboxes at once.
    pub max_sandboxes: Option<u64>,
    /// Most CPU cores summed over its sandboxes.
    pub max_cpu: Option<f64>,
    /// Most memory in MiB summed over its sandboxes.
    pub max_memory_mib: Option<u64>,
}

/// One row of `api_keys` (the key itself is not stored, only its SHA-256).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyRow {
    /// Public id, `key_` + 16 hex digits; the tenant id of its sandboxes.
    pub id: String,
    /// Operator-chosen name.
    pub name: String,
    /// SHA-256 of the key, 64 lowercase hex digits.
    #[serde(skip)]
    pub digest: String,
    /// Admin scope (see [`crate::auth`]).
    pub admin: bool,
    /// Limits.
    #[serde(flatten)]
    pub quota: Quota,
    /// Creation time, Unix ms.
    pub created_at_ms: i64,
    /// Revocation time, Unix ms; a revoked key authenticates nothing.
    pub revoked_at_ms: Option<i64>,
}

/// The SQLite store. Cheap to share behind an `Arc`.
pub struct Store {
    conn: Arc<Mutex<Connection>>,
    /// The group-commit writer's queue ([`Store::grouped`]), started on first use.
    group: OnceLock<std::sync::mpsc::Sender<GroupJob>>,
}

const COLS: &str = "id, backend, image, state, node, created_at, expires_at, spec, labels, tenant";
const KEY_COLS: &str =
    "id, name, digest, admin, max_sandboxes, max_cpu, max_memory_mib, created_at, revoked_at";

impl Store {
    /// Open (creating if needed) `path` and apply the schema.
    ///
    /// # Errors
    /// [`StoreError::Open`] with the path when the file cannot be opened or migrated.
    pub fn open(path: &Path) -> Result<Store> {
        let open_err = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        let conn = Connection::open(path).map_err(open_err)?;
        owner_only(path);
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             PRAGMA synchronous=NORMAL;
             PRAGMA busy_timeout=5000;
             CREATE TABLE IF NOT EXISTS sandboxes (
                id TEXT PRIMARY KEY, backend TEXT NOT NULL, image TEXT NOT NULL,
                state TEXT NOT NULL, node TEXT NOT NULL, created_at INTEGER NOT NULL,
                expires_at INTEGER, spec TEXT NOT NULL, labels TEXT NOT NULL);
             CREATE INDEX IF NOT EXISTS sandboxes_expires ON sandboxes(expires_at);
             CREATE INDEX IF NOT EXISTS sandboxes_node ON sandboxes(node);
             CREATE INDEX IF NOT EXISTS sandboxes_created ON sandboxes(created_at, id);
             CREATE INDEX IF NOT EXISTS sandboxes_trajectory
                ON sandboxes(json_extract(spec, '$.trajectory'));
             CREATE INDEX IF NOT EXISTS sandboxes_job
                ON sandboxes(json_extract(labels, '$.job'));
             CREATE TABLE IF NOT EXISTS idempotency (
                key TEXT PRIMARY KEY, digest TEXT NOT NULL, sandbox_id TEXT NOT NULL,
                created_at INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS api_keys (
                id TEXT PRIMARY KEY, name TEXT NOT NULL, digest TEXT NOT NULL UNIQUE,
                admin INTEGER NOT NULL, max_sandboxes INTEGER, max_cpu REAL,
                max_memory_mib INTEGER, created_at INTEGER NOT NULL, revoked_at INTEGER);
             CREATE TABLE IF NOT EXISTS trajectory_owners (
                trajectory TEXT PRIMARY KEY, tenant TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS checkpoints (
                id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, backend TEXT NOT NULL,
                image TEXT NOT NULL, runtime TEXT, disk_mib INTEGER NOT NULL,
                size_bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, tenant TEXT);",
        )
        .map_err(open_err)?;
        // Databases of older versions lack the tenant column.
        let has_tenant = conn
            .prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name = 'tenant'")
            .and_then(|mut s| s.exists([]))
            .map_err(open_err)?;
        if !has_tenant {
            conn.execute_batch("ALTER TABLE sandboxes ADD COLUMN tenant TEXT;")
                .map_err(open_err)?;
        }
        conn.execute_batch("CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes(tenant);")
            .map_err(open_err)?;
        crate::checkpoints::create_name_table(&conn).map_err(open_err)?;
        // Owner and deadline of a transition (cluster mode's columns, kept alike here so
        // both registries pass one contract); older databases lack them.
        let has_owner = conn
            .prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name = 'owner'")
            .and_then(|mut s| s.exists([]))
            .map_err(open_err)?;
        if !has_owner {
            conn.execute_batch(
                "ALTER TABLE sandboxes ADD COLUMN owner TEXT;
                 ALTER TABLE sandboxes ADD COLUMN deadline INTEGER;",
            )
            .map_err(open_err)?;
        }
        create_tenant_usage(&conn).map_err(open_err)?;
        Ok(Store {
            conn: Arc::new(Mutex::new(conn)),
            group: OnceLock::new(),
        })
    }

    pub(crate) fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        lock(&self.conn)
    }

    /// Insert a new record; with `key = Some((key, digest))` also record the idempotency key
    /// in the same transaction, unless the key exists (then nothing is inserted).
    ///
    /// # Errors
    /// [`StoreError::Sql`] on SQLite failures (including a duplicate id).
    pub fn insert_with_key(&self, rec: &Record, key: Option<(&str, &str)>) -> Result<KeyOutcome> {
        self.insert_checked(rec, key, None)
    }

    /// [`Store::insert_with_key`], and with `quota` also check in the same transaction that
    /// the sandboxes of `rec.tenant` (any state but `deleting`: a delete frees quota at its
    /// mark, before the node has finished it) plus `rec` stay within it; when not,
    /// nothing is inserted and [`KeyOutcome::OverQuota`] says which limit.
    ///
    /// # Errors
    /// [`StoreError::Sql`] on SQLite failures (including a duplicate id).
    pub fn insert_checked(
        &self,
        rec: &Record,
        key: Option<(&str, &str)>,
        quota: Option<&Quota>,
    ) -> Result<KeyOutcome> {
        insert_on(&self.conn(), rec, key, quota, None)
    }

    /// One record by id.
    ///
    /// # Errors
    /// [`StoreError`] on SQLite failures or an undecodable row.
    pub fn get(&self, id: &str) -> Result<Option<Record>> {
        let conn = self.conn();
        // Cached: this runs on every request that names a sandbox.
        let row = conn
            .prepare_cached(&format!("SELECT {COLS} FROM sandboxes WHERE id = ?1"))
            .and_then(|mut st| st.query_row([id], raw_row).optional())
            .map_err(sql("select sandbox"))?;
        row.map(decode).transpose()
    }

    /// Every record, oldest first.
    ///
    /// # Errors
    /// [`StoreError`] on SQLite failures or an undecodable row.
    pub fn list(&self) -> Result<Vec<Record>> {
        self.select(
            &format!("SELECT {COLS} FROM sandboxes ORDER BY created_at, rowid"),
            [],
        )
    }

    /// The records carrying every `labels` pair (AND; empty: all), oldest first. Matched in
    /// SQLite, not after decoding every row; a `job` pair uses the `sandboxes_job` index.
    ///
    /// # Errors
    /// [`StoreError`] on SQLite failures or an undecodable row.
    pub fn list_labeled(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Record>> {
        if labels.is_empty() {
            return self.list();
        }
        let want = serde_json::to_string(labels).expect("labels serialize");
        let job = if labels.contains_key("job") {
            "json_extract(labels, '$.job') = ?2 AND"
        } else {
            "?2 IS NULL AND" // keeps the parameter count fixed
        };
        self.select(
            &format!(
                "SELECT {COLS} FROM sandboxes WHERE {job} NOT EXISTS (
                   SELECT 1 FROM json_each(?1) AS w WHERE NOT EXISTS (
                     SELECT 1 FROM json_each(sandboxes.labels) AS l
                     WHERE l.key = w.key AND l.value = w.value))
                 ORDER BY created_at, rowid"
            ),
            params![want, labels.get("job")],
        )
    }

    /// One page of [`Store::list_labeled`], restricted to `tenant` when given, in
    /// (`created_at`, id) order after the cursor `after`, at most `limit` (see
    /// `Registry::list_page`; the `sandboxes_created` index serves the order).
    ///
    /// # Errors
    /// [`StoreError`] on SQLite failures or an undecodable row.
    pub fn list_page(
        &self,
        labels: &BTreeMap<String, String>,
        tenant: Option<&str>,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<Record>> {
        let want = serde_json::to_string(labels).expect("labels serialize");
        let (after_at, after_id) = after.unzip();
        // As in list_labeled: a `job` pair as a plain equality, so the planner can use the
        // `sandboxes_job` index; without one, `sandboxes_created` serves order and cursor.
        let job = if labels.contains_key("job") {
            "json_extract(labels, '$.job') = ?2"
        } else {
            "?2 IS NULL"
        };
        self.select(
            &format!(
                "SELECT {COLS} FROM sandboxes
                 WHERE (?3 IS NULL OR (created_at, id) > (?3, ?4))
                   AND (?5 IS NULL OR tenant = ?5)
                   AND {job}
                   AND NOT EXISTS (
                     SELECT 1 FROM json_each(?1) AS w WHERE NOT EXISTS (
                       SELECT 1 FROM json_each(sandboxes.labels) AS l
                       WHERE l.key = w.key AND l.value = w.value))
                 ORDER BY created_at, id LIMIT ?6"
            ),
            params![
                want,
                labels.get("job"),
                after_at,
                after_id,
                tenant,
                i64::try_from(limit).unwrap_or(i64::MAX)
            ],
        )
    }

    /// Counts of `Registry::summary`, each an indexed `COUNT(*)`.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn summary(&self) -> Result<crate::registry::Summary> {
        let by_state = self.count_by_state()?;
        let conn = self.conn();
        let by_node = conn
            .prepare_cached("SELECT node, COUNT(*) FROM sandboxes GROUP BY node")
            .map_err(sql("prepare count by node"))?
            .query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? as u64)))
            .map_err(sql("count by node"))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(sql("read counts by node"))?;
        let with_trajectory: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM sandboxes
                 WHERE json_extract(spec, '$.trajectory') IS NOT NULL",
                [],
                |r| r.get(0),
            )
            .map_err(sql("count with trajectory"))?;
        Ok(crate::registry::Summary {
            by_state,
            by_node,
            with_trajectory: with_trajectory as u64,
        })
    }

    /// How many records there are per (backend, state), as stored strings.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn count_by_state(&self) -> Result<Vec<(String, String, u64)>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare_cached(
                "SELECT backend, state, COUNT(*) FROM sandboxes GROUP BY backend, state",
            )
            .map_err(sql("prepare count"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64))
            })
            .map_err(sql("count sandboxes"))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(sql("read counts"))?;
        Ok(rows)
    }

    /// The live (`creating`, `running` or `paused`) record bound to `trajectory`, if any
    /// (the oldest when, against the server's per-trajectory lock, there are several).
    ///
    /// # Errors
    /// [`StoreError`] on SQLite failures or an undecodable row.
    pub fn live_by_trajectory(&self, trajectory: &str) -> Result<Option<Record>> {
        Ok(self
            .select(
                &format!(
                    "SELECT {COLS} FROM sandboxes WHERE json_extract(spec, '$.trajectory') = ?1
                     AND state IN ('creating', 'running', 'paused') ORDER BY created_at LIMIT 1"
                ),
                [trajectory],
            )?
            .pop())
    }

    /// Records whose `expires_at` is at or before `now_ms`, or stuck in `deleting`.
    ///
    /// # Errors
    /// [`StoreError`] on SQLite failures or an undecodable row.
    pub fn due_for_reaping(&self, now_ms: i64) -> Result<Vec<Record>> {
        self.select(
            &format!(
                "SELECT {COLS} FROM sandboxes WHERE (expires_at IS NOT NULL AND expires_at <= ?1)
                 OR state = 'deleting' ORDER BY created_at"
            ),
            [now_ms],
        )
    }

    fn select<P: rusqlite::Params>(&self, q: &str, p: P) -> Result<Vec<Record>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(q).map_err(sql("prepare select"))?;
        let rows = stmt
            .query_map(p, raw_row)
            .map_err(sql("select sandboxes"))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(sql("read sandboxes"))?;
        rows.into_iter().map(decode).collect()
    }

    /// Set `state = to` only when the current state is one of `from`. Returns whether a row
    /// changed (compare-and-set: a create racing a delete finds out here).
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn transition(&self, id: &str, from: &[SandboxState], to: SandboxState) -> Result<bool> {
        let conn = self.conn();
        let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        let from_json = serde_json::to_string(&from).expect("strings serialize");
        let n = conn
            .execute(
                "UPDATE sandboxes SET state = ?1 WHERE id = ?2
                 AND state IN (SELECT value FROM json_each(?3))",
                params![to.as_str(), id, from_json],
            )
            .map_err(sql("update state"))?;
        Ok(n == 1)
    }

    /// The `running`/`paused` records on `node` become `lost`, but a paused `microvm`'s or `vm`'s
    /// (see `Registry::mark_node_lost`); returns the ids and backends changed.
    ///
    /// # Errors
    /// [`StoreError::Sql`], [`StoreError::Corrupt`].
    pub fn mark_node_lost(&self, node: &str) -> Result<Vec<(String, Backend)>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare_cached(
                "UPDATE sandboxes SET state = 'lost' WHERE node = ?1
                 AND (state = 'running' OR (state = 'paused' AND backend NOT IN ('microvm', 'vm')))
                 RETURNING id, backend",
            )
            .map_err(sql("mark node lost"))?;
        let rows = stmt
            .query_map(params![node], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
            })
            .map_err(sql("mark node lost"))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, b) = row.map_err(sql("mark node lost"))?;
            match b.parse() {
                Ok(backend) => out.push((id, backend)),
                Err(what) => return Err(StoreError::Corrupt { id, what }),
            }
        }
        Ok(out)
    }

    /// Moves a `paused` record to node `node` (see `Registry::set_node`).
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn set_node(&self, id: &str, node: &str) -> Result<bool> {
        let n = self
            .conn()
            .execute(
                "UPDATE sandboxes SET node = ?1 WHERE id = ?2 AND state = 'paused'",
                params![node, id],
            )
            .map_err(sql("update node"))?;
        Ok(n == 1)
    }

    /// Set a new expiry for a `running` record. Returns whether it changed.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn set_expiry(&self, id: &str, expires_at_ms: Option<i64>, ttl_s: u64) -> Result<bool> {
        let conn = self.conn();
        let n = conn
            .execute(
                "UPDATE sandboxes SET expires_at = ?1,
                   spec = json_set(spec, '$.ttl_s', ?2)
                 WHERE id = ?3 AND state = 'running'",
                params![expires_at_ms, ttl_s as i64, id],
            )
            .map_err(sql("update expiry"))?;
        Ok(n == 1)
    }

    /// Remove a record and the idempotency keys pointing at it. Returns whether it existed.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn remove(&self, id: &str) -> Result<bool> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql("begin"))?;
        let n = tx
            .execute("DELETE FROM sandboxes WHERE id = ?1", [id])
            .map_err(sql("delete sandbox"))?;
        tx.commit().map_err(sql("commit"))?;
        Ok(n == 1)
    }

    /// The request digest and sandbox id recorded under an Idempotency-Key, if any.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn key_sandbox(&self, key: &str) -> Result<Option<(String, String)>> {
        self.conn()
            .query_row(
                "SELECT digest, sandbox_id FROM idempotency WHERE key = ?1",
                [key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(sql("select idempotency key"))
    }

    /// Forget the idempotency keys of a sandbox whose create failed, so a retry with the
    /// same key creates again.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn forget_keys_of(&self, id: &str) -> Result<()> {
        self.conn()
            .execute("DELETE FROM idempotency WHERE sandbox_id = ?1", [id])
            .map_err(sql("delete idempotency keys"))?;
        Ok(())
    }

    /// Record (`Some((server id, deadline ms))`) or clear (`None`) who runs the record's
    /// current transition. Returns whether the record exists.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn set_transition(&self, id: &str, owner: Option<(&str, i64)>) -> Result<bool> {
        let (o, d) = owner.map_or((None, None), |(o, d)| (Some(o), Some(d)));
        let n = self
            .conn()
            .execute(
                "UPDATE sandboxes SET owner = ?1, deadline = ?2 WHERE id = ?3",
                params![o, d, id],
            )
            .map_err(sql("update transition owner"))?;
        Ok(n == 1)
    }

    /// Compare-and-set of the transition owner: set `(owner, deadline_ms)` when the record
    /// has no owner, its owner's deadline is at or before `now_ms` (stale), or `owner`
    /// already holds it (a renewal). Returns whether `owner` holds it now.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn claim_transition(
        &self,
        id: &str,
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<bool> {
        claim_on(&self.conn(), id, owner, deadline_ms, now_ms)
    }

    /// Clear the transition owner if `owner` holds it. Returns whether it did.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn release_transition(&self, id: &str, owner: &str) -> Result<bool> {
        let n = self
            .conn()
            .execute(
                "UPDATE sandboxes SET owner = NULL, deadline = NULL WHERE id = ?1 AND owner = ?2",
                params![id, owner],
            )
            .map_err(sql("release transition"))?;
        Ok(n == 1)
    }

    /// `creating` / `deleting` records with an owner whose deadline is at or before
    /// `now_ms`, and unclaimed `creating` records at least
    /// [`crate::registry::UNOWNED_CREATE_GRACE_MS`] old, oldest first, as (record, owner,
    /// deadline ms; for an unclaimed record: `None`, its creation time).
    ///
    /// # Errors
    /// [`StoreError`] on SQLite failures or an undecodable row.
    pub fn stale_transitions(&self, now_ms: i64) -> Result<Vec<(Record, Option<String>, i64)>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare_cached(&format!(
                "SELECT {COLS}, owner, COALESCE(deadline, created_at) FROM sandboxes
                 WHERE (state IN ('creating', 'deleting') AND owner IS NOT NULL
                        AND deadline <= ?1)
                    OR (state = 'creating' AND owner IS NULL AND created_at <= ?2)
                 ORDER BY created_at, rowid"
            ))
            .map_err(sql("prepare stale transitions"))?;
        let grace = crate::registry::UNOWNED_CREATE_GRACE_MS;
        let rows = stmt
            .query_map([now_ms, now_ms - grace], |r| {
                Ok((raw_row(r)?, r.get(10)?, r.get(11)?))
            })
            .map_err(sql("select stale transitions"))?
            .collect::<std::result::Result<Vec<(RawRow, Option<String>, i64)>, _>>()
            .map_err(sql("read stale transitions"))?;
        rows.into_iter()
            .map(|(raw, o, d)| Ok((decode(raw)?, o, d)))
            .collect()
    }

    /// Add an API key row.
    ///
    /// # Errors
    /// [`StoreError::Sql`] (also for a duplicate id or digest).
    pub fn insert_key(&self, k: &KeyRow) -> Result<()> {
        self.conn()
            .execute(
                &format!(
                    "INSERT INTO api_keys ({KEY_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
                ),
                params![
                    k.id,
                    k.name,
                    k.digest,
                    k.admin,
                    k.quota.max_sandboxes.map(|v| v as i64),
                    k.quota.max_cpu,
                    k.quota.max_memory_mib.map(|v| v as i64),
                    k.created_at_ms,
                    k.revoked_at_ms
                ],
            )
            .map_err(sql("insert api key"))?;
        Ok(())
    }

    /// The key row whose digest is `digest` (revoked or not).
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn key_by_digest(&self, digest: &str) -> Result<Option<KeyRow>> {
        self.conn()
            .query_row(
                &format!("SELECT {KEY_COLS} FROM api_keys WHERE digest = ?1"),
                [digest],
                key_row,
            )
            .optional()
            .map_err(sql("select api key"))
    }

    /// Every key row, oldest first.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn list_keys(&self) -> Result<Vec<KeyRow>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {KEY_COLS} FROM api_keys ORDER BY created_at, rowid"
            ))
            .map_err(sql("prepare select api keys"))?;
        let rows = stmt
            .query_map([], key_row)
            .map_err(sql("select api keys"))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(sql("read api keys"))?;
        Ok(rows)
    }

    /// Mark key `id` revoked at `now_ms` (kept, so authentication stays on). Returns whether
    /// a not yet revoked key was found.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn revoke_key(&self, id: &str, now_ms: i64) -> Result<bool> {
        let n = self
            .conn()
            .execute(
                "UPDATE api_keys SET revoked_at = ?1 WHERE id = ?2 AND revoked_at IS NULL",
                params![now_ms, id],
            )
            .map_err(sql("revoke api key"))?;
        Ok(n == 1)
    }

    /// Whether any key row exists, revoked ones included (authentication is then required).
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn has_keys(&self) -> Result<bool> {
        self.conn()
            .prepare_cached("SELECT 1 FROM api_keys LIMIT 1")
            .and_then(|mut s| s.exists([]))
            .map_err(sql("count api keys"))
    }

    /// Claim trajectory id `t` for `tenant` unless another tenant holds it. Returns whether
    /// `tenant` owns it now.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn claim_trajectory(&self, t: &str, tenant: &str) -> Result<bool> {
        let conn = self.conn();
        conn.execute(
            "INSERT OR IGNORE INTO trajectory_owners (trajectory, tenant) VALUES (?1, ?2)",
            [t, tenant],
        )
        .map_err(sql("claim trajectory"))?;
        Ok(trajectory_owner_of(&conn, t)?.as_deref() == Some(tenant))
    }

    /// The tenant owning trajectory id `t`, if one claimed it.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn trajectory_owner(&self, t: &str) -> Result<Option<String>> {
        trajectory_owner_of(&self.conn(), t)
    }

    /// Release the claim on trajectory `t` (its log was deleted).
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn forget_trajectory_owner(&self, t: &str) -> Result<()> {
        self.conn()
            .execute("DELETE FROM trajectory_owners WHERE trajectory = ?1", [t])
            .map_err(sql("forget trajectory owner"))?;
        Ok(())
    }

    /// Drop idempotency keys created before `before_ms`. Returns how many.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn purge_keys(&self, before_ms: i64) -> Result<usize> {
        self.conn()
            .execute("DELETE FROM idempotency WHERE created_at < ?1", [before_ms])
            .map_err(sql("purge idempotency keys"))
    }
}

fn trajectory_owner_of(conn: &Connection, t: &str) -> Result<Option<String>> {
    conn.query_row(
        "SELECT tenant FROM trajectory_owners WHERE trajectory = ?1",
        [t],
        |r| r.get(0),
    )
    .optional()
    .map_err(sql("select trajectory owner"))
}

fn key_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<KeyRow> {
    Ok(KeyRow {
        id: r.get(0)?,
        name: r.get(1)?,
        digest: r.get(2)?,
        admin: r.get(3)?,
        quota: Quota {
            max_sandboxes: r.get::<_, Option<i64>>(4)?.map(|v| v.max(0) as u64),
            max_cpu: r.get(5)?,
            max_memory_mib: r.get::<_, Option<i64>>(6)?.map(|v| v.max(0) as u64),
        },
        created_at_ms: r.get(7)?,
        revoked_at_ms: r.get(8)?,
    })
}

/// Creates, on a database without it, the per-tenant usage table (issue 22): the count,
/// cpu (millicores, rounded per sandbox, so sums stay exact) and memory (MiB) of each
/// tenant's sandboxes in any state but `deleting` (`tenant` '' for none: authentication
/// off; tenant ids are `key_…`), filled from the existing rows and kept exact by triggers
/// on `sandboxes`, all in one transaction. A quota check reads its tenant's one row
/// instead of summing its sandboxes.
fn create_tenant_usage(conn: &Connection) -> rusqlite::Result<()> {
    // A spec's (`spec`: its column) cpu in millicores and memory in MiB, as counted.
    let mcpu = |spec: &str| {
        format!("CAST(round(COALESCE(json_extract({spec}, '$.cpu'), 0) * 1000) AS INTEGER)")
    };
    let mem = |spec: &str| format!("COALESCE(json_extract({spec}, '$.memory_mib'), 0)");
    let (new_cpu, new_mem) = (mcpu("NEW.spec"), mem("NEW.spec"));
    let (old_cpu, old_mem) = (mcpu("OLD.spec"), mem("OLD.spec"));
    let (all_cpu, all_mem) = (mcpu("spec"), mem("spec"));
    // Adds NEW to its tenant's row when NEW counts.
    let add = format!(
        "INSERT INTO tenant_usage (tenant, n, mcpu, mem)
           SELECT COALESCE(NEW.tenant, ''), 1, {new_cpu}, {new_mem} WHERE NEW.state != 'deleting'
           ON CONFLICT (tenant) DO UPDATE SET n = n + 1, mcpu = mcpu + excluded.mcpu,
             mem = mem + excluded.mem;"
    );
    // Takes OLD from its tenant's row when OLD counted.
    let sub = format!(
        "UPDATE tenant_usage SET n = n - 1, mcpu = mcpu - {old_cpu}, mem = mem - {old_mem}
           WHERE tenant = COALESCE(OLD.tenant, '') AND OLD.state != 'deleting';"
    );
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let made = (|| {
        let exists = conn
            .prepare("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tenant_usage'")?
            .exists([])?;
        if exists {
            return Ok(());
        }
        conn.execute_batch(&format!(
            "CREATE TABLE tenant_usage (
                tenant TEXT PRIMARY KEY, n INTEGER NOT NULL DEFAULT 0,
                mcpu INTEGER NOT NULL DEFAULT 0, mem INTEGER NOT NULL DEFAULT 0);
             INSERT INTO tenant_usage (tenant, n, mcpu, mem)
               SELECT COALESCE(tenant, ''), COUNT(*), SUM({all_cpu}), SUM({all_mem})
               FROM sandboxes WHERE state != 'deleting' GROUP BY 1;
             CREATE TRIGGER sandboxes_usage_insert AFTER INSERT ON sandboxes
               BEGIN {add} END;
             CREATE TRIGGER sandboxes_usage_delete AFTER DELETE ON sandboxes
               BEGIN {sub} END;
             CREATE TRIGGER sandboxes_usage_update AFTER UPDATE OF state, tenant, spec
               ON sandboxes
               WHEN (OLD.state = 'deleting') != (NEW.state = 'deleting')
                 OR OLD.tenant IS NOT NEW.tenant OR OLD.spec != NEW.spec
               BEGIN {sub} {add} END;"
        ))
    })();
    match made {
        Ok(()) => conn.execute_batch("COMMIT"),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

/// The rows of `tenant_usage` ([`create_tenant_usage`]) that count anything: tenant ('' for
/// none) → (sandboxes, millicores, MiB). For tests.
#[cfg(test)]
pub(crate) fn read_tenant_usage(
    c: &Connection,
) -> rusqlite::Result<BTreeMap<String, (i64, i64, i64)>> {
    let mut st = c.prepare(
        "SELECT tenant, n, mcpu, mem FROM tenant_usage WHERE n != 0 OR mcpu != 0 OR mem != 0",
    )?;
    let rows = st.query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?, r.get(3)?))))?;
    rows.collect()
}

/// Which limit of `q` a new sandbox of `spec` would pass, given the tenant's current
/// `n` sandboxes, `cpu` cores and `mem` MiB; `None` when it fits.
pub(crate) fn over_quota(q: &Quota, n: u64, cpu: f64, mem: u64, spec: &SpecJson) -> Option<String> {
    if let Some(max) = q.max_sandboxes {
        if n + 1 > max {
            return Some(format!(
                "quota exceeded: this API key may have at most {max} sandboxes and has {n}"
            ));
        }
    }
    if let Some(max) = q.max_cpu {
        // Sums of decimal fractions: allow a rounding error of a millicore.
        if cpu + spec.cpu > max + 1e-3 {
            return Some(format!(
                "quota exceeded: cpu {} + {cpu} in use would pass this API key's max_cpu {max}",
                spec.cpu
            ));
        }
    }
    if let Some(max) = q.max_memory_mib {
        if mem + spec.memory_mib > max {
            return Some(format!(
                "quota exceeded: memory_mib {} + {mem} in use would pass this API key's max_memory_mib {max}",
                spec.memory_mib
            ));
        }
    }
    None
}

type RawRow = (
    String,
    String,
    String,
    String,
    String,
    i64,
    Option<i64>,
    String,
    String,
    Option<String>,
);

fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
    ))
}

fn decode(raw: RawRow) -> Result<Record> {
    let (id, backend, image, state, node, created_at_ms, expires_at_ms, spec, labels, tenant) = raw;
    let bad = |what: String| StoreError::Corrupt {
        id: id.clone(),
        what,
    };
    Ok(Record {
        backend: backend.parse().map_err(bad)?,
        state: state.parse().map_err(bad)?,
        spec: serde_json::from_str(&spec).map_err(|e| bad(format!("spec: {e}")))?,
        labels: serde_json::from_str(&labels).map_err(|e| bad(format!("labels: {e}")))?,
        image,
        node,
        created_at_ms,
        expires_at_ms,
        id,
        tenant,
    })
}

/// Makes the database file at `path` readable by its owner only (0600; SQLite gives its
/// `-wal` and `-shm` files the same mode): it holds tenants' sandbox records, events and
/// trajectories.
pub(crate) fn owner_only(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        tracing::warn!(path = %path.display(), error = %e, "could not make the database owner-only");
    }
}

/// [`Store::claim_transition`] on `c`.
fn claim_on(c: &Connection, id: &str, owner: &str, deadline_ms: i64, now_ms: i64) -> Result<bool> {
    let n = c
        .prepare_cached(
            "UPDATE sandboxes SET owner = ?1, deadline = ?2 WHERE id = ?3
             AND (owner IS NULL OR deadline IS NULL OR deadline <= ?4 OR owner = ?1)",
        )
        .and_then(|mut st| st.execute(params![owner, deadline_ms, id, now_ms]))
        .map_err(sql("claim transition"))?;
    Ok(n == 1)
}

/// [`Store::transition`] and [`Store::release_transition`] in one statement on `c`: set
/// `state = to` when the state is one of `from`, and clear the transition owner and
/// deadline if `owner` holds them (another owner's claim stays). Returns whether the state
/// changed. One write instead of two on every create's success path.
fn transition_release_on(
    c: &Connection,
    id: &str,
    from: &[SandboxState],
    to: SandboxState,
    owner: &str,
) -> Result<bool> {
    let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
    let from_json = serde_json::to_string(&from).expect("strings serialize");
    // SET expressions read the row's old values, so both CASEs test the old owner.
    let n = c
        .prepare_cached(
            "UPDATE sandboxes SET state = ?1,
                   deadline = CASE WHEN owner = ?4 THEN NULL ELSE deadline END,
                   owner = CASE WHEN owner = ?4 THEN NULL ELSE owner END
                 WHERE id = ?2 AND state IN (SELECT value FROM json_each(?3))",
        )
        .and_then(|mut st| st.execute(params![to.as_str(), id, from_json, owner]))
        .map_err(sql("update state and release"))?;
    Ok(n == 1)
}

/// [`Store::transition`] on `c` (a prepared statement).
fn transition_on(
    c: &Connection,
    id: &str,
    from: &[SandboxState],
    to: SandboxState,
) -> Result<bool> {
    let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
    let from_json = serde_json::to_string(&from).expect("strings serialize");
    let n = c
        .prepare_cached(
            "UPDATE sandboxes SET state = ?1 WHERE id = ?2
             AND state IN (SELECT value FROM json_each(?3))",
        )
        .and_then(|mut st| st.execute(params![to.as_str(), id, from_json]))
        .map_err(sql("update state"))?;
    Ok(n == 1)
}

/// Runs `f` on `c` inside a savepoint of its own: all of `f`'s writes or, when it fails,
/// none (an enclosing transaction, e.g. a group commit's, keeps the others' writes).
fn in_savepoint<T>(c: &Connection, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
    c.execute_batch("SAVEPOINT many")
        .map_err(sql("savepoint"))?;
    match f(c) {
        Ok(v) => {
            c.execute_batch("RELEASE many")
                .map_err(sql("release savepoint"))?;
            Ok(v)
        }
        Err(e) => {
            let _ = c.execute_batch("ROLLBACK TO many; RELEASE many");
            Err(e)
        }
    }
}

fn lock(conn: &Mutex<Connection>) -> std::sync::MutexGuard<'_, Connection> {
    // A panic while holding the lock cannot leave SQLite inconsistent (each statement
    // is atomic), so a poisoned lock is still usable.
    conn.lock().unwrap_or_else(|p| p.into_inner())
}

/// One create of [`Store::insert_many`]: the record, its `(Idempotency-Key, request digest)`
/// and its tenant's quota, as [`Store::insert_checked`] takes them.
pub type InsertItem<'a> = (&'a Record, Option<(&'a str, &'a str)>, Option<&'a Quota>);

/// Most writes one group commit takes ([`Store::grouped`]).
pub const GROUP_MAX: usize = 512;

/// Hands a write's result to its waiter once its group's COMMIT is done: `None` when it
/// committed, else the COMMIT's error (then nothing of the group was written).
type GroupDeliver = Box<dyn FnOnce(Option<&str>) + Send>;
/// One write of a group: runs on the writer's connection inside the group's transaction.
type GroupJob = Box<dyn FnOnce(&Connection) -> GroupDeliver + Send>;

/// The group-commit writer: takes the first queued write, then every write queued behind it
/// (up to [`GROUP_MAX`]), runs them in one `BEGIN IMMEDIATE … COMMIT` (one WAL commit for
/// all), then answers each. Ends when the [`Store`] is dropped.
fn group_writer(conn: Arc<Mutex<Connection>>, rx: std::sync::mpsc::Receiver<GroupJob>) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while jobs.len() < GROUP_MAX {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        let c = lock(&conn);
        // Should BEGIN fail, each write commits on its own (autocommit, or its savepoint).
        let grouped = c.execute_batch("BEGIN IMMEDIATE").is_ok();
        let delivers: Vec<GroupDeliver> = jobs.into_iter().map(|j| j(&c)).collect();
        let failed = match grouped {
            false => None,
            true => match c.execute_batch("COMMIT") {
                Ok(()) => None,
                Err(e) => {
                    let _ = c.execute_batch("ROLLBACK");
                    Some(format!("group commit failed: {e}"))
                }
            },
        };
        drop(c);
        for d in delivers {
            d(failed.as_deref());
        }
    }
}

impl Store {
    /// Runs `f` in the next group commit: writes that arrive while one group commits are
    /// committed together in the next one (one SQLite transaction, one WAL commit), so
    /// concurrent creates share commits. `f` sees the transaction's earlier writes, in
    /// arrival order; a quota check inside it therefore counts every record admitted
    /// before it. Returns once the group is committed (durable as any single write).
    ///
    /// `f` must keep its own failure to itself (one statement, or a savepoint as
    /// [`Store::insert_checked`] does in a group), since the others commit regardless.
    ///
    /// # Errors
    /// `f`'s error; [`StoreError::Unavailable`] when the group's COMMIT failed (nothing of
    /// `f` was written) or the writer thread is gone.
    pub async fn grouped<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: GroupJob = Box::new(move |c| {
            let out = f(c);
            Box::new(move |failed: Option<&str>| {
                let out = match failed {
                    None => out,
                    Some(m) => Err(StoreError::Unavailable(m.to_owned())),
                };
                let _ = tx.send(out);
            })
        });
        let gone = || StoreError::Unavailable("registry writer thread stopped".into());
        self.group
            .get_or_init(|| {
                let (tx, rx) = std::sync::mpsc::channel();
                let conn = self.conn.clone();
                std::thread::Builder::new()
                    .name("sandlot-registry-writer".into())
                    .spawn(move || group_writer(conn, rx))
                    .expect("spawn the registry writer thread");
                tx
            })
            .send(job)
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// [`Store::insert_checked`] in a group commit ([`Store::grouped`]).
    ///
    /// # Errors
    /// As [`Store::insert_checked`] and [`Store::grouped`].
    pub async fn insert_grouped(
        &self,
        rec: &Record,
        key: Option<(&str, &str)>,
        quota: Option<&Quota>,
    ) -> Result<KeyOutcome> {
        let rec = rec.clone();
        let key = key.map(|(k, d)| (k.to_owned(), d.to_owned()));
        let quota = quota.cloned();
        self.grouped(move |c| {
            insert_on(
                c,
                &rec,
                key.as_ref().map(|(k, d)| (k.as_str(), d.as_str())),
                quota.as_ref(),
                None,
            )
        })
        .await
    }

    /// [`Store::insert_checked`] of every item in ONE transaction (one commit), each in its
    /// own savepoint: the outcomes, in order, are per item (a quota refusal, replay or
    /// failure of one leaves the others inserted); quotas count the items admitted before.
    ///
    /// # Errors
    /// [`StoreError::Sql`] when the transaction cannot begin or commit (nothing inserted).
    pub fn insert_many(&self, items: &[InsertItem<'_>]) -> Result<Vec<Result<KeyOutcome>>> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(sql("begin"))?;
        let out = items
            .iter()
            .map(|(rec, key, quota)| insert_on(&tx, rec, *key, *quota, None))
            .collect();
        tx.commit().map_err(sql("commit"))?;
        Ok(out)
    }

    /// [`Store::insert_many`] as one job of the group writer ([`Store::grouped`]): the
    /// items, each in its own savepoint, are committed with the group (one commit for the
    /// batch and the concurrent single writes), and the caller's thread never waits on the
    /// connection lock. With `claim = Some((owner, deadline_ms))` every inserted record's
    /// transition is claimed by `owner` in its insert (no separate claim write).
    ///
    /// # Errors
    /// As [`Store::grouped`] (the group's COMMIT failed: none of the items was written).
    pub async fn insert_many_grouped(
        &self,
        items: &[InsertItem<'_>],
        claim: Option<(&str, i64)>,
    ) -> Result<Vec<Result<KeyOutcome>>> {
        let claim = claim.map(|(o, d)| (o.to_owned(), d));
        type Owned = (Record, Option<(String, String)>, Option<Quota>);
        let owned: Vec<Owned> = items
            .iter()
            .map(|(r, k, q)| {
                (
                    (*r).clone(),
                    k.map(|(k, d)| (k.to_owned(), d.to_owned())),
                    q.cloned(),
                )
            })
            .collect();
        self.grouped(move |c| {
            Ok(owned
                .iter()
                .map(|(r, k, q)| {
                    insert_on(
                        c,
                        r,
                        k.as_ref().map(|(k, d)| (k.as_str(), d.as_str())),
                        q.as_ref(),
                        claim.as_ref().map(|(o, d)| (o.as_str(), *d)),
                    )
                })
                .collect())
        })
        .await
    }

    /// [`Store::claim_transition`] in a group commit.
    ///
    /// # Errors
    /// As [`Store::grouped`].
    pub async fn claim_grouped(
        &self,
        id: &str,
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<bool> {
        let (id, owner) = (id.to_owned(), owner.to_owned());
        self.grouped(move |c| claim_on(c, &id, &owner, deadline_ms, now_ms))
            .await
    }

    /// `transition_release_on` (state change + release of `owner`'s claim in one
    /// statement) in a group commit.
    ///
    /// # Errors
    /// As [`Store::grouped`].
    pub async fn transition_release_grouped(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        owner: &str,
    ) -> Result<bool> {
        let (id, owner, from) = (id.to_owned(), owner.to_owned(), from.to_vec());
        self.grouped(move |c| transition_release_on(c, &id, &from, to, &owner))
            .await
    }

    /// `Registry::claim_many`: [`Store::claim_transition`] of every id in one job of the
    /// group writer (one commit). Answers per id, in order.
    ///
    /// # Errors
    /// [`StoreError::Sql`] (the job's writes are rolled back to its savepoint) and as
    /// [`Store::grouped`].
    pub async fn claim_many_grouped(
        &self,
        ids: &[String],
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<bool>> {
        let (ids, owner) = (ids.to_vec(), owner.to_owned());
        self.grouped(move |c| {
            in_savepoint(c, |c| {
                ids.iter()
                    .map(|id| claim_on(c, id, &owner, deadline_ms, now_ms))
                    .collect()
            })
        })
        .await
    }

    /// `Registry::transition_many`: the compare-and-set of every id's state (with
    /// `release`, clearing that owner's claim as `transition_release_on`) in one job of the
    /// group writer (one commit). Answers per id, in order.
    ///
    /// # Errors
    /// [`StoreError::Sql`] (the job's writes are rolled back to its savepoint) and as
    /// [`Store::grouped`].
    pub async fn transition_many_grouped(
        &self,
        ids: &[String],
        from: &[SandboxState],
        to: SandboxState,
        release: Option<&str>,
    ) -> Result<Vec<bool>> {
        let (ids, from) = (ids.to_vec(), from.to_vec());
        let release = release.map(str::to_owned);
        self.grouped(move |c| {
            in_savepoint(c, |c| {
                ids.iter()
                    .map(|id| match &release {
                        Some(owner) => transition_release_on(c, id, &from, to, owner),
                        None => transition_on(c, id, &from, to),
                    })
                    .collect()
            })
        })
        .await
    }
}

/// [`Store::insert_checked`] on `c` inside a savepoint of its own: an outcome other than
/// [`KeyOutcome::Inserted`], or an error, rolls back this record's writes only (an
/// enclosing transaction, e.g. a group commit's, keeps the others). Outside a transaction
/// the savepoint is the transaction.
fn insert_on(
    c: &Connection,
    rec: &Record,
    key: Option<(&str, &str)>,
    quota: Option<&Quota>,
    claim: Option<(&str, i64)>,
) -> Result<KeyOutcome> {
    c.execute_batch("SAVEPOINT sandlot_insert")
        .map_err(sql("savepoint"))?;
    let out = insert_body(c, rec, key, quota, claim);
    let end = match out {
        Ok(KeyOutcome::Inserted) => "RELEASE sandlot_insert",
        _ => "ROLLBACK TO sandlot_insert; RELEASE sandlot_insert",
    };
    c.execute_batch(end).map_err(sql("end savepoint"))?;
    out
}

/// With `claim = Some((owner, deadline_ms))` the record is inserted with its transition
/// already claimed by `owner` until `deadline_ms` (as [`Store::claim_transition`] would
/// set it, in the same row write).
fn insert_body(
    tx: &Connection,
    rec: &Record,
    key: Option<(&str, &str)>,
    quota: Option<&Quota>,
    claim: Option<(&str, i64)>,
) -> Result<KeyOutcome> {
    if let Some((key, digest)) = key {
        let found: Option<(String, String)> = tx
            .query_row(
                "SELECT digest, sandbox_id FROM idempotency WHERE key = ?1",
                [key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(sql("select idempotency key"))?;
        if let Some((d, sid)) = found {
            return Ok(if d == digest {
                KeyOutcome::Replay(sid)
            } else {
                KeyOutcome::Mismatch
            });
        }
        tx.execute(
            "INSERT INTO idempotency (key, digest, sandbox_id, created_at) VALUES (?1, ?2, ?3, ?4)",
            params![key, digest, rec.id, rec.created_at_ms],
        )
        .map_err(sql("insert idempotency key"))?;
    }
    if let Some(q) = quota {
        // The tenant's one row of `tenant_usage` ([`create_tenant_usage`]); none: unused.
        let (n, mcpu, mem): (i64, i64, i64) = tx
            .prepare_cached("SELECT n, mcpu, mem FROM tenant_usage WHERE tenant = COALESCE(?1, '')")
            .and_then(|mut st| {
                st.query_row([&rec.tenant], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .optional()
            })
            .map_err(sql("read tenant usage"))?
            .unwrap_or((0, 0, 0));
        let cpu = mcpu as f64 / 1000.0;
        if let Some(msg) = over_quota(q, n.max(0) as u64, cpu, mem.max(0) as u64, &rec.spec) {
            return Ok(KeyOutcome::OverQuota(msg));
        }
    }
    let spec = serde_json::to_string(&rec.spec).expect("spec serializes");
    let labels = serde_json::to_string(&rec.labels).expect("labels serialize");
    let (owner, deadline) = match claim {
        Some((o, d)) => (Some(o), Some(d)),
        None => (None, None),
    };
    tx.prepare_cached(&format!(
        "INSERT INTO sandboxes ({COLS}, owner, deadline) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"
    ))
    .and_then(|mut st| {
        st.execute(params![
            rec.id,
            rec.backend.as_str(),
            rec.image,
            rec.state.as_str(),
            rec.node,
            rec.created_at_ms,
            rec.expires_at_ms,
            spec,
            labels,
            rec.tenant,
            owner,
            deadline
        ])
    })
    .map_err(sql("insert sandbox"))?;
    Ok(KeyOutcome::Inserted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, created: i64, expires: Option<i64>) -> Record {
        Record {
            id: id.into(),
            backend: Backend::Function,
            image: "python".into(),
            state: SandboxState::Creating,
            node: "n1".into(),
            created_at_ms: created,
            expires_at_ms: expires,
            spec: SpecJson {
                cpu: 0.5,
                memory_mib: 256,
                disk_mib: 1024,
                pids_max: 64,
                ttl_s: 10,
                env: [("A".to_string(), "b".to_string())].into(),
                network: NetworkPolicy::None,
                runtime: None,
                checkpoint: None,
                accel: None,
                trajectory: None,
            },
            labels: [("job".to_string(), "x".to_string())].into(),
            tenant: None,
        }
    }

    /// `(guard, DIR/sandlot.db)` in a fresh temporary directory, removed with the guard.
    fn tmpdb(name: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix(&format!("sandlot-store-test-{name}-"))
            .tempdir()
            .unwrap();
        let path = dir.path().join("sandlot.db");
        (dir, path)
    }

    /// A database of a version before `tenant_usage` (issue 22; its rows written without
    /// the table and triggers) gets the table on open, filled from its rows (those in
    /// `deleting` not counted; cpu in millicores), and the triggers keep it from then on.
    #[test]
    fn tenant_usage_is_backfilled_on_open() {
        let (_tmp, path) = tmpdb("usage-backfill");
        let mk = |id: &str, cpu: f64, mem: u64, tenant: Option<&str>| {
            let mut x = rec(id, 1, None);
            x.spec.cpu = cpu;
            x.spec.memory_mib = mem;
            x.tenant = tenant.map(str::to_owned);
            x
        };
        {
            let s = Store::open(&path).unwrap();
            // What an older version's database looks like: no table, no triggers.
            s.conn()
                .execute_batch(
                    "DROP TRIGGER sandboxes_usage_insert; DROP TRIGGER sandboxes_usage_delete;
                     DROP TRIGGER sandboxes_usage_update; DROP TABLE tenant_usage;",
                )
                .unwrap();
            for x in [
                mk("sb-1", 0.1, 100, Some("key_a")),
                mk("sb-2", 0.2, 200, Some("key_a")),
                mk("sb-3", 1.5, 300, Some("key_a")),
                mk("sb-4", 0.25, 50, None),
                mk("sb-5", 2.0, 1000, Some("key_b")),
            ] {
                assert_eq!(s.insert_with_key(&x, None).unwrap(), KeyOutcome::Inserted);
            }
            assert!(s
                .transition("sb-3", &[SandboxState::Creating], SandboxState::Deleting)
                .unwrap());
            assert!(s
                .transition("sb-5", &[SandboxState::Creating], SandboxState::Deleting)
                .unwrap());
        }
        let s = Store::open(&path).unwrap();
        let want = |v: &[(&str, (i64, i64, i64))]| {
            v.iter()
                .map(|(t, u)| (t.to_string(), *u))
                .collect::<BTreeMap<_, _>>()
        };
        assert_eq!(
            read_tenant_usage(&s.conn()).unwrap(),
            want(&[("", (1, 250, 50)), ("key_a", (2, 300, 300))])
        );
        // Kept from now on; a second open changes nothing.
        assert!(s
            .transition("sb-5", &[SandboxState::Deleting], SandboxState::Running)
            .unwrap());
        drop(s);
        let s = Store::open(&path).unwrap();
        assert_eq!(
            read_tenant_usage(&s.conn()).unwrap(),
            want(&[
                ("", (1, 250, 50)),
                ("key_a", (2, 300, 300)),
                ("key_b", (1, 2000, 1000))
            ])
        );
    }

    #[test]
    fn records_survive_reopen() {
        let (_tmp, path) = tmpdb("reopen");
        {
            let s = Store::open(&path).unwrap();
            assert_eq!(
                s.insert_with_key(&rec("sb-1", 1, Some(5)), None).unwrap(),
                KeyOutcome::Inserted
            );
            assert!(s
                .transition("sb-1", &[SandboxState::Creating], SandboxState::Running)
                .unwrap());
        }
        let s = Store::open(&path).unwrap();
        let r = s.get("sb-1").unwrap().expect("record kept");
        let mut want = rec("sb-1", 1, Some(5));
        want.state = SandboxState::Running;
        assert_eq!(r, want);
        assert_eq!(r.to_api().created_at, "1970-01-01T00:00:00.001Z");
    }

    #[test]
    fn transition_is_compare_and_set() {
        let (_tmp, path) = tmpdb("cas");
        let s = Store::open(&path).unwrap();
        s.insert_with_key(&rec("sb-1", 1, None), None).unwrap();
        assert!(s
            .transition("sb-1", &[SandboxState::Creating], SandboxState::Deleting)
            .unwrap());
        // A create finishing after a delete started must not flip it back.
        assert!(!s
            .transition("sb-1", &[SandboxState::Creating], SandboxState::Running)
            .unwrap());
        assert_eq!(
            s.get("sb-1").unwrap().unwrap().state,
            SandboxState::Deleting
        );
        assert!(!s
            .transition("sb-2", &[SandboxState::Creating], SandboxState::Running)
            .unwrap());
    }

    #[test]
    fn idempotency_keys() {
        let (_tmp, path) = tmpdb("keys");
        let s = Store::open(&path).unwrap();
        assert_eq!(
            s.insert_with_key(&rec("sb-1", 100, None), Some(("k", "d1")))
                .unwrap(),
            KeyOutcome::Inserted
        );
        assert_eq!(
            s.insert_with_key(&rec("sb-2", 101, None), Some(("k", "d1")))
                .unwrap(),
            KeyOutcome::Replay("sb-1".into())
        );
        assert_eq!(
            s.insert_with_key(&rec("sb-3", 102, None), Some(("k", "d2")))
                .unwrap(),
            KeyOutcome::Mismatch
        );
        assert!(s.get("sb-2").unwrap().is_none(), "a replay inserts nothing");
        assert_eq!(s.purge_keys(100).unwrap(), 0);
        assert_eq!(s.purge_keys(101).unwrap(), 1);
        assert_eq!(
            s.insert_with_key(&rec("sb-4", 103, None), Some(("k", "d2")))
                .unwrap(),
            KeyOutcome::Inserted
        );
        s.forget_keys_of("sb-4").unwrap();
        assert_eq!(
            s.insert_with_key(&rec("sb-5", 104, None), Some(("k", "d3")))
                .unwrap(),
            KeyOutcome::Inserted
        );
    }

    #[test]
    fn reaping_and_expiry() {
        let (_tmp, path) = tmpdb("reap");
        let s = Store::open(&path).unwrap();
        s.insert_with_key(&rec("sb-a", 1, Some(50)), None).unwrap();
        s.insert_with_key(&rec("sb-b", 2, Some(150)), None).unwrap();
        s.insert_with_key(&rec("sb-c", 3, None), None).unwrap();
        let due: Vec<_> = s
            .due_for_reaping(100)
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(due, ["sb-a"]);
        s.transition("sb-c", &[SandboxState::Creating], SandboxState::Deleting)
            .unwrap();
        let due: Vec<_> = s
            .due_for_reaping(100)
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(due, ["sb-a", "sb-c"]);
        // Only running records take a new expiry.
        assert!(!s.set_expiry("sb-a", Some(500), 7).unwrap());
        s.transition("sb-a", &[SandboxState::Creating], SandboxState::Running)
            .unwrap();
        assert!(s.set_expiry("sb-a", Some(500), 7).unwrap());
        let a = s.get("sb-a").unwrap().unwrap();
        assert_eq!((a.expires_at_ms, a.spec.ttl_s), (Some(500), 7));
        let ids: Vec<_> = s.list().unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, ["sb-a", "sb-b", "sb-c"]);
        assert!(s.remove("sb-a").unwrap());
        assert!(!s.remove("sb-a").unwrap());
    }

    fn tenant_rec(id: &str, tenant: &str) -> Record {
        let mut r = rec(id, 1, None);
        r.tenant = Some(tenant.into());
        r
    }

    fn key_count(s: &Store) -> i64 {
        s.conn()
            .query_row("SELECT COUNT(*) FROM idempotency", [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn insert_many_answers_per_item_in_one_transaction() {
        let (_tmp, path) = tmpdb("many");
        let s = Store::open(&path).unwrap();
        // A record of the tenant exists already: quota 3 leaves room for 2.
        s.insert_checked(&tenant_rec("sb-0", "t"), None, None)
            .unwrap();
        s.insert_with_key(&rec("sb-k", 1, None), Some(("k1", "d1")))
            .unwrap();
        let q = Quota {
            max_sandboxes: Some(3),
            ..Quota::default()
        };
        let (a, b, c, d) = (
            tenant_rec("sb-a", "t"),
            tenant_rec("sb-b", "t"),
            tenant_rec("sb-c", "t"),
            tenant_rec("sb-0", "other"), // duplicate id: fails alone
        );
        let (e, f, g) = (
            rec("sb-e", 1, None),
            rec("sb-f", 1, None),
            rec("sb-g", 1, None),
        );
        let out = s
            .insert_many(&[
                (&a, Some(("ka", "da")), Some(&q)),
                (&b, None, Some(&q)),
                (&c, Some(("kc", "dc")), Some(&q)), // 4th of the tenant: over, key rolled back
                (&d, None, None),
                (&e, Some(("k1", "d1")), None),    // replay of sb-k
                (&f, Some(("k1", "other")), None), // same key, other body
                (&g, Some(("kg", "dg")), None),
            ])
            .unwrap();
        assert_eq!(out[0].as_ref().unwrap(), &KeyOutcome::Inserted);
        assert_eq!(out[1].as_ref().unwrap(), &KeyOutcome::Inserted);
        assert!(
            matches!(out[2], Ok(KeyOutcome::OverQuota(ref m)) if m.contains("at most 3")),
            "{:?}",
            out[2]
        );
        assert!(
            matches!(out[3], Err(StoreError::Sql { .. })),
            "{:?}",
            out[3]
        );
        assert_eq!(out[4].as_ref().unwrap(), &KeyOutcome::Replay("sb-k".into()));
        assert_eq!(out[5].as_ref().unwrap(), &KeyOutcome::Mismatch);
        assert_eq!(out[6].as_ref().unwrap(), &KeyOutcome::Inserted);
        // Nothing half-created: the refused and failed items left no record and no key.
        let ids: Vec<String> = s.list().unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, ["sb-0", "sb-k", "sb-a", "sb-b", "sb-g"]);
        assert_eq!(s.get("sb-0").unwrap().unwrap().tenant.as_deref(), Some("t"));
        assert_eq!(key_count(&s), 3, "k1, ka, kg; kc was rolled back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grouped_writes_share_commits_and_keep_the_quota() {
        let (_tmp, path) = tmpdb("group");
        let s = std::sync::Arc::new(Store::open(&path).unwrap());
        let q = Quota {
            max_sandboxes: Some(50),
            ..Quota::default()
        };
        // 80 concurrent creates of one tenant against a quota of 50, plus the claim and
        // the running + release write of each admitted one, all through the group writer.
        let tasks: Vec<_> = (0..80)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move {
                    let r = tenant_rec(&format!("sb-{i:03}"), "t");
                    let key = format!("key-{i}");
                    let out = s
                        .insert_grouped(&r, Some((&key, "d")), Some(&q))
                        .await
                        .unwrap();
                    if out != KeyOutcome::Inserted {
                        return false;
                    }
                    assert!(s.claim_grouped(&r.id, "srv", 10, 1).await.unwrap());
                    assert!(s
                        .transition_release_grouped(
                            &r.id,
                            &[SandboxState::Creating],
                            SandboxState::Running,
                            "srv",
                        )
                        .await
                        .unwrap());
                    true
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += usize::from(t.await.unwrap());
        }
        assert_eq!(admitted, 50, "exactly the quota admitted");
        let all = s.list().unwrap();
        assert_eq!(all.len(), 50);
        assert!(all.iter().all(|r| r.state == SandboxState::Running));
        assert_eq!(key_count(&s), 50, "refused creates left no key");
        let owners: i64 = s
            .conn()
            .query_row(
                "SELECT COUNT(*) FROM sandboxes WHERE owner IS NOT NULL",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(owners, 0, "every claim released");
        // A duplicate id fails alone; the group keeps working afterwards.
        let dup = s.insert_grouped(&all[0], None, None).await;
        assert!(matches!(dup, Err(StoreError::Sql { .. })), "{dup:?}");
        let r = rec("sb-after", 1, None);
        assert_eq!(
            s.insert_grouped(&r, None, None).await.unwrap(),
            KeyOutcome::Inserted
        );
        // Durable: a fresh connection sees every committed write.
        drop(s);
        assert_eq!(Store::open(&path).unwrap().list().unwrap().len(), 51);
    }
}
