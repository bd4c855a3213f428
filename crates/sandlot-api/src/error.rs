//! Error body and stable error codes.
use serde::{Deserialize, Serialize};
use std::fmt;

/// Stable, machine-readable error code. Clients switch on this, never on the message.
///
/// The HTTP status of each code is fixed by [`ErrorCode::http_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed or a field is out of range (HTTP 400).
    InvalidArgument,
    /// The sandbox, file or image does not exist (HTTP 404).
    NotFound,
    /// The request conflicts with current state (HTTP 409).
    Conflict,
    /// A quota or capacity limit was hit; retry later (HTTP 429).
    ResourceExhausted,
    /// The operation did not finish in time (HTTP 504).
    DeadlineExceeded,
    /// The feature or backend is not available on this host; the message says why (HTTP 503).
    Unavailable,
    /// The caller may not do this (HTTP 403).
    PermissionDenied,
    /// No or bad credentials (HTTP 401).
    Unauthenticated,
    /// The request body is larger than the limit (HTTP 413).
    PayloadTooLarge,
    /// A fault inside Sandlot; logs carry the cause (HTTP 500).
    Internal,
}

impl ErrorCode {
    /// The HTTP status code that carries this error.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::ResourceExhausted => 429,
            ErrorCode::DeadlineExceeded => 504,
            ErrorCode::Unavailable => 503,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::Internal => 500,
        }
    }

    /// The snake_case wire name, e.g. `"not_found"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::ResourceExhausted => "resource_exhausted",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error as carried on the wire: `{"code": "...", "message": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    /// Stable code.
    pub code: ErrorCode,
    /// Human-readable explanation; may change between versions.
    pub message: String,
}

impl ApiError {
    /// Build an error from a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

/// The body of every error response: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ApiError,
}
