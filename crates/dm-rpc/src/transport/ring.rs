//! A single-producer single-consumer byte ring in shared memory: the fast
//! path of a shared-memory connection. No locks: the producer owns `head`,
//! the consumer owns `tail`, each on its own cache line, and each side
//! caches the other's cursor so that a message in each direction costs one
//! cache-line transfer per cursor.
//!
//! Records are 8-byte aligned: `len: u32 | !len: u32 | len bytes | pad`. A
//! record never wraps; when the space left before the end is too small,
//! the producer writes a wrap marker (`u32::MAX | 0`) and starts at 0. So a
//! record is at most half the ring. Cursors are byte counts that only grow
//! (indices are `cursor & (size - 1)`).
//!
//! The consumer never trusts the peer: a head that runs ahead of the ring,
//! a length that does not match its complement or runs past the published
//! head is a [`RingError::Corrupt`], and records are copied out before they
//! are decoded, so a peer that scribbles on the ring cannot change bytes
//! under the decoder.
//!
//! Wake-ups follow [`crate::wait::Bell`]: after publishing, the producer
//! rings the consumer's bell; after consuming, the consumer rings the
//! producer's bell, which a producer parks on only when the ring is full.

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::wait::Bell;

/// Ring layout version (the record format and cursor layout above).
pub const RING_VERSION: u32 = 1;
const REC_HDR: usize = 8;
const WRAP: u32 = u32::MAX;

/// A value on its own cache line.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct Line<T>(pub T);

/// The shared cursors of one ring (192 bytes).
#[repr(C)]
#[derive(Debug, Default)]
pub struct RingControl {
    /// Bytes ever published by the producer.
    pub head: Line<AtomicU64>,
    /// Bytes ever consumed by the consumer.
    pub tail: Line<AtomicU64>,
    /// The producer's bell, rung by the consumer (the producer parks only
    /// when the ring is full).
    pub producer_bell: Line<AtomicU32>,
}

/// The ring's bytes.
pub trait RingData {
    /// Size in bytes (a power of two).
    fn size(&self) -> usize;
    /// Copies `src` into the ring at `at` (`at + src.len() <= size`).
    fn write(&self, at: usize, src: &[u8]);
    /// Copies ring bytes at `at` into `dst` (`at + dst.len() <= size`).
    fn read(&self, at: usize, dst: &mut [u8]);
}

/// Ring bytes in a shared mapping.
#[derive(Debug, Clone, Copy)]
pub struct RawData {
    base: *mut u8,
    size: usize,
}

// SAFETY: the bytes live in a shared mapping kept alive by the owner of the
// ring; accesses are split between one producer and one consumer by the
// cursor protocol.
unsafe impl Send for RawData {}

impl RawData {
    /// # Safety
    /// `base..base + size` must stay mapped and writable for the life of
    /// the value, and `size` must be a power of two.
    pub unsafe fn new(base: *mut u8, size: usize) -> Self {
        RawData { base, size }
    }
}

impl RingData for RawData {
    fn size(&self) -> usize {
        self.size
    }
    #[inline]
    fn write(&self, at: usize, src: &[u8]) {
        debug_assert!(at + src.len() <= self.size);
        // SAFETY: in bounds (callers keep records inside the ring); the
        // producer owns these bytes until it publishes them.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(at), src.len()) }
    }
    #[inline]
    fn read(&self, at: usize, dst: &mut [u8]) {
        debug_assert!(at + dst.len() <= self.size);
        // SAFETY: in bounds; the bytes were published by the producer (a
        // misbehaving peer can only change their values, which the
        // consumer validates after this copy).
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at), dst.as_mut_ptr(), dst.len()) }
    }
}

/// What went wrong with a ring.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// A record larger than half the ring.
    #[error("a record of {len} bytes does not fit a ring of {size} bytes (at most half)")]
    TooLarge {
        /// Record payload bytes.
        len: usize,
        /// Ring bytes.
        size: usize,
    },
    /// The peer broke the ring's invariants.
    #[error("ring corrupt: {0}")]
    Corrupt(String),
}

fn record_len(len: usize) -> usize {
    (REC_HDR + len + 7) & !7
}

/// The largest record payload a ring of `size` bytes takes.
pub fn max_record(size: usize) -> usize {
    size / 2 - REC_HDR
}

/// The producing end.
#[derive(Debug)]
pub struct Producer<'a, D> {
    ctl: &'a RingControl,
    data: D,
    consumer_bell: Bell<'a>,
    head: u64,
    tail_cache: u64,
}

impl<'a, D: RingData> Producer<'a, D> {
    /// Takes the producing end of a ring whose cursors are `ctl`.
    pub fn new(ctl: &'a RingControl, data: D, consumer_bell: &'a AtomicU32) -> Self {
        let head = ctl.head.0.load(Ordering::Relaxed);
        Producer {
            ctl,
            data,
            consumer_bell: Bell(consumer_bell),
            head,
            tail_cache: ctl.tail.0.load(Ordering::Acquire),
        }
    }

    /// The producer's bell (park on it when [`try_push`](Self::try_push) says full).
    pub fn bell(&self) -> Bell<'a> {
        Bell(&self.ctl.producer_bell.0)
    }

    /// Whether a record of `len` bytes would fit now.
    pub fn fits(&mut self, len: usize) -> bool {
        let size = self.data.size();
        let need = self.need(len);
        if self.free_space() >= need {
            return true;
        }
        self.tail_cache = self.ctl.tail.0.load(Ordering::Acquire);
        self.free_space() >= need && need <= size
    }

    fn free_space(&self) -> usize {
        let used = self.head.wrapping_sub(self.tail_cache) as usize;
        self.data.size().saturating_sub(used)
    }

    /// Bytes a record of `len` consumes, counting a wrap marker if needed.
    fn need(&self, len: usize) -> usize {
        let size = self.data.size();
        let idx = self.head as usize & (size - 1);
        let rec = record_len(len);
        if size - idx < rec {
            size - idx + rec
        } else {
            rec
        }
    }

    /// Publishes one record of `len` bytes written by `fill(put)`, where
    /// `put` appends bytes (exactly `len` in all). Returns `Ok(false)` if
    /// the ring is full (nothing written). Rings the consumer's bell.
    pub fn try_push(
        &mut self,
        len: usize,
        fill: impl FnOnce(&mut dyn FnMut(&[u8])),
    ) -> Result<bool, RingError> {
        let size = self.data.size();
        if len > max_record(size) {
            return Err(RingError::TooLarge { len, size });
        }
        if !self.fits(len) {
            return Ok(false);
        }
        let mut idx = self.head as usize & (size - 1);
        let rec = record_len(len);
        if size - idx < rec {
            let mut m = [0u8; REC_HDR];
            m[..4].copy_from_slice(&WRAP.to_le_bytes());
            self.data.write(idx, &m);
            self.head += (size - idx) as u64;
            idx = 0;
        }
        let mut h = [0u8; REC_HDR];
        h[..4].copy_from_slice(&(len as u32).to_le_bytes());
        h[4..].copy_from_slice(&(!(len as u32)).to_le_bytes());
        self.data.write(idx, &h);
        let mut at = idx + REC_HDR;
        let end = at + len;
        let data = &self.data;
        let mut put = |b: &[u8]| {
            let n = b.len().min(end - at);
            data.write(at, &b[..n]);
            at += n;
        };
        fill(&mut put);
        if at != end {
            // The caller wrote fewer bytes than it announced: zero the rest
            // so the record is still well-formed (the decoder rejects it).
            let zeros = [0u8; 64];
            while at < end {
                let n = (end - at).min(64);
                self.data.write(at, &zeros[..n]);
                at += n;
            }
        }
        self.head += rec as u64;
        self.ctl.head.0.store(self.head, Ordering::Release);
        self.consumer_bell.ring();
        Ok(true)
    }
}

/// The consuming end.
#[derive(Debug)]
pub struct Consumer<'a, D> {
    ctl: &'a RingControl,
    data: D,
    tail: u64,
    head_cache: u64,
}

impl<'a, D: RingData> Consumer<'a, D> {
    /// Takes the consuming end of a ring whose cursors are `ctl`.
    pub fn new(ctl: &'a RingControl, data: D) -> Self {
        let tail = ctl.tail.0.load(Ordering::Relaxed);
        Consumer {
            ctl,
            data,
            tail,
            head_cache: tail,
        }
    }

    /// Whether a record may be waiting (one load when none is cached).
    #[inline]
    pub fn ready(&mut self) -> bool {
        if self.head_cache != self.tail {
            return true;
        }
        self.head_cache = self.ctl.head.0.load(Ordering::Acquire);
        self.head_cache != self.tail
    }

    /// Copies the next record into `out` (replacing its contents) and frees
    /// its space. `Ok(false)` if the ring is empty.
    pub fn try_pop(&mut self, out: &mut Vec<u8>) -> Result<bool, RingError> {
        let size = self.data.size();
        loop {
            if !self.ready() {
                return Ok(false);
            }
            let avail = self.head_cache.wrapping_sub(self.tail);
            if avail > size as u64 || !avail.is_multiple_of(8) {
                return Err(RingError::Corrupt(format!(
                    "head {} is {avail} bytes past tail {} in a ring of {size}",
                    self.head_cache, self.tail
                )));
            }
            let idx = self.tail as usize & (size - 1);
            let mut h = [0u8; REC_HDR];
            self.data.read(idx, &mut h);
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
            let chk = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
            if len == WRAP && chk == 0 {
                let skip = (size - idx) as u64;
                if skip > avail {
                    return Err(RingError::Corrupt("wrap marker past the head".into()));
                }
                self.tail += skip;
                continue;
            }
            let rec = record_len(len as usize);
            if chk != !len
                || len as usize > max_record(size)
                || rec as u64 > avail
                || idx + rec > size
            {
                return Err(RingError::Corrupt(format!(
                    "record at {idx}: length {len} (check {chk:#x}) with {avail} bytes published"
                )));
            }
            out.clear();
            out.resize(len as usize, 0);
            self.data.read(idx + REC_HDR, out);
            self.tail += rec as u64;
            self.ctl.tail.0.store(self.tail, Ordering::Release);
            Bell(&self.ctl.producer_bell.0).ring();
            return Ok(true);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    struct VecData(std::cell::RefCell<Vec<u8>>);
    impl RingData for VecData {
        fn size(&self) -> usize {
            self.0.borrow().len()
        }
        fn write(&self, at: usize, src: &[u8]) {
            self.0.borrow_mut()[at..at + src.len()].copy_from_slice(src);
        }
        fn read(&self, at: usize, dst: &mut [u8]) {
            dst.copy_from_slice(&self.0.borrow()[at..at + dst.len()]);
        }
    }

    fn push(p: &mut Producer<'_, &VecData>, msg: &[u8]) -> bool {
        p.try_push(msg.len(), |put| put(msg))
            .expect("fits half the ring")
    }

    impl RingData for &VecData {
        fn size(&self) -> usize {
            (*self).size()
        }
        fn write(&self, at: usize, src: &[u8]) {
            (*self).write(at, src)
        }
        fn read(&self, at: usize, dst: &mut [u8]) {
            (*self).read(at, dst)
        }
    }

    proptest! {
        /// Any interleaving of pushes and pops delivers every accepted
        /// record once, in order, intact; a full ring refuses, never drops.
        #[test]
        fn fifo_in_order(ops in proptest::collection::vec((any::<bool>(), 0usize..200), 1..300)) {
            let ctl = RingControl::default();
            let bell = AtomicU32::new(0);
            let data = VecData(std::cell::RefCell::new(vec![0u8; 512]));
            let mut p = Producer::new(&ctl, &data, &bell);
            let mut c = Consumer::new(&ctl, &data);
            let mut model = std::collections::VecDeque::new();
            let mut n = 0u8;
            let mut out = Vec::new();
            for (is_push, len) in ops {
                if is_push {
                    n = n.wrapping_add(1);
                    let msg = vec![n; len];
                    if push(&mut p, &msg) {
                        model.push_back(msg);
                    } else {
                        prop_assert!(!model.is_empty(), "an empty ring takes any record up to half its size");
                    }
                } else {
                    let got = c.try_pop(&mut out).unwrap();
                    prop_assert_eq!(got, !model.is_empty());
                    if got {
                        prop_assert_eq!(&out, &model.pop_front().unwrap());
                    }
                }
            }
        }

        /// Garbage cursors or records from a peer are errors, never panics.
        #[test]
        fn scribbled_ring_is_rejected_not_trusted(head: u64, bytes in proptest::collection::vec(any::<u8>(), 64)) {
            let ctl = RingControl::default();
            let data = VecData(std::cell::RefCell::new(vec![0u8; 64]));
            data.write(0, &bytes);
            ctl.head.0.store(head, Ordering::Relaxed);
            let mut c = Consumer::new(&ctl, &data);
            let mut out = Vec::new();
            for _ in 0..10 {
                match c.try_pop(&mut out) {
                    Ok(true) => prop_assert!(out.len() <= max_record(64)),
                    Ok(false) | Err(_) => break,
                }
            }
        }
    }

    #[test]
    fn too_large_and_wrap() {
        let ctl = RingControl::default();
        let bell = AtomicU32::new(0);
        let data = VecData(std::cell::RefCell::new(vec![0u8; 256]));
        let mut p = Producer::new(&ctl, &data, &bell);
        let mut c = Consumer::new(&ctl, &data);
        assert!(matches!(
            p.try_push(200, |_| {}),
            Err(RingError::TooLarge { .. })
        ));
        let mut out = Vec::new();
        for i in 0..100u8 {
            assert!(push(&mut p, &[i; 90]));
            assert!(c.try_pop(&mut out).unwrap());
            assert_eq!(out, vec![i; 90]);
        }
        // A short fill is zero-padded, still one record.
        assert!(p.try_push(10, |put| put(&[1, 2])).unwrap());
        assert!(c.try_pop(&mut out).unwrap());
        assert_eq!(out, [1, 2, 0, 0, 0, 0, 0, 0, 0, 0]);
    }
}
