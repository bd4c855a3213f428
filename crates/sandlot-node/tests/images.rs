//! Integration tests of `sandlot_node::images::ImageStore` with real builds.
//!
//! - busybox tests need `/bin/busybox` (Debian `busybox-static`); running the image needs
//!   root (`chroot`).
//! - the python test uses the debootstrap cache at `$SANDLOT_PYTHON_CACHE_DIR` or
//!   `/var/cache/sandlot` (`python-bookworm/` with its stamp) and skips when it is missing;
//!   building the cache from nothing (~1-2 min, network to the Debian mirror) runs only with
//!   `SANDLOT_TEST_DEBOOTSTRAP=1`.
//!
//! Each skip prints why.
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::unistd::Uid;
use sandlot_node::images::{
    DebootstrapSpec, ImageSource, ImageStore, CACHE_STAMP, DEFAULT_PATH, IMAGE_JSON,
};
use sandlot_node::NodeError;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

fn have_busybox() -> bool {
    if Path::new("/bin/busybox").exists() {
        true
    } else {
        eprintln!("SKIP: /bin/busybox missing (apt-get install busybox-static)");
        false
    }
}

fn is_root(why: &str) -> bool {
    if Uid::effective().is_root() {
        true
    } else {
        eprintln!("SKIP: needs root ({why})");
        false
    }
}

/// Run `argv` chrooted into an overlay of `layers` (read-only lowers, tmpfs upper), the
/// way a sandbox sees an image. Uses a private mount namespace for this test thread.
fn run_in_overlay(layers: &[PathBuf], argv: &[&str]) -> (bool, String) {
    unshare(CloneFlags::CLONE_NEWNS).expect("unshare mount ns");
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let rw = tmp.path().join("rw");
    fs::create_dir(&rw).unwrap();
    mount(
        Some("tmpfs"),
        &rw,
        Some("tmpfs"),
        MsFlags::empty(),
        None::<&str>,
    )
    .unwrap();
    for d in ["upper", "work", "merged"] {
        fs::create_dir(rw.join(d)).unwrap();
    }
    let lower: Vec<String> = layers.iter().map(|p| p.display().to_string()).collect();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.join(":"),
        rw.join("upper").display(),
        rw.join("work").display()
    );
    let merged = rw.join("merged");
    mount(
        Some("overlay"),
        &merged,
        Some("overlay"),
        MsFlags::empty(),
        Some(opts.as_str()),
    )
    .expect("mount overlay");
    let out = Command::new("chroot")
        .arg(&merged)
        .args(argv)
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .output()
        .expect("run chroot");
    let _ = umount2(&merged, MntFlags::MNT_DETACH);
    let _ = umount2(&rw, MntFlags::MNT_DETACH);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn busybox_image_layout_and_run() {
    if !have_busybox() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let t = Instant::now();
    let img = store.build_busybox().unwrap();
    eprintln!("busybox image built in {:?}", t.elapsed());
    assert_eq!(img.name, "busybox");
    assert_eq!(img.layers, vec![tmp.path().join("images/busybox/rootfs")]);
    assert_eq!(
        img.env,
        vec![("PATH".to_string(), DEFAULT_PATH.to_string())]
    );
    assert_eq!(img.workdir.as_deref(), Some("/workspace"));
    assert!(chrono::DateTime::parse_from_rfc3339(&img.created_at).is_ok());
    assert!(matches!(img.source, ImageSource::Busybox { .. }));
    let rootfs = &img.layers[0];
    let bb = fs::metadata(rootfs.join("bin/busybox")).unwrap();
    assert_eq!(bb.len(), fs::metadata("/bin/busybox").unwrap().len());
    assert_eq!(bb.permissions().mode() & 0o777, 0o755);
    assert!(img.size_bytes >= bb.len());
    assert_eq!(
        fs::read_link(rootfs.join("bin/sh")).unwrap(),
        Path::new("busybox")
    );
    // One symlink per applet.
    let list = Command::new("/bin/busybox").arg("--list").output().unwrap();
    let applets = String::from_utf8_lossy(&list.stdout).lines().count();
    let links = fs::read_dir(rootfs.join("bin"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_type().unwrap().is_symlink())
        .count();
    assert!(
        links + 1 >= applets && applets > 100,
        "{links} links for {applets} applets"
    );
    for (d, mode) in [
        ("tmp", 0o1777),
        ("root", 0o700),
        ("workspace", 0o755),
        ("proc", 0o755),
        ("dev", 0o755),
        ("sys", 0o755),
        ("usr/bin", 0o755),
    ] {
        let md = fs::metadata(rootfs.join(d)).unwrap();
        assert!(md.is_dir(), "{d}");
        assert_eq!(md.permissions().mode() & 0o7777, mode, "{d}");
    }
    let passwd = fs::read_to_string(rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.starts_with("root:x:0:0:root:/root:/bin/sh\n"));
    assert!(passwd.contains("nobody:"));
    assert!(rootfs.join("etc/group").is_file());
    assert!(rootfs.join("etc/hostname").is_file());

    // The store sees it.
    assert_eq!(store.get("busybox").unwrap(), img);
    let names: Vec<_> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, vec!["busybox".to_string()]);
    // A second store on the same dir sees it too (all state on disk).
    assert_eq!(
        ImageStore::open(tmp.path().join("images"))
            .unwrap()
            .get("busybox")
            .unwrap(),
        img
    );

    if is_root("chroot into the image") {
        let (ok, out) = run_in_overlay(
            &img.layers,
            &[
                "/bin/sh",
                "-c",
                "echo hello from $(cat /etc/hostname); ls /bin | wc -l",
            ],
        );
        assert!(ok, "{out}");
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some("hello from sandbox"));
        let n: usize = lines.next().unwrap().trim().parse().unwrap();
        assert_eq!(n, links + 1);
    }
}

#[test]
fn rebuild_is_skipped_unless_forced_and_remove_works() {
    if !have_busybox() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let a = store.build_busybox().unwrap();
    let ino = |img: &sandlot_node::images::Image| fs::metadata(&img.layers[0]).unwrap().ino();
    let a_ino = ino(&a);
    let b = store.build_busybox().unwrap();
    assert_eq!(ino(&b), a_ino, "not rebuilt");
    assert_eq!(b.created_at, a.created_at);
    let c = store.build_busybox_with(true).unwrap();
    assert_ne!(ino(&c), a_ino, "forced rebuild makes a new rootfs");
    // Only the image dir is left: no temp or old dirs.
    let entries: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(entries, vec!["busybox".to_string()]);

    store.remove("busybox").unwrap();
    assert!(!tmp.path().join("busybox").exists());
    assert!(matches!(
        store.remove("busybox"),
        Err(NodeError::NotFound(_))
    ));
    match store.get("busybox") {
        Err(NodeError::NotFound(m)) => {
            assert_eq!(m, "image \"busybox\" not found; available: none")
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
}

#[test]
fn not_found_lists_available_and_bad_names_are_refused() {
    if !have_busybox() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    store.build_busybox().unwrap();
    // Make a second image by copying metadata under another name (as the OCI import will).
    fs::create_dir(tmp.path().join("python")).unwrap();
    let json = fs::read_to_string(tmp.path().join("busybox").join(IMAGE_JSON)).unwrap();
    fs::write(
        tmp.path().join("python").join(IMAGE_JSON),
        json.replace("\"name\": \"busybox\"", "\"name\": \"python\""),
    )
    .unwrap();
    match store.get("x") {
        Err(NodeError::NotFound(m)) => {
            assert_eq!(m, "image \"x\" not found; available: busybox, python")
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    // ("a/b" would be a valid reference now: looked up, not refused.)
    for bad in [
        "", "../etc", "A", ".hidden", "a/../b", "A/b", "refs", "layers",
    ] {
        assert!(
            matches!(store.get(bad), Err(NodeError::InvalidArgument(_))),
            "{bad:?}"
        );
        assert!(
            matches!(store.remove(bad), Err(NodeError::InvalidArgument(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn half_built_images_are_never_listed_and_leftovers_are_cleaned() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // A rootfs without image.json (crash before the last step).
    fs::create_dir_all(dir.join("half/rootfs/bin")).unwrap();
    // image.json whose name does not match its directory.
    fs::create_dir_all(dir.join("renamed")).unwrap();
    fs::write(
        dir.join("renamed").join(IMAGE_JSON),
        r#"{"name":"other","env":[],"workdir":null,"created_at":"2026-01-01T00:00:00Z","size_bytes":0,"source":{"kind":"busybox","binary":"/bin/busybox"}}"#,
    )
    .unwrap();
    // A corrupt image.json and a layer path escaping the store.
    fs::create_dir_all(dir.join("corrupt")).unwrap();
    fs::write(dir.join("corrupt").join(IMAGE_JSON), "{not json").unwrap();
    fs::create_dir_all(dir.join("escape")).unwrap();
    fs::write(
        dir.join("escape").join(IMAGE_JSON),
        r#"{"name":"escape","env":[],"workdir":null,"created_at":"2026-01-01T00:00:00Z","size_bytes":0,"source":{"kind":"busybox","binary":"/bin/busybox"},"layers":["../../etc"]}"#,
    )
    .unwrap();
    // Temp dirs of a dead builder (pid above pid_max) and of a live one (pid 1).
    let dead = dir.join(".busybox.tmp-4194304999");
    let live = dir.join(".busybox.tmp-1");
    fs::create_dir_all(dead.join("rootfs")).unwrap();
    fs::create_dir_all(live.join("rootfs")).unwrap();

    let store = ImageStore::open(dir).unwrap();
    assert!(!dead.exists(), "dead builder's temp dir removed");
    assert!(live.exists(), "live builder's temp dir kept");
    assert!(store.list().unwrap().is_empty());
    assert!(matches!(store.get("half"), Err(NodeError::NotFound(_))));
    assert!(matches!(store.get("renamed"), Err(NodeError::NotFound(_))));
    assert!(matches!(
        store.get("corrupt"),
        Err(NodeError::Internal { .. })
    ));
    assert!(matches!(
        store.get("escape"),
        Err(NodeError::Internal { .. })
    ));
}

/// Where the python debootstrap cache lives for tests.
fn python_cache_dir() -> PathBuf {
    std::env::var_os("SANDLOT_PYTHON_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sandlot"))
}

#[test]
fn python_image_from_cache() {
    let cache_dir = python_cache_dir();
    let spec = DebootstrapSpec::python_bookworm();
    let cache = cache_dir.join(&spec.cache_name);
    if !cache.join(CACHE_STAMP).exists() {
        eprintln!(
            "SKIP: no complete python cache at {} (build it once with `sandlot image build python` \
             or set SANDLOT_TEST_DEBOOTSTRAP=1 for the from-nothing test)",
            cache.display()
        );
        return;
    }
    if !is_root("hard-linked root-owned rootfs, chroot") {
        return;
    }
    let tmp = tempfile::tempdir_in(&cache_dir).unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let t = Instant::now();
    let img = store.build_python(&cache_dir).unwrap();
    let took = t.elapsed();
    eprintln!(
        "python image from cache in {took:?}, {} bytes",
        img.size_bytes
    );
    assert!(took.as_secs() < 30, "hard-link copy took {took:?}");
    let rootfs = &img.layers[0];
    assert!(img.env.contains(&("LANG".into(), "C.UTF-8".into())));
    assert!(matches!(&img.source, ImageSource::Debootstrap(s) if s.suite == "bookworm"));
    assert!(img.size_bytes > 100 << 20, "size {}", img.size_bytes);
    // Hard links into the cache when on the same file system.
    let a = fs::metadata(rootfs.join("usr/bin/python3")).unwrap();
    let b = fs::metadata(cache.join("usr/bin/python3")).unwrap();
    if a.dev() == b.dev() {
        assert_eq!(a.ino(), b.ino(), "python3 is a hard link into the cache");
    }
    assert!(!rootfs.join(CACHE_STAMP).exists());
    assert!(cache.join(CACHE_STAMP).exists(), "cache untouched");
    assert_eq!(fs::read_dir(rootfs.join("dev")).unwrap().count(), 0);
    assert!(cache.join("dev/null").exists(), "cache /dev untouched");
    assert!(rootfs.join("workspace").is_dir());
    let lists = rootfs.join("var/lib/apt/lists");
    assert!(!lists.exists() || fs::read_dir(&lists).unwrap().count() == 0);

    let (ok, out) = run_in_overlay(
        &img.layers,
        &[
            "/bin/sh",
            "-c",
            "python3 -c 'print(6*7)' && printf '#include <cstdio>\\nint main(){std::puts(\"cpp ok\");}' > /tmp/h.cc && g++ -o /tmp/h /tmp/h.cc && /tmp/h",
        ],
    );
    assert!(ok, "{out}");
    assert_eq!(out.lines().collect::<Vec<_>>(), vec!["42", "cpp ok"]);
    // The overlay write went to the upper dir; the shared rootfs is unchanged.
    assert!(!rootfs.join("tmp/h").exists());
}

#[test]
fn debootstrap_failure_leaves_no_cache_and_ignores_unstamped_dirs() {
    if !is_root("debootstrap") {
        return;
    }
    if Command::new("debootstrap")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIP: debootstrap not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cache_dir = tmp.path().join("cache");
    let spec = DebootstrapSpec {
        // Nothing listens on port 9 (discard): debootstrap fails fast.
        mirror: "http://127.0.0.1:9/debian".into(),
        cache_name: "broken-bookworm".into(),
        ..DebootstrapSpec::python_bookworm()
    };
    // An unstamped (half-done) cache dir must not be used.
    fs::create_dir_all(cache_dir.join("broken-bookworm/usr/bin")).unwrap();
    fs::write(cache_dir.join("broken-bookworm/usr/bin/python3"), b"").unwrap();
    fs::write(cache_dir.join("broken-bookworm/usr/bin/g++"), b"").unwrap();
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let err = store
        .build_debootstrap("broken", &cache_dir, &spec, false)
        .unwrap_err();
    assert!(matches!(err, NodeError::Internal { .. }), "{err:?}");
    assert!(err.to_string().contains("debootstrap"), "{err}");
    let left: Vec<_> = fs::read_dir(&cache_dir).unwrap().collect();
    assert!(left.is_empty(), "cache dir has leftovers: {left:?}");
    assert!(store.list().unwrap().is_empty());
    let left: Vec<_> = fs::read_dir(store.dir()).unwrap().collect();
    assert!(left.is_empty(), "store has leftovers: {left:?}");
}

#[test]
fn python_cache_from_nothing() {
    if std::env::var_os("SANDLOT_TEST_DEBOOTSTRAP").is_none() {
        eprintln!("SKIP: set SANDLOT_TEST_DEBOOTSTRAP=1 to debootstrap from the mirror (~1-2 min)");
        return;
    }
    if !is_root("debootstrap") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cache_dir = tmp.path().join("cache");
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let t = Instant::now();
    let img = store.build_python(&cache_dir).unwrap();
    eprintln!("debootstrap + image in {:?}", t.elapsed());
    let cache = cache_dir.join("python-bookworm");
    assert!(cache.join(CACHE_STAMP).is_file());
    assert!(cache.join("usr/bin/python3").exists());
    assert!(img.layers[0].join("usr/bin/g++").exists());
    let only: Vec<_> = fs::read_dir(&cache_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(only, vec![std::ffi::OsString::from("python-bookworm")]);
    let (ok, out) = run_in_overlay(&img.layers, &["python3", "-c", "print(6*7)"]);
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "42");
}

#[test]
fn leftover_with_mounts_inside_is_unmounted_not_walked() {
    if !is_root("mounts") {
        return;
    }
    // Private mount ns for this thread: the bind below is invisible to the host.
    unshare(CloneFlags::CLONE_NEWNS).expect("unshare mount ns");
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // What a killed debootstrap leaves: its target with /proc still mounted.
    let dead = tmp.path().join(".python-bookworm.tmp-4194304999");
    fs::create_dir_all(dead.join("proc")).unwrap();
    mount(
        Some("/proc"),
        &dead.join("proc"),
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap();
    ImageStore::open(tmp.path()).unwrap();
    assert!(!dead.exists(), "leftover removed");
    let info = fs::read_to_string("/proc/thread-self/mountinfo").unwrap();
    assert!(!info.contains(".python-bookworm.tmp-"), "mount detached");
    assert!(Path::new("/proc/self/status").exists());
}
