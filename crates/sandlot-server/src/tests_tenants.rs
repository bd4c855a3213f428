//! Router-level tests of API keys, quotas and tenant isolation ([`crate::auth`]).
use crate::auth::{create_key, key_digest, presented_key, Principal};
use crate::store::Quota;
use crate::test_support::*;
use axum::http::{HeaderMap, Method, StatusCode};
use base64::Engine;
use serde_json::{json, Value};

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

async fn as_key(t: &T, key: &str, method: Method, uri: &str, body: Option<Value>) -> Resp {
    let auth = bearer(key);
    let hdr = [("authorization", auth.as_str())];
    match body {
        Some(v) => {
            raw(
                &t.app,
                method,
                uri,
                Some("application/json"),
                serde_json::to_vec(&v).unwrap(),
                &hdr,
            )
            .await
        }
        None => raw(&t.app, method, uri, None, Vec::new(), &hdr).await,
    }
}

async fn key(t: &T, name: &str, admin: bool, quota: Quota) -> (String, String) {
    let (row, key) = create_key(&*t.st.store, name, admin, quota).await.unwrap();
    (row.id, key)
}

fn ids(r: &Resp) -> Vec<String> {
    r.json()["sandboxes"]
        .as_array()
        .unwrap_or_else(|| panic!("{:?}", r.body))
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn keys_are_random_and_stored_hashed() {
    let t = setup("keys-hashed");
    let (row, k) = create_key(&*t.st.store, "a", false, Quota::default())
        .await
        .unwrap();
    let (_, k2) = create_key(&*t.st.store, "b", false, Quota::default())
        .await
        .unwrap();
    assert!(k.starts_with("sk-") && k.len() == 3 + 43, "{k}");
    assert_ne!(k, k2);
    assert!(
        row.id.starts_with("key_") && row.id.len() == 20,
        "{}",
        row.id
    );
    let stored =
        t.st.store
            .key_by_digest(&key_digest(&k))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(stored.id, row.id);
    assert_eq!(stored.digest.len(), 64);
    assert!(!stored.digest.contains(&k[3..]), "only the digest is kept");
    assert!(t.st.store.revoke_key(&row.id, 5).await.unwrap());
    assert!(
        !t.st.store.revoke_key(&row.id, 6).await.unwrap(),
        "already revoked"
    );
    assert!(t.st.store.has_keys().await.unwrap());
}

#[test]
fn credentials_bearer_and_basic() {
    let mut h = HeaderMap::new();
    assert_eq!(presented_key(&h), None);
    h.insert("authorization", "Bearer sk-abc".parse().unwrap());
    assert_eq!(presented_key(&h).as_deref(), Some("sk-abc"));
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    h.insert(
        "authorization",
        format!("Basic {}", b64("admin:sk-xyz")).parse().unwrap(),
    );
    assert_eq!(presented_key(&h).as_deref(), Some("sk-xyz"));
    h.insert(
        "authorization",
        format!("Basic {}", b64("sk-user:")).parse().unwrap(),
    );
    assert_eq!(presented_key(&h).as_deref(), Some("sk-user"));
    h.insert("authorization", "Digest foo".parse().unwrap());
    assert_eq!(presented_key(&h), None);
    let p = Principal {
        tenant: Some("key_a".into()),
        admin: false,
        quota: None,
    };
    assert!(p.sees(Some("key_a")) && !p.sees(Some("key_b")) && !p.sees(None));
    assert!(Principal::anonymous().sees(Some("key_b")));
}

#[test]
fn every_sandbox_and_trajectory_route_is_scoped() {
    use crate::auth::{scoped, Scoped};
    assert_eq!(scoped("/v1/sandboxes/{id}"), Some(Scoped::Sandbox("id")));
    assert_eq!(
        scoped("/v1/sandboxes/{id}/exec"),
        Some(Scoped::Sandbox("id"))
    );
    // Routes added later, whatever their parameter is called.
    assert_eq!(
        scoped("/v1/sandboxes/{sandbox_id}/processes/{pid}"),
        Some(Scoped::Sandbox("sandbox_id"))
    );
    assert_eq!(
        scoped("/v1/trajectories/{*id}"),
        Some(Scoped::Trajectory("id"))
    );
    for open in [
        "/v1/sandboxes",
        "/v1/sandboxes:pause",
        "/v1/events",
        "/run_code",
        "",
    ] {
        assert_eq!(scoped(open), None, "{open}");
    }
}

#[tokio::test]
async fn without_keys_everything_is_open() {
    let t = setup("tenant-open");
    let r = call(&t.app, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let r = call(&t.app, Method::GET, "/metrics", None).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn missing_bad_and_revoked_keys_are_401() {
    let t = setup("tenant-401");
    let (id, k) = key(&t, "a", false, Quota::default()).await;
    for (method, uri) in [
        (Method::GET, "/v1/sandboxes"),
        (Method::POST, "/v1/sandboxes"),
        (Method::GET, "/v1/sandboxes/sb-00000000000000000000"),
        (Method::DELETE, "/v1/sandboxes/sb-00000000000000000000"),
        (Method::GET, "/v1/events"),
        (Method::POST, "/run_code"),
        (Method::GET, "/v1/trajectories/t1"),
        (Method::GET, "/metrics"),
        (Method::GET, "/"),
        (Method::GET, "/no/such/route"),
    ] {
        let r = call(&t.app, method.clone(), uri, None).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{method} {uri}");
        assert_eq!(r.code(), "unauthenticated");
        let challenges: Vec<_> = r.headers.get_all("www-authenticate").iter().collect();
        assert_eq!(challenges.len(), 2, "{challenges:?}");
        let r = as_key(&t, "sk-wrong", method.clone(), uri, None).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{method} {uri}");
        assert_eq!(r.message(), "invalid API key");
    }
    // Public routes need no key.
    for uri in ["/v1/ping", "/healthz", "/openapi.json"] {
        let r = call(&t.app, Method::GET, uri, None).await;
        assert_eq!(r.status, StatusCode::OK, "{uri}");
    }
    let r = as_key(&t, &k, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(r.status, StatusCode::OK);
    t.st.store.revoke_key(&id, 1).await.unwrap();
    let r = as_key(&t, &k, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (StatusCode::UNAUTHORIZED, "API key revoked")
    );
}

#[tokio::test]
async fn admin_routes_need_an_admin_key() {
    let t = setup("tenant-admin");
    let (_, user) = key(&t, "u", false, Quota::default()).await;
    let (_, admin) = key(&t, "ops", true, Quota::default()).await;
    for uri in ["/metrics", "/"] {
        let r = as_key(&t, &user, Method::GET, uri, None).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{uri}");
        assert_eq!(r.code(), "permission_denied");
        let r = as_key(&t, &admin, Method::GET, uri, None).await;
        assert_eq!(r.status, StatusCode::OK, "{uri}");
    }
    // Basic auth (a browser on the status page) with the key as password.
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("ops:{admin}"))
    );
    let r = raw(
        &t.app,
        Method::GET,
        "/",
        None,
        vec![],
        &[("authorization", &basic)],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn tenants_cannot_touch_each_others_sandboxes() {
    let t = setup("tenant-iso");
    let (ta, a) = key(&t, "a", false, Quota::default()).await;
    let (_, b) = key(&t, "b", false, Quota::default()).await;
    let (_, admin) = key(&t, "ops", true, Quota::default()).await;
    let r = as_key(
        &t,
        &a,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"labels": {"job": "j"}})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let sa = r.json()["id"].as_str().unwrap().to_owned();
    let r = as_key(
        &t,
        &b,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"labels": {"job": "j"}})),
    )
    .await;
    let sb = r.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(t.st.store.get(&sa).await.unwrap().unwrap().tenant, Some(ta));

    // B sees only its own.
    let r = as_key(&t, &b, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(ids(&r), vec![sb.clone()]);
    let r = as_key(&t, &admin, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(ids(&r), vec![sa.clone(), sb.clone()]);

    // Every sandbox route: A's sandbox looks exactly like an unknown id to B.
    let exec = json!({"cmd": ["true"]});
    let cases: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, format!("/v1/sandboxes/{sa}"), None),
        (
            Method::POST,
            format!("/v1/sandboxes/{sa}/exec"),
            Some(exec.clone()),
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{sa}/exec?stream=true"),
            Some(exec.clone()),
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{sa}/keepalive"),
            Some(json!({})),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{sa}/files?path=/etc/hostname"),
            None,
        ),
        (
            Method::PUT,
            format!("/v1/sandboxes/{sa}/files?path=/tmp/x"),
            None,
        ),
        (
            Method::DELETE,
            format!("/v1/sandboxes/{sa}/files?path=/tmp/x"),
            None,
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{sa}/files/list?path=/"),
            None,
        ),
    ];
    for (m, uri, body) in cases {
        let r = as_key(&t, &b, m.clone(), &uri, body.clone()).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{m} {uri}: {:?}", r.body);
        assert_eq!(r.message(), format!("no sandbox {sa:?}"), "{m} {uri}");
        let unknown = uri.replace(&sa, "sb-00000000000000000000");
        let r2 = as_key(&t, &b, m.clone(), &unknown, body).await;
        assert_eq!(r2.status, StatusCode::NOT_FOUND, "{m} {unknown}");
    }
    let r = as_key(&t, &b, Method::DELETE, &format!("/v1/sandboxes/{sa}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "as for an unknown id");
    assert!(t.node.ids().contains(&sa), "B's delete did nothing");

    // Label pause by B touches only B's sandbox, though A's has the same label.
    let r = as_key(
        &t,
        &b,
        Method::POST,
        "/v1/sandboxes:pause",
        Some(json!({"labels": {"job": "j"}})),
    )
    .await;
    assert_eq!(r.json()["sandboxes"], json!([sb]));
    let r = as_key(&t, &a, Method::GET, &format!("/v1/sandboxes/{sa}"), None).await;
    assert_eq!(r.json()["state"], "running");
    let r = as_key(
        &t,
        &a,
        Method::POST,
        "/v1/sandboxes:resume",
        Some(json!({"labels": {"job": "j"}})),
    )
    .await;
    assert_eq!(r.json()["sandboxes"], json!([]), "A cannot resume B's");

    // Events: B sees only events of its own sandboxes, also when asking for A's.
    let r = as_key(&t, &b, Method::GET, "/v1/events", None).await;
    let evs = r.json()["events"].as_array().unwrap().clone();
    assert!(!evs.is_empty());
    assert!(evs.iter().all(|e| e["sandbox"] == json!(sb)), "{evs:?}");
    let r = as_key(
        &t,
        &b,
        Method::GET,
        &format!("/v1/events?sandbox={sa}"),
        None,
    )
    .await;
    assert_eq!(r.json()["events"], json!([]));
    let r = as_key(
        &t,
        &admin,
        Method::GET,
        &format!("/v1/events?sandbox={sa}"),
        None,
    )
    .await;
    assert!(!r.json()["events"].as_array().unwrap().is_empty());

    // The owner still can do everything.
    let r = as_key(
        &t,
        &a,
        Method::POST,
        &format!("/v1/sandboxes/{sa}/exec"),
        Some(exec),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let r = as_key(&t, &a, Method::DELETE, &format!("/v1/sandboxes/{sa}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(!t.node.ids().contains(&sa));
}

#[tokio::test]
async fn quotas_refuse_with_429_and_create_nothing() {
    let t = setup("tenant-quota");
    let q = Quota {
        max_sandboxes: Some(2),
        max_cpu: Some(1.5),
        max_memory_mib: Some(1024),
    };
    let (_, a) = key(&t, "a", false, q).await;
    let (_, b) = key(&t, "b", false, Quota::default()).await;
    let mk = |body: Value| {
        let a = a.clone();
        let t = &t;
        async move { as_key(t, &a, Method::POST, "/v1/sandboxes", Some(body)).await }
    };
    let r = mk(json!({"cpu": 1.0, "memory_mib": 512})).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = mk(json!({"cpu": 1.0, "memory_mib": 256})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
    assert_eq!(r.code(), "resource_exhausted");
    assert!(r.message().contains("max_cpu 1.5"), "{}", r.message());
    let r = mk(json!({"cpu": 0.5, "memory_mib": 600})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        r.message().contains("max_memory_mib 1024"),
        "{}",
        r.message()
    );
    let r = mk(json!({"cpu": 0.5, "memory_mib": 512})).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = mk(json!({"cpu": 0.01, "memory_mib": 16})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        r.message().contains("at most 2 sandboxes"),
        "{}",
        r.message()
    );
    assert_eq!(t.node.ids().len(), 2, "refused creates made nothing");
    assert_eq!(t.st.store.list().await.unwrap().len(), 2);
    // Another tenant's quota is its own.
    let r = as_key(&t, &b, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(r.status, StatusCode::CREATED);
    // run_code over the quota: HTTP 429, not a SandboxError verdict.
    let r = as_key(
        &t,
        &a,
        Method::POST,
        "/run_code",
        Some(json!({"code": "print(1)", "language": "python"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
    assert_eq!(t.node.ids().len(), 3);
}

#[tokio::test]
async fn idempotency_keys_and_trajectories_are_per_tenant() {
    let t = setup("tenant-scoped");
    let (_, a) = key(&t, "a", false, Quota::default()).await;
    let (_, b) = key(&t, "b", false, Quota::default()).await;
    let post = |k: &str, body: Value| {
        let auth = bearer(k);
        let t = &t;
        async move {
            raw(
                &t.app,
                Method::POST,
                "/v1/sandboxes",
                Some("application/json"),
                serde_json::to_vec(&body).unwrap(),
                &[("authorization", &auth), ("idempotency-key", "k1")],
            )
            .await
        }
    };
    let ra = post(&a, json!({})).await;
    let rb = post(&b, json!({})).await;
    assert_eq!(
        (ra.status, rb.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_ne!(
        ra.json()["id"],
        rb.json()["id"],
        "B did not get A's sandbox"
    );

    let r = as_key(
        &t,
        &a,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "job/ep-1"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let r = as_key(
        &t,
        &b,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"trajectory": "job/ep-1"})),
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::CONFLICT,
        "B cannot reattach to A's trajectory"
    );
    let r = as_key(&t, &b, Method::GET, "/v1/trajectories/job%2Fep-1", None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = as_key(&t, &b, Method::DELETE, "/v1/trajectories/job%2Fep-1", None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = as_key(&t, &a, Method::GET, "/v1/trajectories/job%2Fep-1", None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
}

#[tokio::test]
async fn non_loopback_listen_needs_keys() {
    let tmp = data_dir("tenant-bind");
    let dir = tmp.path().to_path_buf();
    let mut cfg = crate::ServerConfig::new(dir.clone());
    cfg.listen = "0.0.0.0:0".parse().unwrap();
    let node = std::sync::Arc::new(sandlot_node_fake::FakeNode::default());
    let err = crate::Server::bind(cfg.clone(), node.clone())
        .await
        .err()
        .expect("refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("refusing to listen on 0.0.0.0:0"), "{msg}");
    assert!(msg.contains("sandlot key create"), "{msg}");
    let store = crate::store::Store::open(&dir.join("sandlot.db")).unwrap();
    create_key(&store, "ops", true, Quota::default())
        .await
        .unwrap();
    drop(store);
    let s = crate::Server::bind(cfg, node).await.expect("keys present");
    assert!(!s.local_addr().unwrap().ip().is_loopback());
    // Loopback without keys stays allowed (the default).
    let lo = data_dir("tenant-bind-lo");
    let mut cfg = crate::ServerConfig::new(lo.path().to_path_buf());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    let node = std::sync::Arc::new(sandlot_node_fake::FakeNode::default());
    crate::Server::bind(cfg, node)
        .await
        .expect("loopback is fine");
}
