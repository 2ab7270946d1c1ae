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

use crate::{Function, NodeOp, Value};
use stagecraft_ops::{matmul_attrs, matmul_transposes, Attrs, MATMUL, RESHAPE, TRANSPOSE};

/// [`fold_transposes`], also returning how many transposes were folded and
/// identity reshapes skipped.
pub(crate) fn run(f: &Function) -> (Function, usize) {
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
    (out, folded)
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
    run(f).0
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
        assert_eq!(run(&h).1, 0);
    }
}
