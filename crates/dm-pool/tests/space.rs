//! A pool on a file system that runs out of space: on a small tmpfs this
//! test mounts (needs root; where it cannot, it says so and passes without
//! running). A pool that does not fit is refused; a reserved pool cannot
//! run out; an unreserved one whose space others took ends a writer with
//! a message naming the pool, not a bare bus error.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)]

mod common;
use common::Agent;
use dm_pool::{Error, Pool, PoolConfig};
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A 4 MiB tmpfs, unmounted on drop.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount() -> Result<SmallFs, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("needs root to mount a tmpfs".into());
        }
        let dir = std::env::temp_dir().join(format!("dm-small-fs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m", "dmrpc-test"])
            .arg(&dir)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(SmallFs(dir))
    }

    /// Fills what is left with a file (written, so its pages are taken).
    fn fill(&self) -> PathBuf {
        let p = self.0.join("filler");
        let mut f = std::fs::File::create(&p).unwrap();
        let chunk = vec![1u8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
        p
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn cfg(reserve: bool) -> PoolConfig {
    PoolConfig {
        size: 3 << 20,
        reserve,
        ..Default::default()
    }
}

/// An agent attached to `pool` with a new buffer of `len` bytes to write
/// (`how`: `fill`, through the pool, or `mfill`, plain stores through a
/// mapped buffer): the agent, and the handle `how` writes through.
fn writer(pool: &Path, how: &str, len: u64) -> (Agent, String) {
    let mut a = Agent::spawn_with(pool, None, &[], true);
    let b = a.ok(&format!("alloc {len}"));
    let target = if how == "mfill" {
        let r = a.ok(&format!("share {b} 0 {len}"));
        a.ok(&format!("mmap {r}"))
    } else {
        b
    };
    (a, target)
}

/// Has `a` write its buffer (it may die of it): its exit status and stderr.
fn write(mut a: Agent, how: &str, target: &str, len: u64) -> (std::process::ExitStatus, String) {
    a.try_raw(&format!("{how} {target} 0 {len} 7"));
    let (status, stderr) = a.end();
    (status.expect("the agent ends"), stderr)
}

#[test]
fn a_full_file_system_is_a_clear_error() {
    let fs = match SmallFs::mount() {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("SKIPPED a_full_file_system_is_a_clear_error: {e}");
            return;
        }
    };
    // Unreserved: created while the room is there; then another file takes
    // it, and a writer dies with a message naming the pool.
    // The writer attaches first: attaching writes the pool's slot pages,
    // and an agent that attaches to a full file system dies right there.
    let path = fs.0.join("lazy.pool");
    Pool::create(&path, &cfg(false)).unwrap();
    let writers = ["fill", "mfill"].map(|how| (how, writer(&path, how, 512 << 10)));
    let filler = fs.fill();
    for (how, (a, target)) in writers {
        let (status, stderr) = write(a, how, &target, 512 << 10);
        // A store through a mapped buffer is ended by its write fault,
        // whose copy found no room: the fault is passed on, as SIGSEGV.
        let signal = if how == "mfill" {
            libc::SIGSEGV
        } else {
            libc::SIGBUS
        };
        assert_eq!(status.signal(), Some(signal), "{how}: {status:?} {stderr}");
        assert!(
            stderr.contains("bus error writing the pool file")
                && stderr.contains(path.to_str().unwrap())
                && stderr.contains("--reserve"),
            "{how}: {stderr}"
        );
    }
    // A reserved pool that does not fit is refused, naming the free space.
    let reserved = fs.0.join("reserved.pool");
    let e = Pool::create(&reserved, &cfg(true)).unwrap_err();
    assert!(
        matches!(e, Error::Sys(dm_sys::mem::SysError::NoSpace { .. })),
        "{e}"
    );
    assert!(!reserved.exists(), "nothing left behind");
    // With the room back, a reserved pool takes its space at once, and
    // writes into it succeed however full the file system gets.
    std::fs::remove_file(&filler).unwrap();
    std::fs::remove_file(&path).unwrap();
    Pool::create(&reserved, &cfg(true)).unwrap();
    fs.fill();
    let (a, target) = writer(&reserved, "fill", 2 << 20);
    let (status, stderr) = write(a, "fill", &target, 2 << 20);
    assert!(status.success(), "{status:?} {stderr}");
    let report = dm_pool::check_path(&reserved, false).unwrap();
    assert!(report.ok(), "{report:?}");
}
