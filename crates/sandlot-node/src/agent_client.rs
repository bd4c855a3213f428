//! The node's side of the guest agent protocol ([`sandlot_guest::agent_proto`]): one HTTP/2
//! connection per sandbox over the unix socket the node bound for it, opened lazily and
//! re-opened when it breaks (e.g. after a node restart), every call a stream on it.
use crate::node::{NodeError, NodeResult};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandlot_guest::agent_proto::{
    encode, AttachInfo, AttachRequest, ClockRequest, ExecExit, ExecInfo, ExecList, ExecRequest,
    FileInfo, ForgetRequest, Frame, FrameDecoder, FrameKind, FsCode, FsError, IdentityRequest,
    SignalRequest, CONNECTION_WINDOW, EXECS_LIST_QUERY, PATH_CLOCK, PATH_EXEC, PATH_EXECS,
    PATH_EXEC_ATTACH, PATH_EXEC_FORGET, PATH_IDENTITY, PATH_PING, PATH_SIGNAL, STREAM_WINDOW,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long one ping may take.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// Connects to the unix socket at `path` without following a symlink in its last
/// component: the file is opened `O_PATH | O_NOFOLLOW`, checked to be a socket, and the
/// connection goes through `/proc/self/fd/N`, which names that very inode. A sandbox that
/// can write the socket's directory (gVisor's host-UDS mode) therefore cannot point the
/// node at another host socket.
pub(crate) async fn connect_socket(path: &Path) -> std::io::Result<tokio::net::UnixStream> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileTypeExt;
    let fd = nix::fcntl::open(
        path,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(std::io::Error::from)?;
    let file = std::fs::File::from(fd);
    if !file.metadata()?.file_type().is_socket() {
        return Err(std::io::Error::other("not a unix socket"));
    }
    let stream =
        tokio::net::UnixStream::connect(format!("/proc/self/fd/{}", file.as_raw_fd())).await;
    drop(file);
    stream
}

/// Request body of every agent call: a whole buffer, or a stream (stdin of a background
/// process).
/// Request bodies to the agent; an `Err` (a streamed upload that broke off) resets the
/// HTTP/2 stream, so the agent drops what it had started.
type ReqBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

/// Opens the byte stream of one new agent connection, in place of connecting the socket
/// (the `microvm` backend's relay, which keeps the connection across a pause).
pub type Connector = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<tokio::net::UnixStream>> + Send>,
        > + Send
        + Sync,
>;

/// A client of one sandbox's agent.
pub struct AgentClient {
    socket: PathBuf,
    connector: Option<Connector>,
    conn: tokio::sync::Mutex<Option<SendRequest<ReqBody>>>,
    /// Open [`AgentClient::connect_port`] tunnels, at most [`MAX_TUNNELS`].
    tunnels: std::sync::Arc<tokio::sync::Semaphore>,
}

/// `data` as a [`ReqBody`].
fn full(data: Bytes) -> ReqBody {
    Full::new(data).map_err(|e| match e {}).boxed()
}

/// The body of an agent's answer other than success, as text (empty when it cannot be
/// read).
async fn error_text(resp: hyper::Response<Incoming>) -> String {
    resp.into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default()
}

fn agent_err(socket: &Path, what: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::io(
        format!("guest agent at {}: {what}", socket.display()),
        std::io::Error::other(e.to_string()),
    )
}

impl AgentClient {
    /// A client for the agent listening on `socket` (nothing is connected yet).
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        AgentClient {
            socket: socket.into(),
            connector: None,
            conn: tokio::sync::Mutex::new(None),
            tunnels: std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_TUNNELS)),
        }
    }

    /// A client whose connections come from `connector` (`socket` only names the agent in
    /// error messages).
    pub fn with_connector(socket: impl Into<PathBuf>, connector: Connector) -> Self {
        AgentClient {
            socket: socket.into(),
            connector: Some(connector),
            conn: tokio::sync::Mutex::new(None),
            tunnels: std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_TUNNELS)),
        }
    }

    async fn sender(&self) -> NodeResult<SendRequest<ReqBody>> {
        let mut conn = self.conn.lock().await;
        if let Some(s) = conn.as_ref() {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        let stream = match &self.connector {
            Some(c) => c().await,
            None => connect_socket(&self.socket).await,
        }
        .map_err(|e| agent_err(&self.socket, "connect", e))?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| agent_err(&self.socket, "HTTP/2 handshake", e))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        *conn = Some(sender.clone());
        Ok(sender)
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> NodeResult<hyper::Response<Incoming>> {
        self.call_body(method, path, full(body)).await
    }

    async fn call_body(
        &self,
        method: Method,
        path: &str,
        body: ReqBody,
    ) -> NodeResult<hyper::Response<Incoming>> {
        let mut sender = self.sender().await?;
        let req = Request::builder()
            .method(method)
            .uri(format!("http://agent{path}"))
            .body(body)
            .expect("valid request");
        sender
            .send_request(req)
            .await
            .map_err(|e| agent_err(&self.socket, path, e))
    }

    /// Waits until the agent answers `GET /v1/ping`, retrying until `deadline` (each try is
    /// bounded too: a peer that accepts but never speaks HTTP/2 cannot hang it).
    ///
    /// # Errors
    /// `Internal` with the last failure when the deadline passes.
    pub async fn wait_ready(&self, deadline: Instant) -> NodeResult<()> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = self.call(Method::GET, PATH_PING, Bytes::new());
            let err = match tokio::time::timeout(left.min(PING_TIMEOUT), attempt).await {
                Ok(Ok(r)) if r.status() == StatusCode::OK => return Ok(()),
                Ok(Ok(r)) => agent_err(&self.socket, "ping", r.status()),
                Ok(Err(e)) => e,
                Err(_) => {
                    // Drop a connection that never answered; the next try dials again.
                    *self.conn.lock().await = None;
                    agent_err(&self.socket, "ping", "no answer")
                }
            };
            if Instant::now() >= deadline {
                return Err(err);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until the agent answers `GET /v1/ping` over ONE connection: retries only while
    /// the socket cannot be connected, then waits for the answer until `deadline`. For
    /// agents behind a single byte stream (a microVM's virtio-serial port), where dropping
    /// and re-dialling a connection the guest has not seen yet would interleave two
    /// HTTP/2 connections on the one stream.
    ///
    /// # Errors
    /// `Internal` with the last failure when the deadline passes.
    pub async fn wait_ready_single(&self, deadline: Instant) -> NodeResult<()> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.call(Method::GET, PATH_PING, Bytes::new())).await
            {
                Ok(Ok(r)) if r.status() == StatusCode::OK => return Ok(()),
                Ok(Ok(r)) => return Err(agent_err(&self.socket, "ping", r.status())),
                Ok(Err(e)) => {
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    *self.conn.lock().await = None;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(_) => return Err(agent_err(&self.socket, "ping", "no answer")),
            }
        }
    }

    /// Starts an exec; read its output and exit with [`ExecStream::next`]. Dropping the
    /// stream resets the HTTP/2 stream, and the agent then kills the command's tree.
    ///
    /// # Errors
    /// `Internal` when the agent cannot be reached or refuses the request.
    pub async fn exec(&self, req: &ExecRequest, stdin: Option<&[u8]>) -> NodeResult<ExecStream> {
        self.exec_streaming(req, stdin, None).await
    }

    /// [`AgentClient::exec`] whose stdin stays open: after `stdin`, every chunk received on
    /// `more` is sent as stdin frames on the request body; the command's stdin closes (EOF)
    /// when `more`'s senders are all dropped. `req.stdin` must be true when `more` is given.
    ///
    /// # Errors
    /// As [`AgentClient::exec`].
    pub async fn exec_streaming(
        &self,
        req: &ExecRequest,
        stdin: Option<&[u8]>,
        more: Option<tokio::sync::mpsc::Receiver<Bytes>>,
    ) -> NodeResult<ExecStream> {
        let spec = serde_json::to_vec(req).expect("ExecRequest serialises");
        let mut body = encode(FrameKind::Spec, &spec);
        if let Some(data) = stdin {
            body.extend(encode(FrameKind::Stdin, data));
        }
        let body: ReqBody = match more {
            None => full(Bytes::from(body)),
            Some(rx) => {
                let first = futures::stream::once(async move { Bytes::from(body) });
                let rest = futures::stream::unfold(rx, |mut rx| async move {
                    rx.recv()
                        .await
                        .map(|b| (Bytes::from(encode(FrameKind::Stdin, &b)), rx))
                });
                let frames = futures::StreamExt::map(futures::StreamExt::chain(first, rest), |b| {
                    Ok::<_, std::io::Error>(hyper::body::Frame::data(b))
                });
                http_body_util::StreamBody::new(frames).boxed()
            }
        };
        let resp = self.call_body(Method::POST, PATH_EXEC, body).await?;
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            let text = error_text(resp).await;
            return Err(agent_err(&self.socket, "exec", format!("{status}: {text}")));
        }
        Ok(ExecStream {
            body: resp.into_body(),
            dec: FrameDecoder::default(),
            socket: self.socket.clone(),
        })
    }
}

/// File calls (`/v1/files/...`). Errors come back as the agent's [`FsError`] (its stable
/// code and message); a call that never reached the agent, or an answer that is not an
/// `FsError`, is [`FsCode::Internal`] naming the socket.
impl AgentClient {
    fn fs_internal(&self, what: &str, e: impl std::fmt::Display) -> FsError {
        FsError {
            code: FsCode::Internal,
            message: format!("guest agent at {}: {what}", self.socket.display()),
            cause: Some(e.to_string()),
        }
    }

    /// One file call: `body` to `path`; the 2xx answer's body bytes, or the error.
    async fn fs_call(&self, path: &str, body: Bytes) -> Result<hyper::Response<Incoming>, FsError> {
        let resp = self
            .call(Method::POST, path, body)
            .await
            .map_err(|e| self.fs_internal(path, e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Err(
            serde_json::from_slice::<FsError>(&bytes).unwrap_or_else(|_| {
                self.fs_internal(
                    path,
                    format!("{status}: {}", String::from_utf8_lossy(&bytes)),
                )
            }),
        )
    }

    async fn fs_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        req: &impl serde::Serialize,
    ) -> Result<T, FsError> {
        let body = serde_json::to_vec(req).expect("request serialises");
        let resp = self.fs_call(path, body.into()).await?;
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| self.fs_internal(path, e))?
            .to_bytes();
        serde_json::from_slice(&bytes).map_err(|e| self.fs_internal(path, e))
    }

    async fn fs_empty(&self, path: &str, req: &impl serde::Serialize) -> Result<(), FsError> {
        let body = serde_json::to_vec(req).expect("request serialises");
        let resp = self.fs_call(path, body.into()).await?;
        resp.into_body()
            .collect()
            .await
            .map_err(|e| self.fs_internal(path, e))?;
        Ok(())
    }

    /// Reads the regular file at `path` (absolute, or relative to `/workspace`), at most
    /// `max_bytes` bytes; memory grows with the bytes received. The whole of
    /// [`AgentClient::read_file_stream`].
    ///
    /// # Errors
    /// The agent's: `not_found`, `invalid_argument` (directory, not a regular file, special
    /// file system, refused directory, bad path), `payload_too_large` (over `max_bytes`,
    /// also when the file grows during the read), `permission_denied`, `internal`.
    pub async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Vec<u8>, FsError> {
        let mut s = self.read_file_stream(path, max_bytes).await?;
        let mut data = Vec::new();
        while let Some(chunk) = sandlot_node_api::next_chunk(&mut s).await {
            let chunk = chunk.map_err(|e| {
                e.into_inner()
                    .and_then(|b| b.downcast::<FsError>().ok())
                    .map(|b| *b)
                    .unwrap_or_else(|| self.fs_internal("read body", "broke off"))
            })?;
            data.extend_from_slice(&chunk);
        }
        Ok(data)
    }

    /// [`AgentClient::read_file`] as a stream of the chunks the agent sends (memory: what
    /// the HTTP/2 window holds). Errors after the answer's head (the file grew past
    /// `max_bytes`, an I/O error, the agent's error trailer) end the stream with an `Err`
    /// item whose inner error is the [`FsError`].
    ///
    /// # Errors
    /// As [`AgentClient::read_file`], for what the agent answers before the first byte.
    pub async fn read_file_stream(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<sandlot_node_api::ByteStream, FsError> {
        use sandlot_guest::agent_proto::{ReadFileRequest, PATH_FILES_READ, TRAILER_ERROR};
        let req = ReadFileRequest {
            path: path.to_string(),
            max_bytes,
        };
        let body = serde_json::to_vec(&req).expect("request serialises");
        let body = self
            .fs_call(PATH_FILES_READ, body.into())
            .await?
            .into_body();
        let internal = {
            let socket = self.socket.clone();
            move |what: &str, e: String| FsError {
                code: FsCode::Internal,
                message: format!("guest agent at {}: {what}", socket.display()),
                cause: Some(e),
            }
        };
        let path = path.to_string();
        let state = (body, 0u64, false);
        let s = futures::stream::unfold(state, move |(mut body, mut done, ended)| {
            let internal = internal.clone();
            let path = path.clone();
            async move {
                if ended {
                    return None;
                }
                loop {
                    let frame = match body.frame().await {
                        None => return None,
                        Some(Err(e)) => {
                            let e = internal("read body", e.to_string());
                            return Some((Err(std::io::Error::other(e)), (body, done, true)));
                        }
                        Some(Ok(f)) => f,
                    };
                    match frame.into_data() {
                        Ok(d) => {
                            done += d.len() as u64;
                            if done > max_bytes {
                                let e = FsError::new(
                                    FsCode::PayloadTooLarge,
                                    format!(
                                        "file is over {max_bytes} bytes; limit {max_bytes}: {path}"
                                    ),
                                );
                                return Some((Err(std::io::Error::other(e)), (body, done, true)));
                            }
                            if d.is_empty() {
                                continue;
                            }
                            return Some((Ok(d), (body, done, false)));
                        }
                        Err(frame) => {
                            if let Some(v) = frame.trailers_ref().and_then(|t| t.get(TRAILER_ERROR))
                            {
                                let e: FsError = serde_json::from_slice(v.as_bytes())
                                    .unwrap_or_else(|e| {
                                        internal("read error trailer", e.to_string())
                                    });
                                return Some((Err(std::io::Error::other(e)), (body, done, true)));
                            }
                        }
                    }
                }
            }
        });
        Ok(Box::pin(s))
    }

    /// Writes `data` to `path` atomically and durably (the agent answers after the rename
    /// and the directory's fsync), creating missing parents. `max_bytes` is the agent-side
    /// limit (`payload_too_large` past it). One chunk of
    /// [`AgentClient::write_file_stream`].
    ///
    /// # Errors
    /// The agent's: `invalid_argument` (a directory, a special file system, a refused
    /// directory, bad path), `not_found`, `permission_denied`, `resource_exhausted` (the
    /// sandbox's space), `payload_too_large`, `internal`.
    pub async fn write_file(&self, path: &str, data: &[u8], max_bytes: u64) -> Result<(), FsError> {
        let body = sandlot_node_api::chunked(Bytes::copy_from_slice(data));
        self.write_stream_fs(path, body, max_bytes)
            .await
            .map(|_| ())
    }

    /// [`AgentClient::write_file`] from a stream: the chunks go to the agent as they come
    /// (memory: the chunks in flight). A chunk that is an `Err`, or more than `max_bytes`
    /// bytes, resets the request, so the agent removes its temp file and the target stays
    /// as it was. Answers the bytes sent.
    ///
    /// # Errors
    /// As [`AgentClient::write_file`], mapped to node errors; `InvalidArgument` when the body
    /// is over `max_bytes` or broke off.
    pub async fn write_file_stream(
        &self,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        use std::sync::atomic::{AtomicU8, Ordering};
        // Why our side ended the body with an error: 1 over the limit, 2 broke off.
        let why = std::sync::Arc::new(AtomicU8::new(0));
        let r = self
            .write_stream_inner(path, body, max_bytes, why.clone())
            .await;
        match why.load(Ordering::SeqCst) {
            1 => Err(sandlot_node_api::over_limit(path, max_bytes)),
            2 => Err(sandlot_node_api::broke_off(
                path,
                &std::io::Error::other("the body ended with an error"),
            )),
            _ => r.map_err(crate::files::node_error),
        }
    }

    async fn write_stream_fs(
        &self,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> Result<u64, FsError> {
        let why = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(0));
        let r = self
            .write_stream_inner(path, body, max_bytes, why.clone())
            .await;
        // Over the limit on our side: the request was reset (the agent dropped its temp
        // file), so the answer is ours to give, with the agent's code for it.
        if why.load(std::sync::atomic::Ordering::SeqCst) == 1 {
            return Err(FsError::new(
                FsCode::PayloadTooLarge,
                format!("{path}: more than {max_bytes} bytes"),
            ));
        }
        r
    }

    async fn write_stream_inner(
        &self,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
        why: std::sync::Arc<std::sync::atomic::AtomicU8>,
    ) -> Result<u64, FsError> {
        use sandlot_guest::agent_proto::{WriteFileRequest, PATH_FILES_WRITE};
        use std::sync::atomic::{AtomicU64, Ordering};
        let req = WriteFileRequest {
            path: path.to_string(),
            max_bytes,
        };
        let spec = serde_json::to_vec(&req).expect("request serialises");
        let head = Bytes::from(encode(FrameKind::Spec, &spec));
        // The body goes through a channel (hyper wants a `Sync` body; the stream is not):
        // `None` marks its end, so a pump dropped half-way reads as broken, never as done.
        let (tx, rx) = tokio::sync::mpsc::channel::<Option<std::io::Result<Bytes>>>(4);
        let sent = std::sync::Arc::new(AtomicU64::new(0));
        let counted = sent.clone();
        let mut body = body;
        let pump = async move {
            if tx.send(Some(Ok(head))).await.is_err() {
                return;
            }
            loop {
                let item = tokio::select! {
                    _ = tx.closed() => return,
                    c = sandlot_node_api::next_chunk(&mut body) => c,
                };
                let msg = match item {
                    None => None,
                    Some(Err(e)) => {
                        why.store(2, Ordering::SeqCst);
                        Some(Err(e))
                    }
                    Some(Ok(c)) => {
                        let n =
                            counted.fetch_add(c.len() as u64, Ordering::SeqCst) + c.len() as u64;
                        if n > max_bytes {
                            why.store(1, Ordering::SeqCst);
                            Some(Err(std::io::Error::other("over the limit")))
                        } else {
                            Some(Ok(c))
                        }
                    }
                };
                let last = !matches!(msg, Some(Ok(_)));
                if tx.send(msg).await.is_err() || last {
                    return;
                }
            }
        };
        let req_body = http_body_util::StreamBody::new(RxBody { rx, ended: false }).boxed();
        let call = self.call_body(Method::POST, PATH_FILES_WRITE, req_body);
        tokio::pin!(call, pump);
        let resp = tokio::select! {
            r = &mut call => r,
            () = &mut pump => call.await,
        };
        let resp = resp.map_err(|e| self.fs_internal(PATH_FILES_WRITE, e))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| self.fs_internal("write", e))?
            .to_bytes();
        if !status.is_success() {
            return Err(
                serde_json::from_slice::<FsError>(&bytes).unwrap_or_else(|_| {
                    self.fs_internal(
                        PATH_FILES_WRITE,
                        format!("{status}: {}", String::from_utf8_lossy(&bytes)),
                    )
                }),
            );
        }
        Ok(sent.load(Ordering::SeqCst))
    }

    /// Lists the directory at `path`, sorted by name (entries not followed).
    ///
    /// # Errors
    /// `not_found`, `invalid_argument` (not a directory, special file system, refused),
    /// `permission_denied`, `internal`.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<FileInfo>, FsError> {
        use sandlot_guest::agent_proto::{PathRequest, PATH_FILES_LIST};
        self.fs_json(PATH_FILES_LIST, &PathRequest { path: path.into() })
            .await
    }

    /// Facts of `path` (symlinks followed inside the root).
    ///
    /// # Errors
    /// `not_found`, `invalid_argument`, `permission_denied`, `internal`.
    pub async fn stat(&self, path: &str) -> Result<FileInfo, FsError> {
        use sandlot_guest::agent_proto::{PathRequest, PATH_FILES_STAT};
        self.fs_json(PATH_FILES_STAT, &PathRequest { path: path.into() })
            .await
    }

    /// Creates the directory `path` (`parents`: `mkdir -p`).
    ///
    /// # Errors
    /// `not_found` (missing parent without `parents`), `conflict` (exists, or a
    /// non-directory in the way), `invalid_argument`, `permission_denied`,
    /// `resource_exhausted`, `internal`.
    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<(), FsError> {
        use sandlot_guest::agent_proto::{MkdirRequest, PATH_FILES_MKDIR};
        self.fs_empty(
            PATH_FILES_MKDIR,
            &MkdirRequest {
                path: path.into(),
                parents,
            },
        )
        .await
    }

    /// Removes a file, a symlink, or a directory recursively.
    ///
    /// # Errors
    /// `not_found`, `invalid_argument` (`/`, a protected directory, a mount point, special
    /// file system), `conflict` (a directory that keeps filling), `permission_denied`,
    /// `internal`.
    pub async fn remove(&self, path: &str) -> Result<(), FsError> {
        use sandlot_guest::agent_proto::{PathRequest, PATH_FILES_REMOVE};
        self.fs_empty(PATH_FILES_REMOVE, &PathRequest { path: path.into() })
            .await
    }
}

impl AgentClient {
    /// New hostname, machine id and entropy for a microVM guest
    /// ([`sandlot_guest::agent_proto::PATH_IDENTITY`]).
    ///
    /// # Errors
    /// `Internal` when the agent cannot be reached or refuses (its message).
    pub async fn set_identity(&self, req: &IdentityRequest) -> NodeResult<()> {
        let body = serde_json::to_vec(req).expect("IdentityRequest serialises");
        let resp = self.call(Method::POST, PATH_IDENTITY, body.into()).await?;
        self.no_content(resp, "identity", false).await
    }

    /// Sets a VM guest's wall clock to this host's
    /// ([`sandlot_guest::agent_proto::PATH_CLOCK`]). An agent without the call (a guest
    /// started by an older node, re-adopted) answers 404 and keeps its clock.
    ///
    /// # Errors
    /// `Internal` when the agent cannot be reached or refuses (its message).
    pub async fn set_clock(&self) -> NodeResult<()> {
        let Ok(since_epoch) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)
        else {
            return Ok(()); // a host clock before 1970 is nothing to copy
        };
        let unix_ns = since_epoch.as_nanos() as u64;
        let body = serde_json::to_vec(&ClockRequest { unix_ns }).expect("ClockRequest serialises");
        let resp = self.call(Method::POST, PATH_CLOCK, body.into()).await?;
        self.no_content(resp, "clock", true).await
    }

    /// `Ok` for a 204 answer (and for a 404 when `missing_ok`), else the agent's message.
    async fn no_content(
        &self,
        resp: hyper::Response<Incoming>,
        what: &str,
        missing_ok: bool,
    ) -> NodeResult<()> {
        let status = resp.status();
        if status == StatusCode::NO_CONTENT || (missing_ok && status == StatusCode::NOT_FOUND) {
            return Ok(());
        }
        let text = error_text(resp).await;
        Err(agent_err(&self.socket, what, format!("{status}: {text}")))
    }

    /// Delivers `signal` to the running exec started with `handle` (see
    /// [`sandlot_guest::agent_proto::PATH_SIGNAL`]). An exec that already ended is not an
    /// error (the signal has nobody to reach).
    ///
    /// # Errors
    /// `Internal` when the agent cannot be reached or refuses the request.
    pub async fn signal(&self, handle: &str, signal: i32) -> NodeResult<()> {
        let body = serde_json::to_vec(&SignalRequest {
            handle: handle.to_string(),
            signal,
        })
        .expect("SignalRequest serialises");
        let resp = self.call(Method::POST, PATH_SIGNAL, body.into()).await?;
        self.no_content(resp, "signal", true).await
    }
}

/// How long [`AgentClient::list_execs`] and the start of [`AgentClient::attach`] may take.
const EXECS_TIMEOUT: Duration = Duration::from_secs(10);

/// Named execs that outlived their node's connection (issue 25, see
/// [`sandlot_guest::agent_proto::PATH_EXECS`]).
impl AgentClient {
    /// The agent's named execs that no node forgot ([`AgentClient::forget_exec`]):
    /// running ones and ended ones, with the highest number it ever tabled (`None` from an
    /// agent that predates it: the answer is then the bare list). `Ok(None)` from an agent
    /// that predates the call (404): it keeps no such table.
    ///
    /// # Errors
    /// `Internal` when the agent cannot be reached, does not answer within 10 s, or
    /// answers something else.
    pub async fn list_execs(&self) -> NodeResult<Option<ExecList>> {
        /// Either answer of `GET /v1/execs?v=2`: older agents ignore the query.
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Answer {
            List(ExecList),
            Bare(Vec<ExecInfo>),
        }
        let call = async {
            let path = format!("{PATH_EXECS}?{EXECS_LIST_QUERY}");
            let resp = self.call(Method::GET, &path, Bytes::new()).await?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| agent_err(&self.socket, "execs", e))?
                .to_bytes();
            match status {
                StatusCode::OK => serde_json::from_slice(&body)
                    .map(|a| {
                        Some(match a {
                            Answer::List(l) => l,
                            Answer::Bare(execs) => ExecList {
                                execs,
                                max_number: None,
                            },
                        })
                    })
                    .map_err(|e| agent_err(&self.socket, "execs JSON", e)),
                StatusCode::NOT_FOUND => Ok(None),
                s => Err(agent_err(
                    &self.socket,
                    "execs",
                    format!("{s}: {}", String::from_utf8_lossy(&body)),
                )),
            }
        };
        tokio::time::timeout(EXECS_TIMEOUT, call)
            .await
            .map_err(|_| agent_err(&self.socket, "execs", "no answer"))?
    }

    /// Makes the agent forget the named exec `handle` (see
    /// [`sandlot_guest::agent_proto::PATH_EXEC_FORGET`]): its record was deleted. An
    /// unknown handle, and an agent that predates the call (404), are fine.
    ///
    /// # Errors
    /// `Internal` when the agent cannot be reached, does not answer within 10 s, or
    /// refuses the request.
    pub async fn forget_exec(&self, handle: &str) -> NodeResult<()> {
        let body = serde_json::to_vec(&ForgetRequest {
            handle: handle.to_string(),
        })
        .expect("ForgetRequest serialises");
        let call = async {
            let resp = self
                .call(Method::POST, PATH_EXEC_FORGET, body.into())
                .await?;
            self.no_content(resp, "forget", true).await
        };
        tokio::time::timeout(EXECS_TIMEOUT, call)
            .await
            .map_err(|_| agent_err(&self.socket, "forget", "no answer"))?
    }

    /// Reads the named exec `handle` again: where its output resumes ([`AttachInfo`]),
    /// then, from [`ExecStream::next`], what its ring held, its output as it comes and its
    /// exit (at once when it already ended). Dropping the stream on a live connection kills
    /// the command, as for [`AgentClient::exec`].
    ///
    /// # Errors
    /// `NotFound` when the agent has no such exec (or predates the call); `Conflict` when
    /// another connection still reads it; `Internal` when the agent cannot be reached or
    /// answers something else.
    pub async fn attach(&self, handle: &str) -> NodeResult<(AttachInfo, ExecStream)> {
        let start = async {
            let body = serde_json::to_vec(&AttachRequest {
                handle: handle.to_string(),
            })
            .expect("AttachRequest serialises");
            let resp = self
                .call(Method::POST, PATH_EXEC_ATTACH, body.into())
                .await?;
            let status = resp.status();
            if status != StatusCode::OK {
                let text = error_text(resp).await;
                return Err(match status {
                    StatusCode::NOT_FOUND => NodeError::NotFound(format!(
                        "guest agent at {}: no exec {handle}: {text}",
                        self.socket.display()
                    )),
                    StatusCode::CONFLICT => NodeError::Conflict(format!(
                        "guest agent at {}: {text}",
                        self.socket.display()
                    )),
                    s => agent_err(&self.socket, "attach", format!("{s}: {text}")),
                });
            }
            let mut stream = ExecStream {
                body: resp.into_body(),
                dec: FrameDecoder::default(),
                socket: self.socket.clone(),
            };
            let info = stream.spec_frame().await?;
            let info: AttachInfo = serde_json::from_slice(&info)
                .map_err(|e| agent_err(&self.socket, "attach info", e))?;
            Ok((info, stream))
        };
        tokio::time::timeout(EXECS_TIMEOUT, start)
            .await
            .map_err(|_| agent_err(&self.socket, "attach", "no answer"))?
    }
}

/// How many times [`AgentClient::attach_when_free`] asks while the agent answers 409, and
/// how long it waits between: a second in all, the agent's own grace for a connection's
/// end (`CONN_END_GRACE` in `sandlot-guest`'s agent) and then some.
pub const ATTACH_CONFLICT_TRIES: u32 = 5;
/// See [`ATTACH_CONFLICT_TRIES`].
pub const ATTACH_CONFLICT_WAIT: Duration = Duration::from_millis(200);

impl AgentClient {
    /// [`AgentClient::attach`], asked again up to [`ATTACH_CONFLICT_TRIES`] times in all,
    /// [`ATTACH_CONFLICT_WAIT`] apart, while the agent answers 409: the connection that
    /// read the exec is going away but the agent has not seen its end yet (a node that
    /// took a paused VM over while the old node's connection was still held, or this
    /// node's own connection that just dropped). Logged once, at the first 409. All tries
    /// together take at most 10 s, as one attach.
    ///
    /// # Errors
    /// As [`AgentClient::attach`]; `Conflict` when the exec is still read by another
    /// connection after the last try.
    pub async fn attach_when_free(&self, handle: &str) -> NodeResult<(AttachInfo, ExecStream)> {
        let tries = async {
            let mut tries = 1;
            loop {
                match self.attach(handle).await {
                    Err(NodeError::Conflict(msg)) if tries < ATTACH_CONFLICT_TRIES => {
                        if tries == 1 {
                            tracing::info!(handle, agent = %self.socket.display(), error = %msg,
                                "exec still read by another connection; asking again");
                        }
                        tries += 1;
                        tokio::time::sleep(ATTACH_CONFLICT_WAIT).await;
                    }
                    r => return r,
                }
            }
        };
        tokio::time::timeout(EXECS_TIMEOUT, tries)
            .await
            .map_err(|_| agent_err(&self.socket, "attach", "no answer"))?
    }
}

/// The response of one exec: output frames, then the exit.
pub struct ExecStream {
    body: Incoming,
    dec: FrameDecoder,
    socket: PathBuf,
}

/// One event of an [`ExecStream`].
#[derive(Debug)]
pub enum ExecChunk {
    /// Output: `true` for stdout, `false` for stderr.
    Output(bool, Vec<u8>),
    /// The command ended (last event).
    Exit(ExecExit),
}

impl ExecStream {
    /// The first frame, which must be a [`FrameKind::Spec`] frame (an attach's
    /// [`AttachInfo`]); its payload.
    async fn spec_frame(&mut self) -> NodeResult<Vec<u8>> {
        loop {
            match self.dec.next_frame() {
                Err(e) => return Err(agent_err(&self.socket, "attach frames", e)),
                Ok(Some(Frame {
                    kind: FrameKind::Spec,
                    data,
                })) => return Ok(data),
                Ok(Some(f)) => {
                    return Err(agent_err(
                        &self.socket,
                        "attach frames",
                        format!("expected the info frame, got {:?}", f.kind),
                    ))
                }
                Ok(None) => {}
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.dec.push(&d);
                    }
                }
                Some(Err(e)) => return Err(agent_err(&self.socket, "attach", e)),
                None => return Err(agent_err(&self.socket, "attach", "stream ended early")),
            }
        }
    }

    /// The next event; `Ok(None)` when the stream ended without an exit frame (the agent or
    /// its connection died).
    ///
    /// # Errors
    /// `Internal` on a malformed frame stream.
    pub async fn next(&mut self) -> NodeResult<Option<ExecChunk>> {
        loop {
            match self.dec.next_frame() {
                Err(e) => return Err(agent_err(&self.socket, "exec frames", e)),
                Ok(Some(Frame { kind, data })) => {
                    return Ok(Some(match kind {
                        FrameKind::Stdout => ExecChunk::Output(true, data),
                        FrameKind::Stderr => ExecChunk::Output(false, data),
                        FrameKind::Exit => ExecChunk::Exit(
                            serde_json::from_slice(&data)
                                .map_err(|e| agent_err(&self.socket, "exit frame", e))?,
                        ),
                        other => {
                            return Err(agent_err(
                                &self.socket,
                                "exec frames",
                                format!("unexpected {other:?} frame"),
                            ))
                        }
                    }))
                }
                Ok(None) => {}
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.dec.push(&d);
                    }
                }
                Some(Err(_)) | None => return Ok(None),
            }
        }
    }
}

/// Size of each direction's buffer in the [`AgentClient::connect_port`] pipe, bytes.
const TUNNEL_BUF: usize = 64 * 1024;

/// Most [`AgentClient::connect_port`] tunnels open at once on one agent. Each holds an
/// HTTP/2 stream, and the agent serves at most 200 concurrent streams (hyper's default):
/// the rest stay for execs, file calls and pings, which open tunnels must not starve.
pub const MAX_TUNNELS: usize = 128;

impl AgentClient {
    /// A TCP connection to `127.0.0.1:port` inside sandbox `id`, made by its agent
    /// ([`sandlot_guest::agent_proto::PATH_CONNECT`]) and carried by one HTTP/2 stream:
    /// the returned stream is one end of a [`tokio::io::duplex`] pipe (64 KiB
    /// each way) whose other end a task pumps to and from that stream. Shutting down its
    /// write half half-closes the TCP connection inside; its reads end at the service's
    /// EOF; dropping it resets the HTTP/2 stream, which closes the connection. Memory is
    /// bounded by the pipe and HTTP/2 flow control.
    ///
    /// # Errors
    /// `InvalidArgument` (port 0); `Unavailable` starting with
    /// [`sandlot_node_api::PORT_NOT_LISTENING`] (connection refused inside, or no accept
    /// within the agent's connect timeout), or naming an agent too old for the call;
    /// `ResourceExhausted` when [`MAX_TUNNELS`] are open; `Internal` when the agent cannot
    /// be reached or fails otherwise.
    pub async fn connect_port(
        &self,
        id: &str,
        port: u16,
    ) -> NodeResult<sandlot_node_api::PortConn> {
        use sandlot_guest::agent_proto::{ConnectRequest, CONNECT_TIMEOUT_MS, PATH_CONNECT};
        use sandlot_node_api::PORT_NOT_LISTENING;
        if port == 0 {
            return Err(NodeError::InvalidArgument(
                "port 0 cannot be reached".into(),
            ));
        }
        let permit = self.tunnels.clone().try_acquire_owned().map_err(|_| {
            NodeError::ResourceExhausted(format!(
                "sandbox {id} has {MAX_TUNNELS} port connections open through its guest agent, \
                 the most; close some first"
            ))
        })?;
        let spec = serde_json::to_vec(&ConnectRequest { port }).expect("ConnectRequest serialises");
        // Client → service: the spec frame, then what the pump reads from the pipe. A
        // channel of one chunk: the pump reads the pipe only as HTTP/2 takes the chunks.
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
        let first =
            futures::stream::once(async move { Bytes::from(encode(FrameKind::Spec, &spec)) });
        let rest =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) });
        let frames = futures::StreamExt::map(futures::StreamExt::chain(first, rest), |b| {
            Ok::<_, std::io::Error>(hyper::body::Frame::data(b))
        });
        let body: ReqBody = http_body_util::StreamBody::new(frames).boxed();
        // The agent answers within its connect timeout; a little more for the way there.
        let wait = Duration::from_millis(CONNECT_TIMEOUT_MS) + Duration::from_secs(5);
        let resp = match tokio::time::timeout(wait, self.call_body(Method::POST, PATH_CONNECT, body)).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(NodeError::Unavailable(format!(
                    "{PORT_NOT_LISTENING} {port} in sandbox {id} (its agent did not answer within {} s)",
                    wait.as_secs()
                )))
            }
        };
        let status = resp.status();
        if status != StatusCode::OK {
            let text = error_text(resp).await;
            return Err(match status {
                StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => {
                    // The agent's text starts as ours does; keep only its reason.
                    let said = text.trim();
                    let reason = said
                        .strip_prefix(&format!("{PORT_NOT_LISTENING} {port}"))
                        .map(str::trim)
                        .filter(|r| r.starts_with('('))
                        .map(str::to_owned)
                        .unwrap_or_else(|| format!("({said})"));
                    NodeError::Unavailable(format!(
                        "{PORT_NOT_LISTENING} {port} in sandbox {id} {reason}"
                    ))
                }
                StatusCode::NOT_FOUND => NodeError::Unavailable(format!(
                    "the guest agent of sandbox {id} predates port access (recreate the sandbox)"
                )),
                _ => agent_err(&self.socket, "connect", format!("{status}: {text}")),
            });
        }
        let (ours, theirs) = tokio::io::duplex(TUNNEL_BUF);
        let (mut pipe_rd, mut pipe_wr) = tokio::io::split(theirs);
        let mut incoming = resp.into_body();
        // Service → client. Ends at the response body's end (the service's EOF: the pipe's
        // write side shuts down, the caller reads EOF) or when the caller dropped its end.
        let down = async move {
            use tokio::io::AsyncWriteExt;
            while let Some(frame) = incoming.frame().await {
                let Ok(frame) = frame else { break };
                if let Ok(data) = frame.into_data() {
                    if pipe_wr.write_all(&data).await.is_err() {
                        return; // caller gone: dropping `incoming` resets the stream
                    }
                }
            }
            let _ = pipe_wr.shutdown().await;
        };
        // Client → service. The caller's shutdown (EOF here) ends the request body: the
        // agent half-closes the connection.
        let up = async move {
            use tokio::io::AsyncReadExt;
            loop {
                let mut buf = bytes::BytesMut::with_capacity(TUNNEL_BUF);
                match pipe_rd.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        if tx.send(buf.freeze()).await.is_err() {
                            return;
                        }
                    }
                }
            }
        };
        // Both directions in one task, which ends with both or when the caller drops its
        // end (`gone`: a shutdown alone is a half-close, not the end); with the task the
        // request body and `incoming` go, which resets the stream.
        let (gone_tx, gone_rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _permit = permit;
            tokio::select! {
                _ = async { tokio::join!(up, down) } => {}
                _ = gone_rx => {}
            }
        });
        Ok(Box::new(TunnelEnd {
            pipe: ours,
            _gone: gone_tx,
        }))
    }
}

/// The caller's end of an [`AgentClient::connect_port`] tunnel: the pipe, plus a sender
/// whose drop tells the pump task the caller is gone.
struct TunnelEnd {
    pipe: tokio::io::DuplexStream,
    _gone: tokio::sync::oneshot::Sender<()>,
}

impl tokio::io::AsyncRead for TunnelEnd {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.pipe).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TunnelEnd {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.pipe).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.pipe).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.pipe).poll_shutdown(cx)
    }
}

/// A request body fed through a channel by an upload's pump: `Some(item)` items, `None`
/// the end. The channel closing before `None` (the pump was dropped) is an error, so the
/// agent never commits a partial file.
struct RxBody {
    rx: tokio::sync::mpsc::Receiver<Option<std::io::Result<Bytes>>>,
    ended: bool,
}

impl futures::Stream for RxBody {
    type Item = std::io::Result<hyper::body::Frame<Bytes>>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if self.ended {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Some(item))) => Poll::Ready(Some(item.map(hyper::body::Frame::data))),
            Poll::Ready(Some(None)) => {
                self.ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(Some(Err(std::io::Error::other(
                    "upload abandoned before its end",
                ))))
            }
        }
    }
}
