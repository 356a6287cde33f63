//! The async (tokio) client: calls are futures, and any number of them may
//! be outstanding on one connection.
//!
//! Sending happens in the calling task (a push into a ring or a socket
//! write, which waits only when the transport is full). Answers are read by
//! one pump thread per connection, which waits with the node's waiting
//! policy and completes each call's oneshot; a call's future then resolves
//! on whatever runtime awaits it. A dead peer fails every pending and
//! future call with `Unavailable`; a deadline fails the call with
//! `DeadlineExceeded` and sends a cancel, as the blocking client does.

use crate::client::{answer, orphan, outgoing};
use crate::error::RpcError;
use crate::frame::{method_id, Frame, Kind};
use crate::node::Node;
use crate::payload::Payload;
use crate::transport::{Connection, FrameRx, FrameTx};
use crate::CallOptions;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

type Reply = oneshot::Sender<Result<Frame, RpcError>>;

/// An async connection to one service. Cheap to clone.
#[derive(Clone)]
pub struct AsyncClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AsyncClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncClient")
            .field("service", &self.inner.name)
            .finish()
    }
}

struct Inner {
    node: Node,
    name: String,
    tx: Mutex<Box<dyn FrameTx>>,
    state: Arc<Mutex<State>>,
    next_id: AtomicU64,
    max_inline: usize,
    refs: crate::transport::Sharing,
}

#[derive(Default)]
struct State {
    pending: HashMap<u64, Reply>,
    broken: Option<RpcError>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl AsyncClient {
    pub(crate) fn new(node: Node, name: &str, conn: Connection) -> Result<AsyncClient, RpcError> {
        let state = Arc::new(Mutex::new(State::default()));
        let inner = Arc::new(Inner {
            node: node.clone(),
            name: name.to_owned(),
            tx: Mutex::new(conn.tx),
            state: state.clone(),
            next_id: AtomicU64::new(1),
            max_inline: conn.max_inline,
            refs: conn.refs,
        });
        let weak = Arc::downgrade(&inner);
        let rx = conn.rx;
        std::thread::Builder::new()
            .name(format!("dmrpc-pump:{name}"))
            .spawn(move || pump(rx, state, weak, node))
            .map_err(|e| RpcError::internal(format!("cannot start the answer pump: {e}")))?;
        Ok(AsyncClient { inner })
    }

    /// The service this client calls.
    pub fn service(&self) -> &str {
        &self.inner.name
    }

    /// Calls `method` with `payload`.
    pub async fn call(
        &self,
        method: &str,
        payload: impl Into<Payload>,
    ) -> Result<Payload, RpcError> {
        self.call_with(method, payload.into(), CallOptions::default())
            .await
    }

    /// Calls `method` with a copy of `data`, made once: a large argument
    /// is written straight into the pool (`call(method, data)` copies it
    /// into a vector first).
    pub async fn call_slice(&self, method: &str, data: &[u8]) -> Result<Payload, RpcError> {
        let i = &*self.inner;
        let p = Payload::copy_for(&i.node, i.max_inline, i.refs, data)?;
        self.call_with(method, p, CallOptions::default()).await
    }

    /// Calls `method` with options.
    pub async fn call_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
    ) -> Result<Payload, RpcError> {
        let i = &*self.inner;
        let out = outgoing(&i.node, i.max_inline, i.refs, payload, opts)?;
        let (deadline, lent) = (out.deadline, out.lent);
        let id = i.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, waiting) = oneshot::channel();
        {
            let mut st = lock(&i.state);
            if let Some(e) = &st.broken {
                let e = e.clone();
                drop(st);
                lent.release(&i.node);
                return Err(e);
            }
            st.pending.insert(id, reply);
        }
        let frame = Frame::request(id, method_id(method), out.deadline_us, out.body);
        let sent = lock(&i.tx).send(&frame, deadline);
        drop(frame);
        let fail = |e: RpcError| {
            lock(&i.state).pending.remove(&id);
            e
        };
        match sent {
            Ok(true) => {}
            Ok(false) => {
                lent.release(&i.node);
                return Err(fail(RpcError::deadline_exceeded(
                    "no room to send before the deadline",
                )));
            }
            Err(e) => {
                lent.release(&i.node);
                return Err(fail(e.into()));
            }
        }
        let got = match deadline {
            None => waiting.await,
            Some(d) => match tokio::time::timeout_at(d.into(), waiting).await {
                Ok(r) => r,
                Err(_) => {
                    lock(&i.state).pending.remove(&id);
                    lent.release(&i.node);
                    let _ = lock(&i.tx).send(&Frame::cancel(id), Some(Instant::now()));
                    return Err(RpcError::deadline_exceeded(format!(
                        "no answer from {:?} before the deadline",
                        i.name
                    )));
                }
            },
        };
        let f = match got {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                lent.release(&i.node);
                return Err(e);
            }
            Err(_) => {
                lent.release(&i.node);
                return Err(RpcError::unavailable("the connection closed"));
            }
        };
        answer(&i.node, f, lent)
    }
}

/// Reads answers and completes the calls waiting for them, until the
/// client is dropped or the connection breaks.
fn pump(mut rx: Box<dyn FrameRx>, state: Arc<Mutex<State>>, client: Weak<Inner>, node: Node) {
    loop {
        if client.strong_count() == 0 {
            return;
        }
        match rx.recv(Some(Instant::now() + Duration::from_millis(100))) {
            Ok(None) => {}
            Ok(Some(f)) if f.kind == Kind::Response => {
                let waiter = lock(&state).pending.remove(&f.call_id);
                match waiter {
                    Some(w) => {
                        if let Err(Ok(f)) = w.send(Ok(f)) {
                            orphan(&node, f);
                        }
                    }
                    None => orphan(&node, f),
                }
            }
            Ok(Some(_)) => {
                break_all(
                    &state,
                    RpcError::internal("the server sent a frame that is not a response"),
                );
                return;
            }
            Err(e) => {
                break_all(&state, e.into());
                return;
            }
        }
    }
}

fn break_all(state: &Mutex<State>, e: RpcError) {
    let mut st = lock(state);
    st.broken.get_or_insert(e.clone());
    for (_, w) in st.pending.drain() {
        let _ = w.send(Err(e.clone()));
    }
}
