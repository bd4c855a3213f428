//! Fuzz target: the OCI layer unpacker (`sandlot_layer::unpack_layer`), which
//! writes a hostile tar archive (tar paths, `..`, absolute names, symlinks and hard links,
//! whiteouts `.wh.NAME`, opaque markers `.wh..wh..opq`, devices, FIFOs) onto the host.
//!
//! Input: byte 0 even → the rest is a raw tar stream (finds parser edge cases); odd → the
//! rest, 4 bytes per entry ([`build`]), makes an archive of up to 16 entries from a small
//! alphabet of names and link targets chosen to collide (so whiteouts hit earlier entries,
//! symlinks sit where later entries need directories, hard links point at them), with names
//! written straight into the header bytes so `..` and `/` reach the unpacker unfiltered.
//! The committed seeds (`fuzz/seeds/layer_unpack`) hold one known escape each and run first
//! on every fuzz run, so they are regression tests as well.
//!
//! Each run unpacks into `BASE/N/layer` next to a sentinel directory `BASE/N/victim` holding
//! one file. Checked: no panic; `BASE/N` holds nothing but `layer` and `victim` afterwards;
//! `victim` still holds exactly its file with its content (nothing was written, linked or
//! whited out through a link or `..`); after an error `layer` is gone (nothing half-made).
//! Needs root (whiteouts are `mknod` 0/0, opaque dirs a `trusted.*` xattr), as the node.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sandlot_layer::{unpack_layer, Compression};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const NAMES: &[&str] = &[
    "a",
    "b",
    "a/b",
    "a/b/c",
    "b/c",
    "..",
    "../victim/f",
    "../victim",
    "/a",
    "./a",
    "a/../..",
    ".wh.a",
    "a/.wh.b",
    "a/.wh..wh..opq",
    ".wh..wh..opq",
    ".wh.victim",
    "victim",
    "a/victim",
    "/",
    "",
    "c",
    "a/c",
    "../../etc/x",
    "b/../../victim/g",
    "../victim/.wh.f",
    "../victim/.wh..wh..opq",
    "s/f",
];
const TARGETS: &[&str] = &[
    "a",
    "b",
    "a/b",
    "/",
    "..",
    "../victim",
    "../victim/f",
    "/tmp",
    "a/b/c",
    "c",
    "/etc",
    "s/f",
];

/// Builds an archive from 4 bytes per entry (at most 16): name index, kind, link-target
/// index, and a byte giving both the mode bits and the content (`b` repeated `b % 32` times).
/// A dense encoding, so libFuzzer's byte mutations map straight onto archive changes.
fn build(spec: &[u8]) -> Vec<u8> {
    let mut ar = tar::Builder::new(Vec::new());
    for e in spec.chunks_exact(4).take(16) {
        let mut h = tar::Header::new_gnu();
        put(&mut h.as_old_mut().name, NAMES[e[0] as usize % NAMES.len()]);
        let data = vec![e[3]; e[3] as usize % 32];
        let (ty, data): (tar::EntryType, &[u8]) = match e[1] % 7 {
            0 => (tar::EntryType::Regular, &data),
            1 => (tar::EntryType::Directory, &[]),
            2 => (tar::EntryType::Symlink, &[]),
            3 => (tar::EntryType::Link, &[]),
            4 => (tar::EntryType::Char, &[]),
            5 => (tar::EntryType::Block, &[]),
            _ => (tar::EntryType::Fifo, &[]),
        };
        h.set_entry_type(ty);
        if matches!(ty, tar::EntryType::Symlink | tar::EntryType::Link) {
            put(
                &mut h.as_old_mut().linkname,
                TARGETS[e[2] as usize % TARGETS.len()],
            );
        }
        h.set_mode(0o600 | (u32::from(e[3]) << 4 & 0o7777));
        h.set_size(data.len() as u64);
        h.set_mtime(1);
        // `new_gnu` leaves these numeric fields empty, which the unpacker rightly refuses.
        h.set_uid(0);
        h.set_gid(0);
        let _ = h.set_device_major(0);
        let _ = h.set_device_minor(0);
        h.set_cksum();
        let _ = ar.append(&h, data);
    }
    ar.into_inner().unwrap_or_default()
}

fn put(field: &mut [u8], s: &str) {
    let b = s.as_bytes();
    let n = b.len().min(field.len());
    field[..n].copy_from_slice(&b[..n]);
}

fn base() -> &'static Path {
    static BASE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        let b = std::env::temp_dir().join(format!("sandlot-fuzz-unpack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&b);
        std::fs::create_dir_all(&b).expect("create fuzz base dir");
        b
    })
}

static RUN: AtomicU64 = AtomicU64::new(0);

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let archive = if mode % 2 == 0 {
        rest.to_vec()
    } else {
        build(rest)
    };
    let dir = base().join(RUN.fetch_add(1, Ordering::Relaxed).to_string());
    std::fs::create_dir(&dir).expect("create run dir");
    let victim = dir.join("victim");
    std::fs::create_dir(&victim).expect("create victim");
    std::fs::write(victim.join("f"), b"untouched").expect("write victim file");
    let layer = dir.join("layer");

    let res = unpack_layer(&archive[..], Compression::None, None, &layer);

    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("read run dir")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    let want: &[&str] = if res.is_ok() {
        &["layer", "victim"]
    } else {
        &["victim"]
    };
    assert_eq!(names, want, "entries next to the layer after {res:?}");
    let vnames: Vec<_> = std::fs::read_dir(&victim)
        .expect("read victim")
        .map(|e| e.expect("dir entry").file_name())
        .collect();
    assert_eq!(vnames, ["f"], "victim dir changed");
    let meta = std::fs::symlink_metadata(victim.join("f")).expect("victim file");
    assert!(meta.is_file(), "victim file replaced");
    assert_eq!(meta.nlink(), 1, "victim file hard-linked from the layer");
    assert_eq!(
        std::fs::read(victim.join("f")).expect("read victim"),
        b"untouched"
    );
    std::fs::remove_dir_all(&dir).expect("clean run dir");
});
