//! The schedule of stagecraft's all-reduce over point-to-point messages:
//! a reduce-scatter by recursive halving, then an all-gather by recursive
//! doubling (Rabenseifner's algorithm); or, for small tensors, whose
//! rounds cost latency rather than bandwidth, half as many rounds that
//! each exchange every value (recursive doubling). Processes past the
//! largest power of two first fold their values into a partner, and get
//! the result from it last.
//!
//! Why not MPI's own all-reduce: stagecraft's collectives must not block
//! (a watchdog gives up on a hung one, and gradient buckets travel while
//! backward runs), and Open MPI's non-blocking all-reduce costs about
//! twice its blocking one on small tensors. This schedule, run on
//! non-blocking sends and receives, beat the blocking call at every size
//! from 4 KiB to 64 MiB on 2 processes over shared memory
//! (`experiments/allreduce-p2p`).
//!
//! Every process ends with the same bits. Split in halves, each element is
//! reduced by one process only, partials in the order of their ranks, and
//! then copied to the others. Whole, both partners of a round reduce the
//! same two partials in the same order (the lower-ranked side's first),
//! and by induction hold the same bits after every round.
//!
//! Without data, the same schedule is the check every collective runs:
//! its messages carry each process's fingerprint of the collective, and a
//! process that sees another fingerprint passes the news on, so after the
//! halving rounds every process knows whether the group agreed.

use stagecraft_cpu::isa::vectorized;
use stagecraft_ops::Reduction;
use std::ops::Range;

/// One step of one process's schedule. Ranges are element indices into
/// the tensor being reduced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// A process past the largest power of two hands all its values to
    /// `peer`.
    FoldOut { peer: usize },
    /// Takes the values of the folded process `peer` and reduces them into
    /// this process's own (own first: `peer` has the higher rank).
    FoldIn { peer: usize },
    /// Halving round `round`: sends the values in `give`, receives
    /// `peer`'s values in `keep` and reduces them into its own, its own
    /// first when `first`.
    Halve {
        peer: usize,
        round: usize,
        keep: Range<usize>,
        give: Range<usize>,
        first: bool,
    },
    /// Doubling round `round`: sends the reduced values in `mine` and
    /// receives those in `theirs` (no check travels with them: every
    /// process knows by now whether the group agreed).
    Double {
        peer: usize,
        round: usize,
        mine: Range<usize>,
        theirs: Range<usize>,
    },
    /// Hands the whole result to the folded process `peer`.
    UnfoldOut { peer: usize },
    /// Receives the whole result from `peer`.
    UnfoldIn { peer: usize },
}

impl Step {
    /// The step's place in the schedule, the same on both ends of each
    /// message: the message tag within one collective. Below 64 for any
    /// group MPI can hold (`rounds` ≤ 31).
    pub(super) fn tag(&self, rounds: usize) -> usize {
        match self {
            Step::FoldOut { .. } | Step::FoldIn { .. } => 0,
            Step::Halve { round, .. } => 1 + round,
            Step::Double { round, .. } => 1 + rounds + round,
            Step::UnfoldOut { .. } | Step::UnfoldIn { .. } => 1 + 2 * rounds,
        }
    }

    /// The process this step exchanges with.
    pub(super) fn peer(&self) -> usize {
        match *self {
            Step::FoldOut { peer }
            | Step::FoldIn { peer }
            | Step::Halve { peer, .. }
            | Step::Double { peer, .. }
            | Step::UnfoldOut { peer }
            | Step::UnfoldIn { peer } => peer,
        }
    }
}

/// How the halving rounds divide the values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Split {
    /// Each round keeps half of what the last one kept, and the doubling
    /// rounds gather the halves back: every value crosses each link about
    /// twice in all, whatever the group's size.
    Halves,
    /// Each round exchanges every value, and nothing is gathered: half
    /// the rounds, each moving the whole tensor.
    Whole,
}

/// The number of halving (and doubling) rounds of a group of `size`:
/// log2 of its largest power of two.
pub(super) fn rounds(size: usize) -> usize {
    if size == 0 {
        0
    } else {
        (usize::BITS - 1 - size.leading_zeros()) as usize
    }
}

/// `rank`'s steps in an all-reduce of `n` elements over `size` processes,
/// split as `split` says; without `gather`, the doubling rounds are left
/// out (a check carries no data to gather).
pub(super) fn schedule(
    rank: usize,
    size: usize,
    n: usize,
    split: Split,
    gather: bool,
) -> Vec<Step> {
    let rounds = rounds(size);
    let core = 1usize << rounds;
    if size <= 1 {
        return Vec::new();
    }
    if rank >= core {
        let peer = rank - core;
        return vec![Step::FoldOut { peer }, Step::UnfoldIn { peer }];
    }
    let folded = rank + core < size;
    let mut steps = Vec::with_capacity(2 * rounds + 2);
    if folded {
        steps.push(Step::FoldIn { peer: rank + core });
    }
    // Partners are far first: round k pairs ranks `core / 2^(k+1)` apart.
    let mut segment = 0..n;
    let mut halvings = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let distance = core >> (round + 1);
        let peer = rank ^ distance;
        let first = rank < peer;
        if split == Split::Whole {
            steps.push(Step::Halve {
                peer,
                round,
                keep: 0..n,
                give: 0..n,
                first,
            });
            continue;
        }
        let mid = segment.start + segment.len() / 2;
        let (low, high) = (segment.start..mid, mid..segment.end);
        let upper = rank & distance != 0;
        let (keep, give) = if upper {
            (high.clone(), low.clone())
        } else {
            (low.clone(), high.clone())
        };
        steps.push(Step::Halve {
            peer,
            round,
            keep: keep.clone(),
            give,
            first,
        });
        halvings.push((peer, low, high, upper));
        segment = keep;
    }
    if gather {
        for (round, (peer, low, high, upper)) in halvings.into_iter().rev().enumerate() {
            let (mine, theirs) = if upper { (high, low) } else { (low, high) };
            segment = mine.start.min(theirs.start)..mine.end.max(theirs.end);
            steps.push(Step::Double {
                peer,
                round,
                mine,
                theirs,
            });
        }
        debug_assert_eq!(segment, 0..n);
    }
    if folded {
        steps.push(Step::UnfoldOut { peer: rank + core });
    }
    steps
}

/// Element types the schedule reduces itself; others go to MPI's own
/// collective.
pub(super) trait Reducible: Copy {
    /// The sum (wrapping for integers, as MPI's).
    fn add(self, other: Self) -> Self;
    /// The larger; NaN if either is.
    fn larger(self, other: Self) -> Self;
    /// The smaller; NaN if either is.
    fn smaller(self, other: Self) -> Self;
}

macro_rules! float_reducible {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn larger(self, other: Self) -> Self {
                if self >= other || self.is_nan() { self } else { other }
            }
            fn smaller(self, other: Self) -> Self {
                if self <= other || self.is_nan() { self } else { other }
            }
        }
    )*};
}

macro_rules! int_reducible {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn larger(self, other: Self) -> Self {
                self.max(other)
            }
            fn smaller(self, other: Self) -> Self {
                self.min(other)
            }
        }
    )*};
}

float_reducible!(f32, f64);
int_reducible!(i32, i64);

/// `out[i] = first[i] ⊕ second[i]`; a mean is summed here and divided
/// once at the end. The loop runs at the kernels' instruction set
/// ([`vectorized`]): compiled for baseline SSE2, it took 127 ns of a 4 KiB
/// all-reduce's 1.8 µs.
pub(super) fn reduce<T: Reducible>(reduction: Reduction, first: &[T], second: &[T], out: &mut [T]) {
    #[inline(always)]
    fn each<T: Copy>(first: &[T], second: &[T], out: &mut [T], f: impl Fn(T, T) -> T) {
        for ((o, &a), &b) in out.iter_mut().zip(first).zip(second) {
            *o = f(a, b);
        }
    }
    vectorized(|| match reduction {
        Reduction::Sum | Reduction::Mean => each(first, second, out, T::add),
        Reduction::Max => each(first, second, out, T::larger),
        Reduction::Min => each(first, second, out, T::smaller),
    })
}

/// `acc[i] = acc[i] ⊕ other[i]` when `acc_first`, else `other[i] ⊕ acc[i]`
/// (at the kernels' instruction set, as [`reduce`]).
pub(super) fn reduce_in_place<T: Reducible>(
    reduction: Reduction,
    acc: &mut [T],
    other: &[T],
    acc_first: bool,
) {
    #[inline(always)]
    fn each<T: Copy>(acc: &mut [T], other: &[T], acc_first: bool, f: impl Fn(T, T) -> T) {
        if acc_first {
            acc.iter_mut().zip(other).for_each(|(a, &b)| *a = f(*a, b));
        } else {
            acc.iter_mut().zip(other).for_each(|(a, &b)| *a = f(b, *a));
        }
    }
    vectorized(|| match reduction {
        Reduction::Sum | Reduction::Mean => each(acc, other, acc_first, T::add),
        Reduction::Max => each(acc, other, acc_first, T::larger),
        Reduction::Min => each(acc, other, acc_first, T::smaller),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Runs every process's schedule against in-memory mailboxes and
    /// returns each process's result.
    fn simulate<T: Reducible + Default + std::fmt::Debug>(
        reduction: Reduction,
        split: Split,
        inputs: &[Vec<T>],
    ) -> Vec<Vec<T>> {
        let size = inputs.len();
        let n = inputs[0].len();
        let rounds = rounds(size);
        let schedules: Vec<Vec<Step>> = (0..size)
            .map(|r| schedule(r, size, n, split, true))
            .collect();
        // (from, to, tag) -> values
        let mut mail: HashMap<(usize, usize, usize), Vec<T>> = HashMap::new();
        let mut current: Vec<Vec<T>> = inputs.to_vec();
        let mut next = vec![0usize; size];
        let mut sent = vec![false; size];
        while (0..size).any(|r| next[r] < schedules[r].len()) {
            let mut moved = false;
            for rank in 0..size {
                let Some(step) = schedules[rank].get(next[rank]) else {
                    continue;
                };
                let key_out = (rank, step.peer(), step.tag(rounds));
                let key_in = (step.peer(), rank, step.tag(rounds));
                let outgoing: Option<Vec<T>> = match step {
                    Step::FoldOut { .. } | Step::UnfoldOut { .. } => Some(current[rank].clone()),
                    Step::Halve { give, .. } => Some(current[rank][give.clone()].to_vec()),
                    Step::Double { mine, .. } => Some(current[rank][mine.clone()].to_vec()),
                    Step::FoldIn { .. } | Step::UnfoldIn { .. } => None,
                };
                if !sent[rank] {
                    if let Some(values) = outgoing {
                        assert!(
                            mail.insert(key_out, values).is_none(),
                            "a message sent twice"
                        );
                    }
                    sent[rank] = true;
                }
                let receives = !matches!(step, Step::FoldOut { .. } | Step::UnfoldOut { .. });
                if receives {
                    let Some(theirs) = mail.remove(&key_in) else {
                        continue;
                    };
                    let mine = &mut current[rank];
                    match step {
                        Step::FoldIn { .. } => {
                            assert_eq!(theirs.len(), n);
                            reduce_in_place(reduction, mine, &theirs, true);
                        }
                        Step::Halve { keep, first, .. } => {
                            assert_eq!(theirs.len(), keep.len());
                            reduce_in_place(reduction, &mut mine[keep.clone()], &theirs, *first);
                        }
                        Step::Double { theirs: range, .. } => {
                            assert_eq!(theirs.len(), range.len());
                            mine[range.clone()].copy_from_slice(&theirs);
                        }
                        Step::UnfoldIn { .. } => mine.copy_from_slice(&theirs),
                        _ => unreachable!(),
                    }
                }
                next[rank] += 1;
                sent[rank] = false;
                moved = true;
            }
            assert!(moved, "the schedules deadlock at {next:?}");
        }
        assert!(mail.is_empty(), "messages nobody took: {:?}", mail.keys());
        current
    }

    #[test]
    fn every_process_gets_the_reduction() {
        for size in 1..=9 {
            for n in [0, 1, 2, 3, 5, 8, 13] {
                let inputs: Vec<Vec<i64>> = (0..size)
                    .map(|r| (0..n).map(|i| (r * 100 + i) as i64 - 7).collect())
                    .collect();
                let reduce_all = |f: fn(i64, i64) -> i64| -> Vec<i64> {
                    (0..n)
                        .map(|i| inputs.iter().map(|v| v[i]).reduce(f).unwrap())
                        .collect()
                };
                for (reduction, want) in [
                    (Reduction::Sum, reduce_all(|a, b| a + b)),
                    (Reduction::Max, reduce_all(i64::max)),
                    (Reduction::Min, reduce_all(i64::min)),
                ] {
                    for split in [Split::Halves, Split::Whole] {
                        let results = simulate(reduction, split, &inputs);
                        for (rank, got) in results.into_iter().enumerate() {
                            assert_eq!(
                                got, want,
                                "{reduction:?} of {n} split in {split:?} on rank {rank} of {size}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tags_stay_below_64_and_pair_up() {
        for split in [Split::Halves, Split::Whole] {
            for size in [2usize, 3, 6, 64, 100, 1 << 20] {
                let r = rounds(size);
                for rank in [0, 1, size / 2, size - 1] {
                    for step in schedule(rank, size, 10, split, true) {
                        assert!(step.tag(r) < 64);
                        let peer_steps = schedule(step.peer(), size, 10, split, true);
                        assert!(
                            peer_steps
                                .iter()
                                .any(|s| s.tag(r) == step.tag(r) && s.peer() == rank),
                            "{step:?} of rank {rank} has no partner step"
                        );
                    }
                }
            }
        }
        // A whole split has no doubling rounds.
        assert_eq!(
            schedule(1, 6, 10, Split::Whole, true)
                .iter()
                .map(|s| s.tag(2))
                .collect::<Vec<_>>(),
            vec![0, 1, 2, 5]
        );
        // Without data, only the checks' steps remain, with the same tags.
        let checks = schedule(0, 6, 0, Split::Halves, false);
        assert_eq!(
            checks.iter().map(|s| s.tag(2)).collect::<Vec<_>>(),
            vec![0, 1, 2, 5]
        );
    }

    #[test]
    fn nan_wins_in_either_order() {
        for (a, b) in [(f32::NAN, 1.0), (1.0, f32::NAN)] {
            assert!(a.larger(b).is_nan() && a.smaller(b).is_nan());
        }
        assert_eq!(2.0f64.larger(-3.0), 2.0);
        assert_eq!(2.0f64.smaller(-3.0), -3.0);
        assert_eq!(i32::MAX.add(1), i32::MIN);
    }

    #[test]
    fn reducing_into_a_third_slice_keeps_the_operand_order_of_reducing_in_place() {
        let first = [1.0f32, f32::NAN, -0.0, 3.5, 1e30];
        let second = [2.0f32, 4.0, 0.0, f32::NAN, 1e30];
        for r in [
            Reduction::Sum,
            Reduction::Mean,
            Reduction::Max,
            Reduction::Min,
        ] {
            let mut out = [0.0f32; 5];
            reduce(r, &first, &second, &mut out);
            let mut acc = first;
            reduce_in_place(r, &mut acc, &second, true);
            let mut flipped = second;
            reduce_in_place(r, &mut flipped, &first, false);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&acc), "{r:?}");
            assert_eq!(bits(&out), bits(&flipped), "{r:?}");
        }
    }

    proptest! {
        /// Float sums depend on the order of their terms; every process
        /// must still end with the same bits.
        #[test]
        fn every_process_ends_with_the_same_bits(
            size in 1usize..8,
            values in prop::collection::vec(-1e6f32..1e6, 0..40),
            whole in any::<bool>(),
        ) {
            let split = if whole { Split::Whole } else { Split::Halves };
            let n = values.len();
            let inputs: Vec<Vec<f32>> = (0..size)
                .map(|r| values.iter().map(|v| v * (r as f32 + 0.37)).collect())
                .collect();
            let results = simulate(Reduction::Sum, split, &inputs);
            for got in &results[1..] {
                let same = got.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits());
                prop_assert!(same, "{got:?} against {:?}", results[0]);
            }
            for (i, &s) in results[0].iter().enumerate() {
                let want: f64 = inputs.iter().map(|v| v[i] as f64).sum();
                prop_assert!((s as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{i}: {s} vs {want}");
            }
            prop_assert_eq!(results[0].len(), n);
        }
    }
}
