//! Terminals (`ExecRequest::pty`) on the `function` backend: a real `LocalNode`, the real
//! `sandlot-guest`, a busybox image. The pty is allocated inside the sandbox (its own
//! devpts): `tty` names `/dev/pts/N`, `stty size` prints the size, a resize frame changes
//! it. Needs root, cgroups and the guest binary (`SANDLOT_GUEST_BIN`, else
//! `target/{release,debug}/sandlot-guest` of this build's profile); each test prints why it
//! skips.
use base64::Engine;
use bytes::Bytes;
use sandlot_api::{Cmd, ExecEvent, ExecRequest, PtySize};
use sandlot_guest::spec::{pty_frame_data, pty_frame_resize};
use sandlot_node::{ExecControl, Node};
use std::time::Duration;
use tokio::sync::mpsc;

mod support;

fn setup(test: &str) -> Option<support::BusyboxNode> {
    support::BusyboxNode::start(test, "sandlot-test-pty")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pty_exec_has_a_terminal_of_the_sandbox_with_its_size() {
    let Some(env) = setup("a_pty_exec_has_a_terminal_of_the_sandbox_with_its_size") else {
        return;
    };
    let node = env.node.clone();
    let id = "sb-00000000000000007001";
    node.create(&support::function_spec(id)).await.unwrap();

    let mut req = ExecRequest::new(Cmd::Argv(vec!["/bin/sh".into()]));
    req.timeout_s = Some(30.0);
    req.pty = Some(PtySize {
        rows: 33,
        cols: 101,
    });
    req.stdin_b64 =
        Some(base64::engine::general_purpose::STANDARD.encode("tty; stty size; exit 3\n"));
    let r = node.exec(id, &req, None).await.unwrap();
    let out = String::from_utf8_lossy(&r.stdout_raw()).into_owned();
    assert_eq!(
        r.exit_code,
        3,
        "{out:?} {:?}",
        String::from_utf8_lossy(&r.stderr_raw())
    );
    assert!(out.contains("/dev/pts/"), "{out:?}");
    assert!(out.contains("33 101"), "{out:?}");
    assert!(
        String::from_utf8_lossy(&r.stderr_raw()).is_empty(),
        "{:?}",
        String::from_utf8_lossy(&r.stderr_raw())
    );

    // A bad size is the caller's fault.
    req.pty = Some(PtySize { rows: 0, cols: 80 });
    assert!(matches!(
        node.exec(id, &req, None).await,
        Err(sandlot_node::NodeError::InvalidArgument(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controlled_pty_takes_input_resizes_and_is_signalled() {
    let Some(env) = setup("a_controlled_pty_takes_input_resizes_and_is_signalled") else {
        return;
    };
    let node = env.node.clone();
    let id = "sb-00000000000000007002";
    node.create(&support::function_spec(id)).await.unwrap();

    let run = |script: Vec<Vec<u8>>, sig: Option<i32>| {
        let node = node.clone();
        async move {
            let mut req = ExecRequest::new(Cmd::Argv(vec!["/bin/sh".into()]));
            req.timeout_s = Some(30.0);
            req.pty = Some(PtySize { rows: 24, cols: 80 });
            let (in_tx, in_rx) = mpsc::channel::<Bytes>(16);
            let (sig_tx, sig_rx) = mpsc::unbounded_channel();
            let (ev_tx, mut ev_rx) = mpsc::channel::<ExecEvent>(64);
            let control = ExecControl {
                stdin: Some(in_rx),
                signals: sig_rx,
                handle: format!("pty-test-{}", script.len()),
                labels: None,
            };
            let exec =
                tokio::spawn(
                    async move { node.exec_controlled(id, &req, Some(ev_tx), control).await },
                );
            let mut seen = String::new();
            for frame in script {
                in_tx.send(Bytes::from(frame)).await.unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            if let Some(s) = sig {
                // Output first, so the shell is surely running.
                while !seen.contains("ready") {
                    match tokio::time::timeout(Duration::from_secs(10), ev_rx.recv()).await {
                        Ok(Some(ExecEvent::Stdout { data, data_b64, .. })) => {
                            seen.push_str(&match data_b64 {
                                Some(b) => String::from_utf8_lossy(
                                    &base64::engine::general_purpose::STANDARD.decode(b).unwrap(),
                                )
                                .into_owned(),
                                None => data,
                            })
                        }
                        Ok(Some(_)) => {}
                        _ => panic!("no 'ready' in the output: {seen:?}"),
                    }
                }
                sig_tx.send(s).unwrap();
            }
            let r = tokio::time::timeout(Duration::from_secs(30), exec)
                .await
                .expect("the pty exec ends")
                .unwrap()
                .unwrap();
            drop(in_tx);
            r
        }
    };

    let r = run(
        vec![
            pty_frame_data(b"stty size\n"),
            pty_frame_resize(sandlot_guest::spec::PtySize {
                rows: 40,
                cols: 120,
            }),
            pty_frame_data(b"stty size; exit 7\n"),
        ],
        None,
    )
    .await;
    let out = String::from_utf8_lossy(&r.stdout_raw()).into_owned();
    assert_eq!(r.exit_code, 7, "{out:?}");
    assert!(out.contains("24 80"), "{out:?}");
    assert!(out.contains("40 120"), "{out:?}");

    // SIGKILL ends the terminal's whole tree.
    let r = run(vec![pty_frame_data(b"echo ready; sleep 1000\n")], Some(9)).await;
    assert_eq!(r.signal, Some(9), "{r:?}");
}
