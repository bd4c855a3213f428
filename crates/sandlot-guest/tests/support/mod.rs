//! Shared helpers for the root-only integration tests: a cgroup of the test's own, a
//! sandbox started through the real `sandlot-guest init`, and execs through the real
//! `sandlot-guest exec` with the fd 3/4 protocol.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sandlot_guest::spec::{ExecSpec, ExecStatus, InitReady, InitSpec, Rlimit, Violation};

pub const BIN: &str = env!("CARGO_BIN_EXE_sandlot-guest");
pub const UID_BASE: u32 = 100_000;
pub const UID_COUNT: u32 = 65_536;
/// Debootstrapped python trees to try, in order: `$SANDLOT_PYTHON_ROOTFS`, the image
/// builder's cache, the hand-made one.
pub fn python_rootfs() -> Option<PathBuf> {
    std::env::var_os("SANDLOT_PYTHON_ROOTFS")
        .map(PathBuf::from)
        .into_iter()
        .chain([
            PathBuf::from("/var/cache/sandlot/python-bookworm"),
            PathBuf::from("/var/cache/sandlot/python-rootfs.tmp"),
        ])
        .find(|p| p.join("usr/bin/python3").exists())
}

/// Why the root-only tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (namespaces, overlayfs and cgroups need host root)".into());
    }
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs.contains("overlay") {
        return Some("overlayfs not in /proc/filesystems".into());
    }
    if busybox().is_none() {
        return Some("no static busybox at /bin/busybox or /usr/bin/busybox".into());
    }
    None
}

/// Prints the skip reason and returns true when the test must not run.
pub fn skip(test: &str) -> bool {
    match skip_reason() {
        Some(r) => {
            eprintln!("SKIPPED {test}: {r}");
            true
        }
        None => false,
    }
}

pub fn busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

fn poll<T>(deadline: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A cgroup of the test's own: one directory per v1 hierarchy (pids, memory) or one v2
/// directory. Removed on drop once empty.
pub struct TestCgroup {
    dirs: Vec<PathBuf>,
}

impl TestCgroup {
    pub fn new(tag: &str) -> Self {
        let name = format!("sandlot-guest-test-{}-{tag}", std::process::id());
        let root = Path::new("/sys/fs/cgroup");
        let dirs = if root.join("cgroup.controllers").exists() {
            vec![root.join(&name)]
        } else {
            ["pids", "memory"]
                .iter()
                .map(|c| root.join(c).join(&name))
                .filter(|d| d.parent().is_some_and(|p| p.exists()))
                .collect()
        };
        for d in &dirs {
            std::fs::create_dir(d).unwrap_or_else(|e| panic!("mkdir {}: {e}", d.display()));
        }
        Self { dirs }
    }

    pub fn procs_files(&self) -> Vec<String> {
        self.dirs
            .iter()
            .map(|d| d.join("cgroup.procs").to_string_lossy().into_owned())
            .collect()
    }

    pub fn pids(&self) -> Vec<i32> {
        let s = std::fs::read_to_string(self.dirs[0].join("cgroup.procs")).unwrap_or_default();
        s.lines().filter_map(|l| l.trim().parse().ok()).collect()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for d in &self.dirs {
            // Killed processes leave the cgroup only once reaped: retry for a while.
            let ok = poll(Duration::from_secs(5), || std::fs::remove_dir(d).ok());
            if ok.is_none() {
                eprintln!("warning: could not remove cgroup {}", d.display());
            }
        }
    }
}

/// Builds a busybox root file system in `dir`: /bin/busybox plus one symlink per applet,
/// and the usual empty directories. `/usr/owned` belongs to the sandbox's root (uid_base)
/// so that only landlock, not DAC, stops writes there.
pub fn make_busybox_rootfs(dir: &Path) {
    let bb = busybox().unwrap();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(&bb, bin.join("busybox")).unwrap();
    let list = Command::new(&bb).arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            let _ = std::os::unix::fs::symlink("busybox", bin.join(applet));
        }
    }
    for d in ["proc", "dev", "tmp", "etc", "root", "usr/owned", "mnt"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::write(dir.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    // /root as an id-shifted image would have it (the sandbox's root owns its home).
    for d in ["usr/owned", "root"] {
        std::os::unix::fs::chown(dir.join(d), Some(UID_BASE), Some(UID_BASE)).unwrap();
    }
}

/// A running sandbox. Drop kills its init and checks that none of its mounts leaked.
pub struct Sandbox {
    pub ready: InitReady,
    pub base: tempfile::TempDir,
    pub cgroup: TestCgroup,
    pub hostname: String,
}

/// What one exec produced.
#[derive(Debug)]
pub struct Output {
    pub status: ExecStatus,
    /// Denied syscalls the command attempted (the helper's seccomp reports).
    pub violations: Vec<Violation>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn code(&self) -> Option<i32> {
        match self.status {
            ExecStatus::Exited { code } => Some(code),
            _ => None,
        }
    }
}

impl Sandbox {
    /// Starts `sandlot-guest init` over `lower` (None: a fresh busybox rootfs).
    pub fn start(tag: &str, lower: Option<&Path>) -> Self {
        let base = tempfile::Builder::new()
            .prefix("sandlot-guest-test-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let b = base.path();
        let lowerdir = match lower {
            Some(l) => l.to_path_buf(),
            None => {
                make_busybox_rootfs(&b.join("lower"));
                b.join("lower")
            }
        };
        for d in ["upper", "work", "rootfs"] {
            std::fs::create_dir(b.join(d)).unwrap();
        }
        std::os::unix::fs::chown(b.join("upper"), Some(UID_BASE), Some(UID_BASE)).unwrap();
        let cgroup = TestCgroup::new(tag);
        let hostname = format!("sbx-{tag}");
        let spec = InitSpec {
            lowerdirs: vec![lowerdir.to_string_lossy().into_owned()],
            upperdir: b.join("upper").to_string_lossy().into_owned(),
            workdir: b.join("work").to_string_lossy().into_owned(),
            rootfs: b.join("rootfs").to_string_lossy().into_owned(),
            hostname: hostname.clone(),
            uid_base: UID_BASE,
            uid_count: UID_COUNT,
            cgroup_procs: cgroup.procs_files(),
            tmp_mib: 64,
            proc_views: Vec::new(),
        };
        let mut child = Command::new(BIN)
            .arg("init")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(&serde_json::to_vec(&spec).unwrap())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ready: InitReady = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("InitReady {:?}: {e}", String::from_utf8_lossy(&out.stdout))
        });
        Self {
            ready,
            base,
            cgroup,
            hostname,
        }
    }

    pub fn spec(&self, argv: &[&str]) -> ExecSpec {
        ExecSpec {
            init_pid: self.ready.pid,
            init_starttime: self.ready.starttime,
            cgroup_procs: self.cgroup.procs_files(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: vec![
                ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()),
                ("HOME".into(), "/root".into()),
            ],
            cwd: "/workspace".into(),
            uid: 0,
            gid: 0,
            rlimits: Vec::<Rlimit>::new(),
            own_pid_ns: false,
            landlock: true,
            stdin_null: false,
            pty: None,
        }
    }

    /// Runs `argv` in the sandbox as its root in /workspace.
    pub fn exec(&self, argv: &[&str]) -> Output {
        run_exec(&self.spec(argv))
    }

    /// `sh -c script`.
    pub fn sh(&self, script: &str) -> Output {
        self.exec(&["sh", "-c", script])
    }

    /// Host pids whose parent is the sandbox's init (its reparented orphans).
    pub fn init_children(&self) -> Vec<(i32, String)> {
        let mut v = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
                continue;
            };
            let ppid = field(&status, "PPid:");
            if ppid.as_deref() == Some(&self.ready.pid.to_string()) {
                v.push((pid, status));
            }
        }
        v
    }
}

/// First value of a `Key:\tvalue` line of /proc/PID/status.
pub fn field(status: &str, key: &str) -> Option<String> {
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l[key.len()..].split_whitespace().next().map(str::to_string))
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let pid = self.ready.pid;
        // SAFETY: kill with a plain pid and signal.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        let gone = poll(Duration::from_secs(5), || {
            (!Path::new(&format!("/proc/{pid}")).exists() && self.cgroup.pids().is_empty())
                .then_some(())
        });
        if gone.is_none() {
            eprintln!("warning: sandbox init {pid} still present after SIGKILL");
        }
        // No mount of the test paths may remain anywhere visible to the host.
        let base = self.base.path().to_string_lossy().into_owned();
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let leaked: Vec<&str> = info.lines().filter(|l| l.contains(&base)).collect();
        if !std::thread::panicking() {
            assert!(leaked.is_empty(), "mounts leaked to the host: {leaked:#?}");
        }
    }
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid 2-int array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors are fresh and owned here.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Duplicates `fd` to a number >= 10 (close-on-exec), so that dup2 onto 3 and 4 in the
/// child can never clobber the other source.
fn high(fd: &OwnedFd) -> OwnedFd {
    // SAFETY: fcntl on an open descriptor; the result is a fresh descriptor owned here.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 10) };
    assert!(n >= 10);
    // SAFETY: as above.
    unsafe { OwnedFd::from_raw_fd(n) }
}

/// Runs `sandlot-guest exec` with `spec` on fd 3 and collects fd 4, stdout and stderr.
pub fn run_exec(spec: &ExecSpec) -> Output {
    let (spec_r, spec_w) = pipe();
    let (st_r, st_w) = pipe();
    // Move the ends the child gets to fds >= 10; the originals must be closed here, or
    // the status pipe never reaches EOF.
    let (spec_r, st_w) = {
        let (a, b) = (high(&spec_r), high(&st_w));
        drop(spec_r);
        drop(st_w);
        (a, b)
    };
    let json = serde_json::to_vec(spec).unwrap();
    assert!(json.len() < 60_000, "spec must fit the pipe buffer");
    std::fs::File::from(spec_w).write_all(&json).unwrap();
    let (a, b) = (spec_r.as_raw_fd(), st_w.as_raw_fd());
    let mut cmd = Command::new(BIN);
    cmd.arg("exec")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: only dup2 (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(spec_r);
    drop(st_w);
    let out = child.wait_with_output().unwrap();
    let mut status = String::new();
    std::fs::File::from(st_r)
        .read_to_string(&mut status)
        .unwrap();
    assert!(
        out.status.success(),
        "exec helper exited {:?}; stderr {:?}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // fd 4: `violation` records (seccomp reports), then the ExecStatus.
    let mut violations = Vec::new();
    let mut last = None;
    for doc in serde_json::Deserializer::from_str(&status).into_iter::<serde_json::Value>() {
        let doc = doc.unwrap_or_else(|e| panic!("fd 4 {status:?}: {e}"));
        if doc["kind"] == "violation" {
            violations.push(serde_json::from_value::<Violation>(doc).unwrap());
        } else {
            last = Some(doc);
        }
    }
    let status: ExecStatus = last
        .ok_or_else(|| "no status".to_string())
        .and_then(|v| serde_json::from_value(v).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| {
            panic!(
                "ExecStatus {status:?}: {e}; stderr {:?}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    Output {
        status,
        violations,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Polls `f` until it returns true or `deadline` passes.
pub fn eventually(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    poll(deadline, || f().then_some(())).is_some()
}
