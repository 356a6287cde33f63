//! This process's attachment to a pool, as the lease thread shares it
//! with the handle ([`Pool`](crate::Pool)): the mapping, the slot and its
//! incarnation, and what needs only those (the lease, descriptor claims).
//! `reclaim.rs` adds the share changes and reclaiming to it.

use crate::desc::{Desc, DescState, Kind};
use crate::error::{Error, Result};
use crate::shm::Shm;
use crate::slot::{LeaseNow, SlotKind, SlotState};
use crate::sync::Ordering;
use std::sync::atomic::AtomicBool;

/// What the lease thread shares with the handle: the mapping and the slot.
/// Everything here works without the process's page cache; pages it frees are
/// handed back to the caller in a `freed` vector (cached by us).
pub(crate) struct Core {
    pub(crate) shm: Shm,
    pub(crate) slot: u16,
    pub(crate) incarnation: u32,
    pub(crate) lost: AtomicBool,
    /// This process's fork count when it attached
    /// ([`dm_sys::proc::watch_forks`]): a child forked since sees a higher
    /// one, and its calls fail with [`Error::Forked`].
    pub(crate) forks: u64,
    /// Where this process's next descriptor claim starts looking: the
    /// descriptor it freed last (still in this core's caches), else the
    /// one after its last claim. Process-local: a cursor shared by all
    /// processes cost a cache-line transfer per claim (three per call by
    /// Ref) and handed out cold descriptors.
    pub(crate) desc_hint: std::sync::atomic::AtomicU32,
}

impl Core {
    /// Charges `n` pages of buffers to this process's quotas (quota.rs).
    pub(crate) fn charge(&self, n: u64) -> Result<()> {
        match self.shm.slot(self.slot) {
            Some(s) => self.shm.charge(s, n),
            None => Ok(()),
        }
    }

    /// Gives back `n` pages charged.
    pub(crate) fn uncharge(&self, n: u64) {
        if let Some(s) = self.shm.slot(self.slot) {
            self.shm.uncharge(s, n);
        }
    }

    pub(crate) fn set_entry(&self, d: &Desc, k: usize, p: u32) -> Result<()> {
        match self.shm.entry(d, k)? {
            Some(e) => {
                e.store(p, Ordering::Release);
                Ok(())
            }
            None => Err(Error::Corrupt(format!("entry {k} has no list page"))),
        }
    }

    /// Returns pages cached by this slot to the shared free set.
    pub(crate) fn release_freed(&self, freed: Vec<u32>) {
        let t = self.shm.pages();
        for p in freed {
            let _ = t.release_cached(p, self.slot);
        }
    }

    /// Fails with `LeaseLost` unless this slot is still ours: a process that
    /// was stopped past its lease has had its holdings reclaimed and must
    /// not touch them. One load of the slot word (read-mostly, shared).
    pub(crate) fn live(&self) -> Result<()> {
        if dm_sys::proc::forks() != self.forks {
            return Err(Error::Forked);
        }
        if !self.lost.load(Ordering::Relaxed) {
            let w = self
                .shm
                .slot(self.slot)
                .map(|s| s.state.load(Ordering::Acquire));
            if w == Some(SlotState::encode(self.incarnation, SlotKind::Live, 0)) {
                return Ok(());
            }
            self.lost.store(true, Ordering::Relaxed);
        }
        Err(Error::LeaseLost)
    }

    pub(crate) fn renew(&self) -> Result<()> {
        let Some(s) = self.shm.slot(self.slot) else {
            return Err(Error::LeaseLost);
        };
        let st = SlotState::decode(s.state.load(Ordering::Acquire));
        if st.kind != Some(SlotKind::Live) || st.incarnation != self.incarnation {
            self.lost.store(true, Ordering::Relaxed);
            return Err(Error::LeaseLost);
        }
        let now = LeaseNow::read();
        s.heartbeat_mono_ms.store(now.mono_ms, Ordering::Release);
        s.heartbeat_ms.store(now.wall_ms, Ordering::Release);
        Ok(())
    }

    pub(crate) fn desc(&self, i: u32) -> Result<&Desc> {
        self.shm
            .desc(i)
            .ok_or_else(|| Error::Corrupt(format!("descriptor {i} out of range")))
    }

    /// Claims a free descriptor for `kind`, owned by this slot.
    pub(super) fn claim_desc(&self, kind: Kind) -> Result<(u32, u32)> {
        let n = self.shm.layout.n_descs as u64;
        let start = self.desc_hint.load(std::sync::atomic::Ordering::Relaxed) as u64 % n.max(1);
        for k in 0..n {
            let i = ((start + k) % n) as u32;
            let Some(d) = self.shm.desc(i) else { continue };
            let w = d.state.load(Ordering::Relaxed);
            let st = DescState::decode(w);
            if st.kind != Some(Kind::Free) {
                continue;
            }
            let gen = st.generation.wrapping_add(1);
            if d.state
                .compare_exchange(
                    w,
                    DescState::encode(gen, kind, self.slot),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                self.desc_hint.store(
                    ((i as u64 + 1) % n) as u32,
                    std::sync::atomic::Ordering::Relaxed,
                );
                return Ok((i, gen));
            }
        }
        Err(Error::ResourceExhausted {
            what: "descriptors",
        })
    }
}
