//! Channels: per-connection shared memory in the pool, owned by a client
//! and a server slot.
//!
//! A channel is a 4 KiB control page followed by two rings of `ring_size`
//! bytes (requests, then responses). The pool owns the first 64 bytes of
//! the control page, this record:
//!
//! ```text
//! 0   state: generation (32) | kind (8: free, opening, open) | flags (8)
//!     flags: 1 client closed, 2 server closed, 4 accepted by the server
//! 8   client: slot (16) | incarnation (32) << 16
//! 16  server: slot (16) | incarnation (32) << 16
//! 24  service: record index (32) | record generation (32) << 32
//! 32  opened at, ms since the epoch
//! ```
//!
//! The rest of the control page and the rings belong to the RPC layer
//! (`dm-rpc`'s shm transport), which lays its ring cursors and futex words
//! there. The opener zeroes all of it, so a connection never sees bytes of
//! an earlier one. A client opens a channel to a registered service (`free → opening
//! → open`, each a CAS, so maintenance can never free a channel under its
//! opener); the server accepts it; each side closes its end, and the last to
//! close frees it. A side whose slot dies is closed by the pool's
//! maintenance (lease thread or `dmrpc pool gc`), or by an opener that
//! found every channel in use, so a channel never outlives both of its
//! owners. An opener refused for want of a channel can tell whether some
//! are on their way to free (one end closed, the other's owner live and
//! yet to notice), and whose move frees them: `Pool::channels_closing`.

use crate::error::{Error, Result};
use crate::registry::ServiceInfo;
use crate::shm::Shm;
use crate::slot::LeaseNow;
use crate::sync::{AtomicU64, Ordering};

pub(crate) use crate::layout::CONTROL_LEN;
/// Bytes of the control page owned by the pool.
pub(crate) const RECORD_LEN: usize = 64;

const FREE: u64 = 0;
const OPENING: u64 = 1;
const OPEN: u64 = 2;
const CLIENT_CLOSED: u64 = 1;
const SERVER_CLOSED: u64 = 2;
const ACCEPTED: u64 = 4;

/// Channels on their way to free ([`Pool::channels_closing`]), by whose
/// move frees them.
///
/// [`Pool::channels_closing`]: crate::Pool::channels_closing
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Closing {
    /// Opening, or closed by their client: the opener finishes, or the
    /// server (which watches its channels, and is woken by a client's close)
    /// closes its end between calls. Worth waiting for.
    pub soon: usize,
    /// Closed by their server while their client lives: freed when the
    /// client next calls or drops its connection. A client in a call
    /// notices at once; an idle one may hold its channel indefinitely, so
    /// waiting for these is worth only a short grace.
    pub by_clients: usize,
}

impl Closing {
    /// All channels on their way to free.
    pub fn total(&self) -> usize {
        self.soon + self.by_clients
    }
}

/// The pool's record of a channel.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct ChannelRecord {
    /// `generation | kind | flags`.
    pub state: AtomicU64,
    /// Client `slot | incarnation << 16`.
    pub client: AtomicU64,
    /// Server `slot | incarnation << 16`.
    pub server: AtomicU64,
    /// `service index | service generation << 32`.
    pub service: AtomicU64,
    /// Opening time, ms since the epoch.
    pub opened_ms: AtomicU64,
    _rsv: [AtomicU64; 3],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<ChannelRecord>() == RECORD_LEN);

/// Names one opening of a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChannelId {
    /// Channel index.
    pub index: u32,
    /// Generation of the channel record when it was opened.
    pub generation: u32,
}

/// Which end of a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The end that opened it.
    Client,
    /// The service's end.
    Server,
}

/// What one end knows of the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// Attached and has not closed.
    Live,
    /// Closed its end.
    Closed,
    /// Its process is gone (lease expired, or its pid vanished on this host).
    Dead,
}

/// The RPC layer's memory of a channel: valid while the [`Pool`](crate::Pool)
/// it came from is alive.
#[derive(Debug, Clone, Copy)]
pub struct ChannelMemory {
    /// Control bytes after the pool's record (`CONTROL_LEN - RECORD_LEN`),
    /// 64-byte aligned.
    pub control: *mut u8,
    /// The request ring (client to server), `ring_size` bytes.
    pub requests: *mut u8,
    /// The response ring (server to client), `ring_size` bytes.
    pub responses: *mut u8,
    /// Bytes of each ring (a power of two).
    pub ring_size: usize,
}

fn word(slot: u16, inc: u32) -> u64 {
    slot as u64 | ((inc as u64) << 16)
}

fn unword(w: u64) -> (u16, u32) {
    (w as u16, (w >> 16) as u32)
}

fn st(gen: u32, kind: u64, flags: u64) -> u64 {
    gen as u64 | (kind << 32) | (flags << 40)
}

fn unst(w: u64) -> (u32, u64, u64) {
    (w as u32, (w >> 32) & 0xFF, (w >> 40) & 0xFF)
}

impl Shm {
    /// Channel record `i`, if in range.
    pub(crate) fn channel(&self, i: u32) -> Option<&ChannelRecord> {
        if i >= self.layout.n_channels {
            return None;
        }
        // SAFETY: i < n_channels: the record is inside the channel table,
        // which `Layout::parse` validated; a ChannelRecord is repr(C) atomics.
        Some(unsafe { self.at(self.channel_off(i)) })
    }

    fn channel_off(&self, i: u32) -> u64 {
        self.layout.chan_off + i as u64 * crate::layout::channel_stride(self.layout.ring_size)
    }

    /// Closes the ends of channels whose owners are dead, and frees channels
    /// with both ends closed. Returns how many channels it freed.
    pub(crate) fn sweep_channels(&self) -> u64 {
        let now = LeaseNow::read();
        let mut freed = 0;
        for i in 0..self.layout.n_channels {
            let Some(c) = self.channel(i) else { break };
            let w = c.state.load(Ordering::Acquire);
            let (gen, kind, flags) = unst(w);
            let alive = |a: &AtomicU64| {
                let (s, inc) = unword(a.load(Ordering::Acquire));
                self.slot_is(s, inc, now)
            };
            // An end whose owner is in quarantine may still be written:
            // closed, but its rings are not reused yet.
            let held = |a: &AtomicU64| {
                let (s, inc) = unword(a.load(Ordering::Acquire));
                self.slot(s)
                    .is_some_and(|sl| self.in_quarantine(sl, Some(inc), now))
            };
            let to = match kind {
                OPENING if !alive(&c.client) && !held(&c.client) => {
                    st(gen.wrapping_add(1), FREE, 0)
                }
                OPEN => {
                    let mut f = flags;
                    if f & CLIENT_CLOSED == 0 && !alive(&c.client) {
                        f |= CLIENT_CLOSED;
                    }
                    if f & SERVER_CLOSED == 0 && !alive(&c.server) {
                        f |= SERVER_CLOSED;
                    }
                    if f & (CLIENT_CLOSED | SERVER_CLOSED) == CLIENT_CLOSED | SERVER_CLOSED
                        && !held(&c.client)
                        && !held(&c.server)
                    {
                        st(gen.wrapping_add(1), FREE, 0)
                    } else if f != flags {
                        st(gen, OPEN, f)
                    } else {
                        continue;
                    }
                }
                _ => continue,
            };
            if c.state
                .compare_exchange(w, to, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
                && unst(to).1 == FREE
            {
                freed += 1;
            }
        }
        freed
    }

    /// Calls `f(record, kind, flags)` for every channel record, its state
    /// read with Acquire.
    fn each_channel(&self, mut f: impl FnMut(&ChannelRecord, u64, u64)) {
        for c in (0..self.layout.n_channels).filter_map(|i| self.channel(i)) {
            let (_, kind, flags) = unst(c.state.load(Ordering::Acquire));
            f(c, kind, flags);
        }
    }

    /// How many channel records satisfy `f(record, kind, flags)`.
    fn count_channels(&self, f: impl Fn(&ChannelRecord, u64, u64) -> bool) -> usize {
        let mut n = 0;
        self.each_channel(|c, kind, flags| n += usize::from(f(c, kind, flags)));
        n
    }

    /// Open channels of registration `index`/`generation` (its connections).
    pub(crate) fn channels_of(&self, index: u32, generation: u32) -> usize {
        let want = index as u64 | ((generation as u64) << 32);
        self.count_channels(|c, kind, flags| {
            kind == OPEN
                && flags & (CLIENT_CLOSED | SERVER_CLOSED) == 0
                && c.service.load(Ordering::Relaxed) == want
        })
    }

    /// Channels in use (opening or open): for `check` and `stats`.
    pub(crate) fn channels_in_use(&self) -> Vec<(u32, u16, u16)> {
        (0..self.layout.n_channels)
            .filter_map(|i| {
                let c = self.channel(i)?;
                let (_, kind, _) = unst(c.state.load(Ordering::Acquire));
                (kind != FREE).then(|| {
                    (
                        i,
                        unword(c.client.load(Ordering::Relaxed)).0,
                        unword(c.server.load(Ordering::Relaxed)).0,
                    )
                })
            })
            .collect()
    }
}

impl crate::pool::Pool {
    fn chan(&self, id: ChannelId) -> Result<(&ChannelRecord, u64)> {
        let c = self
            .shm()
            .channel(id.index)
            .ok_or_else(|| Error::NoChannel(format!("channel index {} out of range", id.index)))?;
        let w = c.state.load(Ordering::Acquire);
        let (gen, kind, _) = unst(w);
        if gen != id.generation || kind == FREE {
            return Err(Error::NoChannel(format!(
                "channel {} generation {} is gone",
                id.index, id.generation
            )));
        }
        Ok((c, w))
    }

    /// Opens a channel to service `svc` (the client's end). With every
    /// channel in use, the channels of dead processes are freed first (as
    /// maintenance would free them) and taken if that freed any; else
    /// `ResourceExhausted` (see [`channels_closing`](Self::channels_closing)
    /// for whether waiting may help).
    pub fn open_channel(&self, svc: &ServiceInfo) -> Result<ChannelId> {
        self.inner.live()?;
        match self.take_channel(svc) {
            Err(Error::ResourceExhausted { .. }) if self.shm().sweep_channels() > 0 => {
                self.take_channel(svc)
            }
            r => r,
        }
    }

    /// Channels on their way to free: one end closed while the other's
    /// owner has yet to notice, or an opening in progress, counted by whose
    /// move frees them. A client that found no free channel may wait for
    /// these; the others are in use by live processes.
    pub fn channels_closing(&self) -> Closing {
        let mut closing = Closing::default();
        self.shm().each_channel(|_, kind, flags| {
            if kind == OPENING || (kind == OPEN && flags & CLIENT_CLOSED != 0) {
                closing.soon += 1;
            } else if kind == OPEN && flags & SERVER_CLOSED != 0 {
                closing.by_clients += 1;
            }
        });
        closing
    }

    fn take_channel(&self, svc: &ServiceInfo) -> Result<ChannelId> {
        let shm = self.shm();
        let me = word(self.slot(), self.inner.incarnation);
        for i in 0..shm.layout.n_channels {
            let Some(c) = shm.channel(i) else { break };
            let w = c.state.load(Ordering::Acquire);
            let (gen, kind, _) = unst(w);
            if kind != FREE {
                continue;
            }
            let opening = st(gen, OPENING, 0);
            if c.state
                .compare_exchange(w, opening, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            c.client.store(me, Ordering::Release);
            c.server
                .store(word(svc.slot, svc.incarnation), Ordering::Relaxed);
            c.service.store(
                svc.index as u64 | ((svc.generation as u64) << 32),
                Ordering::Relaxed,
            );
            c.opened_ms.store(dm_sys::time::now_ms(), Ordering::Relaxed);
            // Zero everything after the record: the control page and both
            // rings, so nothing of an earlier connection (records that
            // would look ready) survives into this one.
            let off = shm.channel_off(i) as usize + RECORD_LEN;
            let len = crate::layout::channel_stride(shm.layout.ring_size) as usize - RECORD_LEN;
            // SAFETY: the channel lies inside the validated channel table,
            // and only the opener touches it while the channel is `opening`
            // (the server looks only at open channels; the previous owners
            // closed both ends before it became free).
            unsafe {
                std::ptr::write_bytes(shm.base().add(off), 0, len);
            }
            if c.state
                .compare_exchange(
                    opening,
                    st(gen, OPEN, 0),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
            {
                // Maintenance freed it before our client word was visible.
                continue;
            }
            return Ok(ChannelId {
                index: i,
                generation: gen,
            });
        }
        Err(Error::ResourceExhausted { what: "channels" })
    }

    /// Open channels to `svc` that its server has not accepted yet.
    pub fn pending_channels(&self, svc: &ServiceInfo) -> Vec<ChannelId> {
        let shm = self.shm();
        let want = svc.index as u64 | ((svc.generation as u64) << 32);
        (0..shm.layout.n_channels)
            .filter_map(|i| {
                let c = shm.channel(i)?;
                let (gen, kind, flags) = unst(c.state.load(Ordering::Acquire));
                (kind == OPEN
                    && flags & (ACCEPTED | CLIENT_CLOSED) == 0
                    && c.service.load(Ordering::Relaxed) == want)
                    .then_some(ChannelId {
                        index: i,
                        generation: gen,
                    })
            })
            .collect()
    }

    /// Marks a pending channel accepted by this (the server's) process.
    pub fn accept_channel(&self, id: ChannelId) -> Result<()> {
        loop {
            let (c, w) = self.chan(id)?;
            let (s, inc) = unword(c.server.load(Ordering::Relaxed));
            if (s, inc) != (self.slot(), self.inner.incarnation) {
                return Err(Error::NoChannel(format!(
                    "channel {} belongs to another server",
                    id.index
                )));
            }
            let (gen, kind, flags) = unst(w);
            if kind != OPEN {
                return Err(Error::NoChannel(format!(
                    "channel {} is not open",
                    id.index
                )));
            }
            if c.state
                .compare_exchange(
                    w,
                    st(gen, OPEN, flags | ACCEPTED),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                return Ok(());
            }
        }
    }

    /// Closes this process's end; the last end closed frees the channel.
    pub fn close_channel(&self, id: ChannelId, side: Side) {
        let (mine, theirs) = match side {
            Side::Client => (CLIENT_CLOSED, SERVER_CLOSED),
            Side::Server => (SERVER_CLOSED, CLIENT_CLOSED),
        };
        while let Ok((c, w)) = self.chan(id) {
            let (gen, _, flags) = unst(w);
            if flags & mine != 0 {
                return;
            }
            let to = if flags & theirs != 0 {
                st(gen.wrapping_add(1), FREE, 0)
            } else {
                st(gen, OPEN, flags | mine)
            };
            if c.state
                .compare_exchange(w, to, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    /// Gives up channel `id` as its client before its server accepted it
    /// (the service went away as the client connected): the channel is
    /// freed at once, unless the server accepts it meanwhile, and is then
    /// closed on the client's side as [`close_channel`](Self::close_channel)
    /// does. (A client that only closed its side would leave a channel
    /// nobody accepts in use until its server's process ends.)
    pub fn abandon_channel(&self, id: ChannelId) {
        while let Ok((c, w)) = self.chan(id) {
            let (gen, _, flags) = unst(w);
            if flags & (ACCEPTED | CLIENT_CLOSED) != 0 {
                self.close_channel(id, Side::Client);
                return;
            }
            // (The server's accept is a compare-and-swap on this word too:
            // exactly one of the two happens.)
            let freed = st(gen.wrapping_add(1), FREE, 0);
            if c.state
                .compare_exchange(w, freed, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    /// The state of the other end of channel `id`, seen from `side`.
    pub fn channel_peer(&self, id: ChannelId, side: Side) -> Peer {
        let Ok((c, w)) = self.chan(id) else {
            return Peer::Closed;
        };
        let (_, _, flags) = unst(w);
        let (closed, who) = match side {
            Side::Client => (SERVER_CLOSED, &c.server),
            Side::Server => (CLIENT_CLOSED, &c.client),
        };
        if flags & closed != 0 {
            return Peer::Closed;
        }
        let (s, inc) = unword(who.load(Ordering::Acquire));
        if self.shm().slot_is(s, inc, LeaseNow::read()) {
            Peer::Live
        } else {
            Peer::Dead
        }
    }

    /// Process id of the other end of channel `id`, seen from `side`.
    pub fn channel_peer_pid(&self, id: ChannelId, side: Side) -> Option<u32> {
        let (c, _) = self.chan(id).ok()?;
        let who = match side {
            Side::Client => &c.server,
            Side::Server => &c.client,
        };
        let (s, _) = unword(who.load(Ordering::Acquire));
        self.shm().slot(s).map(|x| x.pid.load(Ordering::Relaxed))
    }

    /// The RPC layer's memory of channel `id`.
    pub fn channel_memory(&self, id: ChannelId) -> Result<ChannelMemory> {
        self.chan(id)?;
        let shm = self.shm();
        let off = shm.channel_off(id.index) as usize;
        let ring_size = shm.layout.ring_size as usize;
        // SAFETY: the channel lies inside the validated channel table.
        let base = unsafe { shm.base().add(off) };
        // SAFETY: as above; the rings follow the control page.
        unsafe {
            Ok(ChannelMemory {
                control: base.add(RECORD_LEN),
                requests: base.add(CONTROL_LEN),
                responses: base.add(CONTROL_LEN + ring_size),
                ring_size,
            })
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        assert_eq!(unword(word(7, 0xABCD_1234)), (7, 0xABCD_1234));
        assert_eq!(unst(st(9, OPEN, ACCEPTED)), (9, OPEN, ACCEPTED));
    }
}
