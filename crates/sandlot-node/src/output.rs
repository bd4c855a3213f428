//! Head+tail capture of one output stream under a byte cap.
//!
//! The first `cap/2` bytes and the last `cap - cap/2` bytes are kept; everything in between
//! is counted but dropped. Memory use is bounded by `cap` whatever the process writes.
use sandlot_api::Output;
use std::collections::VecDeque;

/// Capture of one stream (stdout or stderr).
#[derive(Debug, Clone)]
pub struct Capture {
    head_cap: usize,
    tail_cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total: u64,
}

impl Capture {
    /// A capture keeping at most `cap` bytes (head `cap/2`, tail the rest).
    pub fn new(cap: usize) -> Self {
        let head_cap = cap / 2;
        Capture {
            head_cap,
            tail_cap: cap - head_cap,
            head: Vec::new(),
            tail: VecDeque::new(),
            total: 0,
        }
    }

    /// Append a chunk as it comes from the process.
    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.head_cap {
            let n = (self.head_cap - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if data.is_empty() || self.tail_cap == 0 {
            return;
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail
                .extend(data[data.len() - self.tail_cap..].iter().copied());
            return;
        }
        let overflow = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
        self.tail.drain(..overflow);
        self.tail.extend(data.iter().copied());
    }

    /// Total bytes pushed so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The kept bytes (head then tail), the total and whether bytes were dropped.
    pub fn finish(self) -> Output {
        let mut data = self.head;
        data.extend(self.tail);
        Output {
            truncated: (data.len() as u64) < self.total,
            data,
            total: self.total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(cap: usize, chunks: &[&[u8]]) -> Output {
        let mut c = Capture::new(cap);
        for ch in chunks {
            c.push(ch);
        }
        c.finish()
    }

    #[test]
    fn keeps_everything_under_the_cap() {
        let o = run(10, &[b"abc", b"defg", b"hij"]);
        assert_eq!(o.data, b"abcdefghij");
        assert_eq!(o.total, 10);
        assert!(!o.truncated);
        let o = run(10, &[]);
        assert!(o.data.is_empty() && o.total == 0 && !o.truncated);
    }

    #[test]
    fn keeps_head_and_tail_over_the_cap() {
        // Byte-at-a-time and one big chunk must give the same answer.
        let input: Vec<u8> = (0u8..=99).collect();
        let whole = run(10, &[&input]);
        let mut c = Capture::new(10);
        for b in &input {
            c.push(std::slice::from_ref(b));
        }
        let bytewise = c.finish();
        for o in [whole, bytewise] {
            assert_eq!(o.data, [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]);
            assert_eq!(o.total, 100);
            assert!(o.truncated);
        }
    }

    #[test]
    fn odd_cap_and_chunk_boundaries() {
        let input: Vec<u8> = (0u8..50).collect();
        let chunks: Vec<&[u8]> = input.chunks(7).collect();
        let o = run(7, &chunks);
        // head 3, tail 4
        assert_eq!(o.data, [0, 1, 2, 46, 47, 48, 49]);
        assert_eq!(o.total, 50);
        assert!(o.truncated);
        // exactly the cap: nothing dropped
        let o = run(50, &chunks);
        assert_eq!(o.data, input);
        assert!(!o.truncated);
        // cap 0 keeps nothing but counts
        let o = run(0, &chunks);
        assert!(o.data.is_empty());
        assert_eq!(o.total, 50);
        assert!(o.truncated);
    }
}
