//! A device's segment table as a process holds it: mapped, locked, read
//! back checked, written under the lock; and the tie of an attached
//! namespace to its entry. What needs a pool (creating one, counting its
//! processes) is in `mod.rs`.

use super::table;
use super::table::{check_entries, entry_off, Entry, Header, TableError, ENTRY_LEN};
use super::{valid_name, State, MAX_ENTRIES, TABLE_LEN};
use crate::error::{Error, Result};
use dm_sys::mem::{Access, SharedFile};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// The path of namespace `name` on `device`: `DEVICE/NAME`.
pub fn path(device: &Path, name: &str) -> PathBuf {
    device.join(name)
}

/// `(device, name)` when `path` addresses a namespace: it does not exist
/// itself, its last part is a valid namespace name, and its parent is a
/// regular file or a character device (not a directory).
pub fn split(path: &Path) -> Option<(PathBuf, String)> {
    use std::os::unix::fs::FileTypeExt;
    if path.symlink_metadata().is_ok() {
        return None;
    }
    let name = path.file_name()?.to_str()?;
    let device = path.parent().filter(|p| !p.as_os_str().is_empty())?;
    let t = std::fs::metadata(device).ok()?.file_type();
    (valid_name(name) && (t.is_file() || t.is_char_device()))
        .then(|| (device.to_owned(), name.to_owned()))
}

/// The table of a device, mapped, with the lock taken on it.
pub(super) struct Device {
    pub(super) path: PathBuf,
    pub(super) table: SharedFile,
    /// The file's length (None for a character device: it has none).
    pub(super) backing_len: Option<u64>,
}

impl Device {
    /// Maps the table of `path` and takes the lock, exclusive or shared.
    pub(super) fn open(path: &Path, access: Access, exclusive: bool) -> Result<Device> {
        let backing_len = if SharedFile::is_device(path) {
            None
        } else {
            let m = std::fs::metadata(path).map_err(|source| dm_sys::mem::SysError::Open {
                path: path.to_owned(),
                source,
            })?;
            Some(m.len())
        };
        if backing_len.is_some_and(|l| l < TABLE_LEN) {
            return Err(Error::NoNamespace {
                device: path.to_owned(),
                name: String::new(),
                why: format!(" (it is smaller than a segment table's {TABLE_LEN} bytes)"),
            });
        }
        let table = SharedFile::open_region(path, 0, TABLE_LEN, access)?;
        dm_sys::mem::lock_range(table.raw_fd(), 0, TABLE_LEN, exclusive)?;
        Ok(Device {
            path: path.to_owned(),
            table,
            backing_len,
        })
    }

    /// The table's bytes (a copy: other processes may write it).
    pub(super) fn bytes(&self) -> Vec<u8> {
        let n = entry_off(MAX_ENTRIES);
        let mut v = vec![0u8; n];
        // SAFETY: the table mapping is TABLE_LEN >= n bytes; any bytes are
        // acceptable (they are checked after), torn ones included.
        unsafe { std::ptr::copy_nonoverlapping(self.table.base(), v.as_mut_ptr(), n) };
        v
    }

    pub(super) fn header(&self) -> Result<Header> {
        Header::parse(&self.bytes(), self.backing_len).map_err(|e| self.table_error(e))
    }

    pub(super) fn table_error(&self, e: TableError) -> Error {
        let d = self.path.display();
        match e {
            TableError::NoTable => Error::NoNamespace {
                device: self.path.clone(),
                name: String::new(),
                why: " (it holds no segment table: `dmrpc ns create DEVICE NAME --size S \
                      --device-size D` makes one)"
                    .into(),
            },
            TableError::Version(v) => Error::Corrupt(format!(
                "the segment table of {d} is format version {v}; this build reads {}",
                table::NS_VERSION
            )),
            TableError::Corrupt(why) => {
                Error::Corrupt(format!("the segment table of {d} is corrupt: {why}"))
            }
        }
    }

    /// The header and the used entries, checked.
    pub(super) fn entries(&self) -> Result<(Header, Vec<(u32, Entry)>)> {
        let h = self.header()?;
        let used = check_entries(&self.bytes(), &h).map_err(|e| self.table_error(e))?;
        Ok((h, used))
    }

    pub(super) fn word(&self, i: u32, at: usize) -> &AtomicU32 {
        let off = entry_off(i) + at;
        assert!(off + 4 <= TABLE_LEN as usize && off.is_multiple_of(4));
        // SAFETY: in bounds of the table mapping (checked), 4-aligned (the
        // mapping is page-aligned), and only ever used as an atomic.
        unsafe { &*self.table.base().add(off).cast::<AtomicU32>() }
    }

    pub(super) fn refs(&self, i: u32) -> &AtomicU32 {
        self.word(i, table::REFS_OFF)
    }

    pub(super) fn generation(&self, i: u32) -> &AtomicU64 {
        let off = entry_off(i) + 24;
        assert!(off + 8 <= TABLE_LEN as usize && off.is_multiple_of(8));
        // SAFETY: in bounds and 8-aligned (checked), as in `word`.
        unsafe { &*self.table.base().add(off).cast::<AtomicU64>() }
    }

    /// Writes entry `i` (exclusive lock held): its fields, then its state.
    pub(super) fn write(&self, i: u32, e: &Entry) {
        let b = e.encode();
        // SAFETY: the entry lies in the table mapping; nobody else writes
        // these bytes while the exclusive lock is held (detaching processes
        // change only the reference count, which is skipped here and
        // stored whole after).
        unsafe {
            std::ptr::copy_nonoverlapping(
                b[8..].as_ptr(),
                self.table.base().add(entry_off(i) + 8),
                ENTRY_LEN - 8,
            )
        };
        self.refs(i).store(e.refs, Ordering::Release);
        self.word(i, 0).store(e.state.word(), Ordering::Release);
    }

    /// Frees entry `i` (exclusive lock held).
    pub(super) fn clear(&self, i: u32) {
        self.word(i, 0).store(0, Ordering::Release);
        // SAFETY: as in `write`.
        unsafe { std::ptr::write_bytes(self.table.base().add(entry_off(i) + 4), 0, ENTRY_LEN - 4) };
    }

    /// Finishes what crashed processes left half done (exclusive lock
    /// held), and returns the table.
    pub(super) fn recover(&self) -> Result<(Header, Vec<(u32, Entry)>)> {
        let (h, mut used) = self.entries()?;
        for (i, e) in &used {
            if matches!(e.state, State::Creating | State::Removing) {
                self.wipe(e)?;
                self.clear(*i);
            }
        }
        used.retain(|(_, e)| e.state == State::Ready);
        Ok((h, used))
    }

    /// Returns a region's bytes to zeros: its space back to the file
    /// system where holes can be punched, else written over.
    pub(super) fn wipe(&self, e: &Entry) -> Result<()> {
        match dm_sys::mem::punch_hole(self.table.raw_fd(), e.offset, e.size) {
            Ok(true) => Ok(()),
            Ok(false) => {
                let r = SharedFile::open_region(&self.path, e.offset, e.size, Access::Group)?;
                // SAFETY: the region is ours to change: nobody is attached
                // (its entry is being freed under the exclusive lock).
                unsafe { std::ptr::write_bytes(r.base(), 0, r.len()) };
                Ok(())
            }
            Err(errno) => Err(std::io::Error::from_raw_os_error(errno).into()),
        }
    }

    pub(super) fn find<'a>(
        &self,
        used: &'a [(u32, Entry)],
        name: &str,
    ) -> Result<&'a (u32, Entry)> {
        used.iter()
            .find(|(_, e)| e.name == name)
            .ok_or_else(|| Error::NoNamespace {
                device: self.path.clone(),
                name: name.to_owned(),
                why: String::new(),
            })
    }
}

pub(super) fn access(group: bool) -> Access {
    if group {
        Access::Group
    } else {
        Access::Own
    }
}

/// A mapped namespace's tie to its table entry: the shared lock, held
/// until the attaching process has its slot, and the reference count.
pub(crate) struct Link {
    device: Device,
    index: u32,
    generation: u64,
    counted: AtomicBool,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("device", &self.device.path)
            .field("index", &self.index)
            .finish()
    }
}

/// Maps the region of namespace `name` on `device`, holding the shared
/// lock on the table (so that it is not removed) until [`Link::attached`]
/// or the link's drop.
pub(crate) fn open(device: &Path, name: &str, access: Access) -> Result<(SharedFile, Link)> {
    let d = Device::open(device, access, false)?;
    let (_, used) = d.entries()?;
    let (i, e) = d.find(&used, name)?;
    if e.state != State::Ready {
        return Err(Error::NoNamespace {
            device: device.to_owned(),
            name: name.to_owned(),
            why: format!(
                " ready: it is {} (a process died doing that; the next change of the table \
                 finishes it)",
                e.state.as_str()
            ),
        });
    }
    let file = SharedFile::open_region(device, e.offset, e.size, access)?;
    let link = Link {
        device: d,
        index: *i,
        generation: e.generation,
        counted: AtomicBool::new(false),
    };
    Ok((file, link))
}

impl Link {
    /// The attaching process has its slot: count it, and let go of the lock.
    pub(crate) fn attached(&self) {
        self.device.refs(self.index).fetch_add(1, Ordering::AcqRel);
        self.counted.store(true, Ordering::Release);
        let _ = dm_sys::mem::unlock_range(self.device.table.raw_fd(), 0, TABLE_LEN);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // The entry may have been freed and reused (this process lost its
        // slot): then the count is another namespace's.
        if self.counted.load(Ordering::Acquire)
            && self.device.generation(self.index).load(Ordering::Acquire) == self.generation
        {
            let _ = self.device.refs(self.index).fetch_update(
                Ordering::AcqRel,
                Ordering::Acquire,
                |n| n.checked_sub(1),
            );
        }
    }
}
