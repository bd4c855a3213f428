//! The `function` backend end to end: a real `LocalNode`, the real `sandlot-guest`, a busybox
//! image built by `ImageStore::build_busybox`. Needs root, cgroups and the guest binary
//! (`SANDLOT_GUEST_BIN`, else `target/{release,debug}/sandlot-guest` of this build's
//! profile); each test prints why it skips.
use sandlot_api::{Backend, Cmd, ExecEvent, ExecRequest};
use sandlot_node::backends::function::mounts_under;
use sandlot_node::backends::saved::{self, SavedSandbox};
use sandlot_node::cgroups::CgroupRoot;
use sandlot_node::sys::proc_starttime;
use sandlot_node::{LocalNode, Node, NodeConfig, NodeError};
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod support;
use support::{function_spec_with_env as spec, sh, sh_req};

struct Env {
    node: Option<LocalNode>,
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

    /// Host pids in the sandbox's cgroup and its exec children, without the standing
    /// processes of its guest agent when execs go through one (the default; not with `SANDLOT_FUNCTION_AGENT=0`):
    /// the agent (`agent.pid`) and what sits at most two levels below it (its zygote, its
    /// spare helper and that helper's exec init). A command runs three levels below (agent,
    /// helper, exec init, command), so anything an exec leaves behind still counts.
    fn procs(&self, id: &str) -> Vec<i32> {
        let sb = self.cgroups().sandbox(id);
        let mut v = sb.group().pids();
        for c in sb.exec_children() {
            v.extend(c.pids());
        }
        let agent = std::fs::read_to_string(self.sandbox_dir(id).join("agent.pid"))
            .ok()
            .and_then(|s| s.split_ascii_whitespace().next()?.parse::<i32>().ok());
        let Some(agent) = agent else {
            return v;
        };
        let ppid = |p: i32| -> Option<i32> {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            stat[stat.rfind(')')? + 1..]
                .split_ascii_whitespace()
                .nth(1)?
                .parse()
                .ok()
        };
        let standing = |p: i32| -> bool {
            let mut cur = p;
            for _ in 0..3 {
                if cur == agent {
                    return true;
                }
                match ppid(cur) {
                    Some(pp) => cur = pp,
                    None => return false,
                }
            }
            false
        };
        v.retain(|p| !standing(*p));
        v
    }

    fn exec_groups(&self, id: &str) -> usize {
        self.cgroups().sandbox(id).exec_children().len()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Delete whatever the test left, then the test's own cgroup parent.
        if let Some(node) = self.node.take() {
            support::delete_all(&node);
        }
        let _ = self.cgroups().remove_parent();
    }
}

/// A fresh node over a temp data dir, or `None` (with the reason printed) when this host
/// cannot run the function backend.
fn setup(test: &str) -> Option<Env> {
    let guest = support::host_ready(test, support::BUILD_GUEST_HINT)?;
    let (mut cfg, tmp) = support::node_config(guest);
    cfg.name = "test-node".into();
    cfg.cgroup_parent = support::unique_cgroup_parent("sandlot-test");
    let node = LocalNode::open(cfg.clone()).unwrap();
    if let Some((_, Err(why))) = node
        .info()
        .backends
        .into_iter()
        .find(|(b, _)| *b == Backend::Function)
    {
        panic!("function backend unavailable on a host that should run it: {why}");
    }
    if !support::build_busybox(test, &node) {
        return None;
    }
    Some(Env {
        node: Some(node),
        cfg,
        _tmp: tmp,
    })
}

/// Poll `f` until true or `within` passes.
async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_basics_codes_stdin_env_bytes() {
    let Some(env) = setup("exec_basics_codes_stdin_env_bytes") else {
        return;
    };
    let n = env.node();
    n.create(&spec("sb-basic")).await.unwrap();

    let r = sh(n, "sb-basic", "echo hello; echo oops >&2").await;
    assert_eq!((r.exit_code, r.signal, r.timed_out), (0, None, false));
    assert_eq!(r.stdout, "hello\n");
    assert_eq!(r.stderr, "oops\n");
    assert_eq!((r.stdout_bytes, r.stderr_bytes, r.truncated), (6, 5, false));

    assert_eq!(sh(n, "sb-basic", "exit 42").await.exit_code, 42);
    let r = sh(n, "sb-basic", "kill -9 $$").await;
    assert_eq!((r.exit_code, r.signal), (137, Some(9)));
    let r = sh(n, "sb-basic", "kill -TERM $$").await;
    assert_eq!((r.exit_code, r.signal), (143, Some(15)));

    // argv form, missing command → 127 with a message
    let r = n
        .exec(
            "sb-basic",
            &ExecRequest::new(Cmd::Argv(vec!["no-such-cmd".into()])),
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, 127, "{r:?}");
    assert!(r.stderr.contains("no-such-cmd"), "{r:?}");

    // stdin
    let mut req = sh_req("wc -c; cat", 10.0);
    req.stdin_b64 = Some("aGVsbG8gc3RkaW4=".into()); // "hello stdin"
    let r = n.exec("sb-basic", &req, None).await.unwrap();
    assert_eq!(r.stdout.split_whitespace().next(), Some("11"));
    // stdin was consumed by wc; without stdin_b64 it is /dev/null
    let r = sh(n, "sb-basic", "cat; echo end").await;
    assert_eq!(r.stdout, "end\n");

    // environment: default, sandbox, exec (exec overrides sandbox)
    let mut req = sh_req("echo $HOME $SB_VAR $X; pwd", 10.0);
    req.env.insert("X".into(), "from-exec".into());
    let r = n.exec("sb-basic", &req, None).await.unwrap();
    assert_eq!(r.stdout, "/root from-sandbox from-exec\n/workspace\n");

    // a clean signal state: nothing blocked, nothing ignored (the helper is started with
    // posix_spawn, which leaves glibc's internal signals 32 and 33 ignored in it)
    let argv = ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"];
    let req = ExecRequest::new(Cmd::Argv(argv.iter().map(|a| a.to_string()).collect()));
    let r = n.exec("sb-basic", &req, None).await.unwrap();
    assert_eq!(
        r.stdout, "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n",
        "{r:?}"
    );

    // non-UTF-8 bytes come back exactly
    let r = sh(n, "sb-basic", r"printf '\377\376ok\200'").await;
    assert_eq!(r.stdout_raw(), b"\xff\xfeok\x80");
    assert!(r.stdout_b64.is_some());

    // the workspace is writable and persists between execs; files API sees it
    sh(n, "sb-basic", "echo persisted > /workspace/f.txt").await;
    assert_eq!(sh(n, "sb-basic", "cat f.txt").await.stdout, "persisted\n");
    let data = n.read_file("sb-basic", "f.txt", 1024).await.unwrap();
    assert_eq!(data, b"persisted\n");
    n.write_file(
        "sb-basic",
        "/workspace/g.txt",
        bytes::Bytes::from_static(b"from host"),
    )
    .await
    .unwrap();
    assert_eq!(
        sh(n, "sb-basic", "cat /workspace/g.txt").await.stdout,
        "from host"
    );
    let names: Vec<String> = n
        .list_dir("sb-basic", "/workspace")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(names.contains(&"f.txt".to_string()) && names.contains(&"g.txt".to_string()));

    // bad input → invalid_argument, not internal
    let mut req = sh_req("true", 10.0);
    req.cwd = Some("/does/not/exist".into());
    let e = n.exec("sb-basic", &req, None).await.unwrap_err();
    assert!(matches!(e, NodeError::InvalidArgument(_)), "{e:?}");
    let e = n
        .exec("sb-basic", &sh_req("true", 0.0), None)
        .await
        .unwrap_err();
    assert!(matches!(e, NodeError::InvalidArgument(_)), "{e:?}");
    let e = n
        .exec("sb-nope", &sh_req("true", 1.0), None)
        .await
        .unwrap_err();
    assert!(matches!(e, NodeError::NotFound(_)), "{e:?}");

    // every exec cleaned up its cgroup; only the init is left
    // (an empty exec group is removed in the background after the answer)
    assert!(
        eventually(Duration::from_secs(5), || env.exec_groups("sb-basic") == 0).await,
        "exec cgroups left: {}",
        env.exec_groups("sb-basic")
    );
    assert_eq!(
        env.procs("sb-basic").len(),
        1,
        "{:?}",
        env.procs("sb-basic")
    );
    n.delete("sb-basic").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_the_whole_tree_and_keeps_output() {
    let Some(env) = setup("timeout_kills_the_whole_tree_and_keeps_output") else {
        return;
    };
    let n = env.node();
    n.create(&spec("sb-timeout")).await.unwrap();
    let t = Instant::now();
    let r = n
        .exec(
            "sb-timeout",
            &sh_req(
                "echo before; echo err-before >&2; sleep 100 & sleep 100",
                1.0,
            ),
            None,
        )
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(r.timed_out);
    assert_eq!((r.exit_code, r.signal), (137, Some(9)));
    assert_eq!(r.stdout, "before\n");
    assert_eq!(r.stderr, "err-before\n");
    assert!(
        r.duration_ms >= 1000.0 && r.duration_ms < 4000.0,
        "{}",
        r.duration_ms
    );
    // nothing of it survives: no exec cgroup, only the init in the sandbox
    // (killed execs have their group removed before the answer)
    assert_eq!(env.exec_groups("sb-timeout"), 0);
    assert_eq!(
        env.procs("sb-timeout").len(),
        1,
        "{:?}",
        env.procs("sb-timeout")
    );
    let ps = sh(n, "sb-timeout", "ps -o pid,stat,comm").await;
    assert!(!ps.stdout.contains("sleep"), "{ps:?}");

    // a background child left by a finished command neither hangs the exec nor survives it
    let t = Instant::now();
    let r = sh(n, "sb-timeout", "sleep 100 & echo done").await;
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.timed_out),
        (0, "done\n", false)
    );
    assert_eq!(env.procs("sb-timeout").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_output_is_capped_head_and_tail() {
    let Some(env) = setup("huge_output_is_capped_head_and_tail") else {
        return;
    };
    let n = env.node();
    n.create(&spec("sb-huge")).await.unwrap();
    let r = sh(n, "sb-huge", "seq 1 3000000; echo END >&2; exit 3").await;
    let expected_total: u64 = (1..=3_000_000u64)
        .map(|i| i.to_string().len() as u64 + 1)
        .sum();
    assert_eq!(r.exit_code, 3);
    assert_eq!(r.stdout_bytes, expected_total);
    assert!(r.truncated);
    assert_eq!(r.stdout.len(), 1 << 20);
    assert!(r.stdout.starts_with("1\n2\n3\n"));
    assert!(r.stdout.ends_with("2999999\n3000000\n"));
    assert_eq!(r.stderr, "END\n");
    assert_eq!(r.stderr_bytes, 4);

    // a smaller cap
    let mut req = sh_req("seq 1 1000", 10.0);
    req.max_output_bytes = Some(10);
    let r = n.exec("sb-huge", &req, None).await.unwrap();
    // head "1\n2\n3", tail "1000\n"
    assert_eq!(r.stdout, "1\n2\n31000\n");
    assert!(r.truncated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_gives_oom_killed() {
    let Some(env) = setup("memory_limit_gives_oom_killed") else {
        return;
    };
    let n = env.node();
    let mut s = spec("sb-oom");
    s.memory_mib = 64;
    n.create(&s).await.unwrap();
    let r = sh(n, "sb-oom", "head -c 200m /dev/zero | tail").await;
    assert!(r.oom_killed, "{r:?}");
    assert_ne!(r.exit_code, 0);
    // a later, small exec is not reported as OOM-killed
    let r = sh(n, "sb-oom", "echo fine").await;
    assert!(!r.oom_killed && r.exit_code == 0, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_bomb_is_contained_by_pids_max() {
    let Some(env) = setup("fork_bomb_is_contained_by_pids_max") else {
        return;
    };
    let n = env.node();
    let mut s = spec("sb-bomb");
    s.pids_max = 32;
    n.create(&s).await.unwrap();
    let r = n
        .exec(
            "sb-bomb",
            &sh_req(
                "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived",
                4.0,
            ),
            None,
        )
        .await
        .unwrap();
    // contained: the sandbox still answers and nothing of the bomb is left
    assert!(r.exit_code != 0 || r.stdout.contains("survived"), "{r:?}");
    let pids_current = env
        .cgroups()
        .sandbox("sb-bomb")
        .group()
        .dirs()
        .find_map(|d| std::fs::read_to_string(d.join("pids.current")).ok());
    if let Some(cur) = pids_current {
        assert!(cur.trim().parse::<u64>().unwrap() <= 32);
    }
    assert!(eventually(Duration::from_secs(5), || env.procs("sb-bomb").len() == 1).await);
    assert_eq!(sh(n, "sb-bomb", "echo ok").await.stdout, "ok\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_leave_no_zombies() {
    let Some(env) = setup("orphans_leave_no_zombies") else {
        return;
    };
    let n = env.node();
    n.create(&spec("sb-orphans")).await.unwrap();
    let r = sh(
        n,
        "sb-orphans",
        "for i in $(seq 50); do (sleep 0.1 &); done; sleep 0.5; echo spawned",
    )
    .await;
    assert_eq!(r.stdout, "spawned\n");
    // Inside the sandbox: no zombie (state Z) among its processes, polled with a deadline.
    let count_zombies = "cat /proc/[0-9]*/stat 2>/dev/null | awk '$3 == \"Z\"' | wc -l";
    let mut zombies = String::new();
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        zombies = sh(n, "sb-orphans", count_zombies)
            .await
            .stdout
            .trim()
            .to_string();
        if zombies == "0" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(zombies, "0");
    assert_eq!(env.procs("sb-orphans").len(), 1);
}

/// Host mounts naming this test node's data dir (a host-wide count would see whatever
/// else the machine mounts meanwhile).
fn mount_count(data_dir: &std::path::Path) -> usize {
    let d = data_dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&d))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_during_exec_and_twice_leaves_nothing() {
    let Some(env) = setup("delete_during_exec_and_twice_leaves_nothing") else {
        return;
    };
    let n = env.node();
    let mounts_before = mount_count(&env.cfg.data_dir);
    n.create(&spec("sb-del")).await.unwrap();
    let dir = env.sandbox_dir("sb-del");
    let state = saved::read::<SavedSandbox>(&dir).expect("state.json written");
    assert_eq!(state.id, "sb-del");
    assert_eq!(proc_starttime(state.init_pid), Some(state.init_starttime));
    // The overlay lives in the sandbox's mount namespace; the host holds only the
    // writable layer's disk (the disk quota).
    assert_eq!(
        mounts_under(&dir),
        [dir.join("scratch")],
        "only the scratch disk is mounted on the host side"
    );
    assert!(env.cgroups().sandbox("sb-del").group().exists());

    let t = Instant::now();
    let req = sh_req("echo started; sleep 100", 60.0);
    let (r, d) = tokio::join!(n.exec("sb-del", &req, None), async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        n.delete("sb-del").await
    });
    d.unwrap();
    let r = r.unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!((r.exit_code, r.signal, r.timed_out), (137, Some(9), false));
    assert_eq!(r.stdout, "started\n");

    // twice, and an unknown id: fine
    n.delete("sb-del").await.unwrap();
    n.delete("sb-never-existed").await.unwrap();

    // nothing left: no cgroup in any hierarchy, no directory, no process, no mount
    assert!(!env.cgroups().sandbox("sb-del").group().exists());
    assert!(!dir.exists());
    assert!(
        eventually(Duration::from_secs(3), || proc_starttime(state.init_pid)
            .is_none())
        .await,
        "init {} still alive",
        state.init_pid
    );
    assert_eq!(mount_count(&env.cfg.data_dir), mounts_before);
    assert!(n.list().await.unwrap().is_empty());
    let e = n
        .exec("sb-del", &sh_req("true", 1.0), None)
        .await
        .unwrap_err();
    assert!(matches!(e, NodeError::NotFound(_)), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_exec_future_still_cleans_up() {
    let Some(env) = setup("dropped_exec_future_still_cleans_up") else {
        return;
    };
    let n = env.node();
    n.create(&spec("sb-drop")).await.unwrap();
    let r = tokio::time::timeout(
        Duration::from_millis(700),
        n.exec("sb-drop", &sh_req("sleep 100 & sleep 100", 60.0), None),
    )
    .await;
    assert!(r.is_err(), "the exec should still be running when dropped");
    assert!(
        eventually(Duration::from_secs(5), || env.exec_groups("sb-drop") == 0
            && env.procs("sb-drop").len() == 1)
        .await,
        "exec cgroup or processes left: {:?}",
        env.procs("sb-drop")
    );
    assert_eq!(sh(n, "sb-drop", "echo ok").await.stdout, "ok\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sink_gets_chunks_in_order() {
    let Some(env) = setup("streaming_sink_gets_chunks_in_order") else {
        return;
    };
    let n = env.node();
    n.create(&spec("sb-stream")).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let collector = tokio::spawn(async move {
        let mut out = Vec::new();
        let mut times = Vec::new();
        while let Some(ev) = rx.recv().await {
            if let ExecEvent::Stdout { data, .. } = ev {
                out.push(data);
                times.push(Instant::now());
            }
        }
        (out, times)
    });
    let r = n
        .exec(
            "sb-stream",
            &sh_req("for i in 1 2 3 4 5; do echo $i; sleep 0.1; done", 10.0),
            Some(tx),
        )
        .await
        .unwrap();
    let (chunks, times) = collector.await.unwrap();
    assert_eq!(chunks.concat(), "1\n2\n3\n4\n5\n");
    assert_eq!(r.stdout, "1\n2\n3\n4\n5\n");
    // chunks came as produced, not all at the end
    assert!(chunks.len() >= 3, "{chunks:?}");
    assert!(*times.last().unwrap() - times[0] >= Duration::from_millis(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readopt_after_restart() {
    let Some(mut env) = setup("readopt_after_restart") else {
        return;
    };
    {
        let n = env.node();
        n.create(&spec("sb-keep")).await.unwrap();
        n.create(&spec("sb-drop")).await.unwrap();
        sh(n, "sb-keep", "echo kept > /workspace/k").await;
    }
    // "Restart": drop the node, leave a half-created sandbox and a stray cgroup behind.
    drop(env.node.take());
    std::fs::create_dir(env.sandbox_dir("sb-half")).unwrap();
    let stray = env.cgroups().sandbox("sb-stray");
    stray
        .create(&sandlot_node::cgroups::Limits {
            memory_bytes: 64 << 20,
            cpu: 1.0,
            pids_max: 10,
        })
        .unwrap();

    let node = LocalNode::open(env.cfg.clone()).unwrap();
    let adopted = node
        .readopt(&["sb-keep".to_string(), "sb-half".to_string()])
        .await
        .unwrap();
    assert_eq!(adopted, ["sb-keep"]);
    assert_eq!(
        sh(&node, "sb-keep", "cat /workspace/k").await.stdout,
        "kept\n"
    );
    let list = node.list().await.unwrap();
    assert_eq!(list.len(), 1);
    assert!(list[0].liveness.is_alive());
    for gone in ["sb-drop", "sb-half", "sb-stray"] {
        assert!(!env.sandbox_dir(gone).exists(), "{gone} dir left");
        assert!(
            !env.cgroups().sandbox(gone).group().exists(),
            "{gone} cgroup left"
        );
    }
    env.node = Some(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_unavailable_backends() {
    let Some(env) = setup("info_and_unavailable_backends") else {
        return;
    };
    let n = env.node();
    let info = n.info();
    assert_eq!(info.name, "test-node");
    assert!(info.cgroup_version == "v1" || info.cgroup_version == "v2");
    for (b, avail) in &info.backends {
        match b {
            Backend::Function => assert!(avail.is_ok()),
            // Available where a runtime and the static agent exist, else with the reason.
            Backend::Container | Backend::Microvm | Backend::Vm => {
                if let Err(why) = avail {
                    assert!(why.contains(b.as_str()), "{why}");
                }
            }
        }
    }
    // An unavailable backend answers creates with the reason.
    if let Some((_, Err(why))) = info.backends.iter().find(|(b, _)| *b == Backend::Vm) {
        let mut s = spec("sb-vm");
        s.backend = Backend::Vm;
        let e = n.create(&s).await.unwrap_err();
        assert!(matches!(e, NodeError::Unavailable(_)), "{e:?} ({why})");
    }
    let mut s = spec("sb-img");
    s.image = "no-such-image".into();
    let e = n.create(&s).await.unwrap_err();
    assert!(matches!(e, NodeError::NotFound(_)), "{e:?}");
    assert!(!env.sandbox_dir("sb-img").exists());
    // duplicate id → conflict, and the first one keeps working
    n.create(&spec("sb-dup")).await.unwrap();
    let e = n.create(&spec("sb-dup")).await.unwrap_err();
    assert!(matches!(e, NodeError::Conflict(_)), "{e:?}");
    assert_eq!(sh(n, "sb-dup", "echo ok").await.stdout, "ok\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_written_and_concurrent_execs_are_separate() {
    let Some(env) = setup("limits_are_written_and_concurrent_execs_are_separate") else {
        return;
    };
    let n = env.node();
    let mut s = spec("sb-lim");
    s.cpu = 0.5;
    s.memory_mib = 96;
    s.pids_max = 40;
    n.create(&s).await.unwrap();
    let cg = env.cgroups();
    let group = cg.sandbox("sb-lim");
    let read = |file: &str| -> Option<String> {
        group
            .group()
            .dirs()
            .find_map(|d| std::fs::read_to_string(d.join(file)).ok())
            .map(|s| s.trim().to_string())
    };
    match cg.version() {
        sandlot_node::cgroups::CgroupVersion::V1 => {
            assert_eq!(
                read("memory.limit_in_bytes").unwrap(),
                (96u64 << 20).to_string()
            );
            if let Some(sw) = read("memory.memsw.limit_in_bytes") {
                assert_eq!(sw, (96u64 << 20).to_string());
            }
            assert_eq!(read("cpu.cfs_quota_us").unwrap(), "5000");
            assert_eq!(read("cpu.cfs_period_us").unwrap(), "10000");
        }
        sandlot_node::cgroups::CgroupVersion::V2 => {
            assert_eq!(read("memory.max").unwrap(), (96u64 << 20).to_string());
            assert_eq!(read("cpu.max").unwrap(), "5000 10000");
        }
    }
    // Exactly the spec's: the guest agent's room is added only when an agent starts.
    assert_eq!(read("pids.max").unwrap(), "40");

    // Four execs at once: each gets its own output and exit code.
    let reqs: Vec<ExecRequest> = (0..4)
        .map(|i| sh_req(&format!("sleep 0.3; echo exec-{i}; exit {i}"), 10.0))
        .collect();
    let t = Instant::now();
    let (r0, r1, r2, r3) = tokio::join!(
        n.exec("sb-lim", &reqs[0], None),
        n.exec("sb-lim", &reqs[1], None),
        n.exec("sb-lim", &reqs[2], None),
        n.exec("sb-lim", &reqs[3], None)
    );
    let results = [r0, r1, r2, r3];
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "execs ran in parallel"
    );
    for (i, r) in results.into_iter().enumerate() {
        let r = r.unwrap();
        assert_eq!(r.stdout, format!("exec-{i}\n"));
        assert_eq!(r.exit_code, i as i32);
    }
    // (an empty exec group is removed in the background after the answer)
    assert!(
        eventually(Duration::from_secs(5), || env.exec_groups("sb-lim") == 0).await,
        "exec cgroups left: {}",
        env.exec_groups("sb-lim")
    );
}

#[tokio::test]
async fn missing_guest_binary_makes_function_unavailable() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = NodeConfig::new(tmp.path().join("data"));
    cfg.guest_bin = tmp.path().join("no-such-guest");
    cfg.cgroup_parent = format!("sandlot-test-{}-missing", std::process::id());
    let node = LocalNode::open(cfg).unwrap();
    let (_, avail) = node
        .info()
        .backends
        .into_iter()
        .find(|(b, _)| *b == Backend::Function)
        .unwrap();
    let why = avail.unwrap_err();
    assert!(
        why.contains("no-such-guest") || why.contains("root"),
        "{why}"
    );
    let e = node.create(&spec("sb-x")).await.unwrap_err();
    assert!(matches!(e, NodeError::Unavailable(_)), "{e:?}");
    // delete of anything is still fine (idempotent)
    node.delete("sb-x").await.unwrap();
}
