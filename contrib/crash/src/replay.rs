//! Crash states from a recording.
//!
//! The model is the weakest a POSIX file system promises: a write, truncate or fallocate is
//! durable once an fsync or fdatasync of its file completed after it (or, for a write made
//! with O_DSYNC/RWF_DSYNC, once it completed); a create, rename or unlink once the directory
//! was synced after it. Anything else may be lost at a power cut, each operation
//! independently, and a write that spans several 512-byte sectors may keep any of them.
//! Directory changes are the one exception to "independently": file systems journal them in
//! order, so a state keeps a prefix of the directory changes not yet durable.
//!
//! A crash point is the moment just before a durability point (a sync, a directory sync, a
//! synchronous write) takes effect, or the end of the recording. At crash point `c` the
//! state holds every operation durable by then and a subset of the ones that are not (the
//! pending ones). Which subsets: none, all, each single one, each single multi-sector write
//! torn, each prefix, and random subsets (some writes torn), up to the point's share of the
//! state count.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::image::{Files, SECTOR};
use crate::record::{Op, Recording};

/// How a torn write is kept: one flag per piece (512 bytes, or the replay's tear unit), in
/// order.
pub type Tear = Vec<bool>;

#[derive(Clone, Debug)]
enum Pick {
    None,
    All,
    Single(usize),
    TornSingle(usize, u64),
    Prefix(usize),
    Random(u64),
}

/// The pending operations one state keeps.
struct Selection {
    pick: Pick,
    keep: Vec<bool>,
    tears: BTreeMap<usize, Tear>,
}

impl Selection {
    fn key(&self) -> (Vec<bool>, Vec<(usize, Tear)>) {
        (
            self.keep.clone(),
            self.tears.iter().map(|(k, t)| (*k, t.clone())).collect(),
        )
    }
}

/// One crash state.
#[derive(Debug)]
pub struct State {
    /// The crash point: the state holds (a subset of) records `..point`.
    pub point: usize,
    /// The position of the last mark before the crash point.
    pub mark: Option<usize>,
    /// Operations not yet durable at the crash point.
    pub pending: usize,
    /// How many of them the state keeps (a torn write counts once).
    pub kept: usize,
    /// What was picked, for a failure report.
    pub what: String,
    pub files: Files,
}

/// The crash states of one recording.
pub struct Replay<'a> {
    rec: &'a Recording,
    /// For each record that changes something: the record that makes it durable (a later
    /// sync, or itself for a synchronous write); None if nothing ever does.
    durable_at: Vec<Option<usize>>,
    /// Crash points, in order.
    points: Vec<usize>,
    /// What a torn write keeps or loses as a whole (512: any sector).
    unit: u64,
}

impl<'a> Replay<'a> {
    pub fn new(rec: &'a Recording) -> Replay<'a> {
        let n = rec.records.len();
        let mut durable_at = vec![None; n];
        let mut pending_by_file: HashMap<u64, Vec<usize>> = HashMap::new();
        let mut pending_dir: Vec<usize> = Vec::new();
        let mut points = Vec::new();
        let mut changed_since_point = false;
        for (i, r) in rec.records.iter().enumerate() {
            let durability = match &r.op {
                Op::Sync { file, .. } => {
                    for p in pending_by_file.remove(file).unwrap_or_default() {
                        durable_at[p] = Some(i);
                    }
                    true
                }
                Op::SyncDir => {
                    for p in pending_dir.drain(..) {
                        durable_at[p] = Some(i);
                    }
                    true
                }
                Op::Write { dsync: true, .. } => {
                    durable_at[i] = Some(i);
                    true
                }
                _ => false,
            };
            if durability && changed_since_point {
                points.push(i);
                changed_since_point = false;
            }
            match &r.op {
                Op::Mark(_) => changed_since_point = true,
                op if op.is_namespace() => {
                    pending_dir.push(i);
                    changed_since_point = true;
                }
                op => {
                    if let (Some(f), false) = (op.data_file(), durable_at[i].is_some()) {
                        pending_by_file.entry(f).or_default().push(i);
                    }
                    changed_since_point |= op.data_file().is_some();
                }
            }
        }
        points.push(n);
        Replay {
            rec,
            durable_at,
            points,
            unit: SECTOR,
        }
    }

    /// Tear writes at aligned blocks of `unit` bytes (a multiple of 512) instead of at
    /// sectors: a storage stack that keeps each aligned block whole, as the guest's file
    /// system above it assumes of its disk.
    pub fn with_tear_unit(mut self, unit: u64) -> Replay<'a> {
        assert!(
            unit >= SECTOR && unit.is_multiple_of(SECTOR),
            "tear unit {unit}: not a multiple of 512"
        );
        self.unit = unit;
        self
    }

    /// The crash points (record positions).
    pub fn points(&self) -> &[usize] {
        &self.points
    }

    fn changes(&self, i: usize) -> bool {
        let op = &self.rec.records[i].op;
        op.is_namespace() || op.data_file().is_some()
    }

    fn durable(&self, i: usize, point: usize) -> bool {
        self.durable_at[i].is_some_and(|d| d < point)
    }

    /// The operations not durable at `point`, in order.
    pub fn pending(&self, point: usize) -> Vec<usize> {
        (0..point)
            .filter(|&i| self.changes(i) && !self.durable(i, point))
            .collect()
    }

    fn tearable(&self, i: usize) -> bool {
        match &self.rec.records[i].op {
            Op::Write { offset, data, .. } => pieces(*offset, data.len(), self.unit).len() > 1,
            _ => false,
        }
    }

    /// Up to `budget` distinct states over all crash points (at least one per point), the
    /// same for the same `seed`.
    pub fn states(&self, budget: usize, seed: u64) -> impl Iterator<Item = State> + '_ {
        let mut rng = Rng(seed);
        let mut plan: Vec<(usize, Vec<Selection>)> = Vec::new();
        let mut left = budget.max(self.points.len());
        for (k, &point) in self.points.iter().enumerate() {
            let share = (left / (self.points.len() - k)).max(1);
            let pending = self.pending(point);
            let n = pending.len();
            let mut picks = vec![Pick::None];
            if n > 0 {
                picks.push(Pick::All);
            }
            let mut more: Vec<Pick> = Vec::new();
            if n > 1 {
                more.extend((0..n).map(Pick::Single));
                more.extend((1..n).map(Pick::Prefix));
            }
            more.extend(
                (0..n)
                    .filter(|&j| self.tearable(pending[j]))
                    .map(|j| Pick::TornSingle(j, rng.next())),
            );
            if more.len() + picks.len() > share {
                // Keep none and all; sample the rest.
                for j in (1..more.len()).rev() {
                    more.swap(j, rng.below(j as u64 + 1) as usize);
                }
                more.truncate(share.saturating_sub(picks.len()));
            }
            picks.extend(more);
            let mut seen = HashSet::new();
            let mut chosen: Vec<Selection> = Vec::new();
            for pick in picks {
                let sel = self.select(&pending, pick);
                if seen.insert(sel.key()) {
                    chosen.push(sel);
                }
            }
            // Random subsets until the share is met (or they keep coming out the same).
            let mut tries = 0;
            while chosen.len() < share && tries < 8 * share && n > 0 {
                tries += 1;
                let sel = self.select(&pending, Pick::Random(rng.next()));
                if seen.insert(sel.key()) {
                    chosen.push(sel);
                }
            }
            left = left.saturating_sub(chosen.len());
            plan.push((point, chosen));
        }
        let mut base = self.rec.initial.clone();
        let mut base_at = 0usize;
        plan.into_iter().flat_map(move |(point, selections)| {
            let pending = self.pending(point);
            let frontier = pending.first().copied().unwrap_or(point);
            for r in &self.rec.records[base_at..frontier] {
                base.apply(&r.op);
            }
            base_at = base_at.max(frontier);
            let base = base.clone();
            let mark = self.rec.records[..point]
                .iter()
                .rposition(|r| matches!(r.op, Op::Mark(_)));
            selections
                .into_iter()
                .map(|sel| self.build(&base, base_at, point, mark, &pending, sel))
                .collect::<Vec<_>>()
        })
    }

    /// Which pending operations a pick keeps, and how the torn ones tear.
    fn select(&self, pending: &[usize], pick: Pick) -> Selection {
        let n = pending.len();
        let mut keep: Vec<bool> = vec![false; n];
        let mut tears: BTreeMap<usize, Tear> = BTreeMap::new();
        match &pick {
            Pick::None => {}
            Pick::All => keep.fill(true),
            Pick::Single(j) => keep[*j] = true,
            Pick::Prefix(k) => keep[..*k].fill(true),
            Pick::TornSingle(j, s) => {
                keep[*j] = true;
                tears.insert(*j, self.tear(pending[*j], &mut Rng(*s)));
            }
            Pick::Random(s) => {
                let mut rng = Rng(*s);
                for j in 0..n {
                    keep[j] = rng.below(2) == 0;
                    if keep[j] && self.tearable(pending[j]) && rng.below(4) == 0 {
                        tears.insert(j, self.tear(pending[j], &mut rng));
                    }
                }
            }
        }
        // Directory changes are kept as a prefix: a later one kept keeps the earlier ones.
        if let Some(last) = (0..n)
            .rev()
            .find(|&j| keep[j] && self.rec.records[pending[j]].op.is_namespace())
        {
            for j in 0..last {
                if self.rec.records[pending[j]].op.is_namespace() {
                    keep[j] = true;
                }
            }
        }
        Selection { pick, keep, tears }
    }

    fn build(
        &self,
        base: &Files,
        base_at: usize,
        point: usize,
        mark: Option<usize>,
        pending: &[usize],
        sel: Selection,
    ) -> State {
        let Selection { pick, keep, tears } = sel;
        let n = pending.len();
        let mut files = base.clone();
        let kept_at: HashMap<usize, usize> = (0..n)
            .filter(|&j| keep[j])
            .map(|j| (pending[j], j))
            .collect();
        for i in base_at..point {
            if !self.changes(i) {
                continue;
            }
            let op = &self.rec.records[i].op;
            if self.durable(i, point) {
                files.apply(op);
            } else if let Some(j) = kept_at.get(&i) {
                match (tears.get(j), op) {
                    (
                        Some(tear),
                        Op::Write {
                            file,
                            offset,
                            data,
                            dsync,
                        },
                    ) => {
                        for ((o, range), kept) in
                            pieces(*offset, data.len(), self.unit).into_iter().zip(tear)
                        {
                            if *kept {
                                files.apply(&Op::Write {
                                    file: *file,
                                    offset: o,
                                    data: data[range].to_vec(),
                                    dsync: *dsync,
                                });
                            }
                        }
                    }
                    _ => files.apply(op),
                }
            }
        }
        State {
            point,
            mark,
            pending: n,
            kept: keep.iter().filter(|&&k| k).count(),
            what: format!(
                "crash before record {point} of {} ({}): {n} pending [{}], kept {:?}{}",
                self.rec.records.len(),
                self.rec
                    .records
                    .get(point)
                    .map_or("the end".to_string(), |r| short(&r.op)),
                pending
                    .iter()
                    .map(|&i| format!("{i}: {}", short(&self.rec.records[i].op)))
                    .collect::<Vec<_>>()
                    .join(", "),
                pick,
                if tears.is_empty() {
                    String::new()
                } else {
                    format!(", torn {tears:?}")
                }
            ),
            files,
        }
    }

    /// A tear of write `i`: some of its pieces kept, at least one kept and one lost.
    fn tear(&self, i: usize, rng: &mut Rng) -> Tear {
        let Op::Write { offset, data, .. } = &self.rec.records[i].op else {
            unreachable!("only writes tear")
        };
        let n = pieces(*offset, data.len(), self.unit).len();
        let mut t: Tear = (0..n).map(|_| rng.below(2) == 0).collect();
        if t.iter().all(|&k| k) {
            t[rng.below(n as u64) as usize] = false;
        }
        if !t.iter().any(|&k| k) {
            t[rng.below(n as u64) as usize] = true;
        }
        t
    }
}

/// An operation in a few words (no data).
fn short(op: &Op) -> String {
    match op {
        Op::Write {
            file,
            offset,
            data,
            dsync,
        } => format!(
            "write file {file} {offset}+{}{}",
            data.len(),
            if *dsync { " dsync" } else { "" }
        ),
        Op::Mark(m) => format!("mark {m:?}"),
        other => format!("{other:?}"),
    }
}

/// The pieces of a write at `offset` that tear apart: its parts in each aligned block of
/// `unit` bytes, each piece's file offset and its range in the data.
fn pieces(offset: u64, len: usize, unit: u64) -> Vec<(u64, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    let mut done = 0usize;
    while done < len {
        let pos = offset + done as u64;
        let n = ((unit - pos % unit) as usize).min(len - done);
        out.push((pos, done..done + n));
        done += n;
    }
    out
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Record;

    fn rec(ops: Vec<Op>) -> Recording {
        let mut r = Recording::default();
        r.initial.apply(&Op::Create {
            file: 2,
            name: "a".into(),
        });
        r.records = ops.into_iter().map(|op| Record { at_ns: 0, op }).collect();
        r
    }

    fn w(offset: u64, byte: u8, len: usize) -> Op {
        Op::Write {
            file: 2,
            offset,
            data: vec![byte; len],
            dsync: false,
        }
    }

    const SYNC: Op = Op::Sync {
        file: 2,
        data_only: true,
    };

    #[test]
    fn synced_writes_survive_every_state_and_pending_ones_vary() {
        let r = rec(vec![w(0, 1, 512), SYNC, w(512, 2, 1024), w(0, 3, 512)]);
        let replay = Replay::new(&r);
        assert_eq!(replay.points(), &[1, 4]);
        let states: Vec<State> = replay.states(100, 1).collect();
        let at_end: Vec<&State> = states.iter().filter(|s| s.point == 4).collect();
        assert!(at_end.len() > 6, "{} states at the end", at_end.len());
        let mut seen = std::collections::HashSet::new();
        for s in &at_end {
            let a = s.files.get("a").unwrap();
            // The synced write is there unless the later write replaced it.
            assert!([1u8, 3].contains(&a.read(0, 1)[0]), "{}", s.what);
            seen.insert(a.read(0, 1536));
        }
        // none, all, each single, torn versions: several different files.
        assert!(seen.len() >= 5, "only {} distinct states", seen.len());
        // Before the sync: the first write may be lost.
        assert!(states
            .iter()
            .any(|s| s.point == 1 && s.files.get("a").unwrap().is_empty()));
        // A torn 1024-byte write keeps exactly one of its two sectors somewhere.
        assert!(at_end.iter().any(|s| {
            let a = s.files.get("a").unwrap().read(512, 1024);
            a[..512].iter().all(|&b| b == 2) != a[512..].iter().all(|&b| b == 2)
        }));
    }

    #[test]
    fn a_tear_unit_keeps_aligned_blocks_whole() {
        // 8 KiB at 2 KiB: pieces [2K, 4K), [4K, 8K), [8K, 10K) at a 4 KiB unit.
        let r = rec(vec![w(2048, 7, 8192)]);
        let states: Vec<State> = Replay::new(&r)
            .with_tear_unit(4096)
            .states(400, 3)
            .collect();
        let mut torn = 0;
        for s in &states {
            let a = s.files.get("a").unwrap().read(0, 10240);
            for block in [&a[2048..4096], &a[4096..8192], &a[8192..10240]] {
                let kept = block.iter().filter(|&&b| b == 7).count();
                assert!(kept == 0 || kept == block.len(), "{}", s.what);
            }
            let blocks = [2048, 4096, 8192].iter().filter(|&&o| a[o] == 7).count();
            torn += usize::from(blocks == 1 || blocks == 2);
        }
        assert!(torn > 0, "no torn state among {}", states.len());
    }

    #[test]
    fn directory_changes_need_a_directory_sync() {
        let r = rec(vec![
            Op::Create {
                file: 3,
                name: "tmp".into(),
            },
            Op::Write {
                file: 3,
                offset: 0,
                data: vec![9; 4],
                dsync: false,
            },
            Op::Sync {
                file: 3,
                data_only: false,
            },
            Op::Rename {
                from: "tmp".into(),
                to: "a".into(),
            },
            Op::SyncDir,
            Op::Mark("done".into()),
        ]);
        let replay = Replay::new(&r);
        for s in replay.states(50, 2) {
            let a = s.files.get("a").unwrap();
            if s.point > 4 {
                assert_eq!(a.read(0, 4), vec![9; 4], "{}", s.what);
                assert!(s.files.get("tmp").is_none());
            } else {
                // The old "a" or the new one, never a half-written new one.
                assert!(a.is_empty() || a.read(0, 4) == vec![9; 4], "{}", s.what);
            }
        }
    }

    #[test]
    fn a_synchronous_write_is_durable_alone() {
        let r = rec(vec![
            w(0, 1, 512),
            Op::Write {
                file: 2,
                offset: 512,
                data: vec![2; 512],
                dsync: true,
            },
        ]);
        let replay = Replay::new(&r);
        for s in replay.states(50, 3).filter(|s| s.point == 2) {
            let a = s.files.get("a").unwrap();
            assert_eq!(a.read(512, 512), vec![2; 512], "{}", s.what);
        }
    }
}
