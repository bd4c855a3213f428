//! Lease timing and the keep-alive loop shared by node registration and leader election.
use crate::error::{call, call_retry, ClusterError};
use crate::fence::Fence;
use etcd_client::Client;
use std::time::Duration;
use tokio::time::Instant;

/// Timing of an etcd lease and of its fence.
///
/// Defaults from [`LeaseConfig::new`]: keep-alive every `ttl/5` (at least 100 ms), each
/// etcd call limited to the same interval, safety margin `max(ttl/3, 1 s)` but at most
/// `ttl/2`. With `ttl` = 5 s: a renewal each second, the fence goes off 3.33 s after the
/// last renewal that was sent and answered, at least 1.67 s before etcd could expire the
/// lease. A failed renewal is tried again after 50 ms, then after doubling pauses
/// (see `keep_alive_until_lost`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Lease TTL (whole seconds: etcd's unit).
    pub ttl: Duration,
    /// Time between two renewals, and the limit of each etcd call.
    pub keepalive_interval: Duration,
    /// How long before the earliest possible expiry the fence goes off.
    pub safety_margin: Duration,
}

impl LeaseConfig {
    /// The defaults for a TTL of `ttl_s` seconds.
    ///
    /// # Errors
    /// [`ClusterError::InvalidArgument`] when `ttl_s` is below 2 (etcd raises shorter TTLs to
    /// its minimum, 1.5 s with default timings, which leaves no room for a margin) or above
    /// 3600.
    pub fn new(ttl_s: u64) -> Result<Self, ClusterError> {
        if !(2..=3600).contains(&ttl_s) {
            return Err(ClusterError::InvalidArgument(format!(
                "lease ttl must be 2..=3600 s, got {ttl_s}"
            )));
        }
        let ttl = Duration::from_secs(ttl_s);
        let keepalive_interval = (ttl / 5).max(Duration::from_millis(100));
        let safety_margin = (ttl / 3).max(Duration::from_secs(1)).min(ttl / 2);
        Ok(LeaseConfig {
            ttl,
            keepalive_interval,
            safety_margin,
        })
    }

    /// The TTL in etcd's unit.
    pub(crate) fn ttl_s(&self) -> i64 {
        i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX)
    }

    /// How long a renewal or grant sent at `sent` keeps the fence on.
    pub(crate) fn serving_until(&self, sent: Instant, granted: Duration) -> Instant {
        sent + self.ttl.min(granted).saturating_sub(self.safety_margin)
    }
}

/// Grants a new lease; returns its id and the instant the grant was sent.
pub(crate) async fn grant(
    client: &Client,
    cfg: &LeaseConfig,
) -> Result<(i64, Instant, Duration), ClusterError> {
    let lc = client.lease_client();
    let sent = Instant::now();
    let grant = || {
        let mut lc = lc.clone();
        async move { lc.grant(cfg.ttl_s(), None).await }
    };
    let resp = call_retry(
        "lease grant",
        cfg.keepalive_interval.max(Duration::from_secs(1)),
        grant,
    )
    .await?;
    let granted = Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0));
    Ok((resp.id(), sent, granted))
}

/// Revokes a lease, best effort (its keys go at once); errors are only logged.
pub(crate) async fn revoke(client: &Client, lease_id: i64, cfg: &LeaseConfig) {
    let mut lc = client.lease_client();
    if let Err(e) = call(
        "lease revoke",
        cfg.keepalive_interval.max(Duration::from_secs(1)),
        lc.revoke(lease_id),
    )
    .await
    {
        tracing::debug!(lease_id, error = %e, "revoking an old lease failed (it expires by itself)");
    }
}

/// The pause before the next renewal try after `failures` failed tries in a row: 50 ms
/// after the first, doubling, at most `interval`.
fn retry_pause(failures: u32, interval: Duration) -> Duration {
    let first = Duration::from_millis(50);
    (first * 2u32.pow(failures.clamp(1, 16) - 1)).min(interval)
}

/// Renews `lease_id` every `keepalive_interval`, moving the fence forward after each
/// answered renewal, until the lease is lost: etcd answers TTL 0 (lease unknown), or the
/// fence's deadline passes without an answered renewal. Returns then, with the fence off.
///
/// One renewal is in flight at a time on a keep-alive stream; a stream whose renewal
/// failed or timed out is dropped and a new one opened for the next renewal, so a late
/// answer to an old request can never be taken as the answer to a newer one (that would
/// date the renewal too late and break the fence's timing argument).
///
/// After a failed renewal the next try comes 50 ms later, not a whole interval later;
/// further failures double the pause up to the interval. With several endpoints, the client's
/// balancer can route a new stream to a member that has just stopped; waiting a full
/// interval after each such failure left only ~3 tries per fence window, whatever the TTL
/// (the fence went off with one of three members stopped on a loaded host).
pub(crate) async fn keep_alive_until_lost(
    client: &Client,
    lease_id: i64,
    fence: &Fence,
    cfg: &LeaseConfig,
) {
    let mut lc = client.lease_client();
    let mut stream = None;
    let mut wait = Duration::ZERO;
    let mut failures = 0;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = fence.fenced() => {}
        }
        // Until an answered renewal says otherwise, this try failed.
        failures += 1;
        wait = retry_pause(failures, cfg.keepalive_interval);
        if !fence.is_serving() {
            // The holder (node membership, election) logs the transition in its own terms.
            tracing::debug!(lease_id, "no answered lease renewal in time: fenced");
            fence.off();
            return;
        }
        if stream.is_none() {
            match call(
                "lease keep-alive",
                cfg.keepalive_interval,
                lc.keep_alive(lease_id),
            )
            .await
            {
                Ok(s) => stream = Some(s),
                Err(e) => {
                    tracing::warn!(lease_id, error = %e, cause = ?std::error::Error::source(&e), "opening a lease keep-alive stream failed");
                    continue;
                }
            }
        }
        let Some((keeper, answers)) = stream.as_mut() else {
            continue;
        };
        let sent = Instant::now();
        let answer = tokio::time::timeout(cfg.keepalive_interval, async {
            keeper.keep_alive().await?;
            answers.message().await
        })
        .await;
        match answer {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                let granted = Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0));
                fence.extend(cfg.serving_until(sent, granted));
                failures = 0;
                wait = cfg.keepalive_interval;
            }
            Ok(Ok(Some(_))) => {
                tracing::warn!(
                    lease_id,
                    "etcd no longer knows the lease (expired or revoked): fenced"
                );
                fence.off();
                return;
            }
            Ok(Ok(None)) => {
                tracing::warn!(lease_id, "lease keep-alive stream closed; reopening");
                stream = None;
            }
            Ok(Err(e)) => {
                tracing::warn!(lease_id, error = %e, "lease renewal failed; reopening the stream");
                stream = None;
            }
            Err(_) => {
                tracing::warn!(lease_id, after = ?cfg.keepalive_interval, "lease renewal not answered in time; reopening the stream");
                stream = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_ttl() {
        let c = LeaseConfig::new(5).unwrap();
        assert_eq!(c.keepalive_interval, Duration::from_secs(1));
        assert_eq!(c.safety_margin, Duration::from_nanos(1_666_666_666));
        let c = LeaseConfig::new(2).unwrap();
        assert_eq!(c.safety_margin, Duration::from_secs(1));
        assert_eq!(c.keepalive_interval, Duration::from_millis(400));
        assert!(LeaseConfig::new(1).is_err());
        assert!(LeaseConfig::new(0).unwrap_err().code() == sandlot_api::ErrorCode::InvalidArgument);
    }

    #[test]
    fn a_failed_renewal_is_retried_soon_then_less_often() {
        let i = Duration::from_millis(600);
        let seen: Vec<_> = (1..=6).map(|f| retry_pause(f, i).as_millis()).collect();
        assert_eq!(seen, [50, 100, 200, 400, 600, 600]);
        assert_eq!(retry_pause(1000, i), i);
    }

    #[test]
    fn a_renewal_counts_from_its_send_time_and_the_smaller_ttl() {
        let c = LeaseConfig::new(6).unwrap();
        let t = Instant::now();
        assert_eq!(
            c.serving_until(t, Duration::from_secs(6)),
            t + Duration::from_secs(4)
        );
        assert_eq!(
            c.serving_until(t, Duration::from_secs(60)),
            t + Duration::from_secs(4)
        );
        assert_eq!(
            c.serving_until(t, Duration::from_secs(3)),
            t + Duration::from_secs(1)
        );
    }
}
