//! Where a call goes after an attempt that did not end it, without I/O.
//!
//! An attempt ends a call unless its request may go again:
//!
//! * **Elsewhere**: the request is known not to have run (refused by a
//!   server shutting down, never taken by one that stopped, never sent
//!   because the connection broke first), or it is idempotent and its
//!   connection broke. It goes to the service's next connection, as it
//!   was (its Refs still lent), at most [`MAX_ELSEWHERE`] times in a row:
//!   that server may be stopping too.
//! * **Later**: its answer has a status its retry policy lists. It goes
//!   again after the policy's wait, if its deadline leaves room for it.
//!
//! [`Failover`] decides; the clients (blocking, async, balanced) do what
//! it says: retire a connection, wait for a new one, sleep, send again.

use super::attempt::{retry_wait, Failure, Refused};
use super::options::{CallOptions, Reply};
use crate::retry::Retry;
use crate::transport::Sharing;
use std::time::{Duration, Instant};

/// How many times in a row a request known not to have run goes to the
/// service's next connection.
pub(crate) const MAX_ELSEWHERE: u32 = 3;

/// What a call can tell of a connection it might go over next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    /// New calls should not use it (it broke, or was retired).
    pub(crate) spent: bool,
    /// Where the Refs it carries can be mapped.
    pub(crate) refs: Sharing,
    /// Its largest inline payload (with metadata).
    pub(crate) max_inline: usize,
}

/// What a call does after an attempt ([`Failover::next`]).
pub(crate) enum Next {
    /// The call ends with this outcome, on the connection it ran on.
    End(Result<Reply, Failure>),
    /// The request did not run: retire the connection that refused it
    /// and send it over the service's next one (waiting for one first if
    /// [`Failover::waits_for`] says so), if [`Failover::takes`] it.
    Elsewhere(Box<Refused>),
    /// Its answer has a status its retry policy lists: after this wait,
    /// send it again over the service's connection then, if
    /// [`Failover::takes`] it.
    Later(Box<Refused>, Duration),
    /// No attempt is left, or the wait would outlast its deadline: the
    /// call fails with the error of its last attempt.
    GiveUp(Box<Refused>),
}

/// The failover and retry state of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Failover {
    /// Attempts so far that ran (1 for the first).
    attempt: u32,
    /// Times in a row the request went elsewhere.
    elsewhere: u32,
    policy: Option<Retry>,
    wait_for_ready: bool,
}

impl Failover {
    /// The state of a call with `opts` after its first attempt.
    pub(crate) fn new(opts: &CallOptions) -> Failover {
        Failover {
            attempt: 1,
            elsewhere: 0,
            policy: opts.retry,
            wait_for_ready: opts.wait_for_ready,
        }
    }

    /// What the call does after an attempt that ended with `r`, at `now`.
    pub(crate) fn next(&mut self, r: Result<Reply, Failure>, now: Instant) -> Next {
        match r {
            Err(Failure::Refused(x)) if self.elsewhere < MAX_ELSEWHERE => {
                self.elsewhere += 1;
                Next::Elsewhere(x)
            }
            Err(Failure::Again(x)) => {
                self.elsewhere = 0;
                self.attempt += 1;
                match retry_wait(&x, self.attempt, self.policy, now) {
                    Some(wait) => Next::Later(x, wait),
                    None => Next::GiveUp(x),
                }
            }
            r => Next::End(r),
        }
    }

    /// Whether a request that must go elsewhere waits for the service to
    /// come back when its next connection `next` cannot take calls
    /// ([`CallOptions::wait_for_ready`]).
    pub(crate) fn waits_for(&self, next: Link) -> bool {
        self.wait_for_ready && next.spent
    }

    /// Whether request `x` goes over `to`: a connection other than the
    /// one it was refused on (`same` false), that takes calls, whose Refs
    /// are mapped where the request's are and whose inline limit holds
    /// its bytes and metadata.
    pub(crate) fn takes(&self, x: &Refused, to: Link, same: bool) -> bool {
        !same && !to.spent && x.fits(to.refs, to.max_inline)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::call::attempt::{refusal, Again};
    use crate::error::RpcError;
    use crate::frame::{Body, Frame, Status};
    use crate::payload::Lent;

    fn request_with(e: RpcError, deadline: Option<Instant>, inline: usize) -> Box<Refused> {
        let req = Frame::request(1, 7, 0, Body::Inline(vec![1; inline].into()));
        let lent = Lent::default();
        let again = Again::default();
        Box::new(Refused::new(req, e, lent, deadline, Sharing::POOL, again))
    }

    fn request(deadline: Option<Instant>, inline: usize) -> Box<Refused> {
        let answer = Frame::refused(1, "the service is shutting down");
        request_with(refusal(answer), deadline, inline)
    }

    fn refused(deadline: Option<Instant>) -> Result<Reply, Failure> {
        Err(Failure::Refused(request(deadline, 8)))
    }

    fn answered(status: Status, deadline: Option<Instant>) -> Result<Reply, Failure> {
        let e = RpcError::new(status, "busy");
        Err(Failure::Again(request_with(e, deadline, 8)))
    }

    fn link(spent: bool, max_inline: usize) -> Link {
        Link {
            spent,
            refs: Sharing::POOL,
            max_inline,
        }
    }

    /// What `n` says, by name (these requests lend nothing to end).
    fn forget(n: Next) -> &'static str {
        match n {
            Next::End(Ok(_)) => "ok",
            Next::End(Err(Failure::Error(_))) => "error",
            Next::End(Err(Failure::Refused(_))) => "refused",
            Next::End(Err(Failure::Again(_))) => "again",
            Next::Elsewhere(_) => "elsewhere",
            Next::Later(..) => "later",
            Next::GiveUp(_) => "give up",
        }
    }

    #[test]
    fn an_answer_or_an_error_ends_the_call() {
        let mut f = Failover::new(&CallOptions::default());
        let now = Instant::now();
        assert_eq!(forget(f.next(Ok(Reply::default()), now)), "ok");
        let e = Failure::Error(RpcError::new(Status::Internal, "x"));
        assert_eq!(forget(f.next(Err(e), now)), "error");
    }

    #[test]
    fn a_refused_request_goes_elsewhere_three_times_in_a_row_at_most() {
        let policy = Retry::new(5, &[Status::ResourceExhausted]);
        let mut f = Failover::new(&CallOptions::default().retry(policy));
        let now = Instant::now();
        for _ in 0..MAX_ELSEWHERE {
            assert_eq!(forget(f.next(refused(None), now)), "elsewhere");
        }
        // The fourth refusal in a row ends the call with it.
        assert_eq!(forget(f.next(refused(None), now)), "refused");
        // An answer its policy lists starts a new run of refusals.
        let mut f = Failover::new(&CallOptions::default().retry(policy));
        for _ in 0..MAX_ELSEWHERE {
            assert_eq!(forget(f.next(refused(None), now)), "elsewhere");
        }
        assert_eq!(
            forget(f.next(answered(Status::ResourceExhausted, None), now)),
            "later"
        );
        assert_eq!(forget(f.next(refused(None), now)), "elsewhere");
    }

    #[test]
    fn a_listed_status_goes_again_later_until_the_attempts_or_the_deadline_run_out() {
        let listed = &[Status::ResourceExhausted];
        let now = Instant::now();
        // Three attempts: the first ran, two more go later.
        let mut f = Failover::new(&CallOptions::default().retry(Retry::new(3, listed)));
        for _ in 0..2 {
            assert_eq!(
                forget(f.next(answered(Status::ResourceExhausted, None), now)),
                "later"
            );
        }
        assert_eq!(
            forget(f.next(answered(Status::ResourceExhausted, None), now)),
            "give up"
        );
        // No room before the deadline: give up at once.
        let mut f = Failover::new(&CallOptions::default().retry(Retry::new(3, listed)));
        assert_eq!(
            forget(f.next(answered(Status::ResourceExhausted, Some(now)), now)),
            "give up"
        );
        // No policy: nothing goes again.
        let mut f = Failover::new(&CallOptions::default());
        assert_eq!(
            forget(f.next(answered(Status::ResourceExhausted, None), now)),
            "give up"
        );
    }

    #[test]
    fn a_request_goes_only_over_another_live_connection_that_carries_it() {
        let f = Failover::new(&CallOptions::default());
        let x = request(None, 800);
        assert!(f.takes(&x, link(false, 800), false));
        assert!(!f.takes(&x, link(false, 800), true), "the same connection");
        assert!(!f.takes(&x, link(true, 800), false), "a spent one");
        assert!(!f.takes(&x, link(false, 799), false), "too small");
        // A connection that passes more kinds of Ref takes it; one that
        // cannot pass the kinds it was placed for does not.
        let more = Link {
            refs: Sharing::ALL,
            ..link(false, 800)
        };
        assert!(
            f.takes(&x, more, false),
            "pool Refs go where pool and remote Refs do"
        );
        let remote_only = Sharing {
            pool: false,
            remote: true,
        };
        let fewer = Link {
            refs: remote_only,
            ..link(false, 800)
        };
        assert!(!f.takes(&x, fewer, false), "pool Refs not mapped there");
        let lent = crate::payload::Lent::default();
        let req = Frame::request(1, 7, 0, Body::Inline(vec![1; 8].into()));
        let e = RpcError::unavailable("gone");
        let y = Refused::new(req, e, lent, None, remote_only, Again::default());
        assert!(f.takes(&y, more, false), "to a peer of the same pool");
        assert!(
            !f.takes(&y, link(false, 800), false),
            "memory-server Refs not passed there"
        );
        // Waiting for the service to come back: only when asked, and only
        // when the next connection cannot take calls.
        assert!(!f.waits_for(link(true, 800)));
        let w = Failover::new(&CallOptions::default().wait_for_ready());
        assert!(w.waits_for(link(true, 800)) && !w.waits_for(link(false, 800)));
    }
}
