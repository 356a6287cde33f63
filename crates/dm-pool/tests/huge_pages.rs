//! Pools on huge pages: on a hugetlbfs mount and on a tmpfs mounted with
//! `huge=always`, both made by the test. The DM conformance suite runs on
//! each; the kernel's counters show that huge pages back the pool. On
//! hugetlbfs, where only whole huge pages map and `pwrite` is refused,
//! mapped buffers and page-by-page fixed mappings of small pages are
//! refused with a typed error, and a pool of 2 MiB pages maps them.
//!
//! Needs root (to mount, and to ask the kernel for huge pages). A test
//! that cannot have them says why and passes: the suite runs elsewhere.
#![allow(clippy::unwrap_used)]

use dm_pool::testing::{meminfo, HugePages, Mount};
use dm_pool::{AttachOptions, Error, FixedMapping, MappedBuffer, Pool, PoolConfig};
use std::path::{Path, PathBuf};

fn quiet() -> AttachOptions {
    AttachOptions {
        heartbeat: false,
        ..Default::default()
    }
}

fn pool_at(dir: &Path, name: &str, cfg: PoolConfig) -> PathBuf {
    let p = dir.join(name);
    Pool::create(&p, &cfg).unwrap();
    p
}

/// The pools at `a` and `b`, attached, after the DM conformance suite
/// ran on them (`b` as the foreign pool).
fn conformance(a: &Path, b: &Path) -> (Pool, Pool) {
    let (pa, pb) = (
        Pool::open(a, quiet()).unwrap(),
        Pool::open(b, quiet()).unwrap(),
    );
    dm_pool::conformance::run_all(&|| pa.clone(), &|| pb.clone());
    (pa, pb)
}

fn clean(path: &Path) {
    let r = dm_pool::check_path(path, true).unwrap();
    assert!(r.ok(), "{:?}", r.problems);
    assert_eq!(r.pages_held + r.slots_live, 0, "{r:?}");
}

#[test]
fn pools_on_hugetlbfs() {
    // 2 MiB pages: two pools of 64 MiB and one of 32 MiB, and room.
    let _hp = match HugePages::more(96) {
        Ok(h) => h,
        Err(why) => return eprintln!("skipped: no huge pages to give here ({why})"),
    };
    let m = match Mount::new(
        "hugetlbfs",
        &["-t", "hugetlbfs", "-o", "pagesize=2M", "none"],
    ) {
        Ok(m) => m,
        Err(why) => return eprintln!("skipped: cannot mount hugetlbfs ({why})"),
    };
    let cfg = |size, page_size| PoolConfig {
        size,
        page_size,
        ..Default::default()
    };
    let a = pool_at(&m.0, "a.pool", cfg(64 << 20, 4096));
    let b = pool_at(&m.0, "b.pool", cfg(64 << 20, 4096));
    // A file there is a whole number of huge pages.
    assert_eq!(std::fs::metadata(&a).unwrap().len() % (2 << 20), 0);
    {
        let (pa, _pb) = conformance(&a, &b);
        let free = meminfo("HugePages_Free:");
        let mut buf = pa.alloc(16 << 20).unwrap();
        buf.write(0, &vec![5u8; 16 << 20]).unwrap();
        assert!(
            meminfo("HugePages_Free:") + 7 <= free,
            "16 MiB written took {} huge pages",
            free - meminfo("HugePages_Free:")
        );
        // Copy-on-write stays per 4 KiB page, in software.
        let r = pa.create_ref(&buf, 0, 16 << 20).unwrap();
        buf.write(4096, b"changed").unwrap();
        let m2 = pa.map_ref(&r).unwrap();
        let mut got = [0u8; 7];
        m2.read(4096, &mut got).unwrap();
        assert_eq!(got, [5u8; 7]);
        // Load/store mappings of 4 KiB pages: refused, saying why.
        match MappedBuffer::alloc(&pa, 8192) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("hugetlbfs"), "{why}"),
            r => panic!("{r:?}"),
        }
        let whole = pa.alloc(8192).unwrap();
        match FixedMapping::new(whole, 0x5a00_0000_0000) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("--page-size"), "{why}"),
            r => panic!("{:?}", r.map(|_| ())),
        }
        drop(m2);
        pa.release_ref(&r).unwrap();
    }
    clean(&a);
    clean(&b);
    // A pool of 2 MiB pages maps them one by one.
    let c = pool_at(&m.0, "c.pool", cfg(32 << 20, 2 << 20));
    {
        let pc = Pool::open(&c, quiet()).unwrap();
        let mut buf = pc.alloc(4 << 20).unwrap();
        // (A fixed mapping takes pages that are there: both written.)
        buf.write(0, b"first").unwrap();
        buf.write(3 << 20, b"huge").unwrap();
        let fm = FixedMapping::new(buf, 0x5b00_0000_0000).unwrap();
        // SAFETY: the mapping's 4 MiB are mapped read-write at its base
        // for as long as `fm` lives.
        let s = unsafe { std::slice::from_raw_parts_mut(fm.base(), fm.len()) };
        assert_eq!(&s[3 << 20..(3 << 20) + 4], b"huge");
        s[0] = 9;
        let mut got = [0u8; 1];
        fm.buffer().read(0, &mut got).unwrap();
        assert_eq!(got, [9]);
    }
    clean(&c);
    for p in [a, b, c] {
        Pool::destroy(&p).unwrap();
    }
}

#[test]
fn pools_on_a_huge_page_tmpfs() {
    let m = match Mount::new(
        "hugetmpfs",
        &["-t", "tmpfs", "-o", "huge=always,size=512M", "none"],
    ) {
        Ok(m) => m,
        Err(why) => return eprintln!("skipped: cannot mount a huge-page tmpfs ({why})"),
    };
    let cfg = PoolConfig {
        size: 128 << 20,
        ..Default::default()
    };
    let a = pool_at(&m.0, "a.pool", cfg.clone());
    let b = pool_at(&m.0, "b.pool", cfg);
    {
        let (pa, _pb) = conformance(&a, &b);
        let before = meminfo("ShmemHugePages:");
        let mut buf = pa.alloc(32 << 20).unwrap();
        buf.write(0, &vec![3u8; 32 << 20]).unwrap();
        let after = meminfo("ShmemHugePages:");
        if after <= before {
            eprintln!(
                "note: the kernel backed the tmpfs with small pages ({before} -> {after} kB)"
            );
        }
        // Everything works there, mapped buffers too.
        let mut mb = MappedBuffer::alloc(&pa, 3 << 20).unwrap();
        mb.as_mut_slice()[12345] = 7;
        let r = mb.share().unwrap();
        mb.as_mut_slice()[12345] = 8;
        let v = pa.map_ref(&r).unwrap();
        let mut got = [0u8; 1];
        v.read(12345, &mut got).unwrap();
        assert_eq!(got, [7]);
        drop((v, mb, buf));
        pa.release_ref(&r).unwrap();
    }
    clean(&a);
    clean(&b);
}
