//! Collecting a trace: the pending ops that some requested outputs depend
//! on, in a deterministic DFS post-order, with their leaves (concrete
//! values and outputs of traces that ran) and the outputs the trace must
//! return. Collecting only reads op states; the ops are claimed afterwards
//! (`materialize::claim`), which also catches any op another trace ran or
//! claimed meanwhile.

use super::op::{ClaimOutcome, Input, LazyOp, TraceId};
use crate::device::Device;
use smallvec::SmallVec;
use stagecraft_graph::Value;
use stagecraft_ops::{FrozenOpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::FxBuild;
use stagecraft_tensor::{Error, Location, Result, TensorMetadata, TensorValue};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Constants with at most this many elements are baked into traces (until
/// widening promotes them); larger ones are always arguments: comparing
/// their values on every lookup would cost more than baking gains.
const BAKE_LIMIT: usize = 16;

/// A trace argument before the cache decides whether it is baked.
pub(super) struct Leaf {
    pub(super) value: TensorValue,
    /// False for values a trace computed (always arguments) and for large
    /// values.
    pub(super) bakeable: bool,
}

/// The structure of a trace as it is compiled: ops, attributes, wiring,
/// argument metadata and results. Built only when a trace is compiled,
/// printed or explained; lookups use [`Structure`]. Every leaf is a
/// parameter here, whatever it will become.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct Skeleton {
    pub(super) params: Vec<TensorMetadata>,
    pub(super) nodes: Vec<SkeletonNode>,
    pub(super) results: Vec<Value>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct SkeletonNode {
    pub(super) op: usize,
    pub(super) attrs: FrozenOpAttrs,
    pub(super) inputs: SmallVec<[Value; 4]>,
    pub(super) outputs: OutputMetas,
}

/// A trace's structure as a flat list of words: the trace cache's key.
/// It determines the [`Skeleton`] exactly (equal words, equal skeletons),
/// since each op is its signature number (op, attributes and output
/// metadata, numbered when recorded), so a step writes, hashes and
/// compares it without touching an attribute map or a shape of its ops.
///
/// Layout: per op its signature, input count and inputs (written as the
/// walk goes); per parameter its dtype, rank and dims; the result count
/// and the results; last the op and parameter counts, which say where
/// each part ends. A value is `PARAM | leaf` or `node << 32 | output`.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub(super) struct Structure(Vec<u64>);

/// Marks a parameter among [`Structure`]'s values.
const PARAM: u64 = 1 << 63;

impl Structure {
    /// The words, for hashing.
    pub(super) fn words(&self) -> &[u64] {
        &self.0
    }
}

fn word(value: Value) -> u64 {
    match value {
        Value::Param(leaf) => PARAM | u64::from(leaf),
        Value::Output { node, output } => (u64::from(node) << 32) | u64::from(output),
    }
}

fn value(word: u64) -> Value {
    if word & PARAM != 0 {
        Value::Param((word & !PARAM) as u32)
    } else {
        Value::Output {
            node: (word >> 32) as u32,
            output: word as u32,
        }
    }
}

pub(super) struct Collected {
    pub(super) structure: Structure,
    /// The leaves' metadata, in leaf order.
    pub(super) params: Vec<TensorMetadata>,
    pub(super) ops: Vec<Arc<LazyOp>>,
    pub(super) locations: Vec<Location>,
    pub(super) leaves: Vec<Leaf>,
    /// (op position, output index) of each result.
    pub(super) outputs: Vec<(usize, u32)>,
    /// Positions in `outputs` of the requested roots.
    pub(super) requested: Vec<usize>,
    pub(super) target: Device,
    /// Whether [`collect_claiming`] claimed every op.
    pub(super) claimed_all: bool,
}

impl Collected {
    /// The trace's skeleton, read back from its structure and its ops.
    pub(super) fn skeleton(&self) -> Skeleton {
        let words = &self.structure.0;
        let mut at = 0;
        let nodes = self
            .ops
            .iter()
            .map(|op| {
                let count = words[at + 1] as usize;
                let inputs = words[at + 2..at + 2 + count]
                    .iter()
                    .map(|w| value(*w))
                    .collect();
                at += 2 + count;
                SkeletonNode {
                    op: op.def as *const OpDef as usize,
                    attrs: op.attrs.clone(),
                    inputs,
                    outputs: op.outputs.clone(),
                }
            })
            .collect();
        // Skip the parameters: `params` has them.
        for _ in 0..self.params.len() {
            at += 2 + words[at + 1] as usize;
        }
        let count = words[at] as usize;
        let results = words[at + 1..at + 1 + count]
            .iter()
            .map(|w| value(*w))
            .collect();
        Skeleton {
            params: self.params.clone(),
            nodes,
            results,
        }
    }
}

fn key_of(p: &Arc<LazyOp>) -> usize {
    Arc::as_ptr(p) as usize
}

thread_local! {
    /// Ops, leaves and structure words of the last trace this thread
    /// collected (capacity hints; per thread, as each thread repeats its
    /// own step).
    static LAST_TRACE_SIZE: Cell<(usize, usize, usize)> = const { Cell::new((0, 0, 0)) };
}

/// Collects the ops that `roots` depend on and that have not run, in DFS
/// post-order.
pub(super) fn collect(roots: &[(Arc<LazyOp>, u32)]) -> Result<Collected> {
    collect_with(roots, None)
}

/// [`collect`], claiming each op for `trace` under the lock the walk takes
/// anyway. It never waits: if another trace holds an op, the ops this
/// walk claimed are given back and `claimed_all` is false, so the caller
/// claims in its deadlock-free order instead (`materialize::claim`). A
/// failed collection gives its claims back too.
pub(super) fn collect_claiming(roots: &[(Arc<LazyOp>, u32)], trace: TraceId) -> Result<Collected> {
    collect_with(roots, Some(trace))
}

fn collect_with(roots: &[(Arc<LazyOp>, u32)], claim_for: Option<TraceId>) -> Result<Collected> {
    let target = roots
        .first()
        .map(|(op, _)| op.target)
        .ok_or_else(|| Error::internal("an empty trace"))?;
    // A training loop records the same trace every step: sizing for the
    // last one spares the growth of every vector and map (4–5 µs of the
    // MLP step's 47-op trace).
    let (size, leaf_count, word_count) = LAST_TRACE_SIZE.get();
    let (size, leaf_count) = (size.min(1 << 16), leaf_count.min(1 << 16));
    let mut position: HashMap<usize, u32, FxBuild> =
        HashMap::with_capacity_and_hasher(size, FxBuild::default());
    let mut ops: Vec<Arc<LazyOp>> = Vec::with_capacity(size);
    let mut locations = Vec::with_capacity(size);
    // Per op, where its outputs start in `inside_uses`.
    let mut first_output: Vec<u32> = Vec::with_capacity(size);
    // Per op output, how many ops of this trace read it.
    let mut inside_uses: Vec<u32> = Vec::with_capacity(size);
    let mut words: Vec<u64> = Vec::with_capacity(word_count.min(1 << 20));
    let mut leaves: Vec<Leaf> = Vec::with_capacity(leaf_count);
    let mut params: Vec<TensorMetadata> = Vec::with_capacity(leaf_count);
    let mut leaf_ids: HashMap<(usize, u32), u32, FxBuild> =
        HashMap::with_capacity_and_hasher(leaf_count, FxBuild::default());

    // Iterative DFS: (op, visited-children?).
    let mut claimed_all = claim_for.is_some();
    let walked: Result<()> = 'walk: {
        let mut stack: Vec<(Arc<LazyOp>, bool)> = roots
            .iter()
            .rev()
            .map(|(op, _)| (op.clone(), false))
            .collect();
        while let Some((op, expanded)) = stack.pop() {
            let key = key_of(&op);
            // An op can be on the stack unexpanded twice (two readers pushed
            // it before either was taken), and the second is skipped here.
            // Its expanded entry is pushed once and taken before anything
            // could emit the op (that would need a path from its inputs back
            // to it), so it needs no lookup.
            if !expanded && position.contains_key(&key) {
                continue;
            }
            let mut slot = op.lock();
            // Pending or claimed (by this trace from an earlier attempt, or by
            // another, which the claim step will wait for); done ops are
            // leaves.
            let Some(inputs) = slot.state.inputs() else {
                continue;
            };
            if !expanded {
                // The children still to visit go straight onto the stack,
                // last first so that the first is on top; the op goes
                // under them, to be taken again once they are in.
                let mark = stack.len();
                for input in inputs.iter().rev() {
                    if let Input::Op(child, _) = input {
                        if !child.is_done() && !position.contains_key(&key_of(child)) {
                            stack.push((child.clone(), false));
                        }
                    }
                }
                if stack.len() > mark {
                    drop(slot);
                    stack.insert(mark, (op, true));
                    continue;
                }
                // Every input is a leaf or already in the trace: the op goes
                // in now, without a second visit.
            }
            let pos = ops.len() as u32;
            words.push(u64::from(op.signature));
            words.push(inputs.len() as u64);
            for input in inputs.iter() {
                let value = match input {
                    Input::Op(child, index) => {
                        if let Some(&at) = position.get(&key_of(child)) {
                            inside_uses[(first_output[at as usize] + index) as usize] += 1;
                            Value::Output {
                                node: at,
                                output: *index,
                            }
                        } else {
                            // A materialized output: an argument.
                            let leaf_key = (key_of(child), *index);
                            let id = match leaf_ids.get(&leaf_key) {
                                Some(id) => *id,
                                None => {
                                    // A child not in the trace was done when
                                    // it was visited, and stays done.
                                    let value = child.output(*index).unwrap_or_else(|| {
                                        Err(Error::internal("a pending input escaped the trace"))
                                    });
                                    // The producing trace failed: this one fails the same way.
                                    let value = match value {
                                        Ok(v) => v,
                                        Err(e) => break 'walk Err(e),
                                    };
                                    params.push(child.outputs[*index as usize].clone());
                                    leaves.push(Leaf {
                                        value,
                                        bakeable: false,
                                    });
                                    let id = (leaves.len() - 1) as u32;
                                    leaf_ids.insert(leaf_key, id);
                                    id
                                }
                            };
                            Value::Param(id)
                        }
                    }
                    Input::Concrete { handle } => {
                        let leaf_key = (handle.addr(), u32::MAX);
                        let id = match leaf_ids.get(&leaf_key) {
                            Some(id) => *id,
                            None => {
                                let value = match handle.wait_value() {
                                    Ok(v) => v.clone(),
                                    Err(e) => break 'walk Err(e),
                                };
                                // A value in device memory stays there: an
                                // argument, never read back to be baked.
                                let bakeable = matches!(value, TensorValue::Host(_))
                                    && value.metadata().shape.numel() <= BAKE_LIMIT;
                                params.push(handle.metadata().clone());
                                leaves.push(Leaf { value, bakeable });
                                let id = (leaves.len() - 1) as u32;
                                leaf_ids.insert(leaf_key, id);
                                id
                            }
                        };
                        Value::Param(id)
                    }
                };
                words.push(word(value));
            }
            if let Some(trace) = claim_for {
                match slot.claim(trace) {
                    ClaimOutcome::Taken | ClaimOutcome::AlreadyHeld => {}
                    ClaimOutcome::Busy | ClaimOutcome::Done => claimed_all = false,
                }
            }
            drop(slot);
            position.insert(key, pos);
            first_output.push(inside_uses.len() as u32);
            inside_uses.extend(std::iter::repeat_n(0, op.outputs.len()));
            locations.push(op.location);
            ops.push(op);
        }
        Ok(())
    };
    if let Some(trace) = claim_for {
        if !claimed_all || walked.is_err() {
            for op in &ops {
                op.unclaim(trace);
            }
            claimed_all = false;
        }
    }
    walked?;
    // Outputs: requested roots, then every op output still referenced from
    // outside the trace (live user tensors or pending ops not in it).
    let mut outputs: Vec<(usize, u32)> = Vec::new();
    let mut requested = Vec::new();
    // Per op output, its place in `outputs`, if it has one.
    let mut output_at: Vec<u32> = vec![u32::MAX; inside_uses.len()];
    for (op, index) in roots {
        if let Some(&pos) = position.get(&key_of(op)) {
            let slot = (first_output[pos as usize] + index) as usize;
            if output_at[slot] == u32::MAX {
                output_at[slot] = outputs.len() as u32;
                outputs.push((pos as usize, *index));
            }
            requested.push(output_at[slot] as usize);
        }
    }
    for (pos, op) in ops.iter().enumerate() {
        for index in 0..op.outputs.len() as u32 {
            let slot = (first_output[pos] + index) as usize;
            let live = op.is_live(index);
            let uses = op.uses[index as usize].load(Ordering::Relaxed);
            if (live || uses > inside_uses[slot]) && output_at[slot] == u32::MAX {
                output_at[slot] = outputs.len() as u32;
                outputs.push((pos, index));
            }
        }
    }
    for p in &params {
        let dims = p.shape.dims();
        words.push(p.dtype as u64);
        words.push(dims.len() as u64);
        words.extend(dims.iter().map(|&d| d as u64));
    }
    words.push(outputs.len() as u64);
    words.extend(outputs.iter().map(|&(node, output)| {
        word(Value::Output {
            node: node as u32,
            output,
        })
    }));
    words.push(ops.len() as u64);
    words.push(params.len() as u64);
    LAST_TRACE_SIZE.set((ops.len(), leaves.len(), words.len()));
    Ok(Collected {
        structure: Structure(words),
        params,
        ops,
        locations,
        leaves,
        outputs,
        requested,
        target,
        claimed_all,
    })
}

#[cfg(test)]
mod tests {
    use super::super::op::State;
    use super::super::tests::{binary, lazy_device, scalar, unary};
    use super::*;
    use crate::handle::TensorHandle;

    fn root(h: &TensorHandle) -> (Arc<LazyOp>, u32) {
        let r = h.lazy_ref().expect("a lazy tensor");
        (r.op.clone(), r.index)
    }

    /// `w = a + b; x = w - a; y = x * w`: post-order, `a` one leaf though
    /// read twice, and `w` and `x` outputs only while a handle holds them.
    #[test]
    fn collects_in_post_order_with_shared_leaves_and_live_outputs() {
        let d = lazy_device();
        let (a, b) = (scalar(1.0, d), scalar(2.0, d));
        let w = binary(&stagecraft_ops::ADD, &a, &b);
        let x = binary(&stagecraft_ops::SUB, &w, &a);
        let y = binary(&stagecraft_ops::MUL, &x, &w);
        let c = collect(&[root(&y)]).unwrap();
        let names: Vec<&str> = c.ops.iter().map(|op| op.def.name).collect();
        assert_eq!(names, ["Add", "Sub", "Mul"]);
        assert_eq!(c.leaves.len(), 2, "a and b");
        assert!(c.leaves.iter().all(|l| l.bakeable), "scalars are bakeable");
        // y requested first, then the live w and x.
        assert_eq!(c.outputs, [(2, 0), (0, 0), (1, 0)]);
        assert_eq!(c.requested, [0]);
        drop((w, x));
        let c = collect(&[root(&y)]).unwrap();
        assert_eq!(c.outputs, [(2, 0)], "intermediates stay inside");
    }

    /// The structure is the cache key: the same recording twice gives the
    /// same words, a different wiring of equal ops different ones, and
    /// the skeleton read back from the words has the recorded wiring.
    #[test]
    fn the_structure_tells_wirings_apart_and_reads_back_as_the_skeleton() {
        let d = lazy_device();
        let (a, b) = (scalar(1.0, d), scalar(2.0, d));
        let twice = binary(&stagecraft_ops::ADD, &a, &a);
        let pair = binary(&stagecraft_ops::ADD, &a, &b);
        let again = binary(&stagecraft_ops::ADD, &scalar(3.0, d), &scalar(4.0, d));
        let (twice, pair, again) = (
            collect(&[root(&twice)]).unwrap(),
            collect(&[root(&pair)]).unwrap(),
            collect(&[root(&again)]).unwrap(),
        );
        assert_ne!(twice.structure, pair.structure);
        assert_eq!(pair.structure, again.structure, "values are not structure");
        let skeleton = twice.skeleton();
        assert_eq!(skeleton.params.len(), 1);
        assert_eq!(skeleton.nodes[0].inputs.as_slice(), [Value::Param(0); 2]);
        assert_eq!(skeleton.results, [Value::Output { node: 0, output: 0 }]);
        let skeleton = pair.skeleton();
        assert_eq!(skeleton.params.len(), 2);
        assert_eq!(
            skeleton.nodes[0].inputs.as_slice(),
            [Value::Param(0), Value::Param(1)]
        );
        assert_eq!(
            skeleton.nodes[0].op,
            &stagecraft_ops::ADD as *const OpDef as usize
        );
    }

    /// An output that a pending op outside the trace reads is returned even
    /// when no handle holds it, so that op can read it later.
    #[test]
    fn outputs_read_by_pending_ops_outside_the_trace_are_kept() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let inside = unary(&stagecraft_ops::EXP, &w);
        let _outside = unary(&stagecraft_ops::LOG, &w);
        let w_op = root(&w);
        drop(w);
        let c = collect(&[root(&inside)]).unwrap();
        assert_eq!(c.ops.len(), 2);
        assert!(Arc::ptr_eq(&c.ops[0], &w_op.0));
        assert_eq!(c.outputs, [(1, 0), (0, 0)]);
    }

    /// An op that already ran is a leaf (an argument, never baked); its
    /// own inputs are not visited.
    #[test]
    fn done_ops_are_leaves() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        w.wait().unwrap();
        let y = unary(&stagecraft_ops::EXP, &w);
        let c = collect(&[root(&y)]).unwrap();
        assert_eq!(c.ops.len(), 1);
        assert_eq!(c.leaves.len(), 1);
        assert!(!c.leaves[0].bakeable);
        assert_eq!(c.skeleton().nodes[0].inputs.as_slice(), [Value::Param(0)]);
    }

    /// A leaf whose trace failed fails the collection with its error.
    #[test]
    fn a_failed_leaf_fails_the_collection() {
        let d = lazy_device();
        let zero = integer_division_by_zero(d);
        // Recorded before the division runs (after, it would be an error
        // handle at once).
        let y = unary(&stagecraft_ops::NEG, &zero);
        assert!(zero.wait().is_err());
        let err = collect(&[root(&y)]).err().expect("an error");
        assert_eq!(err.op(), Some("Div"));
    }

    fn claimed_by(op: &Arc<LazyOp>, trace: TraceId) -> bool {
        matches!(op.lock().state, State::Claimed(_, t) if t == trace)
    }

    /// Uncontended, the walk claims every op it collects.
    #[test]
    fn collecting_claims_every_op_when_no_other_trace_holds_one() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let y = binary(&stagecraft_ops::ADD, &w, &scalar(2.0, d));
        let trace = TraceId::next();
        let c = collect_claiming(&[root(&y)], trace).unwrap();
        assert!(c.claimed_all);
        assert_eq!(c.ops.len(), 2);
        assert!(c.ops.iter().all(|op| claimed_by(op, trace)));
    }

    /// If another trace holds an op, the walk gives back what it claimed
    /// (the caller then claims in address order, which may wait) and
    /// leaves the other trace's claim alone.
    #[test]
    fn collecting_gives_its_claims_back_when_another_trace_holds_an_op() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let x = unary(&stagecraft_ops::EXP, &w);
        let y = unary(&stagecraft_ops::LOG, &x);
        let (mine, other) = (TraceId::next(), TraceId::next());
        let held = root(&x).0;
        assert_eq!(held.try_claim(other), ClaimOutcome::Taken);
        let c = collect_claiming(&[root(&y)], mine).unwrap();
        assert!(!c.claimed_all);
        assert_eq!(c.ops.len(), 3, "the held op is still part of the trace");
        assert!(c.ops.iter().all(|op| !claimed_by(op, mine)));
        assert!(claimed_by(&held, other));
        held.unclaim(other);
    }

    /// A collection that fails on a leaf keeps no claim.
    #[test]
    fn a_failed_claiming_collection_keeps_no_claim() {
        let d = lazy_device();
        let zero = integer_division_by_zero(d);
        // `first` is collected (and claimed) before the walk meets the
        // failed leaf in `second`'s inputs.
        let first = unary(&stagecraft_ops::NEG, &scalar_i32(3, d));
        let second = binary(&stagecraft_ops::ADD, &first, &zero);
        assert!(zero.wait().is_err());
        let trace = TraceId::next();
        let err = collect_claiming(&[root(&second)], trace)
            .err()
            .expect("an error");
        assert_eq!(err.op(), Some("Div"));
        assert!(matches!(root(&first).0.lock().state, State::Pending(_)));
        assert!(matches!(root(&second).0.lock().state, State::Pending(_)));
    }

    /// `1 / 0` in i32, recorded on `d`: its trace fails when it runs.
    fn integer_division_by_zero(d: Device) -> TensorHandle {
        crate::runtime::execute(
            &stagecraft_ops::DIV,
            d,
            Location::caller(),
            smallvec::smallvec![scalar_i32(1, d), scalar_i32(0, d)],
            (&stagecraft_ops::OpAttrs::new()).into(),
        )
        .remove(0)
    }

    fn scalar_i32(v: i32, d: Device) -> TensorHandle {
        let value = stagecraft_tensor::DenseHostTensor::from_slice(&[v], [0usize; 0]).unwrap();
        TensorHandle::available(d, value.into())
    }
}
