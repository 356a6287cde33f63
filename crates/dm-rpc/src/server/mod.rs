//! Services: handlers registered by method name under a service name, and
//! the dispatch loop that runs them.
//!
//! The dispatcher is one thread per server. It takes requests from every
//! connection in fair order, answers a request whose deadline passed while
//! it was queued with `DeadlineExceeded` (without running the handler),
//! drops requests the caller cancelled before they ran (and the futures of
//! async handlers' calls cancelled while they run; a blocking handler
//! learns of its call's cancel when it asks, [`Call::cancelled`]), and
//! turns a
//! handler's panic into `Internal` for that call alone. A handler may make
//! nested calls (they inherit its call's deadline: [`crate::deadline`])
//! and forward the payload it received. A graceful shutdown
//! ([`Server::shutdown_gracefully`]) serves what was sent before it began
//! and refuses what comes after (`Unavailable`, flagged as not run). When
//! a server stops, however it stops, it refuses what it took and did not
//! run, and tells each client the highest call id it took
//! ([`crate::transport::GoAway`]): no request it did not run is lost, as
//! its callers send them all to its successor.
//!
//! Blocking handlers run on the dispatcher, one call at a time (a
//! blocking streaming handler too, for its whole stream). Async
//! handlers' calls, async streaming handlers' too, are futures the
//! dispatcher polls, many in progress at once (the items an async stream
//! queues are sent by the dispatcher between polls): a call that awaits
//! (a nested call, a timer) is parked, and its waker queues it and pokes
//! the dispatcher, which polls it again between requests. They are polled inside the server's tokio runtime context, so
//! tokio timers, I/O and `tokio::spawn` work (the runtime's one worker
//! thread drives timers and I/O and runs spawned tasks); a handler with
//! long CPU work should spawn it there, as it holds up the dispatcher
//! while polled. (They used to run as tasks on that runtime, so every call
//! crossed to its worker thread and back: about 35 us a hop on two cores.)
//! The answers to the async calls such a handler makes over shared memory
//! are read by the listener itself, while it waits for requests
//! (`async_client/`): a nested call's answer wakes its handler with no
//! thread in between.

mod builder;
mod dispatch;
mod handler;
mod intake;
mod running;
mod tasks;

pub use builder::ServerBuilder;
pub use handler::{
    AsyncBidiHandler, AsyncCall, AsyncHandler, AsyncStreamHandler, BidiHandler, Call,
    DisconnectHook, Handler, HandlerFuture, Incoming, Interceptor, Peer, StreamFuture,
    StreamHandler,
};
pub(crate) use intake::{take_in, Later, Pending};
pub use running::{Server, Stats};

use crate::node::Node;
impl Node {
    /// Starts building a server for service `name` (`shop/images/resize`).
    pub fn server(&self, name: &str) -> ServerBuilder {
        ServerBuilder::new(self.clone(), name)
    }
}
