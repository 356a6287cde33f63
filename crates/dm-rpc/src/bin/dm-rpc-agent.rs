//! A service or client process for the multi-process tests and the demo's
//! smoke checks.
//!
//! ```text
//! dm-rpc-agent POOL serve NAME [--next NAME] [--fan NAME,NAME..] [--lease MS] [--tcp] [--replica]
//!                             [--wait-name MS]
//!     methods: hop   — forwards the payload by Ref to --next (or to every
//!                      --fan service) and answers theirs; without either,
//!                      answers hash (8) | pid (4) | in_pool (1) | Ref (40?)
//!              sleep — sleeps the u64 ms in the payload, answers empty
//!              wait  — forwards the payload to --next's wait (its caller's
//!                      deadline inherited); without --next, sleep
//!              items — a stream: N items (u32 N | u32 LEN | u32 MS in the
//!                      payload) of LEN pattern bytes, item k's first byte
//!                      k, one every MS ms
//!     registered as one replica of NAME with --replica;
//!     waits up to MS for a name a live process holds with --wait-name;
//!     prints "ready" once registered, or "err STATUS MESSAGE" and exits
//!     with 1 if it cannot serve; stops cleanly when stdin closes, or
//!     gracefully on a line "drain" (then prints "drained")
//! dm-rpc-agent POOL call NAME METHOD LEN
//!     one call with LEN pattern bytes (or, for sleep, LEN ms); prints
//!     "calling" before and "ok N" / "err STATUS" after
//! dm-rpc-agent POOL stream NAME N LEN
//!     opens the stream of NAME's items (N items of LEN bytes), reads one,
//!     prints "reading", and then reads no more until stdin closes
//! ```
#![allow(clippy::unwrap_used)]

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    agent::main()
}

#[cfg(not(loom))]
mod agent {

    use dm_pool::{AttachOptions, Pool};
    use dm_rpc::{Client, Node, Payload, RpcError};
    use std::io::{BufRead, Write};
    use std::path::Path;
    use std::sync::OnceLock;

    fn hash(p: &Payload) -> Result<u64, RpcError> {
        Ok(p.segments()?
            .iter()
            .flat_map(|s| s.iter())
            .fold(0u64, |a, &b| a.wrapping_mul(31).wrapping_add(b as u64)))
    }

    fn arg_after(args: &[String], flag: &str) -> Option<String> {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().collect();
        if args.len() < 4 {
            eprintln!("usage: dm-rpc-agent POOL serve NAME [..] | POOL call NAME METHOD LEN");
            std::process::exit(2);
        }
        let lease = arg_after(&args, "--lease").map(|s| s.parse().unwrap());
        let pool = Pool::open(
            Path::new(&args[1]),
            AttachOptions {
                lease_ms: lease,
                name: Some("dm-rpc-agent".into()),
                ..Default::default()
            },
        )
        .unwrap();
        let node = Node::new(pool);
        match args[2].as_str() {
            "serve" => serve(&node, &args),
            "call" => call(&node, &args),
            "stream" => stream(&node, &args),
            "many" => many(&node, &args),
            other => {
                eprintln!("unknown mode {other}");
                std::process::exit(2);
            }
        }
    }

    fn serve(node: &Node, args: &[String]) {
        let name = args[3].clone();
        let next: Vec<String> = match (arg_after(args, "--next"), arg_after(args, "--fan")) {
            (Some(n), _) => vec![n],
            (None, Some(f)) => f.split(',').map(str::to_owned).collect(),
            (None, None) => Vec::new(),
        };
        let clients: Vec<OnceLock<Client>> = next.iter().map(|_| OnceLock::new()).collect();
        let n = node.clone();
        let (wait_next, wait_client, wn) = (next.first().cloned(), OnceLock::new(), node.clone());
        let transport = if args.iter().any(|a| a == "--tcp") {
            dm_rpc::Transport::Tcp("127.0.0.1:0".into())
        } else {
            dm_rpc::Transport::Shm
        };
        let mut builder = node.server(&name).transport(transport);
        if args.iter().any(|a| a == "--replica") {
            builder = builder.replica();
        }
        if let Some(ms) = arg_after(args, "--wait-name") {
            builder = builder.wait_for_name(std::time::Duration::from_millis(ms.parse().unwrap()));
        }
        let server = builder
            .method("hop", move |c| {
                if next.is_empty() {
                    let p = c.payload();
                    let mut out = hash(p)?.to_le_bytes().to_vec();
                    out.extend_from_slice(&std::process::id().to_le_bytes());
                    out.push(p.in_pool() as u8);
                    if let Some(r) = p.as_ref_handle() {
                        out.extend_from_slice(&r.to_bytes());
                    }
                    return Ok(Payload::from_vec(out));
                }
                let mut answers = Vec::new();
                std::thread::scope(|s| {
                    let hs: Vec<_> = next
                        .iter()
                        .zip(&clients)
                        .map(|(to, cl)| {
                            let fwd = c.payload().forward();
                            let n = &n;
                            s.spawn(move || {
                                let cl = match cl.get() {
                                    Some(cl) => cl,
                                    None => {
                                        let _ = cl.set(n.connect(to)?);
                                        cl.get().ok_or_else(|| RpcError::internal("client"))?
                                    }
                                };
                                cl.call("hop", fwd?)?.to_vec()
                            })
                        })
                        .collect();
                    for h in hs {
                        answers.push(
                            h.join()
                                .unwrap_or_else(|_| Err(RpcError::internal("panic"))),
                        );
                    }
                });
                let mut out = Vec::new();
                for a in answers {
                    out.extend_from_slice(&a?);
                }
                Ok(Payload::from_vec(out))
            })
            .method("sleep", |c| sleep(c.payload()))
            // How many `items` and `items_async` streams run now.
            .method("streams", |_| {
                let n = RUNNING.load(std::sync::atomic::Ordering::SeqCst);
                Ok(Payload::from_vec(n.to_le_bytes().to_vec()))
            })
            .method_stream("items", |c, sink| {
                let _running = Running::new();
                let (n, len, ms) = items_args(c.payload())?;
                for k in 0..n {
                    if ms > 0 {
                        std::thread::sleep(std::time::Duration::from_millis(ms.into()));
                    }
                    sink.send(item(k, len))?;
                }
                Ok(())
            })
            .method_stream_async("items_async", |c, mut sink| async move {
                let _running = Running::new();
                let (n, len, ms) = items_args(&c.payload)?;
                for k in 0..n {
                    if ms > 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(ms.into())).await;
                    }
                    sink.send(item(k, len)).await?;
                }
                Ok(())
            })
            .method("wait", move |c| {
                let Some(to) = &wait_next else {
                    return sleep(c.payload());
                };
                if wait_client.get().is_none() {
                    let _ = wait_client.set(wn.connect(to)?);
                }
                let cl: &Client = wait_client
                    .get()
                    .ok_or_else(|| RpcError::internal("client"))?;
                cl.call("wait", c.payload().forward()?)
            })
            .spawn();
        let server = match server {
            Ok(s) => s,
            Err(e) => {
                println!("err {:?} {}", e.status, e.message);
                std::process::exit(1);
            }
        };
        println!("ready");
        std::io::stdout().flush().unwrap();
        // Serve until the parent closes stdin, or says "drain".
        for line in std::io::stdin().lock().lines() {
            if line.is_ok_and(|l| l.trim() == "drain") {
                server.shutdown_gracefully(std::time::Duration::from_secs(20));
                println!("drained");
                std::io::stdout().flush().unwrap();
                return;
            }
        }
        server.shutdown();
    }

    /// Sleeps the u64 ms in `p`.
    fn sleep(p: &Payload) -> Result<Payload, RpcError> {
        let b = p.to_vec()?;
        let ms = u64::from_le_bytes(
            b.try_into()
                .map_err(|_| RpcError::invalid_argument("u64 ms"))?,
        );
        std::thread::sleep(std::time::Duration::from_millis(ms));
        Ok(Payload::empty())
    }

    /// Streams of `items` and `items_async` running.
    static RUNNING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    /// Counts a stream in `RUNNING` while it lives (an async handler's
    /// future dropped, or a handler that returned).
    struct Running;

    impl Running {
        fn new() -> Self {
            RUNNING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Running
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            RUNNING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// The argument of `items` and `items_async`: `u32 N | u32 LEN | u32 MS`.
    fn items_args(p: &Payload) -> Result<(u32, usize, u32), RpcError> {
        let a = p.to_vec()?;
        let word = |i: usize| {
            a.get(i * 4..i * 4 + 4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .ok_or_else(|| RpcError::invalid_argument("u32 N | u32 LEN | u32 MS"))
        };
        Ok((word(0)?, word(1)? as usize, word(2)?))
    }

    /// Item `k` of `len` bytes: k, then 1, 2, 3...
    fn item(k: u32, len: usize) -> Vec<u8> {
        let mut item: Vec<u8> = (0..len).map(|i| i as u8).collect();
        if let Some(b) = item.first_mut() {
            *b = k as u8;
        }
        item
    }

    /// `stream NAME N LEN [--method M]`: opens stream M (default
    /// `items`), reads one item, says "reading" and reads no more.
    fn stream(node: &Node, args: &[String]) {
        let (name, n, len) = (
            &args[3],
            args[4].parse::<u32>().unwrap(),
            args[5].parse::<u32>().unwrap(),
        );
        let method = arg_after(args, "--method").unwrap_or_else(|| "items".into());
        let c = node.connect(name).unwrap();
        let mut arg = n.to_le_bytes().to_vec();
        arg.extend_from_slice(&len.to_le_bytes());
        arg.extend_from_slice(&0u32.to_le_bytes());
        let mut st = c.call_stream(&method, arg).unwrap();
        st.next().unwrap().unwrap();
        println!("reading");
        std::io::stdout().flush().unwrap();
        for _ in std::io::stdin().lock().lines() {}
    }

    /// `many NAME CONNS METHOD`: opens CONNS connections to NAME (a
    /// channel each), says "connected", then calls METHOD (with an 8-byte
    /// argument) on each in turn until stdin closes, and exits.
    fn many(node: &Node, args: &[String]) {
        let (name, conns, method) = (&args[3], args[4].parse::<usize>().unwrap(), &args[5]);
        let clients: Vec<Client> = (0..conns).map(|_| node.connect(name).unwrap()).collect();
        std::thread::spawn(|| {
            for _ in std::io::stdin().lock().lines() {}
            std::process::exit(0);
        });
        println!("connected {}", clients.len());
        std::io::stdout().flush().unwrap();
        loop {
            for c in &clients {
                let _ = c.call(method, Payload::from_vec(vec![0; 8]));
            }
        }
    }

    fn call(node: &Node, args: &[String]) {
        let (name, method, len) = (&args[3], &args[4], args[5].parse::<usize>().unwrap());
        let c = node.connect(name).unwrap();
        let payload = if method == "sleep" {
            Payload::from_vec((len as u64).to_le_bytes().to_vec())
        } else {
            Payload::from_vec((0..len).map(|i| i as u8).collect())
        };
        println!("calling");
        std::io::stdout().flush().unwrap();
        match c.call(method, payload) {
            Ok(p) => println!("ok {}", p.len()),
            Err(e) => println!("err {:?}", e.status),
        }
    }
}
