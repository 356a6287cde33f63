//! One call, without I/O: what a caller gives it and gets back
//! ([`options`]), the request it makes and what an answer means for it
//! ([`attempt`]), and whether and where a request that failed goes again
//! ([`failover`]). The blocking client (`client.rs`), the async client
//! (`async_client/`), streams (`stream/`) and balanced clients
//! (`balance.rs`) drive it over their connections.

pub(crate) mod attempt;
pub(crate) mod failover;
pub(crate) mod options;
