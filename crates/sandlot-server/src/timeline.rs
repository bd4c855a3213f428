//! `GET /v1/timeline`: what this server did over the last minutes, in 10 s buckets, for the
//! charts of the status page ([`crate::web`]): node creates per second and exec latency
//! (p50 / p99) per bucket. Kept in memory ([`BUCKETS`] × [`BUCKET_S`] s = 10 min; older
//! buckets are dropped), per server process (each server of a cluster charts its own calls).
//!
//! Latencies are counted in fixed buckets ([`LATENCY_BOUNDS_MS`]); a percentile is the
//! upper bound of the bucket it falls in (`null` above the last bound), so a chart is exact
//! to that resolution and a bucket costs a fixed ~120 bytes whatever the call rate.
use crate::SharedState;
use axum::extract::State;
use axum::Json;
use std::collections::VecDeque;
use std::sync::Mutex;

/// Width of one bucket, seconds.
pub const BUCKET_S: u64 = 10;
/// Buckets kept (10 minutes).
pub const BUCKETS: usize = 60;
/// Upper bounds of the exec latency buckets, milliseconds (one more bucket above the last).
pub const LATENCY_BOUNDS_MS: [f64; 14] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 3e4,
];

#[derive(Debug, Clone, Default)]
struct Bucket {
    /// Start, Unix seconds (a multiple of [`BUCKET_S`]).
    start_s: u64,
    creates: u64,
    execs: u64,
    latency: [u32; LATENCY_BOUNDS_MS.len() + 1],
}

/// One bucket as `GET /v1/timeline` answers it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Point {
    /// Start of the bucket, Unix seconds.
    pub t: u64,
    /// Node creates (successful or not) per second in the bucket.
    pub creates_per_s: f64,
    /// Execs run on the node in the bucket.
    pub execs: u64,
    /// Exec latency p50 / p99, ms (a bucket bound; `None` without execs or above the last
    /// bound).
    pub exec_p50_ms: Option<f64>,
    /// See `exec_p50_ms`.
    pub exec_p99_ms: Option<f64>,
}

/// The last [`BUCKETS`] buckets of one server. Recording takes a mutex held for a few
/// nanoseconds (no allocation once the ring is full).
#[derive(Debug, Default)]
pub struct Timeline {
    ring: Mutex<VecDeque<Bucket>>,
}

impl Timeline {
    fn with_bucket(&self, now_s: u64, f: impl FnOnce(&mut Bucket)) {
        let start_s = now_s - now_s % BUCKET_S;
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.back().is_none_or(|b| b.start_s < start_s) {
            if ring.len() == BUCKETS {
                ring.pop_front();
            }
            ring.push_back(Bucket {
                start_s,
                ..Bucket::default()
            });
        }
        // A clock step backwards lands in the newest bucket.
        f(ring.back_mut().expect("pushed above"));
    }

    /// Count one node create at `now_s` (Unix seconds).
    pub fn create_at(&self, now_s: u64) {
        self.with_bucket(now_s, |b| b.creates += 1);
    }

    /// Count one exec of `secs` wall seconds at `now_s`.
    pub fn exec_at(&self, now_s: u64, secs: f64) {
        let ms = secs * 1e3;
        let i = LATENCY_BOUNDS_MS
            .iter()
            .position(|b| ms <= *b)
            .unwrap_or(LATENCY_BOUNDS_MS.len());
        self.with_bucket(now_s, |b| {
            b.execs += 1;
            b.latency[i] = b.latency[i].saturating_add(1);
        });
    }

    /// The buckets of the last [`BUCKETS`] × [`BUCKET_S`] s before `now_s`, oldest first,
    /// with empty ones filled in (so a chart's x axis is time).
    pub fn points(&self, now_s: u64) -> Vec<Point> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let last = now_s - now_s % BUCKET_S;
        let first = last.saturating_sub((BUCKETS as u64 - 1) * BUCKET_S);
        let mut it = ring.iter().filter(|b| b.start_s >= first).peekable();
        (0..BUCKETS as u64)
            .map(|i| first + i * BUCKET_S)
            .filter(|t| *t <= last)
            .map(|t| match it.next_if(|b| b.start_s == t) {
                Some(b) => Point {
                    t,
                    creates_per_s: b.creates as f64 / BUCKET_S as f64,
                    execs: b.execs,
                    exec_p50_ms: percentile(&b.latency, b.execs, 0.50),
                    exec_p99_ms: percentile(&b.latency, b.execs, 0.99),
                },
                None => Point {
                    t,
                    creates_per_s: 0.0,
                    execs: 0,
                    exec_p50_ms: None,
                    exec_p99_ms: None,
                },
            })
            .collect()
    }
}

/// The bound of the latency bucket holding the `q` quantile of `n` counts.
fn percentile(counts: &[u32], n: u64, q: f64) -> Option<f64> {
    if n == 0 {
        return None;
    }
    let rank = ((n as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0u64;
    for (i, c) in counts.iter().enumerate() {
        seen += u64::from(*c);
        if seen >= rank {
            return LATENCY_BOUNDS_MS.get(i).copied();
        }
    }
    None
}

/// Unix seconds now.
pub fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `GET /v1/timeline` → 200 `{"bucket_s": 10, "points": [Point, …]}` (the last 10 minutes,
/// oldest first, one point per bucket). Any valid key when authentication is on.
pub async fn get(State(st): State<SharedState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "bucket_s": BUCKET_S,
        "points": st.metrics.timeline.points(now_s()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_rates_and_percentiles() {
        let t = Timeline::default();
        let t0 = 1_000_000; // a multiple of BUCKET_S
        for _ in 0..50 {
            t.create_at(t0 + 3);
        }
        for i in 0..100 {
            // 98 fast execs (3 ms), two slow ones (400 ms)
            t.exec_at(t0 + 5, if i < 98 { 0.003 } else { 0.4 });
        }
        t.create_at(t0 + 25); // two buckets later: the one between stays empty
        let p = t.points(t0 + 29);
        assert_eq!(p.len(), BUCKETS);
        let (a, gap, b) = (&p[BUCKETS - 3], &p[BUCKETS - 2], &p[BUCKETS - 1]);
        assert_eq!((a.t, gap.t, b.t), (t0, t0 + 10, t0 + 20));
        assert_eq!(a.creates_per_s, 5.0);
        assert_eq!(a.execs, 100);
        assert_eq!(a.exec_p50_ms, Some(5.0));
        assert_eq!(a.exec_p99_ms, Some(500.0));
        assert_eq!(
            (gap.execs, gap.exec_p50_ms, gap.creates_per_s),
            (0, None, 0.0)
        );
        assert_eq!(b.creates_per_s, 0.1);
        // Ten minutes on, the old buckets are gone and the ring stays bounded.
        for k in 0..200 {
            t.create_at(t0 + 30 + k * BUCKET_S);
        }
        assert!(t.ring.lock().unwrap().len() <= BUCKETS);
        let later = t.points(t0 + 30 + 199 * BUCKET_S);
        assert!(later.iter().all(|p| p.execs == 0 && p.creates_per_s == 0.1));
        // Above the last bound: no percentile value.
        let slow = Timeline::default();
        slow.exec_at(t0, 60.0);
        assert_eq!(slow.points(t0)[BUCKETS - 1].exec_p50_ms, None);
    }
}
