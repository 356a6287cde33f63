//! The client's cache of immutable pages (Semeru's compute-side cache,
//! without its coherence problem): the data a Ref names is a frozen
//! snapshot, so a page of it read once can be served again from here for
//! as long as the client reads it through a mapping of that Ref — nobody
//! can change it. Pages the client writes in its own mapping (its CoW
//! copies) are never served from here.
//!
//! Entries are page-sized chunks of a Ref's data, counted from the Ref's
//! first byte, keyed by the Ref's identity (server, descriptor, generation,
//! tag: a reused descriptor has another generation and tag). The cache
//! holds at most `capacity` bytes and evicts the least recently used.
//!
//! A Ref's chunks are admitted from its second read on: the first read
//! only notes the Ref (among the last [`SEEN`] noted). Most arguments are
//! read once, by the callee they were sent to, and copying those into the
//! cache cost a read of 64 KiB as much again as the read (19 -> 37 us on
//! the test machine, `examples/put_get`) and never paid back.

use dm_pool::Ref;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// A Ref's identity.
pub type RefKey = (u64, u32, u32, u64);

/// The key of a Ref.
pub fn key_of(r: &Ref) -> RefKey {
    (r.pool_id, r.desc, r.generation, r.tag)
}

/// Counters of a cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Chunks served from the cache.
    pub hits: u64,
    /// Chunks read from a server.
    pub misses: u64,
    /// Chunks evicted.
    pub evictions: u64,
    /// Bytes held now.
    pub bytes: u64,
}

impl CacheStats {
    /// Hits over lookups (0 if none).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// Refs read once remembered (for admission on the second read).
pub const SEEN: usize = 4096;

/// A cached chunk and when it was last used.
type Entry = (Arc<[u8]>, u64);

/// A bounded LRU of immutable chunks.
#[derive(Debug)]
pub struct PageCache {
    capacity: u64,
    map: HashMap<(RefKey, u64), Entry>,
    lru: BTreeMap<u64, (RefKey, u64)>,
    tick: u64,
    stats: CacheStats,
    /// Refs read once, in the order noted (the oldest forgotten first).
    seen: HashSet<RefKey>,
    seen_order: VecDeque<RefKey>,
}

impl PageCache {
    /// A cache of at most `capacity` bytes.
    pub fn new(capacity: u64) -> PageCache {
        PageCache {
            capacity,
            map: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            stats: CacheStats::default(),
            seen: HashSet::new(),
            seen_order: VecDeque::new(),
        }
    }

    /// Whether chunks of Ref `k` read now should be cached: yes if the Ref
    /// was read before (and is still remembered); else it is noted, and
    /// the answer is no.
    pub fn admit(&mut self, k: RefKey) -> bool {
        if self.seen.contains(&k) {
            return true;
        }
        if self.seen_order.len() >= SEEN {
            if let Some(old) = self.seen_order.pop_front() {
                self.seen.remove(&old);
            }
        }
        self.seen.insert(k);
        self.seen_order.push_back(k);
        false
    }

    /// Chunk `chunk` of Ref `k`, if cached (counted as a hit or a miss).
    pub fn get(&mut self, k: RefKey, chunk: u64) -> Option<Arc<[u8]>> {
        self.tick += 1;
        let tick = self.tick;
        match self.map.get_mut(&(k, chunk)) {
            Some((data, t)) => {
                self.lru.remove(t);
                *t = tick;
                self.lru.insert(tick, (k, chunk));
                self.stats.hits += 1;
                Some(data.clone())
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Caches chunk `chunk` of Ref `k`, evicting the least recently used
    /// chunks to stay within the capacity.
    pub fn put(&mut self, k: RefKey, chunk: u64, data: Arc<[u8]>) {
        if data.len() as u64 > self.capacity {
            return;
        }
        self.tick += 1;
        let len = data.len() as u64;
        if let Some((old, t)) = self.map.insert((k, chunk), (data, self.tick)) {
            self.lru.remove(&t);
            self.stats.bytes -= old.len() as u64;
        }
        self.lru.insert(self.tick, (k, chunk));
        self.stats.bytes += len;
        while self.stats.bytes > self.capacity {
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            if let Some((d, _)) = self.map.remove(&victim) {
                self.stats.bytes -= d.len() as u64;
                self.stats.evictions += 1;
            }
        }
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_within_capacity() {
        let mut c = PageCache::new(3 * 4);
        let k = (1, 2, 3, 4);
        for i in 0..3 {
            c.put(k, i, Arc::from([i as u8; 4]));
        }
        assert!(c.get(k, 0).is_some()); // 0 is now the most recent
        c.put(k, 3, Arc::from([3; 4])); // evicts 1
        assert!(c.get(k, 1).is_none());
        assert_eq!(&*c.get(k, 0).unwrap(), &[0u8; 4]);
        assert_eq!(&*c.get(k, 3).unwrap(), &[3u8; 4]);
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.evictions, s.bytes), (3, 1, 1, 12));
        // Another Ref's chunk with the same number is another entry.
        assert!(c.get((1, 2, 4, 4), 0).is_none());
        // Too large to cache: ignored.
        c.put(k, 9, Arc::from([0; 100]));
        assert!(c.get(k, 9).is_none());
    }

    #[test]
    fn a_ref_is_admitted_on_its_second_read_while_remembered() {
        let mut c = PageCache::new(1 << 20);
        let k = |i: u64| (1, 2, 3, i);
        assert!(!c.admit(k(0)));
        assert!(c.admit(k(0)));
        assert!(c.admit(k(0)));
        // Forgotten after SEEN other Refs: a first read again.
        for i in 1..=SEEN as u64 {
            assert!(!c.admit(k(i)));
        }
        assert!(!c.admit(k(0)));
        assert!(c.admit(k(SEEN as u64)));
    }
}
