//! Kernels of the control-flow ops. `If`, `While` and `Call` run the
//! executables of the library functions their attributes name, on the
//! device the op runs on.

use super::partition::should_stop;
use super::{instantiate_library, Executable};
use crate::device::Device;
use stagecraft_cpu::{KernelContext, ValueInputs, ValueKernel};
use stagecraft_ops::{Attrs, ControlOp, OpAttrs, OpDef, OpKind};
use stagecraft_tensor::{Error, HostTensor, Result};
use std::sync::Arc;

fn truth(value: &HostTensor) -> Result<bool> {
    if let HostTensor::Scalar(s) = value {
        return Ok(s.value().to_f64() != 0.0);
    }
    let dense = value.to_dense()?;
    let flags = dense.as_slice::<bool>()?;
    match flags {
        [flag] => Ok(*flag),
        _ => Err(Error::shape(format!(
            "a predicate must have one element, got {}",
            dense.metadata()
        ))),
    }
}

/// The kernel of a control-flow op on `device`; the functions it names are
/// instantiated now, so a bad branch fails when the op is first run.
pub(crate) fn control_kernel(
    op: &'static OpDef,
    attrs: &OpAttrs,
    device: Device,
) -> Result<ValueKernel> {
    let attrs = Attrs::new(attrs, op);
    let OpKind::Control(kind) = op.kind else {
        return Err(Error::internal(format!(
            "{} is not a control-flow op",
            op.name
        )));
    };
    Ok(match kind {
        ControlOp::If => {
            let then_exe = instantiate_library(attrs.func("then_branch")?, device)?;
            let else_exe = instantiate_library(attrs.func("else_branch")?, device)?;
            Arc::new(move |inputs: ValueInputs, _: &KernelContext<'_>| {
                let mut inputs = inputs.into_iter();
                let pred = inputs
                    .next()
                    .ok_or_else(|| Error::internal("If without a predicate"))?;
                let exe = if truth(&pred)? { &then_exe } else { &else_exe };
                Ok(exe.run(inputs.collect())?.into_iter().collect())
            })
        }
        ControlOp::Call => {
            let exe = instantiate_library(attrs.func("f")?, device)?;
            Arc::new(move |inputs: ValueInputs, _: &KernelContext<'_>| {
                Ok(exe.run(inputs.into_vec())?.into_iter().collect())
            })
        }
        ControlOp::While => {
            let cond = instantiate_library(attrs.func("cond")?, device)?;
            let body = instantiate_library(attrs.func("body")?, device)?;
            let limit = attrs.int("max_iterations")?;
            Arc::new(move |inputs: ValueInputs, _: &KernelContext<'_>| {
                Ok(run_while(&cond, &body, limit, inputs.into_vec())?
                    .into_iter()
                    .collect())
            })
        }
    })
}

/// `state = body(state)` while `cond(state)`, checking cancellation (and
/// the failure of a partitioned run it belongs to) every iteration so that
/// a long loop stops promptly.
fn run_while(
    cond: &Executable,
    body: &Executable,
    limit: i64,
    mut state: Vec<HostTensor>,
) -> Result<Vec<HostTensor>> {
    let mut iterations: i64 = 0;
    // The verdict and the next state in vectors kept across iterations:
    // a small loop allocates nothing per iteration for them.
    let mut verdict = Vec::with_capacity(1);
    let mut next = Vec::with_capacity(state.len());
    loop {
        if should_stop() {
            return Err(Error::cancelled());
        }
        if limit >= 0 && iterations >= limit {
            return Ok(state);
        }
        cond.run_into(state.iter().cloned(), &mut verdict)?;
        let keep_going = match verdict.as_slice() {
            [flag] => truth(flag)?,
            _ => return Err(Error::internal("a loop condition returned no single value")),
        };
        verdict.clear();
        if !keep_going {
            return Ok(state);
        }
        body.run_into(state.drain(..), &mut next)?;
        std::mem::swap(&mut state, &mut next);
        iterations += 1;
    }
}
