//! The two collections the crates the heap's allocator plugs into do not
//! have: a string, and an ordered map. Both are thin layers over
//! `allocator-api2`'s `Vec` in the heap (no crate offers either for an
//! allocator on stable Rust: `std`'s `String` and `BTreeMap` take one
//! only on nightly).

use crate::alloc::HeapAlloc;
use crate::error::HeapError;
use allocator_api2::vec::Vec as AVec;
use std::borrow::Borrow;
use std::cmp::Ordering;
use std::ops::{Bound, Deref, RangeBounds};

/// Appends `s` to `v` with one copy. (`allocator-api2`'s own
/// `extend_from_slice` clones element by element on stable Rust: about
/// 50 times slower for bytes, 20 µs for 64 KiB here.)
pub fn extend_copy<T: Copy, A: allocator_api2::alloc::Allocator>(v: &mut AVec<T, A>, s: &[T]) {
    v.reserve(s.len());
    let n = v.len();
    // SAFETY: `reserve` made room for `s.len()` more elements after the
    // `n` initialised ones; `T: Copy` has no drop, and the source and the
    // vector's spare room cannot overlap (`s` is borrowed while `v` is
    // borrowed mutably).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), v.as_mut_ptr().add(n), s.len());
        v.set_len(n + s.len());
    }
}

/// A UTF-8 string whose bytes are in a heap. It reads as a `str`
/// (`Deref`), hashes and compares as one, so a `HeapMap` keyed by
/// `HeapString`s is looked up by `&str`.
#[derive(Clone)]
pub struct HeapString<'h> {
    bytes: AVec<u8, HeapAlloc<'h>>,
}

impl<'h> HeapString<'h> {
    /// An empty string (no block taken until it grows).
    pub fn new_in(alloc: HeapAlloc<'h>) -> HeapString<'h> {
        HeapString {
            bytes: AVec::new_in(alloc),
        }
    }

    /// A copy of `s` in the heap.
    pub fn from_str_in(s: &str, alloc: HeapAlloc<'h>) -> HeapString<'h> {
        let mut h = HeapString {
            bytes: AVec::with_capacity_in(s.len(), alloc),
        };
        h.push_str(s);
        h
    }

    /// A copy of `s` in the heap, or `Full` if the heap has no room
    /// (where [`from_str_in`](Self::from_str_in) aborts, as collections
    /// do when memory runs out).
    pub fn try_from_str_in(s: &str, alloc: HeapAlloc<'h>) -> Result<HeapString<'h>, HeapError> {
        let mut bytes = AVec::new_in(alloc);
        bytes
            .try_reserve_exact(s.len())
            .map_err(|_| HeapError::Full(s.len() as u64))?;
        extend_copy(&mut bytes, s.as_bytes());
        Ok(HeapString { bytes })
    }

    /// Appends `s`.
    pub fn push_str(&mut self, s: &str) {
        extend_copy(&mut self.bytes, s.as_bytes());
    }

    /// Appends `c`.
    pub fn push(&mut self, c: char) {
        self.push_str(c.encode_utf8(&mut [0; 4]));
    }

    /// Its text.
    pub fn as_str(&self) -> &str {
        // SAFETY: only ever appended whole `str`s.
        unsafe { std::str::from_utf8_unchecked(&self.bytes) }
    }

    /// Empties it (keeping its block).
    pub fn clear(&mut self) {
        self.bytes.clear();
    }
}

impl Deref for HeapString<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for HeapString<'_> {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl std::hash::Hash for HeapString<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // (As `str` hashes: lookups by `&str` find it.)
        self.as_str().hash(state);
    }
}

impl PartialEq for HeapString<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for HeapString<'_> {}

impl PartialEq<str> for HeapString<'_> {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for HeapString<'_> {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialOrd for HeapString<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for HeapString<'_> {
    fn cmp(&self, other: &Self) -> Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::fmt::Debug for HeapString<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_str().fmt(f)
    }
}

impl std::fmt::Display for HeapString<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_str().fmt(f)
    }
}

/// A map ordered by its keys, whose entries are in a heap: a sorted
/// vector. Lookups are binary searches; an insert or a removal moves the
/// entries after it (a document's maps are small; a large index belongs
/// in a `HeapMap`). Iteration and ranges go in key order.
#[derive(Clone)]
pub struct HeapOrderedMap<'h, K, V> {
    entries: AVec<(K, V), HeapAlloc<'h>>,
}

impl<'h, K: Ord, V> HeapOrderedMap<'h, K, V> {
    /// An empty map (no block taken until it grows).
    pub fn new_in(alloc: HeapAlloc<'h>) -> Self {
        HeapOrderedMap {
            entries: AVec::new_in(alloc),
        }
    }

    /// An empty map with room for `n` entries.
    pub fn with_capacity_in(n: usize, alloc: HeapAlloc<'h>) -> Self {
        HeapOrderedMap {
            entries: AVec::with_capacity_in(n, alloc),
        }
    }

    /// A map of `entries`, sorted by key here if they are not already
    /// (a later entry of an equal key is kept beside the first).
    pub(crate) fn from_sorted(mut entries: AVec<(K, V), HeapAlloc<'h>>) -> Self {
        if !entries.windows(2).all(|w| w[0].0 <= w[1].0) {
            entries.sort_by(|a, b| a.0.cmp(&b.0));
        }
        HeapOrderedMap { entries }
    }

    fn find<Q: Ord + ?Sized>(&self, k: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.entries.binary_search_by(|(x, _)| x.borrow().cmp(k))
    }

    /// Sets `k` to `v`; the value it had, if any.
    pub fn insert(&mut self, k: K, v: V) -> Option<V> {
        match self.find(&k) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, v)),
            Err(i) => {
                self.entries.insert(i, (k, v));
                None
            }
        }
    }

    /// The value of `k`.
    pub fn get<Q: Ord + ?Sized>(&self, k: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.find(k).ok().map(|i| &self.entries[i].1)
    }

    /// The value of `k`, to change.
    pub fn get_mut<Q: Ord + ?Sized>(&mut self, k: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        self.find(k).ok().map(|i| &mut self.entries[i].1)
    }

    /// Whether it has `k`.
    pub fn contains_key<Q: Ord + ?Sized>(&self, k: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.find(k).is_ok()
    }

    /// Removes `k`; its value, if it had one.
    pub fn remove<Q: Ord + ?Sized>(&mut self, k: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.find(k).ok().map(|i| self.entries.remove(i).1)
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &V)> + ExactSizeIterator {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &K> + ExactSizeIterator {
        self.entries.iter().map(|(k, _)| k)
    }

    /// The values in key order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> + ExactSizeIterator {
        self.entries.iter().map(|(_, v)| v)
    }

    /// The first entry (the least key).
    pub fn first(&self) -> Option<(&K, &V)> {
        self.entries.first().map(|(k, v)| (k, v))
    }

    /// The last entry (the greatest key).
    pub fn last(&self) -> Option<(&K, &V)> {
        self.entries.last().map(|(k, v)| (k, v))
    }

    /// The entries whose keys are in `r`, in order.
    pub fn range<Q: Ord + ?Sized, R: RangeBounds<Q>>(
        &self,
        r: R,
    ) -> impl DoubleEndedIterator<Item = (&K, &V)>
    where
        K: Borrow<Q>,
    {
        let at = |b: Bound<&Q>, past: bool| match b {
            Bound::Unbounded => {
                if past {
                    self.entries.len()
                } else {
                    0
                }
            }
            Bound::Included(q) => match self.find(q) {
                Ok(i) => i + usize::from(past),
                Err(i) => i,
            },
            Bound::Excluded(q) => match self.find(q) {
                Ok(i) => i + usize::from(!past),
                Err(i) => i,
            },
        };
        let start = at(r.start_bound(), false);
        let end = at(r.end_bound(), true).max(start);
        self.entries[start..end].iter().map(|(k, v)| (k, v))
    }
}

impl<K: std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for HeapOrderedMap<'_, K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(k, v)| (k, v)))
            .finish()
    }
}

/// A vector whose memory is in a heap.
pub type HeapVec<'h, T> = allocator_api2::vec::Vec<T, HeapAlloc<'h>>;
/// A box whose memory is in a heap.
pub type HeapBox<'h, T> = allocator_api2::boxed::Box<T, HeapAlloc<'h>>;
/// The hasher of heap maps: seeded the same in every process (a map's
/// hashes must agree wherever it is read), unlike a per-process random one.
pub type HeapHasher = foldhash::fast::FixedState;
/// A hash map whose memory is in a heap.
///
/// Make it with room (`with_capacity_and_hasher_in`), and keep it: a map
/// with no table (made empty, or shrunk to nothing) points to a static
/// of the process that made it, which other processes cannot read.
pub type HeapMap<'h, K, V> = hashbrown::HashMap<K, V, HeapHasher, HeapAlloc<'h>>;
/// A hash set whose memory is in a heap (made with room, as [`HeapMap`]).
pub type HeapSet<'h, T> = hashbrown::HashSet<T, HeapHasher, HeapAlloc<'h>>;
