//! The segment table's bytes: the header and entries at the start of a
//! device, how they are written, and how bytes read back are checked.
//!
//! Everything here is pure: it turns bytes into values and back. The
//! bytes come from a device other processes (and other hosts) write, so
//! [`Header::parse`] and [`Entry::parse`] take any input and return a
//! value whose offsets, sizes and names are within bounds, or say what is
//! wrong. [`check_entries`] then refuses overlapping regions.
//!
//! Format, version [`NS_VERSION`] (all integers little-endian):
//!
//! ```text
//! 0       header, 64 bytes
//!   0   magic "DMRPCNS\0"      8  version u32      12 entries u32
//!   16  entry length u32       20 (zero)          24 table length u64
//!   32  device length u64      40 alignment u64   48 formatted at (ms) u64
//!   56  FNV-1a of bytes 0..56
//! 4096    entries, ENTRY_LEN bytes each
//!   0   state u32 (0 free, 1 creating, 2 ready, 3 removing)
//!   4   reference count u32 (attachments, as last counted)
//!   8   offset u64            16 size u64        24 generation u64
//!   32  created at (ms) u64   40 owner uid u32   44 owner pid u32
//!   48  owner host u64        56 name, NAME_MAX bytes, zero-padded
//!   112 FNV-1a of bytes 8..112
//!   120 (zero)
//! TABLE_LEN  the first region
//! ```
//!
//! Regions start and end on [`ALIGN`] (2 MiB, a huge page), so that a
//! pool inside one can sit on huge pages.

use crate::layout::fnv1a;

/// The table's magic.
pub(crate) const NS_MAGIC: [u8; 8] = *b"DMRPCNS\0";
/// The table format this build writes and reads.
pub const NS_VERSION: u32 = 1;
/// Bytes at the start of the device the table keeps for itself.
pub const TABLE_LEN: u64 = 2 << 20;
/// Region alignment.
pub const ALIGN: u64 = 2 << 20;
/// Length of the header.
pub(crate) const HEADER_LEN: usize = 64;
/// Where the entries start.
pub(crate) const ENTRIES_OFF: usize = 4096;
/// Length of one entry.
pub(crate) const ENTRY_LEN: usize = 128;
/// Entries in a table: namespaces one device holds at most.
pub const MAX_ENTRIES: u32 = 64;
/// The longest namespace name, in bytes.
pub const NAME_MAX: usize = 56;
/// Where the reference count sits in an entry (an atomic `u32`).
pub(crate) const REFS_OFF: usize = 4;

const SUM_FROM: usize = 8;
const SUM_TO: usize = 112;

/// The state of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Unused.
    Free,
    /// Being made: its pool is not written yet. Left so by a creator that
    /// died; the next change of the table frees it.
    Creating,
    /// In service.
    Ready,
    /// Being removed. Left so by a remover that died; the next change of
    /// the table finishes the removal.
    Removing,
}

impl State {
    fn from_word(w: u32) -> Option<State> {
        Some(match w {
            0 => State::Free,
            1 => State::Creating,
            2 => State::Ready,
            3 => State::Removing,
            _ => return None,
        })
    }

    /// The word stored for this state.
    pub fn word(self) -> u32 {
        match self {
            State::Free => 0,
            State::Creating => 1,
            State::Ready => 2,
            State::Removing => 3,
        }
    }

    /// How `dmrpc ns ls` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Free => "free",
            State::Creating => "creating",
            State::Ready => "ready",
            State::Removing => "removing",
        }
    }
}

/// The table header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// Bytes of the device the namespaces may use.
    pub device_len: u64,
    /// When the device was formatted (ms since the epoch).
    pub formatted_ms: u64,
}

/// Why table bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TableError {
    /// No table: the bytes do not start with the magic.
    NoTable,
    /// A table of another format version.
    Version(u32),
    /// A table whose bytes are inconsistent (what is wrong).
    Corrupt(String),
}

impl Header {
    /// Encodes the header.
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&NS_MAGIC);
        b[8..12].copy_from_slice(&NS_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&MAX_ENTRIES.to_le_bytes());
        b[16..20].copy_from_slice(&(ENTRY_LEN as u32).to_le_bytes());
        b[24..32].copy_from_slice(&TABLE_LEN.to_le_bytes());
        b[32..40].copy_from_slice(&self.device_len.to_le_bytes());
        b[40..48].copy_from_slice(&ALIGN.to_le_bytes());
        b[48..56].copy_from_slice(&self.formatted_ms.to_le_bytes());
        let sum = fnv1a(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses and checks a header (any bytes). `backing_len`, when known,
    /// is the file's length: a table may not claim more than the file has.
    pub(crate) fn parse(b: &[u8], backing_len: Option<u64>) -> Result<Header, TableError> {
        if b.len() < HEADER_LEN || b[0..8] != NS_MAGIC {
            return Err(TableError::NoTable);
        }
        let version = u32_at(b, 8);
        if version != NS_VERSION {
            return Err(TableError::Version(version));
        }
        if u64_at(b, 56) != fnv1a(&b[..56]) {
            return Err(TableError::Corrupt("header checksum does not match".into()));
        }
        let fixed = [
            (
                "entry count",
                u64::from(u32_at(b, 12)),
                u64::from(MAX_ENTRIES),
            ),
            ("entry length", u64::from(u32_at(b, 16)), ENTRY_LEN as u64),
            ("table length", u64_at(b, 24), TABLE_LEN),
            ("alignment", u64_at(b, 40), ALIGN),
        ];
        for (what, found, want) in fixed {
            if found != want {
                return Err(TableError::Corrupt(format!(
                    "{what} {found} where version {NS_VERSION} has {want}"
                )));
            }
        }
        let device_len = u64_at(b, 32);
        if device_len < TABLE_LEN + ALIGN || !device_len.is_multiple_of(ALIGN) {
            return Err(TableError::Corrupt(format!(
                "device length {device_len} is not a multiple of {ALIGN} holding one region"
            )));
        }
        if let Some(len) = backing_len.filter(|&l| l < device_len) {
            return Err(TableError::Corrupt(format!(
                "the table says the device has {device_len} bytes; it has {len}"
            )));
        }
        Ok(Header {
            device_len,
            formatted_ms: u64_at(b, 48),
        })
    }
}

/// One entry of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Its state.
    pub state: State,
    /// Attachments, as last counted.
    pub refs: u32,
    /// Where its region starts on the device.
    pub offset: u64,
    /// The region's length.
    pub size: u64,
    /// Bumped by every creation, so that an entry reused for another
    /// namespace is told apart from the one a process attached.
    pub generation: u64,
    /// When it was created (ms since the epoch).
    pub created_ms: u64,
    /// The user who created it.
    pub owner_uid: u32,
    /// The process that created it.
    pub owner_pid: u32,
    /// The host of that process (the pool's host id).
    pub owner_host: u64,
    /// Its name.
    pub name: String,
}

/// Whether `name` may name a namespace: 1 to [`NAME_MAX`] bytes of
/// letters, digits, `.`, `_` and `-`, not `.` or `..`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

impl Entry {
    /// Encodes the entry.
    pub(crate) fn encode(&self) -> [u8; ENTRY_LEN] {
        let mut b = [0u8; ENTRY_LEN];
        b[0..4].copy_from_slice(&self.state.word().to_le_bytes());
        b[4..8].copy_from_slice(&self.refs.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.created_ms.to_le_bytes());
        b[40..44].copy_from_slice(&self.owner_uid.to_le_bytes());
        b[44..48].copy_from_slice(&self.owner_pid.to_le_bytes());
        b[48..56].copy_from_slice(&self.owner_host.to_le_bytes());
        let n = self.name.len().min(NAME_MAX);
        b[56..56 + n].copy_from_slice(&self.name.as_bytes()[..n]);
        let sum = fnv1a(&b[SUM_FROM..SUM_TO]);
        b[SUM_TO..SUM_TO + 8].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses and checks an entry (any bytes) of a table whose device has
    /// `device_len` bytes. `Ok(None)` for a free entry.
    pub(crate) fn parse(b: &[u8], device_len: u64) -> Result<Option<Entry>, String> {
        if b.len() < ENTRY_LEN {
            return Err("entry cut short".into());
        }
        let w = u32_at(b, 0);
        let state = State::from_word(w).ok_or_else(|| format!("state word {w}"))?;
        if state == State::Free {
            return Ok(None);
        }
        if u64_at(b, SUM_TO) != fnv1a(&b[SUM_FROM..SUM_TO]) {
            return Err("checksum does not match".into());
        }
        let raw = &b[56..56 + NAME_MAX];
        let n = raw.iter().position(|&c| c == 0).unwrap_or(NAME_MAX);
        let name = std::str::from_utf8(&raw[..n])
            .ok()
            .filter(|s| valid_name(s) && raw[n..].iter().all(|&c| c == 0))
            .ok_or("its name is not a valid namespace name")?
            .to_owned();
        let (offset, size) = (u64_at(b, 8), u64_at(b, 16));
        let end = offset.checked_add(size).ok_or("offset + size overflows")?;
        if offset < TABLE_LEN
            || !offset.is_multiple_of(ALIGN)
            || size == 0
            || !size.is_multiple_of(ALIGN)
        {
            return Err(format!(
                "region {offset}+{size} is not {ALIGN}-aligned past the table"
            ));
        }
        if end > device_len {
            return Err(format!(
                "region {offset}+{size} ends past the device ({device_len} bytes)"
            ));
        }
        Ok(Some(Entry {
            state,
            refs: u32_at(b, REFS_OFF),
            offset,
            size,
            generation: u64_at(b, 24),
            created_ms: u64_at(b, 32),
            owner_uid: u32_at(b, 40),
            owner_pid: u32_at(b, 44),
            owner_host: u64_at(b, 48),
            name,
        }))
    }

    /// Where the entry's region ends.
    pub(crate) fn end(&self) -> u64 {
        self.offset + self.size
    }
}

/// Parses every entry of `table` (the table's bytes from the device's
/// start, at least up to the last entry) and checks that the used ones
/// have distinct names and regions that do not overlap. Returns
/// `(index, entry)` for every used entry.
pub(crate) fn check_entries(table: &[u8], h: &Header) -> Result<Vec<(u32, Entry)>, TableError> {
    let end = ENTRIES_OFF + MAX_ENTRIES as usize * ENTRY_LEN;
    if table.len() < end {
        return Err(TableError::Corrupt("table cut short".into()));
    }
    let mut used = Vec::new();
    for i in 0..MAX_ENTRIES {
        let at = ENTRIES_OFF + i as usize * ENTRY_LEN;
        match Entry::parse(&table[at..at + ENTRY_LEN], h.device_len) {
            Ok(Some(e)) => used.push((i, e)),
            Ok(None) => {}
            Err(why) => return Err(TableError::Corrupt(format!("entry {i}: {why}"))),
        }
    }
    let mut by_place: Vec<&(u32, Entry)> = used.iter().collect();
    by_place.sort_by_key(|(_, e)| e.offset);
    for w in by_place.windows(2) {
        if w[0].1.end() > w[1].1.offset {
            return Err(TableError::Corrupt(format!(
                "entries {} and {} overlap",
                w[0].0, w[1].0
            )));
        }
    }
    for (k, (i, e)) in used.iter().enumerate() {
        if let Some((j, _)) = used[k + 1..].iter().find(|(_, f)| f.name == e.name) {
            return Err(TableError::Corrupt(format!(
                "entries {i} and {j} have the same name {:?}",
                e.name
            )));
        }
    }
    Ok(used)
}

/// The first gap of at least `size` bytes between `used` regions on a
/// device of `device_len` bytes (first fit), or None.
pub(crate) fn find_gap(used: &[(u32, Entry)], size: u64, device_len: u64) -> Option<u64> {
    let mut regions: Vec<(u64, u64)> = used.iter().map(|(_, e)| (e.offset, e.end())).collect();
    regions.sort_unstable();
    let mut at = TABLE_LEN;
    for (start, end) in regions {
        if start.saturating_sub(at) >= size {
            return Some(at);
        }
        at = at.max(end);
    }
    (device_len.saturating_sub(at) >= size).then_some(at)
}

/// Where entry `i` starts in the table.
pub(crate) fn entry_off(i: u32) -> usize {
    ENTRIES_OFF + i as usize * ENTRY_LEN
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, offset: u64, size: u64) -> Entry {
        Entry {
            state: State::Ready,
            refs: 0,
            offset,
            size,
            generation: 1,
            created_ms: 5,
            owner_uid: 0,
            owner_pid: 7,
            owner_host: 9,
            name: name.into(),
        }
    }

    fn table(h: &Header, entries: &[(u32, Entry)]) -> Vec<u8> {
        let mut t = vec![0u8; ENTRIES_OFF + MAX_ENTRIES as usize * ENTRY_LEN];
        t[..HEADER_LEN].copy_from_slice(&h.encode());
        for (i, e) in entries {
            let at = entry_off(*i);
            t[at..at + ENTRY_LEN].copy_from_slice(&e.encode());
        }
        t
    }

    const DEV: u64 = 64 << 20;

    #[test]
    fn entries_round_trip_and_gaps_fill_first_fit() {
        let h = Header {
            device_len: DEV,
            formatted_ms: 3,
        };
        assert_eq!(Header::parse(&h.encode(), Some(DEV)), Ok(h));
        let a = entry("a", TABLE_LEN, ALIGN);
        let b = entry("b.2_x-y", TABLE_LEN + 3 * ALIGN, 2 * ALIGN);
        let t = table(&h, &[(0, a.clone()), (5, b.clone())]);
        let used = check_entries(&t, &h).unwrap();
        assert_eq!(used, vec![(0, a), (5, b)]);
        assert_eq!(find_gap(&used, 2 * ALIGN, DEV), Some(TABLE_LEN + ALIGN));
        assert_eq!(find_gap(&used, 3 * ALIGN, DEV), Some(TABLE_LEN + 5 * ALIGN));
        assert_eq!(find_gap(&used, DEV, DEV), None);
    }

    #[test]
    fn bad_tables_are_refused_with_what_is_wrong() {
        let h = Header {
            device_len: DEV,
            formatted_ms: 3,
        };
        assert_eq!(Header::parse(&[0u8; 64], None), Err(TableError::NoTable));
        assert!(matches!(
            Header::parse(&h.encode(), Some(DEV - ALIGN)),
            Err(TableError::Corrupt(_))
        ));
        let mut v = h.encode();
        v[8] = 9;
        assert_eq!(Header::parse(&v, None), Err(TableError::Version(9)));
        let mut s = h.encode();
        s[33] ^= 1;
        assert!(matches!(
            Header::parse(&s, None),
            Err(TableError::Corrupt(_))
        ));
        let cases = [
            (
                vec![
                    (0, entry("a", TABLE_LEN, ALIGN)),
                    (1, entry("b", TABLE_LEN, ALIGN)),
                ],
                "overlap",
            ),
            (
                vec![
                    (0, entry("a", TABLE_LEN, ALIGN)),
                    (1, entry("a", TABLE_LEN + ALIGN, ALIGN)),
                ],
                "same name",
            ),
            (vec![(0, entry("a", 0, ALIGN))], "aligned past"),
            (vec![(0, entry("a", TABLE_LEN + 1, ALIGN))], "aligned past"),
            (
                vec![(0, entry("a", DEV - ALIGN, 2 * ALIGN))],
                "past the device",
            ),
            (
                vec![(0, entry("a", u64::MAX - ALIGN + 1, ALIGN))],
                "overflows",
            ),
            (vec![(0, entry("a/b", TABLE_LEN, ALIGN))], "name"),
        ];
        for (entries, why) in cases {
            let t = table(&h, &entries);
            match check_entries(&t, &h) {
                Err(TableError::Corrupt(m)) => assert!(m.contains(why), "{m} lacks {why}"),
                r => panic!("{entries:?}: {r:?}"),
            }
        }
        let mut t = table(&h, &[(3, entry("a", TABLE_LEN, ALIGN))]);
        t[entry_off(3) + 9] ^= 1;
        assert!(
            matches!(check_entries(&t, &h), Err(TableError::Corrupt(m)) if m.contains("checksum"))
        );
        let mut t = table(&h, &[]);
        t[entry_off(2)] = 7;
        assert!(
            matches!(check_entries(&t, &h), Err(TableError::Corrupt(m)) if m.contains("state"))
        );
    }

    proptest::proptest! {
        /// A valid table with bytes changed anywhere: parsing never panics,
        /// and a table that is accepted keeps its regions apart and inside.
        #[test]
        fn changed_tables_are_refused_or_sound(
            changes in proptest::collection::vec((0usize..entry_off(8), proptest::num::u8::ANY), 1..6)
        ) {
            let h = Header { device_len: DEV, formatted_ms: 3 };
            let mut t = table(&h, &[
                (0, entry("a", TABLE_LEN, ALIGN)),
                (1, entry("b", TABLE_LEN + ALIGN, 4 * ALIGN)),
                (6, entry("c", DEV - ALIGN, ALIGN)),
            ]);
            for (at, v) in changes {
                t[at] = v;
            }
            if let Ok(h) = Header::parse(&t, Some(DEV)) {
                if let Ok(used) = check_entries(&t, &h) {
                    let mut r: Vec<(u64, u64)> = used.iter().map(|(_, e)| (e.offset, e.end())).collect();
                    r.sort_unstable();
                    proptest::prop_assert!(r.iter().all(|&(a, b)| a >= TABLE_LEN && b <= DEV));
                    proptest::prop_assert!(r.windows(2).all(|w| w[0].1 <= w[1].0));
                }
            }
        }
    }

    #[test]
    fn names() {
        for ok in ["a", "ns-1", "x.y_z", &"n".repeat(NAME_MAX)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "é", &"n".repeat(NAME_MAX + 1)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
