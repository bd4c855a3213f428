//! Liveness under file-descriptor exhaustion (issue 25, item 1): with no descriptor left, a
//! live process reads as `Unknown` (never `Dead`), and a process that is gone still reads as
//! `Dead` (the `kill(pid, 0)` probe needs no descriptor). Its own test binary: it uses up
//! this process's descriptors.
use sandlot_node::liveness::proc_liveness;
use sandlot_node::Liveness;
use std::process::Command;

fn starttime(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 1..];
    rest.split_whitespace()
        .nth(22 - 3)
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn emfile_makes_liveness_unknown_not_dead() {
    let mut live = Command::new("sleep").arg("60").spawn().unwrap();
    let mut gone = Command::new("true").spawn().unwrap();
    let (live_pid, gone_pid) = (live.id() as i32, gone.id() as i32);
    let (live_start, gone_start) = (starttime(live_pid), starttime(gone_pid));
    gone.wait().unwrap(); // reaped: its pid is free
    assert_eq!(proc_liveness(live_pid, live_start), Liveness::Alive);

    // Use up every descriptor (the soft limit lowered so this is quick).
    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, 256, hard).unwrap();
    let mut hold = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hold.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                break;
            }
        }
    }
    let under = proc_liveness(live_pid, live_start);
    let gone_under = proc_liveness(gone_pid, gone_start);
    drop(hold);
    live.kill().unwrap();
    live.wait().unwrap();
    assert!(
        matches!(&under, Liveness::Unknown(r) if r.contains("Too many open files")),
        "{under:?}"
    );
    assert_eq!(gone_under, Liveness::Dead);
}
