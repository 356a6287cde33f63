//! A single-producer single-consumer byte ring in shared memory: the fast
//! path of a shared-memory connection. No locks, and one cache-line
//! transfer per small message: the consumer learns that a record is there
//! from the record's own header, which sits on the same cache line as the
//! start of its bytes, rather than from a separate head cursor.
//!
//! Records start on 64-byte boundaries: `header: u64 | len bytes | pad`.
//! The header is `len: u32 | tag: u32` with `tag = !len ^ lap`, where `lap`
//! is the record's cursor divided by the ring size, so a record left from
//! an earlier lap never looks ready. The producer writes the bytes, then the
//! header with one Release store; the consumer loads the header at its
//! cursor with Acquire and, if the tag matches, copies the record out. A
//! record never wraps: when the space left before the end is too small, the
//! producer writes a wrap marker (`len = u32::MAX`) and starts at 0, so a
//! record is at most half the ring. Before the consumer frees the space of
//! records it copied out (or wrap markers it skipped), it zeroes every
//! 64-byte slot start in it: so every slot start the consumer will ever
//! look at is either zero or written by the producer in the current lap,
//! never a leftover of an earlier lap (whose bytes, part old header and
//! part old payload, could otherwise pass for a ready header). Cursors are
//! byte counts that only grow (indices are `cursor & (size - 1)`); the
//! consumer publishes `tail` so the producer knows what space is free, and
//! the producer publishes `head` for inspection only.
//!
//! A producer also starts the next lap early: past the ring's hot window
//! ([`HOT_WINDOW`], 64 KiB), if it finds its ring empty (every
//! record taken and freed) and the record fits before its place, it
//! writes the record at 0 and a wrap marker at its place. (Every wrap
//! marker is published after the record it leads to: a consumer that sees
//! one finds a record behind it.) So while the consumer
//! keeps up, records cycle through the window's lines, which stay cached
//! on both cores, instead of walking the whole ring (a large ring's lines
//! are cold by the time a lap comes back to them: through a chain of
//! seven processes with 8 calls in flight, an inline 64 KiB payload took
//! 2.5x as long over 4 MiB rings, 1.9x over the default 256 KiB ones, and
//! with 16 in flight a Ref's small records 7% longer over 4 MiB rings;
//! `examples/chain_loop`, 2026-11-27). The bytes skipped
//! stay taken until the consumer passes the marker, so a producer that
//! promised room (a server's room for the answers it owes) says how much
//! must stay free besides ([`Producer::keep_free`]). The consumer frees
//! the marker's slot alone, not the slots it skips: those hold zero
//! already (the producer skips only free space, which the consumer
//! zeroed when it freed it).
//!
//! The consumer frees what it took when it next finds its ring empty (it
//! is about to wait, off the critical path of a round trip), or once it
//! owes a batch (`FREE_BATCH`, an eighth of a small ring), not after each
//! record: the zeroing store goes to the line the producer's core just
//! wrote, so it waits in the store buffer for that line, and every locked
//! instruction of the taker's next steps (a mutex, a counter) waited for
//! it in turn (`examples/noop_loop`, a no-op call: 7% faster).
//!
//! The consumer never trusts the peer: a ready header whose length runs
//! past the ring or exceeds half of it is a [`RingError::Corrupt`], and
//! records are copied out before they are decoded, so a peer that scribbles
//! on the ring cannot change bytes under the decoder.
//!
//! Wake-ups follow [`crate::wait::Bell`]: after publishing, the producer
//! rings the consumer's bell; after consuming, the consumer rings the
//! producer's bell lazily (no fence: it may miss a producer that parks at
//! that instant), which a producer parks on only when the ring is full. The
//! first time the consumer then finds its ring empty it rings the
//! producer's bell once more, with the fence: a producer waiting for room
//! is never left parked once the consumer has caught up (a fence per
//! drained ring, not per record, and off the critical path: the consumer
//! has nothing to do). A producer still parks in short slices, which bound
//! the wait for room freed by a consumer that has not caught up yet.

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::wait::Bell;

/// Ring layout version (the record format and cursor layout above). Its
/// history is in `CHANGELOG.md`.
pub const RING_VERSION: u32 = 4;
const REC_HDR: usize = 8;
const REC_ALIGN: usize = 64;
const WRAP: u32 = u32::MAX;

/// A value on its own cache line.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct Line<T>(pub T);

/// The shared cursors of one ring (192 bytes).
#[repr(C)]
#[derive(Debug, Default)]
pub struct RingControl {
    /// Bytes ever published by the producer (for inspection).
    pub head: Line<AtomicU64>,
    /// Bytes ever consumed by the consumer.
    pub tail: Line<AtomicU64>,
    /// The producer's bell, rung by the consumer (the producer parks only
    /// when the ring is full), unless both ends agree on another word
    /// ([`Producer::room_bell`], [`Consumer::room_bell`]).
    pub producer_bell: Line<AtomicU32>,
}

/// The ring's bytes.
pub trait RingData {
    /// Size in bytes (a power of two, at least 4 KiB in real rings).
    fn size(&self) -> usize;
    /// Copies `src` into the ring at `at` (`at + src.len() <= size`).
    fn write(&self, at: usize, src: &[u8]);
    /// Copies ring bytes at `at` into `dst` (`at + dst.len() <= size`).
    fn read(&self, at: usize, dst: &mut [u8]);
    /// Replaces the contents of `out` with the `n` ring bytes at `at`.
    fn read_vec(&self, at: usize, n: usize, out: &mut Vec<u8>) {
        out.clear();
        out.resize(n, 0);
        self.read(at, out);
    }
    /// Stores the 8-byte-aligned word at `at` with Release ordering.
    fn store_word(&self, at: usize, v: u64);
    /// Loads the 8-byte-aligned word at `at` with Acquire ordering.
    fn load_word(&self, at: usize) -> u64;
}

/// Ring bytes in a shared mapping.
#[derive(Debug, Clone, Copy)]
pub struct RawData {
    base: *mut u8,
    size: usize,
}

// SAFETY: the bytes live in a shared mapping kept alive by the owner of the
// ring; accesses are split between one producer and one consumer by the
// record protocol.
unsafe impl Send for RawData {}

impl RawData {
    /// # Safety
    /// `base..base + size` must stay mapped and writable for the life of
    /// the value, `base` must be 64-byte aligned and `size` a power of two.
    pub unsafe fn new(base: *mut u8, size: usize) -> Self {
        RawData { base, size }
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at.is_multiple_of(8) && at + 8 <= self.size);
        // SAFETY: in bounds and aligned (callers pass record starts, which
        // are 64-byte aligned in a 64-byte aligned ring); any bits are a
        // valid AtomicU64.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
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
    #[inline]
    fn read_vec(&self, at: usize, n: usize, out: &mut Vec<u8>) {
        debug_assert!(at + n <= self.size);
        out.clear();
        out.reserve_exact(n);
        // SAFETY: in bounds as in `read`; `out` has room for `n` bytes,
        // which the copy initializes before the length covers them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(at), out.as_mut_ptr(), n);
            out.set_len(n);
        }
    }
    #[inline]
    fn store_word(&self, at: usize, v: u64) {
        self.word(at).store(v, Ordering::Release)
    }
    #[inline]
    fn load_word(&self, at: usize) -> u64 {
        self.word(at).load(Ordering::Acquire)
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

/// The ring bytes a record of `len` bytes takes (header and padding).
pub fn record_len(len: usize) -> usize {
    (REC_HDR + len + REC_ALIGN - 1) & !(REC_ALIGN - 1)
}

/// The largest record payload a ring of `size` bytes takes. (With the
/// free slot, an empty ring still takes it wherever its head is: a wrap
/// skips at most a record less one slot.)
pub fn max_record(size: usize) -> usize {
    size / 2 - REC_HDR
}

/// The header of a record of `len` bytes at cursor `pos` of a ring of `size`.
/// (`size` is a power of two, so the lap is a shift: a division here cost a
/// fifth of the consumer's check for a ready record.)
pub fn header(len: u32, pos: u64, size: usize) -> u64 {
    debug_assert!(size.is_power_of_two());
    let lap = (pos >> size.trailing_zeros()) as u32;
    len as u64 | (((!len) ^ lap) as u64) << 32
}

/// The producing end.
#[derive(Debug)]
pub struct Producer<'a, D> {
    ctl: &'a RingControl,
    data: D,
    consumer_bell: Bell<'a>,
    /// Where this producer parks for room.
    room_bell: &'a AtomicU32,
    head: u64,
    tail_cache: u64,
    /// Bytes a push that starts the next lap early must leave free
    /// ([`keep_free`](Self::keep_free)).
    keep: usize,
    /// Past this offset, a push that finds the ring empty starts the next
    /// lap ([`hot_window`](Self::hot_window)).
    hot: usize,
}

impl<'a, D: RingData> Producer<'a, D> {
    /// Takes the producing end of a ring whose cursors are `ctl`.
    pub fn new(ctl: &'a RingControl, data: D, consumer_bell: &'a AtomicU32) -> Self {
        // A fresh ring starts at 0; a cursor a peer scribbled is realigned
        // so records stay aligned whatever it wrote.
        let head = ctl.head.0.load(Ordering::Relaxed) & !(REC_ALIGN as u64 - 1);
        Producer {
            ctl,
            data,
            consumer_bell: Bell(consumer_bell),
            room_bell: &ctl.producer_bell.0,
            head,
            tail_cache: ctl.tail.0.load(Ordering::Acquire),
            keep: 0,
            hot: HOT_WINDOW,
        }
    }

    /// Where the next record goes (a cursor: bytes ever published).
    pub fn position(&self) -> u64 {
        self.head
    }

    /// Parks for room on `bell` instead of the ring's own producer bell:
    /// for a producer whose thread also waits for other things on `bell`
    /// (a server waiting for requests and for room for their answers).
    /// The consumer must ring the same word ([`Consumer::room_bell`]).
    pub fn room_bell(mut self, bell: &'a AtomicU32) -> Self {
        self.room_bell = bell;
        self
    }

    /// The producer's bell (park on it when [`try_push`](Self::try_push) says full).
    pub fn bell(&self) -> Bell<'a> {
        Bell(self.room_bell)
    }

    /// Whether a record of `len` bytes would fit now.
    pub fn fits(&mut self, len: usize) -> bool {
        let need = self.need(len);
        self.fits_bytes(need)
    }

    /// Whether `need` bytes are free now (records of known lengths, with
    /// room for a wrap's skip counted in by the caller: a wrap skips at
    /// most a record less one slot).
    pub fn fits_bytes(&mut self, need: usize) -> bool {
        if self.free_space() >= need {
            return true;
        }
        self.tail_cache = self.ctl.tail.0.load(Ordering::Acquire);
        self.free_space() >= need
    }

    /// Starts a lap early past `bytes` instead of [`HOT_WINDOW`] (tests
    /// use small rings).
    pub fn hot_window(mut self, bytes: usize) -> Self {
        self.hot = bytes;
        self
    }

    /// Makes the next pushes start a lap early (see the module's doc) only
    /// if `bytes` stay free besides: room the caller has promised (a
    /// server's room for the answers it owes). An early start leaves the
    /// bytes it skips taken until the consumer passes its wrap marker.
    pub fn keep_free(&mut self, bytes: usize) {
        self.keep = bytes;
    }

    /// Whether the consumer has taken and freed every record (a fresh
    /// look at its cursor unless the last one said so).
    pub fn is_empty(&mut self) -> bool {
        if self.tail_cache != self.head {
            self.tail_cache = self.ctl.tail.0.load(Ordering::Acquire);
        }
        self.tail_cache == self.head
    }

    fn free_space(&self) -> usize {
        let used = self.head.wrapping_sub(self.tail_cache) as usize;
        self.data.size().saturating_sub(used)
    }

    /// Free bytes a record of `len` needs: itself, and a wrap marker's
    /// skip if it does not fit before the end.
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
        // Past the hot window, with everything taken (and freed), the
        // next lap starts now, while the record and what must stay free
        // fit before this place: the lines in use stay few, and cached.
        let early = idx >= self.hot && rec + self.keep <= idx && self.is_empty();
        // A wrap marker is published after the record it leads to (a
        // consumer that sees it finds the record behind it), at the cursor
        // it is written for.
        let mut marker = None;
        if early || size - idx < rec {
            marker = Some((idx, self.head));
            self.head = self.head.wrapping_add((size - idx) as u64);
            idx = 0;
        }
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
        self.data
            .store_word(idx, header(len as u32, self.head, size));
        if let Some((at, pos)) = marker {
            self.data.store_word(at, header(WRAP, pos, size));
        }
        crate::probe::stamp(crate::probe::PUBLISHED);
        self.head = self.head.wrapping_add(rec as u64);
        self.ctl.head.0.store(self.head, Ordering::Relaxed);
        self.consumer_bell.ring();
        Ok(true)
    }
}

/// The consuming end.
#[derive(Debug)]
pub struct Consumer<'a, D> {
    ctl: &'a RingControl,
    data: D,
    /// The next record's cursor.
    tail: u64,
    /// The cursor published to the producer: the records in
    /// `freed..tail` were taken but their space is not free yet (see
    /// [`free`](Self::free)).
    freed: u64,
    /// The producer's bell: where it parks for room.
    room_bell: &'a AtomicU32,
    /// Records were consumed since the producer's bell was last rung with
    /// the fence.
    owes_ring: bool,
}

/// Taken bytes a consumer frees at once, without waiting to find its ring
/// empty (a consumer that never catches up still frees space); an eighth
/// of a smaller ring.
const FREE_BATCH: u64 = 4096;

/// Past this offset a producer that finds its ring empty starts the next
/// lap at once, by default (see the module's doc): a quarter of the
/// default 256 KiB ring. Rings up to this size never start a lap early
/// (they stay cached anyway).
pub const HOT_WINDOW: usize = 64 << 10;

impl<'a, D: RingData> Consumer<'a, D> {
    /// Takes the consuming end of a ring whose cursors are `ctl`.
    pub fn new(ctl: &'a RingControl, data: D) -> Self {
        let tail = ctl.tail.0.load(Ordering::Relaxed) & !(REC_ALIGN as u64 - 1);
        Consumer {
            ctl,
            data,
            tail,
            freed: tail,
            room_bell: &ctl.producer_bell.0,
            owes_ring: false,
        }
    }

    /// Rings `bell` for room instead of the ring's own producer bell (the
    /// word the producer parks on: [`Producer::room_bell`]).
    pub fn room_bell(mut self, bell: &'a AtomicU32) -> Self {
        self.room_bell = bell;
        self
    }

    /// The header at the cursor, if a record (or wrap marker) of this lap
    /// is there: `Some(len)`.
    #[inline]
    fn peek(&self) -> Option<u32> {
        let size = self.data.size();
        let idx = self.tail as usize & (size - 1);
        let w = self.data.load_word(idx);
        let len = w as u32;
        (w == header(len, self.tail, size)).then_some(len)
    }

    /// Whether a record is waiting, changing nothing (one load of its
    /// header's line).
    #[inline]
    pub fn has_record(&self) -> bool {
        self.peek().is_some()
    }

    /// Whether a record is waiting (one load of its header's line).
    #[inline]
    pub fn ready(&mut self) -> bool {
        if self.peek().is_some() {
            return true;
        }
        self.caught_up();
        false
    }

    /// The ring is empty: wake a producer that parked for room while the
    /// lazy rings of the records consumed may have missed it.
    #[inline]
    fn caught_up(&mut self) {
        if self.freed != self.tail {
            self.free();
        }
        if self.owes_ring {
            self.owes_ring = false;
            Bell(self.room_bell).ring();
        }
    }

    /// Copies the next record into `out` (replacing its contents) and frees
    /// its space. `Ok(false)` if the ring is empty.
    pub fn try_pop(&mut self, out: &mut Vec<u8>) -> Result<bool, RingError> {
        self.pop_with(|d, at, len| d.read_vec(at, len, out))
    }

    /// Like [`try_pop`](Self::try_pop), with the record split as it is
    /// copied out: its first `head.len()` bytes (all of a shorter record)
    /// into `head`, the rest into `rest` (replacing its contents), so that
    /// a caller can keep the rest as it is. The record's length, or
    /// `Ok(None)` if the ring is empty.
    pub fn try_pop_split(
        &mut self,
        head: &mut [u8],
        rest: &mut Vec<u8>,
    ) -> Result<Option<usize>, RingError> {
        let mut got = None;
        self.pop_with(|d, at, len| {
            let h = len.min(head.len());
            d.read(at, &mut head[..h]);
            d.read_vec(at + h, len - h, rest);
            got = Some(len);
        })?;
        Ok(got)
    }

    /// Takes the next record: `copy(data, at, len)` copies its bytes out,
    /// then its space is freed. `Ok(false)` if the ring is empty.
    fn pop_with(&mut self, copy: impl FnOnce(&D, usize, usize)) -> Result<bool, RingError> {
        let size = self.data.size();
        loop {
            let Some(len) = self.peek() else {
                self.caught_up();
                return Ok(false);
            };
            let idx = self.tail as usize & (size - 1);
            if len == WRAP {
                if idx == 0 {
                    return Err(RingError::Corrupt("wrap marker at the ring's start".into()));
                }
                // Frees what came before and the marker's own slot, not
                // the slots it skips: every slot start there holds zero
                // already. The producer skips only free space (it counts
                // the skip in the room it needs, or it found its ring
                // empty), which this consumer zeroed when it freed it, or
                // which was never written since the channel was zeroed.
                // (A skip can be most of a large ring: a look at each of
                // its slots would cost a cache miss each.)
                self.zero_taken();
                self.data.write(idx, &[0u8; REC_HDR]);
                self.tail = self.tail.wrapping_add((size - idx) as u64);
                self.publish_freed();
                continue;
            }
            crate::probe::stamp(crate::probe::SEEN);
            let rec = record_len(len as usize);
            if len as usize > max_record(size) || idx + rec > size {
                return Err(RingError::Corrupt(format!(
                    "record at {idx} of {len} bytes runs past a ring of {size}"
                )));
            }
            copy(&self.data, idx + REC_HDR, len as usize);
            self.tail = self.tail.wrapping_add(rec as u64);
            if self.tail.wrapping_sub(self.freed) >= FREE_BATCH.min(size as u64 / 8) {
                self.free();
                Bell(self.room_bell).ring_lazy();
            }
            return Ok(true);
        }
    }

    /// Frees the space of the records taken since the last time: zeroes
    /// every slot start in it, so that none is left behind that could
    /// pass for a header in a later lap, then publishes the tail (a
    /// Release store, ordered after the zeroing). (Never the slots a wrap
    /// marker skips: see `pop_with`.)
    fn free(&mut self) {
        self.zero_taken();
        self.publish_freed();
    }

    /// Zeroes every slot start of the records taken since the last free.
    fn zero_taken(&mut self) {
        let size = self.data.size();
        let mut at = self.freed;
        while at != self.tail {
            let idx = at as usize & (size - 1);
            // A slot start inside a record may hold zero already: read
            // before writing, so as not to take its line for nothing.
            if self.data.load_word(idx) != 0 {
                self.data.write(idx, &[0u8; REC_HDR]);
            }
            at = at.wrapping_add(REC_ALIGN as u64);
        }
    }

    /// Publishes the tail: everything before it is free (zeroed first).
    fn publish_freed(&mut self) {
        self.freed = self.tail;
        self.ctl.tail.0.store(self.tail, Ordering::Release);
        self.owes_ring = true;
    }
}

/// Ring bytes in ordinary memory, for tests and fuzzing of one thread.
#[doc(hidden)]
#[cfg(not(loom))]
#[derive(Debug)]
pub struct HeapRing(std::cell::RefCell<Vec<u8>>);

#[cfg(not(loom))]
impl HeapRing {
    /// A ring over `bytes` (its length a power of two).
    pub fn new(bytes: Vec<u8>) -> Self {
        HeapRing(std::cell::RefCell::new(bytes))
    }
}

#[cfg(not(loom))]
impl RingData for &HeapRing {
    fn size(&self) -> usize {
        self.0.borrow().len()
    }
    fn write(&self, at: usize, src: &[u8]) {
        self.0.borrow_mut()[at..at + src.len()].copy_from_slice(src);
    }
    fn read(&self, at: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.0.borrow()[at..at + dst.len()]);
    }
    fn store_word(&self, at: usize, v: u64) {
        self.write(at, &v.to_le_bytes());
    }
    fn load_word(&self, at: usize) -> u64 {
        let mut b = [0u8; 8];
        self.read(at, &mut b);
        u64::from_le_bytes(b)
    }
}

/// Fuzzing entry: `data` is a peer's view of a 1 KiB request ring (8 bytes
/// of consumer cursor, then the ring's bytes); the consumer takes records
/// and decodes each as a frame, as the server does. Must never panic.
#[doc(hidden)]
#[cfg(not(loom))]
pub fn fuzz_consume(data: &[u8]) {
    let mut cur = [0u8; 8];
    let n = data.len().min(8);
    cur[..n].copy_from_slice(&data[..n]);
    let mut ring = vec![0u8; 1024];
    let rest = data.get(8..).unwrap_or(&[]);
    let m = rest.len().min(1024);
    ring[..m].copy_from_slice(&rest[..m]);
    let mem = HeapRing::new(ring);
    let ctl = RingControl::default();
    ctl.tail.0.store(u64::from_le_bytes(cur), Ordering::Relaxed);
    let mut c = Consumer::new(&ctl, &mem);
    let limits = crate::frame::Limits {
        max_payload: max_record(1024) as u32,
        ..Default::default()
    };
    let (mut head, mut rest) = ([0u8; crate::frame::HEADER_LEN], Vec::new());
    for _ in 0..64 {
        match c.try_pop_split(&mut head, &mut rest) {
            Ok(Some(len)) => {
                assert!(len <= max_record(1024));
                assert_eq!(len, len.min(head.len()) + rest.len());
                let h = &head[..len.min(head.len())];
                let _ = crate::frame::Frame::decode_record(h, &mut rest, &limits);
            }
            Ok(None) | Err(_) => break,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn push(p: &mut Producer<'_, &HeapRing>, msg: &[u8]) -> bool {
        p.try_push(msg.len(), |put| put(msg))
            .expect("fits half the ring")
    }

    proptest! {
        /// Any interleaving of pushes and pops delivers every accepted
        /// record once, in order, intact; a full ring refuses, never drops.
        #[test]
        fn fifo_in_order(ops in proptest::collection::vec((any::<bool>(), 0usize..249), 1..300)) {
            let ctl = RingControl::default();
            let bell = AtomicU32::new(0);
            let data = HeapRing::new(vec![0u8; 512]);
            // (A lap starts early past a quarter of the ring.)
            let mut p = Producer::new(&ctl, &data, &bell).hot_window(128);
            let mut c = Consumer::new(&ctl, &data);
            let mut model = std::collections::VecDeque::new();
            let mut n = 0u8;
            let mut out = Vec::new();
            // The consumer found the ring empty since it last took a
            // record (and so freed the space of all it took).
            let mut caught_up = true;
            for (is_push, len) in ops {
                if is_push {
                    n = n.wrapping_add(1);
                    let msg = vec![n; len];
                    if push(&mut p, &msg) {
                        model.push_back(msg);
                    } else {
                        prop_assert!(
                            !(model.is_empty() && caught_up),
                            "an empty ring takes any record up to half its size"
                        );
                    }
                } else {
                    let got = c.try_pop(&mut out).unwrap();
                    prop_assert_eq!(got, !model.is_empty());
                    caught_up = !got;
                    if got {
                        prop_assert_eq!(&out, &model.pop_front().unwrap());
                    } else {
                        // Caught up, the consumer freed all it took: no
                        // slot start holds anything, skipped ones included
                        // (which it frees without a look).
                        for at in (0..512).step_by(REC_ALIGN) {
                            prop_assert_eq!((&data).load_word(at), 0, "slot {}", at);
                        }
                    }
                }
            }
        }

        /// Garbage cursors or records from a peer are errors, never panics.
        #[test]
        fn scribbled_ring_is_rejected_not_trusted(tail: u64, len: u32, bytes in proptest::collection::vec(any::<u8>(), 256)) {
            let ctl = RingControl::default();
            let data = HeapRing::new(bytes);
            ctl.tail.0.store(tail, Ordering::Relaxed);
            let mut c = Consumer::new(&ctl, &data);
            // Also a header that is ready for this lap, with any length.
            let at = c.tail as usize & 255;
            (&data).store_word(at, header(len, c.tail, 256));
            let mut out = Vec::new();
            for _ in 0..10 {
                match c.try_pop(&mut out) {
                    Ok(true) => prop_assert!(out.len() <= max_record(256)),
                    Ok(false) | Err(_) => break,
                }
            }
        }
    }

    /// Past the hot window a producer that finds its ring empty starts the
    /// next lap: records cycle through the window's lines. Not while the
    /// consumer has records to take, nor when the room it must keep would
    /// not stay free.
    #[test]
    fn an_empty_ring_past_its_hot_window_starts_the_next_lap() {
        let ctl = RingControl::default();
        let bell = AtomicU32::new(0);
        let data = HeapRing::new(vec![0u8; 4096]);
        let mut p = Producer::new(&ctl, &data, &bell).hot_window(1024);
        let mut c = Consumer::new(&ctl, &data);
        let msg = [7u8; 100]; // 128 bytes a record
        let mut out = Vec::new();
        let mut starts = Vec::new();
        for _ in 0..40 {
            assert!(push(&mut p, &msg));
            starts.push(p.position() - 128);
            assert!(c.try_pop(&mut out).unwrap());
            assert_eq!(out, msg);
            assert!(!c.try_pop(&mut out).unwrap()); // caught up: freed
        }
        // Eight records from 0 to 896, then the next lap at 0: forty
        // records in five laps, all inside the window.
        assert_eq!(starts[7], 896);
        assert_eq!(starts[8], 4096);
        assert_eq!(starts[39], 4 * 4096 + 896);
        assert!(starts.iter().all(|s| s % 4096 < 1024));
        // The first of these starts a lap (the ring is empty); the bytes it
        // skips stay taken until the consumer passes its marker, so eight
        // fit (0 to 896), and a ninth only once the consumer took one.
        assert_eq!(p.position() % 4096, 1024);
        for _ in 0..8 {
            assert!(push(&mut p, &msg));
        }
        assert!(!push(&mut p, &msg));
        assert!(c.try_pop(&mut out).unwrap());
        // With records not taken yet, the lap goes on past the window.
        assert!(push(&mut p, &msg));
        assert!(push(&mut p, &msg));
        assert_eq!(p.position() % 4096, 1280);
        for _ in 0..9 {
            assert!(c.try_pop(&mut out).unwrap());
        }
        assert!(!c.try_pop(&mut out).unwrap());
        // Caught up, but the room to keep would not stay free before
        // this place: the lap goes on too.
        p.keep_free(1280);
        assert!(push(&mut p, &msg));
        assert_eq!(p.position() % 4096, 1408);
        p.keep_free(0);
        assert!(c.try_pop(&mut out).unwrap());
        assert!(!c.try_pop(&mut out).unwrap());
        assert!(push(&mut p, &msg));
        assert_eq!(p.position() % 4096, 128);
        assert!(c.try_pop(&mut out).unwrap());
        assert!(!c.try_pop(&mut out).unwrap());
        for at in (0..4096).step_by(REC_ALIGN) {
            assert_eq!((&data).load_word(at), 0, "slot {at}");
        }
    }

    /// The sequence proptest found against ring v2: a slot start left over
    /// from earlier laps (the last payload byte of one record over the rest
    /// of an older header) passed for a ready header. Consumers now zero the
    /// slot starts of what they consume.
    #[test]
    fn a_stale_slot_is_never_taken_for_a_header() {
        const OPS: &[(bool, usize)] = &[
            (true, 57),
            (true, 57),
            (false, 0),
            (true, 121),
            (true, 57),
            (true, 0),
            (false, 0),
            (false, 0),
            (false, 0),
            (true, 0),
            (true, 57),
            (true, 57),
            (true, 57),
            (true, 0),
            (true, 0),
            (false, 0),
            (false, 0),
            (true, 121),
            (true, 0),
            (false, 0),
            (true, 0),
            (false, 0),
            (false, 0),
            (true, 185),
            (false, 0),
            (true, 57),
            (false, 0),
            (true, 121),
            (true, 0),
            (true, 0),
            (false, 0),
            (false, 0),
            (false, 0),
            (true, 0),
            (true, 185),
            (true, 0),
            (false, 0),
            (true, 57),
            (false, 0),
            (true, 0),
            (true, 0),
            (false, 0),
            (false, 0),
            (true, 121),
            (true, 57),
            (false, 0),
            (true, 57),
            (false, 0),
            (true, 57),
            (true, 0),
            (true, 57),
            (true, 0),
            (true, 0),
            (true, 0),
            (false, 0),
            (true, 57),
            (false, 0),
            (true, 57),
            (true, 0),
            (false, 0),
            (false, 0),
            (true, 0),
            (false, 0),
            (true, 0),
            (true, 0),
            (true, 121),
            (false, 0),
            (true, 47),
            (false, 0),
            (false, 0),
            (false, 0),
            (true, 0),
            (true, 57),
            (false, 0),
            (false, 0),
            (true, 185),
            (false, 0),
            (false, 0),
            (true, 121),
            (false, 0),
            (true, 57),
            (false, 0),
            (false, 0),
        ];
        let ctl = RingControl::default();
        let bell = AtomicU32::new(0);
        let data = HeapRing::new(vec![0u8; 512]);
        let mut p = Producer::new(&ctl, &data, &bell);
        let mut c = Consumer::new(&ctl, &data);
        let mut model = std::collections::VecDeque::new();
        let (mut n, mut out) = (0u8, Vec::new());
        for &(is_push, len) in OPS {
            if is_push {
                n = n.wrapping_add(1);
                if push(&mut p, &vec![n; len]) {
                    model.push_back(vec![n; len]);
                }
            } else {
                let got = c.try_pop(&mut out).unwrap();
                assert_eq!(got, !model.is_empty(), "a record out of nowhere");
                if got {
                    assert_eq!(out, model.pop_front().unwrap());
                }
            }
        }
    }

    #[test]
    fn space_is_freed_when_the_consumer_finds_its_ring_empty() {
        let ctl = RingControl::default();
        let bell = AtomicU32::new(0);
        let data = HeapRing::new(vec![0u8; 64 << 10]);
        let mut p = Producer::new(&ctl, &data, &bell);
        let mut c = Consumer::new(&ctl, &data);
        let mut out = Vec::new();
        let n = if cfg!(miri) { 300 } else { 3000u32 };
        for i in 0..n {
            assert!(push(&mut p, &i.to_le_bytes()));
            let freed = ctl.tail.0.load(Ordering::Relaxed);
            assert!(c.try_pop(&mut out).unwrap());
            assert_eq!(out, i.to_le_bytes());
            // Taken, but not freed while the taker acts on it (unless a
            // batch's worth is owed)...
            let owed = p.position() - freed;
            assert!(owed >= FREE_BATCH || ctl.tail.0.load(Ordering::Relaxed) == freed);
            // ...and freed, slot starts zeroed, once it finds nothing more.
            assert!(!c.ready());
            assert_eq!(ctl.tail.0.load(Ordering::Relaxed), p.position());
            let at = (p.position() - 64) as usize & ((64 << 10) - 1);
            assert_eq!((&data).load_word(at), 0);
        }
    }

    #[test]
    fn a_consumer_that_never_catches_up_still_frees_space() {
        // Two records in, one out, forever: the consumer never finds its
        // ring empty, yet the producer never stays full.
        let ctl = RingControl::default();
        let bell = AtomicU32::new(0);
        let data = HeapRing::new(vec![0u8; 16 << 10]);
        let mut p = Producer::new(&ctl, &data, &bell);
        let mut c = Consumer::new(&ctl, &data);
        let (mut out, mut sent, mut got) = (Vec::new(), 0u32, 0u32);
        let n = if cfg!(miri) { 200 } else { 2000 };
        for _ in 0..n {
            for _ in 0..2 {
                if push(&mut p, &sent.to_le_bytes().repeat(250)) {
                    sent += 1;
                }
            }
            assert!(c.try_pop(&mut out).unwrap());
            assert_eq!(out, got.to_le_bytes().repeat(250));
            got += 1;
        }
        assert_eq!(got, n);
        assert!(sent > n, "the producer stalled at {sent} records");
    }

    /// The real shared-memory accessors (`RawData`: plain copies for
    /// payloads, atomic words for headers and cursors) between a producer
    /// and a consumer on two threads: every record arrives intact and in
    /// order. Under Miri (`scripts/miri.sh`) this also checks that the
    /// record protocol orders every plain copy with the atomic that
    /// publishes or frees its bytes: a data race fails it there.
    #[test]
    fn raw_data_carries_records_between_two_threads() {
        const SIZE: usize = 4096;
        let n: u32 = if cfg!(miri) { 300 } else { 20_000 };
        let msg = |i: u32| i.to_le_bytes().repeat(1 + i as usize % 200);
        let layout = std::alloc::Layout::from_size_align(SIZE, 64).unwrap();
        // SAFETY: the size is not zero.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!base.is_null());
        // SAFETY: 64-byte aligned, SIZE (a power of two) bytes, freed
        // below, after both ends are done.
        let data = unsafe { RawData::new(base, SIZE) };
        let (ctl, bell) = (RingControl::default(), AtomicU32::new(0));
        let (ctl, bell) = (&ctl, &bell);
        std::thread::scope(|s| {
            s.spawn(move || {
                let mut p = Producer::new(ctl, data, bell);
                for i in 0..n {
                    let m = msg(i);
                    while !p.try_push(m.len(), |put| put(&m)).unwrap() {
                        std::thread::yield_now();
                    }
                }
            });
            let mut c = Consumer::new(ctl, data);
            let mut out = Vec::new();
            for i in 0..n {
                while !c.try_pop(&mut out).unwrap() {
                    std::thread::yield_now();
                }
                assert_eq!(out, msg(i), "record {i}");
            }
        });
        // SAFETY: allocated above with this layout; both ends are gone.
        unsafe { std::alloc::dealloc(base, layout) };
    }

    #[test]
    fn too_large_and_wrap() {
        let ctl = RingControl::default();
        let bell = AtomicU32::new(0);
        let data = HeapRing::new(vec![0u8; 256]);
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
            assert!(!c.ready());
            assert_eq!(ctl.tail.0.load(Ordering::Relaxed), p.position());
        }
        // A short fill is zero-padded, still one record.
        assert!(p.try_push(10, |put| put(&[1, 2])).unwrap());
        assert!(c.try_pop(&mut out).unwrap());
        assert_eq!(out, [1, 2, 0, 0, 0, 0, 0, 0, 0, 0]);
    }
}
