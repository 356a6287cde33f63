//! Where registrations lie in etcd, and what their values say.
//!
//! Every key starts with the registry's prefix (`/dmrpc` by default):
//!
//! | key | value |
//! |---|---|
//! | `PREFIX/services/NAME!x/HANDLE` | the one registration of `NAME` ([`Record`], JSON) |
//! | `PREFIX/services/NAME!r/HANDLE` | one replica of `NAME` |
//! | `PREFIX/services/NAME!s/HANDLE` | a service reachable only from its pool (listed, claims nothing) |
//! | `PREFIX/memservers/ZONE/HANDLE` | a memory server ([`MemserverRecord`], JSON) |
//!
//! `HANDLE` is the registration's handle in 16 hex digits. `!` cannot
//! appear in a service name (`dm_pool::validate_service_name`), so the
//! keys of `shop/images` are not a prefix of those of
//! `shop/images/resize`. A key lives under its process's lease: it goes
//! when the lease runs out.
//!
//! What is read from etcd was written by other processes: a key or value
//! that does not parse, or a record larger than [`RECORD_MAX`], is
//! skipped (and counted), never trusted.

use dm_pool::Endpoint;
use serde::{Deserialize, Serialize};

/// The largest record read back (a registration is a few hundred bytes).
pub const RECORD_MAX: usize = 4096;

/// Exclusive registration or replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The one registration of its name.
    Exclusive,
    /// One of any number of replicas.
    Replica,
    /// A service reachable only from its pool, listed: no claim on the
    /// name across hosts.
    Local,
}

impl Kind {
    fn letter(self) -> char {
        match self {
            Kind::Exclusive => 'x',
            Kind::Replica => 'r',
            Kind::Local => 's',
        }
    }
}

/// The keys of one registry (one prefix).
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// The keys under `prefix` (a trailing `/` is dropped).
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.trim_end_matches('/').to_owned(),
        }
    }

    /// Where every service's keys start.
    pub fn services(&self) -> String {
        format!("{}/services/", self.prefix)
    }

    /// Where the keys of `name` start (any kind).
    pub fn name(&self, name: &str) -> String {
        format!("{}/services/{name}!", self.prefix)
    }

    /// Where the keys of `name` of one kind start.
    pub fn kind(&self, name: &str, kind: Kind) -> String {
        format!("{}{}/", self.name(name), kind.letter())
    }

    /// The key of registration `handle` of `name`.
    pub fn key(&self, name: &str, kind: Kind, handle: u64) -> String {
        format!("{}{handle:016x}", self.kind(name, kind))
    }

    /// The name, kind and handle of a key under [`services`](Self::services),
    /// or `None` for one this layout did not write.
    pub fn parse(&self, key: &[u8]) -> Option<(String, Kind, u64)> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(&self.services())?;
        let (name, tail) = rest.rsplit_once('!')?;
        dm_pool::validate_service_name(name).ok()?;
        let (kind, handle) = tail.split_once('/')?;
        let kind = match kind {
            "x" => Kind::Exclusive,
            "r" => Kind::Replica,
            "s" => Kind::Local,
            _ => return None,
        };
        Some((name.to_owned(), kind, parse_handle(handle)?))
    }
}

impl Keys {
    /// Where the memory servers' keys start (of one zone, or of all).
    pub fn memservers(&self, zone: Option<&str>) -> String {
        match zone {
            Some(z) => format!("{}/memservers/{z}/", self.prefix),
            None => format!("{}/memservers/", self.prefix),
        }
    }

    /// The key of memory server `handle` in `zone`.
    pub fn memserver(&self, zone: &str, handle: u64) -> String {
        format!("{}{handle:016x}", self.memservers(Some(zone)))
    }

    /// The zone and handle of a memory server's key, or `None`.
    pub fn parse_memserver(&self, key: &[u8]) -> Option<(String, u64)> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(&self.memservers(None))?;
        let (zone, handle) = rest.split_once('/')?;
        valid_zone(zone).then_some(())?;
        let h = parse_handle(handle)?;
        Some((zone.to_owned(), h))
    }
}

/// Whether `z` can name a zone: 1 to 64 letters, digits, `_`, `-`, `.`.
pub fn valid_zone(z: &str) -> bool {
    (1..=64).contains(&z.len())
        && z.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
}

/// A handle as keys write it: 16 lowercase hex digits.
fn parse_handle(h: &str) -> Option<u64> {
    if h.len() != 16 || !h.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    u64::from_str_radix(h, 16).ok()
}

/// What a memory server's value says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemserverRecord {
    /// Where clients reach it (`host:port`).
    pub addr: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id there.
    pub pid: u32,
    /// The bytes it serves.
    pub size: u64,
}

impl MemserverRecord {
    /// The record's JSON.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record read from etcd, checked (as [`Record::decode`]).
    pub fn decode(b: &[u8]) -> Option<MemserverRecord> {
        if b.len() > RECORD_MAX {
            return None;
        }
        let r: MemserverRecord = serde_json::from_slice(b).ok()?;
        let addr_ok = (3..=255).contains(&r.addr.len()) && r.addr.contains(':');
        (addr_ok && r.host.len() <= 255).then_some(r)
    }
}

/// The endpoint `text` names as records write it (`shm` or
/// `tcp://HOST:PORT`), if it is one.
pub fn parse_endpoint(text: &str) -> Option<Endpoint> {
    if text == "shm" {
        return Some(Endpoint::Shm);
    }
    let a = text.strip_prefix("tcp://")?;
    (!a.is_empty() && a.len() <= 255).then(|| Endpoint::Tcp(a.to_owned()))
}

/// What a registration's value says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// `shm` or `tcp://HOST:PORT`.
    pub endpoint: String,
    /// The host the process runs on.
    pub host: String,
    /// Its process id there.
    pub pid: u32,
    /// The pool it is attached to (its shared-memory channels are there),
    /// if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

impl Record {
    /// The text of `e` in a record.
    pub fn endpoint_text(e: &Endpoint) -> String {
        match e {
            Endpoint::Shm => "shm".to_owned(),
            Endpoint::Tcp(a) => format!("tcp://{a}"),
        }
    }

    /// The endpoint the record names, if it is one.
    pub fn endpoint(&self) -> Option<Endpoint> {
        parse_endpoint(&self.endpoint)
    }

    /// The record's JSON.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record read from etcd, checked: `None` if it is too long, not
    /// a record, or names no endpoint.
    pub fn decode(b: &[u8]) -> Option<Record> {
        if b.len() > RECORD_MAX {
            return None;
        }
        let r: Record = serde_json::from_slice(b).ok()?;
        r.endpoint()?;
        (r.host.len() <= 255 && r.pool.as_ref().is_none_or(|p| p.len() <= 4096)).then_some(r)
    }

    /// Who registered it, for people (and in which pool, for a service
    /// reached over shared memory).
    pub fn owner(&self) -> String {
        match (&self.pool, self.endpoint.as_str()) {
            (Some(p), "shm") => format!("{} pool {p} pid {}", self.host, self.pid),
            _ => format!("{} pid {}", self.host, self.pid),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_of_a_name_do_not_cover_a_longer_name() {
        let k = Keys::new("/dmrpc/");
        let a = k.key("shop/images", Kind::Replica, 0xab);
        let b = k.key("shop/images/resize", Kind::Exclusive, 1);
        assert_eq!(a, "/dmrpc/services/shop/images!r/00000000000000ab");
        assert!(a.starts_with(&k.name("shop/images")));
        assert!(!b.starts_with(&k.name("shop/images")));
        assert_eq!(
            k.parse(a.as_bytes()),
            Some(("shop/images".into(), Kind::Replica, 0xab))
        );
        assert_eq!(
            k.parse(b.as_bytes()),
            Some(("shop/images/resize".into(), Kind::Exclusive, 1))
        );
        for bad in [
            "/dmrpc/services/shop!x/1",
            "/dmrpc/services/shop!y/0000000000000001",
            "/dmrpc/services/sh op!x/0000000000000001",
            "/other/services/shop!x/0000000000000001",
            "/dmrpc/services/!x/0000000000000001",
        ] {
            assert_eq!(k.parse(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let r = Record {
            endpoint: Record::endpoint_text(&Endpoint::Tcp("10.99.0.2:4000".into())),
            host: "h1".into(),
            pid: 42,
            pool: Some("/dev/shm/dmrpc-a.pool".into()),
        };
        assert_eq!(Record::decode(&r.encode()), Some(r.clone()));
        assert_eq!(r.endpoint(), Some(Endpoint::Tcp("10.99.0.2:4000".into())));
        for bad in [
            &br#"{"endpoint":"udp://x","host":"h","pid":1}"#[..],
            br#"{"endpoint":"tcp://","host":"h","pid":1}"#,
            br#"{"endpoint":"shm","host":"h"}"#,
            br#"not json"#,
        ] {
            assert_eq!(Record::decode(bad), None);
        }
        let long = format!(
            r#"{{"endpoint":"shm","host":"h","pid":1,"pool":"{}"}}"#,
            "p".repeat(RECORD_MAX)
        );
        assert_eq!(Record::decode(long.as_bytes()), None);
    }

    #[test]
    fn memserver_keys_and_records() {
        let k = Keys::new("/dmrpc");
        let key = k.memserver("rack-1", 7);
        assert_eq!(key, "/dmrpc/memservers/rack-1/0000000000000007");
        assert_eq!(
            k.parse_memserver(key.as_bytes()),
            Some(("rack-1".into(), 7))
        );
        assert!(key.starts_with(&k.memservers(Some("rack-1"))));
        assert!(!key.starts_with(&k.memservers(Some("rack"))));
        for bad in [
            "/dmrpc/memservers//0000000000000007",
            "/dmrpc/memservers/a b/0000000000000007",
            "/dmrpc/memservers/a/7",
            "/dmrpc/memservers/a/b/0000000000000007",
        ] {
            assert_eq!(k.parse_memserver(bad.as_bytes()), None, "{bad}");
        }
        let r = MemserverRecord {
            addr: "10.99.0.2:7070".into(),
            host: "h2".into(),
            pid: 9,
            size: 1 << 30,
        };
        assert_eq!(MemserverRecord::decode(&r.encode()), Some(r));
        assert_eq!(
            MemserverRecord::decode(br#"{"addr":"nocolon","host":"h","pid":1,"size":1}"#),
            None
        );
    }

    proptest! {
        #[test]
        fn any_bytes_parse_or_are_refused(key in proptest::collection::vec(any::<u8>(), 0..80),
                                          val in proptest::collection::vec(any::<u8>(), 0..200)) {
            let k = Keys::new("/dmrpc");
            let mut full = k.services().into_bytes();
            full.extend_from_slice(&key);
            if let Some((name, kind, h)) = k.parse(&full) {
                prop_assert_eq!(k.key(&name, kind, h).into_bytes(), full);
            }
            let _ = Record::decode(&val);
            let _ = MemserverRecord::decode(&val);
            let mut m = k.memservers(None).into_bytes();
            m.extend_from_slice(&key);
            if let Some((zone, h)) = k.parse_memserver(&m) {
                prop_assert_eq!(k.memserver(&zone, h).into_bytes(), m);
            }
        }
    }
}
