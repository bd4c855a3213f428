//! The trajectory log: step semantics of mutating calls, create-with-trajectory (reattach,
//! restore), and `GET/DELETE /v1/trajectories/{*id}`.
//!
//! Contract: `/work/notes/traj-spec.md` (issue 4). Steps are numbered from 0 per
//! trajectory. A call with `step = S` on a sandbox bound to trajectory `T`, with `next` the
//! number of logged steps of `T`:
//! - `S < next`, same request digest → the logged result, `replayed: true`; the node is not
//!   touched (one SQLite read, one counter update);
//! - `S < next`, other digest → 409 `conflict` "step S diverges: logged digest X, request
//!   digest Y";
//! - `S == next` → executed, then appended to the log in one committed transaction before
//!   the answer. A call that fails (any error of the node: infrastructure failure, missing
//!   file, bad path) is not logged, so the caller may retry it; it had no effect the log
//!   would need to reproduce;
//! - `S > next` → 400 `invalid_argument` "step S is beyond the next step N of trajectory T".
//!
//! `step` on a sandbox without a trajectory → 400. No `step` → the call runs unlogged (the
//! documented escape hatch). Calls of one trajectory are serialised by a per-trajectory
//! async mutex held from the lookup to the append, so two calls with the same step cannot
//! both execute; the store re-checks `step == next` inside its transaction as well. The
//! execute-and-append part runs in its own task, so a client that disconnects cannot cut
//! between executing a step and logging it. A step that was executing when the server
//! process died was never acknowledged and is not logged: re-issued, it runs again
//! (at-least-once for unacknowledged steps, exactly-once for acknowledged ones).
//!
//! Streaming execs (`?stream=true`) take `step` too: a replayed step streams its logged
//! stdout and stderr as one chunk each, then the `exit` line with `replayed: true`.
use crate::error::{ApiResult, Path, ServerError};
use crate::sandboxes::create_sandbox;
use crate::store::Record;
use crate::trajectory_store::{StepRequest, StepResult};
use crate::{now_ms, SharedState};
use axum::extract::State;
use axum::http::StatusCode;
use sandlot_api::{
    ApiError, CreateSandboxRequest, ErrorCode, RestoreMismatch, RestoreMode, RestoreReport,
    Sandbox, TrajectoryInfo, TrajectoryStep,
};
use sandlot_node_api::Node;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tokio::sync::{OwnedMutexGuard, OwnedSemaphorePermit};

/// Longest trajectory id, characters.
pub const MAX_ID_LEN: usize = 200;

/// Check a trajectory id: 1–200 characters of `[A-Za-z0-9._:/-]`.
///
/// # Errors
/// 400 `invalid_argument`.
pub fn check_id(t: &str) -> ApiResult<()> {
    let ok = !t.is_empty()
        && t.len() <= MAX_ID_LEN
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:/-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ServerError::invalid(format!(
            "trajectory id {t:?} must be 1–{MAX_ID_LEN} characters of [A-Za-z0-9._:/-]"
        )))
    }
}

/// One async mutex per trajectory id (created on demand, pruned when unused).
#[derive(Default)]
pub struct Locks {
    map: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Locks {
    /// Wait for and take the lock of trajectory `t`.
    pub async fn lock(&self, t: &str) -> OwnedMutexGuard<()> {
        let m = {
            let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(t.to_owned()).or_default().clone()
        };
        m.lock_owned().await
    }

    /// Drop the mutexes nobody holds or waits for. Returns how many are left.
    pub fn prune(&self) -> usize {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, m| Arc::strong_count(m) > 1);
        map.len()
    }
}

/// Run one call on the node (no logging).
///
/// # Errors
/// The node's error.
pub async fn execute(
    node: &Arc<dyn Node>,
    id: &str,
    req: &StepRequest,
    max_file_bytes: u64,
) -> ApiResult<StepResult> {
    Ok(match req {
        StepRequest::Exec(r) => StepResult::Exec(node.exec(id, r, None).await?),
        StepRequest::WriteFile { path, data } => {
            node.write_file(id, path, data.clone()).await?;
            StepResult::Done
        }
        StepRequest::RemoveFile { path } => {
            node.remove_file(id, path).await?;
            StepResult::Done
        }
        StepRequest::ReadFile { path } => {
            StepResult::Data(node.read_file(id, path, max_file_bytes).await?.into())
        }
        StepRequest::ListDir { path } => StepResult::List(node.list_dir(id, path).await?),
    })
}

/// What [`begin`] decided for a call with a step.
pub enum Begin {
    /// Logged with the same digest: answer this result with `replayed: true`.
    Replayed(StepResult),
    /// The next step: execute it, then [`Pending::commit`] it, while holding the lock.
    Execute(Pending),
}

/// A step to execute and log; holds the trajectory's lock until dropped.
pub struct Pending {
    /// Trajectory id.
    pub trajectory: String,
    /// Step number.
    pub step: u64,
    /// Request digest.
    pub digest: String,
    _guard: OwnedMutexGuard<()>,
}

impl Pending {
    /// Append the executed step with its result (committed when this returns).
    ///
    /// # Errors
    /// Store failures.
    pub async fn commit(
        &self,
        st: &SharedState,
        req: &StepRequest,
        res: &StepResult,
    ) -> ApiResult<()> {
        st.trajectories
            .append(
                &self.trajectory,
                self.step,
                req,
                &self.digest,
                res,
                now_ms(),
            )
            .await?;
        st.metrics.steps_logged.inc();
        Ok(())
    }
}

/// Decide a call with `step` on the sandbox of `rec` (see the module docs).
///
/// # Errors
/// 400 for a step without trajectory or beyond the next step, 409 on divergence, store
/// failures.
pub async fn begin(
    st: &SharedState,
    rec: &Record,
    step: u64,
    req: &StepRequest,
) -> ApiResult<Begin> {
    let Some(t) = rec.spec.trajectory.clone() else {
        return Err(ServerError::invalid(format!(
            "step {step} given but sandbox {} is not bound to a trajectory; create it with `trajectory` or omit `step`",
            rec.id
        )));
    };
    let guard = st.traj_locks.lock(&t).await;
    let digest = req.digest();
    let next = st.trajectories.next_step(&t).await?;
    if step < next {
        let logged = st.trajectories.get_step(&t, step).await?.ok_or_else(|| {
            ServerError::new(
                ErrorCode::Internal,
                format!("trajectory {t:?}: step {step} below next step {next} is missing"),
            )
        })?;
        if logged.digest != digest {
            return Err(ServerError::new(
                ErrorCode::Conflict,
                format!(
                    "step {step} diverges: logged digest {}, request digest {digest}",
                    logged.digest
                ),
            ));
        }
        st.trajectories.record_replay(&t, step, now_ms()).await?;
        st.metrics.replays.inc();
        return Ok(Begin::Replayed(logged.result));
    }
    if step > next {
        return Err(ServerError::invalid(format!(
            "step {step} is beyond the next step {next} of trajectory {t}"
        )));
    }
    Ok(Begin::Execute(Pending {
        trajectory: t,
        step,
        digest,
        _guard: guard,
    }))
}

/// A call with an optional step: replayed from the log, or executed (and logged when it has
/// a step). Returns the result and whether it was replayed.
///
/// # Errors
/// As [`begin`] and the node's errors.
pub async fn call(
    st: &SharedState,
    rec: &Record,
    step: Option<u64>,
    req: StepRequest,
) -> ApiResult<(StepResult, bool)> {
    let (res, replayed, _share) = call_held(st, rec, step, req).await?;
    Ok((res, replayed))
}

/// [`call`] that also returns an executed exec's output budget share
/// ([`crate::budget::BudgetNode::exec_held`]), for a caller that sends the result: keep
/// it until the answer is sent. `None` for other calls and for replays.
///
/// # Errors
/// As [`call`].
pub async fn call_held(
    st: &SharedState,
    rec: &Record,
    step: Option<u64>,
    req: StepRequest,
) -> ApiResult<(StepResult, bool, Option<OwnedSemaphorePermit>)> {
    let pending = match step {
        None => None,
        Some(s) => match begin(st, rec, s, &req).await? {
            Begin::Replayed(r) => return Ok((r, true, None)),
            Begin::Execute(p) => Some(p),
        },
    };
    // Own task: a dropped request must not cut between executing and logging.
    let st2 = st.clone();
    let id = rec.id.clone();
    tokio::spawn(async move {
        let (res, share) = match &req {
            StepRequest::Exec(r) => {
                let (r, share) = st2.budget_node.exec_held(&id, r, None).await?;
                (StepResult::Exec(r), share)
            }
            _ => (
                execute(&st2.node, &id, &req, st2.cfg.max_file_bytes as u64).await?,
                None,
            ),
        };
        if let Some(p) = pending {
            p.commit(&st2, &req, &res).await?;
        }
        Ok((res, false, share))
    })
    .await
    .map_err(|e| ServerError::new(ErrorCode::Internal, format!("call task failed: {e}")))?
}

/// `POST /v1/sandboxes` with `trajectory`: reattach, create, or restore (contract rules).
/// Returns the sandbox and 200 (reattach or idempotent replay) or 201 (new).
///
/// # Errors
/// 400 for a bad id or request, 409 when the log has steps but the sandbox is gone and
/// `restore` is not `replay`; a failing restore step deletes the new sandbox and answers
/// the node's error code with "restore of trajectory T failed at step N: …".
pub async fn create_bound(
    st: &SharedState,
    who: &crate::auth::Principal,
    req: CreateSandboxRequest,
    key: Option<String>,
) -> ApiResult<(StatusCode, Sandbox)> {
    let t = req.trajectory.clone().expect("called with a trajectory");
    check_id(&t)?;
    crate::sandboxes::validate(&req)?;
    let st = st.clone();
    let who = who.clone();
    // Own task: a client that goes away mid-restore must not leave a half-restored sandbox
    // bound to the trajectory.
    tokio::spawn(async move {
        let _guard = st.traj_locks.lock(&t).await;
        // Trajectory ids are client-chosen: the first tenant to use one owns it.
        if let Some(tenant) = &who.tenant {
            if !st.store.claim_trajectory(&t, tenant).await? && !who.admin {
                return Err(ServerError::new(
                    ErrorCode::Conflict,
                    format!("trajectory id {t:?} belongs to another API key; choose another id"),
                ));
            }
        }
        if let Some(rec) = st
            .store
            .live_by_trajectory(&t).await?
            .filter(|r| who.sees(r.tenant.as_deref()))
        {
            tracing::info!(sandbox_id = %rec.id, trajectory = %t, "reattach");
            return Ok((StatusCode::OK, rec.to_api()));
        }
        let next = st.trajectories.next_step(&t).await?;
        let mode = req.restore.unwrap_or_default();
        if next > 0 && mode == RestoreMode::Fail {
            return Err(ServerError::new(
                ErrorCode::Conflict,
                format!(
                    "trajectory {t} has {next} logged steps but its sandbox is gone; create with restore=\"replay\" to rebuild it"
                ),
            ));
        }
        let (rec, created) = create_sandbox(&st, &who, req, BTreeMap::new(), key).await?;
        if !created {
            return Ok((StatusCode::OK, rec.to_api()));
        }
        let mut sb = rec.to_api();
        if mode == RestoreMode::Replay {
            match restore(&st, &rec.id, &t).await {
                Ok(report) => sb.restore = Some(report),
                Err(e) => {
                    if let Err(d) = crate::sandboxes::delete_sandbox(&st, &rec.id).await {
                        tracing::error!(sandbox_id = %rec.id, error = %crate::error::chain(&d), "delete after failed restore failed; the reaper retries");
                    }
                    return Err(e);
                }
            }
        }
        Ok((StatusCode::CREATED, sb))
    })
    .await
    .map_err(|e| ServerError::new(ErrorCode::Internal, format!("create task failed: {e}")))?
}

/// Re-execute every logged mutating step of `t` on sandbox `id`, in order, comparing exit
/// codes. The log is not changed.
async fn restore(st: &SharedState, id: &str, t: &str) -> ApiResult<RestoreReport> {
    let steps = st.trajectories.mutating_steps(t).await?;
    let mut report = RestoreReport::default();
    for (step, req, logged) in steps {
        let res = execute(&st.node, id, &req, st.cfg.max_file_bytes as u64)
            .await
            .map_err(|e| {
                let api = e.api_error();
                ServerError::Api(ApiError::new(
                    api.code,
                    format!(
                        "restore of trajectory {t} failed at step {step} ({}): {}",
                        req.kind().as_str(),
                        api.message
                    ),
                ))
            })?;
        report.replayed_steps += 1;
        if let (StepResult::Exec(now), Some(then)) = (&res, logged.exit_code()) {
            if now.exit_code != then {
                report.mismatches.push(RestoreMismatch {
                    step,
                    logged_exit_code: then,
                    exit_code: now.exit_code,
                });
            }
        }
    }
    tracing::info!(sandbox_id = %id, trajectory = %t, steps = report.replayed_steps, mismatches = report.mismatches.len(), "trajectory restored");
    Ok(report)
}

fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// `GET /v1/trajectories/{*id}` (id percent-encoded; it may contain `/`) →
/// `TrajectoryInfo`; 404 when there is neither a log nor a live sandbox bound to it (a
/// bound sandbox without logged steps, e.g. after `DELETE` of its log, answers
/// `next_step: 0` and no steps).
pub async fn get(
    State(st): State<SharedState>,
    Path(id): Path<String>,
) -> ApiResult<crate::error::Json<TrajectoryInfo>> {
    check_id(&id)?;
    let sandbox_id = st.store.live_by_trajectory(&id).await?.map(|r| r.id);
    let log = match st.trajectories.summary(&id).await? {
        Some(log) => log,
        None if sandbox_id.is_some() => crate::trajectory_store::LogSummary {
            next_step: 0,
            steps: Vec::new(),
            replayed_total: 0,
        },
        None => {
            return Err(ServerError::new(
                ErrorCode::NotFound,
                format!("no trajectory {id:?}"),
            ))
        }
    };
    Ok(crate::error::Json(TrajectoryInfo {
        id,
        sandbox_id,
        next_step: log.next_step,
        steps: log
            .steps
            .into_iter()
            .map(|s| TrajectoryStep {
                step: s.step,
                kind: s.kind,
                digest: s.digest,
                exit_code: s.exit_code,
                created_at: rfc3339(s.created_at_ms),
                replay_count: s.replay_count,
            })
            .collect(),
        replayed_total: log.replayed_total,
    }))
}

/// `DELETE /v1/trajectories/{*id}` → 204, also when unknown. Deletes the log only: a
/// sandbox still bound keeps running and its next logged step is 0 again.
pub async fn delete(
    State(st): State<SharedState>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    check_id(&id)?;
    let _guard = st.traj_locks.lock(&id).await;
    st.trajectories.delete(&id).await?;
    if st.store.live_by_trajectory(&id).await?.is_none() {
        st.store.forget_trajectory_owner(&id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// One retention pass: delete the logs whose last activity is older than the retention and
/// whose sandbox is gone. Returns the ids deleted.
///
/// # Errors
/// Store failures.
pub async fn gc(st: &SharedState) -> ApiResult<Vec<String>> {
    let cutoff = now_ms() - st.cfg.trajectory_retention.as_millis() as i64;
    let mut done = Vec::new();
    for t in st.trajectories.inactive_since(cutoff).await? {
        let _guard = st.traj_locks.lock(&t).await;
        if st.store.live_by_trajectory(&t).await?.is_none() && st.trajectories.delete(&t).await? {
            st.store.forget_trajectory_owner(&t).await?;
            tracing::info!(trajectory = %t, "trajectory log expired (retention); deleted");
            done.push(t);
        }
    }
    st.traj_locks.prune();
    Ok(done)
}
