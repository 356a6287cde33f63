//! The in-memory transport: bounded queues between threads of one process,
//! with the same semantics as the others (back-pressure, `Unavailable`
//! when the other end is dropped). Services bound on it are found by name
//! in a process-wide table, not in the pool's registry.

use super::{
    ConnId, Connection, FrameRx, FrameTx, GoAway, GoAwayWord, Listener, TransportError, Waker,
};
use crate::frame::Frame;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Frames a queue holds before its sender waits.
pub(crate) const QUEUE_DEPTH: usize = 256;
/// Largest inline payload (about what a default 256 KiB ring carries).
pub const MAX_INLINE: usize = 128 << 10;

enum Event {
    Open(ConnId, SyncSender<Frame>, Arc<MemGoAway>),
    Frame(ConnId, Frame),
    Close(ConnId),
    Wake,
}

/// A service bound in this process: its binding (a number no other
/// binding of this process gets, so a client can tell a service bound
/// again from the one it lost), its queue, whether it is one replica of
/// its name, and a weak handle on its listener's life.
struct Bound {
    binding: u64,
    tx: SyncSender<Event>,
    replica: bool,
    alive: Weak<()>,
}

/// The services bound in this process, by name: one, or several replicas.
type Table = HashMap<String, Vec<Bound>>;

fn table() -> &'static Mutex<Table> {
    static T: OnceLock<Mutex<Table>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lock_table() -> std::sync::MutexGuard<'static, Table> {
    crate::sync::lock(table())
}

static IDS: AtomicU64 = AtomicU64::new(1);

/// A client's connection, as its listener holds it.
#[derive(Debug)]
struct MemConn {
    answers: SyncSender<Frame>,
    /// The highest call id of the requests taken, said in `goaway` when
    /// the server stops.
    taken: u64,
    goaway: Arc<MemGoAway>,
}

/// What a connection's listener says when it stops, and whether it ever
/// let the connection in: a listener gone without letting it in took
/// nothing from it (it drops the frames of connections it does not know).
#[derive(Debug)]
struct MemGoAway {
    word: GoAwayWord,
    opened: AtomicBool,
    listener: Weak<()>,
}

impl GoAway for MemGoAway {
    fn unread(&self, id: u64) -> bool {
        if self.word.unread(id) {
            return true;
        }
        if self.listener.strong_count() > 0 {
            return false;
        }
        // (Pairs with the release of the listener's last reference: what
        // it did before it went is seen.)
        std::sync::atomic::fence(Ordering::Acquire);
        !self.opened.load(Ordering::Acquire)
    }
}

/// A service bound on the in-memory transport.
#[derive(Debug)]
pub struct MemListener {
    /// Dropped with the listener, first (before the queue and the answer
    /// senders whose loss its clients see): a client that finds its
    /// connection gone then knows whether it was ever let in
    /// ([`MemGoAway`]).
    _alive: Arc<()>,
    name: String,
    rx: Receiver<Event>,
    tx: SyncSender<Event>,
    conns: HashMap<ConnId, MemConn>,
    stop: Arc<AtomicBool>,
    /// Its binding ([`binding`]).
    binding: u64,
}

/// Binds `name` in this process. `None` if it is taken.
pub fn bind(name: &str, stop: Arc<AtomicBool>) -> Option<MemListener> {
    bind_as(name, stop, false)
}

/// Binds one replica of `name` in this process: a name may have any
/// number of replicas ([`bindings`]). `None` if it is bound otherwise.
pub(crate) fn bind_replica(name: &str, stop: Arc<AtomicBool>) -> Option<MemListener> {
    bind_as(name, stop, true)
}

fn bind_as(name: &str, stop: Arc<AtomicBool>, replica: bool) -> Option<MemListener> {
    let mut t = lock_table();
    let bound = t.entry(name.to_owned()).or_default();
    if bound.iter().any(|b| !(replica && b.replica)) {
        return None;
    }
    let (tx, rx) = sync_channel(QUEUE_DEPTH);
    let binding = IDS.fetch_add(1, Ordering::Relaxed);
    let alive = Arc::new(());
    bound.push(Bound {
        binding,
        tx: tx.clone(),
        replica,
        alive: Arc::downgrade(&alive),
    });
    Some(MemListener {
        name: name.to_owned(),
        rx,
        tx,
        conns: HashMap::new(),
        stop,
        binding,
        _alive: alive,
    })
}

impl MemListener {
    /// Its binding: the number [`binding`] (or [`bindings`]) gives for
    /// its name while it holds the name.
    pub fn binding(&self) -> u64 {
        self.binding
    }

    /// Queues `f` for connection `conn`'s client, waiting for room until
    /// `until` (then `Ok(false)`); a client gone loses its connection.
    fn push(&mut self, conn: ConnId, f: &Frame, until: Instant) -> Result<bool, TransportError> {
        check_size(f)?;
        let Some(tx) = self.conns.get(&conn).map(|c| &c.answers) else {
            return Err(TransportError::Unavailable(format!(
                "connection {conn} is gone"
            )));
        };
        let r = send_bounded(tx, f.clone(), Some(until), || Ok(()));
        if r.is_err() {
            self.conns.remove(&conn);
        }
        r
    }
}

/// Removes `name`'s binding `binding` if it is still there (a listener
/// that stopped does not unbind its successor, nor the other replicas);
/// connections already open go on, new ones are refused.
pub(crate) fn unbind(name: &str, binding: u64) {
    let mut t = lock_table();
    if let Some(bound) = t.get_mut(name) {
        bound.retain(|b| b.binding != binding);
        if bound.is_empty() {
            t.remove(name);
        }
    }
}

/// Every binding of `name` in this process (its replicas, or its one
/// binding), in the order they were bound.
pub(crate) fn bindings(name: &str) -> Vec<u64> {
    lock_table()
        .get(name)
        .map(|bound| bound.iter().map(|b| b.binding).collect())
        .unwrap_or_default()
}

impl Drop for MemListener {
    fn drop(&mut self) {
        unbind(&self.name, self.binding);
    }
}

struct MemTx {
    id: ConnId,
    tx: SyncSender<Event>,
}

struct MemRx {
    rx: Receiver<Frame>,
}

impl Drop for MemTx {
    fn drop(&mut self) {
        let _ = self.tx.try_send(Event::Close(self.id));
    }
}

/// Connects to `name` in this process.
pub fn connect(name: &str) -> Result<Connection, TransportError> {
    connect_to(name, None)
}

/// Connects to `name` in this process if it is still bound as `binding`
/// ([`binding`], [`bindings`]; None: its first binding).
pub(crate) fn connect_to(name: &str, binding: Option<u64>) -> Result<Connection, TransportError> {
    let (tx, alive) = lock_table()
        .get(name)
        .and_then(|bound| {
            bound
                .iter()
                .find(|b| binding.is_none_or(|want| want == b.binding))
        })
        .map(|b| (b.tx.clone(), b.alive.clone()))
        .ok_or_else(|| TransportError::Unavailable(format!("no in-process service {name:?}")))?;
    let id = IDS.fetch_add(1, Ordering::Relaxed);
    let (rtx, rrx) = sync_channel(QUEUE_DEPTH);
    let goaway = Arc::new(MemGoAway {
        word: GoAwayWord::default(),
        opened: AtomicBool::new(false),
        listener: alive,
    });
    tx.send(Event::Open(id, rtx, goaway.clone()))
        .map_err(|_| TransportError::Unavailable(format!("service {name:?} is gone")))?;
    Ok(Connection {
        tx: Box::new(MemTx { id, tx }),
        rx: Box::new(MemRx { rx: rrx }),
        max_inline: MAX_INLINE,
        refs: super::Sharing::ALL,
        goaway,
    })
}

/// Sends with back-pressure: waits for room until `deadline`, running
/// `idle` before each pause.
fn send_bounded<T>(
    tx: &SyncSender<T>,
    mut v: T,
    deadline: Option<Instant>,
    mut idle: impl FnMut() -> Result<(), TransportError>,
) -> Result<bool, TransportError> {
    loop {
        match tx.try_send(v) {
            Ok(()) => return Ok(true),
            Err(TrySendError::Disconnected(_)) => {
                return Err(TransportError::Unavailable("the other end is gone".into()))
            }
            Err(TrySendError::Full(back)) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(false);
                }
                v = back;
                idle()?;
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

fn check_size(f: &Frame) -> Result<(), TransportError> {
    let len = f.encoded_len();
    if len > MAX_INLINE + crate::frame::HEADER_LEN {
        return Err(TransportError::TooLarge {
            len,
            max: MAX_INLINE + crate::frame::HEADER_LEN,
        });
    }
    Ok(())
}

impl FrameTx for MemTx {
    fn send(&mut self, f: &Frame, deadline: Option<Instant>) -> Result<bool, TransportError> {
        check_size(f)?;
        send_bounded(&self.tx, Event::Frame(self.id, f.clone()), deadline, || {
            Ok(())
        })
    }

    fn send_reading(
        &mut self,
        f: &Frame,
        deadline: Option<Instant>,
        rx: &mut dyn FrameRx,
        got: &mut dyn FnMut(Frame),
    ) -> Result<bool, TransportError> {
        check_size(f)?;
        let v = Event::Frame(self.id, f.clone());
        send_bounded(&self.tx, v, deadline, || super::drain(rx, got))
    }

    fn room_needs_reader(&self) -> bool {
        true
    }
}

impl FrameRx for MemRx {
    fn recv(&mut self, deadline: Option<Instant>) -> Result<Option<Frame>, TransportError> {
        let r = match deadline {
            None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => self
                .rx
                .recv_timeout(d.saturating_duration_since(Instant::now())),
        };
        match r {
            Ok(f) => Ok(Some(f)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(TransportError::Unavailable(
                "the service closed the connection".into(),
            )),
        }
    }
}

impl Listener for MemListener {
    fn next(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Option<(ConnId, Frame)>, TransportError> {
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(None);
            }
            let ev = match deadline {
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => self
                    .rx
                    .recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            match ev {
                Ok(Event::Open(id, answers, goaway)) => {
                    goaway.opened.store(true, Ordering::Release);
                    let c = MemConn {
                        answers,
                        taken: 0,
                        goaway,
                    };
                    self.conns.insert(id, c);
                }
                Ok(Event::Frame(id, f)) => {
                    let Some(c) = self.conns.get_mut(&id) else {
                        continue;
                    };
                    if f.kind == crate::frame::Kind::Request {
                        c.taken = c.taken.max(f.call_id);
                    }
                    return Ok(Some((id, f)));
                }
                Ok(Event::Wake) => return Ok(None),
                Ok(Event::Close(id)) => {
                    self.conns.remove(&id);
                }
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                // We hold a sender ourselves, so this cannot happen.
                Err(RecvTimeoutError::Disconnected) => return Ok(None),
            }
        }
    }

    fn reply(&mut self, conn: ConnId, f: &Frame) -> Result<(), TransportError> {
        // A client that does not read its answers for a second loses its
        // connection rather than stalling the server.
        if self.push(conn, f, Instant::now() + Duration::from_secs(1))? {
            return Ok(());
        }
        self.conns.remove(&conn);
        Err(TransportError::Unavailable(format!(
            "connection {conn} does not read its answers"
        )))
    }

    /// Queues the item only if its client's queue has room now.
    fn send_item(&mut self, conn: ConnId, f: &Frame) -> Result<bool, TransportError> {
        self.push(conn, f, Instant::now())
    }

    fn is_open(&self, conn: ConnId) -> bool {
        self.conns.contains_key(&conn)
    }

    fn max_inline(&self) -> usize {
        MAX_INLINE
    }

    fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Says each connection's go-away; the queue, with the frames nobody
    /// took, goes with the listener (and with it the connections never let
    /// in, whose clients know that nothing of theirs was taken).
    fn go_away(&mut self) {
        for c in self.conns.values() {
            c.goaway.word.say(c.taken);
        }
    }

    fn waker(&self) -> Waker {
        let tx = self.tx.clone();
        Waker(Arc::new(move || {
            let _ = tx.try_send(Event::Wake);
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::frame::Body;

    /// A listener that stops before it lets a connection in (its `Open`
    /// still queued) took none of its requests, and its client knows.
    #[test]
    fn a_connection_never_let_in_knows_nothing_was_taken() {
        let name = format!("test/mem/never/{}", std::process::id());
        let l = bind(&name, Arc::new(AtomicBool::new(false))).unwrap();
        let mut c = connect(&name).unwrap();
        let f = Frame::request(1, 1, 0, Body::Inline(vec![1].into()));
        assert!(c.tx.send(&f, None).unwrap());
        assert!(!c.goaway.unread(1), "not known while the listener lives");
        drop(l);
        assert!(c.rx.recv(None).is_err(), "the connection closed");
        assert!(c.goaway.unread(1), "never let in: not taken");
        // Let in, then gone without a word: nobody knows.
        let mut l = bind(&name, Arc::new(AtomicBool::new(false))).unwrap();
        let mut c = connect(&name).unwrap();
        assert!(c.tx.send(&f, None).unwrap());
        let soon = Some(Instant::now() + Duration::from_secs(5));
        assert_eq!(l.next(soon).unwrap().unwrap().1.call_id, 1);
        drop(l);
        assert!(c.rx.recv(None).is_err());
        assert!(!c.goaway.unread(1) && !c.goaway.unread(2));
    }
}
