//! `dmrpc key`: key files for memory servers and TCP services.

use anyhow::Result;
use clap::Subcommand;
use dm_pool::auth::Key;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum KeyCmd {
    /// Write a new random key file (mode 0600). Give the same file to the
    /// server (`--key-file`) and to its clients.
    New {
        /// Where to write it (refused if it exists).
        file: PathBuf,
    },
    /// Print a key file's fingerprint (safe to show; servers print theirs).
    Show {
        /// The key file.
        file: PathBuf,
    },
}

pub fn run(c: KeyCmd) -> Result<()> {
    match c {
        KeyCmd::New { file } => {
            let k = Key::generate_file(&file)?;
            println!("wrote {} (key {})", file.display(), k.fingerprint());
        }
        KeyCmd::Show { file } => println!("key {}", Key::from_file(&file)?.fingerprint()),
    }
    Ok(())
}
