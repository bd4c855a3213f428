//! `/v1/sandboxes/{id}/files`: raw file read, write, remove, and directory listing.
//!
//! Paths are paths inside the sandbox (`?path=P`, URL-encoded UTF-8); the node resolves them
//! inside the sandbox root only. A missing `path` is 400 `invalid_argument`. Uploads are
//! limited to `ServerConfig::max_file_bytes` (413 `payload_too_large` over it) and so are
//! downloads (the node answers 400 for a larger file).
//!
//! Audit: a path whose `..` components climb above `/` (resolved inside the sandbox root
//! anyway), and a call the node refuses because the path would leave the sandbox (a symlink
//! out or a magic link, a special file system such as `/proc` or `/sys`, a mount point, the
//! agent's or runtime's own files, permission), are recorded as `violation` events (layer
//! `files_api`, [`crate::events::files_violation`]).
//!
//! `?step=N` (trajectory log, [`crate::trajectory`]): write and remove are logged mutating
//! steps; read and list are logged only when `step` is given. A replayed answer carries the
//! header `Sandlot-Replayed: true`.
use crate::error::{ApiResult, Json, Path, Query, ServerError};
use crate::sandboxes::running;
use crate::trajectory::call;
use crate::trajectory_store::{StepRequest, StepResult};
use crate::SharedState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sandlot_api::{ErrorCode, FileList};
use serde::Deserialize;

/// `?path=P[&step=N]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// Path inside the sandbox.
    pub path: Option<String>,
    /// Trajectory step (see [`crate::trajectory`]).
    #[serde(default)]
    pub step: Option<u64>,
}

impl PathQuery {
    fn get(&self) -> ApiResult<String> {
        match &self.path {
            Some(p) if !p.is_empty() => Ok(p.clone()),
            _ => Err(ServerError::invalid("missing query parameter `path`")),
        }
    }
}

/// Header set to `true` on a file answer that came from the trajectory log.
pub const REPLAYED_HEADER: &str = "sandlot-replayed";

fn with_replayed(mut resp: Response, replayed: bool) -> Response {
    if replayed {
        resp.headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    resp
}

/// True when the lexical `..` components of `path` climb above `/` (e.g. `../../etc/x`
/// from `/workspace`, or `/../x`): an attempt to leave the sandbox, which the node clamps
/// to its root (openat2 `RESOLVE_IN_ROOT`).
pub fn climbs_above_root(path: &str) -> bool {
    let mut depth: i64 = if path.starts_with('/') {
        0
    } else {
        // relative paths start in /workspace (sandlot_node_api::WORKDIR)
        1
    };
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return true;
                }
            }
            _ => depth += 1,
        }
    }
    false
}

/// Node refusals that mean the path tried to leave the sandbox or reach what the sandbox
/// must not touch through the files API (messages of `sandlot_node::files` and the
/// container backend's files checks).
fn is_escape_refusal(e: &sandlot_api::ApiError) -> bool {
    const MARKERS: [&str; 7] = [
        "escapes the sandbox",
        "is not served by the sandbox's file API",
        "forbidden link",
        "special file system",
        "not part of the sandbox",
        "mount point",
        "permission denied",
    ];
    matches!(
        e.code,
        ErrorCode::InvalidArgument | ErrorCode::PermissionDenied
    ) && MARKERS.iter().any(|m| e.message.contains(m))
}

/// Audit of one files API call on `rec`: the climb check now, refusals in `r`.
fn audited<T>(
    st: &SharedState,
    rec: &crate::store::Record,
    op: &str,
    path: &str,
    r: ApiResult<T>,
) -> ApiResult<T> {
    if climbs_above_root(path) {
        let e = sandlot_api::ApiError::new(
            ErrorCode::InvalidArgument,
            format!("path climbs above / and was resolved inside the sandbox root: {path}"),
        );
        crate::events::files_violation(st, &rec.id, rec.backend, op, path, &e);
    }
    if let Err(err) = &r {
        let e = err.api_error();
        if is_escape_refusal(&e) {
            crate::events::files_violation(st, &rec.id, rec.backend, op, path, &e);
        }
    }
    r
}

fn wrong_kind(q: &PathQuery) -> ServerError {
    ServerError::new(
        ErrorCode::Internal,
        format!("logged step {:?} has another kind", q.step),
    )
}

/// Bytes of server memory a buffered upload reserves per byte of its body: the buffered
/// body and the node's copies while it writes (measured: two concurrent 250 MiB uploads
/// took the server to ~1 GiB RSS, ~2 × each). Only uploads logged as trajectory steps are
/// buffered; other uploads (E2B gzip ones too) stream ([`crate::budget::STREAM_SHARE`]).
pub const UPLOAD_SHARE_FACTOR: u64 = 2;

/// Whether the query string `q` has a `step` parameter (a logged, buffered upload).
fn has_step(q: Option<&str>) -> bool {
    q.is_some_and(|q| {
        q.split('&')
            .any(|kv| kv == "step" || kv.starts_with("step="))
    })
}

/// Middleware of the files route: a `PUT` (upload) first reserves its share of the
/// server-wide file data budget (`AppState::file_budget`, shared with file reads), before
/// a byte of the body is read, and holds it until the answer: a streamed upload
/// [`crate::budget::STREAM_SHARE`] (at most its `Content-Length`), one logged as a
/// trajectory step (`?step=`, buffered whole) [`UPLOAD_SHARE_FACTOR`] × its
/// `Content-Length` (without one, `max_file_bytes`); over budget for 2 s → 429
/// `resource_exhausted` with `Retry-After`. Other methods pass.
pub async fn upload_share(
    State(st): State<SharedState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.method() != axum::http::Method::PUT {
        return next.run(req).await;
    }
    let len = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(st.cfg.max_file_bytes as u64)
        .min(st.cfg.max_file_bytes as u64 + 1);
    let share = if has_step(req.uri().query()) {
        len.saturating_mul(UPLOAD_SHARE_FACTOR)
    } else {
        len.min(crate::budget::STREAM_SHARE)
    };
    match st.file_budget.reserve(share).await {
        Ok((_share, _)) => next.run(req).await,
        Err(e) => ServerError::from(e).into_response(),
    }
}

/// The request's `Content-Length`, when it has a valid one.
pub(crate) fn content_length(h: &axum::http::HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// 413 `payload_too_large` of an upload over `limit` bytes.
pub(crate) fn upload_too_large(limit: u64) -> ServerError {
    ServerError::new(
        ErrorCode::PayloadTooLarge,
        format!("upload over the limit of {limit} bytes; nothing was written"),
    )
}

/// Streams `body` into `path` of sandbox `id` through [`sandlot_node_api::Node::
/// write_file_stream`] (no whole file in server memory), at most `limit` bytes: a
/// `Content-Length` over it is refused before a byte is read, and a body that grows past
/// it is cut off there; both answer 413 `payload_too_large` and leave no file (nor temp
/// file) behind. A body that breaks off (client gone) leaves nothing either. Answers the
/// bytes written. (Also the E2B `POST /files` octet-stream upload.)
///
/// # Errors
/// `payload_too_large`; the node's.
pub(crate) async fn stream_upload<S, E>(
    st: &SharedState,
    id: &str,
    path: &str,
    declared: Option<u64>,
    body: S,
    limit: u64,
) -> ApiResult<u64>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use futures::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    if declared.is_some_and(|n| n > limit) {
        return Err(upload_too_large(limit));
    }
    let over = Arc::new(AtomicBool::new(false));
    let flag = over.clone();
    let mut seen = 0u64;
    let stream = body.map(move |c| {
        let c = c.map_err(std::io::Error::other)?;
        seen += c.len() as u64;
        if seen > limit {
            flag.store(true, Ordering::SeqCst);
            return Err(std::io::Error::other("over the upload limit"));
        }
        Ok(c)
    });
    let r = st
        .node
        .write_file_stream(id, path, Box::pin(stream), limit)
        .await;
    if over.load(Ordering::SeqCst) {
        return Err(upload_too_large(limit));
    }
    Ok(r?)
}

/// `PUT …/files?path=P[&step=N]`, raw body → 204 (`Sandlot-Replayed: true` when replayed).
/// Atomic on the node (temp file, fsync, rename). Without `step` the body is streamed to
/// the node as it arrives (`stream_upload`); a logged step is buffered whole, and has to
/// be: its sha256 is part of the request digest that decides replay (nothing written) or
/// divergence (409) before the node is touched, and its bytes go into the trajectory log
/// as a blob that a restore writes again (a logged read likewise keeps the bytes it
/// answered, for replays). The budget share ([`upload_share`]) bounds what that holds.
pub async fn write(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
    req: axum::extract::Request,
) -> ApiResult<Response> {
    let path = q.get()?;
    let (parts, body) = req.into_parts();
    let rec = running(&st, &id).await?;
    crate::disk_reserve::check(&st)?;
    let limit = st.cfg.max_file_bytes as u64;
    if q.step.is_none() {
        let declared = content_length(&parts.headers);
        let r = stream_upload(
            &st,
            &rec.id,
            &path,
            declared,
            body.into_data_stream(),
            limit,
        )
        .await;
        audited(&st, &rec, "write", &path, r)?;
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let data = axum::body::to_bytes(body, st.cfg.max_file_bytes)
        .await
        .map_err(|_| upload_too_large(limit))?;
    let r = call(
        &st,
        &rec,
        q.step,
        StepRequest::WriteFile {
            path: path.clone(),
            data,
        },
    )
    .await;
    let (_, replayed) = audited(&st, &rec, "write", &path, r)?;
    Ok(with_replayed(
        StatusCode::NO_CONTENT.into_response(),
        replayed,
    ))
}

/// `GET …/files?path=P[&step=N]` → the bytes, `application/octet-stream`. Logged only with
/// `step`. Without `step` the file is streamed as the node reads it (chunked, holding
/// [`crate::budget::STREAM_SHARE`] of the file budget); an error after the first byte
/// (the file grew past the limit, an I/O error) aborts the answer, so a client never
/// takes a short file for the whole.
pub async fn read(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Response> {
    let path = q.get()?;
    let rec = running(&st, &id).await?;
    if q.step.is_none() {
        let r = st
            .budget_node
            .read_stream_held(&rec.id, &path, st.cfg.max_file_bytes as u64)
            .await
            .map_err(ServerError::from);
        let data = audited(&st, &rec, "read", &path, r)?;
        return Ok((
            [(header::CONTENT_TYPE, "application/octet-stream")],
            axum::body::Body::from_stream(data),
        )
            .into_response());
    }
    let r = call(
        &st,
        &rec,
        q.step,
        StepRequest::ReadFile { path: path.clone() },
    )
    .await;
    match audited(&st, &rec, "read", &path, r)? {
        (StepResult::Data(data), replayed) => Ok(with_replayed(
            ([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response(),
            replayed,
        )),
        _ => Err(wrong_kind(&q)),
    }
}

/// A body of `data` in 1 MiB chunks that keeps `permit` until the last chunk was taken:
/// hyper asks for the next chunk only once the previous ones are mostly written, so the
/// budget share lives about as long as the bytes do. (Also the E2B `GET /files` body.)
pub(crate) fn held_body(
    data: Vec<u8>,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> axum::body::Body {
    use futures::StreamExt;
    const CHUNK: usize = 1 << 20;
    let data = Bytes::from(data);
    let chunks: Vec<Bytes> = (0..data.len())
        .step_by(CHUNK)
        .map(|i| data.slice(i..(i + CHUNK).min(data.len())))
        .collect();
    let stream = futures::stream::iter(chunks).map(move |c| {
        let _held = &permit;
        Ok::<_, std::convert::Infallible>(c)
    });
    axum::body::Body::from_stream(stream)
}

/// `DELETE …/files?path=P[&step=N]` → 204 (a directory is removed recursively;
/// `Sandlot-Replayed: true` when replayed).
pub async fn remove(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Response> {
    let path = q.get()?;
    let rec = running(&st, &id).await?;
    let r = call(
        &st,
        &rec,
        q.step,
        StepRequest::RemoveFile { path: path.clone() },
    )
    .await;
    let (_, replayed) = audited(&st, &rec, "remove", &path, r)?;
    Ok(with_replayed(
        StatusCode::NO_CONTENT.into_response(),
        replayed,
    ))
}

/// `GET …/files/list?path=P[&step=N]` → `{"entries": [...]}` sorted by name. Logged only
/// with `step`.
pub async fn list(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> ApiResult<Response> {
    let path = q.get()?;
    let rec = running(&st, &id).await?;
    let r = call(
        &st,
        &rec,
        q.step,
        StepRequest::ListDir { path: path.clone() },
    )
    .await;
    match audited(&st, &rec, "list", &path, r)? {
        (StepResult::List(entries), replayed) => Ok(with_replayed(
            Json(FileList { entries }).into_response(),
            replayed,
        )),
        _ => Err(wrong_kind(&q)),
    }
}

/// `?path=P` of `…/files/stat` (not logged in trajectories, so no `step`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatQuery {
    /// Path inside the sandbox.
    pub path: Option<String>,
}

/// `GET …/files/stat?path=P` → `FileEntry` JSON `{"name","type","size","mode","mtime"}` of
/// the path (symlinks followed inside the sandbox; `name` is the last component, `/` for
/// the root). Not logged in trajectories.
pub async fn stat(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<StatQuery>,
) -> ApiResult<Response> {
    let path = match q.path {
        Some(p) if !p.is_empty() => p,
        _ => return Err(ServerError::invalid("missing query parameter `path`")),
    };
    let rec = running(&st, &id).await?;
    let entry = st.node.stat_file(&rec.id, &path).await?;
    Ok(Json(entry).into_response())
}

/// `?path=P[&parents=true]` of `…/files/mkdir`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirQuery {
    /// Path inside the sandbox.
    pub path: Option<String>,
    /// Create missing parents and accept an existing directory (`mkdir -p`); default false.
    #[serde(default)]
    pub parents: bool,
}

/// `POST …/files/mkdir?path=P[&parents=true]` → 204. Without `parents`: 404 `not_found` when
/// the parent is missing, 409 `conflict` when the path exists; with it, 409 only when a
/// non-directory is in the way. Not logged in trajectories.
pub async fn mkdir(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    Query(q): Query<MkdirQuery>,
) -> ApiResult<Response> {
    let path = match q.path {
        Some(p) if !p.is_empty() => p,
        _ => return Err(ServerError::invalid("missing query parameter `path`")),
    };
    let rec = running(&st, &id).await?;
    st.node.make_dir(&rec.id, &path, q.parents).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[cfg(test)]
mod tests {
    use super::climbs_above_root;

    #[test]
    fn climbing_above_the_root_is_seen() {
        for p in [
            "/..",
            "/../etc/passwd",
            "../../x",
            "a/../../../x",
            "/a/b/../../../c",
        ] {
            assert!(climbs_above_root(p), "{p}");
        }
        for p in ["/", "x", "../x", "/a/../b", "./a/./b/..", "/a//b/../../c"] {
            assert!(!climbs_above_root(p), "{p}");
        }
    }
}
