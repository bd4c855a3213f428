//! The Connect protocol (<https://connectrpc.com/docs/protocol>), JSON codec, as envd
//! speaks it: unary calls and server streams over HTTP/1.1 or HTTP/2.
//!
//! - **Unary**: request `Content-Type: application/json`, body one JSON message; answer
//!   200 `application/json` with one message, or the error's HTTP status (the spec's
//!   table, [`http_status`]) with `{"code": "not_found", "message": "…"}`.
//! - **Server stream**: request `Content-Type: application/connect+json`, body one
//!   envelope: 1 flag byte (0; bit 0 = compressed, refused), a 4-byte big-endian length,
//!   the JSON message. Answer 200 `application/connect+json`: one envelope per message,
//!   then the end-of-stream envelope (flag 2) holding `{}` or `{"error": {"code",
//!   "message"}}`. Errors found before the stream starts are answered the same way (200,
//!   end-of-stream envelope only), as the spec asks.
//!
//! - **Client stream** (`StreamInput`): request `application/connect+json`, body a
//!   sequence of message envelopes read as they arrive ([`Envelopes`]), ended by the end of
//!   the body; answer as a server stream with one message.
//!
//! The binary protobuf codec (`application/proto`, `application/connect+proto`) is served
//! by [`super::proto::codec`], a layer that transcodes such calls to and from this JSON
//! codec (the handlers speak only JSON). Any other content type gets 415 with a Connect
//! `unimplemented` error naming the served codecs.
use crate::error::ServerError;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sandlot_api::ErrorCode;

/// Prefix of the JSON string [`super::proto::codec`] puts in place of a client-stream
/// message it could not decode; the handler answers `invalid_argument` with the rest.
pub const TRANSCODE_ERROR: &str = "\u{0}sandlot-transcode-error:";
/// Largest request message, bytes (envd's requests are small; file data goes over `/files`).
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// End-of-stream flag of an envelope.
pub const END_STREAM: u8 = 0x02;
/// Compressed flag of an envelope.
pub const COMPRESSED: u8 = 0x01;

/// A Connect error: a code of the spec (`not_found`, …) and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    /// Connect code, snake case.
    pub code: &'static str,
    /// Human-readable message.
    pub message: String,
    /// HTTP status for unary answers, when not the code's own (415 for a wrong codec).
    pub status: Option<StatusCode>,
}

impl ConnectError {
    /// An error with `code` and `message`.
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
            status: None,
        }
    }

    /// `invalid_argument`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid_argument", message)
    }

    /// The JSON body `{"code", "message"}`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code, "message": self.message})
    }
}

impl From<ServerError> for ConnectError {
    fn from(e: ServerError) -> Self {
        let api = e.api_error();
        ConnectError::new(code_of(api.code), api.message)
    }
}

impl From<sandlot_node_api::NodeError> for ConnectError {
    fn from(e: sandlot_node_api::NodeError) -> Self {
        ServerError::from(e).into()
    }
}

/// The Connect code of a Sandlot error code. `conflict` (a sandbox or process not in the
/// state the call needs) is `failed_precondition`; `payload_too_large` is
/// `resource_exhausted`.
pub fn code_of(c: ErrorCode) -> &'static str {
    match c {
        ErrorCode::InvalidArgument => "invalid_argument",
        ErrorCode::NotFound => "not_found",
        ErrorCode::Conflict => "failed_precondition",
        ErrorCode::ResourceExhausted | ErrorCode::PayloadTooLarge => "resource_exhausted",
        ErrorCode::DeadlineExceeded => "deadline_exceeded",
        ErrorCode::Unavailable => "unavailable",
        ErrorCode::PermissionDenied => "permission_denied",
        ErrorCode::Unauthenticated => "unauthenticated",
        ErrorCode::Internal => "internal",
    }
}

/// HTTP status of a Connect code for unary answers (the spec's "Error Codes" table).
pub fn http_status(code: &str) -> StatusCode {
    match code {
        "canceled" => StatusCode::from_u16(499).expect("valid status"),
        "invalid_argument" | "failed_precondition" | "out_of_range" => StatusCode::BAD_REQUEST,
        "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
        "not_found" => StatusCode::NOT_FOUND,
        "already_exists" | "aborted" => StatusCode::CONFLICT,
        "permission_denied" => StatusCode::FORBIDDEN,
        "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        let status = self.status.unwrap_or_else(|| http_status(self.code));
        (status, axum::Json(self.json())).into_response()
    }
}

/// Kind of a call, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `application/json`.
    Unary,
    /// `application/connect+json`.
    Stream,
}

fn wrong_codec(ct: &str) -> ConnectError {
    ConnectError {
        code: "unimplemented",
        message: format!(
            "content type {ct:?} is not served: use the Connect JSON or protobuf codec \
             (application/json or application/proto for unary calls, \
             application/connect+json or application/connect+proto for streams)"
        ),
        status: Some(StatusCode::UNSUPPORTED_MEDIA_TYPE),
    }
}

/// The call kind `headers` ask for, which must be `expected`.
///
/// # Errors
/// 415 `unimplemented` for any other content type (binary protobuf included), or the
/// right codec of the other call kind.
pub fn check_kind(headers: &HeaderMap, expected: CallKind) -> Result<(), ConnectError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let kind = match essence.as_str() {
        "application/json" => CallKind::Unary,
        "application/connect+json" => CallKind::Stream,
        _ => return Err(wrong_codec(ct)),
    };
    if kind != expected {
        return Err(ConnectError::invalid(format!(
            "this method is a {} call: send Content-Type {}",
            if expected == CallKind::Unary {
                "unary"
            } else {
                "server-streaming"
            },
            if expected == CallKind::Unary {
                "application/json"
            } else {
                "application/connect+json"
            }
        )));
    }
    Ok(())
}

fn parse_object<T: serde::de::DeserializeOwned>(raw: &[u8]) -> Result<T, ConnectError> {
    let v: serde_json::Value = if raw.iter().all(|b| b.is_ascii_whitespace()) {
        serde_json::Value::Object(Default::default())
    } else {
        serde_json::from_slice(raw)
            .map_err(|e| ConnectError::invalid(format!("request is not valid JSON: {e}")))?
    };
    if let Some(why) = v.as_str().and_then(|s| s.strip_prefix(TRANSCODE_ERROR)) {
        // A client-stream message the binary codec could not decode (`super::proto`).
        return Err(ConnectError::invalid(why.to_owned()));
    }
    if !v.is_object() {
        return Err(ConnectError::invalid(
            "request message must be a JSON object",
        ));
    }
    serde_json::from_value(v).map_err(|e| ConnectError::invalid(format!("request message: {e}")))
}

/// The message of a unary request body.
///
/// # Errors
/// `invalid_argument` for a body that is not a JSON object of the message; `resource_exhausted`
/// over [`MAX_MESSAGE_BYTES`].
pub fn unary_request<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(too_big(body.len()));
    }
    parse_object(body)
}

/// The message length in the 5-byte envelope header at the start of `buf` (at least 5
/// bytes: flags, then the length big-endian), refusing what a request may not send.
///
/// # Errors
/// `invalid_argument` for a compressed or otherwise flagged envelope; `resource_exhausted`
/// for a length over [`MAX_MESSAGE_BYTES`].
fn envelope_len(buf: &[u8]) -> Result<usize, ConnectError> {
    let flags = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if flags & COMPRESSED != 0 {
        return Err(ConnectError::invalid(
            "compressed envelopes are not accepted (send Connect-Content-Encoding identity)",
        ));
    }
    if flags != 0 {
        return Err(ConnectError::invalid(format!(
            "unexpected envelope flags {flags:#04x} in a request"
        )));
    }
    if len > MAX_MESSAGE_BYTES {
        return Err(too_big(len));
    }
    Ok(len)
}

fn too_big(n: usize) -> ConnectError {
    ConnectError::new(
        "resource_exhausted",
        format!("message of {n} bytes is over the limit of {MAX_MESSAGE_BYTES}"),
    )
}

/// The one message of a server-stream request body (one envelope).
///
/// # Errors
/// `invalid_argument` for a short or malformed envelope, a compressed one, trailing bytes,
/// or a message that is not a JSON object of the type; `resource_exhausted` over
/// [`MAX_MESSAGE_BYTES`].
pub fn stream_request<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    if body.len() < 5 {
        return Err(ConnectError::invalid(format!(
            "request body of {} bytes is not a Connect envelope (5-byte header + message)",
            body.len()
        )));
    }
    let len = envelope_len(body)?;
    let rest = &body[5..];
    if rest.len() != len {
        return Err(ConnectError::invalid(format!(
            "envelope says {len} bytes but {} follow (one message per server-stream request)",
            rest.len()
        )));
    }
    parse_object(rest)
}

/// The messages of a client-stream request body, split as its bytes arrive: push each
/// chunk, then take the complete messages. Holds at most one partial envelope (a header
/// announcing more than [`MAX_MESSAGE_BYTES`] is refused before its bytes are read).
#[derive(Debug, Default)]
pub struct Envelopes {
    buf: Vec<u8>,
}

impl Envelopes {
    /// Append `chunk` of the body.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete message, if one has arrived.
    ///
    /// # Errors
    /// `invalid_argument` for a compressed or flagged envelope or a message that is not a
    /// JSON object of the type; `resource_exhausted` over [`MAX_MESSAGE_BYTES`].
    pub fn next_message<T: serde::de::DeserializeOwned>(
        &mut self,
    ) -> Result<Option<T>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let len = envelope_len(&self.buf)?;
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let msg: Vec<u8> = self.buf.drain(..5 + len).skip(5).collect();
        parse_object(&msg).map(Some)
    }

    /// Check that the body ended on an envelope boundary.
    ///
    /// # Errors
    /// `invalid_argument` when a partial envelope is left.
    pub fn finish(&self) -> Result<(), ConnectError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ConnectError::invalid(format!(
                "the request body ended inside an envelope ({} bytes left)",
                self.buf.len()
            )))
        }
    }
}

/// One envelope.
pub fn envelope(flags: u8, msg: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(5 + msg.len());
    v.push(flags);
    v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    v.extend_from_slice(msg);
    Bytes::from(v)
}

/// A message envelope of `msg` serialized as JSON.
pub fn message(msg: &serde_json::Value) -> Bytes {
    envelope(0, &serde_json::to_vec(msg).expect("JSON value serializes"))
}

/// The end-of-stream envelope: `{}` or `{"error": …}`.
pub fn end_stream(err: Option<&ConnectError>) -> Bytes {
    let body = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.json()}),
    };
    envelope(
        END_STREAM,
        &serde_json::to_vec(&body).expect("JSON value serializes"),
    )
}

/// A 200 `application/connect+json` response streaming `body`.
pub fn stream_response(body: Body) -> Response {
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    r
}

/// A server-stream response whose envelopes come from `rx`; it ends when every sender is
/// dropped (the last envelope sent should be the end-of-stream one).
pub fn stream_from(rx: tokio::sync::mpsc::Receiver<Bytes>) -> Response {
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    });
    stream_response(Body::from_stream(body))
}

/// A server stream that failed before it started: 200 with the end-of-stream envelope.
pub fn stream_error(e: ConnectError) -> Response {
    stream_response(Body::from(end_stream(Some(&e))))
}

/// A unary success: 200 `application/json`.
pub fn unary_ok(msg: serde_json::Value) -> Response {
    (StatusCode::OK, axum::Json(msg)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let e = message(&serde_json::json!({"a": 1}));
        let v: serde_json::Value = stream_request(&e).unwrap();
        assert_eq!(v["a"], 1);
        assert!(stream_request::<serde_json::Value>(b"\x00\x00").is_err());
        let mut c = e.to_vec();
        c[0] = COMPRESSED;
        assert!(stream_request::<serde_json::Value>(&c)
            .unwrap_err()
            .message
            .contains("compressed"));
        let mut long = e.to_vec();
        long.push(b' ');
        assert!(stream_request::<serde_json::Value>(&long).is_err());
        let huge = envelope(0, b"{}");
        let mut h = huge.to_vec();
        h[1..5].copy_from_slice(&(u32::MAX).to_be_bytes());
        assert_eq!(
            stream_request::<serde_json::Value>(&h).unwrap_err().code,
            "resource_exhausted"
        );
        assert!(stream_request::<serde_json::Value>(&envelope(0, b"[1]")).is_err());
        let end = end_stream(Some(&ConnectError::invalid("x")));
        assert_eq!(end[0], END_STREAM);
    }

    #[test]
    fn client_stream_envelopes_split_across_chunks() {
        let mut all = message(&serde_json::json!({"a": 1})).to_vec();
        all.extend_from_slice(&message(&serde_json::json!({"b": 2})));
        let mut e = Envelopes::default();
        let mut got = Vec::new();
        for b in &all {
            e.push(std::slice::from_ref(b));
            while let Some(v) = e.next_message::<serde_json::Value>().unwrap() {
                got.push(v);
            }
        }
        assert_eq!(
            got,
            vec![serde_json::json!({"a": 1}), serde_json::json!({"b": 2})]
        );
        assert!(e.finish().is_ok());
        e.push(&[0, 0, 0]);
        assert!(e.next_message::<serde_json::Value>().unwrap().is_none());
        assert!(e.finish().is_err());
        let mut big = Envelopes::default();
        big.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(
            big.next_message::<serde_json::Value>().unwrap_err().code,
            "resource_exhausted"
        );
    }

    #[test]
    fn codecs() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/proto"),
        );
        let e = check_kind(&h, CallKind::Unary).unwrap_err();
        assert_eq!(e.status, Some(StatusCode::UNSUPPORTED_MEDIA_TYPE));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        assert!(check_kind(&h, CallKind::Unary).is_ok());
        assert!(check_kind(&h, CallKind::Stream).is_err());
        assert_eq!(http_status("not_found"), StatusCode::NOT_FOUND);
        assert_eq!(
            unary_request::<serde_json::Value>(b"").unwrap(),
            serde_json::json!({})
        );
    }
}
