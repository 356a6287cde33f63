//! A child forked after its parent attached a pool: every use of what it
//! inherited (the handle, a buffer, a Ref) fails with `Forked`, dropping
//! it touches nothing, and the parent's attachment stays whole. (One test
//! in its own binary: the child runs in a process with no other thread of
//! the test harness at work.)
#![allow(clippy::unwrap_used)]

use dm_pool::testing::TempPool;
use dm_pool::{AttachOptions, Buffer, Error, Pool, Ref};

/// What the child checks; its exit code says which check failed.
fn child(pool: Pool, mut b: Buffer, r: Ref) -> i32 {
    let forked = |e: Result<(), Error>| matches!(e, Err(Error::Forked));
    if !forked(pool.alloc(4096).map(drop)) {
        return 2;
    }
    if !forked(b.write(0, b"child")) {
        return 3;
    }
    if !forked(pool.map_ref(&r).map(drop)) {
        return 4;
    }
    if !forked(pool.release_ref(&r)) {
        return 5;
    }
    if !forked(pool.create_ref(&b, 0, 10).map(drop)) {
        return 6;
    }
    let msg = pool.alloc(1).unwrap_err().to_string();
    if !msg.contains("Pool::open") {
        return 7;
    }
    // Dropping what it inherited frees nothing of the parent's.
    drop((b, pool));
    0
}

/// The child's second act: it attaches anew and works, with random
/// numbers of its own (the next 64 bits it draws, through `out`).
fn child_anew(path: &std::path::Path, out: i32) -> i32 {
    let v = dm_sys::rand::random_u64().to_le_bytes();
    // SAFETY: `out` is the pipe's open write end; `v` is 8 valid bytes.
    if unsafe { libc::write(out, v.as_ptr().cast(), 8) } != 8 {
        return 10;
    }
    let Ok(pool) = Pool::open(path, AttachOptions::default()) else {
        return 11;
    };
    let Ok(mut b) = pool.alloc(100) else {
        return 12;
    };
    if b.write(0, b"own").is_err() {
        return 13;
    }
    let Ok(r) = b.share() else { return 14 };
    if pool.release_ref(&r).is_err() {
        return 15;
    }
    drop((b, pool));
    0
}

#[test]
fn a_child_forked_after_attaching_cannot_use_or_free_the_parents_attachment() {
    let tp = TempPool::new(16 << 20);
    let pool = tp.attach_with(AttachOptions {
        heartbeat: false,
        ..Default::default()
    });
    let mut b = pool.alloc(8192).unwrap();
    b.write(0, b"parent").unwrap();
    let r = b.share().unwrap();
    // The parent's batch of random numbers is drawn before the fork.
    let _ = dm_sys::rand::random_u64();
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is a valid out-array of two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child runs `child` alone (no other thread of this
    // process does anything at the fork) and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let mut code = child(pool, b, r);
        if code == 0 {
            code = child_anew(&tp.path, fds[1]);
        }
        // SAFETY: ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(code) };
    }
    let mut theirs = [0u8; 8];
    // SAFETY: the pipe's read end; `theirs` has room for 8 bytes.
    let n = unsafe { libc::read(fds[0], theirs.as_mut_ptr().cast(), 8) };
    assert_eq!(n, 8, "the child wrote no random number");
    let ours = dm_sys::rand::random_u64();
    assert_ne!(
        u64::from_le_bytes(theirs),
        ours,
        "the child drew the parent's random number"
    );
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out-pointer.
    let got = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(got, pid);
    assert!(libc::WIFEXITED(status), "the child did not exit: {status}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "the child's failed check");
    // The parent's attachment is whole: its buffer, its Ref, its slot.
    assert_eq!(&b.to_vec().unwrap()[..6], b"parent");
    b.write(6, b"!").unwrap();
    let m = pool.map_ref(&r).unwrap();
    assert_eq!(&m.to_vec().unwrap()[..7], b"parent\0");
    pool.release_ref(&r).unwrap();
    assert!(pool.check().ok(), "{:?}", pool.check().problems);
    drop((m, b, pool));
    tp.assert_clean();
}
