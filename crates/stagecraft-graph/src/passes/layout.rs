//! Folds transposes into the matrix products that read them, and skips
//! reshapes that keep their input's shape.
//!
//! `MatMul(Transpose(a), b)`, where the transpose swaps the last two
//! dimensions, becomes `MatMul(a, b)` with `transpose_a` toggled (likewise
//! for `b`): the GEMM reads `a` with swapped strides, so the transposed copy
//! is never written. The transpose node stays for its other users; DCE drops
//! it when the product was the only one. Training graphs are full of these:
//! a hand-written backward pass multiplies by `xᵀ` and `wᵀ`, and copying
//! them cost a tenth of an MLP step.
//!
//! A reshape to the shape its input already has (autodiff emits one after
//! every gradient it sums back to an operand's shape) is read through: its
//! users read its input instead. Besides the copy it saves, this lets the
//! fusion pass see the product behind a weight gradient, so an SGD update
//! becomes the product's epilogue. The reshape stays if it is a result.
//!
//! An elementwise op on a reshaped product, `op(Reshape(MatMul(..)), y)`,
//! with `y` of the op's whole shape (or a scalar), runs over the product's
//! shape instead: `Reshape(op(MatMul(..), Reshape(y)))`. Both reshapes
//! keep the row-major order, so every element meets the same operands and
//! the bits do not change, and the fusion pass then makes the op the
//! product's epilogue. A linear layer over `[B, T, C]` multiplies
//! `[B·T, C]` rows and reshapes back, so its input gradient reaches the
//! activation's derivative through such a reshape (`g·W` times GELU's
//! kept derivative, a pass over the activations per block otherwise).

use crate::{Function, Node, NodeOp, Value};
use stagecraft_ops::{
    matmul_attrs, matmul_transposes, Attrs, OpAttrs, OpKind, MATMUL, RESHAPE, TRANSPOSE,
};
use stagecraft_tensor::TensorMetadata;

/// [`fold_transposes`], also returning how many transposes were folded,
/// identity reshapes skipped and ops moved below reshapes. Ops move only
/// for a device whose kernels run products with epilogues
/// (`into_epilogues`): elsewhere the reshape would only split the group
/// the op would have joined.
pub(crate) fn run(f: &Function, into_epilogues: bool) -> (Function, usize) {
    let mut out = f.clone();
    let mut folded = skip_identity_reshapes(&mut out);
    for index in 0..out.nodes.len() {
        let NodeOp::Op(def, attrs) = &out.nodes[index].op else {
            continue;
        };
        if !std::ptr::eq(*def, &MATMUL) {
            continue;
        }
        let Ok(mut flags) = matmul_transposes(&Attrs::new(attrs, def)) else {
            continue;
        };
        let mut inputs = out.nodes[index].inputs.clone();
        let mut changed = false;
        for (input, flag) in inputs.iter_mut().zip([&mut flags.0, &mut flags.1]) {
            if let Some(source) = swapped_last_two(&out, *input, &out.nodes[index].device) {
                *input = source;
                *flag = !*flag;
                changed = true;
                folded += 1;
            }
        }
        if changed {
            let node = &mut out.nodes[index];
            node.inputs = inputs;
            node.op = NodeOp::Op(&MATMUL, matmul_attrs(flags.0, flags.1).freeze());
        }
    }
    // The reshapes and transposes read through above still count as
    // readers of their inputs until they are dropped.
    let out = if folded > 0 {
        super::dce::run(&out).0
    } else {
        out
    };
    if !into_epilogues {
        return (out, folded);
    }
    let (out, sunk) = sink_reshapes_of_products(&out);
    (out, folded + sunk)
}

/// Moves the reshape between a product and the elementwise op that is its
/// only reader below the op (see the [module docs](self)); returns the new
/// function and how many ops moved. The reshapes left without readers are
/// for DCE to remove.
fn sink_reshapes_of_products(f: &Function) -> (Function, usize) {
    let (_, uses) = f.use_counts();
    let only_user = |v: Value| match v {
        Value::Output { node, output: 0 } => uses[node as usize][0] == 1,
        _ => false,
    };
    let producer = |v: Value| match v {
        Value::Output { node, .. } => Some(&f.nodes[node as usize]),
        Value::Param(_) => None,
    };
    let is = |node: &Node, def: &'static stagecraft_ops::OpDef| match &node.op {
        NodeOp::Op(d, _) => std::ptr::eq(*d, def),
        NodeOp::Const(_) => false,
    };
    // For each elementwise node to move: which input is the reshaped product.
    let mut moves: Vec<Option<usize>> = vec![None; f.nodes.len()];
    for (index, node) in f.nodes.iter().enumerate() {
        let NodeOp::Op(def, _) = &node.op else {
            continue;
        };
        if !matches!(def.kind, OpKind::Unary(_) | OpKind::Binary(_)) || node.outputs.len() != 1 {
            continue;
        }
        let out = &node.outputs[0];
        moves[index] = node.inputs.iter().position(|&v| {
            let Some(reshape) = producer(v).filter(|r| is(r, &RESHAPE) && only_user(v)) else {
                return false;
            };
            let source = reshape.inputs[0];
            let Some(product) = producer(source).filter(|p| is(p, &MATMUL) && only_user(source))
            else {
                return false;
            };
            let others_fit = node
                .inputs
                .iter()
                .filter(|&&w| w != v)
                .all(|&w| f.meta(w).shape == out.shape || f.meta(w).shape.rank() == 0);
            // Every input read the same number of times as the product's
            // reshape (`r * r` reads it twice) keeps this simple.
            let once = node.inputs.iter().filter(|&&w| w == v).count() == 1;
            once && others_fit
                && reshape.device == node.device
                && product.device == node.device
                && product.outputs[0].dtype == out.dtype
        });
    }
    if moves.iter().all(Option::is_none) {
        return (f.clone(), 0);
    }
    let mut out = Function::new(f.name.clone(), f.params.clone());
    let mut map: Vec<Value> = Vec::with_capacity(f.nodes.len());
    let remap = |v: Value, map: &[Value]| match v {
        Value::Param(_) => v,
        Value::Output { node, output } => match map[node as usize] {
            Value::Output { node: n, .. } => Value::Output { node: n, output },
            param => param,
        },
    };
    let mut moved = 0;
    for (index, node) in f.nodes.iter().enumerate() {
        let inputs: smallvec::SmallVec<[Value; 4]> =
            node.inputs.iter().map(|v| remap(*v, &map)).collect();
        let Some(k) = moves[index] else {
            let mut copy = node.clone();
            copy.inputs = inputs;
            map.push(Value::node(out.push(copy)));
            continue;
        };
        let Value::Output { node: reshape, .. } = node.inputs[k] else {
            unreachable!("a moved op reads a reshape's output");
        };
        let product = remap(f.nodes[reshape as usize].inputs[0], &map);
        let rows: TensorMetadata = out.meta(product).clone();
        let reshaped = |out: &mut Function, value: Value, meta: &TensorMetadata| {
            let mut attrs = OpAttrs::new();
            attrs.set_dims("shape", meta.shape.dims());
            push_like(out, node, &RESHAPE, attrs, &[value], meta)
        };
        let mut moved_inputs = inputs.clone();
        for (i, input) in moved_inputs.iter_mut().enumerate() {
            if i == k {
                *input = product;
            } else if out.meta(*input).shape.rank() != 0 {
                let meta = TensorMetadata::new(out.meta(*input).dtype, rows.shape.clone());
                *input = reshaped(&mut out, *input, &meta);
            }
        }
        let mut copy = node.clone();
        copy.inputs = moved_inputs;
        copy.outputs[0] = TensorMetadata::new(node.outputs[0].dtype, rows.shape.clone());
        let flat = Value::node(out.push(copy));
        map.push(reshaped(&mut out, flat, &node.outputs[0]));
        moved += 1;
    }
    out.results = f.results.iter().map(|v| remap(*v, &map)).collect();
    (out, moved)
}

/// Appends `def(inputs)` with output `meta`, placed, located and traced
/// to the same recorded op as `like`; returns its value.
fn push_like(
    out: &mut Function,
    like: &Node,
    def: &'static stagecraft_ops::OpDef,
    attrs: OpAttrs,
    inputs: &[Value],
    meta: &TensorMetadata,
) -> Value {
    Value::node(out.push(Node {
        op: NodeOp::Op(def, attrs.freeze()),
        inputs: inputs.iter().copied().collect(),
        outputs: smallvec::smallvec![meta.clone()],
        device: like.device.clone(),
        location: like.location,
        origin: like.origin,
    }))
}

/// Points every read of a reshape that keeps its input's shape at that
/// input; returns how many reads moved.
fn skip_identity_reshapes(f: &mut Function) -> usize {
    // Nodes come in dependency order, so a chain of identity reshapes
    // resolves through the sources already recorded.
    let mut source: Vec<Option<Value>> = vec![None; f.nodes.len()];
    let mut moved = 0;
    for index in 0..f.nodes.len() {
        let node = &mut f.nodes[index];
        for input in node.inputs.iter_mut() {
            if let Value::Output { node, output: 0 } = *input {
                if let Some(through) = source[node as usize] {
                    *input = through;
                    moved += 1;
                }
            }
        }
        let NodeOp::Op(def, _) = &node.op else {
            continue;
        };
        if std::ptr::eq(*def, &RESHAPE) && node.inputs.len() == 1 {
            let input = node.inputs[0];
            let keeps = f.meta(input).shape == f.nodes[index].outputs[0].shape;
            // A reshape placed elsewhere than its input is also a transfer.
            let placed_alike = match input {
                Value::Output { node, .. } => {
                    f.nodes[node as usize].device == f.nodes[index].device
                }
                Value::Param(_) => true,
            };
            if keeps && placed_alike {
                source[index] = Some(input);
            }
        }
    }
    moved
}

/// Returns `f` with transposes folded into the products reading them (see
/// the [module docs](self)).
pub fn fold_transposes(f: &Function) -> Function {
    run(f, true).0
}

/// The input of `value`'s node when that node is a transpose of the last
/// two dimensions of a rank ≥ 2 tensor, placed like the product.
fn swapped_last_two(f: &Function, value: Value, device: &Option<String>) -> Option<Value> {
    let Value::Output { node, output: 0 } = value else {
        return None;
    };
    let node = &f.nodes[node as usize];
    let NodeOp::Op(def, attrs) = &node.op else {
        return None;
    };
    if !std::ptr::eq(*def, &TRANSPOSE) || node.device != *device {
        return None;
    }
    let perm = Attrs::new(attrs, def).ints("perm").ok()?;
    let rank = perm.len();
    if rank < 2 {
        return None;
    }
    let axis = |p: i64| usize::try_from(p.rem_euclid(rank as i64)).ok();
    let swaps_last_two = perm.iter().enumerate().all(|(i, &p)| {
        let expected = match i {
            _ if i == rank - 2 => rank - 1,
            _ if i == rank - 1 => rank - 2,
            _ => i,
        };
        axis(p) == Some(expected)
    });
    swaps_last_two.then(|| node.inputs[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testing::{eval, loc, meta};
    use crate::passes::{optimize, optimize_with_stats};
    use stagecraft_cpu::CONSTANT_KERNELS as CPU;
    use stagecraft_ops::OpAttrs;
    use stagecraft_tensor::{DenseHostTensor, HostTensor};

    fn transpose(f: &mut Function, x: Value, perm: &[i64]) -> Value {
        let mut attrs = OpAttrs::new();
        attrs.set_ints("perm", perm);
        Value::node(f.add_op(&TRANSPOSE, &attrs, &[x], loc(1)).unwrap())
    }

    fn matmul(f: &mut Function, a: Value, b: Value) -> Value {
        Value::node(f.add_op(&MATMUL, &OpAttrs::new(), &[a, b], loc(2)).unwrap())
    }

    fn arg(dims: &[usize], seed: usize) -> HostTensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 31 + seed * 7) % 17) as f32 - 8.0)
            .collect();
        DenseHostTensor::from_slice(&v, dims).unwrap().into()
    }

    fn ops(f: &Function) -> Vec<&'static str> {
        f.nodes.iter().map(|n| n.op.name()).collect()
    }

    /// The three products of a hand-written dense backward pass: xᵀ·g,
    /// g·wᵀ and (with a negative permutation) a batched one.
    #[test]
    fn transposes_read_by_products_become_flags_and_disappear() {
        let mut f = Function::new(
            "backward",
            vec![meta(&[32, 20]), meta(&[32, 24]), meta(&[20, 24])],
        );
        let (x, g, w) = (Value::Param(0), Value::Param(1), Value::Param(2));
        let xt = transpose(&mut f, x, &[1, 0]);
        let dw = matmul(&mut f, xt, g);
        let wt = transpose(&mut f, w, &[-1, -2]);
        let dx = matmul(&mut f, g, wt);
        f.results = vec![dw, dx];
        let args = [arg(&[32, 20], 1), arg(&[32, 24], 2), arg(&[20, 24], 3)];
        let before = eval(&f, &args).unwrap();
        let (g2, stats) = optimize_with_stats(&f, &CPU);
        assert_eq!(ops(&g2), vec!["MatMul", "MatMul"], "{stats:?}");
        let flags: Vec<(bool, bool)> = g2
            .nodes
            .iter()
            .map(|n| match &n.op {
                NodeOp::Op(def, attrs) => matmul_transposes(&Attrs::new(attrs, def)).unwrap(),
                NodeOp::Const(_) => unreachable!("no constants here"),
            })
            .collect();
        assert_eq!(flags, vec![(true, false), (false, true)]);
        let after = eval(&g2, &args).unwrap();
        for (b, a) in before.iter().zip(&after) {
            assert!(b.same_value(a));
        }
    }

    fn reshape(f: &mut Function, x: Value, dims: &[usize]) -> Value {
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", dims);
        Value::node(f.add_op(&RESHAPE, &attrs, &[x], loc(3)).unwrap())
    }

    /// A linear layer's input gradient times an activation's derivative:
    /// `Reshape(x·w) * d` runs as the product's epilogue, same bits, and
    /// only where each condition holds.
    #[test]
    fn an_op_on_a_reshaped_product_becomes_its_epilogue() {
        use stagecraft_ops::{ADD, MUL};
        let build = |other: &[usize], reshape_is_a_result: bool| {
            let mut f = Function::new("linear", vec![meta(&[2, 3, 4]), meta(&[4, 5]), meta(other)]);
            let rows = reshape(&mut f, Value::Param(0), &[6, 4]);
            let product = matmul(&mut f, rows, Value::Param(1));
            let back = reshape(&mut f, product, &[2, 3, 5]);
            let op = if other.len() == 1 { &ADD } else { &MUL };
            let y = Value::node(
                f.add_op(op, &OpAttrs::new(), &[Value::Param(2), back], loc(4))
                    .unwrap(),
            );
            f.results = if reshape_is_a_result {
                vec![y, back]
            } else {
                vec![y]
            };
            f
        };
        let kernels = |f: &Function| -> Vec<&'static str> {
            ops(f).into_iter().filter(|op| *op != "Reshape").collect()
        };
        for (other, reshape_is_a_result, fused) in [
            (&[2usize, 3, 5][..], false, true),
            (&[][..], false, true),
            // A row bias would broadcast differently over `[6, 5]` rows
            // in general: left as it is.
            (&[5][..], false, false),
            // The reshape has another reader.
            (&[2, 3, 5][..], true, false),
        ] {
            let f = build(other, reshape_is_a_result);
            let args = [arg(&[2, 3, 4], 1), arg(&[4, 5], 2), arg(other, 3)];
            let before = eval(&f, &args).unwrap();
            let g = optimize(&f, &CPU);
            crate::verify(&g).unwrap();
            let want: &[&str] = if fused {
                &["FusedMatMul"]
            } else if other.len() == 1 {
                &["MatMul", "Add"]
            } else {
                &["MatMul", "Mul"]
            };
            assert_eq!(kernels(&g), want, "{other:?}, {reshape_is_a_result}");
            let after = eval(&g, &args).unwrap();
            // A device without epilogues (a GPU) keeps the reshape where it is.
            assert_eq!(run(&f, false).1, 0);
            assert_eq!(after[0].metadata().shape.dims(), &[2, 3, 5]);
            for (b, a) in before.iter().zip(&after) {
                assert!(b.same_value(a), "{other:?}");
            }
        }
    }

    #[test]
    fn a_transpose_with_other_users_stays_and_a_flag_toggles_back() {
        let mut f = Function::new("shared", vec![meta(&[20, 20])]);
        let x = Value::Param(0);
        let xt = transpose(&mut f, x, &[1, 0]);
        let xtt = transpose(&mut f, xt, &[1, 0]);
        // (xᵀ)ᵀ · xᵀ: the outer transpose folds twice over, to `x` as is.
        let p = matmul(&mut f, xtt, xt);
        f.results = vec![p, xt];
        let args = [arg(&[20, 20], 4)];
        let before = eval(&f, &args).unwrap();
        let g = optimize(&f, &CPU);
        assert_eq!(ops(&g), vec!["Transpose", "MatMul"]);
        let after = eval(&g, &args).unwrap();
        for (b, a) in before.iter().zip(&after) {
            assert!(b.same_value(a));
        }
        // Permutations other than a swap of the last two axes stay.
        let mut h = Function::new("rotate", vec![meta(&[2, 3, 4]), meta(&[3, 4, 5])]);
        let r = transpose(&mut h, Value::Param(0), &[1, 0, 2]);
        let r = matmul(&mut h, r, Value::Param(1));
        h.results = vec![r];
        assert_eq!(run(&h, true).1, 0);
    }
}
