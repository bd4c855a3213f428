//! `POST /v1/sandboxes:pause`, `POST /v1/sandboxes:resume` and `POST /v1/sandboxes:delete`:
//! job-level freeze, thaw and delete by label selector.
//!
//! Body `{"labels": {"k": "v", …}}` (AND of all pairs, at least one) → `{"sandboxes": [ids
//! affected], "failed": [{"id", "error"}]}` (`failed` only when non-empty). Pause takes
//! every matching `running` sandbox to `paused`: the record first (so new calls answer 409
//! "sandbox is paused" at once), then the node freezes its processes; when the node fails,
//! the record goes back to `running` and the sandbox is listed in `failed`. Resume thaws
//! every matching `paused` sandbox on the node first, then sets `running`. Sandboxes in other
//! states are not touched (and not listed), nor are other tenants' sandboxes ([`crate::auth`]). The sandboxes of one call are handled
//! concurrently ([`LABEL_CONCURRENCY`] at a time, so a 32k job never asks the registry for
//! 32k connections at once), in a task of their own (a client that goes away does not leave
//! a record `paused` over a running sandbox). The TTL keeps counting while paused; delete
//! works. Delete takes every matching sandbox in any state but `deleting` through the
//! one-sandbox delete (`DELETE /v1/sandboxes/{id}`); a node failure lists it in `failed`
//! (its record stays `deleting` and the reaper retries, as for a single delete).
use crate::auth::Principal;
use crate::error::{ApiResult, Json, ServerError};
use crate::SharedState;
use axum::extract::State;
use axum::Extension;
use sandlot_api::{ErrorCode, LabelSelector, PauseFailure, PauseResult, SandboxState};

/// Sandboxes of one label call handled at once (each holds a registry connection and a node
/// call while it runs).
pub const LABEL_CONCURRENCY: usize = 64;

/// Ids of the sandboxes whose state passes `state` matching `sel` that `who` may see (a
/// tenant's label call never touches another tenant's sandboxes, whatever their labels).
async fn matching(
    st: &SharedState,
    who: &Principal,
    sel: &LabelSelector,
    state: impl Fn(SandboxState) -> bool,
) -> ApiResult<Vec<String>> {
    if sel.labels.is_empty() {
        return Err(ServerError::invalid(
            "labels must hold at least one k: v pair (an empty selector would match every sandbox)",
        ));
    }
    Ok(st
        .store
        .list_labeled(&sel.labels)
        .await?
        .into_iter()
        .filter(|r| state(r.state) && who.sees(r.tenant.as_deref()))
        .map(|r| r.id)
        .collect())
}

/// Backend of a sandbox for its event (one store read; `None` when gone).
async fn backend_of(st: &SharedState, id: &str) -> Option<sandlot_api::Backend> {
    st.store.get(id).await.ok().flatten().map(|r| r.backend)
}

/// Pause one `running` sandbox (the protocol of the module docs); `Ok(None)` when it was not
/// running (gone or paused meanwhile).
pub(crate) async fn pause_one(st: SharedState, id: String) -> Result<Option<String>, PauseFailure> {
    let fail = |e: ServerError| PauseFailure {
        id: id.clone(),
        error: e.api_error(),
    };
    match st
        .store
        .transition(&id, &[SandboxState::Running], SandboxState::Paused)
        .await
    {
        Ok(true) => {}
        Ok(false) => return Ok(None), // deleted or paused meanwhile
        Err(e) => return Err(fail(e.into())),
    }
    if let Err(e) = st.node.pause(&id).await {
        tracing::warn!(sandbox_id = %id, error = %crate::error::chain(&e), "pause failed");
        let _ = st
            .store
            .transition(&id, &[SandboxState::Paused], SandboxState::Running)
            .await;
        let e = ServerError::from(e);
        crate::events::record_error(&st, "pause", Some(&id), backend_of(&st, &id).await, &e);
        return Err(fail(e));
    }
    tracing::info!(sandbox_id = %id, "sandbox paused");
    crate::events::record(
        &st,
        "paused",
        Some(&id),
        backend_of(&st, &id).await,
        Default::default(),
    )
    .map_err(|e| fail(e.into()))?;
    Ok(Some(id))
}

/// Resume one `paused` sandbox; `Ok(None)` when it was deleted meanwhile.
pub(crate) async fn resume_one(
    st: SharedState,
    id: String,
) -> Result<Option<String>, PauseFailure> {
    let fail = |e: ServerError| PauseFailure {
        id: id.clone(),
        error: e.api_error(),
    };
    if let Err(e) = st.node.resume(&id).await {
        tracing::warn!(sandbox_id = %id, error = %crate::error::chain(&e), "resume failed");
        if matches!(e, sandlot_node_api::NodeError::NotFound(_)) {
            mark_lost_if_node_gone(&st, &id, &e.to_string()).await;
        }
        let e = ServerError::from(e);
        crate::events::record_error(&st, "resume", Some(&id), backend_of(&st, &id).await, &e);
        return Err(fail(e));
    }
    moved(&st, &id).await;
    match st
        .store
        .transition(&id, &[SandboxState::Paused], SandboxState::Running)
        .await
    {
        Ok(true) => {
            tracing::info!(sandbox_id = %id, "sandbox resumed");
            let b = backend_of(&st, &id).await;
            crate::events::record(&st, "resumed", Some(&id), b, Default::default())
                .map_err(|e| fail(e.into()))?;
            Ok(Some(id))
        }
        Ok(false) => Ok(None), // deleted meanwhile
        Err(e) => Err(fail(e.into())),
    }
}

/// Cluster mode: after a resume, when the sandbox now runs on another node than its record
/// says (taken over from the shared snapshot store), the record follows it (a `moved`
/// event with `from` and `to`).
async fn moved(st: &SharedState, id: &str) {
    let Some(cluster) = st.cluster.get() else {
        return;
    };
    let Some(to) = cluster.route_of(id) else {
        return;
    };
    let Ok(Some(rec)) = st.store.get(id).await else {
        return;
    };
    if rec.node == to {
        return;
    }
    match st.store.set_node(id, &to).await {
        Ok(true) => {
            tracing::info!(sandbox_id = %id, from = %rec.node, %to, "sandbox moved to another node");
            let mut f = serde_json::Map::new();
            f.insert("from".into(), rec.node.clone().into());
            f.insert("to".into(), to.clone().into());
            crate::events::record_queued(st, "moved", Some(id), Some(rec.backend), f);
        }
        Ok(false) => {}
        Err(e) => {
            tracing::error!(sandbox_id = %id, error = %e, "record's node not updated after a move")
        }
    }
}

/// Cluster mode: a paused sandbox whose node left the cluster and that no node could take
/// over from the shared snapshot store becomes `lost` (with `reason`).
async fn mark_lost_if_node_gone(st: &SharedState, id: &str, reason: &str) {
    let Some(cluster) = st.cluster.get() else {
        return;
    };
    let Ok(Some(rec)) = st.store.get(id).await else {
        return;
    };
    if cluster.nodes().contains_key(&rec.node) {
        return;
    }
    if let Ok(true) = st
        .store
        .transition(id, &[SandboxState::Paused], SandboxState::Lost)
        .await
    {
        let mut f = serde_json::Map::new();
        f.insert("reason".into(), reason.into());
        crate::events::record_queued(st, "lost", Some(id), Some(rec.backend), f);
    }
}

async fn run_all<F, Fut>(st: &SharedState, ids: Vec<String>, f: F) -> ApiResult<PauseResult>
where
    F: Fn(SharedState, String) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<Option<String>, PauseFailure>> + Send + 'static,
{
    use futures::StreamExt;
    let st = st.clone();
    let runs = futures::stream::iter(ids)
        .map(move |id| f(st.clone(), id))
        .buffer_unordered(LABEL_CONCURRENCY)
        .collect::<Vec<_>>();
    let outs = tokio::spawn(runs)
        .await
        .map_err(|e| ServerError::new(ErrorCode::Internal, format!("pause task failed: {e}")))?;
    let mut res = PauseResult::default();
    for o in outs {
        match o {
            Ok(Some(id)) => res.sandboxes.push(id),
            Ok(None) => {}
            Err(f) => res.failed.push(f),
        }
    }
    res.sandboxes.sort();
    Ok(res)
}

/// `POST /v1/sandboxes:pause` → `PauseResult` (see module docs).
pub async fn pause(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Json(sel): Json<LabelSelector>,
) -> ApiResult<Json<PauseResult>> {
    let ids = matching(&st, &who, &sel, |s| s == SandboxState::Running).await?;
    Ok(Json(run_all(&st, ids, pause_one).await?))
}

/// `POST /v1/sandboxes:resume` → `PauseResult` (see module docs).
pub async fn resume(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Json(sel): Json<LabelSelector>,
) -> ApiResult<Json<PauseResult>> {
    let ids = matching(&st, &who, &sel, |s| s == SandboxState::Paused).await?;
    Ok(Json(run_all(&st, ids, resume_one).await?))
}

/// Delete one sandbox for [`delete`] (one gone meanwhile counts as deleted, as for
/// `DELETE /v1/sandboxes/{id}`).
async fn delete_one(st: SharedState, id: String) -> Result<Option<String>, PauseFailure> {
    match crate::sandboxes::delete_sandbox(&st, &id).await {
        Ok(()) => Ok(Some(id)),
        Err(e) => Err(PauseFailure {
            id,
            error: e.api_error(),
        }),
    }
}

/// `POST /v1/sandboxes:delete` → `PauseResult`: the ids deleted, and `failed` (see module
/// docs).
pub async fn delete(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Json(sel): Json<LabelSelector>,
) -> ApiResult<Json<PauseResult>> {
    let ids = matching(&st, &who, &sel, |s| s != SandboxState::Deleting).await?;
    Ok(Json(run_all(&st, ids, delete_one).await?))
}
