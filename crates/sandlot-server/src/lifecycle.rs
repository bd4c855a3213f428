//! Start-up re-adoption and the TTL reaper.
use crate::error::chain;
use crate::{now_ms, SharedState};
use sandlot_api::SandboxState;
use std::collections::HashSet;

/// After a (re)start: ask the node to re-adopt every sandbox whose record is `running` or
/// `paused`; adopted ones keep their state (a paused sandbox's cgroup stays frozen across
/// the restart), every other record (`creating`, `deleting`, `lost`, or
/// `running` but not adopted) is removed, each with a log line. The node deletes its own
/// leftovers that are not adopted.
///
/// The ephemeral sandbox of a `run_code`/`run_jupyter` call (label `sandlot.kind=run_code`)
/// is never re-adopted: the call that owned it died with the previous process, so nobody can
/// read its answer, and keeping it would leave its program running (and its memory and quota
/// held) until its TTL, up to a day for a long `run_timeout`. It is deleted like any sandbox
/// the node does not adopt, with a `lost` event whose `reason` says so.
///
/// # Errors
/// Store or node failures; the server does not start then.
pub async fn recover(st: &SharedState) -> anyhow::Result<()> {
    if let Some(c) = st.cluster.get() {
        return crate::cluster::recover(st, c).await;
    }
    let records = st.store.list().await?;
    let keep: Vec<String> = records
        .iter()
        .filter(|r| matches!(r.state, SandboxState::Running | SandboxState::Paused))
        .filter(|r| !is_run_code(r))
        .map(|r| r.id.clone())
        .collect();
    let adopted: HashSet<String> = st.node.readopt(&keep).await?.into_iter().collect();
    for r in records {
        st.events.set_owner(&r.id, r.tenant.as_deref());
        if adopted.contains(&r.id) {
            tracing::info!(sandbox_id = %r.id, "re-adopted running sandbox");
            let f = serde_json::Map::new();
            crate::events::record_queued(st, "readopted", Some(&r.id), Some(r.backend), f);
        } else {
            let cut_off =
                is_run_code(&r) && matches!(r.state, SandboxState::Running | SandboxState::Paused);
            if cut_off {
                tracing::info!(sandbox_id = %r.id, "run_code sandbox of a call cut off by the restart; deleted");
            } else {
                tracing::warn!(sandbox_id = %r.id, state = r.state.as_str(), "sandbox not re-adopted; record removed");
            }
            if r.state == SandboxState::Creating {
                // A create cut off by the restart failed: as for any failed create, its
                // Idempotency-Keys are forgotten, so a retry creates anew (kept, the retry
                // answered 404 "gone" forever).
                st.store.forget_keys_of(&r.id).await?;
            }
            st.store.remove(&r.id).await?;
            let mut f = serde_json::Map::new();
            f.insert("state".into(), r.state.as_str().into());
            if cut_off {
                f.insert(
                    "reason".into(),
                    "run_code call cut off by the restart".into(),
                );
            }
            crate::events::record_queued(st, "lost", Some(&r.id), Some(r.backend), f);
        }
    }
    crate::checkpoints::recover(st).await
}

/// Whether `r` is the ephemeral sandbox of a `run_code` or `run_jupyter` call.
fn is_run_code(r: &crate::store::Record) -> bool {
    r.labels.get("sandlot.kind").map(String::as_str) == Some("run_code")
}

/// Every `reap_interval` until `stop` turns true: delete sandboxes whose TTL expired and
/// retry deletes that failed (records left `deleting`), mark sandboxes that died under the
/// node `lost`, then purge old idempotency keys.
pub async fn reaper(st: SharedState, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(st.cfg.reap_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        reap_once(&st).await;
    }
}

/// Records `running` or `paused` whose sandbox the node reports dead (its processes ended
/// under it: e.g. a runsc sandbox killed as a whole by the host's OOM killer) become `lost`,
/// so clients see it and only delete remains valid; each gets a `lost` event.
///
/// Only [`sandlot_node_api::Liveness::Dead`] (evidence the processes are gone) counts; a node
/// that cannot tell ([`sandlot_node_api::Liveness::Unknown`]: an error of its own such as
/// `EMFILE` while reading `/proc`) leaves the record alone, with a log line — `lost` is
/// final, so it is never concluded from the node's own trouble.
///
/// In cluster mode a status counts only from the node the record names: a sandbox resumed
/// on another node can leave a dead copy on its old one.
async fn mark_lost(st: &SharedState) {
    let statuses: Vec<(Option<String>, sandlot_node_api::SandboxStatus)> = match st.cluster.get() {
        Some(cluster) => match cluster.list_not_alive_on_nodes().await {
            Ok(v) => v.into_iter().map(|(n, s)| (Some(n), s)).collect(),
            Err(_) => return,
        },
        None => match st.node.list_not_alive().await {
            Ok(v) => v.into_iter().map(|s| (None, s)).collect(),
            Err(_) => return,
        },
    };
    for (_, s) in &statuses {
        if let sandlot_node_api::Liveness::Unknown(why) = &s.liveness {
            tracing::warn!(sandbox_id = %s.id, reason = %why, "liveness unknown; not marked lost");
        }
    }
    for (node, s) in statuses.into_iter().filter(|(_, s)| s.liveness.is_dead()) {
        if let (Some(node), Some(cluster)) = (node, st.cluster.get()) {
            if let Ok(Some(rec)) = st.store.get(&s.id).await {
                // A record naming a node that is gone is the lost-node sweep's to mark.
                if rec.node != node && cluster.nodes().contains_key(&rec.node) {
                    tracing::info!(sandbox_id = %s.id, dead_on = %node, lives_on = %rec.node,
                        "a dead copy on a node the sandbox moved away from; not marked lost");
                    continue;
                }
            }
        }
        let from = [SandboxState::Running, SandboxState::Paused];
        if let Ok(true) = st.store.transition(&s.id, &from, SandboxState::Lost).await {
            tracing::warn!(sandbox_id = %s.id, "sandbox died under its node; marked lost");
            let mut f = serde_json::Map::new();
            f.insert("reason".into(), "processes ended".into());
            crate::events::record_queued(st, "lost", Some(&s.id), Some(s.backend), f);
        }
    }
}

/// One reaper pass (see [`reaper`]). Returns the ids it deleted.
pub async fn reap_once(st: &SharedState) -> Vec<String> {
    // Audit events queued while the disk was full are written as soon as it can take them.
    let _ = st.events.ready();
    let now = now_ms();
    let due = match st.store.due_for_reaping(now).await {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %chain(&e), "reaper: store");
            return Vec::new();
        }
    };
    // Transitions a dead server left behind (see [`crate::leader`]).
    let mut done = crate::leader::sweep_stale(st).await;
    for r in due {
        if done.contains(&r.id) {
            continue;
        }
        if st.creating_set().contains(&r.id) {
            continue; // its creator rolls it back
        }
        if st.deleting_set().contains(&r.id) {
            continue; // a DELETE of it is running now; retried here only if that one fails
        }
        if r.state != SandboxState::Deleting && r.expires_at_ms.is_some_and(|t| t <= now) {
            let f = serde_json::Map::new();
            crate::events::record_queued(st, "expired", Some(&r.id), Some(r.backend), f);
        }
        let started = match crate::sandboxes::start_delete_as(st, &r.id, false).await {
            Ok(Some(task)) => task.await.unwrap_or_else(|e| {
                Err(crate::error::ServerError::new(
                    sandlot_api::ErrorCode::Internal,
                    format!("delete task failed: {e}"),
                ))
            }),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        match started {
            Ok(()) => {
                tracing::info!(sandbox_id = %r.id, "reaper: deleted (TTL expired or delete retried)");
                done.push(r.id);
            }
            Err(e) => {
                tracing::warn!(sandbox_id = %r.id, error = %chain(&e), "reaper: delete failed; retrying next pass")
            }
        }
    }
    mark_lost(st).await;
    let cutoff = now - st.cfg.idempotency_ttl.as_millis() as i64;
    if let Err(e) = st.store.purge_keys(cutoff).await {
        tracing::error!(error = %chain(&e), "reaper: purge idempotency keys");
    }
    let last = st
        .last_traj_gc_ms
        .load(std::sync::atomic::Ordering::Relaxed);
    if now - last >= st.cfg.trajectory_gc_interval.as_millis() as i64 {
        st.last_traj_gc_ms
            .store(now, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = crate::trajectory::gc(st).await {
            tracing::error!(error = %chain(&e), "reaper: trajectory retention");
        }
    }
    done
}
