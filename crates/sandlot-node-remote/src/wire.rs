//! Bodies of the node API (see the crate docs for the routes) and the NDJSON framing of its
//! exec streams.
use sandlot_api::{ExecEvent, ExecRequest, ExecResult};
use sandlot_node_api::{SandboxSpec, WireError};
use serde::{Deserialize, Serialize};

/// Longest NDJSON line either side accepts (256 MiB: a result frame with two 64 MiB
/// outputs as base64 fits).
pub const MAX_FRAME_BYTES: usize = 256 << 20;

/// `POST /v1/sandboxes/{id}/exec` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecCall {
    /// The exec.
    pub request: ExecRequest,
    /// Send output events as they come (the caller has a sink); without it the stream is
    /// the final frame alone.
    #[serde(default)]
    pub stream: bool,
}

/// One line of an exec answer stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecFrame {
    /// An output event (`stdout` or `stderr`), in the order the node produced it.
    Event(ExecEvent),
    /// The last frame of a finished exec: its result.
    Result(ExecResult),
    /// The last frame of a failed exec: the node's error.
    Error(WireError),
}

/// The start of an `exec-controlled` request stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ControlStart {
    /// The exec.
    pub request: ExecRequest,
    /// Send output events as they come.
    #[serde(default)]
    pub stream: bool,
    /// Live stdin follows (`stdin` frames, then `stdin_eof`); without it the command's
    /// stdin is the request's `stdin_b64` alone.
    #[serde(default)]
    pub stdin: bool,
    /// The exec's name on the node (`ExecControl::handle`).
    pub handle: String,
}

/// One line of an `exec-controlled` request stream: `start` first, then any number of
/// the others. A stream that ends (or breaks) closes the command's stdin and ends signal
/// delivery; the exec runs on to its end or its timeout.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlFrame {
    /// What to run.
    Start(ControlStart),
    /// A stdin chunk, base64 (standard alphabet, padded).
    Stdin(String),
    /// Stdin closes (EOF).
    StdinEof,
    /// Deliver this signal (Linux number) to the command.
    Signal(i32),
}

/// `POST /v1/sandboxes/from-checkpoint` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkCall {
    /// The fork's spec.
    pub spec: SandboxSpec,
    /// The checkpoint it starts from.
    pub checkpoint_id: String,
}

/// `POST /v1/sandboxes/{id}/files/volatile` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolatileFiles {
    /// (path, content base64) in write order.
    pub files: Vec<(String, String)>,
}

/// `POST /v1/sandboxes/{id}/files/mkdir` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MkdirCall {
    /// Directory path inside the sandbox.
    pub path: String,
    /// `mkdir -p`.
    #[serde(default)]
    pub parents: bool,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SignalCall {
    /// Linux signal number (validated by the server).
    pub signal: i32,
}

/// `POST /v1/readopt` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadoptCall {
    /// Ids to keep.
    pub keep: Vec<String>,
}

/// `POST /v1/pause` and `POST /v1/resume` body (`Node::pause_many`, `Node::resume_many`):
/// at most [`sandlot_node_api::BULK_MAX_IDS`] sandbox ids. The answer is a JSON array with
/// one element per id, in order: `null` where that id's call succeeded, else its
/// [`sandlot_node_api::WireError`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BulkCall {
    /// The sandboxes to pause or resume.
    pub ids: Vec<String>,
}

/// One JSON value and a newline.
pub fn line<T: Serialize>(v: &T) -> bytes::Bytes {
    let mut out = serde_json::to_vec(v).expect("wire types serialize");
    out.push(b'\n');
    out.into()
}

/// Splits a byte stream into NDJSON lines.
#[derive(Debug, Default)]
pub struct LineBuf {
    buf: Vec<u8>,
}

impl LineBuf {
    /// Append `chunk`; returns the complete lines it finished (without their `\n`; empty
    /// lines skipped).
    ///
    /// # Errors
    /// A line longer than [`MAX_FRAME_BYTES`].
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let mut lines = Vec::new();
        let mut rest = chunk;
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            self.buf.extend_from_slice(&rest[..i]);
            let l = std::mem::take(&mut self.buf);
            if !l.is_empty() {
                lines.push(l);
            }
            rest = &rest[i + 1..];
        }
        self.buf.extend_from_slice(rest);
        if self.buf.len() > MAX_FRAME_BYTES {
            return Err(format!("a frame is over {MAX_FRAME_BYTES} bytes"));
        }
        Ok(lines)
    }

    /// Whether a partial line is pending.
    pub fn has_partial(&self) -> bool {
        !self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_chunks() {
        let mut b = LineBuf::default();
        assert_eq!(b.push(b"{\"a\"").unwrap(), Vec::<Vec<u8>>::new());
        assert!(b.has_partial());
        assert_eq!(
            b.push(b":1}\n\n{}\n{").unwrap(),
            vec![b"{\"a\":1}".to_vec(), b"{}".to_vec()]
        );
        assert!(b.has_partial());
        assert_eq!(b.push(b"}\n").unwrap(), vec![b"{}".to_vec()]);
        assert!(!b.has_partial());
    }

    #[test]
    fn frames_have_stable_shapes() {
        let f = ExecFrame::Event(ExecEvent::stdout(b"hi"));
        assert_eq!(
            String::from_utf8(line(&f).to_vec()).unwrap(),
            "{\"event\":{\"type\":\"stdout\",\"data\":\"hi\"}}\n"
        );
        assert_eq!(
            serde_json::to_string(&ControlFrame::StdinEof).unwrap(),
            "\"stdin_eof\""
        );
        assert_eq!(
            serde_json::to_string(&ControlFrame::Signal(15)).unwrap(),
            "{\"signal\":15}"
        );
    }
}
