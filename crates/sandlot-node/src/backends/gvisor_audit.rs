//! Reports of denied syscalls inside gVisor (`container` sandboxes on runsc).
//!
//! Under runc the exec's seccomp supervisor reports each refusal through seccomp user
//! notification (`sandlot-guest` `seccomp.rs`). gVisor's sentry (runsc 20240729) answers
//! `SECCOMP_FILTER_FLAG_NEW_LISTENER` with EINVAL, so there the exec filter is installed
//! with `SECCOMP_RET_ERRNO(EPERM)`: refused, but not reported by the guest. The sentry itself
//! knows: its syscall entry (`pkg/sentry/kernel/task_syscall.go`, `doSyscall`) checks the
//! task's seccomp filters *before* strace and runtime-monitoring points (which therefore
//! never see a refused call) and logs each refusal at debug level:
//!
//! ```text
//! {"msg":"task_syscall.go:241] [  12:  12] Syscall 165: denied by seccomp","level":"debug","time":"2026-11-30T14:06:26.440760496Z"}
//! ```
//!
//! (`[tgid: tid]` in gVisor's root pid namespace, i.e. as the sandbox's guest agent sees
//! them, each followed by the id in the task's own pid namespace in parentheses when that
//! differs — `[   7(   2):   7(   2)]` for an exec's command; `time` RFC 3339 from the host
//! clock). So runsc runs with
//! `--debug --debug-command=boot --debug-log-format=json --debug-log=<dir>/sentry-debug.fifo`
//! ([`runsc_run_args`]): only the sandbox process (`boot`, the sentry) writes debug lines,
//! JSON-escaped (a file name the sandbox chooses cannot forge a line), into a FIFO that the
//! node holds open read-write (so the open never blocks and nothing lands on disk). A tokio
//! task drains it as it fills and keeps the refusals of the exec deny list (`reported_name`);
//! everything else (the sentry's other debug output, mostly systrap patching) is dropped
//! unparsed.
//!
//! Attribution: the sentry writes the line synchronously before the call returns EPERM, so
//! when an exec's exit frame reaches the node its refusals are already in the FIFO.
//! [`ExecWindow::finish`] drains what is left and takes the refusals stamped between the
//! exec's start and now. Execs of one sandbox that overlap in time cannot be told apart (the
//! line names a pid, not an exec): the first of them to end takes the refusals of the
//! shared interval. If the node is down, the sentry's writes fail with EPIPE (no reader) and
//! those refusals are lost; a re-adopted sandbox reports again from then on.
//!
//! Cost: mostly gVisor's debug log level itself (the sentry and gofer format and write their
//! debug messages), a little the FIFO: +10 ms p50 on a ~60 ms runsc exec of `true`, +10–30 ms
//! on a python start, on the loaded 2-core CI host (`bench/runsc_audit.py`, BENCHMARKS.md). An operator who
//! prefers the speed sets `SANDLOT_GVISOR_AUDIT=0` for the node ([`enabled`]): runsc sandboxes
//! created then still refuse the calls but report nothing (as before this existed).

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use sandlot_api::Violation;
use tokio::net::unix::pipe::Receiver;

/// Name of the FIFO in the container's directory.
pub const FIFO_NAME: &str = "sentry-debug.fifo";

/// Most refusals kept waiting for an exec to claim them (older ones are dropped).
const MAX_PENDING: usize = 1024;

/// Most refusals one exec reports (as `sandlot_guest::spec::MAX_VIOLATIONS_PER_EXEC`).
const MAX_PER_EXEC: usize = sandlot_guest::spec::MAX_VIOLATIONS_PER_EXEC;

/// Name of a call of the exec deny list (`sandlot_guest::syscalls`; `None` for any other
/// number). `clone3`, refused with ENOSYS so that glibc falls back to `clone`, is not on it
/// (as under runc); a refusal of any other number comes from a filter the sandbox's own
/// program installed and is not a Sandlot violation.
fn reported_name(nr: i64) -> Option<&'static str> {
    sandlot_guest::syscalls::syscall_name(nr)
}

/// One refusal read from the sentry's log.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Denial {
    nr: i32,
    name: &'static str,
    pid: u32,
    time_unix_ms: u64,
}

/// Parses one line of the sentry's JSON debug log; `Some` only for a refusal of a
/// [`reported_name`] call.
fn parse_line(line: &[u8]) -> Option<Denial> {
    const MARK: &[u8] = b"denied by seccomp";
    if !line.windows(MARK.len()).any(|w| w == MARK) {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        msg: String,
        time: String,
    }
    let e: Entry = serde_json::from_slice(line).ok()?;
    // "task_syscall.go:241] [  12:  13] Syscall 165: denied by seccomp"
    // (only the sentry's own syscall path writes that file name first; a message that
    // merely ends like one, e.g. with a path the sandbox chose, starts elsewhere)
    let (_, rest) = e.msg.strip_prefix("task_syscall.go:")?.split_once("] [")?;
    let (ids, rest) = rest.split_once(']')?;
    let (tgid, _tid) = ids.split_once(':')?;
    let nr: i64 = rest
        .trim()
        .strip_prefix("Syscall ")?
        .strip_suffix(": denied by seccomp")?
        .parse()
        .ok()?;
    let name = reported_name(nr)?;
    let time = chrono::DateTime::parse_from_rfc3339(&e.time).ok()?;
    Some(Denial {
        nr: nr as i32,
        name,
        // "   7(   2)": the root namespace's id, then the task's own
        pid: tgid.split('(').next()?.trim().parse().ok()?,
        time_unix_ms: time.timestamp_millis().max(0) as u64,
    })
}

/// Now, Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the reader keeps between reads.
#[derive(Default)]
struct State {
    /// Bytes after the last newline.
    partial: Vec<u8>,
    /// Refusals not yet claimed by an exec, oldest first.
    pending: VecDeque<Denial>,
    /// Running execs: token → start (Unix ms).
    running: HashMap<u64, u64>,
    next_token: u64,
}

impl State {
    fn feed(&mut self, mut data: &[u8]) {
        while let Some(i) = data.iter().position(|b| *b == b'\n') {
            let (line, rest) = data.split_at(i);
            data = &rest[1..];
            let d = if self.partial.is_empty() {
                parse_line(line)
            } else {
                self.partial.extend_from_slice(line);
                let d = parse_line(&self.partial);
                self.partial.clear();
                d
            };
            if let Some(d) = d {
                if self.pending.len() == MAX_PENDING {
                    self.pending.pop_front();
                }
                self.pending.push_back(d);
            }
        }
        // A line longer than any the sentry writes for a refusal is not one: keep the
        // buffer bounded.
        if self.partial.len() + data.len() <= 64 << 10 {
            self.partial.extend_from_slice(data);
        } else {
            self.partial.clear();
        }
    }

    /// Takes the refusals of the window `[start, end]`; drops those older than every
    /// running exec (nobody can claim them).
    fn claim(&mut self, start: u64, end: u64) -> Vec<Denial> {
        let mut out = Vec::new();
        self.pending.retain(|d| {
            if d.time_unix_ms >= start && d.time_unix_ms <= end {
                if out.len() < MAX_PER_EXEC {
                    out.push(d.clone());
                }
                false
            } else {
                true
            }
        });
        let oldest = self.running.values().min().copied().unwrap_or(u64::MAX);
        self.pending.retain(|d| d.time_unix_ms >= oldest);
        out
    }
}

/// The sentry debug log of one runsc sandbox: the FIFO's read end and the task draining it.
pub struct SentryLog {
    fd: Arc<Receiver>,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SentryLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads everything the FIFO holds now into `state` with plain non-blocking read(2)
/// (not tokio's cached readiness: at an exec's end the data must be taken even if the
/// reactor has not seen it yet). `Err(WouldBlock)` when empty, so that under
/// `Receiver::try_io` tokio clears its readiness.
fn drain(rx: &Receiver, state: &Mutex<State>) -> std::io::Result<()> {
    let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // SAFETY: reads into a buffer we own, of its length, from the receiver's open fd.
        let n = unsafe { libc::read(rx.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            st.feed(&buf[..n as usize]);
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted if n < 0 => continue,
            _ if n == 0 => return Err(std::io::ErrorKind::WouldBlock.into()),
            _ => return Err(e),
        }
    }
}

/// Registry of logs opened by [`prepare`] before `runsc run` and not yet attached to a
/// sandbox ([`attach`]); keyed by FIFO path.
static PREPARED: Mutex<Option<HashMap<PathBuf, Arc<SentryLog>>>> = Mutex::new(None);

/// Whether runsc sandboxes get the sentry log at creation: unless the node's environment has
/// `SANDLOT_GVISOR_AUDIT=0` (or `off`, `false`).
pub fn enabled() -> bool {
    !matches!(
        std::env::var("SANDLOT_GVISOR_AUDIT").as_deref(),
        Ok("0") | Ok("off") | Ok("false")
    )
}

/// The global `runsc` flags (before `run`) that send the sentry's debug log to the FIFO of
/// the container in `dir` (none when not [`enabled`]).
pub fn runsc_run_args(dir: &Path) -> Vec<std::ffi::OsString> {
    if !enabled() {
        return Vec::new();
    }
    let mut log = std::ffi::OsString::from("--debug-log=");
    log.push(dir.join(FIFO_NAME));
    vec![
        "--debug".into(),
        // Only the sandbox process (the sentry) logs; `run`, the gofer and later commands
        // do not.
        "--debug-command=boot".into(),
        "--debug-log-format=json".into(),
        log,
    ]
}

/// Opens the FIFO at `path` read-write, non-blocking: the open never waits for a writer,
/// and runsc's open for writing never waits for the node (refused if it is not a FIFO).
fn open_fifo(path: &Path) -> std::io::Result<Receiver> {
    tokio::net::unix::pipe::OpenOptions::new()
        .read_write(true)
        .open_receiver(path)
}

impl SentryLog {
    fn open(path: &Path) -> std::io::Result<Arc<Self>> {
        let fd = Arc::new(open_fifo(path)?);
        let state = Arc::new(Mutex::new(State::default()));
        let task = {
            let (fd, state) = (fd.clone(), state.clone());
            tokio::spawn(async move {
                loop {
                    if fd.readable().await.is_err() {
                        return;
                    }
                    match fd.try_io(|| drain(&fd, &state)) {
                        Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => {
                            tracing::warn!(error = %e, "reading gVisor's debug log failed");
                            return;
                        }
                        _ => {}
                    }
                }
            })
        };
        Ok(Arc::new(Self { fd, state, task }))
    }

    /// Marks the start of an exec; [`ExecWindow::finish`] takes its refusals.
    pub fn begin(self: &Arc<Self>) -> ExecWindow {
        let start = now_ms();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.next_token += 1;
        let token = st.next_token;
        st.running.insert(token, start);
        ExecWindow {
            log: self.clone(),
            token,
            start,
        }
    }
}

/// One exec's time window in a [`SentryLog`]; dropping it without [`ExecWindow::finish`]
/// (an exec that failed) unregisters it.
pub struct ExecWindow {
    log: Arc<SentryLog>,
    token: u64,
    start: u64,
}

impl ExecWindow {
    /// The refusals of this exec, oldest first, as wire violations (`layer` `seccomp`,
    /// `pid` in gVisor's root pid namespace, `time_unix_ms` from the sentry's stamp).
    pub fn finish(self) -> Vec<Violation> {
        let _ = drain(&self.log.fd, &self.log.state);
        let mut st = self.log.state.lock().unwrap_or_else(|p| p.into_inner());
        st.running.remove(&self.token);
        st.claim(self.start, now_ms())
            .into_iter()
            .map(|d| Violation {
                layer: "seccomp".into(),
                syscall: d.name.into(),
                nr: d.nr,
                pid: d.pid,
                time_unix_ms: d.time_unix_ms,
                ..Default::default()
            })
            .collect()
    }
}

impl Drop for ExecWindow {
    fn drop(&mut self) {
        let mut st = self.log.state.lock().unwrap_or_else(|p| p.into_inner());
        st.running.remove(&self.token);
    }
}

/// Before `runsc run`: creates the FIFO in `dir` (root only, 0600) and opens its read end,
/// kept until [`attach`] (so runsc's open for writing does not block, and no line meets a
/// missing reader).
///
/// # Errors
/// The `mkfifo` or open error.
pub fn prepare(dir: &Path) -> std::io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    let path = dir.join(FIFO_NAME);
    let c = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(e);
        }
    }
    let log = SentryLog::open(&path)?;
    PREPARED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(path, log);
    Ok(())
}

/// The log of the runsc container in `dir`: the one [`prepare`] opened, or (a sandbox
/// re-adopted after a node restart) the existing FIFO opened again; `None` when the sandbox
/// has none (created before this existed) or it cannot be opened (logged).
pub fn attach(dir: &Path) -> Option<Arc<SentryLog>> {
    let path = dir.join(FIFO_NAME);
    if let Some(log) = PREPARED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_mut()
        .and_then(|m| m.remove(&path))
    {
        return Some(log);
    }
    if !path.exists() {
        return None;
    }
    match SentryLog::open(&path) {
        Ok(log) => Some(log),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot open gVisor's debug log: seccomp refusals of this sandbox go unreported");
            None
        }
    }
}

/// Forgets a log [`prepare`] opened for a create that failed.
pub fn forget(dir: &Path) {
    if let Some(m) = PREPARED.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        m.remove(&dir.join(FIFO_NAME));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = r#"{"msg":"task_syscall.go:241] [  12:  13] Syscall 165: denied by seccomp","level":"debug","time":"2026-11-30T14:06:26.440760496Z"}"#;

    #[test]
    fn parses_a_refusal_of_the_deny_list() {
        let d = parse_line(LINE.as_bytes()).unwrap();
        assert_eq!((d.nr, d.name, d.pid), (165, "mount", 12));
        assert_eq!(d.time_unix_ms, 1_796_047_586_440);
    }

    #[test]
    fn parses_the_ids_of_a_nested_pid_namespace() {
        let l = LINE.replace("[  12:  13]", "[   7(   2):   7(   2)]");
        let d = parse_line(l.as_bytes()).unwrap();
        assert_eq!((d.nr, d.pid), (165, 7));
    }

    #[test]
    fn ignores_other_lines_and_other_filters() {
        // clone3 (ENOSYS by design), a number outside the list, another message, a forged
        // message inside a JSON string.
        for l in [
            LINE.replace("Syscall 165", "Syscall 435"),
            LINE.replace("Syscall 165", "Syscall 39"),
            r#"{"msg":"usertrap_amd64.go:210] [   1:   1] Found the pattern","level":"debug","time":"2026-11-30T14:06:26Z"}"#.into(),
            r#"{"msg":"vfs: open \"x\n[  1:  1] Syscall 165: denied by seccomp\"","level":"debug","time":"2026-11-30T14:06:26Z"}"#.into(),
            "not json denied by seccomp".into(),
            LINE.replace("task_syscall.go:241]", "vfs.go:9] open x] [ 1: 1]"),
        ] {
            assert_eq!(parse_line(l.as_bytes()), None, "{l}");
        }
    }

    #[test]
    fn feeds_split_lines_and_claims_by_window() {
        let mut st = State::default();
        let two = format!("{LINE}\n{}\n", LINE.replace("165", "321"));
        let (a, b) = two.as_bytes().split_at(40);
        st.feed(a);
        st.feed(b);
        assert_eq!(st.pending.len(), 2);
        // An exec still running since 0 keeps them claimable.
        st.running.insert(1, 0);
        assert!(st.claim(0, 1_796_047_586_000).is_empty());
        assert_eq!(st.pending.len(), 2);
        let got = st.claim(1_796_047_586_000, u64::MAX);
        assert_eq!(
            got.iter().map(|d| d.name).collect::<Vec<_>>(),
            ["mount", "bpf"]
        );
        assert!(st.pending.is_empty());
    }

    #[test]
    fn unclaimable_refusals_are_dropped() {
        let mut st = State::default();
        st.feed(format!("{LINE}\n").as_bytes());
        st.running.insert(1, u64::MAX - 1);
        assert!(st.claim(0, 1).is_empty());
        assert!(st.pending.is_empty());
    }
}
