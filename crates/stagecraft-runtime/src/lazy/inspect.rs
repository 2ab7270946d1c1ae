//! Looking at a trace without running it: the trace a tensor's read or
//! this thread's `mark_step` would run, as a graph function, text or DOT.

use super::cache::{build_function, cached_modes, Mode};
use super::collect::{collect, Collected};
use super::record::live_roots;
use crate::handle::TensorHandle;
use stagecraft_graph::{text, Function};
use stagecraft_tensor::{Error, Result};

fn describe(handle: &TensorHandle) -> Result<(Collected, Vec<Mode>)> {
    let lazy = handle
        .lazy_ref()
        .ok_or_else(|| Error::invalid("the tensor is not a pending lazy tensor"))?;
    if lazy.op.is_done() {
        return Err(Error::invalid(
            "the tensor is already materialized: its trace has run",
        ));
    }
    let collected = collect(&[(lazy.op.clone(), lazy.index)])?;
    let modes = cached_modes(&collected);
    Ok((collected, modes))
}

/// The trace [`mark_step`](super::mark_step) would run now, as a graph
/// function, before and
/// after the optimization passes that compiling it runs.
#[derive(Clone, Debug)]
pub struct StepTrace {
    /// The trace as recorded (what [`trace_text`] prints for one tensor).
    pub recorded: Function,
    /// The same function after `stagecraft_graph::passes::optimize`: what
    /// the executor instantiates.
    pub optimized: Function,
}

/// The trace that [`mark_step`](super::mark_step) would run now for this
/// thread's live tensors on the first target device holding pending work,
/// without running it (the pending ops stay pending and the next
/// `mark_step` runs them as usual). An error when nothing is pending.
pub fn step_trace() -> Result<StepTrace> {
    let mut roots = live_roots(false);
    let target = roots
        .first()
        .map(|(op, _)| op.target)
        .ok_or_else(|| Error::invalid("no live lazy tensor is pending: there is no step trace"))?;
    roots.retain(|(op, _)| op.target == target);
    let collected = collect(&roots)?;
    let modes = cached_modes(&collected);
    let recorded = build_function(
        "lazyTrace_step".to_string(),
        &collected.skeleton(),
        &modes,
        &collected.ops,
        &collected.locations,
    );
    let optimized =
        stagecraft_graph::passes::optimize(&recorded, &stagecraft_cpu::CONSTANT_KERNELS);
    Ok(StepTrace {
        recorded,
        optimized,
    })
}

/// The trace that materializing `handle` now would run, in the lazy-tensor
/// text form, with its live outputs listed after `return`.
pub fn trace_text(handle: &TensorHandle) -> Result<String> {
    let (collected, modes) = describe(handle)?;
    let name = format!("lazyTrace_{}", collected.ops.len());
    let f = build_function(
        name,
        &collected.skeleton(),
        &modes,
        &collected.ops,
        &collected.locations,
    );
    let printed = text::print(&f);
    let mut out = String::new();
    for line in printed.lines() {
        let line = line.strip_prefix('@').unwrap_or(line);
        // The seed's form: no per-node metadata or locations.
        let line = match line.find(") : ") {
            Some(cut) if line.trim_start().starts_with('%') => &line[..=cut],
            _ => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    let requested: Vec<String> = collected
        .requested
        .iter()
        .map(|&i| text::value_name(&f, f.results[i]))
        .collect();
    let live: Vec<String> = (0..f.results.len())
        .filter(|i| !collected.requested.contains(i))
        .map(|i| text::value_name(&f, f.results[i]))
        .collect();
    out.push_str(&format!(
        "// requested: {}; live: {}\n",
        requested.join(", "),
        if live.is_empty() {
            "none".to_string()
        } else {
            live.join(", ")
        }
    ));
    Ok(out)
}

/// The same trace as [`trace_text`], as Graphviz DOT.
pub fn trace_dot(handle: &TensorHandle) -> Result<String> {
    let (collected, modes) = describe(handle)?;
    let name = format!("lazyTrace_{}", collected.ops.len());
    let f = build_function(
        name,
        &collected.skeleton(),
        &modes,
        &collected.ops,
        &collected.locations,
    );
    Ok(stagecraft_graph::dot::to_dot(&f))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{binary, lazy_device, scalar, unary};
    use super::*;

    #[test]
    fn trace_text_lists_the_ops_and_the_live_outputs() {
        let d = lazy_device();
        let w = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        let y = binary(&stagecraft_ops::MUL, &w, &w);
        let text = trace_text(&y).unwrap();
        assert!(text.starts_with("lazyTrace_2("), "{text}");
        assert!(text.contains("Neg") && text.contains("Mul"), "{text}");
        let last = text.lines().last().unwrap();
        assert!(
            last.starts_with("// requested: %") && !last.ends_with("live: none"),
            "{text}"
        );
        drop(w);
        let text = trace_text(&y).unwrap();
        assert!(
            text.lines().last().unwrap().ends_with("live: none"),
            "{text}"
        );
        assert!(trace_dot(&y).unwrap().starts_with("digraph"));
    }

    #[test]
    fn a_materialized_tensor_has_no_trace() {
        let d = lazy_device();
        let y = unary(&stagecraft_ops::NEG, &scalar(1.0, d));
        y.wait().unwrap();
        let err = trace_text(&y).unwrap_err();
        assert!(err.to_string().contains("already materialized"), "{err}");
        let concrete = scalar(1.0, d);
        assert!(trace_text(&concrete).is_err());
    }

    /// `step_trace` shows this thread's live work only, and leaves it
    /// pending.
    #[test]
    fn the_step_trace_is_this_threads_and_runs_nothing() {
        let d = lazy_device();
        let y = unary(&stagecraft_ops::EXP, &scalar(0.0, d));
        let step = step_trace().unwrap();
        let ops: Vec<&str> = step
            .recorded
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                stagecraft_graph::NodeOp::Op(def, _) => Some(def.name),
                _ => None,
            })
            .collect();
        assert_eq!(ops, ["Exp"]);
        assert!(!y.lazy_ref().unwrap().op.is_done());
        let elsewhere = std::thread::spawn(|| step_trace().err().map(|e| e.to_string()));
        let err = elsewhere.join().unwrap().expect("nothing pending there");
        assert!(err.contains("no live lazy tensor is pending"), "{err}");
    }
}
