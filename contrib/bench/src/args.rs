//! The command line: every option of every mode, parsed by clap (nothing else happens here).

use std::path::PathBuf;

use clap::Parser;

/// Side-by-side block benchmark through libblkio.
#[derive(Parser, Debug, Clone)]
#[command(name = "vublk-bench")]
pub struct Opts {
    /// Image file (created and fully written if missing or not fully allocated).
    #[arg(long, default_value = "target/bench/bench.img")]
    pub image: PathBuf,
    /// Image size.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub size: u64,
    /// Runs per backend and workload (backends alternate run by run).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Unmeasured warm-up per run, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub warmup_ms: u64,
    /// Backends, comma-separated: file, vublk, qsd.
    #[arg(long, default_value = "file,vublk,qsd", value_delimiter = ',')]
    pub backends: Vec<String>,
    /// Workloads, comma-separated (default: the standard set; see --list).
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// Also measure 4k random reads at depth 16 per queue with 1, 2 and 4 queues.
    #[arg(long)]
    pub scaling: bool,
    /// Measure the backend alone: 4k random reads and writes at depth 1, 32 and 128 per queue
    /// on 1, 2 and 4 queues (`randread-4k-2q-qd32`...), meant for `--image null:SIZE` (vublk's
    /// null disk; qemu-storage-daemon's null-co with the same size, read-zeroes and latency)
    /// with `--backends vublk,qsd`.
    #[arg(long)]
    pub null_matrix: bool,
    /// List workloads and exit.
    #[arg(long)]
    pub list: bool,
    /// The vublk binary (default: target/release/vublk beside this program).
    #[arg(long)]
    pub vublk: Option<PathBuf>,
    /// Extra vublk options, whitespace-separated (e.g. "--poll-us 50").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub vublk_args: String,
    /// The qemu-storage-daemon binary.
    #[arg(long, default_value = "qemu-storage-daemon")]
    pub qsd: PathBuf,
    /// Queues each vhost-user backend offers (the client uses as many as the workload needs).
    #[arg(long, default_value_t = 4)]
    pub backend_queues: u32,
    /// Write the Markdown report here too.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// A few hundred I/Os per workload and backend: checks that everything runs.
    #[arg(long)]
    pub smoke: bool,
    /// Extra backends: NAME=vublk[+BINARY][@IMAGE]:ARGS (vublk with extra options,
    /// whitespace-separated) or NAME=qsd[@IMAGE]:OPTS (extra --blockdev options,
    /// comma-separated); use NAME in --backends. @IMAGE serves another image (e.g. a qcow2
    /// copy of --image, a Ceph RBD image rbd:POOL/IMAGE: vublk then needs --ceph-conf in
    /// ARGS, qsd conf=PATH in OPTS; or an NBD export nbd+unix:///EXPORT?socket=PATH); +BINARY runs another vublk build (e.g. the one before a
    /// change, measured side by side with this one).
    #[arg(long = "variant", value_name = "NAME=KIND:ARGS")]
    pub variants: Vec<String>,
    /// Instead of workloads: write --size bytes of zeroes (1 MiB requests, depth 4) into a
    /// fresh sparse image and into a fully written one, per backend; report time and space.
    #[arg(long)]
    pub zero_fill: bool,
    /// Instead of workloads: measure the file system itself growing a fresh file (io_uring,
    /// O_DIRECT, sequential writes of 16 KiB and 64 KiB at depth 64, 2 GiB): into a file
    /// sized with holes, into a preallocated one (fallocate), and extending it write by write.
    /// The ceiling for writes into fresh image space.
    #[arg(long)]
    pub fresh_file: bool,

    /// Instead of workloads: the compressed-write table. Per --fill-data and
    /// --compression-types, write --size bytes as 64 KiB requests at depth 8 into a fresh
    /// qcow2 (qemu-img made, 64 KiB clusters) through each backend, then FLUSH; report the
    /// time, the image size and the write system calls the backend made (/proc/PID/io).
    /// Use variants with --compress-writes on (vublk) or "compress" (qsd: the compress filter;
    /// add "pagecache" for cache.direct=off).
    #[arg(long)]
    pub compress_fill: bool,
    /// --compress-fill data: ones (a constant byte), mix (the files under /usr, in path
    /// order: binaries, text and compressed files, like a file system image).
    #[arg(long, default_value = "ones,mix", value_delimiter = ',')]
    pub fill_data: Vec<String>,
    /// --compress-fill: the images' compression types.
    #[arg(long, default_value = "zlib,zstd", value_delimiter = ',')]
    pub compression_types: Vec<String>,

    /// Instead of workloads: the parallels preallocation table. A fresh 64 GiB parallels image
    /// (`qemu-img create -f parallels -o cluster_size=64k`) per run and backend; --size bytes
    /// written as sequential 64 KiB writes at depth 1 and at depth 8, then FLUSH. Use
    /// variants with vublk's --prealloc options; qsd variants take "parallels" (QEMU's
    /// defaults: falloc, 128 MiB).
    #[arg(long)]
    pub parallels_fill: bool,

    /// Instead of workloads: a backup of the running disk, vublk (`backup-begin`) against
    /// qemu-storage-daemon (QEMU's copy-before-write fleecing under its NBD server): the
    /// guest's 4 KiB random write IOPS without and during the backup, and the backup's read
    /// MB/s through `qemu-img convert` (a fully written raw image of --size per run).
    #[arg(long)]
    pub backup: bool,

    /// Instead of workloads: a stream job over the running disk, vublk (`vublk ctl stream`)
    /// against qemu-storage-daemon (QMP `block-stream`), on a new qcow2 overlay over a fully
    /// written raw image of --size: the guest's 4 KiB random write IOPS without and during
    /// the job, and the job's MB/s.
    #[arg(long)]
    pub stream: bool,

    /// Instead of workloads: an active commit job over the running disk, vublk (`vublk ctl
    /// commit`) against qemu-storage-daemon (QMP `block-commit`, `block-job-complete` once
    /// ready), of a fully written qcow2 overlay into a fully written raw image of --size: the
    /// guest's 4 KiB random write IOPS without and during the job, and the job's MB/s.
    #[arg(long)]
    pub commit: bool,

    /// Instead of workloads: a mirror job over the running disk (a fully written qcow2
    /// overlay over a fully written raw image of --size) to a new raw image, completed once
    /// ready, vublk (`vublk ctl mirror`, `job-complete`) against qemu-storage-daemon (QMP
    /// `drive-mirror`, `block-job-complete`): the guest's 4 KiB random write IOPS without
    /// and during the job, and the job's MB/s.
    #[arg(long)]
    pub mirror: bool,

    /// With --stream, --commit and --mirror: give a job at most this many seconds, then
    /// cancel it and report the guest's IOPS during those seconds, the job marked "not
    /// concluded" (0: wait until it concludes). qemu-storage-daemon's background-mode jobs
    /// do not converge under the benchmark's writes.
    #[arg(long, default_value_t = 0.0)]
    pub job_limit: f64,

    /// With --mirror: qemu-storage-daemon's `drive-mirror` `copy-mode`, `background` (its
    /// default) or `write-blocking` (from the job's start, each guest write is also written
    /// to the target before it completes; the rest is copied in the background).
    #[arg(long, default_value = "background")]
    pub qsd_copy_mode: String,

    /// Instead of workloads: measure the all-zero scanner on host buffers.
    #[arg(long)]
    pub zero_scan: bool,

    /// Instead of workloads: measure the AES-XTS sector cipher of encrypted disks on one
    /// core.
    #[arg(long)]
    pub xts_speed: bool,

    /// Instead of workloads: the cost of a wake-up across CPUs (eventfd ping-pong between
    /// two pinned threads: both sleeping, one spinning, both spinning), the part of the
    /// vhost-user hop a backend cannot avoid while the client sleeps.
    #[arg(long)]
    pub hop: bool,
    /// Recreate variant images ending in .qcow2 (empty, the size of --image) before every
    /// run, to measure writes into a fresh qcow2; one whose name contains "extl2" gets
    /// extended L2 entries (subclusters, `vublk create --extended-l2`).
    #[arg(long)]
    pub fresh_qcow2: bool,
    /// Rotate the order of the backends from run to run (round r starts with the r-th), so
    /// that none always runs right after the same one; medians are of the same runs.
    #[arg(long)]
    pub rotate: bool,
    /// With --fresh-qcow2: the fresh images are overlays over this backing file (its size).
    #[arg(long)]
    pub fresh_backing: Option<PathBuf>,

    /// Instead of workloads: the four seed gains (preallocation, detect-zeroes, the
    /// compressed-write cache, parallels preallocation), each with its BENCHMARKS.md workload
    /// and the vublk configurations its target compares, alternating run by run; prints each
    /// row's speed-up, its target and "ok" or "BELOW TARGET", and exits with status 1 if a
    /// row is below its target. The preallocation row also shows the file system's own gain.
    /// Sizes are the seeds' own (--smoke shrinks them); --vublk picks the build to check.
    #[arg(long, conflicts_with_all = [
        "size", "backends", "workloads", "variants", "scaling", "list", "vublk_args",
        "backend_queues", "zero_fill", "fresh_file", "compress_fill", "fill_data",
        "compression_types", "parallels_fill", "zero_scan", "hop", "fresh_qcow2",
        "fresh_backing", "null_matrix",
    ])]
    pub seed_check: bool,
}

/// A size in bytes, with an optional K, M or G suffix (powers of two).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|e| format!("{s}: {e}"))
}
