//! The write-fault hook and faults that are not its own: a process that
//! ignores SIGSEGV and then writes where nothing is mapped dies of the
//! signal, as it would without the hook, instead of faulting forever.
#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_pool::MappedBuffer;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

const CHILD: &str = "DMRPC_FAULT_TEST_CHILD";

/// The child: SIGSEGV ignored, the hook installed (by a mapped buffer), a
/// copy-on-write fault resolved, then a store to an address nothing maps.
fn child(path: &str) {
    // SAFETY: setting SIGSEGV to SIG_IGN; no handler code runs.
    unsafe { libc::signal(libc::SIGSEGV, libc::SIG_IGN) };
    let pool = dm_pool::Pool::open(path.as_ref(), Default::default()).unwrap();
    let mut b = pool.alloc(8192).unwrap();
    b.write(0, b"x").unwrap();
    let r = b.share().unwrap();
    let mut m = MappedBuffer::map_ref(&pool, &r).unwrap();
    m.as_mut_slice()[0] = b'y'; // a fault the hook resolves
    assert_eq!(b.to_vec().unwrap()[0], b'x');
    pool.release_ref(&r).unwrap();
    println!("resolved");
    let bad = 16usize as *mut u8;
    // SAFETY: not safe at all, on purpose: the store must kill the process.
    unsafe { std::ptr::write_volatile(bad, 1) };
    println!("survived");
}

#[test]
fn a_fault_that_is_not_the_hooks_kills_even_when_sigsegv_is_ignored() {
    if let Ok(path) = std::env::var(CHILD) {
        child(&path);
        return;
    }
    let tp = TempPool::new(16 << 20);
    let (st, out, _) = run_child(
        "a_fault_that_is_not_the_hooks_kills_even_when_sigsegv_is_ignored",
        CHILD,
        &tp.path,
    );
    assert!(out.contains("resolved"), "{out}");
    assert!(!out.contains("survived"), "{out}");
    assert_eq!(st.signal(), Some(libc::SIGSEGV), "{st:?}");
    // The dead child's holdings are reclaimed.
    dm_pool::gc_path(&tp.path).unwrap();
    tp.assert_clean();
}

/// Runs this test binary's test `name` as a child with `env` set to
/// `path`, killed if it runs past 20 s: its status, stdout and stderr.
fn run_child(
    name: &str,
    env: &str,
    path: &std::path::Path,
) -> (std::process::ExitStatus, String, String) {
    use std::io::Read;
    let mut c = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture"])
        .env(env, path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    let st = loop {
        if let Some(st) = c.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > until {
            let _ = c.kill();
            panic!("the child {name} runs forever");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (mut out, mut err) = (String::new(), String::new());
    c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (st, out, err)
}

const MAPS_CHILD: &str = "DMRPC_FAULT_TEST_MAPS_CHILD";

/// The child: a mapped buffer, then every memory mapping the kernel gives
/// taken (alternating protections, so none merge), then a store that needs
/// one more for its copy-on-write.
fn maps_child(path: &str) {
    let pool = dm_pool::Pool::open(path.as_ref(), Default::default()).unwrap();
    let mut b = pool.alloc(65536).unwrap();
    b.write(0, &[1u8; 65536]).unwrap();
    let r = b.share().unwrap();
    let mut m = MappedBuffer::map_ref(&pool, &r).unwrap();
    let mut n = 0u64;
    loop {
        let prot = if n.is_multiple_of(2) {
            libc::PROT_READ
        } else {
            libc::PROT_NONE
        };
        // SAFETY: a fresh private anonymous mapping, kept until the end.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            break;
        }
        n += 1;
    }
    println!("took {n} mappings");
    m.as_mut_slice()[8192] = 9; // needs a mapping of the copy
    println!("survived");
}

/// A copy-on-write store that the kernel's mapping limit
/// (`vm.max_map_count`) refuses ends the process with a message that says
/// so, not silently; the pool stays consistent.
#[test]
fn a_store_beyond_the_mapping_limit_ends_with_a_message() {
    if let Ok(path) = std::env::var(MAPS_CHILD) {
        maps_child(&path);
        return;
    }
    let tp = TempPool::new(16 << 20);
    let (status, stdout, stderr) = run_child(
        "a_store_beyond_the_mapping_limit_ends_with_a_message",
        MAPS_CHILD,
        &tp.path,
    );
    assert!(stdout.contains("took"), "{stdout} {stderr}");
    assert!(!stdout.contains("survived"), "{stdout}");
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
    assert!(stderr.contains("vm.max_map_count"), "{stderr}");
    // What remains is the Ref it made (in flight until its TTL): its 16
    // pages, and nothing of the buffers or the refused copy.
    dm_pool::gc_path(&tp.path).unwrap();
    let report = dm_pool::check_path(&tp.path, false).unwrap();
    assert!(report.ok(), "{report:?}");
    assert_eq!((report.refs_live, report.pages_held), (1, 16), "{report:?}");
}

const LOCK_CHILD: &str = "DMRPC_FAULT_TEST_LOCK_CHILD";

/// A mapped buffer whose lock word in the pool was scribbled on (held by
/// no thread): a store waits a bounded time, then the process ends with a
/// message, instead of spinning in the fault handler forever.
#[test]
fn a_store_never_waits_forever_for_a_scribbled_lock() {
    if let Ok(path) = std::env::var(LOCK_CHILD) {
        let pool = dm_pool::Pool::open(path.as_ref(), Default::default()).unwrap();
        let mut b = pool.alloc(8192).unwrap();
        b.write(0, b"x").unwrap();
        let r = b.share().unwrap();
        let mut m = MappedBuffer::map_ref(&pool, &r).unwrap();
        dm_pool::testing::scribble_desc_lock(&pool, m.buffer(), 1).unwrap();
        println!("scribbled");
        m.as_mut_slice()[0] = b'y';
        println!("survived");
        return;
    }
    let tp = TempPool::new(16 << 20);
    let (status, stdout, stderr) = run_child(
        "a_store_never_waits_forever_for_a_scribbled_lock",
        LOCK_CHILD,
        &tp.path,
    );
    assert!(
        stdout.contains("scribbled") && !stdout.contains("survived"),
        "{stdout}"
    );
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
    assert!(stderr.contains("lock"), "{stderr}");
    dm_pool::gc_path(&tp.path).unwrap();
    assert!(dm_pool::check_path(&tp.path, false).unwrap().ok());
}
