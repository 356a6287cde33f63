//! Shared helpers for the pool's integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

#[allow(unused_imports)]
pub use dm_pool::testing::TempPool;

/// A `dm-pool-agent` child process driven line by line.
pub struct Agent {
    pub child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Agent {
    pub fn spawn(path: &Path, lease_ms: Option<u64>) -> Agent {
        Self::spawn_with(path, lease_ms, &[], false)
    }

    /// [`spawn`](Self::spawn) with environment variables (`DMRPC_TENANT`,
    /// `DMRPC_LEASE_ONLY`), and its stderr kept for [`end`](Self::end)
    /// if `stderr`.
    pub fn spawn_with(
        path: &Path,
        lease_ms: Option<u64>,
        env: &[(&str, &str)],
        stderr: bool,
    ) -> Agent {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dm-pool-agent"));
        cmd.arg(path);
        if let Some(l) = lease_ms {
            cmd.arg(l.to_string());
        }
        if stderr {
            cmd.stderr(Stdio::piped());
        }
        cmd.envs(env.iter().copied());
        Self::spawn_command(cmd).unwrap_or_else(|e| panic!("agent failed to attach: {e}"))
    }

    /// An agent started by `cmd` (the agent, or a wrapper that runs it,
    /// such as `unshare`), once it has attached; what went wrong if it
    /// could not start or attach.
    pub fn spawn_command(mut cmd: Command) -> Result<Agent, String> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut a = Agent { child, stdin, out };
        let mut hello = String::new();
        let _ = a.out.read_line(&mut hello);
        if !hello.starts_with("ok slot") {
            let mut err = String::new();
            if let Some(mut e) = a.child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Err(format!("{} {err}", hello.trim_end()));
        }
        Ok(a)
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

    /// Sends a command to an agent that may have died; its answer, empty
    /// if it is gone.
    /// Sends a command whose answer never comes (the agent stops in it).
    pub fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }

    pub fn try_raw(&mut self, cmd: &str) -> String {
        if writeln!(self.stdin, "{cmd}")
            .and_then(|()| self.stdin.flush())
            .is_err()
        {
            return String::new();
        }
        let mut s = String::new();
        let _ = self.out.read_line(&mut s);
        s.trim_end().to_string()
    }

    /// Sends `sig` to the agent.
    pub fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// Says `exit` (if it still listens) and waits up to 10 s for the
    /// agent to end, however it ends: its status, and its stderr if kept.
    pub fn end(mut self) -> (Option<std::process::ExitStatus>, String) {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.stdin.flush();
        let err = self.child.stderr.take();
        let st = self.wait_exit(Duration::from_secs(10));
        let mut text = String::new();
        if let Some(mut e) = err {
            let _ = std::io::Read::read_to_string(&mut e, &mut text);
        }
        (st, text)
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

    /// Waits up to `timeout` for the agent to end by itself; how it ended.
    pub fn wait_exit(mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            if std::time::Instant::now() >= until {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
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

/// The bytes of [`hex`]'s text (panics on anything else).
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
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
