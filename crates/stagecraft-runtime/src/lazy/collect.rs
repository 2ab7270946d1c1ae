//! Collecting a trace: the pending ops that some requested outputs depend
//! on, in a deterministic DFS post-order, with their leaves (concrete
//! values and outputs of traces that ran) and the outputs the trace must
//! return. Collecting only reads op states; the ops are claimed afterwards
//! (`materialize::claim`), which also catches any op another trace ran or
//! claimed meanwhile.

use super::op::{Input, LazyOp};
use crate::device::Device;
use crate::fxhash::FxBuild;
use smallvec::SmallVec;
use stagecraft_graph::Value;
use stagecraft_ops::{FrozenOpAttrs, OpDef, OutputMetas};
use stagecraft_tensor::{Error, HostTensor, Location, Result, TensorMetadata};
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
    pub(super) value: HostTensor,
    /// False for values a trace computed (always arguments) and for large
    /// values.
    pub(super) bakeable: bool,
}

/// The structure of a trace: what the cache key hashes. Every leaf is a
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

pub(super) struct Collected {
    pub(super) skeleton: Skeleton,
    pub(super) ops: Vec<Arc<LazyOp>>,
    pub(super) locations: Vec<Location>,
    pub(super) leaves: Vec<Leaf>,
    /// (op position, output index) of each result.
    pub(super) outputs: Vec<(usize, u32)>,
    /// Positions in `outputs` of the requested roots.
    pub(super) requested: Vec<usize>,
    pub(super) target: Device,
}

fn key_of(p: &Arc<LazyOp>) -> usize {
    Arc::as_ptr(p) as usize
}

thread_local! {
    /// Ops and leaves of the last trace this thread collected (capacity
    /// hints; per thread, as each thread repeats its own step).
    static LAST_TRACE_SIZE: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
}

/// Collects the ops that `roots` depend on and that have not run, in DFS
/// post-order.
pub(super) fn collect(roots: &[(Arc<LazyOp>, u32)]) -> Result<Collected> {
    let target = roots
        .first()
        .map(|(op, _)| op.target)
        .ok_or_else(|| Error::internal("an empty trace"))?;
    // A training loop records the same trace every step: sizing for the
    // last one spares the growth of every vector and map (4–5 µs of the
    // MLP step's 47-op trace).
    let (size, leaf_count) = LAST_TRACE_SIZE.get();
    let (size, leaf_count) = (size.min(1 << 16), leaf_count.min(1 << 16));
    let mut position: HashMap<usize, usize, FxBuild> =
        HashMap::with_capacity_and_hasher(size, FxBuild::default());
    let mut ops: Vec<Arc<LazyOp>> = Vec::with_capacity(size);
    let mut nodes: Vec<SkeletonNode> = Vec::with_capacity(size);
    let mut locations = Vec::with_capacity(size);
    let mut leaves: Vec<Leaf> = Vec::with_capacity(leaf_count);
    let mut params: Vec<TensorMetadata> = Vec::with_capacity(leaf_count);
    let mut leaf_ids: HashMap<(usize, u32), u32, FxBuild> =
        HashMap::with_capacity_and_hasher(leaf_count, FxBuild::default());
    let mut inside_uses: HashMap<(usize, u32), u32, FxBuild> =
        HashMap::with_capacity_and_hasher(size * 2, FxBuild::default());

    // Iterative DFS: (op, visited-children?).
    let mut stack: Vec<(Arc<LazyOp>, bool)> = roots
        .iter()
        .rev()
        .map(|(op, _)| (op.clone(), false))
        .collect();
    while let Some((op, expanded)) = stack.pop() {
        let key = key_of(&op);
        if position.contains_key(&key) {
            continue;
        }
        let slot = op.lock();
        // Pending or claimed (by this trace from an earlier attempt, or by
        // another, which the claim step will wait for); done ops are
        // leaves.
        let Some(inputs) = slot.state.inputs() else {
            continue;
        };
        if !expanded {
            let children: Vec<Arc<LazyOp>> = inputs
                .iter()
                .filter_map(|i| match i {
                    Input::Op(child, _)
                        if !child.is_done() && !position.contains_key(&key_of(child)) =>
                    {
                        Some(child.clone())
                    }
                    _ => None,
                })
                .collect();
            drop(slot);
            stack.push((op.clone(), true));
            for child in children.into_iter().rev() {
                stack.push((child, false));
            }
            continue;
        }
        let mut values: SmallVec<[Value; 4]> = SmallVec::new();
        for input in inputs.iter() {
            let value = match input {
                Input::Op(child, index) => {
                    if let Some(&pos) = position.get(&key_of(child)) {
                        *inside_uses.entry((pos, *index)).or_default() += 1;
                        Value::Output {
                            node: pos as u32,
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
                                let value = value?;
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
                            let value = handle.wait()?.clone();
                            let bakeable = value.metadata().shape.numel() <= BAKE_LIMIT;
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
            values.push(value);
        }
        drop(slot);
        position.insert(key, ops.len());
        nodes.push(SkeletonNode {
            op: op.def as *const OpDef as usize,
            attrs: op.attrs.clone(),
            inputs: values,
            outputs: op.outputs.clone(),
        });
        locations.push(op.location);
        ops.push(op);
    }
    // Outputs: requested roots, then every op output still referenced from
    // outside the trace (live user tensors or pending ops not in it).
    let mut outputs: Vec<(usize, u32)> = Vec::new();
    let mut requested = Vec::new();
    for (op, index) in roots {
        if let Some(&pos) = position.get(&key_of(op)) {
            let out = (pos, *index);
            let at = outputs.iter().position(|o| *o == out).unwrap_or_else(|| {
                outputs.push(out);
                outputs.len() - 1
            });
            requested.push(at);
        }
    }
    for (pos, op) in ops.iter().enumerate() {
        for index in 0..op.outputs.len() as u32 {
            let live = op.is_live(index);
            let uses = op.uses[index as usize].load(Ordering::Relaxed);
            let inside = inside_uses.get(&(pos, index)).copied().unwrap_or(0);
            if (live || uses > inside) && !outputs.contains(&(pos, index)) {
                outputs.push((pos, index));
            }
        }
    }
    let results = outputs
        .iter()
        .map(|&(node, output)| Value::Output {
            node: node as u32,
            output,
        })
        .collect();
    LAST_TRACE_SIZE.set((ops.len(), leaves.len()));
    Ok(Collected {
        skeleton: Skeleton {
            params,
            nodes,
            results,
        },
        ops,
        locations,
        leaves,
        outputs,
        requested,
        target,
    })
}

#[cfg(test)]
mod tests {
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
        assert_eq!(c.skeleton.nodes[0].inputs.as_slice(), [Value::Param(0)]);
    }

    /// A leaf whose trace failed fails the collection with its error.
    #[test]
    fn a_failed_leaf_fails_the_collection() {
        let d = lazy_device();
        let zero = crate::runtime::execute(
            &stagecraft_ops::DIV,
            d,
            Location::caller(),
            smallvec::smallvec![scalar_i32(1, d), scalar_i32(0, d)],
            (&stagecraft_ops::OpAttrs::new()).into(),
        )
        .remove(0);
        // Recorded before the division runs (after, it would be an error
        // handle at once).
        let y = unary(&stagecraft_ops::NEG, &zero);
        assert!(zero.wait().is_err());
        let err = collect(&[root(&y)]).err().expect("an error");
        assert_eq!(err.op(), Some("Div"));
    }

    fn scalar_i32(v: i32, d: Device) -> TensorHandle {
        let value = stagecraft_tensor::DenseHostTensor::from_slice(&[v], [0usize; 0]).unwrap();
        TensorHandle::available(d, value.into())
    }
}
