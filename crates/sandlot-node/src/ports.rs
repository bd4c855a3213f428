//! Ingress: TCP connections to ports inside a sandbox's own network namespace
//! ([`sandlot_node_api::Node::connect_port`]).
//!
//! A socket belongs to the network namespace its creating thread was in when it called
//! socket(2) and stays there for its whole life (network_namespaces(7)). So a short-lived
//! thread joins the sandbox's namespace (`setns(2)` on `/proc/<init pid>/ns/net`,
//! `CLONE_NEWNET`), creates a socket, connects it to `127.0.0.1:<port>` and hands it back;
//! the thread then ends, and with it its namespace membership — no other thread of the
//! node (the tokio workers included) ever leaves the host namespace. The sandbox needs no
//! network, veth or policy of its own: its loopback is enough (the guest init brings `lo`
//! up in every sandbox).
use sandlot_node_api::{NodeError, NodeResult, PORT_NOT_LISTENING};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::Duration;

/// How long a connect inside the sandbox may take (a loopback connect either succeeds or
/// is refused at once; this bounds a frozen or overloaded sandbox).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to `127.0.0.1:port` inside the network namespace of process `pid`, the init
/// of sandbox `id` whose start time (field 22 of `/proc/PID/stat`) is `starttime` (checked
/// after opening the namespace file, so a recycled pid is never joined).
///
/// # Errors
/// `InvalidArgument` (port 0); `Conflict` (the init is gone); `Unavailable` (connection
/// refused: nothing listens on the port; or the connect timed out); `Internal` (setns or
/// socket failures).
pub async fn connect_in_netns(
    id: &str,
    pid: i32,
    starttime: u64,
    port: u16,
) -> NodeResult<tokio::net::TcpStream> {
    if port == 0 {
        return Err(NodeError::InvalidArgument(
            "port 0 cannot be reached".into(),
        ));
    }
    let id = id.to_owned();
    let std_stream =
        tokio::task::spawn_blocking(move || connect_blocking(&id, pid, starttime, port))
            .await
            .map_err(|e| NodeError::io("ingress connect task", std::io::Error::other(e)))??;
    std_stream
        .set_nonblocking(true)
        .map_err(|e| NodeError::io("set the ingress socket non-blocking", e))?;
    tokio::net::TcpStream::from_std(std_stream)
        .map_err(|e| NodeError::io("register the ingress socket", e))
}

fn connect_blocking(id: &str, pid: i32, starttime: u64, port: u16) -> NodeResult<TcpStream> {
    let ns_path = format!("/proc/{pid}/ns/net");
    let gone = || {
        NodeError::Conflict(format!(
            "sandbox {id} is not running (its init {pid} is gone)"
        ))
    };
    let ns = std::fs::File::open(&ns_path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => gone(),
        _ => NodeError::io(format!("open {ns_path}"), e),
    })?;
    if crate::sys::proc_starttime(pid) != Some(starttime) {
        return Err(gone());
    }
    let id = id.to_owned();
    // setns(CLONE_NEWNET) changes the calling thread only: a thread of its own, which
    // ends right after, keeps every other thread in the host namespace.
    std::thread::spawn(move || -> NodeResult<TcpStream> {
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
            NodeError::io(
                format!("join the network namespace of sandbox {id} ({ns_path})"),
                std::io::Error::from(e),
            )
        })?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                Ok(s)
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Err(NodeError::Unavailable(format!(
                    "{PORT_NOT_LISTENING} {port} in sandbox {id} (connection to \
                     127.0.0.1:{port} inside it refused)"
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                Err(NodeError::Unavailable(format!(
                    "{PORT_NOT_LISTENING} {port} in sandbox {id} (no accept within {} s)",
                    CONNECT_TIMEOUT.as_secs()
                )))
            }
            Err(e) => Err(NodeError::io(
                format!("connect to 127.0.0.1:{port} in sandbox {id}"),
                e,
            )),
        }
    })
    .join()
    .unwrap_or_else(|_| {
        Err(NodeError::io(
            "ingress connect thread",
            std::io::Error::other("panicked"),
        ))
    })
}
