//! Whether a sandbox's processes are alive, told only from evidence.
//!
//! The server marks a sandbox `lost` when its node says it is dead, and `lost` is final: only
//! delete remains. So the node must never say "dead" because of an error of its own — a
//! `/proc` read that failed with `EMFILE` (the server ran out of file descriptors, e.g. under
//! a flood of idle connections), `ENFILE`, `ENOMEM`, `EACCES`. Such errors give
//! [`Liveness::Unknown`] with the reason; only evidence gives [`Liveness::Dead`]: no such
//! process (`ENOENT` on `/proc/PID/stat`, or `kill(PID, 0)` answering `ESRCH`), a zombie, or
//! the pid reused by another process (its start time differs).
//!
//! `proc(5)`: field 3 of `/proc/PID/stat` is the state, field 22 the start time in clock
//! ticks after boot; field 2 (`comm`) may hold spaces and `)`, so fields are counted after the
//! last `)`.
use nix::errno::Errno;
use std::io;

pub use sandlot_node_api::Liveness;

/// Liveness of process `pid` that started at `starttime` (clock ticks after boot, field 22
/// of `/proc/PID/stat`). A `pid` ≤ 0 (none recorded) is [`Liveness::Dead`].
pub fn proc_liveness(pid: i32, starttime: u64) -> Liveness {
    if pid <= 0 {
        return Liveness::Dead;
    }
    let read = std::fs::read_to_string(format!("/proc/{pid}/stat"));
    classify(pid, starttime, read, || {
        // kill(2) with signal 0 checks existence and needs no file descriptor.
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
    })
}

/// The decision of [`proc_liveness`] from the result of reading `/proc/PID/stat` and, when
/// that read failed with an error that proves nothing, an existence probe (`kill(PID, 0)`).
fn classify(
    pid: i32,
    starttime: u64,
    read: io::Result<String>,
    probe: impl FnOnce() -> Result<(), Errno>,
) -> Liveness {
    match read {
        Ok(s) => match parse_stat(&s) {
            Some((state, _)) if state == "Z" || state == "X" => Liveness::Dead,
            Some((_, start)) if start != starttime => Liveness::Dead,
            Some(_) => Liveness::Alive,
            None => Liveness::Unknown(format!("/proc/{pid}/stat unparsable")),
        },
        // The process is gone (ESRCH: it exited between open and read).
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            Liveness::Dead
        }
        Err(e) => match probe() {
            Err(Errno::ESRCH) => Liveness::Dead,
            _ => Liveness::Unknown(format!("read /proc/{pid}/stat: {e}")),
        },
    }
}

/// (state, start time) from the text of `/proc/PID/stat`.
fn parse_stat(s: &str) -> Option<(&str, u64)> {
    let rest = &s[s.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = *fields.first()?;
    let start = fields.get(22 - 3)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(state: &str, start: u64) -> String {
        // pid (comm with ') ' inside) state ppid … field 22 = start.
        let mut f: Vec<String> = vec![state.into()];
        f.extend((4..22).map(|i| i.to_string()));
        f.push(start.to_string());
        f.push("0".into());
        format!("42 (a) b) {}", f.join(" "))
    }

    /// A fake existence probe that must not be asked.
    fn probe_unused() -> Result<(), Errno> {
        panic!("probe asked although the read decided")
    }

    #[test]
    fn running_with_same_start_is_alive() {
        assert_eq!(
            classify(42, 7, Ok(stat("S", 7)), probe_unused),
            Liveness::Alive
        );
    }

    #[test]
    fn zombie_or_reused_pid_is_dead() {
        assert_eq!(
            classify(42, 7, Ok(stat("Z", 7)), probe_unused),
            Liveness::Dead
        );
        assert_eq!(
            classify(42, 7, Ok(stat("S", 8)), probe_unused),
            Liveness::Dead
        );
    }

    #[test]
    fn no_such_process_is_dead() {
        let enoent = io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(classify(42, 7, Err(enoent), probe_unused), Liveness::Dead);
        let esrch = io::Error::from_raw_os_error(libc::ESRCH);
        assert_eq!(classify(42, 7, Err(esrch), probe_unused), Liveness::Dead);
    }

    #[test]
    fn own_errors_are_unknown_not_dead() {
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOMEM, libc::EACCES] {
            let err = io::Error::from_raw_os_error(errno);
            // The fake probe says the process exists (or cannot say): unknown, never dead.
            for fake_probe in [Ok(()), Err(Errno::EPERM), Err(Errno::ENOMEM)] {
                let l = classify(42, 7, Err(io::Error::from_raw_os_error(errno)), || {
                    fake_probe
                });
                assert!(
                    matches!(&l, Liveness::Unknown(r) if r.contains(&err.to_string())),
                    "{l:?}"
                );
            }
        }
    }

    #[test]
    fn own_error_but_kernel_says_gone_is_dead() {
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(
            classify(42, 7, Err(emfile), || Err(Errno::ESRCH)),
            Liveness::Dead
        );
    }

    #[test]
    fn garbage_is_unknown() {
        assert!(matches!(
            classify(42, 7, Ok("nonsense".into()), probe_unused),
            Liveness::Unknown(_)
        ));
    }

    #[test]
    fn this_process_is_alive_and_a_free_pid_dead() {
        let me = std::process::id() as i32;
        let s = std::fs::read_to_string(format!("/proc/{me}/stat")).unwrap();
        let (_, start) = parse_stat(&s).unwrap();
        assert_eq!(proc_liveness(me, start), Liveness::Alive);
        assert_eq!(proc_liveness(me, start + 1), Liveness::Dead);
        assert_eq!(proc_liveness(0, 0), Liveness::Dead);
    }
}
