//! Turns sums of zero-padded pieces that tile a tensor into one
//! concatenation.
//!
//! The gradient of a slice is its gradient padded with zeros to the
//! sliced tensor's shape, and gradients of one value add up. So when a
//! program splits a tensor into parts along an axis (a transformer's
//! `[B, T, 3C]` projection into queries, keys and values), autodiff sums
//! the parts' padded gradients: `Pad(g_q) + Pad(g_k) + Pad(g_v)`, three
//! zero-filled copies of the whole tensor and two passes adding them. When
//! the pieces are disjoint and cover the axis, the sum is the pieces side
//! by side: `Concat(g_q, g_k, g_v)`, one copy.
//!
//! Bit for bit: at every position the sum adds one piece's value to
//! `+0`s, which gives the value itself except that `-0` becomes `+0`
//! (`-0 + +0 = +0`). For float types the concatenation is therefore
//! followed by `+ 0`, which makes the same change (and which fusion can
//! merge into what reads the sum); integers need no such step.
//!
//! The `Pad`s and partial sums stay for any other users; DCE drops them
//! when the sum was the only one.

use crate::passes::{outputs_of, Rebuilder};
use crate::{Function, Node, NodeOp, Value};
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::{Attrs, OpAttrs, ADD, CONCAT, PAD};
use stagecraft_tensor::{HostTensor, Scalar, ScalarHostTensor};

/// The most pieces a sum is followed through. Every partial sum keeps its
/// own list, so a chain of `n` additions holds `n²/2` entries; a split
/// into more parts than this keeps its pads.
const MAX_PIECES: usize = 64;

/// Zero-padded pieces along one axis whose sum a value is.
#[derive(Clone, Debug)]
struct Pieces {
    axis: usize,
    /// `(start, length, source)` of each piece on `axis`, in no order.
    parts: SmallVec<[(usize, usize, Value); 4]>,
}

impl Pieces {
    /// The sources in order along the axis, when they cover `0..extent`
    /// without gaps or overlaps.
    fn tiling(&self, extent: usize) -> Option<SmallVec<[Value; 4]>> {
        let mut parts = self.parts.clone();
        parts.sort_by_key(|&(start, _, _)| start);
        let mut next = 0;
        for &(start, len, _) in &parts {
            if start != next {
                return None;
            }
            next += len;
        }
        (next == extent).then(|| parts.iter().map(|&(_, _, v)| v).collect())
    }

    /// The union of two disjoint sets of pieces along the same axis.
    fn join(&self, other: &Pieces) -> Option<Pieces> {
        if self.axis != other.axis || self.parts.len() + other.parts.len() > MAX_PIECES {
            return None;
        }
        let overlaps = self
            .parts
            .iter()
            .any(|&(s, l, _)| other.parts.iter().any(|&(t, m, _)| s < t + m && t < s + l));
        if overlaps {
            return None;
        }
        let mut parts = self.parts.clone();
        parts.extend(other.parts.iter().copied());
        Some(Pieces {
            axis: self.axis,
            parts,
        })
    }
}

/// The piece a `Pad` node is: a pad with `+0` along exactly one axis.
fn padded_piece(f: &Function, node: &Node) -> Option<Pieces> {
    let NodeOp::Op(def, attrs) = &node.op else {
        return None;
    };
    if !std::ptr::eq(*def, &PAD) || node.inputs.len() != 1 {
        return None;
    }
    let attrs = Attrs::new(attrs, def);
    let value = attrs.float("value").ok()?;
    if value.to_bits() != 0f64.to_bits() {
        return None;
    }
    let pads = attrs.dims("pads").ok()?;
    let source = node.inputs[0];
    if !same_device(f, source, &node.device) {
        return None;
    }
    let mut padded = (0..pads.len() / 2).filter(|&a| pads[2 * a] != 0 || pads[2 * a + 1] != 0);
    let axis = padded.next()?;
    if padded.next().is_some() {
        return None;
    }
    let len = f.meta(source).shape.dims().get(axis).copied()?;
    Some(Pieces {
        axis,
        parts: smallvec![(pads[2 * axis], len, source)],
    })
}

fn same_device(f: &Function, value: Value, device: &Option<String>) -> bool {
    match value {
        Value::Param(_) => true,
        Value::Output { node, .. } => f.nodes[node as usize].device == *device,
    }
}

/// The pieces of every node's first output, where it is such a sum.
fn find_pieces(f: &Function) -> Vec<Option<Pieces>> {
    let mut pieces: Vec<Option<Pieces>> = vec![None; f.nodes.len()];
    for (index, node) in f.nodes.iter().enumerate() {
        pieces[index] = padded_piece(f, node).or_else(|| summed_pieces(f, node, &pieces));
    }
    pieces
}

/// The pieces an `Add` of two piece sums of its own shape holds.
fn summed_pieces(f: &Function, node: &Node, pieces: &[Option<Pieces>]) -> Option<Pieces> {
    let NodeOp::Op(def, _) = &node.op else {
        return None;
    };
    if !std::ptr::eq(*def, &ADD) || node.inputs.len() != 2 {
        return None;
    }
    let out = &node.outputs[0];
    let of = |v: Value| match v {
        Value::Output { node: n, output: 0 } => {
            let meta = f.meta(v);
            let alike = meta == out && f.nodes[n as usize].device == node.device;
            alike.then(|| pieces[n as usize].as_ref()).flatten()
        }
        _ => None,
    };
    of(node.inputs[0])?.join(of(node.inputs[1])?)
}

/// [`join_padded_pieces`], also returning how many sums became
/// concatenations.
pub(crate) fn run(f: &Function) -> (Function, usize) {
    let pieces = find_pieces(f);
    let tilings: Vec<Option<(usize, SmallVec<[Value; 4]>)>> = f
        .nodes
        .iter()
        .zip(&pieces)
        .map(|(node, p)| {
            let p = p.as_ref()?;
            // A lone pad is a piece too, but not a sum to replace.
            if p.parts.len() < 2 {
                return None;
            }
            let extent = node.outputs[0].shape.dims()[p.axis];
            Some((p.axis, p.tiling(extent)?))
        })
        .collect();
    if tilings.iter().all(Option::is_none) {
        return (f.clone(), 0);
    }
    let mut rb = Rebuilder::new(f);
    let mut joined = 0;
    for (node, tiling) in f.nodes.iter().zip(&tilings) {
        let Some((axis, sources)) = tiling else {
            rb.keep(node);
            continue;
        };
        let out = node.outputs[0].clone();
        // The new nodes stand where the sum stood: its device and lines.
        let at = |op, inputs, output| Node {
            op,
            inputs,
            outputs: smallvec![output],
            device: node.device.clone(),
            location: node.location,
            origin: node.origin,
        };
        let inputs = sources.iter().map(|&v| rb.value(v)).collect();
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", *axis as i64);
        let concat = rb.push(at(NodeOp::Op(&CONCAT, attrs.freeze()), inputs, out.clone()));
        let result = if out.dtype.is_float() {
            let zero =
                HostTensor::from(ScalarHostTensor::new(Scalar::F64(0.0).cast(out.dtype), []));
            let zero_meta = zero.metadata().clone();
            let zero = rb.push(at(NodeOp::Const(zero), SmallVec::new(), zero_meta));
            let add = NodeOp::Op(&ADD, OpAttrs::new().freeze());
            rb.push(at(
                add,
                smallvec![Value::node(concat), Value::node(zero)],
                out,
            ))
        } else {
            concat
        };
        rb.bind(outputs_of(result, 1));
        joined += 1;
    }
    (rb.finish(), joined)
}

/// Returns `f` with every sum of zero-padded pieces that tile a tensor
/// along one axis replaced by their concatenation (see the [module
/// docs](self)).
pub fn join_padded_pieces(f: &Function) -> Function {
    run(f).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::optimize;
    use crate::passes::testing::{loc, meta, run_bits};
    use stagecraft_cpu::CONSTANT_KERNELS as CPU;
    use stagecraft_tensor::{DType, DenseHostTensor, TensorMetadata};

    fn pad(f: &mut Function, x: Value, pads: &[i64], value: f64) -> Value {
        let mut attrs = OpAttrs::new();
        attrs.set_ints("pads", pads).set_float("value", value);
        Value::node(f.add_op(&PAD, &attrs, &[x], loc(1)).unwrap())
    }

    fn add(f: &mut Function, a: Value, b: Value) -> Value {
        Value::node(f.add_op(&ADD, &OpAttrs::new(), &[a, b], loc(2)).unwrap())
    }

    fn ops(f: &Function) -> Vec<&'static str> {
        f.nodes.iter().map(|n| n.op.name()).collect()
    }

    /// Values with signed zeros, infinities and a NaN among them.
    fn arg(dims: &[usize], seed: usize) -> HostTensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| match (i * 7 + seed) % 11 {
                0 => -0.0,
                1 => 0.0,
                2 => f32::INFINITY,
                3 => f32::NAN,
                k => k as f32 * 0.37 - 2.0 * seed as f32,
            })
            .collect();
        DenseHostTensor::from_slice(&v, dims).unwrap().into()
    }

    /// The gradient of splitting `[2, 3, 12]` into three `[2, 3, 4]`
    /// parts along its last axis, as autodiff writes it.
    fn split_gradient(order: [usize; 3]) -> Function {
        let mut f = Function::new("split_grad", vec![meta(&[2, 3, 4]); 3]);
        let pieces: Vec<Value> = (0..3)
            .map(|i| {
                let before = 4 * i as i64;
                pad(
                    &mut f,
                    Value::Param(i as u32),
                    &[0, 0, 0, 0, before, 8 - before],
                    0.0,
                )
            })
            .collect();
        let first = add(&mut f, pieces[order[0]], pieces[order[1]]);
        let sum = add(&mut f, first, pieces[order[2]]);
        f.results = vec![sum];
        f
    }

    #[test]
    fn the_gradient_of_a_split_becomes_one_concatenation_with_the_same_bits() {
        let args = [arg(&[2, 3, 4], 1), arg(&[2, 3, 4], 2), arg(&[2, 3, 4], 3)];
        for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0]] {
            let f = split_gradient(order);
            let (g, joined) = run(&f);
            assert_eq!(joined, 1, "{}", crate::text::print(&g));
            let optimized = optimize(&f, &CPU);
            assert_eq!(ops(&optimized), ["Concat", "Const", "Add"]);
            // Bit for bit, -0 turned into +0 by the sum included.
            assert_eq!(run_bits(&optimized, &args), run_bits(&f, &args));
        }
        // Without the `+ 0`, a -0 in a piece would stay -0 where the sum
        // gives +0.
        let f = split_gradient([0, 1, 2]);
        let (g, _) = run(&f);
        let mut bare = g.clone();
        let concat = bare
            .nodes
            .iter()
            .position(|n| n.op.name() == "Concat")
            .unwrap();
        bare.results = vec![Value::node(concat)];
        assert_ne!(run_bits(&bare, &args), run_bits(&f, &args));
    }

    #[test]
    fn integer_pieces_need_no_zero_added() {
        let int = TensorMetadata::new(DType::I32, [2, 2]);
        let mut f = Function::new("ints", vec![int.clone(), int]);
        let a = pad(&mut f, Value::Param(0), &[0, 0, 0, 2], 0.0);
        let b = pad(&mut f, Value::Param(1), &[0, 0, 2, 0], 0.0);
        f.results = vec![add(&mut f, a, b)];
        let args: Vec<HostTensor> = [[1i32, -2, 3, 4], [5, 6, -7, 8]]
            .iter()
            .map(|v| DenseHostTensor::from_slice(v, [2, 2]).unwrap().into())
            .collect();
        let optimized = optimize(&f, &CPU);
        assert_eq!(ops(&optimized), ["Concat"]);
        assert_eq!(run_bits(&optimized, &args), run_bits(&f, &args));
    }

    #[test]
    fn sums_that_are_not_a_tiling_stay() {
        let two = meta(&[4, 2]);
        let with = |pads: [[i64; 4]; 2], value: f64| {
            let mut f = Function::new("sum", vec![two.clone(), two.clone()]);
            let a = pad(&mut f, Value::Param(0), &pads[0], value);
            let b = pad(&mut f, Value::Param(1), &pads[1], value);
            f.results = vec![add(&mut f, a, b)];
            f
        };
        // Overlapping, leaving a gap, padded on two axes, padded with a
        // nonzero or a negative zero.
        let cases = [
            (with([[0, 0, 0, 1], [0, 0, 1, 0]], 0.0), "overlap"),
            (with([[0, 0, 0, 3], [0, 0, 3, 0]], 0.0), "gap"),
            (with([[0, 4, 0, 2], [4, 0, 2, 0]], 0.0), "two axes"),
            (with([[0, 0, 0, 2], [0, 0, 2, 0]], 1.0), "nonzero"),
            (with([[0, 0, 0, 2], [0, 0, 2, 0]], -0.0), "negative zero"),
        ];
        for (f, case) in cases {
            assert_eq!(run(&f).1, 0, "{case}");
        }
        // The tiling case of the same shapes does join.
        assert_eq!(run(&with([[0, 0, 0, 2], [0, 0, 2, 0]], 0.0)).1, 1);
    }

    /// A split into more parts than a sum is followed through keeps its
    /// pads (and one of exactly that many joins).
    #[test]
    fn a_split_into_too_many_parts_keeps_its_pads() {
        let split = |parts: usize| {
            let mut f = Function::new("many", vec![meta(&[2, 1]); parts]);
            let mut sum = None;
            for i in 0..parts {
                let before = i as i64;
                let after = (parts - 1 - i) as i64;
                let piece = pad(&mut f, Value::Param(i as u32), &[0, 0, before, after], 0.0);
                sum = Some(match sum {
                    Some(s) => add(&mut f, s, piece),
                    None => piece,
                });
            }
            f.results = vec![sum.unwrap()];
            run(&f).1
        };
        assert_eq!(split(MAX_PIECES), 1);
        assert_eq!(split(MAX_PIECES + 1), 0);
    }

    #[test]
    fn a_partial_sum_with_other_users_stays_beside_the_concatenation() {
        let mut f = split_gradient([0, 1, 2]);
        // The first partial sum is also a result.
        let partial = f.nodes.iter().position(|n| n.op.name() == "Add").unwrap();
        f.results.push(Value::node(partial));
        let args = [arg(&[2, 3, 4], 4), arg(&[2, 3, 4], 5), arg(&[2, 3, 4], 6)];
        let optimized = optimize(&f, &CPU);
        assert!(ops(&optimized).contains(&"Concat"), "{:?}", ops(&optimized));
        assert_eq!(run_bits(&optimized, &args), run_bits(&f, &args));
    }
}
