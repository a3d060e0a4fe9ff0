//! The inflight protocol against a crash at every store: a simulated region and used ring
//! (one store budget for both: the process dies after N stores), a driver that publishes
//! and reuses heads, and a device that takes and completes requests in a random order.
//! After the crash a new tracker recovers; every request the guest has not got back must
//! come back exactly once (resubmitted, or taken again from the available ring), in the
//! order it was taken, and none it has got back.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::*;

const QSIZE: u16 = 8;

/// Bytes: the queue's region, then the used ring (idx at `RING`, entries after it).
const RING: usize = 1024;

struct SimCells {
    bytes: Mutex<Vec<u8>>,
    /// Stores left before the "crash"; later stores are lost.
    budget: AtomicUsize,
}

impl SimCells {
    fn new(budget: usize) -> Arc<SimCells> {
        Arc::new(SimCells {
            bytes: Mutex::new(vec![0; RING + 2 + 2 * 4096]),
            budget: AtomicUsize::new(budget),
        })
    }
    fn crashed(&self) -> bool {
        self.budget.load(Ordering::SeqCst) == 0
    }
    fn store(&self, off: usize, v: &[u8]) {
        if self
            .budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
            .is_ok()
        {
            self.bytes.lock().unwrap()[off..off + v.len()].copy_from_slice(v);
        }
    }
    fn load<const N: usize>(&self, off: usize) -> [u8; N] {
        self.bytes.lock().unwrap()[off..off + N].try_into().unwrap()
    }
    /// A new process: the same memory, as many stores as it likes.
    fn restart(&self, budget: usize) {
        self.budget.store(budget, Ordering::SeqCst);
    }
    fn ring_idx(&self) -> u16 {
        u16::from_le_bytes(self.load(RING))
    }
    fn ring_entry(&self, i: u16) -> u16 {
        u16::from_le_bytes(self.load(RING + 2 + 2 * usize::from(i)))
    }
}

impl Cells for SimCells {
    fn load_u8(&self, off: usize) -> u8 {
        self.load::<1>(off)[0]
    }
    fn load_u16(&self, off: usize) -> u16 {
        u16::from_le_bytes(self.load(off))
    }
    fn load_u64(&self, off: usize) -> u64 {
        u64::from_le_bytes(self.load(off))
    }
    fn store_u8(&self, off: usize, v: u8) {
        self.store(off, &[v]);
    }
    fn store_u16(&self, off: usize, v: u16) {
        self.store(off, &v.to_le_bytes());
    }
    fn store_u64(&self, off: usize, v: u64) {
        self.store(off, &v.to_le_bytes());
    }
}

use crate::testing::XorShift as Rng;

/// The guest's side: the available ring (position -> head) and the heads it has not got
/// back, read from the used ring as the device publishes.
struct Driver {
    avail: Vec<u16>,
    outstanding: BTreeSet<u16>,
    seen_used: u16,
}

impl Driver {
    fn new() -> Self {
        Driver {
            avail: Vec::new(),
            outstanding: BTreeSet::new(),
            seen_used: 0,
        }
    }
    fn publish(&mut self, rng: &mut Rng) -> bool {
        let free: Vec<u16> = (0..QSIZE)
            .filter(|h| !self.outstanding.contains(h))
            .collect();
        if free.is_empty() {
            return false;
        }
        let h = free[(rng.next_u64() % free.len() as u64) as usize];
        self.avail.push(h);
        self.outstanding.insert(h);
        true
    }
    fn reap(&mut self, cells: &SimCells) {
        while self.seen_used != cells.ring_idx() {
            self.outstanding.remove(&cells.ring_entry(self.seen_used));
            self.seen_used += 1;
        }
    }
}

/// Run a device for `steps` random steps with a store budget; returns the driver, the
/// heads in the order the device took them, and whether the budget ran out.
fn run_device(
    cells: &Arc<SimCells>,
    t: &mut QueueInflight,
    seed: u64,
    steps: usize,
    d: &mut Driver,
    popped: &mut u16,
    taken_order: &mut Vec<u16>,
) {
    let mut rng = Rng(seed);
    let mut device_outstanding: Vec<u16> = Vec::new();
    for _ in 0..steps {
        if cells.crashed() {
            return;
        }
        d.reap(cells);
        if rng.next_u64().is_multiple_of(2) {
            if usize::from(*popped) == d.avail.len() && !d.publish(&mut rng) {
                continue;
            }
            let head = d.avail[usize::from(*popped)];
            *popped += 1;
            t.taken(head);
            taken_order.push(head);
            device_outstanding.push(head);
        } else if !device_outstanding.is_empty() {
            let j = (rng.next_u64() % device_outstanding.len() as u64) as usize;
            let head = device_outstanding.remove(j);
            let c = cells.clone();
            t.complete(head, move || {
                let idx = c.ring_idx();
                c.store(RING + 2 + 2 * usize::from(idx), &head.to_le_bytes());
                c.store(RING, &(idx + 1).to_le_bytes());
                Some(idx + 1)
            });
        }
    }
}

/// What a restarted device would process: the resubmitted heads, then the available ring
/// from the position recovery gives. Each outstanding head exactly once, none other.
fn check_recovery(
    cells: &Arc<SimCells>,
    d: &Driver,
    taken_order: &[u16],
    r: &Recovered,
    what: &str,
) {
    let ring_used = cells.ring_idx();
    let next_avail = usize::from(ring_used) + r.resubmit.len();
    assert!(
        next_avail <= d.avail.len(),
        "{what}: avail position {next_avail} beyond the ring ({})",
        d.avail.len()
    );
    let mut got: Vec<u16> = r.resubmit.clone();
    got.extend_from_slice(&d.avail[next_avail..]);
    let got_set: BTreeSet<u16> = got.iter().copied().collect();
    assert_eq!(
        got_set.len(),
        got.len(),
        "{what}: a request would run twice: {got:?}"
    );
    // The driver's view, from the used ring as it stands.
    let mut expect = d.outstanding.clone();
    for i in d.seen_used..ring_used {
        expect.remove(&cells.ring_entry(i));
    }
    assert_eq!(
        got_set, expect,
        "{what}: resubmit {:?}, avail from {next_avail}",
        r.resubmit
    );
    // Resubmitted in the order taken (the last occurrence of each head in the taken order).
    let pos = |h: u16| taken_order.iter().rposition(|&x| x == h).unwrap();
    assert!(
        r.resubmit.windows(2).all(|w| pos(w[0]) < pos(w[1])),
        "{what}: resubmit order {:?} vs taken {taken_order:?}",
        r.resubmit
    );
}

fn tracker(cells: &Arc<SimCells>) -> QueueInflight {
    let c: Arc<dyn Cells> = cells.clone();
    QueueInflight::over(c, 0, QSIZE)
}

#[test]
fn queue_region_sizes_follow_the_layout() {
    assert_eq!(queue_region_bytes(128), 16 + 16 * 128 + 48);
    assert_eq!(queue_region_bytes(1), 64);
    assert_eq!(region_bytes(2, 256), 2 * queue_region_bytes(256));
}

/// A crash after every store of a random run (several scripts): recovery gives back exactly
/// the requests the guest has not got, in order. Then a crash at every store of the
/// recovery itself, and a second recovery: the same answer.
#[test]
fn recovery_is_exact_after_a_crash_at_every_store() {
    for seed in 1..=40u64 {
        // How many stores the whole run makes without a crash.
        let full = {
            let cells = SimCells::new(usize::MAX);
            let mut t = tracker(&cells);
            let (mut d, mut popped, mut order) = (Driver::new(), 0, Vec::new());
            run_device(&cells, &mut t, seed, 60, &mut d, &mut popped, &mut order);
            usize::MAX - cells.budget.load(Ordering::SeqCst)
        };
        for crash_at in 0..=full {
            let cells = SimCells::new(crash_at);
            let mut t = tracker(&cells);
            let (mut d, mut popped, mut order) = (Driver::new(), 0, Vec::new());
            run_device(&cells, &mut t, seed, 60, &mut d, &mut popped, &mut order);
            // The recovery crashes too, after every one of its stores (it writes few).
            for recovery_crash in [0, 1, 2, 3, usize::MAX] {
                cells.restart(recovery_crash);
                let mut t2 = tracker(&cells);
                let r = t2.recover(cells.ring_idx(), QSIZE);
                if recovery_crash != usize::MAX {
                    continue;
                }
                check_recovery(
                    &cells,
                    &d,
                    &order,
                    &r,
                    &format!("seed {seed}, crash after {crash_at} stores"),
                );
            }
        }
    }
}

/// The counter continues after the highest recovered one, so requests taken after a
/// restart sort after the resubmitted ones at the next recovery.
#[test]
fn the_counter_continues_after_recovery() {
    let cells = SimCells::new(usize::MAX);
    let mut t = tracker(&cells);
    t.taken(3);
    t.taken(5);
    let mut t2 = tracker(&cells);
    assert_eq!(t2.recover(0, QSIZE).resubmit, vec![3, 5]);
    t2.taken(1);
    let mut t3 = tracker(&cells);
    assert_eq!(t3.recover(0, QSIZE).resubmit, vec![3, 5, 1]);
}

/// A region the frontend filled with garbage: indexes out of range, a batch longer than
/// the queue, a `next` loop. Recovery ends, touches only the queue's entries, and returns
/// only heads inside the ring's size.
#[test]
fn garbage_regions_are_survived() {
    for seed in 1..200u64 {
        let cells = SimCells::new(usize::MAX);
        let mut rng = Rng(seed);
        {
            let mut b = cells.bytes.lock().unwrap();
            for x in b[..queue_region_bytes(QSIZE)].iter_mut() {
                *x = rng.next_u64() as u8;
            }
        }
        let mut t = tracker(&cells);
        let r = t.recover(rng.next_u64() as u16, 4);
        assert!(r.resubmit.iter().all(|&h| h < 4), "{:?}", r.resubmit);
        assert!(r.repaired <= QSIZE);
        let set: BTreeSet<u16> = r.resubmit.iter().copied().collect();
        assert_eq!(set.len(), r.resubmit.len());
        // Nothing past the queue's region was written.
        assert!(cells.bytes.lock().unwrap()[queue_region_bytes(QSIZE)..]
            .iter()
            .all(|&b| b == 0));
    }
}

#[test]
fn created_regions_are_sealed_and_mapped_back() {
    let (file, size) = InflightRegion::create(2, 128).unwrap();
    assert_eq!(size as usize, region_bytes(2, 128));
    // The frontend cannot shrink it.
    assert!(file.set_len(0).is_err());
    let r = Arc::new(InflightRegion::map(&file, size, 0, 2, 128).unwrap());
    assert_eq!(r.load_u16(OFF_VERSION), VERSION);
    assert_eq!(r.load_u16(queue_region_bytes(128) + OFF_DESC_NUM), 128);
    let mut q1 = QueueInflight::new(&r, 1).unwrap();
    assert!(QueueInflight::new(&r, 2).is_none());
    q1.taken(7);
    // A second mapping of the same file (the next process) sees it.
    let again = Arc::new(InflightRegion::map(&file, size, 0, 2, 128).unwrap());
    assert_eq!(
        QueueInflight::new(&again, 1)
            .unwrap()
            .recover(0, 128)
            .resubmit,
        vec![7]
    );
    assert!(QueueInflight::new(&again, 0)
        .unwrap()
        .recover(0, 128)
        .resubmit
        .is_empty());
}

#[test]
fn regions_that_do_not_hold_what_they_claim_are_refused() {
    let (file, size) = InflightRegion::create(1, 128).unwrap();
    assert!(matches!(
        InflightRegion::map(&file, size, 0, 2, 128),
        Err(InflightError::TooSmall { .. })
    ));
    assert!(matches!(
        InflightRegion::map(&file, size * 4, 0, 1, 128),
        Err(InflightError::BeyondFile { .. })
    ));
    assert!(matches!(
        InflightRegion::map(&file, size, 1, 1, 128),
        Err(InflightError::Offset(1))
    ));
    assert!(matches!(
        InflightRegion::map(&file, u64::MAX, 4096, 1, 128),
        Err(InflightError::BeyondFile { .. })
    ));
    assert!(matches!(
        InflightRegion::map(&file, size, 0, 1, 100),
        Err(InflightError::Shape { .. })
    ));
    assert!(matches!(
        InflightRegion::map(&file, size, 0, 0, 128),
        Err(InflightError::Shape { .. })
    ));
    assert!(matches!(
        InflightRegion::create(1, 0),
        Err(InflightError::Shape { .. })
    ));
}
