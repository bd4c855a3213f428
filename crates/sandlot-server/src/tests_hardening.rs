//! Router tests of the hardening fixes (request shapes, method fallback, file-read budget,
//! `run_code` fetch verdicts, error mapping) over the unit-test `FakeNode` (no socket, no
//! root).
use crate::test_support::*;
use axum::http::{Method, StatusCode};
use serde_json::json;

async fn create(t: &T) -> String {
    let r = post(&t.app, "/v1/sandboxes", json!({"image": "busybox"})).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    r.json()["id"].as_str().unwrap().to_owned()
}

// Finding 6: serde builds structs from JSON arrays by position; only objects are requests.
#[tokio::test]
async fn json_body_must_be_an_object() {
    let t = setup("jsonobj");
    let arr = json!(["function", "busybox", 1, 16, 16, 8, 5]);
    let r = post(&t.app, "/v1/sandboxes", arr.clone()).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    assert_eq!(r.code(), "invalid_argument");
    assert_eq!(r.message(), "request body must be a JSON object");
    assert!(t.node.ids().is_empty(), "no sandbox may be created");
    for body in [json!(["print(1)", "python"]), json!("x"), json!(3)] {
        let r = post(&t.app, "/run_code", body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
        assert_eq!(r.message(), "request body must be a JSON object");
    }
    let id = create(&t).await;
    let r = post(
        &t.app,
        &format!("/v1/sandboxes/{id}/exec"),
        json!([["echo", "a"]]),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    let r = post(
        &t.app,
        &format!("/v1/sandboxes/{id}/keepalive"),
        json!([60]),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    assert_eq!(r.message(), "request body must be a JSON object");
    // Objects, malformed JSON and a wrong content type keep their usual answers.
    let r = post(
        &t.app,
        &format!("/v1/sandboxes/{id}/exec"),
        json!({"cmd": ["echo", "a"]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        b"{\"image\":".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_ne!(r.message(), "request body must be a JSON object");
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("text/plain"),
        b"{}".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.message().contains("Content-Type"), "{}", r.message());
    let r = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/vnd.x+json; charset=utf-8"),
        b" {}".to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
}

// Finding 9: a wrong method answers 405 with our JSON error body.
#[tokio::test]
async fn wrong_method_is_405_json() {
    let t = setup("405");
    let r = raw(&t.app, Method::GET, "/run_code", None, vec![], &[]).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.code(), "invalid_argument");
    assert_eq!(r.message(), "method GET not allowed on /run_code");
    let r = raw(
        &t.app,
        Method::PUT,
        "/v1/sandboxes/sb-1/exec",
        None,
        vec![],
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        r.message(),
        "method PUT not allowed on /v1/sandboxes/sb-1/exec"
    );
    let r = raw(&t.app, Method::GET, "/v1/nope", None, vec![], &[]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.code(), "not_found");
    assert!(r.headers.get("content-type").is_some());
}

// Finding 7: a blank shell string is as empty as an empty argv; one image-name rule.
#[tokio::test]
async fn blank_shell_cmd_and_image_rule() {
    let t = setup("blank");
    let id = create(&t).await;
    for cmd in ["", "   ", "\n\t"] {
        let r = post(
            &t.app,
            &format!("/v1/sandboxes/{id}/exec"),
            json!({"cmd": cmd}),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{cmd:?}: {:?}", r.body);
        assert_eq!(r.code(), "invalid_argument");
    }
    assert!(
        t.node.execs.lock().unwrap().is_empty(),
        "nothing may reach the node"
    );
    let node_msg = sandlot_node::validate_image_ref("Python:3")
        .unwrap_err()
        .to_string();
    let r = post(&t.app, "/v1/sandboxes", json!({"image": "Python:3"})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.message(), node_msg);
    let r = post(&t.app, "/v1/sandboxes", json!({"image": "a".repeat(65)})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

// Finding 1: reads take their size from the server-wide budget; none free → 429 + Retry-After.
#[tokio::test]
async fn file_read_budget_exhausted_is_429() {
    let t = setup_with("budget", |c| {
        c.file_read_budget_bytes = 4 * crate::budget::UNIT;
        c.file_read_budget_wait = std::time::Duration::from_millis(100);
    });
    let id = create(&t).await;
    let data = vec![7u8; 3 * crate::budget::UNIT as usize];
    let uri = format!("/v1/sandboxes/{id}/files?path=/workspace/f");
    let r = raw(&t.app, Method::PUT, &uri, None, data.clone(), &[]).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    // Another read holds 2 of the 4 units: a 3-unit read cannot get its share.
    let (held, _) =
        t.st.file_budget
            .reserve(2 * crate::budget::UNIT)
            .await
            .unwrap();
    let r = raw(&t.app, Method::GET, &uri, None, vec![], &[]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
    assert_eq!(r.code(), "resource_exhausted");
    assert_eq!(r.headers.get("retry-after").unwrap(), "1");
    // A small file still fits next to it (an upload reserves by its Content-Length; without
    // one it would reserve max_file_bytes, the whole budget here).
    let small = format!("/v1/sandboxes/{id}/files?path=/workspace/s");
    assert_eq!(
        raw(
            &t.app,
            Method::PUT,
            &small,
            None,
            b"hi".to_vec(),
            &[("content-length", "2")]
        )
        .await
        .status,
        StatusCode::NO_CONTENT
    );
    let r = raw(&t.app, Method::GET, &small, None, vec![], &[]).await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"hi"[..]));
    drop(held);
    let r = raw(&t.app, Method::GET, &uri, None, vec![], &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body.len(), data.len());
    // Every share came back.
    assert_eq!(t.st.file_budget.available_bytes(), 4 * crate::budget::UNIT);
}

fn b64(d: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(d)
}

// Finding 2: a fetch path the program made unreadable leaves the file out; the verdict stays
// the run's (never SandboxError).
#[tokio::test]
async fn run_code_unreadable_fetch_keeps_the_verdict() {
    let t = setup_with("fetchbad", |c| c.max_file_bytes = 10);
    for (code, status) in [("print(1)", "Success"), ("raise x", "Failed")] {
        let r = post(
            &t.app,
            "/run_code",
            json!({"code": code, "language": "python",
                   "files": {"big.bin": b64(&[1u8; 20])},
                   "fetch_files": ["big.bin", "missing.txt", "out.txt"]}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        let v = r.json();
        assert_eq!(v["status"], status, "{v}");
        assert!(v["run_result"].is_object(), "{v}");
        let files = v["files"].as_object().unwrap();
        assert!(
            !files.contains_key("big.bin") && !files.contains_key("missing.txt"),
            "{v}"
        );
        let msg = v["message"].as_str().unwrap();
        assert!(msg.contains("fetch_files left out \"big.bin\""), "{msg}");
        assert!(!msg.contains("missing.txt"), "{msg}");
        if status == "Success" {
            assert_eq!(files["out.txt"], b64(b"made"));
        }
    }
}

// Finding 1c: fetch_files returns at most run_code_fetch_bytes per call.
#[tokio::test]
async fn run_code_fetch_total_is_capped() {
    let t = setup_with("fetchcap", |c| c.run_code_fetch_bytes = 6);
    let r = post(
        &t.app,
        "/run_code",
        json!({"code": "print(1)", "language": "python",
               "files": {"b.txt": b64(b"12345")},
               "fetch_files": ["out.txt", "b.txt"]}),
    )
    .await;
    let v = r.json();
    assert_eq!(v["status"], "Success", "{v}");
    assert_eq!(v["files"]["out.txt"], b64(b"made"));
    assert!(v["files"].get("b.txt").is_none(), "{v}");
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains("\"b.txt\"") && msg.contains("at most 6 bytes per call"),
        "{msg}"
    );
}

#[tokio::test]
async fn below_the_disk_reserve_creates_and_run_code_are_refused_reads_and_deletes_work() {
    // A reserve no file system can keep: every create is below it.
    let t = setup_with("reserve", |c| c.disk_reserve_bytes = u64::MAX);
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::TOO_MANY_REQUESTS, "resource_exhausted".into())
    );
    assert!(r.headers.contains_key("retry-after"));
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("below its reserve"));
    let r = call(
        &t.app,
        Method::POST,
        "/run_code",
        Some(json!({"code": "print(1)", "language": "python"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.json());
    assert!(t.node.ids().is_empty(), "no sandbox made");
    let r = call(&t.app, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = call(
        &t.app,
        Method::DELETE,
        "/v1/sandboxes/sb-0123456789abcdef0123",
        None,
    )
    .await;
    assert!(r.status.is_success(), "{}", r.status);
}

#[tokio::test]
async fn calls_fail_while_their_audit_event_cannot_be_written_and_deletes_still_work() {
    let t = setup("events-full");
    let id = create(&t).await;
    t.st.events.refuse_writes_for_test(true);
    let exec = format!("/v1/sandboxes/{id}/exec");
    let r = call(&t.app, Method::POST, &exec, Some(json!({"cmd": ["true"]}))).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into()),
        "the exec ran but its event is not durable"
    );
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(t.node.ids(), std::slice::from_ref(&id), "no second sandbox");
    let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert!(r.status.is_success(), "{}", r.status);
    assert_eq!(t.st.events.pending().0, 2, "exec and deleted queued");
    t.st.events.refuse_writes_for_test(false);
    crate::lifecycle::reap_once(&t.st).await;
    assert_eq!(t.st.events.pending().0, 0);
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
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, ["created", "exec", "deleted"]);
}

#[tokio::test]
async fn exec_output_budget_exhausted_is_429_and_frees_when_the_exec_ends() {
    // Room for one exec of max_output_bytes 1 MiB (8 MiB reserved), not two.
    let t = setup_with("exec-budget", |c| {
        c.exec_output_budget_bytes = 12 << 20;
        c.file_read_budget_wait = std::time::Duration::from_millis(100);
    });
    let id = create(&t).await;
    let exec = format!("/v1/sandboxes/{id}/exec");
    let slow = {
        let app = t.app.clone();
        let exec = exec.clone();
        tokio::spawn(async move {
            call(
                &app,
                Method::POST,
                &exec,
                Some(json!({"cmd": ["sleep", "1"], "max_output_bytes": 1048576})),
            )
            .await
        })
    };
    // Wait until the slow exec reached the node (it holds its share from then on).
    while !node_ran_sleep(&t) {
        tokio::task::yield_now().await;
    }
    let r = call(
        &t.app,
        Method::POST,
        &exec,
        Some(json!({"cmd": ["echo", "hi"], "max_output_bytes": 1048576})),
    )
    .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::TOO_MANY_REQUESTS, "resource_exhausted".into())
    );
    assert!(r.headers.contains_key("retry-after"));
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("exec output budget"));
    assert_eq!(slow.await.unwrap().status, StatusCode::OK);
    let r = call(
        &t.app,
        Method::POST,
        &exec,
        Some(json!({"cmd": ["echo", "hi"]})),
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "share returned when the exec ended"
    );
}

fn node_ran_sleep(t: &T) -> bool {
    t.node
        .execs
        .lock()
        .unwrap()
        .iter()
        .any(|(_, argv)| argv.first().map(String::as_str) == Some("sleep"))
}

// Issue 25: one server per data directory (SQLite store). A second bind waits
// `lock_wait`, then fails naming the directory and the holder's pid; once the first is
// dropped the directory is free again.
#[tokio::test]
async fn a_second_server_on_one_data_dir_is_refused() {
    let tmp = data_dir("dirlock");
    let mut cfg = crate::ServerConfig::new(tmp.path().to_path_buf());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.lock_wait = std::time::Duration::from_millis(300);
    let node = std::sync::Arc::new(sandlot_node_fake::FakeNode::default());
    let first = crate::Server::bind(cfg.clone(), node.clone())
        .await
        .expect("first server");
    let t0 = std::time::Instant::now();
    let err = crate::Server::bind(cfg.clone(), node.clone())
        .await
        .err()
        .expect("second server refused");
    assert!(t0.elapsed() >= cfg.lock_wait, "{:?}", t0.elapsed());
    assert!(
        err.downcast_ref::<sandlot_node::dirlock::DirLockError>()
            .is_some_and(|e| matches!(e, sandlot_node::dirlock::DirLockError::Held { .. })),
        "{err:#}"
    );
    let msg = format!("{err:#}");
    for want in [
        format!("pid {}", std::process::id()),
        tmp.path().display().to_string(),
        "one server per data directory".to_owned(),
    ] {
        assert!(msg.contains(&want), "{want:?} not in {msg}");
    }
    drop(first);
    crate::Server::bind(cfg, node)
        .await
        .expect("the directory is free once the first server is gone");
}
