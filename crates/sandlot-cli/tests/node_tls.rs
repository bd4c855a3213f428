//! `sandlot node --tls-cert/--tls-key` and `sandlot server --node https://… --node-ca`:
//! certificates from `scripts/node-tls.sh`; a node whose key is not its certificate's does
//! not start; a server without the node's CA does not start (the certificate is refused);
//! with it, it serves. Without the openssl CLI the test prints `SKIPPED: <why>`.
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

mod common;
use common::{Proc, BIN};

/// Runs scripts/node-tls.sh with `args`.
fn node_tls(args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/node-tls.sh");
    let out = Command::new(script).args(args).output().unwrap();
    assert!(out.status.success(), "node-tls.sh {args:?}: {out:?}");
}

/// The first stdout line of `child` (its "listening on" line), read off the test's thread.
async fn first_line(child: &mut Child) -> String {
    let stdout = child.stdout.take().unwrap();
    tokio::task::spawn_blocking(move || {
        let mut l = String::new();
        BufReader::new(stdout).read_line(&mut l).unwrap();
        l.trim().to_owned()
    })
    .await
    .unwrap()
}

/// `sandlot ARGS…` that is expected to fail at start: its output once it exited.
async fn fails(args: Vec<std::ffi::OsString>) -> Output {
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args(args)
            .env("RUST_LOG", "error")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(!out.status.success(), "{out:?}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_reaches_a_tls_node_only_through_its_ca() {
    if Command::new("openssl").arg("version").output().is_err() {
        println!("SKIPPED: no openssl CLI on this host to make test certificates");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (pki, other) = (tmp.path().join("pki"), tmp.path().join("other"));
    let (pki_s, other_s) = (pki.to_str().unwrap(), other.to_str().unwrap());
    node_tls(&["ca", pki_s]);
    node_tls(&["node", pki_s, "n1", "DNS:localhost", "IP:127.0.0.1"]);
    node_tls(&["ca", other_s]);
    node_tls(&["node", other_s, "n1", "DNS:localhost"]);
    let token_file = tmp.path().join("token");
    std::fs::write(&token_file, "tls-n0de-t0ken\n").unwrap();
    let data = tmp.path().join("data");
    let node_args = |key: &Path| -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> =
            ["node", "--listen", "127.0.0.1:0", "--name", "tls-node"]
                .map(Into::into)
                .to_vec();
        for (flag, p) in [
            ("--data-dir", data.as_path()),
            ("--images-dir", &tmp.path().join("images")),
            ("--token-file", &token_file),
            ("--tls-cert", &pki.join("n1.pem")),
            ("--tls-key", key),
        ] {
            v.push(flag.into());
            v.push(p.into());
        }
        v
    };

    // A key that is not the certificate's: the node does not start, and says why.
    let out = fails(node_args(&other.join("n1.key"))).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not the certificate's key"), "{err}");

    let mut child = Command::new(BIN)
        .args(node_args(&pki.join("n1.key")))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let line = first_line(&mut child).await;
    let _node = Proc(child, data.clone());
    let port = line
        .strip_prefix("sandlot node listening on https://127.0.0.1:")
        .unwrap_or_else(|| panic!("first line: {line:?}"));
    let node_url = format!("https://localhost:{port}");
    let server_args = |ca: Option<&Path>, dir: &str| -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> =
            ["server", "--listen", "127.0.0.1:0", "--node", &node_url]
                .map(Into::into)
                .to_vec();
        v.extend(["--data-dir".into(), tmp.path().join(dir).into()]);
        v.extend(["--node-token-file".into(), token_file.clone().into()]);
        if let Some(ca) = ca {
            v.extend(["--node-ca".into(), ca.into()]);
        }
        v
    };

    // Without the CA, or trusting another one: the node's certificate is refused.
    for ca in [None, Some(other.join("ca.pem"))] {
        let out = fails(server_args(ca.as_deref(), "server-refused")).await;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("certificate"), "{err}");
    }

    // With it: the server connects (it asks the node for its info at start) and serves.
    let mut server = Command::new(BIN)
        .args(server_args(Some(&pki.join("ca.pem")), "server"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let line = first_line(&mut server).await;
    let _server = Proc(server, tmp.path().join("server"));
    let url = line
        .strip_prefix("sandlot listening on ")
        .unwrap_or_else(|| panic!("first line: {line:?}"));
    let api = sandlot_client::Client::new(url).unwrap();
    assert!(api.list(&[]).await.unwrap().is_empty());
}
