//! VIRTIO_F_IN_ORDER (virtio 1.1+, 2.7.9 for split rings): once negotiated, the device uses
//! buffers in the order the driver made them available, so the driver may look up the used
//! ring by position instead of by id. A queue's requests still complete in any order (the
//! engine, the pools, the I/O limits); this is where finished ones wait for those taken
//! before them.
//!
//! Every request taken is numbered (`taken`); a finished one is parked under its number
//! (`finished`); `ready` hands out the run of finished requests that continues the used
//! ring, oldest first. Every taken request finishes exactly once in a well-behaved ring
//! (errors and chains cut short too: they are used with a length of 0), so nothing waits
//! for ever. A driver that makes a head available again while it is in flight (which the
//! spec forbids) gets its earlier use skipped rather than a queue that stops: its own ring
//! is wrong either way, and nothing here panics or stalls on it.

/// One queue's order book.
#[derive(Debug)]
pub(super) struct InOrder {
    /// Per head: the number it was taken under, while in flight.
    seq_of: Vec<Option<u16>>,
    /// Per number modulo a power of two at least the queue size (so that the numbers'
    /// wrap at 65536 keeps consecutive numbers in distinct places): the finished request
    /// (head, used length), or a number given up (`Skip`).
    parked: Vec<Parked>,
    /// The number the next request taken gets.
    next_taken: u16,
    /// The number the used ring continues with.
    next_used: u16,
    /// Scratch for `reorder` (kept, so that ordering allocates nothing per batch).
    scratch: Vec<(u16, u32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parked {
    Empty,
    Done(u16, u32),
    Skip,
}

impl InOrder {
    /// For a queue of `size` entries (at most 32768, a power of two for split rings; any
    /// size works here).
    pub(super) fn new(size: u16) -> Self {
        let n = usize::from(size.max(1));
        InOrder {
            seq_of: vec![None; n],
            parked: vec![Parked::Empty; n.next_power_of_two()],
            next_taken: 0,
            next_used: 0,
            scratch: Vec::with_capacity(n),
        }
    }

    /// Replace the finished requests in `list` (in the order they finished) by those that
    /// may go on the used ring now, in the order they were taken; the rest wait here.
    pub(super) fn reorder(&mut self, list: &mut Vec<(u16, u32)>) {
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        for (head, len) in list.drain(..) {
            if let Some(x) = self.finished(head, len) {
                out.push(x);
            }
        }
        self.ready(&mut out);
        std::mem::swap(list, &mut out);
        self.scratch = out;
    }

    fn slot(&self, seq: u16) -> usize {
        usize::from(seq) % self.parked.len()
    }

    /// Requests taken and not yet handed out.
    pub(super) fn outstanding(&self) -> usize {
        usize::from(self.next_taken.wrapping_sub(self.next_used))
    }

    /// `head` was taken from the available ring (or resubmitted after a restart, in the
    /// order it had been taken).
    pub(super) fn taken(&mut self, head: u16) {
        let h = usize::from(head);
        if h >= self.seq_of.len() {
            return; // Not a head of this ring: it is used at once when it finishes.
        }
        if let Some(earlier) = self.seq_of[h].take() {
            // Made available again while in flight: its earlier number is given up.
            let at = self.slot(earlier);
            self.parked[at] = Parked::Skip;
        }
        if self.outstanding() >= self.seq_of.len() {
            // More in flight than the ring holds: only a driver reusing heads gets here.
            // This head is not ordered; it is used when it finishes.
            return;
        }
        self.seq_of[h] = Some(self.next_taken);
        self.next_taken = self.next_taken.wrapping_add(1);
    }

    /// `head` finished with `len` bytes used. Returns it back if it can go on the used ring
    /// at once regardless of order (not a request this book numbered).
    pub(super) fn finished(&mut self, head: u16, len: u32) -> Option<(u16, u32)> {
        let Some(seq) = self
            .seq_of
            .get_mut(usize::from(head))
            .and_then(Option::take)
        else {
            return Some((head, len));
        };
        let at = self.slot(seq);
        self.parked[at] = Parked::Done(head, len);
        None
    }

    /// Move the finished requests that continue the used ring into `out`, oldest first.
    pub(super) fn ready(&mut self, out: &mut Vec<(u16, u32)>) {
        while self.next_used != self.next_taken {
            let at = self.slot(self.next_used);
            match std::mem::replace(&mut self.parked[at], Parked::Empty) {
                Parked::Empty => break,
                Parked::Done(head, len) => out.push((head, len)),
                Parked::Skip => {}
            }
            self.next_used = self.next_used.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn drain(o: &mut InOrder) -> Vec<u16> {
        let mut out = Vec::new();
        o.ready(&mut out);
        out.into_iter().map(|(h, _)| h).collect()
    }

    #[test]
    fn a_later_request_waits_for_an_earlier_one() {
        let mut o = InOrder::new(8);
        o.taken(5);
        o.taken(2);
        assert_eq!(o.finished(2, 1), None);
        assert!(drain(&mut o).is_empty(), "2 was used before 5");
        assert_eq!(o.finished(5, 1), None);
        assert_eq!(drain(&mut o), vec![5, 2]);
        assert_eq!(o.outstanding(), 0);
    }

    #[test]
    fn a_head_made_available_twice_does_not_stop_the_queue() {
        let mut o = InOrder::new(4);
        o.taken(1);
        o.taken(1);
        o.taken(3);
        assert_eq!(o.finished(1, 0), None);
        assert_eq!(o.finished(3, 0), None);
        assert_eq!(drain(&mut o), vec![1, 3]);
        // Its second completion is not ordered: used at once.
        assert_eq!(o.finished(1, 0), Some((1, 0)));
        assert_eq!(o.finished(9, 0), Some((9, 0)), "not a head of this ring");
        assert_eq!(o.outstanding(), 0);
    }

    /// The order book's own cost per request (`cargo test --release --lib
    /// order_book_cost -- --ignored --nocapture`; BENCHMARKS.md): depth 32, requests
    /// finishing in reverse order within each batch.
    #[test]
    #[ignore = "a measurement, run by hand"]
    fn order_book_cost() {
        let mut o = InOrder::new(256);
        let mut list = Vec::with_capacity(32);
        let rounds = 1_000_000u32;
        let start = std::time::Instant::now();
        for r in 0..rounds {
            let base = (r % 8) as u16 * 32;
            for h in base..base + 32 {
                o.taken(h);
            }
            for h in (base..base + 32).rev() {
                list.push((h, 512));
            }
            o.reorder(&mut list);
            assert_eq!(list.len(), 32);
            list.clear();
        }
        let per = start.elapsed().as_nanos() as f64 / (f64::from(rounds) * 32.0);
        println!("order book: {per:.1} ns per request");
    }

    /// A queue size that is not a power of two (packed rings allow them) across the
    /// numbers' wrap at 65536.
    #[test]
    fn order_holds_across_the_wrap_with_any_queue_size() {
        let mut o = InOrder::new(3);
        let mut out = Vec::new();
        for round in 0..70_000u32 {
            let heads = [0u16, 1, 2];
            for h in heads {
                o.taken(h);
            }
            let mut list: Vec<(u16, u32)> = heads.iter().rev().map(|&h| (h, round)).collect();
            o.reorder(&mut list);
            out.clear();
            out.extend(list.iter().map(|&(h, _)| h));
            assert_eq!(out, heads, "round {round}");
        }
    }

    proptest! {
        /// Whatever order requests finish in, the used ring gets them in the order they
        /// were taken, each once, across many wraps of the numbers.
        #[test]
        fn used_order_is_taken_order(
            rounds in proptest::collection::vec(
                (1usize..=16, proptest::collection::vec(any::<u32>(), 16)), 1..200),
        ) {
            const N: u16 = 16;
            let mut o = InOrder::new(N);
            let mut free: Vec<u16> = (0..N).collect();
            let mut in_flight: Vec<u16> = Vec::new();
            let (mut taken_order, mut used_order) = (Vec::new(), Vec::new());
            for (take, keys) in rounds {
                for _ in 0..take.min(free.len()) {
                    let h = free.remove(0);
                    o.taken(h);
                    in_flight.push(h);
                    taken_order.push(h);
                }
                // Finish about half of what is in flight, in a shuffled order.
                let mut order: Vec<(u32, u16)> =
                    in_flight.iter().enumerate().map(|(i, &h)| (keys[i % 16], h)).collect();
                order.sort();
                for (k, h) in order {
                    if k % 2 == 0 {
                        prop_assert_eq!(o.finished(h, u32::from(h)), None);
                        in_flight.retain(|&x| x != h);
                    }
                }
                for h in drain(&mut o) {
                    used_order.push(h);
                    free.push(h);
                }
            }
            for h in in_flight.clone() {
                prop_assert_eq!(o.finished(h, 0), None);
            }
            used_order.extend(drain(&mut o));
            prop_assert_eq!(used_order, taken_order);
            prop_assert_eq!(o.outstanding(), 0);
        }
    }
}
