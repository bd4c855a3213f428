//! The E2B-compatible API surface: E2B's control plane (REST/JSON) and the envd protocol
//! (Connect-RPC), served by Sandlot itself on its own listener, so the unmodified `e2b`
//! SDKs drive Sandlot sandboxes (`docs/e2b.md` says how to point them here).
//!
//! Sources of the protocols: E2B's OpenAPI spec `spec/openapi.yml` (control plane) and
//! the envd proto files `spec/envd/process/process.proto` and
//! `spec/envd/filesystem/filesystem.proto` in `e2b-dev/E2B`; the Connect protocol
//! (<https://connectrpc.com/docs/protocol>) for the framing ([`connect`]). The shapes were
//! checked against the `e2b` Python SDK 2.63.0.
//!
//! | route | module |
//! |---|---|
//! | `POST/GET /v2/sandboxes`, `GET /sandboxes`, `GET/DELETE /sandboxes/{id}`, `POST /sandboxes/{id}/{timeout,pause,resume,connect,refreshes}`, `POST /v2/sandboxes/{id}/connect` | [`control`] |
//! | `POST /process.Process/{Start,Connect,List,SendInput,StreamInput,CloseStdin,SendSignal}` | [`process`] |
//! | `POST /filesystem.Filesystem/{Stat,ListDir,MakeDir,Move,Remove}`, `GET/POST /files` | [`filesystem`] |
//! | `POST /filesystem.Filesystem/{WatchDir,CreateWatcher,GetWatcherEvents,RemoveWatcher}` | [`watch`] |
//! | `GET /health` (envd) | here |
//! | `POST /execute`, `GET/POST /contexts`, `DELETE /contexts/{id}`, `POST /contexts/{id}/restart` (code interpreter, port 49999) | [`interpreter`] |
//!
//! **Which sandbox** an envd request is for: the `E2b-Sandbox-Id` header (what the SDK
//! sends in `E2B_SANDBOX_URL` mode), else a host name `<port>-<sandbox-id>.<domain>`
//! (`E2B_DOMAIN` mode) ([`sandbox_of`]).
//!
//! **Credentials** ([`credentials`], a layer that runs before [`crate::auth`]): on E2B
//! routes `X-API-KEY` (control plane) and `X-Access-Token` (envd) carry a Sandlot API key
//! and become `Authorization: Bearer`; the `envdAccessToken` Sandlot hands out is the key
//! the caller created the sandbox with. On envd routes `Authorization: Basic <user>:`
//! names E2B's user (not a credential): it is taken out before authentication and kept
//! as [`E2bUser`]. Tenants: every route checks that the caller sees the sandbox; another
//! tenant's sandbox answers as an unknown one.
//!
//! **Users.** Commands run as the sandbox's own (unprivileged) root, whatever the E2B
//! user; the user only picks `HOME` and the default working directory (`/home/user` for
//! `user` and any other name, `/root` for `root`), created on first use.
pub mod connect;
pub mod control;
pub mod filesystem;
pub mod interpreter;
pub mod process;
pub mod proto;
pub mod watch;

use crate::auth::Principal;
use crate::error::ServerError;
use crate::store::Record;
use crate::SharedState;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{any, get, post};
use axum::Router;
use base64::Engine;
use sandlot_api::{Backend, ErrorCode};
use std::collections::HashSet;
use std::sync::Mutex;

/// envd version the sandboxes report (`envdVersion`). The SDK enables features by it:
/// 0.4.0 (no default-user header), 0.5.2 (close stdin), 0.5.7 (octet-stream uploads).
pub const ENVD_VERSION: &str = "0.5.7";
/// envd's port in E2B host names (`49983-<id>.<domain>`).
pub const ENVD_PORT: u16 = 49983;
/// Label holding the E2B template a sandbox was created from (left out of `metadata`).
pub const TEMPLATE_LABEL: &str = "e2b/template";

/// Settings of the E2B surface (`sandlot up --e2b-base-image/--e2b-backend`).
#[derive(Debug, Clone, PartialEq)]
pub struct E2bConfig {
    /// Image of E2B's `base` template (default `python`); any other template id names a
    /// Sandlot image directly.
    pub base_image: String,
    /// Backend of sandboxes created through the E2B API (default `function`).
    pub backend: Backend,
}

impl Default for E2bConfig {
    fn default() -> Self {
        E2bConfig {
            base_image: "python".to_owned(),
            backend: Backend::Function,
        }
    }
}

/// The E2B user an envd request names (`Authorization: Basic <user>:`), if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bUser(pub String);

/// The E2B surface's state held by one server: caches and per-connection objects only
/// (process pids and code-interpreter contexts live on the node: [`process`],
/// [`interpreter`]; snapshot names in the registry store: [`control`]).
#[derive(Default)]
pub struct E2bState {
    /// Sandboxes whose home directories exist already.
    homes: Mutex<HashSet<(String, String)>>,
    /// File watchers ([`watch`]).
    pub watchers: watch::Watchers,
    /// This server's attachments to code-interpreter contexts ([`interpreter`]).
    pub interpreters: interpreter::Interpreters,
}

impl E2bState {
    /// Forget the state of sandboxes not in `keep` (gone sandboxes).
    pub fn retain_sandboxes(&self, keep: impl Fn(&str) -> bool) {
        let mut h = self.homes.lock().unwrap_or_else(|p| p.into_inner());
        h.retain(|(k, _)| keep(k));
        drop(h);
        self.watchers.retain_sandboxes(&keep);
        self.interpreters.retain_sandboxes(keep);
    }
}

/// The E2B routes (mounted by [`crate::router`] next to `/v1`; the paths do not collide).
pub fn routes() -> Router<SharedState> {
    // The Connect routes, in both codecs: [`proto::codec`] turns binary protobuf calls
    // into JSON ones and their answers back.
    let connect = Router::new()
        .route("/process.Process/{method}", post(process::dispatch))
        .route(
            "/filesystem.Filesystem/{method}",
            post(filesystem::dispatch),
        )
        .route_layer(axum::middleware::from_fn(proto::codec));
    Router::new()
        .merge(connect)
        .route("/v2/sandboxes", post(control::create).get(control::list_v2))
        .route("/sandboxes", get(control::list_v1).post(control::create))
        .route(
            "/sandboxes/{sandbox_id}",
            get(control::get_one).delete(control::kill),
        )
        .route("/sandboxes/{sandbox_id}/timeout", post(control::timeout))
        .route("/sandboxes/{sandbox_id}/refreshes", post(control::refresh))
        .route("/sandboxes/{sandbox_id}/pause", post(control::pause))
        .route("/sandboxes/{sandbox_id}/resume", post(control::resume))
        .route("/sandboxes/{sandbox_id}/connect", post(control::connect))
        .route("/v2/sandboxes/{sandbox_id}/connect", post(control::connect))
        .route("/sandboxes/{sandbox_id}/fork", post(control::fork))
        .route(
            "/sandboxes/{sandbox_id}/snapshots",
            post(control::create_snapshot),
        )
        .route("/snapshots", get(control::list_snapshots))
        .route(
            "/templates/{template_id}",
            axum::routing::delete(control::delete_template).fallback(control::unsupported),
        )
        .route("/sandboxes/{sandbox_id}/{*rest}", any(control::unsupported))
        .route(
            "/v2/sandboxes/{sandbox_id}/{*rest}",
            any(control::unsupported),
        )
        .route("/templates", any(control::unsupported))
        .route("/volumes", any(control::unsupported))
        .route("/volumes/{*rest}", any(control::unsupported))
        .route("/health", get(health))
        .route("/files", get(filesystem::download).post(filesystem::upload))
        .route("/execute", post(interpreter::execute))
        .route(
            "/contexts",
            post(interpreter::create_context).get(interpreter::list_contexts),
        )
        .route(
            "/contexts/{context_id}",
            axum::routing::delete(interpreter::remove_context),
        )
        .route(
            "/contexts/{context_id}/restart",
            post(interpreter::restart_context),
        )
}

/// Whether `path` belongs to the E2B surface (for [`credentials`]).
pub fn is_e2b_path(path: &str) -> bool {
    path == "/sandboxes"
        || path.starts_with("/sandboxes/")
        || path == "/snapshots"
        || path == "/templates"
        || path.starts_with("/templates/")
        || path == "/volumes"
        || path.starts_with("/volumes/")
        || path == "/v2/sandboxes"
        || path.starts_with("/v2/sandboxes/")
        || is_envd_path(path)
}

/// Whether `path` is one of envd's or the code interpreter's (served per sandbox).
pub fn is_envd_path(path: &str) -> bool {
    path == "/health"
        || path == "/files"
        || path == "/execute"
        || path == "/contexts"
        || path.starts_with("/contexts/")
        || path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// The credentials layer of the E2B routes (module docs). Runs before [`crate::auth`]
/// and leaves every other route untouched.
pub async fn credentials(mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if !is_e2b_path(path) {
        return next.run(req).await;
    }
    let envd = is_envd_path(path);
    let headers = req.headers_mut();
    if envd {
        let basic_user = header_str(headers, "authorization")
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("basic"))
            .and_then(|(_, b)| {
                base64::engine::general_purpose::STANDARD
                    .decode(b.trim())
                    .ok()
            })
            .and_then(|raw| String::from_utf8(raw).ok())
            .map(|s| s.split_once(':').map(|(u, _)| u.to_owned()).unwrap_or(s));
        if let Some(user) = basic_user {
            headers.remove(header::AUTHORIZATION);
            req.extensions_mut().insert(E2bUser(user));
        }
    }
    let headers = req.headers_mut();
    let token = ["x-access-token", "x-api-key", "e2b-traffic-access-token"]
        .into_iter()
        .find_map(|n| header_str(headers, n).map(str::to_owned));
    if let Some(t) = token {
        if !headers.contains_key(header::AUTHORIZATION) {
            if let Ok(v) = HeaderValue::from_str(&format!("Bearer {t}")) {
                headers.insert(header::AUTHORIZATION, v);
            }
        }
    }
    next.run(req).await
}

/// The key a request presented (`X-API-KEY`, `X-Access-Token` or Bearer), for
/// `envdAccessToken`.
pub fn presented_key(h: &HeaderMap) -> Option<String> {
    crate::auth::presented_key(h)
}

/// The sandbox id an envd request addresses: `E2b-Sandbox-Id`, else the host name
/// `<port>-<id>.<domain>`.
///
/// # Errors
/// `invalid_argument` when neither names a sandbox.
pub fn sandbox_of(h: &HeaderMap) -> Result<String, ServerError> {
    if let Some(id) = header_str(h, "e2b-sandbox-id") {
        return Ok(id.to_owned());
    }
    let host = header_str(h, "host").unwrap_or("");
    let first = host.split('.').next().unwrap_or("");
    if let Some((port, id)) = first.split_once('-') {
        if port.parse::<u16>().is_ok() && !id.is_empty() && host.contains('.') {
            return Ok(id.to_owned());
        }
    }
    Err(ServerError::invalid(
        "which sandbox? send the E2b-Sandbox-Id header (E2B_SANDBOX_URL mode) or use the \
         host name <port>-<sandbox-id>.<domain>",
    ))
}

/// The id of the sandbox the request names ([`sandbox_of`]), when `who` sees it and it is
/// `running`.
///
/// # Errors
/// As [`sandbox_of`], [`visible`] and [`crate::sandboxes::running`]: 400 without a sandbox
/// id, 404 for an unknown, hidden, deleting or deleted one, 409 when it is otherwise not
/// running.
pub async fn running_sandbox_of(
    st: &SharedState,
    who: &Principal,
    h: &HeaderMap,
) -> Result<String, ServerError> {
    let id = sandbox_of(h)?;
    visible_running(st, who, &id).await?;
    Ok(id)
}

/// The record of sandbox `id` if `who` may see it and it is `running`: [`visible`] and
/// [`crate::sandboxes::running`] from one store read (every envd call asks this).
///
/// # Errors
/// 404 `not_found` for an unknown, hidden, deleting or deleted sandbox, 409 `conflict` when
/// it is otherwise not running (the messages of [`crate::sandboxes::running`]); store
/// errors.
pub async fn visible_running(
    st: &SharedState,
    who: &Principal,
    id: &str,
) -> Result<Record, ServerError> {
    let rec = visible(st, who, id).await?;
    match rec.state {
        sandlot_api::SandboxState::Running => Ok(rec),
        sandlot_api::SandboxState::Paused => Err(ServerError::new(
            ErrorCode::Conflict,
            format!("sandbox is paused: {id} (resume it with POST /v1/sandboxes:resume)"),
        )),
        s => Err(ServerError::new(
            ErrorCode::Conflict,
            format!("sandbox {id} is {}, not running", s.as_str()),
        )),
    }
}

/// The record of sandbox `id` if `who` may see it and it is not being deleted, else 404 as
/// for an unknown id: E2B's API forgets a sandbox once it is killed or its timeout ends,
/// so a `deleting` (the TTL reaper or a kill at work) or `deleted` record is not found.
///
/// # Errors
/// 404 `not_found`; store errors.
pub async fn visible(st: &SharedState, who: &Principal, id: &str) -> Result<Record, ServerError> {
    use sandlot_api::SandboxState as S;
    match st.store.get(id).await? {
        Some(r)
            if who.sees(r.tenant.as_deref()) && !matches!(r.state, S::Deleting | S::Deleted) =>
        {
            Ok(r)
        }
        _ => Err(ServerError::new(
            ErrorCode::NotFound,
            format!("sandbox {id} not found"),
        )),
    }
}

/// `GET /health` (envd): 204 while the sandbox named by the request runs; 502 when it is
/// not running, with E2B's proxy's message `The sandbox <id> was not found` (the SDK's
/// `is_running` reads any 502 as `false`; its health probe after a broken stream needs
/// "was not found" to call the sandbox gone, [`process`]).
pub async fn health(
    axum::extract::State(st): axum::extract::State<SharedState>,
    axum::Extension(who): axum::Extension<Principal>,
    headers: HeaderMap,
) -> Response {
    use axum::response::IntoResponse;
    let id = sandbox_of(&headers).ok();
    let running = match &id {
        Some(id) => visible(&st, &who, id)
            .await
            .is_ok_and(|r| r.state == sandlot_api::SandboxState::Running),
        None => false,
    };
    if running {
        axum::http::StatusCode::NO_CONTENT.into_response()
    } else {
        let message = format!(
            "The sandbox {} was not found (not running)",
            id.as_deref().unwrap_or("(no id)")
        );
        (
            axum::http::StatusCode::BAD_GATEWAY,
            axum::Json(serde_json::json!({"code": 502, "message": message})),
        )
            .into_response()
    }
}

/// HOME and default working directory of E2B user `user`.
pub fn home_of(user: Option<&str>) -> String {
    match user {
        Some("root") => "/root".to_owned(),
        _ => "/home/user".to_owned(),
    }
}

/// Make sure `home` exists in sandbox `id` (once per sandbox and home).
///
/// # Errors
/// The node's error.
pub async fn ensure_home(st: &SharedState, id: &str, home: &str) -> Result<(), ServerError> {
    let key = (id.to_owned(), home.to_owned());
    if st
        .e2b
        .homes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&key)
    {
        return Ok(());
    }
    st.node.make_dir(id, home, true).await?;
    st.e2b
        .homes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_from_header_or_host() {
        let mut h = HeaderMap::new();
        h.insert(
            "host",
            HeaderValue::from_static("49983-sb-0123.sandlot.test"),
        );
        assert_eq!(sandbox_of(&h).unwrap(), "sb-0123");
        h.insert("e2b-sandbox-id", HeaderValue::from_static("sb-9"));
        assert_eq!(sandbox_of(&h).unwrap(), "sb-9");
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("127.0.0.1:7070"));
        assert!(sandbox_of(&h).is_err());
    }

    #[test]
    fn e2b_paths() {
        assert!(is_e2b_path("/v2/sandboxes"));
        assert!(is_e2b_path("/sandboxes/sb-1/timeout"));
        assert!(is_envd_path("/process.Process/Start"));
        assert!(!is_e2b_path("/v1/sandboxes"));
        assert!(!is_e2b_path("/healthz"));
    }
}
