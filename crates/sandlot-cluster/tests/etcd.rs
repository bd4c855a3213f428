//! Membership, fencing and election against real etcd members started by
//! `scripts/etcd.sh` into a temp dir. Without `etcd` on PATH each test prints
//! "SKIPPED: ..." and returns (scripts/setup.sh installs Debian's etcd-server).
use sandlot_cluster::testing::LocalEtcd as Etcd;
use sandlot_cluster::{
    connect, Election, LeaseConfig, NodeEvent, NodeRecord, NodeRegistration, NodeSet, Resources,
};
use std::time::Duration;
use tokio::sync::broadcast;
use tokio::time::{timeout, Instant};

const TTL_S: u64 = 3;

fn record(name: &str) -> NodeRecord {
    NodeRecord {
        name: name.into(),
        advertise_url: format!("http://127.0.0.1:7070/{name}"),
        capacity: Resources {
            cpu: 16.0,
            memory_mib: 65536,
            sandboxes: 200,
        },
        backends: vec![sandlot_api::Backend::Function],
        runtimes: vec!["runc".into()],
        cached_images: vec!["busybox".into()],
        started_at: "2026-12-04T04:00:00Z".into(),
        ..Default::default()
    }
}

async fn next_event(rx: &mut broadcast::Receiver<NodeEvent>, within: Duration) -> NodeEvent {
    timeout(within, rx.recv())
        .await
        .expect("no node event in time")
        .expect("event stream")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_registers_updates_and_goes_down_after_kill() {
    let Some(etcd) = Etcd::start("node_registers_updates_and_goes_down_after_kill", 1) else {
        return;
    };
    let cfg = LeaseConfig::new(TTL_S).unwrap();
    let server = connect(&etcd.urls).await.unwrap();
    let nodes = NodeSet::start(&server).await.unwrap();
    let (now, mut rx) = nodes.subscribe();
    assert!(now.is_empty());

    let node = connect(&etcd.urls).await.unwrap();
    let reg = NodeRegistration::register(&node, record("n1"), cfg)
        .await
        .unwrap();
    assert!(reg.is_serving());
    match next_event(&mut rx, Duration::from_secs(5)).await {
        NodeEvent::Up(r) => assert_eq!(
            r.capacity,
            Resources {
                cpu: 16.0,
                memory_mib: 65536,
                sandboxes: 200
            }
        ),
        e => panic!("expected Up, got {e:?}"),
    }
    assert_eq!(
        nodes.get("n1").unwrap().advertise_url,
        "http://127.0.0.1:7070/n1"
    );

    let usage = Resources {
        cpu: 2.5,
        memory_mib: 1024,
        sandboxes: 3,
    };
    reg.update(|r| r.usage = usage).await.unwrap();
    match next_event(&mut rx, Duration::from_secs(5)).await {
        NodeEvent::Updated(r) => assert_eq!(r.usage, usage),
        e => panic!("expected Updated, got {e:?}"),
    }

    // kill -9: the keep-alive stops, nothing is revoked.
    let killed = Instant::now();
    drop(reg);
    match next_event(&mut rx, Duration::from_secs(TTL_S + 2)).await {
        NodeEvent::Down(r) => assert_eq!((r.name.as_str(), r.usage), ("n1", usage)),
        e => panic!("expected Down, got {e:?}"),
    }
    let after = killed.elapsed();
    assert!(
        after <= Duration::from_secs(TTL_S + 2),
        "down after {after:?}"
    );
    assert!(nodes.get("n1").is_none());
    println!("node down {after:?} after its keep-alive stopped (ttl {TTL_S} s)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_node_fences_before_ttl_and_serves_again_after() {
    let Some(etcd) = Etcd::start(
        "partitioned_node_fences_before_ttl_and_serves_again_after",
        1,
    ) else {
        return;
    };
    let cfg = LeaseConfig::new(TTL_S).unwrap();
    let node = connect(&etcd.urls).await.unwrap();
    let reg = NodeRegistration::register(&node, record("n1"), cfg)
        .await
        .unwrap();
    let fence = reg.fence();
    let (lease0, epoch0) = (fence.lease_id(), fence.epoch());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(fence.is_serving());

    // Partition: the only member stops answering (SIGSTOP; connections stay open).
    etcd.member("pause-member", 0);
    let paused = Instant::now();
    timeout(Duration::from_secs(TTL_S), fence.fenced())
        .await
        .expect("fence still on at TTL");
    let off_after = paused.elapsed();
    assert!(!reg.is_serving());
    // The lease's last renewal was sent before the pause, so etcd cannot expire it before
    // paused + TTL: the fence went off earlier, by at least the margin minus one interval.
    assert!(
        off_after < Duration::from_secs(TTL_S) - cfg.safety_margin + cfg.keepalive_interval,
        "off after {off_after:?}"
    );
    assert!(matches!(
        reg.update(|r| r.usage.sandboxes = 1).await,
        Err(sandlot_cluster::ClusterError::Fenced { .. })
    ));
    tokio::time::sleep(Duration::from_secs(TTL_S)).await;
    assert!(
        !reg.is_serving(),
        "serving again while etcd is still stopped"
    );

    etcd.member("resume-member", 0);
    let resumed = Instant::now();
    timeout(Duration::from_secs(10), fence.serving())
        .await
        .expect("not serving again 10 s after etcd came back");
    assert!(fence.epoch() > epoch0);
    assert_ne!(fence.lease_id(), lease0, "serving again needs a new lease");
    println!("fenced {off_after:?} after the partition (ttl {TTL_S} s); serving again {:?} after healing", resumed.elapsed());

    // The record is back, with the usage changed while fenced.
    let nodes = NodeSet::start(&connect(&etcd.urls).await.unwrap())
        .await
        .unwrap();
    assert_eq!(
        nodes
            .get("n1")
            .expect("n1 registered again")
            .usage
            .sandboxes,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn election_has_one_leader_and_fails_over_after_kill() {
    let Some(etcd) = Etcd::start("election_has_one_leader_and_fails_over_after_kill", 1) else {
        return;
    };
    let cfg = LeaseConfig::new(TTL_S).unwrap();
    let a = Election::new(&connect(&etcd.urls).await.unwrap(), cfg);
    let b = Election::new(&connect(&etcd.urls).await.unwrap(), cfg);

    let lead_a = timeout(Duration::from_secs(5), a.campaign("singletons", "server-a"))
        .await
        .unwrap()
        .unwrap();
    assert!(lead_a.is_leader());
    let b_campaign = tokio::spawn(async move { b.campaign("singletons", "server-b").await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!b_campaign.is_finished(), "two leaders at once");
    assert_eq!(
        a.leader("singletons").await.unwrap().as_deref(),
        Some("server-a")
    );

    // kill -9 of the leader: its keep-alive stops, no resignation.
    let fence_a = lead_a.fence();
    let killed = Instant::now();
    drop(lead_a);
    assert!(!fence_a.is_serving());
    let lead_b = timeout(Duration::from_secs(TTL_S + 2), b_campaign)
        .await
        .expect("no takeover within TTL + 2 s")
        .unwrap()
        .unwrap();
    let took = killed.elapsed();
    assert!(lead_b.is_leader());
    assert_eq!(
        a.leader("singletons").await.unwrap().as_deref(),
        Some("server-b")
    );
    println!("server-b leads {took:?} after server-a's keep-alive stopped (ttl {TTL_S} s)");

    // A resignation hands over at once.
    let c = Election::new(&connect(&etcd.urls).await.unwrap(), cfg);
    let c_campaign = tokio::spawn(async move { c.campaign("singletons", "server-c").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    lead_b.resign().await.unwrap();
    let lead_c = timeout(Duration::from_secs(2), c_campaign)
        .await
        .expect("no handover after resign")
        .unwrap()
        .unwrap();
    assert!(lead_c.is_leader());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_partitioned_from_etcd_loses_leadership_before_ttl() {
    let Some(etcd) = Etcd::start(
        "leader_partitioned_from_etcd_loses_leadership_before_ttl",
        1,
    ) else {
        return;
    };
    let cfg = LeaseConfig::new(TTL_S).unwrap();
    let a = Election::new(&connect(&etcd.urls).await.unwrap(), cfg);
    let lead = a.campaign("reaper", "server-a").await.unwrap();
    etcd.member("pause-member", 0);
    let paused = Instant::now();
    timeout(Duration::from_secs(TTL_S), lead.lost())
        .await
        .expect("still leader at TTL");
    assert!(paused.elapsed() < Duration::from_secs(TTL_S));
    etcd.member("resume-member", 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_one_stopped_does_not_disturb_membership() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sandlot_cluster=debug")
        .with_test_writer()
        .try_init();
    let Some(etcd) = Etcd::start("three_members_one_stopped_does_not_disturb_membership", 3) else {
        return;
    };
    let cfg = LeaseConfig::new(TTL_S).unwrap();
    let server = connect(&etcd.urls).await.unwrap();
    let nodes = NodeSet::start(&server).await.unwrap();
    let node = connect(&etcd.urls).await.unwrap();
    let reg = NodeRegistration::register(&node, record("n1"), cfg)
        .await
        .unwrap();
    let fence = reg.fence();
    let (_, mut rx) = nodes.subscribe();
    timeout(Duration::from_secs(5), async {
        while nodes.get("n1").is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap();

    for member in 0..3 {
        etcd.member("stop-member", member);
        let until = Instant::now() + Duration::from_secs(2 * TTL_S);
        while Instant::now() < until {
            assert!(fence.is_serving(), "fence off with member {member} stopped");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        reg.update(|r| r.usage.sandboxes = member as u64 + 1)
            .await
            .unwrap();
        etcd.member("start-member", member);
    }
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        if let Ok(Ok(NodeEvent::Down(r))) = timeout(Duration::from_millis(100), rx.recv()).await {
            panic!("node reported down: {r:?}");
        }
    }
    assert_eq!(fence.epoch(), 1, "the node had to re-register");
    assert_eq!(nodes.get("n1").unwrap().usage.sandboxes, 3);
}
