//! Router tests of `/v1/sandboxes/{id}/processes…` over the unit-test `FakeNode` (whose
//! background `sleep`, `echo` and `cat` honour signals and stdin): the HTTP shapes, the
//! process table's bookkeeping and the errors. The real backends are covered by
//! `tests/conformance/test_processes.py`.
use crate::test_support::{call, post, raw, setup};
use axum::http::{Method, StatusCode};
use serde_json::{json, Value};

async fn sandbox(t: &crate::test_support::T) -> String {
    let r = post(&t.app, "/v1/sandboxes", json!({})).await;
    assert_eq!(r.status, StatusCode::CREATED);
    r.json()["id"].as_str().unwrap().to_string()
}

fn lines(body: &[u8]) -> Vec<Value> {
    body.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect()
}

#[tokio::test]
async fn spawn_signal_wait_output_and_delete() {
    let t = setup("procs-basic");
    let id = sandbox(&t).await;
    let base = format!("/v1/sandboxes/{id}/processes");
    let r = post(&t.app, &base, json!({"cmd": ["sleep", "60"]})).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let p = r.json();
    let pid = p["id"].as_str().unwrap().to_string();
    assert!(pid.starts_with("pr-") && pid.len() == 23);
    assert_eq!(p["state"], "running");
    assert_eq!(p["result"], Value::Null);
    // Wait with a short timeout: still running, not an error.
    let r = post(
        &t.app,
        &format!("{base}/{pid}/wait?timeout_s=0.1"),
        json!({}),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["state"].clone()),
        (StatusCode::OK, json!("running"))
    );
    let r = post(
        &t.app,
        &format!("{base}/{pid}/signal"),
        json!({"signal": "sigterm"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = post(&t.app, &format!("{base}/{pid}/wait?timeout_s=5"), json!({})).await;
    let p = r.json();
    assert_eq!(p["state"], "exited");
    assert_eq!(
        (
            p["result"]["exit_code"].clone(),
            p["result"]["signal"].clone()
        ),
        (json!(143), json!(15))
    );
    // A second signal: the process has exited.
    let r = post(
        &t.app,
        &format!("{base}/{pid}/signal"),
        json!({"signal": 15}),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::CONFLICT, "conflict".to_string())
    );
    // Output of an echo, then reading again from an offset.
    let r = post(&t.app, &base, json!({"cmd": ["echo", "hello", "world"]})).await;
    let pid2 = r.json()["id"].as_str().unwrap().to_string();
    post(&t.app, &format!("{base}/{pid2}/wait"), json!({})).await;
    let r = call(&t.app, Method::GET, &format!("{base}/{pid2}/output"), None).await;
    assert_eq!(r.headers["content-type"], "application/x-ndjson");
    let evs = lines(&r.body);
    assert_eq!(
        evs[0],
        json!({"type": "stdout", "data": "hello world\n", "offset": 0})
    );
    assert_eq!(evs[1]["type"], "exit");
    assert_eq!(evs[1]["result"]["stdout_bytes"], 12);
    let r = call(
        &t.app,
        Method::GET,
        &format!("{base}/{pid2}/output?stdout_offset=6"),
        None,
    )
    .await;
    assert_eq!(lines(&r.body)[0]["data"], "world\n");
    let r = call(
        &t.app,
        Method::GET,
        &format!("{base}/{pid2}/output?stdout_offset=13"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // List, delete, then 404.
    let r = call(&t.app, Method::GET, &base, None).await;
    let ids: Vec<String> = r.json()["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, [pid.clone(), pid2]);
    let r = call(&t.app, Method::DELETE, &format!("{base}/{pid}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = call(&t.app, Method::GET, &format!("{base}/{pid}"), None).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::NOT_FOUND, "not_found".to_string())
    );
    // Audit events of spawn and exit.
    let r = call(
        &t.app,
        Method::GET,
        &format!("/v1/events?sandbox={id}"),
        None,
    )
    .await;
    let kinds: Vec<String> = r.json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(kinds.iter().any(|k| k == "process_spawned"), "{kinds:?}");
    assert!(kinds.iter().any(|k| k == "process_exited"), "{kinds:?}");
}

#[tokio::test]
async fn stdin_cap_and_sandbox_delete() {
    let t = setup("procs-stdin");
    let id = sandbox(&t).await;
    let base = format!("/v1/sandboxes/{id}/processes");
    let r = post(&t.app, &base, json!({"cmd": ["cat"], "stdin": true})).await;
    let pid = r.json()["id"].as_str().unwrap().to_string();
    assert_eq!(r.json()["stdin_open"], true);
    let r = raw(
        &t.app,
        Method::POST,
        &format!("{base}/{pid}/stdin"),
        Some("application/octet-stream"),
        b"abc".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = raw(
        &t.app,
        Method::POST,
        &format!("{base}/{pid}/stdin?eof=true"),
        Some("application/octet-stream"),
        b"def".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = post(&t.app, &format!("{base}/{pid}/wait?timeout_s=5"), json!({})).await;
    assert_eq!(r.json()["result"]["exit_code"], 0);
    assert_eq!(r.json()["stdin_open"], false);
    let r = call(&t.app, Method::GET, &format!("{base}/{pid}/output"), None).await;
    let text: String = lines(&r.body)
        .iter()
        .filter(|e| e["type"] == "stdout")
        .map(|e| e["data"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "abcdef");
    let r = raw(
        &t.app,
        Method::POST,
        &format!("{base}/{pid}/stdin"),
        Some("application/octet-stream"),
        b"x".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    // 16 running processes per sandbox, then 429.
    for _ in 0..16 {
        let r = post(&t.app, &base, json!({"cmd": ["sleep", "60"]})).await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    let r = post(&t.app, &base, json!({"cmd": ["sleep", "60"]})).await;
    assert_eq!(
        (r.status, r.code()),
        (
            StatusCode::TOO_MANY_REQUESTS,
            "resource_exhausted".to_string()
        )
    );
    // Deleting the sandbox forgets its processes.
    let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    // The node (the fake's process table) forgot them.
    assert!(t.st.node.process_list(&id).await.unwrap().is_empty());
    let r = call(&t.app, Method::GET, &base, None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn bad_requests_and_unknown_ids() {
    let t = setup("procs-bad");
    let id = sandbox(&t).await;
    let base = format!("/v1/sandboxes/{id}/processes");
    for (body, what) in [
        (json!({"cmd": []}), "empty argv"),
        (json!({"cmd": "  "}), "blank shell string"),
        (json!({"cmd": ["sleep", "1"], "step": 0}), "step"),
        (json!({"cmd": ["sleep", "1"], "timeout_s": 0}), "timeout"),
        (
            json!({"cmd": ["sleep", "1"], "max_output_bytes": 1u64 << 30}),
            "retention",
        ),
        (
            json!({"cmd": ["nope"]}),
            "refused by the node before it starts",
        ),
    ] {
        let r = post(&t.app, &base, body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{what}: {}", r.message());
    }
    let r = post(&t.app, &base, json!({"cmd": ["sleep", "60"]})).await;
    let pid = r.json()["id"].as_str().unwrap().to_string();
    for sig in [
        json!("SIGSTOP"),
        json!(19),
        json!("nope"),
        json!(-1),
        json!(null),
    ] {
        let r = post(
            &t.app,
            &format!("{base}/{pid}/signal"),
            json!({"signal": sig}),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{sig}");
    }
    let r = post(
        &t.app,
        &format!("{base}/{pid}/wait?timeout_s=301"),
        json!({}),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = raw(
        &t.app,
        Method::POST,
        &format!("{base}/{pid}/stdin"),
        Some("application/octet-stream"),
        b"x".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "stdin not open");
    let unknown = "pr-00000000000000000000";
    for (m, path) in [
        (Method::GET, format!("{base}/{unknown}")),
        (Method::GET, format!("{base}/{unknown}/output")),
        (Method::POST, format!("{base}/{unknown}/wait")),
        (Method::DELETE, format!("{base}/{unknown}")),
        (
            Method::GET,
            "/v1/sandboxes/sb-00000000000000000000/processes".to_string(),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/sb-00000000000000000000/processes/{pid}"),
        ),
    ] {
        let r = call(&t.app, m.clone(), &path, None).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{m} {path}");
    }
    // The routes are documented.
    let doc = call(&t.app, Method::GET, "/openapi.json", None)
        .await
        .json();
    for route in [
        "/v1/sandboxes/{id}/processes",
        "/v1/sandboxes/{id}/processes/{pid}",
        "/v1/sandboxes/{id}/processes/{pid}/output",
        "/v1/sandboxes/{id}/processes/{pid}/wait",
        "/v1/sandboxes/{id}/processes/{pid}/signal",
        "/v1/sandboxes/{id}/processes/{pid}/stdin",
        "/v1/sandboxes/{id}/processes/{pid}/resize",
    ] {
        assert!(
            doc["paths"][route].is_object(),
            "{route} missing from openapi.json"
        );
    }
    post(
        &t.app,
        &format!("{base}/{pid}/signal"),
        json!({"signal": "KILL"}),
    )
    .await;
}
