//! Namespaces of one device (DirectCXL): a device or a large file holds
//! several named regions, each with a pool inside, listed in a segment
//! table at the device's start (`table.rs` owns its format).
//!
//! A namespace is addressed as `DEVICE/NAME`: that path works wherever a
//! pool's path does ([`Pool::open`], [`Pool::create`], [`Pool::destroy`],
//! `dmrpc pool check`, `--pool`). The pool inside knows nothing of the
//! table: it is mapped at its region's offset, and every file offset it
//! uses adds that offset ([`SharedFile::file_off`]).
//!
//! Changes to the table (format, create, remove) hold an exclusive lock
//! on the table's bytes, attaching holds a shared one until the attaching
//! process has its slot in the pool. The locks are the kernel's
//! (open-file-description locks): a process killed while holding one
//! lets go of it. A change interrupted by a crash leaves its entry
//! `creating` or `removing`. The next change finds it so while holding
//! the lock (so nobody is making it) and finishes it: a namespace half
//! made is freed, one half removed is removed. Readers meanwhile see it
//! as not there.
//!
//! A namespace is in use while a process is attached to its pool (a live
//! slot, judged as the pool judges its slots: a process of this host while
//! it runs, of another host while its lease lasts). Such a namespace is
//! not removed. The entry's reference count is the number of attachments
//! as last counted: attaching adds one, detaching takes one away, and
//! listing or removing recounts it from the pool's slots (a process
//! killed does not take its one away).
//!
//! Locks are per host. On a device shared by hosts, make and remove
//! namespaces from one host.
//!
//! [`Pool::open`]: crate::Pool::open
//! [`Pool::create`]: crate::Pool::create
//! [`Pool::destroy`]: crate::Pool::destroy
//! [`SharedFile::file_off`]: dm_sys::mem::SharedFile::file_off

pub(crate) mod device;
pub(crate) mod table;

use crate::error::{Error, Result};
use crate::layout::{Layout, PoolConfig};
use crate::shm::Shm;
use device::{access, Device};
pub use device::{path, split};
use dm_sys::mem::{Access, SharedFile};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use table::{entry_off, find_gap, Entry, Header, TableError};
pub use table::{valid_name, State, ALIGN, MAX_ENTRIES, NAME_MAX, NS_VERSION, TABLE_LEN};

/// What the segment table says of one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// The device or file that holds it.
    pub device: PathBuf,
    /// Its name.
    pub name: String,
    /// Its state: `Ready`, or `Creating`/`Removing` when a process died
    /// making or removing it (the next change of the table finishes that).
    pub state: State,
    /// Where its region starts on the device.
    pub offset: u64,
    /// The region's length.
    pub size: u64,
    /// Processes attached to its pool, as counted now.
    pub refs: u32,
    /// Bumped by every creation (a namespace made anew under an old name
    /// has another).
    pub generation: u64,
    /// When it was created (ms since the epoch).
    pub created_ms: u64,
    /// The user who created it.
    pub owner_uid: u32,
    /// The process that created it.
    pub owner_pid: u32,
}

impl Namespace {
    /// The path that opens its pool.
    pub fn path(&self) -> PathBuf {
        path(&self.device, &self.name)
    }
}

fn describe(d: &Device, e: &Entry, refs: u32) -> Namespace {
    Namespace {
        device: d.path.clone(),
        name: e.name.clone(),
        state: e.state,
        offset: e.offset,
        size: e.size,
        refs,
        generation: e.generation,
        created_ms: e.created_ms,
        owner_uid: e.owner_uid,
        owner_pid: e.owner_pid,
    }
}

/// Processes attached to the pool of `e` now, recorded as its
/// reference count. A pool that cannot be read has none.
fn count(d: &Device, i: u32, e: &Entry) -> u32 {
    let live = SharedFile::open_region(&d.path, e.offset, e.size, Access::Group)
        .ok()
        .and_then(|f| Shm::from_file(f, &path(&d.path, &e.name), None).ok())
        .map_or(0, |shm| shm.live_slots());
    d.refs(i).store(live, Ordering::Release);
    live
}
/// Makes `device` hold an empty segment table for `device_len` bytes.
/// A file that does not exist is created with that length (sparse). An
/// existing file or device must start with zeros: one that holds a pool
/// or other data is refused. A device that holds a table already is left
/// as it is.
pub fn format(device: &Path, device_len: u64, group: bool) -> Result<()> {
    let device_len = device_len - device_len % ALIGN;
    if device_len < TABLE_LEN + ALIGN {
        return Err(Error::InvalidConfig(format!(
            "a device for namespaces needs at least {} bytes (a {TABLE_LEN}-byte table and \
             one region)",
            TABLE_LEN + ALIGN
        )));
    }
    if std::fs::symlink_metadata(device).is_err() {
        match SharedFile::create(device, device_len, access(group)) {
            Ok(_) | Err(dm_sys::mem::SysError::Exists(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let d = Device::open(device, access(group), true)?;
    let b = d.bytes();
    match Header::parse(&b, d.backing_len) {
        Ok(_) => return Ok(()),
        Err(TableError::NoTable) => {}
        Err(e) => return Err(d.table_error(e)),
    }
    if b[..8] == crate::layout::MAGIC {
        return Err(Error::InvalidArgument(format!(
            "{} holds a pool: destroy it first (`dmrpc pool destroy`)",
            device.display()
        )));
    }
    if b[..8] != [0; 8] {
        return Err(Error::InvalidArgument(format!(
            "{} does not start with zeros: it holds other data, which formatting would destroy",
            device.display()
        )));
    }
    if let Some(len) = d.backing_len.filter(|&l| l < device_len) {
        return Err(Error::InvalidConfig(format!(
            "{} has {len} bytes, fewer than the {device_len} asked for",
            device.display()
        )));
    }
    let h = Header {
        device_len,
        formatted_ms: dm_sys::time::now_ms(),
    }
    .encode();
    // SAFETY: the header lies in the table mapping, which the exclusive
    // lock gives us alone; the magic (its first bytes) is written last.
    unsafe {
        std::ptr::write_bytes(d.table.base(), 0, entry_off(MAX_ENTRIES));
        std::ptr::copy_nonoverlapping(h[8..].as_ptr(), d.table.base().add(8), h.len() - 8);
        std::ptr::copy_nonoverlapping(h.as_ptr(), d.table.base(), 8);
    }
    Ok(())
}

/// Creates namespace `name` on `device` (formatted: [`format()`]) with a
/// pool of `cfg` inside, in the first gap large enough. The region is the
/// pool's length rounded up to [`ALIGN`]. A process killed meanwhile
/// leaves no namespace: the next change of the table frees what it began.
pub fn create(device: &Path, name: &str, cfg: &PoolConfig) -> Result<Namespace> {
    if !valid_name(name) {
        return Err(Error::InvalidArgument(format!(
            "{name:?} is not a namespace name (1 to {NAME_MAX} letters, digits, '.', '_', '-')"
        )));
    }
    let layout = Layout::compute(cfg, dm_sys::rand::random_u64(), dm_sys::time::now_ms())
        .map_err(Error::InvalidConfig)?;
    let size = layout.total_len.div_ceil(ALIGN) * ALIGN;
    let acc = access(cfg.group);
    let d = Device::open(device, acc, true)?;
    let (h, used) = d.recover()?;
    if used.iter().any(|(_, e)| e.name == name) {
        return Err(Error::AlreadyExists(path(device, name)));
    }
    let i = (0..MAX_ENTRIES)
        .find(|i| used.iter().all(|(j, _)| j != i))
        .ok_or(Error::ResourceExhausted {
            what: "namespace entries",
        })?;
    let offset = find_gap(&used, size, h.device_len).ok_or(Error::ResourceExhausted {
        what: "device space",
    })?;
    let mut e = Entry {
        state: State::Creating,
        refs: 0,
        offset,
        size,
        generation: dm_sys::rand::random_u64().max(1),
        created_ms: dm_sys::time::now_ms(),
        // SAFETY: getuid has no preconditions and cannot fail.
        owner_uid: unsafe { libc::getuid() },
        owner_pid: dm_sys::proc::pid(),
        owner_host: crate::shm::host_id(),
        name: name.to_owned(),
    };
    d.write(i, &e);
    pause(Step::Create);
    let file = SharedFile::open_region(device, offset, size, acc)?;
    crate::shm::prepare_backing(&file, &layout, cfg)?;
    Shm::init(file, layout, cfg);
    e.state = State::Ready;
    d.write(i, &e);
    Ok(describe(&d, &e, 0))
}

/// Removes namespace `name` from `device`: its pool is erased and its
/// region returned (to the file system, for a file). Refused with
/// [`Error::InUse`] while a process is attached to its pool. A process
/// killed meanwhile leaves it removed, or there: the next change of the
/// table finishes the removal.
pub fn remove(device: &Path, name: &str) -> Result<()> {
    let d = Device::open(device, Access::Group, true)?;
    let (_, used) = d.recover()?;
    let (i, e) = d.find(&used, name)?;
    let live = count(&d, *i, e);
    if live > 0 {
        return Err(Error::InUse(format!(
            "namespace {name:?} of {} has {live} process(es) attached (`dmrpc pool stats {}` \
             lists them): stop them first",
            device.display(),
            path(device, name).display()
        )));
    }
    let mut gone = e.clone();
    gone.state = State::Removing;
    d.write(*i, &gone);
    pause(Step::Remove);
    d.wipe(e)?;
    d.clear(*i);
    Ok(())
}

/// The namespaces of `device`, by offset, each with its processes counted.
pub fn list(device: &Path) -> Result<Vec<Namespace>> {
    let d = Device::open(device, Access::Group, false)?;
    let (_, mut used) = d.entries()?;
    used.sort_by_key(|(_, e)| e.offset);
    Ok(used
        .iter()
        .map(|(i, e)| {
            let refs = if e.state == State::Ready {
                count(&d, *i, e)
            } else {
                0
            };
            describe(&d, e, refs)
        })
        .collect())
}

/// What the table says of namespace `name` on `device`.
pub fn info(device: &Path, name: &str) -> Result<Namespace> {
    list(device)?
        .into_iter()
        .find(|n| n.name == name)
        .ok_or_else(|| Error::NoNamespace {
            device: device.to_owned(),
            name: name.to_owned(),
            why: String::new(),
        })
}

/// The device's length for namespaces, as its table records it.
pub fn device_len(device: &Path) -> Result<u64> {
    Ok(Device::open(device, Access::Group, false)?
        .header()?
        .device_len)
}

/// Points where a test stops a change of the table halfway, as a crash
/// there would (`testing::stop_namespace_change`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The entry is written `creating`, its pool not yet.
    Create,
    /// The entry is written `removing`, its region not yet wiped.
    Remove,
}

static PAUSE_AT: AtomicU32 = AtomicU32::new(0);

/// Makes this process stop for good at `step` (tests of crash recovery).
pub(crate) fn stop_at(step: Step) {
    PAUSE_AT.store(step as u32 + 1, Ordering::Relaxed);
}

fn pause(step: Step) {
    if PAUSE_AT.load(Ordering::Relaxed) == step as u32 + 1 {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}
