//! Background processes: commands started with a handle that live in the node, not in the
//! request, the client or the server that started them. A node serves them through the
//! `process_*` calls of [`Node`] with [`WithProcesses`] around it, so every server
//! reaching the node (in process, or as a `RemoteNode`) sees the same processes.
//!
//! [`ProcessTable::spawn`] runs the command through [`Node::exec_controlled`] in a task of
//! its own and keeps, per process, the last `max_output_bytes` of stdout and of stderr in an
//! [`OutputLog`] (a ring with absolute byte offsets), its stdin sender, a signal sender and,
//! once it ended, its [`ExecResult`]. Any client can then read its output from byte offsets
//! (a reconnecting client passes the offsets it reached), wait for it, signal it, feed its
//! stdin and remove it.
//!
//! Signals (semantics of [`sandlot_guest::spec::FORWARDED_SIGNALS`]): SIGKILL ends the
//! whole process tree (exec cgroup on the function backend, the exec's pid namespace in a
//! container); every other signal goes to the command's process group (the command is a
//! session leader: `kill(-pgid, sig)`), like a terminal's job control; children that moved
//! to their own process group do not get it. When the command's leader ends, what is left
//! of its tree is killed, as for every exec.
//!
//! Bounds: at most [`ProcessLimits::max_running`] running processes per sandbox (more:
//! `ResourceExhausted`) and [`ProcessLimits::max_kept`] records per sandbox (the oldest
//! exited ones are forgotten first); retained output per stream up to [`MAX_RETAIN`],
//! kept in unlinked files under the table's spill directory (`DATA/process-output`), not in memory ([`OutputLog`]):
//! a record costs the node a few KiB of memory whatever its output, and at most
//! `max_kept` × 2 × `max_output_bytes` (64 × 2 × 16 MiB = 2 GiB) of disk per sandbox,
//! freed when the records are forgotten.
//!
//! Numbers: the table numbers each sandbox's processes from
//! [`sandlot_api::FIRST_PROCESS_NUMBER`] up ([`Process::number`], E2B's `pid`), never
//! reusing one while the sandbox's entry lives (until the sandbox is forgotten), so any
//! server can resolve a number through `process_list` alone. A process's `tag` and `meta`
//! (bounded by [`sandlot_api::MAX_TAG_BYTES`] / [`sandlot_api::MAX_META_BYTES`]) are kept
//! in its record.
//!
//! Lifetime: processes end with their sandbox (delete, TTL) and are forgotten with
//! [`ProcessTable::forget_sandbox`]. The table is memory only, but a process that runs
//! through a sandbox's guest agent outlives the node's process (the agent tables it, with
//! the last 64 KiB of its output and its end): after a restart [`ProcessTable::refind`]
//! registers it again under its old handle, with its `tag`, `meta` and `number` (kept by
//! the agent as the exec's labels) (container, microvm, vm; function sandboxes' agent
//! path), and so does a node that took over a paused VM from another one. On a live node,
//! an exec whose agent stream ends without an exit (the connection dropped) is asked for
//! again and read on from the offsets the node has (the process task, `collect`).
//! Processes on the function backend's helper path die with the node's exec tasks and
//! their handles answer `NotFound`.
use crate::node::{ExecControl, Node, NodeError, NodeResult};
use bytes::Bytes;
use sandlot_api::{
    ApiError, Cmd, ExecEvent, ExecRequest, ExecResult, Process, ProcessEvent, ProcessState,
    SpawnRequest, StreamName,
};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Default bytes retained per stream (2 MiB).
pub const DEFAULT_RETAIN: u64 = 2 << 20;
/// Largest `max_output_bytes` of a background process (16 MiB per stream).
pub const MAX_RETAIN: u64 = 16 << 20;
/// Largest chunk in one output event, bytes.
const EVENT_CHUNK: usize = 64 << 10;
/// How long a stdin write waits for a process that does not read its stdin.
const STDIN_WAIT: Duration = Duration::from_secs(10);
/// How long removing a process waits for its SIGKILL to take effect before it drops the
/// exec (which kills the tree too).
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How long a re-find waits for the end of a process its agent reports ended to be read.
const REFOUND_END_WAIT: Duration = Duration::from_secs(5);

/// Per-sandbox bounds of the table.
#[derive(Debug, Clone, Copy)]
pub struct ProcessLimits {
    /// Running processes per sandbox (default 16).
    pub max_running: usize,
    /// Records (running + exited) per sandbox (default 64); the oldest exited go first.
    pub max_kept: usize,
    /// Free bytes of the spill directory's file system below which an output log's file
    /// stops growing (default 256 MiB, the server's `--disk-reserve-mib` default; 0: off).
    /// The bytes it would have grown by are not retained and read as skipped, so a
    /// sandbox's output cannot take the last free bytes of the data directory that the
    /// node's and server's own records need; a log whose file already has space for its
    /// whole ring goes on overwriting it (no new space).
    pub spill_reserve_bytes: u64,
}

impl Default for ProcessLimits {
    fn default() -> Self {
        ProcessLimits {
            max_running: 16,
            max_kept: 64,
            spill_reserve_bytes: 256 << 20,
        }
    }
}

/// The last `cap` bytes of one output stream, with absolute offsets: byte `n` of the stream
/// is retained while `start() <= n < end()`.
///
/// The bytes live in a file, not in memory (issue 25, item 4: 48 processes retaining
/// 16 MiB each took the server to ~2 GB, and it stayed there after their sandboxes were
/// deleted): an unlinked temporary file (`O_TMPFILE`) in the table's spill directory, used
/// as a ring — byte `n` is at file position `n % cap`, so the file never grows past `cap`
/// bytes. The file is gone (space freed) when the log is dropped, i.e. when the process's
/// record is forgotten (removed, evicted, or its sandbox deleted), and nothing is left
/// behind by a crash. A write that fails (disk full), or that would grow the file while
/// its file system has less than the log's reserve free ([`OutputLog::with_reserve`]),
/// drops those bytes: they read as skipped (`start()` moves past them), the stream's total
/// still counts them.
#[derive(Debug)]
pub struct OutputLog {
    cap: u64,
    end: u64,
    /// No byte before this offset is retained (raised past bytes a failed write lost).
    floor: u64,
    /// Offsets `[from, to)` the node never got (a re-attach after its connection to the
    /// agent dropped found the agent's ring starting later, [`OutputLog::skip_to`]),
    /// oldest first, at most [`MAX_HOLES`]; they read as skipped.
    holes: std::collections::VecDeque<(u64, u64)>,
    file: Option<std::fs::File>,
    /// Every byte of the ring has file space (size and `st_blocks` × 512 both ≥ `cap`,
    /// remembered once seen): writes then take no new space and the reserve is not checked.
    full: bool,
    /// Free bytes the file's file system keeps: a write that may grow the file is dropped
    /// below this (0: never).
    reserve: u64,
}

/// Most holes an [`OutputLog`] keeps; older ones fold into its floor (the bytes before
/// them then read as skipped too).
const MAX_HOLES: usize = 16;

impl OutputLog {
    /// An empty log retaining at most `cap` bytes in an unlinked file under `dir` (no file
    /// when `cap` is 0).
    ///
    /// # Errors
    /// The temporary file cannot be created in `dir`.
    pub fn new(cap: usize, dir: &std::path::Path) -> std::io::Result<Self> {
        let file = if cap == 0 {
            None
        } else {
            Some(tempfile::tempfile_in(dir)?)
        };
        Ok(OutputLog {
            cap: cap as u64,
            end: 0,
            floor: 0,
            holes: Default::default(),
            file,
            full: false,
            reserve: 0,
        })
    }

    /// The same log, dropping writes that may grow its file while its file system has
    /// fewer than `bytes` free (`fstatvfs(3)`, `f_bavail`; 0: never).
    pub fn with_reserve(mut self, bytes: u64) -> Self {
        self.reserve = bytes;
        self
    }

    /// Whether a write may grow the file while its file system is below the reserve. The
    /// file's allocated size decides whether a write may grow it, not the bytes written:
    /// holes ([`OutputLog::skip_to`], dropped writes) leave parts of a ring unallocated.
    fn below_reserve(&mut self) -> bool {
        use std::os::unix::fs::MetadataExt;
        if self.reserve == 0 || self.full {
            return false;
        }
        let Some(f) = &self.file else { return false };
        // Both: a file with a hole below its end, or space given past its end (XFS
        // preallocation), is not full.
        if f.metadata()
            .is_ok_and(|m| m.len() >= self.cap && m.blocks().saturating_mul(512) >= self.cap)
        {
            self.full = true;
            return false;
        }
        match nix::sys::statvfs::fstatvfs(f) {
            Ok(st) => st.blocks_available().saturating_mul(st.fragment_size()) < self.reserve,
            Err(_) => false,
        }
    }

    /// Writes `data`, whose first byte has absolute offset `at`, into the ring (`data` is
    /// at most `cap` bytes).
    fn write_at(&self, at: u64, data: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let Some(f) = &self.file else { return Ok(()) };
        let pos = at % self.cap;
        let first = ((self.cap - pos) as usize).min(data.len());
        f.write_all_at(&data[..first], pos)?;
        if first < data.len() {
            f.write_all_at(&data[first..], 0)?;
        }
        Ok(())
    }

    /// Appends bytes the process wrote; the oldest fall out past the cap.
    pub fn push(&mut self, data: &[u8]) {
        let len = data.len() as u64;
        if self.cap > 0 && len > 0 {
            let skip = len.saturating_sub(self.cap);
            if self.below_reserve() {
                tracing::debug!(
                    "background process output not retained: data dir below its reserve"
                );
                self.floor = self.end + len;
            } else if let Err(e) = self.write_at(self.end + skip, &data[skip as usize..]) {
                tracing::warn!(error = %e, "background process output not retained");
                self.floor = self.end + len;
            }
        }
        self.end += len;
    }

    /// Makes an empty log start at offset `at` (a process taken up after a node restart:
    /// the bytes before are lost and read as skipped).
    pub fn begin_at(&mut self, at: u64) {
        if self.end == 0 {
            self.end = at;
            self.floor = at;
        }
    }

    /// Moves the end on to `at` without bytes (a re-attached stream that resumes past
    /// what the node got): the bytes in between read as skipped, those retained before
    /// them stay readable. Nothing happens when `at` is not past the end.
    pub fn skip_to(&mut self, at: u64) {
        if at <= self.end {
            return;
        }
        self.holes.push_back((self.end, at));
        self.end = at;
        let start = self.start();
        self.holes.retain(|h| h.1 > start);
        while self.holes.len() > MAX_HOLES {
            let (_, to) = self.holes.pop_front().expect("over the cap means one");
            self.floor = self.floor.max(to);
        }
    }

    /// Where a reader at `off` goes on when its bytes are not retained (older than
    /// [`OutputLog::start`], or in a hole [`OutputLog::skip_to`] left): the next retained
    /// offset; `None` when byte `off` is retained (or `off` is the end).
    pub fn skip_from(&self, off: u64) -> Option<u64> {
        let mut to = off.max(self.start());
        // Sorted and disjoint: one pass moves across touching holes too.
        for &(a, b) in &self.holes {
            if a <= to && to < b {
                to = b;
            }
        }
        (to > off).then_some(to)
    }

    /// Whether any byte written is not retained (fell out of the cap, lost, or skipped).
    pub fn lost_any(&self) -> bool {
        self.start() > 0 || !self.holes.is_empty()
    }

    /// Offset of the oldest retained byte.
    pub fn start(&self) -> u64 {
        self.end.saturating_sub(self.cap).max(self.floor)
    }

    /// Total bytes written (offset of the next byte).
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Up to `max` retained bytes from offset `from` (moved on as [`OutputLog::skip_from`]
    /// says when not retained), with the offset they start at; they stop before a hole.
    /// Empty at or past the end, and when the file cannot be read (logged).
    pub fn read(&self, from: u64, max: usize) -> (u64, Vec<u8>) {
        use std::os::unix::fs::FileExt;
        let from = self.skip_from(from).unwrap_or(from);
        let Some(f) = self.file.as_ref().filter(|_| from < self.end) else {
            return (from, Vec::new());
        };
        let limit = self
            .holes
            .iter()
            .find(|h| h.0 > from)
            .map_or(self.end, |h| h.0);
        let n = (limit - from).min(max as u64) as usize;
        let mut buf = vec![0u8; n];
        let pos = from % self.cap;
        let first = ((self.cap - pos) as usize).min(n);
        let r = f
            .read_exact_at(&mut buf[..first], pos)
            .and_then(|()| f.read_exact_at(&mut buf[first..], 0));
        match r {
            Ok(()) => (from, buf),
            Err(e) => {
                tracing::warn!(error = %e, "background process output unreadable");
                (from, Vec::new())
            }
        }
    }
}

struct State {
    stdout: OutputLog,
    stderr: OutputLog,
    result: Option<ExecResult>,
    error: Option<ApiError>,
    ended_at: Option<String>,
}

impl State {
    fn ended(&self) -> bool {
        self.result.is_some() || self.error.is_some()
    }

    fn log(&mut self, s: StreamName) -> &mut OutputLog {
        match s {
            StreamName::Stdout => &mut self.stdout,
            StreamName::Stderr => &mut self.stderr,
        }
    }
}

/// One background process. Cheap to share (`Arc`); the table and its task hold it.
pub struct ProcessHandle {
    id: String,
    /// Its number within the sandbox ([`Process::number`]).
    number: u32,
    tag: Option<String>,
    meta: Option<serde_json::Value>,
    sandbox_id: String,
    cmd: Cmd,
    started_at: String,
    state: Mutex<State>,
    /// Bumped on every change (output, end, stdin closed); waiters and followers watch it.
    version: watch::Sender<u64>,
    stdin: Mutex<Option<mpsc::Sender<Bytes>>>,
    /// Replaced when the exec is taken up again after its agent connection dropped.
    signals: Mutex<mpsc::UnboundedSender<i32>>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
    /// Runs on a terminal: its stdin channel carries frames
    /// (`sandlot_guest::spec::pty_frame_data` / `pty_frame_resize`), not raw bytes.
    pty: bool,
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn raw_chunk(data: &str, b64: &Option<String>) -> Vec<u8> {
    use base64::Engine as _;
    match b64 {
        Some(b) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .unwrap_or_else(|_| data.as_bytes().to_vec()),
        None => data.as_bytes().to_vec(),
    }
}

impl ProcessHandle {
    /// Its handle (`pr-…`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether it has ended.
    pub fn ended(&self) -> bool {
        self.state.lock().unwrap().ended()
    }

    /// Its wire record.
    pub fn info(&self) -> Process {
        let st = self.state.lock().unwrap();
        Process {
            id: self.id.clone(),
            number: self.number,
            tag: self.tag.clone(),
            meta: self.meta.clone(),
            sandbox_id: self.sandbox_id.clone(),
            cmd: self.cmd.clone(),
            state: if st.ended() {
                ProcessState::Exited
            } else {
                ProcessState::Running
            },
            started_at: self.started_at.clone(),
            ended_at: st.ended_at.clone(),
            stdin_open: !st.ended() && self.stdin.lock().unwrap().is_some(),
            stdout_bytes: st.stdout.end(),
            stderr_bytes: st.stderr.end(),
            result: st.result.clone(),
            error: st.error.clone(),
        }
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Waits until the process ends or `timeout` passes, then answers its record (still
    /// `running` after a timeout; that is not an error).
    pub async fn wait(&self, timeout: Duration) -> Process {
        let mut rx = self.version.subscribe();
        let _ = tokio::time::timeout(timeout, async {
            loop {
                if self.ended() {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        self.info()
    }

    /// Sends `signal` (a Linux number the caller validated: see the module docs).
    ///
    /// # Errors
    /// `Conflict` when the process has already ended.
    pub fn signal(&self, signal: i32) -> NodeResult<()> {
        if self.ended() || self.signals.lock().unwrap().send(signal).is_err() {
            return Err(NodeError::Conflict(format!(
                "process {} has already exited",
                self.id
            )));
        }
        Ok(())
    }

    /// Writes `data` to the process's stdin, then closes it when `eof`.
    ///
    /// # Errors
    /// `Conflict` when stdin is not open (not started with `stdin: true`, closed, or the
    /// process ended); `DeadlineExceeded` when the process has not read earlier input for
    /// 10 s (the pipe and the queue are full).
    pub async fn write_stdin(&self, data: Bytes, eof: bool) -> NodeResult<()> {
        let tx = self.stdin.lock().unwrap().clone();
        let Some(tx) = tx.filter(|_| !self.ended()) else {
            return Err(NodeError::Conflict(format!(
                "stdin of process {} is not open (start it with \"stdin\": true; it closes at eof or exit)",
                self.id
            )));
        };
        if !data.is_empty() {
            let data = if self.pty {
                Bytes::from(sandlot_guest::spec::pty_frame_data(&data))
            } else {
                data
            };
            match tokio::time::timeout(STDIN_WAIT, tx.send(data)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    return Err(NodeError::Conflict(format!(
                        "process {} has already exited",
                        self.id
                    )))
                }
                Err(_) => {
                    return Err(NodeError::DeadlineExceeded(format!(
                        "process {} has not read its stdin for {} s",
                        self.id,
                        STDIN_WAIT.as_secs()
                    )))
                }
            }
        }
        if eof {
            self.stdin.lock().unwrap().take();
            self.bump();
        }
        Ok(())
    }

    /// Whether it runs on a terminal (started with `pty`).
    pub fn is_pty(&self) -> bool {
        self.pty
    }

    /// Resizes its terminal (the command's foreground process group gets SIGWINCH).
    ///
    /// # Errors
    /// `InvalidArgument` for a process without a terminal or a size out of range;
    /// `Conflict` when it has ended; `DeadlineExceeded` as [`ProcessHandle::write_stdin`].
    pub async fn resize(&self, size: sandlot_api::PtySize) -> NodeResult<()> {
        if !self.pty {
            return Err(NodeError::InvalidArgument(format!(
                "process {} has no terminal (start it with \"pty\")",
                self.id
            )));
        }
        size.validate().map_err(NodeError::InvalidArgument)?;
        let tx = self.stdin.lock().unwrap().clone();
        let Some(tx) = tx.filter(|_| !self.ended()) else {
            return Err(NodeError::Conflict(format!(
                "process {} has already exited",
                self.id
            )));
        };
        let frame = sandlot_guest::spec::pty_frame_resize(sandlot_guest::spec::PtySize {
            rows: size.rows,
            cols: size.cols,
        });
        match tokio::time::timeout(STDIN_WAIT, tx.send(Bytes::from(frame))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(NodeError::Conflict(format!(
                "process {} has already exited",
                self.id
            ))),
            Err(_) => Err(NodeError::DeadlineExceeded(format!(
                "process {} has not read its terminal input for {} s",
                self.id,
                STDIN_WAIT.as_secs()
            ))),
        }
    }

    /// The process's output from byte offsets, as [`ProcessEvent`]s: retained chunks of
    /// each stream from its offset (a `skipped` event first when the offset is older than
    /// what is retained), then, once the process ended, one `exit` (or `error`) event.
    /// Without `follow` the stream ends when the retained output is sent (with the `exit`
    /// event only if it already ended); with `follow` it continues until the end. Order
    /// within a stream is exact; the interleaving of stdout and stderr is not kept.
    ///
    /// # Errors
    /// `InvalidArgument` when an offset is past the bytes written so far.
    pub fn output(
        self: Arc<Self>,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> NodeResult<impl futures::Stream<Item = ProcessEvent> + Send + 'static> {
        {
            let st = self.state.lock().unwrap();
            for (name, off, log) in [
                ("stdout_offset", stdout_offset, &st.stdout),
                ("stderr_offset", stderr_offset, &st.stderr),
            ] {
                if off > log.end() {
                    return Err(NodeError::InvalidArgument(format!(
                        "{name} = {off} is past the {} bytes written so far",
                        log.end()
                    )));
                }
            }
        }
        let rx = self.version.subscribe();
        let cursor = Cursor {
            proc: self,
            offsets: [stdout_offset, stderr_offset],
            follow,
            done: false,
            rx,
        };
        Ok(futures::stream::unfold(cursor, |mut c| async move {
            let ev = c.next().await?;
            Some((ev, c))
        }))
    }
}

struct Cursor {
    proc: Arc<ProcessHandle>,
    offsets: [u64; 2],
    follow: bool,
    done: bool,
    rx: watch::Receiver<u64>,
}

impl Cursor {
    async fn next(&mut self) -> Option<ProcessEvent> {
        if self.done {
            return None;
        }
        loop {
            // Marks the current version seen before reading, so a change after the read
            // wakes `changed` below.
            self.rx.borrow_and_update();
            {
                let mut st = self.proc.state.lock().unwrap();
                for (i, s) in [StreamName::Stdout, StreamName::Stderr]
                    .into_iter()
                    .enumerate()
                {
                    let log = st.log(s);
                    if let Some(to) = log.skip_from(self.offsets[i]) {
                        let ev = ProcessEvent::Skipped {
                            stream: s,
                            from: self.offsets[i],
                            to,
                        };
                        self.offsets[i] = to;
                        return Some(ev);
                    }
                    let (off, data) = log.read(self.offsets[i], EVENT_CHUNK);
                    if !data.is_empty() {
                        self.offsets[i] = off + data.len() as u64;
                        return Some(ProcessEvent::chunk(s, &data, off));
                    }
                }
                if st.ended() {
                    self.done = true;
                    return Some(match (&st.result, &st.error) {
                        (Some(r), _) => ProcessEvent::Exit { result: r.clone() },
                        (None, Some(e)) => ProcessEvent::Error { error: e.clone() },
                        (None, None) => unreachable!("ended"),
                    });
                }
            }
            if !self.follow || self.rx.changed().await.is_err() {
                self.done = true;
                return None;
            }
        }
    }
}

type ExecFuture = Pin<Box<dyn Future<Output = NodeResult<ExecResult>> + Send>>;

/// The background processes of a node, by sandbox.
pub struct ProcessTable {
    node: Arc<dyn Node>,
    limits: ProcessLimits,
    spill_dir: std::path::PathBuf,
    by_sandbox: Mutex<HashMap<String, SandboxProcs>>,
}

/// The processes of one sandbox and the number its next one gets.
#[derive(Default)]
struct SandboxProcs {
    /// Oldest first.
    list: Vec<Arc<ProcessHandle>>,
    /// 0 until its first process (then [`sandlot_api::FIRST_PROCESS_NUMBER`] and up).
    next_number: u32,
}

/// A fresh handle: `pr-` + 20 lowercase hex digits (80 random bits).
fn new_id() -> String {
    let bytes: [u8; 10] = rand::random();
    let mut s = String::from("pr-");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

impl ProcessTable {
    /// A table running processes on `node`, keeping their retained output in unlinked
    /// files under `spill_dir` (created if missing; on the data directory's file system in
    /// the server).
    ///
    /// # Errors
    /// `spill_dir` cannot be created.
    pub fn new(
        node: Arc<dyn Node>,
        limits: ProcessLimits,
        spill_dir: std::path::PathBuf,
    ) -> std::io::Result<Arc<Self>> {
        std::fs::create_dir_all(&spill_dir)?;
        Ok(Arc::new(ProcessTable {
            node,
            limits,
            spill_dir,
            by_sandbox: Mutex::new(HashMap::new()),
        }))
    }

    /// An output log retaining `cap` bytes in the spill directory, under the table's
    /// [`ProcessLimits::spill_reserve_bytes`].
    ///
    /// # Errors
    /// `ResourceExhausted` when its file cannot be created (the spill directory is full).
    fn new_log(&self, cap: u64) -> NodeResult<OutputLog> {
        OutputLog::new(cap as usize, &self.spill_dir)
            .map(|l| l.with_reserve(self.limits.spill_reserve_bytes))
            .map_err(|e| {
                NodeError::ResourceExhausted(format!(
                    "cannot keep the output of a background process in {}: {e}",
                    self.spill_dir.display()
                ))
            })
    }

    /// Starts `req` in sandbox `sandbox` (the caller checked it exists and runs).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad request (the exec's own checks, `timeout_s`,
    /// `max_output_bytes`); `ResourceExhausted` at [`ProcessLimits::max_running`] or when the
    /// sandbox is at its process limit; the node's error when the exec cannot start (e.g.
    /// `Conflict` for a paused sandbox). Set-up failures the node finds later (a missing
    /// `cwd`) end the process with `error` set.
    pub async fn spawn(&self, sandbox: &str, req: SpawnRequest) -> NodeResult<Process> {
        let timeout_s = req.timeout_s.unwrap_or(sandlot_api::MAX_TIMEOUT_S);
        sandlot_api::check_timeout_s("timeout_s", timeout_s).map_err(NodeError::InvalidArgument)?;
        req.check_labels().map_err(NodeError::InvalidArgument)?;
        let retain = req.max_output_bytes.unwrap_or(DEFAULT_RETAIN);
        if retain > MAX_RETAIN {
            return Err(NodeError::InvalidArgument(format!(
                "max_output_bytes = {retain} is over {MAX_RETAIN} for a background process"
            )));
        }
        let exec_req = ExecRequest {
            cmd: req.cmd.clone(),
            cwd: req.cwd,
            env: req.env,
            stdin_b64: req.stdin_b64,
            timeout_s: Some(timeout_s),
            // The node keeps no copy: the output lives in the process's logs.
            max_output_bytes: Some(0),
            user: req.user,
            step: None,
            pty: req.pty,
        };
        if let Some(size) = req.pty {
            size.validate().map_err(NodeError::InvalidArgument)?;
        }
        let pty = req.pty.is_some();
        let (stdin_tx, stdin_rx) = if req.stdin || pty {
            let (tx, rx) = mpsc::channel::<Bytes>(16);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let (sig_tx, sig_rx) = mpsc::unbounded_channel();
        let (stdout, stderr) = (self.new_log(retain)?, self.new_log(retain)?);
        let sandbox_id = sandbox.to_string();
        let proc = self.admit(sandbox, true, None, |number| ProcessHandle {
            id: new_id(),
            number,
            tag: req.tag,
            meta: req.meta,
            sandbox_id,
            cmd: req.cmd,
            started_at: now_rfc3339(),
            state: Mutex::new(State {
                stdout,
                stderr,
                result: None,
                error: None,
                ended_at: None,
            }),
            version: watch::channel(0).0,
            stdin: Mutex::new(stdin_tx),
            signals: Mutex::new(sig_tx),
            task: Mutex::new(None),
            pty,
        })?;
        let labels = Labels {
            tag: proc.tag.clone(),
            meta: proc.meta.clone(),
            number: Some(proc.number),
        };
        let control = ExecControl {
            stdin: stdin_rx,
            signals: sig_rx,
            handle: proc.id.clone(),
            labels: serde_json::to_value(labels).ok(),
        };
        let (ev_tx, ev_rx) = mpsc::channel::<ExecEvent>(64);
        let node = self.node.clone();
        let sid = sandbox.to_string();
        let mut exec: ExecFuture = Box::pin(async move {
            node.exec_controlled(&sid, &exec_req, Some(ev_tx), control)
                .await
        });
        // One poll here: what the node refuses before starting anything (validation, a
        // paused or deleting sandbox) is this call's error, not a process.
        if let std::task::Poll::Ready(r) = futures::poll!(exec.as_mut()) {
            if let Err(e) = r {
                self.unadmit(sandbox, &proc.id);
                return Err(e);
            }
            exec = Box::pin(futures::future::ready(r));
        }
        let task = tokio::spawn(collect(proc.clone(), self.node.clone(), exec, ev_rx, None));
        *proc.task.lock().unwrap() = Some(task.abort_handle());
        Ok(proc.info())
    }

    /// Registers the background execs sandbox `sandbox`'s guest agent still holds (issue
    /// 25: started by this node's previous process, or by the node a paused sandbox came
    /// from) under their old handles, with the `tag`, `meta` and `number` they were started
    /// with (kept by the agent as the exec's labels; a new number when that one is taken,
    /// none of them from an agent that predates labels), each taken up with
    /// [`Node::exec_reattach`]: running ones go on (output from where the agent's ring
    /// starts, signals, wait, kill), ended ones are listed with their result (also those
    /// whose end the previous node had read: the agent keeps them until their record is
    /// deleted, [`ProcessTable::remove`]; the call answers once their ends are read, at
    /// most 5 s in all). Handles already in the table are left alone.
    /// New processes are numbered past the highest number the agent ever held, so the
    /// numbers of processes deleted before the restart are not given again.
    /// An agent that keeps no table, or that cannot be asked (paused, gone), gives none
    /// (logged at debug). Returns how many were registered.
    pub async fn refind(&self, sandbox: &str) -> usize {
        let (mut execs, max_number) = match self.node.agent_execs(sandbox).await {
            Ok(e) => (e.execs, e.max_number),
            Err(e) => {
                tracing::debug!(sandbox, error = %e, "no background execs re-found");
                return 0;
            }
        };
        if let Some(max) = max_number.filter(|n| *n >= sandlot_api::FIRST_PROCESS_NUMBER) {
            let mut map = self.by_sandbox.lock().unwrap();
            let sb = map.entry(sandbox.to_string()).or_default();
            if sb.next_number <= max {
                sb.next_number = max
                    .checked_add(1)
                    .unwrap_or(sandlot_api::FIRST_PROCESS_NUMBER);
            }
        }
        let mut found = 0;
        // Listed oldest first, as they were before.
        execs.sort_by_key(|e| e.started_unix_ms);
        let ended: Vec<String> = execs
            .iter()
            .filter(|e| e.exit_code.is_some())
            .map(|e| e.handle.clone())
            .collect();
        for e in execs {
            let known = self
                .by_sandbox
                .lock()
                .unwrap()
                .get(sandbox)
                .is_some_and(|sb| sb.list.iter().any(|p| p.id == e.handle));
            if known {
                continue;
            }
            match self.take_up(sandbox, e) {
                Ok(()) => found += 1,
                // Taken up by a re-find running beside this one.
                Err(NodeError::Conflict(_)) => {}
                Err(err) => {
                    tracing::warn!(sandbox, error = %err, "background exec not re-found");
                }
            }
        }
        // An ended one is listed `running` until its re-attach reads its end (a list right
        // after a resume showed a process that had exited as running; CI under load): the
        // re-find answers once those ends are read, whichever re-find took them up (one at
        // start may still run when the resume thaws the agent it waited for).
        let ended: Vec<_> = ended
            .iter()
            .filter_map(|h| self.get(sandbox, h).ok())
            .collect();
        futures::future::join_all(ended.iter().map(|p| p.wait(REFOUND_END_WAIT))).await;
        if found > 0 {
            tracing::info!(sandbox, found, "background processes re-found");
        }
        found
    }

    /// Registers one [`crate::node::AgentExec`] and starts its task.
    fn take_up(&self, sandbox: &str, e: crate::node::AgentExec) -> NodeResult<()> {
        let (stdout, stderr) = (self.new_log(DEFAULT_RETAIN)?, self.new_log(DEFAULT_RETAIN)?);
        let (sig_tx, sig_rx) = mpsc::unbounded_channel();
        let started_at = chrono::DateTime::from_timestamp_millis(e.started_unix_ms as i64)
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        // Labels this node did not write (another version's) are left out, not an error.
        let labels: Labels = e
            .labels
            .and_then(|l| serde_json::from_value(l).ok())
            .unwrap_or_default();
        // A process that already runs in the sandbox: not held to `max_running`.
        let proc = self.admit(sandbox, false, labels.number, |number| ProcessHandle {
            id: e.handle.clone(),
            number,
            tag: labels.tag,
            meta: labels.meta,
            sandbox_id: sandbox.to_string(),
            // `Cmd::Shell(s)` runs as exactly this argv.
            cmd: match e.argv.as_slice() {
                [sh, c, s] if sh == "/bin/sh" && c == "-c" => Cmd::Shell(s.clone()),
                _ => Cmd::Argv(e.argv),
            },
            started_at,
            state: Mutex::new(State {
                stdout,
                stderr,
                result: None,
                error: None,
                ended_at: None,
            }),
            version: watch::channel(0).0,
            stdin: Mutex::new(None),
            signals: Mutex::new(sig_tx),
            task: Mutex::new(None),
            pty: false,
        })?;
        let (exec, ev_rx, off_rx) = reattach(&self.node, &proc, sig_rx);
        let task = tokio::spawn(collect(
            proc.clone(),
            self.node.clone(),
            exec,
            ev_rx,
            Some(off_rx),
        ));
        *proc.task.lock().unwrap() = Some(task.abort_handle());
        Ok(())
    }

    /// Adds `proc` under its sandbox, within the limits (`max_running` only when
    /// `new_process`), numbering it ([`Process::number`]): `want` (a re-found process's
    /// old number) when no listed process has it, else the sandbox's next one.
    ///
    /// # Errors
    /// `ResourceExhausted` over `max_running`; `Conflict` when a process of that id is
    /// listed already (two re-finds of one sandbox at once).
    fn admit(
        &self,
        sandbox: &str,
        new_process: bool,
        want: Option<u32>,
        make: impl FnOnce(u32) -> ProcessHandle,
    ) -> NodeResult<Arc<ProcessHandle>> {
        let mut map = self.by_sandbox.lock().unwrap();
        let sb = map.entry(sandbox.to_string()).or_default();
        let list = &mut sb.list;
        let running = list.iter().filter(|p| !p.ended()).count();
        if new_process && running >= self.limits.max_running {
            return Err(NodeError::ResourceExhausted(format!(
                "sandbox {} already runs {running} background processes (limit {}); wait for or delete one",
                sandbox, self.limits.max_running
            )));
        }
        while list.len() >= self.limits.max_kept {
            match list.iter().position(|p| p.ended()) {
                Some(i) => {
                    // Its agent (if any) forgets it too, so a later re-find does not list it.
                    let gone = list.remove(i);
                    let (node, sandbox) = (self.node.clone(), sandbox.to_string());
                    tokio::spawn(async move { forget_in_agent(&*node, &sandbox, &gone.id).await });
                }
                None => break,
            }
        }
        if sb.next_number == 0 {
            sb.next_number = sandlot_api::FIRST_PROCESS_NUMBER;
        }
        let old = want.filter(|n| {
            *n >= sandlot_api::FIRST_PROCESS_NUMBER && !sb.list.iter().any(|q| q.number == *n)
        });
        let p = Arc::new(make(old.unwrap_or(sb.next_number)));
        if sb.list.iter().any(|q| q.id == p.id) {
            return Err(NodeError::Conflict(format!(
                "process {} is listed in sandbox {sandbox} already",
                p.id
            )));
        }
        // Numbers after the highest given (an old one kept is not given again).
        if p.number >= sb.next_number {
            // u32 numbers last 4 billion spawns; after that they wrap to the first again.
            sb.next_number = p
                .number
                .checked_add(1)
                .unwrap_or(sandlot_api::FIRST_PROCESS_NUMBER);
        }
        if new_process {
            sb.list.push(p.clone());
        } else {
            // A re-found one goes where its number puts it: two re-finds running at once
            // (at start and after a resume) may take a sandbox's processes up out of order.
            let at = sb.list.iter().position(|q| q.number > p.number);
            sb.list.insert(at.unwrap_or(sb.list.len()), p.clone());
        }
        Ok(p)
    }

    /// Forgets the record `pid`. The sandbox's entry (its next number) stays, so numbers
    /// are not reused, except after a failed first spawn (an unknown sandbox leaves
    /// nothing behind).
    fn remove_record(&self, sandbox: &str, pid: &str) -> Option<Arc<ProcessHandle>> {
        let mut map = self.by_sandbox.lock().unwrap();
        let sb = map.get_mut(sandbox)?;
        let i = sb.list.iter().position(|p| p.id == pid)?;
        let p = sb.list.remove(i);
        Some(p)
    }

    /// Forgets a process whose spawn failed; drops the sandbox's entry when it was its
    /// first process.
    fn unadmit(&self, sandbox: &str, pid: &str) {
        let Some(p) = self.remove_record(sandbox, pid) else {
            return;
        };
        let mut map = self.by_sandbox.lock().unwrap();
        if let Some(sb) = map.get(sandbox) {
            if sb.list.is_empty() && p.number == sandlot_api::FIRST_PROCESS_NUMBER {
                map.remove(sandbox);
            }
        }
    }

    /// The processes of a sandbox, oldest first.
    pub fn list(&self, sandbox: &str) -> Vec<Process> {
        let map = self.by_sandbox.lock().unwrap();
        map.get(sandbox)
            .map(|sb| sb.list.iter().map(|p| p.info()).collect())
            .unwrap_or_default()
    }

    /// One process.
    ///
    /// # Errors
    /// `NotFound` for an unknown handle (or one of another sandbox).
    pub fn get(&self, sandbox: &str, pid: &str) -> NodeResult<Arc<ProcessHandle>> {
        let map = self.by_sandbox.lock().unwrap();
        map.get(sandbox)
            .and_then(|sb| sb.list.iter().find(|p| p.id == pid))
            .cloned()
            .ok_or_else(|| {
                NodeError::NotFound(format!(
                    "no process {pid} in sandbox {sandbox} (after a restart of its node a background process is found again only where it ran through a guest agent: container, microvm and vm sandboxes, and function sandboxes after their first exec)"
                ))
            })
    }

    /// Kills the process's whole tree (SIGKILL), waits for it to end (a few seconds at
    /// most), and forgets it, here and in its guest agent ([`Node::agent_forget`]: a
    /// re-find after a restart does not list it again).
    ///
    /// # Errors
    /// `NotFound` for an unknown handle.
    pub async fn remove(&self, sandbox: &str, pid: &str) -> NodeResult<()> {
        let p = self.get(sandbox, pid)?;
        self.remove_record(sandbox, pid);
        kill_and_drop(p).await;
        forget_in_agent(&*self.node, sandbox, pid).await;
        Ok(())
    }

    /// Forgets every process of a sandbox (deleted or expired), killing those still running.
    pub fn forget_sandbox(&self, sandbox: &str) {
        let sb = self.by_sandbox.lock().unwrap().remove(sandbox);
        for p in sb.map(|sb| sb.list).unwrap_or_default() {
            if !p.ended() {
                tokio::spawn(kill_and_drop(p));
            }
        }
    }

    /// Forgets the processes of every sandbox not in `keep` (killing those still running).
    pub fn retain_sandboxes(&self, keep: &[String]) {
        let gone: Vec<String> = {
            let map = self.by_sandbox.lock().unwrap();
            map.keys().filter(|k| !keep.contains(k)).cloned().collect()
        };
        for id in gone {
            self.forget_sandbox(&id);
        }
    }

    /// Running processes on this node, all sandboxes (for metrics).
    pub fn running(&self) -> usize {
        let map = self.by_sandbox.lock().unwrap();
        map.values()
            .flat_map(|sb| &sb.list)
            .filter(|p| !p.ended())
            .count()
    }
}

/// [`Node::agent_forget`] of a deleted or evicted record; a failure is logged (the
/// process would be listed again after a restart of this node).
async fn forget_in_agent(node: &dyn Node, sandbox: &str, pid: &str) {
    match node.agent_forget(sandbox, pid).await {
        // The sandbox went meanwhile: nothing left to forget.
        Ok(()) | Err(NodeError::NotFound(_)) => {}
        Err(e) => {
            tracing::warn!(sandbox, process = pid, error = %e,
                "the guest agent did not forget a deleted background process");
        }
    }
}

async fn kill_and_drop(p: Arc<ProcessHandle>) {
    let _ = p.signal(libc::SIGKILL);
    p.wait(KILL_WAIT).await;
    // Dropping the exec kills its tree on every backend (exec cgroup / agent stream reset).
    if let Some(t) = p.task.lock().unwrap().take() {
        t.abort();
    }
}

/// How many times in a row [`collect`] tries to take an exec up again after its agent
/// connection dropped (the agent unreachable for the first try), and how long it waits
/// before each try.
const REATTACH_TRIES: u32 = 2;
const REATTACH_WAIT: Duration = Duration::from_millis(500);
/// Most re-attaches in one process's life (each one after a drop that a re-attach
/// mended): a connection that keeps dropping ends the process's record, not a loop.
const MAX_REATTACHES: u32 = 16;

/// What [`ProcessTable`] keeps with a background exec in its guest agent
/// ([`ExecControl::labels`]) so that a node that re-finds it lists it as it was started.
/// Unknown fields are ignored and missing ones are `None` (other node versions).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Labels {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    meta: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    number: Option<u32>,
}

/// The exec of `proc` taken up again through its guest agent ([`Node::exec_reattach`]),
/// its signals read from `signals`: the exec, its output events and the offsets its
/// output starts at (sent before any output).
fn reattach(
    node: &Arc<dyn Node>,
    proc: &ProcessHandle,
    signals: mpsc::UnboundedReceiver<i32>,
) -> (
    ExecFuture,
    mpsc::Receiver<ExecEvent>,
    tokio::sync::oneshot::Receiver<(u64, u64)>,
) {
    let (off_tx, off_rx) = tokio::sync::oneshot::channel();
    let (ev_tx, ev_rx) = mpsc::channel::<ExecEvent>(64);
    let r = crate::node::ExecReattach {
        handle: proc.id.clone(),
        signals,
        offsets: off_tx,
    };
    let (node, sid) = (node.clone(), proc.sandbox_id.clone());
    let exec: ExecFuture = Box::pin(async move { node.exec_reattach(&sid, Some(ev_tx), r).await });
    (exec, ev_rx, off_rx)
}

/// Lines `log` up with a stream taken up again whose output starts at offset `at` of the
/// exec's whole output: an empty log starts there ([`OutputLog::begin_at`]); bytes the
/// node never got leave a hole ([`OutputLog::skip_to`]). Returns how many of the stream's
/// next bytes the log already has (to drop).
fn align(log: &mut OutputLog, at: u64) -> u64 {
    if log.end() == 0 {
        log.begin_at(at);
        0
    } else if at > log.end() {
        log.skip_to(at);
        0
    } else {
        log.end() - at
    }
}

/// Moves one output event into the process's logs, dropping first the bytes `discard`
/// says the log has already (per stream: stdout, stderr).
fn push_event(proc: &ProcessHandle, discard: &mut [u64; 2], ev: ExecEvent) {
    let (stream, bytes) = match ev {
        ExecEvent::Stdout { data, data_b64 } => (StreamName::Stdout, raw_chunk(&data, &data_b64)),
        ExecEvent::Stderr { data, data_b64 } => (StreamName::Stderr, raw_chunk(&data, &data_b64)),
        _ => return,
    };
    let d = &mut discard[usize::from(stream == StreamName::Stderr)];
    let skip = (*d).min(bytes.len() as u64);
    *d -= skip;
    let bytes = &bytes[skip as usize..];
    if bytes.is_empty() {
        return;
    }
    proc.state.lock().unwrap().log(stream).push(bytes);
    proc.bump();
}

/// The process's task: runs the exec, moves its output into the logs, records the end.
///
/// `offsets` (a process taken up after a restart, [`ProcessTable::refind`]): where its
/// output starts, which comes before any output.
///
/// When the exec ends with an `Internal` error (its stream from the guest agent ended
/// without an exit: the connection dropped, on a live node too), the agent may still run
/// it: the task asks for it again ([`Node::exec_reattach`], up to [`REATTACH_TRIES`] times,
/// [`REATTACH_WAIT`] apart) and goes on from the offsets it already has (bytes the agent
/// no longer holds read as skipped; stdin is closed from then on, as the agent closed it
/// with the old connection). Only when the agent no longer has the exec (or cannot be
/// reached) does the original error end the process.
async fn collect(
    proc: Arc<ProcessHandle>,
    node: Arc<dyn Node>,
    exec: ExecFuture,
    events: mpsc::Receiver<ExecEvent>,
    offsets: Option<tokio::sync::oneshot::Receiver<(u64, u64)>>,
) {
    let (mut exec, mut events, mut offsets) = (exec, events, offsets);
    // Bytes of each stream the logs already have, to drop from the next output.
    let mut discard = [0u64; 2];
    // The error that ended the last connection, and the tries made to take the exec up
    // again since.
    let mut lost: Option<(NodeError, u32)> = None;
    let mut reattaches = 0;
    let result = loop {
        let mut attached = true;
        let mut early = None;
        if let Some(mut o) = offsets.take() {
            attached = false;
            let got = tokio::select! {
                biased;
                o = &mut o => o.ok(),
                r = &mut exec => {
                    early = Some(r);
                    // Sent in the poll that also ended it (an exec that had ended already).
                    o.try_recv().ok()
                }
            };
            if let Some((out, err)) = got {
                attached = true;
                let mut st = proc.state.lock().unwrap();
                discard = [align(&mut st.stdout, out), align(&mut st.stderr, err)];
            }
        }
        let r = match early {
            Some(r) => r,
            None => loop {
                tokio::select! {
                    biased;
                    Some(ev) = events.recv() => push_event(&proc, &mut discard, ev),
                    r = &mut exec => break r,
                }
            },
        };
        while let Ok(ev) = events.try_recv() {
            push_event(&proc, &mut discard, ev);
        }
        let (orig, tries) = match (r, lost.take()) {
            // A re-attach that did not reach the exec: try again while the agent could not
            // be reached; otherwise the connection's end was the exec's.
            (Err(e), Some((orig, tries))) if !attached => {
                if e.code() == sandlot_api::ErrorCode::Internal && tries < REATTACH_TRIES {
                    (orig, tries)
                } else {
                    tracing::debug!(process = %proc.id, error = %e, "background exec not taken up again");
                    break Err(orig);
                }
            }
            (Err(e), _)
                if e.code() == sandlot_api::ErrorCode::Internal && reattaches < MAX_REATTACHES =>
            {
                reattaches += 1;
                tracing::info!(sandbox = %proc.sandbox_id, process = %proc.id, error = %e,
                    "background exec's stream ended without an exit; asking its guest agent");
                (e, 0)
            }
            (r, _) => break r,
        };
        // Its stdin went with the old connection (the agent closed it).
        if proc.stdin.lock().unwrap().take().is_some() {
            proc.bump();
        }
        // Signals sent from now on wait for the new stream.
        let (sig_tx, sig_rx) = mpsc::unbounded_channel();
        *proc.signals.lock().unwrap() = sig_tx;
        tokio::time::sleep(REATTACH_WAIT).await;
        let (next, ev_rx, off_rx) = reattach(&node, &proc, sig_rx);
        exec = next;
        events = ev_rx;
        offsets = Some(off_rx);
        lost = Some((orig, tries + 1));
    };
    {
        let mut st = proc.state.lock().unwrap();
        match result {
            Ok(mut r) => {
                // The node kept no output (max_output_bytes 0): the totals are the logs'.
                r.stdout.clear();
                r.stderr.clear();
                r.stdout_b64 = None;
                r.stderr_b64 = None;
                r.stdout_bytes = st.stdout.end();
                r.stderr_bytes = st.stderr.end();
                r.truncated = st.stdout.lost_any() || st.stderr.lost_any();
                st.result = Some(r);
            }
            Err(e) => st.error = Some(ApiError::new(e.code(), e.to_string())),
        }
        st.ended_at = Some(now_rfc3339());
    }
    proc.stdin.lock().unwrap().take();
    proc.bump();
}

/// A node that owns a [`ProcessTable`]: every [`Node`] call goes to `inner`, and the
/// `process_*` calls to the table, which runs the processes on `inner` (so they live on the
/// node, and every server reaching it, locally or through `sandlot-node-remote`, sees the
/// same processes). Deleting a sandbox forgets its processes (killing those still running);
/// so does a [`Node::readopt`] that does not keep it.
///
/// `sandlot up` and `sandlot node` serve a `LocalNode` through it; unit tests wrap their
/// fake node in it.
pub struct WithProcesses {
    inner: Arc<dyn Node>,
    table: Arc<ProcessTable>,
}

impl WithProcesses {
    /// `inner` with a process table of default [`ProcessLimits`] keeping retained output in
    /// unlinked files under `spill_dir` (`DATA/process-output` on a node).
    ///
    /// # Errors
    /// `Internal` when `spill_dir` cannot be created.
    pub fn new(inner: Arc<dyn Node>, spill_dir: std::path::PathBuf) -> NodeResult<Arc<Self>> {
        Self::with_limits(inner, ProcessLimits::default(), spill_dir)
    }

    /// As [`WithProcesses::new`] with other limits.
    ///
    /// # Errors
    /// `Internal` when `spill_dir` cannot be created.
    pub fn with_limits(
        inner: Arc<dyn Node>,
        limits: ProcessLimits,
        spill_dir: std::path::PathBuf,
    ) -> NodeResult<Arc<Self>> {
        let table = ProcessTable::new(inner.clone(), limits, spill_dir.clone())
            .map_err(|e| NodeError::io(format!("create {}", spill_dir.display()), e))?;
        Ok(Arc::new(WithProcesses { inner, table }))
    }

    /// The process table.
    pub fn table(&self) -> &Arc<ProcessTable> {
        &self.table
    }

    /// Re-finds the background processes of sandboxes `ids` (16 agents at a time; each
    /// call is bounded) before the call that made them reachable answers: a re-adoption at
    /// start, a resume (a sandbox paused while the node restarted, or one from another
    /// node, whose agent kept its execs). A spawn right after then numbers past them (one
    /// made while the re-find still ran took a number in use, found by a breaker) and a
    /// list shows them all.
    async fn refind_each(&self, ids: impl IntoIterator<Item = &String>) {
        let table = &self.table;
        futures::StreamExt::for_each_concurrent(futures::stream::iter(ids), 16, |id| async move {
            table.refind(id).await;
        })
        .await;
    }
}

#[async_trait::async_trait]
impl Node for WithProcesses {
    fn info(&self) -> sandlot_node_api::NodeInfo {
        self.inner.info()
    }
    async fn create(&self, spec: &sandlot_node_api::SandboxSpec) -> NodeResult<()> {
        self.inner.create(spec).await
    }
    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<sandlot_node_api::ExecSink>,
    ) -> NodeResult<ExecResult> {
        self.inner.exec(id, req, sink).await
    }
    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<sandlot_node_api::ExecSink>,
        control: ExecControl,
    ) -> NodeResult<ExecResult> {
        self.inner.exec_controlled(id, req, sink, control).await
    }
    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        self.inner.read_file(id, path, max_bytes).await
    }
    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        self.inner.file_size(id, path).await
    }
    async fn write_file(&self, id: &str, path: &str, data: Bytes) -> NodeResult<()> {
        self.inner.write_file(id, path, data).await
    }
    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        self.inner
            .write_file_stream(id, path, body, max_bytes)
            .await
    }
    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        self.inner.read_file_stream(id, path, max_bytes).await
    }
    async fn write_files_volatile(&self, id: &str, files: Vec<(String, Bytes)>) -> NodeResult<()> {
        self.inner.write_files_volatile(id, files).await
    }
    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<sandlot_api::FileEntry>> {
        self.inner.list_dir(id, path).await
    }
    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        self.inner.remove_file(id, path).await
    }
    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<sandlot_api::FileEntry> {
        self.inner.stat_file(id, path).await
    }
    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        self.inner.make_dir(id, path, parents).await
    }
    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.inner.pause(id).await
    }
    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.inner.resume(id).await?;
        self.table.refind(id).await;
        Ok(())
    }
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.inner.pause_many(ids).await
    }
    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        let res = self.inner.resume_many(ids).await;
        let resumed: Vec<&String> = ids
            .iter()
            .zip(&res)
            .filter_map(|(id, r)| r.is_ok().then_some(id))
            .collect();
        self.refind_each(resumed).await;
        res
    }
    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        self.inner.adopt_snapshot(id).await?;
        // The processes the VM ran on its old node (its agent tables them).
        self.table.refind(id).await;
        Ok(())
    }
    async fn delete(&self, id: &str) -> NodeResult<()> {
        let r = self.inner.delete(id).await;
        if r.is_ok() {
            self.table.forget_sandbox(id);
        }
        r
    }
    async fn list(&self) -> NodeResult<Vec<sandlot_node_api::SandboxStatus>> {
        self.inner.list().await
    }
    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let adopted = self.inner.readopt(keep).await?;
        self.table.retain_sandboxes(&adopted);
        // Their background processes, before the server serves them.
        self.refind_each(&adopted).await;
        Ok(adopted)
    }
    async fn checkpoint(
        &self,
        id: &str,
        checkpoint_id: &str,
    ) -> NodeResult<sandlot_node_api::CheckpointMeta> {
        self.inner.checkpoint(id, checkpoint_id).await
    }
    async fn create_from_checkpoint(
        &self,
        spec: &sandlot_node_api::SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        self.inner.create_from_checkpoint(spec, checkpoint_id).await
    }
    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        self.inner.delete_checkpoint(checkpoint_id).await
    }
    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        self.inner.list_checkpoints().await
    }
    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        self.inner.connect_port(id, port).await
    }
    async fn accel(&self) -> Option<String> {
        self.inner.accel().await
    }
    async fn process_spawn(&self, id: &str, req: SpawnRequest) -> NodeResult<Process> {
        self.table.spawn(id, req).await
    }
    async fn process_list(&self, id: &str) -> NodeResult<Vec<Process>> {
        Ok(self.table.list(id))
    }
    async fn process_get(&self, id: &str, pid: &str) -> NodeResult<Process> {
        Ok(self.table.get(id, pid)?.info())
    }
    async fn process_output(
        &self,
        id: &str,
        pid: &str,
        cursor: sandlot_node_api::OutputCursor,
    ) -> NodeResult<sandlot_node_api::ProcessEvents> {
        let h = self.table.get(id, pid)?;
        Ok(Box::pin(h.output(
            cursor.stdout_offset,
            cursor.stderr_offset,
            cursor.follow,
        )?))
    }
    async fn process_wait(&self, id: &str, pid: &str, timeout: Duration) -> NodeResult<Process> {
        let h = self.table.get(id, pid)?;
        Ok(h.wait(timeout).await)
    }
    async fn process_signal(&self, id: &str, pid: &str, signal: i32) -> NodeResult<()> {
        self.table.get(id, pid)?.signal(signal)
    }
    async fn process_stdin(&self, id: &str, pid: &str, data: Bytes, eof: bool) -> NodeResult<()> {
        self.table.get(id, pid)?.write_stdin(data, eof).await
    }
    async fn process_resize(
        &self,
        id: &str,
        pid: &str,
        size: sandlot_api::PtySize,
    ) -> NodeResult<()> {
        self.table.get(id, pid)?.resize(size).await
    }
    async fn process_remove(&self, id: &str, pid: &str) -> NodeResult<()> {
        self.table.remove(id, pid).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small `function` sandbox `id` for the fake node.
    fn function_spec(id: &str) -> sandlot_node_api::SandboxSpec {
        sandlot_node_api::SandboxSpec {
            id: id.into(),
            backend: sandlot_api::Backend::Function,
            image: "python".into(),
            cpu: 1.0,
            memory_mib: 256,
            disk_mib: 256,
            pids_max: 64,
            env: Default::default(),
            network: sandlot_api::NetworkPolicy::None,
            runtime: None,
        }
    }

    fn log_of(cap: usize, chunks: &[&[u8]]) -> OutputLog {
        let mut l = OutputLog::new(cap, &std::env::temp_dir()).unwrap();
        for c in chunks {
            l.push(c);
        }
        l
    }

    #[test]
    fn output_log_keeps_the_last_bytes_with_absolute_offsets() {
        let l = log_of(10, &[b"abc", b"defg"]);
        assert_eq!((l.start(), l.end()), (0, 7));
        assert_eq!(l.read(0, 100), (0, b"abcdefg".to_vec()));
        assert_eq!(l.read(2, 3), (2, b"cde".to_vec()));
        assert_eq!(l.read(7, 100), (7, vec![]));
        // Byte-at-a-time and one big chunk agree.
        let input: Vec<u8> = (0u8..100).collect();
        let whole = log_of(10, &[&input]);
        let mut bytewise = OutputLog::new(10, &std::env::temp_dir()).unwrap();
        for b in &input {
            bytewise.push(std::slice::from_ref(b));
        }
        let chunked = log_of(10, &input.chunks(7).collect::<Vec<_>>());
        for l in [whole, bytewise, chunked] {
            assert_eq!((l.start(), l.end()), (90, 100));
            // An offset that fell out of the log reads from the oldest kept byte.
            assert_eq!(l.read(5, 100), (90, (90u8..100).collect::<Vec<_>>()));
            assert_eq!(l.read(95, 2), (95, vec![95, 96]));
        }
    }

    #[test]
    fn output_log_begun_at_an_offset_reads_from_there() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = OutputLog::new(8, dir.path()).unwrap();
        l.begin_at(100);
        assert_eq!((l.start(), l.end()), (100, 100));
        l.push(b"abc");
        assert_eq!((l.start(), l.end()), (100, 103));
        // Older offsets are raised to the start (read as skipped by a cursor).
        assert_eq!(l.read(0, 10), (100, b"abc".to_vec()));
        // Only an empty log moves.
        l.begin_at(500);
        assert_eq!(l.end(), 103);
    }

    #[test]
    fn output_log_edges() {
        // Exactly the cap, then one more byte.
        let mut l = log_of(4, &[b"abcd"]);
        assert_eq!((l.start(), l.read(0, 9).1), (0, b"abcd".to_vec()));
        l.push(b"e");
        assert_eq!((l.start(), l.end()), (1, 5));
        assert_eq!(l.read(0, 9), (1, b"bcde".to_vec()));
        // Cap 0 keeps nothing but counts.
        let l = log_of(0, &[b"abc", b""]);
        assert_eq!((l.start(), l.end()), (3, 3));
        assert_eq!(l.read(0, 9), (3, vec![]));
        // Empty pushes change nothing.
        let l = log_of(3, &[b"", b"xy", b""]);
        assert_eq!((l.start(), l.end()), (0, 2));
    }

    #[test]
    fn output_log_spills_to_an_unlinked_ring_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = OutputLog::new(1000, dir.path()).unwrap();
        // Nothing visible in the directory: the file is unlinked from the start.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let input: Vec<u8> = (0..10_500u32).map(|i| (i % 251) as u8).collect();
        for c in input.chunks(333) {
            l.push(c);
        }
        assert_eq!((l.start(), l.end()), (9500, 10_500));
        // The file never grows past the cap.
        let len = l.file.as_ref().unwrap().metadata().unwrap().len();
        assert!(len <= 1000, "ring file is {len} bytes");
        // Reads across the wrap point give the stream's bytes at their offsets.
        assert_eq!(l.read(0, 2000), (9500, input[9500..].to_vec()));
        assert_eq!(l.read(9600, 5), (9600, input[9600..9605].to_vec()));
        // Byte 10_000 is at file position 0: this read wraps.
        assert_eq!(l.read(9990, 20), (9990, input[9990..10_010].to_vec()));
    }

    /// Default limits without the free-space reserve: output is kept whatever the test
    /// host's disk has free.
    fn no_reserve() -> ProcessLimits {
        ProcessLimits {
            spill_reserve_bytes: 0,
            ..Default::default()
        }
    }

    #[test]
    fn output_log_below_its_reserve_stops_growing_but_overwrites_a_full_ring() {
        let dir = tempfile::tempdir().unwrap();
        // No file system has u64::MAX bytes free: every write that may grow the file drops.
        let mut l = OutputLog::new(8, dir.path())
            .unwrap()
            .with_reserve(u64::MAX);
        l.push(b"abcd");
        assert_eq!((l.start(), l.end()), (4, 4));
        assert_eq!(l.read(0, 100), (4, Vec::new()));
        assert_eq!(l.file.as_ref().unwrap().metadata().unwrap().len(), 0);
        // The file system's allocation unit (4 KiB on ext4 and x86 tmpfs; larger on some),
        // so that each write below fills whole units.
        let probe = dir.path().join("probe");
        std::fs::write(&probe, b"x").unwrap();
        let unit = {
            use std::os::unix::fs::MetadataExt;
            (std::fs::metadata(&probe).unwrap().blocks() * 512).max(4096) as usize
        };
        // A ring whose file has all its space takes new bytes in place below the reserve.
        let mut l = OutputLog::new(unit, dir.path()).unwrap();
        l.push(&vec![b'a'; unit]);
        let mut l = l.with_reserve(u64::MAX);
        l.push(b"89");
        let end = l.end();
        assert_eq!(l.read(end - 2, 100), (end - 2, b"89".to_vec()));
        // A ring with a hole (a skipped stretch never written) has written as many bytes
        // as its size but not all its space: a write there would grow the file, so it drops.
        let mut l = OutputLog::new(2 * unit, dir.path()).unwrap();
        l.push(&vec![b'a'; unit]);
        l.skip_to(2 * unit as u64);
        l.push(&vec![b'b'; unit]);
        let mut l = l.with_reserve(u64::MAX);
        let end = l.end();
        l.push(&vec![b'c'; unit]);
        assert_eq!((l.start(), l.end()), (end + unit as u64, end + unit as u64));
    }

    #[test]
    fn output_log_holes_read_as_skipped_and_keep_the_bytes_around_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = OutputLog::new(10, dir.path()).unwrap();
        l.push(b"ab");
        l.skip_to(5);
        l.skip_to(3); // not past the end: nothing
        l.push(b"fg");
        assert_eq!((l.start(), l.end()), (0, 7));
        assert!(l.lost_any());
        // Reads stop before the hole and go on after it.
        assert_eq!(l.read(0, 100), (0, b"ab".to_vec()));
        assert_eq!(l.skip_from(2), Some(5));
        assert_eq!(l.skip_from(3), Some(5));
        assert_eq!(l.skip_from(1), None);
        assert_eq!(l.read(2, 100), (5, b"fg".to_vec()));
        // Touching holes are crossed at once.
        l.skip_to(9);
        l.skip_to(12);
        assert_eq!(l.skip_from(7), Some(12));
        // Past the cap, the oldest bytes go as before.
        l.push(b"0123456789");
        assert_eq!((l.start(), l.end()), (12, 22));
        assert_eq!(l.skip_from(0), Some(12));
        assert_eq!(l.read(0, 100), (12, b"0123456789".to_vec()));
        // Holes beyond the cap fold into the floor.
        let mut l = OutputLog::new(1 << 20, dir.path()).unwrap();
        for i in 0..(MAX_HOLES as u64 + 4) {
            l.push(b"x");
            l.skip_to(3 * (i + 1));
        }
        assert_eq!(l.holes.len(), MAX_HOLES);
        assert_eq!(l.start(), 12);
        assert_eq!(l.read(0, 100), (12, b"x".to_vec()));
    }

    /// A fake node (for [`collect`]'s decisions, not the agent's): its exec writes "ab" to
    /// stdout and ends as a dropped agent stream does (`Internal`); its re-attaches answer
    /// from `attaches`, in order.
    struct DroppingNode {
        inner: sandlot_node_fake::FakeNode,
        attaches: Mutex<std::collections::VecDeque<FakeAttach>>,
        attach_calls: std::sync::atomic::AtomicUsize,
    }

    enum FakeAttach {
        Fail(NodeError),
        /// Offsets (stdout, stderr), then this stdout, then this exit code.
        Resume((u64, u64), &'static [u8], i32),
    }

    const DROPPED: &str = "the guest agent ended the stream without an exit";

    #[async_trait::async_trait]
    impl Node for DroppingNode {
        fn info(&self) -> sandlot_node_api::NodeInfo {
            self.inner.info()
        }
        async fn create(&self, spec: &sandlot_node_api::SandboxSpec) -> NodeResult<()> {
            self.inner.create(spec).await
        }
        async fn exec(
            &self,
            id: &str,
            req: &ExecRequest,
            sink: Option<sandlot_node_api::ExecSink>,
        ) -> NodeResult<ExecResult> {
            self.inner.exec(id, req, sink).await
        }
        async fn exec_controlled(
            &self,
            _id: &str,
            _req: &ExecRequest,
            sink: Option<sandlot_node_api::ExecSink>,
            _control: ExecControl,
        ) -> NodeResult<ExecResult> {
            // Started: past the spawn's one poll (which takes an error there for a refusal).
            tokio::time::sleep(Duration::from_millis(20)).await;
            let _ = sink.unwrap().send(ExecEvent::stdout(b"ab")).await;
            Err(NodeError::io(
                DROPPED,
                std::io::Error::other("agent stream ended"),
            ))
        }
        async fn exec_reattach(
            &self,
            _id: &str,
            sink: Option<sandlot_node_api::ExecSink>,
            r: crate::node::ExecReattach,
        ) -> NodeResult<ExecResult> {
            self.attach_calls
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let next = self.attaches.lock().unwrap().pop_front();
            match next.expect("no more re-attaches scripted") {
                FakeAttach::Fail(e) => Err(e),
                FakeAttach::Resume(offsets, out, code) => {
                    let _ = r.offsets.send(offsets);
                    let _ = sink.unwrap().send(ExecEvent::stdout(out)).await;
                    Ok(ExecResult {
                        exit_code: code,
                        ..Default::default()
                    })
                }
            }
        }
        async fn read_file(&self, id: &str, path: &str, max: u64) -> NodeResult<Vec<u8>> {
            self.inner.read_file(id, path, max).await
        }
        async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
            self.inner.file_size(id, path).await
        }
        async fn write_file(&self, id: &str, path: &str, data: Bytes) -> NodeResult<()> {
            self.inner.write_file(id, path, data).await
        }
        async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<sandlot_api::FileEntry>> {
            self.inner.list_dir(id, path).await
        }
        async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
            self.inner.remove_file(id, path).await
        }
        async fn stat_file(&self, id: &str, path: &str) -> NodeResult<sandlot_api::FileEntry> {
            self.inner.stat_file(id, path).await
        }
        async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
            self.inner.make_dir(id, path, parents).await
        }
        async fn pause(&self, id: &str) -> NodeResult<()> {
            self.inner.pause(id).await
        }
        async fn resume(&self, id: &str) -> NodeResult<()> {
            self.inner.resume(id).await
        }
        async fn delete(&self, id: &str) -> NodeResult<()> {
            self.inner.delete(id).await
        }
        async fn list(&self) -> NodeResult<Vec<sandlot_node_api::SandboxStatus>> {
            self.inner.list().await
        }
        async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
            self.inner.readopt(keep).await
        }
    }

    /// Spawns one process on a [`DroppingNode`] scripted with `attaches`; its record once
    /// ended, its stdout events and how many re-attaches were asked.
    async fn run_dropping(attaches: Vec<FakeAttach>) -> (Process, Vec<ProcessEvent>, usize) {
        let dir = tempfile::tempdir().unwrap();
        let node = Arc::new(DroppingNode {
            inner: Default::default(),
            attaches: Mutex::new(attaches.into()),
            attach_calls: Default::default(),
        });
        let table = ProcessTable::new(node.clone(), no_reserve(), dir.path().into()).unwrap();
        let sb = "sb-0123456789abcdef0123";
        let req: SpawnRequest = serde_json::from_str("{\"cmd\": \"x\", \"stdin\": true}").unwrap();
        let p = table.spawn(sb, req).await.unwrap();
        let h = table.get(sb, &p.id).unwrap();
        let done = h.wait(Duration::from_secs(10)).await;
        assert_eq!(done.state, ProcessState::Exited, "{done:?}");
        let events = futures::StreamExt::collect(h.output(0, 0, false).unwrap()).await;
        let calls = node.attach_calls.load(std::sync::atomic::Ordering::SeqCst);
        (done, events, calls)
    }

    fn stdout_of(events: &[ProcessEvent]) -> Vec<u8> {
        events
            .iter()
            .filter_map(|e| match e {
                ProcessEvent::Stdout { data, data_b64, .. } => Some(raw_chunk(data, data_b64)),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[tokio::test]
    async fn a_dropped_agent_stream_is_taken_up_again_from_the_offsets_read() {
        // The agent unreachable once, then it still runs the exec and its ring starts two
        // bytes past what the node read: those read as skipped, the rest goes on.
        let (p, events, calls) = run_dropping(vec![
            FakeAttach::Fail(NodeError::io("connect", std::io::Error::other("refused"))),
            FakeAttach::Resume((4, 0), b"ef", 0),
        ])
        .await;
        assert_eq!(calls, 2);
        assert!(p.error.is_none(), "{p:?}");
        let r = p.result.unwrap();
        assert_eq!((r.exit_code, r.stdout_bytes, r.truncated), (0, 6, true));
        assert_eq!(stdout_of(&events), b"abef");
        assert!(
            events.iter().any(|e| matches!(
                e,
                ProcessEvent::Skipped {
                    stream: StreamName::Stdout,
                    from: 2,
                    to: 4
                }
            )),
            "{events:?}"
        );
        // Stdin went with the old connection.
        assert!(!p.stdin_open);

        // A ring that starts before what the node read: the bytes it has are not doubled.
        let (p, events, calls) = run_dropping(vec![FakeAttach::Resume((1, 0), b"bcd", 3)]).await;
        assert_eq!(calls, 1);
        assert_eq!(p.result.unwrap().exit_code, 3);
        assert_eq!(stdout_of(&events), b"abcd");
    }

    #[tokio::test]
    async fn a_dropped_agent_stream_of_an_exec_the_agent_no_longer_has_ends_the_process() {
        let (p, events, calls) = run_dropping(vec![FakeAttach::Fail(NodeError::NotFound(
            "no exec".into(),
        ))])
        .await;
        assert_eq!(calls, 1);
        let e = p.error.unwrap();
        assert_eq!(e.code, sandlot_api::ErrorCode::Internal);
        assert!(e.message.contains(DROPPED), "{e:?}");
        assert_eq!(stdout_of(&events), b"ab");
        // An agent that stays unreachable: two tries, then the original end.
        let unreachable = || FakeAttach::Fail(NodeError::io("connect", std::io::Error::other("x")));
        let (p, _, calls) = run_dropping(vec![unreachable(), unreachable()]).await;
        assert_eq!(calls, REATTACH_TRIES as usize);
        assert!(p.error.unwrap().message.contains(DROPPED));
    }

    #[tokio::test]
    async fn a_re_found_exec_is_listed_once_and_is_not_held_to_max_running() {
        use sandlot_node_fake::FakeNode;
        let dir = tempfile::tempdir().unwrap();
        let limits = ProcessLimits {
            max_running: 1,
            ..no_reserve()
        };
        let table =
            ProcessTable::new(Arc::new(FakeNode::default()), limits, dir.path().into()).unwrap();
        let sb = "sb-0123456789abcdef0123";
        let exec = |handle: &str| crate::node::AgentExec {
            handle: handle.into(),
            argv: vec!["/bin/sh".into(), "-c".into(), "sleep 9".into()],
            started_unix_ms: 1,
            exit_code: None,
            labels: None,
        };
        // Two re-finds of one sandbox at once both try the same handle: one record.
        table.take_up(sb, exec("pr-a")).unwrap();
        assert!(matches!(
            table.take_up(sb, exec("pr-a")),
            Err(NodeError::Conflict(_))
        ));
        // Processes that already run are listed beyond `max_running` (1 here).
        table.take_up(sb, exec("pr-b")).unwrap();
        let ids: Vec<String> = table.list(sb).into_iter().map(|p| p.id).collect();
        assert_eq!(ids, ["pr-a", "pr-b"]);
        assert_eq!(table.list(sb)[0].cmd, Cmd::Shell("sleep 9".into()));

        // Labels the node gave at spawn: tag, meta and the old number come back; a number
        // already listed is not given twice; labels of another shape are left out.
        let labelled = |handle: &str, number: u32| crate::node::AgentExec {
            labels: Some(serde_json::json!({
                "tag": "t", "meta": {"k": [1]}, "number": number, "future": true
            })),
            ..exec(handle)
        };
        table.take_up(sb, labelled("pr-c", 1007)).unwrap();
        table.take_up(sb, labelled("pr-d", 1007)).unwrap();
        let odd = crate::node::AgentExec {
            labels: Some(serde_json::json!({"tag": 5})),
            ..exec("pr-e")
        };
        table.take_up(sb, odd).unwrap();
        let l = table.list(sb);
        let got: Vec<_> = l.iter().map(|p| (p.tag.as_deref(), p.number)).collect();
        assert_eq!(
            got,
            [
                (None, 1000),
                (None, 1001),
                (Some("t"), 1007),
                (Some("t"), 1008),
                (None, 1009)
            ]
        );
        assert_eq!(l[2].meta, Some(serde_json::json!({"k": [1]})));
    }

    /// Issue 25: after a restart new processes are numbered past the highest number the
    /// agent ever held (a deleted process's number is not given again), and a record
    /// deleted or evicted (the `max_kept` cap) is forgotten by the agent too.
    #[tokio::test]
    async fn numbers_go_past_the_agents_highest_and_gone_records_are_forgotten_there() {
        use sandlot_node_fake::FakeNode;
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeNode::default());
        *fake.agent_max_number.lock().unwrap() = Some(1007);
        let limits = ProcessLimits {
            max_kept: 2,
            ..no_reserve()
        };
        let table = ProcessTable::new(fake.clone(), limits, dir.path().into()).unwrap();
        let sb = "sb-0123456789abcdef0123";
        fake.create(&function_spec(sb)).await.unwrap();
        assert_eq!(table.refind(sb).await, 0);
        let echo = || SpawnRequest {
            cmd: Cmd::Argv(vec!["echo".into(), "hi".into()]),
            ..serde_json::from_str("{\"cmd\": \"x\"}").unwrap()
        };
        let mut ps = Vec::new();
        for _ in 0..2 {
            let p = table.spawn(sb, echo()).await.unwrap();
            table
                .get(sb, &p.id)
                .unwrap()
                .wait(Duration::from_secs(5))
                .await;
            ps.push(p);
        }
        assert_eq!((ps[0].number, ps[1].number), (1008, 1009));
        // The third evicts the first (oldest exited); the agent is told.
        let third = table.spawn(sb, echo()).await.unwrap();
        assert_eq!(third.number, 1010);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while fake.agent_forgets.lock().unwrap().is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "eviction not forgotten"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        table.remove(sb, &ps[1].id).await.unwrap();
        let forgot = fake.agent_forgets.lock().unwrap().clone();
        let want: Vec<(String, String)> = [&ps[0].id, &ps[1].id]
            .iter()
            .map(|p| (sb.to_string(), p.to_string()))
            .collect();
        assert_eq!(forgot, want);
    }

    #[tokio::test]
    async fn with_processes_serves_the_process_calls_and_forgets_deleted_sandboxes() {
        use sandlot_node_api::OutputCursor;
        use sandlot_node_fake::FakeNode;
        let dir = tempfile::tempdir().unwrap();
        let node = WithProcesses::with_limits(
            Arc::new(FakeNode::default()),
            no_reserve(),
            dir.path().join("spill"),
        )
        .unwrap();
        let id = "sb-0123456789abcdef0123";
        node.create(&function_spec(id)).await.unwrap();
        let spawn = |argv: &[&str]| SpawnRequest {
            cmd: Cmd::Argv(argv.iter().map(|s| s.to_string()).collect()),
            ..serde_json::from_str("{\"cmd\": \"x\"}").unwrap()
        };
        let p = node
            .process_spawn(id, spawn(&["echo", "hi"]))
            .await
            .unwrap();
        let done = node
            .process_wait(id, &p.id, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(done.state, ProcessState::Exited);
        let events: Vec<ProcessEvent> = futures::StreamExt::collect(
            node.process_output(id, &p.id, OutputCursor::default())
                .await
                .unwrap(),
        )
        .await;
        assert!(
            matches!(events.last(), Some(ProcessEvent::Exit { .. })),
            "{events:?}"
        );
        // A reader that reached offset 3 gets nothing more of stdout.
        let later: Vec<ProcessEvent> = futures::StreamExt::collect(
            node.process_output(
                id,
                &p.id,
                OutputCursor {
                    stdout_offset: 3,
                    ..Default::default()
                },
            )
            .await
            .unwrap(),
        )
        .await;
        assert_eq!(later.len(), 1, "{later:?}");
        let s = node
            .process_spawn(id, spawn(&["sleep", "30"]))
            .await
            .unwrap();
        assert_eq!(node.process_list(id).await.unwrap().len(), 2);
        assert_eq!(
            node.process_get(id, "pr-00000000000000000000")
                .await
                .unwrap_err()
                .code(),
            sandlot_api::ErrorCode::NotFound
        );
        node.process_signal(id, &s.id, libc::SIGTERM).await.unwrap();
        let s = node
            .process_wait(id, &s.id, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(s.result.unwrap().signal, Some(libc::SIGTERM));
        node.process_remove(id, &s.id).await.unwrap();
        assert_eq!(node.process_list(id).await.unwrap().len(), 1);
        // Numbers count up per sandbox and are not reused after a remove; tag and meta are
        // kept in the record.
        assert_eq!((p.number, s.number), (1000, 1001));
        let mut req = spawn(&["echo", "x"]);
        req.tag = Some("t".into());
        req.meta = Some(serde_json::json!({"k": [1, 2]}));
        let t = node.process_spawn(id, req.clone()).await.unwrap();
        assert_eq!(t.number, 1002);
        let got = node.process_get(id, &t.id).await.unwrap();
        assert_eq!((got.tag, got.meta), (req.tag.clone(), req.meta.clone()));
        req.tag = Some("x".repeat(sandlot_api::MAX_TAG_BYTES + 1));
        let e = node.process_spawn(id, req.clone()).await.unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::InvalidArgument, "{e}");
        req.tag = None;
        req.meta = Some("x".repeat(sandlot_api::MAX_META_BYTES).into());
        let e = node.process_spawn(id, req).await.unwrap_err();
        assert_eq!(e.code(), sandlot_api::ErrorCode::InvalidArgument, "{e}");
        // A spawn in an unknown sandbox leaves no entry behind.
        assert!(node
            .process_spawn("sb-ffffffffffffffffffff", spawn(&["echo"]))
            .await
            .is_err());
        assert!(!node
            .table()
            .by_sandbox
            .lock()
            .unwrap()
            .contains_key("sb-ffffffffffffffffffff"));
        node.delete(id).await.unwrap();
        assert!(node.process_list(id).await.unwrap().is_empty());
        assert_eq!(node.table().running(), 0);
    }
}
