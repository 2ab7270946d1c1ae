//! Seeded, counter-based random number streams.
//!
//! A draw is a pure op keyed by `(seed, offset)`: the value of element `i`
//! depends only on the seed and `offset + i`, never on the device, the
//! execution mode or the number of threads. The [`Rng`] only hands out
//! non-overlapping offsets, on the calling thread, in program order, so a
//! program draws the same numbers however it runs.

/// A random stream: a seed and the next unused counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    seed: u64,
    offset: u64,
}

impl Rng {
    /// A stream starting at counter 0 of `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng { seed, offset: 0 }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next unused counter.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Reserves the counters for a draw of `dims` and returns `(seed,
    /// offset)` for the op. Each element consumes at most one counter
    /// block, so advancing by the element count never overlaps draws.
    pub(crate) fn advance(&mut self, dims: &[usize]) -> (u64, u64) {
        let numel: u64 = dims
            .iter()
            .map(|&d| d as u64)
            .fold(1u64, |a, d| a.saturating_mul(d));
        let start = self.offset;
        // Offsets are carried as i64 attributes; wrap within that range.
        self.offset = start.saturating_add(numel.max(1)) & (i64::MAX as u64);
        (self.seed & (i64::MAX as u64), start)
    }
}
