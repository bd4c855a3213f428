//! The sandbox registry behind an async trait, [`Registry`], with two implementations: the
//! SQLite [`Store`] of `sandlot up` (its sync calls run inline, as the handlers already do)
//! and [`PgRegistry`] on PostgreSQL for cluster mode (schema:
//! `migrations/pg/V2__registry.sql`), shared by every server of a cluster.
//!
//! Covered so far: sandbox records, idempotency keys and tenant quotas
//! ([`Registry::insert_checked`]), the owner + deadline of `creating` / `deleting`
//! transitions ([`Registry::set_transition`], [`Registry::stale_transitions`]), API keys
//! and trajectory owners (`migrations/pg/V3__keys_and_trajectory_owners.sql`), checkpoint
//! records (`migrations/pg/V4__checkpoints.sql`).
//!
//! Cross-server semantics on PostgreSQL (READ COMMITTED):
//! - an Idempotency-Key maps to exactly one sandbox: the key's row is inserted first with
//!   `ON CONFLICT DO NOTHING`, which waits for a concurrent uncommitted insert of the same
//!   key; the loser then reads the winner's committed row and gets
//!   [`KeyOutcome::Replay`] (or [`KeyOutcome::Mismatch`]);
//! - quotas: each tenant's usage (count, cpu, memory of its sandboxes in any state but
//!   `deleting`) is one row of `tenant_usage`, kept exact by triggers on `sandboxes`
//!   (`migrations/pg/V9__tenant_usage.sql`); a group transaction first locks the rows of
//!   the tenants it writes for (`FOR UPDATE`, sorted: `LOCK_USAGE_SQL`), then a quota
//!   check reads its tenant's row (O(1), no scan of its sandboxes); creates of one tenant
//!   serialise on that lock, so two servers cannot both admit the last slot.
use crate::checkpoints::CheckpointRow;
use crate::store::{InsertItem, KeyOutcome, KeyRow, Quota, Record, SpecJson, Store, StoreError};
use async_trait::async_trait;
use deadpool_postgres::Pool;
use sandlot_api::{Backend, SandboxState};
use std::collections::BTreeMap;

type Result<T> = std::result::Result<T, StoreError>;

/// A `creating` / `deleting` record whose owner's deadline has passed.
#[derive(Debug, Clone, PartialEq)]
pub struct StaleTransition {
    /// The record.
    pub record: Record,
    /// Server id that started the transition; `None` for a `creating` record no server
    /// ever claimed (its server stopped between the insert and the claim).
    pub owner: Option<String>,
    /// When it should have finished, Unix milliseconds (for an unclaimed record: its
    /// creation time).
    pub deadline_ms: i64,
}

/// How old a `creating` record without an owner must be (ms since `created_at`) before
/// [`Registry::stale_transitions`] lists it: a create claims its record right after the
/// insert, so an unclaimed one this old was left by a server that stopped in between.
pub const UNOWNED_CREATE_GRACE_MS: i64 = 60_000;

/// The operations the server runs on sandbox records. Every method is one transaction.
#[async_trait]
pub trait Registry: Send + Sync + 'static {
    /// Insert `rec`; with `key = Some((key, request digest))` record the Idempotency-Key in
    /// the same transaction (an existing key inserts nothing and answers
    /// [`KeyOutcome::Replay`] with its sandbox id, or [`KeyOutcome::Mismatch`] for another
    /// digest); with `quota`, admit `rec` only if its tenant's sandboxes (any state but
    /// `deleting`) plus `rec` stay within it, else [`KeyOutcome::OverQuota`].
    ///
    /// # Errors
    /// Store failures, including a duplicate sandbox id.
    async fn insert_checked(
        &self,
        rec: &Record,
        key: Option<(&str, &str)>,
        quota: Option<&Quota>,
    ) -> Result<KeyOutcome>;

    /// [`Registry::insert_checked`] of every item in one store call (a batch create's
    /// chunk): the outcomes, in order, are per item, as `insert_checked` would answer each
    /// (an item refused by its quota, replayed, or failing, e.g. on a duplicate id, leaves
    /// nothing of itself and does not stop the others); a quota check counts the items
    /// admitted before it. With `claim = Some((owner, deadline_ms))` each record inserted
    /// is inserted with its transition claimed by `owner` until `deadline_ms` (what
    /// [`Registry::claim_transition`] would then write, in the insert's own row write: a
    /// batch create's chunk needs no separate claim). The default calls `insert_checked`
    /// per item (then `claim_transition` per record inserted; an item whose claim fails or
    /// is not granted is removed again, its Idempotency-Key with it, and answers the
    /// claim's error, so every item is either inserted and claimed or not there); both
    /// stores override it with one transaction.
    ///
    /// # Errors
    /// The call as a whole: the store is unavailable, or the transaction could not begin or
    /// commit (then none of the items was written).
    async fn insert_many(
        &self,
        items: &[InsertItem<'_>],
        claim: Option<(&str, i64)>,
    ) -> Result<Vec<Result<KeyOutcome>>> {
        let mut out = Vec::with_capacity(items.len());
        for (rec, key, quota) in items {
            let mut r = self.insert_checked(rec, *key, *quota).await;
            if let (Ok(KeyOutcome::Inserted), Some((owner, deadline))) = (&r, claim) {
                let claimed = match self
                    .claim_transition(&rec.id, owner, deadline, i64::MIN)
                    .await
                {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(StoreError::Unavailable(format!(
                        "sandbox {}: the transition claim of the new record was not granted",
                        rec.id
                    ))),
                    Err(e) => Err(e),
                };
                if let Err(e) = claimed {
                    // Not half-done: the record (and its key) go again. Should that fail
                    // too, the record is an unclaimed `creating` one, which
                    // `stale_transitions` hands to the reaper after
                    // UNOWNED_CREATE_GRACE_MS.
                    let undo = async {
                        self.forget_keys_of(&rec.id).await?;
                        self.remove(&rec.id).await
                    }
                    .await;
                    r = Err(match undo {
                        Ok(_) => e,
                        Err(u) => StoreError::Unavailable(format!(
                            "{}; removing the unclaimed record also failed: {}",
                            crate::error::chain(&e),
                            crate::error::chain(&u)
                        )),
                    });
                }
            }
            out.push(r);
        }
        Ok(out)
    }

    /// One record by id.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn get(&self, id: &str) -> Result<Option<Record>>;

    /// Every record, oldest first.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn list(&self) -> Result<Vec<Record>>;

    /// The records carrying every pair of `labels` (AND; empty: every record), oldest
    /// first, matched in the database (an index serves the `job` label).
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn list_labeled(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Record>>;

    /// How many records there are per (backend, state), as stored strings.
    ///
    /// # Errors
    /// Store failures.
    async fn count_by_state(&self) -> Result<Vec<(String, String, u64)>>;

    /// One page of [`Registry::list_labeled`]: the records of `tenant` (`None`: every
    /// tenant's) carrying every pair of `labels`, in (`created_at`, id) order, strictly
    /// after the cursor `after` (the last record of the previous page), at most `limit`.
    /// Served by an index on (`created_at`, id): a page costs its own rows, not the
    /// registry's size.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn list_page(
        &self,
        labels: &BTreeMap<String, String>,
        tenant: Option<&str>,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<Record>>;

    /// Counts for the operator's view: per (backend, state), per node, and records bound
    /// to a trajectory — each one indexed `COUNT(*)`, no record decoded.
    ///
    /// # Errors
    /// Store failures.
    async fn summary(&self) -> Result<Summary>;

    /// The oldest live (`creating`, `running`, `paused`) record bound to `trajectory`.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn live_by_trajectory(&self, trajectory: &str) -> Result<Option<Record>>;

    /// Records whose expiry is at or before `now_ms`, or in `deleting`.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn due_for_reaping(&self, now_ms: i64) -> Result<Vec<Record>>;

    /// Compare-and-set of the state: `to` only when the state is one of `from`. Returns
    /// whether the row changed.
    ///
    /// # Errors
    /// Store failures.
    async fn transition(&self, id: &str, from: &[SandboxState], to: SandboxState) -> Result<bool>;

    /// Cluster mode, a node left: every `running` or `paused` record on `node` becomes
    /// `lost` in one write, except a paused `microvm` or `vm` (its memory is in the shared
    /// snapshot store and another node may resume it). Returns the ids and backends changed (one
    /// indexed update, not a scan of every record).
    ///
    /// # Errors
    /// Store failures (nothing changed then).
    async fn mark_node_lost(&self, node: &str) -> Result<Vec<(String, Backend)>>;

    /// Moves a `paused` record to node `node` (cluster mode: a paused (micro)VM resumed on
    /// another node from the shared snapshot store). Returns whether the row changed.
    ///
    /// # Errors
    /// Store failures.
    async fn set_node(&self, id: &str, node: &str) -> Result<bool>;

    /// New expiry (and `ttl_s` in the spec) of a `running` record. Returns whether it
    /// changed.
    ///
    /// # Errors
    /// Store failures.
    async fn set_expiry(&self, id: &str, expires_at_ms: Option<i64>, ttl_s: u64) -> Result<bool>;

    /// Remove a record. Returns whether it existed.
    ///
    /// # Errors
    /// Store failures.
    async fn remove(&self, id: &str) -> Result<bool>;

    /// The request digest and sandbox id recorded under an Idempotency-Key, if any (a
    /// read only: [`Registry::insert_checked`] is what claims a key).
    ///
    /// # Errors
    /// Store failures.
    async fn key_sandbox(&self, key: &str) -> Result<Option<(String, String)>>;

    /// Forget the Idempotency-Keys of a sandbox whose create failed.
    ///
    /// # Errors
    /// Store failures.
    async fn forget_keys_of(&self, id: &str) -> Result<()>;

    /// Record (`Some((server id, deadline ms))`) or clear (`None`) who runs the record's
    /// current transition. Returns whether the record exists.
    ///
    /// # Errors
    /// Store failures.
    async fn set_transition(&self, id: &str, owner: Option<(&str, i64)>) -> Result<bool>;

    /// Compare-and-set of the transition owner: set `(owner, deadline_ms)` when the record
    /// has no owner, its owner's deadline is at or before `now_ms` (stale: the owner is
    /// presumed dead), or `owner` already holds it (a renewal). Returns whether `owner`
    /// holds the transition now (false also for a missing record). This is how two servers
    /// agree on who runs a record's node call: only the holder calls the node.
    ///
    /// # Errors
    /// Store failures.
    async fn claim_transition(
        &self,
        id: &str,
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<bool>;

    /// Clear the transition owner if `owner` holds it (a node call that failed: the reaper
    /// may retry it). Returns whether it did.
    ///
    /// # Errors
    /// Store failures.
    async fn release_transition(&self, id: &str, owner: &str) -> Result<bool>;

    /// [`Registry::transition`] and [`Registry::release_transition`] as one write: set
    /// `state = to` when the state is one of `from`, and clear the transition owner if
    /// `owner` holds it. Returns whether the state changed. The default runs the two
    /// methods (two writes); both stores override it with one statement.
    ///
    /// # Errors
    /// Store failures.
    async fn transition_release(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        owner: &str,
    ) -> Result<bool> {
        let changed = self.transition(id, from, to).await?;
        self.release_transition(id, owner).await?;
        Ok(changed)
    }

    /// [`Registry::claim_transition`] of every id in ONE write (a batch create's chunk, and
    /// its heartbeat): per id, in order, whether `owner` holds its transition now (false
    /// for a missing record or another live owner). The default claims one by one; both
    /// stores override it with one transaction (PostgreSQL: one `UPDATE … WHERE id =
    /// ANY($1)`).
    ///
    /// # Errors
    /// Store failures (then none of the claims was written).
    async fn claim_many(
        &self,
        ids: &[String],
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.push(
                self.claim_transition(id, owner, deadline_ms, now_ms)
                    .await?,
            );
        }
        Ok(out)
    }

    /// [`Registry::transition`] of every id in ONE write (a batch create's chunk, a pause
    /// or resume by label): per id, in order, whether its state changed to `to` (it was one
    /// of `from`). With `release = Some(owner)`, a changed record's transition owner is
    /// also cleared when `owner` holds it ([`Registry::transition_release`]). The default
    /// runs one write per id; both stores override it with one transaction (PostgreSQL: one
    /// `UPDATE … WHERE id = ANY($2)`).
    ///
    /// # Errors
    /// Store failures (then none of the ids changed).
    async fn transition_many(
        &self,
        ids: &[String],
        from: &[SandboxState],
        to: SandboxState,
        release: Option<&str>,
    ) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.push(match release {
                Some(owner) => self.transition_release(id, from, to, owner).await?,
                None => self.transition(id, from, to).await?,
            });
        }
        Ok(out)
    }

    /// `creating` / `deleting` records with an owner whose deadline is at or before
    /// `now_ms`, and `creating` records no server claimed that are at least
    /// [`UNOWNED_CREATE_GRACE_MS`] old, oldest first: another server may finish or roll
    /// them back.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn stale_transitions(&self, now_ms: i64) -> Result<Vec<StaleTransition>>;

    /// Drop Idempotency-Keys created before `before_ms`. Returns how many.
    ///
    /// # Errors
    /// Store failures.
    async fn purge_keys(&self, before_ms: i64) -> Result<usize>;

    /// Add an API key row.
    ///
    /// # Errors
    /// Store failures, also for a duplicate id or digest.
    async fn insert_key(&self, k: &KeyRow) -> Result<()>;

    /// The key row whose digest (SHA-256 hex of the key) is `digest`, revoked or not.
    ///
    /// # Errors
    /// Store failures.
    async fn key_by_digest(&self, digest: &str) -> Result<Option<KeyRow>>;

    /// Every key row, oldest first.
    ///
    /// # Errors
    /// Store failures.
    async fn list_keys(&self) -> Result<Vec<KeyRow>>;

    /// Mark key `id` revoked at `now_ms`. Returns whether a not yet revoked key was found.
    ///
    /// # Errors
    /// Store failures.
    async fn revoke_key(&self, id: &str, now_ms: i64) -> Result<bool>;

    /// Whether any key row exists, revoked ones included.
    ///
    /// # Errors
    /// Store failures.
    async fn has_keys(&self) -> Result<bool>;

    /// Claim trajectory id `t` for `tenant` unless another tenant holds it. Returns whether
    /// `tenant` owns it now.
    ///
    /// # Errors
    /// Store failures.
    async fn claim_trajectory(&self, t: &str, tenant: &str) -> Result<bool>;

    /// The tenant owning trajectory id `t`, if one claimed it.
    ///
    /// # Errors
    /// Store failures.
    async fn trajectory_owner(&self, t: &str) -> Result<Option<String>>;

    /// Release the claim on trajectory `t`.
    ///
    /// # Errors
    /// Store failures.
    async fn forget_trajectory_owner(&self, t: &str) -> Result<()>;

    /// Add a checkpoint record.
    ///
    /// # Errors
    /// Store failures, also for a duplicate id.
    async fn insert_checkpoint(&self, c: &CheckpointRow) -> Result<()>;

    /// One checkpoint record by id.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn get_checkpoint(&self, id: &str) -> Result<Option<CheckpointRow>>;

    /// Every checkpoint record, oldest first.
    ///
    /// # Errors
    /// Store failures or an undecodable row.
    async fn list_checkpoints(&self) -> Result<Vec<CheckpointRow>>;

    /// Remove a checkpoint record (absent is fine).
    ///
    /// # Errors
    /// Store failures.
    async fn remove_checkpoint(&self, id: &str) -> Result<()>;

    /// Set the E2B snapshot name of checkpoint `id`, replacing any (removed with the
    /// checkpoint by [`Registry::remove_checkpoint`]).
    ///
    /// # Errors
    /// Store failures.
    async fn set_checkpoint_name(&self, id: &str, name: &str) -> Result<()>;

    /// The E2B snapshot names of the named checkpoints, by checkpoint id.
    ///
    /// # Errors
    /// Store failures.
    async fn checkpoint_names(&self) -> Result<BTreeMap<String, String>>;
}

/// [`Registry::summary`]'s counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// (backend, state, records), as stored strings.
    pub by_state: Vec<(String, String, u64)>,
    /// (node, records).
    pub by_node: Vec<(String, u64)>,
    /// Records whose spec names a trajectory.
    pub with_trajectory: u64,
}

#[async_trait]
impl Registry for Store {
    async fn insert_checked(
        &self,
        rec: &Record,
        key: Option<(&str, &str)>,
        quota: Option<&Quota>,
    ) -> Result<KeyOutcome> {
        // Group commit: concurrent creates share one SQLite commit.
        self.insert_grouped(rec, key, quota).await
    }
    async fn insert_many(
        &self,
        items: &[InsertItem<'_>],
        claim: Option<(&str, i64)>,
    ) -> Result<Vec<Result<KeyOutcome>>> {
        // One job of the group writer: the items' savepoints in one commit (shared with
        // the concurrent single writes), without blocking the async runtime.
        self.insert_many_grouped(items, claim).await
    }
    async fn get(&self, id: &str) -> Result<Option<Record>> {
        Store::get(self, id)
    }
    async fn list(&self) -> Result<Vec<Record>> {
        Store::list(self)
    }
    async fn list_labeled(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Record>> {
        Store::list_labeled(self, labels)
    }
    async fn count_by_state(&self) -> Result<Vec<(String, String, u64)>> {
        Store::count_by_state(self)
    }
    async fn list_page(
        &self,
        labels: &BTreeMap<String, String>,
        tenant: Option<&str>,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<Record>> {
        Store::list_page(self, labels, tenant, after, limit)
    }
    async fn summary(&self) -> Result<Summary> {
        Store::summary(self)
    }
    async fn live_by_trajectory(&self, trajectory: &str) -> Result<Option<Record>> {
        Store::live_by_trajectory(self, trajectory)
    }
    async fn due_for_reaping(&self, now_ms: i64) -> Result<Vec<Record>> {
        Store::due_for_reaping(self, now_ms)
    }
    async fn transition(&self, id: &str, from: &[SandboxState], to: SandboxState) -> Result<bool> {
        Store::transition(self, id, from, to)
    }
    async fn mark_node_lost(&self, node: &str) -> Result<Vec<(String, Backend)>> {
        Store::mark_node_lost(self, node)
    }
    async fn set_node(&self, id: &str, node: &str) -> Result<bool> {
        Store::set_node(self, id, node)
    }
    async fn set_expiry(&self, id: &str, expires_at_ms: Option<i64>, ttl_s: u64) -> Result<bool> {
        Store::set_expiry(self, id, expires_at_ms, ttl_s)
    }
    async fn remove(&self, id: &str) -> Result<bool> {
        Store::remove(self, id)
    }
    async fn key_sandbox(&self, key: &str) -> Result<Option<(String, String)>> {
        Store::key_sandbox(self, key)
    }
    async fn forget_keys_of(&self, id: &str) -> Result<()> {
        Store::forget_keys_of(self, id)
    }
    async fn set_transition(&self, id: &str, owner: Option<(&str, i64)>) -> Result<bool> {
        Store::set_transition(self, id, owner)
    }
    async fn claim_transition(
        &self,
        id: &str,
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<bool> {
        self.claim_grouped(id, owner, deadline_ms, now_ms).await
    }
    async fn release_transition(&self, id: &str, owner: &str) -> Result<bool> {
        Store::release_transition(self, id, owner)
    }
    async fn transition_release(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        owner: &str,
    ) -> Result<bool> {
        self.transition_release_grouped(id, from, to, owner).await
    }
    async fn claim_many(
        &self,
        ids: &[String],
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<bool>> {
        self.claim_many_grouped(ids, owner, deadline_ms, now_ms)
            .await
    }
    async fn transition_many(
        &self,
        ids: &[String],
        from: &[SandboxState],
        to: SandboxState,
        release: Option<&str>,
    ) -> Result<Vec<bool>> {
        self.transition_many_grouped(ids, from, to, release).await
    }
    async fn stale_transitions(&self, now_ms: i64) -> Result<Vec<StaleTransition>> {
        Ok(Store::stale_transitions(self, now_ms)?
            .into_iter()
            .map(|(record, owner, deadline_ms)| StaleTransition {
                record,
                owner,
                deadline_ms,
            })
            .collect())
    }
    async fn purge_keys(&self, before_ms: i64) -> Result<usize> {
        Store::purge_keys(self, before_ms)
    }
    async fn insert_key(&self, k: &KeyRow) -> Result<()> {
        Store::insert_key(self, k)
    }
    async fn key_by_digest(&self, digest: &str) -> Result<Option<KeyRow>> {
        Store::key_by_digest(self, digest)
    }
    async fn list_keys(&self) -> Result<Vec<KeyRow>> {
        Store::list_keys(self)
    }
    async fn revoke_key(&self, id: &str, now_ms: i64) -> Result<bool> {
        Store::revoke_key(self, id, now_ms)
    }
    async fn has_keys(&self) -> Result<bool> {
        Store::has_keys(self)
    }
    async fn claim_trajectory(&self, t: &str, tenant: &str) -> Result<bool> {
        Store::claim_trajectory(self, t, tenant)
    }
    async fn trajectory_owner(&self, t: &str) -> Result<Option<String>> {
        Store::trajectory_owner(self, t)
    }
    async fn forget_trajectory_owner(&self, t: &str) -> Result<()> {
        Store::forget_trajectory_owner(self, t)
    }
    async fn insert_checkpoint(&self, c: &CheckpointRow) -> Result<()> {
        Store::insert_checkpoint(self, c)
    }
    async fn get_checkpoint(&self, id: &str) -> Result<Option<CheckpointRow>> {
        Store::get_checkpoint(self, id)
    }
    async fn list_checkpoints(&self) -> Result<Vec<CheckpointRow>> {
        Store::list_checkpoints(self)
    }
    async fn remove_checkpoint(&self, id: &str) -> Result<()> {
        Store::remove_checkpoint(self, id)
    }
    async fn set_checkpoint_name(&self, id: &str, name: &str) -> Result<()> {
        Store::set_checkpoint_name(self, id, name)
    }
    async fn checkpoint_names(&self) -> Result<BTreeMap<String, String>> {
        Store::checkpoint_names(self)
    }
}

fn pg(op: &'static str) -> impl FnOnce(tokio_postgres::Error) -> StoreError {
    move |source| StoreError::Pg { op, source }
}

const COLS: &str =
    "id, backend, image, state, node, created_at, expires_at, spec::text, labels::text, tenant";

fn decode(r: &tokio_postgres::Row) -> Result<Record> {
    let id: String = r.get(0);
    let bad = |what: String| StoreError::Corrupt {
        id: id.clone(),
        what,
    };
    let backend: String = r.get(1);
    let state: String = r.get(3);
    let spec: String = r.get(7);
    let labels: String = r.get(8);
    let spec: SpecJson = serde_json::from_str(&spec).map_err(|e| bad(format!("spec: {e}")))?;
    let labels: BTreeMap<String, String> =
        serde_json::from_str(&labels).map_err(|e| bad(format!("labels: {e}")))?;
    Ok(Record {
        backend: backend.parse().map_err(bad)?,
        state: state.parse().map_err(bad)?,
        spec,
        labels,
        image: r.get(2),
        node: r.get(4),
        created_at_ms: r.get(5),
        expires_at_ms: r.get(6),
        tenant: r.get(9),
        id,
    })
}

const KEY_COLS: &str =
    "id, name, digest, admin, max_sandboxes, max_cpu, max_memory_mib, created_at, revoked_at";

fn key_row(r: &tokio_postgres::Row) -> KeyRow {
    KeyRow {
        id: r.get(0),
        name: r.get(1),
        digest: r.get(2),
        admin: r.get(3),
        quota: Quota {
            max_sandboxes: r.get::<_, Option<i64>>(4).map(|v| v.max(0) as u64),
            max_cpu: r.get(5),
            max_memory_mib: r.get::<_, Option<i64>>(6).map(|v| v.max(0) as u64),
        },
        created_at_ms: r.get(7),
        revoked_at_ms: r.get(8),
    }
}

const CK_COLS: &str =
    "id, sandbox_id, backend, image, runtime, disk_mib, size_bytes, created_at, tenant";

fn checkpoint_row(r: &tokio_postgres::Row) -> Result<CheckpointRow> {
    let id: String = r.get(0);
    let backend: String = r.get(2);
    Ok(CheckpointRow {
        backend: backend.parse().map_err(|what| StoreError::Corrupt {
            id: id.clone(),
            what,
        })?,
        sandbox_id: r.get(1),
        image: r.get(3),
        runtime: r.get(4),
        disk_mib: r.get::<_, i64>(5) as u64,
        size_bytes: r.get::<_, i64>(6) as u64,
        created_at_ms: r.get(7),
        tenant: r.get(8),
        id,
    })
}

/// The outcome of an insert from its statement's answer `raw` and, when it inserted
/// nothing and carried a key (`digest`: the request's), the key's committed row `found`
/// (`(digest, sandbox id)`): a key already used answers a replay (or mismatch) before a
/// quota refusal, as the single insert always did.
fn insert_outcome(
    rec: &Record,
    digest: Option<&str>,
    quota: Option<&Quota>,
    raw: Raw,
    found: Option<(String, String)>,
) -> Result<KeyOutcome> {
    let Raw::Insert {
        n,
        cpu,
        mem,
        inserted,
    } = raw
    else {
        return Err(StoreError::Unavailable(
            "unexpected answer to an insert".into(),
        ));
    };
    if inserted {
        return Ok(KeyOutcome::Inserted);
    }
    if let (Some(d), Some((kd, sid))) = (digest, found) {
        return Ok(if kd == d {
            KeyOutcome::Replay(sid)
        } else {
            KeyOutcome::Mismatch
        });
    }
    if let Some(msg) = quota.and_then(|q| {
        crate::store::over_quota(q, n.max(0) as u64, cpu, mem.max(0) as u64, &rec.spec)
    }) {
        return Ok(KeyOutcome::OverQuota(msg));
    }
    // The key conflicted with a create whose key row is gone again (purged or forgotten
    // after a failed create) by the time it was read: the caller may simply retry.
    Err(StoreError::Unavailable(
        "the Idempotency-Key changed hands during the create; retry".into(),
    ))
}

/// The insert of [`PgRegistry`] as one statement (so a group can pipeline it): with
/// `$13` (check the quota) the tenant's usage `u` (any state but `deleting`: its one row
/// of `tenant_usage`, migration V9, no scan of its sandboxes) decides `ok`
/// (the same limits as [`crate::store::over_quota`]); the Idempotency-Key `$11` is
/// recorded only when `ok`, `ON CONFLICT DO NOTHING` (waiting for a concurrent
/// uncommitted insert of the key), and the record only when `ok` and the key (if any) was
/// recorded now; `$19`/`$20` are its transition owner and deadline (both NULL but for a
/// batch chunk's claimed insert). Answers the usage, whether `ok`, and whether the record
/// was inserted.
const INSERT_SQL: &str = "
WITH u AS (
  SELECT COALESCE(SUM(n), 0)::bigint AS n, (COALESCE(SUM(mcpu), 0) / 1000.0)::float8 AS cpu,
         COALESCE(SUM(mem), 0)::bigint AS mem
  FROM tenant_usage WHERE $13::bool AND tenant = COALESCE($10::text, '')
), ok AS (
  SELECT 1 FROM u WHERE NOT $13::bool OR (
    ($14::bigint IS NULL OR u.n + 1 <= $14::bigint)
    AND ($15::float8 IS NULL OR u.cpu + $17::float8 <= $15::float8 + 0.001::float8)
    AND ($16::bigint IS NULL OR u.mem + $18::bigint <= $16::bigint))
), k AS (
  INSERT INTO idempotency (key, digest, sandbox_id, created_at)
  SELECT $11::text, $12::text, $1::text, $6::bigint FROM ok WHERE $11::text IS NOT NULL
  ON CONFLICT (key) DO NOTHING RETURNING 1
), s AS (
  INSERT INTO sandboxes (id, backend, image, state, node, created_at, expires_at, spec,
    labels, tenant, owner, deadline)
  SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::bigint, $7::bigint,
    $8::text::jsonb, $9::text::jsonb, $10::text, $19::text, $20::bigint
  FROM ok WHERE $11::text IS NULL OR EXISTS (SELECT 1 FROM k)
  RETURNING 1
)
SELECT u.n, u.cpu, u.mem, (SELECT COUNT(*) FROM s) > 0 FROM u";

/// Locks (`FOR UPDATE`, creating it if missing) the `tenant_usage` row of every tenant of
/// `$1` and of the tenant of every sandbox of the ids `$2`, in tenant order ('' for none).
/// A group transaction runs it first: the row of a tenant is the lock under which its
/// quota is checked (two servers cannot both admit its last slot), and the later writes
/// of the group's triggers then find their rows already held.
const LOCK_USAGE_SQL: &str = "
INSERT INTO tenant_usage AS u (tenant)
SELECT t FROM (
  SELECT unnest($1::text[]) AS t
  UNION SELECT COALESCE(tenant, '') FROM sandboxes WHERE id = ANY($2::text[])
) x ORDER BY t
ON CONFLICT (tenant) DO UPDATE SET n = u.n";

/// `Registry::insert_many` of items with neither an Idempotency-Key nor a quota (a batch
/// of a caller without quota, without a key: the common case) as ONE statement: every
/// record of the arrays `$1`..`$10` (one element per record, in order), with the
/// transition owner `$11` and deadline `$12` (NULL: none). A duplicate id fails the whole
/// statement; the caller then inserts the items one by one.
const INSERT_MANY_SQL: &str = "
INSERT INTO sandboxes (id, backend, image, state, node, created_at, expires_at, spec,
  labels, tenant, owner, deadline)
SELECT u.id, u.backend, u.image, u.state, u.node, u.created_at, u.expires_at,
  u.spec::jsonb, u.labels::jsonb, u.tenant, $11::text, $12::bigint
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[],
  $7::bigint[], $8::text[], $9::text[], $10::text[])
  AS u(id, backend, image, state, node, created_at, expires_at, spec, labels, tenant)";

const CLAIM_SQL: &str = "UPDATE sandboxes SET owner = $1, deadline = $2 WHERE id = $3
     AND (owner IS NULL OR deadline IS NULL OR deadline <= $4 OR owner = $1)";

// SET expressions read the row's old values, so both CASEs test the old owner.
const TRANSITION_RELEASE_SQL: &str = "UPDATE sandboxes SET state = $1,
       deadline = CASE WHEN owner = $4 THEN NULL ELSE deadline END,
       owner = CASE WHEN owner = $4 THEN NULL ELSE owner END
     WHERE id = $2 AND state = ANY($3)";

/// `Registry::claim_many` as one statement: [`CLAIM_SQL`] for every id of `$3`; answers
/// the ids claimed.
const CLAIM_MANY_SQL: &str = "UPDATE sandboxes SET owner = $1, deadline = $2 WHERE id = ANY($3)
     AND (owner IS NULL OR deadline IS NULL OR deadline <= $4 OR owner = $1) RETURNING id";

/// `Registry::transition_many` as one statement: the state compare-and-set of every id of
/// `$2`, clearing the owner `$4` (NULL: none) where it holds the claim; answers the ids
/// changed.
const TRANSITION_MANY_SQL: &str = "UPDATE sandboxes SET state = $1,
       deadline = CASE WHEN owner = $4::text THEN NULL ELSE deadline END,
       owner = CASE WHEN owner = $4::text THEN NULL ELSE owner END
     WHERE id = ANY($2) AND state = ANY($3) RETURNING id";

/// [`TRANSITION_MANY_SQL`] run again after the answer to a COMMIT that contained it was
/// lost (the connection closed: the first run may or may not have committed): the ids it
/// changes now, and those already in state `$1` and not held by `$4` (what the first run
/// left, had it committed). Such an id counts as changed; should another caller have made
/// the same change meanwhile, both act on it, as two callers of one state change may.
const TRANSITION_MANY_SETTLED_SQL: &str = "WITH changed AS (
       UPDATE sandboxes SET state = $1,
         deadline = CASE WHEN owner = $4::text THEN NULL ELSE deadline END,
         owner = CASE WHEN owner = $4::text THEN NULL ELSE owner END
       WHERE id = ANY($2) AND state = ANY($3) RETURNING id)
     SELECT id FROM changed
     UNION SELECT id FROM sandboxes
       WHERE id = ANY($2) AND state = $1
         AND ($4::text IS NULL OR owner IS DISTINCT FROM $4::text)";

/// Per id of `ids`, in order, whether it is among the ids a `… RETURNING id` statement
/// answered (`raw`).
fn per_id(ids: &[String], raw: Raw) -> Result<Vec<bool>> {
    match raw {
        Raw::Ids(changed) => Ok(ids.iter().map(|id| changed.contains(id)).collect()),
        _ => Err(StoreError::Unavailable(
            "unexpected answer to a bulk update".into(),
        )),
    }
}

/// Most writes one PostgreSQL group transaction takes ([`PgRegistry`]'s group writer).
pub const PG_GROUP_MAX: usize = 512;

/// One write of [`PgRegistry`]'s group writer, owned.
enum Op {
    /// `Registry::insert_checked`.
    Insert {
        rec: Box<Record>,
        key: Option<(String, String)>,
        quota: Option<Quota>,
        /// The transition claim written with the record: `(owner, deadline ms)`.
        claim: Option<(String, i64)>,
    },
    /// `Registry::insert_many` of items without key or quota, as one statement
    /// ([`INSERT_MANY_SQL`]).
    InsertMany {
        recs: Vec<Record>,
        claim: Option<(String, i64)>,
    },
    /// `Registry::claim_transition`.
    Claim {
        id: String,
        owner: String,
        deadline_ms: i64,
        now_ms: i64,
    },
    /// `Registry::transition_release`.
    TransitionRelease {
        id: String,
        from: Vec<&'static str>,
        to: &'static str,
        owner: String,
    },
    /// `Registry::claim_many`.
    ClaimMany {
        ids: Vec<String>,
        owner: String,
        deadline_ms: i64,
        now_ms: i64,
    },
    /// `Registry::transition_many`.
    TransitionMany {
        ids: Vec<String>,
        from: Vec<&'static str>,
        to: &'static str,
        release: Option<String>,
        /// Run after a lost COMMIT ([`TRANSITION_MANY_SETTLED_SQL`]).
        settled: bool,
    },
}

/// What an [`Op`]'s statement answered.
#[derive(Debug, Clone)]
enum Raw {
    /// The tenant's usage before the insert (zero without a quota) and whether the record
    /// was inserted.
    Insert {
        n: i64,
        cpu: f64,
        mem: i64,
        inserted: bool,
    },
    /// Rows an UPDATE changed.
    Rows(u64),
    /// The ids an UPDATE … RETURNING id changed.
    Ids(std::collections::HashSet<String>),
}

impl Op {
    fn insert(
        rec: &Record,
        key: Option<(&str, &str)>,
        quota: Option<&Quota>,
        claim: Option<(&str, i64)>,
    ) -> Op {
        Op::Insert {
            rec: Box::new(rec.clone()),
            key: key.map(|(k, d)| (k.to_owned(), d.to_owned())),
            quota: quota.cloned(),
            claim: claim.map(|(o, d)| (o.to_owned(), d)),
        }
    }

    /// What a failure of this op alone is called.
    fn what(&self) -> &'static str {
        match self {
            Op::Insert { .. } => "insert sandbox",
            Op::InsertMany { .. } => "insert sandboxes",
            Op::Claim { .. } => "claim transition",
            Op::TransitionRelease { .. } => "update state and release",
            Op::ClaimMany { .. } => "claim transitions",
            Op::TransitionMany { .. } => "update states",
        }
    }

    /// The op to run again after the answer to a COMMIT that held it was lost, where it
    /// differs from the op itself: a [`Op::TransitionMany`] that also counts what its
    /// first run left.
    fn after_lost_commit(&self) -> Option<Op> {
        match self {
            Op::TransitionMany {
                ids,
                from,
                to,
                release,
                settled: false,
            } => Some(Op::TransitionMany {
                ids: ids.clone(),
                from: from.clone(),
                to,
                release: release.clone(),
                settled: true,
            }),
            _ => None,
        }
    }
}

/// A queued group job: its ops and where their answers go (`Err`: no connection, nothing
/// written).
type GroupJob = (
    Vec<Op>,
    tokio::sync::oneshot::Sender<Result<Vec<Result<Raw>>>>,
);

/// Runs `ops` in ONE transaction on `c`, their statements pipelined (sent without waiting
/// for each answer): first the usage rows of the tenants it writes for
/// ([`LOCK_USAGE_SQL`]: sorted, so groups of several servers lock in one order), then every
/// op in order (each statement sees the writes of those before it, so a quota counts the
/// inserts admitted earlier in the group), then COMMIT. Any statement's failure fails the
/// whole (rolled back).
async fn run_pipelined(
    c: &mut deadpool_postgres::Object,
    ops: &[Op],
) -> std::result::Result<Vec<Raw>, tokio_postgres::Error> {
    use tokio_postgres::types::ToSql;
    let ins = c.prepare_cached(INSERT_SQL).await?;
    let claim = c.prepare_cached(CLAIM_SQL).await?;
    let tr = c.prepare_cached(TRANSITION_RELEASE_SQL).await?;
    let claim_many = c.prepare_cached(CLAIM_MANY_SQL).await?;
    let tr_many = c.prepare_cached(TRANSITION_MANY_SQL).await?;
    let tr_settled = c.prepare_cached(TRANSITION_MANY_SETTLED_SQL).await?;
    let ins_many = c.prepare_cached(INSERT_MANY_SQL).await?;
    let lock_usage = c.prepare_cached(LOCK_USAGE_SQL).await?;
    // The usage rows this group's statements write (their triggers): of the tenants it
    // inserts for, and of those whose sandboxes it moves into or out of `deleting`.
    let mut tenants: Vec<&str> = Vec::new();
    let mut moved: Vec<&str> = Vec::new();
    let deleting = SandboxState::Deleting.as_str();
    for o in ops {
        match o {
            Op::Insert { rec, .. } => tenants.push(rec.tenant.as_deref().unwrap_or("")),
            Op::InsertMany { recs, .. } => {
                tenants.extend(recs.iter().map(|r| r.tenant.as_deref().unwrap_or("")))
            }
            Op::TransitionRelease { id, from, to, .. } => {
                if *to == deleting || from.contains(&deleting) {
                    moved.push(id);
                }
            }
            Op::TransitionMany { ids, from, to, .. } => {
                if *to == deleting || from.contains(&deleting) {
                    moved.extend(ids.iter().map(String::as_str));
                }
            }
            Op::Claim { .. } | Op::ClaimMany { .. } => {}
        }
    }
    tenants.sort_unstable();
    tenants.dedup();
    // Owned parameter values the pipelined statements borrow.
    struct InsertVals {
        spec: String,
        labels: String,
        check: bool,
        max_n: Option<i64>,
        max_cpu: Option<f64>,
        max_mem: Option<i64>,
        mem: i64,
    }
    let vals: Vec<Option<InsertVals>> = ops
        .iter()
        .map(|o| match o {
            Op::Insert { rec, quota, .. } => Some(InsertVals {
                spec: serde_json::to_string(&rec.spec).expect("spec serializes"),
                labels: serde_json::to_string(&rec.labels).expect("labels serialize"),
                check: quota.is_some(),
                max_n: quota
                    .and_then(|q| q.max_sandboxes)
                    .map(|v| v.min(i64::MAX as u64) as i64),
                max_cpu: quota.and_then(|q| q.max_cpu),
                max_mem: quota
                    .and_then(|q| q.max_memory_mib)
                    .map(|v| v.min(i64::MAX as u64) as i64),
                mem: rec.spec.memory_mib.min(i64::MAX as u64) as i64,
            }),
            _ => None,
        })
        .collect();
    let tx = c.transaction().await?;
    // Sent first, pipelined with the rest: PostgreSQL runs the statements in order and a
    // statement's snapshot is taken when it starts, so a quota check reads the usage after
    // the lock. In tenant order: groups of several servers lock usage rows in one order
    // instead of deadlocking on them.
    let lock = async {
        if tenants.is_empty() && moved.is_empty() {
            return Ok(0);
        }
        tx.execute(&lock_usage, &[&tenants, &moved]).await
    };
    let calls = ops.iter().zip(&vals).map(|(o, v)| {
        let tx = &tx;
        let (ins, claim, tr) = (&ins, &claim, &tr);
        let (claim_many, tr_many, tr_settled, ins_many) =
            (&claim_many, &tr_many, &tr_settled, &ins_many);
        async move {
            match (o, v) {
                (
                    Op::Insert {
                        rec, key, claim, ..
                    },
                    Some(v),
                ) => {
                    let (k, d) = match key {
                        Some((k, d)) => (Some(k.as_str()), Some(d.as_str())),
                        None => (None, None),
                    };
                    let (owner, deadline) = match claim {
                        Some((o, d)) => (Some(o.as_str()), Some(*d)),
                        None => (None, None),
                    };
                    let p: [&(dyn ToSql + Sync); 20] = [
                        &rec.id,
                        &rec.backend.as_str(),
                        &rec.image,
                        &rec.state.as_str(),
                        &rec.node,
                        &rec.created_at_ms,
                        &rec.expires_at_ms,
                        &v.spec,
                        &v.labels,
                        &rec.tenant,
                        &k,
                        &d,
                        &v.check,
                        &v.max_n,
                        &v.max_cpu,
                        &v.max_mem,
                        &rec.spec.cpu,
                        &v.mem,
                        &owner,
                        &deadline,
                    ];
                    let r = tx.query_one(ins, &p).await?;
                    Ok(Raw::Insert {
                        n: r.get(0),
                        cpu: r.get(1),
                        mem: r.get(2),
                        inserted: r.get(3),
                    })
                }
                (
                    Op::Claim {
                        id,
                        owner,
                        deadline_ms,
                        now_ms,
                    },
                    _,
                ) => Ok(Raw::Rows(
                    tx.execute(claim, &[owner, deadline_ms, id, now_ms]).await?,
                )),
                (
                    Op::TransitionRelease {
                        id,
                        from,
                        to,
                        owner,
                    },
                    _,
                ) => Ok(Raw::Rows(tx.execute(tr, &[to, id, from, owner]).await?)),
                (
                    Op::ClaimMany {
                        ids,
                        owner,
                        deadline_ms,
                        now_ms,
                    },
                    _,
                ) => {
                    let rows = tx
                        .query(claim_many, &[owner, deadline_ms, ids, now_ms])
                        .await?;
                    Ok(Raw::Ids(rows.iter().map(|r| r.get(0)).collect()))
                }
                (
                    Op::TransitionMany {
                        ids,
                        from,
                        to,
                        release,
                        settled,
                    },
                    _,
                ) => {
                    let st = if *settled { tr_settled } else { tr_many };
                    let rows = tx.query(st, &[to, ids, from, release]).await?;
                    Ok(Raw::Ids(rows.iter().map(|r| r.get(0)).collect()))
                }
                (Op::InsertMany { recs, claim }, _) => {
                    let col = |f: fn(&Record) -> String| recs.iter().map(f).collect::<Vec<_>>();
                    let ids = col(|r| r.id.clone());
                    let backends = col(|r| r.backend.as_str().to_owned());
                    let images = col(|r| r.image.clone());
                    let states = col(|r| r.state.as_str().to_owned());
                    let nodes = col(|r| r.node.clone());
                    let specs = col(|r| serde_json::to_string(&r.spec).expect("spec serializes"));
                    let labels =
                        col(|r| serde_json::to_string(&r.labels).expect("labels serialize"));
                    let created: Vec<i64> = recs.iter().map(|r| r.created_at_ms).collect();
                    let expires: Vec<Option<i64>> = recs.iter().map(|r| r.expires_at_ms).collect();
                    let tenants: Vec<Option<&str>> =
                        recs.iter().map(|r| r.tenant.as_deref()).collect();
                    let (owner, deadline) = match claim {
                        Some((o, d)) => (Some(o.as_str()), Some(*d)),
                        None => (None, None),
                    };
                    let p: [&(dyn ToSql + Sync); 12] = [
                        &ids, &backends, &images, &states, &nodes, &created, &expires, &specs,
                        &labels, &tenants, &owner, &deadline,
                    ];
                    Ok(Raw::Rows(tx.execute(ins_many, &p).await?))
                }
                (Op::Insert { .. }, None) => unreachable!("insert values are built per insert"),
            }
        }
    });
    // join! and join_all poll (and so send) the statements in order; their answers come
    // back in order too.
    let (locked, out) = futures::join!(lock, futures::future::join_all(calls));
    locked?;
    let out: Vec<Raw> = out
        .into_iter()
        .collect::<std::result::Result<_, tokio_postgres::Error>>()?;
    tx.commit().await?;
    Ok(out)
}

/// Runs a group: all ops in one pipelined transaction ([`run_pipelined`]); should that fail
/// (one op's error such as a duplicate id, a deadlock with another server's group, a
/// broken connection), each op again in a transaction of its own, so a failure stays with
/// its op. After a broken connection (the COMMIT may have gone through) a bulk state change
/// runs again as [`Op::after_lost_commit`], also when it was the group's only op.
async fn run_group(pool: &Pool, ops: &[Op]) -> Result<Vec<Result<Raw>>> {
    let mut c = pool
        .get()
        .await
        .map_err(|e| StoreError::Unavailable(e.to_string()))?;
    let first = run_pipelined(&mut c, ops).await;
    let e = match first {
        Ok(v) => return Ok(v.into_iter().map(Ok).collect()),
        Err(e) => e,
    };
    // The connection closed: whether the COMMIT went through is unknown.
    let lost = e.is_closed();
    if ops.len() == 1 && !(lost && matches!(ops[0], Op::TransitionMany { .. })) {
        return Ok(vec![Err(StoreError::Pg {
            op: ops[0].what(),
            source: e,
        })]);
    }
    if lost {
        // The connection broke: a new one for the retries.
        drop(c);
        c = pool
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
    }
    let mut out = Vec::with_capacity(ops.len());
    for op in ops {
        let again = lost.then(|| op.after_lost_commit()).flatten();
        let one = run_pipelined(&mut c, std::slice::from_ref(again.as_ref().unwrap_or(op))).await;
        out.push(match one {
            Ok(mut v) => Ok(v.pop().expect("one answer per op")),
            Err(source) => {
                let broken = source.is_closed();
                let r = Err(StoreError::Pg {
                    op: op.what(),
                    source,
                });
                if broken {
                    if let Ok(n) = pool.get().await {
                        c = n;
                    }
                }
                r
            }
        });
    }
    Ok(out)
}

/// The group writer of a [`PgRegistry`]: takes the first queued job and every job queued
/// behind it (up to [`PG_GROUP_MAX`] ops), runs them as one group ([`run_group`]), answers
/// each. Ends when the registry (the queue's sender) is dropped.
async fn pg_group_writer(pool: Pool, mut rx: tokio::sync::mpsc::UnboundedReceiver<GroupJob>) {
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        let mut n = jobs[0].0.len();
        while n < PG_GROUP_MAX {
            match rx.try_recv() {
                Ok(j) => {
                    n += j.0.len();
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        let mut ops = Vec::with_capacity(n);
        let mut sizes = Vec::with_capacity(jobs.len());
        let mut answers = Vec::with_capacity(jobs.len());
        for (o, tx) in jobs {
            sizes.push(o.len());
            ops.extend(o);
            answers.push(tx);
        }
        match run_group(&pool, &ops).await {
            Ok(results) => {
                let mut results = results.into_iter();
                for (size, tx) in sizes.into_iter().zip(answers) {
                    let _ = tx.send(Ok(results.by_ref().take(size).collect()));
                }
            }
            Err(e) => {
                let msg = e.to_string();
                for tx in answers {
                    let _ = tx.send(Err(StoreError::Unavailable(msg.clone())));
                }
            }
        }
    }
}

/// PostgreSQL implementation of [`Registry`]. Cheap to share behind an `Arc`.
///
/// Group commit: the writes of the create path (inserts, [`Registry::insert_many`],
/// transition claims, `transition_release`) go through one writer task that runs every
/// write queued while the previous group ran as ONE transaction on one connection, their
/// prepared statements pipelined (one round trip and one WAL flush for the group); should
/// the group fail, each write is retried in a transaction of its own, so a failure (e.g.
/// a duplicate id) stays with its write. Other calls use the pool with prepared
/// statements.
pub struct PgRegistry {
    pool: Pool,
    /// The group writer's queue, started on first use (needs a Tokio runtime).
    group: std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<GroupJob>>,
}

impl PgRegistry {
    /// A registry on `pool`, whose database [`crate::pg::connect`] has migrated.
    pub fn new(pool: Pool) -> PgRegistry {
        PgRegistry {
            pool,
            group: std::sync::OnceLock::new(),
        }
    }

    /// Runs `ops` in the next group transaction ([`PgRegistry`]); answers per op.
    async fn grouped(&self, ops: Vec<Op>) -> Result<Vec<Result<Raw>>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let gone = || StoreError::Unavailable("registry writer task stopped".into());
        self.group
            .get_or_init(|| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                tokio::spawn(pg_group_writer(self.pool.clone(), rx));
                tx
            })
            .send((ops, tx))
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// One op in the next group transaction.
    async fn grouped_one(&self, op: Op) -> Result<Raw> {
        self.grouped(vec![op])
            .await?
            .pop()
            .unwrap_or_else(|| Err(StoreError::Unavailable("no answer from the writer".into())))
    }

    /// `Registry::insert_many` before [`PgRegistry::own_rows`].
    async fn insert_many_once(
        &self,
        items: &[InsertItem<'_>],
        claim: Option<(&str, i64)>,
    ) -> Result<Vec<Result<KeyOutcome>>> {
        // Without keys and quotas (nothing per item to decide): one statement for all.
        if items.len() > 1 && items.iter().all(|(_, k, q)| k.is_none() && q.is_none()) {
            let op = Op::InsertMany {
                recs: items.iter().map(|(r, _, _)| (*r).clone()).collect(),
                claim: claim.map(|(o, d)| (o.to_owned(), d)),
            };
            match self.grouped_one(op).await {
                Ok(Raw::Rows(n)) if n == items.len() as u64 => {
                    return Ok(items.iter().map(|_| Ok(KeyOutcome::Inserted)).collect());
                }
                // A duplicate id (or any failure of the one statement): one by one below,
                // so a failure stays with its item.
                Ok(_) | Err(StoreError::Pg { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let ops = items
            .iter()
            .map(|(rec, key, quota)| Op::insert(rec, *key, *quota, claim))
            .collect();
        let raws = self.grouped(ops).await?;
        // The keys of items not inserted, read in one query (after the commit: a key
        // that conflicted belongs to a committed create).
        let keys: Vec<&str> = items
            .iter()
            .zip(&raws)
            .filter_map(|((_, key, _), raw)| match (raw, key) {
                (
                    Ok(Raw::Insert {
                        inserted: false, ..
                    }),
                    Some((k, _)),
                ) => Some(*k),
                _ => None,
            })
            .collect();
        let mut found: BTreeMap<String, (String, String)> = BTreeMap::new();
        if !keys.is_empty() {
            let c = self.conn().await?;
            let st = c
                .prepare_cached(
                    "SELECT key, digest, sandbox_id FROM idempotency WHERE key = ANY($1)",
                )
                .await
                .map_err(pg("prepare"))?;
            for r in c
                .query(&st, &[&keys])
                .await
                .map_err(pg("select idempotency keys"))?
            {
                found.insert(r.get(0), (r.get(1), r.get(2)));
            }
        }
        Ok(items
            .iter()
            .zip(raws)
            .map(|((rec, key, quota), raw)| {
                let f = key.and_then(|(k, _)| found.get(k).cloned());
                insert_outcome(rec, key.map(|(_, d)| d), *quota, raw?, f)
            })
            .collect())
    }

    /// After a batch insert with the claim `(owner, deadline)`: the items answered with an
    /// error, or with a replay of their own new id, whose row exists exactly as the item's
    /// record with this claim are this call's own rows (the one-statement insert, or the
    /// group, committed but the answer to its COMMIT was lost, e.g. the connection
    /// dropped, and the item-by-item retry then met its own rows as duplicates or its own
    /// keys as replays): they answer `Inserted`. Ids are random per create and the claim
    /// names this server and this call's deadline, so no other create's row matches.
    /// Should the lookup itself fail, the outcomes stay as they were (the rows, if any,
    /// stay claimed `creating`; the reaper rolls them back once the claim lapses).
    async fn own_rows(
        &self,
        items: &[InsertItem<'_>],
        owner: &str,
        deadline: i64,
        out: &mut [Result<KeyOutcome>],
    ) {
        let suspect: Vec<usize> = (0..items.len())
            .filter(|&i| match &out[i] {
                Err(_) => true,
                Ok(KeyOutcome::Replay(sid)) => *sid == items[i].0.id,
                Ok(_) => false,
            })
            .collect();
        if suspect.is_empty() {
            return;
        }
        let ids: Vec<&str> = suspect.iter().map(|&i| items[i].0.id.as_str()).collect();
        let rows = async {
            let c = self.conn().await?;
            let st = c
                .prepare_cached(&format!(
                    "SELECT {COLS}, owner, deadline FROM sandboxes WHERE id = ANY($1)"
                ))
                .await
                .map_err(pg("prepare"))?;
            c.query(&st, &[&ids])
                .await
                .map_err(pg("select sandboxes of a batch"))
        }
        .await;
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %crate::error::chain(&e), "batch insert: own rows not checked after failed items");
                return;
            }
        };
        let mut found: std::collections::HashMap<String, (Record, Option<String>, Option<i64>)> =
            std::collections::HashMap::new();
        for r in &rows {
            if let Ok(rec) = decode(r) {
                found.insert(rec.id.clone(), (rec, r.get(10), r.get(11)));
            }
        }
        for i in suspect {
            let rec = items[i].0;
            let ours = found.get(&rec.id).is_some_and(|(row, o, d)| {
                row == rec && o.as_deref() == Some(owner) && *d == Some(deadline)
            });
            if ours {
                tracing::info!(sandbox_id = %rec.id, "batch insert: the row was written by this very call (its COMMIT's answer was lost)");
                out[i] = Ok(KeyOutcome::Inserted);
            }
        }
    }

    async fn conn(&self) -> Result<deadpool_postgres::Object> {
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))
    }

    async fn select(
        &self,
        q: &str,
        p: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Record>> {
        let c = self.conn().await?;
        let st = c.prepare_cached(q).await.map_err(pg("prepare"))?;
        c.query(&st, p)
            .await
            .map_err(pg("select sandboxes"))?
            .iter()
            .map(decode)
            .collect()
    }
}

#[async_trait]
impl Registry for PgRegistry {
    async fn insert_checked(
        &self,
        rec: &Record,
        key: Option<(&str, &str)>,
        quota: Option<&Quota>,
    ) -> Result<KeyOutcome> {
        let raw = self.grouped_one(Op::insert(rec, key, quota, None)).await?;
        let found = match (&raw, key) {
            (
                Raw::Insert {
                    inserted: false, ..
                },
                Some((k, _)),
            ) => self.key_sandbox(k).await?,
            _ => None,
        };
        insert_outcome(rec, key.map(|(_, d)| d), quota, raw, found)
    }

    /// One statement for items without keys and quotas, else one grouped write per item;
    /// then, with a claim, `PgRegistry::own_rows`: an item whose write seemed to fail
    /// but whose row is this very call's (a COMMIT whose answer was lost, then the retry
    /// found the row) answers `Inserted`.
    async fn insert_many(
        &self,
        items: &[InsertItem<'_>],
        claim: Option<(&str, i64)>,
    ) -> Result<Vec<Result<KeyOutcome>>> {
        let mut out = self.insert_many_once(items, claim).await?;
        if let Some((owner, deadline)) = claim {
            self.own_rows(items, owner, deadline, &mut out).await;
        }
        Ok(out)
    }

    async fn get(&self, id: &str) -> Result<Option<Record>> {
        Ok(self
            .select(
                &format!("SELECT {COLS} FROM sandboxes WHERE id = $1"),
                &[&id],
            )
            .await?
            .pop())
    }

    async fn list(&self) -> Result<Vec<Record>> {
        self.select(
            &format!("SELECT {COLS} FROM sandboxes ORDER BY created_at, seq"),
            &[],
        )
        .await
    }

    async fn list_labeled(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Record>> {
        if labels.is_empty() {
            return self.list().await;
        }
        // Containment (`@>`), served by the GIN index of migration V5.
        let want = serde_json::to_string(labels).expect("labels serialize");
        self.select(
            &format!(
                "SELECT {COLS} FROM sandboxes WHERE labels @> $1::text::jsonb
                 ORDER BY created_at, seq"
            ),
            &[&want],
        )
        .await
    }

    async fn list_page(
        &self,
        labels: &BTreeMap<String, String>,
        tenant: Option<&str>,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<Record>> {
        let want = serde_json::to_string(labels).expect("labels serialize");
        let (after_at, after_id) = after.unzip();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // `labels @> '{}'` holds for every row; the `sandboxes_created` index (migration
        // V8) serves order and cursor, the GIN index of V5 a selective label.
        self.select(
            &format!(
                "SELECT {COLS} FROM sandboxes
                 WHERE ($2::bigint IS NULL OR (created_at, id) > ($2, $3::text))
                   AND ($4::text IS NULL OR tenant = $4)
                   AND labels @> $1::text::jsonb
                 ORDER BY created_at, id LIMIT $5"
            ),
            &[&want, &after_at, &after_id, &tenant, &limit],
        )
        .await
    }

    async fn summary(&self) -> Result<Summary> {
        let by_state = self.count_by_state().await?;
        let c = self.conn().await?;
        let by_node = c
            .query(
                &c.prepare_cached("SELECT node, COUNT(*) FROM sandboxes GROUP BY node")
                    .await
                    .map_err(pg("prepare"))?,
                &[],
            )
            .await
            .map_err(pg("count by node"))?
            .iter()
            .map(|r| (r.get(0), r.get::<_, i64>(1) as u64))
            .collect();
        let with_trajectory: i64 = c
            .query_one(
                &c.prepare_cached(
                    "SELECT COUNT(*) FROM sandboxes WHERE spec ->> 'trajectory' IS NOT NULL",
                )
                .await
                .map_err(pg("prepare"))?,
                &[],
            )
            .await
            .map_err(pg("count with trajectory"))?
            .get(0);
        Ok(Summary {
            by_state,
            by_node,
            with_trajectory: with_trajectory as u64,
        })
    }

    async fn count_by_state(&self) -> Result<Vec<(String, String, u64)>> {
        let c = self.conn().await?;
        Ok(c.query(
            &c.prepare_cached(
                "SELECT backend, state, COUNT(*) FROM sandboxes GROUP BY backend, state",
            )
            .await
            .map_err(pg("prepare"))?,
            &[],
        )
        .await
        .map_err(pg("count sandboxes"))?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get::<_, i64>(2) as u64))
        .collect())
    }

    async fn live_by_trajectory(&self, trajectory: &str) -> Result<Option<Record>> {
        Ok(self
            .select(
                &format!(
                    "SELECT {COLS} FROM sandboxes WHERE spec->>'trajectory' = $1
                     AND state IN ('creating', 'running', 'paused')
                     ORDER BY created_at, seq LIMIT 1"
                ),
                &[&trajectory],
            )
            .await?
            .pop())
    }

    async fn due_for_reaping(&self, now_ms: i64) -> Result<Vec<Record>> {
        self.select(
            &format!(
                "SELECT {COLS} FROM sandboxes WHERE (expires_at IS NOT NULL AND expires_at <= $1)
                 OR state = 'deleting' ORDER BY created_at, seq"
            ),
            &[&now_ms],
        )
        .await
    }

    async fn transition(&self, id: &str, from: &[SandboxState], to: SandboxState) -> Result<bool> {
        let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        let c = self.conn().await?;
        let n = c
            .execute(
                &c.prepare_cached(
                    "UPDATE sandboxes SET state = $1 WHERE id = $2 AND state = ANY($3)",
                )
                .await
                .map_err(pg("prepare"))?,
                &[&to.as_str(), &id, &from],
            )
            .await
            .map_err(pg("update state"))?;
        Ok(n == 1)
    }

    async fn mark_node_lost(&self, node: &str) -> Result<Vec<(String, Backend)>> {
        let c = self.conn().await?;
        let rows = c
            .query(
                &c.prepare_cached(
                    "UPDATE sandboxes SET state = 'lost' WHERE node = $1
                     AND (state = 'running' OR (state = 'paused' AND backend NOT IN ('microvm', 'vm')))
                     RETURNING id, backend",
                )
                .await
                .map_err(pg("prepare"))?,
                &[&node],
            )
            .await
            .map_err(pg("mark node lost"))?;
        rows.iter()
            .map(|r| {
                let (id, b): (String, String) = (r.get(0), r.get(1));
                match b.parse() {
                    Ok(backend) => Ok((id, backend)),
                    Err(what) => Err(StoreError::Corrupt { id, what }),
                }
            })
            .collect()
    }

    async fn set_node(&self, id: &str, node: &str) -> Result<bool> {
        let c = self.conn().await?;
        let n = c
            .execute(
                &c.prepare_cached(
                    "UPDATE sandboxes SET node = $1 WHERE id = $2 AND state = 'paused'",
                )
                .await
                .map_err(pg("prepare"))?,
                &[&node, &id],
            )
            .await
            .map_err(pg("update node"))?;
        Ok(n == 1)
    }

    async fn set_expiry(&self, id: &str, expires_at_ms: Option<i64>, ttl_s: u64) -> Result<bool> {
        let c = self.conn().await?;
        let n = c
            .execute(
                &c.prepare_cached(
                    "UPDATE sandboxes SET expires_at = $1,
                   spec = jsonb_set(spec, '{ttl_s}', to_jsonb($2::bigint))
                 WHERE id = $3 AND state = 'running'",
                )
                .await
                .map_err(pg("prepare"))?,
                &[&expires_at_ms, &(ttl_s as i64), &id],
            )
            .await
            .map_err(pg("update expiry"))?;
        Ok(n == 1)
    }

    async fn remove(&self, id: &str) -> Result<bool> {
        let c = self.conn().await?;
        let n = c
            .execute(
                &c.prepare_cached("DELETE FROM sandboxes WHERE id = $1")
                    .await
                    .map_err(pg("prepare"))?,
                &[&id],
            )
            .await
            .map_err(pg("delete sandbox"))?;
        Ok(n == 1)
    }

    async fn key_sandbox(&self, key: &str) -> Result<Option<(String, String)>> {
        let c = self.conn().await?;
        let row = c
            .query_opt(
                &c.prepare_cached("SELECT digest, sandbox_id FROM idempotency WHERE key = $1")
                    .await
                    .map_err(pg("prepare"))?,
                &[&key],
            )
            .await
            .map_err(pg("select idempotency key"))?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    async fn forget_keys_of(&self, id: &str) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            &c.prepare_cached("DELETE FROM idempotency WHERE sandbox_id = $1")
                .await
                .map_err(pg("prepare"))?,
            &[&id],
        )
        .await
        .map_err(pg("delete idempotency keys"))?;
        Ok(())
    }

    async fn set_transition(&self, id: &str, owner: Option<(&str, i64)>) -> Result<bool> {
        let (o, d) = owner.map_or((None, None), |(o, d)| (Some(o), Some(d)));
        let c = self.conn().await?;
        let n = c
            .execute(
                &c.prepare_cached("UPDATE sandboxes SET owner = $1, deadline = $2 WHERE id = $3")
                    .await
                    .map_err(pg("prepare"))?,
                &[&o, &d, &id],
            )
            .await
            .map_err(pg("update transition owner"))?;
        Ok(n == 1)
    }

    async fn claim_transition(
        &self,
        id: &str,
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<bool> {
        let raw = self
            .grouped_one(Op::Claim {
                id: id.to_owned(),
                owner: owner.to_owned(),
                deadline_ms,
                now_ms,
            })
            .await?;
        Ok(matches!(raw, Raw::Rows(1)))
    }

    async fn release_transition(&self, id: &str, owner: &str) -> Result<bool> {
        let c = self.conn().await?;
        let n = c
            .execute(
                &c.prepare_cached("UPDATE sandboxes SET owner = NULL, deadline = NULL WHERE id = $1 AND owner = $2").await.map_err(pg("prepare"))?,
                &[&id, &owner],
            )
            .await
            .map_err(pg("release transition"))?;
        Ok(n == 1)
    }

    async fn transition_release(
        &self,
        id: &str,
        from: &[SandboxState],
        to: SandboxState,
        owner: &str,
    ) -> Result<bool> {
        let raw = self
            .grouped_one(Op::TransitionRelease {
                id: id.to_owned(),
                from: from.iter().map(|s| s.as_str()).collect(),
                to: to.as_str(),
                owner: owner.to_owned(),
            })
            .await?;
        Ok(matches!(raw, Raw::Rows(1)))
    }

    async fn claim_many(
        &self,
        ids: &[String],
        owner: &str,
        deadline_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<bool>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let raw = self
            .grouped_one(Op::ClaimMany {
                ids: ids.to_vec(),
                owner: owner.to_owned(),
                deadline_ms,
                now_ms,
            })
            .await?;
        per_id(ids, raw)
    }

    async fn transition_many(
        &self,
        ids: &[String],
        from: &[SandboxState],
        to: SandboxState,
        release: Option<&str>,
    ) -> Result<Vec<bool>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let raw = self
            .grouped_one(Op::TransitionMany {
                ids: ids.to_vec(),
                from: from.iter().map(|s| s.as_str()).collect(),
                to: to.as_str(),
                release: release.map(str::to_owned),
                settled: false,
            })
            .await?;
        per_id(ids, raw)
    }

    async fn stale_transitions(&self, now_ms: i64) -> Result<Vec<StaleTransition>> {
        let c = self.conn().await?;
        c.query(
            &format!(
                "SELECT {COLS}, owner, COALESCE(deadline, created_at) FROM sandboxes
                 WHERE (state IN ('creating', 'deleting') AND owner IS NOT NULL
                        AND deadline <= $1)
                    OR (state = 'creating' AND owner IS NULL AND created_at <= $2)
                 ORDER BY created_at, seq"
            ),
            &[&now_ms, &(now_ms - UNOWNED_CREATE_GRACE_MS)],
        )
        .await
        .map_err(pg("select stale transitions"))?
        .iter()
        .map(|r| {
            Ok(StaleTransition {
                record: decode(r)?,
                owner: r.get(10),
                deadline_ms: r.get(11),
            })
        })
        .collect()
    }
    async fn purge_keys(&self, before_ms: i64) -> Result<usize> {
        let c = self.conn().await?;
        Ok(c.execute(
            &c.prepare_cached("DELETE FROM idempotency WHERE created_at < $1")
                .await
                .map_err(pg("prepare"))?,
            &[&before_ms],
        )
        .await
        .map_err(pg("purge idempotency keys"))? as usize)
    }

    async fn insert_key(&self, k: &KeyRow) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            &format!(
                "INSERT INTO api_keys ({KEY_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
            ),
            &[
                &k.id,
                &k.name,
                &k.digest,
                &k.admin,
                &k.quota.max_sandboxes.map(|v| v as i64),
                &k.quota.max_cpu,
                &k.quota.max_memory_mib.map(|v| v as i64),
                &k.created_at_ms,
                &k.revoked_at_ms,
            ],
        )
        .await
        .map_err(pg("insert api key"))?;
        Ok(())
    }

    async fn key_by_digest(&self, digest: &str) -> Result<Option<KeyRow>> {
        let c = self.conn().await?;
        Ok(c.query_opt(
            &format!("SELECT {KEY_COLS} FROM api_keys WHERE digest = $1"),
            &[&digest],
        )
        .await
        .map_err(pg("select api key"))?
        .as_ref()
        .map(key_row))
    }

    async fn list_keys(&self) -> Result<Vec<KeyRow>> {
        let c = self.conn().await?;
        Ok(c.query(
            &format!("SELECT {KEY_COLS} FROM api_keys ORDER BY created_at, seq"),
            &[],
        )
        .await
        .map_err(pg("select api keys"))?
        .iter()
        .map(key_row)
        .collect())
    }

    async fn revoke_key(&self, id: &str, now_ms: i64) -> Result<bool> {
        let c = self.conn().await?;
        let n = c
            .execute(
                &c.prepare_cached(
                    "UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL",
                )
                .await
                .map_err(pg("prepare"))?,
                &[&now_ms, &id],
            )
            .await
            .map_err(pg("revoke api key"))?;
        Ok(n == 1)
    }

    async fn has_keys(&self) -> Result<bool> {
        let c = self.conn().await?;
        Ok(c.query_opt(
            &c.prepare_cached("SELECT 1 FROM api_keys LIMIT 1")
                .await
                .map_err(pg("prepare"))?,
            &[],
        )
        .await
        .map_err(pg("count api keys"))?
        .is_some())
    }

    async fn claim_trajectory(&self, t: &str, tenant: &str) -> Result<bool> {
        let c = self.conn().await?;
        // Waits for a concurrent uncommitted claim; then the committed owner is read.
        c.execute(
            &c.prepare_cached(
                "INSERT INTO trajectory_owners (trajectory, tenant) VALUES ($1, $2)
             ON CONFLICT (trajectory) DO NOTHING",
            )
            .await
            .map_err(pg("prepare"))?,
            &[&t, &tenant],
        )
        .await
        .map_err(pg("claim trajectory"))?;
        let owner: Option<String> = c
            .query_opt(
                &c.prepare_cached("SELECT tenant FROM trajectory_owners WHERE trajectory = $1")
                    .await
                    .map_err(pg("prepare"))?,
                &[&t],
            )
            .await
            .map_err(pg("select trajectory owner"))?
            .map(|r| r.get(0));
        Ok(owner.as_deref() == Some(tenant))
    }

    async fn trajectory_owner(&self, t: &str) -> Result<Option<String>> {
        let c = self.conn().await?;
        Ok(c.query_opt(
            &c.prepare_cached("SELECT tenant FROM trajectory_owners WHERE trajectory = $1")
                .await
                .map_err(pg("prepare"))?,
            &[&t],
        )
        .await
        .map_err(pg("select trajectory owner"))?
        .map(|r| r.get(0)))
    }

    async fn forget_trajectory_owner(&self, t: &str) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            &c.prepare_cached("DELETE FROM trajectory_owners WHERE trajectory = $1")
                .await
                .map_err(pg("prepare"))?,
            &[&t],
        )
        .await
        .map_err(pg("forget trajectory owner"))?;
        Ok(())
    }

    async fn insert_checkpoint(&self, ck: &CheckpointRow) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            &format!(
                "INSERT INTO checkpoints ({CK_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
            ),
            &[
                &ck.id,
                &ck.sandbox_id,
                &ck.backend.as_str(),
                &ck.image,
                &ck.runtime,
                &(ck.disk_mib as i64),
                &(ck.size_bytes as i64),
                &ck.created_at_ms,
                &ck.tenant,
            ],
        )
        .await
        .map_err(pg("insert checkpoint"))?;
        Ok(())
    }

    async fn get_checkpoint(&self, id: &str) -> Result<Option<CheckpointRow>> {
        let c = self.conn().await?;
        c.query_opt(
            &format!("SELECT {CK_COLS} FROM checkpoints WHERE id = $1"),
            &[&id],
        )
        .await
        .map_err(pg("select checkpoint"))?
        .as_ref()
        .map(checkpoint_row)
        .transpose()
    }

    async fn list_checkpoints(&self) -> Result<Vec<CheckpointRow>> {
        let c = self.conn().await?;
        c.query(
            &format!("SELECT {CK_COLS} FROM checkpoints ORDER BY created_at, id"),
            &[],
        )
        .await
        .map_err(pg("list checkpoints"))?
        .iter()
        .map(checkpoint_row)
        .collect()
    }

    async fn remove_checkpoint(&self, id: &str) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            &c.prepare_cached("DELETE FROM checkpoints WHERE id = $1")
                .await
                .map_err(pg("prepare"))?,
            &[&id],
        )
        .await
        .map_err(pg("delete checkpoint"))?;
        c.execute(
            &c.prepare_cached("DELETE FROM checkpoint_names WHERE checkpoint_id = $1")
                .await
                .map_err(pg("prepare"))?,
            &[&id],
        )
        .await
        .map_err(pg("delete checkpoint name"))?;
        Ok(())
    }

    async fn set_checkpoint_name(&self, id: &str, name: &str) -> Result<()> {
        let c = self.conn().await?;
        c.execute(
            &c.prepare_cached(
                "INSERT INTO checkpoint_names (checkpoint_id, name) VALUES ($1, $2)
             ON CONFLICT (checkpoint_id) DO UPDATE SET name = EXCLUDED.name",
            )
            .await
            .map_err(pg("prepare"))?,
            &[&id, &name],
        )
        .await
        .map_err(pg("set checkpoint name"))?;
        Ok(())
    }

    async fn checkpoint_names(&self) -> Result<BTreeMap<String, String>> {
        let c = self.conn().await?;
        let rows = c
            .query(
                &c.prepare_cached("SELECT checkpoint_id, name FROM checkpoint_names")
                    .await
                    .map_err(pg("prepare"))?,
                &[],
            )
            .await
            .map_err(pg("list checkpoint names"))?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandlot_api::{Backend, NetworkPolicy};
    use std::sync::Arc;

    fn rec(id: &str, created: i64, tenant: Option<&str>) -> Record {
        Record {
            id: id.into(),
            backend: Backend::Function,
            image: "python".into(),
            state: SandboxState::Creating,
            node: "n1".into(),
            created_at_ms: created,
            expires_at_ms: Some(created + 10_000),
            spec: SpecJson {
                cpu: 0.5,
                memory_mib: 256,
                disk_mib: 1024,
                pids_max: 64,
                ttl_s: 10,
                env: [("A".to_string(), "b".to_string())].into(),
                network: NetworkPolicy::None,
                runtime: None,
                checkpoint: None,
                accel: None,
                trajectory: Some("traj-1".into()),
            },
            labels: [("job".to_string(), "x".to_string())].into(),
            tenant: tenant.map(str::to_owned),
        }
    }

    // ---- the contract: one suite, run against both registries ----

    /// Pages walk the registry in (created_at, id) order, each record once, filtered by
    /// labels and tenant in the store; the summary counts without reading records.
    async fn contract_list_page_and_summary(r: &dyn Registry) {
        // Three share created_at 5 (ties broken by id), one has another job, two another
        // tenant, one another node, two no trajectory.
        let mk = |id: &str, at: i64, job: &str, tenant: Option<&str>, node: &str| {
            let mut x = rec(id, at, tenant);
            x.labels = [("job".to_string(), job.to_string())].into();
            x.node = node.into();
            x
        };
        let mut rows = vec![
            mk("sb-c", 5, "x", None, "n1"),
            mk("sb-a", 5, "x", None, "n1"),
            mk("sb-b", 5, "x", Some("t1"), "n1"),
            mk("sb-d", 2, "x", None, "n2"),
            mk("sb-e", 9, "y", None, "n1"),
            mk("sb-f", 7, "x", Some("t1"), "n1"),
            mk("sb-g", 8, "x", None, "n1"),
        ];
        rows[4].spec.trajectory = None;
        rows[6].spec.trajectory = None;
        for x in &rows {
            r.insert_checked(x, None, None).await.unwrap();
        }
        let all = BTreeMap::new();
        let walk = |labels: BTreeMap<String, String>, tenant: Option<&'static str>| async move {
            let mut seen = Vec::new();
            let mut after: Option<(i64, String)> = None;
            loop {
                let page = r
                    .list_page(
                        &labels,
                        tenant,
                        after.as_ref().map(|(t, i)| (*t, i.as_str())),
                        3,
                    )
                    .await
                    .unwrap();
                assert!(page.len() <= 3);
                seen.extend(page.iter().map(|x| x.id.clone()));
                match page.last() {
                    Some(last) if page.len() == 3 => {
                        after = Some((last.created_at_ms, last.id.clone()))
                    }
                    _ => return seen,
                }
            }
        };
        assert_eq!(
            walk(all.clone(), None).await,
            ["sb-d", "sb-a", "sb-b", "sb-c", "sb-f", "sb-g", "sb-e"]
        );
        let job_x: BTreeMap<String, String> = [("job".to_string(), "x".to_string())].into();
        assert_eq!(
            walk(job_x, None).await,
            ["sb-d", "sb-a", "sb-b", "sb-c", "sb-f", "sb-g"]
        );
        assert_eq!(walk(all.clone(), Some("t1")).await, ["sb-b", "sb-f"]);
        assert!(walk(all, Some("nobody")).await.is_empty());

        let mut s = r.summary().await.unwrap();
        s.by_state.sort();
        s.by_node.sort();
        assert_eq!(
            s.by_state,
            [("function".to_string(), "creating".to_string(), 7)]
        );
        assert_eq!(s.by_node, [("n1".to_string(), 6), ("n2".to_string(), 1)]);
        assert_eq!(s.with_trajectory, 5);
    }

    /// A departed node's `running` and `paused` records become `lost` in one write, but a
    /// paused microVM's or VM's; other nodes' and other states' records are untouched.
    async fn contract_mark_node_lost(r: &dyn Registry) {
        let mk = |id: &str, node: &str, backend: Backend, state: SandboxState| {
            let mut x = rec(id, 1, None);
            x.spec.trajectory = None;
            (x.node, x.backend, x.state) = (node.into(), backend, state);
            x
        };
        let rows = [
            mk("sb-run", "gone", Backend::Function, SandboxState::Running),
            mk("sb-pau", "gone", Backend::Container, SandboxState::Paused),
            mk("sb-vm", "gone", Backend::Microvm, SandboxState::Paused),
            mk("sb-vmrun", "gone", Backend::Microvm, SandboxState::Running),
            mk("sb-q35", "gone", Backend::Vm, SandboxState::Paused),
            mk("sb-mk", "gone", Backend::Function, SandboxState::Creating),
            mk("sb-del", "gone", Backend::Function, SandboxState::Deleting),
            mk("sb-other", "here", Backend::Function, SandboxState::Running),
        ];
        for x in &rows {
            r.insert_checked(x, None, None).await.unwrap();
        }
        let mut got = r.mark_node_lost("gone").await.unwrap();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got,
            [
                ("sb-pau".to_string(), Backend::Container),
                ("sb-run".to_string(), Backend::Function),
                ("sb-vmrun".to_string(), Backend::Microvm),
            ]
        );
        for x in &rows {
            let want = if ["sb-pau", "sb-run", "sb-vmrun"].contains(&x.id.as_str()) {
                SandboxState::Lost
            } else {
                x.state
            };
            assert_eq!(r.get(&x.id).await.unwrap().unwrap().state, want, "{}", x.id);
        }
        assert!(
            r.mark_node_lost("gone").await.unwrap().is_empty(),
            "done once"
        );
    }

    async fn contract_records(r: &dyn Registry) {
        let a = rec("sb-a", 1, Some("key_t"));
        let b = rec("sb-b", 2, None);
        assert_eq!(
            r.insert_checked(&a, Some(("k1", "d1")), None)
                .await
                .unwrap(),
            KeyOutcome::Inserted
        );
        assert_eq!(
            r.insert_checked(&b, None, None).await.unwrap(),
            KeyOutcome::Inserted
        );
        // Same key: replay with the same digest, mismatch with another; nothing inserted.
        let c = rec("sb-c", 3, None);
        assert_eq!(
            r.insert_checked(&c, Some(("k1", "d1")), None)
                .await
                .unwrap(),
            KeyOutcome::Replay("sb-a".into())
        );
        assert_eq!(
            r.insert_checked(&c, Some(("k1", "d2")), None)
                .await
                .unwrap(),
            KeyOutcome::Mismatch
        );
        assert!(r.get("sb-c").await.unwrap().is_none());
        assert_eq!(r.get("sb-a").await.unwrap().unwrap(), a);
        let ids: Vec<String> = r.list().await.unwrap().into_iter().map(|x| x.id).collect();
        assert_eq!(ids, ["sb-a", "sb-b"]);
        // List by labels, matched in the database (AND of the pairs), and counts.
        let mut d = rec("sb-d", 4, None);
        d.labels = [("job", "y"), ("team", "a\"b")]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into();
        r.insert_checked(&d, None, None).await.unwrap();
        let by = |pairs: &[(&str, &str)]| {
            let want: BTreeMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            async move {
                r.list_labeled(&want)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|x| x.id)
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(by(&[("job", "x")]).await, ["sb-a", "sb-b"]);
        assert_eq!(by(&[("job", "y"), ("team", "a\"b")]).await, ["sb-d"]);
        assert_eq!(by(&[("team", "a\"b")]).await, ["sb-d"]);
        assert!(by(&[("job", "x"), ("team", "a\"b")]).await.is_empty());
        assert!(by(&[("nope", "x")]).await.is_empty());
        assert_eq!(by(&[]).await, ["sb-a", "sb-b", "sb-d"]);
        assert_eq!(
            r.count_by_state().await.unwrap(),
            [("function".to_string(), "creating".to_string(), 3)]
        );
        assert!(r.remove("sb-d").await.unwrap());
        // Trajectory: oldest live record.
        assert_eq!(
            r.live_by_trajectory("traj-1").await.unwrap().unwrap().id,
            "sb-a"
        );
        assert!(r.live_by_trajectory("none").await.unwrap().is_none());
        // Compare-and-set transitions.
        assert!(r
            .transition("sb-a", &[SandboxState::Creating], SandboxState::Running)
            .await
            .unwrap());
        assert!(!r
            .transition("sb-a", &[SandboxState::Creating], SandboxState::Running)
            .await
            .unwrap());
        assert!(!r
            .transition("sb-x", &[SandboxState::Creating], SandboxState::Running)
            .await
            .unwrap());
        // Expiry: only a running record.
        assert!(r.set_expiry("sb-a", Some(50_000), 50).await.unwrap());
        assert!(!r.set_expiry("sb-b", Some(50_000), 50).await.unwrap());
        let got = r.get("sb-a").await.unwrap().unwrap();
        assert_eq!((got.expires_at_ms, got.spec.ttl_s), (Some(50_000), 50));
        // Reaping: sb-b expires at 10_002; sb-a at 50_000.
        let due: Vec<String> = r
            .due_for_reaping(20_000)
            .await
            .unwrap()
            .into_iter()
            .map(|x| x.id)
            .collect();
        assert_eq!(due, ["sb-b"]);
        // Transition owners and deadlines.
        assert!(r
            .set_transition("sb-b", Some(("srv-1", 100)))
            .await
            .unwrap());
        assert!(!r
            .set_transition("sb-x", Some(("srv-1", 100)))
            .await
            .unwrap());
        assert!(r.stale_transitions(99).await.unwrap().is_empty());
        let stale = r.stale_transitions(100).await.unwrap();
        assert_eq!(stale.len(), 1);
        assert_eq!(
            (
                stale[0].record.id.as_str(),
                stale[0].owner.as_deref(),
                stale[0].deadline_ms
            ),
            ("sb-b", Some("srv-1"), 100)
        );
        // A running record is not a transition, whatever its owner.
        assert!(r.set_transition("sb-a", Some(("srv-1", 1))).await.unwrap());
        assert_eq!(r.stale_transitions(1000).await.unwrap().len(), 1);
        assert!(r.set_transition("sb-b", None).await.unwrap());
        assert!(r.stale_transitions(1000).await.unwrap().is_empty());
        // A `creating` record never claimed (its server stopped right after the insert) is
        // listed once it is older than the grace.
        let created_b = r.get("sb-b").await.unwrap().unwrap().created_at_ms;
        assert!(r
            .stale_transitions(created_b + UNOWNED_CREATE_GRACE_MS - 1)
            .await
            .unwrap()
            .is_empty());
        let unowned = r
            .stale_transitions(created_b + UNOWNED_CREATE_GRACE_MS)
            .await
            .unwrap();
        assert_eq!(
            unowned
                .iter()
                .map(|t| (t.record.id.as_str(), t.owner.as_deref(), t.deadline_ms))
                .collect::<Vec<_>>(),
            [("sb-b", None, created_b)]
        );
        // Claims: free → taken; held by a live owner → refused to another, renewed by
        // itself; stale → taken over; released only by its holder.
        assert!(r.claim_transition("sb-b", "srv-1", 500, 0).await.unwrap());
        assert!(!r.claim_transition("sb-b", "srv-2", 600, 100).await.unwrap());
        assert!(r.claim_transition("sb-b", "srv-1", 700, 100).await.unwrap());
        assert!(!r.release_transition("sb-b", "srv-2").await.unwrap());
        assert!(r.claim_transition("sb-b", "srv-2", 900, 700).await.unwrap());
        assert!(!r.claim_transition("sb-b", "srv-1", 900, 800).await.unwrap());
        assert!(r.release_transition("sb-b", "srv-2").await.unwrap());
        assert!(r.claim_transition("sb-b", "srv-1", 900, 800).await.unwrap());
        assert!(r.release_transition("sb-b", "srv-1").await.unwrap());
        assert!(!r.claim_transition("sb-x", "srv-1", 900, 800).await.unwrap());
        // Deleting state is reaped, and frees its quota.
        assert!(r
            .transition("sb-b", &[SandboxState::Creating], SandboxState::Deleting)
            .await
            .unwrap());
        assert_eq!(r.due_for_reaping(0).await.unwrap().len(), 1);
        // A failed create forgets its key: a retry creates again.
        r.forget_keys_of("sb-a").await.unwrap();
        assert!(r.remove("sb-a").await.unwrap());
        assert!(!r.remove("sb-a").await.unwrap());
        assert_eq!(
            r.insert_checked(&c, Some(("k1", "d1")), None)
                .await
                .unwrap(),
            KeyOutcome::Inserted
        );
    }

    /// Per tenant ('' for none): count, millicores and MiB of memory.
    type Usage = BTreeMap<String, (i64, i64, i64)>;

    /// Reads a store's `tenant_usage` table (rows of all zeros left out: as good as none).
    type UsageProbe = dyn Fn() -> futures::future::BoxFuture<'static, Usage> + Sync;

    /// The usage the records of `r` add up to, counted afresh (in Rust, from `list`).
    async fn usage_from_records(r: &dyn Registry) -> Usage {
        let mut u = Usage::new();
        for x in r.list().await.unwrap() {
            if x.state == SandboxState::Deleting {
                continue;
            }
            let e = u.entry(x.tenant.unwrap_or_default()).or_default();
            e.0 += 1;
            e.1 += (x.spec.cpu * 1000.0).round() as i64;
            e.2 += x.spec.memory_mib as i64;
        }
        u
    }

    /// `tenant_usage` (issue 22) equals a fresh count of the records after every kind of
    /// write: single and batch inserts (with and without quota, with a claim), a refused
    /// insert, state changes into `deleting` and back (single, bulk, with release), other
    /// state changes, and removals of live and deleting records.
    async fn contract_usage(r: &dyn Registry, probe: &UsageProbe) {
        let check = |step: &'static str| async move {
            let stored = probe().await;
            assert_eq!(stored, usage_from_records(r).await, "after {step}");
        };
        let mk = |id: &str, i: i64, tenant: Option<&str>| {
            let mut x = rec(id, i, tenant);
            x.spec.cpu = 0.1 * (i % 7 + 1) as f64;
            x.spec.memory_mib = 64 * (i as u64 % 5 + 1);
            x
        };
        let tenants = [Some("key_u1"), Some("key_u2"), None];
        let big = Quota {
            max_sandboxes: Some(1000),
            max_cpu: Some(500.0),
            max_memory_mib: None,
        };
        for i in 0..6 {
            let q = (i % 2 == 0).then_some(&big);
            let x = mk(&format!("sb-u{i}"), i, tenants[i as usize % 3]);
            assert_eq!(
                r.insert_checked(&x, None, q).await.unwrap(),
                KeyOutcome::Inserted
            );
        }
        check("single inserts").await;
        // A batch without keys and quotas (PostgreSQL: one statement), with a claim.
        let batch: Vec<Record> = (6..18)
            .map(|i| mk(&format!("sb-u{i}"), i, tenants[i as usize % 3]))
            .collect();
        let items: Vec<InsertItem> = batch.iter().map(|x| (x, None, None)).collect();
        let out = r.insert_many(&items, Some(("srv-u", 100))).await.unwrap();
        assert!(out.iter().all(|o| matches!(o, Ok(KeyOutcome::Inserted))));
        check("a batch insert").await;
        // A batch with a quota (per item), one refused.
        let tight = Quota {
            max_sandboxes: Some(8),
            max_cpu: None,
            max_memory_mib: None,
        };
        let batch: Vec<Record> = (18..21)
            .map(|i| mk(&format!("sb-u{i}"), i, Some("key_u1")))
            .collect();
        let items: Vec<InsertItem> = batch.iter().map(|x| (x, None, Some(&tight))).collect();
        let out = r.insert_many(&items, None).await.unwrap();
        let n: Vec<bool> = out
            .iter()
            .map(|o| matches!(o, Ok(KeyOutcome::Inserted)))
            .collect();
        assert_eq!(n, [true, true, false], "key_u1 had 6, quota 8");
        check("a batch insert with a quota").await;
        // Into deleting: one, then several of every tenant, one claimed by its releaser.
        assert!(r
            .transition("sb-u0", &[SandboxState::Creating], SandboxState::Deleting)
            .await
            .unwrap());
        check("a state change to deleting").await;
        let ids: Vec<String> = (6..12).map(|i| format!("sb-u{i}")).collect();
        let moved = r
            .transition_many(
                &ids,
                &[SandboxState::Creating],
                SandboxState::Deleting,
                Some("srv-u"),
            )
            .await
            .unwrap();
        assert!(moved.iter().all(|m| *m));
        assert!(r
            .transition_release(
                "sb-u12",
                &[SandboxState::Creating],
                SandboxState::Deleting,
                "srv-u"
            )
            .await
            .unwrap());
        check("bulk state changes to deleting").await;
        // Out of deleting again, and changes that do not move a record in or out.
        assert!(r
            .transition("sb-u6", &[SandboxState::Deleting], SandboxState::Running)
            .await
            .unwrap());
        let ids: Vec<String> = ["sb-u7", "sb-u8"].map(String::from).to_vec();
        let back = r
            .transition_many(&ids, &[SandboxState::Deleting], SandboxState::Running, None)
            .await
            .unwrap();
        assert_eq!(back, [true, true]);
        assert!(r
            .transition("sb-u1", &[SandboxState::Creating], SandboxState::Running)
            .await
            .unwrap());
        assert!(!r.mark_node_lost("n1").await.unwrap().is_empty());
        check("state changes out of deleting and between live states").await;
        // Removals: a deleting record (counted nothing) and live ones.
        assert!(r.remove("sb-u9").await.unwrap());
        assert!(r.remove("sb-u2").await.unwrap());
        assert!(r.remove("sb-u6").await.unwrap());
        check("removals").await;
        // The quota reads the kept usage: key_u1 now holds 4 (sb-u3, 15, 18, 19), so a
        // quota of 5 admits one more.
        let five = Quota {
            max_sandboxes: Some(5),
            ..tight
        };
        let last = |id: &str, i| mk(id, i, Some("key_u1"));
        assert_eq!(
            r.insert_checked(&last("sb-u30", 30), None, Some(&five))
                .await
                .unwrap(),
            KeyOutcome::Inserted
        );
        assert!(matches!(
            r.insert_checked(&last("sb-u31", 31), None, Some(&five))
                .await
                .unwrap(),
            KeyOutcome::OverQuota(_)
        ));
        check("the last slot").await;
    }

    /// [`UsageProbe`] of a SQLite store.
    fn sqlite_usage(s: &Arc<Store>) -> impl Fn() -> futures::future::BoxFuture<'static, Usage> {
        let s = s.clone();
        move || {
            let s = s.clone();
            Box::pin(async move { crate::store::read_tenant_usage(&s.conn()).unwrap() })
        }
    }

    /// [`UsageProbe`] of a PostgreSQL database.
    fn pg_usage(pool: &Pool) -> impl Fn() -> futures::future::BoxFuture<'static, Usage> {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            Box::pin(async move {
                let c = pool.get().await.unwrap();
                c.query(
                    "SELECT tenant, n, mcpu, mem FROM tenant_usage
                     WHERE n != 0 OR mcpu != 0 OR mem != 0",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
                .collect()
            })
        }
    }

    async fn contract_quota(r: &dyn Registry) {
        let q = Quota {
            max_sandboxes: Some(2),
            max_cpu: None,
            max_memory_mib: None,
        };
        let t = Some("key_q");
        for (i, id) in ["sb-q1", "sb-q2"].iter().enumerate() {
            assert_eq!(
                r.insert_checked(&rec(id, i as i64, t), None, Some(&q))
                    .await
                    .unwrap(),
                KeyOutcome::Inserted
            );
        }
        // Full; the refused create's key is rolled back with it.
        assert!(matches!(
            r.insert_checked(&rec("sb-q3", 5, t), Some(("kq", "d")), Some(&q))
                .await
                .unwrap(),
            KeyOutcome::OverQuota(_)
        ));
        // Other tenants are not counted.
        assert_eq!(
            r.insert_checked(&rec("sb-o", 6, Some("key_o")), None, Some(&q))
                .await
                .unwrap(),
            KeyOutcome::Inserted
        );
        // A deleting sandbox frees its slot.
        assert!(r
            .transition("sb-q1", &[SandboxState::Creating], SandboxState::Deleting)
            .await
            .unwrap());
        assert_eq!(
            r.insert_checked(&rec("sb-q3", 7, t), Some(("kq", "d")), Some(&q))
                .await
                .unwrap(),
            KeyOutcome::Inserted
        );
        // Memory limit.
        let qm = Quota {
            max_sandboxes: None,
            max_cpu: None,
            max_memory_mib: Some(600),
        };
        assert!(matches!(
            r.insert_checked(&rec("sb-m", 8, t), None, Some(&qm))
                .await
                .unwrap(),
            KeyOutcome::OverQuota(m) if m.contains("memory_mib")
        ));
    }

    /// [`Registry::insert_many`]: per-item outcomes in order (quota counting the items
    /// admitted before, replay, mismatch, a duplicate id failing alone), nothing of a
    /// refused or failed item left behind, the rest inserted.
    async fn contract_insert_many(r: &dyn Registry) {
        let t = Some("key_t");
        r.insert_checked(&rec("sb-0", 0, t), None, None)
            .await
            .unwrap();
        r.insert_checked(&rec("sb-k", 1, None), Some(("k1", "d1")), None)
            .await
            .unwrap();
        // Quota 3: one record of the tenant exists, room for two more.
        let q = Quota {
            max_sandboxes: Some(3),
            max_cpu: None,
            max_memory_mib: None,
        };
        let (a, b, c) = (rec("sb-a", 2, t), rec("sb-b", 3, t), rec("sb-c", 4, t));
        let dup = rec("sb-0", 5, Some("key_other"));
        let (e, f, g) = (
            rec("sb-e", 6, None),
            rec("sb-f", 7, None),
            rec("sb-g", 8, None),
        );
        let out = r
            .insert_many(
                &[
                    (&a, Some(("ka", "da")), Some(&q)),
                    (&b, None, Some(&q)),
                    (&c, Some(("kc", "dc")), Some(&q)), // 4th of the tenant: refused, key too
                    (&dup, None, None),                 // duplicate id: fails alone
                    (&e, Some(("k1", "d1")), None),     // replay of sb-k
                    (&f, Some(("k1", "other")), None),  // same key, other body
                    (&g, Some(("kg", "dg")), None),
                ],
                Some(("srv-a", 1_000_000)),
            )
            .await
            .unwrap();
        assert_eq!(out.len(), 7);
        assert_eq!(out[0].as_ref().unwrap(), &KeyOutcome::Inserted);
        assert_eq!(out[1].as_ref().unwrap(), &KeyOutcome::Inserted);
        assert!(
            matches!(out[2], Ok(KeyOutcome::OverQuota(ref m)) if m.contains("at most 3")),
            "{:?}",
            out[2]
        );
        assert!(out[3].is_err(), "{:?}", out[3]);
        assert_eq!(out[4].as_ref().unwrap(), &KeyOutcome::Replay("sb-k".into()));
        assert_eq!(out[5].as_ref().unwrap(), &KeyOutcome::Mismatch);
        assert_eq!(out[6].as_ref().unwrap(), &KeyOutcome::Inserted);
        let ids: Vec<String> = r.list().await.unwrap().into_iter().map(|x| x.id).collect();
        assert_eq!(ids, ["sb-0", "sb-k", "sb-a", "sb-b", "sb-g"]);
        assert_eq!(r.get("sb-0").await.unwrap().unwrap().tenant.as_deref(), t);
        // Keys: ka and kg recorded, kc rolled back with its refused item.
        assert_eq!(r.key_sandbox("ka").await.unwrap().unwrap().1, "sb-a");
        assert_eq!(r.key_sandbox("kg").await.unwrap().unwrap().1, "sb-g");
        assert!(r.key_sandbox("kc").await.unwrap().is_none());
        // The records inserted carry the claim (written with the insert): another server
        // cannot take it while it is live, its holder renews it, and it lapses at its
        // deadline. Records not inserted by this call are not claimed.
        assert!(!r
            .claim_transition("sb-a", "srv-b", 2_000_000, 500_000)
            .await
            .unwrap());
        assert!(r
            .claim_transition("sb-g", "srv-a", 1_000_000, 500_000)
            .await
            .unwrap());
        let stale: Vec<(String, Option<String>, i64)> = r
            .stale_transitions(1_000_000)
            .await
            .unwrap()
            .into_iter()
            .filter(|s| s.owner.is_some())
            .map(|s| (s.record.id, s.owner, s.deadline_ms))
            .collect();
        assert_eq!(
            stale,
            [
                ("sb-a".to_owned(), Some("srv-a".to_owned()), 1_000_000),
                ("sb-b".to_owned(), Some("srv-a".to_owned()), 1_000_000),
                ("sb-g".to_owned(), Some("srv-a".to_owned()), 1_000_000),
            ]
        );
        assert!(r
            .claim_transition("sb-k", "srv-b", 2_000_000, 500_000)
            .await
            .unwrap());
        // A batch whose every item is refused or replayed writes nothing.
        let h = rec("sb-h", 9, t);
        let out = r
            .insert_many(
                &[(&h, Some(("k1", "d1")), Some(&q)), (&h, None, Some(&q))],
                None,
            )
            .await
            .unwrap();
        assert_eq!(out[0].as_ref().unwrap(), &KeyOutcome::Replay("sb-k".into()));
        assert!(
            matches!(out[1], Ok(KeyOutcome::OverQuota(_))),
            "{:?}",
            out[1]
        );
        assert_eq!(r.list().await.unwrap().len(), 5);
        // Without keys and quotas (PostgreSQL: one statement for all): all inserted, with
        // the claim; a duplicate id among them fails alone, the others are inserted.
        let (x, y) = (rec("sb-x", 10, None), rec("sb-y", 11, None));
        let out = r
            .insert_many(&[(&x, None, None), (&y, None, None)], Some(("srv-c", 5)))
            .await
            .unwrap();
        assert_eq!(out.len(), 2);
        assert!(out
            .iter()
            .all(|o| o.as_ref().unwrap() == &KeyOutcome::Inserted));
        assert!(!r.claim_transition("sb-y", "srv-d", 9, 4).await.unwrap());
        assert!(r.claim_transition("sb-y", "srv-d", 9, 5).await.unwrap());
        let z = rec("sb-z", 12, None);
        let out = r
            .insert_many(&[(&z, None, None), (&x, None, None)], None)
            .await
            .unwrap();
        assert_eq!(out[0].as_ref().unwrap(), &KeyOutcome::Inserted);
        assert!(out[1].is_err(), "{:?}", out[1]);
        assert!(r.claim_transition("sb-z", "srv-d", 9, 0).await.unwrap());
        assert_eq!(r.list().await.unwrap().len(), 8);
    }

    /// [`Registry::claim_many`] and [`Registry::transition_many`]: per-id answers in order
    /// (a missing id, another live owner, a state not in `from` answer false and change
    /// nothing), a stale claim taken over, `release` clearing only its own owner's claim.
    async fn contract_bulk(r: &dyn Registry) {
        for (i, id) in ["b-a", "b-b", "b-c"].iter().enumerate() {
            r.insert_checked(&rec(id, i as i64, None), None, None)
                .await
                .unwrap();
        }
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(r.claim_many(&[], "s1", 100, 50).await.unwrap().is_empty());
        assert!(r
            .transition_many(&[], &[SandboxState::Creating], SandboxState::Running, None)
            .await
            .unwrap()
            .is_empty());
        let got = r
            .claim_many(&ids(&["b-a", "b-b", "nope"]), "s1", 100, 50)
            .await
            .unwrap();
        assert_eq!(got, [true, true, false]);
        // b-a is s1's and alive at 60; b-c is free; a renewal by s1 holds.
        let got = r
            .claim_many(&ids(&["b-a", "b-c"]), "s2", 200, 60)
            .await
            .unwrap();
        assert_eq!(got, [false, true]);
        let got = r.claim_many(&ids(&["b-b"]), "s1", 120, 60).await.unwrap();
        assert_eq!(got, [true]);
        // At 150 s1's claim on b-a is stale: s2 takes it over.
        let got = r.claim_many(&ids(&["b-a"]), "s2", 300, 150).await.unwrap();
        assert_eq!(got, [true]);
        let creating = [SandboxState::Creating];
        let got = r
            .transition_many(
                &ids(&["b-a", "b-b", "b-c", "nope"]),
                &creating,
                SandboxState::Running,
                Some("s2"),
            )
            .await
            .unwrap();
        assert_eq!(got, [true, true, true, false]);
        for id in ["b-a", "b-b", "b-c"] {
            let got = r.get(id).await.unwrap().unwrap().state;
            assert_eq!(got, SandboxState::Running, "{id}");
        }
        // Only s1's claim on b-b is left: back in `deleting`, it is listed stale with s1.
        let got = r
            .transition_many(
                &ids(&["b-a", "b-b", "b-c"]),
                &[SandboxState::Running],
                SandboxState::Deleting,
                None,
            )
            .await
            .unwrap();
        assert_eq!(got, [true, true, true]);
        let stale = r.stale_transitions(10_000).await.unwrap();
        let stale: Vec<(&str, Option<&str>)> = stale
            .iter()
            .map(|t| (t.record.id.as_str(), t.owner.as_deref()))
            .collect();
        assert_eq!(stale, [("b-b", Some("s1"))]);
        // A state not in `from` changes nothing.
        let got = r
            .transition_many(
                &ids(&["b-a"]),
                &[SandboxState::Running],
                SandboxState::Paused,
                None,
            )
            .await
            .unwrap();
        assert_eq!(got, [false]);
        assert_eq!(
            r.get("b-a").await.unwrap().unwrap().state,
            SandboxState::Deleting
        );
    }

    /// Concurrent creates on ONE registry (the group writers of both stores): 80 creates of
    /// one tenant against a quota of 50, each admitted one claimed and then marked running
    /// with its claim released; exactly the quota admitted, every write applied, and a
    /// duplicate id failing alone without stopping the writes grouped with it.
    async fn contract_concurrent(r: Arc<dyn Registry>) {
        let q = Quota {
            max_sandboxes: Some(50),
            max_cpu: None,
            max_memory_mib: None,
        };
        let tasks: Vec<_> = (0..80)
            .map(|i| {
                let r = r.clone();
                tokio::spawn(async move {
                    let x = rec(&format!("sb-{i:03}"), i, Some("key_c"));
                    let key = format!("key-{i}");
                    let out = r
                        .insert_checked(&x, Some((&key, "d")), Some(&q))
                        .await
                        .unwrap();
                    if out != KeyOutcome::Inserted {
                        assert!(matches!(out, KeyOutcome::OverQuota(_)), "{out:?}");
                        return false;
                    }
                    assert!(r.claim_transition(&x.id, "srv", 10, 1).await.unwrap());
                    assert!(r
                        .transition_release(
                            &x.id,
                            &[SandboxState::Creating],
                            SandboxState::Running,
                            "srv"
                        )
                        .await
                        .unwrap());
                    true
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += usize::from(t.await.unwrap());
        }
        assert_eq!(admitted, 50, "exactly the quota admitted");
        let all = r.list().await.unwrap();
        assert_eq!(all.len(), 50);
        assert!(all.iter().all(|x| x.state == SandboxState::Running));
        // Claims were released: a stale-transition scan far in the future sees none.
        assert!(r.stale_transitions(i64::MAX / 2).await.unwrap().is_empty());
        // A duplicate id among concurrent creates fails alone.
        let tasks: Vec<_> = (0..20)
            .map(|i| {
                let r = r.clone();
                let id = if i == 7 {
                    all[0].id.clone()
                } else {
                    format!("sb-new{i}")
                };
                tokio::spawn(
                    async move { r.insert_checked(&rec(&id, 100, None), None, None).await },
                )
            })
            .collect();
        let mut failed = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(KeyOutcome::Inserted) => {}
                Err(_) => failed += 1,
                Ok(other) => panic!("{other:?}"),
            }
        }
        assert_eq!(failed, 1);
        assert_eq!(r.list().await.unwrap().len(), 69);
    }

    /// `regs[i]` race for the last quota slot of one tenant, then on one Idempotency-Key:
    /// exactly one wins each race.
    async fn contract_races(regs: Vec<Arc<dyn Registry>>) {
        let q = Quota {
            max_sandboxes: Some(3),
            max_cpu: None,
            max_memory_mib: None,
        };
        let t = Some("key_race");
        for id in ["sb-r1", "sb-r2"] {
            regs[0]
                .insert_checked(&rec(id, 0, t), None, Some(&q))
                .await
                .unwrap();
        }
        let tasks: Vec<_> = regs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let r = r.clone();
                tokio::spawn(async move {
                    r.insert_checked(&rec(&format!("sb-slot{i}"), 1, t), None, Some(&q))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            match task.await.unwrap() {
                KeyOutcome::Inserted => won += 1,
                KeyOutcome::OverQuota(_) => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(won, 1, "exactly one create takes the last slot");

        let tasks: Vec<_> = regs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let r = r.clone();
                tokio::spawn(async move {
                    let id = format!("sb-key{i}");
                    let out = r
                        .insert_checked(&rec(&id, 2, None), Some(("race-key", "d")), None)
                        .await
                        .unwrap();
                    (id, out)
                })
            })
            .collect();
        let mut winner = None;
        let mut replays = Vec::new();
        for task in tasks {
            match task.await.unwrap() {
                (id, KeyOutcome::Inserted) => {
                    assert!(winner.is_none(), "two creates for one key");
                    winner = Some(id);
                }
                (_, KeyOutcome::Replay(sid)) => replays.push(sid),
                other => panic!("{other:?}"),
            }
        }
        let winner = winner.expect("one create for the key");
        assert!(
            replays.iter().all(|s| *s == winner),
            "{replays:?} vs {winner}"
        );
        let keyed = regs[0]
            .list()
            .await
            .unwrap()
            .into_iter()
            .filter(|x| x.id.starts_with("sb-key"))
            .count();
        assert_eq!(keyed, 1);
    }

    fn sqlite(name: &str) -> (tempfile::TempDir, Arc<Store>) {
        let dir = tempfile::Builder::new()
            .prefix(&format!("sandlot-registry-test-{name}-"))
            .tempdir()
            .unwrap();
        let s = Store::open(&dir.path().join("sandlot.db")).unwrap();
        (dir, Arc::new(s))
    }

    async fn contract_keys(r: &dyn Registry) {
        assert!(!r.has_keys().await.unwrap());
        let k = |id: &str, digest: &str, at| KeyRow {
            id: id.into(),
            name: format!("name-{id}"),
            digest: digest.into(),
            admin: id == "key_a",
            quota: Quota {
                max_sandboxes: Some(3),
                max_cpu: Some(1.5),
                max_memory_mib: None,
            },
            created_at_ms: at,
            revoked_at_ms: None,
        };
        r.insert_key(&k("key_a", "da", 1)).await.unwrap();
        r.insert_key(&k("key_b", "db", 2)).await.unwrap();
        // Duplicate digest refused.
        assert!(r.insert_key(&k("key_c", "da", 3)).await.is_err());
        assert!(r.has_keys().await.unwrap());
        assert_eq!(
            r.key_by_digest("db").await.unwrap(),
            Some(k("key_b", "db", 2))
        );
        assert!(r.key_by_digest("zz").await.unwrap().is_none());
        assert!(r.revoke_key("key_b", 9).await.unwrap());
        assert!(!r.revoke_key("key_b", 10).await.unwrap());
        let keys = r.list_keys().await.unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!((keys[0].admin, keys[1].revoked_at_ms), (true, Some(9)));
        // Trajectory ownership: first claim wins.
        assert!(r.claim_trajectory("t", "key_a").await.unwrap());
        assert!(r.claim_trajectory("t", "key_a").await.unwrap());
        assert!(!r.claim_trajectory("t", "key_b").await.unwrap());
        assert_eq!(
            r.trajectory_owner("t").await.unwrap().as_deref(),
            Some("key_a")
        );
        r.forget_trajectory_owner("t").await.unwrap();
        assert!(r.trajectory_owner("t").await.unwrap().is_none());
        // Idempotency keys expire by age.
        r.insert_checked(&rec("sb-p", 100, None), Some(("old", "d")), None)
            .await
            .unwrap();
        assert_eq!(r.purge_keys(100).await.unwrap(), 0);
        assert_eq!(r.purge_keys(101).await.unwrap(), 1);
        // Checkpoint records.
        let ck = |id: &str, at| CheckpointRow {
            id: id.into(),
            sandbox_id: "sb-1".into(),
            backend: Backend::Container,
            image: "python".into(),
            runtime: Some("runc".into()),
            disk_mib: 1024,
            size_bytes: 5 << 20,
            created_at_ms: at,
            tenant: Some("key_a".into()),
        };
        r.insert_checkpoint(&ck("ck-2", 2)).await.unwrap();
        r.insert_checkpoint(&ck("ck-1", 1)).await.unwrap();
        assert!(r.insert_checkpoint(&ck("ck-1", 1)).await.is_err());
        assert_eq!(r.get_checkpoint("ck-2").await.unwrap(), Some(ck("ck-2", 2)));
        assert!(r.get_checkpoint("ck-9").await.unwrap().is_none());
        let ids: Vec<String> = r
            .list_checkpoints()
            .await
            .unwrap()
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(ids, ["ck-1", "ck-2"]);
        // E2B snapshot names: set, replaced, and removed with their checkpoint.
        assert!(r.checkpoint_names().await.unwrap().is_empty());
        r.set_checkpoint_name("ck-1", "first").await.unwrap();
        r.set_checkpoint_name("ck-2", "two").await.unwrap();
        r.set_checkpoint_name("ck-2", "second").await.unwrap();
        let names = r.checkpoint_names().await.unwrap();
        assert_eq!(
            names,
            BTreeMap::from([
                ("ck-1".to_owned(), "first".to_owned()),
                ("ck-2".to_owned(), "second".to_owned())
            ])
        );
        r.remove_checkpoint("ck-1").await.unwrap();
        r.remove_checkpoint("ck-1").await.unwrap();
        assert_eq!(r.list_checkpoints().await.unwrap().len(), 1);
        let names = r.checkpoint_names().await.unwrap();
        assert_eq!(names.keys().collect::<Vec<_>>(), ["ck-2"]);
    }

    #[tokio::test]
    async fn sqlite_contract() {
        let (_d, s) = sqlite("keys");
        contract_keys(&*s).await;
        let (_d, s) = sqlite("records");
        contract_records(&*s).await;
        let (_d, s) = sqlite("quota");
        contract_quota(&*s).await;
        let (_d, s) = sqlite("many");
        contract_insert_many(&*s).await;
        let (_d, s) = sqlite("lost");
        contract_mark_node_lost(&*s).await;
        let (_d, s) = sqlite("page");
        contract_list_page_and_summary(&*s).await;
        let (_d, s) = sqlite("bulk");
        contract_bulk(&*s).await;
        let (_d, s) = sqlite("usage");
        contract_usage(&*s, &sqlite_usage(&s)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite_races() {
        // Embedded mode: one process, one Store shared by every handler.
        let (_d, s) = sqlite("races");
        let regs: Vec<Arc<dyn Registry>> = (0..8).map(|_| s.clone() as Arc<dyn Registry>).collect();
        contract_races(regs).await;
    }

    /// `n` registries on a fresh PostgreSQL database, each with its own pool of one
    /// connection (as separate servers), or `None` (skipped).
    async fn pg(test: &str, n: usize) -> Option<Vec<Arc<dyn Registry>>> {
        let url = crate::pg::testing::fresh_database(test).await?;
        let mut v: Vec<Arc<dyn Registry>> = Vec::new();
        for _ in 0..n {
            let pool = crate::pg::connect(&url, 1).await.unwrap();
            v.push(Arc::new(PgRegistry::new(pool)));
        }
        Some(v)
    }

    #[tokio::test]
    async fn pg_contract() {
        let Some(r) = pg("pg_contract_keys", 1).await else {
            return;
        };
        contract_keys(&*r[0]).await;
        let Some(r) = pg("pg_contract_records", 1).await else {
            return;
        };
        contract_records(&*r[0]).await;
        let Some(r) = pg("pg_contract_quota", 1).await else {
            return;
        };
        contract_quota(&*r[0]).await;
        let Some(r) = pg("pg_contract_many", 1).await else {
            return;
        };
        contract_insert_many(&*r[0]).await;
        let Some(r) = pg("pg_contract_lost", 1).await else {
            return;
        };
        contract_mark_node_lost(&*r[0]).await;
        let Some(r) = pg("pg_contract_page", 1).await else {
            return;
        };
        contract_list_page_and_summary(&*r[0]).await;
        let Some(r) = pg("pg_contract_bulk", 1).await else {
            return;
        };
        contract_bulk(&*r[0]).await;
        let Some(url) = crate::pg::testing::fresh_database("pg_contract_usage").await else {
            return;
        };
        let pool = crate::pg::connect(&url, 2).await.unwrap();
        contract_usage(&PgRegistry::new(pool.clone()), &pg_usage(&pool)).await;
    }

    /// A test fake: the SQLite [`Store`] behind the trait's DEFAULT `insert_many` (every
    /// other call delegated), whose `claim_transition` fails for ids starting `fail-`.
    struct FakeClaimFails(Arc<Store>);

    #[async_trait]
    impl Registry for FakeClaimFails {
        async fn insert_checked(
            &self,
            rec: &Record,
            key: Option<(&str, &str)>,
            quota: Option<&Quota>,
        ) -> Result<KeyOutcome> {
            Registry::insert_checked(&*self.0, rec, key, quota).await
        }
        async fn get(&self, id: &str) -> Result<Option<Record>> {
            Registry::get(&*self.0, id).await
        }
        async fn list(&self) -> Result<Vec<Record>> {
            Registry::list(&*self.0).await
        }
        async fn list_labeled(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Record>> {
            Registry::list_labeled(&*self.0, labels).await
        }
        async fn count_by_state(&self) -> Result<Vec<(String, String, u64)>> {
            Registry::count_by_state(&*self.0).await
        }
        async fn list_page(
            &self,
            labels: &BTreeMap<String, String>,
            tenant: Option<&str>,
            after: Option<(i64, &str)>,
            limit: usize,
        ) -> Result<Vec<Record>> {
            Registry::list_page(&*self.0, labels, tenant, after, limit).await
        }
        async fn summary(&self) -> Result<Summary> {
            Registry::summary(&*self.0).await
        }
        async fn live_by_trajectory(&self, trajectory: &str) -> Result<Option<Record>> {
            Registry::live_by_trajectory(&*self.0, trajectory).await
        }
        async fn due_for_reaping(&self, now_ms: i64) -> Result<Vec<Record>> {
            Registry::due_for_reaping(&*self.0, now_ms).await
        }
        async fn transition(
            &self,
            id: &str,
            from: &[SandboxState],
            to: SandboxState,
        ) -> Result<bool> {
            Registry::transition(&*self.0, id, from, to).await
        }
        async fn mark_node_lost(&self, node: &str) -> Result<Vec<(String, Backend)>> {
            Registry::mark_node_lost(&*self.0, node).await
        }
        async fn set_node(&self, id: &str, node: &str) -> Result<bool> {
            Registry::set_node(&*self.0, id, node).await
        }
        async fn set_expiry(
            &self,
            id: &str,
            expires_at_ms: Option<i64>,
            ttl_s: u64,
        ) -> Result<bool> {
            Registry::set_expiry(&*self.0, id, expires_at_ms, ttl_s).await
        }
        async fn remove(&self, id: &str) -> Result<bool> {
            Registry::remove(&*self.0, id).await
        }
        async fn key_sandbox(&self, key: &str) -> Result<Option<(String, String)>> {
            Registry::key_sandbox(&*self.0, key).await
        }
        async fn forget_keys_of(&self, id: &str) -> Result<()> {
            Registry::forget_keys_of(&*self.0, id).await
        }
        async fn set_transition(&self, id: &str, owner: Option<(&str, i64)>) -> Result<bool> {
            Registry::set_transition(&*self.0, id, owner).await
        }
        async fn release_transition(&self, id: &str, owner: &str) -> Result<bool> {
            Registry::release_transition(&*self.0, id, owner).await
        }
        async fn transition_release(
            &self,
            id: &str,
            from: &[SandboxState],
            to: SandboxState,
            owner: &str,
        ) -> Result<bool> {
            Registry::transition_release(&*self.0, id, from, to, owner).await
        }
        async fn claim_many(
            &self,
            ids: &[String],
            owner: &str,
            deadline_ms: i64,
            now_ms: i64,
        ) -> Result<Vec<bool>> {
            Registry::claim_many(&*self.0, ids, owner, deadline_ms, now_ms).await
        }
        async fn transition_many(
            &self,
            ids: &[String],
            from: &[SandboxState],
            to: SandboxState,
            release: Option<&str>,
        ) -> Result<Vec<bool>> {
            Registry::transition_many(&*self.0, ids, from, to, release).await
        }
        async fn stale_transitions(&self, now_ms: i64) -> Result<Vec<StaleTransition>> {
            Registry::stale_transitions(&*self.0, now_ms).await
        }
        async fn purge_keys(&self, before_ms: i64) -> Result<usize> {
            Registry::purge_keys(&*self.0, before_ms).await
        }
        async fn insert_key(&self, k: &KeyRow) -> Result<()> {
            Registry::insert_key(&*self.0, k).await
        }
        async fn key_by_digest(&self, digest: &str) -> Result<Option<KeyRow>> {
            Registry::key_by_digest(&*self.0, digest).await
        }
        async fn list_keys(&self) -> Result<Vec<KeyRow>> {
            Registry::list_keys(&*self.0).await
        }
        async fn revoke_key(&self, id: &str, now_ms: i64) -> Result<bool> {
            Registry::revoke_key(&*self.0, id, now_ms).await
        }
        async fn has_keys(&self) -> Result<bool> {
            Registry::has_keys(&*self.0).await
        }
        async fn claim_trajectory(&self, t: &str, tenant: &str) -> Result<bool> {
            Registry::claim_trajectory(&*self.0, t, tenant).await
        }
        async fn trajectory_owner(&self, t: &str) -> Result<Option<String>> {
            Registry::trajectory_owner(&*self.0, t).await
        }
        async fn forget_trajectory_owner(&self, t: &str) -> Result<()> {
            Registry::forget_trajectory_owner(&*self.0, t).await
        }
        async fn insert_checkpoint(&self, c: &CheckpointRow) -> Result<()> {
            Registry::insert_checkpoint(&*self.0, c).await
        }
        async fn get_checkpoint(&self, id: &str) -> Result<Option<CheckpointRow>> {
            Registry::get_checkpoint(&*self.0, id).await
        }
        async fn list_checkpoints(&self) -> Result<Vec<CheckpointRow>> {
            Registry::list_checkpoints(&*self.0).await
        }
        async fn remove_checkpoint(&self, id: &str) -> Result<()> {
            Registry::remove_checkpoint(&*self.0, id).await
        }
        async fn set_checkpoint_name(&self, id: &str, name: &str) -> Result<()> {
            Registry::set_checkpoint_name(&*self.0, id, name).await
        }
        async fn checkpoint_names(&self) -> Result<BTreeMap<String, String>> {
            Registry::checkpoint_names(&*self.0).await
        }

        async fn claim_transition(
            &self,
            id: &str,
            owner: &str,
            deadline_ms: i64,
            now_ms: i64,
        ) -> Result<bool> {
            if id.starts_with("fail-") {
                return Err(StoreError::Unavailable(format!(
                    "injected claim failure for {id}"
                )));
            }
            Registry::claim_transition(&*self.0, id, owner, deadline_ms, now_ms).await
        }
    }

    /// The default `insert_many` leaves nothing half-done: an item whose claim fails is
    /// removed again (record and key) and answers the claim's error; the items before and
    /// after it are inserted and claimed.
    #[tokio::test]
    async fn default_insert_many_removes_an_item_whose_claim_fails() {
        let (_d, s) = sqlite("default_many");
        let r = FakeClaimFails(s);
        let (a, b, c) = (
            rec("sb-a", 1, None),
            rec("fail-b", 2, None),
            rec("sb-c", 3, None),
        );
        let out = r
            .insert_many(
                &[
                    (&a, None, None),
                    (&b, Some(("kb", "db")), None),
                    (&c, Some(("kc", "dc")), None),
                ],
                Some(("srv-a", 1_000_000)),
            )
            .await
            .expect("the call as a whole succeeds");
        assert_eq!(out[0].as_ref().unwrap(), &KeyOutcome::Inserted);
        let e = out[1].as_ref().unwrap_err();
        assert!(e.to_string().contains("injected claim failure"), "{e}");
        assert_eq!(out[2].as_ref().unwrap(), &KeyOutcome::Inserted);
        let ids: Vec<String> = r.list().await.unwrap().into_iter().map(|x| x.id).collect();
        assert_eq!(ids, ["sb-a", "sb-c"]);
        assert!(r.key_sandbox("kb").await.unwrap().is_none());
        assert_eq!(r.key_sandbox("kc").await.unwrap().unwrap().1, "sb-c");
        for id in ["sb-a", "sb-c"] {
            assert!(!r
                .claim_transition(id, "srv-b", 2_000_000, 500_000)
                .await
                .unwrap());
        }
    }

    /// A [`PgRegistry`] on a fresh database `name`, reached through
    /// [`commit_cutting_proxy`], and the proxy's arming flag; `None` without PostgreSQL.
    async fn behind_commit_cutter(
        name: &str,
    ) -> Option<(PgRegistry, Arc<std::sync::atomic::AtomicBool>)> {
        let url = crate::pg::testing::fresh_database(name).await?;
        let (user, rest) = url.rsplit_once('@').expect("postgres://USER@HOST:PORT/DB");
        let (hostport, db) = rest.split_once('/').expect("a database");
        let (port, armed) = commit_cutting_proxy(hostport.to_owned()).await;
        let pool = crate::pg::connect(&format!("{user}@127.0.0.1:{port}/{db}"), 2)
            .await
            .unwrap();
        Some((PgRegistry::new(pool), armed))
    }

    /// A TCP proxy to PostgreSQL at `target` (`host:port`): relays both ways until armed;
    /// then the first client chunk holding `COMMIT` is sent on to PostgreSQL, but its
    /// answer never comes back (the client's connection is closed first): the commit
    /// happened and the client cannot know, as when a network drops at that moment. The
    /// flag is cleared when it cut one. Returns its port and the flag.
    async fn commit_cutting_proxy(target: String) -> (u16, Arc<std::sync::atomic::AtomicBool>) {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let flag = armed.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = l.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let armed = armed.clone();
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let cut = Arc::new(tokio::sync::Notify::new());
                    let stop = cut.clone();
                    let down = tokio::spawn(async move {
                        let mut buf = vec![0u8; 1 << 16];
                        loop {
                            tokio::select! {
                                _ = stop.notified() => return,
                                n = sr.read(&mut buf) => match n {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => {
                                        if cw.write_all(&buf[..n]).await.is_err() {
                                            return;
                                        }
                                    }
                                },
                            }
                        }
                    });
                    let mut buf = vec![0u8; 1 << 16];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let commit = buf[..n].windows(6).any(|w| w == b"COMMIT");
                        if commit && armed.swap(false, Ordering::SeqCst) {
                            // Stop relaying answers (closes the client's side), then let
                            // PostgreSQL have the COMMIT and the time to run it.
                            cut.notify_one();
                            let _ = down.await;
                            let _ = sw.write_all(&buf[..n]).await;
                            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                            return;
                        }
                        if sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        (port, flag)
    }

    /// Review finding: a batch insert whose COMMIT's answer is lost (the connection drops
    /// after PostgreSQL committed) retries item by item and meets its own rows; they are
    /// recognised (same record, same claim) and answered `Inserted`, claimed as written.
    /// Another create's row of the same id still answers its duplicate error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pg_batch_insert_recognises_its_own_rows_after_a_lost_commit() {
        use std::sync::atomic::Ordering;
        let Some((r, armed)) = behind_commit_cutter("pg_lost_commit").await else {
            return;
        };
        let claim = Some(("srv-a", 1_000_000));
        // Keyless items: the one-statement path.
        let recs: Vec<Record> = (0..3)
            .map(|i| rec(&format!("sb-cut{i}"), i, None))
            .collect();
        let items: Vec<InsertItem> = recs.iter().map(|x| (x, None, None)).collect();
        armed.store(true, Ordering::SeqCst);
        let out = r.insert_many(&items, claim).await.unwrap();
        assert!(!armed.load(Ordering::SeqCst), "the proxy cut no COMMIT");
        for o in &out {
            assert_eq!(o.as_ref().unwrap(), &KeyOutcome::Inserted, "{out:?}");
        }
        // Keyed items: one grouped write each; the retry meets its own keys.
        let keyed: Vec<Record> = (3..5)
            .map(|i| rec(&format!("sb-cut{i}"), i, None))
            .collect();
        let items: Vec<InsertItem> = vec![
            (&keyed[0], Some(("kc3", "d3")), None),
            (&keyed[1], Some(("kc4", "d4")), None),
        ];
        armed.store(true, Ordering::SeqCst);
        let out = r.insert_many(&items, claim).await.unwrap();
        assert!(!armed.load(Ordering::SeqCst), "the proxy cut no COMMIT");
        for o in &out {
            assert_eq!(o.as_ref().unwrap(), &KeyOutcome::Inserted, "{out:?}");
        }
        let ids: Vec<String> = r.list().await.unwrap().into_iter().map(|x| x.id).collect();
        assert_eq!(ids, ["sb-cut0", "sb-cut1", "sb-cut2", "sb-cut3", "sb-cut4"]);
        for id in &ids {
            assert!(!r
                .claim_transition(id, "srv-b", 2_000_000, 500_000)
                .await
                .unwrap());
        }
        // Not ours: another record under an existing id, or our record under another
        // claim, is a duplicate as before; the rest of its batch goes in.
        let other = rec("sb-cut0", 99, None);
        let fresh = rec("sb-fresh", 100, None);
        let out = r
            .insert_many(
                &[
                    (&other, None, None),
                    (&recs[1], None, None),
                    (&fresh, None, None),
                ],
                Some(("srv-b", 2_000_000)),
            )
            .await
            .unwrap();
        assert!(out[0].is_err(), "{out:?}");
        assert!(out[1].is_err(), "{out:?}");
        assert_eq!(out[2].as_ref().unwrap(), &KeyOutcome::Inserted);
    }

    /// Review finding: a bulk state change (a label pause's chunk) whose COMMIT's answer is
    /// lost was reported failed (alone in its group) or unchanged (retried in a group)
    /// although PostgreSQL had committed it: the records were `paused` while the caller
    /// left their sandboxes running. Now it runs again counting what the first run left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pg_transition_many_after_a_lost_commit_reports_its_changes() {
        use std::sync::atomic::Ordering;
        let Some((r, armed)) = behind_commit_cutter("pg_lost_commit_tr").await else {
            return;
        };
        let ids: Vec<String> = (0..4).map(|i| format!("sb-tr{i}")).collect();
        for (i, id) in ids.iter().enumerate() {
            let mut x = rec(id, i as i64, None);
            x.state = SandboxState::Running;
            r.insert_checked(&x, None, None).await.unwrap();
        }
        // sb-tr3 is already paused: not this call's change.
        assert!(r
            .transition(&ids[3], &[SandboxState::Running], SandboxState::Paused)
            .await
            .unwrap());
        let run = &ids[..3];
        armed.store(true, Ordering::SeqCst);
        let changed = r
            .transition_many(run, &[SandboxState::Running], SandboxState::Paused, None)
            .await
            .unwrap();
        assert!(!armed.load(Ordering::SeqCst), "the proxy cut no COMMIT");
        assert_eq!(changed, [true, true, true]);
        for id in &ids {
            assert_eq!(
                r.get(id).await.unwrap().unwrap().state,
                SandboxState::Paused
            );
        }
        // Without a cut, an id already in the target state is not reported changed.
        let changed = r
            .transition_many(&ids, &[SandboxState::Running], SandboxState::Paused, None)
            .await
            .unwrap();
        assert_eq!(changed, [false, false, false, false]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sqlite_concurrent() {
        let (_d, s) = sqlite("concurrent");
        contract_concurrent(s).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn pg_concurrent() {
        // One registry on a pool of several connections, as one server.
        let Some(url) = crate::pg::testing::fresh_database("pg_concurrent").await else {
            return;
        };
        let pool = crate::pg::connect(&url, 8).await.unwrap();
        contract_concurrent(Arc::new(PgRegistry::new(pool))).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn pg_races() {
        let Some(regs) = pg("pg_races", 8).await else {
            return;
        };
        contract_races(regs).await;
    }
}
