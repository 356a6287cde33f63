//! Large messages by Ref on the direct way, with no copy but the encode.
//!
//! The bytes between the processes stay a gRPC body (length-prefixed
//! messages): a large message is one payload, a pool buffer holding its
//! 5-byte prefix and the message. What changes is how tonic's codec meets
//! them, in each process, when the service or client uses [`Codec`]:
//!
//! * Sending: while the direct way polls a body tonic encodes, an
//!   [`Outbox`] is in reach of the encoder. A message above the node's
//!   inline threshold is encoded straight into a pool buffer, and the
//!   encoder writes a token in its place (a zero byte, which no protobuf
//!   message starts with, and 128 random bits). The direct way finds the
//!   token's frame in the body and sends the buffer instead.
//! * Receiving: a frame of at least [`VIEW_MIN`] bytes is handed to the
//!   decoder as a token too, and the message stays where it arrived (a
//!   view of the pool's pages). Only when the decoder that reads the body
//!   is a [`Codec`]'s: it says so just before each read ([`Codec`]'s
//!   `buffer_settings`), and a stock decoder, which does not, gets the
//!   bytes themselves.
//!
//! * Forwarding: a message that passes on a received `bytes` field is
//!   laid over the received pages instead (`forward.rs`).
//!
//! A token that is never claimed holds its buffer or view only until the
//! body that made it is dropped.
//!
//! [`Codec`]: crate::Codec

use bytes::{BufMut, Bytes};
use dm_pool::{Buffer, Pool};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// A token's length: the zero byte and the id.
pub(crate) const TOKEN_LEN: usize = 17;
/// gRPC's frame prefix: the compressed flag and the length.
const PREFIX: usize = 5;
/// The smallest received message handed over by view (a smaller one costs
/// tonic less to copy than its token costs to make).
pub(crate) const VIEW_MIN: usize = 16 << 10;
/// The largest: tonic's default limit on a received message, which a token
/// would bypass (a larger message goes as bytes, and tonic's own limit,
/// whatever it is set to, applies).
pub(crate) const VIEW_MAX: usize = 4 << 20;

fn token(id: u128) -> [u8; TOKEN_LEN] {
    let mut t = [0u8; TOKEN_LEN];
    t[1..].copy_from_slice(&id.to_le_bytes());
    t
}

fn new_id() -> u128 {
    u128::from(dm_sys::rand::random_u64()) << 64 | u128::from(dm_sys::rand::random_u64())
}

/// The id a token holds, if `msg` is one.
pub(crate) fn token_id(msg: &[u8]) -> Option<u128> {
    match msg {
        [0, id @ ..] if id.len() == TOKEN_LEN - 1 => Some(u128::from_le_bytes(id.try_into().ok()?)),
        _ => None,
    }
}

/// Where a body's large messages are encoded, while the direct way polls
/// it: the node's pool, its threshold, and the buffers encoded since.
pub(crate) struct Outbox {
    pool: Pool,
    /// Messages (with their prefix) larger than this go into the pool.
    inline_max: usize,
    made: Vec<(u128, Buffer)>,
    frames: Frames,
}

thread_local! {
    static OUTBOX: RefCell<Option<Outbox>> = const { RefCell::new(None) };
    /// Set by a [`crate::Codec`]'s decoder just before tonic reads the body
    /// it decodes. The body's read takes it.
    static VIEWS_WANTED: Cell<bool> = const { Cell::new(false) };
}

/// A piece of a body as the direct way sends it.
pub(crate) enum Part {
    Bytes(Bytes),
    Pool(Buffer),
}

/// Parts of a body, most often one: that one is kept without an
/// allocation (a call's message, its answer), a second makes a list.
#[derive(Default)]
pub(crate) struct Parts {
    first: Option<Part>,
    more: Vec<Part>,
}

impl Parts {
    fn one(p: Part) -> Parts {
        Parts {
            first: Some(p),
            more: Vec::new(),
        }
    }

    /// How many.
    pub(crate) fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.more.len()
    }

    /// The first, taken out of them.
    pub(crate) fn take_first(&mut self) -> Option<Part> {
        let f = self.first.take();
        if f.is_some() && !self.more.is_empty() {
            self.first = Some(self.more.remove(0));
        }
        f
    }

    /// Adds `other`'s at the end.
    pub(crate) fn append(&mut self, other: Parts) {
        for p in other {
            match self.first {
                None => self.first = Some(p),
                Some(_) => self.more.push(p),
            }
        }
    }
}

impl IntoIterator for Parts {
    type Item = Part;
    type IntoIter = std::iter::Chain<std::option::IntoIter<Part>, std::vec::IntoIter<Part>>;
    fn into_iter(self) -> Self::IntoIter {
        self.first.into_iter().chain(self.more)
    }
}

impl Outbox {
    /// An outbox for `node`, or none if its payloads all go inline.
    pub(crate) fn new(node: &dm_rpc::Node) -> Option<Outbox> {
        let cfg = node.config();
        (!cfg.by_value).then(|| Outbox {
            pool: node.pool().clone(),
            inline_max: cfg.inline_max,
            made: Vec::new(),
            frames: Frames::default(),
        })
    }

    /// Runs `f` (which polls a body tonic encodes) with `this` in reach of
    /// the encoder.
    pub(crate) fn lend<R>(this: &mut Option<Outbox>, f: impl FnOnce() -> R) -> R {
        if this.is_none() {
            return f();
        }
        let before = OUTBOX.replace(this.take());
        let r = f();
        *this = OUTBOX.replace(before);
        r
    }

    /// `chunk` of the body, with each token's frame swapped for the buffer
    /// it stands for.
    pub(crate) fn parts(this: &mut Option<Outbox>, chunk: Bytes) -> Parts {
        let Some(ob) = this else {
            return Parts::one(Part::Bytes(chunk));
        };
        if ob.made.is_empty() {
            // (No token in it: only where its frames end is kept.)
            ob.frames.walk(&chunk, |_, _| {});
            return Parts::one(Part::Bytes(chunk));
        }
        let made = &mut ob.made;
        let mut v = ob
            .frames
            .split(
                chunk,
                |flag, msg| {
                    let id = token_id(msg).filter(|_| flag == 0)?;
                    let at = made.iter().position(|(m, _)| *m == id)?;
                    Some(Part::Pool(made.swap_remove(at).1))
                },
                Part::Bytes,
            )
            .into_iter();
        Parts {
            first: v.next(),
            more: v.collect(),
        }
    }
}

/// Encodes `msg` (of encoded length `len`) into the pool if an outbox
/// is lent and it is large enough, and gives the token that stands for
/// it.
pub(crate) fn encode_in_pool<M: prost::Message>(msg: &M, len: usize) -> Option<[u8; TOKEN_LEN]> {
    OUTBOX.with_borrow_mut(|ob| {
        let ob = ob.as_mut()?;
        let total = PREFIX + len;
        if total <= ob.inline_max || u32::try_from(len).is_err() {
            return None;
        }
        // (A pool out of space, or a quota: the message goes inline.)
        if let Some(buf) = super::forward::lay_over(msg, len) {
            let id = new_id();
            ob.made.push((id, buf));
            count_encoded(true);
            return Some(token(id));
        }
        let mut buf = ob.pool.alloc(total as u64).ok()?;
        let mut ok = false;
        buf.overwrite(|runs| {
            let mut w = Runs {
                runs,
                at: 0,
                off: 0,
            };
            w.put_u8(0);
            w.put_u32(len as u32);
            ok = msg.encode(&mut w).is_ok();
            w.written()
        })
        .ok()?;
        if !ok {
            return None;
        }
        let id = new_id();
        ob.made.push((id, buf));
        count_encoded(false);
        Some(token(id))
    })
}

/// The pool pages [`Buffer::overwrite`] hands out, as one `BufMut`.
struct Runs<'a, 'b> {
    runs: &'a mut [&'b mut [std::mem::MaybeUninit<u8>]],
    /// The run being written, and the offset in it.
    at: usize,
    off: usize,
}

impl Runs<'_, '_> {
    fn written(&self) -> usize {
        self.runs[..self.at.min(self.runs.len())]
            .iter()
            .map(|r| r.len())
            .sum::<usize>()
            + self.off
    }
}

// SAFETY: `chunk_mut` gives the unwritten rest of the current run (memory
// the buffer holds alone, for as long as `self` borrows it), and
// `advance_mut` moves past bytes the caller wrote, never past the runs'
// end (checked).
unsafe impl BufMut for Runs<'_, '_> {
    fn remaining_mut(&self) -> usize {
        self.runs.iter().map(|r| r.len()).sum::<usize>() - self.written()
    }

    unsafe fn advance_mut(&mut self, mut cnt: usize) {
        while cnt > 0 {
            let Some(run) = self.runs.get(self.at) else {
                panic!("advance_mut past the end of a pool buffer");
            };
            let step = cnt.min(run.len() - self.off);
            self.off += step;
            cnt -= step;
            if self.off == run.len() {
                self.at += 1;
                self.off = 0;
            }
        }
    }

    fn chunk_mut(&mut self) -> &mut bytes::buf::UninitSlice {
        while self.at < self.runs.len() && self.off == self.runs[self.at].len() {
            self.at += 1;
            self.off = 0;
        }
        match self.runs.get_mut(self.at) {
            Some(run) => bytes::buf::UninitSlice::uninit(&mut run[self.off..]),
            None => bytes::buf::UninitSlice::uninit(&mut []),
        }
    }
}

/// Views handed to decoders by token, until they claim them.
static ARRIVED: Mutex<Option<HashMap<u128, Bytes>>> = Mutex::new(None);

/// Claims the message token `id` stands for.
pub(crate) fn claim(id: u128) -> Option<Bytes> {
    let mut a = ARRIVED.lock().unwrap_or_else(PoisonError::into_inner);
    a.as_mut()?.remove(&id)
}

/// Says that the decoder about to read a body is a [`crate::Codec`]'s.
pub(crate) fn want_views(on: bool) {
    VIEWS_WANTED.set(on);
}

/// Whether the decoder reading a body now said so: a body asks at the
/// start of every read, so no word outlives the read it was said for.
pub(crate) fn views_wanted() -> bool {
    VIEWS_WANTED.take()
}

/// The receiving side of a body: hands its large messages over by token
/// when the decoder reading it wants them so.
pub(crate) struct Inbox {
    frames: Frames,
    /// Tokens handed out: claimed ones are gone from [`ARRIVED`] already.
    issued: Vec<u128>,
    /// The smallest message handed over by view ([`VIEW_MIN`]).
    min: usize,
}

impl Default for Inbox {
    fn default() -> Self {
        Inbox::with_min(VIEW_MIN)
    }
}

impl Inbox {
    /// An inbox that hands over messages of `min` bytes and more by view.
    pub(crate) fn with_min(min: usize) -> Inbox {
        Inbox {
            frames: Frames::default(),
            issued: Vec::new(),
            min,
        }
    }

    /// Whether some of `chunk` may go by token, for a decoder that wants
    /// it so: else [`pass`](Self::pass) it as it is.
    pub(crate) fn may_take(&self, chunk: &[u8], wanted: bool) -> bool {
        wanted && chunk.len() >= PREFIX + self.min
    }

    /// Notes `chunk` handed over as it is.
    pub(crate) fn pass(&mut self, chunk: &[u8]) {
        self.frames.walk(chunk, |_, _| {});
    }

    /// `chunk` as the decoder reading now should get it.
    pub(crate) fn parts(&mut self, chunk: Bytes, wanted: bool) -> Vec<Bytes> {
        let (issued, min) = (&mut self.issued, self.min);
        self.frames.split(
            chunk,
            |flag, msg| {
                if !wanted || flag != 0 || msg.len() < min || msg.len() > VIEW_MAX {
                    return None;
                }
                let id = new_id();
                ARRIVED
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert_default()
                    .insert(id, msg.clone());
                issued.push(id);
                let mut f = Vec::with_capacity(PREFIX + TOKEN_LEN);
                f.put_u8(0);
                f.put_u32(TOKEN_LEN as u32);
                f.put_slice(&token(id));
                Some(Bytes::from(f))
            },
            |b| b,
        )
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        if self.issued.is_empty() {
            return;
        }
        let mut a = ARRIVED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(a) = a.as_mut() {
            for id in &self.issued {
                a.remove(id);
            }
        }
    }
}

/// Where a body's frames begin, across its chunks.
#[derive(Default)]
struct Frames {
    /// A prefix read in part.
    head: [u8; PREFIX],
    have: usize,
    /// Bytes of the current frame's message still to come.
    left: usize,
}

impl Frames {
    /// Walks `chunk`, calling `whole(at, len)` for each frame that lies in
    /// it whole (its prefix at `at`, its message `len` bytes after).
    fn walk(&mut self, chunk: &[u8], mut whole: impl FnMut(usize, usize)) {
        let (mut at, n) = (0, chunk.len());
        while at < n {
            if self.left > 0 {
                let k = self.left.min(n - at);
                self.left -= k;
                at += k;
                continue;
            }
            if self.have == 0 && n - at >= PREFIX {
                let len = u32::from_be_bytes([
                    chunk[at + 1],
                    chunk[at + 2],
                    chunk[at + 3],
                    chunk[at + 4],
                ]) as usize;
                if n - at - PREFIX >= len {
                    whole(at, len);
                    at += PREFIX + len;
                    continue;
                }
            }
            // A prefix in pieces, or a frame longer than this chunk.
            let k = (PREFIX - self.have).min(n - at);
            self.head[self.have..self.have + k].copy_from_slice(&chunk[at..at + k]);
            self.have += k;
            at += k;
            if self.have == PREFIX {
                self.have = 0;
                self.left =
                    u32::from_be_bytes([self.head[1], self.head[2], self.head[3], self.head[4]])
                        as usize;
            }
        }
    }

    /// Splits `chunk` around each whole frame `pick` takes (given its flag
    /// and message). The rest stays bytes (`bytes`).
    fn split<T>(
        &mut self,
        chunk: Bytes,
        mut pick: impl FnMut(u8, &Bytes) -> Option<T>,
        bytes: impl Fn(Bytes) -> T,
    ) -> Vec<T> {
        let mut out = Vec::new();
        let mut from = 0;
        self.walk(&chunk, |at, len| {
            let end = at + PREFIX + len;
            if let Some(t) = pick(chunk[at], &chunk.slice(at + PREFIX..end)) {
                if from < at {
                    out.push(bytes(chunk.slice(from..at)));
                }
                out.push(t);
                from = end;
            }
        });
        if from < chunk.len() {
            out.push(bytes(chunk.slice(from..)));
        }
        out
    }
}

static ENCODED: AtomicU64 = AtomicU64::new(0);
static DECODED: AtomicU64 = AtomicU64::new(0);
static FORWARDED: AtomicU64 = AtomicU64::new(0);

pub(crate) fn count_decoded() {
    DECODED.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn count_encoded(forwarded: bool) {
    ENCODED.fetch_add(1, Ordering::Relaxed);
    if forwarded {
        FORWARDED.fetch_add(1, Ordering::Relaxed);
    }
}

/// What this process's [`Codec`](crate::Codec)s have done by Ref, since it started (for
/// tests and diagnostics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByRefCounts {
    /// Messages encoded into the pool.
    pub encoded: u64,
    /// Of those, messages laid over the pages of a received one (a
    /// `bytes` field passed on): no copy of it.
    pub forwarded: u64,
    /// Messages decoded from views of the pool's pages.
    pub decoded: u64,
}

/// The counts so far.
pub fn by_ref_counts() -> ByRefCounts {
    ByRefCounts {
        encoded: ENCODED.load(Ordering::Relaxed),
        forwarded: FORWARDED.load(Ordering::Relaxed),
        decoded: DECODED.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn frame(flag: u8, msg: &[u8]) -> Vec<u8> {
        let mut f = vec![flag];
        f.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        f.extend_from_slice(msg);
        f
    }

    /// Splits `body` cut at `cuts`, taking every frame whose message is
    /// `want` long: what comes out, joined, is the body with those frames
    /// swapped for a marker.
    fn run(body: &[u8], cuts: &[usize], want: usize) -> Vec<u8> {
        let mut f = Frames::default();
        let mut out = Vec::new();
        let mut last = 0;
        for &c in cuts.iter().chain([body.len()].iter()) {
            let chunk = Bytes::copy_from_slice(&body[last..c]);
            last = c;
            for p in f.split(
                chunk,
                |flag, m| (flag == 0 && m.len() == want).then(|| Bytes::from_static(b"<T>")),
                |b| b,
            ) {
                out.extend_from_slice(&p);
            }
        }
        out
    }

    #[test]
    fn frames_are_found_across_chunks_and_only_whole_ones_are_taken() {
        let mut body = frame(0, b"abc");
        body.extend(frame(0, &[7; 20]));
        body.extend(frame(1, &[7; 20]));
        body.extend(frame(0, b""));
        body.extend(frame(0, &[9; 20]));
        // Whole chunk: both uncompressed 20-byte frames taken.
        let want: Vec<u8> = [
            frame(0, b"abc"),
            b"<T>".to_vec(),
            frame(1, &[7; 20]),
            frame(0, b""),
            b"<T>".to_vec(),
        ]
        .concat();
        assert_eq!(run(&body, &[], 20), want);
        // Every cut: a frame cut in two stays bytes, and the frames after
        // it are still found where they start.
        for c in 1..body.len() {
            let got = run(&body, &[c], 20);
            let taken = got.windows(3).filter(|w| w == b"<T>").count();
            assert!(taken >= 1, "cut at {c}");
            let plain = run(&body, &[c], 999);
            assert_eq!(plain, body, "cut at {c}");
        }
        // Cut into single bytes: nothing whole, nothing taken.
        let cuts: Vec<usize> = (1..body.len()).collect();
        assert_eq!(run(&body, &cuts, 20), body);
    }

    #[test]
    fn runs_take_a_message_across_their_ends_and_no_further() {
        use std::mem::MaybeUninit;
        let mut a = [MaybeUninit::new(0u8); 3];
        let mut b: [MaybeUninit<u8>; 0] = [];
        let mut c = [MaybeUninit::new(0u8); 5];
        let mut runs: Vec<&mut [MaybeUninit<u8>]> = vec![&mut a, &mut b, &mut c];
        let mut w = Runs {
            runs: &mut runs,
            at: 0,
            off: 0,
        };
        assert_eq!(w.remaining_mut(), 8);
        w.put_u8(1);
        w.put_slice(&[2, 3, 4, 5]);
        assert_eq!((w.written(), w.remaining_mut()), (5, 3));
        w.put_u16(0x0607);
        w.put_u8(8);
        assert_eq!((w.written(), w.remaining_mut()), (8, 0));
        assert_eq!(w.chunk_mut().len(), 0);
        // SAFETY: every byte was initialised above.
        let got: Vec<u8> = a
            .iter()
            .chain(c.iter())
            .map(|b| unsafe { b.assume_init() })
            .collect();
        assert_eq!(got, [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn tokens_are_recognised_and_nothing_else_is() {
        let id = new_id();
        assert_eq!(token_id(&token(id)), Some(id));
        assert_eq!(token_id(&token(id)[..16]), None);
        let mut t = token(id);
        t[0] = 1;
        assert_eq!(token_id(&t), None);
        assert_eq!(token_id(b""), None);
        assert_ne!(new_id(), new_id());
    }
}
