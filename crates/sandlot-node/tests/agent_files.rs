//! The guest agent's file calls (`/v1/files/...`) and [`AgentClient`]'s file methods, end
//! to end: a real `sandlot-guest agent` process whose file root is a tmpfs mounted in a
//! private mount namespace of the test thread (`SANDLOT_AGENT_FILES_ROOT`), so nothing
//! touches the host's own tree. Needs root and the guest binary (see `agent.rs`); each test
//! prints why it skips.
mod support;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use sandlot_guest::agent_proto::{encode, FileKind, FrameKind, FsCode, FsError};
use sandlot_node::agent_client::AgentClient;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    client: AgentClient,
    sock: PathBuf,
    /// The agent's file root on the host side (a tmpfs).
    root: PathBuf,
    /// A host directory outside the root, holding `secret`.
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
    // Private mount namespace for this test thread (and the agent it spawns).
    unshare(CloneFlags::CLONE_NEWNS).expect("unshare mount ns");
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .expect("make / private");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    std::fs::create_dir(tmp.path().join("outside")).unwrap();
    std::fs::write(tmp.path().join("outside/secret"), b"host secret").unwrap();
    mount(
        Some("tmpfs"),
        &root,
        Some("tmpfs"),
        MsFlags::empty(),
        Some("mode=0755"),
    )
    .expect("mount tmpfs root");
    std::fs::create_dir_all(root.join("workspace")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/passwd"), b"root:x:0:0::/root:/bin/sh\n").unwrap();
    let sock = tmp.path().join("agent.sock");
    let child = Command::new(&guest)
        .args(["agent", "--listen"])
        .arg(&sock)
        .env("SANDLOT_AGENT_FILES_ROOT", &root)
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
        sock,
        root,
        _tmp: tmp,
    })
}

fn code<T: std::fmt::Debug>(r: Result<T, FsError>) -> FsCode {
    r.expect_err("expected an error").code
}

/// Deterministic bytes of every value (no rand dependency needed for this).
fn pattern(n: usize) -> Vec<u8> {
    let mut x: u32 = 0x1234_5678;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

#[tokio::test]
async fn file_calls_round_trip() {
    let Some(a) = start("file_calls_round_trip").await else {
        return;
    };
    let c = &a.client;
    // Several HTTP/2 DATA frames and read chunks each way.
    let data = pattern(3 * 1024 * 1024 + 7);
    c.write_file("d/e/f.bin", &data, u64::MAX).await.unwrap();
    assert_eq!(
        std::fs::read(a.root.join("workspace/d/e/f.bin")).unwrap(),
        data
    );
    assert_eq!(
        c.read_file("/workspace/d/e/f.bin", 1 << 30).await.unwrap(),
        data
    );
    let st = c.stat("d/e/f.bin").await.unwrap();
    assert_eq!(
        (st.name.as_str(), st.kind, st.size, st.mode),
        ("f.bin", FileKind::File, data.len() as u64, 0o644)
    );
    let dir = c.stat("/workspace/d").await.unwrap();
    assert_eq!((dir.kind, dir.mode), (FileKind::Dir, 0o755));
    assert_eq!(c.stat("/").await.unwrap().name, "/");
    let list = c.list_dir("d/e").await.unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].name, "f.bin");
    // Empty file; overwrite replaces.
    c.write_file("empty", b"", 10).await.unwrap();
    assert_eq!(c.read_file("empty", 0).await.unwrap(), b"");
    c.write_file("d/e/f.bin", b"short", 10).await.unwrap();
    assert_eq!(c.read_file("d/e/f.bin", 10).await.unwrap(), b"short");
    // mkdir with and without parents.
    c.mkdir("m/n/o", true).await.unwrap();
    c.mkdir("m/n/o", true).await.unwrap();
    assert_eq!(c.stat("m/n/o").await.unwrap().kind, FileKind::Dir);
    assert_eq!(code(c.mkdir("m/n/o", false).await), FsCode::Conflict);
    assert_eq!(code(c.mkdir("x/y", false).await), FsCode::NotFound);
    c.mkdir("x", false).await.unwrap();
    assert_eq!(code(c.mkdir("empty", true).await), FsCode::Conflict);
    assert_eq!(
        code(c.mkdir("empty/sub", true).await),
        FsCode::InvalidArgument
    );
    // Remove, recursively.
    c.remove("d").await.unwrap();
    assert_eq!(code(c.stat("d").await), FsCode::NotFound);
    assert!(!a.root.join("workspace/d").exists());
}

#[tokio::test]
async fn file_errors_have_stable_codes() {
    let Some(a) = start("file_errors_have_stable_codes").await else {
        return;
    };
    let c = &a.client;
    assert_eq!(code(c.read_file("missing", 10).await), FsCode::NotFound);
    assert_eq!(
        code(c.read_file("/workspace", 10).await),
        FsCode::InvalidArgument
    );
    assert_eq!(code(c.read_file("", 10).await), FsCode::InvalidArgument);
    c.write_file("big", &[1u8; 100], u64::MAX).await.unwrap();
    let e = c.read_file("big", 99).await.unwrap_err();
    assert_eq!(e.code, FsCode::PayloadTooLarge, "{e}");
    assert!(e.message.contains("/workspace/big"), "{e}");
    // Over the write limit: nothing written, no temp file left.
    assert_eq!(
        code(c.write_file("w", &[0u8; 11], 10).await),
        FsCode::PayloadTooLarge
    );
    assert_eq!(code(c.stat("w").await), FsCode::NotFound);
    let names: Vec<String> = std::fs::read_dir(a.root.join("workspace"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| !n.starts_with(".sandlot-tmp-")),
        "{names:?}"
    );
    assert_eq!(
        code(c.write_file("/workspace", b"x", 10).await),
        FsCode::InvalidArgument
    );
    assert_eq!(
        code(c.write_file("/workspace/", b"x", 10).await),
        FsCode::InvalidArgument
    );
    // Refused top-level directories, however spelled.
    for p in [
        "/proc/self/environ",
        "/workspace/../proc/1/status",
        "/dev/null",
        "/sys/kernel",
        "/.sandlot/run",
    ] {
        assert_eq!(
            code(c.read_file(p, 10).await),
            FsCode::InvalidArgument,
            "{p}"
        );
        assert_eq!(
            code(c.write_file(p, b"x", 10).await),
            FsCode::InvalidArgument,
            "{p}"
        );
    }
    assert_eq!(code(c.remove("/").await), FsCode::InvalidArgument);
    assert_eq!(code(c.remove("/workspace").await), FsCode::InvalidArgument);
    // Symlinks and `..` stay inside the root.
    std::os::unix::fs::symlink("../../../../outside/secret", a.root.join("workspace/esc")).unwrap();
    assert_eq!(code(c.read_file("esc", 100).await), FsCode::NotFound);
    std::os::unix::fs::symlink("/etc/passwd", a.root.join("workspace/abs")).unwrap();
    assert_eq!(
        c.read_file("abs", 100).await.unwrap(),
        b"root:x:0:0::/root:/bin/sh\n"
    );
    assert_eq!(
        c.read_file("/../../../../etc/passwd", 100).await.unwrap(),
        b"root:x:0:0::/root:/bin/sh\n"
    );
    // Writing through a symlink replaces the link, never the target.
    c.write_file("abs", b"new", 10).await.unwrap();
    assert_eq!(
        std::fs::read(a.root.join("etc/passwd")).unwrap(),
        b"root:x:0:0::/root:/bin/sh\n"
    );
    // The calls act without capabilities: another user's private file is refused.
    std::fs::write(a.root.join("workspace/private"), b"p").unwrap();
    std::os::unix::fs::chown(a.root.join("workspace/private"), Some(1234), Some(1234)).unwrap();
    std::fs::set_permissions(
        a.root.join("workspace/private"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    assert_eq!(
        code(c.read_file("private", 10).await),
        FsCode::PermissionDenied
    );
    std::fs::create_dir(a.root.join("workspace/locked")).unwrap();
    std::os::unix::fs::chown(a.root.join("workspace/locked"), Some(1234), Some(1234)).unwrap();
    std::fs::set_permissions(
        a.root.join("workspace/locked"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    assert_eq!(
        code(c.write_file("locked/x", b"x", 10).await),
        FsCode::PermissionDenied
    );
    assert_eq!(
        code(c.mkdir("locked/d", false).await),
        FsCode::PermissionDenied
    );
    // A procfs mounted inside the root (reached without the /proc name) is refused.
    std::fs::create_dir(a.root.join("workspace/p")).unwrap();
    mount(
        Some("proc"),
        &a.root.join("workspace/p"),
        Some("proc"),
        MsFlags::empty(),
        None::<&str>,
    )
    .expect("mount proc");
    assert_eq!(code(c.list_dir("p").await), FsCode::InvalidArgument);
    assert_eq!(
        code(c.read_file("p/self/status", 1 << 20).await),
        FsCode::InvalidArgument
    );
    assert_eq!(code(c.remove("p").await), FsCode::InvalidArgument);
}

/// Sends one raw request on a fresh HTTP/2 connection; returns (status, body).
async fn raw(sock: &std::path::Path, method: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
    let stream = tokio::net::UnixStream::connect(sock).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://agent{path}"))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, body)
}

#[tokio::test]
async fn junk_file_requests_get_4xx_and_the_agent_survives() {
    let Some(a) = start("junk_file_requests_get_4xx_and_the_agent_survives").await else {
        return;
    };
    let paths = [
        "/v1/files/read",
        "/v1/files/write",
        "/v1/files/list",
        "/v1/files/stat",
        "/v1/files/mkdir",
        "/v1/files/remove",
        "/v1/files/nope",
    ];
    let long = format!("{{\"path\":\"{}\",\"max_bytes\":1}}", "a/".repeat(5000));
    let mut bodies: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"{".to_vec(),
        b"null".to_vec(),
        b"{\"path\":\"a\\u0000b\",\"max_bytes\":1}".to_vec(),
        b"{\"path\":\"\",\"max_bytes\":1}".to_vec(),
        b"{\"path\":\"/proc/1/mem\",\"max_bytes\":1}".to_vec(),
        b"{\"path\":\"x\",\"max_bytes\":-1}".to_vec(),
        b"{\"path\":\"x\",\"unknown\":1}".to_vec(),
        long.into_bytes(),
        vec![9, 0, 0, 0, 0],
        vec![1, 0xff, 0xff, 0xff, 0xff],
        encode(FrameKind::Spec, b"not json"),
        encode(FrameKind::Stdin, b"{}"),
        vec![b'{'; 100 * 1024],
    ];
    for seed in 0..8 {
        bodies.push(pattern(64 + seed * 97));
    }
    for p in paths {
        for b in &bodies {
            for method in ["POST", "GET"] {
                let (status, body) = raw(&a.sock, method, p, b.clone()).await;
                assert!(
                    (400..500).contains(&status),
                    "{method} {p} {:?}: {status}",
                    String::from_utf8_lossy(&b[..b.len().min(40)])
                );
                let e: FsError = serde_json::from_slice(&body).unwrap_or_else(|e| {
                    panic!(
                        "{method} {p}: body is not an FsError ({e}): {:?}",
                        String::from_utf8_lossy(&body)
                    )
                });
                assert_ne!(e.code, FsCode::Internal, "{method} {p}: {e}");
            }
        }
    }
    // Nothing was created by the junk, and the agent still answers.
    assert!(a.client.list_dir("/workspace").await.unwrap().is_empty());
    a.client
        .wait_ready(Instant::now() + Duration::from_secs(2))
        .await
        .unwrap();
}
