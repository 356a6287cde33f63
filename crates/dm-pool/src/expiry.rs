//! Where Refs expire: the expiry summary, so that finding the Refs whose
//! TTL passed reads one word per group of descriptors, not every
//! descriptor, however many Refs are live.
//!
//! Word `g` of the summary covers descriptors `[g * EXPIRY_GROUP, (g + 1)
//! * EXPIRY_GROUP)`. It is a time (on the pool's Ref clock) before which no
//! live Ref of the group expires; `u64::MAX` when none is known. The rules:
//! - a Ref's maker commits it (its state word says `RefLive`), then lowers
//!   the word to the Ref's expiry if the word is later ([`Shm::note_expiry`]);
//! - a sweeper of a group whose word is due raises it to `u64::MAX`, reads
//!   the group's descriptors, expires the Refs that are due, and lowers the
//!   word to the earliest expiry left ([`Core::expire_due`]).
//!
//! A sequentially consistent fence stands between the maker's commit and
//! its read of the word, and between the sweeper's raise and its reads of
//! the descriptors. So either the maker read the word after the raise
//! (and lowers it, or finds it lowered to no later than its Ref's expiry),
//! or the sweeper's reads come after the commit and see the Ref (the loom
//! model `expiry_summary_covers_every_live_ref` checks it). A word too
//! early only costs a sweep of its group.
//!
//! The words have a summary of their own, one word in the header
//! (`expiry_top`), kept by the same rules one level up: a maker lowers
//! it after its group's word; a sweeper raises it, reads the group words
//! (sweeping the due groups), and lowers it to the earliest word left.
//! A lease period's sweep with nothing due reads that one word.
//!
//! One case leaves a Ref out: a maker killed between the commit and the
//! word. Reclaiming a dead process reads every descriptor anyway
//! (`release_holdings_of`), and lowers each group's word for the Refs live
//! in it. A new pool's words are zero: every group is swept once.

#[cfg(not(loom))]
use crate::desc::{mappers, DescState, Kind, END_EXPIRED};
#[cfg(not(loom))]
use crate::error::Result;
#[cfg(not(loom))]
use crate::layout::{words_for, EXPIRY_GROUP};
#[cfg(not(loom))]
use crate::process::Core;
#[cfg(not(loom))]
use crate::reclaim::GcReport;
#[cfg(not(loom))]
use crate::shm::Shm;
#[cfg(not(loom))]
use crate::slot::LeaseNow;
use crate::sync::{fence, AtomicU64, Ordering};

/// A maker's side, once its Ref is committed: lowers `word` to `at` if
/// it is later. Most makers find it early enough and write nothing, so
/// the line stays shared between the processes making Refs.
pub fn note(word: &AtomicU64, at: u64) {
    fence(Ordering::SeqCst);
    if word.load(Ordering::Relaxed) > at {
        word.fetch_min(at, Ordering::AcqRel);
    }
}

/// A sweeper's first step: raises `word` to `u64::MAX`. Its reads of the
/// group's descriptors follow.
pub fn begin_sweep(word: &AtomicU64) {
    word.swap(u64::MAX, Ordering::AcqRel);
    fence(Ordering::SeqCst);
}

/// A sweeper's last step: lowers `word` to the earliest expiry it left.
pub fn end_sweep(word: &AtomicU64, left: u64) {
    word.fetch_min(left, Ordering::AcqRel);
}

#[cfg(not(loom))]
impl Shm {
    /// Word `g` of the expiry summary, if in range.
    pub(crate) fn expiry_word(&self, g: u32) -> Option<&AtomicU64> {
        (u64::from(g) < words_for(self.layout.n_descs))
            // SAFETY: g is below the summary's word count: inside the area
            // `Layout::parse` validated (8-aligned); AtomicU64 has the
            // layout of u64.
            .then(|| unsafe { self.at(self.layout.exp_off + g as u64 * 8) })
    }

    /// Notes that descriptor `di` holds a live Ref expiring at `at`
    /// ([`note`]). Called after the commit.
    pub(crate) fn note_expiry(&self, di: u32, at: u64) {
        if let Some(w) = self.expiry_word(di / EXPIRY_GROUP) {
            note(w, at);
            note(&self.atomics().expiry_top, at);
        }
    }
}

#[cfg(not(loom))]
impl Core {
    /// Expires the Refs whose TTL passed, sweeping only the groups whose
    /// summary word is due (all of them with `all`). Pages freed go to
    /// `freed`; counts go to `rep`.
    pub(crate) fn expire_due(
        &self,
        now: LeaseNow,
        all: bool,
        rep: &mut GcReport,
        freed: &mut Vec<u32>,
        pass: &mut crate::progress::Pass<'_>,
    ) -> Result<()> {
        let due = self.shm.ref_now(now);
        let n = words_for(self.shm.layout.n_descs);
        let top = &self.shm.atomics().expiry_top;
        if !all && top.load(Ordering::Acquire) > due {
            // No group's word is due.
            pass.end("expiry groups", n);
            return Ok(());
        }
        begin_sweep(top);
        let mut earliest = u64::MAX;
        for g in 0..n as u32 {
            pass.at("expiry groups", g as u64, n);
            let Some(w) = self.shm.expiry_word(g) else {
                break;
            };
            let word = w.load(Ordering::Acquire);
            if !all && word > due {
                earliest = earliest.min(word);
                continue;
            }
            begin_sweep(w);
            rep.expiry_groups_swept += 1;
            match self.sweep_group(g, due, rep, freed) {
                Ok(left) => end_sweep(w, left),
                Err(e) => {
                    // Not read to the end: swept again next time.
                    end_sweep(w, 0);
                    end_sweep(top, 0);
                    return Err(e);
                }
            }
            earliest = earliest.min(w.load(Ordering::Acquire));
        }
        end_sweep(top, earliest);
        pass.end("expiry groups", n);
        Ok(())
    }

    /// Expires the Refs of group `g` due at `due`; returns the earliest
    /// expiry of those left live (`u64::MAX`: none).
    fn sweep_group(
        &self,
        g: u32,
        due: u64,
        rep: &mut GcReport,
        freed: &mut Vec<u32>,
    ) -> Result<u64> {
        let n = self.shm.layout.n_descs;
        let mut left = u64::MAX;
        for idx in g * EXPIRY_GROUP..((g + 1) * EXPIRY_GROUP).min(n) {
            let d = self.desc(idx)?;
            let w = d.state.load(Ordering::Acquire);
            if DescState::decode(w).kind != Some(Kind::RefLive)
                || mappers::released(d.aux.load(Ordering::Acquire))
            {
                continue;
            }
            let expiry = d.expiry_ms.load(Ordering::Relaxed);
            if due <= expiry {
                left = left.min(expiry);
                continue;
            }
            let flags = d.flags.load(Ordering::Relaxed);
            d.flags
                .store((flags & 0xFF) | (END_EXPIRED << 8), Ordering::Release);
            match mappers::release(&d.aux, self.slot) {
                mappers::Release::Drop => {
                    self.drop_ref(idx, d, w, END_EXPIRED, freed)?;
                    self.expired(rep);
                }
                mappers::Release::Kept => self.expired(rep),
                // Released meanwhile: its releaser drops it.
                mappers::Release::Already => {}
                // Its mapper word is locked (a map or unmap under way):
                // expired next time.
                mappers::Release::Busy(_) => left = left.min(expiry),
            }
        }
        Ok(left)
    }

    fn expired(&self, rep: &mut GcReport) {
        self.shm
            .atomics()
            .refs_expired
            .fetch_add(1, Ordering::Relaxed);
        rep.refs_expired += 1;
    }
}
