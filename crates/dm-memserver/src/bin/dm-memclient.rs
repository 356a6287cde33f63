//! A memory-server client process for the multi-process tests:
//!
//! * `dm-memclient ADDR cow HEXREF` maps the Ref, prints `read SUM`, writes
//!   0xFF over bytes 4096..4196 of its mapping (a CoW copy), prints
//!   `after SUM` (of its mapping), frees it and exits;
//! * `dm-memclient ADDR share LEN` writes LEN bytes, prints `ref HEXREF
//!   SUM`, and releases the Ref when a line arrives on stdin;
//! * `dm-memclient ADDR churn` prints `started`, then allocates, writes,
//!   shares, maps and frees in a loop until killed;
//! * `dm-memclient ADDR check` runs the server's check and prints `ok` or
//!   its problems;
//! * `dm-memclient ADDR release-later` puts 64 KiB, releases the Ref
//!   without waiting (kept to go with the next request), prints `queued`
//!   and sleeps until killed.
//!
//! With `DMRPC_KEY_FILE` set, it proves the key in that file.

use dm_memserver::MemPool;
use dm_pool::{Dm, DmBuffer, Ref};

fn sum(v: &[u8]) -> u64 {
    v.iter().map(|&b| b as u64).sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(addr), Some(cmd)) = (args.get(1), args.get(2)) else {
        return Err("usage: dm-memclient ADDR cow HEXREF | churn".into());
    };
    let cfg = dm_memserver::ClientConfig {
        key: std::env::var_os("DMRPC_KEY_FILE")
            .map(dm_pool::auth::Key::from_file)
            .transpose()?,
        ..Default::default()
    };
    let pool = MemPool::connect_with(&[addr], cfg)?;
    match cmd.as_str() {
        "cow" => {
            let hex = args.get(3).ok_or("cow needs a Ref")?;
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
                .collect::<Result<_, _>>()?;
            let r = Ref::from_bytes(&bytes)?;
            let mut m = pool.map_ref(&r)?;
            println!("read {}", sum(&m.to_vec()?));
            m.write(4096, &[0xFF; 100])?;
            println!("after {}", sum(&m.to_vec()?));
            pool.free(m)?;
        }
        "share" => {
            let len: usize = args.get(3).ok_or("share needs a length")?.parse()?;
            let data: Vec<u8> = (0..len).map(|i| (i % 7) as u8).collect();
            let mut b = pool.alloc(len as u64)?;
            b.write(0, &data)?;
            let r = pool.create_ref(&b, 0, len as u64)?;
            let hex: String = r.to_bytes().iter().map(|x| format!("{x:02x}")).collect();
            println!("ref {hex} {}", sum(&data));
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            pool.release_ref(&r)?;
            pool.free(b)?;
        }
        "churn" => {
            println!("started");
            let data = vec![3u8; 64 << 10];
            loop {
                let mut b = pool.alloc(data.len() as u64)?;
                b.write(0, &data)?;
                let r = pool.create_ref(&b, 0, data.len() as u64)?;
                let mut m = pool.map_ref(&r)?;
                m.write(0, b"x")?;
                pool.release_ref(&r)?;
                drop((b, m));
            }
        }
        "release-later" => {
            // Half-way between two keep-alive pings, which would take the
            // release along.
            std::thread::sleep(std::time::Duration::from_millis(250));
            let r = pool.put(&[5u8; 64 << 10], std::time::Duration::ZERO)?;
            pool.release_ref_nowait(&r)?;
            println!("queued");
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
        "check" => {
            let problems = pool.check_servers()?;
            if problems.is_empty() {
                println!("ok");
            }
            for p in problems {
                println!("{p}");
            }
        }
        other => return Err(format!("unknown command {other}").into()),
    }
    Ok(())
}
