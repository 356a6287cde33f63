//! A client connection's sending half, shared by the calls of both
//! clients, and the call ids of its requests.
//!
//! A request's call id is drawn when it enters the connection, under the
//! sending half's lock (`Sender::push`), so requests enter the
//! connection in the order of their ids. A server that stops says the
//! highest id it took ([`crate::transport::goaway`]), and its client reads
//! every higher id as never taken (sent again elsewhere, with no risk
//! that it runs twice): that reading holds only if no request with a
//! lower id can be behind a higher one in the connection. (With ids drawn
//! before the lock, a caller could draw id 5, be overtaken by the caller
//! that drew 6, and find its request, never taken, judged taken: a
//! spurious `Unavailable`.)
//!
//! A caller that does not read its own answer lists its call under the
//! id at that moment too, before its request can be answered: the
//! `Out::Listed` callback runs under the sending half's lock, before the
//! frame goes. A send that finds no room before its time slice ends sends
//! nothing and lets the lock go; its next try draws a new id, and the call
//! moves to it (ids are never used twice, so the old one is never
//! answered).
//!
//! The sending functions keep reading answers while they wait
//! (`send_holding_rx`, `send_unheld`): see [`crate::client`].

use crate::frame::Frame;
use crate::sync::lock;
use crate::transport::{FrameRx, FrameTx, TransportError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A connection's sending half, with the id of the next request.
pub(crate) struct Sender {
    tx: Box<dyn FrameTx>,
    /// The id the next request gets (ids start at 1: 0 is "none yet").
    next_id: u64,
}

/// A frame to send, and what the send does with its call id.
pub(crate) enum Out<'a> {
    /// A frame of a call already sent (a grant, a cancel): its id goes as
    /// it is.
    Kept(&'a Frame),
    /// A request whose caller reads its own answer (it holds the
    /// receiving half): it gets the connection's next id.
    Own(&'a mut Frame),
    /// A request whose answer someone else may read: it gets the
    /// connection's next id. First, under the sending half's lock,
    /// `enlist(old, new)` runs: the caller moves its call from `old` (the
    /// frame's id before, 0 on its first try) to `new`, where its answer
    /// will find it.
    Listed(&'a mut Frame, &'a mut dyn FnMut(u64, u64)),
}

impl Out<'_> {
    /// The same, for one more try.
    pub(crate) fn again(&mut self) -> Out<'_> {
        match self {
            Out::Kept(f) => Out::Kept(f),
            Out::Own(f) => Out::Own(f),
            Out::Listed(f, enlist) => Out::Listed(f, &mut **enlist),
        }
    }
}

/// The receiving half of a connection, for a send that reads while it
/// waits for room, and where what it reads goes.
pub(crate) type Reading<'a> = Option<(&'a mut dyn FrameRx, &'a mut dyn FnMut(Frame))>;

impl Sender {
    pub(crate) fn new(tx: Box<dyn FrameTx>) -> Self {
        Sender { tx, next_id: 1 }
    }

    /// Sends `f` ([`FrameTx::send`]), or, given the receiving half and
    /// where what it reads goes, reading while it waits for room
    /// ([`FrameTx::send_reading`]). A request ([`Out::Own`],
    /// [`Out::Listed`]) gets its call id here, whatever the outcome (a
    /// send that fails sends nothing, and the id is not used again).
    pub(crate) fn push(
        &mut self,
        f: Out<'_>,
        deadline: Option<Instant>,
        reading: Reading<'_>,
    ) -> Result<bool, TransportError> {
        let f = match f {
            Out::Kept(f) => f,
            Out::Own(f) => {
                f.call_id = self.draw();
                f
            }
            Out::Listed(f, enlist) => {
                let old = std::mem::replace(&mut f.call_id, self.draw());
                enlist(old, f.call_id);
                f
            }
        };
        match reading {
            Some((rx, got)) => self.tx.send_reading(f, deadline, rx, got),
            None => self.tx.send(f, deadline),
        }
    }

    /// A new call id.
    fn draw(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Sends, best effort, a cancel of call `id` (a caller that gave up:
    /// its request, if still queued, is then skipped): only if there is
    /// room now, without reading; a cancel that finds none is dropped.
    pub(crate) fn cancel(&mut self, id: u64) {
        let _ = self.tx.send(&Frame::cancel(id), Some(Instant::now()));
    }

    /// Sends the end of the items of the caller of call `id` if there is
    /// room now, without reading; else cancels the call, best effort (a
    /// server never waits for items that will not come).
    pub(crate) fn finish_or_cancel(&mut self, id: u64) {
        if !matches!(
            self.tx.send(&Frame::last_item(id), Some(Instant::now())),
            Ok(true)
        ) {
            self.cancel(id);
        }
    }

    /// [`FrameTx::room_needs_reader`].
    pub(crate) fn room_needs_reader(&self) -> bool {
        self.tx.room_needs_reader()
    }
}

/// Sends `f` for a caller that holds the connection's receiving half
/// `rx`, reading what arrives meanwhile into `got`: while it waits for the
/// sending half `tx` (another caller may hold it, waiting for room that
/// only this reading makes), then while it waits for room
/// ([`FrameTx::send_reading`]).
#[inline]
pub(crate) fn send_holding_rx(
    tx: &Mutex<Sender>,
    f: Out<'_>,
    deadline: Option<Instant>,
    rx: &mut Box<dyn FrameRx>,
    yield_for: Duration,
    got: &mut dyn FnMut(Frame),
) -> Result<bool, TransportError> {
    let mut since = None;
    let mut tx = loop {
        match tx.try_lock() {
            Ok(tx) => break tx,
            Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        crate::transport::drain(&mut **rx, got)?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
        // Yield at first (the half is usually free within microseconds),
        // then pause: a server that is slow to make room may keep the
        // other caller waiting for a while.
        if since.get_or_insert_with(Instant::now).elapsed() < yield_for {
            dm_sys::sched_yield();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    };
    tx.push(f, deadline, Some((&mut **rx, got)))
}

/// How long a caller that does not hold the receiving half waits for room
/// at a time before it looks again whether anyone holds it.
const ROOM_SLICE: Duration = Duration::from_millis(1);

/// Sends `f` for a caller that does not hold the connection's receiving
/// half (`take_rx` takes it if it is free). Room to send may come only
/// once answers are read ([`FrameTx::room_needs_reader`]): while another
/// caller holds the half, that caller reads them; when nobody does (its
/// holder got its answer and left, and what is left are answers to calls
/// that gave up), this caller takes the half and reads while it waits
/// ([`send_holding_rx`]), handing what it reads to `got`. It lets the half
/// go before it returns.
pub(crate) fn send_unheld<R: std::ops::DerefMut<Target = Box<dyn FrameRx>>>(
    tx: &Mutex<Sender>,
    mut f: Out<'_>,
    take_rx: impl Fn() -> Option<R>,
    deadline: Option<Instant>,
    yield_for: Duration,
    got: &mut dyn FnMut(Frame),
) -> Result<bool, TransportError> {
    // The first try does not wait: room is usually there.
    let mut slice = Duration::ZERO;
    loop {
        let mut t = lock(tx);
        if !t.room_needs_reader() {
            return t.push(f, deadline, None);
        }
        let until = Instant::now() + slice;
        let d = Some(deadline.map_or(until, |d| d.min(until)));
        match t.push(f.again(), d, None) {
            Ok(false) if deadline.is_none_or(|d| Instant::now() < d) => {}
            done => return done,
        }
        drop(t);
        if let Some(mut rx) = take_rx() {
            return send_holding_rx(tx, f, deadline, &mut rx, yield_for, got);
        }
        slice = ROOM_SLICE;
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::frame::{Body, Kind};
    use std::sync::Arc;

    /// A sending half that finds no room at every other try that has a
    /// time limit (one without waits until there is), and records the ids
    /// of the requests it takes, in order.
    struct Tight {
        tries: u64,
        taken: Arc<Mutex<Vec<u64>>>,
    }

    impl FrameTx for Tight {
        fn send(&mut self, f: &Frame, d: Option<Instant>) -> Result<bool, TransportError> {
            self.tries += 1;
            if d.is_some() && self.tries.is_multiple_of(2) {
                // (Another caller may go meanwhile.)
                std::thread::yield_now();
                return Ok(false);
            }
            if f.kind == Kind::Request {
                self.taken.lock().unwrap().push(f.call_id);
            }
            Ok(true)
        }

        fn room_needs_reader(&self) -> bool {
            true
        }
    }

    /// A receiving half with nothing in it.
    struct Empty;

    impl FrameRx for Empty {
        fn recv(&mut self, _: Option<Instant>) -> Result<Option<Frame>, TransportError> {
            Ok(None)
        }
    }

    /// Requests of four threads, each sent again and again until it goes
    /// (half the tries find no room), enter the connection in the order of
    /// their ids, and each caller's list follows its request to the id it
    /// went with (none is listed under an id that did not go).
    #[test]
    fn requests_enter_in_the_order_of_their_ids_and_their_callers_follow() {
        let taken = Arc::new(Mutex::new(Vec::new()));
        let tx = Mutex::new(Sender::new(Box::new(Tight {
            tries: 0,
            taken: taken.clone(),
        })));
        let listed = Mutex::new(Vec::<u64>::new());
        let rx = Mutex::new(Box::new(Empty) as Box<dyn FrameRx>);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..500 {
                        let mut f = Frame::request(0, 1, 0, Body::Inline(vec![1].into()));
                        let mut enlist = |old: u64, new: u64| {
                            let mut l = listed.lock().unwrap();
                            match l.iter_mut().find(|k| **k == old) {
                                Some(k) if old != 0 => *k = new,
                                _ => l.push(new),
                            }
                        };
                        let take_rx = || rx.try_lock().ok();
                        let sent = send_unheld(
                            &tx,
                            Out::Listed(&mut f, &mut enlist),
                            take_rx,
                            None,
                            Duration::ZERO,
                            &mut |_| {},
                        );
                        assert!(sent.unwrap());
                        // A grant goes with the id it has.
                        let g = Frame::credit(f.call_id, 1);
                        assert!(lock(&tx).push(Out::Kept(&g), None, None).unwrap());
                        assert_eq!(g.call_id, f.call_id);
                        assert!(listed.lock().unwrap().contains(&f.call_id));
                    }
                });
            }
        });
        let taken = taken.lock().unwrap().clone();
        assert_eq!(taken.len(), 2000);
        assert!(taken.windows(2).all(|w| w[0] < w[1]), "out of order");
        let mut listed = listed.into_inner().unwrap();
        listed.sort_unstable();
        assert_eq!(listed, taken, "a call listed where its request did not go");
    }
}
