//! The agent's file calls (`/v1/files/...`, protocol in [`sandlot_guest::agent_proto`]):
//! [`sandlot_guest::sandbox_fs`] applied to the agent's own root, with blocking file system
//! work on tokio's blocking pool. Nothing here knows what carries the HTTP/2 connection (a
//! unix socket, virtio-serial, vsock): handlers take a request and give a response.
use std::convert::Infallible;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame as BodyFrame, Incoming};
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use sandlot_guest::agent_proto::{
    ascii_json, fs_status, FrameDecoder, FrameKind, MkdirRequest, PathRequest, ReadFileRequest,
    WriteFileRequest, PATH_FILES_LIST, PATH_FILES_MKDIR, PATH_FILES_READ, PATH_FILES_REMOVE,
    PATH_FILES_STAT, PATH_FILES_WRITE, TRAILER_ERROR,
};
use sandlot_guest::sandbox_fs::{
    FsCode, FsError, FsPolicy, FsResult, SandboxFs, ALLOWED_FS, V9FS_MAGIC,
};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// Largest JSON request body of a file call, bytes (a path is at most PATH_MAX = 4096).
const MAX_REQUEST: usize = 64 * 1024;
/// Chunk size of streamed reads, bytes.
const READ_CHUNK: usize = 256 * 1024;

/// Top-level directories the file calls refuse: kernel file systems and the agent's own
/// mounts (the same set the node refused from the host).
const REFUSED_TOPS: [&str; 4] = ["/dev", "/proc", "/sys", "/.sandlot"];

/// Environment variable naming the directory the file calls resolve in (default `/`, the
/// agent's own root). Only tests set it (the node gives the agent a fixed environment).
pub const ROOT_ENV: &str = "SANDLOT_AGENT_FILES_ROOT";

/// The agent's root with its policy, opened once.
fn root() -> FsResult<Arc<SandboxFs>> {
    static ROOT: OnceLock<Result<Arc<SandboxFs>, FsError>> = OnceLock::new();
    ROOT.get_or_init(|| {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::var_os(ROOT_ENV)
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| "/".into());
        let root_dev = std::fs::metadata(&dir).map(|m| m.dev());
        // The agent's own bind mounts (its binary, runsc's socket directory): refused by
        // device too, so a symlink cannot reach them past the lexical check. Only devices
        // that differ from the root's (a shared one would refuse everything).
        let mut refused_devs = Vec::new();
        for p in [".sandlot", ".sandlot/sandlot-guest", ".sandlot/run"] {
            if let (Ok(m), Ok(rd)) = (std::fs::symlink_metadata(dir.join(p)), root_dev.as_ref()) {
                if m.dev() != *rd && !refused_devs.contains(&m.dev()) {
                    refused_devs.push(m.dev());
                }
            }
        }
        let mut allowed_fs = ALLOWED_FS.to_vec();
        // runsc: the rootfs and /tmp are gVisor gofer mounts of the node's overlay.
        allowed_fs.push(V9FS_MAGIC);
        // vm: the root is the guest's own ext4 disk (no host file is reachable in a VM; in
        // a container an ext4 would be a host bind mount, so only there it stays refused).
        if crate::vm::IN_VM.load(std::sync::atomic::Ordering::SeqCst) {
            allowed_fs.push(nix::sys::statfs::EXT4_SUPER_MAGIC);
        }
        let policy = FsPolicy {
            allowed_fs,
            refused_tops: REFUSED_TOPS.iter().map(|s| s.to_string()).collect(),
            refused_devs,
        };
        let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
        SandboxFs::open(&dir, uid.as_raw(), gid.as_raw()).map(|fs| Arc::new(fs.with_policy(policy)))
    })
    .clone()
}

/// Handles a `/v1/files/...` call; `None` when `path` is not one.
pub async fn handle(req: Request<Incoming>) -> Option<Response<Body>> {
    let path = req.uri().path().to_string();
    if !path.starts_with("/v1/files/") {
        return None;
    }
    if req.method() != hyper::Method::POST {
        return Some(error(&FsError::new(
            FsCode::InvalidArgument,
            format!("{path}: use POST"),
        )));
    }
    let body = req.into_body();
    let resp = match path.as_str() {
        PATH_FILES_READ => read(body).await,
        PATH_FILES_WRITE => write(body).await,
        PATH_FILES_LIST => {
            simple(body, |fs, r: PathRequest| {
                fs.list(&r.path).map(|v| json(StatusCode::OK, &v))
            })
            .await
        }
        PATH_FILES_STAT => {
            simple(body, |fs, r: PathRequest| {
                fs.stat(&r.path).map(|v| json(StatusCode::OK, &v))
            })
            .await
        }
        PATH_FILES_MKDIR => {
            simple(body, |fs, r: MkdirRequest| {
                fs.mkdir(&r.path, r.parents).map(|()| no_content())
            })
            .await
        }
        PATH_FILES_REMOVE => {
            simple(body, |fs, r: PathRequest| {
                fs.remove(&r.path).map(|()| no_content())
            })
            .await
        }
        _ => Err(FsError::new(
            FsCode::NotFound,
            format!("no such call: {path}"),
        )),
    };
    Some(resp.unwrap_or_else(|e| error(&e)))
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(v).expect("serialises"))).boxed())
        .expect("valid response")
}

fn no_content() -> Response<Body> {
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Full::new(Bytes::new()).boxed())
        .expect("valid response")
}

/// The error answer: the code's status, the error as JSON.
fn error(e: &FsError) -> Response<Body> {
    let status =
        StatusCode::from_u16(fs_status(e.code)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json(status, e)
}

/// Reads a whole JSON request body of at most [`MAX_REQUEST`] bytes.
async fn request<T: DeserializeOwned>(mut body: Incoming) -> FsResult<T> {
    let mut buf = Vec::new();
    while let Some(fr) = body.frame().await {
        let fr =
            fr.map_err(|e| FsError::new(FsCode::InvalidArgument, format!("request body: {e}")))?;
        if let Ok(d) = fr.into_data() {
            buf.extend_from_slice(&d);
            if buf.len() > MAX_REQUEST {
                return Err(FsError::new(
                    FsCode::PayloadTooLarge,
                    format!("request over {MAX_REQUEST} bytes"),
                ));
            }
        }
    }
    serde_json::from_slice(&buf)
        .map_err(|e| FsError::new(FsCode::InvalidArgument, format!("request JSON: {e}")))
}

/// A call with a JSON request and a one-shot answer, run on the blocking pool.
async fn simple<T, F>(body: Incoming, f: F) -> FsResult<Response<Body>>
where
    T: DeserializeOwned + Send + 'static,
    F: FnOnce(&SandboxFs, T) -> FsResult<Response<Body>> + Send + 'static,
{
    let r: T = request(body).await?;
    let fs = root()?;
    blocking(move || f(&fs, r)).await
}

/// Runs `f` on the blocking pool with this thread's effective capabilities cleared, so the
/// call may touch exactly what the sandbox's root user without capabilities may (as its
/// commands), and `EACCES`/`EPERM` answer `permission_denied`.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> FsResult<T> + Send + 'static,
) -> FsResult<T> {
    tokio::task::spawn_blocking(move || {
        let _caps = NoEffectiveCaps::enter()?;
        f()
    })
    .await
    .unwrap_or_else(|e| Err(FsError::new(FsCode::Internal, format!("file task: {e}"))))
}

async fn read(body: Incoming) -> FsResult<Response<Body>> {
    let r: ReadFileRequest = request(body).await?;
    let fs = root()?;
    let mut reader = blocking(move || fs.open_read(&r.path, r.max_bytes)).await?;
    let (tx, rx) = mpsc::channel::<BodyFrame<Bytes>>(2);
    // One blocking task streams the file; the channel's bound paces it to the reader.
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            match reader.read_chunk(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    let chunk = BodyFrame::data(Bytes::copy_from_slice(&buf[..n]));
                    if tx.blocking_send(chunk).is_err() {
                        return; // caller gone
                    }
                }
                Err(e) => {
                    let mut trailers = HeaderMap::new();
                    let value = HeaderValue::from_str(&ascii_json(&e)).unwrap_or_else(|_| {
                        HeaderValue::from_static(
                            "{\"code\":\"internal\",\"message\":\"read failed\"}",
                        )
                    });
                    trailers.insert(TRAILER_ERROR, value);
                    let _ = tx.blocking_send(BodyFrame::trailers(trailers));
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|f| (Ok::<_, Infallible>(f), rx))
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, "application/octet-stream")
        .body(StreamBody::new(stream).boxed())
        .expect("valid response"))
}

async fn write(mut body: Incoming) -> FsResult<Response<Body>> {
    let bad = |m: String| FsError::new(FsCode::InvalidArgument, m);
    let mut dec = FrameDecoder::default();
    let spec = loop {
        if let Some(f) = dec.next_frame().map_err(|e| bad(e.to_string()))? {
            if f.kind != FrameKind::Spec {
                return Err(bad(format!("first frame must be a spec, got {:?}", f.kind)));
            }
            break f.data;
        }
        match body.frame().await {
            Some(Ok(fr)) => {
                if let Ok(d) = fr.into_data() {
                    dec.push(&d);
                }
            }
            Some(Err(e)) => return Err(bad(format!("request body: {e}"))),
            None => return Err(bad("request ended before the spec frame".into())),
        }
    };
    let r: WriteFileRequest =
        serde_json::from_slice(&spec).map_err(|e| bad(format!("spec JSON: {e}")))?;
    let first = dec.into_rest();
    let fs = root()?;
    let mut w = blocking(move || fs.begin_write(&r.path, r.max_bytes)).await?;
    // Chunks go to the blocking pool one at a time; the writer travels with them.
    let mut chunk = Bytes::from(first);
    loop {
        if !chunk.is_empty() {
            let data = std::mem::take(&mut chunk);
            w = blocking(move || w.write(&data).map(|()| w)).await?;
        }
        match body.frame().await {
            Some(Ok(fr)) => {
                if let Ok(d) = fr.into_data() {
                    chunk = d;
                }
            }
            // A reset stream: the caller gave up; the writer's drop removes the temp file.
            Some(Err(e)) => return Err(bad(format!("request body: {e}"))),
            None => break,
        }
    }
    blocking(move || w.commit()).await?;
    Ok(no_content())
}

/// This thread's effective capability set emptied until dropped (capset(2) acts on the
/// calling thread only; the permitted set is kept, so dropping raises them again for the
/// next task of this pooled thread).
struct NoEffectiveCaps([CapData; 2]);

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3` (linux/capability.h): two 32-bit words per set.
const CAP_V3: u32 = 0x2008_0522;

fn capset(data: &[CapData; 2]) -> std::io::Result<()> {
    let mut h = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    // SAFETY: header and data have the kernel's v3 layout (two data elements); both outlive
    // the call.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut h, data.as_ptr()) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl NoEffectiveCaps {
    fn enter() -> FsResult<NoEffectiveCaps> {
        let mut h = CapHeader {
            version: CAP_V3,
            pid: 0,
        };
        let mut old = [CapData::default(); 2];
        // SAFETY: as in `capset`; the kernel fills the two elements of `old`.
        let r = unsafe { libc::syscall(libc::SYS_capget, &mut h, old.as_mut_ptr()) };
        if r != 0 {
            return Err(FsError::io("capget", std::io::Error::last_os_error()));
        }
        let mut none = old;
        for d in &mut none {
            d.effective = 0;
        }
        capset(&none).map_err(|e| FsError::io("capset (drop effective)", e))?;
        Ok(NoEffectiveCaps(old))
    }
}

impl Drop for NoEffectiveCaps {
    fn drop(&mut self) {
        // Raising effective back within the permitted set cannot fail for lack of rights.
        let _ = capset(&self.0);
    }
}
