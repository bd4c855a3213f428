//! Filtering DNS resolver of one sandbox (used by [`crate::net`]).
//!
//! Listens on UDP and TCP (RFC 1035 §4.2; TCP messages carry a two-byte length prefix) at
//! the host side of the sandbox's veth. For a standard query (OPCODE 0) with exactly one
//! question whose name the sandbox's [`AllowPolicy`] allows, it sends a *fresh* query (new
//! id, only that question, nothing from the sandbox's additional section) to the upstream
//! server, over the transport the sandbox used; it hands the A records of the answer section
//! to a callback (which puts them into the sandbox's nft set) and only then answers, with
//! TTLs capped at [`MAX_DNS_TTL`]. Every other query is answered REFUSED
//! (RFC 1035 §4.1.1, "for policy reasons") without contacting the upstream, so a name
//! cannot carry data out; malformed messages are dropped. Messages are parsed and encoded
//! with `hickory-proto`.
use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::RData;
use sandlot_api::AllowPolicy;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Largest TTL passed to the sandbox (answers with longer TTLs are rewritten to this), and
/// so the longest nft set element timeout in [`crate::net`]: a client never caches an
/// address longer than the node allows it.
pub const MAX_DNS_TTL: Duration = Duration::from_secs(3600);

/// Upstream answer deadline per attempt (UDP is tried twice).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Idle limit of a sandbox's TCP DNS connection.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// Queries in flight per sandbox; more are dropped (UDP) or wait (TCP accept).
const MAX_IN_FLIGHT: usize = 64;

/// Called with `(address, ttl_s)` of every A record of an answer to an allowed name,
/// before the answer is sent; an error turns the answer into SERVFAIL.
pub type OnAnswer = Arc<
    dyn Fn(Vec<(Ipv4Addr, u32)>) -> Pin<Box<dyn Future<Output = io::Result<()>> + Send>>
        + Send
        + Sync,
>;

/// Query counters of one resolver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Queries for allowed names answered from the upstream.
    pub forwarded: u64,
    /// Queries answered REFUSED (name not allowed, not a single standard query).
    pub refused: u64,
    /// Allowed queries answered SERVFAIL (upstream unreachable or bad, nft update failed).
    pub failed: u64,
}

/// One query the resolver answered REFUSED, kept for the audit (`violation` events, layer
/// `dns`, of the exec that asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The question's name as asked (ASCII, trailing dot); empty when the message had none.
    pub name: String,
    /// The question's type (`A`, `TXT`, ...); `-` when the message had none.
    pub qtype: String,
    /// When it was refused, Unix milliseconds (the node's clock).
    pub time_unix_ms: u64,
}

/// Most refusals a resolver keeps until they are taken (older ones are dropped; the
/// `refused` counter still counts them).
pub const MAX_REFUSALS: usize = 256;

#[derive(Default)]
struct Counters {
    forwarded: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    refusals: std::sync::Mutex<std::collections::VecDeque<Refusal>>,
}

impl Counters {
    /// Counts a refusal of `req` and keeps its question.
    fn refuse(&self, req: &Message) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let q = req.queries().first();
        let r = Refusal {
            name: q.map(|q| q.name().to_ascii()).unwrap_or_default(),
            qtype: q
                .map(|q| q.query_type().to_string())
                .unwrap_or_else(|| "-".into()),
            time_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        };
        let mut v = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() == MAX_REFUSALS {
            v.pop_front();
        }
        v.push_back(r);
    }
}

struct Ctx {
    upstream: SocketAddr,
    policy: Arc<AllowPolicy>,
    on_answer: OnAnswer,
    counters: Counters,
}

/// A running resolver (one UDP and one TCP listener task).
pub struct Resolver {
    tasks: Vec<JoinHandle<()>>,
    ctx: Arc<Ctx>,
}

impl Resolver {
    /// Binds UDP and TCP on `bind` and starts serving.
    ///
    /// # Errors
    /// The bind error (e.g. `EADDRNOTAVAIL` when the address is not on a local interface).
    pub async fn start(
        bind: SocketAddr,
        upstream: SocketAddr,
        policy: Arc<AllowPolicy>,
        on_answer: OnAnswer,
    ) -> io::Result<Resolver> {
        let udp = Arc::new(UdpSocket::bind(bind).await?);
        let tcp = TcpListener::bind(bind).await?;
        let ctx = Arc::new(Ctx {
            upstream,
            policy,
            on_answer,
            counters: Counters::default(),
        });
        let tasks = vec![
            tokio::spawn(serve_udp(udp, ctx.clone())),
            tokio::spawn(serve_tcp(tcp, ctx.clone())),
        ];
        Ok(Resolver { tasks, ctx })
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        let c = &self.ctx.counters;
        Stats {
            forwarded: c.forwarded.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
        }
    }

    /// Takes the kept refusals stamped at or before `until_ms` (Unix ms), oldest first.
    pub fn take_refusals(&self, until_ms: u64) -> Vec<Refusal> {
        let mut v = self
            .ctx
            .counters
            .refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let n = v.iter().take_while(|r| r.time_unix_ms <= until_ms).count();
        v.drain(..n).collect()
    }

    /// Stops the listeners and waits until their sockets are closed. Queries in flight on
    /// per-query tasks may still finish.
    pub async fn stop(self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }

    /// Stops the listeners without waiting (for `Drop`).
    pub fn abort(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn serve_udp(sock: Arc<UdpSocket>, ctx: Arc<Ctx>) {
    let limit = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "dns udp recv");
                continue;
            }
        };
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            continue; // overload: drop, the client retries
        };
        let query = buf[..n].to_vec();
        let (sock, ctx) = (sock.clone(), ctx.clone());
        tokio::spawn(async move {
            if let Some(reply) = handle(&ctx, &query, false).await {
                let _ = sock.send_to(&reply, peer).await;
            }
            drop(permit);
        });
    }
}

async fn serve_tcp(listener: TcpListener, ctx: Arc<Ctx>) {
    let limit = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    loop {
        let Ok(permit) = limit.clone().acquire_owned().await else {
            return;
        };
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let _ = serve_tcp_conn(stream, &ctx).await;
            drop(permit);
        });
    }
}

async fn read_framed(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let len = stream.read_u16().await? as usize;
    let mut msg = vec![0u8; len];
    stream.read_exact(&mut msg).await?;
    Ok(msg)
}

async fn write_framed(stream: &mut TcpStream, msg: &[u8]) -> io::Result<()> {
    let len = u16::try_from(msg.len()).map_err(|_| io::Error::other("DNS message too long"))?;
    let mut out = Vec::with_capacity(msg.len() + 2);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(msg);
    stream.write_all(&out).await
}

async fn serve_tcp_conn(mut stream: TcpStream, ctx: &Ctx) -> io::Result<()> {
    loop {
        let query = match tokio::time::timeout(TCP_IDLE, read_framed(&mut stream)).await {
            Ok(r) => r?,
            Err(_) => return Ok(()),
        };
        match handle(ctx, &query, true).await {
            Some(reply) => write_framed(&mut stream, &reply).await?,
            None => return Ok(()),
        }
    }
}

fn error_reply(req: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::error_msg(req.id(), req.op_code(), code);
    m.add_queries(req.queries().to_vec());
    m.set_recursion_desired(req.recursion_desired());
    m.set_recursion_available(true);
    m.to_vec().ok()
}

/// The answer to one query message, or `None` to stay silent (unparsable, not a query).
async fn handle(ctx: &Ctx, raw: &[u8], tcp: bool) -> Option<Vec<u8>> {
    let req = Message::from_vec(raw).ok()?;
    if req.message_type() != MessageType::Query {
        return None;
    }
    let c = &ctx.counters;
    if req.op_code() != OpCode::Query || req.queries().len() != 1 {
        c.refuse(&req);
        return error_reply(&req, ResponseCode::Refused);
    }
    let q = &req.queries()[0];
    if !ctx.policy.allows_name(&q.name().to_ascii()) {
        c.refuse(&req);
        tracing::debug!(name = %q.name(), "dns refused by policy");
        return error_reply(&req, ResponseCode::Refused);
    }
    match forward(ctx, &req, tcp).await {
        Ok(reply) => {
            c.forwarded.fetch_add(1, Ordering::Relaxed);
            Some(reply)
        }
        Err(e) => {
            c.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(name = %q.name(), error = %e, "dns forward failed");
            error_reply(&req, ResponseCode::ServFail)
        }
    }
}

async fn forward(ctx: &Ctx, req: &Message, tcp: bool) -> io::Result<Vec<u8>> {
    let id: u16 = rand_id();
    let mut up = Message::new();
    up.set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(req.queries()[0].clone());
    let bytes = up.to_vec().map_err(io::Error::other)?;
    let raw = if tcp {
        tokio::time::timeout(UPSTREAM_TIMEOUT * 2, async {
            let mut s = TcpStream::connect(ctx.upstream).await?;
            write_framed(&mut s, &bytes).await?;
            read_framed(&mut s).await
        })
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "upstream TCP timed out"))??
    } else {
        udp_exchange(ctx.upstream, &bytes, id).await?
    };
    let mut resp = Message::from_vec(&raw).map_err(io::Error::other)?;
    if resp.id() != id || resp.message_type() != MessageType::Response {
        return Err(io::Error::other("upstream answered another message"));
    }
    let mut addrs = Vec::new();
    let max = MAX_DNS_TTL.as_secs() as u32;
    for r in resp.answers_mut().iter_mut() {
        if r.ttl() > max {
            r.set_ttl(max);
        }
    }
    for r in resp.name_servers_mut().iter_mut() {
        if r.ttl() > max {
            r.set_ttl(max);
        }
    }
    for r in resp.answers() {
        if let RData::A(a) = r.data() {
            addrs.push((a.0, r.ttl()));
        }
    }
    // Additional records (glue, EDNS) are not passed to the sandbox.
    let _ = resp.take_additionals();
    (ctx.on_answer)(addrs).await?;
    resp.set_id(req.id());
    resp.set_recursion_desired(req.recursion_desired());
    resp.to_vec().map_err(io::Error::other)
}

async fn udp_exchange(upstream: SocketAddr, bytes: &[u8], id: u16) -> io::Result<Vec<u8>> {
    let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
    sock.connect(upstream).await?;
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        sock.send(bytes).await?;
        let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
        loop {
            match tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                Err(_) => break,
                Ok(Err(e)) => return Err(e),
                Ok(Ok(n)) if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id => {
                    return Ok(buf[..n].to_vec())
                }
                Ok(Ok(_)) => continue, // stray datagram
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("upstream {upstream} did not answer"),
    ))
}

fn rand_id() -> u16 {
    // The upstream exchange is on a fresh connected socket with a random source port; a
    // random id on top makes off-path spoofing harder (RFC 5452 §9.2).
    rand::random()
}
