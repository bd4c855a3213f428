//! Shared helpers of the router-level tests: a server over the unit-test `FakeNode` (no
//! socket, no root) and one-shot requests through the router.
use crate::{router, AppState, ServerConfig, SharedState};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::Router;
use sandlot_node_fake::FakeNode;
use serde_json::Value;
use std::sync::Arc;
use tower::ServiceExt;

pub(crate) struct T {
    pub(crate) st: SharedState,
    pub(crate) node: Arc<FakeNode>,
    pub(crate) app: Router,
    /// The test's data directory, removed when the test ends (`None`: the test owns it).
    pub(crate) _dir: Option<tempfile::TempDir>,
}

/// A fresh, empty data directory `TMPDIR/sandlot-router-NAME-*`, removed with the guard.
pub(crate) fn data_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("sandlot-router-{name}-"))
        .tempdir()
        .expect("create a temporary data directory")
}

/// A server over `node` with its state in `dir`, which the test owns (for a restart:
/// open a second one on the same directory and node).
pub(crate) fn open_on(dir: &std::path::Path, node: &Arc<FakeNode>) -> T {
    let st = AppState::open(
        ServerConfig::new(dir.to_path_buf()),
        with_processes(dir, node),
    )
    .unwrap();
    let app = router(st.clone());
    T {
        st,
        node: node.clone(),
        app,
        _dir: None,
    }
}

/// `node` with a process table (as `sandlot up` serves its `LocalNode`), its output
/// spilled under `dir`.
pub(crate) fn with_processes(
    dir: &std::path::Path,
    node: &Arc<FakeNode>,
) -> Arc<sandlot_node::WithProcesses> {
    // No free-space reserve: output is kept whatever the test host's disk has free.
    let limits = sandlot_node::processes::ProcessLimits {
        spill_reserve_bytes: 0,
        ..Default::default()
    };
    sandlot_node::WithProcesses::with_limits(node.clone(), limits, dir.join("process-output"))
        .unwrap()
}

pub(crate) fn setup_with(name: &str, f: impl FnOnce(&mut ServerConfig)) -> T {
    let dir = data_dir(name);
    let mut cfg = ServerConfig::new(dir.path().to_path_buf());
    f(&mut cfg);
    let node = Arc::new(FakeNode::default());
    let st = AppState::open(cfg, with_processes(dir.path(), &node)).unwrap();
    let app = router(st.clone());
    T {
        st,
        node,
        app,
        _dir: Some(dir),
    }
}

pub(crate) fn setup(name: &str) -> T {
    setup_with(name, |_| {})
}

pub(crate) struct Resp {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Resp {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub(crate) fn code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap().to_owned()
    }
    pub(crate) fn message(&self) -> String {
        self.json()["error"]["message"].as_str().unwrap().to_owned()
    }
}

pub(crate) async fn raw(
    app: &Router,
    method: Method,
    uri: &str,
    ctype: Option<&str>,
    body: Vec<u8>,
    hdr: &[(&str, &str)],
) -> Resp {
    let mut b = Request::builder().method(method).uri(uri);
    if let Some(c) = ctype {
        b = b.header("content-type", c);
    }
    for (k, v) in hdr {
        b = b.header(*k, *v);
    }
    let resp = app
        .clone()
        .oneshot(b.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    Resp {
        status,
        headers,
        body,
    }
}

pub(crate) async fn call(app: &Router, method: Method, uri: &str, body: Option<Value>) -> Resp {
    match body {
        Some(v) => {
            raw(
                app,
                method,
                uri,
                Some("application/json"),
                serde_json::to_vec(&v).unwrap(),
                &[],
            )
            .await
        }
        None => raw(app, method, uri, None, Vec::new(), &[]).await,
    }
}

pub(crate) async fn post(app: &Router, uri: &str, body: Value) -> Resp {
    call(app, Method::POST, uri, Some(body)).await
}
