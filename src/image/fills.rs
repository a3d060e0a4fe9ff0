//! The fill protocol, as the data plane sees it: a first write of fresh qcow2 clusters goes
//! through the engine whole (a fill) while its L2 entries are already visible, so a write
//! through the format waits for the fills in flight ([`Image::fence_fills`]) and an in-place
//! overwrite holds its range against them ([`Image::hold_overwrite`]). The waiter lends a
//! `progress` closure: the fill waited for is often its own, which ends only when it reaps.

use super::{FillGate, Image, Ticket, WriteTicket};

/// How long a wait for a fill sleeps before the waiter's own progress runs again: the fill
/// waited for is often the waiter's own (see [`Image::fence_fills`]).
const FILL_WAIT: std::time::Duration = std::time::Duration::from_micros(20);

impl Image {
    /// Before a write or zeroing through the format, which writes in place without ranges
    /// and may free clusters: keep new fills (first writes of fresh clusters through the
    /// engine) from starting, and wait for those in flight. `progress` runs between short
    /// waits: the fill may be the caller's own, which ends only when the caller reaps it.
    /// Drop the gate once the write through the format is done. None: this format has no
    /// fills.
    pub fn fence_fills(&self, mut progress: impl FnMut()) -> Option<FillGate> {
        let (_, d) = self.qcow2()?;
        let gate = d.q.raise_fill_gate();
        while !gate.wait_drained(std::time::Duration::ZERO) {
            progress();
            gate.wait_drained(FILL_WAIT);
        }
        Some(gate)
    }

    /// An in-place overwrite of [start, end) of the file (a planned write with
    /// [`super::EngineWrite::overwrite`]): while fills are in flight, their L2 entries are visible
    /// before their data lands, so the range is held against them, waiting for a fill of it
    /// to end (`progress` runs between short waits, as for [`Self::fence_fills`]). Hand the
    /// ticket to [`Self::end_write`] when the write completed. None: nothing to hold.
    pub fn hold_overwrite(
        &self,
        start: u64,
        end: u64,
        mut progress: impl FnMut(),
    ) -> Option<WriteTicket> {
        let (_, d) = self.qcow2()?;
        if !d.q.fills_in_flight() {
            return None;
        }
        loop {
            if let Some(k) = d.q.try_hold_overwrite(start, end) {
                return Some(WriteTicket(Ticket::Overwrite(k)));
            }
            progress();
            d.q.wait_fill_change(FILL_WAIT);
        }
    }
}
