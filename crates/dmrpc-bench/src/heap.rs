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
//!   - **heap, view**: the same document as a `dm_heap::Value` archive
//!     in a sealed scope, read through checked views: the service checks
//!     only the nodes it reaches;
//!   - **prost**, **serde_json**, **bincode**: encoded by the caller on
//!     every call, passed by value (dmrpc's size-aware payloads: inline,
//!     or copied into the pool from 64 KiB), decoded whole by the service.
//! * **Seal cost.** An argument of 4 KiB, 64 KiB or 1 MiB written before
//!   every call (its first byte) in the next of a ring of scopes, then
//!   sealed (and released after the answer), against the same without a
//!   seal. The service verifies the seal and reads the first byte.
//!
//! * **A key-value service** (RPCool's Memcached under YCSB A, B and C:
//!   50%, 95% and 100% reads, keys drawn from a Zipfian distribution).
//!   By value, a value travels in each put and each get and the service
//!   keeps a copy. In a heap, the values live in a heap the service made
//!   and shares with its clients: a client builds a value there and
//!   passes a pointer, the service keeps the pointer (freeing the value
//!   it replaces), and a get answers with a pointer the client reads in
//!   place.
//!
//! Targets: at 64 KiB, heap pointers at least 10x prost's throughput;
//! validated access (the view, or the whole archive) within 2x of the
//! trusted heap; a sealed call within 2x of an
//! unsealed one.

use super::peer::{percentile, BenchPool, Peer};
use super::plot::Chart;
use super::serde_like::Obj;
use super::BenchArgs;
use crate::say;
use anyhow::{bail, Result};
use dm_heap::rkyv;
use dm_heap::{
    DocView, Heap, HeapAlloc, HeapError, HeapOrderedMap, HeapString, HeapVec, Heaps, ScopeVec,
    Value,
};
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
        dm_heap::extend_copy(&mut scores, &s.scores);
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

/// The document as a [`Value`] (for readers that know no Rust type).
fn to_value(d: &Doc) -> Value {
    let s = |t: &str| Value::Str(t.to_string());
    let section = |x: &Section| {
        Value::Map(BTreeMap::from([
            ("heading".to_string(), s(&x.heading)),
            ("body".to_string(), s(&x.body)),
            (
                "scores".to_string(),
                Value::List(x.scores.iter().map(|&k| Value::Int(k)).collect()),
            ),
        ]))
    };
    Value::Map(BTreeMap::from([
        ("id".to_string(), Value::Int(d.id as i64)),
        ("title".to_string(), s(&d.title)),
        ("author".to_string(), s(&d.author)),
        (
            "tags".to_string(),
            Value::List(d.tags.iter().map(|t| s(t)).collect()),
        ),
        (
            "meta".to_string(),
            Value::Map(d.meta.iter().map(|(k, v)| (k.clone(), s(v))).collect()),
        ),
        (
            "sections".to_string(),
            Value::List(d.sections.iter().map(section).collect()),
        ),
    ]))
}

/// What the service reads of a document, through checked views: each
/// node checked as it is reached, nothing else.
fn read_view(r: DocView<'_>) -> Result<u64, HeapError> {
    let missing = || HeapError::Invalid("a field is missing".into());
    let f = |k: &str| r.get(k)?.ok_or_else(missing);
    let len = |v: Option<DocView<'_>>| -> Result<usize, HeapError> {
        v.map_or(Ok(0), |v| v.as_str().map(str::len))
    };
    let sections = f("sections")?;
    let n = sections.len()?;
    let score = match n.checked_sub(1) {
        Some(last) => {
            let last = sections.index(last)?.ok_or_else(missing)?;
            let scores = last.get("scores")?.ok_or_else(missing)?;
            scores.index(0)?.map_or(Ok(0), |x| x.as_i64())?
        }
        None => 0,
    };
    Ok(fields(
        f("id")?.as_i64()? as u64,
        f("title")?.as_str()?.len(),
        len(f("tags")?.index(0)?)?,
        len(f("meta")?.get("lang")?)?,
        n,
        score,
    ))
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
    let (h1, h2, h3, h4) = (heaps.clone(), heaps.clone(), heaps.clone(), heaps.clone());
    let h5 = heaps;
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
        .method("view", move |c| {
            let b = c.payload().bytes()?;
            let v = h5.document_view(&b).map_err(bad)?;
            answer(read_view(v.root().map_err(bad)?).map_err(bad)?)
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

/// A value of the key-value service in the service's heap, in a box the
/// client made (a `HeapBox`), which the service owns once it is put.
type KvValue<'h> = HeapVec<'h, u8>;

/// What a client reads of a value: every 64th byte, summed.
fn touch(v: &[u8]) -> u64 {
    v.iter().step_by(64).map(|&b| u64::from(b)).sum()
}

fn key_of(b: &[u8]) -> Result<u64, RpcError> {
    b.get(..8)
        .and_then(|k| k.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| RpcError::invalid_argument("no key"))
}

/// The key-value service (in the peer): `put`/`get` by value, and
/// `hput`/`hget` with values in the heap it shares (`heap` gives it).
pub fn peer_kv(pool: &Pool, name: &str) -> Result<Server> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    let node = Node::new(pool.clone());
    let heaps = Arc::new(Heaps::new(pool));
    let heap = heaps.add(Heap::create(pool, 160 << 20)?);
    let shared = heap.share()?.to_bytes().to_vec();
    let by_value: Arc<Mutex<HashMap<u64, Vec<u8>>>> = Arc::default();
    // Offsets of the boxes the clients put, by key.
    let in_heap: Arc<Mutex<HashMap<u64, u64>>> = Arc::default();
    let (v1, v2) = (by_value.clone(), by_value);
    let (i1, i2) = (in_heap.clone(), in_heap);
    let (hp1, hp2) = (heap.clone(), heap);
    let hs = heaps;
    Ok(node
        .server(name)
        .method("heap", move |_| Ok(Payload::from_vec(shared.clone())))
        .method("put", move |c| {
            let b = c.payload().bytes()?;
            let k = key_of(&b)?;
            v1.lock().map_err(bad)?.insert(k, b[8..].to_vec());
            Ok(Payload::empty())
        })
        .method("get", move |c| {
            let k = key_of(&c.payload().bytes()?)?;
            let v = v2.lock().map_err(bad)?.get(&k).cloned().unwrap_or_default();
            Ok(Payload::from_vec(v))
        })
        .method("hput", move |c| {
            let b = c.payload().bytes()?;
            let k = key_of(&b)?;
            let a = hs.arg::<KvValue>(&b[8..]).map_err(bad)?;
            let off = a.as_ptr() as u64 - hp1.base() as u64;
            let old = i1.lock().map_err(bad)?.insert(k, off);
            if let Some(old) = old {
                // SAFETY: a box a client put and gave up (the bench's
                // client never keeps what it puts), taken back once: its
                // key now names another.
                drop(unsafe {
                    dm_heap::HeapBox::from_raw_in(
                        hp1.base().add(old as usize) as *mut KvValue,
                        hp1.alloc(),
                    )
                });
            }
            Ok(Payload::empty())
        })
        .method("hget", move |c| {
            let k = key_of(&c.payload().bytes()?)?;
            let off = i2.lock().map_err(bad)?.get(&k).copied();
            let Some(off) = off else {
                return Ok(Payload::empty());
            };
            // SAFETY: the box of that key, alive until its key is put again.
            let v = unsafe { &*(hp2.base().add(off as usize) as *const KvValue) };
            Ok(Payload::from_vec(hp2.arg(v).map_err(bad)?.to_vec()))
        })
        .spawn()?)
}

/// Keys drawn from a Zipfian distribution over `n` keys (YCSB's, with
/// its constant 0.99), by a small deterministic generator.
struct Zipf {
    cdf: Vec<f64>,
    state: u64,
}

impl Zipf {
    fn new(n: usize, seed: u64) -> Zipf {
        let w: Vec<f64> = (1..=n).map(|i| 1.0 / (i as f64).powf(0.99)).collect();
        let total: f64 = w.iter().sum();
        let mut acc = 0.0;
        let cdf = w
            .iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect();
        Zipf {
            cdf,
            state: seed | 1,
        }
    }

    /// A number in [0, 1).
    fn unit(&mut self) -> f64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state >> 11) as f64 / (1u64 << 53) as f64
    }

    fn key(&mut self) -> u64 {
        let u = self.unit();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u64
    }
}

/// The key-value service under YCSB A, B and C, by value and in its heap.
fn kv(a: &BenchArgs, peer: &mut Peer, node: &Node, pool: &Pool) -> Result<Vec<Obj>> {
    let name = format!("bench/kv/{}", std::process::id());
    peer.cmd(&format!("heapkv {name}"))?;
    let c = node.connect(&name)?;
    // The service's heap, opened here: values are built in it, and the
    // service's answers point into it.
    let reader = Heaps::new(pool);
    let shared = dm_heap::HeapRef::from_bytes(&c.call("heap", Payload::empty())?.to_vec()?)?;
    let heap = reader.add(Heap::open(pool, &shared)?);
    let configs: &[(u64, usize, usize)] = if a.quick {
        &[(1000, 2000, 4 << 10)]
    } else {
        &[(10_000, 100_000, 4 << 10), (1000, 20_000, 64 << 10)]
    };
    say!("key-value service (YCSB, Zipfian keys, one call at a time)");
    say!(
        "{:>9} {:>9} {:>14} {:>14} {:>10}",
        "value",
        "workload",
        "by value op/s",
        "heap op/s",
        "heap/value"
    );
    let mut rows = Vec::new();
    for &(keys, ops, size) in configs {
        rows.extend(kv_run(&c, &heap, &reader, keys, ops, size)?);
    }
    drop(reader);
    drop(heap);
    Ok(rows)
}

/// YCSB A, B and C over `keys` keys of `size`-byte values, `ops`
/// operations each, by value and in the service's heap.
fn kv_run(
    c: &dm_rpc::Client,
    heap: &Heap,
    reader: &Heaps,
    keys: u64,
    ops: usize,
    size: usize,
) -> Result<Vec<Obj>> {
    let value: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let put_value = |k: u64| -> Result<()> {
        let mut b = k.to_le_bytes().to_vec();
        b.extend_from_slice(&value);
        c.call("put", Payload::from_vec(b))?;
        Ok(())
    };
    let put_heap = |k: u64| -> Result<()> {
        let mut v = HeapVec::with_capacity_in(size, heap.alloc());
        dm_heap::extend_copy(&mut v, &value);
        let boxed = dm_heap::HeapBox::new_in(v, heap.alloc());
        let mut b = k.to_le_bytes().to_vec();
        b.extend_from_slice(&heap.arg(&*boxed)?);
        // (The service owns it now.)
        let _ = dm_heap::HeapBox::into_raw(boxed);
        c.call("hput", Payload::from_vec(b))?;
        Ok(())
    };
    let get_value = |k: u64| -> Result<u64> {
        Ok(touch(
            &c.call("get", Payload::from_vec(k.to_le_bytes().to_vec()))?
                .to_vec()?,
        ))
    };
    let get_heap = |k: u64| -> Result<u64> {
        let arg = c
            .call("hget", Payload::from_vec(k.to_le_bytes().to_vec()))?
            .to_vec()?;
        let v = reader.arg::<KvValue>(&arg)?;
        // SAFETY: the service's value of that key, which no one puts
        // again while this client reads it (the bench's one client).
        Ok(touch(unsafe { v.get() }))
    };
    for k in 0..keys {
        put_value(k)?;
        put_heap(k)?;
    }
    let mut rows = Vec::new();
    for (w, reads) in [("A", 0.5), ("B", 0.95), ("C", 1.0)] {
        let mut rate = [0.0; 2];
        for (i, r) in rate.iter_mut().enumerate() {
            let mut z = Zipf::new(keys as usize, 0x9e37_79b9 + i as u64);
            let start = Instant::now();
            let mut sink = 0u64;
            for _ in 0..ops {
                let k = z.key();
                let read = z.unit() < reads;
                sink = sink.wrapping_add(match (i, read) {
                    (0, true) => get_value(k)?,
                    (0, false) => put_value(k).map(|()| 0)?,
                    (_, true) => get_heap(k)?,
                    (_, false) => put_heap(k).map(|()| 0)?,
                });
            }
            std::hint::black_box(sink);
            *r = ops as f64 / start.elapsed().as_secs_f64();
        }
        say!(
            "{:>9} {:>9} {:>14.0} {:>14.0} {:>9.1}x",
            fmt_size(size as u64),
            w,
            rate[0],
            rate[1],
            rate[1] / rate[0]
        );
        let mut o = Obj::default();
        o.str("part", "kv");
        o.str("workload", w);
        o.num("value_bytes", size as f64);
        o.num("value_ops_per_s", rate[0]);
        o.num("heap_ops_per_s", rate[1]);
        o.num("heap_over_value", rate[1] / rate[0]);
        rows.push(o);
        super::progress::tick(format!("kv {} {w}", fmt_size(size as u64)));
    }
    Ok(rows)
}

/// Times `n` calls made by `call` (after a warm-up): p50 in ns, and calls
/// per second over the whole run.
/// As [`time`], after checking that the first answer is `expect`.
fn time_checked(
    n: usize,
    expect: u64,
    mut call: impl FnMut() -> Result<u64>,
) -> Result<(f64, f64)> {
    let got = call()?;
    if got != expect {
        bail!("answered {got}, not {expect}");
    }
    time(n, call)
}

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
    let ways = ["heap", "validated", "view", "prost", "json", "bincode"];
    super::progress::start("heap", (sizes.len() * ways.len() + 9) as u64);
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
        let vscope = heap.scope((size as u64) * 2 + (64 << 10))?;
        let varchive = vscope.archive(&to_value(&d))?;
        let mut results = Vec::new();
        // What every way must answer: the fields read here.
        let expect = read_doc(&d);
        for way in ways {
            let (p50, rate, wire) = match way {
                "heap" => {
                    let arg = heap.arg(hd)?;
                    let (p, r) = time_checked(n, expect, || {
                        num(c.call("heap", Payload::from_vec(arg.to_vec()))?)
                    })?;
                    (p, r, arg.len())
                }
                "validated" => {
                    let (p, r) = time_checked(n, expect, || {
                        let seal = scope.seal()?;
                        let arg = heap.sealed_archive_arg(&archive, &seal)?;
                        let v = num(c.call("validated", Payload::from_vec(arg.to_vec()))?);
                        drop(seal);
                        v
                    })?;
                    (p, r, dm_heap::ARG_LEN)
                }
                "view" => {
                    let (p, r) = time_checked(n, expect, || {
                        let seal = vscope.seal()?;
                        let arg = heap.sealed_archive_arg(&varchive, &seal)?;
                        let v = num(c.call("view", Payload::from_vec(arg.to_vec()))?);
                        drop(seal);
                        v
                    })?;
                    (p, r, dm_heap::ARG_LEN)
                }
                "prost" => {
                    let (p, r) = time_checked(n, expect, || {
                        num(c.call("prost", Payload::from_vec(d.encode_to_vec()))?)
                    })?;
                    (p, r, d.encoded_len())
                }
                "json" => {
                    let (p, r) = time_checked(n, expect, || {
                        num(c.call("json", Payload::from_vec(serde_json::to_vec(&d)?))?)
                    })?;
                    (p, r, serde_json::to_vec(&d)?.len())
                }
                _ => {
                    let (p, r) = time_checked(n, expect, || {
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
        drop((scope, vscope));
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
    rows.extend(kv(a, &mut peer, &node, pool)?);
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
        "document store: p50 and calls/s of one call at a time whose service (another process) reads a few fields; heap = pointer into a shared heap read in place; validated = rkyv archive in a sealed scope, seal verified and archive validated per call; view = a Value archive in a sealed scope, seal verified and each node read checked (checked views); prost/json/bincode = encoded per call, by value, decoded whole. Seal cost: an argument written before each call in a ring of scopes, sealed or not. Key-value: YCSB A/B/C (50/95/100% reads, Zipfian 0.99 keys), values by value or in the service's shared heap",
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
