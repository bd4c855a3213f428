//! Router-level tests of `POST /v1/sandboxes:batch` ([`crate::sandboxes::create_batch`]).
use crate::auth::create_key;
use crate::store::Quota;
use crate::test_support::*;
use axum::http::{Method, StatusCode};
use serde_json::{json, Value};

const BATCH: &str = "/v1/sandboxes:batch";

fn statuses(v: &Value) -> Vec<u64> {
    v["results"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|r| r["status"].as_u64().unwrap())
        .collect()
}

async fn records(t: &T) -> usize {
    t.st.store.list().await.unwrap().len()
}

#[tokio::test]
async fn count_creates_all_in_request_order() {
    let t = setup("batch-count");
    let r = post(&t.app, BATCH, json!({"count": 5, "labels": {"job": "j1"}})).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let v = r.json();
    assert_eq!(statuses(&v), vec![201; 5]);
    assert_eq!(
        (v["created"].as_u64(), v["failed"].as_u64()),
        (Some(5), Some(0))
    );
    for (i, item) in v["results"].as_array().unwrap().iter().enumerate() {
        assert_eq!(item["index"], i);
        assert_eq!(item["sandbox"]["state"], "running");
        assert_eq!(item["sandbox"]["labels"]["job"], "j1");
        assert!(item.get("error").is_none());
    }
    assert_eq!(t.node.ids().len(), 5);
    let listed = call(&t.app, Method::GET, "/v1/sandboxes?label=job=j1", None).await;
    assert_eq!(listed.json()["sandboxes"].as_array().unwrap().len(), 5);
}

#[tokio::test]
async fn bad_items_fail_alone_and_leave_nothing_behind() {
    let t = setup("batch-bad");
    let r = post(
        &t.app,
        BATCH,
        json!({"items": [
            {},
            {"cpu": 999},
            {"image": "nosuch"},
            {"backend": "vm"},
            "not an object",
            {"unknown_field": 1},
            {"trajectory": "t1"},
            {"memory_mib": 64},
        ]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let v = r.json();
    assert_eq!(statuses(&v), vec![201, 400, 404, 503, 400, 400, 400, 201]);
    let codes: Vec<_> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["error"]["code"].as_str().unwrap_or("-").to_owned())
        .collect();
    assert_eq!(
        codes,
        [
            "-",
            "invalid_argument",
            "not_found",
            "unavailable",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "-"
        ]
    );
    assert_eq!(
        (v["created"].as_u64(), v["failed"].as_u64()),
        (Some(2), Some(6))
    );
    // Only the two good ones exist, on the node and in the registry.
    assert_eq!(t.node.ids().len(), 2);
    assert_eq!(records(&t).await, 2);
    assert_eq!(v["results"][7]["sandbox"]["memory_mib"], 64);
}

#[tokio::test]
async fn over_quota_admits_exactly_the_quota() {
    let t = setup("batch-quota");
    let q = Quota {
        max_sandboxes: Some(3),
        ..Quota::default()
    };
    let (_, key) = create_key(&*t.st.store, "small", false, q).await.unwrap();
    let auth = format!("Bearer {key}");
    let body = serde_json::to_vec(&json!({"count": 10, "cpu": 0.1})).unwrap();
    let r = raw(
        &t.app,
        Method::POST,
        BATCH,
        Some("application/json"),
        body,
        &[("authorization", auth.as_str())],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let v = r.json();
    let s = statuses(&v);
    assert_eq!(s.iter().filter(|&&c| c == 201).count(), 3, "{s:?}");
    assert_eq!(s.iter().filter(|&&c| c == 429).count(), 7, "{s:?}");
    for item in v["results"].as_array().unwrap() {
        if item["status"] == 429 {
            assert_eq!(item["error"]["code"], "resource_exhausted");
        }
    }
    assert_eq!(t.node.ids().len(), 3);
    assert_eq!(records(&t).await, 3);
}

#[tokio::test]
async fn batch_key_replays_per_item() {
    let t = setup("batch-idem");
    let send = || {
        raw(
            &t.app,
            Method::POST,
            BATCH,
            Some("application/json"),
            serde_json::to_vec(&json!({"count": 3})).unwrap(),
            &[("idempotency-key", "job-42")],
        )
    };
    let first = send().await.json();
    assert_eq!(statuses(&first), vec![201; 3]);
    let again = send().await.json();
    assert_eq!(statuses(&again), vec![200; 3]);
    for i in 0..3 {
        assert_eq!(
            first["results"][i]["sandbox"]["id"],
            again["results"][i]["sandbox"]["id"]
        );
    }
    assert_eq!(t.node.ids().len(), 3);
    // The key names the single create `job-42#0` too: same body → the same sandbox.
    let single = raw(
        &t.app,
        Method::POST,
        "/v1/sandboxes",
        Some("application/json"),
        b"{}".to_vec(),
        &[("idempotency-key", "job-42#0")],
    )
    .await;
    assert_eq!(single.status, StatusCode::OK);
    assert_eq!(single.json()["id"], first["results"][0]["sandbox"]["id"]);
}

#[tokio::test]
async fn whole_batch_errors_are_400() {
    let t = setup("batch-400");
    for body in [
        json!({"count": 0}),
        json!({"count": sandlot_api::MAX_BATCH + 1}),
        json!({"count": -1}),
        json!({"count": 2, "cpu": 999}),
        json!({"count": 2, "bogus": 1}),
        json!({"count": 2, "items": [{}]}),
        json!({}),
        json!({"items": []}),
        json!({"items": {}}),
        json!({"items": [{}], "cpu": 1}),
        json!([1, 2]),
    ] {
        let r = post(&t.app, BATCH, body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {:?}", r.body);
        assert_eq!(r.code(), "invalid_argument", "{body}");
    }
    assert_eq!(records(&t).await, 0);
    assert!(t.node.ids().is_empty());
}

#[tokio::test]
async fn openapi_lists_batch_route() {
    let t = setup("batch-openapi");
    let doc = call(&t.app, Method::GET, "/openapi.json", None)
        .await
        .json();
    assert!(doc["paths"][BATCH]["post"].is_object());
    assert!(doc["components"]["schemas"]["BatchCreateResponse"].is_object());
}

#[tokio::test]
async fn rust_client_body_forms_are_accepted() {
    let t = setup("batch-client-forms");
    let spec = sandlot_api::CreateSandboxRequest {
        memory_mib: Some(64),
        ..Default::default()
    };
    for (req, n) in [
        (
            sandlot_api::BatchCreateRequest::Count {
                spec: Box::new(spec.clone()),
                count: 2,
            },
            2,
        ),
        (
            sandlot_api::BatchCreateRequest::Items {
                items: vec![spec.clone(), Default::default(), spec],
            },
            3,
        ),
    ] {
        let r = post(&t.app, BATCH, serde_json::to_value(&req).unwrap()).await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        let v: sandlot_api::BatchCreateResponse = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((v.created, v.failed, v.results.len()), (n, 0, n));
        assert!(v
            .results
            .iter()
            .all(|i| i.status == 201 && i.error.is_none()));
    }
}

/// A batch of several chunks (`BATCH_CHUNK` items share their registry writes): every item
/// created and `running`, and no transition claim or in-flight mark left behind.
#[tokio::test]
async fn chunks_leave_no_claim_behind() {
    let t = setup("batch-chunks");
    let n = crate::sandboxes::BATCH_CHUNK * 2 + 7;
    let r = post(&t.app, BATCH, json!({"count": n, "labels": {"job": "jc"}})).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let v = r.json();
    assert_eq!(statuses(&v), vec![201; n]);
    let idx: Vec<u64> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, (0..n as u64).collect::<Vec<_>>());
    assert_eq!(t.node.ids().len(), n);
    let recs = t.st.store.list().await.unwrap();
    assert_eq!(recs.len(), n);
    assert!(recs
        .iter()
        .all(|r| r.state == sandlot_api::SandboxState::Running));
    // A claim left set would show up as stale once its deadline passed.
    let far = crate::now_ms() + 3_600_000;
    assert!(t.st.store.stale_transitions(far).await.unwrap().is_empty());
    assert!(t.st.creating_set().is_empty());
}

/// A chunk's `created` events are one write of the events database: when it cannot be
/// written, every item of the batch fails 503 `unavailable` and nothing is left behind (no
/// sandbox on the node, no record, no claim); the events wait in the queue and are
/// written, in order, once the database takes writes again.
#[tokio::test]
async fn events_not_durable_fail_every_item_and_leave_nothing() {
    let t = setup("batch-events-full");
    let n = crate::sandboxes::BATCH_CHUNK + 3;
    t.st.events.refuse_writes_for_test(true);
    let r = post(&t.app, BATCH, json!({"count": n, "labels": {"job": "je"}})).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let v = r.json();
    assert_eq!(statuses(&v), vec![503; n], "{v}");
    assert_eq!(v["created"].as_u64(), Some(0));
    assert!(v["results"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["error"]["code"] == "unavailable"));
    assert!(t.node.ids().is_empty(), "rolled back on the node");
    assert_eq!(records(&t).await, 0, "no record left");
    assert!(t.st.creating_set().is_empty());
    let queued = t.st.events.pending().0;
    assert!(queued > 0, "the events wait in the queue");
    t.st.events.refuse_writes_for_test(false);
    crate::lifecycle::reap_once(&t.st).await;
    assert_eq!(t.st.events.pending().0, 0);
    // Writable again: the same batch is created.
    let r = post(&t.app, BATCH, json!({"count": n, "labels": {"job": "je"}})).await;
    assert_eq!(statuses(&r.json()), vec![201; n]);
    assert_eq!(t.node.ids().len(), n);
}
