//! The caller's own items: what an [`AsyncBidi`](super::AsyncBidi)
//! sends to its server, as the server grants them (frames v9).

use crate::async_client::AsyncConn;
use crate::error::RpcError;
use crate::frame::{Frame, Status};
use crate::payload::{Dir, Payload};
use std::sync::Arc;
use std::time::Instant;

/// The sending half of a call whose caller sends items
/// ([`AsyncBidi::split`](super::AsyncBidi::split)).
///
/// An item goes only while the server has granted more than it was sent
/// (its handler grants as it reads), so a caller never fills its server
/// with what the handler has not read. Small items travel inline, large
/// ones as Refs made for the server. Dropped before [`finish`](Self::finish),
/// it ends the items if it can without waiting, else it cancels the
/// call: a server never waits for items that will not come.
pub struct AsyncItems {
    conn: Arc<AsyncConn>,
    id: u64,
    deadline: Option<Instant>,
    finished: bool,
    sent: u64,
}

impl std::fmt::Debug for AsyncItems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncItems")
            .field("call_id", &self.id)
            .field("sent", &self.sent)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl AsyncItems {
    pub(crate) fn new(conn: Arc<AsyncConn>, id: u64, deadline: Option<Instant>) -> Self {
        AsyncItems {
            conn,
            id,
            deadline,
            finished: false,
            sent: 0,
        }
    }

    /// Items sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Sends `item`, awaiting a grant while the server holds as many
    /// unread items as it takes. Fails with `Cancelled` once the call
    /// ended (its answer says how: read it), `DeadlineExceeded` once the
    /// call's deadline passed, `InvalidArgument` after
    /// [`finish`](Self::finish), `Unavailable` if the connection broke;
    /// the item is then released.
    pub async fn send(&mut self, item: impl Into<Payload>) -> Result<(), RpcError> {
        if self.finished {
            return Err(RpcError::invalid_argument(
                "the call's items were finished: no more can go",
            ));
        }
        let item = item.into();
        if !self.conn.item_credit(self.id, self.deadline).await? {
            return Err(ended());
        }
        let node = crate::stream::StreamConn::node(&*self.conn).clone();
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
        match crate::stream::StreamConn::send_own(&*self.conn, &f, self.deadline) {
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

    /// Ends the items: the server's handler sees their end once it read
    /// them all. Sending it needs no grant. Idempotent.
    pub async fn finish(&mut self) -> Result<(), RpcError> {
        if std::mem::replace(&mut self.finished, true) {
            return Ok(());
        }
        let f = Frame::last_item(self.id);
        crate::stream::StreamConn::send_own(&*self.conn, &f, self.deadline).map_err(|(e, _)| e)
    }
}

impl AsyncItems {
    /// Cancels the call instead of ending its items (the source of the
    /// items failed): its server is told (best effort, without waiting),
    /// and its answer ends `Cancelled`.
    pub fn abort(mut self) {
        self.finished = true;
        self.conn.cancel_call(self.id);
    }
}

impl Drop for AsyncItems {
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
