//! Common-subexpression elimination: a node that computes what an earlier
//! node already computed is dropped, and its uses read the earlier node.
//!
//! Two op nodes are the same computation when they have the same op, equal
//! attributes, the same inputs and the same placement, and the op is pure
//! (see [`super::has_side_effects`]: two `Print`s print twice). Two
//! constants are the same when they have the same placement and
//! bit-identical values of the same kind: dense constants with equal
//! metadata and bytes, or broadcast scalars with equal metadata and
//! [`Scalar::to_bits`](stagecraft_tensor::Scalar::to_bits). Comparing bits
//! rather than values keeps `0.0` and `-0.0` apart and lets a NaN constant
//! merge with itself. A dense and a scalar constant are never merged even
//! when their elements agree, so that a function's constants (and the
//! results that are constants) keep the form they were given.
//!
//! The earliest node of a class is the one kept, with its location. Since
//! nodes are in topological order and every node's inputs are rewritten to
//! their class's node before it is looked up, one forward pass reaches the
//! fixed point: after `a = x+y; b = x+y`, `exp(a)` and `exp(b)` have the
//! same inputs by the time they are compared.

use super::{outputs_of, Effects, Rebuilder};
use crate::{Function, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::{FrozenOpAttrs, OpDef};
use stagecraft_tensor::{Buffer, HostTensor, TensorMetadata};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Returns `f` with every repeated computation merged into its first
/// occurrence (see the [module docs](self)). Nodes that become unused
/// are dropped here, since nothing can refer to them any more.
pub fn cse(f: &Function) -> Function {
    run(f).0
}

/// [`cse`], also returning how many nodes were merged away.
pub(crate) fn run(f: &Function) -> (Function, usize) {
    let mut effects = Effects::default();
    let mut b = Rebuilder::new(f);
    let mut seen: HashMap<Key, usize> = HashMap::new();
    let mut merged = 0;
    for node in &f.nodes {
        let node = b.remapped(node);
        let key = if effects.of(&node.op) {
            None
        } else {
            Some(Key::of(&node.op, &node.inputs, &node.device))
        };
        if let Some(&earlier) = key.as_ref().and_then(|k| seen.get(k)) {
            b.bind(outputs_of(earlier, node.outputs.len()));
            merged += 1;
            continue;
        }
        let count = node.outputs.len();
        let index = b.push(node);
        if let Some(key) = key {
            seen.insert(key, index);
        }
        b.bind(outputs_of(index, count));
    }
    (b.finish(), merged)
}

/// What makes two nodes the same computation.
#[derive(PartialEq, Eq, Hash)]
enum Key {
    Op {
        def: &'static OpDef,
        attrs: FrozenOpAttrs,
        inputs: SmallVec<[Value; 4]>,
        device: Option<String>,
    },
    Dense {
        meta: TensorMetadata,
        bytes: Bytes,
        device: Option<String>,
    },
    List {
        identity: usize,
        device: Option<String>,
    },
    Scalar {
        meta: TensorMetadata,
        bits: u64,
        device: Option<String>,
    },
}

impl Key {
    fn of(op: &NodeOp, inputs: &[Value], device: &Option<String>) -> Key {
        let device = device.clone();
        match op {
            NodeOp::Op(def, attrs) => Key::Op {
                def,
                attrs: attrs.clone(),
                inputs: inputs.iter().copied().collect(),
                device,
            },
            NodeOp::Const(HostTensor::Dense(t)) => Key::Dense {
                meta: t.metadata().clone(),
                bytes: Bytes(t.buffer().clone()),
                device,
            },
            NodeOp::Const(HostTensor::List(list)) => Key::List {
                identity: list.identity(),
                device,
            },
            NodeOp::Const(HostTensor::Scalar(t)) => Key::Scalar {
                meta: t.metadata().clone(),
                bits: t.value().to_bits(),
                device,
            },
        }
    }
}

/// A constant's buffer, compared and hashed by its bytes; sharing the
/// buffer rather than copying the bytes keeps large constants cheap to key.
struct Bytes(Buffer);

impl PartialEq for Bytes {
    fn eq(&self, other: &Bytes) -> bool {
        self.0.ptr_eq(&other.0) || self.0.bytes() == other.0.bytes()
    }
}

impl Eq for Bytes {}

impl Hash for Bytes {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.bytes().hash(state);
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{bits, eval, loc, meta, pure_dag};
    use super::*;
    use crate::text::{parse, print};
    use proptest::prelude::*;
    use stagecraft_ops::{self as ops, OpAttrs};
    use stagecraft_tensor::{DenseHostTensor, Scalar, ScalarHostTensor};

    fn names(f: &Function) -> Vec<&'static str> {
        f.nodes.iter().map(|n| n.op.name()).collect()
    }

    fn merged(f: &Function) -> (Function, usize) {
        let (g, n) = run(f);
        crate::verify(&g).unwrap_or_else(|e| panic!("{e}\n{}", print(&g)));
        (g, n)
    }

    #[test]
    fn merges_repeated_expressions_transitively() {
        let f = parse(
            r#"@rep(%x: f32[3], %y: f32[3]) -> (f32[3]) {
  %a = Add(%x, %y)
  %b = Add(%x, %y)
  %c = Exp(%a)
  %d = Exp(%b)
  %e = Add(%y, %x)
  %f = Mul(%c, %d)
  %g = Mul(%f, %e)
  return (%g)
}"#,
        )
        .unwrap();
        let (g, n) = merged(&f);
        assert_eq!(n, 2);
        // Add(%y, %x) is not Add(%x, %y): CSE does not know that Add
        // commutes.
        assert_eq!(names(&g), ["Add", "Exp", "Add", "Mul", "Mul"]);
        assert_eq!(
            g.nodes[3].inputs.as_slice(),
            [Value::node(1), Value::node(1)]
        );
        assert_eq!(g.nodes[0].location, f.nodes[0].location);
    }

    #[test]
    fn attributes_and_placement_must_agree() {
        let f = parse(
            r#"@attrs(%x: f32[2,3]) -> (f32[2], f32[2], f32[3], f32[2], f32[2]) {
  %a = Sum[axes: [1]](%x)
  %b = Sum[axes: [1]](%x)
  %c = Sum[axes: [0]](%x)
  %d = Sum[axes: [1]](%x) device "cpu:1"
  %e = Sum[axes: [1]](%x) device "cpu:1"
  return (%a, %b, %c, %d, %e)
}"#,
        )
        .unwrap();
        let (g, n) = merged(&f);
        assert_eq!(n, 2);
        assert_eq!(names(&g), ["Sum", "Sum", "Sum"]);
        assert_eq!(
            g.results,
            [0, 0, 1, 2, 2].map(Value::node).to_vec(),
            "{}",
            print(&g)
        );
    }

    #[test]
    fn merges_bit_identical_constants_only() {
        let mut f = Function::new("consts", vec![]);
        let dense =
            |v: &[f32]| -> HostTensor { DenseHostTensor::from_slice(v, [v.len()]).unwrap().into() };
        let scalar = |v: f32| -> HostTensor { ScalarHostTensor::new(Scalar::F32(v), []).into() };
        let nan = f32::from_bits(0x7fc0_0001);
        let consts = [
            dense(&[1.0, 2.0]),                                  // 0
            dense(&[1.0, 2.0]),                                  // 1: = 0
            dense(&[1.0, 2.5]),                                  // 2
            scalar(0.0),                                         // 3
            scalar(-0.0),                                        // 4: not 0.0
            scalar(nan),                                         // 5
            scalar(nan),                                         // 6: = 5
            scalar(f32::NAN),                                    // 7: another NaN payload
            dense(&[0.0]),                                       // 8: dense, not scalar 3
            ScalarHostTensor::new(Scalar::F32(0.0), [1]).into(), // 9: f32[1], not 3
            ScalarHostTensor::new(Scalar::F64(0.0), []).into(),  // 10: f64, not 3
        ];
        for (i, c) in consts.into_iter().enumerate() {
            f.add_const(c, loc(i as u32));
        }
        f.results = (0..f.nodes.len()).map(Value::node).collect();
        let (g, n) = merged(&f);
        assert_eq!(n, 2);
        assert_eq!(g.nodes.len(), 9);
        assert_eq!(g.results[1], Value::node(0));
        // Node 1 is gone, so node 5 is now node 4.
        assert_eq!(g.results[5..7], [Value::node(4), Value::node(4)]);
        assert_eq!(g.nodes[4].location, loc(5));
        assert_eq!(bits(&eval(&f, &[]).unwrap()), bits(&eval(&g, &[]).unwrap()));
    }

    #[test]
    fn never_merges_side_effects() {
        let f = parse(
            r#"@prints(%x: f32[3]) -> (f32[3]) {
  %p = Print[label: "x"](%x)
  %q = Print[label: "x"](%x)
  %a = Neg(%p)
  %b = Neg(%q)
  %c = Add(%a, %b)
  return (%c)
}"#,
        )
        .unwrap();
        let (g, n) = merged(&f);
        assert_eq!(n, 0);
        assert_eq!(names(&g), names(&f));
    }

    #[test]
    fn merges_calls_of_pure_functions_only() {
        let mut quiet = Function::new("cse_quiet", vec![meta(&[3])]);
        let e = quiet
            .add_op(&ops::EXP, &OpAttrs::new(), &[Value::Param(0)], loc(1))
            .unwrap();
        quiet.results = vec![Value::node(e)];
        let quiet = quiet.register();
        let mut noisy = Function::new("cse_noisy", vec![meta(&[3])]);
        let p = noisy
            .add_op(&ops::PRINT, &OpAttrs::new(), &[Value::Param(0)], loc(1))
            .unwrap();
        noisy.results = vec![Value::node(p)];
        let noisy = noisy.register();
        let mut f = Function::new("cse_calls", vec![meta(&[3])]);
        for id in [quiet, quiet, noisy, noisy] {
            let mut attrs = OpAttrs::new();
            attrs.set_func("f", id);
            let c = f
                .add_op(&ops::CALL, &attrs, &[Value::Param(0)], loc(2))
                .unwrap();
            f.results.push(Value::node(c));
        }
        let (g, n) = merged(&f);
        assert_eq!(n, 1);
        assert_eq!(g.nodes.len(), 3);
        assert_eq!(g.results[..2], [Value::node(0), Value::node(0)]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn cse_preserves_results((f, args) in pure_dag()) {
            let (g, n) = merged(&f);
            prop_assert_eq!(g.nodes.len() + n, f.nodes.len());
            prop_assert_eq!(bits(&eval(&f, &args).unwrap()), bits(&eval(&g, &args).unwrap()));
            let prints = |f: &Function| f.nodes.iter().filter(|n| n.op.name() == "Print").count();
            prop_assert_eq!(prints(&f), prints(&g));
            let (_, again) = run(&g);
            prop_assert_eq!(again, 0);
        }
    }
}
