//! Command-line definitions (clap only; validation lives in `config`).

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

pub use crate::device::{CacheMode, DiscardMode};
pub use crate::image::lock::Locking;
pub use crate::image::prealloc::PreallocMode;
pub use crate::image::qcow2::Compression;
pub use crate::image::{Format, PreallocChoice};
pub use crate::io::AioMode;
pub use crate::zero::DetectZeroes;

/// vhost-user-blk backend: serve a disk image to QEMU, cloud-hypervisor or libblkio.
#[derive(Debug, Parser)]
#[command(name = "vublk", version, about, long_about = None, args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Listen on this UNIX socket path (created; a stale socket file is replaced).
    #[arg(long, value_name = "PATH")]
    pub socket_path: Option<PathBuf>,

    /// Serve an already listening UNIX socket inherited as file descriptor N. Without
    /// --socket-path or --fd, a socket passed by systemd's socket activation (LISTEN_FDS).
    #[arg(long, value_name = "N")]
    pub fd: Option<i32>,

    /// Disk image (or block device) to serve; an NBD export: nbd://HOST[:PORT]/EXPORT or
    /// nbd+unix:///EXPORT?socket=PATH; a Ceph RBD image: rbd:POOL/IMAGE[@SNAPSHOT] (a
    /// snapshot is served read-only; needs a vublk built with --features rbd); or a null
    /// disk that stores nothing, for measuring the backend alone:
    /// null:SIZE[?read-zeroes=on|off][&latency-ns=N] (reads return zeroes, or leave the
    /// buffers untouched with read-zeroes=off; writes are dropped; every request completes
    /// N ns late).
    #[arg(long, value_name = "PATH")]
    pub blk_file: Option<PathBuf>,

    /// NBD: give up one connection attempt (connect and handshake) after this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub nbd_timeout: u32,

    /// NBD: seconds between attempts to connect again after the server was lost.
    #[arg(long, value_name = "SECS", default_value_t = 2)]
    pub nbd_reconnect_delay: u32,

    /// NBD: how long requests wait for a lost server to come back before they fail (0: they
    /// fail at once).
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub nbd_reconnect_timeout: u32,

    /// RBD: the Ceph configuration file (monitors, auth).
    #[arg(long, value_name = "PATH", default_value = "/etc/ceph/ceph.conf")]
    pub ceph_conf: PathBuf,

    /// RBD: the Ceph client name, without "client.".
    #[arg(long, value_name = "NAME", default_value = "admin")]
    pub ceph_id: String,

    /// RBD: the keyring with the client's key (default: what the configuration says).
    #[arg(long, value_name = "PATH")]
    pub ceph_keyring: Option<PathBuf>,

    /// RBD: give up connecting to the cluster after this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub ceph_timeout: u32,

    /// RBD: a request the cluster does not answer within this many seconds fails with an I/O
    /// error (0: it waits for ever).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub ceph_op_timeout: u32,

    /// RBD: how long to wait for another client to give up the image's exclusive lock (a
    /// killed client's lock is broken about 30 s after it died).
    #[arg(long, value_name = "SECS", default_value_t = 45)]
    pub ceph_lock_wait: u32,

    /// Image format (probed from the file's first bytes when absent).
    #[arg(long, value_enum)]
    pub format: Option<Format>,

    /// The secret of a LUKS image: file:PATH (the whole file, as cryptsetup's --key-file
    /// reads it), fd:N (read to its end, then closed) or credential:NAME (systemd's
    /// $CREDENTIALS_DIRECTORY/NAME). A passphrase, or with --key-secret-raw the volume key.
    #[arg(long, value_name = "SOURCE")]
    pub key_secret: Option<crate::crypt::KeySource>,

    /// The --key-secret is the volume key itself (32 or 64 bytes), not a passphrase: no key
    /// slot is tried.
    #[arg(long, requires = "key_secret")]
    pub key_secret_raw: bool,

    /// Encrypted images: helper threads that share the encryption of large requests (128
    /// KiB and more) with the queue threads (0: the queue threads alone; default: one
    /// less than the CPUs, at most 4).
    #[arg(long, value_name = "N")]
    pub crypt_threads: Option<usize>,

    /// Backing files of qcow2 images: follow them (read-only, relative to the image), or
    /// refuse images that have one.
    #[arg(long, value_enum, default_value_t = BackingMode::Follow)]
    pub backing: BackingMode,

    /// Image locking, QEMU's protocol (OFD locks on the image and its backing files): auto
    /// (on where the file system has OFD locks), on (refuse to serve without them), off
    /// (nothing stops another user corrupting the image).
    #[arg(long, value_enum, default_value_t = Locking::Auto)]
    pub locking: Locking,

    /// With --read-only: share every permission with other users of the image, like
    /// `qemu-img -U` (reads may see another writer's half-done changes).
    #[arg(long)]
    pub force_share: bool,

    /// Serve the image read-only (guest writes fail with an I/O error).
    #[arg(long)]
    pub read_only: bool,

    /// Serve the control API (JSON-RPC 2.0, one object per line) on this UNIX socket, mode
    /// 0600 (see `vublk ctl`).
    #[arg(long, value_name = "PATH")]
    pub control_socket: Option<PathBuf>,

    /// Serve Prometheus metrics at http://HOST:PORT/metrics.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,

    /// Make the control socket 0660 and owned by this group (name or number).
    #[arg(long, value_name = "GROUP")]
    pub control_group: Option<String>,

    /// Close a control client that sends no complete request line (or does not read its
    /// answer) for this many seconds (1-86400).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub control_idle_timeout: u32,

    /// Be the destination of a live migration: listen and answer the frontend's set-up, but
    /// take no lock, read nothing beyond the image's header and write nothing until the
    /// frontend starts the queues (after the source vublk has handed the image over); then
    /// take the locks and open the image.
    #[arg(long)]
    pub incoming: bool,

    /// Print the backend's capabilities as JSON and exit.
    #[arg(long)]
    pub print_capabilities: bool,

    /// Number of virtqueues (1-16); each gets its own thread and io_uring.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub num_queues: u32,

    /// Maximum virtqueue size (power of two, 2-1024).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub queue_size: u32,

    /// Logical block size reported to the guest (512 or 4096).
    #[arg(long, value_name = "BYTES", default_value_t = 512)]
    pub logical_block_size: u32,

    /// Serial number returned for GET_ID (at most 20 bytes; default derived from the file).
    #[arg(long, value_name = "STR")]
    pub serial: Option<String>,

    /// Host cache mode: none = O_DIRECT with a volatile write cache (FLUSH = fdatasync),
    /// writeback = page cache with a volatile write cache, writethrough = every write durable.
    #[arg(long, value_enum, default_value_t = CacheMode::None)]
    pub cache: CacheMode,

    /// I/O engine; io_uring falls back to threads when the kernel forbids it.
    #[arg(long, value_enum, default_value_t = AioMode::IoUring)]
    pub aio: AioMode,

    /// Turn all-zero guest writes into cheap zero operations: on = keep the space allocated,
    /// unmap = may deallocate (needs --discard unmap).
    #[arg(long, value_enum, default_value_t = DetectZeroes::Off)]
    pub detect_zeroes: DetectZeroes,

    /// What guest DISCARD (and WRITE_ZEROES with the unmap flag) may do: ignore = keep every
    /// block allocated, unmap = punch holes.
    #[arg(long, value_enum, default_value_t = DiscardMode::Ignore)]
    pub discard: DiscardMode,

    /// I/O limit: reads and writes per second, together (0 = unlimited; one second of
    /// burst; requests over it wait, they do not fail).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub throttle_iops: u64,

    /// I/O limit: bytes read and written per second, together (0 = unlimited).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub throttle_bps: u64,

    /// I/O limit: reads per second (0 = unlimited).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub throttle_read_iops: u64,

    /// I/O limit: writes per second (0 = unlimited).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub throttle_write_iops: u64,

    /// I/O limit: bytes read per second (0 = unlimited).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub throttle_read_bps: u64,

    /// I/O limit: bytes written per second (0 = unlimited).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub throttle_write_bps: u64,

    /// Busy-poll each queue this many microseconds after its last request or completion
    /// before sleeping (0-10000; 0 = never), or `auto`: poll 50 us only while work follows
    /// work faster than that and the polls find it. Lowers latency at low queue depth; a
    /// fixed window costs CPU while the guest is busy.
    #[arg(long, value_name = "US|auto", default_value = "0")]
    pub poll_us: PollArg,

    /// Which host errors of writes (and write-zeroes, discards, flushes) hold the request
    /// instead of failing it: report = none, enospc = "no space" and "quota exceeded", hold
    /// = every one. While requests are held the disk takes no new ones; they are retried
    /// every --error-retry-interval and on `vublk ctl resume` (docs/error-policy.md).
    #[arg(long, value_enum, value_name = "POLICY", default_value_t = crate::hold::WritePolicy::Enospc)]
    pub werror: crate::hold::WritePolicy,

    /// Which host errors of reads hold the request: report = none, hold = every one.
    #[arg(long, value_enum, value_name = "POLICY", default_value_t = crate::hold::ReadPolicy::Report)]
    pub rerror: crate::hold::ReadPolicy,

    /// Retry held requests every SECS seconds (0 = only on `vublk ctl resume`; at most
    /// 86400).
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    pub error_retry_interval: u32,

    /// Log a request in flight longer than this many seconds, with what it waits for (one
    /// line per queue, repeated at most once per period while it stays; 0 = never;
    /// at most 86400). `stats` and the metrics show each queue's oldest request's age.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub stuck_request_secs: u32,

    /// Start with an in-memory dirty bitmap NAME that records from the first request
    /// (repeatable; GRANULARITY: a power of two from 512 to 2G, with K, M, G; default 64K).
    /// See `vublk ctl bitmap-add` and docs/changed-block-tracking.md.
    #[arg(long = "bitmap", value_name = "NAME[:GRANULARITY]")]
    pub bitmaps: Vec<String>,

    /// Keep a persistent dirty bitmap NAME in the qcow2 image file: added at start (recording)
    /// unless the file has a bitmap of that name, which is then kept as it is (repeatable;
    /// GRANULARITY as for --bitmap, used when adding). Refused for disks that keep bitmaps in
    /// memory only. See docs/changed-block-tracking.md.
    #[arg(long = "persistent-bitmap", value_name = "NAME[:GRANULARITY]")]
    pub persistent_bitmaps: Vec<String>,

    /// Pin queue N's thread to the N-th CPU of LIST (comma-separated CPUs and ranges, e.g.
    /// `2,3` or `0-3`; cycled when there are more queues than CPUs). Default: unpinned.
    #[arg(long, value_name = "LIST")]
    pub queue_cpus: Option<String>,

    /// qcow2 L2 table cache per image, e.g. 32M (at least 4 tables, at most 4 GiB; default:
    /// 32 MiB, or enough to map 64 GiB of guest data when clusters are small, never more than
    /// the image's L2 tables). Each 8 bytes map one cluster: 1 MiB maps 8 GiB at 64 KiB.
    #[arg(long, value_name = "SIZE")]
    pub l2_cache_size: Option<String>,

    /// Preallocate file space ahead of writes past the end of a growing image (qcow2):
    /// on, off, or auto (on when the image's file system sits on a non-rotational device or
    /// on a virtual disk, whose rotational flag is only a default).
    #[arg(long, value_enum, default_value_t = PreallocChoice::Auto)]
    pub prealloc: PreallocChoice,

    /// How much to preallocate past the end of a write that extends the file.
    #[arg(long, value_name = "SIZE", default_value = "128M")]
    pub prealloc_size: String,

    /// Round preallocated file lengths up to this (a multiple of the file's alignment).
    #[arg(long, value_name = "SIZE", default_value = "1M")]
    pub prealloc_align: String,

    /// parallels: how the file grows ahead of the data: falloc (allocated) or truncate
    /// (size only, sparse).
    #[arg(long, value_enum, default_value_t = PreallocMode::Falloc)]
    pub prealloc_mode: PreallocMode,

    /// qcow2: store every cluster written whole compressed (the image's compression type),
    /// merging partial writes to unallocated clusters into whole ones; a cluster that does not
    /// compress is written normally. For backup targets and image export.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub compress_writes: OnOff,

    /// With --compress-writes on: pack compressed chunks in memory and write each host
    /// cluster once, whole (the unfinished one on FLUSH and shutdown), instead of a
    /// read-modify-write of the blocks around every chunk.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub compressed_cache: OnOff,

    /// Bound of the compressed-write cache: it holds a run of adjacent host clusters up to
    /// this size and writes it as one aligned write when the run is full (a size of one
    /// cluster writes every host cluster as it fills). Default: 16 host clusters.
    #[arg(long, value_name = "SIZE")]
    pub compressed_cache_size: Option<String>,

    /// With --compress-writes on: threads that compress and place writes off the queue
    /// threads (0: compress on the queue thread). Default: the number of online CPUs, up to 8.
    #[arg(long, value_name = "N")]
    pub compress_threads: Option<usize>,

    /// qcow2: threads for writes that allocate through the format (copy-on-write of backing
    /// file, zero or shared clusters, sub-block writes), so that their reads and writes
    /// overlap instead of running one at a time on the queue thread (0: on the queue thread).
    /// Each waits on the disk most of the time (a copy is a read, a write and a sync), so
    /// more threads than CPUs pay: 16 doubles 4's rate into a fresh overlay (BENCHMARKS.md).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub cow_threads: usize,

    /// Log level: error, warn, info, debug or trace.
    #[arg(long, value_name = "LEVEL", default_value = "info")]
    pub log_level: String,

    /// Log lines as text, or as JSON (one object per line: timestamp, level, target,
    /// message, and `queue` for lines about one queue), for log shippers.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Where the top of the disk's chain is kept after a snapshot, so that a restart with
    /// the same command line serves the overlay (docs/snapshots.md). Default: the file
    /// .NAME.vublk-chain beside the image file NAME; a block device has none (snapshots of
    /// it need this option).
    #[arg(long, value_name = "PATH")]
    pub chain_state: Option<PathBuf>,

    /// Write the daemon's process id to this file, created if missing and locked while the
    /// daemon runs (a second daemon with the same file refuses to start); removed at exit.
    #[arg(long, value_name = "PATH")]
    pub pidfile: Option<PathBuf>,
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// on / off switches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// `--poll-us` values: a fixed window in microseconds, or adaptive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollArg {
    Fixed(u32),
    Auto,
}

impl std::str::FromStr for PollArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(PollArg::Auto);
        }
        s.parse()
            .map(PollArg::Fixed)
            .map_err(|_| format!("{s:?}: expected microseconds (0-10000) or auto"))
    }
}

/// `--backing` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackingMode {
    /// Open the backing chain read-only (at most 16 deep).
    Follow,
    /// Refuse images that have a backing file.
    None,
}

/// Subcommands (without one, vublk serves an image).
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a new raw, qcow2 or parallels image (never overwrites).
    Create(CreateArgs),
    /// Call a running vublk's control socket: `vublk ctl --control-socket PATH METHOD
    /// [OPTIONS]`; prints the JSON result (exit 0) or the error (exit 1).
    Ctl(CtlArgs),
    /// Write the files a package installs beside the binary into DIR: the man page
    /// (vublk.1.gz), shell completions (bash, zsh, fish) and QEMU's vhost-user backend
    /// descriptor (50-vublk.json). Used by contrib/package.sh.
    #[command(hide = true)]
    GenerateAssets(GenerateArgs),
}

/// `vublk generate-assets` options.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Where to write them (created).
    pub dir: PathBuf,
    /// The installed binary's path, for the descriptor.
    #[arg(long, value_name = "PATH", default_value = "/usr/bin/vublk")]
    pub binary: PathBuf,
}

/// `vublk ctl` options: the socket, and the method as a subcommand.
#[derive(Debug, clap::Args)]
#[command(subcommand_required = true, arg_required_else_help = true)]
pub struct CtlArgs {
    /// The daemon's `--control-socket` (before or after the method).
    #[arg(long, value_name = "PATH", global = true)]
    pub control_socket: Option<PathBuf>,
    #[command(subcommand)]
    pub method: CtlMethod,
}

/// The control methods (docs/operations.md, "The control socket").
#[derive(Debug, Subcommand)]
pub enum CtlMethod {
    /// The daemon's name and version.
    Version,
    /// The image, its size and format, whether it is active here and a frontend connected,
    /// queues, uptime.
    Status,
    /// Request counters per queue and in total (requests, bytes, latency, errors, in
    /// flight and the oldest request's age, wake-ups, polling) and the features' counters.
    Stats {
        /// Also each latency histogram's buckets (bucket i: requests under 2^i us).
        #[arg(long)]
        histograms: bool,
    },
    /// Write back all metadata and sync the file; answers once it is durable.
    Flush,
    /// Retry the requests the error policy holds now (--werror, --rerror), without waiting
    /// for --error-retry-interval (docs/error-policy.md).
    Resume {
        /// Answer them with an I/O error instead (as stop-holding).
        #[arg(long)]
        report: bool,
    },
    /// Answer every request the error policy holds with an I/O error (giving up on the
    /// disk coming back); the disk takes new requests again.
    StopHolding,
    /// Grow the disk online to SIZE (bytes, or with K, M, G, T) and tell the frontend;
    /// without SIZE, a block device's or RBD image's size now.
    Resize {
        /// The new size.
        size: Option<String>,
    },
    /// The I/O limits in effect.
    GetThrottle,
    /// Change the I/O limits (0: unlimited; the limits not named stay).
    SetThrottle(ThrottleArgs),
    /// A live view of IOPS, throughput, latency and requests in flight per queue and in
    /// total, refreshed every interval (q, Esc or Ctrl-C quits).
    Top {
        /// One frame as plain text, for scripts (needs no terminal).
        #[arg(long)]
        once: bool,
        /// Seconds between frames (0.1-3600).
        #[arg(long, value_name = "SECS", default_value_t = 1.0, value_parser = top_interval)]
        interval: f64,
    },
    /// Dirty bitmaps (changed-block tracking: docs/changed-block-tracking.md).
    #[command(flatten)]
    Bitmap(BitmapMethod),
    /// Backups: a point-in-time NBD export and checkpoints (docs/backups.md).
    #[command(flatten)]
    Backup(BackupMethod),
    /// Create a qcow2 overlay over the image served now and serve it from now on, switched
    /// between two guest requests; the old image becomes its read-only backing file
    /// (docs/snapshots.md).
    Snapshot {
        /// The overlay to create (it must not exist); its backing file is recorded relative
        /// to it, with its format.
        #[arg(long, value_name = "PATH")]
        overlay: String,
        /// Give the overlay extended L2 entries (subclusters, QEMU 5.2+'s extended_l2=on):
        /// the guest's small writes into it then copy nothing from the old image.
        #[arg(long)]
        extended_l2: bool,
    },
    /// Start a stream job: copy into the image served what it reads from its backing
    /// chain (down to NODE, or all of it), then drop the backing link (or point it at
    /// NODE) between two guest requests (docs/snapshots.md).
    Stream {
        /// The backing file that stays (a path or a file name in the chain); its data and
        /// what is below it are not copied.
        #[arg(long, value_name = "NODE")]
        base: Option<String>,
        #[command(flatten)]
        job: JobArgs,
    },
    /// Merge layers of the chain into a layer below while the guest runs (a commit job):
    /// from --top (default: the image served) down to --base (default: the bottom), which
    /// must not be --top; the merged layers leave the chain. Committing the image served
    /// switches the guest to the base at the end.
    Commit {
        /// The top layer merged (a path or a file name in the chain; default: the image
        /// served, an active commit).
        #[arg(long, value_name = "NODE")]
        top: Option<String>,
        /// The layer merged into (default: the bottom of the chain).
        #[arg(long, value_name = "NODE")]
        base: Option<String>,
        /// An active commit waits in the ready state (still copying what the guest
        /// writes) until job-complete, instead of switching by itself.
        #[arg(long)]
        manual_complete: bool,
        /// How an active commit keeps up with the guest's writes: background (copy again
        /// what they dirty), write-through (from the end of the first pass, each guest
        /// write is also sent to the base as it completes), auto (background, then
        /// write-through once a pass leaves half as much as the one before; the default).
        #[arg(long, value_name = "MODE")]
        copy_mode: Option<String>,
        #[command(flatten)]
        job: JobArgs,
    },
    /// Copy the running disk to another image (a mirror job), keep copying what the guest
    /// writes, wait in the ready state, and on job-complete switch the guest to it.
    Mirror {
        /// The new image (a path; it must not exist), or with --bitmap an existing copy.
        #[arg(long, value_name = "PATH")]
        target: String,
        /// The target's format: raw, qcow2 or parallels (default: the disk's; qcow2 with
        /// --sync top; probed with --bitmap).
        #[arg(long, value_name = "F")]
        format: Option<String>,
        /// full: everything the guest reads, into a stand-alone image; top: what the served
        /// image itself holds, into a qcow2 image over the same backing file.
        #[arg(long, value_name = "full|top")]
        sync: Option<String>,
        /// The target holds an older copy already: copy only what this dirty bitmap marks
        /// first.
        #[arg(long, value_name = "NAME")]
        bitmap: Option<String>,
        /// How the mirror keeps up with the guest's writes: background, write-through or
        /// auto (the default), as commit's --copy-mode.
        #[arg(long, value_name = "MODE")]
        copy_mode: Option<String>,
        #[command(flatten)]
        job: JobArgs,
    },
    /// Block jobs: id, type, state, bytes done of the total, speed limit, error.
    Jobs,
    /// Stop a job at its next step.
    JobCancel { id: String },
    /// Finish a job that waits in the ready state.
    JobComplete { id: String },
    /// Any other method (a newer daemon's): sent as it is, `--name value` pairs as its
    /// parameters.
    #[command(external_subcommand)]
    Other(Vec<String>),
}

/// What every job takes.
#[derive(Debug, clap::Args)]
pub struct JobArgs {
    /// The job's id (default: job-N).
    #[arg(long, value_name = "ID")]
    pub id: Option<String>,
    /// Copy at most this many bytes per second (with K, M, G; 0: unlimited).
    #[arg(long, value_name = "BYTES/S", default_value = "0")]
    pub speed: String,
}

/// The `bitmap-*` control methods.
#[derive(Debug, Subcommand)]
pub enum BitmapMethod {
    /// Add a clean bitmap that records every change to the disk from now on.
    BitmapAdd {
        /// 1 to 1023 bytes, no control characters.
        name: String,
        /// Bytes per bit: a power of two from 512 to 2G (with K, M, G).
        #[arg(long, value_name = "SIZE", default_value = "64K")]
        granularity: String,
        /// Keep it in the image file across restarts (qcow2 images; others keep bitmaps
        /// in memory only).
        #[arg(long)]
        persistent: bool,
        /// Add it without recording (enable it later).
        #[arg(long)]
        disabled: bool,
    },
    /// Remove a bitmap.
    BitmapRemove { name: String },
    /// Clear every bit of a bitmap.
    BitmapClear { name: String },
    /// Record changes in a bitmap again.
    BitmapEnable { name: String },
    /// Stop recording changes in a bitmap (what it holds stays).
    BitmapDisable { name: String },
    /// Set in TARGET every bit set in any SOURCE (same granularity).
    BitmapMerge {
        #[arg(long, value_name = "NAME")]
        target: String,
        #[arg(required = true, value_name = "SOURCE")]
        sources: Vec<String>,
    },
    /// Every bitmap: name, granularity, recording, persistent, inconsistent, dirty bytes.
    BitmapList,
    /// A bitmap's dirty extents (offset, length), at most MAX from OFFSET on.
    BitmapRanges {
        name: String,
        #[arg(long, value_name = "OFFSET", default_value_t = 0)]
        offset: u64,
        #[arg(long, value_name = "MAX", default_value_t = 1024)]
        max: u64,
    },
}

/// The `backup-*` control methods.
#[derive(Debug, Subcommand)]
pub enum BackupMethod {
    /// Freeze a point-in-time view of the disk, start checkpoint NAME (a bitmap recording
    /// from that moment) and export the view read-only over NBD, in one step between two
    /// guest requests; answers with the NBD URI.
    BackupBegin {
        /// The checkpoint to start (a bitmap; persistent on qcow2 images).
        #[arg(long, value_name = "NAME")]
        checkpoint: String,
        /// Stop checkpoint FROM recording at the same moment, and export it as
        /// qemu:dirty-bitmap:FROM: the changes between FROM's view and this one.
        #[arg(long, value_name = "FROM")]
        incremental: Option<String>,
        /// Serve the export on this UNIX socket (it must not exist).
        #[arg(
            long,
            value_name = "PATH",
            conflicts_with = "listen",
            required_unless_present = "listen"
        )]
        socket: Option<String>,
        /// Serve the export on this loopback TCP address (port 0: any free port).
        #[arg(long, value_name = "ADDR:PORT")]
        listen: Option<String>,
        /// The export's name (default: the checkpoint's).
        #[arg(long, value_name = "EXPORTNAME")]
        export: Option<String>,
        /// Where the copy-before-write scratch file goes (default: the image's directory).
        #[arg(long, value_name = "DIR")]
        scratch: Option<String>,
        /// The most scratch bytes the backup may use before it fails (the guest's writes
        /// go on); default: until the file system is full.
        #[arg(long, value_name = "SIZE")]
        scratch_max: Option<String>,
        /// The checkpoint bitmap's granularity.
        #[arg(long, value_name = "SIZE", default_value = "64K")]
        granularity: String,
    },
    /// Stop a backup's export and drop its view (the checkpoint stays).
    BackupEnd {
        #[arg(long, value_name = "NAME")]
        checkpoint: String,
    },
    /// Running backups: export URI, clients, bytes read, bytes copied, scratch used, failure.
    BackupList,
}

/// `vublk ctl set-throttle` limits (per second; 0 = unlimited; a negative number is
/// refused naming the limit, not taken for an option).
#[derive(Debug, clap::Args)]
#[command(arg_required_else_help = true)]
pub struct ThrottleArgs {
    /// Reads and writes together.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub iops: Option<u64>,
    /// Bytes read and written together.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub bps: Option<u64>,
    /// Reads.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub read_iops: Option<u64>,
    /// Writes.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub write_iops: Option<u64>,
    /// Bytes read.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub read_bps: Option<u64>,
    /// Bytes written.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub write_bps: Option<u64>,
}

fn top_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err("seconds from 0.1 to 3600".into()),
    }
}

/// `vublk create` options.
#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// Image format.
    #[arg(long, value_enum)]
    pub format: Format,
    /// Virtual size, e.g. 8G, 512M, 1T or bytes (default: the backing file's size).
    #[arg(long, value_name = "SIZE")]
    pub size: Option<String>,
    /// Cluster size: qcow2 a power of two from 512 to 2M (default 64K); parallels a multiple
    /// of 512 up to 1G (default 1M).
    #[arg(long, value_name = "BYTES")]
    pub cluster_size: Option<String>,
    /// qcow2 compression type for compressed clusters.
    #[arg(long, value_enum, default_value_t = Compression::Zlib)]
    pub compression_type: Compression,
    /// qcow2 extended L2 entries (QEMU's extended_l2=on): 32 subclusters per cluster, so a
    /// small write into an overlay copies nothing from the backing file. Needs clusters of
    /// 16K at least.
    #[arg(long)]
    pub extended_l2: bool,
    /// qcow2 backing file (stored as given, relative to the new image).
    #[arg(long, value_name = "FILE")]
    pub backing: Option<PathBuf>,
    /// Encrypt the new image: a LUKS1 volume (cryptsetup and QEMU open it) or a LUKS2 one
    /// (cryptsetup), aes-xts-plain64, raw data inside (--format raw or luks); or a qcow2
    /// image encrypted as QEMU's encrypt.format=luks (--format qcow2; QEMU opens LUKS1 ones;
    /// no --backing). A LUKS volume's data reads as whatever the file's bytes decrypt to
    /// until written; a qcow2 image's unwritten clusters read as zeroes.
    #[arg(long, value_enum, requires = "key_secret")]
    pub encrypt: Option<crate::crypt::format::LuksVersion>,
    /// The passphrase of the new volume's key slot: file:PATH, fd:N or credential:NAME.
    #[arg(long, value_name = "SOURCE", requires = "encrypt")]
    pub key_secret: Option<crate::crypt::KeySource>,
    /// The key slot's KDF (default: pbkdf2 for LUKS1, argon2id for LUKS2).
    #[arg(long, value_enum, requires = "encrypt")]
    pub kdf: Option<crate::crypt::format::KdfChoice>,
    /// PBKDF2: milliseconds one unlock should take (the iterations are measured for it).
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub iter_time: u32,
    /// PBKDF2 iterations or Argon2 passes, instead of measuring (at least 1000 for PBKDF2).
    #[arg(long, value_name = "N")]
    pub kdf_iterations: Option<u32>,
    /// Argon2: memory (e.g. 1G, 64M; at most 4G).
    #[arg(long, value_name = "SIZE", default_value = "1G")]
    pub kdf_memory: String,
    /// Argon2: lanes (threads, at most 16).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub kdf_lanes: u32,
    /// Volume key bits: 512 (AES-256-XTS) or 256 (AES-128-XTS).
    #[arg(long, value_name = "BITS", default_value_t = 512)]
    pub key_bits: u32,
    /// LUKS2: the encryption sector (512 or 4096; serve a 4096 one with
    /// --logical-block-size 4096).
    #[arg(long, value_name = "BYTES", default_value_t = 512)]
    pub sector_size: u32,
    /// The image to create.
    pub file: PathBuf,
}

pub use crate::units::parse_size;
