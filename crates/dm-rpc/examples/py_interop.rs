//! The Rust half of the Python <-> Rust example
//! (`crates/dmrpc-py/examples/rust_interop.py` runs it):
//!
//! ```text
//! py_interop POOL serve NAME   serves `stats`: a little-endian f32 array in,
//!                              [mean, min, max] (3 f32) out; prints "ready",
//!                              serves until stdin closes
//! py_interop POOL call NAME N  calls `scale` of service NAME with N f32s
//!                              (0, 1, 2, ...; by Ref when large) and checks
//!                              that each came back doubled
//! ```
//!
//! Nothing here knows the other side is Python: a service is a name in the
//! pool's registry, and payloads are bytes (read from the pool in place
//! when they arrive by Ref).

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    if let Err(e) = run() {
        eprintln!("py_interop: {e}");
        std::process::exit(1);
    }
}

#[cfg(not(loom))]
fn run() -> Result<(), Box<dyn std::error::Error>> {
    use dm_pool::{AttachOptions, Pool};
    use dm_rpc::{Node, Payload, RpcError};
    use std::io::BufRead;

    let args: Vec<String> = std::env::args().collect();
    let [_, pool, cmd, name, rest @ ..] = args.as_slice() else {
        return Err("usage: py_interop POOL serve NAME | POOL call NAME N".into());
    };
    let node = Node::new(Pool::open(pool.as_ref(), AttachOptions::default())?);
    match cmd.as_str() {
        "serve" => {
            let server = node
                .server(name)
                .method("stats", |call| {
                    let p = call.payload();
                    if p.is_empty() || p.len() % 4 != 0 {
                        return Err(RpcError::invalid_argument("an f32 array, please"));
                    }
                    // The data as it lies in the pool (or the frame): read
                    // in place when its pages are contiguous (else copied
                    // once into one slice).
                    let (mut sum, mut min, mut max, mut n) = (0f64, f32::MAX, f32::MIN, 0u64);
                    let bytes = p.bytes()?;
                    for c in bytes.chunks_exact(4) {
                        let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        sum += x as f64;
                        min = min.min(x);
                        max = max.max(x);
                        n += 1;
                    }
                    let out: Vec<u8> = [(sum / n as f64) as f32, min, max]
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect();
                    Ok(Payload::from_vec(out))
                })
                .spawn()?;
            println!("ready");
            // Serve until our parent closes stdin.
            for _ in std::io::stdin().lock().lines() {}
            server.shutdown();
        }
        "call" => {
            let n: usize = rest.first().ok_or("call needs N")?.parse()?;
            let data: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
            let client = node.connect(name)?;
            let answer = client.call("scale", data)?;
            let got = answer.to_vec()?;
            let ok = got.len() == n * 4
                && got
                    .chunks_exact(4)
                    .enumerate()
                    .all(|(i, c)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) == 2.0 * i as f32);
            if !ok {
                return Err("scale answered something else".into());
            }
            println!(
                "ok: {n} f32s doubled by {name} ({} bytes, the answer came {})",
                got.len(),
                if answer.in_pool() { "by Ref" } else { "inline" }
            );
        }
        _ => return Err(format!("unknown command {cmd:?}").into()),
    }
    Ok(())
}
