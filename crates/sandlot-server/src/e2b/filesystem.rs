//! envd's `filesystem.Filesystem` service (`spec/envd/filesystem/filesystem.proto`) and its
//! `/files` HTTP routes (`spec/envd/envd.yaml`), over the node's file calls.
//!
//! | method / route | Sandlot |
//! |---|---|
//! | `Stat {path}` → `{entry}` | stat (symlinks followed inside the sandbox) |
//! | `ListDir {path, depth}` → `{entries}` | list, recursing into directories down to `depth` (default 1), at most [`MAX_ENTRIES`] entries, in envd's order (depth first, by name) |
//! | `MakeDir {path}` → `{entry}` | `mkdir -p`; `already_exists` when the path exists |
//! | `Move {source, destination}` → `{entry}` | `mv` in the sandbox (destination's parents created) |
//! | `Remove {path}` → `{}` | remove (a directory recursively); a missing path is not an error (envd's `os.RemoveAll`) |
//! | `GET /files?path=&username=` → the bytes | read, at most `max_file_bytes`; over 1 MiB streamed as read |
//! | `POST /files?path=&username=`, `multipart/form-data` (part `file`, its filename the path when `path` is absent) or `application/octet-stream` → `[{name, type: "file", path}]` | write (parents created), at most `max_file_bytes` per file; streamed to the node as it arrives (gzip inflated on the way) |
//!
//! `EntryInfo` is `{name, type: FILE_TYPE_FILE|FILE_TYPE_DIRECTORY|FILE_TYPE_SYMLINK, path,
//! size, mode, permissions ("-rw-r--r--"), owner, group, modifiedTime}`; owner and group are
//! always `root` (the sandbox's own root owns every file). Relative paths and `~` resolve
//! against the E2B user's home ([`super::home_of`]). The watcher methods (`WatchDir`,
//! `CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`) are served by [`super::watch`].
//!
//! **gzip** (what the SDK's `gzip=True` sends): an upload with `Content-Encoding: gzip`
//! (or `x-gzip`) is inflated as it arrives and streamed on like a plain upload
//! ([`gunzip_stream`]: ~100 KiB of memory whatever the ratio), at most `max_file_bytes`
//! inflated bytes per file (+ 64 KiB of multipart framing in all) — more is refused with
//! 413 without inflating further and leaves nothing of that file, data that is not gzip
//! (or cut short) 400, any other encoding 400. A
//! download whose `Accept-Encoding` accepts gzip ([`accepts_gzip`]) is sent gzip-compressed
//! as it goes out, with `Content-Encoding: gzip`, when its data is [`compressible`] and at
//! most [`STREAM_DOWNLOAD_ABOVE`] (1 MiB; larger files stream out as they are); random,
//! encrypted or already compressed data and files under 1 KiB go out as they are (httpx,
//! under the `e2b` SDK, accepts gzip on every request: deflating 1 MiB of random bytes
//! cost ~10 ms on the server and again on the client, for no smaller body).
use super::connect::{check_kind, unary_ok, unary_request, CallKind, ConnectError};
use super::{ensure_home, home_of, sandbox_of, visible_running, watch, E2bUser};
use crate::auth::Principal;
use crate::error::ServerError;
use crate::SharedState;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sandlot_api::{Cmd, ErrorCode, ExecRequest, FileEntry, FileType};
use serde::Deserialize;

/// Most entries one `ListDir` answers.
pub const MAX_ENTRIES: usize = 10_000;

#[derive(Debug, Default, Deserialize)]
struct PathReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
struct MoveReq {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

/// The absolute path of `p` for E2B user home `home`: `~` and `~/x` and relative paths
/// resolve against it.
///
/// # Errors
/// `invalid_argument` for an empty path.
pub fn resolve(p: &str, home: &str) -> Result<String, ConnectError> {
    if p.is_empty() {
        return Err(ConnectError::invalid("path is required"));
    }
    if p == "~" {
        return Ok(home.to_owned());
    }
    if let Some(rest) = p.strip_prefix("~/") {
        return Ok(format!("{home}/{rest}"));
    }
    if p.starts_with('/') {
        return Ok(p.to_owned());
    }
    Ok(format!("{home}/{p}"))
}

fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// `-rwxr-xr-x`-style permissions of `mode` (Go's `FileMode.String()`, which envd sends).
pub fn permissions(kind: FileType, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileType::Dir => 'd',
        FileType::Symlink => 'L',
        _ => '-',
    });
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

/// envd's `EntryInfo` of `e` at `path`.
pub fn entry_info(e: &FileEntry, path: &str) -> serde_json::Value {
    let kind = match e.kind {
        FileType::File => "FILE_TYPE_FILE",
        FileType::Dir => "FILE_TYPE_DIRECTORY",
        FileType::Symlink => "FILE_TYPE_SYMLINK",
        FileType::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let mut info = serde_json::json!({
        "name": e.name,
        "type": kind,
        "path": path,
        "size": e.size.to_string(),
        "mode": e.mode,
        "permissions": permissions(e.kind, e.mode),
        "owner": "root",
        "group": "root",
        "modifiedTime": crate::store::rfc3339(e.mtime.saturating_mul(1000)),
    });
    if let Some(t) = &e.link_target {
        info["symlinkTarget"] = t.as_str().into();
    }
    info
}

/// `POST /filesystem.Filesystem/{method}`: the methods of the module docs.
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
    let watching = watch::is_watch_method(&method);
    if !watching
        && !matches!(
            method.as_str(),
            "Stat" | "ListDir" | "MakeDir" | "Move" | "Remove"
        )
    {
        let mut e = ConnectError::new(
            "unimplemented",
            format!("no method filesystem.Filesystem/{method}"),
        );
        e.status = Some(StatusCode::NOT_FOUND);
        return e.into_response();
    }
    let checked = if watching {
        watch::check(&method, &headers)
    } else {
        check_kind(&headers, CallKind::Unary)
    };
    if let Err(e) = checked {
        return watch::fail(&method, e);
    }
    let body = match axum::body::to_bytes(body, st.cfg.max_json_bytes).await {
        Ok(b) => b,
        Err(e) => {
            return watch::fail(
                &method,
                ConnectError::new("resource_exhausted", format!("request body: {e}")),
            )
        }
    };
    let out = async {
        let id = super::running_sandbox_of(&st, &who, &headers).await?;
        let home = home_of(user.as_deref());
        ensure_home(&st, &id, &home).await?;
        match method.as_str() {
            "Stat" => stat(&st, &id, &home, &body).await,
            "ListDir" => list_dir(&st, &id, &home, &body).await,
            "MakeDir" => make_dir(&st, &id, &home, &body).await,
            "Move" => move_(&st, &id, &home, &body).await,
            "Remove" => remove(&st, &id, &home, &body).await,
            m => watch::serve(&st, &id, &home, m, &headers, &body).await,
        }
    };
    out.await
        .unwrap_or_else(|e: ConnectError| watch::fail(&method, e))
}

async fn stat_at(
    st: &SharedState,
    id: &str,
    path: &str,
) -> Result<serde_json::Value, ConnectError> {
    let e = st.node.stat_file(id, path).await?;
    Ok(entry_info(&e, path))
}

async fn stat(
    st: &SharedState,
    id: &str,
    home: &str,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    let req: PathReq = unary_request(body)?;
    let path = resolve(&req.path, home)?;
    Ok(unary_ok(
        serde_json::json!({"entry": stat_at(st, id, &path).await?}),
    ))
}

async fn list_dir(
    st: &SharedState,
    id: &str,
    home: &str,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    let req: PathReq = unary_request(body)?;
    let path = resolve(&req.path, home)?;
    let depth = req.depth.filter(|d| *d > 0).unwrap_or(1);
    let top = st.node.stat_file(id, &path).await?;
    if top.kind != FileType::Dir {
        return Err(ConnectError::invalid(format!("{path} is not a directory")));
    }
    let mut out = Vec::new();
    let mut todo = vec![(path, 1u32)];
    while let Some((dir, level)) = todo.pop() {
        for e in st.node.list_dir(id, &dir).await? {
            let p = join(&dir, &e.name);
            if e.kind == FileType::Dir && level < depth {
                todo.push((p.clone(), level + 1));
            }
            out.push((p.clone(), entry_info(&e, &p)));
            if out.len() > MAX_ENTRIES {
                return Err(ConnectError::new(
                    "resource_exhausted",
                    format!("more than {MAX_ENTRIES} entries; list with a smaller depth"),
                ));
            }
        }
    }
    // envd's order (`filepath.WalkDir`): depth first, each directory's entries by name,
    // a directory followed by what is in it.
    out.sort_by(|(a, _), (b, _)| a.split('/').cmp(b.split('/')));
    let entries: Vec<serde_json::Value> = out.into_iter().map(|(_, e)| e).collect();
    Ok(unary_ok(serde_json::json!({ "entries": entries })))
}

async fn make_dir(
    st: &SharedState,
    id: &str,
    home: &str,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    let req: PathReq = unary_request(body)?;
    let path = resolve(&req.path, home)?;
    match st.node.stat_file(id, &path).await {
        Ok(_) => {
            return Err(ConnectError::new(
                "already_exists",
                format!("{path} already exists"),
            ))
        }
        Err(sandlot_node_api::NodeError::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    st.node.make_dir(id, &path, true).await?;
    Ok(unary_ok(
        serde_json::json!({"entry": stat_at(st, id, &path).await?}),
    ))
}

fn parent(p: &str) -> Option<&str> {
    let t = p.trim_end_matches('/');
    match t.rfind('/') {
        Some(0) | None => None,
        Some(i) => Some(&t[..i]),
    }
}

async fn move_(
    st: &SharedState,
    id: &str,
    home: &str,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    let req: MoveReq = unary_request(body)?;
    let src = resolve(&req.source, home)?;
    let dst = resolve(&req.destination, home)?;
    st.node.stat_file(id, &src).await?;
    if let Some(dir) = parent(&dst) {
        st.node.make_dir(id, dir, true).await?;
    }
    let mut ex = ExecRequest::new(Cmd::Argv(vec![
        "mv".into(),
        "-f".into(),
        "--".into(),
        src.clone(),
        dst.clone(),
    ]));
    ex.timeout_s = Some(60.0);
    let r = st.node.exec(id, &ex, None).await?;
    if r.exit_code != 0 {
        let msg = r.stderr.trim().to_owned();
        return Err(ConnectError::new(
            "invalid_argument",
            format!("cannot move {src} to {dst}: {msg}"),
        ));
    }
    Ok(unary_ok(
        serde_json::json!({"entry": stat_at(st, id, &dst).await?}),
    ))
}

async fn remove(
    st: &SharedState,
    id: &str,
    home: &str,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    let req: PathReq = unary_request(body)?;
    let path = resolve(&req.path, home)?;
    // envd removes with `os.RemoveAll`: a missing path is not an error (E2B's
    // `test_remove_non_existing_file`).
    match st.node.stat_file(id, &path).await {
        Err(sandlot_node_api::NodeError::NotFound(_)) => {
            return Ok(unary_ok(serde_json::json!({})))
        }
        r => r?,
    };
    st.node.remove_file(id, &path).await?;
    Ok(unary_ok(serde_json::json!({})))
}

/// An error of the `/files` routes in envd's shape `{"code": <HTTP status>, "message"}`.
fn files_error(e: ServerError) -> Response {
    let api = e.api_error();
    let status = StatusCode::from_u16(api.code.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
    (
        status,
        axum::Json(serde_json::json!({"code": status.as_u16(), "message": api.message})),
    )
        .into_response()
}

#[derive(Debug, Default)]
struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
}

fn files_query(uri: &axum::http::Uri) -> Result<FilesQuery, ServerError> {
    let m = axum::extract::Query::<std::collections::HashMap<String, String>>::try_from_uri(uri)
        .map_err(|e| ServerError::invalid(format!("query string: {e}")))?
        .0;
    let get = |k: &str| m.get(k).filter(|s| !s.is_empty()).cloned();
    Ok(FilesQuery {
        path: get("path"),
        username: get("username"),
    })
}

struct FilesCtx {
    id: String,
    home: String,
    q: FilesQuery,
}

async fn files_ctx(
    st: &SharedState,
    req: &axum::http::request::Parts,
) -> Result<FilesCtx, ServerError> {
    let who = req
        .extensions
        .get::<Principal>()
        .cloned()
        .unwrap_or_else(Principal::anonymous);
    let q = files_query(&req.uri)?;
    let user = q
        .username
        .clone()
        .or_else(|| req.extensions.get::<E2bUser>().map(|u| u.0.clone()));
    let id = sandbox_of(&req.headers)?;
    visible_running(st, &who, &id).await?;
    let home = home_of(user.as_deref());
    ensure_home(st, &id, &home).await?;
    Ok(FilesCtx { id, home, q })
}

fn resolve_files(p: &str, home: &str) -> Result<String, ServerError> {
    resolve(p, home).map_err(|e| ServerError::invalid(e.message))
}

/// How an upload body is encoded (`Content-Encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyEncoding {
    Identity,
    Gzip,
}

fn body_encoding(h: &HeaderMap) -> Result<BodyEncoding, ServerError> {
    let v = h
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase())
        .unwrap_or_default();
    match v.as_str() {
        "" | "identity" => Ok(BodyEncoding::Identity),
        "gzip" | "x-gzip" => Ok(BodyEncoding::Gzip),
        other => Err(ServerError::invalid(format!(
            "Content-Encoding {other:?} of uploads is not supported: send gzip or identity"
        ))),
    }
}

/// Why a [`gunzip_stream`] stopped with an error: the error its stream yielded was
/// about the gzip data itself, and the upload answers this instead of what its reader
/// made of the broken stream.
#[derive(Debug, Default)]
pub struct GunzipFailure(std::sync::Mutex<Option<ServerError>>);

impl GunzipFailure {
    fn set(&self, e: ServerError) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
    }

    /// The error, once (None when the gzip data was fine).
    pub fn take(&self) -> Option<ServerError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Input bytes of a gzip upload [`gunzip_stream`] hands the inflater per call: each call
/// yields at most the inflater's 32 KiB buffer, so output is bounded per step whatever the
/// ratio.
const GUNZIP_STEP: usize = 8 * 1024;
/// Inflated bytes [`gunzip_stream`] gathers before it yields a chunk.
const GUNZIP_CHUNK: usize = 64 * 1024;

/// `body` (gzip data, every member, RFC 1952) inflated as it arrives: a stream of chunks
/// of about `GUNZIP_CHUNK` (64 KiB) bytes, at most `limit` inflated bytes in all, never more than
/// a chunk and the inflater's buffers (~100 KiB) in memory whatever the compression ratio
/// (a gzip bomb is stopped at `limit` without inflating further). Inflating runs in the
/// consumer's task, a bounded step per poll.
///
/// On an error the stream yields an `io::Error` and ends; what the caller should answer is
/// left in `failure`: `payload_too_large` past `limit`, `invalid_argument` for data that
/// is not gzip (or a truncated one). An error of `body` itself is passed on as it is
/// (`failure` stays empty).
pub fn gunzip_stream<S, E>(
    body: S,
    limit: u64,
    failure: std::sync::Arc<GunzipFailure>,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static
where
    S: futures::Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    use futures::StreamExt;
    use std::io::Write;
    struct State<S> {
        body: S,
        dec: flate2::write::MultiGzDecoder<Vec<u8>>,
        pending: Bytes,
        out_total: u64,
        ended: bool,
    }
    let bad = {
        let failure = failure.clone();
        move |e: std::io::Error| {
            let msg = format!("the upload says Content-Encoding: gzip but is not gzip data: {e}");
            failure.set(ServerError::invalid(msg.clone()));
            std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
        }
    };
    let state = State {
        body,
        dec: flate2::write::MultiGzDecoder::new(Vec::with_capacity(GUNZIP_CHUNK)),
        pending: Bytes::new(),
        out_total: 0,
        ended: false,
    };
    futures::stream::try_unfold(state, move |mut s| {
        let bad = bad.clone();
        let failure = failure.clone();
        async move {
            // An `Err` ends the stream (try_unfold drops the state).
            loop {
                let have = s.dec.get_ref().len();
                if s.out_total + have as u64 > limit {
                    let msg =
                        format!("the gzip upload inflates to more than the limit of {limit} bytes");
                    failure.set(ServerError::new(ErrorCode::PayloadTooLarge, msg.clone()));
                    return Err(std::io::Error::other(msg));
                }
                if have >= GUNZIP_CHUNK || (s.ended && have > 0) {
                    let out = std::mem::take(s.dec.get_mut());
                    s.out_total += out.len() as u64;
                    return Ok(Some((Bytes::from(out), s)));
                }
                if s.ended {
                    return Ok(None);
                }
                if !s.pending.is_empty() {
                    let step = s.pending.len().min(GUNZIP_STEP);
                    let n = s.dec.write(&s.pending[..step]).map_err(&bad)?;
                    if n == 0 {
                        return Err(bad(std::io::Error::other("the inflater took no input")));
                    }
                    let _ = s.pending.split_to(n);
                    continue;
                }
                match s.body.next().await {
                    Some(Ok(c)) => s.pending = c,
                    Some(Err(e)) => return Err(std::io::Error::other(e)),
                    None => {
                        // The end: a truncated member is an error, not a short file.
                        s.dec.try_finish().map_err(&bad)?;
                        s.ended = true;
                    }
                }
            }
        }
    })
}

/// Whether `Accept-Encoding` accepts gzip (a `gzip` or `x-gzip` coding whose `q` is not
/// 0; `*` counts too).
pub fn accepts_gzip(h: &HeaderMap) -> bool {
    h.get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut it = item.split(';');
            let coding = it.next().unwrap_or("").trim().to_ascii_lowercase();
            let q_zero = it.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            matches!(coding.as_str(), "gzip" | "x-gzip" | "*") && !q_zero
        })
}

/// Whether gzip is worth its CPU for `data`: false under [`MIN_GZIP_BYTES`] (the gzip
/// framing eats what it saves) and when a sample (the first [`SAMPLE_BYTES`]) looks
/// incompressible — an order-0 entropy of at least
/// [`INCOMPRESSIBLE_BITS`] bits per byte, what random, encrypted and already compressed
/// data (zip, png, jpeg, gz) have. Costs one pass over the sample (~20 µs), where
/// deflating 1 MiB of random bytes costs ~10 ms on each side for nothing.
pub fn compressible(data: &[u8]) -> bool {
    if data.len() < MIN_GZIP_BYTES {
        return false;
    }
    let sample = &data[..data.len().min(SAMPLE_BYTES)];
    let mut counts = [0u32; 256];
    for b in sample {
        counts[*b as usize] += 1;
    }
    let n = sample.len() as f64;
    let bits: f64 = counts
        .iter()
        .filter(|c| **c > 0)
        .map(|c| {
            let p = f64::from(*c) / n;
            -p * p.log2()
        })
        .sum();
    bits < INCOMPRESSIBLE_BITS
}

/// Smallest download [`compressible`] gzips.
pub const MIN_GZIP_BYTES: usize = 1024;
/// Bytes of a download [`compressible`] samples.
pub const SAMPLE_BYTES: usize = 64 * 1024;
/// Order-0 entropy (bits per byte) from which [`compressible`] says no.
pub const INCOMPRESSIBLE_BITS: f64 = 7.5;
/// Input bytes the streamed gzip of a download compresses per chunk it sends.
const GZIP_CHUNK: usize = 256 * 1024;

/// A body of `data` gzip-compressed as it is sent (fast level: downloads are bound by the
/// network, not size): a blocking task deflates [`GZIP_CHUNK`] bytes at a time into a
/// channel of 2 chunks, so besides `data` (whose budget share `permit` stays with the body
/// until the last chunk was taken) at most ~3 compressed chunks are in memory. A client
/// that goes away stops the task at its next chunk.
fn gzip_body(data: Vec<u8>, permit: tokio::sync::OwnedSemaphorePermit) -> axum::body::Body {
    use std::io::Write;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(2);
    tokio::task::spawn_blocking(move || {
        let mut enc = flate2::write::GzEncoder::new(
            Vec::with_capacity(GZIP_CHUNK / 2),
            flate2::Compression::fast(),
        );
        for chunk in data.chunks(GZIP_CHUNK) {
            enc.write_all(chunk)
                .expect("writing into a Vec cannot fail");
            let out = std::mem::take(enc.get_mut());
            if !out.is_empty() && tx.blocking_send(Bytes::from(out)).is_err() {
                return;
            }
        }
        let out = enc.finish().expect("writing into a Vec cannot fail");
        let _ = tx.blocking_send(Bytes::from(out));
    });
    let stream = futures::stream::unfold((rx, permit), |(mut rx, permit)| async move {
        let c = rx.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(c), (rx, permit)))
    });
    axum::body::Body::from_stream(stream)
}

/// `data` gzip-compressed in one piece (fast level).
pub fn gzip(data: &[u8]) -> Bytes {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(
        Vec::with_capacity(data.len() / 2 + 64),
        flate2::Compression::fast(),
    );
    enc.write_all(data).expect("writing into a Vec cannot fail");
    Bytes::from(enc.finish().expect("writing into a Vec cannot fail"))
}

/// Files larger than this (1 MiB) are downloaded streamed, as they are read, never
/// gzipped; smaller ones are read whole and may be gzipped.
pub const STREAM_DOWNLOAD_ABOVE: u64 = 1 << 20;

/// `GET /files?path=P[&username=U]` → the file's bytes (`application/octet-stream`). A
/// file over [`STREAM_DOWNLOAD_ABOVE`] is streamed as the node reads it (chunked, identity,
/// [`crate::budget::STREAM_SHARE`] of the file budget held; an error after the first byte
/// aborts the answer). A smaller one is sent
/// in chunks while the file's budget share is held (`files::held_body`); gzip-
/// compressed as it is sent (`gzip_body`, chunked, no `Content-Length`) when the client
/// accepts gzip ([`accepts_gzip`]) and the data is [`compressible`] — else as it is, with
/// its `Content-Length` (HTTP lets a server answer identity whatever `Accept-Encoding`
/// says; httpx, under the `e2b` SDK, accepts gzip on every request).
pub async fn download(State(st): State<SharedState>, req: Request) -> Response {
    let (req, _) = req.into_parts();
    let r = async {
        let ctx = files_ctx(&st, &req).await?;
        let path = ctx
            .q
            .path
            .as_deref()
            .ok_or_else(|| ServerError::invalid("missing query parameter `path`"))?;
        let path = resolve_files(path, &ctx.home)?;
        let max = st.cfg.max_file_bytes as u64;
        if st.node.file_size(&ctx.id, &path).await? > STREAM_DOWNLOAD_ABOVE {
            // Streamed as it is read (identity): no whole file in server memory.
            let data = st.budget_node.read_stream_held(&ctx.id, &path, max).await?;
            return Ok::<_, ServerError>(
                (
                    [
                        (header::CONTENT_TYPE, "application/octet-stream"),
                        (header::VARY, "Accept-Encoding"),
                    ],
                    axum::body::Body::from_stream(data),
                )
                    .into_response(),
            );
        }
        let (data, permit) = st.budget_node.read_file_held(&ctx.id, &path, max).await?;
        if accepts_gzip(&req.headers) && compressible(&data) {
            return Ok::<_, ServerError>(
                (
                    [
                        (header::CONTENT_TYPE, "application/octet-stream"),
                        (header::CONTENT_ENCODING, "gzip"),
                        (header::VARY, "Accept-Encoding"),
                    ],
                    gzip_body(data, permit),
                )
                    .into_response(),
            );
        }
        let len = data.len().to_string();
        Ok::<_, ServerError>(
            (
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
                    (header::CONTENT_LENGTH, len),
                    (header::VARY, "Accept-Encoding".to_owned()),
                ],
                crate::files::held_body(data, permit),
            )
                .into_response(),
        )
    };
    r.await.unwrap_or_else(files_error)
}

/// Bytes of multipart framing (boundaries, part headers) an upload may carry beyond
/// `max_file_bytes`.
pub const MULTIPART_FRAMING: usize = 64 * 1024;

/// `POST /files?path=P[&username=U]` (module docs) → `[{name, type, path}]`.
///
/// The body is streamed to the node as it arrives, no whole file in server memory: an
/// octet-stream body to `path`, a `multipart/form-data` body part by part
/// (`stream_multipart`; files of parts before a malformed or refused part stay written),
/// each at most `max_file_bytes` (413 `payload_too_large` past it, nothing left of that
/// file); [`crate::budget::STREAM_SHARE`] of the file budget is held. A gzip body
/// (`Content-Encoding: gzip`) is inflated on the way ([`gunzip_stream`]): the limits count
/// inflated bytes (a multipart body at most `max_file_bytes` + [`MULTIPART_FRAMING`] of
/// them in all), a gzip bomb is cut off at the limit (413, nothing left of the file it was
/// writing), data that is not gzip is 400 `invalid_argument`.
pub async fn upload(State(st): State<SharedState>, req: Request) -> Response {
    let (req, body) = req.into_parts();
    let r = async {
        let ctx = files_ctx(&st, &req).await?;
        let encoding = body_encoding(&req.headers)?;
        let ct = req
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let boundary = if ct.to_ascii_lowercase().starts_with("multipart/form-data") {
            Some(
                multer::parse_boundary(ct)
                    .map_err(|_| ServerError::invalid("multipart/form-data without a boundary"))?,
            )
        } else {
            if ctx.q.path.is_none() {
                return Err(ServerError::invalid(
                    "missing query parameter `path` for an octet-stream upload",
                ));
            }
            None
        };
        let limit = st.cfg.max_file_bytes;
        let len = req
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(limit as u64)
            .min(limit as u64 + 1);
        // Streamed to the node part by part, inflated on the way when gzip: a small
        // budget share, no whole file held.
        let (_share, _) = st
            .file_budget
            .reserve(len.min(crate::budget::STREAM_SHARE))
            .await?;
        crate::disk_reserve::check(&st)?;
        use futures::TryStreamExt;
        let failure = std::sync::Arc::new(GunzipFailure::default());
        let (declared, body): (Option<u64>, BodyStream) = match encoding {
            BodyEncoding::Identity => (
                crate::files::content_length(&req.headers),
                Box::pin(body.into_data_stream().err_into::<BoxError>()),
            ),
            // `Content-Length` counts gzip bytes, not the file's.
            BodyEncoding::Gzip => {
                let most = if boundary.is_some() {
                    limit as u64 + MULTIPART_FRAMING as u64
                } else {
                    limit as u64 + 1
                };
                (
                    None,
                    Box::pin(
                        gunzip_stream(body.into_data_stream(), most, failure.clone())
                            .err_into::<BoxError>(),
                    ),
                )
            }
        };
        let out = match boundary {
            None => {
                let p = ctx.q.path.as_deref().unwrap_or_default();
                let path = resolve_files(p, &ctx.home)?;
                crate::files::stream_upload(&st, &ctx.id, &path, declared, body, limit as u64)
                    .await
                    .map(|_| vec![written_entry(&path)])
            }
            // multer stops at the closing boundary: a gzip body is then read to its end
            // (bounded by `most` inflated bytes) so that its trailer (CRC-32, length) is
            // checked, as for a plain upload.
            Some(b) => {
                let shared = std::sync::Arc::new(std::sync::Mutex::new(body));
                let r =
                    stream_multipart(&st, &ctx, SharedBody(shared.clone()), b, limit as u64).await;
                match (r, std::sync::Arc::try_unwrap(shared)) {
                    (Ok(v), Ok(rest)) if encoding == BodyEncoding::Gzip => {
                        let mut rest = rest.into_inner().unwrap_or_else(|e| e.into_inner());
                        let mut end = Ok(v);
                        while let Some(chunk) = futures::StreamExt::next(&mut rest).await {
                            if let Err(e) = chunk {
                                end = Err(ServerError::invalid(format!("reading the upload: {e}")));
                                break;
                            }
                        }
                        end
                    }
                    (r, _) => r,
                }
            }
        };
        let out = out.map_err(|e| failure.take().unwrap_or(e))?;
        Ok::<_, ServerError>(axum::Json(out).into_response())
    };
    r.await.unwrap_or_else(files_error)
}

/// An error of an upload body's stream.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An upload body as a stream of chunks (identity, or inflated by [`gunzip_stream`]).
type BodyStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<Bytes, BoxError>> + Send>>;

/// An upload body shared between its reader (multer, which needs a `'static` stream and
/// stops at the closing boundary) and the handler, which reads the rest afterwards.
struct SharedBody(std::sync::Arc<std::sync::Mutex<BodyStream>>);

impl futures::Stream for SharedBody {
    type Item = Result<Bytes, BoxError>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let mut body = self.0.lock().unwrap_or_else(|e| e.into_inner());
        body.as_mut().poll_next(cx)
    }
}

/// The answer entry `{name, type: "file", path}` of a file written at `path`.
fn written_entry(path: &str) -> serde_json::Value {
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    serde_json::json!({"name": name, "type": "file", "path": path})
}

/// Streams each part of a `multipart/form-data` body to its file as the part arrives
/// (`crate::files::stream_upload`: at most `limit` bytes per part, 413 over it). The first
/// part goes to `path` when the query has one, else to its filename; every later part to
/// its filename (or `path` when it has none). Files of the parts before a failing part
/// stay written; the failing part leaves nothing.
///
/// # Errors
/// `invalid_argument` (malformed body, a part with neither filename nor `path`, no part at
/// all); `payload_too_large`; the node's.
async fn stream_multipart<S, E>(
    st: &SharedState,
    ctx: &FilesCtx,
    body: S,
    boundary: String,
    limit: u64,
) -> Result<Vec<serde_json::Value>, ServerError>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    let err = |e: multer::Error| match e {
        multer::Error::StreamReadFailed(e) => {
            ServerError::invalid(format!("reading the upload: {e}"))
        }
        e => ServerError::invalid(format!("malformed multipart body: {e}")),
    };
    let mut mp = multer::Multipart::new(body, boundary);
    let mut out = Vec::new();
    while let Some(field) = mp.next_field().await.map_err(err)? {
        let name = field
            .file_name()
            .filter(|f| !f.is_empty())
            .map(str::to_owned);
        let p = match (&ctx.q.path, name) {
            (Some(p), _) if out.is_empty() => p.clone(),
            (_, Some(f)) => f,
            (Some(p), None) => p.clone(),
            (None, None) => {
                return Err(ServerError::invalid(
                    "a multipart part has no filename and there is no `path`",
                ))
            }
        };
        let path = resolve_files(&p, &ctx.home)?;
        crate::files::stream_upload(st, &ctx.id, &path, None, field, limit).await?;
        out.push(written_entry(&path));
    }
    if out.is_empty() {
        return Err(ServerError::invalid("the upload has no file"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_home() {
        assert_eq!(resolve("a/b", "/home/user").unwrap(), "/home/user/a/b");
        assert_eq!(resolve("~", "/root").unwrap(), "/root");
        assert_eq!(resolve("~/x", "/root").unwrap(), "/root/x");
        assert_eq!(resolve("/etc", "/root").unwrap(), "/etc");
        assert!(resolve("", "/root").is_err());
        assert_eq!(parent("/a/b/c"), Some("/a/b"));
        assert_eq!(parent("/a"), None);
    }

    /// `gz` through [`gunzip_stream`] in chunks of `chunk` bytes: the inflated bytes (or
    /// the stream's error), what `failure` says, and the largest chunk it yielded.
    async fn gunzip_all(
        gz: Vec<u8>,
        chunk: usize,
        limit: u64,
    ) -> (std::io::Result<Vec<u8>>, Option<ServerError>, usize) {
        use futures::StreamExt;
        let chunks: Vec<Result<Bytes, std::convert::Infallible>> = gz
            .chunks(chunk)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let failure = std::sync::Arc::new(GunzipFailure::default());
        let mut s = Box::pin(gunzip_stream(
            futures::stream::iter(chunks),
            limit,
            failure.clone(),
        ));
        let (mut out, mut largest) = (Vec::new(), 0);
        while let Some(c) = s.next().await {
            match c {
                Ok(c) => {
                    largest = largest.max(c.len());
                    out.extend_from_slice(&c);
                }
                Err(e) => return (Err(e), failure.take(), largest),
            }
        }
        (Ok(out), failure.take(), largest)
    }

    #[tokio::test]
    async fn gzip_both_ways_and_bombs_are_bounded() {
        let data = b"hello gzip ".repeat(1000);
        let gz = gzip(&data).to_vec();
        assert!(gz.len() < data.len() / 10);
        for chunk in [1, 7, 1 << 20] {
            let (out, failure, _) = gunzip_all(gz.clone(), chunk, data.len() as u64).await;
            assert_eq!(out.unwrap(), data, "chunks of {chunk}");
            assert!(failure.is_none());
        }
        let (out, failure, _) = gunzip_all(gz.clone(), 100, data.len() as u64 - 1).await;
        assert!(out.is_err());
        assert_eq!(
            failure.unwrap().api_error().code,
            ErrorCode::PayloadTooLarge
        );
        let two = [gz.clone(), gzip(b"!").to_vec()].concat();
        let (out, _, _) = gunzip_all(two, 5, 1 << 20).await;
        assert_eq!(out.unwrap().len(), data.len() + 1);
        // Not gzip, cut short, empty: 400 with what was wrong.
        for bad in [
            b"not gzip".to_vec(),
            gz[..gz.len() - 5].to_vec(),
            Vec::new(),
        ] {
            let (out, failure, _) = gunzip_all(bad.clone(), 3, 1 << 20).await;
            assert!(out.is_err(), "{bad:?}");
            let e = failure.unwrap().api_error();
            assert_eq!(e.code, ErrorCode::InvalidArgument);
            assert!(e.message.contains("not gzip data"), "{}", e.message);
        }
        // A bomb: 512 MiB of zeros in ~500 KiB of gzip, fed in 64 KiB chunks, stops at a
        // 4 MiB limit having yielded chunks of at most ~100 KiB.
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..512 {
            std::io::Write::write_all(&mut enc, &zeros).unwrap();
        }
        let bomb = enc.finish().unwrap();
        assert!(bomb.len() < 1 << 20, "{}", bomb.len());
        let (out, failure, largest) = gunzip_all(bomb, 64 << 10, 4 << 20).await;
        assert!(out.is_err());
        assert_eq!(
            failure.unwrap().api_error().code,
            ErrorCode::PayloadTooLarge
        );
        assert!(largest <= GUNZIP_CHUNK + (32 << 10), "{largest}");
        let mut h = HeaderMap::new();
        assert!(!accepts_gzip(&h));
        for (v, want) in [
            ("gzip", true),
            ("br, gzip;q=0.5", true),
            ("gzip;q=0, identity", false),
            ("identity", false),
            ("*", true),
        ] {
            h.insert(header::ACCEPT_ENCODING, v.parse().unwrap());
            assert_eq!(accepts_gzip(&h), want, "{v}");
        }
        h.insert(header::CONTENT_ENCODING, "x-gzip".parse().unwrap());
        assert_eq!(body_encoding(&h).unwrap(), BodyEncoding::Gzip);
        h.insert(header::CONTENT_ENCODING, "br".parse().unwrap());
        assert!(body_encoding(&h).is_err());
    }

    #[test]
    fn permission_strings() {
        assert_eq!(permissions(FileType::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileType::Dir, 0o755), "drwxr-xr-x");
    }

    #[test]
    fn incompressible_downloads_are_not_gzipped() {
        let text = b"hello gzip, hello world ".repeat(1000);
        assert!(compressible(&text));
        assert!(!compressible(&text[..MIN_GZIP_BYTES - 1]));
        // Pseudo-random bytes (xorshift): what random, encrypted and compressed data look like.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let random: Vec<u8> = (0..1 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        assert!(!compressible(&random));
    }
}
