//! Helpers of the snapshot and block-job tests: qemu-img's view of a chain, a disk of a
//! format with a pattern, waiting for a job, and a writer that flushes every write (for the
//! SIGKILL tests).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::*;

pub fn qemu_img(args: &[&str], paths: &[&Path]) -> String {
    run_ok(Command::new("qemu-img").args(args).args(paths))
}

/// `qemu-img compare` of an image (its format probed, its backing chain followed) with a
/// raw file: identical.
pub fn assert_compare(image: &Path, raw: &Path, what: &str) {
    let o = Command::new("qemu-img")
        .args(["compare", "-F", "raw"])
        .args([image, raw])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{what}: qemu-img compare {} {}: {}{}",
        image.display(),
        raw.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Does a process hold `img` open for writing? (QEMU's lock protocol: byte 101, the write
/// permission, is locked by every user that holds it.)
pub fn holds_write(img: &Path) -> bool {
    byte_locked(img, 101)
}

/// A disk of `fmt` holding a pattern in its first half (the second half never written).
pub fn make_disk(dir: &TestDir, fmt: &str, size: u64) -> PathBuf {
    let raw = dir.join("seed.raw");
    create_sparse_image(&raw, size);
    write_file_range(&raw, 0, &pattern((size / 2) as usize, 0, 5));
    let img = dir.join(&format!("disk.{fmt}"));
    qemu_img(&["convert", "-f", "raw", "-O", fmt], &[&raw, &img]);
    std::fs::remove_file(&raw).unwrap();
    img
}

/// The whole chain as qemu-img sees it: (file name, format) from the top down.
pub fn chain(top: &Path) -> Vec<(String, String)> {
    let out = qemu_img(&["info", "--backing-chain", "--output=json", "-U"], &[top]);
    let v: Value = serde_json::from_str(&out).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let name = Path::new(l["filename"].as_str().unwrap())
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (name, l["format"].as_str().unwrap().to_owned())
        })
        .collect()
}

pub fn read_disk_via_qemu(img: &Path, dir: &TestDir) -> Vec<u8> {
    let raw = dir.join("model.raw");
    let _ = std::fs::remove_file(&raw);
    qemu_img(&["convert", "-O", "raw"], &[img, &raw]);
    let v = read_file(&raw);
    std::fs::remove_file(&raw).unwrap();
    v
}

/// Skip (or, where the suite must run it, fail) a test of `what` without vublk or qemu-img.
pub fn skip_chain_test(what: &str) -> bool {
    if skip_unless_vublk(what) {
        return true;
    }
    if !have_qemu_img() {
        return skip_or_fail::<()>("qemu-img missing (qemu-utils)").is_none();
    }
    false
}

/// Poll `jobs` until job `id` is in `state` (within `limit`); its entry. A job that
/// concludes while another state is awaited fails the test.
fn wait_for_state(sock: &Path, id: &str, state: &str, limit: Duration) -> Value {
    let t0 = std::time::Instant::now();
    loop {
        let v = ctl_ok(sock, "jobs", &[]);
        let j = v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no job {id}: {v}"));
        if j["state"] == state {
            return j;
        }
        assert!(j["state"] != "concluded", "job {id} concluded: {j}");
        assert!(t0.elapsed() < limit, "job {id}, waiting for {state}: {j}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Poll `jobs` until job `id` concludes; its entry.
pub fn wait_job(sock: &Path, id: &str) -> Value {
    wait_for_state(sock, id, "concluded", Duration::from_secs(120))
}

/// Poll `jobs` until job `id` is in `state` (`ready`, `running`); its entry.
pub fn wait_state(sock: &Path, id: &str, state: &str) -> Value {
    wait_for_state(sock, id, state, Duration::from_secs(60))
}

/// A writer that flushes after every write, on a thread of its own, until the daemon dies
/// under it (`stop`): 64 KiB blocks of one byte value at random places of the disk.
pub struct FlushingWriter {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    log: Arc<std::sync::Mutex<Written>>,
    thread: std::thread::JoinHandle<()>,
}

/// What a [`FlushingWriter`] wrote: the writes whose flush completed, in order, and the
/// write in flight when the daemon died (on disk or not).
#[derive(Default)]
pub struct Written {
    pub flushed: Vec<(u64, u8)>,
    pending: Option<(u64, u8)>,
}

impl FlushingWriter {
    pub fn start(c: Client, seed: u64, size: u64) -> Self {
        let mut c = Shared(c);
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let log = Arc::new(std::sync::Mutex::new(Written::default()));
        let (s, w, l) = (stop.clone(), writes.clone(), log.clone());
        let thread = std::thread::spawn(move || {
            // The daemon is killed under it: its last request gives up within a second.
            set_io_deadline_for_this_thread(Duration::from_secs(1));
            let mut r = Rng::new(seed);
            while !s.load(Ordering::Relaxed) {
                let block = r.below(size / 65536) * 65536;
                let byte = (r.below(255) + 1) as u8;
                l.lock().unwrap().pending = Some((block, byte));
                if c.0.write_at(0, block, &[byte; 65536]) != 0 || c.0.submit(0, Op::Flush) != 0 {
                    break;
                }
                let mut g = l.lock().unwrap();
                g.flushed.push((block, byte));
                g.pending = None;
                drop(g);
                w.fetch_add(1, Ordering::Relaxed);
            }
            drop(c);
        });
        FlushingWriter {
            stop,
            writes,
            log,
            thread,
        }
    }

    /// Wait until `n` writes were flushed.
    pub fn wait_for(&self, n: u64) {
        while self.writes.load(Ordering::Relaxed) < n {
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// After the daemon died: what was written. (The client's wait for the dead daemon's
    /// last request times out, a panic in that thread: what it logged before counts.)
    pub fn stop(self) -> Written {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Written {
    /// `disk` holds the last flushed write of every block written (the write in flight at
    /// the kill may be there instead).
    pub fn check(&self, disk: &[u8], what: &str) {
        let last: std::collections::BTreeMap<u64, u8> = self.flushed.iter().copied().collect();
        for (block, byte) in &last {
            let here = &disk[*block as usize..*block as usize + 65536];
            if self
                .pending
                .is_some_and(|(pb, pbyte)| pb == *block && here.iter().all(|x| *x == pbyte))
            {
                continue;
            }
            assert!(
                here.iter().all(|x| x == byte),
                "{what}: a flushed write at {block} is lost"
            );
        }
    }
}

/// How many guest writes a job's write-through mode wrote through to its target, as the
/// daemon's log says at the switch.
pub fn written_through(log: &str) -> Option<u64> {
    let (before, _) = log.split_once("guest writes went through")?;
    before.trim_end().rsplit(' ').next()?.parse().ok()
}
