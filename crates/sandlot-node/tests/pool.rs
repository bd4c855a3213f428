//! The warm pool of the `function` backend end to end: a real `LocalNode` with
//! `warm_pool` on, the real `sandlot-guest`, a busybox image built by
//! `ImageStore::build_busybox`. Needs root, cgroups and the guest binary
//! (`SANDLOT_GUEST_BIN`, else `target/{release,debug}/sandlot-guest` of this build's
//! profile); each test prints why it skips.
//!
//! `cargo test -p sandlot-node --test pool -- --nocapture` prints cold vs pooled create
//! latency.
use sandlot_api::{Backend, Cmd, ExecRequest};
use sandlot_node::backends::function::pool::POOL_PREFIX;
use sandlot_node::backends::saved::{self, SavedSandbox};
use sandlot_node::cgroups::CgroupRoot;
use sandlot_node::sys::proc_starttime;
use sandlot_node::{LocalNode, Node, NodeConfig, SandboxSpec};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

struct Env {
    node: Option<Arc<LocalNode>>,
    cfg: NodeConfig,
    _tmp: tempfile::TempDir,
}

impl Env {
    fn node(&self) -> &LocalNode {
        self.node.as_ref().unwrap()
    }

    fn cgroups(&self) -> CgroupRoot {
        support::cgroups(&self.cfg)
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("sandboxes").join(id)
    }

    fn pool_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("warm-pool")
    }

    /// Names of the entries of `DATA/warm-pool`.
    fn pool_entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.pool_dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// The value of a limit file of sandbox `id`'s cgroup (by the name in its state).
    fn cgroup_file(&self, cgroup: &str, v1: &str, v2: &str) -> String {
        let g = self.cgroups().sandbox(cgroup);
        for d in g.group().dirs() {
            for f in [v1, v2] {
                if let Ok(s) = std::fs::read_to_string(d.join(f)) {
                    return s.trim().to_string();
                }
            }
        }
        panic!("no {v1} / {v2} in the cgroup {cgroup}");
    }

    async fn wait_ready(&self, image: &str, n: usize) {
        let end = Instant::now() + Duration::from_secs(30);
        while self
            .node()
            .warm_pool_ready()
            .get(image)
            .copied()
            .unwrap_or(0)
            < n
        {
            assert!(
                Instant::now() < end,
                "warm pool did not reach {n} ready {image} jails: {:?}",
                self.node().warm_pool_ready()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(node) = self.node.take() {
            support::delete_all(&node);
            // Dropping the node stops the pool and destroys its jails.
            drop(node);
        }
        let _ = self.cgroups().remove_parent();
    }
}

fn config(test: &str, pool: usize) -> Option<(NodeConfig, tempfile::TempDir)> {
    let guest = support::host_ready(test, support::BUILD_GUEST_HINT)?;
    let (mut cfg, tmp) = support::node_config(guest);
    cfg.name = "pool-test-node".into();
    cfg.cgroup_parent = support::unique_cgroup_parent("sandlot-pooltest");
    cfg.warm_pool = pool;
    cfg.warm_pool_images = vec!["busybox".into()];
    Some((cfg, tmp))
}

/// A node with a warm pool of `pool` busybox jails, started (readopt done).
async fn setup(test: &str, pool: usize) -> Option<Env> {
    let (cfg, tmp) = config(test, pool)?;
    let node = LocalNode::open(cfg.clone()).unwrap();
    if !support::build_busybox(test, &node) {
        return None;
    }
    node.readopt(&[]).await.unwrap();
    Some(Env {
        node: Some(Arc::new(node)),
        cfg,
        _tmp: tmp,
    })
}

/// Server defaults (512 MiB, 1 GiB disk): the pool can serve it.
fn spec(id: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        backend: Backend::Function,
        image: "busybox".into(),
        cpu: 0.5,
        memory_mib: 512,
        disk_mib: 1024,
        pids_max: 64,
        env: [("SB_VAR".to_string(), "from-sandbox".to_string())]
            .into_iter()
            .collect(),
        network: sandlot_api::NetworkPolicy::None,
        runtime: None,
    }
}

async fn sh(node: &LocalNode, id: &str, script: &str) -> sandlot_api::ExecResult {
    let mut r = ExecRequest::new(Cmd::Shell(script.into()));
    r.timeout_s = Some(30.0);
    node.exec(id, &r, None)
        .await
        .unwrap_or_else(|e| panic!("exec {script:?} in {id}: {e}"))
}

/// Cgroup name recorded for `id`: a `wp-` name when the sandbox came from the pool.
fn cgroup_of(env: &Env, id: &str) -> String {
    saved::read::<SavedSandbox>(&env.sandbox_dir(id))
        .unwrap_or_else(|| panic!("no state.json for {id}"))
        .cgroup_name()
        .to_string()
}

fn pooled(env: &Env, id: &str) -> bool {
    cgroup_of(env, id).starts_with(POOL_PREFIX)
}

/// Every host trace of cgroup `name` and sandbox dir `id` is gone, and `pid` is dead.
async fn assert_gone(env: &Env, id: &str, cgroup: &str, pid: i32) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let cg = env.cgroups().sandbox(cgroup).group().exists();
        let dir = env.sandbox_dir(id).exists();
        let alive = proc_starttime(pid).is_some();
        if !cg && !dir && !alive {
            return;
        }
        assert!(
            Instant::now() < end,
            "{id} left: cgroup {cgroup} {cg}, dir {dir}, init {pid} alive {alive}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn p50(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_create_is_used_works_and_deletes_clean() {
    let Some(env) = setup("pooled_create_is_used_works_and_deletes_clean", 2).await else {
        return;
    };
    let n = env.node();
    env.wait_ready("busybox", 2).await;
    assert!(
        n.list().await.unwrap().is_empty(),
        "pooled jails are not sandboxes"
    );
    assert_eq!(env.pool_entries().len(), 2);

    let t = Instant::now();
    n.create(&spec("sb-pooled")).await.unwrap();
    let took = t.elapsed();
    assert!(pooled(&env, "sb-pooled"), "the create did not use the pool");
    assert_eq!(n.warm_pool_stats().0, 1);
    eprintln!("pooled create took {took:?}");
    // Exactly the spec's pids limit at hand-over: no guest agent runs in a pooled jail.
    let cg = cgroup_of(&env, "sb-pooled");
    assert_eq!(env.cgroup_file(&cg, "pids.max", "pids.max"), "64");

    // It works like any sandbox: exec, env, host name, files, limits. Its first exec (as
    // run_code's one exec) takes the helper path (through the jail's standby helper) on
    // both exec paths: the command sees the sandbox's pid namespace (`NSpid` has one level
    // as the jail's /proc sees it; two through the guest agent, checked below).
    let r = sh(
        n,
        "sb-pooled",
        "echo hi; echo $SB_VAR; hostname; pwd; grep NSpid /proc/self/status",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let (out, nspid) = r.stdout.trim_end().rsplit_once('\n').unwrap_or_default();
    assert_eq!(out, "hi\nfrom-sandbox\nsb-pooled\n/workspace", "{r:?}");
    let levels = nspid.split_ascii_whitespace().count() - 1;
    assert_eq!(levels, 1, "first exec did not take the helper path: {r:?}");
    n.write_file("sb-pooled", "/workspace/a.txt", "data".into())
        .await
        .unwrap();
    assert_eq!(
        n.read_file("sb-pooled", "/workspace/a.txt", 100)
            .await
            .unwrap(),
        b"data"
    );
    assert_eq!(sh(n, "sb-pooled", "cat a.txt").await.stdout, "data");
    // From its second exec on, the sandbox starts its guest agent in the background (when
    // execs go through one): a later exec reaches it (its own pid namespace: two levels).
    let want = if sandlot_node::backends::function::agent_enabled() {
        2
    } else {
        1
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = sh(n, "sb-pooled", "grep NSpid /proc/self/status").await;
        assert_eq!(r.exit_code, 0, "{r:?}");
        let levels = r.stdout.split_ascii_whitespace().count() - 1;
        if levels == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no exec reached the guest agent within 10 s: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let names: Vec<String> = n
        .list_dir("sb-pooled", "/workspace")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(names.contains(&"a.txt".to_string()), "{names:?}");
    assert_eq!(
        env.cgroup_file(&cg, "memory.limit_in_bytes", "memory.max"),
        (512u64 << 20).to_string()
    );
    // The agent started above (default exec path) and added room for its standing
    // processes; without one the spec's limit stands as it was at hand-over.
    let extra = if sandlot_node::backends::function::agent_enabled() {
        sandlot_node::backends::function::AGENT_EXTRA_PIDS
    } else {
        0
    };
    assert_eq!(
        env.cgroup_file(&cg, "pids.max", "pids.max"),
        (64 + extra).to_string()
    );
    let cpu = env.cgroup_file(&cg, "cpu.cfs_quota_us", "cpu.max");
    // 0.5 CPU: 5 ms per 10 ms period (v2: "5000 10000").
    assert!(cpu == "5000" || cpu == "5000 10000", "cpu quota {cpu}");
    let state = saved::read::<SavedSandbox>(&env.sandbox_dir("sb-pooled")).unwrap();
    assert_eq!(state.id, "sb-pooled");
    assert_eq!(state.spec.memory_mib, 512);
    let pid = state.init_pid;

    // The pool refills.
    env.wait_ready("busybox", 2).await;

    // Delete leaves nothing: directory, cgroup (under its pooled name), processes.
    n.delete("sb-pooled").await.unwrap();
    assert_gone(&env, "sb-pooled", &cg, pid).await;
    assert!(n
        .exec(
            "sb-pooled",
            &ExecRequest::new(Cmd::Shell("true".into())),
            None
        )
        .await
        .is_err());

    // Cold (a /tmp bound the pool cannot give: disk < memory) vs pooled create latency.
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for i in 0..8 {
        let mut s = spec(&format!("sb-cold-{i}"));
        s.disk_mib = 64;
        let t = Instant::now();
        n.create(&s).await.unwrap();
        cold.push(t.elapsed().as_secs_f64() * 1000.0);
        assert!(!pooled(&env, &s.id));
        env.wait_ready("busybox", 1).await;
        let id = format!("sb-warm-{i}");
        let t = Instant::now();
        n.create(&spec(&id)).await.unwrap();
        warm.push(t.elapsed().as_secs_f64() * 1000.0);
        assert!(pooled(&env, &id));
        assert_eq!(sh(n, &id, "echo ok").await.stdout, "ok\n");
        n.delete(&s.id).await.unwrap();
        n.delete(&id).await.unwrap();
    }
    let (c, w) = (p50(&mut cold), p50(&mut warm));
    eprintln!("create p50: cold {c:.2} ms, pooled {w:.2} ms (8 each)");
    assert!(
        w < c,
        "pooled create ({w:.2} ms) is not faster than cold ({c:.2} ms)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_lower_and_higher_than_the_pool_default() {
    let Some(env) = setup("memory_lower_and_higher_than_the_pool_default", 2).await else {
        return;
    };
    let n = env.node();
    for (id, mib) in [("sb-small", 32u64), ("sb-big", 2048u64)] {
        env.wait_ready("busybox", 1).await;
        let mut s = spec(id);
        s.memory_mib = mib;
        n.create(&s).await.unwrap();
        assert!(pooled(&env, id), "{id} did not use the pool");
        let cg = cgroup_of(&env, id);
        assert_eq!(
            env.cgroup_file(&cg, "memory.limit_in_bytes", "memory.max"),
            (mib << 20).to_string(),
            "{id}"
        );
        assert_eq!(sh(n, id, "echo ok").await.stdout, "ok\n");
    }
    // The small limit is enforced: a 64 MiB buffer in a 32 MiB sandbox is OOM-killed.
    let mut req = ExecRequest::new(Cmd::Shell(
        "dd if=/dev/zero of=/dev/null bs=64M count=1".into(),
    ));
    req.timeout_s = Some(20.0);
    let r = n.exec("sb-small", &req, None).await.unwrap();
    assert!(
        r.oom_killed && !r.timed_out,
        "64 MiB fit in a 32 MiB sandbox: {r:?}"
    );
    // ...and the same buffer fits in the 2 GiB one.
    let r = n.exec("sb-big", &req, None).await.unwrap();
    assert_eq!((r.exit_code, r.oom_killed), (0, false), "{r:?}");
}

/// A pooled jail is made for 1 core, its standby exec group placed on 1 CPU; a sandbox
/// handed over with 2 cores must run its execs on 2 CPUs (cgroup v1 keeps a child
/// group's cpuset when the parent's widens: a JVM or compiler held to one CPU ran 1.5x
/// slower in run_code).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_cpu_than_the_pool_default_reaches_every_exec() {
    let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if host_cpus < 2 {
        eprintln!("SKIPPED: more_cpu_than_the_pool_default_reaches_every_exec: one CPU here");
        return;
    }
    let Some(env) = setup("more_cpu_than_the_pool_default_reaches_every_exec", 1).await else {
        return;
    };
    let n = env.node();
    env.wait_ready("busybox", 1).await;
    let mut s = spec("sb-2cpu");
    s.cpu = 2.0;
    n.create(&s).await.unwrap();
    assert!(pooled(&env, "sb-2cpu"), "did not use the pool");
    let allowed = sh(n, "sb-2cpu", "grep Cpus_allowed_list /proc/self/status")
        .await
        .stdout;
    let list = allowed.split(':').nth(1).unwrap_or("").trim().to_string();
    let count: usize = list
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum();
    assert_eq!(count, 2, "execs of a 2-core sandbox run on {list:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_beyond_the_pool_fall_back_to_cold() {
    let Some(env) = setup("concurrent_creates_beyond_the_pool_fall_back_to_cold", 1).await else {
        return;
    };
    let node = env.node.clone().unwrap();
    env.wait_ready("busybox", 1).await;
    let mut tasks = Vec::new();
    for i in 0..5 {
        let node = node.clone();
        tasks.push(tokio::spawn(async move {
            node.create(&spec(&format!("sb-c{i}"))).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let mut n_pooled = 0;
    for i in 0..5 {
        let id = format!("sb-c{i}");
        assert_eq!(
            sh(&node, &id, "echo $SB_VAR").await.stdout,
            "from-sandbox\n"
        );
        n_pooled += usize::from(pooled(&env, &id));
    }
    let (hits, misses) = node.warm_pool_stats();
    eprintln!("5 concurrent creates, pool of 1: {n_pooled} pooled, hits {hits}, misses {misses}");
    assert!(n_pooled >= 1, "none used the pool");
    assert!(n_pooled < 5, "all five pooled with a pool of one");
    assert_eq!(hits as usize, n_pooled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_removes_pool_jails_and_readopts_real_ones() {
    let Some(env) = setup("restart_removes_pool_jails_and_readopts_real_ones", 2).await else {
        return;
    };
    let n1 = env.node();
    env.wait_ready("busybox", 2).await;
    n1.create(&spec("sb-keep")).await.unwrap();
    assert!(pooled(&env, "sb-keep"));
    n1.write_file("sb-keep", "/workspace/k.txt", "kept".into())
        .await
        .unwrap();
    env.wait_ready("busybox", 2).await;
    let old: Vec<String> = env.pool_entries();
    assert_eq!(old.len(), 2, "{old:?}");
    let old_pids: Vec<i32> = old
        .iter()
        .map(|p| {
            saved::read::<SavedSandbox>(&env.pool_dir().join(p))
                .unwrap()
                .init_pid
        })
        .collect();

    // A second process on the same data dir (the first one "crashed": it is left alone
    // and idle, its pool full). A crash drops the first one's data-dir lock; n1 lives on in
    // this process and keeps it, so n2 takes none.
    let n2 = LocalNode::open(NodeConfig {
        lock_wait: None,
        ..env.cfg.clone()
    })
    .unwrap();
    let adopted = n2.readopt(&["sb-keep".to_string()]).await.unwrap();
    assert_eq!(adopted, ["sb-keep"]);
    // The old pool's jails are gone (processes, cgroups, directories)...
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let dirs_left = old.iter().any(|p| env.pool_dir().join(p).exists());
        let cg_left = old
            .iter()
            .any(|p| env.cgroups().sandbox(p).group().exists());
        let alive = old_pids.iter().any(|p| proc_starttime(*p).is_some());
        if !dirs_left && !cg_left && !alive {
            break;
        }
        assert!(
            Instant::now() < end,
            "old pool left: dirs {dirs_left}, cgroups {cg_left}, alive {alive}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...the new one refills with new jails...
    let end = Instant::now() + Duration::from_secs(30);
    while n2.warm_pool_ready().get("busybox").copied().unwrap_or(0) < 2 {
        assert!(Instant::now() < end, "new pool did not fill");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let new = env.pool_entries();
    assert!(
        new.iter().all(|p| !old.contains(p)),
        "old {old:?} new {new:?}"
    );
    // ...and the pooled sandbox is re-adopted and works.
    assert_eq!(
        sh(&n2, "sb-keep", "cat k.txt; echo; hostname").await.stdout,
        "kept\nsb-keep\n"
    );
    assert_eq!(
        n2.read_file("sb-keep", "/workspace/k.txt", 10)
            .await
            .unwrap(),
        b"kept"
    );
    let cg = cgroup_of(&env, "sb-keep");
    let pid = saved::read::<SavedSandbox>(&env.sandbox_dir("sb-keep"))
        .unwrap()
        .init_pid;
    n2.delete("sb-keep").await.unwrap();
    assert_gone(&env, "sb-keep", &cg, pid).await;
    // Dropping a pool destroys its own jails and nothing else.
    drop(n2);
    assert!(env.pool_entries().is_empty(), "{:?}", env.pool_entries());
}
