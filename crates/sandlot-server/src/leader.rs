//! Several servers on one database (cluster mode, issue 21 items 3 and 4): transition
//! owners and the singleton election.
//!
//! **Transitions.** Every server has an id ([`crate::ServerConfig::server_id`]). A create or
//! delete holds its record's transition ([`crate::registry::Registry::claim_transition`])
//! while its node call runs: the record's `owner` is the server id and its `deadline`
//! now + [`crate::ServerConfig::transition_ttl`], renewed every third of that by a
//! heartbeat ([`hold`]), cleared when the call is done. Only the holder calls the node for
//! that record; a second server's delete of it waits for the record to go, and the reaper
//! skips it. A server that dies mid-call stops renewing: once the deadline passes, the
//! leader's stale-transition sweep ([`sweep_stale`]) takes the record over and finishes or
//! rolls it back — a `creating` record is rolled back (its Idempotency-Keys forgotten, the
//! sandbox deleted on its node if there, the record removed: as a create whose node call
//! failed), a `deleting` one is deleted.
//!
//! **Singletons.** The TTL reaper (with the stale-transition sweep, lost-sandbox marking,
//! idempotency-key purge and trajectory retention, [`crate::lifecycle::reaper`]) and the
//! lost-node sweeper ([`crate::cluster::spawn_sweeper`]) run on one server at a time: with
//! [`crate::ServerConfig::election`] only on the holder of the etcd election
//! [`ELECTION_NAME`] ([`sandlot_cluster::Election`]), stopped at once when leadership is
//! lost (then the server campaigns again); without it (`sandlot up`, one server) always.
//! [`crate::AppState::leader`] and the gauge `sandlot_server_leader` say which.
use crate::error::chain;
use crate::{now_ms, SharedState};
use sandlot_api::SandboxState;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Name of the servers' election in etcd (key prefix
/// `/sandlot/election/servers/`).
pub const ELECTION_NAME: &str = "servers";

/// Default [`crate::ServerConfig::transition_ttl`].
pub const DEFAULT_TRANSITION_TTL: Duration = Duration::from_secs(30);

/// The etcd election of the singletons ([`crate::ServerConfig::election`]).
#[derive(Clone)]
pub struct ElectionConfig {
    /// etcd client ([`sandlot_cluster::connect`]).
    pub client: sandlot_cluster::Client,
    /// Lease timing of the leadership: another server takes over within `ttl` of the
    /// leader's death; the leader stops its singletons `safety_margin` before that.
    pub lease: sandlot_cluster::LeaseConfig,
}

impl std::fmt::Debug for ElectionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElectionConfig")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// A server id: `HOSTNAME-PID-RANDOM` (8 hex digits), unique per process even when a
/// restarted server gets the pid of a dead one.
pub fn default_server_id() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "host".into());
    unique_server_id(&format!("{host}-{}", std::process::id()))
}

/// `NAME-RANDOM` (8 hex digits): two servers started with one name still get two ids, so
/// neither can renew or release a transition the other holds.
pub fn unique_server_id(name: &str) -> String {
    format!("{name}-{:08x}", rand::random::<u32>())
}

/// A transition held by this server: its heartbeat renews the deadline until
/// [`Hold::release`] (or drop, which only stops the heartbeat: the deadline then lapses).
pub struct Hold {
    st: SharedState,
    id: String,
    beat: tokio::task::JoinHandle<()>,
}

/// Claims the transition of record `id` for this server (deadline now +
/// `transition_ttl`) and starts its heartbeat. `Ok(None)`: another server holds it and is
/// alive (its deadline has not passed), or the record is gone.
///
/// # Errors
/// Store failures.
pub async fn hold(st: &SharedState, id: &str) -> Result<Option<Hold>, crate::store::StoreError> {
    let (me, deadline) = claim(st);
    if !st
        .store
        .claim_transition(id, me, deadline, now_ms())
        .await?
    {
        return Ok(None);
    }
    Ok(Some(held(st, id)))
}

/// A claim of this server for a record written now: `(server id, deadline ms)`, what
/// [`hold`] writes (a create inserts its record with it, so it needs no second write).
pub fn claim(st: &SharedState) -> (&str, i64) {
    let ttl = st.cfg.transition_ttl.as_millis() as i64;
    (st.cfg.server_id.as_str(), now_ms() + ttl)
}

/// The [`Hold`] of record `id`, which this server has claimed already ([`claim`] written
/// with the record): starts its heartbeat.
pub fn held(st: &SharedState, id: &str) -> Hold {
    let ttl = st.cfg.transition_ttl.as_millis() as i64;
    let (st2, id2) = (st.clone(), id.to_owned());
    let beat = tokio::spawn(async move {
        let period = st2.cfg.transition_ttl / 3;
        loop {
            tokio::time::sleep(period).await;
            let now = now_ms();
            let me = st2.cfg.server_id.as_str();
            match st2.store.claim_transition(&id2, me, now + ttl, now).await {
                Ok(true) => {}
                Ok(false) => return, // record gone, or taken over after a stall
                Err(e) => {
                    tracing::warn!(sandbox_id = %id2, error = %chain(&e), "transition heartbeat failed")
                }
            }
        }
    });
    Hold {
        st: st.clone(),
        id: id.to_owned(),
        beat,
    }
}

impl Hold {
    /// Stops the heartbeat, leaving the owner in the record (the caller clears it in its
    /// own write, e.g. [`crate::registry::Registry::transition_release`]).
    pub fn stop_beat(&self) {
        self.beat.abort();
    }

    /// Whose claim this is: this server's id, the owner to clear.
    pub fn owner(&self) -> &str {
        self.st.cfg.server_id.as_str()
    }

    /// Ends the hold without a write: the caller has cleared the owner already.
    pub fn disarm(self) {
        self.beat.abort();
    }

    /// Stops the heartbeat and clears the owner (a no-op when the record is gone).
    pub async fn release(self) {
        self.beat.abort();
        let me = self.st.cfg.server_id.as_str();
        if let Err(e) = self.st.store.release_transition(&self.id, me).await {
            // The deadline lapses by itself; the leader's sweep then finishes the record.
            tracing::warn!(sandbox_id = %self.id, error = %chain(&e), "release transition");
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.beat.abort();
    }
}

/// One pass of the stale-transition sweep (the leader's reaper runs it): every
/// `creating` / `deleting` record whose owner's deadline has passed is taken over — a
/// `creating` one is rolled back (keys forgotten, marked `deleting`), then each is deleted on
/// its node and its record removed ([`crate::sandboxes::delete_sandbox`]'s protocol). Returns
/// the ids taken over.
pub async fn sweep_stale(st: &SharedState) -> Vec<String> {
    let stale = match st.store.stale_transitions(now_ms()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %chain(&e), "stale-transition sweep: store");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for t in stale {
        let id = t.record.id.clone();
        if st.creating_set().contains(&id) || st.deleting_set().contains(&id) {
            continue; // ours and in flight (its heartbeat is late): not stale
        }
        let Ok(Some(held)) = hold(st, &id).await else {
            continue; // renewed meanwhile, gone, or a store error (next pass)
        };
        let owner = t
            .owner
            .as_deref()
            .unwrap_or("(none: it stopped before claiming)");
        tracing::warn!(sandbox_id = %id, %owner, deadline_ms = t.deadline_ms, state = t.record.state.as_str(),
            "transition of a server that stopped renewing it; taking over");
        if t.record.state == SandboxState::Creating {
            if let Err(e) = st.store.forget_keys_of(&id).await {
                tracing::warn!(sandbox_id = %id, error = %chain(&e), "stale create: forget keys");
                continue;
            }
            let from = [SandboxState::Creating];
            if let Err(e) = st
                .store
                .transition(&id, &from, SandboxState::Deleting)
                .await
            {
                tracing::warn!(sandbox_id = %id, error = %chain(&e), "stale create: mark deleting");
                continue;
            }
            let mut f = serde_json::Map::new();
            f.insert(
                "reason".into(),
                format!("create rolled back: server {owner} stopped during it").into(),
            );
            crate::events::record_queued(st, "lost", Some(&id), Some(t.record.backend), f);
        }
        // Same owner: the delete below renews our claim rather than waiting on it.
        match crate::sandboxes::delete_sandbox(st, &id).await {
            Ok(()) => out.push(id),
            Err(e) => {
                tracing::warn!(sandbox_id = %id, error = %chain(&e), "stale transition: delete failed; the reaper retries")
            }
        }
        held.release().await;
    }
    out
}

/// Runs the singletons until `stop` turns true: always without
/// [`crate::ServerConfig::election`], else only while this server leads (campaigning again
/// after a loss; resigning on stop so another server takes over at once).
pub async fn run(st: SharedState, mut stop: tokio::sync::watch::Receiver<bool>) {
    let Some(election) = st.cfg.election.clone() else {
        set_leader(&st, true);
        let tasks = start(&st, stop.clone());
        let _ = stop.wait_for(|s| *s).await;
        for t in tasks {
            t.abort();
        }
        return;
    };
    let e = sandlot_cluster::Election::new(&election.client, election.lease);
    let me = st.cfg.server_id.clone();
    loop {
        let won = tokio::select! {
            r = e.campaign(ELECTION_NAME, &me) => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        let leadership = match won {
            Ok(l) => l,
            Err(err) => {
                tracing::warn!(error = %err, "election campaign failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        };
        tracing::info!(server_id = %me, "leader: running the TTL reaper, sweeps and GC");
        set_leader(&st, true);
        let (tx, rx) = tokio::sync::watch::channel(false);
        let tasks = start(&st, rx);
        let stopping = tokio::select! {
            _ = leadership.lost() => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        let _ = tx.send(true);
        for t in tasks {
            t.abort();
        }
        set_leader(&st, false);
        if stopping {
            if let Err(err) = leadership.resign().await {
                tracing::warn!(error = %err, "resign leadership");
            }
            return;
        }
        tracing::warn!(server_id = %me, "leadership lost: singletons stopped; campaigning again");
    }
}

fn set_leader(st: &SharedState, on: bool) {
    st.leader.store(on, Ordering::SeqCst);
    st.metrics.set_leader(on);
}

/// Starts the singletons: the reaper, and in cluster mode the lost-node sweeper.
fn start(
    st: &SharedState,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = vec![tokio::spawn(crate::lifecycle::reaper(
        st.clone(),
        stop.clone(),
    ))];
    if let Some(c) = st.cluster.get() {
        tasks.push(crate::cluster::spawn_sweeper(st.clone(), c.clone(), stop));
    }
    tasks
}
