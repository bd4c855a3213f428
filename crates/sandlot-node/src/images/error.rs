//! [`ImageError`]: failures of the image store's registry pulls and content checks, with
//! the registry's or the parser's error as the source.
use crate::node::NodeError;

/// Failures of image pulls, imports and content checks. The registry client's, the JSON
/// parser's or the unpacker's error is the [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A digest that is not `sha256:<64 lowercase hex>`.
    #[error("malformed digest {digest:?} (expected sha256:<64 lowercase hex>)")]
    MalformedDigest {
        /// The digest as given.
        digest: String,
    },
    /// A digest of another algorithm than sha256.
    #[error("unsupported digest algorithm {algorithm:?} in {digest:?} (only sha256)")]
    UnsupportedDigest {
        /// The algorithm named.
        algorithm: String,
        /// The digest as given.
        digest: String,
    },
    /// Content whose sha256 is not the one its descriptor names.
    #[error("blob digest mismatch: expected {expected}, got {got}")]
    DigestMismatch {
        /// The descriptor's digest.
        expected: String,
        /// The content's digest.
        got: String,
    },
    /// A manifest, index or config that does not parse as its OCI/Docker schema.
    #[error("{what} is not valid JSON of its kind")]
    Json {
        /// `manifest`, `index.json`, `image config`, …
        what: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The registry says there is no such image, or refuses access (a 4xx answer).
    #[error("pull {reference}: registry {registry} has no such image or refuses access")]
    NoSuchImage {
        /// The image reference.
        reference: String,
        /// The registry host.
        registry: String,
        /// The registry client's error.
        #[source]
        source: oci_client::errors::OciDistributionError,
    },
    /// The registry sent content that fails its own checks.
    #[error("pull {reference}: bad content from {registry}")]
    BadContent {
        /// The image reference.
        reference: String,
        /// The registry host.
        registry: String,
        /// The registry client's error.
        #[source]
        source: oci_client::errors::OciDistributionError,
    },
    /// The registry cannot be reached or failed (connection, TLS, 5xx).
    #[error("pull {reference}: registry {registry} cannot be reached or failed")]
    RegistryUnavailable {
        /// The image reference.
        reference: String,
        /// The registry host.
        registry: String,
        /// The registry client's error.
        #[source]
        source: oci_client::errors::OciDistributionError,
    },
    /// The unpack task of a pull panicked or was cancelled.
    #[error("unpack {reference}")]
    UnpackTask {
        /// The image reference.
        reference: String,
        /// The task's join error.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl ImageError {
    /// The node's error code for this failure: `InvalidArgument` for bad content,
    /// `NotFound` for an image the registry does not have (or refuses), `Unavailable` for
    /// a registry that cannot be reached, `Internal` for a failed unpack task.
    fn code(&self) -> sandlot_api::ErrorCode {
        use sandlot_api::ErrorCode as C;
        match self {
            ImageError::MalformedDigest { .. }
            | ImageError::UnsupportedDigest { .. }
            | ImageError::DigestMismatch { .. }
            | ImageError::Json { .. }
            | ImageError::BadContent { .. } => C::InvalidArgument,
            ImageError::NoSuchImage { .. } => C::NotFound,
            ImageError::RegistryUnavailable { .. } => C::Unavailable,
            ImageError::UnpackTask { .. } => C::Internal,
        }
    }
}

/// The node's error of an image failure (see [`ImageError`]'s variants for the code).
/// Codes without a source of their own carry the whole chain in their message.
impl From<ImageError> for NodeError {
    fn from(e: ImageError) -> Self {
        use sandlot_api::ErrorCode as C;
        match e.code() {
            C::InvalidArgument => NodeError::InvalidArgument(sandlot_node_api::chain(&e)),
            C::NotFound => NodeError::NotFound(sandlot_node_api::chain(&e)),
            C::Unavailable => NodeError::Unavailable(sandlot_node_api::chain(&e)),
            _ => {
                let context = e.to_string();
                let source: Option<Box<dyn std::error::Error + Send + Sync>> = match e {
                    ImageError::UnpackTask { source, .. } => Some(Box::new(source)),
                    _ => None,
                };
                NodeError::internal(context, source)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_errors_are_invalid_argument_with_the_parsers_cause() {
        let source = serde_json::from_slice::<serde_json::Value>(b"{oops").unwrap_err();
        let e = ImageError::Json {
            what: "manifest".into(),
            source,
        };
        assert!(std::error::Error::source(&e).is_some());
        let n = NodeError::from(e);
        assert_eq!(n.code(), sandlot_api::ErrorCode::InvalidArgument);
        assert!(
            n.to_string()
                .starts_with("manifest is not valid JSON of its kind: key must be a string"),
            "{n}"
        );
    }
}
