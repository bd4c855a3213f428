//! `sandlot-guest agent`: pid 1 of a container (later of a microVM/VM), serving the
//! protocol of [`sandlot_guest::agent_proto`] over HTTP/2.
//!
//! Usage: `sandlot-guest agent --listen-fd N` (accept connections on an inherited,
//! listening unix socket: the node bound it on the host and passed it in, so the
//! container can neither replace nor redirect it) or `--listen PATH` (bind a unix socket).
//!
//! Duties as pid 1: reap every child (orphans are re-parented here), bring up `lo`. Each exec runs `sandlot-guest exec` in `own_pid_ns` mode (this
//! same binary, cloned from the exec-helper zygote [`crate::zygote`] or started via
//! `/proc/self/exe`), so set-up, privilege drop, seccomp and the whole-tree kill are the
//! code the function backend uses. The runtime is single-threaded (tokio
//! current-thread) to keep the agent small: it only shuffles bytes.
use std::collections::HashSet;
use std::convert::Infallible;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame as BodyFrame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use sandlot_guest::agent_proto::{
    encode, AttachInfo, AttachRequest, ClockRequest, ExecExit, ExecInfo, ExecList, ExecRequest,
    ForgetRequest, FrameDecoder, FrameKind, IdentityRequest, SignalRequest, CONNECTION_WINDOW,
    CONNECT_TIMEOUT_MS, EXECS_LIST_QUERY, MAX_LABELS_BYTES, MAX_STREAMS, PATH_CLOCK, PATH_CONNECT,
    PATH_EXEC, PATH_EXECS, PATH_EXEC_ATTACH, PATH_EXEC_FORGET, PATH_IDENTITY, PATH_PING,
    PATH_SIGNAL, STREAM_WINDOW,
};
use sandlot_guest::exec_table::{ExecState, ExecTable, Stream};
use sandlot_guest::spec::ExecStatus;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch, Notify};

use crate::sys;

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// After the command ended, how long to wait for its output pipes to reach EOF.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// Pids of exec helpers still running (so a late kill never hits a reused pid); the reaper
/// removes them.
type Live = Arc<Mutex<HashSet<i32>>>;

/// Running execs that have an [`ExecRequest::handle`]: handle → helper pid (see
/// [`signal`]).
type Handles = Arc<Mutex<std::collections::HashMap<String, i32>>>;

/// When a named exec's reader goes away, how long to wait for its connection's end before
/// taking it as the caller's cancel (which kills the exec): the stream's reset and the
/// connection's end arrive separately when the node's process dies.
const CONN_END_GRACE: Duration = Duration::from_secs(1);

/// The connection reading a named exec's frames now: the one that started it, or the last
/// that attached to it ([`PATH_EXEC_ATTACH`]).
#[derive(Clone)]
struct Reader {
    tx: mpsc::Sender<Bytes>,
    /// The connection's [`Shared::host_gone`].
    host_gone: Arc<std::sync::atomic::AtomicBool>,
    /// The connection's [`Shared::conn_ended`].
    ended: Option<watch::Receiver<bool>>,
}

impl Reader {
    fn open(&self) -> bool {
        !self.tx.is_closed()
    }

    /// After its stream closed: true when its connection went away (the node's process:
    /// keep the exec), false when the connection lives on (the caller cancelled).
    async fn host_went(&self) -> bool {
        if self.host_gone.load(SeqCst) {
            return true;
        }
        let Some(mut ended) = self.ended.clone() else {
            return false;
        };
        // `Err` from `wait_for`: the connection's sender was dropped, so it ended too.
        let went = tokio::time::timeout(CONN_END_GRACE, ended.wait_for(|e| *e))
            .await
            .is_ok();
        went
    }
}

/// What the agent keeps of a named exec besides its [`ExecTable`] entry.
struct Tabled {
    /// Who reads its frames; `None` (or closed) while nobody does: output goes to the ring.
    reader: Option<Reader>,
    /// Bytes written so far to stdout and stderr.
    totals: [u64; 2],
    /// Its exit frame once it ended, for the node that takes it.
    exit: Option<Bytes>,
    /// Woken when a new reader attaches (the exec's task watches that one's close).
    attached: Arc<Notify>,
}

/// The agent's named execs: the [`ExecTable`] (issue 25) and, per entry, its [`Tabled`].
#[derive(Default)]
struct Execs {
    table: ExecTable,
    tabled: std::collections::HashMap<String, Tabled>,
}

fn stream_of(kind: FrameKind) -> Stream {
    if kind == FrameKind::Stderr {
        Stream::Stderr
    } else {
        Stream::Stdout
    }
}

fn frame_of(s: Stream) -> FrameKind {
    match s {
        Stream::Stdout => FrameKind::Stdout,
        Stream::Stderr => FrameKind::Stderr,
    }
}

impl Execs {
    /// Tables the running exec `handle`; `None` when the table is full of running execs
    /// (the exec then runs untabled, as a plain one).
    fn add(
        &mut self,
        handle: &str,
        argv: Vec<String>,
        labels: Option<serde_json::Value>,
        pid: i32,
        reader: Reader,
    ) -> Option<Arc<Notify>> {
        self.table.insert(handle, argv, labels, pid).ok()?;
        let table = &self.table;
        // Entries the insert evicted (ended ones nobody took).
        self.tabled.retain(|h, _| table.get(h).is_some());
        let attached = Arc::new(Notify::new());
        self.tabled.insert(
            handle.to_string(),
            Tabled {
                reader: Some(reader),
                totals: [0, 0],
                exit: None,
                attached: attached.clone(),
            },
        );
        Some(attached)
    }

    fn reader(&self, handle: &str) -> Option<Reader> {
        self.tabled.get(handle)?.reader.clone()
    }

    /// Forgets the reader `tx` of `handle` (not a newer one that attached meanwhile).
    fn drop_reader(&mut self, handle: &str, tx: &mpsc::Sender<Bytes>) {
        if let Some(t) = self.tabled.get_mut(handle) {
            if t.reader.as_ref().is_some_and(|r| r.tx.same_channel(tx)) {
                t.reader = None;
            }
        }
    }

    /// Counts `data` and returns the open reader to send it to; without one it goes to
    /// the ring.
    fn output(
        &mut self,
        handle: &str,
        kind: FrameKind,
        data: &[u8],
    ) -> Option<mpsc::Sender<Bytes>> {
        let t = self.tabled.get_mut(handle)?;
        t.totals[usize::from(kind == FrameKind::Stderr)] += data.len() as u64;
        if let Some(r) = t.reader.as_ref().filter(|r| r.open()) {
            return Some(r.tx.clone());
        }
        let _ = self.table.output(handle, stream_of(kind), data);
        None
    }

    /// Puts `data` (already counted) in the ring: its reader went away while it was sent.
    fn keep(&mut self, handle: &str, kind: FrameKind, data: &[u8]) {
        let _ = self.table.output(handle, stream_of(kind), data);
    }

    /// Records the end of `handle` (`exit`: its exit frame); returns the open reader to
    /// send the frame to.
    fn finish(&mut self, handle: &str, code: i32, exit: Bytes) -> Option<mpsc::Sender<Bytes>> {
        let _ = self.table.exited(handle, code);
        let t = self.tabled.get_mut(handle)?;
        t.exit = Some(exit);
        t.reader.as_ref().filter(|r| r.open()).map(|r| r.tx.clone())
    }

    /// Untables `handle`; nothing when it is not tabled.
    fn forget(&mut self, handle: &str) {
        let _ = self.table.forget(handle);
        self.tabled.remove(handle);
    }

    /// [`PATH_EXEC_FORGET`]: untables `handle`, killing it first (SIGKILL to its helper,
    /// which takes its whole pid namespace) while it runs.
    fn forget_killing(&mut self, handle: &str) {
        if let Some(e) = self.table.get(handle) {
            if e.state == ExecState::Running {
                let _ = kill(Pid::from_raw(e.pid), Signal::SIGKILL);
            }
        }
        self.forget(handle);
    }

    /// A node read the end of `handle`: it stays tabled, ended, until forgotten, and its
    /// reader goes (so that reader's stream ends).
    fn taken(&mut self, handle: &str) {
        if let Some(t) = self.tabled.get_mut(handle) {
            t.reader = None;
        }
    }

    /// `GET /v1/execs`: every entry, by handle.
    fn list(&self) -> Vec<ExecInfo> {
        self.table
            .iter()
            .map(|(h, e)| {
                let totals = self.tabled.get(h).map_or([0, 0], |t| t.totals);
                ExecInfo {
                    handle: h.to_string(),
                    argv: e.command.clone(),
                    pid: e.pid,
                    started_unix_ms: e
                        .started
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64),
                    exit_code: match e.state {
                        ExecState::Running => None,
                        ExecState::Exited(c) => Some(c),
                    },
                    stdout_bytes: totals[0],
                    stderr_bytes: totals[1],
                    dropped: e.output.dropped(),
                    labels: e.labels.clone(),
                }
            })
            .collect()
    }

    /// `POST /v1/exec/attach` under the lock: the answer's first frames (the
    /// [`AttachInfo`], the ring's content, the exit frame when it ended) and whether the
    /// exec goes on (then `reader` reads it from now on). A 404 / 409 message otherwise.
    fn attach(
        &mut self,
        handle: &str,
        reader: Reader,
    ) -> Result<(Vec<u8>, bool), (StatusCode, String)> {
        let (Some(t), Some(e)) = (self.tabled.get_mut(handle), self.table.get_mut(handle)) else {
            return Err((
                StatusCode::NOT_FOUND,
                format!("no exec with handle {handle:?}"),
            ));
        };
        if t.reader.as_ref().is_some_and(|r| r.open()) {
            return Err((
                StatusCode::CONFLICT,
                format!("exec {handle:?} is read by a live connection"),
            ));
        }
        let chunks = e.output.drain();
        let mut held = [0u64; 2];
        for (s, d) in &chunks {
            held[usize::from(*s == Stream::Stderr)] += d.len() as u64;
        }
        let info = AttachInfo {
            stdout_offset: t.totals[0] - held[0],
            stderr_offset: t.totals[1] - held[1],
            dropped: e.output.dropped(),
        };
        let mut first = encode(
            FrameKind::Spec,
            &serde_json::to_vec(&info).expect("AttachInfo serialises"),
        );
        for (s, d) in &chunks {
            first.extend(encode(frame_of(*s), d));
        }
        if let Some(exit) = &t.exit {
            first.extend_from_slice(exit);
            // Kept, ended, until the node forgets it.
            t.reader = None;
            return Ok((first, false));
        }
        t.reader = Some(reader);
        t.attached.notify_one();
        Ok((first, true))
    }
}

/// What every call may need: the live helpers, the named execs and the helper started
/// ahead of the next exec.
#[derive(Clone, Default)]
struct Shared {
    live: Live,
    handles: Handles,
    /// Named execs, kept past their connection's end (see [`PATH_EXECS`]).
    execs: Arc<Mutex<Execs>>,
    /// Turns true when this call's connection ends ([`serve_conn`]); `None` outside one.
    conn_ended: Option<watch::Receiver<bool>>,
    spare: Arc<Mutex<Option<Helper>>>,
    /// The exec-helper zygote (see [`crate::zygote`]) that makes the helpers.
    zygote: Arc<Mutex<ZygoteSlot>>,
    /// Set by [`serve_vm`]: the first spare is started just after the answer to the
    /// node's identity call (the last call of a create) instead of at start, so that on a
    /// microVM's single vCPU neither the boot's readiness ping nor the identity call waits
    /// for the zygote's and the spare's fork + execve (~40 ms of a cold boot under TCG).
    /// Cleared by the first exec, which starts its own helper and the spare after it.
    spare_pending: Arc<std::sync::atomic::AtomicBool>,
    /// Set by [`bridge`] when the host closed the microVM's port (its node went away: a
    /// node restart, or the VM was resumed on another node from a shared snapshot): the
    /// execs of that connection then run on until they end or time out, their output
    /// discarded, instead of being killed as for a caller that cancelled. One flag per
    /// connection (a fresh one for each in [`serve_vm`]).
    host_gone: Arc<std::sync::atomic::AtomicBool>,
}

/// A started `sandlot-guest exec` waiting for its spec on fd 3.
///
/// The agent keeps one started ahead of the next exec (the "spare", see [`Shared::spare`];
/// `sandlot-guest exec --own-pid-ns`): the helper's creation and its spec-independent
/// set-up (the exec's pid namespace and exec init, the seccomp filters) then happen off the
/// exec's critical path. A spare costs two processes of the sandbox (its pids limit) and
/// about 0.3 MiB private memory; one that died meanwhile (OOM killer, kill from the node)
/// is noticed and replaced by a fresh helper.
///
/// Helpers are made by the zygote (one more long-lived process, see [`crate::zygote`]),
/// which saves each the fork of the agent, the execve and the start-up of the binary and
/// the building of the filters; while there is none (not started yet, killed, failing)
/// the agent starts them itself with fork + execve of `/proc/self/exe`. Either way the
/// helper is the agent's child.
struct Helper {
    pid: i32,
    /// Write end of the helper's stdin.
    stdin: OwnedFd,
    /// Read end of the helper's stdout.
    stdout: OwnedFd,
    /// Read end of the helper's stderr.
    stderr: OwnedFd,
    /// Write end of the helper's fd 3 (the spec).
    spec_w: OwnedFd,
    /// Read end of the helper's fd 4 (violations, then the status).
    status_r: OwnedFd,
}

/// For `pre_exec` of a helper or the zygote: in a microVM every exec joins the guest's
/// `sandbox` cgroup (its pids limit), and signals for the command wait in the helper until
/// it can forward them. The returned closure is async-signal-safe (open, write, close,
/// sigprocmask; the path is made here, before the fork).
fn helper_setup() -> impl FnMut() -> std::io::Result<()> + Send + Sync + 'static {
    let procs = std::path::Path::new(crate::vm::SANDBOX_CGROUP_PROCS)
        .exists()
        .then(|| std::ffi::CString::new(crate::vm::SANDBOX_CGROUP_PROCS).expect("no NUL"));
    move || {
        if let Some(p) = &procs {
            // SAFETY: a NUL-terminated path; open, write and close are async-signal-safe.
            unsafe {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    // "0" moves the writing process itself.
                    libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                }
            }
        }
        sys::block_forwarded_raw()
    }
}

impl Helper {
    /// Starts a helper with fork + execve (stdin, stdout and stderr are pipes) and
    /// registers it in `live`.
    fn spawn_direct(live: &Live) -> std::io::Result<Helper> {
        let (spec_r, spec_w) = pipe()?;
        let (status_r, status_w) = pipe()?;
        let spec_r = high(spec_r)?;
        let status_w = high(status_w)?;
        let (sfd, wfd) = (spec_r.as_raw_fd(), status_w.as_raw_fd());
        let mut cmd = Command::new("/proc/self/exe");
        cmd.args(["exec", "--own-pid-ns"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_clear();
        let mut setup = helper_setup();
        // SAFETY: runs in the forked child before execve; dup2 and `setup` are
        // async-signal-safe, the sources are CLOEXEC fds >= 10.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(sfd, 3) < 0 || libc::dup2(wfd, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                setup()
            });
        }
        let mut child = cmd.spawn()?;
        let pid = child.id() as i32;
        register(live, pid);
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            unreachable!("stdin, stdout and stderr are piped");
        };
        Ok(Helper {
            pid,
            stdin: stdin.into(),
            stdout: stdout.into(),
            stderr: stderr.into(),
            spec_w,
            status_r,
        })
    }
}

/// The zygote, if one runs, and when the next may be started.
#[derive(Default)]
struct ZygoteSlot {
    zygote: Option<crate::zygote::Zygote>,
    /// No new zygote before this (set after a failure, so a zygote that keeps dying costs
    /// one start per second at most).
    not_before: Option<Instant>,
    /// The zygote cannot work here (gVisor: `CLONE_PARENT` not honoured): never start one.
    unsupported: bool,
    /// A refill thread is starting one (outside the lock).
    starting: bool,
}

/// How long after a zygote failed the next one may be started.
const ZYGOTE_RESTART_DELAY: Duration = Duration::from_secs(1);

/// Locks `m` even if a thread panicked while holding it (the slots hold no invariant a
/// panic could break: at worst a helper or zygote that is gone, which the users check).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Adds the child `pid` to `live` unless the reaper already collected it (a helper may
/// end before its pid reaches us: at the pids limit its fork fails and it exits at once);
/// a pid left in `live` after its reaping would be killed later, perhaps reused by then.
fn register(live: &Live, pid: i32) {
    let mut l = live.lock().unwrap();
    l.insert(pid);
    // WNOWAIT: only look; the reaper, which takes the lock above before it removes a pid,
    // collects it. ECHILD: reaped before the insert.
    let gone = nix::sys::wait::waitid(
        nix::sys::wait::Id::Pid(Pid::from_raw(pid)),
        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
    ) == Err(nix::errno::Errno::ECHILD);
    if gone {
        l.remove(&pid);
    }
}

impl Shared {
    /// The spare helper if it is still alive (not yet reaped), else a freshly started one.
    /// A refill under way is waited for (it holds the lock while it asks the zygote for a
    /// helper, or forks and execs one: about a millisecond; a zygote's own start happens
    /// before the refill takes the lock): starting a second helper next to it costs more.
    fn take_helper(&self) -> std::io::Result<Helper> {
        self.spare_pending.store(false, SeqCst);
        let spare = lock(&self.spare).take();
        if let Some(h) = spare {
            if self.live.lock().unwrap().contains(&h.pid) {
                return Ok(h);
            }
        }
        self.new_helper()
    }

    /// Starts the zygote unless one runs, is starting, cannot work here, or failed less
    /// than [`ZYGOTE_RESTART_DELAY`] ago. Only off the exec's critical path (the refill
    /// thread), and without holding a lock an exec waits for: the start (fork, execve, the
    /// binary's start-up, the filters, its probe clone) takes milliseconds, under TCG more.
    fn ensure_zygote(&self) {
        {
            let mut slot = lock(&self.zygote);
            if slot.zygote.is_some()
                || slot.unsupported
                || slot.starting
                || slot.not_before.is_some_and(|t| Instant::now() < t)
            {
                return;
            }
            slot.starting = true;
        }
        // SAFETY: `helper_setup` is async-signal-safe.
        let started = unsafe { crate::zygote::Zygote::spawn(helper_setup()) };
        let mut slot = lock(&self.zygote);
        slot.starting = false;
        match started {
            Ok(z) => {
                register(&self.live, z.pid());
                slot.zygote = Some(z);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => {
                eprintln!(
                    "sandlot-guest agent: no exec zygote here (clone with CLONE_PARENT \
                     does not make the agent the parent): helpers start directly"
                );
                slot.unsupported = true;
            }
            Err(e) => {
                eprintln!("sandlot-guest agent: starting the exec zygote: {e}");
                slot.not_before = Some(Instant::now() + ZYGOTE_RESTART_DELAY);
            }
        }
    }

    /// A new helper from the zygote, else (none running, gone, failing) started directly.
    ///
    /// EAGAIN (the pids limit) from the zygote is the answer: a direct start would be
    /// refused too.
    fn new_helper(&self) -> std::io::Result<Helper> {
        let mut slot = lock(&self.zygote);
        if let Some(z) = &slot.zygote {
            match z.helper() {
                Ok(m) => {
                    register(&self.live, m.pid);
                    return Ok(Helper {
                        pid: m.pid,
                        stdin: m.stdin,
                        stdout: m.stdout,
                        stderr: m.stderr,
                        spec_w: m.spec_w,
                        status_r: m.status_r,
                    });
                }
                Err(crate::zygote::RequestError::Refused(e))
                    if e.raw_os_error() == Some(libc::EAGAIN) =>
                {
                    return Err(e)
                }
                Err(crate::zygote::RequestError::Refused(_)) => {}
                Err(crate::zygote::RequestError::Gone(e)) => {
                    eprintln!("sandlot-guest agent: exec zygote gone ({e}): helpers start directly until a new one runs");
                    let z = slot.zygote.take().expect("checked above");
                    if self.live.lock().unwrap().contains(&z.pid()) {
                        let _ = kill(Pid::from_raw(z.pid()), Signal::SIGKILL);
                    }
                    slot.not_before = Some(Instant::now() + ZYGOTE_RESTART_DELAY);
                }
            }
        }
        drop(slot);
        Helper::spawn_direct(&self.live)
    }

    /// Starts a spare helper on a short-lived thread (a zygote's start, the request to the
    /// zygote, or the fork and execve stay off the runtime's thread) unless a live one is
    /// there or a refill is under way. A failure, e.g. at the pids limit, leaves none: the
    /// next exec starts its own.
    fn refill_spare(&self) {
        let shared = self.clone();
        let _ = std::thread::Builder::new()
            .name("spare".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                shared.ensure_zygote();
                let mut spare = match shared.spare.try_lock() {
                    Ok(g) => g,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => return,
                };
                let alive = spare
                    .as_ref()
                    .is_some_and(|h| shared.live.lock().unwrap().contains(&h.pid));
                if !alive {
                    *spare = shared.new_helper().ok();
                }
            });
    }
}

/// Entry point; returns the process exit code.
pub fn main(args: &[String]) -> i32 {
    let args = match jail_from_args(args) {
        Ok((None, rest)) => rest,
        Ok((Some(j), rest)) => {
            match crate::exec::enter_jail(j.init_pid, j.init_starttime, &j.cgroup_procs) {
                Ok(None) => rest,
                // The launcher: the agent runs on in the sandbox (see `enter_jail`); its host
                // pid goes to the node on stdout.
                Ok(Some(pid)) => {
                    println!("{pid}");
                    return 0;
                }
                Err(e) => {
                    eprintln!("sandlot-guest agent: entering the sandbox: {e:#}");
                    return 1;
                }
            }
        }
        Err(e) => {
            eprintln!("sandlot-guest agent: {e}");
            return 2;
        }
    };
    let listener = match listener_from_args(args) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("sandlot-guest agent: {e}");
            return 2;
        }
    };
    if std::process::id() == 1 {
        // A container without network has a fresh netns with `lo` down.
        let _ = sys::loopback_up();
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandlot-guest agent: tokio runtime: {e}");
            return 1;
        }
    };
    rt.block_on(serve(listener))
}

/// The function sandbox an agent is to enter first (`--jail PID STARTTIME` followed by
/// any number of `--cgroup-procs FILE`, ahead of the listener flags; see
/// [`crate::exec::enter_jail`]).
struct Jail {
    init_pid: i32,
    init_starttime: u64,
    cgroup_procs: Vec<String>,
}

/// Splits the `--jail` prefix (if any) off `args`.
fn jail_from_args(args: &[String]) -> Result<(Option<Jail>, &[String]), String> {
    if args.len() < 3 || args[0] != "--jail" {
        return Ok((None, args));
    }
    let (pid, start) = (&args[1], &args[2]);
    let mut jail = Jail {
        init_pid: pid.parse().map_err(|_| format!("bad pid {pid:?}"))?,
        init_starttime: start
            .parse()
            .map_err(|_| format!("bad start time {start:?}"))?,
        cgroup_procs: Vec::new(),
    };
    let mut rest = &args[3..];
    while rest.len() >= 2 && rest[0] == "--cgroup-procs" {
        jail.cgroup_procs.push(rest[1].clone());
        rest = &rest[2..];
    }
    Ok((Some(jail), rest))
}

fn listener_from_args(args: &[String]) -> Result<std::os::unix::net::UnixListener, String> {
    match args {
        [flag, fd] if flag == "--listen-fd" => {
            let fd: i32 = fd.parse().map_err(|_| format!("bad fd {fd:?}"))?;
            let owned = sys::inherited_fd(fd).map_err(|e| format!("fd {fd}: {e}"))?;
            sys::set_cloexec(owned.as_raw_fd()).map_err(|e| format!("cloexec {fd}: {e}"))?;
            Ok(std::os::unix::net::UnixListener::from(owned))
        }
        [flag, path, rest @ ..] if flag == "--listen" => {
            let _ = std::fs::remove_file(path);
            let l = std::os::unix::net::UnixListener::bind(path)
                .map_err(|e| format!("bind {path}: {e}"))?;
            // Connecting needs write permission on the socket: owned by another uid with
            // mode 0600, commands (uid 0 without capabilities) cannot reach the agent.
            if let [flag, uid] = rest {
                if flag != "--socket-owner" {
                    return Err(format!("unknown flag {flag:?}"));
                }
                let uid: u32 = uid.parse().map_err(|_| format!("bad uid {uid:?}"))?;
                std::os::unix::fs::chown(path, Some(uid), Some(uid))
                    .and_then(|_| {
                        use std::os::unix::fs::PermissionsExt;
                        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                    })
                    .map_err(|e| format!("chown/chmod {path}: {e}"))?;
            } else if !rest.is_empty() {
                return Err("usage: --listen PATH [--socket-owner UID]".into());
            }
            Ok(l)
        }
        _ => Err(
            "usage: sandlot-guest agent --listen-fd N | --listen PATH [--socket-owner UID]".into(),
        ),
    }
}

async fn serve(listener: std::os::unix::net::UnixListener) -> i32 {
    if let Err(e) = listener.set_nonblocking(true) {
        eprintln!("sandlot-guest agent: nonblocking listener: {e}");
        return 1;
    }
    let listener = match tokio::net::UnixListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("sandlot-guest agent: listener: {e}");
            return 1;
        }
    };
    let shared = Shared::default();
    tokio::spawn(reap(shared.live.clone()));
    shared.refill_spare();
    // No SIGTERM handler on purpose: as pid 1 of its namespace the agent then ignores
    // SIGTERM sent from inside (a command cannot stop it); the node deletes containers
    // with SIGKILL, which takes every exec's pid namespace down with it.
    let mut failures = 0u32;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                failures = 0;
                stream
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning, up to a second; never
                // exit (as pid 1 that would end the sandbox).
                failures += 1;
                if failures == 1 || failures.is_multiple_of(100) {
                    eprintln!("sandlot-guest agent: accept: {e}");
                }
                let ms = (50 * u64::from(failures)).min(1000);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                continue;
            }
        };
        tokio::spawn(serve_conn(stream, shared.clone()));
    }
}

/// Serves one HTTP/2 connection until it ends.
async fn serve_conn<S>(stream: S, mut shared: Shared)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (ended_tx, ended_rx) = watch::channel(false);
    shared.conn_ended = Some(ended_rx);
    let svc = hyper::service::service_fn(move |req| handle(req, shared.clone()));
    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .max_concurrent_streams(MAX_STREAMS)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .serve_connection(TokioIo::new(stream), svc)
        .await;
    // Named execs of this connection run on (see `Reader::host_went`).
    let _ = ended_tx.send(true);
}

/// The agent of a microVM (called by [`crate::vm`] as pid 1): serves the protocol over the
/// virtio-serial port `port`, a single byte stream that QEMU connects to a unix socket on
/// the host. Each host connection gets a fresh HTTP/2 server connection: the port reads EOF
/// (and polls `POLLHUP`) when the host side closes (node restart), which ends that
/// connection (and kills its running execs, as a reset stream does); the next one starts
/// when the host connects again.
///
/// The port is served by two plain threads with poll(2) timeouts, bridged to a socketpair
/// whose other end is the HTTP/2 connection: the port's wake-ups are not reliable edges for
/// epoll (seen with virtio_console on Linux 6.1 under QEMU 7.2).
/// Returns only on a fatal error.
pub fn serve_vm(port: &std::path::Path) -> i32 {
    use std::os::unix::fs::OpenOptionsExt;
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(port)
    {
        Ok(f) => Arc::new(f),
        Err(e) => {
            eprintln!("sandlot-guest agent: open {}: {e}", port.display());
            return 1;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandlot-guest agent: tokio runtime: {e}");
            return 1;
        }
    };
    let shared = Shared::default();
    rt.spawn(reap(shared.live.clone()));
    shared.spare_pending.store(true, SeqCst);
    loop {
        // While no host is connected poll answers POLLHUP at once: sleep between checks.
        while port_poll(&file, libc::POLLIN, 100).is_none_or(|r| r & libc::POLLHUP != 0) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (a, b) = match std::os::unix::net::UnixStream::pair() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("sandlot-guest agent: socketpair: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let conn = {
            let _g = rt.enter();
            a.set_nonblocking(true)
                .ok()
                .and_then(|_| tokio::net::UnixStream::from_std(a).ok())
        };
        let Some(conn) = conn else { continue };
        let mut per_conn = shared.clone();
        per_conn.host_gone = Arc::default();
        let host_gone = per_conn.host_gone.clone();
        rt.spawn(serve_conn(conn, per_conn));
        bridge(&file, b, &host_gone);
    }
}

/// poll(2) on the port for `events` for up to `ms`; the returned events, `None` on error.
fn port_poll(f: &std::fs::File, events: libc::c_short, ms: i32) -> Option<libc::c_short> {
    let mut p = libc::pollfd {
        fd: f.as_raw_fd(),
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        std::thread::sleep(Duration::from_millis(ms as u64));
        return None;
    }
    Some(p.revents)
}

/// How long after the host's last bytes [`bridge`] polls the port in short steps.
const PORT_BUSY_FOR: Duration = Duration::from_secs(2);
/// [`bridge`]'s poll timeout on the port while busy (ms). Not shorter: with the guest's
/// high-resolution timers each wake-up reprograms the APIC timer, which costs under TCG
/// (docs/backends.md "Agent channel").
const PORT_POLL_BUSY_MS: i32 = 4;
/// [`bridge`]'s poll timeout on the port while idle (ms): an idle guest wakes 10 times a
/// second.
const PORT_POLL_IDLE_MS: i32 = 100;

/// Copies bytes between the port and `b` (the agent's end of one HTTP/2 connection) until
/// the host disconnects (a read of 0 with `POLLHUP`) or the connection ends; then shuts `b`
/// down so the HTTP/2 connection ends too.
fn bridge(
    port: &Arc<std::fs::File>,
    b: std::os::unix::net::UnixStream,
    host_gone: &std::sync::atomic::AtomicBool,
) {
    use std::io::{Read, Write};
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Milliseconds since `t0` at the last bytes either way (the host's answer to the
    // guest's bytes is traffic to expect as well).
    let t0 = Instant::now();
    let last_data = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // Blocking reads without a timeout: the end of the port side (below) shuts `b` down,
    // which ends this read at once; a timeout would only wake an idle guest for nothing.
    let Ok(mut b_in) = b.try_clone() else { return };
    let down = {
        let (port, done, last_data) = (port.clone(), done.clone(), last_data.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let n = match b_in.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::WouldBlock
                            || e.kind() == std::io::ErrorKind::TimedOut
                            || e.kind() == std::io::ErrorKind::Interrupted =>
                    {
                        continue
                    }
                    Err(_) => break,
                };
                last_data.store(
                    t0.elapsed().as_millis() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                let mut off = 0;
                while off < n && !done.load(std::sync::atomic::Ordering::Relaxed) {
                    match (&*port).write(&buf[off..n]) {
                        Ok(w) => off += w,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            port_poll(&port, libc::POLLOUT, 10);
                        }
                        Err(_) => break,
                    }
                }
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    };
    let mut b_out = b;
    let mut buf = vec![0u8; 64 * 1024];
    while !done.load(std::sync::atomic::Ordering::Relaxed) {
        // The port's POLLIN wake-up does not always come (the host's next bytes then waited
        // for the timeout: ~0.1 s of every microVM exec round trip under TCG, measured):
        // while the connection is busy, poll in short steps; idle, in long ones.
        let since = (t0.elapsed().as_millis() as u64)
            .saturating_sub(last_data.load(std::sync::atomic::Ordering::Relaxed));
        let busy = since < PORT_BUSY_FOR.as_millis() as u64;
        let ms = if busy {
            PORT_POLL_BUSY_MS
        } else {
            PORT_POLL_IDLE_MS
        };
        let revents = port_poll(port, libc::POLLIN, ms).unwrap_or(0);
        if revents & (libc::POLLIN | libc::POLLHUP) == 0 {
            continue;
        }
        match (&**port).read(&mut buf) {
            Ok(0) => {
                // A read of 0 is the host's close only when poll agrees (the port can also
                // yield empty reads).
                if port_poll(port, libc::POLLIN, 0).is_some_and(|r| r & libc::POLLHUP != 0) {
                    // Before the connection ends (below): its execs see the flag.
                    host_gone.store(true, SeqCst);
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(n) => {
                last_data.store(
                    t0.elapsed().as_millis() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                if b_out.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = b_out.shutdown(std::net::Shutdown::Both);
    let _ = down.join();
}

/// Reaps every child on SIGCHLD: exec helpers and orphans re-parented to pid 1.
async fn reap(live: Live) {
    let Ok(mut chld) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) else {
        return;
    };
    loop {
        loop {
            match waitpid(None::<Pid>, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(s) => {
                    if let Some(pid) = s.pid() {
                        live.lock().unwrap().remove(&pid.as_raw());
                    }
                }
            }
        }
        if chld.recv().await.is_none() {
            return;
        }
    }
}

fn text(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Full::new(Bytes::from(msg.into())).boxed())
        .expect("valid response")
}

async fn handle(req: Request<Incoming>, shared: Shared) -> Result<Response<Body>, Infallible> {
    if req.uri().path().starts_with("/v1/files/") {
        return Ok(crate::agent_files::handle(req)
            .await
            .unwrap_or_else(|| text(StatusCode::NOT_FOUND, "no such call")));
    }
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, PATH_PING) => text(
            StatusCode::OK,
            format!(
                "{{\"agent\":\"{}\",\"pid\":{}}}",
                env!("CARGO_PKG_VERSION"),
                std::process::id()
            ),
        ),
        (&Method::POST, PATH_EXEC) => match exec(req.into_body(), shared).await {
            Ok(r) => r,
            Err(msg) => text(StatusCode::BAD_REQUEST, msg),
        },
        (&Method::POST, PATH_SIGNAL) => signal(req.into_body(), &shared).await,
        (&Method::GET, PATH_EXECS) => {
            let json = {
                let execs = lock(&shared.execs);
                let list = execs.list();
                if req.uri().query() == Some(EXECS_LIST_QUERY) {
                    serde_json::to_vec(&ExecList {
                        execs: list,
                        max_number: execs.table.max_number(),
                    })
                } else {
                    serde_json::to_vec(&list)
                }
                .expect("ExecInfo serialises")
            };
            Response::builder()
                .status(StatusCode::OK)
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(json)).boxed())
                .expect("valid response")
        }
        (&Method::POST, PATH_EXEC_ATTACH) => attach(req.into_body(), &shared).await,
        (&Method::POST, PATH_EXEC_FORGET) => {
            match json_body::<ForgetRequest>(req.into_body(), 4096, "forget").await {
                Ok(r) => {
                    lock(&shared.execs).forget_killing(&r.handle);
                    text(StatusCode::NO_CONTENT, "")
                }
                Err(answer) => answer,
            }
        }
        (&Method::POST, PATH_IDENTITY) => {
            let answer = identity(req.into_body()).await;
            if answer.status().is_success() && shared.spare_pending.load(SeqCst) {
                // Once the answer is on its way to the node (through the port's bridge
                // thread, which the spare's fork + execve would otherwise hold up).
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if shared.spare_pending.swap(false, SeqCst) {
                        shared.refill_spare();
                    }
                });
            }
            answer
        }
        (&Method::POST, PATH_CLOCK) => clock(req.into_body()).await,
        (&Method::POST, PATH_CONNECT) => {
            crate::agent_tunnel::connect(req.into_body(), Duration::from_millis(CONNECT_TIMEOUT_MS))
                .await
        }
        _ => text(StatusCode::NOT_FOUND, "no such call"),
    })
}

/// The JSON body of a request, at most `limit` bytes; otherwise the 400 answer to give
/// (`what` names the call in its message).
async fn json_body<T: serde::de::DeserializeOwned>(
    body: Incoming,
    limit: usize,
    what: &str,
) -> Result<T, Response<Body>> {
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Err(text(StatusCode::BAD_REQUEST, format!("request body: {e}"))),
    };
    serde_json::from_slice(&bytes)
        .map_err(|e| text(StatusCode::BAD_REQUEST, format!("{what} JSON: {e}")))
}

/// `POST /v1/clock` (see [`sandlot_guest::agent_proto::PATH_CLOCK`]): sets the guest's
/// wall clock to the host's.
async fn clock(body: Incoming) -> Response<Body> {
    // Not in a container (its agent is pid 1 of its own pid namespace too).
    if !crate::vm::IN_VM.load(SeqCst) {
        return text(
            StatusCode::NOT_FOUND,
            "the clock is set only by a VM's init",
        );
    }
    let req: ClockRequest = match json_body(body, 1 << 10, "clock").await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    let ts = libc::timespec {
        tv_sec: (req.unix_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (req.unix_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime reads one timespec through a pointer to a live local.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        let e = std::io::Error::last_os_error();
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("clock_settime: {e}"),
        );
    }
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Full::new(Bytes::new()).boxed())
        .expect("valid response")
}

/// Reads frames from a request body until the spec frame and parses it as `T`'s JSON;
/// returns it with the decoder, which holds what followed it (the first stdin frames of
/// an exec, the first raw bytes of a tunnel).
pub(crate) async fn read_spec<T, B>(body: &mut B) -> Result<(T, FrameDecoder), String>
where
    T: serde::de::DeserializeOwned,
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut dec = FrameDecoder::default();
    loop {
        if let Some(f) = dec.next_frame().map_err(|e| e.to_string())? {
            if f.kind != FrameKind::Spec {
                return Err(format!("first frame must be a spec, got {:?}", f.kind));
            }
            let r = serde_json::from_slice(&f.data).map_err(|e| format!("spec JSON: {e}"))?;
            return Ok((r, dec));
        }
        match body.frame().await {
            Some(Ok(fr)) => {
                if let Ok(data) = fr.into_data() {
                    dec.push(&data);
                }
            }
            Some(Err(e)) => return Err(format!("request body: {e}")),
            None => return Err("request ended before the spec frame".into()),
        }
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)
}

/// Moves `fd` to a number >= 10 (CLOEXEC), so dup2 onto 3/4 in the child cannot clobber it.
fn high(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    let n = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))?;
    // SAFETY: F_DUPFD_CLOEXEC returned a fresh descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// `POST /v1/identity` (see [`sandlot_guest::agent_proto::PATH_IDENTITY`]): hostname,
/// `/etc/machine-id` and fresh entropy for a microVM guest (the agent is its pid 1).
async fn identity(body: Incoming) -> Response<Body> {
    if std::process::id() != 1 {
        return text(
            StatusCode::NOT_FOUND,
            "identity is set only by a microVM's init",
        );
    }
    let req: IdentityRequest = match json_body(body, 16 << 10, "identity").await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    if req.hostname.is_empty() || req.hostname.len() > 64 || req.entropy.len() > 512 {
        return text(
            StatusCode::BAD_REQUEST,
            "hostname 1..=64 bytes, entropy <= 512 bytes",
        );
    }
    if req.machine_id.len() != 32
        || !req
            .machine_id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return text(
            StatusCode::BAD_REQUEST,
            "machine_id: 32 lowercase hex digits",
        );
    }
    if let Err(e) = nix::unistd::sethostname(&req.hostname) {
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("sethostname: {e}"),
        );
    }
    let _ = std::fs::create_dir_all("/etc");
    let tmp = "/etc/.machine-id.sandlot";
    if let Err(e) = std::fs::write(tmp, format!("{}\n", req.machine_id))
        .and_then(|_| std::fs::rename(tmp, "/etc/machine-id"))
    {
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("/etc/machine-id: {e}"),
        );
    }
    if let Err(e) = add_entropy(&req.entropy) {
        return text(StatusCode::INTERNAL_SERVER_ERROR, format!("entropy: {e}"));
    }
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Full::new(Bytes::new()).boxed())
        .expect("valid response")
}

/// Credits `data` to the kernel's entropy pool (`RNDADDENTROPY`, 8 bits per byte) and
/// reseeds the CRNG (`RNDRESEEDCRNG`), so `/dev/urandom` output differs from any other guest
/// restored from the same snapshot (random(4)).
fn add_entropy(data: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203; // _IOW('R', 0x03, int[2])
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207; // _IO('R', 0x07)
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    if !data.is_empty() {
        // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
        let mut buf = Vec::with_capacity(8 + data.len());
        buf.extend_from_slice(&((data.len() * 8) as i32).to_ne_bytes());
        buf.extend_from_slice(&(data.len() as i32).to_ne_bytes());
        buf.extend_from_slice(data);
        buf.resize(buf.len().div_ceil(4) * 4, 0);
        // SAFETY: RNDADDENTROPY reads a rand_pool_info of buf_size bytes from a buffer that
        // holds it.
        if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, buf.as_ptr()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `POST /v1/signal`: delivers a signal to the exec named by the handle (see
/// [`sandlot_guest::agent_proto::PATH_SIGNAL`]).
async fn signal(body: Incoming, shared: &Shared) -> Response<Body> {
    // A signal request is a few bytes; anything larger is not one.
    let req: SignalRequest = match json_body(body, 4096, "signal").await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    if req.signal != libc::SIGKILL && !sys::FORWARDED.contains(&req.signal) {
        return text(
            StatusCode::BAD_REQUEST,
            format!("signal {} cannot be delivered", req.signal),
        );
    }
    let Some(pid) = shared.handles.lock().unwrap().get(&req.handle).copied() else {
        return text(StatusCode::NOT_FOUND, "no running exec with that handle");
    };
    // Only a helper not yet reaped: its pid cannot have been reused.
    if !shared.live.lock().unwrap().contains(&pid) {
        return text(StatusCode::NOT_FOUND, "the exec has ended");
    }
    let sig = Signal::try_from(req.signal).expect("checked above");
    match kill(Pid::from_raw(pid), sig) {
        Ok(()) => Response::builder()
            .status(StatusCode::NO_CONTENT)
            .body(Full::new(Bytes::new()).boxed())
            .expect("valid response"),
        Err(e) => text(StatusCode::NOT_FOUND, format!("the exec has ended: {e}")),
    }
}

/// Removes an exec's handle when its task ends.
struct HandleGuard(Handles, Option<String>);

impl Drop for HandleGuard {
    fn drop(&mut self) {
        if let Some(h) = &self.1 {
            self.0.lock().unwrap().remove(h);
        }
    }
}

async fn exec(mut body: Incoming, shared: Shared) -> Result<Response<Body>, String> {
    let live = shared.live.clone();
    let (mut req, mut dec): (ExecRequest, _) = read_spec(&mut body).await?;
    if let Some(h) = &req.handle {
        if shared.handles.lock().unwrap().contains_key(h) {
            return Err(format!("handle {h:?} is already in use"));
        }
    }
    if let Some(l) = &req.labels {
        let n = serde_json::to_vec(l).map_or(usize::MAX, |v| v.len());
        if n > MAX_LABELS_BYTES {
            return Err(format!(
                "labels are {n} bytes of JSON, over the limit of {MAX_LABELS_BYTES}"
            ));
        }
    }
    // Kept only for a named exec (the table's).
    let labels = req.labels.take().filter(|_| req.handle.is_some());
    req.spec.own_pid_ns = true;
    req.spec.cgroup_procs.clear();
    req.spec.stdin_null = !req.stdin;
    let argv = req.spec.argv.clone();
    let spec_json = serde_json::to_vec(&req.spec).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let oom_before = sandbox_oom_kills();
    let helper = match send_spec(&shared, &spec_json).await {
        Ok(h) => h,
        // The sandbox's processes hold every pid of its limit: the sandbox's state, not
        // an agent failure (the node answers resource_exhausted).
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
            let exit = ExecExit {
                status: ExecStatus::SetupFailed {
                    message: format!("spawn exec helper: {e}"),
                    user_error: false,
                    resource_exhausted: true,
                },
                timed_out: false,
                duration_ms: 0.0,
                violations: Vec::new(),
                oom_kills: None,
            };
            let json = serde_json::to_vec(&exit).expect("ExecExit serialises");
            let frame = Bytes::from(encode(FrameKind::Exit, &json));
            return Ok(Response::new(Full::new(frame).boxed()));
        }
        Err(e) => return Err(format!("spawn exec helper: {e}")),
    };
    let Started {
        pid,
        stdin,
        stdout,
        stderr,
        status_r,
    } = helper;
    let killer = KillOnDrop(pid, live.clone());
    let named = HandleGuard(shared.handles.clone(), req.handle.clone());
    if let Some(h) = &req.handle {
        shared.handles.lock().unwrap().insert(h.clone(), pid);
    }
    // Without stdin the helper swaps in /dev/null (`stdin_null`); our end just closes.
    let stdin = Some(stdin).filter(|_| req.stdin);
    if let Some(fd) = stdin {
        let mut w = tokio::net::unix::pipe::Sender::from_owned_fd(fd)
            .map_err(|e| format!("stdin pipe: {e}"))?;
        tokio::spawn(async move {
            loop {
                while let Ok(Some(f)) = dec.next_frame() {
                    if f.kind == FrameKind::Stdin && w.write_all(&f.data).await.is_err() {
                        return;
                    }
                }
                match body.frame().await {
                    Some(Ok(fr)) => {
                        if let Ok(data) = fr.into_data() {
                            dec.push(&data);
                        }
                    }
                    _ => return, // end of body: close stdin
                }
            }
        });
    }
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let reader = Reader {
        tx: tx.clone(),
        host_gone: shared.host_gone.clone(),
        ended: shared.conn_ended.clone(),
    };
    // A named exec is tabled: its output and end then go through the table, to whichever
    // connection reads it (see `PATH_EXECS`).
    let tabled = req.handle.clone().and_then(|h| {
        let attached = lock(&shared.execs).add(&h, argv, labels, pid, reader.clone())?;
        Some((h, attached))
    });
    let route = |kind| match &tabled {
        Some((h, _)) => Route::Named(shared.execs.clone(), h.clone(), kind),
        None => Route::Direct(tx.clone(), kind),
    };
    let out = pump(Some(stdout), route(FrameKind::Stdout));
    let err = pump(Some(stderr), route(FrameKind::Stderr));
    let status_rx = tokio::net::unix::pipe::Receiver::from_owned_fd(status_r)
        .map_err(|e| format!("status pipe: {e}"))?;
    let timeout = Duration::from_millis(req.timeout_ms.max(1));
    let spare_after = shared.clone();
    let execs = shared.execs.clone();
    tokio::spawn(async move {
        let _killer = killer;
        let _named = named;
        let violations = std::sync::Mutex::new(Vec::new());
        let mut status_fut = std::pin::pin!(sandlot_guest::spec::read_exec_status(
            status_rx,
            &violations
        ));
        let deadline = std::pin::pin!(tokio::time::sleep(timeout));
        let mut deadline = deadline;
        let mut orphaned = false;
        // `cancelled`: its reader's stream was reset on a live connection.
        let (status, timed_out, read_done, cancelled) = loop {
            let cur = match &tabled {
                Some((h, _)) => lock(&execs).reader(h),
                None => (!orphaned).then(|| reader.clone()),
            };
            let attached = async {
                match &tabled {
                    Some((_, a)) => a.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                s = status_fut.as_mut() => break (s, false, true, false),
                _ = deadline.as_mut() => break (None, true, false, false),
                _ = async {
                    match &cur {
                        Some(r) => r.tx.closed().await,
                        None => std::future::pending().await,
                    }
                } => {
                    let r = cur.expect("closed only with a reader");
                    // The host went away, not the caller: run on to the end or the
                    // timeout (see `Shared::host_gone`; a named exec also when its
                    // connection ended, see `PATH_EXECS`).
                    let keep = match &tabled {
                        Some(_) => r.host_went().await,
                        None => r.host_gone.load(SeqCst),
                    };
                    if !keep {
                        break (None, false, false, true);
                    }
                    match &tabled {
                        Some((h, _)) => lock(&execs).drop_reader(h, &r.tx),
                        None => orphaned = true,
                    }
                }
                _ = attached => {}
            }
        };
        if status.is_none() {
            // Timeout, caller gone, or helper killed: SIGKILL to the helper takes its exec
            // init (PR_SET_PDEATHSIG) and with it the command's whole pid namespace.
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            if !read_done {
                // Violation records still in the pipe (EOF follows the kill at once).
                let _ = tokio::time::timeout(DRAIN_GRACE, status_fut.as_mut()).await;
            }
        }
        let duration_ms = start.elapsed().as_secs_f64() * 1000.0;
        let _ = tokio::time::timeout(DRAIN_GRACE, async {
            let _ = out.await;
            let _ = err.await;
        })
        .await;
        let status = status.unwrap_or(ExecStatus::Signaled {
            signal: libc::SIGKILL,
        });
        let exit = ExecExit {
            status,
            timed_out,
            duration_ms,
            violations: std::mem::take(&mut *violations.lock().unwrap_or_else(|p| p.into_inner())),
            oom_kills: oom_before
                .zip(sandbox_oom_kills())
                .map(|(a, b)| b.saturating_sub(a)),
        };
        let json = serde_json::to_vec(&exit).expect("ExecExit serialises");
        let frame = Bytes::from(encode(FrameKind::Exit, &json));
        match &tabled {
            None => {
                let _ = tx.send(frame).await;
            }
            // Cancelled: nobody wants its end.
            Some((h, _)) if cancelled => lock(&execs).forget(h),
            Some((h, _)) => {
                drop(tx);
                let code = match &exit.status {
                    ExecStatus::Exited { code } => *code,
                    ExecStatus::Signaled { signal } => 128 + signal,
                    ExecStatus::SetupFailed { .. } => -1,
                };
                let to = lock(&execs).finish(h, code, frame.clone());
                // Delivered: the reader's node has its end; the entry stays, ended,
                // until that node forgets it. Otherwise its end waits in the table for
                // the next node that attaches.
                if let Some(to) = to {
                    if to.send(frame).await.is_ok() {
                        lock(&execs).taken(h);
                    }
                }
            }
        }
        // The next exec's helper, started now that this one's answer is on its way.
        spare_after.refill_spare();
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(BodyFrame::data(b)), rx))
    });
    Ok(Response::new(StreamBody::new(stream).boxed()))
}

/// `oom_kill` of the guest's `sandbox` cgroup (`memory.events`, cgroup v2), only in a VM
/// ([`crate::vm::IN_VM`]); `None` elsewhere or unreadable.
fn sandbox_oom_kills() -> Option<u64> {
    if !crate::vm::IN_VM.load(SeqCst) {
        return None;
    }
    let s = std::fs::read_to_string(crate::vm::SANDBOX_MEMORY_EVENTS).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

/// A helper that has its spec: what the exec keeps of it.
struct Started {
    pid: i32,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
    status_r: OwnedFd,
}

/// Hands `spec_json` to a helper (the spare if it is alive, else a fresh one) and closes
/// its fd 3. A spare that died after the check (EPIPE: fd 3 has no reader) is replaced by
/// a fresh helper once.
async fn send_spec(shared: &Shared, spec_json: &[u8]) -> std::io::Result<Started> {
    let mut helper = shared.take_helper()?;
    let mut retried = false;
    loop {
        let Helper {
            pid,
            stdin,
            stdout,
            stderr,
            spec_w,
            status_r,
        } = helper;
        let mut w = tokio::net::unix::pipe::Sender::from_owned_fd(spec_w)?;
        match w.write_all(spec_json).await {
            Ok(()) => {
                return Ok(Started {
                    pid,
                    stdin,
                    stdout,
                    stderr,
                    status_r,
                })
            }
            Err(e) => {
                // The reaper collects it.
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                if retried || e.raw_os_error() != Some(libc::EPIPE) {
                    return Err(e);
                }
                retried = true;
                helper = shared.new_helper()?;
            }
        }
    }
}

/// Kills the helper (and so the command's tree) when the exec task ends without a status.
struct KillOnDrop(i32, Live);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.1.lock().unwrap().contains(&self.0) {
            let _ = kill(Pid::from_raw(self.0), Signal::SIGKILL);
        }
    }
}

/// Where a pump sends an exec's output (frames of the kind given).
enum Route {
    /// To its connection's stream (a plain exec).
    Direct(mpsc::Sender<Bytes>, FrameKind),
    /// Through the table (a named exec): to its reader, else to its ring.
    Named(Arc<Mutex<Execs>>, String, FrameKind),
}

fn pump(fd: Option<OwnedFd>, route: Route) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Some(fd) = fd else { return };
        let Ok(mut r) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) else {
            return;
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let data = &buf[..n];
            // With no one to send to, keep draining (an exec that outlives its host's
            // connection must not die of SIGPIPE).
            match &route {
                Route::Direct(tx, kind) => {
                    if !tx.is_closed() {
                        let _ = tx.send(Bytes::from(encode(*kind, data))).await;
                    }
                }
                Route::Named(execs, h, kind) => {
                    let to = lock(execs).output(h, *kind, data);
                    if let Some(to) = to {
                        if to.send(Bytes::from(encode(*kind, data))).await.is_err() {
                            lock(execs).keep(h, *kind, data);
                        }
                    }
                }
            }
        }
    })
}

/// `POST /v1/exec/attach` (see [`PATH_EXEC_ATTACH`]): the named exec's ring, then its
/// output as it comes and its exit.
async fn attach(body: Incoming, shared: &Shared) -> Response<Body> {
    let req: AttachRequest = match json_body(body, 4096, "attach").await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let reader = Reader {
        tx,
        host_gone: shared.host_gone.clone(),
        ended: shared.conn_ended.clone(),
    };
    // Under the lock: no output slips between the ring's content and the reader.
    let first = lock(&shared.execs).attach(&req.handle, reader);
    let (first, goes_on) = match first {
        Ok(f) => f,
        Err((status, msg)) => return text(status, msg),
    };
    let first = futures_util::stream::once(async move {
        Ok::<_, Infallible>(BodyFrame::data(Bytes::from(first)))
    });
    if !goes_on {
        return Response::new(StreamBody::new(first).boxed());
    }
    let rest = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(BodyFrame::data(b)), rx))
    });
    Response::new(StreamBody::new(futures_util::StreamExt::chain(first, rest)).boxed())
}
