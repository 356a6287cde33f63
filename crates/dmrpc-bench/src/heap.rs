//! `dmrpc bench heap` — pointer-rich arguments in a shared heap against
//! the serializations users would otherwise pay (RPCool's experiments).
//!
//! * **A document store.** Documents of nested maps and lists (a title,
//!   tags, a map of metadata, sections of text with scores), 1 KiB to
//!   1 MiB, sent to a service (another process) that reads a few fields
//!   (the id, the title, the first tag, one metadata value, the number of
//!   sections and the last section's first score). Five ways, in the
//!   same run over the same channel:
//!   - **heap**: built once in a shared heap with the heap's collections;
//!     each call passes a 96-byte pointer and the service reads in place,
//!     trusting its sender;
//!   - **heap, validated**: an `rkyv` archive in a sealed scope; each call
//!     seals it (the scope is not written between calls, so a seal costs
//!     no page-table work) and the service verifies the seal and
//!     validates the whole archive (`bytecheck`) before it reads;
//!   - **prost**, **serde_json**, **bincode**: encoded by the caller on
//!     every call, passed by value (dmrpc's size-aware payloads: inline,
//!     or copied into the pool from 64 KiB), decoded whole by the service.
//! * **Seal cost.** An argument of 4 KiB, 64 KiB or 1 MiB written before
//!   every call (its first byte) in the next of a ring of scopes, then
//!   sealed (and released after the answer), against the same without a
//!   seal. The service verifies the seal and reads the first byte.
//!
//! Targets: at 64 KiB, heap pointers at least 10x prost's throughput;
//! validated within 2x of the trusted heap; a sealed call within 2x of an
//! unsealed one.

use super::peer::{percentile, BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_heap::rkyv;
use dm_heap::{Heap, HeapAlloc, HeapOrderedMap, HeapString, HeapVec, Heaps, ScopeVec};
use dm_pool::{Pool, PoolConfig};
use dm_rpc::{Node, Payload, RpcError, Server};
use dmrpc::fmt_size;
use prost::Message;
use std::collections::BTreeMap;
use std::time::Instant;

/// A document, as users write it: one struct for every format.
#[derive(
    Clone,
    PartialEq,
    prost::Message,
    serde::Serialize,
    serde::Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
)]
#[rkyv(crate = dm_heap::rkyv)]
pub struct Doc {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(string, tag = "2")]
    pub title: String,
    #[prost(string, tag = "3")]
    pub author: String,
    #[prost(string, repeated, tag = "4")]
    pub tags: Vec<String>,
    #[prost(btree_map = "string, string", tag = "5")]
    pub meta: BTreeMap<String, String>,
    #[prost(message, repeated, tag = "6")]
    pub sections: Vec<Section>,
}

/// A section of a document.
#[derive(
    Clone,
    PartialEq,
    prost::Message,
    serde::Serialize,
    serde::Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
)]
#[rkyv(crate = dm_heap::rkyv)]
pub struct Section {
    #[prost(string, tag = "1")]
    pub heading: String,
    #[prost(string, tag = "2")]
    pub body: String,
    #[prost(sint64, repeated, tag = "3")]
    pub scores: Vec<i64>,
}

/// The same document built in a heap with the heap's collections.
#[allow(dead_code, reason = "passed whole; the service reads a few fields")]
pub struct HeapDoc<'h> {
    pub id: u64,
    pub title: HeapString<'h>,
    pub author: HeapString<'h>,
    pub tags: HeapVec<'h, HeapString<'h>>,
    pub meta: HeapOrderedMap<'h, HeapString<'h>, HeapString<'h>>,
    pub sections: HeapVec<'h, HeapSection<'h>>,
}

/// A section in a heap.
#[allow(dead_code, reason = "passed whole; the service reads a few fields")]
pub struct HeapSection<'h> {
    pub heading: HeapString<'h>,
    pub body: HeapString<'h>,
    pub scores: HeapVec<'h, i64>,
}

/// A document of about `size` bytes: a header, then sections of about
/// 1 KiB (a 1 KiB document has one short section).
fn doc(size: usize) -> Doc {
    let n = (size / 1100).max(1);
    let body_len = if size < 1100 { size / 2 } else { 900 };
    Doc {
        id: 42,
        title: "Pointer-rich arguments in a shared heap".into(),
        author: "dmrpc".into(),
        tags: (0..8).map(|i| format!("tag-{i}")).collect(),
        meta: (0..8)
            .map(|i| (format!("key{i}"), format!("value {i}")))
            .chain([("lang".to_string(), "en".to_string())])
            .collect(),
        sections: (0..n)
            .map(|i| Section {
                heading: format!("Section {i}"),
                body: "lorem ipsum dolor sit amet ".repeat(body_len / 27 + 1),
                scores: (0..16).map(|k| (i * 16 + k) as i64).collect(),
            })
            .collect(),
    }
}

fn hstr<'h>(s: &str, a: HeapAlloc<'h>) -> HeapString<'h> {
    HeapString::from_str_in(s, a)
}

fn to_heap<'h>(d: &Doc, a: HeapAlloc<'h>) -> HeapDoc<'h> {
    let mut tags = HeapVec::with_capacity_in(d.tags.len(), a);
    tags.extend(d.tags.iter().map(|t| hstr(t, a)));
    let mut meta = HeapOrderedMap::with_capacity_in(d.meta.len(), a);
    for (k, v) in &d.meta {
        meta.insert(hstr(k, a), hstr(v, a));
    }
    let mut sections = HeapVec::with_capacity_in(d.sections.len(), a);
    sections.extend(d.sections.iter().map(|s| {
        let mut scores = HeapVec::with_capacity_in(s.scores.len(), a);
        scores.extend_from_slice(&s.scores);
        HeapSection {
            heading: hstr(&s.heading, a),
            body: hstr(&s.body, a),
            scores,
        }
    }));
    HeapDoc {
        id: d.id,
        title: hstr(&d.title, a),
        author: hstr(&d.author, a),
        tags,
        meta,
        sections,
    }
}

/// What the service reads of a document, folded into one number.
fn fields(id: u64, title: usize, tag0: usize, lang: usize, sections: usize, score: i64) -> u64 {
    id + title as u64 + tag0 as u64 + lang as u64 + sections as u64 + score as u64
}

fn read_doc(d: &Doc) -> u64 {
    fields(
        d.id,
        d.title.len(),
        d.tags.first().map_or(0, String::len),
        d.meta.get("lang").map_or(0, String::len),
        d.sections.len(),
        d.sections
            .last()
            .and_then(|s| s.scores.first().copied())
            .unwrap_or(0),
    )
}

fn answer(v: u64) -> Result<Payload, RpcError> {
    Ok(Payload::from_vec(v.to_le_bytes().to_vec()))
}

fn bad(e: impl std::fmt::Display) -> RpcError {
    RpcError::invalid_argument(e.to_string())
}

/// The service (in the peer): one method per way.
pub fn peer_serve(pool: &Pool, name: &str) -> Result<Server> {
    let node = Node::new(pool.clone());
    let heaps = std::sync::Arc::new(Heaps::new(pool));
    let (h1, h2, h3, h4) = (heaps.clone(), heaps.clone(), heaps.clone(), heaps);
    Ok(node
        .server(name)
        .method("heap", move |c| {
            let b = c.payload().bytes()?;
            let a = h1.arg::<HeapDoc>(&b).map_err(bad)?;
            // SAFETY: the bench's client passes a HeapDoc it leaves be.
            let d = unsafe { a.get() };
            answer(fields(
                d.id,
                d.title.len(),
                d.tags.first().map_or(0, |t| t.len()),
                d.meta.get("lang").map_or(0, |v| v.len()),
                d.sections.len(),
                d.sections
                    .last()
                    .and_then(|s| s.scores.first().copied())
                    .unwrap_or(0),
            ))
        })
        .method("validated", move |c| {
            let b = c.payload().bytes()?;
            let v = h2.archived_sealed::<Doc>(&b).map_err(bad)?;
            let d = v.get();
            answer(fields(
                d.id.to_native(),
                d.title.len(),
                d.tags.first().map_or(0, |t| t.len()),
                d.meta.get("lang").map_or(0, |v| v.len()),
                d.sections.len(),
                d.sections
                    .last()
                    .and_then(|s| s.scores.first().map(|x| x.to_native()))
                    .unwrap_or(0),
            ))
        })
        .method("prost", |c| {
            answer(read_doc(&Doc::decode(&*c.payload().bytes()?).map_err(bad)?))
        })
        .method("json", |c| {
            answer(read_doc(
                &serde_json::from_slice::<Doc>(&c.payload().bytes()?).map_err(bad)?,
            ))
        })
        .method("bincode", |c| {
            answer(read_doc(
                &bincode::deserialize::<Doc>(&c.payload().bytes()?).map_err(bad)?,
            ))
        })
        // Seal cost: the first byte of a sealed vector, or of a plain one.
        .method("sealed", move |c| {
            let b = c.payload().bytes()?;
            let a = h3.sealed_arg::<ScopeVec<u8>>(&b).map_err(bad)?;
            // SAFETY: sealed (verified): its sender cannot change it.
            answer(u64::from(unsafe { a.get() }.first().copied().unwrap_or(0)))
        })
        .method("plain", move |c| {
            let b = c.payload().bytes()?;
            let a = h4.arg::<ScopeVec<u8>>(&b).map_err(bad)?;
            // SAFETY: the bench's client leaves it be during the call.
            answer(u64::from(unsafe { a.get() }.first().copied().unwrap_or(0)))
        })
        .spawn()?)
}

/// Times `n` calls made by `call` (after a warm-up): p50 in ns, and calls
/// per second over the whole run.
fn time(n: usize, mut call: impl FnMut() -> Result<u64>) -> Result<(f64, f64)> {
    let want = call()?;
    for _ in 0..(n / 10).max(5) {
        if call()? != want {
            bail!("an answer changed");
        }
    }
    let mut v = Vec::with_capacity(n);
    let start = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        if call()? != want {
            bail!("an answer changed");
        }
        v.push(t.elapsed().as_nanos() as f64);
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    Ok((percentile(&mut v, 0.5), rate))
}

fn num(p: Payload) -> Result<u64> {
    let b = p.to_vec()?;
    Ok(u64::from_le_bytes(b.as_slice().try_into()?))
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let quick = a.quick;
    let bp = BenchPool::create(
        "heap",
        PoolConfig {
            size: 1 << 30,
            channels: Some(8),
            ring_size: 4 << 20,
            ..Default::default()
        },
    )?;
    let (pool, path) = (&bp.pool, &bp.path);
    let mut peer = Peer::spawn(path, &[])?;
    let name = format!("bench/heap/{}", std::process::id());
    peer.cmd(&format!("heapdocs {name}"))?;
    let node = Node::new(pool.clone());
    let c = node.connect(&name)?;
    let heap = Heap::create(pool, 160 << 20)?;
    let sizes: &[usize] = if quick {
        &[1 << 10, 64 << 10]
    } else {
        &[1 << 10, 16 << 10, 64 << 10, 1 << 20]
    };
    let ways = ["heap", "validated", "prost", "json", "bincode"];
    super::progress::start("heap", (sizes.len() * ways.len() + 3) as u64);
    say!("bench heap: a document store whose service reads a few fields (one call at a time)");
    say!(
        "{:>8} {:>10} {:>8} {:>10} {:>12} {:>10}",
        "size",
        "way",
        "wire B",
        "p50 us",
        "calls/s",
        "vs prost"
    );
    let mut rows = Vec::new();
    for &size in sizes {
        let d = doc(size);
        let n = if quick {
            300
        } else if size >= 1 << 20 {
            1000
        } else {
            20_000
        };
        // Built once: in the heap, and as an archive in a scope.
        let hd = heap.put(to_heap(&d, heap.alloc()))?;
        let scope = heap.scope((size as u64) * 2 + (64 << 10))?;
        let archive = scope.archive(&d)?;
        let mut results = Vec::new();
        for way in ways {
            let (p50, rate, wire) = match way {
                "heap" => {
                    let arg = heap.arg(hd)?;
                    let (p, r) = time(n, || num(c.call("heap", Payload::from_vec(arg.to_vec()))?))?;
                    (p, r, arg.len())
                }
                "validated" => {
                    let (p, r) = time(n, || {
                        let seal = scope.seal()?;
                        let arg = heap.sealed_archive_arg(&archive, &seal)?;
                        let v = num(c.call("validated", Payload::from_vec(arg.to_vec()))?);
                        drop(seal);
                        v
                    })?;
                    (p, r, dm_heap::ARG_LEN)
                }
                "prost" => {
                    let (p, r) = time(n, || {
                        num(c.call("prost", Payload::from_vec(d.encode_to_vec()))?)
                    })?;
                    (p, r, d.encoded_len())
                }
                "json" => {
                    let (p, r) = time(n, || {
                        num(c.call("json", Payload::from_vec(serde_json::to_vec(&d)?))?)
                    })?;
                    (p, r, serde_json::to_vec(&d)?.len())
                }
                _ => {
                    let (p, r) = time(n, || {
                        num(c.call("bincode", Payload::from_vec(bincode::serialize(&d)?))?)
                    })?;
                    (p, r, bincode::serialize(&d)?.len())
                }
            };
            results.push((way, p50, rate, wire));
            super::progress::tick(format!("{} {way}", fmt_size(size as u64)));
        }
        heap.flush_seals();
        // The floor of validated access: validating the archive alone, in
        // this process, from a private copy (what every validated call
        // pays on top of a trusted one).
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(&d)?;
        let (check, _) = time(n, || {
            let a = rkyv::access::<ArchivedDoc, rkyv::rancor::Error>(std::hint::black_box(&bytes))?;
            Ok(a.id.to_native())
        })?;
        let prost_rate = results
            .iter()
            .find(|r| r.0 == "prost")
            .map_or(f64::NAN, |r| r.2);
        let heap_rate = results[0].2;
        say!(
            "{:>8} {:>10} {:>8} {:>10.2}   (validating the archive alone: the floor of validated's extra cost)",
            fmt_size(size as u64),
            "floor",
            bytes.len(),
            check / 1e3
        );
        let mut o = Obj::default();
        o.str("part", "validation floor");
        o.num("size", size as f64);
        o.num("p50_ns", check);
        rows.push(o);
        for (way, p50, rate, wire) in results {
            say!(
                "{:>8} {:>10} {:>8} {:>10.2} {:>12.0} {:>9.1}x",
                fmt_size(size as u64),
                way,
                wire,
                p50 / 1e3,
                rate,
                rate / prost_rate
            );
            let mut o = Obj::default();
            o.str("part", "docs");
            o.num("size", size as f64);
            o.str("way", way);
            o.num("wire_bytes", wire as f64);
            o.num("p50_ns", p50);
            o.num("calls_per_s", rate);
            o.num("over_prost", rate / prost_rate);
            o.num("over_heap", rate / heap_rate);
            rows.push(o);
        }
        drop(scope);
    }

    // Seal cost: a ring of scopes, each written before its call.
    say!(
        "seal cost: an argument written before each call, sealed or not (the ring of {} scopes)",
        dm_heap::BATCH
    );
    say!(
        "{:>8} {:>12} {:>12} {:>14}",
        "size",
        "plain us",
        "sealed us",
        "sealed/plain"
    );
    for size in [4usize << 10, 64 << 10, 1 << 20] {
        let n = if quick { 300 } else { 20_000 };
        let scopes: Vec<_> = (0..dm_heap::BATCH)
            .map(|_| heap.scope(size as u64 + 4096))
            .collect::<Result<_, _>>()?;
        let vecs: Vec<_> = scopes
            .iter()
            .map(|s| {
                let mut v = ScopeVec::with_capacity_in(size, s.alloc());
                v.resize(size, 1u8);
                s.put(v)
            })
            .collect::<Result<_, _>>()?;
        let mut k = 0usize;
        let (plain, _) = time(n, || {
            k = (k + 1) % scopes.len();
            let v = vecs[k];
            // SAFETY: the vector's first byte, in a scope this process
            // owns and has not sealed.
            unsafe { (v.as_ptr() as *mut u8).write_volatile(1) };
            num(c.call("plain", Payload::from_vec(heap.arg(v)?.to_vec()))?)
        })?;
        let (sealed, _) = time(n, || {
            k = (k + 1) % scopes.len();
            let v = vecs[k];
            // SAFETY: as above; a released seal still on it is undone by
            // the store (the fault hook).
            unsafe { (v.as_ptr() as *mut u8).write_volatile(1) };
            let seal = scopes[k].seal()?;
            let r = num(c.call(
                "sealed",
                Payload::from_vec(heap.sealed_arg(v, &seal)?.to_vec()),
            )?);
            drop(seal);
            r
        })?;
        heap.flush_seals();
        // The floor of a seal: making the argument's pages read-only and
        // writable again (one `mprotect` each), with no call.
        let (start, len) = scopes[0].range();
        let (pair, _) = time(n, || {
            // SAFETY: a scope of this process, not sealed now: its pages
            // go read-only and back, with nothing stored in between.
            unsafe {
                dm_sys::mem::protect(start as *mut u8, len as usize, dm_sys::mem::Prot::Read)?;
                dm_sys::mem::protect(start as *mut u8, len as usize, dm_sys::mem::Prot::ReadWrite)?;
            }
            Ok(0)
        })?;
        say!(
            "{:>8} {:>12.2} {:>12.2} {:>13.2}x   floor: an mprotect pair {:.2} us",
            fmt_size(size as u64),
            plain / 1e3,
            sealed / 1e3,
            sealed / plain,
            pair / 1e3
        );
        let mut o = Obj::default();
        o.str("part", "seal");
        o.num("size", size as f64);
        o.num("plain_p50_ns", plain);
        o.num("sealed_p50_ns", sealed);
        o.num("sealed_over_plain", sealed / plain);
        o.num("mprotect_pair_p50_ns", pair);
        rows.push(o);
        super::progress::tick(format!("seal {}", fmt_size(size as u64)));
        drop(vecs);
        drop(scopes);
    }
    peer.cmd("unserve")?;
    drop(peer);
    drop(c);
    drop(node);
    drop(heap);
    bp.check()?;
    let mut res = Obj::default();
    res.str("benchmark", "heap");
    res.str(
        "method",
        "document store: p50 and calls/s of one call at a time whose service (another process) reads a few fields; heap = pointer into a shared heap read in place; validated = rkyv archive in a sealed scope, seal verified and archive validated per call; prost/json/bincode = encoded per call, by value, decoded whole. Seal cost: an argument written before each call in a ring of scopes, sealed or not",
    );
    res.obj("machine", &super::machine());
    res.arr("rows", &rows);
    let docs: Vec<Obj> = rows
        .iter()
        .filter(|r| r.text("part") == Some("docs"))
        .cloned()
        .collect();
    super::write_results(
        a,
        "heap",
        &Chart {
            title: "bench heap: a document store, calls/s by way",
            x: "size",
            ys: &["calls_per_s"],
            by: Some("way"),
            y_label: "calls/s",
            log_x: true,
            log_y: true,
        },
        &res,
        &docs,
        &[
            "size",
            "way",
            "wire_bytes",
            "p50_ns",
            "calls_per_s",
            "over_prost",
            "over_heap",
        ],
    )
}
