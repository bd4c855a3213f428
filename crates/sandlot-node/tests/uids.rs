//! Per-sandbox host uid ranges of the `function` backend, and the per-user kernel counts
//! they isolate (inotify instances). A real `LocalNode`, the real `sandlot-guest` and the
//! python image of the machine's image store (`SANDLOT_IMAGES_DIR`, default
//! `/var/lib/sandlot/images`; only read). Needs root, cgroups, the guest binary
//! (`SANDLOT_GUEST_BIN`, else `target/{release,debug}/sandlot-guest` of this build's
//! profile) and host `python3`; each test prints why it skips.
use sandlot_api::{Cmd, ExecRequest, ExecResult};
use sandlot_node::backends::saved::{self, SavedSandbox};
use sandlot_node::cgroups::CgroupRoot;
use sandlot_node::{LocalNode, Node, NodeConfig, SandboxSpec};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod support;

struct Env {
    node: Option<LocalNode>,
    cfg: NodeConfig,
    _tmp: tempfile::TempDir,
}

impl Env {
    fn node(&self) -> &LocalNode {
        self.node.as_ref().unwrap()
    }
    fn dir(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("sandboxes").join(id)
    }
    fn cgroups(&self) -> CgroupRoot {
        support::cgroups(&self.cfg)
    }
    fn base(&self, id: &str) -> u32 {
        saved::read::<SavedSandbox>(&self.dir(id))
            .expect("state.json")
            .uid_base
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(node) = self.node.take() {
            support::delete_all(&node);
        }
        let _ = self.cgroups().remove_parent();
    }
}

fn setup(test: &str) -> Option<Env> {
    let guest = support::host_ready(test, "build sandlot-guest")?;
    let images = std::env::var_os("SANDLOT_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/sandlot/images"));
    if !images.join("python/image.json").exists() {
        eprintln!(
            "SKIP {test}: no python image in {} (set SANDLOT_IMAGES_DIR)",
            images.display()
        );
        return None;
    }
    if std::process::Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
        .map_or(true, |s| !s.success())
    {
        eprintln!("SKIP {test}: no python3 on the host");
        return None;
    }
    let (mut cfg, tmp) = support::node_config(guest);
    cfg.images_dir = images;
    cfg.cgroup_parent = support::unique_cgroup_parent("sandlot-test-uids");
    let node = LocalNode::open(cfg.clone()).unwrap();
    Some(Env {
        node: Some(node),
        cfg,
        _tmp: tmp,
    })
}

fn spec(id: &str) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        backend: sandlot_api::Backend::Function,
        image: "python".into(),
        cpu: 1.0,
        memory_mib: 512,
        disk_mib: 64,
        pids_max: 128,
        env: Default::default(),
        network: sandlot_api::NetworkPolicy::None,
        runtime: None,
    }
}

fn req(argv: &[&str], timeout_s: f64) -> ExecRequest {
    let mut r = ExecRequest::new(Cmd::Argv(argv.iter().map(|s| s.to_string()).collect()));
    r.timeout_s = Some(timeout_s);
    r
}

async fn run(node: &LocalNode, id: &str, argv: &[&str]) -> ExecResult {
    let r = node
        .exec(id, &req(argv, 60.0), None)
        .await
        .unwrap_or_else(|e| panic!("exec {argv:?} in {id}: {e}"));
    assert_eq!(r.exit_code, 0, "{argv:?} in {id}: {r:?}");
    r
}

/// `Uid:` line of /proc/PID/status: real, effective, saved, fs.
fn status_uids(pid: i32) -> Option<Vec<u32>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("Uid:"))?;
    Some(
        line[4..]
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect(),
    )
}

/// Opens inotify instances until the kernel refuses (or 200), holds them until
/// /tmp/release exists; prints how many it got.
const HOLD: &str = r#"
import ctypes, os, time
l = ctypes.CDLL(None, use_errno=True)
fds = []
err = ""
for _ in range(200):
    fd = l.inotify_init1(0)
    if fd < 0:
        err = os.strerror(ctypes.get_errno())
        break
    fds.append(fd)
open("/tmp/held", "w").write(f"{len(fds)} {err}")
while not os.path.exists("/tmp/release"):
    time.sleep(0.05)
print(len(fds), err)
"#;

/// One inotify_init1 from a fresh process: prints its result and errno text.
const ONE: &str = r#"
import ctypes, os
l = ctypes.CDLL(None, use_errno=True)
fd = l.inotify_init1(0)
print(fd, os.strerror(ctypes.get_errno()) if fd < 0 else "ok")
"#;

fn host_inotify_ok() -> String {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(ONE)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sandbox_has_its_own_host_uid_range() {
    let Some(mut env) = setup("each_sandbox_has_its_own_host_uid_range") else {
        return;
    };
    let n = env.node();
    n.create(&spec("sb-a")).await.unwrap();
    n.create(&spec("sb-b")).await.unwrap();
    let (a, b) = (env.base("sb-a"), env.base("sb-b"));
    // Lowest free slots of the node's base, one 65536-id range each.
    let mut got = [a, b];
    got.sort();
    assert_eq!(got, [env.cfg.uid_base, env.cfg.uid_base + 65536]);

    for (id, base) in [("sb-a", a), ("sb-b", b)] {
        // The init's id maps use the sandbox's own base.
        let st = saved::read::<SavedSandbox>(&env.dir(id)).unwrap();
        for f in ["uid_map", "gid_map"] {
            let map = std::fs::read_to_string(format!("/proc/{}/{f}", st.init_pid)).unwrap();
            let fields: Vec<&str> = map.split_whitespace().collect();
            assert_eq!(fields, ["0", &base.to_string(), "65536"], "{id} {f}");
        }
        // Files written through the files API and by a command: owned by the sandbox's base.
        n.write_file(id, "/workspace/api.txt", bytes::Bytes::from_static(b"x"))
            .await
            .unwrap();
        run(n, id, &["sh", "-c", "echo y > /workspace/cmd.txt; id -u"]).await;
        for f in ["api.txt", "cmd.txt"] {
            let md =
                std::fs::metadata(env.dir(id).join("scratch/upper/workspace").join(f)).unwrap();
            assert_eq!((md.uid(), md.gid()), (base, base), "{id} {f}");
        }
        let md = std::fs::metadata(env.dir(id).join("scratch/upper")).unwrap();
        assert_eq!(md.uid(), base, "{id} upper dir owner");
    }

    // After a restart the slots are rebuilt from state.json: a new sandbox gets neither
    // re-adopted range; a deleted sandbox's range is reused.
    drop(env.node.take());
    let node = LocalNode::open(env.cfg.clone()).unwrap();
    let adopted = node
        .readopt(&["sb-a".to_string(), "sb-b".to_string()])
        .await
        .unwrap();
    assert_eq!(adopted, ["sb-a", "sb-b"]);
    node.create(&spec("sb-c")).await.unwrap();
    env.node = Some(node);
    assert_eq!(env.base("sb-c"), env.cfg.uid_base + 2 * 65536);
    env.node().delete("sb-a").await.unwrap();
    env.node().create(&spec("sb-d")).await.unwrap();
    assert_eq!(
        env.base("sb-d"),
        a,
        "the freed range is the lowest free one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inotify_instances_are_charged_to_the_sandbox_not_host_root() {
    let test = "inotify_instances_are_charged_to_the_sandbox_not_host_root";
    let Some(env) = setup(test) else {
        return;
    };
    let max: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    if max >= 200 {
        eprintln!("SKIP {test}: fs.inotify.max_user_instances is {max}, the test holds 200");
        return;
    }
    let n = env.node();
    n.create(&spec("sb-hold")).await.unwrap();
    n.create(&spec("sb-other")).await.unwrap();
    let (hold_base, other_base) = (env.base("sb-hold"), env.base("sb-other"));
    assert_ne!(hold_base, other_base);

    // A long-running exec holds as many instances as the kernel gives its uid.
    let hold_req = req(&["python3", "-c", HOLD], 60.0);
    let holder = n.exec("sb-hold", &hold_req, None);
    let checks = async {
        let end = Instant::now() + Duration::from_secs(30);
        let held = loop {
            if let Ok(b) = n.read_file("sb-hold", "/tmp/held", 1024).await {
                break String::from_utf8(b).unwrap();
            }
            assert!(Instant::now() < end, "the holder never reported");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // The sandbox hits the per-user limit, for its own uid.
        assert_eq!(held, format!("{max} Too many open files"), "holder: {held}");

        // Its processes run as the sandbox's host uid (the exec helper itself stays host
        // root outside the namespaces and holds no inotify instance).
        // (Exec cgroups on the helper path; the sandbox's own group when execs go through
        // the guest agent in the jail, the default.)
        let cg = env.cgroups().sandbox("sb-hold");
        let mut uids = Vec::new();
        for g in cg.exec_children().iter().chain([cg.group()]) {
            for pid in g.pids() {
                if let Some(u) = status_uids(pid) {
                    uids.push(u);
                }
            }
        }
        assert!(
            uids.iter().any(|u| u.iter().all(|&x| x == hold_base)),
            "no process of the holder runs as {hold_base}: {uids:?}"
        );
        assert!(uids.iter().flatten().all(|&x| x == hold_base || x == 0));

        // Host root and the other sandbox are untouched.
        assert_eq!(host_inotify_ok().split_whitespace().nth(1), Some("ok"));
        let r = run(n, "sb-other", &["python3", "-c", ONE]).await;
        assert!(
            r.stdout.trim().ends_with(" ok"),
            "other sandbox: {:?}",
            r.stdout
        );
        n.write_file("sb-hold", "/tmp/release", bytes::Bytes::new())
            .await
            .unwrap();
    };
    let (res, ()) = tokio::join!(holder, checks);
    let res = res.unwrap();
    assert_eq!(res.exit_code, 0, "{res:?}");
    assert_eq!(res.stdout.trim(), format!("{max} Too many open files"));

    // Released with the exec: the sandbox gets its whole share again.
    run(n, "sb-hold", &["rm", "-f", "/tmp/held", "/tmp/release"]).await;
    let again = n.exec("sb-hold", &hold_req, None);
    let release = async {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(b) = n.read_file("sb-hold", "/tmp/held", 1024).await {
                assert_eq!(
                    String::from_utf8(b).unwrap(),
                    format!("{max} Too many open files")
                );
                break;
            }
            assert!(Instant::now() < end, "the second holder never reported");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        n.write_file("sb-hold", "/tmp/release", bytes::Bytes::new())
            .await
            .unwrap();
    };
    let (res, ()) = tokio::join!(again, release);
    assert_eq!(res.unwrap().exit_code, 0);
    assert_eq!(host_inotify_ok().split_whitespace().nth(1), Some("ok"));
}
