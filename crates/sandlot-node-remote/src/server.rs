//! The node side: [`router`] (every `Node` call as an HTTP route) and [`serve`] (h2c and
//! HTTP/1.1 on one listener).
use crate::wire::{
    line, BulkCall, ControlFrame, ExecCall, ExecFrame, ForkCall, LineBuf, MkdirCall, ReadoptCall,
    VolatileFiles,
};
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bytes::Bytes;
use futures::StreamExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandlot_api::ExecEvent;
use sandlot_node_api::{ExecControl, Node, NodeError, SandboxSpec, WireError};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::sync::mpsc;

/// Largest request body the node accepts (1 GiB): a whole file of `write_file`.
pub const MAX_BODY_BYTES: usize = 1 << 30;

/// Concurrent calls (HTTP/2 streams) one connection may carry (10,000: a server sends all
/// its calls to a node over one connection; hyper's default of 200 would queue the rest).
pub const MAX_STREAMS: u32 = 10_000;

/// Connections a node serves at once (4,096; a server needs one, reconnects add a few):
/// a new connection over the limit is closed at once, so idle or hostile connections
/// cannot take the file descriptors the node's sandboxes need.
pub const MAX_CONNECTIONS: usize = 4096;

/// Time a new connection has to make its first authenticated call (10 s; a call that
/// passes the token check, or any call when the router has no token); a connection that
/// has not is closed, so connections that send nothing, half a request or only calls
/// with a wrong token do not stay open.
pub const AUTH_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Pause after an `accept` that failed for want of resources (out of file descriptors,
/// memory or buffers) or because the peer went away first, before accepting again.
const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);

/// Set in a request's extensions by [`serve`]: the request's connection made an
/// authenticated call (set by the router's token check, see [`AUTH_DEADLINE`]).
#[derive(Clone)]
struct ConnAuthed(Arc<std::sync::atomic::AtomicBool>);

impl ConnAuthed {
    fn mark(req: &Request) {
        if let Some(c) = req.extensions().get::<ConnAuthed>() {
            c.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

type Shared = Arc<dyn Node>;

/// HTTP status of a node error on the wire: `not_found` 404, `invalid_argument` 400,
/// `permission_denied` 403, `conflict` 409, `resource_exhausted` 429, `unavailable` 503,
/// `deadline_exceeded` 504, `transport` 502, `internal` 500. The body's `kind` is what the
/// client reads; the status is for people and proxies.
pub fn status_of(e: &NodeError) -> StatusCode {
    match e {
        NodeError::NotFound(_) => StatusCode::NOT_FOUND,
        NodeError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
        NodeError::PermissionDenied(_) => StatusCode::FORBIDDEN,
        NodeError::Conflict(_) => StatusCode::CONFLICT,
        NodeError::ResourceExhausted(_) => StatusCode::TOO_MANY_REQUESTS,
        NodeError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        NodeError::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
        NodeError::Transport(_) => StatusCode::BAD_GATEWAY,
        NodeError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        NodeError::CleanupFailed { error, .. } => status_of(error),
    }
}

struct Failed(NodeError);

impl From<NodeError> for Failed {
    fn from(e: NodeError) -> Self {
        Failed(e)
    }
}

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        (status_of(&self.0), Json(self.0.to_wire())).into_response()
    }
}

type Answer<T> = Result<Json<T>, Failed>;

/// A request's JSON body or query string that does not parse (or a body over the limit, or
/// the wrong content type) answers like every other node error: a
/// [`sandlot_node_api::WireError`] of kind `invalid_argument` with axum's message, under the
/// rejection's own status (400, 413 or 415), so a client always gets a stable code.
fn rejected(status: StatusCode, message: String) -> Response {
    (status, Json(NodeError::InvalidArgument(message).to_wire())).into_response()
}

/// [`Json`] as an argument whose rejection is a wire error ([`rejected`]).
struct JsonArg<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for JsonArg<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(JsonArg(v)),
            Err(r) => Err(rejected(r.status(), r.body_text())),
        }
    }
}

/// [`Query`] as an argument whose rejection is a wire error ([`rejected`]).
struct QueryArg<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequestParts<S>
    for QueryArg<T>
{
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Response> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(QueryArg(v)),
            Err(r) => Err(rejected(r.status(), r.body_text())),
        }
    }
}

fn empty() -> Json<serde_json::Value> {
    Json(serde_json::json!({}))
}

/// Every [`Node`] call of `node` as an HTTP route (the table in the crate docs).
///
/// `token`: when set, every request must carry `Authorization: Bearer <token>` (SHA-256
/// digests compared in constant time); others get `401` with a `permission_denied`
/// [`sandlot_node_api::WireError`]. `None` serves without authentication (tests, a node
/// reachable only by its server).
pub fn router(node: Arc<dyn Node>, token: Option<String>) -> Router {
    router_gated(node, token, None)
}

/// Whether a node may serve calls now: the cluster-mode fence of `sandlot node --etcd`
/// (its etcd lease is certainly alive), behind a small trait so this crate needs no etcd.
pub trait ServingGate: Send + Sync + 'static {
    /// `Ok(())` while the node may serve; `Err(why)` while it must refuse every call (the
    /// text goes into the `unavailable` error's message).
    fn check(&self) -> Result<(), String>;
    /// What `GET /v1/health` answers besides `serving` (e.g. the lease id and epoch), a
    /// JSON object.
    fn status(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// [`router`] with an optional [`ServingGate`], and `GET /v1/health`.
///
/// Every request first passes the token check (401 without it), then the gate: while
/// [`ServingGate::check`] fails, every route answers `503` with a
/// [`sandlot_node_api::WireError`] of kind `unavailable` (`RemoteNode` returns
/// `NodeError::Unavailable`); nothing reaches the node. The gate is checked when a call
/// arrives: a call (an exec stream) admitted before the gate closed runs to its end.
///
/// `GET /v1/health` answers `{"serving": true|false, ...ServingGate::status}`, status 200
/// while serving and 503 while not (always 200 `{"serving": true}` without a gate).
pub fn router_gated(
    node: Arc<dyn Node>,
    token: Option<String>,
    gate: Option<Arc<dyn ServingGate>>,
) -> Router {
    let health_gate = gate.clone();
    let health = get(move || {
        let gate = health_gate.clone();
        async move {
            let mut body = gate.as_ref().map(|g| g.status()).unwrap_or_default();
            let serving = gate.as_ref().is_none_or(|g| g.check().is_ok());
            body.insert("serving".into(), serving.into());
            let status = if serving {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, Json(serde_json::Value::Object(body)))
        }
    });
    // Compared as SHA-256 digests: equal lengths, so the time does not depend on the
    // token's length either.
    let token: Arc<Option<[u8; 32]>> = Arc::new(token.map(|t| Sha256::digest(t).into()));
    Router::new()
        .route("/v1/info", get(info))
        .route("/v1/accel", get(accel))
        .route("/v1/readopt", post(readopt))
        .route("/v1/pause", post(pause_many))
        .route("/v1/resume", post(resume_many))
        .route("/v1/checkpoints", get(list_checkpoints))
        .route("/v1/checkpoints/{ck}", delete(delete_checkpoint))
        .route("/v1/sandboxes", get(list).post(create))
        .route(
            "/v1/sandboxes/from-checkpoint",
            post(create_from_checkpoint),
        )
        .route("/v1/sandboxes/{id}", delete(delete_sandbox))
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/sandboxes/{id}/adopt-snapshot", post(adopt_snapshot))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/exec-controlled", post(exec_controlled))
        .route("/v1/sandboxes/{id}/ports/{port}", post(connect_port))
        .route("/v1/sandboxes/{id}/checkpoints/{ck}", post(checkpoint))
        .route(
            "/v1/sandboxes/{id}/files/content",
            get(read_file).put(write_file),
        )
        .route("/v1/sandboxes/{id}/files/volatile", post(write_volatile))
        .route("/v1/sandboxes/{id}/files/size", get(file_size))
        .route("/v1/sandboxes/{id}/files/stat", get(stat_file))
        .route("/v1/sandboxes/{id}/files/list", get(list_dir))
        .route("/v1/sandboxes/{id}/files/mkdir", post(make_dir))
        .route("/v1/sandboxes/{id}/files", delete(remove_file))
        .route(
            "/v1/sandboxes/{id}/processes",
            get(process_list).post(process_spawn),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}",
            get(process_get).delete(process_remove),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/output",
            get(process_output),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/wait",
            post(process_wait),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/signal",
            post(process_signal),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/stdin",
            post(process_stdin),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/resize",
            post(process_resize),
        )
        .layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let gate = gate.clone();
                async move {
                    if let Some(Err(why)) = gate.as_ref().map(|g| g.check()) {
                        let e = NodeError::Unavailable(why);
                        return (status_of(&e), Json(e.to_wire())).into_response();
                    }
                    next.run(req).await
                }
            },
        ))
        .route("/v1/health", health)
        .layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let token = token.clone();
                async move {
                    if let Some(want) = token.as_ref() {
                        let got = req
                            .headers()
                            .get(header::AUTHORIZATION)
                            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
                            .unwrap_or_default();
                        let got: [u8; 32] = Sha256::digest(got).into();
                        if !bool::from(got.ct_eq(want)) {
                            let e = NodeError::PermissionDenied(
                                "missing or wrong node API token".into(),
                            );
                            return (StatusCode::UNAUTHORIZED, Json(e.to_wire())).into_response();
                        }
                    }
                    ConnAuthed::mark(&req);
                    next.run(req).await
                }
            },
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(node)
}

/// Serve `app` on `listener` until this future is dropped (which also drops every open
/// connection) or accepting fails for good. Each connection speaks HTTP/1.1 or, on seeing
/// the HTTP/2 preface, h2c (hyper-util's auto builder), with [`MAX_STREAMS`] calls at once
/// and a PING every 20 s (a client that does not answer one within 20 s is disconnected;
/// its execs run on).
///
/// Hostile clients (the port is reachable before the token is checked): at most
/// [`MAX_CONNECTIONS`] connections at once (a new one over it is closed at once); a
/// connection that has made no authenticated call within [`AUTH_DEADLINE`] is closed (an
/// HTTP/1.1 request head must also arrive within it); an `accept` that fails for want of
/// file descriptors, memory or buffers, or because the peer already left, is retried after
/// 100 ms instead of ending the node.
///
/// # Errors
/// The listener's `accept` error, other than those retried.
pub async fn serve(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    serve_with(listener, app, None).await
}

/// [`serve`] over TLS (1.2: native-tls's server side turns 1.3 off): every connection
/// first completes a TLS handshake with `tls` (see [`tls_acceptor`]), then speaks HTTP/1.1 or HTTP/2 inside it as [`serve`]'s do (the
/// client sends the HTTP/2 preface: no ALPN is needed). The handshake counts toward the
/// connection's [`AUTH_DEADLINE`]; a failed one closes the connection (logged at debug).
///
/// # Errors
/// As [`serve`].
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: tokio_native_tls::TlsAcceptor,
) -> std::io::Result<()> {
    serve_with(listener, app, Some(Arc::new(tls))).await
}

/// The TLS side of [`serve_tls`] from the node's certificate chain `cert_pem` (PEM, the
/// node's certificate first, then any intermediates) and its private key `key_pem` (PEM,
/// PKCS#8: `-----BEGIN PRIVATE KEY-----`; an RSA or EC key in another form converts with
/// `openssl pkcs8 -topk8 -nocrypt`). The TLS library is the host's OpenSSL (native-tls),
/// as for image pulls.
///
/// # Errors
/// A message naming what did not parse or match (no PEM certificate or key, the key not
/// PKCS#8 or encrypted, a key that is not the first certificate's). A certificate not
/// valid now is only logged (a warning).
pub fn tls_acceptor(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<tokio_native_tls::TlsAcceptor, String> {
    use tokio_native_tls::native_tls;
    // native-tls does not check that the key is the certificate's (every handshake would
    // fail instead): checked here with OpenSSL, its library on Linux.
    let cert = openssl::x509::X509::from_pem(cert_pem)
        .map_err(|e| format!("node TLS certificate (PEM): {e}"))?;
    if key_pem
        .windows(b"ENCRYPTED".len())
        .any(|w| w == b"ENCRYPTED")
    {
        return Err("node TLS key is encrypted, which is not supported: decrypt it (`openssl pkey -in KEY -out PLAIN.key`) and keep it readable by root only".into());
    }
    // A callback that gives no passphrase: OpenSSL's default would prompt on a terminal.
    let key = openssl::pkey::PKey::private_key_from_pem_callback(key_pem, |_| Ok(0))
        .map_err(|e| format!("node TLS key (PEM): {e}"))?;
    let now = openssl::asn1::Asn1Time::days_from_now(0)
        .map_err(|e| format!("node TLS: the clock: {e}"))?;
    if cert.not_after() < now || cert.not_before() > now {
        tracing::warn!(not_before = %cert.not_before(), not_after = %cert.not_after(), "node TLS certificate is not valid now: servers will refuse it");
    }
    let public = cert
        .public_key()
        .map_err(|e| format!("node TLS certificate's public key: {e}"))?;
    if !public.public_eq(&key) {
        return Err(
            "node TLS key is not the certificate's key (the first certificate of the chain)".into(),
        );
    }
    let id = native_tls::Identity::from_pkcs8(cert_pem, key_pem).map_err(|e| {
        format!("node TLS certificate and key (PEM certificate chain, PKCS#8 PEM key; `openssl pkcs8 -topk8 -nocrypt` converts others): {e}")
    })?;
    let acceptor = native_tls::TlsAcceptor::builder(id)
        .min_protocol_version(Some(native_tls::Protocol::Tlsv12))
        .build()
        .map_err(|e| format!("node TLS set-up: {e}"))?;
    Ok(acceptor.into())
}

async fn serve_with(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: Option<Arc<tokio_native_tls::TlsAcceptor>>,
) -> std::io::Result<()> {
    let mut conns = tokio::task::JoinSet::new();
    let mut refused: u64 = 0;
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) if accept_error_is_transient(&e) => {
                    tracing::warn!(error = %e, open = conns.len(), "node API accept failed; retrying in 100 ms");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
                Err(e) => return Err(e),
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        if conns.len() >= MAX_CONNECTIONS {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(%peer, refused, limit = MAX_CONNECTIONS, "node API connection limit reached; new connections are closed");
            }
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let deadline = tokio::time::Instant::now() + AUTH_DEADLINE;
        match tls.clone() {
            None => conns.spawn(serve_conn(stream, peer, app, deadline)),
            Some(tls) => conns.spawn(async move {
                match tokio::time::timeout_at(deadline, tls.accept(stream)).await {
                    Ok(Ok(s)) => serve_conn(s, peer, app, deadline).await,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "node API TLS handshake failed")
                    }
                    Err(_) => tracing::debug!(%peer, "node API TLS handshake not done in time"),
                }
            }),
        };
    }
}

/// One connection of [`serve_with`]: closed at `deadline` unless it made an authenticated
/// call by then.
async fn serve_conn<S>(
    stream: S,
    peer: std::net::SocketAddr,
    app: Router,
    deadline: tokio::time::Instant,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let authed = ConnAuthed(Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let seen = authed.0.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        use tower::ServiceExt;
        let mut req = req.map(Body::new);
        req.extensions_mut().insert(authed.clone());
        app.clone().oneshot(req)
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(AUTH_DEADLINE);
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .max_concurrent_streams(Some(MAX_STREAMS))
        .keep_alive_interval(Some(std::time::Duration::from_secs(20)))
        .keep_alive_timeout(std::time::Duration::from_secs(20));
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let ended = match tokio::time::timeout_at(deadline, conn.as_mut()).await {
        Ok(r) => r,
        Err(_) if seen.load(std::sync::atomic::Ordering::Relaxed) => conn.await,
        Err(_) => {
            tracing::debug!(%peer, "node API connection closed: no authenticated call in time");
            return;
        }
    };
    if let Err(e) = ended {
        tracing::debug!(%peer, error = %e, "node API connection ended with an error");
    }
}

/// Whether a failed `accept` concerns one connection or a passing shortage (the listener
/// still works): out of file descriptors (`EMFILE`, `ENFILE`), memory or buffers, or a
/// peer that left before it was accepted.
fn accept_error_is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::ConnectionAborted | K::ConnectionReset | K::Interrupted | K::OutOfMemory
    ) || matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::ECONNABORTED
                | libc::EPROTO
                | libc::EPERM
        )
    )
}

async fn info(State(n): State<Shared>) -> Json<sandlot_node_api::NodeInfo> {
    Json(n.info())
}

async fn accel(State(n): State<Shared>) -> Json<Option<String>> {
    Json(n.accel().await)
}

async fn readopt(State(n): State<Shared>, JsonArg(c): JsonArg<ReadoptCall>) -> Answer<Vec<String>> {
    Ok(Json(n.readopt(&c.keep).await?))
}

async fn list_checkpoints(State(n): State<Shared>) -> Answer<Vec<String>> {
    Ok(Json(n.list_checkpoints().await?))
}

async fn delete_checkpoint(
    State(n): State<Shared>,
    Path(ck): Path<String>,
) -> Answer<serde_json::Value> {
    n.delete_checkpoint(&ck).await?;
    Ok(empty())
}

/// `GET /v1/sandboxes[?liveness=not_alive]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQ {
    liveness: Option<LivenessFilter>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum LivenessFilter {
    NotAlive,
}

async fn list(
    State(n): State<Shared>,
    QueryArg(q): QueryArg<ListQ>,
) -> Answer<Vec<sandlot_node_api::SandboxStatus>> {
    Ok(Json(match q.liveness {
        Some(LivenessFilter::NotAlive) => n.list_not_alive().await?,
        None => n.list().await?,
    }))
}

async fn create(
    State(n): State<Shared>,
    JsonArg(spec): JsonArg<SandboxSpec>,
) -> Answer<serde_json::Value> {
    // Its own task: a create the caller gave up on still finishes (or rolls back) whole.
    tokio::spawn(async move { n.create(&spec).await })
        .await
        .map_err(joined)??;
    Ok(empty())
}

async fn create_from_checkpoint(
    State(n): State<Shared>,
    JsonArg(c): JsonArg<ForkCall>,
) -> Answer<serde_json::Value> {
    tokio::spawn(async move { n.create_from_checkpoint(&c.spec, &c.checkpoint_id).await })
        .await
        .map_err(joined)??;
    Ok(empty())
}

fn joined(e: tokio::task::JoinError) -> Failed {
    Failed(NodeError::io(
        "node API task",
        std::io::Error::other(e.to_string()),
    ))
}

async fn delete_sandbox(
    State(n): State<Shared>,
    Path(id): Path<String>,
) -> Answer<serde_json::Value> {
    tokio::spawn(async move { n.delete(&id).await })
        .await
        .map_err(joined)??;
    Ok(empty())
}

async fn pause(State(n): State<Shared>, Path(id): Path<String>) -> Answer<serde_json::Value> {
    n.pause(&id).await?;
    Ok(empty())
}

async fn resume(State(n): State<Shared>, Path(id): Path<String>) -> Answer<serde_json::Value> {
    n.resume(&id).await?;
    Ok(empty())
}

/// The ids of a bulk call, refused past [`sandlot_node_api::BULK_MAX_IDS`].
fn bulk_ids(c: BulkCall) -> Result<Vec<String>, Failed> {
    if c.ids.len() > sandlot_node_api::BULK_MAX_IDS {
        return Err(Failed(NodeError::InvalidArgument(format!(
            "{} ids in one call; at most {}",
            c.ids.len(),
            sandlot_node_api::BULK_MAX_IDS
        ))));
    }
    Ok(c.ids)
}

/// Per-id results of a bulk call on the wire: `null` for success, else the error.
fn bulk_answer(out: Vec<sandlot_node_api::NodeResult<()>>) -> Json<Vec<Option<WireError>>> {
    Json(
        out.into_iter()
            .map(|r| r.err().map(|e| e.to_wire()))
            .collect(),
    )
}

/// `POST /v1/pause` ([`BulkCall`]): `Node::pause_many` in a task of its own (a server that
/// goes away does not leave half the ids unpaused).
async fn pause_many(
    State(n): State<Shared>,
    JsonArg(c): JsonArg<BulkCall>,
) -> Answer<Vec<Option<WireError>>> {
    let ids = bulk_ids(c)?;
    let out = tokio::spawn(async move { n.pause_many(&ids).await })
        .await
        .map_err(joined)?;
    Ok(bulk_answer(out))
}

/// `POST /v1/resume` ([`BulkCall`]): `Node::resume_many`, as [`pause_many`].
async fn resume_many(
    State(n): State<Shared>,
    JsonArg(c): JsonArg<BulkCall>,
) -> Answer<Vec<Option<WireError>>> {
    let ids = bulk_ids(c)?;
    let out = tokio::spawn(async move { n.resume_many(&ids).await })
        .await
        .map_err(joined)?;
    Ok(bulk_answer(out))
}

async fn adopt_snapshot(
    State(n): State<Shared>,
    Path(id): Path<String>,
) -> Answer<serde_json::Value> {
    n.adopt_snapshot(&id).await?;
    Ok(empty())
}

async fn checkpoint(
    State(n): State<Shared>,
    Path((id, ck)): Path<(String, String)>,
) -> Answer<sandlot_node_api::CheckpointMeta> {
    let meta = tokio::spawn(async move { n.checkpoint(&id, &ck).await })
        .await
        .map_err(joined)??;
    Ok(Json(meta))
}

fn ndjson(rx: mpsc::Receiver<Bytes>) -> Response {
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response()
}

/// Runs `exec` (given the sink, when streaming) in its own task, forwarding events to
/// `out` as frames and ending with the result or error frame. A gone caller only makes the
/// sends fail; the exec itself continues (as the server's own exec does).
fn pump<F>(out: mpsc::Sender<Bytes>, stream: bool, exec: F)
where
    F: FnOnce(
            Option<mpsc::Sender<ExecEvent>>,
        ) -> futures::future::BoxFuture<
            'static,
            sandlot_node_api::NodeResult<sandlot_api::ExecResult>,
        > + Send
        + 'static,
{
    tokio::spawn(async move {
        let (ev_tx, mut ev_rx) = mpsc::channel::<ExecEvent>(64);
        let run = exec(stream.then_some(ev_tx));
        tokio::pin!(run);
        let result = loop {
            tokio::select! {
                biased;
                Some(ev) = ev_rx.recv() => { let _ = out.send(line(&ExecFrame::Event(ev))).await; }
                r = &mut run => break r,
            }
        };
        while let Ok(ev) = ev_rx.try_recv() {
            let _ = out.send(line(&ExecFrame::Event(ev))).await;
        }
        let last = match result {
            Ok(r) => ExecFrame::Result(r),
            Err(e) => ExecFrame::Error(e.to_wire()),
        };
        let _ = out.send(line(&last)).await;
    });
}

async fn exec(
    State(n): State<Shared>,
    Path(id): Path<String>,
    JsonArg(c): JsonArg<ExecCall>,
) -> Response {
    let (out_tx, out_rx) = mpsc::channel::<Bytes>(64);
    pump(out_tx, c.stream, move |sink| {
        Box::pin(async move { n.exec(&id, &c.request, sink).await })
    });
    ndjson(out_rx)
}

/// `POST /v1/sandboxes/{id}/ports/{port}`: [`Node::connect_port`] as one full-duplex
/// HTTP/2 stream. On success the answer is `200` with an `application/octet-stream` body
/// carrying what the sandbox's listener sends, and the request body's bytes go to it as
/// they arrive (its end half-closes the TCP connection); on failure the node error
/// (status of [`status_of`], [`sandlot_node_api::WireError`] body) before any byte.
async fn connect_port(
    State(n): State<Shared>,
    Path((id, port)): Path<(String, u16)>,
    body: Body,
) -> Result<Response, Failed> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let conn = n.connect_port(&id, port).await?;
    let (rd, mut wr) = tokio::io::split(conn);
    tokio::spawn(async move {
        let mut frames = body.into_data_stream();
        while let Some(Ok(chunk)) = frames.next().await {
            if wr.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let out = futures::stream::unfold(Some(rd), |st| async move {
        let mut rd = st?;
        let mut buf = vec![0u8; 64 * 1024];
        match rd.read(&mut buf).await {
            Ok(0) => None,
            Ok(k) => {
                buf.truncate(k);
                Some((Ok::<_, std::io::Error>(Bytes::from(buf)), Some(rd)))
            }
            Err(e) => Some((Err(e), None)),
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(out),
    )
        .into_response())
}

async fn exec_controlled(
    State(n): State<Shared>,
    Path(id): Path<String>,
    body: Body,
) -> Result<Response, Failed> {
    let bad = |m: String| Failed(NodeError::InvalidArgument(m));
    let mut frames = body.into_data_stream();
    let mut lines = LineBuf::default();
    let mut pending = std::collections::VecDeque::new();
    // The start frame first, before any answer.
    let start = loop {
        if let Some(l) = pending.pop_front() {
            break l;
        }
        match frames.next().await {
            Some(Ok(chunk)) => pending.extend(lines.push(&chunk).map_err(bad)?),
            Some(Err(e)) => return Err(bad(format!("request stream broke: {e}"))),
            None => return Err(bad("request stream ended before its start frame".into())),
        }
    };
    let start = match serde_json::from_slice::<ControlFrame>(&start) {
        Ok(ControlFrame::Start(s)) => s,
        Ok(_) => return Err(bad("the first frame must be start".into())),
        Err(e) => return Err(bad(format!("bad start frame: {e}"))),
    };
    let (stdin_tx, stdin_rx) = mpsc::channel::<Bytes>(16);
    let (sig_tx, sig_rx) = mpsc::unbounded_channel::<i32>();
    let control = ExecControl {
        stdin: start.stdin.then_some(stdin_rx),
        signals: sig_rx,
        handle: start.handle,
        labels: None,
    };
    // Reads the rest of the request stream into the control channels; it ends (closing
    // stdin and the signals) when the stream ends or breaks, or at a bad frame.
    let reader = tokio::spawn(async move {
        let mut stdin_tx = Some(stdin_tx);
        loop {
            while let Some(l) = pending.pop_front() {
                let frame = match serde_json::from_slice::<ControlFrame>(&l) {
                    Ok(f) => f,
                    Err(e) => {
                        tracing::info!(error = %e, "bad exec-controlled frame; control ends");
                        return;
                    }
                };
                match frame {
                    ControlFrame::Stdin(b) => {
                        let Ok(data) = B64.decode(b) else {
                            tracing::info!("stdin frame is not base64; control ends");
                            return;
                        };
                        if let Some(tx) = &stdin_tx {
                            // Bounded: a command that does not read its stdin stalls this
                            // reader and so, by HTTP/2 flow control, the caller.
                            let _ = tx.send(Bytes::from(data)).await;
                        }
                    }
                    ControlFrame::StdinEof => stdin_tx = None,
                    ControlFrame::Signal(s) => {
                        let _ = sig_tx.send(s);
                    }
                    ControlFrame::Start(_) => {
                        tracing::info!("a second start frame; control ends");
                        return;
                    }
                }
            }
            match frames.next().await {
                Some(Ok(chunk)) => match lines.push(&chunk) {
                    Ok(ls) => pending.extend(ls),
                    Err(e) => {
                        tracing::info!(error = %e, "exec-controlled frame too long; control ends");
                        return;
                    }
                },
                Some(Err(_)) | None => return,
            }
        }
    });
    let (out_tx, out_rx) = mpsc::channel::<Bytes>(64);
    let request = start.request;
    pump(out_tx, start.stream, move |sink| {
        Box::pin(async move {
            let r = n.exec_controlled(&id, &request, sink, control).await;
            reader.abort();
            r
        })
    });
    Ok(ndjson(out_rx))
}

#[derive(Deserialize)]
struct PathQ {
    path: String,
}

#[derive(Deserialize)]
struct ReadQ {
    path: String,
    max_bytes: u64,
}

/// `GET …/files/content?path=&max_bytes=`: the file streamed as it is read (errors before
/// the first byte are the wire error; a later one aborts the body, so the client sees a
/// broken answer, never a short file).
async fn read_file(
    State(n): State<Shared>,
    Path(id): Path<String>,
    QueryArg(q): QueryArg<ReadQ>,
) -> Result<Response, Failed> {
    let data = n.read_file_stream(&id, &q.path, q.max_bytes).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(data),
    )
        .into_response())
}

#[derive(Deserialize)]
struct WriteQ {
    path: String,
    /// Limit of the upload (absent from older servers: unlimited here, theirs applies).
    #[serde(default)]
    max_bytes: Option<u64>,
}

/// `PUT …/files/content?path=&max_bytes=`: the body streamed into the node's
/// [`Node::write_file_stream`] (no whole file in memory); a body that breaks off leaves
/// nothing written.
async fn write_file(
    State(n): State<Shared>,
    Path(id): Path<String>,
    QueryArg(q): QueryArg<WriteQ>,
    body: Body,
) -> Answer<serde_json::Value> {
    let stream = body
        .into_data_stream()
        .map(|r| r.map_err(std::io::Error::other));
    n.write_file_stream(
        &id,
        &q.path,
        Box::pin(stream),
        q.max_bytes.unwrap_or(u64::MAX),
    )
    .await?;
    Ok(empty())
}

async fn write_volatile(
    State(n): State<Shared>,
    Path(id): Path<String>,
    JsonArg(v): JsonArg<VolatileFiles>,
) -> Answer<serde_json::Value> {
    let mut files = Vec::with_capacity(v.files.len());
    for (p, b) in v.files {
        let data = B64.decode(b).map_err(|e| {
            Failed(NodeError::InvalidArgument(format!(
                "content of {p:?} is not base64: {e}"
            )))
        })?;
        files.push((p, Bytes::from(data)));
    }
    n.write_files_volatile(&id, files).await?;
    Ok(empty())
}

async fn file_size(
    State(n): State<Shared>,
    Path(id): Path<String>,
    QueryArg(q): QueryArg<PathQ>,
) -> Answer<u64> {
    Ok(Json(n.file_size(&id, &q.path).await?))
}

async fn stat_file(
    State(n): State<Shared>,
    Path(id): Path<String>,
    QueryArg(q): QueryArg<PathQ>,
) -> Answer<sandlot_api::FileEntry> {
    Ok(Json(n.stat_file(&id, &q.path).await?))
}

async fn list_dir(
    State(n): State<Shared>,
    Path(id): Path<String>,
    QueryArg(q): QueryArg<PathQ>,
) -> Answer<Vec<sandlot_api::FileEntry>> {
    Ok(Json(n.list_dir(&id, &q.path).await?))
}

async fn remove_file(
    State(n): State<Shared>,
    Path(id): Path<String>,
    QueryArg(q): QueryArg<PathQ>,
) -> Answer<serde_json::Value> {
    n.remove_file(&id, &q.path).await?;
    Ok(empty())
}

async fn make_dir(
    State(n): State<Shared>,
    Path(id): Path<String>,
    JsonArg(c): JsonArg<MkdirCall>,
) -> Answer<serde_json::Value> {
    n.make_dir(&id, &c.path, c.parents).await?;
    Ok(empty())
}

async fn process_spawn(
    State(n): State<Shared>,
    Path(id): Path<String>,
    JsonArg(req): JsonArg<sandlot_api::SpawnRequest>,
) -> Answer<sandlot_api::Process> {
    Ok(Json(n.process_spawn(&id, req).await?))
}

async fn process_list(
    State(n): State<Shared>,
    Path(id): Path<String>,
) -> Answer<Vec<sandlot_api::Process>> {
    Ok(Json(n.process_list(&id).await?))
}

async fn process_get(
    State(n): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
) -> Answer<sandlot_api::Process> {
    Ok(Json(n.process_get(&id, &pid).await?))
}

/// `GET …/processes/{pid}/output?stdout_offset=&stderr_offset=&follow=`: NDJSON
/// [`sandlot_api::ProcessEvent`] lines, streamed as the process writes (with `follow`);
/// an error before the first event is a [`sandlot_node_api::WireError`] answer.
async fn process_output(
    State(n): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    QueryArg(c): QueryArg<sandlot_node_api::OutputCursor>,
) -> Result<Response, Failed> {
    let events = n.process_output(&id, &pid, c).await?;
    let body = events.map(|ev| Ok::<_, std::convert::Infallible>(line(&ev)));
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response())
}

#[derive(Deserialize)]
struct WaitQ {
    /// Longest wait, milliseconds.
    timeout_ms: u64,
}

async fn process_wait(
    State(n): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    QueryArg(q): QueryArg<WaitQ>,
) -> Answer<sandlot_api::Process> {
    let t = std::time::Duration::from_millis(q.timeout_ms);
    Ok(Json(n.process_wait(&id, &pid, t).await?))
}

async fn process_signal(
    State(n): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    JsonArg(c): JsonArg<crate::wire::SignalCall>,
) -> Answer<serde_json::Value> {
    n.process_signal(&id, &pid, c.signal).await?;
    Ok(empty())
}

#[derive(Deserialize)]
struct StdinQ {
    #[serde(default)]
    eof: bool,
}

async fn process_stdin(
    State(n): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    QueryArg(q): QueryArg<StdinQ>,
    body: Bytes,
) -> Answer<serde_json::Value> {
    n.process_stdin(&id, &pid, body, q.eof).await?;
    Ok(empty())
}

async fn process_resize(
    State(n): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    JsonArg(size): JsonArg<sandlot_api::PtySize>,
) -> Answer<serde_json::Value> {
    n.process_resize(&id, &pid, size).await?;
    Ok(empty())
}

async fn process_remove(
    State(n): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
) -> Answer<serde_json::Value> {
    tokio::spawn(async move { n.process_remove(&id, &pid).await })
        .await
        .map_err(joined)??;
    Ok(empty())
}
