//! Shared by the integration tests of the node API: starting a [`router`] on
//! `127.0.0.1:0`, and the contract cases every `Node` must pass (`FakeNode`, `RemoteNode`
//! in front of a `FakeNode`, `RemoteNode` in front of a real `LocalNode`).
#![allow(dead_code)]

use bytes::Bytes;
use sandlot_api::{Backend, Cmd, ExecEvent, ExecRequest, FileType, NetworkPolicy};
use sandlot_api::{ProcessEvent, ProcessState, SpawnRequest};
use sandlot_node_api::{ExecControl, Node, NodeError, OutputCursor, SandboxSpec};
use sandlot_node_remote::{router, serve};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// `node` serving background processes, as `sandlot node` serves its `LocalNode` (output
/// spilled under a temporary directory that lives as long as the test process).
pub fn with_processes(node: Arc<dyn Node>) -> Arc<sandlot_node::WithProcesses> {
    let dir = tempfile::tempdir().unwrap().keep();
    // No free-space reserve: output is kept whatever the test host's disk has free.
    let limits = sandlot_node::processes::ProcessLimits {
        spill_reserve_bytes: 0,
        ..Default::default()
    };
    sandlot_node::WithProcesses::with_limits(node, limits, dir.join("process-output")).unwrap()
}

/// A node API for `node` on a fresh local port: its URL and the serving task (abort it
/// to kill the listener and every connection).
pub async fn start(
    node: Arc<dyn Node>,
    token: Option<String>,
) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        serve(listener, router(node, token)).await.unwrap();
    });
    (url, task)
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A fresh sandbox id: `sb-` + 20 hex digits (pid, then a counter).
pub fn new_id() -> String {
    format!(
        "sb-{:08x}{:012x}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}

/// A small `function` sandbox of the `busybox` image (both the fake and a real node with
/// the busybox test image take it).
pub fn spec(id: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        backend: Backend::Function,
        image: "busybox".into(),
        cpu: 1.0,
        memory_mib: 256,
        disk_mib: 64,
        pids_max: 128,
        env: Default::default(),
        network: NetworkPolicy::None,
        runtime: None,
    }
}

/// What differs between the nodes under test: the command that writes
/// `line 0\nline 1\nline 2\n` to stdout in three writes, the bytes `ff fe` to stderr, and
/// exits 3 (`chunks 3` on the fake, a shell loop on a real node).
pub struct Profile {
    /// The command described above.
    pub chunks3: Cmd,
}

impl Profile {
    /// For `FakeNode`.
    pub fn fake() -> Profile {
        Profile {
            chunks3: Cmd::Argv(vec!["chunks".into(), "3".into()]),
        }
    }

    /// For a real node with the busybox image.
    pub fn real() -> Profile {
        Profile {
            chunks3: Cmd::Shell(
                r#"for i in 0 1 2; do echo "line $i"; done; printf '\377\376' >&2; exit 3"#.into(),
            ),
        }
    }
}

fn argv(v: &[&str]) -> ExecRequest {
    let mut r = ExecRequest::new(Cmd::Argv(v.iter().map(|s| s.to_string()).collect()));
    r.timeout_s = Some(30.0);
    r
}

fn kind(e: &NodeError) -> String {
    e.to_wire().kind
}

#[track_caller]
fn assert_kind<T: std::fmt::Debug>(r: Result<T, NodeError>, want: &str, what: &str) {
    match r {
        Err(e) => assert_eq!(kind(&e), want, "{what}: {e}"),
        Ok(v) => panic!("{what}: expected {want}, got Ok({v:?})"),
    }
}

/// Every contract case, in order, on `node` (which must start with no sandbox of ours).
pub async fn run_all(node: &dyn Node, p: &Profile) {
    let id = new_id();
    lifecycle_and_exec(node, p, &id).await;
    controlled(node, &id).await;
    files(node, &id).await;
    pause_resume(node, &id).await;
    checkpoints(node, &id).await;
    unknown_ids(node).await;
    processes(node, &id).await;
    delete_idempotent(node, &id).await;
    // Deleting the sandbox forgot its processes.
    assert!(node.process_list(&id).await.unwrap().is_empty());
}

fn spawn_of(v: &[&str], stdin: bool) -> SpawnRequest {
    SpawnRequest {
        cmd: Cmd::Argv(v.iter().map(|s| s.to_string()).collect()),
        cwd: None,
        env: Default::default(),
        stdin_b64: None,
        stdin,
        timeout_s: Some(60.0),
        max_output_bytes: None,
        user: None,
        pty: None,
        tag: None,
        meta: None,
    }
}

/// The stdout bytes and the last event of a process's output from `cursor`.
async fn read_output(
    node: &dyn Node,
    id: &str,
    pid: &str,
    cursor: OutputCursor,
) -> (Vec<u8>, Option<ProcessEvent>) {
    use futures::StreamExt;
    let mut events = node.process_output(id, pid, cursor).await.expect("output");
    let (mut out, mut last) = (Vec::new(), None);
    while let Some(ev) = events.next().await {
        if let ProcessEvent::Stdout { data, data_b64, .. } = &ev {
            out.extend(raw(data.clone(), data_b64.clone()));
        }
        last = Some(ev);
    }
    (out, last)
}

/// Background processes live on the node: spawn, output from offsets (a reader that
/// comes back later reads on from where it was), stdin, signals, wait, list, remove.
async fn processes(node: &dyn Node, id: &str) {
    let wait = Duration::from_secs(20);
    let p = node
        .process_spawn(id, spawn_of(&["echo", "hi"], false))
        .await
        .expect("spawn echo");
    assert!(p.id.starts_with("pr-"), "{p:?}");
    let done = node.process_wait(id, &p.id, wait).await.unwrap();
    assert_eq!(done.state, ProcessState::Exited, "{done:?}");
    assert_eq!(done.result.as_ref().unwrap().exit_code, 0, "{done:?}");
    assert_eq!(done.stdout_bytes, 3);
    let (out, last) = read_output(node, id, &p.id, OutputCursor::default()).await;
    assert_eq!(out, b"hi\n");
    assert!(matches!(last, Some(ProcessEvent::Exit { .. })), "{last:?}");
    // A reader that reached offset 3 gets only the end.
    let cursor = OutputCursor {
        stdout_offset: 3,
        ..Default::default()
    };
    let (out, last) = read_output(node, id, &p.id, cursor).await;
    assert!(out.is_empty());
    assert!(matches!(last, Some(ProcessEvent::Exit { .. })), "{last:?}");
    let past = OutputCursor {
        stdout_offset: 4,
        ..Default::default()
    };
    assert_kind(
        node.process_output(id, &p.id, past).await.map(|_| ()),
        "invalid_argument",
        "offset past the end",
    );

    // Live stdin; a following reader sees the first chunk before the second is sent.
    let cat = node
        .process_spawn(id, spawn_of(&["cat"], true))
        .await
        .expect("spawn cat");
    node.process_stdin(id, &cat.id, Bytes::from_static(b"ab"), false)
        .await
        .unwrap();
    {
        use futures::StreamExt;
        let follow = OutputCursor {
            follow: true,
            ..Default::default()
        };
        let mut events = node.process_output(id, &cat.id, follow).await.unwrap();
        let first = tokio::time::timeout(wait, events.next())
            .await
            .expect("cat echoed the first chunk")
            .unwrap();
        match first {
            ProcessEvent::Stdout { data, data_b64, .. } => {
                assert_eq!(raw(data, data_b64), b"ab")
            }
            other => panic!("{other:?}"),
        }
    }
    node.process_stdin(id, &cat.id, Bytes::from_static(b"cd"), true)
        .await
        .unwrap();
    let done = node.process_wait(id, &cat.id, wait).await.unwrap();
    assert_eq!(
        done.result.as_ref().map(|r| r.exit_code),
        Some(0),
        "{done:?}"
    );
    assert!(!done.stdin_open);
    let cursor = OutputCursor {
        stdout_offset: 2,
        ..Default::default()
    };
    let (out, _) = read_output(node, id, &cat.id, cursor).await;
    assert_eq!(out, b"cd");
    assert_kind(
        node.process_stdin(id, &cat.id, Bytes::from_static(b"x"), false)
            .await,
        "conflict",
        "stdin after exit",
    );

    // A signal ends a command that would run for 60 s; remove forgets it.
    let sleep = node
        .process_spawn(id, spawn_of(&["sleep", "60"], false))
        .await
        .expect("spawn sleep");
    let listed = node.process_list(id).await.unwrap();
    let ids: Vec<&str> = listed.iter().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, [p.id.as_str(), cat.id.as_str(), sleep.id.as_str()]);
    // The node numbers a sandbox's processes, counting up; list and get answer the numbers.
    let numbers: Vec<u32> = listed.iter().map(|p| p.number).collect();
    assert!(p.number >= sandlot_api::FIRST_PROCESS_NUMBER, "{p:?}");
    assert_eq!(numbers, [p.number, p.number + 1, p.number + 2]);
    assert_eq!(sleep.number, p.number + 2);
    let running = node
        .process_wait(id, &sleep.id, Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(running.state, ProcessState::Running);
    node.process_signal(id, &sleep.id, 15).await.unwrap();
    let done = node.process_wait(id, &sleep.id, wait).await.unwrap();
    assert_eq!(
        done.result.as_ref().and_then(|r| r.signal),
        Some(15),
        "{done:?}"
    );
    assert_kind(
        node.process_signal(id, &sleep.id, 15).await,
        "conflict",
        "signal after exit",
    );
    node.process_remove(id, &sleep.id).await.unwrap();
    assert_kind(
        node.process_get(id, &sleep.id).await.map(|_| ()),
        "not_found",
        "get after remove",
    );
    assert_eq!(node.process_get(id, &p.id).await.unwrap().id, p.id);
    assert_kind(
        node.process_remove(id, "pr-00000000000000000000").await,
        "not_found",
        "remove unknown",
    );
}

/// A process started through client `a` is found by its number and by its tag through
/// client `b` of the same node (another server of a cluster), with its `meta`, and driven
/// from there: stdin, signal, wait. The numbers of a fresh sandbox start at
/// [`sandlot_api::FIRST_PROCESS_NUMBER`] and are not reused after a remove.
pub async fn numbers_across_clients(a: &dyn Node, b: &dyn Node) {
    let wait = Duration::from_secs(20);
    let id = new_id();
    a.create(&spec(&id)).await.expect("create");
    let first = a
        .process_spawn(&id, spawn_of(&["echo", "one"], false))
        .await
        .unwrap();
    assert_eq!(first.number, sandlot_api::FIRST_PROCESS_NUMBER, "{first:?}");
    a.process_wait(&id, &first.id, wait).await.unwrap();
    a.process_remove(&id, &first.id).await.unwrap();
    let meta = serde_json::json!({"e2b": {"config": {"cmd": "cat"}, "pty": false}});
    let req = SpawnRequest {
        tag: Some("svc".into()),
        meta: Some(meta.clone()),
        ..spawn_of(&["cat"], true)
    };
    let cat = a.process_spawn(&id, req).await.unwrap();
    assert_eq!(cat.number, first.number + 1, "numbers are not reused");
    let listed = b.process_list(&id).await.unwrap();
    let by_number = listed.iter().find(|p| p.number == cat.number).unwrap();
    assert_eq!(by_number.id, cat.id);
    assert_eq!(by_number.tag.as_deref(), Some("svc"));
    assert_eq!(by_number.meta.as_ref(), Some(&meta));
    let by_tag = listed
        .iter()
        .rev()
        .find(|p| p.tag.as_deref() == Some("svc"))
        .unwrap();
    assert_eq!(by_tag.id, cat.id);
    b.process_stdin(&id, &by_number.id, Bytes::from_static(b"from b"), true)
        .await
        .unwrap();
    let done = a.process_wait(&id, &cat.id, wait).await.unwrap();
    assert_eq!(
        done.result.as_ref().map(|r| r.exit_code),
        Some(0),
        "{done:?}"
    );
    assert_eq!(done.stdout_bytes, 6);
    assert_eq!(
        b.process_get(&id, &cat.id).await.unwrap().number,
        cat.number
    );
    // Over the limits: refused, nothing created.
    let long = SpawnRequest {
        tag: Some("t".repeat(sandlot_api::MAX_TAG_BYTES + 1)),
        ..spawn_of(&["echo"], false)
    };
    assert_kind(
        a.process_spawn(&id, long).await,
        "invalid_argument",
        "long tag",
    );
    assert_eq!(b.process_list(&id).await.unwrap().len(), 1);
    a.delete(&id).await.unwrap();
}

async fn lifecycle_and_exec(node: &dyn Node, p: &Profile, id: &str) {
    assert!(!node.info().name.is_empty(), "info has a name");
    node.create(&spec(id)).await.expect("create");
    let listed = node.list().await.unwrap();
    let me = listed
        .iter()
        .find(|s| s.id == id)
        .unwrap_or_else(|| panic!("{id} not in {listed:?}"));
    assert_eq!(me.backend, Backend::Function);
    assert!(me.liveness.is_alive(), "{me:?}");

    let r = node
        .exec(id, &argv(&["echo", "hello", "world"]), None)
        .await
        .expect("echo");
    assert_eq!(
        (r.exit_code, r.stdout.as_str()),
        (0, "hello world\n"),
        "{r:?}"
    );
    assert!(!r.timed_out);

    // Streamed: the events, in order, make the result's output; non-UTF-8 bytes survive.
    let (tx, mut rx) = mpsc::channel(64);
    let mut req = ExecRequest::new(p.chunks3.clone());
    req.timeout_s = Some(30.0);
    let r = node.exec(id, &req, Some(tx)).await.expect("streamed exec");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut events = 0;
    while let Ok(ev) = rx.try_recv() {
        events += 1;
        match ev {
            ExecEvent::Stdout { data, data_b64 } => out.extend(raw(data, data_b64)),
            ExecEvent::Stderr { data, data_b64 } => err.extend(raw(data, data_b64)),
            other => panic!("sink got {other:?}"),
        }
    }
    assert!(events >= 2, "{events} events");
    assert_eq!(out, b"line 0\nline 1\nline 2\n");
    assert_eq!(err, [0xff, 0xfe]);
    assert_eq!(r.exit_code, 3, "{r:?}");
    assert_eq!(r.stdout_raw(), out);
    assert_eq!(r.stderr_raw(), err);
    assert_eq!((r.stdout_bytes, r.stderr_bytes), (21, 2));
}

fn raw(data: String, b64: Option<String>) -> Vec<u8> {
    use base64::Engine;
    match b64 {
        Some(b) => base64::engine::general_purpose::STANDARD.decode(b).unwrap(),
        None => data.into_bytes(),
    }
}

async fn controlled(node: &dyn Node, id: &str) {
    // Live stdin: two chunks, then EOF; `cat` echoes them and ends.
    let (stdin_tx, stdin_rx) = mpsc::channel::<Bytes>(4);
    let (_sig_tx, sig_rx) = mpsc::unbounded_channel();
    let (tx, mut rx) = mpsc::channel(64);
    let control = ExecControl {
        stdin: Some(stdin_rx),
        signals: sig_rx,
        handle: format!("{id}-cat"),
        labels: None,
    };
    let req = argv(&["cat"]);
    let run = node.exec_controlled(id, &req, Some(tx), control);
    let feed = async {
        stdin_tx.send(Bytes::from_static(b"ab")).await.unwrap();
        // The first chunk comes back before the second is sent: stdin is live.
        let first = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("cat echoed the first chunk")
            .unwrap();
        stdin_tx.send(Bytes::from_static(b"cd")).await.unwrap();
        drop(stdin_tx);
        first
    };
    let (r, first) = tokio::join!(run, feed);
    let r = r.expect("cat");
    let mut out = match first {
        ExecEvent::Stdout { data, data_b64 } => raw(data, data_b64),
        other => panic!("{other:?}"),
    };
    while let Ok(ev) = rx.try_recv() {
        if let ExecEvent::Stdout { data, data_b64 } = ev {
            out.extend(raw(data, data_b64));
        }
    }
    assert_eq!(out, b"abcd");
    assert_eq!(r.exit_code, 0, "{r:?}");

    // A signal ends a command that would run for 30 s: 128 + 15.
    let (sig_tx, sig_rx) = mpsc::unbounded_channel();
    let control = ExecControl {
        stdin: None,
        signals: sig_rx,
        handle: format!("{id}-sleep"),
        labels: None,
    };
    let started = std::time::Instant::now();
    let req = argv(&["sleep", "30"]);
    let run = node.exec_controlled(id, &req, None, control);
    let kill = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        sig_tx.send(15).unwrap();
    };
    let (r, ()) = tokio::join!(run, kill);
    let r = r.expect("sleep");
    assert_eq!((r.exit_code, r.signal), (143, Some(15)), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

async fn files(node: &dyn Node, id: &str) {
    let dir = "/workspace/contract";
    let file = "/workspace/contract/a.txt";
    node.make_dir(id, dir, true).await.expect("mkdir -p");
    node.write_file(id, file, Bytes::from_static(b"hello"))
        .await
        .expect("write");
    assert_eq!(node.read_file(id, file, 1 << 20).await.unwrap(), b"hello");
    assert_eq!(node.file_size(id, file).await.unwrap(), 5);
    let st = node.stat_file(id, file).await.unwrap();
    assert_eq!(
        (st.name.as_str(), st.kind, st.size),
        ("a.txt", FileType::File, 5)
    );
    assert_eq!(node.stat_file(id, dir).await.unwrap().kind, FileType::Dir);
    let names: Vec<_> = node
        .list_dir(id, dir)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["a.txt"]);
    assert_kind(
        node.read_file(id, file, 2).await,
        "invalid_argument",
        "read over max_bytes",
    );
    assert_kind(
        node.read_file(id, "/workspace/contract/missing", 100).await,
        "not_found",
        "read missing",
    );
    assert_kind(
        node.stat_file(id, "/workspace/contract/missing").await,
        "not_found",
        "stat missing",
    );
    // Paths with spaces and non-ASCII cross the wire unchanged.
    let odd = "/workspace/contract/b c ü?&=.txt";
    node.write_files_volatile(id, vec![(odd.into(), Bytes::from_static(&[0, 1, 0xff]))])
        .await
        .expect("volatile write");
    assert_eq!(node.read_file(id, odd, 10).await.unwrap(), [0, 1, 0xff]);
    node.remove_file(id, odd).await.unwrap();
    node.remove_file(id, file).await.expect("remove");
    assert_kind(
        node.read_file(id, file, 100).await,
        "not_found",
        "read removed",
    );
    assert!(node.list_dir(id, dir).await.unwrap().is_empty());
}

async fn pause_resume(node: &dyn Node, id: &str) {
    node.pause(id).await.expect("pause");
    node.pause(id).await.expect("pause again (no-op)");
    assert_kind(
        node.exec(id, &argv(&["echo", "x"]), None).await,
        "conflict",
        "exec while paused",
    );
    assert_kind(
        node.read_file(id, "/workspace/x", 10).await,
        "conflict",
        "read while paused",
    );
    node.resume(id).await.expect("resume");
    node.resume(id).await.expect("resume again (no-op)");
    let r = node.exec(id, &argv(&["echo", "back"]), None).await.unwrap();
    assert_eq!(r.stdout, "back\n");
    // Bulk: one call, one result per id in order; an unknown id fails alone.
    let ids = vec![new_id(), id.to_owned(), new_id()];
    let mut out = node.pause_many(&ids).await;
    assert_eq!(out.len(), 3);
    out.remove(1).expect("bulk pause of the sandbox");
    for r in out {
        assert_kind(r, "not_found", "bulk pause of an unknown id");
    }
    assert_kind(
        node.exec(id, &argv(&["echo", "x"]), None).await,
        "conflict",
        "exec after a bulk pause",
    );
    assert!(node.pause_many(&[]).await.is_empty());
    let mut out = node.resume_many(&ids).await;
    assert_eq!(out.len(), 3);
    out.remove(1).expect("bulk resume of the sandbox");
    for r in out {
        assert_kind(r, "not_found", "bulk resume of an unknown id");
    }
    let r = node
        .exec(id, &argv(&["echo", "again"]), None)
        .await
        .unwrap();
    assert_eq!(r.stdout, "again\n");
}

async fn unknown_ids(node: &dyn Node) {
    let nope = new_id();
    assert_kind(
        node.exec(&nope, &argv(&["echo"]), None).await,
        "not_found",
        "exec",
    );
    assert_kind(
        node.read_file(&nope, "/workspace/x", 10).await,
        "not_found",
        "read",
    );
    assert_kind(
        node.write_file(&nope, "/workspace/x", Bytes::new()).await,
        "not_found",
        "write",
    );
    assert_kind(node.pause(&nope).await, "not_found", "pause");
    assert_kind(node.resume(&nope).await, "not_found", "resume");
    node.delete(&nope)
        .await
        .expect("delete of an unknown id is fine");
}

async fn delete_idempotent(node: &dyn Node, id: &str) {
    node.delete(id).await.expect("delete");
    node.delete(id).await.expect("delete again");
    assert!(!node.list().await.unwrap().iter().any(|s| s.id == id));
    assert_kind(
        node.exec(id, &argv(&["echo"]), None).await,
        "not_found",
        "exec after delete",
    );
}

async fn checkpoints(node: &dyn Node, id: &str) {
    let file = "/workspace/ck.txt";
    node.write_file(id, file, Bytes::from_static(b"v1"))
        .await
        .unwrap();
    let ck = format!(
        "ck-{:020x}",
        SEQ.fetch_add(1, Ordering::SeqCst) as u64 + 0xc0ffee
    );
    let meta = node.checkpoint(id, &ck).await.expect("checkpoint");
    assert_eq!(
        (meta.id.as_str(), meta.sandbox_id.as_str(), meta.backend),
        (ck.as_str(), id, Backend::Function)
    );
    assert_eq!(meta.image, "busybox");
    assert!(node.list_checkpoints().await.unwrap().contains(&ck));
    assert_kind(
        node.checkpoint(id, "ck-bad").await,
        "invalid_argument",
        "bad ck id",
    );

    let fork = new_id();
    node.create_from_checkpoint(&spec(&fork), &ck)
        .await
        .expect("fork");
    assert_eq!(node.read_file(&fork, file, 10).await.unwrap(), b"v1");
    node.delete(&fork).await.unwrap();
    let unknown = format!("ck-{:020x}", 0xdead_u64);
    assert_kind(
        node.create_from_checkpoint(&spec(&new_id()), &unknown)
            .await,
        "not_found",
        "fork of an unknown checkpoint",
    );
    node.delete_checkpoint(&ck)
        .await
        .expect("delete checkpoint");
    node.delete_checkpoint(&ck)
        .await
        .expect("delete checkpoint again");
    assert!(!node.list_checkpoints().await.unwrap().contains(&ck));
}
