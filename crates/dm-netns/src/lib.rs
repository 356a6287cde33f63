//! Hosts on one machine: network namespaces joined by a switch.
//!
//! [`Hosts::up`] makes `n` network namespaces (the hosts) and one more
//! (the switch) with a Linux bridge in it. Each host has one interface,
//! `eth0`, a veth pair whose other end is a port of the bridge, and an
//! address `10.99.0.(i+1)/24`. So every host reaches every other through
//! the switch, as machines of one rack do.
//!
//! A [`Link`] with a rate shapes both directions of every host's link
//! with `tc`'s token bucket filter (`tbf`): on `eth0` (what the host
//! sends) and on its bridge port (what it receives). A byte then costs
//! what it costs on a datacenter link of that rate, wherever it goes. A
//! link's propagation delay cannot be added: this kernel has no `netem`.
//!
//! Processes run in a host by [`Hosts::command`]; a thread of this
//! process moves into one by [`Hosts::enter`]. Pool files in `/dev/shm`
//! stay visible to all: only the network is per host. Everything is
//! removed when the [`Hosts`] drops, and [`Hosts::up`] first removes the
//! namespaces of processes that died without doing so.
//!
//! It needs root and iproute2 (`ip`, `tc`; `scripts/deps.sh` installs
//! them). [`Hosts::available`] says why not where they are missing.

use std::fs::File;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Names of this crate's namespaces start with this.
const PREFIX: &str = "dmrpc-";

/// Why hosts could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not root, or `ip` or `tc` missing.
    #[error("network namespaces are not available here: {0}")]
    Unavailable(String),
    /// A command of iproute2 failed.
    #[error("`{cmd}` failed: {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// What it said.
        stderr: String,
    },
    /// A host index past the last host.
    #[error("no host {0} (there are {1})")]
    NoHost(usize, usize),
    /// An I/O error (opening a namespace, entering it).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A rate that does not parse.
    #[error("bad link rate {0:?}: say e.g. 10gbit, 25gbit or 800mbit")]
    BadRate(String),
}

/// The link every host has to the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Link {
    /// Bits per second in each direction; `None`: not shaped (as fast as
    /// the machine moves bytes through veth).
    pub rate: Option<u64>,
}

impl Link {
    /// A link shaped to `bits` per second each way.
    pub fn shaped(bits: u64) -> Link {
        Link { rate: Some(bits) }
    }

    /// A rate as `tc` writes it (`10gbit`, `800mbit`, `1500kbit`, a plain
    /// number of bits per second), or `none`/`unshaped`.
    pub fn parse(s: &str) -> Result<Link, Error> {
        let t = s.trim().to_ascii_lowercase();
        if t == "none" || t == "unshaped" {
            return Ok(Link { rate: None });
        }
        let (num, mult) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
            .iter()
            .find_map(|&(suf, m)| t.strip_suffix(suf).map(|n| (n, m)))
            .unwrap_or((&t, 1.0));
        let v: f64 = num.parse().map_err(|_| Error::BadRate(s.into()))?;
        if !(v.is_finite() && v > 0.0) || v * mult < 8_000.0 {
            return Err(Error::BadRate(s.into()));
        }
        Ok(Link::shaped((v * mult) as u64))
    }

    /// How the results name it: `10 Gbit/s (tbf)` or `unshaped veth`.
    pub fn describe(&self) -> String {
        match self.rate {
            None => "unshaped veth".into(),
            Some(b) if b >= 1_000_000_000 => format!("{} Gbit/s (tbf)", b as f64 / 1e9),
            Some(b) => format!("{} Mbit/s (tbf)", b as f64 / 1e6),
        }
    }

    /// The token bucket's depth: 64 KiB, or 50 µs at the rate if more.
    /// A deeper bucket lets a whole message of a few hundred KiB through
    /// at the machine's speed after a pause, which no link does. A
    /// shallower one needs a timer per packet, which this kernel cannot
    /// keep up with at 10 Gbit/s (with 16 KiB, a 1 MiB message took 2.6
    /// times its time on the wire). So a message of up to 64 KiB after a
    /// pause still passes at the machine's speed: shaping binds on larger
    /// messages and on traffic back to back.
    pub fn burst(bits: u64) -> u64 {
        (bits / 8 / 20_000).max(64 << 10)
    }
}

fn open_namespace(name: &str) -> Result<File, Error> {
    Ok(File::open(format!("/run/netns/{name}"))?)
}

/// Makes `cmd` run in the host whose namespace is `name` (one of
/// [`Hosts::namespaces`]): for a command made where the [`Hosts`] cannot
/// be reached.
pub fn place(name: &str, cmd: &mut Command) -> Result<(), Error> {
    dm_sys::netns::command_in(cmd, open_namespace(name)?);
    Ok(())
}

/// Hosts made by this process so far (in names, with the pid).
static MADE: AtomicU32 = AtomicU32::new(0);

/// `n` hosts joined by a switch (see the crate docs). Removed on drop.
#[derive(Debug)]
pub struct Hosts {
    hosts: Vec<String>,
    switch: String,
    link: Link,
}

impl Hosts {
    /// Whether hosts can be made here: root, with `ip` and `tc`.
    pub fn available() -> Result<(), Error> {
        if !dm_sys::proc::is_root() {
            return Err(Error::Unavailable("needs root (ip netns)".into()));
        }
        for tool in ["ip", "tc"] {
            let ok = Command::new(tool)
                .arg("-V")
                .output()
                .is_ok_and(|o| o.status.success());
            if !ok {
                return Err(Error::Unavailable(format!(
                    "`{tool}` is missing (iproute2: scripts/deps.sh installs it)"
                )));
            }
        }
        Ok(())
    }

    /// Makes `n` hosts (1 to 200) whose links are `link`.
    pub fn up(n: usize, link: Link) -> Result<Hosts, Error> {
        Hosts::available()?;
        if n == 0 || n > 200 {
            return Err(Error::NoHost(n, 200));
        }
        sweep_stale();
        let tag = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        );
        let mut h = Hosts {
            hosts: Vec::new(),
            switch: format!("{tag}-sw"),
            link,
        };
        // From here on, a failure removes what was made (drop).
        run("ip", &["netns", "add", &h.switch])?;
        let sw = h.switch.clone();
        run("ip", &["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = format!("{tag}-{i}");
            run("ip", &["netns", "add", &ns])?;
            h.hosts.push(ns.clone());
            let port = format!("p{i}");
            run(
                "ip",
                &[
                    "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                    "netns", &sw,
                ],
            )?;
            // Jumbo frames, as datacenter links have: tbf passes 9 KB
            // packets at 10 Gbit/s with a 64 KiB bucket (at 1500 bytes a
            // 1 MiB message took twice its time on the wire here).
            run("ip", &["-n", &ns, "link", "set", "eth0", "mtu", "9000"])?;
            run("ip", &["-n", &sw, "link", "set", &port, "mtu", "9000"])?;
            run("ip", &["-n", &sw, "link", "set", &port, "master", "br0"])?;
            run("ip", &["-n", &sw, "link", "set", &port, "up"])?;
            let addr = format!("{}/24", h.addr(i)?);
            run("ip", &["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
            run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            if let Some(bits) = link.rate {
                let (rate, burst) = (format!("{bits}bit"), format!("{}b", Link::burst(bits)));
                for (ns, dev) in [(&ns, "eth0"), (&sw, port.as_str())] {
                    run(
                        "tc",
                        &[
                            "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate,
                            "burst", &burst, "latency", "10ms",
                        ],
                    )?;
                }
            }
        }
        Ok(h)
    }

    /// How many hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are none (never, once made).
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Their link.
    pub fn link(&self) -> Link {
        self.link
    }

    /// Host `i`'s namespace name (`ip netns exec NAME ...`).
    pub fn name(&self, i: usize) -> Result<&str, Error> {
        self.hosts
            .get(i)
            .map(String::as_str)
            .ok_or(Error::NoHost(i, self.hosts.len()))
    }

    /// Host `i`'s address: `10.99.0.(i+1)`.
    pub fn addr(&self, i: usize) -> Result<Ipv4Addr, Error> {
        // (While `up` adds hosts, the next one's address is asked too.)
        if i > self.hosts.len() || i >= 254 {
            return Err(Error::NoHost(i, self.hosts.len()));
        }
        Ok(Ipv4Addr::new(10, 99, 0, i as u8 + 1))
    }

    /// Every namespace of these hosts: the hosts', then the switch's.
    pub fn namespaces(&self) -> Vec<String> {
        let mut v = self.hosts.clone();
        v.push(self.switch.clone());
        v
    }

    fn open(&self, i: usize) -> Result<File, Error> {
        open_namespace(self.name(i)?)
    }

    /// A command that runs `program` in host `i`.
    pub fn command(
        &self,
        i: usize,
        program: impl AsRef<std::ffi::OsStr>,
    ) -> Result<Command, Error> {
        let ns = self.open(i)?;
        let mut c = Command::new(program);
        dm_sys::netns::command_in(&mut c, ns);
        Ok(c)
    }

    /// Moves the calling thread into host `i`: its sockets and the
    /// threads it starts from then on are that host's.
    pub fn enter(&self, i: usize) -> Result<(), Error> {
        Ok(dm_sys::netns::enter(&self.open(i)?)?)
    }

    /// Removes the hosts (as drop does), saying what failed.
    pub fn down(mut self) -> Result<(), Error> {
        self.remove()
    }

    fn remove(&mut self) -> Result<(), Error> {
        let mut first = None;
        // The switch last: removing a namespace removes its veth ends.
        for ns in self
            .hosts
            .drain(..)
            .chain(std::iter::once(self.switch.clone()))
        {
            if let Err(e) = run("ip", &["netns", "del", &ns]) {
                first.get_or_insert(e);
            }
        }
        self.switch.clear();
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if !self.switch.is_empty() {
            let _ = self.remove();
        }
    }
}

/// Runs an iproute2 command.
fn run(tool: &str, args: &[&str]) -> Result<(), Error> {
    let out = Command::new(tool).args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            cmd: format!("{tool} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// The namespaces of this crate that exist now.
pub fn existing() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(PREFIX))
                .collect()
        })
        .unwrap_or_default()
}

/// Removes the namespaces of processes that are gone (killed before
/// their hosts dropped).
pub fn sweep_stale() {
    for ns in existing() {
        let pid = ns[PREFIX.len()..]
            .split('-')
            .next()
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !dm_sys::proc::pid_alive(p)) {
            let _ = run("ip", &["netns", "del", &ns]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_as_tc_writes_them() {
        assert_eq!(Link::parse("10gbit").unwrap().rate, Some(10_000_000_000));
        assert_eq!(Link::parse("25Gbit").unwrap().rate, Some(25_000_000_000));
        assert_eq!(Link::parse("800mbit").unwrap().rate, Some(800_000_000));
        assert_eq!(Link::parse("2.5gbit").unwrap().rate, Some(2_500_000_000));
        assert_eq!(Link::parse("none").unwrap().rate, None);
        for bad in ["", "gbit", "-1gbit", "10 apples", "nan", "1bit"] {
            assert!(Link::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Link::shaped(10_000_000_000).describe(), "10 Gbit/s (tbf)");
        assert_eq!(Link::burst(10_000_000_000), 64 << 10);
        assert_eq!(Link::burst(100_000_000_000), 625_000);
    }
}
