//! How `dmrpc call` prints what comes back: bytes as they are or as
//! hex, metadata on stderr, times in microseconds.

use anyhow::Result;
use dm_rpc::Metadata;
use std::io::Write;
use std::time::Duration;

/// Writes `b` to `out` as it is, or as hex (32 bytes a line, then an
/// empty line: one block per item or message).
pub(super) fn write_bytes(out: &mut impl Write, b: &[u8], hex: bool) -> Result<()> {
    if hex {
        for line in b.chunks(32) {
            let h: Vec<String> = line.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(out, "{}", h.join(" "))?;
        }
        writeln!(out)?;
    } else {
        out.write_all(b)?;
    }
    out.flush()?;
    Ok(())
}

/// Prints the metadata of an answer on stderr, `< key: value` a line: a
/// value of printable text as it is, any other in hex (`0x…`).
pub(super) fn show_metadata(m: &Metadata) {
    for (k, v) in m.iter() {
        match std::str::from_utf8(v) {
            Ok(s) if s.chars().all(|c| !c.is_control()) => eprintln!("< {k}: {s}"),
            _ => {
                let hex: String = v.iter().map(|b| format!("{b:02x}")).collect();
                eprintln!("< {k}: 0x{hex}");
            }
        }
    }
}

/// A duration in microseconds.
pub(super) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
