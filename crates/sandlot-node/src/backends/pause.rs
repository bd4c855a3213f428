//! Pause and resume by freezing a sandbox's cgroup: the shared code of every backend whose
//! `pause` is a cgroup freeze (function, container, and the QEMU backends without a memory
//! snapshot). A sandbox keeps a `paused` flag, checked by exec and file calls
//! ([`check_not_paused`]), and a lifecycle lock `deleting` whose read side these calls hold.
//! Freezes of the whole node are serialised by [`crate::checkpoints::FREEZER`], which a
//! checkpoint copy also holds while it keeps a group frozen.
use crate::cgroups::Cgroup;
use crate::node::{NodeError, NodeResult};
use crate::sys::spawn_blocking;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::RwLock;

/// How long freezing a sandbox's cgroup may take (pause).
pub(crate) const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a pause waits for the set-ups of execs already past their `paused` check (see
/// [`freeze`]).
const SETUP_WAIT: Duration = Duration::from_secs(10);

/// `Conflict` ("sandbox is paused") while `paused` is set: exec and file calls of every
/// backend that pauses by freezing its cgroup.
pub(crate) fn check_not_paused(paused: &AtomicBool, id: &str) -> NodeResult<()> {
    if paused.load(Ordering::SeqCst) {
        return Err(NodeError::Conflict(format!("sandbox is paused: {id}")));
    }
    Ok(())
}

/// The checks of an exec or file call on sandbox `id` before it reaches the sandbox:
/// `NotFound` ("being deleted") when `deleting` (the read side of its lifecycle lock, or its
/// kill signal) says so, else [`check_not_paused`].
pub(crate) fn check_live(id: &str, deleting: bool, paused: &AtomicBool) -> NodeResult<()> {
    if deleting {
        return Err(NodeError::NotFound(format!(
            "sandbox {id} is being deleted"
        )));
    }
    check_not_paused(paused, id)
}

/// Pause by freezing `group` (see [`super::SandboxBackend::pause`]), under the read side of the
/// sandbox's lifecycle lock `deleting` (no delete runs meanwhile). `paused` is set first,
/// so no new exec starts while the freeze is in progress; then the set-ups of execs already
/// past that check are waited for (the write side, at most 10 s; meanwhile new readers
/// queue), so a frozen sandbox holds no half-sent exec; `paused` is cleared again if the
/// freeze fails. `Conflict` when a resume ran while it waited.
pub(crate) async fn freeze(
    id: &str,
    backend: &str,
    deleting: &RwLock<bool>,
    paused: &AtomicBool,
    group: &Cgroup,
) -> NodeResult<()> {
    if *deleting.read().await {
        return Err(NodeError::NotFound(format!(
            "sandbox {id} is being deleted"
        )));
    }
    let was_paused = paused.swap(true, Ordering::SeqCst);
    // An exec that passed its `paused` check before it was set holds the read side until
    // its set-up is done (an agent-backed one: until the agent answered, i.e. the exec is
    // in the agent's table). Wait for those: an exec sent to an agent frozen before it read
    // the request was registered only after the resume, after a node restart's re-find had
    // listed the agent's execs, so it was missing and its number given again (CI).
    let guard = if was_paused {
        deleting.read().await
    } else {
        match tokio::time::timeout(SETUP_WAIT, deleting.write()).await {
            Ok(w) => w.downgrade(),
            Err(_) => {
                tracing::warn!(sandbox = %id, "pausing while the sandbox's lifecycle lock is still held for reading after 10 s (an exec set-up, checkpoint copy or agent start); an exec on its way in may be frozen with it");
                deleting.read().await
            }
        }
    };
    if *guard {
        paused.store(false, Ordering::SeqCst);
        return Err(NodeError::NotFound(format!(
            "sandbox {id} is being deleted"
        )));
    }
    let _freezer = crate::checkpoints::FREEZER.lock().await;
    if !paused.load(Ordering::SeqCst) {
        // A resume ran while this pause waited: it wins (freezing now would leave the
        // sandbox frozen with `paused` clear).
        return Err(NodeError::Conflict(format!(
            "sandbox {id} was resumed while its pause waited"
        )));
    }
    let g = group.clone();
    let res = spawn_blocking(move || Ok(g.freeze(Instant::now() + FREEZE_TIMEOUT)?)).await;
    if res.is_err() {
        paused.store(false, Ordering::SeqCst);
    } else {
        tracing::info!(sandbox = %id, backend, "sandbox paused (cgroup frozen)");
    }
    res
}

/// Resume by thawing `group` (see [`super::SandboxBackend::resume`]); the counterpart of
/// [`freeze`].
pub(crate) async fn thaw(
    id: &str,
    backend: &str,
    deleting: &RwLock<bool>,
    paused: &AtomicBool,
    group: &Cgroup,
) -> NodeResult<()> {
    let guard = deleting.read().await;
    if *guard {
        return Err(NodeError::NotFound(format!(
            "sandbox {id} is being deleted"
        )));
    }
    let freezer = crate::checkpoints::FREEZER.lock().await;
    if crate::checkpoints::copying(&freezer, id) {
        // A checkpoint copy holds the group frozen; its end thaws it (not paused any more).
        paused.store(false, Ordering::SeqCst);
        tracing::info!(sandbox = %id, backend, "sandbox resumed (thawed when the checkpoint copy ends)");
        return Ok(());
    }
    let g = group.clone();
    spawn_blocking(move || Ok(g.thaw()?)).await?;
    paused.store(false, Ordering::SeqCst);
    tracing::info!(sandbox = %id, backend, "sandbox resumed (cgroup thawed)");
    Ok(())
}
