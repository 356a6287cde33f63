//! What a server that stops says to each client connection (HTTP/2's
//! GOAWAY): the highest call id it took from it. It says so once it reads
//! the connection no more, so a request with a higher id was never taken
//! and never will be: its caller may send it to another server, with no
//! risk that it runs twice. (That holds because a client draws a
//! request's id as the request enters the connection, so ids enter in
//! order: [`crate::sender`].) Every transport carries it: a word in the
//! shared-memory channel's control page, a go-away frame over TCP, a word
//! shared in this process for the in-memory transport.
//!
//! The word holds 0 until the server speaks, then the highest id taken
//! plus one (so "none taken" is 1). The server stores it with `Release`
//! before it closes its end of the connection; the client loads it with
//! `Acquire` once it found the connection closed (or its server dead: a
//! word written before the death stands). The loom model
//! `a_request_is_taken_or_known_unread` (tests/loom.rs) checks, over the
//! real ring, that a request is never both taken and judged unread, and
//! that every request sent before the word is one or the other.

use crate::sync::{AtomicU64, Ordering};

/// Says that the highest call id taken on the connection of `word` was
/// `last_taken` (0: none). The server takes nothing from it after this.
pub fn say(word: &AtomicU64, last_taken: u64) {
    word.store(last_taken.saturating_add(1), Ordering::Release);
}

/// What the server said in `word`: the highest call id it took, or None
/// if it has not spoken.
pub fn said(word: &AtomicU64) -> Option<u64> {
    word.load(Ordering::Acquire).checked_sub(1)
}

/// Whether the request with call id `id` is known never to have been
/// taken by the server that spoke in `word` (nor ever to be).
pub fn unread(word: &AtomicU64, id: u64) -> bool {
    said(word).is_some_and(|last| id > last)
}
