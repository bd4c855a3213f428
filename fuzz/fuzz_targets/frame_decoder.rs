//! Fuzz target: the guest-agent frame decoder (`sandlot_guest::agent_proto::FrameDecoder`),
//! which parses bytes from a sandbox, i.e. from code we do not trust.
//!
//! Input: byte 0 picks the chunk size (1–256) the stream is pushed in; the rest is the
//! stream. Properties checked besides "no panic, no unbounded allocation":
//! - every frame's payload is at most `MAX_FRAME` bytes;
//! - decoding in chunks gives the same frames and the same error as decoding all at once;
//! - re-encoding the decoded frames gives back exactly the bytes they were decoded from;
//! - after an error the decoder is not used again (the stream is dead), and on success the
//!   leftover is shorter than one complete frame.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sandlot_guest::agent_proto::{encode, Frame, FrameDecoder, FrameError, HEADER, MAX_FRAME};

fn decode(stream: &[u8], chunk: usize) -> (Vec<Frame>, Option<FrameError>, bool) {
    let mut d = FrameDecoder::default();
    let mut frames = Vec::new();
    for c in stream.chunks(chunk) {
        d.push(c);
        loop {
            match d.next_frame() {
                Ok(Some(f)) => {
                    assert!(f.data.len() <= MAX_FRAME, "frame over MAX_FRAME");
                    frames.push(f);
                }
                Ok(None) => break,
                Err(e) => return (frames, Some(e), false),
            }
        }
    }
    let empty = d.is_empty();
    (frames, None, empty)
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, stream)) = data.split_first() else {
        return;
    };
    let chunk = first as usize + 1;
    let (frames, err, empty) = decode(stream, chunk);
    let (all_at_once, err2, empty2) = decode(stream, stream.len().max(1));
    assert_eq!(frames, all_at_once, "chunking changed the frames");
    assert_eq!(err, err2, "chunking changed the error");
    assert_eq!(empty, empty2);
    let mut wire = Vec::new();
    for f in &frames {
        wire.extend_from_slice(&encode(f.kind, &f.data));
    }
    assert_eq!(
        &stream[..wire.len()],
        &wire[..],
        "re-encoding differs from the input"
    );
    if err.is_none() {
        let rest = &stream[wire.len()..];
        assert_eq!(empty, rest.is_empty());
        // What is left is an incomplete frame: a short header or a short payload.
        if rest.len() >= HEADER {
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            assert!(
                rest.len() < HEADER + len,
                "a complete frame was left undecoded"
            );
        }
    }
});
