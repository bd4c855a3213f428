//! `/v1/checkpoints` and `POST /v1/sandboxes/{id}/checkpoints`: disk checkpoints and the
//! forks made from them (`POST /v1/sandboxes {"checkpoint": "ck-…"}`).
//!
//! A checkpoint is the sandbox's writable layer, saved by the node
//! ([`sandlot_node::checkpoints`]); its record (`checkpoints` in `DATA/sandlot.db`) makes it
//! survive server restarts. On start the server removes node checkpoints it has no record
//! of (a crash between the node's copy and the insert) and records whose files are gone.
//!
//! Tenants: a checkpoint belongs to the API key that made it; other tenants get 404 for it
//! (`DELETE` answers 204 and deletes nothing, as for sandboxes), also when they try to fork
//! it; an admin key sees all.
//!
//! Delete vs. forks: every fork copies the checkpoint at create, so deleting a checkpoint
//! with live forks is fine (no refcount); only while a create is copying from it does the
//! node answer 409 `conflict`.
use crate::auth::Principal;
use crate::error::{ApiResult, Json, Path, ServerError};
use crate::store::{rfc3339, sql, Store, StoreError};
use crate::SharedState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Extension;
use rusqlite::{params, OptionalExtension};
use sandlot_api::{Backend, Checkpoint, CheckpointList, ErrorCode, SandboxState};
use std::collections::BTreeMap;

/// One row of `checkpoints`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRow {
    /// `ck-` + 20 hex.
    pub id: String,
    /// The sandbox it was taken from.
    pub sandbox_id: String,
    /// Its backend.
    pub backend: Backend,
    /// Its image.
    pub image: String,
    /// Container runtime.
    pub runtime: Option<String>,
    /// The parent's `disk_mib`.
    pub disk_mib: u64,
    /// Bytes on the node's disk.
    pub size_bytes: u64,
    /// Creation time, Unix ms.
    pub created_at_ms: i64,
    /// API key id that made it; `None` without authentication.
    pub tenant: Option<String>,
}

impl CheckpointRow {
    /// The wire shape.
    pub fn to_api(&self) -> Checkpoint {
        Checkpoint {
            checkpoint_id: self.id.clone(),
            sandbox_id: self.sandbox_id.clone(),
            backend: self.backend,
            image: self.image.clone(),
            runtime: self.runtime.clone(),
            disk_mib: self.disk_mib,
            size_bytes: self.size_bytes,
            created_at: rfc3339(self.created_at_ms),
        }
    }
}

const CK_COLS: &str =
    "id, sandbox_id, backend, image, runtime, disk_mib, size_bytes, created_at, tenant";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(CheckpointRow, String)> {
    let backend: String = r.get(2)?;
    Ok((
        CheckpointRow {
            id: r.get(0)?,
            sandbox_id: r.get(1)?,
            backend: Backend::Function,
            image: r.get(3)?,
            runtime: r.get(4)?,
            disk_mib: r.get::<_, i64>(5)? as u64,
            size_bytes: r.get::<_, i64>(6)? as u64,
            created_at_ms: r.get(7)?,
            tenant: r.get(8)?,
        },
        backend,
    ))
}

fn decode((mut c, backend): (CheckpointRow, String)) -> Result<CheckpointRow, StoreError> {
    c.backend = backend.parse().map_err(|what| StoreError::Corrupt {
        id: c.id.clone(),
        what,
    })?;
    Ok(c)
}

impl Store {
    /// Insert a checkpoint record.
    ///
    /// # Errors
    /// [`StoreError::Sql`] (also for a duplicate id).
    pub fn insert_checkpoint(&self, c: &CheckpointRow) -> Result<(), StoreError> {
        self.conn()
            .execute(
                &format!("INSERT INTO checkpoints ({CK_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"),
                params![
                    c.id,
                    c.sandbox_id,
                    c.backend.as_str(),
                    c.image,
                    c.runtime,
                    c.disk_mib as i64,
                    c.size_bytes as i64,
                    c.created_at_ms,
                    c.tenant
                ],
            )
            .map_err(sql("insert checkpoint"))?;
        Ok(())
    }

    /// The checkpoint record `id`, if any.
    ///
    /// # Errors
    /// [`StoreError::Sql`], [`StoreError::Corrupt`].
    pub fn get_checkpoint(&self, id: &str) -> Result<Option<CheckpointRow>, StoreError> {
        self.conn()
            .query_row(
                &format!("SELECT {CK_COLS} FROM checkpoints WHERE id = ?1"),
                [id],
                row,
            )
            .optional()
            .map_err(sql("select checkpoint"))?
            .map(decode)
            .transpose()
    }

    /// Every checkpoint record, oldest first.
    ///
    /// # Errors
    /// [`StoreError::Sql`], [`StoreError::Corrupt`].
    pub fn list_checkpoints(&self) -> Result<Vec<CheckpointRow>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {CK_COLS} FROM checkpoints ORDER BY created_at, id"
            ))
            .map_err(sql("list checkpoints"))?;
        let rows = stmt
            .query_map([], row)
            .map_err(sql("list checkpoints"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(sql("list checkpoints"))?;
        rows.into_iter().map(decode).collect()
    }

    /// Remove checkpoint record `id` (absent is fine).
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn remove_checkpoint(&self, id: &str) -> Result<(), StoreError> {
        let conn = self.conn();
        conn.execute("DELETE FROM checkpoints WHERE id = ?1", [id])
            .map_err(sql("delete checkpoint"))?;
        conn.execute(
            "DELETE FROM checkpoint_names WHERE checkpoint_id = ?1",
            [id],
        )
        .map_err(sql("delete checkpoint name"))?;
        Ok(())
    }

    /// Set the E2B snapshot name of checkpoint `id`, replacing any (table
    /// `checkpoint_names`, created at the store's open).
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn set_checkpoint_name(&self, id: &str, name: &str) -> Result<(), StoreError> {
        self.conn()
            .execute(
                "INSERT INTO checkpoint_names (checkpoint_id, name) VALUES (?1, ?2)
                 ON CONFLICT (checkpoint_id) DO UPDATE SET name = excluded.name",
                [id, name],
            )
            .map_err(sql("set checkpoint name"))?;
        Ok(())
    }

    /// The E2B snapshot names of the named checkpoints, by checkpoint id.
    ///
    /// # Errors
    /// [`StoreError::Sql`].
    pub fn checkpoint_names(&self) -> Result<BTreeMap<String, String>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT checkpoint_id, name FROM checkpoint_names")
            .map_err(sql("list checkpoint names"))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
            .map_err(sql("list checkpoint names"))?
            .collect::<Result<BTreeMap<_, _>, _>>()
            .map_err(sql("list checkpoint names"))?;
        Ok(rows)
    }
}

/// Creates the SQLite table of E2B snapshot names, `checkpoint_names(checkpoint_id TEXT PK,
/// name TEXT)`, if missing (at [`Store`] open; PostgreSQL's is
/// `migrations/pg/V6__checkpoint_names.sql`).
///
/// # Errors
/// The SQL error.
pub(crate) fn create_name_table(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS checkpoint_names (
            checkpoint_id TEXT PRIMARY KEY, name TEXT NOT NULL);",
    )
}

/// A fresh checkpoint id: `ck-` + 20 lowercase hex digits (80 random bits).
pub fn new_id() -> String {
    let bytes: [u8; 10] = rand::random();
    let mut s = String::from("ck-");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn no_checkpoint(id: &str) -> ServerError {
    ServerError::new(ErrorCode::NotFound, format!("checkpoint not found: {id}"))
}

/// The record of checkpoint `id` if `who` may see it.
///
/// # Errors
/// 404 `not_found` when missing or another tenant's; store errors.
pub async fn visible(st: &SharedState, who: &Principal, id: &str) -> ApiResult<CheckpointRow> {
    match st.store.get_checkpoint(id).await? {
        Some(c) if who.sees(c.tenant.as_deref()) => Ok(c),
        _ => Err(no_checkpoint(id)),
    }
}

/// `POST /v1/sandboxes/{id}/checkpoints` (no body, or `{}`) → 201 `Checkpoint`. The sandbox
/// must be `running` or `paused` (its processes are frozen during the copy and keep
/// running afterwards).
///
/// # Errors
/// 404 (sandbox), 409 (state), 400 `invalid_argument` (the backend cannot checkpoint), the
/// node's error.
pub async fn create(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<Checkpoint>)> {
    let rec = st
        .store
        .get(&id)
        .await?
        .ok_or_else(|| ServerError::no_sandbox(&id))?;
    if !matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
        return Err(ServerError::new(
            ErrorCode::Conflict,
            format!("sandbox {id} is {}, not running", rec.state.as_str()),
        ));
    }
    crate::disk_reserve::check(&st)?;
    st.events.ready()?;
    let ck = new_id();
    // Own task: a client that disconnects must not leave files without a record.
    let st2 = st.clone();
    let tenant = who.tenant.clone();
    let row = tokio::spawn(async move {
        let meta = st2.node.checkpoint(&id, &ck).await?;
        let row = CheckpointRow {
            id: ck.clone(),
            sandbox_id: id.clone(),
            backend: meta.backend,
            image: meta.image,
            runtime: meta.runtime,
            disk_mib: meta.disk_mib,
            size_bytes: meta.size_bytes,
            created_at_ms: meta.created_at_ms,
            tenant,
        };
        if let Err(e) = st2.store.insert_checkpoint(&row).await {
            let _ = st2.node.delete_checkpoint(&ck).await;
            return Err(ServerError::from(e));
        }
        let mut f = serde_json::Map::new();
        f.insert("checkpoint_id".into(), ck.clone().into());
        f.insert("size_bytes".into(), row.size_bytes.into());
        if let Err(e) = crate::events::record(&st2, "checkpointed", Some(&id), Some(row.backend), f)
        {
            // No checkpoint without its audit event: roll it back, fail the call.
            let _ = st2.store.remove_checkpoint(&ck).await;
            let _ = st2.node.delete_checkpoint(&ck).await;
            return Err(ServerError::from(e));
        }
        Ok::<_, ServerError>(row)
    })
    .await
    .map_err(|e| ServerError::new(ErrorCode::Internal, format!("checkpoint task failed: {e}")))??;
    Ok((StatusCode::CREATED, Json(row.to_api())))
}

/// `GET /v1/checkpoints` → `CheckpointList` of the caller's checkpoints (an admin sees all).
pub async fn list(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
) -> ApiResult<Json<CheckpointList>> {
    let checkpoints = st
        .store
        .list_checkpoints()
        .await?
        .into_iter()
        .filter(|c| who.sees(c.tenant.as_deref()))
        .map(|c| c.to_api())
        .collect();
    Ok(Json(CheckpointList { checkpoints }))
}

/// `GET /v1/checkpoints/{checkpoint_id}` → `Checkpoint` or 404.
pub async fn get_one(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<Checkpoint>> {
    Ok(Json(visible(&st, &who, &id).await?.to_api()))
}

/// `DELETE /v1/checkpoints/{checkpoint_id}` → 204, also when unknown (or another tenant's:
/// nothing is deleted then); 409 while a create copies from it.
pub async fn delete(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let Ok(c) = visible(&st, &who, &id).await else {
        return Ok(StatusCode::NO_CONTENT);
    };
    st.node.delete_checkpoint(&c.id).await?;
    st.store.remove_checkpoint(&c.id).await?;
    let mut f = serde_json::Map::new();
    f.insert("checkpoint_id".into(), c.id.clone().into());
    // Deletes never fail for their event (deleting frees space); it waits in the queue.
    crate::events::record_queued(
        &st,
        "checkpoint_deleted",
        Some(&c.sandbox_id),
        Some(c.backend),
        f,
    );
    Ok(StatusCode::NO_CONTENT)
}

/// Fill a create request's fields from its `checkpoint` (see
/// [`sandlot_api::CreateSandboxRequest::checkpoint`]); `backend_given` says whether the
/// body named a backend (the field's own default is `function`).
///
/// # Errors
/// 404 for an unknown (or another tenant's) checkpoint; 400 when `backend` or `image`
/// differ from the checkpoint's.
pub async fn fill_from_checkpoint(
    st: &SharedState,
    who: &Principal,
    req: &mut sandlot_api::CreateSandboxRequest,
    backend_given: bool,
) -> ApiResult<()> {
    let Some(id) = req.checkpoint.clone() else {
        return Ok(());
    };
    if sandlot_node_api::check_checkpoint_id(&id).is_err() {
        return Err(ServerError::invalid(format!(
            "checkpoint {id:?} is not ck- followed by 20 lowercase hex digits"
        )));
    }
    let c = visible(st, who, &id).await?;
    if backend_given && req.backend != c.backend {
        return Err(ServerError::invalid(format!(
            "backend {} does not match checkpoint {id}'s backend {} (omit it to use the checkpoint's)",
            req.backend, c.backend
        )));
    }
    req.backend = c.backend;
    match &req.image {
        Some(i) if *i != c.image => {
            return Err(ServerError::invalid(format!(
                "image {i:?} does not match checkpoint {id}'s image {:?} (omit it to use the checkpoint's)",
                c.image
            )))
        }
        _ => req.image = Some(c.image.clone()),
    }
    if req.backend == Backend::Container && req.runtime.is_none() {
        req.runtime = c.runtime.clone();
    }
    if req.disk_mib.is_none() {
        req.disk_mib = Some(c.disk_mib);
    }
    Ok(())
}

/// At start: remove node checkpoints without a record and records without node files.
///
/// # Errors
/// Store or node errors.
pub async fn recover(st: &SharedState) -> anyhow::Result<()> {
    let on_node: std::collections::HashSet<String> =
        st.node.list_checkpoints().await?.into_iter().collect();
    let rows = st.store.list_checkpoints().await?;
    let known: std::collections::HashSet<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    for id in on_node.iter().filter(|i| !known.contains(i.as_str())) {
        tracing::warn!(checkpoint = %id, "checkpoint without a record; removed");
        st.node.delete_checkpoint(id).await?;
    }
    for r in rows.iter().filter(|r| !on_node.contains(&r.id)) {
        tracing::warn!(checkpoint = %r.id, "checkpoint files are gone; record removed");
        st.store.remove_checkpoint(&r.id).await?;
    }
    Ok(())
}
