//! The function backend's fast exec path: a guest agent living inside the jail.
//!
//! On by default; `SANDLOT_FUNCTION_AGENT=0` turns it off (see [`enabled`] and
//! [`super::FunctionBackend::new`]): execs then always take the helper path. At a
//! re-adoption, and from the second exec of a sandbox without a live agent (cold-created
//! or handed over by the warm pool: its first exec takes the helper path, a pooled jail's
//! through its standby helper, so a one-exec sandbox such as `run_code`'s never pays for
//! an agent; adopted from an older node; whose agent died) the node starts `sandlot-guest agent --jail PID STARTTIME
//! --cgroup-procs FILE... --listen-fd 3` in the background. That launcher joins the
//! sandbox's cgroups and namespaces and its root, forks into its pid namespace and becomes
//! root of its user namespace (`sandlot-guest`'s `exec::enter_jail`): the agent then sits
//! inside every boundary of the jail except landlock and seccomp, which each exec's helper
//! applies before the command runs (exactly as the old path's helper does), and it holds
//! capabilities only over the sandbox's own user namespace.
//!
//! Execs then go over the agent protocol exactly as for containers ([`agent_exec::run`]):
//! the agent forks a prestarted `sandlot-guest exec --own-pid-ns` helper, already in the
//! sandbox's cgroup, so no cgroup write, setns or per-exec cgroup sits on the request path.
//! The per-exec process-tree kill is the exec's own pid namespace (its init dies with the
//! helper, and the kernel kills every process left in it); the timeout is the agent's; the
//! output cap is the node's; OOM kills are the delta of the sandbox cgroup's counter, as
//! for containers.
//!
//! Files: `agent.pid` (`PID STARTTIME` of the agent on the host, so a restarted node
//! knows whether it still lives), `agent.log` (its messages) and the socket
//! `DATA/sandboxes/<id>/agent.sock`, bound (mode 0600, root) and listened on by
//! the node, passed to the agent as fd 3. It lies outside the jail's root, so neither the
//! sandbox's commands nor another sandbox can reach it; the agent keeps the listener open,
//! so it survives a node restart and re-adoption reconnects to the same path.
//!
//! Until an agent answers, execs take the old path (a helper entering from outside), so
//! nothing depends on the agent being up.
use super::Jail;
use crate::agent_client::AgentClient;
use crate::backends::agent_exec;
use crate::node::{ExecControl, ExecSink, NodeError, NodeResult};
use crate::sys::{proc_starttime, spawn_blocking};
use sandlot_api::ExecResult;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tasks a sandbox's cgroup gets on top of its `pids_max` while execs go through the
/// agent: the agent's standing processes in the group (the agent, its zygote, its spare
/// helper and that helper's exec init), so that the sandbox's commands keep the budget
/// the spec gives them.
pub const EXTRA_PIDS: u64 = 4;

/// Whether `function` execs go through a guest agent in the jail: yes unless the
/// environment has `SANDLOT_FUNCTION_AGENT=0` (read once per backend, at its start).
pub fn enabled() -> bool {
    std::env::var_os("SANDLOT_FUNCTION_AGENT").is_none_or(|v| v != "0")
}

/// How long a new agent may take to answer its first ping.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long re-adoption waits for an agent left by the previous node process.
const REATTACH_TIMEOUT: Duration = Duration::from_millis(500);

/// A running agent: its client and its host pid and start time (field 22 of
/// `/proc/PID/stat`), which tell whether it still lives.
pub(super) struct Agent {
    pub(super) client: AgentClient,
    pid: i32,
    starttime: u64,
}

/// A jail's agent as a caller found it: the one the node started, or one found answering
/// in the jail's directory ([`answering`]).
pub(super) enum JailAgent {
    Held(Arc<Agent>),
    Found(AgentClient),
}

impl JailAgent {
    /// Its client.
    pub(super) fn client(&self) -> &AgentClient {
        match self {
            JailAgent::Held(a) => &a.client,
            JailAgent::Found(c) => c,
        }
    }
}

/// A jail's agent once it answered, and whether a start is under way.
#[derive(Default)]
pub(super) struct AgentSlot {
    agent: Mutex<Option<Arc<Agent>>>,
    starting: AtomicBool,
}

impl AgentSlot {
    /// The agent, if it answered and still lives; a dead one (OOM-killed, killed by the
    /// host) is forgotten, so the next [`kick`] starts a new one.
    pub(super) fn ready(&self) -> Option<Arc<Agent>> {
        let mut slot = self.agent.lock().unwrap();
        match slot.as_ref() {
            Some(a) if proc_starttime(a.pid) == Some(a.starttime) => Some(a.clone()),
            Some(_) => {
                *slot = None;
                None
            }
            None => None,
        }
    }
}

/// Host path of the agent socket of the sandbox in `dir`.
pub(super) fn socket_path(dir: &Path) -> PathBuf {
    dir.join("agent.sock")
}

/// Starts (or, when a previous node process left one, reconnects to) `jail`'s agent in the
/// background, unless it answers already or a start is under way. Failures are logged;
/// execs keep the old path then.
pub(super) fn kick(guest_bin: &Path, dir: &Path, jail: &Arc<Jail>) {
    if jail.agent.ready().is_some() || jail.agent.starting.swap(true, Ordering::SeqCst) {
        return;
    }
    let (bin, dir, jail) = (guest_bin.to_path_buf(), dir.to_path_buf(), jail.clone());
    tokio::spawn(async move {
        attach_now(&bin, &dir, &jail).await;
        jail.agent.starting.store(false, Ordering::SeqCst);
    });
}

async fn attach_now(guest_bin: &Path, dir: &Path, jail: &Arc<Jail>) {
    match start(guest_bin, dir, jail).await {
        Ok(Some(agent)) => {
            *jail.agent.agent.lock().unwrap() = Some(Arc::new(agent));
        }
        Ok(None) => {}
        // Deleted meanwhile: the agent went with the sandbox.
        Err(e) if *jail.killed.borrow() => {
            tracing::debug!(sandbox = %jail.state.saved.id, error = %e, "guest agent start cut short by a delete")
        }
        Err(e) => {
            tracing::warn!(sandbox = %jail.state.saved.id, error = %e, "no guest agent in the function sandbox; execs take the helper path")
        }
    }
}

/// See [`kick`]. `Ok(None)`: the sandbox is being deleted.
async fn start(guest_bin: &Path, dir: &Path, jail: &Arc<Jail>) -> NodeResult<Option<Agent>> {
    // Under the read side of the lifecycle lock, like an exec's set-up: a delete waits
    // until the agent is in the cgroup (and kills it with the rest), or comes first.
    let lock = jail.deleting.read().await;
    if *lock || *jail.killed.borrow() {
        return Ok(None);
    }
    let sock = socket_path(dir);
    let pid_file = dir.join("agent.pid");
    // Left by a previous node process: "PID STARTTIME".
    let previous = std::fs::read_to_string(&pid_file).ok().and_then(|s| {
        let mut it = s.split_ascii_whitespace();
        Some((
            it.next()?.parse::<i32>().ok()?,
            it.next()?.parse::<u64>().ok()?,
        ))
    });
    if let Some((pid, starttime)) = previous.filter(|(p, t)| proc_starttime(*p) == Some(*t)) {
        let client = AgentClient::new(&sock);
        if client
            .wait_ready(Instant::now() + REATTACH_TIMEOUT)
            .await
            .is_ok()
        {
            return Ok(Some(Agent {
                client,
                pid,
                starttime,
            }));
        }
    }
    let (init, init_start) = (jail.state.saved.init_pid, jail.state.saved.init_starttime);
    let procs: Vec<PathBuf> = jail.cgroup.group().procs_files();
    let (bin, d) = (guest_bin.to_path_buf(), dir.to_path_buf());
    // Room for the agent's standing processes, granted only now that it starts (a jail
    // without an agent keeps exactly the spec's `pids_max`), and taken back if it fails.
    let (cg, pids_max) = (jail.cgroup.clone(), jail.state.saved.spec.pids_max);
    let (pid, starttime) = spawn_blocking(move || {
        cg.set_pids_max(pids_max + EXTRA_PIDS)?;
        launch(&bin, &d, init, init_start, &procs).inspect_err(|_| {
            let _ = cg.set_pids_max(pids_max);
        })
    })
    .await?;
    drop(lock);
    let client = AgentClient::new(&sock);
    if let Err(e) = client.wait_ready(Instant::now() + READY_TIMEOUT).await {
        let _ = jail.cgroup.set_pids_max(jail.state.saved.spec.pids_max);
        return Err(e);
    }
    tracing::debug!(sandbox = %jail.state.saved.id, agent_pid = pid, "guest agent ready in the function sandbox");
    Ok(Some(Agent {
        client,
        pid,
        starttime,
    }))
}

/// Runs `plan` through `agent`, `jail`'s agent (see module docs).
///
/// # Errors
/// `NotFound` while the sandbox is being deleted; those of [`agent_exec::run`].
pub(super) async fn exec(
    jail: &Arc<Jail>,
    agent: &AgentClient,
    mut plan: super::ExecPlan,
    sink: Option<ExecSink>,
    control: Option<ExecControl>,
) -> NodeResult<ExecResult> {
    let id = &jail.state.saved.id;
    let mut killed = jail.killed.subscribe();
    let guard = jail.deleting.read().await;
    // `paused` again under the lock, as in the helper path's set-up.
    crate::backends::pause::check_live(id, *guard || *killed.borrow(), &jail.paused)?;
    // The agent's helpers run each command in a pid namespace of its own (their tree
    // kill); landlock, capabilities, uid and seccomp as in the helper path.
    plan.spec.own_pid_ns = true;
    plan.spec.cgroup_procs.clear();
    let oom_before = jail.cgroup.group().oom_kills();
    let (pid, start) = (jail.state.saved.init_pid, jail.state.saved.init_starttime);
    let died = move || proc_starttime(pid) != Some(start);
    let target = agent_exec::Target {
        id,
        kind: "function sandbox",
        agent,
        pids_max: jail.state.saved.spec.pids_max,
        died: &died,
    };
    let mut res = agent_exec::run(target, plan, guard, &mut killed, sink, control).await?;
    res.oom_killed = match (oom_before, jail.cgroup.group().oom_kills()) {
        (Some(a), Some(b)) => b > a,
        _ => false,
    };
    Ok(res)
}

/// Takes up the named exec `r.handle` that `agent` (`jail`'s) kept after the node that read
/// it went away (see [`agent_exec::reattach`]).
///
/// # Errors
/// Those of [`agent_exec::reattach`].
pub(super) async fn reattach(
    jail: &Arc<Jail>,
    agent: &AgentClient,
    sink: Option<ExecSink>,
    r: crate::node::ExecReattach,
) -> NodeResult<ExecResult> {
    let id = &jail.state.saved.id;
    let mut killed = jail.killed.subscribe();
    let (pid, start) = (jail.state.saved.init_pid, jail.state.saved.init_starttime);
    let died = move || proc_starttime(pid) != Some(start);
    let target = agent_exec::Target {
        id,
        kind: "function sandbox",
        agent,
        pids_max: jail.state.saved.spec.pids_max,
        died: &died,
    };
    agent_exec::reattach(target, &mut killed, sink, r).await
}

/// An agent that answers on `jail`'s socket under `dir` within [`REATTACH_TIMEOUT`] (one
/// left by a previous node process, found before the re-adoption's reconnect finished), or
/// `None`.
pub(super) async fn answering(dir: &Path) -> Option<AgentClient> {
    let sock = socket_path(dir);
    if !sock.exists() {
        return None;
    }
    let client = AgentClient::new(&sock);
    client
        .wait_ready(Instant::now() + REATTACH_TIMEOUT)
        .await
        .ok()
        .map(|()| client)
}

/// Starts the guest agent of the jail whose init is `init` (start time `init_start`) and
/// whose cgroups' `cgroup.procs` files are `procs`, serving on `dir/agent.sock`, and
/// records it in `dir/agent.pid`; returns its host pid and start time. Blocking (waits for
/// the launcher, a few ms). The agent may still be starting its runtime: wait for its ping.
///
/// # Errors
/// `Conflict` when the init is gone; `Internal` when the socket cannot be bound or the
/// launcher fails (its message from `dir/agent.log`).
pub(crate) fn launch(
    bin: &Path,
    d: &Path,
    init: i32,
    init_start: u64,
    procs: &[PathBuf],
) -> NodeResult<(i32, u64)> {
    let s = socket_path(d);
    let pf = d.join("agent.pid");
    if proc_starttime(init) != Some(init_start) {
        return Err(NodeError::Conflict(format!(
            "the sandbox's init {init} is gone"
        )));
    }
    let _ = std::fs::remove_file(&s);
    let listener = std::os::unix::net::UnixListener::bind(&s)
        .map_err(|e| NodeError::io(format!("bind {}", s.display()), e))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| NodeError::io(format!("chmod {}", s.display()), e))?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(d.join("agent.log"))
        .map_err(|e| NodeError::io(format!("create {}/agent.log", d.display()), e))?;
    let mut cmd = std::process::Command::new(bin);
    cmd.args([
        "agent",
        "--jail",
        &init.to_string(),
        &init_start.to_string(),
    ]);
    for p in procs {
        cmd.arg("--cgroup-procs").arg(p);
    }
    cmd.args(["--listen-fd", "3"])
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stderr(log);
    let fd = listener.as_raw_fd();
    // SAFETY: runs in the forked child before execve; dup2 and fcntl are
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if fd == 3 {
                let fl = libc::fcntl(3, libc::F_GETFD);
                if fl < 0 || libc::fcntl(3, libc::F_SETFD, fl & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // The launcher exits once the agent is forked into the sandbox, reporting its pid.
    let out = cmd
        .stdout(std::process::Stdio::piped())
        .output()
        .map_err(|e| NodeError::io(format!("spawn {} agent", bin.display()), e))?;
    let status = out.status;
    let agent_pid = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse::<i32>()
        .ok();
    if let (true, Some(p)) = (status.success(), agent_pid) {
        let t = proc_starttime(p).ok_or_else(|| {
            NodeError::io(
                format!(
                    "guest agent {p} ended at once; see {}/agent.log",
                    d.display()
                ),
                std::io::Error::other("agent died"),
            )
        })?;
        std::fs::write(&pf, format!("{p} {t}\n"))
            .map_err(|e| NodeError::io(format!("write {}", pf.display()), e))?;
        return Ok((p, t));
    }
    let log = std::fs::read_to_string(d.join("agent.log")).unwrap_or_default();
    Err(NodeError::io(
        format!("sandlot-guest agent --jail: {status}: {}", log.trim()),
        std::io::Error::other("agent launch failed"),
    ))
}
