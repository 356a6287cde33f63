//! The `Ref` wire format (version 1).
//!
//! A `Ref` is 40 bytes that can travel in any message. It names a frozen
//! snapshot of a buffer range held by a descriptor in one pool:
//!
//! | bytes  | field       | notes                                           |
//! |--------|-------------|-------------------------------------------------|
//! | 0      | version     | `REF_VERSION` (1)                               |
//! | 1      | backend     | 0 = shared pool, 1 = memory server              |
//! | 2..4   | reserved    | must be zero                                    |
//! | 4..8   | descriptor  | index in the pool's descriptor table            |
//! | 8..16  | pool id     | random id of the pool (or the memory server)    |
//! | 16..24 | tag         | 64 random bits chosen when the Ref was created  |
//! | 24..28 | generation  | the descriptor's generation when created        |
//! | 28..32 | reserved    | must be zero                                    |
//! | 32..40 | length      | bytes in the snapshot, > 0                      |
//!
//! All integers little-endian. The tag and generation make a Ref unforgeable
//! in practice: the pool rejects a Ref whose tag or generation does not match
//! the descriptor it names (`docs/design.md`, *What dmrpc trusts*).

/// Current version of the Ref encoding.
pub const REF_VERSION: u8 = 1;
/// Backend byte of a shared-pool Ref.
pub const BACKEND_POOL: u8 = 0;
/// Backend byte of a memory server's Ref (`pool_id` is the server's id).
pub const BACKEND_MEMSERVER: u8 = 1;

/// A capability naming a frozen snapshot of a buffer range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ref {
    /// Which backend made it ([`BACKEND_POOL`] or [`BACKEND_MEMSERVER`]).
    pub backend: u8,
    /// Pool id (or memory server id).
    pub pool_id: u64,
    /// Descriptor index.
    pub desc: u32,
    /// Descriptor generation.
    pub generation: u32,
    /// Random tag.
    pub tag: u64,
    /// Snapshot length in bytes.
    pub len: u64,
}

/// Why bytes are not a Ref.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RefDecodeError {
    /// Wrong number of bytes.
    #[error("a Ref is {expected} bytes, got {got}")]
    Length {
        /// Expected length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// Unknown encoding version.
    #[error("unknown Ref version {0} (this build reads version {REF_VERSION})")]
    Version(u8),
    /// Unknown backend byte.
    #[error("unknown Ref backend {0}")]
    Backend(u8),
    /// Reserved bytes were not zero.
    #[error("reserved bytes of the Ref are not zero")]
    Reserved,
    /// Zero length.
    #[error("a Ref cannot have length zero")]
    ZeroLength,
}

impl Ref {
    /// Encoded size in bytes.
    pub const SIZE: usize = 40;

    /// Encodes the Ref.
    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0] = REF_VERSION;
        b[1] = self.backend;
        b[4..8].copy_from_slice(&self.desc.to_le_bytes());
        b[8..16].copy_from_slice(&self.pool_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.tag.to_le_bytes());
        b[24..28].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a Ref, rejecting anything that is not a well-formed version-1
    /// Ref. Never panics. (Whether it names a live snapshot is the pool's
    /// question.)
    pub fn from_bytes(b: &[u8]) -> Result<Self, RefDecodeError> {
        let b: &[u8; Self::SIZE] = b.try_into().map_err(|_| RefDecodeError::Length {
            expected: Self::SIZE,
            got: b.len(),
        })?;
        if b[0] != REF_VERSION {
            return Err(RefDecodeError::Version(b[0]));
        }
        if b[1] != BACKEND_POOL && b[1] != BACKEND_MEMSERVER {
            return Err(RefDecodeError::Backend(b[1]));
        }
        if b[2..4] != [0, 0] || b[28..32] != [0, 0, 0, 0] {
            return Err(RefDecodeError::Reserved);
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let r = Ref {
            backend: b[1],
            desc: u32_at(4),
            pool_id: u64_at(8),
            tag: u64_at(16),
            generation: u32_at(24),
            len: u64_at(32),
        };
        if r.len == 0 {
            return Err(RefDecodeError::ZeroLength);
        }
        Ok(r)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(backend in 0u8..2, pool_id: u64, desc: u32, generation: u32, tag: u64, len in 1u64..) {
            let r = Ref { backend, pool_id, desc, generation, tag, len };
            prop_assert_eq!(Ref::from_bytes(&r.to_bytes()), Ok(r));
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Ref::from_bytes(&b);
        }
    }

    #[test]
    fn rejects_malformed() {
        let r = Ref {
            backend: BACKEND_POOL,
            pool_id: 1,
            desc: 2,
            generation: 3,
            tag: 4,
            len: 5,
        };
        let good = r.to_bytes();
        assert!(matches!(
            Ref::from_bytes(&good[..39]),
            Err(RefDecodeError::Length { .. })
        ));
        let mut b = good;
        b[0] = 9;
        assert_eq!(Ref::from_bytes(&b), Err(RefDecodeError::Version(9)));
        let mut b = good;
        b[1] = 2;
        assert_eq!(Ref::from_bytes(&b), Err(RefDecodeError::Backend(2)));
        let mut b = good;
        b[30] = 1;
        assert_eq!(Ref::from_bytes(&b), Err(RefDecodeError::Reserved));
        let mut b = good;
        b[32..40].fill(0);
        assert_eq!(Ref::from_bytes(&b), Err(RefDecodeError::ZeroLength));
    }
}
