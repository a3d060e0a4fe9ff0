//! Validated configuration: every option conflict is rejected here with a message that names
//! the option, so `main` can print one line and exit with status 2.

use std::path::PathBuf;
use std::time::Duration;

use crate::args::{AioMode, Args, CacheMode, DiscardMode, PollArg};
use crate::image::prealloc::PreallocMode;
use crate::image::{Format, PreallocChoice};
use crate::worker::poll::Poller;
use crate::zero::DetectZeroes;

mod create;
pub use create::create_request;

/// Most queues we serve; each queue costs a thread and an io_uring.
pub const MAX_NUM_QUEUES: u32 = 16;
/// Largest split-ring size the virtio spec allows is 32768; we bound it so per-queue state
/// (one in-flight slot per descriptor head) stays small.
pub const MAX_QUEUE_SIZE: u32 = 1024;
/// Longest busy-poll window: beyond 10 ms polling only burns CPU.
pub const MAX_POLL_US: u32 = 10_000;
/// GET_ID returns at most 20 bytes (virtio spec 5.2.6, VIRTIO_BLK_ID_BYTES).
pub const SERIAL_MAX_BYTES: usize = 20;

/// Where the vhost-user socket comes from.
#[derive(Debug, Clone)]
pub enum Socket {
    /// Create and listen on this path.
    Path(PathBuf),
    /// An inherited listening socket.
    Fd(i32),
}

/// Everything the daemon needs, checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub socket: Socket,
    pub blk_file: PathBuf,
    /// None: probe by magic.
    pub format: Option<Format>,
    /// `--key-secret` (read once, here) and `--key-secret-raw`.
    pub key: Option<crate::crypt::Key>,
    /// `--crypt-threads` (auto resolved).
    pub crypt_threads: usize,
    pub follow_backing: bool,
    pub locking: crate::image::lock::Locking,
    pub force_share: bool,
    pub read_only: bool,
    /// `--incoming`: a migration destination (see `image::handover`).
    pub incoming: bool,
    /// `--control-socket` and `--control-group`.
    pub control_socket: Option<PathBuf>,
    pub control_group: Option<String>,
    /// `--control-idle-timeout`.
    pub control_idle_timeout: Duration,
    /// `--metrics-addr`.
    pub metrics_addr: Option<String>,
    pub num_queues: u16,
    pub queue_size: u16,
    pub logical_block_size: u32,
    pub serial: Option<String>,
    pub cache: CacheMode,
    pub aio: AioMode,
    /// `--poll-us`.
    pub poll: Poller,
    /// `--stuck-request-secs` (zero: no watchdog).
    pub stuck_request: Duration,
    /// `--werror`, `--rerror`, `--error-retry-interval`.
    pub werror: crate::hold::WritePolicy,
    pub rerror: crate::hold::ReadPolicy,
    pub error_retry: Duration,
    /// `--bitmap`: (name, granularity) of the in-memory bitmaps to start with.
    pub bitmaps: Vec<(String, u64)>,
    /// `--persistent-bitmap`: (name, granularity) of the bitmaps the image file must keep
    /// (added at start where the file has none of that name).
    pub persistent_bitmaps: Vec<(String, u64)>,
    /// `--queue-cpus`, in queue order (empty: unpinned).
    pub queue_cpus: Vec<usize>,
    /// `--throttle-*`.
    pub throttle: crate::throttle::Limits,
    pub detect_zeroes: DetectZeroes,
    pub discard: DiscardMode,
    pub prealloc: PreallocChoice,
    pub prealloc_mode: PreallocMode,
    pub compress_writes: bool,
    pub compressed_cache: bool,
    /// `--compressed-cache-size` in bytes (None: 16 host clusters).
    pub compressed_cache_bytes: Option<u64>,
    pub compress_threads: usize,
    pub cow_threads: usize,
    pub prealloc_size: u64,
    pub prealloc_align: u64,
    /// qcow2 L2 cache bytes (None: the default for the image).
    pub l2_cache_bytes: Option<u64>,
    pub log_level: log::LevelFilter,
    /// `--pidfile`.
    pub pidfile: Option<PathBuf>,
    /// Where the chain's state file is (`--chain-state`, or beside a regular image file;
    /// None: a block device or remote disk without the option).
    pub chain_state: Option<PathBuf>,
    /// `--ceph-*` (librbd's cache comes from `cache`).
    pub ceph: crate::rbd::CephOptions,
    /// `--nbd-*`.
    pub nbd: crate::nbd::client::NbdOptions,
}

/// A rejected option: the message names it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Upper bound of --prealloc-size and --prealloc-align.
const MAX_PREALLOC: u64 = 1 << 40;
/// Upper bound of --l2-cache-size.
const MAX_L2_CACHE: u64 = 4 << 30;
/// Largest `--compressed-cache-size`.
const MAX_COMPRESSED_CACHE: u64 = 1 << 30;
/// Most `--compress-threads`.
const MAX_COMPRESS_THREADS: usize = 64;

/// CPUs as the kernel lists them (`0-3,6`).
fn cpu_ranges(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    if out.is_empty() {
        "none".into()
    } else {
        format!("allowed: {}", out.join(","))
    }
}

fn bad(msg: impl Into<String>) -> ConfigError {
    ConfigError(msg.into())
}

impl Config {
    /// Validate parsed arguments. `--print-capabilities` is handled before this.
    pub fn from_args(args: &Args) -> Result<Self, ConfigError> {
        let socket = match (&args.socket_path, args.fd) {
            (Some(_), Some(_)) => {
                return Err(bad("--socket-path and --fd are mutually exclusive"));
            }
            (None, None) => match crate::service::activation_socket().map_err(bad)? {
                Some(fd) => Socket::Fd(fd),
                None => {
                    return Err(bad(
                        "one of --socket-path or --fd is required (or a socket from systemd's \
                         socket activation)",
                    ))
                }
            },
            (Some(p), None) => {
                if p.as_os_str().is_empty() {
                    return Err(bad("--socket-path must not be empty"));
                }
                Socket::Path(p.clone())
            }
            (None, Some(fd)) => {
                if fd < 0 {
                    return Err(bad(format!("--fd {fd}: must be a non-negative descriptor")));
                }
                Socket::Fd(fd)
            }
        };
        let blk_file = args
            .blk_file
            .clone()
            .ok_or_else(|| bad("--blk-file is required"))?;
        let chain_state = if remote_kind(&blk_file).is_some() {
            args.chain_state.clone()
        } else {
            crate::snapshot::state::location(&blk_file, args.chain_state.as_deref())
        };
        if !(1..=MAX_NUM_QUEUES).contains(&args.num_queues) {
            return Err(bad(format!(
                "--num-queues {}: must be between 1 and {MAX_NUM_QUEUES}",
                args.num_queues
            )));
        }
        if !(2..=MAX_QUEUE_SIZE).contains(&args.queue_size) || !args.queue_size.is_power_of_two() {
            return Err(bad(format!(
                "--queue-size {}: must be a power of two between 2 and {MAX_QUEUE_SIZE}",
                args.queue_size
            )));
        }
        if args.logical_block_size != 512 && args.logical_block_size != 4096 {
            return Err(bad(format!(
                "--logical-block-size {}: must be 512 or 4096",
                args.logical_block_size
            )));
        }
        if let Some(s) = &args.serial {
            if s.len() > SERIAL_MAX_BYTES {
                return Err(bad(format!(
                    "--serial: {} bytes is longer than the {SERIAL_MAX_BYTES} bytes GET_ID can carry",
                    s.len()
                )));
            }
        }
        let poll = match args.poll_us {
            PollArg::Fixed(us) if us > MAX_POLL_US => {
                return Err(bad(format!(
                    "--poll-us {us}: must be at most {MAX_POLL_US}"
                )));
            }
            PollArg::Fixed(us) => Poller::fixed(Duration::from_micros(u64::from(us))),
            PollArg::Auto => Poller::auto(crate::worker::poll::AUTO_MAX),
        };
        let queue_cpus = match &args.queue_cpus {
            None => Vec::new(),
            Some(list) => {
                let cpus = crate::worker::thread::parse_cpu_list(list)
                    .map_err(|e| bad(format!("--queue-cpus {list}: {e}")))?;
                let allowed = crate::worker::thread::allowed_cpus();
                if let Some(c) = cpus.iter().find(|c| !allowed.contains(c)) {
                    return Err(bad(format!(
                        "--queue-cpus {list}: CPU {c} is not one this process may run on \
                         ({})",
                        cpu_ranges(&allowed)
                    )));
                }
                cpus
            }
        };
        let detect_zeroes = args.detect_zeroes;
        if detect_zeroes == DetectZeroes::Unmap && args.discard != DiscardMode::Unmap {
            return Err(bad(
                "--detect-zeroes unmap requires --discard unmap (deallocation must be allowed)",
            ));
        }
        let l2_cache_bytes = match &args.l2_cache_size {
            None => None,
            Some(s) => match crate::args::parse_size(s) {
                Some(n) if n <= MAX_L2_CACHE => Some(n),
                _ => {
                    return Err(bad(format!(
                        "--l2-cache-size {s}: must be a size up to 4G (e.g. 32M)"
                    )))
                }
            },
        };
        let compressed_cache_bytes = match &args.compressed_cache_size {
            None => None,
            Some(s) => match crate::args::parse_size(s) {
                Some(n) if n > 0 && n <= MAX_COMPRESSED_CACHE => Some(n),
                _ => {
                    return Err(bad(format!(
                        "--compressed-cache-size {s}: must be a size from one cluster up to 1G \
                         (e.g. 1M)"
                    )))
                }
            },
        };
        let crypt_threads = match args.crypt_threads {
            Some(n) if n > MAX_COMPRESS_THREADS => {
                return Err(bad(format!(
                    "--crypt-threads {n}: at most {MAX_COMPRESS_THREADS}"
                )))
            }
            Some(n) => n,
            None => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .saturating_sub(1)
                .min(4),
        };
        let compress_threads = match args.compress_threads {
            Some(n) if n > MAX_COMPRESS_THREADS => {
                return Err(bad(format!(
                    "--compress-threads {n}: at most {MAX_COMPRESS_THREADS}"
                )))
            }
            Some(n) => n,
            None => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(8),
        };
        // Conflicts the options show by themselves (those that depend on the image, e.g.
        // --compress-writes on a raw file or a --prealloc-align the file's alignment does not
        // divide, are refused when it is opened: `image::open`).
        let compress = args.compress_writes == crate::args::OnOff::On;
        if compress && args.read_only {
            return Err(bad(
                "--compress-writes on: needs a qcow2 image opened read-write (not --read-only)",
            ));
        }
        if let Some((path, what)) = args
            .blk_file
            .as_deref()
            .and_then(|p| Some((p, remote_kind(p)?)))
        {
            if compress {
                return Err(bad(format!(
                    "--compress-writes on: needs a qcow2 image; {what} are raw"
                )));
            }
            if args.format.is_some_and(|f| f != Format::Raw) {
                return Err(bad(format!(
                    "{}: {what} are served as raw (--format raw or no --format)",
                    path.display()
                )));
            }
        }
        if args.cow_threads > MAX_COMPRESS_THREADS {
            return Err(bad(format!(
                "--cow-threads {}: at most {MAX_COMPRESS_THREADS}",
                args.cow_threads
            )));
        }
        let prealloc_size = crate::args::parse_size(&args.prealloc_size)
            .filter(|&n| n <= MAX_PREALLOC)
            .ok_or_else(|| {
                bad(format!(
                    "--prealloc-size {}: must be a size up to 1T (e.g. 128M)",
                    args.prealloc_size
                ))
            })?;
        let prealloc_align = crate::args::parse_size(&args.prealloc_align)
            .filter(|&n| n > 0 && n % 512 == 0 && n <= MAX_PREALLOC)
            .ok_or_else(|| {
                bad(format!(
                    "--prealloc-align {}: must be a non-zero multiple of 512 bytes (e.g. 1M)",
                    args.prealloc_align
                ))
            })?;
        if args.ceph_timeout > 3600 || args.ceph_op_timeout > 3600 || args.ceph_lock_wait > 3600 {
            return Err(bad(
                "--ceph-timeout, --ceph-op-timeout and --ceph-lock-wait: at most 3600 seconds",
            ));
        }
        if args.nbd_timeout > 3600
            || args.nbd_reconnect_delay > 3600
            || args.nbd_reconnect_timeout > 86400
        {
            return Err(bad(
                "--nbd-timeout and --nbd-reconnect-delay: at most 3600 seconds; \
                 --nbd-reconnect-timeout: at most 86400",
            ));
        }
        let mut bitmaps: Vec<(String, u64)> = Vec::new();
        let mut persistent_bitmaps: Vec<(String, u64)> = Vec::new();
        for (opt, given, out) in [
            ("--bitmap", &args.bitmaps, &mut bitmaps),
            (
                "--persistent-bitmap",
                &args.persistent_bitmaps,
                &mut persistent_bitmaps,
            ),
        ] {
            for b in given {
                let (name, g) = match b.rsplit_once(':') {
                    Some((n, g)) => {
                        let g = crate::args::parse_size(g).ok_or_else(|| {
                            bad(format!("{opt} {b}: GRANULARITY: bytes, or with K, M or G"))
                        })?;
                        (n, g)
                    }
                    None => (b.as_str(), crate::bitmaps::DEFAULT_GRANULARITY),
                };
                crate::bitmaps::check_name(name)
                    .and_then(|()| crate::bitmaps::check_granularity(g))
                    .map_err(|e| bad(format!("{opt} {b}: {e}")))?;
                out.push((name.to_owned(), g));
            }
        }
        for (i, (name, _)) in bitmaps.iter().chain(&persistent_bitmaps).enumerate() {
            if bitmaps
                .iter()
                .chain(&persistent_bitmaps)
                .take(i)
                .any(|(n, _)| n == name)
            {
                return Err(bad(format!("bitmap {name}: given twice")));
            }
        }
        if args.stuck_request_secs > 86400 {
            return Err(bad(format!(
                "--stuck-request-secs {}: at most 86400 (0: off)",
                args.stuck_request_secs
            )));
        }
        if args.error_retry_interval > 86400 {
            return Err(bad(format!(
                "--error-retry-interval {}: at most 86400 (0: only on resume)",
                args.error_retry_interval
            )));
        }
        if !(1..=86400).contains(&args.control_idle_timeout) {
            return Err(bad(format!(
                "--control-idle-timeout {}: must be between 1 and 86400 seconds",
                args.control_idle_timeout
            )));
        }
        if args.ceph_id.is_empty() || args.ceph_id.contains(['\0', ' ']) {
            return Err(bad(format!(
                "--ceph-id {:?}: a client name such as admin",
                args.ceph_id
            )));
        }
        if args.force_share && !args.read_only {
            return Err(bad(
                "--force-share needs --read-only (a writer never shares write)",
            ));
        }
        let log_level = args.log_level.parse::<log::LevelFilter>().map_err(|_| {
            bad(format!(
                "--log-level {}: must be one of off, error, warn, info, debug, trace",
                args.log_level
            ))
        })?;
        // Read once, here: an fd: source can be read only once, and a secret that cannot
        // be read is an option error before anything is opened. The message names the
        // source, never its contents.
        let key = match &args.key_secret {
            None => None,
            Some(src) => {
                if remote_kind(&blk_file).is_some() {
                    return Err(bad(
                        "--key-secret: NBD exports, RBD images and null disks are served as raw (no LUKS)",
                    ));
                }
                let secret = src
                    .read()
                    .map_err(|e| bad(format!("--key-secret {src}: {e}")))?;
                if secret.is_empty() {
                    return Err(bad(format!("--key-secret {src}: empty")));
                }
                Some(crate::crypt::Key {
                    secret: std::sync::Arc::new(secret),
                    raw: args.key_secret_raw,
                })
            }
        };
        Ok(Config {
            socket,
            blk_file,
            format: args.format,
            follow_backing: args.backing == crate::args::BackingMode::Follow,
            locking: args.locking,
            force_share: args.force_share,
            key,
            crypt_threads,
            read_only: args.read_only,
            incoming: args.incoming,
            control_socket: args.control_socket.clone(),
            control_group: args.control_group.clone(),
            control_idle_timeout: Duration::from_secs(u64::from(args.control_idle_timeout)),
            stuck_request: Duration::from_secs(u64::from(args.stuck_request_secs)),
            werror: args.werror,
            rerror: args.rerror,
            error_retry: Duration::from_secs(u64::from(args.error_retry_interval)),
            bitmaps,
            persistent_bitmaps,
            metrics_addr: args.metrics_addr.clone(),
            num_queues: args.num_queues as u16,
            queue_size: args.queue_size as u16,
            logical_block_size: args.logical_block_size,
            serial: args.serial.clone(),
            cache: args.cache,
            aio: args.aio,
            poll,
            queue_cpus,
            throttle: crate::throttle::Limits {
                iops: args.throttle_iops,
                bps: args.throttle_bps,
                read_iops: args.throttle_read_iops,
                write_iops: args.throttle_write_iops,
                read_bps: args.throttle_read_bps,
                write_bps: args.throttle_write_bps,
            },
            detect_zeroes,
            discard: args.discard,
            l2_cache_bytes,
            prealloc: args.prealloc,
            prealloc_mode: args.prealloc_mode,
            compress_writes: args.compress_writes == crate::args::OnOff::On,
            compressed_cache: args.compressed_cache == crate::args::OnOff::On,
            compressed_cache_bytes,
            compress_threads,
            cow_threads: args.cow_threads,
            prealloc_size,
            prealloc_align,
            log_level,
            pidfile: args.pidfile.clone(),
            chain_state,
            nbd: crate::nbd::client::NbdOptions {
                timeout: std::time::Duration::from_secs(u64::from(args.nbd_timeout.max(1))),
                reconnect_delay: std::time::Duration::from_millis(
                    u64::from(args.nbd_reconnect_delay) * 1000,
                )
                .max(std::time::Duration::from_millis(100)),
                reconnect_timeout: std::time::Duration::from_secs(u64::from(
                    args.nbd_reconnect_timeout,
                )),
            },
            ceph: crate::rbd::CephOptions {
                conf: args.ceph_conf.clone(),
                id: args.ceph_id.clone(),
                keyring: args.ceph_keyring.clone(),
                timeout: std::time::Duration::from_secs(u64::from(args.ceph_timeout.max(1))),
                op_timeout: std::time::Duration::from_secs(u64::from(args.ceph_op_timeout)),
                lock_wait: std::time::Duration::from_secs(u64::from(args.ceph_lock_wait)),
                cache: match args.cache {
                    CacheMode::None => crate::rbd::RbdCache::Off,
                    CacheMode::Writeback => crate::rbd::RbdCache::Writeback,
                    CacheMode::Writethrough => crate::rbd::RbdCache::Writethrough,
                },
            },
        })
    }
}

impl Config {
    /// How the image is opened and served.
    pub fn image_options(&self) -> crate::image::ImageOptions {
        use crate::image::ImageOptions;
        let compress = self
            .compress_writes
            .then_some(crate::image::CompressChoice {
                cache: self.compressed_cache,
                cache_bytes: self.compressed_cache_bytes,
                threads: self.compress_threads,
            });
        ImageOptions {
            path: self.blk_file.clone(),
            format: self.format,
            key: self.key.clone(),
            crypt_threads: self.crypt_threads,
            read_only: self.read_only,
            direct: self.cache == CacheMode::None,
            logical_block_size: self.logical_block_size,
            follow_backing: self.follow_backing,
            locking: self.locking,
            force_share: self.force_share,
            l2_cache_bytes: self.l2_cache_bytes,
            discard_unmap: self.discard == DiscardMode::Unmap,
            prealloc: self.prealloc,
            prealloc_size: self.prealloc_size,
            prealloc_align: self.prealloc_align,
            prealloc_mode: self.prealloc_mode,
            compress,
            cow_threads: self.cow_threads,
            ceph: self.ceph.clone(),
            nbd: self.nbd,
        }
    }
}

/// The JSON printed by `--print-capabilities` (QEMU vhost-user backend program conventions).
/// "NBD exports", "RBD images" or "null disks" where `--blk-file` names one (their URI or
/// spec), else None.
fn remote_kind(blk_file: &std::path::Path) -> Option<&'static str> {
    let s = blk_file.to_str()?;
    if s.starts_with("nbd://") || s.starts_with("nbd+unix://") || s.starts_with("nbds://") {
        Some("NBD exports")
    } else if s.starts_with("rbd:") {
        Some("RBD images")
    } else if s.starts_with("null:") {
        Some("null disks")
    } else {
        None
    }
}

pub fn capabilities_json() -> &'static str {
    "{\n  \"type\": \"block\",\n  \"features\": [\n    \"read-only\",\n    \"blk-file\",\n    \"migration\"\n  ]\n}"
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(extra: &[&str]) -> Result<Config, ConfigError> {
        let mut v = vec!["vublk"];
        v.extend_from_slice(extra);
        Config::from_args(&Args::try_parse_from(v).unwrap())
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = parse(&["--socket-path", "/tmp/s", "--blk-file", "/tmp/f"]).unwrap();
        assert_eq!(c.num_queues, 1);
        assert_eq!(c.queue_size, 256);
        assert_eq!(c.logical_block_size, 512);
        assert_eq!(c.cache, CacheMode::None);
        assert_eq!(c.aio, AioMode::IoUring);
        assert_eq!(c.detect_zeroes, DetectZeroes::Off);
        assert_eq!(c.discard, DiscardMode::Ignore);
        assert!(!c.read_only);
    }

    #[test]
    fn socket_path_and_fd_conflict() {
        let e = parse(&["--socket-path", "/s", "--fd", "3", "--blk-file", "/f"]).unwrap_err();
        assert!(e.0.contains("--socket-path") && e.0.contains("--fd"), "{e}");
    }

    #[test]
    fn missing_socket_is_rejected() {
        let e = parse(&["--blk-file", "/f"]).unwrap_err();
        assert!(e.0.contains("--socket-path"), "{e}");
    }

    #[test]
    fn out_of_range_values_name_the_option() {
        for (args, opt) in [
            (vec!["--num-queues", "17"], "--num-queues"),
            (vec!["--num-queues", "0"], "--num-queues"),
            (vec!["--queue-size", "1025"], "--queue-size"),
            (vec!["--queue-size", "100"], "--queue-size"),
            (vec!["--logical-block-size", "1024"], "--logical-block-size"),
            (vec!["--serial", "123456789012345678901"], "--serial"),
            (vec!["--log-level", "loud"], "--log-level"),
            (vec!["--poll-us", "10001"], "--poll-us"),
            (vec!["--queue-cpus", "0-"], "--queue-cpus"),
            (
                vec!["--queue-cpus", "1023"],
                "--queue-cpus 1023: CPU 1023 is not one",
            ),
            (vec!["--detect-zeroes", "unmap"], "--discard unmap"),
            (vec!["--force-share"], "--force-share"),
            (
                vec!["--detect-zeroes", "unmap", "--discard", "ignore"],
                "--detect-zeroes",
            ),
        ] {
            let mut all = vec!["--socket-path", "/s", "--blk-file", "/f"];
            all.extend(args);
            let e = parse(&all).unwrap_err();
            assert!(e.0.contains(opt), "{e}");
        }
    }

    #[test]
    fn option_conflicts_are_refused_here() {
        let with = |blk: &str, more: &[&str]| {
            parse(&[&["--socket-path", "/s", "--blk-file", blk][..], more].concat())
        };
        let err =
            |r: Result<Config, ConfigError>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(with("/f", &["--compress-writes", "on", "--read-only"]))
            .contains("--compress-writes on"));
        assert!(
            err(with("nbd://h/e", &["--compress-writes", "on"])).contains("NBD exports are raw")
        );
        assert!(
            err(with("rbd:p/i", &["--format", "qcow2"])).contains("RBD images are served as raw")
        );
        assert!(with("nbd+unix:///e?socket=/x", &["--format", "raw"]).is_ok());
        assert!(with("/f", &["--compress-writes", "on"]).is_ok());
    }

    #[test]
    fn poll_and_queue_cpus() {
        let base = ["--socket-path", "/s", "--blk-file", "/f"];
        let c = parse(&base).unwrap();
        assert_eq!(c.poll, Poller::fixed(Duration::ZERO));
        assert!(c.queue_cpus.is_empty());
        let c =
            parse(&[&base[..], &["--poll-us", "auto", "--queue-cpus", "0,0"]].concat()).unwrap();
        assert_eq!(c.poll, Poller::auto(crate::worker::poll::AUTO_MAX));
        assert_eq!(c.queue_cpus, [0, 0]);
        assert_eq!(
            parse(&[&base[..], &["--poll-us", "20"]].concat())
                .unwrap()
                .poll,
            Poller::fixed(Duration::from_micros(20))
        );
        assert!(Args::try_parse_from(["vublk", "--poll-us", "sometimes"]).is_err());
        assert_eq!(cpu_ranges(&[0, 1, 2, 5, 7, 8]), "allowed: 0-2,5,7-8");
    }

    #[test]
    fn capabilities_are_valid_json_naming_block() {
        let s = capabilities_json();
        assert!(s.contains("\"type\": \"block\""));
        assert!(s.contains("\"read-only\"") && s.contains("\"blk-file\""));
    }
}
