//! Checked views of documents: validated access that checks only what it
//! reads.
//!
//! `archive.rs` validates a whole archive before the first read: the cost
//! grows with the document, however little of it a receiver reads. A
//! [`DocView`] is a node of a document archive ([`Value`]) that checks
//! each node as it is reached, and nothing else:
//!
//! * a node: inside the archive, aligned, its tag one of [`Value`]'s;
//! * a list or map: its elements' array inside the archive and aligned
//!   (an element is checked when it is reached);
//! * a string or bytes: by `rkyv`'s own check, when read;
//! * a map's lookup: a binary search that checks each key it compares.
//!
//! Each step does a bounded amount of work, so cycles cannot make a read
//! loop: a reader that follows one repeats only its own steps. Nothing
//! here is `unsafe`: every number is read from the bytes with bounds
//! checks. The archive's bytes must hold still while they are read: they
//! are sealed ([`Heaps::document_view`]).
//!
//! The layout of `rkyv`'s archived values (where each variant keeps its
//! field, how a relative pointer is stored) is read once from values
//! archived by `rkyv` itself, so the view follows the `rkyv` it is built
//! with; the unit tests compare it with `rkyv`'s own reads.

use crate::arg::{decode, type_tag, Heaps};
use crate::document::{ArchivedValue, Value};
use crate::error::HeapError;
use crate::heap::Heap;
use rkyv::rancor::Failure;
use rkyv::string::ArchivedString;
use rkyv::vec::ArchivedVec;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

/// What a node of a document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`Value::Null`].
    Null,
    /// [`Value::Bool`].
    Bool,
    /// [`Value::Int`].
    Int,
    /// [`Value::Float`].
    Float,
    /// [`Value::Str`].
    Str,
    /// [`Value::Bytes`].
    Bytes,
    /// [`Value::List`].
    List,
    /// [`Value::Map`].
    Map,
}

const KINDS: [Kind; 8] = [
    Kind::Null,
    Kind::Bool,
    Kind::Int,
    Kind::Float,
    Kind::Str,
    Kind::Bytes,
    Kind::List,
    Kind::Map,
];

/// Where `rkyv` keeps what, read from values it archived.
#[derive(Debug)]
struct Shape {
    /// A node's size and alignment.
    node: (usize, usize),
    /// Each kind's tag byte and where its field starts in the node.
    tag: [u8; 8],
    field: [usize; 8],
    /// A map entry's size, and where its value starts (its key at 0).
    entry: (usize, usize),
}

// An archived vector is a relative pointer (4 bytes, from its own
// place) and a length (4 bytes), as `DocView::array` reads it.
const _: () = assert!(std::mem::size_of::<ArchivedVec<u8>>() == 8);

fn shape() -> &'static Shape {
    static SHAPE: OnceLock<Shape> = OnceLock::new();
    SHAPE.get_or_init(|| {
        let samples = [
            Value::Null,
            Value::Bool(true),
            Value::Int(1),
            Value::Float(1.0),
            Value::Str("s".into()),
            Value::Bytes(vec![1]),
            Value::List(vec![Value::Null]),
            Value::Map(BTreeMap::from([("k".to_string(), Value::Null)])),
        ];
        let (mut tag, mut field, mut entry) = ([0u8; 8], [0usize; 8], (0, 0));
        for (k, v) in samples.iter().enumerate() {
            let b = rkyv::to_bytes::<Failure>(v).expect("a sample archives");
            let a = rkyv::access::<ArchivedValue, Failure>(&b).expect("a sample validates");
            let at = |p: *const u8| p as usize - a as *const ArchivedValue as usize;
            tag[k] = b[a as *const ArchivedValue as usize - b.as_ptr() as usize];
            field[k] = match a {
                ArchivedValue::Null => 1,
                ArchivedValue::Bool(x) => at(x as *const bool as *const u8),
                ArchivedValue::Int(x) => at(x as *const _ as *const u8),
                ArchivedValue::Float(x) => at(x as *const _ as *const u8),
                ArchivedValue::Str(x) => at(x as *const _ as *const u8),
                ArchivedValue::Bytes(x) => at(x as *const _ as *const u8),
                ArchivedValue::List(x) => at(x as *const _ as *const u8),
                ArchivedValue::Map(x) => {
                    let e = &x[0];
                    let key = e as *const _ as usize;
                    entry = (
                        std::mem::size_of_val(e),
                        &e.value as *const ArchivedValue as usize - key,
                    );
                    at(x as *const _ as *const u8)
                }
            };
        }
        Shape {
            node: (
                std::mem::size_of::<ArchivedValue>(),
                std::mem::align_of::<ArchivedValue>(),
            ),
            tag,
            field,
            entry,
        }
    })
}

/// A node of a document archive, checked as it is read (see the module
/// docs). Every accessor returns an error for bytes that are not what
/// they should be: `Invalid` naming what was wrong.
#[derive(Debug, Clone, Copy)]
pub struct DocView<'a> {
    bytes: &'a [u8],
    pos: usize,
    kind: Kind,
}

fn bad(why: &str, pos: usize) -> HeapError {
    HeapError::Invalid(format!("{why} (at byte {pos} of the archive)"))
}

/// The little-endian word of `N` bytes at `at` (checked by the caller).
fn word<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut w = [0u8; N];
    w.copy_from_slice(&b[at..at + N]);
    w
}

impl<'a> DocView<'a> {
    /// The root of the archive `bytes` (as `rkyv` places it: at the end).
    pub fn root(bytes: &'a [u8]) -> Result<DocView<'a>, HeapError> {
        let (size, align) = shape().node;
        let pos = bytes
            .len()
            .checked_sub(size)
            .map(|p| p - p % align)
            .ok_or_else(|| bad("too short for a document", 0))?;
        DocView::at(bytes, pos)
    }

    /// The node at `pos`: inside, aligned, a known tag.
    fn at(bytes: &'a [u8], pos: usize) -> Result<DocView<'a>, HeapError> {
        let (size, align) = shape().node;
        let addr = (bytes.as_ptr() as usize).wrapping_add(pos);
        if pos.checked_add(size).is_none_or(|e| e > bytes.len()) || !addr.is_multiple_of(align) {
            return Err(bad("a node outside the archive or misaligned", pos));
        }
        let t = bytes[pos];
        let k = shape()
            .tag
            .iter()
            .position(|&x| x == t)
            .ok_or_else(|| bad("a node of no known kind", pos))?;
        let kind = KINDS[k];
        if kind == Kind::Bool && bytes[pos + shape().field[1]] > 1 {
            return Err(bad("a truth value that is neither", pos));
        }
        Ok(DocView { bytes, pos, kind })
    }

    /// What it is.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    fn field(&self, kind: Kind) -> Result<usize, HeapError> {
        if self.kind != kind {
            return Err(HeapError::Invalid(format!(
                "a {:?} read as a {kind:?}",
                self.kind
            )));
        }
        Ok(self.pos + shape().field[kind as usize])
    }

    /// Whether it is null.
    pub fn is_null(&self) -> bool {
        self.kind == Kind::Null
    }

    /// Its truth value.
    pub fn as_bool(&self) -> Result<bool, HeapError> {
        Ok(self.bytes[self.field(Kind::Bool)?] == 1)
    }

    /// Its integer.
    pub fn as_i64(&self) -> Result<i64, HeapError> {
        Ok(i64::from_le_bytes(word(self.bytes, self.field(Kind::Int)?)))
    }

    /// Its number.
    pub fn as_f64(&self) -> Result<f64, HeapError> {
        Ok(f64::from_le_bytes(word(
            self.bytes,
            self.field(Kind::Float)?,
        )))
    }

    /// Its text, checked (in bounds, UTF-8) by `rkyv`.
    pub fn as_str(&self) -> Result<&'a str, HeapError> {
        let at = self.field(Kind::Str)?;
        string_at(self.bytes, at)
    }

    /// Its bytes, checked (in bounds) by `rkyv`: a view, not a copy.
    pub fn as_bytes(&self) -> Result<&'a [u8], HeapError> {
        let at = self.field(Kind::Bytes)?;
        rkyv::api::low::access_pos::<ArchivedVec<u8>, Failure>(self.bytes, at)
            .map(|v| v.as_slice())
            .map_err(|_| bad("bytes outside the archive", at))
    }

    /// Where the elements of the vector at `at` start, and how many there
    /// are, each `size` bytes aligned to `align`: all inside the archive.
    fn array(&self, at: usize, size: usize, align: usize) -> Result<(usize, usize), HeapError> {
        let off = i64::from(i32::from_le_bytes(word(self.bytes, at)));
        let len = u32::from_le_bytes(word(self.bytes, at + 4)) as usize;
        let start = (at as i64)
            .checked_add(off)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| bad("an array before the archive", at))?;
        let end = len.checked_mul(size).and_then(|n| n.checked_add(start));
        let addr = (self.bytes.as_ptr() as usize).wrapping_add(start);
        if end.is_none_or(|e| e > self.bytes.len()) || !addr.is_multiple_of(align) {
            return Err(bad("an array outside the archive or misaligned", at));
        }
        Ok((start, len))
    }

    fn list(&self) -> Result<(usize, usize), HeapError> {
        let at = self.field(Kind::List)?;
        let (size, align) = shape().node;
        self.array(at, size, align)
    }

    fn map(&self) -> Result<(usize, usize), HeapError> {
        let at = self.field(Kind::Map)?;
        self.array(at, shape().entry.0, shape().node.1)
    }

    /// How many elements a list, or entries a map, has.
    pub fn len(&self) -> Result<usize, HeapError> {
        match self.kind {
            Kind::Map => self.map().map(|(_, n)| n),
            _ => self.list().map(|(_, n)| n),
        }
    }

    /// Whether a list or map is empty.
    pub fn is_empty(&self) -> Result<bool, HeapError> {
        self.len().map(|n| n == 0)
    }

    /// Element `i` of a list (`None` past its end).
    pub fn index(&self, i: usize) -> Result<Option<DocView<'a>>, HeapError> {
        let (start, len) = self.list()?;
        if i >= len {
            return Ok(None);
        }
        DocView::at(self.bytes, start + i * shape().node.0).map(Some)
    }

    /// Entry `i` of a map: its key and its value.
    pub fn entry(&self, i: usize) -> Result<Option<(&'a str, DocView<'a>)>, HeapError> {
        let (start, len) = self.map()?;
        if i >= len {
            return Ok(None);
        }
        let e = start + i * shape().entry.0;
        let key = string_at(self.bytes, e)?;
        Ok(Some((key, DocView::at(self.bytes, e + shape().entry.1)?)))
    }

    /// The value of a map's `key`: a binary search over its entries, each
    /// key it compares checked. (A map its sender did not sort may hide
    /// keys from it; it never reads outside the archive.)
    pub fn get(&self, key: &str) -> Result<Option<DocView<'a>>, HeapError> {
        let (start, len) = self.map()?;
        let (mut lo, mut hi) = (0, len);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let e = start + mid * shape().entry.0;
            match string_at(self.bytes, e)?.cmp(key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => {
                    return DocView::at(self.bytes, e + shape().entry.1).map(Some)
                }
            }
        }
        Ok(None)
    }
}

/// The archived string at `at`, checked by `rkyv` (its bytes inside the
/// archive, UTF-8).
fn string_at(bytes: &[u8], at: usize) -> Result<&str, HeapError> {
    rkyv::api::low::access_pos::<ArchivedString, Failure>(bytes, at)
        .map(|s| s.as_str())
        .map_err(|_| bad("text outside the archive or not UTF-8", at))
}

/// A sealed document, read through checked views. It keeps its heap open.
#[derive(Debug)]
pub struct Viewed {
    _heap: Arc<Heap>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: a view of sealed shared memory, read only, through safe code.
unsafe impl Send for Viewed {}
// SAFETY: as above.
unsafe impl Sync for Viewed {}

impl Viewed {
    /// The document's root node.
    pub fn root(&self) -> Result<DocView<'_>, HeapError> {
        DocView::root(self.bytes())
    }

    /// The archive's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: in the heap's mapping (checked on arrival), kept open by
        // `_heap`, and sealed: its sender cannot change it while this
        // lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Heaps {
    /// The document (an archived [`Value`]) a sealed argument passes, read
    /// through checked views: the seal verified, then each node checked
    /// only when it is read. For a receiver that reads a few fields of a
    /// large document it does not trust.
    pub fn document_view(&self, bytes: &[u8]) -> Result<Viewed, HeapError> {
        let d = decode(bytes)?;
        let align = shape().node.1;
        let (heap, ptr) = self.place_raw(&d, type_tag::<ArchivedValue>(), align)?;
        heap.verify_sealed(d.seal, ptr, d.size)?;
        Ok(Viewed {
            _heap: heap,
            ptr,
            len: d.size as usize,
        })
    }
}

/// Reads all it can of a view (64 elements of each list or map, 8 levels
/// deep), errors ignored: for bytes a fuzzer or a test edited. Returns
/// how many nodes it reached.
pub(crate) fn read_all(v: DocView<'_>, depth: usize) -> usize {
    if depth > 8 {
        return 0;
    }
    let mut n = 1;
    let _ = (
        v.as_bool(),
        v.as_i64(),
        v.as_f64(),
        v.as_str(),
        v.as_bytes(),
    );
    for i in 0..v.len().unwrap_or(0).min(64) {
        if let Ok(Some(x)) = v.index(i) {
            n += read_all(x, depth + 1);
        }
        if let Ok(Some((_, x))) = v.entry(i) {
            n += read_all(x, depth + 1);
        }
    }
    let _ = v.get("title");
    n
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rkyv::util::AlignedVec;

    fn doc() -> Value {
        let mut m = BTreeMap::new();
        m.insert("id".to_string(), Value::Int(-42));
        m.insert("pi".to_string(), Value::Float(3.5));
        m.insert("ok".to_string(), Value::Bool(true));
        m.insert("none".to_string(), Value::Null);
        m.insert(
            "title".to_string(),
            Value::Str("a longer title than inline".into()),
        );
        m.insert("raw".to_string(), Value::Bytes((0..200u8).collect()));
        m.insert(
            "list".to_string(),
            Value::List((0..50).map(Value::Int).collect()),
        );
        Value::Map(m)
    }

    fn archive(v: &Value) -> AlignedVec {
        rkyv::to_bytes::<Failure>(v).unwrap()
    }

    /// Reads every node of `v` through a view, as `rkyv` reads it.
    fn same(view: DocView<'_>, v: &ArchivedValue) {
        match v {
            ArchivedValue::Null => assert!(view.is_null()),
            ArchivedValue::Bool(b) => assert_eq!(view.as_bool().unwrap(), *b),
            ArchivedValue::Int(i) => assert_eq!(view.as_i64().unwrap(), i.to_native()),
            ArchivedValue::Float(f) => assert_eq!(view.as_f64().unwrap(), f.to_native()),
            ArchivedValue::Str(s) => assert_eq!(view.as_str().unwrap(), s.as_str()),
            ArchivedValue::Bytes(b) => assert_eq!(view.as_bytes().unwrap(), &b[..]),
            ArchivedValue::List(l) => {
                assert_eq!(view.len().unwrap(), l.len());
                for (i, x) in l.iter().enumerate() {
                    same(view.index(i).unwrap().unwrap(), x);
                }
                assert!(view.index(l.len()).unwrap().is_none());
            }
            ArchivedValue::Map(m) => {
                assert_eq!(view.len().unwrap(), m.len());
                for (i, e) in m.iter().enumerate() {
                    let (k, x) = view.entry(i).unwrap().unwrap();
                    assert_eq!(k, e.key.as_str());
                    same(x, &e.value);
                    same(view.get(k).unwrap().unwrap(), &e.value);
                }
                assert!(view.get("no such key").unwrap().is_none());
            }
        }
    }

    #[test]
    fn a_view_reads_what_rkyv_reads() {
        let b = archive(&doc());
        let a = rkyv::access::<ArchivedValue, Failure>(&b).unwrap();
        let root = DocView::root(&b).unwrap();
        assert_eq!(root.kind(), Kind::Map);
        same(root, a);
        assert_eq!(root.get("id").unwrap().unwrap().as_i64().unwrap(), -42);
        // A read of the wrong kind is an error, not a misread.
        assert!(root.get("id").unwrap().unwrap().as_str().is_err());
        assert!(root.as_i64().is_err());
        // Nested and empty ones too.
        for v in [
            Value::List(vec![]),
            Value::Map(BTreeMap::new()),
            Value::List(vec![doc(), Value::List(vec![doc()])]),
            Value::Str(String::new()),
            Value::Bytes(vec![]),
        ] {
            let b = archive(&v);
            same(
                DocView::root(&b).unwrap(),
                rkyv::access::<ArchivedValue, Failure>(&b).unwrap(),
            );
        }
    }

    #[test]
    fn edited_bytes_are_errors_or_reads_inside_the_archive() {
        let pristine = archive(&doc());
        let mut b = AlignedVec::<16>::new();
        b.extend_from_slice(&pristine);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..3000 {
            b.as_mut_slice().copy_from_slice(&pristine);
            for _ in 0..4 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let at = (seed % b.len() as u64) as usize;
                b[at] = (seed >> 32) as u8;
            }
            if let Ok(r) = DocView::root(&b) {
                read_all(r, 0);
            }
        }
        // The tag of the root, made unknown.
        b.as_mut_slice().copy_from_slice(&pristine);
        let (size, align) = shape().node;
        let root = (b.len() - size) / align * align;
        b[root] = 0xee;
        assert!(matches!(DocView::root(&b), Err(HeapError::Invalid(_))));
        assert!(DocView::root(&[]).is_err());
    }
}
