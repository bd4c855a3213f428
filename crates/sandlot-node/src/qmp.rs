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
use crate::node::{NodeError, NodeResult};
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

fn qmp_err(path: &Path, what: &str, e: impl std::fmt::Display) -> NodeError {
    let e = e.to_string();
    NodeError::io(
        format!("QMP at {}: {what}: {e}", path.display()),
        std::io::Error::other(e),
    )
}

impl Qmp {
    /// Connects to the QMP socket at `path`, retrying until `deadline` while the socket is
    /// missing or refuses (QEMU still starting), then reads the greeting and sends
    /// `qmp_capabilities`. `timeout` bounds every later read of one answer.
    ///
    /// # Errors
    /// `Internal` when the socket cannot be connected by `deadline`, the greeting is not
    /// QMP, or negotiation fails.
    pub fn connect(path: &Path, deadline: Instant, timeout: Duration) -> NodeResult<Qmp> {
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(qmp_err(path, "connect", e)),
            }
        };
        let writer = stream.try_clone().map_err(|e| qmp_err(path, "clone", e))?;
        let mut q = Qmp {
            path: path.to_path_buf(),
            reader: BufReader::new(stream),
            writer,
            events: VecDeque::new(),
            timeout,
        };
        let greeting = q.read_value()?;
        if greeting.get("QMP").is_none() {
            return Err(qmp_err(path, "greeting", format!("not QMP: {greeting}")));
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    fn read_value(&mut self) -> NodeResult<Value> {
        self.reader
            .get_ref()
            .set_read_timeout(Some(self.timeout))
            .map_err(|e| qmp_err(&self.path, "set timeout", e))?;
        let mut line = String::new();
        loop {
            line.clear();
            let n = self
                .reader
                .read_line(&mut line)
                .map_err(|e| qmp_err(&self.path, "read", e))?;
            if n == 0 {
                return Err(qmp_err(&self.path, "read", "QEMU closed the connection"));
            }
            if line.trim().is_empty() {
                continue;
            }
            return serde_json::from_str(line.trim())
                .map_err(|e| qmp_err(&self.path, "parse", format!("{e}: {line}")));
        }
    }

    /// Reads until the answer to the command just sent, queueing events.
    fn answer(&mut self, name: &str) -> NodeResult<Value> {
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
                return Err(qmp_err(
                    &self.path,
                    name,
                    format!(
                        "{}: {}",
                        e.get("class").and_then(Value::as_str).unwrap_or("Error"),
                        e.get("desc").and_then(Value::as_str).unwrap_or("")
                    ),
                ));
            }
            return Err(qmp_err(&self.path, name, format!("unexpected {v}")));
        }
    }

    fn send(
        &mut self,
        name: &str,
        args: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
    ) -> NodeResult<()> {
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
                .map_err(|e| qmp_err(&self.path, name, e)),
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
                .map_err(|e| qmp_err(&self.path, name, e))?;
                if n < line.len() {
                    self.writer
                        .write_all(&line[n..])
                        .map_err(|e| qmp_err(&self.path, name, e))?;
                }
                Ok(())
            }
        }
    }

    /// Runs command `name` with `args` (a JSON object or none); its `return` value.
    ///
    /// # Errors
    /// `Internal` with QEMU's error class and description, or an I/O failure.
    pub fn execute(&mut self, name: &str, args: Option<Value>) -> NodeResult<Value> {
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
    ) -> NodeResult<Value> {
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
    ) -> NodeResult<Value> {
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
                return Err(qmp_err(&self.path, name, "event did not come in time"));
            }
            let saved = self.timeout;
            self.timeout = left.min(saved);
            let r = self.read_value();
            self.timeout = saved;
            match r {
                Ok(v) if matches(&v) => return Ok(v),
                Ok(_) => {}
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(e) => {
                    // A read timeout shorter than the deadline: keep waiting.
                    if !e.to_string().contains("timed out")
                        && !e.to_string().contains("Resource temporarily unavailable")
                    {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Polls `query-migrate` until its status is `completed` (returned) or `failed` /
    /// `cancelled` (an error with QEMU's reason), up to `deadline`.
    ///
    /// # Errors
    /// `Internal` on a failed migration, a timeout or I/O failure.
    pub fn wait_migration(&mut self, deadline: Instant) -> NodeResult<Value> {
        loop {
            let v = self.execute("query-migrate", None)?;
            match v.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(v),
                Some(s @ ("failed" | "cancelled")) => {
                    return Err(qmp_err(
                        &self.path,
                        "migration",
                        format!(
                            "{s}: {}",
                            v.get("error-desc").and_then(Value::as_str).unwrap_or("")
                        ),
                    ))
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(qmp_err(
                    &self.path,
                    "migration",
                    format!("not done in time: {v}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
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
    }
}
