//! envd's file watching (`filesystem.Filesystem/{WatchDir, CreateWatcher,
//! GetWatcherEvents, RemoveWatcher}`, `spec/envd/filesystem/filesystem.proto`) by
//! **polling**: nothing runs inside the sandbox, so it works on every backend and in any
//! image. Every [`POLL_MS`] ms the watcher lists the directory through the node's file calls
//! (`list_dir`, recursing when `recursive`) and diffs the listing with the previous one
//! ([`diff`]); `GetWatcherEvents` also polls once before it answers, so what changed
//! before the call is in its answer (E2B's tests read events right after a write).
//!
//! | method | kind | answer |
//! |---|---|---|
//! | `WatchDir {path, recursive, includeEntry}` | server stream | `{"start": {}}` once the first listing is taken, then `{"filesystem": FilesystemEvent}` per event and `{"keepalive": {}}` every `Keepalive-Ping-Interval` s (default 50); ends at the stream's deadline (`Connect-Timeout-Ms`, error `deadline_exceeded`) or when the client goes away |
//! | `CreateWatcher {path, recursive, includeEntry}` | unary | `{"watcherId"}`; events are kept until fetched |
//! | `GetWatcherEvents {watcherId}` | unary | `{"events": [FilesystemEvent]}` since the last call |
//! | `RemoveWatcher {watcherId}` | unary | `{}` |
//!
//! `FilesystemEvent` is `{name, type, entry?}`: `name` is the path relative to the watched
//! directory (`sub/f.txt` in a recursive watch), `type` one of `EVENT_TYPE_CREATE`,
//! `EVENT_TYPE_WRITE`, `EVENT_TYPE_REMOVE`, `EVENT_TYPE_CHMOD`; `entry` (an `EntryInfo`,
//! only with `includeEntry`) is absent for removals.
//!
//! What a poll sees, and so what is reported: a new entry is `CREATE` (a new non-empty file
//! also `WRITE`, as inotify reports the write after the create); a gone one `REMOVE`; a
//! file whose size or modification time (whole seconds) changed `WRITE`; changed permission
//! bits `CHMOD`; an entry whose type changed `REMOVE` + `CREATE`. A rename is `REMOVE` of
//! the old name + `CREATE` of the new one (`EVENT_TYPE_RENAME` is never sent). Changes
//! undone within one poll are not seen; nor is a rewrite keeping size and the same second
//! of mtime. Directories get no `WRITE`. Symbolic links are not followed.
//!
//! Bounds: at most [`MAX_WATCHERS`] watchers (both kinds) per sandbox
//! (`resource_exhausted`); a watched tree of more than [`MAX_WATCH_ENTRIES`] entries or
//! deeper than [`MAX_WATCH_DEPTH`] levels is refused (`resource_exhausted`, at creation, or
//! later as the watcher's error); at most [`MAX_PENDING_EVENTS`] unfetched events, beyond
//! which the watcher stops with `resource_exhausted` (events are never dropped silently); a
//! `CreateWatcher` watcher not read for [`IDLE_EXPIRY`] is removed. Watchers end with their
//! sandbox (a poll that finds it deleted stops); while the sandbox is paused they skip
//! polls. A watcher whose directory disappears stops with `not_found`, reported by the next
//! `GetWatcherEvents` (or the stream's end).
use super::connect::{
    check_kind, end_stream, message, stream_error, stream_from, stream_request, unary_ok,
    unary_request, CallKind, ConnectError,
};
use super::filesystem::{entry_info, resolve};
use crate::SharedState;
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use sandlot_api::{FileEntry, FileType, SandboxState};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Interval of the directory polls, milliseconds.
pub const POLL_MS: u64 = 200;
/// Most watchers (`WatchDir` streams and `CreateWatcher` watchers together) per sandbox.
pub const MAX_WATCHERS: usize = 16;
/// Most entries of a watched tree.
pub const MAX_WATCH_ENTRIES: usize = 10_000;
/// Deepest level of a recursive watch (the watched directory's entries are level 1).
pub const MAX_WATCH_DEPTH: u32 = 16;
/// Most events a `CreateWatcher` watcher keeps unfetched.
pub const MAX_PENDING_EVENTS: usize = 10_000;
/// A `CreateWatcher` watcher not read for this long is removed.
pub const IDLE_EXPIRY: Duration = Duration::from_secs(600);

/// One watcher's entry in [`Watchers`].
struct Slot {
    sandbox: String,
    /// Events and error of a `CreateWatcher` watcher (`None` for a `WatchDir` stream).
    pending: Option<Arc<Mutex<Pending>>>,
    /// Its poll task (`None` for a stream, whose task removes its slot itself).
    task: Option<tokio::task::AbortHandle>,
}

#[derive(Default)]
struct Pending {
    events: VecDeque<serde_json::Value>,
    error: Option<ConnectError>,
    last_read: Option<Instant>,
    /// What it watches and its last listing (`None` only before its first poll is set up).
    poller: Option<Arc<Poller>>,
}

/// A `CreateWatcher` watcher's target and last listing, shared by its poll task and
/// `GetWatcherEvents` (which polls once more before it answers, so a change made before
/// the call is in the answer, as with envd's inotify). The async lock keeps polls in order.
struct Poller {
    t: Target,
    snap: tokio::sync::Mutex<Snapshot>,
}

/// The live watchers of every sandbox, by watcher id.
#[derive(Default)]
pub struct Watchers {
    slots: Mutex<HashMap<String, Slot>>,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserve a slot for a new watcher of `sandbox`; returns its id.
    fn add(
        &self,
        sandbox: &str,
        pending: Option<Arc<Mutex<Pending>>>,
    ) -> Result<String, ConnectError> {
        let mut m = self.lock();
        let n = m.values().filter(|s| s.sandbox == sandbox).count();
        if n >= MAX_WATCHERS {
            return Err(ConnectError::new(
                "resource_exhausted",
                format!("sandbox {sandbox} has {n} watchers, the most allowed: remove one first"),
            ));
        }
        let bytes: [u8; 10] = rand::random();
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let id = format!("w-{id}");
        m.insert(
            id.clone(),
            Slot {
                sandbox: sandbox.to_owned(),
                pending,
                task: None,
            },
        );
        Ok(id)
    }

    fn set_task(&self, id: &str, task: tokio::task::AbortHandle) {
        if let Some(s) = self.lock().get_mut(id) {
            s.task = Some(task);
        }
    }

    /// Remove watcher `id` and stop its task; whether it existed.
    fn remove(&self, id: &str) -> bool {
        match self.lock().remove(id) {
            Some(s) => {
                if let Some(t) = s.task {
                    t.abort();
                }
                true
            }
            None => false,
        }
    }

    fn pending_of(&self, sandbox: &str, id: &str) -> Option<Arc<Mutex<Pending>>> {
        let m = self.lock();
        let s = m.get(id).filter(|s| s.sandbox == sandbox)?;
        s.pending.clone()
    }

    /// Remove every watcher of sandboxes for which `keep` is false.
    pub fn retain_sandboxes(&self, keep: impl Fn(&str) -> bool) {
        let mut m = self.lock();
        m.retain(|_, s| {
            let k = keep(&s.sandbox);
            if !k {
                if let Some(t) = &s.task {
                    t.abort();
                }
            }
            k
        });
    }

    /// Number of live watchers of `sandbox`.
    pub fn count(&self, sandbox: &str) -> usize {
        self.lock()
            .values()
            .filter(|s| s.sandbox == sandbox)
            .count()
    }
}

/// Removes a `WatchDir` stream's slot when its task ends.
struct SlotGuard {
    st: SharedState,
    id: String,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.st.e2b.watchers.remove(&self.id);
    }
}

/// An event type of envd's `EventType` that polling reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// `EVENT_TYPE_CREATE`.
    Create,
    /// `EVENT_TYPE_WRITE`.
    Write,
    /// `EVENT_TYPE_REMOVE`.
    Remove,
    /// `EVENT_TYPE_CHMOD`.
    Chmod,
}

impl EventType {
    /// The JSON name of the enum value.
    pub fn name(self) -> &'static str {
        match self {
            EventType::Create => "EVENT_TYPE_CREATE",
            EventType::Write => "EVENT_TYPE_WRITE",
            EventType::Remove => "EVENT_TYPE_REMOVE",
            EventType::Chmod => "EVENT_TYPE_CHMOD",
        }
    }
}

/// A listing of a watched tree: path relative to the watched directory → its entry.
pub type Snapshot = BTreeMap<String, FileEntry>;

/// The events that turn listing `old` into `new` (module docs), removals first, each
/// group in path order.
pub fn diff(old: &Snapshot, new: &Snapshot) -> Vec<(String, EventType)> {
    let mut out = Vec::new();
    for (p, o) in old {
        match new.get(p) {
            None => out.push((p.clone(), EventType::Remove)),
            Some(n) if n.kind != o.kind => out.push((p.clone(), EventType::Remove)),
            _ => {}
        }
    }
    for (p, n) in new {
        match old.get(p) {
            Some(o) if o.kind == n.kind => {
                if n.kind != FileType::Dir && (n.size != o.size || n.mtime != o.mtime) {
                    out.push((p.clone(), EventType::Write));
                }
                if n.mode != o.mode {
                    out.push((p.clone(), EventType::Chmod));
                }
            }
            _ => {
                out.push((p.clone(), EventType::Create));
                if n.kind == FileType::File && n.size > 0 {
                    out.push((p.clone(), EventType::Write));
                }
            }
        }
    }
    out
}

fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The listing of `root` (its entries; with `recursive`, those of its subdirectories too).
///
/// # Errors
/// `resource_exhausted` over [`MAX_WATCH_ENTRIES`] or [`MAX_WATCH_DEPTH`]; the node's
/// errors for `root` (a subdirectory gone meanwhile is skipped).
pub async fn snapshot(
    st: &SharedState,
    id: &str,
    root: &str,
    recursive: bool,
) -> Result<Snapshot, ConnectError> {
    let mut out = Snapshot::new();
    let mut todo: Vec<(String, u32)> = vec![(String::new(), 1)];
    while let Some((rel, level)) = todo.pop() {
        let dir = if rel.is_empty() {
            root.to_owned()
        } else {
            join(root, &rel)
        };
        let entries = match st.node.list_dir(id, &dir).await {
            Ok(e) => e,
            Err(sandlot_node_api::NodeError::NotFound(_)) if !rel.is_empty() => continue,
            Err(e) => return Err(e.into()),
        };
        for e in entries {
            let p = if rel.is_empty() {
                e.name.clone()
            } else {
                format!("{rel}/{}", e.name)
            };
            if recursive && e.kind == FileType::Dir {
                if level >= MAX_WATCH_DEPTH {
                    return Err(ConnectError::new(
                        "resource_exhausted",
                        format!(
                            "recursive watch of {root}: deeper than {MAX_WATCH_DEPTH} levels \
                             ({p}); watch a smaller tree"
                        ),
                    ));
                }
                todo.push((p.clone(), level + 1));
            }
            out.insert(p, e);
            if out.len() > MAX_WATCH_ENTRIES {
                return Err(ConnectError::new(
                    "resource_exhausted",
                    format!(
                        "watch of {root}: more than {MAX_WATCH_ENTRIES} entries; watch a \
                         smaller tree{}",
                        if recursive { " or not recursively" } else { "" }
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// The message of the error that ends a watcher whose sandbox is gone.
fn gone_message(sandbox: &str) -> String {
    format!("sandbox {sandbox} is gone")
}

/// What one watcher watches.
#[derive(Clone)]
struct Target {
    sandbox: String,
    root: String,
    recursive: bool,
    include_entry: bool,
}

/// One poll: `Ok(None)` while the sandbox is paused (or still creating), else the events since
/// `snap` (which becomes the new listing).
///
/// # Errors
/// `not_found` when the sandbox (deleting, deleted, lost or unknown) or the watched
/// directory is gone; [`snapshot`]'s.
async fn poll_once(
    st: &SharedState,
    t: &Target,
    snap: &mut Snapshot,
) -> Result<Option<Vec<serde_json::Value>>, ConnectError> {
    match st.store.get(&t.sandbox).await {
        Ok(Some(r)) if r.state == SandboxState::Running => {}
        Ok(Some(r)) if matches!(r.state, SandboxState::Paused | SandboxState::Creating) => {
            return Ok(None)
        }
        // Deleting, deleted, lost, or no record: the watcher ends with its sandbox.
        Ok(_) => return Err(ConnectError::new("not_found", gone_message(&t.sandbox))),
        Err(e) => return Err(crate::error::ServerError::from(e).into()),
    }
    let new = snapshot(st, &t.sandbox, &t.root, t.recursive).await?;
    let events = diff(snap, &new)
        .into_iter()
        .map(|(p, ty)| {
            let mut ev = serde_json::json!({"name": p, "type": ty.name()});
            if t.include_entry && ty != EventType::Remove {
                if let Some(e) = new.get(&p) {
                    ev["entry"] = entry_info(e, &join(&t.root, &p));
                }
            }
            ev
        })
        .collect();
    *snap = new;
    Ok(Some(events))
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default)]
    include_entry: bool,
    #[serde(default)]
    #[allow(dead_code)] // accepted; Sandlot has no network mounts to refuse
    allow_network_mounts: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherIdReq {
    #[serde(default)]
    watcher_id: String,
}

/// Whether `method` is one of this module's.
pub fn is_watch_method(method: &str) -> bool {
    matches!(
        method,
        "WatchDir" | "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher"
    )
}

/// Check the codec of watch `method` (a stream for `WatchDir`, else unary).
///
/// # Errors
/// [`check_kind`]'s.
pub fn check(method: &str, headers: &HeaderMap) -> Result<(), ConnectError> {
    check_kind(
        headers,
        if method == "WatchDir" {
            CallKind::Stream
        } else {
            CallKind::Unary
        },
    )
}

/// How a failure of watch `method` is answered (a stream's end for `WatchDir`).
pub fn fail(method: &str, e: ConnectError) -> Response {
    if method == "WatchDir" && e.status.is_none() {
        stream_error(e)
    } else {
        e.into_response()
    }
}

/// Serve watch `method` for sandbox `id` (visible to the caller, running) with E2B home
/// `home`.
pub async fn serve(
    st: &SharedState,
    id: &str,
    home: &str,
    method: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ConnectError> {
    match method {
        "WatchDir" => {
            let req: WatchReq = stream_request(body)?;
            let t = target(st, id, home, &req).await?;
            let snap = snapshot(st, id, &t.root, t.recursive).await?;
            let wid = st.e2b.watchers.add(id, None)?;
            Ok(watch_stream(st.clone(), wid, t, snap, headers))
        }
        "CreateWatcher" => {
            let req: WatchReq = unary_request(body)?;
            let t = target(st, id, home, &req).await?;
            let snap = snapshot(st, id, &t.root, t.recursive).await?;
            let poller = Arc::new(Poller {
                t,
                snap: tokio::sync::Mutex::new(snap),
            });
            let pending = Arc::new(Mutex::new(Pending {
                last_read: Some(Instant::now()),
                poller: Some(poller.clone()),
                ..Default::default()
            }));
            let wid = st.e2b.watchers.add(id, Some(pending.clone()))?;
            let task = tokio::spawn(poll_into(st.clone(), wid.clone(), poller, pending));
            st.e2b.watchers.set_task(&wid, task.abort_handle());
            Ok(unary_ok(serde_json::json!({ "watcherId": wid })))
        }
        "GetWatcherEvents" => {
            let req: WatcherIdReq = unary_request(body)?;
            let p = st
                .e2b
                .watchers
                .pending_of(id, &req.watcher_id)
                .ok_or_else(|| unknown_watcher(&req.watcher_id))?;
            let poller = p.lock().unwrap_or_else(|e| e.into_inner()).poller.clone();
            if let Some(poller) = poller {
                poll_step(st, &req.watcher_id, &poller, &p).await;
            }
            let (events, error) = {
                let mut g = p.lock().unwrap_or_else(|e| e.into_inner());
                g.last_read = Some(Instant::now());
                (g.events.drain(..).collect::<Vec<_>>(), g.error.take())
            };
            if let Some(e) = error {
                // The watcher stopped: report its error once, then it is gone.
                st.e2b.watchers.remove(&req.watcher_id);
                if events.is_empty() {
                    return Err(e);
                }
            }
            Ok(unary_ok(serde_json::json!({ "events": events })))
        }
        "RemoveWatcher" => {
            let req: WatcherIdReq = unary_request(body)?;
            if st.e2b.watchers.pending_of(id, &req.watcher_id).is_none()
                || !st.e2b.watchers.remove(&req.watcher_id)
            {
                return Err(unknown_watcher(&req.watcher_id));
            }
            Ok(unary_ok(serde_json::json!({})))
        }
        other => Err(ConnectError::new(
            "unimplemented",
            format!("no method filesystem.Filesystem/{other}"),
        )),
    }
}

fn unknown_watcher(id: &str) -> ConnectError {
    ConnectError::new("not_found", format!("watcher {id:?} not found"))
}

async fn target(
    st: &SharedState,
    id: &str,
    home: &str,
    req: &WatchReq,
) -> Result<Target, ConnectError> {
    let root = resolve(&req.path, home)?;
    let top = st.node.stat_file(id, &root).await?;
    if top.kind != FileType::Dir {
        return Err(ConnectError::invalid(format!("{root} is not a directory")));
    }
    Ok(Target {
        sandbox: id.to_owned(),
        root,
        recursive: req.recursive,
        include_entry: req.include_entry,
    })
}

/// The poll loop of a `CreateWatcher` watcher: events into `pending` until removed, an
/// error, or [`IDLE_EXPIRY`] without a read.
async fn poll_into(
    st: SharedState,
    wid: String,
    poller: Arc<Poller>,
    pending: Arc<Mutex<Pending>>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(POLL_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let idle = pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last_read
            .is_some_and(|t| t.elapsed() > IDLE_EXPIRY);
        if idle {
            st.e2b.watchers.remove(&wid);
            return;
        }
        if !poll_step(&st, &wid, &poller, &pending).await {
            return;
        }
    }
}

/// One poll of watcher `wid` into `pending`; false once the watcher has stopped (its
/// error is then in `pending`, and no further poll adds anything).
async fn poll_step(st: &SharedState, wid: &str, poller: &Poller, pending: &Mutex<Pending>) -> bool {
    let mut snap = poller.snap.lock().await;
    if pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .error
        .is_some()
    {
        return false;
    }
    let r = poll_once(st, &poller.t, &mut snap).await;
    let mut g = pending.lock().unwrap_or_else(|e| e.into_inner());
    match r {
        Ok(None) => true,
        Ok(Some(evs)) => {
            if g.events.len() + evs.len() > MAX_PENDING_EVENTS {
                g.error = Some(ConnectError::new(
                    "resource_exhausted",
                    format!(
                        "more than {MAX_PENDING_EVENTS} events not fetched: the watcher \
                         stopped; fetch events more often"
                    ),
                ));
                return false;
            }
            g.events.extend(evs);
            true
        }
        Err(e) => {
            let gone = e.message == gone_message(&poller.t.sandbox);
            g.error = Some(e);
            drop(g);
            if gone {
                st.e2b.watchers.remove(wid);
            }
            false
        }
    }
}

fn deadline_of(h: &HeaderMap) -> Option<Duration> {
    h.get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
}

/// The `WatchDir` stream (module docs).
fn watch_stream(
    st: SharedState,
    wid: String,
    t: Target,
    mut snap: Snapshot,
    headers: &HeaderMap,
) -> Response {
    let keepalive = super::process::keepalive_of(headers);
    let deadline = deadline_of(headers).map(|d| tokio::time::Instant::now() + d);
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let _guard = SlotGuard {
            st: st.clone(),
            id: wid,
        };
        if tx
            .send(message(&serde_json::json!({"start": {}})))
            .await
            .is_err()
        {
            return;
        }
        let mut poll = tokio::time::interval(Duration::from_millis(POLL_MS));
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll.tick().await;
        let mut ka = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        let end = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(end);
        loop {
            tokio::select! {
                _ = poll.tick() => {
                    match poll_once(&st, &t, &mut snap).await {
                        Ok(None) => {}
                        Ok(Some(evs)) => {
                            for ev in evs {
                                let m = message(&serde_json::json!({"filesystem": ev}));
                                if tx.send(m).await.is_err() {
                                    return;
                                }
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(end_stream(Some(&e))).await;
                            return;
                        }
                    }
                }
                _ = ka.tick() => {
                    if tx.send(message(&serde_json::json!({"keepalive": {}}))).await.is_err() {
                        return;
                    }
                }
                _ = &mut end => {
                    let e = ConnectError::new("deadline_exceeded", "the watch's deadline passed");
                    let _ = tx.send(end_stream(Some(&e))).await;
                    return;
                }
                _ = tx.closed() => return,
            }
        }
    });
    stream_from(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(name: &str, kind: FileType, size: u64, mode: u32, mtime: i64) -> FileEntry {
        FileEntry {
            name: name.rsplit('/').next().unwrap_or(name).into(),
            kind,
            size,
            mode,
            mtime,
            link_target: None,
        }
    }

    fn snap(items: &[(&str, FileType, u64, u32, i64)]) -> Snapshot {
        items
            .iter()
            .map(|(p, k, s, m, t)| (p.to_string(), e(p, *k, *s, *m, *t)))
            .collect()
    }

    #[test]
    fn diff_reports_create_write_remove_chmod() {
        use EventType::*;
        use FileType::*;
        let a = snap(&[
            ("keep", File, 1, 0o644, 10),
            ("grow", File, 1, 0o644, 10),
            ("old", File, 1, 0o644, 10),
            ("mod", File, 1, 0o644, 10),
            ("d", Dir, 4096, 0o755, 10),
            ("swap", File, 0, 0o644, 10),
        ]);
        let b = snap(&[
            ("keep", File, 1, 0o644, 10),
            ("grow", File, 5, 0o644, 11),
            ("mod", File, 1, 0o600, 10),
            ("d", Dir, 4096, 0o755, 12),
            ("new", File, 3, 0o644, 12),
            ("empty", File, 0, 0o644, 12),
            ("swap", Dir, 4096, 0o755, 12),
        ]);
        let d = diff(&a, &b);
        let want: Vec<(String, EventType)> = [
            ("old", Remove),
            ("swap", Remove),
            ("empty", Create),
            ("grow", Write),
            ("mod", Chmod),
            ("new", Create),
            ("new", Write),
            ("swap", Create),
        ]
        .iter()
        .map(|(p, t)| (p.to_string(), *t))
        .collect();
        assert_eq!(d, want);
        assert!(diff(&b, &b).is_empty());
        assert_eq!(EventType::Create.name(), "EVENT_TYPE_CREATE");
    }

    #[test]
    fn watchers_are_bounded_per_sandbox_and_removed() {
        let w = Watchers::default();
        let mut ids = Vec::new();
        for _ in 0..MAX_WATCHERS {
            ids.push(w.add("sb-a", Some(Default::default())).unwrap());
        }
        let e = w.add("sb-a", None).unwrap_err();
        assert_eq!(e.code, "resource_exhausted");
        assert!(w.add("sb-b", None).is_ok());
        assert!(
            w.pending_of("sb-b", &ids[0]).is_none(),
            "other sandbox's watcher"
        );
        assert!(w.pending_of("sb-a", &ids[0]).is_some());
        assert!(w.remove(&ids[0]));
        assert!(!w.remove(&ids[0]));
        assert_eq!(w.count("sb-a"), MAX_WATCHERS - 1);
        w.retain_sandboxes(|s| s != "sb-a");
        assert_eq!(w.count("sb-a"), 0);
        assert_eq!(w.count("sb-b"), 1);
    }

    /// Over the unit-test `FakeNode`: a `CreateWatcher` watcher sees a write, and is
    /// dropped when its sandbox is deleted.
    #[tokio::test]
    async fn create_watcher_events_and_drop_with_sandbox() {
        use crate::test_support::{call, raw, setup};
        use axum::http::Method;
        let t = setup("e2b-watch");
        let r = call(
            &t.app,
            Method::POST,
            "/v1/sandboxes",
            Some(serde_json::json!({})),
        )
        .await;
        let id = r.json()["id"].as_str().unwrap().to_owned();
        t.st.node
            .write_file(&id, "/tmp/w/a", Bytes::from_static(b"1"))
            .await
            .unwrap();
        let hdr = [("e2b-sandbox-id", id.as_str())];
        let ct = Some("application/json");
        let r = raw(
            &t.app,
            Method::POST,
            "/filesystem.Filesystem/CreateWatcher",
            ct,
            br#"{"path": "/tmp/w"}"#.to_vec(),
            &hdr,
        )
        .await;
        assert_eq!(r.status, axum::http::StatusCode::OK, "{:?}", r.body);
        let wid = r.json()["watcherId"].as_str().unwrap().to_owned();
        assert_eq!(t.st.e2b.watchers.count(&id), 1);
        t.st.node
            .write_file(&id, "/tmp/w/b", Bytes::from_static(b"22"))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(3 * POLL_MS)).await;
        let body = serde_json::to_vec(&serde_json::json!({ "watcherId": wid })).unwrap();
        let r = raw(
            &t.app,
            Method::POST,
            "/filesystem.Filesystem/GetWatcherEvents",
            ct,
            body.clone(),
            &hdr,
        )
        .await;
        let evs = r.json()["events"].clone();
        assert_eq!(
            evs,
            serde_json::json!([
                {"name": "b", "type": "EVENT_TYPE_CREATE"},
                {"name": "b", "type": "EVENT_TYPE_WRITE"}
            ])
        );
        let r = call(&t.app, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert!(r.status.is_success(), "{:?}", r.body);
        for _ in 0..50 {
            if t.st.e2b.watchers.count(&id) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
        assert_eq!(t.st.e2b.watchers.count(&id), 0, "dropped with its sandbox");
    }
}
