//! The example service of the tests, the examples and `bench grpc`
//! (`proto/imaging.proto`): its generated code ([`imaging`]) and an
//! implementation ([`Service`]).

/// The code tonic and prost generate from `proto/imaging.proto`.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod imaging {
    tonic::include_proto!("imaging");
}

/// The same service and client with tonic's stock codec
/// (`tonic_prost::ProstCodec`): unchanged generated code, for tests that
/// mix it with [`imaging`]'s. [`Service`] serves both.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod stock {
    include!(concat!(env!("OUT_DIR"), "/stock/imaging.rs"));
}

/// The encoded descriptors of `proto/imaging.proto`, for a reflection
/// service (`tonic-reflection`).
pub const DESCRIPTORS: &[u8] = tonic::include_file_descriptor_set!("imaging_descriptor");

/// The example service with gRPC's health and reflection services beside
/// it, as a server would serve them: one `Routes`. Health reports the
/// example service serving.
pub async fn routes() -> Result<tonic::service::Routes, tonic_reflection::server::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<imaging::imaging_server::ImagingServer<Service>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(DESCRIPTORS)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let imaging =
        imaging::imaging_server::ImagingServer::new(Service).max_decoding_message_size(64 << 20);
    Ok(tonic::service::Routes::new(imaging)
        .add_service(health)
        .add_service(reflection))
}

use imaging::imaging_server::Imaging;
use imaging::{Blob, Image, Summary, TileRequest};
use std::pin::Pin;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

/// A stream of messages a method answers with.
pub type Items<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// FNV-1a of `b`.
pub fn digest(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

/// `len` bytes of a pattern that differs with `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// The example service: what each method does is in the `.proto`. Echo
/// also answers metadata: `x-tag` comes back, `x-fail: CODE` fails with
/// that code (with details and trailer metadata), `x-sleep-ms: MS` waits
/// first.
#[derive(Debug, Default)]
pub struct Service;

#[tonic::async_trait]
impl Imaging for Service {
    async fn echo(&self, req: Request<Blob>) -> Result<Response<Blob>, Status> {
        // Metadata both ways: a header asked for comes back as a header.
        let tag = req.metadata().get("x-tag").cloned();
        if let Some(code) = req.metadata().get("x-fail") {
            let code: i32 = code.to_str().ok().and_then(|c| c.parse().ok()).unwrap_or(2);
            let mut s = Status::with_details(
                tonic::Code::from_i32(code),
                "asked to fail",
                bytes::Bytes::from_static(b"\x01details"),
            );
            s.metadata_mut().insert(
                "x-why",
                tonic::metadata::MetadataValue::from_static("asked"),
            );
            return Err(s);
        }
        if let Some(ms) = req.metadata().get("x-sleep-ms") {
            let ms: u64 = ms.to_str().ok().and_then(|m| m.parse().ok()).unwrap_or(0);
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        let mut answer = Response::new(req.into_inner());
        if let Some(tag) = tag {
            answer.metadata_mut().insert("x-tag", tag);
        }
        Ok(answer)
    }

    async fn invert(&self, req: Request<Image>) -> Result<Response<Image>, Status> {
        let img = req.into_inner();
        if img.pixels.len() as u64 != u64::from(img.width) * u64::from(img.height) * 3 {
            return Err(Status::invalid_argument("pixels do not fill the image"));
        }
        let pixels: Vec<u8> = img.pixels.iter().map(|p| 255 - p).collect();
        Ok(Response::new(Image {
            width: img.width,
            height: img.height,
            digest: digest(&pixels),
            pixels: pixels.into(),
        }))
    }

    type TilesStream = Items<Blob>;

    async fn tiles(&self, req: Request<TileRequest>) -> Result<Response<Items<Blob>>, Status> {
        let r = req.into_inner();
        let tiles = (0..r.count).map(move |k| {
            Ok(Blob {
                data: pattern(r.size as usize, k as u8).into(),
                seq: u64::from(k),
            })
        });
        let end = (r.fail_with != 0).then(|| {
            Err(Status::new(
                tonic::Code::from_i32(r.fail_with),
                "the tiles ran out",
            ))
        });
        let s = tokio_stream::iter(tiles.chain(end));
        Ok(Response::new(Box::pin(s)))
    }

    async fn upload(&self, req: Request<Streaming<Blob>>) -> Result<Response<Summary>, Status> {
        let mut s = req.into_inner();
        let mut sum = Summary::default();
        while let Some(b) = s.next().await {
            let b = b?;
            if b.data.as_ref() != pattern(b.data.len(), b.seq as u8).as_slice() {
                return Err(Status::data_loss(format!("blob {} is not its own", b.seq)));
            }
            sum.blobs += 1;
            sum.bytes += b.data.len() as u64;
        }
        Ok(Response::new(sum))
    }

    type ChatStream = Items<Blob>;

    async fn chat(&self, req: Request<Streaming<Blob>>) -> Result<Response<Items<Blob>>, Status> {
        let s = req.into_inner();
        Ok(Response::new(Box::pin(s)))
    }
}

/// [`Service`] behind the stock codec's trait: every method is the one
/// above.
#[tonic::async_trait]
impl stock::imaging_server::Imaging for Service {
    async fn echo(&self, req: Request<Blob>) -> Result<Response<Blob>, Status> {
        Imaging::echo(self, req).await
    }

    async fn invert(&self, req: Request<Image>) -> Result<Response<Image>, Status> {
        Imaging::invert(self, req).await
    }

    type TilesStream = Items<Blob>;

    async fn tiles(&self, req: Request<TileRequest>) -> Result<Response<Items<Blob>>, Status> {
        Imaging::tiles(self, req).await
    }

    async fn upload(&self, req: Request<Streaming<Blob>>) -> Result<Response<Summary>, Status> {
        Imaging::upload(self, req).await
    }

    type ChatStream = Items<Blob>;

    async fn chat(&self, req: Request<Streaming<Blob>>) -> Result<Response<Items<Blob>>, Status> {
        Imaging::chat(self, req).await
    }
}
