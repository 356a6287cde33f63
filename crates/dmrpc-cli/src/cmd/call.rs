//! `dmrpc call`: calls a method of a service from the shell (as `grpcurl`
//! does for gRPC), by name through a pool's registry or by TCP address.
//!
//! The argument comes from `--data`, a file or stdin; a large one goes by
//! Ref, written into the pool once (the size-aware rule). The answer's
//! bytes go to stdout as they are (or as hex), what it was to stderr. A
//! failed call prints its typed status and exits with 1 (2: the service
//! could not be reached at all). With `--repeat N` the call is made N
//! times and the latencies are summarised: a quick check of a live
//! service from where its callers run. With `--stream` the method is
//! called as a streaming one: each item's bytes go to stdout as they come
//! (with `--hex`, one block per item), and a summary to stderr. A service
//! that speaks gRPC is called as gRPC (`grpc.rs`): the method is a path,
//! the argument one encoded message.

use super::out::{show_metadata, us, write_bytes};
use super::pool::Target;
use anyhow::{bail, Context, Result};
use clap::Args;
use dm_pool::{AttachOptions, Pool, PoolConfig};
use dm_rpc::{CallOptions, Client, Metadata, Node, Payload};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct CallArgs {
    /// Service name (`shop/images/resize`), looked up in the pool's
    /// registry; with --tcp, any label.
    pub service: String,
    /// Method name.
    pub method: String,
    /// The argument, as text.
    #[arg(long, conflicts_with = "file")]
    pub data: Option<String>,
    /// The argument, read from this file ("-": stdin).
    #[arg(long)]
    pub file: Option<std::path::PathBuf>,
    /// Call the service listening at this TCP address instead of looking
    /// it up (without the pool file, a private pool is made for the call).
    #[arg(long)]
    pub tcp: Option<String>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 10.0)]
    pub timeout: f64,
    /// Wait (within --timeout) for the service to be registered.
    #[arg(long)]
    pub wait_for_ready: bool,
    /// Metadata to send with the call, `KEY=VALUE` (repeatable).
    #[arg(long = "meta", value_name = "KEY=VALUE")]
    pub meta: Vec<String>,
    /// Print the answer as hex instead of its raw bytes.
    #[arg(long)]
    pub hex: bool,
    /// Make the call this many times and print latency percentiles.
    #[arg(long, default_value_t = 1, conflicts_with = "stream")]
    pub repeat: u32,
    /// Call a streaming method: print its items as they come.
    #[arg(long)]
    pub stream: bool,
    /// The pool (default: the pool named "default").
    #[arg(long, default_value = "default")]
    pub pool: String,
    /// The pool's file, instead of its name.
    #[arg(long)]
    pub path: Option<std::path::PathBuf>,
    /// The service's access key file, for a service on TCP that wants one
    /// (default: $DMRPC_KEY_FILE).
    #[arg(long)]
    pub key_file: Option<std::path::PathBuf>,
}

/// What the call ends with: 0 done, 1 the call failed, 2 no connection.
pub fn run(a: CallArgs) -> Result<i32> {
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds");
    }
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let arg = argument(&a)?;
    let mut meta = Metadata::new();
    for kv in &a.meta {
        let Some((k, v)) = kv.split_once('=') else {
            bail!("--meta {kv:?} is not KEY=VALUE");
        };
        meta.insert(k, v)?;
    }
    let target = Target {
        name: a.pool.clone(),
        path: a.path.clone(),
    };
    let path = target.path();
    let opts = AttachOptions {
        name: Some("dmrpc-call".into()),
        ..Default::default()
    };
    // A TCP call needs no shared pool: without one, a private one holds
    // this process's buffers, and goes with it.
    let (pool, private) = match (&a.tcp, path.exists()) {
        (Some(_), false) => {
            let p = std::env::temp_dir().join(format!("dmrpc-call-{}.pool", std::process::id()));
            let cfg = PoolConfig {
                size: 64 << 20,
                ..Default::default()
            };
            let pool = Pool::create(&p, &cfg).and_then(|_| Pool::open(&p, opts));
            (
                pool.with_context(|| format!("making a private pool at {}", p.display()))?,
                Some(p),
            )
        }
        _ => (
            Pool::open(&path, opts).with_context(|| format!("attaching to {}", path.display()))?,
            None,
        ),
    };
    let key_file = a
        .key_file
        .clone()
        .or_else(|| std::env::var_os("DMRPC_KEY_FILE").map(std::path::PathBuf::from));
    let key = key_file.map(dm_pool::auth::Key::from_file).transpose()?;
    let node = Node::with_config(
        pool,
        dm_rpc::Config {
            tcp_key: key,
            ..Default::default()
        },
    );
    let code = call(&a, &node, &arg, &meta);
    drop(node);
    if let Some(p) = private {
        let _ = Pool::destroy(&p);
    }
    code
}

fn argument(a: &CallArgs) -> Result<Vec<u8>> {
    Ok(match (&a.data, &a.file) {
        (Some(d), _) => d.as_bytes().to_vec(),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut b = Vec::new();
            std::io::stdin()
                .read_to_end(&mut b)
                .context("reading stdin")?;
            b
        }
        (None, Some(f)) => std::fs::read(f).with_context(|| format!("reading {}", f.display()))?,
        (None, None) => Vec::new(),
    })
}

fn call(a: &CallArgs, node: &Node, arg: &[u8], meta: &Metadata) -> Result<i32> {
    // A service that speaks gRPC is called with gRPC's framing.
    let grpc = matches!(
        node.pool().lookup(&a.service),
        Ok(Some(s)) if s.protocol == dm_pool::Protocol::Grpc
    );
    if a.tcp.is_none() && grpc {
        let how = super::grpc::How {
            service: &a.service,
            method: &a.method,
            timeout: Duration::from_secs_f64(a.timeout),
            repeat: a.repeat,
            hex: a.hex,
        };
        return super::grpc::call(&how, node, arg, meta);
    }
    let connected = match &a.tcp {
        Some(addr) => node.connect_tcp(addr),
        None if a.wait_for_ready => node.connect_lazily(&a.service),
        None => node.connect(&a.service),
    };
    let client = match connected {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "cannot reach {}: {e}",
                a.tcp.as_deref().unwrap_or(&a.service)
            );
            return Ok(2);
        }
    };
    let mut opts = CallOptions::deadline(Duration::from_secs_f64(a.timeout));
    if a.wait_for_ready {
        opts = opts.wait_for_ready();
    }
    if a.stream {
        return stream(a, &client, node, (arg, meta), opts);
    }
    let mut took = Vec::with_capacity(a.repeat as usize);
    let mut last = None;
    for _ in 0..a.repeat {
        let t0 = Instant::now();
        match once(&client, node, (&a.method, arg, meta), opts) {
            Ok(p) => {
                took.push(t0.elapsed());
                last = Some(p);
            }
            Err(e) => {
                show_metadata(&e.metadata);
                eprintln!("{} {}: {e}", a.service, a.method);
                return Ok(1);
            }
        }
    }
    let Some(dm_rpc::Reply {
        payload: answer,
        metadata,
    }) = last
    else {
        return Ok(1);
    };
    show_metadata(&metadata);
    let how = if answer.in_pool() { "by Ref" } else { "inline" };
    let bytes = answer.to_vec()?;
    let mut out = std::io::stdout().lock();
    write_bytes(&mut out, &bytes, a.hex)?;
    took.sort();
    let pct = |q: f64| took[((took.len() - 1) as f64 * q).round() as usize];
    if took.len() == 1 {
        eprintln!("ok: {} bytes {how} in {:.1} µs", bytes.len(), us(took[0]));
    } else {
        eprintln!(
            "ok: {} calls, answer {} bytes {how}; p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
            took.len(),
            bytes.len(),
            us(pct(0.5)),
            us(pct(0.99)),
            us(pct(1.0)),
        );
    }
    Ok(0)
}

/// One call of `method` with `arg` (copied once: into the pool when it
/// goes by Ref) and `meta`.
fn once(
    c: &Client,
    node: &Node,
    (method, arg, meta): (&str, &[u8], &Metadata),
    opts: CallOptions,
) -> Result<dm_rpc::Reply, dm_rpc::RpcError> {
    c.call_full(method, argument_payload(node, arg)?, opts, meta.clone())
}

/// `arg` as a call's payload: into the pool when it goes by Ref.
fn argument_payload(node: &Node, arg: &[u8]) -> Result<Payload, dm_rpc::RpcError> {
    Ok(if arg.len() > node.config().inline_max {
        let mut b = node.pool().alloc(arg.len() as u64)?;
        b.write(0, arg)?;
        Payload::from(b)
    } else {
        Payload::from_vec(arg.to_vec())
    })
}

/// Calls streaming method `a.method`, writing each item to stdout as it
/// comes; 1 if the stream ends with an error.
fn stream(
    a: &CallArgs,
    c: &Client,
    node: &Node,
    (arg, meta): (&[u8], &Metadata),
    opts: CallOptions,
) -> Result<i32> {
    let t0 = Instant::now();
    let (mut items, mut bytes, mut by_ref) = (0u64, 0u64, 0u64);
    let mut out = std::io::stdout().lock();
    let opened = argument_payload(node, arg)
        .and_then(|p| c.call_stream_with(&a.method, p, opts, meta.clone()));
    let mut st = match opened {
        Ok(st) => st,
        Err(e) => {
            eprintln!("{} {}: {e}", a.service, a.method);
            return Ok(1);
        }
    };
    for item in st.by_ref() {
        let item = match item {
            Ok(p) => p,
            Err(e) => {
                out.flush()?;
                show_metadata(&e.metadata);
                eprintln!("{} {} after {items} items: {e}", a.service, a.method);
                return Ok(1);
            }
        };
        items += 1;
        by_ref += item.in_pool() as u64;
        let b = item.to_vec()?;
        bytes += b.len() as u64;
        write_bytes(&mut out, &b, a.hex)?;
    }
    show_metadata(st.metadata());
    eprintln!(
        "ok: {items} items, {bytes} bytes ({by_ref} by Ref) in {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(0)
}
