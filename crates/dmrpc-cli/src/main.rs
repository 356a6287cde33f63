//! The `dmrpc` command-line tool. Subcommands live in `cmd/` (pool and
//! namespace management, `ls`, `call`, the demo, the memory server); `bench` runs
//! the `dmrpc-bench` crate (benchmarks against baselines).

mod cmd;

use dmrpc_bench as bench;

use clap::{Parser, Subcommand};

/// dmrpc: RPC for data-intensive services, with large arguments passed by
/// reference through a shared memory pool and page-granular copy-on-write.
///
/// Start with `dmrpc demo`. Pools live under /dev/shm by default
/// (`dmrpc pool create NAME --size 1GiB`); any mmap-able file or DAX device
/// works with --path.
#[derive(Parser, Debug)]
#[command(name = "dmrpc", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Create, inspect, check, collect and destroy memory pools.
    #[command(subcommand)]
    Pool(cmd::pool::PoolCmd),
    /// Namespaces of one device or large file, each with its own pool
    /// (DirectCXL): create, ls, info, rm.
    #[command(subcommand)]
    Ns(cmd::ns::NsCmd),
    /// A client, a load balancer and two workers as processes: by Ref vs by value.
    Demo(cmd::demo::DemoArgs),
    /// List the services registered in a pool (or in etcd: --etcd).
    Ls(cmd::ls::LsArgs),
    /// Call a method of a service and print its answer.
    Call(cmd::call::CallArgs),
    /// Serve disaggregated memory over TCP (a memory server, DmRPC-net).
    Memserver(cmd::memserver::MemserverArgs),
    /// Make and inspect key files (peers over TCP prove they hold one).
    #[command(subcommand)]
    Key(cmd::key::KeyCmd),
    /// Three hosts on this machine (network namespaces), etcd on each,
    /// memory servers, and a chain of replicated services found by name.
    Cluster(cmd::cluster::ClusterArgs),
    /// Run a benchmark against its baseline (see BENCHMARKS.md).
    Bench(bench::BenchArgs),
    #[command(name = "__demo-service", hide = true)]
    DemoService(cmd::demo::ServiceArgs),
    #[command(name = "__cluster-tier", hide = true)]
    ClusterTier(cmd::cluster::TierArgs),
    #[command(name = "__bench-peer", hide = true)]
    BenchPeer(bench::PeerArgs),
}

fn main() {
    // Large inline payloads are allocated and freed per call: keep their
    // memory mapped (see `dm_sys::malloc`). Before any thread starts.
    dm_sys::malloc::keep_large_buffers();
    let cli = Cli::parse();
    if matches!(
        cli.cmd,
        Cmd::Pool(_) | Cmd::Ns(_) | Cmd::Ls(_) | Cmd::Key(_)
    ) {
        // Commands that only print end quietly when their reader goes
        // (`dmrpc pool info | head`), as other tools do. The rest keep
        // SIGPIPE ignored: a peer that closes a socket is an error there.
        // SAFETY: before any thread starts; SIG_DFL is a valid disposition.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let r = match cli.cmd {
        Cmd::Pool(c) => cmd::pool::run(c),
        Cmd::Ns(c) => cmd::ns::run(c),
        Cmd::Demo(a) => cmd::demo::run(a),
        Cmd::Ls(a) => cmd::ls::run(a),
        Cmd::Call(a) => match cmd::call::run(a) {
            Ok(0) => Ok(()),
            Ok(code) => std::process::exit(code),
            Err(e) => Err(e),
        },
        Cmd::Memserver(a) => cmd::memserver::run(a),
        Cmd::Key(c) => cmd::key::run(c),
        Cmd::Cluster(a) => cmd::cluster::run(a),
        Cmd::ClusterTier(a) => cmd::cluster::tier(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::DemoService(a) => cmd::demo::service(a),
        Cmd::BenchPeer(a) => bench::peer(a),
    };
    if let Err(e) = r {
        eprintln!("error: {}", chain(&e));
        std::process::exit(2);
    }
}

/// An error and its causes in one line, as `{:#}` prints them, but without
/// a cause whose text the message before it already includes (an error
/// that shows its OS reason and also returns it as its source).
fn chain(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let os = std::io::Error::from(std::io::ErrorKind::NotFound);
        let shown = format!("cannot open /x: {os}");
        // A cause the message shows already...
        #[derive(Debug)]
        struct Shows(String, std::io::Error);
        impl std::fmt::Display for Shows {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl std::error::Error for Shows {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.1)
            }
        }
        let e = anyhow::Error::new(Shows(shown.clone(), os)).context("attaching to /x");
        assert_eq!(chain(&e), format!("attaching to /x: {shown}"));
        // ...and one it does not.
        let e = anyhow::anyhow!("no such file").context("reading /y");
        assert_eq!(chain(&e), "reading /y: no such file");
    }
}
