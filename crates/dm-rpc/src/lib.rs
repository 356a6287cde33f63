//! # dm-rpc — the RPC layer of dmrpc
//!
//! Where frames are parsed: [`frame`] defines the wire format every
//! transport carries (shared-memory rings, TCP, in-memory) and its decoder,
//! which rejects malformed bytes from a peer with a typed error and never
//! panics. Transports, channels, services and size-aware payloads build on
//! it (issue 3).

pub mod frame;

pub use frame::{Frame, FrameError, Kind, Payload, Status};
