//! Throughput of the trajectory log itself (the SQLite [`TrajectoryStore`], no HTTP, no
//! sandbox): appends and replay reads per second with many concurrent trajectories.
//!
//! ```text
//! cargo run --release -p sandlot-server --example trajectory_log_bench -- [TRAJECTORIES] [STEPS] [--fsync]
//! ```
//! Defaults: 100 trajectories × 100 steps (10,000 appends), `synchronous=NORMAL` (the
//! server's default; `--fsync` = `synchronous=FULL`). Each append is one committed
//! transaction holding a realistic exec request and result (`python3 -c 'print(1)'`).
//! Prints appends/s and per-append latency p50/p99, then the same for the store part of a
//! replay (`get_step` + `record_replay`). The log lives in a temp directory, removed at
//! the end.
use sandlot_api::{Cmd, ExecRequest, ExecResult};
use sandlot_server::trajectory_store::{
    SqliteTrajectoryStore, StepRequest, StepResult, TrajectoryStore,
};
use std::sync::Arc;
use std::time::Instant;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let fsync = args.iter().any(|a| a == "--fsync");
    let nums: Vec<u64> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let trajectories = *nums.first().unwrap_or(&100);
    let steps = *nums.get(1).unwrap_or(&100);

    let dir = std::env::temp_dir().join(format!("sandlot-log-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = Arc::new(SqliteTrajectoryStore::open(
        &dir.join("trajectories.db"),
        fsync,
    )?);

    let req = StepRequest::Exec(ExecRequest::new(Cmd::Argv(vec![
        "python3".into(),
        "-c".into(),
        "print(1)".into(),
    ])));
    let digest = req.digest();
    let result = StepResult::Exec(ExecResult {
        stdout: "1\n".into(),
        stdout_bytes: 2,
        duration_ms: 12.5,
        ..Default::default()
    });

    // Appends: one task per trajectory, steps in order, all trajectories at once.
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..trajectories {
        let (store, req, digest, result) =
            (store.clone(), req.clone(), digest.clone(), result.clone());
        tasks.push(tokio::spawn(async move {
            let id = format!("bench/traj-{t}");
            let mut lat = Vec::with_capacity(steps as usize);
            for s in 0..steps {
                let c = Instant::now();
                store.append(&id, s, &req, &digest, &result, 0).await?;
                lat.push(c.elapsed().as_secs_f64() * 1e3);
            }
            anyhow::Ok(lat)
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    let wall = t0.elapsed().as_secs_f64();
    let n = lat.len() as f64;
    println!(
        "append: {} steps over {trajectories} trajectories in {wall:.2} s = {:.0} steps/s; per append p50 {:.3} ms p99 {:.3} ms (synchronous={})",
        lat.len(),
        n / wall,
        pct(&mut lat, 0.50),
        pct(&mut lat, 0.99),
        if fsync { "FULL" } else { "NORMAL" }
    );

    // Replay reads: what the replay path asks of the store per call.
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..trajectories {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("bench/traj-{t}");
            let mut lat = Vec::with_capacity(steps as usize);
            for s in 0..steps {
                let c = Instant::now();
                let logged = store.get_step(&id, s).await?;
                anyhow::ensure!(logged.is_some(), "step {s} of {id} missing");
                store.record_replay(&id, s, 0).await?;
                lat.push(c.elapsed().as_secs_f64() * 1e3);
            }
            anyhow::Ok(lat)
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    let wall = t0.elapsed().as_secs_f64();
    println!(
        "replay (get_step + record_replay): {} in {wall:.2} s = {:.0} replays/s; p50 {:.3} ms p99 {:.3} ms",
        lat.len(),
        lat.len() as f64 / wall,
        pct(&mut lat, 0.50),
        pct(&mut lat, 0.99)
    );
    drop(store);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
