//! The fuzz target `heap_arg`'s reader: arguments, archives and
//! documents as a peer could send them (`fuzz_arg`). Above every other
//! file: it reaches all the decoders of peer bytes.

use crate::arg::{decode, Heaps, ARG_LEN};
use crate::header::HEADER_LEN;
use crate::heap::Heap;
use dm_pool::Pool;
use std::sync::Arc;

/// A document for the fuzz target's archives.
#[derive(rkyv::Archive, rkyv::Serialize)]
struct FuzzDoc {
    id: u64,
    name: String,
    tags: Vec<String>,
    rows: Vec<Vec<u32>>,
}

/// Reads `data` as edits of valid arguments, as a peer could send them,
/// for the fuzz target `heap_arg` (and its corpus, replayed by the tests):
/// the first byte picks a plain or a sealed argument and the type asked
/// for, or an archive; then each pair of bytes sets one byte of the
/// argument (of the archive's bytes, for an archive). Whatever comes out
/// must be a typed error, or a value in bounds of the heap (an archive
/// whose every part reads).
#[doc(hidden)]
pub fn fuzz_arg(data: &[u8]) {
    use std::sync::OnceLock;
    struct Fixture {
        heaps: Heaps,
        heap: Arc<Heap>,
        plain: [u8; ARG_LEN],
        sealed: [u8; ARG_LEN],
        _scope: &'static crate::scope::Scope<'static>,
        /// An archive's argument, where its bytes are, and a copy of them.
        archive: ([u8; ARG_LEN], usize, Vec<u8>),
    }
    struct Shared(Fixture);
    // SAFETY: the fixture is built once and then only read; the heap's
    // memory is shared on purpose.
    unsafe impl Send for Shared {}
    // SAFETY: as above.
    unsafe impl Sync for Shared {}
    static FIXTURE: OnceLock<Shared> = OnceLock::new();
    let f = &FIXTURE
        .get_or_init(|| {
            let path = std::env::temp_dir().join(format!("dm-heap-fuzz-{}", std::process::id()));
            let _ = Pool::destroy(&path);
            let cfg = dm_pool::PoolConfig {
                size: 16 << 20,
                ..Default::default()
            };
            let pool = Pool::open_or_create(&path, &cfg, Default::default()).expect("a pool");
            // (Mapped, it needs no name: nothing is left behind.)
            let _ = std::fs::remove_file(&path);
            let heaps = Heaps::new(&pool);
            let heap = heaps.add(Heap::create(&pool, 1 << 20).expect("a heap"));
            let v: &[u64; 4] = heap.put([1, 2, 3, 4]).expect("room");
            let plain = heap.arg(v).expect("an argument");
            // (Leaked: the fixture lives as long as the process.)
            let scope: &'static crate::scope::Scope<'static> = Box::leak(Box::new(
                // SAFETY: the heap lives in the fixture, for the process.
                unsafe { &*Arc::as_ptr(&heap) }
                    .scope(4096)
                    .expect("a scope"),
            ));
            let w = scope.put([5u64, 6, 7, 8]).expect("room");
            let seal = scope.seal().expect("a seal");
            let sealed = heap.sealed_arg(w, &seal).expect("an argument");
            std::mem::forget(seal);
            let d = FuzzDoc {
                id: 7,
                name: "doc".into(),
                tags: vec!["a".into(), "bc".into(), "a longer tag than inline".into()],
                rows: (0..6).map(|i| (0..i).collect()).collect(),
            };
            let a = heap.archive(&d).expect("an archive");
            let a_arg = heap.archive_arg(&a).expect("an argument");
            let at = decode(&a_arg).expect("its own argument").off as usize;
            // SAFETY: the archive's bytes, just written.
            let pristine =
                unsafe { std::slice::from_raw_parts(heap.base().add(at), a.len()) }.to_vec();
            Shared(Fixture {
                heaps,
                heap,
                plain,
                sealed,
                _scope: scope,
                archive: (a_arg, at, pristine),
            })
        })
        .0;
    let Some((&mode, edits)) = data.split_first() else {
        return;
    };
    if (mode >> 1) % 6 == 5 {
        // A document's archive, edited, read through checked views.
        static DOC: OnceLock<Vec<u8>> = OnceLock::new();
        let pristine = DOC.get_or_init(|| {
            let d = crate::document::Value::List(vec![
                crate::document::Value::Map(
                    [
                        (
                            "title".to_string(),
                            crate::document::Value::Str("a doc".repeat(9)),
                        ),
                        ("n".to_string(), crate::document::Value::Int(7)),
                        (
                            "raw".to_string(),
                            crate::document::Value::Bytes(vec![1; 40]),
                        ),
                    ]
                    .into_iter()
                    .collect(),
                ),
                crate::document::Value::Float(0.5),
                crate::document::Value::Bool(true),
            ]);
            rkyv::to_bytes::<rkyv::rancor::Failure>(&d)
                .expect("a document archives")
                .to_vec()
        });
        let mut b = rkyv::util::AlignedVec::<16>::new();
        b.extend_from_slice(pristine);
        for e in edits.chunks(2) {
            if let [p, v] = e {
                let at = usize::from(*p) % b.len();
                b[at] = *v;
            }
        }
        if let Ok(r) = crate::view::DocView::root(&b) {
            std::hint::black_box(crate::view::read_all(r, 0));
        }
        return;
    }
    if (mode >> 1) % 6 == 4 {
        // An archive, its bytes edited in the heap, validated (copied).
        let (arg, at, pristine) = &f.archive;
        // SAFETY: the fixture's archive, in its heap, this process's own
        // (the fuzzer runs one input at a time).
        let b = unsafe { std::slice::from_raw_parts_mut(f.heap.base().add(*at), pristine.len()) };
        b.copy_from_slice(pristine);
        for e in edits.chunks(2) {
            if let [p, v] = e {
                b[usize::from(*p) % pristine.len()] = *v;
            }
        }
        if let Ok(c) = f.heaps.archived_copy::<FuzzDoc>(arg) {
            let d = c.get();
            let n: usize = d.name.len()
                + d.tags.iter().map(|t| t.len()).sum::<usize>()
                + d.rows
                    .iter()
                    .map(|r| r.iter().map(|x| x.to_native() as usize).sum::<usize>())
                    .sum::<usize>();
            std::hint::black_box((d.id, n));
        }
        return;
    }
    let mut b = if mode & 1 == 0 { f.plain } else { f.sealed };
    let mut len = ARG_LEN;
    for e in edits.chunks(2) {
        match e {
            [255, n] => len = usize::from(*n).min(ARG_LEN),
            [at, v] => b[usize::from(*at) % ARG_LEN] = *v,
            _ => {}
        }
    }
    let b = &b[..len];
    let (base, end) = (f.heap.base() as u64, f.heap.base() as u64 + f.heap.len());
    let check = |p: *const u8, size: usize| {
        let a = p as u64;
        assert!(
            a >= base + HEADER_LEN && a + size as u64 <= end,
            "a value outside its heap"
        );
    };
    match (mode >> 1) % 6 {
        0 => {
            if let Ok(a) = f.heaps.arg::<[u64; 4]>(b) {
                check(a.as_ptr().cast(), 32);
            }
        }
        1 => {
            if let Ok(a) = f.heaps.sealed_arg::<[u64; 4]>(b) {
                check(a.as_ptr().cast(), 32);
            }
        }
        2 => {
            if let Ok(a) = f.heaps.arg::<u8>(b) {
                check(a.as_ptr(), 1);
            }
        }
        _ => {
            if let Ok(a) = f.heaps.arg::<[u64; 512]>(b) {
                check(a.as_ptr().cast(), 4096);
            }
        }
    }
}
