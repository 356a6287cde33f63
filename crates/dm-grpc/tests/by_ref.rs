//! Large messages by Ref on the direct way ([`dm_grpc::Codec`]): encoded
//! once into the pool, decoded from views of its pages, at sizes just
//! below and above the threshold, in every kind of stream. And a stock
//! codec on either end still gets plain bytes. One test: the counts it
//! checks are the process's.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use dm_grpc::example::imaging::imaging_client::ImagingClient;
use dm_grpc::example::imaging::imaging_server::ImagingServer;
use dm_grpc::example::imaging::{Blob, TileRequest};
use dm_grpc::example::{pattern, stock, Service};
use dm_grpc::{by_ref_counts, Channel};
use dm_pool::testing::TempPool;
use dm_pool::PoolConfig;
use dm_rpc::Node;
use prost::Message;
use std::time::Duration;
use tokio_stream::StreamExt;

fn blob(len: usize, seq: u64) -> Blob {
    Blob {
        data: pattern(len, seq as u8).into(),
        seq,
    }
}

/// The change in the by-Ref counts across `f`: messages encoded into
/// the pool (of those, laid over a received one's pages), and decoded
/// from views.
async fn counted<T>(f: impl std::future::Future<Output = T>) -> (T, (u64, u64, u64)) {
    let a = by_ref_counts();
    let t = f.await;
    let b = by_ref_counts();
    (
        t,
        (
            b.encoded - a.encoded,
            b.forwarded - a.forwarded,
            b.decoded - a.decoded,
        ),
    )
}

type Ours = ImagingClient<Channel>;
type Stock = stock::imaging_client::ImagingClient<Channel>;

async fn echo_ours(c: &mut Ours, b: Blob) -> Blob {
    c.echo(b).await.unwrap().into_inner()
}

async fn echo_stock(c: &mut Stock, b: Blob) -> Blob {
    c.echo(b).await.unwrap().into_inner()
}

#[test]
fn large_messages_go_by_ref_and_stock_codecs_get_bytes() {
    let tp = TempPool::with(PoolConfig {
        size: 256 << 20,
        channels: Some(16),
        ..Default::default()
    });
    {
        let node = Node::new(tp.attach());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let id = std::process::id();
            let ours_name = format!("test/by-ref/ours/{id}");
            let stock_name = format!("test/by-ref/stock/{id}");
            let s1 = dm_grpc::serve(
                &node,
                &ours_name,
                ImagingServer::new(Service).max_decoding_message_size(64 << 20),
            )
            .unwrap();
            let s2 = dm_grpc::serve(
                &node,
                &stock_name,
                stock::imaging_server::ImagingServer::new(Service)
                    .max_decoding_message_size(64 << 20),
            )
            .unwrap();
            let to_ours = dm_grpc::Dial::new(&node, &ours_name)
                .connect()
                .await
                .unwrap();
            let to_stock = dm_grpc::Dial::new(&node, &stock_name)
                .connect()
                .await
                .unwrap();
            let mut ours: Ours =
                ImagingClient::new(to_ours.clone()).max_decoding_message_size(64 << 20);
            let mut ours_to_stock: Ours =
                ImagingClient::new(to_stock.clone()).max_decoding_message_size(64 << 20);
            let mut stock_to_ours: Stock =
                stock::imaging_client::ImagingClient::new(to_ours.clone())
                    .max_decoding_message_size(64 << 20);
            let mut stock_both: Stock = stock::imaging_client::ImagingClient::new(to_stock)
                .max_decoding_message_size(64 << 20);

            // The threshold: a message whose frame (5-byte prefix and
            // message) fits inline goes inline. One byte more goes by Ref.
            let inline_max = node.config().inline_max;
            let frame = |n: usize| 5 + blob(n, 1).encoded_len();
            let at = (0..inline_max)
                .rev()
                .find(|&n| frame(n) == inline_max)
                .unwrap();
            let (got, n) = counted(echo_ours(&mut ours, blob(at, 1))).await;
            assert_eq!(got, blob(at, 1));
            // (Decoded from a view: both ends, as it is past the view size.)
            assert_eq!(n, (0, 0, 2), "a message that fits inline");
            let (got, n) = counted(echo_ours(&mut ours, blob(at + 1, 2))).await;
            assert_eq!(got, blob(at + 1, 2));
            assert_eq!(n, (2, 0, 2), "a message one byte past the threshold");

            // 1 MiB every way a codec pair can be: a stock codec on either
            // end encodes and decodes plain bytes, ours still goes by Ref.
            // A server of ours answering with the field it got lays its
            // answer over the request's pages.
            let big = blob(1 << 20, 3);
            let (got, n) = counted(echo_ours(&mut ours, big.clone())).await;
            assert_eq!((got == big, n), (true, (2, 1, 2)), "ours to ours");
            let (got, n) = counted(echo_ours(&mut ours_to_stock, big.clone())).await;
            assert_eq!((got == big, n), (true, (1, 0, 1)), "ours to a stock server");
            let (got, n) = counted(echo_stock(&mut stock_to_ours, big.clone())).await;
            assert_eq!((got == big, n), (true, (1, 1, 1)), "a stock client to ours");
            let (got, n) = counted(echo_stock(&mut stock_both, big.clone())).await;
            assert_eq!((got == big, n), (true, (0, 0, 0)), "stock to stock");
            // The raw codec is no Codec either: it gets the bytes.
            let (got, n) = counted(dm_grpc::raw::call(
                to_ours.clone(),
                "/imaging.Imaging/Echo",
                tonic::Request::new(Bytes::from(big.encode_to_vec())),
            ))
            .await;
            assert_eq!(
                got.unwrap().messages,
                vec![Bytes::from(big.encode_to_vec())]
            );
            assert_eq!(n, (1, 1, 1), "raw bytes to ours");

            // Streams: every message its own Ref, whether tonic writes
            // them one at a time or all at once (and a chat's answers
            // over its requests' pages).
            let (tiles, n) = counted(async {
                let mut s = ours
                    .tiles(TileRequest {
                        count: 5,
                        size: 256 << 10,
                        fail_with: 0,
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let mut got = Vec::new();
                while let Some(t) = s.next().await {
                    got.push(t.unwrap());
                }
                got
            })
            .await;
            assert_eq!(
                tiles,
                (0..5).map(|k| blob(256 << 10, k)).collect::<Vec<_>>()
            );
            assert_eq!(n, (5, 0, 5), "tiles");
            let up: Vec<Blob> = (0..4).map(|k| blob(300 << 10, k)).collect();
            let (sum, n) = counted(ours.upload(tokio_stream::iter(up))).await;
            let sum = sum.unwrap().into_inner();
            assert_eq!((sum.blobs, sum.bytes), (4, 4 * (300 << 10)));
            assert_eq!(n, (4, 0, 4), "upload");
            let (back, n) = counted(async {
                let (tx, rx) = tokio::sync::mpsc::channel(4);
                let mut s = ours
                    .chat(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await
                    .unwrap()
                    .into_inner();
                let mut back = Vec::new();
                for k in 0..4u64 {
                    tx.send(blob(200 << 10, k)).await.unwrap();
                    back.push(s.next().await.unwrap().unwrap());
                }
                drop(tx);
                assert!(s.next().await.is_none());
                back
            })
            .await;
            assert_eq!(back, (0..4).map(|k| blob(200 << 10, k)).collect::<Vec<_>>());
            assert_eq!(n, (8, 4, 8), "chat");

            // A token sent by a peer stands for nothing here: the call
            // fails, the server goes on.
            let mut fake = vec![0u8];
            fake.extend_from_slice(&[0x5a; 16]);
            let e = dm_grpc::raw::call(
                to_ours.clone(),
                "/imaging.Imaging/Echo",
                tonic::Request::new(Bytes::from(fake)),
            )
            .await
            .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
            assert_eq!(echo_ours(&mut ours, blob(10, 4)).await, blob(10, 4));

            // A call dropped before its answer is read leaves nothing
            // behind (the pool check below).
            let pending = tokio::time::timeout(
                Duration::from_millis(1),
                ours.tiles(TileRequest {
                    count: 50,
                    size: 1 << 20,
                    fail_with: 0,
                }),
            )
            .await;
            drop(pending);
            drop((ours, ours_to_stock, stock_to_ours, stock_both, to_ours));
            s1.shutdown();
            s2.shutdown();
        });
    }
    tp.assert_clean_within(Duration::from_secs(2));
}
