//! `/v1/sandboxes`: create, list, get, delete, keepalive.
//!
//! Create protocol (nothing half-created is left behind):
//! 1. validate and fill defaults; 2. insert the record in state `creating` (and the
//!    `Idempotency-Key`, same transaction); 3. `node.create`; 4. compare-and-set
//!    `creating → running`. On a node error the record and key are removed and the node's
//!    error is answered. When a `DELETE` arrived during step 3, step 4 fails: the sandbox is
//!    deleted on the node, the record removed, and the creator gets **409 conflict**
//!    ("deleted while being created"). The work runs in its own task, so a client that
//!    disconnects mid-create does not interrupt the protocol.
//!
//! Idempotency: a create with `Idempotency-Key: K` whose body (as parsed JSON, canonical
//! form) equals the first request with K answers **200** with the sandbox made by that first
//! request, in its current state (also `creating` while it is still in flight); another
//! body under K → **409 conflict**; when the first sandbox is already gone → **404
//! not_found**. Keys are kept 24 h (`ServerConfig::idempotency_ttl`); a create that failed
//! forgets its key so a retry creates again. Keys are scoped per tenant: the same key used
//! by two API keys names two different creates.
//!
//! Tenants ([`crate::auth`]): a create records the caller's tenant and is checked against
//! its quota in the same transaction as the insert (over it → 429 `resource_exhausted`,
//! nothing created); list shows only the caller's sandboxes (an admin sees all).
use crate::auth::Principal;
use crate::error::{ApiResult, Json, Path, Query, ServerError};
use crate::store::{KeyOutcome, Record, SpecJson};
use crate::{now_ms, SharedState};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Extension;
use sandlot_api::{
    Backend, CreateSandboxRequest, ErrorCode, KeepaliveRequest, Sandbox, SandboxList, SandboxState,
    SandboxSummary, StateCount,
};
use sandlot_node_api::{NodeError, SandboxSpec};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// Largest TTL: one week, in seconds.
pub const MAX_TTL_S: u64 = 604_800;
/// Label keys a client may not set: Sandlot's own (`sandlot.kind=run_code` marks the
/// ephemeral sandbox of a `run_code` call, which a restart deletes).
pub const RESERVED_LABEL_PREFIX: &str = "sandlot.";

/// Most entries in `env` or `labels`.
pub const MAX_MAP_ENTRIES: usize = 256;
/// Longest key of `env` or `labels`, bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Longest `env` value, bytes.
pub const MAX_ENV_VALUE_BYTES: usize = 32 * 1024;
/// Longest label value, bytes.
pub const MAX_LABEL_VALUE_BYTES: usize = 1024;
/// Default image.
pub const DEFAULT_IMAGE: &str = "python";

/// Create parameters after validation, defaults filled.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    /// Image name.
    pub image: String,
    /// Everything else stored in the record's `spec`.
    pub spec: SpecJson,
}

fn range<T: PartialOrd + std::fmt::Display + Copy>(name: &str, v: T, lo: T, hi: T) -> ApiResult<T> {
    if v >= lo && v <= hi {
        Ok(v)
    } else {
        Err(ServerError::invalid(format!(
            "{name} = {v} is out of range [{lo}, {hi}]"
        )))
    }
}

fn check_map(name: &str, m: &BTreeMap<String, String>, max_value: usize) -> ApiResult<()> {
    if m.len() > MAX_MAP_ENTRIES {
        return Err(ServerError::invalid(format!(
            "{name} has {} entries; at most {MAX_MAP_ENTRIES}",
            m.len()
        )));
    }
    for (k, v) in m {
        // '=' would make `KEY=VALUE` (env) and `label=k=v` (filters) ambiguous; NUL cannot
        // pass through execve.
        if k.is_empty() || k.len() > MAX_KEY_BYTES || k.contains(['=', '\0']) {
            return Err(ServerError::invalid(format!(
                "{name} key {k:?} must be 1–{MAX_KEY_BYTES} bytes without '=' or NUL"
            )));
        }
        if v.len() > max_value || v.contains('\0') {
            return Err(ServerError::invalid(format!(
                "{name} value of {k:?} must be at most {max_value} bytes without NUL"
            )));
        }
    }
    Ok(())
}

/// Image names reach host paths on the node: one rule for server and node, the node's
/// [`sandlot_node::validate_image_ref`] (a short name `[a-z0-9][a-z0-9._-]{0,63}` or an OCI
/// reference such as `127.0.0.1:5000/sandlot/python:latest`), so no name can walk out of the
/// image store and both sides answer with the same message.
fn check_image(name: &str) -> ApiResult<()> {
    sandlot_node::validate_image_ref(name).map_err(ServerError::from)
}

/// Validate a create request and fill defaults (image `python`, cpu 1, memory 512 MiB,
/// disk 1024 MiB, pids 256, ttl 600 s).
///
/// # Errors
/// `invalid_argument` for out-of-range values, oversized maps, a bad trajectory id, or
/// `restore` without `trajectory`.
pub fn validate(req: &CreateSandboxRequest) -> ApiResult<Validated> {
    match &req.trajectory {
        Some(t) => crate::trajectory::check_id(t)?,
        None if req.restore.is_some() => {
            return Err(ServerError::invalid(
                "restore is only valid with trajectory",
            ))
        }
        None => {}
    }
    let image = req
        .image
        .clone()
        .unwrap_or_else(|| DEFAULT_IMAGE.to_owned());
    check_image(&image)?;
    let cpu = req.cpu.unwrap_or(1.0);
    if !cpu.is_finite() {
        return Err(ServerError::invalid("cpu must be a finite number"));
    }
    let spec = SpecJson {
        cpu: range("cpu", cpu, 0.01, 64.0)?,
        memory_mib: range("memory_mib", req.memory_mib.unwrap_or(512), 16, 65536)?,
        disk_mib: range("disk_mib", req.disk_mib.unwrap_or(1024), 16, 1 << 20)?,
        pids_max: range("pids_max", req.pids_max.unwrap_or(256), 8, 65536)?,
        ttl_s: range("ttl_s", req.ttl_s.unwrap_or(600), 0, MAX_TTL_S)?,
        env: req.env.clone(),
        network: req.network.clone(),
        runtime: check_runtime(req)?,
        accel: None,
        trajectory: req.trajectory.clone(),
        checkpoint: req.checkpoint.clone(),
    };
    req.network.check().map_err(ServerError::invalid)?;
    check_map("env", &spec.env, MAX_ENV_VALUE_BYTES)?;
    check_map("labels", &req.labels, MAX_LABEL_VALUE_BYTES)?;
    if let Some(k) = req
        .labels
        .keys()
        .find(|k| k.starts_with(RESERVED_LABEL_PREFIX))
    {
        return Err(ServerError::invalid(format!(
            "labels key {k:?}: the prefix {RESERVED_LABEL_PREFIX:?} is reserved for labels \
             Sandlot sets itself"
        )));
    }
    Ok(Validated { image, spec })
}

/// The OCI runtime of a create: only for `backend: "container"`, one of runc / crun / runsc;
/// absent = the node's default (filled in by the create).
fn check_runtime(req: &CreateSandboxRequest) -> ApiResult<Option<String>> {
    match (req.backend, req.runtime.as_deref()) {
        (Backend::Container, None) => Ok(None),
        (Backend::Container, Some(r @ ("runc" | "crun" | "runsc"))) => Ok(Some(r.to_string())),
        (Backend::Container, Some(r)) => Err(ServerError::invalid(format!(
            "unknown runtime {r:?}: expected \"runc\", \"crun\" or \"runsc\""
        ))),
        (_, None) => Ok(None),
        (b, Some(_)) => Err(ServerError::invalid(format!(
            "runtime is only valid with backend \"container\", not {b}"
        ))),
    }
}

/// A fresh sandbox id: `sb-` + 20 lowercase hex digits (80 random bits).
pub fn new_id() -> String {
    let bytes: [u8; 10] = rand::random();
    let mut s = String::from("sb-");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn digest(req: &CreateSandboxRequest) -> String {
    // Canonical form: serde output of the parsed request (maps are BTreeMaps, so ordered);
    // whitespace and key order of the client's JSON do not matter.
    let json = serde_json::to_vec(req).expect("request serializes");
    Sha256::digest(&json)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Create a sandbox for `who` (the whole protocol of the module docs). Returns the record
/// and whether it was created now (`false`: an idempotent replay).
///
/// # Errors
/// Validation errors, 409/404 for idempotency conflicts or a concurrent delete, 429
/// `resource_exhausted` over `who`'s quota, the node's error when it could not create.
pub async fn create_sandbox(
    st: &SharedState,
    who: &Principal,
    req: CreateSandboxRequest,
    labels_extra: BTreeMap<String, String>,
    idempotency_key: Option<String>,
) -> ApiResult<(Record, bool)> {
    let p = match prepare_create(st, who, req, labels_extra, idempotency_key).await? {
        Prep::Ready(p) => p,
        Prep::Done(answer) => return Ok(answer),
    };
    let key = p.key.as_ref().map(|(k, d)| (k.as_str(), d.as_str()));
    // The record goes in with this server's transition claim (one write, not two).
    let inserted = st
        .store
        .insert_many(
            &[(&p.rec, key, who.quota.as_ref())],
            Some(crate::leader::claim(st)),
        )
        .await
        .and_then(|v| v.into_iter().next().expect("one outcome per item"));
    settle_create(st, p, inserted.map_err(ServerError::from)).await
}

/// A create that passed validation and placement (steps 1 and the node's choice), its
/// record not written yet.
struct Prepared {
    /// The record to insert, state `creating`.
    rec: Record,
    /// `(per-tenant Idempotency-Key, request digest)`.
    key: Option<(String, String)>,
    /// The cluster placement, forgotten when the create stops before the node is asked.
    placed: Unassign,
}

/// What [`prepare_create`] ends with.
enum Prep {
    /// Ready for the insert.
    Ready(Prepared),
    /// Answered without a write: a retry under an Idempotency-Key whose sandbox exists,
    /// while no node could take a new one.
    Done((Record, bool)),
}

/// Step 1 of a create and its placement: validate, fill defaults, refuse below the disk
/// reserve, pick the node (cluster mode) and build the record.
///
/// # Errors
/// As [`create_sandbox`] before its insert.
async fn prepare_create(
    st: &SharedState,
    who: &Principal,
    req: CreateSandboxRequest,
    labels_extra: BTreeMap<String, String>,
    idempotency_key: Option<String>,
) -> ApiResult<Prep> {
    let mut v = validate(&req)?;
    // Refused before anything is written: below the data directory's free-space reserve,
    // or while audit events cannot be written (disk_reserve and events module docs).
    crate::disk_reserve::check(st)?;
    st.events.ready()?;
    if req.backend == Backend::Container && v.spec.runtime.is_none() {
        v.spec.runtime = Some(st.cfg.default_runtime.clone());
    }
    let mut labels = req.labels.clone();
    labels.extend(labels_extra);
    let id = new_id();
    let d = digest(&req);
    // Per-tenant key space: another tenant's key must neither replay nor block this create.
    let scoped_key = idempotency_key.map(|k| match &who.tenant {
        Some(t) => format!("{t}/{k}"),
        None => k,
    });
    let node = match st.cluster.get() {
        // Cluster mode: pick the node before the record is written, so the record names
        // it; nothing fits → 429 `resource_exhausted` at once — unless the request carries
        // an Idempotency-Key that already made a sandbox: a retry of a create that was
        // made answers its sandbox even while no node could take a new one.
        Some(c) => {
            let placed = match c.assign(&id, &placement_request(&req, &v, &labels, c).await?) {
                Ok(p) => p,
                Err(e) => {
                    if let Some(k) = scoped_key.as_deref() {
                        if let Some((kd, sid)) = st.store.key_sandbox(k).await? {
                            if kd != d {
                                return Err(ServerError::new(
                                    ErrorCode::Conflict,
                                    "Idempotency-Key was already used with a different request body",
                                ));
                            }
                            if let Some(r) = st.store.get(&sid).await? {
                                return Ok(Prep::Done((r, false)));
                            }
                        }
                    }
                    return Err(e.into());
                }
            };
            if matches!(req.backend, Backend::Microvm | Backend::Vm) {
                v.spec.accel = placed.accelerator;
            }
            placed.node
        }
        None => {
            if matches!(req.backend, Backend::Microvm | Backend::Vm) {
                // Decided once per node process (a start-up probe); waits for it if still
                // running.
                v.spec.accel = st.node.accel().await;
            }
            st.node_name.clone()
        }
    };
    let placed = Unassign(st.cluster.get().cloned(), id.clone());
    let now = now_ms();
    let rec = Record {
        id,
        backend: req.backend,
        image: v.image,
        state: SandboxState::Creating,
        node,
        created_at_ms: now,
        expires_at_ms: (v.spec.ttl_s > 0).then(|| now + v.spec.ttl_s as i64 * 1000),
        spec: v.spec,
        labels,
        tenant: who.tenant.clone(),
    };
    Ok(Prep::Ready(Prepared {
        rec,
        key: scoped_key.map(|k| (k, d)),
        placed,
    }))
}

/// Everything of a create after its insert (`inserted`: the insert's outcome): answer a
/// quota refusal, replay or key mismatch, else run the node's create and settle the record
/// in a task of its own (a dropped request future must not stop between the node's create
/// and the record update).
///
/// # Errors
/// As [`create_sandbox`] from its insert on.
async fn settle_create(
    st: &SharedState,
    p: Prepared,
    inserted: ApiResult<KeyOutcome>,
) -> ApiResult<(Record, bool)> {
    let rec = match admit(st, p, inserted).await? {
        Admitted::Go(rec) => rec,
        Admitted::Replayed(r) => return Ok((r, false)),
    };
    // Own task: a dropped request future must not stop between the node's create and the
    // record update.
    let st2 = st.clone();
    st.creating_set().insert(rec.id.clone());
    tokio::spawn(async move {
        let id = rec.id.clone();
        // This server owns the create until it is done ([`crate::leader`]; claimed with
        // the insert): should it die mid-call, the leader rolls the record back once the
        // deadline has passed.
        let mut held = Some(crate::leader::held(&st2, &id));
        let out = finish_create(&st2, rec, &mut held).await;
        if let Some(h) = held {
            h.release().await;
        }
        st2.creating_set().remove(&id);
        out
    })
    .await
    .map_err(|e| ServerError::new(ErrorCode::Internal, format!("create task failed: {e}")))?
}

/// What [`admit`] ends with.
enum Admitted {
    /// Inserted: the node's create is next.
    Go(Record),
    /// The Idempotency-Key's sandbox, created before (answered 200).
    Replayed(Record),
}

/// The insert's outcome `inserted` of a prepared create: a quota refusal (429), key
/// mismatch (409) or error, a replay, or the record to create on its node (its cluster
/// placement kept, its owner known to the event log).
///
/// # Errors
/// As [`create_sandbox`] from its insert to the node's create.
async fn admit(
    st: &SharedState,
    p: Prepared,
    inserted: ApiResult<KeyOutcome>,
) -> ApiResult<Admitted> {
    let Prepared {
        rec, mut placed, ..
    } = p;
    match inserted? {
        KeyOutcome::Inserted => {}
        KeyOutcome::OverQuota(msg) => {
            // RetryAfter marks it as the caller's own limit (run_code answers it as HTTP
            // 429 instead of a `SandboxError` verdict).
            return Err(ServerError::RetryAfter {
                error: sandlot_api::ApiError::new(ErrorCode::ResourceExhausted, msg),
                seconds: 1,
            });
        }
        KeyOutcome::Replay(sid) => {
            return match st.store.get(&sid).await? {
                Some(r) => Ok(Admitted::Replayed(r)),
                None => Err(ServerError::new(
                    ErrorCode::NotFound,
                    format!("sandbox {sid} created under this Idempotency-Key is gone"),
                )),
            };
        }
        KeyOutcome::Mismatch => {
            return Err(ServerError::new(
                ErrorCode::Conflict,
                "Idempotency-Key was already used with a different request body",
            ))
        }
    }
    placed.0 = None; // the create below owns the route now
    st.events.set_owner(&rec.id, rec.tenant.as_deref());
    Ok(Admitted::Go(rec))
}

/// Forgets a cluster placement (of the sandbox id) when the create stops before the node
/// is asked (quota, idempotent replay, store error).
struct Unassign(Option<std::sync::Arc<crate::cluster::ClusterNode>>, String);

impl Drop for Unassign {
    fn drop(&mut self) {
        if let Some(c) = &self.0 {
            c.unassign(&self.1);
        }
    }
}

/// The placement request of a create in cluster mode: backend, runtime, cpu, memory, image
/// (locality), the `job` label; a fork is placed on its checkpoint's node.
async fn placement_request(
    req: &CreateSandboxRequest,
    v: &Validated,
    labels: &BTreeMap<String, String>,
    c: &crate::cluster::ClusterNode,
) -> ApiResult<crate::placement::Request> {
    let checkpoint_node = match &v.spec.checkpoint {
        Some(ck) => Some(c.checkpoint_node(ck).await?),
        None => None,
    };
    Ok(crate::placement::Request {
        backend: req.backend,
        runtime: v.spec.runtime.clone(),
        accelerator: None,
        cpu: v.spec.cpu,
        memory_mib: v.spec.memory_mib,
        image: Some(v.image.clone()),
        layers: Vec::new(),
        job: labels.get(crate::cluster::JOB_LABEL).cloned(),
        checkpoint_node,
    })
}

/// Runs the node's create and settles the record. With `held`, the success path marks the
/// record `running` and clears this server's claim in one write, taking `held` (disarmed);
/// on every other path `held` stays for the caller to release.
async fn finish_create(
    st: &SharedState,
    rec: Record,
    held: &mut Option<crate::leader::Hold>,
) -> ApiResult<(Record, bool)> {
    let id = rec.id.clone();
    if let Err(e) = node_create(st, &rec).await {
        return Err(create_failed(st, &id, rec.backend, e).await);
    }
    let creating = [SandboxState::Creating];
    let running = match held.as_ref() {
        Some(h) => {
            // No heartbeat may re-claim the record after the write below clears the owner.
            h.stop_beat();
            let owner = h.owner().to_owned();
            let changed = st
                .store
                .transition_release(&id, &creating, SandboxState::Running, &owner)
                .await?;
            if changed {
                if let Some(h) = held.take() {
                    h.disarm();
                }
            }
            changed
        }
        None => {
            st.store
                .transition(&id, &creating, SandboxState::Running)
                .await?
        }
    };
    if running {
        return now_running(st, rec).await;
    }
    deleted_while_creating(st, &id).await
}

/// The node's create of record `rec` (the metrics' create time included).
async fn node_create(st: &SharedState, rec: &Record) -> Result<(), NodeError> {
    let spec = SandboxSpec {
        id: rec.id.clone(),
        backend: rec.backend,
        image: rec.image.clone(),
        cpu: rec.spec.cpu,
        memory_mib: rec.spec.memory_mib,
        disk_mib: rec.spec.disk_mib,
        pids_max: rec.spec.pids_max,
        env: rec.spec.env.clone(),
        network: rec.spec.network.clone(),
        runtime: rec.spec.runtime.clone(),
    };
    let started = std::time::Instant::now();
    let created = match &rec.spec.checkpoint {
        Some(ck) => st.node.create_from_checkpoint(&spec, ck).await,
        None => st.node.create(&spec).await,
    };
    st.metrics
        .create_done(rec.backend, started.elapsed().as_secs_f64());
    created
}

/// After the node's create of sandbox `id` failed with `e`: its Idempotency-Keys are
/// forgotten and its record removed — or, when the outcome is unknown (a transport
/// error), kept as `deleting` so the reaper deletes it on the node. Returns the error to
/// answer (a store failure on the way replaces `e`).
async fn create_failed(
    st: &SharedState,
    id: &str,
    backend: sandlot_api::Backend,
    e: NodeError,
) -> ServerError {
    let outcome_unknown = matches!(e, NodeError::Transport(_));
    let undo = async {
        st.store.forget_keys_of(id).await?;
        if outcome_unknown {
            // The sandbox may exist on the node: keep the record as `deleting` (no longer
            // counted against the quota) so the reaper deletes it there, then the record.
            tracing::warn!(sandbox_id = %id, error = %crate::error::chain(&e), "create's outcome unknown; the reaper deletes it");
            let all = [SandboxState::Creating, SandboxState::Deleting];
            st.store
                .transition(id, &all, SandboxState::Deleting)
                .await?;
        } else {
            tracing::info!(sandbox_id = %id, error = %crate::error::chain(&e), "create failed; record removed");
            st.store.remove(id).await?;
        }
        Ok::<(), crate::store::StoreError>(())
    };
    if let Err(se) = undo.await {
        return se.into();
    }
    let e = ServerError::from(e);
    crate::events::record_error(st, "create", Some(id), Some(backend), &e);
    if !outcome_unknown {
        st.events.forget_owner(id); // else the reaper's `deleted` event ends it
    }
    e
}

/// A create whose record just became `running`: its `created` event, or (when that event
/// cannot be written) the sandbox deleted again and the call failed.
async fn now_running(st: &SharedState, mut rec: Record) -> ApiResult<(Record, bool)> {
    let id = rec.id.clone();
    {
        tracing::info!(sandbox_id = %id, backend = %rec.backend, image = %rec.image, "sandbox running");
        let mut f = serde_json::Map::new();
        f.insert("image".into(), rec.image.clone().into());
        if let Err(e) = crate::events::record(st, "created", Some(&id), Some(rec.backend), f) {
            // No sandbox without its audit event: roll the create back, fail the call.
            tracing::warn!(sandbox_id = %id, error = %e, "create rolled back: its event is not durable");
            if let Err(de) = delete_sandbox(st, &id).await {
                tracing::error!(sandbox_id = %id, error = %crate::error::chain(&de), "rollback delete failed; the reaper retries");
            }
            return Err(e.into());
        }
        rec.state = SandboxState::Running;
        Ok((rec, true))
    }
}

/// A create whose record was no longer `creating` once the node had made the sandbox: a
/// DELETE came meanwhile, so the sandbox is deleted on the node and its record removed;
/// answers 409 `conflict`.
async fn deleted_while_creating(st: &SharedState, id: &str) -> ApiResult<(Record, bool)> {
    let id = id.to_owned();
    // A DELETE came while the node was creating: finish its job.
    tracing::info!(sandbox_id = %id, "deleted while being created; rolling back");
    if let Err(e) = st.node.delete(&id).await {
        tracing::error!(sandbox_id = %id, error = %crate::error::chain(&e), "rollback delete failed; the reaper retries");
        return Err(e.into());
    }
    st.store.remove(&id).await?;
    st.events.forget_owner(&id);
    Err(ServerError::new(
        ErrorCode::Conflict,
        format!("sandbox {id} was deleted while being created"),
    ))
}

/// The node delete of a sandbox already marked `deleting`, running in its own task
/// ([`start_delete`]); its result is the node's or the store's error.
pub type DeleteTask = tokio::task::JoinHandle<ApiResult<()>>;

/// Delete a sandbox: mark it `deleting`, kill it on the node, remove the record. Unknown ids
/// are fine. A sandbox still `creating` is only marked; its creator rolls it back. When the
/// node fails, the record stays `deleting` and the reaper retries every second.
///
/// # Errors
/// The node's error (the record is kept for the retry), store errors.
pub async fn delete_sandbox(st: &SharedState, id: &str) -> ApiResult<()> {
    match start_delete(st, id).await? {
        Some(task) => task.await.map_err(|e| {
            ServerError::new(ErrorCode::Internal, format!("delete task failed: {e}"))
        })?,
        None => Ok(()),
    }
}

/// The first half of [`delete_sandbox`]: mark the sandbox `deleting` now (from that mark it
/// no longer counts against its tenant's quota: [`crate::store::Store::insert_checked`]
/// skips `deleting` records) and start the node delete in its own task, returned so the
/// caller may answer first and await it later (`run_code` does). `None`: nothing to wait
/// for (no record, or still `creating`: its creator rolls it back). Should this process die
/// between the mark and the node delete, the record stays `deleting` and the reaper deletes
/// the sandbox after the restart's re-adoption.
///
/// # Errors
/// Store errors (nothing started then).
pub async fn start_delete(st: &SharedState, id: &str) -> ApiResult<Option<DeleteTask>> {
    start_delete_as(st, id, true).await
}

/// [`start_delete`]; when another server holds the record's transition (its own delete or
/// create runs now, [`crate::leader`]), `wait_elsewhere` returns a task that waits until the
/// record is gone (at most [`crate::ServerConfig::transition_ttl`]), else `None` (the
/// reaper: it looks again next pass).
///
/// # Errors
/// As [`start_delete`].
pub(crate) async fn start_delete_as(
    st: &SharedState,
    id: &str,
    wait_elsewhere: bool,
) -> ApiResult<Option<DeleteTask>> {
    let Some(rec) = st.store.get(id).await? else {
        return Ok(None);
    };
    follow_record(st, &rec);
    let all = [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Deleting,
        SandboxState::Lost,
        SandboxState::Deleted,
        SandboxState::Paused,
    ];
    if rec.state == SandboxState::Creating {
        st.store
            .transition(id, &all, SandboxState::Deleting)
            .await?;
        return Ok(None);
    }
    // In flight from before the record says `deleting`: the reaper must not start a second
    // node delete of it meanwhile.
    st.deleting_set().insert(id.to_owned());
    // Across servers: only the holder of the record's transition calls the node.
    let held = match crate::leader::hold(st, id).await {
        Ok(Some(h)) => h,
        Ok(None) => {
            st.deleting_set().remove(id);
            if !wait_elsewhere {
                return Ok(None);
            }
            tracing::info!(sandbox_id = %id, "another server runs this sandbox's transition; waiting for it");
            if let Err(e) = st.store.transition(id, &all, SandboxState::Deleting).await {
                return Err(e.into());
            }
            let (st2, id2) = (st.clone(), id.to_owned());
            return Ok(Some(tokio::spawn(async move {
                let until = std::time::Instant::now() + st2.cfg.transition_ttl;
                while std::time::Instant::now() < until {
                    if st2.store.get(&id2).await?.is_none() {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Ok(())
            })));
        }
        Err(e) => {
            st.deleting_set().remove(id);
            return Err(e.into());
        }
    };
    if let Err(e) = st.store.transition(id, &all, SandboxState::Deleting).await {
        st.deleting_set().remove(id);
        held.release().await;
        return Err(e.into());
    }
    let st2 = st.clone();
    let id2 = id.to_owned();
    let backend = rec.backend;
    Ok(Some(tokio::spawn(async move {
        let finished = async {
            let deleted = st2.node.delete(&id2).await;
            if deleted.is_err() {
                // The record stays `deleting` without an owner: the reaper retries.
                held.release().await;
            } else {
                drop(held); // the record goes below
            }
            if let Err(e) = deleted {
                let e = ServerError::from(e);
                crate::events::record_error(&st2, "delete", Some(&id2), Some(backend), &e);
                return Err(e);
            }
            st2.store.remove(&id2).await?;
            tracing::info!(sandbox_id = %id2, "sandbox deleted");
            let f = serde_json::Map::new();
            // Deletes never fail for their event (deleting frees space); it waits in the queue.
            crate::events::record_queued(&st2, "deleted", Some(&id2), Some(backend), f);
            Ok::<(), ServerError>(())
        }
        .await;
        // Only now: until the record is gone, a reaper pass that listed it as `deleting`
        // must still see this delete in flight (else it starts a second node delete).
        st2.deleting_set().remove(&id2);
        finished
    })))
}

/// The record of a sandbox that must be `running` for the call.
///
/// # Errors
/// 404 `not_found` without a record; 409 `conflict` in any other state.
pub async fn running(st: &SharedState, id: &str) -> ApiResult<Record> {
    let rec = st
        .store
        .get(id)
        .await?
        .ok_or_else(|| ServerError::no_sandbox(id))?;
    if rec.state == SandboxState::Paused {
        return Err(ServerError::new(
            ErrorCode::Conflict,
            format!("sandbox is paused: {id} (resume it with POST /v1/sandboxes:resume)"),
        ));
    }
    if rec.state != SandboxState::Running {
        return Err(ServerError::new(
            ErrorCode::Conflict,
            format!("sandbox {id} is {}, not running", rec.state.as_str()),
        ));
    }
    follow_record(st, &rec);
    Ok(rec)
}

/// Cluster mode: the next node call for `rec` goes to the node its record names
/// ([`crate::cluster::ClusterNode::follow_record`]).
pub(crate) fn follow_record(st: &SharedState, rec: &Record) {
    if let Some(c) = st.cluster.get() {
        c.follow_record(&rec.id, &rec.node);
    }
}

/// `POST /v1/sandboxes` → 201 `Sandbox` (200 on an idempotent replay). With `trajectory`:
/// the rules of [`crate::trajectory::create_bound`] (200 on a reattach).
pub async fn create(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> ApiResult<(StatusCode, Json<Sandbox>)> {
    // Whether the body names a backend: a fork takes its checkpoint's when it does not.
    let backend_given = body.get("backend").is_some();
    if !body.is_object() {
        return Err(ServerError::invalid("request body must be a JSON object"));
    }
    let mut req: CreateSandboxRequest = serde_json::from_value(body).map_err(|e| {
        ServerError::invalid(format!(
            "Failed to deserialize the JSON body into the target type: {e}"
        ))
    })?;
    crate::checkpoints::fill_from_checkpoint(&st, &who, &mut req, backend_given).await?;
    let key = idempotency_key(&headers)?;
    if req.trajectory.is_some() {
        let (status, sb) = crate::trajectory::create_bound(&st, &who, req, key).await?;
        return Ok((status, Json(sb)));
    }
    let (rec, created) = create_sandbox(&st, &who, req, BTreeMap::new(), key).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(rec.to_api())))
}

/// Largest `limit` of a paged `GET /v1/sandboxes`.
pub const MAX_PAGE: usize = 10_000;

/// `GET /v1/sandboxes?label=k=v` (repeatable, all must match) → `SandboxList`, oldest first;
/// only the caller's tenant's sandboxes (an admin sees all).
///
/// Paged with `limit=N` (1..=[`MAX_PAGE`]) and `page_token` (the previous page's
/// `next_page_token`): at most N sandboxes in (creation time, id) order, and a
/// `next_page_token` while more may follow. Without `limit` every match comes in one answer
/// (a large registry should be paged).
///
/// # Errors
/// 400 `invalid_argument`: an unknown parameter, a label filter not `k=v`, a `limit` out of
/// range, or a `page_token` this server did not give.
pub async fn list(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    Query(params): Query<Vec<(String, String)>>,
) -> ApiResult<Json<SandboxList>> {
    let mut want = BTreeMap::new();
    let (mut limit, mut token) = (None, None);
    let mut contradictory = false;
    for (k, v) in params {
        match k.as_str() {
            "label" => {}
            "limit" => {
                limit = Some(
                    v.parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_PAGE).contains(n))
                        .ok_or_else(|| {
                            ServerError::invalid(format!(
                                "limit {v:?} must be an integer in 1..={MAX_PAGE}"
                            ))
                        })?,
                );
                continue;
            }
            "page_token" => {
                token = Some(page_cursor(&v)?);
                continue;
            }
            _ => {
                return Err(ServerError::invalid(format!(
                    "unknown query parameter {k:?}; only label=k=v, limit, page_token"
                )))
            }
        }
        let (lk, lv) = v
            .split_once('=')
            .ok_or_else(|| ServerError::invalid(format!("label filter {v:?} must be k=v")))?;
        // Two values for one key: nothing can match (a record has one value per key).
        contradictory |= want
            .insert(lk.to_owned(), lv.to_owned())
            .is_some_and(|old| old != lv);
    }
    if token.is_some() && limit.is_none() {
        return Err(ServerError::invalid("page_token needs limit"));
    }
    if contradictory {
        return Ok(Json(SandboxList {
            sandboxes: Vec::new(),
            next_page_token: None,
        }));
    }
    let Some(limit) = limit else {
        let sandboxes = st
            .store
            .list_labeled(&want)
            .await?
            .into_iter()
            .filter(|r| who.sees(r.tenant.as_deref()))
            .map(|r| r.to_api())
            .collect();
        return Ok(Json(SandboxList {
            sandboxes,
            next_page_token: None,
        }));
    };
    let after = token.as_ref().map(|(at, id)| (*at, id.as_str()));
    let page = st
        .store
        .list_page(&want, who.only_tenant(), after, limit)
        .await?;
    let next_page_token = (page.len() == limit)
        .then(|| page.last().map(|r| page_token(r.created_at_ms, &r.id)))
        .flatten();
    let sandboxes = page
        .into_iter()
        .filter(|r| who.sees(r.tenant.as_deref()))
        .map(|r| r.to_api())
        .collect();
    Ok(Json(SandboxList {
        sandboxes,
        next_page_token,
    }))
}

/// The opaque `next_page_token` after the record created at `created_at_ms` with `id`:
/// base64url (no padding) of `"{created_at_ms}.{id}"`.
fn page_token(created_at_ms: i64, id: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{created_at_ms}.{id}"))
}

/// The cursor in a `page_token` made by [`page_token`].
fn page_cursor(token: &str) -> ApiResult<(i64, String)> {
    use base64::Engine as _;
    let bad = || ServerError::invalid("page_token is not one this server gave");
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    let raw = String::from_utf8(raw).map_err(|_| bad())?;
    let (at, id) = raw.split_once('.').ok_or_else(bad)?;
    Ok((at.parse().map_err(|_| bad())?, id.to_owned()))
}

/// `GET /v1/sandboxes:summary` (admin) → [`SandboxSummary`]: counts over the whole
/// registry, each an indexed count (the status page reads these, not every record).
///
/// # Errors
/// Registry failures (500).
pub async fn summary(State(st): State<SharedState>) -> ApiResult<Json<SandboxSummary>> {
    let s = st.store.summary().await?;
    Ok(Json(SandboxSummary {
        total: s.by_state.iter().map(|c| c.2).sum(),
        by_state: s
            .by_state
            .into_iter()
            .map(|(backend, state, count)| StateCount {
                backend,
                state,
                count,
            })
            .collect(),
        by_node: s.by_node.into_iter().collect(),
        with_trajectory: s.with_trajectory,
    }))
}

/// `GET /v1/sandboxes/{id}` → `Sandbox` or 404.
pub async fn get_one(
    State(st): State<SharedState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Sandbox>> {
    let rec = st
        .store
        .get(&id)
        .await?
        .ok_or_else(|| ServerError::no_sandbox(&id))?;
    Ok(Json(rec.to_api()))
}

/// `DELETE /v1/sandboxes/{id}` → 204, also when unknown or already gone.
pub async fn delete(
    State(st): State<SharedState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    delete_sandbox(&st, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sandboxes/{id}/keepalive` with an optional body `{"ttl_s": N}` (an empty body
/// keeps the sandbox's own TTL) → `Sandbox` with `expires_at` = now + ttl (`null` for 0).
pub async fn keepalive(
    State(st): State<SharedState>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<Sandbox>> {
    let req: KeepaliveRequest = if body.iter().all(|b| b.is_ascii_whitespace()) {
        KeepaliveRequest::default()
    } else if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        // Only an object: serde would also read the struct from an array by position.
        return Err(ServerError::invalid("request body must be a JSON object"));
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ServerError::invalid(format!("keepalive body: {e}")))?
    };
    let rec = running(&st, &id).await?;
    let rec = set_ttl(&st, &id, req.ttl_s.unwrap_or(rec.spec.ttl_s)).await?;
    Ok(Json(rec.to_api()))
}

/// Set the TTL of a running sandbox: it expires `ttl_s` seconds from now (0 = never).
/// Shared by keepalive and the E2B surface's `timeout`/`connect`.
///
/// # Errors
/// `invalid_argument` for a TTL over [`MAX_TTL_S`]; 404/409 when the sandbox is gone or
/// not running.
pub async fn set_ttl(st: &SharedState, id: &str, ttl_s: u64) -> ApiResult<Record> {
    let ttl = range("ttl_s", ttl_s, 0, MAX_TTL_S)?;
    let expires = (ttl > 0).then(|| now_ms() + ttl as i64 * 1000);
    if !st.store.set_expiry(id, expires, ttl).await? {
        running(st, id).await?; // gone or no longer running meanwhile: answer 404/409
    }
    st.store
        .get(id)
        .await?
        .ok_or_else(|| ServerError::no_sandbox(id))
}

/// Chunks of one batch in flight at once ([`create_batch`]): each chunk's items are
/// placed, inserted, claimed, created on their nodes (all of the chunk's node calls at
/// once) and marked running together, so up to this × [`BATCH_CHUNK`] node creates of one
/// batch run at a time.
pub const BATCH_CHUNKS_IN_FLIGHT: usize = 16;

/// Items of a batch whose writes go together: one
/// [`crate::registry::Registry::insert_many`] (that also claims the records' creates for
/// this server), one [`crate::registry::Registry::transition_many`] (to `running`) and one
/// write of their `created` audit events ([`crate::events::record_many`]) per chunk, each
/// one transaction.
pub const BATCH_CHUNK: usize = 64;

/// One item of a batch: its create request (or its own error) and whether it named a
/// backend.
type BatchEntry = (Result<CreateSandboxRequest, ServerError>, bool);

/// The create requests of a `POST /v1/sandboxes:batch` body: `Ok` per item, or that item's
/// own error (a bad item fails alone).
///
/// # Errors
/// 400 `invalid_argument` for the batch as a whole: not an object, both or neither of
/// `count` / `items`, a size outside 1..=[`sandlot_api::MAX_BATCH`], or (with `count`) a
/// create request that does not parse or validate.
fn batch_items(mut body: serde_json::Value) -> ApiResult<Vec<BatchEntry>> {
    let max = sandlot_api::MAX_BATCH;
    let obj = body
        .as_object_mut()
        .ok_or_else(|| ServerError::invalid("request body must be a JSON object"))?;
    let size_err =
        |n: usize| ServerError::invalid(format!("a batch holds 1..={max} sandboxes, not {n}"));
    let parse = |v: serde_json::Value| -> Result<(CreateSandboxRequest, bool), ServerError> {
        if !v.is_object() {
            return Err(ServerError::invalid(
                "a create request must be a JSON object",
            ));
        }
        let backend_given = v.get("backend").is_some();
        let req: CreateSandboxRequest = serde_json::from_value(v)
            .map_err(|e| ServerError::invalid(format!("create request: {e}")))?;
        if req.trajectory.is_some() {
            return Err(ServerError::invalid(
                "trajectory is not supported in a batch; create bound sandboxes one by one",
            ));
        }
        Ok((req, backend_given))
    };
    match (obj.remove("count"), obj.remove("items")) {
        (Some(count), None) => {
            let n = count
                .as_u64()
                .ok_or_else(|| ServerError::invalid("count must be a positive integer"))?;
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n == 0 || n > max {
                return Err(size_err(n));
            }
            let (req, backend_given) = parse(body)?;
            validate(&req)?;
            Ok((0..n).map(|_| (Ok(req.clone()), backend_given)).collect())
        }
        (None, Some(serde_json::Value::Array(items))) => {
            if items.is_empty() || items.len() > max {
                return Err(size_err(items.len()));
            }
            if !obj.is_empty() {
                return Err(ServerError::invalid(
                    "with items, the body holds nothing else; put the fields in each item",
                ));
            }
            Ok(items
                .into_iter()
                .map(|v| match parse(v) {
                    Ok((r, b)) => (Ok(r), b),
                    Err(e) => (Err(e), false),
                })
                .collect())
        }
        (None, Some(_)) => Err(ServerError::invalid("items must be an array")),
        _ => Err(ServerError::invalid(
            "a batch has exactly one of count (with the create fields) or items",
        )),
    }
}

/// `POST /v1/sandboxes:batch` → 200 [`sandlot_api::BatchCreateResponse`]: every item runs
/// the single create's protocol ([`create_sandbox`]: placement, quota in the insert's
/// transaction, transition claim, node call, rollback on failure, so a failed item leaves
/// nothing behind) with the registry writes of [`BATCH_CHUNK`] items at a time as one
/// write each and [`BATCH_CHUNKS_IN_FLIGHT`] chunks at once, answered per item in request
/// order. Partial success
/// is normal: over the caller's quota or without node capacity an item fails with 429
/// `resource_exhausted`, a bad item with 400, and the others are created.
///
/// `Idempotency-Key: K` on the batch gives item `i` the key `K#i` (a retried batch replays
/// the items already created, answered 200, and creates the rest). The items run in a task
/// of their own, so a client that disconnects mid-batch does not cut the batch short.
pub async fn create_batch(
    State(st): State<SharedState>,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> ApiResult<Json<sandlot_api::BatchCreateResponse>> {
    let key = idempotency_key(&headers)?;
    let items = batch_items(body)?;
    // Own task: a client that disconnects mid-batch does not stop the items not yet
    // started (each then ends created or rolled back; a resend with the key tells which).
    let results = tokio::spawn(run_batch(st, who, key, items))
        .await
        .map_err(|e| ServerError::new(ErrorCode::Internal, format!("batch task failed: {e}")))?;
    let created = results.iter().filter(|r| r.sandbox.is_some()).count();
    Ok(Json(sandlot_api::BatchCreateResponse {
        failed: results.len() - created,
        created,
        results,
    }))
}

/// The items of a batch, answered in request order: [`BATCH_CHUNK`] at a time run as one
/// chunk ([`batch_chunk`]), [`BATCH_CHUNKS_IN_FLIGHT`] chunks at once.
async fn run_batch(
    st: SharedState,
    who: Principal,
    key: Option<String>,
    items: Vec<BatchEntry>,
) -> Vec<sandlot_api::BatchItem> {
    use futures::{FutureExt, StreamExt};
    let who = std::sync::Arc::new(who);
    let mut chunks: Vec<Vec<(usize, BatchEntry)>> = Vec::new();
    for (index, entry) in items.into_iter().enumerate() {
        match chunks.last_mut() {
            Some(c) if c.len() < BATCH_CHUNK => c.push((index, entry)),
            _ => chunks.push(vec![(index, entry)]),
        }
    }
    // (A plain loop: the stream combinators' closures trip the compiler's Send check
    // under tokio::spawn.)
    let n = chunks.iter().map(Vec::len).sum();
    let mut chunks = chunks.into_iter();
    let mut running = futures::stream::FuturesOrdered::new();
    let mut out = Vec::with_capacity(n);
    loop {
        while running.len() < BATCH_CHUNKS_IN_FLIGHT {
            match chunks.next() {
                Some(c) => {
                    running.push_back(batch_chunk(st.clone(), who.clone(), key.clone(), c).boxed())
                }
                None => break,
            }
        }
        match running.next().await {
            Some(items) => out.extend(items),
            None => break,
        }
    }
    out
}

/// One chunk of a batch, answered per item in request order: prepare every item, insert
/// the records of those ready with one [`crate::registry::Registry::insert_many`], answer
/// the refused and replayed ones, then create the rest together ([`create_chunk`]).
async fn batch_chunk(
    st: SharedState,
    who: std::sync::Arc<Principal>,
    key: Option<String>,
    chunk: Vec<(usize, BatchEntry)>,
) -> Vec<sandlot_api::BatchItem> {
    let (st, who, key) = (&st, &*who, &key);
    let preps = futures::future::join_all(chunk.into_iter().map(
        |(index, (req, backend_given))| async move {
            let key = key.as_ref().map(|k| format!("{k}#{index}"));
            let prep = match req {
                Err(e) => Err(e),
                Ok(mut req) => {
                    match crate::checkpoints::fill_from_checkpoint(st, who, &mut req, backend_given)
                        .await
                    {
                        Err(e) => Err(e),
                        Ok(()) => prepare_create(st, who, req, BTreeMap::new(), key).await,
                    }
                }
            };
            (index, prep)
        },
    ))
    .await;
    let inserts: Vec<crate::store::InsertItem<'_>> = preps
        .iter()
        .filter_map(|(_, p)| match p {
            Ok(Prep::Ready(p)) => Some((
                &p.rec,
                p.key.as_ref().map(|(k, d)| (k.as_str(), d.as_str())),
                who.quota.as_ref(),
            )),
            _ => None,
        })
        .collect();
    // Each record inserted carries this server's claim on its create (the transition of
    // [`create_chunk`]), written with the insert: no separate claim write.
    let deadline = now_ms() + st.cfg.transition_ttl.as_millis() as i64;
    let claim = Some((st.cfg.server_id.as_str(), deadline));
    let outcomes: Vec<ApiResult<KeyOutcome>> = if inserts.is_empty() {
        Vec::new()
    } else {
        match st.store.insert_many(&inserts, claim).await {
            Ok(v) => v
                .into_iter()
                .map(|r| r.map_err(ServerError::from))
                .collect(),
            // Nothing of the chunk was written: each of its items fails with the cause.
            Err(e) => {
                let e = ServerError::from(e).api_error();
                inserts
                    .iter()
                    .map(|_| Err(ServerError::Api(e.clone())))
                    .collect()
            }
        }
    };
    drop(inserts);
    let mut outcomes = outcomes.into_iter();
    let mut out = Vec::with_capacity(preps.len());
    let mut go = Vec::new();
    for (index, prep) in preps {
        match prep {
            Ok(Prep::Ready(p)) => {
                let inserted = outcomes.next().unwrap_or_else(|| {
                    Err(ServerError::new(
                        ErrorCode::Internal,
                        "registry answered fewer items than it was given",
                    ))
                });
                match admit(st, p, inserted).await {
                    Ok(Admitted::Go(rec)) => go.push((index, rec)),
                    Ok(Admitted::Replayed(r)) => out.push(batch_item(index, Ok((r, false)))),
                    Err(e) => out.push(batch_item(index, Err(e))),
                }
            }
            Ok(Prep::Done(answer)) => out.push(batch_item(index, Ok(answer))),
            Err(e) => out.push(batch_item(index, Err(e))),
        }
    }
    out.extend(create_chunk(st, go).await);
    out.sort_by_key(|b| b.index);
    out
}

/// Stops a chunk's heartbeat task when dropped.
struct Beat(Option<tokio::task::JoinHandle<()>>);

impl Beat {
    /// Stops the heartbeat and waits until it has (no renewal can follow this).
    async fn stop(mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
            let _ = h.await;
        }
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        if let Some(h) = &self.0 {
            h.abort();
        }
    }
}

/// The inserted records `recs` (`(batch index, record)`) of one chunk, created as
/// [`settle_create`] creates one, with the chunk's registry writes as one write each:
/// their transitions were claimed for this server by their insert ([`batch_chunk`]) and
/// are renewed together by one heartbeat ([`crate::registry::Registry::claim_many`]) while
/// the node calls run (every node create at once); the records of the sandboxes made are
/// set `running` (their claims cleared) with one
/// [`crate::registry::Registry::transition_many`] and their `created` audit events written
/// with one [`crate::events::record_many`] ([`now_running_many`]). A failed node create is
/// rolled back alone ([`create_failed`]); a record deleted meanwhile is deleted on its node
/// ([`deleted_while_creating`]). Answers per item, in no particular order.
async fn create_chunk(st: &SharedState, recs: Vec<(usize, Record)>) -> Vec<sandlot_api::BatchItem> {
    if recs.is_empty() {
        return Vec::new();
    }
    let ids: Vec<String> = recs.iter().map(|(_, r)| r.id.clone()).collect();
    {
        let mut creating = st.creating_set();
        for id in &ids {
            creating.insert(id.clone());
        }
    }
    let ttl = st.cfg.transition_ttl.as_millis() as i64;
    let me = st.cfg.server_id.clone();
    let beat = Beat(Some({
        let (st2, me2, beat_ids) = (st.clone(), me.clone(), ids.clone());
        tokio::spawn(async move {
            let period = st2.cfg.transition_ttl / 3;
            loop {
                tokio::time::sleep(period).await;
                let now = now_ms();
                if let Err(e) = st2.store.claim_many(&beat_ids, &me2, now + ttl, now).await {
                    tracing::warn!(error = %crate::error::chain(&e), "batch transition heartbeat failed");
                }
            }
        })
    }));
    let created = futures::future::join_all(recs.iter().map(|(_, rec)| node_create(st, rec))).await;
    // No heartbeat may re-claim a record after the writes below clear the owners.
    beat.stop().await;
    let mut out = Vec::with_capacity(recs.len());
    // Records whose claim the write below does not clear (failed, or not running).
    let mut release = Vec::new();
    let mut ok = Vec::new();
    for ((index, rec), created) in recs.into_iter().zip(created) {
        match created {
            Err(e) => {
                let e = create_failed(st, &rec.id, rec.backend, e).await;
                release.push(rec.id.clone());
                out.push(batch_item(index, Err(e)));
            }
            Ok(()) => ok.push((index, rec)),
        }
    }
    if !ok.is_empty() {
        let item_ids: Vec<String> = ok.iter().map(|(_, r)| r.id.clone()).collect();
        match st
            .store
            .transition_many(
                &item_ids,
                &[SandboxState::Creating],
                SandboxState::Running,
                Some(me.as_str()),
            )
            .await
        {
            Err(e) => {
                let e = ServerError::from(e).api_error();
                for (index, _) in ok {
                    out.push(batch_item(index, Err(ServerError::Api(e.clone()))));
                }
                release.extend(item_ids);
            }
            Ok(changed) => {
                let mut running = Vec::with_capacity(ok.len());
                for ((index, rec), c) in ok.into_iter().zip(changed) {
                    if c {
                        running.push((index, rec));
                    } else {
                        release.push(rec.id.clone());
                        out.push(batch_item(index, deleted_while_creating(st, &rec.id).await));
                    }
                }
                out.extend(now_running_many(st, running).await);
            }
        }
    }
    for id in release {
        if let Err(e) = st.store.release_transition(&id, &me).await {
            // The deadline lapses by itself; the leader's sweep then finishes the record.
            tracing::warn!(sandbox_id = %id, error = %crate::error::chain(&e), "release transition");
        }
    }
    {
        let mut creating = st.creating_set();
        for id in &ids {
            creating.remove(id);
        }
    }
    out
}

/// [`now_running`] of a chunk's records that just became `running`: their `created`
/// events in ONE write of the events database, or (when they cannot be written) every one
/// of those sandboxes deleted again and its item failed (503, as a single create's).
async fn now_running_many(
    st: &SharedState,
    items: Vec<(usize, Record)>,
) -> Vec<sandlot_api::BatchItem> {
    if items.is_empty() {
        return Vec::new();
    }
    let events: Vec<crate::events::NewEvent<'_>> = items
        .iter()
        .map(|(_, rec)| {
            tracing::info!(sandbox_id = %rec.id, backend = %rec.backend, image = %rec.image, "sandbox running");
            let mut f = serde_json::Map::new();
            f.insert("image".into(), rec.image.clone().into());
            crate::events::NewEvent {
                kind: "created",
                sandbox: Some(&rec.id),
                backend: Some(rec.backend),
                fields: f,
            }
        })
        .collect();
    match crate::events::record_many(st, events) {
        Ok(()) => items
            .into_iter()
            .map(|(index, mut rec)| {
                rec.state = SandboxState::Running;
                batch_item(index, Ok((rec, true)))
            })
            .collect(),
        Err(e) => {
            // No sandbox without its audit event: roll the creates back, fail the items.
            tracing::warn!(sandboxes = items.len(), error = %e, "creates rolled back: their events are not durable");
            let e = ServerError::from(e).api_error();
            let undone = futures::future::join_all(items.iter().map(|(_, rec)| async move {
                if let Err(de) = delete_sandbox(st, &rec.id).await {
                    tracing::error!(sandbox_id = %rec.id, error = %crate::error::chain(&de), "rollback delete failed; the reaper retries");
                }
            }));
            undone.await;
            items
                .into_iter()
                .map(|(index, _)| batch_item(index, Err(ServerError::Api(e.clone()))))
                .collect()
        }
    }
}

/// The answer of batch item `index`.
fn batch_item(index: usize, out: ApiResult<(Record, bool)>) -> sandlot_api::BatchItem {
    match out {
        Ok((rec, created)) => sandlot_api::BatchItem {
            index,
            status: if created { 201 } else { 200 },
            sandbox: Some(rec.to_api()),
            error: None,
        },
        Err(e) => {
            let error = e.api_error();
            sandlot_api::BatchItem {
                index,
                status: error.code.http_status(),
                sandbox: None,
                error: Some(error),
            }
        }
    }
}

/// The `Idempotency-Key` header of a create, checked (1–256 visible ASCII characters).
fn idempotency_key(headers: &HeaderMap) -> ApiResult<Option<String>> {
    match headers.get("idempotency-key") {
        None => Ok(None),
        Some(v) => {
            let k = v
                .to_str()
                .ok()
                .filter(|k| !k.is_empty() && k.len() <= 256)
                .ok_or_else(|| {
                    ServerError::invalid("Idempotency-Key must be 1–256 visible ASCII characters")
                })?;
            Ok(Some(k.to_owned()))
        }
    }
}
