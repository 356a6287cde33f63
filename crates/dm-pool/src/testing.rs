//! Test support shared by the crates' test suites (not part of the API).

use crate::{AttachOptions, Pool, PoolConfig};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static N: AtomicU32 = AtomicU32::new(0);

/// A pool file under /dev/shm, removed on drop. With
/// [`NAMESPACES_ENV`] set, a namespace of a device file of this process
/// instead (the device goes when its last namespace does), so that a test
/// suite runs inside namespaces unchanged.
#[derive(Debug)]
pub struct TempPool {
    /// Its path.
    pub path: PathBuf,
}

/// Set (to anything but `0`), [`TempPool`]s are namespaces of one device.
pub const NAMESPACES_ENV: &str = "DMRPC_TEST_NAMESPACES";

/// The length of the device file namespaced test pools share (sparse).
const TEST_DEVICE_LEN: u64 = 16 << 30;

/// Namespaced test pools alive, and the device they live on.
static NS_DEVICE: std::sync::Mutex<(usize, Option<PathBuf>)> = std::sync::Mutex::new((0, None));

/// Whether test pools are namespaces ([`NAMESPACES_ENV`]).
pub fn in_namespaces() -> bool {
    std::env::var(NAMESPACES_ENV).is_ok_and(|v| v != "0" && !v.is_empty())
}

impl TempPool {
    /// A pool of `size` bytes with the default configuration.
    pub fn new(size: u64) -> TempPool {
        Self::with(PoolConfig {
            size,
            ..Default::default()
        })
    }

    /// A pool with `cfg`. Panics if it cannot be created.
    pub fn with(cfg: PoolConfig) -> TempPool {
        if in_namespaces() {
            return Self::namespaced(cfg);
        }
        let path = PathBuf::from(format!(
            "/dev/shm/dmrpc-test-{}-{}.pool",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&path);
        if let Err(e) = Pool::create(&path, &cfg) {
            panic!("cannot create test pool {}: {e}", path.display());
        }
        TempPool { path }
    }

    fn namespaced(cfg: PoolConfig) -> TempPool {
        let mut dev = NS_DEVICE.lock().unwrap_or_else(|e| e.into_inner());
        let device = dev
            .1
            .get_or_insert_with(|| {
                let d = PathBuf::from(format!(
                    "/dev/shm/dmrpc-test-{}-namespaces.dev",
                    std::process::id()
                ));
                let _ = std::fs::remove_file(&d);
                if let Err(e) = crate::namespace::format(&d, TEST_DEVICE_LEN, cfg.group) {
                    panic!("cannot make test device {}: {e}", d.display());
                }
                d
            })
            .clone();
        let name = format!("t{}", N.fetch_add(1, Ordering::Relaxed));
        if let Err(e) = crate::namespace::create(&device, &name, &cfg) {
            panic!(
                "cannot create test namespace {name} on {}: {e}",
                device.display()
            );
        }
        dev.0 += 1;
        TempPool {
            path: crate::namespace::path(&device, &name),
        }
    }

    /// The file that holds the pool, and where the pool starts in it (a
    /// namespace's region offset; 0 for a pool file).
    pub fn backing(&self) -> (PathBuf, u64) {
        match crate::namespace::split(&self.path) {
            Some((device, name)) => {
                let ns = crate::namespace::info(&device, &name)
                    .unwrap_or_else(|e| panic!("{}: {e}", self.path.display()));
                (device, ns.offset)
            }
            None => (self.path.clone(), 0),
        }
    }

    /// The pool's bytes, as they are in its backing now.
    pub fn bytes(&self) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let (file, off) = self.backing();
        let len = crate::layout_of(&self.path)
            .unwrap_or_else(|e| panic!("{}: {e}", self.path.display()))
            .total_len;
        let mut v = vec![0u8; len as usize];
        std::fs::File::open(&file)
            .and_then(|f| f.read_exact_at(&mut v, off))
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        v
    }

    /// Attaches with default options. Panics on failure.
    pub fn attach(&self) -> Pool {
        self.attach_with(AttachOptions::default())
    }

    /// Attaches with `o`. Panics on failure.
    pub fn attach_with(&self, o: AttachOptions) -> Pool {
        Pool::open(&self.path, o).unwrap_or_else(|e| panic!("attach failed: {e}"))
    }

    /// [`assert_clean`](Self::assert_clean), once the pool is clean or
    /// `within` has passed (a thread that outlives what it served by a
    /// moment, such as an async client's answer pump, lets go then).
    pub fn assert_clean_within(&self, within: std::time::Duration) {
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            match crate::check_path(&self.path, true) {
                Ok(r)
                    if r.ok()
                        && r.pages_held + r.pages_cached + r.slots_live == 0
                        && r.services + r.channels == 0 =>
                {
                    return
                }
                _ => std::thread::sleep(std::time::Duration::from_millis(5)),
            }
        }
        self.assert_clean();
    }

    /// Asserts the pool invariant (deep: list pages too) and that nothing
    /// is left: no page held or cached, no slot, service or channel.
    pub fn assert_clean(&self) {
        let r = crate::check_path(&self.path, true).unwrap_or_else(|e| panic!("check: {e}"));
        assert!(r.ok(), "pool check failed: {:#?}", r.problems);
        assert_eq!(r.pages_held, 0, "pages still held: {r:?}");
        assert_eq!(r.pages_cached, 0, "pages still cached: {r:?}");
        assert_eq!(r.slots_live, 0, "slots still live: {r:?}");
        assert_eq!(r.services, 0, "services still registered: {r:?}");
        assert_eq!(r.channels, 0, "channels still open: {r:?}");
    }
}

impl Drop for TempPool {
    fn drop(&mut self) {
        let Some((device, _)) = crate::namespace::split(&self.path) else {
            let _ = std::fs::remove_file(&self.path);
            return;
        };
        let _ = Pool::destroy(&self.path);
        let mut dev = NS_DEVICE.lock().unwrap_or_else(|e| e.into_inner());
        dev.0 = dev.0.saturating_sub(1);
        if dev.0 == 0 {
            let _ = std::fs::remove_file(&device);
            dev.1 = None;
        }
    }
}

/// Makes this process stop for good halfway through its next namespace
/// creation (the entry written, the pool not) or, with `removing`,
/// removal (the entry marked, the region not yet wiped), as a crash there
/// would leave it; for tests of recovery, whose caller is killed next.
pub fn stop_namespace_change(removing: bool) {
    crate::namespace::stop_at(if removing {
        crate::namespace::Step::Remove
    } else {
        crate::namespace::Step::Create
    });
}

/// Runs `run` on every input of the saved fuzz corpus of `target`
/// (`fuzz/corpus/TARGET` from the workspace root), so every test run
/// covers what fuzzing found without nightly or cargo-fuzz. Panics if the
/// corpus is missing or empty.
pub fn replay_corpus(target: &str, run: impl Fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .path();
        run(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())));
        n += 1;
    }
    assert!(n > 0, "empty corpus in {}", dir.display());
}

/// Leaves Ref `r`'s mapper word locked by a new mapping of this process,
/// as a process killed in the middle of `map_ref` leaves it; for tests of
/// crash recovery, whose caller is killed next (nothing else in the pool
/// may use `r` until this process is reclaimed).
pub fn hold_ref_lock(pool: &Pool, r: &crate::Ref) -> crate::Result<()> {
    pool.map_ref_stop_in_lock(r)
}

/// Leaves a Ref to the whole of `buf` half built, its list pages attached
/// but its entries not yet copied (they hold the pages' old bytes), as a
/// process killed in the middle of `create_ref` leaves it; for tests of
/// crash recovery, whose caller is killed next.
pub fn stop_creating_ref(pool: &Pool, buf: &crate::Buffer) -> crate::Result<()> {
    pool.create_ref_stop_before_copy(buf)
}

/// Makes this process stop for good after committing its next Ref and
/// before noting its expiry in the pool's summary, as a process killed
/// there leaves it; for tests of crash recovery, whose caller is killed
/// next.
pub fn stop_before_noting() {
    crate::pool::stop_before_noting()
}

/// Where a crash-recovery test can make this process stop for good
/// ([`stop_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StopPoint {
    /// A buffer giving itself a copy of a list a Ref shares: the old
    /// list's count dropped, the copy's pages counted, the copy not yet
    /// held.
    ListCopied = 1,
    /// A Ref sharing its buffer's lists: every list counted, the build
    /// not finished.
    ListsShared = 2,
    /// A drop: the first list others hold too has lost its count.
    SharedListLeft = 3,
}

static STOP_AT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Makes this process stop for good when it next reaches `p`: it says
/// `ok stopped` on its standard output and sleeps (the test kills it).
pub fn stop_at(p: StopPoint) {
    STOP_AT.store(p as u8, std::sync::atomic::Ordering::Relaxed);
}

/// Stops here for good if a test asked for `p` ([`stop_at`]).
pub(crate) fn reached(p: StopPoint) {
    if STOP_AT.load(std::sync::atomic::Ordering::Relaxed) == p as u8 {
        use std::io::Write;
        println!("ok stopped");
        let _ = std::io::stdout().flush();
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

/// Leaves `buf` half turned into a Ref ([`Pool::into_ref`]): the Ref's
/// fields written, the descriptor still a buffer, as a process killed
/// just before the commit leaves it; for tests of crash recovery, whose
/// caller is killed next.
pub fn stop_sealing(pool: &Pool, buf: crate::Buffer) -> crate::Result<()> {
    pool.seal_stop_before_commit(buf)
}

/// Sets the lock word of `buf`'s descriptor, as a process with write
/// access to the pool file could; for tests of what a fault does then.
pub fn scribble_desc_lock(pool: &Pool, buf: &crate::Buffer, v: u32) -> crate::Result<()> {
    let d = pool.inner.desc(buf.desc_index())?;
    d.lock.store(v, std::sync::atomic::Ordering::Release);
    Ok(())
}

/// A file system mounted for a test or a benchmark, unmounted (and its
/// directory removed) on drop. Needs root.
#[derive(Debug)]
pub struct Mount(pub PathBuf);

impl Mount {
    /// Mounts with `mount ARGS DIR` on a new directory named by `tag`.
    pub fn new(tag: &str, args: &[&str]) -> Result<Mount, String> {
        let dir = std::env::temp_dir().join(format!("dmrpc-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(args)
            .arg(&dir)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            let _ = std::fs::remove_dir(&dir);
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        Ok(Mount(dir))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A `/proc/meminfo` figure (0 when missing).
pub fn meminfo(key: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// The kernel's pool of 2 MiB pages raised by `n` for a test or a
/// benchmark, put back on drop. Needs root.
#[derive(Debug)]
pub struct HugePages {
    before: u64,
}

const NR: &str = "/proc/sys/vm/nr_hugepages";

impl HugePages {
    /// Asks the kernel for `n` more huge pages; an error says why not.
    pub fn more(n: u64) -> Result<HugePages, String> {
        let before: u64 = std::fs::read_to_string(NR)
            .map_err(|e| e.to_string())?
            .trim()
            .parse()
            .map_err(|_| "unreadable nr_hugepages".to_string())?;
        std::fs::write(NR, (before + n).to_string()).map_err(|e| e.to_string())?;
        let hp = HugePages { before };
        if meminfo("HugePages_Free:") < n {
            return Err(format!(
                "the kernel gave {} of the {n} huge pages asked for",
                meminfo("HugePages_Free:")
            ));
        }
        Ok(hp)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR, self.before.to_string());
    }
}
