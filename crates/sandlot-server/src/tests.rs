//! Router-level tests over the unit-test `FakeNode` (no socket, no root).
use crate::fake::FakeNode;
use crate::{lifecycle, router, AppState, ServerConfig, SharedState};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

struct T {
    st: SharedState,
    node: Arc<FakeNode>,
    app: Router,
}

fn data_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("sandlot-router-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn setup_with(name: &str, f: impl FnOnce(&mut ServerConfig)) -> T {
    let mut cfg = ServerConfig::new(data_dir(name));
    f(&mut cfg);
    let node = Arc::new(FakeNode::default());
    let st = AppState::open(cfg, node.clone()).unwrap();
    let app = router(st.clone());
    T { st, node, app }
}

fn setup(name: &str) -> T {
    setup_with(name, |_| {})
}

struct Resp {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    fn code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap().to_owned()
    }
}

async fn raw(
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

async fn call(app: &Router, method: Method, uri: &str, body: Option<Value>) -> Resp {
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

async fn create(t: &T, body: Value) -> String {
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    r.json()["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn lifecycle_create_get_list_delete() {
    let t = setup("life");
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"labels": {"job": "a"}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let sb = r.json();
    let id = sb["id"].as_str().unwrap().to_owned();
    assert!(
        id.starts_with("sb-") && id.len() == 23 && id[3..].chars().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );
    assert_eq!(sb["state"], "running");
    assert_eq!(sb["backend"], "function");
    assert_eq!(sb["image"], "python");
    assert_eq!(
        (
            sb["cpu"].as_f64(),
            sb["memory_mib"].as_u64(),
            sb["disk_mib"].as_u64()
        ),
        (Some(1.0), Some(512), Some(1024))
    );
    assert_eq!(
        (sb["pids_max"].as_u64(), sb["ttl_s"].as_u64()),
        (Some(256), Some(600))
    );
    assert_eq!(sb["node"], "fake-node");
    assert!(sb["expires_at"].is_string());
    assert_eq!(t.node.ids(), vec![id.clone()]);
    let id2 = create(&t, json!({"labels": {"job": "b", "x": "1"}, "ttl_s": 0})).await;

    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(
        (r.status, r.json()["id"].as_str()),
        (StatusCode::OK, Some(id.as_str()))
    );
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id2}"), None).await;
    assert!(r.json()["expires_at"].is_null(), "ttl 0 has no expiry");

    let ids = |r: &Resp| -> Vec<String> {
        r.json()["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let r = call(&t.app, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(ids(&r), [id.clone(), id2.clone()], "oldest first");
    let r = call(&t.app, Method::GET, "/v1/sandboxes?label=job=b", None).await;
    assert_eq!(ids(&r), vec![id2.clone()]);
    let r = call(
        &t.app,
        Method::GET,
        "/v1/sandboxes?label=job=b&label=x=1",
        None,
    )
    .await;
    assert_eq!(ids(&r), vec![id2.clone()]);
    let r = call(
        &t.app,
        Method::GET,
        "/v1/sandboxes?label=job=b&label=x=2",
        None,
    )
    .await;
    assert!(ids(&r).is_empty());
    let r = call(&t.app, Method::GET, "/v1/sandboxes?label=job", None).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
    );

    let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(t.node.ids(), vec![id2.clone()]);
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    for _ in 0..2 {
        let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(
            r.status,
            StatusCode::NO_CONTENT,
            "delete of a gone sandbox is 204"
        );
    }
    let r = call(&t.app, Method::DELETE, "/v1/sandboxes/sb-nope", None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn create_validation_and_rejections_are_json_errors() {
    let t = setup("valid");
    let cases: Vec<(Value, &str)> = vec![
        (json!({"backend": "hyperv"}), "unknown variant"),
        (json!({"cpu": 0.001}), "cpu"),
        (json!({"cpu": 65}), "cpu"),
        (json!({"memory_mib": 8}), "memory_mib"),
        (json!({"memory_mib": 70000}), "memory_mib"),
        (json!({"pids_max": 4}), "pids_max"),
        (json!({"ttl_s": 604801}), "ttl_s"),
        (json!({"network": "host"}), "unknown variant"),
        (json!({"bogus": 1}), "unknown field"),
        (json!({"image": "../etc"}), "image name"),
        (json!({"env": {"A=B": "x"}}), "env key"),
        (json!({"labels": {"k": "v".repeat(2000)}}), "labels value"),
    ];
    for (body, needle) in cases {
        let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(body.clone())).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.code(), "invalid_argument", "{body}");
        let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let many: serde_json::Map<String, Value> =
        (0..300).map(|i| (format!("K{i}"), json!("v"))).collect();
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"env": many})),
    )
    .await;
    assert_eq!(r.code(), "invalid_argument");

    // Invalid JSON, missing and wrong content type: our body, not axum's text.
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        b"{nope".to_vec(),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
    );
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("text/plain"),
        b"{}".to_vec(),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
    );
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        None,
        b"{}".to_vec(),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
    );

    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "t1"})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into())
    );
    // Node errors: unknown image → 404, backend not built → 503; no record left behind.
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": "ubuntu"})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"backend": "vm"})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into())
    );
    assert!(
        t.st.store.list().unwrap().is_empty(),
        "failed creates leave no record"
    );
    assert!(t.node.ids().is_empty());
    // Valid custom values reach the node.
    create(&t, json!({"image": "busybox", "cpu": 0.5, "memory_mib": 64, "pids_max": 16, "env": {"A": "1"}})).await;
    let spec = t.node.creates.lock().unwrap()[0].clone();
    assert_eq!(
        (
            spec.image.as_str(),
            spec.cpu,
            spec.memory_mib,
            spec.pids_max
        ),
        ("busybox", 0.5, 64, 16)
    );
    assert_eq!(spec.env["A"], "1");

    let r = call(&t.app, Method::GET, "/v1/nothing", None).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
}

#[tokio::test]
async fn idempotency_key() {
    let t = setup("idem");
    let body = br#"{"labels": {"a": "1"}, "ttl_s": 60}"#.to_vec();
    let same = br#"{ "ttl_s":60, "labels":{"a":"1"} }"#.to_vec();
    let h = [("idempotency-key", "k-1")];
    let r1 = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        body.clone(),
        &h,
    )
    .await;
    assert_eq!(r1.status, StatusCode::CREATED);
    let r2 = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        same,
        &h,
    )
    .await;
    assert_eq!(r2.status, StatusCode::OK, "replay answers 200");
    assert_eq!(r1.json()["id"], r2.json()["id"]);
    assert_eq!(t.node.creates.lock().unwrap().len(), 1, "created once");
    let r3 = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        br#"{"ttl_s": 61}"#.to_vec(),
        &h,
    )
    .await;
    assert_eq!(
        (r3.status, r3.code()),
        (StatusCode::CONFLICT, "conflict".into())
    );
    // Another key creates another sandbox.
    let r4 = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        body.clone(),
        &[("idempotency-key", "k-2")],
    )
    .await;
    assert_eq!(r4.status, StatusCode::CREATED);
    assert_ne!(r4.json()["id"], r1.json()["id"]);
    // Once the sandbox is gone, a replay says so.
    let id = r1.json()["id"].as_str().unwrap().to_owned();
    call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    let r5 = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        body.clone(),
        &h,
    )
    .await;
    assert_eq!(
        (r5.status, r5.code()),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    // A failed create forgets its key.
    let bad = br#"{"image": "ubuntu"}"#.to_vec();
    let h3 = [("idempotency-key", "k-3")];
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        bad.clone(),
        &h3,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        br#"{}"#.to_vec(),
        &h3,
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "key of a failed create is free again"
    );
}

#[tokio::test]
async fn body_limits_give_413_json() {
    let t = setup_with("limits", |c| {
        c.max_json_bytes = 1024;
        c.max_file_bytes = 4096;
    });
    let big = json!({"labels": {"k": "x".repeat(2000)}});
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(big)).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large".into())
    );
    let id = create(&t, json!({})).await;
    let uri = format!("/v1/sandboxes/{id}/files?path=/workspace/f");
    // Over the JSON limit but under the file limit: accepted.
    let r = raw(&t.app, Method::PUT, &uri, None, vec![7u8; 3000], &[]).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = raw(&t.app, Method::PUT, &uri, None, vec![7u8; 5000], &[]).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large".into())
    );
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["echo", "x".repeat(2000)]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn exec_plain_and_validation() {
    let t = setup("exec");
    let id = create(&t, json!({})).await;
    let uri = format!("/v1/sandboxes/{id}/exec");
    let r = call(
        &t.app,
        Method::POST,
        &uri,
        Some(json!({"cmd": ["echo", "hi", "there"]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert_eq!(
        (v["exit_code"].as_i64(), v["stdout"].as_str()),
        (Some(0), Some("hi there\n"))
    );
    let r = call(
        &t.app,
        Method::POST,
        &uri,
        Some(json!({"cmd": "echo shell"})),
    )
    .await;
    assert_eq!(
        r.json()["exit_code"],
        127,
        "shell string goes to /bin/sh -c, which the fake does not know"
    );
    let r = call(
        &t.app,
        Method::POST,
        &uri,
        Some(json!({"cmd": ["exit", "3"]})),
    )
    .await;
    assert_eq!(
        (r.json()["exit_code"].as_i64(), r.json()["stderr"].as_str()),
        (Some(3), Some("bye"))
    );
    for bad in [json!(0), json!(-1), json!(86401), json!(1e300)] {
        let r = call(
            &t.app,
            Method::POST,
            &uri,
            Some(json!({"cmd": ["echo"], "timeout_s": bad})),
        )
        .await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::BAD_REQUEST, "invalid_argument".into()),
            "{bad}"
        );
    }
    let r = call(&t.app, Method::POST, &uri, Some(json!({"cmd": []}))).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = call(
        &t.app,
        Method::POST,
        &uri,
        Some(json!({"cmd": ["echo"], "step": 1})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into())
    );
    let r = call(&t.app, Method::POST, &uri, Some(json!({"cmd": ["fail"]}))).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::INTERNAL_SERVER_ERROR, "internal".into())
    );
    let r = call(
        &t.app,
        Method::POST,
        &format!("{uri}?stream=maybe"),
        Some(json!({"cmd": ["echo"]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes/sb-0000/exec",
        Some(json!({"cmd": ["echo"]})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    // Not running → 409.
    t.st.store
        .transition(
            &id,
            &[sandlot_api::SandboxState::Running],
            sandlot_api::SandboxState::Lost,
        )
        .unwrap();
    let r = call(&t.app, Method::POST, &uri, Some(json!({"cmd": ["echo"]}))).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::CONFLICT, "conflict".into())
    );
}

#[tokio::test]
async fn exec_stream_framing() {
    let t = setup("stream");
    let id = create(&t, json!({})).await;
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec?stream=true"),
        Some(json!({"cmd": ["chunks", "3"]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["content-type"], "application/x-ndjson");
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    assert!(text.ends_with('\n'));
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5, "{text}");
    for (i, l) in lines[..3].iter().enumerate() {
        assert_eq!(
            (l["type"].as_str(), l["data"].as_str()),
            (Some("stdout"), Some(format!("line {i}\n").as_str()))
        );
    }
    assert_eq!(lines[3]["type"], "stderr");
    assert_eq!(
        lines[3]["data_b64"], "//4=",
        "non-UTF-8 chunk carries exact bytes"
    );
    let exit = &lines[4];
    assert_eq!(exit["type"], "exit");
    assert_eq!(exit["result"]["exit_code"], 3);
    assert_eq!(exit["result"]["stdout"], "", "text already streamed");
    assert!(exit["result"].get("stderr_b64").is_none());
    assert_eq!(
        (
            exit["result"]["stdout_bytes"].as_u64(),
            exit["result"]["stderr_bytes"].as_u64()
        ),
        (Some(21), Some(2))
    );
    // A node failure ends the stream with one error line.
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec?stream=true"),
        Some(json!({"cmd": ["fail"]})),
    )
    .await;
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(
        (
            lines[0]["type"].as_str(),
            lines[0]["error"]["code"].as_str()
        ),
        (Some("error"), Some("internal"))
    );
}

#[tokio::test]
async fn files_roundtrip() {
    let t = setup("files");
    let id = create(&t, json!({})).await;
    let base = format!("/v1/sandboxes/{id}/files");
    let data: Vec<u8> = (0..=255u8).collect();
    let r = raw(
        &t.app,
        Method::PUT,
        &format!("{base}?path=/workspace/a%20b.bin"),
        Some("application/octet-stream"),
        data.clone(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(
        &t.app,
        Method::GET,
        &format!("{base}?path=/workspace/a%20b.bin"),
        None,
    )
    .await;
    assert_eq!(
        (r.status, r.headers["content-type"].to_str().unwrap()),
        (StatusCode::OK, "application/octet-stream")
    );
    assert_eq!(r.body.to_vec(), data);
    let r = call(
        &t.app,
        Method::GET,
        &format!("{base}/list?path=/workspace"),
        None,
    )
    .await;
    let e = &r.json()["entries"][0];
    assert_eq!(
        (e["name"].as_str(), e["type"].as_str(), e["size"].as_u64()),
        (Some("a b.bin"), Some("file"), Some(256))
    );
    let r = call(
        &t.app,
        Method::DELETE,
        &format!("{base}?path=/workspace/a%20b.bin"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(
        &t.app,
        Method::GET,
        &format!("{base}?path=/workspace/a%20b.bin"),
        None,
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    for uri in [
        base.clone(),
        format!("{base}/list"),
        format!("{base}?path="),
    ] {
        let r = call(&t.app, Method::GET, &uri, None).await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::BAD_REQUEST, "invalid_argument".into()),
            "{uri}"
        );
    }
    let r = raw(
        &t.app,
        Method::PUT,
        &format!("{base}?path=/../x"),
        None,
        b"x".to_vec(),
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
    );
    let r = call(
        &t.app,
        Method::GET,
        "/v1/sandboxes/sb-x/files?path=/a",
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn delete_during_create_rolls_back() {
    let t = setup("race");
    *t.node.create_delay.lock().unwrap() = Duration::from_millis(400);
    let app = t.app.clone();
    let creator =
        tokio::spawn(
            async move { call(&app, Method::POST, "/v1/sandboxes", Some(json!({}))).await },
        );
    // Wait until the record exists in state creating.
    let id = loop {
        if let Some(r) = t.st.store.list().unwrap().into_iter().next() {
            break r.id;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.json()["state"], "creating");
    // The reaper leaves an in-flight create to its creator.
    let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(lifecycle::reap_once(&t.st).await.is_empty());
    let r = creator.await.unwrap();
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::CONFLICT, "conflict".into())
    );
    assert!(t.node.ids().is_empty(), "rolled back on the node");
    assert!(t.node.deleted.lock().unwrap().contains(&id));
    assert!(t.st.store.list().unwrap().is_empty(), "record removed");
}

#[tokio::test]
async fn ttl_reaper_and_keepalive() {
    let t = setup("ttl");
    let a = create(&t, json!({"ttl_s": 1})).await;
    let b = create(&t, json!({"ttl_s": 1})).await;
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{b}/keepalive"),
        Some(json!({"ttl_s": 100})),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["ttl_s"].as_u64()),
        (StatusCode::OK, Some(100))
    );
    let exp =
        chrono::DateTime::parse_from_rfc3339(r.json()["expires_at"].as_str().unwrap()).unwrap();
    let left = exp.timestamp_millis() - crate::now_ms();
    assert!((98_000..=100_000).contains(&left), "{left}");
    assert!(
        lifecycle::reap_once(&t.st).await.is_empty(),
        "nothing due yet"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(lifecycle::reap_once(&t.st).await, vec![a.clone()]);
    assert_eq!(t.node.ids(), vec![b.clone()]);
    // Empty body keeps the sandbox's ttl; 0 removes the expiry.
    let r = raw(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{b}/keepalive"),
        None,
        vec![],
        &[],
    )
    .await;
    assert_eq!(
        (r.status, r.json()["ttl_s"].as_u64()),
        (StatusCode::OK, Some(100))
    );
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{b}/keepalive"),
        Some(json!({"ttl_s": 0})),
    )
    .await;
    assert!(r.json()["expires_at"].is_null());
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{b}/keepalive"),
        Some(json!({"ttl_s": 604801})),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{a}/keepalive"),
        Some(json!({})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn restart_readopts_running_records() {
    let dir = data_dir("restart");
    let node = Arc::new(FakeNode::default());
    let (a, b) = {
        let st = AppState::open(ServerConfig::new(dir.clone()), node.clone()).unwrap();
        let app = router(st.clone());
        let t = T {
            st,
            node: node.clone(),
            app,
        };
        (create(&t, json!({})).await, create(&t, json!({})).await)
    };
    // The node lost `b` (e.g. its processes died with the host).
    node.sandboxes.lock().unwrap().remove(&b);
    let st = AppState::open(ServerConfig::new(dir), node.clone()).unwrap();
    assert_eq!(
        st.store.list().unwrap().len(),
        2,
        "records survived the restart"
    );
    lifecycle::recover(&st).await.unwrap();
    let ids: Vec<_> = st.store.list().unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![a.clone()]);
    assert_eq!(node.ids(), [a]);
}

async fn run_code(t: &T, body: Value) -> Value {
    let r = call(&t.app, Method::POST, "/run_code", Some(body)).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    r.json()
}

#[tokio::test]
async fn run_code_verdicts_and_cleanup() {
    let t = setup("runcode");
    let v = run_code(
        &t,
        json!({"code": "print(input())", "language": "python", "stdin": "hello",
        "files": {"data/in.txt": "aGk="}, "fetch_files": ["out.txt", "missing.txt"]}),
    )
    .await;
    assert_eq!(v["status"], "Success", "{v}");
    assert_eq!(v["run_result"]["status"], "Finished");
    assert_eq!(v["run_result"]["stdout"], "hello");
    assert_eq!(v["run_result"]["return_code"], 0);
    assert_eq!(v["run_result"]["execution_time"], 0.012);
    assert!(v["compile_result"].is_null());
    assert_eq!(v["files"], json!({"out.txt": "bWFkZQ=="}));
    assert_eq!(v["executor_pod_name"], "fake-node");
    let spec = t.node.creates.lock().unwrap()[0].clone();
    assert_eq!((spec.image.as_str(), spec.memory_mib), ("python", 512));

    let v = run_code(
        &t,
        json!({"code": "raise", "language": "python", "memory_limit_MB": 128}),
    )
    .await;
    assert_eq!(
        (
            v["status"].as_str(),
            v["run_result"]["status"].as_str(),
            v["run_result"]["return_code"].as_i64()
        ),
        (Some("Failed"), Some("Finished"), Some(1))
    );
    assert_eq!(t.node.creates.lock().unwrap()[1].memory_mib, 128);
    let v = run_code(
        &t,
        json!({"code": "loop", "language": "python", "run_timeout": 1}),
    )
    .await;
    assert_eq!(
        (v["status"].as_str(), v["run_result"]["status"].as_str()),
        (Some("Failed"), Some("TimeLimitExceeded"))
    );
    let v = run_code(&t, json!({"code": "syntax error", "language": "cpp"})).await;
    assert_eq!(
        (v["status"].as_str(), v["compile_result"]["status"].as_str()),
        (Some("Failed"), Some("Finished"))
    );
    assert!(v["run_result"].is_null());
    let v = run_code(&t, json!({"code": "int main(){}", "language": "cpp"})).await;
    assert_eq!(
        (v["status"].as_str(), v["run_result"]["stdout"].as_str()),
        (Some("Success"), Some("42\n"))
    );
    for bad in [
        json!({"code": "x", "language": "cobol"}),
        json!({"code": "x", "language": "python", "files": {"a": "!!"}}),
        json!({"code": "x", "language": "python", "run_timeout": 0}),
    ] {
        let r = call(&t.app, Method::POST, "/run_code", Some(bad.clone())).await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::BAD_REQUEST, "invalid_argument".into()),
            "{bad}"
        );
    }
    let r = call(
        &t.app,
        Method::POST,
        "/run_code",
        Some(json!({"language": "python"})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
    );
    assert!(t.node.ids().is_empty(), "every run_code sandbox deleted");
    assert!(t.st.store.list().unwrap().is_empty());
}

#[tokio::test]
async fn run_code_admission() {
    let t = setup_with("admit", |c| {
        c.run_code_concurrency = 1;
        c.run_code_queue = 1;
        c.run_code_wait = Duration::from_millis(300);
    });
    let held = t.st.run_code_gate.admit(Duration::ZERO).await.unwrap();
    let app = t.app.clone();
    let waiter = tokio::spawn(async move {
        call(
            &app,
            Method::POST,
            "/run_code",
            Some(json!({"code": "1", "language": "python"})),
        )
        .await
    });
    while t.st.run_code_gate.load().1 == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = call(
        &t.app,
        Method::POST,
        "/run_code",
        Some(json!({"code": "1", "language": "python"})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::TOO_MANY_REQUESTS, "resource_exhausted".into())
    );
    assert_eq!(r.headers["retry-after"], "1");
    let r = waiter.await.unwrap();
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded".into())
    );
    assert_eq!(r.headers["retry-after"], "1");
    drop(held);
    let r = call(
        &t.app,
        Method::POST,
        "/run_code",
        Some(json!({"code": "1", "language": "python"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(t.st.run_code_gate.load(), (0, 0));
}

#[tokio::test]
async fn health_routes() {
    let t = setup("health");
    let r = call(&t.app, Method::GET, "/v1/ping", None).await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"pong"[..]));
    let r = call(&t.app, Method::GET, "/healthz", None).await;
    let v = r.json();
    assert_eq!(
        (
            v["status"].as_str(),
            v["node"].as_str(),
            v["cgroup_version"].as_str()
        ),
        (Some("ok"), Some("fake-node"), Some("v1"))
    );
    assert_eq!(v["backends"]["vm"], "unavailable: no kvm");
    let r = call(&t.app, Method::GET, "/openapi.json", None).await;
    let doc = r.json();
    assert_eq!(doc["openapi"], "3.1.0");
    for route in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}",
        "/v1/sandboxes/{id}/keepalive",
        "/v1/sandboxes/{id}/exec",
        "/v1/sandboxes/{id}/files",
        "/v1/sandboxes/{id}/files/list",
        "/run_code",
        "/v1/ping",
        "/healthz",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(
            doc["paths"][route].is_object(),
            "{route} missing from openapi.json"
        );
    }
    create(&t, json!({})).await;
    let r = call(&t.app, Method::GET, "/metrics", None).await;
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    assert!(
        text.contains("sandlot_sandboxes{backend=\"function\",state=\"running\"} 1"),
        "{text}"
    );
}
