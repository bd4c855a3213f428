//! The one place where errors become HTTP responses.
//!
//! Every handler returns [`ServerError`]; its [`IntoResponse`] picks the status from
//! [`ErrorCode::http_status`] and writes `{"error": {"code", "message"}}`
//! ([`sandlot_api::ErrorBody`]). Internal errors are logged with their whole source chain;
//! the client gets the top-level message only.
use crate::store::StoreError;
use crate::trajectory_store::TrajectoryStoreError;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sandlot_api::{ApiError, ErrorBody, ErrorCode};
use sandlot_node_api::NodeError;

/// Any error a handler can answer with.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A validation or protocol error decided by the server itself.
    #[error("{0}")]
    Api(ApiError),
    /// An error of the node.
    #[error("node: {0}")]
    Node(#[from] NodeError),
    /// An error of the SQLite store.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// An error of the trajectory log.
    #[error("{0}")]
    Trajectory(#[from] TrajectoryStoreError),
    /// An API error that also asks the client to retry after some seconds
    /// (`Retry-After` header; overload answers of `run_code`).
    #[error("{error}")]
    RetryAfter {
        /// The error.
        error: ApiError,
        /// Seconds for `Retry-After`.
        seconds: u64,
    },
}

impl ServerError {
    /// A server-decided error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ServerError::Api(ApiError::new(code, message))
    }

    /// `400 invalid_argument`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }

    /// `404 not_found` for a sandbox id.
    pub fn no_sandbox(id: &str) -> Self {
        Self::new(ErrorCode::NotFound, format!("no sandbox {id:?}"))
    }

    /// The wire error (code + message) of this error.
    pub fn api_error(&self) -> ApiError {
        match self {
            ServerError::Api(e) | ServerError::RetryAfter { error: e, .. } => e.clone(),
            ServerError::Node(e) => ApiError::new(e.code(), e.to_string()),
            // The database is down or out of connections: retry later.
            ServerError::Store(e @ StoreError::Unavailable(_)) => {
                ApiError::new(ErrorCode::Unavailable, e.to_string())
            }
            ServerError::Store(e @ StoreError::Pg { source, .. }) if pg_unavailable(source) => {
                ApiError::new(ErrorCode::Unavailable, e.to_string())
            }
            ServerError::Store(e) => ApiError::new(ErrorCode::Internal, e.to_string()),
            // Another writer logged the step first: the caller's view is stale.
            ServerError::Trajectory(e @ TrajectoryStoreError::NotNext { .. }) => {
                ApiError::new(ErrorCode::Conflict, e.to_string())
            }
            // The database is down or out of connections: retry later.
            ServerError::Trajectory(e @ TrajectoryStoreError::Unavailable(_)) => {
                ApiError::new(ErrorCode::Unavailable, e.to_string())
            }
            ServerError::Trajectory(e @ TrajectoryStoreError::Pg { source, .. })
                if pg_unavailable(source) =>
            {
                ApiError::new(ErrorCode::Unavailable, e.to_string())
            }
            ServerError::Trajectory(e) => ApiError::new(ErrorCode::Internal, e.to_string()),
        }
    }
}

/// Whether a PostgreSQL error means "the database cannot answer now, retry later"
/// (answered `503 unavailable`, not `500 internal`): the connection is closed or broke
/// (an I/O error, no server error code), the server is shutting down or starting
/// (SQLSTATE 57P01 `admin_shutdown` — what a `pg_ctl stop` sends to every open connection
/// —, 57P02 `crash_shutdown`, 57P03 `cannot_connect_now`), or any class 08 connection
/// exception. SQLSTATE codes: PostgreSQL manual, appendix A "PostgreSQL Error Codes".
pub fn pg_unavailable(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        Some(c) => {
            let c = c.code();
            matches!(c, "57P01" | "57P02" | "57P03") || c.starts_with("08")
        }
        // No server answer at all: the connection failed under the query.
        None => std::error::Error::source(e)
            .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some()),
    }
}

/// The full source chain of an error, `a: b: c`, for logs (the node API's, so both sides
/// format a chain alike).
pub use sandlot_node_api::chain;

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        let api = self.api_error();
        if api.code == ErrorCode::Internal {
            tracing::error!(error = %chain(&self), "internal error");
        } else {
            tracing::debug!(code = %api.code, error = %chain(&self), "request failed");
        }
        let status = StatusCode::from_u16(api.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let exhausted = api.code == ErrorCode::ResourceExhausted;
        let mut resp = (status, axum::Json(ErrorBody { error: api })).into_response();
        if let ServerError::RetryAfter { seconds, .. } = self {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        } else if exhausted {
            // Capacity answers of the node (file read budget, process or space limits):
            // worth retrying later.
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(1u64));
        }
        resp
    }
}

/// A rejection of axum's body extractors: 413 (over the body limit) becomes
/// `payload_too_large`, everything else `invalid_argument` with axum's explanation.
fn rejection(status: StatusCode, text: String) -> ServerError {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ServerError::new(
            ErrorCode::PayloadTooLarge,
            format!("request body too large: {text}"),
        )
    } else {
        ServerError::invalid(text)
    }
}

impl From<JsonRejection> for ServerError {
    fn from(r: JsonRejection) -> Self {
        rejection(r.status(), r.body_text())
    }
}

impl From<BytesRejection> for ServerError {
    fn from(r: BytesRejection) -> Self {
        rejection(r.status(), r.body_text())
    }
}

impl From<QueryRejection> for ServerError {
    fn from(r: QueryRejection) -> Self {
        ServerError::invalid(r.body_text())
    }
}

impl From<PathRejection> for ServerError {
    fn from(r: PathRejection) -> Self {
        ServerError::invalid(r.body_text())
    }
}

/// Handler result.
pub type ApiResult<T> = Result<T, ServerError>;

/// `Json<T>` whose rejections (wrong content type, invalid JSON, unknown fields or enum
/// variants, body over the limit) answer with our JSON error body instead of axum's text.
///
/// The body must be a JSON **object** (RFC 8259 §4): serde would otherwise also build a
/// struct from a JSON array by field position (`["function","busybox",1,…]`), a second,
/// undocumented request shape that bypasses field names and `deny_unknown_fields`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

/// True for `application/json` and `application/*+json` (the rule of `axum::Json`).
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.strip_prefix("application/") {
        Some(sub) => sub == "json" || sub.ends_with("+json"),
        None => false,
    }
}

impl<T, S> axum::extract::FromRequest<S> for Json<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ServerError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ServerError> {
        if !json_content_type(req.headers()) {
            return Err(ServerError::invalid(
                "Expected request with `Content-Type: application/json`",
            ));
        }
        let bytes = Bytes::from_request(req, state).await?;
        let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
        if first != Some(&b'{') {
            // An empty or malformed body still gets serde's own message below when it
            // starts like an object; anything else is not an object at all.
            if first.is_some_and(|b| b"[\"-0123456789tfn".contains(b)) {
                return Err(ServerError::invalid("request body must be a JSON object"));
            }
        }
        let axum::Json(v) = axum::Json::<T>::from_bytes(&bytes)?;
        Ok(Json(v))
    }
}

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// `Query<T>` answering rejections with our JSON error body.
#[derive(Debug, Clone, Copy, Default, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ServerError))]
pub struct Query<T>(pub T);

/// `Path<T>` answering rejections with our JSON error body.
#[derive(Debug, Clone, Copy, Default, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ServerError))]
pub struct Path<T>(pub T);

/// Fallback for a known route called with a method it does not serve: `405` with our body
/// (code `invalid_argument`; the status stays 405 so HTTP clients see the usual meaning).
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let body = ErrorBody {
        error: ApiError::new(
            ErrorCode::InvalidArgument,
            format!("method {method} not allowed on {}", uri.path()),
        ),
    };
    (StatusCode::METHOD_NOT_ALLOWED, axum::Json(body)).into_response()
}

/// Fallback for unknown routes: `404 not_found` in our body.
pub async fn not_found_route(uri: axum::http::Uri) -> ServerError {
    ServerError::new(ErrorCode::NotFound, format!("no route {}", uri.path()))
}
