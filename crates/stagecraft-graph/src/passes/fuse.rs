//! Elementwise fusion: chains and trees of elementwise ops over one shape
//! (scalars, row biases and per-row values broadcast in) become one
//! `FusedElementwise` node, so the executor runs one kernel that reads each
//! input once and writes one output instead of materializing every
//! intermediate.
//!
//! A node joins the group of an input's producer when that producer is
//! fusible, has one output, and this node is its only user, possibly
//! several times (results count as users): the group then has a single
//! output, its root.
//!
//! A comparison whose only user casts it to the float type it compares
//! (a mask, as in the relu gradient `g * (x > 0)`) first becomes one
//! comparison instruction giving 1 or 0 in that type, so it joins groups
//! like any elementwise op and the bool tensor is never made.

use crate::{Function, Node, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::{
    decode_fused, fused_operand, matmul_attrs, matmul_transposes, Attrs, FusedInstr, OpAttrs,
    OpDef, OpKind, CAST, FUSED_BINARY, FUSED_BINARY_BASE, FUSED_COMPARE, FUSED_COMPARE_BASE,
    FUSED_ELEMENTWISE, FUSED_MATMUL, FUSED_REDUCE, FUSED_REDUCE_OPS, FUSED_UNARY, MATMUL,
};
use stagecraft_tensor::{DType, TensorMetadata};

/// The program code of a fusible node, if it is one.
fn code(f: &Function, node: &Node) -> Option<i64> {
    let NodeOp::Op(def, attrs) = &node.op else {
        return None;
    };
    let out: &TensorMetadata = node.outputs.first()?;
    if node.outputs.len() != 1 || !matches!(out.dtype, DType::F32 | DType::F64) {
        return None;
    }
    // Broadcasts the kernel reads block by block: scalars, biases over
    // rows, values per row.
    let shapes_fit = node.inputs.iter().all(|v| {
        let m = f.meta(*v);
        m.dtype == out.dtype && fused_operand(&m.shape, &out.shape).is_some()
    });
    if !shapes_fit {
        return None;
    }
    if std::ptr::eq(*def, &FUSED_ELEMENTWISE) {
        // A mask made by `masks_as_numbers`: one comparison of its two inputs.
        let program = Attrs::new(attrs, def).ints("program").ok()?;
        return match decode_fused(program, node.inputs.len()).ok()?.as_slice() {
            [FusedInstr::Compare(_, 0, 1)] if node.inputs.len() == 2 => Some(program[0]),
            _ => None,
        };
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

/// The function with each float cast of a comparison used only by that
/// cast replaced by one fused comparison instruction over the
/// comparison's inputs (see the module docs), and the comparisons removed;
/// `None` when there is no such cast.
fn masks_as_numbers(f: &Function) -> Option<Function> {
    let (_, uses) = f.use_counts();
    let masks: Vec<(usize, i64)> = (0..f.nodes.len())
        .filter_map(|i| Some((i, mask_code(f, i, &uses)?)))
        .collect();
    if masks.is_empty() {
        return None;
    }
    let mut out = f.clone();
    for (i, code) in masks {
        let Value::Output { node: c, .. } = out.nodes[i].inputs[0] else {
            continue;
        };
        let mut attrs = OpAttrs::new();
        attrs.set_ints("program", &[code, 0, 1]);
        let inputs = out.nodes[c as usize].inputs.clone();
        let node = &mut out.nodes[i];
        node.op = NodeOp::Op(&FUSED_ELEMENTWISE, attrs.freeze());
        node.inputs = inputs;
    }
    Some(super::dce::run(&out).0)
}

/// The fused comparison code node `i` becomes, when it is a float cast of
/// a comparison that only it reads, whose operands a fused kernel reads.
fn mask_code(f: &Function, i: usize, uses: &[SmallVec<[u32; 1]>]) -> Option<i64> {
    let node = &f.nodes[i];
    // (A node without outputs, a partition's `Send`, is no cast.)
    let out = node.outputs.first()?;
    let NodeOp::Op(def, _) = &node.op else {
        return None;
    };
    if !std::ptr::eq(*def, &CAST) || !matches!(out.dtype, DType::F32 | DType::F64) {
        return None;
    }
    let [Value::Output { node: c, output: 0 }] = node.inputs.as_slice() else {
        return None;
    };
    let compare = &f.nodes[*c as usize];
    let NodeOp::Op(compare_def, _) = &compare.op else {
        return None;
    };
    let OpKind::Compare(op) = compare_def.kind else {
        return None;
    };
    let operands_fit = compare.inputs.len() == 2
        && compare.inputs.iter().all(|v| {
            let m = f.meta(*v);
            m.dtype == out.dtype && fused_operand(&m.shape, &out.shape).is_some()
        });
    if uses[*c as usize][0] != 1 || compare.device != node.device || !operands_fit {
        return None;
    }
    let k = FUSED_COMPARE.iter().position(|o| *o == op)?;
    Some(FUSED_COMPARE_BASE + k as i64)
}

/// Fuses elementwise groups; returns the new function and how many nodes
/// were folded into fused kernels.
pub(crate) fn run(f: &Function) -> (Function, usize) {
    run_with(f, &Fusions::ALL)
}

/// Which fusions a device's kernels can run.
#[derive(Clone, Copy, Debug)]
pub struct Fusions {
    /// Reductions of a group's root become `FusedReduce`.
    pub reductions: bool,
    /// Matmuls read by a group become `FusedMatMul` with the group as epilogue.
    pub matmul_epilogues: bool,
    /// Only ops this accepts join groups (a device may lack some ops'
    /// fused form).
    pub accepts: fn(&'static OpDef) -> bool,
    /// The most inputs a fused group may read: a GPU binds each input
    /// buffer, and a group past its binding limit would run on the host.
    pub max_inputs: usize,
}

impl Fusions {
    /// Everything the CPU kernels fuse.
    pub const ALL: Fusions = Fusions {
        reductions: true,
        matmul_epilogues: true,
        accepts: |_| true,
        max_inputs: usize::MAX,
    };

    /// No fusion: for a device that runs no fused op.
    pub const NONE: Fusions = Fusions {
        reductions: false,
        matmul_epilogues: false,
        accepts: |_| false,
        max_inputs: usize::MAX,
    };
}

/// Fusion limited to `fusions`: how a device whose kernels run fewer
/// fused forms than the CPU's (a GPU: elementwise groups only) fuses.
pub fn run_with(f: &Function, fusions: &Fusions) -> (Function, usize) {
    let masked = masks_as_numbers(f);
    let f = masked.as_ref().unwrap_or(f);
    let (_, uses) = f.use_counts();
    let codes: Vec<Option<i64>> = f
        .nodes
        .iter()
        .map(|n| match &n.op {
            NodeOp::Op(def, _) if !(fusions.accepts)(def) => None,
            _ => code(f, n),
        })
        .collect();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    // How many values each group reads from outside it, for `max_inputs`:
    // a value read twice counts twice, so the count is a bound, kept in
    // constant time per merge.
    let mut reads: Vec<usize> = Vec::new();
    let mut group_of: Vec<Option<usize>> = vec![None; f.nodes.len()];
    for (i, node) in f.nodes.iter().enumerate() {
        if codes[i].is_none() {
            continue;
        }
        let mut members: Vec<usize> = Vec::new();
        let mut merged_groups: SmallVec<[usize; 4]> = SmallVec::new();
        let mut read = 0usize;
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
                let merged = read.saturating_add(reads[g]);
                if merged.saturating_add(node.inputs.len()) <= fusions.max_inputs {
                    members.append(&mut groups[g]);
                    merged_groups.push(g);
                    read = merged;
                }
            }
        }
        // An input from a merged group is read inside the new one.
        let joined = |v: &Value| match *v {
            Value::Output { node: p, .. } => {
                group_of[p as usize].is_some_and(|g| merged_groups.contains(&g))
            }
            Value::Param(_) => false,
        };
        read += node.inputs.iter().filter(|v| !joined(v)).count();
        members.push(i);
        members.sort_unstable();
        for &m in &members {
            group_of[m] = Some(groups.len());
        }
        groups.push(members);
        reads.push(read);
    }
    // A reduction that is the only user of a group's root computes the
    // group itself: its values are folded as they are made. `claims[i]`
    // holds the group reduction `i` takes over and the attributes of the
    // fused reduction, less the program.
    let mut claims: Vec<Option<(usize, OpAttrs)>> = vec![None; f.nodes.len()];
    let mut reduced: Vec<bool> = vec![false; groups.len()];
    for (i, node) in f.nodes.iter().enumerate() {
        if !fusions.reductions {
            break;
        }
        let NodeOp::Op(def, given) = &node.op else {
            continue;
        };
        let (OpKind::Reduce(op), [Value::Output { node: p, output: 0 }]) =
            (def.kind, node.inputs.as_slice())
        else {
            continue;
        };
        let p = *p as usize;
        let (Some(g), Some(_)) = (group_of[p], codes[p]) else {
            continue;
        };
        let given = Attrs::new(given, def);
        let (Ok(axes), Ok(keepdim), Some(code)) = (
            given.ints("axes"),
            given.bool("keepdim"),
            FUSED_REDUCE_OPS.iter().position(|r| *r == op),
        ) else {
            continue;
        };
        if uses[p][0] == 1 && f.nodes[p].device == node.device {
            let mut attrs = OpAttrs::new();
            attrs
                .set_int("reduce", code as i64)
                .set_ints("axes", axes)
                .set_bool("keepdim", keepdim);
            claims[i] = Some((g, attrs));
            reduced[g] = true;
        }
    }
    // A matmul whose only user is a group member (the product read in full,
    // not broadcast) runs with the group as its epilogue.
    let mut epilogue_of: Vec<Option<usize>> = vec![None; groups.len()];
    let mut in_epilogue: Vec<bool> = vec![false; f.nodes.len()];
    for (c, node) in f.nodes.iter().enumerate() {
        if !fusions.matmul_epilogues {
            break;
        }
        let Some(g) = group_of[c].filter(|&g| !reduced[g] && epilogue_of[g].is_none()) else {
            continue;
        };
        for v in &node.inputs {
            let Value::Output {
                node: mm,
                output: 0,
            } = *v
            else {
                continue;
            };
            let mm = mm as usize;
            let producer = &f.nodes[mm];
            let is_matmul =
                matches!(&producer.op, NodeOp::Op(def, _) if std::ptr::eq(*def, &MATMUL));
            if is_matmul
                && uses[mm][0] == 1
                && producer.device == node.device
                && producer.outputs[0].shape == node.outputs[0].shape
                && matches!(producer.outputs[0].dtype, DType::F32 | DType::F64)
            {
                epilogue_of[g] = Some(mm);
                in_epilogue[mm] = true;
                break;
            }
        }
    }
    let mut out = Function::new(f.name.clone(), f.params.clone());
    let mut map: Vec<Option<Value>> = vec![None; f.nodes.len()];
    let mut fused = 0;
    for (i, node) in f.nodes.iter().enumerate() {
        if let Some(g) = group_of[i] {
            let members = &groups[g];
            // A member other than the root is emitted inside the root's
            // kernel, and a root a reduction takes over inside the
            // reduction's.
            let single = members.len() == 1 && !reduced[g] && epilogue_of[g].is_none();
            if !single {
                if *members.last().unwrap_or(&i) != i || reduced[g] {
                    continue;
                }
                let first = epilogue_of[g].map(Value::node);
                let (mut inputs, program) = group_program(f, members, &codes, &map, first);
                let (def, mut attrs) = match epilogue_of[g] {
                    Some(mm) => {
                        // The product's register is 0; a and b come first.
                        let operands = f.nodes[mm].inputs.iter().map(|v| remap(*v, &map));
                        inputs = operands.chain(inputs.into_iter().skip(1)).collect();
                        let (ta, tb) = match &f.nodes[mm].op {
                            NodeOp::Op(def, mm_attrs) => {
                                matmul_transposes(&Attrs::new(mm_attrs, def)).unwrap_or_default()
                            }
                            NodeOp::Const(_) => (false, false),
                        };
                        fused += 1;
                        (&FUSED_MATMUL, matmul_attrs(ta, tb))
                    }
                    None => (&FUSED_ELEMENTWISE, OpAttrs::new()),
                };
                attrs.set_ints("program", &program);
                let index = out.push(Node {
                    op: NodeOp::Op(def, attrs.freeze()),
                    inputs,
                    outputs: node.outputs.clone(),
                    device: node.device.clone(),
                    location: node.location,
                    origin: node.origin,
                });
                fused += members.len();
                map[i] = Some(Value::node(index));
                continue;
            }
        }
        if let Some((g, attrs)) = &claims[i] {
            let members = &groups[*g];
            let (inputs, program) = group_program(f, members, &codes, &map, None);
            let mut attrs = attrs.clone();
            attrs.set_ints("program", &program);
            let index = out.push(Node {
                op: NodeOp::Op(&FUSED_REDUCE, attrs.freeze()),
                inputs,
                outputs: node.outputs.clone(),
                device: node.device.clone(),
                location: node.location,
                origin: node.origin,
            });
            fused += members.len() + 1;
            map[i] = Some(Value::node(index));
            continue;
        }
        if in_epilogue[i] {
            // Emitted as its epilogue's FusedMatMul.
            continue;
        }
        let mut copy = node.clone();
        copy.inputs = node.inputs.iter().map(|v| remap(*v, &map)).collect();
        map[i] = Some(Value::node(out.push(copy)));
    }
    out.results = f.results.iter().map(|v| remap(*v, &map)).collect();
    (out, fused)
}

/// `v` in the new function.
fn remap(v: Value, map: &[Option<Value>]) -> Value {
    match v {
        Value::Param(i) => Value::Param(i),
        Value::Output { node, output } => match map[node as usize] {
            Some(Value::Output { node: n, .. }) => Value::Output { node: n, output },
            Some(other) => other,
            None => v,
        },
    }
}

/// The inputs (in the new function) and register program of a group;
/// `first`, when given, is the first input.
fn group_program(
    f: &Function,
    members: &[usize],
    codes: &[Option<i64>],
    map: &[Option<Value>],
    first: Option<Value>,
) -> (SmallVec<[Value; 4]>, Vec<i64>) {
    let mut externals: Vec<Value> = first.into_iter().collect();
    let mut program: Vec<i64> = Vec::with_capacity(3 * members.len());
    let register = |v: Value, externals: &mut Vec<Value>| -> i64 {
        if let Value::Output { node: p, .. } = v {
            if let Some(pos) = members.iter().position(|&m| m == p as usize) {
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
    for &m in members {
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
    let inputs = externals.iter().map(|v| remap(*v, map)).collect();
    (inputs, program)
}

/// Fuses elementwise chains and trees into `FusedElementwise` nodes.
pub fn fuse_elementwise(f: &Function) -> Function {
    run(f).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::optimize;
    use crate::passes::testing::run_bits;
    use stagecraft_cpu::CONSTANT_KERNELS as CPU;
    use stagecraft_ops::{OpDef, ADD, MUL, RELU, SUB};
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
        let g = optimize(&f, &CPU);
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

    /// A function of f32 parameters of these shapes.
    fn f32_params(name: &str, shapes: &[&[usize]]) -> Function {
        let params = shapes.iter().map(|d| TensorMetadata::new(DType::F32, *d));
        Function::new(name, params.collect())
    }

    fn kernels(g: &Function) -> Vec<&'static str> {
        g.nodes
            .iter()
            .filter(|n| !matches!(n.op, NodeOp::Const(_)))
            .map(|n| n.op.name())
            .collect()
    }

    /// A sum of ten parameters fused for a device that binds at most four
    /// inputs per kernel: every kernel reads at most four, and the groups
    /// still compute the sum.
    #[test]
    fn a_group_reads_no_more_inputs_than_the_device_binds() {
        let shapes: Vec<&[usize]> = vec![&[8]; 10];
        let mut f = f32_params("wide", &shapes);
        let loc = Location::caller();
        let mut total = Value::Param(0);
        for k in 1..10 {
            total = Value::node(
                f.add_op(&ADD, &OpAttrs::new(), &[total, Value::Param(k)], loc)
                    .unwrap(),
            );
        }
        f.results = vec![total];
        let narrow = Fusions {
            max_inputs: 4,
            ..Fusions::ALL
        };
        let (g, _) = run_with(&f, &narrow);
        crate::verify(&g).unwrap();
        let widest = g.nodes.iter().map(|n| n.inputs.len()).max().unwrap();
        assert!(widest <= 4, "a kernel reads {widest} inputs");
        assert!(kernels(&g).len() < 9, "{:?}", kernels(&g));
        let (unbounded, _) = run_with(&f, &Fusions::ALL);
        assert_eq!(kernels(&unbounded), ["FusedElementwise"]);
        let args: Vec<HostTensor> = (0..10).map(|k| values(&[8], k)).collect();
        assert_eq!(run_bits(&g, &args), run_bits(&unbounded, &args));
    }

    fn values(dims: &[usize], seed: usize) -> HostTensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        HostTensor::Dense(
            stagecraft_tensor::DenseHostTensor::from_slice(&v, Shape::new(dims)).unwrap(),
        )
    }

    /// `sum((x*2+1)*x)` over rows, over columns, over everything and as a
    /// mean: one `FusedReduce` kernel each, with the unfused result's bits
    /// (sizes large enough for the parallel paths and the pairwise split).
    #[test]
    fn a_reduction_of_a_chain_becomes_one_kernel() {
        use stagecraft_ops::{MEAN, SUM};
        let cases: [(&OpDef, &[usize], &[i64], bool); 6] = [
            (&SUM, &[64, 300], &[1], false),
            // Short rows, many per read, on several threads.
            (&SUM, &[400, 300], &[1], false),
            (&SUM, &[300, 700], &[0], true),
            (&SUM, &[3, 70_000], &[], false),
            (&MEAN, &[8, 9, 10], &[1], true),
            (&stagecraft_ops::MAX, &[5, 6000], &[-1], false),
        ];
        for (op, dims, axes, keepdim) in cases {
            let mut f = Function::new("reduce", vec![TensorMetadata::new(DType::F32, dims)]);
            let x = Value::Param(0);
            let none = OpAttrs::new();
            let loc = Location::caller();
            let two = scalar(&mut f, 2.0);
            let one = scalar(&mut f, 1.0);
            let a = Value::node(f.add_op(&MUL, &none, &[x, two], loc).unwrap());
            let b = Value::node(f.add_op(&ADD, &none, &[a, one], loc).unwrap());
            let c = Value::node(f.add_op(&MUL, &none, &[b, x], loc).unwrap());
            let mut attrs = OpAttrs::new();
            attrs.set_ints("axes", axes).set_bool("keepdim", keepdim);
            let r = Value::node(f.add_op(op, &attrs, &[c], loc).unwrap());
            f.results = vec![r];
            let g = optimize(&f, &CPU);
            crate::verify(&g).unwrap();
            assert_eq!(kernels(&g), ["FusedReduce"], "{} over {axes:?}", op.name);
            let x = values(dims, 1);
            assert_eq!(
                run_bits(&f, std::slice::from_ref(&x)),
                run_bits(&g, &[x]),
                "{} of {dims:?} over {axes:?}",
                op.name
            );
        }
    }

    /// A lone elementwise op feeding a reduction fuses too: `sum(x * y)`.
    #[test]
    fn a_dot_product_is_one_kernel() {
        let m = TensorMetadata::new(DType::F32, [1000]);
        let mut f = Function::new("dot", vec![m.clone(), m]);
        let none = OpAttrs::new();
        let loc = Location::caller();
        let p = Value::node(
            f.add_op(&MUL, &none, &[Value::Param(0), Value::Param(1)], loc)
                .unwrap(),
        );
        let s = Value::node(f.add_op(&stagecraft_ops::SUM, &none, &[p], loc).unwrap());
        f.results = vec![s];
        let g = optimize(&f, &CPU);
        assert_eq!(kernels(&g), ["FusedReduce"]);
        let args = [values(&[1000], 2), values(&[1000], 3)];
        assert_eq!(run_bits(&f, &args), run_bits(&g, &args));
    }

    /// A bias over rows and a value per row broadcast inside the fused
    /// kernel: `relu(x + b) * s` with `b: [n]`, `s: [m, 1]` is one kernel.
    #[test]
    fn bias_and_row_scale_broadcast_inside_one_kernel() {
        let (m, n) = (33, 70);
        let mut f = f32_params("bias", &[&[m, n], &[n], &[m, 1]]);
        let none = OpAttrs::new();
        let loc = Location::caller();
        let a = Value::node(
            f.add_op(&ADD, &none, &[Value::Param(0), Value::Param(1)], loc)
                .unwrap(),
        );
        let r = Value::node(f.add_op(&RELU, &none, &[a], loc).unwrap());
        let y = Value::node(f.add_op(&MUL, &none, &[r, Value::Param(2)], loc).unwrap());
        f.results = vec![y];
        let g = optimize(&f, &CPU);
        crate::verify(&g).unwrap();
        assert_eq!(kernels(&g), ["FusedElementwise"]);
        let args = [values(&[m, n], 4), values(&[n], 5), values(&[m, 1], 6)];
        assert_eq!(run_bits(&f, &args), run_bits(&g, &args));
    }

    /// A reduction of a value that is also a result leaves the value's
    /// kernel alone: it must be materialized anyway.
    #[test]
    fn a_reduced_value_that_is_also_a_result_is_not_taken_over() {
        let mut f = Function::new("both", vec![TensorMetadata::new(DType::F32, [100])]);
        let none = OpAttrs::new();
        let loc = Location::caller();
        let t = Value::node(
            f.add_op(&stagecraft_ops::TANH, &none, &[Value::Param(0)], loc)
                .unwrap(),
        );
        let s = Value::node(f.add_op(&stagecraft_ops::SUM, &none, &[t], loc).unwrap());
        f.results = vec![t, s];
        let g = optimize(&f, &CPU);
        assert_eq!(kernels(&g), ["Tanh", "Sum"]);
    }

    /// `relu(x @ w + b)`: the bias and activation run as the matmul's
    /// epilogue, one kernel, with the unfused bits.
    #[test]
    fn bias_and_activation_become_a_matmul_epilogue() {
        for (m, k, n) in [(4, 3, 5), (128, 96, 300)] {
            let mut f = f32_params("dense", &[&[m, k], &[k, n], &[n]]);
            let none = OpAttrs::new();
            let loc = Location::caller();
            let p = Value::node(
                f.add_op(&MATMUL, &none, &[Value::Param(0), Value::Param(1)], loc)
                    .unwrap(),
            );
            let a = Value::node(f.add_op(&ADD, &none, &[p, Value::Param(2)], loc).unwrap());
            let r = Value::node(f.add_op(&RELU, &none, &[a], loc).unwrap());
            f.results = vec![r];
            let g = optimize(&f, &CPU);
            crate::verify(&g).unwrap();
            assert_eq!(kernels(&g), ["FusedMatMul"]);
            let args = [values(&[m, k], 7), values(&[k, n], 8), values(&[n], 9)];
            assert_eq!(run_bits(&f, &args), run_bits(&g, &args), "{m}x{k}x{n}");
        }
    }

    /// A product that is also a result keeps its own kernel.
    #[test]
    fn a_product_used_twice_is_not_an_epilogue_input() {
        let mut f = f32_params("twice", &[&[4, 4], &[4, 4]]);
        let none = OpAttrs::new();
        let loc = Location::caller();
        let p = Value::node(
            f.add_op(&MATMUL, &none, &[Value::Param(0), Value::Param(1)], loc)
                .unwrap(),
        );
        let r = Value::node(f.add_op(&RELU, &none, &[p], loc).unwrap());
        f.results = vec![p, r];
        let g = optimize(&f, &CPU);
        assert_eq!(kernels(&g), ["MatMul", "Relu"]);
    }

    /// An SGD update of a weight by its gradient, `w - lr * reshape(xᵀ @ g)`
    /// with the identity reshape autodiff leaves: one kernel, the update
    /// the product's epilogue, with the unfused bits (the larger size
    /// splits the product into bands, each with its own epilogue).
    #[test]
    fn an_update_by_a_gradient_behind_an_identity_reshape_is_one_kernel() {
        use stagecraft_ops::{matmul_attrs, RESHAPE};
        for (batch, k, n) in [(8, 5, 6), (128, 300, 96)] {
            let mut f = f32_params("sgd", &[&[batch, k], &[batch, n], &[k, n]]);
            let none = OpAttrs::new();
            let loc = Location::caller();
            let (x, g, w) = (Value::Param(0), Value::Param(1), Value::Param(2));
            let transposed = matmul_attrs(true, false);
            let dw = Value::node(f.add_op(&MATMUL, &transposed, &[x, g], loc).unwrap());
            let mut same = OpAttrs::new();
            same.set_ints("shape", &[k as i64, n as i64]);
            let dw = Value::node(f.add_op(&RESHAPE, &same, &[dw], loc).unwrap());
            let lr = scalar(&mut f, 0.01);
            let step = Value::node(f.add_op(&MUL, &none, &[dw, lr], loc).unwrap());
            let updated = Value::node(f.add_op(&SUB, &none, &[w, step], loc).unwrap());
            f.results = vec![updated];
            let opt = optimize(&f, &CPU);
            crate::verify(&opt).unwrap();
            assert_eq!(kernels(&opt), ["FusedMatMul"], "{batch}x{k}x{n}");
            let args = [
                values(&[batch, k], 1),
                values(&[batch, n], 2),
                values(&[k, n], 3),
            ];
            assert_eq!(
                run_bits(&f, &args),
                run_bits(&opt, &args),
                "{batch}x{k}x{n}"
            );
        }
    }

    /// `g * cast(x > 0)`, the relu gradient's mask: the comparison and
    /// cast join the product in one kernel, with the unfused bits where x
    /// is NaN, ±0 or ±inf too. A comparison that is also a result stays.
    #[test]
    fn a_float_mask_is_a_fused_comparison() {
        use stagecraft_ops::{CAST, GREATER};
        let n = 1000;
        let build = |comparison_is_result: bool| {
            let meta = TensorMetadata::new(DType::F32, [n]);
            let mut f = Function::new("mask", vec![meta.clone(), meta]);
            let (x, g) = (Value::Param(0), Value::Param(1));
            let none = OpAttrs::new();
            let loc = Location::caller();
            let zero = scalar(&mut f, 0.0);
            let positive = Value::node(f.add_op(&GREATER, &none, &[x, zero], loc).unwrap());
            let mut to_f32 = OpAttrs::new();
            to_f32.set_dtype("dtype", DType::F32);
            let mask = Value::node(f.add_op(&CAST, &to_f32, &[positive], loc).unwrap());
            let masked = Value::node(f.add_op(&MUL, &none, &[g, mask], loc).unwrap());
            f.results = vec![masked];
            if comparison_is_result {
                f.results.push(positive);
            }
            f
        };
        let mut x: Vec<f32> = (0..n).map(|i| (i as f32 - 500.0) / 7.0).collect();
        x[..6].copy_from_slice(&[f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY, 1e-40]);
        let x = HostTensor::Dense(stagecraft_tensor::DenseHostTensor::from_slice(&x, [n]).unwrap());
        let args = [x, values(&[n], 4)];
        let f = build(false);
        let opt = optimize(&f, &CPU);
        crate::verify(&opt).unwrap();
        assert_eq!(kernels(&opt), ["FusedElementwise"]);
        assert_eq!(run_bits(&f, &args), run_bits(&opt, &args));
        let f = build(true);
        let opt = optimize(&f, &CPU);
        assert_eq!(kernels(&opt), ["Greater", "Cast", "Mul"]);
        assert_eq!(run_bits(&f, &args), run_bits(&opt, &args));
    }
}
