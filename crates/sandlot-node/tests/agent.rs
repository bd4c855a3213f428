//! The guest agent (`sandlot-guest agent`) and the node's client of it, end to end on the
//! host: a real agent process on a unix socket, real `sandlot-guest exec` helpers in their
//! own pid namespaces. Needs root (the helper unshares a pid namespace) and the guest
//! binary (`SANDLOT_GUEST_BIN`, else `target/{release,debug}/sandlot-guest`); each test
//! prints why it skips.
mod support;

use sandlot_guest::agent_proto::ExecRequest;
use sandlot_guest::spec::{ExecSpec, ExecStatus};
use sandlot_node::agent_client::{AgentClient, ExecChunk};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    client: AgentClient,
    _tmp: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start(test: &str) -> Option<Agent> {
    let guest = support::host_ready(test, support::BUILD_GUEST_HINT)?;
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("agent.sock");
    let child = Command::new(&guest)
        .args(["agent", "--listen"])
        .arg(&sock)
        .spawn()
        .unwrap();
    let client = AgentClient::new(&sock);
    client
        .wait_ready(Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    Some(Agent {
        child,
        client,
        _tmp: tmp,
    })
}

fn request(script: &str, timeout_ms: u64, stdin: bool) -> ExecRequest {
    ExecRequest {
        spec: ExecSpec {
            init_pid: 0,
            init_starttime: 0,
            cgroup_procs: Vec::new(),
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            cwd: "/".into(),
            uid: 0,
            gid: 0,
            rlimits: Vec::new(),
            own_pid_ns: true,
            landlock: false,
            stdin_null: false,
            pty: None,
        },
        timeout_ms,
        stdin,
        handle: None,
        labels: None,
    }
}

/// Runs to the exit frame; returns (stdout, stderr, exit).
async fn run(
    a: &Agent,
    req: &ExecRequest,
    stdin: Option<&[u8]>,
) -> (Vec<u8>, Vec<u8>, sandlot_guest::agent_proto::ExecExit) {
    let mut s = a.client.exec(req, stdin).await.unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        match s.next().await.unwrap().expect("stream ended without exit") {
            ExecChunk::Output(true, d) => out.extend(d),
            ExecChunk::Output(false, d) => err.extend(d),
            ExecChunk::Exit(x) => return (out, err, x),
        }
    }
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

#[tokio::test]
async fn exec_streams_output_takes_stdin_and_reports_the_exit() {
    let Some(a) = start("exec_streams_output_takes_stdin_and_reports_the_exit").await else {
        return;
    };
    let req = request("cat; echo err >&2; echo $$; exit 3", 10_000, true);
    let (out, err, x) = run(&a, &req, Some(b"from stdin\n")).await;
    // The command is pid 2 of its own pid namespace (its init is pid 1).
    assert_eq!(String::from_utf8_lossy(&out), "from stdin\n2\n");
    assert_eq!(err, b"err\n");
    assert_eq!(x.status, ExecStatus::Exited { code: 3 });
    assert!(!x.timed_out);
    // Many calls multiplexed on one connection at once.
    let reqs: Vec<ExecRequest> = (0..8)
        .map(|i| request(&format!("echo {i}"), 10_000, false))
        .collect();
    let outs = futures::future::join_all(reqs.iter().map(|r| run(&a, r, None))).await;
    for (i, (out, _, x)) in outs.into_iter().enumerate() {
        assert_eq!(out, format!("{i}\n").into_bytes());
        assert_eq!(x.status, ExecStatus::Exited { code: 0 });
    }
}

#[tokio::test]
async fn timeout_kills_the_whole_tree_and_keeps_earlier_output() {
    let Some(a) = start("timeout_kills_the_whole_tree_and_keeps_earlier_output").await else {
        return;
    };
    let marker = a._tmp.path().join("ns");
    let script = format!(
        "sleep 300 & readlink /proc/self/ns/pid > {}; echo started; sleep 300",
        marker.display()
    );
    let t = Instant::now();
    let (out, _, x) = run(&a, &request(&script, 1_000, false), None).await;
    assert!(x.timed_out, "{x:?}");
    assert_eq!(x.status, ExecStatus::Signaled { signal: 9 });
    assert_eq!(out, b"started\n");
    assert!(t.elapsed() < Duration::from_secs(10));
    // Nothing of the tree is left: no process in that pid namespace. The kernel kills the
    // namespace's other processes when its init dies, but finishes their exit
    // asynchronously, so give a loaded host a moment.
    let ns = std::fs::read_to_string(&marker).unwrap();
    let in_ns = || -> Vec<i32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .filter(|p: &i32| {
                std::fs::read_link(format!("/proc/{p}/ns/pid"))
                    .map(|l| l.to_string_lossy() == ns.trim())
                    .unwrap_or(false)
                    && alive(*p)
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut left = in_ns();
    while !left.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        left = in_ns();
    }
    assert!(
        left.is_empty(),
        "left in the exec's pid namespace after 5 s: {left:?}"
    );
}

#[tokio::test]
async fn dropping_the_stream_kills_the_command() {
    let Some(a) = start("dropping_the_stream_kills_the_command").await else {
        return;
    };
    let marker = a._tmp.path().join("ns");
    let script = format!(
        "readlink /proc/self/ns/pid > {}; sleep 300",
        marker.display()
    );
    let s = a
        .client
        .exec(&request(&script, 600_000, false), None)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !marker.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ns = std::fs::read_to_string(&marker).unwrap();
    drop(s);
    let in_ns = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| {
                std::fs::read_link(format!("/proc/{p}/ns/pid"))
                    .map(|l| l.to_string_lossy() == ns.trim())
                    .unwrap_or(false)
                    && alive(*p)
            })
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while in_ns() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(in_ns(), 0, "the command outlived its caller");
    // The agent still serves.
    let (out, _, _) = run(&a, &request("echo ok", 10_000, false), None).await;
    assert_eq!(out, b"ok\n");
}

#[tokio::test]
async fn a_command_that_cannot_start_is_127_and_bad_input_is_a_user_error() {
    let Some(a) = start("a_command_that_cannot_start_is_127_and_bad_input_is_a_user_error").await
    else {
        return;
    };
    let mut req = request("", 10_000, false);
    req.spec.argv = vec!["no-such-command-xyz".into()];
    let (_, err, x) = run(&a, &req, None).await;
    assert_eq!(x.status, ExecStatus::Exited { code: 127 });
    assert!(String::from_utf8_lossy(&err).contains("command not found"));
    let mut req = request("true", 10_000, false);
    req.spec.cwd = "/no/such/dir".into();
    let (_, _, x) = run(&a, &req, None).await;
    assert!(
        matches!(
            x.status,
            ExecStatus::SetupFailed {
                user_error: true,
                ..
            }
        ),
        "{x:?}"
    );
}

#[tokio::test]
async fn handles_take_signals_and_streamed_stdin() {
    let Some(a) = start("handles_take_signals_and_streamed_stdin").await else {
        return;
    };
    // A trapped TERM reaches the command's process group through the helper and the exec
    // init; stdin streamed after the spec arrives while the command runs.
    let mut req = request(
        "trap 'echo term; exit 5' TERM; read line; echo got $line; while true; do sleep 0.05; done",
        10_000,
        true,
    );
    req.handle = Some("h-1".into());
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut s = a.client.exec_streaming(&req, None, Some(rx)).await.unwrap();
    tx.send(bytes::Bytes::from_static(b"hello\n"))
        .await
        .unwrap();
    let mut out = Vec::new();
    while !out.ends_with(b"got hello\n") {
        match s.next().await.unwrap().expect("exit too early") {
            ExecChunk::Output(true, d) => out.extend(d),
            ExecChunk::Output(false, _) => {}
            ExecChunk::Exit(x) => panic!("exited early: {x:?}"),
        }
    }
    // A second exec cannot take a handle in use.
    let mut dup = request("true", 10_000, false);
    dup.handle = Some("h-1".into());
    assert!(a.client.exec(&dup, None).await.is_err());
    a.client.signal("h-1", libc::SIGTERM).await.unwrap();
    let x = loop {
        match s.next().await.unwrap().expect("no exit") {
            ExecChunk::Output(true, d) => out.extend(d),
            ExecChunk::Output(false, _) => {}
            ExecChunk::Exit(x) => break x,
        }
    };
    assert_eq!(String::from_utf8_lossy(&out), "got hello\nterm\n");
    assert_eq!(x.status, ExecStatus::Exited { code: 5 });
    // Unknown (or ended) handles are not an error; a signal outside the set is.
    a.client.signal("h-1", libc::SIGTERM).await.unwrap();
    assert!(a.client.signal("h-2", libc::SIGSTOP).await.is_err());
    // SIGKILL ends the whole tree at once.
    let mut req = request("sleep 30 & sleep 30", 10_000, false);
    req.handle = Some("h-3".into());
    let mut s = a.client.exec(&req, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    a.client.signal("h-3", libc::SIGKILL).await.unwrap();
    let x = loop {
        if let ExecChunk::Exit(x) = s.next().await.unwrap().expect("no exit") {
            break x;
        }
    };
    assert_eq!(x.status, ExecStatus::Signaled { signal: 9 });
}

/// The agent's live children: (pid, command line, whether it made its own pid namespace
/// — the exec helpers do, the zygote does not).
fn agent_children(agent: i32) -> Vec<(i32, String, bool)> {
    let own_ns = std::fs::read_link(format!("/proc/{agent}/ns/pid_for_children")).ok();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // pid (comm) state ppid ...: the fields after the last ')'.
            let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
            rest.split_whitespace().nth(1) == Some(&agent.to_string()) && alive(*p)
        })
        .filter_map(|p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let ns = std::fs::read_link(format!("/proc/{p}/ns/pid_for_children")).ok();
            Some((p, cmd.trim().to_string(), ns != own_ns))
        })
        .collect()
}

/// Waits up to 10 s for `pred` over the agent's children; returns the last list.
async fn wait_children(
    agent: i32,
    what: &str,
    pred: impl Fn(&[(i32, String, bool)]) -> bool,
) -> Vec<(i32, String, bool)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = agent_children(agent);
        if pred(&c) {
            return c;
        }
        assert!(Instant::now() < deadline, "{what}: agent's children {c:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_zygote_makes_the_helpers_and_a_killed_one_is_replaced() {
    let Some(a) = start("a_zygote_makes_the_helpers_and_a_killed_one_is_replaced").await else {
        return;
    };
    let agent = a.child.id() as i32;
    let zygotes = |c: &[(i32, String, bool)]| -> Vec<i32> {
        c.iter()
            .filter(|(_, cmd, own_ns)| !own_ns && cmd.ends_with("exec --zygote"))
            .map(|(p, _, _)| *p)
            .collect()
    };
    // A spare made by the zygote is a clone of it (its command line, no execve), in a pid
    // namespace of its own, and a child of the agent (CLONE_PARENT).
    let from_zygote = |c: &[(i32, String, bool)]| {
        c.iter()
            .any(|(_, cmd, own_ns)| *own_ns && cmd.ends_with("exec --zygote"))
    };
    let echo = request("echo ok", 10_000, false);
    let (out, _, _) = run(&a, &echo, None).await;
    assert_eq!(out, b"ok\n");
    let c = wait_children(agent, "one zygote and a spare it made", |c| {
        zygotes(c).len() == 1 && from_zygote(c)
    })
    .await;
    let zygote = zygotes(&c)[0];
    assert!(
        !c.iter().any(|(_, cmd, _)| cmd.contains("--own-pid-ns")),
        "a helper was started with execve while the zygote runs: {c:?}"
    );

    // Killed: every exec still runs (the spare it made, then helpers the agent starts
    // itself), and a new zygote takes over after the restart delay (1 s).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(zygote),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_children(agent, "the killed zygote reaped", |c| {
        !c.iter().any(|(p, _, _)| *p == zygote)
    })
    .await;
    let mut direct = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    let c = loop {
        let (out, _, x) = run(&a, &echo, None).await;
        assert_eq!(out, b"ok\n", "{x:?}");
        // The refill after the exec has started the next spare by then.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = agent_children(agent);
        direct |= c.iter().any(|(_, cmd, _)| cmd.contains("--own-pid-ns"));
        if zygotes(&c).iter().any(|p| *p != zygote) && from_zygote(&c) {
            break c;
        }
        assert!(Instant::now() < deadline, "no new zygote: {c:?}");
    };
    assert!(
        direct,
        "no helper started directly while the zygote was gone"
    );
    assert_eq!(zygotes(&c).len(), 1, "{c:?}");

    // The zygote ends with the agent (EOF on its socket).
    let zygote = zygotes(&c)[0];
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(zygote) {
        assert!(Instant::now() < deadline, "the zygote outlived the agent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn connect_port_tunnels_both_ways_half_closes_and_closes_on_drop() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let test = "connect_port_tunnels_both_ways_half_closes_and_closes_on_drop";
    let Some(a) = start(test).await else { return };
    // The agent runs on the host here, so its loopback is the test's.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();

    // Echo of everything read, written after the client's half-close.
    let mut conn = a.client.connect_port("sb-test", port).await.unwrap();
    let (mut s, _) = l.accept().await.unwrap();
    let big: Vec<u8> = (0..2_000_000u32).map(|i| (i % 253) as u8).collect();
    let server = tokio::spawn(async move {
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        s.write_all(&got).await.unwrap();
    });
    let send = big.clone();
    let (mut rd, mut wr) = tokio::io::split(conn);
    let writer = tokio::spawn(async move {
        wr.write_all(&send).await.unwrap();
        wr.shutdown().await.unwrap();
        wr
    });
    let mut back = Vec::new();
    rd.read_to_end(&mut back).await.unwrap();
    assert!(back == big, "{} bytes back of {}", back.len(), big.len());
    server.await.unwrap();
    drop(rd.unsplit(writer.await.unwrap()));

    // Dropping the stream (no shutdown) closes the connection inside.
    conn = a.client.connect_port("sb-test", port).await.unwrap();
    let (mut s, _) = l.accept().await.unwrap();
    conn.write_all(b"hi").await.unwrap();
    let mut two = [0u8; 2];
    s.read_exact(&mut two).await.unwrap();
    assert_eq!(&two, b"hi");
    drop(conn);
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest))
        .await
        .expect("the service sees EOF once the caller drops its end")
        .unwrap();

    // Nothing listening; port 0.
    drop(l);
    match a.client.connect_port("sb-test", port).await {
        Err(sandlot_node_api::NodeError::Unavailable(m)) => {
            assert!(m.starts_with(sandlot_node_api::PORT_NOT_LISTENING), "{m}")
        }
        Err(e) => panic!("refused port: {e:?}"),
        Ok(_) => panic!("refused port connected"),
    }
    assert!(matches!(
        a.client.connect_port("sb-test", 0).await,
        Err(sandlot_node_api::NodeError::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn tunnels_nobody_reads_leave_the_other_calls_moving() {
    use tokio::io::AsyncWriteExt;
    let test = "tunnels_nobody_reads_leave_the_other_calls_moving";
    let Some(a) = start(test).await else { return };
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    // A service that pours 8 MiB into every connection; the callers never read.
    let pour = tokio::spawn(async move {
        let chunk = vec![7u8; 1 << 20];
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            let chunk = chunk.clone();
            tokio::spawn(async move {
                for _ in 0..8 {
                    if s.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(a.client.connect_port("sb-test", port).await.unwrap());
    }
    // Let the stalled streams fill every window they can.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t0 = Instant::now();
    let (out, _, x) = tokio::time::timeout(
        Duration::from_secs(20),
        run(&a, &request("echo still-here", 10_000, false), None),
    )
    .await
    .expect("an exec beside 16 unread tunnels finishes");
    assert_eq!(x.status, ExecStatus::Exited { code: 0 });
    assert_eq!(out, b"still-here\n");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    drop(held);
    pour.abort();
}

/// Collects an exec stream until `until` is in stdout (or the exit, when `until` is
/// `None`): (stdout, stderr, exit if seen).
async fn read_until(
    s: &mut sandlot_node::agent_client::ExecStream,
    until: Option<&[u8]>,
) -> (
    Vec<u8>,
    Vec<u8>,
    Option<sandlot_guest::agent_proto::ExecExit>,
) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        if until.is_some_and(|u| out.windows(u.len()).any(|w| w == u)) {
            return (out, err, None);
        }
        match s.next().await.unwrap().expect("stream ended without exit") {
            ExecChunk::Output(true, d) => out.extend(d),
            ExecChunk::Output(false, d) => err.extend(d),
            ExecChunk::Exit(x) => return (out, err, Some(x)),
        }
    }
}

/// Issue 25: a named exec outlives its connection's end (the node's restart), keeps what
/// it writes meanwhile in its ring, and a new connection finds it (`GET /v1/execs`),
/// reads it on from where the ring starts (`POST /v1/exec/attach`) and signals it; one
/// that ended meanwhile keeps its exit for the next node, and keeps it after that node
/// read it, until a node forgets it (`POST /v1/exec/forget`).
#[tokio::test]
async fn named_execs_outlive_their_connection_and_are_found_again() {
    let Some(a) = start("named_execs_outlive_their_connection_and_are_found_again").await else {
        return;
    };
    let sock = a._tmp.path().join("agent.sock");
    // The first "node": starts two named execs and one plain one, then goes away.
    let first = AgentClient::new(&sock);
    let mut counter = request(
        "i=0; while true; do echo n$i; i=$((i+1)); sleep 0.05; done",
        60_000,
        false,
    );
    counter.handle = Some("pr-counter".into());
    let mut s1 = first.exec(&counter, None).await.unwrap();
    let (out, _, _) = read_until(&mut s1, Some(b"n3\n")).await;
    assert!(out.starts_with(b"n0\n"));
    let mut short = request("sleep 0.3; echo done >&2; exit 7", 60_000, false);
    short.handle = Some("pr-short".into());
    let s2 = first.exec(&short, None).await.unwrap();
    let marker = a._tmp.path().join("plain");
    let plain = request(
        &format!("echo $$ > {}; sleep 300", marker.display()),
        60_000,
        false,
    );
    let s3 = first.exec(&plain, None).await.unwrap();
    while !marker.exists() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop((s1, s2, s3));
    drop(first);
    // Output written while nobody reads goes to the ring; "pr-short" ends meanwhile.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The second "node".
    let second = AgentClient::new(&sock);
    let list = second
        .list_execs()
        .await
        .unwrap()
        .expect("the agent has the call")
        .execs;
    let handles: Vec<&str> = list.iter().map(|e| e.handle.as_str()).collect();
    assert_eq!(handles, ["pr-counter", "pr-short"], "{list:?}");
    let c = &list[0];
    assert_eq!(c.exit_code, None);
    assert_eq!(c.argv, counter.spec.argv);
    assert!(c.stdout_bytes > out.len() as u64, "{c:?}");
    assert!(c.pid > 0 && c.started_unix_ms > 0);
    assert_eq!(list[1].exit_code, Some(7));
    assert_eq!(list[1].stderr_bytes, 5);

    // The ended one: its ring and exit; then, read, its exit again (its output is gone:
    // the offsets are past it) until it is forgotten.
    let (info, mut s) = second.attach("pr-short").await.unwrap();
    assert_eq!((info.stdout_offset, info.stderr_offset), (0, 0));
    let (_, err, x) = read_until(&mut s, None).await;
    assert_eq!(err, b"done\n");
    assert_eq!(x.unwrap().status, ExecStatus::Exited { code: 7 });
    let (info, mut s) = second.attach("pr-short").await.unwrap();
    assert_eq!((info.stdout_offset, info.stderr_offset), (0, 5));
    let (_, err, x) = read_until(&mut s, None).await;
    assert_eq!(err, b"");
    assert_eq!(x.unwrap().status, ExecStatus::Exited { code: 7 });
    second.forget_exec("pr-short").await.unwrap();
    assert!(matches!(
        second.attach("pr-short").await,
        Err(sandlot_node::node::NodeError::NotFound(_))
    ));

    // The running one: the ring's content starts where the first node stopped reading (or
    // earlier: frames in flight when it went), and the count goes on without a gap.
    let (info, mut s) = second.attach("pr-counter").await.unwrap();
    assert!(info.stdout_offset <= out.len() as u64, "{info:?}");
    assert_eq!(info.dropped, 0);
    let (more, _, _) = read_until(&mut s, Some(b"n40\n")).await;
    let mut whole = out[..info.stdout_offset as usize].to_vec();
    whole.extend(&more);
    let text = String::from_utf8_lossy(&whole);
    for (i, line) in text.lines().enumerate() {
        assert_eq!(line, format!("n{i}"), "{text}");
    }
    // A second reader while this one reads: refused.
    let third = AgentClient::new(&sock);
    assert!(matches!(
        third.attach("pr-counter").await,
        Err(sandlot_node::node::NodeError::Conflict(_))
    ));
    // Its handle still takes signals.
    second.signal("pr-counter", libc::SIGKILL).await.unwrap();
    let (_, _, x) = read_until(&mut s, None).await;
    assert_eq!(x.unwrap().status, ExecStatus::Signaled { signal: 9 });
    // Read to its end, it stays listed, ended, until forgotten.
    let list = second.list_execs().await.unwrap().unwrap().execs;
    let ended: Vec<_> = list
        .iter()
        .map(|e| (e.handle.as_str(), e.exit_code))
        .collect();
    assert_eq!(ended, [("pr-counter", Some(137))]);
    second.forget_exec("pr-counter").await.unwrap();
    let left = second.list_execs().await.unwrap().unwrap();
    assert_eq!((left.execs, left.max_number), (vec![], None));
}

/// `POST /v1/exec/forget` over the wire: an exec whose end its node read stays listed,
/// ended, with its exit code and labels until forgotten; forgetting is idempotent (an
/// unknown handle is fine); forgetting a running exec kills its tree; the highest number
/// label ever tabled outlives the forgotten execs.
#[tokio::test]
async fn named_execs_stay_until_forgotten_and_their_numbers_are_not_forgotten() {
    let Some(a) =
        start("named_execs_stay_until_forgotten_and_their_numbers_are_not_forgotten").await
    else {
        return;
    };
    let numbered = |cmd: &str, handle: &str, number: u32| {
        let mut r = request(cmd, 60_000, false);
        r.handle = Some(handle.into());
        r.labels = Some(serde_json::json!({"tag": handle, "number": number}));
        r
    };
    // Read to its end on a live connection.
    let (out, _, x) = run(&a, &numbered("echo hi; exit 3", "pr-read", 1003), None).await;
    assert_eq!(out, b"hi\n");
    assert_eq!(x.status, ExecStatus::Exited { code: 3 });
    let mut s = a
        .client
        .exec(&numbered("echo up; sleep 300", "pr-run", 1001), None)
        .await
        .unwrap();
    read_until(&mut s, Some(b"up\n")).await;
    let list = a.client.list_execs().await.unwrap().unwrap();
    assert_eq!(list.max_number, Some(1003));
    let got: Vec<_> = list
        .execs
        .iter()
        .map(|e| (e.handle.as_str(), e.exit_code, e.labels.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (
                "pr-read",
                Some(3),
                Some(serde_json::json!({"tag": "pr-read", "number": 1003}))
            ),
            (
                "pr-run",
                None,
                Some(serde_json::json!({"tag": "pr-run", "number": 1001}))
            ),
        ]
    );

    // Forgetting: gone from the list, twice is fine, unknown handles too.
    a.client.forget_exec("pr-read").await.unwrap();
    a.client.forget_exec("pr-read").await.unwrap();
    a.client.forget_exec("pr-never").await.unwrap();
    // A running one is killed: its stream ends at once (not after its 300 s), its end
    // going to no one.
    a.client.forget_exec("pr-run").await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.next().await {
                Ok(Some(ExecChunk::Output(..))) => {}
                other => return other.map(|c| c.is_none()),
            }
        }
    })
    .await
    .expect("the forgotten exec still runs");
    assert!(!matches!(end, Ok(false)), "{end:?}");
    let list = a.client.list_execs().await.unwrap().unwrap();
    assert_eq!((list.execs, list.max_number), (vec![], Some(1003)));
    // Its handle is free again.
    let (out, _, _) = run(&a, &numbered("echo again", "pr-read", 1004), None).await;
    assert_eq!(out, b"again\n");
    assert_eq!(
        a.client.list_execs().await.unwrap().unwrap().max_number,
        Some(1004)
    );
}

/// Resetting a named exec's stream on a live connection is a cancel: the command dies and
/// the table forgets it.
#[tokio::test]
async fn a_cancelled_named_exec_is_killed_and_forgotten() {
    let Some(a) = start("a_cancelled_named_exec_is_killed_and_forgotten").await else {
        return;
    };
    let mut req = request("echo up; sleep 300", 60_000, false);
    req.handle = Some("pr-cancel".into());
    let mut s = a.client.exec(&req, None).await.unwrap();
    read_until(&mut s, Some(b"up\n")).await;
    assert_eq!(a.client.list_execs().await.unwrap().unwrap().execs.len(), 1);
    drop(s);
    // Within the agent's grace for a connection's end (1 s) and the kill.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = a.client.list_execs().await.unwrap().unwrap().execs;
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still tabled: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The handle is free again.
    let mut again = request("echo again", 10_000, false);
    again.handle = Some("pr-cancel".into());
    let (out, _, _) = run(&a, &again, None).await;
    assert_eq!(out, b"again\n");
}

/// A client whose connections the test can cut (as a socket error or an agent whose
/// listener restarted would): each connection's socket is kept, cloned, in the list.
fn cuttable_client(
    sock: &std::path::Path,
) -> (
    AgentClient,
    std::sync::Arc<std::sync::Mutex<Vec<std::os::unix::net::UnixStream>>>,
) {
    let held: std::sync::Arc<std::sync::Mutex<Vec<std::os::unix::net::UnixStream>>> =
        Default::default();
    let (h, path) = (held.clone(), sock.to_path_buf());
    let connector: sandlot_node::agent_client::Connector = std::sync::Arc::new(move || {
        let (held, path) = (h.clone(), path.clone());
        Box::pin(async move {
            let s = std::os::unix::net::UnixStream::connect(&path)?;
            held.lock().unwrap().push(s.try_clone()?);
            s.set_nonblocking(true)?;
            tokio::net::UnixStream::from_std(s)
        })
    });
    (AgentClient::with_connector(sock, connector), held)
}

fn cut(held: &std::sync::Mutex<Vec<std::os::unix::net::UnixStream>>) {
    for c in held.lock().unwrap().drain(..) {
        let _ = c.shutdown(std::net::Shutdown::Both);
    }
}

/// Issue 25 on a live node: a named exec outlives the drop of the connection that read it
/// (not the node going away); the same client connects again and takes it up where the
/// agent's ring starts, the offsets fitting the count. An attach while another connection
/// still reads it is answered 409 and `attach_when_free` asks again until that
/// connection's end frees it.
#[tokio::test]
async fn a_named_exec_outlives_a_dropped_connection_and_is_taken_up_again() {
    let Some(a) = start("a_named_exec_outlives_a_dropped_connection_and_is_taken_up_again").await
    else {
        return;
    };
    let sock = a._tmp.path().join("agent.sock");
    let (client, held) = cuttable_client(&sock);
    let mut counter = request(
        "i=0; while true; do echo n$i; i=$((i+1)); sleep 0.05; done",
        60_000,
        false,
    );
    counter.handle = Some("pr-drop".into());
    let mut s = client.exec(&counter, None).await.unwrap();
    let (mut out, _, _) = read_until(&mut s, Some(b"n3\n")).await;
    cut(&held);
    // The stream ends without an exit frame.
    loop {
        match s.next().await.unwrap() {
            Some(ExecChunk::Output(true, d)) => out.extend(d),
            Some(other) => panic!("unexpected {other:?}"),
            None => break,
        }
    }
    drop(s);
    // The agent keeps it (its connection ended: not a cancel); the same client reconnects.
    let (info, mut s) = client.attach_when_free("pr-drop").await.unwrap();
    let (more, _, _) = read_until(&mut s, Some(b"n30\n")).await;
    let text = String::from_utf8_lossy(&more).into_owned();
    let first: usize = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix('n'))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    for (i, line) in text.lines().enumerate() {
        assert_eq!(line, format!("n{}", first + i), "{text}");
    }
    // The offset is that of the first line taken up; nothing read before is past it
    // by more than the frames in flight when the connection went.
    let offset: usize = (0..first).map(|i| format!("n{i}\n").len()).sum();
    assert_eq!(info.stdout_offset, offset as u64, "{info:?} {text}");
    assert!(first <= out.len() / 3 + 16, "{first} {}", out.len());

    // A second client while this one reads: 409 at once for `attach`, and
    // `attach_when_free` gets it once this connection is cut.
    let other = AgentClient::new(&sock);
    assert!(matches!(
        other.attach("pr-drop").await,
        Err(sandlot_node::node::NodeError::Conflict(_))
    ));
    let t0 = Instant::now();
    let cutter = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        cut(&held);
    };
    let (r, ()) = tokio::join!(other.attach_when_free("pr-drop"), cutter);
    let (_, mut s2) = r.unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(300));
    drop(s);
    read_until(&mut s2, Some(b"\n")).await;
    other.signal("pr-drop", libc::SIGKILL).await.unwrap();
    let (_, _, x) = read_until(&mut s2, None).await;
    assert_eq!(x.unwrap().status, ExecStatus::Signaled { signal: 9 });
}

/// A named exec's labels (the node's tag, meta and number of its process) are kept as
/// given and listed by `GET /v1/execs`; labels over the cap are refused (400), a plain
/// exec's are not kept.
#[tokio::test]
async fn a_named_execs_labels_are_listed_as_given_and_bounded() {
    let Some(a) = start("a_named_execs_labels_are_listed_as_given_and_bounded").await else {
        return;
    };
    let labels = serde_json::json!({"tag": "t", "meta": {"k": [1, "é"]}, "number": 1003});
    let mut req = request("echo up; sleep 300", 60_000, false);
    req.handle = Some("pr-labels".into());
    req.labels = Some(labels.clone());
    let mut s = a.client.exec(&req, None).await.unwrap();
    read_until(&mut s, Some(b"up\n")).await;
    let list = a.client.list_execs().await.unwrap().unwrap().execs;
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].labels, Some(labels));

    let mut big = request("true", 10_000, false);
    big.handle = Some("pr-big".into());
    big.labels = Some(serde_json::Value::String(
        "x".repeat(sandlot_guest::agent_proto::MAX_LABELS_BYTES),
    ));
    let refused = match a.client.exec(&big, None).await {
        Err(e) => format!("{e:?}"),
        Ok(mut s) => format!("{:?}", s.next().await),
    };
    assert!(refused.contains("over the limit"), "{refused}");
    assert_eq!(a.client.list_execs().await.unwrap().unwrap().execs.len(), 1);
    a.client.signal("pr-labels", libc::SIGKILL).await.unwrap();
    let (_, _, x) = read_until(&mut s, None).await;
    assert_eq!(x.unwrap().status, ExecStatus::Signaled { signal: 9 });
}
