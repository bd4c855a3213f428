//! Sandlot control plane: the HTTP API v1 of `../../shared/DESIGN.md` over a [`Node`].
//!
//! Start it with [`serve`] (or [`Server::bind`] + [`Server::run`] to learn the bound address
//! first); test handlers without a socket through [`router`]. Records live in SQLite under
//! `DATA/sandlot.db` ([`store`]); a reaper deletes sandboxes whose TTL expired; on start the
//! server asks the node to re-adopt the sandboxes its records say are running
//! ([`lifecycle`]). Routes, one module per resource:
//!
//! | route | module |
//! |---|---|
//! | `POST/GET /v1/sandboxes`, `POST /v1/sandboxes:batch`, `GET /v1/sandboxes:summary`, `GET/DELETE /v1/sandboxes/{id}`, `POST …/keepalive` | [`sandboxes`] |
//! | `POST /v1/sandboxes/{id}/exec[?stream=true]` | [`exec`] |
//! | `/v1/sandboxes/{id}/processes[/{pid}[/output\|/wait\|/signal\|/stdin\|/resize]]` | [`processes`] |
//! | `PUT/GET/DELETE /v1/sandboxes/{id}/files?path=P`, `GET …/files/list?path=P` | [`files`] |
//! | `POST /v1/sandboxes:pause`, `:resume`, `:delete` | [`pause`] |
//! | `POST /v1/sandboxes/{id}/checkpoints`, `GET /v1/checkpoints[/{ck}]`, `DELETE /v1/checkpoints/{ck}` | [`checkpoints`] |
//! | `GET/DELETE /v1/trajectories/{*id}`; step semantics of exec and files | [`trajectory`] |
//! | `POST /run_code` (SandboxFusion-compatible), `GET /v1/run_code/languages` | [`run_code`] |
//! | `POST /run_jupyter` (SandboxFusion-compatible) | [`run_code::jupyter`] |
//! | `GET /v1/ping`, `/healthz`, `/openapi.json` | [`health`] |
//! | `GET /metrics` | [`metrics`] |
//! | `GET /v1/events` (audit events, durable in `events.db`) | [`events`] |
//! | `GET /v1/nodes` (the nodes, `simulated` ones marked) | [`nodes`] |
//! | `GET /v1/timeline` (creates/s and exec latency, last 10 min) | [`timeline`] |
//! | `GET /` (status page) | [`web`] |
//! | `ANY /v1/sandboxes/{id}/ports/{port}/…` and host names `<port>-<id>.<domain>` (ingress) | [`ingress`] |
//! | E2B's control plane (`/v2/sandboxes`, `/sandboxes/{id}/…`) and envd (`/process.Process/…`, `/health`) | [`e2b`] |
//!
//! Authentication and tenant scoping of every route: [`auth`] (one layer over the router).
//!
//! The trajectory log lives behind [`trajectory_store::TrajectoryStore`] (SQLite in
//! `DATA/trajectories.db`). Errors map to HTTP in one place, [`error`].
#![deny(missing_docs)]

pub mod auth;
pub mod budget;
pub mod checkpoints;
pub mod cluster;
pub mod conn;
pub mod disk_reserve;
pub mod e2b;
pub mod error;
pub mod events;
pub mod exec;
pub mod files;
pub mod health;
pub mod ingress;
pub mod leader;
pub mod lifecycle;
pub mod metrics;
pub mod nodes;
pub mod pause;
pub mod pg;
pub mod placement;
pub mod processes;
pub mod registry;
pub mod run_code;
pub mod sandboxes;
pub mod store;
pub mod timeline;
pub mod trajectory;
pub mod trajectory_store;
pub mod web;

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_batch;
#[cfg(test)]
mod tests_checkpoints;
#[cfg(test)]
mod tests_hardening;
#[cfg(test)]
mod tests_ingress;
#[cfg(test)]
mod tests_observe;
#[cfg(test)]
mod tests_processes;
#[cfg(test)]
mod tests_quota_cost;
#[cfg(test)]
mod tests_slowbody;
#[cfg(test)]
mod tests_tenants;

use anyhow::Context;
use axum::extract::{DefaultBodyLimit, MatchedPath};
use axum::routing::{any, get, post};
use axum::Router;
use sandlot_node_api::Node;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Server settings. [`ServerConfig::new`] gives the documented defaults.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on (default `127.0.0.1:7070`).
    pub listen: SocketAddr,
    /// OCI runtime of `container` sandboxes created without one (default `runc`; must match
    /// the node's `NodeConfig::default_runtime`).
    pub default_runtime: String,
    /// Data directory; the store is `DATA/sandlot.db` unless [`ServerConfig::postgres_url`]
    /// is set (audit events and process output spill stay here either way).
    pub data_dir: PathBuf,
    /// PostgreSQL URL (libpq URI form, [`pg`]) of the sandbox registry and trajectory log
    /// instead of the SQLite files under `data_dir` (default none). Without
    /// [`ServerConfig::election`] one server per database ([`pg::SERVER_LOCK`]); with it
    /// any number.
    pub postgres_url: Option<String>,
    /// Id of this server: the owner of the transitions it runs ([`leader`]) and its value
    /// in the election (default [`leader::default_server_id`]: host, pid, random).
    pub server_id: String,
    /// How long a create or delete may go without its heartbeat before another server
    /// takes it over (default 30 s; renewed every third of it; [`leader`]).
    pub transition_ttl: Duration,
    /// The etcd election of the singletons (default none: this server runs them;
    /// [`leader`]). Lets several servers share one PostgreSQL database.
    pub election: Option<leader::ElectionConfig>,
    /// Largest JSON request body in bytes (default 16 MiB); larger → 413 `payload_too_large`.
    pub max_json_bytes: usize,
    /// Largest file upload and download in bytes (default 256 MiB); larger → 413 on upload,
    /// 400 `invalid_argument` from the node on download.
    pub max_file_bytes: usize,
    /// Server-wide bytes of file data that reads may hold in memory at once (default
    /// 1 GiB; [`budget`]).
    pub file_read_budget_bytes: u64,
    /// Longest wait for a share of that budget or of the exec output budget (default 2 s);
    /// then 429 `resource_exhausted`.
    pub file_read_budget_wait: Duration,
    /// Server-wide bytes of exec output that foreground execs may hold at once, each
    /// reserving 8 × its `max_output_bytes` (default 1 GiB; [`budget`]).
    pub exec_output_budget_bytes: u64,
    /// Total bytes `run_code` returns in `files` per call (default 64 MiB); files past it
    /// are left out and named in `message`.
    pub run_code_fetch_bytes: u64,
    /// `run_code` calls running at once (default max(4, 4 × cores)).
    pub run_code_concurrency: usize,
    /// CPU limit of a `run_code` sandbox, in cores (default: the host's cores, at most 64;
    /// SandboxFusion runs code without a CPU cap, and a JVM or a compiler driver held to 1
    /// core runs 1.4–1.8× slower). A caller whose API key has a `max_cpu` quota gets at
    /// most 1 core per call, so that quota counts concurrent calls as before.
    pub run_code_cpu: f64,
    /// `run_code` calls allowed to wait for a slot (default 256); more → 429 at once.
    pub run_code_queue: usize,
    /// Longest wait for a `run_code` slot (default 10 s); then 504 `deadline_exceeded`.
    pub run_code_wait: Duration,
    /// Period of the TTL reaper (default 1 s).
    pub reap_interval: Duration,
    /// How long an `Idempotency-Key` is remembered (default 24 h).
    pub idempotency_ttl: Duration,
    /// How long a clean shutdown waits for in-flight requests (default 10 s).
    pub shutdown_grace: Duration,
    /// Trajectory logs whose last activity is older than this and whose sandbox is gone are
    /// deleted (default 168 h; `sandlot up --trajectory-retention-h`).
    pub trajectory_retention: Duration,
    /// Period of the trajectory retention pass (default 60 s).
    pub trajectory_gc_interval: Duration,
    /// `synchronous=FULL` for the trajectory log: a logged step also survives power loss, at
    /// one fsync per step (default false: `NORMAL`, survives a crash of the server process).
    pub trajectory_fsync: bool,
    /// Connection limits and timeouts ([`conn`]).
    pub conn: conn::ConnLimits,
    /// Timeouts of ingress connections to ports inside sandboxes ([`ingress`]).
    pub ingress: ingress::IngressLimits,
    /// Free space of the data directory's file system below which creates, checkpoints and
    /// uploads are refused (default 256 MiB; 0 = no check; [`disk_reserve`]).
    pub disk_reserve_bytes: u64,
    /// Image store directory, read at scrape for `sandlot_image_count` (default none: the
    /// gauge stays 0; `sandlot up` sets the node's).
    pub images_dir: Option<PathBuf>,
    /// The E2B-compatible surface: image of the `base` template, backend ([`e2b`]).
    pub e2b: e2b::E2bConfig,
    /// Without [`ServerConfig::postgres_url`]: how long [`Server::bind`] waits for another
    /// process to release `DATA/server.lock` before it fails (default 10 s,
    /// [`sandlot_node::dirlock::DEFAULT_WAIT`]).
    pub lock_wait: Duration,
}

impl ServerConfig {
    /// Defaults for a data directory.
    pub fn new(data_dir: PathBuf) -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            default_runtime: "runc".to_string(),
            data_dir,
            max_json_bytes: 16 << 20,
            max_file_bytes: 256 << 20,
            file_read_budget_bytes: 1 << 30,
            file_read_budget_wait: Duration::from_secs(2),
            exec_output_budget_bytes: 1 << 30,
            run_code_fetch_bytes: 64 << 20,
            run_code_concurrency: (4 * cores).max(4),
            run_code_cpu: cores.min(64) as f64,
            run_code_queue: 256,
            run_code_wait: Duration::from_secs(10),
            reap_interval: Duration::from_secs(1),
            idempotency_ttl: Duration::from_secs(24 * 3600),
            shutdown_grace: Duration::from_secs(10),
            trajectory_retention: Duration::from_secs(168 * 3600),
            trajectory_gc_interval: Duration::from_secs(60),
            trajectory_fsync: false,
            postgres_url: None,
            server_id: leader::default_server_id(),
            transition_ttl: leader::DEFAULT_TRANSITION_TTL,
            election: None,
            images_dir: None,
            conn: conn::ConnLimits::default(),
            ingress: ingress::IngressLimits::default(),
            disk_reserve_bytes: 256 << 20,
            e2b: e2b::E2bConfig::default(),
            lock_wait: sandlot_node::dirlock::DEFAULT_WAIT,
        }
    }
}

/// Shared state of every handler.
pub struct AppState {
    /// Settings.
    pub cfg: ServerConfig,
    /// The node running the sandboxes, behind the file read budget
    /// ([`budget::BudgetNode`]).
    pub node: Arc<dyn Node>,
    /// The file read budget shared by every read.
    pub file_budget: Arc<budget::FileBudget>,
    /// The same node as [`AppState::node`], for reads that keep their budget share.
    pub budget_node: Arc<budget::BudgetNode>,
    /// Durable records: sandboxes, Idempotency-Keys, API keys, trajectory owners and
    /// checkpoints ([`registry::Registry`]: SQLite [`store::Store`] under `sandlot up` and a
    /// single server, [`registry::PgRegistry`] when servers share PostgreSQL).
    pub store: Arc<dyn registry::Registry>,
    /// Name of the node (from [`Node::info`]).
    pub node_name: String,
    /// Admission control of `run_code`.
    pub run_code_gate: run_code::Gate,
    /// Ids whose `node.create` is in flight in this process; the reaper leaves them to
    /// their creator, which rolls them back itself.
    pub creating: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Ids whose `node.delete` is in flight in this process; the reaper, which retries
    /// deletes that failed, leaves them alone (two deletes of one container at once race
    /// in the OCI runtime and can leave its cgroups behind).
    pub deleting: std::sync::Mutex<std::collections::HashSet<String>>,
    /// The trajectory log.
    pub trajectories: Arc<dyn trajectory_store::TrajectoryStore>,
    /// Per-trajectory locks serialising the calls of one trajectory.
    pub traj_locks: trajectory::Locks,
    /// When the last trajectory retention pass ran, Unix ms.
    pub last_traj_gc_ms: std::sync::atomic::AtomicI64,
    /// Prometheus metrics ([`metrics`]).
    pub metrics: metrics::Metrics,
    /// Audit events, durable in `events.db` ([`events`]).
    pub events: events::EventLog,
    /// Open connections and their limits ([`conn`]).
    pub conns: Arc<conn::ConnTable>,
    /// Authentication required (latched once the store showed an API key; [`auth`]).
    pub auth_on: std::sync::atomic::AtomicBool,
    /// E2B process ids of the envd surface ([`e2b`]).
    pub e2b: e2b::E2bState,
    /// Cluster mode: the node set behind [`AppState::node`] (placement before a create's
    /// record is written, the lost-node sweeper), set once by [`Server::bind_cluster`]; unset
    /// for one node (`sandlot up`, `sandlot server --node`).
    pub cluster: std::sync::OnceLock<Arc<cluster::ClusterNode>>,
    /// Whether this server runs the singletons now ([`leader`]; `/healthz` `leader`).
    pub leader: std::sync::atomic::AtomicBool,
}

/// Handler state: cheap to clone.
pub type SharedState = Arc<AppState>;

impl AppState {
    /// Open the store under `cfg.data_dir` (creating the directory).
    ///
    /// # Errors
    /// The data directory cannot be created or the database cannot be opened.
    pub fn open(cfg: ServerConfig, node: Arc<dyn Node>) -> anyhow::Result<SharedState> {
        std::fs::create_dir_all(&cfg.data_dir)
            .with_context(|| format!("create data dir {}", cfg.data_dir.display()))?;
        let db = cfg.data_dir.join("sandlot.db");
        let store = Arc::new(store::Store::open(&db)?);
        let trajectories = Arc::new(trajectory_store::SqliteTrajectoryStore::open(
            &cfg.data_dir.join("trajectories.db"),
            cfg.trajectory_fsync,
        )?);
        AppState::open_with(cfg, node, store, trajectories)
    }

    /// As [`AppState::open`], with the registry and the trajectory log given (PostgreSQL's,
    /// [`pg::open_server`]).
    ///
    /// # Errors
    /// The data directory (audit events) cannot be created or opened.
    pub fn open_with(
        cfg: ServerConfig,
        node: Arc<dyn Node>,
        store: Arc<dyn registry::Registry>,
        trajectories: Arc<dyn trajectory_store::TrajectoryStore>,
    ) -> anyhow::Result<SharedState> {
        std::fs::create_dir_all(&cfg.data_dir)
            .with_context(|| format!("create data dir {}", cfg.data_dir.display()))?;
        let node_name = node.info().name;
        let file_budget = Arc::new(budget::FileBudget::new(
            cfg.file_read_budget_bytes,
            cfg.file_read_budget_wait,
        ));
        let exec_budget = Arc::new(budget::FileBudget::named(
            "exec output",
            cfg.exec_output_budget_bytes,
            cfg.file_read_budget_wait,
        ));
        let budget_node = Arc::new(
            budget::BudgetNode::new(node, file_budget.clone()).with_exec_budget(exec_budget),
        );
        let node: Arc<dyn Node> = budget_node.clone();
        let run_code_gate = run_code::Gate::new(cfg.run_code_concurrency, cfg.run_code_queue);
        let events = events::EventLog::open(&cfg.data_dir.join("events.db"))?;
        let conns = Arc::new(conn::ConnTable::new(cfg.conn.clone()));
        Ok(Arc::new(AppState {
            conns,
            cfg,
            node,
            file_budget,
            budget_node,
            store,
            node_name,
            run_code_gate,
            creating: Default::default(),
            deleting: Default::default(),
            trajectories,
            traj_locks: Default::default(),
            last_traj_gc_ms: std::sync::atomic::AtomicI64::new(now_ms()),
            metrics: metrics::Metrics::new(),
            events,
            auth_on: std::sync::atomic::AtomicBool::new(false),
            e2b: Default::default(),
            cluster: std::sync::OnceLock::new(),
            leader: std::sync::atomic::AtomicBool::new(false),
        }))
    }
}

impl AppState {
    pub(crate) fn creating_set(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.creating.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn deleting_set(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.deleting.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The whole HTTP API as an axum router (no socket; drive it with `tower::ServiceExt`).
pub fn router(state: SharedState) -> Router {
    let trace = tower_http::trace::TraceLayer::new_for_http().make_span_with(
        |req: &axum::http::Request<axum::body::Body>| {
            let route = req
                .extensions()
                .get::<MatchedPath>()
                .map(|m| m.as_str().to_owned())
                .unwrap_or_default();
            let sandbox_id = req
                .uri()
                .path()
                .strip_prefix("/v1/sandboxes/")
                .and_then(|r| r.split('/').next())
                .unwrap_or("");
            tracing::info_span!("http", method = %req.method(), route, sandbox_id)
        },
    );
    let app = Router::new()
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get_one).delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/keepalive", post(sandboxes::keepalive))
        .route("/v1/sandboxes/{id}/checkpoints", post(checkpoints::create))
        .route("/v1/checkpoints", get(checkpoints::list))
        .route(
            "/v1/checkpoints/{checkpoint_id}",
            get(checkpoints::get_one).delete(checkpoints::delete),
        )
        .route("/v1/sandboxes/{id}/exec", post(exec::exec))
        .route(
            "/v1/sandboxes/{id}/processes",
            post(processes::spawn).get(processes::list),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}",
            get(processes::get_one).delete(processes::delete),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/output",
            get(processes::output),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/wait",
            post(processes::wait),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/signal",
            post(processes::signal),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/stdin",
            post(processes::stdin),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/resize",
            post(processes::resize),
        )
        .route(
            "/v1/sandboxes/{id}/files",
            get(files::read)
                .put(files::write)
                .delete(files::remove)
                // Uploads get their own, larger limit than JSON bodies.
                .layer(DefaultBodyLimit::max(state.cfg.max_file_bytes))
                // Uploads reserve their size from the file data budget first.
                .layer(axum::middleware::from_fn_with_state(
                    state.clone(),
                    files::upload_share,
                )),
        )
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/stat", get(files::stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .route("/v1/sandboxes:batch", post(sandboxes::create_batch))
        .route("/v1/sandboxes:pause", post(pause::pause))
        .route("/v1/sandboxes:resume", post(pause::resume))
        .route("/v1/sandboxes:delete", post(pause::delete))
        .route("/v1/sandboxes:summary", get(sandboxes::summary))
        .route(
            "/v1/trajectories/{*id}",
            get(trajectory::get).delete(trajectory::delete),
        )
        .route("/run_code", post(run_code::run_code))
        .route("/v1/run_code/languages", get(run_code::list_languages))
        .route("/run_jupyter", post(run_code::jupyter::run_jupyter))
        .route("/v1/sandboxes/{id}/ports/{port}", any(ingress::proxy))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(ingress::proxy))
        .route(
            "/v1/sandboxes/{id}/ports/{port}/{*path}",
            any(ingress::proxy),
        )
        .route("/v1/ping", get(health::ping))
        .route("/healthz", get(health::healthz))
        .route("/metrics", get(metrics::metrics))
        .route("/v1/events", get(events::list))
        .route("/v1/nodes", get(nodes::list))
        .route("/v1/timeline", get(timeline::get))
        .route("/", get(web::index))
        .route("/openapi.json", get(health::openapi))
        // E2B's control plane and envd protocol (their paths do not collide with /v1).
        .merge(e2b::routes())
        .fallback(error::not_found_route)
        .method_not_allowed_fallback(error::method_not_allowed)
        // Every route, present and future: credentials, admin scope, tenant of `{id}`.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::authorize,
        ))
        // Before auth: E2B's X-API-KEY / X-Access-Token become Bearer credentials.
        .layer(axum::middleware::from_fn(e2b::credentials))
        .layer(DefaultBodyLimit::max(state.cfg.max_json_bytes))
        .layer(trace)
        .with_state(state);
    // Ingress host names (`<port>-<sandbox-id>.<domain>`) become `/v1/sandboxes/{id}/ports/…`
    // before routing ([`ingress::rewrite`]).
    Router::new().fallback_service(tower::ServiceExt::map_request(app, ingress::rewrite))
}

/// A server bound to its socket, records recovered, not yet serving.
pub struct Server {
    state: SharedState,
    listener: tokio::net::TcpListener,
    /// With [`ServerConfig::postgres_url`]: the stores and the server lock, held while the
    /// server lives.
    _pg: Option<pg::ServerStores>,
    /// Without it: `DATA/server.lock` ([`sandlot_node::dirlock`]), held while the server
    /// lives.
    _dir_lock: Option<sandlot_node::dirlock::DirLock>,
}

impl Server {
    /// Open the store, bind `cfg.listen`, and re-adopt the sandboxes of a previous run
    /// ([`lifecycle::recover`]). With the SQLite store (no [`ServerConfig::postgres_url`])
    /// it first locks `DATA/server.lock` ([`sandlot_node::dirlock`]), waiting up to
    /// [`ServerConfig::lock_wait`] for another process that holds it; the lock is held while
    /// the server lives.
    ///
    /// # Errors
    /// Store, bind or re-adoption failures, with context; a non-loopback `cfg.listen` while
    /// the store holds no API key (the server would serve anyone without authentication);
    /// [`sandlot_node::dirlock::DirLockError::Held`] when another process holds the data
    /// directory's server lock (nothing was opened); with PostgreSQL,
    /// [`pg::PgError::InUse`] when another server without an election runs on the database.
    pub async fn bind(cfg: ServerConfig, node: Arc<dyn Node>) -> anyhow::Result<Server> {
        Self::bind_with(cfg, node, None).await
    }

    /// [`Server::bind`] in cluster mode: sandboxes are placed on the nodes of `cluster`;
    /// start-up reconciles every registered node ([`cluster::recover`]) and
    /// [`Server::run`] runs the lost-node sweeper ([`cluster::spawn_sweeper`]).
    ///
    /// # Errors
    /// As [`Server::bind`].
    pub async fn bind_cluster(
        cfg: ServerConfig,
        cluster: Arc<cluster::ClusterNode>,
    ) -> anyhow::Result<Server> {
        Self::bind_with(cfg, cluster.clone(), Some(cluster)).await
    }

    async fn bind_with(
        cfg: ServerConfig,
        node: Arc<dyn Node>,
        cluster: Option<Arc<cluster::ClusterNode>>,
    ) -> anyhow::Result<Server> {
        let listen = cfg.listen;
        let data_dir = cfg.data_dir.clone();
        let on_pg = cfg.postgres_url.is_some();
        // Before the store is opened: a second server on this directory changes nothing.
        let dir_lock = if on_pg {
            None
        } else {
            std::fs::create_dir_all(&data_dir)
                .with_context(|| format!("create data dir {}", data_dir.display()))?;
            let (dir, wait) = (data_dir.clone(), cfg.lock_wait);
            Some(
                tokio::task::spawn_blocking(move || {
                    use sandlot_node::dirlock::{DirLock, SERVER_LOCK};
                    DirLock::acquire(&dir, SERVER_LOCK, "server", wait)
                })
                .await??,
            )
        };
        let (state, pg) = match cfg.postgres_url.clone() {
            None => (AppState::open(cfg, node)?, None),
            Some(url) => {
                let pg = pg::open_server(&url, cfg.election.is_none())
                    .await
                    .context("open the PostgreSQL stores")?;
                let state =
                    AppState::open_with(cfg, node, pg.registry.clone(), pg.trajectories.clone())?;
                (state, Some(pg))
            }
        };
        if let Some(c) = cluster {
            let _ = state.cluster.set(c);
        }
        if !listen.ip().is_loopback() && !state.store.has_keys().await? {
            let (store, flag) = if on_pg {
                (
                    "the PostgreSQL store".to_owned(),
                    "--postgres URL".to_owned(),
                )
            } else {
                let db = data_dir.join("sandlot.db").display().to_string();
                (db, format!("--data-dir {}", data_dir.display()))
            };
            anyhow::bail!(
                "refusing to listen on {listen} without authentication: no API keys in \
                 {store}. Create one with `sandlot key create {flag} --name NAME --admin`, \
                 or listen on a loopback address (127.0.0.1, ::1)"
            );
        }
        if auth::enabled(&state).await? {
            tracing::info!(
                "API keys present: every request needs one (except ping, healthz, openapi)"
            );
        } else {
            tracing::info!("no API keys: no authentication (allowed on loopback only)");
        }
        lifecycle::recover(&state)
            .await
            .context("re-adopt sandboxes of the previous run")?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("listen on {listen}"))?;
        Ok(Server {
            state,
            listener,
            _pg: pg,
            _dir_lock: dir_lock,
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serve until `shutdown` resolves, then stop accepting, give in-flight requests up to
    /// `shutdown_grace`, and return. Sandboxes are left running for the next start to
    /// re-adopt (sandboxes outlive processes).
    ///
    /// # Errors
    /// None at present: accept failures (`EMFILE` …) are backed off and counted
    /// ([`conn`]), not returned.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let state = self.state;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        // The reaper, sweeps and GC: here, or on the elected server ([`leader`]).
        let singletons = tokio::spawn(leader::run(state.clone(), stop_rx.clone()));
        let grace = state.cfg.shutdown_grace;
        tracing::info!(
            max_connections = state.conns.max_total(),
            limits = ?state.cfg.conn,
            "connection limits"
        );
        let app = router(state.clone());
        let mut stopped = stop_rx.clone();
        tokio::spawn(async move {
            shutdown.await;
            tracing::info!("shutting down: no new connections, finishing in-flight requests");
            let _ = stop_tx.send(true);
        });
        let serve = conn::serve(self.listener, app, state, stop_rx);
        let out = tokio::select! {
            _ = serve => Ok(()),
            _ = async {
                let _ = stopped.wait_for(|s| *s).await;
                tokio::time::sleep(grace).await;
            } => {
                tracing::warn!(?grace, "in-flight requests still running after the grace period; exiting");
                Ok(())
            }
        };
        // Give a leader a moment to resign, so another server takes over at once.
        let _ = tokio::time::timeout(Duration::from_secs(3), singletons).await;
        out
    }
}

/// Bind, recover and serve until `shutdown` resolves (see [`Server::run`]).
///
/// # Errors
/// As [`Server::bind`] and [`Server::run`].
pub async fn serve(
    cfg: ServerConfig,
    node: Arc<dyn Node>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let server = Server::bind(cfg, node).await?;
    tracing::info!(addr = %server.local_addr()?, "sandlot server listening");
    server.run(shutdown).await
}

/// Current time in Unix milliseconds.
pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
