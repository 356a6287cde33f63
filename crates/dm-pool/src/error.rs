//! Errors of the pool: one enum, each variant says what is wrong.

use std::path::PathBuf;

pub(crate) use crate::pages::PageError;
pub(crate) use crate::refs::RefDecodeError;

/// Everything a pool operation can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A length of zero was given where data is required.
    #[error("length must be greater than zero")]
    ZeroLength,
    /// A length above what a buffer can hold.
    #[error("length {len} exceeds the maximum buffer size {max} of this pool")]
    TooLarge {
        /// Asked for.
        len: u64,
        /// The pool's maximum.
        max: u64,
    },
    /// A range outside the buffer.
    #[error("range {offset}..{offset}+{len} is outside the buffer of {size} bytes")]
    OutOfBounds {
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// Buffer size.
        size: u64,
    },
    /// An address not aligned as the operation requires.
    #[error("address {addr:#x} is not aligned to {align} bytes")]
    Unaligned {
        /// The address.
        addr: u64,
        /// Required alignment.
        align: u64,
    },
    /// The pool (or its descriptor or slot table) has no room.
    #[error(
        "resource exhausted: no free {what} in the pool. {}",
        exhausted_hint(what)
    )]
    ResourceExhausted {
        /// Pages, descriptors or slots.
        what: &'static str,
    },
    /// The buffer was freed already.
    #[error("double free: buffer {desc} (generation {generation}) was already freed")]
    DoubleFree {
        /// Descriptor index.
        desc: u32,
        /// Generation.
        generation: u32,
    },
    /// The buffer id does not name a buffer of this process.
    #[error("buffer {desc} does not belong to this process")]
    NotOwner {
        /// Descriptor index.
        desc: u32,
    },
    /// A buffer or Ref from another pool.
    #[error("object of pool {found:#018x} used with pool {expected:#018x}")]
    ForeignPool {
        /// This pool.
        expected: u64,
        /// The object's pool.
        found: u64,
    },
    /// A pool whose Refs are timed by another host's monotonic clock
    /// ([`RefClock::Host`](crate::RefClock::Host)), attached from this host
    /// while a process of that host is alive: the two hosts' monotonic
    /// clocks have nothing in common.
    #[error(
        "the pool's Refs are timed by the monotonic clock of host {host:#018x}, \
         which has live processes: a pool several hosts attach needs the wall \
         Ref clock (`dmrpc pool create --ref-clock wall`)"
    )]
    RefClockInUse {
        /// The host (boot id hash) whose clock the pool keeps.
        host: u64,
    },
    /// A Ref whose tag or length does not match its descriptor.
    #[error("forged Ref: tag or length does not match descriptor {desc}")]
    RefForged {
        /// Descriptor index.
        desc: u32,
    },
    /// A Ref whose descriptor has been reused since.
    #[error("stale Ref: descriptor {desc} is at generation {current}, the Ref names {generation}")]
    RefStale {
        /// Descriptor index.
        desc: u32,
        /// The Ref's generation.
        generation: u32,
        /// The descriptor's generation.
        current: u32,
    },
    /// A Ref that was released already (double release, or use after release).
    #[error("Ref {desc}/{generation} was already released")]
    RefReleased {
        /// Descriptor index.
        desc: u32,
        /// Generation.
        generation: u32,
    },
    /// A Ref whose TTL has passed.
    #[error("Ref {desc}/{generation} expired")]
    RefExpired {
        /// Descriptor index.
        desc: u32,
        /// Generation.
        generation: u32,
    },
    /// Bytes that are not a Ref.
    #[error("malformed Ref: {0}")]
    RefDecode(#[from] RefDecodeError),
    /// The file is not a dmrpc pool.
    #[error("{path} is not a dmrpc pool (bad magic)")]
    NotAPool {
        /// The path.
        path: PathBuf,
    },
    /// The pool was made by an incompatible version.
    #[error("pool format version {found} is not supported (this build reads version {supported})")]
    VersionMismatch {
        /// In the file.
        found: u32,
        /// This build.
        supported: u32,
    },
    /// The header is inconsistent.
    #[error("corrupt pool header: {0}")]
    CorruptHeader(String),
    /// A pool cannot be made as asked (a page size that is not a power of
    /// two, a size too small for one data page, a ring size out of range).
    #[error("invalid pool configuration: {0}")]
    InvalidConfig(String),
    /// Pool metadata is inconsistent (an index out of range, an impossible state).
    #[error("corrupt pool metadata: {0}")]
    Corrupt(String),
    /// An argument the operation cannot take (what is wrong with it).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The pool is still being initialised by its creator (or the creator died).
    #[error("pool is not initialised (its creator has not finished or died while creating it)")]
    NotReady,
    /// This process is a child forked after its parent attached: what it
    /// inherited (the pool handle, buffers, Refs in flight) is its
    /// parent's.
    #[error(
        "this process was forked after the pool was attached: the attachment, its buffers and \
         Refs belong to the parent. Attach the pool anew in the child (`Pool::open`), and drop \
         what was inherited unused"
    )]
    Forked,
    /// This process's lease expired (it was stopped too long) and others reclaimed it.
    #[error("this process's lease on the pool was lost; its holdings were reclaimed")]
    LeaseLost,
    /// A service name that breaks the naming rules (or an endpoint too long).
    #[error("invalid service name {0}")]
    InvalidName(String),
    /// A live process holds that service name. A process that is gone
    /// (exited, killed, a zombie, or its lease lost) never does: its name
    /// is taken over at once.
    #[error(
        "service {name:?} is held by live process {pid} (on its host it holds the name as long \
         as it runs; elsewhere its lease runs {lease_left_ms} ms more unless renewed): stop \
         that process, choose another name, or wait for the name \
         (`ServerBuilder::wait_for_name`)"
    )]
    NameTaken {
        /// The name.
        name: String,
        /// The process that holds it.
        pid: u32,
        /// How long the holder's lease runs unless it renews it, in ms:
        /// the longest a holder that stopped (not died) keeps the name.
        lease_left_ms: u64,
    },
    /// This process has no such registration (removed, or taken over).
    #[error("service {0:?} is not registered by this process")]
    NotRegistered(String),
    /// A channel that is gone or not this process's.
    #[error("no such channel: {0}")]
    NoChannel(String),
    /// A pool with that name or path exists.
    #[error("{0} already exists")]
    AlreadyExists(PathBuf),
    /// A device holds no namespace of that name (or one still being made
    /// or removed).
    #[error("{}", no_namespace(device, name, why))]
    NoNamespace {
        /// The device or file.
        device: PathBuf,
        /// The name asked for.
        name: String,
        /// Why not, when it is there but not ready (else empty).
        why: String,
    },
    /// Something cannot be removed while processes use it (what, who).
    #[error("in use: {0}")]
    InUse(String),
    /// A memory server is unreachable, or its connection broke (it died,
    /// or it dropped this client).
    #[error("memory server unavailable: {0}")]
    Unavailable(String),
    /// The peer did not prove who it is: it has no key, or another one
    /// (the message says which end, and what to give it).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The peer is known and may not do this (an admin operation asked
    /// for without the admin key).
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// A peer sent bytes that break the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The OS refused (open, map, size).
    #[error(transparent)]
    Sys(#[from] dm_sys::mem::SysError),
    /// Other I/O.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// [`Error::NoNamespace`]'s message: of a name, or of a device that
/// holds none at all (`name` empty).
fn no_namespace(device: &std::path::Path, name: &str, why: &str) -> String {
    let d = device.display();
    if name.is_empty() {
        return format!("{d} holds no namespaces{why}");
    }
    format!("{d} holds no namespace {name:?}{why} (`dmrpc ns ls {d}` lists those it holds)")
}

/// What to do when the pool has no free `what`: the message's second half.
fn exhausted_hint(what: &str) -> &'static str {
    match what {
        "pages" => {
            "Free buffers and release Refs you hold (`dmrpc pool stats NAME` shows what is \
             held), or create a larger pool (`dmrpc pool create NAME --size 4GiB`, \
             `PoolConfig::size`)"
        }
        "descriptors" => {
            "Each live buffer and Ref takes one: free buffers and release Refs, or create the \
             pool with more (`PoolConfig::descs`, by default a quarter of its pages)"
        }
        "slots" => {
            "Too many processes are attached: detach some, or create the pool with more \
             (`dmrpc pool create NAME --slots N`, `PoolConfig::slots`)"
        }
        "service records" => {
            "Too many services are registered (`dmrpc ls`): stop some, or create the pool with \
             more (`dmrpc pool create NAME --services N`, `PoolConfig::services`)"
        }
        "memory-server sessions" => {
            "The memory server has as many clients as it takes: close idle ones, or start it \
             with more (`dmrpc memserver --max-clients N`)"
        }
        "memory-server pages" => {
            "The buffers allocated on the memory server reserve its whole region: free some, \
             or start it with more (`dmrpc memserver --size`)"
        }
        "memory-server quota" => {
            "This client holds as much of the memory server as one client may: free buffers \
             and release Refs it holds, or start the server with a larger quota \
             (`dmrpc memserver --client-quota`)"
        }
        "process quota" => {
            "This process holds as many bytes of buffers as its quota allows: free buffers \
             (or turn them into Refs), or attach with a larger quota (`AttachOptions::quota`, \
             `dmrpc pool create --process-quota`)"
        }
        "tenant quota" => {
            "This process's tenant holds as many bytes of buffers as its quota allows \
             (`dmrpc pool stats NAME` shows who holds what): free buffers, or create the pool \
             with a larger quota for the tenant (`--tenant NAME=SIZE`)"
        }
        "namespace entries" => {
            "The device's segment table is full: remove a namespace (`dmrpc ns rm DEVICE \
             NAME`) or use another device"
        }
        "device space" => {
            "No gap on the device is as large as the namespace asked for: remove a namespace \
             (`dmrpc ns ls DEVICE` shows where each lies) or ask for a smaller size"
        }
        "channels" => {
            "Too many shared-memory connections are open: close clients, or create the pool \
             with more (`dmrpc pool create NAME --channels N`, `PoolConfig::channels`)"
        }
        _ => "Drop some of them first",
    }
}

impl From<PageError> for Error {
    fn from(e: PageError) -> Self {
        Error::Corrupt(e.to_string())
    }
}

/// `Ok` if `len` bytes at `offset` lie inside `size` bytes, else
/// [`Error::OutOfBounds`] (overflow included).
pub fn check_range(offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(e) if e <= size => Ok(()),
        _ => Err(Error::OutOfBounds { offset, len, size }),
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
