//! Integration tests of `sandlot_node::files::SandboxFs` against real file systems.
//!
//! Needs root: each test unshares a private mount namespace for its own thread (so nothing
//! it mounts is visible to the host or other tests, and everything vanishes when the thread
//! ends) and mounts a tmpfs as the sandbox root — `SandboxFs` accepts only tmpfs/overlayfs,
//! and the host's /tmp here is ext4. Without root each test prints why it skips.
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::Mode;
use nix::unistd::{mkfifo, Uid};
use sandlot_api::FileType;
use sandlot_node::files::SandboxFs;
use sandlot_node::NodeError;
use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const UID: u32 = 1234;
const GID: u32 = 5678;

/// A tmpfs sandbox root with `/workspace` and `/etc/passwd`, plus a host directory
/// `outside` next to it (not under the root) holding `secret`.
struct Root {
    root: PathBuf,
    outside: PathBuf,
    mounts: Vec<PathBuf>,
    _tmp: tempfile::TempDir,
}

impl Root {
    fn new() -> Option<Root> {
        if !Uid::effective().is_root() {
            eprintln!("SKIP: needs root (mounts a tmpfs sandbox root in a private mount ns)");
            return None;
        }
        // Private mount namespace for this test thread only (unshare(CLONE_NEWNS) also
        // unshares CLONE_FS, which a single thread may do).
        unshare(CloneFlags::CLONE_NEWNS).expect("unshare mount ns");
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .expect("make / private");
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        fs::create_dir(&root).unwrap();
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("secret"), b"host secret").unwrap();
        mount(
            Some("tmpfs"),
            &root,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("mode=0755"),
        )
        .expect("mount tmpfs");
        fs::create_dir_all(root.join("workspace")).unwrap();
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(root.join("etc/passwd"), b"sandbox passwd\n").unwrap();
        Some(Root {
            mounts: vec![root.clone()],
            root,
            outside,
            _tmp: tmp,
        })
    }

    fn fs(&self) -> SandboxFs {
        SandboxFs::open(&self.root, UID, GID).unwrap()
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// Bind-mount `src` at `<root>/<rel>` (created as dir or file to match).
    fn bind(&mut self, src: &Path, rel: &str) {
        let dst = self.p(rel);
        if src.is_dir() {
            fs::create_dir_all(&dst).unwrap();
        } else {
            fs::write(&dst, b"").unwrap();
        }
        mount(
            Some(src),
            &dst,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind mount");
        self.mounts.push(dst);
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        // Mounts live only in this thread's namespace; detach them so the temp dir can be
        // removed (they would vanish with the thread anyway).
        for m in self.mounts.iter().rev() {
            let _ = umount2(m, MntFlags::MNT_DETACH);
        }
    }
}

fn host_hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname").unwrap()
}

#[test]
fn binary_round_trip_owner_and_mode() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    let data: Vec<u8> = (0..=255u8).collect();
    sfs.write("bin.dat", &data).unwrap();
    assert_eq!(sfs.read("bin.dat", 1 << 20).unwrap(), data);
    assert_eq!(sfs.read("/workspace/bin.dat", 256).unwrap(), data);
    let md = fs::symlink_metadata(r.p("workspace/bin.dat")).unwrap();
    assert_eq!((md.uid(), md.gid()), (UID, GID));
    assert_eq!(md.permissions().mode() & 0o7777, 0o644);
    // No temp files left behind.
    let names: Vec<_> = sfs.list(".").unwrap().into_iter().map(|e| e.name).collect();
    assert_eq!(names, vec!["bin.dat".to_string()]);
    // Overwrite replaces content.
    sfs.write("bin.dat", b"short").unwrap();
    assert_eq!(sfs.read("bin.dat", 10).unwrap(), b"short");
}

#[test]
fn unicode_and_space_paths() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    let path = "dir with space/ünïcödé 文件 🚀.txt";
    sfs.write(path, "héllo".as_bytes()).unwrap();
    assert_eq!(sfs.read(path, 100).unwrap(), "héllo".as_bytes());
    assert!(r
        .p("workspace/dir with space/ünïcödé 文件 🚀.txt")
        .is_file());
    let entries = sfs.list("dir with space").unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].name, "ünïcödé 文件 🚀.txt");
}

#[test]
fn large_files_and_size_limit() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    let small: Vec<u8> = (0..20 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    sfs.write("20k", &small).unwrap();
    assert_eq!(sfs.read("20k", 20 * 1024).unwrap(), small);
    let big: Vec<u8> = (0..50 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    let t = Instant::now();
    sfs.write("50m", &big).unwrap();
    let back = sfs.read("50m", 64 << 20).unwrap();
    assert!(back == big, "50 MB round trip differs");
    eprintln!("50 MB write+read: {:?}", t.elapsed());
    match sfs.read("20k", 1000) {
        Err(NodeError::InvalidArgument(m)) => {
            assert_eq!(m, "file is 20480 bytes; limit 1000: /workspace/20k")
        }
        other => panic!("expected size error, got {other:?}"),
    }
}

#[test]
fn nested_parents_created_with_owner() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    sfs.write("a/b/c/f.txt", b"x").unwrap();
    for d in ["workspace/a", "workspace/a/b", "workspace/a/b/c"] {
        let md = fs::metadata(r.p(d)).unwrap();
        assert!(md.is_dir());
        assert_eq!((md.uid(), md.gid()), (UID, GID), "{d}");
        assert_eq!(md.permissions().mode() & 0o7777, 0o755, "{d}");
    }
    // Existing directories keep their owner (workspace belongs to root here).
    assert_eq!(fs::metadata(r.p("workspace")).unwrap().uid(), 0);
    // Absolute path outside /workspace, creating dirs under /.
    sfs.write("/opt/tool/conf", b"y").unwrap();
    assert_eq!(fs::read(r.p("opt/tool/conf")).unwrap(), b"y");
    // `..` inside a new path is resolved by the kernel after creation.
    sfs.write("n1/../n2/g", b"z").unwrap();
    assert_eq!(fs::read(r.p("workspace/n2/g")).unwrap(), b"z");
}

#[test]
fn dotdot_is_clamped_to_the_sandbox_root() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    let host = fs::read("/etc/passwd").unwrap();
    for p in [
        "../../etc/passwd",
        "../../../../../../../../etc/passwd",
        "/../../etc/passwd",
    ] {
        let got = sfs.read(p, 1 << 20).unwrap();
        assert_eq!(got, b"sandbox passwd\n", "{p}");
        assert_ne!(got, host);
    }
    // Writing through `..` lands inside the root too.
    sfs.write("../../../../tmp/x", b"in").unwrap();
    assert_eq!(fs::read(r.p("tmp/x")).unwrap(), b"in");
}

#[test]
fn symlinks_resolve_inside_the_root() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    symlink("/etc/passwd", r.p("workspace/abs")).unwrap();
    symlink("../../../../etc/passwd", r.p("workspace/rel")).unwrap();
    assert_eq!(sfs.read("abs", 100).unwrap(), b"sandbox passwd\n");
    assert_eq!(sfs.read("rel", 100).unwrap(), b"sandbox passwd\n");

    // A symlink to a host path outside the root does not escape.
    let secret = r.outside.join("secret");
    symlink(&secret, r.p("workspace/esc_file")).unwrap();
    symlink(&r.outside, r.p("workspace/esc_dir")).unwrap();
    assert!(matches!(
        sfs.read("esc_file", 100),
        Err(NodeError::NotFound(_))
    ));
    assert!(matches!(
        sfs.read("esc_dir/secret", 100),
        Err(NodeError::NotFound(_))
    ));
    assert!(matches!(sfs.list("esc_dir"), Err(NodeError::NotFound(_))));
    // Writing below it must not create anything on the host.
    assert!(sfs.write("esc_dir/planted", b"x").is_err());
    assert!(!r.outside.join("planted").exists());
    // Writing at a symlink replaces the link, never the target.
    sfs.write("esc_file", b"replaced").unwrap();
    assert_eq!(fs::read(&secret).unwrap(), b"host secret");
    assert!(fs::symlink_metadata(r.p("workspace/esc_file"))
        .unwrap()
        .is_file());
    sfs.write("abs", b"replaced").unwrap();
    assert_eq!(fs::read(r.p("etc/passwd")).unwrap(), b"sandbox passwd\n");
    // Magic links are refused (a sandbox /proc would otherwise let /proc/self/root jump).
    symlink("/proc/self/root/etc/passwd", r.p("workspace/viaproc")).unwrap();
    assert!(sfs.read("viaproc", 100).is_err());
}

#[test]
fn fifo_does_not_hang_and_bad_kinds_are_refused() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    mkfifo(&r.p("workspace/fifo"), Mode::from_bits_truncate(0o644)).unwrap();
    let t = Instant::now();
    match sfs.read("fifo", 100) {
        Err(NodeError::InvalidArgument(m)) => assert!(m.contains("not a regular file"), "{m}"),
        other => panic!("expected refusal, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(2));
    fs::create_dir(r.p("workspace/d")).unwrap();
    assert!(matches!(
        sfs.read("d", 100),
        Err(NodeError::InvalidArgument(_))
    ));
    assert!(matches!(
        sfs.write("d", b"x"),
        Err(NodeError::InvalidArgument(_))
    ));
    assert!(matches!(
        sfs.write("d/", b"x"),
        Err(NodeError::InvalidArgument(_))
    ));
    fs::write(r.p("workspace/file"), b"x").unwrap();
    assert!(matches!(
        sfs.write("file/sub", b"x"),
        Err(NodeError::InvalidArgument(_))
    ));
    assert!(matches!(
        sfs.list("file"),
        Err(NodeError::InvalidArgument(_))
    ));
    assert!(matches!(
        sfs.read("", 1),
        Err(NodeError::InvalidArgument(_))
    ));
    assert!(matches!(
        sfs.read("a\0b", 1),
        Err(NodeError::InvalidArgument(_))
    ));
}

#[test]
fn missing_is_not_found() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    match sfs.read("missing", 10) {
        Err(NodeError::NotFound(m)) => assert_eq!(m, "no such file: /workspace/missing"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(matches!(sfs.list("nodir"), Err(NodeError::NotFound(_))));
    assert!(matches!(sfs.remove("nothing"), Err(NodeError::NotFound(_))));
    assert!(matches!(
        SandboxFs::open(&r.p("no-such-root"), 0, 0),
        Err(NodeError::NotFound(_))
    ));
}

#[test]
fn list_reports_types_sizes_modes() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    let w = r.p("workspace");
    fs::write(w.join("b.txt"), b"hello").unwrap();
    fs::set_permissions(w.join("b.txt"), fs::Permissions::from_mode(0o640)).unwrap();
    fs::create_dir(w.join("a_dir")).unwrap();
    fs::set_permissions(w.join("a_dir"), fs::Permissions::from_mode(0o711)).unwrap();
    symlink("/etc/passwd", w.join("c_link")).unwrap();
    mkfifo(&w.join("d_fifo"), Mode::from_bits_truncate(0o600)).unwrap();
    let e = sfs.list("/workspace").unwrap();
    let got: Vec<_> = e
        .iter()
        .map(|e| (e.name.as_str(), e.kind, e.mode))
        .collect();
    assert_eq!(
        got,
        vec![
            ("a_dir", FileType::Dir, 0o711),
            ("b.txt", FileType::File, 0o640),
            ("c_link", FileType::Symlink, 0o777),
            ("d_fifo", FileType::Other, 0o600),
        ]
    );
    assert_eq!(e[1].size, 5);
    assert_eq!(
        e[2].size,
        "/etc/passwd".len() as u64,
        "lstat size of the link"
    );
    let mtime = fs::metadata(w.join("b.txt")).unwrap().mtime();
    assert_eq!(e[1].mtime, mtime);
    // Listing through a symlinked directory lists the (in-root) target.
    symlink("/etc", w.join("etc_link")).unwrap();
    let names: Vec<_> = sfs
        .list("etc_link")
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, vec!["passwd".to_string()]);
}

#[test]
fn remove_tree_keeps_outside_targets() {
    let Some(r) = Root::new() else { return };
    let sfs = r.fs();
    let t = r.p("workspace/tree");
    fs::create_dir_all(t.join("a/b/c")).unwrap();
    fs::write(t.join("a/b/c/f"), b"1").unwrap();
    fs::write(t.join("top"), b"2").unwrap();
    symlink(&r.outside, t.join("a/host_dir_link")).unwrap();
    symlink("/etc", t.join("a/b/sandbox_etc_link")).unwrap();
    mkfifo(&t.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
    sfs.remove("tree").unwrap();
    assert!(!t.exists());
    assert_eq!(fs::read(r.outside.join("secret")).unwrap(), b"host secret");
    assert_eq!(fs::read(r.p("etc/passwd")).unwrap(), b"sandbox passwd\n");

    // A symlink itself is removed, not its target.
    symlink("/etc", r.p("workspace/l")).unwrap();
    sfs.remove("l").unwrap();
    assert!(fs::symlink_metadata(r.p("workspace/l")).is_err());
    assert!(r.p("etc/passwd").exists());
    // A plain file.
    fs::write(r.p("workspace/f"), b"x").unwrap();
    sfs.remove("/workspace/f").unwrap();
    assert!(!r.p("workspace/f").exists());
    // The root and dot paths are refused.
    for p in ["/", "..", "/workspace/.", "x/"] {
        assert!(
            matches!(sfs.remove(p), Err(NodeError::InvalidArgument(_))),
            "{p}"
        );
    }
    assert!(r.p("workspace").is_dir());
}

#[test]
fn special_file_systems_are_refused() {
    let Some(mut r) = Root::new() else { return };
    r.bind(Path::new("/proc"), "proc");
    r.bind(Path::new("/sys"), "sys");
    r.bind(Path::new("/dev/null"), "workspace/null");
    let sfs = r.fs();
    let before = host_hostname();
    let special = |res: Result<(), NodeError>, what: &str| match res {
        Err(NodeError::InvalidArgument(m)) => {
            assert!(m.contains("special file system"), "{what}: {m}")
        }
        other => panic!("{what}: expected refusal, got {other:?}"),
    };
    special(
        sfs.read("/proc/sys/kernel/hostname", 100).map(drop),
        "read procfs",
    );
    special(
        sfs.write("/proc/sys/kernel/hostname", before.as_bytes()),
        "write procfs",
    );
    special(sfs.write("/proc/newfile", b"x"), "create in procfs");
    special(sfs.list("/proc").map(drop), "list procfs");
    special(sfs.remove("/proc/sys"), "remove in procfs");
    special(
        sfs.read("../../proc/meminfo", 100).map(drop),
        "read procfs via ..",
    );
    special(
        sfs.read("/sys/kernel/uevent_seqnum", 100).map(drop),
        "read sysfs",
    );
    // devtmpfs reports TMPFS_MAGIC, so a bound device node is stopped by the
    // regular-file check (before any real open), not by the file-system check.
    assert!(matches!(
        sfs.read("null", 100),
        Err(NodeError::InvalidArgument(m)) if m.contains("not a regular file")
    ));
    assert_eq!(host_hostname(), before);
    // A mount point inside a removed tree is not descended into.
    fs::create_dir_all(r.p("workspace/t")).unwrap();
    r.bind(Path::new("/proc"), "workspace/t/p");
    assert!(sfs.remove("t").is_err());
    assert!(Path::new("/proc/self").exists());
}

#[test]
fn overlayfs_root_is_accepted() {
    let Some(mut r) = Root::new() else { return };
    // Build an overlay the way a sandbox rootfs is built: lower (image) + upper + work.
    for d in ["lower/etc", "upper", "work", "merged"] {
        fs::create_dir_all(r.p(d)).unwrap();
    }
    fs::write(r.p("lower/etc/os"), b"image").unwrap();
    let merged = r.p("merged");
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        r.p("lower").display(),
        r.p("upper").display(),
        r.p("work").display()
    );
    mount(
        Some("overlay"),
        &merged,
        Some("overlay"),
        MsFlags::empty(),
        Some(opts.as_str()),
    )
    .expect("mount overlay");
    r.mounts.push(merged.clone());
    let sfs = SandboxFs::open(&merged, UID, GID).unwrap();
    assert_eq!(sfs.read("/etc/os", 10).unwrap(), b"image");
    sfs.write("x/y", b"upper").unwrap();
    assert_eq!(fs::read(r.p("upper/workspace/x/y")).unwrap(), b"upper");
    sfs.remove("/etc/os").unwrap();
    assert!(r.p("lower/etc/os").exists(), "lower layer untouched");
    assert!(matches!(
        sfs.read("/etc/os", 10),
        Err(NodeError::NotFound(_))
    ));
}
