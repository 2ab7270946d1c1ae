//! The buffer plan of an executable: how many blocks of each size a run can
//! have live at once, in whatever order the dataflow executor runs its
//! steps. A run draws its buffers from an [`Arena`] filled to this plan, so
//! after the first run no run allocates (see `Arena` for why the shared
//! pool alone cannot promise that).
//!
//! The plan is a liveness-based buffer assignment in the style of XLA's
//! dependency ordering: every value a kernel produces is assigned a buffer,
//! and two values may share one only when the graph itself orders their
//! lifetimes — every step that reads the first (and its producer) is an
//! ancestor of the step that produces the second. That holds in every run,
//! sequential or parallel, so at any moment the live values of a size are
//! at most the buffers assigned to that size. A chain of same-sized values
//! needs two buffers (each step reads one and writes the other); a graph
//! whose branches run side by side needs one per branch.
//!
//! A run in order leaves values smaller than [`SMALL_BLOCK`] out of its
//! plan: it takes and frees them on its one thread, in the same order
//! every run, so the thread's own cache of small blocks serves them
//! without a lock. Planning them cost more than it saved: a staged
//! `While` over a [1000]-element tensor spent a fifth of each iteration
//! entering its body's arena and taking and returning blocks under the
//! arena's lock. A parallel run plans them too: its steps free blocks on
//! whichever pool thread ran them, into that thread's cache, so without
//! the arena a run would allocate small blocks for several steps before
//! every thread's cache was full.
//!
//! [`Arena`]: stagecraft_tensor::Arena

use super::{Slot, Step, StepKind};
use smallvec::SmallVec;
use stagecraft_ops::ShapeKind;
use stagecraft_tensor::SMALL_BLOCK;

/// Graphs with more steps than this get no plan (their runs use the shared
/// pool): the ancestor sets cost steps² bits.
const MAX_PLANNED_STEPS: usize = 8192;

/// The planned blocks, as `(bytes, count)` pairs with distinct sizes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BufferPlan {
    /// Blocks per byte size.
    pub blocks: Vec<(usize, usize)>,
}

impl BufferPlan {
    /// Bytes of all planned blocks together.
    pub fn bytes(&self) -> usize {
        // Saturating: a plan may list sizes no system can allocate (those
        // runs fail with an error).
        self.blocks.iter().fold(0, |sum, (bytes, count)| {
            sum.saturating_add(bytes.saturating_mul(*count))
        })
    }

    /// Plans the buffers of `steps` (in topological order). `consumers`
    /// lists the steps reading each slot; `results` are the slots the run
    /// returns; `small` plans values under [`SMALL_BLOCK`] too (for runs
    /// that spread their steps over threads).
    pub(super) fn new(
        steps: &[Step],
        consumers: &[SmallVec<[u32; 2]>],
        results: &[Slot],
        small: bool,
    ) -> Self {
        if steps.len() > MAX_PLANNED_STEPS {
            return BufferPlan::default();
        }
        let words = steps.len().div_ceil(64);
        let mut producer: Vec<Option<u32>> = vec![None; consumers.len()];
        for (s, step) in steps.iter().enumerate() {
            for out in &step.outputs {
                producer[*out as usize] = Some(s as u32);
            }
        }
        // ancestors[s]: the steps `s` transitively waits for.
        let mut ancestors: Vec<Vec<u64>> = Vec::with_capacity(steps.len());
        for step in steps {
            let mut set = vec![0u64; words];
            for input in &step.inputs {
                if let Some(p) = producer[*input as usize] {
                    let p = p as usize;
                    set[p / 64] |= 1 << (p % 64);
                    for (word, theirs) in set.iter_mut().zip(&ancestors[p]) {
                        *word |= theirs;
                    }
                }
            }
            ancestors.push(set);
        }
        let is_result = |slot: Slot| results.contains(&slot);
        let precedes = |earlier: u32, step: usize| {
            let e = earlier as usize;
            ancestors[step][e / 64] & (1 << (e % 64)) != 0
        };
        // Per size: the last value assigned to each buffer so far.
        let mut buffers: Vec<(usize, Vec<Slot>)> = Vec::new();
        let mut result_blocks: Vec<(usize, usize)> = Vec::new();
        for (s, step) in steps.iter().enumerate() {
            let StepKind::Kernel { def, .. } = &step.kind else {
                continue;
            };
            if def.shape_kind != ShapeKind::Static {
                continue;
            }
            for (out, meta) in step.outputs.iter().zip(&step.metas) {
                let Ok(bytes) = meta.checked_size_in_bytes() else {
                    continue;
                };
                if bytes == 0 || (bytes < SMALL_BLOCK && !small) {
                    continue;
                }
                if is_result(*out) {
                    // A result leaves the run; the caller holds the last
                    // run's results while this run makes new ones.
                    add(&mut result_blocks, bytes, 2);
                    continue;
                }
                let index = match buffers.iter().position(|(b, _)| *b == bytes) {
                    Some(i) => i,
                    None => {
                        buffers.push((bytes, Vec::new()));
                        buffers.len() - 1
                    }
                };
                let free = buffers[index].1.iter().position(|&last| {
                    let done_with = |p: u32| precedes(p, s);
                    producer[last as usize].is_some_and(done_with)
                        && consumers[last as usize].iter().all(|&r| done_with(r))
                });
                match free {
                    Some(b) => buffers[index].1[b] = *out,
                    None => buffers[index].1.push(*out),
                }
            }
        }
        let mut blocks = result_blocks;
        for (bytes, lasts) in buffers {
            add(&mut blocks, bytes, lasts.len());
        }
        blocks.sort_unstable();
        BufferPlan { blocks }
    }
}

fn add(blocks: &mut Vec<(usize, usize)>, bytes: usize, count: usize) {
    match blocks.iter_mut().find(|(b, _)| *b == bytes) {
        Some((_, c)) => *c += count,
        None => blocks.push((bytes, count)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::executor::instantiate;
    use stagecraft_graph::{Function, Value};
    use stagecraft_ops::OpAttrs;
    use stagecraft_ops::MATMUL;
    use stagecraft_tensor::{DType, DenseHostTensor, HostTensor, Location, Shape, TensorMetadata};
    use std::sync::Arc;

    const N: usize = 64;
    const BYTES: usize = N * N * 4;

    fn square() -> TensorMetadata {
        TensorMetadata {
            dtype: DType::F32,
            shape: Shape::from(&[N, N][..]),
        }
    }

    fn matmul(f: &mut Function, a: Value, b: Value) -> Value {
        let at = Location::caller();
        Value::node(f.add_op(&MATMUL, &OpAttrs::new(), &[a, b], at).unwrap())
    }

    fn plan_of(f: Function) -> (BufferPlan, Arc<Function>) {
        let f = Arc::new(f);
        let exe = instantiate(f.clone(), Device::cpu()).unwrap();
        (exe.buffer_plan().clone(), f)
    }

    #[test]
    fn a_chain_needs_two_buffers_whatever_its_length() {
        let mut f = Function::new("chain", vec![square(), square()]);
        let (x, w) = (Value::Param(0), Value::Param(1));
        let mut t = matmul(&mut f, x, w);
        for _ in 0..6 {
            t = matmul(&mut f, t, w);
        }
        f.results = vec![t];
        let (plan, _) = plan_of(f);
        // Two that ping-pong, plus two for the result (this run's and the
        // last run's, which the caller may still hold).
        assert_eq!(plan.blocks, vec![(BYTES, 2 + 2)]);
        assert_eq!(plan.bytes(), 4 * BYTES);
    }

    #[test]
    fn branches_that_may_run_side_by_side_get_a_buffer_each() {
        let mut f = Function::new("branches", vec![square(); 5]);
        let x = Value::Param(0);
        let b: Vec<Value> = (1..5).map(|i| matmul(&mut f, x, Value::Param(i))).collect();
        // Any order may compute all four branches before combining them.
        let t1 = matmul(&mut f, b[0], b[1]);
        // b[0] is dead once t1 is done, and t2 waits for t1: t2 reuses it.
        let t2 = matmul(&mut f, t1, b[2]);
        let t3 = matmul(&mut f, t2, b[3]);
        f.results = vec![t3];
        let (plan, _) = plan_of(f);
        assert_eq!(plan.blocks, vec![(BYTES, 5 + 2)]);
    }

    #[test]
    fn plans_keep_sizes_apart_and_skip_small_and_empty_values() {
        let narrow = TensorMetadata {
            dtype: DType::F32,
            shape: Shape::from(&[N, 16][..]),
        };
        let small = TensorMetadata {
            dtype: DType::F32,
            shape: Shape::from(&[N, 1][..]),
        };
        let empty = TensorMetadata {
            dtype: DType::F32,
            shape: Shape::from(&[0, N][..]),
        };
        let mut f = Function::new("sizes", vec![square(), narrow, small, empty]);
        let strip = matmul(&mut f, Value::Param(0), Value::Param(1));
        let column = matmul(&mut f, Value::Param(0), Value::Param(2));
        let nothing = matmul(&mut f, Value::Param(3), Value::Param(0));
        let square_again = matmul(&mut f, Value::Param(0), Value::Param(0));
        f.results = vec![strip, column, nothing, square_again];
        let exe = instantiate(Arc::new(f), Device::cpu()).unwrap();
        let in_order = BufferPlan::new(&exe.steps, &exe.schedule.consumers, &exe.results, false);
        // In order, the [64, 1] column (256 bytes) is small: its block
        // comes from the thread's cache, not the plan.
        assert_eq!(in_order.blocks, vec![(N * 16 * 4, 2), (BYTES, 2)]);
        let parallel = BufferPlan::new(&exe.steps, &exe.schedule.consumers, &exe.results, true);
        assert_eq!(
            parallel.blocks,
            vec![(N * 4, 2), (N * 16 * 4, 2), (BYTES, 2)]
        );
    }

    #[test]
    fn runs_draw_from_an_arena_and_results_go_home_to_it() {
        let mut f = Function::new("chain", vec![square(), square()]);
        let (x, w) = (Value::Param(0), Value::Param(1));
        let t = matmul(&mut f, x, w);
        let t = matmul(&mut f, t, w);
        f.results = vec![matmul(&mut f, t, w)];
        let exe = instantiate(Arc::new(f), Device::cpu()).unwrap();
        // x = 2·I, w = I: every product is 2·I.
        let eye: Vec<f32> = (0..N * N)
            .map(|i| (i % (N + 1) == 0) as u8 as f32)
            .collect();
        let twice: Vec<f32> = eye.iter().map(|v| v * 2.0).collect();
        let arg =
            |v: &[f32]| HostTensor::Dense(DenseHostTensor::from_slice(v, &[N, N][..]).unwrap());
        let first = exe.run(vec![arg(&twice), arg(&eye)]).unwrap();
        let second = exe.run(vec![arg(&twice), arg(&eye)]).unwrap();
        for out in [&first[0], &second[0]] {
            assert_eq!(out.to_dense().unwrap().to_vec::<f32>().unwrap(), twice);
        }
        // Sequential runs share one arena, kept between runs.
        assert_eq!(exe.arenas.lock().unwrap().len(), 1);
        let arena = exe.arenas.lock().unwrap()[0].clone();
        assert_eq!(arena.planned_bytes(), exe.buffer_plan().bytes());
    }
}
