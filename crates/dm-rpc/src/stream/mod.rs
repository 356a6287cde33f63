//! Streaming calls: a method that answers with a stream of items, and one
//! that also reads a stream of its caller's.
//!
//! A server registers a streaming method with
//! [`ServerBuilder::method_stream`](crate::ServerBuilder::method_stream):
//! its handler sends items into a [`Sink`] as it has them and returns how
//! the stream ends. An async handler
//! ([`ServerBuilder::method_stream_async`](crate::ServerBuilder::method_stream_async))
//! sends them into an [`AsyncSink`] (`sink.send(item).await`), and its
//! stream runs beside the server's other calls. A caller opens the stream with
//! [`Client::call_stream`](crate::Client::call_stream) and reads the items
//! from a [`Streaming`], an iterator, as they come (an async caller:
//! [`AsyncClient::call_stream`](crate::AsyncClient::call_stream), and
//! [`AsyncStreaming::next`]). Each item is a
//! [`Payload`](crate::Payload): small ones travel inline, large ones as Refs made for the
//! caller (the size-aware rule of every answer), so a stream of large
//! items moves no bytes through the connection.
//!
//! **Flow control.** The caller says how many items it will hold (its
//! window, [`CallOptions::window`](crate::CallOptions::window), default
//! [`DEFAULT_WINDOW`]): the server sends an item only while the caller has
//! granted more than it was sent, and the caller grants more as it reads
//! (in [`Kind::Credit`](crate::Kind::Credit) frames, once half its window
//! is read). So what a slow reader has not read stays within its window:
//! its client never buffers more, and its connection never fills with it
//! (the answers of the connection's other calls still get through). A
//! handler that sends faster than its caller reads waits in
//! [`Sink::send`]; meanwhile its server queues the requests that come (it
//! runs one blocking handler at a time, a streaming one too; over shared
//! memory the stream's own connection is not read for requests until it
//! ends, so that its items have the room). An async handler awaits in
//! [`AsyncSink::send`] instead, and the server goes on with its other
//! calls, those of the stream's own connection included: its dispatcher
//! polls the stream's future as it polls async handlers' calls, and sends
//! the items it queued between polls. Over shared memory, a server keeps
//! room in a connection for the answer to every request it took, so that
//! answers never wait for a client that does not read; for a stream it
//! keeps only the room for a small answer, its end
//! (`transport::shm::SMALL_ANSWER`: an error
//! message and trailer metadata of at most 16 KiB; a unary method called
//! as a stream answers with a larger payload by Ref), so that its items
//! have the rest.
//!
//! **Ends.** The stream ends with the call's answer: `Ok` after the
//! handler returned `Ok(())`, or the error it returned (or
//! `DeadlineExceeded` once the call's deadline passes: the deadline
//! bounds the whole stream). A caller that drops its [`Streaming`] before
//! the end cancels the call: the handler's next [`Sink::send`] fails with
//! `Cancelled` (and [`Call::cancelled`](crate::Call::cancelled) is true),
//! an async handler's future is dropped, and the items already sent are
//! released. An async handler's items go out before its end. A server that dies ends its
//! streams with `Unavailable`, as it does calls.
//!
//! **The caller's items.** A method registered with
//! [`ServerBuilder::method_bidi_async`](crate::ServerBuilder::method_bidi_async)
//! also reads items its caller sends after the request: a bidirectional
//! stream, or, if it answers with one item, a caller's stream answered
//! once. The caller opens the call with
//! [`AsyncClient::call_bidi`](crate::AsyncClient::call_bidi), sends with
//! [`AsyncBidi::send`] and ends its items with [`AsyncBidi::finish`]
//! (or [`AsyncBidi::split`]s the call into an [`AsyncItems`] and an
//! [`AsyncStreaming`] for two tasks). The handler reads them from its
//! [`AsyncInbox`]. Blocking callers and handlers have the same:
//! [`Client::call_bidi`](crate::Client::call_bidi) ([`Bidi`], [`Items`])
//! and [`ServerBuilder::method_bidi`](crate::ServerBuilder::method_bidi)
//! ([`Inbox`]).
//!
//! Flow control runs the other way here: the server
//! grants a window of items when the handler starts, and grants more as
//! the handler reads half of it, so what the handler has not read stays
//! within the window. A caller that sends beyond its grant ends the
//! items with `ResourceExhausted`. A call ended by its handler fails the
//! caller's later sends (`Cancelled`: its answer says how). A caller that
//! drops the call cancels it. Items dropped without a finish end the
//! items if that can go at once, else cancel the call.
//!
//! The wire format is in [`crate::frame`] (frames v7, and v9 for the
//! caller's items). The server's end
//! is in `sink.rs`; the callers' (one state machine for both clients) in
//! `call.rs`. The caller's items leave from `items.rs` and arrive in
//! `inbox.rs`.

mod call;
mod inbox;
mod items;
mod sink;

pub use call::{AsyncBidi, AsyncStreaming, Bidi, Streaming};
pub(crate) use call::{How, StreamConn};
pub use inbox::{AsyncInbox, Inbox};
pub(crate) use inbox::{Inlet, Taking};
pub(crate) use items::ItemConn;
pub use items::{AsyncItems, Items};
pub use sink::{AsyncSink, Sink};
pub(crate) use sink::{Feed, Outlet};

/// Items a caller holds unread at most, unless it says otherwise
/// ([`CallOptions::window`](crate::CallOptions::window)).
pub const DEFAULT_WINDOW: u32 = 16;
