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

/// One part's record, written straight from its frame: its header, then
/// its slice of the frame's encoding.
pub(crate) struct PartRecord<'a> {
    f: &'a Frame,
    head: [u8; HEADER_LEN],
    /// The slice: bytes `lo..hi` of the frame's encoding.
    lo: usize,
    hi: usize,
}

impl PartRecord<'_> {
    /// The record's length.
    pub(crate) fn len(&self) -> usize {
        HEADER_LEN + self.hi - self.lo
    }

    /// Writes the record's bytes through `put`.
    pub(crate) fn fill(&self, put: &mut dyn FnMut(&[u8])) {
        put(&self.head);
        let (lo, hi, mut at) = (self.lo, self.hi, 0);
        self.f.encode_with(|piece: &[u8]| {
            let (a, b) = (at.max(lo), (at + piece.len()).min(hi));
            if a < b {
                put(&piece[a - at..b - at]);
            }
            at += piece.len();
        });
    }
}

/// The records of `f`'s parts, each carrying at most `slice` bytes of its
/// encoding (at least 1), written straight from the frame. The same bytes
/// as [`split`]'s frames encode, with no copy of the frame made first.
pub(crate) fn records(f: &Frame, slice: usize) -> impl Iterator<Item = PartRecord<'_>> {
    let slice = slice.max(1);
    let total = f.encoded_len();
    let n = total.div_ceil(slice);
    (0..n).map(move |k| {
        let (lo, hi) = (k * slice, ((k + 1) * slice).min(total));
        let mut flags = 0;
        if k == 0 {
            flags |= FLAG_PART_FIRST;
        }
        if k + 1 == n {
            flags |= FLAG_PART_LAST;
        }
        let mut head = Frame::part(f.call_id, flags, Bytes::new()).header();
        head[24..28].copy_from_slice(&((hi - lo) as u32).to_le_bytes());
        PartRecord { f, head, lo, hi }
    })
}

/// The parts of `f` as frames, each carrying at most `slice` bytes of its
/// encoding (at least 1): what [`records`] writes.
#[cfg(test)]
fn split(f: &Frame, slice: usize) -> Vec<Frame> {
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
    /// The call id of the frame being gathered, its bytes past the header
    /// so far, and how many its header announces.
    at: Option<(u64, Vec<u8>, usize)>,
    /// The frame's header, once its first bytes came (the rest gathers
    /// in `at`, which becomes the payload without a copy).
    head: [u8; HEADER_LEN],
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
        let limits = Limits {
            max_payload: MAX_JOINED as u32,
            ..Limits::default()
        };
        let mut slice: &[u8] = slice;
        if f.flags & FLAG_PART_FIRST != 0 {
            // The whole frame's header: checked now, so that what it
            // announces (at most the limits) can be reserved at once.
            let Some(h) = slice.get(..HEADER_LEN) else {
                self.at = None;
                return Err(bad("a first part shorter than a header"));
            };
            if let Err(e) = Frame::decode(h, &limits) {
                self.at = None;
                return Err(bad(&e.to_string()));
            }
            self.head.copy_from_slice(h);
            let at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
            let rest = at(24) as usize + at(28) as usize;
            self.at = Some((f.call_id, Vec::with_capacity(rest), rest));
            slice = &slice[HEADER_LEN..];
        }
        let Some((id, buf, want)) = self.at.as_mut() else {
            return Err(bad("a part before the first"));
        };
        if *id != f.call_id {
            self.at = None;
            return Err(bad("a part of another call"));
        }
        if buf.len() + slice.len() > *want {
            self.at = None;
            return Err(bad("more bytes than its header announces"));
        }
        buf.extend_from_slice(slice);
        if f.flags & FLAG_PART_LAST == 0 {
            return Ok(None);
        }
        let Some((id, mut buf, _)) = self.at.take() else {
            return Err(bad("no frame"));
        };
        match Frame::decode_record(&self.head, &mut buf, &limits) {
            Ok(whole) if whole.call_id == id && whole.kind != Kind::Part => Ok(Some(whole)),
            Ok(_) => Err(bad("the parts make a part, or a frame of another call")),
            Err(e) => Err(bad(&e.to_string())),
        }
    }
}

/// The fuzz target `parts_join`: `data` as a peer's stream of frames fed
/// to a `Joiner`, which must never panic and must give out only whole
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
        for r in records(&f, slice) {
            let mut rec = Vec::new();
            r.fill(&mut |b: &[u8]| rec.extend_from_slice(b));
            let (p, _) = Frame::decode(&rec, &Limits::default())
                .ok()
                .flatten()
                .expect("a part decodes");
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
        // More bytes than the header announces: refused as they come.
        let mut j = Joiner::default();
        j.take(parts[0].clone()).unwrap();
        let extra = Frame::part(9, 0, Bytes::from(vec![0u8; 10_000]));
        assert!(j.take(extra).is_err());
        // A header announcing more than the bound: refused at the first part.
        let mut h = big(10).encode();
        h[24..28].copy_from_slice(&(MAX_JOINED as u32 + 1).to_le_bytes());
        let first = Frame::part(9, FLAG_PART_FIRST, Bytes::from(h));
        assert!(Joiner::default().take(first).is_err());
    }

    #[test]
    fn records_are_the_parts_written_straight_from_the_frame() {
        let meta = crate::metadata::Metadata::new()
            .with("k", b"value")
            .unwrap();
        let f = big(10_000).with_meta(meta);
        for slice in [1, 7, 1000, 9_999, 20_000] {
            let want: Vec<Vec<u8>> = split(&f, slice).iter().map(Frame::encode).collect();
            let got: Vec<Vec<u8>> = records(&f, slice)
                .map(|r| {
                    let mut v = Vec::new();
                    r.fill(&mut |b: &[u8]| v.extend_from_slice(b));
                    assert_eq!(v.len(), r.len());
                    v
                })
                .collect();
            assert_eq!(got, want, "slice {slice}");
        }
    }
}
