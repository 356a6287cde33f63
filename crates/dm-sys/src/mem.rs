//! Shared file mappings and fixed-address page mappings.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Errors of the OS edge: which call failed, on what, and the OS reason.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    /// The backing path could not be opened or created.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The path given.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The backing file exists already (exclusive create).
    #[error("{0} already exists")]
    Exists(PathBuf),
    /// Sizing the backing file failed.
    #[error("cannot size {path} to {size} bytes: {source}")]
    Resize {
        /// The path.
        path: PathBuf,
        /// The size asked for.
        size: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file system has less free space than the file's size: writing
    /// into the mapping past it would end the process with `SIGBUS`.
    #[error(
        "cannot create {path} of {size} bytes: its file system has {free} bytes free. A mapping \
         written past the free space ends the process with SIGBUS: free space there, or make \
         it smaller"
    )]
    NoSpace {
        /// The path.
        path: PathBuf,
        /// The size asked for.
        size: u64,
        /// The free bytes of its file system.
        free: u64,
    },
    /// A file others could have written, or a symbolic link: mapping it
    /// would let them change this process's shared state.
    #[error("refusing {path}: {why}")]
    Unsafe {
        /// The path.
        path: PathBuf,
        /// What is wrong with it, and what to do.
        why: String,
    },
    /// `mmap` refused the backing file.
    #[error("cannot map {path} ({len} bytes): {source}")]
    Map {
        /// The path.
        path: PathBuf,
        /// The length asked for.
        len: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// A page-table operation (`mmap` fixed, `mprotect`, `munmap`) failed.
    #[error("{op} failed: {source}")]
    PageTable {
        /// The operation.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// A range of addresses asked for is in use in this process (or not
    /// in its address space): what must sit at one address in every
    /// process cannot be mapped here.
    #[error(
        "addresses {addr:#x}..{:#x} are in use in this process: what must sit there cannot be \
         mapped (map it in a process that has the range free, e.g. one that maps it early)",
        addr + *len as u64
    )]
    AddressInUse {
        /// The first address.
        addr: u64,
        /// The length.
        len: usize,
    },
}

/// A backing file (regular file, tmpfs file or DAX device) mapped in full,
/// shared and read-write, at an address the kernel chooses.
///
/// The mapping lives as long as this value. Everything in it may be changed
/// at any time by other processes: read it through atomics or accept torn
/// values, never through `&T` of a type with invalid bit patterns.
/// Who may have written a shared file that is opened: what
/// [`SharedFile::open`] accepts besides a file of this user's alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only this process's user: the file is its own, and writable by
    /// neither its group nor others.
    Own,
    /// Also the file's group (mode 0660): shared with a group on purpose.
    Group,
}

#[derive(Debug)]
pub struct SharedFile {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
    /// Where the mapping starts in the file: 0, or a region's offset
    /// ([`SharedFile::open_region`]).
    file_off: u64,
    /// The huge page size of the file's file system, if it is hugetlbfs.
    huge_page: Option<u64>,
    path: PathBuf,
    /// A bus error in the mapping says which file and why.
    _bus: crate::bus::Watch,
}

// SAFETY: the mapping is plain shared memory; the raw pointer is only an
// address. Concurrent access discipline is the responsibility of users, who
// go through atomics.
unsafe impl Send for SharedFile {}
// SAFETY: as above.
unsafe impl Sync for SharedFile {}

fn cpath(path: &Path) -> Result<CString, SysError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| SysError::Open {
        path: path.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"),
    })
}

impl SharedFile {
    /// Creates `path` exclusively with `size` bytes and maps it, readable
    /// and writable by this user (mode 0600), and by its group too with
    /// [`Access::Group`] (0660, whatever the umask).
    /// A DAX or other character device cannot be created: use [`open`](Self::open).
    pub fn create(path: &Path, size: u64, access: Access) -> Result<Self, SysError> {
        let c = cpath(path)?;
        // SAFETY: `c` is a valid NUL-terminated path.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Err(SysError::Exists(path.to_owned()));
            }
            return Err(SysError::Open {
                path: path.to_owned(),
                source: e,
            });
        }
        // SAFETY: fd was just returned by open and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if access == Access::Group {
            // SAFETY: `fd` is open; the mode is a plain value.
            unsafe { libc::fchmod(fd.as_raw_fd(), 0o660) };
        }
        // On hugetlbfs a file is a whole number of huge pages.
        let size = match hugetlbfs_page(&fd) {
            Some(h) => size.div_ceil(h) * h,
            None => size,
        };
        if let Some(free) = free_bytes(&fd).filter(|&free| free < size) {
            // SAFETY: `c` is valid; we remove the file we just created.
            unsafe { libc::unlink(c.as_ptr()) };
            return Err(SysError::NoSpace {
                path: path.to_owned(),
                size,
                free,
            });
        }
        // SAFETY: fd is a valid open file descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: `c` is valid; we remove the file we just created.
            unsafe { libc::unlink(c.as_ptr()) };
            return Err(SysError::Resize {
                path: path.to_owned(),
                size,
                source: e,
            });
        }
        Self::map(fd, path, 0, size as usize).inspect_err(|_| {
            // SAFETY: `c` is valid; we remove the file we just created.
            unsafe { libc::unlink(c.as_ptr()) };
        })
    }

    /// Opens an existing backing and maps it whole. For regular files the
    /// length is the file size; for devices (DAX) `device_len` must be given.
    ///
    /// A regular file must be this user's, and writable by no one else
    /// (its group too with [`Access::Group`]); a symbolic link is refused.
    /// A device (DAX) is left to its own permissions.
    pub fn open(path: &Path, device_len: Option<u64>, access: Access) -> Result<Self, SysError> {
        let fd = Self::open_fd(path, access)?;
        let len = match device_len {
            Some(l) => l,
            None => file_len(&fd).map_err(|source| SysError::Open {
                path: path.to_owned(),
                source,
            })?,
        };
        Self::map(fd, path, 0, len as usize)
    }

    /// Opens an existing backing, as [`open`](Self::open) does, and maps
    /// only `len` bytes of it from `file_off` (a multiple of the OS page
    /// size): one region of a larger file or device. Offsets into this
    /// mapping are offsets into the region; [`file_off`](Self::file_off)
    /// turns them into the file's.
    pub fn open_region(
        path: &Path,
        file_off: u64,
        len: u64,
        access: Access,
    ) -> Result<Self, SysError> {
        let fd = Self::open_fd(path, access)?;
        Self::map(fd, path, file_off, len as usize)
    }

    fn open_fd(path: &Path, access: Access) -> Result<OwnedFd, SysError> {
        let c = cpath(path)?;
        // SAFETY: `c` is a valid NUL-terminated path.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            )
        };
        if fd < 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::ELOOP) {
                return Err(SysError::Unsafe {
                    path: path.to_owned(),
                    why: "it is a symbolic link: open the pool by its own path".into(),
                });
            }
            return Err(SysError::Open {
                path: path.to_owned(),
                source,
            });
        }
        // SAFETY: fd was just returned by open and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if let Some(why) = unsafe_to_share(&fd, access) {
            return Err(SysError::Unsafe {
                path: path.to_owned(),
                why,
            });
        }
        Ok(fd)
    }

    /// Whether `path` is a character device (a DAX device: it has no file size).
    pub fn is_device(path: &Path) -> bool {
        use std::os::unix::fs::FileTypeExt;
        std::fs::metadata(path)
            .map(|m| m.file_type().is_char_device())
            .unwrap_or(false)
    }

    fn map(fd: OwnedFd, path: &Path, file_off: u64, len: usize) -> Result<Self, SysError> {
        if len == 0 {
            return Err(SysError::Map {
                path: path.to_owned(),
                len,
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty file"),
            });
        }
        // SAFETY: a fresh shared mapping of a file we hold open; the kernel
        // chooses the address, so nothing existing is replaced.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                file_off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(SysError::Map {
                path: path.to_owned(),
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        let huge_page = hugetlbfs_page(&fd);
        let bus = crate::bus::watch(
            p as usize,
            len,
            format!(
                "dmrpc: bus error writing the pool file {}: its file system has no space left for \
                 a page (or the file was cut short). Free space there, make the pool smaller, or \
                 create it with its space reserved (`dmrpc pool create --reserve`, \
                 `PoolConfig::reserve`)",
                path.display()
            ),
        );
        Ok(Self {
            fd,
            base: p.cast(),
            len,
            file_off,
            huge_page,
            path: path.to_owned(),
            _bus: bus,
        })
    }

    /// Allocates the whole file's space now (`fallocate`), so that no
    /// store into the mapping can find its file system full. On tmpfs
    /// this takes the memory at once. A file system without room is
    /// [`SysError::NoSpace`].
    pub fn reserve_space(&self) -> Result<(), SysError> {
        self.reserve_range(0, self.len as u64)
    }

    /// Allocates the space of `len` bytes of the file from `off` now, as
    /// [`SharedFile::reserve_space`] does for the whole file. A file
    /// system that cannot allocate ahead is left as it is.
    pub fn reserve_range(&self, off: u64, len: u64) -> Result<(), SysError> {
        match back_range(self.fd.as_raw_fd(), self.file_off + off, len as usize) {
            Ok(()) => Ok(()),
            Err(libc::ENOSPC) => Err(SysError::NoSpace {
                path: self.path.clone(),
                size: self.len as u64,
                free: free_bytes(&self.fd).unwrap_or(0),
            }),
            Err(e) => Err(SysError::Resize {
                path: self.path.clone(),
                size: self.len as u64,
                source: std::io::Error::from_raw_os_error(e),
            }),
        }
    }

    /// Base address of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never true for a mapped file).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backing path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file descriptor, for mapping single pages elsewhere (at file
    /// offsets: add [`file_off`](Self::file_off) to offsets into the mapping).
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Where the mapping starts in the file (0 unless opened with
    /// [`open_region`](Self::open_region)).
    pub fn file_off(&self) -> u64 {
        self.file_off
    }

    /// The huge page size of the file's file system if it is hugetlbfs:
    /// there a file is a whole number of huge pages, mapped only in whole
    /// huge pages, and cannot be written with `pwrite`.
    pub fn huge_page(&self) -> Option<u64> {
        self.huge_page
    }

    /// Faults in `len` bytes at `offset` ahead of use (`MADV_POPULATE_WRITE`),
    /// so that later accesses cost no page fault. Best effort.
    pub fn prefault(&self, offset: usize, len: usize) {
        if offset >= self.len {
            return;
        }
        let len = len.min(self.len - offset);
        // SAFETY: the range lies within our mapping; madvise does not change
        // the contents.
        unsafe {
            libc::madvise(
                self.base.add(offset).cast(),
                len,
                23, /* MADV_POPULATE_WRITE */
            )
        };
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        // SAFETY: base/len describe the mapping created in `map`, which no
        // reference outlives (borrows of it are tied to `self`).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn file_len(fd: &OwnedFd) -> std::io::Result<u64> {
    // SAFETY: an all-zero stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is valid and `st` is writable.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.st_size as u64)
}

/// Removes a backing file.
pub fn unlink(path: &Path) -> std::io::Result<()> {
    std::fs::remove_file(path)
}

/// The system page size.
pub fn os_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// A range of reserved virtual addresses (`PROT_NONE`, anonymous) into which
/// file pages are mapped at fixed addresses. Unmapped on drop.
#[derive(Debug)]
pub struct Reservation {
    base: *mut u8,
    len: usize,
}

// SAFETY: an address range; access discipline is the caller's.
unsafe impl Send for Reservation {}
// SAFETY: as above.
unsafe impl Sync for Reservation {}

/// Access rights of a fixed mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prot {
    /// Read-only.
    Read,
    /// Read-write.
    ReadWrite,
}

impl Prot {
    fn bits(self) -> i32 {
        match self {
            Prot::Read => libc::PROT_READ,
            Prot::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        }
    }
}

fn last(op: &'static str) -> SysError {
    SysError::PageTable {
        op,
        source: std::io::Error::last_os_error(),
    }
}

impl Reservation {
    /// Reserves `len` bytes of address space (rounded by the caller to pages),
    /// readable as zeros and not writable: a write faults.
    pub fn new(len: usize) -> Result<Self, SysError> {
        // SAFETY: a fresh private anonymous mapping at a kernel-chosen address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last("mmap(reserve)"));
        }
        Ok(Self {
            base: p.cast(),
            len: len.max(1),
        })
    }

    /// Reserves `len` bytes of address space at `addr` exactly (both
    /// multiples of the OS page), as [`new`](Self::new) does: never over a
    /// mapping already there (`MAP_FIXED_NOREPLACE`), which is
    /// [`SysError::AddressInUse`].
    pub fn at(addr: u64, len: usize) -> Result<Self, SysError> {
        let ps = os_page_size() as u64;
        if len == 0 || !addr.is_multiple_of(ps) || !(len as u64).is_multiple_of(ps) {
            return Err(SysError::PageTable {
                op: "mmap(reserve at)",
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "an address or length that is not a multiple of the page",
                ),
            });
        }
        if addr.checked_add(len as u64).is_none() {
            return Err(SysError::AddressInUse { addr, len });
        }
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping:
        // the kernel maps at `addr` only if the range is free.
        let p = unsafe {
            libc::mmap(
                addr as usize as *mut libc::c_void,
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE
                    | libc::MAP_ANONYMOUS
                    | libc::MAP_NORESERVE
                    | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EEXIST) | Some(libc::ENOMEM) | Some(libc::EINVAL) => {
                    SysError::AddressInUse { addr, len }
                }
                _ => SysError::PageTable {
                    op: "mmap(reserve at)",
                    source: e,
                },
            });
        }
        if p as u64 != addr {
            // (A kernel older than 4.17 takes the flag as a hint.)
            // SAFETY: the mapping just made, unmapped whole.
            unsafe { libc::munmap(p, len) };
            return Err(SysError::AddressInUse { addr, len });
        }
        Ok(Self {
            base: p.cast(),
            len,
        })
    }

    /// Base address.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the reservation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maps `len` bytes of `fd` at file offset `file_off` at `self.base + at`.
    pub fn map_file(
        &self,
        at: usize,
        fd: i32,
        file_off: u64,
        len: usize,
        prot: Prot,
    ) -> Result<(), SysError> {
        if at.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(SysError::PageTable {
                op: "mmap(fixed)",
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "outside reservation",
                ),
            });
        }
        // SAFETY: the target range lies inside our reservation.
        unsafe { map_file_fixed(self.base.add(at), fd, file_off, len, prot) }
    }
}

/// Maps `len` bytes of `fd` at `file_off` over `addr` (`MAP_SHARED|MAP_FIXED`).
/// Writes `src` into the file at `file_off` (`pwrite`, repeated until all
/// is written). The error is the `errno`: `ENOSPC` when the file system
/// is full, where a store through a mapping would raise `SIGBUS`.
///
/// System calls only, no allocation: callable from a signal handler.
pub fn write_at(fd: i32, src: &[u8], file_off: u64) -> Result<(), i32> {
    let mut done = 0usize;
    while done < src.len() {
        let rest = &src[done..];
        // SAFETY: `rest` is readable for its length; pwrite only reads it.
        let r = unsafe {
            libc::pwrite(
                fd,
                rest.as_ptr().cast(),
                rest.len(),
                (file_off + done as u64) as libc::off_t,
            )
        };
        if r > 0 {
            done += r as usize;
            continue;
        }
        if r == 0 {
            return Err(libc::ENOSPC);
        }
        // SAFETY: __errno_location returns this thread's errno.
        match unsafe { *libc::__errno_location() } {
            libc::EINTR => continue,
            e => return Err(e),
        }
    }
    Ok(())
}

/// Gives `len` bytes of the file at `file_off` their storage now
/// (`fallocate`), so that stores through a mapping of them cannot raise
/// `SIGBUS` for want of space. The error is the `errno`: `ENOSPC` when the
/// file system is full. A file system that cannot allocate ahead (no
/// `fallocate` there) is `Ok`: stores may still find it full.
///
/// One system call, no allocation: callable from a signal handler.
pub fn back_range(fd: i32, file_off: u64, len: usize) -> Result<(), i32> {
    loop {
        // SAFETY: fallocate only reads its arguments; a bad fd or range is
        // an error, not undefined behaviour.
        let r = unsafe { libc::fallocate(fd, 0, file_off as libc::off_t, len as libc::off_t) };
        if r == 0 {
            return Ok(());
        }
        // SAFETY: __errno_location returns this thread's errno.
        match unsafe { *libc::__errno_location() } {
            libc::EINTR => continue,
            libc::EOPNOTSUPP | libc::ENODEV | libc::ESPIPE => return Ok(()),
            e => return Err(e),
        }
    }
}

/// Returns `len` bytes of the file at `file_off` to its file system
/// (`fallocate` with `FALLOC_FL_PUNCH_HOLE`): they read as zeros after.
/// `Ok(false)` for a file or device that cannot punch holes (a DAX
/// device): it is left as it is. The error is the `errno`.
pub fn punch_hole(fd: i32, file_off: u64, len: u64) -> Result<bool, i32> {
    loop {
        // SAFETY: fallocate only reads its arguments.
        let r = unsafe {
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                file_off as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        // SAFETY: __errno_location returns this thread's errno.
        match unsafe { *libc::__errno_location() } {
            libc::EINTR => continue,
            libc::EOPNOTSUPP | libc::ENODEV | libc::ESPIPE | libc::EINVAL => return Ok(false),
            e => return Err(e),
        }
    }
}

/// Takes an open-file-description lock (`F_OFD_SETLKW`) on `len` bytes of
/// `fd` at `file_off`, shared or exclusive, waiting for it. The kernel lets
/// go of it when the descriptor is closed or its process dies, so a lock is
/// never left behind by a crash. Locks are per host: processes of other
/// hosts sharing a device do not see them.
pub fn lock_range(fd: i32, file_off: u64, len: u64, exclusive: bool) -> std::io::Result<()> {
    let kind = if exclusive {
        libc::F_WRLCK
    } else {
        libc::F_RDLCK
    };
    ofd_lock(fd, libc::F_OFD_SETLKW, kind, file_off, len)
}

/// Lets go of a lock taken with [`lock_range`].
pub fn unlock_range(fd: i32, file_off: u64, len: u64) -> std::io::Result<()> {
    ofd_lock(fd, libc::F_OFD_SETLK, libc::F_UNLCK, file_off, len)
}

fn ofd_lock(fd: i32, cmd: i32, kind: i32, file_off: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: an all-zero flock is a valid value to fill in.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = file_off as libc::off_t;
    fl.l_len = len as libc::off_t;
    loop {
        // SAFETY: `fl` is a valid flock; l_pid must be 0 for OFD locks,
        // which the zeroed value gives.
        if unsafe { libc::fcntl(fd, cmd, &mut fl) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// A raw syscall wrapper with no allocation: callable from a signal handler.
///
/// # Safety
/// `addr..addr+len` must be a page-aligned range this process owns (a
/// [`Reservation`]), with no live Rust references into it.
pub unsafe fn map_file_fixed(
    addr: *mut u8,
    fd: i32,
    file_off: u64,
    len: usize,
    prot: Prot,
) -> Result<(), SysError> {
    // SAFETY: per the function contract the range is ours to replace.
    let p = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            prot.bits(),
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            file_off as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(last("mmap(fixed)"));
    }
    Ok(())
}

/// Changes the protection of `addr..addr+len`. Async-signal-safe.
///
/// # Safety
/// The range must be page-aligned and owned by the caller (a [`Reservation`]).
pub unsafe fn protect(addr: *mut u8, len: usize, prot: Prot) -> Result<(), SysError> {
    // SAFETY: per the function contract.
    if unsafe { libc::mprotect(addr.cast(), len, prot.bits()) } != 0 {
        return Err(last("mprotect"));
    }
    Ok(())
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: base/len is the reservation made in `new`; fixed mappings
        // inside it are removed with it.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Private anonymous memory, read-write, touched at creation and locked in
/// RAM where the limits allow (a memory server's pinned region). Unmapped
/// on drop.
#[derive(Debug)]
pub struct PinnedRegion {
    base: *mut u8,
    len: usize,
    locked: bool,
}

// SAFETY: plain memory; access discipline is the caller's.
unsafe impl Send for PinnedRegion {}
// SAFETY: as above.
unsafe impl Sync for PinnedRegion {}

impl PinnedRegion {
    /// Maps `len` bytes (populated: every page faulted in now, so no
    /// request pays a first-touch fault) and tries to `mlock` them.
    pub fn new(len: usize) -> Result<Self, SysError> {
        // SAFETY: a fresh private anonymous mapping at a kernel-chosen address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last("mmap(region)"));
        }
        // SAFETY: the range was just mapped by us.
        let locked = unsafe { libc::mlock(p, len.max(1)) } == 0;
        Ok(Self {
            base: p.cast(),
            len: len.max(1),
            locked,
        })
    }

    /// Base address.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty (at least one byte is mapped).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `mlock` succeeded (else the pages are populated but may be
    /// swapped out under memory pressure).
    pub fn locked(&self) -> bool {
        self.locked
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// The bytes an unprivileged writer may still use on the file system of
/// the regular file `fd` (None for a device, or if it cannot be told).
/// `f_type` of a hugetlbfs file system (`statfs(2)`).
const HUGETLBFS_MAGIC: libc::c_long = 0x9584_58f6;

/// The huge page size of the file system of `fd` if it is hugetlbfs.
fn hugetlbfs_page(fd: &OwnedFd) -> Option<u64> {
    // SAFETY: a zeroed statfs is a valid value of a plain C struct.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open; `fs` is a valid out-pointer.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } != 0 {
        return None;
    }
    (fs.f_type as libc::c_long == HUGETLBFS_MAGIC && fs.f_bsize > 0).then_some(fs.f_bsize as u64)
}

/// Huge pages of `size` bytes the kernel has free (for hugetlbfs mounts
/// with no size limit of their own).
fn free_huge_pages(size: u64) -> Option<u64> {
    let p = format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB/free_hugepages",
        size >> 10
    );
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn free_bytes(fd: &OwnedFd) -> Option<u64> {
    // SAFETY: zeroed stat and statvfs are valid values of plain C structs.
    let (mut st, mut vfs): (libc::stat, libc::statvfs) =
        unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: `fd` is open; `st` is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0
        || st.st_mode & libc::S_IFMT != libc::S_IFREG
    {
        return None;
    }
    // SAFETY: `fd` is open; `vfs` is a valid out-pointer.
    if unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut vfs) } != 0 {
        return None;
    }
    if let Some(h) = hugetlbfs_page(fd).filter(|_| vfs.f_blocks == 0) {
        // A hugetlbfs mount with no limit of its own: the kernel's pool.
        return Some(free_huge_pages(h)?.saturating_mul(h));
    }
    Some(vfs.f_bavail.saturating_mul(vfs.f_frsize))
}

/// Why the regular file `fd` is not safe to map with `access` (None: it
/// is, or it is not a regular file).
fn unsafe_to_share(fd: &OwnedFd, access: Access) -> Option<String> {
    // SAFETY: a zeroed stat is a valid value of a plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open; `st` is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0
        || st.st_mode & libc::S_IFMT != libc::S_IFREG
    {
        return None;
    }
    // SAFETY: geteuid takes no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    if st.st_uid != me {
        return Some(format!(
            "it belongs to user {}, not to this process's user {me}: a pool is attached by \
             its owner's processes",
            st.st_uid
        ));
    }
    if st.st_mode & 0o002 != 0 {
        return Some(format!(
            "any user may write it (mode {:o}): `chmod o-w` it",
            st.st_mode & 0o777
        ));
    }
    if st.st_mode & 0o020 != 0 && access != Access::Group {
        return Some(format!(
            "its group may write it (mode {:o}): `chmod g-w` it, or attach it as shared with \
             its group (`AttachOptions::group`)",
            st.st_mode & 0o777
        ));
    }
    None
}
