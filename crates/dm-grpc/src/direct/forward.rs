//! Forwarding with no copy: a message that passes on a `bytes` field it
//! received is laid over the received pages.
//!
//! A received payload of [`LAY_MIN`] bytes or more becomes a view that
//! holds its buffer ([`view`]), and the view's address range is listed
//! while it lives. Before a large message is encoded into fresh pages
//! (`by_ref.rs`), it is encoded once without its large `bytes` field (a
//! `BufMut` that stops at a `put` of a listed range). If there is one
//! such field, and its source buffer has room for the bytes around it,
//! the new message is a Ref range of the source mapped anew: the bytes
//! before and after the field are written where they differ, which copies
//! the first and the last page only, whatever the size.

use bytes::{Buf, BufMut, Bytes};
use dm_pool::Buffer;
use dm_rpc::{Payload, RpcError};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// A `bytes` field this large that is a received view is passed on by
/// sharing its pages.
const LAY_MIN: usize = 64 << 10;

/// Received pool buffers whose views live: where each is mapped, and the
/// buffer (held by the views).
static SOURCES: Mutex<Vec<(usize, usize, Weak<Buffer>)>> = Mutex::new(Vec::new());

/// What a received view holds: the buffer, mapped, and where.
struct Held {
    buf: Arc<Buffer>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: `ptr..ptr + len` is the mapping of `buf`'s pages, which `buf`
// keeps (and keeps unchanged: a buffer's shared pages are frozen) for as
// long as this value lives, whichever thread holds it.
unsafe impl Send for Held {}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see `Send` above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let me = Arc::as_ptr(&self.buf);
        let mut s = SOURCES.lock().unwrap_or_else(PoisonError::into_inner);
        s.retain(|(_, _, buf)| !std::ptr::eq(buf.as_ptr(), me));
    }
}

/// `p` as bytes: a payload that came in the pool as a view of its pages,
/// which a message encoded in this process may share ([`lay_over`]);
/// others as [`Payload::into_bytes`] gives them.
pub(crate) fn view(p: Payload) -> Result<Bytes, RpcError> {
    if !p.in_pool() || p.len() < LAY_MIN as u64 {
        return p.into_bytes();
    }
    let Some(buf) = p.into_buffer()? else {
        return Ok(Bytes::new());
    };
    let Some((ptr, len)) = buf.as_slice()?.map(|s| (s.as_ptr(), s.len())) else {
        return Ok(Bytes::from(buf.to_vec()?));
    };
    let buf = Arc::new(buf);
    SOURCES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((ptr as usize, len, Arc::downgrade(&buf)));
    Ok(Bytes::from_owner(Held { buf, ptr, len }))
}

/// The received buffer whose mapping holds `s` whole, and where in it.
fn source_of(s: &[u8]) -> Option<(Arc<Buffer>, u64)> {
    let at = s.as_ptr() as usize;
    let sources = SOURCES.lock().unwrap_or_else(PoisonError::into_inner);
    sources.iter().find_map(|(start, len, buf)| {
        let off = at.checked_sub(*start)?;
        (off + s.len() <= *len).then(|| Some((buf.upgrade()?, off as u64)))?
    })
}

/// A message encoded apart from its one large `bytes` field that is a
/// received view: what comes before it (with the frame's prefix to come),
/// the field, and what comes after.
/// It gives up (and stops keeping bytes) at a second large piece, or at
/// more than [`LAY_MIN`] of small ones: the message is then encoded as
/// usual, with no copy made here.
#[derive(Default)]
struct Probe {
    head: Vec<u8>,
    field: Option<(Arc<Buffer>, u64, usize)>,
    tail: Vec<u8>,
    gave_up: bool,
}

impl Probe {
    fn out(&mut self) -> &mut Vec<u8> {
        let v = if self.field.is_some() {
            &mut self.tail
        } else {
            &mut self.head
        };
        if v.len() > LAY_MIN {
            self.gave_up = true;
            v.clear();
        }
        v
    }
}

// SAFETY: every method forwards to the `Vec` being written (the head until
// the field is found, the tail after), whose own `BufMut` is sound.
unsafe impl BufMut for Probe {
    fn remaining_mut(&self) -> usize {
        usize::MAX - self.head.len() - self.tail.len()
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        // SAFETY: the caller's contract, passed on to the same `Vec`
        // whose `chunk_mut` it wrote.
        unsafe { self.out().advance_mut(cnt) }
    }

    fn chunk_mut(&mut self) -> &mut bytes::buf::UninitSlice {
        self.out().chunk_mut()
    }

    fn put<T: Buf>(&mut self, mut src: T)
    where
        Self: Sized,
    {
        if src.remaining() >= LAY_MIN {
            let found = (self.field.is_none() && src.chunk().len() == src.remaining())
                .then(|| source_of(src.chunk()))
                .flatten();
            match found {
                Some((buf, off)) => self.field = Some((buf, off, src.remaining())),
                None => self.gave_up = true,
            }
            src.advance(src.remaining());
            return;
        }
        while src.has_remaining() {
            let n = src.chunk().len();
            self.out().extend_from_slice(src.chunk());
            src.advance(n);
        }
    }

    fn put_slice(&mut self, src: &[u8]) {
        if src.len() >= LAY_MIN {
            self.gave_up = true;
        } else {
            self.out().extend_from_slice(src);
        }
    }
}

/// `msg` (encoding `len` bytes) laid over the pages of the received view
/// its one large `bytes` field is, if it has one and the view's buffer
/// has room around it for the rest: a buffer holding the frame (prefix
/// and message) whose pages are the source's but the first and the last.
pub(super) fn lay_over<M: prost::Message>(msg: &M, len: usize) -> Option<Buffer> {
    if SOURCES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .is_empty()
    {
        return None;
    }
    let mut probe = Probe::default();
    probe.head.extend_from_slice(&[0, 0, 0, 0, 0]);
    msg.encode(&mut probe).ok()?;
    if probe.gave_up {
        return None;
    }
    let (src, at, n) = probe.field.take()?;
    probe.head[1..5].copy_from_slice(&u32::try_from(len).ok()?.to_be_bytes());
    let (h, t) = (probe.head.len() as u64, probe.tail.len() as u64);
    let start = at.checked_sub(h)?;
    let total = h + n as u64 + t;
    if start + total > src.len() {
        return None;
    }
    let pool = src.pool();
    let r = pool.create_ref(&src, start, total).ok()?;
    let mapped = pool.map_ref(&r);
    let _ = pool.release_ref(&r);
    let mut out = mapped.ok()?;
    // (Bytes already in place are not written: their page stays shared.)
    let same = |b: &Buffer, off: u64, want: &[u8]| {
        let mut have = vec![0u8; want.len()];
        b.read(off, &mut have).is_ok() && have == want
    };
    if !same(&out, 0, &probe.head) {
        out.write(0, &probe.head).ok()?;
    }
    if !same(&out, h + n as u64, &probe.tail) {
        out.write(h + n as u64, &probe.tail).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_received_field_passed_on_shares_its_pages_and_the_rest_is_written() {
        use crate::example::imaging::Image;
        use crate::example::pattern;
        use prost::Message;
        let frame = |m: &Image| {
            let mut f = vec![0u8];
            f.extend_from_slice(&(m.encoded_len() as u32).to_be_bytes());
            m.encode(&mut f).unwrap();
            f
        };
        let tp = dm_pool::testing::TempPool::new(64 << 20);
        let pool = tp.attach();
        let sent = Image {
            width: 7,
            height: 9,
            pixels: pattern(300_000, 3).into(),
            digest: 5,
        };
        let mut b = pool.alloc(frame(&sent).len() as u64).unwrap();
        b.write(0, &frame(&sent)).unwrap();
        let v = view(Payload::from_buffer(b)).unwrap();
        let got = Image::decode(v.slice(5..)).unwrap();
        // The same message: its frame is the source's.
        let out = lay_over(&got, got.encoded_len()).unwrap();
        assert_eq!(out.to_vec().unwrap(), frame(&sent));
        // Other fields of the same sizes, before and after the pixels:
        // written over the first and the last page. The source is unchanged.
        let other = Image {
            width: 8,
            digest: 6,
            ..got.clone()
        };
        let out2 = lay_over(&other, other.encoded_len()).unwrap();
        assert_eq!(out2.to_vec().unwrap(), frame(&other));
        assert_eq!(&v[..], &frame(&sent)[..]);
        // The pages between are the source's own.
        for b in [&out, &out2] {
            let mid = b.segments(100_000, 1).unwrap()[0].as_ptr();
            assert_eq!(mid, v[100_000..].as_ptr());
        }
        assert_ne!(out2.segments(0, 1).unwrap()[0].as_ptr(), v.as_ptr());
        // No room in the source for a longer tail, and pixels that are no
        // received view: encoded as usual.
        let longer = Image {
            digest: u64::MAX,
            ..got.clone()
        };
        assert!(lay_over(&longer, longer.encoded_len()).is_none());
        let fresh = Image {
            pixels: pattern(300_000, 3).into(),
            ..got.clone()
        };
        assert!(lay_over(&fresh, fresh.encoded_len()).is_none());
        drop((out, out2, got, other, longer, fresh, v, pool));
        tp.assert_clean();
    }
}
