//! `POST /v1/sandboxes:pause`, `POST /v1/sandboxes:resume` and `POST /v1/sandboxes:delete`:
//! job-level freeze, thaw and delete by label selector.
//!
//! Body `{"labels": {"k": "v", …}}` (AND of all pairs, at least one) → `{"sandboxes": [ids
//! affected], "failed": [{"id", "error"}]}` (`failed` only when non-empty). Pause takes
//! every matching `running` sandbox to `paused`: the record first (so new calls answer 409
//! "sandbox is paused" at once), then the node freezes its processes; when the node fails,
//! the record goes back to `running` and the sandbox is listed in `failed`. Resume thaws
//! every matching `paused` sandbox on the node first, then sets `running`. Sandboxes in other
//! states are not touched (and not listed), nor are other tenants' sandboxes ([`crate::auth`]).
//! Pause and resume handle the sandboxes of one call in chunks of at most [`LABEL_CHUNK`]
//! sandboxes of one node ([`LABEL_CHUNKS_IN_FLIGHT`] chunks at once): one registry write
//! per chunk for its state changes ([`crate::registry::Registry::transition_many`]; one
//! more for the failed ones of a pause), one write of the events database for its
//! `paused`/`resumed` audit events ([`crate::events::record_many`]), and ONE node call
//! for the chunk ([`sandlot_node_api::Node::pause_many`] / `resume_many`, per-id results:
//! a sandbox the node fails is listed in `failed`, the others go on). Delete runs
//! [`LABEL_CONCURRENCY`] one-sandbox deletes at a time. Each call runs in a task of its own
//! (a client that goes away does not leave a record `paused` over a running sandbox). The TTL keeps counting while paused; delete
//! works. Delete takes every matching sandbox in any state but `deleting` through the
//! one-sandbox delete (`DELETE /v1/sandboxes/{id}`); a node failure lists it in `failed`
//! (its record stays `deleting` and the reaper retries, as for a single delete).
use crate::auth::Principal;
use crate::error::{ApiResult, Json, ServerError};
use crate::store::Record;
use crate::SharedState;
use axum::extract::State;
use axum::Extension;
use sandlot_api::{ErrorCode, LabelSelector, PauseFailure, PauseResult, SandboxState};

/// Sandboxes of one label delete handled at once (each holds a registry connection and a
/// node call while it runs).
pub const LABEL_CONCURRENCY: usize = 64;

/// Sandboxes of a pause or resume by label whose state changes are one registry write.
pub const LABEL_CHUNK: usize = 256;

/// Chunks of one pause or resume by label in flight at once (so up to this ×
/// [`LABEL_CHUNK`] node calls).
pub const LABEL_CHUNKS_IN_FLIGHT: usize = 16;

/// Ids of the sandboxes whose state passes `state` matching `sel` that `who` may see (a
/// tenant's label call never touches another tenant's sandboxes, whatever their labels).
async fn matching(
    st: &SharedState,
    who: &Principal,
    sel: &LabelSelector,
    state: impl Fn(SandboxState) -> bool,
) -> ApiResult<Vec<String>> {
    Ok(matching_records(st, who, sel, state)
        .await?
        .into_iter()
        .map(|r| r.id)
        .collect())
}

/// [`matching`]'s records.
async fn matching_records(
    st: &SharedState,
    who: &Principal,
    sel: &LabelSelector,
    state: impl Fn(SandboxState) -> bool,
) -> ApiResult<Vec<Record>> {
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
    Ok(tally(outs))
}

/// The [`PauseResult`] of a label call's outcomes: changed ids (sorted) and failures.
fn tally(outs: impl IntoIterator<Item = Outcome>) -> PauseResult {
    let mut res = PauseResult::default();
    for o in outs {
        match o {
            Ok(Some(id)) => res.sandboxes.push(id),
            Ok(None) => {}
            Err(f) => res.failed.push(f),
        }
    }
    res.sandboxes.sort();
    res
}

/// One answer per sandbox of a label call: `Ok(Some(id))` changed, `Ok(None)` not touched
/// (its state changed meanwhile), `Err` failed.
type Outcome = Result<Option<String>, PauseFailure>;

/// The outcomes of the sandboxes of a chunk that a label call changed: their `kind`
/// (`paused`/`resumed`) audit events recorded in ONE write of the events database
/// ([`crate::events::record_many`]), or, when that write fails, each one failed with it
/// (the events wait in the queue).
fn changed_events(st: &SharedState, recs: &[&Record], kind: &'static str) -> Vec<Outcome> {
    if recs.is_empty() {
        return Vec::new();
    }
    let events = recs
        .iter()
        .map(|rec| {
            tracing::info!(sandbox_id = %rec.id, "sandbox {kind}");
            crate::events::NewEvent {
                kind,
                sandbox: Some(&rec.id),
                backend: Some(rec.backend),
                fields: Default::default(),
            }
        })
        .collect();
    match crate::events::record_many(st, events) {
        Ok(()) => recs.iter().map(|r| Ok(Some(r.id.clone()))).collect(),
        Err(e) => {
            let e = ServerError::from(e);
            recs.iter().map(|r| Err(failure(&r.id, &e))).collect()
        }
    }
}

/// The failure of sandbox `id` with `e`.
fn failure(id: &str, e: &ServerError) -> PauseFailure {
    PauseFailure {
        id: id.to_owned(),
        error: e.api_error(),
    }
}

/// Pause of one chunk of `running` records ([`pause_one`]'s protocol per sandbox): every
/// record `paused` in one write, the node pauses all at once, the records of those that
/// failed back to `running` in one write.
async fn pause_chunk(st: SharedState, recs: Vec<Record>) -> Vec<Outcome> {
    let ids: Vec<String> = recs.iter().map(|r| r.id.clone()).collect();
    let changed = match st
        .store
        .transition_many(&ids, &[SandboxState::Running], SandboxState::Paused, None)
        .await
    {
        Ok(c) => c,
        Err(e) => {
            let e = ServerError::from(e);
            return ids.iter().map(|id| Err(failure(id, &e))).collect();
        }
    };
    let paused: Vec<&Record> = recs
        .iter()
        .zip(&changed)
        .filter(|(_, c)| **c)
        .map(|(r, _)| r)
        .collect();
    let paused_ids: Vec<String> = paused.iter().map(|r| r.id.clone()).collect();
    let node = st.node.pause_many(&paused_ids).await;
    let mut out: Vec<Outcome> = changed
        .iter()
        .filter(|c| !**c)
        .map(|_| Ok(None)) // deleted or paused meanwhile
        .collect();
    let mut back = Vec::new();
    let mut done = Vec::with_capacity(paused.len());
    for (rec, res) in paused.into_iter().zip(node) {
        match res {
            Err(e) => {
                tracing::warn!(sandbox_id = %rec.id, error = %crate::error::chain(&e), "pause failed");
                let e = ServerError::from(e);
                crate::events::record_error(&st, "pause", Some(&rec.id), Some(rec.backend), &e);
                back.push(rec.id.clone());
                out.push(Err(failure(&rec.id, &e)));
            }
            Ok(()) => done.push(rec),
        }
    }
    out.extend(changed_events(&st, &done, "paused"));
    if !back.is_empty() {
        let undo = st
            .store
            .transition_many(&back, &[SandboxState::Paused], SandboxState::Running, None)
            .await;
        if let Err(e) = undo {
            tracing::error!(error = %crate::error::chain(&e), "records of failed pauses not set back to running");
        }
    }
    out
}

/// Resume of one chunk of `paused` records ([`resume_one`]'s protocol per sandbox): the
/// node resumes all at once, then the records of those resumed `running` in one write.
async fn resume_chunk(st: SharedState, recs: Vec<Record>) -> Vec<Outcome> {
    let ids: Vec<String> = recs.iter().map(|r| r.id.clone()).collect();
    let node = st.node.resume_many(&ids).await;
    let mut out = Vec::with_capacity(recs.len());
    let mut ok: Vec<&Record> = Vec::new();
    for (rec, res) in recs.iter().zip(node) {
        match res {
            Err(e) => {
                tracing::warn!(sandbox_id = %rec.id, error = %crate::error::chain(&e), "resume failed");
                if matches!(e, sandlot_node_api::NodeError::NotFound(_)) {
                    mark_lost_if_node_gone(&st, &rec.id, &e.to_string()).await;
                }
                let e = ServerError::from(e);
                crate::events::record_error(&st, "resume", Some(&rec.id), Some(rec.backend), &e);
                out.push(Err(failure(&rec.id, &e)));
            }
            Ok(()) => {
                // Cluster mode: taken over by another node (its route says so).
                let elsewhere = st
                    .cluster
                    .get()
                    .and_then(|c| c.route_of(&rec.id))
                    .is_some_and(|to| to != rec.node);
                if elsewhere {
                    moved(&st, &rec.id).await;
                }
                ok.push(rec);
            }
        }
    }
    let ids: Vec<String> = ok.iter().map(|r| r.id.clone()).collect();
    if ids.is_empty() {
        return out;
    }
    match st
        .store
        .transition_many(&ids, &[SandboxState::Paused], SandboxState::Running, None)
        .await
    {
        Err(e) => {
            let e = ServerError::from(e);
            out.extend(ids.iter().map(|id| Err(failure(id, &e))));
        }
        Ok(changed) => {
            let mut done = Vec::with_capacity(ok.len());
            for (rec, c) in ok.into_iter().zip(changed) {
                if c {
                    done.push(rec);
                } else {
                    out.push(Ok(None)); // deleted meanwhile
                }
            }
            out.extend(changed_events(&st, &done, "resumed"));
        }
    }
    out
}

/// Runs `f` over `recs` in chunks of at most [`LABEL_CHUNK`] records of one node each
/// (so a chunk's node call is one [`sandlot_node_api::Node::pause_many`] /
/// `resume_many` to one node), [`LABEL_CHUNKS_IN_FLIGHT`] at once, in a task of its own;
/// the ids changed (sorted) and the failures.
async fn run_chunks<F, Fut>(st: &SharedState, recs: Vec<Record>, f: F) -> ApiResult<PauseResult>
where
    F: Fn(SharedState, Vec<Record>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Vec<Outcome>> + Send + 'static,
{
    use futures::StreamExt;
    let st = st.clone();
    let mut by_node: std::collections::BTreeMap<String, Vec<Record>> = Default::default();
    for r in recs {
        crate::sandboxes::follow_record(&st, &r);
        by_node.entry(r.node.clone()).or_default().push(r);
    }
    let mut chunks: Vec<Vec<Record>> = Vec::new();
    for recs in by_node.into_values() {
        let mut recs = recs.into_iter().peekable();
        while recs.peek().is_some() {
            chunks.push(recs.by_ref().take(LABEL_CHUNK).collect());
        }
    }
    let runs = futures::stream::iter(chunks)
        .map(move |c| f(st.clone(), c))
        .buffer_unordered(LABEL_CHUNKS_IN_FLIGHT)
        .collect::<Vec<_>>();
    let outs = tokio::spawn(runs)
        .await
        .map_err(|e| ServerError::new(ErrorCode::Internal, format!("pause task failed: {e}")))?;
    Ok(tally(outs.into_iter().flatten()))
}

/// `POST /v1/sandboxes:pause` → `PauseResult` (see module docs).
pub async fn pause(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Json(sel): Json<LabelSelector>,
) -> ApiResult<Json<PauseResult>> {
    let recs = matching_records(&st, &who, &sel, |s| s == SandboxState::Running).await?;
    Ok(Json(run_chunks(&st, recs, pause_chunk).await?))
}

/// `POST /v1/sandboxes:resume` → `PauseResult` (see module docs).
pub async fn resume(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Json(sel): Json<LabelSelector>,
) -> ApiResult<Json<PauseResult>> {
    let recs = matching_records(&st, &who, &sel, |s| s == SandboxState::Paused).await?;
    Ok(Json(run_chunks(&st, recs, resume_chunk).await?))
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
