//! Functional control flow: `If`, `While` and `Call` are single ops whose
//! attributes name library functions (the cond_v2 design). Their metadata
//! functions check the functions' signatures against the arguments, so a
//! branch or body mismatch is found when the op is created.

use crate::attrs::AttrKind;
use crate::func::{function_name, function_signature, FuncId, FunctionSignature};
use crate::grad::{
    gradient_function, if_residuals, while_gradient, while_residuals, GradBuilder, GradContext,
    InputGrads, G,
};
use crate::op::*;
use stagecraft_tensor::{DType, Error, Result, TensorMetadata};

fn signature(attrs: &Attrs<'_>, name: &str) -> Result<(FuncId, FunctionSignature)> {
    let id = attrs.func(name)?;
    let sig = function_signature(id).ok_or_else(|| {
        Error::attribute(format!(
            "attribute `{name}` names function {} which does not exist",
            id.0
        ))
    })?;
    Ok((id, sig))
}

fn list(metas: &[TensorMetadata]) -> String {
    let items: Vec<String> = metas.iter().map(|m| m.to_string()).collect();
    format!("({})", items.join(", "))
}

fn check_params(
    role: &str,
    id: FuncId,
    sig: &FunctionSignature,
    args: &[TensorMetadata],
) -> Result<()> {
    if sig.inputs.as_slice() != args {
        return Err(Error::shape(format!(
            "the {role} @{} takes {} but is given {}",
            function_name(id),
            list(&sig.inputs),
            list(args)
        )));
    }
    Ok(())
}

fn require_bool_scalar(role: &str, meta: &TensorMetadata) -> Result<()> {
    if meta.dtype != DType::Bool || meta.shape.numel() != 1 {
        return Err(Error::dtype(format!(
            "{role} must be a bool tensor with one element, got {meta}"
        )));
    }
    Ok(())
}

fn if_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    require_bool_scalar("the predicate", &inputs[0])?;
    let args = &inputs[1..];
    let (then_id, then_sig) = signature(attrs, "then_branch")?;
    let (else_id, else_sig) = signature(attrs, "else_branch")?;
    check_params("then branch", then_id, &then_sig, args)?;
    check_params("else branch", else_id, &else_sig, args)?;
    if then_sig.outputs != else_sig.outputs {
        return Err(Error::shape(format!(
            "the branches return different types: then @{} returns {}, else @{} returns {}",
            function_name(then_id),
            list(&then_sig.outputs),
            function_name(else_id),
            list(&else_sig.outputs)
        )));
    }
    Ok(then_sig.outputs.into_iter().collect())
}

fn while_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (cond_id, cond_sig) = signature(attrs, "cond")?;
    let (body_id, body_sig) = signature(attrs, "body")?;
    check_params("condition", cond_id, &cond_sig, inputs)?;
    check_params("body", body_id, &body_sig, inputs)?;
    match cond_sig.outputs.as_slice() {
        [out] => require_bool_scalar("the loop condition's result", out)?,
        other => {
            return Err(Error::shape(format!(
                "the loop condition @{} must return one bool scalar, it returns {}",
                function_name(cond_id),
                list(other)
            )))
        }
    }
    if body_sig.outputs.as_slice() != inputs {
        return Err(Error::shape(format!(
            "the loop body @{} must return the loop state's types {}, it returns {} \
             (loop-carried values keep their dtype and shape)",
            function_name(body_id),
            list(inputs),
            list(&body_sig.outputs)
        )));
    }
    if attrs.int("max_iterations")? < -1 {
        return Err(Error::attribute(
            "`max_iterations` must be -1 (no limit) or non-negative",
        ));
    }
    Ok(inputs.iter().cloned().collect())
}

fn call_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (id, sig) = signature(attrs, "f")?;
    check_params("function", id, &sig, inputs)?;
    Ok(sig.outputs.into_iter().collect())
}

/// `If(pred, args...)`: runs `then_branch(args...)` when `pred` holds, else
/// `else_branch(args...)`; only the taken branch runs.
pub static IF: OpDef = OpDef {
    name: "If",
    inputs: &["pred"],
    variadic: true,
    outputs: 0,
    attrs: &[
        AttrSpec::required("then_branch", AttrKind::Func),
        AttrSpec::required("else_branch", AttrKind::Func),
    ],
    kind: OpKind::Control(ControlOp::If),
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: if_meta,
    grad: Some(if_grad),
};

/// `While(state...)`: `state = body(state)` while `cond(state)` holds; the
/// result is the final state. Loop-carried values keep dtype and shape.
pub static WHILE: OpDef = OpDef {
    name: "While",
    inputs: &["state"],
    variadic: true,
    outputs: 0,
    attrs: &[
        AttrSpec::required("cond", AttrKind::Func),
        AttrSpec::required("body", AttrKind::Func),
        AttrSpec::optional("max_iterations", AttrKind::Int, AttrDefault::Int(-1)),
    ],
    kind: OpKind::Control(ControlOp::While),
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: while_meta,
    grad: Some(while_grad),
};

/// `Call(args...)`: runs the function `f`.
pub static CALL: OpDef = OpDef {
    name: "Call",
    inputs: &[],
    variadic: true,
    outputs: 0,
    attrs: &[AttrSpec::required("f", AttrKind::Func)],
    kind: OpKind::Control(ControlOp::Call),
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: call_meta,
    grad: Some(call_grad),
};

/// The incoming gradient of each of the first `count` outputs, zeros where
/// none flows (a gradient function takes one per result).
fn grads_of(b: &mut dyn GradBuilder, ctx: &GradContext<'_>, count: usize) -> Result<Vec<G>> {
    ctx.outputs[..count]
        .iter()
        .zip(ctx.grads)
        .map(|(out, g)| match g {
            Some(g) => Ok(*g),
            None => {
                let meta = b.meta(*out);
                b.fill(0.0, &meta)
            }
        })
        .collect()
}

/// The incoming gradient of every output.
fn all_grads(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<Vec<G>> {
    grads_of(b, ctx, ctx.outputs.len())
}

/// True when no gradient flows into the outputs from `from` on (the
/// residuals), which is every first-order use.
fn residuals_get_no_gradient(ctx: &GradContext<'_>, from: usize) -> bool {
    ctx.grads.iter().skip(from).all(Option::is_none)
}

/// The gradient of an If is an If on the same predicate whose branches are
/// the backward halves of the forward branches. The forward If, augmented
/// when it was recorded, returned the intermediates those halves need as
/// extra outputs (the branch that did not run returns placeholders), so
/// nothing is recomputed. An If that was not augmented, or whose residuals
/// receive gradients themselves (higher order), differentiates its branches
/// whole: the gradient branches recompute the forward values.
fn if_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (then_f, else_f) = (
        ctx.attrs.func("then_branch")?,
        ctx.attrs.func("else_branch")?,
    );
    if let Some(plan) = if_residuals(then_f, else_f) {
        if residuals_get_no_gradient(ctx, plan.results) {
            let mut inputs: Vec<G> = ctx.inputs.to_vec();
            inputs.extend_from_slice(&ctx.outputs[plan.results..]);
            inputs.extend(grads_of(b, ctx, plan.results)?);
            let mut attrs = crate::OpAttrs::new();
            attrs
                .set_func("then_branch", plan.then_backward)
                .set_func("else_branch", plan.else_backward);
            let grads = b.op_multi(&IF, &inputs, &attrs)?;
            let mut out = InputGrads::new();
            out.push(None);
            out.extend(grads.into_iter().map(Some));
            return Ok(out);
        }
    }
    let then_g = gradient_function(then_f)?;
    let else_g = gradient_function(else_f)?;
    let mut inputs: Vec<G> = ctx.inputs.to_vec();
    inputs.extend(all_grads(b, ctx)?);
    let mut attrs = crate::OpAttrs::new();
    attrs
        .set_func("then_branch", then_g)
        .set_func("else_branch", else_g);
    let grads = b.op_multi(&IF, &inputs, &attrs)?;
    let mut out = InputGrads::new();
    out.push(None);
    out.extend(grads.into_iter().map(Some));
    Ok(out)
}

/// The gradient of a Call is a Call of the callee's gradient function.
fn call_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let f_g = gradient_function(ctx.attrs.func("f")?)?;
    let mut inputs: Vec<G> = ctx.inputs.to_vec();
    inputs.extend(all_grads(b, ctx)?);
    let mut attrs = crate::OpAttrs::new();
    attrs.set_func("f", f_g);
    Ok(b.op_multi(&CALL, &inputs, &attrs)?
        .into_iter()
        .map(Some)
        .collect())
}

/// Reverse mode through a While with a data-dependent trip count. The
/// forward loop, augmented when it was recorded, pushed the values the
/// body's gradient needs onto one list per value and counted its trips
/// `n`; the gradient is a While that runs `n` times, popping one
/// iteration's values and running the body's backward half, from the last
/// iteration to the first. Memory: `n` times the stacked values' size
/// (values that do not change across iterations are not stacked); compute:
/// one backward body per iteration.
///
/// A loop that was not augmented, or whose lists receive gradients (higher
/// order), takes the fallback: a counting loop finds `n`, and the reverse
/// loop recomputes the state entering iteration `k` from the initial
/// state, which keeps memory at one state for O(n²) body runs.
fn while_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (cond, body) = (ctx.attrs.func("cond")?, ctx.attrs.func("body")?);
    if let Some(plan) = while_residuals(cond, body) {
        if residuals_get_no_gradient(ctx, plan.state) {
            let n = plan.state;
            let mut reverse_in: Vec<G> = ctx.outputs[n..n + plan.lists + 1].to_vec();
            reverse_in.extend(grads_of(b, ctx, n)?);
            reverse_in.extend(plan.invariants.iter().map(|&i| ctx.inputs[i]));
            let mut attrs = crate::OpAttrs::new();
            attrs
                .set_func("cond", plan.reverse_cond)
                .set_func("body", plan.reverse_body);
            let reversed = b.op_multi(&WHILE, &reverse_in, &attrs)?;
            let first = plan.lists + 1;
            let mut out: InputGrads = reversed[first..first + n]
                .iter()
                .map(|g| Some(*g))
                .collect();
            out.extend((n..ctx.inputs.len()).map(|_| None));
            return Ok(out);
        }
    }
    if ctx.attrs.int("max_iterations")? >= 0 {
        return Err(Error::invalid(
            "the gradient of a While with max_iterations is not supported",
        ));
    }
    let plan = while_gradient(ctx.attrs.func("cond")?, ctx.attrs.func("body")?)?;
    let n_all = ctx.inputs.len();
    let zero = b.fill(
        0.0,
        &TensorMetadata::new(DType::I64, stagecraft_tensor::Shape::scalar()),
    )?;
    let mut count_in: Vec<G> = ctx.inputs.to_vec();
    count_in.push(zero);
    let mut attrs = crate::OpAttrs::new();
    attrs
        .set_func("cond", plan.count_cond)
        .set_func("body", plan.count_body);
    let counted = b.op_multi(&WHILE, &count_in, &attrs)?;
    let trips = counted[n_all];
    let mut reverse_in: Vec<G> = ctx.inputs.to_vec();
    reverse_in.push(trips);
    reverse_in.extend(all_grads(b, ctx)?);
    let mut attrs = crate::OpAttrs::new();
    attrs
        .set_func("cond", plan.reverse_cond)
        .set_func("body", plan.reverse_body);
    let reversed = b.op_multi(&WHILE, &reverse_in, &attrs)?;
    Ok(reversed[n_all + 1..].iter().map(|g| Some(*g)).collect())
}
