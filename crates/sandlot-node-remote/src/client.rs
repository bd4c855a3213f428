//! The server side: [`RemoteNode`], a [`Node`] whose calls go to a node's [`crate::router`]
//! over HTTP/2 cleartext (prior knowledge).
use crate::wire::{
    line, BulkCall, ControlFrame, ControlStart, ExecCall, ExecFrame, ForkCall, LineBuf, MkdirCall,
    ReadoptCall, VolatileFiles,
};
use async_trait::async_trait;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bytes::Bytes;
use futures::StreamExt;
use reqwest::{Method, RequestBuilder, StatusCode, Url};
use sandlot_api::{ExecRequest, ExecResult, FileEntry};
use sandlot_node_api::{
    CheckpointMeta, ExecControl, ExecSink, Node, NodeError, NodeInfo, NodeResult, SandboxSpec,
    SandboxStatus, WireError,
};
use serde::de::DeserializeOwned;
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;

/// Time limits of a [`RemoteNode`].
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Limit on opening the TCP connection (default 5 s).
    pub connect_timeout: Duration,
    /// Limit on every call but the two execs, from sending to the whole answer read
    /// (default 300 s: creates pull and unpack images, deletes unmount).
    pub call_timeout: Duration,
    /// An exec's limit is its own `timeout_s` (default 60 s) plus this (default 60 s: the
    /// node's start-up of the command, the kill at timeout, the answer).
    pub exec_grace: Duration,
    /// HTTP/2 PING interval on the connection, also while idle; a PING unanswered for
    /// twice this closes the connection, so a node gone dark fails an exec that waits on
    /// it long before the exec's own limit (default 10 s).
    pub keepalive: Duration,
    /// PEM certificates (one or more) trusted, beside the system's roots, for the
    /// certificate of an `https://` node: the CA that signed the nodes' certificates
    /// (`sandlot server --node-ca`). Unused for `http://` nodes (default: none).
    pub tls_ca_pem: Option<Vec<u8>>,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            connect_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(300),
            exec_grace: Duration::from_secs(60),
            keepalive: Duration::from_secs(10),
            tls_ca_pem: None,
        }
    }
}

/// A node reached over its HTTP API ([`crate::router`]). Cheap to share (`Arc` it); one
/// HTTP/2 connection carries all calls (re-opened after it breaks).
///
/// Every failure to reach the node or to read its whole answer is
/// [`NodeError::Transport`]; errors the node answered keep their kind
/// ([`NodeError::from_wire`]); `401` is `PermissionDenied`.
pub struct RemoteNode {
    base: Url,
    token: Option<String>,
    http: reqwest::Client,
    info: NodeInfo,
    opts: RemoteOptions,
}

impl std::fmt::Debug for RemoteNode {
    /// The URL and node name; never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteNode")
            .field("url", &self.base.as_str())
            .field("name", &self.info.name)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What reaches nodes: one HTTP/2 client with [`RemoteOptions`]' timeouts and trusted CAs,
/// shared by every [`RemoteNode`] connected through it (one connection per node). Cheap to
/// clone. Build it once per set of options: each build loads the system's CA roots (tens
/// of milliseconds of CPU and about a MiB of memory; a server that built one per node
/// spent most of its start-up on 160 nodes doing that).
#[derive(Clone)]
pub struct NodeConnector {
    http: reqwest::Client,
    opts: RemoteOptions,
}

impl std::fmt::Debug for NodeConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConnector")
            .field("opts", &self.opts)
            .finish()
    }
}

impl NodeConnector {
    /// The client `opts` describe.
    ///
    /// # Errors
    /// `InvalidArgument` for a [`RemoteOptions::tls_ca_pem`] that is not PEM certificates;
    /// `Internal` when the TLS library cannot build a client.
    pub fn new(opts: RemoteOptions) -> NodeResult<NodeConnector> {
        let mut builder = reqwest::Client::builder();
        if let Some(pem) = &opts.tls_ca_pem {
            let cas = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| {
                NodeError::InvalidArgument(format!("node CA certificates (PEM): {}", chain(&e)))
            })?;
            if cas.is_empty() {
                return Err(NodeError::InvalidArgument(
                    "node CA certificates (PEM): no certificate found".into(),
                ));
            }
            for ca in cas {
                builder = builder.add_root_certificate(ca);
            }
        }
        let http = builder
            .http2_prior_knowledge()
            .connect_timeout(opts.connect_timeout)
            .http2_keep_alive_interval(Some(opts.keepalive))
            .http2_keep_alive_timeout(opts.keepalive * 2)
            .http2_keep_alive_while_idle(true)
            .no_proxy()
            .build()
            .map_err(|e| NodeError::io("HTTP client", std::io::Error::other(chain(&e))))?;
        Ok(NodeConnector { http, opts })
    }

    /// A client of the node at `url` (`http://host:port`, or `https://host:port` for a
    /// node serving TLS, [`crate::serve_tls`]), sending `token` as `Authorization:
    /// Bearer`; asks the node for its [`NodeInfo`] once (what [`Node::info`] answers from
    /// then on).
    ///
    /// # Errors
    /// `InvalidArgument` for a URL that is not `http://…` or `https://…`; `Transport`
    /// when the node cannot be reached, its certificate is not trusted (or not for the
    /// URL's host), or it does not answer within `call_timeout`; `PermissionDenied` for a
    /// refused token.
    pub async fn connect(&self, url: &str, token: Option<String>) -> NodeResult<RemoteNode> {
        let base = Url::parse(url)
            .map_err(|e| NodeError::InvalidArgument(format!("node URL {url:?}: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(NodeError::InvalidArgument(format!(
                "node URL {url:?} is not http://host:port or https://host:port"
            )));
        }
        let mut node = RemoteNode {
            base,
            token,
            http: self.http.clone(),
            info: NodeInfo {
                name: String::new(),
                backends: Vec::new(),
                cgroup_version: String::new(),
                runtimes: Vec::new(),
                accel: None,
                warm_pools: Vec::new(),
            },
            opts: self.opts.clone(),
        };
        node.info = node.call(node.req(Method::GET, &["info"])).await?;
        Ok(node)
    }
}

impl RemoteNode {
    /// [`RemoteNode::connect_with`] with [`RemoteOptions::default`].
    ///
    /// # Errors
    /// As [`RemoteNode::connect_with`].
    pub async fn connect(url: &str, token: Option<String>) -> NodeResult<RemoteNode> {
        Self::connect_with(url, token, RemoteOptions::default()).await
    }

    /// A client of the node at `url` under `opts`: [`NodeConnector::new`] then
    /// [`NodeConnector::connect`]. To reach many nodes, build one [`NodeConnector`] and
    /// connect each through it.
    ///
    /// # Errors
    /// As [`NodeConnector::new`] and [`NodeConnector::connect`].
    pub async fn connect_with(
        url: &str,
        token: Option<String>,
        opts: RemoteOptions,
    ) -> NodeResult<RemoteNode> {
        NodeConnector::new(opts)?.connect(url, token).await
    }

    /// The node's base URL.
    pub fn url(&self) -> &Url {
        &self.base
    }

    fn url_of(&self, segments: &[&str]) -> Url {
        let mut u = self.base.clone();
        u.path_segments_mut()
            .expect("checked: can be a base")
            .pop_if_empty()
            .push("v1")
            .extend(segments);
        u
    }

    fn req(&self, method: Method, segments: &[&str]) -> RequestBuilder {
        let rb = self.http.request(method, self.url_of(segments));
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    fn transport(&self, e: &reqwest::Error) -> NodeError {
        NodeError::Transport(format!("node {}: {}", self.base, chain(e)))
    }

    async fn limit<T>(
        &self,
        limit: Duration,
        what: &str,
        fut: impl Future<Output = NodeResult<T>>,
    ) -> NodeResult<T> {
        match tokio::time::timeout(limit, fut).await {
            Ok(r) => r,
            Err(_) => Err(NodeError::Transport(format!(
                "node {}: no whole answer to {what} within {:.1} s",
                self.base,
                limit.as_secs_f64()
            ))),
        }
    }

    /// The response when 2xx, else its error.
    async fn check(&self, resp: reqwest::Response) -> NodeResult<reqwest::Response> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = resp.bytes().await.map_err(|e| self.transport(&e))?;
        let wire = serde_json::from_slice::<WireError>(&body).ok();
        if status == StatusCode::UNAUTHORIZED {
            return Err(NodeError::PermissionDenied(
                wire.map(|w| w.message)
                    .unwrap_or_else(|| format!("node {} refused the token (401)", self.base)),
            ));
        }
        match wire {
            Some(w) => Err(NodeError::from_wire(w)),
            None => {
                let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
                let m = format!(
                    "node {}: HTTP {status} without a node error: {text}",
                    self.base
                );
                // Something between us and the node answered (a proxy): the call may not
                // have reached the node.
                if matches!(
                    status,
                    StatusCode::BAD_GATEWAY
                        | StatusCode::SERVICE_UNAVAILABLE
                        | StatusCode::GATEWAY_TIMEOUT
                ) {
                    Err(NodeError::Transport(m))
                } else {
                    Err(NodeError::io(m, std::io::Error::other("unexpected answer")))
                }
            }
        }
    }

    /// The whole body of `resp` when 2xx, else its error ([`RemoteNode::check`]).
    async fn body(&self, resp: reqwest::Response) -> NodeResult<Bytes> {
        let resp = self.check(resp).await?;
        resp.bytes().await.map_err(|e| self.transport(&e))
    }

    async fn raw(&self, rb: RequestBuilder) -> NodeResult<Bytes> {
        let fut = async {
            let resp = rb.send().await.map_err(|e| self.transport(&e))?;
            self.body(resp).await
        };
        self.limit(self.opts.call_timeout, "a node call", fut).await
    }

    async fn call<T: DeserializeOwned>(&self, rb: RequestBuilder) -> NodeResult<T> {
        let body = self.raw(rb).await?;
        self.parse(&body)
    }

    /// The JSON answer `body` of a 2xx response.
    fn parse<T: DeserializeOwned>(&self, body: &[u8]) -> NodeResult<T> {
        serde_json::from_slice(body).map_err(|e| {
            NodeError::io(
                format!("node {}: answer not understood", self.base),
                std::io::Error::other(e),
            )
        })
    }

    async fn unit(&self, rb: RequestBuilder) -> NodeResult<()> {
        self.raw(rb).await.map(|_| ())
    }

    /// A bulk call (`verb`: `pause` or `resume`, [`crate::wire::BulkCall`]): per-id
    /// results in order. A call that fails as a whole is each id's error (a transport
    /// failure: each outcome unknown); an answer of the wrong length is an `Internal`
    /// error for each id. A node older than the bulk routes (HTTP 404 whose body is no
    /// node error) gets the one-id calls instead, 32 at a time
    /// ([`sandlot_node_api::bulk`]), so a label pause works during a rolling upgrade.
    async fn bulk(&self, verb: &str, ids: &[String]) -> Vec<NodeResult<()>> {
        let mut out = Vec::with_capacity(ids.len());
        for part in ids.chunks(sandlot_node_api::BULK_MAX_IDS) {
            let call = BulkCall { ids: part.to_vec() };
            let v = match self.bulk_call(verb, &call).await {
                Ok(Some(v)) => v,
                Ok(None) => {
                    let calls = part.iter().map(|id| async move {
                        match verb {
                            "pause" => self.pause(id).await,
                            _ => self.resume(id).await,
                        }
                    });
                    out.extend(sandlot_node_api::bulk(calls.collect()).await);
                    continue;
                }
                Err(e) => {
                    let w = e.to_wire();
                    out.extend(part.iter().map(|_| Err(NodeError::from_wire(w.clone()))));
                    continue;
                }
            };
            if v.len() == part.len() {
                out.extend(v.into_iter().map(|w| match w {
                    None => Ok(()),
                    Some(w) => Err(NodeError::from_wire(w)),
                }));
            } else {
                let m = format!(
                    "node {}: {} results to a {verb} of {} ids",
                    self.base,
                    v.len(),
                    part.len()
                );
                out.extend(part.iter().map(|_| {
                    Err(NodeError::io(
                        m.clone(),
                        std::io::Error::other("bad answer"),
                    ))
                }));
            }
        }
        out
    }

    /// One `POST /v1/{verb}`: the per-id answers, or `None` when the node has no such
    /// route (404 without a node error in the body).
    async fn bulk_call(
        &self,
        verb: &str,
        call: &BulkCall,
    ) -> NodeResult<Option<Vec<Option<WireError>>>> {
        let fut = async {
            let resp = self
                .req(Method::POST, &[verb])
                .json(call)
                .send()
                .await
                .map_err(|e| self.transport(&e))?;
            if resp.status() == StatusCode::NOT_FOUND {
                let body = resp.bytes().await.map_err(|e| self.transport(&e))?;
                return match serde_json::from_slice::<WireError>(&body) {
                    Ok(w) => Err(NodeError::from_wire(w)),
                    Err(_) => Ok(None),
                };
            }
            self.parse(&self.body(resp).await?).map(Some)
        };
        self.limit(self.opts.call_timeout, "a node call", fut).await
    }

    fn exec_limit(&self, req: &ExecRequest) -> Duration {
        let t = req.timeout_s.unwrap_or(60.0);
        let t = if t.is_finite() {
            t.clamp(0.0, 86_400.0)
        } else {
            86_400.0
        };
        Duration::from_secs_f64(t) + self.opts.exec_grace
    }

    /// Sends an exec call and reads its NDJSON answer: events to `sink`, then the result.
    async fn exec_stream(
        &self,
        rb: RequestBuilder,
        sink: Option<ExecSink>,
        limit: Duration,
    ) -> NodeResult<ExecResult> {
        let fut = async {
            let resp = rb.send().await.map_err(|e| self.transport(&e))?;
            let resp = self.check(resp).await?;
            let mut body = resp.bytes_stream();
            let mut lines = LineBuf::default();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| self.transport(&e))?;
                let got = lines.push(&chunk).map_err(|m| {
                    NodeError::io(
                        format!("node {}: exec answer", self.base),
                        std::io::Error::other(m),
                    )
                })?;
                for l in got {
                    let frame = serde_json::from_slice::<ExecFrame>(&l).map_err(|e| {
                        NodeError::io(
                            format!("node {}: exec frame not understood", self.base),
                            std::io::Error::other(e),
                        )
                    })?;
                    match frame {
                        ExecFrame::Event(ev) => {
                            if let Some(s) = &sink {
                                // A closed receiver does not stop the exec.
                                let _ = s.send(ev).await;
                            }
                        }
                        ExecFrame::Result(r) => return Ok(r),
                        ExecFrame::Error(w) => return Err(NodeError::from_wire(w)),
                    }
                }
            }
            Err(NodeError::Transport(format!(
                "node {}: the exec stream ended without its result",
                self.base
            )))
        };
        self.limit(limit, "an exec", fut).await
    }
}

/// Forwards live stdin and signals as request frames until both are closed (then the
/// request stream ends) or the request stream is gone.
async fn forward(tx: mpsc::Sender<Bytes>, control: ExecControl) {
    let ExecControl {
        mut stdin,
        mut signals,
        ..
    } = control;
    let mut signals_open = true;
    loop {
        let frame = tokio::select! {
            c = async { stdin.as_mut().expect("guarded").recv().await }, if stdin.is_some() => match c {
                Some(b) => ControlFrame::Stdin(B64.encode(&b)),
                None => {
                    stdin = None;
                    ControlFrame::StdinEof
                }
            },
            s = signals.recv(), if signals_open => match s {
                Some(s) => ControlFrame::Signal(s),
                None => {
                    signals_open = false;
                    continue;
                }
            },
            else => return,
        };
        if tx.send(line(&frame)).await.is_err() {
            return;
        }
    }
}

#[async_trait]
impl Node for RemoteNode {
    fn info(&self) -> NodeInfo {
        self.info.clone()
    }

    async fn create(&self, spec: &SandboxSpec) -> NodeResult<()> {
        self.unit(self.req(Method::POST, &["sandboxes"]).json(spec))
            .await
    }

    async fn exec(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
    ) -> NodeResult<ExecResult> {
        let call = ExecCall {
            request: req.clone(),
            stream: sink.is_some(),
        };
        let rb = self
            .req(Method::POST, &["sandboxes", id, "exec"])
            .json(&call);
        self.exec_stream(rb, sink, self.exec_limit(req)).await
    }

    async fn exec_controlled(
        &self,
        id: &str,
        req: &ExecRequest,
        sink: Option<ExecSink>,
        control: ExecControl,
    ) -> NodeResult<ExecResult> {
        let start = ControlFrame::Start(ControlStart {
            request: req.clone(),
            stream: sink.is_some(),
            stdin: control.stdin.is_some(),
            handle: control.handle.clone(),
        });
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        tx.try_send(line(&start)).expect("room for the first frame");
        let _forwarder = AbortOnDrop(tokio::spawn(forward(tx, control)));
        let body = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
        });
        let rb = self
            .req(Method::POST, &["sandboxes", id, "exec-controlled"])
            .header(reqwest::header::CONTENT_TYPE, "application/x-ndjson")
            .body(reqwest::Body::wrap_stream(body));
        self.exec_stream(rb, sink, self.exec_limit(req)).await
    }

    async fn connect_port(&self, id: &str, port: u16) -> NodeResult<sandlot_node_api::PortConn> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // One full-duplex HTTP/2 stream (the node's `POST …/ports/{port}`): the request
        // body carries our bytes, the answer body the sandbox's. The caller gets one end of
        // an in-memory pipe; two tasks move bytes between its other end and the stream.
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let body = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
        });
        let rb = self
            .req(Method::POST, &["sandboxes", id, "ports", &port.to_string()])
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(reqwest::Body::wrap_stream(body));
        let fut = async {
            let resp = rb.send().await.map_err(|e| self.transport(&e))?;
            self.check(resp).await
        };
        let resp = self
            .limit(self.opts.connect_timeout * 3, "a port connect", fut)
            .await?;
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let (mut our_rd, mut our_wr) = tokio::io::split(ours);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match our_rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => {
                        if tx.send(Bytes::copy_from_slice(&buf[..k])).await.is_err() {
                            break;
                        }
                    }
                }
            }
            // Dropping `tx` ends the request body: the node half-closes the connection.
        });
        tokio::spawn(async move {
            let mut stream = resp.bytes_stream();
            while let Some(Ok(chunk)) = stream.next().await {
                if our_wr.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            let _ = our_wr.shutdown().await;
        });
        Ok(Box::new(theirs))
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> NodeResult<Vec<u8>> {
        let s = self.read_file_stream(id, path, max_bytes).await?;
        let fut = async {
            let mut s = s;
            let mut data = Vec::new();
            while let Some(c) = sandlot_node_api::next_chunk(&mut s).await {
                let c = c.map_err(|e| {
                    NodeError::Transport(format!("node {}: read of {path}: {e}", self.base))
                })?;
                data.extend_from_slice(&c);
            }
            Ok(data)
        };
        self.limit(self.opts.call_timeout, "a node call", fut).await
    }

    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        max_bytes: u64,
    ) -> NodeResult<sandlot_node_api::ByteStream> {
        let rb = self
            .req(Method::GET, &["sandboxes", id, "files", "content"])
            .query(&[("path", path), ("max_bytes", &max_bytes.to_string())]);
        let fut = async {
            let resp = rb.send().await.map_err(|e| self.transport(&e))?;
            self.check(resp).await
        };
        let resp = self
            .limit(self.opts.call_timeout, "a node call", fut)
            .await?;
        let base = self.base.clone();
        let path = path.to_string();
        let mut done = 0u64;
        let s = resp.bytes_stream().map(move |c| {
            let c = c.map_err(|e| std::io::Error::other(format!("node {base}: {}", chain(&e))))?;
            done += c.len() as u64;
            if done > max_bytes {
                return Err(std::io::Error::other(format!(
                    "node {base}: read of {path} answered over {max_bytes} bytes"
                )));
            }
            Ok(c)
        });
        Ok(Box::pin(s))
    }

    async fn file_size(&self, id: &str, path: &str) -> NodeResult<u64> {
        self.call(
            self.req(Method::GET, &["sandboxes", id, "files", "size"])
                .query(&[("path", path)]),
        )
        .await
    }

    async fn write_file(&self, id: &str, path: &str, data: Bytes) -> NodeResult<()> {
        self.write_file_stream(id, path, sandlot_node_api::chunked(data), u64::MAX)
            .await
            .map(|_| ())
    }

    /// The body goes out as it comes (chunked HTTP); the node writes it as it arrives. No
    /// overall time limit (the upload lasts as long as its client): the connection's own
    /// timeouts apply.
    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        body: sandlot_node_api::ByteStream,
        max_bytes: u64,
    ) -> NodeResult<u64> {
        use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
        use std::sync::Arc;
        // Why our side broke the body: 1 over the limit, 2 the source broke off.
        let why = Arc::new(AtomicU8::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        let (w, n) = (why.clone(), sent.clone());
        let body = body.map(move |c| match c {
            Err(e) => {
                w.store(2, Ordering::SeqCst);
                Err(e)
            }
            Ok(c) => {
                if n.fetch_add(c.len() as u64, Ordering::SeqCst) + c.len() as u64 > max_bytes {
                    w.store(1, Ordering::SeqCst);
                    return Err(std::io::Error::other("over the limit"));
                }
                Ok(c)
            }
        });
        let mut q = vec![("path", path.to_string())];
        if max_bytes != u64::MAX {
            q.push(("max_bytes", max_bytes.to_string()));
        }
        let rb = self
            .req(Method::PUT, &["sandboxes", id, "files", "content"])
            .query(&q)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(reqwest::Body::wrap_stream(body));
        let r = async {
            let resp = rb.send().await.map_err(|e| self.transport(&e))?;
            let resp = self.check(resp).await?;
            resp.bytes().await.map_err(|e| self.transport(&e))
        }
        .await;
        match why.load(Ordering::SeqCst) {
            1 => Err(sandlot_node_api::over_limit(path, max_bytes)),
            2 => Err(sandlot_node_api::broke_off(
                path,
                &std::io::Error::other("the body ended with an error"),
            )),
            _ => r.map(|_| sent.load(Ordering::SeqCst)),
        }
    }

    async fn write_files_volatile(&self, id: &str, files: Vec<(String, Bytes)>) -> NodeResult<()> {
        let body = VolatileFiles {
            files: files
                .into_iter()
                .map(|(p, d)| (p, B64.encode(&d)))
                .collect(),
        };
        self.unit(
            self.req(Method::POST, &["sandboxes", id, "files", "volatile"])
                .json(&body),
        )
        .await
    }

    async fn list_dir(&self, id: &str, path: &str) -> NodeResult<Vec<FileEntry>> {
        self.call(
            self.req(Method::GET, &["sandboxes", id, "files", "list"])
                .query(&[("path", path)]),
        )
        .await
    }

    async fn remove_file(&self, id: &str, path: &str) -> NodeResult<()> {
        self.unit(
            self.req(Method::DELETE, &["sandboxes", id, "files"])
                .query(&[("path", path)]),
        )
        .await
    }

    async fn stat_file(&self, id: &str, path: &str) -> NodeResult<FileEntry> {
        self.call(
            self.req(Method::GET, &["sandboxes", id, "files", "stat"])
                .query(&[("path", path)]),
        )
        .await
    }

    async fn make_dir(&self, id: &str, path: &str, parents: bool) -> NodeResult<()> {
        let body = MkdirCall {
            path: path.to_owned(),
            parents,
        };
        self.unit(
            self.req(Method::POST, &["sandboxes", id, "files", "mkdir"])
                .json(&body),
        )
        .await
    }

    async fn pause(&self, id: &str) -> NodeResult<()> {
        self.unit(self.req(Method::POST, &["sandboxes", id, "pause"]))
            .await
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.unit(self.req(Method::POST, &["sandboxes", id, "resume"]))
            .await
    }

    /// One `POST /v1/pause` for all of `ids` (in slices of `BULK_MAX_IDS`); a call that
    /// fails as a whole (transport, refused) is every id's error.
    async fn pause_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.bulk("pause", ids).await
    }

    /// One `POST /v1/resume` for all of `ids`, as [`RemoteNode::pause_many`].
    async fn resume_many(&self, ids: &[String]) -> Vec<NodeResult<()>> {
        self.bulk("resume", ids).await
    }

    async fn adopt_snapshot(&self, id: &str) -> NodeResult<()> {
        self.unit(self.req(Method::POST, &["sandboxes", id, "adopt-snapshot"]))
            .await
    }

    async fn delete(&self, id: &str) -> NodeResult<()> {
        self.unit(self.req(Method::DELETE, &["sandboxes", id]))
            .await
    }

    async fn list(&self) -> NodeResult<Vec<SandboxStatus>> {
        self.call(self.req(Method::GET, &["sandboxes"])).await
    }

    async fn list_not_alive(&self) -> NodeResult<Vec<SandboxStatus>> {
        let req = self
            .req(Method::GET, &["sandboxes"])
            .query(&[("liveness", "not_alive")]);
        let mut list: Vec<SandboxStatus> = self.call(req).await?;
        // A node from before the filter ignores the query and sends every sandbox.
        list.retain(|s| !s.liveness.is_alive());
        Ok(list)
    }

    async fn readopt(&self, keep: &[String]) -> NodeResult<Vec<String>> {
        let body = ReadoptCall {
            keep: keep.to_vec(),
        };
        self.call(self.req(Method::POST, &["readopt"]).json(&body))
            .await
    }

    async fn checkpoint(&self, id: &str, checkpoint_id: &str) -> NodeResult<CheckpointMeta> {
        self.call(self.req(
            Method::POST,
            &["sandboxes", id, "checkpoints", checkpoint_id],
        ))
        .await
    }

    async fn create_from_checkpoint(
        &self,
        spec: &SandboxSpec,
        checkpoint_id: &str,
    ) -> NodeResult<()> {
        let body = ForkCall {
            spec: spec.clone(),
            checkpoint_id: checkpoint_id.to_owned(),
        };
        self.unit(
            self.req(Method::POST, &["sandboxes", "from-checkpoint"])
                .json(&body),
        )
        .await
    }

    async fn delete_checkpoint(&self, checkpoint_id: &str) -> NodeResult<()> {
        self.unit(self.req(Method::DELETE, &["checkpoints", checkpoint_id]))
            .await
    }

    async fn list_checkpoints(&self) -> NodeResult<Vec<String>> {
        self.call(self.req(Method::GET, &["checkpoints"])).await
    }

    /// The node's accelerator; `None` also when the node cannot be asked (this call has no
    /// error in the trait: the failure is logged).
    async fn process_spawn(
        &self,
        id: &str,
        req: sandlot_api::SpawnRequest,
    ) -> NodeResult<sandlot_api::Process> {
        self.call(
            self.req(Method::POST, &["sandboxes", id, "processes"])
                .json(&req),
        )
        .await
    }

    async fn process_list(&self, id: &str) -> NodeResult<Vec<sandlot_api::Process>> {
        self.call(self.req(Method::GET, &["sandboxes", id, "processes"]))
            .await
    }

    async fn process_get(&self, id: &str, pid: &str) -> NodeResult<sandlot_api::Process> {
        self.call(self.req(Method::GET, &["sandboxes", id, "processes", pid]))
            .await
    }

    /// The events as the node streams them; a connection that breaks mid-stream ends the
    /// stream without the `exit` event (logged): the caller reads on from its offsets.
    async fn process_output(
        &self,
        id: &str,
        pid: &str,
        cursor: sandlot_node_api::OutputCursor,
    ) -> NodeResult<sandlot_node_api::ProcessEvents> {
        let rb = self
            .req(Method::GET, &["sandboxes", id, "processes", pid, "output"])
            .query(&[
                ("stdout_offset", cursor.stdout_offset.to_string()),
                ("stderr_offset", cursor.stderr_offset.to_string()),
                ("follow", cursor.follow.to_string()),
            ]);
        let resp = self
            .limit(self.opts.call_timeout, "a process output call", async {
                let resp = rb.send().await.map_err(|e| self.transport(&e))?;
                self.check(resp).await
            })
            .await?;
        let base = self.base.to_string();
        let ready: std::collections::VecDeque<Vec<u8>> = Default::default();
        let state = (resp.bytes_stream(), LineBuf::default(), ready);
        Ok(Box::pin(futures::stream::unfold(
            state,
            move |(mut body, mut lines, mut ready)| {
                let base = base.clone();
                async move {
                    loop {
                        if let Some(l) = ready.pop_front() {
                            match serde_json::from_slice::<sandlot_api::ProcessEvent>(&l) {
                                Ok(ev) => return Some((ev, (body, lines, ready))),
                                Err(e) => {
                                    tracing::warn!(node = %base, error = %e, "process output event not understood");
                                    return None;
                                }
                            }
                        }
                        match body.next().await {
                            Some(Ok(chunk)) => match lines.push(&chunk) {
                                Ok(got) => ready.extend(got),
                                Err(m) => {
                                    tracing::warn!(node = %base, error = %m, "process output");
                                    return None;
                                }
                            },
                            Some(Err(e)) => {
                                tracing::warn!(node = %base, error = %chain(&e), "process output stream broke");
                                return None;
                            }
                            None => return None,
                        }
                    }
                }
            },
        )))
    }

    async fn process_wait(
        &self,
        id: &str,
        pid: &str,
        timeout: Duration,
    ) -> NodeResult<sandlot_api::Process> {
        let rb = self
            .req(Method::POST, &["sandboxes", id, "processes", pid, "wait"])
            .query(&[("timeout_ms", timeout.as_millis().to_string())]);
        let fut = async {
            let resp = rb.send().await.map_err(|e| self.transport(&e))?;
            self.parse(&self.body(resp).await?)
        };
        self.limit(timeout + self.opts.exec_grace, "a process wait", fut)
            .await
    }

    async fn process_signal(&self, id: &str, pid: &str, signal: i32) -> NodeResult<()> {
        self.unit(
            self.req(Method::POST, &["sandboxes", id, "processes", pid, "signal"])
                .json(&crate::wire::SignalCall { signal }),
        )
        .await
    }

    async fn process_stdin(&self, id: &str, pid: &str, data: Bytes, eof: bool) -> NodeResult<()> {
        self.unit(
            self.req(Method::POST, &["sandboxes", id, "processes", pid, "stdin"])
                .query(&[("eof", eof.to_string())])
                .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                .body(data),
        )
        .await
    }

    async fn process_resize(
        &self,
        id: &str,
        pid: &str,
        size: sandlot_api::PtySize,
    ) -> NodeResult<()> {
        self.unit(
            self.req(Method::POST, &["sandboxes", id, "processes", pid, "resize"])
                .json(&size),
        )
        .await
    }

    async fn process_remove(&self, id: &str, pid: &str) -> NodeResult<()> {
        self.unit(self.req(Method::DELETE, &["sandboxes", id, "processes", pid]))
            .await
    }

    async fn accel(&self) -> Option<String> {
        match self.call(self.req(Method::GET, &["accel"])).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(node = %self.base, error = %e, "cannot ask the node for its accelerator");
                None
            }
        }
    }
}
