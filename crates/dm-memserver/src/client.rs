//! The memory-server client: one or several servers as one pool, behind
//! the same DM contract ([`dm_pool::Dm`]) as the shared pool.
//!
//! Each server gets one TCP connection. Callers read answers themselves
//! (one at a time leads and hands the others their answers by id), so any
//! number of requests are in flight at once (pipelining: a large read or
//! write is cut into chunks sent back to back) and a lone caller pays no
//! thread hand-off. Allocations and puts go to a server on this host
//! where there is one, else to the servers round robin ([`Placement`]);
//! a Ref names its server (by id), and any client connected to that
//! server can map it. A keep-alive thread pings each server well within
//! the session's lease. A server that dies or drops the connection turns
//! every pending and later request on it into `Unavailable`, never a hang
//! (requests also time out).

use crate::cache::{key_of, CacheStats, PageCache, RefKey};
use crate::proto::{self, Request, MAX_FRAME, MAX_IO};
use dm_pool::auth::Key;
use dm_pool::{Dm, DmBuffer, Error, Ref, Result, Usage, BACKEND_MEMSERVER};
use dm_sys::poll::Spin;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// Bytes per write request when a large write is cut into pipelined chunks.
pub const WRITE_CHUNK: usize = 1 << 20;
/// Bytes per read request, likewise.
pub const READ_CHUNK: usize = 4 << 20;
/// Bytes per read request of a Ref, likewise. Smaller: a Ref whose
/// bytes are still arriving (`stream_put`) answers each request once its
/// range has arrived, so the first bytes come back while the last are
/// still on their way to the server.
pub const REF_READ_CHUNK: usize = 256 << 10;

/// How a client connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The session lease the servers enforce (pings go every third of it).
    pub lease: Duration,
    /// A request without an answer after this fails with `Unavailable`.
    pub timeout: Duration,
    /// Time to connect to each server.
    pub connect_timeout: Duration,
    /// Bytes of the cache of immutable pages read through mapped Refs
    /// (0: no cache).
    pub cache_bytes: u64,
    /// Longest busy-poll of the socket before a caller blocks reading its
    /// answer (adapted per connection: [`dm_sys::poll::Spin`]; zero: block
    /// at once). A blocked reader's wake-up costs more than a loopback
    /// round trip on the test machine (BENCHMARKS.md, `bench memserver`).
    pub spin: Duration,
    /// The servers' client key (the file their `--key-file` names). With
    /// it, a client proves it holds the key and refuses a server that
    /// does not prove the same.
    pub key: Option<Key>,
    /// The servers' admin key, for `check` and `maintain` from another
    /// host. It admits as a client too.
    pub admin_key: Option<Key>,
    /// Which server a new buffer or put goes to.
    pub placement: Placement,
}

/// Which of its servers a client's new buffers and puts go to. A Ref is
/// read where it was placed, so placement decides which links its bytes
/// cross.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// The servers on this host, in turn; every server in turn when none
    /// is. The writer's bytes then stay on its host, and cross the
    /// network once: to whoever reads the Ref. A server is on this host
    /// when its address is a loopback address or the connection's own
    /// (the kernel gives a connection to one of the host's addresses that
    /// address as its source).
    #[default]
    Local,
    /// Every server in turn, wherever it is.
    RoundRobin,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            lease: Duration::from_secs(10),
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            cache_bytes: 32 << 20,
            spin: Duration::from_micros(200),
            key: None,
            admin_key: None,
            placement: Placement::Local,
        }
    }
}

type Answer = Result<Vec<u8>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long the reading caller blocks in one read before it looks at its
/// deadline again.
const READ_SLICE: Duration = Duration::from_millis(100);

/// One server's connection. There is no reader thread: the caller that
/// finds nobody reading becomes the reader (the leader), reads answers
/// until its own arrives, and hands the others to their callers (the
/// followers, waiting on the condition variable), so a lone caller gets
/// its answer without a thread hand-off.
#[derive(Debug)]
struct Conn {
    addr: String,
    /// The server runs on this host ([`Placement::Local`]).
    local: bool,
    server_id: u64,
    page_size: u32,
    max_len: u64,
    out: Mutex<TcpStream>,
    rx: Mutex<Rx>,
    state: Mutex<Pending>,
    cv: Condvar,
    next_id: AtomicU64,
    /// The server takes `stream_put` (until it answers that it does not:
    /// then `put`).
    streams: AtomicBool,
    /// Requests whose answers nobody waits for (releases), sent ahead of
    /// the next request, or by the keep-alive thread within half a
    /// second, or at once when [`LATER_MAX`] bytes wait.
    later: Mutex<Vec<u8>>,
}

/// Bytes of requests kept for later before they go at once (about a
/// hundred releases).
const LATER_MAX: usize = 8 << 10;

#[derive(Debug, Default)]
struct Pending {
    /// Ids of requests whose callers wait.
    waiting: HashSet<u64>,
    /// Answers read by a leader for their callers.
    answers: HashMap<u64, Answer>,
    /// Someone is reading.
    leader: bool,
    /// Callers asleep on the condition variable. A notification is a
    /// system call even with nobody asleep, and the lone caller of the
    /// common case needs none.
    sleepers: usize,
    /// Why the connection is gone, once it is.
    dead: Option<String>,
}

/// The read side: bytes received and not yet consumed as frames, in
/// `buf[start..end]` (the buffer is zeroed once, when it grows).
#[derive(Debug)]
struct Rx {
    s: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The busy-poll before a blocking read.
    spin: Spin,
    /// Why the stream broke in the middle of a body received in place.
    broken: Option<String>,
}

/// Bytes before an answer's body: the length prefix and the header.
const ANSWER_HEAD: usize = 4 + proto::HEADER;

/// Answers at least this long are received straight into the caller's
/// buffer when the caller reads them itself. Below it the extra read of
/// the header costs more than the copy it saves.
const IN_PLACE_MIN: usize = 16 << 10;

/// What [`Rx::frame_with`] found.
enum Next<T> {
    /// A whole frame, handed to the callback.
    Frame(T),
    /// The head of the success answer awaited in place, its body still
    /// arriving.
    Arriving,
}

/// An answer as a caller waiting for it gets it.
enum Got<'a> {
    /// Decoded, where it lies.
    Frame(Result<&'a [u8]>),
    /// A success answer whose body is still arriving: exactly the length
    /// the caller asked to receive in place.
    Arriving(Arriving<'a>),
}

/// The rest of an answer's body, to be received into a caller's buffer.
struct Arriving<'a> {
    rx: &'a mut Rx,
    deadline: Instant,
}

impl Got<'_> {
    /// The answer's body, owned.
    fn into_vec(self) -> Result<Vec<u8>> {
        match self {
            Got::Frame(a) => a.map(<[u8]>::to_vec),
            Got::Arriving(a) => {
                let mut v = vec![0u8; a.len()];
                a.receive(&mut v)?;
                Ok(v)
            }
        }
    }

    /// Puts the answer's body into `out`, which it must fill exactly.
    fn fill(self, out: &mut [u8]) -> Result<()> {
        match self {
            Got::Frame(a) => {
                let b = a?;
                if b.len() != out.len() {
                    return Err(Error::Protocol(format!(
                        "a read of {} bytes answered {}",
                        out.len(),
                        b.len()
                    )));
                }
                out.copy_from_slice(b);
                Ok(())
            }
            Got::Arriving(a) if a.len() == out.len() => a.receive(out),
            Got::Arriving(a) => Err(Error::Protocol(format!(
                "a read of {} bytes answered {}",
                out.len(),
                a.len()
            ))),
        }
    }
}

impl Arriving<'_> {
    /// The body's length.
    fn len(&self) -> usize {
        let h = &self.rx.buf[self.rx.start..self.rx.start + 4];
        u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize - proto::HEADER
    }

    /// Receives the body into `out` (of its length): the part already
    /// buffered is copied, the rest read from the socket straight into
    /// `out`. A stream that breaks or stalls past the deadline midway is
    /// recorded in `rx.broken`: the connection cannot go on.
    fn receive(self, out: &mut [u8]) -> Result<()> {
        let rx = self.rx;
        let body = &rx.buf[rx.start + ANSWER_HEAD..rx.end];
        let mut at = body.len();
        out[..at].copy_from_slice(body);
        (rx.start, rx.end) = (0, 0);
        while at < out.len() {
            let s = &mut rx.s;
            let r = rx.spin.read(s.as_raw_fd(), &mut out[at..], |to| s.read(to));
            let why = match r {
                Ok(0) => "connection closed by the server".to_owned(),
                Ok(k) => {
                    at += k;
                    continue;
                }
                Err(e) if no_bytes_yet(&e) && Instant::now() < self.deadline => continue,
                Err(e) if no_bytes_yet(&e) => "an answer stopped midway".to_owned(),
                Err(e) => format!("connection lost ({e})"),
            };
            rx.broken = Some(why.clone());
            return Err(Error::Unavailable(why));
        }
        Ok(())
    }
}

/// Whether a read failed only for want of bytes within its slice.
fn no_bytes_yet(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

impl Rx {
    /// The next answer frame, handed to `f` as its id and its body where
    /// it lies in the receive buffer (no copy): `Ok(None)` if none arrived
    /// within a read slice (partial bytes are kept), an error if the
    /// connection broke. With `in_place` (an id and a body length), the
    /// head of that success answer with that body length is reported as
    /// [`Next::Arriving`] as soon as it is here, unless the whole frame is.
    fn frame_with<T>(
        &mut self,
        in_place: Option<(u64, usize)>,
        f: impl FnOnce(u64, Result<&[u8]>) -> T,
    ) -> std::result::Result<Option<Next<T>>, String> {
        loop {
            let have = &self.buf[self.start..self.end];
            let mut need = 4;
            if have.len() >= 4 {
                let n = u32::from_le_bytes([have[0], have[1], have[2], have[3]]) as usize;
                if n > MAX_FRAME {
                    return Err(format!("answer of {n} bytes exceeds the maximum"));
                }
                need = 4 + n;
                if have.len() >= need {
                    let (id, a) = proto::decode_answer(&have[4..need])
                        .map_err(|e| format!("malformed answer: {e}"))?;
                    let t = f(id, a);
                    self.start += need;
                    if self.start == self.end {
                        (self.start, self.end) = (0, 0);
                    }
                    return Ok(Some(Next::Frame(t)));
                }
                if let Some((want, len)) = in_place {
                    if have.len() >= ANSWER_HEAD {
                        let head = have[4..ANSWER_HEAD]
                            .try_into()
                            .unwrap_or([0; proto::HEADER]);
                        if n == proto::HEADER + len && proto::success_id(&head) == Some(want) {
                            return Ok(Some(Next::Arriving));
                        }
                    }
                }
            }
            // The answer awaited in place: read only up to its head, so that
            // its body lands in the caller's buffer.
            let head_only =
                in_place.is_some_and(|(_, len)| len >= IN_PLACE_MIN) && have.len() < ANSWER_HEAD;
            // Room for the rest of this frame and a good read.
            if self.buf.len() - self.start < need.max(64 << 10) {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
                if self.buf.len() < need.max(64 << 10) {
                    self.buf.resize(need.max(256 << 10), 0);
                }
            }
            let to = if head_only {
                self.start + ANSWER_HEAD
            } else {
                self.buf.len()
            };
            let s = &mut self.s;
            let r = self
                .spin
                .read(s.as_raw_fd(), &mut self.buf[self.end..to], |to| s.read(to));
            match r {
                Ok(0) => return Err("connection closed by the server".into()),
                Ok(k) => self.end += k,
                Err(e) if no_bytes_yet(&e) => return Ok(None),
                Err(e) => return Err(format!("connection lost ({e})")),
            }
        }
    }
}

impl Conn {
    fn open(addr: &str, cfg: &ClientConfig) -> Result<Conn> {
        let unavailable = |e: std::io::Error| Error::Unavailable(format!("{addr}: {e}"));
        let sa = addr
            .to_socket_addrs()
            .map_err(unavailable)?
            .next()
            .ok_or_else(|| Error::Unavailable(format!("{addr}: no address")))?;
        let s = TcpStream::connect_timeout(&sa, cfg.connect_timeout).map_err(unavailable)?;
        s.set_nodelay(true).map_err(unavailable)?;
        let rd = s.try_clone().map_err(unavailable)?;
        rd.set_read_timeout(Some(READ_SLICE)).map_err(unavailable)?;
        let local = match (s.local_addr(), s.peer_addr()) {
            (Ok(me), Ok(it)) => it.ip().is_loopback() || me.ip() == it.ip(),
            _ => false,
        };
        let mut c = Conn {
            addr: addr.to_owned(),
            local,
            server_id: 0,
            page_size: 0,
            max_len: 0,
            out: Mutex::new(s),
            rx: Mutex::new(Rx {
                s: rd,
                buf: vec![0u8; 256 << 10],
                start: 0,
                end: 0,
                spin: Spin::new(cfg.spin),
                broken: None,
            }),
            state: Mutex::new(Pending::default()),
            cv: Condvar::new(),
            next_id: AtomicU64::new(1),
            streams: AtomicBool::new(true),
            later: Mutex::new(Vec::new()),
        };
        let lease_ms = cfg.lease.as_millis().min(u32::MAX as u128) as u32;
        // A client with a key challenges the server; one without sends the
        // hello servers before authentication understood.
        let nonce = (cfg.key.is_some() || cfg.admin_key.is_some()).then(dm_pool::auth::nonce);
        let body = c.call(&Request::Hello { lease_ms, nonce }, cfg.timeout)?;
        let h = proto::HelloAnswer::decode(&body).map_err(|e| Error::Protocol(e.to_string()))?;
        c.server_id = h.server_id;
        c.page_size = h.page_size;
        c.max_len = h.max_len;
        if let Some(cn) = nonce {
            c.authenticate(cfg, &cn, h.auth)?;
        }
        Ok(c)
    }

    /// Checks the server's proof of the key this client holds, then
    /// proves this client's keys.
    fn authenticate(
        &self,
        cfg: &ClientConfig,
        cn: &[u8; 16],
        offer: Option<proto::AuthOffer>,
    ) -> Result<()> {
        let addr = &self.addr;
        let Some(o) = offer else {
            return Err(Error::Unauthenticated(format!(
                "memory server {addr} does not authenticate itself (it is older than keys): \
                 connect to it without a key"
            )));
        };
        let ctx = proto::AUTH_CONTEXT;
        let server_holds = |k: &Option<Key>, role, proof: &[u8]| {
            k.as_ref()
                .is_some_and(|k| k.verify(ctx, role, cn, &o.nonce, proof))
        };
        if !server_holds(&cfg.key, b'S', &o.proof)
            && !server_holds(&cfg.admin_key, b'T', &o.admin_proof)
        {
            return Err(Error::Unauthenticated(format!(
                "memory server {addr} did not prove it holds this client's key: it is not the \
                 server meant, or it was started with another key file (or none)"
            )));
        }
        let mut roles = Vec::new();
        if let Some(k) = cfg
            .key
            .as_ref()
            .filter(|_| o.flags & proto::AUTH_NEEDS_KEY != 0)
        {
            roles.push((proto::ROLE_CLIENT, k.proof(ctx, b'C', cn, &o.nonce)));
        }
        if let Some(k) = cfg
            .admin_key
            .as_ref()
            .filter(|_| o.flags & proto::AUTH_HAS_ADMIN != 0)
        {
            roles.push((proto::ROLE_ADMIN, k.proof(ctx, b'A', cn, &o.nonce)));
        }
        for (role, proof) in roles {
            self.call(&Request::Auth { role, proof }, cfg.timeout)?;
        }
        Ok(())
    }

    /// Queues a request whose answer nobody waits for, to go ahead of
    /// the next one (see `later`).
    fn send_later(&self, req: &Request) -> Result<()> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut l = lock(&self.later);
        req.encode(id, &mut l);
        if l.len() < LATER_MAX {
            return Ok(());
        }
        let b = std::mem::take(&mut *l);
        drop(l);
        lock(&self.out)
            .write_all(&b)
            .map_err(|e| self.unavailable(&e.to_string()))
    }

    /// Sends what waits for later, with `more` after it.
    fn flush_later(&self, more: &[u8]) -> std::io::Result<()> {
        let mut b = std::mem::take(&mut *lock(&self.later));
        b.extend_from_slice(more);
        if b.is_empty() {
            return Ok(());
        }
        lock(&self.out).write_all(&b)
    }

    fn unavailable(&self, why: &str) -> Error {
        Error::Unavailable(format!("{}: {why}", self.addr))
    }

    /// Sends `reqs` back to back and waits for all their answers.
    fn call_many(&self, reqs: &[Request], timeout: Duration) -> Vec<Answer> {
        let ids = match self.send_many(reqs) {
            Ok(ids) => ids,
            Err(why) => return reqs.iter().map(|_| Err(self.unavailable(&why))).collect(),
        };
        let deadline = Instant::now() + timeout;
        ids.into_iter()
            .map(|id| self.wait_with(id, deadline, 0, |g| g.into_vec()))
            .collect()
    }

    /// Sends reads `reqs` back to back and receives each answer into its
    /// part of `outs` (one per request, of the length it reads): from the
    /// socket straight into it when this caller reads the answer itself
    /// (the usual case: an answer another caller read comes through a
    /// vector).
    fn read_into(&self, reqs: &[Request], outs: Vec<&mut [u8]>, timeout: Duration) -> Result<()> {
        debug_assert_eq!(reqs.len(), outs.len(), "one buffer per read");
        let ids = self.send_many(reqs).map_err(|why| self.unavailable(&why))?;
        let deadline = Instant::now() + timeout;
        let mut first = None;
        // Every answer is waited for, even after an error.
        for (id, out) in ids.into_iter().zip(outs) {
            let r = self.wait_with(id, deadline, out.len(), |g| g.fill(out));
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Sends `reqs` back to back; their ids, registered as waited for (or
    /// why the connection is unusable).
    fn send_many(&self, reqs: &[Request]) -> std::result::Result<Vec<u64>, String> {
        // The requests' heads in one buffer, each followed on the wire by
        // its data (of a write or put), written where it lies.
        let mut heads = Vec::new();
        let mut parts: Vec<(usize, &[u8])> = Vec::with_capacity(reqs.len());
        let mut ids = Vec::with_capacity(reqs.len());
        {
            let mut st = lock(&self.state);
            if let Some(why) = &st.dead {
                return Err(why.clone());
            }
            for r in reqs {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                st.waiting.insert(id);
                ids.push(id);
                let data = r.encode_head(id, &mut heads);
                parts.push((heads.len(), data));
            }
        }
        // Releases kept for later go first, in the same write.
        let later = std::mem::take(&mut *lock(&self.later));
        let mut slices = Vec::with_capacity(2 * parts.len() + 1);
        if !later.is_empty() {
            slices.push(std::io::IoSlice::new(&later));
        }
        let mut from = 0;
        for (end, data) in &parts {
            slices.push(std::io::IoSlice::new(&heads[from..*end]));
            if !data.is_empty() {
                slices.push(std::io::IoSlice::new(data));
            }
            from = *end;
        }
        if let Err(e) = dm_sys::io::write_all_vectored(&mut *lock(&self.out), &mut slices) {
            let mut st = lock(&self.state);
            for id in &ids {
                st.waiting.remove(id);
            }
            return Err(e.to_string());
        }
        Ok(ids)
    }

    /// Waits for the answer to `id`, reading as the leader when nobody is,
    /// and hands it to `take` (from the receive buffer when this caller
    /// reads it, else from the vector the reader left). A success answer
    /// with a body of `in_place` bytes (non-zero) may be handed over as
    /// [`Got::Arriving`], to be received where `take` puts it.
    fn wait_with<T>(
        &self,
        id: u64,
        deadline: Instant,
        in_place: usize,
        mut take: impl FnMut(Got<'_>) -> Result<T>,
    ) -> Result<T> {
        let mut st = lock(&self.state);
        loop {
            if let Some(a) = st.answers.remove(&id) {
                st.waiting.remove(&id);
                drop(st);
                return match a {
                    Ok(v) => take(Got::Frame(Ok(&v))),
                    Err(e) => take(Got::Frame(Err(e))),
                };
            }
            if let Some(why) = &st.dead {
                let e = self.unavailable(why);
                st.waiting.remove(&id);
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                st.waiting.remove(&id);
                return Err(self.unavailable("no answer in time"));
            }
            if st.leader {
                st.sleepers += 1;
                st = self
                    .cv
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                st.sleepers -= 1;
                continue;
            }
            // Lead: read until our answer comes (or the connection breaks).
            st.leader = true;
            drop(st);
            let got = self.lead(id, deadline, in_place, &mut take);
            st = lock(&self.state);
            st.leader = false;
            match got {
                Ok(Some(a)) => {
                    st.waiting.remove(&id);
                    // Another caller leads now.
                    self.wake(&st);
                    return a;
                }
                Ok(None) => {}
                Err(why) => st.dead = Some(why),
            }
            self.wake(&st);
        }
    }

    /// Wakes the callers asleep on the condition variable, if any
    /// (called with the state locked, so none can fall asleep unseen).
    fn wake(&self, st: &Pending) {
        if st.sleepers > 0 {
            self.cv.notify_all();
        }
    }

    /// Reads answers, handing the others' over, until `id`'s (given to
    /// `take`: `Some`) or the deadline (`None`).
    fn lead<T>(
        &self,
        id: u64,
        deadline: Instant,
        in_place: usize,
        take: &mut impl FnMut(Got<'_>) -> Result<T>,
    ) -> std::result::Result<Option<Result<T>>, String> {
        let mut rx = lock(&self.rx);
        let in_place = (in_place > 0).then_some((id, in_place));
        loop {
            let got = rx.frame_with(in_place, |aid, a| {
                if aid == id {
                    return Some(take(Got::Frame(a)));
                }
                let mut st = lock(&self.state);
                if st.waiting.contains(&aid) {
                    st.answers.insert(aid, a.map(<[u8]>::to_vec));
                    self.wake(&st);
                }
                None
            })?;
            match got {
                Some(Next::Frame(Some(r))) => return Ok(Some(r)),
                Some(Next::Frame(None)) => {}
                Some(Next::Arriving) => {
                    let r = take(Got::Arriving(Arriving {
                        rx: &mut rx,
                        deadline,
                    }));
                    return match rx.broken.take() {
                        Some(why) => Err(why),
                        None => Ok(Some(r)),
                    };
                }
                None if Instant::now() >= deadline => return Ok(None),
                None => {}
            }
        }
    }

    fn call(&self, req: &Request, timeout: Duration) -> Answer {
        self.call_many(std::slice::from_ref(req), timeout)
            .pop()
            .unwrap_or_else(|| Err(Error::Corrupt("no answer".into())))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Releases kept for later go now; then the server's session ends.
        let _ = self.flush_later(&[]);
        let _ = lock(&self.out).shutdown(Shutdown::Both);
    }
}

#[derive(Debug)]
struct Inner {
    conns: Vec<Conn>,
    cache: Option<Mutex<PageCache>>,
    cfg: ClientConfig,
    next: AtomicUsize,
    /// The servers a new buffer or put may go to (indices in `conns`).
    place: Vec<usize>,
    closed: AtomicBool,
}

impl Inner {
    /// The server the next new buffer or put goes to.
    fn next_server(&self) -> usize {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        self.place[k % self.place.len()]
    }

    /// The connection to the server of `r`, once `r` is checked as far as
    /// the client can: a Ref of one of its servers, no longer than that
    /// server holds (a forged length must not size a buffer or a loop).
    fn conn_of(&self, r: &Ref) -> Result<&Conn> {
        if r.backend != BACKEND_MEMSERVER {
            return Err(Error::ForeignPool {
                expected: self.conns[0].server_id,
                found: r.pool_id,
            });
        }
        let c = self
            .conns
            .iter()
            .find(|c| c.server_id == r.pool_id)
            .ok_or(Error::ForeignPool {
                expected: self.conns[0].server_id,
                found: r.pool_id,
            })?;
        if r.len > c.max_len {
            return Err(Error::TooLarge {
                len: r.len,
                max: c.max_len,
            });
        }
        Ok(c)
    }

    fn call(&self, server: usize, req: &Request) -> Answer {
        self.conns[server].call(req, self.cfg.timeout)
    }
}

/// One or several memory servers as one pool.
#[derive(Debug, Clone)]
pub struct MemPool {
    inner: Arc<Inner>,
}

impl MemPool {
    /// Connects to every server in `addrs` with the default configuration.
    pub fn connect<S: AsRef<str>>(addrs: &[S]) -> Result<MemPool> {
        Self::connect_with(addrs, ClientConfig::default())
    }

    /// Connects to every server in `addrs`.
    pub fn connect_with<S: AsRef<str>>(addrs: &[S], cfg: ClientConfig) -> Result<MemPool> {
        if addrs.is_empty() {
            return Err(Error::Unavailable("no memory server given".into()));
        }
        let conns = addrs
            .iter()
            .map(|a| Conn::open(a.as_ref(), &cfg))
            .collect::<Result<Vec<_>>>()?;
        if conns.iter().any(|c| c.page_size != conns[0].page_size) {
            return Err(Error::Protocol(
                "the memory servers use different page sizes".into(),
            ));
        }
        let local: Vec<usize> = (0..conns.len()).filter(|&i| conns[i].local).collect();
        let place = if cfg.placement == Placement::Local && !local.is_empty() {
            local
        } else {
            (0..conns.len()).collect()
        };
        let inner = Arc::new(Inner {
            place,
            conns,
            cache: (cfg.cache_bytes > 0).then(|| Mutex::new(PageCache::new(cfg.cache_bytes))),
            cfg,
            next: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
        });
        keepalive(Arc::downgrade(&inner));
        Ok(MemPool { inner })
    }

    /// The servers' ids, in the order given.
    pub fn server_ids(&self) -> Vec<u64> {
        self.inner.conns.iter().map(|c| c.server_id).collect()
    }

    /// Which servers (indices in the order given) run on this host.
    pub fn local_servers(&self) -> Vec<usize> {
        (0..self.inner.conns.len())
            .filter(|&i| self.inner.conns[i].local)
            .collect()
    }

    /// Allocates on server `server` (an index in the list given).
    pub fn alloc_on(&self, server: usize, len: u64) -> Result<MemBuffer> {
        let c = self
            .inner
            .conns
            .get(server)
            .ok_or_else(|| Error::Unavailable(format!("no server {server}")))?;
        if len > c.max_len {
            return Err(Error::TooLarge {
                len,
                max: c.max_len,
            });
        }
        let a = self.inner.call(server, &Request::Alloc { len })?;
        let [addr] = proto::u64s::<1>(&a).map_err(|e| Error::Protocol(e.to_string()))?;
        Ok(MemBuffer {
            inner: self.inner.clone(),
            server,
            addr,
            len,
            freed: false,
            origin: None,
        })
    }

    /// Stores `data` on a server (as [`Placement`] says) as a new Ref, in one round
    /// trip (alloc, write, create_ref and free on the server). `ttl` 0:
    /// the server's default.
    ///
    /// The Ref comes back once the server has read the request's head
    /// (`stream_put`), while the bytes may still be on their way: a
    /// reader of the Ref on another connection waits for them at the
    /// server. If this process dies before they all arrive, the Ref is
    /// released and its readers get `Unavailable`.
    pub fn put(&self, data: &[u8], ttl: Duration) -> Result<Ref> {
        let k = self.inner.next_server();
        if data.len() > MAX_IO {
            // Too large for one request: the long way, pipelined.
            let mut b = self.alloc_on(k, data.len() as u64)?;
            b.write(0, data)?;
            let r = self.create_ref_ttl(&b, 0, data.len() as u64, ttl)?;
            self.free(b)?;
            return Ok(r);
        }
        let ttl_ms = ttl.as_millis().min(u32::MAX as u128) as u32;
        let data = std::borrow::Cow::Borrowed(data);
        let c = &self.inner.conns[k];
        // The Ref comes back as soon as the server has taken the pages:
        // the bytes follow on the wire while the caller passes it on.
        let a = if c.streams.load(Ordering::Relaxed) {
            match self.inner.call(
                k,
                &Request::StreamPut {
                    ttl_ms,
                    data: data.clone(),
                },
            ) {
                Err(Error::Protocol(m)) if m.contains("unknown operation") => {
                    c.streams.store(false, Ordering::Relaxed);
                    self.inner.call(k, &Request::Put { ttl_ms, data })
                }
                a => a,
            }
        } else {
            self.inner.call(k, &Request::Put { ttl_ms, data })
        }?;
        proto::decode_ref(&a).map_err(|e| Error::Protocol(e.to_string()))
    }

    /// Checks `r` as far as the client can without asking its server: a
    /// Ref of one of these servers, no longer than that server holds.
    /// What a receiver does before it sizes anything by the Ref's length.
    pub fn check_ref(&self, r: &Ref) -> Result<()> {
        self.inner.conn_of(r).map(drop)
    }

    /// Reads `out.len()` bytes at `offset` of `r`'s snapshot without
    /// mapping it (one round trip per [`REF_READ_CHUNK`], pipelined,
    /// through the page
    /// cache). Chunks this client read before come from its cache even if
    /// the Ref was released since: the data is immutable and was readable
    /// to this client; chunks not cached need the Ref live.
    pub fn read_ref(&self, r: &Ref, offset: u64, out: &mut [u8]) -> Result<()> {
        let c = self.inner.conn_of(r)?;
        dm_pool::check_range(offset, out.len() as u64, r.len)?;
        let fetch = |off: u64, buf: &mut [u8]| -> Result<()> {
            let reqs: Vec<Request> = read_requests(*r, off, buf.len()).collect();
            c.read_into(
                &reqs,
                buf.chunks_mut(REF_READ_CHUNK).collect(),
                self.inner.cfg.timeout,
            )
        };
        match &self.inner.cache {
            Some(cache) if !out.is_empty() => {
                let chunks = r.len.div_ceil(self.page_size() as u64) as usize;
                read_through(
                    cache,
                    key_of(r),
                    &vec![false; chunks],
                    self.page_size() as u64,
                    r.len,
                    offset,
                    out,
                    fetch,
                )
            }
            _ => fetch(offset, out),
        }
    }

    /// Reads several ranges of `r`'s snapshot in one pipelined batch (all
    /// requests sent, then all answers read: about one round trip however
    /// many ranges), e.g. the rows of an image that a thumbnail samples.
    /// Each entry is an offset and the buffer it fills. The ranges bypass
    /// the page cache. Every range is checked before anything is sent.
    pub fn read_ref_ranges(&self, r: &Ref, ranges: &mut [(u64, &mut [u8])]) -> Result<()> {
        let c = self.inner.conn_of(r)?;
        let mut reqs = Vec::new();
        for (off, buf) in ranges.iter() {
            dm_pool::check_range(*off, buf.len() as u64, r.len)?;
            reqs.extend(read_requests(*r, *off, buf.len()));
        }
        let outs = ranges
            .iter_mut()
            .flat_map(|(_, buf)| buf.chunks_mut(REF_READ_CHUNK))
            .collect();
        c.read_into(&reqs, outs, self.inner.cfg.timeout)
    }

    /// Releases `r` without waiting for the answer (a Ref the framework
    /// made for a call, released when the call completes: a failure would
    /// change nothing for the caller, and the TTL reclaims it anyway).
    /// The release costs no write of its own: it goes ahead of this
    /// client's next request to that server, or with the keep-alive
    /// ping within half a second, or when the pool drops. If the process
    /// dies first, the Ref's TTL reclaims it.
    pub fn release_ref_nowait(&self, r: &Ref) -> Result<()> {
        self.inner.conn_of(r)?.send_later(&Request::ReleaseRef(*r))
    }

    /// The counters of the page cache (zeros without one).
    pub fn cache_stats(&self) -> CacheStats {
        self.inner
            .cache
            .as_ref()
            .map(|c| lock(c).stats())
            .unwrap_or_default()
    }

    /// Every server's invariant problems (none: consistent).
    pub fn check_servers(&self) -> Result<Vec<String>> {
        let mut v = Vec::new();
        for i in 0..self.inner.conns.len() {
            let b = self.inner.call(i, &Request::Check)?;
            let s = String::from_utf8_lossy(&b);
            v.extend(s.lines().filter(|l| !l.is_empty()).map(str::to_owned));
        }
        Ok(v)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

/// Pings every server every third of the lease while the pool lives.
fn keepalive(inner: Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(i) => i.cfg.lease / 3,
        None => return,
    };
    let _ = std::thread::Builder::new()
        .name("dm-memclient-ping".into())
        .spawn(move || loop {
            std::thread::sleep(period.min(Duration::from_millis(500)));
            let Some(i) = inner.upgrade() else { return };
            if i.closed.load(Ordering::Relaxed) {
                return;
            }
            for c in &i.conns {
                // Fire and forget: the answer is dropped by the reader.
                // Releases kept for later go with it.
                let id = c.next_id.fetch_add(1, Ordering::Relaxed);
                let mut b = Vec::new();
                Request::Ping.encode(id, &mut b);
                let _ = c.flush_later(&b);
            }
        });
}

/// A buffer on a memory server. Dropping it frees it.
#[derive(Debug)]
pub struct MemBuffer {
    inner: Arc<Inner>,
    server: usize,
    addr: u64,
    len: u64,
    freed: bool,
    /// The Ref this buffer maps (its chunks are cacheable), and the chunks
    /// this client has written since (its own copies: never cached).
    origin: Option<(RefKey, Vec<bool>)>,
}

impl MemBuffer {
    /// Its address on its server.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Which server holds it (an index in the list given).
    pub fn server(&self) -> usize {
        self.server
    }

    /// The pool (the servers, through this client) the buffer is of.
    pub fn pool(&self) -> MemPool {
        MemPool {
            inner: self.inner.clone(),
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        dm_pool::check_range(offset, len, self.len)
    }

    fn all(answers: Vec<Answer>) -> Result<Vec<Vec<u8>>> {
        answers.into_iter().collect()
    }
}

impl DmBuffer for MemBuffer {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len() as u64)?;
        match (&self.origin, &self.inner.cache) {
            (Some((key, dirty)), Some(cache)) if !out.is_empty() => read_through(
                cache,
                *key,
                dirty,
                self.inner.conns[0].page_size as u64,
                self.len,
                offset,
                out,
                |off, buf| self.read_server(off, buf),
            ),
            _ => self.read_server(offset, out),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        if let Some((_, dirty)) = &mut self.origin {
            if !data.is_empty() {
                let ps = self.inner.conns[0].page_size as u64;
                let (a, b) = (offset / ps, (offset + data.len() as u64 - 1) / ps);
                for d in &mut dirty[a as usize..=b as usize] {
                    *d = true;
                }
            }
        }
        let reqs: Vec<Request> = data
            .chunks(WRITE_CHUNK)
            .enumerate()
            .map(|(i, d)| Request::Write {
                addr: self.addr,
                offset: offset + (i * WRITE_CHUNK) as u64,
                data: d.into(),
            })
            .collect();
        let c = &self.inner.conns[self.server];
        Self::all(c.call_many(&reqs, self.inner.cfg.timeout)).map(|_| ())
    }
}

impl MemBuffer {
    fn read_server(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let reqs: Vec<Request> = (0..out.len())
            .step_by(READ_CHUNK)
            .map(|at| Request::Read {
                addr: self.addr,
                offset: offset + at as u64,
                len: READ_CHUNK.min(out.len() - at) as u32,
            })
            .collect();
        let c = &self.inner.conns[self.server];
        c.read_into(
            &reqs,
            out.chunks_mut(READ_CHUNK).collect(),
            self.inner.cfg.timeout,
        )
    }
}

impl Drop for MemBuffer {
    fn drop(&mut self) {
        if !self.freed {
            let _ = self
                .inner
                .call(self.server, &Request::Free { addr: self.addr });
        }
    }
}

impl Dm for MemPool {
    type Buffer = MemBuffer;

    fn page_size(&self) -> usize {
        self.inner.conns[0].page_size as usize
    }

    fn alloc(&self, len: u64) -> Result<MemBuffer> {
        self.alloc_on(self.inner.next_server(), len)
    }

    fn free(&self, mut buf: MemBuffer) -> Result<()> {
        buf.freed = true;
        self.inner
            .call(buf.server, &Request::Free { addr: buf.addr })
            .map(|_| ())
    }

    fn create_ref(&self, buf: &MemBuffer, offset: u64, len: u64) -> Result<Ref> {
        self.create_ttl(buf, offset, len, 0)
    }

    fn create_ref_ttl(&self, buf: &MemBuffer, offset: u64, len: u64, ttl: Duration) -> Result<Ref> {
        let ms = ttl.as_millis().clamp(1, u32::MAX as u128) as u32;
        self.create_ttl(buf, offset, len, ms)
    }

    fn map_ref(&self, r: &Ref) -> Result<MemBuffer> {
        let c = self.inner.conn_of(r)?;
        let server = self
            .inner
            .conns
            .iter()
            .position(|x| std::ptr::eq(x, c))
            .unwrap_or(0);
        let a = self.inner.call(server, &Request::MapRef(*r))?;
        let [addr, len] = proto::u64s::<2>(&a).map_err(|e| Error::Protocol(e.to_string()))?;
        let chunks = len.div_ceil(self.page_size() as u64) as usize;
        Ok(MemBuffer {
            inner: self.inner.clone(),
            server,
            addr,
            len,
            freed: false,
            origin: self
                .inner
                .cache
                .is_some()
                .then(|| (key_of(r), vec![false; chunks])),
        })
    }

    fn release_ref(&self, r: &Ref) -> Result<()> {
        let c = self.inner.conn_of(r)?;
        c.call(&Request::ReleaseRef(*r), self.inner.cfg.timeout)
            .map(|_| ())
    }

    fn maintain(&self) -> Result<()> {
        for i in 0..self.inner.conns.len() {
            self.inner.call(i, &Request::Maintain)?;
        }
        Ok(())
    }

    fn usage(&self) -> Result<Usage> {
        let mut u = Usage::default();
        for i in 0..self.inner.conns.len() {
            let b = self.inner.call(i, &Request::Usage)?;
            let [h, s, r, f] = proto::u64s::<4>(&b).map_err(|e| Error::Protocol(e.to_string()))?;
            u.pages_held += h;
            u.pages_shared += s;
            u.refs += r;
            u.pages_free += f;
        }
        Ok(u)
    }

    fn check(&self) -> Result<Vec<String>> {
        self.check_servers()
    }
}

impl MemPool {
    fn create_ttl(&self, buf: &MemBuffer, offset: u64, len: u64, ttl_ms: u32) -> Result<Ref> {
        if !Arc::ptr_eq(&buf.inner, &self.inner) {
            return Err(Error::NotOwner { desc: 0 });
        }
        let b = self.inner.call(
            buf.server,
            &Request::CreateRef {
                addr: buf.addr,
                offset,
                len,
                ttl_ms,
            },
        )?;
        proto::decode_ref(&b).map_err(|e| Error::Protocol(e.to_string()))
    }
}

/// The requests reading `len` bytes at `off` of `r`, a [`REF_READ_CHUNK`]
/// each.
fn read_requests(r: Ref, off: u64, len: usize) -> impl Iterator<Item = Request<'static>> {
    (0..len)
        .step_by(REF_READ_CHUNK)
        .map(move |at| Request::ReadRef {
            r,
            offset: off + at as u64,
            len: REF_READ_CHUNK.min(len - at) as u32,
        })
}

/// Reads through the cache: chunks of Ref `key` not in `dirty` come from
/// the cache when there; the span of the missing ones is read with
/// `fetch` in one go and cached (except dirty ones).
#[allow(clippy::too_many_arguments)]
fn read_through(
    cache: &Mutex<PageCache>,
    key: RefKey,
    dirty: &[bool],
    ps: u64,
    len: u64,
    offset: u64,
    out: &mut [u8],
    fetch: impl Fn(u64, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let (first, last) = (offset / ps, (offset + out.len() as u64 - 1) / ps);
    let mut got: Vec<Option<Arc<[u8]>>> = Vec::with_capacity((last - first + 1) as usize);
    // Chunks are cached from the Ref's second read on (cache.rs).
    let admit;
    {
        let mut c = lock(cache);
        admit = c.admit(key);
        for k in first..=last {
            got.push(if dirty[k as usize] {
                None
            } else {
                c.get(key, k)
            });
        }
    }
    let missing: Vec<u64> = (first..=last)
        .filter(|k| got[(k - first) as usize].is_none())
        .collect();
    // Chunks fetched straight into `out`.
    let mut in_place = None;
    if let (Some(&lo), Some(&hi)) = (missing.first(), missing.last()) {
        let start = lo * ps;
        let end = ((hi + 1) * ps).min(len);
        let inside = start >= offset && end <= offset + out.len() as u64;
        let mut own = Vec::new();
        let span: &[u8] = if inside {
            // The span lies inside `out` (a whole-Ref read): fetch straight
            // into it, and cache from there.
            let at = (start - offset) as usize;
            let dst = &mut out[at..at + (end - start) as usize];
            fetch(start, dst)?;
            dst
        } else {
            own.resize((end - start) as usize, 0);
            fetch(start, &mut own)?;
            &own
        };
        let mut c = lock(cache);
        for k in lo..=hi {
            let s = ((k - lo) * ps) as usize;
            let e = (s + ps as usize).min(span.len());
            if inside {
                // Already in place: only cached (unless dirty).
                if admit && !dirty[k as usize] {
                    c.put(key, k, Arc::from(&span[s..e]));
                }
                continue;
            }
            let chunk: Arc<[u8]> = Arc::from(&span[s..e]);
            if admit && !dirty[k as usize] {
                c.put(key, k, chunk.clone());
            }
            got[(k - first) as usize] = Some(chunk);
        }
        if inside {
            in_place = Some(lo..=hi);
        }
    }
    for (i, k) in (first..=last).enumerate() {
        if in_place.as_ref().is_some_and(|r| r.contains(&k)) {
            continue;
        }
        let Some(chunk) = &got[i] else {
            return Err(Error::Corrupt("a chunk went missing".into()));
        };
        let cs = k * ps;
        let (from, to) = (offset.max(cs), (offset + out.len() as u64).min(cs + ps));
        out[(from - offset) as usize..(to - offset) as usize]
            .copy_from_slice(&chunk[(from - cs) as usize..(to - cs) as usize]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads through the cache give the data whichever way they go: a
    /// whole-Ref read fetched straight into the caller's buffer, the same
    /// read again from the cache alone, unaligned ranges (fetched into a
    /// span of whole chunks), and chunks marked dirty, which are fetched
    /// every time and never cached.
    #[test]
    fn reads_through_the_cache_agree_with_the_data() {
        let ps = 4096u64;
        let data: Vec<u8> = (0..10 * ps + 100).map(|i| (i % 251) as u8).collect();
        let len = data.len() as u64;
        let fetched = std::cell::Cell::new(0u64);
        let fetch = |off: u64, buf: &mut [u8]| -> Result<()> {
            fetched.set(fetched.get() + buf.len() as u64);
            buf.copy_from_slice(&data[off as usize..off as usize + buf.len()]);
            Ok(())
        };
        let chunks = len.div_ceil(ps) as usize;
        let key = (1, 2, 3, 4);
        let read = |cache: &Mutex<PageCache>, dirty: &[bool], off: u64, n: usize| {
            let mut out = vec![0u8; n];
            read_through(cache, key, dirty, ps, len, off, &mut out, fetch).unwrap();
            assert!(out == data[off as usize..off as usize + n], "{off}+{n}");
        };
        let clean = vec![false; chunks];
        let cache = Mutex::new(PageCache::new(1 << 20));
        read(&cache, &clean, 0, len as usize);
        assert_eq!(fetched.get(), len, "one fetch of the whole Ref");
        assert_eq!(lock(&cache).stats().bytes, 0, "a first read is not cached");
        read(&cache, &clean, 0, len as usize);
        assert_eq!(fetched.get(), 2 * len, "the second read fetches and caches");
        read(&cache, &clean, 0, len as usize);
        read(&cache, &clean, 5000, 20_000);
        assert_eq!(fetched.get(), 2 * len, "then all from the cache");
        let cache = Mutex::new(PageCache::new(1 << 20));
        read(&cache, &clean, 5000, 20_000);
        read(&cache, &clean, 3 * ps + 1, (len - 3 * ps - 1) as usize);
        let mut dirty = clean.clone();
        dirty[4] = true;
        let before = fetched.get();
        let cache = Mutex::new(PageCache::new(1 << 20));
        read(&cache, &dirty, 0, len as usize);
        read(&cache, &dirty, 0, len as usize);
        read(&cache, &dirty, 0, len as usize);
        assert_eq!(
            fetched.get() - before,
            2 * len + ps,
            "twice to be cached, then the dirty chunk alone"
        );
    }
}
