//! The free-space reserve of the data directory (issue 25, item 5).
//!
//! A full data directory used to take the node down for everyone: the store could not
//! commit, so every create answered `500 internal "sqlite commit"`, and audit events were
//! not durable. The server now reads the free space of the file system holding the data
//! directory (`statvfs(3)`, no descriptor needed) before every call that adds data there —
//! creates (the API's and `run_code`'s), checkpoints, file uploads — and refuses the call
//! with `429 resource_exhausted` and `Retry-After: 5` while the space available to it is
//! below the reserve ([`crate::ServerConfig::disk_reserve_bytes`], `sandlot up
//! --disk-reserve-mib`, default 256 MiB; 0 turns the check off). Reads, execs, lists and
//! deletes still work (deleting is how space comes back), and the store and the audit log
//! keep the reserve to commit in. `GET /metrics` shows `sandlot_data_dir_free_bytes` and
//! `sandlot_data_dir_reserve_bytes`.
use crate::error::{ApiResult, ServerError};
use crate::SharedState;
use sandlot_api::{ApiError, ErrorCode};
use std::path::Path;

/// Bytes available to this (unprivileged or not) process on the file system of `dir`, and
/// its size in bytes.
///
/// # Errors
/// `statvfs` failures.
pub fn free_bytes(dir: &Path) -> std::io::Result<(u64, u64)> {
    let s = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    let frsize = s.fragment_size() as u64;
    Ok((
        s.blocks_available() as u64 * frsize,
        s.blocks() as u64 * frsize,
    ))
}

/// The refusal for `avail` bytes free below `reserve` in `dir`.
fn refusal(dir: &Path, avail: u64, reserve: u64) -> ServerError {
    ServerError::RetryAfter {
        error: ApiError::new(
            ErrorCode::ResourceExhausted,
            format!(
                "data directory {} has {} MiB free, below its reserve of {} MiB \
                 (sandlot up --disk-reserve-mib): creates, checkpoints and uploads are \
                 refused until space is freed (delete sandboxes, checkpoints or files)",
                dir.display(),
                avail >> 20,
                reserve >> 20
            ),
        ),
        seconds: 5,
    }
}

/// Whether `avail` free bytes keep the reserve (`reserve` 0: always).
pub fn keeps_reserve(avail: u64, reserve: u64) -> bool {
    reserve == 0 || avail >= reserve
}

/// Refuse the call when the data directory's free space is below the reserve.
///
/// # Errors
/// `429 resource_exhausted` (with `Retry-After: 5`) below the reserve. A `statvfs` that
/// fails refuses nothing (logged).
pub fn check(st: &SharedState) -> ApiResult<()> {
    let reserve = st.cfg.disk_reserve_bytes;
    if reserve == 0 {
        return Ok(());
    }
    match free_bytes(&st.cfg.data_dir) {
        Ok((avail, _)) if !keeps_reserve(avail, reserve) => {
            tracing::warn!(
                avail,
                reserve,
                "data directory below its free-space reserve; call refused"
            );
            Err(refusal(&st.cfg.data_dir, avail, reserve))
        }
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the data directory's free space");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_decides() {
        assert!(keeps_reserve(300 << 20, 256 << 20));
        assert!(!keeps_reserve(100 << 20, 256 << 20));
        assert!(keeps_reserve(0, 0), "0 turns the check off");
    }

    #[test]
    fn refusal_is_resource_exhausted_with_the_figures() {
        let e = refusal(Path::new("/d"), 10 << 20, 256 << 20);
        let api = e.api_error();
        assert_eq!(api.code, ErrorCode::ResourceExhausted);
        assert!(api.message.contains("10 MiB free") && api.message.contains("256 MiB"));
    }

    #[test]
    fn free_bytes_of_a_real_directory() {
        let d = tempfile::tempdir().unwrap();
        let (avail, total) = free_bytes(d.path()).unwrap();
        assert!(total > 0 && avail <= total);
    }
}
