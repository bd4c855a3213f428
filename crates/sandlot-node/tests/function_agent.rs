//! The `function` backend's guest-agent exec path (the default; `SANDLOT_FUNCTION_AGENT=0`
//! turns it off; see
//! `backends/function/agent.rs`): a real `LocalNode`, the real `sandlot-guest`, a busybox
//! image. One test in a binary of its own, because the switch is an environment variable
//! read when the node opens (setting it while other tests' threads read the environment
//! would race). Needs root, cgroups and the guest binary; prints why it skips.
use sandlot_api::{Cmd, ExecRequest};
use sandlot_node::backends::saved::{self, SavedSandbox};
use sandlot_node::cgroups::CgroupRoot;
use sandlot_node::sys::proc_starttime;
use sandlot_node::{LocalNode, Node, NodeConfig, SandboxSpec};

use std::time::{Duration, Instant};

mod support;
use support::{sh, sh_req};

/// Until an exec runs through the agent: there each command has a pid namespace of its
/// own, nested in the sandbox's (two pids on its `NSpid` line; the helper path runs it in
/// the sandbox's, one pid).
async fn wait_agent(node: &LocalNode, cfg: &NodeConfig, id: &str) {
    let end = Instant::now() + Duration::from_secs(15);
    let log = cfg.data_dir.join("sandboxes").join(id).join("agent.log");
    loop {
        let r = node
            .exec(id, &sh_req("grep NSpid /proc/self/status", 30.0), None)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "exec: {e:?}; agent.log: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        if r.stdout.split_ascii_whitespace().count() == 3 {
            return;
        }
        assert!(
            Instant::now() < end,
            "{id}: no exec went through the agent: {r:?}; agent.log: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `PID STARTTIME` of the sandbox's agent (its `agent.pid`).
fn agent_pid(cfg: &NodeConfig, id: &str) -> (i32, u64) {
    let s =
        std::fs::read_to_string(cfg.data_dir.join("sandboxes").join(id).join("agent.pid")).unwrap();
    let mut it = s.split_ascii_whitespace();
    (
        it.next().unwrap().parse().unwrap(),
        it.next().unwrap().parse().unwrap(),
    )
}

/// Names (`comm`) of the processes in the sandbox's cgroup and its exec groups.
fn comms(cg: &CgroupRoot, id: &str) -> Vec<String> {
    let sb = cg.sandbox(id);
    let mut pids = sb.group().pids();
    for c in sb.exec_children() {
        pids.extend(c.pids());
    }
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_path_keeps_exec_semantics_and_survives_restart() {
    let test = "agent_path_keeps_exec_semantics_and_survives_restart";
    let Some(guest) = support::host_ready(test, support::BUILD_GUEST_HINT) else {
        return;
    };
    // The only test of this binary: no other thread reads the environment yet.
    // (Set explicitly: the suite may run with `SANDLOT_FUNCTION_AGENT=0` for the helper path.)
    std::env::set_var("SANDLOT_FUNCTION_AGENT", "1");
    let (mut cfg, _tmp) = support::node_config(guest);
    cfg.name = "test-node".into();
    cfg.cgroup_parent = support::unique_cgroup_parent("sandlot-test");
    let cg = support::cgroups(&cfg);
    let node = LocalNode::open(cfg.clone()).unwrap();
    if !support::build_busybox(test, &node) {
        return;
    }
    let id = "sb-agent";
    let spec = support::function_spec_with_env(id);
    node.create(&spec).await.unwrap();
    // `pids.max` is the spec's until the agent starts, then has room for its processes.
    let pids_max = || {
        cg.sandbox(id)
            .group()
            .dirs()
            .find_map(|d| std::fs::read_to_string(d.join("pids.max")).ok())
            .map(|s| s.trim().to_string())
    };
    assert_eq!(pids_max(), Some(spec.pids_max.to_string()));
    wait_agent(&node, &cfg, id).await;
    assert_eq!(
        pids_max(),
        Some((spec.pids_max + sandlot_node::backends::function::AGENT_EXTRA_PIDS).to_string())
    );

    // Exit codes, signals, env, cwd, stdin, identity and lock-down as on the helper path.
    let r = sh(&node, id, "echo out; echo err >&2; exit 3").await;
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
        (3, "out\n", "err\n")
    );
    let r = sh(&node, id, "kill -9 $$").await;
    assert_eq!((r.exit_code, r.signal), (137, Some(9)), "{r:?}");
    let r = sh(&node, id, "echo $SB_VAR; pwd; id -u").await;
    assert_eq!(r.stdout, "from-sandbox\n/workspace\n0\n");
    let mut req = ExecRequest::new(Cmd::Argv(vec!["cat".into()]));
    req.stdin_b64 = Some("aGVsbG8=".into());
    assert_eq!(node.exec(id, &req, None).await.unwrap().stdout, "hello");
    let r = sh(
        &node,
        id,
        "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status",
    )
    .await;
    assert_eq!(
        r.stdout,
        "CapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n",
        "{r:?}"
    );
    // The agent itself holds the sandbox's own host uid, never host root.
    let base = saved::read::<SavedSandbox>(&cfg.data_dir.join("sandboxes").join(id))
        .unwrap()
        .uid_base;
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", agent_pid(&cfg, id).0)).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert_eq!(
        uid_line.split_ascii_whitespace().nth(1),
        Some(base.to_string().as_str()),
        "{uid_line}"
    );

    // Output cap.
    let mut req = sh_req("seq 1 1000", 10.0);
    req.max_output_bytes = Some(10);
    let r = node.exec(id, &req, None).await.unwrap();
    assert_eq!(r.stdout, "1\n2\n31000\n");
    assert!(r.truncated);

    // Timeout kills the whole tree, background children included; nothing is left but
    // the sandbox's init and the agent's own processes.
    let t0 = Instant::now();
    let r = node
        .exec(
            id,
            &sh_req("sleep 100 & sleep 100 & echo up; wait", 0.5),
            None,
        )
        .await
        .unwrap();
    assert!(r.timed_out && r.stdout == "up\n", "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let end = Instant::now() + Duration::from_secs(5);
    while comms(&cg, id).iter().any(|c| c == "sleep") {
        assert!(Instant::now() < end, "left: {:?}", comms(&cg, id));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cg.sandbox(id).exec_children().len(), 0);

    // OOM: attributed to the exec, and not to the next one.
    node.create(&SandboxSpec {
        memory_mib: 64,
        ..support::function_spec_with_env("sb-agent-oom")
    })
    .await
    .unwrap();
    wait_agent(&node, &cfg, "sb-agent-oom").await;
    let r = sh(&node, "sb-agent-oom", "head -c 200m /dev/zero | tail").await;
    assert!(r.oom_killed && r.exit_code != 0, "{r:?}");
    let r = sh(&node, "sb-agent-oom", "echo fine").await;
    assert!(!r.oom_killed && r.exit_code == 0, "{r:?}");

    // A node restart: the re-adopted sandbox's execs reach the same agent.
    let before = agent_pid(&cfg, id);
    drop(node);
    let node = LocalNode::open(cfg.clone()).unwrap();
    let keep = [id.to_string(), "sb-agent-oom".to_string()];
    node.readopt(&keep).await.unwrap();
    wait_agent(&node, &cfg, id).await;
    assert_eq!(agent_pid(&cfg, id), before);

    // A killed agent is replaced; execs meanwhile take the helper path.
    let (pid, _) = before;
    // SAFETY: kill(2) on a pid this test owns (the sandbox's agent, checked alive above).
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let end = Instant::now() + Duration::from_secs(5);
    while proc_starttime(pid).is_some() {
        assert!(Instant::now() < end);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sh(&node, id, "echo still").await.stdout, "still\n");
    wait_agent(&node, &cfg, id).await;
    assert_ne!(agent_pid(&cfg, id).0, pid);

    // Delete: nothing left.
    for s in keep {
        node.delete(&s).await.unwrap();
        assert!(!cg.sandbox(&s).group().exists(), "{s} cgroup left");
        assert!(!cfg.data_dir.join("sandboxes").join(&s).exists());
    }
    let _ = cg.remove_parent();
}
