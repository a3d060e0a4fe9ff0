//! `--backup`: a backup of the running disk, vublk against qemu-storage-daemon doing the
//! same. vublk: `vublk ctl backup-begin` (copy-before-write view, NBD export on a UNIX
//! socket). qemu-storage-daemon: QEMU's fleecing, a copy-before-write node over the image
//! with a qcow2 scratch image as its target, a snapshot-access node over it exported by its
//! NBD server, the guest's vhost-user-blk export on the copy-before-write node.
//!
//! Each run: a fully written raw image of --size; 4 KiB random writes at depth 32 for
//! --seconds without a backup (the baseline), then the backup begins and `qemu-img convert`
//! copies the export to /dev/shm while the same writes go on until it ends. Reported: the
//! guest's write IOPS without and during the backup, and the backup's read MB/s.

use std::fmt::Write as _;
use std::fs::{self, File};
use std::mem::MaybeUninit;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use blkio::{Blkioq, ReqFlags};

use crate::alternate::{alternate, Order};
use crate::args::Opts;
use crate::backends::{Backend, BackendKind};
use crate::client::connect_client;
use crate::images::prepare_image;
use crate::report::{self, median_by};
use crate::server::{qsd_export, spawn, start_server, Server};

const BS: usize = 4096;
const DEPTH: usize = 32;

/// One run's result.
pub struct DuringResult {
    /// Guest 4 KiB write IOPS without the task (a backup, a job).
    pub base_iops: f64,
    /// Guest 4 KiB write IOPS while it runs.
    pub iops: f64,
    /// The task's rate in MB/s (the image size over its time).
    pub mbps: f64,
}

/// 4 KiB random writes at depth 32 on `q` until `stop` (or `until`); (I/Os, seconds).
fn write_until(
    q: &mut Blkioq,
    base: usize,
    capacity: u64,
    stop: &AtomicBool,
    until: Option<Instant>,
) -> (u64, f64) {
    let blocks = capacity / BS as u64;
    let mut rng: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % blocks) * BS as u64
    };
    let mut completions: Vec<MaybeUninit<blkio::Completion>> =
        (0..DEPTH).map(|_| MaybeUninit::uninit()).collect();
    // Slot i writes from the i-th 4 KiB of the mapped buffer to a random block.
    let mut submit = |q: &mut Blkioq, slot: usize| {
        q.write(
            next(),
            (base + slot * BS) as *mut u8,
            BS,
            slot,
            ReqFlags::empty(),
        )
    };
    let t0 = Instant::now();
    for slot in 0..DEPTH {
        submit(q, slot);
    }
    let (mut ios, mut in_flight) = (0u64, DEPTH);
    loop {
        let n = q.do_io(&mut completions, 1, None, None).expect("do_io");
        let done = stop.load(Ordering::Relaxed) || until.is_some_and(|u| Instant::now() >= u);
        for c in completions.iter().take(n) {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_ref() };
            assert_eq!(c.ret, 0, "guest write failed: errno {}", -c.ret);
            ios += 1;
            in_flight -= 1;
            if !done {
                submit(q, c.user_data);
                in_flight += 1;
            }
        }
        if done && in_flight == 0 {
            return (ios, t0.elapsed().as_secs_f64());
        }
    }
}

/// qemu-storage-daemon with QEMU's fleecing set up over `image`, the NBD export `backup`
/// on `nbd`.
fn qsd_fleecing(opts: &Opts, image: &Path, work: &Path, nbd: &Path) -> Server {
    let scratch = work.join("qsd-fleece.qcow2");
    let _ = fs::remove_file(&scratch);
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&scratch)
        .arg(opts.size.to_string())
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img create of the fleecing image");
    let socket = work.join("qsd.sock");
    let _ = fs::remove_file(&socket);
    let _ = fs::remove_file(nbd);
    let log = File::create(work.join("qsd.log")).expect("qsd log");
    let mut c = Command::new(&opts.qsd);
    c.args([
        "--blockdev",
        &format!(
            "driver=file,node-name=file0,filename={},cache.direct=on,aio=io_uring",
            image.display()
        ),
        "--blockdev",
        &format!(
            "driver=file,node-name=tmpfile,filename={},cache.direct=on,aio=io_uring",
            scratch.display()
        ),
        "--blockdev",
        "driver=qcow2,node-name=tmp,file=tmpfile",
        "--blockdev",
        "driver=copy-before-write,node-name=cbw,file=file0,target=tmp",
        "--blockdev",
        "driver=snapshot-access,node-name=acc,file=cbw",
        "--export",
        &qsd_export("cbw", &socket, opts.backend_queues),
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", nbd.display()),
        "--export",
        "type=nbd,id=nbd0,node-name=acc,name=backup",
    ])
    .stdin(Stdio::null())
    .stdout(log.try_clone().expect("dup"))
    .stderr(log);
    spawn(c, socket, "qsd")
}

/// A connected client with its buffers: 4 KiB writes at depth 32 until `stop` or `until`.
pub(crate) fn writes(
    backend: &Backend,
    server: &Server,
    image: &Path,
    stop: &AtomicBool,
    until: Option<Instant>,
) -> (u64, f64) {
    let (mut b, mut queues) = connect_client(backend, server, image, 1);
    let capacity = b.get_u64("capacity").expect("capacity");
    let r = b.alloc_mem_region(BS * DEPTH).expect("alloc region");
    b.map_mem_region(&r).expect("map region");
    // SAFETY: the region is ours, BS * DEPTH bytes long.
    unsafe { std::ptr::write_bytes(r.addr as *mut u8, 0x5a, BS * DEPTH) };
    let out = write_until(&mut queues[0], r.addr, capacity, stop, until);
    drop(queues);
    drop(b);
    out
}

/// One run through `backend`. The baseline first (vublk: in the process that then begins
/// the backup; qemu-storage-daemon: plain, since its fleecing runs from its start), then the
/// backup from its begin on, every granule still to copy.
fn measure(backend: &Backend, opts: &Opts, vublk: &Path, work: &Path) -> DuringResult {
    let image = work.join("backup-bench.img");
    prepare_image(&image, opts.size);
    let nbd = work.join("backup-nbd.sock");
    let _ = fs::remove_file(&nbd);
    let ctl = work.join("backup-ctl.sock");
    let never = AtomicBool::new(false);
    let baseline = |server: &Server| {
        let until = Instant::now() + Duration::from_secs_f64(opts.seconds);
        let (ios, secs) = writes(backend, server, &image, &never, Some(until));
        ios as f64 / secs
    };
    let (server, uri, base_iops) = match backend.kind {
        BackendKind::Vublk => {
            let mut b = backend.clone();
            b.extra
                .extend(["--control-socket".into(), ctl.display().to_string()]);
            let s = start_server(&b, &image, opts, vublk, work);
            let base = baseline(&s);
            let o = Command::new(backend.binary.as_deref().unwrap_or(vublk))
                .args(["ctl", "--control-socket"])
                .arg(&ctl)
                .args(["backup-begin", "--checkpoint", "bench", "--socket"])
                .arg(&nbd)
                .output()
                .expect("vublk ctl");
            assert!(
                o.status.success(),
                "backup-begin: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            (
                s,
                format!("nbd+unix:///bench?socket={}", nbd.display()),
                base,
            )
        }
        BackendKind::Qsd => {
            let base = baseline(&start_server(backend, &image, opts, vublk, work));
            let s = qsd_fleecing(opts, &image, work, &nbd);
            (
                s,
                format!("nbd+unix:///backup?socket={}", nbd.display()),
                base,
            )
        }
        BackendKind::File => panic!("--backup measures vublk and qsd"),
    };
    let out = Path::new("/dev/shm").join(format!("vublk-bench-backup-{}.raw", std::process::id()));
    let stop = AtomicBool::new(false);
    let (convert_secs, (ios, secs)) = std::thread::scope(|s| {
        let conv = s.spawn(|| {
            let t0 = Instant::now();
            let st = Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "raw", &uri])
                .arg(&out)
                .status()
                .expect("qemu-img convert");
            let secs = t0.elapsed().as_secs_f64();
            stop.store(true, Ordering::Relaxed);
            assert!(st.success(), "qemu-img convert of the export");
            secs
        });
        let w = writes(backend, &server, &image, &stop, None);
        (conv.join().expect("convert thread"), w)
    });
    let _ = fs::remove_file(&out);
    drop(server);
    let _ = fs::remove_file(&image);
    DuringResult {
        base_iops,
        iops: ios as f64 / secs,
        mbps: opts.size as f64 / convert_secs / 1e6,
    }
}

/// `--backup`: every backend (vublk and qsd builds), `--runs` times, alternating.
pub fn run(opts: &Opts, backends: &[Backend], vublk: &Path, work: &Path) {
    let how = format!(
        "A fully written {} MiB raw image; 4 KiB random writes at depth 32 (one queue) for {} s \
         without a backup, then during a backup read by `qemu-img convert` of the NBD export \
         to /dev/shm; {} runs, medians.",
        opts.size >> 20,
        opts.seconds,
        opts.runs
    );
    run_during(opts, backends, ("the backup", "backup read"), &how, |b| {
        measure(b, opts, vublk, work)
    });
}

/// Every backend but the file, `--runs` times, alternating, through `measure`: the guest's
/// write IOPS without and during a task (`what`: its name in the lines, the name of its
/// rate), the table after `how`.
/// A task's rate for the table: MB/s, or that it did not conclude (a job given up after
/// --job-limit).
fn mb_per_s(m: f64) -> String {
    if m.is_nan() {
        "not concluded".into()
    } else {
        format!("{m:.0} MB/s")
    }
}

pub(crate) fn run_during(
    opts: &Opts,
    backends: &[Backend],
    what: (&str, &str),
    how: &str,
    measure: impl FnMut(&Backend) -> DuringResult,
) {
    let backends: Vec<Backend> = backends
        .iter()
        .filter(|b| b.kind != BackendKind::File)
        .cloned()
        .collect();
    let (task, rate) = what;
    let results = alternate(
        opts.runs,
        Order::of(opts),
        &backends,
        measure,
        |run, b, r| {
            format!(
                "run {run} {:8} writes {:.0} IOPS without, {:.0} during {task}; {rate} {}",
                b.name(),
                r.base_iops,
                r.iops,
                mb_per_s(r.mbps)
            )
        },
    );
    let mut rows = String::new();
    for (b, rs) in backends.iter().zip(&results) {
        let base = median_by(rs, |r| r.base_iops);
        let during = median_by(rs, |r| r.iops);
        let _ = writeln!(
            rows,
            "| {} | {:.0} | {:.0} | {:.2} | {} |",
            b.name(),
            base,
            during,
            during / base,
            mb_per_s(median_by(rs, |r| r.mbps))
        );
    }
    report::emit(
        opts,
        &report::table(
            how,
            &format!(
                "| backend | write IOPS, without | write IOPS during {task} | during / without | {rate} |"
            ),
            "|---|---:|---:|---:|---:|",
            &rows,
        ),
    );
}
