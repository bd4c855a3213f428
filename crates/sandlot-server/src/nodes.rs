//! `GET /v1/nodes`: the nodes this server places sandboxes on.
use crate::error::{ApiResult, Json};
use crate::SharedState;
use axum::extract::State;

/// `GET /v1/nodes` (admin key when authentication is on) →
/// `{"cluster": bool, "simulated": S, "real": R, "nodes": [NodeRecord + "kind", ...]}`, by
/// name.
///
/// In cluster mode (`sandlot server --etcd`) `nodes` are the records registered in etcd now
/// (`sandlot_cluster::NodeRecord` JSON: name, advertise_url, capacity, usage, backends,
/// runtimes, accelerator, cached images and layers, labels, jobs, started_at, and
/// `simulated`: true for identities of `sandlot node --simulate`, whose sandboxes are
/// records and whose exec runs nothing), each with `kind`: `"simulated"` or `"real"`
/// (the same fact as a label for people); `simulated` / `real` at the top count them.
/// Outside cluster mode `cluster` is false and `nodes` holds the one node as
/// `{"name": NAME, "simulated": false, "kind": "real"}`.
pub async fn list(State(st): State<SharedState>) -> ApiResult<Json<serde_json::Value>> {
    Ok(Json(match st.cluster.get() {
        Some(c) => {
            let mut sim = 0;
            let nodes: Vec<serde_json::Value> = c
                .nodes()
                .values()
                .map(|n| {
                    sim += usize::from(n.simulated);
                    let mut v = serde_json::to_value(&**n).unwrap_or_default();
                    v["kind"] = kind(n.simulated).into();
                    v
                })
                .collect();
            serde_json::json!({
                "cluster": true,
                "simulated": sim,
                "real": nodes.len() - sim,
                "nodes": nodes,
            })
        }
        None => serde_json::json!({
            "cluster": false,
            "simulated": 0,
            "real": 1,
            "nodes": [{"name": st.node_name, "simulated": false, "kind": kind(false)}],
        }),
    }))
}

/// The label of a node for people: `"simulated"` or `"real"`.
pub fn kind(simulated: bool) -> &'static str {
    if simulated {
        "simulated"
    } else {
        "real"
    }
}
