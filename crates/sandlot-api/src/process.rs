//! Background processes: a command started with a handle that outlives the request and
//! the client (`POST /v1/sandboxes/{id}/processes`), then waited for, signalled, fed stdin
//! and read from byte offsets, by any client that knows the handle.
use crate::exec::{text_and_b64, Cmd, ExecResult};
use crate::ApiError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /v1/sandboxes/{id}/processes` body: the fields of an exec, plus `stdin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpawnRequest {
    /// Command to run (argv list or shell string, as for exec).
    pub cmd: Cmd,
    /// Working directory inside the sandbox (default `/workspace`).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment; overrides the sandbox's `env` per key.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// First bytes of standard input, base64. Without `stdin: true` stdin then closes;
    /// without either, stdin is `/dev/null`.
    #[serde(default)]
    pub stdin_b64: Option<String>,
    /// Keep stdin open: more arrives through `POST …/processes/{pid}/stdin` until a call
    /// with `eof=true` (or the process ends).
    #[serde(default)]
    pub stdin: bool,
    /// Wall-clock limit in seconds (default and maximum 86400). On expiry the whole process
    /// tree is killed and `timed_out` is set.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Bytes retained per stream for `…/output` (default 2 MiB, maximum 16 MiB): the last
    /// ones; older bytes are dropped (their offsets stay counted).
    #[serde(default)]
    pub max_output_bytes: Option<u64>,
    /// User inside the sandbox: only `"root"` (the sandbox's own unprivileged root).
    #[serde(default)]
    pub user: Option<String>,
    /// Run it on a pseudo-terminal of this size inside the sandbox (a terminal session):
    /// stdin, stdout and stderr are the terminal, its output is the `stdout` stream
    /// (`stderr` stays empty), stdin stays open (`stdin` is implied) and
    /// `POST …/processes/{pid}/resize` changes the size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<crate::exec::PtySize>,
    /// A label of the caller's choice (at most [`MAX_TAG_BYTES`] bytes), kept in the
    /// process's record: any client finds the process again by it through the list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// JSON of the caller's choice (at most [`MAX_META_BYTES`] bytes serialized), kept in
    /// the process's record and answered as given (the E2B surface keeps envd's
    /// `ProcessConfig` there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<serde_json::Value>,
}

/// Longest `tag` of a background process, bytes.
pub const MAX_TAG_BYTES: usize = 256;
/// Longest `meta` of a background process, bytes of its compact JSON.
pub const MAX_META_BYTES: usize = 4096;

impl SpawnRequest {
    /// Checks `tag` and `meta` against [`MAX_TAG_BYTES`] and [`MAX_META_BYTES`].
    ///
    /// # Errors
    /// A message naming the field and its limit.
    pub fn check_labels(&self) -> Result<(), String> {
        if let Some(t) = &self.tag {
            if t.len() > MAX_TAG_BYTES {
                return Err(format!(
                    "tag is {} bytes, over the limit of {MAX_TAG_BYTES}",
                    t.len()
                ));
            }
        }
        if let Some(m) = &self.meta {
            let n = serde_json::to_vec(m).map(|v| v.len()).unwrap_or(usize::MAX);
            if n > MAX_META_BYTES {
                return Err(format!(
                    "meta is {n} bytes of JSON, over the limit of {MAX_META_BYTES}"
                ));
            }
        }
        Ok(())
    }
}

/// Where a background process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    /// Still running.
    Running,
    /// Ended: `result` (or `error`, when Sandlot failed to run it) is set.
    Exited,
}

/// A background process (`GET /v1/sandboxes/{id}/processes/{pid}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Process {
    /// Handle, `pr-` followed by 20 lowercase hex digits.
    pub id: String,
    /// Its number within the sandbox, given by the sandbox's node: counting up from
    /// [`FIRST_PROCESS_NUMBER`] per sandbox, never reused while the sandbox lives on that
    /// node (E2B's `pid`). 0 from a node that does not number its processes.
    #[serde(default)]
    pub number: u32,
    /// Sandbox it runs in.
    pub sandbox_id: String,
    /// The command as given.
    pub cmd: Cmd,
    /// `running` or `exited`.
    pub state: ProcessState,
    /// Start time, RFC 3339 UTC.
    pub started_at: String,
    /// End time, RFC 3339 UTC; `null` while running.
    pub ended_at: Option<String>,
    /// Whether stdin is still open for `…/stdin` calls.
    pub stdin_open: bool,
    /// Bytes written to stdout so far (the offset the next stdout byte will have).
    pub stdout_bytes: u64,
    /// Bytes written to stderr so far.
    pub stderr_bytes: u64,
    /// How it ended (empty `stdout`/`stderr`: read them through `…/output`); `null` while
    /// running or when `error` is set.
    pub result: Option<ExecResult>,
    /// Sandlot could not run it (set-up failure inside the sandbox, sandbox gone): the
    /// error, with the code the exec call would have answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
    /// The `tag` it was started with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// The `meta` it was started with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<serde_json::Value>,
}

/// The [`Process::number`] of a sandbox's first background process.
pub const FIRST_PROCESS_NUMBER: u32 = 1000;

/// `GET /v1/sandboxes/{id}/processes` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessList {
    /// Processes of the sandbox (running and exited), oldest first.
    pub processes: Vec<Process>,
}

/// A signal by name (`"SIGTERM"` or `"TERM"`, any case) or Linux number (`15`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SignalName {
    /// Linux signal number.
    Number(i64),
    /// Name with or without the `SIG` prefix.
    Name(String),
}

/// The signals a background process can be sent, Linux numbers: SIGKILL (9) ends the whole
/// process tree; the others go to the command's process group.
pub const SIGNALS: [(&str, i32); 12] = [
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ABRT", 6),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("ALRM", 14),
    ("TERM", 15),
    ("CONT", 18),
    ("TSTP", 20),
    ("WINCH", 28),
];

impl SignalName {
    /// The Linux number of this signal.
    ///
    /// # Errors
    /// A message naming the accepted signals when this one is unknown or not deliverable
    /// (SIGSTOP cannot be forwarded: use SIGTSTP).
    pub fn number(&self) -> Result<i32, String> {
        let found = match self {
            SignalName::Number(n) => SIGNALS.iter().find(|(_, v)| i64::from(*v) == *n),
            SignalName::Name(s) => {
                let u = s.trim().to_ascii_uppercase();
                let u = u.strip_prefix("SIG").unwrap_or(&u).to_string();
                SIGNALS.iter().find(|(name, _)| *name == u)
            }
        };
        found.map(|(_, n)| *n).ok_or_else(|| {
            let names: Vec<String> = SIGNALS
                .iter()
                .map(|(n, v)| format!("SIG{n} ({v})"))
                .collect();
            format!(
                "signal {self:?} cannot be sent; one of {}",
                names.join(", ")
            )
        })
    }
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// The signal.
    pub signal: SignalName,
}

/// Which output stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamName {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One line of `GET …/processes/{pid}/output` (NDJSON): the events of a streamed exec
/// (`stdout`, `stderr`, `exit`, `error`), each chunk with its absolute byte `offset` in its
/// stream, plus `skipped` when a requested offset is older than what is retained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ProcessEvent {
    /// A chunk of stdout.
    Stdout {
        /// Chunk as text (invalid UTF-8 replaced).
        data: String,
        /// Exact bytes, base64, when the chunk is not valid UTF-8.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
        /// Offset of the chunk's first byte in the stream (bytes since the start).
        offset: u64,
    },
    /// A chunk of stderr.
    Stderr {
        /// Chunk as text (invalid UTF-8 replaced).
        data: String,
        /// Exact bytes, base64, when the chunk is not valid UTF-8.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
        /// Offset of the chunk's first byte in the stream.
        offset: u64,
    },
    /// Bytes `[from, to)` of `stream` are no longer retained; output resumes at `to`.
    Skipped {
        /// Which stream.
        stream: StreamName,
        /// The offset asked for.
        from: u64,
        /// The oldest offset still retained.
        to: u64,
    },
    /// The process ended (last line): `result` without `stdout`/`stderr` text.
    Exit {
        /// Exit record.
        result: ExecResult,
    },
    /// Sandlot failed to run the process (last line).
    Error {
        /// The error.
        error: ApiError,
    },
}

impl ProcessEvent {
    /// A chunk event of `stream` from raw bytes starting at `offset`.
    pub fn chunk(stream: StreamName, bytes: &[u8], offset: u64) -> Self {
        let (data, data_b64) = text_and_b64(bytes);
        match stream {
            StreamName::Stdout => ProcessEvent::Stdout {
                data,
                data_b64,
                offset,
            },
            StreamName::Stderr => ProcessEvent::Stderr {
                data,
                data_b64,
                offset,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names_and_numbers() {
        for (s, n) in [
            (SignalName::Name("SIGTERM".into()), 15),
            (SignalName::Name("term".into()), 15),
            (SignalName::Name("Kill".into()), 9),
            (SignalName::Number(2), 2),
        ] {
            assert_eq!(s.number(), Ok(n));
        }
        for bad in [
            SignalName::Name("SIGSTOP".into()),
            SignalName::Name("".into()),
            SignalName::Number(19),
            SignalName::Number(-1),
            SignalName::Number(1 << 40),
        ] {
            assert!(bad.number().is_err(), "{bad:?}");
        }
        let r: SignalRequest = serde_json::from_str(r#"{"signal": 15}"#).unwrap();
        assert_eq!(r.signal.number(), Ok(15));
        let r: SignalRequest = serde_json::from_str(r#"{"signal": "SIGINT"}"#).unwrap();
        assert_eq!(r.signal.number(), Ok(2));
    }
}
