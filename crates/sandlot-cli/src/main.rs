//! `sandlot`: run the server (`up`), drive it (`run`, `exec`, `create`, `ls`, `rm`) and
//! manage the local image store (`image`). Logic lives in the libraries; this binary only
//! parses arguments and prints.
//!
//! Exit codes: 0 ok; the command's own exit code for `run` and `exec`; 2 usage errors;
//! 1 any other error (printed as `error: CODE: message`).
mod cluster;
mod shell;
mod sim;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use futures::StreamExt;
use sandlot_api::{Backend, Cmd, CreateSandboxRequest, ExecEvent, ExecRequest, ExecResult};
use sandlot_client::{Client, ClientError};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "sandlot",
    version,
    about = "Isolated sandboxes for AI agents at training scale"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Args, Clone)]
struct Remote {
    /// Server URL; several replicas of one cluster separated by commas (a call whose
    /// connection fails moves to the next).
    #[arg(long, env = "SANDLOT_URL", default_value = "http://127.0.0.1:7070")]
    url: String,
    /// API key (`sk-…`), sent as `Authorization: Bearer`; needed once the server has keys.
    #[arg(long, env = "SANDLOT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

impl Remote {
    fn client(&self) -> anyhow::Result<Client> {
        let c = Client::new(&self.url)?;
        Ok(match &self.api_key {
            Some(k) if !k.is_empty() => c.with_api_key(k)?,
            _ => c,
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the server and a local node in one process (state in DATA/sandlot.db).
    ///
    /// Prints `sandlot listening on http://ADDR` on stdout when ready. SIGTERM/SIGINT stop
    /// accepting connections, give in-flight requests up to 10 s, and exit; sandboxes keep
    /// running and are re-adopted by the next `sandlot up` on the same data directory
    /// (expired ones are then reaped).
    Up(UpArgs),
    /// Serve a local node over the node API (cluster mode; `sandlot server --node URL`
    /// serves the public API in front of it). With --etcd the node registers in the cluster
    /// and fences itself when it cannot renew its lease.
    ///
    /// HTTP/2 cleartext (h2c) and HTTP/1.1 on `--listen`; every call must carry
    /// `Authorization: Bearer <token>` (the token file's content, surrounding whitespace
    /// removed). Prints `sandlot node listening on http://ADDR` on stdout when ready.
    /// SIGTERM/SIGINT stop it (with --etcd: after deleting its etcd record); sandboxes keep
    /// running, and the next `sandlot node` on the same data directory re-adopts every live
    /// one at start (a server's `readopt` then removes those it has no record of).
    Node(NodeArgs),
    /// Run the API server against nodes served by `sandlot node` (cluster mode): one node
    /// (`--node URL`), or every node registered in etcd (`--etcd URLS`: placement over
    /// them, routing by sandbox id, lost-node sweep). State in DATA/sandlot.db, or in
    /// PostgreSQL with `--postgres URL`; with `--etcd` and `--postgres` any number of
    /// servers share one database and elect the one that runs the singletons
    /// (docs/operations.md "Cluster mode").
    ///
    /// Prints `sandlot listening on http://ADDR` on stdout when ready. A call whose node
    /// request failed in transport answers 503 `unavailable` (outcome unknown) and never
    /// marks a sandbox lost; sandboxes are re-adopted through the node API at start.
    Server(ServerArgs),
    /// Create a sandbox, run one command, print its output, delete it; exits with the
    /// command's exit code.
    Run(RunArgs),
    /// Run a command in an existing sandbox; exits with the command's exit code.
    Exec(ExecArgs),
    /// Open an interactive terminal in a sandbox (a login shell, or `-- CMD…`): raw mode,
    /// the window size follows SIGWINCH; exits with the command's exit code. With stdin not
    /// a terminal, its bytes are typed in and its end is typed as Ctrl-D (each second until
    /// the command exits).
    Shell(ShellArgs),
    /// Create a sandbox and print its id (for scripts).
    Create(CreateArgs),
    /// List sandboxes (oldest first).
    Ls(LsArgs),
    /// Delete sandboxes (unknown ids are fine).
    Rm(RmArgs),
    /// Save a sandbox's writable layer as a checkpoint and print its id (`ck-…`); fork it
    /// with `sandlot create --checkpoint CK`.
    Checkpoint(CheckpointArgs),
    /// List checkpoints (oldest first).
    Checkpoints(CheckpointsArgs),
    /// Delete checkpoints (unknown ids are fine; forks made from them live on). Takes
    /// checkpoint ids (`ck-…`).
    RmCheckpoint(RmArgs),
    /// Freeze every running sandbox with all the given labels (e.g. a preempted job's).
    Pause(SelectArgs),
    /// Thaw every paused sandbox with all the given labels.
    Resume(SelectArgs),
    /// Print a trajectory log (`GET /v1/trajectories/{id}`) as JSON.
    Trajectory(TrajectoryArgs),
    /// Manage the local image store directly (no server needed).
    #[command(subcommand)]
    Image(ImageCmd),
    /// Manage API keys in DATA/sandlot.db directly (no server needed; a running server sees
    /// changes at once). The first key turns authentication on (every route but ping, healthz, openapi.json).
    #[command(subcommand)]
    Key(KeyCmd),
    /// Print the version.
    Version,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
struct NodeArgs {
    /// Address to listen on (HOST:PORT; port 0 picks a free one).
    #[arg(long, required_unless_present = "simulate")]
    listen: Option<SocketAddr>,
    /// Data directory (sandbox state, checkpoints, images). One node per directory: a node
    /// already running on it (`DATA/node.lock` held) is waited for 10 s, then this start fails.
    #[arg(long, env = "SANDLOT_DATA_DIR", required_unless_present = "simulate")]
    data_dir: Option<PathBuf>,
    /// Image store directory [default: DATA/images].
    #[arg(long, env = "SANDLOT_IMAGES_DIR")]
    images_dir: Option<PathBuf>,
    /// Shared snapshot store: a directory every node of the cluster mounts at the same
    /// absolute path (NFS, 3FS, ...). A microVM's pause writes its memory, disk and image
    /// disk there, so another node resumes it when this one is gone (docs/operations.md
    /// "Cross-node resume"). Unset: pauses stay on this node's disk.
    #[arg(long, env = "SANDLOT_SNAPSHOT_DIR")]
    snapshot_dir: Option<PathBuf>,
    /// Size cap of the lazy-image chunk cache on this node's disk (`IMAGES/chunks`), MiB:
    /// over it the least recently used chunks not being read are evicted (they are
    /// fetched again when read). 0: no cap [default: 0].
    #[arg(long, env = "SANDLOT_IMAGE_CACHE_MIB")]
    image_cache_mib: Option<u64>,
    /// File holding the node API token (shared with the servers).
    #[arg(long)]
    token_file: PathBuf,
    /// Node name [default: host name]; with --etcd its key is `/sandlot/nodes/NAME`
    /// (ASCII letters, digits, `.`, `_`, `-`). With --simulate: the prefix of the
    /// identities' names, `NAME-000`, `NAME-001`, ... [default: sim].
    #[arg(long)]
    name: Option<String>,
    /// Log format on stderr (level via RUST_LOG, default info).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// OCI runtime of `container` sandboxes created without one: runc, runsc or crun.
    #[arg(long, default_value = "runc", value_parser = ["runc", "runsc", "crun"])]
    default_runtime: String,
    /// etcd client URLs, comma-separated (`http://HOST:PORT,...`): register this node in
    /// the cluster under a lease, keep its usage current, and refuse every node API call
    /// (503 `unavailable`) while the lease is not known to be alive (fencing). Needs
    /// --advertise (but for --simulate).
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// URL at which servers reach this node's API (`http://HOST:PORT`), published in its
    /// etcd record. With --simulate: `http://HOST` only, each identity's URL is
    /// `http://HOST:ITS_PORT` [default: the --listen-base IP].
    #[arg(long)]
    advertise: Option<String>,
    /// Serve the node API over TLS with this certificate chain (PEM: the node's certificate
    /// first). Servers then reach it at `https://…` and trust it through their
    /// `--node-ca`; `scripts/node-tls.sh` makes a CA and node certificates.
    #[arg(long, requires = "tls_key", conflicts_with = "simulate")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM, PKCS#8: `BEGIN PRIVATE KEY`).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// SIMULATION, not a sandbox backend (issue 22): run N simulated node identities in
    /// this process, each with its own etcd lease and record (`simulated: true`) and its
    /// own node API listener; their sandboxes are in-memory records and exec runs nothing
    /// (exit 0, stdout names the simulated node). Needs --etcd; --data-dir and --listen
    /// are not used.
    #[arg(long, requires = "etcd", value_parser = clap::value_parser!(u32).range(1..=10000))]
    simulate: Option<u32>,
    /// With --simulate: identity i listens on this address with port PORT + i (port 0:
    /// each on a free port).
    #[arg(long, default_value = "127.0.0.1:0", requires = "simulate")]
    listen_base: SocketAddr,
    /// With --simulate: how long a create takes, milliseconds.
    #[arg(long, default_value_t = 0, requires = "simulate")]
    sim_create_delay_ms: u64,
    /// With --simulate: how long an exec takes, milliseconds.
    #[arg(long, default_value_t = 0, requires = "simulate")]
    sim_exec_delay_ms: u64,
    /// With --simulate: published cpu capacity of each identity, cores [default:
    /// --max-sandboxes × 4].
    #[arg(long, requires = "simulate")]
    sim_cpu: Option<f64>,
    /// With --simulate: published memory of each identity, MiB [default: --max-sandboxes ×
    /// 8192].
    #[arg(long, requires = "simulate")]
    sim_memory_mib: Option<u64>,
    /// TTL of the node's etcd lease in seconds (2..=3600): a node that cannot renew it
    /// fences itself after TTL - max(TTL/3, 1 s) at most; servers see it down after TTL.
    #[arg(long, default_value_t = 5)]
    lease_ttl_s: u64,
    /// Sandboxes this node offers at most (its published capacity; servers place no more), ≥ 1.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    max_sandboxes: u64,
    /// Published cpu capacity = host cores × this (> 0). A sandbox's `cpu` is a ceiling (a
    /// CFS quota), not a reservation, so a node takes more of them than it has cores, as
    /// `sandlot up` does; 1 places only what the cores can run at full speed at once.
    #[arg(long, default_value_t = 8.0)]
    cpu_overcommit: f64,
    #[command(flatten)]
    pools: PoolOpts,
}

#[derive(Args)]
struct ServerArgs {
    /// Address to listen on (HOST:PORT; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Data directory of the server's own state (sandlot.db, trajectory log, events). Without
    /// --postgres one server per directory: one already running on it (`DATA/server.lock`
    /// held) is waited for 10 s, then this start fails.
    #[arg(long, env = "SANDLOT_DATA_DIR")]
    data_dir: PathBuf,
    /// URL of the node (`sandlot node`'s `http://HOST:PORT`); one node, no etcd.
    #[arg(long, required_unless_present = "etcd", conflicts_with = "etcd")]
    node: Option<String>,
    /// etcd client URLs, comma-separated (`http://HOST:PORT,...`): serve every node
    /// registered there (cluster mode: placement over the nodes, lost-node sweep).
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// File holding the node API token (the nodes' `--token-file`).
    #[arg(long)]
    node_token_file: PathBuf,
    /// PEM file of the CA certificate(s) that signed the nodes' TLS certificates (nodes
    /// started with --tls-cert, reached at `https://…`), trusted beside the system's roots.
    #[arg(long)]
    node_ca: Option<PathBuf>,
    /// Name of this server: its id is NAME-RANDOM [default: HOST-PID-RANDOM], owner of the
    /// creates and deletes it runs and its value in the leader election (the random part
    /// keeps two servers started with one name apart).
    #[arg(long)]
    name: Option<String>,
    /// With --etcd and --postgres: TTL in seconds (2..=3600) of the leader election's lease.
    /// Several servers share the database; the elected one runs the TTL reaper, sweeps and
    /// GC, and another takes over within this TTL when it dies.
    #[arg(long, default_value_t = 5)]
    election_ttl_s: u64,
    /// With --postgres: seconds (2..=3600) a create or delete holds its record's transition
    /// without a heartbeat (renewed every third of it while the node call runs). When this
    /// server dies mid-call, the elected server rolls its `creating` records back (or
    /// finishes its `deleting` ones) once this has passed; a retry with the same
    /// Idempotency-Key through another server waits that long at most.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(2..=3600))]
    transition_ttl_s: u64,
    /// The node's image store, when this host can read it (run_code then answers a missing
    /// toolchain image itself, and /metrics counts images); without it the node's create
    /// reports a missing image.
    #[arg(long, env = "SANDLOT_IMAGES_DIR")]
    images_dir: Option<PathBuf>,
    /// Log format on stderr (level via RUST_LOG, default info).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    server: ServerOpts,
}

#[derive(Args)]
struct UpArgs {
    /// Address to listen on (HOST:PORT; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Data directory (sandbox state, sandlot.db, images). One process per directory: a
    /// `sandlot up`, `node` or `server` already running on it is waited for 10 s, then this
    /// start fails.
    #[arg(long, env = "SANDLOT_DATA_DIR", default_value = "/var/lib/sandlot")]
    data_dir: PathBuf,
    /// Image store directory [default: DATA/images].
    #[arg(long, env = "SANDLOT_IMAGES_DIR")]
    images_dir: Option<PathBuf>,
    /// Size cap of the lazy-image chunk cache on this node's disk (`IMAGES/chunks`), MiB:
    /// over it the least recently used chunks not being read are evicted (they are
    /// fetched again when read). 0: no cap [default: 0].
    #[arg(long, env = "SANDLOT_IMAGE_CACHE_MIB")]
    image_cache_mib: Option<u64>,
    /// Node name shown in sandboxes and /healthz [default: host name].
    #[arg(long)]
    node_name: Option<String>,
    /// Log format on stderr (level via RUST_LOG, default info).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    pools: PoolOpts,
    #[command(flatten)]
    server: ServerOpts,
}

/// Warm-pool flags of a node (`sandlot up`, `sandlot node`).
#[derive(Args)]
struct PoolOpts {
    /// Ready `function` jails kept per warm-pool image, so a create only hands one over
    /// (0 = no warm pool). Pooled jails are real processes and count toward the host.
    #[arg(long, default_value_t = 4)]
    warm_pool: usize,
    /// Images the warm pools keep jails and containers of (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "python")]
    warm_pool_images: Vec<String>,
    /// `run_code` toolchain images the function warm pool also keeps `--warm-pool` jails of
    /// (comma-separated; an image not in the image store is logged and skipped; empty
    /// string = none), so a `run_code` call on them hands a ready jail over.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lang-python,lang-cpp,lang-java"
    )]
    run_code_pool_images: Vec<String>,
    /// Ready runc `container` sandboxes kept per warm-pool image, so a create (runtime
    /// runc, network none, disk_mib 1024, not a fork) hands one over instead of running
    /// `runc run` (0 = no container pool). Pooled containers are real processes.
    #[arg(long, default_value_t = 2)]
    container_warm_pool: usize,
    /// Members each warm pool (function jails, runc containers) builds at once while it
    /// refills (at least 1; never more than the pool keeps). Builds wait mostly on the
    /// kernel (mounts, cgroups), so a few at once keep the pool up with concurrent creates.
    #[arg(long, env = "SANDLOT_WARM_POOL_BUILDS", default_value_t = 2)]
    warm_pool_builds: usize,
}

/// API server flags (`sandlot up`, `sandlot server`).
#[derive(Args)]
struct ServerOpts {
    /// Largest file upload in MiB.
    #[arg(long, default_value_t = 256)]
    max_file_mib: usize,
    /// Hours a trajectory log is kept after its last activity once its sandbox is gone.
    #[arg(long, default_value_t = 168)]
    trajectory_retention_h: u64,
    /// fsync the trajectory log on every step (survives power loss, not only a crash of
    /// this process; one fsync per logged step).
    #[arg(long)]
    trajectory_fsync: bool,
    /// PostgreSQL URL (postgres://USER@HOST:PORT/DB) of the sandbox registry, API keys and
    /// trajectory log instead of DATA/sandlot.db and DATA/trajectories.db; migrated at
    /// start. With `sandlot server --etcd` any number of servers share it (leader
    /// election); otherwise one server per database (a second one is refused).
    #[arg(long, env = "SANDLOT_POSTGRES_URL")]
    postgres: Option<String>,
    /// OCI runtime of `container` sandboxes created without one: runc, runsc or crun.
    #[arg(long, default_value = "runc", value_parser = ["runc", "runsc", "crun"])]
    default_runtime: String,
    /// Open API connections at most; at the limit the oldest idle connection is closed to
    /// make room (none idle: the new one is closed). Held at or below half the file
    /// descriptor limit (the soft limit is raised to the hard one at start).
    #[arg(long, default_value_t = 16384)]
    max_connections: usize,
    /// Open API connections per client IP address at most (at the limit that address's
    /// oldest idle connection makes room).
    #[arg(long, default_value_t = 1024)]
    max_connections_per_ip: usize,
    /// Seconds a connection has to send a complete request head (from its opening or from
    /// the first byte of its next request).
    #[arg(long, default_value_t = 10)]
    header_read_timeout_s: u64,
    /// Seconds a keep-alive connection with no request in flight may stay quiet.
    #[arg(long, default_value_t = 60)]
    idle_timeout_s: u64,
    /// Seconds an answer may wait for its client to accept its next bytes before the
    /// connection is closed (a client that never reads cannot hold a request slot).
    #[arg(long, default_value_t = 120)]
    write_stall_timeout_s: u64,
    /// Requests in flight server-wide at most; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = 4096)]
    max_requests_in_flight: usize,
    /// Requests in flight from one client IP address at most; more are answered 503 with
    /// Retry-After [default: a quarter of --max-requests-in-flight].
    #[arg(long)]
    max_requests_in_flight_per_ip: Option<usize>,
    /// Seconds a request body may send nothing; a slower body is answered 408
    /// deadline_exceeded and its connection closed. Also the grace period of
    /// --body-min-bytes-per-s.
    #[arg(long, default_value_t = 10)]
    body_read_timeout_s: u64,
    /// Bytes per second a request body must average once it has been waited on for
    /// --body-read-timeout-s (only time spent waiting for the client counts); below it
    /// 408 deadline_exceeded. 0 = no rate floor.
    #[arg(long, default_value_t = 1024)]
    body_min_bytes_per_s: u64,
    /// Seconds an app reached through ingress (`/v1/sandboxes/{id}/ports/{port}/…`) may
    /// leave its connection quiet before its response head: counted from the last byte of
    /// the request it took; past it 504 deadline_exceeded and the connection is closed.
    #[arg(long, default_value_t = 60)]
    ingress_response_timeout_s: u64,
    /// Seconds an ingress connection past its response head (a streamed body, an upgraded
    /// WebSocket) may move no byte either way before it is closed.
    #[arg(long, default_value_t = 600)]
    ingress_idle_timeout_s: u64,
    /// MiB of free space kept on the data directory's file system: below it creates,
    /// run_code, checkpoints and uploads answer 429 resource_exhausted (reads, execs and
    /// deletes still work); with `sandlot up` background processes' output files stop
    /// growing too (those bytes read as skipped; `sandlot node` keeps 256 MiB). 0 = no
    /// check.
    #[arg(long, default_value_t = 256)]
    disk_reserve_mib: u64,
    /// MiB of exec output that foreground execs may hold in server memory at once; each
    /// reserves 8 × its max_output_bytes (default 1 MiB) and waits up to 2 s for it, else
    /// 429 resource_exhausted with Retry-After.
    #[arg(long, default_value_t = 1024)]
    exec_output_budget_mib: u64,
    /// CPU limit of each `run_code` sandbox, in cores (0.01–64; default: the host's
    /// cores, as SandboxFusion runs code without a CPU cap). A caller whose API key has a
    /// max_cpu quota gets at most 1 core per call.
    #[arg(long, value_parser = parse_run_code_cpu)]
    run_code_cpu: Option<f64>,
    /// Image of E2B's `base` template on the E2B-compatible API (docs/e2b.md); any other
    /// E2B template id names a Sandlot image directly.
    #[arg(long, default_value = "python")]
    e2b_base_image: String,
    /// Backend of sandboxes created through the E2B-compatible API: function, container,
    /// microvm or vm.
    #[arg(long, default_value = "function")]
    e2b_backend: sandlot_api::Backend,
}

#[derive(Args, Clone)]
struct SandboxOpts {
    /// Isolation level: function, container, microvm, vm.
    #[arg(long, default_value = "function")]
    backend: Backend,
    /// Image: a short name (see `sandlot image ls`) or a reference such as
    /// `127.0.0.1:5000/sandlot/python:latest` (pulled by the node on first use when allowed).
    #[arg(long, default_value = "python")]
    image: String,
    /// CPU quota in cores (0.01–64) [server default: 1].
    #[arg(long)]
    cpu: Option<f64>,
    /// Memory limit in MiB (16–65536) [server default: 512].
    #[arg(long)]
    memory_mib: Option<u64>,
    /// Environment for every exec, KEY=VALUE (repeatable).
    #[arg(long = "env", value_parser = parse_kv)]
    env: Vec<(String, String)>,
    /// OCI runtime of a container sandbox: runc, crun, runsc [server default: runc].
    #[arg(long)]
    runtime: Option<String>,
}

impl SandboxOpts {
    fn request(&self) -> CreateSandboxRequest {
        CreateSandboxRequest {
            backend: self.backend,
            image: Some(self.image.clone()),
            cpu: self.cpu,
            memory_mib: self.memory_mib,
            env: self.env.iter().cloned().collect(),
            runtime: self.runtime.clone(),
            ..Default::default()
        }
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    remote: Remote,
    #[command(flatten)]
    sandbox: SandboxOpts,
    /// Command timeout in seconds (0 < S ≤ 86400) [server default: 60].
    #[arg(long)]
    timeout: Option<f64>,
    /// Command and arguments (argv; use `sh -c '...'` for shell syntax).
    #[arg(last = true, required = true)]
    cmd: Vec<String>,
}

#[derive(Args)]
struct ExecArgs {
    #[command(flatten)]
    remote: Remote,
    /// Sandbox id (sb-…).
    id: String,
    /// Command timeout in seconds (0 < S ≤ 86400) [server default: 60].
    #[arg(long)]
    timeout: Option<f64>,
    /// Print output as it comes (NDJSON stream from the server).
    #[arg(long)]
    stream: bool,
    /// Working directory inside the sandbox [default: /workspace].
    #[arg(long)]
    cwd: Option<String>,
    /// Command and arguments (argv).
    #[arg(last = true, required = true)]
    cmd: Vec<String>,
}

#[derive(Args)]
struct ShellArgs {
    #[command(flatten)]
    remote: Remote,
    /// Sandbox id (sb-…).
    id: String,
    /// Command and arguments [default: `bash -l` where the image has bash, else `sh -l`].
    #[arg(last = true)]
    cmd: Vec<String>,
}

#[derive(Args)]
struct CreateArgs {
    #[command(flatten)]
    remote: Remote,
    #[command(flatten)]
    sandbox: SandboxOpts,
    /// TTL in seconds (0 = none, max 604800) [server default: 600].
    #[arg(long)]
    ttl: Option<u64>,
    /// Label k=v (repeatable).
    #[arg(long = "label", value_parser = parse_kv)]
    labels: Vec<(String, String)>,
    /// Fork this checkpoint (`ck-…`): backend, image and runtime are the checkpoint's.
    #[arg(long)]
    checkpoint: Option<String>,
}

#[derive(Args)]
struct CheckpointArgs {
    #[command(flatten)]
    remote: Remote,
    /// Sandbox id.
    id: String,
}

#[derive(Args)]
struct CheckpointsArgs {
    #[command(flatten)]
    remote: Remote,
    /// Print the JSON list instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct LsArgs {
    #[command(flatten)]
    remote: Remote,
    /// Only sandboxes with label k=v (repeatable; all must match).
    #[arg(long = "label", value_parser = parse_kv)]
    labels: Vec<(String, String)>,
    /// Print the JSON list instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct SelectArgs {
    #[command(flatten)]
    remote: Remote,
    /// Label k=v (repeatable, at least one; all must match).
    #[arg(long = "label", value_parser = parse_kv, required = true)]
    labels: Vec<(String, String)>,
}

#[derive(Args)]
struct TrajectoryArgs {
    #[command(flatten)]
    remote: Remote,
    /// Trajectory id, e.g. `job-42/ep-7`.
    id: String,
}

#[derive(Args)]
struct RmArgs {
    #[command(flatten)]
    remote: Remote,
    /// Ids (sandbox ids for `rm`, checkpoint ids for `rm-checkpoint`).
    #[arg(required = true)]
    ids: Vec<String>,
}

#[derive(Args, Clone)]
struct ImageDirs {
    /// Data directory.
    #[arg(long, env = "SANDLOT_DATA_DIR", default_value = "/var/lib/sandlot")]
    data_dir: PathBuf,
    /// Image store directory [default: DATA/images].
    #[arg(long, env = "SANDLOT_IMAGES_DIR")]
    images_dir: Option<PathBuf>,
}

impl ImageDirs {
    fn open(&self) -> anyhow::Result<sandlot_node::images::ImageStore> {
        let dir = self
            .images_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join("images"));
        sandlot_node::images::ImageStore::open(dir.clone())
            .with_context(|| format!("open image store {}", dir.display()))
    }
}

#[derive(Args, Clone)]
struct DataDir {
    /// Data directory of the server (its store is DATA/sandlot.db).
    #[arg(long, env = "SANDLOT_DATA_DIR", default_value = "/var/lib/sandlot")]
    data_dir: PathBuf,
    /// PostgreSQL URL of the server's store instead of DATA/sandlot.db (the server's
    /// `--postgres`).
    #[arg(long, env = "SANDLOT_POSTGRES_URL")]
    postgres: Option<String>,
}

#[derive(Subcommand)]
enum KeyCmd {
    /// Create an API key; prints the key (`sk-…`, shown only this once) on stdout and its
    /// id (the tenant id of its sandboxes) on stderr. Limits default to unlimited.
    Create {
        #[command(flatten)]
        dirs: DataDir,
        /// Name to recognise the key by (1–128 characters), e.g. the team or job.
        #[arg(long)]
        name: String,
        /// Admin scope: /metrics, the status page /, and every tenant's sandboxes, trajectories
        /// and events.
        #[arg(long)]
        admin: bool,
        /// Most sandboxes the key may have at once (any state).
        #[arg(long)]
        max_sandboxes: Option<u64>,
        /// Most CPU cores summed over its sandboxes.
        #[arg(long)]
        max_cpu: Option<f64>,
        /// Most memory in MiB summed over its sandboxes.
        #[arg(long)]
        max_memory_mib: Option<u64>,
    },
    /// List keys (ids, names, scope, limits, creation and revocation times; never the keys).
    Ls {
        #[command(flatten)]
        dirs: DataDir,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id (`key_…`): it authenticates nothing from now on. Its sandboxes keep
    /// running until deleted by an admin key or their TTL.
    Revoke {
        #[command(flatten)]
        dirs: DataDir,
        /// Key id.
        id: String,
    },
}

/// The server's store: PostgreSQL with `--postgres`, else DATA/sandlot.db.
async fn open_store(d: &DataDir) -> anyhow::Result<Box<dyn sandlot_server::registry::Registry>> {
    if let Some(url) = &d.postgres {
        let pool = sandlot_server::pg::connect(url, 2).await?;
        return Ok(Box::new(sandlot_server::registry::PgRegistry::new(pool)));
    }
    std::fs::create_dir_all(&d.data_dir)
        .with_context(|| format!("create data dir {}", d.data_dir.display()))?;
    Ok(Box::new(sandlot_server::store::Store::open(
        &d.data_dir.join("sandlot.db"),
    )?))
}

async fn key(cmd: KeyCmd) -> anyhow::Result<u8> {
    match cmd {
        KeyCmd::Create {
            dirs,
            name,
            admin,
            max_sandboxes,
            max_cpu,
            max_memory_mib,
        } => {
            if name.is_empty() || name.chars().count() > 128 {
                anyhow::bail!("--name must be 1–128 characters");
            }
            if max_cpu.is_some_and(|c| !(c.is_finite() && c >= 0.0)) {
                anyhow::bail!("--max-cpu must be a finite number ≥ 0");
            }
            let quota = sandlot_server::store::Quota {
                max_sandboxes,
                max_cpu,
                max_memory_mib,
            };
            let store = open_store(&dirs).await?;
            let (row, key) = sandlot_server::auth::create_key(&*store, &name, admin, quota).await?;
            println!("{key}");
            eprintln!(
                "created API key {} ({name}{}); the key above is shown only once",
                row.id,
                if admin { ", admin" } else { "" }
            );
            Ok(0)
        }
        KeyCmd::Ls { dirs, json } => {
            let keys = open_store(&dirs).await?.list_keys().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&keys)?);
                return Ok(0);
            }
            let lim = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            println!(
                "{:<20} {:<16} {:<5} {:>9} {:>7} {:>10} {:<24} REVOKED",
                "ID", "NAME", "ADMIN", "SANDBOXES", "CPU", "MEMORY_MIB", "CREATED"
            );
            for k in keys {
                let t = |ms: i64| {
                    chrono::DateTime::from_timestamp_millis(ms)
                        .unwrap_or_default()
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                };
                println!(
                    "{:<20} {:<16} {:<5} {:>9} {:>7} {:>10} {:<24} {}",
                    k.id,
                    k.name,
                    k.admin,
                    lim(k.quota.max_sandboxes.map(|v| v.to_string())),
                    lim(k.quota.max_cpu.map(|v| v.to_string())),
                    lim(k.quota.max_memory_mib.map(|v| v.to_string())),
                    t(k.created_at_ms),
                    k.revoked_at_ms.map(t).unwrap_or_else(|| "-".into()),
                );
            }
            Ok(0)
        }
        KeyCmd::Revoke { dirs, id } => {
            let store = open_store(&dirs).await?;
            let now = chrono::Utc::now().timestamp_millis();
            if store.revoke_key(&id, now).await? {
                eprintln!("revoked API key {id}");
                Ok(0)
            } else if store.list_keys().await?.iter().any(|k| k.id == id) {
                eprintln!("API key {id} was already revoked");
                Ok(0)
            } else {
                let at = dirs
                    .postgres
                    .is_some()
                    .then(|| "the PostgreSQL store".to_owned());
                let at = at.unwrap_or_else(|| dirs.data_dir.display().to_string());
                anyhow::bail!("no API key {id:?} in {at}")
            }
        }
    }
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Build built-in images: `busybox`, `python`, a toolchain image `lang-<x>` (`lang-go`,
    /// `lang-java`, …: `sandlot image toolchains` lists them; each a layer over `python`'s,
    /// reused while its recipe is unchanged) or `lang-all` for every toolchain image.
    Build {
        /// Which images, built in the order given.
        #[arg(required = true)]
        names: Vec<String>,
        #[command(flatten)]
        dirs: ImageDirs,
        /// Cache of debootstrap trees (kept between builds).
        #[arg(long, default_value = "/var/cache/sandlot")]
        cache_dir: PathBuf,
        /// Rebuild even when the image exists.
        #[arg(long)]
        force: bool,
    },
    /// Pull an image from a registry (OCI distribution API; plain HTTP only for loopback
    /// registries such as 127.0.0.1:5000). A multi-platform index resolves to linux/amd64.
    ///
    /// By default the lazy form (`REPO:TAG-lazy`, made by `image convert`) is pulled when
    /// the registry has it: only file metadata is fetched now, file data chunk by chunk when
    /// sandboxes read it; otherwise the image is pulled and unpacked whole.
    Pull {
        /// Reference, e.g. `127.0.0.1:5000/sandlot/python:latest` (tag `latest` by default).
        reference: String,
        /// Store it under this name (short name or reference) [default: the reference].
        #[arg(long)]
        name: Option<String>,
        /// Pull the lazy form only (fail when the registry has none).
        #[arg(long, conflicts_with = "eager")]
        lazy: bool,
        /// Pull and unpack the whole image, even when a lazy form exists.
        #[arg(long)]
        eager: bool,
        #[command(flatten)]
        dirs: ImageDirs,
    },
    /// Convert an image of the store (pulled or imported) into the lazy format (file tree
    /// index + 1 MiB content-addressed chunks per layer; docs/images.md) and push it to its
    /// registry as `REPO:TAG-lazy`.
    Convert {
        /// Reference of the image, e.g. `127.0.0.1:5000/sandlot/big:latest`.
        reference: String,
        #[command(flatten)]
        dirs: ImageDirs,
    },
    /// Import an OCI image layout directory, an OCI archive (tar of a layout) or a
    /// `docker save` archive.
    Import {
        /// Directory or tar file.
        path: PathBuf,
        /// Store it under this name [default: the archive's full reference annotation or
        /// RepoTags entry].
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        dirs: ImageDirs,
    },
    /// List images: NAME SIZE LAYERS CREATED SOURCE.
    Ls {
        #[command(flatten)]
        dirs: ImageDirs,
        /// Also print each image's layers (store-relative path and size, top first).
        #[arg(long)]
        layers: bool,
    },
    /// List the toolchain images `image build lang-<x>` can build: NAME APT PIP NPM LOWER.
    Toolchains,
    /// Remove an image name (its blobs and layers stay until `gc`; a built-in image whose
    /// rootfs running sandboxes use is kept in `retired/` until `gc` finds it unused).
    Rm {
        /// Image name or reference.
        name: String,
        #[command(flatten)]
        dirs: ImageDirs,
    },
    /// Remove blobs and unpacked layers no image references (layers a running sandbox has
    /// mounted are kept).
    Gc {
        #[command(flatten)]
        dirs: ImageDirs,
    },
}

/// Progress of a pull/import: bars on a terminal, one line per step otherwise.
struct CliProgress {
    multi: Option<indicatif::MultiProgress>,
    bars: std::sync::Mutex<BTreeMap<String, indicatif::ProgressBar>>,
}

impl CliProgress {
    fn new() -> CliProgress {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        CliProgress {
            multi: tty.then(indicatif::MultiProgress::new),
            bars: Default::default(),
        }
    }
}

impl sandlot_node::images::oci::Progress for CliProgress {
    fn start(&self, id: &str, what: &str, total: Option<u64>) {
        let Some(m) = &self.multi else {
            match total {
                Some(t) => eprintln!("{id}: {what} ({t} bytes)"),
                None => eprintln!("{id}: {what}"),
            }
            return;
        };
        let bar = match total {
            Some(t) => m.add(indicatif::ProgressBar::new(t)).with_style(
                indicatif::ProgressStyle::with_template(
                    "{prefix} {msg:10} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            ),
            None => {
                let b = m.add(indicatif::ProgressBar::new_spinner()).with_style(
                    indicatif::ProgressStyle::with_template("{prefix} {spinner} {msg}")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                );
                b.enable_steady_tick(std::time::Duration::from_millis(120));
                b
            }
        };
        bar.set_prefix(id.to_string());
        bar.set_message(what.to_string());
        self.bars
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), bar);
    }

    fn advance(&self, id: &str, bytes: u64) {
        if let Some(b) = self.bars.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
            b.inc(bytes);
        }
    }

    fn finish(&self, id: &str, note: &str) {
        let bar = self
            .bars
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        match bar {
            Some(b) => b.finish_with_message(note.to_string()),
            None if self.multi.is_some() => {
                if let Some(m) = &self.multi {
                    let _ = m.println(format!("{id} {note}"));
                }
            }
            None => eprintln!("{id}: {note}"),
        }
    }
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

fn main() -> ExitCode {
    // The lazy-image FUSE daemon the node starts (`sandlot __lazy-mount ...`, one per lazy
    // layer; see sandlot_node::images::lazy::serve_main): not a user command.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv
        .get(1)
        .is_some_and(|a| a == sandlot_node::images::lazy::DAEMON_ARG)
    {
        init_logs(LogFormat::Text);
        return match sandlot_node::images::lazy::serve_main(&argv[2..]) {
            Ok(()) => ExitCode::from(0),
            Err(e) => {
                eprintln!("error: lazy mount: {e}");
                ExitCode::from(1)
            }
        };
    }
    let cli = Cli::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(dispatch(cli.cmd)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            match e.downcast_ref::<ClientError>() {
                Some(ClientError::Api(api)) => eprintln!("error: {}: {}", api.code, api.message),
                _ => eprintln!("error: {e:#}"),
            }
            ExitCode::from(1)
        }
    }
}

async fn dispatch(cmd: Command) -> anyhow::Result<u8> {
    match cmd {
        Command::Up(a) => up(a).await,
        Command::Node(a) => node(a).await,
        Command::Server(a) => server(a).await,
        Command::Run(a) => run(a).await,
        Command::Exec(a) => exec(a).await,
        Command::Shell(a) => shell::shell(&a.remote.client()?, &a.id, a.cmd).await,
        Command::Create(a) => create(a).await,
        Command::Ls(a) => ls(a).await,
        Command::Rm(a) => rm(a).await,
        Command::Checkpoint(a) => checkpoint(a).await,
        Command::Checkpoints(a) => checkpoints(a).await,
        Command::RmCheckpoint(a) => rm_checkpoint(a).await,
        Command::Pause(a) => pause_resume(a, true).await,
        Command::Resume(a) => pause_resume(a, false).await,
        Command::Trajectory(a) => trajectory(a).await,
        Command::Image(c) => image(c).await,
        Command::Key(c) => key(c).await,
        Command::Version => {
            println!("sandlot {}", env!("CARGO_PKG_VERSION"));
            Ok(0)
        }
    }
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGTERM; only SIGINT stops the server");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
    }
}

/// `--run-code-cpu`: cores, 0.01–64 (the range of a create's `cpu`).
fn parse_run_code_cpu(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(c) if (0.01..=64.0).contains(&c) => Ok(c),
        _ => Err(format!("{s:?} is not a number of cores in 0.01..=64")),
    }
}

/// The images of `--run-code-pool-images` that are built in `images_dir` (`image.json`
/// present); each one that is not is logged and left out, so the pool never retries it.
fn run_code_pool_images(images_dir: &std::path::Path, wanted: Vec<String>) -> Vec<String> {
    wanted
        .into_iter()
        .map(|i| i.trim().to_owned())
        .filter(|i| !i.is_empty())
        .filter(|i| {
            let built = images_dir.join(i).join("image.json").is_file();
            if !built {
                tracing::warn!(image = %i, "run_code pool image is not built; skipped (sandlot image build {i})");
            }
            built
        })
        .collect()
}

/// Record `--image-cache-mib` in the image store, where the lazy mount daemons read it
/// (absent or 0: no cap).
fn set_image_cache_limit(images_dir: &std::path::Path, mib: Option<u64>) -> anyhow::Result<()> {
    let bytes = mib.filter(|&m| m > 0).map(|m| m.saturating_mul(1 << 20));
    sandlot_node::images::lazy::fetch::set_cache_limit(images_dir, bytes)
        .context("--image-cache-mib")?;
    Ok(())
}

async fn up(a: UpArgs) -> anyhow::Result<u8> {
    init_logs(a.log_format);
    raise_nofile_limit();
    let mut ncfg = sandlot_node::NodeConfig::new(a.data_dir.clone());
    if let Some(d) = a.images_dir {
        ncfg.guest_kit_dir = sandlot_node::local::default_guest_kit_dir(&d);
        ncfg.images_dir = d;
    }
    if let Some(n) = a.node_name {
        ncfg.name = n;
    }
    a.pools.apply(&mut ncfg);
    ncfg.default_runtime =
        sandlot_node::backends::container::Runtime::parse(&a.server.default_runtime)
            .context("--default-runtime")?;
    let images_dir = ncfg.images_dir.clone();
    let spill = ncfg.data_dir.join("process-output");
    // First: the data directory's lock (another process on it: wait, then fail).
    let local = Arc::new(sandlot_node::LocalNode::open(ncfg).context("open local node")?);
    set_image_cache_limit(&images_dir, a.image_cache_mib)?;
    // Background processes live on the node (output spilled under DATA/process-output).
    let limits = sandlot_node::processes::ProcessLimits {
        spill_reserve_bytes: a.server.disk_reserve_mib << 20,
        ..Default::default()
    };
    let node = sandlot_node::WithProcesses::with_limits(local.clone(), limits, spill)?;
    let mut cfg = a.server.config(a.data_dir, a.listen)?;
    cfg.images_dir = Some(images_dir);
    let served = serve_api(cfg, node).await;
    stop_warm_pools(local).await;
    served
}

/// The node API on `listener`, over TLS when `tls` is set (`sandlot node --tls-cert`).
async fn serve_node(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    tls: Option<sandlot_node_remote::TlsAcceptor>,
) -> std::io::Result<()> {
    match tls {
        Some(tls) => sandlot_node_remote::serve_tls(listener, app, tls).await,
        None => sandlot_node_remote::serve(listener, app).await,
    }
}

/// On a stop for good: the warm pools' ready members go (they are not sandboxes; see
/// [`sandlot_node::LocalNode::stop_warm_pools`]).
async fn stop_warm_pools(local: Arc<sandlot_node::LocalNode>) {
    match tokio::task::spawn_blocking(move || local.stop_warm_pools()).await {
        Ok(()) => tracing::info!("warm pools stopped, their ready members removed"),
        Err(e) => tracing::warn!(error = %e, "stopping the warm pools failed"),
    }
}

async fn server(a: ServerArgs) -> anyhow::Result<u8> {
    init_logs(a.log_format);
    raise_nofile_limit();
    let token = read_token(&a.node_token_file)?;
    let mut opts = sandlot_node_remote::RemoteOptions::default();
    if let Some(ca) = &a.node_ca {
        opts.tls_ca_pem =
            Some(std::fs::read(ca).with_context(|| format!("read --node-ca {}", ca.display()))?);
    }
    let mut cfg = a.server.config(a.data_dir, a.listen)?;
    cfg.images_dir = a.images_dir;
    cfg.transition_ttl = std::time::Duration::from_secs(a.transition_ttl_s);
    if let Some(n) = a.name {
        anyhow::ensure!(
            !n.is_empty() && n.len() <= 128,
            "--name: 1 to 128 characters"
        );
        cfg.server_id = sandlot_server::leader::unique_server_id(&n);
    }
    let Some(url) = a.node else {
        let etcd = sandlot_cluster::connect(&a.etcd)
            .await
            .with_context(|| format!("connect to etcd {}", a.etcd.join(",")))?;
        if cfg.postgres_url.is_some() {
            // Several servers on one database: the singletons run on the elected one.
            cfg.election = Some(sandlot_server::leader::ElectionConfig {
                client: etcd.clone(),
                lease: sandlot_cluster::LeaseConfig::new(a.election_ttl_s)
                    .context("--election-ttl-s")?,
            });
            tracing::info!(server_id = %cfg.server_id, "several servers may share this database: leader election in etcd");
        }
        let cluster = sandlot_server::cluster::ClusterNode::start(&etcd, Some(token), opts)
            .await
            .context("cluster mode: read the node set from etcd (and --node-ca)")?;
        let names: Vec<String> = cluster.nodes().keys().cloned().collect();
        tracing::info!(etcd = %a.etcd.join(","), nodes = ?names, "cluster mode: following the nodes registered in etcd");
        let server = sandlot_server::Server::bind_cluster(cfg, cluster).await?;
        return run_bound(server).await;
    };
    let node = sandlot_node_remote::RemoteNode::connect_with(&url, Some(token), opts)
        .await
        .with_context(|| format!("connect to node {url}"))?;
    let name = sandlot_node_api::Node::info(&node).name;
    tracing::info!(node = %url, %name, "node connected");
    serve_api(cfg, Arc::new(node)).await
}

fn raise_nofile_limit() {
    match sandlot_server::conn::raise_nofile_limit() {
        Ok(n) => tracing::info!(nofile = n, "file descriptor limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the file descriptor limit"),
    }
}

/// Serves the API until SIGTERM/SIGINT (`sandlot up`, `sandlot server`).
async fn serve_api(
    cfg: sandlot_server::ServerConfig,
    node: Arc<dyn sandlot_node_api::Node>,
) -> anyhow::Result<u8> {
    let server = sandlot_server::Server::bind(cfg, node).await?;
    run_bound(server).await
}

/// Prints the listening line and serves until SIGTERM/SIGINT.
async fn run_bound(server: sandlot_server::Server) -> anyhow::Result<u8> {
    let addr = server.local_addr()?;
    println!("sandlot listening on http://{addr}");
    std::io::stdout().flush().ok();
    server.run(shutdown_signal()).await?;
    tracing::info!("stopped; sandboxes left running for re-adoption");
    Ok(0)
}

/// The node API token in `path` (surrounding whitespace removed; empty is an error).
fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("read token file {}", path.display()))?
        .trim()
        .to_owned();
    anyhow::ensure!(!token.is_empty(), "token file {} is empty", path.display());
    Ok(token)
}

impl PoolOpts {
    fn apply(self, ncfg: &mut sandlot_node::NodeConfig) {
        ncfg.warm_pool = self.warm_pool;
        ncfg.warm_pool_images = self.warm_pool_images;
        ncfg.function_pool_images =
            run_code_pool_images(&ncfg.images_dir, self.run_code_pool_images);
        ncfg.container_warm_pool = self.container_warm_pool;
        ncfg.warm_pool_builds = self.warm_pool_builds;
    }
}

impl ServerOpts {
    /// The server configuration these flags give, for state in `data_dir`.
    fn config(
        self,
        data_dir: PathBuf,
        listen: SocketAddr,
    ) -> anyhow::Result<sandlot_server::ServerConfig> {
        let mut cfg = sandlot_server::ServerConfig::new(data_dir);
        cfg.listen = listen;
        cfg.default_runtime = self.default_runtime;
        cfg.max_file_bytes = self.max_file_mib << 20;
        cfg.trajectory_retention =
            std::time::Duration::from_secs(self.trajectory_retention_h * 3600);
        cfg.trajectory_fsync = self.trajectory_fsync;
        cfg.postgres_url = self.postgres;
        cfg.conn = sandlot_server::conn::ConnLimits {
            max_connections: self.max_connections.max(1),
            max_connections_per_ip: self.max_connections_per_ip.max(1),
            header_read_timeout: std::time::Duration::from_secs(self.header_read_timeout_s.max(1)),
            idle_timeout: std::time::Duration::from_secs(self.idle_timeout_s.max(1)),
            write_stall_timeout: std::time::Duration::from_secs(self.write_stall_timeout_s.max(1)),
            max_requests_in_flight: self.max_requests_in_flight.max(1),
            max_requests_in_flight_per_ip: self.max_requests_in_flight_per_ip.map(|n| n.max(1)),
            body_read_timeout: std::time::Duration::from_secs(self.body_read_timeout_s.max(1)),
            body_min_rate: self.body_min_bytes_per_s,
        };
        cfg.ingress = sandlot_server::ingress::IngressLimits {
            response_timeout: std::time::Duration::from_secs(
                self.ingress_response_timeout_s.max(1),
            ),
            idle_timeout: std::time::Duration::from_secs(self.ingress_idle_timeout_s.max(1)),
        };
        cfg.disk_reserve_bytes = self.disk_reserve_mib << 20;
        cfg.exec_output_budget_bytes = self.exec_output_budget_mib.max(1) << 20;
        if let Some(cpu) = self.run_code_cpu {
            cfg.run_code_cpu = cpu;
        }
        sandlot_node::validate_image_ref(&self.e2b_base_image)
            .map_err(|e| anyhow::anyhow!("--e2b-base-image: {e}"))?;
        cfg.e2b = sandlot_server::e2b::E2bConfig {
            base_image: self.e2b_base_image,
            backend: self.e2b_backend,
        };
        Ok(cfg)
    }
}

async fn node(a: NodeArgs) -> anyhow::Result<u8> {
    if let Some(n) = a.simulate {
        return node_simulate(a, n).await;
    }
    if !a.etcd.is_empty() && a.advertise.is_none() {
        use clap::CommandFactory;
        Cli::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "--etcd needs --advertise <ADVERTISE> (the URL servers reach this node at)",
            )
            .exit();
    }
    let (Some(listen), Some(data_dir)) = (a.listen, a.data_dir.clone()) else {
        anyhow::bail!("--listen and --data-dir are required without --simulate");
    };
    init_logs(a.log_format);
    raise_nofile_limit();
    let token = read_token(&a.token_file)?;
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => {
            let read =
                |p: &PathBuf| std::fs::read(p).with_context(|| format!("read {}", p.display()));
            Some(
                sandlot_node_remote::tls_acceptor(&read(cert)?, &read(key)?)
                    .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?,
            )
        }
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ncfg = sandlot_node::NodeConfig::new(data_dir);
    if let Some(d) = a.images_dir {
        ncfg.guest_kit_dir = sandlot_node::local::default_guest_kit_dir(&d);
        ncfg.images_dir = d;
    }
    if let Some(n) = a.name {
        ncfg.name = n;
    }
    if let Some(d) = a.snapshot_dir {
        ncfg.snapshot_dir = Some(std::path::absolute(&d).context("--snapshot-dir")?);
    }
    a.pools.apply(&mut ncfg);
    ncfg.default_runtime = sandlot_node::backends::container::Runtime::parse(&a.default_runtime)
        .context("--default-runtime")?;
    let (name, data_dir, images_dir) = (
        ncfg.name.clone(),
        ncfg.data_dir.clone(),
        ncfg.images_dir.clone(),
    );
    // Checked before anything starts: a bad TTL, URL or name fails at once.
    let cluster = if a.etcd.is_empty() {
        None
    } else {
        let advertise = a.advertise.clone().unwrap_or_default();
        anyhow::ensure!(
            advertise.starts_with(&format!("{scheme}://")),
            "--advertise {advertise:?} is not {scheme}://HOST:PORT ({})",
            if tls.is_some() {
                "--tls-cert: the node API is HTTPS"
            } else {
                "without --tls-cert the node API is h2c"
            }
        );
        sandlot_cluster::node_key(&name).context("--name")?;
        anyhow::ensure!(
            a.cpu_overcommit.is_finite() && a.cpu_overcommit > 0.0,
            "--cpu-overcommit must be a finite number > 0, got {}",
            a.cpu_overcommit
        );
        let cfg = sandlot_cluster::LeaseConfig::new(a.lease_ttl_s).context("--lease-ttl-s")?;
        Some((advertise, cfg))
    };
    let spill = ncfg.data_dir.join("process-output");
    // First: the data directory's lock (another process on it: wait, then fail).
    let node = Arc::new(sandlot_node::LocalNode::open(ncfg).context("open local node")?);
    set_image_cache_limit(&images_dir, a.image_cache_mib)?;
    // Keep every live sandbox of a previous process (a restart of this node alone must not
    // lose a server's sandboxes); this also starts the warm pools. A server's readopt at its
    // own start then removes what it has no record of.
    let found = node.sandboxes_on_disk();
    let adopted = sandlot_node_api::Node::readopt(&*node, &found)
        .await
        .context("re-adopt sandboxes")?;
    tracing::info!(
        found = found.len(),
        adopted = adopted.len(),
        "sandboxes of the previous process re-adopted"
    );
    // Background processes live on the node, for every server (output spilled under
    // DATA/process-output).
    let local = node.clone();
    let node = sandlot_node::WithProcesses::new(node, spill)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let Some((advertise, lease)) = cluster else {
        let app = sandlot_node_remote::router(node, Some(token));
        println!("sandlot node listening on {scheme}://{addr}");
        std::io::stdout().flush().ok();
        let served = tokio::select! {
            r = serve_node(listener, app, tls) => r.context("accept"),
            () = shutdown_signal() => Ok(()),
        };
        stop_warm_pools(local).await;
        served?;
        tracing::info!("stopped; sandboxes left running for re-adoption");
        return Ok(0);
    };
    let tracked = Arc::new(
        cluster::Tracked::new(node)
            .with_capacity(cluster::host_capacity(a.max_sandboxes, a.cpu_overcommit)),
    );
    tracked.learn_readopted(&data_dir, &adopted);
    let client = sandlot_cluster::connect(&a.etcd)
        .await
        .with_context(|| format!("connect to etcd {}", a.etcd.join(",")))?;
    let mut record = sandlot_cluster::NodeRecord {
        name: name.clone(),
        advertise_url: advertise,
        capacity: cluster::host_capacity(a.max_sandboxes, a.cpu_overcommit),
        started_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        ..Default::default()
    };
    cluster::refresh_info(&mut record, &sandlot_node_api::Node::info(&*tracked));
    cluster::refresh_images(&mut record, &images_dir);
    let listed = sandlot_node_api::Node::list(&*tracked)
        .await
        .context("list sandboxes")?;
    record.usage = tracked.usage(&listed, tokio::time::Instant::now());
    let reg = sandlot_cluster::NodeRegistration::register(&client, record, lease)
        .await
        .context("register in etcd")?;
    let fence = reg.fence();
    tracing::info!(node = %name, lease_id = fence.lease_id(), epoch = fence.epoch(), ttl_s = a.lease_ttl_s, "registered in etcd; serving");
    let reg = Arc::new(reg);
    let updater = tokio::spawn(cluster::keep_record_current(
        reg.clone(),
        tracked.clone(),
        images_dir,
    ));
    let transitions = tokio::spawn(cluster::log_transitions(name.clone(), fence.clone()));
    let gate = Arc::new(cluster::FenceGate {
        name: name.clone(),
        fence,
        simulated: false,
    });
    let app = sandlot_node_remote::router_gated(tracked, Some(token), Some(gate));
    println!("sandlot node listening on {scheme}://{addr}");
    std::io::stdout().flush().ok();
    let served = tokio::select! {
        r = serve_node(listener, app, tls) => r.context("accept"),
        () = shutdown_signal() => Ok(()),
    };
    // Leave the cluster before exiting: the key goes now, not at the lease's expiry.
    transitions.abort();
    updater.abort();
    let _ = updater.await;
    match Arc::try_unwrap(reg) {
        Ok(reg) => match reg.deregister().await {
            Ok(()) => tracing::info!(node = %name, "deregistered from etcd"),
            Err(e) => {
                tracing::warn!(node = %name, error = %e, "deregistering failed; the record goes when the lease expires")
            }
        },
        Err(_) => {
            tracing::warn!("registration still shared; the record goes when the lease expires")
        }
    }
    stop_warm_pools(local).await;
    served?;
    tracing::info!("stopped; sandboxes left running for re-adoption");
    Ok(0)
}

/// `sandlot node --simulate N`: N simulated node identities ([`sim`]).
async fn node_simulate(a: NodeArgs, n: u32) -> anyhow::Result<u8> {
    init_logs(a.log_format);
    let token = read_token(&a.token_file)?;
    let prefix = a.name.clone().unwrap_or_else(|| "sim".into());
    sandlot_cluster::node_key(&sim::identity_name(&prefix, n.saturating_sub(1)))
        .context("--name")?;
    let advertise_host = match &a.advertise {
        None => None,
        Some(u) => {
            let host = u.strip_prefix("http://").map(|h| h.trim_end_matches('/'));
            match host {
                // A host alone: each identity adds `:PORT` (an IPv6 address in brackets).
                Some(h)
                    if !h.is_empty()
                        && !h.contains('/')
                        && (h.ends_with(']') || !h.contains(':')) =>
                {
                    Some(h.to_owned())
                }
                _ => anyhow::bail!(
                    "--advertise {u:?} is not http://HOST (with --simulate each identity adds its port; the node API is h2c)"
                ),
            }
        }
    };
    let lease = sandlot_cluster::LeaseConfig::new(a.lease_ttl_s).context("--lease-ttl-s")?;
    let cpu = a.sim_cpu.unwrap_or(a.max_sandboxes as f64 * 4.0);
    anyhow::ensure!(
        cpu.is_finite() && cpu > 0.0,
        "--sim-cpu must be a finite number > 0, got {cpu}"
    );
    let plan = sim::Plan {
        count: n,
        prefix,
        etcd: a.etcd,
        listen_base: a.listen_base,
        advertise_host,
        lease,
        token,
        cfg: sim::SimConfig {
            create_delay: std::time::Duration::from_millis(a.sim_create_delay_ms),
            exec_delay: std::time::Duration::from_millis(a.sim_exec_delay_ms),
            max_sandboxes: a.max_sandboxes,
            cpu,
            memory_mib: a
                .sim_memory_mib
                .unwrap_or(a.max_sandboxes.saturating_mul(8192)),
        },
    };
    sim::run(plan, shutdown_signal()).await?;
    tracing::info!(simulated = true, "simulation stopped");
    Ok(0)
}

fn exec_request(cmd: Vec<String>, timeout: Option<f64>, cwd: Option<String>) -> ExecRequest {
    let mut r = ExecRequest::new(Cmd::Argv(cmd));
    r.timeout_s = timeout;
    r.cwd = cwd;
    r
}

fn print_result(r: &ExecResult) -> u8 {
    let mut out = std::io::stdout();
    let _ = out.write_all(&r.stdout_raw());
    let _ = out.flush();
    let _ = std::io::stderr().write_all(&r.stderr_raw());
    report_exit(r)
}

fn report_exit(r: &ExecResult) -> u8 {
    if r.timed_out {
        eprintln!("sandlot: command timed out after {:.0} ms", r.duration_ms);
    }
    if r.oom_killed {
        eprintln!("sandlot: command was killed by the OOM killer");
    }
    if r.truncated {
        eprintln!("sandlot: output truncated (kept head and tail)");
    }
    r.exit_code.clamp(0, 255) as u8
}

async fn run(a: RunArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let sb = c.create(&a.sandbox.request()).await?;
    let out = c.exec(&sb.id, &exec_request(a.cmd, a.timeout, None)).await;
    // Always delete, also when the exec failed.
    let del = c.delete(&sb.id).await;
    let code = print_result(&out?);
    del?;
    Ok(code)
}

async fn exec(a: ExecArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let req = exec_request(a.cmd, a.timeout, a.cwd);
    if !a.stream {
        return Ok(print_result(&c.exec(&a.id, &req).await?));
    }
    let mut s = c.exec_stream(&a.id, &req).await?;
    while let Some(ev) = s.next().await {
        match ev? {
            ExecEvent::Stdout { data, data_b64 } => {
                let mut o = std::io::stdout();
                let _ = o.write_all(&raw(&data, data_b64));
                let _ = o.flush();
            }
            ExecEvent::Stderr { data, data_b64 } => {
                let _ = std::io::stderr().write_all(&raw(&data, data_b64));
            }
            ExecEvent::Exit { result } => return Ok(report_exit(&result)),
            ExecEvent::Error { error } => return Err(ClientError::Api(error).into()),
        }
    }
    anyhow::bail!("stream ended without an exit record")
}

fn raw(text: &str, b64: Option<String>) -> Vec<u8> {
    ExecResult {
        stdout: text.to_owned(),
        stdout_b64: b64,
        ..Default::default()
    }
    .stdout_raw()
}

async fn create(a: CreateArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let mut req = a.sandbox.request();
    req.ttl_s = a.ttl;
    req.labels = a.labels.into_iter().collect::<BTreeMap<_, _>>();
    if let Some(ck) = a.checkpoint {
        let ck = c.get_checkpoint(&ck).await?;
        req.backend = ck.backend;
        req.image = Some(ck.image);
        req.runtime = ck.runtime;
        req.checkpoint = Some(ck.checkpoint_id);
    }
    let sb = c.create(&req).await?;
    println!("{}", sb.id);
    Ok(0)
}

/// Prints one affected id per line; ids the node refused go to stderr and make the exit
/// code 1.
async fn pause_resume(a: SelectArgs, pause: bool) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let labels: Vec<(&str, &str)> = a
        .labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let r = if pause {
        c.pause(&labels).await?
    } else {
        c.resume(&labels).await?
    };
    for id in &r.sandboxes {
        println!("{id}");
    }
    for f in &r.failed {
        eprintln!("{}: {}", f.id, f.error);
    }
    Ok(u8::from(!r.failed.is_empty()))
}

async fn trajectory(a: TrajectoryArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let t = c.trajectory(&a.id).await?;
    println!("{}", serde_json::to_string_pretty(&t)?);
    Ok(0)
}

async fn ls(a: LsArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let labels: Vec<(&str, &str)> = a
        .labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let list = c.list(&labels).await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "sandboxes": list }))?
        );
        return Ok(0);
    }
    println!(
        "{:<24} {:<9} {:<9} {:<10} {:<25} {:<25} LABELS",
        "ID", "STATE", "BACKEND", "IMAGE", "CREATED", "EXPIRES"
    );
    for s in list {
        let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<24} {:<9} {:<9} {:<10} {:<25} {:<25} {}",
            s.id,
            s.state.as_str(),
            s.backend.as_str(),
            s.image,
            s.created_at,
            s.expires_at.as_deref().unwrap_or("-"),
            labels.join(",")
        );
    }
    Ok(0)
}

async fn rm(a: RmArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    for id in &a.ids {
        c.delete(id).await.with_context(|| format!("delete {id}"))?;
    }
    Ok(0)
}

async fn checkpoint(a: CheckpointArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let ck = c.checkpoint(&a.id).await?;
    println!("{}", ck.checkpoint_id);
    Ok(0)
}

async fn checkpoints(a: CheckpointsArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    let list = c.list_checkpoints().await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "checkpoints": list }))?
        );
        return Ok(0);
    }
    println!(
        "{:<24} {:<24} {:<9} {:<10} {:>12} CREATED",
        "ID", "SANDBOX", "BACKEND", "IMAGE", "BYTES"
    );
    for k in list {
        println!(
            "{:<24} {:<24} {:<9} {:<10} {:>12} {}",
            k.checkpoint_id,
            k.sandbox_id,
            k.backend.as_str(),
            k.image,
            k.size_bytes,
            k.created_at
        );
    }
    Ok(0)
}

async fn rm_checkpoint(a: RmArgs) -> anyhow::Result<u8> {
    let c = a.remote.client()?;
    for id in &a.ids {
        c.delete_checkpoint(id)
            .await
            .with_context(|| format!("delete checkpoint {id}"))?;
    }
    Ok(0)
}

async fn image(cmd: ImageCmd) -> anyhow::Result<u8> {
    match cmd {
        ImageCmd::Build {
            names,
            dirs,
            cache_dir,
            force,
        } => {
            use sandlot_node::images::toolchain::TOOLCHAINS;
            let store = dirs.open()?;
            let mut todo = Vec::new();
            for n in names {
                if n == "lang-all" {
                    todo.extend(TOOLCHAINS.iter().map(|t| format!("lang-{}", t.name)));
                } else {
                    todo.push(n);
                }
            }
            for name in todo {
                let img = match name.as_str() {
                    "busybox" => store.build_busybox_with(force),
                    "python" => store.build_python_with(&cache_dir, force),
                    other => store.build_toolchain(other, &cache_dir, force),
                }
                .with_context(|| format!("build image {name}"))?;
                println!("{} {} bytes", img.name, img.size_bytes);
            }
        }
        ImageCmd::Toolchains => {
            use sandlot_node::images::toolchain::TOOLCHAINS;
            println!(
                "{:<14} {:<44} {:<5} {:<5} LOWER",
                "NAME", "APT", "PIP", "NPM"
            );
            for t in TOOLCHAINS {
                println!(
                    "{:<14} {:<44} {:<5} {:<5} {}",
                    format!("lang-{}", t.name),
                    t.apt.join(" "),
                    t.pip.len(),
                    t.npm.len(),
                    t.lower.join(" ")
                );
            }
        }
        ImageCmd::Pull {
            reference,
            name,
            lazy,
            eager,
            dirs,
        } => {
            let store = dirs.open()?;
            if !eager {
                match store.pull_lazy(&reference, name.as_deref()).await {
                    Ok(img) => {
                        println!("{} {} bytes (lazy)", img.name, img.size_bytes);
                        return Ok(0);
                    }
                    Err(e) if lazy => {
                        return Err(
                            anyhow::Error::new(e).context(format!("pull --lazy {reference}"))
                        )
                    }
                    Err(e) => tracing::debug!(error = %e, "no lazy form; pulling whole"),
                }
            }
            let p = CliProgress::new();
            let img = store
                .pull(&reference, name.as_deref(), &p)
                .await
                .with_context(|| format!("pull {reference}"))?;
            println!("{} {} bytes", img.name, img.size_bytes);
        }
        ImageCmd::Convert { reference, dirs } => {
            let store = dirs.open()?;
            let r = store
                .convert_lazy(&reference)
                .await
                .with_context(|| format!("convert {reference}"))?;
            println!(
                "{} {} files bytes, {} data bytes, EROFS disk {} bytes, ext4 disk {} bytes, manifest {}",
                r.reference,
                r.files_bytes,
                r.data_bytes,
                r.disk_bytes.map_or("none".to_string(), |b| b.to_string()),
                r.vm_disk_bytes.map_or("none".to_string(), |b| b.to_string()),
                r.manifest
            );
        }
        ImageCmd::Import { path, name, dirs } => {
            let store = dirs.open()?;
            let p = CliProgress::new();
            let img = store
                .import(&path, name.as_deref(), &p)
                .with_context(|| format!("import {}", path.display()))?;
            println!("{} {} bytes", img.name, img.size_bytes);
        }
        ImageCmd::Ls { dirs, layers } => {
            println!(
                "{:<44} {:>12} {:>6} {:<24} SOURCE",
                "NAME", "SIZE", "LAYERS", "CREATED"
            );
            let store = dirs.open()?;
            for img in store.list()? {
                use sandlot_node::images::ImageSource as S;
                let source = match &img.source {
                    S::Busybox { .. } => "built-in busybox".to_string(),
                    S::Debootstrap(d) => format!("debootstrap {}", d.suite),
                    S::Registry { reference, .. } => format!("pull {reference}"),
                    S::Lazy { reference, .. } => match store.lazy_local_bytes(&img) {
                        Some(l) => {
                            let mut s = format!("local {}/{} bytes", l.cached, l.total);
                            if l.disk_total > 0 {
                                s += &format!(
                                    ", EROFS disk {}/{} bytes",
                                    l.disk_cached, l.disk_total
                                );
                            }
                            if l.vm_disk_total > 0 {
                                s += &format!(
                                    ", ext4 disk {}/{} bytes",
                                    l.vm_disk_cached, l.vm_disk_total
                                );
                            }
                            format!("lazy {reference} ({s})")
                        }
                        None => format!("lazy {reference}"),
                    },
                    S::Archive { path, .. } => format!("import {}", path.display()),
                    S::Toolchain { toolchain, .. } => format!("toolchain {toolchain}"),
                };
                println!(
                    "{:<44} {:>12} {:>6} {:<24} {}",
                    img.name,
                    img.size_bytes,
                    img.layers.len(),
                    img.created_at,
                    source
                );
                if layers {
                    for (rel, bytes) in
                        sandlot_node::images::toolchain::layer_sizes(store.dir(), &img)?
                    {
                        println!("    {:>12}  {rel}", bytes);
                    }
                }
            }
        }
        ImageCmd::Rm { name, dirs } => {
            dirs.open()?
                .remove(&name)
                .with_context(|| format!("remove image {name}"))?;
        }
        ImageCmd::Gc { dirs } => {
            let r = dirs.open()?.gc().context("image gc")?;
            println!(
                "removed {} blobs and {} layers, {} bytes; kept {} unreferenced layers or retired images still mounted",
                r.blobs, r.layers, r.bytes, r.in_use
            );
        }
    }
    Ok(0)
}
