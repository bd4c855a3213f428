//! Cluster coordination of Sandlot on etcd (issue 21, `../shared/DESIGN.md` "Cluster mode").
//!
//! - **Membership**: a node registers its [`NodeRecord`] (capacity, usage, backends,
//!   runtimes, accelerator, cached images) at `/sandlot/nodes/<name>` under an etcd lease
//!   kept alive by [`NodeRegistration`]; servers follow the set with [`NodeSet`] (a read,
//!   then a watch: [`NodeEvent::Up`], [`NodeEvent::Updated`], [`NodeEvent::Down`] when the
//!   lease expired or the node left).
//! - **Fencing**: [`Fence::is_serving`] turns false before etcd could expire the node's
//!   lease, so a partitioned node stops serving before servers declare it down; see the
//!   timing argument on [`Fence`].
//! - **Leader election**: [`Election::campaign`] on etcd's election service; the
//!   [`Leadership`] reports its loss with the same fence timing.
//!
//! Start with [`connect`], then `NodeRegistration::register` on a node or
//! `NodeSet::start` / `Election::campaign` on a server. Values are serde JSON.
//! etcd: v3 API (tested with Debian's etcd-server 3.4); `scripts/etcd.sh` runs local members.
#![deny(missing_docs)]

mod election;
mod error;
mod fence;
mod lease;
mod membership;
mod record;
pub mod testing;

pub use election::{Election, Leadership, ELECTION_PREFIX};
pub use error::ClusterError;
pub use etcd_client::Client;
pub use fence::Fence;
pub use lease::LeaseConfig;
pub use membership::{node_key, NodeEvent, NodeRegistration, NodeSet, Nodes, NODES_PREFIX};
pub use record::{NodeRecord, Resources};

use std::time::Duration;

/// Connects to etcd at `endpoints` (`http://host:port`, several for a cluster: calls go to
/// any member that answers).
///
/// gRPC keep-alive pings every second (2 s timeout) detect a dead or stopped member, so
/// streams move to another member instead of hanging; calls fail on a member without a
/// quorum leader (`require_leader`), rather than waiting on a minority side.
///
/// # Errors
/// [`ClusterError::InvalidArgument`] for no endpoints; [`ClusterError::Etcd`] /
/// [`ClusterError::Timeout`] when no endpoint accepts a connection within 5 s.
pub async fn connect(endpoints: &[String]) -> Result<Client, ClusterError> {
    if endpoints.is_empty() {
        return Err(ClusterError::InvalidArgument("no etcd endpoints".into()));
    }
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
        .with_keep_alive_while_idle(true)
        .with_require_leader(true);
    error::call(
        "connect",
        Duration::from_secs(5),
        Client::connect(endpoints, Some(opts)),
    )
    .await
}
