//! Shared helpers for the pool's integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use dm_pool::{AttachOptions, Pool, PoolConfig};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

static N: AtomicU32 = AtomicU32::new(0);

/// A pool file under /dev/shm removed on drop.
pub struct TempPool {
    pub path: PathBuf,
}

impl TempPool {
    pub fn new(size: u64) -> TempPool {
        Self::with(PoolConfig {
            size,
            ..Default::default()
        })
    }

    pub fn with(cfg: PoolConfig) -> TempPool {
        let path = PathBuf::from(format!(
            "/dev/shm/dmrpc-test-{}-{}.pool",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&path);
        Pool::create(&path, &cfg).unwrap();
        TempPool { path }
    }

    pub fn attach(&self) -> Pool {
        Pool::open(&self.path, AttachOptions::default()).unwrap()
    }

    pub fn attach_with(&self, o: AttachOptions) -> Pool {
        Pool::open(&self.path, o).unwrap()
    }

    /// Asserts the pool invariant (deep: free pages zero) and no live slot left.
    pub fn assert_clean(&self) {
        let r = dm_pool::check_path(&self.path, true).unwrap();
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
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A `dm-pool-agent` child process driven line by line.
pub struct Agent {
    pub child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Agent {
    pub fn spawn(path: &Path, lease_ms: Option<u64>) -> Agent {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dm-pool-agent"));
        cmd.arg(path);
        if let Some(l) = lease_ms {
            cmd.arg(l.to_string());
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut a = Agent { child, stdin, out };
        let hello = a.line();
        assert!(
            hello.starts_with("ok slot"),
            "agent failed to attach: {hello}"
        );
        a
    }

    fn line(&mut self) -> String {
        let mut s = String::new();
        self.out.read_line(&mut s).unwrap();
        s.trim_end().to_string()
    }

    /// Sends a command; returns the raw answer line.
    pub fn raw(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }

    /// Sends a command that must succeed; returns its value.
    pub fn ok(&mut self, cmd: &str) -> String {
        let r = self.raw(cmd);
        assert!(r.starts_with("ok"), "{cmd:?} failed: {r}");
        r.trim_start_matches("ok").trim().to_string()
    }

    /// Sends a command that must fail; returns the error text.
    pub fn err(&mut self, cmd: &str) -> String {
        let r = self.raw(cmd);
        assert!(r.starts_with("err"), "{cmd:?} should have failed: {r}");
        r
    }

    pub fn exit(mut self) {
        let _ = writeln!(self.stdin, "exit");
        let st = self.child.wait().unwrap();
        assert!(st.success(), "agent exited with {st}");
    }

    /// SIGKILL (std's `kill`), then reap.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Agent {
    /// A test that fails midway must not leave agents running.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs `f` on a thread and fails the test instead of hanging past `secs`.
pub fn watchdog<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("watchdog: test did not finish in {secs}s (deadlock?)"))
}
