//! Where the network variants' processes run: all on loopback, or each on
//! a host of its own (a network namespace, `dm-netns`) whose link is
//! shaped to a datacenter link's rate.
//!
//! A benchmark asks a [`Net`] for its peers, its memory server and a
//! thread for its client, by host index; on loopback every index is the
//! same machine. A peer learns the address to listen on from
//! `DMRPC_BENCH_LISTEN` (`net::listen_ip`).

use super::net::{start_memserver_cmd, Proc, LISTEN_ENV};
use super::peer::Peer;
use anyhow::{Context, Result};
use dm_netns::{Hosts, Link};
use std::path::Path;
use std::process::Command;

/// The links the network variants run over (`--links`): `loopback`, or
/// a rate as `tc` writes it (`10gbit`).
pub fn links(a: &super::BenchArgs) -> Vec<String> {
    match &a.links {
        Some(l) => l.split(',').map(|s| s.trim().to_owned()).collect(),
        None if a.quick => vec!["loopback".into()],
        None => vec!["loopback".into(), "10gbit".into()],
    }
}

/// Loopback, or hosts on shaped links.
#[derive(Debug)]
pub struct Net {
    hosts: Option<Hosts>,
    /// Between hosts: the memory servers' admin key (its file, and the
    /// key), so the benchmark's clients may run their check.
    admin: Option<(std::path::PathBuf, dm_pool::auth::Key)>,
}

impl Drop for Net {
    fn drop(&mut self) {
        if let Some((f, _)) = &self.admin {
            let _ = std::fs::remove_file(f);
        }
    }
}

impl Net {
    /// `link` (`loopback` or a rate) for `n` hosts. `Ok(None)` where
    /// hosts cannot be made here (not root, no iproute2): said on stderr.
    pub fn new(link: &str, n: usize) -> Result<Option<Net>> {
        if link == "loopback" {
            return Ok(Some(Net {
                hosts: None,
                admin: None,
            }));
        }
        let link = Link::parse(link)?;
        if let Err(e) = Hosts::available() {
            eprintln!("skipping the {} link: {e}", link.describe());
            return Ok(None);
        }
        let file =
            std::env::temp_dir().join(format!("dmrpc-bench-admin-{}.key", std::process::id()));
        let key = dm_pool::auth::Key::generate_file(&file)?;
        Ok(Some(Net {
            hosts: Some(Hosts::up(n, link)?),
            admin: Some((file, key)),
        }))
    }

    /// How the results name the link.
    pub fn describe(&self) -> String {
        self.hosts
            .as_ref()
            .map_or_else(|| "loopback".into(), |h| h.link().describe())
    }

    /// Whether this is loopback.
    pub fn is_loopback(&self) -> bool {
        self.hosts.is_none()
    }

    /// Host `i`'s address.
    pub fn ip(&self, i: usize) -> Result<String> {
        Ok(match &self.hosts {
            None => "127.0.0.1".into(),
            Some(h) => h.addr(i)?.to_string(),
        })
    }

    /// A command running `program` on host `i`.
    fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        let mut c = match &self.hosts {
            None => Command::new(program),
            Some(h) => h.command(i, program)?,
        };
        c.env(LISTEN_ENV, self.ip(i)?);
        Ok(c)
    }

    /// A bench peer on host `i`, attached to the pool at `path`.
    pub fn peer(&self, i: usize, path: &Path) -> Result<Peer> {
        Peer::spawn_cmd(self.command(i, std::env::current_exe()?)?, path)
    }

    /// A memory server on host `i`, and its address. Beyond loopback it
    /// serves any host of the benchmark without a client key (`--open`),
    /// and the benchmark's clients hold its admin key
    /// ([`client_config`](Self::client_config)).
    ///
    /// One worker thread: the hosts are namespaces of one machine, so the
    /// memory server shares its cores with every client and tier. A
    /// second worker, polling beside them, takes a core from them (on
    /// two cores, a `create_ref` + `map_ref` by two clients took 41 us
    /// with two workers and 21 us with one).
    pub fn memserver(&self, i: usize, size: &str) -> Result<(Proc, String)> {
        let listen = format!("{}:0", self.ip(i)?);
        let mut more = Vec::new();
        if let Some((f, _)) = &self.admin {
            more = vec![
                "--open".to_owned(),
                "--admin-key-file".to_owned(),
                f.display().to_string(),
            ];
        }
        let more: Vec<&str> = more.iter().map(String::as_str).collect();
        start_memserver_cmd(
            self.command(i, std::env::current_exe()?)?,
            &listen,
            size,
            1,
            &more,
        )
    }

    /// How the benchmark's own clients connect to its memory servers.
    pub fn client_config(&self) -> dm_memserver::ClientConfig {
        dm_memserver::ClientConfig {
            admin_key: self.admin.as_ref().map(|(_, k)| *k),
            ..Default::default()
        }
    }

    /// Runs `f` on a thread of host `i` (this process's client there).
    pub fn on<R: Send>(&self, i: usize, f: impl FnOnce() -> Result<R> + Send) -> Result<R> {
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Some(h) = &self.hosts {
                    h.enter(i).context("entering the client's host")?;
                }
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the client thread panicked")))
        })
    }
}
