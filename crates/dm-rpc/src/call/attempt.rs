//! One attempt of a call on one connection, without I/O: the request a
//! call makes (the size-aware rule, its deadline, its metadata), what the
//! answer means for it (a result, or a request that may go again), and
//! what it takes to send a request again ([`Refused`]).

use super::options::{CallOptions, Reply};
use crate::error::RpcError;
use crate::frame::{method_id, Body, Frame, Kind, Status, FLAG_REFUSED};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::{Dir, Lent, Payload};
use crate::retry::{Retry, Statuses};
use std::time::{Duration, Instant};

/// Whether a client takes frames of this kind from its server: answers,
/// items of the streams it opened, and grants for the items it sends.
#[inline]
pub(crate) fn answers(kind: Kind) -> bool {
    matches!(kind, Kind::Response | Kind::Item | Kind::Credit)
}

/// A request ready to send: what both clients compute from a call (and
/// keep of a request to send it again).
pub(crate) struct Outgoing {
    pub(crate) method: u32,
    pub(crate) body: Body,
    pub(crate) meta: Metadata,
    /// What the argument lends (the Ref the framework made for it, or the
    /// payload it forwards): ended when the call completes, whatever its
    /// outcome.
    pub(crate) lent: Lent,
    pub(crate) deadline: Option<Instant>,
    /// What is left of the deadline, as the request says it (0: none).
    pub(crate) deadline_us: u32,
    /// When it may be sent again besides when it is known not to have run.
    pub(crate) again: Again,
}

/// When a request may be sent again besides when it is known not to have
/// run ([`Failure::Refused`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Again {
    /// Its connection broke while it was in flight, and it may run twice
    /// ([`CallOptions::idempotent`]).
    pub(crate) idempotent: bool,
    /// Its answer has one of these statuses ([`CallOptions::retry`]).
    pub(crate) on: Statuses,
}

impl Outgoing {
    /// Its request frame, and what the call keeps beside it: what the
    /// argument lent, when it gives up, and when it may be sent again.
    /// (The frame is kept until the answer: a request known not to have
    /// run is sent again. Its call id, 0 here, is drawn when it enters a
    /// connection: [`crate::sender`].)
    pub(crate) fn into_frame(self) -> (Frame, Lent, Option<Instant>, Again) {
        let mut frame = Frame::request(0, self.method, self.deadline_us, self.body);
        frame.meta = self.meta;
        (frame, self.lent, self.deadline, self.again)
    }
}

/// When a call with `opts` gives up (the earlier of its own deadline, or
/// the node's default, and the served one unless detached), and whether
/// the served call's caller gave up already.
pub(crate) fn deadline_of(node: &Node, opts: CallOptions, now: Instant) -> (Option<Instant>, bool) {
    let own = opts.deadline.or(node.cfg.default_deadline).map(|d| now + d);
    let served = if opts.detached {
        None
    } else {
        crate::deadline::served()
    };
    let d = match (own, served) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    (d, served.is_some_and(|s| s <= now))
}

/// Applies the size-aware rule and the deadline to a call of `method`
/// with `meta`.
pub(crate) fn outgoing(
    node: &Node,
    max_inline: usize,
    refs: crate::transport::Sharing,
    method: &str,
    payload: Payload,
    opts: CallOptions,
    meta: Metadata,
) -> Result<Outgoing, RpcError> {
    let threshold = node.cfg.threshold();
    outgoing_at(
        node,
        (max_inline, threshold),
        refs,
        method,
        payload,
        opts,
        meta,
    )
}

/// [`outgoing`], with the threshold given (`limits`: the connection's
/// cap and the threshold).
pub(crate) fn outgoing_at(
    node: &Node,
    limits: (usize, usize),
    refs: crate::transport::Sharing,
    method: &str,
    payload: Payload,
    opts: CallOptions,
    mut meta: Metadata,
) -> Result<Outgoing, RpcError> {
    let (max_inline, threshold) = limits;
    // What the call being served passes on (ServerBuilder::propagate_metadata).
    crate::metadata::inherit_into(&mut meta);
    let (deadline, deadline_us) = if opts.deadline.is_none()
        && node.cfg.default_deadline.is_none()
        && (opts.detached || crate::deadline::served().is_none())
    {
        // (No clock read on the common path.)
        (None, 0)
    } else {
        let now = Instant::now();
        let (d, gone) = deadline_of(node, opts, now);
        if gone {
            // Its caller gave up already: nothing to send.
            return Err(RpcError::deadline_exceeded(
                "the deadline of the call being served has passed",
            ));
        }
        match d {
            None => (None, 0),
            Some(d) => {
                let left = d.saturating_duration_since(now).as_micros();
                (Some(d), left.clamp(1, u32::MAX as u128) as u32)
            }
        }
    };
    // (The metadata travels in the frame too, within the receiver's limit.)
    let inline_max = meta
        .inline_room(threshold, max_inline)
        .map_err(|(len, max)| {
            RpcError::invalid_argument(format!(
                "metadata of {len} bytes exceeds the limit of {max}"
            ))
        })?;
    let (body, lent) = payload.into_body(node, inline_max, Dir::Request, refs)?;
    crate::stats::count(&body, true);
    Ok(Outgoing {
        method: method_id(method),
        body,
        meta,
        lent,
        deadline,
        deadline_us,
        again: again_of(opts),
    })
}

/// How long a call whose answer `x` has a status its retry policy lists
/// waits, from `now`, before attempt `n`; None to give up: no attempt
/// left, the server said not to, or the wait would outlast the deadline.
pub(crate) fn retry_wait(
    x: &Refused,
    n: u32,
    policy: Option<Retry>,
    now: Instant,
) -> Option<Duration> {
    let wait = policy?.wait(n, x.answer_metadata())?;
    match x.deadline() {
        Some(d) if now + wait >= d => None,
        _ => Some(wait),
    }
}

/// When a call with `opts` may be sent again: a retry policy that lists
/// `Unavailable` makes it idempotent too.
fn again_of(opts: CallOptions) -> Again {
    let on = opts.retry.map(|r| r.retries_on()).unwrap_or_default();
    Again {
        idempotent: opts.idempotent || on.contains(Status::Unavailable),
        on,
    }
}

/// The error an answer of an error status carries (with its metadata).
pub(crate) fn answer_error(f: Frame) -> RpcError {
    RpcError::new(f.status, message_of(f.payload)).with_metadata(f.meta)
}

/// What a send's outcome `r`, over a connection to `name`, means for its
/// call: sent, or the error and whether the connection broke with it (it
/// is then marked broken with `broke`, and the frame was not sent: a
/// request may go elsewhere).
pub(crate) fn sent_as(
    name: &str,
    r: Result<bool, crate::transport::TransportError>,
    broke: impl FnOnce(crate::transport::TransportError) -> RpcError,
) -> Result<(), (RpcError, bool)> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err((
            RpcError::deadline_exceeded(format!("no room to send to {name:?} before the deadline")),
            false,
        )),
        Err(e) if e.breaks_connection() => Err((broke(e), true)),
        Err(e) => Err((e.into(), false)),
    }
}

/// Whether request `req`, placed for a connection whose Refs are
/// `sharing.0`, can go as it is over one whose Refs are `sharing.1` and
/// largest inline payload `max_inline` (its Refs usable there, its inline
/// bytes and metadata within the limit).
pub(crate) fn carried(
    req: &Frame,
    sharing: (crate::transport::Sharing, crate::transport::Sharing),
    max_inline: usize,
) -> bool {
    goes_as_is(
        req.payload.len() + req.meta.encoded_len(),
        sharing,
        max_inline,
    )
}

/// Whether a request of `len` bytes of payload and metadata, placed for a
/// connection whose Refs are `from.0`, can go as it is over one whose Refs
/// are `from.1` and largest inline payload `max_inline` (a request sent
/// again elsewhere).
fn goes_as_is(
    len: usize,
    (from, to): (crate::transport::Sharing, crate::transport::Sharing),
    max_inline: usize,
) -> bool {
    to.covers(from) && len <= max_inline
}

/// How the answer `f` to request `frame` ends its call: a refusal or a
/// status its retry policy lists lets the request go again (with what it
/// lent, its deadline, the sharing it was placed for and when it may go
/// again); any other answer is the call's result.
pub(crate) fn ended(
    node: &Node,
    frame: Frame,
    f: Frame,
    (lent, deadline, refs, again): (Lent, Option<Instant>, crate::transport::Sharing, Again),
) -> Result<Reply, Failure> {
    if f.flags & FLAG_REFUSED != 0 {
        return Err(Failure::not_run(
            frame,
            refusal(f),
            lent,
            deadline,
            refs,
            again,
        ));
    }
    if f.status != Status::Ok && again.on.contains(f.status) {
        // Its retry policy lists this status: it may go again.
        let r = Refused::new(frame, answer_error(f), lent, deadline, refs, again);
        return Err(Failure::Again(Box::new(r)));
    }
    drop(frame);
    Ok(answer(node, f, lent)?)
}

/// Turns an answer frame into the call's result, ending what the
/// argument lent.
pub(crate) fn answer(node: &Node, f: Frame, lent: Lent) -> Result<Reply, RpcError> {
    crate::stats::count(&f.payload, false);
    if f.status != Status::Ok {
        lent.release(node);
        return Err(answer_error(f));
    }
    let payload = lent.answer(node, f.flags, f.payload)?;
    Ok(Reply {
        payload,
        metadata: f.meta,
    })
}

/// How a call on one connection failed.
pub(crate) enum Failure {
    /// With this error.
    Error(RpcError),
    /// Not run, and known not to be: refused by a server shutting down
    /// ([`FLAG_REFUSED`]), never taken by a server that stopped
    /// ([`crate::transport::GoAway`]), or never sent (the connection
    /// broke first). It may be sent again elsewhere.
    Refused(Box<Refused>),
    /// Run, and answered with a status its retry policy lists: it may be
    /// sent again, to the same service, after a wait ([`crate::retry`]).
    Again(Box<Refused>),
}

impl Failure {
    /// The failure of request `frame`, placed for a connection with
    /// `refs`, which did not run (or may run again: `idempotent`) because
    /// of `e`: it may be sent again elsewhere.
    #[cold]
    pub(crate) fn not_run(
        frame: Frame,
        e: RpcError,
        lent: Lent,
        deadline: Option<Instant>,
        refs: crate::transport::Sharing,
        again: Again,
    ) -> Failure {
        let r = Refused::new(frame, e, lent, deadline, refs, again);
        Failure::Refused(Box::new(r))
    }
}

impl From<RpcError> for Failure {
    fn from(e: RpcError) -> Self {
        Failure::Error(e)
    }
}

/// A request known not to have run ([`Failure::Refused`]), with what it
/// takes to send it again: its method, its payload as it was sent (its
/// Refs still lent), its metadata and its deadline.
pub(crate) struct Refused {
    pub(crate) req: Outgoing,
    /// The sharing of Refs of the connection it was placed for.
    refs: crate::transport::Sharing,
    /// Why it did not run: the call's error if it is not sent again.
    error: RpcError,
}

/// The error of a refusal answer ([`FLAG_REFUSED`]).
pub(crate) fn refusal(answer: Frame) -> RpcError {
    RpcError::new(Status::Unavailable, message_of(answer.payload))
}

impl Refused {
    /// The request `frame`, which did not run because of `error`.
    pub(crate) fn new(
        frame: Frame,
        error: RpcError,
        lent: Lent,
        deadline: Option<Instant>,
        refs: crate::transport::Sharing,
        again: Again,
    ) -> Refused {
        let req = Outgoing {
            method: frame.method,
            body: frame.payload,
            meta: frame.meta,
            lent,
            deadline,
            deadline_us: frame.deadline_us,
            again,
        };
        Refused { req, refs, error }
    }

    /// The metadata of the answer that made it go again.
    pub(crate) fn answer_metadata(&self) -> &Metadata {
        &self.error.metadata
    }

    /// When the call gives up.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.req.deadline
    }

    /// Whether a connection with `refs` and `max_inline` can carry it as
    /// it is (its Refs usable at the other end, its inline bytes and
    /// metadata within the limit).
    pub(crate) fn fits(&self, refs: crate::transport::Sharing, max_inline: usize) -> bool {
        let len = self.req.body.len() + self.req.meta.encoded_len();
        goes_as_is(len, (self.refs, refs), max_inline)
    }

    /// Gives up sending it again, with `e`: ends what it lent.
    pub(crate) fn drop_with(self, node: &Node, e: RpcError) -> RpcError {
        self.req.lent.release(node);
        e
    }

    /// The request to send again to `name`, with what is left of its
    /// deadline; or, if its deadline passed, the call's error (what it
    /// lent released).
    pub(crate) fn left(self, node: &Node, name: &str) -> Result<Outgoing, RpcError> {
        let mut req = self.req;
        let Some(d) = req.deadline else {
            req.deadline_us = 0;
            return Ok(req);
        };
        match d.saturating_duration_since(Instant::now()).as_micros() {
            0 => {
                req.lent.release(node);
                Err(RpcError::deadline_exceeded(format!(
                    "the deadline passed before {name:?} could be called again"
                )))
            }
            us => {
                req.deadline_us = us.min(u32::MAX as u128) as u32;
                Ok(req)
            }
        }
    }

    /// Gives up sending it: ends what it lent; the refusal.
    pub(crate) fn fail(self, node: &Node) -> RpcError {
        self.req.lent.release(node);
        self.error
    }
}

/// The message an error answer carries.
fn message_of(b: Body) -> String {
    match b {
        Body::Inline(m) => String::from_utf8_lossy(&m).into_owned(),
        _ => String::new(),
    }
}

/// An answer nobody waits for (its caller gave up): a Ref in it was made
/// for us, so release it.
pub(crate) fn orphan(node: &Node, f: Frame) {
    if f.flags & crate::frame::FLAG_ECHO != 0 {
        // Our request's own Ref passed back: released with the call.
        return;
    }
    if let Body::Refs(rs) = f.payload {
        for r in rs {
            let _ = node.pool.release_ref(&r);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::transport::Sharing;

    fn refused(deadline: Option<Instant>, inline: usize, meta: Metadata) -> Refused {
        let req = Frame::request(1, 7, 9, Body::Inline(vec![1; inline].into())).with_meta(meta);
        let answer = Frame::refused(1, "the service is shutting down");
        let lent = Lent::default();
        let again = Again {
            idempotent: true,
            ..Again::default()
        };
        Refused::new(req, refusal(answer), lent, deadline, Sharing::POOL, again)
    }

    #[test]
    fn a_refused_request_goes_again_only_where_it_fits_and_in_time() {
        let tp = dm_pool::testing::TempPool::new(16 << 20);
        let node = Node::new(tp.attach());
        let none = Metadata::new;
        let r = refused(None, 800, none());
        assert_eq!((r.req.method, r.req.body.len()), (7, 800));
        // Its sharing, and room for its bytes (and its metadata).
        assert!(r.fits(Sharing::POOL, 1000));
        assert!(r.fits(Sharing::POOL, 800));
        assert!(!r.fits(Sharing::POOL, 799));
        // A connection that passes more kinds of Ref, yes; fewer, no.
        assert!(r.fits(Sharing::ALL, 1000));
        let remote_only = Sharing {
            pool: false,
            remote: true,
        };
        assert!(!r.fits(remote_only, 1000));
        let meta = Metadata::new().with("k", "v").unwrap();
        let m = refused(None, 800, meta.clone());
        assert!(m.fits(Sharing::POOL, 805) && !m.fits(Sharing::POOL, 804));
        // Sent again as it was, with what is left of its deadline.
        let again = m.left(&node, "s").unwrap();
        assert_eq!(
            (again.deadline_us, again.again.idempotent),
            (0, true),
            "no deadline"
        );
        assert_eq!((again.method, again.meta), (7, meta));
        let soon = Instant::now() + Duration::from_secs(5);
        let us = refused(Some(soon), 1, none())
            .left(&node, "s")
            .unwrap()
            .deadline_us;
        assert!(us > 4_000_000 && us <= 5_000_000, "{us}");
        let Err(e) = refused(Some(Instant::now()), 1, none()).left(&node, "s") else {
            panic!("sent again after its deadline");
        };
        assert_eq!(e.status, Status::DeadlineExceeded);
        let e = refused(None, 1, none()).fail(&node);
        assert_eq!(e.status, Status::Unavailable);
        assert!(e.message.contains("shutting down"), "{e}");
        drop(node);
        tp.assert_clean();
    }
}
