//! The OS edge of dmrpc.
//!
//! Everything that talks to the kernel lives here, behind small, documented
//! primitives, so that the crates above (the pool format, the RPC layer) are
//! safe Rust over offsets and atomics:
//!
//! * [`mem::SharedFile`] — create/open a pool backing file (tmpfs, any regular
//!   file, or a DAX character device) and map all of it `MAP_SHARED` once.
//! * [`mem::Reservation`] — a reserved range of virtual addresses into which
//!   single file pages are mapped at fixed addresses (the transparent
//!   load/store path of mapped buffers).
//! * [`fault`] — a process-wide `SIGSEGV` hook that resolves write faults in
//!   registered windows and chains to the previous handler for everything else.
//! * [`futex`] — cross-process wait and wake on a word in shared memory.
//! * [`time`], [`rand`], [`proc`] — clocks for leases, random tags, liveness.
//! * [`io`] — writing several buffers to a stream with no copy into one.
//! * [`poll`] — busy-polling sockets before blocking, with an adaptive budget.
//! * [`malloc`] — keeping large transient buffers' memory mapped.
//! * [`netns`] — moving a thread or a child process into a network
//!   namespace.

pub mod bus;
pub mod fault;
pub mod futex;
pub mod mem;
pub mod poll;

/// Network namespaces: the "hosts" of a cluster on one machine.
pub mod netns {
    use std::fs::File;
    use std::io::Result;
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    /// Moves the calling thread into the network namespace `ns` refers to
    /// (an open `/run/netns/NAME`). Sockets it makes from then on are
    /// that namespace's; threads it starts from then on are in it too.
    pub fn enter(ns: &File) -> Result<()> {
        // SAFETY: setns on a valid descriptor; it changes only this thread.
        let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Makes `cmd`'s process start in the network namespace `ns` (an
    /// open `/run/netns/NAME`; `cmd` keeps it open until it spawns).
    pub fn command_in(cmd: &mut Command, ns: File) -> &mut Command {
        // SAFETY: the hook runs in the child between fork and exec and
        // makes one system call, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
        }
    }
}

/// The C allocator's treatment of large buffers.
pub mod malloc {
    /// Keeps freed memory of large allocations in the process instead of
    /// giving it back to the kernel at once: glibc serves allocations from
    /// 128 KiB up (its default, raised dynamically) with `mmap` and trims
    /// free heap memory past a threshold, and a thread's arena shrinks its
    /// heap on `free`. A large inline payload (a frame received, its copy
    /// for forwarding) is allocated and freed per call, so every call paid
    /// page faults and the kernel clearing each page again: 1 MiB requests
    /// by value through `bench image`'s tiers ran at 300 requests/s, 700
    /// with this. Sets `M_MMAP_THRESHOLD` to 64 MiB and `M_TRIM_THRESHOLD`
    /// to 256 MiB (a process keeps up to that much freed memory). Call it
    /// first in `main`, before other threads start; returns whether glibc
    /// took both settings (other C libraries: false, nothing changed).
    pub fn keep_large_buffers() -> bool {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: mallopt only changes allocator parameters.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20) == 1
                    && libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20) == 1
            }
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        {
            false
        }
    }
}

/// Clocks: the wall clock (Ref TTLs, leases across hosts) and the host's
/// monotonic clock (leases on one host, intervals).
pub mod time {
    /// Milliseconds since the Unix epoch (`CLOCK_REALTIME`).
    ///
    /// The one clock processes on different hosts agree on (assumed
    /// NTP-synchronised to well under a lease): a pool on a CXL device
    /// shared by several hosts judges another host's leases by it. It can
    /// step (an NTP step, a manual change), so a lease renewed on this
    /// host is judged by [`monotonic_ms`] instead.
    pub fn now_ms() -> u64 {
        clock_ms(libc::CLOCK_REALTIME)
    }

    /// [`now_ms`] as of the last clock tick (`CLOCK_REALTIME_COARSE`: up
    /// to one tick behind, 4 ms at HZ=250, and about 5x cheaper: 8 ns
    /// against 43 ns on the test VM). For the per-call path (a Ref's
    /// expiry, set and checked on every call), where a TTL a tick longer
    /// or shorter does not matter; leases keep the precise clock.
    pub fn now_ms_coarse() -> u64 {
        clock_ms(libc::CLOCK_REALTIME_COARSE)
    }

    /// Milliseconds of this host's monotonic clock (`CLOCK_MONOTONIC`):
    /// it never steps (an NTP or manual change of the wall clock does not
    /// move it) and stands still while the host is suspended, and every
    /// process of one boot reads the same clock (unless put in a time
    /// namespace of its own, which shifts it). For leases judged on the
    /// host that renews them.
    pub fn monotonic_ms() -> u64 {
        clock_ms(libc::CLOCK_MONOTONIC)
    }

    /// Milliseconds of the monotonic clock as of the last tick
    /// (`CLOCK_MONOTONIC_COARSE`: as cheap as [`now_ms_coarse`], and it
    /// never steps back): for intervals timed on a per-call path.
    pub fn monotonic_ms_coarse() -> u64 {
        clock_ms(libc::CLOCK_MONOTONIC_COARSE)
    }

    fn clock_ms(clock: libc::clockid_t) -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; clock_gettime is
        // async-signal-safe and has no other preconditions.
        unsafe { libc::clock_gettime(clock, &mut ts) };
        (ts.tv_sec as u64) * 1000 + (ts.tv_nsec as u64) / 1_000_000
    }
}

/// Stream output.
pub mod io {
    use std::io::{ErrorKind, IoSlice, Result, Write};

    /// Writes every slice, in order, with vectored writes (what
    /// `Write::write_all_vectored` does on nightly): a frame's header and
    /// its payload go out without being copied into one buffer first.
    pub fn write_all_vectored(w: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> Result<()> {
        while !slices.is_empty() {
            match w.write_vectored(slices) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes `msg` to stderr with one `write(2)`, ignoring failure.
    /// Async-signal-safe (for fault handlers).
    pub fn write_stderr(msg: &[u8]) {
        // SAFETY: `msg` is valid for its length; write(2) is
        // async-signal-safe.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    }

    #[cfg(test)]
    mod tests {
        /// A writer that takes at most 3 bytes per call: every slice still
        /// arrives whole and in order.
        #[test]
        fn short_writes_lose_nothing() {
            struct Slow(Vec<u8>);
            impl std::io::Write for Slow {
                fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                    let n = b.len().min(3);
                    self.0.extend_from_slice(&b[..n]);
                    Ok(n)
                }
                fn flush(&mut self) -> std::io::Result<()> {
                    Ok(())
                }
            }
            let (a, b, c) = (b"hello".to_vec(), Vec::new(), b" world!".to_vec());
            let mut s = [
                std::io::IoSlice::new(&a),
                std::io::IoSlice::new(&b),
                std::io::IoSlice::new(&c),
            ];
            let mut w = Slow(Vec::new());
            super::write_all_vectored(&mut w, &mut s).unwrap();
            assert_eq!(w.0, b"hello world!");
        }
    }
}

/// Randomness for pool ids and Ref tags.
pub mod rand {
    use std::cell::RefCell;

    fn fill(v: &mut [u8]) {
        let mut filled = 0usize;
        while filled < v.len() {
            // SAFETY: the pointer and length describe the unfilled tail of `v`.
            let n =
                unsafe { libc::getrandom(v[filled..].as_mut_ptr().cast(), v.len() - filled, 0) };
            if n > 0 {
                filled += n as usize;
            }
        }
    }

    thread_local! {
        // Kernel randomness fetched 4 KiB at a time: the same strength as
        // one getrandom(2) per value, without a syscall per Ref.
        // (The bytes, the next unused one, and the process's fork count
        // when they were drawn.)
        static POOL: RefCell<(Vec<u8>, usize, u64)> = const { RefCell::new((Vec::new(), 0, 0)) };
    }

    /// 64 random bits from the kernel (`getrandom(2)`, batched per thread).
    /// A child made by `fork()` draws a batch of its own: it never hands
    /// out the values its parent will ([`crate::proc::watch_forks`]).
    pub fn random_u64() -> u64 {
        let forks = crate::proc::watch_forks();
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            if p.0.len() < 4096 || p.1 + 8 > p.0.len() || p.2 != forks {
                p.0.resize(4096, 0);
                fill(&mut p.0);
                p.1 = 0;
                p.2 = forks;
            }
            let at = p.1;
            p.1 += 8;
            let mut b = [0u8; 8];
            b.copy_from_slice(&p.0[at..at + 8]);
            // Used bytes are overwritten so that a later memory disclosure
            // cannot reveal tags already handed out.
            p.0[at..at + 8].fill(0);
            u64::from_ne_bytes(b)
        })
    }
}

/// Process liveness.
pub mod proc {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// This process's id.
    pub fn pid() -> u32 {
        std::process::id()
    }

    /// Forks this process went through since it started watching
    /// ([`watch_forks`]).
    static FORKS: AtomicU64 = AtomicU64::new(0);

    extern "C" fn forked() {
        // In the child, right after the fork: one atomic add, which is
        // async-signal-safe.
        FORKS.fetch_add(1, Ordering::Relaxed);
    }

    /// Starts counting the forks of this process, once, and returns the
    /// count so far: a value to compare [`forks`] with later. A child made
    /// by `fork()` sees a higher count than its parent saw when it took
    /// this value, whatever thread forked. (Its handler runs in the child,
    /// `pthread_atfork`.)
    pub fn watch_forks() -> u64 {
        static WATCH: std::sync::Once = std::sync::Once::new();
        WATCH.call_once(|| {
            // SAFETY: `forked` is a plain `extern "C" fn()` that lives for
            // the whole process; the other handlers are none.
            let r = unsafe { libc::pthread_atfork(None, None, Some(forked)) };
            debug_assert_eq!(r, 0, "pthread_atfork");
        });
        forks()
    }

    /// The forks counted so far (see [`watch_forks`]): one relaxed load.
    #[inline]
    pub fn forks() -> u64 {
        FORKS.load(Ordering::Relaxed)
    }

    /// Whether this process runs as root (its effective user).
    pub fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// Whether a process with this pid runs on this host: it exists (a
    /// signal 0 probe) and has not exited. A process killed and not yet
    /// reaped by its parent (a zombie) still exists, but is dead. A hint
    /// only: pids are reused, so leases remain the authority.
    pub fn pid_alive(pid: u32) -> bool {
        alive_since(pid, 0)
    }

    /// Whether process `pid` runs, as [`pid_alive`], and is the one that
    /// started at `start` ([`start_time`]; 0: any): a pid reused by a
    /// newer process is not the process it was.
    pub fn alive_since(pid: u32, start: u64) -> bool {
        if pid == 0 || pid > i32::MAX as u32 {
            return false;
        }
        if start != 0 {
            if let Some(alive) = handles::alive(pid, start) {
                return alive;
            }
        }
        let alive = alive_by_proc(pid, start);
        if alive && start != 0 {
            handles::keep(pid, start);
        }
        alive
    }

    /// [`alive_since`] from `/proc`: a signal 0 probe, then the process's
    /// state and start time (four system calls).
    fn alive_by_proc(pid: u32, start: u64) -> bool {
        // SAFETY: kill with signal 0 performs only the permission/existence check.
        let r = unsafe { libc::kill(pid as i32, 0) };
        let exists = r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !exists {
            return false;
        }
        match std::fs::read(format!("/proc/{pid}/stat")) {
            Ok(stat) => {
                !exited_state(&stat)
                    && (start == 0 || start_of_stat(&stat).is_none_or(|s| s == start))
            }
            Err(_) => true,
        }
    }

    /// Handles (pidfds) of processes found alive, by pid and start time:
    /// checking one again is one `poll`, where `/proc` costs four system
    /// calls and a file's formatting (a pool's lease thread checks every
    /// process attached to it each lease period). A pidfd names its
    /// process for good, so a reused pid cannot pass for it, and it reads
    /// as ready once the process has exited (a zombie included).
    mod handles {
        use std::collections::HashMap;
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        use std::sync::Mutex;

        /// At most this many handles are kept: each is an open descriptor
        /// of this process. Past it, those of processes that exited go
        /// (one `poll` for all), and if none has, all go.
        pub(super) const MAX: usize = 256;

        /// Handles by pid and start time.
        type Kept = Option<HashMap<(u32, u64), OwnedFd>>;

        static KEPT: Mutex<Kept> = Mutex::new(None);

        /// Whether the process kept as (`pid`, `start`) is alive; None if
        /// none is kept.
        /// The map, unless another thread holds it (then /proc answers:
        /// a lock held across a fork never blocks the child).
        fn kept() -> Option<std::sync::MutexGuard<'static, Kept>> {
            match KEPT.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }

        pub(super) fn alive(pid: u32, start: u64) -> Option<bool> {
            let mut kept = kept()?;
            let fd = kept.as_ref()?.get(&(pid, start))?;
            let mut p = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, no wait.
            let r = unsafe { libc::poll(&mut p, 1, 0) };
            match r {
                0 => Some(true),
                _ => {
                    // Exited (ready), or the handle failed: ask /proc.
                    kept.as_mut().map(|m| m.remove(&(pid, start)));
                    (r == 1 && p.revents & libc::POLLIN != 0).then_some(false)
                }
            }
        }

        /// Handles kept now.
        #[cfg(test)]
        pub(super) fn count() -> usize {
            kept().map_or(0, |k| k.as_ref().map_or(0, HashMap::len))
        }

        /// Keeps a handle of `pid` if it is still the process that started
        /// at `start` once the handle is open.
        pub(super) fn keep(pid: u32, start: u64) {
            // SAFETY: pidfd_open takes a pid and flags; it returns a new
            // descriptor (close-on-exec) or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
            if fd < 0 {
                return;
            }
            // SAFETY: fd is a descriptor just opened, owned by nothing else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            // The pid may have been reused between the check and the open.
            if super::start_time(pid) != Some(start) {
                return;
            }
            let Some(mut kept) = kept() else { return };
            let m = kept.get_or_insert_with(HashMap::new);
            if m.len() >= MAX {
                // A process nobody asks about again keeps its handle until
                // here: drop those that exited.
                let keys: Vec<(u32, u64)> = m.keys().copied().collect();
                let mut polls: Vec<libc::pollfd> = keys
                    .iter()
                    .map(|k| libc::pollfd {
                        fd: m[k].as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
                // SAFETY: `polls` holds polls.len() valid pollfds; no wait.
                let r = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, 0) };
                if r < 0 {
                    m.clear();
                } else {
                    for (k, p) in keys.iter().zip(&polls) {
                        if p.revents != 0 {
                            m.remove(k);
                        }
                    }
                }
                if m.len() >= MAX {
                    m.clear();
                }
            }
            m.insert((pid, start), fd);
        }
    }

    /// When process `pid` started, in clock ticks since boot (field 22 of
    /// `/proc/PID/stat`): with its pid, it names a process for good. None
    /// if that cannot be read.
    pub fn start_time(pid: u32) -> Option<u64> {
        start_of_stat(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)
    }

    /// The start time in a `/proc/PID/stat` line: the 20th field after
    /// the command (which is in parentheses and may contain them).
    fn start_of_stat(stat: &[u8]) -> Option<u64> {
        let after = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
        let field = std::str::from_utf8(after)
            .ok()?
            .split_whitespace()
            .nth(19)?;
        field.parse().ok()
    }

    /// This process's PID namespace (the inode of `/proc/self/ns/pid`; 0
    /// if it cannot be read): processes whose pids can be compared with
    /// this process's share it.
    pub fn pid_namespace() -> u64 {
        static NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        *NS.get_or_init(|| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
        })
    }

    /// The state of a `/proc/PID/stat` line says the process exited. The
    /// state is the field after the command, which is in parentheses and
    /// may itself contain them: it follows the last `)`.
    fn exited_state(stat: &[u8]) -> bool {
        stat.iter()
            .rposition(|&b| b == b')')
            .and_then(|i| stat.get(i + 2))
            .is_some_and(|s| matches!(s, b'Z' | b'X'))
    }

    /// Has the kernel kill this process (SIGKILL) when the thread that
    /// started it exits (`PR_SET_PDEATHSIG`): for helper processes of
    /// tests, which must not outlive a test that crashed or hung (one that
    /// spins in a wait would run on for good). Exits at once if the parent
    /// is already gone.
    pub fn die_with_parent() -> std::io::Result<()> {
        // SAFETY: getppid takes no arguments and cannot fail.
        let parent = unsafe { libc::getppid() };
        // SAFETY: PR_SET_PDEATHSIG takes a signal number, no pointers.
        let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::getppid() } != parent {
            std::process::exit(1);
        }
        Ok(())
    }

    /// The context switches of every thread of process `pid` so far,
    /// voluntary (it blocked) and not (it was preempted, or called
    /// `sched_yield` with another task runnable), from
    /// `/proc/PID/task/*/status`. For benchmarks that explain where a
    /// chain of processes on few cores spends its time: the difference of
    /// two readings divided by the calls between them. A thread that ends
    /// between two readings takes its count with it.
    pub fn context_switches(pid: u32) -> std::io::Result<u64> {
        let mut n = 0;
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            // A thread that ended since the listing has no status: skip it.
            if let Ok(s) = std::fs::read_to_string(t?.path().join("status")) {
                n += switches_in_status(&s);
            }
        }
        Ok(n)
    }

    /// The context switches of all the threads of these processes so far
    /// ([`context_switches`]); a process that cannot be read (it exited)
    /// counts none.
    pub fn context_switches_of(pids: &[u32]) -> u64 {
        pids.iter().map(|&p| context_switches(p).unwrap_or(0)).sum()
    }

    /// The sum of the `voluntary_ctxt_switches` and
    /// `nonvoluntary_ctxt_switches` lines of a `/proc/.../status` text.
    pub fn switches_in_status(status: &str) -> u64 {
        status
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                matches!(k, "voluntary_ctxt_switches" | "nonvoluntary_ctxt_switches")
                    .then(|| v.trim().parse::<u64>().ok())?
            })
            .sum()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn switches_sum_both_kinds_and_nothing_else() {
            let s = "Name:\tx\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t30\nThreads:\t7\n";
            assert_eq!(switches_in_status(s), 42);
            assert_eq!(switches_in_status("Name:\tx\n"), 0);
            assert_eq!(switches_in_status("voluntary_ctxt_switches:\tbad\n"), 0);
        }

        #[test]
        fn a_thread_that_blocks_adds_switches_and_a_missing_process_is_an_error() {
            let before = context_switches(pid()).unwrap();
            // Blocking on a channel switches this thread out at least once.
            let (tx, rx) = std::sync::mpsc::channel();
            let t = std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                tx.send(()).unwrap();
            });
            rx.recv().unwrap();
            let after = context_switches(pid()).unwrap();
            t.join().unwrap();
            assert!(after > before, "{before} -> {after}");
            assert!(context_switches(u32::MAX).is_err());
            assert!(context_switches_of(&[pid(), u32::MAX]) >= after);
        }

        #[test]
        fn the_state_follows_the_last_parenthesis() {
            assert!(!exited_state(b"42 (worker) S 1 42"));
            assert!(exited_state(b"42 (worker) Z 1 42"));
            assert!(exited_state(b"42 (a) b) X 1 42"));
            assert!(!exited_state(b"42 (a) Z b) R 1 42"));
            assert!(!exited_state(b"42 (cut"));
            assert!(!exited_state(b""));
        }

        #[test]
        fn a_process_is_its_pid_and_its_start_time() {
            let line = b"42 (a) b) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 9 9";
            assert_eq!(start_of_stat(line), Some(987_654));
            assert_eq!(start_of_stat(b"42 (cut"), None);
            let me = start_time(pid()).unwrap();
            assert!(alive_since(pid(), me));
            assert!(alive_since(pid(), 0));
            assert!(
                !alive_since(pid(), me + 1),
                "the same pid, started at another time"
            );
            assert_ne!(pid_namespace(), 0);
        }

        /// A child that exited is dead while it waits to be reaped (a
        /// zombie), not only once its parent reaps it.
        #[test]
        fn a_zombie_is_dead() {
            assert!(pid_alive(pid()));
            let mut child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let id = child.id();
            assert!(pid_alive(id));
            child.kill().unwrap(); // SIGKILL; not reaped yet
            let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while pid_alive(id) {
                assert!(std::time::Instant::now() < until, "a zombie looks alive");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            // Still a zombie here: it exists until its parent reaps it.
            // SAFETY: signal 0 checks existence only.
            assert_eq!(unsafe { libc::kill(id as i32, 0) }, 0);
            child.wait().unwrap();
            assert!(!pid_alive(id));
        }

        /// A process found alive by its start time is checked again through
        /// its kept handle, which says when it exits, zombie or reaped.
        #[test]
        fn a_kept_handle_follows_its_process() {
            for reap in [false, true] {
                let mut child = std::process::Command::new("sleep")
                    .arg("30")
                    .spawn()
                    .unwrap();
                let id = child.id();
                let start = start_time(id).unwrap();
                assert!(alive_since(id, start));
                assert_eq!(handles::alive(id, start), Some(true), "kept");
                assert!(alive_since(id, start), "through the handle");
                assert!(!alive_since(id, start + 1));
                child.kill().unwrap();
                if reap {
                    child.wait().unwrap();
                }
                let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while alive_since(id, start) {
                    assert!(
                        std::time::Instant::now() < until,
                        "an exited process looks alive"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                assert_eq!(handles::alive(id, start), None, "dropped once found dead");
                let _ = child.wait();
            }
        }

        /// Handles of processes nobody asks about again do not pile up:
        /// past the limit, those that exited are dropped, and those of
        /// processes still running are kept.
        #[test]
        fn handles_of_exited_processes_do_not_pile_up() {
            let sleeper = || {
                std::process::Command::new("sleep")
                    .arg("30")
                    .spawn()
                    .unwrap()
            };
            let mut live: Vec<_> = (0..4).map(|_| sleeper()).collect();
            let keys: Vec<(u32, u64)> = live
                .iter()
                .map(|c| (c.id(), start_time(c.id()).unwrap()))
                .collect();
            for &(id, start) in &keys {
                assert!(alive_since(id, start));
            }
            for _ in 0..handles::MAX + 8 {
                let mut child = sleeper();
                let id = child.id();
                assert!(alive_since(id, start_time(id).unwrap()));
                child.kill().unwrap();
                child.wait().unwrap();
            }
            assert!(
                handles::count() <= handles::MAX,
                "{} handles kept",
                handles::count()
            );
            for &(id, start) in &keys {
                assert_eq!(
                    handles::alive(id, start),
                    Some(true),
                    "a live one's handle went"
                );
            }
            for c in &mut live {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Gives up the CPU (`sched_yield(2)`). Async-signal-safe.
pub fn sched_yield() {
    // SAFETY: no preconditions.
    unsafe { libc::sched_yield() };
}

/// The CPUs the calling thread may run on (`sched_getaffinity(2)`).
pub fn affinity() -> std::io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by the call
    // (`size_of::<cpu_set_t>()` bytes); CPU_ISSET reads within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect())
    }
}

/// Lets the calling thread (and the threads and processes it creates
/// afterwards) run only on `cpus` (`sched_setaffinity(2)`).
pub fn set_affinity(cpus: &[usize]) -> std::io::Result<()> {
    if cpus.is_empty() || cpus.iter().any(|&c| c >= libc::CPU_SETSIZE as usize) {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes
    // within it (every cpu < CPU_SETSIZE, checked above); the call reads
    // `size_of::<cpu_set_t>()` bytes of it.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod affinity_tests {
    #[test]
    fn set_and_restore() {
        let all = super::affinity().unwrap();
        assert!(!all.is_empty());
        super::set_affinity(&all[..1]).unwrap();
        assert_eq!(super::affinity().unwrap(), all[..1].to_vec());
        super::set_affinity(&all).unwrap();
        assert_eq!(super::affinity().unwrap(), all);
        assert!(super::set_affinity(&[]).is_err());
    }
}
