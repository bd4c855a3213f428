//! `sandlot-guest`: the function backend's jail helper. `sandlot-guest init` builds a
//! sandbox and leaves its pid 1 running; `sandlot-guest exec` runs one command in it. The
//! JSON protocol is in [`sandlot_guest::spec`]. `init` and `exec` are single-threaded on
//! purpose: unshare(2) and setns(2) into a user namespace refuse multi-threaded callers.
//! `sandlot-guest agent` is the guest agent of containers (see `agent`); it only spawns
//! `exec` helpers, so its runtime threads never meet those calls.

mod agent;
mod agent_files;
mod agent_tunnel;
mod exec;
mod fsrules;
mod host;
mod init;
mod seccomp;
mod sys;
mod vm;
mod zygote;

fn main() {
    // pid 1 of a microVM: the kernel runs the initramfs's /init with no arguments.
    if std::process::id() == 1 && std::env::args().count() == 1 {
        std::process::exit(vm::main());
    }
    let code = match std::env::args().nth(1).as_deref() {
        Some("init") => init::main(),
        Some("exec") => match std::env::args().nth(2).as_deref() {
            Some("--zygote") => zygote::main(),
            flag => exec::main(flag == Some("--own-pid-ns")),
        },
        Some("agent") => agent::main(&std::env::args().skip(2).collect::<Vec<_>>()),
        _ => {
            eprintln!(
                "usage: sandlot-guest init   (InitSpec JSON on stdin, InitReady JSON on stdout)\n       \
                 sandlot-guest exec [--own-pid-ns]   (ExecSpec JSON on fd 3, ExecStatus JSON on fd 4)\n       \
                 sandlot-guest agent [--jail PID STARTTIME [--cgroup-procs FILE]...] --listen-fd N | --listen PATH   (guest agent, HTTP/2)"
            );
            2
        }
    };
    std::process::exit(code)
}
