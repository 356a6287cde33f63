//! The `dmrpc` command-line tool. Subcommands live in `cmd/` (pool
//! management, `ls`, `call`, the demo, the memory server) and `bench/`
//! (benchmarks against baselines).

mod bench;
mod cmd;

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
    /// A client, a load balancer and two workers as processes: by Ref vs by value.
    Demo(cmd::demo::DemoArgs),
    /// List the services registered in a pool.
    Ls(cmd::ls::LsArgs),
    /// Call a method of a service and print its answer.
    Call(cmd::call::CallArgs),
    /// Serve disaggregated memory over TCP (a memory server, DmRPC-net).
    Memserver(cmd::memserver::MemserverArgs),
    /// Run a benchmark against its baseline (see BENCHMARKS.md).
    Bench(bench::BenchArgs),
    #[command(name = "__demo-service", hide = true)]
    DemoService(cmd::demo::ServiceArgs),
    #[command(name = "__bench-peer", hide = true)]
    BenchPeer(bench::PeerArgs),
}

fn main() {
    // Large inline payloads are allocated and freed per call: keep their
    // memory mapped (see `dm_sys::malloc`). Before any thread starts.
    dm_sys::malloc::keep_large_buffers();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Pool(c) => cmd::pool::run(c),
        Cmd::Demo(a) => cmd::demo::run(a),
        Cmd::Ls(a) => cmd::ls::run(a),
        Cmd::Call(a) => match cmd::call::run(a) {
            Ok(0) => Ok(()),
            Ok(code) => std::process::exit(code),
            Err(e) => Err(e),
        },
        Cmd::Memserver(a) => cmd::memserver::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::DemoService(a) => cmd::demo::service(a),
        Cmd::BenchPeer(a) => bench::peer(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
}
