//! `GET /metrics`: Prometheus metrics through the `prometheus-client` crate, exposed in the
//! OpenMetrics 1.0 text format (`application/openmetrics-text; version=1.0.0`, which
//! Prometheus scrapes natively; the body ends with `# EOF`).
//!
//! | name | type | labels | source |
//! |---|---|---|---|
//! | `sandlot_sandboxes` | gauge | `backend`, `state` | store records, counted at scrape |
//! | `sandlot_create_seconds` | histogram | `backend` | `node.create` of each sandbox |
//! | `sandlot_exec_seconds` | histogram | `backend`, `outcome` = `ok`\|`timeout`\|`error` | every exec run on the node (API, stream, `run_code`); replays are not execs |
//! | `sandlot_trajectory_replays_total` | counter | | steps answered from the trajectory log |
//! | `sandlot_trajectory_steps_logged_total` | counter | | steps appended to the log |
//! | `sandlot_run_code_total` | counter | `status` = `Success`\|`Failed`\|`SandboxError`\|`Rejected` | `/run_code` calls (`Rejected`: 429/504 from admission) |
//! | `sandlot_run_code_running`, `sandlot_run_code_waiting` | gauge | | `run_code` admission, at scrape |
//! | `sandlot_image_count` | gauge | | complete images in the image store, at scrape |
//! | `sandlot_image_bytes_fetched_total` | counter | `tier` = `registry`\|`disk` | bytes of lazy-image chunks loaded from the registry / the node's disk cache (verified), summed over the lazy mount daemons' stats files at scrape ([`sandlot_node::images::lazy::fetch`]) |
//! | `sandlot_image_chunk_cache_hits_total` | counter | `tier` = `memory`\|`disk` | chunk lookups answered by a daemon's memory tier / the disk cache |
//! | `sandlot_image_chunk_cache_misses_total` | counter | | chunk lookups that went to the registry |
//! | `sandlot_image_chunk_cache_hit_ratio` | gauge | | hits / (hits + misses), since the store was made (0 before any lookup) |
//! | `sandlot_image_chunk_corrupt_total` | counter | `tier` = `disk`\|`registry` | chunks that failed their digest check (never served) |
//! | `sandlot_image_chunk_fetch_failures_total` | counter | | chunk fetches that failed every attempt (readers got `EIO`) |
//! | `sandlot_image_chunk_fetch_seconds` | histogram | | latency of successful registry chunk fetches |
//! | `sandlot_image_chunk_evictions_total`, `sandlot_image_chunk_evicted_bytes_total` | counter | | chunks evicted from the disk cache by its cap |
//! | `sandlot_image_cache_bytes`, `sandlot_image_cache_limit_bytes` | gauge | | the disk chunk cache's size and cap (`--image-cache-mib`; 0: none) |
//! | `sandlot_image_pulls_total` | counter | `mode` = `eager`\|`lazy`, `outcome` = `ok`\|`not_found`\|`error` | pulls into the image store by any process (node, `sandlot image pull`), from its counters file at scrape ([`sandlot_node::images::pull_stats`]) |
//! | `sandlot_image_pull_bytes_total` | counter | `mode` | bytes of blobs those pulls downloaded from registries |
//! | `process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds` | counter, gauge, gauge | | this process (`getrusage`, procfs), at scrape |
//! | `sandlot_host_cpus`, `sandlot_host_load1` | gauge | | CPUs online and the 1-minute load average of the host, at scrape |
//! | `sandlot_host_cpu_seconds_total` | counter | `mode` = `user`\|`nice`\|`system`\|`idle`\|`iowait`\|`irq`\|`softirq`\|`steal` | the host's CPU time (`/proc/stat`), at scrape |
//! | `sandlot_host_memory_bytes` | gauge | `kind` = `total`\|`available` | the host's memory (`/proc/meminfo` `MemTotal`, `MemAvailable`), at scrape |
//! | `sandlot_warm_pool_ready` | gauge | `backend`, `image` | ready members of the node's warm pools (function jails, runc containers), at scrape |
//! | `sandlot_warm_pool_handovers_total`, `sandlot_warm_pool_misses_total` | counter | `backend` | creates served by a pooled member / creates the pool could serve that went cold, since the node started (the node's counts, copied at scrape) |
//! | `sandlot_warm_pool_image_handovers_total` | counter | `backend`, `image` | the hand-overs per image (`run_code` on a pooled `lang-*` image counts here), copied at scrape |
//! | `sandlot_events_total` | counter | `kind` | audit events recorded ([`crate::events`]) |
//! | `sandlot_connections` | gauge | | open API connections, at scrape ([`crate::conn`]) |
//! | `sandlot_connections_refused_total` | counter | `reason` = `total`\|`per_ip` | connections closed at accept: limit reached and none idle to make room |
//! | `sandlot_connections_closed_total` | counter | `reason` = `evicted`\|`header_timeout`\|`idle_timeout`\|`write_stall` | connections the server closed |
//! | `sandlot_requests_shed_total` | counter | `reason` = `total`\|`per_ip`\|`body` | requests answered 503 over the in-flight limit (server-wide / of the peer's address / of requests with a body still arriving) |
//! | `sandlot_request_body_timeouts_total` | counter | | requests answered 408: the body arrived too slowly ([`crate::conn::Paced`]) |
//! | `sandlot_accept_errors_total` | counter | `error` (errno name, e.g. `EMFILE`) | failed `accept` calls (each followed by a back-off) |
//! | `sandlot_events_pending` | gauge | | audit events waiting for a durable write (disk full), at scrape ([`crate::events`]) |
//! | `sandlot_events_dropped_total` | counter | | audit events dropped because that queue was full |
//! | `sandlot_data_dir_free_bytes`, `sandlot_data_dir_reserve_bytes` | gauge | | free space of the data directory's file system and its reserve, at scrape ([`crate::disk_reserve`]) |
//! | `sandlot_server_leader` | gauge | | 1 while this server runs the singletons (TTL reaper, lost-node sweep, trajectory retention, stale-transition sweep): always without `--etcd`, while it holds the etcd election with it ([`crate::leader`]) |
//! | `sandlot_cluster_nodes` | gauge | `simulated` = `true`\|`false` | nodes registered in etcd (cluster mode; `true`: `sandlot node --simulate` identities), at scrape |
//! | `sandlot_violations_total` | counter | `backend`, `layer` = `seccomp`\|`files_api`, `what` (syscall name or files API operation) | refused attempts recorded as `violation` events |
//!
//! Hot paths only touch the crate's atomics (a read lock on a label family to find the
//! series); no lock is held across an `.await`. Seconds are wall-clock seconds.
use crate::error::ApiResult;
use crate::SharedState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use sandlot_api::Backend;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Mutex;

mod collectors;

/// Content type of the `/metrics` answer.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels `backend`, `state`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct BackendState {
    /// Backend name.
    pub backend: String,
    /// Sandbox state.
    pub state: String,
}

/// Labels `backend`, `image`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// Backend name.
    pub backend: String,
    /// Image name.
    pub image: String,
}

/// Label `backend`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    /// Backend name.
    pub backend: String,
}

/// Labels `backend`, `outcome`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExecLabels {
    /// Backend name.
    pub backend: String,
    /// `ok`, `timeout` or `error`.
    pub outcome: String,
}

/// Label `status`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// `run_code` status.
    pub status: String,
}

/// Labels `backend`, `layer`, `what` of `sandlot_violations_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ViolationLabels {
    /// Backend name.
    pub backend: String,
    /// Refusing layer: `seccomp` or `files_api`.
    pub layer: String,
    /// Syscall name (seccomp) or files API operation (`read`, `write`, ...).
    pub what: String,
}

/// Label `simulated` (`true` for nodes of `sandlot node --simulate`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SimulatedLabel {
    /// `"true"` or `"false"`.
    pub simulated: String,
}

/// Label `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why.
    pub reason: String,
}

/// Label `error`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    /// Errno name.
    pub error: String,
}

/// Label `kind`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// Event kind.
    pub kind: String,
}

fn create_histogram() -> Histogram {
    // 10 ms … ~82 s.
    Histogram::new(exponential_buckets(0.01, 2.0, 14))
}

fn exec_histogram() -> Histogram {
    // 1 ms … ~262 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 19))
}

/// Outcome label of an exec: `timeout` when it hit its timeout, `ok` when it ran (any exit
/// code), `error` (`None`) when the node failed.
pub fn exec_outcome(r: Option<&sandlot_api::ExecResult>) -> &'static str {
    match r {
        Some(r) if r.timed_out => "timeout",
        Some(_) => "ok",
        None => "error",
    }
}

/// Figures read at scrape for the gauges of the audit queue and the data directory.
pub struct ScrapeExtra {
    /// Open API connections.
    pub connections: usize,
    /// Audit events waiting for a durable write.
    pub events_pending: usize,
    /// Audit events dropped since start.
    pub events_dropped: u64,
    /// Free bytes of the data directory's file system (None: unreadable).
    pub data_dir_free: Option<u64>,
    /// Its reserve in bytes.
    pub data_dir_reserve: u64,
    /// Cluster mode: nodes registered in etcd, `[real, simulated]`; `None` outside it.
    pub cluster_nodes: Option<[i64; 2]>,
    /// The lazy image tiers of the image store (`None`: no image store configured).
    pub lazy: Option<sandlot_node::images::lazy::fetch::LazyMetrics>,
    /// The image store's pull counters (`None`: no image store configured).
    pub pulls: Option<sandlot_node::images::pull_stats::PullStats>,
}

/// The `sandlot_image_*` lazy-image metrics: counts summed from the daemons' stats files at
/// scrape (the daemons are processes of their own), encoded as constant metrics.
#[derive(Debug, Default)]
struct LazyCollector(std::sync::Arc<Mutex<Option<sandlot_node::images::lazy::fetch::LazyMetrics>>>);

impl prometheus_client::collector::Collector for LazyCollector {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::NoLabelSet;
        use prometheus_client::metrics::MetricType;
        let Some(m) = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return Ok(());
        };
        let s = &m.stats;
        // (name, help, series by `tier` label; "" = no label)
        type Series<'a> = &'a [(&'a str, u64)];
        let counters: [(&str, &str, Series); 8] = [
            (
                "sandlot_image_bytes_fetched",
                "Bytes of lazy-image chunks loaded, by tier (registry: remote; disk: node cache)",
                &[("registry", s.registry_bytes), ("disk", s.disk_bytes)],
            ),
            (
                "sandlot_image_chunk_cache_hits",
                "Lazy-image chunk lookups answered by a cache tier",
                &[("memory", s.memory_hits), ("disk", s.disk_hits)],
            ),
            (
                "sandlot_image_chunk_corrupt",
                "Lazy-image chunks that failed their digest check, by tier (never served)",
                &[("disk", s.corrupt_disk), ("registry", s.corrupt_registry)],
            ),
            (
                "sandlot_image_chunk_cache_misses",
                "Lazy-image chunk lookups that went to the registry",
                &[("", s.misses)],
            ),
            (
                "sandlot_image_chunk_fetch_failures",
                "Lazy-image chunk fetches that failed every attempt (readers got EIO)",
                &[("", s.failures)],
            ),
            (
                "sandlot_image_chunk_evictions",
                "Chunks evicted from the node's disk cache by its size cap",
                &[("", s.evictions)],
            ),
            (
                "sandlot_image_complete_files",
                "Complete-file copies of lazy-image files assembled from verified cached chunks",
                &[("", s.complete_files)],
            ),
            (
                "sandlot_image_passthrough_opens",
                "Lazy-image file opens served by FUSE passthrough from a complete-file copy",
                &[("", s.passthrough_opens)],
            ),
        ];
        for (name, help, series) in counters {
            let mut d = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (tier, v) in series {
                if tier.is_empty() {
                    d.encode_counter::<NoLabelSet, _, u64>(v, None)?;
                } else {
                    d.encode_family(&[("tier", *tier)])?
                        .encode_counter::<NoLabelSet, _, u64>(v, None)?;
                }
            }
        }
        enc.encode_descriptor(
            "sandlot_image_chunk_evicted_bytes",
            "Bytes of the chunks evicted from the node's disk cache",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&s.evicted_bytes, None)?;
        let hits = s.memory_hits + s.disk_hits;
        let ratio = if hits + s.misses == 0 {
            0.0
        } else {
            hits as f64 / (hits + s.misses) as f64
        };
        for (name, help, v) in [
            (
                "sandlot_image_chunk_cache_hit_ratio",
                "Lazy-image chunk lookups answered by a cache tier / all lookups",
                ratio,
            ),
            (
                "sandlot_image_cache_bytes",
                "Bytes in the node's lazy-image chunk cache",
                m.cache_bytes as f64,
            ),
            (
                "sandlot_image_cache_limit_bytes",
                "Size cap of the node's lazy-image chunk cache (0: none)",
                m.cache_limit.unwrap_or(0) as f64,
            ),
        ] {
            enc.encode_descriptor(name, help, None, MetricType::Gauge)?
                .encode_gauge(&v)?;
        }
        let mut buckets: Vec<(f64, u64)> = sandlot_node::images::lazy::fetch::FETCH_BUCKETS
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(s.fetch_buckets.iter().copied().chain(std::iter::repeat(0)))
            .collect();
        buckets.truncate(sandlot_node::images::lazy::fetch::FETCH_BUCKETS.len() + 1);
        enc.encode_descriptor(
            "sandlot_image_chunk_fetch_seconds",
            "Latency of successful lazy-image chunk fetches from the registry, seconds",
            None,
            MetricType::Histogram,
        )?
        .encode_histogram::<NoLabelSet>(
            s.fetch_us_sum as f64 / 1e6,
            s.fetches,
            &buckets,
            None,
        )
    }
}

/// Every metric of the server and its registry.
pub struct Metrics {
    registry: Registry,
    sandboxes: Family<BackendState, Gauge>,
    /// Label sets of `sandlot_sandboxes` ever set, so states that emptied read 0.
    seen: Mutex<BTreeSet<BackendState>>,
    create_seconds: Family<BackendLabel, Histogram, fn() -> Histogram>,
    exec_seconds: Family<ExecLabels, Histogram, fn() -> Histogram>,
    /// Steps answered from the trajectory log.
    pub replays: Counter,
    /// Steps appended to the trajectory log.
    pub steps_logged: Counter,
    run_code: Family<StatusLabel, Counter>,
    run_code_running: Gauge,
    run_code_waiting: Gauge,
    image_count: Gauge,
    pool_ready: Family<PoolLabels, Gauge>,
    pool_handovers: Family<BackendLabel, Counter>,
    pool_image_handovers: Family<PoolLabels, Counter>,
    pool_misses: Family<BackendLabel, Counter>,
    events: Family<KindLabel, Counter>,
    violations: Family<ViolationLabels, Counter>,
    connections: Gauge,
    conn_refused: Family<ReasonLabel, Counter>,
    conn_closed: Family<ReasonLabel, Counter>,
    requests_shed: Family<ReasonLabel, Counter>,
    body_timeouts: Counter,
    accept_errors: Family<ErrorLabel, Counter>,
    events_pending: Gauge,
    events_dropped: Counter,
    data_dir_free: Gauge,
    data_dir_reserve: Gauge,
    leader: Gauge,
    cluster_nodes: Family<SimulatedLabel, Gauge>,
    lazy: std::sync::Arc<Mutex<Option<sandlot_node::images::lazy::fetch::LazyMetrics>>>,
    pulls: std::sync::Arc<Mutex<Option<sandlot_node::images::pull_stats::PullStats>>>,
    /// The last minutes in 10 s buckets, for the status page's charts.
    pub timeline: crate::timeline::Timeline,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Sets `sandlot_server_leader` (1 while this server runs the singletons).
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let sandboxes = Family::<BackendState, Gauge>::default();
        registry.register(
            "sandlot_sandboxes",
            "Sandboxes by backend and state",
            sandboxes.clone(),
        );
        let create_seconds =
            Family::<BackendLabel, Histogram, fn() -> Histogram>::new_with_constructor(
                create_histogram,
            );
        registry.register(
            "sandlot_create_seconds",
            "Time of the node's create of a sandbox, seconds",
            create_seconds.clone(),
        );
        let exec_seconds = Family::<ExecLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            exec_histogram,
        );
        registry.register(
            "sandlot_exec_seconds",
            "Wall time of execs run on the node, seconds",
            exec_seconds.clone(),
        );
        let replays = Counter::default();
        registry.register(
            "sandlot_trajectory_replays",
            "Steps answered from the trajectory log",
            replays.clone(),
        );
        let steps_logged = Counter::default();
        registry.register(
            "sandlot_trajectory_steps_logged",
            "Steps appended to the trajectory log",
            steps_logged.clone(),
        );
        let run_code = Family::<StatusLabel, Counter>::default();
        registry.register(
            "sandlot_run_code",
            "run_code calls by status (Rejected: refused by admission control)",
            run_code.clone(),
        );
        let run_code_running = Gauge::default();
        registry.register(
            "sandlot_run_code_running",
            "run_code calls running",
            run_code_running.clone(),
        );
        let run_code_waiting = Gauge::default();
        registry.register(
            "sandlot_run_code_waiting",
            "run_code calls waiting for a slot",
            run_code_waiting.clone(),
        );
        let image_count = Gauge::default();
        registry.register(
            "sandlot_image_count",
            "Complete images in the image store",
            image_count.clone(),
        );
        let pool_ready = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "sandlot_warm_pool_ready",
            "Ready members of the node's warm pools, by backend and image",
            pool_ready.clone(),
        );
        let pool_handovers = Family::<BackendLabel, Counter>::default();
        registry.register(
            "sandlot_warm_pool_handovers",
            "Creates served by a hand-over of a pooled member",
            pool_handovers.clone(),
        );
        let pool_image_handovers = Family::<PoolLabels, Counter>::default();
        registry.register(
            "sandlot_warm_pool_image_handovers",
            "Creates served by a hand-over of a pooled member, by backend and image",
            pool_image_handovers.clone(),
        );
        let pool_misses = Family::<BackendLabel, Counter>::default();
        registry.register(
            "sandlot_warm_pool_misses",
            "Creates a warm pool could serve that found no usable member and went cold",
            pool_misses.clone(),
        );
        let events = Family::<KindLabel, Counter>::default();
        registry.register(
            "sandlot_events",
            "Audit events recorded, by kind",
            events.clone(),
        );
        let violations = Family::<ViolationLabels, Counter>::default();
        registry.register(
            "sandlot_violations",
            "Refused dangerous attempts (seccomp reports, files API path escapes)",
            violations.clone(),
        );
        let connections = Gauge::default();
        registry.register(
            "sandlot_connections",
            "Open API connections",
            connections.clone(),
        );
        let conn_refused = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "sandlot_connections_refused",
            "Connections closed at accept: limit reached (total or per_ip) and none idle",
            conn_refused.clone(),
        );
        let conn_closed = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "sandlot_connections_closed",
            "Connections the server closed (evicted, header_timeout, idle_timeout)",
            conn_closed.clone(),
        );
        let requests_shed = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "sandlot_requests_shed",
            "Requests answered 503 over an in-flight request limit (total or per_ip)",
            requests_shed.clone(),
        );
        let body_timeouts = Counter::default();
        registry.register(
            "sandlot_request_body_timeouts",
            "Requests answered 408: the request body arrived too slowly",
            body_timeouts.clone(),
        );
        let accept_errors = Family::<ErrorLabel, Counter>::default();
        registry.register(
            "sandlot_accept_errors",
            "Failed accept calls by errno (each followed by a back-off)",
            accept_errors.clone(),
        );
        let events_pending = Gauge::default();
        registry.register(
            "sandlot_events_pending",
            "Audit events waiting for a durable write",
            events_pending.clone(),
        );
        let events_dropped = Counter::default();
        registry.register(
            "sandlot_events_dropped",
            "Audit events dropped because the queue of events waiting for a write was full",
            events_dropped.clone(),
        );
        let data_dir_free = Gauge::default();
        registry.register(
            "sandlot_data_dir_free_bytes",
            "Bytes available on the data directory's file system",
            data_dir_free.clone(),
        );
        let data_dir_reserve = Gauge::default();
        registry.register(
            "sandlot_data_dir_reserve_bytes",
            "Free-space reserve of the data directory (creates refused below it)",
            data_dir_reserve.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "sandlot_server_leader",
            "1 while this server runs the singletons (TTL reaper, sweeps, GC), else 0",
            leader.clone(),
        );
        let cluster_nodes = Family::<SimulatedLabel, Gauge>::default();
        registry.register(
            "sandlot_cluster_nodes",
            "Nodes registered in etcd, by simulated (sandlot node --simulate) or real",
            cluster_nodes.clone(),
        );
        let lazy = LazyCollector::default();
        let lazy_slot = lazy.0.clone();
        registry.register_collector(Box::new(lazy));
        let pulls = collectors::PullCollector::default();
        let pulls_slot = pulls.0.clone();
        registry.register_collector(Box::new(pulls));
        registry.register_collector(Box::new(collectors::HostCollector));
        Metrics {
            lazy: lazy_slot,
            pulls: pulls_slot,
            leader,
            cluster_nodes,
            events_pending,
            events_dropped,
            data_dir_free,
            data_dir_reserve,
            connections,
            conn_refused,
            conn_closed,
            requests_shed,
            body_timeouts,
            accept_errors,
            violations,
            registry,
            sandboxes,
            seen: Mutex::new(BTreeSet::new()),
            create_seconds,
            exec_seconds,
            replays,
            steps_logged,
            run_code,
            run_code_running,
            run_code_waiting,
            image_count,
            pool_ready,
            pool_handovers,
            pool_image_handovers,
            pool_misses,
            events,
            timeline: Default::default(),
        }
    }

    /// Observe one node create.
    pub fn create_done(&self, backend: Backend, secs: f64) {
        self.create_seconds
            .get_or_create(&BackendLabel {
                backend: backend.as_str().to_owned(),
            })
            .observe(secs);
        self.timeline.create_at(crate::timeline::now_s());
    }

    /// Observe one exec run on the node (`outcome` from [`exec_outcome`]).
    pub fn exec_done(&self, backend: Backend, outcome: &str, secs: f64) {
        self.exec_seconds
            .get_or_create(&ExecLabels {
                backend: backend.as_str().to_owned(),
                outcome: outcome.to_owned(),
            })
            .observe(secs);
        self.timeline.exec_at(crate::timeline::now_s(), secs);
    }

    /// Count one `run_code` call with its final status.
    pub fn run_code_done(&self, status: &str) {
        self.run_code
            .get_or_create(&StatusLabel {
                status: status.to_owned(),
            })
            .inc();
    }

    /// Count one refused attempt (`layer` `seccomp` or `files_api`; `what` the syscall or
    /// files API operation).
    pub fn violation(&self, backend: Backend, layer: &str, what: &str) {
        self.violations
            .get_or_create(&ViolationLabels {
                backend: backend.as_str().to_owned(),
                layer: layer.to_owned(),
                what: what.to_owned(),
            })
            .inc();
    }

    /// Count one connection refused at accept (`reason` `total` or `per_ip`).
    pub fn conn_refused(&self, reason: &str) {
        self.conn_refused
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Count one connection closed by the server (`evicted`, `header_timeout`,
    /// `idle_timeout`).
    pub fn conn_closed(&self, reason: &str) {
        self.conn_closed
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Count one request shed over an in-flight limit (`reason` `total` or `per_ip`).
    pub fn request_shed(&self, reason: &str) {
        self.requests_shed
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Count one request answered `408`: its body arrived too slowly.
    pub fn body_timeout(&self) {
        self.body_timeouts.inc();
    }

    /// Count one failed `accept` (`error`: errno name).
    pub fn accept_error(&self, error: &str) {
        self.accept_errors
            .get_or_create(&ErrorLabel {
                error: error.to_owned(),
            })
            .inc();
    }

    /// Count one audit event.
    pub fn event(&self, kind: &str) {
        self.events
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Set the scrape-time gauges and encode everything.
    fn render(
        &self,
        counts: BTreeMap<BackendState, i64>,
        running: usize,
        waiting: usize,
        images: Option<i64>,
        pools: &[sandlot_node_api::WarmPoolInfo],
        extra: &ScrapeExtra,
    ) -> String {
        self.connections.set(extra.connections as i64);
        self.events_pending.set(extra.events_pending as i64);
        self.events_dropped.inc_by(
            extra
                .events_dropped
                .saturating_sub(self.events_dropped.get()),
        );
        if let Some(free) = extra.data_dir_free {
            self.data_dir_free.set(free as i64);
        }
        self.data_dir_reserve.set(extra.data_dir_reserve as i64);
        *self.lazy.lock().unwrap_or_else(|p| p.into_inner()) = extra.lazy.clone();
        *self.pulls.lock().unwrap_or_else(|p| p.into_inner()) = extra.pulls.clone();
        if let Some(counts) = extra.cluster_nodes {
            for (simulated, n) in ["false", "true"].into_iter().zip(counts) {
                self.cluster_nodes
                    .get_or_create(&SimulatedLabel {
                        simulated: simulated.into(),
                    })
                    .set(n);
            }
        }
        for p in pools {
            let backend = p.backend.as_str().to_owned();
            for (image, n) in &p.ready {
                let l = PoolLabels {
                    backend: backend.clone(),
                    image: image.clone(),
                };
                self.pool_ready.get_or_create(&l).set(*n as i64);
            }
            for (image, n) in &p.handovers_by_image {
                let l = PoolLabels {
                    backend: backend.clone(),
                    image: image.clone(),
                };
                let c = self.pool_image_handovers.get_or_create(&l);
                c.inc_by(n.saturating_sub(c.get()));
            }
            // The node counts; these counters follow it (only this function adds to them).
            let l = BackendLabel { backend };
            for (c, n) in [
                (&self.pool_handovers, p.handovers),
                (&self.pool_misses, p.misses),
            ] {
                let c = c.get_or_create(&l);
                c.inc_by(n.saturating_sub(c.get()));
            }
        }
        {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            for l in seen.iter() {
                if !counts.contains_key(l) {
                    self.sandboxes.get_or_create(l).set(0);
                }
            }
            for (l, n) in counts {
                self.sandboxes.get_or_create(&l).set(n);
                seen.insert(l);
            }
        }
        self.run_code_running.set(running as i64);
        self.run_code_waiting.set(waiting as i64);
        if let Some(n) = images {
            self.image_count.set(n);
        }
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)
            .expect("encoding into a String cannot fail");
        s
    }
}

/// Complete images under `dir`: entries with an `image.json` (the image store's marker of a
/// finished build; builds in progress live in temp directories without one), short-named
/// ones in `dir` and reference-named ones in `dir/refs`.
pub fn count_images(dir: &Path) -> std::io::Result<i64> {
    let mut n = 0;
    for ent in std::fs::read_dir(dir)? {
        let ent = ent?;
        let name = ent.file_name();
        let valid = name
            .to_str()
            .is_some_and(|s| sandlot_node::validate_image_name(s).is_ok());
        if valid && ent.path().join("image.json").is_file() {
            n += 1;
        }
    }
    // Images named by an OCI reference live in refs/<sha256 of the reference>/.
    if let Ok(rd) = std::fs::read_dir(dir.join("refs")) {
        for ent in rd.flatten() {
            let hashed = ent
                .file_name()
                .to_str()
                .is_some_and(|s| s.len() == 64 && s.bytes().all(|c| c.is_ascii_hexdigit()));
            if hashed && ent.path().join("image.json").is_file() {
                n += 1;
            }
        }
    }
    Ok(n)
}

/// `GET /metrics` → the metrics of the module table, OpenMetrics text.
pub async fn metrics(State(st): State<SharedState>) -> ApiResult<impl IntoResponse> {
    let mut counts: BTreeMap<BackendState, i64> = BTreeMap::new();
    for (backend, state, n) in st.store.count_by_state().await? {
        *counts.entry(BackendState { backend, state }).or_default() += n as i64;
    }
    let (images, lazy, pulls) = match st.cfg.images_dir.clone() {
        None => (None, None, None),
        Some(dir) => tokio::task::spawn_blocking(move || {
            (
                count_images(&dir).ok(),
                Some(sandlot_node::images::lazy::fetch::read_metrics(&dir)),
                Some(sandlot_node::images::pull_stats::read(&dir)),
            )
        })
        .await
        .unwrap_or((None, None, None)),
    };
    let (running, waiting) = st.run_code_gate.load();
    let pools = st.node.info().warm_pools;
    let (events_pending, events_dropped) = st.events.pending();
    let extra = ScrapeExtra {
        connections: st.conns.open(),
        events_pending,
        events_dropped,
        data_dir_free: crate::disk_reserve::free_bytes(&st.cfg.data_dir)
            .ok()
            .map(|(a, _)| a),
        data_dir_reserve: st.cfg.disk_reserve_bytes,
        cluster_nodes: st.cluster.get().map(|c| {
            let mut n = [0i64; 2];
            for r in c.nodes().values() {
                n[usize::from(r.simulated)] += 1;
            }
            n
        }),
        lazy,
        pulls,
    };
    let text = st
        .metrics
        .render(counts, running, waiting, images, &pools, &extra);
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], text))
}
