//! One exec through a guest agent, shared by the backends whose commands run behind
//! `sandlot-guest agent` (`container`, `microvm`, `vm`): send the request
//! ([`sandlot_guest::agent_proto::ExecRequest`]), relay output to the capture and the
//! caller's sink, pass signals to the agent's `/v1/signal`, and turn the exit frame into an
//! [`ExecResult`]; and the one file call that needs more than a call of the agent's
//! ([`file_size`]).
use super::exec_plan::ExecPlan;
use super::pause::check_live;
use super::saved::StoredSpec;
use crate::agent_client::{AgentClient, ExecChunk};
use crate::node::{ExecControl, ExecSink, NodeError, NodeResult};
use crate::output::Capture;
use sandlot_api::{ExecEvent, ExecRequest, ExecResult};
use sandlot_guest::agent_proto;
use sandlot_guest::spec::ExecStatus;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use tokio::sync::{watch, RwLock, RwLockReadGuard};

/// Past an exec's own timeout: how long the node waits for the agent's exit frame before it
/// gives up on the exec (the agent kills at the timeout itself).
const EXEC_GRACE: Duration = Duration::from_secs(10);

/// A sandbox's lifecycle as an exec checks it: its delete lock, kill signal and paused flag.
pub(super) type Life<'a> = (&'a RwLock<bool>, &'a watch::Sender<bool>, &'a AtomicBool);

/// What every exec through an agent starts with, after the checks every agent-backed
/// backend makes: the sandbox's delete lock held for reading (a delete waits for the exec),
/// its kill signal watched, and the exec's plan (its own pid namespace, no landlock: the
/// agent runs inside the sandbox already). `image_env` and `spec` are the sandbox's.
///
/// # Errors
/// `NotFound` (being deleted or killed), `Conflict` (paused), `InvalidArgument` (the
/// request's, see [`ExecPlan::build`]).
pub(super) async fn begin<'a>(
    id: &str,
    (deleting, killed, paused): Life<'a>,
    image_env: &[(String, String)],
    spec: &StoredSpec,
    req: &ExecRequest,
) -> NodeResult<(RwLockReadGuard<'a, bool>, watch::Receiver<bool>, ExecPlan)> {
    let killed = killed.subscribe();
    let guard = deleting.read().await;
    check_live(id, *guard || *killed.borrow(), paused)?;
    let mut plan = ExecPlan::build(image_env, spec, req)?;
    plan.spec.own_pid_ns = true;
    plan.spec.landlock = false;
    Ok((guard, killed, plan))
}

/// The sandbox an exec runs in, as the shared loop needs it.
pub(super) struct Target<'a> {
    /// Sandbox id (messages).
    pub id: &'a str,
    /// `container` or `microVM` (messages).
    pub kind: &'static str,
    /// Its agent.
    pub agent: &'a AgentClient,
    /// Its `pids_max` (the message of a spawn refused at the limit).
    pub pids_max: u64,
    /// Whether the sandbox as a whole is gone (its init or VMM died); asked when the
    /// stream ends without an exit frame.
    pub died: &'a (dyn Fn() -> bool + Send + Sync),
}

/// Runs `plan` in `t` (see module docs). `guard` (the sandbox's delete lock) is released
/// once the request is sent; `killed` turns true when the sandbox is deleted.
///
/// # Errors
/// `ResourceExhausted` at the process limit, `InvalidArgument` for a command the agent
/// refuses as the caller's fault, `Internal` when the agent fails or does not answer.
pub(super) async fn run<G>(
    t: Target<'_>,
    plan: ExecPlan,
    guard: G,
    killed: &mut watch::Receiver<bool>,
    sink: Option<ExecSink>,
    control: Option<ExecControl>,
) -> NodeResult<ExecResult> {
    let (more_stdin, signals, handle, labels) = match control {
        Some(ctl) => (ctl.stdin, Some(ctl.signals), Some(ctl.handle), ctl.labels),
        None => (None, None, None, None),
    };
    // A named exec without labels has no process record to forget it later: the agent
    // forgets it once its end is read (it keeps ended named execs until told).
    let forget_after = handle.clone().filter(|_| labels.is_none());
    let areq = agent_proto::ExecRequest {
        spec: plan.spec,
        timeout_ms: plan.timeout.as_millis() as u64,
        stdin: plan.stdin.is_some() || more_stdin.is_some(),
        handle: handle.clone(),
        labels,
    };
    let id = t.id;
    let stream = tokio::time::timeout(
        plan.timeout + EXEC_GRACE,
        t.agent
            .exec_streaming(&areq, plan.stdin.as_deref(), more_stdin),
    )
    .await
    .map_err(|_| {
        NodeError::io(
            format!("exec in {} {id}: the guest agent did not answer", t.kind),
            std::io::Error::other("agent timeout"),
        )
    })??;
    drop(guard);
    let deadline = tokio::time::Instant::now() + plan.timeout + EXEC_GRACE;
    let agent = t.agent;
    let result = relay(t, stream, plan.cap, deadline, killed, sink, signals, handle).await;
    if let Some(h) = forget_after {
        if let Err(e) = agent.forget_exec(&h).await {
            tracing::debug!(sandbox = id, handle = %h, error = %e, "agent did not forget an unlabelled named exec");
        }
    }
    result
}

/// The background execs sandbox `id`'s guest agent still holds and the highest number it
/// ever held ([`AgentClient::list_execs`]); none from an agent older than the table
/// (logged at debug).
///
/// # Errors
/// As [`AgentClient::list_execs`].
pub(super) async fn agent_execs(
    id: &str,
    agent: &AgentClient,
) -> NodeResult<crate::node::AgentExecs> {
    let Some(list) = agent.list_execs().await? else {
        tracing::debug!(sandbox = %id, "guest agent keeps no exec table (older agent)");
        return Ok(Default::default());
    };
    Ok(crate::node::AgentExecs {
        execs: list
            .execs
            .into_iter()
            .map(|e| crate::node::AgentExec {
                handle: e.handle,
                argv: e.argv,
                started_unix_ms: e.started_unix_ms,
                exit_code: e.exit_code,
                labels: e.labels,
            })
            .collect(),
        // Numbers past u32 are none this node gave.
        max_number: list.max_number.and_then(|n| u32::try_from(n).ok()),
    })
}

/// Takes up the named exec `r.handle` that the agent of `t` kept after the node that read
/// it went away (see [`AgentClient::attach`]; a 409 is asked again for a second,
/// [`AgentClient::attach_when_free`]): its offsets go to `r.offsets`, then it is
/// relayed as [`run`] relays a new one (the agent enforces the exec's own timeout; the
/// node waits at most the longest one plus the grace).
///
/// # Errors
/// `NotFound` (the agent has no such exec), `Conflict` (another connection still reads it
/// after a second), as
/// [`run`] otherwise.
pub(super) async fn reattach(
    t: Target<'_>,
    killed: &mut watch::Receiver<bool>,
    sink: Option<ExecSink>,
    r: crate::node::ExecReattach,
) -> NodeResult<ExecResult> {
    let (info, stream) = t.agent.attach_when_free(&r.handle).await?;
    let _ = r.offsets.send((info.stdout_offset, info.stderr_offset));
    let deadline = tokio::time::Instant::now()
        + Duration::from_secs_f64(sandlot_api::MAX_TIMEOUT_S)
        + EXEC_GRACE;
    // The node keeps no copy of a background process's output (its logs do).
    relay(
        t,
        stream,
        0,
        deadline,
        killed,
        sink,
        Some(r.signals),
        Some(r.handle),
    )
    .await
}

/// Relays `stream` (an exec's or an attach's frames) to the captures of `cap` bytes and
/// `sink`, delivers `signals` to `handle`, and turns its end into the result.
#[allow(clippy::too_many_arguments)]
async fn relay(
    t: Target<'_>,
    mut stream: crate::agent_client::ExecStream,
    cap: usize,
    deadline: tokio::time::Instant,
    killed: &mut watch::Receiver<bool>,
    sink: Option<ExecSink>,
    mut signals: Option<tokio::sync::mpsc::UnboundedReceiver<i32>>,
    handle: Option<String>,
) -> NodeResult<ExecResult> {
    let id = t.id;
    let mut out = Capture::new(cap);
    let mut err = Capture::new(cap);
    let exit = loop {
        let step = tokio::select! {
            c = stream.next() => Ok(c?),
            _ = tokio::time::sleep_until(deadline) => Ok(None),
            _ = killed.wait_for(|k| *k) => Ok(None),
            Some(sig) = async { match signals.as_mut() { Some(r) => r.recv().await, None => std::future::pending().await } } => Err(sig),
        };
        let chunk = match step {
            Ok(chunk) => chunk,
            Err(sig) => {
                if let Some(h) = &handle {
                    if let Err(e) = t.agent.signal(h, sig).await {
                        tracing::warn!(sandbox = %id, error = %e, "signal through the guest agent failed");
                    }
                }
                continue;
            }
        };
        match chunk {
            Some(ExecChunk::Output(is_out, data)) => {
                if is_out { &mut out } else { &mut err }.push(&data);
                if let Some(s) = &sink {
                    let ev = if is_out {
                        ExecEvent::stdout(&data)
                    } else {
                        ExecEvent::stderr(&data)
                    };
                    let _ = s.send(ev).await;
                }
            }
            Some(ExecChunk::Exit(x)) => break Some(x),
            None => break None,
        }
    };
    let mut res = ExecResult::default();
    match exit {
        Some(x) => {
            res.duration_ms = x.duration_ms;
            res.timed_out = x.timed_out;
            // A VM's agent counts its own cgroup's OOM kills (containers: the node's
            // cgroup counter, set by the caller).
            res.oom_killed = x.oom_kills.is_some_and(|n| n > 0);
            res.violations = super::violations_from_guest(x.violations);
            match x.status {
                ExecStatus::Exited { code } => res.exit_code = code,
                ExecStatus::Signaled { signal } => {
                    res.exit_code = 128 + signal;
                    res.signal = Some(signal);
                }
                ExecStatus::SetupFailed {
                    message,
                    user_error,
                    resource_exhausted,
                } => {
                    return Err(if resource_exhausted {
                        NodeError::ResourceExhausted(format!(
                            "sandbox is at its process limit (pids_max={}): {message}",
                            t.pids_max
                        ))
                    } else if user_error {
                        NodeError::InvalidArgument(message)
                    } else {
                        NodeError::io(
                            format!("exec in {} {id}: {message}", t.kind),
                            std::io::Error::other("exec set-up failed"),
                        )
                    })
                }
            }
        }
        // The agent died, the sandbox was deleted, or the agent missed its own deadline.
        None => {
            if *killed.borrow() || (t.died)() {
                // Deleted, or the whole sandbox died with the command (a runsc sandbox
                // OOM-killed as a whole): the command's own end, as SIGKILL.
                res.exit_code = 137;
                res.signal = Some(9);
            } else {
                return Err(NodeError::io(
                    format!(
                        "exec in {} {id}: the guest agent ended the stream without an exit",
                        t.kind
                    ),
                    std::io::Error::other("agent stream ended"),
                ));
            }
        }
    }
    res.set_output(&out.finish(), &err.finish());
    Ok(res)
}

/// Size of the regular file at `path` (absolute, or relative to `/workspace`) through the
/// agent's stat call.
///
/// # Errors
/// The agent's error; `InvalidArgument` for a directory or anything but a regular file.
pub(super) async fn file_size(agent: &AgentClient, path: &str) -> NodeResult<u64> {
    use sandlot_guest::sandbox_fs::FileKind;
    let st = agent.stat(path).await.map_err(crate::files::node_error)?;
    let abs = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{}/{path}", crate::files::WORKDIR)
    };
    match st.kind {
        FileKind::File => Ok(st.size),
        FileKind::Dir => Err(NodeError::InvalidArgument(format!("is a directory: {abs}"))),
        _ => Err(NodeError::InvalidArgument(format!(
            "not a regular file: {abs}"
        ))),
    }
}
