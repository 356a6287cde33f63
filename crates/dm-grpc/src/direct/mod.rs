//! Beyond NotNets: no HTTP/2 between processes of one pool. Each gRPC
//! call is a dmrpc call (its path, metadata, deadline and status map onto
//! dmrpc's: `wire.rs`), its messages travel as the call's payloads and
//! items (inline, or by Ref when large), and the receiving side hands
//! tonic the bytes it got (by Ref, views of the pool's pages).

mod body;
pub(crate) mod by_ref;
pub(crate) mod client;
mod forward;
pub(crate) mod server;
pub(crate) mod wire;

pub use server::GrpcService;

/// What a peer's bytes become on the direct way, for the fuzz target
/// `grpc_wire`. `data` as metadata entries (a key length byte, the key, a
/// value length byte, the value; keys dmrpc refuses are skipped), read as
/// a request (its method's URI, its headers, its timeout) and as an answer
/// (its headers and trailers).
///
/// And `data` as a gRPC body, in chunks of the first byte's size, handed
/// to a decoder with every whole message of one byte or more by token
/// (but every third chunk, handed over as it is). With each token's
/// message put back, it is `data` again. Never panics, whatever the bytes
/// (but on that check).
#[doc(hidden)]
pub fn fuzz_wire(data: &[u8]) {
    fuzz_body(data);
    fuzz_metadata(data);
}

fn fuzz_body(data: &[u8]) {
    let cut = data.first().map_or(1, |&b| usize::from(b).max(1));
    let mut inbox = by_ref::Inbox::with_min(1);
    let mut back = Vec::with_capacity(data.len());
    for (k, chunk) in data.chunks(cut).enumerate() {
        // (Every third chunk read by a decoder that takes no tokens.)
        let wanted = k % 3 != 2;
        if !inbox.may_take(chunk, wanted) {
            inbox.pass(chunk);
            back.extend_from_slice(chunk);
            continue;
        }
        for part in inbox.parts(bytes::Bytes::copy_from_slice(chunk), wanted) {
            let msg = part
                .get(5..)
                .filter(|_| part.len() == 5 + by_ref::TOKEN_LEN && part[..5] == [0, 0, 0, 0, 17])
                .and_then(by_ref::token_id)
                .and_then(by_ref::claim);
            match msg {
                Some(m) => {
                    back.push(0);
                    back.extend_from_slice(&(m.len() as u32).to_be_bytes());
                    back.extend_from_slice(&m);
                }
                None => back.extend_from_slice(&part),
            }
        }
    }
    assert_eq!(back, data, "a body read by token is the body");
}

fn fuzz_metadata(mut data: &[u8]) {
    let mut meta = dm_rpc::Metadata::new();
    let take = |n: usize, d: &mut &[u8]| -> Option<Vec<u8>> {
        let (a, b) = d.split_at_checked(n)?;
        *d = b;
        Some(a.to_vec())
    };
    while let Some(k) = take(1, &mut data) {
        let Some(key) = take(usize::from(k[0] % 64), &mut data) else {
            break;
        };
        let Some(v) = take(1, &mut data) else { break };
        let Some(value) = take(usize::from(v[0]), &mut data) else {
            break;
        };
        if let Ok(key) = std::str::from_utf8(&key) {
            let _ = meta.insert(key, value);
        }
    }
    let _ = server::request_uri(&meta);
    if let Ok(h) = wire::request_headers(&meta) {
        let _ = wire::grpc_timeout(&h);
    }
    let _ = wire::answer_headers(&meta);
}
