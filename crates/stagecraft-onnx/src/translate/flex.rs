//! `FlexAttention` (domain `ai.onnx.preview`): scaled dot-product
//! attention over 4-D `[B, H, L, E]` inputs whose scores and
//! probabilities pass through optional user subgraphs (`score_mod`,
//! `prob_mod`). The subgraphs are translated in place on the scores, like
//! the taken branch of an `If` whose condition is known, so their ops join
//! the surrounding translation.

use super::attention::repeat_heads;
use super::{dims, require_float, run_nodes, Ctx, Translate, Val};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DType;
use std::collections::HashMap;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "FlexAttention" => flex_attention as Translate,
        _ => return None,
    })
}

/// Translates the graph attribute `name` of the node, if set, on `x` (its
/// one input) and returns its one output.
fn apply_mod(c: &Ctx<'_>, name: &str, x: TensorHandle) -> Result<TensorHandle> {
    let Some(graph) = c
        .node
        .attribute
        .iter()
        .find(|a| a.name() == name)
        .and_then(|a| a.g.as_ref())
    else {
        return Ok(x);
    };
    if graph.input.len() != 1 || graph.output.len() != 1 {
        return Err(OnnxError::invalid(format!(
            "{name} must have one input and one output, has {} and {}",
            graph.input.len(),
            graph.output.len()
        )));
    }
    let mut scope: HashMap<String, Val> = HashMap::new();
    for init in &graph.initializer {
        let t = crate::tensor::decode(init)?;
        scope.insert(
            init.name().to_string(),
            Val {
                handle: c.constant(t.clone()),
                known: Some(t),
            },
        );
    }
    scope.insert(
        graph.input[0].name().to_string(),
        Val {
            handle: x,
            known: None,
        },
    );
    run_nodes(&graph.node, c.opset, c.device, &mut scope)?;
    let out = graph.output[0].name();
    scope
        .get(out)
        .map(|v| v.handle.clone())
        .ok_or_else(|| OnnxError::invalid(format!("output '{out}' of {name} is not computed")))
}

/// `softmax(score_mod(scale · Q Kᵀ)) V` with `prob_mod` applied to the
/// probabilities. Like the op's function body, `√scale` multiplies `Q` and
/// `K` in the input dtype, and the softmax and the product with `V` run in
/// f32 (f64 for f64 inputs).
fn flex_attention(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (q, k, v) = (c.input(0)?, c.input(1)?, c.input(2)?);
    require_float(c, &q)?;
    let dt = q.dtype();
    let (qd, kd, vd) = (dims(&q), dims(&k), dims(&v));
    if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 {
        return Err(OnnxError::unsupported(
            "FlexAttention needs 4-D [B, H, L, E] query, key and value",
        ));
    }
    let (hq, hkv) = (qd[1], kd[1]);
    if hkv == 0 || !hq.is_multiple_of(hkv) || vd[1] != hkv || kd[3] != qd[3] || vd[2] != kd[2] {
        return Err(OnnxError::invalid(format!(
            "query {qd:?}, key {kd:?} and value {vd:?} do not fit together"
        )));
    }
    let wide = if dt == DType::F64 { dt } else { DType::F32 };
    let scale = if c.has_attr("scale") {
        c.attr_float("scale", 1.0)
    } else {
        1.0 / (qd[3] as f32).sqrt()
    };
    let root = scale.sqrt() as f64;
    let k = repeat_heads(c, &k, hq / hkv)?;
    let v = repeat_heads(c, &v, hq / hkv)?;
    let qs = c.with_scalar(&ops::MUL, &q, root)?;
    let ks = c.with_scalar(&ops::MUL, &k, root)?;
    let mut mm = OpAttrs::new();
    mm.set_bool("transpose_b", true);
    let score = c.op1(&ops::MATMUL, &[qs, ks], &mm)?;
    let score = c.cast(&score, wide)?;
    let score = apply_mod(c, "score_mod", score)?;
    let mut sa = OpAttrs::new();
    sa.set_int("axis", 3);
    let prob = c.op1(&ops::SOFTMAX, &[score], &sa)?;
    let prob = apply_mod(c, "prob_mod", prob)?;
    let v = c.cast(&v, wide)?;
    let prob = c.cast(&prob, wide)?;
    let y = c.binary(&ops::MATMUL, &prob, &v)?;
    Ok(vec![c.cast(&y, dt)?])
}
