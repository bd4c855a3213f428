//! `sandlot node` as a process: started on 127.0.0.1:0 with a token file, reached through
//! `RemoteNode` (its info, a refused token, a list); on a host that can run the `function`
//! backend (root, cgroups, `sandlot-guest` beside the binary) also a create and an exec
//! through it, a kill -9 of the node mid-exec (`Transport`), a restart on the same data dir
//! that re-adopts the sandbox, an exec and a delete; else that part prints
//! `SKIPPED: <why>`.
use sandlot_api::{Backend, Cmd, ExecRequest, NetworkPolicy};
use sandlot_node_api::{Node, NodeError, SandboxSpec};
use sandlot_node_remote::RemoteNode;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

mod common;
use common::{cannot_run, Proc, BIN};

/// Starts `sandlot node` on a free port: the process and its URL.
async fn start_node(data: &Path, images: &Path, token_file: &Path) -> (Proc, String) {
    let mut child = Command::new(BIN)
        .args(["node", "--listen", "127.0.0.1:0", "--name", "cli-node"])
        .arg("--data-dir")
        .arg(data)
        .arg("--images-dir")
        .arg(images)
        .arg("--token-file")
        .arg(token_file)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc(child, data.to_path_buf());
    let line = tokio::task::spawn_blocking(move || {
        let mut l = String::new();
        BufReader::new(stdout).read_line(&mut l).unwrap();
        l
    })
    .await
    .unwrap();
    let url = line
        .trim()
        .strip_prefix("sandlot node listening on ")
        .unwrap_or_else(|| panic!("first line: {line:?}"))
        .to_owned();
    (proc, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandlot_node_serves_a_local_node_to_remote_node() {
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    let why_not = cannot_run(&images);
    let token_file = tmp.path().join("token");
    std::fs::write(&token_file, "n0de-t0ken\n").unwrap();
    let data = tmp.path().join("data");
    let (proc1, url) = start_node(&data, &images, &token_file).await;

    let r = RemoteNode::connect(&url, Some("wrong".into())).await;
    assert!(matches!(r, Err(NodeError::PermissionDenied(_))), "{r:?}");
    let node = RemoteNode::connect(&url, Some("n0de-t0ken".into()))
        .await
        .unwrap();
    assert_eq!(node.info().name, "cli-node");
    assert!(node.list().await.unwrap().is_empty());

    if let Some(why) = why_not {
        println!("SKIPPED: create and exec through `sandlot node`: {why}");
        return;
    }
    let id = "sb-c11000000000000000c1";
    let spec = SandboxSpec {
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
    };
    node.create(&spec)
        .await
        .expect("create through sandlot node");
    let mut req = ExecRequest::new(Cmd::Shell("echo hi from the node; exit 7".into()));
    req.timeout_s = Some(30.0);
    let r = node
        .exec(id, &req, None)
        .await
        .expect("exec through sandlot node");
    assert_eq!(
        (r.exit_code, r.stdout.as_str()),
        (7, "hi from the node\n"),
        "{r:?}"
    );

    // kill -9 of the node mid-exec: the caller gets Transport (outcome unknown), not
    // NotFound; the sandbox outlives the node process.
    let mut long = ExecRequest::new(Cmd::Shell("sleep 30".into()));
    long.timeout_s = Some(60.0);
    let pid = nix::unistd::Pid::from_raw(proc1.0.id() as i32);
    let kill = async {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
    };
    let (r, ()) = tokio::join!(node.exec(id, &long, None), kill);
    assert!(matches!(r, Err(NodeError::Transport(_))), "{r:?}");
    assert!(matches!(node.list().await, Err(NodeError::Transport(_))));
    drop(proc1);

    // Restarted on the same data dir, the node re-adopts the sandbox when told to keep it.
    let (_proc2, url2) = start_node(&data, &images, &token_file).await;
    let node = RemoteNode::connect(&url2, Some("n0de-t0ken".into()))
        .await
        .unwrap();
    let kept = node.readopt(&[id.to_string()]).await.expect("readopt");
    assert_eq!(kept, [id]);
    let mut req = ExecRequest::new(Cmd::Argv(vec!["echo".into(), "still here".into()]));
    req.timeout_s = Some(30.0);
    let r = node.exec(id, &req, None).await;
    let del = node.delete(id).await;
    assert_eq!(r.expect("exec after re-adoption").stdout, "still here\n");
    del.expect("delete");
    assert!(node.list().await.unwrap().is_empty());
}
