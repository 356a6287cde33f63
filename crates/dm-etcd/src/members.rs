//! etcd members started by this process, for tests, demos and the
//! one-machine cluster: [`EtcdCluster::start`] on loopback, or
//! [`EtcdCluster::start_with`] with a command per member (to run each in
//! a network namespace of its own). The `etcd` binary comes from the
//! distribution's `etcd-server` package (`scripts/deps.sh` installs it),
//! or from the path in `DMRPC_ETCD_BIN`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `etcd` binary to run.
pub fn etcd_bin() -> PathBuf {
    std::env::var_os("DMRPC_ETCD_BIN").map_or_else(|| PathBuf::from("etcd"), PathBuf::from)
}

/// Whether an `etcd` binary can be run here.
pub fn etcd_available() -> bool {
    Command::new(etcd_bin())
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// One member: where it listens and its process while it runs.
#[derive(Debug)]
pub struct Member {
    /// Its name in the cluster (`m0`, `m1`, ...).
    pub name: String,
    /// The address clients reach it at (`IP:PORT`).
    pub client: String,
    /// The address other members reach it at.
    pub peer: String,
    dir: PathBuf,
    child: Option<Child>,
}

/// A cluster of etcd members this process started (and stops when
/// dropped, removing their data).
pub struct EtcdCluster {
    members: Vec<Member>,
    initial: String,
    token: String,
    wrap: Wrap,
}

/// How a member's command is made (for one in a namespace).
type Wrap = Box<dyn Fn(usize, Command) -> Command + Send + Sync>;

/// A member exited while the cluster started (its ports taken, say).
#[derive(Debug)]
struct Exited(String);

impl std::fmt::Display for Exited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Exited {}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl EtcdCluster {
    /// Starts `n` members on loopback, on free ports, their data under
    /// `dir`, and waits until the cluster answers (at most 20 s).
    ///
    /// A port found free may be taken by another process before its
    /// member binds it, and the member exits: the cluster is then started
    /// again on other ports (three times at most).
    pub fn start(n: usize, dir: &Path) -> std::io::Result<EtcdCluster> {
        let mut tries = 0;
        loop {
            let mut addrs = Vec::with_capacity(n);
            for _ in 0..n {
                addrs.push((
                    format!("127.0.0.1:{}", free_port()?),
                    format!("127.0.0.1:{}", free_port()?),
                ));
            }
            match Self::start_with(&addrs, dir, |_, c| c) {
                Err(e) if tries < 2 && e.get_ref().is_some_and(|x| x.is::<Exited>()) => tries += 1,
                r => return r,
            }
        }
    }

    /// Starts one member per `(client, peer)` address pair, each command
    /// passed through `wrap` (its index and the `etcd` command; e.g. to
    /// run it in a network namespace), and waits until the cluster
    /// answers.
    pub fn start_with(
        addrs: &[(String, String)],
        dir: &Path,
        wrap: impl Fn(usize, Command) -> Command + Send + Sync + 'static,
    ) -> std::io::Result<EtcdCluster> {
        if !etcd_available() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "no etcd binary ({}): scripts/deps.sh installs the distribution's etcd-server",
                    etcd_bin().display()
                ),
            ));
        }
        let members: Vec<Member> = addrs
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| Member {
                name: format!("m{i}"),
                client: client.clone(),
                peer: peer.clone(),
                dir: dir.join(format!("m{i}")),
                child: None,
            })
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}=http://{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut c = EtcdCluster {
            members,
            initial,
            token: format!("dmrpc-{:x}", dm_sys::rand::random_u64()),
            wrap: Box::new(wrap),
        };
        for i in 0..c.members.len() {
            c.spawn(i, "new")?;
        }
        c.wait_ready(Duration::from_secs(20))?;
        Ok(c)
    }

    fn spawn(&mut self, i: usize, state: &str) -> std::io::Result<()> {
        let m = &self.members[i];
        std::fs::create_dir_all(&m.dir)?;
        let mut cmd = Command::new(etcd_bin());
        cmd.args([
            "--name",
            &m.name,
            "--data-dir",
            &m.dir.display().to_string(),
            "--listen-client-urls",
            &format!("http://{}", m.client),
            "--advertise-client-urls",
            &format!("http://{}", m.client),
            "--listen-peer-urls",
            &format!("http://{}", m.peer),
            "--initial-advertise-peer-urls",
            &format!("http://{}", m.peer),
            "--initial-cluster",
            &self.initial,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            &self.token,
            "--logger",
            "zap",
            "--log-level",
            "error",
            // Leases are kept to the second: a short election timeout
            // lets the shortest leases be granted.
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        let child = (self.wrap)(i, cmd).spawn()?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// The members' client endpoints.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client.clone()).collect()
    }

    /// The members.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// Kills member `i` (`SIGKILL`); its data stays for [`restart`](Self::restart).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data (then [`wait_ready`](Self::wait_ready):
    /// a member is healthy only with a quorum of members up).
    pub fn restart(&mut self, i: usize) -> std::io::Result<()> {
        self.kill(i);
        self.spawn(i, "existing")
    }

    /// Waits until every running member says it is healthy (it has a
    /// leader).
    pub fn wait_ready(&mut self, within: Duration) -> std::io::Result<()> {
        let t = Instant::now() + within;
        loop {
            let mut all = true;
            for m in &mut self.members {
                if let Some(c) = &mut m.child {
                    if let Some(st) = c.try_wait()? {
                        return Err(std::io::Error::other(Exited(format!(
                            "etcd member {} exited ({st}) while starting",
                            m.name
                        ))));
                    }
                    all &= healthy(&m.client);
                }
            }
            if all {
                return Ok(());
            }
            if Instant::now() > t {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the etcd cluster did not become healthy",
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Whether the member at `addr` answers `/health` with a leader.
pub fn healthy(addr: &str) -> bool {
    let Ok(sa) = addr.parse() else { return false };
    let Ok(mut s) = TcpStream::connect_timeout(&sa, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let mut b = Vec::new();
    let _ = s.take(4096).read_to_end(&mut b);
    let text = String::from_utf8_lossy(&b);
    text.contains("\"health\":\"true\"") || text.contains("\"health\": \"true\"")
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
            let _ = std::fs::remove_dir_all(&self.members[i].dir);
        }
    }
}

impl std::fmt::Debug for EtcdCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCluster")
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}
