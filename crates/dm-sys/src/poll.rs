//! Busy-polling sockets before blocking on them.
//!
//! A blocked reader on this machine's loopback pays for a wake-up of its
//! thread (about 25 µs across cores in the KVM guest, twice per round
//! trip), where the data itself takes a few microseconds. A reader that
//! polls the socket for a short while before it blocks takes an answer
//! that comes soon without that cost, as the shared-memory rings' waiters
//! spin before they park. [`Spin`] is the budget of such a poll, adapted
//! to the waits it sees so that a reader whose answers come late (a loaded
//! server, more threads than cores) stops burning the CPU the answer needs.
//! [`readable_now`], [`recv_nowait`] and [`ReadySet`] are the non-blocking
//! checks to poll, [`IdlePoll`] an event loop's poll before it sleeps, and
//! [`wait_io`] a bounded wait for a socket to be readable or writable.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// The shortest budget an adapted [`Spin`] keeps: a few polls, enough for
/// an answer already on its way.
pub const MIN_SPIN: Duration = Duration::from_micros(2);

/// A `sched_yield` between two polls that takes this long ran another
/// thread: this core has more runnable threads than one, and polling on
/// would only take CPU from the thread that has the work (perhaps the one
/// the answer waits for). (A yield with nobody else to run takes well
/// under a microsecond.)
const CROWDED: Duration = Duration::from_micros(3);

/// An adaptive busy-poll budget (one per waiting party: a connection's
/// reader, a server's event loop).
///
/// Between polls the poller yields its core, so a thread that is ready to
/// run there runs at once; a yield that ran someone else ends the poll
/// (the core is crowded). A poll that ends with the answer keeps the
/// budget; one that runs out or finds the core crowded halves it (down to
/// [`MIN_SPIN`]); a blocking wait that ends within the maximum after a
/// poll that ran out (the answer "just missed") doubles that poll's
/// budget. So the budget grows to cover answers that come within the
/// maximum while the cores have room, and shrinks to the floor for
/// answers that come later or when threads outnumber cores.
#[derive(Debug, Clone)]
pub struct Spin {
    max: Duration,
    cur: Duration,
    /// The budget of the last poll that ran out (for [`Spin::blocked`]).
    spun: Duration,
}

impl Spin {
    /// A budget of at most `max` (zero: never poll).
    pub fn new(max: Duration) -> Spin {
        Spin {
            max,
            cur: max,
            spun: Duration::ZERO,
        }
    }

    /// The budget the next poll gets.
    pub fn budget(&self) -> Duration {
        self.cur
    }

    /// Calls `poll` until it gives a value, the budget passes or the core
    /// turns out crowded (`None`: block now, and report the blocking wait
    /// with [`Spin::blocked`]).
    pub fn run<T>(&mut self, mut poll: impl FnMut() -> Option<T>) -> Option<T> {
        self.spun = Duration::ZERO;
        if self.cur.is_zero() {
            return None;
        }
        let start = Instant::now();
        loop {
            if let Some(x) = poll() {
                return Some(x);
            }
            let t = Instant::now();
            crate::sched_yield();
            let now = Instant::now();
            if now - t >= CROWDED {
                // One last look: the answer may have come meanwhile.
                let x = poll();
                if x.is_none() {
                    self.crowded();
                }
                return x;
            }
            if now - start >= self.cur {
                self.ran_out();
                return None;
            }
        }
    }

    /// Reads what stream socket `fd` has into `buf`: polls it for the
    /// budget (checking readiness with [`readable_now`], which takes no
    /// socket lock), else reads with `block` (the caller's blocking read,
    /// with its own timeout) and reports how long that took.
    pub fn read(
        &mut self,
        fd: RawFd,
        buf: &mut [u8],
        block: impl FnOnce(&mut [u8]) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        let polled = self.run(|| {
            if !readable_now(fd) {
                return None;
            }
            match recv_nowait(fd, buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                r => Some(r),
            }
        });
        if let Some(r) = polled {
            return r;
        }
        let t = Instant::now();
        let r = block(buf);
        self.blocked(t.elapsed());
        r
    }

    /// A poll used its whole budget: halve it, and remember it for
    /// [`Spin::blocked`].
    fn ran_out(&mut self) {
        self.spun = self.cur;
        self.cur = (self.cur / 2).max(MIN_SPIN.min(self.max));
    }

    /// A poll found its core crowded: halve the budget (no near miss).
    fn crowded(&mut self) {
        self.spun = Duration::ZERO;
        self.cur = (self.cur / 2).max(MIN_SPIN.min(self.max));
    }

    /// Reports that the blocking wait after a poll that gave up took
    /// `waited`: an answer that came within the maximum just missed a poll
    /// that ran out, so the next poll gets twice that one's budget.
    pub fn blocked(&mut self, waited: Duration) {
        if !self.spun.is_zero() && waited < self.max {
            self.cur = (self.spun * 2).clamp(MIN_SPIN.min(self.max), self.max);
        }
        self.spun = Duration::ZERO;
    }
}

/// Reads what `fd` (a connected stream socket) has buffered into `buf`
/// without blocking (`recv(2)` with `MSG_DONTWAIT`): `WouldBlock` when
/// nothing has arrived, `Ok(0)` at the end of the stream.
pub fn recv_nowait(fd: RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes; recv writes
    // at most that many and returns how many (or -1).
    let r = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// Whether `fd` has input (or a hang-up or an error) now (`poll(2)` with
/// no wait). Unlike a read attempt it takes no socket lock, so polling
/// with it does not hold up the kernel delivering the bytes awaited.
pub fn readable_now(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one valid pollfd, as the count says; timeout 0.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0
}

/// What [`wait_io`] found a descriptor ready for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ready {
    /// Input, a hang-up or an error (a read then tells which).
    pub read: bool,
    /// Room for output, a hang-up or an error (a write then tells which).
    pub write: bool,
}

/// Waits until `fd` is ready for what is asked (`poll(2)`), at most
/// `timeout`: nothing ready if it was not in time.
pub fn wait_io(fd: RawFd, read: bool, write: bool, timeout: Duration) -> std::io::Result<Ready> {
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    loop {
        // SAFETY: `p` is one valid pollfd, as the count says.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r >= 0 {
            let bad = p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
            return Ok(Ready {
                read: read && (bad || p.revents & libc::POLLIN != 0),
                write: write && (bad || p.revents & libc::POLLOUT != 0),
            });
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A set of file descriptors to poll for readability together (an epoll
/// instance, level-triggered): an event loop polls its sockets through it
/// before it parks.
#[derive(Debug)]
pub struct ReadySet {
    ep: RawFd,
}

impl ReadySet {
    /// An empty set.
    pub fn new() -> std::io::Result<ReadySet> {
        // SAFETY: no pointers; returns a new descriptor or -1.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(ReadySet { ep })
    }

    /// Adds `fd` (polled for input until [`ReadySet::remove`] or its close).
    pub fn add(&self, fd: RawFd) -> std::io::Result<()> {
        self.add_with(fd, fd as u64)
    }

    /// Adds `fd`, named `token` in what [`ReadySet::wait`] reports.
    pub fn add_with(&self, fd: RawFd, token: u64) -> std::io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32 | libc::EPOLLRDHUP as u32,
            u64: token,
        };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call.
        let r = unsafe { libc::epoll_ctl(self.ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Removes `fd` (call before closing it if it may have been duplicated).
    pub fn remove(&self, fd: RawFd) {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: as in add; a descriptor not in the set only fails.
        unsafe { libc::epoll_ctl(self.ep, libc::EPOLL_CTL_DEL, fd, &mut ev) };
    }

    /// Waits until some descriptor in the set has input (or a hang-up), at
    /// most `timeout` (`None`: no limit; zero: just looks), and puts their
    /// tokens in `out` (cleared first; empty if none in time).
    pub fn wait(&self, out: &mut Vec<u64>, timeout: Option<Duration>) -> std::io::Result<()> {
        out.clear();
        let ms = match timeout {
            None => -1,
            Some(t) if t.is_zero() => 0,
            // Rounded up: a wait never ends before its time.
            Some(t) => t.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128) as i32,
        };
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 64];
        // SAFETY: `ev` holds 64 events, as the count says.
        let r = unsafe { libc::epoll_wait(self.ep, ev.as_mut_ptr(), ev.len() as i32, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(e)
            };
        }
        out.extend(ev[..r as usize].iter().map(|e| e.u64));
        Ok(())
    }

    /// Whether any descriptor in the set has input (or a hang-up) now.
    pub fn any_ready(&self) -> bool {
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }];
        // SAFETY: `ev` holds one event, as the count says; timeout 0 never
        // blocks.
        let r = unsafe { libc::epoll_wait(self.ep, ev.as_mut_ptr(), 1, 0) };
        r > 0
    }
}

impl Drop for ReadySet {
    fn drop(&mut self) {
        // SAFETY: the descriptor is owned by this set and closed once.
        unsafe { libc::close(self.ep) };
    }
}

/// The sockets of an event loop, polled before the loop's thread sleeps:
/// the loop calls [`IdlePoll::before_sleep`] when it has nothing left to
/// run (tokio's `on_thread_park`) and [`IdlePoll::after_wake`] when it
/// runs again (`on_thread_unpark`). A socket that became readable during
/// the poll makes the loop's own wait return at once (tokio registers
/// sockets edge-triggered, so the event is pending), without the wake-up
/// of a sleeping thread.
#[derive(Debug)]
pub struct IdlePoll {
    set: ReadySet,
    /// The budget, and when the loop went to sleep after a poll that gave up.
    spin: std::sync::Mutex<(Spin, Option<Instant>)>,
}

impl IdlePoll {
    /// Polls for up to `max` (adapted; zero: never).
    pub fn new(max: Duration) -> std::io::Result<IdlePoll> {
        Ok(IdlePoll {
            set: ReadySet::new()?,
            spin: std::sync::Mutex::new((Spin::new(max), None)),
        })
    }

    /// Adds a socket of the loop.
    pub fn add(&self, fd: RawFd) -> std::io::Result<()> {
        self.set.add(fd)
    }

    /// Removes a socket (before it is closed).
    pub fn remove(&self, fd: RawFd) {
        self.set.remove(fd)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, (Spin, Option<Instant>)> {
        self.spin.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loop is about to sleep: poll its sockets first.
    pub fn before_sleep(&self) {
        let mut st = self.state();
        let ready = st.0.run(|| self.set.any_ready().then_some(()));
        st.1 = ready.is_none().then(Instant::now);
    }

    /// The loop runs again.
    pub fn after_wake(&self) {
        let mut st = self.state();
        if let Some(t) = st.1.take() {
            st.0.blocked(t.elapsed());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_poll_that_finds_its_answer_keeps_its_budget() {
        // The answer is there from the second poll on, which comes either
        // in the loop or as the last look after a yield that found the
        // core crowded (a loaded test run), so it is found either way.
        // (The budget is too long to run out first; a 50 us one did, and
        // a third poll was not always reached, under load.)
        let max = Duration::from_secs(1);
        let mut s = Spin::new(max);
        let mut n = 0;
        let got = s.run(|| {
            n += 1;
            (n >= 2).then_some(n)
        });
        assert_eq!(got, Some(2));
        assert_eq!(s.budget(), max);
    }

    #[test]
    fn polls_that_give_up_halve_the_budget_down_to_the_floor_and_a_near_miss_doubles_it() {
        let max = Duration::from_micros(64);
        let mut s = Spin::new(max);
        // Ran out or found the core crowded (under a loaded test run):
        // halved either way.
        assert_eq!(s.run(|| None::<()>), None);
        assert_eq!(s.budget(), max / 2);
        for _ in 0..10 {
            s.ran_out();
            s.blocked(Duration::from_millis(5)); // a long wait: no change
        }
        assert_eq!(s.budget(), MIN_SPIN);
        s.ran_out();
        s.blocked(Duration::from_micros(3)); // just missed
        assert_eq!(s.budget(), 2 * MIN_SPIN);
        // A report without a poll that ran out changes nothing.
        s.blocked(Duration::from_micros(1));
        assert_eq!(s.budget(), 2 * MIN_SPIN);
        // Nor does one after a crowded core.
        s.crowded();
        s.blocked(Duration::from_micros(1));
        assert_eq!(s.budget(), MIN_SPIN);
    }

    #[test]
    fn a_zero_budget_never_polls() {
        let mut s = Spin::new(Duration::ZERO);
        assert_eq!(s.run(|| -> Option<()> { panic!("polled") }), None);
        s.blocked(Duration::ZERO);
        assert_eq!(s.budget(), Duration::ZERO);
    }

    #[test]
    fn recv_nowait_and_the_ready_set_see_what_arrived() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let set = ReadySet::new().unwrap();
        set.add(b.as_raw_fd()).unwrap();
        let mut buf = [0u8; 16];
        let e = recv_nowait(b.as_raw_fd(), &mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
        assert!(!set.any_ready());
        a.write_all(b"hello").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !set.any_ready() {
            assert!(Instant::now() < deadline, "never ready");
        }
        assert_eq!(recv_nowait(b.as_raw_fd(), &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
        assert!(!set.any_ready());
        drop(a);
        while !set.any_ready() {
            assert!(Instant::now() < deadline, "hang-up never seen");
        }
        assert_eq!(recv_nowait(b.as_raw_fd(), &mut buf).unwrap(), 0);
        set.remove(b.as_raw_fd());
        assert!(!set.any_ready());
    }

    #[test]
    fn wait_reports_the_tokens_of_what_is_ready_and_wait_io_the_directions() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (d, _) = l.accept().unwrap();
        let set = ReadySet::new().unwrap();
        set.add_with(b.as_raw_fd(), 7).unwrap();
        set.add_with(d.as_raw_fd(), 9).unwrap();
        let mut got = vec![1, 2, 3];
        set.wait(&mut got, Some(Duration::ZERO)).unwrap();
        assert!(got.is_empty());
        let t = Instant::now();
        set.wait(&mut got, Some(Duration::from_millis(20))).unwrap();
        assert!(got.is_empty() && t.elapsed() >= Duration::from_millis(20));
        let r = wait_io(b.as_raw_fd(), true, true, Duration::from_millis(1)).unwrap();
        assert_eq!((r.read, r.write), (false, true));
        c.write_all(b"x").unwrap();
        set.wait(&mut got, None).unwrap();
        assert_eq!(got, [9]);
        a.write_all(b"y").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            set.wait(&mut got, Some(Duration::from_millis(10))).unwrap();
            got.sort();
            if got == [7, 9] {
                break;
            }
            assert!(Instant::now() < deadline, "got {got:?}");
        }
        let r = wait_io(b.as_raw_fd(), true, false, Duration::from_secs(5)).unwrap();
        assert_eq!((r.read, r.write), (true, false));
    }
}
