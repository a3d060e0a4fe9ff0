//! Runs that alternate: every backend (or configuration) is measured once per round and the
//! rounds repeat `--runs` times, so that what drifts on the machine (caches, the file
//! system's background work, other load) spreads over all of them instead of falling on the
//! one measured last; `--rotate` also rotates their order round by round.

use crate::args::Opts;

/// The order of the items within a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// As listed, every round.
    Listed,
    /// Round r starts with item r (mod n), so that every item takes every place in the order
    /// equally often and what one run leaves behind (a big file being freed) does not always
    /// fall on the same item.
    Rotated,
}

impl Order {
    /// The order `--rotate` asks for.
    pub fn of(opts: &Opts) -> Order {
        if opts.rotate {
            Order::Rotated
        } else {
            Order::Listed
        }
    }

    /// The indices of `n` items in the order of round `run` (counted from 0).
    pub fn round(self, run: usize, n: usize) -> impl Iterator<Item = usize> {
        let start = match self {
            Order::Listed => 0,
            Order::Rotated => run % n,
        };
        (0..n).map(move |k| (start + k) % n)
    }
}

/// `measure` every item, once per round for `runs` rounds, in `order`; after each run print
/// `line(run, item, result)` (the run counted from 1) to stderr. Every item's results, in
/// the order of `items`.
pub fn alternate<I, T>(
    runs: usize,
    order: Order,
    items: &[I],
    mut measure: impl FnMut(&I) -> T,
    line: impl Fn(usize, &I, &T) -> String,
) -> Vec<Vec<T>> {
    let mut results: Vec<Vec<T>> = items.iter().map(|_| Vec::new()).collect();
    for run in 0..runs {
        for i in order.round(run, items.len()) {
            let r = measure(&items[i]);
            eprintln!("{}", line(run + 1, &items[i], &r));
            results[i].push(r);
        }
    }
    results
}
