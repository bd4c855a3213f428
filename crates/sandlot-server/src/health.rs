//! `GET /v1/ping`, `/healthz`, `/metrics`, `/openapi.json`.
use crate::error::{ApiResult, Json};
use crate::SharedState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The OpenAPI 3.1 document of this API (`docs/openapi.json`, compiled in).
pub const OPENAPI_JSON: &str = include_str!("../../../docs/openapi.json");

/// `GET /v1/ping` → `pong` (text/plain).
pub async fn ping() -> &'static str {
    "pong"
}

/// `GET /healthz` → `{"status":"ok","node":NAME,"cgroup_version":"v1"|"v2",
/// "backends":{"function":"ok"|"unavailable: why",...},"sandboxes":N}`.
pub async fn healthz(State(st): State<SharedState>) -> ApiResult<Json<serde_json::Value>> {
    let info = st.node.info();
    let backends: BTreeMap<String, String> = info
        .backends
        .iter()
        .map(|(b, r)| {
            let s = match r {
                Ok(()) => "ok".to_owned(),
                Err(why) => format!("unavailable: {why}"),
            };
            (b.as_str().to_owned(), s)
        })
        .collect();
    let n = st.store.list()?.len();
    Ok(Json(serde_json::json!({
        "status": "ok",
        "node": info.name,
        "cgroup_version": info.cgroup_version,
        "backends": backends,
        "sandboxes": n,
        "version": env!("CARGO_PKG_VERSION"),
    })))
}

/// `GET /metrics` → Prometheus text format 0.0.4: `sandlot_sandboxes{backend,state}` (gauge,
/// from the store), `sandlot_run_code_running` and `sandlot_run_code_waiting` (gauges).
/// Latency histograms come with a later issue.
pub async fn metrics(State(st): State<SharedState>) -> ApiResult<impl IntoResponse> {
    let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
    for r in st.store.list()? {
        *counts
            .entry((r.backend.as_str().into(), r.state.as_str().into()))
            .or_default() += 1;
    }
    let mut s = String::new();
    s.push_str("# HELP sandlot_sandboxes Sandboxes by backend and state.\n# TYPE sandlot_sandboxes gauge\n");
    for ((b, state), n) in counts {
        let _ = writeln!(
            s,
            "sandlot_sandboxes{{backend=\"{b}\",state=\"{state}\"}} {n}"
        );
    }
    let (running, waiting) = st.run_code_gate.load();
    let _ = writeln!(s, "# HELP sandlot_run_code_running run_code calls running.\n# TYPE sandlot_run_code_running gauge\nsandlot_run_code_running {running}");
    let _ = writeln!(s, "# HELP sandlot_run_code_waiting run_code calls waiting for a slot.\n# TYPE sandlot_run_code_waiting gauge\nsandlot_run_code_waiting {waiting}");
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s))
}

/// `GET /openapi.json` → [`OPENAPI_JSON`].
pub async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON)
}
