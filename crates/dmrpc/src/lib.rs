//! # dmrpc
//!
//! RPC for data-intensive services whose arguments travel by reference
//! through a disaggregated memory pool. This facade re-exports the layers:
//!
//! * [`pool`] — the shared-memory pool backend (`dm-pool`): buffers, Refs,
//!   page-granular copy-on-write, leases, check and gc.
//! * [`rpc`] — the RPC layer (`dm-rpc`): services, clients, transports
//!   (shared-memory rings, TCP, in-process), size-aware payloads.
//! * [`memserver`] — memory servers (`dm-memserver`): the same contract
//!   over TCP, for memory beyond one host (DmRPC-net). With the
//!   `memserver` feature, on by default.
//!
//! The `dmrpc` command lives in the `dmrpc-cli` crate, and the benchmarks
//! with the applications they run in `dmrpc-bench`: a library user pulls
//! neither.

#[cfg(feature = "memserver")]
pub use dm_memserver as memserver;
pub use dm_pool as pool;
pub use dm_rpc as rpc;

/// Parses a size such as `4096`, `4KiB`, `64MiB`, `1GiB`, `1G`, `512M`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (try 4KiB, 64MiB, 1GiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => {
            return Err(format!(
                "unknown size unit {u:?} in {s:?} (use KiB, MiB, GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Formats a byte count with a binary unit.
pub fn fmt_size(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", U[i])
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size(" 2 gib "), Ok(2 << 30));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999999TiB").is_err());
        assert_eq!(fmt_size(4096), "4 KiB");
        assert_eq!(fmt_size(64 << 20), "64 MiB");
        assert_eq!(fmt_size(1536), "1.5 KiB");
    }
}
