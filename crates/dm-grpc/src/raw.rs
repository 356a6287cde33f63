//! gRPC calls with raw messages, for tools that know a method's path but
//! not its types (`dmrpc call`): messages are the bytes of their encoding.

use bytes::{Buf, BufMut, Bytes};
use tokio_stream::StreamExt;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

/// A codec of raw messages: what is sent is the bytes given, what comes
/// back is the bytes received.
#[derive(Debug, Clone, Copy, Default)]
pub struct BytesCodec;

/// [`BytesCodec`]'s encoder.
#[derive(Debug)]
pub struct BytesEncoder;

/// [`BytesCodec`]'s decoder.
#[derive(Debug)]
pub struct BytesDecoder;

impl Encoder for BytesEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for BytesDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl Codec for BytesCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = BytesEncoder;
    type Decoder = BytesDecoder;

    fn encoder(&mut self) -> BytesEncoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> BytesDecoder {
        BytesDecoder
    }
}

/// What a raw call got: the messages, and the metadata of its headers
/// and of its trailers.
#[derive(Debug)]
pub struct Answer {
    /// Response headers.
    pub headers: tonic::metadata::MetadataMap,
    /// Every message, in order.
    pub messages: Vec<Bytes>,
    /// Trailers (empty if the call ended without any).
    pub trailers: tonic::metadata::MetadataMap,
}

/// Calls the method at `path` (`/package.Service/Method`) over `channel`
/// with one message, and reads every message of its answer: a unary
/// method answers one, a server-streaming one any number. `req` carries
/// the message, the request metadata and the timeout. A status other
/// than `Ok` is the error, with its details and metadata.
pub async fn call(
    channel: crate::Channel,
    path: &str,
    req: tonic::Request<Bytes>,
) -> Result<Answer, Status> {
    let path: http::uri::PathAndQuery = path
        .parse()
        .map_err(|_| Status::invalid_argument(format!("{path:?} is not a method's path")))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let answer = grpc.server_streaming(req, path, BytesCodec).await?;
    let headers = answer.metadata().clone();
    let mut stream = answer.into_inner();
    let mut messages = Vec::new();
    while let Some(m) = stream.next().await {
        messages.push(m?);
    }
    let trailers = stream.trailers().await?.unwrap_or_default();
    Ok(Answer {
        headers,
        messages,
        trailers,
    })
}
