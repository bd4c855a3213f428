//! One exec request checked and turned into the spec `sandlot-guest exec` runs
//! ([`ExecPlan`]): by the `function` backend's helper directly, and through the guest agent
//! of a container, microVM or VM ([`super::agent_exec`]).
use super::saved::StoredSpec;
use crate::node::{NodeError, NodeResult};
use base64::Engine as _;
use sandlot_api::ExecRequest;
use sandlot_guest::spec::{ExecSpec, Rlimit, RlimitResource};
use std::time::Duration;

/// Default cap on kept bytes per stream (1 MiB).
pub use sandlot_node_api::DEFAULT_MAX_OUTPUT;
/// Largest accepted `max_output_bytes` (64 MiB).
pub const MAX_MAX_OUTPUT: u64 = 64 << 20;
/// Default exec timeout (60 s).
pub const DEFAULT_TIMEOUT_S: f64 = 60.0;
/// Limit on open files of every exec.
pub const NOFILE: u64 = 1024;

/// A validated exec, ready to hand to `sandlot-guest exec` (directly, or through the guest
/// agent of a container).
pub(crate) struct ExecPlan {
    pub(crate) spec: ExecSpec,
    pub(crate) stdin: Option<Vec<u8>>,
    pub(crate) timeout: Duration,
    pub(crate) cap: usize,
}

impl ExecPlan {
    /// Validates `req` against a sandbox with this image environment and spec; the
    /// returned spec has no target (`init_pid` 0).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad timeout, output cap, user, cmd, cwd, env or stdin.
    pub(crate) fn build(
        image_env: &[(String, String)],
        sandbox: &StoredSpec,
        req: &ExecRequest,
    ) -> NodeResult<ExecPlan> {
        let timeout_s = req.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        sandlot_api::check_timeout_s("timeout_s", timeout_s).map_err(NodeError::InvalidArgument)?;
        let cap = req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT);
        if cap > MAX_MAX_OUTPUT {
            return Err(NodeError::InvalidArgument(format!(
                "max_output_bytes must be at most {MAX_MAX_OUTPUT}, got {cap}"
            )));
        }
        match req.user.as_deref() {
            None | Some("root") => {}
            Some(u) => {
                return Err(NodeError::InvalidArgument(format!(
                "user {u:?} is not supported; only \"root\" (the sandbox's own unprivileged root)"
            )))
            }
        }
        let argv = req.cmd.to_argv();
        if argv.is_empty() || argv[0].is_empty() {
            return Err(NodeError::InvalidArgument("cmd must not be empty".into()));
        }
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(NodeError::InvalidArgument(
                "cmd must not contain NUL bytes".into(),
            ));
        }
        let cwd = req.cwd.clone().unwrap_or_else(|| "/workspace".to_string());
        if !cwd.starts_with('/') || cwd.contains('\0') {
            return Err(NodeError::InvalidArgument(format!(
                "cwd must be an absolute path, got {cwd:?}"
            )));
        }
        let mut env: Vec<(String, String)> = vec![
            (
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ),
            ("HOME".into(), "/root".into()),
            ("LANG".into(), "C.UTF-8".into()),
            ("TERM".into(), "xterm".into()),
        ];
        let layers: Vec<(String, String)> = image_env
            .iter()
            .cloned()
            .chain(sandbox.env.iter().map(|(k, v)| (k.clone(), v.clone())))
            .chain(req.env.iter().map(|(k, v)| (k.clone(), v.clone())))
            .collect();
        for (k, v) in layers {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(NodeError::InvalidArgument(format!(
                    "bad environment variable name or value: {k:?}"
                )));
            }
            match env.iter_mut().find(|(ek, _)| *ek == k) {
                Some(slot) => slot.1 = v,
                None => env.push((k, v)),
            }
        }
        let stdin = match &req.stdin_b64 {
            None => None,
            Some(b) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(b)
                    .map_err(|e| {
                        NodeError::InvalidArgument(format!("stdin_b64 is not base64: {e}"))
                    })?,
            ),
        };
        let mut spec = ExecSpec {
            init_pid: 0,
            init_starttime: 0,
            cgroup_procs: Vec::new(),
            argv,
            env,
            cwd,
            uid: 0,
            gid: 0,
            rlimits: vec![
                Rlimit {
                    resource: RlimitResource::Nofile,
                    value: NOFILE,
                },
                Rlimit {
                    resource: RlimitResource::Core,
                    value: 0,
                },
                Rlimit {
                    resource: RlimitResource::Fsize,
                    value: sandbox.disk_mib.saturating_mul(1 << 20),
                },
            ],
            own_pid_ns: false,
            landlock: true,
            stdin_null: false,
            pty: None,
        };
        // Terminal mode: the helper's stdin is framed (`pty_frame_data`) and always a pipe.
        let stdin = match req.pty {
            None => stdin,
            Some(size) => {
                size.validate().map_err(NodeError::InvalidArgument)?;
                spec.pty = Some(sandlot_guest::spec::PtySize {
                    rows: size.rows,
                    cols: size.cols,
                });
                Some(match stdin {
                    Some(d) if !d.is_empty() => sandlot_guest::spec::pty_frame_data(&d),
                    _ => Vec::new(),
                })
            }
        };
        Ok(ExecPlan {
            spec,
            stdin,
            timeout: Duration::from_secs_f64(timeout_s),
            cap: cap as usize,
        })
    }
}
