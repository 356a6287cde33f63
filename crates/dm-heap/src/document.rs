//! Documents: values that describe themselves (maps, lists, strings,
//! numbers, bytes), for readers that know no Rust type, such as Python.
//! A document travels as an `rkyv` archive of a [`Value`] in a heap, and
//! is read as every archive is (validated, copied out, or trusted).

use std::collections::BTreeMap;

/// A document: JSON's values, and bytes.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[rkyv(crate = rkyv, attr(derive(Debug)))]
#[rkyv(serialize_bounds(
    __S: rkyv::ser::Writer + rkyv::ser::Allocator,
    __S::Error: rkyv::rancor::Source,
))]
#[rkyv(deserialize_bounds(__D::Error: rkyv::rancor::Source))]
#[rkyv(bytecheck(bounds(__C: rkyv::validation::ArchiveContext)))]
pub enum Value {
    /// Nothing (JSON's null, Python's None).
    Null,
    /// A truth value.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// Text.
    Str(String),
    /// Bytes, read in place (a view, not a copy).
    Bytes(Vec<u8>),
    /// A list of values.
    List(#[rkyv(omit_bounds)] Vec<Value>),
    /// Values by text key, in key order (archived as a vector of
    /// entries sorted by key, which a [`DocView`](crate::DocView) searches
    /// checking only the entries it looks at).
    Map(#[rkyv(omit_bounds, with = rkyv::with::AsVec)] BTreeMap<String, Value>),
}
