//! Control flow: ONNX `If`, `Loop` and `Scan` become stagecraft's
//! functional `If` and `While` ops (the cond_v2 design), never unrolled.
//!
//! Each subgraph is translated once on the tracer device into a graph
//! function. Subgraphs see the enclosing scope by name: a value of the
//! enclosing graph that a subgraph uses is captured by the trace and
//! becomes an extra input of the op (small constants are baked in).
//!
//! `Scan` and `Loop` run as one `While` op whose state is an iteration
//! counter, the loop-carried values and one buffer per scan output; the
//! buffers have the full iteration count along the scan axis and each
//! iteration writes its row with a select, so the iteration count of a
//! loop with scan outputs must be known when the node is translated.

use super::{dims, run_nodes, Ctx, Val};
use crate::error::{OnnxError, Result};
use crate::proto::{GraphProto, NodeProto};
use stagecraft_graph::Value;
use stagecraft_ops::{self as ops, OpAttrs};
use stagecraft_runtime::{tracing, Device, TensorHandle};
use stagecraft_tensor::{DType, DenseHostTensor, HostTensor, Location, Scalar, TensorMetadata};
use std::collections::HashMap;

/// Whether `op_type` is translated here (it needs the enclosing scope).
pub(crate) fn is_control(op_type: &str) -> bool {
    matches!(op_type, "If" | "Loop" | "Scan")
}

/// Translates a control-flow node whose inputs are `inputs` (`None` for
/// an absent optional input); `outer` is the scope its subgraphs see.
pub(crate) fn translate(
    node: &NodeProto,
    opset: i64,
    device: Device,
    inputs: Vec<Option<Val>>,
    outer: &HashMap<String, Val>,
) -> Result<Vec<Val>> {
    let ctx = Ctx::new(node, opset, device, inputs);
    let handles = match node.op_type() {
        "If" => {
            if let Some(pred) = ctx.known(0) {
                return if_known(&ctx, pred, outer);
            }
            if_op(&ctx, outer)
        }
        "Loop" => loop_op(&ctx, outer),
        "Scan" => scan_op(&ctx, outer),
        other => Err(OnnxError::invalid(format!("{other} is not control flow"))),
    }?;
    Ok(handles
        .into_iter()
        .map(|handle| Val {
            handle,
            known: None,
        })
        .collect())
}

/// An `If` whose condition is known before the model runs (computed from
/// constants and shapes): the taken branch is translated in place, so its
/// results stay known when they can be.
fn if_known(c: &Ctx<'_>, pred: &DenseHostTensor, outer: &HashMap<String, Val>) -> Result<Vec<Val>> {
    let flags = super::ints_of(pred)?;
    if flags.len() != 1 {
        return Err(OnnxError::invalid(format!(
            "If needs a one-element condition, got {} elements",
            flags.len()
        )));
    }
    let graph = graph_attr(
        c,
        if flags[0] != 0 {
            "then_branch"
        } else {
            "else_branch"
        },
    )?;
    let mut scope = outer.clone();
    for init in &graph.initializer {
        let t = crate::tensor::decode(init)?;
        scope.insert(
            init.name().to_string(),
            Val {
                handle: TensorHandle::available(c.device, t.clone().into()),
                known: Some(t),
            },
        );
    }
    run_nodes(&graph.node, c.opset, c.device, &mut scope)?;
    graph
        .output
        .iter()
        .map(|o| {
            scope.get(o.name()).cloned().ok_or_else(|| {
                OnnxError::invalid(format!(
                    "output '{}' of subgraph '{}' is not computed",
                    o.name(),
                    graph.name()
                ))
            })
        })
        .collect()
}

/// The graph attribute `name` of the node.
fn graph_attr<'a>(c: &Ctx<'a>, name: &str) -> Result<&'a GraphProto> {
    c.node
        .attribute
        .iter()
        .find(|a| a.name() == name)
        .and_then(|a| a.g.as_ref())
        .ok_or_else(|| OnnxError::invalid(format!("{} needs graph attribute {name}", c.op_type())))
}

/// Traces `body` over parameters of the given metadata into a function;
/// the frame is closed however `body` ends.
fn trace(
    name: &str,
    params: &[TensorMetadata],
    body: impl FnOnce(Vec<TensorHandle>) -> Result<Vec<TensorHandle>>,
) -> Result<tracing::Traced> {
    struct Guard(bool);
    impl Drop for Guard {
        fn drop(&mut self) {
            if !self.0 {
                tracing::abandon();
            }
        }
    }
    let placeholders = tracing::begin(name, params);
    let mut guard = Guard(false);
    let results = body(placeholders);
    guard.0 = true;
    match results {
        Ok(results) => Ok(tracing::end(&results, Location::caller())?),
        Err(e) => {
            tracing::abandon();
            Err(e)
        }
    }
}

/// Translates subgraph `graph` on the tracer device (inside an open
/// frame) with `inputs` bound to its inputs and `outer` visible by name;
/// returns its outputs.
fn run_graph(
    graph: &GraphProto,
    opset: i64,
    outer: &HashMap<String, Val>,
    inputs: Vec<TensorHandle>,
) -> Result<Vec<TensorHandle>> {
    let device = tracing::tracer_device();
    let mut scope = outer.clone();
    for init in &graph.initializer {
        let t = crate::tensor::decode(init)?;
        scope.insert(
            init.name().to_string(),
            Val {
                handle: TensorHandle::available(device, t.clone().into()),
                known: Some(t),
            },
        );
    }
    if graph.input.len() != inputs.len() {
        return Err(OnnxError::invalid(format!(
            "subgraph '{}' takes {} inputs, the op gives it {}",
            graph.name(),
            graph.input.len(),
            inputs.len()
        )));
    }
    for (vi, h) in graph.input.iter().zip(inputs) {
        scope.insert(
            vi.name().to_string(),
            Val {
                handle: h,
                known: None,
            },
        );
    }
    run_nodes(&graph.node, opset, device, &mut scope)?;
    graph
        .output
        .iter()
        .map(|o| {
            scope
                .get(o.name())
                .map(|v| v.handle.clone())
                .ok_or_else(|| {
                    OnnxError::invalid(format!(
                        "output '{}' of subgraph '{}' is not computed",
                        o.name(),
                        graph.name()
                    ))
                })
        })
        .collect()
}

/// `x` as a scalar (one element).
fn to_scalar(c: &Ctx<'_>, x: &TensorHandle) -> Result<TensorHandle> {
    if x.metadata().shape.numel() != 1 {
        return Err(OnnxError::invalid(format!(
            "{} needs a one-element condition, got shape {:?}",
            c.op_type(),
            dims(x)
        )));
    }
    c.reshape(x, &[])
}

/// ONNX `If`: both branches become functions of one `If` op; only the
/// taken one runs.
fn if_op(c: &Ctx<'_>, outer: &HashMap<String, Val>) -> Result<Vec<TensorHandle>> {
    let then_g = graph_attr(c, "then_branch")?;
    let else_g = graph_attr(c, "else_branch")?;
    let pred = c.cast(&to_scalar(c, &c.input(0)?)?, DType::Bool)?;
    let mut then_metas = Vec::new();
    let mut then_t = trace("then", &[], |_| {
        let r = run_graph(then_g, c.opset, outer, vec![])?;
        then_metas = r.iter().map(|h| h.metadata().clone()).collect();
        Ok(r)
    })?;
    let mut else_metas = Vec::new();
    let mut else_t = trace("else", &[], |_| {
        let r = run_graph(else_g, c.opset, outer, vec![])?;
        else_metas = r.iter().map(|h| h.metadata().clone()).collect();
        Ok(r)
    })?;
    if then_metas != else_metas {
        return Err(OnnxError::unsupported(format!(
            "If whose branches return different types or shapes ({then_metas:?} and {else_metas:?}) on a condition known only while the model runs"
        )));
    }
    let captures = tracing::unify_captures(0, &mut [&mut then_t, &mut else_t]);
    let mut attrs = OpAttrs::new();
    attrs
        .set_func("then_branch", then_t.function.register())
        .set_func("else_branch", else_t.function.register());
    let mut args = vec![pred];
    args.extend(captures);
    c.op(&ops::IF, &args, &attrs)
}

/// A scalar i64 constant on the tracer device.
fn int_scalar(v: i64) -> TensorHandle {
    let t = HostTensor::filled(
        Scalar::I64(v),
        &TensorMetadata::new(DType::I64, stagecraft_tensor::Shape::scalar()),
    );
    TensorHandle::available(tracing::tracer_device(), t)
}

/// The loop machinery shared by `Scan` and `Loop`: a `While` op over the
/// state `[i, carried..., buffers...]`.
struct LoopPlan<'a> {
    /// Iterations to run when known (needed for scan outputs).
    count: Option<usize>,
    /// The body's scan outputs: (axis, reversed) per output.
    scan_out: Vec<(i64, bool)>,
    /// The number of loop-carried values.
    carried: usize,
    /// Runs the ONNX body inside the body trace: given the counter and
    /// the carried values, returns (keep going, carried..., scan rows...);
    /// keep going is `None` when the loop only counts.
    step: &'a dyn Fn(&TensorHandle, &[TensorHandle]) -> Result<StepOut>,
}

/// What one iteration of a loop body computes.
struct StepOut {
    keep_going: Option<TensorHandle>,
    carried: Vec<TensorHandle>,
    rows: Vec<TensorHandle>,
}

/// Runs a [`LoopPlan`] from `init` (the carried values, then an optional
/// initial condition) and returns the final carried values and the
/// stacked scan outputs.
fn run_loop(
    c: &Ctx<'_>,
    plan: &LoopPlan<'_>,
    init: Vec<TensorHandle>,
    init_cond: Option<TensorHandle>,
    limit: Option<TensorHandle>,
) -> Result<Vec<TensorHandle>> {
    let n = plan.carried;
    let k = plan.scan_out.len();
    let with_cond = init_cond.is_some();
    // Probe the body once for the scan rows' metadata.
    let counter_meta = TensorMetadata::new(DType::I64, stagecraft_tensor::Shape::scalar());
    let carried_metas: Vec<TensorMetadata> = init.iter().map(|h| h.metadata().clone()).collect();
    let mut probe_params = vec![counter_meta.clone()];
    probe_params.extend(carried_metas.iter().cloned());
    let mut row_metas = Vec::new();
    trace("probe", &probe_params, |p| {
        let out = (plan.step)(&p[0], &p[1..])?;
        row_metas = out.rows.iter().map(|h| h.metadata().clone()).collect();
        Ok(vec![])
    })?;
    if k > 0 && plan.count.is_none() {
        return Err(OnnxError::unsupported(format!(
            "{} with scan outputs needs an iteration count known when the node is translated",
            c.op_type()
        )));
    }
    let count = plan.count.unwrap_or(0);
    let mut buffer_metas = Vec::new();
    let mut axes = Vec::new();
    for (m, &(axis, _)) in row_metas.iter().zip(&plan.scan_out) {
        let mut d = m.shape.dims().to_vec();
        let a = super::axis(axis, d.len() + 1)?;
        d.insert(a, count);
        axes.push(a);
        buffer_metas.push(TensorMetadata::new(
            m.dtype,
            stagecraft_tensor::Shape::from(d),
        ));
    }
    // State: counter, [cond], carried..., buffers...
    let mut state_metas = vec![counter_meta];
    if with_cond {
        state_metas.push(TensorMetadata::new(
            DType::Bool,
            stagecraft_tensor::Shape::scalar(),
        ));
    }
    state_metas.extend(carried_metas);
    state_metas.extend(buffer_metas.iter().cloned());
    let off = 1 + usize::from(with_cond);
    let fixed = state_metas.len();
    let limit_c = limit.clone();
    let mut cond_t = trace("cond", &state_metas, |p| {
        let tc = Ctx::new(c.node, c.opset, tracing::tracer_device(), vec![]);
        let mut go = match &limit_c {
            Some(m) => Some(tc.binary(&ops::LESS, &p[0], m)?),
            None => None,
        };
        if with_cond {
            go = Some(match go {
                Some(g) => tc.binary(&ops::LOGICAL_AND, &g, &p[1])?,
                None => p[1].clone(),
            });
        }
        let go = match go {
            Some(g) => g,
            None => {
                return Err(OnnxError::unsupported(format!(
                    "{} without an iteration count or a condition never ends",
                    c.op_type()
                )))
            }
        };
        Ok(vec![go])
    })?;
    let mut body_t = trace("body", &state_metas, |p| {
        let tc = Ctx::new(c.node, c.opset, tracing::tracer_device(), vec![]);
        let out = (plan.step)(&p[0], &p[off..off + n])?;
        let one = int_scalar(1);
        let mut results = vec![tc.binary(&ops::ADD, &p[0], &one)?];
        if with_cond {
            let g = match out.keep_going {
                Some(g) => tc.cast(&to_scalar(&tc, &g)?, DType::Bool)?,
                None => p[1].clone(),
            };
            results.push(g);
        }
        if out.carried.len() != n {
            return Err(OnnxError::invalid(format!(
                "the body returns {} loop-carried values, expected {n}",
                out.carried.len()
            )));
        }
        results.extend(out.carried);
        for (j, row) in out.rows.iter().enumerate() {
            let buf = &p[off + n + j];
            let a = axes[j];
            let (_, reversed) = plan.scan_out[j];
            let pos = if reversed {
                let last = int_scalar(count as i64 - 1);
                tc.binary(&ops::SUB, &last, &p[0])?
            } else {
                p[0].clone()
            };
            let bd = dims(buf);
            let mut rd = dims(row);
            rd.insert(a, 1);
            let row = tc.reshape(row, &rd)?;
            let mut idx_dims = vec![1; bd.len()];
            idx_dims[a] = count;
            let idx: Vec<i64> = (0..count as i64).collect();
            let idx = tc.constant(DenseHostTensor::from_slice(&idx, idx_dims)?);
            let here = tc.binary(&ops::EQUAL, &idx, &pos)?;
            let mut b = OpAttrs::new();
            b.set_dims("shape", &bd);
            let here = tc.op1(&ops::BROADCAST_TO, &[here], &b)?;
            let row = tc.op1(&ops::BROADCAST_TO, &[row], &b)?;
            results.push(tc.op1(&ops::SELECT, &[here, row, buf.clone()], &OpAttrs::new())?);
        }
        Ok(results)
    })?;
    let captures = tracing::unify_captures(fixed, &mut [&mut cond_t, &mut body_t]);
    body_t
        .function
        .results
        .extend((0..captures.len()).map(|j| Value::Param((fixed + j) as u32)));
    let mut attrs = OpAttrs::new();
    attrs
        .set_func("cond", cond_t.function.register())
        .set_func("body", body_t.function.register());
    let mut args = vec![c.constant(DenseHostTensor::from_slice(
        &[0i64],
        stagecraft_tensor::Shape::scalar(),
    )?)];
    if with_cond {
        let g = match init_cond {
            Some(g) => c.cast(&to_scalar(c, &g)?, DType::Bool)?,
            None => c.constant(DenseHostTensor::from_slice(
                &[true],
                stagecraft_tensor::Shape::scalar(),
            )?),
        };
        args.push(g);
    }
    args.extend(init);
    for m in &buffer_metas {
        let zero = HostTensor::filled(Scalar::F64(0.0).cast(m.dtype), m);
        args.push(c.constant(zero.to_dense()?));
    }
    args.extend(captures);
    let results = c.op(&ops::WHILE, &args, &attrs)?;
    Ok(results.into_iter().skip(off).take(n + k).collect())
}

/// ONNX `Scan` (opset 9 and later): the scan inputs are sliced along
/// their axes per iteration; the state is carried; scan outputs stack.
fn scan_op(c: &Ctx<'_>, outer: &HashMap<String, Val>) -> Result<Vec<TensorHandle>> {
    if c.opset < 9 {
        return Err(OnnxError::unsupported(
            "Scan before opset 9 (a batch axis and sequence_lens)",
        ));
    }
    let body = graph_attr(c, "body")?;
    let m = c.attr_int("num_scan_inputs", 0) as usize;
    let inputs = c.inputs();
    if m > inputs.len() {
        return Err(OnnxError::invalid("num_scan_inputs exceeds the inputs"));
    }
    let n = inputs.len() - m;
    let k =
        body.output.len().checked_sub(n).ok_or_else(|| {
            OnnxError::invalid("the Scan body returns fewer values than the state")
        })?;
    let scans: Vec<TensorHandle> = inputs[n..].to_vec();
    let in_axes = c.attr_ints("scan_input_axes").unwrap_or(vec![0; m]);
    let in_dirs = c.attr_ints("scan_input_directions").unwrap_or(vec![0; m]);
    let out_axes = c.attr_ints("scan_output_axes").unwrap_or(vec![0; k]);
    let out_dirs = c.attr_ints("scan_output_directions").unwrap_or(vec![0; k]);
    if in_axes.len() != m || in_dirs.len() != m || out_axes.len() != k || out_dirs.len() != k {
        return Err(OnnxError::invalid(
            "Scan axes or directions of the wrong length",
        ));
    }
    let mut count = None;
    let mut axes = Vec::new();
    for (x, &a) in scans.iter().zip(&in_axes) {
        let d = dims(x);
        let a = super::axis(a, d.len())?;
        if *count.get_or_insert(d[a]) != d[a] {
            return Err(OnnxError::invalid("the scan inputs differ in length"));
        }
        axes.push(a);
    }
    let count = count.ok_or_else(|| OnnxError::unsupported("Scan without scan inputs"))?;
    let step = |i: &TensorHandle, carried: &[TensorHandle]| -> Result<StepOut> {
        let tc = Ctx::new(c.node, c.opset, tracing::tracer_device(), vec![]);
        let mut body_in = carried.to_vec();
        for (j, x) in scans.iter().enumerate() {
            let pos = if in_dirs[j] != 0 {
                tc.binary(&ops::SUB, &int_scalar(count as i64 - 1), i)?
            } else {
                i.clone()
            };
            let pos = tc.reshape(&pos, &[1])?;
            let mut g = OpAttrs::new();
            g.set_int("axis", axes[j] as i64);
            let slice = tc.op1(&ops::GATHER, &[x.clone(), pos], &g)?;
            let mut d = dims(x);
            d.remove(axes[j]);
            body_in.push(tc.reshape(&slice, &d)?);
        }
        let mut outs = run_graph(body, c.opset, outer, body_in)?;
        let rows = outs.split_off(n);
        Ok(StepOut {
            keep_going: None,
            carried: outs,
            rows,
        })
    };
    let plan = LoopPlan {
        count: Some(count),
        scan_out: out_axes
            .iter()
            .zip(&out_dirs)
            .map(|(&a, &d)| (a, d != 0))
            .collect(),
        carried: n,
        step: &step,
    };
    let limit = int_scalar(count as i64);
    run_loop(c, &plan, inputs[..n].to_vec(), None, Some(limit))
}

/// ONNX `Loop`: runs while the iteration count (if given) is not reached
/// and the condition (if given) holds. Scan outputs need a known count and
/// a body that never ends the loop early (its condition output is its
/// condition input or a constant true).
fn loop_op(c: &Ctx<'_>, outer: &HashMap<String, Val>) -> Result<Vec<TensorHandle>> {
    let body = graph_attr(c, "body")?;
    let n = c.node.input.len().saturating_sub(2);
    let k = body
        .output
        .len()
        .checked_sub(1 + n)
        .ok_or_else(|| OnnxError::invalid("the Loop body returns too few values"))?;
    let count = match c.known(0) {
        Some(t) => super::ints_of(t)?.first().map(|&v| v.max(0) as usize),
        None => None,
    };
    let limit = match (c.opt_input(0), count) {
        (_, Some(m)) => Some(int_scalar(m as i64)),
        (Some(h), None) => Some(c.cast(&to_scalar(c, h)?, DType::I64)?),
        (None, None) => None,
    };
    let init_cond = c.opt_input(1).cloned();
    if k > 0 {
        let cond_known_true = match c.opt_input(1) {
            None => true,
            Some(_) => c
                .known(1)
                .is_some_and(|t| super::ints_of(t).is_ok_and(|v| v.iter().all(|&x| x != 0))),
        };
        let body_cond = body.output.first().map(|o| o.name()).unwrap_or("");
        let cond_in = body.input.get(1).map(|i| i.name()).unwrap_or("");
        let passthrough = body_cond == cond_in
            || body.node.iter().any(|nd| {
                nd.op_type() == "Identity"
                    && nd.output.first().map(String::as_str) == Some(body_cond)
                    && nd.input.first().map(String::as_str) == Some(cond_in)
            });
        if !(cond_known_true && passthrough) {
            return Err(OnnxError::unsupported(
                "Loop with scan outputs whose body may end it early (the outputs' length is known only while it runs)",
            ));
        }
        if count.is_none() {
            return Err(OnnxError::unsupported(
                "Loop with scan outputs needs an iteration count known when the node is translated",
            ));
        }
    }
    let init: Vec<TensorHandle> = (0..n).map(|j| c.input(2 + j)).collect::<Result<_>>()?;
    let has_cond = init_cond.is_some();
    let cond_meta_true = c.constant(DenseHostTensor::from_slice(
        &[true],
        stagecraft_tensor::Shape::scalar(),
    )?);
    let step = |i: &TensorHandle, carried: &[TensorHandle]| -> Result<StepOut> {
        let mut body_in = vec![i.clone(), cond_meta_true.clone()];
        body_in.extend(carried.iter().cloned());
        let mut outs = run_graph(body, c.opset, outer, body_in)?;
        let rows = outs.split_off(1 + n);
        let keep = outs.remove(0);
        Ok(StepOut {
            keep_going: if has_cond || count.is_none() {
                Some(keep)
            } else {
                None
            },
            carried: outs,
            rows,
        })
    };
    let plan = LoopPlan {
        count: if k > 0 { count } else { None },
        scan_out: vec![(0, false); k],
        carried: n,
        step: &step,
    };
    let init_cond = match init_cond {
        Some(g) => Some(g),
        None if count.is_none() => Some(cond_meta_true.clone()),
        None => None,
    };
    run_loop(c, &plan, init, init_cond, limit)
}
