//! `FakeNode`: a **unit-test fake** of the [`Node`] trait, in memory, for router tests of
//! validation, error mapping, idempotency and stream framing. It runs nothing: "exec"
//! interprets a handful of argv shapes (`echo`, `exit N`, `sleep S`, `chunks N`,
//! `python3 main.py`, `g++ …`, `./main` or `./test`) so the server's own logic can be checked. Real
//! behaviour is tested against `LocalNode` end to end.
use async_trait::async_trait;
use bytes::Bytes;
use sandlot_api::{Backend, ExecEvent, ExecRequest, ExecResult, FileEntry, FileType, Output};
use sandlot_node_api::{
    ExecSink, Node, NodeError, NodeInfo, NodeResult, SandboxSpec, SandboxStatus,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

/// A fake checkpoint: the parent's spec and a copy of its files.
pub type FakeCheckpoint = (SandboxSpec, BTreeMap<String, Vec<u8>>);

/// The fake node; every field is there for tests to read or to steer it.
#[derive(Default)]
pub struct FakeNode {
    /// Live sandboxes and their files (path → content).
    pub sandboxes: Mutex<HashMap<String, BTreeMap<String, Vec<u8>>>>,
    /// How long each create takes.
    pub create_delay: Mutex<Duration>,
    /// Ids deleted, in order (also unknown ones).
    pub deleted: Mutex<Vec<String>>,
    /// Every create's spec, in order.
    pub creates: Mutex<Vec<SandboxSpec>>,
    /// Ids currently paused; exec and file calls on them answer `Conflict`.
    pub paused: Mutex<std::collections::HashSet<String>>,
    /// Ids whose processes "died": `list` reports them not alive.
    pub dead: Mutex<std::collections::HashSet<String>>,
    /// Ids whose liveness the node "cannot tell" (an error of its own), with the reason.
    pub unknown: Mutex<HashMap<String, String>>,
    /// Every exec that reached the node, as (sandbox id, argv).
    pub execs: Mutex<Vec<(String, Vec<String>)>>,
    /// Checkpoints: the parent's spec and a copy of its files.
    pub checkpoints: Mutex<HashMap<String, FakeCheckpoint>>,
    /// While set, `create`, `exec`, `delete` and `list` fail with
    /// [`NodeError::Transport`] and this message, as a remote node behind a broken link.
    pub link_down: Mutex<Option<String>>,
    /// Ports "inside" every sandbox, each the address of a real TCP listener of the test
    /// on the host: `connect_port` connects there (any other port: nothing listens).
    pub ports: Mutex<HashMap<u16, std::net::SocketAddr>>,
    /// Every `pause_many` / `resume_many` call, in order: (`"pause"` or `"resume"`, the
    /// number of ids it carried).
    pub bulk_calls: Mutex<Vec<(&'static str, usize)>>,
    /// Ids whose pause and resume fail (`Internal`, "freezer refused"), one by one or in
    /// bulk.
    pub refuse_freeze: Mutex<std::collections::HashSet<String>>,
    /// What `agent_execs` answers for every live sandbox: no execs, this highest number.
    pub agent_max_number: Mutex<Option<u32>>,
    /// Every `agent_forget` call, in order: (sandbox id, handle).
    pub agent_forgets: Mutex<Vec<(String, String)>>,
}

impl FakeNode {
    /// Ids of the live sandboxes, sorted.
    pub fn ids(&self) -> Vec<String> {
        let mut v: Vec<_> = self.sandboxes.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

    fn link(&self) -> NodeResult<()> {
        match &*self.link_down.lock().unwrap() {
            Some(m) => Err(NodeError::Transport(m.clone())),
            None => Ok(()),
        }
    }

    /// Pause (`paused`) or resume one sandbox: `NotFound` when unknown, `Internal` when in
    /// `refuse_freeze`.
    fn freeze(&self, id: &str, paused: bool) -> NodeResult<()> {
        if !self.sandboxes.lock().unwrap().contains_key(id) {
            return Err(NodeError::NotFound(format!("no sandbox {id}")));
        }
        if self.refuse_freeze.lock().unwrap().contains(id) {
            return Err(NodeError::internal(
                format!("freezer refused sandbox {id}"),
                None,
            ));
        }
        if paused {
            self.paused.lock().unwrap().insert(id.to_owned());
        } else {
            self.paused.lock().unwrap().remove(id);
        }
        Ok(())
    }

    fn files<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut BTreeMap<String, Vec<u8>>) -> T,
    ) -> NodeResult<T> {
        if self.paused.lock().unwrap().contains(id) {
            return Err(NodeError::Conflict(format!("sandbox is paused: {id}")));
        }
        let mut m = self.sandboxes.lock().unwrap();
        let files = m
            .get_mut(id)
            .ok_or_else(|| NodeError::NotFound(format!("no sandbox {id}")))?;
        Ok(f(files))
    }
}

fn result(code: i32, out: &[u8], err: &[u8], timed_out: bool) -> ExecResult {
    let mut r = ExecResult {
        exit_code: code,
        timed_out,
        duration_ms: 12.0,
        ..Default::default()
    };
    let o = |d: &[u8]| Output {
        data: d.to_vec(),
        total: d.len() as u64,
        truncated: false,
    };
    r.set_output(&o(out), &o(err));
    r
}

#[async_trait]
impl Node for FakeNode {
    /// Background processes: `echo …` (stdout, exit 0), `sleep N` (until N seconds or a
    /// signal: 128+n), `cat` (stdin to stdout until EOF, or a signal).
    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        mut control: sandlot_node_api::ExecControl,
    ) -> NodeResult<ExecResult> {
        self.files(id, |_| ())?;
        let argv = req.cmd.to_argv();
        let args: Vec<&str> = argv.iter().map(|s| s.as_str()).collect();
        let send = |ev: ExecEvent| {
            let sink = sink.clone();
            async move {
                if let Some(s) = sink {
                    let _ = s.send(ev).await;
                }
            }
        };
        let killed = |sig: i32| ExecResult {
            exit_code: 128 + sig,
            signal: Some(sig),
            ..Default::default()
        };
        match args.as_slice() {
            ["echo", rest @ ..] => {
                send(ExecEvent::stdout(
                    format!("{}\n", rest.join(" ")).as_bytes(),
                ))
                .await;
                Ok(ExecResult::default())
            }
            ["sleep", s] => {
                let d = Duration::from_secs_f64(s.parse().unwrap());
                tokio::select! {
                    _ = tokio::time::sleep(d) => Ok(ExecResult::default()),
                    Some(sig) = control.signals.recv() => Ok(killed(sig)),
                }
            }
            ["cat"] => {
                let mut stdin = control.stdin.take().expect("cat needs stdin");
                loop {
                    tokio::select! {
                        chunk = stdin.recv() => match chunk {
                            Some(b) => send(ExecEvent::stdout(&b)).await,
                            None => return Ok(ExecResult::default()),
                        },
                        Some(sig) = control.signals.recv() => return Ok(killed(sig)),
                    }
                }
            }
            _ => Err(NodeError::InvalidArgument(format!(
                "fake node: no background {argv:?}"
            ))),
        }
    }

    fn info(&self) -> NodeInfo {
        NodeInfo {
            name: "fake-node".into(),
            backends: vec![
                (Backend::Function, Ok(())),
                (Backend::Vm, Err("no kvm".into())),
            ],
            cgroup_version: "v1".into(),
            runtimes: Vec::new(),
            accel: None,
            warm_pools: Vec::new(),
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()> {
        self.link()?;
        if !["python", "busybox"].contains(&spec.image.as_str()) {
            return Err(NodeError::NotFound(format!("no image {:?}", spec.image)));
        }
        if spec.backend != Backend::Function {
            return Err(NodeError::Unavailable(format!(
                "backend {} not built",
                spec.backend
            )));
        }
        let d = *self.create_delay.lock().unwrap();
        tokio::time::sleep(d).await;
        self.creates.lock().unwrap().push(spec.clone());
        self.sandboxes
            .lock()
            .unwrap()
            .insert(spec.id.clone(), BTreeMap::new());
        Ok(())
    }

    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        self.link()?;
        let files = self.files(id, |f| f.clone())?;
        let argv = req.cmd.to_argv();
        self.execs
            .lock()
            .unwrap()
            .push((id.to_owned(), argv.clone()));
        let args: Vec<&str> = argv.iter().map(|s| s.as_str()).collect();
        let timeout = req.timeout_s.unwrap_or(60.0);
        let r = match args.as_slice() {
            ["echo", rest @ ..] => {
                result(0, format!("{}\n", rest.join(" ")).as_bytes(), b"", false)
            }
            ["exit", n] => result(n.parse().unwrap(), b"", b"bye", false),
            // A denied syscall, as the exec helper's seccomp supervisor reports it.
            ["mount", ..] => ExecResult {
                violations: vec![sandlot_api::Violation {
                    layer: "seccomp".into(),
                    syscall: "mount".into(),
                    nr: 165,
                    pid: 7,
                    time_unix_ms: 1_796_036_022_312,
                    ..Default::default()
                }],
                ..result(32, b"", b"mount: permission denied", false)
            },
            ["sleep", s] => {
                let s: f64 = s.parse().unwrap();
                if s > timeout {
                    tokio::time::sleep(Duration::from_secs_f64(timeout)).await;
                    result(137, b"", b"", true)
                } else {
                    tokio::time::sleep(Duration::from_secs_f64(s)).await;
                    result(0, b"", b"", false)
                }
            }
            ["chunks", n] => {
                let n: usize = n.parse().unwrap();
                let mut out = Vec::new();
                for i in 0..n {
                    let c = format!("line {i}\n");
                    out.extend_from_slice(c.as_bytes());
                    if let Some(s) = &sink {
                        let _ = s.send(ExecEvent::stdout(c.as_bytes())).await;
                    }
                }
                if let Some(s) = &sink {
                    let _ = s.send(ExecEvent::stderr(&[0xff, 0xfe])).await;
                }
                result(3, &out, &[0xff, 0xfe], false)
            }
            ["fail"] => {
                return Err(NodeError::io(
                    "spawn /x",
                    std::io::Error::from_raw_os_error(libc_enoent()),
                ))
            }
            ["python3", "main.py"] => {
                let code = String::from_utf8_lossy(&files["/workspace/main.py"]).into_owned();
                let stdin = req
                    .stdin_b64
                    .as_ref()
                    .map(|b| {
                        use base64::Engine;
                        base64::engine::general_purpose::STANDARD.decode(b).unwrap()
                    })
                    .unwrap_or_default();
                if code.contains("loop") {
                    result(137, b"", b"", true)
                } else if code.contains("raise") {
                    result(1, b"", b"Traceback", false)
                } else {
                    self.files(id, |f| {
                        f.insert("/workspace/out.txt".into(), b"made".to_vec())
                    })?;
                    result(0, &stdin, b"", false)
                }
            }
            ["g++", ..] => {
                let code = String::from_utf8_lossy(&files["/workspace/main.cpp"]).into_owned();
                if code.contains("syntax error") {
                    result(1, b"", b"main.cpp:1: error", false)
                } else {
                    result(0, b"", b"", false)
                }
            }
            ["./main"] | ["./test"] => result(0, b"42\n", b"", false),
            // Appends a line to /workspace/log and prints the line count: not idempotent,
            // so running it twice shows.
            ["append", line] => {
                let n = self.files(id, |f| {
                    let e = f.entry("/workspace/log".into()).or_default();
                    e.extend_from_slice(format!("{line}\n").as_bytes());
                    e.iter().filter(|b| **b == b'\n').count()
                })?;
                result(0, format!("{n}\n").as_bytes(), b"", false)
            }
            // Exit code from a file's content (`/workspace/code`, default 0): lets a test
            // make a replayed step end differently.
            ["code"] => {
                let c = files
                    .get("/workspace/code")
                    .map(|d| String::from_utf8_lossy(d).trim().parse().unwrap())
                    .unwrap_or(0);
                result(c, b"", b"", false)
            }
            ["big", n] => {
                let n: usize = n.parse().unwrap();
                result(0, &vec![b'x'; n], &[0xff; 3], false)
            }
            other => result(127, b"", format!("not found: {other:?}").as_bytes(), false),
        };
        Ok(r)
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        let data = self
            .files(id, |f| f.get(path).cloned())?
            .ok_or_else(|| NodeError::NotFound(format!("no file {path}")))?;
        if data.len() as u64 > max_bytes {
            return Err(NodeError::InvalidArgument(format!(
                "{path} is over {max_bytes} bytes"
            )));
        }
        Ok(data)
    }

    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        self.files(id, |f| f.get(path).map(|d| d.len() as u64))?
            .ok_or_else(|| NodeError::NotFound(format!("no file {path}")))
    }

    /// A real TCP connection to the test's listener mapped to `port` in
    /// [`FakeNode::ports`] (for any running sandbox).
    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        self.files(id, |_| ())?;
        let addr = self.ports.lock().unwrap().get(&port).copied();
        let Some(addr) = addr else {
            return Err(NodeError::Unavailable(format!(
                "{} {port} in sandbox {id}",
                sandlot_node_api::PORT_NOT_LISTENING
            )));
        };
        let s = tokio::net::TcpStream::connect(addr).await.map_err(|e| {
            NodeError::Unavailable(format!(
                "{} {port}: {e}",
                sandlot_node_api::PORT_NOT_LISTENING
            ))
        })?;
        Ok(Box::new(s))
    }

    async fn write_file(&self, id: &str, path: &str, data: Bytes) -> NodeResult<()> {
        if path.contains("..") {
            return Err(NodeError::InvalidArgument(format!("path {path:?} escapes")));
        }
        self.files(id, |f| f.insert(path.to_owned(), data.to_vec()))?;
        Ok(())
    }

    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        let prefix = format!("{}/", path.trim_end_matches('/'));
        self.files(id, |f| {
            f.iter()
                .filter_map(|(p, d)| {
                    let name = p.strip_prefix(&prefix)?;
                    Some(FileEntry {
                        name: name.to_owned(),
                        kind: FileType::File,
                        size: d.len() as u64,
                        mode: 0o644,
                        mtime: 0,
                        link_target: None,
                    })
                })
                .collect()
        })
    }

    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        self.files(id, |f| f.remove(path))?
            .map(|_| ())
            .ok_or_else(|| NodeError::NotFound(format!("no file {path}")))
    }

    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        let prefix = format!("{}/", path.trim_end_matches('/'));
        let name = path.rsplit('/').next().unwrap_or(path).to_owned();
        self.files(id, |f| {
            if let Some(d) = f.get(path) {
                Some((FileType::File, d.len() as u64))
            } else if f.keys().any(|k| k.starts_with(&prefix)) {
                Some((FileType::Dir, 0))
            } else {
                None
            }
        })?
        .map(|(kind, size)| FileEntry {
            name,
            kind,
            size,
            mode: if kind == FileType::Dir { 0o755 } else { 0o644 },
            mtime: 0,
            link_target: None,
        })
        .ok_or_else(|| NodeError::NotFound(format!("no file {path}")))
    }

    async fn make_dir(&self, id: &str, path: &str, _parents: bool) -> NodeResult<()> {
        // Directories are implicit in the fake's flat map.
        if path.contains("..") {
            return Err(NodeError::InvalidArgument(format!("path {path:?} escapes")));
        }
        self.files(id, |_| ())
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.freeze(id, true)
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.freeze(id, false)
    }

    /// One call for all (recorded in `bulk_calls`), per-id results.
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.bulk_calls.lock().unwrap().push(("pause", ids.len()));
        ids.iter().map(|id| self.freeze(id, true)).collect()
    }

    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.bulk_calls.lock().unwrap().push(("resume", ids.len()));
        ids.iter().map(|id| self.freeze(id, false)).collect()
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        self.link()?;
        self.paused.lock().unwrap().remove(id);
        self.sandboxes.lock().unwrap().remove(id);
        self.deleted.lock().unwrap().push(id.to_owned());
        Ok(())
    }

    async fn list(&self) -> NodeResult<Vec<SandboxStatus>> {
        self.link()?;
        Ok(self
            .ids()
            .into_iter()
            .map(|id| SandboxStatus {
                liveness: if self.dead.lock().unwrap().contains(&id) {
                    sandlot_node_api::Liveness::Dead
                } else if let Some(r) = self.unknown.lock().unwrap().get(&id) {
                    sandlot_node_api::Liveness::Unknown(r.clone())
                } else {
                    sandlot_node_api::Liveness::Alive
                },
                id,
                backend: Backend::Function,
            })
            .collect())
    }

    async fn checkpoint(
        &self,
        id: &str,
        checkpoint_id: &str,
    ) -> NodeResult<sandlot_node_api::CheckpointMeta> {
        sandlot_node_api::check_checkpoint_id(checkpoint_id)?;
        // Unlike file calls, a checkpoint works on a paused sandbox.
        let files = self
            .sandboxes
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("no sandbox {id}")))?;
        let spec = self
            .creates
            .lock()
            .unwrap()
            .iter()
            .find(|s| s.id == id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("no sandbox {id}")))?;
        let meta = sandlot_node_api::CheckpointMeta {
            id: checkpoint_id.into(),
            sandbox_id: id.into(),
            backend: spec.backend,
            image: spec.image.clone(),
            runtime: spec.runtime.clone(),
            uid_base: None,
            disk_mib: spec.disk_mib,
            image_version: None,
            size_bytes: files.values().map(|v| v.len() as u64).sum(),
            created_at_ms: 1,
        };
        self.checkpoints
            .lock()
            .unwrap()
            .insert(checkpoint_id.into(), (spec, files));
        Ok(meta)
    }

    async fn create_from_checkpoint(
        &self,
        spec: &SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        let (parent, files) = self
            .checkpoints
            .lock()
            .unwrap()
            .get(checkpoint_id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(format!("no checkpoint {checkpoint_id}")))?;
        if parent.backend != spec.backend || parent.image != spec.image {
            return Err(NodeError::InvalidArgument(
                "backend or image mismatch".into(),
            ));
        }
        self.create(spec).await?;
        self.sandboxes
            .lock()
            .unwrap()
            .insert(spec.id.clone(), files);
        Ok(())
    }

    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        self.checkpoints.lock().unwrap().remove(checkpoint_id);
        Ok(())
    }

    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        Ok(self.checkpoints.lock().unwrap().keys().cloned().collect())
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let mut m = self.sandboxes.lock().unwrap();
        m.retain(|id, _| keep.contains(id));
        let mut v: Vec<_> = m.keys().cloned().collect();
        v.sort();
        Ok(v)
    }

    async fn agent_execs(&self, id: &str) -> NodeResult<sandlot_node_api::AgentExecs> {
        self.files(id, |_| ())?;
        Ok(sandlot_node_api::AgentExecs {
            execs: Vec::new(),
            max_number: *self.agent_max_number.lock().unwrap(),
        })
    }

    async fn agent_forget(&self, id: &str, handle: &str) -> NodeResult<()> {
        self.files(id, |_| ())?;
        self.agent_forgets
            .lock()
            .unwrap()
            .push((id.to_string(), handle.to_string()));
        Ok(())
    }
}

fn libc_enoent() -> i32 {
    2
}
