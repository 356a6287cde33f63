//! The dispatcher: one thread per server that takes requests from every
//! connection in fair order and runs their handlers (see the module
//! documentation of `server/`).

use super::handler::{
    intercept, panicked, run_bidi, run_handler, run_stream, AsyncCall, DisconnectHook,
    HandlerFuture, Interceptor, Method, Methods, Peer, Scope,
};
use super::intake::{ended_items_of, intake, pending, refuse, Later, Pending, To};
use super::running::{bump, Stats};
use super::tasks::{Task, TaskWake, Tasks};
use crate::async_client::polling_with;
use crate::error::RpcError;
use crate::frame::{Body, Frame, Kind, Status, FLAG_CALLER_STREAM, FLAG_STREAM};
use crate::metadata::Metadata;
use crate::node::Node;
use crate::payload::{Dir, Payload};
use crate::stream::{AsyncInbox, AsyncSink, Inbox, Inlet, Outlet, Sink};
use crate::transport::{ConnId, Listener, Waker, WatchSet};
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant};

/// The call's future of an async stream whose handler `make` makes: it
/// ends once the items it queued in `outlet` went out.
fn items_before_end(
    make: impl FnOnce(AsyncCall) -> crate::server::StreamFuture,
    outlet: Arc<Outlet>,
) -> impl FnOnce(AsyncCall) -> HandlerFuture {
    move |c| {
        let fut = make(c);
        Box::pin(async move {
            let r = fut.await;
            // Its items go before its end, which may carry the last one.
            let flushed = outlet.flushed().await;
            r.and(flushed)
                .map(|()| outlet.take_last().unwrap_or_default())
        })
    }
}

pub(super) struct Dispatcher {
    pub(super) node: Node,
    pub(super) methods: Methods,
    /// What serves the methods not registered, if anything.
    pub(super) fallback: Option<(Arc<str>, Method)>,
    /// Run before every handler ([`ServerBuilder::intercept`]).
    pub(super) interceptors: Vec<Interceptor>,
    /// Metadata keys passed on ([`ServerBuilder::propagate_metadata`]).
    pub(super) propagate: Vec<String>,
    pub(super) listener: Box<dyn Listener>,
    pub(super) stop: Arc<AtomicBool>,
    /// Set by [`Server::shutdown_gracefully`].
    pub(super) drain_by: Arc<OnceLock<Instant>>,
    /// Draining, until this time at the latest: requests read now are
    /// refused.
    pub(super) draining: Option<Instant>,
    pub(super) stats: Arc<Stats>,
    pub(super) queue: VecDeque<Pending>,
    /// Async handlers' calls in progress (dropped before the runtime their
    /// timers and I/O belong to).
    pub(super) tasks: Tasks,
    /// The async streams in progress: their items, sent by the
    /// dispatcher between polls.
    pub(super) outlets: Vec<Arc<Outlet>>,
    /// The items callers send to the calls in progress, taken in by the
    /// dispatcher (which sends their grants).
    pub(super) inlets: Vec<Arc<Inlet>>,
    /// The context async handlers are polled in (only if the server has
    /// some): their timers, I/O and spawned tasks.
    pub(super) rt: Option<tokio::runtime::Runtime>,
    /// Pokes the dispatcher (out of a wait for requests).
    pub(super) waker: Waker,
    /// Where async clients awaited by async handlers register, so that the
    /// listener reads their answers (if it can, and the server has async
    /// methods).
    pub(super) watch: Option<Arc<WatchSet>>,
    /// This server among the process's: with a connection's id, its
    /// [`Peer`].
    pub(super) serial: u64,
    /// Run when a connection that made calls closes
    /// ([`ServerBuilder::on_disconnect`](crate::ServerBuilder::on_disconnect)).
    pub(super) on_disconnect: Option<DisconnectHook>,
    /// The connections that made calls, while a hook waits for their
    /// end, and when they were last looked at.
    pub(super) peers: HashSet<ConnId>,
    pub(super) peers_seen: Instant,
}

/// How often a server with a disconnect hook looks for connections gone.
const PEERS_EVERY: Duration = Duration::from_millis(100);

impl Dispatcher {
    pub(super) fn run(mut self) {
        self.serve_until_stopped();
        self.close();
    }

    /// The end, however the server stops: the requests taken and never
    /// run are refused ([`FLAG_REFUSED`](crate::frame::FLAG_REFUSED)),
    /// and every client is told which of its requests were taken
    /// ([`Listener::go_away`]): their callers send the others elsewhere.
    fn close(&mut self) {
        for o in std::mem::take(&mut self.outlets) {
            o.end(&self.node, RpcError::unavailable("the server is stopping"));
        }
        for i in std::mem::take(&mut self.inlets) {
            i.end(&self.node, RpcError::unavailable("the server is stopping"));
        }
        for p in std::mem::take(&mut self.queue) {
            if p.frame.kind == Kind::Request {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                let answer = Frame::refused(p.frame.call_id, "the service is shutting down");
                let _ = self.listener.reply(p.conn, &answer);
            }
        }
        self.listener.go_away();
        // Every connection ends with the server.
        for conn in std::mem::take(&mut self.peers) {
            self.disconnected(conn);
        }
    }

    /// Runs the disconnect hook for `conn` (a panic in it is its own).
    fn disconnected(&self, conn: ConnId) {
        if let Some(h) = &self.on_disconnect {
            let peer = Peer::new(self.serial, conn);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(peer)));
        }
    }

    /// Runs the disconnect hook for the connections that closed since the
    /// last look (at most every [`PEERS_EVERY`]).
    fn tend_peers(&mut self) {
        if self.peers.is_empty() || self.peers_seen.elapsed() < PEERS_EVERY {
            return;
        }
        self.peers_seen = Instant::now();
        let gone: Vec<ConnId> = (self.peers.iter())
            .copied()
            .filter(|&c| !self.listener.is_open(c))
            .collect();
        for conn in gone {
            self.peers.remove(&conn);
            self.disconnected(conn);
        }
    }

    fn serve_until_stopped(&mut self) {
        while !self.stop.load(Ordering::Acquire) {
            if self.rt.is_some() {
                self.poll_woken();
            }
            if !self.outlets.is_empty() || !self.inlets.is_empty() {
                self.tend_outlets();
            }
            if self.on_disconnect.is_some() {
                self.tend_peers();
            }
            if self.drained() {
                return;
            }
            let p = match self.queue.pop_front() {
                Some(p) => p,
                None => match self.listener.next(self.wake_by()) {
                    Ok(Some((conn, frame))) if !self.refused(conn, &frame) => pending(conn, frame),
                    Ok(_) => continue,
                    Err(_) => return,
                },
            };
            match p.frame.kind {
                Kind::Request => self.serve(p),
                // Every transport keeps a connection's frames in order, so
                // the request of a cancel read here was served already, or
                // is an async handler's call in progress.
                Kind::Cancel => {
                    self.cancel_task(p.conn, p.frame.call_id);
                }
                // A grant for an async stream in progress (one for a
                // stream that ended is dropped).
                Kind::Credit => self.grant(p.conn, p.frame.call_id, p.frame.method),
                // An item of a caller's stream.
                Kind::Item => self.feed_item(p.conn, p.frame),
                // Clients do not send responses or go-aways.
                // (Parts are joined by the transport: none gets here.)
                Kind::Response | Kind::GoAway | Kind::Part => {}
            }
        }
    }

    /// When the wait for the next frame ends at the latest: the next look
    /// for connections gone, if a disconnect hook waits for one; the end
    /// of a graceful shutdown; with async streams in progress, their earliest
    /// deadline, and soon enough to notice a caller gone (50 ms, as a
    /// blocking stream's sink does) or, over a transport whose listener
    /// does not say when room comes, to send items that found none (a
    /// millisecond).
    fn wake_by(&self) -> Option<Instant> {
        let by = self.streams_wake_by();
        if self.peers.is_empty() {
            return by;
        }
        // (A disconnect hook waits for a connection's end.)
        let look = self.peers_seen + PEERS_EVERY;
        Some(by.map_or(look, |b| b.min(look)))
    }

    /// When the wait ends at the latest for the streams in progress and
    /// a graceful shutdown (see [`wake_by`](Self::wake_by)).
    fn streams_wake_by(&self) -> Option<Instant> {
        if self.outlets.is_empty() && self.inlets.is_empty() {
            return self.draining;
        }
        let poll = !self.listener.wakes_for_room()
            && (self.outlets.iter().any(|o| o.unsent()) || self.inlets.iter().any(|i| i.owes()));
        let slice = Duration::from_millis(if poll { 1 } else { 50 });
        let mut by = Instant::now() + slice;
        for d in self.outlets.iter().filter_map(|o| o.deadline) {
            by = by.min(d);
        }
        Some(self.draining.map_or(by, |d| d.min(by)))
    }

    /// Sends the items the async streams queued, as far as their
    /// connections have room, and ends the streams whose callers are
    /// gone or whose deadlines passed.
    fn tend_outlets(&mut self) {
        let now = Instant::now();
        let (listener, stats, node) = (&mut self.listener, &self.stats, &self.node);
        for i in &self.inlets {
            i.flush(node, &mut **listener);
            if !listener.is_open(i.conn) {
                i.end(node, RpcError::unavailable("the call's caller is gone"));
            }
        }
        for o in &self.outlets {
            o.flush(node, &mut **listener, stats);
            if !listener.is_open(o.conn) {
                o.end(node, RpcError::unavailable("the stream's caller is gone"));
            } else if o.deadline.is_some_and(|d| now >= d) {
                o.end(
                    node,
                    RpcError::deadline_exceeded("the stream's deadline passed"),
                );
            }
        }
    }

    /// Stream `id` of `conn` was granted `n` more items: its sink may go
    /// on, if it is an async stream in progress.
    fn grant(&mut self, conn: ConnId, id: u64, n: u32) {
        if let Some(o) = self.outlets.iter().find(|o| o.conn == conn && o.id == id) {
            o.grant(n);
        }
    }

    /// An item the caller of call `f.call_id` of `conn` sent: to its
    /// handler's inbox; the end of the items of a queued request is noted
    /// there; any other is released (its call ended, or never took items).
    fn feed_item(&mut self, conn: ConnId, f: Frame) {
        if let Some(i) = self
            .inlets
            .iter()
            .find(|i| i.conn == conn && i.id == f.call_id)
        {
            i.take(&self.node, f);
        } else if !ended_items_of(&mut self.queue, conn, &f) {
            crate::call::attempt::orphan(&self.node, f);
        }
    }

    /// Applies what was read for calls in progress while a handler ran.
    fn apply(&mut self, later: Vec<Later>) {
        for l in later {
            match l {
                Later::Cancel(conn, id) => self.cancel_task(conn, id),
                Later::Credit(conn, id, n) => self.grant(conn, id, n),
                Later::Item(conn, f) => self.feed_item(conn, f),
            }
        }
    }

    /// A call's inlet goes (its call ended): what it still held is
    /// released, and what comes for it later too.
    fn close_inlet(&mut self, inlet: Option<Arc<Inlet>>) {
        if let Some(i) = inlet {
            self.inlets.retain(|x| !Arc::ptr_eq(x, &i));
            i.end_call(&self.node);
        }
    }

    /// An async stream's call ended (answered, or cancelled): its outlet
    /// goes, and what it still held is released.
    fn close_outlet(&mut self, outlet: Option<Arc<Outlet>>) {
        if let Some(o) = outlet {
            self.outlets.retain(|x| !Arc::ptr_eq(x, &o));
            o.finish(&self.node);
        }
    }

    /// Whether a graceful shutdown is done: nothing queued or in progress,
    /// or its time is up. The first time it sees one begin, it queues what
    /// was sent before (to be served): what comes after is refused.
    fn drained(&mut self) -> bool {
        let Some(by) = self.draining else {
            let Some(&by) = self.drain_by.get() else {
                return false;
            };
            self.drain();
            self.draining = Some(by);
            return false;
        };
        let busy = self.tasks.slots.len() > self.tasks.free.len() || self.listener.holding();
        (self.queue.is_empty() && !busy) || Instant::now() >= by
    }

    /// Answers `f` with `Unavailable` if it is a request read while the
    /// server drains (true), instead of taking it.
    fn refused(&mut self, conn: ConnId, f: &Frame) -> bool {
        refuse(&mut *self.listener, &self.stats, self.draining, conn, f)
    }

    /// Moves every frame already waiting into the queue, applying cancels,
    /// so that a request cancelled while queued never runs.
    fn drain(&mut self) {
        let mut later = Vec::new();
        let (stats, draining) = (&self.stats, self.draining);
        intake(
            &mut *self.listener,
            &mut self.queue,
            stats,
            draining,
            &mut later,
        );
        self.apply(later);
    }

    fn serve(&mut self, p: Pending) {
        let Pending {
            conn,
            frame,
            deadline,
            credit,
            items_ended,
        } = p;
        let to = To {
            conn,
            id: frame.call_id,
            echo: match &frame.payload {
                Body::Refs(rs) if rs.len() == 1 => Some(rs[0]),
                _ => None,
            },
        };
        // Cancels of async calls and grants of async streams read while a
        // blocking handler ran.
        let mut later = Vec::new();
        if self.on_disconnect.is_some() {
            self.peers.insert(conn);
        }
        let mut scope = Scope {
            peer: Peer::new(self.serial, conn),
            deadline,
            meta: Default::default(),
        };
        if !frame.meta.is_empty() {
            if !self.propagate.is_empty() {
                scope.meta.inherited = frame.meta.only(&self.propagate);
            }
            scope.meta.follow_inline = crate::choice::came_inline(&frame.meta);
        }
        let method = self.methods.get(&frame.method).or(self.fallback.as_ref());
        let result = if deadline.is_some_and(|d| Instant::now() >= d) {
            self.stats.expired.fetch_add(1, Ordering::Relaxed);
            Err(RpcError::deadline_exceeded(
                "the deadline passed while the request was queued",
            ))
        } else if let Err(e) = intercept(&self.interceptors, method, &frame, &mut scope) {
            Err(e)
        } else {
            match method {
                Some((
                    name,
                    Method::Stream(_)
                    | Method::AsyncStream(_)
                    | Method::Bidi(_)
                    | Method::AsyncBidi(_),
                )) if frame.flags & FLAG_STREAM == 0 => Err(RpcError::invalid_argument(format!(
                    "method {name:?} answers with a stream: call it with call_stream"
                ))),
                Some((name, m))
                    if frame.flags & FLAG_CALLER_STREAM != 0
                        && !matches!(m, Method::Bidi(_) | Method::AsyncBidi(_)) =>
                {
                    Err(RpcError::invalid_argument(format!(
                        "method {name:?} takes no items from its caller: call it with call or \
                         call_stream"
                    )))
                }
                Some((name, Method::Async(h))) => {
                    let h = h.clone();
                    let started =
                        self.start_future(name, (frame.payload, frame.meta), &mut scope, |c| h(c));
                    match started {
                        Ok(fut) => {
                            self.start_async(to, frame.method, fut, scope, (None, None));
                            self.drain();
                            return;
                        }
                        Err(e) => Err(e),
                    }
                }
                Some((name, Method::Blocking(h))) => {
                    // What the handler's looks for a cancel of its call
                    // read: requests are queued, cancels of queued ones
                    // applied, those of async calls kept for after it.
                    let (listener, queue) = (&mut self.listener, &mut self.queue);
                    let (stats, draining) = (&self.stats, self.draining);
                    let running = (conn, frame.call_id);
                    let mut seen = false;
                    let mut check = || {
                        if !seen {
                            intake(&mut **listener, queue, stats, draining, &mut later);
                            let mine = Later::Cancel(running.0, running.1);
                            if let Some(k) = later.iter().position(|c| *c == mine) {
                                // (In order: a caller's items stay in theirs.)
                                later.remove(k);
                                seen = true;
                            }
                        }
                        seen
                    };
                    let req = (frame.payload, frame.meta);
                    run_handler(h, name, &self.node, req, &mut scope, &mut check)
                }
                Some((name, Method::Stream(h))) => {
                    let feed = crate::stream::Feed::new(
                        &mut *self.listener,
                        &mut self.queue,
                        &self.stats,
                        self.draining,
                        ((conn, frame.call_id), credit),
                    );
                    let cell = std::cell::RefCell::new(feed);
                    let mut sink =
                        Sink::new(&cell, &self.node, &self.stop, deadline, frame.call_id);
                    let req = (frame.payload, frame.meta);
                    let r = run_stream(h, name, &self.node, req, &mut scope, &mut sink);
                    later = cell.borrow_mut().take_later();
                    r.map(|()| Payload::empty())
                }
                Some((name, Method::Bidi(h))) => {
                    let items = frame.flags & FLAG_CALLER_STREAM != 0 && !items_ended;
                    let mut feed = crate::stream::Feed::new(
                        &mut *self.listener,
                        &mut self.queue,
                        &self.stats,
                        self.draining,
                        ((conn, frame.call_id), credit),
                    );
                    feed.taking = Some(crate::stream::Taking::new(items));
                    let cell = std::cell::RefCell::new(feed);
                    let mut sink =
                        Sink::new(&cell, &self.node, &self.stop, deadline, frame.call_id);
                    let mut inbox = Inbox::new(&cell, &self.node, &self.stop, deadline);
                    let req = (frame.payload, frame.meta);
                    let io = (&mut inbox, &mut sink);
                    let r = run_bidi(h, name, &self.node, req, &mut scope, io);
                    let mut f = cell.borrow_mut();
                    later = f.take_later();
                    if let Some(t) = f.taking.take() {
                        t.release(&self.node);
                    }
                    r.map(|()| Payload::empty())
                }
                Some((name, Method::AsyncStream(h))) => {
                    let outlet = Arc::new(Outlet::new(conn, frame.call_id, deadline, credit));
                    let sink = self.sink(&outlet, conn);
                    let h = h.clone();
                    let make = move |c| h(c, sink);
                    let req = (frame.payload, frame.meta);
                    let make = items_before_end(make, outlet.clone());
                    match self.start_future(name, req, &mut scope, make) {
                        Ok(fut) => {
                            let io = (outlet, None);
                            self.start_stream(to, frame.method, fut, scope, io);
                            return;
                        }
                        Err(e) => Err(e),
                    }
                }
                Some((name, Method::AsyncBidi(h))) => {
                    let outlet = Arc::new(Outlet::new(conn, frame.call_id, deadline, credit));
                    let sink = self.sink(&outlet, conn);
                    let items = frame.flags & FLAG_CALLER_STREAM != 0 && !items_ended;
                    // (A caller that sends no items gets an inbox with
                    // nothing behind it: no inlet to keep, flush or close.)
                    let inlet = items.then(|| Arc::new(Inlet::new(conn, frame.call_id, true)));
                    let inbox =
                        AsyncInbox::new(inlet.clone(), self.node.clone(), self.waker.clone());
                    let h = h.clone();
                    let make = move |c| h(c, inbox, sink);
                    let req = (frame.payload, frame.meta);
                    let make = items_before_end(make, outlet.clone());
                    match self.start_future(name, req, &mut scope, make) {
                        Ok(fut) => {
                            let io = (outlet, inlet);
                            self.start_stream(to, frame.method, fut, scope, io);
                            return;
                        }
                        Err(e) => Err(e),
                    }
                }
                None => Err(RpcError::not_found(crate::error::no_method(frame.method))),
            }
        };
        self.apply(later);
        self.answer(to, result, scope.meta.reply);
    }

    /// The sink of an async stream whose items leave through `outlet`, on
    /// connection `conn`.
    fn sink(&self, outlet: &Arc<Outlet>, conn: ConnId) -> AsyncSink {
        let (ours, max) = (self.node.cfg.threshold(), self.listener.max_inline());
        AsyncSink::new(
            outlet.clone(),
            self.node.clone(),
            self.waker.clone(),
            ours.min(max),
            self.listener.refs(conn),
        )
    }

    /// Starts an async stream's call, its future made: its items go out
    /// through `outlet`, its caller's come in through `inlet` (whose first
    /// grant goes at once, if there is room), and its connection's other
    /// requests go on beside it.
    fn start_stream(
        &mut self,
        to: To,
        method: u32,
        fut: HandlerFuture,
        scope: Scope,
        (outlet, inlet): (Arc<Outlet>, Option<Arc<Inlet>>),
    ) {
        self.listener.stream_beside(to.conn, to.id);
        self.outlets.push(outlet.clone());
        if let Some(i) = &inlet {
            i.flush(&self.node, &mut *self.listener);
            self.inlets.push(i.clone());
        }
        self.start_async(to, method, fut, scope, (Some(outlet), inlet));
        self.drain();
    }

    /// The future of an async handler's call of method `name` with
    /// request `req` (payload and metadata), made by `make` in the call's
    /// scope and the server's runtime context (a handler may touch tokio
    /// before its first await); a panic is the call's error.
    fn start_future(
        &self,
        name: &Arc<str>,
        (body, metadata): (Body, Metadata),
        scope: &mut Scope,
        make: impl FnOnce(AsyncCall) -> HandlerFuture,
    ) -> Result<HandlerFuture, RpcError> {
        let call = AsyncCall {
            payload: Payload::from_request_body(body, &self.node)?,
            deadline: scope.deadline,
            method: name.clone(),
            node: self.node.clone(),
            metadata,
            peer: scope.peer,
        };
        let _rt = self.rt.as_ref().map(|rt| rt.enter());
        polling_with(self.watch.as_ref(), || scope.run(|| make(call)))
            .map_err(|p| panicked(name, &*p))
    }

    /// Starts an async handler's call: polls it at once (it runs up to
    /// its first await), and keeps it until it completes.
    fn start_async(
        &mut self,
        to: To,
        method: u32,
        fut: HandlerFuture,
        scope: Scope,
        (outlet, inlet): (Option<Arc<Outlet>>, Option<Arc<Inlet>>),
    ) {
        let t = &mut self.tasks;
        let slot = t.free.pop().unwrap_or_else(|| {
            let slot = t.slots.len();
            t.slots.push(None);
            t.wakers.push(std::task::Waker::from(Arc::new(TaskWake {
                slot,
                woken: t.woken.clone(),
                poke: self.waker.clone(),
            })));
            slot
        });
        t.slots[slot] = Some(Task {
            to,
            method,
            fut,
            scope,
            outlet,
            inlet,
        });
        self.poll_task(slot);
    }

    /// Cancels call `id` of `conn` if an async handler is running it: drops
    /// its future, which cancels the calls it awaits in turn (an async
    /// client's dropped call sends a cancel and releases what it lent), so
    /// a cancel travels down a chain of async services; answers it
    /// `Cancelled`. (A blocking handler learns of its call's cancel when it
    /// asks: [`Call::cancelled`].)
    fn cancel_task(&mut self, conn: ConnId, id: u64) {
        let t = &mut self.tasks;
        let Some(slot) = t.slots.iter().position(|s| {
            s.as_ref()
                .is_some_and(|s| s.to.conn == conn && s.to.id == id)
        }) else {
            return;
        };
        let Some(task) = t.slots[slot].take() else {
            return;
        };
        t.free.push(slot);
        let Task {
            to,
            fut,
            outlet,
            inlet,
            ..
        } = task;
        {
            // Dropped as it is polled: in the runtime's context, its
            // clients read by this listener, a panic caught.
            let _rt = self.rt.as_ref().map(|rt| rt.enter());
            polling_with(self.watch.as_ref(), || {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(fut)));
            });
        }
        self.close_outlet(outlet);
        self.close_inlet(inlet);
        self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        let cancelled = RpcError::new(Status::Cancelled, "cancelled by the caller");
        self.answer(to, Err(cancelled), Metadata::new());
    }

    /// Polls the calls whose futures were woken, until none is.
    ///
    /// It must not return while a call is queued: a waker queues its call
    /// and then pokes the listener, and polling a call may answer it, and
    /// answering drains the listener, which may swallow the poke of a call
    /// woken meanwhile. Returning then, the dispatcher would sleep in the
    /// listener with that call queued and nothing left to wake it (the
    /// hang of d5a618f). So the queue is checked again after each round;
    /// a poke swallowed before a check belongs to a call that check sees.
    fn poll_woken(&mut self) {
        loop {
            {
                let mut w = crate::sync::lock(&self.tasks.woken);
                if w.is_empty() {
                    return;
                }
                std::mem::swap(&mut *w, &mut self.tasks.polling);
            }
            let mut polling = std::mem::take(&mut self.tasks.polling);
            for &slot in &polling {
                self.poll_task(slot);
            }
            polling.clear();
            self.tasks.polling = polling;
        }
    }

    /// Polls the call in `slot`; answers it if it completed (a panic is
    /// `Internal`).
    fn poll_task(&mut self, slot: usize) {
        let Tasks { slots, wakers, .. } = &mut self.tasks;
        let Some(task) = slots.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        let method = task.method;
        let polled = {
            let _rt = self.rt.as_ref().map(|rt| rt.enter());
            let mut cx = std::task::Context::from_waker(&wakers[slot]);
            let (fut, scope) = (&mut task.fut, &mut task.scope);
            polling_with(self.watch.as_ref(), || {
                scope.run(|| fut.as_mut().poll(&mut cx))
            })
        };
        let r = match polled {
            Ok(Poll::Pending) => return,
            Ok(Poll::Ready(r)) => r,
            Err(p) => {
                let name = self
                    .methods
                    .get(&method)
                    .or(self.fallback.as_ref())
                    .map_or("?", |(n, _)| &**n);
                Err(panicked(name, &*p))
            }
        };
        if let Some(t) = self.tasks.slots[slot].take() {
            self.tasks.free.push(slot);
            self.close_outlet(t.outlet);
            self.close_inlet(t.inlet);
            self.answer(t.to, r, t.scope.meta.reply);
        }
    }

    /// Sends the answer to a call, with `meta` (what its handler set).
    fn answer(&mut self, to: To, mut result: Result<Payload, RpcError>, mut meta: Metadata) {
        let To { conn, id, echo } = to;
        if let Err(e) = &mut result {
            // The metadata the error carries (a nested call's answer's)
            // goes on, after the handler's.
            meta.extend(std::mem::take(&mut e.metadata));
        }
        // (The metadata travels in the frame too, within the limit: the
        // room the transport keeps for this answer, if it keeps some.)
        let (mut cfg_inline, mut max_inline) =
            (self.node.cfg.threshold(), self.listener.max_inline());
        if let Some(cap) = self.listener.answer_max(conn, id) {
            // (Above the transport's record only for answers it sends in
            // parts: a shared-memory server of a by-value node.)
            cfg_inline = cfg_inline.min(cap);
            max_inline = cap;
        }
        let inline_max = match meta.inline_room(cfg_inline, max_inline) {
            Ok(room) => room,
            Err((len, max)) => {
                result = Err(RpcError::internal(format!(
                    "the answer's metadata of {len} bytes exceeds the limit of {max}"
                )));
                meta = Metadata::new();
                cfg_inline.min(max_inline)
            }
        };
        let refs = self.listener.refs(conn);
        let dir = Dir::Answer(echo);
        let (status, body, made, echoed) =
            match result.and_then(|p| p.into_body(&self.node, inline_max, dir, refs)) {
                Ok((body, lent)) => (Status::Ok, body, lent.made_ref(), lent.is_echo()),
                Err(e) => {
                    let mut msg = e.message.into_bytes();
                    msg.truncate(inline_max.min(4096));
                    let body = if msg.is_empty() {
                        Body::None
                    } else {
                        Body::Inline(msg.into())
                    };
                    (e.status, body, None, false)
                }
            };
        if status != Status::Ok {
            bump(&self.stats.errors);
        }
        bump(&self.stats.calls);
        crate::stats::count(&body, true);
        let mut frame = match (body, echo) {
            // The request's own Ref, passed back.
            (Body::Refs(_), Some(r)) if echoed => Frame::echo(id, r),
            (body, _) => Frame::response(id, status, body),
        };
        if !meta.is_empty() {
            frame.meta = meta;
        }
        let sent = self.listener.reply(conn, &frame);
        if sent.is_err() {
            // The caller is gone: the answer's Ref is ours to release.
            if let Some(r) = made {
                let _ = self.node.release_ref(&r);
            }
        }
        self.drain();
    }
}
