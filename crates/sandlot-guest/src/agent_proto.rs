//! The guest agent's wire protocol: what the node says to `sandlot-guest agent` running as
//! pid 1 inside a container (and, later, a microVM or VM).
//!
//! Transport: HTTP/2 with prior knowledge (RFC 9113 §3.3, no TLS, no upgrade) over ONE
//! byte stream — a unix socket the node created and handed to the container, or a
//! virtio-serial port. HTTP/2 multiplexes any number of calls on that stream; the agent
//! does not care what the stream is.
//!
//! Calls:
//!
//! * `GET /v1/ping` → 200, body `{"agent": "<version>", "pid": <agent pid>}`.
//! * `POST /v1/exec` — request body: a stream of [frames](Frame): first one
//!   [`FrameKind::Spec`] holding [`ExecRequest`] JSON, then [`FrameKind::Stdin`] frames
//!   (only when `ExecRequest::stdin`); the end of the request body is the command's stdin
//!   EOF. Response 200, body: [`FrameKind::Stdout`] / [`FrameKind::Stderr`] frames as the
//!   command writes, then exactly one [`FrameKind::Exit`] frame holding [`ExecExit`] JSON.
//!   Resetting the stream (dropping the response) kills the command's whole process tree.
//!   A bad request answers 400 with a text body.
//! * `POST /v1/signal` — see [`PATH_SIGNAL`].
//! * `POST /v1/connect` — a TCP tunnel into the sandbox, see [`PATH_CONNECT`].
//! * `GET /v1/execs`, `POST /v1/exec/attach` and `POST /v1/exec/forget` — named execs
//!   that outlived their node's connection, see [`PATH_EXECS`], [`PATH_EXEC_ATTACH`] and
//!   [`PATH_EXEC_FORGET`].
//!
//! File calls (paths under `/v1/files/`; the rules of [`crate::sandbox_fs`], applied by the
//! agent to its own root: relative paths under `/workspace`, `openat2` with
//! `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`, `/dev`, `/proc`, `/sys` and `/.sandlot`
//! refused). Each is `POST` with a request body; an error answers the status of its
//! [`FsCode`] ([`fs_status`]) with an [`FsError`] JSON body:
//!
//! * `POST /v1/files/read` — body [`ReadFileRequest`] JSON → 200, body: the file's bytes,
//!   streamed. A failure after the 200 (the file grew past `max_bytes`, an I/O error) ends
//!   the body with the trailer [`TRAILER_ERROR`] holding the [`FsError`] JSON (ASCII, see
//!   [`ascii_json`]); a body that ends without that trailer is the whole file.
//! * `POST /v1/files/write` — body: one [`FrameKind::Spec`] frame holding
//!   [`WriteFileRequest`] JSON, then the file's bytes, raw, to the end of the body → 204
//!   once the data is durable (temp file in the target's directory, fsync, rename, directory
//!   fsync). Resetting the stream leaves the target untouched (the temp file is removed).
//! * `POST /v1/files/list` — body [`PathRequest`] → 200, a JSON array of [`FileInfo`] sorted
//!   by name.
//! * `POST /v1/files/stat` — body [`PathRequest`] → 200, [`FileInfo`] JSON.
//! * `POST /v1/files/mkdir` — body [`MkdirRequest`] → 204.
//! * `POST /v1/files/remove` — body [`PathRequest`] → 204 (directories recursively).
//!
//! Frame layout: 1 byte kind, 4 bytes big-endian payload length, payload (at most
//! [`MAX_FRAME`] bytes). [`FrameDecoder`] is the one decoder, used by both ends.
use serde::{Deserialize, Serialize};

pub use crate::sandbox_fs::{FileInfo, FileKind, FsCode, FsError};
use crate::spec::{ExecSpec, ExecStatus};

/// Path of the liveness call.
pub const PATH_PING: &str = "/v1/ping";
/// Path of the exec call.
pub const PATH_EXEC: &str = "/v1/exec";
/// Largest frame payload, bytes. Writers split larger data.
pub const MAX_FRAME: usize = 1 << 20;
/// Size of a frame header, bytes.
pub const HEADER: usize = 5;

/// Most concurrent HTTP/2 streams on one agent connection (the agent's
/// `SETTINGS_MAX_CONCURRENT_STREAMS`, RFC 9113 §6.5.2).
pub const MAX_STREAMS: u32 = 200;
/// Flow-control window of each HTTP/2 stream, both ends, bytes (RFC 9113 §6.9.2). A
/// stream nobody reads (a tunnel whose client stopped reading, an exec whose output is not
/// consumed, a service in the sandbox that does not read) holds at most this much of its
/// connection's window.
pub const STREAM_WINDOW: u32 = 64 * 1024;
/// Flow-control window of a whole agent connection, both ends, bytes: every stream
/// ([`MAX_STREAMS`]) can sit on a full [`STREAM_WINDOW`] unread and the connection still
/// carries 1 MiB more, so stalled streams never stall the other calls (HTTP/2 counts
/// unread bytes against the connection's window too). It is also the most unread data
/// one connection can buffer at the receiving end.
pub const CONNECTION_WINDOW: u32 = MAX_STREAMS * STREAM_WINDOW + (1 << 20);

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// [`ExecRequest`] JSON (request, first frame).
    Spec = 1,
    /// Bytes for the command's stdin (request).
    Stdin = 2,
    /// Bytes the command wrote to stdout (response).
    Stdout = 3,
    /// Bytes the command wrote to stderr (response).
    Stderr = 4,
    /// [`ExecExit`] JSON (response, last frame).
    Exit = 5,
}

impl FrameKind {
    fn from_byte(b: u8) -> Option<FrameKind> {
        Some(match b {
            1 => FrameKind::Spec,
            2 => FrameKind::Stdin,
            3 => FrameKind::Stdout,
            4 => FrameKind::Stderr,
            5 => FrameKind::Exit,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its kind.
    pub kind: FrameKind,
    /// Its payload.
    pub data: Vec<u8>,
}

/// A malformed frame stream. The connection's stream is unusable after one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The kind byte is not one of [`FrameKind`].
    UnknownKind(u8),
    /// The length field exceeds [`MAX_FRAME`].
    TooLarge(u32),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            FrameError::TooLarge(n) => write!(f, "frame of {n} bytes exceeds {MAX_FRAME}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Encodes `data` as frames of `kind` (several when longer than [`MAX_FRAME`]; one empty
/// frame for empty data).
pub fn encode(kind: FrameKind, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + HEADER);
    let mut chunks = data.chunks(MAX_FRAME).peekable();
    if chunks.peek().is_none() {
        out.push(kind as u8);
        out.extend_from_slice(&0u32.to_be_bytes());
    }
    for c in chunks {
        out.push(kind as u8);
        out.extend_from_slice(&(c.len() as u32).to_be_bytes());
        out.extend_from_slice(c);
    }
    out
}

/// Incremental decoder: [`FrameDecoder::push`] bytes as they arrive, then take complete
/// frames with [`FrameDecoder::next_frame`]. Holds at most one partial frame plus what was
/// pushed.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    start: usize,
}

impl FrameDecoder {
    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// The next complete frame, `Ok(None)` when more bytes are needed.
    ///
    /// # Errors
    /// [`FrameError`] on an unknown kind or an oversized length; the stream is then
    /// unusable.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let rest = &self.buf[self.start..];
        if rest.len() < HEADER {
            return Ok(None);
        }
        let kind = FrameKind::from_byte(rest[0]).ok_or(FrameError::UnknownKind(rest[0]))?;
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]);
        if len as usize > MAX_FRAME {
            return Err(FrameError::TooLarge(len));
        }
        let end = HEADER + len as usize;
        if rest.len() < end {
            return Ok(None);
        }
        let data = rest[HEADER..end].to_vec();
        self.start += end;
        if self.start > (1 << 16) && self.start * 2 > self.buf.len() {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        Ok(Some(Frame { kind, data }))
    }

    /// The bytes pushed but not yet taken as frames (for a body whose frames are followed
    /// by raw data, like `/v1/files/write`).
    pub fn into_rest(mut self) -> Vec<u8> {
        self.buf.drain(..self.start);
        self.buf
    }

    /// True when no partial frame is buffered (a clean end of stream).
    pub fn is_empty(&self) -> bool {
        self.start == self.buf.len()
    }
}

/// `POST /v1/exec` spec frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// What `sandlot-guest exec` runs; the agent forces `own_pid_ns = true`.
    pub spec: ExecSpec,
    /// Wall-clock limit in milliseconds; the whole process tree is killed at it.
    pub timeout_ms: u64,
    /// Whether stdin frames follow (else the command's stdin is `/dev/null`).
    pub stdin: bool,
    /// A name for this exec, unique among the agent's running execs, that
    /// [`PATH_SIGNAL`] calls use to reach it (the node's background-process handle id);
    /// `None`: not signallable (a plain exec). A named exec is also tabled: it survives the
    /// end of its connection and can be found again ([`PATH_EXECS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
    /// Opaque JSON the node attaches to a named exec (its background process's `tag`,
    /// `meta` and `number`): the agent keeps it in its exec table as given and answers it
    /// in [`ExecInfo::labels`], so a node that re-finds the exec lists it as it was
    /// started. At most [`MAX_LABELS_BYTES`] bytes of compact JSON (more: 400); ignored
    /// without a `handle`. The agent reads one field of it: `number`, when an unsigned
    /// integer, of which it keeps the highest ever tabled ([`ExecList::max_number`]). Absent from nodes that predate it; agents that predate it
    /// ignore it (the exec then comes back without its labels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<serde_json::Value>,
}

/// Largest [`ExecRequest::labels`], bytes of compact JSON (8 KiB: the node's own caps on
/// a process's `tag` and `meta`, 256 and 4096 bytes, with room for JSON escapes). The
/// agent keeps at most [`crate::exec_table::TABLE_CAP`] of them: 8 MiB at most.
pub const MAX_LABELS_BYTES: usize = 8 << 10;

/// `POST /v1/exec` exit frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecExit {
    /// How the command ended (or why it could not start).
    pub status: ExecStatus,
    /// True when the agent killed it at `timeout_ms`.
    pub timed_out: bool,
    /// Wall time from spawning the helper to the command's end, milliseconds.
    pub duration_ms: f64,
    /// Denied syscalls the command attempted (seccomp reports), oldest first; absent when
    /// none (and from agents that predate it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<crate::spec::Violation>,
    /// OOM kills in the guest's `sandbox` cgroup during the exec (the delta of `oom_kill`
    /// in its `memory.events`, which counts the guest kernel's global OOM kills of its
    /// processes too; cgroup-v2.rst): set by an agent running as a VM's init, absent
    /// elsewhere (in a container the node reads the container's own cgroup) and from
    /// agents that predate it. An OOM kill of another exec running at the same time is
    /// counted too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kills: Option<u64>,
}

/// Path of the streamed file read.
pub const PATH_FILES_READ: &str = "/v1/files/read";
/// Path of the streamed, atomic file write.
pub const PATH_FILES_WRITE: &str = "/v1/files/write";
/// Path of the directory listing.
pub const PATH_FILES_LIST: &str = "/v1/files/list";
/// Path of the stat call.
pub const PATH_FILES_STAT: &str = "/v1/files/stat";
/// Path of the mkdir call.
pub const PATH_FILES_MKDIR: &str = "/v1/files/mkdir";
/// Path of the remove call.
pub const PATH_FILES_REMOVE: &str = "/v1/files/remove";
/// Trailer that carries an [`FsError`] when a streamed read fails after its 200.
pub const TRAILER_ERROR: &str = "sandlot-error";

/// `POST /v1/files/read` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadFileRequest {
    /// Path inside the sandbox (absolute, or relative to `/workspace`).
    pub path: String,
    /// Largest file accepted, bytes; a larger one fails with `payload_too_large`.
    pub max_bytes: u64,
}

/// `POST /v1/files/write` spec frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteFileRequest {
    /// Path inside the sandbox; missing parent directories are created.
    pub path: String,
    /// Largest body accepted, bytes; more fails with `payload_too_large` (nothing written).
    pub max_bytes: u64,
}

/// `POST /v1/files/{list,stat,remove}` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathRequest {
    /// Path inside the sandbox.
    pub path: String,
}

/// `POST /v1/files/mkdir` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    /// Path inside the sandbox.
    pub path: String,
    /// Create missing ancestors too, and accept an existing directory (`mkdir -p`).
    #[serde(default)]
    pub parents: bool,
}

/// HTTP status of an error code: 404 not_found, 400 invalid_argument, 403
/// permission_denied, 409 conflict, 429 resource_exhausted, 413 payload_too_large, 500
/// internal.
pub fn fs_status(code: FsCode) -> u16 {
    match code {
        FsCode::NotFound => 404,
        FsCode::InvalidArgument => 400,
        FsCode::PermissionDenied => 403,
        FsCode::Conflict => 409,
        FsCode::ResourceExhausted => 429,
        FsCode::PayloadTooLarge => 413,
        FsCode::Internal => 500,
    }
}

/// `e` as JSON with every non-ASCII character `\uXXXX`-escaped (RFC 8259 §7), so it fits
/// an HTTP header or trailer value; `serde_json` reads it back unchanged.
pub fn ascii_json(e: &FsError) -> String {
    let json = serde_json::to_string(e).expect("FsError serialises");
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() && !c.is_ascii_control() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// Path of the signal call (background processes).
///
/// `POST /v1/signal`, body [`SignalRequest`] JSON → 204 when delivered, 404 when no running
/// exec has that handle, 400 for a bad body or a signal outside
/// [`crate::spec::FORWARDED_SIGNALS`] and SIGKILL (9). SIGKILL kills the exec's helper,
/// which ends its whole process tree (pid namespace); any other signal goes to the helper,
/// which forwards it to the command's process group.
pub const PATH_SIGNAL: &str = "/v1/signal";

/// `POST /v1/signal` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalRequest {
    /// [`ExecRequest::handle`] of the exec.
    pub handle: String,
    /// Signal number (Linux).
    pub signal: i32,
}

/// Path of the exec-table call (re-finding background execs after the node that started
/// them went away: its restart or kill -9, or a paused VM resumed on another node).
///
/// `GET /v1/execs` → 200, a JSON array of [`ExecInfo`]: every exec started with an
/// [`ExecRequest::handle`] that no node forgot yet ([`PATH_EXEC_FORGET`]): running, ended
/// while no node read it, or ended and read (kept so that a later node still lists it),
/// sorted by handle; at most [`crate::exec_table::TABLE_CAP`] (1,024) entries, the oldest
/// ended evicted first. `GET /v1/execs?v=2` ([`EXECS_LIST_QUERY`]) answers an
/// [`ExecList`] instead (the same array plus the highest number ever given); agents that
/// predate it ignore the query and answer the array. An agent that predates the call
/// answers 404 ("no such call") at once: the node then has nothing to re-find.
///
/// A named exec outlives the connection that started it when that connection ends (the
/// node's process went away); resetting its stream on a live connection (the caller
/// cancelled) still kills it. While no connection reads it, its output goes to a ring of
/// the last [`crate::exec_table::RING_CAP`] bytes (64 KiB; older bytes are dropped and
/// counted), and its end is kept for [`PATH_EXEC_ATTACH`].
pub const PATH_EXECS: &str = "/v1/execs";

/// The query of `GET /v1/execs` that asks for an [`ExecList`] (see [`PATH_EXECS`]).
pub const EXECS_LIST_QUERY: &str = "v=2";

/// `GET /v1/execs?v=2` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecList {
    /// The entries, as `GET /v1/execs` answers them.
    pub execs: Vec<ExecInfo>,
    /// The highest `number` of [`ExecRequest::labels`] among every exec the agent ever
    /// tabled (forgotten and evicted ones included): a node numbers new processes past it
    /// so that a deleted process's number is not given again. `None` when none had one.
    pub max_number: Option<u64>,
}

/// Path of the forget call: the node deleted a named exec's record (see [`PATH_EXECS`]).
///
/// `POST /v1/exec/forget`, body [`ForgetRequest`] JSON → 204 once the agent no longer
/// tables the exec (an ended one is dropped with its end; a running one is killed first,
/// its whole process tree, and its end goes to no one). An unknown handle is fine (204: forgetting
/// twice is). 400 for a bad body. An agent that predates the call answers 404, which the
/// node takes as done (such an agent forgets an exec once its end is read).
pub const PATH_EXEC_FORGET: &str = "/v1/exec/forget";

/// Path of the attach call: read a named exec again (see [`PATH_EXECS`]).
///
/// `POST /v1/exec/attach`, body [`AttachRequest`] JSON → 200, body: one
/// [`FrameKind::Spec`] frame holding [`AttachInfo`] JSON, then what the ring holds as
/// [`FrameKind::Stdout`] / [`FrameKind::Stderr`] frames, then the exec's output as it comes,
/// then exactly one [`FrameKind::Exit`] frame ([`ExecExit`]) — at once when it already
/// ended (the agent keeps it, ended, until [`PATH_EXEC_FORGET`]). Resetting this stream behaves as for
/// `POST /v1/exec`. Errors, text body: 400 (bad body), 404 (no such handle: never named,
/// forgotten or evicted), 409 (a live connection still reads it). An agent that predates
/// the call answers 404.
pub const PATH_EXEC_ATTACH: &str = "/v1/exec/attach";

/// One entry of `GET /v1/execs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecInfo {
    /// The exec's [`ExecRequest::handle`] (the node's handle id).
    pub handle: String,
    /// Its argv.
    pub argv: Vec<String>,
    /// Pid of its exec helper in the agent's pid namespace.
    pub pid: i32,
    /// When it started: milliseconds since the Unix epoch (the guest's clock).
    pub started_unix_ms: u64,
    /// `None` while running; its exit code once ended (128 + signal for a signal death,
    /// -1 when it could not start).
    pub exit_code: Option<i32>,
    /// Bytes it wrote to stdout so far.
    pub stdout_bytes: u64,
    /// Bytes it wrote to stderr so far.
    pub stderr_bytes: u64,
    /// Output bytes dropped from its ring (written while nobody read it, past the cap).
    pub dropped: u64,
    /// Its [`ExecRequest::labels`], as given; absent when none were given (and from
    /// agents that predate them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<serde_json::Value>,
}

/// `POST /v1/exec/attach` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachRequest {
    /// [`ExecRequest::handle`] of the exec.
    pub handle: String,
}

/// `POST /v1/exec/forget` body: the same one field as [`AttachRequest`].
pub type ForgetRequest = AttachRequest;

/// First frame of a `POST /v1/exec/attach` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachInfo {
    /// Offset within the exec's whole stdout of the first stdout byte that follows.
    pub stdout_offset: u64,
    /// Offset within the exec's whole stderr of the first stderr byte that follows.
    pub stderr_offset: u64,
    /// Output bytes dropped from the ring (both streams; the gaps the offsets show).
    pub dropped: u64,
}

/// Path of the identity call (microVM guests only: the agent is pid 1).
///
/// `POST /v1/identity`, body [`IdentityRequest`] JSON → 204 once the hostname is set,
/// `/etc/machine-id` written and the entropy mixed into the kernel's pool (`RNDADDENTROPY`,
/// credited, then `RNDRESEEDCRNG`); 400 for a bad body; 404 from an agent that is not pid 1
/// (containers keep the runtime's identity). The node calls it after every microVM start,
/// so guests restored from one template snapshot still differ.
pub const PATH_IDENTITY: &str = "/v1/identity";

/// `POST /v1/identity` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityRequest {
    /// New hostname (1..=64 bytes).
    pub hostname: String,
    /// New machine id: 32 lowercase hex digits (machine-id(5)).
    pub machine_id: String,
    /// Random bytes from the host (at most 512) credited to the guest's entropy pool.
    pub entropy: Vec<u8>,
}

/// Path of the clock call (microVM and vm guests only: the agent is the VM's init).
///
/// `POST /v1/clock`, body [`ClockRequest`] JSON → 204 once the guest's `CLOCK_REALTIME` is
/// set to it (clock_settime(2)); 400 for a bad body; 404 from an agent that is not a VM's
/// init (a container's).
/// The node calls it after every start and every resume: a guest restored from a template
/// or from a pause would otherwise go on from the wall-clock time of the save.
pub const PATH_CLOCK: &str = "/v1/clock";

/// `POST /v1/clock` body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockRequest {
    /// The host's wall-clock time: nanoseconds since the Unix epoch (UTC).
    pub unix_ns: u64,
}

/// Path of the tunnel call (ingress: a TCP connection to a port inside the sandbox).
///
/// `POST /v1/connect` — request body: one [`FrameKind::Spec`] frame holding
/// [`ConnectRequest`] JSON, then raw bytes, client → service. The agent connects to
/// `127.0.0.1:port` in its own network namespace (the workload's: execs unshare only a pid
/// namespace; in a VM the guest's only one) within [`CONNECT_TIMEOUT_MS`], then answers 200
/// and streams what the service sends as the response body (service → client, raw). The
/// end of the request body half-closes the TCP connection (`shutdown(SHUT_WR)`); the
/// service's EOF ends the response body; resetting the stream closes the connection.
/// HTTP/2 flow control bounds what is in flight either way.
///
/// Errors, before any 200, with a text body: 400 (bad spec frame, port 0), 502 (connection
/// refused: nothing listens; the body starts with [`CONNECT_REFUSED_PREFIX`]), 504 (no
/// accept within [`CONNECT_TIMEOUT_MS`]), 500 (another connect failure). An agent that
/// predates the call answers 404.
pub const PATH_CONNECT: &str = "/v1/connect";

/// How long the agent waits for a connect to a port inside the sandbox, milliseconds.
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;

/// How the text body of a 502 or 504 answer to [`PATH_CONNECT`] starts.
pub const CONNECT_REFUSED_PREFIX: &str = "nothing listens on port";

/// `POST /v1/connect` spec frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectRequest {
    /// TCP port on the sandbox's loopback (`127.0.0.1`), 1..=65535.
    pub port: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_in_any_chunking() {
        let mut wire = encode(FrameKind::Stdout, b"hello");
        wire.extend(encode(FrameKind::Stderr, b""));
        wire.extend(encode(FrameKind::Exit, b"{}"));
        for step in 1..wire.len() {
            let mut d = FrameDecoder::default();
            let mut got = Vec::new();
            for c in wire.chunks(step) {
                d.push(c);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f);
                }
            }
            assert!(d.is_empty());
            assert_eq!(got.len(), 3, "chunk size {step}");
            assert_eq!(got[0].data, b"hello");
            assert_eq!(got[1].kind, FrameKind::Stderr);
            assert_eq!(got[2].data, b"{}");
        }
    }

    #[test]
    fn large_data_is_split_and_bad_headers_are_errors() {
        let big = vec![7u8; MAX_FRAME + 3];
        let mut d = FrameDecoder::default();
        d.push(&encode(FrameKind::Stdin, &big));
        assert_eq!(d.next_frame().unwrap().unwrap().data.len(), MAX_FRAME);
        assert_eq!(d.next_frame().unwrap().unwrap().data.len(), 3);
        let mut d = FrameDecoder::default();
        d.push(&[9, 0, 0, 0, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::UnknownKind(9)));
        let mut d = FrameDecoder::default();
        d.push(&[1, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(d.next_frame(), Err(FrameError::TooLarge(_))));
    }

    #[test]
    fn ascii_json_round_trips_any_message() {
        let e = FsError::new(FsCode::NotFound, "no such file: /workspace/ü 😀\u{1}");
        let a = ascii_json(&e);
        assert!(a.bytes().all(|b| (0x20..0x7f).contains(&b)), "{a}");
        let back: FsError = serde_json::from_str(&a).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn rest_after_a_spec_frame_is_raw() {
        let mut wire = encode(FrameKind::Spec, b"{}");
        wire.extend_from_slice(b"raw bytes");
        let mut d = FrameDecoder::default();
        d.push(&wire);
        assert_eq!(d.next_frame().unwrap().unwrap().kind, FrameKind::Spec);
        assert_eq!(d.into_rest(), b"raw bytes");
    }
}
