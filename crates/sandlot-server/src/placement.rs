//! Placement: which node of a cluster runs a new sandbox (DESIGN.md "Cluster mode").
//!
//! [`place`] filters the nodes that can take the sandbox — up and serving, the backend (and
//! OCI runtime, and accelerator) supported, room for its cpu, memory and one more sandbox —
//! then picks by **power of two choices** (Mitzenmacher, "The Power of Two Choices in
//! Randomized Load Balancing", 2001): two feasible nodes drawn at random, the better
//! [`score`] wins. Two draws keep the pick O(1) per create and avoid the herd a
//! deterministic "least loaded" pick sends to one node when many servers place at once
//! from slightly stale views of usage.
//!
//! The score prefers image locality (the share of the image's layer bytes already cached on
//! the node: a lazy pull of what is missing is the slowest part of a cold create), then
//! spread of a job (`job=` label: fewer sandboxes of the same job on the node; one node's
//! loss then takes fewer of a job's rollouts), then free capacity.
//!
//! A fork goes to the node that holds its checkpoint (checkpoints are node-local files).
//! When no node fits, [`place`] answers [`PlacementError::NoCapacity`] at once — the server
//! maps it to 429 `resource_exhausted` with `Retry-After` — with the reason of each node,
//! so an operator can see why (e.g. "node-2: backend vm unavailable").
//!
//! Published usage lags (a node publishes it at most once a second), so a burst of creates
//! would all score one node as emptiest; each server therefore adds what it placed on a node
//! lately ([`Candidate::recent`]) to that node's usage when it *scores* (never when it
//! filters: the node enforces its own capacity, and a placement counted twice for a moment
//! must not refuse a create).
//!
//! This module is pure logic over a snapshot of the node set (from etcd in cluster mode);
//! it performs no I/O.
use rand::Rng;
use sandlot_api::Backend;
use sandlot_cluster::{NodeRecord, Resources};

/// What placement needs to know of one node: its membership record (from etcd in cluster
/// mode) and whether it may take work now.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Candidate {
    /// The node's record: name, capacity (cpu already multiplied by any overcommit factor
    /// the operator allows) and usage, backends, runtimes, accelerator, cached layers, jobs.
    pub record: std::sync::Arc<NodeRecord>,
    /// False while the node is `down`, fenced or draining: never picked.
    pub serving: bool,
    /// What this server placed on the node lately, which `record.usage` may not show yet:
    /// counted by [`score`] (free capacity and job spread), not by [`unfit`].
    pub recent: Recent,
}

/// Placements a server made on one node within the usage-publication lag.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Recent {
    /// Their sum: cpu cores, MiB, sandboxes.
    pub usage: Resources,
    /// Their `job` labels and how many of each.
    pub jobs: std::collections::BTreeMap<String, u64>,
}

/// One layer of the image a sandbox starts from: its digest and size in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// `sha256:<hex>` digest.
    pub digest: String,
    /// Size in bytes (weights locality: a cached 500 MiB layer counts more than a 2 MiB one).
    pub bytes: u64,
}

/// What one create asks of a node.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    /// Isolation level.
    pub backend: Backend,
    /// OCI runtime of a `container` sandbox; `None` = the node's default (any node with the
    /// container backend can take it).
    pub runtime: Option<String>,
    /// Required accelerator of a `microvm`/`vm` (e.g. `kvm`), `None` = any.
    pub accelerator: Option<String>,
    /// CPU cores.
    pub cpu: f64,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// The image reference as the create names it (e.g. `python`), for locality when
    /// `layers` is empty: a node listing it in its `cached_images` counts as holding all of
    /// it. `None` = no preference.
    pub image: Option<String>,
    /// Layers of the image, for locality by cached bytes; empty = by `image` name.
    pub layers: Vec<Layer>,
    /// The `job` label of the sandbox, for spread.
    pub job: Option<String>,
    /// A fork: the node that holds the checkpoint; only that node is considered.
    pub checkpoint_node: Option<String>,
}

/// Why no node was picked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    /// No node can take the sandbox now; one reason per node (`name: why`). Answer 429
    /// `resource_exhausted` with `Retry-After`.
    #[error("no node can take this sandbox: {}", .0.join("; "))]
    NoCapacity(Vec<String>),
    /// The fork's checkpoint is on a node that is not in the node set (down or removed).
    /// Answer 503 `unavailable`: the checkpoint comes back with its node.
    #[error("the checkpoint's node {0} is not serving")]
    CheckpointNodeGone(String),
}

/// Why `c` cannot take `r`, or `None` when it can.
pub fn unfit(c: &Candidate, r: &Request) -> Option<String> {
    if !c.serving {
        return Some("not serving".into());
    }
    if !c.record.backends.contains(&r.backend) {
        return Some(format!("backend {} unavailable", r.backend.as_str()));
    }
    if let Some(rt) = &r.runtime {
        if r.backend == Backend::Container && !c.record.runtimes.iter().any(|x| x == rt) {
            return Some(format!("runtime {rt} unavailable"));
        }
    }
    if let Some(acc) = &r.accelerator {
        if matches!(r.backend, Backend::Microvm | Backend::Vm)
            && c.record.accelerator.as_ref() != Some(acc)
        {
            return Some(format!("accelerator {acc} unavailable"));
        }
    }
    let free = free(c);
    if free.sandboxes < 1 {
        return Some(format!("sandboxes full ({})", c.record.capacity.sandboxes));
    }
    // Sums of decimal fractions: allow a rounding error of a millicore.
    if r.cpu > free.cpu + 1e-3 {
        return Some(format!("cpu {} free, {} asked", round3(free.cpu), r.cpu));
    }
    if r.memory_mib > free.memory_mib {
        return Some(format!(
            "memory {} MiB free, {} asked",
            free.memory_mib, r.memory_mib
        ));
    }
    None
}

fn free(c: &Candidate) -> Resources {
    Resources {
        cpu: (c.record.capacity.cpu - c.record.usage.cpu).max(0.0),
        memory_mib: c
            .record
            .capacity
            .memory_mib
            .saturating_sub(c.record.usage.memory_mib),
        sandboxes: c
            .record
            .capacity
            .sandboxes
            .saturating_sub(c.record.usage.sandboxes),
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// How good a node `c` is for `r` (higher is better), for nodes that fit:
/// `4 × locality + 2 × spread + free` where locality is the share of the image's layer
/// bytes cached on `c` (0–1; without layers in `r`, 1 when `c` lists `r.image` among its
/// cached images, else 0), spread is `1 / (1 + sandboxes of r's job on c)` (1 without a
/// job) and free is the smallest free share of cpu, memory and sandbox slots after placing
/// `r` (0–1); both count [`Candidate::recent`] on top of the published record. The weights order the goals; any of them breaks ties of the ones before.
pub fn score(c: &Candidate, r: &Request) -> f64 {
    let total: u64 = r.layers.iter().map(|l| l.bytes).sum();
    let locality = if total == 0 {
        match &r.image {
            Some(i) if c.record.cached_images.contains(i) => 1.0,
            _ => 0.0,
        }
    } else {
        let cached: u64 = r
            .layers
            .iter()
            .filter(|l| c.record.cached_layers.contains(&l.digest))
            .map(|l| l.bytes)
            .sum();
        cached as f64 / total as f64
    };
    let spread = match &r.job {
        Some(j) => {
            let on_node = c.record.jobs.get(j).unwrap_or(&0) + c.recent.jobs.get(j).unwrap_or(&0);
            1.0 / (1.0 + on_node as f64)
        }
        None => 1.0,
    };
    let mut f = free(c);
    f.cpu = (f.cpu - c.recent.usage.cpu).max(0.0);
    f.memory_mib = f.memory_mib.saturating_sub(c.recent.usage.memory_mib);
    f.sandboxes = f.sandboxes.saturating_sub(c.recent.usage.sandboxes);
    let share = |free: f64, cap: f64| {
        if cap > 0.0 {
            (free / cap).clamp(0.0, 1.0)
        } else {
            0.0
        }
    };
    let free_share = share(f.cpu - r.cpu, c.record.capacity.cpu)
        .min(share(
            f.memory_mib as f64 - r.memory_mib as f64,
            c.record.capacity.memory_mib as f64,
        ))
        .min(share(
            f.sandboxes as f64 - 1.0,
            c.record.capacity.sandboxes as f64,
        ));
    4.0 * locality + 2.0 * spread + free_share
}

/// Pick the node for `r` among `nodes` (power of two choices over the nodes that fit, by
/// [`score`]; `rng` draws the two).
///
/// # Errors
/// [`PlacementError::NoCapacity`] when no node fits (reasons per node; also for an empty
/// node set); [`PlacementError::CheckpointNodeGone`] for a fork whose checkpoint's node is
/// not in `nodes`.
pub fn place<'a, R: Rng + ?Sized>(
    nodes: &'a [Candidate],
    r: &Request,
    rng: &mut R,
) -> Result<&'a Candidate, PlacementError> {
    if let Some(want) = &r.checkpoint_node {
        let c = nodes
            .iter()
            .find(|c| &c.record.name == want)
            .ok_or_else(|| PlacementError::CheckpointNodeGone(want.clone()))?;
        return match unfit(c, r) {
            None => Ok(c),
            Some(why) => Err(PlacementError::NoCapacity(vec![format!(
                "{}: {why}",
                c.record.name
            )])),
        };
    }
    let mut fit = Vec::with_capacity(nodes.len());
    let mut why = Vec::new();
    for c in nodes {
        match unfit(c, r) {
            None => fit.push(c),
            Some(w) => why.push(format!("{}: {w}", c.record.name)),
        }
    }
    match fit.len() {
        0 => {
            if why.is_empty() {
                why.push("no node is registered".into());
            }
            Err(PlacementError::NoCapacity(why))
        }
        1 => Ok(fit[0]),
        n => {
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (sa, sb) = (score(fit[a], r), score(fit[b], r));
            Ok(if sb > sa { fit[b] } else { fit[a] })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn node(name: &str) -> Candidate {
        Candidate {
            serving: true,
            recent: Recent::default(),
            record: std::sync::Arc::new(NodeRecord {
                name: name.into(),
                capacity: Resources {
                    cpu: 8.0,
                    memory_mib: 16384,
                    sandboxes: 100,
                },
                backends: vec![Backend::Function, Backend::Container],
                runtimes: vec!["runc".into()],
                ..Default::default()
            }),
        }
    }

    /// The record of a test candidate, to change (copied out of its `Arc` if shared).
    fn rec(c: &mut Candidate) -> &mut NodeRecord {
        std::sync::Arc::make_mut(&mut c.record)
    }

    fn req() -> Request {
        Request {
            backend: Backend::Function,
            cpu: 1.0,
            memory_mib: 512,
            ..Default::default()
        }
    }

    fn layer(d: &str, bytes: u64) -> Layer {
        Layer {
            digest: d.into(),
            bytes,
        }
    }

    #[test]
    fn filters_say_why_each_node_cannot_take_it() {
        let mut down = node("down");
        down.serving = false;
        let mut full = node("full");
        rec(&mut full).usage = Resources {
            cpu: 7.5,
            memory_mib: 0,
            sandboxes: 3,
        };
        let mut slots = node("slots");
        rec(&mut slots).usage.sandboxes = 100;
        let mut mem = node("mem");
        rec(&mut mem).usage.memory_mib = 16000;
        let nodes = [down, full, slots, mem];
        let mut rng = StdRng::seed_from_u64(1);
        let err = place(&nodes, &req(), &mut rng).unwrap_err();
        let PlacementError::NoCapacity(why) = &err else {
            panic!("{err:?}")
        };
        assert_eq!(
            why,
            &[
                "down: not serving",
                "full: cpu 0.5 free, 1 asked",
                "slots: sandboxes full (100)",
                "mem: memory 384 MiB free, 512 asked",
            ]
        );
        assert!(err
            .to_string()
            .starts_with("no node can take this sandbox: down"));
        assert_eq!(
            place(&[], &req(), &mut rng).unwrap_err(),
            PlacementError::NoCapacity(vec!["no node is registered".into()])
        );
    }

    #[test]
    fn backend_runtime_and_accelerator_must_be_supported() {
        let mut kvm = node("kvm");
        rec(&mut kvm).backends.push(Backend::Microvm);
        rec(&mut kvm).accelerator = Some("kvm".into());
        let mut tcg = node("tcg");
        rec(&mut tcg).backends.push(Backend::Microvm);
        rec(&mut tcg).accelerator = Some("tcg".into());
        rec(&mut tcg).runtimes.push("runsc".into());
        let nodes = [node("plain"), kvm, tcg];
        let mut rng = StdRng::seed_from_u64(2);
        let mut r = req();
        r.backend = Backend::Microvm;
        r.accelerator = Some("kvm".into());
        for _ in 0..20 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "kvm");
        }
        r.accelerator = None;
        for _ in 0..20 {
            assert_ne!(place(&nodes, &r, &mut rng).unwrap().record.name, "plain");
        }
        let mut r = req();
        r.backend = Backend::Container;
        r.runtime = Some("runsc".into());
        for _ in 0..20 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "tcg");
        }
        r.backend = Backend::Vm;
        let err = place(&nodes, &r, &mut rng).unwrap_err();
        assert!(
            err.to_string().contains("plain: backend vm unavailable"),
            "{err}"
        );
    }

    #[test]
    fn image_locality_wins_over_free_capacity() {
        let mut warm = node("warm");
        rec(&mut warm).cached_layers = ["sha256:big".to_string()].into();
        rec(&mut warm).usage = Resources {
            cpu: 6.0,
            memory_mib: 8000,
            sandboxes: 50,
        };
        let nodes = [warm, node("idle")];
        let mut r = req();
        r.layers = vec![
            layer("sha256:big", 500 << 20),
            layer("sha256:small", 2 << 20),
        ];
        let mut rng = StdRng::seed_from_u64(3);
        // With two fitting nodes both are drawn every time: the cached one wins.
        for _ in 0..20 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "warm");
        }
        // Without layers to prefer, the idle node wins on free capacity.
        r.layers.clear();
        for _ in 0..20 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "idle");
        }
    }

    #[test]
    fn a_node_listing_the_image_by_name_wins_without_layers() {
        let mut warm = node("warm");
        rec(&mut warm).cached_images = vec!["python".into()];
        rec(&mut warm).usage = Resources {
            cpu: 6.0,
            memory_mib: 8000,
            sandboxes: 50,
        };
        let nodes = [warm, node("idle")];
        let mut r = req();
        r.image = Some("python".into());
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..20 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "warm");
        }
        // Another image: neither holds it, free capacity decides.
        r.image = Some("node".into());
        for _ in 0..20 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "idle");
        }
    }

    #[test]
    fn a_job_spreads_over_nodes() {
        let mut busy = node("a");
        rec(&mut busy).jobs.insert("job-1".into(), 3);
        let nodes = [busy, node("b")];
        let mut r = req();
        r.job = Some("job-1".into());
        let mut rng = StdRng::seed_from_u64(4);
        for _ in 0..20 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "b");
        }
        // Another job has no sandboxes on either: both stay in play.
        r.job = Some("job-2".into());
        assert!(score(&nodes[0], &r) == score(&nodes[1], &r));
    }

    #[test]
    fn two_choices_spread_load_over_many_nodes() {
        // 50 identical nodes, 2000 creates placed one by one with usage updated: the
        // busiest node ends well below what one random draw per create gives.
        let mut nodes: Vec<Candidate> = (0..50).map(|i| node(&format!("n{i}"))).collect();
        let mut rng = StdRng::seed_from_u64(5);
        let r = Request {
            cpu: 0.1,
            memory_mib: 64,
            ..req()
        };
        for _ in 0..2000 {
            let name = place(&nodes, &r, &mut rng).unwrap().record.name.clone();
            let c = nodes.iter_mut().find(|c| c.record.name == name).unwrap();
            rec(c).usage.sandboxes += 1;
            rec(c).usage.cpu += r.cpu;
            rec(c).usage.memory_mib += r.memory_mib;
        }
        let max = nodes
            .iter()
            .map(|c| c.record.usage.sandboxes)
            .max()
            .unwrap();
        let min = nodes
            .iter()
            .map(|c| c.record.usage.sandboxes)
            .min()
            .unwrap();
        assert_eq!(
            nodes.iter().map(|c| c.record.usage.sandboxes).sum::<u64>(),
            2000
        );
        assert!(
            max <= 45 && min >= 35,
            "40 per node expected, got {min}..{max}"
        );
    }

    #[test]
    fn recent_placements_count_in_the_score_not_in_the_filter() {
        // Published usage equal; "a" got 10 sandboxes of job j from this server a moment
        // ago: "b" scores higher, and "a" still fits though its recent load exceeds capacity.
        let (mut a, b) = (node("a"), node("b"));
        a.recent.usage = Resources {
            cpu: 7.5,
            memory_mib: 5120,
            sandboxes: 10,
        };
        a.recent.jobs.insert("j".into(), 10);
        let r = Request {
            job: Some("j".into()),
            ..req()
        };
        assert!(score(&b, &r) > score(&a, &r) + 1.0);
        assert_eq!(unfit(&a, &req()), None);
        let big = Request { cpu: 4.0, ..req() };
        assert!(score(&b, &big) > score(&a, &big));
    }

    #[test]
    fn a_fork_goes_to_its_checkpoint_node_or_nowhere() {
        let nodes = [node("a"), node("b")];
        let mut r = req();
        r.checkpoint_node = Some("b".into());
        let mut rng = StdRng::seed_from_u64(6);
        for _ in 0..10 {
            assert_eq!(place(&nodes, &r, &mut rng).unwrap().record.name, "b");
        }
        r.checkpoint_node = Some("gone".into());
        assert_eq!(
            place(&nodes, &r, &mut rng).unwrap_err(),
            PlacementError::CheckpointNodeGone("gone".into())
        );
        r.checkpoint_node = Some("a".into());
        r.memory_mib = 1 << 20;
        assert!(matches!(
            place(&nodes, &r, &mut rng),
            Err(PlacementError::NoCapacity(w)) if w[0].starts_with("a: memory")
        ));
    }
}
