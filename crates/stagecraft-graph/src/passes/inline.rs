//! Inlining: a `Call` of a small library function is replaced by a copy of
//! the function's nodes, so that the other passes can optimize across the
//! call boundary and the executor runs the body's kernels directly instead
//! of a nested executable.
//!
//! A call is inlined when its callee is a graph function of at most
//! [`INLINE_LIMIT`] nodes; larger callees stay calls, since copying them
//! into every caller would grow the caller faster than it saves. The copy
//! reads the call's inputs where the callee read its parameters, and the
//! call's uses read the copies of the callee's results. Calls inside an
//! inlined body are considered in turn, so a chain of small functions
//! flattens completely; the result is no larger than the number of nodes
//! the call tree runs (no loop is ever unrolled: `While` and `If` bodies
//! are left to their own optimization).
//!
//! Copied nodes keep their own locations, so a failure inside the callee is
//! still reported at the callee's source line; they lose any origin, which
//! indexes the recording of a lazy trace the callee is not part of. A
//! copied node without a placement takes the call's: the callee would have
//! run where the call ran.

use super::outputs_of;
use crate::{Function, Node, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::{AttrValue, ControlOp, FuncId, OpKind};
use std::sync::Arc;

/// The most nodes a callee may have to be inlined.
pub const INLINE_LIMIT: usize = 64;

/// Returns `f` with its calls of small functions (and theirs, in turn)
/// inlined (see the [module docs](self)).
pub fn inline_calls(f: &Function) -> Function {
    run(f).0
}

/// [`inline_calls`], also returning how many calls were inlined.
pub(crate) fn run(f: &Function) -> (Function, usize) {
    let mut out = Function::new(f.name.clone(), f.params.clone());
    out.nodes.reserve(f.nodes.len());
    let params: Vec<Value> = (0..f.params.len() as u32).map(Value::Param).collect();
    let mut inliner = Inliner {
        out,
        active: Vec::new(),
        inlined: 0,
    };
    let results = inliner.splice(f, &params, None);
    inliner.out.results = results.into_vec();
    (inliner.out, inliner.inlined)
}

struct Inliner {
    out: Function,
    /// The functions being spliced in right now, outermost first: a call of
    /// one of them is left as a call, so that recursion (which the library
    /// cannot express today) could not inline forever.
    active: Vec<FuncId>,
    inlined: usize,
}

impl Inliner {
    /// Appends copies of `f`'s nodes, reading `args` for its parameters and
    /// giving nodes without a placement `device`; returns the new values of
    /// `f`'s results.
    fn splice(
        &mut self,
        f: &Function,
        args: &[Value],
        device: Option<&str>,
    ) -> SmallVec<[Value; 1]> {
        let mut map: Vec<SmallVec<[Value; 1]>> = Vec::with_capacity(f.nodes.len());
        let value = |map: &[SmallVec<[Value; 1]>], v: Value| match v {
            Value::Param(i) => args[i as usize],
            Value::Output { node, output } => map[node as usize][output as usize],
        };
        for node in &f.nodes {
            let mut copy = node.clone();
            for v in &mut copy.inputs {
                *v = value(&map, *v);
            }
            if copy.device.is_none() {
                copy.device = device.map(str::to_owned);
            }
            if !self.active.is_empty() {
                // A callee's node is no entry of the caller's recording: it
                // is reported at the callee's own location.
                copy.origin = None;
            }
            let outputs = self.emit(copy);
            map.push(outputs);
        }
        f.results.iter().map(|&v| value(&map, v)).collect()
    }

    /// Appends `node` (its inputs already values of the new function), or
    /// its callee's body if it is an inlinable call; returns the values of
    /// its outputs.
    fn emit(&mut self, node: Node) -> SmallVec<[Value; 1]> {
        let Some((id, callee)) = self.inlinable(&node) else {
            let count = node.outputs.len();
            let index = self.out.push(node);
            return outputs_of(index, count);
        };
        self.active.push(id);
        let outputs = self.splice(&callee, &node.inputs, node.device.as_deref());
        self.active.pop();
        self.inlined += 1;
        outputs
    }

    /// The callee of `node` if it is a call to inline.
    fn inlinable(&self, node: &Node) -> Option<(FuncId, Arc<Function>)> {
        let NodeOp::Op(def, attrs) = &node.op else {
            return None;
        };
        if def.kind != OpKind::Control(ControlOp::Call) {
            return None;
        }
        let Some(AttrValue::Func(id)) = attrs.get("f") else {
            return None;
        };
        if self.active.contains(&id) {
            return None;
        }
        let callee = Function::lookup(id)?;
        // The op's metadata function checked the signature; a callee that
        // disagrees anyway is left for the verifier and executor to report.
        let fits = callee.nodes.len() <= INLINE_LIMIT
            && callee.params.len() == node.inputs.len()
            && callee.result_metas().as_slice() == node.outputs.as_slice();
        fits.then_some((id, callee))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{bits, eval, loc, meta, pure_dag};
    use super::*;
    use crate::text::print;
    use proptest::prelude::*;
    use stagecraft_cpu::CONSTANT_KERNELS as CPU;
    use stagecraft_ops::{self as ops, OpAttrs};
    use stagecraft_tensor::{DType, DenseHostTensor, HostTensor, TensorMetadata};

    fn names(f: &Function) -> Vec<&'static str> {
        f.nodes.iter().map(|n| n.op.name()).collect()
    }

    fn inlined(f: &Function) -> (Function, usize) {
        let (g, n) = run(f);
        crate::verify(&g).unwrap_or_else(|e| panic!("{e}\n{}", print(&g)));
        (g, n)
    }

    fn call_attrs(id: FuncId) -> OpAttrs {
        let mut attrs = OpAttrs::new();
        attrs.set_func("f", id);
        attrs
    }

    fn input(values: &[f32]) -> HostTensor {
        DenseHostTensor::from_slice(values, [values.len()])
            .unwrap()
            .into()
    }

    /// `@scale_shift(a, b) -> (a*b + a, b)`: two results, one of them a
    /// parameter.
    fn scale_shift() -> FuncId {
        let none = OpAttrs::new();
        let mut callee = Function::new("scale_shift", vec![meta(&[3]), meta(&[3])]);
        let m = callee
            .add_op(
                &ops::MUL,
                &none,
                &[Value::Param(0), Value::Param(1)],
                loc(100),
            )
            .unwrap();
        let s = callee
            .add_op(
                &ops::ADD,
                &none,
                &[Value::node(m), Value::Param(0)],
                loc(101),
            )
            .unwrap();
        callee.results = vec![Value::node(s), Value::Param(1)];
        callee.register()
    }

    /// A callee's nodes are no entries of the caller's lazy trace: once
    /// inlined they lose any origin (and report their own location), while
    /// the caller's nodes keep theirs.
    #[test]
    fn inlined_nodes_have_no_origin() {
        let none = OpAttrs::new();
        let mut callee = Function::new("neg_with_origin", vec![meta(&[3])]);
        let n = callee
            .add_op(&ops::NEG, &none, &[Value::Param(0)], loc(100))
            .unwrap();
        callee.nodes[n].origin = Some(0);
        callee.results = vec![Value::node(n)];
        let id = callee.register();
        let mut f = Function::new("caller", vec![meta(&[3])]);
        let e = f
            .add_op(&ops::EXP, &none, &[Value::Param(0)], loc(1))
            .unwrap();
        let call = f
            .add_op(&ops::CALL, &call_attrs(id), &[Value::node(e)], loc(2))
            .unwrap();
        for (i, node) in f.nodes.iter_mut().enumerate() {
            node.origin = Some(i as u32);
        }
        f.results = vec![Value::node(call)];
        let (g, count) = inlined(&f);
        assert_eq!(count, 1);
        assert_eq!(names(&g), ["Exp", "Neg"]);
        assert_eq!(g.nodes[0].origin, Some(0));
        assert_eq!(g.nodes[1].origin, None);
        assert_eq!(g.nodes[1].location, loc(100));
    }

    #[test]
    fn splices_the_callee_in() {
        let id = scale_shift();
        let mut f = Function::new("caller", vec![meta(&[3]), meta(&[3])]);
        let none = OpAttrs::new();
        let e = f
            .add_op(&ops::EXP, &none, &[Value::Param(1)], loc(1))
            .unwrap();
        let call = f
            .add_op(
                &ops::CALL,
                &call_attrs(id),
                &[Value::node(e), Value::Param(0)],
                loc(2),
            )
            .unwrap();
        let out = |output| Value::Output {
            node: call as u32,
            output,
        };
        let n = f.add_op(&ops::NEG, &none, &[out(0)], loc(3)).unwrap();
        f.results = vec![Value::node(n), out(1), out(0)];
        let (g, count) = inlined(&f);
        assert_eq!(count, 1);
        assert_eq!(names(&g), ["Exp", "Mul", "Add", "Neg"]);
        assert_eq!(
            g.nodes[1].inputs.as_slice(),
            [Value::node(0), Value::Param(0)]
        );
        assert_eq!(
            g.nodes[2].inputs.as_slice(),
            [Value::node(1), Value::node(0)]
        );
        // The callee's own locations, not the call's.
        assert_eq!(g.nodes[1].location, loc(100));
        assert_eq!(g.nodes[2].location, loc(101));
        assert_eq!(
            g.results,
            vec![Value::node(3), Value::Param(0), Value::node(2)]
        );
        let args = [input(&[1.0, 2.0, 3.0]), input(&[0.5, -1.0, 0.0])];
        assert_eq!(
            bits(&eval(&f, &args).unwrap()),
            bits(&eval(&g, &args).unwrap())
        );
    }

    #[test]
    fn flattens_nested_calls_and_places_copies_where_the_call_ran() {
        let inner = scale_shift();
        let none = OpAttrs::new();
        let mut middle = Function::new("middle", vec![meta(&[3])]);
        let c = middle
            .add_op(
                &ops::CALL,
                &call_attrs(inner),
                &[Value::Param(0), Value::Param(0)],
                loc(200),
            )
            .unwrap();
        let mut placed = middle
            .add_op(&ops::SIN, &none, &[Value::node(c)], loc(201))
            .unwrap();
        middle.nodes[placed].device = Some("cpu:2".into());
        placed = middle
            .add_op(&ops::COS, &none, &[Value::node(placed)], loc(202))
            .unwrap();
        middle.results = vec![Value::node(placed)];
        let middle = middle.register();
        let mut f = Function::new("outer", vec![meta(&[3])]);
        let call = f
            .add_op(&ops::CALL, &call_attrs(middle), &[Value::Param(0)], loc(3))
            .unwrap();
        f.nodes[call].device = Some("cpu:1".into());
        f.results = vec![Value::node(call)];
        let (g, count) = inlined(&f);
        assert_eq!(count, 2);
        assert_eq!(names(&g), ["Mul", "Add", "Sin", "Cos"]);
        let devices: Vec<Option<&str>> = g.nodes.iter().map(|n| n.device.as_deref()).collect();
        assert_eq!(
            devices,
            [Some("cpu:1"), Some("cpu:1"), Some("cpu:2"), Some("cpu:1")]
        );
        let args = [input(&[1.0, 2.0, 3.0])];
        assert_eq!(
            bits(&eval(&f, &args).unwrap()),
            bits(&eval(&g, &args).unwrap())
        );
    }

    #[test]
    fn leaves_large_callees_and_other_control_flow_alone() {
        let none = OpAttrs::new();
        let chain = |name: &str, len: usize| {
            let mut callee = Function::new(name, vec![meta(&[3])]);
            let mut v = Value::Param(0);
            for i in 0..len {
                v = Value::node(
                    callee
                        .add_op(&ops::NEG, &none, &[v], loc(i as u32))
                        .unwrap(),
                );
            }
            callee.results = vec![v];
            callee.register()
        };
        let fits = chain("fits", INLINE_LIMIT);
        let too_big = chain("too_big", INLINE_LIMIT + 1);
        let mut f = Function::new(
            "limits",
            vec![meta(&[3]), TensorMetadata::new(DType::Bool, [])],
        );
        let a = f
            .add_op(&ops::CALL, &call_attrs(fits), &[Value::Param(0)], loc(1))
            .unwrap();
        let b = f
            .add_op(&ops::CALL, &call_attrs(too_big), &[Value::node(a)], loc(2))
            .unwrap();
        let mut branches = OpAttrs::new();
        branches
            .set_func("then_branch", fits)
            .set_func("else_branch", fits);
        let c = f
            .add_op(
                &ops::IF,
                &branches,
                &[Value::Param(1), Value::node(b)],
                loc(3),
            )
            .unwrap();
        f.results = vec![Value::node(c)];
        let (g, count) = inlined(&f);
        assert_eq!(count, 1);
        assert_eq!(g.nodes.len(), INLINE_LIMIT + 2);
        assert_eq!(names(&g)[INLINE_LIMIT..], ["Call", "If"]);
    }

    #[test]
    fn inlined_prints_are_kept() {
        let mut noisy = Function::new("inline_noisy", vec![meta(&[3])]);
        noisy
            .add_op(&ops::PRINT, &OpAttrs::new(), &[Value::Param(0)], loc(1))
            .unwrap();
        noisy.results = vec![Value::Param(0)];
        let noisy = noisy.register();
        let mut f = Function::new("inline_print", vec![meta(&[3])]);
        f.add_op(&ops::CALL, &call_attrs(noisy), &[Value::Param(0)], loc(2))
            .unwrap();
        f.results = vec![Value::Param(0)];
        let g = super::super::optimize(&f, &CPU);
        crate::verify(&g).unwrap();
        assert_eq!(names(&g), ["Print"]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// A random DAG called twice (once on its parameters, once on
        /// values computed from them) computes the same after inlining.
        #[test]
        fn inlining_preserves_results((body, args) in pure_dag()) {
            let metas = body.params.clone();
            let id = body.clone().register();
            let mut f = Function::new("twice", metas.clone());
            let params: Vec<Value> = (0..metas.len() as u32).map(Value::Param).collect();
            let first = f.add_op(&ops::CALL, &call_attrs(id), &params, loc(1)).unwrap();
            let shifted: Vec<Value> = params
                .iter()
                .map(|&p| Value::node(f.add_op(&ops::EXP, &OpAttrs::new(), &[p], loc(2)).unwrap()))
                .collect();
            let second = f.add_op(&ops::CALL, &call_attrs(id), &shifted, loc(3)).unwrap();
            let results = body.results.len() as u32;
            f.results = (0..results)
                .flat_map(|output| {
                    [first, second].map(|node| Value::Output { node: node as u32, output })
                })
                .collect();
            let (g, count) = inlined(&f);
            prop_assert_eq!(count, 2);
            prop_assert_eq!(g.nodes.len(), 2 * body.nodes.len() + metas.len());
            prop_assert_eq!(bits(&eval(&f, &args).unwrap()), bits(&eval(&g, &args).unwrap()));
        }
    }
}
