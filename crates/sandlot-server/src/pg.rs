//! PostgreSQL connection pool and schema migrations for cluster mode (issue 21 item 4).
//!
//! Client: `tokio-postgres` behind a `deadpool-postgres` pool; migrations: `refinery`, from
//! the versioned files `crates/sandlot-server/migrations/pg/V{n}__{name}.sql`, embedded in
//! the binary at compile time and applied by [`connect`] (refinery records them in its
//! `refinery_schema_history` table and refuses a database whose applied migrations differ
//! from the embedded ones). Several servers starting at once serialise on a PostgreSQL
//! advisory lock ([`MIGRATION_LOCK`]) around the migration run, so each migration is applied
//! exactly once.
//!
//! The URL is libpq's URI form, e.g. `postgres://sandlot@127.0.0.1:55432/sandlot`
//! (<https://www.postgresql.org/docs/15/libpq-connect.html#LIBPQ-CONNSTRING>); TLS is not
//! used (a cluster's PostgreSQL is reached on a private network or a unix socket).

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

mod embedded {
    refinery::embed_migrations!("migrations/pg");
}

/// Key of the session-level advisory lock held while migrating (an arbitrary constant,
/// ASCII "sandlotm").
pub const MIGRATION_LOCK: i64 = 0x7361_6e64_6c6f_746d;

/// Connections per pool unless the caller says otherwise.
pub const DEFAULT_POOL_SIZE: usize = 32;

/// How long a call waits for a free pooled connection, or for a new one to connect, before
/// failing with `unavailable` (so an outage fails fast instead of hanging).
pub const POOL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Errors of connecting to and migrating PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// The URL does not parse as a libpq connection string.
    #[error("postgres URL: {0}")]
    Url(#[source] tokio_postgres::Error),
    /// The pool could not be built.
    #[error("postgres pool: {0}")]
    Build(#[from] deadpool_postgres::BuildError),
    /// No connection could be had (server down, refused, auth failed, pool timeout).
    #[error("postgres unavailable: {0}")]
    Unavailable(#[from] deadpool_postgres::PoolError),
    /// A statement failed.
    #[error("postgres {op}: {source}")]
    Sql {
        /// What was being done.
        op: &'static str,
        /// Cause.
        #[source]
        source: tokio_postgres::Error,
    },
    /// Applying the migrations failed.
    #[error("postgres migrations: {0}")]
    Migrate(#[from] refinery::Error),
    /// Another server holds [`SERVER_LOCK`] on this database.
    #[error(
        "another sandlot server runs on this PostgreSQL database (it holds advisory lock \
         {SERVER_LOCK:#x}); without --etcd there is no leader election, so one server per \
         database: stop it first, or run every server with --etcd"
    )]
    InUse,
}

/// Key of the session-level advisory lock a server without an etcd election holds on its
/// database while it runs (ASCII "sandlots"): such a server runs the singletons itself, so
/// it must be the only one. Servers with an election ([`crate::leader`]) do not take it;
/// a restarted or replacement server takes over the database as soon as the previous one is
/// gone (PostgreSQL drops a session's advisory locks when its connection closes, also when
/// the process is killed).
pub const SERVER_LOCK: i64 = 0x7361_6e64_6c6f_7473;

/// The stores of a server on PostgreSQL and the connection that holds [`SERVER_LOCK`] (if
/// taken).
pub struct ServerStores {
    /// Sandbox records, keys, trajectory owners, checkpoints.
    pub registry: std::sync::Arc<crate::registry::PgRegistry>,
    /// The trajectory log.
    pub trajectories: std::sync::Arc<crate::trajectory_store::PgTrajectoryStore>,
    /// Holds [`SERVER_LOCK`] while it lives (its connection task runs beside it).
    _lock: Option<tokio_postgres::Client>,
}

/// Connect to `url` ([`connect`], [`DEFAULT_POOL_SIZE`] connections), with `exclusive`
/// take [`SERVER_LOCK`] on a connection of its own, and open the registry and the
/// trajectory log on the pool.
///
/// # Errors
/// As [`connect`]; [`PgError::InUse`] when `exclusive` and another server holds the lock.
pub async fn open_server(url: &str, exclusive: bool) -> Result<ServerStores, PgError> {
    let pool = connect(url, DEFAULT_POOL_SIZE).await?;
    if !exclusive {
        return Ok(ServerStores {
            registry: std::sync::Arc::new(crate::registry::PgRegistry::new(pool.clone())),
            trajectories: std::sync::Arc::new(crate::trajectory_store::PgTrajectoryStore::new(
                pool,
            )),
            _lock: None,
        });
    }
    let config: tokio_postgres::Config = url.parse().map_err(PgError::Url)?;
    let (client, conn) = config.connect(NoTls).await.map_err(|source| PgError::Sql {
        op: "connect for the server lock",
        source,
    })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::error!(error = %e, "PostgreSQL connection holding the server lock closed");
        }
    });
    let got: bool = client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&SERVER_LOCK])
        .await
        .map_err(|source| PgError::Sql {
            op: "take server lock",
            source,
        })?
        .get(0);
    if !got {
        return Err(PgError::InUse);
    }
    Ok(ServerStores {
        registry: std::sync::Arc::new(crate::registry::PgRegistry::new(pool.clone())),
        trajectories: std::sync::Arc::new(crate::trajectory_store::PgTrajectoryStore::new(pool)),
        _lock: Some(client),
    })
}

/// A pool of connections to `url` (at most `max_size`), with the schema migrated to the
/// newest embedded version. Connections are checked with a cheap query when recycled, so
/// a restarted PostgreSQL costs failed calls only while it is down.
///
/// # Errors
/// [`PgError::Url`] for a bad URL, [`PgError::Unavailable`] when no connection can be made,
/// [`PgError::Migrate`] / [`PgError::Sql`] when the migration fails.
pub async fn connect(url: &str, max_size: usize) -> Result<Pool, PgError> {
    let config: tokio_postgres::Config = url.parse().map_err(PgError::Url)?;
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Verified,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(max_size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .wait_timeout(Some(POOL_WAIT))
        .create_timeout(Some(POOL_WAIT))
        .build()?;
    migrate(&pool).await?;
    Ok(pool)
}

/// Apply the embedded migrations under the advisory lock [`MIGRATION_LOCK`].
///
/// # Errors
/// As [`connect`].
pub async fn migrate(pool: &Pool) -> Result<(), PgError> {
    let mut conn = pool.get().await?;
    let sql = |op| move |source| PgError::Sql { op, source };
    conn.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(sql("take migration lock"))?;
    let client: &mut tokio_postgres::Client = &mut conn;
    let ran = embedded::migrations::runner().run_async(client).await;
    conn.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(sql("release migration lock"))?;
    ran?;
    Ok(())
}

/// Test support: a PostgreSQL to run store tests against, and a fresh database per test.
#[cfg(test)]
pub(crate) mod testing {
    use std::process::{Command, Stdio};
    use std::sync::OnceLock;

    /// The server URL for tests: `SANDLOT_TEST_POSTGRES_URL`, else one server per test
    /// process started by `scripts/postgres.sh` in a temp dir (stopped and removed by a
    /// watchdog shell, in its own session, when this process exits, also when killed).
    /// `Err(why)` when neither is possible.
    pub(crate) fn server_url() -> Result<String, String> {
        static URL: OnceLock<Result<String, String>> = OnceLock::new();
        URL.get_or_init(|| {
            if let Ok(u) = std::env::var("SANDLOT_TEST_POSTGRES_URL") {
                return Ok(u);
            }
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/postgres.sh");
            let dir = tempfile::Builder::new()
                .prefix("sandlot-pg-test-")
                .tempdir()
                .map_err(|e| format!("temp dir: {e}"))?
                .keep();
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("free port: {e}"))?
                .port();
            // Watchdog: stop the server and remove its dir once this test process is gone;
            // spawned first, so a test killed while the server starts leaves nothing either.
            // In its own session (setsid), so killing the test's process group (a timeout)
            // does not take the watchdog with it.
            let _ = Command::new("setsid")
                .arg("bash")
                .arg("-c")
                .arg(
                    "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; \
                     bash \"$2\" stop \"$3\" >/dev/null 2>&1; rm -rf \"$3\"",
                )
                .arg("watchdog")
                .arg(std::process::id().to_string())
                .arg(script)
                .arg(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let out = Command::new("bash")
                .arg(script)
                .arg("start")
                .arg(&dir)
                .arg(port.to_string())
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("run scripts/postgres.sh: {e}"))?;
            if !out.status.success() {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(format!(
                    "scripts/postgres.sh start: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let line = String::from_utf8_lossy(&out.stdout);
            line.lines()
                .find_map(|l| l.strip_prefix("postgres "))
                .map(str::to_owned)
                .ok_or_else(|| format!("scripts/postgres.sh printed no URL: {line:?}"))
        })
        .clone()
    }

    /// URL of a new, empty database on the test server (named `t_<random>`; the server URL
    /// must be of the form `postgres://USER[:PASS]@HOST:PORT/DB`), or `None`
    /// after printing `SKIPPED: no PostgreSQL (why)`.
    pub(crate) async fn fresh_database(test: &str) -> Option<String> {
        let url = match server_url() {
            Ok(u) => u,
            Err(why) => {
                println!("SKIPPED: no PostgreSQL ({why}) for {test}");
                return None;
            }
        };
        let name = format!("t_{:016x}", rand::random::<u64>());
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect to the test PostgreSQL");
        tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create test database");
        // Same server and credentials, other database (the URL's path is its name).
        let base = url.split('?').next().unwrap_or(&url);
        let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
        Some(format!("{base}/{name}"))
    }
}

#[cfg(test)]
mod tests {
    /// Several servers starting at once on an empty database: each migration is applied
    /// once (the advisory lock), and every server gets a working pool.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_start_migrates_once() {
        let Some(url) = super::testing::fresh_database("concurrent_start_migrates_once").await
        else {
            return;
        };
        let tasks: Vec<_> = (0..6)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { super::connect(&url, 1).await })
            })
            .collect();
        let mut pools = Vec::new();
        for t in tasks {
            pools.push(t.await.unwrap().expect("connect and migrate"));
        }
        let c = pools[0].get().await.unwrap();
        let applied: i64 = c
            .query_one("SELECT count(*) FROM refinery_schema_history", &[])
            .await
            .unwrap()
            .get(0);
        let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/pg"))
            .unwrap()
            .count() as i64;
        assert_eq!(applied, files);
    }

    /// Migration V9 (issue 22) on a database with sandboxes: `tenant_usage` holds each
    /// tenant's count, millicores and MiB of its sandboxes not in `deleting` ('' for none),
    /// and its triggers keep it (a bulk insert, a change into and out of `deleting`, a
    /// delete).
    #[tokio::test]
    async fn tenant_usage_is_backfilled_by_its_migration() {
        let Some(url) = super::testing::fresh_database("tenant_usage_backfill").await else {
            return;
        };
        let (mut client, conn) = tokio_postgres::connect(&url, super::NoTls).await.unwrap();
        tokio::spawn(conn);
        super::embedded::migrations::runner()
            .set_target(refinery::Target::Version(8))
            .run_async(&mut client)
            .await
            .unwrap();
        let add = "INSERT INTO sandboxes (id, backend, image, state, node, created_at, spec,
                     labels, tenant)
                   SELECT id, 'function', 'python', st, 'n1', 1,
                     jsonb_build_object('cpu', cpu, 'memory_mib', mem), '{}', t
                   FROM unnest($1::text[], $2::text[], $3::float8[], $4::bigint[], $5::text[])
                     AS u(id, st, cpu, mem, t)";
        client
            .execute(
                add,
                &[
                    &vec!["sb-1", "sb-2", "sb-3", "sb-4", "sb-5"],
                    &vec!["running", "creating", "deleting", "running", "deleting"],
                    &vec![0.1f64, 0.2, 1.5, 0.25, 2.0],
                    &vec![100i64, 200, 300, 50, 1000],
                    &vec![
                        Some("key_a"),
                        Some("key_a"),
                        Some("key_a"),
                        None,
                        Some("key_b"),
                    ],
                ],
            )
            .await
            .unwrap();
        let pool = super::connect(&url, 1).await.unwrap();
        let usage = || async {
            client
                .query(
                    "SELECT tenant, n, mcpu, mem FROM tenant_usage
                     WHERE n != 0 OR mcpu != 0 OR mem != 0 ORDER BY tenant",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
                .collect::<Vec<(String, i64, i64, i64)>>()
        };
        let row = |t: &str, n, c, m| (t.to_owned(), n, c, m);
        assert_eq!(
            usage().await,
            [row("", 1, 250, 50), row("key_a", 2, 300, 300)]
        );
        // The tenant_locks of earlier versions is gone (tenant_usage is the lock now).
        let c = pool.get().await.unwrap();
        let locks: Option<String> = c
            .query_one("SELECT to_regclass('tenant_locks')::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(locks, None);
        c.execute(
            add,
            &[
                &vec!["sb-6", "sb-7"],
                &vec!["creating", "creating"],
                &vec![0.5f64, 0.5],
                &vec![10i64, 20],
                &vec![Some("key_b"), Some("key_c")],
            ],
        )
        .await
        .unwrap();
        c.execute(
            "UPDATE sandboxes SET state = 'running' WHERE id IN ('sb-5', 'sb-3')",
            &[],
        )
        .await
        .unwrap();
        c.execute(
            "UPDATE sandboxes SET state = 'deleting' WHERE id = 'sb-1'",
            &[],
        )
        .await
        .unwrap();
        c.execute("DELETE FROM sandboxes WHERE id IN ('sb-1', 'sb-2')", &[])
            .await
            .unwrap();
        assert_eq!(
            usage().await,
            [
                row("", 1, 250, 50),
                row("key_a", 1, 1500, 300),
                row("key_b", 2, 2500, 1010),
                row("key_c", 1, 500, 20)
            ]
        );
    }

    #[tokio::test]
    async fn bad_url_and_unreachable_server() {
        assert!(matches!(
            super::connect("postgres://u@h:notaport/db", 1).await,
            Err(super::PgError::Url(_))
        ));
        // Nothing listens on port 1: fails (within the pool's create timeout).
        assert!(matches!(
            super::connect("postgres://u@127.0.0.1:1/db", 1).await,
            Err(super::PgError::Unavailable(_))
        ));
    }
}
