//! Small host-side helpers shared by `init` and `exec`: joining cgroups and reading a
//! process's start time.

use std::io::Read;
use std::os::fd::AsFd;

use anyhow::{bail, Context, Result};
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::Mode;

/// Writes the caller's pid into each `cgroup.procs` file (cgroup v1 or v2; the format is
/// one decimal pid, cgroups(7)).
///
/// # Errors
/// The first file that cannot be written, with its path.
pub fn join_cgroups(files: &[String]) -> Result<()> {
    let pid = std::process::id().to_string();
    for f in files {
        std::fs::write(f, &pid).with_context(|| format!("joining cgroup: writing {pid} to {f}"))?;
    }
    Ok(())
}

/// Field 22 (`starttime`, clock ticks after boot) of a `/proc/PID/stat` line
/// (proc_pid_stat(5)). The command name (field 2) may contain spaces and parentheses, so
/// fields are counted after the last `)`.
pub fn parse_starttime(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")" come field 3 (state) onwards; field 22 is the 20th of those.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Reads the start time of the process whose `/proc/PID` directory `dir` is.
///
/// # Errors
/// The process is gone (ESRCH/ENOENT) or the file is malformed.
pub fn starttime_at(dir: impl AsFd, what: &str) -> Result<u64> {
    let fd = openat(
        dir,
        "stat",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening {what}/stat"))?;
    let mut s = String::new();
    std::fs::File::from(fd)
        .read_to_string(&mut s)
        .with_context(|| format!("reading {what}/stat"))?;
    match parse_starttime(&s) {
        Some(t) => Ok(t),
        None => bail!("{what}/stat: no starttime field in {s:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starttime_of_own_process_is_stable_and_parsed() {
        let a = std::fs::read_to_string("/proc/self/stat").unwrap();
        let t = parse_starttime(&a).unwrap();
        let dir = nix::fcntl::open(
            "/proc/self",
            OFlag::O_PATH | OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .unwrap();
        assert_eq!(starttime_at(&dir, "/proc/self").unwrap(), t);
    }

    #[test]
    fn command_names_with_parens_and_spaces() {
        let line = "42 (a) b (c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(parse_starttime(line), Some(98765));
        assert_eq!(parse_starttime("garbage"), None);
    }
}
