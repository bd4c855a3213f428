//! A small client of QEMU's machine protocol (QMP) over a unix socket: JSON objects, one
//! per line (spec: QEMU's `docs/interop/qmp-spec.rst`).
//!
//! [`Qmp::connect`] reads the greeting and negotiates (`qmp_capabilities`);
//! [`Qmp::execute`] sends one command and returns its `return` value, keeping the
//! asynchronous events that arrive meanwhile; [`Qmp::execute_with_fd`] passes a file
//! descriptor along (`SCM_RIGHTS`, as `getfd` and `add-fd` expect); [`Qmp::wait_event`]
//! waits for an event by name and predicate. Blocking I/O: call it from a blocking task.
//!
//! Used by the `microvm` backend to save and restore a guest (`stop`, `migrate` to an `fd:`
//! URI, `migrate-incoming`, `cont`); the `vm` backend can use it the same way.
use crate::node::NodeError;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A connected, negotiated QMP session.
pub struct Qmp {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    events: VecDeque<Value>,
    /// Answers and events wait at most this long per read.
    timeout: Duration,
}

/// Failures of a QMP session. Each names the socket; an I/O or JSON failure is the
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Connecting, reading or writing the socket failed (`step`: `connect`, `read`, or the
    /// command being sent).
    #[error("QMP at {}: {step}", path.display())]
    Io {
        /// The QMP socket.
        path: PathBuf,
        /// What was being done.
        step: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// QEMU closed the connection (it exited).
    #[error("QMP at {}: QEMU closed the connection", path.display())]
    Closed {
        /// The QMP socket.
        path: PathBuf,
    },
    /// A line that is not JSON.
    #[error("QMP at {}: answer is not JSON: {line}", path.display())]
    Parse {
        /// The QMP socket.
        path: PathBuf,
        /// The line read.
        line: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The greeting has no `QMP` member: not a QMP socket.
    #[error("QMP at {}: not QMP: {greeting}", path.display())]
    NotQmp {
        /// The QMP socket.
        path: PathBuf,
        /// The first object read.
        greeting: String,
    },
    /// QEMU answered a command with `{"error": {"class", "desc"}}`.
    #[error("QMP at {}: {command}: {class}: {desc}", path.display())]
    Command {
        /// The QMP socket.
        path: PathBuf,
        /// The command.
        command: String,
        /// QEMU's error class (`GenericError`, `DeviceNotFound`, …).
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// An answer that is neither `return`, `error` nor an event.
    #[error("QMP at {}: {command}: unexpected {answer}", path.display())]
    Unexpected {
        /// The QMP socket.
        path: PathBuf,
        /// The command.
        command: String,
        /// The answer.
        answer: String,
    },
    /// The awaited event did not come before the deadline.
    #[error("QMP at {}: {event}: event did not come in time", path.display())]
    EventTimeout {
        /// The QMP socket.
        path: PathBuf,
        /// The event's name.
        event: String,
    },
    /// `query-migrate` reported `failed` or `cancelled`.
    #[error("QMP at {}: migration {status}: {desc}", path.display())]
    MigrationFailed {
        /// The QMP socket.
        path: PathBuf,
        /// `failed` or `cancelled`.
        status: String,
        /// QEMU's `error-desc`.
        desc: String,
    },
    /// The migration was not done by the deadline.
    #[error("QMP at {}: migration not done in time: {last}", path.display())]
    MigrationTimeout {
        /// The QMP socket.
        path: PathBuf,
        /// The last `query-migrate` answer.
        last: String,
    },
}

impl QmpError {
    /// True for a read that timed out (the socket's read timeout, not a deadline).
    fn is_read_timeout(&self) -> bool {
        matches!(self, QmpError::Io { source, .. }
            if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }
}

/// Every QMP failure is the node's `Internal`: the message as context, an I/O or JSON
/// failure as source.
impl From<QmpError> for NodeError {
    fn from(e: QmpError) -> Self {
        let context = e.to_string();
        let source: Option<Box<dyn std::error::Error + Send + Sync>> = match e {
            QmpError::Io { source, .. } => Some(Box::new(source)),
            QmpError::Parse { source, .. } => Some(Box::new(source)),
            _ => None,
        };
        NodeError::internal(context, source)
    }
}

/// Result of QMP calls.
pub type QmpResult<T> = Result<T, QmpError>;

fn io_err(path: &Path, step: &str) -> impl FnOnce(std::io::Error) -> QmpError {
    let path = path.to_path_buf();
    let step = step.to_string();
    move |source| QmpError::Io { path, step, source }
}

impl Qmp {
    /// Connects to the QMP socket at `path`, retrying until `deadline` while the socket is
    /// missing or refuses (QEMU still starting), then reads the greeting and sends
    /// `qmp_capabilities`. `timeout` bounds every later read of one answer.
    ///
    /// # Errors
    /// `Internal` when the socket cannot be connected by `deadline`, the greeting is not
    /// QMP, or negotiation fails.
    pub fn connect(path: &Path, deadline: Instant, timeout: Duration) -> QmpResult<Qmp> {
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io_err(path, "connect")(e)),
            }
        };
        let writer = stream.try_clone().map_err(io_err(path, "clone"))?;
        let mut q = Qmp {
            path: path.to_path_buf(),
            reader: BufReader::new(stream),
            writer,
            events: VecDeque::new(),
            timeout,
        };
        let greeting = q.read_value()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::NotQmp {
                path: path.to_path_buf(),
                greeting: greeting.to_string(),
            });
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    fn read_value(&mut self) -> QmpResult<Value> {
        self.reader
            .get_ref()
            .set_read_timeout(Some(self.timeout))
            .map_err(io_err(&self.path, "set timeout"))?;
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .reader
                .read_line(&mut line)
                .map_err(io_err(&self.path, "read"))?;
            if n == 0 {
                return Err(QmpError::Closed {
                    path: self.path.clone(),
                });
            }
            if line.trim().is_empty() {
                continue;
            }
            return serde_json::from_str(line.trim()).map_err(|source| QmpError::Parse {
                path: self.path.clone(),
                line: line.trim().to_string(),
                source,
            });
        }
    }

    /// Reads until the answer to the command just sent, queueing events.
    fn answer(&mut self, name: &str) -> QmpResult<Value> {
        loop {
            let v = self.read_value()?;
            if v.get("event").is_some() {
                self.events.push_back(v);
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    path: self.path.clone(),
                    command: name.to_string(),
                    class: e
                        .get("class")
                        .and_then(Value::as_str)
                        .unwrap_or("Error")
                        .to_string(),
                    desc: e
                        .get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                });
            }
            return Err(QmpError::Unexpected {
                path: self.path.clone(),
                command: name.to_string(),
                answer: v.to_string(),
            });
        }
    }

    fn send(
        &mut self,
        name: &str,
        args: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
    ) -> QmpResult<()> {
        let mut cmd = json!({ "execute": name });
        if let Some(a) = args {
            cmd["arguments"] = a;
        }
        let mut line = serde_json::to_vec(&cmd).expect("QMP command serialises");
        line.push(b'\n');
        match fd {
            None => self
                .writer
                .write_all(&line)
                .map_err(io_err(&self.path, name)),
            Some(fd) => {
                use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
                let raw = [fd.as_raw_fd()];
                let iov = [std::io::IoSlice::new(&line)];
                let cmsg = [ControlMessage::ScmRights(&raw)];
                let n = sendmsg::<()>(
                    self.writer.as_raw_fd(),
                    &iov,
                    &cmsg,
                    MsgFlags::empty(),
                    None,
                )
                .map_err(|e| io_err(&self.path, name)(e.into()))?;
                if n < line.len() {
                    self.writer
                        .write_all(&line[n..])
                        .map_err(io_err(&self.path, name))?;
                }
                Ok(())
            }
        }
    }

    /// Runs command `name` with `args` (a JSON object or none); its `return` value.
    ///
    /// # Errors
    /// `Internal` with QEMU's error class and description, or an I/O failure.
    pub fn execute(&mut self, name: &str, args: Option<Value>) -> QmpResult<Value> {
        self.send(name, args, None)?;
        self.answer(name)
    }

    /// [`Qmp::execute`] with `fd` passed along the command (`SCM_RIGHTS`), e.g.
    /// `getfd {"fdname": N}`; QEMU keeps its own duplicate.
    ///
    /// # Errors
    /// As [`Qmp::execute`].
    pub fn execute_with_fd(
        &mut self,
        name: &str,
        args: Option<Value>,
        fd: BorrowedFd<'_>,
    ) -> QmpResult<Value> {
        self.send(name, args, Some(fd))?;
        self.answer(name)
    }

    /// Waits until `deadline` for the event `name` whose `data` satisfies `pred` (events
    /// queued earlier count); other events are dropped.
    ///
    /// # Errors
    /// `DeadlineExceeded`-style `Internal` when it does not come in time, or I/O failure.
    pub fn wait_event(
        &mut self,
        name: &str,
        deadline: Instant,
        pred: impl Fn(&Value) -> bool,
    ) -> QmpResult<Value> {
        let matches = |v: &Value| {
            v.get("event").and_then(Value::as_str) == Some(name)
                && pred(v.get("data").unwrap_or(&Value::Null))
        };
        while let Some(v) = self.events.pop_front() {
            if matches(&v) {
                return Ok(v);
            }
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(QmpError::EventTimeout {
                    path: self.path.clone(),
                    event: name.to_string(),
                });
            }
            let saved = self.timeout;
            self.timeout = left.min(saved);
            let r = self.read_value();
            self.timeout = saved;
            match r {
                Ok(v) if matches(&v) => return Ok(v),
                Ok(_) => {}
                Err(e) if Instant::now() >= deadline => return Err(e),
                // A read timeout shorter than the deadline: keep waiting.
                Err(e) if e.is_read_timeout() => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Polls `query-migrate` until its status is `completed` (returned) or `failed` /
    /// `cancelled` (an error with QEMU's reason), up to `deadline`.
    ///
    /// # Errors
    /// `Internal` on a failed migration, a timeout or I/O failure.
    pub fn wait_migration(&mut self, deadline: Instant) -> QmpResult<Value> {
        loop {
            let v = self.execute("query-migrate", None)?;
            match v.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(v),
                Some(s @ ("failed" | "cancelled")) => {
                    return Err(QmpError::MigrationFailed {
                        path: self.path.clone(),
                        status: s.to_string(),
                        desc: v
                            .get("error-desc")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                    })
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(QmpError::MigrationTimeout {
                    path: self.path.clone(),
                    last: v.to_string(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A recording fake of QEMU's side of QMP for unit tests of the code that drives QEMU
/// (pause, resume, migration) without a QEMU: it greets, records every command (with the
/// descriptors passed along it, `SCM_RIGHTS`) and answers through a script.
#[cfg(test)]
pub(crate) mod fake {
    use serde_json::{json, Value};
    use std::io::Write;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::path::Path;
    use std::sync::{Arc, Mutex};

    /// One command as received: its name, its arguments (`null` when none) and the
    /// descriptors that came with it.
    pub(crate) struct Received {
        pub name: String,
        pub args: Value,
        pub fds: Vec<OwnedFd>,
    }

    /// The script: given a command (and the commands before it), the lines to answer
    /// (events and then the `return` or `error` object).
    pub(crate) type Script = Box<dyn FnMut(&Received, &[Received]) -> Vec<Value> + Send>;

    /// A fake QMP peer serving connections on a socket; `log` holds every command
    /// received, `qmp_capabilities` included, in order, over all connections.
    pub(crate) struct FakeQmp {
        pub log: Arc<Mutex<Vec<Received>>>,
    }

    /// `{"return": {}}`.
    pub(crate) fn ok() -> Vec<Value> {
        vec![json!({ "return": {} })]
    }

    impl FakeQmp {
        /// Listen on `sock` and serve every connection with `script`.
        pub(crate) fn serve(sock: &Path, script: Script) -> FakeQmp {
            let l = UnixListener::bind(sock).unwrap();
            let log: Arc<Mutex<Vec<Received>>> = Arc::default();
            let script = Arc::new(Mutex::new(script));
            let (log2, script2) = (log.clone(), script.clone());
            std::thread::spawn(move || {
                for conn in l.incoming() {
                    let Ok(s) = conn else { return };
                    serve_one(s, &log2, &script2);
                }
            });
            FakeQmp { log }
        }

        /// The names of the commands received so far.
        pub(crate) fn names(&self) -> Vec<String> {
            self.log
                .lock()
                .unwrap()
                .iter()
                .map(|r| r.name.clone())
                .collect()
        }
    }

    fn serve_one(mut s: UnixStream, log: &Mutex<Vec<Received>>, script: &Mutex<Script>) {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        let greet = b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n";
        if s.write_all(greet).is_err() {
            return;
        }
        let mut buf = Vec::new();
        let mut fds = Vec::new();
        loop {
            // One line per command; descriptors come with the first byte of their line.
            while let Some(end) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=end).collect();
                let v: Value = serde_json::from_slice(&line).unwrap();
                let r = Received {
                    name: v["execute"].as_str().unwrap_or_default().to_string(),
                    args: v.get("arguments").cloned().unwrap_or(Value::Null),
                    fds: std::mem::take(&mut fds),
                };
                let answer = if r.name == "qmp_capabilities" {
                    ok()
                } else {
                    let before = log.lock().unwrap();
                    (script.lock().unwrap())(&r, &before)
                };
                log.lock().unwrap().push(r);
                for a in answer {
                    let mut out = serde_json::to_vec(&a).unwrap();
                    out.extend_from_slice(b"\r\n");
                    if s.write_all(&out).is_err() {
                        return;
                    }
                }
            }
            let mut chunk = [0u8; 4096];
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 4]);
            let mut iov = [std::io::IoSliceMut::new(&mut chunk)];
            let Ok(msg) =
                recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
            else {
                return;
            };
            if msg.bytes == 0 {
                return;
            }
            let n = msg.bytes;
            for c in msg.cmsgs().into_iter().flatten() {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: descriptors just received with SCM_RIGHTS are ours alone.
                    fds.extend(raw.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                }
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixListener;

    /// A fake QMP peer: greeting, then answers each line from `answers` in order.
    fn fake(
        answers: Vec<&'static str>,
    ) -> (
        tempfile::TempDir,
        PathBuf,
        std::thread::JoinHandle<Vec<String>>,
    ) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("qmp.sock");
        let l = UnixListener::bind(&p).unwrap();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
                .unwrap();
            let mut got = Vec::new();
            let mut r = BufReader::new(s.try_clone().unwrap());
            for a in answers {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                got.push(line.trim().to_string());
                s.write_all(a.as_bytes()).unwrap();
                s.write_all(b"\r\n").unwrap();
            }
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest);
            got
        });
        (d, p, h)
    }

    #[test]
    fn negotiates_executes_and_keeps_events() {
        let (_d, p, h) = fake(vec![
            r#"{"return": {}}"#,
            "{\"event\": \"STOP\", \"data\": {}}\r\n{\"return\": {}}",
            r#"{"error": {"class": "GenericError", "desc": "nope"}}"#,
        ]);
        let mut q = Qmp::connect(
            &p,
            Instant::now() + Duration::from_secs(5),
            Duration::from_secs(5),
        )
        .unwrap();
        q.execute("stop", None).unwrap();
        let e = q.execute("cont", Some(json!({"x": 1}))).unwrap_err();
        assert!(e.to_string().contains("GenericError: nope"), "{e}");
        assert!(
            matches!(&e, QmpError::Command { command, class, desc, .. }
                if command == "cont" && class == "GenericError" && desc == "nope"),
            "{e:?}"
        );
        q.wait_event("STOP", Instant::now() + Duration::from_secs(1), |_| true)
            .unwrap();
        drop(q);
        let got = h.join().unwrap();
        assert_eq!(got[0], r#"{"execute":"qmp_capabilities"}"#);
        assert_eq!(got[1], r#"{"execute":"stop"}"#);
        assert_eq!(got[2], r#"{"arguments":{"x":1},"execute":"cont"}"#);
    }

    #[test]
    fn missing_socket_fails_by_deadline() {
        let d = tempfile::tempdir().unwrap();
        let e = Qmp::connect(
            &d.path().join("none"),
            Instant::now(),
            Duration::from_secs(1),
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("connect"), "{e}");
        let QmpError::Io { source, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        let node = NodeError::from(e);
        assert_eq!(node.code(), sandlot_api::ErrorCode::Internal);
        let chain = sandlot_node_api::chain(&node);
        assert!(
            chain.ends_with("none: connect: No such file or directory (os error 2)"),
            "{chain}"
        );
    }

    #[test]
    fn a_line_that_is_not_json_keeps_the_parser_error_and_reads_time_out_as_such() {
        let (_d, p, h) = fake(vec![r#"{"return": {}}"#, "{oops"]);
        let mut q = Qmp::connect(
            &p,
            Instant::now() + Duration::from_secs(5),
            Duration::from_millis(50),
        )
        .unwrap();
        // Nothing comes: the read timeout ends the wait at the deadline.
        let e = q
            .wait_event("STOP", Instant::now() + Duration::from_millis(120), |_| {
                true
            })
            .unwrap_err();
        assert!(
            matches!(e, QmpError::EventTimeout { .. }) || e.is_read_timeout(),
            "{e:?}"
        );
        let e = q.execute("stop", None).unwrap_err();
        let QmpError::Parse { line, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(line, "{oops");
        assert!(std::error::Error::source(&e).is_some());
        drop(q);
        h.join().unwrap();
    }
}
