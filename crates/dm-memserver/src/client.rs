//! The memory-server client: one or several servers as one pool, behind
//! the same DM contract ([`dm_pool::Dm`]) as the shared pool.
//!
//! Each server gets one TCP connection with a reader thread that hands
//! every answer to the caller waiting for its id, so any number of
//! requests are in flight at once (pipelining): a large read or write is
//! cut into chunks sent back to back. Allocations go to the servers round
//! robin; a Ref names its server (by id), and any client connected to that
//! server can map it. A keep-alive thread pings each server well within
//! the session's lease. A server that dies or drops the connection turns
//! every pending and later request on it into `Unavailable`, never a hang
//! (requests also time out).

use crate::proto::{self, Request, MAX_FRAME};
use dm_pool::{contract::Usage, refs::BACKEND_MEMSERVER, Dm, DmBuffer, Error, Ref, Result};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Bytes per write request when a large write is cut into pipelined chunks.
pub const WRITE_CHUNK: usize = 1 << 20;
/// Bytes per read request, likewise.
pub const READ_CHUNK: usize = 4 << 20;

/// How a client connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The session lease the servers enforce (pings go every third of it).
    pub lease: Duration,
    /// A request without an answer after this fails with `Unavailable`.
    pub timeout: Duration,
    /// Time to connect to each server.
    pub connect_timeout: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            lease: Duration::from_secs(10),
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

type Answer = Result<Vec<u8>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One server's connection.
#[derive(Debug)]
struct Conn {
    addr: String,
    server_id: u64,
    page_size: u32,
    max_len: u64,
    out: Mutex<TcpStream>,
    waiting: Arc<Mutex<Waiting>>,
    next_id: AtomicU64,
}

#[derive(Debug, Default)]
struct Waiting {
    by_id: HashMap<u64, SyncSender<Answer>>,
    /// Why the connection is gone, once it is.
    dead: Option<String>,
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
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        let w = waiting.clone();
        let name = addr.to_owned();
        std::thread::Builder::new()
            .name("dm-memclient-rx".into())
            .spawn(move || reader(rd, w, name))
            .map_err(unavailable)?;
        let mut c = Conn {
            addr: addr.to_owned(),
            server_id: 0,
            page_size: 0,
            max_len: 0,
            out: Mutex::new(s),
            waiting,
            next_id: AtomicU64::new(1),
        };
        let lease_ms = cfg.lease.as_millis().min(u32::MAX as u128) as u32;
        let body = c.call(&Request::Hello { lease_ms }, cfg.timeout)?;
        let (id, ps, max) =
            proto::decode_hello(&body).map_err(|e| Error::Protocol(e.to_string()))?;
        c.server_id = id;
        c.page_size = ps;
        c.max_len = max;
        Ok(c)
    }

    /// Sends `reqs` back to back and waits for all their answers.
    fn call_many(&self, reqs: &[Request], timeout: Duration) -> Vec<Answer> {
        let mut rx: Vec<Receiver<Answer>> = Vec::with_capacity(reqs.len());
        let mut bytes = Vec::new();
        let mut ids = Vec::with_capacity(reqs.len());
        {
            let mut w = lock(&self.waiting);
            if let Some(why) = &w.dead {
                let e = Error::Unavailable(format!("{}: {why}", self.addr));
                return reqs.iter().map(|_| Err(clone_err(&e))).collect();
            }
            for r in reqs {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let (tx, rx1) = sync_channel(1);
                w.by_id.insert(id, tx);
                rx.push(rx1);
                ids.push(id);
                r.encode(id, &mut bytes);
            }
        }
        let sent = lock(&self.out).write_all(&bytes);
        if let Err(e) = sent {
            let mut w = lock(&self.waiting);
            for id in &ids {
                w.by_id.remove(id);
            }
            let e = Error::Unavailable(format!("{}: {e}", self.addr));
            return reqs.iter().map(|_| Err(clone_err(&e))).collect();
        }
        rx.into_iter()
            .zip(ids)
            .map(|(r, id)| match r.recv_timeout(timeout) {
                Ok(a) => a,
                Err(_) => {
                    lock(&self.waiting).by_id.remove(&id);
                    Err(Error::Unavailable(format!(
                        "{}: no answer within {timeout:?}",
                        self.addr
                    )))
                }
            })
            .collect()
    }

    fn call(&self, req: &Request, timeout: Duration) -> Answer {
        self.call_many(std::slice::from_ref(req), timeout)
            .pop()
            .unwrap_or_else(|| Err(Error::Corrupt("no answer".into())))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Ends the reader thread (and the server's session).
        let _ = lock(&self.out).shutdown(Shutdown::Both);
    }
}

/// Errors are not `Clone` (they may carry an `io::Error`); the ones a
/// connection reports to many callers are strings.
fn clone_err(e: &Error) -> Error {
    match e {
        Error::Unavailable(m) => Error::Unavailable(m.clone()),
        other => Error::Unavailable(other.to_string()),
    }
}

/// Reads answers and hands each to its caller; on EOF or garbage, fails
/// every waiting caller and marks the connection dead.
fn reader(mut s: TcpStream, waiting: Arc<Mutex<Waiting>>, addr: String) {
    let mut frame = Vec::new();
    let why = loop {
        let mut len = [0u8; 4];
        if let Err(e) = s.read_exact(&mut len) {
            break format!("connection lost ({e})");
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_FRAME {
            break format!("answer of {n} bytes exceeds the maximum");
        }
        frame.resize(n, 0);
        if let Err(e) = s.read_exact(&mut frame) {
            break format!("connection lost ({e})");
        }
        match proto::decode_answer(&frame) {
            Ok((id, a)) => {
                let tx = lock(&waiting).by_id.remove(&id);
                if let Some(tx) = tx {
                    let _ = tx.send(a.map(<[u8]>::to_vec));
                }
            }
            Err(e) => break format!("malformed answer: {e}"),
        }
    };
    let _ = s.shutdown(Shutdown::Both);
    let mut w = lock(&waiting);
    for (_, tx) in w.by_id.drain() {
        let _ = tx.send(Err(Error::Unavailable(format!("{addr}: {why}"))));
    }
    w.dead = Some(why);
}

#[derive(Debug)]
struct Inner {
    conns: Vec<Conn>,
    cfg: ClientConfig,
    next: AtomicUsize,
    closed: AtomicBool,
}

impl Inner {
    fn conn_of(&self, r: &Ref) -> Result<&Conn> {
        if r.backend != BACKEND_MEMSERVER {
            return Err(Error::ForeignPool {
                expected: self.conns[0].server_id,
                found: r.pool_id,
            });
        }
        self.conns
            .iter()
            .find(|c| c.server_id == r.pool_id)
            .ok_or(Error::ForeignPool {
                expected: self.conns[0].server_id,
                found: r.pool_id,
            })
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
        let inner = Arc::new(Inner {
            conns,
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
        })
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
                let id = c.next_id.fetch_add(1, Ordering::Relaxed);
                let mut b = Vec::new();
                Request::Ping.encode(id, &mut b);
                let _ = lock(&c.out).write_all(&b);
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

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(e) if e <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
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
        let reqs: Vec<Request> = (0..out.len())
            .step_by(READ_CHUNK)
            .map(|at| Request::Read {
                addr: self.addr,
                offset: offset + at as u64,
                len: READ_CHUNK.min(out.len() - at) as u32,
            })
            .collect();
        let c = &self.inner.conns[self.server];
        let got = Self::all(c.call_many(&reqs, self.inner.cfg.timeout))?;
        let mut at = 0;
        for g in got {
            let end = at + g.len();
            if end > out.len() {
                return Err(Error::Protocol("a read answered too many bytes".into()));
            }
            out[at..end].copy_from_slice(&g);
            at = end;
        }
        if at != out.len() {
            return Err(Error::Protocol("a read answered too few bytes".into()));
        }
        Ok(())
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        let reqs: Vec<Request> = data
            .chunks(WRITE_CHUNK)
            .enumerate()
            .map(|(i, d)| Request::Write {
                addr: self.addr,
                offset: offset + (i * WRITE_CHUNK) as u64,
                data: d.to_vec(),
            })
            .collect();
        let c = &self.inner.conns[self.server];
        Self::all(c.call_many(&reqs, self.inner.cfg.timeout)).map(|_| ())
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
        let n = self.inner.conns.len();
        let k = self.inner.next.fetch_add(1, Ordering::Relaxed) % n;
        self.alloc_on(k, len)
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
        Ok(MemBuffer {
            inner: self.inner.clone(),
            server,
            addr,
            len,
            freed: false,
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
