//! The pool file format (version 9): header, areas, and their validation.
//!
//! ```text
//! 0        header (4 KiB): immutable part (checksummed), the pool's secret
//!          at 256 (32 random bytes), then shared atomics at 512
//! pt_off   page table: one u64 per data page            (see pages.rs)
//! st_off   stripe locks: one u64 per 64 data pages      (see pages.rs)
//! slot_off slot table: SLOT_SIZE bytes per slot         (see slot.rs)
//! desc_off descriptor table: DESC_SIZE bytes per desc   (see desc.rs)
//! exp_off  expiry summary: one u64 per EXPIRY_GROUP descs (see expiry.rs)
//! reg_off  service registry: SERVICE_SIZE bytes each    (see registry.rs)
//! chan_off channels: 4 KiB + 2 * ring_size bytes each   (see channel.rs)
//! data_off data pages, page_size each, aligned to page_size
//! ```
//!
//! Everything in the pool is addressed by offset or index, never by pointer,
//! so each process may map the pool anywhere. The immutable header is written
//! once by the creator, then `ready` is set; openers check magic, version,
//! checksum and that every area lies inside the file before touching anything.
//! Any change to this layout, the page-table word, the slot or descriptor
//! record or the Ref encoding bumps [`POOL_VERSION`].

use crate::desc::DESC_SIZE;
use crate::slot::SLOT_SIZE;
use crate::sync::{AtomicU32, AtomicU64};

/// Size of a service record (its fields: `registry.rs`).
pub(crate) const SERVICE_SIZE: usize = 512;

/// Bytes of the control page at the start of each channel (its fields:
/// `channel.rs`).
pub(crate) const CONTROL_LEN: usize = 4096;

/// Magic bytes at offset 0.
pub(crate) const MAGIC: [u8; 8] = *b"DMRPOOL\0";
/// Format version this build reads and writes (history: `CHANGELOG.md`).
pub const POOL_VERSION: u32 = 9;
/// Where the pool's secret lies in the header: 32 random bytes written at
/// creation, known to the processes that can read the pool (zero in pools
/// created before there was one).
pub(crate) const SECRET_OFF: usize = 256;
/// Bytes of the pool's secret.
pub(crate) const SECRET_LEN: usize = 32;
/// Bytes reserved for the header.
pub(crate) const HEADER_LEN: u64 = 4096;
/// Offset of the shared atomics inside the header.
pub(crate) const ATOMICS_OFF: usize = 512;
const IMMUTABLE_LEN: usize = 192;
/// Descriptors per word of the expiry summary (`expiry.rs`).
pub const EXPIRY_GROUP: u32 = 64;

/// Words of the expiry summary for `descs` descriptors.
pub(crate) fn words_for(descs: u32) -> u64 {
    descs.div_ceil(EXPIRY_GROUP) as u64
}

/// Smallest allowed page size.
pub(crate) const MIN_PAGE_SIZE: u32 = 4096;
/// Largest allowed page size.
pub(crate) const MAX_PAGE_SIZE: u32 = 1 << 30;

/// The immutable part of the header, decoded and validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Page size in bytes (power of two, >= 4 KiB).
    pub page_size: u32,
    /// Random pool id (in every Ref).
    pub pool_id: u64,
    /// Bytes of the backing used by the pool.
    pub total_len: u64,
    /// Number of data pages.
    pub n_pages: u32,
    /// Number of slots (attached processes at once).
    pub n_slots: u32,
    /// Number of descriptors (buffers + Refs at once).
    pub n_descs: u32,
    /// Offset of the page table.
    pub pt_off: u64,
    /// Offset of the stripe-lock table.
    pub st_off: u64,
    /// Offset of the slot table.
    pub slot_off: u64,
    /// Offset of the descriptor table.
    pub desc_off: u64,
    /// Offset of the expiry summary: for each group of
    /// [`EXPIRY_GROUP`] descriptors, a time at
    /// or before which none of its Refs expires (`expiry.rs`).
    pub exp_off: u64,
    /// Number of service records (registered services at once).
    pub n_services: u32,
    /// Offset of the service registry.
    pub reg_off: u64,
    /// Number of channels (connections at once).
    pub n_channels: u32,
    /// Bytes of each ring of a channel (a power of two).
    pub ring_size: u32,
    /// Offset of the channel table.
    pub chan_off: u64,
    /// Offset of the first data page.
    pub data_off: u64,
    /// Default lease of a slot, ms.
    pub lease_ms: u64,
    /// Default TTL of a Ref, ms.
    pub ref_ttl_ms: u64,
    /// Creation time, ms since the epoch.
    pub created_ms: u64,
    /// The clock Ref expiries are kept on.
    pub ref_clock: RefClock,
    /// Pool name (up to 32 bytes).
    pub name: String,
}

/// The clock a pool keeps its Refs' expiries on (`Desc::expiry_ms`), chosen
/// at creation ([`PoolConfig::ref_clock`]).
///
/// A Ref lives for its TTL (a minute by default) on this clock. The wall
/// clock can step (NTP, a manual change, a VM resumed from a snapshot): a
/// forward step longer than a TTL would expire every Ref in flight, a
/// backward one would keep dead Refs for as long as the step. A host's
/// monotonic clock never steps, but means nothing to another host or after
/// a reboot, so a [`RefClock::Host`] pool belongs to one host's boot: the
/// header atomic `ref_clock_host` names it, a process of another host is
/// refused while one of the owner's processes is alive
/// ([`Error::RefClockInUse`](crate::Error::RefClockInUse)), and the first
/// process of a new boot takes the clock over and expires every Ref of the
/// old one (no holder of them survived it).
///
/// Processes of one host must read one monotonic clock: a process in a
/// time namespace of its own (`unshare -T`) reads it shifted, and would
/// see Refs expire early or late by the shift (as its leases would look
/// skewed: see `dm_sys::time::monotonic_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RefClock {
    /// `CLOCK_REALTIME` (header code 0): the clock hosts share, for a
    /// pool on a device several hosts attach (assumed NTP-synchronised
    /// well within a TTL).
    Wall = 0,
    /// `CLOCK_MONOTONIC` of the host that owns the pool (the default;
    /// header code 1).
    #[default]
    Host = 1,
}

impl RefClock {
    /// Every clock, in the order of their header codes.
    const ALL: [RefClock; 2] = [RefClock::Wall, RefClock::Host];

    /// Header encoding.
    fn code(self) -> u32 {
        self as u32
    }

    fn from_code(c: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.code() == c)
    }

    /// The clock's name, as `dmrpc pool create --ref-clock` takes it.
    pub fn name(self) -> &'static str {
        match self {
            RefClock::Wall => "wall",
            RefClock::Host => "host",
        }
    }
}

impl std::str::FromStr for RefClock {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("Ref clock {s:?} is neither \"host\" nor \"wall\""))
    }
}

/// Shared counters and cursors, at [`ATOMICS_OFF`] in the header.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct HeaderAtomics {
    /// 0 while the creator initialises, [`READY`] after.
    pub ready: AtomicU32,
    _pad: AtomicU32,
    /// Where the next page claim starts scanning.
    pub page_cursor: AtomicU64,
    /// Where the next descriptor claim started scanning, up to the session
    /// after pool format 5 was introduced; claims now start from a hint
    /// private to each process, so nothing reads or writes it. Kept so the
    /// layout (and format 5) stays as it is.
    pub desc_cursor: AtomicU64,
    /// Maintenance lock (gc recount): holder slot + 1, or 0.
    pub maint: AtomicU64,
    /// Pages copied by copy-on-write, ever.
    pub cow_copies: AtomicU64,
    /// Refs created, ever.
    pub refs_created: AtomicU64,
    /// Refs reclaimed by TTL, ever.
    pub refs_expired: AtomicU64,
    /// Slots reclaimed after lease expiry, ever.
    pub slots_reclaimed: AtomicU64,
    /// Registry lock: `slot + 1 | incarnation << 16` of the holder, or 0.
    pub reg_lock: AtomicU64,
    /// A [`RefClock::Host`] pool: the host (boot id hash, as in a slot's
    /// `host`) whose monotonic clock the Refs' expiries are on. Set by the
    /// creator; replaced, under `maint`, by the first process of another
    /// boot once no process of the old one is alive (since format 7).
    pub ref_clock_host: AtomicU64,
    /// How long a slot judged by its lease is kept after its lease ran
    /// out before its holdings are reused, in ms (`Shm::in_quarantine`;
    /// since the quarantine was added to format 7, so 0, none, in pools
    /// created before).
    pub quarantine_ms: AtomicU64,
    /// Lists a buffer copied because a Ref shared them, ever (since
    /// format 9).
    pub lists_copied: AtomicU64,
    /// The expiry summary's own summary: a time before which no group's
    /// word is due (`expiry.rs`; since format 9).
    pub expiry_top: AtomicU64,
}

/// Where the quota table lies in the header (after the atomics; zeros in
/// a pool created before quotas: no quota).
pub(crate) const QUOTAS_OFF: usize = 1024;
/// Tenants a pool may name.
pub const MAX_TENANTS: usize = 16;
/// Bytes of a tenant's name, at most.
pub const TENANT_NAME_MAX: usize = 24;

/// The quota table, at [`QUOTAS_OFF`] in the header (`quota.rs`).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Quotas {
    /// Every process's quota in pages, unless its attach asks for less
    /// (0: none).
    pub process_pages: AtomicU64,
    /// The tenants (a name of all zeros: an unused record).
    pub tenants: [Tenant; MAX_TENANTS],
}

/// A tenant: processes that attach as it share its quota.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Tenant {
    /// Name, NUL padded.
    pub name: [AtomicU64; 3],
    /// Quota in pages (0: none).
    pub quota_pages: AtomicU64,
    /// Pages its processes' buffers hold.
    pub held_pages: AtomicU64,
    _rsv: AtomicU64,
}

#[cfg(not(loom))]
const _: () = assert!(
    ATOMICS_OFF + std::mem::size_of::<HeaderAtomics>() <= QUOTAS_OFF
        && QUOTAS_OFF + std::mem::size_of::<Quotas>() <= HEADER_LEN as usize
);

/// Most service records a pool may have.
pub(crate) const MAX_SERVICES: u32 = 1 << 16;
/// Most channels a pool may have.
pub(crate) const MAX_CHANNELS: u32 = 1 << 16;
/// Smallest ring.
pub const MIN_RING: u32 = 4096;
/// Largest ring.
pub const MAX_RING: u32 = 16 << 20;

fn valid_ring_size(r: u32) -> bool {
    r.is_power_of_two() && (MIN_RING..=MAX_RING).contains(&r)
}

/// Bytes of one channel: a 4 KiB control page (the pool's record, then the
/// RPC layer's ring cursors), then the two rings.
pub(crate) fn channel_stride(ring_size: u32) -> u64 {
    CONTROL_LEN as u64 + 2 * ring_size as u64
}

/// Value of `ready` once the pool is initialised.
pub(crate) const READY: u32 = 0x5245_4459;

/// FNV-1a (64-bit): the header checksum, and other small stable hashes.
pub(crate) fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

/// Parameters for creating a pool.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Total size of the backing in bytes. Default 1 GiB.
    pub size: u64,
    /// Page size (power of two, >= 4 KiB). Default 4 KiB.
    pub page_size: u32,
    /// Slots (processes attached at once). Default 256.
    pub slots: u32,
    /// Descriptors (live buffers + Refs at once). Default: a quarter of the
    /// page count, at least 1024.
    pub descs: Option<u32>,
    /// Default lease of a slot in ms: a process silent this long is
    /// considered dead and its holdings reclaimed. Default 2000.
    pub lease_ms: u64,
    /// Default TTL of a Ref in ms. Default 60000.
    pub ref_ttl_ms: u64,
    /// Service records (services registered at once). Default 128.
    pub services: u32,
    /// Channels (RPC connections over shared memory at once). Default: as
    /// many as fit in a sixteenth of the pool, at most 64 (none in a pool
    /// too small for one).
    pub channels: Option<u32>,
    /// Bytes of each of a channel's two rings (power of two, 4 KiB to
    /// 16 MiB). Default 256 KiB (the RPC layer's default inline threshold,
    /// 64 KiB, needs a frame of that size to fit twice in half a ring).
    pub ring_size: u32,
    /// The clock Refs' expiries are kept on. Default [`RefClock::Host`];
    /// [`RefClock::Wall`] for a pool several hosts attach.
    pub ref_clock: RefClock,
    /// Name recorded in the header.
    pub name: String,
    /// Create the file readable and writable by its group too (mode 0660),
    /// for processes of several users in one group; they attach with
    /// `AttachOptions::group`. Default false (mode 0600).
    pub group: bool,
    /// Allocate the file's whole space at creation (`fallocate`): a pool
    /// that does not fit is refused, and no store into it can later find
    /// its file system full (a bus error). On tmpfs the memory is taken at
    /// once. Default false: space is taken as pages are first written, and
    /// creation checks only that the file system has the room now.
    pub reserve: bool,
    /// Bytes of buffers each process may hold at most, unless its attach
    /// asks for less (`AttachOptions::quota`). Default: no quota.
    pub process_quota: Option<u64>,
    /// Tenants and their quotas in bytes: the processes that attach as a
    /// tenant (`AttachOptions::tenant`) share its quota. At most
    /// [`MAX_TENANTS`], names of 1 to [`TENANT_NAME_MAX`] bytes.
    pub tenants: Vec<(String, u64)>,
    /// How long the holdings of a process judged by its lease (of another
    /// host or PID namespace) are kept after its lease ran out, in ms,
    /// before others reuse them: a process that was only stopped and
    /// resumes within it loses nothing and overwrites no one. Default
    /// 30 s. 0: reused at once (a stopped process that resumes later may
    /// store into pages handed to another).
    pub quarantine_ms: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            size: 1 << 30,
            page_size: 4096,
            slots: 256,
            descs: None,
            lease_ms: 2000,
            ref_ttl_ms: 60_000,
            services: 128,
            channels: None,
            ring_size: 256 << 10,
            ref_clock: RefClock::Host,
            name: String::new(),
            group: false,
            reserve: false,
            process_quota: None,
            tenants: Vec::new(),
            quarantine_ms: 30_000,
        }
    }
}

impl PoolConfig {
    /// Channels this configuration gives (see [`PoolConfig::channels`]).
    pub fn channel_count(&self) -> u32 {
        self.channels.unwrap_or_else(|| {
            let stride = channel_stride(self.ring_size.clamp(MIN_RING, MAX_RING));
            (self.size / 16 / stride).min(64) as u32
        })
    }
}

impl Layout {
    /// Computes the layout for a configuration, or says why it cannot exist.
    pub fn compute(cfg: &PoolConfig, pool_id: u64, created_ms: u64) -> Result<Layout, String> {
        let ps = cfg.page_size;
        if !ps.is_power_of_two() || !(MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&ps) {
            return Err(format!(
                "page size {ps} must be a power of two between {MIN_PAGE_SIZE} and {MAX_PAGE_SIZE}"
            ));
        }
        if cfg.slots == 0 || cfg.slots > u16::MAX as u32 {
            return Err(format!("slots must be between 1 and {}", u16::MAX));
        }
        if cfg.name.len() > 32 {
            return Err("pool name is longer than 32 bytes".into());
        }
        validate_quotas(cfg)?;
        if cfg.services > MAX_SERVICES || cfg.channels.unwrap_or(0) > MAX_CHANNELS {
            return Err(format!(
                "at most {MAX_SERVICES} services and {MAX_CHANNELS} channels"
            ));
        }
        if !valid_ring_size(cfg.ring_size) {
            return Err(format!(
                "ring size {} must be a power of two between {MIN_RING} and {MAX_RING}",
                cfg.ring_size
            ));
        }
        let ps64 = ps as u64;
        let mut n = (cfg.size / ps64).min(crate::pages::MAX_PAGES as u64);
        loop {
            if n == 0 {
                return Err(format!("size {} is too small for any data page", cfg.size));
            }
            let descs = cfg
                .descs
                .unwrap_or(((n / 4) as u32).max(1024))
                .clamp(1, crate::pages::MAX_LOCK_DESC);
            let l = Self::place(cfg, ps, n as u32, descs, pool_id, created_ms)
                .ok_or("size overflows")?;
            if l.data_off + n * ps64 <= cfg.size {
                return Ok(l);
            }
            // Shrink by the metadata overshoot (at least one page).
            let over = (l.data_off + n * ps64 - cfg.size).div_ceil(ps64).max(1);
            n = n.saturating_sub(over);
        }
    }

    fn place(
        cfg: &PoolConfig,
        ps: u32,
        n: u32,
        descs: u32,
        id: u64,
        created: u64,
    ) -> Option<Layout> {
        let pt_off = HEADER_LEN;
        let st_off = align_up(pt_off + n as u64 * 8, 64)?;
        let slot_off = align_up(st_off + crate::pages::stripes_for(n) as u64 * 8, 4096)?;
        let desc_off = align_up(slot_off + cfg.slots as u64 * SLOT_SIZE as u64, 4096)?;
        let exp_off = align_up(desc_off.checked_add(descs as u64 * DESC_SIZE as u64)?, 64)?;
        let reg_off = align_up(exp_off + words_for(descs) * 8, 4096)?;
        let chan_off = align_up(reg_off + cfg.services as u64 * SERVICE_SIZE as u64, 4096)?;
        let meta_end =
            chan_off.checked_add(cfg.channel_count() as u64 * channel_stride(cfg.ring_size))?;
        let data_off = align_up(meta_end, ps as u64)?;
        Some(Layout {
            page_size: ps,
            pool_id: id,
            total_len: data_off + n as u64 * ps as u64,
            n_pages: n,
            n_slots: cfg.slots,
            n_descs: descs,
            pt_off,
            st_off,
            slot_off,
            desc_off,
            exp_off,
            n_services: cfg.services,
            reg_off,
            n_channels: cfg.channel_count(),
            ring_size: cfg.ring_size,
            chan_off,
            data_off,
            lease_ms: cfg.lease_ms,
            ref_ttl_ms: cfg.ref_ttl_ms,
            created_ms: created,
            ref_clock: cfg.ref_clock,
            name: cfg.name.clone(),
        })
    }

    /// Entries per list page.
    pub fn per_list_page(&self) -> usize {
        self.page_size as usize / 4
    }

    /// Largest buffer (or Ref) in bytes: the pool's data pages, or what
    /// two levels of list pages name if that is less (`desc.rs`).
    pub fn max_len(&self) -> u64 {
        let per = self.per_list_page() as u64;
        let pages = (crate::desc::INLINE as u64 * per * per).min(self.n_pages as u64);
        pages * self.page_size as u64
    }

    /// Encodes the immutable header (with checksum).
    pub fn encode(&self) -> [u8; IMMUTABLE_LEN + 8] {
        let mut b = [0u8; IMMUTABLE_LEN + 8];
        b[0..8].copy_from_slice(&MAGIC);
        let put32 =
            |b: &mut [u8], at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        let put64 =
            |b: &mut [u8], at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put32(&mut b, 8, POOL_VERSION);
        put32(&mut b, 12, HEADER_LEN as u32);
        put32(&mut b, 16, self.page_size);
        put32(&mut b, 20, 0);
        put64(&mut b, 24, self.pool_id);
        put64(&mut b, 32, self.total_len);
        put64(&mut b, 40, self.n_pages as u64);
        put32(&mut b, 48, self.n_slots);
        put32(&mut b, 52, self.n_descs);
        put64(&mut b, 56, self.pt_off);
        put64(&mut b, 64, self.slot_off);
        put64(&mut b, 72, self.desc_off);
        put64(&mut b, 80, self.data_off);
        put64(&mut b, 88, self.lease_ms);
        put64(&mut b, 96, self.ref_ttl_ms);
        put64(&mut b, 104, self.created_ms);
        let name = self.name.as_bytes();
        b[112..112 + name.len().min(32)].copy_from_slice(&name[..name.len().min(32)]);
        put64(&mut b, 144, self.st_off);
        put32(&mut b, 152, self.n_services);
        put32(&mut b, 156, self.n_channels);
        put64(&mut b, 160, self.reg_off);
        put64(&mut b, 168, self.chan_off);
        put32(&mut b, 176, self.ring_size);
        put32(&mut b, 180, self.ref_clock.code());
        put64(&mut b, 184, self.exp_off);
        let sum = fnv1a(&b[..IMMUTABLE_LEN]);
        put64(&mut b, IMMUTABLE_LEN, sum);
        b
    }

    /// Decodes and validates header bytes read from a backing of `file_len`
    /// bytes. Never panics, whatever the bytes.
    pub fn parse(b: &[u8], file_len: u64) -> Result<Layout, ParseError> {
        if b.len() < IMMUTABLE_LEN + 8 || file_len < HEADER_LEN {
            return Err(ParseError::Truncated);
        }
        if b[0..8] != MAGIC {
            return Err(ParseError::Magic);
        }
        let g32 = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let g64 = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(x)
        };
        let version = g32(8);
        if version != POOL_VERSION {
            return Err(ParseError::Version(version));
        }
        if g64(IMMUTABLE_LEN) != fnv1a(&b[..IMMUTABLE_LEN]) {
            return Err(ParseError::Corrupt("header checksum mismatch".into()));
        }
        let bad = |s: String| Err(ParseError::Corrupt(s));
        if g32(12) as u64 != HEADER_LEN {
            return bad(format!("header length {} is not {HEADER_LEN}", g32(12)));
        }
        let name_raw = &b[112..144];
        let name_len = name_raw.iter().position(|&c| c == 0).unwrap_or(32);
        let Ok(name) = std::str::from_utf8(&name_raw[..name_len]) else {
            return bad("pool name is not UTF-8".into());
        };
        let n_pages = g64(40);
        if n_pages == 0 || n_pages > crate::pages::MAX_PAGES as u64 {
            return bad(format!("page count {n_pages} out of range"));
        }
        let l = Layout {
            page_size: g32(16),
            pool_id: g64(24),
            total_len: g64(32),
            n_pages: n_pages as u32,
            n_slots: g32(48),
            n_descs: g32(52),
            pt_off: g64(56),
            st_off: g64(144),
            slot_off: g64(64),
            desc_off: g64(72),
            exp_off: g64(184),
            n_services: g32(152),
            reg_off: g64(160),
            n_channels: g32(156),
            ring_size: g32(176),
            chan_off: g64(168),
            data_off: g64(80),
            lease_ms: g64(88),
            ref_ttl_ms: g64(96),
            created_ms: g64(104),
            ref_clock: match RefClock::from_code(g32(180)) {
                Some(c) => c,
                None => return bad(format!("Ref clock {} is unknown", g32(180))),
            },
            name: name.to_owned(),
        };
        let ps = l.page_size;
        if !ps.is_power_of_two() || !(MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&ps) {
            return bad(format!("page size {ps} is invalid"));
        }
        if l.n_slots == 0 || l.n_slots > u16::MAX as u32 {
            return bad(format!("slot count {} out of range", l.n_slots));
        }
        if l.n_descs == 0 || l.n_descs > crate::pages::MAX_LOCK_DESC {
            return bad(format!("descriptor count {} out of range", l.n_descs));
        }
        if l.n_services > MAX_SERVICES || l.n_channels > MAX_CHANNELS {
            return bad(format!(
                "{} services or {} channels out of range",
                l.n_services, l.n_channels
            ));
        }
        if !valid_ring_size(l.ring_size) {
            return bad(format!("ring size {} is invalid", l.ring_size));
        }
        if l.total_len > file_len {
            return bad(format!(
                "pool claims {} bytes but the backing has {file_len}",
                l.total_len
            ));
        }
        // Areas must follow each other in order, aligned, inside total_len.
        let areas = [
            ("page table", l.pt_off, Some(l.n_pages as u64 * 8), 8u64),
            (
                "stripe table",
                l.st_off,
                Some(crate::pages::stripes_for(l.n_pages) as u64 * 8),
                8,
            ),
            (
                "slot table",
                l.slot_off,
                (l.n_slots as u64).checked_mul(SLOT_SIZE as u64),
                64,
            ),
            (
                "descriptor table",
                l.desc_off,
                (l.n_descs as u64).checked_mul(DESC_SIZE as u64),
                64,
            ),
            (
                "expiry summary",
                l.exp_off,
                Some(words_for(l.n_descs) * 8),
                64,
            ),
            (
                "service registry",
                l.reg_off,
                Some(l.n_services as u64 * SERVICE_SIZE as u64),
                4096,
            ),
            (
                "channel table",
                l.chan_off,
                Some(l.n_channels as u64 * channel_stride(l.ring_size)),
                4096,
            ),
            (
                "data",
                l.data_off,
                (l.n_pages as u64).checked_mul(ps as u64),
                ps as u64,
            ),
        ];
        let mut end = HEADER_LEN;
        for (what, off, len, align) in areas {
            let Some(len) = len else {
                return bad(format!("{what} size overflows"));
            };
            if off < end || off % align != 0 {
                return bad(format!("{what} offset {off:#x} overlaps or is misaligned"));
            }
            match off.checked_add(len) {
                Some(e) if e <= l.total_len => end = e,
                _ => return bad(format!("{what} runs past the end of the pool")),
            }
        }
        Ok(l)
    }
}

/// Why header bytes were rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Fewer bytes than a header.
    #[error("file is shorter than a pool header")]
    Truncated,
    /// Not a pool.
    #[error("bad magic")]
    Magic,
    /// Unsupported version.
    #[error("unsupported version {0}")]
    Version(u32),
    /// Inconsistent header.
    #[error("{0}")]
    Corrupt(String),
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn compute_fits_and_parses_back() {
        for (size, ps) in [
            (1u64 << 20, 4096u32),
            (1 << 30, 4096),
            (64 << 20, 65536),
            (1 << 24, 1 << 21),
        ] {
            let cfg = PoolConfig {
                size,
                page_size: ps,
                name: "t".into(),
                ..Default::default()
            };
            let l = Layout::compute(&cfg, 42, 7).unwrap();
            assert!(l.total_len <= size, "{l:?}");
            assert!(
                l.n_pages as u64 * ps as u64 > size / 2,
                "metadata overhead too high: {l:?}"
            );
            let b = l.encode();
            assert_eq!(Layout::parse(&b, size).unwrap(), l);
        }
        for clock in [RefClock::Wall, RefClock::Host] {
            let cfg = PoolConfig {
                size: 1 << 22,
                ref_clock: clock,
                ..Default::default()
            };
            let l = Layout::compute(&cfg, 1, 1).unwrap();
            assert_eq!(
                Layout::parse(&l.encode(), 1 << 22).unwrap().ref_clock,
                clock
            );
            assert_eq!(clock.name().parse::<RefClock>(), Ok(clock));
        }
        assert!("monotonic".parse::<RefClock>().is_err());
    }

    #[test]
    fn rejects_bad_headers() {
        let l = Layout::compute(
            &PoolConfig {
                size: 1 << 22,
                ..Default::default()
            },
            1,
            1,
        )
        .unwrap();
        let good = l.encode();
        assert_eq!(
            Layout::parse(&good[..10], 1 << 22),
            Err(ParseError::Truncated)
        );
        let mut b = good;
        b[0] = b'X';
        assert_eq!(Layout::parse(&b, 1 << 22), Err(ParseError::Magic));
        let mut b = good;
        b[8] = 99;
        assert_eq!(Layout::parse(&b, 1 << 22), Err(ParseError::Version(99)));
        // A Ref clock this build does not know (resealed: only the field
        // is wrong).
        let mut b = good;
        b[180] = 2;
        let sum = fnv1a(&b[..IMMUTABLE_LEN]);
        b[IMMUTABLE_LEN..].copy_from_slice(&sum.to_le_bytes());
        assert!(matches!(
            Layout::parse(&b, 1 << 22),
            Err(ParseError::Corrupt(m)) if m.contains("Ref clock")
        ));
        let mut b = good;
        b[60] ^= 1;
        assert!(matches!(
            Layout::parse(&b, 1 << 22),
            Err(ParseError::Corrupt(_))
        ));
        assert!(matches!(
            Layout::parse(&good, 4096 * 2),
            Err(ParseError::Corrupt(_))
        ));
        assert!(Layout::compute(
            &PoolConfig {
                page_size: 3000,
                ..Default::default()
            },
            1,
            1
        )
        .is_err());
        assert!(Layout::compute(
            &PoolConfig {
                size: 8192,
                ..Default::default()
            },
            1,
            1
        )
        .is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_header_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200), len: u64) {
            let _ = Layout::parse(&b, len);
        }

        #[test]
        fn resealed_mutations_are_validated(at in 8usize..IMMUTABLE_LEN, v: u8) {
            // Mutate a field and fix the checksum: the validator must still
            // accept only consistent layouts (or report why), never panic.
            let l = Layout::compute(&PoolConfig { size: 1 << 22, ..Default::default() }, 1, 1).unwrap();
            let mut b = l.encode();
            b[at] = v;
            let sum = fnv1a(&b[..IMMUTABLE_LEN]);
            b[IMMUTABLE_LEN..].copy_from_slice(&sum.to_le_bytes());
            if let Ok(p) = Layout::parse(&b, 1 << 22) {
                prop_assert!(p.data_off + p.n_pages as u64 * p.page_size as u64 <= 1 << 22);
            }
        }
    }
}

/// Checks the quotas and tenants of a configuration (`quota.rs`).
fn validate_quotas(cfg: &PoolConfig) -> std::result::Result<(), String> {
    if cfg.tenants.len() > MAX_TENANTS {
        return Err(format!("at most {MAX_TENANTS} tenants"));
    }
    for (i, (name, bytes)) in cfg.tenants.iter().enumerate() {
        if name.is_empty() || name.len() > TENANT_NAME_MAX || name.contains('\0') {
            return Err(format!(
                "tenant name {name:?} must be 1 to {TENANT_NAME_MAX} bytes, without NUL"
            ));
        }
        if *bytes == 0 {
            return Err(format!("tenant {name:?} has a quota of 0 bytes"));
        }
        if cfg.tenants[..i].iter().any(|(n, _)| n == name) {
            return Err(format!("tenant {name:?} is named twice"));
        }
    }
    if cfg.process_quota == Some(0) {
        return Err("a process quota of 0 bytes".into());
    }
    Ok(())
}
