//! A first dmrpc program: a service in one process, its client in
//! another, both attached to one pool under /dev/shm.
//!
//! ```sh
//! cargo run --release -p dm-rpc --example hello
//! ```
//!
//! The client (this process) creates the pool and starts the service (this
//! program again, with `serve POOL`). It then calls the service four ways:
//!
//! * a small argument, which travels inline in the frame;
//! * a 4 MiB argument built in the pool, where only a 40-byte Ref travels;
//!   the service reads it in place, with no copy;
//! * the same, keeping the buffer (`dup`): a later write copies the page
//!   it writes, and the service never sees it;
//! * a method the service does not have, which fails with `NotFound`;
//! * a call whose deadline passes, which fails with `DeadlineExceeded`.
//!
//! Then it stops the service, checks that the pool is clean and removes
//! it.

use dm_pool::{AttachOptions, Pool, PoolConfig};
use dm_rpc::{CallOptions, Node, Payload, RpcError, Status};
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SERVICE: &str = "hello/greeter";

type Res<T> = Result<T, Box<dyn Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("serve") => serve(Path::new(&args[2])),
        _ => client(),
    }
}

/// The service's process: registers `hello/greeter`, says "ready" and
/// serves until its stdin closes.
fn serve(path: &Path) -> Res<()> {
    let node = Node::new(Pool::open(path, AttachOptions::default())?);
    let server = node
        .server(SERVICE)
        .method("greet", |call| {
            let name = call.payload().to_vec()?;
            let name = std::str::from_utf8(&name)
                .map_err(|_| RpcError::invalid_argument("the name is not UTF-8"))?;
            Ok(Payload::from_vec(format!("hello, {name}").into_bytes()))
        })
        .method("sum", |call| {
            // Inline bytes or a Ref mapped from the pool: the same segments.
            let p = call.payload();
            let mut sum = 0u64;
            for s in p.segments()? {
                sum += s.iter().map(|&b| u64::from(b)).sum::<u64>();
            }
            Ok(Payload::from_vec(sum.to_le_bytes().to_vec()))
        })
        .method("slow", |_| {
            std::thread::sleep(Duration::from_millis(200));
            Ok(Payload::empty())
        })
        .spawn()?;
    println!("ready");
    for _ in std::io::stdin().lock().lines() {}
    server.shutdown_gracefully(Duration::from_secs(1));
    Ok(())
}

/// The client's process: makes the pool, starts the service, calls it.
fn client() -> Res<()> {
    let path = format!("/dev/shm/dmrpc-hello-{}.pool", std::process::id());
    let path = Path::new(&path);
    Pool::create(
        path,
        &PoolConfig {
            size: 256 << 20,
            ..Default::default()
        },
    )?;
    let out = run_client(path);
    // Whatever happened, the pool file goes (the service has ended: see
    // `Service`).
    let gone = Pool::destroy(path);
    out.and(gone.map_err(Into::into))
}

/// The service's process, stopped when this is dropped: its stdin closes,
/// so it shuts down gracefully and exits.
struct Service(std::process::Child);

impl Drop for Service {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

fn run_client(path: &Path) -> Res<()> {
    let mut service = Service(
        Command::new(std::env::current_exe()?)
            .arg("serve")
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?,
    );
    let mut line = String::new();
    if let Some(out) = service.0.stdout.take() {
        BufReader::new(out).read_line(&mut line)?;
    }
    if line.trim() != "ready" {
        return Err("the service did not start".into());
    }

    let node = Node::new(Pool::open(path, AttachOptions::default())?);
    let client = node.connect(SERVICE)?;

    // 1. A small argument: inline in the frame.
    let answer = client.call("greet", Payload::from_vec(b"world".to_vec()))?;
    println!(
        "greet:  {:?} (the argument went inline)",
        String::from_utf8(answer.to_vec()?)?
    );

    // 2. A large argument, written once into the pool: a Ref travels, the
    //    service reads the pages in place, and the Ref is released when
    //    the call completes. (Timed with the write into the pool.)
    let data: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
    let want = data.iter().map(|&b| u64::from(b)).sum::<u64>();
    let mut took = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let mut buf = node.pool().alloc(data.len() as u64)?;
        buf.write(0, &data)?;
        let answer = client.call("sum", buf)?;
        took.push(t.elapsed().as_secs_f64() * 1e6);
        let sum = u64::from_le_bytes(answer.to_vec()?.as_slice().try_into()?);
        if sum != want {
            return Err(format!("wrong sum: {sum}, not {want}").into());
        }
    }
    println!(
        "sum:    {want} over 4 MiB by Ref: {:.0} µs the first time (fresh pool pages), \
         {:.0} µs the third",
        took[0], took[2]
    );

    // 3. Send a buffer and keep it: `dup` gives the call the same pages
    //    (one more share each, no copy). A write here afterwards copies
    //    the page it writes, so the service only sees what was sent.
    let mut kept = node.pool().alloc(data.len() as u64)?;
    kept.write(0, &data)?;
    let answer = client.call("sum", kept.dup()?)?;
    kept.write(0, &[0; 4096])?;
    let sum = u64::from_le_bytes(answer.to_vec()?.as_slice().try_into()?);
    if sum != want || kept.to_vec()?[..4096] != [0; 4096] {
        return Err("the kept buffer and the call's copy are not apart".into());
    }
    println!(
        "kept:   the caller wrote its buffer after sending it; the service summed what was sent"
    );

    // 4. No such method: a typed status, not a hang.
    match client.call("nope", Payload::empty()) {
        Err(e) if e.status == Status::NotFound => println!("nope:   {e}"),
        other => return Err(format!("expected NotFound, got {other:?}").into()),
    }

    // 5. A deadline: the call gives up after 20 ms.
    let opts = CallOptions::deadline(Duration::from_millis(20));
    match client.call_with("slow", Payload::empty(), opts) {
        Err(e) if e.status == Status::DeadlineExceeded => println!("slow:   {e}"),
        other => return Err(format!("expected DeadlineExceeded, got {other:?}").into()),
    }

    // Stop the service (it finishes what it took), then check the pool:
    // every page free, no channel or service left.
    drop((client, kept));
    drop(service);
    drop(node);
    let report = dm_pool::check_path(path, true)?;
    if !report.ok() {
        return Err(format!("pool check: {:?}", report.problems).into());
    }
    println!(
        "pool check --deep: ok ({} pages held, {} services, {} channels left)",
        report.pages_held, report.services, report.channels
    );
    Ok(())
}
