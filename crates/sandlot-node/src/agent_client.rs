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
    encode, ExecExit, ExecRequest, Frame, FrameDecoder, FrameKind, PATH_EXEC, PATH_PING,
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
async fn connect_socket(path: &Path) -> std::io::Result<tokio::net::UnixStream> {
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

/// A client of one sandbox's agent.
pub struct AgentClient {
    socket: PathBuf,
    conn: tokio::sync::Mutex<Option<SendRequest<Full<Bytes>>>>,
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
            conn: tokio::sync::Mutex::new(None),
        }
    }

    async fn sender(&self) -> NodeResult<SendRequest<Full<Bytes>>> {
        let mut conn = self.conn.lock().await;
        if let Some(s) = conn.as_ref() {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        let stream = connect_socket(&self.socket)
            .await
            .map_err(|e| agent_err(&self.socket, "connect", e))?;
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
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
        let mut sender = self.sender().await?;
        let req = Request::builder()
            .method(method)
            .uri(format!("http://agent{path}"))
            .body(Full::new(body))
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
        let spec = serde_json::to_vec(req).expect("ExecRequest serialises");
        let mut body = encode(FrameKind::Spec, &spec);
        if let Some(data) = stdin {
            body.extend(encode(FrameKind::Stdin, data));
        }
        let resp = self.call(Method::POST, PATH_EXEC, body.into()).await?;
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            let text = resp
                .into_body()
                .collect()
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            return Err(agent_err(&self.socket, "exec", format!("{status}: {text}")));
        }
        Ok(ExecStream {
            body: resp.into_body(),
            dec: FrameDecoder::default(),
            socket: self.socket.clone(),
        })
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
