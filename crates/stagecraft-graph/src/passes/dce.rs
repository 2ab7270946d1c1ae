//! Dead-code elimination: drops the nodes that no result depends on.
//!
//! A node with side effects (see [`super::has_side_effects`]) is live even
//! when nothing uses its outputs, and so is everything it reads: dropping
//! a `Print` would lose its line. The surviving nodes keep their relative
//! order, so the function stays topologically ordered, and are renumbered
//! densely. Parameters are never dropped, since they are the function's
//! signature.

use super::{Effects, Rebuilder};
use crate::{Function, Value};

/// Returns `f` without its dead nodes (see the [module docs](self)).
pub fn dce(f: &Function) -> Function {
    run(f).0
}

/// [`dce`], also returning how many nodes were dropped.
pub(crate) fn run(f: &Function) -> (Function, usize) {
    let mut effects = Effects::default();
    let mut live = vec![false; f.nodes.len()];
    for (index, node) in f.nodes.iter().enumerate() {
        live[index] = effects.of(&node.op);
    }
    for v in &f.results {
        if let Value::Output { node, .. } = *v {
            live[node as usize] = true;
        }
    }
    // Every input of a node comes from an earlier node, so one backward
    // sweep sees each node's liveness settled before it marks its inputs.
    for index in (0..f.nodes.len()).rev() {
        if !live[index] {
            continue;
        }
        for v in &f.nodes[index].inputs {
            if let Value::Output { node, .. } = *v {
                live[node as usize] = true;
            }
        }
    }
    let mut b = Rebuilder::new(f);
    let mut removed = 0;
    for (node, &live) in f.nodes.iter().zip(&live) {
        if live {
            b.keep(node);
        } else {
            // Nothing live reads a dead node's outputs, so where they map
            // to is never asked; the parameter is a placeholder.
            b.bind(smallvec::smallvec![Value::Param(u32::MAX); node.outputs.len()]);
            removed += 1;
        }
    }
    (b.finish(), removed)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{bits, eval, loc, meta, pure_dag};
    use super::*;
    use crate::text::{parse, print};
    use proptest::prelude::*;
    use stagecraft_ops::{self as ops, OpAttrs};

    fn names(f: &Function) -> Vec<&'static str> {
        f.nodes.iter().map(|n| n.op.name()).collect()
    }

    fn eliminated(f: &Function) -> (Function, usize) {
        let (g, n) = run(f);
        crate::verify(&g).unwrap_or_else(|e| panic!("{e}\n{}", print(&g)));
        (g, n)
    }

    #[test]
    fn drops_unused_nodes_and_renumbers() {
        let none = OpAttrs::new();
        let mut f = Function::new("dead", vec![meta(&[3]), meta(&[3])]);
        let (x, y) = (Value::Param(0), Value::Param(1));
        let dead = f.add_op(&ops::EXP, &none, &[x], loc(1)).unwrap();
        f.add_op(&ops::NEG, &none, &[Value::node(dead)], loc(2))
            .unwrap();
        let a = f.add_op(&ops::ADD, &none, &[x, y], loc(3)).unwrap();
        let b = f
            .add_op(&ops::SIN, &none, &[Value::node(a)], loc(4))
            .unwrap();
        f.results = vec![Value::node(b), y, Value::node(a)];
        let (g, n) = eliminated(&f);
        assert_eq!(n, 2);
        assert_eq!(names(&g), ["Add", "Sin"]);
        assert_eq!(g.results, vec![Value::node(1), y, Value::node(0)]);
        assert_eq!(g.nodes[1].inputs[0], Value::node(0));
        assert_eq!(g.nodes[1].location, loc(4));
        assert_eq!(g.params.len(), 2);
    }

    #[test]
    fn keeps_side_effects_and_what_they_read() {
        let f = parse(
            r#"@effects(%x: f32[3]) -> (f32[3]) {
  %a = Exp(%x)
  %p = Print[label: "a"](%a)
  %q = Neg(%p)
  %r = Sin(%x)
  %s = Print(%r)
  return (%x)
}"#,
        )
        .unwrap();
        let (g, n) = eliminated(&f);
        assert_eq!(n, 1);
        assert_eq!(names(&g), ["Exp", "Print", "Sin", "Print"]);
    }

    #[test]
    fn keeps_calls_of_functions_with_side_effects() {
        let mut noisy = Function::new("dce_noisy", vec![meta(&[3])]);
        let p = noisy
            .add_op(&ops::PRINT, &OpAttrs::new(), &[Value::Param(0)], loc(1))
            .unwrap();
        noisy.results = vec![Value::node(p)];
        let noisy = noisy.register();
        let mut quiet = Function::new("dce_quiet", vec![meta(&[3])]);
        quiet.results = vec![Value::Param(0)];
        let quiet = quiet.register();
        let mut f = Function::new("dce_calls", vec![meta(&[3])]);
        for id in [noisy, quiet] {
            let mut attrs = OpAttrs::new();
            attrs.set_func("f", id);
            f.add_op(&ops::CALL, &attrs, &[Value::Param(0)], loc(2))
                .unwrap();
        }
        f.results = vec![Value::Param(0)];
        let (g, n) = eliminated(&f);
        assert_eq!(n, 1);
        assert_eq!(g.nodes.len(), 1);
        assert_eq!(g.nodes[0].op.functions().as_slice(), [noisy]);
    }

    #[test]
    fn keeps_multi_output_nodes_whole() {
        let mut body = Function::new("dce_pair", vec![meta(&[3])]);
        let n = body
            .add_op(&ops::NEG, &OpAttrs::new(), &[Value::Param(0)], loc(1))
            .unwrap();
        body.results = vec![Value::node(n), Value::Param(0)];
        let id = body.register();
        let mut attrs = OpAttrs::new();
        attrs.set_func("f", id);
        let mut f = Function::new("dce_multi", vec![meta(&[3])]);
        f.add_op(&ops::EXP, &OpAttrs::new(), &[Value::Param(0)], loc(2))
            .unwrap();
        let call = f
            .add_op(&ops::CALL, &attrs, &[Value::Param(0)], loc(3))
            .unwrap();
        f.results = vec![Value::Output {
            node: call as u32,
            output: 1,
        }];
        let (g, n) = eliminated(&f);
        assert_eq!(n, 1);
        assert_eq!(names(&g), ["Call"]);
        assert_eq!(g.results, vec![Value::Output { node: 0, output: 1 }]);
    }

    #[test]
    fn an_empty_function_stays_empty() {
        let mut f = Function::new("nothing", vec![meta(&[1])]);
        f.results = vec![Value::Param(0)];
        let (g, n) = eliminated(&f);
        assert_eq!((g.nodes.len(), n), (0, 0));
        assert_eq!(g.results, f.results);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn dce_preserves_results_and_prints((f, args) in pure_dag()) {
            let (g, n) = eliminated(&f);
            prop_assert_eq!(g.nodes.len() + n, f.nodes.len());
            prop_assert_eq!(bits(&eval(&f, &args).unwrap()), bits(&eval(&g, &args).unwrap()));
            let prints = |f: &Function| f.nodes.iter().filter(|n| n.op.name() == "Print").count();
            prop_assert_eq!(prints(&f), prints(&g));
            // Everything left is used by a result or a side effect.
            let (_, again) = run(&g);
            prop_assert_eq!(again, 0);
        }
    }
}
