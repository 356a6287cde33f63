//! `dmrpc ns ...`: namespaces of one device or large file (DirectCXL),
//! each a region with its own pool, listed in the device's segment table.

use super::pool::PoolOptions;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use dm_pool::namespace;
use dmrpc::{fmt_size, parse_size};
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum NsCmd {
    /// Create namespace NAME on DEVICE with a pool of --size inside
    /// (DEVICE/NAME then opens it wherever a pool path is taken).
    Create {
        /// The device (a DAX device) or file that holds the namespaces.
        device: PathBuf,
        /// The namespace's name (letters, digits, '.', '_', '-').
        name: String,
        /// Format DEVICE for namespaces first if it holds no segment
        /// table: a file that does not exist is created with this length
        /// (sparse); a device must start with zeros.
        #[arg(long, value_parser = parse_size)]
        device_size: Option<u64>,
        #[command(flatten)]
        opts: PoolOptions,
    },
    /// List DEVICE's namespaces: where each lies, and how many processes
    /// are attached.
    Ls {
        /// The device or file.
        device: PathBuf,
    },
    /// Show one namespace and the pool inside it.
    Info {
        /// The device or file.
        device: PathBuf,
        /// The namespace.
        name: String,
    },
    /// Remove a namespace (refused while a process is attached to it).
    Rm {
        /// The device or file.
        device: PathBuf,
        /// The namespace.
        name: String,
    },
}

pub fn run(cmd: NsCmd) -> Result<()> {
    match cmd {
        NsCmd::Create {
            device,
            name,
            device_size,
            opts,
        } => {
            if device_size.is_none() && std::fs::symlink_metadata(&device).is_err() {
                bail!(
                    "there is no device or file {}: give --device-size to create a file of that \
                     length for namespaces",
                    device.display()
                );
            }
            if let Some(len) = device_size {
                namespace::format(&device, len, opts.config(&name)?.group)
                    .with_context(|| format!("formatting {}", device.display()))?;
            }
            let ns = namespace::create(&device, &name, &opts.config(&name)?)
                .with_context(|| format!("creating namespace {name:?} on {}", device.display()))?;
            println!(
                "created namespace {name:?} on {} at offset {} ({}); its pool: {}",
                device.display(),
                ns.offset,
                fmt_size(ns.size),
                ns.path().display()
            );
        }
        NsCmd::Ls { device } => {
            let all = namespace::list(&device)
                .with_context(|| format!("reading the segment table of {}", device.display()))?;
            let len = namespace::device_len(&device)?;
            let used: u64 = all.iter().map(|n| n.size).sum();
            println!(
                "{}: {} of namespaces, {} used, {} namespace(s) of at most {}",
                device.display(),
                fmt_size(len - namespace::TABLE_LEN),
                fmt_size(used),
                all.len(),
                namespace::MAX_ENTRIES
            );
            if !all.is_empty() {
                println!(
                    "{:<24} {:<9} {:>14} {:>10} {:>5} {:>8}",
                    "NAME", "STATE", "OFFSET", "SIZE", "REFS", "OWNER"
                );
            }
            for n in all {
                println!(
                    "{:<24} {:<9} {:>14} {:>10} {:>5} {:>8}",
                    n.name,
                    n.state.as_str(),
                    n.offset,
                    fmt_size(n.size),
                    n.refs,
                    n.owner_pid
                );
            }
        }
        NsCmd::Info { device, name } => {
            let n = namespace::info(&device, &name)?;
            println!("namespace   {:?}", n.name);
            println!("device      {}", device.display());
            println!("pool path   {}", n.path().display());
            println!("state       {}", n.state.as_str());
            println!(
                "region      {} +{} ({})",
                n.offset,
                n.size,
                fmt_size(n.size)
            );
            println!("attached    {} process(es)", n.refs);
            let age = dm_sys::time::now_ms().saturating_sub(n.created_ms) / 1000;
            println!(
                "created     by pid {} (uid {}), {age} s ago",
                n.owner_pid, n.owner_uid
            );
            println!("generation  {:#018x}", n.generation);
            if n.state == namespace::State::Ready {
                let l = dm_pool::layout_of(&n.path())?;
                println!(
                    "pool        {} data pages of {}, {} slots",
                    l.n_pages,
                    fmt_size(u64::from(l.page_size)),
                    l.n_slots
                );
            }
        }
        NsCmd::Rm { device, name } => {
            namespace::remove(&device, &name)
                .with_context(|| format!("removing namespace {name:?} of {}", device.display()))?;
            println!("removed namespace {name:?} of {}", device.display());
        }
    }
    Ok(())
}
