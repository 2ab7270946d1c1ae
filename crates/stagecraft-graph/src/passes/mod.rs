//! Optimization passes over functions.
//!
//! Every pass takes a function and returns a new one that computes the same
//! results, bit for bit, with its nodes still in topological order:
//!
//! - [`inline_calls`] splices the bodies of small `Call`ed functions in;
//! - [`fold_constants`] evaluates pure ops of constants on the CPU;
//! - [`cse()`] merges nodes that compute the same thing;
//! - [`dce()`] drops nodes that no result depends on;
//! - [`join_padded_pieces`] turns sums of zero-padded pieces that tile
//!   a tensor (the gradient of a split) into one concatenation;
//! - [`fold_transposes`] lets matrix products read transposed operands
//!   through strides instead of copies;
//! - [`fuse_elementwise`] turns chains and trees of elementwise ops into
//!   single fused kernels.
//!
//! [`optimize`] runs them in that order. Inlining goes first because it is
//! the only pass that exposes new work to the others: a callee's constant
//! arithmetic and the repeated subexpressions it shares with its caller are
//! invisible behind a `Call`. Folding goes before CSE because folding turns
//! different expressions into constants that may be bit-identical, which
//! CSE then merges (and, once their inputs are the same node, the ops that
//! consume them). Dead-code elimination goes last because every earlier
//! pass leaves garbage behind it: the constants folded ops consumed, the
//! duplicates CSE bypassed, and whatever was dead to begin with. Joining
//! padded pieces and folding transposes into products come next (then DCE
//! again for the pads and transposes nobody reads any more), and fusion
//! last, on the final set of nodes, so it sees the true use counts.
//!
//! Side effects are respected throughout: a side-effecting op, or a
//! control-flow op that runs a function containing one (see
//! [`has_side_effects`]), is never folded, merged or dropped.

pub mod concat;
pub mod cse;
pub mod dce;
pub mod fold;
pub mod fuse;
pub mod inline;
pub mod layout;
#[cfg(test)]
mod testing;

pub use concat::join_padded_pieces;
pub use cse::cse;
pub use dce::dce;
pub use fold::{fold_constants, FOLD_LIMIT};
pub use fuse::fuse_elementwise;
pub use inline::{inline_calls, INLINE_LIMIT};
pub use layout::fold_transposes;

use crate::{Function, Node, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::{ConstantKernels, Effect, FuncId, OpKind};
use std::collections::HashMap;

/// What [`optimize_with_stats`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassStats {
    /// Nodes in the function given to [`optimize_with_stats`].
    pub nodes_before: usize,
    /// Nodes in the optimized function.
    pub nodes_after: usize,
    /// Op nodes that constant folding replaced by constants.
    pub folded: usize,
    /// Nodes that CSE merged into an earlier, equal node.
    pub merged: usize,
    /// `Call` nodes replaced by their callee's body (nested calls count
    /// too).
    pub inlined: usize,
    /// Nodes that dead-code elimination dropped.
    pub removed: usize,
    /// Elementwise nodes merged into fused kernels.
    pub fused: usize,
}

/// Runs inline → fold → CSE → DCE (see the [module docs](self) for why in
/// that order) and returns the optimized function; constants fold with
/// `kernels` (the runtime passes the CPU's).
pub fn optimize(f: &Function, kernels: &dyn ConstantKernels) -> Function {
    optimize_with_stats(f, kernels).0
}

/// [`optimize`], also saying what each pass did.
pub fn optimize_with_stats(f: &Function, kernels: &dyn ConstantKernels) -> (Function, PassStats) {
    optimize_fusing(f, kernels, &fuse::Fusions::ALL)
}

/// [`optimize_with_stats`] for a device whose kernels run only the fused
/// forms `fusions` allows (a GPU).
pub fn optimize_fusing(
    f: &Function,
    kernels: &dyn ConstantKernels,
    fusions: &fuse::Fusions,
) -> (Function, PassStats) {
    let (g, stats) = simplify_with_stats(f, kernels);
    let (g, removed, fused) = lower(&g, fusions);
    let stats = PassStats {
        nodes_after: g.nodes.len(),
        removed: stats.removed + removed,
        fused,
        ..stats
    };
    (g, stats)
}

/// The passes after [`simplify_with_stats`] that shape a function for a
/// device's kernels: sums of padded pieces become concatenations,
/// transposes read by products become strides, elementwise ops on
/// reshaped products move below the reshape (where products take
/// epilogues), then fusion (limited to `fusions`) groups what is left. A function placed on
/// several devices is simplified whole, then lowered per partition, each
/// for its own device's kernels. Returns the function, the nodes removed
/// and the groups fused.
pub fn lower(f: &Function, fusions: &fuse::Fusions) -> (Function, usize, usize) {
    let (g, joined) = concat::run(f);
    let (g, transposes) = layout::run(&g, fusions.matmul_epilogues);
    let (g, removed) = if joined + transposes > 0 {
        dce::run(&g)
    } else {
        (g, 0)
    };
    let (g, fused) = fuse::run_with(&g, fusions);
    (g, removed, fused)
}

/// Every pass but fusion (inline → fold → CSE → DCE): the function stays
/// in terms of the ops the user wrote.
pub fn simplify_with_stats(f: &Function, kernels: &dyn ConstantKernels) -> (Function, PassStats) {
    let (g, inlined) = inline::run(f);
    let (g, folded) = fold::run(&g, kernels);
    let (g, merged) = cse::run(&g);
    let (g, removed) = dce::run(&g);
    let fused = 0;
    let stats = PassStats {
        nodes_before: f.nodes.len(),
        nodes_after: g.nodes.len(),
        folded,
        merged,
        inlined,
        removed,
        fused,
    };
    (g, stats)
}

/// True when running the node may be observable beyond its outputs: a
/// side-effecting op, or a control-flow op whose functions (or the
/// functions they in turn name) contain one. `Call`, `If` and `While` are
/// pure by declaration, but dropping or merging a call whose callee prints
/// would lose the print.
pub fn has_side_effects(op: &NodeOp) -> bool {
    Effects::default().of(op)
}

/// [`has_side_effects`] with a memo of the library functions already
/// looked at, so a pass asks about each callee once. Library functions
/// never change once registered, so the memo stays valid for the whole
/// pass.
#[derive(Default)]
pub(crate) struct Effects {
    functions: HashMap<FuncId, bool>,
}

impl Effects {
    pub(crate) fn of(&mut self, op: &NodeOp) -> bool {
        let NodeOp::Op(def, _) = op else {
            return false;
        };
        if def.effect == Effect::SideEffecting {
            return true;
        }
        if !matches!(def.kind, OpKind::Control(_)) {
            return false;
        }
        op.functions().into_iter().any(|id| self.function(id))
    }

    fn function(&mut self, id: FuncId) -> bool {
        if let Some(&known) = self.functions.get(&id) {
            return known;
        }
        // Provisionally pure, so that a cycle (which the library cannot
        // build today: a function can only name functions registered before
        // it) would end instead of recursing forever.
        self.functions.insert(id, false);
        let effects = match Function::lookup(id) {
            Some(body) => body.nodes.iter().any(|n| self.of(&n.op)),
            // A body that is not a graph function cannot be inspected.
            None => true,
        };
        self.functions.insert(id, effects);
        effects
    }
}

/// Builds a new function node by node while the passes rewrite an old one,
/// remembering where each old value went.
pub(crate) struct Rebuilder<'a> {
    old: &'a Function,
    new: Function,
    /// For each old node, the new value of each of its outputs.
    map: Vec<SmallVec<[Value; 1]>>,
}

impl<'a> Rebuilder<'a> {
    pub(crate) fn new(old: &'a Function) -> Rebuilder<'a> {
        let mut new = Function::new(old.name.clone(), old.params.clone());
        new.nodes.reserve(old.nodes.len());
        Rebuilder {
            old,
            new,
            map: Vec::with_capacity(old.nodes.len()),
        }
    }

    /// The function built so far.
    pub(crate) fn built(&self) -> &Function {
        &self.new
    }

    /// Where an old value now lives. Parameters never move.
    pub(crate) fn value(&self, v: Value) -> Value {
        match v {
            Value::Param(_) => v,
            Value::Output { node, output } => self.map[node as usize][output as usize],
        }
    }

    /// `node` with its inputs moved to the new function.
    pub(crate) fn remapped(&self, node: &Node) -> Node {
        let mut node = node.clone();
        for v in &mut node.inputs {
            *v = self.value(*v);
        }
        node
    }

    /// Appends a node whose inputs are already new values and returns its
    /// index in the new function.
    pub(crate) fn push(&mut self, node: Node) -> usize {
        self.new.push(node)
    }

    /// Says where the outputs of the next old node went; must be called
    /// once per old node, in order.
    pub(crate) fn bind(&mut self, outputs: SmallVec<[Value; 1]>) {
        debug_assert_eq!(outputs.len(), self.old.nodes[self.map.len()].outputs.len());
        self.map.push(outputs);
    }

    /// Appends the old node's remapped copy and binds its outputs to it.
    pub(crate) fn keep(&mut self, node: &Node) {
        let copy = self.remapped(node);
        let index = self.push(copy);
        self.bind(outputs_of(index, node.outputs.len()));
    }

    /// The new function, returning the old results' new values.
    pub(crate) fn finish(mut self) -> Function {
        debug_assert_eq!(self.map.len(), self.old.nodes.len());
        self.new.results = self.old.results.iter().map(|&v| self.value(v)).collect();
        self.new
    }
}

/// The values of all `count` outputs of node `index`.
pub(crate) fn outputs_of(index: usize, count: usize) -> SmallVec<[Value; 1]> {
    (0..count as u32)
        .map(|output| Value::Output {
            node: index as u32,
            output,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::testing::{bits, eval, loc, meta, pure_dag, run_bits};
    use super::*;
    use crate::text::print;
    use proptest::prelude::*;
    use stagecraft_cpu::CONSTANT_KERNELS as CPU;
    use stagecraft_ops::{self as ops, OpAttrs};
    use stagecraft_tensor::{DenseHostTensor, Scalar, ScalarHostTensor};

    fn scalar(f: &mut Function, v: f32, line: u32) -> Value {
        Value::node(f.add_const(ScalarHostTensor::new(Scalar::F32(v), []).into(), loc(line)))
    }

    /// `y = x*2 + 1`, `z = (x+x) * (x+x)` with the sum written twice, a
    /// constant subexpression `2*3` and a dead `Neg`.
    fn sample() -> Function {
        let none = OpAttrs::new();
        let mut f = Function::new("sample", vec![meta(&[3])]);
        let x = Value::Param(0);
        let two = scalar(&mut f, 2.0, 1);
        let three = scalar(&mut f, 3.0, 2);
        let six = f.add_op(&ops::MUL, &none, &[two, three], loc(3)).unwrap();
        let x2 = f.add_op(&ops::MUL, &none, &[x, two], loc(4)).unwrap();
        let one = scalar(&mut f, 1.0, 5);
        let y = f
            .add_op(&ops::ADD, &none, &[Value::node(x2), one], loc(6))
            .unwrap();
        let s1 = f.add_op(&ops::ADD, &none, &[x, x], loc(7)).unwrap();
        let s2 = f.add_op(&ops::ADD, &none, &[x, x], loc(8)).unwrap();
        let z = f
            .add_op(
                &ops::MUL,
                &none,
                &[Value::node(s1), Value::node(s2)],
                loc(9),
            )
            .unwrap();
        f.add_op(&ops::NEG, &none, &[x], loc(10)).unwrap();
        let w = f
            .add_op(
                &ops::MUL,
                &none,
                &[Value::node(z), Value::node(six)],
                loc(11),
            )
            .unwrap();
        f.results = vec![Value::node(y), Value::node(w)];
        crate::verify(&f).unwrap();
        f
    }

    /// Every pass carries a node's origin along with its location (a folded
    /// constant, the copy CSE keeps, a fused kernel's root), so a rewritten
    /// node of a lazy trace names the entry whose line it was built with.
    #[test]
    fn origins_travel_with_locations() {
        let mut f = sample();
        for node in &mut f.nodes {
            node.origin = Some(node.location.line() + 100);
        }
        let (g, stats) = optimize_with_stats(&f, &CPU);
        assert!(stats.folded > 0 && stats.merged > 0 && stats.fused > 0);
        for node in &g.nodes {
            let expected = Some(node.location.line() + 100);
            assert_eq!(node.origin, expected, "{}", print(&g));
        }
    }

    #[test]
    fn optimize_prints_the_expected_function() {
        let f = sample();
        let (g, stats) = simplify_with_stats(&f, &CPU);
        crate::verify(&g).unwrap();
        let expected = r#"@sample(%0: f32[3]) -> (f32[3], f32[3]) {
  %1 = Const[dtype: f32, value: 2.0]() : f32[]  @ "t.rs":1:1
  %2 = Const[dtype: f32, value: 6.0]() : f32[]  @ "t.rs":3:1
  %3 = Mul(%0, %1) : f32[3]  @ "t.rs":4:1
  %4 = Const[dtype: f32, value: 1.0]() : f32[]  @ "t.rs":5:1
  %5 = Add(%3, %4) : f32[3]  @ "t.rs":6:1
  %6 = Add(%0, %0) : f32[3]  @ "t.rs":7:1
  %7 = Mul(%6, %6) : f32[3]  @ "t.rs":9:1
  %8 = Mul(%7, %2) : f32[3]  @ "t.rs":11:1
  return (%5, %8)
}
"#;
        assert_eq!(print(&g), expected);
        assert_eq!(
            stats,
            PassStats {
                nodes_before: 11,
                nodes_after: 8,
                folded: 1,
                merged: 1,
                inlined: 0,
                removed: 2,
                fused: 0,
            }
        );
        // Fusion then joins `x * 2 + 1` and `(x + x)² * 6` into two kernels.
        let (fused, stats) = optimize_with_stats(&f, &CPU);
        assert_eq!(stats.fused, 5, "{}", print(&fused));
        assert_eq!(
            run_bits(
                &g,
                &[DenseHostTensor::from_slice(&[0.5f32, 1.0, 2.0], [3])
                    .unwrap()
                    .into()]
            ),
            run_bits(
                &fused,
                &[DenseHostTensor::from_slice(&[0.5f32, 1.0, 2.0], [3])
                    .unwrap()
                    .into()]
            )
        );
        let x = DenseHostTensor::from_slice(&[1.0f32, -2.5, 3.0], [3]).unwrap();
        assert_eq!(run_bits(&f, &[x.clone().into()]), run_bits(&g, &[x.into()]));
    }

    #[test]
    fn optimize_is_idempotent_on_its_output() {
        let g = optimize(&sample(), &CPU);
        let (h, stats) = optimize_with_stats(&g, &CPU);
        assert_eq!(print(&h), print(&g));
        assert_eq!(
            (stats.folded, stats.merged, stats.removed, stats.inlined),
            (0, 0, 0, 0)
        );
    }

    #[test]
    fn optimize_inlines_then_folds_and_merges_across_the_call() {
        let none = OpAttrs::new();
        // @callee(a) = a * (2 + 2)
        let mut callee = Function::new("opt_callee", vec![meta(&[3])]);
        let two = scalar(&mut callee, 2.0, 20);
        let four = callee
            .add_op(&ops::ADD, &none, &[two, two], loc(21))
            .unwrap();
        let out = callee
            .add_op(
                &ops::MUL,
                &none,
                &[Value::Param(0), Value::node(four)],
                loc(22),
            )
            .unwrap();
        callee.results = vec![Value::node(out)];
        let id = callee.register();
        // @caller(x) = Call(x) + x * 4
        let mut f = Function::new("opt_caller", vec![meta(&[3])]);
        let mut attrs = OpAttrs::new();
        attrs.set_func("f", id);
        let call = f
            .add_op(&ops::CALL, &attrs, &[Value::Param(0)], loc(30))
            .unwrap();
        let four = scalar(&mut f, 4.0, 31);
        let m = f
            .add_op(&ops::MUL, &none, &[Value::Param(0), four], loc(32))
            .unwrap();
        let sum = f
            .add_op(
                &ops::ADD,
                &none,
                &[Value::node(call), Value::node(m)],
                loc(33),
            )
            .unwrap();
        f.results = vec![Value::node(sum)];
        let (g, stats) = simplify_with_stats(&f, &CPU);
        crate::verify(&g).unwrap();
        assert_eq!(stats.inlined, 1);
        assert_eq!(stats.folded, 1);
        // The folded 2+2 is the caller's constant 4.0, so the callee's
        // `a * 4` and the caller's `x * 4` become one node.
        assert_eq!(stats.merged, 2);
        let names: Vec<&str> = g.nodes.iter().map(|n| n.op.name()).collect();
        assert_eq!(names, ["Const", "Mul", "Add"], "{}", print(&g));
        assert_eq!(
            g.nodes[2].inputs.as_slice(),
            [Value::node(1), Value::node(1)]
        );
        let x = DenseHostTensor::from_slice(&[1.0f32, 0.5, -7.0], [3]).unwrap();
        assert_eq!(run_bits(&f, &[x.clone().into()]), run_bits(&g, &[x.into()]));
    }

    #[test]
    fn side_effects_are_seen_through_calls() {
        let mut printing = Function::new("effects_printing", vec![meta(&[3])]);
        let p = printing
            .add_op(&ops::PRINT, &OpAttrs::new(), &[Value::Param(0)], loc(1))
            .unwrap();
        printing.results = vec![Value::node(p)];
        let printing = printing.register();
        let mut quiet = Function::new("effects_quiet", vec![meta(&[3])]);
        quiet.results = vec![Value::Param(0)];
        let quiet = quiet.register();
        let mut outer = Function::new("effects_outer", vec![meta(&[3])]);
        let mut attrs = OpAttrs::new();
        attrs.set_func("f", printing);
        outer
            .add_op(&ops::CALL, &attrs, &[Value::Param(0)], loc(2))
            .unwrap();
        outer.results = vec![Value::Param(0)];
        let outer = outer.register();

        let call = |id| {
            let mut attrs = OpAttrs::new();
            attrs.set_func("f", id);
            NodeOp::Op(&ops::CALL, attrs.freeze())
        };
        assert!(has_side_effects(&call(printing)));
        assert!(has_side_effects(&call(outer)));
        assert!(!has_side_effects(&call(quiet)));
        assert!(!has_side_effects(&NodeOp::Op(
            &ops::ADD,
            OpAttrs::new().freeze()
        )));
        assert!(has_side_effects(&NodeOp::Op(
            &ops::PRINT,
            OpAttrs::new().freeze()
        )));
    }

    /// Guards the property below against a generator that stopped
    /// producing work for the passes: over many functions, every pass but
    /// inlining must have had something to do.
    #[test]
    fn generated_functions_exercise_every_pass() {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let mut total = PassStats::default();
        for _ in 0..200 {
            let tree = pure_dag().new_tree(&mut runner).unwrap();
            let (f, _) = proptest::strategy::ValueTree::current(&tree);
            let (_, stats) = optimize_with_stats(&f, &CPU);
            total.folded += stats.folded;
            total.merged += stats.merged;
            total.removed += stats.removed;
        }
        assert!(
            total.folded > 20 && total.merged > 20 && total.removed > 20,
            "{total:?}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// `optimize` never changes what a random pure elementwise DAG
        /// computes, keeps it well formed, and never grows it.
        #[test]
        fn optimize_preserves_results((f, args) in pure_dag()) {
            let before = eval(&f, &args).unwrap();
            let (g, stats) = optimize_with_stats(&f, &CPU);
            crate::verify(&g).unwrap();
            let after = eval(&g, &args).unwrap();
            prop_assert_eq!(bits(&before), bits(&after));
            prop_assert!(g.nodes.len() <= f.nodes.len());
            prop_assert!(stats.nodes_after <= stats.nodes_before - stats.merged - stats.removed);
            // Folded constants print and read back.
            let text = print(&g);
            let parsed = crate::text::parse(&text).unwrap();
            prop_assert_eq!(print(&parsed), text);
            let prints = |f: &Function| f.nodes.iter().filter(|n| n.op.name() == "Print").count();
            prop_assert_eq!(prints(&f), prints(&g));
            // A second round finds nothing left to do.
            let (_, again) = optimize_with_stats(&g, &CPU);
            prop_assert_eq!((again.folded, again.merged, again.removed), (0, 0, 0));
        }
    }
}
