//! Heaps across real processes (`dm-heap-agent`): data built in one and
//! read and changed in another, allocation from several at once, a
//! process killed holding the heap's lock, an address range taken.
#![allow(clippy::unwrap_used)]

use dm_heap::{Heap, HeapError, HeapMap, HeapVec};
use dm_pool::testing::TempPool;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

type Root<'h> = HeapMap<'h, u64, HeapVec<'h, u64>>;

struct Agent {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Agent {
    fn spawn(tp: &TempPool) -> Agent {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dm-heap-agent"))
            .arg(&tp.path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut hello = String::new();
        out.read_line(&mut hello).unwrap();
        assert!(hello.starts_with("ok slot"), "{hello:?}");
        Agent { child, stdin, out }
    }

    /// Sends `cmd`; its answer (`Ok` after "ok ", `Err` after "err ").
    fn ask(&mut self, cmd: &str) -> Result<String, String> {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        let line = line.trim_end();
        match line.strip_prefix("ok") {
            Some(rest) => Ok(rest.trim_start().to_string()),
            None => Err(line.strip_prefix("err ").unwrap_or(line).to_string()),
        }
    }

    fn ok(&mut self, cmd: &str) -> String {
        self.ask(cmd).unwrap_or_else(|e| panic!("{cmd}: {e}"))
    }

    fn exit(mut self) {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A heap in `pool` whose root is an empty `Root`, and its shared form.
fn heap_with_root(pool: &dm_pool::Pool, len: u64) -> (Heap, dm_heap::HeapRef) {
    let heap = Heap::create(pool, len).unwrap();
    // (With room: an empty map points to its process's static, see
    // `HeapMap`.)
    let m: Root = HeapMap::with_capacity_and_hasher_in(4, Default::default(), heap.alloc());
    // (Leaked into the heap on purpose: the root lives as long as the heap.)
    let m = heap.put(m).unwrap();
    heap.set_root(m);
    let r = heap.share().unwrap();
    (heap, r)
}

/// The root of `heap`, to change (one process at a time, in the tests).
#[allow(clippy::mut_from_ref)]
fn root_mut<'h>(heap: &'h Heap) -> &'h mut Root<'h> {
    // SAFETY: the tests' root is a Root, changed by one process at a time.
    unsafe { &mut *heap.root_ptr::<Root>().unwrap().as_ptr() }
}

#[test]
fn a_map_built_in_one_process_is_read_and_grown_in_another() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let (heap, r) = heap_with_root(&pool, 4 << 20);
    let m = root_mut(&heap);
    for k in 0..100u64 {
        let mut v = HeapVec::new_in(heap.alloc());
        v.extend(0..k);
        m.insert(k, v);
    }
    let want: u64 = (0..100u64).map(|k| k * k.saturating_sub(1) / 2).sum();
    let mut a = Agent::spawn(&tp);
    a.ok(&format!("open {}", hex(&r.to_bytes())));
    assert_eq!(a.ok("sum"), format!("100 {want}"), "read in place");
    // The other process allocates in the heap: a new entry, and the map
    // grows its table from there.
    for k in 100..400u64 {
        a.ok(&format!("insert {k} 3"));
    }
    a.ok("remove 5");
    let m = root_mut(&heap);
    assert_eq!(m.len(), 399);
    assert_eq!(&m[&250][..], &[0, 1, 2]);
    assert!(!m.contains_key(&5));
    // And this one frees what the other made.
    m.retain(|k, _| *k < 100);
    assert_eq!(a.ok("sum"), format!("99 {}", want - 10));
    a.ok("close");
    a.ok("check");
    a.exit();
    pool.release_ref(r.pool_ref()).unwrap();
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

#[test]
fn several_processes_allocate_at_once_and_nothing_is_lost() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let (heap, r) = heap_with_root(&pool, 16 << 20);
    let before = heap.in_use();
    let mut agents: Vec<Agent> = (0..3).map(|_| Agent::spawn(&tp)).collect();
    for a in &mut agents {
        a.ok(&format!("open {}", hex(&r.to_bytes())));
    }
    // Each churns (allocating and freeing, checking its blocks) at once.
    let threads: Vec<_> = agents
        .into_iter()
        .enumerate()
        .map(|(i, mut a)| {
            std::thread::spawn(move || {
                a.ok(&format!("churn 20000 {i}"));
                a
            })
        })
        .collect();
    // (This process too.)
    let mut mine = Vec::new();
    for i in 0..20000u64 {
        let mut v = HeapVec::with_capacity_in((i % 200) as usize, heap.alloc());
        v.extend(0..i % 200);
        mine.push(v);
        if mine.len() > 40 {
            let v = mine.swap_remove((i % 40) as usize);
            assert!(v.iter().enumerate().all(|(j, &x)| x == j as u64));
        }
    }
    drop(mine);
    for t in threads {
        let mut a = t.join().unwrap();
        a.ok("close");
        a.exit();
    }
    assert_eq!(heap.in_use(), before, "every block given back");
    pool.release_ref(r.pool_ref()).unwrap();
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

#[test]
fn a_process_killed_holding_the_lock_does_not_keep_it_and_nothing_leaks() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let (heap, r) = heap_with_root(&pool, 4 << 20);
    let mut a = Agent::spawn(&tp);
    a.ok(&format!("open {}", hex(&r.to_bytes())));
    a.ok("insert 1 10");
    // It dies with the lock held (no answer comes).
    writeln!(a.stdin, "lock-and-die").unwrap();
    a.stdin.flush().unwrap();
    let st = a.child.wait().unwrap();
    assert!(!st.success());
    // This process takes the lock over once the pool finds it dead.
    let t = std::time::Instant::now();
    let m = root_mut(&heap);
    let mut v = HeapVec::new_in(heap.alloc());
    v.push(7);
    m.insert(2, v);
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(&m[&1][..], &(0..10).collect::<Vec<u64>>()[..]);
    assert_eq!(&m[&2][..], &[7]);
    // Its hold on the heap's pages went with it: when this process closes
    // the heap too, the pool has nothing left of it.
    pool.release_ref(r.pool_ref()).unwrap();
    drop(heap);
    pool.maintain().unwrap();
    assert!(pool.check().ok());
    drop(pool);
    tp.assert_clean();
}

#[test]
fn a_heap_whose_address_is_taken_in_a_process_is_refused_there() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let (heap, r) = heap_with_root(&pool, 1 << 20);
    let mut a = Agent::spawn(&tp);
    // Something else of that process sits in the heap's range.
    a.ok(&format!("reserve {} 4096", r.addr() + 8192));
    let e = a.ask(&format!("open {}", hex(&r.to_bytes()))).unwrap_err();
    assert!(e.contains("in use in this process"), "{e}");
    a.ok("check");
    a.exit();
    // In this process too: a second opening of one heap is refused.
    assert!(matches!(
        Heap::open(&pool, &r),
        Err(HeapError::Pool(dm_pool::Error::Sys(
            dm_sys::mem::SysError::AddressInUse { .. }
        )))
    ));
    pool.release_ref(r.pool_ref()).unwrap();
    drop(heap);
    drop(pool);
    tp.assert_clean();
}

#[test]
fn a_sealed_argument_cannot_be_changed_by_its_sender() {
    let tp = TempPool::new(64 << 20);
    let pool = tp.attach();
    let (heap, r) = heap_with_root(&pool, 4 << 20);
    let mut a = Agent::spawn(&tp);
    a.ok(&format!("open {}", hex(&r.to_bytes())));
    let got = a.ok("seal 1000");
    let w: Vec<u64> = got.split(' ').map(|x| x.parse().unwrap()).collect();
    let (id, addr, len) = (w[0], w[1], w[2]);
    // The receiver verifies the seal, then reads in place.
    heap.verify_sealed(id, addr as *const u8, len).unwrap();
    // SAFETY: 1000 u64 in the heap, sealed by their sender.
    let v = unsafe { std::slice::from_raw_parts(addr as *const u64, 1000) };
    assert_eq!(v[7], 7);
    // A wrong id, or bytes beyond the sealed scope, are not sealed.
    assert!(matches!(
        heap.verify_sealed(id ^ 1, addr as *const u8, len),
        Err(HeapError::NotSealed(_))
    ));
    assert!(heap.verify_sealed(id, addr as *const u8, 1 << 20).is_err());
    // The sender stores into it: the store faults, and kills it.
    writeln!(a.stdin, "write {}", addr + 7 * 8).unwrap();
    a.stdin.flush().unwrap();
    let st = a.child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGSEGV), "{st:?}");
    assert_eq!(v[7], 7, "the receiver's view is unchanged");
    // Its sealer gone, the seal proves nothing any more.
    pool.maintain().unwrap();
    assert!(matches!(
        heap.verify_sealed(id, addr as *const u8, len),
        Err(HeapError::NotSealed("its sealer is gone"))
    ));
    pool.release_ref(r.pool_ref()).unwrap();
    drop(heap);
    drop(pool);
    tp.assert_clean();
}
