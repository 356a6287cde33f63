//! The async (tokio) client: calls are futures, and any number of them may
//! be outstanding on one connection.
//!
//! Sending happens in the calling task (a push into a ring or a socket
//! write, which waits only when the transport is full). A call that reads
//! its own answer while it spins takes it straight from the transport (an
//! answer read by someone else meanwhile is left in its slot); a call
//! that awaits gets it through a oneshot channel, made only then, and its
//! future resolves on whatever runtime awaits it. Who reads the answers
//! is chosen when a call first waits:
//!
//! * a client whose first call is awaited by a server's async handler, on
//!   a transport with a doorbell (shared-memory rings), is read by that
//!   server's listener, which looks at it while it waits for requests and
//!   parks on its bell along with its own (`futex_waitv`): an answer then
//!   costs no thread of its own and no hand-off between threads, and the
//!   dispatcher polls the handler it wakes right away. It is read only
//!   while that dispatcher waits for requests, so a long blocking handler
//!   of the same server delays its answers (to any caller: a client is
//!   read by the listener of the first server that awaited it). When that
//!   server stops, a pump thread takes over;
//! * any other client's calls read the answers themselves while they spin
//!   (the spin of the node's waiting policy, adaptive): a call whose
//!   answer comes within it completes in the task that awaits it, with no
//!   thread in between, as a blocking call does. A call still waiting
//!   when its spin runs out leaves the wait to the connection's pump
//!   thread (started the first time one is needed), which reads answers
//!   while calls rely on it and parks on the transport's doorbell. The
//!   spin holds the runtime's thread, as a blocking call would, for at
//!   most the policy's spin (20 µs by default, less once answers take
//!   longer); a policy without spin (`WaitPolicy::park_only`, or
//!   `DMRPC_WAIT=0,0,20`) never holds it and leaves every wait to the
//!   pump.
//!
//! A dead peer fails every pending and future call on the connection with
//! `Unavailable` (until a call finds the service registered again:
//! [`crate::reconnect`]); a
//! deadline fails the call with `DeadlineExceeded` and sends a cancel, as
//! the blocking client does. Dropping a call's future while it waits (a
//! timeout around it, a `select!` that took another branch) cancels it
//! the same way: the Ref made for its argument is released at once, and
//! so is its answer when it comes.

use crate::call::attempt::{deadline_of, outgoing};
use crate::call::failover::{Failover, Next};
use crate::call::options::{CallOptions, Reply};
use crate::dial::Target;
use crate::error::RpcError;
use crate::handle::ClientOf;
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::Payload;
use crate::reconnect::{Connected, Redial};
use crate::sync::lock;

use arc_swap::Guard;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

mod conn;
mod reader;

pub(crate) use conn::AsyncConn;
use conn::Held;
pub(crate) use reader::polling_with;
use reader::LISTENER;

/// An async client of one service: calls are futures, any number
/// outstanding on one connection. Cheap to clone; clones share the
/// connection. Its connection is replaced when it breaks and the service
/// is registered again ([`crate::reconnect`]). What every client has (its
/// options, its interceptors) is [`ClientOf`]'s.
pub type AsyncClient = ClientOf<AsyncConn>;

impl AsyncClient {
    /// Whether a server's listener reads this client's answers (no pump
    /// thread of its own; see the module's documentation).
    pub fn answers_read_by_listener(&self) -> bool {
        self.h.current().reader.driver.load(Ordering::Acquire) == LISTENER
    }

    /// Whether this client has a pump thread (started when a call first
    /// outlasted its spin; see the module's documentation).
    pub fn has_pump(&self) -> bool {
        lock(&self.h.current().reader.state).pumping
    }

    /// Calls `method` with `payload`. (Like every call of this client,
    /// nothing is sent before the future is first polled.)
    pub fn call<'a>(
        &'a self,
        method: &'a str,
        payload: impl Into<Payload>,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        self.call_with(method, payload.into(), CallOptions::default())
    }

    /// Calls `method` with a copy of `data`, made once: a large argument
    /// is written straight into the pool (`call(method, data)` copies it
    /// into a vector first).
    pub async fn call_slice(&self, method: &str, data: &[u8]) -> Result<Payload, RpcError> {
        match self.payload_for(data) {
            Ok(p) => self.call_with(method, p, CallOptions::default()).await,
            // (A copy that failed ends the call: its answer interceptors see it.)
            Err(e) => self.defaults.answered(method, Err(e)).map(|r| r.payload),
        }
    }

    /// A copy of `data` as this client's calls send it (inline, or written
    /// into the pool when it will travel by Ref).
    pub(crate) fn payload_for(&self, data: &[u8]) -> Result<Payload, RpcError> {
        let i = self.h.live();
        Payload::copy_for(&i.node, i.max_inline, i.refs, data)
    }

    /// Calls `method` with options.
    pub fn call_with<'a>(
        &'a self,
        method: &'a str,
        payload: Payload,
        opts: CallOptions,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        self.call_with_metadata(method, payload, opts, Metadata::new())
    }

    /// Calls `method` with options and metadata, which the handler reads
    /// ([`Call::metadata`](crate::server::Call::metadata)).
    pub fn call_with_metadata<'a>(
        &'a self,
        method: &'a str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> impl std::future::Future<Output = Result<Payload, RpcError>> + Send + 'a {
        Then::new(
            self.call_full(method, payload, opts, meta),
            |r: Result<Reply, RpcError>| r.map(|r| r.payload),
        )
    }

    /// Calls `method` with options and metadata, and returns the answer
    /// with the metadata its handler set (on a failure, the error carries
    /// it: [`RpcError::metadata`]).
    ///
    /// The layers above are this future, not futures around it: an async
    /// fn that awaits another keeps its own copy of the arguments beside
    /// the other's state, and a call's future is held by whatever awaits
    /// it (a server's task boxes it for every call).
    pub fn call_full<'a>(
        &'a self,
        method: &'a str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> impl std::future::Future<Output = Result<Reply, RpcError>> + Send + 'a {
        Then::new(
            self.call_intercepted(method, payload, opts, meta),
            move |r| self.defaults.answered(method, r),
        )
    }

    /// [`call_full`](Self::call_full) before the answer interceptors.
    async fn call_intercepted(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<Reply, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (mut c, opts) = self.usable(opts).await?;
        let mut r = c.call_with(method, payload, opts, meta).await;
        // What Failover decides, done in this task. (Each wait is boxed:
        // a rare state kept out of every call's future. The request is
        // held across it, so that a call dropped meanwhile ends what it
        // lent.)
        let mut f = Failover::new(&opts);
        loop {
            let x = match f.next(r, Instant::now()) {
                Next::End(r) => return self.h.settle(&c, r),
                Next::GiveUp(x) => return Err(x.fail(&c.node)),
                Next::Elsewhere(mut x) => {
                    self.h.refused(&c);
                    let mut n = Guard::into_inner(self.h.live());
                    if f.waits_for(n.link()) {
                        let until = x.deadline();
                        let held = Held(Some(x), c.node.clone());
                        let ready = Box::pin(self.h.ready_async(n, until)).await;
                        x = held.take();
                        match ready {
                            Ok(ready) => n = ready,
                            Err(e) => return Err(x.drop_with(&c.node, e)),
                        }
                    }
                    if !f.takes(&x, n.link(), Arc::ptr_eq(&n, &c)) {
                        return Err(x.fail(&c.node));
                    }
                    c = n;
                    x
                }
                Next::Later(x, wait) => {
                    let held = Held(Some(x), c.node.clone());
                    Box::pin(tokio::time::sleep(wait)).await;
                    let x = held.take();
                    let n = Guard::into_inner(self.h.live());
                    if !f.takes(&x, n.link(), false) {
                        return Err(x.fail(&c.node));
                    }
                    c = n;
                    x
                }
            };
            r = c.resend(*x).await;
        }
    }

    /// The connection a call with `opts` goes over, and its options then:
    /// the current one, or, if it is broken or retired with nothing new to
    /// dial, the one a call that waits for ready waits for; else the
    /// failure (the argument is not even placed).
    async fn usable(
        &self,
        mut opts: CallOptions,
    ) -> Result<(Arc<AsyncConn>, CallOptions), RpcError> {
        // (Held as an Arc: a guard is no thing to keep across awaits.)
        let mut c = Guard::into_inner(self.h.live());
        if c.is_spent() {
            if opts.wait_for_ready {
                let until = deadline_of(&c.node, opts, Instant::now()).0;
                c = Box::pin(self.h.ready_async(c, until)).await?;
                opts = opts.after_waiting(until);
            }
            if let Some(e) = c.failure() {
                return Err(e);
            }
        }
        Ok((c, opts))
    }

    /// Calls streaming method `method` with `payload`: its answer is a
    /// stream of items, read as they come from the
    /// [`AsyncStreaming`](crate::stream::AsyncStreaming). See
    /// [`crate::stream`].
    pub async fn call_stream(
        &self,
        method: &str,
        payload: impl Into<Payload>,
    ) -> Result<crate::stream::AsyncStreaming, RpcError> {
        let p = payload.into();
        self.call_stream_with(method, p, CallOptions::default(), Metadata::new())
            .await
    }

    /// Calls streaming method `method` with options (the deadline bounds
    /// the whole stream; [`CallOptions::window`] is how many items it
    /// holds unread at most) and metadata. The request is sent and the
    /// stream open when this returns; what the server answers comes
    /// through the stream, its errors included.
    pub async fn call_stream_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<crate::stream::AsyncStreaming, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (c, opts) = self.usable(opts).await?;
        let out = outgoing(&c.node, c.max_inline, c.refs, method, payload, opts, meta)?;
        let how = crate::stream::How::of(opts, &out);
        crate::stream::AsyncStreaming::open(self.h.clone(), c, method, out, how).await
    }
}

impl AsyncClient {
    /// Calls method `method` with `payload` and a stream of items the
    /// caller sends after it: a bidirectional stream (the method's
    /// handler answers with items too) or a caller's stream answered
    /// once. See [`crate::stream`].
    pub async fn call_bidi(
        &self,
        method: &str,
        payload: impl Into<Payload>,
    ) -> Result<crate::stream::AsyncBidi, RpcError> {
        let p = payload.into();
        self.call_bidi_with(method, p, CallOptions::default(), Metadata::new())
            .await
    }

    /// [`call_bidi`](Self::call_bidi) with options (the deadline bounds
    /// the whole call; [`CallOptions::window`] is how many of the
    /// server's items it holds unread at most) and metadata. The request
    /// is sent when this returns; the caller's items go as the server
    /// grants them. Unlike a server's stream, the request is never sent
    /// to another server once it went: its items follow it.
    pub async fn call_bidi_with(
        &self,
        method: &str,
        payload: Payload,
        opts: CallOptions,
        meta: Metadata,
    ) -> Result<crate::stream::AsyncBidi, RpcError> {
        let (opts, meta) = self.defaults.apply(method, &payload, opts, meta)?;
        let (c, opts) = self.usable(opts).await?;
        let out = outgoing(&c.node, c.max_inline, c.refs, method, payload, opts, meta)?;
        let how = crate::stream::How::of(opts, &out);
        crate::stream::AsyncBidi::open(self.h.clone(), c, method, out, how).await
    }
}

/// A future whose output goes through a function when it is ready: a
/// layer that adds nothing to the future's state but the function.
pub(crate) struct Then<F, G>(F, Option<G>);

impl<F, G> Then<F, G> {
    pub(crate) fn new(fut: F, then: G) -> Self {
        Then(fut, Some(then))
    }
}

impl<F: std::future::Future, G: FnOnce(F::Output) -> T, T> std::future::Future for Then<F, G> {
    type Output = T;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<T> {
        // SAFETY: the inner future is pinned structurally: it is never
        // moved out of `self`, which is pinned; the function is not
        // pinned (only taken, by value).
        let this = unsafe { self.get_unchecked_mut() };
        if this.1.is_none() {
            // Polled again after it was ready (its future is done and
            // must not be polled): pending for ever, as the Future
            // contract allows.
            return Poll::Pending;
        }
        // SAFETY: as above.
        let fut = unsafe { std::pin::Pin::new_unchecked(&mut this.0) };
        match fut.poll(cx) {
            Poll::Ready(v) => this.1.take().map_or(Poll::Pending, |g| Poll::Ready(g(v))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Node {
    /// Like [`connect`](Self::connect), for async callers: calls are
    /// futures, any number may be outstanding on the connection.
    pub fn connect_async(&self, name: &str) -> Result<AsyncClient, RpcError> {
        Ok(AsyncClient::new(
            self.redialer(Target::Name(name.to_owned()))?,
        ))
    }

    /// Like [`connect_lazily`](Self::connect_lazily), for async callers.
    pub fn connect_async_lazily(&self, name: &str) -> Result<AsyncClient, RpcError> {
        dm_pool::validate_service_name(name)?;
        Ok(AsyncClient::new(Redial::unconnected(
            self.clone(),
            Target::Name(name.to_owned()),
        )))
    }

    /// Like [`connect_tcp`](Self::connect_tcp), for async callers.
    pub fn connect_tcp_async(&self, addr: &str) -> Result<AsyncClient, RpcError> {
        Ok(AsyncClient::new(
            self.redialer(Target::Addr(addr.to_owned()))?,
        ))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::reader::{Slot, PUMP};
    use super::*;
    use crate::frame::Body;
    use crate::frame::{Frame, Status};
    use crate::transport::{Connection, TransportError};
    use crate::transport::{FrameRx, FrameTx};
    use std::sync::mpsc;
    use std::time::Duration;

    /// Pending at its first poll (waking its waker), ready at the next.
    struct YieldOnce(bool);

    impl std::future::Future for YieldOnce {
        type Output = ();
        fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
            if self.0 {
                return Poll::Ready(());
            }
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    /// `Then` polls a future that borrows from itself across an await (so
    /// must stay where it is pinned) and maps its output once; a second
    /// poll after it was ready stays pending; one dropped while pending
    /// drops its future in place. (Run under Miri by `scripts/miri.sh`:
    /// its pinning is unsafe code.)
    #[test]
    fn then_maps_a_pinned_futures_output() {
        use std::future::Future;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let inner = async {
            let v = vec![1u8, 2, 3];
            let r = &v;
            YieldOnce(false).await;
            r.len()
        };
        let mut t = std::pin::pin!(Then::new(inner, |n: usize| n * 10));
        assert!(t.as_mut().poll(&mut cx).is_pending());
        assert_eq!(t.as_mut().poll(&mut cx), Poll::Ready(30));
        assert!(t.as_mut().poll(&mut cx).is_pending());
        let dropped = std::sync::Arc::new(());
        let held = dropped.clone();
        let pending = async move {
            let _held = held;
            YieldOnce(false).await;
        };
        let mut t = Box::pin(Then::new(pending, |()| ()));
        assert!(t.as_mut().poll(&mut cx).is_pending());
        drop(t);
        assert_eq!(std::sync::Arc::strong_count(&dropped), 1);
    }

    /// A receiving half fed by the test.
    struct FedRx(mpsc::Receiver<Frame>);

    impl FrameRx for FedRx {
        fn recv(&mut self, _deadline: Option<Instant>) -> Result<Option<Frame>, TransportError> {
            Ok(self.0.try_recv().ok())
        }
    }

    /// A sending half that takes everything.
    struct Sink;

    impl FrameTx for Sink {
        fn send(&mut self, _f: &Frame, _d: Option<Instant>) -> Result<bool, TransportError> {
            Ok(true)
        }
    }

    fn answer(id: u64, byte: u8) -> Frame {
        Frame::response(id, Status::Ok, Body::Inline(vec![byte].into()))
    }

    fn byte(got: Option<Result<Frame, RpcError>>) -> u8 {
        match got {
            Some(Ok(Frame {
                payload: Body::Inline(b),
                ..
            })) => b[0],
            other => panic!("no answer: {other:?}"),
        }
    }

    #[test]
    fn spinning_calls_take_their_own_answers_and_find_the_others_in_their_slots() {
        let (_tp, c, feed) = fed_client(crate::WaitPolicy::default());
        let i = c.h.current();
        let r = &i.reader;
        r.driver.store(PUMP, Ordering::Release);
        for id in 1..=4 {
            r.insert(&mut lock(&r.state), id, Slot::Spinning);
        }
        // Call 1 reads past call 2's answer to its own: call 2's waits in
        // its slot.
        feed.send(answer(2, 20)).unwrap();
        feed.send(answer(1, 10)).unwrap();
        assert_eq!(byte(r.take_own(1)), 10);
        assert_eq!(r.ready.load(Ordering::Relaxed), 1);
        assert_eq!(byte(r.take_own(2)), 20);
        assert_eq!(r.ready.load(Ordering::Relaxed), 0);
        assert!(r.take_own(3).is_none(), "no answer yet");
        // Call 3's spin ran out after its answer came: it takes it
        // instead of waiting on a channel.
        feed.send(answer(3, 30)).unwrap();
        assert!(r.take_own(4).is_none());
        match r.await_own(3) {
            Err(got) => assert_eq!(byte(Some(got)), 30),
            Ok(_) => panic!("call 3 would wait for an answer already there"),
        }
        // Call 4 awaits on a channel; a second answer to it is dropped.
        let mut w = r
            .await_own(4)
            .unwrap_or_else(|_| panic!("call 4 has no answer yet"));
        feed.send(answer(4, 40)).unwrap();
        feed.send(answer(4, 41)).unwrap();
        assert!(r.take_own(99).is_none());
        assert_eq!(byte(w.try_recv().ok()), 40);
        assert_eq!(lock(&r.state).pending.len(), 0);
        // A connection that breaks while a call spins fails that call.
        r.insert(&mut lock(&r.state), 5, Slot::Spinning);
        r.break_all(RpcError::unavailable("gone"));
        match r.take_own(5) {
            Some(Err(e)) => assert_eq!(e.status, Status::Unavailable),
            other => panic!("call 5 got {other:?}"),
        }
        assert_eq!(r.ready.load(Ordering::Relaxed), 0);
        assert_eq!(r.waiting.load(Ordering::Relaxed), 0);
    }

    /// A client whose connection takes every frame and whose answers the
    /// test feeds, on a pool of its own.
    fn fed_client(
        wait: crate::WaitPolicy,
    ) -> (dm_pool::testing::TempPool, AsyncClient, mpsc::Sender<Frame>) {
        let tp = dm_pool::testing::TempPool::new(16 << 20);
        let node = Node::with_config(
            tp.attach(),
            crate::Config {
                wait,
                ..Default::default()
            },
        );
        let (feed, rx) = mpsc::channel();
        let conn = Connection {
            tx: Box::new(Sink),
            rx: Box::new(FedRx(rx)),
            max_inline: 1 << 20,
            refs: crate::transport::Sharing::POOL,
            goaway: crate::transport::silent(),
        };
        let target = crate::dial::Target::Name("test/lone".into());
        let h = Redial::new(node, target, crate::dial::Origin::Addr, conn);
        (tp, AsyncClient::new(h), feed)
    }

    #[test]
    fn a_lone_call_reads_its_own_answer_and_hands_the_others_theirs() {
        let (_tp, c, feed) = fed_client(crate::WaitPolicy::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // Another call (id 100) spins meanwhile, through its slot.
        let r = c.h.current().reader.clone();
        r.insert(&mut lock(&r.state), 100, Slot::Spinning);
        feed.send(answer(100, 7)).unwrap();
        feed.send(answer(1, 10)).unwrap();
        let got = rt.block_on(c.call("m", Payload::empty())).unwrap();
        assert_eq!(got.to_vec().unwrap(), [10]);
        assert!(!c.has_pump(), "the answer was there: no pump");
        assert_eq!(byte(r.take_own(100)), 7);
        // A lone call whose spin runs out leaves its answer to the pump.
        let (_tp, c, feed) = fed_client(crate::WaitPolicy::park_only());
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            feed.send(answer(1, 11)).unwrap();
        });
        let got = rt.block_on(c.call("m", Payload::empty())).unwrap();
        assert_eq!(got.to_vec().unwrap(), [11]);
        assert!(c.has_pump());
        late.join().unwrap();
    }
}
