//! The service registry embedded in the pool: names to endpoints, with
//! liveness.
//!
//! A record is `SERVICE_SIZE` bytes:
//!
//! ```text
//! 0    state: generation (32) | kind (8) | owner slot (16)     kind 0 free, 1 live
//! 8    owner incarnation (the slot's, so a reused slot is not the owner)
//! 16   registered at, ms since the epoch
//! 24   name length (u32) | endpoint kind (u32: 1 shm, 2 tcp)
//! 32   endpoint length (u32) | flags (u32: bit 0 replica, bit 1 gRPC)
//! 64   name, 128 bytes (hierarchical: `shop/images/resize`)
//! 192  endpoint, 128 bytes (for TCP, the address as text)
//! 320  192 bytes owned by the RPC layer (doorbells), zeroed on registration
//! ```
//!
//! Registration, lookup of a name and removal run under the registry lock
//! (`reg_lock` in the header atomics), so a name is registered at most once
//! — unless every registration of it is a *replica* (flag bit 0): then any
//! number of servers share the name and clients spread their calls over
//! them. An exclusive registration is refused while a replica holds the
//! name, and the other way round. The lock names its holder, and a dead
//! holder's lock is broken.
//!
//! The flags word was reserved (zero) before replicas: records of pools
//! made earlier read as exclusive, and a build that predates the flag reads
//! a replica as an exclusive registration (it finds one of the replicas and
//! cannot register the name), so the pool format version did not change.
//! Bit 1 says the service speaks gRPC ([`Protocol::Grpc`]): a label for
//! people and tools (`dmrpc ls`, `dmrpc call`), which older builds ignore. Readers
//! (`list`, `lookup`) also take it: registry traffic is rare and short. A
//! record whose owner slot is dead is removed by the pool's maintenance
//! (any live process's lease thread, or `dmrpc pool gc`), so a crashed
//! service disappears within its lease.

use crate::error::{Error, Result};
use crate::shm::Shm;
use crate::slot::LeaseNow;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

pub(crate) use crate::layout::SERVICE_SIZE;
/// Longest service name, bytes.
pub const NAME_MAX: usize = 128;
/// Longest endpoint text, bytes.
pub(crate) const ENDPOINT_MAX: usize = 128;
/// Bytes of a record owned by the RPC layer.
pub(crate) const RPC_AREA: usize = 192;

const KIND_FREE: u64 = 0;
const KIND_LIVE: u64 = 1;
/// Flag: the registration is one replica of its name.
pub(crate) const FLAG_REPLICA: u32 = 1;
/// Record flag: the service speaks gRPC over dmrpc ([`Protocol::Grpc`]).
pub(crate) const FLAG_GRPC: u32 = 2;

/// What a registered service speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// dmrpc's own calls, by method name.
    #[default]
    Dmrpc,
    /// gRPC calls (by path) over dmrpc, served by the `dm-grpc` crate.
    Grpc,
}

/// A service record as laid out in the pool.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct ServiceRecord {
    /// `generation | kind | owner slot`.
    pub state: AtomicU64,
    /// Owner's slot incarnation.
    pub owner_inc: AtomicU64,
    /// Registration time, ms since the epoch.
    pub registered_ms: AtomicU64,
    /// Name length.
    pub name_len: AtomicU32,
    /// Endpoint kind (1 shm, 2 tcp).
    pub endpoint_kind: AtomicU32,
    /// Endpoint text length.
    pub endpoint_len: AtomicU32,
    /// Flags ([`FLAG_REPLICA`]).
    pub flags: AtomicU32,
    _rsv: [AtomicU64; 3],
    /// Name bytes.
    pub name: [AtomicU64; NAME_MAX / 8],
    /// Endpoint bytes.
    pub endpoint: [AtomicU64; ENDPOINT_MAX / 8],
    /// The RPC layer's words (doorbells).
    pub rpc: [AtomicU32; RPC_AREA / 4],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<ServiceRecord>() == SERVICE_SIZE);

/// Where a service is reached.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// Over shared-memory channels in this pool.
    Shm,
    /// Over TCP at this address (`host:port`).
    Tcp(String),
}

/// A registered service, as listed or looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    /// Record index.
    pub index: u32,
    /// Record generation (changes when the name is registered again).
    pub generation: u32,
    /// Service name.
    pub name: String,
    /// How to reach it.
    pub endpoint: Endpoint,
    /// Owner slot.
    pub slot: u16,
    /// Owner slot incarnation.
    pub incarnation: u32,
    /// Owner process id.
    pub pid: u32,
    /// Registration time, ms since the epoch.
    pub registered_ms: u64,
    /// Whether the owner's lease is current.
    pub live: bool,
    /// Whether it is one replica of its name ([`Pool::register_replica`](crate::Pool::register_replica)).
    pub replica: bool,
    /// What it speaks ([`Pool::register_with`](crate::Pool::register_with)).
    pub protocol: Protocol,
}

/// Checks a service name: 1 to 128 bytes of `/`-separated segments made of
/// ASCII letters, digits, `_`, `-` and `.`, none empty.
pub fn validate_name(name: &str) -> Result<()> {
    let bad = |why: &str| Err(Error::InvalidName(format!("{name:?}: {why}")));
    if name.is_empty() || name.len() > NAME_MAX {
        return bad("must be 1 to 128 bytes");
    }
    for seg in name.split('/') {
        if seg.is_empty() {
            return bad("has an empty segment");
        }
        if !seg
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
        {
            return bad("segments may hold only letters, digits, '_', '-' and '.'");
        }
    }
    Ok(())
}

pub(crate) fn state(gen: u32, kind: u64, slot: u16) -> u64 {
    gen as u64 | (kind << 32) | ((slot as u64) << 40)
}

pub(crate) fn decode(w: u64) -> (u32, u64, u16) {
    (w as u32, (w >> 32) & 0xFF, (w >> 40) as u16)
}

fn store_text(words: &[AtomicU64], s: &[u8]) {
    for (k, w) in words.iter().enumerate() {
        let mut x = [0u8; 8];
        let lo = (k * 8).min(s.len());
        let hi = (k * 8 + 8).min(s.len());
        x[..hi - lo].copy_from_slice(&s[lo..hi]);
        w.store(u64::from_le_bytes(x), Ordering::Relaxed);
    }
}

fn load_text(words: &[AtomicU64], len: usize) -> String {
    let mut b: Vec<u8> = words
        .iter()
        .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
        .collect();
    b.truncate(len.min(words.len() * 8));
    String::from_utf8_lossy(&b).into_owned()
}

/// The registry lock, held for the life of the guard.
pub(crate) struct RegLock<'a> {
    shm: &'a Shm,
    word: u64,
}

impl<'a> RegLock<'a> {
    pub(crate) fn take(shm: &'a Shm, slot: u16, inc: u32) -> RegLock<'a> {
        let word = (slot as u64 + 1) | ((inc as u64) << 16);
        let lock = &shm.atomics().reg_lock;
        let mut spins = 0u32;
        loop {
            let cur = lock.load(Ordering::Acquire);
            if cur == 0 || !holder_live(shm, cur) {
                if lock
                    .compare_exchange(cur, word, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return RegLock { shm, word };
                }
                continue;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

impl Drop for RegLock<'_> {
    fn drop(&mut self) {
        let _ = self.shm.atomics().reg_lock.compare_exchange(
            self.word,
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

fn holder_live(shm: &Shm, w: u64) -> bool {
    let slot = ((w & 0xFFFF) as u16).wrapping_sub(1);
    shm.slot_is(slot, (w >> 16) as u32, LeaseNow::read())
}

impl Shm {
    /// Service record `i`, if in range.
    pub(crate) fn service(&self, i: u32) -> Option<&ServiceRecord> {
        if i >= self.layout.n_services {
            return None;
        }
        // SAFETY: i < n_services: the record is inside the registry, which
        // `Layout::parse` validated; a ServiceRecord is repr(C) atomics.
        Some(unsafe { self.at(self.layout.reg_off + i as u64 * SERVICE_SIZE as u64) })
    }

    fn service_info(&self, i: u32, now: LeaseNow) -> Option<ServiceInfo> {
        let r = self.service(i)?;
        let w = r.state.load(Ordering::Acquire);
        let (generation, kind, slot) = decode(w);
        if kind != KIND_LIVE {
            return None;
        }
        let incarnation = r.owner_inc.load(Ordering::Relaxed) as u32;
        let name = load_text(&r.name, r.name_len.load(Ordering::Relaxed) as usize);
        let endpoint = match r.endpoint_kind.load(Ordering::Relaxed) {
            2 => Endpoint::Tcp(load_text(
                &r.endpoint,
                r.endpoint_len.load(Ordering::Relaxed) as usize,
            )),
            _ => Endpoint::Shm,
        };
        Some(ServiceInfo {
            index: i,
            generation,
            name,
            endpoint,
            slot,
            incarnation,
            pid: self.slot(slot).map_or(0, |s| s.pid.load(Ordering::Relaxed)),
            registered_ms: r.registered_ms.load(Ordering::Relaxed),
            live: self.slot_is(slot, incarnation, now),
            replica: r.flags.load(Ordering::Relaxed) & FLAG_REPLICA != 0,
            protocol: if r.flags.load(Ordering::Relaxed) & FLAG_GRPC != 0 {
                Protocol::Grpc
            } else {
                Protocol::Dmrpc
            },
        })
    }

    /// Every registered service (live or not yet swept), by record index.
    pub(crate) fn list_services(&self) -> Vec<ServiceInfo> {
        let now = LeaseNow::read();
        (0..self.layout.n_services)
            .filter_map(|i| self.service_info(i, now))
            .collect()
    }

    /// Removes records whose owner is dead. Returns how many.
    pub(crate) fn sweep_services(&self, me: u16, inc: u32) -> u64 {
        let now = LeaseNow::read();
        let mut n = 0;
        let stale: Vec<u32> = (0..self.layout.n_services)
            .filter(|&i| self.service_info(i, now).is_some_and(|s| !s.live))
            .collect();
        if stale.is_empty() {
            return 0;
        }
        let _g = RegLock::take(self, me, inc);
        for i in stale {
            let Some(s) = self.service_info(i, now) else {
                continue;
            };
            if !s.live && self.remove_service(i, s.generation) {
                n += 1;
            }
        }
        n
    }

    /// Frees record `i` if it is still generation `gen`. Caller holds the lock.
    fn remove_service(&self, i: u32, gen: u32) -> bool {
        let Some(r) = self.service(i) else {
            return false;
        };
        let w = r.state.load(Ordering::Acquire);
        let (g, kind, _) = decode(w);
        g == gen
            && kind == KIND_LIVE
            && r.state
                .compare_exchange(
                    w,
                    state(gen.wrapping_add(1), KIND_FREE, 0),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
    }
}

impl crate::pool::Pool {
    /// Registers `name` at `endpoint`, owned by this process until
    /// [`unregister`](Self::unregister) or its death. A name held by a live
    /// process gives `NameTaken`; one held by a dead process is taken over.
    pub fn register(&self, name: &str, endpoint: &Endpoint) -> Result<ServiceInfo> {
        self.register_with(name, endpoint, false, Protocol::Dmrpc)
    }

    /// Registers one replica of `name` at `endpoint`: the name may have
    /// any number of replicas (none exclusive), and [`lookup_all`](Self::lookup_all)
    /// finds them all. A name registered exclusively by a live process
    /// gives `NameTaken`.
    pub fn register_replica(&self, name: &str, endpoint: &Endpoint) -> Result<ServiceInfo> {
        self.register_with(name, endpoint, true, Protocol::Dmrpc)
    }

    /// Registers `name` at `endpoint` as [`register`](Self::register)
    /// does, or one replica of it (`replica`), recording what it speaks.
    pub fn register_with(
        &self,
        name: &str,
        endpoint: &Endpoint,
        replica: bool,
        protocol: Protocol,
    ) -> Result<ServiceInfo> {
        validate_name(name)?;
        let text = match endpoint {
            Endpoint::Shm => "",
            Endpoint::Tcp(a) => a.as_str(),
        };
        if text.len() > ENDPOINT_MAX {
            return Err(Error::InvalidName(format!(
                "endpoint {text:?} is longer than {ENDPOINT_MAX} bytes"
            )));
        }
        self.inner.live()?;
        let shm = self.shm();
        let (me, inc) = (self.slot(), self.inner.incarnation);
        let _g = RegLock::take(shm, me, inc);
        let now = LeaseNow::read();
        let mut free = None;
        for i in 0..shm.layout.n_services {
            match shm.service_info(i, now) {
                Some(s) if s.name == name => {
                    if s.live && replica && s.replica {
                        continue;
                    }
                    if s.live {
                        return Err(Error::NameTaken {
                            name: name.to_owned(),
                            pid: s.pid,
                            lease_left_ms: shm.lease_left_ms(s.slot, now),
                        });
                    }
                    shm.remove_service(i, s.generation);
                    free = free.or(Some(i));
                }
                Some(_) => {}
                None => free = free.or(Some(i)),
            }
        }
        let Some(i) = free else {
            return Err(Error::ResourceExhausted {
                what: "service records",
            });
        };
        let r = shm
            .service(i)
            .ok_or_else(|| Error::Corrupt("service index".into()))?;
        let (gen, _, _) = decode(r.state.load(Ordering::Acquire));
        r.owner_inc.store(inc as u64, Ordering::Relaxed);
        r.registered_ms.store(now.wall_ms, Ordering::Relaxed);
        r.name_len.store(name.len() as u32, Ordering::Relaxed);
        store_text(&r.name, name.as_bytes());
        r.endpoint_kind
            .store(if text.is_empty() { 1 } else { 2 }, Ordering::Relaxed);
        r.endpoint_len.store(text.len() as u32, Ordering::Relaxed);
        store_text(&r.endpoint, text.as_bytes());
        let grpc = if protocol == Protocol::Grpc {
            FLAG_GRPC
        } else {
            0
        };
        let flags = if replica { FLAG_REPLICA } else { 0 } | grpc;
        r.flags.store(flags, Ordering::Relaxed);
        for w in &r.rpc {
            w.store(0, Ordering::Relaxed);
        }
        r.state.store(state(gen, KIND_LIVE, me), Ordering::Release);
        shm.service_info(i, now)
            .ok_or_else(|| Error::Corrupt("service record vanished under the lock".into()))
    }

    /// Removes a registration made by this process.
    pub fn unregister(&self, s: &ServiceInfo) -> Result<()> {
        let shm = self.shm();
        let _g = RegLock::take(shm, self.slot(), self.inner.incarnation);
        match shm.service_info(s.index, LeaseNow::read()) {
            Some(cur)
                if cur.generation == s.generation
                    && cur.slot == self.slot()
                    && cur.incarnation == self.inner.incarnation =>
            {
                shm.remove_service(s.index, s.generation);
                Ok(())
            }
            _ => Err(Error::NotRegistered(s.name.clone())),
        }
    }

    /// Every live registration of `name` (its replicas, or its one
    /// exclusive registration), by record index.
    pub fn lookup_all(&self, name: &str) -> Result<Vec<ServiceInfo>> {
        validate_name(name)?;
        Ok(self
            .shm()
            .list_services()
            .into_iter()
            .filter(|s| s.live && s.name == name)
            .collect())
    }

    /// The live registration of `name`, if any (of a name with replicas,
    /// the first by record index).
    pub fn lookup(&self, name: &str) -> Result<Option<ServiceInfo>> {
        validate_name(name)?;
        Ok(self
            .shm()
            .list_services()
            .into_iter()
            .find(|s| s.live && s.name == name))
    }

    /// Every registered service.
    pub fn services(&self) -> Vec<ServiceInfo> {
        self.shm().list_services()
    }

    /// Whether registration `s` is still current (same generation, owner live).
    pub fn service_current(&self, s: &ServiceInfo) -> bool {
        self.shm()
            .service_info(s.index, LeaseNow::read())
            .is_some_and(|c| c.live && c.generation == s.generation)
    }

    /// The RPC layer's words of service record `s` (its doorbells).
    pub fn service_words(&self, s: &ServiceInfo) -> Result<&[AtomicU32; RPC_AREA / 4]> {
        self.shm()
            .service(s.index)
            .map(|r| &r.rpc)
            .ok_or_else(|| Error::Corrupt(format!("service index {} out of range", s.index)))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "shop/images/resize", "x-1/y_2/z.3"] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/a", "a/", "a//b", "a b", "é", &"x".repeat(129)] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn state_words_round_trip() {
        let w = state(0xDEAD_BEEF, KIND_LIVE, 513);
        assert_eq!(decode(w), (0xDEAD_BEEF, KIND_LIVE, 513));
    }
}
