//! `/v1/sandboxes/{id}/files`: raw file read, write, remove, and directory listing.
//!
//! Paths are paths inside the sandbox (`?path=P`, URL-encoded UTF-8); the node resolves them
//! inside the sandbox root only. A missing `path` is 400 `invalid_argument`. Uploads are
//! limited to `ServerConfig::max_file_bytes` (413 `payload_too_large` over it) and so are
//! downloads (the node answers 400 for a larger file).
use crate::error::{ApiResult, Json, Path, Query, ServerError};
use crate::sandboxes::running;
use crate::SharedState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use sandlot_api::FileList;
use serde::Deserialize;

/// `?path=P`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// Path inside the sandbox.
    pub path: Option<String>,
}

impl PathQuery {
    fn get(self) -> ApiResult<String> {
        match self.path {
            Some(p) if !p.is_empty() => Ok(p),
            _ => Err(ServerError::invalid("missing query parameter `path`")),
        }
    }
}

/// `PUT …/files?path=P`, raw body → 204. Atomic on the node (temp file, fsync, rename).
pub async fn write(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> ApiResult<StatusCode> {
    let path = q.get()?;
    let body = body?;
    running(&st, &id)?;
    st.node.write_file(&id, &path, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET …/files?path=P` → the bytes, `application/octet-stream`.
pub async fn read(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Response> {
    let path = q.get()?;
    running(&st, &id)?;
    let data = st
        .node
        .read_file(&id, &path, st.cfg.max_file_bytes as u64)
        .await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

/// `DELETE …/files?path=P` → 204 (a directory is removed recursively).
pub async fn remove(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<StatusCode> {
    let path = q.get()?;
    running(&st, &id)?;
    st.node.remove_file(&id, &path).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET …/files/list?path=P` → `{"entries": [...]}` sorted by name.
pub async fn list(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Json<FileList>> {
    let path = q.get()?;
    running(&st, &id)?;
    let entries = st.node.list_dir(&id, &path).await?;
    Ok(Json(FileList { entries }))
}
