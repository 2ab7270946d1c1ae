//! Constant folding: an op whose inputs are all constants is run once, now,
//! by a device's [`ConstantKernels`] (the CPU's, from the runtime), and
//! replaced by constants holding its outputs. The pass knows no device
//! crate: the kernels come through that interface.
//!
//! A node is folded only when doing so cannot change what the function
//! does or make it much bigger:
//! - the op is pure and not control flow (a side-effecting op must run
//!   every time; the functions that control-flow ops run are left to their
//!   own optimization). Counter-based random ops are pure and fold like any
//!   other: their values depend on their attributes alone;
//! - its output shapes are static, because a data-dependent op's recorded
//!   metadata has placeholder dimensions that the nodes using it were
//!   inferred against;
//! - its outputs hold at most [`FOLD_LIMIT`] elements in all, since a
//!   folded constant lives in the function (and its text) for good;
//! - it runs on the device whose kernels fold it (no placement, or one of
//!   that device's kind), so the bits cannot differ;
//! - the kernel succeeds. A kernel error (an integer division by zero, say)
//!   leaves the node as it is, so that the error is reported when the
//!   function runs, at the node's location, like any other.
//!
//! A folded constant keeps the node's location, origin and placement. Constants
//! whose elements are all the same value are stored as a broadcast scalar,
//! so that folding a large `Fill` costs one value rather than a buffer —
//! but only when the scalar expands back to exactly the same bytes.

use super::{outputs_of, Rebuilder};
use crate::{Function, Node, NodeOp, Value};
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::{Attrs, ConstantKernels, Effect, OpKind, ShapeKind};
use stagecraft_tensor::{DenseHostTensor, HostTensor, ScalarHostTensor};

/// The most elements (over all outputs) that one folded node may produce.
pub const FOLD_LIMIT: usize = 1 << 16;

/// Replaces every foldable op of constants (see the [module docs](self))
/// by constants, in one forward pass: a folded node's constants feed the
/// nodes after it, so chains of constant arithmetic fold completely. The
/// constants the folded nodes consumed stay; [`super::dce()`] removes them
/// once nothing uses them.
pub fn fold_constants(f: &Function, kernels: &dyn ConstantKernels) -> Function {
    run(f, kernels).0
}

/// [`fold_constants`], also returning how many nodes were folded.
pub(crate) fn run(f: &Function, kernels: &dyn ConstantKernels) -> (Function, usize) {
    let mut b = Rebuilder::new(f);
    let mut folded = 0;
    for node in &f.nodes {
        let node = b.remapped(node);
        match evaluate(b.built(), &node, kernels) {
            Some(values) => {
                let outputs = values
                    .into_iter()
                    .map(|value| {
                        let meta = value.metadata().clone();
                        Value::node(b.push(Node {
                            op: NodeOp::Const(value),
                            inputs: SmallVec::new(),
                            outputs: smallvec![meta],
                            device: node.device.clone(),
                            location: node.location,
                            origin: node.origin,
                        }))
                    })
                    .collect();
                b.bind(outputs);
                folded += 1;
            }
            None => {
                let count = node.outputs.len();
                let index = b.push(node);
                b.bind(outputs_of(index, count));
            }
        }
    }
    (b.finish(), folded)
}

/// The outputs of `node` (whose inputs are values of `g`) if it can be
/// folded, `None` otherwise.
fn evaluate(
    g: &Function,
    node: &Node,
    kernels: &dyn ConstantKernels,
) -> Option<SmallVec<[HostTensor; 1]>> {
    let NodeOp::Op(def, attrs) = &node.op else {
        return None;
    };
    if def.effect != Effect::Pure
        || matches!(def.kind, OpKind::Control(_))
        || def.shape_kind != ShapeKind::Static
        || !placed_on(node.device.as_deref(), kernels.device_kind())
    {
        return None;
    }
    let mut elements = 0usize;
    for meta in &node.outputs {
        elements = elements.checked_add(meta.shape.checked_numel().ok()?)?;
    }
    if elements > FOLD_LIMIT {
        return None;
    }
    let inputs: SmallVec<[DenseHostTensor; 4]> = node
        .inputs
        .iter()
        .map(|&v| constant(g, v)?.to_dense().ok())
        .collect::<Option<_>>()?;
    let outputs = kernels.evaluate(def, &Attrs::new(attrs, def), &inputs, &node.outputs)?;
    let dense: Option<Vec<DenseHostTensor>> = outputs.iter().map(|t| t.to_dense().ok()).collect();
    Some(dense?.into_iter().map(compact).collect())
}

/// The constant behind `v`, if a constant node produces it.
fn constant(g: &Function, v: Value) -> Option<&HostTensor> {
    let Value::Output { node, output: 0 } = v else {
        return None;
    };
    match &g.nodes[node as usize].op {
        NodeOp::Const(t) => Some(t),
        NodeOp::Op(..) => None,
    }
}

/// True for no placement or one of the device `kind` (`cpu`, `cpu:N`).
fn placed_on(device: Option<&str>, kind: &str) -> bool {
    device.is_none_or(|d| d.trim().split(':').next() == Some(kind))
}

/// A broadcast scalar when every element is the same value and the scalar
/// expands to the very same bytes (it does not for `-0.0`, which expands
/// to `+0.0`); the dense tensor otherwise.
fn compact(t: DenseHostTensor) -> HostTensor {
    let bytes = t.buffer().bytes();
    let width = t.dtype().size_in_bytes();
    let Some(first) = bytes.get(..width) else {
        return t.into();
    };
    if width == 0 || !bytes.chunks_exact(width).all(|e| e == first) {
        return t.into();
    }
    let Some(value) = t.get_scalar(0) else {
        return t.into();
    };
    let expands_exactly = ScalarHostTensor::new(value, [1])
        .to_dense()
        .is_ok_and(|d| d.buffer().bytes() == first);
    if expands_exactly {
        ScalarHostTensor::new(value, t.shape().clone()).into()
    } else {
        t.into()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{bits, eval, loc, meta, pure_dag, run_bits};
    use super::*;
    use crate::text::{parse, print};
    use proptest::prelude::*;
    use stagecraft_ops::{self as ops, OpAttrs};
    use stagecraft_tensor::Scalar;

    fn names(f: &Function) -> Vec<&'static str> {
        f.nodes.iter().map(|n| n.op.name()).collect()
    }

    fn folded(f: &Function) -> (Function, usize) {
        let (g, n) = run(f, &stagecraft_cpu::CONSTANT_KERNELS);
        crate::verify(&g).unwrap_or_else(|e| panic!("{e}\n{}", print(&g)));
        (g, n)
    }

    #[test]
    fn folds_chains_of_constant_arithmetic() {
        let f = parse(
            r#"@chain(%x: f32[2]) -> (f32[2]) {
  %a = Const[dtype: f32, shape: [2], values: [1.0, 2.0]]()
  %b = Const[dtype: f32, value: 3.0]()
  %c = Mul(%a, %b)
  %d = Neg(%c)
  %e = Add(%x, %d)
  return (%e)
}"#,
        )
        .unwrap();
        let (g, n) = folded(&f);
        assert_eq!(n, 2);
        assert_eq!(names(&g), ["Const", "Const", "Const", "Const", "Add"]);
        let NodeOp::Const(d) = &g.nodes[3].op else {
            unreachable!()
        };
        assert_eq!(
            d.to_dense().unwrap().to_vec::<f32>().unwrap(),
            vec![-3.0, -6.0]
        );
        // The constant keeps the location of the node it replaces.
        assert_eq!(g.nodes[3].location, f.nodes[3].location);
        assert_eq!(g.results, vec![Value::node(4)]);
        assert_eq!(g.nodes[4].inputs[1], Value::node(3));
        let x = DenseHostTensor::from_slice(&[0.25f32, 8.0], [2]).unwrap();
        assert_eq!(run_bits(&f, &[x.clone().into()]), run_bits(&g, &[x.into()]));
    }

    #[test]
    fn folds_ops_without_inputs_and_random_ops() {
        let none = OpAttrs::new();
        let mut f = Function::new("sources", vec![]);
        let mut fill = OpAttrs::new();
        fill.set_ints("shape", &[4, 4])
            .set_scalar("value", Scalar::F32(1.5));
        let a = f.add_op(&ops::FILL, &fill, &[], loc(1)).unwrap();
        let mut random = OpAttrs::new();
        random.set_ints("shape", &[4, 4]).set_int("seed", 7);
        let r = f
            .add_op(&ops::RANDOM_UNIFORM, &random, &[], loc(2))
            .unwrap();
        let s = f
            .add_op(&ops::ADD, &none, &[Value::node(a), Value::node(r)], loc(3))
            .unwrap();
        f.results = vec![Value::node(s)];
        let (g, n) = folded(&f);
        assert_eq!(n, 3);
        assert_eq!(names(&g), ["Const"; 3]);
        // A uniform fill folds to one broadcast value, not a buffer.
        assert!(matches!(
            &g.nodes[0].op,
            NodeOp::Const(HostTensor::Scalar(_))
        ));
        assert!(matches!(
            &g.nodes[2].op,
            NodeOp::Const(HostTensor::Dense(_))
        ));
        assert_eq!(run_bits(&f, &[]), run_bits(&g, &[]));
    }

    #[test]
    fn leaves_large_outputs_alone() {
        let mut f = Function::new("large", vec![]);
        let mut small = OpAttrs::new();
        small
            .set_ints("shape", &[FOLD_LIMIT as i64])
            .set_scalar("value", Scalar::F32(1.0));
        let mut large = OpAttrs::new();
        large
            .set_ints("shape", &[FOLD_LIMIT as i64 + 1])
            .set_scalar("value", Scalar::F32(1.0));
        let a = f.add_op(&ops::FILL, &small, &[], loc(1)).unwrap();
        let b = f.add_op(&ops::FILL, &large, &[], loc(2)).unwrap();
        f.results = vec![Value::node(a), Value::node(b)];
        let (g, n) = folded(&f);
        assert_eq!(n, 1);
        assert_eq!(names(&g), ["Const", "Fill"]);
    }

    #[test]
    fn leaves_parameters_effects_and_data_dependent_shapes_alone() {
        let f = parse(
            r#"@kept(%x: f32[3]) -> (f32[3], f32[3], i64[0,1]) {
  %c = Const[dtype: f32, shape: [3], values: [1.0, 0.0, 2.0]]()
  %a = Add(%x, %c)
  %p = Print[label: "c"](%c)
  %n = Nonzero(%c)
  return (%a, %p, %n)
}"#,
        )
        .unwrap();
        let (g, n) = folded(&f);
        assert_eq!(n, 0);
        assert_eq!(names(&g), names(&f));
    }

    #[test]
    fn kernel_errors_leave_the_node_to_fail_at_run_time() {
        let f = parse(
            r#"@div(%x: i32[2]) -> (i32[2]) {
  %a = Const[dtype: i32, shape: [2], values: [4, 5]]()
  %b = Const[dtype: i32, shape: [2], values: [2, 0]]()
  %c = Div(%a, %b)
  return (%c)
}"#,
        )
        .unwrap();
        let (g, n) = folded(&f);
        assert_eq!(n, 0);
        assert_eq!(names(&g), ["Const", "Const", "Div"]);
        assert!(eval(&g, &[]).is_err());
    }

    #[test]
    fn respects_placements() {
        let mut f = parse(
            r#"@placed() -> (f32[], f32[], f32[]) {
  %a = Const[dtype: f32, value: 2.0]()
  %b = Neg(%a) device "cpu:1"
  %c = Neg(%a) device "gpu:0"
  %d = Neg(%a)
  return (%b, %c, %d)
}"#,
        )
        .unwrap();
        f.nodes[0].device = Some("cpu".into());
        let (g, n) = folded(&f);
        assert_eq!(n, 2);
        assert_eq!(names(&g), ["Const", "Const", "Neg", "Const"]);
        assert_eq!(g.nodes[1].device.as_deref(), Some("cpu:1"));
    }

    #[test]
    fn negative_zero_stays_dense() {
        let f = parse(
            r#"@nz() -> (f32[2]) {
  %a = Const[dtype: f32, shape: [2], values: [0.0, 0.0]]()
  %b = Neg(%a)
  return (%b)
}"#,
        )
        .unwrap();
        let (g, _) = folded(&f);
        assert!(matches!(&g.nodes[1].op, NodeOp::Const(_)));
        // Folded -0.0 keeps its sign bit, dense or compacted.
        assert_eq!(run_bits(&f, &[]), run_bits(&g, &[]));
        let one = DenseHostTensor::from_slice(&[3i64], []).unwrap();
        assert!(matches!(compact(one), HostTensor::Scalar(_)));
        let empty = DenseHostTensor::zeros(meta(&[0])).unwrap();
        assert!(matches!(compact(empty), HostTensor::Dense(_)));
    }

    /// Found by the property below: `NaN * -NaN` gives a NaN of another
    /// sign when the kernel writes into its input's buffer, so folding must
    /// not hand the kernel buffers it could write into.
    #[test]
    fn nan_signs_match_the_unfolded_function() {
        let f = parse(
            r#"@nans() -> (f32[]) {
  %a = Const[dtype: f32, value: NaN]()
  %b = Neg(%a)
  %c = Mul(%a, %b)
  return (%c)
}"#,
        )
        .unwrap();
        let (g, n) = folded(&f);
        assert_eq!(n, 2);
        assert_eq!(run_bits(&f, &[]), run_bits(&g, &[]));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn folding_preserves_results((f, args) in pure_dag()) {
            let (g, _) = folded(&f);
            prop_assert_eq!(g.nodes.len(), f.nodes.len());
            prop_assert_eq!(bits(&eval(&f, &args).unwrap()), bits(&eval(&g, &args).unwrap()));
        }
    }
}
