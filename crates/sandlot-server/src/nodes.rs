//! `GET /v1/nodes`: the nodes this server places sandboxes on.
use crate::error::{ApiResult, Json};
use crate::SharedState;
use axum::extract::State;

/// `GET /v1/nodes` (admin key when authentication is on) →
/// `{"cluster": bool, "nodes": [NodeRecord, ...]}`, by name.
///
/// In cluster mode (`sandlot server --etcd`) `nodes` are the records registered in etcd now
/// (`sandlot_cluster::NodeRecord` JSON: name, advertise_url, capacity, usage, backends,
/// runtimes, accelerator, cached images and layers, labels, jobs, started_at, and
/// `simulated`: true for identities of `sandlot node --simulate`, whose sandboxes are
/// records and whose exec runs nothing). Outside cluster mode `cluster` is false and
/// `nodes` holds the one node as `{"name": NAME, "simulated": false}`.
pub async fn list(State(st): State<SharedState>) -> ApiResult<Json<serde_json::Value>> {
    Ok(Json(match st.cluster.get() {
        Some(c) => {
            let nodes: Vec<_> = c.nodes().into_values().collect();
            serde_json::json!({"cluster": true, "nodes": nodes})
        }
        None => serde_json::json!({
            "cluster": false,
            "nodes": [{"name": st.node_name, "simulated": false}],
        }),
    }))
}
