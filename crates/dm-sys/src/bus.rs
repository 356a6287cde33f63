//! Bus errors in shared mappings, explained.
//!
//! A store into a page of a shared file mapping whose file system has no
//! space left (a full tmpfs, a file truncated by someone else) raises
//! `SIGBUS`. The store cannot return an error, so the process still ends.
//! This module makes it end with a message that says which file, why, and
//! what to do, instead of a bare "Bus error".
//!
//! Mappings register their range with a message ([`watch`]); one process-
//! wide handler writes the message of the range the fault lies in to
//! stderr, then lets the signal take its usual course: a previous handler
//! runs as if this one were not there, or, without one, the default action
//! ends the process. A fault outside every range goes straight to the
//! previous handler.
//!
//! Everything the handler touches is async-signal-safe: atomics, `write`,
//! `sigaction`.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

/// Ranges watched at once at most (a pool's mapping and its window
/// reservation each take one; later ones go unexplained).
const RANGES: usize = 64;

struct Range {
    start: AtomicUsize,
    len: AtomicUsize,
    msg: AtomicPtr<u8>,
    msg_len: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Range = Range {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    msg: AtomicPtr::new(std::ptr::null_mut()),
    msg_len: AtomicUsize::new(0),
};

static TABLE: [Range; RANGES] = [EMPTY; RANGES];
/// Serialises registration (the handler only reads).
static REGISTER: Mutex<()> = Mutex::new(());
static INSTALL: Once = Once::new();
static BUS: crate::fault::Chain = crate::fault::Chain::new();

/// A watched range; unwatched when dropped.
#[derive(Debug)]
pub struct Watch {
    slot: Option<usize>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let _g = REGISTER.lock().unwrap_or_else(|p| p.into_inner());
            // The message stays allocated: a handler may be reading it.
            TABLE[i].start.store(0, Ordering::Release);
            TABLE[i].len.store(0, Ordering::Release);
        }
    }
}

/// Watches `len` bytes at `start`: a bus error there prints `message`
/// (one line is added) before the process ends. Installs the handler once.
/// When the table is full, or the handler cannot be installed, the range
/// goes unwatched (a bus error there is reported as before).
pub fn watch(start: usize, len: usize, message: String) -> Watch {
    INSTALL.call_once(|| {
        // (Without the handler, bus errors go unexplained, as before.)
        let _ = BUS.install(libc::SIGBUS, handler);
    });
    let _g = REGISTER.lock().unwrap_or_else(|p| p.into_inner());
    let Some(i) = TABLE
        .iter()
        .position(|r| r.len.load(Ordering::Acquire) == 0)
    else {
        return Watch { slot: None };
    };
    let msg: &'static mut [u8] = format!("{message}\n").into_bytes().leak();
    let r = &TABLE[i];
    r.msg_len.store(msg.len(), Ordering::Relaxed);
    r.msg.store(msg.as_mut_ptr(), Ordering::Release);
    r.start.store(start, Ordering::Release);
    r.len.store(len, Ordering::Release);
    Watch { slot: Some(i) }
}

/// Writes the message of the watched range that `addr` lies in to stderr,
/// for a bus error that was foreseen rather than raised (a page whose
/// storage could not be allocated). `false` when no range holds `addr`.
/// Async-signal-safe.
pub fn explain(addr: usize) -> bool {
    for r in &TABLE {
        let (start, len) = (
            r.start.load(Ordering::Acquire),
            r.len.load(Ordering::Acquire),
        );
        if len != 0 && addr.wrapping_sub(start) < len {
            let p = r.msg.load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: `p` points to a leaked message of `msg_len`
                // bytes, never freed; write(2) is async-signal-safe.
                unsafe { libc::write(2, p.cast(), r.msg_len.load(Ordering::Relaxed)) };
            }
            return true;
        }
    }
    false
}

extern "C" fn handler(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    explain(addr);
    BUS.pass_on(sig, info, ctx);
}
