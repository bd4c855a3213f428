//! Connection handling that idle or slow clients cannot starve.
//!
//! Before this module the server ran `axum::serve`: no limit on connections, no timeout on a
//! connection that never sends a request, and an accept loop that sleeps a second on every
//! `EMFILE`. About 20,000 idle TCP connections (no API key needed: keys are checked per
//! request) used up the process's file descriptors; `accept` failed, `/v1/ping` hung, and the
//! node's `/proc` reads failed too (issue 25, item 1). Here, per connection and server-wide:
//!
//! - **Total and per-peer limits** ([`ConnLimits::max_connections`],
//!   [`ConnLimits::max_connections_per_ip`]). At a limit the oldest *idle* connection (no
//!   request in flight) of that scope is closed to make room, so a new client is served while
//!   connections that do nothing are the ones that go; when every connection of the scope is
//!   busy the new one is closed at once. The total limit is also held below half of the
//!   process's file-descriptor limit, so the node keeps descriptors for its own work.
//! - **Header-read timeout** ([`ConnLimits::header_read_timeout`]): a connection must deliver
//!   a complete request head within it, counted from its opening or from the first byte of
//!   its next request (slow-loris).
//! - **Idle timeout** ([`ConnLimits::idle_timeout`]): a keep-alive connection with no request
//!   in flight and no byte in either direction for that long is closed.
//! - **In-flight requests** ([`ConnLimits::max_requests_in_flight`]): over it a request is
//!   answered `503 unavailable` with `Retry-After: 1` at once (load shedding) instead of
//!   queueing; a streamed response holds its slot until its body ends. One peer address
//!   holds at most [`ConnLimits::per_ip_requests`] of them (default a quarter), so it cannot
//!   take every slot. Requests whose body is still arriving hold at most
//!   [`ConnLimits::body_requests`] of them (three quarters), so slow bodies from many
//!   addresses cannot take the slots of requests without a body (`GET`s, deletes, health
//!   checks, `/metrics`); a request gives this share back once its body has been read.
//! - **Write stalls** ([`ConnLimits::write_stall_timeout`]): an answer whose client
//!   accepts none of its next bytes for that long (an HTTP/2 stream window left at 0, a
//!   socket never read) has its connection closed (within twice the timeout), which frees
//!   its slot; time the server
//!   waits for the answer's own next bytes (a quiet exec stream) does not count.
//! - **Request-body pace** ([`ConnLimits::body_read_timeout`], [`ConnLimits::body_min_rate`],
//!   enforced by [`Paced`] around every request body): a body that sends nothing for the
//!   read timeout, or averages under the floor once waited on for that long, is answered
//!   `408 deadline_exceeded` and its connection closed, which frees its slot (a request head
//!   and then one body byte every 20 s used to hold a slot forever).
//! - **Accept errors** (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`): counted in
//!   `sandlot_accept_errors_total{error}`, the oldest idle connection is closed to free a
//!   descriptor, and accepting backs off (10 ms doubling to 1 s) instead of spinning.
//!
//! [`raise_nofile_limit`] lifts the soft `RLIMIT_NOFILE` to the hard one at start.
//! Metrics: `sandlot_connections` (open), `sandlot_connections_refused_total{reason}`,
//! `sandlot_connections_closed_total{reason}` (`evicted`, `header_timeout`, `idle_timeout`,
//! `write_stall`),
//! `sandlot_requests_shed_total{reason}` (`total`, `per_ip`, `body`),
//! `sandlot_request_body_timeouts_total`, `sandlot_accept_errors_total{error}`.
use crate::SharedState;
use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::Router;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use sandlot_api::ErrorCode;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

/// Connection limits and timeouts (`sandlot up --max-connections …`).
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// Open connections at most (default 16384; held below half the `RLIMIT_NOFILE` soft
    /// limit).
    pub max_connections: usize,
    /// Open connections per peer IP address at most (default 1024).
    pub max_connections_per_ip: usize,
    /// Longest time to receive a complete request head (default 10 s).
    pub header_read_timeout: Duration,
    /// Longest quiet time of a connection with no request in flight (default 60 s).
    pub idle_timeout: Duration,
    /// Longest time an answer may wait for its client to accept its next bytes (default
    /// 120 s): its connection is then closed (found within twice that).
    pub write_stall_timeout: Duration,
    /// Requests in flight server-wide at most (default 4096); more → 503 at once.
    pub max_requests_in_flight: usize,
    /// Requests in flight from one peer IP address at most; more → 503 at once (default
    /// `None`: a quarter of [`ConnLimits::max_requests_in_flight`], see
    /// [`ConnLimits::per_ip_requests`]).
    pub max_requests_in_flight_per_ip: Option<usize>,
    /// Longest wait for the next bytes of a request body (default 10 s); also the grace
    /// period before [`ConnLimits::body_min_rate`] applies. See [`Paced`].
    pub body_read_timeout: Duration,
    /// Lowest average rate of a request body, bytes per second of waiting for it, once it
    /// has been waited on for [`ConnLimits::body_read_timeout`] (default 1024; 0 = no rate
    /// floor).
    pub body_min_rate: u64,
}

impl ConnLimits {
    /// The per-peer in-flight request limit in force: the configured one, or a quarter of
    /// the total (at least 1).
    pub fn per_ip_requests(&self) -> usize {
        self.max_requests_in_flight_per_ip
            .unwrap_or(self.max_requests_in_flight / 4)
            .max(1)
    }

    /// How many requests may be in flight with their body still arriving: the total less a
    /// quarter kept for requests without a body (at least 1).
    pub fn body_requests(&self) -> usize {
        let total = self.max_requests_in_flight.max(1);
        (total - total / 4).max(1)
    }
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 16384,
            max_connections_per_ip: 1024,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            write_stall_timeout: Duration::from_secs(120),
            max_requests_in_flight: 4096,
            max_requests_in_flight_per_ip: None,
            body_read_timeout: Duration::from_secs(10),
            body_min_rate: 1024,
        }
    }
}

/// Raise the soft `RLIMIT_NOFILE` of this process to its hard limit; returns the soft limit
/// now in force.
///
/// # Errors
/// `getrlimit`/`setrlimit` failures.
pub fn raise_nofile_limit() -> io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io::Error::from)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(io::Error::from)?;
    }
    Ok(hard.max(soft))
}

/// The soft `RLIMIT_NOFILE` now (None when it cannot be read).
fn nofile_soft() -> Option<u64> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(s, _)| s)
}

/// The total connection limit in force: the configured one, held at or below half of the
/// descriptor limit (the rest stays for SQLite, sandboxes, pipes and `/proc` reads).
pub fn effective_max_connections(configured: usize, nofile: Option<u64>) -> usize {
    let cap = nofile.map_or(usize::MAX, |n| (n / 2).max(16) as usize);
    configured.min(cap).max(1)
}

/// Milliseconds since a process-wide start instant (monotonic).
fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// What the registry knows of one open connection.
#[derive(Debug)]
struct Conn {
    ip: IpAddr,
    /// Requests in flight on it (their response bodies included).
    in_flight: AtomicUsize,
    /// Last byte read or written, [`now_ms`].
    last_io: AtomicU64,
    /// Waiting for a request head since ([`now_ms`]; 0 = not waiting: idle before any byte
    /// of the next request, or a request in flight).
    head_since: AtomicU64,
    /// Answers waiting for the client to take their next bytes: since when ([`now_ms`]), by
    /// answer id ([`Guarded`]).
    client_waits: Mutex<HashMap<u64, u64>>,
    /// Notified when it is evicted.
    close: Notify,
}

impl Conn {
    /// Since when the longest-waiting answer has waited for the client ([`now_ms`]).
    fn oldest_client_wait(&self) -> Option<u64> {
        let w = self.client_waits.lock().unwrap_or_else(|p| p.into_inner());
        w.values().min().copied()
    }

    fn idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
    }
}

#[derive(Default)]
struct Table {
    next_id: u64,
    conns: BTreeMap<u64, Arc<Conn>>,
    per_ip: HashMap<IpAddr, usize>,
}

impl Table {
    fn remove(&mut self, id: u64) -> Option<Arc<Conn>> {
        let c = self.conns.remove(&id)?;
        if let Some(n) = self.per_ip.get_mut(&c.ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&c.ip);
            }
        }
        Some(c)
    }

    /// Close the oldest idle connection (of `ip` when given); true when one was found.
    fn evict_oldest_idle(&mut self, ip: Option<IpAddr>) -> bool {
        let victim = self
            .conns
            .iter()
            .find(|(_, c)| ip.is_none_or(|ip| c.ip == ip) && c.idle())
            .map(|(id, _)| *id);
        match victim.and_then(|id| self.remove(id)) {
            Some(c) => {
                c.close.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    PerIp,
    Total,
}

/// Open connections, their limits and the in-flight request slots.
pub struct ConnTable {
    limits: ConnLimits,
    max_total: usize,
    table: Mutex<Table>,
    slots: Arc<Semaphore>,
    /// Slots of requests whose body has not been read to its end ([`ConnLimits::body_requests`]).
    body_slots: Arc<Semaphore>,
    /// Requests in flight per peer IP address (absent: none).
    requests_per_ip: Mutex<HashMap<IpAddr, usize>>,
}

impl ConnTable {
    /// A table enforcing `limits` (the total limit as [`effective_max_connections`]).
    pub fn new(limits: ConnLimits) -> Self {
        let max_total = effective_max_connections(limits.max_connections, nofile_soft());
        let slots = Arc::new(Semaphore::new(limits.max_requests_in_flight.max(1)));
        let body_slots = Arc::new(Semaphore::new(limits.body_requests()));
        ConnTable {
            limits,
            max_total,
            table: Mutex::new(Table::default()),
            slots,
            body_slots,
            requests_per_ip: Mutex::new(HashMap::new()),
        }
    }

    /// Take one of `ip`'s in-flight request slots ([`ConnLimits::per_ip_requests`]); `None`
    /// when that address has all of its slots in flight.
    fn try_ip_slot(self: &Arc<Self>, ip: IpAddr) -> Option<IpSlot> {
        let mut m = self
            .requests_per_ip
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_default();
        // The limit is at least 1, so an entry is never left at 0 here.
        if *n >= self.limits.per_ip_requests() {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            table: self.clone(),
            ip,
        })
    }

    /// The limits it enforces.
    pub fn limits(&self) -> &ConnLimits {
        &self.limits
    }

    /// Requests in flight from `ip` now.
    pub fn requests_from(&self, ip: IpAddr) -> usize {
        let m = self
            .requests_per_ip
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m.get(&ip).copied().unwrap_or(0)
    }

    /// The total connection limit in force.
    pub fn max_total(&self) -> usize {
        self.max_total
    }

    /// Open connections now.
    pub fn open(&self) -> usize {
        self.lock().conns.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admit a connection from `ip`, evicting the oldest idle one of the same peer (at the
    /// per-peer limit) or of all (at the total limit); returns its id and its record.
    fn admit(&self, ip: IpAddr) -> Result<(u64, Arc<Conn>), Refused> {
        let mut t = self.lock();
        if t.per_ip.get(&ip).copied().unwrap_or(0) >= self.limits.max_connections_per_ip
            && !t.evict_oldest_idle(Some(ip))
        {
            return Err(Refused::PerIp);
        }
        if t.conns.len() >= self.max_total && !t.evict_oldest_idle(None) {
            return Err(Refused::Total);
        }
        t.next_id += 1;
        let id = t.next_id;
        let now = now_ms();
        let c = Arc::new(Conn {
            ip,
            in_flight: AtomicUsize::new(0),
            last_io: AtomicU64::new(now),
            head_since: AtomicU64::new(now),
            client_waits: Mutex::new(HashMap::new()),
            close: Notify::new(),
        });
        t.conns.insert(id, c.clone());
        *t.per_ip.entry(ip).or_default() += 1;
        Ok((id, c))
    }

    fn release(&self, id: u64) {
        self.lock().remove(id);
    }

    /// Close the oldest idle connection (frees a descriptor after `EMFILE`).
    fn evict_one(&self) -> bool {
        self.lock().evict_oldest_idle(None)
    }
}

/// One in-flight request slot of a peer address, given back when dropped.
struct IpSlot {
    table: Arc<ConnTable>,
    ip: IpAddr,
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut m = self
            .table
            .requests_per_ip
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// The peer's address, IPv4-mapped IPv6 as IPv4 (one peer, one count).
fn peer_ip(peer: SocketAddr) -> IpAddr {
    match peer.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        ip => ip,
    }
}

/// Errors of `accept` that concern only the connection being accepted (try again at once).
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Label of an accept error (`EMFILE`, …).
fn errno_name(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => format!("{:?}", nix::errno::Errno::from_raw(n)),
        None => format!("{:?}", e.kind()),
    }
}

/// Accept and serve connections on `listener` with `app` until `stop` turns true; then stop
/// accepting, ask every connection to finish its requests and close, and return once all
/// are closed (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    st: SharedState,
    mut stop: watch::Receiver<bool>,
) {
    let conns = st.conns.clone();
    let (done_tx, mut done_rx) = watch::channel(());
    let mut backoff = Duration::from_millis(10);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = Duration::from_millis(10);
                a
            }
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // EMFILE and kin: free a descriptor (the oldest idle connection) and back
                // off rather than spin on a listener that stays readable.
                let name = errno_name(&e);
                st.metrics.accept_error(&name);
                let freed = conns.evict_one();
                tracing::warn!(error = %e, freed, ?backoff, "accept failed; backing off");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        // Small writes go out at once: without TCP_NODELAY a streamed response's first frame
        // on a reused connection waited ~40 ms for the client's delayed ACK (Nagle), e.g.
        // every envd `Start` of the E2B SDK (BENCHMARKS.md "e2b").
        let _ = stream.set_nodelay(true);
        let ip = peer_ip(peer);
        let (id, conn) = match conns.admit(ip) {
            Ok(a) => a,
            Err(r) => {
                let reason = match r {
                    Refused::PerIp => "per_ip",
                    Refused::Total => "total",
                };
                st.metrics.conn_refused(reason);
                tracing::debug!(%peer, reason, "connection refused: limit reached, none idle");
                drop(stream);
                continue;
            }
        };
        let task = ConnTask {
            id,
            conn,
            conns: conns.clone(),
            st: st.clone(),
            app: app.clone(),
            stop: stop.clone(),
            _done: done_tx.clone(),
        };
        tokio::spawn(task.run(stream));
    }
    drop(done_tx);
    // Every task holds a clone of `done_tx`: this returns once the last one ended.
    let _ = done_rx.changed().await;
}

/// One connection being served.
struct ConnTask {
    id: u64,
    conn: Arc<Conn>,
    conns: Arc<ConnTable>,
    st: SharedState,
    app: Router,
    stop: watch::Receiver<bool>,
    _done: watch::Sender<()>,
}

impl ConnTask {
    async fn run(mut self, stream: TcpStream) {
        let io = TokioIo::new(Tracked {
            inner: stream,
            conn: self.conn.clone(),
        });
        let svc = {
            let conn = self.conn.clone();
            let app = self.app.clone();
            let conns = self.conns.clone();
            let st = self.st.clone();
            let pace = BodyPace::of(&self.conns.limits);
            hyper::service::service_fn(move |req: Request<Incoming>| {
                let guard = InFlight::start(conn.clone());
                let unread = !http_body::Body::is_end_stream(req.body());
                // The peer's own share first, so a peer over it takes no global slot; then
                // the share of requests with a body still to come.
                let admitted = match conns.try_ip_slot(conn.ip) {
                    None => Err(Shed::PerIp),
                    Some(ip_slot) => match unread
                        .then(|| conns.body_slots.clone().try_acquire_owned())
                        .transpose()
                    {
                        Err(_) => Err(Shed::Body),
                        Ok(body_slot) => match conns.slots.clone().try_acquire_owned() {
                            Ok(permit) => Ok((ip_slot, body_slot, permit)),
                            Err(_) => Err(Shed::Total),
                        },
                    },
                };
                let app = app.clone();
                let st = st.clone();
                async move {
                    let (ip_slot, body_slot, permit) = match admitted {
                        Ok(a) => a,
                        Err(shed) => {
                            st.metrics.request_shed(shed.label());
                            return Ok::<_, std::convert::Infallible>(overloaded(shed));
                        }
                    };
                    let read = Arc::new(AtomicBool::new(!unread));
                    let too_slow = Arc::new(AtomicBool::new(false));
                    let paced = is_paced(req.uri().path());
                    let req = req.map(|inner| {
                        let inner = ReadToEnd {
                            inner,
                            read: read.clone(),
                            body_slot,
                        };
                        if paced {
                            Body::new(Paced::new(inner, pace, too_slow.clone()))
                        } else {
                            Body::new(inner)
                        }
                    });
                    let mut resp = app.oneshot(req).await.unwrap_or_else(|e| match e {});
                    if too_slow.load(Ordering::Acquire) {
                        // Whatever the handler made of the failed body read (a 400 from an
                        // extractor, a 500), the answer is the same for every route.
                        st.metrics.body_timeout();
                        resp = body_too_slow(pace);
                    }
                    if resp.status().is_client_error() || resp.status().is_server_error() {
                        close_if_unread(&mut resp, &read);
                    }
                    Ok(resp.map(|b| Body::new(Guarded::new(b, guard, permit, ip_slot))))
                }
            })
        };
        // The connection (and its descriptor) is dropped before it leaves the table.
        let closing = {
            let builder = Builder::new(TokioExecutor::new());
            let mut served = pin!(builder.serve_connection_with_upgrades(io, svc));
            let header_ms = self.conns.limits.header_read_timeout.as_millis() as u64;
            let idle_ms = self.conns.limits.idle_timeout.as_millis() as u64;
            let stall_ms = self.conns.limits.write_stall_timeout.as_millis() as u64;
            let mut closing = None;
            loop {
                let now = now_ms();
                let mut wake = now + idle_ms.max(1);
                if let Some(since) = self.conn.oldest_client_wait() {
                    if now >= since + stall_ms {
                        closing = Some("write_stall");
                        break;
                    }
                }
                if self.conn.idle() && !*self.stop.borrow() {
                    let head = self.conn.head_since.load(Ordering::Acquire);
                    let last = self.conn.last_io.load(Ordering::Acquire);
                    if head != 0 && now >= head + header_ms {
                        closing = Some("header_timeout");
                        break;
                    }
                    if now >= last + idle_ms {
                        closing = Some("idle_timeout");
                        break;
                    }
                    wake = last + idle_ms;
                    if head != 0 {
                        wake = wake.min(head + header_ms);
                    }
                }
                // At least every write-stall timeout, so a stall that began after this
                // check is found within twice the timeout (no wake-up per answer frame).
                wake = wake.min(now + stall_ms.max(1));
                let sleep = tokio::time::sleep(Duration::from_millis(wake.saturating_sub(now)));
                tokio::select! {
                    r = served.as_mut() => {
                        if let Err(e) = r {
                            tracing::trace!(error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    _ = sleep => {}
                    _ = self.conn.close.notified() => {
                        closing = Some("evicted");
                        break;
                    }
                    _ = self.stop.wait_for(|s| *s), if !*self.stop.borrow() => {
                        served.as_mut().graceful_shutdown();
                    }
                }
            }
            closing
        };
        if let Some(reason) = closing {
            self.st.metrics.conn_closed(reason);
            tracing::debug!(reason, "connection closed");
        }
        self.conns.release(self.id);
    }
}

/// Why a request was answered `503` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shed {
    /// [`ConnLimits::max_requests_in_flight`] reached.
    Total,
    /// [`ConnLimits::per_ip_requests`] reached for the peer's address.
    PerIp,
    /// [`ConnLimits::body_requests`] reached: too many requests with a body still arriving.
    Body,
}

impl Shed {
    /// The `reason` label of `sandlot_requests_shed_total`.
    fn label(self) -> &'static str {
        match self {
            Shed::Total => "total",
            Shed::PerIp => "per_ip",
            Shed::Body => "body",
        }
    }
}

/// A JSON error response `{"error": {"code", "message"}}` with `status`.
fn error_response(status: StatusCode, code: ErrorCode, message: &str) -> Response<Body> {
    let body = serde_json::json!({"error": {"code": code.as_str(), "message": message}});
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// `503 unavailable` with `Retry-After: 1`: too many requests in flight, server-wide or
/// from the peer's address.
fn overloaded(shed: Shed) -> Response<Body> {
    let message = match shed {
        Shed::Total => "server overloaded: too many requests in flight; retry later",
        Shed::PerIp => {
            "server overloaded: too many requests in flight from your address; retry later"
        }
        Shed::Body => "server overloaded: too many requests with a body in flight; retry later",
    };
    let mut r = error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Unavailable,
        message,
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(1u64));
    r
}

/// `408 deadline_exceeded` with `Connection: close`: the request body arrived too slowly
/// ([`Paced`]). `deadline_exceeded` because the request did not arrive in time (the code's
/// usual status, 504, is for the server's own timeouts; 408 says it is the client's side).
fn body_too_slow(pace: BodyPace) -> Response<Body> {
    let message = if pace.min_rate > 0 {
        format!(
            "request body too slow: no bytes for {} s, or under {} bytes/s on average after {} s",
            pace.read_timeout.as_secs_f64(),
            pace.min_rate,
            pace.read_timeout.as_secs_f64()
        )
    } else {
        format!(
            "request body too slow: no bytes for {} s",
            pace.read_timeout.as_secs_f64()
        )
    };
    let mut r = error_response(
        StatusCode::REQUEST_TIMEOUT,
        ErrorCode::DeadlineExceeded,
        &message,
    );
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A request in flight on a connection, until its response body ends or is dropped.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn start(conn: Arc<Conn>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        conn.head_since.store(0, Ordering::Release);
        InFlight(conn)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.last_io.store(now_ms(), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted in flight (and its slot) until it ends,
/// and tells its connection when it waits for the client: from its making (the head is
/// not sent yet) and from each frame it hands over until it is polled again. A poll that
/// finds no frame ready (the server's side is waiting) ends the wait.
struct Guarded {
    inner: Body,
    /// Key of its entry in the connection's `client_waits`.
    id: u64,
    _guard: InFlight,
    _permit: OwnedSemaphorePermit,
    _ip_slot: IpSlot,
}

impl Guarded {
    fn new(inner: Body, guard: InFlight, permit: OwnedSemaphorePermit, ip_slot: IpSlot) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let g = Guarded {
            inner,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            _guard: guard,
            _permit: permit,
            _ip_slot: ip_slot,
        };
        g.client_wait(true);
        g
    }

    /// Start (again, from now) or end this answer's wait for the client.
    fn client_wait(&self, waiting: bool) {
        let mut w = self
            ._guard
            .0
            .client_waits
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if waiting {
            w.insert(self.id, now_ms());
        } else {
            w.remove(&self.id);
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.client_wait(false);
    }
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        self.client_wait(matches!(r, Poll::Ready(Some(Ok(_)))));
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that notes when it has been read to its end.
struct ReadToEnd {
    inner: Incoming,
    read: Arc<AtomicBool>,
    /// The request's slot among [`ConnLimits::body_requests`], given back at the body's end
    /// (or when the body is dropped unread).
    body_slot: Option<OwnedSemaphorePermit>,
}

impl http_body::Body for ReadToEnd {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Release);
            self.body_slot = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An error answered before the request body was read (a `404` for another tenant's
/// sandbox, a `413`, a `429`) ends the HTTP/1.1 connection: hyper does not keep it alive
/// with unread body bytes in it, and without `Connection: close` a client could send its
/// next request on it just as it closes and see "server disconnected" (RFC 9112 §9.6).
/// HTTP/2 streams do not share a body stream; hyper drops the header there.
fn close_if_unread(resp: &mut Response<Body>, read: &AtomicBool) {
    if !read.load(Ordering::Acquire) {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// How fast a request body must arrive ([`ConnLimits::body_read_timeout`],
/// [`ConnLimits::body_min_rate`]).
#[derive(Debug, Clone, Copy)]
pub struct BodyPace {
    /// Longest single wait for body bytes; also the grace period of the rate floor.
    pub read_timeout: Duration,
    /// Bytes per second of waiting, on average, once the body was waited on for
    /// `read_timeout` in all (0 = no floor).
    pub min_rate: u64,
}

impl BodyPace {
    fn of(l: &ConnLimits) -> Self {
        BodyPace {
            read_timeout: l.body_read_timeout,
            min_rate: l.body_min_rate,
        }
    }
}

/// Whether a request body on `path` must keep the pace of [`Paced`]: every route but the
/// E2B `process.Process/StreamInput` client stream, whose body is an interactive stdin that
/// may be quiet for minutes (its keepalives come every 50 s; the handler bounds its wait
/// itself, `e2b::process::STREAM_INPUT_IDLE_S`, and the route needs the sandbox owner's key).
fn is_paced(path: &str) -> bool {
    path != "/process.Process/StreamInput"
}

/// The error of a request body that arrived too slowly.
#[derive(Debug, thiserror::Error)]
#[error("request body too slow: {0}")]
pub struct BodyTooSlow(&'static str);

/// A request body that must arrive at a minimum pace (issue 25: a client that sent its
/// request head and then one body byte every 20 s held an in-flight slot forever).
///
/// Only time spent waiting for the client counts: the clock runs while a read of the body
/// is pending (the handler wants bytes the client has not sent), not while the handler is
/// busy elsewhere, so a handler that streams an upload to a slow sandbox does not make the
/// client look slow. The read fails with [`BodyTooSlow`] when
/// - one wait lasts [`BodyPace::read_timeout`] (`no bytes`), or
/// - the total wait exceeds `read_timeout` and the bytes received are fewer than
///   [`BodyPace::min_rate`] × the total wait in seconds (`under the rate floor`).
///
/// It then sets `too_slow`, and the connection answers `408` (`body_too_slow`) whatever
/// the handler answered. At 1 KiB/s the floor is far below any real upload: a 256 MiB PUT
/// may take 73 hours.
pub struct Paced<B> {
    inner: B,
    pace: BodyPace,
    /// Data bytes received so far.
    bytes: u64,
    /// Time spent in earlier, finished waits.
    waited: Duration,
    /// Start of the wait in progress (a read returned `Pending`).
    waiting_since: Option<tokio::time::Instant>,
    /// Wakes the reader at the deadline of the wait in progress.
    timer: Pin<Box<tokio::time::Sleep>>,
    too_slow: Arc<AtomicBool>,
    failed: Option<&'static str>,
}

impl<B> Paced<B> {
    /// Wrap `inner`; `too_slow` turns true when the pace is not kept.
    pub fn new(inner: B, pace: BodyPace, too_slow: Arc<AtomicBool>) -> Self {
        Paced {
            inner,
            pace,
            bytes: 0,
            waited: Duration::ZERO,
            waiting_since: None,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            too_slow,
            failed: None,
        }
    }

    /// When the wait that began at `since` fails, and why.
    fn deadline(&self, since: tokio::time::Instant) -> (tokio::time::Instant, &'static str) {
        let idle = (
            since + self.pace.read_timeout,
            "no bytes within the read timeout",
        );
        if self.pace.min_rate == 0 {
            return idle;
        }
        // Total wait at which `bytes` falls under the floor (never before the grace period).
        let allowed = Duration::from_secs_f64(self.bytes as f64 / self.pace.min_rate as f64)
            .max(self.pace.read_timeout);
        let rate = (
            since + allowed.saturating_sub(self.waited),
            "average rate under the floor",
        );
        if rate.0 < idle.0 {
            rate
        } else {
            idle
        }
    }

    fn end_wait(&mut self) {
        if let Some(since) = self.waiting_since.take() {
            self.waited += since.elapsed();
        }
    }
}

impl<B> http_body::Body for Paced<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::BoxError>>> {
        if let Some(why) = self.failed {
            return Poll::Ready(Some(Err(BodyTooSlow(why).into())));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                self.end_wait();
                if let Some(d) = frame.data_ref() {
                    self.bytes += d.len() as u64;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.end_wait();
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                self.end_wait();
                Poll::Ready(None)
            }
            Poll::Pending => {
                let now = tokio::time::Instant::now();
                let since = *self.waiting_since.get_or_insert(now);
                let (at, why) = self.deadline(since);
                if now < at {
                    if self.timer.deadline() != at {
                        self.timer.as_mut().reset(at);
                    }
                    if self.timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                }
                self.end_wait();
                self.failed = Some(why);
                self.too_slow.store(true, Ordering::Release);
                Poll::Ready(Some(Err(BodyTooSlow(why).into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The TCP stream of a connection, noting its activity in the registry.
struct Tracked {
    inner: TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let now = now_ms();
            self.conn.last_io.store(now, Ordering::Release);
            // The first byte of a request head starts its header-read clock.
            if self.conn.idle() {
                let _ = self.conn.head_since.compare_exchange(
                    0,
                    now,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.conn.last_io.store(now_ms(), Ordering::Release);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.conn.last_io.store(now_ms(), Ordering::Release);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(total: usize, per_ip: usize) -> ConnTable {
        let t = ConnTable::new(ConnLimits {
            max_connections: total,
            max_connections_per_ip: per_ip,
            ..Default::default()
        });
        assert_eq!(t.max_total(), total, "test limits below the fd cap");
        t
    }

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, n])
    }

    fn is_open(t: &ConnTable, id: u64) -> bool {
        t.lock().conns.contains_key(&id)
    }

    #[test]
    fn at_the_total_limit_the_oldest_idle_connection_makes_room() {
        let t = table(3, 10);
        let (first, _) = t.admit(ip(2)).unwrap();
        let (busy_id, busy) = t.admit(ip(3)).unwrap();
        busy.in_flight.store(1, Ordering::Release);
        t.admit(ip(4)).unwrap();
        t.admit(ip(5)).unwrap();
        assert!(!is_open(&t, first), "oldest idle evicted");
        assert!(is_open(&t, busy_id), "busy one kept");
        assert_eq!(t.open(), 3);
    }

    #[test]
    fn when_every_connection_is_busy_the_new_one_is_refused() {
        let t = table(2, 10);
        for n in 2..4 {
            let (_, c) = t.admit(ip(n)).unwrap();
            c.in_flight.store(1, Ordering::Release);
        }
        assert_eq!(t.admit(ip(9)).unwrap_err(), Refused::Total);
    }

    #[test]
    fn per_peer_limit_evicts_that_peers_idle_connection_only() {
        let t = table(100, 2);
        let (other, _) = t.admit(ip(1)).unwrap();
        let (a, _) = t.admit(ip(2)).unwrap();
        let (_, b) = t.admit(ip(2)).unwrap();
        b.in_flight.store(1, Ordering::Release);
        t.admit(ip(2)).unwrap();
        assert!(!is_open(&t, a), "that peer's oldest idle one evicted");
        assert!(is_open(&t, other), "other peers untouched");
        for c in t.lock().conns.values() {
            c.in_flight.store(1, Ordering::Release);
        }
        assert_eq!(t.admit(ip(2)).unwrap_err(), Refused::PerIp);
        assert!(t.admit(ip(3)).is_ok(), "other peers unaffected");
    }

    #[test]
    fn release_frees_the_peer_count() {
        let t = table(10, 1);
        let (id, _) = t.admit(ip(2)).unwrap();
        t.release(id);
        assert!(t.lock().per_ip.is_empty());
        assert_eq!(t.open(), 0);
    }

    #[test]
    fn total_limit_is_held_below_half_the_descriptor_limit() {
        assert_eq!(effective_max_connections(16384, Some(1024)), 512);
        assert_eq!(effective_max_connections(100, Some(1 << 20)), 100);
        assert_eq!(effective_max_connections(100, None), 100);
    }

    /// A body fed by a channel (unit test of the pacing logic: no socket).
    fn channel_body(pace: BodyPace) -> (tokio::sync::mpsc::Sender<Bytes>, Body, Arc<AtomicBool>) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, io::Error>(b), rx))
        });
        let too_slow = Arc::new(AtomicBool::new(false));
        let body = Body::new(Paced::new(
            Body::from_stream(stream),
            pace,
            too_slow.clone(),
        ));
        (tx, body, too_slow)
    }

    const PACE: BodyPace = BodyPace {
        read_timeout: Duration::from_millis(200),
        min_rate: 1024,
    };

    #[tokio::test]
    async fn a_silent_body_fails_after_the_read_timeout() {
        let (_tx, body, too_slow) = channel_body(PACE);
        let t = Instant::now();
        let err = axum::body::to_bytes(body, usize::MAX).await.unwrap_err();
        assert!(format!("{err:?}").contains("no bytes"), "{err:?}");
        assert!(too_slow.load(Ordering::Acquire));
        assert!(
            t.elapsed() >= Duration::from_millis(190),
            "{:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn a_trickle_under_the_floor_fails_after_the_grace_period() {
        let (tx, body, too_slow) = channel_body(PACE);
        tokio::spawn(async move {
            while tx.send(Bytes::from_static(b"x")).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let t = Instant::now();
        let err = axum::body::to_bytes(body, usize::MAX).await.unwrap_err();
        assert!(format!("{err:?}").contains("under the floor"), "{err:?}");
        assert!(too_slow.load(Ordering::Acquire));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_fast_body_and_a_busy_reader_are_not_paced() {
        let (tx, mut body, too_slow) = channel_body(PACE);
        tokio::spawn(async move {
            for _ in 0..20 {
                tx.send(Bytes::from(vec![0u8; 8192])).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        let mut got = 0;
        let mut n = 0;
        while let Some(f) = http_body_util_frame(&mut body).await {
            got += f.expect("no pacing error").len();
            n += 1;
            if n == 3 {
                // The reader is busy for longer than the read timeout: the client is not
                // to blame, the clock does not run.
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        assert_eq!(got, 20 * 8192);
        assert!(!too_slow.load(Ordering::Acquire));
    }

    /// The next data frame of `body` (trailers skipped).
    async fn http_body_util_frame(body: &mut Body) -> Option<Result<Bytes, axum::Error>> {
        loop {
            let f =
                std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut *body), cx))
                    .await?;
            match f {
                Ok(f) => match f.into_data() {
                    Ok(d) => return Some(Ok(d)),
                    Err(_) => continue,
                },
                Err(e) => return Some(Err(e)),
            }
        }
    }

    #[test]
    fn every_body_is_paced_but_the_interactive_stdin_stream() {
        assert!(is_paced("/v1/sandboxes/sb-1/files"));
        assert!(is_paced("/process.Process/Start"));
        assert!(is_paced("/process.Process/SendInput"));
        assert!(!is_paced("/process.Process/StreamInput"));
    }

    #[test]
    fn the_per_peer_request_limit_defaults_to_a_quarter_of_the_total() {
        let l = ConnLimits {
            max_requests_in_flight: 4096,
            ..Default::default()
        };
        assert_eq!(l.per_ip_requests(), 1024);
        let l = ConnLimits {
            max_requests_in_flight: 2,
            ..Default::default()
        };
        assert_eq!(l.per_ip_requests(), 1, "at least one");
        let l = ConnLimits {
            max_requests_in_flight_per_ip: Some(7),
            ..Default::default()
        };
        assert_eq!(l.per_ip_requests(), 7);
    }

    #[test]
    fn a_peers_request_slots_are_counted_and_given_back() {
        let t = Arc::new(ConnTable::new(ConnLimits {
            max_requests_in_flight: 8,
            ..Default::default()
        }));
        let a = t.try_ip_slot(ip(2)).unwrap();
        let b = t.try_ip_slot(ip(2)).unwrap();
        assert!(t.try_ip_slot(ip(2)).is_none(), "a quarter of 8");
        let c = t.try_ip_slot(ip(3)).expect("other peers unaffected");
        drop(a);
        assert_eq!(t.requests_from(ip(2)), 1);
        let a = t.try_ip_slot(ip(2)).expect("given back");
        drop((a, b, c));
        assert!(t.requests_per_ip.lock().unwrap().is_empty());
    }

    #[test]
    fn ipv4_mapped_peers_count_as_ipv4() {
        let a: SocketAddr = "[::ffff:10.0.0.1]:5".parse().unwrap();
        assert_eq!(peer_ip(a), IpAddr::from([10, 0, 0, 1]));
    }
}
