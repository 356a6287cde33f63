//! Call metadata: named values a caller attaches to a request (a trace id,
//! an authentication token, a tenant), apart from the payload, as gRPC's
//! metadata. The handler reads them ([`crate::server::Call::metadata`]).
//!
//! An answer carries metadata too (gRPC's response headers and trailers:
//! a server's version, a cost, a hint to retry after some time), set by
//! the handler while it serves the call ([`set_reply`]), on a success or
//! an error alike, and read by the caller from
//! [`Reply::metadata`](crate::Reply::metadata) or
//! [`RpcError::metadata`](crate::RpcError). An error a handler returns
//! keeps the metadata it carries (that of a nested call's answer, say),
//! after what the handler set.
//!
//! In a frame (version 6; requests only in version 5) they follow the
//! payload, `meta length` bytes (header bytes 28..32) of entries, each:
//!
//! | bytes | field |
//! |-------|-------|
//! | 1     | key length *k*, 1..=255 |
//! | *k*   | key: lowercase ASCII letters, digits, `-`, `_`, `.` |
//! | 2     | value length *v* (little-endian) |
//! | *v*   | value: any bytes |
//!
//! A key may repeat (its values keep their order). The decoder checks
//! every entry and that they fill the section exactly, within
//! [`Limits::max_meta`](crate::frame::Limits) bytes.

use std::cell::Cell;

/// Most bytes of metadata a frame carries by default
/// ([`Limits::max_meta`](crate::frame::Limits)).
pub(crate) const DEFAULT_MAX_META: u32 = 16 << 10;

/// Longest key.
pub const MAX_KEY: usize = 255;
/// Longest value.
pub const MAX_VALUE: usize = u16::MAX as usize;

/// A request's metadata: keys and values, in order. Empty (the common
/// case) costs nothing: no allocation, no bytes in the frame, one word in
/// a frame (so a call moves and drops no more than it did without).
/// Otherwise it is held as its encoding in a frame (the table above), in
/// one buffer: decoding a frame's metadata is one copy, and adding an
/// entry appends to it.
#[derive(Clone, Default, PartialEq, Eq)]
#[allow(
    clippy::box_collection,
    reason = "one word in every frame; a Vec is three"
)]
pub struct Metadata(Option<Box<Vec<u8>>>);

impl std::fmt::Debug for Metadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|(k, v)| (k, String::from_utf8_lossy(v))))
            .finish()
    }
}

/// The entries of an encoding that was checked (on insert or decode), in
/// order.
#[derive(Clone)]
struct Entries<'a>(&'a [u8]);

impl<'a> Iterator for Entries<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let (&klen, rest) = self.0.split_first()?;
        let klen = klen as usize;
        let (key, rest) = rest.split_at_checked(klen)?;
        let (vlen, rest) = rest.split_first_chunk::<2>()?;
        let (value, rest) = rest.split_at_checked(u16::from_le_bytes(*vlen) as usize)?;
        self.0 = rest;
        // (A checked key is ASCII: never the empty string here.)
        Some((std::str::from_utf8(key).unwrap_or_default(), value))
    }
}

/// Why a key or value cannot be metadata.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// Empty, too long, or with a character outside `[a-z0-9._-]`.
    #[error("metadata key {0:?} is not 1 to 255 of a-z, 0-9, '-', '_', '.'")]
    Key(String),
    /// Longer than [`MAX_VALUE`].
    #[error("metadata value of {0} bytes exceeds {MAX_VALUE}")]
    Value(usize),
    /// [`set_reply`] on a thread that serves no call.
    #[error("no call is being served on this thread: there is no answer to carry metadata")]
    NotServing,
}

/// The metadata of the call a thread serves that is not the request's:
/// what its answer will carry, and what the calls its handler makes
/// inherit (the keys the server propagates, see
/// [`ServerBuilder::propagate_metadata`](crate::ServerBuilder::propagate_metadata)).
#[derive(Debug, Default)]
pub(crate) struct Served {
    /// The answer's metadata, as the handler set it so far.
    pub(crate) reply: Metadata,
    /// What the calls made while serving inherit.
    pub(crate) inherited: Metadata,
    /// The request came inline by a caller's learned choice
    /// ([`crate::choice::WAY_KEY`]): payloads passed on go inline too.
    pub(crate) follow_inline: bool,
}

thread_local! {
    /// The [`Served`] of the call this thread serves (a blocking handler
    /// runs on it, or an async handler's future is being polled on it),
    /// installed by [`serving`]; null when it serves none. (A pointer, not
    /// the metadata: no destructor to register, one load and one store a
    /// call.)
    static SERVED: Cell<*mut Served> = const { Cell::new(std::ptr::null_mut()) };
}

/// Sets the metadata of the answer to the call being served on this
/// thread, replacing what was set before: a blocking handler calls it
/// while it runs, an async handler's future anywhere in its body (it runs
/// while polled). It goes with the answer whether the handler succeeds or
/// fails. Fails with [`MetadataError::NotServing`] on a thread that serves
/// no call (a thread or task the handler started). An answer's metadata
/// counts against the frame limit as a request's does; a handler whose
/// answer's metadata exceeds it fails with `Internal`.
pub fn set_reply(meta: Metadata) -> Result<(), MetadataError> {
    let served = SERVED.with(Cell::get);
    if served.is_null() {
        return Err(MetadataError::NotServing);
    }
    // SAFETY: `serving` installed the pointer from a live `&mut`, which
    // nothing else uses until it returns, and removes it before that
    // borrow ends (on return or unwind); it is used only on this thread,
    // one access at a time. (The old value is dropped here.)
    unsafe { (*served).reply = meta };
    Ok(())
}

/// Adds to `meta`, the metadata of a call about to be made, what the call
/// being served on this thread passes on ([`Served::inherited`]): each
/// key `meta` does not have already.
#[inline]
pub(crate) fn inherit_into(meta: &mut Metadata) {
    let served = SERVED.with(Cell::get);
    if served.is_null() {
        return;
    }
    // SAFETY: as in `set_reply`; read only.
    let inherited = unsafe { &(*served).inherited };
    meta.fill_from(inherited);
}

/// Whether the call being served on this thread came inline by its
/// caller's learned choice, which the calls it makes then follow.
#[inline]
pub(crate) fn follows_inline() -> bool {
    let served = SERVED.with(Cell::get);
    // SAFETY: as in `set_reply`; read only.
    !served.is_null() && unsafe { (*served).follow_inline }
}

/// Runs `f` as the serving of a call whose answer's metadata and
/// inherited metadata are `*served`: what [`set_reply`] sets meanwhile
/// goes to it (a handler's panic included), and calls made read what they
/// inherit from it.
#[inline]
pub(crate) fn serving<R>(served: &mut Served, f: impl FnOnce() -> R) -> R {
    /// Puts the outer call's back when dropped.
    struct Back(*mut Served);
    impl Drop for Back {
        fn drop(&mut self) {
            SERVED.with(|r| r.set(self.0));
        }
    }
    let _back = Back(SERVED.with(|r| r.replace(served)));
    f()
}

/// Bytes a metadata's buffer has room for when its first entry comes:
/// the typical call's entries (a gRPC call's path, content type and
/// status) fit, so it grows no further.
const FIRST_ROOM: usize = 128;

fn valid_key(k: &[u8]) -> bool {
    !k.is_empty()
        && k.len() <= MAX_KEY
        && k.iter()
            .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_.".contains(&c))
}

impl Metadata {
    /// No metadata.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Adds `value` under `key` (after any value the key has).
    pub fn insert(&mut self, key: &str, value: impl AsRef<[u8]>) -> Result<(), MetadataError> {
        if !valid_key(key.as_bytes()) {
            return Err(MetadataError::Key(key.to_owned()));
        }
        let value = value.as_ref();
        if value.len() > MAX_VALUE {
            return Err(MetadataError::Value(value.len()));
        }
        self.push(key.as_bytes(), value);
        Ok(())
    }

    /// Appends an entry whose key and value were checked.
    fn push(&mut self, key: &[u8], value: &[u8]) {
        // Room for a few entries at once: metadata is built entry by
        // entry, and each growth is an allocation.
        let b = self
            .0
            .get_or_insert_with(|| Box::new(Vec::with_capacity(FIRST_ROOM)));
        b.reserve(3 + key.len() + value.len());
        // (Lengths checked by the caller.)
        b.push(key.len() as u8);
        b.extend_from_slice(key);
        b.extend_from_slice(&(value.len() as u16).to_le_bytes());
        b.extend_from_slice(value);
    }

    /// This metadata with `value` added under `key`.
    pub fn with(mut self, key: &str, value: impl AsRef<[u8]>) -> Result<Self, MetadataError> {
        self.insert(key, value)?;
        Ok(self)
    }

    fn bytes(&self) -> &[u8] {
        self.0.as_deref().map_or(&[], Vec::as_slice)
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Every value of `key`, in order.
    pub fn get_all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.iter().filter(move |(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Every key and value, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> + Clone {
        Entries(self.bytes())
    }

    /// The entries whose key is one of `keys`, in order.
    pub fn only(&self, keys: &[String]) -> Metadata {
        let mut out = Metadata::new();
        for (k, v) in self.iter() {
            if keys.iter().any(|x| x == k) {
                out.push(k.as_bytes(), v);
            }
        }
        out
    }

    /// Adds the entries of `other` whose key it does not have, after its
    /// own (a call's own values win over those it inherits or its client
    /// adds).
    #[inline]
    pub(crate) fn fill_from(&mut self, other: &Metadata) {
        if !other.is_empty() {
            self.fill_from_entries(other);
        }
    }

    #[cold]
    fn fill_from_entries(&mut self, other: &Metadata) {
        if self.is_empty() {
            self.clone_from(other);
            return;
        }
        let mine = self.bytes().len();
        for (k, v) in other.iter() {
            if !Entries(&self.bytes()[..mine]).any(|(x, _)| x == k) {
                self.push(k.as_bytes(), v);
            }
        }
    }

    /// Adds every entry of `other` after its own.
    pub fn extend(&mut self, other: Metadata) {
        let Some(more) = other.0 else { return };
        match &mut self.0 {
            Some(mine) => mine.extend_from_slice(&more),
            None => self.0 = Some(more),
        }
    }

    /// Whether there is none.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|v| v.is_empty())
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Bytes of its encoding in a frame.
    #[inline]
    pub fn encoded_len(&self) -> usize {
        self.bytes().len()
    }

    /// The most payload bytes that may go inline beside it in a frame of a
    /// transport that carries `max_inline` bytes inline, given the
    /// node's threshold `inline_max`; or, if it exceeds the receiver's
    /// limit ([`Limits::max_meta`](crate::frame::Limits)) or `max_inline`,
    /// its size and the lower of the two.
    #[inline]
    pub(crate) fn inline_room(
        &self,
        inline_max: usize,
        max_inline: usize,
    ) -> Result<usize, (usize, usize)> {
        let room = inline_max.min(max_inline);
        if self.is_empty() {
            return Ok(room);
        }
        let len = self.encoded_len();
        let max_meta = (DEFAULT_MAX_META as usize).min(max_inline);
        if len > max_meta {
            return Err((len, max_meta));
        }
        Ok(room.min(max_inline.saturating_sub(len)))
    }

    /// Calls `put` with its encoding.
    #[inline]
    pub(crate) fn encode_with(&self, put: &mut impl FnMut(&[u8])) {
        if !self.is_empty() {
            put(self.bytes());
        }
    }

    /// Its encoding.
    pub(crate) fn encode(&self) -> Vec<u8> {
        self.bytes().to_vec()
    }

    /// Decodes a frame's metadata section, exactly `b`; the error says
    /// what is wrong with it (the frame decoder's `FrameError::Metadata`).
    pub(crate) fn decode(b: &[u8]) -> Result<Metadata, &'static str> {
        // Every entry checked before it is kept: the entries, read back,
        // fill `b` exactly.
        let mut rest = b;
        while let Some((&klen, r)) = rest.split_first() {
            let klen = klen as usize;
            let key = r
                .get(..klen)
                .filter(|k| valid_key(k))
                .ok_or("a key is malformed or cut short")?;
            let r = &r[key.len()..];
            let vlen = r
                .get(..2)
                .map(|l| u16::from_le_bytes([l[0], l[1]]) as usize)
                .ok_or("a value's length is cut short")?;
            rest = r.get(2 + vlen..).ok_or("a value is cut short")?;
        }
        Ok(Metadata((!b.is_empty()).then(|| Box::new(b.to_vec()))))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn entries_round_trip_in_order_and_bad_ones_are_refused() {
        let m = Metadata::new()
            .with("trace-id", "abc")
            .unwrap()
            .with("x.tenant_1", vec![0u8, 255])
            .unwrap()
            .with("trace-id", "def")
            .unwrap();
        let b = m.encode();
        assert_eq!(b.len(), m.encoded_len());
        assert_eq!(Metadata::decode(&b).unwrap(), m);
        assert_eq!(m.get("trace-id"), Some(&b"abc"[..]));
        assert_eq!(m.get_all("trace-id").collect::<Vec<_>>(), [b"abc", b"def"]);
        assert_eq!(m.get("none"), None);
        assert_eq!(Metadata::decode(&[]).unwrap(), Metadata::new());
        for bad in ["", "Trace", "a b", "ü", &"k".repeat(256)] {
            assert!(Metadata::new().with(bad, "v").is_err(), "{bad:?}");
        }
        assert_eq!(
            Metadata::new().with("k", vec![0; MAX_VALUE + 1]),
            Err(MetadataError::Value(MAX_VALUE + 1))
        );
        // Cut anywhere, or a bad key byte: refused.
        for cut in 0..b.len() {
            let r = Metadata::decode(&b[..cut]);
            // (Entries end at 14 and 29 bytes.)
            assert_eq!(r.is_ok(), [0, 14, 29].contains(&cut), "cut at {cut}: {r:?}");
        }
        let mut upper = b.clone();
        upper[1] = b'T';
        assert!(Metadata::decode(&upper).is_err());
        assert!(Metadata::decode(&[0, 0, 0]).is_err(), "an empty key");
    }

    proptest::proptest! {
        /// Entries read back as they were added, through an encoding and
        /// a decoding; any bytes either decode to entries that encode
        /// back to exactly them, or are refused.
        #[test]
        fn entries_read_back_and_any_bytes_decode_exactly_or_not_at_all(
            entries in proptest::collection::vec(
                ("[a-z0-9._-]{1,12}", proptest::collection::vec(proptest::num::u8::ANY, 0..40)),
                0..8,
            ),
            noise in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
        ) {
            let mut m = Metadata::new();
            for (k, v) in &entries {
                m.insert(k, v).unwrap();
            }
            let got: Vec<_> = m.iter().map(|(k, v)| (k.to_owned(), v.to_vec())).collect();
            proptest::prop_assert_eq!(&got, &entries);
            proptest::prop_assert_eq!(m.len(), entries.len());
            let back = Metadata::decode(&m.encode()).unwrap();
            proptest::prop_assert_eq!(&back, &m);
            if let Ok(d) = Metadata::decode(&noise) {
                let mut again = Metadata::new();
                for (k, v) in d.iter() {
                    again.insert(k, v).unwrap();
                }
                proptest::prop_assert_eq!(again.encode(), noise);
            }
        }
    }

    #[test]
    fn an_answers_metadata_is_set_and_inherited_only_while_a_call_is_served() {
        let m = |v: &str| Metadata::new().with("k", v).unwrap();
        assert_eq!(set_reply(m("x")), Err(MetadataError::NotServing));
        let mut none = Metadata::new();
        inherit_into(&mut none);
        assert!(none.is_empty(), "serving nothing: nothing to inherit");
        let mut outer = Served {
            reply: m("before"),
            inherited: Metadata::new()
                .with("trace-id", "t")
                .and_then(|x| x.with("k", "inherited"))
                .unwrap(),
            follow_inline: true,
        };
        assert!(!follows_inline(), "serving nothing: nothing to follow");
        serving(&mut outer, || {
            assert!(follows_inline());
            set_reply(m("outer")).unwrap();
            // Inherited keys the call does not set itself.
            let mut call = m("own");
            inherit_into(&mut call);
            let got: Vec<_> = call.iter().collect();
            assert_eq!(got, [("k", &b"own"[..]), ("trace-id", &b"t"[..])]);
            let mut inner = Served::default();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serving(&mut inner, || {
                    set_reply(m("inner")).unwrap();
                    let mut call = Metadata::new();
                    inherit_into(&mut call);
                    assert!(call.is_empty(), "the inner call passes nothing on");
                    panic!("handler bug")
                })
            }));
            assert!(r.is_err());
            assert_eq!(inner.reply, m("inner"), "kept through the panic");
            // Another thread serves nothing.
            let other = std::thread::spawn(|| set_reply(Metadata::new()));
            assert_eq!(other.join().unwrap(), Err(MetadataError::NotServing));
        });
        assert_eq!(outer.reply, m("outer"));
        assert_eq!(set_reply(m("x")), Err(MetadataError::NotServing));
        // Set or not, the slot carries over between the polls of one call.
        let mut slot = Served {
            reply: m("first poll"),
            ..Served::default()
        };
        serving(&mut slot, || ());
        assert_eq!(slot.reply, m("first poll"));
        let mut both = m("a");
        both.extend(m("b"));
        both.extend(Metadata::new());
        assert_eq!(both.get_all("k").collect::<Vec<_>>(), [b"a", b"b"]);
        let keys = ["trace-id".to_string(), "none".to_string()];
        assert_eq!(
            outer.inherited.only(&keys),
            Metadata::new().with("trace-id", "t").unwrap()
        );
        assert!(Metadata::new().only(&keys).is_empty());
    }
}
