//! What the dispatcher takes in: requests queued in order (refused while
//! the server drains), cancels applied to queued requests or kept for
//! calls in progress, and streams' credit.

use super::running::Stats;
use crate::frame::{Body, Frame, Kind, Status};
use crate::transport::{ConnId, Listener};
use dm_pool::Ref;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub(crate) struct Pending {
    pub(super) conn: ConnId,
    pub(super) frame: Frame,
    /// When the caller stops waiting (from the frame's relative deadline,
    /// counted from when the frame was read).
    pub(super) deadline: Option<Instant>,
    /// Items its caller granted while it was queued (a stream's request).
    pub(super) credit: u64,
    /// Its caller ended its items while it was queued (before any could
    /// be granted).
    pub(super) items_ended: bool,
}

pub(super) fn pending(conn: ConnId, frame: Frame) -> Pending {
    let deadline = (frame.deadline_us > 0)
        .then(|| Instant::now() + Duration::from_micros(frame.deadline_us as u64));
    // (A stream's request may grant its first window with it.)
    let credit = if frame.flags & crate::frame::FLAG_WINDOW != 0 {
        u64::from(crate::stream::DEFAULT_WINDOW)
    } else {
        0
    };
    Pending {
        conn,
        frame,
        deadline,
        credit,
        items_ended: false,
    }
}

/// Answers `f` with `Unavailable` if it is a request read while the
/// server drains (`draining`), instead of taking it (true).
pub(super) fn refuse(
    listener: &mut dyn Listener,
    stats: &Stats,
    draining: Option<Instant>,
    conn: ConnId,
    f: &Frame,
) -> bool {
    if draining.is_none() || f.kind != Kind::Request {
        return false;
    }
    stats.refused.fetch_add(1, Ordering::Relaxed);
    let answer = Frame::refused(f.call_id, "the service is shutting down");
    let _ = listener.reply(conn, &answer);
    true
}

/// A frame for a call in progress, read while a handler ran: applied
/// when it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Later {
    /// The caller of call `.1` of connection `.0` cancelled it.
    Cancel(ConnId, u64),
    /// The caller of stream `.1` of connection `.0` granted `.2` more items.
    Credit(ConnId, u64, u32),
    /// An item the caller of a call in progress sent (on connection `.0`).
    Item(ConnId, Frame),
}

/// Moves every frame already waiting in `listener` into `queue`, applying
/// cancels: a cancelled request still queued is answered `Cancelled` and
/// never runs; the other cancels (of calls in progress), and grants of
/// streams in progress, go to `later`.
pub(super) fn intake(
    listener: &mut dyn Listener,
    queue: &mut VecDeque<Pending>,
    stats: &Stats,
    draining: Option<Instant>,
    later: &mut Vec<Later>,
) {
    while let Ok(Some((conn, frame))) = listener.poll() {
        take_in(listener, queue, stats, draining, later, (conn, frame));
        if queue.len() > 4096 {
            break;
        }
    }
}

/// Takes frame `frame` of connection `conn`, read while a handler runs
/// ([`intake`]): a request is queued (or refused while draining), a cancel
/// applied to a queued request or kept in `later`, a credit added to its
/// queued request's or kept in `later` (for an async stream in progress;
/// dropped there if its stream ended).
#[inline]
pub(crate) fn take_in(
    listener: &mut dyn Listener,
    queue: &mut VecDeque<Pending>,
    stats: &Stats,
    draining: Option<Instant>,
    later: &mut Vec<Later>,
    (conn, frame): (ConnId, Frame),
) {
    match frame.kind {
        Kind::Cancel => {
            // Every request gets exactly one answer (transports count on
            // it to bound what they owe a client): a cancelled one gets
            // `Cancelled`, which its caller, gone, drops.
            if let Some(k) = queue
                .iter()
                .position(|q| q.conn == conn && q.frame.call_id == frame.call_id)
            {
                queue.remove(k);
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                let _ = listener.reply(
                    conn,
                    &Frame::response(frame.call_id, Status::Cancelled, Body::None),
                );
            } else {
                later.push(Later::Cancel(conn, frame.call_id));
            }
        }
        Kind::Request => {
            if !refuse(listener, stats, draining, conn, &frame) {
                queue.push_back(pending(conn, frame));
            }
        }
        Kind::Credit => {
            // A grant for a stream whose request is queued, or for one in
            // progress.
            if let Some(q) = queue
                .iter_mut()
                .find(|q| q.conn == conn && q.frame.call_id == frame.call_id)
            {
                q.credit += u64::from(frame.method);
            } else {
                later.push(Later::Credit(conn, frame.call_id, frame.method));
            }
        }
        // An item of a caller's stream: for a call in progress (one for
        // a queued request was never granted; the dispatcher releases it).
        Kind::Item => {
            if !ended_items_of(queue, conn, &frame) {
                later.push(Later::Item(conn, frame));
            }
        }
        // (Parts are joined by the transport: none gets here.)
        Kind::Response | Kind::GoAway | Kind::Part => {}
    }
}

/// Whether `f`, an item of connection `conn`, is the end of the items of
/// a request still queued (the one item that needs no grant): then it
/// is noted there.
pub(super) fn ended_items_of(queue: &mut VecDeque<Pending>, conn: ConnId, f: &Frame) -> bool {
    if f.flags & crate::frame::FLAG_LAST == 0 {
        return false;
    }
    match queue
        .iter_mut()
        .find(|q| q.conn == conn && q.frame.call_id == f.call_id)
    {
        Some(q) => {
            q.items_ended = true;
            true
        }
        None => false,
    }
}

/// Where an answer goes: the call, and the pool Ref its request carried
/// (which the answer may pass back as it came).
pub(super) struct To {
    pub(super) conn: ConnId,
    pub(super) id: u64,
    pub(super) echo: Option<Ref>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::frame::FLAG_REFUSED;
    use crate::transport::Waker;

    /// A transport's server end that records what it is asked to send
    /// (take_in only answers through it).
    #[derive(Default)]
    struct Replies(Vec<(ConnId, Frame)>);

    impl Listener for Replies {
        fn next(
            &mut self,
            _: Option<Instant>,
        ) -> Result<Option<(ConnId, Frame)>, crate::transport::TransportError> {
            Ok(None)
        }
        fn reply(
            &mut self,
            conn: ConnId,
            f: &Frame,
        ) -> Result<(), crate::transport::TransportError> {
            self.0.push((conn, f.clone()));
            Ok(())
        }
        fn is_open(&self, _: ConnId) -> bool {
            true
        }
        fn max_inline(&self) -> usize {
            1 << 16
        }
        fn connections(&self) -> usize {
            1
        }
        fn waker(&self) -> Waker {
            Waker(std::sync::Arc::new(|| {}))
        }
        fn go_away(&mut self) {}
    }

    fn take(
        l: &mut Replies,
        q: &mut VecDeque<Pending>,
        stats: &Stats,
        draining: Option<Instant>,
        (conn, f): (ConnId, Frame),
    ) -> Vec<Later> {
        let mut later = Vec::new();
        take_in(l, q, stats, draining, &mut later, (conn, f));
        later
    }

    #[test]
    fn requests_queue_in_order_with_their_deadline_and_cancels_find_them() {
        let (mut l, mut q, stats) = (Replies::default(), VecDeque::new(), Stats::default());
        let f = |id, us| Frame::request(id, 9, us, Body::None);
        assert!(take(&mut l, &mut q, &stats, None, (1, f(10, 0))).is_empty());
        assert!(take(&mut l, &mut q, &stats, None, (2, f(10, 5_000_000))).is_empty());
        assert!(take(&mut l, &mut q, &stats, None, (1, f(11, 0))).is_empty());
        let ids: Vec<_> = q.iter().map(|p| (p.conn, p.frame.call_id)).collect();
        assert_eq!(ids, [(1, 10), (2, 10), (1, 11)]);
        assert!(q[0].deadline.is_none());
        let left = q[1].deadline.unwrap() - Instant::now();
        assert!(left > Duration::from_secs(4) && left <= Duration::from_secs(5));
        // A cancel of a queued request: it never runs, and is answered
        // Cancelled (each request gets exactly one answer).
        assert!(take(&mut l, &mut q, &stats, None, (2, Frame::cancel(10))).is_empty());
        let ids: Vec<_> = q.iter().map(|p| (p.conn, p.frame.call_id)).collect();
        assert_eq!(ids, [(1, 10), (1, 11)]);
        assert_eq!(l.0.len(), 1);
        assert_eq!((l.0[0].0, l.0[0].1.call_id), (2, 10));
        assert_eq!(l.0[0].1.status, Status::Cancelled);
        assert_eq!(stats.cancelled.load(Ordering::Relaxed), 1);
        // A cancel of a call not queued (running, or never seen) is kept
        // for the dispatcher.
        let later = take(&mut l, &mut q, &stats, None, (1, Frame::cancel(99)));
        assert_eq!(later, [Later::Cancel(1, 99)]);
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn a_draining_server_refuses_requests_as_not_run_and_credit_finds_its_stream() {
        let (mut l, mut q, stats) = (Replies::default(), VecDeque::new(), Stats::default());
        let req = Frame::request(7, 9, 0, Body::None);
        assert!(take(&mut l, &mut q, &stats, None, (3, req.clone())).is_empty());
        // Credit for the queued stream's request adds to it; credit for
        // another call is kept.
        assert!(take(&mut l, &mut q, &stats, None, (3, Frame::credit(7, 4))).is_empty());
        assert_eq!(q[0].credit, 4);
        let later = take(&mut l, &mut q, &stats, None, (3, Frame::credit(8, 2)));
        assert_eq!(later, [Later::Credit(3, 8, 2)]);
        // Draining: a new request is answered Unavailable, flagged as not
        // run, and not queued.
        let soon = Some(Instant::now() + Duration::from_secs(1));
        let req = Frame::request(12, 9, 0, Body::None);
        assert!(take(&mut l, &mut q, &stats, soon, (3, req)).is_empty());
        assert_eq!(q.len(), 1);
        let (conn, answer) = &l.0[0];
        assert_eq!((*conn, answer.call_id), (3, 12));
        assert_eq!(answer.status, Status::Unavailable);
        assert_ne!(answer.flags & FLAG_REFUSED, 0);
        assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
        // Answers and go-aways are not for a server.
        let stray = Frame::response(5, Status::Ok, Body::None);
        assert!(take(&mut l, &mut q, &stats, None, (3, stray)).is_empty());
        assert_eq!((q.len(), l.0.len()), (1, 1));
    }
}
