//! `sandlot node --etcd`: the node's registration in etcd (its [`NodeRecord`] under a lease
//! kept alive by `sandlot_cluster::NodeRegistration`), the usage updates, and the fence as
//! the node API's [`ServingGate`] (issue 21, DESIGN.md "Cluster mode").
use async_trait::async_trait;
use bytes::Bytes;
use sandlot_api::{ExecRequest, ExecResult, FileEntry};
use sandlot_cluster::{Fence, NodeRecord, NodeRegistration, Resources};
use sandlot_node_api::{
    CheckpointMeta, ExecControl, ExecSink, Liveness, Node, NodeError, NodeInfo, NodeResult,
    SandboxSpec, SandboxStatus,
};
use sandlot_node_remote::ServingGate;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// How often the node compares its usage (and accelerator, images) with the published
/// record; it writes to etcd only when something changed.
pub const USAGE_PERIOD: Duration = Duration::from_secs(1);

/// Limits of one sandbox as the node knows them: cores, MiB, and when they were learned.
type Limits = (f64, u64, Instant);

/// A [`Node`] that remembers the cpu and memory of every sandbox created through it (and,
/// for re-adopted ones, what their `state.json` says), so the node can publish the
/// resources its sandboxes reserve. Every call goes to the inner node unchanged.
pub struct Tracked {
    inner: Arc<dyn Node>,
    limits: Mutex<HashMap<String, Limits>>,
    /// The node's data directory, from [`Tracked::learn_readopted`] (for sandboxes taken
    /// over from the shared snapshot store later).
    data_dir: std::sync::OnceLock<PathBuf>,
    /// The capacity this node publishes ([`Tracked::with_capacity`]), enforced at create.
    capacity: Option<Resources>,
}

impl Tracked {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Node>) -> Self {
        Tracked {
            inner,
            limits: Mutex::new(HashMap::new()),
            data_dir: std::sync::OnceLock::new(),
            capacity: None,
        }
    }

    /// Enforces `capacity` (the one published in etcd) at create: a create that would
    /// take the sandboxes the node knows of (live, and creates in flight) over its
    /// sandbox count, cpu or memory answers `ResourceExhausted`. Servers filter nodes on
    /// the usage published once a second, so a burst of creates (a batch) placed within
    /// that second would otherwise all land on one node, far past what it offers.
    #[must_use]
    pub fn with_capacity(mut self, capacity: Resources) -> Self {
        self.capacity = Some(capacity);
        self
    }

    /// Counts `spec` in before its create runs, if it fits the capacity; `Ok(false)` when
    /// the id is already known (a create of an existing id: the node answers it).
    fn admit(&self, spec: &SandboxSpec) -> NodeResult<bool> {
        let mut limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        if limits.contains_key(&spec.id) {
            return Ok(false);
        }
        if let Some(cap) = &self.capacity {
            let n = limits.len() as u64;
            let cpu: f64 = limits.values().map(|l| l.0).sum();
            let mem: u64 = limits.values().map(|l| l.1).sum();
            let full = if n + 1 > cap.sandboxes {
                Some(format!("{n} of {} sandboxes", cap.sandboxes))
            } else if cpu + spec.cpu > cap.cpu + 1e-9 {
                Some(format!(
                    "cpu {cpu} of {} taken, {} asked",
                    cap.cpu, spec.cpu
                ))
            } else if mem + spec.memory_mib > cap.memory_mib {
                Some(format!(
                    "memory {mem} of {} MiB taken, {} asked",
                    cap.memory_mib, spec.memory_mib
                ))
            } else {
                None
            };
            if let Some(why) = full {
                return Err(NodeError::ResourceExhausted(format!("node full: {why}")));
            }
        }
        limits.insert(spec.id.clone(), (spec.cpu, spec.memory_mib, Instant::now()));
        Ok(true)
    }

    fn remember(&self, spec: &SandboxSpec) {
        self.limits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(spec.id.clone(), (spec.cpu, spec.memory_mib, Instant::now()));
    }

    fn forget(&self, id: &str) {
        self.limits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// Learns the limits of re-adopted sandboxes `ids` from their state files under
    /// `data_dir` (`sandboxes/<id>/state.json` of `function`, `containers/<id>/state.json`
    /// of `container`, `microvm/vms/<id>/state.json` and `vm/vms/<id>/state.json` of the
    /// QEMU backends: the `spec.cpu` and `spec.memory_mib` fields). Sandboxes without a
    /// readable file count as sandboxes with no cpu or memory.
    pub fn learn_readopted(&self, data_dir: &Path, ids: &[String]) {
        let _ = self.data_dir.set(data_dir.to_path_buf());
        for id in ids {
            for sub in ["sandboxes", "containers", "microvm/vms", "vm/vms"] {
                let f: PathBuf = data_dir.join(sub).join(id).join("state.json");
                let Ok(raw) = std::fs::read(&f) else { continue };
                let Ok(v) = serde_json::from_slice::<serde_json::Value>(&raw) else {
                    continue;
                };
                let cpu = v["spec"]["cpu"].as_f64();
                let mem = v["spec"]["memory_mib"].as_u64();
                if let (Some(cpu), Some(mem)) = (cpu, mem) {
                    self.limits
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id.clone(), (cpu, mem, Instant::now()));
                    break;
                }
            }
        }
    }

    /// What the live sandboxes of `listed` (the node's list, taken at `listed_at`) hold.
    /// Limits of sandboxes that were known before `listed_at` but are no longer listed are
    /// dropped (gone without a delete through this node: died, or removed by a restart).
    pub fn usage(&self, listed: &[SandboxStatus], listed_at: Instant) -> Resources {
        let live: std::collections::HashSet<&str> = listed
            .iter()
            .filter(|s| s.liveness != Liveness::Dead)
            .map(|s| s.id.as_str())
            .collect();
        let mut limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        limits.retain(|id, (_, _, at)| live.contains(id.as_str()) || *at >= listed_at);
        let mut r = Resources {
            sandboxes: live.len() as u64,
            ..Default::default()
        };
        for id in &live {
            if let Some((cpu, mem, _)) = limits.get(*id) {
                r.cpu += cpu;
                r.memory_mib += mem;
            }
        }
        // Whole hundredths of a core: sums of floats must compare equal tick to tick.
        r.cpu = (r.cpu * 100.0).round() / 100.0;
        r
    }
}

#[async_trait]
impl Node for Tracked {
    fn info(&self) -> NodeInfo {
        self.inner.info()
    }
    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()> {
        let admitted = self.admit(spec)?;
        if let Err(e) = self.inner.create(spec).await {
            if admitted {
                self.forget(&spec.id);
            }
            return Err(e);
        }
        self.remember(spec);
        Ok(())
    }
    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        self.inner.exec(id, req, sink).await
    }
    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: ExecControl,
    ) -> NodeResult<ExecResult> {
        self.inner.exec_controlled(id, req, sink, control).await
    }
    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        self.inner.read_file(id, path, max_bytes).await
    }
    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        self.inner.file_size(id, path).await
    }
    async fn write_file(&self, id: &str, path: &str, data: Bytes) -> NodeResult<()> {
        self.inner.write_file(id, path, data).await
    }
    async fn write_files_volatile(&self, id: &str, files: Vec<(String, Bytes)>) -> NodeResult<()> {
        self.inner.write_files_volatile(id, files).await
    }
    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        self.inner.list_dir(id, path).await
    }
    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        self.inner.remove_file(id, path).await
    }
    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        self.inner.stat_file(id, path).await
    }
    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        self.inner.make_dir(id, path, parents).await
    }
    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.inner.pause(id).await
    }
    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.inner.resume(id).await
    }
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.inner.pause_many(ids).await
    }
    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.inner.resume_many(ids).await
    }
    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        self.inner.adopt_snapshot(id).await?;
        if let Some(d) = self.data_dir.get() {
            self.learn_readopted(d, &[id.to_owned()]);
        }
        Ok(())
    }
    async fn delete(&self, id: &str) -> NodeResult<()> {
        let r = self.inner.delete(id).await;
        if matches!(r, Ok(()) | Err(NodeError::NotFound(_))) {
            self.forget(id);
        }
        r
    }
    async fn list(&self) -> NodeResult<Vec<SandboxStatus>> {
        self.inner.list().await
    }
    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        self.inner.readopt(keep).await
    }
    async fn checkpoint(&self, id: &str, checkpoint_id: &str) -> NodeResult<CheckpointMeta> {
        self.inner.checkpoint(id, checkpoint_id).await
    }
    async fn create_from_checkpoint(
        &self,
        spec: &SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        let admitted = self.admit(spec)?;
        if let Err(e) = self.inner.create_from_checkpoint(spec, checkpoint_id).await {
            if admitted {
                self.forget(&spec.id);
            }
            return Err(e);
        }
        self.remember(spec);
        Ok(())
    }
    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        self.inner.delete_checkpoint(checkpoint_id).await
    }
    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        self.inner.list_checkpoints().await
    }
    async fn accel(&self) -> Option<String> {
        self.inner.accel().await
    }
    async fn process_spawn(
        &self,
        id: &str,
        req: sandlot_api::SpawnRequest,
    ) -> NodeResult<sandlot_api::Process> {
        self.inner.process_spawn(id, req).await
    }
    async fn process_list(&self, id: &str) -> NodeResult<Vec<sandlot_api::Process>> {
        self.inner.process_list(id).await
    }
    async fn process_get(&self, id: &str, pid: &str) -> NodeResult<sandlot_api::Process> {
        self.inner.process_get(id, pid).await
    }
    async fn process_output(
        &self,
        id: &str,
        pid: &str,
        cursor: sandlot_node_api::OutputCursor,
    ) -> NodeResult<sandlot_node_api::ProcessEvents> {
        self.inner.process_output(id, pid, cursor).await
    }
    async fn process_wait(
        &self,
        id: &str,
        pid: &str,
        timeout: std::time::Duration,
    ) -> NodeResult<sandlot_api::Process> {
        self.inner.process_wait(id, pid, timeout).await
    }
    async fn process_signal(&self, id: &str, pid: &str, signal: i32) -> NodeResult<()> {
        self.inner.process_signal(id, pid, signal).await
    }
    async fn process_stdin(
        &self,
        id: &str,
        pid: &str,
        data: bytes::Bytes,
        eof: bool,
    ) -> NodeResult<()> {
        self.inner.process_stdin(id, pid, data, eof).await
    }
    async fn process_resize(
        &self,
        id: &str,
        pid: &str,
        size: sandlot_api::PtySize,
    ) -> NodeResult<()> {
        self.inner.process_resize(id, pid, size).await
    }
    async fn process_remove(&self, id: &str, pid: &str) -> NodeResult<()> {
        self.inner.process_remove(id, pid).await
    }
}

/// The registration's fence as the node API's gate: calls are refused (503
/// `unavailable`) while the fence is off; `/v1/health` shows `lease_id` and `epoch`.
pub struct FenceGate {
    /// The node's name (in the refusal's message).
    pub name: String,
    /// The fence of the node's registration.
    pub fence: Fence,
    /// A `sandlot node --simulate` identity: `/v1/health` then says `"simulated": true`.
    pub simulated: bool,
}

impl ServingGate for FenceGate {
    fn check(&self) -> Result<(), String> {
        if self.fence.is_serving() {
            Ok(())
        } else {
            Err(format!(
                "node {} is fenced: its etcd lease is not known to be alive (it re-registers when etcd answers)",
                self.name
            ))
        }
    }

    fn status(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("etcd".into(), true.into());
        m.insert("lease_id".into(), self.fence.lease_id().into());
        m.insert("epoch".into(), self.fence.epoch().into());
        if self.simulated {
            m.insert("simulated".into(), true.into());
        }
        m
    }
}

/// The host's capacity: its CPU cores (`available_parallelism`: the affinity mask and
/// cgroup quota of this process) × `cpu_overcommit`, its memory (`MemTotal` of
/// `/proc/meminfo`, MiB), and `max_sandboxes`.
pub fn host_capacity(max_sandboxes: u64, cpu_overcommit: f64) -> Resources {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let cpu = cores * cpu_overcommit;
    let memory_mib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024);
    Resources {
        cpu,
        memory_mib,
        sandboxes: max_sandboxes,
    }
}

/// Backends, runtimes and accelerator the node can really run: what [`Node::info`]
/// reports as available (the accelerator once the QEMU probe has decided).
pub fn refresh_info(record: &mut NodeRecord, info: &NodeInfo) {
    record.backends = info
        .backends
        .iter()
        .filter(|(_, ok)| ok.is_ok())
        .map(|(b, _)| *b)
        .collect();
    record.runtimes = info
        .runtimes
        .iter()
        .filter(|(_, ok)| ok.is_ok())
        .map(|(r, _)| r.clone())
        .collect();
    record.accelerator = info.accel.as_ref().and_then(|(a, _)| a.clone());
}

/// The images of the node's image store: their names, and `sha256:<hex>` of their layers
/// stored under a digest-named directory. An unreadable store leaves the record as it is.
pub fn refresh_images(record: &mut NodeRecord, images_dir: &Path) {
    if let Ok(images) =
        sandlot_node::images::ImageStore::open(images_dir.to_path_buf()).and_then(|s| s.list())
    {
        record.cached_images = images.iter().map(|i| i.name.clone()).collect();
        record.cached_layers = images
            .iter()
            .flat_map(|i| i.layers.iter())
            .filter_map(|l| l.file_name()?.to_str())
            .filter(|n| n.len() == 64 && n.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(|n| format!("sha256:{n}"))
            .collect();
    }
}

/// Keeps the published record current: every [`USAGE_PERIOD`] the node's list gives the
/// usage, its info the backends and accelerator, and every 10th period the image store the
/// cached images; the record is written only when it changed. While the node is fenced the
/// change is kept and goes out with the re-registration.
pub async fn keep_record_current(
    reg: Arc<NodeRegistration>,
    node: Arc<Tracked>,
    images_dir: PathBuf,
) {
    let mut tick = tokio::time::interval(USAGE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n: u64 = 0;
    loop {
        tick.tick().await;
        n += 1;
        let at = Instant::now();
        let listed = match node.list().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "listing sandboxes for the usage failed");
                continue;
            }
        };
        let usage = node.usage(&listed, at);
        let mut want = reg.record().await;
        want.usage = usage;
        refresh_info(&mut want, &node.info());
        if n.is_multiple_of(10) {
            refresh_images(&mut want, &images_dir);
        }
        if want == reg.record().await {
            continue;
        }
        match reg.update(|r| *r = want).await {
            Ok(()) => tracing::debug!(?usage, "node record updated"),
            Err(sandlot_cluster::ClusterError::Fenced { .. }) => {}
            Err(e) => tracing::warn!(error = %e, "updating the node record failed (retried)"),
        }
    }
}

/// Logs each change of the fence once: `fenced` (warn) when the node stops serving,
/// `serving again` (info, with the new lease and epoch) when it re-registered.
pub async fn log_transitions(name: String, fence: Fence) {
    loop {
        fence.fenced().await;
        tracing::warn!(node = %name, lease_id = fence.lease_id(), epoch = fence.epoch(),
            "fenced: no answered etcd lease renewal in time; refusing node API calls (503 unavailable), sandboxes keep running");
        fence.serving().await;
        tracing::info!(node = %name, lease_id = fence.lease_id(), epoch = fence.epoch(),
            "serving again under a new etcd lease");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandlot_api::Backend;

    fn st(id: &str, liveness: Liveness) -> SandboxStatus {
        SandboxStatus {
            id: id.into(),
            backend: Backend::Function,
            liveness,
        }
    }

    #[tokio::test]
    async fn creates_past_the_published_capacity_are_refused() {
        let cap = Resources {
            cpu: 2.5,
            memory_mib: 1024,
            sandboxes: 3,
        };
        let t = Tracked::new(Arc::new(sandlot_node_fake::FakeNode::default())).with_capacity(cap);
        let spec = |id: &str, cpu: f64, mem: u64| SandboxSpec {
            id: id.into(),
            backend: Backend::Function,
            image: "busybox".into(),
            cpu,
            memory_mib: mem,
            disk_mib: 64,
            pids_max: 64,
            env: Default::default(),
            network: Default::default(),
            runtime: None,
        };
        t.create(&spec("a", 1.0, 256)).await.unwrap();
        t.create(&spec("b", 1.0, 256)).await.unwrap();
        let full = |r: NodeResult<()>| matches!(r, Err(NodeError::ResourceExhausted(_)));
        assert!(full(t.create(&spec("cpu", 1.0, 64)).await), "cpu 3 > 2.5");
        assert!(
            full(t.create(&spec("mem", 0.5, 600)).await),
            "memory 1112 > 1024"
        );
        t.create(&spec("c", 0.5, 512)).await.unwrap();
        assert!(full(t.create(&spec("n", 0.0, 0)).await), "4 sandboxes > 3");
        // A refused create left nothing counted; a delete frees its place.
        assert_eq!(t.limits.lock().unwrap().len(), 3);
        t.delete("a").await.unwrap();
        t.create(&spec("d", 1.0, 256)).await.unwrap();
    }

    #[tokio::test]
    async fn usage_sums_the_live_sandboxes_it_knows() {
        let t = Tracked::new(Arc::new(sandlot_node_fake::FakeNode::default()));
        let before = Instant::now();
        for (id, cpu, mem) in [("a", 1.0, 256), ("b", 0.5, 512), ("gone", 2.0, 64)] {
            t.limits
                .lock()
                .unwrap()
                .insert(id.into(), (cpu, mem, before));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let listed = [
            st("a", Liveness::Alive),
            st("b", Liveness::Unknown("probe failed".into())),
            st("dead", Liveness::Dead),
            st("readopted-vm", Liveness::Alive),
        ];
        let u = t.usage(&listed, Instant::now());
        assert_eq!(
            u,
            Resources {
                cpu: 1.5,
                memory_mib: 768,
                sandboxes: 3
            }
        );
        assert!(!t.limits.lock().unwrap().contains_key("gone"));
    }

    #[test]
    fn readopted_limits_come_from_state_files() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("containers/sb-1");
        std::fs::create_dir_all(&f).unwrap();
        std::fs::write(
            f.join("state.json"),
            r#"{"id":"sb-1","spec":{"cpu":2.0,"memory_mib":1024}}"#,
        )
        .unwrap();
        let t = Tracked::new(Arc::new(sandlot_node_fake::FakeNode::default()));
        t.learn_readopted(d.path(), &["sb-1".into(), "sb-2".into()]);
        let l = t.limits.lock().unwrap();
        assert_eq!(l.get("sb-1").map(|x| (x.0, x.1)), Some((2.0, 1024)));
        assert!(!l.contains_key("sb-2"));
    }

    #[test]
    fn capacity_reads_the_host() {
        let c = host_capacity(100, 1.0);
        assert!(
            c.cpu >= 1.0 && c.memory_mib > 0 && c.sandboxes == 100,
            "{c:?}"
        );
    }
}
