//! Router-level tests of checkpoints and forks ([`crate::checkpoints`]) over the `FakeNode`.
use crate::auth::create_key;
use crate::store::Quota;
use crate::test_support::*;
use axum::http::{Method, StatusCode};
use serde_json::{json, Value};

async fn sandbox(t: &T, body: Value) -> String {
    let r = post(&t.app, "/v1/sandboxes", body).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    r.json()["id"].as_str().unwrap().to_owned()
}

async fn put(t: &T, id: &str, path: &str, data: &[u8]) {
    let r = raw(
        &t.app,
        Method::PUT,
        &format!("/v1/sandboxes/{id}/files?path={path}"),
        Some("application/octet-stream"),
        data.to_vec(),
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.body);
}

async fn checkpoint(t: &T, id: &str) -> Value {
    let r = call(
        &t.app,
        Method::POST,
        &format!("/v1/sandboxes/{id}/checkpoints"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    r.json()
}

#[tokio::test]
async fn checkpoint_fork_list_get_delete() {
    let t = setup("ck-cycle");
    let id = sandbox(&t, json!({"image": "busybox", "disk_mib": 64})).await;
    put(&t, &id, "/workspace/a.txt", b"hello").await;
    let ck = checkpoint(&t, &id).await;
    let ck_id = ck["checkpoint_id"].as_str().unwrap().to_owned();
    assert!(ck_id.starts_with("ck-") && ck_id.len() == 23, "{ck_id}");
    assert_eq!(ck["sandbox_id"], json!(id));
    assert_eq!(ck["backend"], json!("function"));
    assert_eq!(ck["image"], json!("busybox"));
    assert_eq!(ck["disk_mib"], json!(64));
    assert_eq!(ck["size_bytes"], json!(5));
    assert!(ck["created_at"].as_str().unwrap().ends_with('Z'));

    // Backend, image and disk come from the checkpoint when omitted.
    let fork = sandbox(&t, json!({"checkpoint": ck_id})).await;
    let spec = t.node.creates.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        (spec.id.as_str(), spec.image.as_str(), spec.disk_mib),
        (fork.as_str(), "busybox", 64)
    );
    let r = call(
        &t.app,
        Method::GET,
        &format!("/v1/sandboxes/{fork}/files?path=/workspace/a.txt"),
        None,
    )
    .await;
    assert_eq!(&r.body[..], b"hello");
    // Explicit matching values are fine too.
    sandbox(
        &t,
        json!({"checkpoint": ck_id, "backend": "function", "image": "busybox"}),
    )
    .await;

    let r = call(&t.app, Method::GET, "/v1/checkpoints", None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["checkpoints"][0]["checkpoint_id"], json!(ck_id));
    let r = call(
        &t.app,
        Method::GET,
        &format!("/v1/checkpoints/{ck_id}"),
        None,
    )
    .await;
    assert_eq!(r.json(), ck);

    // Forks do not depend on their checkpoint: delete works while they live.
    let r = call(
        &t.app,
        Method::DELETE,
        &format!("/v1/checkpoints/{ck_id}"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(t.node.checkpoints.lock().unwrap().is_empty());
    let r = call(
        &t.app,
        Method::GET,
        &format!("/v1/checkpoints/{ck_id}"),
        None,
    )
    .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::NOT_FOUND, "not_found")
    );
    let r = call(
        &t.app,
        Method::DELETE,
        &format!("/v1/checkpoints/{ck_id}"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "idempotent");
    let r = post(&t.app, "/v1/sandboxes", json!({"checkpoint": ck_id})).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::NOT_FOUND, "not_found")
    );
}

#[tokio::test]
async fn bad_input_gets_stable_codes() {
    let t = setup("ck-bad");
    let id = sandbox(&t, json!({"image": "busybox", "labels": {"job": "p"}})).await;
    let ck = checkpoint(&t, &id).await["checkpoint_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let cases = [
        (
            json!({"checkpoint": ck, "image": "python"}),
            StatusCode::BAD_REQUEST,
            "invalid_argument",
        ),
        (
            json!({"checkpoint": ck, "backend": "container"}),
            StatusCode::BAD_REQUEST,
            "invalid_argument",
        ),
        (
            json!({"checkpoint": "ck-nope"}),
            StatusCode::BAD_REQUEST,
            "invalid_argument",
        ),
        (
            json!({"checkpoint": 5}),
            StatusCode::BAD_REQUEST,
            "invalid_argument",
        ),
        (
            json!({"checkpoint": "ck-00000000000000000000"}),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
    ];
    for (body, status, code) in cases {
        let r = post(&t.app, "/v1/sandboxes", body.clone()).await;
        assert_eq!(
            (r.status, r.code()),
            (status, code.to_owned()),
            "{body}: {:?}",
            r.body
        );
    }
    let r = post(&t.app, "/v1/sandboxes", json!([1])).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = call(
        &t.app,
        Method::POST,
        "/v1/sandboxes/sb-00000000000000000000/checkpoints",
        None,
    )
    .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::NOT_FOUND, "not_found")
    );
    let r = call(&t.app, Method::GET, "/v1/checkpoints/whatever", None).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (StatusCode::NOT_FOUND, "not_found")
    );
    // A paused sandbox can be checkpointed; nothing else changes about it.
    let r = post(
        &t.app,
        "/v1/sandboxes:pause",
        json!({"labels": {"job": "p"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    checkpoint(&t, &id).await;
    let r = call(&t.app, Method::PUT, &format!("/v1/checkpoints/{ck}"), None).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn checkpoints_belong_to_their_tenant() {
    let t = setup("ck-tenants");
    let (_, a) = create_key(&*t.st.store, "a", false, Quota::default())
        .await
        .unwrap();
    let (_, b) = create_key(&*t.st.store, "b", false, Quota::default())
        .await
        .unwrap();
    let (_, admin) = create_key(&*t.st.store, "root", true, Quota::default())
        .await
        .unwrap();
    let req = |key: &str, m: Method, uri: &str, body: Option<Value>| {
        let auth = format!("Bearer {key}");
        let app = t.app.clone();
        let uri = uri.to_owned();
        async move {
            let hdr = [("authorization", auth.as_str())];
            match body {
                Some(v) => {
                    raw(
                        &app,
                        m,
                        &uri,
                        Some("application/json"),
                        serde_json::to_vec(&v).unwrap(),
                        &hdr,
                    )
                    .await
                }
                None => raw(&app, m, &uri, None, Vec::new(), &hdr).await,
            }
        }
    };
    let r = req(
        &a,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"image": "busybox"})),
    )
    .await;
    let id = r.json()["id"].as_str().unwrap().to_owned();
    let r = req(
        &a,
        Method::POST,
        &format!("/v1/sandboxes/{id}/checkpoints"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let ck = r.json()["checkpoint_id"].as_str().unwrap().to_owned();
    // b can neither checkpoint a's sandbox nor see, fork or delete a's checkpoint.
    let r = req(
        &b,
        Method::POST,
        &format!("/v1/sandboxes/{id}/checkpoints"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = req(&b, Method::GET, &format!("/v1/checkpoints/{ck}"), None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = req(&b, Method::GET, "/v1/checkpoints", None).await;
    assert_eq!(r.json()["checkpoints"], json!([]));
    let r = req(
        &b,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"checkpoint": ck})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = req(&b, Method::DELETE, &format!("/v1/checkpoints/{ck}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(
        t.node.checkpoints.lock().unwrap().len(),
        1,
        "b deleted nothing"
    );
    // a and the admin can.
    let r = req(
        &a,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"checkpoint": ck})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let r = req(&admin, Method::GET, "/v1/checkpoints", None).await;
    assert_eq!(r.json()["checkpoints"][0]["checkpoint_id"], json!(ck));
    let r = req(&a, Method::DELETE, &format!("/v1/checkpoints/{ck}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(t.node.checkpoints.lock().unwrap().is_empty());
}

#[tokio::test]
async fn records_survive_a_restart_and_orphans_are_pruned() {
    let t = setup("ck-restart");
    let id = sandbox(&t, json!({"image": "busybox"})).await;
    let ck = checkpoint(&t, &id).await["checkpoint_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // A node checkpoint without a record (a crash between copy and insert).
    let orphan = "ck-0123456789abcdef0123".to_string();
    let parent = t.node.creates.lock().unwrap()[0].clone();
    t.node
        .checkpoints
        .lock()
        .unwrap()
        .insert(orphan.clone(), (parent, Default::default()));
    crate::checkpoints::recover(&t.st).await.unwrap();
    let left: Vec<String> = t.node.checkpoints.lock().unwrap().keys().cloned().collect();
    assert_eq!(left, vec![ck.clone()]);
    // A reopened store still has the record.
    let store = crate::store::Store::open(&t.st.cfg.data_dir.join("sandlot.db")).unwrap();
    assert_eq!(store.get_checkpoint(&ck).unwrap().unwrap().sandbox_id, id);
    // A record whose files are gone is dropped.
    t.node.checkpoints.lock().unwrap().clear();
    crate::checkpoints::recover(&t.st).await.unwrap();
    assert!(t.st.store.get_checkpoint(&ck).await.unwrap().is_none());
}

#[tokio::test]
async fn openapi_lists_checkpoint_routes() {
    let t = setup("ck-openapi");
    let doc = call(&t.app, Method::GET, "/openapi.json", None)
        .await
        .json();
    for route in [
        "/v1/sandboxes/{id}/checkpoints",
        "/v1/checkpoints",
        "/v1/checkpoints/{checkpoint_id}",
    ] {
        assert!(
            doc["paths"].get(route).is_some(),
            "{route} missing from openapi.json"
        );
    }
    assert!(
        doc["components"]["schemas"]["CreateSandboxRequest"]["properties"]["checkpoint"]
            .is_object()
    );
}
