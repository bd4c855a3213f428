//! Tenants: API keys, authentication, and the one layer that scopes every route to its
//! tenant.
//!
//! **Keys.** `sk-` + 43 characters: 32 random bytes (256 bits from the OS CSPRNG through
//! `rand`) in unpadded base64url (RFC 4648 §5). Only the SHA-256 of a key is stored
//! (`api_keys` in `DATA/sandlot.db`, [`crate::store::KeyRow`]); a plain hash, not a slow
//! password hash, is the right tool for 256-bit random secrets (nothing to brute-force).
//! Each key has a public id (`key_` + 16 hex digits) that is the **tenant id** of the
//! sandboxes it creates, an optional admin scope, and quotas ([`crate::store::Quota`]).
//! Keys are managed offline on the store with `sandlot key create|ls|revoke --data-dir`
//! ([`create_key`]); the server reads the table on every request, so a key created or
//! revoked while it runs takes effect at once.
//!
//! **When authentication is on.** As soon as the store holds any key row (revoked ones
//! included, so revoking the last key never opens the server). Without keys the server
//! answers everyone as the anonymous admin, which [`crate::Server::bind`] allows only on a
//! loopback address.
//!
//! **Credentials.** `Authorization: Bearer <key>`; also `Authorization: Basic` with the key
//! as password (or as user name with an empty password) so a browser can open the status
//! page `/`. Missing, unknown or revoked → 401 `unauthenticated` with
//! `WWW-Authenticate: Bearer realm="sandlot"` and `Basic realm="sandlot"`. The key is found
//! by its SHA-256 (a unique index): the lookup's timing depends only on the digest, which
//! tells nothing about the key; the stored digest is then compared in constant time
//! (`subtle`).
//!
//! **Scopes** ([`authorize`], applied to the whole router):
//! - public, no credentials: `GET /v1/ping`, `/healthz`, `/openapi.json` (liveness probes,
//!   API description);
//! - admin keys only (else 403 `permission_denied`): `GET /metrics`, `GET /`,
//!   `GET /v1/nodes` (host-wide figures);
//! - every other route needs a key. Any route whose path template starts with
//!   `/v1/sandboxes/{…}` (today's and any added later, whatever the parameter is called;
//!   [`scoped`]) first loads the sandbox record: a
//!   sandbox of another tenant is answered exactly like an unknown id (404 `not_found`;
//!   `DELETE /v1/sandboxes/{id}` answers 204 as for an unknown id and deletes nothing), so
//!   its existence does not leak. `/v1/trajectories/{*id}` likewise for a trajectory id
//!   claimed by another tenant. List, label pause/resume, events and create read the
//!   [`Principal`] the layer puts into the request extensions and see only their tenant.
//! - An admin key sees and acts on every tenant's sandboxes, trajectories and events (an
//!   operator's key); its own creates are still recorded with its id and its quotas apply.
use crate::error::ServerError;
use crate::store::{KeyRow, Quota, StoreError};
use crate::SharedState;
use axum::extract::{FromRequestParts, MatchedPath, RawPathParams, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sandlot_api::ErrorCode;
use sha2::{Digest, Sha256};
use std::sync::atomic::Ordering;
use subtle::ConstantTimeEq;

/// Prefix of every API key.
pub const KEY_PREFIX: &str = "sk-";
/// Routes answered without credentials.
pub const PUBLIC_ROUTES: [&str; 3] = ["/v1/ping", "/healthz", "/openapi.json"];
/// Routes that need an admin key when authentication is on.
pub const ADMIN_ROUTES: [&str; 5] = [
    "/metrics",
    "/",
    "/v1/nodes",
    "/v1/timeline",
    "/v1/sandboxes:summary",
];
/// Route templates starting with this name a sandbox in their first parameter (whatever the
/// parameter is called), checked against the caller's tenant.
pub const SANDBOX_ROUTES: &str = "/v1/sandboxes/{";
/// Route templates starting with this name a trajectory in their first parameter.
pub const TRAJECTORY_ROUTES: &str = "/v1/trajectories/{";

/// What a route template's first path parameter names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoped<'a> {
    /// A sandbox id in parameter `.0`.
    Sandbox(&'a str),
    /// A trajectory id in parameter `.0`.
    Trajectory(&'a str),
}

/// The tenant-scoped object a route template (`MatchedPath`) addresses, if any:
/// `/v1/sandboxes/{id}/anything` → `Sandbox("id")`, `/v1/trajectories/{*id}` →
/// `Trajectory("id")`. `/v1/sandboxes:pause` and `/v1/sandboxes` address none.
pub fn scoped(route: &str) -> Option<Scoped<'_>> {
    fn param(rest: &str) -> Option<&str> {
        let name = &rest[..rest.find('}')?];
        Some(name.strip_prefix('*').unwrap_or(name))
    }
    if let Some(rest) = route.strip_prefix(SANDBOX_ROUTES) {
        return param(rest).map(Scoped::Sandbox);
    }
    if let Some(rest) = route.strip_prefix(TRAJECTORY_ROUTES) {
        return param(rest).map(Scoped::Trajectory);
    }
    None
}

/// Who is calling: put into the request extensions by [`authorize`].
#[derive(Debug, Clone, PartialEq)]
pub struct Principal {
    /// Tenant id (= API key id); `None` when authentication is off.
    pub tenant: Option<String>,
    /// Sees every tenant's sandboxes, trajectories and events; may read `/metrics`, `/`.
    pub admin: bool,
    /// Limits on the tenant's sandboxes; `None` when authentication is off.
    pub quota: Option<Quota>,
}

impl Principal {
    /// The caller when authentication is off: no tenant, admin, no quota.
    pub fn anonymous() -> Principal {
        Principal {
            tenant: None,
            admin: true,
            quota: None,
        }
    }

    /// Whether this caller may see a sandbox or trajectory owned by `owner`.
    pub fn sees(&self, owner: Option<&str>) -> bool {
        self.admin || (self.tenant.is_some() && self.tenant.as_deref() == owner)
    }

    /// The tenant whose objects alone this caller may see; `None` = all (admin).
    pub fn only_tenant(&self) -> Option<&str> {
        if self.admin {
            None
        } else {
            // A non-admin principal always has a tenant.
            Some(self.tenant.as_deref().unwrap_or(""))
        }
    }
}

/// SHA-256 of a key, 64 lowercase hex digits (the stored form).
pub fn key_digest(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A fresh key: `sk-` + 32 random bytes in unpadded base64url.
pub fn generate_key() -> String {
    let bytes: [u8; 32] = rand::random();
    format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// A new key named `name`: its row (id `key_` + 16 hex digits, SHA-256 digest of the key)
/// and the key itself (`sk-` + 43 base64url characters), which is not kept anywhere and must
/// be shown to the operator once. Nothing is stored.
fn new_key(name: &str, admin: bool, quota: Quota) -> (KeyRow, String) {
    let key = generate_key();
    let id_bytes: [u8; 8] = rand::random();
    let row = KeyRow {
        id: format!(
            "key_{}",
            id_bytes
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ),
        name: name.to_owned(),
        digest: key_digest(&key),
        admin,
        quota,
        created_at_ms: crate::now_ms(),
        revoked_at_ms: None,
    };
    (row, key)
}

/// A new key named `name` (`sk-` + 43 base64url characters), its digest stored in `store`.
/// Returns the row and the key, which is kept nowhere and must be shown to the operator once.
///
/// # Errors
/// [`StoreError`] when the store fails. The caller validates `name` (`sandlot key create`
/// takes 1–128 characters).
pub async fn create_key(
    store: &dyn crate::registry::Registry,
    name: &str,
    admin: bool,
    quota: Quota,
) -> Result<(KeyRow, String), StoreError> {
    let (row, key) = new_key(name, admin, quota);
    store.insert_key(&row).await?;
    Ok((row, key))
}

/// The key presented in `Authorization` (Bearer, or Basic with the key as password or as
/// user name), if any.
pub fn presented_key(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = v.split_once(' ')?;
    let rest = rest.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(rest.to_owned());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (user, pass) = text.split_once(':')?;
        return Some(if pass.is_empty() { user } else { pass }.to_owned());
    }
    None
}

fn unauthenticated(message: &str) -> Response {
    let mut resp = ServerError::new(ErrorCode::Unauthenticated, message).into_response();
    let h = resp.headers_mut();
    h.append(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"sandlot\""),
    );
    h.append(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"sandlot\""),
    );
    resp
}

/// Whether authentication is on (latched once the store showed a key).
///
/// # Errors
/// Store failures.
pub async fn enabled(st: &SharedState) -> Result<bool, StoreError> {
    if st.auth_on.load(Ordering::Relaxed) {
        return Ok(true);
    }
    let on = st.store.has_keys().await?;
    if on {
        st.auth_on.store(true, Ordering::Relaxed);
        tracing::info!("API keys found: authentication is required from now on");
    }
    Ok(on)
}

/// Why [`authenticate`] refused a request.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No usable key: 401 `unauthenticated` with the challenges.
    #[error("{0}")]
    Unauthenticated(&'static str),
    /// The key table could not be read: 500.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        match self {
            AuthError::Unauthenticated(m) => unauthenticated(m),
            AuthError::Store(e) => ServerError::from(e).into_response(),
        }
    }
}

/// The principal of a request: anonymous when authentication is off, else the key's.
///
/// # Errors
/// [`AuthError::Unauthenticated`] for a missing, unknown or revoked key;
/// [`AuthError::Store`] on store failures.
pub async fn authenticate(st: &SharedState, headers: &HeaderMap) -> Result<Principal, AuthError> {
    if !enabled(st).await? {
        return Ok(Principal::anonymous());
    }
    let Some(key) = presented_key(headers) else {
        return Err(AuthError::Unauthenticated(
            "missing API key: send `Authorization: Bearer <key>`",
        ));
    };
    let digest = key_digest(&key);
    let row = st.store.key_by_digest(&digest).await?;
    let Some(row) = row.filter(|r| bool::from(r.digest.as_bytes().ct_eq(digest.as_bytes()))) else {
        return Err(AuthError::Unauthenticated("invalid API key"));
    };
    if row.revoked_at_ms.is_some() {
        return Err(AuthError::Unauthenticated("API key revoked"));
    }
    Ok(Principal {
        tenant: Some(row.id),
        admin: row.admin,
        quota: Some(row.quota),
    })
}

/// What a caller who may not see sandbox `id` gets: the answer of an unknown id (`DELETE
/// /v1/sandboxes/{id}` itself answers 204 for an unknown id).
fn hidden_sandbox(method: &Method, route: &str, id: &str) -> Response {
    let whole = route
        .strip_prefix(SANDBOX_ROUTES)
        .is_some_and(|r| r.ends_with('}') && !r.contains('/'));
    if method == Method::DELETE && whole {
        return StatusCode::NO_CONTENT.into_response();
    }
    ServerError::no_sandbox(id).into_response()
}

/// The authentication and tenant layer of every route (module docs). Handlers read the
/// caller with `Extension<Principal>`.
pub async fn authorize(State(st): State<SharedState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let route = route.as_deref().unwrap_or("");
    if PUBLIC_ROUTES.contains(&route) {
        return next.run(req).await;
    }
    let principal = match authenticate(&st, req.headers()).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    if ADMIN_ROUTES.contains(&route) && !principal.admin {
        return ServerError::new(
            ErrorCode::PermissionDenied,
            format!("{route} needs an admin API key"),
        )
        .into_response();
    }
    let (mut parts, body) = req.into_parts();
    if let Some(what) = scoped(route).filter(|_| !principal.admin) {
        let params = match RawPathParams::from_request_parts(&mut parts, &st).await {
            Ok(p) => p,
            Err(e) => return ServerError::invalid(e.body_text()).into_response(),
        };
        let name = match what {
            Scoped::Sandbox(n) | Scoped::Trajectory(n) => n,
        };
        let Some(id) = params.iter().find(|(k, _)| *k == name).map(|(_, v)| v) else {
            return ServerError::new(ErrorCode::Internal, format!("route {route} without {name}"))
                .into_response();
        };
        match what {
            Scoped::Trajectory(_) => match st.store.trajectory_owner(id).await {
                Ok(owner) if principal.sees(owner.as_deref()) => {}
                Ok(_) if parts.method == Method::DELETE => {
                    return StatusCode::NO_CONTENT.into_response()
                }
                Ok(_) => {
                    return ServerError::new(ErrorCode::NotFound, format!("no trajectory {id:?}"))
                        .into_response()
                }
                Err(e) => return ServerError::from(e).into_response(),
            },
            Scoped::Sandbox(_) => match st.store.get(id).await {
                Ok(Some(rec)) if !principal.sees(rec.tenant.as_deref()) => {
                    return hidden_sandbox(&parts.method, route, id)
                }
                Ok(_) => {}
                Err(e) => return ServerError::from(e).into_response(),
            },
        }
    }
    parts.extensions.insert(principal);
    next.run(Request::from_parts(parts, body)).await
}
