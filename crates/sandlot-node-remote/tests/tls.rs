//! The node API over TLS ([`serve_tls`], `RemoteNode` to an `https://` URL): the contract
//! suite through TLS, and what a client without the node's CA, with the wrong host, in
//! cleartext or without a handshake gets. Certificates come from `scripts/node-tls.sh` (the
//! openssl CLI); without openssl the tests print `SKIPPED: <why>`.
use sandlot_node_api::{Node, NodeError};
use sandlot_node_fake::FakeNode;
use sandlot_node_remote::AUTH_DEADLINE;
use sandlot_node_remote::{
    router, serve_tls, tls_acceptor, NodeConnector, RemoteNode, RemoteOptions,
};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::with_processes;

/// A CA and a certificate `node` for `sans` under `dir` (scripts/node-tls.sh): `None`
/// (after printing why) without openssl.
fn certs(dir: &Path, sans: &[&str]) -> Option<(Vec<u8>, PathBuf, PathBuf)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/node-tls.sh");
    if std::process::Command::new("openssl")
        .arg("version")
        .output()
        .is_err()
    {
        println!("SKIPPED: no openssl CLI on this host to make test certificates");
        return None;
    }
    let run = |args: &[&str]| {
        let out = std::process::Command::new(&script)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "node-tls.sh {args:?}: {out:?}");
    };
    let d = dir.to_str().unwrap();
    run(&["ca", d]);
    run(&[&["node", d, "node"][..], sans].concat());
    let ca = std::fs::read(dir.join("ca.pem")).unwrap();
    Some((ca, dir.join("node.pem"), dir.join("node.key")))
}

/// `node` served over TLS with `cert`/`key` on 127.0.0.1: its port and the serving task.
async fn start_tls(
    node: Arc<dyn Node>,
    cert: &Path,
    key: &Path,
) -> (u16, tokio::task::JoinHandle<()>) {
    let tls = tls_acceptor(&std::fs::read(cert).unwrap(), &std::fs::read(key).unwrap()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        serve_tls(listener, router(node, Some("tls-t0ken".into())), tls)
            .await
            .unwrap();
    });
    (port, task)
}

fn trusting(ca: &[u8]) -> RemoteOptions {
    RemoteOptions {
        tls_ca_pem: Some(ca.to_vec()),
        ..RemoteOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_over_tls() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((ca, cert, key)) = certs(tmp.path(), &["IP:127.0.0.1"]) else {
        return;
    };
    let fake = Arc::new(FakeNode::default());
    let (port, _server) = start_tls(with_processes(fake.clone()), &cert, &key).await;
    let url = format!("https://127.0.0.1:{port}");
    let remote = RemoteNode::connect_with(&url, Some("tls-t0ken".into()), trusting(&ca))
        .await
        .unwrap();
    assert_eq!(remote.info(), fake.info());
    // Every call, the streamed and full-duplex ones included, through TLS.
    common::run_all(&remote, &common::Profile::fake()).await;
    assert!(fake.execs.lock().unwrap().len() >= 3);
}

/// One connector (one HTTP client, the CA loaded once) reaches several nodes, each over its
/// own connection: every node answers its own calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connector_reaches_several_nodes() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((ca, cert, key)) = certs(tmp.path(), &["IP:127.0.0.1"]) else {
        return;
    };
    let connector = NodeConnector::new(trusting(&ca)).unwrap();
    let mut fakes = Vec::new();
    let mut remotes = Vec::new();
    for _ in 0..3 {
        let fake = Arc::new(FakeNode::default());
        let (port, _server) = start_tls(fake.clone(), &cert, &key).await;
        let url = format!("https://127.0.0.1:{port}");
        remotes.push(
            connector
                .connect(&url, Some("tls-t0ken".into()))
                .await
                .unwrap(),
        );
        fakes.push(fake);
    }
    for (i, r) in remotes.iter().enumerate() {
        r.create(&common::spec(&format!("sb-{i}"))).await.unwrap();
    }
    for (i, f) in fakes.iter().enumerate() {
        let ids: Vec<String> = f.list().await.unwrap().into_iter().map(|s| s.id).collect();
        assert_eq!(ids, [format!("sb-{i}")]);
    }
    // A bad CA is refused when the connector is built, before any node is reached.
    let e = NodeConnector::new(trusting(b"not a certificate")).unwrap_err();
    assert!(matches!(e, NodeError::InvalidArgument(_)), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_cleartext_and_silent_clients_get_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    // The certificate names 127.0.0.2 and localhost, not 127.0.0.1.
    let Some((ca, cert, key)) = certs(tmp.path(), &["IP:127.0.0.2", "DNS:localhost"]) else {
        return;
    };
    let fake = Arc::new(FakeNode::default());
    let (port, server) = start_tls(fake.clone(), &cert, &key).await;
    let token = || Some("tls-t0ken".to_string());

    // Trusted CA, a host the certificate names: served; a wrong token is refused.
    let good = format!("https://localhost:{port}");
    let node = RemoteNode::connect_with(&good, token(), trusting(&ca))
        .await
        .unwrap();
    assert!(node.list().await.unwrap().is_empty());
    let r = RemoteNode::connect_with(&good, Some("wrong".into()), trusting(&ca)).await;
    assert!(matches!(r, Err(NodeError::PermissionDenied(_))), "{r:?}");

    // Only the system's roots: the node's certificate is not trusted.
    let r = RemoteNode::connect(&good, token()).await;
    assert!(
        matches!(&r, Err(NodeError::Transport(m)) if m.contains("certificate")),
        "{r:?}"
    );
    // Trusted CA, but the URL's host is not in the certificate.
    let r = RemoteNode::connect_with(&format!("https://127.0.0.1:{port}"), token(), trusting(&ca))
        .await;
    assert!(matches!(r, Err(NodeError::Transport(_))), "{r:?}");
    // Cleartext HTTP/2 to the TLS port.
    let r = RemoteNode::connect(&format!("http://127.0.0.1:{port}"), token()).await;
    assert!(matches!(r, Err(NodeError::Transport(_))), "{r:?}");
    // A CA file that holds no certificate.
    let r = RemoteNode::connect_with(&good, token(), trusting(b"not a certificate")).await;
    assert!(matches!(r, Err(NodeError::InvalidArgument(_))), "{r:?}");
    // The acceptor refuses a key that is not the certificate's, and non-PEM input.
    let other = tmp.path().join("other");
    certs(&other, &["IP:127.0.0.1"]).unwrap();
    let cert_pem = std::fs::read(&cert).unwrap();
    assert!(tls_acceptor(&cert_pem, &std::fs::read(other.join("node.key")).unwrap()).is_err());
    assert!(tls_acceptor(b"junk", b"junk").is_err());
    // An encrypted key is refused with a message (OpenSSL's default would prompt for a
    // passphrase on a terminal).
    let enc = tmp.path().join("enc.key");
    let out = std::process::Command::new("openssl")
        .args(["pkcs8", "-topk8", "-passout", "pass:secret", "-in"])
        .arg(&key)
        .arg("-out")
        .arg(&enc)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let e = tls_acceptor(&cert_pem, &std::fs::read(&enc).unwrap()).err();
    assert!(
        e.as_deref().is_some_and(|e| e.contains("encrypted")),
        "{e:?}"
    );

    // A connection that never starts a handshake is closed after AUTH_DEADLINE; the node
    // serves on.
    let silent = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let t = Instant::now();
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = silent;
        s.set_read_timeout(Some(AUTH_DEADLINE + Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 16];
        // EOF or a reset: closed by the node. A timeout: still open.
        match s.read(&mut b) {
            Ok(n) => n == 0,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    })
    .await
    .unwrap();
    assert!(closed && t.elapsed() < AUTH_DEADLINE + Duration::from_secs(4));
    assert!(!server.is_finished());
    assert!(node.list().await.unwrap().is_empty());
}
