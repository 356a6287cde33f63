//! Frames in parts: a frame too large for one record of a shared-memory
//! ring travels as [`Kind::Part`] frames, each a slice of its encoding
//! (the frame format's "Parts", `frame.rs`). Splitting is [`split`];
//! joining, with every check a peer's bytes need, is [`Joiner`].
//!
//! Only a frame whose inline payload is larger than a record carries
//! travels so: a node that asked for every payload by value
//! (`Config::by_value`), or one whose threshold is above what a record
//! carries. Such a frame's payload is at most [`MAX_JOINED`] bytes.

use super::TransportError;
use crate::frame::{Frame, Kind, Limits, FLAG_PART_FIRST, FLAG_PART_LAST, HEADER_LEN};
use bytes::Bytes;

/// The largest payload of a frame sent in parts (64 MiB). It bounds what
/// a receiver gathers for a peer before the frame is whole.
pub(crate) const MAX_JOINED: usize = 64 << 20;

/// The parts of `f`, each carrying at most `slice` bytes of its encoding
/// (at least 1). The encoding is made once and shared by the parts.
pub(crate) fn split(f: &Frame, slice: usize) -> Vec<Frame> {
    let all = Bytes::from(f.encode());
    let slice = slice.max(1);
    let n = all.len().div_ceil(slice);
    (0..n)
        .map(|k| {
            let mut flags = 0;
            if k == 0 {
                flags |= FLAG_PART_FIRST;
            }
            if k + 1 == n {
                flags |= FLAG_PART_LAST;
            }
            let end = ((k + 1) * slice).min(all.len());
            Frame::part(f.call_id, flags, all.slice(k * slice..end))
        })
        .collect()
}

/// Gathers the parts of one frame at a time from one peer, and decodes
/// the whole once the last has come.
#[derive(Debug, Default)]
pub(crate) struct Joiner {
    /// The call id of the frame being gathered, and its bytes so far.
    at: Option<(u64, Vec<u8>)>,
}

impl Joiner {
    /// Whether a frame is being gathered.
    #[cfg(test)]
    fn is_joining(&self) -> bool {
        self.at.is_some()
    }

    /// Takes frame `f` as it arrived: a frame that is not a part passes
    /// through (and a frame being gathered is given up: its sender gave
    /// up on it, a deadline passing between two parts); a part is
    /// gathered, and the whole frame comes out with the last. A part that
    /// does not follow the one before, parts beyond [`MAX_JOINED`] of
    /// payload, or a whole that is not one valid frame of the same call is
    /// an error: the peer broke the protocol.
    pub(crate) fn take(&mut self, f: Frame) -> Result<Option<Frame>, TransportError> {
        if f.kind != Kind::Part {
            self.passing();
            return Ok(Some(f));
        }
        self.part(&f)
    }

    /// A frame that is not a part came (see [`take`](Self::take)): the
    /// hot path, which moves no frame.
    #[inline]
    pub(crate) fn passing(&mut self) {
        if self.at.is_some() {
            self.at = None;
        }
    }

    /// Gathers part `f` (see [`take`](Self::take)).
    #[cold]
    pub(crate) fn part(&mut self, f: &Frame) -> Result<Option<Frame>, TransportError> {
        let bad = |why: &str| TransportError::Protocol(format!("a frame in parts: {why}"));
        let crate::frame::Body::Inline(slice) = &f.payload else {
            return Err(bad("a part without bytes"));
        };
        if f.flags & FLAG_PART_FIRST != 0 {
            self.at = Some((f.call_id, Vec::new()));
        }
        let Some((id, buf)) = self.at.as_mut() else {
            return Err(bad("a part before the first"));
        };
        if *id != f.call_id {
            return Err(bad("a part of another call"));
        }
        let limit = HEADER_LEN + MAX_JOINED + crate::metadata::DEFAULT_MAX_META as usize;
        if buf.len() + slice.len() > limit {
            self.at = None;
            return Err(bad(&format!("more than {limit} bytes")));
        }
        buf.extend_from_slice(slice);
        if f.flags & FLAG_PART_LAST == 0 {
            return Ok(None);
        }
        let Some((id, buf)) = self.at.take() else {
            return Err(bad("no frame"));
        };
        let limits = Limits {
            max_payload: MAX_JOINED as u32,
            ..Limits::default()
        };
        match Frame::decode(&buf, &limits) {
            Ok(Some((whole, used))) if used == buf.len() && whole.call_id == id => {
                if whole.kind == Kind::Part {
                    return Err(bad("a part inside a part"));
                }
                Ok(Some(whole))
            }
            Ok(_) => Err(bad("the parts do not make one frame of their call")),
            Err(e) => Err(bad(&e.to_string())),
        }
    }
}

/// The fuzz target `parts_join`: `data` as a peer's stream of frames fed
/// to a [`Joiner`], which must never panic and must give out only whole
/// frames that are not parts. Then the first whole frame found, split in
/// slices of a length the data picks, must join to itself.
pub fn fuzz_join(data: &[u8]) {
    let limits = Limits {
        max_payload: 1 << 16,
        ..Limits::default()
    };
    let mut j = Joiner::default();
    let (mut at, mut first) = (0, None);
    while at < data.len() {
        let Ok(Some((f, used))) = Frame::decode(&data[at..], &limits) else {
            break;
        };
        at += used;
        if f.kind != Kind::Part && first.is_none() {
            first = Some(f.clone());
        }
        if let Ok(Some(whole)) = j.take(f) {
            assert_ne!(whole.kind, Kind::Part, "a part given out");
        }
    }
    if let Some(f) = first {
        let slice = 1 + data.first().map_or(0, |&b| b as usize) * 16;
        let mut j = Joiner::default();
        let mut out = None;
        for p in split(&f, slice) {
            out = j.take(p).expect("parts of a frame join");
        }
        assert_eq!(out, Some(f), "a frame split and joined is itself");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Body, Status};

    fn big(len: usize) -> Frame {
        let v: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
        Frame::request(9, 3, 0, Body::Inline(v.into()))
    }

    #[test]
    fn a_frame_split_and_joined_is_the_same_frame() {
        for (len, slice) in [(1, 1000), (10_000, 1000), (10_000, 33), (1 << 20, 4096)] {
            let f = big(len);
            let parts = split(&f, slice);
            assert!(parts.len() > 1 || f.encoded_len() <= slice);
            let mut j = Joiner::default();
            let mut out = None;
            for (k, p) in parts.into_iter().enumerate() {
                assert!(out.is_none(), "whole before the last part");
                assert!(p.encoded_len() <= slice + HEADER_LEN);
                out = j.take(p).unwrap();
                assert!(k == 0 || out.is_some() || j.is_joining());
            }
            assert_eq!(out.unwrap(), f);
            assert!(!j.is_joining());
        }
    }

    #[test]
    fn a_frame_given_up_between_parts_is_dropped_and_the_next_one_passes() {
        let f = big(5000);
        let parts = split(&f, 1000);
        let mut j = Joiner::default();
        assert!(j.take(parts[0].clone()).unwrap().is_none());
        let next = Frame::response(4, Status::Ok, Body::None);
        assert_eq!(j.take(next.clone()).unwrap(), Some(next));
        assert!(!j.is_joining());
        // And a frame sent whole in parts afterwards is joined.
        let mut out = None;
        for p in split(&f, 1000) {
            out = j.take(p).unwrap();
        }
        assert_eq!(out, Some(f));
    }

    #[test]
    fn parts_that_break_the_protocol_are_errors() {
        let f = big(5000);
        let parts = split(&f, 1000);
        // A part before the first.
        assert!(Joiner::default().take(parts[1].clone()).is_err());
        // A part of another call.
        let mut j = Joiner::default();
        j.take(parts[0].clone()).unwrap();
        let mut other = parts[1].clone();
        other.call_id += 1;
        assert!(j.take(other).is_err());
        // The last part too soon: not one frame.
        let mut j = Joiner::default();
        j.take(parts[0].clone()).unwrap();
        let mut last = parts[1].clone();
        last.flags |= FLAG_PART_LAST;
        assert!(j.take(last).is_err());
        // Parts without bytes, or of a part.
        let mut j = Joiner::default();
        let mut empty = parts[0].clone();
        empty.payload = Body::None;
        assert!(j.take(empty).is_err());
        let inner = split(&parts[0], 1000);
        let mut j = Joiner::default();
        let mut r = Ok(None);
        for p in inner {
            r = j.take(p);
        }
        assert!(r.is_err(), "a part inside a part");
        // More than the bound: refused before it is gathered.
        let mut j = Joiner::default();
        let first = Frame::part(1, FLAG_PART_FIRST, Bytes::from(vec![0u8; 1 << 20]));
        j.take(first).unwrap();
        let mut refused = false;
        for _ in 0..80 {
            if j.take(Frame::part(1, 0, Bytes::from(vec![0u8; 1 << 20])))
                .is_err()
            {
                refused = true;
                break;
            }
        }
        assert!(refused);
    }
}
