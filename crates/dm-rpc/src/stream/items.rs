//! The caller's own items: what a call made with `call_bidi` sends to
//! its server, as the server grants them (frames v9). One core
//! ([`Outgoing`]) for both clients; [`Items`] waits for grants by
//! blocking, [`AsyncItems`] by awaiting.

use crate::error::RpcError;
use crate::frame::{Frame, Status};
use crate::payload::{Dir, Payload};
use crate::stream::StreamConn;
use std::sync::Arc;
use std::time::Instant;

/// What sending the caller's items needs of its client's connection,
/// beyond a stream's ([`StreamConn`]).
pub(crate) trait ItemConn: StreamConn {
    /// Gives back a grant taken for an item that did not go.
    fn regrant(&self, id: u64);
    /// Sends the end of the items of stream `id` if there is room now,
    /// else cancels the call.
    fn finish_or_cancel(&self, id: u64);
    /// Cancels call `id`, best effort, without waiting for room.
    fn cancel_call(&self, id: u64);
    /// The largest inline payload, and which Refs the server can use.
    fn carries_what(&self) -> (usize, crate::transport::Sharing);
}

/// The state both kinds of items share.
struct Outgoing<C: ItemConn> {
    conn: Arc<C>,
    id: u64,
    deadline: Option<Instant>,
    finished: bool,
    sent: u64,
}

impl<C: ItemConn> Outgoing<C> {
    /// Refuses a send after the finish.
    fn open(&self) -> Result<(), RpcError> {
        if self.finished {
            return Err(RpcError::invalid_argument(
                "the call's items were finished: no more can go",
            ));
        }
        Ok(())
    }

    /// Sends `item`, a grant taken for it (`granted`; false: the call
    /// ended, and it does not go).
    fn send_granted(&mut self, granted: bool, item: Payload) -> Result<(), RpcError> {
        if !granted {
            return Err(ended());
        }
        let node = self.conn.node().clone();
        let (max_inline, refs) = self.conn.carries_what();
        let inline_max = node.cfg.threshold().min(max_inline);
        let (body, lent) = match item.into_body(&node, inline_max, Dir::Answer(None), refs) {
            Ok(x) => x,
            Err(e) => {
                self.conn.regrant(self.id);
                return Err(e);
            }
        };
        let made = lent.made_ref();
        let f = Frame::item(self.id, body);
        match self.conn.send_own(&f, self.deadline) {
            Ok(()) => {
                self.sent += 1;
                crate::stats::count(&f.payload, false);
                Ok(())
            }
            Err((e, _)) => {
                if let Some(r) = made {
                    let _ = node.release_ref(&r);
                }
                Err(e)
            }
        }
    }

    fn finish(&mut self) -> Result<(), RpcError> {
        if std::mem::replace(&mut self.finished, true) {
            return Ok(());
        }
        let f = Frame::last_item(self.id);
        self.conn.send_own(&f, self.deadline).map_err(|(e, _)| e)
    }

    fn abort(&mut self) {
        self.finished = true;
        self.conn.cancel_call(self.id);
    }
}

impl<C: ItemConn> Drop for Outgoing<C> {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.finish_or_cancel(self.id);
        }
    }
}

/// A send after the call ended.
fn ended() -> RpcError {
    RpcError::new(
        Status::Cancelled,
        "the call ended before this item went: its answer says how",
    )
}

/// The sending half of a call whose caller sends items, for an async
/// caller ([`AsyncBidi::split`](super::AsyncBidi::split)).
///
/// An item goes only while the server has granted more than it was sent
/// (its handler grants as it reads), so a caller never fills its server
/// with what the handler has not read. Small items travel inline, large
/// ones as Refs made for the server. Dropped before [`finish`](Self::finish),
/// it ends the items if it can without waiting, else it cancels the
/// call: a server never waits for items that will not come.
pub struct AsyncItems {
    out: Outgoing<crate::async_client::AsyncConn>,
}

/// The sending half of a call whose caller sends items, for a blocking
/// caller ([`Bidi::split`](super::Bidi::split)): as [`AsyncItems`], with
/// sends that block.
pub struct Items {
    out: Outgoing<crate::client::BlockingConn>,
}

impl std::fmt::Debug for AsyncItems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncItems")
            .field("call_id", &self.out.id)
            .field("sent", &self.out.sent)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Items {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Items")
            .field("call_id", &self.out.id)
            .field("sent", &self.out.sent)
            .finish_non_exhaustive()
    }
}

impl AsyncItems {
    pub(crate) fn new(
        conn: Arc<crate::async_client::AsyncConn>,
        id: u64,
        deadline: Option<Instant>,
    ) -> Self {
        AsyncItems {
            out: Outgoing {
                conn,
                id,
                deadline,
                finished: false,
                sent: 0,
            },
        }
    }

    /// Items sent so far.
    pub fn sent(&self) -> u64 {
        self.out.sent
    }

    /// Sends `item`, awaiting a grant while the server holds as many
    /// unread items as it takes. Fails with `Cancelled` once the call
    /// ended (its answer says how: read it), `DeadlineExceeded` once the
    /// call's deadline passed, `InvalidArgument` after
    /// [`finish`](Self::finish), `Unavailable` if the connection broke;
    /// the item is then released.
    pub async fn send(&mut self, item: impl Into<Payload>) -> Result<(), RpcError> {
        self.out.open()?;
        let item = item.into();
        let o = &self.out;
        let granted = o.conn.item_credit(o.id, o.deadline).await?;
        self.out.send_granted(granted, item)
    }

    /// Ends the items: the server's handler sees their end once it read
    /// them all. Sending it needs no grant. Idempotent.
    pub async fn finish(&mut self) -> Result<(), RpcError> {
        self.out.finish()
    }

    /// Cancels the call instead of ending its items (the source of the
    /// items failed): its server is told (best effort, without waiting),
    /// and its answer ends `Cancelled`.
    pub fn abort(mut self) {
        self.out.abort();
    }
}

impl Items {
    pub(crate) fn new(
        conn: Arc<crate::client::BlockingConn>,
        id: u64,
        deadline: Option<Instant>,
    ) -> Self {
        Items {
            out: Outgoing {
                conn,
                id,
                deadline,
                finished: false,
                sent: 0,
            },
        }
    }

    /// Items sent so far.
    pub fn sent(&self) -> u64 {
        self.out.sent
    }

    /// Sends `item`, waiting for a grant while the server holds as many
    /// unread items as it takes ([`AsyncItems::send`]).
    pub fn send(&mut self, item: impl Into<Payload>) -> Result<(), RpcError> {
        self.out.open()?;
        let item = item.into();
        let o = &self.out;
        let granted = o.conn.item_credit(o.id, o.deadline)?;
        self.out.send_granted(granted, item)
    }

    /// Ends the items ([`AsyncItems::finish`]).
    pub fn finish(&mut self) -> Result<(), RpcError> {
        self.out.finish()
    }

    /// Cancels the call instead of ending its items ([`AsyncItems::abort`]).
    pub fn abort(mut self) {
        self.out.abort();
    }
}
