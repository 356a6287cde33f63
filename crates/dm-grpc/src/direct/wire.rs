//! How a gRPC call maps onto a dmrpc call, with no HTTP/2 between them.
//!
//! * The request: the method's path under [`PATH`], the request headers
//!   (gRPC metadata) as the call's metadata, `grpc-timeout` as its
//!   deadline too. Its payload is the gRPC body the client has written
//!   when the call starts (length-prefixed messages, as on the wire);
//!   what it writes later goes as the caller's items.
//! * The answer: gRPC body bytes too. A body that is whole at once (a
//!   unary answer, a trailers-only error) travels in the answer that ends
//!   the call: its metadata holds the response headers, then [`TRAILERS`],
//!   then the trailers. Any other answer starts with an item whose
//!   metadata holds the headers and [`HEADERS`]; the body follows as
//!   items, and the ending answer's metadata holds [`TRAILERS`] and the
//!   trailers.
//!
//! Keys are gRPC's metadata keys, which dmrpc's metadata takes as they
//! are (lowercase letters, digits, `-`, `_`, `.`). Everything read from
//! the peer is checked: a key or value HTTP would refuse is an error, not
//! a header.

use dm_rpc::{Metadata, RpcError};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use std::time::Duration;

/// The method's path (`/package.Service/Method`).
pub(crate) const PATH: &str = "dmrpc.path";
/// Marks an item that carries the response headers.
pub(crate) const HEADERS: &str = "dmrpc.headers";
/// Separates the headers from the trailers in an ending answer.
pub(crate) const TRAILERS: &str = "dmrpc.trailers";

/// Headers HTTP/2 needs and a dmrpc call does not carry.
fn hop_by_hop(k: &str) -> bool {
    matches!(k, "te" | "connection" | "host" | "content-length")
}

/// Adds headers `h` to `meta`.
pub(crate) fn headers_into(meta: &mut Metadata, h: &HeaderMap) -> Result<(), RpcError> {
    for (k, v) in h {
        if hop_by_hop(k.as_str()) {
            continue;
        }
        meta.insert(k.as_str(), v.as_bytes())
            .map_err(|e| RpcError::invalid_argument(format!("gRPC metadata: {e}")))?;
    }
    Ok(())
}

/// Adds the entries `entries` to `h` as headers, but dmrpc's own keys.
fn into_headers<'a>(
    h: &mut HeaderMap,
    entries: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> Result<(), RpcError> {
    for (k, v) in entries {
        if k.starts_with("dmrpc.") {
            continue;
        }
        let name = header_name(k)
            .map_err(|_| RpcError::invalid_argument(format!("{k:?} cannot be a header")))?;
        let value = header_value(v).map_err(|_| {
            RpcError::invalid_argument(format!("the value of {k:?} cannot be a header's"))
        })?;
        h.append(name, value);
    }
    Ok(())
}

/// Header `k`: gRPC's own names are made with no allocation.
fn header_name(k: &str) -> Result<HeaderName, http::header::InvalidHeaderName> {
    Ok(match k {
        "content-type" => http::header::CONTENT_TYPE,
        "grpc-status" => HeaderName::from_static("grpc-status"),
        "grpc-message" => HeaderName::from_static("grpc-message"),
        "grpc-encoding" => HeaderName::from_static("grpc-encoding"),
        "grpc-accept-encoding" => HeaderName::from_static("grpc-accept-encoding"),
        "grpc-timeout" => HeaderName::from_static("grpc-timeout"),
        _ => return HeaderName::from_bytes(k.as_bytes()),
    })
}

/// A header's value `v`: the values every call carries (its content type,
/// the status of a success) are made with no allocation.
fn header_value(v: &[u8]) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
    Ok(match v {
        b"application/grpc" => HeaderValue::from_static("application/grpc"),
        b"0" => HeaderValue::from_static("0"),
        b"identity" => HeaderValue::from_static("identity"),
        _ => return HeaderValue::from_bytes(v),
    })
}

/// The headers a request's metadata carries.
pub(crate) fn request_headers(meta: &Metadata) -> Result<HeaderMap, RpcError> {
    // Room for them and the two the server adds (`te`, `content-type`).
    let mut h = HeaderMap::with_capacity(meta.len() + 2);
    into_headers(&mut h, meta.iter())?;
    Ok(h)
}

/// The headers and the trailers an answer's metadata carries: the
/// entries before [`TRAILERS`], and after it.
pub(crate) fn answer_headers(meta: &Metadata) -> Result<(HeaderMap, HeaderMap), RpcError> {
    let mut parts = meta.iter();
    let mut head = HeaderMap::new();
    into_headers(
        &mut head,
        parts.by_ref().take_while(|(k, _)| *k != TRAILERS),
    )?;
    let mut tail = HeaderMap::new();
    into_headers(&mut tail, parts)?;
    Ok((head, tail))
}

/// The time `grpc-timeout` gives (at most 8 digits and a unit), if any.
pub(crate) fn grpc_timeout(h: &HeaderMap) -> Option<Duration> {
    let v = h.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The gRPC status of a dmrpc call that failed under the gRPC call (what
/// a gRPC service says travels in trailers instead).
pub(crate) fn status_of(e: RpcError) -> tonic::Status {
    use dm_rpc::Status as S;
    use tonic::Code;
    let code = match e.status {
        S::DeadlineExceeded => Code::DeadlineExceeded,
        S::Unavailable => Code::Unavailable,
        S::ResourceExhausted => Code::ResourceExhausted,
        S::Cancelled => Code::Cancelled,
        S::Unauthenticated => Code::Unauthenticated,
        S::PermissionDenied => Code::PermissionDenied,
        S::AlreadyExists => Code::AlreadyExists,
        S::NotFound => Code::Unimplemented,
        S::Ok | S::InvalidArgument | S::Internal => Code::Internal,
    };
    tonic::Status::new(code, e.message)
}

/// The trailers that say `status`.
pub(crate) fn status_trailers(status: &tonic::Status) -> HeaderMap {
    let mut t = HeaderMap::new();
    if status.add_header(&mut t).is_err() {
        // (Only a message HTTP refuses; the code alone still goes.)
        let plain = tonic::Status::new(status.code(), "");
        let _ = plain.add_header(&mut t);
    }
    t
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn timeouts_parse_as_grpc_writes_them() {
        let t = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_str(v).unwrap());
            grpc_timeout(&h)
        };
        assert_eq!(t("100m"), Some(Duration::from_millis(100)));
        assert_eq!(t("3S"), Some(Duration::from_secs(3)));
        assert_eq!(t("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(t("7u"), Some(Duration::from_micros(7)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "123456789m", "1x", "-1m", "1.5S", "12"] {
            assert_eq!(t(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn headers_and_trailers_split_at_the_marker_and_bad_ones_are_refused() {
        let mut m = Metadata::new();
        m.insert("x-a", "1").unwrap();
        m.insert(PATH, "/p.S/M").unwrap();
        m.insert("x-b-bin", "AAEC").unwrap();
        m.insert(TRAILERS, "").unwrap();
        m.insert("grpc-status", "0").unwrap();
        let (h, t) = answer_headers(&m).unwrap();
        assert_eq!(h.len(), 2);
        assert_eq!(h["x-a"], "1");
        assert_eq!(h["x-b-bin"], "AAEC");
        assert_eq!(t.len(), 1);
        assert_eq!(t["grpc-status"], "0");
        // No marker: all headers.
        let (h, t) = answer_headers(&Metadata::new().with("k", "v").unwrap()).unwrap();
        assert_eq!((h.len(), t.len()), (1, 0));
        // A value with a newline is no header's.
        let bad = Metadata::new().with("k", b"a\nb").unwrap();
        assert!(request_headers(&bad).is_err());
        // Hop-by-hop headers stay behind.
        let mut h = HeaderMap::new();
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-k", HeaderValue::from_static("v"));
        let mut m = Metadata::new();
        headers_into(&mut m, &h).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m.get("x-k"), Some(&b"v"[..]));
    }
}
