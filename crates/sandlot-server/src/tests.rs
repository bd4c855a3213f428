//! Router-level tests over the unit-test `FakeNode` (no socket, no root).
use crate::test_support::*;
use crate::{lifecycle, AppState, ServerConfig};
use axum::http::{Method, StatusCode};
use sandlot_node_fake::FakeNode;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

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
        (json!({"network": {"allow": []}}), "at least one entry"),
        (
            json!({"network": {"allow": ["10.1.2.3/24"]}}),
            "network.allow entry \"10.1.2.3/24\": host bits are set",
        ),
        (json!({"network": {"allow": ["*.org"]}}), "two labels"),
        (json!({"network": {"allow": ["::1"]}}), "IPv6"),
        (json!({"network": {"deny": ["a.example"]}}), "unknown field"),
        (json!({"bogus": 1}), "unknown field"),
        (json!({"image": "../etc"}), "image name"),
        (json!({"env": {"A=B": "x"}}), "env key"),
        (json!({"labels": {"k": "v".repeat(2000)}}), "labels value"),
        (
            json!({"labels": {"sandlot.kind": "run_code"}}),
            "prefix \"sandlot.\" is reserved",
        ),
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
        Some(json!({"trajectory": "bad id!"})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
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
        t.st.store.list().await.unwrap().is_empty(),
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
    // `step` on a sandbox without a trajectory.
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::BAD_REQUEST, "invalid_argument".into())
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
        .await
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
        if let Some(r) = t.st.store.list().await.unwrap().into_iter().next() {
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
    assert!(
        t.st.store.list().await.unwrap().is_empty(),
        "record removed"
    );
}

#[tokio::test]
async fn a_sandbox_whose_liveness_is_unknown_is_not_marked_lost() {
    // The node's own error (EMFILE reading /proc) proves nothing: the sandbox stays running.
    let t = setup("unknown-liveness");
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    let id = r.json()["id"].as_str().unwrap().to_owned();
    t.node.unknown.lock().unwrap().insert(
        id.clone(),
        "read /proc/42/stat: Too many open files (os error 24)".into(),
    );
    for _ in 0..3 {
        lifecycle::reap_once(&t.st).await;
    }
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.json()["state"], "running");
    let r = call(
        &t.app,
        Method::GET,
        &format!("/v1/events?sandbox={id}&kind=lost"),
        None,
    )
    .await;
    assert!(r.json()["events"].as_array().unwrap().is_empty());
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["true"]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn a_node_transport_failure_is_unavailable_and_never_lost() {
    // The link to a (remote) node breaks: its calls' outcome is unknown. Even a sandbox the
    // node would report dead stays `running` until the node answers; calls answer 503.
    let t = setup("transport-unknown");
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    let id = r.json()["id"].as_str().unwrap().to_owned();
    t.node.dead.lock().unwrap().insert(id.clone());
    *t.node.link_down.lock().unwrap() = Some("connection reset by peer".into());
    for _ in 0..3 {
        lifecycle::reap_once(&t.st).await;
    }
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.json()["state"], "running");
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["true"]})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into())
    );
    assert!(r.message().contains("outcome unknown"), "{}", r.message());
    // The node answers again and says dead: now it is lost.
    *t.node.link_down.lock().unwrap() = None;
    lifecycle::reap_once(&t.st).await;
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.json()["state"], "lost");
}

#[tokio::test]
async fn a_create_whose_outcome_is_unknown_is_deleted_on_the_node_by_the_reaper() {
    // The link breaks while the node creates: the sandbox may exist there. The call fails
    // 503, the record waits as `deleting` (not counted, not listed as running) and the
    // reaper deletes it on the node once the link is back.
    let t = setup("create-transport");
    *t.node.link_down.lock().unwrap() = Some("connection reset by peer".into());
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into())
    );
    let recs = t.st.store.list().await.unwrap();
    assert_eq!(recs.len(), 1, "{recs:?}");
    assert_eq!(recs[0].state, sandlot_api::SandboxState::Deleting);
    let id = recs[0].id.clone();
    // As if the node had made it before the answer was lost.
    t.node
        .sandboxes
        .lock()
        .unwrap()
        .insert(id.clone(), Default::default());
    lifecycle::reap_once(&t.st).await; // link still down: kept for the next pass
    assert_eq!(t.st.store.list().await.unwrap().len(), 1);
    *t.node.link_down.lock().unwrap() = None;
    lifecycle::reap_once(&t.st).await;
    assert!(t.st.store.list().await.unwrap().is_empty());
    assert!(t.node.ids().is_empty(), "{:?}", t.node.ids());
}

#[tokio::test]
async fn a_sandbox_that_died_under_its_node_is_marked_lost() {
    let t = setup("lost");
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    let id = r.json()["id"].as_str().unwrap().to_owned();
    lifecycle::reap_once(&t.st).await;
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.json()["state"], "running");
    t.node.dead.lock().unwrap().insert(id.clone());
    lifecycle::reap_once(&t.st).await;
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.json()["state"], "lost");
    let r = call(
        &t.app,
        Method::GET,
        &format!("/v1/events?sandbox={id}&kind=lost"),
        None,
    )
    .await;
    assert_eq!(
        r.json()["events"].as_array().unwrap().len(),
        1,
        "{:?}",
        r.json()
    );
    // Only delete remains, and it works.
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["true"]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
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
    let tmp = data_dir("restart");
    let dir = tmp.path().to_path_buf();
    let node = Arc::new(FakeNode::default());
    let (a, b) = {
        let t = open_on(&dir, &node);
        (create(&t, json!({})).await, create(&t, json!({})).await)
    };
    // The node lost `b` (e.g. its processes died with the host).
    node.sandboxes.lock().unwrap().remove(&b);
    let st = AppState::open(ServerConfig::new(dir), node.clone()).unwrap();
    assert_eq!(
        st.store.list().await.unwrap().len(),
        2,
        "records survived the restart"
    );
    lifecycle::recover(&st).await.unwrap();
    let ids: Vec<_> = st
        .store
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, vec![a.clone()]);
    assert_eq!(node.ids(), [a]);
}

#[tokio::test]
async fn restart_forgets_the_keys_of_creates_it_cut_off() {
    // A create cut off by a kill -9 (its record still `creating`, nothing on the node)
    // failed: a retry with its Idempotency-Key creates anew (it answered 404 "gone").
    let tmp = data_dir("cutcreate");
    let dir = tmp.path().to_path_buf();
    let node = Arc::new(FakeNode::default());
    async fn post(t: &T) -> Resp {
        let h = [("idempotency-key", "k-cut")];
        let json = Some("application/json");
        raw(
            &t.app,
            Method::POST,
            "/v1/sandboxes",
            json,
            b"{}".to_vec(),
            &h,
        )
        .await
    }
    let first = {
        let t = open_on(&dir, &node);
        let r = post(&t).await;
        assert_eq!(r.status, StatusCode::CREATED);
        let id = r.json()["id"].as_str().unwrap().to_string();
        let back = [sandlot_api::SandboxState::Running];
        let creating = sandlot_api::SandboxState::Creating;
        assert!(t.st.store.transition(&id, &back, creating).await.unwrap());
        node.sandboxes.lock().unwrap().remove(&id);
        id
    };
    let t = open_on(&dir, &node);
    lifecycle::recover(&t.st).await.unwrap();
    assert!(t.st.store.list().await.unwrap().is_empty());
    let r = post(&t).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    assert_ne!(r.json()["id"].as_str().unwrap(), first);
}

#[tokio::test]
async fn restart_deletes_run_code_sandboxes_instead_of_readopting_them() {
    // A run_code call cut off by a crash of the server: nobody can read its answer, so its
    // sandbox (label `sandlot.kind=run_code`) must not live on until its TTL.
    let tmp = data_dir("restart-runcode");
    let dir = tmp.path().to_path_buf();
    let node = Arc::new(FakeNode::default());
    let (a, b) = {
        let t = open_on(&dir, &node);
        (
            create(&t, json!({"labels": {"job": "j"}})).await,
            // As run_code makes it: the label is Sandlot's own (a client may not set it).
            crate::sandboxes::create_sandbox(
                &t.st,
                &crate::auth::Principal::anonymous(),
                sandlot_api::CreateSandboxRequest {
                    ttl_s: Some(86400),
                    ..Default::default()
                },
                [("sandlot.kind".to_owned(), "run_code".to_owned())].into(),
                None,
            )
            .await
            .unwrap()
            .0
            .id,
        )
    };
    let st = AppState::open(ServerConfig::new(dir), node.clone()).unwrap();
    lifecycle::recover(&st).await.unwrap();
    let ids: Vec<_> = st
        .store
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, vec![a.clone()], "{b} was re-adopted");
    assert_eq!(node.ids(), [a], "the node still holds {b}");
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
    assert!(t.st.store.list().await.unwrap().is_empty());
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
        "/v1/sandboxes/{id}/files/stat",
        "/v1/sandboxes/{id}/files/mkdir",
        "/run_code",
        "/v1/ping",
        "/healthz",
        "/metrics",
        "/openapi.json",
        "/v1/sandboxes:pause",
        "/v1/sandboxes:resume",
        "/v1/trajectories/{id}",
        "/v1/timeline",
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
    // The create above is in one of the two newest buckets of the timeline (a bucket may
    // have begun between the create and this call).
    let tl = call(&t.app, Method::GET, "/v1/timeline", None).await.json();
    assert_eq!(tl["bucket_s"], 10);
    let points = tl["points"].as_array().unwrap();
    assert_eq!(points.len(), crate::timeline::BUCKETS);
    let recent: f64 = points[points.len() - 2..]
        .iter()
        .map(|p| p["creates_per_s"].as_f64().unwrap())
        .sum();
    assert!(recent >= 0.1, "{tl}");
}

// ---- trajectory log and pause/resume (issue 4) ----

async fn exec_step(t: &T, id: &str, body: Value) -> Resp {
    call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(body),
    )
    .await
}

fn node_execs(t: &T) -> usize {
    t.node.execs.lock().unwrap().len()
}

#[tokio::test]
async fn trajectory_replay_divergence_gap_and_no_trajectory() {
    let t = setup("traj-rules");
    let id = create(&t, json!({"trajectory": "job-42/ep-7"})).await;
    let r = exec_step(&t, &id, json!({"cmd": ["append", "a"], "step": 0})).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["stdout"], "1\n");
    assert_eq!(r.json()["replayed"], false);
    // Same step, same request: the logged result, nothing executed.
    let before = node_execs(&t);
    let r = exec_step(&t, &id, json!({"cmd": ["append", "a"], "step": 0})).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["stdout"], "1\n");
    assert_eq!(r.json()["replayed"], true);
    assert_eq!(
        node_execs(&t),
        before,
        "a replayed step must not reach the node"
    );
    // Next step runs for real.
    let r = exec_step(&t, &id, json!({"cmd": ["append", "b"], "step": 1})).await;
    assert_eq!(r.json()["stdout"], "2\n");
    assert_eq!(r.json()["replayed"], false);
    // Divergence: 409 naming both digests.
    let r = exec_step(&t, &id, json!({"cmd": ["append", "OTHER"], "step": 0})).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.starts_with("step 0 diverges: logged digest "), "{msg}");
    let digests: Vec<&str> = msg
        .split(|c: char| !c.is_ascii_hexdigit())
        .filter(|w| w.len() == 64)
        .collect();
    assert_eq!(digests.len(), 2, "{msg}");
    assert_ne!(digests[0], digests[1]);
    // Gap: 400.
    let r = exec_step(&t, &id, json!({"cmd": ["append", "c"], "step": 5})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.code(), "invalid_argument");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("step 5 is beyond the next step 2 of trajectory job-42/ep-7"));
    // No step: runs unlogged (escape hatch).
    let r = exec_step(&t, &id, json!({"cmd": ["append", "x"]})).await;
    assert_eq!(r.json()["stdout"], "3\n");
    // Step on a sandbox without trajectory: 400.
    let plain = create(&t, json!({})).await;
    let r = exec_step(&t, &plain, json!({"cmd": ["echo", "hi"], "step": 0})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.code(), "invalid_argument");
    let r = raw(
        &t.app,
        Method::PUT,
        &format!("/v1/sandboxes/{plain}/files?path=/workspace/a&step=0"),
        None,
        b"x".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // Bad trajectory ids.
    for bad in ["", "a b", &"x".repeat(201)] {
        let r = call(
            &t.app,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"trajectory": bad})),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad:?}");
    }
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"restore": "replay"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // GET shows the log.
    let r = call(&t.app, Method::GET, "/v1/trajectories/job-42%2Fep-7", None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let info = r.json();
    assert_eq!(info["id"], "job-42/ep-7");
    assert_eq!(info["sandbox_id"], id.as_str());
    assert_eq!(info["next_step"], 2);
    assert_eq!(info["replayed_total"], 1);
    let steps = info["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0]["kind"], "exec");
    assert_eq!(steps[0]["exit_code"], 0);
    assert_eq!(steps[0]["replay_count"], 1);
    assert_eq!(steps[1]["replay_count"], 0);
    assert_eq!(steps[0]["digest"].as_str().unwrap(), digests[0]);
    // Unencoded slashes reach the same trajectory (wildcard route).
    let r = call(&t.app, Method::GET, "/v1/trajectories/job-42/ep-7", None).await;
    assert_eq!(r.json()["next_step"], 2);
    let r = call(&t.app, Method::GET, "/v1/trajectories/nope", None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn trajectory_files_steps_and_replayed_header() {
    let t = setup("traj-files");
    let id = create(&t, json!({"trajectory": "files-1"})).await;
    let url = |p: &str, s: u64| format!("/v1/sandboxes/{id}/files?path={p}&step={s}");
    let r = raw(
        &t.app,
        Method::PUT,
        &url("/workspace/a", 0),
        None,
        b"one".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(r.headers.get("sandlot-replayed").is_none());
    // Replay of the write: 204 with the header, the file is not written again.
    t.node
        .sandboxes
        .lock()
        .unwrap()
        .get_mut(&id)
        .unwrap()
        .insert("/workspace/a".into(), b"changed".to_vec());
    let r = raw(
        &t.app,
        Method::PUT,
        &url("/workspace/a", 0),
        None,
        b"one".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(r.headers["sandlot-replayed"], "true");
    assert_eq!(
        t.node.sandboxes.lock().unwrap()[&id]["/workspace/a"],
        b"changed"
    );
    // Other data under the same step diverges.
    let r = raw(
        &t.app,
        Method::PUT,
        &url("/workspace/a", 0),
        None,
        b"two".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    // A read with step is logged and replayed with its logged bytes.
    let r = raw(
        &t.app,
        Method::GET,
        &url("/workspace/a", 1),
        None,
        vec![],
        &[],
    )
    .await;
    assert_eq!(&r.body[..], b"changed");
    t.node
        .sandboxes
        .lock()
        .unwrap()
        .get_mut(&id)
        .unwrap()
        .insert("/workspace/a".into(), b"third".to_vec());
    let r = raw(
        &t.app,
        Method::GET,
        &url("/workspace/a", 1),
        None,
        vec![],
        &[],
    )
    .await;
    assert_eq!(&r.body[..], b"changed");
    assert_eq!(r.headers["sandlot-replayed"], "true");
    // A failing call is not logged: removing a missing file is 404 and step 2 stays next.
    let r = raw(
        &t.app,
        Method::DELETE,
        &url("/workspace/missing", 2),
        None,
        vec![],
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = raw(
        &t.app,
        Method::DELETE,
        &url("/workspace/a", 2),
        None,
        vec![],
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = raw(
        &t.app,
        Method::GET,
        &format!("/v1/sandboxes/{id}/files/list?path=/workspace&step=3"),
        None,
        vec![],
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let kinds: Vec<String> = call(&t.app, Method::GET, "/v1/trajectories/files-1", None)
        .await
        .json()["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        kinds,
        ["write_file", "read_file", "remove_file", "list_dir"]
    );
    // Large exec output goes through the blob table and comes back byte-exact.
    let r = exec_step(&t, &id, json!({"cmd": ["big", "5000"], "step": 4})).await;
    let first = r.json();
    let r = exec_step(&t, &id, json!({"cmd": ["big", "5000"], "step": 4})).await;
    let again = r.json();
    assert_eq!(again["replayed"], true);
    assert_eq!(again["stdout"], first["stdout"]);
    assert_eq!(again["stdout"].as_str().unwrap().len(), 5000);
    assert_eq!(again["stderr_b64"], first["stderr_b64"]);
    assert!(again["stderr_b64"].is_string());
}

#[tokio::test]
async fn trajectory_reattach_restore_fail_and_replay() {
    let t = setup("traj-restore");
    let body = json!({"trajectory": "T1", "labels": {"job": "j"}});
    let id = create(&t, body.clone()).await;
    // Reattach: the same sandbox, 200, whatever the other fields say.
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "T1", "image": "busybox"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["id"], id.as_str());
    // Log: write code=0, append, code (exit 0), write file, remove it.
    let put = |p: &str, s: u64| format!("/v1/sandboxes/{id}/files?path={p}&step={s}");
    raw(
        &t.app,
        Method::PUT,
        &put("/workspace/code", 0),
        None,
        b"0".to_vec(),
        &[],
    )
    .await;
    exec_step(&t, &id, json!({"cmd": ["append", "a"], "step": 1})).await;
    let r = exec_step(&t, &id, json!({"cmd": ["code"], "step": 2})).await;
    assert_eq!(r.json()["exit_code"], 0);
    raw(
        &t.app,
        Method::PUT,
        &put("/workspace/tmp", 3),
        None,
        b"t".to_vec(),
        &[],
    )
    .await;
    raw(
        &t.app,
        Method::DELETE,
        &put("/workspace/tmp", 4),
        None,
        vec![],
        &[],
    )
    .await;
    raw(
        &t.app,
        Method::GET,
        &put("/workspace/code", 5),
        None,
        vec![],
        &[],
    )
    .await;

    // The sandbox is lost.
    let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(&t.app, Method::GET, "/v1/trajectories/T1", None).await;
    assert_eq!(r.json()["sandbox_id"], Value::Null);
    // restore=fail (default): 409 with the documented message.
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "T1"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains(
        "trajectory T1 has 6 logged steps but its sandbox is gone; create with restore=\"replay\" to rebuild it"
    ));
    // restore=replay: a new sandbox with the mutating steps re-executed (not the read).
    let execs_before = node_execs(&t);
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "T1", "restore": "replay"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let sb = r.json();
    let id2 = sb["id"].as_str().unwrap().to_owned();
    assert_ne!(id2, id);
    assert_eq!(sb["trajectory"], "T1");
    assert_eq!(
        sb["restore"],
        json!({"replayed_steps": 5, "mismatches": []})
    );
    assert_eq!(node_execs(&t) - execs_before, 2);
    let files = t.node.sandboxes.lock().unwrap()[&id2].clone();
    assert_eq!(files["/workspace/log"], b"a\n");
    assert_eq!(files["/workspace/code"], b"0");
    assert!(!files.contains_key("/workspace/tmp"));
    // The log is unchanged and the trainer's replay now comes from it.
    let r = exec_step(&t, &id2, json!({"cmd": ["append", "a"], "step": 1})).await;
    assert_eq!(r.json()["replayed"], true);
    let r = call(&t.app, Method::GET, "/v1/trajectories/T1", None).await;
    assert_eq!(r.json()["next_step"], 6);
    assert_eq!(r.json()["sandbox_id"], id2.as_str());
    // A plain create (no restore) now reattaches to the restored sandbox.
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "T1"})),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["id"].as_str().unwrap()),
        (StatusCode::OK, id2.as_str())
    );
    assert!(r.json().get("restore").is_none());

    // Mismatch: the restored environment differs (the node starts each sandbox with a
    // file that makes `code` exit 3), reported, not fatal.
    call(
        &t.app,
        Method::DELETE,
        &format!("/v1/sandboxes/{id2}"),
        None,
    )
    .await;
    let mut log = Vec::new();
    {
        let r = call(&t.app, Method::GET, "/v1/trajectories/T1", None).await;
        for s in r.json()["steps"].as_array().unwrap() {
            log.push(s["digest"].as_str().unwrap().to_owned());
        }
    }
    // Change the logged write of step 0 is impossible (log is immutable); instead make the
    // re-executed `code` see another file by writing it before: use a fresh trajectory.
    let id3 = create(&t, json!({"trajectory": "T2"})).await;
    let put3 = |p: &str, s: u64| format!("/v1/sandboxes/{id3}/files?path={p}&step={s}");
    raw(
        &t.app,
        Method::PUT,
        &put3("/workspace/code", 0),
        None,
        b"3".to_vec(),
        &[],
    )
    .await;
    let r = exec_step(&t, &id3, json!({"cmd": ["code"], "step": 1})).await;
    assert_eq!(r.json()["exit_code"], 3);
    // Unlogged write (no step) changes the state behind the log's back.
    raw(
        &t.app,
        Method::PUT,
        &format!("/v1/sandboxes/{id3}/files?path=/workspace/code"),
        None,
        b"0".to_vec(),
        &[],
    )
    .await;
    let r = exec_step(&t, &id3, json!({"cmd": ["code"], "step": 2})).await;
    assert_eq!(r.json()["exit_code"], 0);
    call(
        &t.app,
        Method::DELETE,
        &format!("/v1/sandboxes/{id3}"),
        None,
    )
    .await;
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "T2", "restore": "replay"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(
        r.json()["restore"],
        json!({"replayed_steps": 3, "mismatches": [{"step": 2, "logged_exit_code": 0, "exit_code": 3}]})
    );
    assert_eq!(log.len(), 6);
}

#[tokio::test]
async fn trajectory_delete_log_and_concurrent_same_step() {
    let t = setup("traj-delete");
    let id = create(&t, json!({"trajectory": "D"})).await;
    // Two calls with the same step at once: exactly one executes.
    let a = exec_step(&t, &id, json!({"cmd": ["append", "x"], "step": 0}));
    let b = exec_step(&t, &id, json!({"cmd": ["append", "x"], "step": 0}));
    let (a, b) = tokio::join!(a, b);
    let mut replayed = [
        a.json()["replayed"].as_bool().unwrap(),
        b.json()["replayed"].as_bool().unwrap(),
    ];
    replayed.sort();
    assert_eq!(replayed, [false, true]);
    assert_eq!(
        t.node.sandboxes.lock().unwrap()[&id]["/workspace/log"],
        b"x\n"
    );
    // DELETE the log: 204, the sandbox keeps running and starts at step 0 again.
    let r = call(&t.app, Method::DELETE, "/v1/trajectories/D", None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(&t.app, Method::DELETE, "/v1/trajectories/never-was", None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    // The log is gone; D stays known through its live sandbox, with no steps.
    let r = call(&t.app, Method::GET, "/v1/trajectories/D", None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["next_step"], 0);
    assert_eq!(r.json()["steps"], json!([]));
    assert_eq!(r.json()["sandbox_id"], id.as_str());
    let r = exec_step(&t, &id, json!({"cmd": ["append", "x"], "step": 0})).await;
    assert_eq!(r.json()["replayed"], false);
    assert_eq!(r.json()["stdout"], "2\n");
    // Retention: an inactive log whose sandbox is gone is collected, a live one is kept.
    call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    let other = create(&t, json!({"trajectory": "live"})).await;
    exec_step(&t, &other, json!({"cmd": ["echo", "1"], "step": 0})).await;
    let mut st2 = t.st.cfg.clone();
    st2.trajectory_retention = Duration::ZERO;
    let st3 = AppState::open(st2, t.node.clone()).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let gone = crate::trajectory::gc(&st3).await.unwrap();
    assert_eq!(gone, ["D"]);
    let r = call(&t.app, Method::GET, "/v1/trajectories/live", None).await;
    assert_eq!(r.status, StatusCode::OK);
}

/// A pause or resume by label is ONE node call for the chunk (`pause_many` /
/// `resume_many` with every id), with per-id results: a sandbox the node fails is listed
/// in `failed` and stays `running`; the others change.
#[tokio::test]
async fn pause_by_label_is_one_bulk_node_call_with_per_id_failures() {
    let t = setup("bulkpause");
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(create(&t, json!({"labels": {"job": "bulk"}})).await);
    }
    let bad = ids[2].clone();
    t.node.refuse_freeze.lock().unwrap().insert(bad.clone());
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {"job": "bulk"}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let body = r.json();
    let mut want: Vec<String> = ids.iter().filter(|i| **i != bad).cloned().collect();
    want.sort();
    assert_eq!(body["sandboxes"], json!(want));
    let failed = body["failed"].as_array().unwrap();
    assert_eq!(failed.len(), 1, "{body}");
    assert_eq!(failed[0]["id"], bad);
    assert!(
        failed[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("freezer refused"),
        "{body}"
    );
    assert_eq!(*t.node.bulk_calls.lock().unwrap(), [("pause", 5)]);
    for id in &ids {
        let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        let want = if *id == bad { "running" } else { "paused" };
        assert_eq!(r.json()["state"], want, "{id}");
    }
    t.node.refuse_freeze.lock().unwrap().clear();
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:resume",
        Some(json!({"labels": {"job": "bulk"}})),
    )
    .await;
    assert_eq!(r.json(), json!({"sandboxes": want}));
    assert_eq!(
        *t.node.bulk_calls.lock().unwrap(),
        [("pause", 5), ("resume", 4)]
    );
    assert!(t.node.paused.lock().unwrap().is_empty());
}

#[tokio::test]
async fn pause_resume_by_label() {
    let t = setup("pause");
    let a = create(&t, json!({"labels": {"job": "x", "r": "1"}})).await;
    let b = create(&t, json!({"labels": {"job": "x", "r": "2"}})).await;
    let c = create(&t, json!({"labels": {"job": "y"}})).await;
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {"job": "x"}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let mut want = vec![a.clone(), b.clone()];
    want.sort();
    assert_eq!(r.json(), json!({"sandboxes": want}));
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{a}"), None).await;
    assert_eq!(r.json()["state"], "paused");
    // Calls on a paused sandbox: 409 "sandbox is paused"; the node is not asked.
    let before = node_execs(&t);
    let r = exec_step(&t, &a, json!({"cmd": ["echo", "hi"]})).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("sandbox is paused"));
    assert_eq!(node_execs(&t), before);
    let r = raw(
        &t.app,
        Method::PUT,
        &format!("/v1/sandboxes/{a}/files?path=/workspace/f"),
        None,
        b"x".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{a}/keepalive"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    // The other job runs on.
    let r = exec_step(&t, &c, json!({"cmd": ["echo", "hi"]})).await;
    assert_eq!(r.status, StatusCode::OK);
    // AND of pairs: resume only r=1.
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:resume",
        Some(json!({"labels": {"job": "x", "r": "1"}})),
    )
    .await;
    assert_eq!(r.json(), json!({"sandboxes": [a.clone()]}));
    let r = exec_step(&t, &a, json!({"cmd": ["echo", "hi"]})).await;
    assert_eq!(r.status, StatusCode::OK);
    // Pausing again affects only running ones; delete works on a paused sandbox.
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {"job": "x"}})),
    )
    .await;
    assert_eq!(r.json(), json!({"sandboxes": [a.clone()]}));
    let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{b}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(!t.node.ids().contains(&b));
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{b}"), None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // Delete by label: every state but `deleting`, only the matching ones.
    let d1 = create(&t, json!({"labels": {"job": "del"}})).await;
    call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {"job": "del"}})),
    )
    .await;
    let d2 = create(&t, json!({"labels": {"job": "del"}})).await;
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:delete",
        Some(json!({"labels": {}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:delete",
        Some(json!({"labels": {"job": "del"}})),
    )
    .await;
    let mut want = vec![d1.clone(), d2.clone()];
    want.sort();
    assert_eq!(r.json(), json!({"sandboxes": want}));
    for d in [&d1, &d2] {
        assert!(!t.node.ids().contains(d));
        let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{d}"), None).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
    }
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{c}"), None).await;
    assert_eq!(r.json()["state"], "running");
    // A paused sandbox survives a restart paused.
    let st2 = AppState::open(t.st.cfg.clone(), t.node.clone()).unwrap();
    lifecycle::recover(&st2).await.unwrap();
    assert_eq!(
        st2.store.get(&a).await.unwrap().unwrap().state.as_str(),
        "paused"
    );
    // A paused sandbox bound to a trajectory is reattached, not replaced.
    let tj = create(&t, json!({"trajectory": "P", "labels": {"job": "z"}})).await;
    call(
        &t.app,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {"job": "z"}})),
    )
    .await;
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "P"})),
    )
    .await;
    assert_eq!(
        (
            r.status,
            r.json()["id"].as_str().unwrap(),
            r.json()["state"].as_str().unwrap()
        ),
        (StatusCode::OK, tj.as_str(), "paused")
    );
}

#[tokio::test]
async fn network_policy_reaches_the_node_in_canonical_form() {
    let t = setup("netpol");
    let body = json!({"network": {"allow": ["10.1.2.0/24", "203.0.113.7/32", "PyPI.example.", "*.example.org"]}});
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let canonical =
        json!({"allow": ["10.1.2.0/24", "203.0.113.7", "pypi.example", "*.example.org"]});
    assert_eq!(r.json()["network"], canonical);
    let id = r.json()["id"].as_str().unwrap().to_owned();
    let r = call(&t.app, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.json()["network"], canonical, "stored and read back");
    let spec = t.node.creates.lock().unwrap()[0].clone();
    assert_eq!(serde_json::to_value(&spec.network).unwrap(), canonical);
    // "none" and null are the default and echo as "none".
    for v in [json!("none"), Value::Null] {
        let r = call(
            &t.app,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({ "network": v })),
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.json()["network"], "none");
    }
}

#[tokio::test]
async fn paged_list_and_summary() {
    let t = setup("paged");
    let mut made = Vec::new();
    for i in 0..5 {
        made.push(
            create(
                &t,
                json!({"labels": {"job": if i < 3 { "p" } else { "q" }}}),
            )
            .await,
        );
    }
    // limit=2 walks all five, each once, in pages of at most 2; the last has no token.
    let mut seen = Vec::new();
    let mut url = "/v1/sandboxes?limit=2".to_owned();
    let mut pages = 0;
    loop {
        let r = call(&t.app, Method::GET, &url, None).await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        let body = r.json();
        let page = body["sandboxes"].as_array().unwrap();
        assert!(page.len() <= 2);
        seen.extend(page.iter().map(|s| s["id"].as_str().unwrap().to_owned()));
        pages += 1;
        match body["next_page_token"].as_str() {
            Some(tok) => url = format!("/v1/sandboxes?limit=2&page_token={tok}"),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    let mut want = made.clone();
    want.sort();
    assert_eq!(sorted, want, "every sandbox once");
    // Labels filter pages too.
    let r = call(
        &t.app,
        Method::GET,
        "/v1/sandboxes?label=job=p&limit=10",
        None,
    )
    .await;
    let body = r.json();
    assert_eq!(body["sandboxes"].as_array().unwrap().len(), 3);
    assert!(body.get("next_page_token").is_none(), "{body}");
    // Unpaged answers carry no token.
    let r = call(&t.app, Method::GET, "/v1/sandboxes", None).await;
    assert!(r.json().get("next_page_token").is_none());
    for bad in [
        "/v1/sandboxes?limit=0",
        "/v1/sandboxes?limit=10001",
        "/v1/sandboxes?limit=x",
        "/v1/sandboxes?limit=2&page_token=%21%21",
        "/v1/sandboxes?limit=2&page_token=bm90LWEtY3Vyc29y",
        "/v1/sandboxes?page_token=NS5zYi1h",
        "/v1/sandboxes?offset=2",
    ] {
        let r = call(&t.app, Method::GET, bad, None).await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::BAD_REQUEST, "invalid_argument".into()),
            "{bad}"
        );
    }
    let r = call(&t.app, Method::GET, "/v1/sandboxes:summary", None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(
        r.json(),
        json!({
            "total": 5,
            "by_state": [{"backend": "function", "state": "running", "count": 5}],
            "by_node": {"fake-node": 5},
            "with_trajectory": 0
        })
    );
}
