//! The agent's table of its named (background) execs, kept so that a node that connects
//! after the one that started them went away (its restart or kill -9, or a paused VM
//! resumed on another node) can find them again (issue 25).
//!
//! The agent tables every exec started with a handle; `GET /v1/execs` and
//! `POST /v1/exec/attach` ([`crate::agent_proto::PATH_EXECS`]) serve it. What it holds per exec: the node's handle id (the key, [`crate::agent_proto::ExecRequest::handle`]),
//! the command, the node's opaque labels ([`crate::agent_proto::ExecRequest::labels`], at
//! most [`crate::agent_proto::MAX_LABELS_BYTES`]), the helper's pid, the start time, the
//! state (running or its exit code) and an [`OutputRing`] of the output produced while no
//! host is connected.
//!
//! An ended entry stays after a node has read its end, until the node forgets it
//! ([`ExecTable::forget`], `POST /v1/exec/forget`: the node deleted the process's record),
//! so that a node that connects later still lists the process as exited. The table also
//! keeps the highest `number` label it ever tabled ([`ExecTable::max_number`]), so a node
//! that connects later numbers new processes past those forgotten (not reused).
//!
//! Memory is bounded: each ring holds at most [`RING_CAP`] bytes per exec (older output is
//! dropped and counted), and the table holds at most [`TABLE_CAP`] entries, running or
//! ended (a new exec beyond it is refused with [`TableError::Full`]; ended entries, read
//! or not, are evicted oldest first to make room: a node that connects after more than
//! [`TABLE_CAP`] named execs no longer finds the oldest ended ones).

use std::collections::{BTreeMap, VecDeque};
use std::time::SystemTime;

/// Most output bytes kept per exec while no host is connected: 64 KiB.
pub const RING_CAP: usize = 64 * 1024;

/// Most entries (running or ended) in an [`ExecTable`].
pub const TABLE_CAP: usize = 1024;

/// Which stream a chunk of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// The command's stdout.
    Stdout,
    /// The command's stderr.
    Stderr,
}

/// A byte ring of at most `cap` bytes of (stream, bytes) chunks, oldest dropped first.
///
/// `dropped` counts the bytes dropped to stay within the cap, so a reader can say how
/// much it missed (never unbounded memory).
#[derive(Debug)]
pub struct OutputRing {
    cap: usize,
    len: usize,
    dropped: u64,
    chunks: VecDeque<(Stream, Vec<u8>)>,
}

impl OutputRing {
    /// An empty ring holding at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            len: 0,
            dropped: 0,
            chunks: VecDeque::new(),
        }
    }

    /// Appends `data` from `stream`, dropping the oldest bytes beyond the cap.
    pub fn push(&mut self, stream: Stream, data: &[u8]) {
        // Only the last `cap` bytes of an oversized chunk can ever be kept.
        let skip = data.len().saturating_sub(self.cap);
        self.dropped += skip as u64;
        let data = &data[skip..];
        if data.is_empty() {
            return;
        }
        self.chunks.push_back((stream, data.to_vec()));
        self.len += data.len();
        while self.len > self.cap {
            let over = self.len - self.cap;
            let front = self.chunks.front_mut().expect("len > 0 means a chunk");
            if front.1.len() <= over {
                let n = front.1.len();
                self.chunks.pop_front();
                self.len -= n;
                self.dropped += n as u64;
            } else {
                front.1.drain(..over);
                self.len -= over;
                self.dropped += over as u64;
            }
        }
    }

    /// Bytes held now (at most the cap).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes dropped so far to stay within the cap.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Takes everything held, oldest first, leaving the ring empty (`dropped` is kept).
    pub fn drain(&mut self) -> Vec<(Stream, Vec<u8>)> {
        self.len = 0;
        self.chunks.drain(..).collect()
    }
}

/// How a tabled exec stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecState {
    /// Still running.
    Running,
    /// Ended with this exit code (128 + signal for a signal death, as a shell reports).
    Exited(i32),
}

/// One named exec in an [`ExecTable`].
#[derive(Debug)]
pub struct ExecEntry {
    /// The command line (argv).
    pub command: Vec<String>,
    /// The node's labels of it, as given (the agent does not read them).
    pub labels: Option<serde_json::Value>,
    /// Pid of the exec helper (in the agent's pid namespace).
    pub pid: i32,
    /// When the exec started.
    pub started: SystemTime,
    /// Running or ended.
    pub state: ExecState,
    /// Output produced while no host was connected.
    pub output: OutputRing,
    seq: u64,
}

/// Why an [`ExecTable`] call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    /// The handle id is already in the table.
    InUse(String),
    /// The table holds [`TABLE_CAP`] running execs.
    Full,
    /// No such handle id.
    NotFound(String),
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::InUse(h) => write!(f, "handle {h:?} is already in use"),
            Self::Full => write!(f, "the agent already tracks {TABLE_CAP} execs"),
            Self::NotFound(h) => write!(f, "no exec with handle {h:?}"),
        }
    }
}

impl std::error::Error for TableError {}

/// The agent's named execs, keyed by the node's handle id, at most `cap` entries.
#[derive(Debug)]
pub struct ExecTable {
    cap: usize,
    ring_cap: usize,
    next_seq: u64,
    entries: BTreeMap<String, ExecEntry>,
    max_number: Option<u64>,
}

impl Default for ExecTable {
    fn default() -> Self {
        Self::new(TABLE_CAP, RING_CAP)
    }
}

impl ExecTable {
    /// An empty table of at most `cap` entries with rings of `ring_cap` bytes.
    pub fn new(cap: usize, ring_cap: usize) -> Self {
        Self {
            cap,
            ring_cap,
            next_seq: 0,
            entries: BTreeMap::new(),
            max_number: None,
        }
    }

    /// Adds a running exec under `handle` with the node's `labels` (bounded by the
    /// caller); evicts the oldest ended entry when full. A `number` field of `labels` that
    /// is an unsigned integer raises [`ExecTable::max_number`] (the only label read).
    ///
    /// Errors: [`TableError::InUse`] when `handle` is tabled, [`TableError::Full`] when
    /// every entry is running.
    pub fn insert(
        &mut self,
        handle: &str,
        command: Vec<String>,
        labels: Option<serde_json::Value>,
        pid: i32,
    ) -> Result<(), TableError> {
        if self.entries.contains_key(handle) {
            return Err(TableError::InUse(handle.to_string()));
        }
        if self.entries.len() >= self.cap {
            let oldest_ended = self
                .entries
                .iter()
                .filter(|(_, e)| e.state != ExecState::Running)
                .min_by_key(|(_, e)| e.seq)
                .map(|(k, _)| k.clone());
            match oldest_ended {
                Some(k) => {
                    self.entries.remove(&k);
                }
                None => return Err(TableError::Full),
            }
        }
        if let Some(n) = labels
            .as_ref()
            .and_then(|l| l.get("number"))
            .and_then(serde_json::Value::as_u64)
        {
            self.max_number = Some(self.max_number.map_or(n, |m| m.max(n)));
        }
        self.next_seq += 1;
        self.entries.insert(
            handle.to_string(),
            ExecEntry {
                command,
                labels,
                pid,
                started: SystemTime::now(),
                state: ExecState::Running,
                output: OutputRing::new(self.ring_cap),
                seq: self.next_seq,
            },
        );
        Ok(())
    }

    /// Records output of `handle` produced while no host is connected.
    pub fn output(&mut self, handle: &str, stream: Stream, data: &[u8]) -> Result<(), TableError> {
        let e = self.entry(handle)?;
        e.output.push(stream, data);
        Ok(())
    }

    /// Marks `handle` ended with `code`.
    pub fn exited(&mut self, handle: &str, code: i32) -> Result<(), TableError> {
        self.entry(handle)?.state = ExecState::Exited(code);
        Ok(())
    }

    /// Removes `handle` (its node deleted it, or nobody wants its end), returning the
    /// entry; `None` when it is not tabled (forgetting twice is fine). Its number stays
    /// counted in [`ExecTable::max_number`].
    pub fn forget(&mut self, handle: &str) -> Option<ExecEntry> {
        self.entries.remove(handle)
    }

    /// The highest `number` label of every exec ever tabled (forgotten and evicted ones
    /// included); `None` before the first one with such a label.
    pub fn max_number(&self) -> Option<u64> {
        self.max_number
    }

    /// The entry of `handle`, if tabled.
    pub fn get(&self, handle: &str) -> Option<&ExecEntry> {
        self.entries.get(handle)
    }

    /// The entry of `handle` for changes (draining its ring), if tabled.
    pub fn get_mut(&mut self, handle: &str) -> Option<&mut ExecEntry> {
        self.entries.get_mut(handle)
    }

    /// Every entry, by handle id.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &ExecEntry)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no exec is tabled.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn entry(&mut self, handle: &str) -> Result<&mut ExecEntry, TableError> {
        self.entries
            .get_mut(handle)
            .ok_or_else(|| TableError::NotFound(handle.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(r: &mut OutputRing) -> Vec<u8> {
        r.drain().into_iter().flat_map(|(_, d)| d).collect()
    }

    #[test]
    fn ring_keeps_last_cap_bytes_and_counts_dropped() {
        let mut r = OutputRing::new(10);
        r.push(Stream::Stdout, b"0123456");
        r.push(Stream::Stderr, b"789ab");
        assert_eq!(r.len(), 10);
        assert_eq!(r.dropped(), 2);
        let chunks = r.drain();
        assert_eq!(chunks[0], (Stream::Stdout, b"23456".to_vec()));
        assert_eq!(chunks[1], (Stream::Stderr, b"789ab".to_vec()));
        assert!(r.is_empty());
        assert_eq!(r.dropped(), 2);
    }

    #[test]
    fn ring_oversized_chunk_keeps_its_tail() {
        let mut r = OutputRing::new(4);
        r.push(Stream::Stdout, b"ab");
        r.push(Stream::Stdout, b"0123456789");
        assert_eq!(bytes(&mut r), b"6789");
        assert_eq!(r.dropped(), 8);
    }

    #[test]
    fn ring_default_cap_is_bounded() {
        let mut t = ExecTable::default();
        t.insert("h", vec!["yes".into()], None, 1).unwrap();
        for _ in 0..1000 {
            t.output("h", Stream::Stdout, &[b'y'; 1000]).unwrap();
        }
        let e = t.get("h").unwrap();
        assert_eq!(e.output.len(), RING_CAP);
        assert_eq!(e.output.dropped(), 1_000_000 - RING_CAP as u64);
    }

    #[test]
    fn table_tracks_state_and_rejects_duplicates() {
        let mut t = ExecTable::new(4, 16);
        let labels = serde_json::json!({"tag": "t", "number": 1000});
        t.insert(
            "a",
            vec!["sleep".into(), "9".into()],
            Some(labels.clone()),
            10,
        )
        .unwrap();
        assert_eq!(t.get("a").unwrap().labels, Some(labels));
        assert_eq!(
            t.insert("a", vec![], None, 11),
            Err(TableError::InUse("a".into()))
        );
        assert_eq!(t.get("a").unwrap().state, ExecState::Running);
        t.exited("a", 3).unwrap();
        assert_eq!(t.get("a").unwrap().state, ExecState::Exited(3));
        assert_eq!(t.exited("b", 0), Err(TableError::NotFound("b".into())));
        assert_eq!(t.forget("a").unwrap().pid, 10);
        assert!(t.is_empty());
    }

    #[test]
    fn ended_entry_stays_until_forgotten_and_forget_is_idempotent() {
        let mut t = ExecTable::new(4, 16);
        t.insert("a", vec!["true".into()], None, 1).unwrap();
        t.exited("a", 0).unwrap();
        // Ended: still tabled (and listed) until forgotten.
        assert_eq!(t.get("a").unwrap().state, ExecState::Exited(0));
        assert_eq!(t.iter().count(), 1);
        assert!(t.forget("a").is_some());
        assert!(t.forget("a").is_none());
        assert!(t.forget("never").is_none());
        assert!(t.is_empty());
        // Its handle can be used again once forgotten.
        t.insert("a", vec![], None, 2).unwrap();
    }

    #[test]
    fn max_number_outlives_forget_and_eviction() {
        let mut t = ExecTable::new(2, 16);
        assert_eq!(t.max_number(), None);
        let n = |v: serde_json::Value| Some(serde_json::json!({ "number": v }));
        t.insert("a", vec![], n(1003.into()), 1).unwrap();
        t.insert("b", vec![], n(1001.into()), 2).unwrap();
        assert_eq!(t.max_number(), Some(1003));
        t.forget("a");
        assert_eq!(t.max_number(), Some(1003));
        // Labels without an unsigned `number` leave it alone.
        t.insert("c", vec![], n("1009".into()), 3).unwrap();
        t.exited("b", 0).unwrap();
        t.exited("c", 0).unwrap();
        t.insert("d", vec![], n((-5).into()), 4).unwrap();
        t.insert("e", vec![], None, 5).unwrap();
        assert_eq!(t.max_number(), Some(1003));
        // Every entry that carried a number is evicted by now; the mark stays.
        assert!(t.get("b").is_none());
        assert_eq!(t.max_number(), Some(1003));
    }

    #[test]
    fn table_full_evicts_oldest_ended_else_refuses() {
        let mut t = ExecTable::new(2, 16);
        t.insert("a", vec![], None, 1).unwrap();
        t.insert("b", vec![], None, 2).unwrap();
        assert_eq!(t.insert("c", vec![], None, 3), Err(TableError::Full));
        t.exited("b", 0).unwrap();
        t.exited("a", 0).unwrap();
        t.insert("c", vec![], None, 3).unwrap();
        // "a" was tabled first, so it goes first.
        assert!(t.get("a").is_none());
        assert!(t.get("b").is_some());
        assert_eq!(t.len(), 2);
    }
}
