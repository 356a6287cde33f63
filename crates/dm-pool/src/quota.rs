//! Quotas: how many pages of buffers a process, and a tenant (processes
//! that attach under one name), may hold.
//!
//! The header holds a quota table ([`Quotas`](crate::layout::Quotas)): a
//! default quota for every process and up to 16 named tenants, each with
//! its quota and the pages its processes hold. A slot records the pages
//! its process holds, its quota, and its tenant.
//!
//! A process charges a buffer's pages when it gets the buffer (`alloc`,
//! `map_ref`) and gives them back when the buffer goes (freed, or turned
//! into a Ref: a Ref in flight is bounded by its TTL, not by a quota). A
//! charge past a quota is undone and refused with `ResourceExhausted`
//! naming the quota; nothing else changes.
//!
//! Crashes: only its owner changes a slot's count. When a dead slot is
//! reclaimed, its count is taken out of its tenant's and zeroed; a process
//! that attaches starts from zero. A reclaimer that dies between the two
//! steps leaves the tenant's count too high (never too low) until a gc
//! with nobody attached recounts every tenant to zero.
//!
//! Every word read here may have been written by anyone who can write the
//! pool: a tenant index is checked against the table, and counts saturate
//! instead of wrapping.

use crate::error::{Error, Result};
use crate::layout::{Quotas, Tenant, MAX_TENANTS, QUOTAS_OFF, TENANT_NAME_MAX};
use crate::shm::Shm;
use crate::slot::Slot;
use std::sync::atomic::{AtomicU64, Ordering};

impl Shm {
    /// The quota table.
    pub(crate) fn quotas(&self) -> &Quotas {
        // SAFETY: the header is always mapped (HEADER_LEN bytes, checked at
        // open), and the table lies inside it at an 8-aligned offset
        // (asserted in layout.rs); any bytes are valid atomics.
        unsafe { self.at(QUOTAS_OFF as u64) }
    }

    /// The tenant of a slot, if it has a valid one.
    pub(crate) fn tenant_of(&self, s: &Slot) -> Option<&Tenant> {
        let t = s.tenant.load(Ordering::Relaxed);
        (1..=MAX_TENANTS as u64)
            .contains(&t)
            .then(|| &self.quotas().tenants[t as usize - 1])
    }

    /// Writes the quotas of a pool being created (before it is ready).
    pub(crate) fn init_quotas(&self, cfg: &crate::layout::PoolConfig) {
        let ps = self.layout.page_size as u64;
        let q = self.quotas();
        q.process_pages.store(
            cfg.process_quota.map_or(0, |b| b.div_ceil(ps).max(1)),
            Ordering::Relaxed,
        );
        for (t, (name, bytes)) in q.tenants.iter().zip(&cfg.tenants) {
            for (k, w) in name_words(name).into_iter().enumerate() {
                t.name[k].store(w, Ordering::Relaxed);
            }
            t.quota_pages
                .store(bytes.div_ceil(ps).max(1), Ordering::Relaxed);
            t.held_pages.store(0, Ordering::Relaxed);
        }
    }

    /// The index + 1 of the tenant named `name`, or an error naming the
    /// tenants there are.
    pub(crate) fn find_tenant(&self, name: &str) -> Result<u64> {
        let want = name_words(name);
        let mut names = Vec::new();
        for (i, t) in self.quotas().tenants.iter().enumerate() {
            let w: [u64; 3] = std::array::from_fn(|k| t.name[k].load(Ordering::Relaxed));
            if w == [0; 3] {
                continue;
            }
            if w == want && name.len() <= TENANT_NAME_MAX && !name.is_empty() {
                return Ok(i as u64 + 1);
            }
            names.push(name_of(&w));
        }
        Err(Error::InvalidConfig(format!(
            "no tenant {name:?} in this pool (it has {}): tenants are named when the pool is \
             created (`dmrpc pool create NAME --tenant {name}=1GiB`, `PoolConfig::tenants`)",
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        )))
    }

    /// Tenants and their (held, quota) pages, for stats.
    pub(crate) fn tenant_usage(&self) -> Vec<(String, u64, u64)> {
        self.quotas()
            .tenants
            .iter()
            .filter_map(|t| {
                let w: [u64; 3] = std::array::from_fn(|k| t.name[k].load(Ordering::Relaxed));
                (w != [0; 3]).then(|| {
                    (
                        name_of(&w),
                        t.held_pages.load(Ordering::Relaxed),
                        t.quota_pages.load(Ordering::Relaxed),
                    )
                })
            })
            .collect()
    }

    /// Takes a dead slot's count out of its tenant's (reclaim), and zeroes
    /// it.
    pub(crate) fn drop_charges(&self, s: &Slot) {
        let n = s.held_pages.swap(0, Ordering::AcqRel);
        if let Some(t) = self.tenant_of(s) {
            sub(&t.held_pages, n);
        }
    }

    /// Zeroes every tenant's count (gc's recount, with nobody attached).
    pub(crate) fn reset_tenants(&self) {
        for t in &self.quotas().tenants {
            t.held_pages.store(0, Ordering::Relaxed);
        }
    }

    /// Charges `n` pages to slot `s` (and its tenant), or refuses.
    pub(crate) fn charge(&self, s: &Slot, n: u64) -> Result<()> {
        let held = s
            .held_pages
            .fetch_add(n, Ordering::AcqRel)
            .saturating_add(n);
        let quota = s.quota_pages.load(Ordering::Relaxed);
        if quota != 0 && held > quota {
            sub(&s.held_pages, n);
            return Err(Error::ResourceExhausted {
                what: "process quota",
            });
        }
        if let Some(t) = self.tenant_of(s) {
            let held = t
                .held_pages
                .fetch_add(n, Ordering::AcqRel)
                .saturating_add(n);
            let quota = t.quota_pages.load(Ordering::Relaxed);
            if quota != 0 && held > quota {
                sub(&t.held_pages, n);
                sub(&s.held_pages, n);
                return Err(Error::ResourceExhausted {
                    what: "tenant quota",
                });
            }
        }
        Ok(())
    }

    /// Gives back `n` pages charged to slot `s`.
    pub(crate) fn uncharge(&self, s: &Slot, n: u64) {
        sub(&s.held_pages, n);
        if let Some(t) = self.tenant_of(s) {
            sub(&t.held_pages, n);
        }
    }
}

/// Subtracts `n`, stopping at zero (a count others could have scribbled on
/// never wraps to a huge value).
fn sub(w: &AtomicU64, n: u64) {
    let _ = w.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |x| {
        Some(x.saturating_sub(n))
    });
}

fn name_words(name: &str) -> [u64; 3] {
    let mut b = [0u8; TENANT_NAME_MAX];
    let n = name.len().min(TENANT_NAME_MAX);
    b[..n].copy_from_slice(&name.as_bytes()[..n]);
    std::array::from_fn(|k| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[k * 8..k * 8 + 8]);
        u64::from_le_bytes(x)
    })
}

fn name_of(w: &[u64; 3]) -> String {
    let b: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}
