//! Ingress: HTTP (and WebSocket or any other `Upgrade`) traffic from outside to a port a
//! process listens on inside a sandbox, with no network, veth or policy given to the
//! sandbox: the node opens the TCP connection inside the sandbox's own network namespace
//! ([`sandlot_node_api::Node::connect_port`]) and this module speaks HTTP/1.1 over it.
//!
//! Two ways in, both on Sandlot's own listener:
//! - **Path**: `ANY /v1/sandboxes/{id}/ports/{port}/{path…}` (and `…/ports/{port}` for
//!   `/`) reaches `/{path…}?{query}` on `127.0.0.1:{port}` inside sandbox `{id}`.
//! - **Host name** (E2B's `sandbox.get_host(port)`, `<port>-<sandbox-id>.<domain>`): a
//!   request whose `Host` is such a name, for any port but envd's 49983 and the code
//!   interpreter's 49999 (which the E2B surface serves, [`crate::e2b`]), is rewritten to the path form before routing
//!   ([`rewrite`]), so every path of the app in the sandbox is reachable and the same
//!   authentication and tenant checks apply.
//!
//! **Credentials** as for every `/v1/sandboxes/{id}/…` route ([`crate::auth`]): a Sandlot
//! API key as `Authorization: Bearer`/`Basic`, or, on the host-name form, as
//! `X-Access-Token` or E2B's `e2b-traffic-access-token` header; another tenant's sandbox
//! answers 404 as an unknown one. The key headers Sandlot consumed are not forwarded to
//! the app (an `Authorization` is forwarded only when it did not carry a Sandlot key).
//!
//! **Errors** (Sandlot's `{"error": {"code", "message"}}`): unknown sandbox 404
//! `not_found`; paused or not running 409 `conflict`; nothing listening on the port (or
//! the app closed the connection without answering) **502** `unavailable`; an app that
//! sends no response head in time **504** `deadline_exceeded` (below); bad port 400.
//! Every backend reaches ports (microvm, vm and runsc through their guest agents).
//!
//! Forwarding: HTTP/1.1 to the app whatever the client spoke; hop-by-hop headers
//! (RFC 9110 §7.6.1) are dropped both ways, `Host` is kept as the client sent it, and
//! `X-Forwarded-Host`/`X-Forwarded-Proto` are added. One TCP connection into the sandbox
//! per request (no pooling). An `Upgrade` request answered `101` becomes a byte pipe
//! between the client and the app until either side closes.
//!
//! **Timeouts** ([`IngressLimits`]; `sandlot up --ingress-response-timeout-s`,
//! `--ingress-idle-timeout-s`), so an app that accepts and then never answers cannot hold
//! a connection into the sandbox (on microvm, vm and runsc one of the guest agent's 128
//! tunnel slots) and a server task forever:
//! - until the app's response head arrives, no byte may stay unmoved to or from the app
//!   for [`IngressLimits::response_timeout`] (default 60 s): counted from the last byte of
//!   the request the app took (a request body that flows keeps it alive; an app that stops
//!   reading it does not). Past it the client gets **504** `deadline_exceeded` and the
//!   connection into the sandbox is closed at once.
//! - after the head (a streamed response body) and on an upgraded (`101`, WebSocket)
//!   connection, a connection on which no byte moved either way for
//!   [`IngressLimits::idle_timeout`] (default 600 s) is closed (a cut body; for an upgraded
//!   pipe both sides see the close).
//! - a client that goes away (or a body dropped) closes the connection into the sandbox
//!   with it.
use crate::auth;
use crate::error::ServerError;
use crate::sandboxes::running;
use crate::SharedState;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use sandlot_api::ErrorCode;
use sandlot_node_api::{NodeError, PORT_NOT_LISTENING};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Timeouts of ingress connections (module docs, "Timeouts").
#[derive(Debug, Clone)]
pub struct IngressLimits {
    /// Longest time with no byte moved to or from the app before its response head
    /// arrives (default 60 s); past it 504 `deadline_exceeded`.
    pub response_timeout: Duration,
    /// Longest time with no byte moved either way on a connection whose response head
    /// arrived (a streamed body, an upgraded WebSocket pipe) (default 600 s); past it the
    /// connection is closed.
    pub idle_timeout: Duration,
}

impl Default for IngressLimits {
    fn default() -> Self {
        IngressLimits {
            response_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// When a byte last moved on one connection into a sandbox (shared by its [`Tracked`]
/// stream and the watchdogs).
#[derive(Debug)]
struct LastIo {
    start: Instant,
    /// Milliseconds after `start`.
    at_ms: AtomicU64,
}

impl LastIo {
    fn new() -> Arc<Self> {
        Arc::new(LastIo {
            start: Instant::now(),
            at_ms: AtomicU64::new(0),
        })
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.at_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.at_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }

    /// Resolves once no byte moved for `limit`.
    async fn quiet(&self, limit: Duration) {
        loop {
            let q = self.quiet_for();
            if q >= limit {
                return;
            }
            tokio::time::sleep(limit - q).await;
        }
    }
}

/// A stream that notes in [`LastIo`] every read or write that moved bytes.
struct Tracked<T> {
    inner: T,
    last: Arc<LastIo>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.last.touch();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.last.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Aborts the task driving a connection into a sandbox when dropped (which closes the
/// connection and frees its tunnel slot).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A response body that holds the connection into the sandbox open until it is dropped
/// (ended, or its client gone).
struct HoldConn {
    inner: Body,
    _conn: AbortOnDrop,
}

impl http_body::Body for HoldConn {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        http_body::Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::Body::size_hint(&self.inner)
    }
}

/// Headers of one hop only (RFC 9110 §7.6.1), never forwarded as they are.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Headers that carry Sandlot credentials on ingress (never forwarded to the app).
const KEY_HEADERS: [&str; 3] = ["x-access-token", "e2b-traffic-access-token", "x-api-key"];

/// `(port, sandbox id)` of an ingress host name `<port>-<sandbox-id>.<domain>[:port]`
/// (E2B's `get_host`), `None` for any other host and for envd's port 49983 and the code
/// interpreter's 49999 (both served by Sandlot itself, [`crate::e2b`]).
pub fn ingress_host(host: &str) -> Option<(u16, String)> {
    let name = host.split(':').next().unwrap_or("");
    let (first, rest) = name.split_once('.')?;
    if rest.is_empty() {
        return None;
    }
    let (port, id) = first.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    let id_ok =
        id.len() > 3 && id.starts_with("sb-") && id[3..].bytes().all(|b| b.is_ascii_alphanumeric());
    let served = port == crate::e2b::ENVD_PORT || port == crate::e2b::interpreter::JUPYTER_PORT;
    (port != 0 && !served && id_ok).then(|| (port, id.to_owned()))
}

/// Runs before routing: a request for an ingress host name ([`ingress_host`]) becomes a
/// request for `/v1/sandboxes/{id}/ports/{port}{path}` (query kept), and a key in
/// `X-Access-Token` / `e2b-traffic-access-token` becomes `Authorization: Bearer` when the
/// request has no `Authorization`. Every other request is left as it is.
pub fn rewrite(mut req: Request) -> Request {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let Some((port, id)) = host.as_deref().and_then(ingress_host) else {
        return req;
    };
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let pq = if pq.starts_with('/') {
        pq.to_owned()
    } else {
        format!("/{pq}")
    };
    let Ok(uri) = format!("/v1/sandboxes/{id}/ports/{port}{pq}").parse::<Uri>() else {
        return req;
    };
    *req.uri_mut() = uri;
    let h = req.headers_mut();
    if !h.contains_key(header::AUTHORIZATION) {
        let token = KEY_HEADERS[..2].iter().find_map(|n| {
            h.get(*n)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        });
        if let Some(v) = token.and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
            h.insert(header::AUTHORIZATION, v);
        }
    }
    req
}

/// Names listed in `Connection` (also hop-by-hop, RFC 9110 §7.6.1).
fn connection_listed(h: &HeaderMap) -> Vec<HeaderName> {
    h.get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

/// Drops hop-by-hop headers; with `upgrade`, keeps `Connection: upgrade` and `Upgrade`.
fn strip_hop_by_hop(h: &mut HeaderMap, upgrade: bool) {
    for n in connection_listed(h) {
        if !(upgrade && n == header::UPGRADE) {
            h.remove(n);
        }
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
    if upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        h.remove(header::UPGRADE);
    }
}

fn bad_gateway(message: String) -> Response {
    let mut r = ServerError::new(ErrorCode::Unavailable, message).into_response();
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r
}

/// `ANY /v1/sandboxes/{id}/ports/{port}[/{*path}]`: the request forwarded to the port
/// inside the sandbox, its answer streamed back (module docs for errors and headers).
pub async fn proxy(
    State(st): State<SharedState>,
    Path(params): Path<HashMap<String, String>>,
    mut req: Request,
) -> Response {
    let id = params.get("id").cloned().unwrap_or_default();
    let Some(port) = params
        .get("port")
        .and_then(|p| p.parse::<u16>().ok())
        .filter(|p| *p != 0)
    else {
        return ServerError::invalid(format!(
            "bad port {:?}: a number from 1 to 65535",
            params.get("port").map(String::as_str).unwrap_or("")
        ))
        .into_response();
    };
    let rec = match running(&st, &id).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let conn = match st.node.connect_port(&rec.id, port).await {
        Ok(c) => c,
        Err(NodeError::Unavailable(m)) if m.starts_with(PORT_NOT_LISTENING) => {
            return bad_gateway(m)
        }
        Err(e) => return ServerError::from(e).into_response(),
    };

    // The request as the app sees it: the path after `/ports/{port}` exactly as the client
    // sent it, still percent-encoded (the decoded `{*path}` would turn `%2F` into a
    // separator, `%3F` into a query and `%23` into a fragment), then the query.
    let path = req.uri().path().splitn(7, '/').nth(6).unwrap_or("");
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let uri: Uri = match format!("/{path}{query}").parse() {
        Ok(u) => u,
        Err(e) => return ServerError::invalid(format!("bad path: {e}")).into_response(),
    };
    let upgrade = req.headers().contains_key(header::UPGRADE)
        && connection_listed(req.headers()).contains(&header::UPGRADE);
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let sandlot_key =
        auth::presented_key(&parts.headers).filter(|k| k.starts_with(auth::KEY_PREFIX));
    let mut headers = std::mem::take(&mut parts.headers);
    strip_hop_by_hop(&mut headers, upgrade);
    for n in KEY_HEADERS {
        headers.remove(n);
    }
    if sandlot_key.is_some() {
        headers.remove(header::AUTHORIZATION);
    }
    if let Some(h) = headers.get(header::HOST).cloned() {
        headers.insert("x-forwarded-host", h);
    }
    headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    let mut out = axum::http::Request::new(body);
    *out.method_mut() = parts.method;
    *out.uri_mut() = uri;
    *out.headers_mut() = headers;

    let limits = st.cfg.ingress.clone();
    let last = LastIo::new();
    let conn = Tracked {
        inner: conn,
        last: last.clone(),
    };
    let (mut sender, connection) = match hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(conn))
        .await
    {
        Ok(x) => x,
        Err(e) => return bad_gateway(format!("port {port} of sandbox {id}: {e}")),
    };
    // The connection into the sandbox lives in this task; aborting it (`hold` dropped:
    // a timeout, the client gone, the body done) closes the connection.
    let idle = last.clone();
    let quiet_limit = limits.idle_timeout.max(limits.response_timeout);
    let task = tokio::spawn(async move {
        tokio::select! {
            r = connection.with_upgrades() => if let Err(e) = r {
                tracing::debug!(error = %e, "ingress connection ended with an error");
            },
            () = idle.quiet(quiet_limit) => {
                tracing::debug!("ingress connection idle; closed");
            }
        }
    });
    let hold = AbortOnDrop(task.abort_handle());
    let mut resp = tokio::select! {
        r = sender.send_request(out) => match r {
            Ok(r) => r,
            Err(e) => {
                return bad_gateway(format!(
                    "port {port} of sandbox {id} did not answer (HTTP/1.1): {e}"
                ))
            }
        },
        () = last.quiet(limits.response_timeout) => {
            drop(hold);
            return ServerError::new(
                ErrorCode::DeadlineExceeded,
                format!(
                    "port {port} of sandbox {id} sent no response head within {} s of \
                     the last byte it took (ingress response timeout); the connection \
                     was closed",
                    limits.response_timeout.as_secs_f64()
                ),
            )
            .into_response();
        }
    };
    let switched = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    strip_hop_by_hop(resp.headers_mut(), switched && upgrade);
    if switched {
        if let Some(client) = client_upgrade {
            let app = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                // Held until the pipe ends: the connection task hands its stream over
                // to `app` when the upgrade completes.
                let _hold = hold;
                let (client, app) = match tokio::try_join!(client, app) {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::debug!(error = %e, "ingress upgrade failed");
                        return;
                    }
                };
                let mut client = TokioIo::new(client);
                let mut app = TokioIo::new(app);
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut client, &mut app) => {}
                    () = last.quiet(limits.idle_timeout) => {
                        tracing::debug!("upgraded ingress connection idle; closed");
                    }
                }
            });
            return resp.map(Body::new);
        }
    }
    resp.map(|b| {
        Body::new(HoldConn {
            inner: Body::new(b),
            _conn: hold,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingress_hosts_are_port_dash_sandbox_id_but_not_envd() {
        assert_eq!(
            ingress_host("8000-sb-0123456789abcdef0123.sandlot.test"),
            Some((8000, "sb-0123456789abcdef0123".into()))
        );
        assert_eq!(
            ingress_host("80-sb-ab.example.com:7070"),
            Some((80, "sb-ab".into()))
        );
        for h in [
            "49983-sb-ab.example.com",
            "8000-sb-ab",
            "8000-sb-ab.",
            "127.0.0.1:7070",
            "localhost",
            "my-host.example.com",
            "8000-foo.example.com",
            "0-sb-ab.example.com",
            "70000-sb-ab.example.com",
            "8000-sb-a_b.example.com",
        ] {
            assert_eq!(ingress_host(h), None, "{h}");
        }
    }

    #[test]
    fn rewrite_maps_host_names_to_the_ports_route_and_tokens_to_bearer() {
        let req = axum::http::Request::builder()
            .uri("/a/b?x=1")
            .header("host", "8000-sb-ab.sandlot.test")
            .header("e2b-traffic-access-token", "sk-key")
            .body(Body::empty())
            .unwrap();
        let r = rewrite(req);
        assert_eq!(r.uri(), "/v1/sandboxes/sb-ab/ports/8000/a/b?x=1");
        assert_eq!(r.headers()["authorization"], "Bearer sk-key");
        let plain = axum::http::Request::builder()
            .uri("/v1/ping")
            .header("host", "127.0.0.1:7070")
            .body(Body::empty())
            .unwrap();
        assert_eq!(rewrite(plain).uri(), "/v1/ping");
    }

    #[test]
    fn hop_by_hop_headers_are_dropped_upgrade_kept_only_when_upgrading() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("Upgrade, X-Foo"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("x-foo", HeaderValue::from_static("1"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("accept", HeaderValue::from_static("*/*"));
        let mut up = h.clone();
        strip_hop_by_hop(&mut up, true);
        assert_eq!(up["connection"], "upgrade");
        assert_eq!(up["upgrade"], "websocket");
        assert!(!up.contains_key("x-foo") && !up.contains_key("te"));
        strip_hop_by_hop(&mut h, false);
        assert!(!h.contains_key("connection") && !h.contains_key("upgrade"));
        assert_eq!(h["accept"], "*/*");
    }
}
