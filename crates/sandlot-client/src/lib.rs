//! Rust client of the Sandlot HTTP API v1 (`docs/openapi.json`, DESIGN.md "HTTP API v1").
//!
//! ```no_run
//! # async fn demo() -> Result<(), sandlot_client::ClientError> {
//! use sandlot_client::Client;
//! use sandlot_api::{Cmd, CreateSandboxRequest, ExecRequest};
//! let c = Client::new("http://127.0.0.1:7070")?;
//! let sb = c.create(&CreateSandboxRequest::default()).await?;
//! let r = c.exec(&sb.id, &ExecRequest::new(Cmd::Shell("echo hi".into()))).await?;
//! assert_eq!(r.stdout, "hi\n");
//! c.delete(&sb.id).await?;
//! # Ok(()) }
//! ```
//!
//! Every method maps to one route. Errors: [`ClientError::Api`] carries the server's decoded
//! `{"error": {"code", "message"}}` body (switch on [`ErrorCode`]); transport failures and
//! undecodable answers are the other variants.
#![deny(missing_docs)]

use bytes::Bytes;
use futures::{Stream, StreamExt};
use sandlot_api::{
    ApiError, BatchCreateRequest, BatchCreateResponse, Checkpoint, CheckpointList,
    CreateSandboxRequest, ErrorBody, ErrorCode, ExecEvent, ExecRequest, ExecResult, FileEntry,
    FileList, KeepaliveRequest, LabelSelector, PauseResult, Process, ProcessEvent, PtySize,
    RunCodeRequest, RunCodeResponse, Sandbox, SandboxList, SandboxState, SpawnRequest,
    TrajectoryInfo,
};

/// True when a file answer came from the trajectory log (`Sandlot-Replayed: true`).
fn replayed(resp: &reqwest::Response) -> bool {
    resp.headers()
        .get("sandlot-replayed")
        .is_some_and(|v| v.as_bytes() == b"true")
}
use serde::de::DeserializeOwned;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Sends of one create whose `Idempotency-Key` replay was rolled back before it finished
/// (see [`Client::create_idempotent`]); the Python SDK's `CREATE_ATTEMPTS`.
pub const CREATE_ATTEMPTS: usize = 3;
/// How long a create waits for a replayed `creating` sandbox to finish.
const CREATE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// Poll interval of that wait.
const CREATE_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Errors of client calls.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error body (HTTP status is `code.http_status()`).
    #[error("{0}")]
    Api(ApiError),
    /// The request could not be sent or the answer not read (connection refused, reset...).
    #[error("{url}")]
    Transport {
        /// Requested URL.
        url: String,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// The answer was not what the API promises (not JSON, unexpected status, bad line).
    #[error("bad response from {url}: {what}")]
    BadResponse {
        /// Requested URL.
        url: String,
        /// What was wrong.
        what: String,
    },
    /// The base URL does not parse.
    #[error("invalid base URL {0:?}")]
    BadUrl(String),
}

impl ClientError {
    /// The API error code, when the server answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api(e) => Some(e.code),
            _ => None,
        }
    }
}

/// Result of client calls.
pub type Result<T> = std::result::Result<T, ClientError>;

/// A stream of exec events: chunks, then one `exit` or `error` event.
pub type ExecStream = Pin<Box<dyn Stream<Item = Result<ExecEvent>> + Send>>;

/// A stream of a background process's output events (`GET …/processes/{pid}/output`):
/// chunks with their byte offsets, `skipped` gaps, then `exit` or `error` once it ended.
pub type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessEvent>> + Send>>;

/// Client of a Sandlot server, or of several replicas of one cluster. Cheap to clone
/// (connection pool and server list shared).
#[derive(Debug, Clone)]
pub struct Client {
    servers: Arc<Servers>,
    http: reqwest::Client,
}

/// The servers a client may send to (cluster mode: stateless `sandlot server` replicas,
/// each answering every route) and the one it uses now.
#[derive(Debug)]
struct Servers {
    urls: Vec<String>,
    current: AtomicUsize,
}

impl Servers {
    fn current(&self) -> &str {
        &self.urls[self.current.load(Ordering::Relaxed) % self.urls.len()]
    }

    /// Move past `failed` (compare-and-set: calls failing together on one server move the
    /// client one step); the index of the server to use now.
    fn fail_over(&self, failed: usize) -> usize {
        let next = (failed + 1) % self.urls.len();
        match self
            .current
            .compare_exchange(failed, next, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => next,
            Err(now) => now,
        }
    }
}

/// Whether sending a request again is safe after `e`: nothing reached the server (the
/// connection could not be set up), or the request is idempotent (GET, HEAD, PUT,
/// DELETE; RFC 9110 §9.2.2, or carrying an `Idempotency-Key`) and its connection broke
/// before the answer came. A timeout is not retried: the work may still be running.
fn resendable(e: &reqwest::Error, idempotent: bool) -> bool {
    e.is_connect() || (idempotent && e.is_request() && !e.is_timeout())
}

/// A fresh `Idempotency-Key` for a create the caller gave none, so a create resent after
/// a lost answer (or through another server) returns the first attempt's sandbox.
fn auto_idempotency_key() -> String {
    format!("client-{:032x}", rand::random::<u128>())
}

fn enc(s: &str) -> String {
    // RFC 3986 unreserved characters pass; everything else (including '/') is %-encoded.
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    /// A client of the server at `base_url`, e.g. `http://127.0.0.1:7070` (no trailing
    /// path), or of several replicas of one cluster separated by commas
    /// (`http://a:7070,http://b:7070`): calls go to the first, and a call whose connection
    /// fails moves to the next (at once, each server tried once per call). No request
    /// timeout is set: execs can last up to their own `timeout_s`.
    ///
    /// # Errors
    /// [`ClientError::BadUrl`] when an entry is not an `http(s)://` URL or none is given.
    pub fn new(base_url: &str) -> Result<Client> {
        let urls: Vec<String> = base_url
            .split(',')
            .map(|u| u.trim().trim_end_matches('/').to_owned())
            .filter(|u| !u.is_empty())
            .collect();
        if urls.is_empty()
            || !urls
                .iter()
                .all(|u| u.starts_with("http://") || u.starts_with("https://"))
        {
            return Err(ClientError::BadUrl(base_url.to_owned()));
        }
        Ok(Client {
            servers: Arc::new(Servers {
                urls,
                current: AtomicUsize::new(0),
            }),
            http: reqwest::Client::new(),
        })
    }

    /// This client, sending `Authorization: Bearer <key>` on every request (an API key
    /// `sk-…` from `sandlot key create`; needed once the server has keys).
    ///
    /// # Errors
    /// [`ClientError::BadResponse`] when the key is not a valid header value (control
    /// characters); [`ClientError::Transport`] when the HTTP client cannot be built.
    pub fn with_api_key(self, key: &str) -> Result<Client> {
        let mut v =
            reqwest::header::HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                ClientError::BadResponse {
                    url: self.base_url().to_owned(),
                    what: "API key holds characters not allowed in an HTTP header".into(),
                }
            })?;
        v.set_sensitive(true);
        let headers = reqwest::header::HeaderMap::from_iter([(reqwest::header::AUTHORIZATION, v)]);
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .build()
            .map_err(|source| ClientError::Transport {
                url: self.base_url().to_owned(),
                source,
            })?;
        Ok(Client {
            servers: self.servers,
            http,
        })
    }

    /// The base URL calls go to now (the first given until one fails).
    pub fn base_url(&self) -> &str {
        self.servers.current()
    }

    /// Every server URL, in the order given.
    pub fn server_urls(&self) -> &[String] {
        &self.servers.urls
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.servers.current(), path)
    }

    /// Send `rb` (built for `url`, which starts with one of the server URLs); when its
    /// connection fails and resending is safe ([`resendable`]), send it to the next server.
    async fn send(&self, url: &str, rb: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        let transport = |url: &str| {
            let url = url.to_owned();
            move |source| ClientError::Transport { url, source }
        };
        let mut req = rb.build().map_err(transport(url))?;
        let idempotent = matches!(req.method().as_str(), "GET" | "HEAD" | "PUT" | "DELETE")
            || req.headers().contains_key("idempotency-key");
        let urls = &self.servers.urls;
        // The longest server URL that prefixes `url` (one may prefix another).
        let mut at = urls
            .iter()
            .enumerate()
            .filter(|(_, b)| url.starts_with(b.as_str()))
            .max_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        let path = at.map(|i| url[urls[i].len()..].to_owned());
        let mut hops = 0;
        let resp = loop {
            let again = req.try_clone();
            let sent_to = req.url().to_string();
            match self.http.execute(req).await {
                Ok(resp) => break resp,
                Err(e) => {
                    let (Some(i), Some(path), Some(mut next)) = (at, path.as_deref(), again) else {
                        return Err(transport(&sent_to)(e));
                    };
                    if hops + 1 >= urls.len() || !resendable(&e, idempotent) {
                        return Err(transport(&sent_to)(e));
                    }
                    let j = self.servers.fail_over(i);
                    let to = format!("{}{path}", urls[j]);
                    *next.url_mut() =
                        reqwest::Url::parse(&to).map_err(|_| ClientError::BadUrl(to.clone()))?;
                    at = Some(j);
                    hops += 1;
                    req = next;
                }
            }
        };
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp
            .bytes()
            .await
            .map_err(|source| ClientError::Transport {
                url: url.to_owned(),
                source,
            })?;
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => Err(ClientError::Api(e.error)),
            Err(_) => Err(ClientError::BadResponse {
                url: url.to_owned(),
                what: format!("HTTP {status}: {}", String::from_utf8_lossy(&body)),
            }),
        }
    }

    async fn json<T: DeserializeOwned>(&self, url: &str, rb: reqwest::RequestBuilder) -> Result<T> {
        let resp = self.send(url, rb).await?;
        let body = resp
            .bytes()
            .await
            .map_err(|source| ClientError::Transport {
                url: url.to_owned(),
                source,
            })?;
        serde_json::from_slice(&body).map_err(|e| ClientError::BadResponse {
            url: url.to_owned(),
            what: e.to_string(),
        })
    }

    /// `POST /v1/sandboxes` → the new [`Sandbox`] (state `running`). Without a
    /// `trajectory` (whose create reattaches by itself) the call carries an
    /// `Idempotency-Key` of its own, so resending it after a lost answer never makes two.
    ///
    /// # Errors
    /// `invalid_argument` (ranges), `not_found` (image), `unavailable` (backend), ...
    pub async fn create(&self, req: &CreateSandboxRequest) -> Result<Sandbox> {
        if req.trajectory.is_none() {
            return self.create_idempotent(req, &auto_idempotency_key()).await;
        }
        let url = self.url("/v1/sandboxes");
        self.json(&url, self.http.post(&url).json(req)).await
    }

    /// `POST /v1/sandboxes` with an `Idempotency-Key`: retrying with the same key and
    /// request returns the same sandbox instead of creating another.
    ///
    /// A replay of a create still in flight (the first try went to a server that stopped
    /// during it) answers `creating`: this waits for it (polling `GET`, at most 60 s). When
    /// that create is rolled back meanwhile (`deleting`, `deleted`, `lost`, or gone: the
    /// rollback frees its key), the request is sent again with the same key, at most
    /// [`CREATE_ATTEMPTS`] times in all — as the Python SDK does.
    ///
    /// # Errors
    /// As [`create`](Self::create); `conflict` when the key was used with another request;
    /// `unavailable` when the create was rolled back on every attempt.
    pub async fn create_idempotent(
        &self,
        req: &CreateSandboxRequest,
        key: &str,
    ) -> Result<Sandbox> {
        let mut rolled_back = String::new();
        'attempt: for _ in 0..CREATE_ATTEMPTS {
            let url = self.url("/v1/sandboxes");
            let rb = self
                .http
                .post(&url)
                .header("Idempotency-Key", key)
                .json(req);
            let mut sb: Sandbox = self.json(&url, rb).await?;
            let deadline = tokio::time::Instant::now() + CREATE_WAIT;
            while sb.state == SandboxState::Creating && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(CREATE_POLL).await;
                match self.get(&sb.id).await {
                    Ok(now) => sb = now,
                    Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                        rolled_back = sb.id;
                        continue 'attempt;
                    }
                    Err(e) => return Err(e),
                }
            }
            if !matches!(
                sb.state,
                SandboxState::Deleting | SandboxState::Deleted | SandboxState::Lost
            ) {
                return Ok(sb);
            }
            rolled_back = sb.id;
        }
        Err(ClientError::Api(ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "the create of sandbox {rolled_back} was rolled back {CREATE_ATTEMPTS} times \
                 (a server stopped during it); try again"
            ),
        )))
    }

    /// `POST /v1/sandboxes:batch`: many creates in one call ([`BatchCreateRequest`]: one
    /// request times `count`, or a list of requests), with an `Idempotency-Key` of its own
    /// (item `i` gets `KEY#i`), so resending after a lost answer never makes two of an item.
    /// The answer has one [`sandlot_api::BatchItem`] per item, in request order; a failed
    /// item (over quota: 429 `resource_exhausted`) is in the answer, not an `Err`.
    ///
    /// # Errors
    /// `invalid_argument` for the batch as a whole (size outside 1..=1000, a bad `count`
    /// request), transport errors.
    pub async fn create_many(&self, req: &BatchCreateRequest) -> Result<BatchCreateResponse> {
        self.create_many_idempotent(req, &auto_idempotency_key())
            .await
    }

    /// [`create_many`](Self::create_many) with the caller's own batch key.
    ///
    /// # Errors
    /// As [`create_many`](Self::create_many).
    pub async fn create_many_idempotent(
        &self,
        req: &BatchCreateRequest,
        key: &str,
    ) -> Result<BatchCreateResponse> {
        let url = self.url("/v1/sandboxes:batch");
        let rb = self
            .http
            .post(&url)
            .header("Idempotency-Key", key)
            .json(req);
        self.json(&url, rb).await
    }

    /// `GET /v1/sandboxes/{id}`.
    ///
    /// # Errors
    /// `not_found`.
    pub async fn get(&self, id: &str) -> Result<Sandbox> {
        let url = self.url(&format!("/v1/sandboxes/{}", enc(id)));
        self.json(&url, self.http.get(&url)).await
    }

    /// `GET /v1/sandboxes?label=k=v...`: live sandboxes carrying every label, oldest first.
    ///
    /// # Errors
    /// Transport or API errors.
    pub async fn list(&self, labels: &[(&str, &str)]) -> Result<Vec<Sandbox>> {
        let q: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("label={}", enc(&format!("{k}={v}"))))
            .collect();
        let url = if q.is_empty() {
            self.url("/v1/sandboxes")
        } else {
            self.url(&format!("/v1/sandboxes?{}", q.join("&")))
        };
        let l: SandboxList = self.json(&url, self.http.get(&url)).await?;
        Ok(l.sandboxes)
    }

    /// `DELETE /v1/sandboxes/{id}`; succeeds also when the sandbox is already gone.
    ///
    /// # Errors
    /// Transport errors, or the node's error when the kill failed (the server retries).
    pub async fn delete(&self, id: &str) -> Result<()> {
        let url = self.url(&format!("/v1/sandboxes/{}", enc(id)));
        self.send(&url, self.http.delete(&url)).await.map(drop)
    }

    /// `POST /v1/sandboxes/{id}/checkpoints`: save the sandbox's writable layer; fork it with
    /// `CreateSandboxRequest { checkpoint: Some(ck.checkpoint_id), backend: ck.backend, .. }`.
    ///
    /// # Errors
    /// `not_found`, `conflict` (not running; a paused microVM), `unavailable` (backend).
    pub async fn checkpoint(&self, id: &str) -> Result<Checkpoint> {
        let url = self.url(&format!("/v1/sandboxes/{}/checkpoints", enc(id)));
        self.json(&url, self.http.post(&url)).await
    }

    /// `GET /v1/checkpoints`: this key's checkpoints, oldest first.
    ///
    /// # Errors
    /// Transport or API errors.
    pub async fn list_checkpoints(&self) -> Result<Vec<Checkpoint>> {
        let url = self.url("/v1/checkpoints");
        let l: CheckpointList = self.json(&url, self.http.get(&url)).await?;
        Ok(l.checkpoints)
    }

    /// `GET /v1/checkpoints/{checkpoint_id}`.
    ///
    /// # Errors
    /// `not_found`.
    pub async fn get_checkpoint(&self, checkpoint_id: &str) -> Result<Checkpoint> {
        let url = self.url(&format!("/v1/checkpoints/{}", enc(checkpoint_id)));
        self.json(&url, self.http.get(&url)).await
    }

    /// `DELETE /v1/checkpoints/{checkpoint_id}`; succeeds also when already gone.
    ///
    /// # Errors
    /// `conflict` while a create copies from it.
    pub async fn delete_checkpoint(&self, checkpoint_id: &str) -> Result<()> {
        let url = self.url(&format!("/v1/checkpoints/{}", enc(checkpoint_id)));
        self.send(&url, self.http.delete(&url)).await.map(drop)
    }

    /// `POST /v1/sandboxes/{id}/keepalive`: expiry = now + `ttl_s` (the sandbox's own TTL
    /// when `None`; 0 = no expiry).
    ///
    /// # Errors
    /// `not_found`, `conflict` (not running), `invalid_argument` (ttl over a week).
    pub async fn keepalive(&self, id: &str, ttl_s: Option<u64>) -> Result<Sandbox> {
        let url = self.url(&format!("/v1/sandboxes/{}/keepalive", enc(id)));
        self.json(&url, self.http.post(&url).json(&KeepaliveRequest { ttl_s }))
            .await
    }

    /// `POST /v1/sandboxes/{id}/exec` → [`ExecResult`] (waits for the command).
    ///
    /// # Errors
    /// `not_found`, `conflict`, `invalid_argument`; the program's own failure is in the
    /// result (`exit_code`, `timed_out`), not an error.
    pub async fn exec(&self, id: &str, req: &ExecRequest) -> Result<ExecResult> {
        let url = self.url(&format!("/v1/sandboxes/{}/exec", enc(id)));
        self.json(&url, self.http.post(&url).json(req)).await
    }

    /// `POST /v1/sandboxes/{id}/exec?stream=true` → a stream of [`ExecEvent`] parsed from
    /// NDJSON: `stdout`/`stderr` chunks as they come, then one `exit` (result without the
    /// text, byte totals kept) or `error` event.
    ///
    /// # Errors
    /// Errors before the exec starts are returned here; later ones arrive as `error`
    /// events or `Err` items (transport, bad line).
    pub async fn exec_stream(&self, id: &str, req: &ExecRequest) -> Result<ExecStream> {
        let url = self.url(&format!("/v1/sandboxes/{}/exec?stream=true", enc(id)));
        let resp = self.send(&url, self.http.post(&url).json(req)).await?;
        Ok(ndjson(url, resp.bytes_stream()))
    }

    fn process_url(&self, id: &str, pid: &str, suffix: &str) -> String {
        self.url(&format!(
            "/v1/sandboxes/{}/processes/{}{suffix}",
            enc(id),
            enc(pid)
        ))
    }

    /// `POST /v1/sandboxes/{id}/processes`: start a background process (a terminal
    /// session when `req.pty` is set) → its [`Process`] handle, state `running`.
    ///
    /// # Errors
    /// `invalid_argument` (command, sizes), `not_found`, `conflict` (sandbox paused or not
    /// running), `resource_exhausted` (16 processes already run, or `pids_max`).
    pub async fn spawn(&self, id: &str, req: &SpawnRequest) -> Result<Process> {
        let url = self.url(&format!("/v1/sandboxes/{}/processes", enc(id)));
        self.json(&url, self.http.post(&url).json(req)).await
    }

    /// `GET …/processes/{pid}/output?stdout_offset=O&stderr_offset=E&follow=F`: the output
    /// from those byte offsets; with `follow` the stream lasts until the process ends.
    ///
    /// # Errors
    /// `not_found` (sandbox or process), `invalid_argument` for an offset past the bytes
    /// written so far; transport errors (also mid-stream, as items).
    pub async fn process_output(
        &self,
        id: &str,
        pid: &str,
        (stdout_offset, stderr_offset): (u64, u64),
        follow: bool,
    ) -> Result<ProcessStream> {
        let url = self.process_url(
            id,
            pid,
            &format!(
                "/output?stdout_offset={stdout_offset}&stderr_offset={stderr_offset}&follow={follow}"
            ),
        );
        let resp = self.send(&url, self.http.get(&url)).await?;
        Ok(ndjson(url, resp.bytes_stream()))
    }

    /// `POST …/processes/{pid}/stdin[?eof=true]`: queue `data` (at most 1 MiB) for the
    /// process's stdin (keys typed into a terminal session); `eof` closes it after.
    ///
    /// # Errors
    /// `conflict` when stdin is not open, `deadline_exceeded` when the process has not
    /// read its stdin for 10 s, `payload_too_large` over 1 MiB.
    pub async fn process_stdin(
        &self,
        id: &str,
        pid: &str,
        data: impl Into<Bytes>,
        eof: bool,
    ) -> Result<()> {
        let url = self.process_url(id, pid, if eof { "/stdin?eof=true" } else { "/stdin" });
        self.send(&url, self.http.post(&url).body(data.into()))
            .await
            .map(drop)
    }

    /// `POST …/processes/{pid}/resize`: the terminal session's new size (its foreground
    /// process group gets SIGWINCH).
    ///
    /// # Errors
    /// `invalid_argument` for a process without a terminal or a size outside 1..=1000,
    /// `conflict` once it exited.
    pub async fn process_resize(&self, id: &str, pid: &str, size: PtySize) -> Result<()> {
        let url = self.process_url(id, pid, "/resize");
        self.send(&url, self.http.post(&url).json(&size))
            .await
            .map(drop)
    }

    /// `DELETE …/processes/{pid}`: SIGKILL to the whole process tree, then the handle is
    /// forgotten.
    ///
    /// # Errors
    /// `not_found` for an unknown sandbox or process.
    pub async fn delete_process(&self, id: &str, pid: &str) -> Result<()> {
        let url = self.process_url(id, pid, "");
        self.send(&url, self.http.delete(&url)).await.map(drop)
    }

    fn file_url(&self, id: &str, suffix: &str, path: &str) -> String {
        self.url(&format!(
            "/v1/sandboxes/{}/files{suffix}?path={}",
            enc(id),
            enc(path)
        ))
    }

    /// `PUT /v1/sandboxes/{id}/files?path=P`: write `data` atomically, creating parents.
    ///
    /// # Errors
    /// `payload_too_large` over the server's file limit (256 MiB by default),
    /// `invalid_argument` for a path escaping the sandbox.
    pub async fn write_file(&self, id: &str, path: &str, data: impl Into<Bytes>) -> Result<()> {
        let url = self.file_url(id, "", path);
        let rb = self
            .http
            .put(&url)
            .header("content-type", "application/octet-stream")
            .body(data.into());
        self.send(&url, rb).await.map(drop)
    }

    /// `GET /v1/sandboxes/{id}/files?path=P` → the file's bytes.
    ///
    /// # Errors
    /// `not_found`, `invalid_argument` (a directory, too large).
    pub async fn read_file(&self, id: &str, path: &str) -> Result<Bytes> {
        let url = self.file_url(id, "", path);
        let resp = self.send(&url, self.http.get(&url)).await?;
        resp.bytes()
            .await
            .map_err(|source| ClientError::Transport { url, source })
    }

    /// `GET /v1/sandboxes/{id}/files/list?path=P` → entries sorted by name.
    ///
    /// # Errors
    /// `not_found`, `invalid_argument` (not a directory).
    pub async fn list_files(&self, id: &str, path: &str) -> Result<Vec<FileEntry>> {
        let url = self.file_url(id, "/list", path);
        let l: FileList = self.json(&url, self.http.get(&url)).await?;
        Ok(l.entries)
    }

    /// `DELETE /v1/sandboxes/{id}/files?path=P` (directories recursively).
    ///
    /// # Errors
    /// `not_found`.
    pub async fn remove_file(&self, id: &str, path: &str) -> Result<()> {
        let url = self.file_url(id, "", path);
        self.send(&url, self.http.delete(&url)).await.map(drop)
    }

    /// `PUT /v1/sandboxes/{id}/files?path=P&step=N`: a logged write on a trajectory
    /// sandbox. Returns whether the answer came from the log (`Sandlot-Replayed: true`).
    ///
    /// # Errors
    /// As [`write_file`](Self::write_file); `conflict` when step `N` was logged with other
    /// data, `invalid_argument` for a step beyond the next one.
    pub async fn write_file_step(
        &self,
        id: &str,
        path: &str,
        data: impl Into<Bytes>,
        step: u64,
    ) -> Result<bool> {
        let url = format!("{}&step={step}", self.file_url(id, "", path));
        let rb = self
            .http
            .put(&url)
            .header("content-type", "application/octet-stream")
            .body(data.into());
        Ok(replayed(&self.send(&url, rb).await?))
    }

    /// `DELETE /v1/sandboxes/{id}/files?path=P&step=N`: a logged remove. Returns whether the
    /// answer came from the log.
    ///
    /// # Errors
    /// As [`remove_file`](Self::remove_file) and [`write_file_step`](Self::write_file_step).
    pub async fn remove_file_step(&self, id: &str, path: &str, step: u64) -> Result<bool> {
        let url = format!("{}&step={step}", self.file_url(id, "", path));
        Ok(replayed(&self.send(&url, self.http.delete(&url)).await?))
    }

    /// `POST /v1/sandboxes:pause` with a label selector (every pair must match) → ids paused.
    ///
    /// # Errors
    /// `invalid_argument` for an empty selector.
    pub async fn pause(&self, labels: &[(&str, &str)]) -> Result<PauseResult> {
        self.pause_resume("pause", labels).await
    }

    /// `POST /v1/sandboxes:resume` with a label selector → ids resumed.
    ///
    /// # Errors
    /// `invalid_argument` for an empty selector.
    pub async fn resume(&self, labels: &[(&str, &str)]) -> Result<PauseResult> {
        self.pause_resume("resume", labels).await
    }

    async fn pause_resume(&self, verb: &str, labels: &[(&str, &str)]) -> Result<PauseResult> {
        let url = self.url(&format!("/v1/sandboxes:{verb}"));
        let sel = LabelSelector {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        self.json(&url, self.http.post(&url).json(&sel)).await
    }

    /// `GET /v1/trajectories/{id}` → the log (steps, digests, exit codes, replay counts).
    ///
    /// # Errors
    /// `not_found` for an unknown trajectory.
    pub async fn trajectory(&self, trajectory: &str) -> Result<TrajectoryInfo> {
        let url = self.url(&format!("/v1/trajectories/{}", enc(trajectory)));
        self.json(&url, self.http.get(&url)).await
    }

    /// `DELETE /v1/trajectories/{id}`: delete the log (not the sandbox); fine when unknown.
    ///
    /// # Errors
    /// Transport errors, `invalid_argument` for a malformed id.
    pub async fn delete_trajectory(&self, trajectory: &str) -> Result<()> {
        let url = self.url(&format!("/v1/trajectories/{}", enc(trajectory)));
        self.send(&url, self.http.delete(&url)).await.map(drop)
    }

    /// `POST /run_code` (SandboxFusion-compatible) → [`RunCodeResponse`]; the verdict is in
    /// `status`.
    ///
    /// # Errors
    /// `resource_exhausted` (429) or `deadline_exceeded` (504) under overload: retry after a
    /// second.
    pub async fn run_code(&self, req: &RunCodeRequest) -> Result<RunCodeResponse> {
        let url = self.url("/run_code");
        self.json(&url, self.http.post(&url).json(req)).await
    }

    /// `GET /v1/ping` → `Ok(())` when the server answers `pong`.
    ///
    /// # Errors
    /// Transport errors; `BadResponse` for another answer.
    pub async fn ping(&self) -> Result<()> {
        let url = self.url("/v1/ping");
        let resp = self.send(&url, self.http.get(&url)).await?;
        let body = resp.text().await.map_err(|source| ClientError::Transport {
            url: url.clone(),
            source,
        })?;
        if body.trim() == "pong" {
            Ok(())
        } else {
            Err(ClientError::BadResponse {
                url,
                what: format!("expected pong, got {body:?}"),
            })
        }
    }
}

/// Split a byte stream into NDJSON lines and decode each as a `T` ([`ExecEvent`],
/// [`ProcessEvent`]).
fn ndjson<T: DeserializeOwned + Send + 'static>(
    url: String,
    body: impl Stream<Item = reqwest::Result<Bytes>> + Send + 'static,
) -> Pin<Box<dyn Stream<Item = Result<T>> + Send>> {
    struct St<S> {
        body: Pin<Box<S>>,
        buf: Vec<u8>,
        url: String,
        done: bool,
    }
    let st = St {
        body: Box::pin(body),
        buf: Vec::new(),
        url,
        done: false,
    };
    Box::pin(futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(pos) = st.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = st.buf.drain(..=pos).collect();
                let line = &line[..line.len() - 1];
                if line.iter().all(|b| b.is_ascii_whitespace()) {
                    continue;
                }
                let item =
                    serde_json::from_slice::<T>(line).map_err(|e| ClientError::BadResponse {
                        url: st.url.clone(),
                        what: format!("bad NDJSON line: {e}"),
                    });
                return Some((item, st));
            }
            if st.done {
                if st.buf.iter().all(|b| b.is_ascii_whitespace()) {
                    return None;
                }
                st.buf.push(b'\n'); // last line without newline
                continue;
            }
            match st.body.next().await {
                Some(Ok(chunk)) => st.buf.extend_from_slice(&chunk),
                Some(Err(source)) => {
                    st.done = true;
                    st.buf.clear();
                    let url = st.url.clone();
                    return Some((Err(ClientError::Transport { url, source }), st));
                }
                None => st.done = true,
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding() {
        assert_eq!(enc("/work space/ä=1&"), "%2Fwork%20space%2F%C3%A4%3D1%26");
        assert_eq!(enc("sb-0a"), "sb-0a");
        assert!(Client::new("localhost:7070").is_err());
        assert_eq!(Client::new("http://h:1/").unwrap().base_url(), "http://h:1");
    }

    #[tokio::test]
    async fn ndjson_splits_lines_across_chunks() {
        let text = "{\"type\":\"stdout\",\"data\":\"a\\n\"}\n{\"type\":\"std";
        let rest = "err\",\"data\":\"b\"}\n\n{\"type\":\"exit\",\"result\":{\"exit_code\":0,\"signal\":null,\"timed_out\":false,\"oom_killed\":false,\"duration_ms\":1.0,\"stdout\":\"\",\"stderr\":\"\",\"stdout_bytes\":2,\"stderr_bytes\":1,\"truncated\":false,\"replayed\":false}}";
        let chunks: Vec<reqwest::Result<Bytes>> =
            vec![Ok(Bytes::from(text)), Ok(Bytes::from(rest))];
        let evs: Vec<_> = ndjson("u".into(), futures::stream::iter(chunks))
            .collect()
            .await;
        let evs: Vec<ExecEvent> = evs.into_iter().map(|e| e.unwrap()).collect();
        assert_eq!(evs.len(), 3);
        assert_eq!(evs[0], ExecEvent::stdout(b"a\n"));
        assert_eq!(evs[1], ExecEvent::stderr(b"b"));
        match &evs[2] {
            ExecEvent::Exit { result } => assert_eq!(result.stdout_bytes, 2),
            e => panic!("{e:?}"),
        }
    }
}

#[cfg(test)]
mod failover_tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A fake server for this unit test only: answers every connection with one canned
    /// `GET /v1/sandboxes` body and records the request heads.
    async fn fake_server() -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let mut buf = vec![0u8; 65536];
                let n = c.read(&mut buf).await.unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let body = r#"{"sandboxes":[]}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = c.write_all(resp.as_bytes()).await;
            }
        });
        (url, rx)
    }

    #[tokio::test]
    async fn a_refused_connection_moves_to_the_next_server() {
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let (live, mut seen) = fake_server().await;
        let c = Client::new(&format!("{dead}, {live}/")).unwrap();
        assert_eq!(c.server_urls(), [dead.clone(), live.clone()]);
        assert_eq!(c.base_url(), dead);
        assert!(c.list(&[("job", "a")]).await.unwrap().is_empty());
        assert_eq!(
            c.base_url(),
            live,
            "later calls go straight to the live server"
        );
        let head = seen.recv().await.unwrap();
        assert!(
            head.starts_with("GET /v1/sandboxes?label=job%3Da "),
            "{head}"
        );
        assert!(c.list(&[]).await.is_ok());
        assert!(Client::new(" , ").is_err());
        assert!(Client::new("http://a:1,b:2").is_err());
    }

    /// A fake server for this unit test only: answers the `i`-th connection with
    /// `answers[i]` (status, JSON body) and records the request heads.
    async fn scripted_server(
        answers: Vec<(u16, String)>,
    ) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            for (status, body) in answers {
                let Ok((mut c, _)) = l.accept().await else {
                    return;
                };
                let mut buf = vec![0u8; 65536];
                let n = c.read(&mut buf).await.unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let resp = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = c.write_all(resp.as_bytes()).await;
            }
        });
        (url, rx)
    }

    fn sandbox_json(id: &str, state: SandboxState) -> String {
        serde_json::to_string(&Sandbox {
            id: id.into(),
            backend: Default::default(),
            image: "python".into(),
            state,
            node: "n".into(),
            created_at: "2026-12-04T00:00:00Z".into(),
            expires_at: None,
            cpu: 1.0,
            memory_mib: 64,
            disk_mib: 0,
            pids_max: 64,
            ttl_s: 60,
            labels: Default::default(),
            network: Default::default(),
            runtime: None,
            accel: None,
            trajectory: None,
            restore: None,
        })
        .unwrap()
    }

    #[tokio::test]
    async fn a_replayed_create_that_gets_rolled_back_is_sent_again() {
        let not_found = r#"{"error":{"code":"not_found","message":"no sandbox"}}"#;
        let (url, mut seen) = scripted_server(vec![
            // A replay of a create in flight on a server that then stopped ...
            (200, sandbox_json("sb-a", SandboxState::Creating)),
            (200, sandbox_json("sb-a", SandboxState::Creating)),
            // ... rolled back and removed by the leader's sweep: the key is free again.
            (404, not_found.into()),
            (200, sandbox_json("sb-b", SandboxState::Deleting)),
            (201, sandbox_json("sb-c", SandboxState::Running)),
        ])
        .await;
        let c = Client::new(&url).unwrap();
        let sb = c
            .create_idempotent(&CreateSandboxRequest::default(), "k-1")
            .await
            .unwrap();
        assert_eq!((sb.id.as_str(), sb.state), ("sb-c", SandboxState::Running));
        let mut heads = Vec::new();
        while let Ok(h) = seen.try_recv() {
            heads.push(h);
        }
        let posts: Vec<&String> = heads.iter().filter(|h| h.starts_with("POST ")).collect();
        assert_eq!(posts.len(), 3, "{heads:?}");
        for p in posts {
            assert!(
                p.to_ascii_lowercase().contains("idempotency-key: k-1"),
                "{p}"
            );
        }

        // Rolled back on every attempt: `unavailable`, not a dead handle.
        let gone = || (200, sandbox_json("sb-x", SandboxState::Deleted));
        let (url, _seen) = scripted_server(vec![gone(), gone(), gone()]).await;
        let e = Client::new(&url)
            .unwrap()
            .create_idempotent(&CreateSandboxRequest::default(), "k-2")
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{e}");
    }

    #[tokio::test]
    async fn every_server_down_is_a_transport_error() {
        let dead: Vec<String> = (0..2)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                format!("http://{}", l.local_addr().unwrap())
            })
            .collect();
        let c = Client::new(&dead.join(",")).unwrap();
        match c.list(&[]).await {
            Err(ClientError::Transport { url, .. }) => assert!(url.starts_with(&dead[1]), "{url}"),
            other => panic!("{other:?}"),
        }
    }
}
