//! A measurement, not a check (issue 22): creates/s of one tenant with a quota while it has
//! many live sandboxes, on both registries. Uses only the [`Registry`] trait, so it runs
//! unchanged against the code before `tenant_usage` (the "before" figure).

use crate::registry::{PgRegistry, Registry};
use crate::store::{KeyOutcome, Quota, Record, SpecJson, Store};
use sandlot_api::{Backend, NetworkPolicy, SandboxState};
use std::sync::Arc;
use std::time::Instant;

fn env(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn rec(id: String) -> Record {
    Record {
        id,
        backend: Backend::Function,
        image: "python".into(),
        state: SandboxState::Running,
        node: "n1".into(),
        created_at_ms: 1,
        expires_at_ms: None,
        spec: SpecJson {
            cpu: 0.1,
            memory_mib: 64,
            disk_mib: 1024,
            pids_max: 64,
            ttl_s: 600,
            env: Default::default(),
            network: NetworkPolicy::None,
            runtime: None,
            checkpoint: None,
            accel: None,
            trajectory: None,
        },
        labels: Default::default(),
        tenant: Some("key_bench".into()),
    }
}

/// Fills `r` with `live` sandboxes of one tenant (batches without quota), then times
/// `creates` creates of that tenant with a quota, `conc` at once; prints creates/s.
async fn measure(name: &str, r: Arc<dyn Registry>, live: usize, creates: usize, conc: usize) {
    let fill: Vec<Record> = (0..live).map(|i| rec(format!("sb-fill-{i}"))).collect();
    for chunk in fill.chunks(1000) {
        let items: Vec<_> = chunk.iter().map(|x| (x, None, None)).collect();
        let out = r.insert_many(&items, None).await.unwrap();
        assert!(out.iter().all(|o| matches!(o, Ok(KeyOutcome::Inserted))));
    }
    let q = Quota {
        max_sandboxes: Some(10_000_000),
        max_cpu: Some(1e9),
        max_memory_mib: Some(u64::MAX / 2),
    };
    let t = Instant::now();
    let tasks: Vec<_> = (0..conc)
        .map(|w| {
            let r = r.clone();
            tokio::spawn(async move {
                for i in (w..creates).step_by(conc) {
                    let x = rec(format!("sb-new-{i}"));
                    let out = r.insert_checked(&x, None, Some(&q)).await.unwrap();
                    assert_eq!(out, KeyOutcome::Inserted);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "MEASURE {name}: {creates} quota'd creates of one tenant at {live} live, {conc} at once: \
         {:.1} s, {:.0} creates/s",
        s,
        creates as f64 / s
    );
}

/// `SANDLOT_QUOTA_LIVE` live sandboxes (default 20000), `SANDLOT_QUOTA_CREATES` timed
/// creates (default 2000), `SANDLOT_QUOTA_CONCURRENCY` at once (default 32); SQLite, then
/// PostgreSQL when one can be started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn measure_quota_check_cost() {
    let (live, creates, conc) = (
        env("SANDLOT_QUOTA_LIVE", 20000),
        env("SANDLOT_QUOTA_CREATES", 2000),
        env("SANDLOT_QUOTA_CONCURRENCY", 32),
    );
    let dir = tempfile::Builder::new()
        .prefix("sandlot-quota-cost-")
        .tempdir()
        .unwrap();
    let s = Arc::new(Store::open(&dir.path().join("sandlot.db")).unwrap());
    measure("sqlite", s, live, creates, conc).await;
    let Some(url) = crate::pg::testing::fresh_database("measure_quota_check_cost").await else {
        return;
    };
    let pool = crate::pg::connect(&url, 4).await.unwrap();
    measure(
        "postgres",
        Arc::new(PgRegistry::new(pool)),
        live,
        creates,
        conc,
    )
    .await;
}
