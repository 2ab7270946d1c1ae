//! Elementwise fusion: chains and trees of elementwise ops over one shape
//! (scalars may join in) become one `FusedElementwise` node, so the
//! executor runs one kernel that reads each input once and writes one
//! output instead of materializing every intermediate.
//!
//! A node joins the group of an input's producer when that producer is
//! fusible, has one output, and this node is its only user, possibly
//! several times (results count as users): the group then has a single
//! output, its root.

use crate::{Function, Node, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::{
    OpAttrs, OpKind, FUSED_BINARY, FUSED_BINARY_BASE, FUSED_ELEMENTWISE, FUSED_UNARY,
};
use stagecraft_tensor::{DType, TensorMetadata};

/// The program code of a fusible node, if it is one.
fn code(f: &Function, node: &Node) -> Option<i64> {
    let NodeOp::Op(def, _) = &node.op else {
        return None;
    };
    let out: &TensorMetadata = node.outputs.first()?;
    if node.outputs.len() != 1 || !matches!(out.dtype, DType::F32 | DType::F64) {
        return None;
    }
    // Same shape as the output, or a scalar: no other broadcasting.
    let shapes_fit = node.inputs.iter().all(|v| {
        let m = f.meta(*v);
        m.dtype == out.dtype && (m.shape == out.shape || m.shape.rank() == 0)
    });
    if !shapes_fit {
        return None;
    }
    match def.kind {
        OpKind::Unary(op) => FUSED_UNARY.iter().position(|u| *u == op).map(|i| i as i64),
        OpKind::Binary(op) => FUSED_BINARY
            .iter()
            .position(|b| *b == op)
            .map(|i| FUSED_BINARY_BASE + i as i64),
        _ => None,
    }
}

/// Fuses elementwise groups; returns the new function and how many nodes
/// were folded into fused kernels.
pub(crate) fn run(f: &Function) -> (Function, usize) {
    let (_, uses) = f.use_counts();
    let codes: Vec<Option<i64>> = f.nodes.iter().map(|n| code(f, n)).collect();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of: Vec<Option<usize>> = vec![None; f.nodes.len()];
    for (i, node) in f.nodes.iter().enumerate() {
        if codes[i].is_none() {
            continue;
        }
        let mut members: Vec<usize> = Vec::new();
        for v in &node.inputs {
            let Value::Output { node: p, .. } = *v else {
                continue;
            };
            let p = p as usize;
            // Every use of p is by this node (`t * t` uses t twice).
            let here = node.inputs.iter().filter(|w| **w == *v).count() as u32;
            let joins = codes[p].is_some()
                && uses[p][0] == here
                && f.nodes[p].device == node.device
                && f.nodes[p].outputs[0].shape == node.outputs[0].shape;
            if let (true, Some(g)) = (joins, group_of[p]) {
                members.append(&mut groups[g]);
            }
        }
        members.push(i);
        members.sort_unstable();
        for &m in &members {
            group_of[m] = Some(groups.len());
        }
        groups.push(members);
    }
    let mut out = Function::new(f.name.clone(), f.params.clone());
    let mut map: Vec<Option<Value>> = vec![None; f.nodes.len()];
    let remap = |v: Value, map: &[Option<Value>]| match v {
        Value::Param(i) => Value::Param(i),
        Value::Output { node, output } => match map[node as usize] {
            Some(Value::Output { node: n, .. }) => Value::Output { node: n, output },
            Some(other) => other,
            None => v,
        },
    };
    let mut fused = 0;
    for (i, node) in f.nodes.iter().enumerate() {
        let group = group_of[i].map(|g| &groups[g]).filter(|g| g.len() > 1);
        match group {
            // A member other than the root: emitted inside the root's kernel.
            Some(g) if *g.last().unwrap_or(&i) != i => continue,
            Some(g) => {
                let mut externals: Vec<Value> = Vec::new();
                let mut program: Vec<i64> = Vec::with_capacity(3 * g.len());
                let register = |v: Value, externals: &mut Vec<Value>| -> i64 {
                    if let Value::Output { node: p, .. } = v {
                        if let Some(pos) = g.iter().position(|&m| m == p as usize) {
                            return -1 - pos as i64; // a member: fixed up below
                        }
                    }
                    match externals.iter().position(|e| *e == v) {
                        Some(k) => k as i64,
                        None => {
                            externals.push(v);
                            (externals.len() - 1) as i64
                        }
                    }
                };
                for &m in g {
                    let n = &f.nodes[m];
                    let a = register(n.inputs[0], &mut externals);
                    let b = n.inputs.get(1).map_or(0, |v| register(*v, &mut externals));
                    program.extend([codes[m].unwrap_or(0), a, b]);
                }
                // Members become registers after the external inputs.
                let base = externals.len() as i64;
                for (k, slot) in program.iter_mut().enumerate() {
                    if k % 3 != 0 && *slot < 0 {
                        *slot = base + (-1 - *slot);
                    }
                }
                let inputs: SmallVec<[Value; 4]> =
                    externals.iter().map(|v| remap(*v, &map)).collect();
                let mut attrs = OpAttrs::new();
                attrs.set_ints("program", &program);
                let index = out.push(Node {
                    op: NodeOp::Op(&FUSED_ELEMENTWISE, attrs.freeze()),
                    inputs,
                    outputs: node.outputs.clone(),
                    device: node.device.clone(),
                    location: node.location,
                });
                fused += g.len();
                map[i] = Some(Value::node(index));
            }
            None => {
                let mut copy = node.clone();
                copy.inputs = node.inputs.iter().map(|v| remap(*v, &map)).collect();
                map[i] = Some(Value::node(out.push(copy)));
            }
        }
    }
    out.results = f.results.iter().map(|v| remap(*v, &map)).collect();
    (out, fused)
}

/// Fuses elementwise chains and trees into `FusedElementwise` nodes.
pub fn fuse_elementwise(f: &Function) -> Function {
    run(f).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::optimize;
    use stagecraft_ops::{ADD, MUL, RELU, SUB};
    use stagecraft_tensor::{HostTensor, Location, Scalar, ScalarHostTensor, Shape};

    fn scalar(f: &mut Function, v: f32) -> Value {
        let s = ScalarHostTensor::new(Scalar::F32(v), Shape::scalar());
        Value::node(f.add_const(HostTensor::Scalar(s), Location::caller()))
    }

    /// `((x*2+1)*x-3).relu()` becomes one kernel.
    #[test]
    fn a_chain_becomes_one_kernel() {
        let mut f = Function::new("chain", vec![TensorMetadata::new(DType::F32, [1000])]);
        let x = Value::Param(0);
        let none = OpAttrs::new();
        let loc = Location::caller();
        let two = scalar(&mut f, 2.0);
        let one = scalar(&mut f, 1.0);
        let three = scalar(&mut f, 3.0);
        let a = Value::node(f.add_op(&MUL, &none, &[x, two], loc).unwrap());
        let b = Value::node(f.add_op(&ADD, &none, &[a, one], loc).unwrap());
        let c = Value::node(f.add_op(&MUL, &none, &[b, x], loc).unwrap());
        let d = Value::node(f.add_op(&SUB, &none, &[c, three], loc).unwrap());
        let e = Value::node(f.add_op(&RELU, &none, &[d], loc).unwrap());
        f.results = vec![e];
        let g = optimize(&f);
        crate::verify(&g).unwrap();
        let kernels: Vec<&str> = g
            .nodes
            .iter()
            .filter(|n| !matches!(n.op, NodeOp::Const(_)))
            .map(|n| n.op.name())
            .collect();
        assert_eq!(kernels, ["FusedElementwise"]);
    }

    /// A value used twice ends a group: it must be materialized once.
    #[test]
    fn shared_values_are_not_fused_into_two_kernels() {
        let mut f = Function::new("shared", vec![TensorMetadata::new(DType::F64, [8])]);
        let x = Value::Param(0);
        let none = OpAttrs::new();
        let loc = Location::caller();
        let t = Value::node(f.add_op(&stagecraft_ops::TANH, &none, &[x], loc).unwrap());
        let p = Value::node(f.add_op(&ADD, &none, &[t, x], loc).unwrap());
        let q = Value::node(f.add_op(&MUL, &none, &[t, x], loc).unwrap());
        f.results = vec![p, q];
        let g = fuse_elementwise(&f);
        crate::verify(&g).unwrap();
        assert_eq!(g.nodes.len(), 3, "tanh is shared, so nothing fuses");
    }
}
