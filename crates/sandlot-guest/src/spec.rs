//! JSON specs exchanged between the node and `sandlot-guest`.
//!
//! * `sandlot-guest init`: reads one [`InitSpec`] as JSON on stdin; on success prints one
//!   [`InitReady`] line on stdout and exits 0 while the sandbox's pid 1 keeps running
//!   (re-parented away from the node); on failure prints the reason on stderr, exits
//!   non-zero and leaves no process behind (mounts live only in the dead mount namespace;
//!   the node removes directories and cgroups).
//! * `sandlot-guest exec`: reads one [`ExecSpec`] as JSON from file descriptor 3 (to EOF);
//!   its stdin, stdout and stderr become those of the command. On file descriptor 4 it
//!   writes a sequence of JSON documents: one [`Violation`] (`"kind": "violation"`) for
//!   each denied syscall the command attempted, as it happens, then one [`ExecStatus`]
//!   when the command has ended; then it exits 0. If it dies before the status (e.g. the
//!   node killed the exec cgroup on timeout), fd 4 reaches EOF without one; the
//!   violations written before still count ([`read_exec_status`]).
use serde::{Deserialize, Serialize};

/// How `sandlot-guest init` builds a sandbox. Paths are host paths.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitSpec {
    /// Read-only image layers, top-most first (overlayfs `lowerdir=` order).
    pub lowerdirs: Vec<String>,
    /// Per-sandbox writable layer (overlayfs `upperdir=`), owned by `uid_base`.
    pub upperdir: String,
    /// overlayfs `workdir=` on the same file system as `upperdir`.
    pub workdir: String,
    /// Empty directory where the overlay is mounted before pivot_root.
    pub rootfs: String,
    /// Host name inside the sandbox (uts namespace).
    pub hostname: String,
    /// Host uid/gid that uid/gid 0 inside maps to (`0 uid_base uid_count` in uid_map).
    pub uid_base: u32,
    /// Number of ids mapped.
    pub uid_count: u32,
    /// `cgroup.procs` files the init writes its own pid into before unsharing (one per
    /// cgroup v1 hierarchy, or the single v2 one), so that everything in the sandbox is
    /// accounted to the sandbox's cgroups.
    pub cgroup_procs: Vec<String>,
    /// Size of the tmpfs on /tmp (and /dev/shm), MiB.
    pub tmp_mib: u64,
    /// Per-sandbox stand-ins of `/proc` files, `(name, content)` (names from
    /// [`crate::procview::VIEW_FILES`]; see [`crate::procview::render`]): each is written
    /// to a private tmpfs and bound over `/proc/<name>`. Empty: the host's files show.
    #[serde(default)]
    pub proc_views: Vec<(String, String)>,
}

/// Printed by `sandlot-guest init` on success.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitReady {
    /// Host pid of the sandbox's pid 1.
    pub pid: i32,
    /// Its start time (field 22 of `/proc/PID/stat`, clock ticks since boot), to tell it
    /// from a later process that reuses the pid.
    pub starttime: u64,
}

/// One resource limit (setrlimit(2)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    /// Resource name: `nofile`, `core`, `fsize`, `stack`, `nproc`, `memlock`, `msgqueue`.
    pub resource: RlimitResource,
    /// Soft and hard limit (same value).
    pub value: u64,
}

/// Resources settable through [`Rlimit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RlimitResource {
    /// RLIMIT_NOFILE
    Nofile,
    /// RLIMIT_CORE
    Core,
    /// RLIMIT_FSIZE (bytes)
    Fsize,
    /// RLIMIT_STACK (bytes)
    Stack,
    /// RLIMIT_MEMLOCK (bytes)
    Memlock,
    /// RLIMIT_MSGQUEUE (bytes)
    Msgqueue,
    /// RLIMIT_NPROC (processes of the real uid). In `own_pid_ns` mode the exec init also
    /// applies it, without CAP_SYS_ADMIN/CAP_SYS_RESOURCE, before forking the command, so a
    /// sandbox at its limit refuses the exec (used where no pids cgroup sees the sandbox's
    /// processes, e.g. inside gVisor).
    Nproc,
}

/// How `sandlot-guest exec` runs one command inside a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecSpec {
    /// Host pid of the sandbox's pid 1 (from [`InitReady`]).
    pub init_pid: i32,
    /// Its start time, checked before joining (a stale pid gives an error status).
    pub init_starttime: u64,
    /// `cgroup.procs` files to join before entering the namespaces (the exec's own cgroups).
    pub cgroup_procs: Vec<String>,
    /// argv; `argv[0]` without a `/` is searched in `PATH` of `env`.
    pub argv: Vec<String>,
    /// Complete environment of the command, in order.
    pub env: Vec<(String, String)>,
    /// Working directory inside the sandbox.
    pub cwd: String,
    /// uid and gid inside the sandbox (0 = the sandbox's unprivileged root).
    pub uid: u32,
    /// gid inside the sandbox.
    pub gid: u32,
    /// Resource limits applied before execve.
    pub rlimits: Vec<Rlimit>,
    /// `false` (default, the function backend): join the namespaces of `init_pid` from the
    /// host. `true` (the guest agent inside a container or VM): `init_pid`,
    /// `init_starttime` and `cgroup_procs` are ignored; the helper is already inside the
    /// sandbox and runs the command in a fresh pid namespace of its own, whose init reaps
    /// and ends with the command, so the command's whole process tree ends with it (killing
    /// the helper with SIGKILL kills that tree too).
    #[serde(default)]
    pub own_pid_ns: bool,
    /// Apply the landlock ruleset (writes only beneath the scratch directories; default
    /// true). The container backend turns it off: its root may write its whole rootfs.
    #[serde(default = "default_true")]
    pub landlock: bool,
    /// Replace stdin with `/dev/null` before the command starts (default false: stdin as
    /// inherited). The guest agent starts its next helper ahead of time with a stdin pipe
    /// and sets this for an exec without stdin, so the command still sees `/dev/null`.
    #[serde(default)]
    pub stdin_null: bool,
    /// Run the command on a pseudo-terminal of this size, allocated inside the sandbox (its
    /// own devpts): the command's stdin, stdout and stderr are the terminal's slave (its
    /// controlling terminal, in a session of its own), and this process's stdout carries
    /// the terminal's output. This process's stdin is then framed ([`pty_frame_data`],
    /// [`pty_frame_resize`]), not raw. `None` (default): plain pipes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// Size of a pseudo-terminal, in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    /// Rows (lines), 1..=1000.
    pub rows: u16,
    /// Columns, 1..=1000.
    pub cols: u16,
}

/// Frame kind of terminal input bytes (see [`pty_frame_data`]).
pub const PTY_FRAME_DATA: u8 = b'D';
/// Frame kind of a terminal resize (see [`pty_frame_resize`]).
pub const PTY_FRAME_RESIZE: u8 = b'R';

/// A frame of the stdin of a PTY exec ([`ExecSpec::pty`]) carrying bytes typed into the
/// terminal. Format (Sandlot's own, node to helper): one kind byte, the payload length as a
/// little-endian u32, then the payload.
pub fn pty_frame_data(data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + data.len());
    v.push(PTY_FRAME_DATA);
    v.extend_from_slice(&(data.len() as u32).to_le_bytes());
    v.extend_from_slice(data);
    v
}

/// A frame of the stdin of a PTY exec that resizes the terminal (the command's foreground
/// process group gets SIGWINCH). Payload: rows then cols, little-endian u16 each.
pub fn pty_frame_resize(size: PtySize) -> Vec<u8> {
    let mut v = Vec::with_capacity(9);
    v.push(PTY_FRAME_RESIZE);
    v.extend_from_slice(&4u32.to_le_bytes());
    v.extend_from_slice(&size.rows.to_le_bytes());
    v.extend_from_slice(&size.cols.to_le_bytes());
    v
}

/// One decoded frame of a PTY exec's stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtyFrame {
    /// Bytes typed into the terminal.
    Data(Vec<u8>),
    /// New terminal size.
    Resize(PtySize),
}

/// Takes the complete frames off the front of `buf` (what is left is an incomplete frame).
///
/// # Errors
/// A message for an unknown frame kind, a resize payload that is not 4 bytes, or a frame
/// over 16 MiB.
pub fn pty_frames_take(buf: &mut Vec<u8>) -> Result<Vec<PtyFrame>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while buf.len() - at >= 5 {
        let kind = buf[at];
        let len = u32::from_le_bytes(buf[at + 1..at + 5].try_into().expect("4 bytes")) as usize;
        if len > 16 << 20 {
            return Err(format!("pty frame of {len} bytes is too large"));
        }
        if buf.len() - at - 5 < len {
            break;
        }
        let payload = &buf[at + 5..at + 5 + len];
        out.push(match kind {
            PTY_FRAME_DATA => PtyFrame::Data(payload.to_vec()),
            PTY_FRAME_RESIZE if len == 4 => PtyFrame::Resize(PtySize {
                rows: u16::from_le_bytes([payload[0], payload[1]]),
                cols: u16::from_le_bytes([payload[2], payload[3]]),
            }),
            k => return Err(format!("bad pty frame kind {k} (length {len})")),
        });
        at += 5 + len;
    }
    buf.drain(..at);
    Ok(out)
}

fn default_true() -> bool {
    true
}

/// Written by `sandlot-guest exec` on fd 4 when the command has ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExecStatus {
    /// The command exited with this code (127: not found, 126: not executable, with a
    /// message on the command's stderr).
    Exited {
        /// Exit code 0–255.
        code: i32,
    },
    /// The command was killed by this signal.
    Signaled {
        /// Signal number.
        signal: i32,
    },
    /// The exec could not be set up (sandbox gone, cwd missing, ...): an infrastructure
    /// error, not the program's verdict.
    SetupFailed {
        /// What failed, with the path or step.
        message: String,
        /// True when the cause is the caller's input (e.g. cwd does not exist), so the
        /// node answers `invalid_argument` rather than `internal`.
        user_error: bool,
        /// True when the sandbox's own processes used up its process limit (`fork` failed
        /// with `EAGAIN` inside the sandbox's pids cgroup), so the node answers
        /// `resource_exhausted`. Absent in older helpers' output (defaults to false).
        #[serde(default)]
        resource_exhausted: bool,
    },
}

/// A denied syscall a command attempted, reported by the seccomp supervisor of
/// `sandlot-guest exec` (`SECCOMP_RET_USER_NOTIF`, seccomp_unotify(2)); the call failed
/// with `EPERM` in the command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// Syscall name (`mount`, `bpf`, `socket`, ...).
    pub syscall: String,
    /// Syscall number on the sandbox's architecture (`arch`).
    pub nr: i32,
    /// Architecture of the call, as the kernel reports it (`AUDIT_ARCH_*`, e.g.
    /// 0xc000003e for x86_64).
    pub arch: u32,
    /// Pid of the caller in the exec helper's pid namespace (0 when not visible there).
    pub pid: u32,
    /// When the supervisor received the call, Unix milliseconds (the sandbox's clock).
    pub time_unix_ms: u64,
}

/// Most [`Violation`]s one exec reports; later attempts are still refused but not
/// reported one by one (a command looping on a denied call cannot flood the audit log).
pub const MAX_VIOLATIONS_PER_EXEC: usize = 64;

/// Reads what a `sandlot-guest exec` helper writes on its fd 4: [`Violation`]s go to
/// `violations` as they arrive (so they survive a timeout that cancels this future); the
/// [`ExecStatus`] is returned as soon as it is complete (a process that inherited the pipe
/// cannot delay it). `None` on EOF without a valid status (the helper was killed) or past
/// 1 MiB of garbage.
pub async fn read_exec_status(
    mut rx: tokio::net::unix::pipe::Receiver,
    violations: &std::sync::Mutex<Vec<Violation>>,
) -> Option<ExecStatus> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = match rx.read(&mut chunk).await {
            Ok(0) | Err(_) => 0,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        let mut docs = serde_json::Deserializer::from_slice(&buf).into_iter::<serde_json::Value>();
        let mut consumed = 0;
        loop {
            match docs.next() {
                Some(Ok(v)) => {
                    consumed = docs.byte_offset();
                    if v.get("kind").and_then(|k| k.as_str()) == Some("violation") {
                        if let Ok(x) = serde_json::from_value::<Violation>(v) {
                            let mut g = violations.lock().unwrap_or_else(|p| p.into_inner());
                            if g.len() < MAX_VIOLATIONS_PER_EXEC {
                                g.push(x);
                            }
                        }
                    } else {
                        return serde_json::from_value(v).ok();
                    }
                }
                Some(Err(e)) if e.is_eof() => break,
                Some(Err(_)) => return None,
                None => break,
            }
        }
        buf.drain(..consumed);
        if n == 0 || buf.len() > 1 << 20 {
            return None;
        }
    }
}

/// Signals `sandlot-guest exec` forwards to its command, Linux numbers (x86-64 and
/// aarch64): SIGHUP 1, SIGINT 2, SIGQUIT 3, SIGABRT 6, SIGUSR1 10, SIGUSR2 12, SIGALRM 14,
/// SIGTERM 15, SIGCONT 18, SIGTSTP 20, SIGWINCH 28 — every catchable signal a user sends a
/// job. A helper has them blocked from its start (its spawner blocks them before execve)
/// and delivers each it receives to the command's process group (function backend), or to
/// its exec init, which delivers it to the command's process group (`own_pid_ns`). SIGKILL
/// and SIGSTOP cannot be caught: SIGKILL is delivered by killing the helper (the whole
/// tree goes), SIGSTOP is not offered.
pub const FORWARDED_SIGNALS: [i32; 11] = [1, 2, 3, 6, 10, 12, 14, 15, 18, 20, 28];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pty_frames_round_trip_across_split_reads() {
        let size = PtySize {
            rows: 40,
            cols: 120,
        };
        let mut wire = pty_frame_data(b"ls\n");
        wire.extend(pty_frame_resize(size));
        wire.extend(pty_frame_data(b""));
        // Fed one byte at a time: frames come out whole, in order.
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for b in &wire {
            buf.push(*b);
            got.extend(pty_frames_take(&mut buf).unwrap());
        }
        assert!(buf.is_empty());
        assert_eq!(
            got,
            vec![
                PtyFrame::Data(b"ls\n".to_vec()),
                PtyFrame::Resize(size),
                PtyFrame::Data(Vec::new())
            ]
        );
    }

    #[test]
    fn bad_pty_frames_are_refused() {
        let mut bad_kind = vec![b'X', 0, 0, 0, 0];
        assert!(pty_frames_take(&mut bad_kind).is_err());
        let mut short_resize = vec![PTY_FRAME_RESIZE, 2, 0, 0, 0, 1, 2];
        assert!(pty_frames_take(&mut short_resize).is_err());
        let mut huge = vec![PTY_FRAME_DATA, 0xff, 0xff, 0xff, 0xff];
        assert!(pty_frames_take(&mut huge).is_err());
    }
}
