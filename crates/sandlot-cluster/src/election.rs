//! Leader election for the server singletons (TTL reaper, GC, lost-node sweeper), on etcd's
//! election service (`v3electionpb`, the same protocol as `etcdctl elect`).
use crate::error::{call, ClusterError};
use crate::fence::Fence;
use crate::lease::{grant, keep_alive_until_lost, revoke, LeaseConfig};
use etcd_client::{Client, EventType, LeaderKey, ResignOptions, WatchOptions};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Prefix of election keys: election `E` uses `/sandlot/election/E/<lease id>`.
pub const ELECTION_PREFIX: &str = "/sandlot/election/";

/// Campaigns for leadership of named elections, one lease per campaign.
#[derive(Clone)]
pub struct Election {
    client: Client,
    cfg: LeaseConfig,
}

/// Leadership won by [`Election::campaign`]: valid while [`Leadership::is_leader`] is true.
///
/// The holder runs its singletons while `is_leader()` is true and stops them when
/// [`Leadership::lost`] resolves. Leadership is lost when its lease is lost — renewals not
/// answered for `ttl - margin` (the same [`Fence`] timing as a node's registration, so the
/// holder stops before etcd can expire the lease and elect another), etcd answers that the
/// lease is gone, or the leader key is deleted. A lost leadership never comes back:
/// campaign again.
///
/// Dropping it aborts the keep-alive without resigning (as a `kill -9` would): another
/// candidate takes over once etcd expires the lease, within `ttl`.
pub struct Leadership {
    client: Client,
    cfg: LeaseConfig,
    fence: Fence,
    key: LeaderKey,
    tasks: Vec<JoinHandle<()>>,
}

impl Election {
    /// An election client with the lease timing `cfg`.
    pub fn new(client: &Client, cfg: LeaseConfig) -> Self {
        Election {
            client: client.clone(),
            cfg,
        }
    }

    /// Campaigns in election `name` with value `server_id` and waits until elected (this
    /// can wait as long as another candidate leads). A lease lost while waiting is replaced
    /// by a new one and the campaign starts again.
    ///
    /// # Errors
    /// [`ClusterError::InvalidArgument`] for an empty name or one with `/`;
    /// [`ClusterError::Etcd`] / [`ClusterError::Timeout`] when etcd refuses the lease or the
    /// campaign (the caller retries after a pause).
    pub async fn campaign(&self, name: &str, server_id: &str) -> Result<Leadership, ClusterError> {
        if name.is_empty() || name.contains('/') {
            return Err(ClusterError::InvalidArgument(format!(
                "election name {name:?}: non-empty, no '/'"
            )));
        }
        let election = format!("{ELECTION_PREFIX}{name}");
        loop {
            let (lease_id, sent, granted) = grant(&self.client, &self.cfg).await?;
            let fence = Fence::new();
            fence.start(lease_id, self.cfg.serving_until(sent, granted));
            let keeper = {
                let (client, fence, cfg) = (self.client.clone(), fence.clone(), self.cfg);
                tokio::spawn(
                    async move { keep_alive_until_lost(&client, lease_id, &fence, &cfg).await },
                )
            };
            let mut ec = self.client.election_client();
            let won = tokio::select! {
                r = ec.campaign(election.as_str(), server_id, lease_id) => Some(r),
                _ = fence.fenced() => None,
            };
            match won {
                Some(Ok(mut resp)) if fence.is_serving() => {
                    let Some(key) = resp.take_leader() else {
                        keeper.abort();
                        revoke(&self.client, lease_id, &self.cfg).await;
                        continue;
                    };
                    tracing::info!(election = %election, server_id, lease_id, "elected leader");
                    let watcher = tokio::spawn(watch_leader_key(
                        self.client.clone(),
                        key.key().to_vec(),
                        fence.clone(),
                    ));
                    return Ok(Leadership {
                        client: self.client.clone(),
                        cfg: self.cfg,
                        fence,
                        key,
                        tasks: vec![keeper, watcher],
                    });
                }
                Some(Err(source)) => {
                    keeper.abort();
                    revoke(&self.client, lease_id, &self.cfg).await;
                    return Err(ClusterError::Etcd {
                        op: "campaign",
                        source,
                    });
                }
                _ => {
                    tracing::warn!(election = %election, lease_id, "campaign lease lost while waiting; campaigning again");
                    keeper.abort();
                    revoke(&self.client, lease_id, &self.cfg).await;
                }
            }
        }
    }

    /// The value (server id) of the current leader of election `name`, `None` when there
    /// is none.
    ///
    /// # Errors
    /// [`ClusterError::Etcd`] / [`ClusterError::Timeout`] when etcd does not answer.
    pub async fn leader(&self, name: &str) -> Result<Option<String>, ClusterError> {
        let mut ec = self.client.election_client();
        let election = format!("{ELECTION_PREFIX}{name}");
        match call(
            "election leader",
            Duration::from_secs(2),
            ec.leader(election),
        )
        .await
        {
            Ok(resp) => Ok(resp
                .kv()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())),
            // etcd answers "election: no leader" as an error.
            Err(ClusterError::Etcd { source, .. }) if source.to_string().contains("no leader") => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// Fences the leadership when its key is deleted (resigned elsewhere, or deleted by hand).
async fn watch_leader_key(client: Client, key: Vec<u8>, fence: Fence) {
    let mut wc = client.watch_client();
    loop {
        if let Ok(mut stream) = call(
            "watch leader key",
            Duration::from_secs(2),
            wc.watch(key.clone(), Some(WatchOptions::new())),
        )
        .await
        {
            while let Ok(Some(resp)) = stream.message().await {
                if resp
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    tracing::warn!("leader key deleted: leadership lost");
                    fence.off();
                    return;
                }
            }
        }
        // A broken watch says nothing about the lease: the fence's clock covers that.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

impl Leadership {
    /// True while this holder is certainly the leader (cheap: a clock read and an atomic).
    pub fn is_leader(&self) -> bool {
        self.fence.is_serving()
    }

    /// Resolves when leadership is lost (at once if it already is): stop the singletons.
    pub async fn lost(&self) {
        self.fence.fenced().await
    }

    /// The fence of this leadership, to hand to the singletons.
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Gives leadership up now: resigns and revokes the lease, so another candidate is
    /// elected at once.
    ///
    /// # Errors
    /// [`ClusterError::Etcd`] / [`ClusterError::Timeout`] when etcd does not take the
    /// resignation; the lease then expires within `ttl`.
    pub async fn resign(mut self) -> Result<(), ClusterError> {
        self.fence.off();
        for t in self.tasks.drain(..) {
            t.abort();
        }
        let mut ec = self.client.election_client();
        let opts = ResignOptions::new().with_leader(self.key.clone());
        let res = call("resign", Duration::from_secs(2), ec.resign(Some(opts)))
            .await
            .map(|_| ());
        revoke(&self.client, self.fence.lease_id(), &self.cfg).await;
        res
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.fence.off();
        for t in &self.tasks {
            t.abort();
        }
    }
}
