//! Errors of the cluster crate, with their stable wire codes.
use sandlot_api::ErrorCode;
use std::time::Duration;

/// Why a cluster operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// An etcd call failed (connection refused, no leader, lease not found, ...).
    #[error("etcd {op} failed")]
    Etcd {
        /// The operation, e.g. `"lease grant"`.
        op: &'static str,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// An etcd call did not answer in time (a partitioned or stopped member).
    #[error("etcd {op} did not answer within {after:?}")]
    Timeout {
        /// The operation, e.g. `"put node record"`.
        op: &'static str,
        /// The limit that passed.
        after: Duration,
    },
    /// A value under a Sandlot key is not the JSON this crate writes.
    #[error("value of etcd key {key} is not valid JSON for its type")]
    Decode {
        /// The key whose value did not decode.
        key: String,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// A node name, election name or lease setting is out of range; the message says which.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The node's fence is off (its lease could be gone): it must not serve or publish until
    /// it has re-registered under a new lease.
    #[error("node {name} is fenced: its etcd lease is not known to be alive")]
    Fenced {
        /// The node's name.
        name: String,
    },
}

impl ClusterError {
    /// The stable wire code of this error: `unavailable` for etcd failures, timeouts and a
    /// fenced node (retry later), `invalid_argument` for bad input, `internal` for a value
    /// that does not decode.
    pub fn code(&self) -> ErrorCode {
        match self {
            ClusterError::Etcd { .. }
            | ClusterError::Timeout { .. }
            | ClusterError::Fenced { .. } => ErrorCode::Unavailable,
            ClusterError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            ClusterError::Decode { .. } => ErrorCode::Internal,
        }
    }
}

/// Runs one etcd call with a deadline, mapping both failure kinds to [`ClusterError`].
pub(crate) async fn call<T>(
    op: &'static str,
    limit: Duration,
    fut: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ClusterError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(ClusterError::Etcd { op, source }),
        Err(_) => Err(ClusterError::Timeout { op, after: limit }),
    }
}

/// Whether a failed call may succeed on another endpoint: the connection failed or the
/// member answered "unavailable" (stopped, no leader). Everything else is final.
///
/// A connection that closes under a request (a member stopping) comes back from tonic as
/// status CANCELLED, or UNKNOWN "transport error" (a broken pipe on a connection the
/// balancer still held), with the transport error as its source; that is retryable too,
/// while a CANCELLED or UNKNOWN the member itself sent (no source) is not.
fn retryable(e: &etcd_client::Error) -> bool {
    use std::error::Error as _;
    match e {
        etcd_client::Error::TransportError(_) => true,
        // gRPC status codes (grpc/grpc doc/statuscodes.md): 14 UNAVAILABLE, 1 CANCELLED,
        // 2 UNKNOWN.
        etcd_client::Error::GRpcStatus(s) => {
            s.code() as i32 == 14 || (matches!(s.code() as i32, 1 | 2) && s.source().is_some())
        }
        _ => false,
    }
}

/// [`call`] with up to 10 attempts when the failure is [`retryable`], pausing 50 ms after
/// the first failure and doubling up to 500 ms (at most ~3 s of pauses). With several
/// endpoints the client's balancer (tonic's power of two choices on pending requests)
/// keeps routing calls to a member that has stopped: its connection fails at once, so it
/// looks idle and is often preferred; three attempts all landed there on a loaded host.
/// `make` builds a fresh call per attempt; each has `limit`.
pub(crate) async fn call_retry<T, F, Fut>(
    op: &'static str,
    limit: Duration,
    mut make: F,
) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        match call(op, limit, make()).await {
            Err(ClusterError::Etcd { source, .. }) if attempt < 10 && retryable(&source) => {
                tracing::debug!(op, attempt, error = %source, "etcd call failed on one endpoint; retrying");
                let pause = Duration::from_millis(50) * 2u32.pow(attempt.min(5) - 1);
                tokio::time::sleep(pause.min(Duration::from_millis(500))).await;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_connection_closed_under_a_call_is_retryable_but_a_members_own_status_is_not() {
        let mut closed = tonic::Status::cancelled("operation was canceled");
        closed.set_source(Arc::new(std::io::Error::other("connection closed")));
        assert!(retryable(&etcd_client::Error::GRpcStatus(closed)));
        let sent = tonic::Status::cancelled("the member cancelled it");
        assert!(!retryable(&etcd_client::Error::GRpcStatus(sent)));
        let down = tonic::Status::unavailable("no leader");
        assert!(retryable(&etcd_client::Error::GRpcStatus(down)));
        // A broken pipe under a put (CI, a member stopped): UNKNOWN with the transport
        // error as its source.
        let mut piped = tonic::Status::unknown("transport error");
        piped.set_source(Arc::new(std::io::Error::other("broken pipe")));
        assert!(retryable(&etcd_client::Error::GRpcStatus(piped)));
        assert!(!retryable(&etcd_client::Error::GRpcStatus(
            tonic::Status::unknown("the member failed it")
        )));
        let final_ = tonic::Status::not_found("lease not found");
        assert!(!retryable(&etcd_client::Error::GRpcStatus(final_)));
    }
}
