//! The shared-memory transport: per-connection rings in the pool.
//!
//! A server registers its name in the pool's registry; a client opens a
//! channel in the pool's channel table (see `dm_pool::channel`), which
//! gives a control page and two rings. The control page after the pool's
//! record holds (offsets from the record's end, version [`CONTROL_VERSION`]):
//!
//! ```text
//! 0    magic | ring version, written by the client when it opens
//! 64   request ring cursors  (head, tail, producer bell: 3 cache lines)
//! 256  response ring cursors (head, tail, producer bell: unused, below)
//! 448  the client's bell (the response ring's consumer parks on it)
//! 512  the go-away word (u64, written by the server when it stops: see
//!      `transport::goaway`)
//! ```
//!
//! The request rings of all of a service's connections share one consumer
//! bell, the server's doorbell, in the service's registry record (word 0;
//! word 16, on another cache line, counts connection attempts so that the
//! server scans the channel table only when a client arrived; word 32, on
//! a third, counts clients' closes so that the server closes its end, and
//! the channel is free for another connection, as soon as it next looks
//! instead of at its next periodic sweep). So one server thread waits for
//! every client with one futex, and a client pays a syscall only when the
//! server is parked.
//!
//! The server's doorbell is also where it waits for room in a response
//! ring: a client that consumes answers rings the server's doorbell, not
//! the response ring's own producer bell. The server takes a request only
//! when the connection has room for its answer, so a server whose clients
//! have not yet read their answers waits for requests and for room at once,
//! on one word (control version 2; in version 1 the room was signalled on
//! the response ring's bell, where the waiting server did not listen, and
//! it noticed only at the end of a 20 ms park slice). The room it keeps
//! per answer owed is the largest answer's for the only call in progress
//! (or while another such would still fit), else a small answer's
//! ([`SMALL_ANSWER`]: the dispatcher sends a larger payload by Ref, as it
//! learns from [`Listener::answer_max`]); the end of a stream is always a
//! small answer. This is the server's own accounting: the client sees
//! only answers inline or by Ref.
//!
//! A server that stops writes the go-away word before it closes its end:
//! the highest call id it took, so the client sends the requests it never
//! took to another server (control version 3).

use super::parts::{self, Joiner, MAX_JOINED};
use super::ring::{self, record_len, Consumer, Producer, RawData, RingControl};
use super::{
    ConnId, Connection, FrameRx, FrameTx, Listener, Looked, TransportError, Waker, WatchSet,
    Watched,
};
use crate::frame::{Frame, Kind, Limits, FLAG_STREAM, HEADER_LEN};
use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};
use crate::wait::{Bell, Bells, WaitPolicy, Waiter};
use dm_pool::{ChannelId, ChannelMemory, Peer, Pool, ServiceInfo, Side};
use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Version of the control-page layout and bells above (history:
/// `CHANGELOG.md`).
pub(crate) const CONTROL_VERSION: u32 = 3;
const MAGIC: u32 = 0x4443_0000 | CONTROL_VERSION << 8 | super::RING_VERSION;
const REQ_CTL: usize = 64;
const RESP_CTL: usize = 256;
const CLIENT_BELL: usize = 448;
const GOAWAY: usize = 512;
const SERVER_BELL: usize = 0;
const CONN_EPOCH: usize = 16;
const CLOSE_EPOCH: usize = 32;

/// Largest inline payload a pool's rings carry (a frame is at most half a
/// ring).
pub fn ring_max_inline(pool: &Pool) -> usize {
    ring::max_record(pool.layout().ring_size as usize) - HEADER_LEN
}

struct ChannelParts {
    req: &'static RingControl,
    resp: &'static RingControl,
    client_bell: &'static AtomicU32,
    magic: &'static AtomicU32,
    goaway: &'static AtomicU64,
    req_data: RawData,
    resp_data: RawData,
}

/// # Safety
/// The returned references point into the pool mapping: the caller must keep
/// a clone of `pool` alive at least as long as it uses them.
unsafe fn parts(m: &ChannelMemory) -> ChannelParts {
    // SAFETY: (for all derefs below) the control page is 4032 bytes, 64-byte
    // aligned, inside the pool mapping, and every offset used fits in it
    // (with the alignment of its type); RingControl, AtomicU32 and
    // AtomicU64 are valid for any bit pattern.
    unsafe {
        ChannelParts {
            req: &*(m.control.add(REQ_CTL) as *const RingControl),
            resp: &*(m.control.add(RESP_CTL) as *const RingControl),
            client_bell: &*(m.control.add(CLIENT_BELL) as *const AtomicU32),
            magic: &*(m.control as *const AtomicU32),
            goaway: &*(m.control.add(GOAWAY) as *const AtomicU64),
            req_data: RawData::new(m.requests, m.ring_size),
            resp_data: RawData::new(m.responses, m.ring_size),
        }
    }
}

fn service_words(pool: &Pool, svc: &ServiceInfo) -> Result<&'static [AtomicU32], TransportError> {
    let w = pool.service_words(svc)?;
    // SAFETY: the words live in the pool mapping; every holder of the
    // returned slice also holds a clone of `pool`, which keeps it mapped.
    Ok(unsafe { std::slice::from_raw_parts(w.as_ptr(), w.len()) })
}

/// What both halves of a client connection share; closes the client's end
/// of the channel when the last half is dropped.
struct ClientShared {
    ch: ChannelId,
    svc: ServiceInfo,
    // Last: dropped after the rings that point into it.
    pool: Pool,
}

impl ClientShared {
    fn check_peer(&self) -> Result<(), TransportError> {
        match self.pool.channel_peer(self.ch, Side::Client) {
            Peer::Live => Ok(()),
            Peer::Closed => Err(TransportError::Unavailable(format!(
                "service {:?} closed the connection",
                self.svc.name
            ))),
            Peer::Dead => Err(TransportError::Unavailable(format!(
                "service {:?} (pid {}) is dead",
                self.svc.name, self.svc.pid
            ))),
        }
    }
}

impl Drop for ClientShared {
    fn drop(&mut self) {
        self.pool.close_channel(self.ch, Side::Client);
        if let Ok(w) = service_words(&self.pool, &self.svc) {
            w[CLOSE_EPOCH].fetch_add(1, Ordering::Release);
            Bell(&w[SERVER_BELL]).ring();
        }
    }
}

/// The go-away word of a client's channel.
struct ShmGoAway {
    word: &'static AtomicU64,
    // Keeps the pool mapped (and the channel open).
    _sh: Arc<ClientShared>,
}

impl super::GoAway for ShmGoAway {
    fn unread(&self, id: u64) -> bool {
        super::goaway::unread(self.word, id)
    }
}

struct ShmTx {
    prod: Producer<'static, RawData>,
    waiter: Waiter,
    sh: Arc<ClientShared>,
}

struct ShmRx {
    cons: Consumer<'static, RawData>,
    waiter: Waiter,
    bell: &'static AtomicU32,
    limits: Limits,
    sh: Arc<ClientShared>,
    /// Where a record's bytes past its header are copied: an inline
    /// payload takes the vector, other records leave it for the next
    /// (a by-Ref answer then costs no allocation).
    rest: Vec<u8>,
    /// An answer arriving in parts.
    joiner: Joiner,
}

/// The policy of a producer waiting for room in a full ring: the consumer
/// rings its bell without a fence (see `ring`), so it parks in short slices.
fn full_ring(policy: WaitPolicy) -> WaitPolicy {
    WaitPolicy {
        park_slice: policy.park_slice.min(Duration::from_millis(1)),
        ..policy
    }
}

/// Opens a channel to `svc` as its client: the shared part (which closes
/// the client's end when dropped), the channel's memory with the magic
/// written, and the service's words.
fn open_client(
    pool: &Pool,
    svc: &ServiceInfo,
) -> Result<(Arc<ClientShared>, ChannelParts, &'static [AtomicU32]), TransportError> {
    let words = service_words(pool, svc)?;
    let ch = pool.open_channel(svc)?;
    let sh = Arc::new(ClientShared {
        ch,
        svc: svc.clone(),
        pool: pool.clone(),
    });
    let m = pool.channel_memory(ch)?;
    // SAFETY: `sh` holds the pool; every user of the parts holds `sh`.
    let p = unsafe { parts(&m) };
    p.magic.store(MAGIC, Ordering::Release);
    Ok((sh, p, words))
}

/// Opens a connection to `svc` over a new channel of `pool`.
pub fn connect(
    pool: &Pool,
    svc: &ServiceInfo,
    policy: WaitPolicy,
) -> Result<Connection, TransportError> {
    let (sh, p, words) = open_client(pool, svc)?;
    let max_inline = ring_max_inline(pool);
    let tx = ShmTx {
        prod: Producer::new(p.req, p.req_data, &words[SERVER_BELL]),
        waiter: full_ring(policy).waiter(),
        sh: sh.clone(),
    };
    let rx = ShmRx {
        cons: Consumer::new(p.resp, p.resp_data).room_bell(&words[SERVER_BELL]),
        waiter: policy.waiter(),
        bell: p.client_bell,
        limits: Limits {
            max_payload: max_inline as u32,
            ..Limits::default()
        },
        sh,
        rest: Vec::new(),
        joiner: Joiner::default(),
    };
    let goaway = Arc::new(ShmGoAway {
        word: p.goaway,
        _sh: rx.sh.clone(),
    });
    words[CONN_EPOCH].fetch_add(1, Ordering::AcqRel);
    // A server that stops unregisters, then fences and looks for new
    // channels one last time (`go_away`): with this fence, either it sees
    // this channel (and accepts it, and says what it took), or this sees
    // the registration gone. Else the channel would never be accepted,
    // and its calls would wait out their deadlines.
    fence(Ordering::SeqCst);
    if !pool.service_current(svc) {
        pool.abandon_channel(rx.sh.ch);
        return Err(TransportError::Unavailable(format!(
            "service {:?} stopped as this client connected",
            svc.name
        )));
    }
    Bell(&words[SERVER_BELL]).ring();
    Ok(Connection {
        tx: Box::new(tx),
        rx: Box::new(rx),
        // (A frame longer than a record goes in parts.)
        max_inline: max_inline.max(MAX_JOINED),
        refs: super::Sharing::POOL,
        goaway,
    })
}

/// Pushes `f`, waiting for room until `deadline`: parked on `sleeper`
/// (the ring's room bell, or several bells), running `meanwhile` before
/// each look at the room (an error from it ends the wait) and `check`
/// between park slices.
#[inline]
fn push(
    prod: &mut Producer<'static, RawData>,
    f: &Frame,
    waiter: &mut Waiter,
    deadline: Option<Instant>,
    sleeper: impl crate::wait::Sleeper,
    meanwhile: impl FnMut() -> Result<(), TransportError>,
    check: impl FnMut() -> Result<(), TransportError>,
) -> Result<bool, TransportError> {
    let fill = |put: &mut dyn FnMut(&[u8])| f.encode_with(put);
    let len = f.encoded_len();
    push_record(prod, len, fill, waiter, deadline, sleeper, meanwhile, check)
}

/// Pushes a record of `len` bytes that `fill` writes, as [`push`] does.
#[allow(clippy::too_many_arguments)]
#[inline]
fn push_record(
    prod: &mut Producer<'static, RawData>,
    len: usize,
    fill: impl Fn(&mut dyn FnMut(&[u8])),
    waiter: &mut Waiter,
    deadline: Option<Instant>,
    sleeper: impl crate::wait::Sleeper,
    mut meanwhile: impl FnMut() -> Result<(), TransportError>,
    check: impl FnMut() -> Result<(), TransportError>,
) -> Result<bool, TransportError> {
    if prod.try_push(len, |put| fill(put))? {
        return Ok(true);
    }
    let room = waiter.wait(
        sleeper,
        deadline,
        || match meanwhile() {
            Err(e) => Some(Err(e)),
            Ok(()) => prod.fits(len).then_some(Ok(())),
        },
        check,
    )?;
    match room {
        None => Ok(false),
        Some(r) => {
            r?;
            Ok(prod.try_push(len, |put| fill(put))?)
        }
    }
}

/// Pushes `f` as [`push`] does, in parts if it is longer than a record
/// of the ring: each part waits for room in turn. `Ok(false)` if the
/// deadline passed first, maybe after some parts (the receiver drops a
/// frame whose parts stop: [`Joiner`]). (The ring refuses a record too
/// long before it takes any step: the path of every other frame is
/// [`push`]'s.)
#[inline]
fn push_whole(
    prod: &mut Producer<'static, RawData>,
    f: &Frame,
    waiter: &mut Waiter,
    deadline: Option<Instant>,
    sleeper: impl crate::wait::Sleeper + Copy,
    mut meanwhile: impl FnMut() -> Result<(), TransportError>,
    mut check: impl FnMut() -> Result<(), TransportError>,
) -> Result<bool, TransportError> {
    match push(
        prod,
        f,
        waiter,
        deadline,
        sleeper,
        &mut meanwhile,
        &mut check,
    ) {
        Err(TransportError::TooLarge { max, .. }) => {
            push_parts(prod, f, max, waiter, deadline, sleeper, meanwhile, check)
        }
        r => r,
    }
}

/// The parts of [`push_whole`]'s frame, each at most `max_rec` bytes,
/// pushed in turn, each written straight from the frame.
#[allow(clippy::too_many_arguments)]
#[cold]
fn push_parts(
    prod: &mut Producer<'static, RawData>,
    f: &Frame,
    max_rec: usize,
    waiter: &mut Waiter,
    deadline: Option<Instant>,
    sleeper: impl crate::wait::Sleeper + Copy,
    mut meanwhile: impl FnMut() -> Result<(), TransportError>,
    mut check: impl FnMut() -> Result<(), TransportError>,
) -> Result<bool, TransportError> {
    for r in parts::records(f, max_rec - HEADER_LEN) {
        let fill = |put: &mut dyn FnMut(&[u8])| r.fill(put);
        let (m, c) = (&mut meanwhile, &mut check);
        if !push_record(prod, r.len(), fill, waiter, deadline, sleeper, m, c)? {
            return Ok(false);
        }
    }
    Ok(true)
}

impl FrameTx for ShmTx {
    fn send(&mut self, f: &Frame, deadline: Option<Instant>) -> Result<bool, TransportError> {
        let (sh, bell) = (&self.sh, self.prod.bell());
        let check = || sh.check_peer();
        push_whole(
            &mut self.prod,
            f,
            &mut self.waiter,
            deadline,
            bell,
            || Ok(()),
            check,
        )
    }

    /// Waits for room and for answers at once: on the ring's room bell
    /// and on `rx`'s doorbell (`futex_waitv`), reading answers as they
    /// come. (The server takes a request only when the response ring has
    /// room for its answer.)
    fn send_reading(
        &mut self,
        f: &Frame,
        deadline: Option<Instant>,
        rx: &mut dyn FrameRx,
        got: &mut dyn FnMut(Frame),
    ) -> Result<bool, TransportError> {
        let Some(answers) = rx.bell() else {
            return self.send(f, deadline);
        };
        let bells = [self.prod.bell().0, answers];
        let sh = &self.sh;
        let (read, check) = (|| super::drain(rx, got), || sh.check_peer());
        let r = push_whole(
            &mut self.prod,
            f,
            &mut self.waiter,
            deadline,
            Bells(&bells),
            read,
            check,
        );
        if r.is_err() {
            // The server may have answered just before it went (see
            // `ShmRx::recv`): those answers still reach their callers.
            let _ = super::drain(rx, got);
        }
        r
    }

    fn room_needs_reader(&self) -> bool {
        true
    }
}

impl ShmRx {
    /// The frame of a record of `len` bytes taken as `head` and `rest`.
    fn decode(&mut self, head: &[u8; HEADER_LEN], len: usize) -> Result<Frame, TransportError> {
        let h = &head[..len.min(HEADER_LEN)];
        Ok(Frame::decode_record(h, &mut self.rest, &self.limits)?)
    }
}

impl ShmRx {
    /// The next record's frame, as [`FrameRx::recv`] (parts not joined).
    fn recv_record(&mut self, deadline: Option<Instant>) -> Result<Option<Frame>, TransportError> {
        let sh = &self.sh;
        let (cons, rest) = (&mut self.cons, &mut self.rest);
        let mut head = [0u8; HEADER_LEN];
        let got = match self.waiter.wait(
            Bell(self.bell),
            deadline,
            || cons.try_pop_split(&mut head, rest).transpose(),
            || sh.check_peer(),
        ) {
            Ok(got) => got,
            // The server closed its end or died, maybe just after the last
            // look at the ring and just before the answers it had sent are
            // read: those are still read, one per call, and the end is
            // reported once none is left. (Seeing it closed, by an Acquire
            // load of the channel's state, orders every record published
            // before the close before the look here.)
            Err(e) => match cons.try_pop_split(&mut head, rest)? {
                Some(len) => Some(Ok(len)),
                None => return Err(e),
            },
        };
        match got {
            None => Ok(None),
            Some(len) => Ok(Some(self.decode(&head, len?)?)),
        }
    }
}

impl FrameRx for ShmRx {
    /// The next frame; one that came in parts once its last part is here.
    fn recv(&mut self, deadline: Option<Instant>) -> Result<Option<Frame>, TransportError> {
        loop {
            let Some(f) = self.recv_record(deadline)? else {
                return Ok(None);
            };
            if f.kind != Kind::Part {
                self.joiner.passing();
                return Ok(Some(f));
            }
            if let Some(f) = self.joiner.part(&f)? {
                return Ok(Some(f));
            }
        }
    }

    fn try_recv(&mut self) -> Result<Option<Frame>, TransportError> {
        let mut head = [0u8; HEADER_LEN];
        loop {
            let Some(len) = self.cons.try_pop_split(&mut head, &mut self.rest)? else {
                return Ok(None);
            };
            let f = self.decode(&head, len)?;
            if f.kind != Kind::Part {
                self.joiner.passing();
                return Ok(Some(f));
            }
            if let Some(f) = self.joiner.part(&f)? {
                return Ok(Some(f));
            }
        }
    }

    fn bell(&self) -> Option<&'static AtomicU32> {
        Some(self.bell)
    }

    /// The server's end is gone only once nothing it sent is left to
    /// read (see `recv`).
    fn check_peer(&mut self) -> Result<(), TransportError> {
        match self.sh.check_peer() {
            Err(e) if !self.cons.has_record() => Err(e),
            _ => Ok(()),
        }
    }
}

/// One accepted connection at the server.
struct ServerConn {
    id: ConnId,
    ch: ChannelId,
    req: Consumer<'static, RawData>,
    resp: Producer<'static, RawData>,
    /// Requests taken but not answered yet: each holds room for one
    /// answer in `resp`: the largest answer, or a small one
    /// ([`SMALL_ANSWER`]).
    owed: usize,
    /// Call ids of the streams among them (room for the small answer
    /// that ends each).
    ends: Vec<u64>,
    /// Call ids of the unary calls among them taken with room for a small
    /// answer only (there was no room for the largest): a larger answer
    /// goes by Ref ([`Listener::answer_max`]).
    small: Vec<u64>,
    /// The highest call id of the requests taken, and the go-away word
    /// it is said in when the server stops.
    taken: u64,
    goaway: &'static AtomicU64,
    /// Requests read while the response ring had no room for their
    /// answers (not taken yet: handed out in order as room comes), and
    /// the cancels and grants of those, kept behind them. Reading on past
    /// them lets a running stream's grants and cancels through
    /// ([`crate::stream`]); at most sixteen rings' worth of bytes is held
    /// (`ShmListener::hold_max`), then the connection is not read.
    held: VecDeque<Frame>,
    held_bytes: usize,
    /// A request arriving in parts.
    joiner: Joiner,
    /// Call ids of the blocking streams taken and not yet answered: while
    /// one runs, the connection's other requests are held (its handler
    /// holds up the server, so their answers would keep room its items
    /// need: [`ShmListener::send_item`]). An async stream is let go at
    /// once ([`Listener::stream_beside`]).
    streams: Vec<u64>,
}

/// The most bytes of payload and metadata in a small answer: the end of
/// a stream (its error message, its trailer metadata), or the answer to a
/// call taken while its connection had no room for a larger one (a
/// larger payload goes by Ref: both ends share the pool). A server keeps
/// room in a connection's response ring for the answer to every request
/// it took, so that answers never wait for a client that does not read;
/// small answers let more calls run at once on one connection, and a
/// stream's items have the rest.
pub(crate) const SMALL_ANSWER: usize = 16 << 10;

/// The response-ring room kept per answer owed: record lengths.
#[derive(Debug, Clone, Copy)]
struct Room {
    /// The largest answer.
    answer: usize,
    /// A small answer.
    small: usize,
    /// Every unary answer gets room for the largest one, or the request
    /// waits: a server that sends every payload by value
    /// ([`ShmListener::whole_answers`]).
    whole: bool,
}

/// The room a request is taken with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// For the largest answer.
    Full,
    /// For a small answer.
    Small,
}

impl ServerConn {
    /// The response-ring bytes kept for the answers owed.
    #[inline]
    fn reserved(&self, room: Room) -> usize {
        let small = self.ends.len() + self.small.len();
        self.owed.saturating_sub(small) * room.answer + small * room.small
    }

    /// Before a push to the response ring: a lap started early there
    /// ([`Producer::keep_free`]) leaves the room kept for the answers owed.
    #[inline]
    fn keep_room(&mut self, room: Room) {
        let keep = self.reserved(room);
        self.resp.keep_free(keep);
    }

    /// The room a request (asking for a stream, or not) is taken with
    /// now, if any: no blocking stream runs, and the response ring has
    /// room for its answer besides those owed and a wrap's skip (and,
    /// while streams run, for one of their items). A unary call gets room
    /// for the largest answer if it is the only call in progress (a
    /// caller's answers are then inline up to the threshold, whatever its
    /// client has yet to free of the ring), or if that leaves room for
    /// another such; else room for a small one (so on a 256 KiB ring
    /// with the default 64 KiB threshold, eight calls run at once, not
    /// two); a stream room for its small end.
    #[inline]
    fn room_for(&mut self, room: Room, stream: bool) -> Option<Kept> {
        if !self.streams.is_empty() {
            return None;
        }
        let mut base = self.reserved(room) + room.answer;
        if !self.ends.is_empty() {
            base += room.answer;
        }
        let another = if self.owed == 0 { 0 } else { room.answer };
        if !stream && self.resp.fits_bytes(base + room.answer + another) {
            return Some(Kept::Full);
        }
        if room.whole && !stream {
            // By value: never a small answer (it would go by Ref). An
            // empty ring takes any record up to half of it, so the only
            // call in progress is taken then; else it waits for room.
            return (self.owed == 0 && self.resp.is_empty()).then_some(Kept::Full);
        }
        self.resp
            .fits_bytes(base + room.small)
            .then_some(Kept::Small)
    }

    /// Whether a frame of `len` bytes that answers nothing fits in the
    /// response ring beside the answers owed (and a wrap's skip).
    #[inline]
    fn item_fits(&mut self, room: Room, len: usize) -> bool {
        let rec = record_len(len);
        self.resp
            .fits_bytes(self.reserved(room) + rec + rec.max(room.answer))
    }

    /// Moves the grants and cancels of request `id`, taken from the held
    /// frames, to their front: they go next. (Held behind it, they may be
    /// behind later requests too, which wait while its stream runs: the
    /// stream would wait for its grant forever.)
    fn lift_held(&mut self, id: u64) {
        if !self.held.iter().any(|h| h.call_id == id) {
            return;
        }
        let (mut mine, rest): (VecDeque<Frame>, VecDeque<Frame>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|h| h.call_id == id);
        mine.extend(rest);
        self.held = mine;
    }

    /// Takes request `f` with room `kept`: its answer is owed.
    #[inline]
    fn took(&mut self, f: &Frame, kept: Kept) {
        self.owed += 1;
        self.taken = self.taken.max(f.call_id);
        if f.flags & FLAG_STREAM != 0 {
            self.streams.push(f.call_id);
            self.ends.push(f.call_id);
        } else if kept == Kept::Small {
            self.small.push(f.call_id);
        }
    }

    /// Answer `id` is sent: its room is free.
    #[inline]
    fn answered(&mut self, id: u64) {
        self.owed = self.owed.saturating_sub(1);
        if !self.ends.is_empty() {
            self.ends.retain(|&s| s != id);
            self.streams.retain(|&s| s != id);
        }
        if !self.small.is_empty() {
            self.small.retain(|&s| s != id);
        }
    }
}

/// What [`ShmListener::poll_conns`] found on a connection.
enum Found {
    /// A record, taken into the listener's buffers (to decode).
    Record(ConnId, usize),
    /// A frame held before, handed out now.
    Held(ConnId, Frame),
}

/// The server's end: every channel opened to one registered service.
pub struct ShmListener {
    svc: ServiceInfo,
    words: &'static [AtomicU32],
    conns: Vec<ServerConn>,
    rr: usize,
    next_id: ConnId,
    epoch: u32,
    /// The clients' close count as of the last sweep.
    close_epoch: u32,
    waiter: Waiter,
    reply_waiter: Waiter,
    stop: Arc<AtomicBool>,
    limits: Limits,
    room: Room,
    /// The most bytes of payload and metadata of the largest answer and
    /// of a small one.
    answer_max: (usize, usize),
    /// Most bytes of frames held for one connection: sixteen rings' worth
    /// (beyond, the connection is not read until its held requests go).
    hold_max: usize,
    /// The record just taken: its header bytes, its length and the rest.
    head: [u8; HEADER_LEN],
    rec_len: usize,
    rest: Vec<u8>,
    last_sweep: Instant,
    polls: u32,
    /// Set by the waker: `next` returns even without a frame.
    poked: Arc<AtomicBool>,
    /// Connections on which `send_item` found no room, and the length of
    /// the item: `next` returns once one has room (or is gone).
    want_room: Vec<(ConnId, usize)>,
    /// Async clients' answers this listener reads while it waits
    /// ([`Watched`]), their copy as of `watch_version`, and the bells it
    /// parks on: the server's doorbell first, then each watched one's.
    watch: Arc<WatchSet>,
    watched: Vec<Arc<dyn Watched>>,
    watch_version: u64,
    bells: Vec<&'static AtomicU32>,
    // Last: dropped after the rings that point into it.
    pool: Pool,
}

impl std::fmt::Debug for ShmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmListener")
            .field("service", &self.svc.name)
            .field("connections", &self.conns.len())
            .finish()
    }
}

impl ShmListener {
    /// Takes a request only when its connection has room for the largest
    /// answer (never room for a small one only, whose larger payload would
    /// go by Ref): for a server that sends every payload by value. Its
    /// calls run one at a time per connection when their answers are
    /// large.
    pub fn whole_answers(mut self) -> Self {
        self.room.whole = true;
        // (An answer longer than a record goes in parts.)
        self.answer_max.0 = self.answer_max.0.max(MAX_JOINED);
        self
    }

    /// Serves registration `svc` (made by this process, endpoint `Shm`).
    /// `reserve_inline` is the largest inline answer the server will send:
    /// a request is read only when its connection has room for such an
    /// answer, so replies never wait on a client that does not read.
    pub fn new(
        pool: &Pool,
        svc: ServiceInfo,
        policy: WaitPolicy,
        stop: Arc<AtomicBool>,
        reserve_inline: usize,
    ) -> Result<ShmListener, TransportError> {
        let words = service_words(pool, &svc)?;
        let max_inline = ring_max_inline(pool);
        Ok(ShmListener {
            svc,
            words,
            conns: Vec::new(),
            rr: 0,
            next_id: 1,
            epoch: words[CONN_EPOCH].load(Ordering::Acquire).wrapping_sub(1),
            close_epoch: words[CLOSE_EPOCH].load(Ordering::Acquire),
            waiter: policy.waiter(),
            reply_waiter: full_ring(policy).waiter(),
            stop,
            limits: Limits {
                max_payload: max_inline as u32,
                ..Limits::default()
            },
            room: Room {
                answer: record_len(HEADER_LEN + reserve_inline.min(max_inline)),
                small: record_len(HEADER_LEN + SMALL_ANSWER.min(max_inline)),
                whole: false,
            },
            answer_max: (reserve_inline.min(max_inline), SMALL_ANSWER.min(max_inline)),
            hold_max: 16 * pool.layout().ring_size as usize,
            head: [0; HEADER_LEN],
            rec_len: 0,
            rest: Vec::new(),
            last_sweep: Instant::now(),
            polls: 0,
            poked: Arc::new(AtomicBool::new(false)),
            want_room: Vec::new(),
            watch: Arc::default(),
            watched: Vec::new(),
            watch_version: 0,
            bells: vec![&words[SERVER_BELL]],
            pool: pool.clone(),
        })
    }

    /// Takes the watch set's changes: the sources and the bells.
    fn refresh_watched(&mut self) {
        let v = self.watch.version();
        if v == self.watch_version {
            return;
        }
        self.watch_version = v;
        self.watched = self.watch.snapshot();
        self.bells.truncate(1);
        self.bells.extend(self.watched.iter().map(|w| w.bell()));
    }

    /// Accepts channels opened since the last look.
    fn accept_new(&mut self) {
        let e = self.words[CONN_EPOCH].load(Ordering::Acquire);
        if e == self.epoch {
            return;
        }
        self.epoch = e;
        for ch in self.pool.pending_channels(&self.svc) {
            let Ok(m) = self.pool.channel_memory(ch) else {
                continue;
            };
            // SAFETY: `self.pool` outlives `self.conns` (field order).
            let p = unsafe { parts(&m) };
            let magic = p.magic.load(Ordering::Acquire);
            if magic == 0 {
                // Opened (zeroed) but not yet set up: the client writes
                // the magic, then moves the epoch, so it is looked at
                // again then. Another client's epoch brought us here
                // early; only a client that died first is refused.
                if self.pool.channel_peer(ch, Side::Server) != Peer::Live {
                    self.pool.close_channel(ch, Side::Server);
                }
                continue;
            }
            if magic != MAGIC || self.pool.accept_channel(ch).is_err() {
                // Another version of the protocol, or gone: refuse it.
                self.pool.close_channel(ch, Side::Server);
                continue;
            }
            self.conns.push(ServerConn {
                id: self.next_id,
                ch,
                req: Consumer::new(p.req, p.req_data),
                resp: Producer::new(p.resp, p.resp_data, p.client_bell)
                    .room_bell(&self.words[SERVER_BELL]),
                owed: 0,
                ends: Vec::new(),
                small: Vec::new(),
                taken: 0,
                goaway: p.goaway,
                held: VecDeque::new(),
                held_bytes: 0,
                joiner: Joiner::default(),
                streams: Vec::new(),
            });
            self.next_id += 1;
        }
    }

    /// Drops connections whose client closed or died.
    fn sweep(&mut self) {
        self.last_sweep = Instant::now();
        // (Read before the channels: a close after this read sweeps again.)
        self.close_epoch = self.words[CLOSE_EPOCH].load(Ordering::Acquire);
        let pool = &self.pool;
        self.conns.retain(|c| {
            let keep = pool.channel_peer(c.ch, Side::Server) == Peer::Live;
            if !keep {
                pool.close_channel(c.ch, Side::Server);
            }
            keep
        });
    }

    /// Decodes the record just taken from connection `i`. A client that
    /// sends garbage loses its connection; the others are not disturbed.
    /// A request is taken only if the response ring has room for its
    /// answer (besides those owed) and no request read before waits for
    /// room; else it is held (`None`), and so is a cancel of a held one.
    fn decode_for(&mut self, i: usize) -> Option<Frame> {
        let h = &self.head[..self.rec_len.min(HEADER_LEN)];
        let f = match Frame::decode_record(h, &mut self.rest, &self.limits) {
            Ok(f) if f.kind != Kind::Part => {
                self.conns[i].joiner.passing();
                f
            }
            Ok(p) => match self.conns[i].joiner.part(&p) {
                Ok(Some(f)) => f,
                // The request is not whole yet.
                Ok(None) => return None,
                Err(_) => {
                    self.drop_conn(i);
                    return None;
                }
            },
            Err(_) => {
                self.drop_conn(i);
                return None;
            }
        };
        let c = &mut self.conns[i];
        let (hold, kept) = match f.kind {
            Kind::Request if c.held.is_empty() => {
                match c.room_for(self.room, f.flags & FLAG_STREAM != 0) {
                    Some(kept) => (false, Some(kept)),
                    None => (true, None),
                }
            }
            Kind::Request => (true, None),
            // (A cancel, a grant or an item of its caller of a held
            // request stays behind it.)
            Kind::Cancel | Kind::Credit | Kind::Item => {
                (c.held.iter().any(|h| h.call_id == f.call_id), None)
            }
            _ => (false, None),
        };
        if hold {
            c.held_bytes += f.encoded_len();
            c.held.push_back(f);
            return None;
        }
        if let Some(kept) = kept {
            c.took(&f, kept);
        }
        Some(f)
    }

    /// Whether a connection that had no room for an item has room now (or
    /// is gone): then every such wish is forgotten (the dispatcher tries
    /// its items again, and says again what finds no room).
    fn room_came(&mut self) -> bool {
        let room = self.room;
        let came = self.want_room.iter().any(|&(conn, len)| {
            match self.conns.iter_mut().find(|c| c.id == conn) {
                Some(c) => c.item_fits(room, len),
                None => true,
            }
        });
        if came {
            self.want_room.clear();
        }
        came
    }

    /// The position of connection `conn` in `conns`.
    fn index(&self, conn: ConnId) -> Result<usize, TransportError> {
        self.conns
            .iter()
            .position(|c| c.id == conn)
            .ok_or_else(|| TransportError::Unavailable(format!("connection {conn} is gone")))
    }

    fn drop_conn(&mut self, k: usize) {
        let c = self.conns.swap_remove(k);
        self.pool.close_channel(c.ch, Side::Server);
    }

    /// Looks at each connection once, starting after the last served one:
    /// a held frame whose turn came, or the next record. (The room for a
    /// request's answer is checked once it is decoded: `decode_for`.)
    fn poll_conns(&mut self) -> Option<Result<Found, usize>> {
        let n = self.conns.len();
        // Round robin from `rr` (no division: this runs on every spin of
        // a waiting server).
        let start = if self.rr < n { self.rr } else { 0 };
        for k in 0..n {
            let i = if start + k < n {
                start + k
            } else {
                start + k - n
            };
            let c = &mut self.conns[i];
            if let Some(f) = c.held.front() {
                let kept = match f.kind {
                    Kind::Request => c.room_for(self.room, f.flags & FLAG_STREAM != 0),
                    _ => Some(Kept::Full),
                };
                if let Some(kept) = kept {
                    let f = c.held.pop_front()?;
                    c.held_bytes -= f.encoded_len();
                    if f.kind == Kind::Request {
                        c.took(&f, kept);
                        c.lift_held(f.call_id);
                    }
                    self.rr = i + 1;
                    return Some(Ok(Found::Held(c.id, f)));
                }
                if c.held_bytes >= self.hold_max {
                    continue;
                }
            }
            if !c.req.ready() {
                continue;
            }
            self.rr = i + 1;
            return Some(match c.req.try_pop_split(&mut self.head, &mut self.rest) {
                Ok(Some(len)) => {
                    self.rec_len = len;
                    Ok(Found::Record(c.id, i))
                }
                Ok(None) => continue,
                Err(_) => Err(i),
            });
        }
        None
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        // Clients whose answers this listener read get a reader of their own.
        self.watch.close();
        for c in self.conns.drain(..) {
            self.pool.close_channel(c.ch, Side::Server);
        }
    }
}

impl Listener for ShmListener {
    fn next(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(ConnId, Frame)>, TransportError> {
        loop {
            self.polls = self.polls.wrapping_add(1);
            if self.polls.is_multiple_of(4096)
                && self.last_sweep.elapsed() > Duration::from_millis(100)
            {
                self.sweep();
            }
            self.accept_new();
            self.refresh_watched();
            let bells = std::mem::take(&mut self.bells);
            let watched = std::mem::take(&mut self.watched);
            let mut waiter = self.waiter.clone();
            let words = self.words;
            // Set between park slices (and about every millisecond while
            // spinning or yielding): drop connections whose clients are
            // gone, from inside the wait.
            let sweep_due = std::cell::Cell::new(false);
            // A watched client failed its calls when checked, or is gone.
            let (delivered, gone) = (std::cell::Cell::new(false), std::cell::Cell::new(false));
            let got = waiter.wait(
                Bells(&bells),
                deadline,
                || {
                    if self.stop.load(Ordering::Acquire)
                        || (self.poked.load(Ordering::Relaxed)
                            && self.poked.swap(false, Ordering::AcqRel))
                        || delivered.take()
                    {
                        return Some(None);
                    }
                    if sweep_due.take()
                        || words[CLOSE_EPOCH].load(Ordering::Relaxed) != self.close_epoch
                    {
                        self.sweep();
                    }
                    if !self.want_room.is_empty() && self.room_came() {
                        return Some(None);
                    }
                    if words[CONN_EPOCH].load(Ordering::Relaxed) != self.epoch {
                        self.accept_new();
                    }
                    if let Some(x) = self.poll_conns() {
                        return Some(Some(x));
                    }
                    // Answers to the async handlers' calls: the tasks they
                    // wake are polled as soon as this returns.
                    let mut any = false;
                    for w in &watched {
                        match w.look() {
                            Looked::Idle => {}
                            Looked::Delivered => any = true,
                            Looked::Gone => gone.set(true),
                        }
                    }
                    any.then_some(None)
                },
                || {
                    sweep_due.set(true);
                    for w in &watched {
                        match w.check() {
                            Looked::Idle => {}
                            Looked::Delivered => delivered.set(true),
                            Looked::Gone => gone.set(true),
                        }
                    }
                    Ok::<(), TransportError>(())
                },
            );
            self.bells = bells;
            self.watched = watched;
            if gone.get() {
                self.watch.remove_gone();
            }
            let got = got?;
            self.waiter = waiter;
            let (id, i) = match got {
                None | Some(None) => return Ok(None),
                Some(Some(Err(i))) => {
                    self.drop_conn(i);
                    continue;
                }
                Some(Some(Ok(Found::Held(id, f)))) => return Ok(Some((id, f))),
                Some(Some(Ok(Found::Record(id, i)))) => (id, i),
            };
            if let Some(f) = self.decode_for(i) {
                return Ok(Some((id, f)));
            }
        }
    }

    fn poll(&mut self) -> Result<Option<(ConnId, Frame)>, TransportError> {
        loop {
            let (id, i) = match self.poll_conns() {
                None => return Ok(None),
                Some(Err(i)) => {
                    self.drop_conn(i);
                    continue;
                }
                Some(Ok(Found::Held(id, f))) => return Ok(Some((id, f))),
                Some(Ok(Found::Record(id, i))) => (id, i),
            };
            match self.decode_for(i) {
                Some(f) => return Ok(Some((id, f))),
                None => continue,
            }
        }
    }

    fn reply(&mut self, conn: ConnId, f: &Frame) -> Result<(), TransportError> {
        let k = self.index(conn)?;
        let c = &mut self.conns[k];
        c.answered(f.call_id);
        c.keep_room(self.room);
        let (pool, ch) = (&self.pool, c.ch);
        let bell = self.conns[k].resp.bell();
        let r = push_whole(
            &mut self.conns[k].resp,
            f,
            &mut self.reply_waiter,
            None,
            bell,
            || Ok(()),
            || match pool.channel_peer(ch, Side::Server) {
                Peer::Live => Ok(()),
                _ => Err(TransportError::Unavailable("client gone".into())),
            },
        );
        if r.is_err() {
            self.drop_conn(k);
        }
        r.map(|_| ())
    }

    /// Pushes the item only if the response ring keeps room for the
    /// answers owed besides (one record of the largest answer each); never
    /// waits.
    fn send_item(&mut self, conn: ConnId, f: &Frame) -> Result<bool, TransportError> {
        let k = self.index(conn)?;
        let len = f.encoded_len();
        let c = &mut self.conns[k];
        if !c.item_fits(self.room, len) {
            if self.pool.channel_peer(c.ch, Side::Server) != Peer::Live {
                self.drop_conn(k);
                return Err(TransportError::Unavailable("client gone".into()));
            }
            if !self.want_room.contains(&(conn, len)) {
                self.want_room.push((conn, len));
            }
            return Ok(false);
        }
        c.keep_room(self.room);
        // (It rings the client's doorbell.)
        Ok(c.resp.try_push(len, |put| f.encode_with(put))?)
    }

    /// Waits on the server's doorbell, which a client rings when it frees
    /// room in its response ring (and when it sends).
    fn wait_room(&mut self, conn: ConnId, len: usize, until: Instant) {
        let Ok(k) = self.index(conn) else {
            return;
        };
        let (room, words) = (self.room, self.words);
        let c = &mut self.conns[k];
        let _ = self.reply_waiter.wait(
            Bell(&words[SERVER_BELL]),
            Some(until),
            || (c.item_fits(room, len) || c.req.ready()).then_some(()),
            || Ok::<(), TransportError>(()),
        );
    }

    fn wakes_for_room(&self) -> bool {
        true
    }

    fn answer_max(&self, conn: ConnId, id: u64) -> Option<usize> {
        let (full, small) = self.answer_max;
        let c = self.conns.iter().find(|c| c.id == conn)?;
        let is_small = |ids: &Vec<u64>| !ids.is_empty() && ids.contains(&id);
        Some(if is_small(&c.ends) || is_small(&c.small) {
            small
        } else {
            full
        })
    }

    fn stream_beside(&mut self, conn: ConnId, id: u64) {
        if let Ok(k) = self.index(conn) {
            self.conns[k].streams.retain(|&s| s != id);
        }
    }

    fn holding(&self) -> bool {
        self.conns.iter().any(|c| !c.held.is_empty())
    }

    fn is_open(&self, conn: ConnId) -> bool {
        self.conns.iter().any(|c| c.id == conn)
    }

    fn max_inline(&self) -> usize {
        ring_max_inline(&self.pool)
    }

    fn connections(&self) -> usize {
        self.conns.len()
    }

    fn watch_set(&self) -> Option<Arc<WatchSet>> {
        Some(self.watch.clone())
    }

    /// Writes each connection's go-away word; the channels close when the
    /// listener is dropped, right after. Channels opened since the last
    /// look are accepted first, so that their clients learn that nothing
    /// was taken.
    fn go_away(&mut self) {
        // (Unregistered before: see the fence in `connect`.)
        fence(Ordering::SeqCst);
        self.accept_new();
        for c in &mut self.conns {
            c.keep_room(self.room);
            // Held requests were never taken: refused where there is room
            // (one taken after them, of a higher id, would hide them from
            // the go-away word).
            for f in std::mem::take(&mut c.held) {
                if f.kind == Kind::Request {
                    let no = Frame::refused(f.call_id, "the service is shutting down");
                    let _ = c.resp.try_push(no.encoded_len(), |put| no.encode_with(put));
                }
            }
            super::goaway::say(c.goaway, c.taken);
        }
    }

    fn waker(&self) -> Waker {
        let (pool, words, poked) = (self.pool.clone(), self.words, self.poked.clone());
        Waker(Arc::new(move || {
            let _keep = &pool;
            poked.store(true, Ordering::Release);
            Bell(&words[SERVER_BELL]).ring();
        }))
    }
}

/// A client connection that writes raw records into the request ring: for
/// conformance tests and fuzzing of the server's side (malformed frames,
/// broken cursors). Closes its end on drop.
pub struct RawConnection {
    prod: Producer<'static, RawData>,
    data: RawData,
    sh: Arc<ClientShared>,
}

impl std::fmt::Debug for RawConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawConnection")
            .field("channel", &self.sh.ch)
            .finish()
    }
}

impl RawConnection {
    /// Opens a channel to `svc` as a client would.
    pub fn open(pool: &Pool, svc: &ServiceInfo) -> Result<RawConnection, TransportError> {
        let (sh, p, words) = open_client(pool, svc)?;
        words[CONN_EPOCH].fetch_add(1, Ordering::AcqRel);
        Ok(RawConnection {
            prod: Producer::new(p.req, p.req_data, &words[SERVER_BELL]),
            data: p.req_data,
            sh,
        })
    }

    /// Publishes `bytes` as one ring record (not necessarily a frame).
    /// `false` if the ring is full.
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        self.prod
            .try_push(bytes.len(), |put| put(bytes))
            .unwrap_or(false)
    }

    /// Publishes a record header claiming `len` bytes at the next record's
    /// place, with no regard for the ring's size.
    pub fn scribble_header(&self, len: u32) {
        use ring::RingData;
        let pos = self.prod.position();
        let size = self.data.size();
        self.data
            .store_word(pos as usize & (size - 1), ring::header(len, pos, size));
        if let Ok(w) = service_words(&self.sh.pool, &self.sh.svc) {
            Bell(&w[SERVER_BELL]).ring();
        }
    }

    /// Whether the server has closed this connection.
    pub fn closed_by_server(&self) -> bool {
        self.sh.check_peer().is_err()
    }
}
