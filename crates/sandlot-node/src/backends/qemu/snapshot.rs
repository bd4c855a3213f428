//! Pause with memory for the `microvm` and `vm` backends: the guest's memory and device
//! state are saved to `vms/<id>/memory.state` and its QEMU is stopped (the memory is
//! freed); resume starts QEMU again with the same command line plus `-incoming defer` and
//! restores it. Each backend fills in a [`Target`] (its VM's flags, relay, QEMU cell and
//! command line) and calls [`pause`] / [`resume`] under its lifecycle lock.
//!
//! Steps of a pause (QMP, [`crate::qmp`]):
//!
//! 1. the node's side of the agent link stops sending ([`Relay::hold`]) and waits until
//!    QEMU has taken every byte it sent (`SIOCOUTQ` of the socket is 0), so that no byte
//!    is left in a socket that dies with QEMU;
//! 2. `stop`; `getfd` passes the file (QEMU's `-sandbox on` forbids `exec:` migration;
//!    the file is root's, mode 0600, and QEMU, an unprivileged uid, never opens it by name),
//!    `migrate` to `fd:`; `query-migrate` until `completed`; fsync, rename;
//! 3. the link lets go of QEMU's socket ([`Relay::detach`]), `state.json` records
//!    `memory_saved`, QEMU is killed.
//!
//! Resume: QEMU starts with `-incoming defer`, jailed as before the pause
//! ([`Target::jail`]: the sandbox's `qemu_uid`, its sockets bound anew by the node and
//! inherited as fds); the link connects to its new agent socket *before* the state is
//! loaded, so the guest's virtio-serial port sees its host still
//! connected (its `host_connected` is part of the saved state: a mismatch would tell the
//! guest agent the host went away, ending the agent connection and with it every running
//! exec); `migrate-incoming` from `fd:`; `cont`; the link carries on ([`Relay::attach`]).
//! The node's HTTP/2 connection to the agent never notices: it runs over a socket pair whose
//! other end is the relay, not over QEMU's socket. After a node restart there is no such
//! connection to keep; the guest then sees its host disconnect and the next call opens a new
//! agent connection (execs of the old one were lost with the node's process anyway).
//!
//! On disk a paused microVM is `state.json` with `memory_saved: true` plus `memory.state`;
//! [`super::microvm::MicrovmBackend`]'s `readopt` adopts it as paused (a QEMU still alive from a pause
//! cut short by a node crash is killed first).
use super::state::{write_json, VmState};
use super::{spawn_qemu, tail_of, Jail};
use crate::agent_client::AgentClient;
use crate::cgroups::SandboxCgroup;
use crate::node::{NodeError, NodeResult};
use crate::qmp::Qmp;
use crate::sys::{proc_starttime, spawn_blocking};
use serde_json::json;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::RwLock;
use tokio::sync::{mpsc, oneshot};

/// The saved memory and device state of a paused microVM.
pub(crate) const MEMORY_FILE: &str = "memory.state";
pub(crate) use crate::backends::qemu::QMP_SOCK;
/// How long the agent link may take to hand QEMU its last bytes before a pause gives up.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long saving or loading the state may take.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a restarted QEMU may take to open its QMP socket.
const QMP_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause after a restore with no agent connection to keep, so the guest sees its host's
/// disconnect before the next call connects (see the module docs).
const SETTLE_AFTER_RESTART: Duration = Duration::from_millis(500);

/// The QEMU process a microVM runs in now.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QemuProc {
    pub pid: i32,
    pub start: u64,
    /// Its state is in [`MEMORY_FILE`] and no QEMU runs.
    pub saved: bool,
}

impl QemuProc {
    /// The VM is running (QEMU alive) or saved to its memory file.
    pub fn exists(&self) -> bool {
        self.saved || proc_starttime(self.pid) == Some(self.start)
    }

    /// As [`QemuProc::exists`], told only from evidence ([`crate::liveness`]).
    pub fn liveness(&self) -> crate::Liveness {
        if self.saved {
            return crate::Liveness::Alive;
        }
        crate::liveness::proc_liveness(self.pid, self.start)
    }
}

/// Shared handle on the current QEMU of one VM.
pub(crate) type ProcCell = Arc<Mutex<QemuProc>>;

enum Ctl {
    Hold(oneshot::Sender<Result<(), String>>),
    Release,
    Detach(oneshot::Sender<()>),
    Attach(UnixStream),
}

/// The node's end of one microVM's agent link: every agent connection is a socket pair whose
/// far end a pump task bridges to QEMU's agent socket; across a pause the pump parks and is
/// given the new QEMU's socket, so the agent connection (and every exec on it) survives.
pub(crate) struct Relay {
    upstream: PathBuf,
    current: Mutex<Option<mpsc::Sender<Ctl>>>,
}

/// Bytes QEMU has not read yet from the socket `s` (`SIOCOUTQ`).
fn unread(s: &UnixStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (= SIOCOUTQ) writes one int through a valid pointer.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if r < 0 {
        0
    } else {
        n.max(0) as usize
    }
}

impl Relay {
    /// A relay to QEMU's agent socket at `upstream`.
    pub fn new(upstream: PathBuf) -> Arc<Relay> {
        Arc::new(Relay {
            upstream,
            current: Mutex::new(None),
        })
    }

    /// The [`crate::agent_client::Connector`] of this relay.
    pub fn connector(self: &Arc<Self>) -> crate::agent_client::Connector {
        let me = self.clone();
        Arc::new(move || {
            let me = me.clone();
            Box::pin(async move { me.connect().await })
        })
    }

    async fn connect(&self) -> std::io::Result<UnixStream> {
        let up = crate::agent_client::connect_socket(&self.upstream).await?;
        let (a, b) = UnixStream::pair()?;
        let (tx, rx) = mpsc::channel(4);
        *self.current.lock().unwrap() = Some(tx);
        tokio::spawn(pump(b, up, rx));
        Ok(a)
    }

    fn sender(&self) -> Option<mpsc::Sender<Ctl>> {
        let cur = self.current.lock().unwrap();
        cur.as_ref().filter(|t| !t.is_closed()).cloned()
    }

    /// Whether an agent connection is open through the relay.
    pub fn connected(&self) -> bool {
        self.sender().is_some()
    }

    /// Stops forwarding the node's bytes and waits until QEMU read all sent so far.
    ///
    /// # Errors
    /// `Unavailable` when QEMU does not take them within [`DRAIN_TIMEOUT`] (the guest is
    /// not reading its agent port); the link is released again.
    pub async fn hold(&self) -> NodeResult<()> {
        let Some(tx) = self.sender() else {
            return Ok(());
        };
        let (rtx, rrx) = oneshot::channel();
        if tx.send(Ctl::Hold(rtx)).await.is_err() {
            return Ok(());
        }
        match rrx.await {
            Ok(Ok(())) | Err(_) => Ok(()),
            Ok(Err(e)) => {
                let _ = tx.send(Ctl::Release).await;
                Err(NodeError::Unavailable(e))
            }
        }
    }

    /// Undoes [`Relay::hold`] (a pause that failed later).
    pub async fn release(&self) {
        if let Some(tx) = self.sender() {
            let _ = tx.send(Ctl::Release).await;
        }
    }

    /// Forwards what QEMU still wrote, then lets go of QEMU's socket (the agent connection
    /// stays open, parked).
    pub async fn detach(&self) {
        if let Some(tx) = self.sender() {
            let (rtx, rrx) = oneshot::channel();
            if tx.send(Ctl::Detach(rtx)).await.is_ok() {
                let _ = rrx.await;
            }
        }
    }

    /// When an agent connection is parked: connects QEMU's (new) agent socket for it.
    /// Returns the socket to hand over with [`Relay::attach`] once the guest runs.
    ///
    /// # Errors
    /// `Internal` when QEMU's socket cannot be connected.
    pub async fn reconnect(&self) -> NodeResult<Option<UnixStream>> {
        if !self.connected() {
            return Ok(None);
        }
        crate::agent_client::connect_socket(&self.upstream)
            .await
            .map(Some)
            .map_err(|e| NodeError::io(format!("connect {}", self.upstream.display()), e))
    }

    /// Resumes the parked connection over `up`.
    pub async fn attach(&self, up: UnixStream) {
        if let Some(tx) = self.sender() {
            let _ = tx.send(Ctl::Attach(up)).await;
        }
    }
}

enum Ev {
    Ctl(Option<Ctl>),
    Client(std::io::Result<usize>),
    Up(std::io::Result<usize>),
}

async fn read_opt(s: Option<&mut UnixStream>, buf: &mut [u8]) -> std::io::Result<usize> {
    match s {
        Some(s) => s.read(buf).await,
        None => std::future::pending().await,
    }
}

/// Copies bytes between `client` (the agent connection's far end) and `up` (QEMU's agent
/// socket) until either side closes, obeying [`Ctl`]s in between.
async fn pump(mut client: UnixStream, up: UnixStream, mut ctl: mpsc::Receiver<Ctl>) {
    let mut up = Some(up);
    let mut holding = false;
    let mut ctl_open = true;
    let mut cbuf = vec![0u8; 64 << 10];
    let mut ubuf = vec![0u8; 64 << 10];
    loop {
        let ev = tokio::select! {
            c = ctl.recv(), if ctl_open => Ev::Ctl(c),
            r = client.read(&mut cbuf), if !holding && up.is_some() => Ev::Client(r),
            r = read_opt(up.as_mut(), &mut ubuf) => Ev::Up(r),
        };
        match ev {
            Ev::Ctl(None) => ctl_open = false,
            Ev::Ctl(Some(Ctl::Hold(done))) => {
                holding = true;
                let deadline = Instant::now() + DRAIN_TIMEOUT;
                let res = loop {
                    let Some(u) = up.as_mut() else { break Ok(()) };
                    if unread(u) == 0 {
                        break Ok(());
                    }
                    if Instant::now() >= deadline {
                        break Err(format!(
                            "the guest did not read its agent port within {}s ({} bytes left); not paused",
                            DRAIN_TIMEOUT.as_secs(),
                            unread(u)
                        ));
                    }
                    // Keep forwarding the guest's output meanwhile.
                    match tokio::time::timeout(Duration::from_millis(2), u.read(&mut ubuf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => return,
                        Ok(Ok(n)) => {
                            if client.write_all(&ubuf[..n]).await.is_err() {
                                return;
                            }
                        }
                        Err(_) => {}
                    }
                };
                let _ = done.send(res);
            }
            Ev::Ctl(Some(Ctl::Release)) => holding = false,
            Ev::Ctl(Some(Ctl::Detach(done))) => {
                if let Some(mut u) = up.take() {
                    while let Ok(Ok(n)) =
                        tokio::time::timeout(Duration::from_millis(30), u.read(&mut ubuf)).await
                    {
                        if n == 0 || client.write_all(&ubuf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
                let _ = done.send(());
            }
            Ev::Ctl(Some(Ctl::Attach(u))) => {
                up = Some(u);
                holding = false;
            }
            Ev::Client(Ok(0)) | Ev::Client(Err(_)) => return,
            Ev::Client(Ok(n)) => {
                let Some(u) = up.as_mut() else { return };
                if u.write_all(&cbuf[..n]).await.is_err() {
                    return;
                }
            }
            Ev::Up(Ok(0)) | Ev::Up(Err(_)) => return,
            Ev::Up(Ok(n)) => {
                if client.write_all(&ubuf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// `stop`, then the migration stream of the QEMU whose QMP socket is in `dir` to
/// `OUT/memory.state` (via a temp file, fsynced); its size in bytes. On failure the guest
/// is continued again when QEMU still answers.
pub(crate) fn save_memory(dir: &Path, out_dir: &Path) -> NodeResult<u64> {
    let mut q = Qmp::connect(
        &dir.join(QMP_SOCK),
        Instant::now() + Duration::from_secs(5),
        Duration::from_secs(30),
    )?;
    let tmp = out_dir.join(format!("{MEMORY_FILE}.tmp"));
    let out = out_dir.join(MEMORY_FILE);
    let res = (|| {
        q.execute("stop", None)?;
        // Root's, mode 0600: QEMU (an unprivileged uid) writes it only through the
        // descriptor passed below.
        let _ = std::fs::remove_file(&tmp);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| NodeError::io(format!("create {}", tmp.display()), e))?;
        q.execute(
            "migrate-set-parameters",
            Some(json!({ "max-bandwidth": 1u64 << 40 })),
        )?;
        q.execute_with_fd("getfd", Some(json!({ "fdname": "sandlot-mem" })), f.as_fd())?;
        q.execute("migrate", Some(json!({ "uri": "fd:sandlot-mem" })))?;
        q.wait_migration(Instant::now() + MIGRATE_TIMEOUT)?;
        f.sync_all()
            .map_err(|e| NodeError::io(format!("fsync {}", tmp.display()), e))?;
        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
        std::fs::rename(&tmp, &out)
            .map_err(|e| NodeError::io(format!("rename {}", tmp.display()), e))?;
        if let Ok(d) = std::fs::File::open(out_dir) {
            let _ = d.sync_all();
        }
        Ok(size)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
        let _ = q.execute("cont", None);
    }
    res
}

/// `migrate-incoming` from the saved state at `path` into the QEMU of `q` (started with
/// `-incoming defer`), then `cont`.
pub(crate) fn load_memory(q: &mut Qmp, path: &Path) -> NodeResult<()> {
    let f = std::fs::File::open(path)
        .map_err(|e| NodeError::io(format!("open {}", path.display()), e))?;
    q.execute_with_fd("getfd", Some(json!({ "fdname": "sandlot-mem" })), f.as_fd())?;
    q.execute("migrate-incoming", Some(json!({ "uri": "fd:sandlot-mem" })))?;
    q.wait_migration(Instant::now() + MIGRATE_TIMEOUT)?;
    q.execute("cont", None)?;
    Ok(())
}

/// Best effort after a node crash: `cont` a QEMU that a pause stopped but did not finish,
/// and drop a partial or stale memory file.
pub(crate) fn continue_if_stopped(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(format!("{MEMORY_FILE}.tmp")));
    let _ = std::fs::remove_file(dir.join(MEMORY_FILE));
    let Ok(mut q) = Qmp::connect(
        &dir.join(QMP_SOCK),
        Instant::now() + Duration::from_secs(2),
        Duration::from_secs(5),
    ) else {
        return;
    };
    let running = q
        .execute("query-status", None)
        .ok()
        .and_then(|v| v.get("running").and_then(serde_json::Value::as_bool));
    if running == Some(false) {
        let _ = q.execute("migrate_cancel", None);
        let _ = q.execute("cont", None);
    }
}

/// Start time of `pid` whatever its state, zombies included: a multi-threaded QEMU's leader
/// is a zombie while its other threads still exit and hold its descriptors (its sockets).
fn starttime_any_state(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// SIGKILL to QEMU `pid` (when it is still the process started at `start`), waiting up to
/// 10 s until it is gone entirely (reaped: every thread exited, every descriptor closed).
pub(crate) fn kill_and_wait(pid: i32, start: u64) {
    if starttime_any_state(pid) != Some(start) {
        return;
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while starttime_any_state(pid) == Some(start) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One VM whose memory [`pause`] saves and [`resume`] restores: the parts of a `microvm`
/// or `vm` sandbox these steps use.
pub(crate) struct Target<'a> {
    /// Backend name for logs (`microvm`, `vm`).
    pub backend: &'static str,
    /// The VM directory (`QMP_SOCK`, `agent.sock`, `MEMORY_FILE`, `state.json`).
    pub dir: PathBuf,
    /// The QEMU binary.
    pub qemu: &'a Path,
    /// QEMU's cgroup (a resumed QEMU starts in it).
    pub cgroup: &'a SandboxCgroup,
    /// Its state as created, `qemu_args` the command line a resume starts (plus
    /// `-incoming defer`); `state.json` is rewritten from it with the current QEMU.
    pub state: VmState,
    /// The sandbox's delete flag (read side held throughout).
    pub deleting: &'a RwLock<bool>,
    /// The sandbox's paused flag.
    pub paused: &'a AtomicBool,
    /// The agent link that survives.
    pub relay: &'a Arc<Relay>,
    /// The guest's agent (its clock is set after a resume).
    pub agent: &'a AgentClient,
    /// The QEMU it runs in now.
    pub proc_: &'a ProcCell,
    /// How a resumed QEMU is confined: the sandbox's uid (`state.qemu_uid`, the same as
    /// before the pause) and the sockets the node binds and hands over; they must match
    /// `state.qemu_args` (fd-based `-chardev`s with a uid, path-based for a root QEMU).
    pub jail: Jail,
    /// The snapshot directory in the shared store ([`super::store`]) where a pause writes
    /// the memory file instead of `dir`, and where a resume finds it when `dir` has none;
    /// a resume removes it once the VM runs. `None`: no shared store (or a backend that
    /// does not use one).
    pub snapshot: Option<PathBuf>,
}

impl Target<'_> {
    /// Where the saved memory of this VM is: its own directory's, else the snapshot
    /// directory's.
    pub fn memory_file(&self) -> PathBuf {
        let local = self.dir.join(MEMORY_FILE);
        match &self.snapshot {
            Some(s) if !local.is_file() => s.join(MEMORY_FILE),
            _ => local,
        }
    }
}

impl Target<'_> {
    /// `state.json` with the current QEMU.
    pub fn write_current_state(&self) -> NodeResult<()> {
        let p = *self.proc_.lock().unwrap();
        let st = VmState {
            qemu_pid: p.pid,
            qemu_starttime: p.start,
            memory_saved: p.saved,
            ..self.state.clone()
        };
        write_json(&self.dir.join("state.json"), &st)
    }
}

/// Pause with memory (see the module docs). Pausing a paused VM is a no-op. The caller
/// holds the VM's lifecycle lock (pause, resume and checkpoints one at a time).
///
/// # Errors
/// `NotFound` (being deleted), `Conflict` (QEMU gone), `Unavailable` (the agent link does
/// not drain), `Internal` (QMP or file failures; the VM keeps running).
pub(crate) async fn pause(t: &Target<'_>) -> NodeResult<()> {
    let id = t.state.id.as_str();
    let guard = t.deleting.read().await;
    if *guard {
        return Err(NodeError::NotFound(format!(
            "sandbox {id} is being deleted"
        )));
    }
    if t.paused.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(());
    }
    let cur = *t.proc_.lock().unwrap();
    if !cur.exists() {
        return Err(NodeError::Conflict(format!(
            "sandbox {id} is not running (its QEMU {} is gone)",
            cur.pid
        )));
    }
    t.paused.store(true, std::sync::atomic::Ordering::SeqCst);
    let started = Instant::now();
    if let Err(e) = t.relay.hold().await {
        t.paused.store(false, std::sync::atomic::Ordering::SeqCst);
        return Err(e);
    }
    let dir = t.dir.clone();
    let out_dir = t.snapshot.clone().unwrap_or_else(|| dir.clone());
    let size = match spawn_blocking(move || save_memory(&dir, &out_dir)).await {
        Ok(s) => s,
        Err(e) => {
            t.relay.release().await;
            // The guest ran on (`cont`) after standing still for the failed save.
            crate::backends::qemu::sync_clock(t.agent, id, t.backend).await;
            t.paused.store(false, std::sync::atomic::Ordering::SeqCst);
            return Err(e);
        }
    };
    let saved_ms = started.elapsed().as_millis() as u64;
    t.relay.detach().await;
    t.proc_.lock().unwrap().saved = true;
    t.write_current_state()?;
    spawn_blocking(move || {
        kill_and_wait(cur.pid, cur.start);
        Ok(())
    })
    .await?;
    tracing::info!(sandbox = %id, backend = t.backend, ms = started.elapsed().as_millis() as u64, save_ms = saved_ms, bytes = size, "sandbox paused (memory saved, QEMU stopped)");
    Ok(())
}

/// Resume a VM paused with memory (see the module docs). Resuming a running VM is a
/// no-op. On failure the VM stays paused with its memory file. The caller holds the VM's
/// lifecycle lock.
///
/// # Errors
/// `NotFound` (being deleted), `Internal` (QEMU or restore failures).
pub(crate) async fn resume(t: &Target<'_>) -> NodeResult<()> {
    let id = t.state.id.as_str();
    let guard = t.deleting.read().await;
    if *guard {
        return Err(NodeError::NotFound(format!(
            "sandbox {id} is being deleted"
        )));
    }
    if !t.paused.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(());
    }
    let started = Instant::now();
    let dir = t.dir.clone();
    let mut args = t.state.qemu_args.clone();
    args.extend(["-incoming".to_string(), "defer".to_string()]);
    // The last QEMU's sockets: a connect must reach the new QEMU's or fail (and retry).
    for f in [QMP_SOCK, "agent.sock"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let (pid, start) = spawn_qemu(t.qemu, &args, &dir, t.cgroup, true, &t.jail)?;
    let res: NodeResult<Option<UnixStream>> = async {
        let d = dir.clone();
        let q = spawn_blocking(move || {
            Ok(Qmp::connect(
                &d.join(QMP_SOCK),
                Instant::now() + QMP_START_TIMEOUT,
                Duration::from_secs(30),
            )?)
        })
        .await?;
        // QMP answers once QEMU's chardevs exist: the agent socket listens.
        let up = t.relay.reconnect().await?;
        let mut q = q;
        let mem = t.memory_file();
        spawn_blocking(move || load_memory(&mut q, &mem)).await?;
        Ok(up)
    }
    .await;
    let up = match res {
        Ok(up) => up,
        Err(e) => {
            spawn_blocking(move || {
                kill_and_wait(pid, start);
                Ok(())
            })
            .await?;
            return Err(NodeError::io(
                format!(
                    "restore {} {id} from {}: {e}; QEMU said: {}",
                    t.backend,
                    MEMORY_FILE,
                    tail_of(&dir.join("qemu.log"), 400)
                ),
                std::io::Error::other("restore failed"),
            ));
        }
    };
    let kept = up.is_some();
    if let Some(up) = up {
        t.relay.attach(up).await;
    }
    *t.proc_.lock().unwrap() = QemuProc {
        pid,
        start,
        saved: false,
    };
    t.write_current_state()?;
    let _ = std::fs::remove_file(dir.join(MEMORY_FILE));
    if let Some(s) = &t.snapshot {
        // The guest runs on from here: the snapshot is stale.
        let _ = std::fs::remove_dir_all(s);
    }
    if !kept {
        tokio::time::sleep(SETTLE_AFTER_RESTART).await;
    }
    // The guest's wall clock went on from the time of the pause.
    crate::backends::qemu::sync_clock(t.agent, id, t.backend).await;
    t.paused.store(false, std::sync::atomic::Ordering::SeqCst);
    drop(guard);
    tracing::info!(sandbox = %id, backend = t.backend, ms = started.elapsed().as_millis() as u64, agent_connection_kept = kept, "sandbox resumed (memory restored)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qmp::fake::{ok, FakeQmp, Received};
    use serde_json::Value;
    use std::io::Write;
    use tokio::net::UnixListener;

    /// QEMU's side of a migration to `fd:sandlot-mem`: the stream is written into the
    /// descriptor passed with `getfd`; `query-migrate` answers `active` once, then `last`.
    fn migrating_qemu(stream: &'static [u8], last: Value) -> crate::qmp::fake::Script {
        let mut polls = 0;
        Box::new(
            move |r: &Received, before: &[Received]| match r.name.as_str() {
                "migrate" => {
                    assert_eq!(r.args["uri"], "fd:sandlot-mem");
                    let getfd = before.iter().rev().find(|b| b.name == "getfd").unwrap();
                    assert_eq!(getfd.args["fdname"], "sandlot-mem");
                    let mut f = std::fs::File::from(getfd.fds[0].try_clone().unwrap());
                    f.write_all(stream).unwrap();
                    ok()
                }
                "query-migrate" => {
                    polls += 1;
                    if polls == 1 {
                        vec![json!({"return": {"status": "active"}})]
                    } else {
                        vec![json!({ "return": last.clone() })]
                    }
                }
                _ => ok(),
            },
        )
    }

    #[test]
    fn save_memory_stops_streams_to_a_temp_file_and_renames_it() {
        let d = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let qemu = FakeQmp::serve(
            &d.path().join(QMP_SOCK),
            migrating_qemu(b"QEVM state", json!({"status": "completed"})),
        );
        let size = save_memory(d.path(), out.path()).unwrap();
        assert_eq!(size, 10);
        assert_eq!(
            std::fs::read(out.path().join(MEMORY_FILE)).unwrap(),
            b"QEVM state"
        );
        assert!(!out.path().join(format!("{MEMORY_FILE}.tmp")).exists());
        assert_eq!(
            qemu.names(),
            [
                "qmp_capabilities",
                "stop",
                "migrate-set-parameters",
                "getfd",
                "migrate",
                "query-migrate",
                "query-migrate"
            ]
        );
    }

    #[test]
    fn a_failed_migration_leaves_no_file_and_continues_the_guest() {
        let d = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let qemu = FakeQmp::serve(
            &d.path().join(QMP_SOCK),
            migrating_qemu(
                b"QEVM half",
                json!({"status": "failed", "error-desc": "disk full"}),
            ),
        );
        let e = save_memory(d.path(), out.path()).unwrap_err();
        assert!(sandlot_node_api::chain(&e).contains("disk full"), "{e}");
        assert!(!out.path().join(MEMORY_FILE).exists());
        assert!(!out.path().join(format!("{MEMORY_FILE}.tmp")).exists());
        assert_eq!(qemu.names().last().map(String::as_str), Some("cont"));
    }

    #[test]
    fn continue_if_stopped_only_continues_a_stopped_guest() {
        for (running, expected) in [
            (
                false,
                vec!["qmp_capabilities", "query-status", "migrate_cancel", "cont"],
            ),
            (true, vec!["qmp_capabilities", "query-status"]),
        ] {
            let d = tempfile::tempdir().unwrap();
            std::fs::write(d.path().join(MEMORY_FILE), b"stale").unwrap();
            let qemu = FakeQmp::serve(
                &d.path().join(QMP_SOCK),
                Box::new(move |r: &Received, _: &[Received]| match r.name.as_str() {
                    "query-status" => vec![json!({"return": {"running": running}})],
                    _ => ok(),
                }),
            );
            continue_if_stopped(d.path());
            assert_eq!(qemu.names(), expected, "running: {running}");
            assert!(!d.path().join(MEMORY_FILE).exists());
        }
    }

    async fn read_some(s: &mut UnixStream, ms: u64) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        match tokio::time::timeout(Duration::from_millis(ms), s.read(&mut buf)).await {
            Ok(Ok(n)) => buf[..n].to_vec(),
            _ => Vec::new(),
        }
    }

    /// Bytes sent while held reach the NEW upstream after detach/reconnect/attach; the
    /// client's connection never breaks.
    #[tokio::test]
    async fn relay_keeps_the_connection_across_a_swap() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("agent.sock");
        let l1 = UnixListener::bind(&path).unwrap();
        let relay = Relay::new(path.clone());
        let mut c = (relay.connector())().await.unwrap();
        let (mut u1, _) = l1.accept().await.unwrap();
        c.write_all(b"hello").await.unwrap();
        assert_eq!(read_some(&mut u1, 2000).await, b"hello");
        u1.write_all(b"world").await.unwrap();
        assert_eq!(read_some(&mut c, 2000).await, b"world");

        relay.hold().await.unwrap();
        c.write_all(b"held").await.unwrap();
        assert!(
            read_some(&mut u1, 200).await.is_empty(),
            "held bytes leaked"
        );
        u1.write_all(b"late").await.unwrap();
        relay.detach().await;
        assert_eq!(read_some(&mut c, 2000).await, b"late");
        drop(u1);
        drop(l1);

        std::fs::remove_file(&path).unwrap();
        let l2 = UnixListener::bind(&path).unwrap();
        let up = relay
            .reconnect()
            .await
            .unwrap()
            .expect("a parked connection");
        let (mut u2, _) = l2.accept().await.unwrap();
        relay.attach(up).await;
        assert_eq!(read_some(&mut u2, 2000).await, b"held");
        u2.write_all(b"again").await.unwrap();
        assert_eq!(read_some(&mut c, 2000).await, b"again");
        assert!(relay.connected());
        drop(c);
        assert!(read_some(&mut u2, 2000).await.is_empty());
    }
}
