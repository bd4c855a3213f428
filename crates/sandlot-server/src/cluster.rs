//! Cluster mode's router: one server in front of every node registered in etcd
//! (DESIGN.md "Cluster mode", issue 21 items 3, 5, 6, 8).
//!
//! [`ClusterNode`] is a [`Node`] that spreads over the node set: it follows the nodes
//! registered under `/sandlot/nodes/` ([`sandlot_cluster::NodeSet`]) and holds one
//! [`RemoteNode`] per node, connected on first use to the record's `advertise_url` with the
//! shared node API token and dropped when the node leaves (or re-registers under another
//! URL).
//!
//! - **Placement**: a create is placed by [`crate::placement::place`] over the registered
//!   nodes (backend, runtime, cpu, memory, `job` label spread; power of two choices). When
//!   no node fits the answer is [`NodeError::ResourceExhausted`] at once (HTTP 429 with
//!   `Retry-After: 1`). The server places before it writes the record
//!   ([`ClusterNode::assign`]), so the record's `node` is the real node's name from the
//!   start. A fork goes to the node that holds its checkpoint.
//! - **Routing**: sandbox id → node name in memory (filled by creates, at start from every
//!   node's `list`, and when a node (re)joins); no store query on the hot path. An id not in
//!   the map is looked up once on every node (`list`) and cached; a caller holding the
//!   record follows its `node` ([`ClusterNode::follow_record`]: another server moved the
//!   sandbox). Every I/O call (exec,
//!   streaming or controlled, files, pause/resume, checkpoint) goes to the owning node.
//! - **Lost-node sweep** ([`spawn_sweeper`]): when a node leaves the set (lease expired or
//!   revoked) every `running`/`paused` record of it becomes `lost` (a `lost` event with
//!   reason "node NAME left the cluster (lease expired)"); when a node (re)joins, its
//!   `list` is reconciled against the records ([`reconcile`]).
//!
//! State is in the server's SQLite store, or in PostgreSQL (`--postgres`); with an etcd
//! election several servers share one database and front the same nodes
//! ([`crate::leader`]): the lost-node sweeper then runs on the leader only.
use crate::placement::{self, Candidate, PlacementError, Recent, Request};
use crate::{events, SharedState};
use async_trait::async_trait;
use futures::StreamExt as _;
use rand::rngs::StdRng;
use rand::SeedableRng;
use sandlot_api::{Backend, ExecRequest, ExecResult, FileEntry, SandboxState};
use sandlot_cluster::{NodeEvent, NodeSet};
use sandlot_node_api::{
    CheckpointMeta, ExecControl, ExecSink, Liveness, Node, NodeError, NodeInfo, NodeResult,
    SandboxSpec, SandboxStatus,
};
use sandlot_node_remote::{NodeConnector, RemoteNode, RemoteOptions};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// The label whose value spreads a job's sandboxes over nodes (placement's `job`).
pub const JOB_LABEL: &str = "job";

/// How long a placement counts in [`Candidate::recent`]: a node publishes its usage at most
/// once a second, and the etcd watch brings it within milliseconds; 2 s covers both.
pub const RECENT_PLACEMENT: Duration = Duration::from_secs(2);

/// Nodes asked for their sandboxes at once when a server starts ([`ClusterNode::start`]),
/// so that the start does not take the sum of every node's round trips.
pub const START_LEARN_CONCURRENCY: usize = 32;

/// One placement this server made: when, what it asked, its job.
type Placement = (Instant, f64, u64, Option<String>);

/// This server's placements on one node within [`RECENT_PLACEMENT`], oldest first, and
/// their running sum (kept as they come and go, so a placement costs O(1) per node, not a
/// pass over every recent placement).
#[derive(Default)]
struct RecentQueue {
    placed: VecDeque<Placement>,
    sum: Recent,
}

impl RecentQueue {
    fn push(&mut self, p: Placement) {
        self.sum.usage.cpu += p.1;
        self.sum.usage.memory_mib += p.2;
        self.sum.usage.sandboxes += 1;
        if let Some(j) = &p.3 {
            *self.sum.jobs.entry(j.clone()).or_default() += 1;
        }
        self.placed.push_back(p);
    }

    /// Drops the placements older than [`RECENT_PLACEMENT`] at `now` from the queue and
    /// the sum.
    fn expire(&mut self, now: Instant) {
        while let Some((at, cpu, mem, job)) = self.placed.front() {
            if now.duration_since(*at) <= RECENT_PLACEMENT {
                break;
            }
            self.sum.usage.cpu = (self.sum.usage.cpu - cpu).max(0.0);
            self.sum.usage.memory_mib -= mem;
            self.sum.usage.sandboxes -= 1;
            if let Some(j) = job {
                if let Some(n) = self.sum.jobs.get_mut(j) {
                    *n -= 1;
                    if *n == 0 {
                        self.sum.jobs.remove(j);
                    }
                }
            }
            self.placed.pop_front();
        }
        if self.placed.is_empty() {
            self.sum = Recent::default(); // no float residue
        }
    }
}

/// A [`Node`] over every node registered in etcd; see the module docs.
pub struct ClusterNode {
    set: NodeSet,
    token: Option<String>,
    /// One HTTP/2 client for every node (built once: each build loads the CA roots).
    connector: NodeConnector,
    /// Node name → (advertise URL it was connected at, client).
    clients: Mutex<HashMap<String, (String, Arc<RemoteNode>)>>,
    /// Sandbox id → node name.
    routes: RwLock<HashMap<String, String>>,
    /// Checkpoint id → node name.
    checkpoints: RwLock<HashMap<String, String>>,
    rng: Mutex<StdRng>,
    /// Node name → this server's placements there within [`RECENT_PLACEMENT`], oldest first.
    recent: Mutex<HashMap<String, RecentQueue>>,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("nodes", &self.set.nodes().keys().collect::<Vec<_>>())
            .finish()
    }
}

/// What [`ClusterNode::assign`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Placed {
    /// The node's name (the record's `node`).
    pub node: String,
    /// The node's accelerator (`kvm`, `tcg`) from its membership record.
    pub accelerator: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

/// The sum of the placements on `node` within [`RECENT_PLACEMENT`] of `now`, dropping
/// older ones (and the node's entry once empty).
fn recent_on(recent: &mut HashMap<String, RecentQueue>, node: &str, now: Instant) -> Recent {
    let Some(q) = recent.get_mut(node) else {
        return Recent::default();
    };
    q.expire(now);
    if q.placed.is_empty() {
        recent.remove(node);
        return Recent::default();
    }
    q.sum.clone()
}

impl ClusterNode {
    /// Follows the node set in etcd (`client`, see [`sandlot_cluster::connect`]) and
    /// reaches nodes with `token` (the nodes' shared node API token) under `opts`; fills
    /// the routes from every registered node's `list` and `list_checkpoints`, up to
    /// [`START_LEARN_CONCURRENCY`] nodes at once (a node that does not answer is logged
    /// and looked up later).
    ///
    /// # Errors
    /// `Unavailable` when etcd cannot be read; `InvalidArgument` for a
    /// [`RemoteOptions::tls_ca_pem`] that is not PEM certificates.
    pub async fn start(
        client: &sandlot_cluster::Client,
        token: Option<String>,
        opts: RemoteOptions,
    ) -> NodeResult<Arc<ClusterNode>> {
        let connector = NodeConnector::new(opts)?;
        let set = NodeSet::start(client)
            .await
            .map_err(|e| NodeError::Unavailable(format!("etcd: {e}")))?;
        let c = Arc::new(ClusterNode {
            set,
            token,
            connector,
            clients: Mutex::default(),
            routes: RwLock::default(),
            checkpoints: RwLock::default(),
            rng: Mutex::new(StdRng::from_os_rng()),
            recent: Mutex::default(),
        });
        let names: Vec<String> = c.set.nodes().keys().cloned().collect();
        let cn = &c;
        futures::stream::iter(&names)
            .map(|name| async move { (name, cn.learn(name).await) })
            .buffer_unordered(START_LEARN_CONCURRENCY)
            .for_each(|(name, r)| async move {
                if let Err(e) = r {
                    tracing::warn!(node = %name, error = %e, "cannot list the node's sandboxes at start");
                }
            })
            .await;
        Ok(c)
    }

    /// The records of the nodes registered now, by name.
    pub fn nodes(&self) -> Arc<sandlot_cluster::Nodes> {
        self.set.nodes()
    }

    /// The node set now and every change after it ([`NodeSet::subscribe`]).
    pub fn subscribe(
        &self,
    ) -> (
        Arc<sandlot_cluster::Nodes>,
        tokio::sync::broadcast::Receiver<NodeEvent>,
    ) {
        self.set.subscribe()
    }

    /// The node that owns sandbox `id`, if known (no I/O).
    pub fn route_of(&self, id: &str) -> Option<String> {
        read(&self.routes).get(id).cloned()
    }

    /// Records that sandbox `id` lives on node `node` (reconcile).
    pub fn set_route(&self, id: &str, node: &str) {
        write(&self.routes).insert(id.to_owned(), node.to_owned());
    }

    /// Forgets the route of `id` (a create that was not made).
    pub fn unassign(&self, id: &str) {
        write(&self.routes).remove(id);
    }

    /// Places sandbox `id` ([`placement::place`] over the registered nodes) and routes it
    /// there; its [`Node::create`] then goes to that node.
    ///
    /// # Errors
    /// `ResourceExhausted` with every node's reason when none fits (also with no node
    /// registered); `Unavailable` for a fork whose checkpoint's node is not registered.
    pub fn assign(&self, id: &str, req: &Request) -> NodeResult<Placed> {
        let now = Instant::now();
        let mut recent = lock(&self.recent);
        let nodes: Vec<Candidate> = self
            .set
            .nodes()
            .values()
            .map(|record| {
                let recent = recent_on(&mut recent, &record.name, now);
                Candidate {
                    record: record.clone(),
                    serving: true,
                    recent,
                }
            })
            .collect();
        let picked = {
            let mut rng = lock(&self.rng);
            placement::place(&nodes, req, &mut *rng)
        };
        match picked {
            Ok(c) => {
                recent.entry(c.record.name.clone()).or_default().push((
                    now,
                    req.cpu,
                    req.memory_mib,
                    req.job.clone(),
                ));
                drop(recent);
                self.set_route(id, &c.record.name);
                Ok(Placed {
                    node: c.record.name.clone(),
                    accelerator: c.record.accelerator.clone(),
                })
            }
            Err(e @ PlacementError::NoCapacity(_)) => {
                Err(NodeError::ResourceExhausted(e.to_string()))
            }
            Err(e @ PlacementError::CheckpointNodeGone(_)) => {
                Err(NodeError::Unavailable(e.to_string()))
            }
        }
    }

    /// The node holding checkpoint `ck`, asking every node once when not known.
    ///
    /// # Errors
    /// `NotFound` when no registered node has it.
    pub async fn checkpoint_node(&self, ck: &str) -> NodeResult<String> {
        if let Some(n) = read(&self.checkpoints).get(ck) {
            return Ok(n.clone());
        }
        for name in self.set.nodes().keys() {
            let Ok(node) = self.remote(name).await else {
                continue;
            };
            if let Ok(cks) = node.list_checkpoints().await {
                let mut map = write(&self.checkpoints);
                for c in cks {
                    map.insert(c, name.clone());
                }
            }
        }
        read(&self.checkpoints)
            .get(ck)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("no checkpoint {ck} on any node")))
    }

    /// The client of node `name` (connected on first use).
    ///
    /// # Errors
    /// `Unavailable` when the node is not registered; the connect's error
    /// (`Transport`, `PermissionDenied`).
    pub async fn remote(&self, name: &str) -> NodeResult<Arc<RemoteNode>> {
        let Some(rec) = self.set.get(name) else {
            lock(&self.clients).remove(name);
            return Err(NodeError::Unavailable(format!(
                "node {name} is not in the cluster"
            )));
        };
        if let Some((url, n)) = lock(&self.clients).get(name) {
            if *url == rec.advertise_url {
                return Ok(n.clone());
            }
        }
        let n = Arc::new(
            self.connector
                .connect(&rec.advertise_url, self.token.clone())
                .await?,
        );
        lock(&self.clients).insert(name.to_owned(), (rec.advertise_url.clone(), n.clone()));
        Ok(n)
    }

    /// Cross-node resume: asks the registered nodes that run `microvm` or `vm` (all but `exclude`,
    /// the sandbox's own node) in turn to take sandbox `id` over from the shared snapshot
    /// store ([`Node::adopt_snapshot`]); the first that does becomes its route. Returns
    /// that node's name.
    ///
    /// # Errors
    /// `NotFound` when no node holds or sees a snapshot of it (no shared store, or it was
    /// not paused with memory); `Conflict` when a node says another claimed it; else the
    /// last node's error.
    pub async fn resume_elsewhere(&self, id: &str, exclude: Option<&str>) -> NodeResult<String> {
        let mut names: Vec<(u64, String)> = self
            .set
            .nodes()
            .values()
            .filter(|r| {
                Some(r.name.as_str()) != exclude
                    && (r.backends.contains(&Backend::Microvm) || r.backends.contains(&Backend::Vm))
            })
            .map(|r| (r.usage.sandboxes, r.name.clone()))
            .collect();
        names.sort();
        let mut last = NodeError::NotFound(format!(
            "sandbox {id}: its node is gone and no other node can resume it (no node with the shared snapshot store runs microvm or vm)"
        ));
        for (_, name) in names {
            let node = match self.remote(&name).await {
                Ok(n) => n,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            match node.adopt_snapshot(id).await {
                Ok(()) => {
                    tracing::info!(sandbox_id = %id, from = ?exclude, to = %name, "sandbox resumed on another node from the shared snapshot store");
                    self.set_route(id, &name);
                    return Ok(name);
                }
                Err(e @ NodeError::Conflict(_)) => return Err(e),
                Err(e) => {
                    tracing::info!(sandbox_id = %id, node = %name, error = %e, "node did not take the snapshot over");
                    if !matches!(last, NodeError::NotFound(_))
                        || !matches!(e, NodeError::NotFound(_))
                    {
                        last = e;
                    }
                }
            }
        }
        Err(last)
    }

    /// Drops the client of a node that left.
    pub fn forget_node(&self, name: &str) {
        lock(&self.clients).remove(name);
        lock(&self.recent).remove(name);
    }

    /// Asks node `name` for its sandboxes and checkpoints and routes them to it; returns
    /// its sandboxes.
    ///
    /// # Errors
    /// As [`ClusterNode::remote`] and the node's `list`.
    pub async fn learn(&self, name: &str) -> NodeResult<Vec<SandboxStatus>> {
        let list = self.learn_sandboxes(name, false).await?;
        let node = self.remote(name).await?;
        if let Ok(cks) = node.list_checkpoints().await {
            let mut map = write(&self.checkpoints);
            for c in cks {
                map.insert(c, name.to_owned());
            }
        }
        Ok(list)
    }

    /// Asks node `name` for its sandboxes (with `not_alive`, only those not alive) and
    /// routes them to it (no checkpoints). A not-alive list routes nothing: a dead copy
    /// a node keeps of a sandbox that moved away must not take its route (a resume reads
    /// the route to tell whether the sandbox is elsewhere).
    async fn learn_sandboxes(&self, name: &str, not_alive: bool) -> NodeResult<Vec<SandboxStatus>> {
        let node = self.remote(name).await?;
        if not_alive {
            return node.list_not_alive().await;
        }
        let list = node.list().await?;
        let mut routes = write(&self.routes);
        for s in &list {
            routes.insert(s.id.clone(), name.to_owned());
        }
        Ok(list)
    }

    /// [`Node::list`] (or with `not_alive`, [`Node::list_not_alive`]) of every registered
    /// node at once, each status with the name of the node that answered it; see
    /// [`ClusterNode::list`].
    async fn list_each(&self, not_alive: bool) -> NodeResult<Vec<(String, SandboxStatus)>> {
        let names: Vec<String> = self.set.nodes().keys().cloned().collect();
        let n = names.len();
        let (all, mut failed) = union(names, |name| async move {
            let list = self.learn_sandboxes(&name, not_alive).await?;
            Ok(list.into_iter().map(|s| (name.clone(), s)).collect())
        })
        .await;
        for (name, e) in &failed {
            tracing::warn!(node = %name, error = %e, "list: node did not answer");
        }
        if n > 0 && failed.len() == n {
            return Err(failed.swap_remove(0).1);
        }
        Ok(all)
    }

    /// [`Node::list_not_alive`] of every registered node, each status with the name of the
    /// node that answered it: the reaper marks a sandbox `lost` only when that is the node
    /// its record names (a dead copy left on the node a sandbox moved away from says
    /// nothing about the sandbox). Errors as [`ClusterNode::list`].
    pub async fn list_not_alive_on_nodes(&self) -> NodeResult<Vec<(String, SandboxStatus)>> {
        self.list_each(true).await
    }

    /// Routes sandbox `id` to `node`, the node its record names, when that node is
    /// registered and the route says otherwise: another server moved it (a resume on
    /// another node writes the record's `node`, [`crate::pause`]), and this server's
    /// route still names the old node. Callers that read the record before a node call
    /// pass it here (no I/O).
    pub fn follow_record(&self, id: &str, node: &str) {
        if self.route_of(id).as_deref() != Some(node) && self.set.nodes().contains_key(node) {
            self.set_route(id, node);
        }
    }

    /// The node name owning `id`: the route, else a lookup on every node (once; the
    /// answer is cached).
    async fn owner_name(&self, id: &str) -> NodeResult<String> {
        if let Some(n) = self.route_of(id) {
            return Ok(n);
        }
        // Learns every node's routes; nodes that do not answer are logged there.
        let _ = self.list_each(false).await;
        self.route_of(id)
            .ok_or_else(|| NodeError::NotFound(format!("no sandbox {id} on any node")))
    }

    /// The client of the node owning `id`.
    async fn owner(&self, id: &str) -> NodeResult<Arc<RemoteNode>> {
        let name = self.owner_name(id).await?;
        self.owner_node(&name, id).await
    }

    /// The client of node `name`, owner of `id` (named in the error when it is gone).
    async fn owner_node(&self, name: &str, id: &str) -> NodeResult<Arc<RemoteNode>> {
        self.remote(name).await.map_err(|e| match e {
            NodeError::Unavailable(_) => {
                NodeError::Unavailable(format!("node {name} of sandbox {id} is not in the cluster"))
            }
            e => e,
        })
    }

    /// The indexes of `ids` grouped by owning node; an id whose owner cannot be found gets
    /// its error in `out` instead. Ids without a route are looked up once for all
    /// ([`ClusterNode::owner_name`] of the first; the lookup fills every route it learns).
    async fn by_owner(
        &self,
        ids: &[String],
        out: &mut [Option<NodeResult<()>>],
    ) -> HashMap<String, Vec<usize>> {
        let mut groups: HashMap<String, Vec<usize>> = HashMap::new();
        let mut unknown = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            match self.route_of(id) {
                Some(n) => groups.entry(n).or_default().push(i),
                None => unknown.push(i),
            }
        }
        let mut looked_up = false;
        for i in unknown {
            let owner = match self.route_of(&ids[i]) {
                Some(n) => Ok(n),
                None if looked_up => Err(NodeError::NotFound(format!(
                    "no sandbox {} on any node",
                    ids[i]
                ))),
                None => {
                    looked_up = true;
                    self.owner_name(&ids[i]).await
                }
            };
            match owner {
                Ok(n) => groups.entry(n).or_default().push(i),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        groups
    }
}

/// A bulk call's result for one id; `None` (a node whose answer had fewer results than
/// ids) is an `Internal` error of that id.
fn unanswered(r: Option<NodeResult<()>>) -> NodeResult<()> {
    r.unwrap_or_else(|| {
        Err(NodeError::internal(
            "the node's bulk answer had no result for this sandbox",
            None,
        ))
    })
}

/// `n` copies of `e` (a bulk call that failed as a whole), kind and message kept.
fn same_error(e: &NodeError, n: usize) -> impl Iterator<Item = NodeResult<()>> {
    let w = e.to_wire();
    (0..n).map(move |_| Err(NodeError::from_wire(w.clone())))
}

/// Sandbox statuses of many nodes, one list.
async fn union<F, Fut, T>(names: Vec<String>, f: F) -> (Vec<T>, Vec<(String, NodeError)>)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = NodeResult<Vec<T>>>,
{
    let results = futures::future::join_all(names.iter().cloned().map(f)).await;
    let (mut all, mut failed) = (Vec::new(), Vec::new());
    for (n, r) in names.into_iter().zip(results) {
        match r {
            Ok(v) => all.extend(v),
            Err(e) => failed.push((n, e)),
        }
    }
    (all, failed)
}

/// A placement request for a create: backend, runtime, cpu, memory, image (locality), the
/// `job` label, and for a fork the node of its checkpoint.
pub fn request_of(
    spec: &SandboxSpec,
    job: Option<&str>,
    checkpoint_node: Option<String>,
) -> Request {
    Request {
        backend: spec.backend,
        runtime: spec.runtime.clone(),
        accelerator: None,
        cpu: spec.cpu,
        memory_mib: spec.memory_mib,
        image: Some(spec.image.clone()),
        layers: Vec::new(),
        job: job.map(str::to_owned),
        checkpoint_node,
    }
}

#[async_trait]
impl Node for ClusterNode {
    /// The cluster as one node: name `cluster`, the backends and runtimes some registered
    /// node offers (`Err("no registered node offers it")` for the others), the first
    /// node's accelerator, no warm pools, `cgroup_version` `"cluster"`.
    fn info(&self) -> NodeInfo {
        let nodes = self.set.nodes();
        let offered: Vec<Backend> = nodes
            .values()
            .flat_map(|r| r.backends.iter().copied())
            .collect();
        let backends = [
            Backend::Function,
            Backend::Container,
            Backend::Microvm,
            Backend::Vm,
        ]
        .into_iter()
        .map(|b| {
            let ok = if offered.contains(&b) {
                Ok(())
            } else {
                Err("no registered node offers it".to_owned())
            };
            (b, ok)
        })
        .collect();
        let runtimes: BTreeSet<String> = nodes
            .values()
            .flat_map(|r| r.runtimes.iter().cloned())
            .collect();
        let accel = nodes.values().find_map(|r| {
            r.accelerator
                .clone()
                .map(|a| (Some(a), format!("node {}", r.name)))
        });
        NodeInfo {
            name: "cluster".into(),
            backends,
            cgroup_version: "cluster".into(),
            runtimes: runtimes.into_iter().map(|r| (r, Ok(()))).collect(),
            accel,
            warm_pools: Vec::new(),
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()> {
        let name = match self.route_of(&spec.id) {
            Some(n) => n,
            None => self.assign(&spec.id, &request_of(spec, None, None))?.node,
        };
        let out = async { self.remote(&name).await?.create(spec).await }.await;
        if let Err(e) = &out {
            // Outcome unknown: keep the route so the reaper's delete reaches the node.
            if !matches!(e, NodeError::Transport(_)) {
                self.unassign(&spec.id);
            }
        }
        out
    }

    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        self.owner(id).await?.exec(id, req, sink).await
    }

    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: ExecControl,
    ) -> NodeResult<ExecResult> {
        self.owner(id)
            .await?
            .exec_controlled(id, req, sink, control)
            .await
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        self.owner(id).await?.read_file(id, path, max_bytes).await
    }

    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        self.owner(id).await?.file_size(id, path).await
    }

    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()> {
        self.owner(id).await?.write_file(id, path, data).await
    }

    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        self.owner(id)
            .await?
            .write_file_stream(id, path, body, max_bytes)
            .await
    }

    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        self.owner(id)
            .await?
            .read_file_stream(id, path, max_bytes)
            .await
    }

    async fn write_files_volatile(
        &self,
        id: &str,
        files: Vec<(String, bytes::Bytes)>,
    ) -> NodeResult<()> {
        self.owner(id).await?.write_files_volatile(id, files).await
    }

    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        self.owner(id).await?.list_dir(id, path).await
    }

    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        self.owner(id).await?.remove_file(id, path).await
    }

    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        self.owner(id).await?.stat_file(id, path).await
    }

    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        self.owner(id).await?.make_dir(id, path, parents).await
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.owner(id).await?.pause(id).await
    }

    /// Resumes on the owning node (the fast path). When that node is gone (not
    /// registered, or no node knows the id) or answers `ResourceExhausted`, the sandbox is
    /// taken over by another node from the shared snapshot store
    /// ([`ClusterNode::resume_elsewhere`]); a full owner then deletes its paused copy.
    async fn resume(&self, id: &str) -> NodeResult<()> {
        let name = match self.owner_name(id).await {
            Ok(n) => n,
            Err(NodeError::NotFound(_)) => return self.resume_elsewhere(id, None).await.map(drop),
            Err(e) => return Err(e),
        };
        let node = match self.remote(&name).await {
            Ok(n) => n,
            Err(NodeError::Unavailable(_)) => {
                return self.resume_elsewhere(id, Some(&name)).await.map(drop)
            }
            Err(e) => return Err(e),
        };
        match node.resume(id).await {
            Err(NodeError::ResourceExhausted(why)) => {
                tracing::info!(sandbox_id = %id, node = %name, %why, "owner full; resuming on another node");
                self.resume_elsewhere(id, Some(&name)).await?;
                if let Err(e) = node.delete(id).await {
                    tracing::warn!(sandbox_id = %id, node = %name, error = %e, "stale paused copy not deleted; the next reconcile does");
                }
                Ok(())
            }
            r => r,
        }
    }

    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        self.resume_elsewhere(id, None).await.map(drop)
    }

    /// The ids grouped by owning node (`ClusterNode::owner_name`), one
    /// [`Node::pause_many`] call per node, all nodes at once; an id whose owner is unknown
    /// or gone gets [`Node::pause`]'s error.
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        let mut out: Vec<Option<NodeResult<()>>> = ids.iter().map(|_| None).collect();
        let groups = self.by_owner(ids, &mut out).await;
        let calls = groups.into_iter().map(|(name, idx)| async move {
            let part: Vec<String> = idx.iter().map(|&i| ids[i].clone()).collect();
            let res = match self.owner_node(&name, &part[0]).await {
                Ok(node) => node.pause_many(&part).await,
                Err(e) => same_error(&e, part.len()).collect(),
            };
            (idx, res)
        });
        for (idx, res) in futures::future::join_all(calls).await {
            for (i, r) in idx.into_iter().zip(res) {
                out[i] = Some(r);
            }
        }
        out.into_iter().map(unanswered).collect()
    }

    /// As [`ClusterNode::pause_many`], with [`Node::resume`]'s fallback per id: an id
    /// whose owner is gone, or that its owner answers `ResourceExhausted` for, goes
    /// through the one-id [`Node::resume`] (taken over from the shared snapshot store).
    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        let mut out: Vec<Option<NodeResult<()>>> = ids.iter().map(|_| None).collect();
        let groups = self.by_owner(ids, &mut out).await;
        // Taken over from the shared snapshot store, each on its own: (index, the owner
        // to avoid, whether the owner keeps a stale paused copy to delete afterwards).
        // No node knows them: no owner (as the single resume; no second lookup per id).
        let mut single: Vec<(usize, Option<String>, bool)> = (0..ids.len())
            .filter(|&i| matches!(out[i], Some(Err(NodeError::NotFound(_)))))
            .map(|i| (i, None, false))
            .collect();
        let calls = groups.into_iter().map(|(name, idx)| async move {
            let part: Vec<String> = idx.iter().map(|&i| ids[i].clone()).collect();
            let res = match self.remote(&name).await {
                Ok(node) => Ok(node.resume_many(&part).await),
                Err(e) => Err(e),
            };
            (name, idx, res)
        });
        for (name, idx, res) in futures::future::join_all(calls).await {
            match res {
                // Gone: each one taken over elsewhere.
                Err(NodeError::Unavailable(_)) => {
                    single.extend(idx.into_iter().map(|i| (i, Some(name.clone()), false)))
                }
                Err(e) => {
                    for (i, r) in idx.into_iter().zip(same_error(&e, usize::MAX)) {
                        out[i] = Some(r);
                    }
                }
                Ok(res) => {
                    for (i, r) in idx.into_iter().zip(res) {
                        match r {
                            // The owner is full: resumed elsewhere, its copy deleted after.
                            Err(NodeError::ResourceExhausted(_)) => {
                                single.push((i, Some(name.clone()), true))
                            }
                            r => out[i] = Some(r),
                        }
                    }
                }
            }
        }
        let takeovers = single.iter().map(|(i, owner, stale)| async move {
            let id = &ids[*i];
            self.resume_elsewhere(id, owner.as_deref()).await?;
            if let (Some(name), true) = (owner, stale) {
                let deleted = match self.remote(name).await {
                    Ok(node) => node.delete(id).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = deleted {
                    tracing::warn!(sandbox_id = %id, node = %name, error = %e, "stale paused copy not deleted; the next reconcile does");
                }
            }
            Ok(())
        });
        let retried = sandlot_node_api::bulk(takeovers.collect()).await;
        for ((i, _, _), r) in single.into_iter().zip(retried) {
            out[i] = Some(r);
        }
        out.into_iter().map(unanswered).collect()
    }

    /// Deletes on the owning node. An id no node has, or whose node left the cluster, is
    /// done (the sandbox went with its node; a node that comes back deletes it as an
    /// orphan in [`reconcile`]).
    async fn delete(&self, id: &str) -> NodeResult<()> {
        let name = match self.owner_name(id).await {
            Ok(n) => n,
            Err(NodeError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let node = match self.remote(&name).await {
            Ok(n) => n,
            Err(NodeError::Unavailable(_)) => {
                self.unassign(id);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        node.delete(id).await?;
        self.unassign(id);
        Ok(())
    }

    /// The union of every registered node's list. Nodes that do not answer are logged and
    /// left out (their sandboxes are neither alive nor dead to the caller); all failing is
    /// the first node's error.
    async fn list(&self) -> NodeResult<Vec<SandboxStatus>> {
        Ok(self
            .list_each(false)
            .await?
            .into_iter()
            .map(|(_, s)| s)
            .collect())
    }

    /// As [`ClusterNode::list`], of each node's [`Node::list_not_alive`] (the reaper's
    /// call every pass: with S live sandboxes, the whole list moved S statuses a second).
    async fn list_not_alive(&self) -> NodeResult<Vec<SandboxStatus>> {
        Ok(self
            .list_each(true)
            .await?
            .into_iter()
            .map(|(_, s)| s)
            .collect())
    }

    /// Cluster mode reconciles per node ([`reconcile`]) rather than re-adopting: this only
    /// reports which ids of `keep` some registered node runs (alive or unknown), and
    /// deletes nothing.
    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let live: BTreeSet<String> = self
            .list()
            .await?
            .into_iter()
            .filter(|s| !s.liveness.is_dead())
            .map(|s| s.id)
            .collect();
        Ok(keep.iter().filter(|k| live.contains(*k)).cloned().collect())
    }

    async fn checkpoint(&self, id: &str, checkpoint_id: &str) -> NodeResult<CheckpointMeta> {
        let name = self.owner_name(id).await?;
        let meta = self
            .remote(&name)
            .await?
            .checkpoint(id, checkpoint_id)
            .await?;
        write(&self.checkpoints).insert(checkpoint_id.to_owned(), name);
        Ok(meta)
    }

    async fn create_from_checkpoint(
        &self,
        spec: &SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        let name = match self.route_of(&spec.id) {
            Some(n) => n,
            None => {
                let ck = self.checkpoint_node(checkpoint_id).await?;
                self.assign(&spec.id, &request_of(spec, None, Some(ck)))?
                    .node
            }
        };
        let out = async {
            self.remote(&name)
                .await?
                .create_from_checkpoint(spec, checkpoint_id)
                .await
        }
        .await;
        if let Err(e) = &out {
            if !matches!(e, NodeError::Transport(_)) {
                self.unassign(&spec.id);
            }
        }
        out
    }

    /// Deletes on the node holding it; a checkpoint no registered node has is done.
    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        let name = match self.checkpoint_node(checkpoint_id).await {
            Ok(n) => n,
            Err(NodeError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        match self.remote(&name).await {
            Ok(n) => n.delete_checkpoint(checkpoint_id).await?,
            Err(NodeError::Unavailable(_)) => {}
            Err(e) => return Err(e),
        }
        write(&self.checkpoints).remove(checkpoint_id);
        Ok(())
    }

    /// The union of every registered node's checkpoints.
    ///
    /// # Errors
    /// The first error of a node that did not answer (a partial list would make the
    /// caller drop records of checkpoints that still exist).
    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        let names: Vec<String> = self.set.nodes().keys().cloned().collect();
        let (all, mut failed) = union(names, |name| async move {
            let cks = self.remote(&name).await?.list_checkpoints().await?;
            let mut map = write(&self.checkpoints);
            for c in &cks {
                map.insert(c.clone(), name.clone());
            }
            Ok(cks)
        })
        .await;
        if !failed.is_empty() {
            return Err(failed.swap_remove(0).1);
        }
        Ok(all)
    }

    /// Not answerable for the cluster as a whole: the server takes the accelerator of the
    /// node a create is placed on from its membership record instead.
    async fn accel(&self) -> Option<String> {
        None
    }

    async fn process_spawn(
        &self,
        id: &str,
        req: sandlot_api::SpawnRequest,
    ) -> NodeResult<sandlot_api::Process> {
        self.owner(id).await?.process_spawn(id, req).await
    }
    async fn process_list(&self, id: &str) -> NodeResult<Vec<sandlot_api::Process>> {
        self.owner(id).await?.process_list(id).await
    }
    async fn process_get(&self, id: &str, pid: &str) -> NodeResult<sandlot_api::Process> {
        self.owner(id).await?.process_get(id, pid).await
    }
    async fn process_output(
        &self,
        id: &str,
        pid: &str,
        cursor: sandlot_node_api::OutputCursor,
    ) -> NodeResult<sandlot_node_api::ProcessEvents> {
        self.owner(id).await?.process_output(id, pid, cursor).await
    }
    async fn process_wait(
        &self,
        id: &str,
        pid: &str,
        timeout: std::time::Duration,
    ) -> NodeResult<sandlot_api::Process> {
        self.owner(id).await?.process_wait(id, pid, timeout).await
    }
    async fn process_signal(&self, id: &str, pid: &str, signal: i32) -> NodeResult<()> {
        self.owner(id).await?.process_signal(id, pid, signal).await
    }
    async fn process_stdin(
        &self,
        id: &str,
        pid: &str,
        data: bytes::Bytes,
        eof: bool,
    ) -> NodeResult<()> {
        self.owner(id)
            .await?
            .process_stdin(id, pid, data, eof)
            .await
    }
    async fn process_resize(
        &self,
        id: &str,
        pid: &str,
        size: sandlot_api::PtySize,
    ) -> NodeResult<()> {
        self.owner(id).await?.process_resize(id, pid, size).await
    }
    async fn process_remove(&self, id: &str, pid: &str) -> NodeResult<()> {
        self.owner(id).await?.process_remove(id, pid).await
    }
}

/// The reason of a `lost` event for a node that left.
pub fn left_reason(node: &str) -> String {
    format!("node {node} left the cluster (lease expired)")
}

/// Marks every `running` or `paused` record of node `node` `lost` with `reason` (a `lost`
/// event each, as [`crate::lifecycle`] does for sandboxes that died), in one registry write
/// (`Registry::mark_node_lost`). Returns the ids; a store failure is logged and changes
/// nothing ([`try_mark_node_lost`] says whether the pass was done).
pub async fn mark_node_lost(st: &SharedState, node: &str, reason: &str) -> Vec<String> {
    try_mark_node_lost(st, node, reason).await.0
}

/// [`mark_node_lost`], and whether every record of the node was judged: false when the
/// store failed (PostgreSQL down), so the caller retries later ([`spawn_sweeper`] does,
/// every [`SWEEP_RETRY`]) rather than leave them `running` on a node that is gone.
pub async fn try_mark_node_lost(st: &SharedState, node: &str, reason: &str) -> (Vec<String>, bool) {
    // One indexed update for the whole node (paused microVMs and VMs stay paused: with a shared
    // snapshot store another node resumes them; without one that resume marks them `lost`).
    let changed = match st.store.mark_node_lost(node).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(%node, error = %e, "lost-node sweep: store; retried");
            return (Vec::new(), false);
        }
    };
    if !changed.is_empty() {
        tracing::warn!(%node, reason, sandboxes = changed.len(), "marked lost");
    }
    let mut lost = Vec::with_capacity(changed.len());
    for (id, backend) in changed {
        let mut f = serde_json::Map::new();
        f.insert("reason".into(), reason.into());
        events::record_queued(st, "lost", Some(&id), Some(backend), f);
        lost.push(id);
    }
    (lost, true)
}

/// How soon [`spawn_sweeper`] retries marking the records of departed nodes `lost` after
/// the store failed.
pub const SWEEP_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// What [`reconcile`] did on one node.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Reconciled {
    /// Sandboxes on the node whose record is live: kept (and routed).
    pub kept: Vec<String>,
    /// Sandboxes on the node whose record is `lost` or missing: deleted there (orphans).
    pub orphans_deleted: Vec<String>,
    /// `running`/`paused` records of the node it no longer has (or reports dead): now
    /// `lost`.
    pub marked_lost: Vec<String>,
}

/// Reconciles node `node` (at server start and when it rejoins) with the records: its
/// sandboxes whose record is `lost` or missing are deleted on it (orphans); those with a
/// live record stay and are routed to it; its `running`/`paused` records it does not have
/// become `lost` ("not on node NAME after it rejoined").
///
/// # Errors
/// The node's `list` error, or `Unavailable` when the store cannot be read (nothing
/// changed then); a failed orphan delete is logged and retried at the next reconcile.
pub async fn reconcile(
    st: &SharedState,
    cluster: &ClusterNode,
    node: &str,
) -> NodeResult<Reconciled> {
    // Records made after the list was taken are not judged by it.
    let listed_at = crate::now_ms();
    let on_node = cluster.learn(node).await?;
    let records = read_records(st).await?;
    let index = RecordIndex::new(&records);
    settle(st, cluster, node, listed_at, &on_node, &index).await
}

/// Every record, read after the nodes' lists were taken: a sandbox a node lists then has
/// its record (a create writes the record before it asks the node).
async fn read_records(st: &SharedState) -> NodeResult<Vec<crate::store::Record>> {
    st.store
        .list()
        .await
        .map_err(|e| NodeError::Unavailable(format!("reconcile: read the records: {e:#}")))
}

/// The records by id and by node, for deciding many nodes' reconciles from one read.
struct RecordIndex<'a> {
    by_id: HashMap<&'a str, &'a crate::store::Record>,
    by_node: HashMap<&'a str, Vec<&'a crate::store::Record>>,
}

impl<'a> RecordIndex<'a> {
    fn new(records: &'a [crate::store::Record]) -> Self {
        let mut by_node: HashMap<&str, Vec<&crate::store::Record>> = HashMap::new();
        for r in records {
            by_node.entry(r.node.as_str()).or_default().push(r);
        }
        RecordIndex {
            by_id: records.iter().map(|r| (r.id.as_str(), r)).collect(),
            by_node,
        }
    }
}

/// [`reconcile`] of `node` from its list `on_node`, taken at `listed_at`, and the records
/// read after it.
async fn settle(
    st: &SharedState,
    cluster: &ClusterNode,
    node: &str,
    listed_at: i64,
    on_node: &[SandboxStatus],
    records: &RecordIndex<'_>,
) -> NodeResult<Reconciled> {
    let remote = cluster.remote(node).await?;
    let mut out = Reconciled::default();
    let mut present = BTreeSet::new();
    for s in on_node {
        match records.by_id.get(s.id.as_str()) {
            // On another node than its record says: a paused microVM resumed elsewhere
            // from the shared snapshot store while this node was away; this copy is an
            // orphan.
            Some(r) if r.state != SandboxState::Lost && r.node == node => {
                if matches!(s.liveness, Liveness::Alive | Liveness::Unknown(_)) {
                    present.insert(s.id.clone());
                }
                out.kept.push(s.id.clone());
            }
            _ => match remote.delete(&s.id).await {
                Ok(()) => {
                    tracing::info!(sandbox_id = %s.id, %node, "orphan deleted on the node");
                    cluster.unassign(&s.id);
                    out.orphans_deleted.push(s.id.clone());
                }
                Err(e) => {
                    tracing::warn!(sandbox_id = %s.id, %node, error = %e, "orphan delete failed; retried at the next reconcile")
                }
            },
        }
    }
    let reason = format!("not on node {node} after it rejoined");
    for r in records.by_node.get(node).into_iter().flatten() {
        if present.contains(&r.id) || r.created_at_ms >= listed_at {
            continue;
        }
        // The records were read after every node's list: one moved to another node since
        // (a resume elsewhere) is not this node's to judge.
        if !matches!(st.store.get(&r.id).await, Ok(Some(cur)) if cur.node == node) {
            continue;
        }
        let from = [SandboxState::Running, SandboxState::Paused];
        if let Ok(true) = st.store.transition(&r.id, &from, SandboxState::Lost).await {
            let mut f = serde_json::Map::new();
            f.insert("reason".into(), reason.clone().into());
            events::record_queued(st, "lost", Some(&r.id), Some(r.backend), f);
            out.marked_lost.push(r.id.clone());
        }
    }
    Ok(out)
}

/// Server start in cluster mode (in place of [`crate::lifecycle::recover`]'s re-adoption):
/// records of nodes not registered now become `lost` ("node NAME is not in the cluster at
/// server start"); each registered node is reconciled ([`reconcile`]; one that does not
/// answer is logged and reconciled when it next re-registers); records left `creating`
/// by a previous process are removed (with an election: left to the leader's
/// stale-transition sweep); then checkpoints are recovered (a failure is
/// logged: a node that did not answer keeps its checkpoints and their records).
///
/// # Errors
/// Store errors.
pub async fn recover(st: &SharedState, cluster: &ClusterNode) -> anyhow::Result<()> {
    let nodes = cluster.nodes();
    // Every node's list first (up to START_LEARN_CONCURRENCY at once), then one read of the
    // records for all of them: at a full unit (160 nodes, 384,000 sandboxes) a read of the
    // whole store per node, and a record lookup per listed sandbox, made the start
    // O(nodes × records) and serial.
    let listed_at = crate::now_ms();
    let lists: Vec<(String, NodeResult<Vec<SandboxStatus>>)> = futures::stream::iter(nodes.keys())
        .map(|name| async move { (name.clone(), cluster.learn(name).await) })
        .buffer_unordered(START_LEARN_CONCURRENCY)
        .collect()
        .await;
    let records = st.store.list().await?;
    let mut gone: BTreeSet<String> = BTreeSet::new();
    for r in &records {
        st.events.set_owner(&r.id, r.tenant.as_deref());
        if r.state == SandboxState::Creating && st.cfg.election.is_none() {
            // Its creator died with the previous process: the reaper deletes it. (With an
            // election, other servers may be creating now: the leader's stale-transition
            // sweep rolls back what a dead one left, [`crate::leader`].)
            st.store
                .transition(&r.id, &[SandboxState::Creating], SandboxState::Deleting)
                .await?;
        } else if !nodes.contains_key(&r.node) {
            gone.insert(r.node.clone());
        }
    }
    for node in gone {
        mark_node_lost(
            st,
            &node,
            &format!("node {node} is not in the cluster at server start"),
        )
        .await;
    }
    let index = RecordIndex::new(&records);
    for (name, list) in lists {
        let settled = match list {
            Ok(on_node) => settle(st, cluster, &name, listed_at, &on_node, &index).await,
            Err(e) => Err(e),
        };
        match settled {
            Ok(r) => {
                tracing::info!(node = %name, kept = r.kept.len(), orphans = r.orphans_deleted.len(), lost = r.marked_lost.len(), "node reconciled")
            }
            Err(e) => tracing::warn!(node = %name, error = %e, "node did not answer its reconcile"),
        }
    }
    if let Err(e) = crate::checkpoints::recover(st).await {
        tracing::warn!(error = %crate::error::chain(e.as_ref()), "checkpoint recovery skipped");
    }
    Ok(())
}

/// Starts the lost-node sweeper: first marks `lost` the live records of nodes not
/// registered now (a new leader catching up); then follows the node set; a node that leaves gets its
/// records marked `lost` ([`mark_node_lost`] with [`left_reason`]) and its client dropped;
/// a node that joins (or re-registers with a new `started_at`, a restart) is reconciled
/// ([`reconcile`]). Ends when `stop` turns true.
pub fn spawn_sweeper(
    st: SharedState,
    cluster: Arc<ClusterNode>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (known, mut rx) = cluster.subscribe();
        let mut known = Arc::unwrap_or_clone(known);
        // A server that becomes leader catches up on nodes that left while no one swept
        // (another leader's failover): their live records become `lost` now. `retry`: a
        // pass failed on the store (PostgreSQL down); `unreconciled`: nodes whose reconcile
        // failed (a node seen in etcd a moment before it lifts its fence answers 503). Both
        // are retried every SWEEP_RETRY until done, so records do not stay `running` on a
        // node that left and orphans do not stay on a node that came back.
        let mut retry = !catch_up_departed(&st, &known).await;
        let mut unreconciled: BTreeSet<String> = BTreeSet::new();
        loop {
            let pending = retry || !unreconciled.is_empty();
            let wake = tokio::select! {
                ev = rx.recv() => Wake::Event(ev),
                _ = stop.wait_for(|s| *s) => Wake::Stop,
                _ = tokio::time::sleep(SWEEP_RETRY), if pending => Wake::Retry,
            };
            let ev = match wake {
                Wake::Stop => return,
                Wake::Retry => {
                    if retry {
                        retry = !catch_up_departed(&st, &known).await;
                    }
                    for name in std::mem::take(&mut unreconciled) {
                        if known.contains_key(&name) && !rejoin(&st, &cluster, &name).await {
                            unreconciled.insert(name);
                        }
                    }
                    continue;
                }
                Wake::Event(ev) => ev,
            };
            match ev {
                Ok(NodeEvent::Down(r)) => {
                    known.remove(&r.name);
                    unreconciled.remove(&r.name);
                    cluster.forget_node(&r.name);
                    let (lost, complete) =
                        try_mark_node_lost(&st, &r.name, &left_reason(&r.name)).await;
                    retry |= !complete;
                    tracing::warn!(node = %r.name, lost = lost.len(), "node left the cluster");
                }
                Ok(NodeEvent::Up(r)) => {
                    known.insert(r.name.clone(), Arc::new(r.clone()));
                    if !rejoin(&st, &cluster, &r.name).await {
                        unreconciled.insert(r.name.clone());
                    }
                }
                Ok(NodeEvent::Updated(r)) => {
                    let restarted = known
                        .get(&r.name)
                        .is_some_and(|o| o.started_at != r.started_at);
                    known.insert(r.name.clone(), Arc::new(r.clone()));
                    if restarted && !rejoin(&st, &cluster, &r.name).await {
                        unreconciled.insert(r.name.clone());
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    // Take a new snapshot and treat the difference as events.
                    let (now, fresh) = cluster.subscribe();
                    rx = fresh;
                    for name in known.keys().filter(|n| !now.contains_key(*n)) {
                        cluster.forget_node(name);
                        unreconciled.remove(name);
                        retry |= !try_mark_node_lost(&st, name, &left_reason(name)).await.1;
                    }
                    for (name, r) in now.iter() {
                        if known.get(name).is_none_or(|o| o.started_at != r.started_at)
                            && !rejoin(&st, &cluster, name).await
                        {
                            unreconciled.insert(name.clone());
                        }
                    }
                    known = Arc::unwrap_or_clone(now);
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    })
}

/// What woke [`spawn_sweeper`]'s loop.
// One short-lived value per wake-up, moved once: boxing the event would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Wake {
    /// A node event (or the channel's lag/close).
    Event(Result<NodeEvent, tokio::sync::broadcast::error::RecvError>),
    /// `stop` turned true.
    Stop,
    /// [`SWEEP_RETRY`] passed with something to retry.
    Retry,
}

/// Marks `lost` the `running`/`paused` records of nodes not in `known` ([`left_reason`]).
/// Returns whether the pass was complete (false: the store failed; retry later).
async fn catch_up_departed(st: &SharedState, known: &sandlot_cluster::Nodes) -> bool {
    let records = match st.store.list().await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "lost-node sweep: store; retried");
            return false;
        }
    };
    let gone: BTreeSet<String> = records
        .into_iter()
        .filter(|r| matches!(r.state, SandboxState::Running | SandboxState::Paused))
        .filter(|r| !known.contains_key(&r.node))
        .map(|r| r.node)
        .collect();
    let mut complete = true;
    for node in gone {
        let (lost, done) = try_mark_node_lost(st, &node, &left_reason(&node)).await;
        complete &= done;
        tracing::warn!(%node, lost = lost.len(), "node not in the cluster when the sweep ran");
    }
    complete
}

/// Reconciles a node that joined or restarted. Returns false when its reconcile failed
/// (the caller retries).
async fn rejoin(st: &SharedState, cluster: &ClusterNode, name: &str) -> bool {
    cluster.forget_node(name);
    match reconcile(st, cluster, name).await {
        Ok(r) => {
            tracing::info!(node = %name, kept = r.kept.len(), orphans = r.orphans_deleted.len(), lost = r.marked_lost.len(), "node joined; reconciled");
            true
        }
        Err(e) => {
            tracing::warn!(node = %name, error = %e, "node joined but its reconcile failed; retried");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_sum_follows_placements_in_and_out_of_the_window() {
        let mut recent = HashMap::new();
        let t0 = Instant::now();
        let q: &mut RecentQueue = recent.entry("n1".to_owned()).or_default();
        q.push((t0, 0.5, 256, Some("job-a".into())));
        q.push((t0 + Duration::from_secs(1), 0.25, 128, Some("job-a".into())));
        q.push((t0 + Duration::from_secs(1), 1.0, 64, None));
        let all = recent_on(&mut recent, "n1", t0 + Duration::from_millis(1500));
        assert_eq!(all.usage.sandboxes, 3);
        assert_eq!(all.usage.memory_mib, 448);
        assert!((all.usage.cpu - 1.75).abs() < 1e-9);
        assert_eq!(all.jobs.get("job-a"), Some(&2));
        // The first placement leaves the window: its share leaves the sum.
        let later = recent_on(
            &mut recent,
            "n1",
            t0 + RECENT_PLACEMENT + Duration::from_millis(500),
        );
        assert_eq!(later.usage.sandboxes, 2);
        assert_eq!(later.usage.memory_mib, 192);
        assert_eq!(later.jobs.get("job-a"), Some(&1));
        // All gone: an empty sum, and the node's entry dropped.
        let none = recent_on(&mut recent, "n1", t0 + RECENT_PLACEMENT * 3);
        assert_eq!(none, Recent::default());
        assert!(recent.is_empty());
        assert_eq!(recent_on(&mut recent, "other", t0), Recent::default());
    }
}
