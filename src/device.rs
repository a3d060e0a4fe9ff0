//! The virtio-blk device model shared by all queues: limits, config space, the guest-visible
//! write cache state, and the open image. No vhost-user here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::image::handover::ImageSlot;
use crate::image::{Image, ImageError, ImageOptions};
use crate::io::align::DioAlign;
use crate::io::ranges::RangeLocks;
use crate::locks::Locked;
use crate::virtio_blk::{DeviceLimits, ID_BYTES, SECTOR_SHIFT};
use crate::zero::DetectZeroes;

/// Host cache modes (QEMU's names and meanings).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheMode {
    /// O_DIRECT; the guest sees a volatile write cache that FLUSH empties.
    None,
    /// Page cache; the guest sees a volatile write cache that FLUSH empties.
    Writeback,
    /// Page cache; every write is durable before it completes; no volatile cache.
    Writethrough,
}

/// `--discard` values (QEMU's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DiscardMode {
    /// DISCARD succeeds and does nothing; nothing is ever deallocated.
    Ignore,
    /// DISCARD punches holes; WRITE_ZEROES with the unmap flag deallocates.
    Unmap,
}

/// Largest single guest segment we accept (config size_max): 1 MiB keeps one iovec's worth of
/// bounce buffer pooled.
pub const SIZE_MAX_BYTES: u32 = 1 << 20;
/// Ranges per DISCARD / WRITE_ZEROES request.
pub const MAX_RANGES: u32 = 32;
/// Sectors per range: 4 Mi sectors = 2 GiB, comfortably inside i64 fallocate arithmetic.
pub const MAX_RANGE_SECTORS: u32 = 1 << 22;
/// Bytes of struct virtio_blk_config we serve, up to and including write_zeroes_may_unmap and
/// its padding (5.2.4).
pub const CONFIG_LEN: usize = 60;
/// Offset of the `writeback` byte in the config space (5.2.4), writable with CONFIG_WCE.
pub const CONFIG_WRITEBACK_OFFSET: usize = 32;

/// Device parameters fixed at start-up.
#[derive(Debug, Clone)]
pub struct DeviceParams {
    pub logical_block_size: u32,
    pub read_only: bool,
    pub num_queues: u16,
    pub queue_size: u16,
    pub cache: CacheMode,
    pub align: DioAlign,
    pub serial: Vec<u8>,
    /// What an all-zero guest write becomes.
    pub detect_zeroes: DetectZeroes,
    /// DISCARD and unmapping WRITE_ZEROES may deallocate (`--discard unmap`).
    pub discard_unmap: bool,
    /// The image is a block device: DISCARD uses BLKDISCARD.
    pub is_block_device: bool,
}

/// Zero-write statistics, shared by all queues and readable at any time.
#[derive(Debug, Default)]
pub struct ZeroStats {
    /// Guest writes found all-zero and turned into zero operations.
    pub zero_writes: AtomicU64,
    /// Bytes of those writes.
    pub zero_write_bytes: AtomicU64,
    /// Bytes deallocated (punched) by DISCARD, unmapping WRITE_ZEROES and zero writes.
    pub unmapped_bytes: AtomicU64,
}

impl ZeroStats {
    /// One line for the log.
    pub fn summary(&self) -> String {
        format!(
            "{} zero writes detected, {} bytes written as zero operations, {} bytes deallocated",
            self.zero_writes.load(Ordering::Relaxed),
            self.zero_write_bytes.load(Ordering::Relaxed),
            self.unmapped_bytes.load(Ordering::Relaxed)
        )
    }
}

/// The frontend's backend channel (VHOST_USER_PROTOCOL_F_BACKEND_REQ), when it gave one.
pub struct FrontendChannel(pub Option<vhost::vhost_user::Backend>, u64);

/// How long a message on the backend channel may take (sending it and, with REPLY_ACK, the
/// frontend's answer; QEMU answers at once): a frontend that does not read or answer in
/// that time loses the channel, not the daemon its control thread.
pub const FRONTEND_CHANNEL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl FrontendChannel {
    /// The frontend's channel, its messages bounded by [`FRONTEND_CHANNEL_TIMEOUT`].
    pub fn set(&mut self, backend: vhost::vhost_user::Backend) {
        self.1 += 1;
        if let Err(e) = backend.set_timeout(Some(FRONTEND_CHANNEL_TIMEOUT)) {
            log::warn!("the backend channel cannot have a timeout ({e}): not using it");
            self.0 = None;
            return;
        }
        self.0 = Some(backend);
    }
}

impl std::fmt::Debug for FrontendChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "connected"
        } else {
            "none"
        })
    }
}

/// What an online resize did.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ResizeOutcome {
    pub old_size_bytes: u64,
    pub size_bytes: u64,
    /// The frontend was sent VHOST_USER_BACKEND_CONFIG_CHANGE_MSG (and acknowledged it).
    pub frontend_notified: bool,
}

/// The block device as the guest sees it.
#[derive(Debug)]
pub struct Device {
    /// The disk image behind it (handed over between processes in a live migration).
    pub image: ImageSlot,
    pub params: DeviceParams,
    /// Limits as at start-up; the capacity in here is the first one (see [`Device::limits`]).
    limits: DeviceLimits,
    /// Capacity in sectors now (it grows with an online resize).
    capacity_sectors: AtomicU64,
    /// Guest-visible volatile write cache (WCE). Off means every write is durable on completion.
    writeback: AtomicBool,
    /// The filesystem refused FALLOC_FL_ZERO_RANGE once; use the fallback from then on.
    pub no_zero_range: AtomicBool,
    /// Zero-write and deallocation counters.
    pub zero_stats: ZeroStats,
    /// Present when a guest block is smaller than the file's direct-I/O block, so sub-block
    /// writes are read-modify-written and must be serialised against overlapping writes.
    pub write_ranges: Option<RangeLocks>,
    /// The frontend negotiated VHOST_F_LOG_ALL (it migrates the guest): guest pages the
    /// kernel writes for a request are marked in its dirty log by hand.
    pub dirty_log: AtomicBool,
    /// VIRTIO_F_IN_ORDER was negotiated: each queue uses buffers in the order they were made
    /// available (read by a queue when it starts).
    pub in_order: AtomicBool,
    /// Request counters, one set per queue (`stats`).
    pub queue_stats: Vec<crate::stats::QueueCounters>,
    /// I/O limits (`--throttle-*`, `set-throttle`).
    pub throttle: crate::throttle::Throttle,
    /// A frontend is connected (`status`).
    pub frontend_connected: AtomicBool,
    /// The connected frontend's backend channel (BACKEND_REQ), to announce config changes.
    pub frontend_channel: std::sync::Mutex<FrontendChannel>,
    /// One resize at a time.
    resizing: std::sync::Mutex<()>,
    /// The dirty bitmaps (changed-block tracking), marked by every queue.
    pub bitmaps: crate::bitmaps::Bitmaps,
    /// The running backups, whose views every queue's writes copy into first.
    pub backups: std::sync::Arc<crate::backup::Backups>,
    /// Block jobs (stream), each on a thread of its own.
    pub jobs: crate::jobs::Jobs,
    /// An active job's write-through to its target (the write-through copy mode).
    pub write_through: crate::jobs::active::ThroughSlot,
    /// What pauses the queues of the connected frontend (None: none is connected).
    pause: std::sync::Mutex<Option<std::sync::Weak<dyn QueuePause>>>,
    /// The error policy and the requests it holds (`--werror`, `--rerror`: `hold`).
    pub holds: Box<crate::hold::Holds>,
}

/// Pausing every queue between two requests: the connected frontend's backend.
pub trait QueuePause: Send + Sync {
    /// Run `f` while no request is in flight and none starts (requests already taken
    /// complete first, their completions published).
    fn paused(&self, f: &mut dyn FnMut());
}

impl Device {
    /// Watch the queues for requests in flight longer than `limit` (`--stuck-request-secs`;
    /// zero: not watched), on a thread that lives as long as the device.
    pub fn spawn_watchdog(
        self: &std::sync::Arc<Self>,
        limit: std::time::Duration,
    ) -> std::io::Result<()> {
        if limit.is_zero() {
            return Ok(());
        }
        let weak = std::sync::Arc::downgrade(self);
        let every = crate::watchdog::period(limit);
        std::thread::Builder::new()
            .name("vublk-watchdog".into())
            .spawn(move || {
                let mut last_report = Vec::new();
                loop {
                    std::thread::sleep(every);
                    let Some(dev) = weak.upgrade() else { return };
                    last_report.resize(dev.queue_stats.len(), None);
                    for (q, c) in dev.queue_stats.iter().enumerate() {
                        crate::watchdog::check_queue(q, &c.watch, limit, &mut last_report[q]);
                    }
                }
            })?;
        Ok(())
    }

    /// The device over `image`; its capacity is the image's size. `reopen`: how the image
    /// is opened again when it is taken over after a handover (None: never).
    pub fn new(image: Image, params: DeviceParams) -> Self {
        Self::with_reopen(image, params, None)
    }

    /// [`Device::new`], with the options that open the image again (see `image::handover`).
    pub fn with_reopen(image: Image, params: DeviceParams, reopen: Option<ImageOptions>) -> Self {
        let lbs = u64::from(params.logical_block_size);
        let capacity_sectors = (image.size_bytes() / lbs * lbs) >> SECTOR_SHIFT;
        let limits = DeviceLimits {
            capacity_sectors,
            logical_block_size: params.logical_block_size,
            read_only: params.read_only,
            seg_max: u32::from(params.queue_size) - 2,
            max_discard_sectors: MAX_RANGE_SECTORS,
            max_discard_seg: MAX_RANGES,
            max_write_zeroes_sectors: MAX_RANGE_SECTORS,
            max_write_zeroes_seg: MAX_RANGES,
        };
        let writeback = params.cache != CacheMode::Writethrough;
        let queues = params.num_queues.max(1);
        let slots = usize::from(params.queue_size);
        let rmw_possible = params.cache == CacheMode::None
            && params.align.offset > params.logical_block_size as usize;
        let bitmaps = crate::bitmaps::Bitmaps::new(image.size_bytes(), image.bitmaps_memory_only());
        bitmaps.adopt(image.persistent_bitmaps(), image.bitmaps_memory_only());
        Device {
            bitmaps,
            backups: std::sync::Arc::default(),
            jobs: crate::jobs::Jobs::default(),
            write_through: Default::default(),
            pause: std::sync::Mutex::new(None),
            holds: Box::default(),
            write_ranges: rmw_possible.then(RangeLocks::default),
            zero_stats: ZeroStats::default(),
            image: ImageSlot::new(image, reopen),
            params,
            limits,
            writeback: AtomicBool::new(writeback),
            no_zero_range: AtomicBool::new(false),
            dirty_log: AtomicBool::new(false),
            in_order: AtomicBool::new(false),
            throttle: crate::throttle::Throttle::default(),
            frontend_connected: AtomicBool::new(false),
            frontend_channel: std::sync::Mutex::new(FrontendChannel(None, 0)),
            resizing: std::sync::Mutex::new(()),
            capacity_sectors: AtomicU64::new(capacity_sectors),
            queue_stats: (0..queues)
                .map(|_| crate::stats::QueueCounters::with_slots(slots))
                .collect(),
        }
    }

    /// The limits requests are checked against, with the capacity as it is now.
    pub fn limits(&self) -> DeviceLimits {
        DeviceLimits {
            capacity_sectors: self.capacity_sectors.load(Ordering::Acquire),
            ..self.limits
        }
    }

    /// The queues of a connected frontend are paused through `p` from now on (None: no
    /// frontend is connected). Set before the first request of a connection, cleared after
    /// its last.
    pub fn set_queue_pause(&self, p: Option<std::sync::Weak<dyn QueuePause>>) {
        *self.pause.locked() = p;
    }

    /// Run `f` between two guest requests: every queue of the connected frontend paused,
    /// nothing in flight (see [`QueuePause`]); with no frontend, at once (and no frontend
    /// connects meanwhile).
    pub fn with_queues_paused<R>(&self, f: impl FnOnce() -> R) -> R {
        let p = self.pause.locked();
        let Some(backend) = p.as_ref().and_then(|w| w.upgrade()) else {
            return f();
        };
        let mut f = Some(f);
        let mut out = None;
        backend.paused(&mut || {
            if let Some(f) = f.take() {
                out = Some(f());
            }
        });
        drop(p);
        match out {
            Some(r) => r,
            // Not run by the backend (it cannot fail to; but never lose the call).
            None => f.map(|f| f()).expect("the closure ran or is still here"),
        }
    }

    /// Write the persistent bitmaps `list` to the image (the control methods' `Save`).
    pub fn save_bitmaps(&self, list: &[crate::bitmaps::Persistent]) -> Result<(), String> {
        self.image
            .get()
            .save_bitmaps(list)
            .map_err(|e| crate::logging::error_chain(&e))
    }

    /// Grow the disk online to `new_bytes` (see [`Image::grow`]) and tell the frontend.
    pub fn resize(&self, new_bytes: Option<u64>) -> Result<ResizeOutcome, String> {
        let _one = self.resizing.locked();
        if self.params.read_only {
            return Err("the disk is served read-only".into());
        }
        let old = self.size_bytes();
        let image = self.image.get();
        let now = image.grow(new_bytes).map_err(|e| e.to_string())?;
        // The bitmaps cover the new space before the guest may write there.
        self.bitmaps.grow(now);
        let lbs = u64::from(self.params.logical_block_size);
        let sectors = (now / lbs * lbs) >> SECTOR_SHIFT;
        self.capacity_sectors.store(sectors, Ordering::Release);
        let grown = now > old;
        let notified = if grown {
            self.announce_config_change()
        } else {
            None
        };
        if grown {
            log::info!(
                "resized from {old} to {now} bytes{}",
                match notified {
                    Some(true) => ", the frontend told",
                    Some(false) => ", telling the frontend failed",
                    None => " (the frontend has no backend channel: it sees the size when it reads the config space)",
                }
            );
        }
        Ok(ResizeOutcome {
            old_size_bytes: old,
            size_bytes: sectors << SECTOR_SHIFT,
            frontend_notified: notified == Some(true),
        })
    }

    /// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG to the connected frontend: Some(sent), None
    /// without a channel. A frontend that does not take or answer it within
    /// [`FRONTEND_CHANNEL_TIMEOUT`] loses the channel for the rest of its connection (a late
    /// answer would be read as the next message's; later resizes are seen at its next
    /// config-space read).
    fn announce_config_change(&self) -> Option<bool> {
        let (ch, generation) = {
            let cur = self.frontend_channel.locked();
            (cur.0.clone()?, cur.1)
        };
        match ch.config_change() {
            Ok(_) => Some(true),
            Err(e) => {
                log::warn!(
                    "telling the frontend the config changed failed ({e}; it may not have \
                     answered within {} s): not using its backend channel again",
                    FRONTEND_CHANNEL_TIMEOUT.as_secs()
                );
                ch.set_failed(libc::EIO);
                let mut cur = self.frontend_channel.locked();
                if cur.1 == generation {
                    // (Not a channel a new frontend has set meanwhile.)
                    cur.0 = None;
                }
                Some(false)
            }
        }
    }

    /// Everything completed so far durable: format metadata, then the file.
    pub fn sync(&self) -> Result<(), ImageError> {
        self.image.get().sync()
    }

    /// The guest-visible size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.capacity_sectors.load(Ordering::Acquire) << SECTOR_SHIFT
    }

    /// Direct I/O: the file is opened O_DIRECT.
    pub fn direct(&self) -> bool {
        self.params.cache == CacheMode::None
    }

    /// Is the guest-visible write cache on (FLUSH needed for durability)?
    pub fn writeback(&self) -> bool {
        self.writeback.load(Ordering::Relaxed)
    }

    /// Back to the start-up mode on feature negotiation; write-through if the driver cannot
    /// flush.
    pub fn reset_writeback(&self, driver_can_flush: bool) {
        let on = driver_can_flush && self.params.cache != CacheMode::Writethrough;
        self.set_writeback(on);
    }

    pub fn set_writeback(&self, on: bool) {
        self.writeback.store(on, Ordering::Relaxed);
    }

    /// Serial for GET_ID, padded with zeros to 20 bytes.
    pub fn id_bytes(&self) -> [u8; ID_BYTES] {
        let mut id = [0u8; ID_BYTES];
        let n = self.params.serial.len().min(ID_BYTES);
        id[..n].copy_from_slice(&self.params.serial[..n]);
        id
    }

    /// struct virtio_blk_config, little-endian (5.2.4).
    pub fn config_space(&self) -> [u8; CONFIG_LEN] {
        let p = &self.params;
        let mut c = [0u8; CONFIG_LEN];
        let put32 = |c: &mut [u8; CONFIG_LEN], off: usize, v: u32| {
            c[off..off + 4].copy_from_slice(&v.to_le_bytes())
        };
        c[0..8].copy_from_slice(&self.limits().capacity_sectors.to_le_bytes());
        put32(&mut c, 8, SIZE_MAX_BYTES);
        put32(&mut c, 12, self.limits.seg_max);
        // geometry (16..20) left zero: not offered.
        put32(&mut c, 20, p.logical_block_size);
        // topology: physical block = max(logical, what O_DIRECT needs), as an exponent of
        // logical blocks; min_io_size in logical blocks; opt_io_size 0 = none.
        let phys = (p.align.offset as u32).max(p.logical_block_size);
        c[24] = (phys / p.logical_block_size).trailing_zeros() as u8;
        c[25] = 0;
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        put32(&mut c, 28, 0);
        c[CONFIG_WRITEBACK_OFFSET] = u8::from(self.writeback());
        c[34..36].copy_from_slice(&p.num_queues.to_le_bytes());
        put32(&mut c, 36, MAX_RANGE_SECTORS);
        put32(&mut c, 40, MAX_RANGES);
        put32(&mut c, 44, phys >> SECTOR_SHIFT);
        put32(&mut c, 48, MAX_RANGE_SECTORS);
        put32(&mut c, 52, MAX_RANGES);
        c[56] = 1; // write_zeroes_may_unmap
        c
    }

    /// The slice of the config space a GET_CONFIG asks for (zeros past the end).
    pub fn read_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = self.config_space();
        // A frontend may ask for a larger struct than we know; bound the answer.
        let size = (size as usize).min(256);
        let mut out = vec![0u8; size];
        let off = offset as usize;
        if off < CONFIG_LEN {
            let n = (CONFIG_LEN - off).min(size);
            out[..n].copy_from_slice(&c[off..off + n]);
        }
        out
    }

    /// SET_CONFIG: only the writeback byte is writable (CONFIG_WCE).
    pub fn write_config(&self, offset: u32, data: &[u8]) -> Result<(), &'static str> {
        let off = offset as usize;
        let end = off
            .checked_add(data.len())
            .ok_or("config write out of range")?;
        if off > CONFIG_WRITEBACK_OFFSET || end <= CONFIG_WRITEBACK_OFFSET || end > CONFIG_LEN {
            return Err("only the writeback field of the config space is writable");
        }
        let wce = data[CONFIG_WRITEBACK_OFFSET - off];
        if wce > 1 {
            return Err("writeback must be 0 or 1");
        }
        self.set_writeback(wce == 1);
        log::info!(
            "guest set write cache to {}",
            if wce == 1 {
                "writeback"
            } else {
                "writethrough"
            }
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(cache: CacheMode, lbs: u32) -> Device {
        let file = std::fs::File::open("/dev/null").unwrap();
        Device::new(
            Image::raw(file, (1 << 30) + 1000, false),
            DeviceParams {
                logical_block_size: lbs,
                read_only: false,
                num_queues: 4,
                queue_size: 256,
                cache,
                align: DioAlign {
                    mem: 512,
                    offset: 4096,
                },
                serial: b"abc".to_vec(),
                detect_zeroes: DetectZeroes::Off,
                discard_unmap: false,
                is_block_device: false,
            },
        )
    }

    #[test]
    fn config_space_layout() {
        let d = dev(CacheMode::None, 512);
        let c = d.config_space();
        // 1000 trailing bytes hold one whole 512-byte sector more.
        assert_eq!(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            (1 << 30) / 512 + 1
        );
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 254);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(c[24], 3, "4096-byte physical blocks over 512-byte logical");
        assert_eq!(c[32], 1, "cache=none offers a volatile write cache");
        assert_eq!(u16::from_le_bytes([c[34], c[35]]), 4);
    }

    #[test]
    fn writethrough_offers_no_write_cache_and_wce_toggles() {
        let d = dev(CacheMode::Writethrough, 4096);
        assert_eq!(d.config_space()[32], 0);
        d.write_config(32, &[1]).unwrap();
        assert!(d.writeback());
        assert_eq!(d.read_config(32, 1), vec![1]);
        d.write_config(32, &[0]).unwrap();
        assert!(!d.writeback());
        assert!(d.write_config(0, &[0; 8]).is_err());
        assert!(d.write_config(32, &[7]).is_err());
    }

    #[test]
    fn feature_negotiation_resets_the_write_cache() {
        let d = dev(CacheMode::None, 512);
        d.reset_writeback(false);
        assert!(!d.writeback(), "a driver without FLUSH gets write-through");
        d.reset_writeback(true);
        assert!(
            d.writeback(),
            "the next driver gets the configured write-back cache"
        );
        d.write_config(32, &[0]).unwrap();
        assert!(!d.writeback());
        let wt = dev(CacheMode::Writethrough, 512);
        wt.reset_writeback(true);
        assert!(!wt.writeback());
    }

    #[test]
    fn capacity_rounds_down_to_logical_blocks() {
        let d = dev(CacheMode::None, 4096);
        assert_eq!(d.limits().capacity_sectors % 8, 0);
    }

    #[test]
    fn read_config_pads_and_bounds() {
        let d = dev(CacheMode::None, 512);
        assert_eq!(d.read_config(56, 8), vec![1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(d.read_config(1000, 4), vec![0; 4]);
        assert_eq!(d.read_config(0, 1 << 20).len(), 256);
    }

    #[test]
    fn id_is_padded() {
        let d = dev(CacheMode::None, 512);
        let id = d.id_bytes();
        assert_eq!(&id[..3], b"abc");
        assert!(id[3..].iter().all(|&b| b == 0));
    }
}
