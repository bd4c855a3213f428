//! The landlock file-system ruleset applied to every command (best effort).
//!
//! What it adds: defence in depth. The sandbox's file access is already bounded by the
//! mount namespace (only the image, its overlay and a few tmpfs are visible) and by DAC
//! (image files are not owned by the sandbox's uids). If one of those is wrong, say a
//! writable bind mount slips in or an image ships world-writable system files, landlock
//! still confines writes to the scratch areas below. Reads and execution stay allowed
//! everywhere the mount namespace shows.
//!
//! Best effort (landlock's `CompatLevel::BestEffort`, the crate default): on a kernel
//! without landlock or with an older ABI, the rights it does not know are simply not
//! enforced, and the exec still runs.

use anyhow::{Context, Result};
use landlock::{
    path_beneath_rules, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, ABI,
};

/// Directories beneath which writing, creating and removing files is allowed (`/dev` is
/// there for /dev/null, /dev/tty and the pty devices; it holds nothing else writable).
/// `/mnt`, `/opt`, `/srv`, `/media` and `/home` are there for programs that write outside
/// `/workspace` (SandboxFusion's `run_code` lets a program write `/mnt/out`; E2B's SDK works
/// in `/home/user`); the node makes them the sandbox root's directories in the sandbox's own
/// writable layer, so writing there never reaches a shared image layer.
pub const WRITABLE: [&str; 11] = [
    "/workspace",
    "/tmp",
    "/root",
    "/home",
    "/var/tmp",
    "/dev/shm",
    "/dev",
    "/mnt",
    "/opt",
    "/srv",
    "/media",
];

/// Newest landlock ABI whose file-system rights this code asks for.
const ABI_USED: ABI = ABI::V5;

/// Restricts the calling thread (and what it execs) to read+execute everywhere and full
/// access beneath [`WRITABLE`]. Paths that do not exist are skipped. Requires
/// no_new_privs.
///
/// # Errors
/// A landlock syscall failed in a way best-effort mode does not absorb.
pub fn restrict() -> Result<()> {
    let all = AccessFs::from_all(ABI_USED);
    Ruleset::default()
        .handle_access(all)
        .context("landlock: handled rights")?
        .create()
        .context("landlock: creating the ruleset")?
        .add_rules(path_beneath_rules(["/"], AccessFs::from_read(ABI_USED)))
        .context("landlock: read rule on /")?
        .add_rules(path_beneath_rules(WRITABLE, all))
        .context("landlock: write rules")?
        .restrict_self()
        .context("landlock: restrict_self")?;
    Ok(())
}
