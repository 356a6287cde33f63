//! `dmrpc call` of a service that speaks gRPC (as its registration
//! says): the method is a path (`/package.Service/Method`), the argument
//! the bytes of one encoded request message, and what comes back the
//! bytes of each message of the answer, as `grpcurl` would with raw
//! messages. The call goes the direct way (`dm-grpc`).

use super::out::{show_metadata, us, write_bytes};
use anyhow::{bail, Result};
use dm_rpc::{Metadata, Node};
use std::time::{Duration, Instant};

/// What to call, and how (from `dmrpc call`'s arguments).
pub struct How<'a> {
    pub service: &'a str,
    pub method: &'a str,
    pub timeout: Duration,
    pub repeat: u32,
    pub hex: bool,
}

/// Calls gRPC method `a.method` of `a.service` with `arg`: 0 done, 1 the
/// call failed (a status other than `Ok`), 2 no connection.
pub fn call(a: &How<'_>, node: &Node, arg: &[u8], meta: &Metadata) -> Result<i32> {
    if !a.method.starts_with('/') {
        bail!(
            "{} speaks gRPC: its methods are paths, /package.Service/Method (not {:?})",
            a.service,
            a.method
        );
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let channel = match dm_grpc::Dial::new(node, a.service).connect().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("cannot reach {}: {e}", a.service);
                return Ok(2);
            }
        };
        let mut took = Vec::with_capacity(a.repeat as usize);
        let mut last = None;
        for _ in 0..a.repeat {
            let mut req = tonic::Request::new(bytes::Bytes::copy_from_slice(arg));
            req.set_timeout(a.timeout);
            for (k, v) in meta.iter() {
                let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())?;
                let value = tonic::metadata::MetadataValue::try_from(v)?;
                req.metadata_mut().insert(key, value);
            }
            let t0 = Instant::now();
            match dm_grpc::raw::call(channel.clone(), a.method, req).await {
                Ok(answer) => {
                    took.push(t0.elapsed());
                    last = Some(answer);
                }
                Err(s) => {
                    show(s.metadata());
                    eprintln!(
                        "{} {}: {:?}: {}",
                        a.service,
                        a.method,
                        s.code(),
                        s.message()
                    );
                    return Ok(1);
                }
            }
        }
        let Some(answer) = last else {
            return Ok(1);
        };
        show(&answer.headers);
        show(&answer.trailers);
        let mut out = std::io::stdout().lock();
        let mut bytes = 0;
        for m in &answer.messages {
            write_bytes(&mut out, m, a.hex)?;
            bytes += m.len();
        }
        took.sort();
        let pct = |q: f64| took[((took.len() - 1) as f64 * q).round() as usize];
        eprintln!(
            "ok: {} message(s), {bytes} bytes; {} call(s), p50 {:.1} µs",
            answer.messages.len(),
            took.len(),
            us(pct(0.5))
        );
        Ok(0)
    })
}

/// gRPC metadata on stderr, as dmrpc's is shown.
fn show(m: &tonic::metadata::MetadataMap) {
    let mut shown = Metadata::new();
    for (k, v) in m.clone().into_headers().iter() {
        let _ = shown.insert(k.as_str(), v.as_bytes());
    }
    show_metadata(&shown);
}
