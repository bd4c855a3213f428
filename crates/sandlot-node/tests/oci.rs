//! OCI layer unpacking, the blob store and imports, on real files. Needs root (whiteouts are
//! `mknod`, opaque dirs `trusted.*` xattrs, and ownership is kept); skips with the reason
//! otherwise.
use sandlot_node::images::oci::{sha256_digest, NoProgress};
use sandlot_node::images::unpack::{unpack_layer, Compression};
use sandlot_node::images::{ImageSource, ImageStore};
use sandlot_node::NodeError;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

fn root_or_skip(test: &str) -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    eprintln!("SKIP {test}: needs root (mknod of whiteouts, trusted.* xattrs, chown)");
    false
}

/// A tar stream written header by header, so tests can put hostile names in it (the `tar`
/// crate's builder refuses `..` and absolute paths).
#[derive(Default)]
struct RawTar(Vec<u8>);

impl RawTar {
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        name: &str,
        kind: tar::EntryType,
        data: &[u8],
        link: &str,
        mode: u32,
        uid: u64,
        gid: u64,
    ) -> &mut Self {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_size(data.len() as u64);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_mtime(1_700_000_000);
        {
            let old = h.as_old_mut();
            old.name.fill(0);
            old.name[..name.len()].copy_from_slice(name.as_bytes());
            old.linkname.fill(0);
            old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_cksum();
        self.0.extend_from_slice(h.as_bytes());
        self.0.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.0.extend(std::iter::repeat_n(0u8, pad));
        self
    }
    fn dir(&mut self, name: &str, mode: u32) -> &mut Self {
        self.add(name, tar::EntryType::Directory, b"", "", mode, 0, 0)
    }
    fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.add(name, tar::EntryType::Regular, data, "", 0o644, 0, 0)
    }
    fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.add(name, tar::EntryType::Symlink, b"", target, 0o777, 0, 0)
    }
    fn hardlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.add(name, tar::EntryType::Link, b"", target, 0o644, 0, 0)
    }
    fn finish(&mut self) -> Vec<u8> {
        let mut v = self.0.clone();
        v.extend(std::iter::repeat_n(0u8, 1024));
        v
    }
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn getxattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let cp = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let cn = std::ffi::CString::new(name).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: valid NUL-terminated strings and a buffer of the stated length.
    let n =
        unsafe { libc::lgetxattr(cp.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

fn invalid(r: Result<impl std::fmt::Debug, NodeError>, what: &str) -> String {
    match r {
        Err(NodeError::InvalidArgument(m)) => m,
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn whiteouts_opaque_dirs_modes_owners_links() {
    if !root_or_skip("whiteouts_opaque_dirs_modes_owners_links") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("layer");
    let tar = RawTar::default()
        .dir("./", 0o755)
        .dir("etc/", 0o755)
        .file("etc/hosts", b"127.0.0.1 localhost\n")
        .file("etc/.wh.motd", b"")
        .dir("opt/", 0o755)
        .file("opt/.wh..wh..opq", b"")
        .file("opt/new", b"n")
        .dir("tmp/", 0o1777)
        .add(
            "usr/bin/su",
            tar::EntryType::Regular,
            b"#!",
            "",
            0o4755,
            0,
            0,
        )
        .add(
            "home/u/f",
            tar::EntryType::Regular,
            b"x",
            "",
            0o640,
            1234,
            5678,
        )
        .symlink("bin", "usr/bin")
        .hardlink("etc/hosts2", "etc/hosts")
        .add("/abs/file", tar::EntryType::Regular, b"a", "", 0o600, 0, 0)
        .add("dev/null", tar::EntryType::Char, b"", "", 0o666, 0, 0)
        .add("fifo", tar::EntryType::Fifo, b"", "", 0o600, 0, 0)
        .finish();
    let diff_id = sha256_digest(&tar);
    let stats = unpack_layer(&gzip(&tar)[..], Compression::Gzip, Some(&diff_id), &dest).unwrap();
    assert_eq!(stats.diff_id, diff_id);
    assert_eq!(stats.skipped, 1, "only the device node is skipped");

    // `.wh.motd` → char device 0/0 named motd; the marker itself is not written.
    let wh = fs::symlink_metadata(dest.join("etc/motd")).unwrap();
    assert!(wh.file_type().is_char_device(), "whiteout is a char device");
    assert_eq!(wh.rdev(), 0, "whiteout is device 0/0");
    assert!(!dest.join("etc/.wh.motd").exists());
    // Opaque dir: xattr, no marker file, siblings kept.
    assert_eq!(
        getxattr(&dest.join("opt"), "trusted.overlay.opaque").as_deref(),
        Some(&b"y"[..])
    );
    assert!(!dest.join("opt/.wh..wh..opq").exists());
    assert_eq!(fs::read(dest.join("opt/new")).unwrap(), b"n");
    // Modes (setuid and sticky kept) and owners.
    assert_eq!(
        fs::metadata(dest.join("tmp")).unwrap().mode() & 0o7777,
        0o1777
    );
    assert_eq!(
        fs::metadata(dest.join("usr/bin/su")).unwrap().mode() & 0o7777,
        0o4755
    );
    let f = fs::metadata(dest.join("home/u/f")).unwrap();
    assert_eq!((f.uid(), f.gid(), f.mode() & 0o7777), (1234, 5678, 0o640));
    assert_eq!(f.mtime(), 1_700_000_000);
    // Implicit parents are 0755 root.
    let u = fs::metadata(dest.join("home/u")).unwrap();
    assert_eq!((u.uid(), u.mode() & 0o7777), (0, 0o755));
    // Symlink stored as is, hard link shares the inode.
    assert_eq!(
        fs::read_link(dest.join("bin")).unwrap(),
        Path::new("usr/bin")
    );
    assert_eq!(
        fs::metadata(dest.join("etc/hosts")).unwrap().ino(),
        fs::metadata(dest.join("etc/hosts2")).unwrap().ino()
    );
    // Absolute names are made relative; device nodes skipped; FIFOs made.
    assert_eq!(fs::read(dest.join("abs/file")).unwrap(), b"a");
    assert!(!dest.join("dev/null").exists());
    assert!(fs::symlink_metadata(dest.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(fs::metadata(&dest).unwrap().mode() & 0o7777, 0o755);
}

#[test]
fn hostile_layers_are_refused_and_leave_nothing() {
    if !root_or_skip("hostile_layers_are_refused_and_leave_nothing") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let secret = tmp.path().join("secret");
    fs::write(&secret, b"s").unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "dotdot",
            RawTar::default().file("a/../../escape", b"x").finish(),
        ),
        (
            "symlink then write through it",
            RawTar::default()
                .symlink("evil", outside.to_str().unwrap())
                .file("evil/pwned", b"x")
                .finish(),
        ),
        (
            "relative symlink then write through it",
            RawTar::default()
                .dir("d/", 0o755)
                .symlink("d/up", "../../outside")
                .file("d/up/pwned", b"x")
                .finish(),
        ),
        (
            "hard link out with ..",
            RawTar::default().hardlink("h", "../secret").finish(),
        ),
        (
            "hard link to an absolute host path",
            RawTar::default()
                .hardlink("h", secret.to_str().unwrap())
                .finish(),
        ),
        (
            "hard link through a symlink",
            RawTar::default()
                .symlink("s", tmp.path().to_str().unwrap())
                .hardlink("h", "s/secret")
                .finish(),
        ),
    ];
    for (what, tar) in cases {
        let dest = tmp.path().join("layer");
        let msg = invalid(unpack_layer(&tar[..], Compression::None, None, &dest), what);
        assert!(
            !dest.exists(),
            "{what}: a failed unpack leaves nothing ({msg})"
        );
        assert!(
            !outside.join("pwned").exists(),
            "{what}: wrote outside the layer"
        );
        assert_eq!(fs::read(&secret).unwrap(), b"s");
        assert_eq!(
            fs::metadata(&secret).unwrap().nlink(),
            1,
            "{what}: linked the secret"
        );
    }
    // Garbage is an InvalidArgument too, never a panic.
    let dest = tmp.path().join("layer");
    invalid(
        unpack_layer(&b"not gzip at all"[..], Compression::Gzip, None, &dest),
        "bad gzip",
    );
    assert!(!dest.exists());
}

#[test]
fn digest_mismatches_are_rejected_and_nothing_half_written_remains() {
    if !root_or_skip("digest_mismatches_are_rejected_and_nothing_half_written_remains") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let blobs = tmp.path().join("images/blobs/sha256");
    // A blob whose bytes do not match the expected digest.
    let wrong = sha256_digest(b"something else");
    let msg = invalid(
        store.put_blob(&b"hello"[..], Some(&wrong), None, &NoProgress, "t"),
        "blob digest",
    );
    assert!(msg.contains("mismatch"), "{msg}");
    assert_eq!(
        fs::read_dir(&blobs).unwrap().count(),
        0,
        "no blob, no temp file"
    );
    // A size mismatch against the descriptor.
    let good = sha256_digest(b"hello");
    invalid(
        store.put_blob(&b"hello"[..], Some(&good), Some(3), &NoProgress, "t"),
        "blob size",
    );
    assert_eq!(fs::read_dir(&blobs).unwrap().count(), 0);
    // The right digest is stored under its hex.
    let (d, n) = store
        .put_blob(&b"hello"[..], Some(&good), Some(5), &NoProgress, "t")
        .unwrap();
    assert_eq!((d.as_str(), n), (good.as_str(), 5));
    assert_eq!(fs::read(store.blob_path(&good).unwrap()).unwrap(), b"hello");
    // A layer whose content does not match its DiffID.
    let tar = RawTar::default().file("f", b"1").finish();
    let dest = tmp.path().join("layer");
    let msg = invalid(
        unpack_layer(&tar[..], Compression::None, Some(&wrong), &dest),
        "diff id",
    );
    assert!(msg.contains("DiffID"), "{msg}");
    assert!(!dest.exists());
    // Malformed digests.
    invalid(store.blob_path("sha256:xyz"), "short digest");
    invalid(store.blob_path("md5:00"), "algorithm");
}

#[test]
fn a_layer_is_unpacked_once() {
    if !root_or_skip("a_layer_is_unpacked_once") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let tar = RawTar::default().file("f", b"1").finish();
    let diff_id = sha256_digest(&tar);
    let gz = gzip(&tar);
    let (blob, _) = store
        .put_blob(&gz[..], Some(&sha256_digest(&gz)), None, &NoProgress, "l")
        .unwrap();
    let media = "application/vnd.oci.image.layer.v1.tar+gzip";
    let (dir, now) = store.ensure_layer(&diff_id, &blob, media).unwrap();
    assert!(now);
    assert_eq!(dir, store.layer_path(&diff_id).unwrap());
    fs::write(dir.join("marker"), b"m").unwrap();
    let (dir2, now2) = store.ensure_layer(&diff_id, &blob, media).unwrap();
    assert!(!now2, "second ensure_layer must not unpack again");
    assert_eq!(dir2, dir);
    assert!(
        dir.join("marker").exists(),
        "existing layer dir left untouched"
    );
}

/// Write blob `data` into an OCI layout at `root`; returns its descriptor JSON.
fn layout_blob(root: &Path, media: &str, data: &[u8]) -> serde_json::Value {
    let d = sha256_digest(data);
    fs::write(root.join("blobs/sha256").join(&d[7..]), data).unwrap();
    serde_json::json!({"mediaType": media, "digest": d, "size": data.len()})
}

/// An OCI layout with two gzip layers (the second deletes a file of the first and makes a
/// dir opaque), config with Env/WorkingDir/User; returns the two DiffIDs.
fn build_layout(root: &Path, ref_name: &str) -> (String, String) {
    fs::create_dir_all(root.join("blobs/sha256")).unwrap();
    fs::write(
        root.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let l1 = RawTar::default()
        .dir("bin/", 0o755)
        .file("bin/hello", b"#!/bin/sh\necho hi\n")
        .file("gone", b"x")
        .dir("cache/", 0o755)
        .file("cache/old", b"o")
        .finish();
    let l2 = RawTar::default()
        .file(".wh.gone", b"")
        .dir("cache/", 0o755)
        .file("cache/.wh..wh..opq", b"")
        .file("cache/new", b"n")
        .finish();
    let (d1, d2) = (sha256_digest(&l1), sha256_digest(&l2));
    let gz = "application/vnd.oci.image.layer.v1.tar+gzip";
    let ld1 = layout_blob(root, gz, &gzip(&l1));
    let ld2 = layout_blob(root, gz, &gzip(&l2));
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin", "GREETING=a=b"], "WorkingDir": "/work", "User": "1000:1000"},
        "rootfs": {"type": "layers", "diff_ids": [d1, d2]},
    });
    let cd = layout_blob(
        root,
        "application/vnd.oci.image.config.v1+json",
        config.to_string().as_bytes(),
    );
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": cd, "layers": [ld1, ld2],
    });
    let mut md = layout_blob(
        root,
        "application/vnd.oci.image.manifest.v1+json",
        manifest.to_string().as_bytes(),
    );
    md["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": ref_name});
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [md]});
    fs::write(root.join("index.json"), index.to_string()).unwrap();
    (d1, d2)
}

#[test]
fn import_oci_layout_then_rm_and_gc() {
    if !root_or_skip("import_oci_layout_then_rm_and_gc") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let (d1, d2) = build_layout(&layout, "127.0.0.1:5000/test/app:v1");
    let store = ImageStore::open(tmp.path().join("images")).unwrap();

    // Named by the ref-name annotation (a full reference).
    let img = store.import(&layout, None, &NoProgress).unwrap();
    assert_eq!(img.name, "127.0.0.1:5000/test/app:v1");
    assert_eq!(
        img.layers,
        vec![
            store.layer_path(&d2).unwrap(),
            store.layer_path(&d1).unwrap()
        ],
        "lowerdirs top-most first"
    );
    assert_eq!(
        img.env,
        vec![
            ("PATH".to_string(), "/bin".to_string()),
            ("GREETING".to_string(), "a=b".to_string())
        ]
    );
    assert_eq!(img.workdir.as_deref(), Some("/work"));
    assert_eq!(img.user.as_deref(), Some("1000:1000"));
    assert!(matches!(img.source, ImageSource::Archive { .. }));
    // Found by the reference, also without re-normalising.
    assert_eq!(
        store.get("127.0.0.1:5000/test/app:v1").unwrap().name,
        img.name
    );
    // The second layer's whiteout and opaque dir are in overlay form.
    let top = store.layer_path(&d2).unwrap();
    assert!(fs::symlink_metadata(top.join("gone"))
        .unwrap()
        .file_type()
        .is_char_device());
    assert_eq!(
        getxattr(&top.join("cache"), "trusted.overlay.opaque").as_deref(),
        Some(&b"y"[..])
    );

    // A second name for the same content shares the layers (no new layer dirs).
    let layers_dir = tmp.path().join("images/layers/sha256");
    let before = fs::read_dir(&layers_dir).unwrap().count();
    let short = store.import(&layout, Some("app"), &NoProgress).unwrap();
    assert_eq!(short.layers, img.layers);
    assert_eq!(fs::read_dir(&layers_dir).unwrap().count(), before);
    let names: Vec<String> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(
        names,
        vec!["127.0.0.1:5000/test/app:v1".to_string(), "app".to_string()]
    );

    // gc keeps what images use.
    assert_eq!(store.gc().unwrap().layers, 0);
    store.remove("127.0.0.1:5000/test/app:v1").unwrap();
    assert_eq!(store.gc().unwrap().layers, 0, "still used by `app`");
    store.remove("app").unwrap();
    let r = store.gc().unwrap();
    assert_eq!(
        (r.layers, r.blobs),
        (2, 4),
        "2 layers; 2 layer blobs + config + manifest"
    );
    assert_eq!(fs::read_dir(&layers_dir).unwrap().count(), 0);
    assert!(matches!(store.get("app"), Err(NodeError::NotFound(_))));
}

/// A sandbox's overlay names its lower dirs by alias (`/run/sandlot/lower/<h>`, so its
/// mountinfo shows no store path); gc still sees the layers as in use through the aliases.
#[test]
fn gc_keeps_layers_mounted_under_aliases() {
    if !root_or_skip("gc_keeps_layers_mounted_under_aliases") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    build_layout(&layout, "127.0.0.1:5000/test/alias:v1");
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let img = store.import(&layout, Some("alias"), &NoProgress).unwrap();
    for d in ["upper", "work", "mnt"] {
        fs::create_dir(tmp.path().join(d)).unwrap();
    }
    let opts = sandlot_guest::layers::layer_options(
        &img.layers,
        &tmp.path().join("upper"),
        &tmp.path().join("work"),
    )
    .unwrap();
    assert!(
        opts.options.starts_with("lowerdir=/run/sandlot/lower/")
            && !opts.options.contains(&tmp.path().display().to_string()),
        "{}",
        opts.options
    );
    let mnt = tmp.path().join("mnt");
    nix::mount::mount(
        Some("overlay"),
        &mnt,
        Some("overlay"),
        nix::mount::MsFlags::empty(),
        Some(opts.options.as_str()),
    )
    .unwrap();
    drop(opts);
    store.remove("alias").unwrap();
    let kept = store.gc();
    let layers_dir = tmp.path().join("images/layers/sha256");
    let left = fs::read_dir(&layers_dir).unwrap().count();
    nix::mount::umount(&mnt).unwrap();
    assert_eq!(kept.unwrap().layers, 0, "layers under a mount were removed");
    assert_eq!(left, 2);
    assert_eq!(store.gc().unwrap().layers, 2, "unmounted: collected");
}

#[test]
fn import_rejects_a_tampered_blob() {
    if !root_or_skip("import_rejects_a_tampered_blob") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let (d1, _) = build_layout(&layout, "x");
    // Corrupt one layer blob in place (its file name keeps the old digest).
    let blobs = layout.join("blobs/sha256");
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let mdig = index["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(blobs.join(&mdig[7..])).unwrap()).unwrap();
    let ldig = manifest["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let mut data = fs::read(blobs.join(&ldig[7..])).unwrap();
    let last = data.len() - 1;
    data[last] ^= 0xff;
    fs::write(blobs.join(&ldig[7..]), &data).unwrap();
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let msg = invalid(store.import(&layout, Some("t"), &NoProgress), "tampered");
    assert!(msg.contains("mismatch"), "{msg}");
    assert!(!store.layer_path(&d1).unwrap().exists());
    assert!(!store.blob_path(&ldig).unwrap().exists());
    // No full reference annotation and no name: a clear error.
    let layout2 = tmp.path().join("layout2");
    build_layout(&layout2, "latest");
    let msg = invalid(store.import(&layout2, None, &NoProgress), "no name");
    assert!(msg.contains("pass a name"), "{msg}");
}

#[test]
fn import_docker_save_archive() {
    if !root_or_skip("import_docker_save_archive") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let l1 = RawTar::default().file("hello", b"hi").finish();
    let d1 = sha256_digest(&l1);
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["A=1"]},
        "rootfs": {"type": "layers", "diff_ids": [d1]},
    })
    .to_string();
    let cfg_name = format!("{}.json", &sha256_digest(config.as_bytes())[7..]);
    let manifest = serde_json::json!([{
        "Config": cfg_name, "RepoTags": ["busybox:1.36"], "Layers": ["abc/layer.tar"]
    }])
    .to_string();
    let archive = RawTar::default()
        .file("manifest.json", manifest.as_bytes())
        .file(&cfg_name, config.as_bytes())
        .dir("abc/", 0o755)
        .file("abc/layer.tar", &l1)
        .finish();
    let path = tmp.path().join("save.tar");
    fs::write(&path, archive).unwrap();
    let store = ImageStore::open(tmp.path().join("images")).unwrap();
    let img = store.import(&path, None, &NoProgress).unwrap();
    assert_eq!(img.name, "docker.io/library/busybox:1.36");
    assert_eq!(img.env, vec![("A".to_string(), "1".to_string())]);
    assert_eq!(fs::read(img.layers[0].join("hello")).unwrap(), b"hi");
    assert_eq!(store.get("busybox:1.36").unwrap().name, img.name);
}
