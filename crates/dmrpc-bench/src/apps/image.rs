//! The image application: the research's 7-tier cloud image-processing
//! service (DmRPC's `img_transcode`), built as real dmrpc services.
//!
//! ```text
//! client → firewall → load balancer → image processing (one of two)
//!                                        ├→ transcoding  (the image → a thumbnail)
//!                                        └→ compressing  (the thumbnail → zstd)
//! ```
//!
//! * **firewall** checks the request's signed token (HMAC-SHA256 over the
//!   header, with the key it shares with clients) and its expiry, and
//!   forwards good requests untouched; bad ones get `InvalidArgument`
//!   ("token rejected: ...") and go no further.
//! * **load balancer** forwards each request, round robin, to one of the
//!   image-processing services.
//! * **image processing** decodes the image's header (the `image` crate's
//!   PNM decoder, over the first bytes only), checks the dimensions against
//!   the request's length, and dispatches: the request to transcoding, the
//!   thumbnail that comes back to compressing. It answers the compressed
//!   thumbnail.
//! * **transcoding** resizes the image to a thumbnail of at most `thumb`
//!   pixels a side (nearest neighbour over the `image` crate's view of the
//!   pixels, in place: it reads only the pixels it samples; from a memory
//!   server, only the rows it samples, in one batch) and re-encodes it as
//!   PPM with the `image` crate's encoder.
//! * **compressing** compresses the thumbnail with zstd (level 3).
//!
//! Every tier passes the request on with [`Payload::forward`]. By Ref the
//! client writes the image into the pool (or onto a memory server) once,
//! and only transcoding reads it, in place; by value every hop copies it.
//!
//! # Request format, version 1
//!
//! A 64-byte header, then a binary PPM image (P6, 8-bit RGB). Integers are
//! little-endian.
//!
//! | offset | size | field                                        |
//! |--------|------|----------------------------------------------|
//! | 0      | 8    | magic `DMIMG` 0 `v` `1`                      |
//! | 8      | 8    | client id                                    |
//! | 16     | 8    | expiry, seconds since the Unix epoch         |
//! | 24     | 4    | thumbnail's largest side, pixels (1–1024)    |
//! | 28     | 4    | reserved, zero                               |
//! | 32     | 32   | HMAC-SHA256 of bytes 0..32 under the key     |
//!
//! The answer is the zstd frame of the thumbnail's PPM ([`expected`]
//! computes it locally).

pub use super::Link;
use super::{u32_at, u64_at, Next};
use dm_rpc::{Node, Payload, RpcError, Server, ServerBuilder, Transport};
use hmac::{Hmac, Mac};
use image::codecs::pnm::{PnmDecoder, PnmEncoder, PnmSubtype, SampleEncoding};
use image::{ColorType, ImageDecoder, ImageEncoder};
use sha2::Sha256;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of the request header.
pub const HEADER_LEN: usize = 64;
/// The header's magic (its last byte is the format version).
pub const MAGIC: [u8; 8] = *b"DMIMG\0v1";
/// The method every tier serves.
pub const METHOD: &str = "process";
/// The largest thumbnail side a request may ask for.
pub const MAX_THUMB: u32 = 1024;
/// The zstd level of the compressing service.
pub const ZSTD_LEVEL: i32 = 3;
/// The most bytes of PPM header the image-processing tier reads.
const PPM_HEADER_MAX: usize = 256;

/// The secret a firewall shares with its clients.
pub type Key = [u8; 32];

/// What a request's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Who sent it.
    pub client: u64,
    /// Valid until this many seconds since the Unix epoch.
    pub expires: u64,
    /// The thumbnail's largest side.
    pub thumb: u32,
}

fn mac(key: &Key) -> Hmac<Sha256> {
    // HMAC takes keys of any length: this cannot fail.
    <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!())
}

impl Header {
    /// The header's 64 bytes, signed with `key`.
    pub fn sign(&self, key: &Key) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(&MAGIC);
        h[8..16].copy_from_slice(&self.client.to_le_bytes());
        h[16..24].copy_from_slice(&self.expires.to_le_bytes());
        h[24..28].copy_from_slice(&self.thumb.to_le_bytes());
        let mut m = mac(key);
        m.update(&h[..32]);
        h[32..].copy_from_slice(&m.finalize().into_bytes());
        h
    }

    /// Checks a header's signature (in constant time), format and expiry
    /// at `now` (seconds since the epoch).
    pub fn verify(h: &[u8; HEADER_LEN], key: &Key, now: u64) -> Result<Header, RpcError> {
        // A token that does not check out is no proof of who sent it; a
        // request that is not one is bad input.
        let reject = |why: &str| RpcError::unauthenticated(format!("token rejected: {why}"));
        if h[..8] != MAGIC {
            return Err(RpcError::invalid_argument(
                "token rejected: not an image request of format version 1",
            ));
        }
        let mut m = mac(key);
        m.update(&h[..32]);
        m.verify_slice(&h[32..])
            .map_err(|_| reject("bad signature"))?;
        let hd = Header {
            client: u64_at(h, 8),
            expires: u64_at(h, 16),
            thumb: u32_at(h, 24),
        };
        if hd.expires < now {
            return Err(reject("expired"));
        }
        if hd.thumb == 0 || hd.thumb > MAX_THUMB || h[28..32] != [0; 4] {
            return Err(RpcError::invalid_argument(format!(
                "thumbnail side {} is not in 1..={MAX_THUMB}",
                hd.thumb
            )));
        }
        Ok(hd)
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A request: the signed header, then the image.
pub fn request(h: &Header, key: &Key, ppm: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + ppm.len());
    v.extend_from_slice(&h.sign(key));
    v.extend_from_slice(ppm);
    v
}

/// A deterministic test image of about `bytes` bytes as a binary PPM
/// (nearly square; gradients with noise from `seed`).
pub fn generate(bytes: usize, seed: u64) -> Vec<u8> {
    let px = (bytes / 3).max(1);
    let w = ((px as f64).sqrt() as usize).max(1);
    let h = (px / w).max(1);
    let mut v = format!("P6\n{w} {h}\n255\n").into_bytes();
    v.reserve(w * h * 3);
    let mut x = seed | 1;
    for y in 0..h {
        for i in 0..w {
            // xorshift64: cheap noise over smooth gradients.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x & 15) as usize;
            v.push(((i * 255 / w) + n) as u8);
            v.push(((y * 255 / h) + n) as u8);
            v.push((((i + y) * 127 / (w + h)) + n) as u8);
        }
    }
    v
}

fn bad_image(e: impl std::fmt::Display) -> RpcError {
    RpcError::invalid_argument(format!("not an 8-bit RGB binary PPM image: {e}"))
}

/// Parses a PPM header at the start of `b`: width, height and the
/// header's length in bytes (the pixels follow).
pub fn parse_ppm(b: &[u8]) -> Result<(u32, u32, usize), RpcError> {
    let mut rest = b;
    let d = PnmDecoder::new(&mut rest).map_err(bad_image)?;
    if d.color_type() != ColorType::Rgb8
        || d.subtype() != PnmSubtype::Pixmap(SampleEncoding::Binary)
    {
        return Err(bad_image(format!("{:?} {:?}", d.subtype(), d.color_type())));
    }
    let (w, h) = d.dimensions();
    drop(d);
    if w == 0 || h == 0 {
        return Err(bad_image(format!("an empty image ({w}x{h})")));
    }
    Ok((w, h, b.len() - rest.len()))
}

/// Bytes of pixel data of a `w` x `h` RGB image (None on overflow).
fn pixel_bytes(w: u32, h: u32) -> Option<usize> {
    (w as usize).checked_mul(h as usize)?.checked_mul(3)
}

/// Parses the PPM header at the start of `head` (the image's first
/// bytes) and checks it against the image's length `len` (header and
/// pixels): width, height and the header's length.
fn dims(head: &[u8], len: usize) -> Result<(u32, u32, usize), RpcError> {
    let (w, h, hl) = parse_ppm(head)?;
    let have = len.saturating_sub(hl);
    match pixel_bytes(w, h) {
        Some(n) if n == have => Ok((w, h, hl)),
        n => Err(bad_image(format!(
            "{w}x{h} needs {} bytes of pixels, which does not match the {have} the request has",
            n.map_or_else(|| "too many".to_owned(), |n| n.to_string())
        ))),
    }
}

/// The image's first bytes in request `p` (up to its PPM header's
/// largest size), and the image's length.
fn image_head(p: &Payload) -> Result<([u8; PPM_HEADER_MAX], usize, usize), RpcError> {
    let len = image_len(p)?;
    let mut head = [0u8; PPM_HEADER_MAX];
    let n = len.min(PPM_HEADER_MAX);
    p.read(HEADER_LEN as u64, &mut head[..n])?;
    Ok((head, n, len))
}

/// The thumbnail's size: the image scaled to fit `side` x `side`.
pub fn thumb_size(w: u32, h: u32, side: u32) -> (u32, u32) {
    if w <= side && h <= side {
        return (w, h);
    }
    let (w64, h64, s) = (w as u64, h as u64, side as u64);
    if w >= h {
        (side, ((h64 * s) / w64).max(1) as u32)
    } else {
        (((w64 * s) / h64).max(1) as u32, side)
    }
}

/// Transcoding's work: the PPM image `ppm` resized (nearest neighbour)
/// to fit `side` x `side`, as PPM.
pub fn transcode(ppm: &[u8], side: u32) -> Result<Vec<u8>, RpcError> {
    transcode_spread(&ppm[..ppm.len().min(PPM_HEADER_MAX)], &[ppm], 0, side)
}

/// Transcoding a PPM image lying at byte `at` of `segs` (runs of
/// contiguous pool pages, read in place) whose first bytes are `head`.
fn transcode_spread(
    head: &[u8],
    segs: &[&[u8]],
    at: usize,
    side: u32,
) -> Result<Vec<u8>, RpcError> {
    let px = Spread::new(segs);
    let (w, h, hl) = dims(head, px.len.saturating_sub(at))?;
    let img = PixelView {
        px,
        at: at + hl,
        w,
        h,
    };
    let (tw, th) = thumb_size(w, h, side);
    encode(&nearest(&img, tw, th))
}

/// Transcoding a PPM image at byte `at` of a payload on a memory server,
/// whose first bytes are `head`: only the rows the thumbnail samples are
/// read, in one batch (about one round trip), not the image.
fn transcode_remote(head: &[u8], p: &Payload, at: usize, side: u32) -> Result<Vec<u8>, RpcError> {
    let (w, h, hl) = dims(head, (p.len() as usize).saturating_sub(at))?;
    let (tw, th) = thumb_size(w, h, side);
    let row = w as usize * 3;
    let mut rows = vec![0u8; row * th as usize];
    let mut ranges: Vec<(u64, &mut [u8])> = rows
        .chunks_mut(row)
        .enumerate()
        .map(|(y, b)| {
            let sy = sample(y as u32, h, th).min(h - 1) as usize;
            ((at + hl + sy * row) as u64, b)
        })
        .collect();
    p.read_ranges(&mut ranges)?;
    // Row y of `rows` is the image's row the thumbnail's row y samples,
    // so sampling `rows` at th rows picks each once.
    let img = image::RgbImage::from_raw(w, th, rows).ok_or_else(|| bad_image("short rows"))?;
    encode(&nearest(&img, tw, th))
}

/// The thumbnail as binary PPM.
fn encode(t: &image::RgbImage) -> Result<Vec<u8>, RpcError> {
    let mut out = Vec::with_capacity(t.len() + 20);
    PnmEncoder::new(&mut out)
        .with_subtype(PnmSubtype::Pixmap(SampleEncoding::Binary))
        .write_image(t.as_raw(), t.width(), t.height(), ColorType::Rgb8)
        .map_err(|e| RpcError::internal(format!("encoding the thumbnail: {e}")))?;
    Ok(out)
}

/// The source coordinate output coordinate `o` of `of` samples among `n`:
/// the centre of its cell.
fn sample(o: u32, n: u32, of: u32) -> u32 {
    ((2 * o as u64 + 1) * n as u64 / (2 * of as u64)) as u32
}

/// Bytes spread over segments, addressed as one run.
struct Spread<'a> {
    segs: &'a [&'a [u8]],
    starts: Vec<usize>,
    len: usize,
}

impl<'a> Spread<'a> {
    fn new(segs: &'a [&'a [u8]]) -> Spread<'a> {
        let mut starts = Vec::with_capacity(segs.len());
        let mut len = 0;
        for s in segs {
            starts.push(len);
            len += s.len();
        }
        Spread { segs, starts, len }
    }

    /// The 3 bytes at `off` (< len - 2).
    fn rgb(&self, off: usize) -> [u8; 3] {
        let i = self.starts.partition_point(|&s| s <= off).saturating_sub(1);
        let (seg, o) = (self.segs[i], off - self.starts[i]);
        match seg.get(o..o + 3) {
            Some(b) => [b[0], b[1], b[2]],
            // A pixel across two runs of pages.
            None => [0, 1, 2].map(|k| {
                let off = off + k;
                let j = self.starts.partition_point(|&s| s <= off).saturating_sub(1);
                self.segs[j][off - self.starts[j]]
            }),
        }
    }
}

/// An RGB image's pixels where they lie (in the pool: no copy), as the
/// `image` crate's view.
struct PixelView<'a> {
    px: Spread<'a>,
    at: usize,
    w: u32,
    h: u32,
}

impl image::GenericImageView for PixelView<'_> {
    type Pixel = image::Rgb<u8>;

    fn dimensions(&self) -> (u32, u32) {
        (self.w, self.h)
    }

    fn bounds(&self) -> (u32, u32, u32, u32) {
        (0, 0, self.w, self.h)
    }

    fn get_pixel(&self, x: u32, y: u32) -> image::Rgb<u8> {
        let i = (y as usize * self.w as usize + x as usize) * 3;
        image::Rgb(self.px.rgb(self.at + i))
    }
}

/// `img` resized to `tw` x `th` by nearest neighbour: each output pixel
/// is the source pixel at its centre, so only those pixels are read (in
/// place: for an image in the pool, the pages of the sampled rows).
/// `image::imageops::resize` with `FilterType::Nearest` picks nearly the
/// same pixels (its rounding differs) but runs a generic floating-point
/// resampler over whole rows: about 170 µs for a 64 px thumbnail of a
/// 64 KiB image here, against about 30 µs.
fn nearest<I>(img: &I, tw: u32, th: u32) -> image::RgbImage
where
    I: image::GenericImageView<Pixel = image::Rgb<u8>>,
{
    let (w, h) = img.dimensions();
    // The source columns and rows, computed once (a division each: per
    // pixel they cost more than the sampling itself).
    let xs: Vec<u32> = (0..tw).map(|x| sample(x, w, tw).min(w - 1)).collect();
    let ys: Vec<u32> = (0..th).map(|y| sample(y, h, th).min(h - 1)).collect();
    image::RgbImage::from_fn(tw, th, |x, y| img.get_pixel(xs[x as usize], ys[y as usize]))
}

thread_local! {
    // A zstd context per thread, reused: creating one per call (what
    // `zstd::bulk::compress` does) costs more than compressing a thumbnail.
    static ZSTD: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Compressing's work.
pub fn compress(b: &[u8]) -> Result<Vec<u8>, RpcError> {
    let fail = |e: std::io::Error| RpcError::internal(format!("zstd: {e}"));
    ZSTD.with(|z| {
        let mut z = z.borrow_mut();
        if z.is_none() {
            *z = Some(zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(fail)?);
        }
        match z.as_mut() {
            Some(c) => c.compress(b).map_err(fail),
            None => Err(RpcError::internal("zstd context")),
        }
    })
}

/// The answer the application gives for image `ppm` and thumbnail side
/// `side`, computed locally.
pub fn expected(ppm: &[u8], side: u32) -> Result<Vec<u8>, RpcError> {
    compress(&transcode(ppm, side)?)
}

/// A tier of the application and what it needs.
#[derive(Debug, Clone)]
pub enum Role {
    /// Checks tokens signed with `key`, forwards to `next`.
    Firewall {
        /// The secret shared with clients.
        key: Key,
        /// The load balancer.
        next: Link,
    },
    /// Forwards round robin to `next`.
    Balancer {
        /// The image-processing services.
        next: Vec<Link>,
    },
    /// Decodes the header and dispatches.
    Processing {
        /// The transcoding service.
        transcode: Link,
        /// The compressing service.
        compress: Link,
    },
    /// Image → thumbnail.
    Transcoding,
    /// Thumbnail → zstd.
    Compressing,
}

/// The length of request `p`'s image (what follows the header), refusing
/// a request shorter than its header.
fn image_len(p: &Payload) -> Result<usize, RpcError> {
    let len =
        usize::try_from(p.len()).map_err(|_| RpcError::invalid_argument("request too large"))?;
    len.checked_sub(HEADER_LEN).ok_or_else(|| {
        RpcError::invalid_argument(format!(
            "a request of {len} bytes is shorter than its {HEADER_LEN}-byte header"
        ))
    })
}

/// Reads the request header (the first 64 bytes only).
fn header_of(p: &Payload) -> Result<[u8; HEADER_LEN], RpcError> {
    image_len(p)?;
    let mut h = [0u8; HEADER_LEN];
    p.read(0, &mut h)?;
    Ok(h)
}

/// Starts tier `role` as service `name` of `node`, listening on
/// `transport`.
pub fn serve(
    node: &Node,
    name: &str,
    role: Role,
    transport: Transport,
) -> Result<Server, RpcError> {
    serve_with(node, node.server(name).transport(transport), role)
}

/// Starts tier `role` on `b`, a server of `node` made as the caller
/// wants it (a replica, say).
pub fn serve_with(node: &Node, b: ServerBuilder, role: Role) -> Result<Server, RpcError> {
    let b = match role {
        Role::Firewall { key, next } => {
            let next = Next::new(node, next);
            b.method(METHOD, move |c| {
                Header::verify(&header_of(c.payload())?, &key, unix_now())?;
                next.call(METHOD, c.payload().forward()?)
            })
        }
        Role::Balancer { next } => {
            if next.is_empty() {
                return Err(RpcError::invalid_argument("a balancer needs services"));
            }
            let next: Vec<Next> = next.into_iter().map(|l| Next::new(node, l)).collect();
            let turn = AtomicUsize::new(0);
            b.method(METHOD, move |c| {
                let k = turn.fetch_add(1, Ordering::Relaxed) % next.len();
                next[k].call(METHOD, c.payload().forward()?)
            })
        }
        Role::Processing {
            transcode,
            compress,
        } => {
            let (tc, cz) = (Next::new(node, transcode), Next::new(node, compress));
            b.method(METHOD, move |c| {
                let p = c.payload();
                // Decode: the image's header only.
                let (head, n, len) = image_head(p)?;
                dims(&head[..n], len)?;
                // Dispatch.
                let thumb = tc.call(METHOD, p.forward()?)?;
                cz.call(METHOD, thumb)
            })
        }
        Role::Transcoding => b.method(METHOD, |c| {
            let p = c.payload();
            let side = u32_at(&header_of(p)?, 24).clamp(1, MAX_THUMB);
            // The image where it lies: its header copied out, its pixels
            // read in place (for a Ref, only the pages of sampled rows).
            let (head, n, _) = image_head(p)?;
            if p.is_remote() {
                return Ok(Payload::from_vec(transcode_remote(
                    &head[..n],
                    p,
                    HEADER_LEN,
                    side,
                )?));
            }
            let segs = p.segments()?;
            Ok(Payload::from_vec(transcode_spread(
                &head[..n],
                &segs,
                HEADER_LEN,
                side,
            )?))
        }),
        Role::Compressing => b.method(METHOD, |c| {
            Ok(Payload::from_vec(compress(&c.payload().bytes()?)?))
        }),
    };
    b.spawn()
}

/// Fuzz entry point shared by `fuzz/fuzz_targets/image_request.rs` and
/// the corpus replay test: everything the tiers decode from a peer's bytes
/// (the signed header, the PPM header, the pixels over runs of pages, the
/// rows read by range) must answer or refuse, never panic, and the three
/// ways of transcoding must agree.
#[doc(hidden)]
pub fn fuzz_request(data: &[u8]) {
    if let Some(h) = data.get(..HEADER_LEN).and_then(|h| h.try_into().ok()) {
        let _ = Header::verify(h, &[0u8; 32], 0);
    }
    let side = data.first().map_or(1, |&b| u32::from(b % 64) + 1);
    let whole = transcode(data, side);
    let head = &data[..data.len().min(PPM_HEADER_MAX)];
    let cut = usize::from(data.get(1).copied().unwrap_or(7)) + 1;
    let segs: Vec<&[u8]> = data.chunks(cut).collect();
    let spread = transcode_spread(head, &segs, 0, side);
    let p = Payload::from_vec(data.to_vec());
    let rows = transcode_remote(head, &p, 0, side);
    match (&whole, &spread, &rows) {
        (Ok(a), Ok(b), Ok(c)) => assert!(a == b && b == c, "transcodings differ"),
        (Err(_), Err(_), Err(_)) => {}
        _ => panic!("one transcoding failed: {whole:?} {spread:?} {rows:?}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use dm_pool::testing::TempPool;
    use dm_pool::PoolConfig;
    use dm_rpc::{Config, Status};

    const KEY: Key = [7u8; 32];

    fn header(expires: u64) -> Header {
        Header {
            client: 42,
            expires,
            thumb: 64,
        }
    }

    #[test]
    fn tokens_verify_and_tampering_is_caught() {
        let now = unix_now();
        let h = header(now + 60).sign(&KEY);
        assert_eq!(Header::verify(&h, &KEY, now).unwrap(), header(now + 60));
        // Any flipped bit of the signed part or of the MAC, another key,
        // expiry, a bad magic: rejected.
        for i in 0..HEADER_LEN {
            let mut t = h;
            t[i] ^= 1;
            assert!(Header::verify(&t, &KEY, now).is_err(), "byte {i}");
        }
        assert!(Header::verify(&h, &[8u8; 32], now).is_err());
        let e = Header::verify(&header(now - 1).sign(&KEY), &KEY, now).unwrap_err();
        assert!(e.message.contains("expired"), "{e}");
        let mut big = header(now + 60);
        big.thumb = MAX_THUMB + 1;
        assert!(Header::verify(&big.sign(&KEY), &KEY, now).is_err());
    }

    #[test]
    fn generated_images_parse_and_thumbnails_fit() {
        for bytes in [10, 4 << 10, 64 << 10, 1 << 20] {
            let ppm = generate(bytes, 1);
            let (w, h, hl) = parse_ppm(&ppm).unwrap();
            assert_eq!(ppm.len(), hl + pixel_bytes(w, h).unwrap());
            assert!(ppm.len() <= bytes + hl && ppm.len() + 3 * w as usize + hl >= bytes);
            let t = transcode(&ppm, 64).unwrap();
            let (tw, th, _) = parse_ppm(&t).unwrap();
            assert_eq!((tw, th), thumb_size(w, h, 64));
            assert!(tw <= 64 && th <= 64);
            assert_eq!(generate(bytes, 1), ppm, "deterministic");
        }
        assert_eq!(thumb_size(1000, 10, 64), (64, 1));
        assert_eq!(thumb_size(10, 1000, 64), (1, 64));
        assert_eq!(thumb_size(20, 30, 64), (20, 30));
        // The in-place view gives what the image crate's own decoding
        // gives; a thumbnail as large as the image is the image.
        let ppm = generate(64 << 10, 3);
        let d = PnmDecoder::new(&ppm[..]).unwrap();
        let (w, h) = d.dimensions();
        let mut px = vec![0u8; d.total_bytes() as usize];
        d.read_image(&mut px).unwrap();
        let owned = image::RgbImage::from_raw(w, h, px).unwrap();
        let t = transcode(&ppm, 16).unwrap();
        let (_, _, thl) = parse_ppm(&t).unwrap();
        let (tw, th) = thumb_size(w, h, 16);
        let r = image::RgbImage::from_fn(tw, th, |x, y| {
            *owned.get_pixel((2 * x + 1) * w / (2 * tw), (2 * y + 1) * h / (2 * th))
        });
        assert!(t[thl..] == *r.as_raw());
        let same = transcode(&ppm, MAX_THUMB).unwrap();
        let (_, _, shl) = parse_ppm(&same).unwrap();
        assert!(same[shl..] == ppm[ppm.len() - (same.len() - shl)..]);
        assert_eq!(parse_ppm(&same).unwrap().0, w);
    }

    #[test]
    fn bad_images_are_invalid_arguments() {
        let ppm = generate(4096, 1);
        for bad in [
            &b"P5\n2 2\n255\n\0\0\0\0"[..],
            &b"P6\n2 2\n65535\n"[..],
            &b"not an image"[..],
            &ppm[..ppm.len() - 1],
            &b"P6\n4000000000 4000000000\n255\n"[..],
        ] {
            let e = transcode(bad, 8).unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument, "{e}");
        }
    }

    #[test]
    fn an_image_over_scattered_pages_transcodes_as_a_contiguous_one() {
        let ppm = generate(200 << 10, 5);
        let want = transcode(&ppm, 48).unwrap();
        // A request header in front, runs of odd lengths (pixels straddle
        // runs), and runs of whole pages.
        let mut req = vec![9u8; HEADER_LEN];
        req.extend_from_slice(&ppm);
        for chunk in [4093, 4096, 3 * 4096, 100_000] {
            let segs: Vec<&[u8]> = req.chunks(chunk).collect();
            let got = transcode_spread(&ppm[..PPM_HEADER_MAX], &segs, HEADER_LEN, 48).unwrap();
            assert!(got == want, "runs of {chunk}");
        }
        let segs: Vec<&[u8]> = req[..req.len() - 2].chunks(4096).collect();
        assert!(transcode_spread(&ppm[..PPM_HEADER_MAX], &segs, HEADER_LEN, 48).is_err());
    }

    #[test]
    fn reading_only_the_sampled_rows_gives_the_same_thumbnail() {
        for (bytes, side) in [(200 << 10, 48), (4 << 10, 64), (1 << 20, 7)] {
            let ppm = generate(bytes, 11);
            let mut req = vec![0u8; HEADER_LEN];
            req.extend_from_slice(&ppm);
            let p = Payload::from_vec(req);
            let got = transcode_remote(&ppm[..PPM_HEADER_MAX.min(ppm.len())], &p, HEADER_LEN, side);
            assert!(got.unwrap() == transcode(&ppm, side).unwrap());
        }
    }

    /// The application over TCP between two pools, the request on a
    /// memory server (DmRPC-net): transcoding reads the rows it samples.
    #[test]
    fn the_application_over_a_memory_server() {
        let ms = dm_memserver::Server::start(dm_memserver::Config {
            size: 64 << 20,
            ..Default::default()
        })
        .unwrap();
        let mem = || dm_memserver::MemPool::connect(&[ms.addr().to_string()]).unwrap();
        let (ta, tb) = (TempPool::new(16 << 20), TempPool::new(16 << 20));
        let node = Node::new(tb.attach()).with_memserver(mem());
        let tcp = || Transport::Tcp("127.0.0.1:0".into());
        let id = std::process::id();
        let start = |r: &str, role: Role| {
            let s = serve(&node, &format!("test/imagenet/{id}/{r}"), role, tcp()).unwrap();
            let a = Link::Tcp(s.tcp_addr().unwrap().to_owned());
            (s, a)
        };
        let (s1, tc) = start("transcode", Role::Transcoding);
        let (s2, cz) = start("compress", Role::Compressing);
        let (s3, p0) = start(
            "proc0",
            Role::Processing {
                transcode: tc,
                compress: cz,
            },
        );
        let (s4, lb) = start("lb", Role::Balancer { next: vec![p0] });
        let (s5, fw) = start("firewall", Role::Firewall { key: KEY, next: lb });
        let Link::Tcp(fw) = fw else { unreachable!() };
        let client = Node::with_config(
            ta.attach(),
            Config {
                inline_max: 0,
                ..Default::default()
            },
        )
        .with_memserver(mem());
        let c = client.connect_tcp(&fw).unwrap();
        let ppm = generate(1 << 20, 4);
        let want = expected(&ppm, 64).unwrap();
        let reads = ms.state().metrics.requests_of("read_ref");
        let req = request(&header(unix_now() + 60), &KEY, &ppm);
        assert!(c.call(METHOD, req).unwrap().to_vec().unwrap() == want);
        // The firewall's header, processing's, transcoding's, its 64 rows.
        let n = ms.state().metrics.requests_of("read_ref") - reads;
        assert!(n <= 3 + 64, "{n} reads");
        drop((c, s5, s4, s3, s2, s1));
        for _ in 0..200 {
            if ms.state().usage().refs == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(ms.state().usage().refs, 0);
        drop((client, node));
        ta.assert_clean();
        tb.assert_clean();
    }

    /// The whole application in one process over shared-memory channels
    /// (the benchmark runs it as seven processes).
    #[test]
    fn the_application_answers_thumbnails_and_rejects_bad_tokens() {
        let tp = TempPool::with(PoolConfig {
            size: 64 << 20,
            channels: Some(32),
            ..Default::default()
        });
        let pool = tp.attach();
        let id = std::process::id();
        let name = |r: &str| format!("test/image/{id}/{r}");
        let shm = |r: &str| Link::Shm(name(r));
        let node = Node::new(pool.clone());
        let servers = [
            ("transcode", Role::Transcoding),
            ("compress", Role::Compressing),
            (
                "proc0",
                Role::Processing {
                    transcode: shm("transcode"),
                    compress: shm("compress"),
                },
            ),
            (
                "proc1",
                Role::Processing {
                    transcode: shm("transcode"),
                    compress: shm("compress"),
                },
            ),
            (
                "lb",
                Role::Balancer {
                    next: vec![shm("proc0"), shm("proc1")],
                },
            ),
            (
                "firewall",
                Role::Firewall {
                    key: KEY,
                    next: shm("lb"),
                },
            ),
        ]
        .into_iter()
        .map(|(n, r)| serve(&node, &name(n), r, Transport::Shm).unwrap())
        .collect::<Vec<_>>();
        let now = unix_now();
        for (inline_max, bytes) in [(usize::MAX, 64 << 10), (0, 64 << 10), (0, 1 << 20)] {
            let client = Node::with_config(
                pool.clone(),
                Config {
                    inline_max,
                    ..Default::default()
                },
            );
            let fw = client.connect(&name("firewall")).unwrap();
            let ppm = generate(bytes, 9);
            let want = expected(&ppm, 64).unwrap();
            for _ in 0..3 {
                let req = request(&header(now + 60), &KEY, &ppm);
                let got = fw.call(METHOD, req).unwrap().to_vec().unwrap();
                assert!(got == want);
            }
            let thumb = zstd::bulk::decompress(&want, 1 << 20).unwrap();
            let (tw, th, _) = parse_ppm(&thumb).unwrap();
            assert_eq!(tw.max(th), 64);
            // Forged, expired, short and malformed requests.
            let mut forged = request(&header(now + 60), &KEY, &ppm);
            forged[8] ^= 1;
            let expired = request(&header(now - 10), &KEY, &ppm);
            let other_key = request(&header(now + 60), &[1u8; 32], &ppm);
            let truncated = request(&header(now + 60), &KEY, &ppm[..ppm.len() / 2]);
            let (unauthenticated, invalid) = (Status::Unauthenticated, Status::InvalidArgument);
            for (bad, why, status) in [
                (forged, "bad signature", unauthenticated),
                (expired, "expired", unauthenticated),
                (other_key, "bad signature", unauthenticated),
                (vec![0u8; 10], "shorter than", invalid),
                (truncated, "does not match", invalid),
            ] {
                let e = fw.call(METHOD, bad).unwrap_err();
                assert_eq!(e.status, status, "{e}");
                assert!(e.message.contains(why), "{e} (wanted {why:?})");
            }
        }
        drop(servers);
        drop(node);
        drop(pool);
        tp.assert_clean();
    }
}
