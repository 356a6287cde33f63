//! A process-wide write-fault hook.
//!
//! Transparent copy-on-write needs to run code when a store hits a page that
//! is mapped read-only. This module installs one `SIGSEGV` handler for the
//! process (once) and calls a resolver registered by the layer above with the
//! faulting address. If the resolver does not claim the fault (an address
//! outside every DM window, or a real bug), the previous handler runs as if we
//! were never there: a `SA_SIGINFO` handler is called with the same arguments.
//! `SIG_DFL` is restored so that the re-executed instruction faults again and
//! the process dies with the usual signal, and so is `SIG_IGN`: an ignored
//! fault would re-execute the instruction forever (the kernel, too, delivers
//! a fault that is ignored with the default action).
//!
//! The handler saves `errno` and restores it before it returns: the
//! resolver's system calls must not change what the interrupted code reads.
//!
//! Everything reachable from the handler must be async-signal-safe: atomics,
//! plain loads and stores, and raw syscalls. No allocation, no locks.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

/// Resolver signature: given the faulting address and whether the access was
/// a write, return `true` if the fault was resolved (the instruction will be
/// retried), `false` to pass it on.
pub type Resolver = fn(addr: usize, is_write: bool) -> bool;

/// The resolvers, tried in the order they were added (one per layer that
/// resolves faults: mapped buffers, heap seals).
const MAX_RESOLVERS: usize = 4;
static RESOLVERS: [AtomicPtr<()>; MAX_RESOLVERS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_RESOLVERS];
static INSTALL: Once = Once::new();
static SEGV: Chain = Chain::new();

/// Installs the process-wide handler (idempotent) and adds `resolver` to
/// those it asks (once: adding it again changes nothing). Returns an
/// error if `sigaction` fails, or if four resolvers are in already.
pub fn install(resolver: Resolver) -> std::io::Result<()> {
    let f = resolver as *mut ();
    // (Slots fill in order and are never emptied: the first empty one is
    // after every resolver added.)
    let added = RESOLVERS.iter().any(|r| {
        r.load(Ordering::Acquire) == f
            || r.compare_exchange(std::ptr::null_mut(), f, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            || r.load(Ordering::Acquire) == f
    });
    if !added {
        return Err(std::io::Error::other(
            "four fault resolvers are installed already",
        ));
    }
    let mut err = None;
    INSTALL.call_once(|| err = SEGV.install(libc::SIGSEGV, handler).err());
    match err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A signal handler of ours and the action it replaced, which it passes
/// the signals that are not its own to (this module's `SIGSEGV`, and
/// [`crate::bus`]'s `SIGBUS`).
pub(crate) struct Chain {
    /// Set once `prev` is written.
    set: AtomicUsize,
    prev: std::cell::UnsafeCell<std::mem::MaybeUninit<libc::sigaction>>,
}

// SAFETY: `prev` is written once, before `set` is published (Release), and
// only read after `set` is seen (Acquire); `install` runs under a `Once`.
unsafe impl Sync for Chain {}

impl Chain {
    pub(crate) const fn new() -> Chain {
        Chain {
            set: AtomicUsize::new(0),
            prev: std::cell::UnsafeCell::new(std::mem::MaybeUninit::uninit()),
        }
    }

    /// Installs `handler` for `sig` (`SA_SIGINFO`, on the alternate stack,
    /// re-entrant) and keeps the action it replaces. Call once (a `Once`).
    pub(crate) fn install(
        &self,
        sig: i32,
        handler: extern "C" fn(i32, *mut libc::siginfo_t, *mut libc::c_void),
    ) -> std::io::Result<()> {
        // SAFETY: a zeroed sigaction is a valid value; we fill in the
        // handler and write the previous action into `prev` before `set`
        // is published, which every reader checks first.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = handler as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut sa.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &sa, &mut old) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            (*self.prev.get()).write(old);
        }
        self.set.store(1, Ordering::Release);
        Ok(())
    }

    /// What would have happened without our handler: the previous handler
    /// runs with the same arguments; a previous `SIG_DFL` or `SIG_IGN`
    /// becomes the default action, so the re-executed instruction faults
    /// again and the process dies of the signal (an ignored fault would
    /// re-execute it forever; the kernel, too, delivers an ignored fault
    /// with the default action). Async-signal-safe.
    pub(crate) fn pass_on(&self, sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        if self.set.load(Ordering::Acquire) == 0 {
            restore_default(sig);
            return;
        }
        // SAFETY: `prev` was fully written before `set` was published.
        let prev: &libc::sigaction = unsafe { (*self.prev.get()).assume_init_ref() };
        let h = prev.sa_sigaction;
        if h == libc::SIG_IGN || h == libc::SIG_DFL {
            restore_default(sig);
            return;
        }
        if prev.sa_flags & libc::SA_SIGINFO != 0 {
            // SAFETY: the previous handler was installed with SA_SIGINFO, so it
            // has this signature.
            let f: extern "C" fn(i32, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(h) };
            f(sig, info, ctx);
        } else {
            // SAFETY: a plain handler takes the signal number only.
            let f: extern "C" fn(i32) = unsafe { std::mem::transmute(h) };
            f(sig);
        }
    }
}

extern "C" fn handler(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: __errno_location returns this thread's errno, always valid.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: as above; a plain read of an int.
    let saved = unsafe { *errno };
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    let is_write = fault_is_write(ctx);
    let resolved = RESOLVERS.iter().any(|r| {
        let r = r.load(Ordering::Acquire);
        !r.is_null() && {
            // SAFETY: RESOLVERS only ever hold `Resolver` fn pointers (see
            // `install`).
            let f: Resolver = unsafe { std::mem::transmute::<*mut (), Resolver>(r) };
            f(addr, is_write)
        }
    });
    if !resolved {
        SEGV.pass_on(sig, info, ctx);
    }
    // SAFETY: as above; a plain write of an int.
    unsafe { *errno = saved };
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn fault_is_write(ctx: *mut libc::c_void) -> bool {
    if ctx.is_null() {
        return true;
    }
    // SAFETY: for SA_SIGINFO handlers the third argument is a ucontext_t.
    let uc = unsafe { &*(ctx as *const libc::ucontext_t) };
    // Bit 1 of the page-fault error code: the access was a write.
    (uc.uc_mcontext.gregs[libc::REG_ERR as usize] & 2) != 0
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn fault_is_write(_ctx: *mut libc::c_void) -> bool {
    true
}

fn restore_default(sig: i32) {
    // SAFETY: resetting a signal to SIG_DFL is async-signal-safe; the faulting
    // instruction is then retried and delivers the default action.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(sig, &sa, std::ptr::null_mut());
    }
}
