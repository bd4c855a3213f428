//! Node membership: a node registers its [`NodeRecord`] under a lease; servers watch the set.
use crate::error::{call, call_retry, ClusterError};
use crate::fence::Fence;
use crate::lease::{grant, keep_alive_until_lost, revoke, LeaseConfig};
use crate::record::NodeRecord;
use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::{broadcast, Mutex};
use tokio::task::JoinHandle;

/// Key prefix of node records: a node named `N` lives at `/sandlot/nodes/N`.
pub const NODES_PREFIX: &str = "/sandlot/nodes/";

/// The etcd key of node `name`.
///
/// # Errors
/// [`ClusterError::InvalidArgument`] when `name` is empty, longer than 253 bytes, or holds
/// anything but ASCII letters, digits, `-`, `_` and `.`.
pub fn node_key(name: &str) -> Result<String, ClusterError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok {
        return Err(ClusterError::InvalidArgument(format!(
            "node name {name:?}: use 1..=253 of [A-Za-z0-9._-]"
        )));
    }
    Ok(format!("{NODES_PREFIX}{name}"))
}

/// A node's registration: its record at `/sandlot/nodes/<name>` under a lease kept alive
/// by a background task, and the [`Fence`] that says whether the node may serve.
///
/// When the fence goes off (renewals failed for `ttl - margin`, or etcd no longer knows the
/// lease) the task keeps trying, every keep-alive interval, to register again under a
/// **new** lease (grant, then put the latest record under it, then revoke the old lease);
/// the fence turns on with a higher [`Fence::epoch`] once that succeeded.
///
/// Dropping the registration aborts the keep-alive task without revoking the lease (as a
/// `kill -9` would): the record disappears when etcd expires the lease, within `ttl`.
/// [`NodeRegistration::deregister`] removes it at once.
///
/// A node that restarts under the same name overwrites the record of its previous process
/// (the old lease then holds no key and expires unseen); two live nodes with one name are a
/// configuration error this does not detect.
pub struct NodeRegistration {
    client: Client,
    key: String,
    cfg: LeaseConfig,
    fence: Fence,
    /// The latest record. Its lock is held across every put, so a usage update can never
    /// re-attach the key to an old lease after a re-registration moved it to a new one.
    record: Arc<Mutex<NodeRecord>>,
    task: JoinHandle<()>,
}

/// Grants a lease and puts the record under it.
async fn put_under_new_lease(
    client: &Client,
    key: &str,
    record: &NodeRecord,
    cfg: &LeaseConfig,
    fence: &Fence,
) -> Result<(), ClusterError> {
    let (lease_id, sent, granted) = grant(client, cfg).await?;
    let value = serde_json::to_vec(record).map_err(|source| ClusterError::Decode {
        key: key.to_owned(),
        source,
    })?;
    let kv = client.kv_client();
    let limit = cfg.keepalive_interval.max(Duration::from_secs(1));
    let put = || {
        let (mut kv, value) = (kv.clone(), value.clone());
        async move {
            kv.put(key, value, Some(PutOptions::new().with_lease(lease_id)))
                .await
        }
    };
    if let Err(e) = call_retry("put node record", limit, put).await {
        revoke(client, lease_id, cfg).await;
        return Err(e);
    }
    fence.start(lease_id, cfg.serving_until(sent, granted));
    Ok(())
}

impl NodeRegistration {
    /// Registers `record` under a new lease and starts keeping it alive.
    ///
    /// # Errors
    /// [`ClusterError::InvalidArgument`] for a bad node name; [`ClusterError::Etcd`] or
    /// [`ClusterError::Timeout`] when etcd does not take the grant or the put (nothing is
    /// left behind: a granted lease is revoked, or expires).
    pub async fn register(
        client: &Client,
        record: NodeRecord,
        cfg: LeaseConfig,
    ) -> Result<Self, ClusterError> {
        let key = node_key(&record.name)?;
        let fence = Fence::new();
        put_under_new_lease(client, &key, &record, &cfg, &fence).await?;
        tracing::info!(node = %record.name, lease_id = fence.lease_id(), ttl = ?cfg.ttl, "registered in etcd");
        let record = Arc::new(Mutex::new(record));
        let task = tokio::spawn(keep_registered(
            client.clone(),
            key.clone(),
            record.clone(),
            cfg,
            fence.clone(),
        ));
        Ok(NodeRegistration {
            client: client.clone(),
            key,
            cfg,
            fence,
            record,
            task,
        })
    }

    /// The fence of this node: check [`Fence::is_serving`] before serving each call.
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Shorthand for `self.fence().is_serving()`.
    pub fn is_serving(&self) -> bool {
        self.fence.is_serving()
    }

    /// Changes the record (e.g. its usage or cached images) and publishes it under the
    /// current lease.
    ///
    /// # Errors
    /// [`ClusterError::Fenced`] while the fence is off: the change is kept and published by
    /// the next re-registration. [`ClusterError::Etcd`] / [`ClusterError::Timeout`] when the
    /// put fails (the change is kept and goes out with the next update or re-registration).
    pub async fn update(&self, change: impl FnOnce(&mut NodeRecord)) -> Result<(), ClusterError> {
        let mut record = self.record.lock().await;
        change(&mut record);
        if !self.fence.is_serving() {
            return Err(ClusterError::Fenced {
                name: record.name.clone(),
            });
        }
        let value = serde_json::to_vec(&*record).map_err(|source| ClusterError::Decode {
            key: self.key.clone(),
            source,
        })?;
        let kv = self.client.kv_client();
        let lease_id = self.fence.lease_id();
        let key = self.key.as_str();
        let put = || {
            let (mut kv, value) = (kv.clone(), value.clone());
            async move {
                kv.put(key, value, Some(PutOptions::new().with_lease(lease_id)))
                    .await
            }
        };
        let limit = self.cfg.keepalive_interval.max(Duration::from_secs(1));
        call_retry("put node record", limit, put).await?;
        Ok(())
    }

    /// A copy of the record as last set.
    pub async fn record(&self) -> NodeRecord {
        self.record.lock().await.clone()
    }

    /// Leaves the cluster now: stops the keep-alive and revokes the lease, which deletes
    /// the record (watchers see the node `down` at once).
    ///
    /// # Errors
    /// [`ClusterError::Etcd`] / [`ClusterError::Timeout`] when the revoke fails; the record
    /// then goes when the lease expires.
    pub async fn deregister(self) -> Result<(), ClusterError> {
        self.task.abort();
        let lease_id = self.fence.lease_id();
        self.fence.off();
        let mut lc = self.client.lease_client();
        call("lease revoke", Duration::from_secs(2), lc.revoke(lease_id)).await?;
        Ok(())
    }
}

impl Drop for NodeRegistration {
    fn drop(&mut self) {
        self.task.abort();
        self.fence.off();
    }
}

/// The registration task: keep the lease alive; once lost, re-register under a new one.
async fn keep_registered(
    client: Client,
    key: String,
    record: Arc<Mutex<NodeRecord>>,
    cfg: LeaseConfig,
    fence: Fence,
) {
    loop {
        let old = fence.lease_id();
        keep_alive_until_lost(&client, old, &fence, &cfg).await;
        loop {
            tokio::time::sleep(cfg.keepalive_interval).await;
            let rec = record.lock().await;
            match put_under_new_lease(&client, &key, &rec, &cfg, &fence).await {
                Ok(()) => {
                    drop(rec);
                    tracing::debug!(%key, lease_id = fence.lease_id(), epoch = fence.epoch(), "re-registered under a new lease");
                    let client = client.clone();
                    tokio::spawn(async move { revoke(&client, old, &cfg).await });
                    break;
                }
                Err(e) => tracing::warn!(%key, error = %e, "re-registration failed; retrying"),
            }
        }
    }
}

/// A change of the node set seen by [`NodeSet`].
#[derive(Debug, Clone, PartialEq)]
pub enum NodeEvent {
    /// A node registered (or came back after being down).
    Up(NodeRecord),
    /// A registered node published a new record (usage, images, ...).
    Updated(NodeRecord),
    /// A node's record is gone: its lease expired (crash, partition) or it deregistered.
    /// Carries its last known record.
    Down(NodeRecord),
}

/// The node set by name. Shared as an `Arc` snapshot: readers (placement runs on every
/// create) take it without copying a record; a change copies the map of `Arc`s once.
pub type Nodes = BTreeMap<String, Arc<NodeRecord>>;

/// A server's live view of the nodes: an initial read of `/sandlot/nodes/` and a watch of
/// that prefix from the read's revision, so no change is missed between the two.
///
/// After a broken watch (etcd member lost, compaction) the task reads the prefix again,
/// reports the difference as events, and watches from the new revision.
#[derive(Debug)]
pub struct NodeSet {
    nodes: Arc<RwLock<Arc<Nodes>>>,
    events: broadcast::Sender<NodeEvent>,
    task: JoinHandle<()>,
}

impl NodeSet {
    /// Reads the current node set and starts watching it.
    ///
    /// # Errors
    /// [`ClusterError::Etcd`] / [`ClusterError::Timeout`] when the initial read fails.
    pub async fn start(client: &Client) -> Result<Self, ClusterError> {
        let (nodes, revision) = read_all(client).await?;
        let nodes = Arc::new(RwLock::new(Arc::new(nodes)));
        let (events, _) = broadcast::channel(1024);
        let task = tokio::spawn(watch_nodes(
            client.clone(),
            nodes.clone(),
            events.clone(),
            revision,
        ));
        Ok(NodeSet {
            nodes,
            events,
            task,
        })
    }

    /// The records of all nodes now up, by name: a snapshot (an `Arc` clone, no copy).
    pub fn nodes(&self) -> Arc<Nodes> {
        self.nodes.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The record of node `name` if it is up.
    pub fn get(&self, name: &str) -> Option<NodeRecord> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|r| NodeRecord::clone(r))
    }

    /// The current set and a stream of every change after it (taken atomically: no event
    /// is lost or counted twice). A receiver that falls more than 1024 events behind gets
    /// `Lagged` and should take a new snapshot.
    pub fn subscribe(&self) -> (Arc<Nodes>, broadcast::Receiver<NodeEvent>) {
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        (nodes.clone(), self.events.subscribe())
    }
}

impl Drop for NodeSet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn decode(kv: &etcd_client::KeyValue) -> Option<NodeRecord> {
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    match serde_json::from_slice::<NodeRecord>(kv.value()) {
        Ok(r) => Some(r),
        Err(source) => {
            let e = ClusterError::Decode { key, source };
            tracing::warn!(error = %e, "ignoring a node record that does not decode");
            None
        }
    }
}

fn name_of(key: &[u8]) -> String {
    String::from_utf8_lossy(key.strip_prefix(NODES_PREFIX.as_bytes()).unwrap_or(key)).into_owned()
}

async fn read_all(client: &Client) -> Result<(Nodes, i64), ClusterError> {
    let kv = client.kv_client();
    let get = || {
        let mut kv = kv.clone();
        async move {
            kv.get(NODES_PREFIX, Some(GetOptions::new().with_prefix()))
                .await
        }
    };
    let resp = call_retry("get node records", Duration::from_secs(2), get).await?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
    let nodes = resp
        .kvs()
        .iter()
        .filter_map(|kv| decode(kv).map(|r| (name_of(kv.key()), Arc::new(r))))
        .collect();
    Ok((nodes, revision))
}

/// Applies one change under the write lock and broadcasts its event.
fn apply(
    nodes: &RwLock<Arc<Nodes>>,
    events: &broadcast::Sender<NodeEvent>,
    name: String,
    record: Option<NodeRecord>,
) {
    let mut guard = nodes.write().unwrap_or_else(|e| e.into_inner());
    if guard.get(&name).map(|old| &**old) == record.as_ref() {
        return; // unchanged (also: gone and still gone): no copy, no event
    }
    // Copy-on-write: snapshots handed out keep the old map.
    let map = Arc::make_mut(&mut guard);
    let event = match record {
        Some(r) => match map.insert(name, Arc::new(r.clone())) {
            None => NodeEvent::Up(r),
            Some(_) => NodeEvent::Updated(r),
        },
        None => match map.remove(&name) {
            Some(old) => NodeEvent::Down(Arc::unwrap_or_clone(old)),
            None => return,
        },
    };
    let _ = events.send(event);
}

async fn watch_nodes(
    client: Client,
    nodes: Arc<RwLock<Arc<Nodes>>>,
    events: broadcast::Sender<NodeEvent>,
    mut revision: i64,
) {
    let mut wc = client.watch_client();
    loop {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        match call(
            "watch node records",
            Duration::from_secs(2),
            wc.watch(NODES_PREFIX, Some(opts)),
        )
        .await
        {
            Ok(mut stream) => loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        if resp.canceled() || resp.compact_revision() > 0 {
                            tracing::warn!(
                                reason = resp.cancel_reason(),
                                "node watch cancelled; reading the set again"
                            );
                            break;
                        }
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            revision = revision.max(kv.mod_revision());
                            let name = name_of(kv.key());
                            match ev.event_type() {
                                EventType::Put => {
                                    if let Some(r) = decode(kv) {
                                        apply(&nodes, &events, name, Some(r));
                                    }
                                }
                                EventType::Delete => apply(&nodes, &events, name, None),
                            }
                        }
                        if let Some(h) = resp.header() {
                            revision = revision.max(h.revision());
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "node watch broke; reading the set again");
                        break;
                    }
                }
            },
            Err(e) => tracing::warn!(error = %e, "starting the node watch failed"),
        }
        // Resynchronise: read the whole set, report what changed meanwhile, watch again.
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            match read_all(&client).await {
                Ok((fresh, rev)) => {
                    let gone: Vec<String> = {
                        let map = nodes.read().unwrap_or_else(|e| e.into_inner());
                        map.keys()
                            .filter(|k| !fresh.contains_key(*k))
                            .cloned()
                            .collect()
                    };
                    for name in gone {
                        apply(&nodes, &events, name, None);
                    }
                    for (name, r) in fresh {
                        apply(&nodes, &events, name, Some(Arc::unwrap_or_clone(r)));
                    }
                    revision = rev;
                    break;
                }
                Err(e) => tracing::warn!(error = %e, "reading the node set failed; retrying"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_checked() {
        assert_eq!(node_key("node-1").unwrap(), "/sandlot/nodes/node-1");
        for bad in ["", "a/b", "x y", &"n".repeat(254)] {
            assert!(node_key(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn apply_reports_up_updated_down_once() {
        let nodes = RwLock::new(Arc::new(Nodes::new()));
        let (tx, mut rx) = broadcast::channel(8);
        let r = NodeRecord {
            name: "a".into(),
            ..Default::default()
        };
        apply(&nodes, &tx, "a".into(), Some(r.clone()));
        apply(&nodes, &tx, "a".into(), Some(r.clone()));
        let mut r2 = r.clone();
        r2.usage.sandboxes = 3;
        apply(&nodes, &tx, "a".into(), Some(r2.clone()));
        apply(&nodes, &tx, "a".into(), None);
        apply(&nodes, &tx, "a".into(), None);
        assert_eq!(rx.try_recv().unwrap(), NodeEvent::Up(r));
        assert_eq!(rx.try_recv().unwrap(), NodeEvent::Updated(r2.clone()));
        assert_eq!(rx.try_recv().unwrap(), NodeEvent::Down(r2));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn record_json_round_trips_and_tolerates_missing_fields() {
        let mut r = NodeRecord {
            name: "n1".into(),
            advertise_url: "http://10.0.0.5:7070".into(),
            ..Default::default()
        };
        r.capacity = crate::Resources {
            cpu: 32.0,
            memory_mib: 131072,
            sandboxes: 500,
        };
        r.backends = vec![
            sandlot_api::Backend::Function,
            sandlot_api::Backend::Container,
        ];
        r.accelerator = Some("kvm".into());
        r.cached_layers.insert("sha256:ab".into());
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            json.contains(r#""backends":["function","container"]"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<NodeRecord>(&json).unwrap(), r);
        let old: NodeRecord = serde_json::from_str(r#"{"name":"n2","future_field":1}"#).unwrap();
        assert_eq!(old.name, "n2");
    }
}
