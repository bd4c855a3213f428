//! Router tests of `/metrics`, `/v1/events` and `/` over the unit-test `FakeNode`.
use crate::{router, AppState, ServerConfig};
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use sandlot_node_fake::FakeNode;
use serde_json::{json, Value};
use std::sync::Arc;
use tower::ServiceExt;

/// A router over the fake node, its state, and the guard of its temporary data directory
/// (removed when the test drops it).
fn app(name: &str) -> (Router, crate::SharedState, tempfile::TempDir) {
    let d = tempfile::Builder::new()
        .prefix(&format!("sandlot-obs-{name}-"))
        .tempdir()
        .unwrap();
    let st = AppState::open(
        ServerConfig::new(d.path().to_path_buf()),
        Arc::new(FakeNode::default()),
    )
    .unwrap();
    (router(st.clone()), st, d)
}

async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    body: Option<Value>,
) -> (StatusCode, String) {
    let mut b = Request::builder().method(method).uri(uri);
    let body = match body {
        Some(v) => {
            b = b.header("content-type", "application/json");
            Body::from(serde_json::to_vec(&v).unwrap())
        }
        None => Body::empty(),
    };
    let resp = app.clone().oneshot(b.body(body).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

async fn create(app: &Router, body: Value) -> String {
    let (s, b) = call(app, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    serde_json::from_str::<Value>(&b).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn exec(app: &Router, id: &str, body: Value) -> Value {
    let (s, b) = call(
        app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(body),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    serde_json::from_str(&b).unwrap()
}

async fn events(app: &Router, query: &str) -> Value {
    let (s, b) = call(app, Method::GET, &format!("/v1/events{query}"), None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    serde_json::from_str(&b).unwrap()
}

/// The value of the sample line that starts with `prefix ` (name and labels).
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix)?.strip_prefix(' '))
        .map(|v| v.parse().unwrap())
}

#[tokio::test]
async fn metrics_histograms_and_counters_after_execs() {
    let (app, _st, _tmp) = app("metrics");
    let id = create(&app, json!({"trajectory": "m/1"})).await;
    exec(&app, &id, json!({"cmd": ["echo", "hi"], "step": 0})).await;
    exec(&app, &id, json!({"cmd": ["echo", "hi"], "step": 0})).await; // replayed
    let r = exec(&app, &id, json!({"cmd": ["sleep", "5"], "timeout_s": 0.05})).await;
    assert_eq!(r["timed_out"], true);
    let (s, _) = call(
        &app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["fail"]})),
    )
    .await;
    assert!(s.is_server_error() || s.is_client_error(), "{s}");

    let (s, text) = call(&app, Method::GET, "/metrics", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(
        text.contains("# TYPE sandlot_exec_seconds histogram"),
        "{text}"
    );
    // One executed step plus the timeout: the replay is not an exec.
    let ok = r#"sandlot_exec_seconds_count{backend="function",outcome="ok"}"#;
    assert_eq!(sample(&text, ok), Some(1.0), "{text}");
    let to = r#"sandlot_exec_seconds_count{backend="function",outcome="timeout"}"#;
    assert_eq!(sample(&text, to), Some(1.0), "{text}");
    // The timed-out exec slept ~50 ms: its sum is at least that.
    let to_sum = r#"sandlot_exec_seconds_sum{backend="function",outcome="timeout"}"#;
    assert!(sample(&text, to_sum).unwrap() >= 0.04, "{text}");
    let inf = r#"sandlot_exec_seconds_bucket{le="+Inf",backend="function",outcome="ok"}"#;
    assert_eq!(sample(&text, inf), Some(1.0), "{text}");
    let err = r#"sandlot_exec_seconds_count{backend="function",outcome="error"}"#;
    assert_eq!(sample(&text, err), Some(1.0), "{text}");
    let c = r#"sandlot_create_seconds_count{backend="function"}"#;
    assert_eq!(sample(&text, c), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "sandlot_trajectory_replays_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "sandlot_trajectory_steps_logged_total"),
        Some(1.0),
        "{text}"
    );
    let sb = r#"sandlot_sandboxes{backend="function",state="running"}"#;
    assert_eq!(sample(&text, sb), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "sandlot_run_code_running"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, r#"sandlot_events_total{kind="exec"}"#),
        Some(3.0),
        "{text}"
    );

    // Deleted: the gauge of the emptied state reads 0 rather than vanishing.
    call(&app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    let (_, text) = call(&app, Method::GET, "/metrics", None).await;
    assert_eq!(sample(&text, sb), Some(0.0), "{text}");
}

#[tokio::test]
async fn events_filter_by_sandbox_kind_and_since() {
    let (app, _st, _tmp) = app("events");
    let a = create(&app, json!({})).await;
    let b = create(&app, json!({"labels": {"job": "<script>x</script>"}})).await;
    exec(&app, &a, json!({"cmd": ["echo", "a"]})).await;
    exec(&app, &b, json!({"cmd": ["exit", "3"]})).await;
    let all = events(&app, "").await;
    let kinds: Vec<&str> = all["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["created", "created", "exec", "exec"]);
    let cursor = all["next"].as_str().unwrap().to_owned();

    let only_b = events(&app, &format!("?sandbox={b}")).await;
    let evs = only_b["events"].as_array().unwrap();
    assert_eq!(evs.len(), 2);
    assert!(evs.iter().all(|e| e["sandbox"] == b.as_str()));
    let ex = &evs[1];
    assert_eq!(
        (ex["kind"].as_str(), ex["exit_code"].as_i64()),
        (Some("exec"), Some(3))
    );
    assert_eq!(ex["backend"], "function");
    assert_eq!(ex["replayed"], false);
    assert_eq!(ex["timed_out"], false);
    // Digest of the argv JSON, the command itself is not kept.
    let want = crate::events::command_digest(&sandlot_api::ExecRequest::new(
        sandlot_api::Cmd::Argv(vec!["exit".into(), "3".into()]),
    ));
    assert_eq!(ex["command_digest"], want.as_str());
    assert_eq!(want.len(), 64);
    assert!(!ex.to_string().contains("\"exit\""));

    let execs = events(&app, "?kind=exec").await;
    assert_eq!(execs["events"].as_array().unwrap().len(), 2);

    // Cursor: nothing new yet, then only the delete.
    let none = events(&app, &format!("?since={cursor}")).await;
    assert_eq!(none["events"].as_array().unwrap().len(), 0);
    assert_eq!(none["next"], cursor.as_str());
    call(&app, Method::DELETE, &format!("/v1/sandboxes/{a}"), None).await;
    let after = events(&app, &format!("?since={cursor}")).await;
    let evs = after["events"].as_array().unwrap();
    assert_eq!(evs.len(), 1, "{after}");
    assert_eq!(
        (evs[0]["kind"].as_str(), evs[0]["sandbox"].as_str()),
        (Some("deleted"), Some(a.as_str()))
    );
    assert_ne!(after["next"], cursor.as_str());

    // RFC 3339: a time after everything selects nothing, one before selects all.
    let future = events(&app, "?since=2999-01-01T00:00:00Z").await;
    assert_eq!(future["events"].as_array().unwrap().len(), 0);
    let past = events(&app, "?since=2000-01-01T00:00:00%2B00:00").await;
    assert_eq!(past["events"].as_array().unwrap().len(), 5);

    // Limit without cursor: the newest; with cursor: the oldest after it.
    let tail = events(&app, "?limit=2").await;
    let ids: Vec<u64> = tail["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [4, 5]);
    let page = events(&app, "?since=0&limit=2").await;
    let ids: Vec<u64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_u64().unwrap())
        .collect();
    assert_eq!((ids, page["next"].as_str()), (vec![1, 2], Some("2")));

    for bad in ["?since=yesterday", "?limit=0", "?limit=1001", "?what=1"] {
        let (s, body) = call(&app, Method::GET, &format!("/v1/events{bad}"), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
}

#[tokio::test]
async fn events_pause_resume_expire_and_ring_bound() {
    let (app, st, _tmp) = app("events-life");
    let id = create(&app, json!({"labels": {"job": "p"}, "ttl_s": 1})).await;
    let (s, _) = call(
        &app,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {"job": "p"}})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(
        &app,
        Method::POST,
        "/v1/sandboxes:resume",
        Some(json!({"labels": {"job": "p"}})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let done = crate::lifecycle::reap_once(&st).await;
    assert_eq!(done, [id.as_str()]);
    let evs = events(&app, &format!("?sandbox={id}")).await;
    let kinds: Vec<&str> = evs["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["created", "paused", "resumed", "expired", "deleted"]
    );

    // Memory-only log (unit-test default): the ring drops the oldest.
    let mem = crate::events::EventLog::default();
    for _ in 0..crate::events::RING_CAPACITY + 5 {
        mem.push("test", None, None, Default::default()).unwrap();
    }
    let (evs, next) = mem.query(None, None, None, &crate::events::Since::After(0), 1000);
    assert_eq!(evs[0].id, 6, "oldest kept after the ring wrapped");
    assert_eq!(evs.len(), 1000);
    assert_eq!(next, evs[999].id);
}

#[tokio::test]
async fn events_are_durable_across_reopen_and_beyond_the_ring() {
    use crate::events::{EventLog, Since, RING_CAPACITY};
    let dir = tempfile::Builder::new()
        .prefix("sandlot-obs-durable-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("events.db");
    let log = EventLog::open(&path).unwrap();
    log.set_owner("sb-a", Some("tenant-1"));
    let mut f = serde_json::Map::new();
    f.insert("image".into(), "python".into());
    assert_eq!(log.push("created", Some("sb-a"), None, f).unwrap(), 1);
    for _ in 0..RING_CAPACITY + 5 {
        log.push("test", None, None, Default::default()).unwrap();
    }
    // Older than the ring: read back from the database, fields and tenant intact.
    let (evs, next) = log.query(None, None, None, &Since::After(0), 3);
    assert_eq!(evs.iter().map(|e| e.id).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(evs[0].fields["image"], "python");
    assert_eq!(next, 3);
    let (evs, _) = log.query(None, Some("sb-a"), None, &Since::All, 10);
    assert_eq!(evs.len(), 1, "a filter reaching past the ring finds it");
    let (evs, _) = log.query(Some("tenant-1"), None, None, &Since::All, 10);
    assert_eq!(evs.len(), 1, "the tenant of a database row is kept");
    let (evs, _) = log.query(Some("tenant-2"), None, None, &Since::After(0), 10);
    assert!(evs.is_empty(), "another tenant sees none of it: {evs:?}");
    drop(log);

    // A restart keeps ids increasing and old cursors valid.
    let log = EventLog::open(&path).unwrap();
    log.set_owner("sb-a", Some("tenant-1"));
    let last = (RING_CAPACITY + 6) as u64;
    let id = log
        .push("deleted", Some("sb-a"), None, Default::default())
        .unwrap();
    assert_eq!(id, last + 1);
    let (evs, next) = log.query(Some("tenant-1"), Some("sb-a"), None, &Since::After(0), 10);
    let kinds: Vec<&str> = evs.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["created", "deleted"]);
    assert_eq!(next, last + 1);
    let (evs, _) = log.query(None, None, Some("test"), &Since::After(last - 2), 10);
    let ids: Vec<u64> = evs.iter().map(|e| e.id).collect();
    assert_eq!(ids, [last - 1, last]);
    drop(log);
}

#[tokio::test]
async fn status_page_escapes_client_data() {
    let (app, _st, _tmp) = app("web");
    let evil = "<img src=x onerror=alert(1)>";
    let id = create(&app, json!({"labels": {"job": evil}})).await;
    let req = Request::builder().uri("/").body(Body::empty()).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let csp = resp.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    let html = String::from_utf8(
        axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap();
    assert!(html.contains(&id), "sandbox id in the server render");
    assert!(!html.contains(evil), "label must be escaped");
    assert!(html.contains("&lt;img src=x onerror=alert(1)&gt;"));
    assert!(!html.contains("innerHTML"));
}

#[tokio::test]
async fn openapi_lists_observability_routes() {
    let doc: Value = serde_json::from_str(crate::health::OPENAPI_JSON).unwrap();
    for route in ["/metrics", "/v1/events", "/"] {
        assert!(
            doc["paths"][route]["get"].is_object(),
            "{route} missing from openapi.json"
        );
    }
}

#[tokio::test]
async fn seccomp_reports_and_files_escapes_become_violation_events() {
    let (app, _st, _tmp) = app("violations");
    let id = create(&app, json!({"image": "python"})).await;
    let r = exec(
        &app,
        &id,
        json!({"cmd": ["mount", "-t", "tmpfs", "x", "/mnt"]}),
    )
    .await;
    assert_eq!(r["violations"][0]["syscall"], "mount");
    let ev = events(&app, &format!("?sandbox={id}&kind=violation")).await;
    let v = &ev["events"][0];
    assert_eq!(v["layer"], "seccomp");
    assert_eq!(v["syscall"], "mount");
    assert_eq!(v["nr"], 165);
    assert_eq!(v["action"], "EPERM");
    assert_eq!(v["at"], "2026-11-30T10:53:42.312Z");
    let ex = events(&app, &format!("?sandbox={id}&kind=exec")).await;
    assert_eq!(ex["events"][0]["violations"], 1);
    assert_eq!(ex["events"][0]["command_digest"], v["command_digest"]);
    assert!(ex["events"][0]["id"].as_u64() > v["id"].as_u64());
    // An exec without attempts has no `violations` field.
    let r = exec(&app, &id, json!({"cmd": ["echo", "hi"]})).await;
    assert!(r.get("violations").is_none(), "{r}");

    // Files API: `..` above the root is reported even though the node clamps it.
    let (s, _) = call(
        &app,
        Method::GET,
        &format!("/v1/sandboxes/{id}/files?path=../../etc/passwd"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let ev = events(&app, &format!("?sandbox={id}&kind=violation")).await;
    let f = &ev["events"][1];
    assert_eq!(f["layer"], "files_api");
    assert_eq!(f["op"], "read");
    assert_eq!(f["path"], "../../etc/passwd");

    let (_, text) = call(&app, Method::GET, "/metrics", None).await;
    let seccomp = r#"sandlot_violations_total{backend="function",layer="seccomp",what="mount"}"#;
    assert_eq!(sample(&text, seccomp), Some(1.0), "{text}");
    let files = r#"sandlot_violations_total{backend="function",layer="files_api",what="read"}"#;
    assert_eq!(sample(&text, files), Some(1.0), "{text}");
}
