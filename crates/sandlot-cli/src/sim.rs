//! `sandlot node --simulate N`: simulated node identities for proving the control plane at
//! scale (issue 22 item 1). Not a sandbox backend: [`SimNode`] keeps each sandbox as a small
//! in-memory record, waits a configured delay on create and exec, and runs nothing.
//!
//! Each identity registers its own [`NodeRecord`] (with `simulated: true`) under its own etcd
//! lease and serves the real node API (`sandlot_node_remote::router_gated`, fenced like a
//! real node) on its own listener, so servers, etcd and PostgreSQL see N ordinary nodes.
//! All identities share one tokio runtime and one etcd client (the lease keep-alive streams
//! are multiplexed on its gRPC channel).
//!
//! What a simulated sandbox does:
//! - create: waits `create_delay`, then keeps `{id, backend, paused, cpu, memory}`; refused
//!   with `resource_exhausted` when the node holds `max_sandboxes` (creating ones counted);
//!   a create of an id it has is answered `Ok` (idempotent, as the contract asks).
//! - exec (also `exec_controlled`, stdin and signals ignored): waits `exec_delay`, then exit
//!   0 with stdout [`exec_stdout`] (names the node and says nothing ran).
//! - pause / resume (also `pause_many` / `resume_many`: one lock for all ids) / delete /
//!   list / readopt: on the records (exec of a paused one answers
//!   `conflict`, as on a real node). Records live in memory only: a restarted simulation
//!   has none, so its servers mark the old ones `lost` or delete them on reconcile.
//! - files, checkpoints, ports: `unavailable` with a message that says the node is
//!   simulated ([`unsupported`]); an unknown sandbox is `not_found` first.
use async_trait::async_trait;
use bytes::Bytes;
use sandlot_api::{Backend, ExecEvent, ExecRequest, ExecResult, FileEntry};
use sandlot_cluster::{LeaseConfig, NodeRecord, NodeRegistration, Resources};
use sandlot_node_api::{
    ExecControl, ExecSink, Liveness, Node, NodeError, NodeInfo, NodeResult, SandboxSpec,
    SandboxStatus,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Settings shared by every simulated identity of one process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// How long a create takes.
    pub create_delay: Duration,
    /// How long an exec takes.
    pub exec_delay: Duration,
    /// Sandboxes one identity holds at most (its published `capacity.sandboxes`).
    pub max_sandboxes: u64,
    /// Published cpu capacity of one identity, cores.
    pub cpu: f64,
    /// Published memory capacity of one identity, MiB.
    pub memory_mib: u64,
}

/// One simulated sandbox: 12 bytes beside its id (the map key).
#[derive(Debug, Clone, Copy)]
struct Rec {
    backend: Backend,
    paused: bool,
    /// CPU quota in thousandths of a core.
    cpu_milli: u32,
    memory_mib: u32,
}

#[derive(Default)]
struct Book {
    sandboxes: HashMap<Box<str>, Rec>,
    /// Creates admitted and waiting their delay (they hold a slot of the capacity).
    creating: u64,
    /// Sum of `cpu_milli` of `sandboxes`.
    cpu_milli: u64,
    /// Sum of `memory_mib` of `sandboxes`.
    memory_mib: u64,
}

/// A simulated node: sandboxes as in-memory records (see the module docs).
pub struct SimNode {
    name: String,
    cfg: SimConfig,
    book: Mutex<Book>,
    execs: AtomicU64,
}

/// The stdout of every simulated exec on node `node`.
pub fn exec_stdout(node: &str) -> String {
    format!("simulated exec on simulated node {node} (sandlot node --simulate): nothing ran\n")
}

/// The `unavailable` error of a call a simulated node does not simulate (`what`: "files",
/// "checkpoints", ...). Its code is `unavailable` (HTTP 503 through a server).
pub fn unsupported(node: &str, what: &str) -> NodeError {
    NodeError::Unavailable(format!(
        "simulated node {node} (sandlot node --simulate): {what} are not simulated"
    ))
}

impl SimNode {
    /// A simulated node named `name`.
    pub fn new(name: String, cfg: SimConfig) -> Self {
        SimNode {
            name,
            cfg,
            book: Mutex::new(Book::default()),
            execs: AtomicU64::new(0),
        }
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What its sandboxes hold now (count, cpu and memory summed; cpu in whole hundredths).
    pub fn usage(&self) -> Resources {
        let b = self.book();
        Resources {
            cpu: (b.cpu_milli / 10) as f64 / 100.0,
            memory_mib: b.memory_mib,
            sandboxes: b.sandboxes.len() as u64,
        }
    }

    /// Execs answered since start.
    pub fn execs(&self) -> u64 {
        self.execs.load(Ordering::Relaxed)
    }

    /// `Ok(paused)` of sandbox `id`, or `NotFound`.
    fn paused(&self, id: &str) -> NodeResult<bool> {
        self.book()
            .sandboxes
            .get(id)
            .map(|r| r.paused)
            .ok_or_else(|| self.not_found(id))
    }

    fn not_found(&self, id: &str) -> NodeError {
        NodeError::NotFound(format!("no sandbox {id} on simulated node {}", self.name))
    }

    fn set_paused(&self, id: &str, paused: bool) -> NodeResult<()> {
        let mut b = self.book();
        match b.sandboxes.get_mut(id) {
            Some(r) => {
                r.paused = paused;
                Ok(())
            }
            None => Err(self.not_found(id)),
        }
    }

    /// [`SimNode::set_paused`] of every id, under one lock; per-id results in order.
    fn set_paused_many(&self, ids: &[String], paused: bool) -> Vec<NodeResult<()>> {
        let mut b = self.book();
        ids.iter()
            .map(|id| match b.sandboxes.get_mut(id.as_str()) {
                Some(r) => {
                    r.paused = paused;
                    Ok(())
                }
                None => Err(self.not_found(id)),
            })
            .collect()
    }

    /// `NotFound` for an unknown sandbox, else the "not simulated" error for `what`.
    fn unsupported_on(&self, id: &str, what: &str) -> NodeError {
        match self.paused(id) {
            Err(e) => e,
            Ok(_) => unsupported(&self.name, what),
        }
    }

    fn remove(&self, id: &str) {
        let mut b = self.book();
        if let Some(r) = b.sandboxes.remove(id) {
            b.cpu_milli -= u64::from(r.cpu_milli);
            b.memory_mib -= u64::from(r.memory_mib);
        }
    }

    async fn run(&self, id: &str, sink: Option<ExecSink>) -> NodeResult<ExecResult> {
        if self.paused(id)? {
            return Err(NodeError::Conflict(format!("sandbox {id} is paused")));
        }
        tokio::time::sleep(self.cfg.exec_delay).await;
        // Deleted or paused during the delay: as a real node whose sandbox went away.
        if self.paused(id)? {
            return Err(NodeError::Conflict(format!("sandbox {id} is paused")));
        }
        self.execs.fetch_add(1, Ordering::Relaxed);
        let stdout = exec_stdout(&self.name);
        if let Some(s) = sink {
            let _ = s
                .send(ExecEvent::Stdout {
                    data: stdout.clone(),
                    data_b64: None,
                })
                .await;
        }
        Ok(ExecResult {
            exit_code: 0,
            signal: None,
            timed_out: false,
            oom_killed: false,
            duration_ms: self.cfg.exec_delay.as_secs_f64() * 1000.0,
            stdout_bytes: stdout.len() as u64,
            stdout,
            stderr: String::new(),
            stdout_b64: None,
            stderr_b64: None,
            stderr_bytes: 0,
            truncated: false,
            replayed: false,
            violations: Vec::new(),
        })
    }
}

#[async_trait]
impl Node for SimNode {
    fn info(&self) -> NodeInfo {
        NodeInfo {
            name: self.name.clone(),
            backends: [
                Backend::Function,
                Backend::Container,
                Backend::Microvm,
                Backend::Vm,
            ]
            .into_iter()
            .map(|b| (b, Ok(())))
            .collect(),
            cgroup_version: "simulated".into(),
            runtimes: ["runc", "crun", "runsc"]
                .into_iter()
                .map(|r| (r.to_owned(), Ok(())))
                .collect(),
            accel: Some((None, "simulated node: no accelerator".into())),
            warm_pools: Vec::new(),
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()> {
        {
            let mut b = self.book();
            if b.sandboxes.contains_key(spec.id.as_str()) {
                return Ok(());
            }
            if b.sandboxes.len() as u64 + b.creating >= self.cfg.max_sandboxes {
                return Err(NodeError::ResourceExhausted(format!(
                    "simulated node {} holds {} sandboxes (its --max-sandboxes)",
                    self.name, self.cfg.max_sandboxes
                )));
            }
            b.creating += 1;
        }
        tokio::time::sleep(self.cfg.create_delay).await;
        let rec = Rec {
            backend: spec.backend,
            paused: false,
            cpu_milli: (spec.cpu * 1000.0).round().clamp(0.0, u32::MAX as f64) as u32,
            memory_mib: u32::try_from(spec.memory_mib).unwrap_or(u32::MAX),
        };
        let mut b = self.book();
        b.creating -= 1;
        if b.sandboxes.insert(spec.id.as_str().into(), rec).is_none() {
            b.cpu_milli += u64::from(rec.cpu_milli);
            b.memory_mib += u64::from(rec.memory_mib);
        }
        Ok(())
    }

    async fn exec(
        &self,
        id: &str,
        _req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        self.run(id, sink).await
    }

    async fn exec_controlled(
        &self,
        id: &str,
        _req: &ExecRequest,
        sink: Option<ExecSink>,
        _control: ExecControl,
    ) -> NodeResult<ExecResult> {
        self.run(id, sink).await
    }

    async fn read_file(&self, id: &str, _path: &str, _max: u64) -> NodeResult<Vec<u8>> {
        Err(self.unsupported_on(id, "files"))
    }
    async fn file_size(&self, id: &str, _path: &str) -> NodeResult<u64> {
        Err(self.unsupported_on(id, "files"))
    }
    async fn write_file(&self, id: &str, _path: &str, _data: Bytes) -> NodeResult<()> {
        Err(self.unsupported_on(id, "files"))
    }
    async fn list_dir(&self, id: &str, _path: &str) -> NodeResult<Vec<FileEntry>> {
        Err(self.unsupported_on(id, "files"))
    }
    async fn remove_file(&self, id: &str, _path: &str) -> NodeResult<()> {
        Err(self.unsupported_on(id, "files"))
    }
    async fn stat_file(&self, id: &str, _path: &str) -> NodeResult<FileEntry> {
        Err(self.unsupported_on(id, "files"))
    }
    async fn make_dir(&self, id: &str, _path: &str, _parents: bool) -> NodeResult<()> {
        Err(self.unsupported_on(id, "files"))
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.set_paused(id, true)
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.set_paused(id, false)
    }

    /// All of `ids` under one lock of the book.
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.set_paused_many(ids, true)
    }

    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.set_paused_many(ids, false)
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        self.remove(id);
        Ok(())
    }

    async fn list(&self) -> NodeResult<Vec<SandboxStatus>> {
        Ok(self
            .book()
            .sandboxes
            .iter()
            .map(|(id, r)| SandboxStatus {
                id: id.to_string(),
                backend: r.backend,
                liveness: Liveness::Alive,
            })
            .collect())
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let keep: std::collections::HashSet<&str> = keep.iter().map(String::as_str).collect();
        let gone: Vec<String> = self
            .book()
            .sandboxes
            .keys()
            .filter(|id| !keep.contains(&id[..]))
            .map(|id| id.to_string())
            .collect();
        for id in &gone {
            self.remove(id);
        }
        let b = self.book();
        Ok(keep
            .into_iter()
            .filter(|id| b.sandboxes.contains_key(*id))
            .map(str::to_owned)
            .collect())
    }

    async fn checkpoint(
        &self,
        id: &str,
        _checkpoint_id: &str,
    ) -> NodeResult<sandlot_node_api::CheckpointMeta> {
        Err(self.unsupported_on(id, "checkpoints"))
    }

    async fn create_from_checkpoint(
        &self,
        _spec: &SandboxSpec,
        _checkpoint_id: &str,
    ) -> NodeResult<()> {
        Err(unsupported(&self.name, "checkpoints"))
    }

    async fn connect_port(&self, id: &str, _port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        Err(self.unsupported_on(id, "ports"))
    }
}

/// The record identity `name` publishes: `simulated: true`, the configured capacity, the
/// backends and runtimes of [`SimNode::info`], no accelerator.
pub fn record(name: &str, advertise_url: String, cfg: &SimConfig, started_at: &str) -> NodeRecord {
    let mut r = NodeRecord {
        name: name.to_owned(),
        advertise_url,
        capacity: Resources {
            cpu: cfg.cpu,
            memory_mib: cfg.memory_mib,
            sandboxes: cfg.max_sandboxes,
        },
        started_at: started_at.to_owned(),
        simulated: true,
        ..Default::default()
    };
    let node = SimNode::new(name.to_owned(), *cfg);
    crate::cluster::refresh_info(&mut r, &node.info());
    r
}

/// Keeps identity `node`'s published usage current: every [`crate::cluster::USAGE_PERIOD`]
/// its usage is compared with the record and written to etcd only when it changed (while
/// fenced the change goes out with the re-registration).
pub async fn keep_usage_current(reg: Arc<NodeRegistration>, node: Arc<SimNode>) {
    let mut tick = tokio::time::interval(crate::cluster::USAGE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut published = reg.record().await.usage;
    loop {
        tick.tick().await;
        let usage = node.usage();
        if usage == published {
            continue;
        }
        match reg.update(|r| r.usage = usage).await {
            Ok(()) => published = usage,
            Err(sandlot_cluster::ClusterError::Fenced { .. }) => {}
            Err(e) => {
                tracing::warn!(node = %node.name, simulated = true, error = %e, "updating the simulated node's record failed (retried)")
            }
        }
    }
}

/// What `sandlot node --simulate` runs (checked flags).
pub struct Plan {
    /// Identities to run (N).
    pub count: u32,
    /// Identity `i` is named `{prefix}-{i:03}`.
    pub prefix: String,
    /// etcd client URLs.
    pub etcd: Vec<String>,
    /// Identity `i` listens on this address with port `port + i` (port 0: each a free port).
    pub listen_base: SocketAddr,
    /// Host (name or IP) published in the advertise URLs, `None`: the listen IP.
    pub advertise_host: Option<String>,
    /// Lease timing of every identity.
    pub lease: LeaseConfig,
    /// The node API token (shared with the servers).
    pub token: String,
    /// The simulated backend's settings.
    pub cfg: SimConfig,
}

/// The name of identity `i` of `prefix`.
pub fn identity_name(prefix: &str, i: u32) -> String {
    format!("{prefix}-{i:03}")
}

/// One running identity.
struct Identity {
    name: String,
    node: Arc<SimNode>,
    reg: Arc<NodeRegistration>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Runs the plan until `stop` resolves: binds every listener, registers every identity in
/// etcd (at most 32 registrations at once) and serves their node APIs; prints
/// `sandlot node (simulated) NAME listening on URL` per identity, then `sandlot node
/// --simulate: N simulated nodes ready` on stdout. On `stop` every identity deregisters
/// (its etcd key goes at once).
///
/// # Errors
/// A listener that cannot be bound, etcd unreachable, a registration refused; a node API
/// listener whose accept failed (after deregistering the others).
pub async fn run(plan: Plan, stop: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    use anyhow::Context;
    use futures::{StreamExt, TryStreamExt};
    use std::io::Write;
    use tracing::Instrument;

    let ip = plan.listen_base.ip();
    let host = match &plan.advertise_host {
        Some(h) => h.clone(),
        None if ip.is_unspecified() => anyhow::bail!(
            "--listen-base {} is a wildcard address: give --advertise http://HOST (the host servers reach)",
            plan.listen_base
        ),
        None => match ip {
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        },
    };
    let mut listeners = Vec::with_capacity(plan.count as usize);
    for i in 0..plan.count {
        let mut addr = plan.listen_base;
        if addr.port() != 0 {
            let port = u32::from(addr.port()) + i;
            anyhow::ensure!(port <= 65535, "--listen-base port + {i} is past 65535");
            addr.set_port(port as u16);
        }
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen on {addr}"))?;
        listeners.push(l);
    }
    let client = sandlot_cluster::connect(&plan.etcd)
        .await
        .with_context(|| format!("connect to etcd {}", plan.etcd.join(",")))?;
    let started_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let mut wanted = Vec::with_capacity(listeners.len());
    for (i, l) in listeners.into_iter().enumerate() {
        let name = identity_name(&plan.prefix, i as u32);
        let url = format!("http://{host}:{}", l.local_addr()?.port());
        wanted.push((name, url, l));
    }
    let registered: Vec<(String, String, tokio::net::TcpListener, NodeRegistration)> =
        futures::stream::iter(wanted)
            .map(|(name, url, l)| {
                let rec = record(&name, url.clone(), &plan.cfg, &started_at);
                let (client, lease) = (client.clone(), plan.lease);
                async move {
                    let reg = NodeRegistration::register(&client, rec, lease)
                        .await
                        .with_context(|| format!("register simulated node {name} in etcd"))?;
                    anyhow::Ok((name, url, l, reg))
                }
            })
            .buffered(32)
            .try_collect()
            .await?;
    let (failed_tx, mut failed_rx) = tokio::sync::mpsc::unbounded_channel::<(String, String)>();
    let mut ids = Vec::with_capacity(registered.len());
    for (name, url, listener, reg) in registered {
        let span = tracing::info_span!("simulated_node", node = %name, simulated = true);
        let node = Arc::new(SimNode::new(name.clone(), plan.cfg));
        let fence = reg.fence();
        let reg = Arc::new(reg);
        let gate = Arc::new(crate::cluster::FenceGate {
            name: name.clone(),
            fence: fence.clone(),
            simulated: true,
        });
        let app =
            sandlot_node_remote::router_gated(node.clone(), Some(plan.token.clone()), Some(gate));
        let failed = failed_tx.clone();
        let n = name.clone();
        let tasks = vec![
            tokio::spawn(
                async move {
                    if let Err(e) = sandlot_node_remote::serve(listener, app).await {
                        let _ = failed.send((n, e.to_string()));
                    }
                }
                .instrument(span.clone()),
            ),
            tokio::spawn(keep_usage_current(reg.clone(), node.clone()).instrument(span.clone())),
            tokio::spawn(
                crate::cluster::log_transitions(name.clone(), fence.clone()).instrument(span),
            ),
        ];
        tracing::info!(node = %name, simulated = true, url = %url, lease_id = fence.lease_id(),
            "simulated node registered in etcd; serving the node API (its sandboxes are records, nothing runs)");
        println!("sandlot node (simulated) {name} listening on {url}");
        ids.push(Identity {
            name,
            node,
            reg,
            tasks,
        });
    }
    println!(
        "sandlot node --simulate: {} simulated nodes ready",
        ids.len()
    );
    std::io::stdout().flush().ok();
    tracing::info!(nodes = ids.len(), simulated = true, create_delay = ?plan.cfg.create_delay,
        exec_delay = ?plan.cfg.exec_delay, max_sandboxes = plan.cfg.max_sandboxes,
        "simulation: every node of this process is simulated");
    let failed = tokio::select! {
        () = stop => None,
        f = failed_rx.recv() => f,
    };
    let sandboxes: u64 = ids.iter().map(|i| i.node.usage().sandboxes).sum();
    let execs: u64 = ids.iter().map(|i| i.node.execs()).sum();
    tracing::info!(
        simulated = true,
        sandboxes,
        execs,
        "simulation stopping: deregistering every simulated node"
    );
    futures::stream::iter(ids)
        .for_each_concurrent(32, |id| async move {
            for t in &id.tasks {
                t.abort();
            }
            for t in id.tasks {
                let _ = t.await;
            }
            match Arc::try_unwrap(id.reg) {
                Ok(reg) => {
                    if let Err(e) = reg.deregister().await {
                        tracing::warn!(node = %id.name, simulated = true, error = %e, "deregistering failed; the record goes when the lease expires");
                    }
                }
                Err(_) => tracing::warn!(node = %id.name, simulated = true, "registration still shared; the record goes when the lease expires"),
            }
        })
        .await;
    if let Some((name, e)) = failed {
        anyhow::bail!("simulated node {name}: accept failed: {e}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandlot_api::{Cmd, NetworkPolicy};

    fn spec(id: &str) -> SandboxSpec {
        SandboxSpec {
            id: id.into(),
            backend: Backend::Function,
            image: "python".into(),
            cpu: 0.5,
            memory_mib: 256,
            disk_mib: 1024,
            pids_max: 64,
            env: Default::default(),
            network: NetworkPolicy::None,
            runtime: None,
        }
    }

    fn cfg(max: u64) -> SimConfig {
        SimConfig {
            create_delay: Duration::from_millis(1),
            exec_delay: Duration::from_millis(1),
            max_sandboxes: max,
            cpu: 100.0,
            memory_mib: 1 << 20,
        }
    }

    #[tokio::test]
    async fn records_live_and_die_and_exec_says_it_is_simulated() {
        let n = SimNode::new("sim-000".into(), cfg(2));
        n.create(&spec("sb-1")).await.unwrap();
        n.create(&spec("sb-1")).await.unwrap();
        n.create(&spec("sb-2")).await.unwrap();
        let e = n.create(&spec("sb-3")).await.unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::ResourceExhausted, "{e}");
        assert_eq!(
            n.usage(),
            Resources {
                cpu: 1.0,
                memory_mib: 512,
                sandboxes: 2
            }
        );
        let req = ExecRequest::new(Cmd::Argv(vec!["true".into()]));
        let r = n.exec("sb-1", &req, None).await.unwrap();
        assert_eq!(r.exit_code, 0);
        assert!(r.stdout.contains("simulated node sim-000"), "{}", r.stdout);
        n.pause("sb-1").await.unwrap();
        let e = n.exec("sb-1", &req, None).await.unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::Conflict);
        n.resume("sb-1").await.unwrap();
        // Bulk: per-id results in order, an unknown id fails alone.
        let ids = ["sb-1".to_string(), "sb-9".into(), "sb-2".into()];
        let out = n.pause_many(&ids).await;
        assert!(out[0].is_ok() && out[2].is_ok(), "{out:?}");
        let e = out[1].as_ref().unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::NotFound, "{e}");
        let e = n.exec("sb-2", &req, None).await.unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::Conflict);
        let out = n.resume_many(&ids).await;
        assert!(
            out[0].is_ok() && out[1].is_err() && out[2].is_ok(),
            "{out:?}"
        );
        n.exec("sb-2", &req, None).await.unwrap();
        let e = n.read_file("sb-1", "/x", 10).await.unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::Unavailable);
        assert!(e.to_string().contains("not simulated"), "{e}");
        let e = n.read_file("sb-9", "/x", 10).await.unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::NotFound);
        assert_eq!(
            n.readopt(&["sb-2".into(), "sb-9".into()]).await.unwrap(),
            ["sb-2"]
        );
        n.delete("sb-2").await.unwrap();
        n.delete("sb-2").await.unwrap();
        assert!(n.list().await.unwrap().is_empty());
        assert_eq!(n.usage(), Resources::default());
        assert_eq!(n.execs(), 2);
    }

    #[test]
    fn the_record_says_simulated() {
        let r = record("sim-001", "http://127.0.0.1:1".into(), &cfg(7), "t");
        assert!(r.simulated);
        assert_eq!(r.capacity.sandboxes, 7);
        assert!(r.backends.contains(&Backend::Function));
        assert_eq!(r.accelerator, None);
    }
}
