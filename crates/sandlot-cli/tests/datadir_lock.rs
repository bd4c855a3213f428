//! One process per data directory (issue 25), with the real binary: `sandlot up` serving
//! on a directory; a second `sandlot up` and a `sandlot node` on it wait, then exit non-zero
//! naming the directory and the holder's pid, leaving the lock files as they were; the
//! first still serves. After a kill -9 of the first, a new `sandlot up` starts on the
//! directory at once (the kernel dropped the lock).
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{Proc, BIN};

/// `sandlot up` on `data` (port 0, no warm pools) and its address, once it listens.
fn start_up(data: &Path, images: &Path) -> (Proc, String) {
    let mut child = up_command(data, images)
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc(child, data.to_path_buf());
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("sandlot listening on http://")
        .unwrap_or_else(|| panic!("first line: {line:?}"))
        .to_owned();
    (proc, addr)
}

fn up_command(data: &Path, images: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["up", "--listen", "127.0.0.1:0"])
        .args(["--warm-pool", "0", "--container-warm-pool", "0"])
        .arg("--data-dir")
        .arg(data)
        .arg("--images-dir")
        .arg(images)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The status line of `GET /healthz` at `addr`.
fn healthz(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.lines().next().unwrap_or_default().to_owned()
}

/// Waits for `child`, started at `t0`, to exit (at most `limit` after `t0`): its status,
/// stderr and how long it ran.
fn wait_exit(
    mut child: Child,
    t0: Instant,
    limit: Duration,
) -> (std::process::ExitStatus, String, Duration) {
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (st, err, t0.elapsed());
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_second_process_on_a_data_dir_is_refused_and_a_crash_frees_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, images) = (tmp.path().join("data"), tmp.path().join("images"));
    let token = tmp.path().join("token");
    std::fs::write(&token, "t0ken\n").unwrap();
    let (first, addr) = start_up(&data, &images);
    let pid = first.0.id();
    assert!(healthz(&addr).contains(" 200 "), "{}", healthz(&addr));
    let locks =
        || ["node.lock", "server.lock"].map(|f| std::fs::read_to_string(data.join(f)).unwrap());
    assert_eq!(locks(), [format!("{pid}\n"), format!("{pid}\n")]);

    // Both at once: each waits ~10 s for the holder, then gives up.
    let t0 = Instant::now();
    let second_up = up_command(&data, &images).spawn().unwrap();
    let node = Command::new(BIN)
        .args(["node", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&token)
        .arg("--data-dir")
        .arg(&data)
        .arg("--images-dir")
        .arg(&images)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for (what, child) in [("up", second_up), ("node", node)] {
        let (st, err, took) = wait_exit(child, t0, Duration::from_secs(20));
        assert_eq!(st.code(), Some(1), "{what}: {st:?} {err}");
        assert!(
            took >= Duration::from_secs(9) && took < Duration::from_secs(15),
            "{what} exited after {took:?}: {err}"
        );
        for want in [
            "is in use by another sandlot process".to_owned(),
            format!("pid {pid}"),
            data.display().to_string(),
        ] {
            assert!(err.contains(&want), "{what}: {want:?} not in {err}");
        }
    }
    // Nothing of the first was touched; it still serves.
    assert_eq!(locks(), [format!("{pid}\n"), format!("{pid}\n")]);
    assert!(healthz(&addr).contains(" 200 "), "{}", healthz(&addr));

    // kill -9: the kernel drops the locks with the process; a new start does not wait.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    drop(first);
    let t0 = Instant::now();
    let (third, addr) = start_up(&data, &images);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "restart after kill -9 took {took:?}"
    );
    assert!(healthz(&addr).contains(" 200 "), "{}", healthz(&addr));
    assert_eq!(
        locks(),
        [format!("{}\n", third.0.id()), format!("{}\n", third.0.id())]
    );
}
