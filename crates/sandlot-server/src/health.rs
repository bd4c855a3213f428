//! `GET /v1/ping`, `/healthz`, `/openapi.json` (`/metrics` is in [`crate::metrics`]).
use crate::error::{ApiResult, Json};
use crate::SharedState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use std::collections::BTreeMap;

/// The OpenAPI 3.1 document of this API (`docs/openapi.json`, compiled in).
pub const OPENAPI_JSON: &str = include_str!("../../../docs/openapi.json");

/// `GET /v1/ping` → `pong` (text/plain).
pub async fn ping() -> &'static str {
    "pong"
}

/// `GET /healthz` → `{"status":"ok","node":NAME,"cgroup_version":"v1"|"v2",
/// "backends":{"function":"ok"|"unavailable: why",...},"runtimes":{"runc":"ok"|"unavailable:
/// why",...},"accel":{"name":"kvm"|"tcg"|null,"why":TEXT}|null,"sandboxes":N}` (`runtimes`:
/// the container backend's OCI runtimes; `accel`: the QEMU backends' accelerator, `name`
/// null while the start-up probe runs, the whole field null without a QEMU backend;
/// `server_id`: this server's id; `leader`: whether it runs the singletons now, see
/// [`crate::leader`]; `nodes`: in cluster mode `{"total": N, "simulated": S, "real": R}`, the
/// registered nodes with the simulated ones (`sandlot node --simulate`) counted apart, else
/// null).
pub async fn healthz(State(st): State<SharedState>) -> ApiResult<Json<serde_json::Value>> {
    let info = st.node.info();
    let status = |r: &Result<(), String>| match r {
        Ok(()) => "ok".to_owned(),
        Err(why) => format!("unavailable: {why}"),
    };
    let backends: BTreeMap<String, String> = info
        .backends
        .iter()
        .map(|(b, r)| (b.as_str().to_owned(), status(r)))
        .collect();
    let runtimes: BTreeMap<String, String> = info
        .runtimes
        .iter()
        .map(|(n, r)| (n.clone(), status(r)))
        .collect();
    let accel = info
        .accel
        .map(|(name, why)| serde_json::json!({"name": name, "why": why}));
    let n: u64 = st.store.count_by_state().await?.iter().map(|c| c.2).sum();
    let nodes = st.cluster.get().map(|c| {
        let all = c.nodes();
        let sim = all.values().filter(|r| r.simulated).count();
        serde_json::json!({"total": all.len(), "simulated": sim, "real": all.len() - sim})
    });
    Ok(Json(serde_json::json!({
        "status": "ok",
        "node": info.name,
        "cgroup_version": info.cgroup_version,
        "backends": backends,
        "runtimes": runtimes,
        "accel": accel,
        "sandboxes": n,
        "nodes": nodes,
        "server_id": st.cfg.server_id,
        "leader": st.leader.load(std::sync::atomic::Ordering::SeqCst),
        "version": env!("CARGO_PKG_VERSION"),
    })))
}

/// `GET /openapi.json` → [`OPENAPI_JSON`].
pub async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON)
}
