//! `POST /v1/sandboxes:batch`: many creates in one call (docs/api.md, "Batch create").
use crate::{ApiError, CreateSandboxRequest, Sandbox};
use serde::{Deserialize, Serialize};

/// Most sandboxes one batch may ask for (`count`, or the length of `items`); more is 400
/// `invalid_argument` for the whole batch.
pub const MAX_BATCH: usize = 1000;

/// One item's outcome in a [`BatchCreateResponse`], in request order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchItem {
    /// Position of the item in the request (0-based; with `count`: 0..count).
    pub index: usize,
    /// The HTTP status the item would have had as a single create: 201 created, 200 an
    /// `Idempotency-Key` replay, else the error's status (429 over quota or no capacity,
    /// 400 a bad item, ...).
    pub status: u16,
    /// The sandbox (state `running`, or `creating` for a replay still in flight) when the
    /// item succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    /// The error (stable code + message) when it failed; nothing of it was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

/// `POST /v1/sandboxes:batch` answer (HTTP 200 whenever the batch itself was valid, also
/// when some or all items failed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchCreateResponse {
    /// One entry per requested sandbox, in request order.
    pub results: Vec<BatchItem>,
    /// How many items have a sandbox (created now or replayed).
    pub created: usize,
    /// How many items failed.
    pub failed: usize,
}

/// `POST /v1/sandboxes:batch` body as the Rust client sends it: either one create request
/// repeated `count` times (its fields at the top level, plus `count`), or a list of
/// create requests in `items`. Exactly one of the two forms.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum BatchCreateRequest {
    /// `{...create fields..., "count": N}`.
    Count {
        /// The create request every sandbox gets.
        #[serde(flatten)]
        spec: Box<CreateSandboxRequest>,
        /// How many (1..=[`MAX_BATCH`]).
        count: usize,
    },
    /// `{"items": [create, ...]}` (1..=[`MAX_BATCH`] entries).
    Items {
        /// The create requests, each as the body of `POST /v1/sandboxes`.
        items: Vec<CreateSandboxRequest>,
    },
}
