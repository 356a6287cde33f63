//! The memory server: a pinned region served over TCP (tokio), one session
//! per connection.
//!
//! State is split so that threads serving different clients share no lock
//! on the fast path: each session owns its address space (`space.rs`,
//! locked only by its own task and by the invariant check), page counts
//! are atomics, the free FIFOs and the Ref table are sharded
//! (`pages.rs`, `refs.rs`). A session ends when its connection closes or
//! its lease passes in silence; everything its buffers held is released.
//! Refs outlive sessions (they are in flight to other clients) until
//! released or expired by their TTL.

pub mod metrics;
pub mod pages;
pub mod quota;
pub mod refs;
pub mod space;

use crate::proto::{self, encode_err, encode_ok, Request, MAX_FRAME};
use dm_pool::auth::Key;
use dm_pool::{Error, Ref, Result, Usage};
use dm_sys::poll::IdlePoll;
use metrics::{Gauges, Metrics};
use pages::{lock, Pages};
use refs::{Fill, Refs, Snapshot};
use space::{Space, Standing};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::watch;

/// How a server runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on (`127.0.0.1:0` picks a port).
    pub listen: String,
    /// Bytes of memory to serve (pinned at start).
    pub size: u64,
    /// Page size.
    pub page_size: usize,
    /// Worker threads (default [`default_threads`]).
    pub threads: usize,
    /// Address of the Prometheus metrics endpoint, if any.
    pub metrics: Option<String>,
    /// TTL of a Ref created without one.
    pub default_ttl: Duration,
    /// The longest TTL a client may ask for (default one hour): a Ref
    /// nobody releases holds its pages at most this long.
    pub max_ttl: Duration,
    /// Live Refs at most (default: one per page).
    pub max_refs: Option<usize>,
    /// Buffers per session at most.
    pub max_buffers: usize,
    /// Sessions (client connections) at once at most (default 1024): the
    /// first request of one more is answered `ResourceExhausted`, and its
    /// connection closed.
    pub max_clients: usize,
    /// A session silent this long (without a hello saying otherwise) ends.
    pub default_lease: Duration,
    /// How often expired Refs are swept.
    pub sweep_every: Duration,
    /// Longest busy-poll of a worker's sockets before the worker sleeps
    /// (adapted per worker: [`dm_sys::poll::Spin`]; zero: sleep at once).
    /// A sleeping worker's wake-up costs more than a loopback round trip
    /// on the test machine (BENCHMARKS.md, `bench memserver`).
    pub spin: Duration,
    /// The key clients prove they hold (`--key-file`). None: any client
    /// that reaches the port is served, and the server refuses to listen
    /// beyond loopback unless [`open`](Self::open) says so.
    pub key: Option<Key>,
    /// The key of the admin operations (`check`, `maintain`;
    /// `--admin-key-file`). None: they are served to clients on this
    /// host only.
    pub admin_key: Option<Key>,
    /// Listen beyond loopback without a key (`--open`): anyone who reaches
    /// the port may allocate and read.
    pub open: bool,
    /// Bytes one session may hold at most: its buffers and the live Refs
    /// it created (`--client-quota`; default: no quota but the region).
    pub client_quota: Option<u64>,
}

/// Worker threads by default: half the CPUs this process may use, at
/// least one. A worker busy-polls its sockets for a while after each
/// request; where clients share the host, workers on every CPU take the
/// CPUs from them (on two CPUs, a `create_ref` + `map_ref` by two local
/// clients took 41 us with two workers and 21 us with one).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:0".into(),
            size: 64 << 20,
            page_size: 4096,
            threads: default_threads(),
            metrics: None,
            default_ttl: Duration::from_secs(60),
            max_ttl: Duration::from_secs(3600),
            max_refs: None,
            max_buffers: 1 << 20,
            max_clients: 1024,
            default_lease: Duration::from_secs(10),
            sweep_every: Duration::from_millis(250),
            spin: Duration::from_micros(200),
            key: None,
            admin_key: None,
            open: false,
            client_quota: None,
        }
    }
}

/// How long a session of a server with a key may stay unauthenticated
/// (or the default lease, if shorter).
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// The shared state of a server.
#[derive(Debug)]
pub struct State {
    /// This server's id (in its Refs).
    pub id: u64,
    cfg: Config,
    pages: Pages,
    refs: Refs,
    sessions: Mutex<HashMap<u64, Arc<Mutex<Space>>>>,
    next_session: AtomicU64,
    /// Held by the sweeper and the check (so the check sees no change).
    sweeping: Mutex<()>,
    /// Counters.
    pub metrics: Metrics,
}

impl State {
    /// A server's state: pins the region.
    pub fn new(cfg: Config) -> Result<State> {
        let shards = (cfg.threads * 2).max(2);
        let pages = Pages::new(cfg.size, cfg.page_size, shards)?;
        let id = loop {
            let x = dm_sys::rand::random_u64();
            if x != 0 {
                break x;
            }
        };
        let max_refs = cfg.max_refs.unwrap_or(pages.total() as usize);
        Ok(State {
            id,
            refs: Refs::new(id, max_refs),
            pages,
            cfg,
            sessions: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            sweeping: Mutex::new(()),
            metrics: Metrics::default(),
        })
    }

    /// The largest buffer: the whole region.
    pub fn max_len(&self) -> u64 {
        self.pages.total() as u64 * self.pages.page_size() as u64
    }

    /// Page counts.
    pub fn usage(&self) -> Usage {
        let free = self.pages.free_count();
        Usage {
            pages_held: self.pages.total() as u64 - free,
            pages_shared: self.pages.shared(),
            refs: self.refs.live(),
            pages_free: free,
        }
    }

    /// Expires Refs past their TTL now.
    pub fn maintain(&self) -> u64 {
        let _g = lock(&self.sweeping);
        let n = self.refs.sweep(&self.pages, Instant::now());
        self.metrics.refs_expired.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// The invariant check: every page's count equals its holders (buffers
    /// of all sessions and live Refs), free pages are on the free lists
    /// once. Stops every change while it runs.
    pub fn check(&self) -> Vec<String> {
        let _g = lock(&self.sweeping);
        let sessions = lock(&self.sessions);
        let mut ids: Vec<&u64> = sessions.keys().collect();
        ids.sort();
        let guards: Vec<_> = ids.iter().map(|k| lock(&sessions[*k])).collect();
        let mut counts = vec![0u32; self.pages.total() as usize];
        let mut problems = Vec::new();
        for g in &guards {
            g.count_holdings(&mut counts, &mut problems);
        }
        self.refs.count_holdings(&mut counts, &mut problems);
        self.pages.check(&counts, &mut problems);
        problems
    }

    fn gauges(&self) -> Gauges {
        let u = self.usage();
        Gauges {
            pages_free: u.pages_free,
            pages_held: u.pages_held,
            refs: u.refs,
            refs_created: self.refs.created.load(Ordering::Relaxed),
            cow_copies: self.pages.cow_copies.load(Ordering::Relaxed),
        }
    }

    /// The metrics text.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(self.gauges())
    }

    /// A new session, of a client on this host (`local`) or not.
    fn open_session(&self, local: bool) -> (u64, Arc<Mutex<Space>>) {
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let ps = self.pages.page_size() as u64;
        let quota = self.cfg.client_quota.map_or(u64::MAX, |b| b.div_ceil(ps));
        let standing = Standing {
            client: self.cfg.key.is_none(),
            admin: self.cfg.admin_key.is_none() && local,
            challenge: None,
        };
        let space = Arc::new(Mutex::new(Space::new(
            id as usize,
            self.cfg.max_buffers,
            quota,
            standing,
        )));
        lock(&self.sessions).insert(id, space.clone());
        self.metrics.clients.fetch_add(1, Ordering::Relaxed);
        (id, space)
    }

    fn close_session(&self, id: u64, space: &Mutex<Space>) {
        lock(space).clear(&self.pages);
        lock(&self.sessions).remove(&id);
        self.metrics.clients.fetch_sub(1, Ordering::Relaxed);
    }

    /// The TTL a client asked for (0: the default), within the maximum.
    fn ttl(&self, ttl_ms: u32) -> Result<Duration> {
        let ttl = match ttl_ms {
            0 => self.cfg.default_ttl,
            ms => Duration::from_millis(ms as u64),
        };
        if ttl > self.cfg.max_ttl {
            return Err(Error::InvalidConfig(format!(
                "a Ref TTL of {} ms is above this server's maximum of {} ms: ask for less, and \
                 create a new Ref before it expires",
                ttl.as_millis(),
                self.cfg.max_ttl.as_millis()
            )));
        }
        Ok(ttl)
    }

    /// For a read [`answered_in_place`] (of a buffer or a Ref): the
    /// answer's head appended to `out`, and its body as pieces of pages,
    /// pinned, to be written where they lie and then unpinned
    /// ([`Pinned::unpin`]). `None` for any other request, or for a read
    /// that fails (served the usual way, which answers the error).
    fn read_pinned(
        &self,
        space: &Mutex<Space>,
        id: u64,
        req: &Request<'_>,
        out: &mut Vec<u8>,
    ) -> Option<Pinned> {
        let pages = &self.pages;
        let mut pieces = Vec::new();
        let mut emit = |p: u32, off: usize, n: usize| {
            if p == pages::NONE {
                let mut at = 0;
                while at < n {
                    let k = (n - at).min(pages::ZERO_RUN);
                    pieces.push((p, 0, k));
                    at += k;
                }
            } else {
                pages.share(p);
                pieces.push((p, off, n));
            }
        };
        let mut sp = lock(space);
        if !sp.standing.client {
            return None;
        }
        let (len, r) = match *req {
            Request::Read { addr, offset, len } => (
                len,
                sp.read_spans(pages, addr, offset, len as u64, &mut emit),
            ),
            Request::ReadRef { r, offset, len } => (
                len,
                self.refs
                    .read_spans(pages, sp.hint, &r, offset, len as u64, &mut emit),
            ),
            _ => return None,
        };
        r.ok()?;
        // Recorded where `check` counts holders, in the same critical
        // section as the pins.
        sp.pinned.extend(
            pieces
                .iter()
                .map(|&(p, _, _)| p)
                .filter(|&p| p != pages::NONE),
        );
        proto::encode_ok_head(id, len as usize, out);
        Some(Pinned { pieces })
    }

    /// Serves one request of a session, appending its answer to `out`.
    /// Returns whether it succeeded.
    pub fn serve(
        &self,
        space: &Mutex<Space>,
        id: u64,
        req: Request<'_>,
        out: &mut Vec<u8>,
    ) -> bool {
        let mark = out.len();
        let r = self.apply(space, id, req, out);
        if let Err(e) = &r {
            out.truncate(mark);
            encode_err(id, e, out);
        }
        r.is_ok()
    }

    fn apply(
        &self,
        space: &Mutex<Space>,
        id: u64,
        req: Request<'_>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let ok = |out: &mut Vec<u8>, vals: &[u64]| {
            encode_ok(id, out, |o| {
                for v in vals {
                    o.extend_from_slice(&v.to_le_bytes());
                }
            })
        };
        // Operations on the whole server first: they take the session's
        // lock only to read or record what it proved.
        match req {
            Request::Hello { nonce, .. } => {
                let auth = nonce.map(|cn| self.offer(space, cn));
                let h = proto::HelloAnswer {
                    server_id: self.id,
                    page_size: self.pages.page_size() as u32,
                    max_len: self.max_len(),
                    auth,
                };
                encode_ok(id, out, |o| h.encode_body(o));
                return Ok(());
            }
            Request::Auth { role, proof } => {
                self.authenticate(space, role, &proof)?;
                ok(out, &[]);
                return Ok(());
            }
            Request::Ping => {
                ok(out, &[]);
                return Ok(());
            }
            Request::Usage => {
                self.may_use(&lock(space))?;
                let u = self.usage();
                ok(out, &[u.pages_held, u.pages_shared, u.refs, u.pages_free]);
                return Ok(());
            }
            Request::Check | Request::Maintain => {
                let what = if matches!(req, Request::Check) {
                    "check"
                } else {
                    "maintain"
                };
                self.may_administer(&lock(space), what)?;
                if matches!(req, Request::Check) {
                    let problems = self.check().join("\n");
                    encode_ok(id, out, |o| o.extend_from_slice(problems.as_bytes()));
                } else {
                    self.maintain();
                    ok(out, &[]);
                }
                return Ok(());
            }
            _ => {}
        }
        let pages = &self.pages;
        let mut sp = lock(space);
        self.may_use(&sp)?;
        match req {
            Request::Alloc { len } => {
                let a = sp.alloc(pages, len, self.max_len())?;
                ok(out, &[a]);
            }
            Request::Free { addr } => {
                sp.free(pages, addr)?;
                ok(out, &[]);
            }
            Request::Read { addr, offset, len } => {
                let mut res = Ok(());
                encode_ok(id, out, |o| {
                    o.reserve(len as usize);
                    res = sp.read_spans(pages, addr, offset, len as u64, |p, off, n| {
                        pages.append(p, off, n, o)
                    })
                });
                res?;
            }
            Request::Write { addr, offset, data } => {
                sp.write(pages, addr, offset, &data)?;
                ok(out, &[]);
            }
            Request::CreateRef {
                addr,
                offset,
                len,
                ttl_ms,
            } => {
                let expires = Instant::now() + self.ttl(ttl_ms)?;
                let r = sp.create_ref(pages, &self.refs, addr, offset, len, expires)?;
                encode_ok(id, out, |o| o.extend_from_slice(&r.to_bytes()));
            }
            Request::MapRef(r) => {
                let (a, len) = sp.map_ref(pages, &self.refs, &r)?;
                ok(out, &[a, len]);
            }
            Request::ReleaseRef(r) => {
                self.refs.release(pages, sp.hint, &r)?;
                ok(out, &[]);
            }
            Request::Put { ttl_ms, data } | Request::StreamPut { ttl_ms, data } => {
                let len = data.len() as u64;
                // The Ref's charge is the one that stays.
                let a = sp.alloc_with(pages, len, self.max_len(), false)?;
                let r = sp.write(pages, a, 0, &data).and_then(|()| {
                    let expires = Instant::now() + self.ttl(ttl_ms)?;
                    sp.create_ref(pages, &self.refs, a, 0, len, expires)
                });
                sp.free(pages, a)?;
                let r = r?;
                encode_ok(id, out, |o| o.extend_from_slice(&r.to_bytes()));
            }
            Request::ReadRef { r, offset, len } => {
                let mut res = Ok(());
                let hint = sp.hint;
                encode_ok(id, out, |o| {
                    o.reserve(len as usize);
                    res = self
                        .refs
                        .read_spans(pages, hint, &r, offset, len as u64, |p, off, n| {
                            pages.append(p, off, n, o)
                        })
                });
                res?;
            }
            Request::Hello { .. }
            | Request::Auth { .. }
            | Request::Usage
            | Request::Check
            | Request::Maintain
            | Request::Ping => {}
        }
        Ok(())
    }

    /// Takes the pages of a `stream_put` of `len` bytes and makes its Ref,
    /// filling (see `proto`): the Ref, its fill, and its pages, of which
    /// the caller, their filler, holds a share each (recorded with the
    /// session's pinned pages, which the check counts) until
    /// [`end_fill`](Self::end_fill).
    fn start_fill(
        &self,
        space: &Mutex<Space>,
        ttl_ms: u32,
        len: u64,
    ) -> Result<(Ref, Arc<Fill>, Vec<u32>)> {
        let pages = &self.pages;
        let mut sp = lock(space);
        self.may_use(&sp)?;
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        let max = self.max_len();
        if len > max {
            return Err(Error::TooLarge { len, max });
        }
        let expires = Instant::now() + self.ttl(ttl_ms)?;
        let ps = pages.page_size() as u64;
        let n = len.div_ceil(ps) as usize;
        // As a put's buffer does, for as long as the bytes arrive.
        if !pages.reserve(n as u64) {
            return Err(Error::ResourceExhausted {
                what: "memory-server pages",
            });
        }
        let taken = sp.account.charge(n as u64).and_then(|charge| {
            let mut pgs = Vec::with_capacity(n);
            pages.take(sp.hint, n, &mut pgs)?;
            Ok((charge, pgs))
        });
        let (charge, pgs) = match taken {
            Ok(t) => t,
            Err(e) => {
                pages.unreserve(n as u64);
                return Err(e);
            }
        };
        pages.zero_tail(pgs[n - 1], (len - (n as u64 - 1) * ps) as usize);
        // The Ref's shares; the taker's count is the filler's.
        for &p in &pgs {
            pages.share(p);
        }
        let fill = Arc::new(Fill::new(len));
        let snap = Snapshot {
            len,
            head: 0,
            pages: pgs.clone(),
        };
        match self
            .refs
            .insert_filling(snap, expires, charge, Some(fill.clone()))
        {
            Ok(r) => {
                sp.pinned.extend_from_slice(&pgs);
                Ok((r, fill, pgs))
            }
            Err(e) => {
                for &p in &pgs {
                    pages.unshare(sp.hint, p);
                    pages.unshare(sp.hint, p);
                }
                pages.unreserve(n as u64);
                Err(e)
            }
        }
    }

    /// Ends the fill of `r`: `complete`, or broken off (the Ref is
    /// released and those waiting fail). The filler's shares go.
    fn end_fill(&self, space: &Mutex<Space>, r: &Ref, fill: &Fill, complete: bool) {
        let mut sp = lock(space);
        let hint = sp.hint;
        if !complete {
            fill.break_off();
            // (Released or expired already: nothing to do.)
            let _ = self.refs.release(&self.pages, hint, r);
        }
        let n = sp.pinned.len() as u64;
        for p in sp.pinned.drain(..) {
            self.pages.unshare(hint, p);
        }
        self.pages.unreserve(n);
    }

    /// The fill a read or map of a Ref still filling waits for, and up to
    /// which byte; `None` for anything else.
    fn fill_to_wait(&self, space: &Mutex<Space>, req: &Request<'_>) -> Option<(Arc<Fill>, u64)> {
        let (r, end) = match *req {
            Request::ReadRef { r, offset, len } => (r, offset.saturating_add(len as u64)),
            Request::MapRef(r) => (r, r.len),
            _ => return None,
        };
        let hint = lock(space).hint;
        let f = self.refs.filling(&self.pages, hint, &r).ok()??;
        Some((f, end))
    }

    /// The server's side of the challenge, for a hello with nonce `cn`.
    fn offer(&self, space: &Mutex<Space>, cn: [u8; 16]) -> proto::AuthOffer {
        let sn = dm_pool::auth::nonce();
        lock(space).standing.challenge = Some((cn, sn));
        let mut flags = 0;
        if self.cfg.key.is_some() {
            flags |= proto::AUTH_NEEDS_KEY;
        }
        if self.cfg.admin_key.is_some() {
            flags |= proto::AUTH_HAS_ADMIN;
        }
        let prove = |k: &Option<Key>, role| {
            k.as_ref()
                .map_or([0; 32], |k| k.proof(proto::AUTH_CONTEXT, role, &cn, &sn))
        };
        proto::AuthOffer {
            flags,
            nonce: sn,
            proof: prove(&self.cfg.key, b'S'),
            admin_proof: prove(&self.cfg.admin_key, b'T'),
        }
    }

    /// Checks a client's proof of a key, against the nonces of its last
    /// hello.
    fn authenticate(&self, space: &Mutex<Space>, role: u8, proof: &[u8; 32]) -> Result<()> {
        let mut sp = lock(space);
        let Some((cn, sn)) = sp.standing.challenge else {
            return Err(Error::Unauthenticated(
                "auth without a hello that sent a nonce first".into(),
            ));
        };
        let (key, letter, what) = match role {
            proto::ROLE_CLIENT => (self.cfg.key.as_ref(), b'C', "client"),
            proto::ROLE_ADMIN => (self.cfg.admin_key.as_ref(), b'A', "admin"),
            r => return Err(Error::Protocol(format!("unknown auth role {r}"))),
        };
        let Some(key) = key else {
            return Err(Error::Unauthenticated(format!(
                "this memory server has no {what} key: connect without one"
            )));
        };
        if !key.verify(proto::AUTH_CONTEXT, letter, &cn, &sn, proof) {
            self.metrics.auth_failures.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Unauthenticated(format!(
                "the {what} key does not match this memory server's: give the client the \
                 server's key file"
            )));
        }
        match role {
            proto::ROLE_ADMIN => {
                sp.standing.admin = true;
                sp.standing.client = true;
            }
            _ => sp.standing.client = true,
        }
        Ok(())
    }

    fn may_use(&self, sp: &Space) -> Result<()> {
        if sp.standing.client {
            return Ok(());
        }
        Err(Error::Unauthenticated(
            "this memory server wants a client key: give the client the server's key file \
             (`ClientConfig::key`, `--key-file`)"
                .into(),
        ))
    }

    fn may_administer(&self, sp: &Space, what: &str) -> Result<()> {
        // (A client of this host without the client key is no admin.)
        if sp.standing.admin && sp.standing.client {
            return Ok(());
        }
        Err(Error::PermissionDenied(format!(
            "{what} is an admin operation: {}",
            if self.cfg.admin_key.is_some() {
                "connect with the server's admin key (`ClientConfig::admin_key`, `--admin-key-file`)"
            } else {
                "run it on the server's own host, or start the server with an admin key \
                 (`--admin-key-file`)"
            }
        )))
    }
}

/// Serves a `stream_put` whose head (`id`, `ttl_ms`) was read and whose
/// `len` bytes follow on `rd`: answers its Ref at once, then receives the
/// bytes straight into its pages, within `within`. Returns whether it
/// succeeded; an error ends the session (the stream cannot be followed).
#[allow(clippy::too_many_arguments)]
async fn stream_put(
    state: &State,
    space: &Mutex<Space>,
    rd: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: &mut BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    id: u64,
    ttl_ms: u32,
    len: u64,
    within: Duration,
    out: &mut Vec<u8>,
) -> std::result::Result<bool, &'static str> {
    out.clear();
    let (r, fill, pgs) = match state.start_fill(space, ttl_ms, len) {
        Ok(x) => x,
        Err(e) => {
            // Refused: say why, and pass over its bytes.
            encode_err(id, &e, out);
            write_within(wr, out, true, within)
                .await
                .map_err(|_| "write failed or not read")?;
            skip(rd, len, within).await.map_err(|_| "truncated frame")?;
            return Ok(false);
        }
    };
    encode_ok(id, out, |o| o.extend_from_slice(&r.to_bytes()));
    if write_within(wr, out, true, within).await.is_err() {
        state.end_fill(space, &r, &fill, false);
        return Err("write failed or not read");
    }
    let pieces = pieces_of(&pgs, state.pages.page_size(), len);
    let got = receive_into(&state.pages, rd, &pieces, |n| fill.advance(n), within).await;
    state.end_fill(space, &r, &fill, got.is_ok());
    got.map(|()| true)
        .map_err(|_| "a stream_put's bytes stopped short")
}

/// Writes at least this long are received straight into the buffer's
/// pages; shorter ones are read whole first and copied (one read of the
/// frame costs less than following its pieces).
pub const WRITE_IN_PLACE_MIN: usize = 64 << 10;

/// Serves a `write` whose head (`id`, `addr`, `offset`) was read and whose
/// `len` bytes follow on `rd`: receives them straight into the buffer's
/// pages (made ready as any write makes them), then puts its answer in
/// `out`. Returns whether it succeeded; an error ends the session (the
/// stream cannot be followed).
#[allow(clippy::too_many_arguments)]
async fn write_in_place(
    state: &State,
    space: &Mutex<Space>,
    rd: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    id: u64,
    addr: u64,
    offset: u64,
    len: u64,
    within: Duration,
    out: &mut Vec<u8>,
) -> std::result::Result<bool, &'static str> {
    out.clear();
    let pieces = {
        let mut sp = lock(space);
        state
            .may_use(&sp)
            .and_then(|()| sp.write_pieces(&state.pages, addr, offset, len))
    };
    match pieces {
        Ok(pieces) => {
            // The session goes on only once the bytes are in: nothing else
            // of it runs meanwhile, and nobody else holds these pages.
            receive_into(&state.pages, rd, &pieces, |_| {}, within)
                .await
                .map_err(|_| "a write's bytes stopped short")?;
            encode_ok(id, out, |_| {});
            Ok(true)
        }
        Err(e) => {
            // Refused: say why, and pass over its bytes.
            encode_err(id, &e, out);
            skip(rd, len, within).await.map_err(|_| "truncated frame")?;
            Ok(false)
        }
    }
}

/// Reads and drops `len` bytes, within `within`.
async fn skip(
    rd: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    len: u64,
    within: Duration,
) -> std::io::Result<()> {
    let mut take = (&mut *rd).take(len);
    let n = tokio::time::timeout(within, tokio::io::copy(&mut take, &mut tokio::io::sink()))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    if n < len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Receives bytes straight into `pieces` (page, offset, length), in
/// order: what `rd` holds already is copied, the rest read from the
/// socket into the pages (vectored, no copy in between). `arrived` is
/// told how many bytes are in after each read; all within `within`.
///
/// The pieces are the caller's to fill (see [`Pages::fill_slice`]): the
/// pages of a `stream_put`'s Ref while its fill runs, or of a buffer a
/// write goes to, which only this session touches.
async fn receive_into(
    pages: &Pages,
    rd: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    pieces: &[(u32, usize, usize)],
    mut arrived: impl FnMut(u64),
    within: Duration,
) -> std::io::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    // The next piece, and bytes of it already in.
    let (mut next, mut part) = (0usize, 0usize);
    let mut got = 0u64;
    while next < pieces.len() {
        let buffered = rd.buffer();
        if !buffered.is_empty() {
            let mut used = 0;
            while next < pieces.len() && used < buffered.len() {
                let (p, off, n) = pieces[next];
                let k = (n - part).min(buffered.len() - used);
                // SAFETY: the caller fills these bytes (above); nobody
                // reads them until `arrived` says they are in.
                let dst = unsafe { pages.fill_slice(p, off + part, k) };
                dst.copy_from_slice(&buffered[used..used + k]);
                used += k;
                part += k;
                if part == n {
                    (next, part) = (next + 1, 0);
                }
            }
            rd.consume(used);
            got += used as u64;
            arrived(got);
            continue;
        }
        // Nothing buffered: from the socket straight into the pages.
        let s = rd.get_ref();
        match tokio::time::timeout_at(deadline, s.readable()).await {
            Ok(r) => r?,
            Err(_) => return Err(std::io::ErrorKind::TimedOut.into()),
        }
        let mut slices = Vec::new();
        // (At most IOV_MAX pieces a read.)
        for (i, &(p, off, n)) in pieces[next..].iter().take(1024).enumerate() {
            let skip = if i == 0 { part } else { 0 };
            // SAFETY: as above; the slices are dropped before `arrived`
            // says their bytes are in.
            slices.push(std::io::IoSliceMut::new(unsafe {
                pages.fill_slice(p, off + skip, n - skip)
            }));
        }
        let r = s.try_read_vectored(&mut slices);
        drop(slices);
        match r {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(mut k) => {
                got += k as u64;
                while k > 0 {
                    let left = pieces[next].2 - part;
                    if k < left {
                        part += k;
                        break;
                    }
                    k -= left;
                    (next, part) = (next + 1, 0);
                }
                arrived(got);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The pieces (page, offset, length) of `len` bytes laid from the start
/// of pages `pgs`.
fn pieces_of(pgs: &[u32], page_size: usize, len: u64) -> Vec<(u32, usize, usize)> {
    let mut left = len as usize;
    pgs.iter()
        .map_while(|&p| {
            (left > 0).then(|| {
                let n = left.min(page_size);
                left -= n;
                (p, 0, n)
            })
        })
        .collect()
}

/// Reads this long or longer are answered from the pages where they lie
/// (pinned while written), not copied into the answer first. (`put_get`,
/// interleaved runs: 1 MiB `read_ref` 509-595 -> 382-424 us; at 256 KiB
/// ahead in two runs of three; at 64 KiB, where the copy is about 5 of
/// 45 us, no difference could be told from the noise.)
pub const PINNED_READ_MIN: usize = 256 << 10;

/// Whether `req` is a read answered from the pages where they lie.
fn answered_in_place(req: &Request<'_>) -> bool {
    matches!(*req, Request::Read { len, .. } | Request::ReadRef { len, .. } if len as usize >= PINNED_READ_MIN)
}

/// A read's answer body: pieces of pages (page, offset, length), pinned
/// (and recorded in the session's `Space::pinned`).
struct Pinned {
    pieces: Vec<(u32, usize, usize)>,
}

impl Pinned {
    /// Ends the pins (a session writes one answer at a time, so its
    /// pinned pages are exactly these).
    fn unpin(self, pages: &Pages, space: &Mutex<Space>) {
        let mut sp = lock(space);
        let hint = sp.hint;
        for p in sp.pinned.drain(..) {
            pages.unshare(hint, p);
        }
    }
}

/// Writes `head` and then the pinned pieces where they lie, within
/// `within`, unpinning them whatever happens.
async fn write_pinned(
    wr: &mut BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    pages: &Pages,
    space: &Mutex<Space>,
    head: &[u8],
    body: Pinned,
    within: Duration,
) -> std::io::Result<()> {
    let w = async {
        let mut slices: Vec<std::io::IoSlice<'_>> = Vec::with_capacity(body.pieces.len() + 1);
        slices.push(std::io::IoSlice::new(head));
        for &(p, off, n) in &body.pieces {
            slices.push(std::io::IoSlice::new(pages.slice(p, off, n)));
        }
        // What is buffered goes first; then straight to the socket.
        wr.flush().await?;
        let s = wr.get_mut();
        let mut rest: &mut [std::io::IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let k = s.write_vectored(rest).await?;
            if k == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            std::io::IoSlice::advance_slices(&mut rest, k);
        }
        Ok(())
    };
    let r = tokio::time::timeout(within, w)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()));
    body.unpin(pages, space);
    r
}

/// A worker's runtime: single-threaded, and, before it sleeps, polling
/// its sessions' sockets (`polled`), so a request that comes soon is
/// served without the wake-up of a sleeping thread.
fn polling_runtime(polled: Arc<IdlePoll>) -> std::io::Result<Runtime> {
    let p2 = polled.clone();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(move || polled.before_sleep())
        .on_thread_unpark(move || p2.after_wake())
        .build()
}

/// Serves one connection until it closes, its lease passes in silence,
/// it breaks the framing, or the server stops.
async fn session(
    state: Arc<State>,
    stream: TcpStream,
    mut stop: watch::Receiver<bool>,
    polled: Arc<IdlePoll>,
) {
    let _ = stream.set_nodelay(true);
    let fd = stream.as_raw_fd();
    // Polled by the worker before it sleeps (a failure only loses that).
    let _ = polled.add(fd);
    let peer_addr = stream.peer_addr().ok();
    let local = peer_addr.is_some_and(|a| a.ip().is_loopback());
    let peer = peer_addr.map_or_else(|| "?".into(), |a| a.to_string());
    let (sid, space) = state.open_session(local);
    let opened = Instant::now();
    // (Counted with this one.)
    let over_cap = state.metrics.clients.load(Ordering::Relaxed) as usize > state.cfg.max_clients;
    tracing::debug!(session = sid, %peer, over_cap, "session opened");
    let (rd, wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(1 << 16, rd);
    let mut wr = BufWriter::with_capacity(1 << 16, wr);
    let mut lease = state.cfg.default_lease;
    let mut frame = Vec::new();
    let mut out = Vec::new();
    // The lease: a tick every tenth of it; a session that read nothing
    // for a whole lease ends. (No timer per request: the tick persists.)
    let mut tick = tokio::time::interval(lease / 10);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut idle_since: Option<Instant> = None;
    let mut active = true;
    let why = loop {
        // Wait for bytes without consuming any (cancel-safe), so the
        // lease tick and the stop can interrupt the wait, never a frame.
        let avail = tokio::select! {
            biased;
            r = rd.fill_buf() => match r {
                Ok([]) => break "closed",
                Ok(b) => {
                    let n = (b.len() >= 4).then(|| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
                    (b.len(), n)
                }
                Err(_) => break "closed",
            },
            _ = tick.tick() => {
                if opened.elapsed() >= AUTH_TIMEOUT.min(state.cfg.default_lease)
                    && !lock(&space).standing.client
                {
                    break "not authenticated in time";
                }
                if std::mem::take(&mut active) {
                    idle_since = None;
                } else if idle_since.get_or_insert_with(Instant::now).elapsed() >= lease {
                    state.metrics.leases_expired.fetch_add(1, Ordering::Relaxed);
                    break "lease expired";
                }
                continue;
            }
            _ = stop.changed() => break "server stopping",
        };
        active = true;
        let mut len = [0u8; 4];
        if avail.0 >= 4 {
            // Buffered: completes at once.
            if rd.read_exact(&mut len).await.is_err() {
                break "closed";
            }
        } else {
            match tokio::time::timeout(lease, rd.read_exact(&mut len)).await {
                Ok(Ok(_)) => {}
                _ => break "truncated frame",
            }
        }
        let n = u32::from_le_bytes(len) as usize;
        out.clear();
        if n > MAX_FRAME {
            // The stream cannot be followed past this: answer and close.
            state.metrics.malformed();
            encode_err(
                0,
                &Error::Protocol(proto::ProtoError::TooLong(n).to_string()),
                &mut out,
            );
            let _ = wr.write_all(&out).await;
            let _ = wr.flush().await;
            break "oversized frame";
        }
        // A stream_put: answered before its bytes are read.
        let streamed = (n >= proto::STREAM_PUT_HEAD && !over_cap)
            .then(|| rd.buffer().get(..proto::STREAM_PUT_HEAD))
            .flatten()
            .and_then(proto::stream_put_head);
        if let Some((id, ttl_ms)) = streamed {
            rd.consume(proto::STREAM_PUT_HEAD);
            let t = Instant::now();
            let len = (n - proto::STREAM_PUT_HEAD) as u64;
            match stream_put(
                &state, &space, &mut rd, &mut wr, id, ttl_ms, len, lease, &mut out,
            )
            .await
            {
                Ok(ok) => {
                    state.metrics.request(
                        sid as usize,
                        proto::op_code::STREAM_PUT,
                        t.elapsed(),
                        ok,
                    );
                    continue;
                }
                Err(why) => break why,
            }
        }
        // A long write: received straight into the buffer's pages.
        let in_place = (n >= proto::WRITE_HEAD + WRITE_IN_PLACE_MIN && !over_cap)
            .then(|| rd.buffer().get(..proto::WRITE_HEAD))
            .flatten()
            .and_then(proto::write_head);
        if let Some((id, addr, offset)) = in_place {
            rd.consume(proto::WRITE_HEAD);
            let t = Instant::now();
            let len = (n - proto::WRITE_HEAD) as u64;
            match write_in_place(
                &state, &space, &mut rd, id, addr, offset, len, lease, &mut out,
            )
            .await
            {
                Ok(ok) => {
                    state
                        .metrics
                        .request(sid as usize, proto::op_code::WRITE, t.elapsed(), ok);
                    if write_within(&mut wr, &out, true, lease).await.is_err() {
                        break "write failed or not read";
                    }
                    continue;
                }
                Err(why) => break why,
            }
        }
        let whole = avail.1 == Some(n) && avail.0 >= 4 + n;
        if whole {
            // The buffer only grows (zero-filled then, once): a large
            // write after small requests does not zero it again.
            if frame.len() < n {
                frame.resize(n, 0);
            }
            if rd.read_exact(&mut frame[..n]).await.is_err() {
                break "truncated frame";
            }
        } else if read_slowly(&mut rd, &mut frame, n, lease).await.is_err() {
            break "truncated frame";
        }
        let frame = &frame[..n];
        let t = Instant::now();
        let decoded = Request::decode(frame);
        // A read or map of a Ref whose bytes are still arriving waits for
        // them (or fails, if they stopped short).
        if let Ok((id, req)) = &decoded {
            if let Some((fill, end)) = state.fill_to_wait(&space, req) {
                let w = tokio::time::timeout(lease, fill.wait(end))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::Unavailable(
                            "a Ref's bytes did not arrive in time".into(),
                        ))
                    });
                if let Err(e) = w {
                    encode_err(*id, &e, &mut out);
                    state
                        .metrics
                        .request(sid as usize, req.op(), t.elapsed(), false);
                    if write_within(&mut wr, &out, true, lease).await.is_err() {
                        break "write failed or not read";
                    }
                    continue;
                }
            }
        }
        let (op, ok) = match decoded {
            Ok((id, req)) if answered_in_place(&req) => {
                let op = req.op();
                match state.read_pinned(&space, id, &req, &mut out) {
                    Some(body) => {
                        let w =
                            write_pinned(&mut wr, &state.pages, &space, &out, body, lease).await;
                        state.metrics.request(sid as usize, op, t.elapsed(), true);
                        if w.is_err() {
                            break "write failed";
                        }
                        continue;
                    }
                    None => (op, state.serve(&space, id, req, &mut out)),
                }
            }
            Ok((id, _)) if over_cap => {
                // One session too many: its first request says so, and the
                // connection closes.
                let e = Error::ResourceExhausted {
                    what: "memory-server sessions",
                };
                encode_err(id, &e, &mut out);
                let _ = wr.write_all(&out).await;
                let _ = wr.flush().await;
                break "one session too many";
            }
            Ok((id, req)) => {
                if let Request::Hello { lease_ms, .. } = req {
                    lease = Duration::from_millis(lease_ms.clamp(100, 3_600_000) as u64);
                    tick = tokio::time::interval(lease / 10);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                }
                let op = req.op();
                // Page copies can take a while: large ones off the I/O
                // workers. (Small ones here: no shared counter touched.)
                let ok = if matches!(req, Request::Read { len, .. } | Request::ReadRef { len, .. } if len > 1 << 20)
                    || matches!(&req, Request::Write { data, .. } | Request::Put { data, .. } | Request::StreamPut { data, .. } if data.len() > 1 << 20)
                {
                    let (st, sp) = (state.clone(), space.clone());
                    let req = req.into_owned();
                    let mut o = std::mem::take(&mut out);
                    match tokio::task::spawn_blocking(move || {
                        let ok = st.serve(&sp, id, req, &mut o);
                        (ok, o)
                    })
                    .await
                    {
                        Ok((ok, o)) => {
                            out = o;
                            ok
                        }
                        Err(_) => break "request panicked",
                    }
                } else {
                    state.serve(&space, id, req, &mut out)
                };
                (op, ok)
            }
            Err((id, e)) => {
                state.metrics.malformed();
                tracing::warn!(session = sid, %peer, error = %e, "malformed request");
                encode_err(id.unwrap_or(0), &Error::Protocol(e.to_string()), &mut out);
                (0, false)
            }
        };
        state.metrics.request(sid as usize, op, t.elapsed(), ok);
        let flush = rd.buffer().is_empty();
        if write_within(&mut wr, &out, flush, lease).await.is_err() {
            break "write failed or not read";
        }
    };
    polled.remove(fd);
    state.close_session(sid, &space);
    tracing::debug!(session = sid, %peer, why, "session closed");
}

/// Reads a frame of `n` bytes that has not arrived whole into `frame`,
/// growing the buffer as bytes come (by at most 1 MiB ahead of them: an
/// announced length costs memory only once it is sent), all of it within
/// `within` (a client that sends a frame slowly is dropped).
async fn read_slowly(
    rd: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    frame: &mut Vec<u8>,
    n: usize,
    within: Duration,
) -> std::result::Result<(), ()> {
    let deadline = tokio::time::Instant::now() + within;
    let mut got = 0;
    while got < n {
        let upto = n.min(got + (1 << 20));
        if frame.len() < upto {
            frame.resize(upto, 0);
        }
        match tokio::time::timeout_at(deadline, rd.read(&mut frame[got..upto])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(()),
            Ok(Ok(k)) => got += k,
        }
    }
    Ok(())
}

/// Writes `bytes` (and flushes, if `flush`) within `within`: a client that
/// reads no answers is dropped, not waited for.
async fn write_within(
    wr: &mut BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    bytes: &[u8],
    flush: bool,
    within: Duration,
) -> std::io::Result<()> {
    let w = async {
        wr.write_all(bytes).await?;
        if flush {
            wr.flush().await?;
        }
        Ok(())
    };
    tokio::time::timeout(within, w)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// Answers every HTTP request on `l` with the metrics.
async fn serve_metrics(state: Arc<State>, l: TcpListener, mut stop: watch::Receiver<bool>) {
    loop {
        let (mut s, _) = tokio::select! {
            r = l.accept() => match r { Ok(x) => x, Err(_) => continue },
            _ = stop.changed() => return,
        };
        let st = state.clone();
        tokio::spawn(async move {
            let mut req = vec![0u8; 8192];
            let mut n = 0;
            while n < req.len() {
                match tokio::time::timeout(Duration::from_secs(5), s.read(&mut req[n..])).await {
                    Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return,
                    Ok(Ok(k)) => n += k,
                }
                if req[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let body = st.render_metrics();
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(body.as_bytes()).await;
            let _ = s.shutdown().await;
        });
    }
}

/// A running server (in its own threads).
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    state: Arc<State>,
    stop: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
}

impl Server {
    /// Pins the region, binds, and starts serving.
    pub fn start(cfg: Config) -> Result<Server> {
        if cfg.key.is_none() && !cfg.open && !dm_pool::auth::is_loopback(&cfg.listen) {
            return Err(Error::InvalidConfig(format!(
                "listening on {} without a key would let any host that reaches the port \
                 allocate memory and read every Ref it learns: give a key (`--key-file FILE`; \
                 `dmrpc key new FILE` makes one, and clients use the same file), or say \
                 `--open` to serve anyone",
                cfg.listen
            )));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let listener = rt.block_on(TcpListener::bind(&cfg.listen))?;
        let addr = listener.local_addr()?;
        let metrics = match &cfg.metrics {
            Some(a) => Some(rt.block_on(TcpListener::bind(a))?),
            None => None,
        };
        let metrics_addr = metrics.as_ref().and_then(|l| l.local_addr().ok());
        let nworkers = cfg.threads.max(1);
        let cfg_spin = cfg.spin;
        let state = Arc::new(State::new(cfg)?);
        if !state.pages.locked() {
            tracing::warn!("could not lock the region in RAM (RLIMIT_MEMLOCK); it is populated but may be swapped");
        }
        let (stop, stop_rx) = watch::channel(false);
        let mut threads = Vec::new();
        // Workers: one single-threaded runtime each (thread per core, as an
        // event loop like Redis's): a session lives on one worker, so
        // serving it never hands work between threads.
        let mut to_workers = Vec::new();
        for k in 0..nworkers {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<std::net::TcpStream>();
            to_workers.push(tx);
            let polled = Arc::new(IdlePoll::new(cfg_spin)?);
            let wrt = polling_runtime(polled.clone())?;
            let st = state.clone();
            let mut stop_w = stop_rx.clone();
            let stop_s = stop_rx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("dm-memserver-{k}"))
                    .spawn(move || {
                        wrt.block_on(async move {
                            let mut tasks = tokio::task::JoinSet::new();
                            loop {
                                tokio::select! {
                                    c = rx.recv() => match c {
                                        Some(c) => {
                                            if let Ok(c) = TcpStream::from_std(c) {
                                                tasks.spawn(session(
                                                    st.clone(),
                                                    c,
                                                    stop_s.clone(),
                                                    polled.clone(),
                                                ));
                                            }
                                        }
                                        None => break,
                                    },
                                    _ = stop_w.changed() => break,
                                }
                                while tasks.try_join_next().is_some() {}
                            }
                            // Sessions see the stop and release their holdings.
                            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                                while tasks.join_next().await.is_some() {}
                            })
                            .await;
                        });
                        wrt.shutdown_timeout(Duration::from_secs(1));
                    })?,
            );
        }
        let st = state.clone();
        threads.push(
            std::thread::Builder::new()
                .name("dm-memserver-accept".into())
                .spawn(move || {
                    rt.block_on(async move {
                        if let Some(l) = metrics {
                            tokio::spawn(serve_metrics(st.clone(), l, stop_rx.clone()));
                        }
                        let sw = st.clone();
                        let mut sw_stop = stop_rx.clone();
                        tokio::spawn(async move {
                            let mut tick = tokio::time::interval(sw.cfg.sweep_every);
                            loop {
                                tokio::select! {
                                    _ = tick.tick() => { sw.maintain(); }
                                    _ = sw_stop.changed() => return,
                                }
                            }
                        });
                        let mut stop_accept = stop_rx.clone();
                        let mut next = 0usize;
                        loop {
                            tokio::select! {
                                r = listener.accept() => {
                                    if let Ok(c) = r.and_then(|(s, _)| s.into_std()) {
                                        let _ = to_workers[next % to_workers.len()].send(c);
                                        next += 1;
                                    }
                                }
                                _ = stop_accept.changed() => break,
                            }
                        }
                    });
                    rt.shutdown_timeout(Duration::from_secs(1));
                })?,
        );
        tracing::info!(%addr, id = state.id, workers = nworkers, "memory server listening");
        Ok(Server {
            addr,
            metrics_addr,
            state,
            stop,
            threads,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The metrics endpoint's address.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The server's state (counts, check, metrics).
    pub fn state(&self) -> &Arc<State> {
        &self.state
    }

    /// Stops: closes every session (releasing its buffers) and joins.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let _ = self.stop.send(true);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Runs a server until SIGTERM or SIGINT, then shuts it down cleanly.
pub fn run(cfg: Config, on_ready: impl FnOnce(&Server)) -> Result<()> {
    let server = Server::start(cfg)?;
    on_ready(&server);
    wait_for_stop_signal()?;
    tracing::info!("shutting down");
    server.shutdown();
    Ok(())
}

/// Waits for SIGTERM or SIGINT.
pub fn wait_for_stop_signal() -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok(())
    })
}

/// The fuzz target `memserver_serve`: `data` read as a stream of request
/// frames and served, in order, by one session of a small server (a Ref
/// whose tag is zero stands for the last Ref the session created, so
/// mapping and releasing get past the capability check); then the session
/// ends, every Ref is dropped, and the server must hold nothing and pass
/// its check; every read must show zeros wherever nothing was written
/// since the page was taken (a recycled page's old bytes would show).
/// Panics on a violated invariant.
/// What the fuzzed session's buffers and Refs must read as: every
/// successful request applied to plain vectors (a buffer starts as zeros;
/// a Ref is a snapshot; a mapping starts as its Ref's snapshot).
#[derive(Default)]
struct Model {
    bufs: std::collections::BTreeMap<u64, Vec<u8>>,
    snaps: HashMap<dm_pool::Ref, Vec<u8>>,
}

/// A request, as the model needs it after the server took it.
enum Op {
    Alloc(u64),
    Free(u64),
    Read(u64, u64),
    Write(u64, u64, Vec<u8>),
    Share(u64, u64, u64),
    Put(Vec<u8>),
    Map(dm_pool::Ref),
    Release(dm_pool::Ref),
    ReadRef(dm_pool::Ref, u64),
    Other,
}

impl Model {
    /// The buffer holding `addr` (any address inside it, as the server
    /// takes), and `addr + off` as an offset into it.
    fn at(&mut self, addr: u64, off: u64) -> Option<(&mut Vec<u8>, u64)> {
        let (&base, v) = self.bufs.range_mut(..=addr).next_back()?;
        ((addr - base) < v.len() as u64).then_some((v, addr - base + off))
    }

    fn op(req: &Request<'_>) -> Op {
        match req {
            Request::Alloc { len } => Op::Alloc(*len),
            Request::Free { addr } => Op::Free(*addr),
            Request::Read { addr, offset, .. } => Op::Read(*addr, *offset),
            Request::Write { addr, offset, data } => Op::Write(*addr, *offset, data.to_vec()),
            Request::CreateRef {
                addr, offset, len, ..
            } => Op::Share(*addr, *offset, *len),
            Request::Put { data, .. } | Request::StreamPut { data, .. } => Op::Put(data.to_vec()),
            Request::MapRef(r) => Op::Map(*r),
            Request::ReleaseRef(r) => Op::Release(*r),
            Request::ReadRef { r, offset, .. } => Op::ReadRef(*r, *offset),
            _ => Op::Other,
        }
    }

    /// Applies a request that succeeded with answer `body`, checking what
    /// reads return.
    fn apply(&mut self, op: Op, body: &[u8]) {
        let word = |i: usize| {
            let b: [u8; 8] = body
                .get(8 * i..8 * i + 8)
                .and_then(|b| b.try_into().ok())
                .expect("a numeric answer");
            u64::from_le_bytes(b)
        };
        let range = |v: &[u8], off: u64, len: usize| -> Vec<u8> {
            v.get(off as usize..off as usize + len)
                .expect("a successful read lies inside what the model holds")
                .to_vec()
        };
        match op {
            Op::Alloc(len) => {
                self.bufs.insert(word(0), vec![0; len as usize]);
            }
            Op::Free(addr) => {
                self.bufs.remove(&addr);
            }
            Op::Write(addr, off, data) => {
                if let Some((v, at)) = self.at(addr, off) {
                    v[at as usize..at as usize + data.len()].copy_from_slice(&data);
                }
            }
            Op::Read(addr, off) => {
                if let Some((v, at)) = self.at(addr, off) {
                    assert_eq!(body, range(v, at, body.len()), "read of {addr:#x}+{off}");
                }
            }
            Op::Share(addr, off, len) => {
                let r = proto::decode_ref(body).expect("a Ref");
                if let Some((v, at)) = self.at(addr, off) {
                    let snap = range(v, at, len as usize);
                    self.snaps.insert(r, snap);
                }
            }
            Op::Put(data) => {
                self.snaps
                    .insert(proto::decode_ref(body).expect("a Ref"), data);
            }
            Op::Map(r) => {
                if let Some(v) = self.snaps.get(&r) {
                    self.bufs.insert(word(0), v.clone());
                }
            }
            Op::Release(r) => {
                self.snaps.remove(&r);
            }
            Op::ReadRef(r, off) => {
                if let Some(v) = self.snaps.get(&r) {
                    assert_eq!(body, range(v, off, body.len()), "read of a Ref at {off}");
                }
            }
            Op::Other => {}
        }
    }
}

#[doc(hidden)]
pub fn fuzz_serve(data: &[u8]) {
    thread_local! {
        static STATE: State = State::new(Config {
            size: 64 * 4096,
            threads: 1,
            max_refs: Some(32),
            max_buffers: 64,
            ..Default::default()
        })
        .expect("a small server");
    }
    STATE.with(|st| {
        let (sid, space) = st.open_session(true);
        let mut last = None;
        let mut out = Vec::new();
        let mut model = Model::default();
        let mut rest = data;
        while rest.len() >= 4 {
            let n = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            let body = &rest[4..];
            let frame = &body[..n.min(body.len())];
            rest = &body[frame.len()..];
            let Ok((id, mut req)) = Request::decode(frame) else {
                continue;
            };
            if let Request::MapRef(r) | Request::ReleaseRef(r) | Request::ReadRef { r, .. } =
                &mut req
            {
                if let (0, Some(l)) = (r.tag, last) {
                    *r = l;
                }
            }
            // The whole-server operations are exercised by the check below.
            if matches!(req, Request::Check | Request::Hello { .. }) {
                continue;
            }
            out.clear();
            let was_ref = matches!(
                req,
                Request::CreateRef { .. } | Request::Put { .. } | Request::StreamPut { .. }
            );
            let op = Model::op(&req);
            let ok = st.serve(&space, id, req, &mut out);
            let (aid, a) = proto::decode_answer(&out[4..]).expect("the server's answers decode");
            assert_eq!(aid, id);
            assert_eq!(a.is_ok(), ok);
            if let Ok(body) = a {
                model.apply(op, body);
            }
            if was_ref && ok {
                last = a.ok().and_then(|b| proto::decode_ref(b).ok());
            }
        }
        st.close_session(sid, &space);
        st.refs.clear(&st.pages);
        let problems = st.check();
        assert!(problems.is_empty(), "{problems:#?}");
        assert_eq!(st.usage().pages_held, 0, "pages left held");
    });
}
