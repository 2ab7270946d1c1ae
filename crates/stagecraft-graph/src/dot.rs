//! The Graphviz DOT form of a [`Function`], for looking at graphs
//! (`dot -Tsvg`).
//!
//! Parameters and results are ellipses, nodes are boxes labelled with their
//! op, their attributes (shortened), their output metadata and their
//! device; each edge is labelled with the metadata of the value it carries.
//! The form is for people: unlike [`crate::text`], it does not read back.

use crate::{Function, NodeOp, Value};
use stagecraft_ops::{func, AttrValue};
use stagecraft_tensor::HostTensor;
use std::fmt::Write as _;

/// Attribute values longer than this many characters are cut short, so
/// that a long list does not stretch the node across the picture.
const MAX_ATTR_CHARS: usize = 32;

/// Dense constants show this many values.
const MAX_CONST_VALUES: usize = 4;

/// The function as a Graphviz digraph.
///
/// Never panics: edges from values that do not exist in a malformed
/// function are drawn with the label `?`.
pub fn to_dot(f: &Function) -> String {
    let mut out = String::new();
    let _ = write_dot(&mut out, f);
    out
}

fn write_dot(out: &mut String, f: &Function) -> std::fmt::Result {
    writeln!(out, "digraph \"{}\" {{", escape(&f.name))?;
    writeln!(out, "  graph [rankdir=TB, label=\"@{}\"];", escape(&f.name))?;
    writeln!(out, "  node [shape=box, fontname=\"monospace\"];")?;
    writeln!(out, "  edge [fontname=\"monospace\", fontsize=10];")?;
    for (i, meta) in f.params.iter().enumerate() {
        writeln!(
            out,
            "  p{i} [shape=ellipse, label=\"{}\"];",
            label(&[format!("%{i}"), meta.to_string()])
        )?;
    }
    for (i, node) in f.nodes.iter().enumerate() {
        let mut lines = vec![format!("%{} = {}", f.params.len() + i, node.op.name())];
        match &node.op {
            NodeOp::Op(_, attrs) => {
                for (name, value) in attrs.iter() {
                    let text = match value {
                        AttrValue::Func(id) => format!("@{}", func::function_name(id)),
                        other => other.to_string(),
                    };
                    lines.push(format!("{name}: {}", shorten(&text, MAX_ATTR_CHARS)));
                }
            }
            NodeOp::Const(tensor) => lines.push(const_summary(tensor)),
        }
        let outputs: Vec<String> = node.outputs.iter().map(|m| m.to_string()).collect();
        lines.push(match outputs.len() {
            1 => outputs[0].clone(),
            _ => format!("({})", outputs.join(", ")),
        });
        if let Some(device) = &node.device {
            lines.push(format!("device {device}"));
        }
        let style = match node.op {
            NodeOp::Const(_) => ", style=filled, fillcolor=\"#eeeeee\"",
            NodeOp::Op(..) => "",
        };
        writeln!(out, "  n{i} [label=\"{}\"{style}];", label(&lines))?;
    }
    for (i, v) in f.results.iter().enumerate() {
        let meta = f.try_meta(*v).map_or("?".to_owned(), |m| m.to_string());
        writeln!(
            out,
            "  r{i} [shape=ellipse, label=\"{}\"];",
            label(&[format!("result {i}"), meta])
        )?;
    }
    for (i, node) in f.nodes.iter().enumerate() {
        for v in &node.inputs {
            write_edge(out, f, *v, &format!("n{i}"))?;
        }
    }
    for (i, v) in f.results.iter().enumerate() {
        write_edge(out, f, *v, &format!("r{i}"))?;
    }
    out.push_str("}\n");
    Ok(())
}

fn write_edge(out: &mut String, f: &Function, from: Value, to: &str) -> std::fmt::Result {
    let source = match from {
        Value::Param(i) => format!("p{i}"),
        Value::Output { node, .. } => format!("n{node}"),
    };
    let meta = f.try_meta(from).map_or("?".to_owned(), |m| m.to_string());
    // Name the output only where the source does not have exactly one.
    let text = match from {
        Value::Output { node, output }
            if f.nodes
                .get(node as usize)
                .is_none_or(|n| n.outputs.len() != 1) =>
        {
            format!("#{output} {meta}")
        }
        _ => meta,
    };
    writeln!(out, "  {source} -> {to} [label=\"{}\"];", escape(&text))
}

/// A short description of a constant's value.
fn const_summary(tensor: &HostTensor) -> String {
    match tensor {
        HostTensor::Scalar(t) => format!("value: {}", t.value()),
        HostTensor::List(list) => format!("list of {} items", list.len()),
        HostTensor::Dense(t) => {
            let mut text = String::from("values: [");
            let shown = t.numel().min(MAX_CONST_VALUES);
            for i in 0..shown {
                if i > 0 {
                    text.push_str(", ");
                }
                match t.get_scalar(i) {
                    Some(v) => {
                        let _ = write!(text, "{v}");
                    }
                    None => text.push('?'),
                }
            }
            if t.numel() > shown {
                text.push_str(", ...");
            }
            text.push(']');
            text
        }
    }
}

/// `text` cut to `max` characters, with `...` when cut.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(3)).collect();
    cut.push_str("...");
    cut
}

/// Escaped lines joined with DOT's centered line break `\n`.
fn label<S: AsRef<str>>(lines: &[S]) -> String {
    lines
        .iter()
        .map(|l| escape(l.as_ref()))
        .collect::<Vec<_>>()
        .join("\\n")
}

/// Escapes text for a double-quoted DOT string: quotes and backslashes, and
/// line breaks as DOT's `\n` (a raw line break would end up in the label
/// as-is on some renderers).
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => {}
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagecraft_ops::{self as ops, OpAttrs};
    use stagecraft_tensor::{
        DType, DenseHostTensor, Location, Scalar, ScalarHostTensor, TensorMetadata,
    };

    /// Checks that quotes close and brackets balance outside strings.
    fn assert_balanced(dot: &str) {
        let (mut braces, mut brackets) = (0i64, 0i64);
        let mut chars = dot.chars();
        let mut in_string = false;
        while let Some(ch) = chars.next() {
            match (in_string, ch) {
                (true, '\\') => {
                    chars.next();
                }
                (true, '"') | (false, '"') => in_string = !in_string,
                (true, _) => {}
                (false, '{') => braces += 1,
                (false, '}') => braces -= 1,
                (false, '[') => brackets += 1,
                (false, ']') => brackets -= 1,
                (false, _) => {}
            }
            assert!(braces >= 0 && brackets >= 0, "unbalanced:\n{dot}");
        }
        assert!(!in_string, "unterminated string:\n{dot}");
        assert_eq!((braces, brackets), (0, 0), "unbalanced:\n{dot}");
    }

    #[test]
    fn draws_every_node_and_edge() {
        let loc = Location::new("d.rs", 1, 1);
        let mut branch = Function::new("dot_branch", vec![TensorMetadata::new(DType::F32, [2])]);
        let neg = branch
            .add_op(&ops::NEG, &OpAttrs::new(), &[Value::Param(0)], loc)
            .unwrap();
        branch.results = vec![Value::Param(0), Value::node(neg)];
        let id = branch.register();

        let mut f = Function::new(
            "say \"hi\" \\ there",
            vec![
                TensorMetadata::new(DType::Bool, []),
                TensorMetadata::new(DType::F32, [2]),
            ],
        );
        let c = f.add_const(ScalarHostTensor::new(Scalar::F32(2.0), [2]).into(), loc);
        let dense = f.add_const(
            DenseHostTensor::from_slice(&[1i64, 2, 3, 4, 5], [5])
                .unwrap()
                .into(),
            loc,
        );
        let mul = f
            .add_op(
                &ops::MUL,
                &OpAttrs::new(),
                &[Value::Param(1), Value::node(c)],
                loc,
            )
            .unwrap();
        let mut attrs = OpAttrs::new();
        attrs.set_str(
            "label",
            "a \"quoted\"\nlabel that is much longer than the limit",
        );
        let print = f
            .add_op(&ops::PRINT, &attrs, &[Value::node(mul)], loc)
            .unwrap();
        f.nodes[print].device = Some("cpu:\"1\"".into());
        let mut attrs = OpAttrs::new();
        attrs
            .set_func("then_branch", id)
            .set_func("else_branch", id);
        let cond = f
            .add_op(
                &ops::IF,
                &attrs,
                &[Value::Param(0), Value::node(print)],
                loc,
            )
            .unwrap();
        f.results = vec![
            Value::Output {
                node: cond as u32,
                output: 1,
            },
            Value::node(dense),
        ];

        let dot = to_dot(&f);
        assert_balanced(&dot);
        assert!(
            dot.starts_with("digraph \"say \\\"hi\\\" \\\\ there\" {"),
            "{dot}"
        );
        for id in ["p0", "p1", "n0", "n1", "n2", "n3", "n4", "r0", "r1"] {
            assert!(dot.contains(&format!("  {id} [")), "{id} missing:\n{dot}");
        }
        assert!(!dot.contains("n5"), "{dot}");
        assert!(dot.contains("%4 = Mul\\nf32[2]"), "{dot}");
        assert!(dot.contains("values: [1, 2, 3, 4, ...]"), "{dot}");
        assert!(dot.contains("value: 2.0"), "{dot}");
        assert!(dot.contains("device cpu:\\\"1\\\""), "{dot}");
        assert!(dot.contains("then_branch: @dot_branch"), "{dot}");
        assert!(
            dot.contains("label: \\\"a \\\\\\\"quoted\\\\\\\"\\\\nlabel that is ..."),
            "{dot}"
        );
        assert!(dot.contains("  p1 -> n2 [label=\"f32[2]\"];"), "{dot}");
        assert!(dot.contains("  n4 -> r0 [label=\"#1 f32[2]\"];"), "{dot}");
        assert!(dot.contains("  n1 -> r1 [label=\"i64[5]\"];"), "{dot}");
        // Every edge: 2 into Mul, 1 into Print, 2 into If, 2 results.
        assert_eq!(dot.matches(" -> ").count(), 7, "{dot}");
    }

    #[test]
    fn draws_malformed_functions_without_panicking() {
        let mut f = Function::new("bad", vec![]);
        f.results = vec![Value::node(3), Value::Param(1)];
        let dot = to_dot(&f);
        assert_balanced(&dot);
        assert!(dot.contains("n3 -> r0 [label=\"#0 ?\"]"), "{dot}");
        assert!(dot.contains("p1 -> r1 [label=\"?\"]"), "{dot}");
    }
}
