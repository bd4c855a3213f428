//! E2B's control plane (`spec/openapi.yml` of `e2b-dev/E2B`) over Sandlot's sandboxes.
//!
//! | E2B | Sandlot |
//! |---|---|
//! | `POST /v2/sandboxes` `{templateID, timeout, metadata, envVars, autoPause}` → 201 `Sandbox` | create: template → image (`base` → [`super::E2bConfig::base_image`]), `timeout` s → TTL (default 15 s, as E2B), `metadata` → labels, `envVars` → env, backend [`super::E2bConfig::backend`]; `Idempotency-Key` as for `/v1` |
//! | `GET /v2/sandboxes?metadata=&state=&template=&startedAfter=&order=&limit=&nextToken=` → `[ListedSandbox]`, `X-Next-Token` when more follow | list of the caller's sandboxes, `metadata` = URL-encoded `k=v&…` (all must match), `state` = `running,paused`, `order` by start (default `desc`), `limit` 1–100 (default 100) |
//! | `GET /sandboxes` → `[ListedSandbox]` | the running ones |
//! | `GET /sandboxes/{id}` → `SandboxDetail` | get |
//! | `DELETE /sandboxes/{id}` → 204 (404 unknown or being deleted) | delete |
//! | `POST /sandboxes/{id}/timeout {timeout}` → 204 | TTL = now + timeout ([`crate::sandboxes::set_ttl`]) |
//! | `POST /sandboxes/{id}/refreshes {duration}` → 204 | keepalive |
//! | `POST /sandboxes/{id}/pause` → 204 (409 when paused) | pause (processes frozen, files kept) |
//! | `POST /sandboxes/{id}/resume {timeout}` → 201 `Sandbox` (409 when running) | resume |
//! | `POST /v2/sandboxes/{id}/connect {timeout}` → 200 `Sandbox` (running) or 201 (resumed) | resume when paused, then TTL (never shortened for a running one) |
//! | `POST /sandboxes/{id}/snapshots {name}` → 201 `SnapshotInfo`; `GET /snapshots`; `DELETE /templates/{snapshotID}` | disk checkpoint ([`crate::checkpoints`]); `templateID` = snapshot id forks from it |
//! | `POST /sandboxes/{id}/fork {timeout, count}` → 201 `[SandboxForkResult]` | checkpoint, `count` creates from it, checkpoint deleted |
//! | other E2B control routes (metrics, logs, templates, volumes, network) | 501 in E2B's error shape |
//!
//! Errors are E2B's body `{"code": <HTTP status>, "message": "…"}`. Unsupported fields
//! (`autoPause`, `network`, `mcp`, volume mounts, `secure`) are accepted and ignored;
//! `docs/e2b.md` lists them.
use super::{visible, ENVD_VERSION, TEMPLATE_LABEL};
use crate::auth::Principal;
use crate::error::ServerError;
use crate::sandboxes::{create_sandbox, delete_sandbox, set_ttl};
use crate::store::{rfc3339, Record};
use crate::SharedState;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use sandlot_api::{CreateSandboxRequest, ErrorCode, SandboxState};
use serde::Deserialize;
use std::collections::BTreeMap;

/// E2B's default sandbox timeout when `timeout` is absent, seconds (OpenAPI `NewSandbox`).
pub const DEFAULT_TIMEOUT_S: u64 = 15;

/// An error in E2B's shape: `{"code": <HTTP status>, "message"}` with that status.
#[derive(Debug)]
pub struct E2bError(pub ServerError);

impl From<ServerError> for E2bError {
    fn from(e: ServerError) -> Self {
        E2bError(e)
    }
}

impl From<crate::store::StoreError> for E2bError {
    fn from(e: crate::store::StoreError) -> Self {
        E2bError(e.into())
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let api = self.0.api_error();
        if api.code == ErrorCode::Internal {
            tracing::error!(error = %crate::error::chain(&self.0), "e2b control plane: internal error");
        }
        let status = StatusCode::from_u16(api.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (
            status,
            axum::Json(serde_json::json!({"code": status.as_u16(), "message": api.message})),
        )
            .into_response();
        if let ServerError::RetryAfter { seconds, .. } = self.0 {
            if let Ok(v) = seconds.to_string().parse() {
                r.headers_mut().insert("retry-after", v);
            }
        }
        r
    }
}

type E2bResult<T> = Result<T, E2bError>;

fn invalid(msg: impl Into<String>) -> E2bError {
    E2bError(ServerError::invalid(msg))
}

/// A JSON object body (empty = `{}`) as `T`.
fn body_of<T: serde::de::DeserializeOwned>(body: &Bytes) -> E2bResult<T> {
    let v: serde_json::Value = if body.iter().all(|b| b.is_ascii_whitespace()) {
        serde_json::Value::Object(Default::default())
    } else {
        serde_json::from_slice(body).map_err(|e| invalid(format!("request body: {e}")))?
    };
    if !v.is_object() {
        return Err(invalid("request body must be a JSON object"));
    }
    serde_json::from_value(v).map_err(|e| invalid(format!("request body: {e}")))
}

/// `NewSandbox` / `NewSandboxV2` (the fields Sandlot uses; others are ignored).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// `ConnectSandbox`, `ResumedSandbox`, `SandboxTimeoutRequest`, `SandboxRefreshRequest`.
#[derive(Debug, Default, Deserialize)]
struct TimeoutBody {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    duration: Option<u64>,
}

fn image_of(st: &SharedState, template: &str) -> String {
    if template == "base" {
        st.cfg.e2b.base_image.clone()
    } else if super::interpreter::TEMPLATES.contains(&template) {
        super::interpreter::IMAGE.to_owned()
    } else {
        template.to_owned()
    }
}

fn template_of(rec: &Record) -> String {
    rec.labels
        .get(TEMPLATE_LABEL)
        .cloned()
        .unwrap_or_else(|| rec.image.clone())
}

fn metadata_of(rec: &Record) -> BTreeMap<String, String> {
    rec.labels
        .iter()
        .filter(|(k, _)| !k.starts_with("e2b/"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn state_of(rec: &Record) -> &'static str {
    match rec.state {
        SandboxState::Paused => "paused",
        _ => "running",
    }
}

/// E2B's `endAt`: the expiry, or far in the future for a sandbox without TTL.
fn end_at(rec: &Record) -> String {
    rfc3339(
        rec.expires_at_ms
            .unwrap_or(rec.created_at_ms + super::super::sandboxes::MAX_TTL_S as i64 * 1000),
    )
}

/// The `Sandbox` answer of create, resume and connect. `envdAccessToken` is the caller's
/// API key when authentication is on (the envd routes accept it as `X-Access-Token`).
fn sandbox_json(st: &SharedState, rec: &Record, key: Option<String>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "templateID": template_of(rec),
        "sandboxID": rec.id,
        "clientID": st.node_name,
        "alias": template_of(rec),
        "envdVersion": ENVD_VERSION,
        "domain": null,
    });
    if let Some(k) = key {
        // The code interpreter's `*_code_context` calls send only the traffic token.
        v["trafficAccessToken"] = k.clone().into();
        v["envdAccessToken"] = k.into();
    }
    v
}

fn listed_json(rec: &Record) -> serde_json::Value {
    serde_json::json!({
        "templateID": template_of(rec),
        "alias": template_of(rec),
        "sandboxID": rec.id,
        "clientID": rec.node,
        "startedAt": rfc3339(rec.created_at_ms),
        "endAt": end_at(rec),
        "cpuCount": rec.spec.cpu.ceil().max(1.0) as u64,
        "memoryMB": rec.spec.memory_mib,
        "diskSizeMB": rec.spec.disk_mib,
        "metadata": metadata_of(rec),
        "state": state_of(rec),
        "envdVersion": ENVD_VERSION,
    })
}

async fn access_key(st: &SharedState, headers: &HeaderMap) -> Option<String> {
    if crate::auth::enabled(st).await.unwrap_or(true) {
        super::presented_key(headers)
    } else {
        None
    }
}

/// Create one E2B sandbox: `template` is an E2B template (image) or a snapshot id
/// (`ck-…`, a Sandlot checkpoint: the sandbox is forked from it); `shown` is the template
/// it reports (`template` when `None`).
#[allow(clippy::too_many_arguments)]
async fn create_one(
    st: &SharedState,
    who: &Principal,
    template: &str,
    shown: Option<String>,
    ttl_s: u64,
    env: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
    key: Option<String>,
) -> Result<(Record, bool), ServerError> {
    if labels.keys().any(|k| k.starts_with("e2b/")) {
        return Err(ServerError::invalid(
            "metadata keys starting with \"e2b/\" are reserved",
        ));
    }
    let mut create = CreateSandboxRequest {
        backend: st.cfg.e2b.backend,
        ttl_s: Some(ttl_s),
        env,
        labels,
        ..Default::default()
    };
    if sandlot_node_api::check_checkpoint_id(template).is_ok() {
        create.checkpoint = Some(template.to_owned());
        crate::checkpoints::fill_from_checkpoint(st, who, &mut create, false).await?;
    } else {
        create.image = Some(image_of(st, template));
    }
    let shown = shown.unwrap_or_else(|| template.to_owned());
    let extra = BTreeMap::from([(TEMPLATE_LABEL.to_owned(), shown)]);
    let (rec, created) = create_sandbox(st, who, create, extra, key).await?;
    if let Err(e) = super::ensure_home(st, &rec.id, &super::home_of(None)).await {
        tracing::warn!(sandbox_id = %rec.id, error = %crate::error::chain(&e), "e2b: could not create /home/user");
    }
    Ok((rec, created))
}

/// `POST /v2/sandboxes` (and the older `POST /sandboxes`) → 201 `Sandbox`. A
/// `templateID` that is a snapshot id (`ck-…`, from `POST /sandboxes/{id}/snapshots`)
/// starts the sandbox from that snapshot's files.
pub async fn create(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
    body: Bytes,
) -> E2bResult<Response> {
    let req: NewSandbox = body_of(&body)?;
    if req.template_id.is_empty() {
        return Err(invalid("templateID must not be empty"));
    }
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .filter(|k| !k.is_empty() && k.len() <= 256)
                .ok_or_else(|| invalid("Idempotency-Key must be 1–256 visible ASCII characters"))?
                .to_owned(),
        ),
    };
    let (rec, created) = create_one(
        &st,
        &who,
        &req.template_id,
        None,
        req.timeout.unwrap_or(DEFAULT_TIMEOUT_S),
        req.env_vars.unwrap_or_default(),
        req.metadata.unwrap_or_default(),
        key,
    )
    .await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        axum::Json(sandbox_json(&st, &rec, access_key(&st, &headers).await)),
    )
        .into_response())
}

/// Longest snapshot name, bytes.
pub const MAX_SNAPSHOT_NAME: usize = 256;

/// A `SnapshotInfo`: the checkpoint id and its name, if it has one. Names
/// (`SandboxSnapshotRequest.name`) are kept in the registry store
/// ([`crate::registry::Registry::set_checkpoint_name`]: SQLite under `sandlot up`,
/// PostgreSQL in a cluster), so every server lists them and they survive restarts.
fn snapshot_json(id: &str, name: Option<&String>) -> serde_json::Value {
    serde_json::json!({"snapshotID": id, "names": name.into_iter().collect::<Vec<_>>()})
}

/// Checkpoint `id` (visible to `who`, running or paused) → the checkpoint id.
async fn checkpoint_of(st: &SharedState, who: &Principal, id: &str) -> E2bResult<String> {
    let rec = visible(st, who, id).await?;
    if !matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
        return Err(E2bError(ServerError::no_sandbox(id)));
    }
    let (_, axum::Json(ck)) = crate::checkpoints::create(
        State(st.clone()),
        Extension(who.clone()),
        crate::error::Path(id.to_owned()),
    )
    .await
    .map(|(s, crate::error::Json(c))| (s, axum::Json(c)))?;
    Ok(ck.checkpoint_id)
}

/// `POST /sandboxes/{id}/snapshots {"name"?}` → 201 `SnapshotInfo`: a Sandlot checkpoint of
/// the sandbox's files (processes and memory are not saved); its id is the `snapshotID`,
/// usable as `templateID` of a create.
pub async fn create_snapshot(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> E2bResult<Response> {
    #[derive(Deserialize)]
    struct Req {
        #[serde(default)]
        name: Option<String>,
    }
    let req: Req = body_of(&body)?;
    let name = req.name.filter(|n| !n.is_empty());
    if let Some(n) = &name {
        if n.len() > MAX_SNAPSHOT_NAME {
            return Err(invalid(format!(
                "name is {} bytes, over the limit of {MAX_SNAPSHOT_NAME}",
                n.len()
            )));
        }
    }
    let ck = checkpoint_of(&st, &who, &id).await?;
    if let Some(n) = &name {
        if let Err(e) = st.store.set_checkpoint_name(&ck, n).await {
            // Nothing half-made: the snapshot goes when its name cannot be kept.
            let _ = crate::checkpoints::delete(
                State(st.clone()),
                Extension(who.clone()),
                crate::error::Path(ck.clone()),
            )
            .await;
            return Err(e.into());
        }
    }
    Ok((
        StatusCode::CREATED,
        axum::Json(snapshot_json(&ck, name.as_ref())),
    )
        .into_response())
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=` → 200 `[SnapshotInfo]`, oldest
/// first; `X-Next-Token` (an offset) when more follow.
pub async fn list_snapshots(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| invalid(format!("query: {e}")))?;
    let (mut sandbox, mut name, mut limit, mut from) = (None, None, 100usize, 0usize);
    for (k, v) in pairs {
        match k.as_str() {
            "sandboxID" => sandbox = Some(v),
            "name" => name = Some(v),
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|l| (1..=100).contains(l))
                    .ok_or_else(|| invalid(format!("limit {v:?} must be 1–100")))?
            }
            "nextToken" => {
                from = v
                    .parse()
                    .map_err(|_| invalid(format!("nextToken {v:?} is not one this server gave")))?
            }
            other => return Err(invalid(format!("unknown query parameter {other:?}"))),
        }
    }
    let checkpoints = st.store.list_checkpoints().await?;
    let names = st.store.checkpoint_names().await?;
    let all: Vec<String> = checkpoints
        .into_iter()
        .filter(|c| who.sees(c.tenant.as_deref()))
        .filter(|c| sandbox.as_ref().is_none_or(|s| *s == c.sandbox_id))
        .filter(|c| {
            name.as_ref()
                .is_none_or(|n| *n == c.id || names.get(&c.id) == Some(n))
        })
        .map(|c| c.id)
        .collect();
    let page: Vec<serde_json::Value> = all
        .iter()
        .skip(from)
        .take(limit)
        .map(|id| snapshot_json(id, names.get(id)))
        .collect();
    let mut r = axum::Json(page).into_response();
    if from.saturating_add(limit) < all.len() {
        if let Ok(v) = (from + limit).to_string().parse() {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

/// `DELETE /templates/{id}` → 204 for a snapshot (a Sandlot checkpoint) the caller sees,
/// 404 otherwise (templates are images in Sandlot and are not deleted here).
pub async fn delete_template(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    if crate::checkpoints::visible(&st, &who, &id).await.is_err() {
        return Err(E2bError(ServerError::new(
            ErrorCode::NotFound,
            format!("snapshot {id} not found"),
        )));
    }
    crate::checkpoints::delete(
        State(st.clone()),
        Extension(who.clone()),
        crate::error::Path(id.clone()),
    )
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/fork {"timeout"?, "count"?}` → 201 `[SandboxForkResult]`: one
/// checkpoint of the sandbox's files, `count` (1–100) sandboxes created from it (each
/// `{"sandbox"}` or `{"error": {code, message}}`), then the checkpoint deleted. The
/// forks keep the parent's template, metadata and environment; memory and processes are
/// not carried (Sandlot checkpoints are disk only).
pub async fn fork(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> E2bResult<Response> {
    #[derive(Deserialize)]
    struct Req {
        #[serde(default)]
        timeout: Option<u64>,
        #[serde(default)]
        count: Option<u64>,
    }
    let req: Req = body_of(&body)?;
    let count = req.count.unwrap_or(1);
    if !(1..=100).contains(&count) {
        return Err(invalid(format!("count {count} must be 1–100")));
    }
    let parent = visible(&st, &who, &id).await?;
    let ck = checkpoint_of(&st, &who, &id).await?;
    let key = access_key(&st, &headers).await;
    let mut out = Vec::new();
    for _ in 0..count {
        let made = create_one(
            &st,
            &who,
            &ck,
            Some(template_of(&parent)),
            req.timeout.unwrap_or(DEFAULT_TIMEOUT_S),
            parent.spec.env.clone(),
            metadata_of(&parent),
            None,
        )
        .await;
        out.push(match made {
            Ok((rec, _)) => serde_json::json!({"sandbox": sandbox_json(&st, &rec, key.clone())}),
            Err(e) => {
                let api = e.api_error();
                serde_json::json!({"error": {"code": api.code.http_status(), "message": api.message}})
            }
        });
    }
    if let Err(e) = crate::checkpoints::delete(
        State(st.clone()),
        Extension(who.clone()),
        crate::error::Path(ck.clone()),
    )
    .await
    {
        tracing::warn!(checkpoint_id = %ck, error = %crate::error::chain(&e), "e2b fork: could not delete its checkpoint");
    }
    Ok((StatusCode::CREATED, axum::Json(out)).into_response())
}

/// Any E2B control route Sandlot does not serve (templates, volumes, secrets, metrics,
/// logs, network updates…) → 501 in E2B's error shape.
pub async fn unsupported(uri: axum::http::Uri, method: axum::http::Method) -> Response {
    let status = StatusCode::NOT_IMPLEMENTED;
    let message = format!(
        "{method} {} is not supported by Sandlot's E2B surface (docs/e2b.md)",
        uri.path()
    );
    (
        status,
        axum::Json(serde_json::json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

/// Parsed list query.
#[derive(Debug, Default, PartialEq)]
struct ListQuery {
    metadata: Vec<(String, String)>,
    states: Option<Vec<&'static str>>,
    limit: Option<usize>,
    /// Oldest first (`order=asc`); default newest first, as E2B.
    asc: bool,
    /// `startedAfter`, Unix ms: sandboxes started at or after it.
    started_after_ms: Option<i64>,
    template: Option<String>,
    /// `nextToken`: the (start ms, id) of the previous page's last sandbox.
    after: Option<(i64, String)>,
}

/// Most sandboxes on one page of `GET /v2/sandboxes` (E2B's `limit` maximum and default).
pub const MAX_PAGE: usize = 100;

fn parse_list_query(raw: Option<&str>) -> E2bResult<ListQuery> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw.unwrap_or(""))
        .map_err(|e| invalid(format!("query: {e}")))?;
    let mut q = ListQuery::default();
    for (k, v) in pairs {
        match k.as_str() {
            "metadata" => {
                // The SDK percent-encodes each key and value (`urllib.parse.quote`) before
                // it form-encodes the pairs (e2b `sandbox_sync/paginator.py`), so both are
                // decoded once more after the pairs are split.
                let m: Vec<(String, String)> = serde_urlencoded::from_str(&v)
                    .map_err(|e| invalid(format!("metadata filter {v:?}: {e}")))?;
                for (k, v) in m {
                    q.metadata.push((unquote(&k)?, unquote(&v)?));
                }
            }
            "state" => {
                let mut s = Vec::new();
                for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                    s.push(match part {
                        "running" => "running",
                        "paused" => "paused",
                        other => {
                            return Err(invalid(format!(
                                "state {other:?}: expected running or paused"
                            )))
                        }
                    });
                }
                q.states = Some(s);
            }
            "limit" => {
                let n: usize = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| invalid(format!("limit {v:?} must be 1–{MAX_PAGE}")))?;
                q.limit = Some(n);
            }
            "order" => {
                q.asc = match v.as_str() {
                    "asc" => true,
                    "desc" => false,
                    _ => return Err(invalid(format!("order {v:?}: expected asc or desc"))),
                }
            }
            "startedAfter" => {
                let t = chrono::DateTime::parse_from_rfc3339(&v)
                    .map_err(|e| invalid(format!("startedAfter {v:?}: {e}")))?;
                q.started_after_ms = Some(t.timestamp_millis());
            }
            "template" => q.template = Some(v),
            "nextToken" => {
                let bad = || invalid(format!("nextToken {v:?} is not one this server gave"));
                let (ms, id) = v.split_once('.').ok_or_else(bad)?;
                q.after = Some((ms.parse().map_err(|_| bad())?, id.to_owned()));
            }
            other => return Err(invalid(format!("unknown query parameter {other:?}"))),
        }
    }
    Ok(q)
}

/// `s` percent-decoded (one level of `%XX`; `+` stays `+`).
///
/// # Errors
/// `invalid_argument` when the bytes are not UTF-8.
fn unquote(s: &str) -> E2bResult<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(|c| c.into_owned())
        .map_err(|e| invalid(format!("metadata filter {s:?}: {e}")))
}

async fn list_with(
    st: &SharedState,
    who: &Principal,
    q: ListQuery,
    default_states: &[&'static str],
    default_limit: Option<usize>,
) -> E2bResult<Response> {
    let states = q.states.unwrap_or_else(|| default_states.to_vec());
    let mut recs: Vec<Record> = Vec::new();
    for rec in st.store.list().await? {
        if !who.sees(rec.tenant.as_deref())
            || !matches!(rec.state, SandboxState::Running | SandboxState::Paused)
            || !states.contains(&state_of(&rec))
            || q.started_after_ms.is_some_and(|t| rec.created_at_ms < t)
            || q.template.as_ref().is_some_and(|t| *t != template_of(&rec))
            || !q
                .metadata
                .iter()
                .all(|(k, v)| rec.labels.get(k).is_some_and(|x| x == v))
        {
            continue;
        }
        recs.push(rec);
    }
    // Start time, then id: a total order, so a page's last (start, id) is the cursor.
    recs.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
    if !q.asc {
        recs.reverse();
    }
    if let Some((ms, id)) = &q.after {
        let cur = (*ms, id);
        recs.retain(|r| {
            let k = (r.created_at_ms, &r.id);
            if q.asc {
                k > cur
            } else {
                k < cur
            }
        });
    }
    let limit = q.limit.or(default_limit).unwrap_or(usize::MAX);
    let more = recs.len() > limit;
    recs.truncate(limit);
    let mut r = axum::Json(recs.iter().map(listed_json).collect::<Vec<_>>()).into_response();
    if let (true, Some(last)) = (more, recs.last()) {
        if let Ok(v) = format!("{}.{}", last.created_at_ms, last.id).parse() {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

/// `GET /v2/sandboxes` → `[ListedSandbox]` (running and paused unless `state` says).
pub async fn list_v2(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = parse_list_query(raw.as_deref())?;
    list_with(&st, &who, q, &["running", "paused"], Some(MAX_PAGE)).await
}

/// `GET /sandboxes` → `[ListedSandbox]` (running ones unless `state` says).
pub async fn list_v1(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = parse_list_query(raw.as_deref())?;
    list_with(&st, &who, q, &["running"], None).await
}

/// `GET /sandboxes/{id}` → `SandboxDetail`.
pub async fn get_one(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> E2bResult<Response> {
    let rec = visible(&st, &who, &id).await?;
    let mut v = listed_json(&rec);
    if let Some(k) = access_key(&st, &headers).await {
        v["trafficAccessToken"] = k.clone().into();
        v["envdAccessToken"] = k.into();
    }
    v["domain"] = serde_json::Value::Null;
    Ok(axum::Json(v).into_response())
}

/// `DELETE /sandboxes/{id}` → 204; 404 when unknown or already being deleted (the SDK's
/// `kill` then answers `False`).
pub async fn kill(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    visible(&st, &who, &id).await?;
    delete_sandbox(&st, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/timeout {"timeout": s}` → 204.
pub async fn timeout(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> E2bResult<StatusCode> {
    let b: TimeoutBody = body_of(&body)?;
    let t = b.timeout.ok_or_else(|| invalid("timeout is required"))?;
    visible(&st, &who, &id).await?;
    set_ttl(&st, &id, t).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/refreshes {"duration": s}` → 204 (TTL = now + duration, or the
/// sandbox's own TTL).
pub async fn refresh(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> E2bResult<StatusCode> {
    let b: TimeoutBody = body_of(&body)?;
    let rec = visible(&st, &who, &id).await?;
    set_ttl(&st, &id, b.duration.unwrap_or(rec.spec.ttl_s)).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn conflict(msg: String) -> E2bError {
    E2bError(ServerError::new(ErrorCode::Conflict, msg))
}

/// `POST /sandboxes/{id}/pause` → 204; 409 when already paused.
pub async fn pause(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let rec = visible(&st, &who, &id).await?;
    if rec.state == SandboxState::Paused {
        return Err(conflict(format!("sandbox {id} is already paused")));
    }
    match crate::pause::pause_one(st.clone(), id.clone()).await {
        Ok(Some(_)) => Ok(StatusCode::NO_CONTENT),
        Ok(None) => {
            let rec = visible(&st, &who, &id).await?;
            Err(conflict(format!(
                "sandbox {id} is {}, not running",
                rec.state.as_str()
            )))
        }
        Err(f) => Err(E2bError(ServerError::Api(f.error))),
    }
}

/// Resume `rec` when paused; returns whether it was.
async fn resume_if_paused(st: &SharedState, rec: &Record) -> E2bResult<bool> {
    match rec.state {
        SandboxState::Running => Ok(false),
        SandboxState::Paused => match crate::pause::resume_one(st.clone(), rec.id.clone()).await {
            Ok(Some(_)) => Ok(true),
            Ok(None) => Err(E2bError(ServerError::no_sandbox(&rec.id))),
            Err(f) => Err(E2bError(ServerError::Api(f.error))),
        },
        s => Err(conflict(format!("sandbox {} is {}", rec.id, s.as_str()))),
    }
}

/// `POST /sandboxes/{id}/resume {"timeout": s}` → 201 `Sandbox`; 409 when running.
pub async fn resume(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> E2bResult<Response> {
    let b: TimeoutBody = body_of(&body)?;
    let rec = visible(&st, &who, &id).await?;
    if rec.state == SandboxState::Running {
        return Err(conflict(format!("sandbox {id} is already running")));
    }
    resume_if_paused(&st, &rec).await?;
    let rec = set_ttl(&st, &id, b.timeout.unwrap_or(rec.spec.ttl_s)).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(sandbox_json(&st, &rec, access_key(&st, &headers).await)),
    )
        .into_response())
}

/// `POST /v2/sandboxes/{id}/connect {"timeout": s}` (and the older `/sandboxes/{id}/
/// connect`) → 200 `Sandbox` when it was running, 201 when it was paused and is resumed.
/// `timeout` sets the end to now + timeout, unless that would make a running sandbox's
/// end earlier (then the end stays).
pub async fn connect(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> E2bResult<Response> {
    let b: TimeoutBody = body_of(&body)?;
    let rec = visible(&st, &who, &id).await?;
    let resumed = resume_if_paused(&st, &rec).await?;
    // A running sandbox's end is only ever moved later (E2B's
    // `test_resume_does_not_shorten_timeout_on_running_sandbox`).
    let later = |t: u64| {
        resumed
            || rec
                .expires_at_ms
                .is_some_and(|e| e < crate::now_ms() + t as i64 * 1000)
    };
    let rec = match b.timeout {
        Some(t) if later(t) => set_ttl(&st, &id, t).await?,
        _ => visible(&st, &who, &id).await?,
    };
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        axum::Json(sandbox_json(&st, &rec, access_key(&st, &headers).await)),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_query() {
        let q = parse_list_query(Some(
            "metadata=user%3Dalice%26job%3D7&state=running,paused&limit=5",
        ))
        .unwrap();
        assert_eq!(
            q.metadata,
            vec![("user".into(), "alice".into()), ("job".into(), "7".into())]
        );
        assert_eq!(q.states, Some(vec!["running", "paused"]));
        assert_eq!(q.limit, Some(5));
        // What the e2b SDK 2.63.0 sends for {"job": "test_x[function] a&b=c/d%"}: each key
        // and value quoted, the pairs form-encoded, then the whole value form-encoded.
        let q = parse_list_query(Some(
            "metadata=job%3Dtest_x%25255Bfunction%25255D%252520a%252526b%25253Dc%252Fd%252525",
        ))
        .unwrap();
        assert_eq!(
            q.metadata,
            vec![("job".into(), "test_x[function] a&b=c/d%".into())]
        );
        let q = parse_list_query(Some(
            "order=asc&startedAfter=2026-12-05T12%3A00%3A00.5%2B00%3A00&template=base&nextToken=7.sb-1",
        ))
        .unwrap();
        assert!(q.asc);
        assert_eq!(q.started_after_ms, Some(1_796_472_000_500));
        assert_eq!(q.template.as_deref(), Some("base"));
        assert_eq!(q.after, Some((7, "sb-1".into())));
        for bad in [
            "order=up",
            "limit=0",
            "limit=101",
            "nextToken=x",
            "startedAfter=today",
        ] {
            assert!(parse_list_query(Some(bad)).is_err(), "{bad}");
        }
        assert!(parse_list_query(Some("state=gone")).is_err());
        assert!(parse_list_query(Some("bogus=1")).is_err());
        assert_eq!(parse_list_query(None).unwrap(), ListQuery::default());
    }
}
