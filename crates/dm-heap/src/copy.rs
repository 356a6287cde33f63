//! Deep copies into a heap and out of one (RPCool's `copy_from`).
//!
//! [`Heap::copy_from`] copies a value, with everything it points to,
//! into a heap: from another heap (a value a call passed, to keep after
//! the call), or from ordinary memory (a `Vec`, a `String`, a map).
//! [`CopyFrom::copy_out`] copies a heap value out to ordinary memory
//! (`Vec`, `String`, `Box`, `HashMap`, `BTreeMap`).
//!
//! Every allocation of a copy into a heap is fallible: a heap without
//! room is [`HeapError::Full`], and what was copied so far is given back.
//! A copy reads its source as [`Arg::get`](crate::Arg::get) does: the
//! sender of a value must be trusted (an untrusted one sends archives,
//! which `Heaps::archived_copy` validates as it copies them out).
//!
//! A type of the user's implements [`CopyFrom`] field by field:
//!
//! ```
//! use dm_heap::{CopyFrom, HeapAlloc, HeapError, HeapString, HeapVec};
//! struct Point<'h> { name: HeapString<'h>, xs: HeapVec<'h, f64> }
//! struct OwnedPoint { name: String, xs: Vec<f64> }
//! impl CopyFrom for Point<'_> {
//!     type In<'h> = Point<'h>;
//!     type Owned = OwnedPoint;
//!     fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Point<'h>, HeapError> {
//!         Ok(Point { name: self.name.copy_in(a)?, xs: self.xs.copy_in(a)? })
//!     }
//!     fn copy_out(&self) -> OwnedPoint {
//!         OwnedPoint { name: self.name.copy_out(), xs: self.xs.copy_out() }
//!     }
//! }
//! ```

use crate::alloc::HeapAlloc;
use crate::collections::{
    HeapBox, HeapHasher, HeapMap, HeapOrderedMap, HeapSet, HeapString, HeapVec,
};
use crate::error::HeapError;
use crate::heap::Heap;
use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hash;

/// A value that can be deep-copied into a heap and out of one (see the
/// module docs).
pub trait CopyFrom {
    /// The same value with its memory in a heap.
    type In<'h>;
    /// The same value in ordinary memory.
    type Owned;
    /// A deep copy whose every allocation is `a`'s.
    fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Self::In<'h>, HeapError>;
    /// A deep copy in ordinary memory.
    fn copy_out(&self) -> Self::Owned;
}

impl Heap {
    /// A deep copy of `value` in this heap, itself in the heap too (as
    /// [`put`](Self::put) places it): to keep a value a call passed after
    /// the call, or to move ordinary data into a heap.
    pub fn copy_from<T: CopyFrom + ?Sized>(&self, value: &T) -> Result<&T::In<'_>, HeapError> {
        self.put(value.copy_in(self.alloc())?)
    }
}

/// The error of a reservation of `n` items of `T` that failed.
fn full<T>(n: usize) -> HeapError {
    HeapError::Full(n.saturating_mul(std::mem::size_of::<T>()) as u64)
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl CopyFrom for $t {
            type In<'h> = $t;
            type Owned = $t;
            fn copy_in<'h>(&self, _: HeapAlloc<'h>) -> Result<$t, HeapError> {
                Ok(*self)
            }
            fn copy_out(&self) -> $t {
                *self
            }
        }
    )*};
}
plain!(
    u8,
    u16,
    u32,
    u64,
    u128,
    usize,
    i8,
    i16,
    i32,
    i64,
    i128,
    isize,
    f32,
    f64,
    bool,
    char,
    ()
);

/// A heap vector of copies of `items`.
fn vec_in<'h, 'a, T: CopyFrom + 'a>(
    items: impl ExactSizeIterator<Item = &'a T>,
    a: HeapAlloc<'h>,
) -> Result<HeapVec<'h, T::In<'h>>, HeapError> {
    let mut v = HeapVec::new_in(a);
    v.try_reserve_exact(items.len())
        .map_err(|_| full::<T::In<'h>>(items.len()))?;
    for x in items {
        v.push(x.copy_in(a)?);
    }
    Ok(v)
}

/// Sequences: copied in as heap vectors, out as vectors.
macro_rules! like_vec {
    ($($src:ty),*) => {$(
        impl<T: CopyFrom> CopyFrom for $src {
            type In<'h> = HeapVec<'h, T::In<'h>>;
            type Owned = Vec<T::Owned>;
            fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Self::In<'h>, HeapError> {
                vec_in(self.iter(), a)
            }
            fn copy_out(&self) -> Vec<T::Owned> {
                self.iter().map(CopyFrom::copy_out).collect()
            }
        }
    )*};
}
like_vec!(HeapVec<'_, T>, Vec<T>, [T]);

/// Text: copied in as heap strings, out as strings.
macro_rules! like_str {
    ($($src:ty),*) => {$(
        impl CopyFrom for $src {
            type In<'h> = HeapString<'h>;
            type Owned = String;
            fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<HeapString<'h>, HeapError> {
                HeapString::try_from_str_in(Borrow::<str>::borrow(self), a)
            }
            fn copy_out(&self) -> String {
                Borrow::<str>::borrow(self).to_owned()
            }
        }
    )*};
}
like_str!(HeapString<'_>, str, String);

impl<T: CopyFrom> CopyFrom for HeapBox<'_, T> {
    type In<'h> = HeapBox<'h, T::In<'h>>;
    type Owned = Box<T::Owned>;
    fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Self::In<'h>, HeapError> {
        HeapBox::try_new_in((**self).copy_in(a)?, a).map_err(|_| full::<T::In<'h>>(1))
    }
    fn copy_out(&self) -> Box<T::Owned> {
        Box::new((**self).copy_out())
    }
}

impl<T: CopyFrom> CopyFrom for Option<T> {
    type In<'h> = Option<T::In<'h>>;
    type Owned = Option<T::Owned>;
    fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Self::In<'h>, HeapError> {
        self.as_ref().map(|x| x.copy_in(a)).transpose()
    }
    fn copy_out(&self) -> Option<T::Owned> {
        self.as_ref().map(CopyFrom::copy_out)
    }
}

impl<A: CopyFrom, B: CopyFrom> CopyFrom for (A, B) {
    type In<'h> = (A::In<'h>, B::In<'h>);
    type Owned = (A::Owned, B::Owned);
    fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Self::In<'h>, HeapError> {
        Ok((self.0.copy_in(a)?, self.1.copy_in(a)?))
    }
    fn copy_out(&self) -> Self::Owned {
        (self.0.copy_out(), self.1.copy_out())
    }
}

/// A heap map of copies of `entries` (at least one entry's room: a map
/// with no table points to its process's static).
fn map_in<'h, 'a, K, V>(
    entries: impl ExactSizeIterator<Item = (&'a K, &'a V)>,
    a: HeapAlloc<'h>,
) -> Result<HeapMap<'h, K::In<'h>, V::In<'h>>, HeapError>
where
    K: CopyFrom + 'a,
    V: CopyFrom + 'a,
    K::In<'h>: Eq + Hash,
{
    let mut m = HeapMap::with_hasher_in(HeapHasher::default(), a);
    let n = entries.len().max(1);
    m.try_reserve(n)
        .map_err(|_| full::<(K::In<'h>, V::In<'h>)>(n))?;
    for (k, v) in entries {
        m.insert(k.copy_in(a)?, v.copy_in(a)?);
    }
    Ok(m)
}

/// Maps of `$in` (copied in as `$heap`, out as `$out`): heap and
/// ordinary ones alike.
macro_rules! like_map {
    ($bound:ident, $fill:ident, $heap:ident, $out:ident: $($src:ty),*) => {$(
        impl<K, V> CopyFrom for $src
        where
            K: CopyFrom + $bound,
            V: CopyFrom,
            for<'h> K::In<'h>: $bound,
            K::Owned: $bound,
        {
            type In<'h> = $heap<'h, K::In<'h>, V::In<'h>>;
            type Owned = $out<K::Owned, V::Owned>;
            fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Self::In<'h>, HeapError> {
                $fill(self.iter(), a)
            }
            fn copy_out(&self) -> Self::Owned {
                self.iter().map(|(k, v)| (k.copy_out(), v.copy_out())).collect()
            }
        }
    )*};
}
/// Keys of hash maps.
trait HashKey: Eq + Hash {}
impl<T: Eq + Hash> HashKey for T {}
like_map!(HashKey, map_in, HeapMap, HashMap: HeapMap<'_, K, V>, HashMap<K, V>);

impl<T> CopyFrom for HeapSet<'_, T>
where
    T: CopyFrom,
    for<'h> T::In<'h>: Eq + Hash,
    T::Owned: Eq + Hash,
{
    type In<'h> = HeapSet<'h, T::In<'h>>;
    type Owned = HashSet<T::Owned>;
    fn copy_in<'h>(&self, a: HeapAlloc<'h>) -> Result<Self::In<'h>, HeapError> {
        let mut s = HeapSet::with_hasher_in(HeapHasher::default(), a);
        let n = self.len().max(1);
        s.try_reserve(n).map_err(|_| full::<T::In<'h>>(n))?;
        for x in self {
            s.insert(x.copy_in(a)?);
        }
        Ok(s)
    }
    fn copy_out(&self) -> HashSet<T::Owned> {
        self.iter().map(CopyFrom::copy_out).collect()
    }
}

/// A heap ordered map of copies of `entries`, which come in key order.
fn ordered_in<'h, 'a, K, V>(
    entries: impl ExactSizeIterator<Item = (&'a K, &'a V)>,
    a: HeapAlloc<'h>,
) -> Result<HeapOrderedMap<'h, K::In<'h>, V::In<'h>>, HeapError>
where
    K: CopyFrom + 'a,
    V: CopyFrom + 'a,
    K::In<'h>: Ord,
{
    let mut v = HeapVec::new_in(a);
    v.try_reserve_exact(entries.len())
        .map_err(|_| full::<(K::In<'h>, V::In<'h>)>(entries.len()))?;
    for (k, x) in entries {
        v.push((k.copy_in(a)?, x.copy_in(a)?));
    }
    Ok(HeapOrderedMap::from_sorted(v))
}

like_map!(Ord, ordered_in, HeapOrderedMap, BTreeMap: HeapOrderedMap<'_, K, V>, BTreeMap<K, V>);
