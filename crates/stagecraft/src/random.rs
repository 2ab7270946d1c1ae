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

    /// A new stream, independent of this one and of every other fork of
    /// it: layers that hold their own stream (dropout) take a fork of the
    /// model's, so one seed reproduces the whole model. Forking consumes
    /// one counter, so two forks of the same stream differ.
    pub fn fork(&mut self) -> Rng {
        let (seed, offset) = self.advance(&[]);
        // SplitMix64's finalizer: nearby (seed, offset) pairs give
        // unrelated seeds, so a fork's draws do not overlap its parent's.
        let mut z = seed ^ offset.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng::new(z ^ (z >> 31))
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
