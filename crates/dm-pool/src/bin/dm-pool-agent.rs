//! An interactive pool client for multi-process tests and debugging.
//!
//! `dm-pool-agent POOL_PATH [LEASE_MS]` attaches (as the tenant named by
//! `DMRPC_TENANT`, if set; judged by its lease alone, as a process of
//! another host, if `DMRPC_LEASE_ONLY` is set) and reads one command per
//! line on stdin,
//! answering `ok [values]` or `err <kind>: <message>` on stdout:
//!
//! ```text
//! alloc LEN                 -> ok B           (a buffer handle number)
//! fill B OFF LEN BYTE       -> ok             (explicit write)
//! read B OFF LEN            -> ok HEX
//! sum B                     -> ok FNV64       (hash of the whole buffer)
//! share B OFF LEN           -> ok REFHEX
//! map REFHEX                -> ok B
//! mmap REFHEX               -> ok M           (mapped buffer, load/store)
//! mfill M OFF LEN BYTE      -> ok             (plain stores through the mapping)
//! mread M OFF LEN           -> ok HEX         (plain loads)
//! release REFHEX            -> ok
//! free B                    -> ok
//! check                     -> ok | err check: problems
//! holdlock REFHEX           -> ok holding     (stops in map_ref, holding the Ref's lock)
//! stopref B                 -> ok stopped     (stops in create_ref before copying entries)
//! stopat POINT              -> ok             (the next time this process
//!                              reaches POINT, `list-copied`, `lists-shared`
//!                              or `shared-list-left`, it answers `ok stopped`
//!                              and stops for good)
//! churn SEED [MASK]         -> never returns: random ops until killed
//!                              (MASK: bit n enables op n of `churn`, default all)
//! nscreate DEV NAME SIZE [stop] -> ok OFFSET  (creates a namespace; with `stop`,
//!                              answers `ok stopping` and stops halfway)
//! nsrm DEV NAME [stop]      -> ok             (removes one; `stop` as above)
//! nschurn DEV SEED          -> never returns: creates and removes namespaces
//!                              of DEV until killed
//! exit                      -> detaches and exits
//! ```

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    agent::main()
}

#[cfg(not(loom))]
mod agent {
    use dm_pool::{AttachOptions, Buffer, MappedBuffer, Pool, Ref};
    use std::collections::HashMap;
    use std::io::{BufRead, Write};

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex(s: &str) -> Option<Vec<u8>> {
        (0..s.len())
            .step_by(2)
            .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect()
    }

    fn fnv(b: &[u8]) -> u64 {
        b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
            (h ^ x as u64).wrapping_mul(0x0100_0000_01b3)
        })
    }

    struct Agent {
        pool: Pool,
        bufs: HashMap<u64, Buffer>,
        maps: HashMap<u64, MappedBuffer>,
        next: u64,
    }

    type R = Result<String, String>;

    fn num(it: &mut std::str::SplitWhitespace<'_>) -> Result<u64, String> {
        it.next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| "usage: missing number".to_string())
    }

    fn e(x: dm_pool::Error) -> String {
        let kind = format!("{x:?}");
        let kind = kind
            .split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or("");
        format!("{kind}: {x}")
    }

    impl Agent {
        fn put(&mut self, b: Buffer) -> String {
            self.next += 1;
            self.bufs.insert(self.next, b);
            self.next.to_string()
        }

        fn parse_ref(s: Option<&str>) -> Result<Ref, String> {
            let b = s.and_then(unhex).ok_or("usage: bad ref hex")?;
            Ref::from_bytes(&b).map_err(|x| format!("RefDecode: {x}"))
        }

        fn run(&mut self, line: &str) -> R {
            let mut it = line.split_whitespace();
            let cmd = it.next().unwrap_or("");
            match cmd {
                "alloc" => {
                    let len = num(&mut it)?;
                    let b = self.pool.alloc(len).map_err(e)?;
                    Ok(self.put(b))
                }
                "fill" => {
                    let (b, off, len, byte) =
                        (num(&mut it)?, num(&mut it)?, num(&mut it)?, num(&mut it)?);
                    let buf = self.bufs.get_mut(&b).ok_or("no such buffer")?;
                    buf.write(off, &vec![byte as u8; len as usize]).map_err(e)?;
                    Ok(String::new())
                }
                "read" => {
                    let (b, off, len) = (num(&mut it)?, num(&mut it)?, num(&mut it)?);
                    let buf = self.bufs.get(&b).ok_or("no such buffer")?;
                    let mut out = vec![0u8; len as usize];
                    buf.read(off, &mut out).map_err(e)?;
                    Ok(hex(&out))
                }
                "sum" => {
                    let b = num(&mut it)?;
                    let buf = self.bufs.get(&b).ok_or("no such buffer")?;
                    let mut h = Vec::new();
                    for s in buf.segments(0, buf.len()).map_err(e)? {
                        h.extend_from_slice(s);
                    }
                    Ok(fnv(&h).to_string())
                }
                "share" => {
                    let (b, off, len) = (num(&mut it)?, num(&mut it)?, num(&mut it)?);
                    let buf = self.bufs.get(&b).ok_or("no such buffer")?;
                    Ok(hex(&buf.create_ref(off, len).map_err(e)?.to_bytes()))
                }
                "map" => {
                    let r = Self::parse_ref(it.next())?;
                    let b = self.pool.map_ref(&r).map_err(e)?;
                    Ok(self.put(b))
                }
                "holdlock" => {
                    // Crash-recovery tests: stop holding the Ref's mapper
                    // lock (the test kills this agent next).
                    let r = Self::parse_ref(it.next())?;
                    dm_pool::testing::hold_ref_lock(&self.pool, &r).map_err(e)?;
                    Ok("holding".into())
                }
                "seal" => {
                    // The buffer becomes a Ref to all of it (`into_ref`).
                    let b = num(&mut it)?;
                    let buf = self.bufs.remove(&b).ok_or("no such buffer")?;
                    Ok(hex(&self.pool.into_ref(buf).map_err(e)?.to_bytes()))
                }
                "stopseal" => {
                    // Crash-recovery tests: stop turning a buffer into a
                    // Ref just before the commit (the test kills this
                    // agent next).
                    let b = num(&mut it)?;
                    let buf = self.bufs.remove(&b).ok_or("no such buffer")?;
                    dm_pool::testing::stop_sealing(&self.pool, buf).map_err(e)?;
                    Ok("stopped".into())
                }
                "stopref" => {
                    // Crash-recovery tests: stop creating a Ref before its
                    // entries are written (the test kills this agent next).
                    let b = num(&mut it)?;
                    let buf = self.bufs.get(&b).ok_or("no such buffer")?;
                    dm_pool::testing::stop_creating_ref(&self.pool, buf).map_err(e)?;
                    Ok("stopped".into())
                }
                "stopat" => {
                    use dm_pool::testing::StopPoint;
                    let p = match it.next() {
                        Some("list-copied") => StopPoint::ListCopied,
                        Some("lists-shared") => StopPoint::ListsShared,
                        Some("shared-list-left") => StopPoint::SharedListLeft,
                        p => return Err(format!("usage: stopat POINT, not {p:?}")),
                    };
                    dm_pool::testing::stop_at(p);
                    Ok(String::new())
                }
                "stopnote" => {
                    // Crash-recovery tests: share a buffer with a TTL of
                    // `ms`, and stop for good between the Ref's commit and
                    // the expiry summary (the test kills this agent next).
                    let b = num(&mut it)?;
                    let ms = num(&mut it)?;
                    let buf = self.bufs.get(&b).ok_or("no such buffer")?;
                    dm_pool::testing::stop_before_noting();
                    self.pool
                        .create_ref_ttl(buf, 0, buf.len(), std::time::Duration::from_millis(ms))
                        .map_err(e)?;
                    Err("not stopped".into())
                }
                "mmap" => {
                    let r = Self::parse_ref(it.next())?;
                    let m = MappedBuffer::map_ref(&self.pool, &r).map_err(e)?;
                    self.next += 1;
                    self.maps.insert(self.next, m);
                    Ok(self.next.to_string())
                }
                "mfill" => {
                    let (m, off, len, byte) =
                        (num(&mut it)?, num(&mut it)?, num(&mut it)?, num(&mut it)?);
                    let mb = self.maps.get_mut(&m).ok_or("no such mapping")?;
                    let s = mb.as_mut_slice();
                    let end = (off + len) as usize;
                    if end > s.len() {
                        return Err("OutOfBounds: mfill past the end".into());
                    }
                    s[off as usize..end].fill(byte as u8);
                    Ok(String::new())
                }
                "mread" => {
                    let (m, off, len) = (num(&mut it)?, num(&mut it)?, num(&mut it)?);
                    let mb = self.maps.get(&m).ok_or("no such mapping")?;
                    let s = mb.as_slice();
                    let r = s
                        .get(off as usize..(off + len) as usize)
                        .ok_or("OutOfBounds: mread")?;
                    Ok(hex(r))
                }
                "release" => {
                    let r = Self::parse_ref(it.next())?;
                    self.pool.release_ref(&r).map_err(e)?;
                    Ok(String::new())
                }
                "free" => {
                    let b = num(&mut it)?;
                    if let Some(m) = self.maps.remove(&b) {
                        drop(m);
                        return Ok(String::new());
                    }
                    let buf = self.bufs.remove(&b).ok_or("no such buffer")?;
                    self.pool.free(buf).map_err(e)?;
                    Ok(String::new())
                }
                "check" => {
                    let rep = self.pool.check();
                    if rep.ok() {
                        Ok(String::new())
                    } else {
                        Err(format!("check: {}", rep.problems.join("; ")))
                    }
                }
                "nscreate" | "nsrm" => {
                    let dev = std::path::PathBuf::from(it.next().ok_or("usage: device")?);
                    let name = it.next().ok_or("usage: name")?.to_owned();
                    let size = if cmd == "nscreate" { num(&mut it)? } else { 0 };
                    if it.next() == Some("stop") {
                        dm_pool::testing::stop_namespace_change(cmd == "nsrm");
                        println!("ok stopping");
                        let _ = std::io::stdout().flush();
                    }
                    if cmd == "nsrm" {
                        dm_pool::namespace::remove(&dev, &name).map_err(e)?;
                        return Ok(String::new());
                    }
                    let cfg = dm_pool::PoolConfig {
                        size,
                        ..Default::default()
                    };
                    let ns = dm_pool::namespace::create(&dev, &name, &cfg).map_err(e)?;
                    Ok(ns.offset.to_string())
                }
                "nschurn" => {
                    let dev = std::path::PathBuf::from(it.next().ok_or("usage: device")?);
                    let mut x = num(&mut it)? | 1;
                    println!("ok churning");
                    let _ = std::io::stdout().flush();
                    loop {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let name = format!("c{}", x % 6);
                        let cfg = dm_pool::PoolConfig {
                            size: (1 + x % 5) << 20,
                            ..Default::default()
                        };
                        if dm_pool::namespace::create(&dev, &name, &cfg).is_err() {
                            let _ = dm_pool::namespace::remove(&dev, &name);
                        }
                    }
                }
                "churn" => {
                    let seed = num(&mut it)?;
                    let mask = it.next().and_then(|m| m.parse().ok()).unwrap_or(u64::MAX);
                    let big = it.next().and_then(|m| m.parse().ok()).unwrap_or(0);
                    self.churn(seed, mask, big)
                }
                _ => Err(format!("unknown command {cmd:?}")),
            }
        }

        /// Random operations forever, exercising every multi-step protocol (for
        /// kill -9 tests). Announces "ok" once started. With `big` > 0 a
        /// quarter of the buffers are sparse ones of up to `big` bytes.
        fn churn(&mut self, seed: u64, mask: u64, big: u64) -> R {
            let mut x = seed | 1;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            println!("ok churning");
            let _ = std::io::stdout().flush();
            let mut bufs: Vec<Buffer> = Vec::new();
            let mut refs: Vec<Ref> = Vec::new();
            let mut maps: Vec<MappedBuffer> = Vec::new();
            let ps = self.pool.page_size() as u64;
            loop {
                let op = rnd() % 9;
                if mask & (1 << op) == 0 {
                    continue;
                }
                match op {
                    0 | 1 if bufs.len() < 16 => {
                        let len = if big > 0 && rnd() % 4 == 0 {
                            big - rnd() % (big / 4)
                        } else {
                            1 + rnd() % (ps * 80)
                        };
                        if let Ok(b) = self.pool.alloc(len) {
                            bufs.push(b);
                        }
                    }
                    2 | 3 if !bufs.is_empty() => {
                        let i = (rnd() as usize) % bufs.len();
                        let len = bufs[i].len();
                        let off = rnd() % len;
                        let n = 1 + rnd() % (len - off).min(ps * 80);
                        let _ = bufs[i].write(off, &vec![rnd() as u8; n as usize]);
                    }
                    4 if !bufs.is_empty() && refs.len() < 16 => {
                        let i = (rnd() as usize) % bufs.len();
                        // A Ref sharing the buffer, or the buffer turned
                        // into one (a mapped one is shared and freed).
                        let r = if rnd() % 2 == 0 {
                            bufs[i].share()
                        } else {
                            self.pool.into_ref(bufs.swap_remove(i))
                        };
                        if let Ok(r) = r {
                            refs.push(r);
                        }
                    }
                    5 if !refs.is_empty() => {
                        let r = refs[(rnd() as usize) % refs.len()];
                        if rnd() % 3 == 0 && maps.len() < 4 {
                            if let Ok(m) = MappedBuffer::map_ref(&self.pool, &r) {
                                maps.push(m);
                            }
                        } else if let Ok(b) = self.pool.map_ref(&r) {
                            bufs.push(b);
                        }
                    }
                    6 if !refs.is_empty() => {
                        let r = refs.swap_remove((rnd() as usize) % refs.len());
                        let _ = self.pool.release_ref(&r);
                    }
                    7 if !bufs.is_empty() => {
                        drop(bufs.swap_remove((rnd() as usize) % bufs.len()));
                    }
                    8 if !maps.is_empty() => {
                        let i = (rnd() as usize) % maps.len();
                        let s = maps[i].as_mut_slice();
                        let at = (rnd() as usize) % s.len();
                        s[at] = rnd() as u8;
                        if rnd() % 4 == 0 {
                            drop(maps.swap_remove(i));
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    pub fn main() {
        // A test that crashed or hung must not leave its agents running.
        if let Err(e) = dm_sys::proc::die_with_parent() {
            eprintln!("dm-pool-agent: {e}");
        }
        let args: Vec<String> = std::env::args().collect();
        let Some(path) = args.get(1) else {
            eprintln!("usage: dm-pool-agent POOL_PATH [LEASE_MS]");
            std::process::exit(2);
        };
        let lease_ms = args.get(2).and_then(|s| s.parse().ok());
        let pool = match Pool::open(
            std::path::Path::new(path),
            AttachOptions {
                lease_ms,
                name: Some("dm-pool-agent".into()),
                reclaim: std::env::var_os("DMRPC_AGENT_NO_RECLAIM").is_none(),
                tenant: std::env::var("DMRPC_TENANT").ok(),
                lease_only: std::env::var_os("DMRPC_LEASE_ONLY").is_some(),
                ..Default::default()
            },
        ) {
            Ok(p) => p,
            Err(x) => {
                println!("err {}", e(x));
                std::process::exit(1);
            }
        };
        println!("ok slot {}", pool.slot());
        let mut agent = Agent {
            pool,
            bufs: HashMap::new(),
            maps: HashMap::new(),
            next: 0,
        };
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let Ok(line) = line else { break };
            if line.trim() == "exit" {
                break;
            }
            let out = match agent.run(&line) {
                Ok(v) if v.is_empty() => "ok".to_string(),
                Ok(v) => format!("ok {v}"),
                Err(m) => format!("err {m}"),
            };
            println!("{out}");
            let _ = std::io::stdout().flush();
        }
    }
}
