//! A protobuf codec for generated services and clients that passes large
//! messages by Ref on the direct way.
//!
//! Generate code with it instead of `tonic_prost::ProstCodec`:
//!
//! ```ignore
//! tonic_prost_build::configure()
//!     .codec_path("dm_grpc::Codec")
//!     .bytes(".")
//!     .compile_protos(&["proto/imaging.proto"], &["proto"])?;
//! ```
//!
//! On the direct way a message above the node's inline threshold is
//! encoded once, straight into pool pages, and sent by Ref. A received
//! message is decoded from a view of the pool's pages, so its `bytes`
//! fields (as `bytes::Bytes`, the `.bytes(".")` above) are views too: no
//! copy. Everywhere else (TCP, HTTP/2 over shared memory, a peer with a
//! stock codec) it is `ProstCodec`, byte for byte.

use crate::direct::by_ref;
use bytes::Buf;
use std::cell::Cell;
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

/// Encodes `T`, decodes `U` (see the module docs).
#[derive(Debug)]
pub struct Codec<T, U> {
    _types: PhantomData<fn(T) -> U>,
}

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec {
            _types: PhantomData,
        }
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = MessageEncoder<T>;
    type Decoder = MessageDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        MessageEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        MessageDecoder {
            made: Cell::new(false),
            _type: PhantomData,
        }
    }
}

/// [`Codec`]'s encoder.
#[derive(Debug)]
pub struct MessageEncoder<T>(PhantomData<fn(T)>);

impl<T: prost::Message> Encoder for MessageEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        let len = item.encoded_len();
        if let Some(token) = by_ref::encode_in_pool(&item, len) {
            bytes::BufMut::put_slice(buf, &token);
            return Ok(());
        }
        // (One allocation for the message, however large.)
        buf.reserve(len);
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding a message: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        small_buffers()
    }
}

/// The buffers tonic starts a call's encoding and decoding with. Its
/// default is 8 KiB each: an allocation too large for the allocator's
/// fast path (glibc's thread cache ends at 1 KiB), made twice per call
/// on each side, which costs a small call more than the rest of its
/// encoding. The encoder reserves a message's length before encoding it,
/// and the decoder's buffer grows to the first message it holds.
fn small_buffers() -> BufferSettings {
    BufferSettings::new(SMALL_BUFFER, YIELD_THRESHOLD)
}

/// How much an encoding stream holds before it yields (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// The size of [`small_buffers`].
const SMALL_BUFFER: usize = 512;

/// [`Codec`]'s decoder.
#[derive(Debug)]
pub struct MessageDecoder<U> {
    /// Whether tonic has made its stream (`buffer_settings` is asked once
    /// then, and before every read of the body after).
    made: Cell<bool>,
    _type: PhantomData<fn() -> U>,
}

impl<U: prost::Message + Default> Decoder for MessageDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // (tonic decodes instead of reading the body: no read claims it.)
        by_ref::want_views(false);
        let bad = |e: prost::DecodeError| Status::internal(format!("decoding a message: {e}"));
        if buf.remaining() == by_ref::TOKEN_LEN {
            if let Some(id) = by_ref::token_id(buf.chunk()) {
                let Some(msg) = by_ref::claim(id) else {
                    return Err(Status::internal(
                        "a message passed by Ref is not in this process (a token from a peer?)",
                    ));
                };
                buf.advance(by_ref::TOKEN_LEN);
                by_ref::count_decoded();
                return U::decode(msg).map(Some).map_err(bad);
            }
        }
        U::decode(buf).map(Some).map_err(bad)
    }

    fn buffer_settings(&self) -> BufferSettings {
        // tonic asks once when it makes the stream, and then just before
        // each read of the body: the reads are what should hear it.
        if self.made.replace(true) {
            by_ref::want_views(true);
        }
        small_buffers()
    }
}
