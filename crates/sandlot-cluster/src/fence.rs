//! The fence: a cheap, clock-based "is my etcd lease certainly alive?" check.
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::Instant;

/// A clone-able handle that says whether the holder of an etcd lease may act as its owner
/// (a node serving calls, a leader running singletons).
///
/// # Timing argument
///
/// The lease has a TTL of `T`. The keep-alive loop sends one renewal at a time and records
/// the instant `s` (tokio's monotonic clock) at which it *sent* the request whose successful
/// answer it then received. etcd renewed the lease while handling that request, i.e. at or
/// after `s`, so the lease cannot expire before `s + T` (etcd measures `T` on its own
/// monotonic clock; a leader change in etcd only extends leases). A fresh grant counts the
/// same way from the instant the grant was sent. The fence stays on only until
/// `s + T - margin`; after that [`Fence::is_serving`] is false, **before** etcd could have
/// deleted the key and before any watcher could have seen the node `down`. The margin
/// (default `max(T/3, 1 s)`, see [`crate::LeaseConfig`]) absorbs clock-rate differences
/// between the hosts (it tolerates far more than real drift) and the time between a
/// caller's check and the end of its action: a long mutating action must check again
/// before it commits.
///
/// The check reads the clock and one atomic: no lock, no I/O, and it goes off on time even
/// when the keep-alive task is starved or stuck on a hung connection. Once off it stays off
/// for that lease: it turns on again only when the owner registers under a **new** lease
/// ([`Fence::epoch`] then grows; the old lease may be gone and its key with it).
#[derive(Debug, Clone)]
pub struct Fence {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    base: Instant,
    /// Deadline as nanoseconds after `base`, plus 1; 0 = fenced.
    deadline: AtomicU64,
    lease_id: AtomicI64,
    epoch: AtomicU64,
    changed: watch::Sender<()>,
}

impl Fence {
    /// A fence that is off (no lease yet).
    pub(crate) fn new() -> Self {
        Fence {
            inner: Arc::new(Inner {
                base: Instant::now(),
                deadline: AtomicU64::new(0),
                lease_id: AtomicI64::new(0),
                epoch: AtomicU64::new(0),
                changed: watch::channel(()).0,
            }),
        }
    }

    /// True while the lease is certainly alive at etcd (see the timing argument above).
    pub fn is_serving(&self) -> bool {
        let d = self.inner.deadline.load(Ordering::Acquire);
        d != 0 && self.nanos(Instant::now()) < d - 1
    }

    /// The instant at which the fence goes off unless renewed; `None` when it is off.
    pub fn serving_until(&self) -> Option<Instant> {
        let d = self.inner.deadline.load(Ordering::Acquire);
        if d == 0 {
            return None;
        }
        let at = self.inner.base + std::time::Duration::from_nanos(d - 1);
        (at > Instant::now()).then_some(at)
    }

    /// The etcd lease id the fence follows (0 before the first grant).
    pub fn lease_id(&self) -> i64 {
        self.inner.lease_id.load(Ordering::Acquire)
    }

    /// How many leases the owner has held so far: 1 after the first registration, +1 per
    /// re-registration after a fence. Anything cached under an older epoch (e.g. "the
    /// cluster agrees I own sandbox X") must be checked again.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch.load(Ordering::Acquire)
    }

    /// Resolves once the fence is off (at once if it already is).
    pub async fn fenced(&self) {
        let mut rx = self.inner.changed.subscribe();
        loop {
            rx.borrow_and_update();
            let Some(until) = self.serving_until() else {
                return;
            };
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                _ = rx.changed() => {}
            }
        }
    }

    /// Resolves once the fence is on (at once if it already is).
    pub async fn serving(&self) {
        let mut rx = self.inner.changed.subscribe();
        loop {
            rx.borrow_and_update();
            if self.is_serving() {
                return;
            }
            let _ = rx.changed().await;
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.inner.base).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Starts serving under a new lease valid until `until`.
    pub(crate) fn start(&self, lease_id: i64, until: Instant) {
        self.inner.lease_id.store(lease_id, Ordering::Release);
        self.inner.epoch.fetch_add(1, Ordering::AcqRel);
        let d = self.nanos(until).saturating_add(1);
        self.inner.deadline.store(d, Ordering::Release);
        self.inner.changed.send_replace(());
    }

    /// Moves the deadline to `until` (never backwards) while the fence is on; a fence that
    /// is already off stays off (only [`Fence::start`] with a new lease turns it on).
    pub(crate) fn extend(&self, until: Instant) {
        let new = self.nanos(until).saturating_add(1);
        let cur = &self.inner.deadline;
        let mut old = cur.load(Ordering::Acquire);
        loop {
            let off = old == 0 || self.nanos(Instant::now()) >= old - 1;
            if off || new <= old {
                return;
            }
            match cur.compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(o) => old = o,
            }
        }
        self.inner.changed.send_replace(());
    }

    /// Turns the fence off now (lease known lost or released).
    pub(crate) fn off(&self) {
        self.inner.deadline.store(0, Ordering::Release);
        self.inner.changed.send_replace(());
    }
}

#[cfg(test)]
mod tests {
    //! Real time, no paused clock (tokio's `test-util` would be a feature the binaries'
    //! build lacks, and `cargo test` would rebuild tokio and every crate above it): every
    //! assertion is taken well away from a deadline, or after one has passed.
    use super::*;
    use std::time::Duration;

    const FAR: Duration = Duration::from_secs(3600);

    #[tokio::test]
    async fn goes_off_at_deadline_and_only_a_new_lease_turns_it_on() {
        let f = Fence::new();
        assert!(!f.is_serving());
        let t = Instant::now();
        f.start(7, t + Duration::from_secs(600));
        assert!(f.is_serving());
        assert_eq!((f.lease_id(), f.epoch()), (7, 1));
        // A renewal moves the deadline on, never back (exact: no clock read in between).
        f.extend(t + FAR);
        assert_eq!(f.serving_until(), Some(t + FAR));
        f.extend(t + Duration::from_secs(1));
        assert_eq!(f.serving_until(), Some(t + FAR));
        // Off at the deadline: a sleep past it can only oversleep.
        f.start(7, Instant::now() + Duration::from_millis(50));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(!f.is_serving());
        assert_eq!(f.serving_until(), None);
        // A late renewal answer cannot revive an expired fence.
        f.extend(Instant::now() + FAR);
        assert!(!f.is_serving());
        f.start(8, Instant::now() + FAR);
        assert!(f.is_serving());
        assert_eq!((f.lease_id(), f.epoch()), (8, 3));
        f.off();
        assert!(!f.is_serving());
        assert_eq!(f.serving_until(), None);
    }

    #[tokio::test]
    async fn fenced_resolves_at_the_deadline() {
        let f = Fence::new();
        let t0 = Instant::now();
        f.start(1, t0 + Duration::from_millis(200));
        tokio::time::timeout(Duration::from_secs(30), f.fenced())
            .await
            .expect("fenced() resolves at the deadline");
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(200), "{waited:?}");
        assert!(!f.is_serving());
        let g = f.clone();
        let waiter = tokio::spawn(async move { g.serving().await });
        f.start(2, Instant::now() + FAR);
        tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("serving() resolves when a new lease starts")
            .unwrap();
    }
}
