//! Namespaces of one device (DirectCXL) on a file: create, attach, use,
//! remove; a namespace in use is not removed; a process killed in the
//! middle of creating or removing one leaves the table consistent. (No
//! DAX device exists on the machines that run this: the device is a file,
//! and a DAX device runs the same code.)
#![allow(clippy::unwrap_used)]

mod common;

use common::Agent;
use dm_pool::namespace::{self, State};
use dm_pool::{AttachOptions, Error, Pool, PoolConfig};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A device file under /dev/shm, formatted, removed on drop.
struct Device(PathBuf);

impl Device {
    fn new(tag: &str, len: u64) -> Device {
        let p = PathBuf::from(format!(
            "/dev/shm/dmrpc-test-{}-{tag}.dev",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        namespace::format(&p, len, false).unwrap();
        Device(p)
    }

    fn ns(&self, name: &str) -> PathBuf {
        namespace::path(&self.0, name)
    }

    fn names(&self) -> Vec<(String, State)> {
        namespace::list(&self.0)
            .unwrap()
            .into_iter()
            .map(|n| (n.name, n.state))
            .collect()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn cfg(size: u64) -> PoolConfig {
    PoolConfig {
        size,
        ..Default::default()
    }
}

fn quiet() -> AttachOptions {
    AttachOptions {
        heartbeat: false,
        ..Default::default()
    }
}

fn read(b: &dm_pool::Buffer, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    b.read(off, &mut v).unwrap();
    v
}

/// Reclaims what killed processes held, then checks the pool.
fn assert_clean(path: &Path) {
    dm_pool::gc_path(path).unwrap();
    let r = dm_pool::check_path(path, true).unwrap();
    assert!(r.ok(), "{}: {:?}", path.display(), r.problems);
    assert_eq!(r.pages_held + r.slots_live, 0, "{r:?}");
}

#[test]
fn namespaces_hold_separate_pools_and_go_away_when_unused() {
    let dev = Device::new("basic", 256 << 20);
    let a = namespace::create(&dev.0, "a", &cfg(16 << 20)).unwrap();
    Pool::create(&dev.ns("b"), &cfg(40 << 20)).unwrap();
    assert!(matches!(
        namespace::create(&dev.0, "a", &cfg(1 << 20)),
        Err(Error::AlreadyExists(_))
    ));
    let list = namespace::list(&dev.0).unwrap();
    assert_eq!(list.len(), 2);
    let b = &list[1];
    assert_eq!((a.offset, b.name.as_str()), (namespace::TABLE_LEN, "b"));
    assert!(a.offset + a.size <= b.offset, "{a:?} {b:?}");
    assert_eq!(b.size % namespace::ALIGN, 0);

    // Each pool is its own: data, Refs and checks.
    let pa = Pool::open(&dev.ns("a"), quiet()).unwrap();
    let pb = Pool::open_namespace(&dev.0, "b", quiet()).unwrap();
    assert_eq!(pa.path(), dev.ns("a"));
    assert_ne!(pa.id(), pb.id());
    let mut buf = pa.alloc(3 << 20).unwrap();
    buf.write(12345, b"in namespace a").unwrap();
    let r = pa.create_ref(&buf, 0, 3 << 20).unwrap();
    assert!(matches!(pb.map_ref(&r), Err(Error::ForeignPool { .. })));
    let m = pa.map_ref(&r).unwrap();
    assert_eq!(read(&m, 12345, 14), b"in namespace a");
    // A mapped buffer's pages sit at the region's offset in the file.
    let mut mb = dm_pool::MappedBuffer::map_ref(&pa, &r).unwrap();
    assert_eq!(&mb.as_slice()[12345..12359], b"in namespace a");
    mb.as_mut_slice()[12345] = b'I';
    assert_eq!(read(&m, 12345, 1), b"i", "the Ref's snapshot is kept");
    drop(mb);
    let big = pb.alloc(30 << 20).unwrap();
    assert!(read(&big, 0, 1 << 20).iter().all(|&x| x == 0));

    assert_eq!(namespace::info(&dev.0, "a").unwrap().refs, 1);
    match Pool::destroy(&dev.ns("a")) {
        Err(Error::InUse(m)) => assert!(m.contains("1 process"), "{m}"),
        r => panic!("removed while attached: {r:?}"),
    }
    drop((m, buf, big));
    pa.release_ref(&r).unwrap();
    drop((pa, pb));
    assert_clean(&dev.ns("a"));
    assert_clean(&dev.ns("b"));
    assert_eq!(namespace::info(&dev.0, "a").unwrap().refs, 0);

    namespace::remove(&dev.0, "a").unwrap();
    assert_eq!(dev.names(), vec![("b".to_string(), State::Ready)]);
    assert!(matches!(
        Pool::open(&dev.ns("a"), quiet()),
        Err(Error::NoNamespace { .. })
    ));
    // A new namespace in a's place reads zeros where a had data.
    let c = namespace::create(&dev.0, "c", &cfg(16 << 20)).unwrap();
    assert_eq!(c.offset, a.offset);
    let pc = Pool::open(&dev.ns("c"), quiet()).unwrap();
    let z = pc.alloc(3 << 20).unwrap();
    assert!(read(&z, 0, 3 << 20).iter().all(|&x| x == 0));
    drop((z, pc));

    // No room, bad names, no such namespace, no table: typed errors.
    assert!(matches!(
        namespace::create(&dev.0, "huge", &cfg(1 << 30)),
        Err(Error::ResourceExhausted {
            what: "device space"
        })
    ));
    assert!(matches!(
        namespace::create(&dev.0, "a b", &cfg(1 << 20)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        namespace::remove(&dev.0, "nope"),
        Err(Error::NoNamespace { .. })
    ));
    assert!(matches!(
        Pool::open_namespace(Path::new("/dev/shm"), "a", quiet()),
        Err(Error::NoNamespace { .. })
    ));
    let plain = Device::new("plain-file", 8 << 20);
    std::fs::write(&plain.0, vec![0u8; 8 << 20]).unwrap();
    assert!(matches!(
        namespace::list(&plain.0),
        Err(Error::NoNamespace { .. })
    ));
}

#[test]
fn a_table_fills_up_and_frees() {
    let dev = Device::new("full", 4 << 30);
    for i in 0..namespace::MAX_ENTRIES {
        namespace::create(&dev.0, &format!("n{i}"), &cfg(1 << 20)).unwrap();
    }
    assert!(matches!(
        namespace::create(&dev.0, "one-more", &cfg(1 << 20)),
        Err(Error::ResourceExhausted {
            what: "namespace entries"
        })
    ));
    namespace::remove(&dev.0, "n7").unwrap();
    namespace::create(&dev.0, "one-more", &cfg(1 << 20)).unwrap();
    assert_eq!(
        namespace::list(&dev.0).unwrap().len(),
        namespace::MAX_ENTRIES as usize
    );
}

#[test]
fn a_namespace_in_use_by_another_process_is_kept_until_it_dies() {
    let dev = Device::new("in-use", 64 << 20);
    namespace::create(&dev.0, "svc", &cfg(8 << 20)).unwrap();
    let mut agent = Agent::spawn(&dev.ns("svc"), None);
    let b = agent.ok("alloc 100000");
    agent.ok(&format!("fill {b} 0 100000 7"));
    let info = namespace::info(&dev.0, "svc").unwrap();
    assert_eq!((info.refs, info.state), (1, State::Ready));
    assert!(matches!(
        namespace::remove(&dev.0, "svc"),
        Err(Error::InUse(_))
    ));
    agent.kill9();
    // The dead process's slot no longer counts: the namespace goes.
    namespace::remove(&dev.0, "svc").unwrap();
    assert!(dev.names().is_empty());
}

/// The state word of every used entry, read from the file itself (the
/// table's lock is held by the process being killed, so `list` waits).
fn raw_states(dev: &Path) -> Vec<u32> {
    let b = std::fs::read(dev).unwrap();
    (0..namespace::MAX_ENTRIES as usize)
        .map(|i| u32::from_le_bytes(b[4096 + i * 128..][..4].try_into().unwrap()))
        .filter(|&w| w != 0)
        .collect()
}

fn wait_for_state(dev: &Path, word: u32) {
    let until = Instant::now() + Duration::from_secs(20);
    while !raw_states(dev).contains(&word) {
        assert!(Instant::now() < until, "no entry reached state {word}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_creator_killed_halfway_leaves_no_namespace() {
    let dev = Device::new("crash-create", 64 << 20);
    namespace::create(&dev.0, "keep", &cfg(4 << 20)).unwrap();
    let mut agent = Agent::spawn(&dev.ns("keep"), None);
    assert_eq!(
        agent.ok(&format!(
            "nscreate {} half {} stop",
            dev.0.display(),
            8 << 20
        )),
        "stopping"
    );
    wait_for_state(&dev.0, State::Creating as u32);
    agent.kill9();
    // Seen, not opened; the next change frees it and the name is free.
    assert!(dev.names().contains(&("half".to_string(), State::Creating)));
    match Pool::open(&dev.ns("half"), quiet()) {
        Err(Error::NoNamespace { why, .. }) => assert!(why.contains("creating"), "{why}"),
        r => panic!("{r:?}"),
    }
    namespace::create(&dev.0, "half", &cfg(8 << 20)).unwrap();
    assert_eq!(
        dev.names(),
        vec![
            ("keep".to_string(), State::Ready),
            ("half".to_string(), State::Ready)
        ]
    );
    assert_clean(&dev.ns("half"));
    assert_clean(&dev.ns("keep"));
}

#[test]
fn a_remover_killed_halfway_leaves_the_namespace_removed() {
    let dev = Device::new("crash-remove", 64 << 20);
    namespace::create(&dev.0, "keep", &cfg(4 << 20)).unwrap();
    namespace::create(&dev.0, "gone", &cfg(4 << 20)).unwrap();
    {
        let p = Pool::open(&dev.ns("gone"), quiet()).unwrap();
        let mut b = p.alloc(1 << 20).unwrap();
        b.write(0, &[9; 4096]).unwrap();
        // A Ref left live: the removal takes it with the pool.
        p.create_ref(&b, 0, 4096).unwrap();
    }
    let mut agent = Agent::spawn(&dev.ns("keep"), None);
    assert_eq!(
        agent.ok(&format!("nsrm {} gone stop", dev.0.display())),
        "stopping"
    );
    wait_for_state(&dev.0, State::Removing as u32);
    agent.kill9();
    assert!(matches!(
        Pool::open(&dev.ns("gone"), quiet()),
        Err(Error::NoNamespace { .. })
    ));
    // The next change finishes the removal.
    namespace::create(&dev.0, "new", &cfg(4 << 20)).unwrap();
    let names: Vec<String> = dev.names().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["keep", "new"]);
    let p = Pool::open(&dev.ns("new"), quiet()).unwrap();
    assert!(read(&p.alloc(1 << 20).unwrap(), 0, 4096)
        .iter()
        .all(|&x| x == 0));
}

#[test]
fn processes_killed_at_random_while_changing_the_table_leave_it_consistent() {
    let dev = Device::new("churn", 64 << 20);
    namespace::create(&dev.0, "home", &cfg(2 << 20)).unwrap();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut interrupted = 0;
    for round in 0..12 {
        let mut agent = Agent::spawn(&dev.ns("home"), None);
        assert_eq!(
            agent.ok(&format!("nschurn {} {round}", dev.0.display())),
            "churning"
        );
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_micros(2000 + rng % 30000));
        agent.kill9();
        interrupted += raw_states(&dev.0)
            .iter()
            .filter(|&&w| w == State::Creating as u32 || w == State::Removing as u32)
            .count();
        // A change recovers; then every namespace is a sound pool.
        namespace::create(&dev.0, "probe", &cfg(1 << 20)).unwrap();
        namespace::remove(&dev.0, "probe").unwrap();
        for ns in namespace::list(&dev.0).unwrap() {
            assert_eq!(ns.state, State::Ready, "{ns:?}");
            assert_clean(&ns.path());
        }
    }
    eprintln!("{interrupted} changes were interrupted and recovered");
}
