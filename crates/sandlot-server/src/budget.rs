//! Server-wide memory budget for file data read from sandboxes.
//!
//! A sandbox decides how big its files are, and a sparse file of any apparent size costs it
//! nothing (`truncate -s 256M f`), while reading it costs the server that much memory per
//! concurrent read. Every file read (`GET …/files`, trajectory steps, `run_code`
//! `fetch_files`) therefore reserves its size from one [`FileBudget`] — a semaphore counted
//! in [`UNIT`]s of 64 KiB, `ServerConfig::file_read_budget_bytes` in all (default 1 GiB) —
//! before the node reads it, and gives it back when the read returns. A read that cannot
//! get its share within `ServerConfig::file_read_budget_wait` answers 429
//! `resource_exhausted` (with `Retry-After`, see [`crate::error`]).
//!
//! [`BudgetNode`] applies the budget by wrapping the node, so every caller of
//! [`Node::read_file`] goes through it. A plain `GET …/files` and `run_code` keep the share
//! until their answer is sent ([`BudgetNode::read_file_held`]); a read logged as a
//! trajectory step holds it for the read only.
//!
//! **Exec output** (issue 25, item 4): a foreground exec (`POST …/exec`, streamed or not,
//! trajectory steps, `run_code`) keeps up to `max_output_bytes` per stream (up to 64 MiB
//! each) in server memory; 8 such execs took the server from 85 MB to 2.7 GB. Each one
//! therefore first reserves [`EXEC_SHARE_FACTOR`] (8) × its `max_output_bytes` (default
//! 1 MiB; two streams, each kept and then encoded in the answer) from a second
//! budget, `ServerConfig::exec_output_budget_bytes` (default 1 GiB, `sandlot up
//! --exec-output-budget-mib`), waiting at most `file_read_budget_wait`, else 429
//! `resource_exhausted` with `Retry-After`. The share is kept until the answer has been
//! sent ([`BudgetNode::exec_held`], [`exec_json_body`]; `run_code` keeps it until its
//! answer is handed over): giving it back when the node's exec returned let clients that
//! do not read their answers hold any number of encoded answers. Background processes
//! ([`Node::exec_controlled`]) are not covered: their retained output is capped per
//! process by the node.
use async_trait::async_trait;
use sandlot_api::{ExecRequest, ExecResult, FileEntry};
use sandlot_node_api::{
    ExecSink, Node, NodeError, NodeInfo, NodeResult, SandboxSpec, SandboxStatus,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes a foreground exec reserves per byte of its `max_output_bytes`: two streams, each
/// held as kept output and again, larger, in the JSON answer (UTF-8 text ~1×, base64
/// 1.33×, control bytes escaped as `\u00XX` up to 6×). Measured: 8 execs printing 64 MiB
/// of NUL bytes each took ~600 MiB of server memory apiece.
pub const EXEC_SHARE_FACTOR: u64 = 8;

/// Budget unit in bytes (64 KiB).
pub const UNIT: u64 = 64 << 10;

/// The byte budget of file data held in memory by reads.
#[derive(Debug)]
pub struct FileBudget {
    sem: Arc<Semaphore>,
    units: u32,
    wait: Duration,
    /// What the budget holds, for messages (`file read`, `exec output`).
    what: &'static str,
}

impl FileBudget {
    /// A budget of `total_bytes` (rounded up to [`UNIT`]s, at least one), waiting at most
    /// `wait` for a share.
    pub fn new(total_bytes: u64, wait: Duration) -> Self {
        Self::named("file read", total_bytes, wait)
    }

    /// As [`FileBudget::new`], naming what it holds in its messages.
    pub fn named(what: &'static str, total_bytes: u64, wait: Duration) -> Self {
        let units = total_bytes.div_ceil(UNIT).clamp(1, u32::MAX as u64 >> 3) as u32;
        FileBudget {
            sem: Arc::new(Semaphore::new(units as usize)),
            units,
            wait,
            what,
        }
    }

    /// Bytes free right now.
    pub fn available_bytes(&self) -> u64 {
        self.sem.available_permits() as u64 * UNIT
    }

    /// Reserve `bytes` (rounded up to units; at least one unit, at most the whole budget).
    /// Returns the permit and the bytes it covers.
    ///
    /// # Errors
    /// `ResourceExhausted` when the share is not free within the wait.
    pub async fn reserve(&self, bytes: u64) -> NodeResult<(OwnedSemaphorePermit, u64)> {
        let units = bytes.div_ceil(UNIT).clamp(1, self.units as u64) as u32;
        let exhausted = || {
            NodeError::ResourceExhausted(format!(
                "{} budget exhausted: {bytes} bytes not free within {:?} (server-wide budget {} bytes); retry later",
                self.what,
                self.wait,
                self.units as u64 * UNIT
            ))
        };
        match tokio::time::timeout(self.wait, self.sem.clone().acquire_many_owned(units)).await {
            Ok(Ok(p)) => Ok((p, units as u64 * UNIT)),
            Ok(Err(_)) | Err(_) => Err(exhausted()),
        }
    }
}

/// A [`Node`] whose reads take their size from a [`FileBudget`] first; every other call
/// goes straight to the wrapped node.
pub struct BudgetNode {
    inner: Arc<dyn Node>,
    budget: Arc<FileBudget>,
    exec_budget: Option<Arc<FileBudget>>,
}

impl BudgetNode {
    /// Wrap `inner` (file reads take from `budget`; execs take nothing).
    pub fn new(inner: Arc<dyn Node>, budget: Arc<FileBudget>) -> Self {
        BudgetNode {
            inner,
            budget,
            exec_budget: None,
        }
    }

    /// Foreground execs also reserve [`EXEC_SHARE_FACTOR`] × their `max_output_bytes` from
    /// `exec_budget`.
    pub fn with_exec_budget(mut self, exec_budget: Arc<FileBudget>) -> Self {
        self.exec_budget = Some(exec_budget);
        self
    }
}

impl BudgetNode {
    /// [`Node::read_file`] that also returns the budget share of the data, for a caller
    /// that keeps the bytes in memory after the read (an answer being sent): the share
    /// goes back when the permit is dropped.
    ///
    /// # Errors
    /// As [`Node::read_file`]; `ResourceExhausted` when the share is not free in time.
    pub async fn read_file_held(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<(Vec<u8>, OwnedSemaphorePermit)> {
        let size = self.inner.file_size(id, path).await?;
        if size > max_bytes {
            // The node refuses from st_size alone, before reading a byte.
            self.inner.read_file(id, path, max_bytes).await?;
            return Err(NodeError::InvalidArgument(format!(
                "file is {size} bytes; limit {max_bytes}: {path}"
            )));
        }
        let (permit, covered) = self.budget.reserve(size).await?;
        // Never read more than reserved: a file grown since the size check is refused
        // ("file is over N bytes"), not read beyond the budget.
        let data = self
            .inner
            .read_file(id, path, max_bytes.min(covered.max(size)))
            .await?;
        Ok((data, permit))
    }
}

/// Bytes of the file budget a streamed read or write holds while it runs (2 MiB): the
/// chunks in flight between the node and the client (the node's few
/// [`sandlot_node_api::STREAM_CHUNK`]s, hyper's buffers), whatever the file's size.
pub const STREAM_SHARE: u64 = 2 << 20;

impl BudgetNode {
    /// [`Node::read_file_stream`] holding [`STREAM_SHARE`] (at most the file's size) of the
    /// file budget until the stream is dropped.
    ///
    /// # Errors
    /// As [`Node::read_file_stream`]; `ResourceExhausted` when the share is not free in
    /// time.
    pub async fn read_stream_held(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        use futures::StreamExt;
        let size = self.inner.file_size(id, path).await?;
        let (permit, _) = self.budget.reserve(size.min(STREAM_SHARE)).await?;
        let s = self.inner.read_file_stream(id, path, max_bytes).await?;
        Ok(Box::pin(s.map(move |c| {
            let _held = &permit;
            c
        })))
    }
}

impl BudgetNode {
    /// [`Node::exec`] that also returns the exec output budget share (none without an exec
    /// budget), for a caller that keeps the result in memory after the exec — logs it,
    /// encodes and sends it ([`exec_json_body`]): the share goes back when the permit is
    /// dropped, so the output is charged for as long as the server holds it.
    ///
    /// # Errors
    /// As [`Node::exec`]; `ResourceExhausted` when the share is not free in time.
    pub async fn exec_held(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<(ExecResult, Option<OwnedSemaphorePermit>)> {
        let share = match &self.exec_budget {
            None => None,
            Some(b) => {
                let per_stream = req
                    .max_output_bytes
                    .unwrap_or(sandlot_node_api::DEFAULT_MAX_OUTPUT);
                Some(
                    b.reserve(per_stream.saturating_mul(EXEC_SHARE_FACTOR))
                        .await?
                        .0,
                )
            }
        };
        let r = self.inner.exec(id, req, sink).await?;
        Ok((r, share))
    }
}

/// Bytes of output text encoded per body chunk by [`exec_json_body`] (256 KiB of text; up
/// to 6× that once control characters are escaped as `\u00XX`).
const JSON_TEXT_CHUNK: usize = 256 << 10;

/// The JSON of an [`ExecResult`] (the same object `Json(r)` gives; `stdout` and `stderr`
/// come first) as a body encoded piece by piece while hyper sends it, keeping `share`
/// until the last piece was taken or the body dropped.
///
/// Encoding the whole answer at once held it twice — the result's text and its JSON, up to
/// 6× larger for control bytes (`\u0000`), with `Vec` growth on top — outside any budget
/// once the exec had returned its share: 8 execs printing 64 MiB of NUL bytes took the
/// server past its documented bound (issue 25 soak: peak RSS 2750 MiB). Now the JSON
/// exists 256 KiB of text at a time, and the text itself stays charged to the exec's
/// share until it has been sent.
pub fn exec_json_body(mut r: ExecResult, share: Option<OwnedSemaphorePermit>) -> axum::body::Body {
    let mut texts = vec![
        ("stdout", std::mem::take(&mut r.stdout)),
        ("stderr", std::mem::take(&mut r.stderr)),
    ];
    if let Some(b) = r.stdout_b64.take() {
        texts.push(("stdout_b64", b));
    }
    if let Some(b) = r.stderr_b64.take() {
        texts.push(("stderr_b64", b));
    }
    // The remaining fields (small); the text fields are left out of them.
    let mut rest = match serde_json::to_value(&r) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    rest.remove("stdout");
    rest.remove("stderr");
    let rest = serde_json::to_vec(&rest).unwrap_or_else(|_| b"{}".to_vec());
    let pieces = JsonPieces {
        texts: texts.into(),
        at: 0,
        opened: false,
        rest: Some(rest),
        first: true,
        _share: share,
    };
    axum::body::Body::from_stream(futures::stream::iter(
        pieces.map(Ok::<_, std::convert::Infallible>),
    ))
}

/// The pieces of [`exec_json_body`]: `{"k":"` per text field, its escaped text in chunks of
/// [`JSON_TEXT_CHUNK`], `"`, then the other fields and `}`.
struct JsonPieces {
    texts: std::collections::VecDeque<(&'static str, String)>,
    /// Byte offset into the front text.
    at: usize,
    /// The front text's key was written.
    opened: bool,
    rest: Option<Vec<u8>>,
    first: bool,
    _share: Option<OwnedSemaphorePermit>,
}

impl Iterator for JsonPieces {
    type Item = bytes::Bytes;

    fn next(&mut self) -> Option<bytes::Bytes> {
        if let Some((key, text)) = self.texts.front() {
            if !self.opened {
                self.opened = true;
                let sep = if std::mem::take(&mut self.first) {
                    "{"
                } else {
                    ","
                };
                return Some(format!("{sep}\"{key}\":\"").into());
            }
            if self.at < text.len() {
                let mut end = (self.at + JSON_TEXT_CHUNK).min(text.len());
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                let enc = bytes::Bytes::from(
                    serde_json::to_vec(&text[self.at..end]).unwrap_or_else(|_| b"\"\"".to_vec()),
                );
                self.at = end;
                // Without the quotes: each slice is escaped on its own (JSON escapes are per
                // character, and the slice ends on a character boundary).
                return Some(enc.slice(1..enc.len() - 1));
            }
            self.texts.pop_front();
            self.at = 0;
            self.opened = false;
            return Some(bytes::Bytes::from_static(b"\""));
        }
        let rest = self.rest.take()?;
        let body = rest.strip_prefix(b"{").unwrap_or(&rest);
        let mut out = Vec::with_capacity(body.len() + 1);
        if self.first || body == b"}" {
            // No text fields before (cannot happen: stdout is always there) or no others.
            out.extend_from_slice(if self.first { b"{" } else { b"" });
        } else {
            out.push(b',');
        }
        out.extend_from_slice(body);
        Some(out.into())
    }
}

#[async_trait]
impl Node for BudgetNode {
    fn info(&self) -> NodeInfo {
        self.inner.info()
    }

    async fn accel(&self) -> Option<String> {
        self.inner.accel().await
    }
    async fn process_spawn(
        &self,
        id: &str,
        req: sandlot_api::SpawnRequest,
    ) -> NodeResult<sandlot_api::Process> {
        self.inner.process_spawn(id, req).await
    }
    async fn process_list(&self, id: &str) -> NodeResult<Vec<sandlot_api::Process>> {
        self.inner.process_list(id).await
    }
    async fn process_get(&self, id: &str, pid: &str) -> NodeResult<sandlot_api::Process> {
        self.inner.process_get(id, pid).await
    }
    async fn process_output(
        &self,
        id: &str,
        pid: &str,
        cursor: sandlot_node_api::OutputCursor,
    ) -> NodeResult<sandlot_node_api::ProcessEvents> {
        self.inner.process_output(id, pid, cursor).await
    }
    async fn process_wait(
        &self,
        id: &str,
        pid: &str,
        timeout: std::time::Duration,
    ) -> NodeResult<sandlot_api::Process> {
        self.inner.process_wait(id, pid, timeout).await
    }
    async fn process_signal(&self, id: &str, pid: &str, signal: i32) -> NodeResult<()> {
        self.inner.process_signal(id, pid, signal).await
    }
    async fn process_stdin(
        &self,
        id: &str,
        pid: &str,
        data: bytes::Bytes,
        eof: bool,
    ) -> NodeResult<()> {
        self.inner.process_stdin(id, pid, data, eof).await
    }
    async fn process_resize(
        &self,
        id: &str,
        pid: &str,
        size: sandlot_api::PtySize,
    ) -> NodeResult<()> {
        self.inner.process_resize(id, pid, size).await
    }
    async fn process_remove(&self, id: &str, pid: &str) -> NodeResult<()> {
        self.inner.process_remove(id, pid).await
    }

    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()> {
        self.inner.create(spec).await
    }

    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        Ok(self.exec_held(id, req, sink).await?.0)
    }

    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: sandlot_node_api::ExecControl,
    ) -> NodeResult<ExecResult> {
        self.inner.exec_controlled(id, req, sink, control).await
    }

    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        self.inner.connect_port(id, port).await
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        Ok(self.read_file_held(id, path, max_bytes).await?.0)
    }

    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        self.inner.file_size(id, path).await
    }

    async fn write_file(&self, id: &str, path: &str, data: bytes::Bytes) -> NodeResult<()> {
        self.inner.write_file(id, path, data).await
    }

    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        self.inner
            .write_file_stream(id, path, body, max_bytes)
            .await
    }

    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        self.read_stream_held(id, path, max_bytes).await
    }

    async fn write_files_volatile(
        &self,
        id: &str,
        files: Vec<(String, bytes::Bytes)>,
    ) -> NodeResult<()> {
        self.inner.write_files_volatile(id, files).await
    }

    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        self.inner.list_dir(id, path).await
    }

    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        self.inner.remove_file(id, path).await
    }

    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        self.inner.stat_file(id, path).await
    }

    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        self.inner.make_dir(id, path, parents).await
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.inner.pause(id).await
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.inner.resume(id).await
    }
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.inner.pause_many(ids).await
    }
    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.inner.resume_many(ids).await
    }

    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        self.inner.adopt_snapshot(id).await
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        self.inner.delete(id).await
    }

    async fn list(&self) -> NodeResult<Vec<SandboxStatus>> {
        self.inner.list().await
    }

    async fn list_not_alive(&self) -> NodeResult<Vec<SandboxStatus>> {
        self.inner.list_not_alive().await
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        self.inner.readopt(keep).await
    }

    async fn checkpoint(
        &self,
        id: &str,
        checkpoint_id: &str,
    ) -> NodeResult<sandlot_node_api::CheckpointMeta> {
        self.inner.checkpoint(id, checkpoint_id).await
    }

    async fn create_from_checkpoint(
        &self,
        spec: &SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        self.inner.create_from_checkpoint(spec, checkpoint_id).await
    }

    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        self.inner.delete_checkpoint(checkpoint_id).await
    }

    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        self.inner.list_checkpoints().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_bytes(b: axum::body::Body) -> Vec<u8> {
        axum::body::to_bytes(b, usize::MAX).await.unwrap().to_vec()
    }

    /// The pieced body is the same JSON object `Json(r)` gives, for text with control
    /// characters, multi-byte characters across chunk edges, and base64 fields.
    #[tokio::test]
    async fn exec_json_body_is_the_result_json() {
        let mut r = ExecResult {
            exit_code: 3,
            ..Default::default()
        };
        // 'é' is 2 bytes: chunk edges fall inside characters and must move back.
        r.stdout = "aé\u{0}\"\\\n".repeat(JSON_TEXT_CHUNK / 3);
        r.stderr = String::new();
        r.stderr_b64 = Some("AAEC".into());
        let want = serde_json::to_value(&r).unwrap();
        let got: serde_json::Value =
            serde_json::from_slice(&body_bytes(exec_json_body(r.clone(), None)).await).unwrap();
        assert_eq!(got, want);
        let back: ExecResult = serde_json::from_value(got).unwrap();
        assert_eq!(back.stdout, r.stdout);
    }

    /// The budget share goes back only when the body is dropped or fully taken.
    #[tokio::test]
    async fn exec_json_body_keeps_the_share_until_sent() {
        let b = FileBudget::new(4 * UNIT, Duration::from_millis(10));
        let (permit, _) = b.reserve(4 * UNIT).await.unwrap();
        let body = exec_json_body(ExecResult::default(), Some(permit));
        assert!(b.reserve(UNIT).await.is_err());
        let v: serde_json::Value = serde_json::from_slice(&body_bytes(body).await).unwrap();
        assert_eq!(v["exit_code"], 0);
        assert_eq!(b.available_bytes(), 4 * UNIT);
    }
}
