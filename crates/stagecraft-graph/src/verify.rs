//! The verifier: checks the invariants that passes, the text parser and the
//! executor rely on, so that they can index values and trust metadata
//! without checking again.
//!
//! A function is well formed when
//! - every node input is a parameter or an output of an *earlier* node (the
//!   nodes are in topological order) and exists;
//! - every result exists;
//! - each op node has as many inputs as its op takes, names only functions
//!   that are in the library, and its recorded output metadata is what the
//!   op's metadata function computes;
//! - each constant has no inputs and one output whose metadata is the
//!   constant's.

use crate::text::{infer, value_name};
use crate::{Function, Node, NodeOp, Value};
use smallvec::SmallVec;
use stagecraft_ops::{func, AttrValue, OpDef};
use stagecraft_tensor::{Error, Result, TensorMetadata};

/// Checks that a function is well formed (see the [module docs](self)).
///
/// The error names the function and the first offending node as
/// `%k = OpName`, and says what is wrong.
pub fn verify(f: &Function) -> Result<()> {
    for (index, node) in f.nodes.iter().enumerate() {
        verify_node(f, index, node)?;
    }
    for (i, &result) in f.results.iter().enumerate() {
        if let Some(problem) = missing(f, result, f.nodes.len()) {
            return Err(Error::invalid(format!(
                "@{}: result {i} ({}) {problem}",
                f.name,
                value_name(f, result)
            )));
        }
    }
    Ok(())
}

fn verify_node(f: &Function, index: usize, node: &Node) -> Result<()> {
    let fail = |message: String| {
        Error::invalid(format!(
            "@{}: %{} = {}: {message}",
            f.name,
            f.params.len() + index,
            node.op.name()
        ))
        .at(node.location)
    };
    for (i, &input) in node.inputs.iter().enumerate() {
        if let Some(problem) = missing(f, input, index) {
            return Err(fail(format!(
                "input {i} ({}) {problem}",
                value_name(f, input)
            )));
        }
    }
    let metas: SmallVec<[TensorMetadata; 4]> =
        node.inputs.iter().map(|v| f.meta(*v).clone()).collect();
    match &node.op {
        NodeOp::Const(tensor) => {
            if !node.inputs.is_empty() {
                return Err(fail(format!(
                    "a constant takes no inputs, this one has {}",
                    node.inputs.len()
                )));
            }
            if node.outputs.len() != 1 || node.outputs[0] != *tensor.metadata() {
                return Err(fail(format!(
                    "the constant is {} but the node records outputs {}",
                    tensor.metadata(),
                    list(&node.outputs)
                )));
            }
        }
        NodeOp::Op(def, attrs) => {
            check_arity(def, node.inputs.len()).map_err(&fail)?;
            for (name, value) in attrs.iter() {
                if let AttrValue::Func(id) = value {
                    if func::function_signature(id).is_none() {
                        return Err(fail(format!(
                            "attribute `{name}` names function {} which is not in the library",
                            id.0
                        )));
                    }
                }
            }
            let computed = infer(def, &metas, attrs).map_err(|e| {
                Error::new(
                    e.kind(),
                    format!(
                        "@{}: %{} = {}: the metadata function rejects the inputs {}: {}",
                        f.name,
                        f.params.len() + index,
                        def.name,
                        list(&metas),
                        e.message()
                    ),
                )
                .at(node.location)
            })?;
            if computed != node.outputs {
                return Err(fail(format!(
                    "the node records outputs {} but the op computes {}",
                    list(&node.outputs),
                    list(&computed)
                )));
            }
        }
    }
    Ok(())
}

/// Why `value` cannot be used by something that sees the first `visible`
/// nodes, or `None` if it can.
fn missing(f: &Function, value: Value, visible: usize) -> Option<String> {
    match value {
        Value::Param(i) if (i as usize) < f.params.len() => None,
        Value::Param(i) => Some(format!(
            "is parameter {i}, but the function has {} parameters",
            f.params.len()
        )),
        Value::Output { node, output } => {
            let Some(producer) = f.nodes.get(node as usize) else {
                return Some(format!(
                    "refers to node {node}, but the function has {} nodes",
                    f.nodes.len()
                ));
            };
            if node as usize >= visible {
                return Some(
                    "is defined by this node or a later one (the nodes must be in topological order)"
                        .to_owned(),
                );
            }
            if output as usize >= producer.outputs.len() {
                return Some(format!(
                    "refers to output {output}, but that node has {} outputs",
                    producer.outputs.len()
                ));
            }
            None
        }
    }
}

/// The same rule as the op registry's: a variadic op repeats its last input
/// zero or more times.
fn check_arity(def: &OpDef, n: usize) -> std::result::Result<(), String> {
    let declared = def.inputs.len();
    let ok = if def.variadic {
        n >= declared
    } else {
        n == declared
    };
    if ok {
        return Ok(());
    }
    let expected = if def.variadic {
        format!("at least {declared}")
    } else {
        declared.to_string()
    };
    Err(format!(
        "{} takes {expected} inputs ({}), but the node has {n}",
        def.name,
        def.inputs.join(", ")
    ))
}

fn list(metas: &[TensorMetadata]) -> String {
    let items: Vec<String> = metas.iter().map(|m| m.to_string()).collect();
    format!("({})", items.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::{self as ops, FuncId, OpAttrs};
    use stagecraft_tensor::{DType, HostTensor, Location, Scalar, ScalarHostTensor};

    fn meta(dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(DType::F32, dims)
    }

    fn loc() -> Location {
        Location::new("v.rs", 1, 1)
    }

    /// `@v(%0: f32[2,3], %1: f32[3]) { %2 = Neg(%0); %3 = Add(%2, %1);
    /// %4 = Const 1.0; return (%3) }`.
    fn sample() -> Function {
        let mut f = Function::new("v", vec![meta(&[2, 3]), meta(&[3])]);
        let none = OpAttrs::new();
        let n = f
            .add_op(&ops::NEG, &none, &[Value::Param(0)], loc())
            .unwrap();
        let a = f
            .add_op(&ops::ADD, &none, &[Value::node(n), Value::Param(1)], loc())
            .unwrap();
        f.add_const(ScalarHostTensor::new(Scalar::F32(1.0), []).into(), loc());
        f.results = vec![Value::node(a)];
        f
    }

    fn error(f: &Function) -> String {
        match verify(f) {
            Ok(()) => panic!("verified:\n{}", crate::text::print(f)),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn accepts_well_formed_functions() {
        verify(&sample()).unwrap();
        verify(&Function::new("empty", vec![])).unwrap();
    }

    #[test]
    fn rejects_a_missing_parameter() {
        let mut f = sample();
        f.nodes[0].inputs[0] = Value::Param(5);
        let e = error(&f);
        assert!(e.contains("%2 = Neg: input 0 (%5) is parameter 5"), "{e}");
    }

    #[test]
    fn rejects_uses_before_definition() {
        let mut f = sample();
        f.nodes[0].inputs[0] = Value::node(1);
        let e = error(&f);
        assert!(
            e.contains("%2 = Neg: input 0 (%3)") && e.contains("topological order"),
            "{e}"
        );
        let mut f = sample();
        f.nodes[1].inputs[0] = Value::node(1);
        let e = error(&f);
        assert!(
            e.contains("%3 = Add") && e.contains("this node or a later one"),
            "{e}"
        );
    }

    #[test]
    fn rejects_missing_nodes_and_outputs() {
        let mut f = sample();
        f.nodes[1].inputs[1] = Value::node(9);
        let e = error(&f);
        assert!(
            e.contains("%3 = Add: input 1 (%11#0) refers to node 9"),
            "{e}"
        );
        let mut f = sample();
        f.nodes[1].inputs[0] = Value::Output { node: 0, output: 1 };
        let e = error(&f);
        assert!(
            e.contains("refers to output 1, but that node has 1 outputs"),
            "{e}"
        );
    }

    #[test]
    fn rejects_missing_results() {
        let mut f = sample();
        f.results.push(Value::node(3));
        let e = error(&f);
        assert!(e.contains("@v: result 1 (%5#0) refers to node 3"), "{e}");
        let mut f = sample();
        f.results.push(Value::Param(2));
        assert!(error(&f).contains("result 1 (%2) is parameter 2"));
    }

    #[test]
    fn rejects_wrong_arity() {
        let mut f = sample();
        f.nodes[0].inputs.push(Value::Param(0));
        let e = error(&f);
        assert!(
            e.contains("%2 = Neg: Neg takes 1 inputs (x), but the node has 2"),
            "{e}"
        );
        let mut f = sample();
        f.nodes[0].op = NodeOp::Op(&ops::IF, OpAttrs::new().freeze());
        f.nodes[0].inputs.clear();
        let e = error(&f);
        assert!(e.contains("If takes at least 1 inputs"), "{e}");
    }

    #[test]
    fn rejects_stale_output_metadata() {
        let mut f = sample();
        f.nodes[1].outputs[0] = meta(&[3]);
        let e = error(&f);
        assert!(
            e.contains(
                "%3 = Add: the node records outputs (f32[3]) but the op computes (f32[2,3])"
            ),
            "{e}"
        );
        assert!(e.contains("v.rs:1:1"), "{e}");
    }

    #[test]
    fn rejects_inputs_the_op_does_not_accept() {
        let mut f = sample();
        // Add of f32[2,3] and f32[2,3]... made f32[2,3] and f32[4].
        f.params[1] = meta(&[4]);
        let e = error(&f);
        assert!(e.contains("%3 = Add: the metadata function rejects"), "{e}");
        assert!(e.contains("shape error"), "{e}");
    }

    #[test]
    fn rejects_bad_constants() {
        let mut f = sample();
        f.nodes[2].outputs[0] = meta(&[2]);
        let e = error(&f);
        assert!(
            e.contains("%4 = Const: the constant is f32[] but the node records outputs (f32[2])"),
            "{e}"
        );
        let mut f = sample();
        f.nodes[2].inputs.push(Value::Param(0));
        let e = error(&f);
        assert!(e.contains("%4 = Const: a constant takes no inputs"), "{e}");
        let mut f = sample();
        f.nodes[2].op = NodeOp::Const(HostTensor::Scalar(ScalarHostTensor::new(
            Scalar::I64(1),
            [],
        )));
        assert!(error(&f).contains("the constant is i64[]"));
    }

    #[test]
    fn rejects_functions_missing_from_the_library() {
        let mut branch = Function::new("verify_branch", vec![meta(&[2, 3])]);
        branch.results = vec![Value::Param(0)];
        let id = branch.register();
        let mut f = Function::new(
            "cond",
            vec![TensorMetadata::new(DType::Bool, []), meta(&[2, 3])],
        );
        let mut attrs = OpAttrs::new();
        attrs
            .set_func("then_branch", id)
            .set_func("else_branch", id);
        let node = f
            .add_op(&ops::IF, &attrs, &[Value::Param(0), Value::Param(1)], loc())
            .unwrap();
        f.results = vec![Value::node(node)];
        verify(&f).unwrap();
        attrs.set_func("else_branch", FuncId(u32::MAX));
        f.nodes[node].op = NodeOp::Op(&ops::IF, attrs.freeze());
        let e = error(&f);
        assert!(
            e.contains("%2 = If: attribute `else_branch` names function 4294967295 which is not in the library"),
            "{e}"
        );
    }
}
