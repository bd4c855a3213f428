//! Exec: request, result and streamed events.
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Largest `timeout_s` an exec, a background process or a `run_code` call accepts: one day,
/// in seconds.
pub const MAX_TIMEOUT_S: f64 = 86_400.0;

/// Check a timeout in seconds: finite and in (0, [`MAX_TIMEOUT_S`]].
///
/// # Errors
/// A message naming `field`, the value and the range, for an `invalid_argument` error.
pub fn check_timeout_s(field: &str, t: f64) -> Result<(), String> {
    if t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_S {
        Ok(())
    } else {
        Err(format!("{field} = {t} must be in (0, {MAX_TIMEOUT_S}]"))
    }
}

/// The command of an exec: an argv list (run directly, `PATH` searched for `argv[0]`) or a
/// shell string (run as `/bin/sh -c STRING`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Cmd {
    /// `["python3", "-c", "print(1)"]`
    Argv(Vec<String>),
    /// `"echo hi | wc -c"`
    Shell(String),
}

impl Cmd {
    /// The argv actually executed: a shell string becomes `["/bin/sh", "-c", s]`.
    pub fn to_argv(&self) -> Vec<String> {
        match self {
            Cmd::Argv(v) => v.clone(),
            Cmd::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        }
    }
}

/// `POST /v1/sandboxes/{id}/exec` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Command to run.
    pub cmd: Cmd,
    /// Working directory inside the sandbox (default `/workspace`).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment; overrides the sandbox's `env` per key.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Standard input, base64. Without it stdin is `/dev/null`.
    #[serde(default)]
    pub stdin_b64: Option<String>,
    /// Wall-clock limit in seconds (default 60; range (0, 86400]). On expiry the whole process
    /// tree is killed and `timed_out` is set.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Cap on kept bytes per stream (default 1 MiB, max 64 MiB): the first and last halves
    /// are kept, the middle dropped, and `truncated` is set.
    #[serde(default)]
    pub max_output_bytes: Option<u64>,
    /// User inside the sandbox: only `"root"` (the sandbox's own unprivileged root) for now.
    #[serde(default)]
    pub user: Option<String>,
    /// Trajectory step number, from 0, on a sandbox bound to a trajectory: a step already
    /// logged with the same request comes back from the log (`replayed: true`) without
    /// running; the next step runs and is logged before the answer. Without `step` the call
    /// runs unlogged.
    #[serde(default)]
    pub step: Option<u64>,
    /// Run the command on a pseudo-terminal of this size inside the sandbox (its stdin,
    /// stdout and stderr are the terminal; `tty` names a `/dev/pts/N` of the sandbox). The
    /// terminal's output comes back as `stdout` (stderr stays empty). Absent: pipes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// Size of a pseudo-terminal, in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// Rows (lines), 1..=1000.
    pub rows: u16,
    /// Columns, 1..=1000.
    pub cols: u16,
}

impl PtySize {
    /// Checks the range (1..=1000 each).
    ///
    /// # Errors
    /// A message naming the bad value.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=1000).contains(&self.rows) || !(1..=1000).contains(&self.cols) {
            return Err(format!(
                "pty size must be 1..=1000 rows and cols, got {}x{}",
                self.rows, self.cols
            ));
        }
        Ok(())
    }
}

impl ExecRequest {
    /// An exec of `cmd` with every other field at its default.
    pub fn new(cmd: Cmd) -> Self {
        ExecRequest {
            cmd,
            cwd: None,
            env: BTreeMap::new(),
            stdin_b64: None,
            timeout_s: None,
            max_output_bytes: None,
            user: None,
            step: None,
            pty: None,
        }
    }
}

/// Captured bytes of one output stream, after the head+tail cap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Output {
    /// Kept bytes (head, then tail when truncated).
    pub data: Vec<u8>,
    /// Total bytes the process wrote to this stream.
    pub total: u64,
    /// True when `data` is shorter than `total`.
    pub truncated: bool,
}

/// Result of an exec (`exit` record of a streamed exec too).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ExecResult {
    /// Exit status: the process's own code, 128+n when killed by signal n, 127 when the
    /// command was not found, 126 when it could not be executed.
    pub exit_code: i32,
    /// Signal number that killed the process, if any.
    pub signal: Option<i32>,
    /// The timeout expired and the process tree was killed.
    pub timed_out: bool,
    /// The kernel's OOM killer killed a process of this exec.
    pub oom_killed: bool,
    /// Wall-clock duration in milliseconds.
    pub duration_ms: f64,
    /// Stdout as UTF-8 text (invalid bytes replaced by U+FFFD).
    pub stdout: String,
    /// Stderr as UTF-8 text (invalid bytes replaced by U+FFFD).
    pub stderr: String,
    /// Exact stdout bytes, base64; present only when stdout is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_b64: Option<String>,
    /// Exact stderr bytes, base64; present only when stderr is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_b64: Option<String>,
    /// Total bytes written to stdout (before the cap).
    pub stdout_bytes: u64,
    /// Total bytes written to stderr (before the cap).
    pub stderr_bytes: u64,
    /// Some output was dropped by the head+tail cap.
    pub truncated: bool,
    /// The result came from the trajectory log without executing.
    pub replayed: bool,
    /// Denied dangerous syscalls the command attempted, oldest first (each failed with
    /// `EPERM` in the command), reported by the exec's seccomp supervisor; at most 64 per
    /// exec. Absent when none. On runsc they are read from gVisor's sentry debug log (`pid` in
    /// gVisor's root pid namespace).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<Violation>,
}

/// One refused attempt an exec made: a denied syscall (`layer` `seccomp`: seccomp user
/// notification, seccomp_unotify(2), or gVisor's sentry log) or a DNS query the sandbox's
/// network policy refused (`layer` `dns`: `name` and `qtype` set, `syscall` empty, `nr` and
/// `pid` 0).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The layer that refused it: `seccomp`, `dns` or `network` (a packet the network
    /// policy dropped).
    pub layer: String,
    /// Syscall name (`mount`, `bpf`, `socket`, ...).
    pub syscall: String,
    /// Syscall number on the sandbox's architecture.
    pub nr: i32,
    /// Pid of the caller as the sandbox's exec helper sees it (0 when not visible).
    pub pid: u32,
    /// When it was refused, Unix milliseconds (the sandbox's clock; `dns`: the node's).
    pub time_unix_ms: u64,
    /// `dns`: the refused question's name (as asked, ASCII, trailing dot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `dns`: the refused question's type (`A`, `TXT`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qtype: Option<String>,
    /// `network`: the dropped packet's protocol (`tcp`, `udp`, `icmp`, `icmpv6`, or the IP
    /// protocol number).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// `network`: the dropped packet's destination, `ip:port` (TCP, UDP; `[ipv6]:port`) or
    /// `ip`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst: Option<String>,
}

/// Text of `bytes` plus their exact base64 when they are not valid UTF-8.
pub fn text_and_b64(bytes: &[u8]) -> (String, Option<String>) {
    match std::str::from_utf8(bytes) {
        Ok(s) => (s.to_owned(), None),
        Err(_) => (
            String::from_utf8_lossy(bytes).into_owned(),
            Some(B64.encode(bytes)),
        ),
    }
}

impl ExecResult {
    /// Fill the output fields from captured stdout and stderr.
    pub fn set_output(&mut self, stdout: &Output, stderr: &Output) {
        (self.stdout, self.stdout_b64) = text_and_b64(&stdout.data);
        (self.stderr, self.stderr_b64) = text_and_b64(&stderr.data);
        self.stdout_bytes = stdout.total;
        self.stderr_bytes = stderr.total;
        self.truncated = stdout.truncated || stderr.truncated;
    }

    /// Exact stdout bytes (decoding `stdout_b64` when present).
    pub fn stdout_raw(&self) -> Vec<u8> {
        raw(&self.stdout, &self.stdout_b64)
    }

    /// Exact stderr bytes (decoding `stderr_b64` when present).
    pub fn stderr_raw(&self) -> Vec<u8> {
        raw(&self.stderr, &self.stderr_b64)
    }
}

fn raw(text: &str, b64: &Option<String>) -> Vec<u8> {
    match b64 {
        Some(b) => B64.decode(b).unwrap_or_else(|_| text.as_bytes().to_vec()),
        None => text.as_bytes().to_vec(),
    }
}

/// One line of a streamed exec (`?stream=true`, NDJSON: one JSON object per line).
///
/// Chunks come as the process writes them; the stream ends with exactly one `exit` or
/// `error` line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    /// A chunk of stdout.
    Stdout {
        /// Chunk as text (invalid UTF-8 replaced).
        data: String,
        /// Exact bytes, base64, when the chunk is not valid UTF-8.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    /// A chunk of stderr.
    Stderr {
        /// Chunk as text (invalid UTF-8 replaced).
        data: String,
        /// Exact bytes, base64, when the chunk is not valid UTF-8.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    /// The process ended; `result` has empty `stdout`/`stderr` (already streamed) but the
    /// byte totals.
    Exit {
        /// Exit record.
        result: ExecResult,
    },
    /// The exec failed inside Sandlot (not the program's own failure).
    Error {
        /// The error.
        error: crate::ApiError,
    },
}

impl ExecEvent {
    /// A stdout chunk event from raw bytes.
    pub fn stdout(bytes: &[u8]) -> Self {
        let (data, data_b64) = text_and_b64(bytes);
        ExecEvent::Stdout { data, data_b64 }
    }

    /// A stderr chunk event from raw bytes.
    pub fn stderr(bytes: &[u8]) -> Self {
        let (data, data_b64) = text_and_b64(bytes);
        ExecEvent::Stderr { data, data_b64 }
    }
}
