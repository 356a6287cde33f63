//! Per-client quotas: the pages a session holds (its buffers, and the
//! live Refs it created) are charged to its account, and a request that
//! would take it past its quota is refused with `ResourceExhausted`.
//!
//! A charge is given back when what it paid for is dropped: a buffer
//! freed, a Ref released or expired. A Ref outlives the session that made
//! it, and so does its charge (on an account nobody charges any more):
//! what a client can hold after it disconnects is bounded by the Refs'
//! TTL cap (`Config::max_ttl`), not by its quota.

use dm_pool::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The pages a session holds, and the most it may.
#[derive(Debug)]
pub struct Account {
    held: AtomicU64,
    quota: u64,
}

impl Account {
    /// An account of at most `quota` pages.
    pub fn new(quota: u64) -> Arc<Account> {
        Arc::new(Account {
            held: AtomicU64::new(0),
            quota,
        })
    }

    /// Pages held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Charges `n` pages, or refuses if the quota would be passed.
    pub fn charge(self: &Arc<Self>, n: u64) -> Result<Charge> {
        let before = self.held.fetch_add(n, Ordering::AcqRel);
        if before.saturating_add(n) > self.quota {
            self.held.fetch_sub(n, Ordering::AcqRel);
            return Err(Error::ResourceExhausted {
                what: "memory-server quota",
            });
        }
        Ok(Charge {
            account: self.clone(),
            n,
        })
    }
}

/// Pages charged to an account, given back when dropped.
#[derive(Debug)]
pub struct Charge {
    account: Arc<Account>,
    n: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.account.held.fetch_sub(self.n, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_within_the_quota_and_gives_back_on_drop() {
        let a = Account::new(10);
        let c = a.charge(6).unwrap();
        assert!(matches!(
            a.charge(5),
            Err(Error::ResourceExhausted {
                what: "memory-server quota"
            })
        ));
        assert_eq!(a.held(), 6, "a refused charge leaves nothing behind");
        let d = a.charge(4).unwrap();
        drop(c);
        assert_eq!(a.held(), 4);
        drop(d);
        assert_eq!(a.held(), 0);
    }
}
