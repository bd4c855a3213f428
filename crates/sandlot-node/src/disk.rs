//! Per-sandbox scratch disks: sparse ext4 images with a fixed size (the sandbox's disk
//! quota), cloned from a per-size template and attached to a loop device with the kernel's
//! loop ioctls (`linux/loop.h`: `LOOP_CTL_GET_FREE` on `/dev/loop-control`, then
//! `LOOP_CONFIGURE` with `LO_FLAGS_AUTOCLEAR`, so the device is released by the last
//! unmount). Creating a disk costs one sparse copy of the template's few hundred KiB of
//! metadata plus two ioctls and a mount, instead of running `mkfs.ext4` and `mount -o loop`.
//!
//! Template: `<templates>/ext4-<MiB>.img`, made once per size with `mkfs.ext4 -F -m 0
//! -O ^has_journal -E lazy_itable_init=1,nodiscard` (no journal: scratch data does not
//! outlive its sandbox; no reserved blocks: every uid gets the same quota), written to a
//! temporary name and renamed into place, so a crash never leaves a half-made template.
//! Every clone has the template's file-system UUID, which ext4 allows on one host.
use crate::node::{NodeError, NodeResult};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};

/// `LOOP_CTL_GET_FREE` (`linux/loop.h`): the number of a free loop device, made if needed.
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
/// `LOOP_CONFIGURE` (`linux/loop.h`, Linux 5.8): bind a file and set its flags in one call.
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
/// `LO_FLAGS_AUTOCLEAR`: detach when the last user (the mount) goes away.
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// Tries before giving up when other processes keep taking the free device first (creates
/// of this node do not race each other: they attach one at a time, see [`ATTACH_LOCK`]).
const ATTACH_TRIES: usize = 64;

/// Serialises `LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE` within the process: the kernel hands
/// every concurrent caller the same free device, so unserialised creates would mostly retry.
/// Held for two ioctls (microseconds), not for the mount.
static ATTACH_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `struct loop_info64` (`linux/loop.h`).
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` (`linux/loop.h`).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> NodeError {
    move |e| NodeError::io(context, e)
}

/// Make `img`: a sparse ext4 image of `mib` MiB, cloned from the template of that size in
/// `templates` (made first when missing).
///
/// # Errors
/// `NodeError::Io` when `mkfs.ext4` fails or a file cannot be written.
pub fn make_image(templates: &Path, img: &Path, mib: u64) -> NodeResult<()> {
    let tpl = templates.join(format!("ext4-{mib}.img"));
    if !tpl.is_file() {
        make_template(templates, &tpl, mib)?;
    }
    sparse_copy(&tpl, img, mib << 20)
}

fn make_template(templates: &Path, tpl: &Path, mib: u64) -> NodeResult<()> {
    std::fs::create_dir_all(templates).map_err(io(format!("create {}", templates.display())))?;
    let tmp = templates.join(format!(
        ".tmp-ext4-{mib}-{}-{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let made = (|| {
        File::create(&tmp)
            .and_then(|f| f.set_len(mib << 20))
            .map_err(io(format!("create {}", tmp.display())))?;
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-O", "^has_journal", "-E"])
            .arg("lazy_itable_init=1,nodiscard")
            .arg(&tmp)
            .stdin(Stdio::null())
            .output()
            .map_err(io("run mkfs.ext4".into()))?;
        if !out.status.success() {
            return Err(NodeError::io(
                format!(
                    "mkfs.ext4 {}: {}: {}",
                    tmp.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                std::io::Error::other("scratch disk template"),
            ));
        }
        std::fs::rename(&tmp, tpl).map_err(io(format!("rename to {}", tpl.display())))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    made
}

/// Copy the data extents of `src` into a new file `dst` of `len` bytes, leaving holes as
/// holes (`SEEK_DATA`/`SEEK_HOLE` + `copy_file_range`).
fn sparse_copy(src: &Path, dst: &Path, len: u64) -> NodeResult<()> {
    let s = File::open(src).map_err(io(format!("open {}", src.display())))?;
    let d = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)
        .map_err(io(format!("create {}", dst.display())))?;
    d.set_len(len)
        .map_err(io(format!("size {}", dst.display())))?;
    let ctx = || format!("copy {} to {}", src.display(), dst.display());
    let mut off: i64 = 0;
    loop {
        // SAFETY: plain syscalls on owned, open descriptors.
        let data = unsafe { libc::lseek(s.as_raw_fd(), off, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                return Ok(()); // no data after `off`
            }
            return Err(NodeError::io(ctx(), e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(s.as_raw_fd(), data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(NodeError::io(ctx(), std::io::Error::last_os_error()));
        }
        let (mut from, mut to) = (data, data);
        while from < hole {
            // SAFETY: the offsets point at live i64s; the descriptors are open.
            let n = unsafe {
                libc::copy_file_range(
                    s.as_raw_fd(),
                    &mut from,
                    d.as_raw_fd(),
                    &mut to,
                    (hole - from) as usize,
                    0,
                )
            };
            if n < 0 {
                return Err(NodeError::io(ctx(), std::io::Error::last_os_error()));
            }
            if n == 0 {
                break;
            }
        }
        off = hole;
    }
}

/// Attach `img` to a free loop device (auto-clearing) and mount it at `mnt` as ext4 with
/// `flags`. The loop device goes away with the mount, also when the mount fails.
///
/// # Errors
/// `NodeError::Io` when no loop device could be attached or the mount fails.
pub fn mount_image(img: &Path, mnt: &Path, flags: nix::mount::MsFlags) -> NodeResult<()> {
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .map_err(io(format!("open {}", img.display())))?;
    let ctl = File::open("/dev/loop-control").map_err(io("open /dev/loop-control".into()))?;
    let mut last = None;
    for _ in 0..ATTACH_TRIES {
        let attached = ATTACH_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: an argument-less ioctl on an open descriptor.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(NodeError::io(
                "LOOP_CTL_GET_FREE",
                std::io::Error::last_os_error(),
            ));
        }
        let dev = format!("/dev/loop{n}");
        let loopf = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&dev)
            .map_err(io(format!("open {dev}")))?;
        let cfg = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: LO_FLAGS_AUTOCLEAR,
                lo_file_name: [0; 64],
                lo_crypt_name: [0; 64],
                lo_encrypt_key: [0; 32],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: `cfg` is a live `struct loop_config` for the duration of the call.
        let r = unsafe { libc::ioctl(loopf.as_raw_fd(), LOOP_CONFIGURE, &cfg) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EBUSY) {
                last = Some(e); // another creator took it first
                continue;
            }
            return Err(NodeError::io(format!("LOOP_CONFIGURE {dev}"), e));
        }
        drop(attached);
        // Closing `loopf` after the mount leaves the mount as the last user, so the
        // device is cleared by the unmount (or right here when the mount fails).
        return nix::mount::mount(Some(dev.as_str()), mnt, Some("ext4"), flags, None::<&str>)
            .map_err(|e| {
                NodeError::io(
                    format!("mount {dev} ({}) at {}", img.display(), mnt.display()),
                    e.into(),
                )
            });
    }
    Err(NodeError::io(
        format!("attach {} to a loop device", img.display()),
        last.unwrap_or_else(|| std::io::Error::other("no free loop device")),
    ))
}

/// The writable layer's file system and disk quota of a `function` or `container` sandbox: `dir/disk.img`, a sparse ext4 image of
/// `disk_mib` MiB (cloned from a per-size template, [`make_image`]), loop-mounted on the
/// host at `dir/scratch` (`nosuid,nodev,noatime`; the loop device is released with the last
/// mount). The sandbox's mount namespace, copied from the host's when its init unshares,
/// holds the mount too; the backend's delete unmounts the host's and the rest goes
/// with the namespace. The image's inode count (ext4's default ratio) bounds inode
/// exhaustion as well.
///
/// # Errors
/// `Internal` when the image cannot be made or mounted.
pub fn mount_scratch(templates: &Path, dir: &Path, disk_mib: u64) -> NodeResult<()> {
    use nix::mount::MsFlags;
    let mnt = dir.join("scratch");
    std::fs::create_dir(&mnt).map_err(|e| NodeError::io(format!("create {}", mnt.display()), e))?;
    let img = dir.join("disk.img");
    make_image(templates, &img, disk_mib)?;
    mount_image(
        &img,
        &mnt,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_copy_keeps_data_and_holes() {
        let d = std::env::temp_dir().join(format!("sandlot-disk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let src = d.join("src");
        let f = File::create(&src).unwrap();
        f.set_len(8 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(b"middle", 4 << 20).unwrap();
        drop(f);
        sparse_copy(&src, &d.join("dst"), 8 << 20).unwrap();
        let got = std::fs::read(d.join("dst")).unwrap();
        assert_eq!(got.len(), 8 << 20);
        assert_eq!(&got[..4], b"head");
        assert_eq!(&got[4 << 20..(4 << 20) + 6], b"middle");
        assert!(got[4..4 << 20].iter().all(|&b| b == 0));
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(d.join("dst")).unwrap().blocks();
        assert!(blocks * 512 < 1 << 20, "holes stay holes: {blocks} blocks");
        assert!(
            sparse_copy(&src, &d.join("dst"), 8 << 20).is_err(),
            "never overwrites"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
