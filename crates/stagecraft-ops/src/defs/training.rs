//! Ops only training uses: dropout from the counter-based random stream,
//! the squared norm over a list of tensors that gradient clipping reduces
//! in one kernel, and Adam's update of one parameter in one pass.

use super::{one, require_float};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use smallvec::smallvec;
use stagecraft_tensor::{DType, Error, Result, Shape, TensorMetadata};

/// Inverted dropout: each element of `x` is zeroed with probability `p`
/// and the survivors are scaled by `1 / (1 - p)`.
///
/// The mask is a pure function of the `key` input, an i64 tensor `[seed,
/// offset]`: element `i` survives when the 24-bit uniform of lane `i % 4`
/// of Philox block `offset + i / 4` (the same layout as `RandomUniform`'s
/// f32 draws) is at least `p`. The key is an input, not an attribute, so a
/// lazy training loop whose key changes every step still replays one
/// cached trace (the key is a small leaf that widening promotes to a trace
/// argument). `p = 1` zeroes everything.
///
/// The gradient is the same dropout of the incoming gradient: the same key
/// gives the same mask and the same scale.
pub static DROPOUT: OpDef = OpDef {
    name: "Dropout",
    inputs: &["x", "key"],
    variadic: false,
    outputs: 1,
    attrs: &[AttrSpec::required("p", AttrKind::Float)],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: dropout_meta,
    grad: Some(dropout_grad),
};

/// The threshold of dropout's mask: element `i` survives when its 24-bit
/// uniform, as an integer (`word >> 8`), is at least this (`⌈p·2²⁴⌉`,
/// which no 24-bit integer reaches when `p = 1`). Every device's kernel
/// draws the mask with it.
pub fn dropout_threshold(p: f64) -> u32 {
    (p * (1u64 << 24) as f64).ceil() as u32
}

fn dropout_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (x, key) = (&inputs[0], &inputs[1]);
    require_float("x", x)?;
    if key.dtype != DType::I64 || key.shape.dims() != [2] {
        return Err(Error::dtype(format!(
            "the key must be an i64 tensor [seed, offset] of shape [2], got {key}"
        )));
    }
    let p = attrs.float("p")?;
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::attribute(format!(
            "the drop probability p must lie in [0, 1], got {p}"
        )));
    }
    one(x.clone())
}

fn dropout_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (key, g) = (ctx.inputs[1], ctx.grad()?);
    let mut attrs = crate::OpAttrs::new();
    attrs.set_float("p", ctx.attrs.float("p")?);
    let dx = b.op(&DROPOUT, &[g, key], &attrs)?;
    Ok(smallvec![Some(dx), None])
}

/// `Σ_k Σ_i xs[k][i]²` over every element of every input, as a rank-0
/// tensor of the inputs' (common, floating-point) dtype: the global norm
/// of a parameter list, squared, in one reduction (gradient clipping).
/// Narrow dtypes are summed in f64 and rounded once.
pub static SQUARED_NORM: OpDef = OpDef {
    name: "SquaredNorm",
    inputs: &["xs"],
    variadic: true,
    outputs: 1,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: squared_norm_meta,
    grad: Some(squared_norm_grad),
};

fn squared_norm_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    let first = &inputs[0];
    require_float("xs[0]", first)?;
    for (i, x) in inputs.iter().enumerate().skip(1) {
        if x.dtype != first.dtype {
            return Err(Error::dtype(format!(
                "xs[{i}] is {x} but xs[0] is {first}: every tensor must share one dtype"
            )));
        }
    }
    one(TensorMetadata::new(first.dtype, Shape::scalar()))
}

/// `d/dx (Σ x²) = 2x`, scaled by the incoming (scalar) gradient.
fn squared_norm_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let g = ctx.grad()?;
    let g2 = b.scale(g, 2.0)?;
    let mut grads = InputGrads::new();
    for &x in ctx.inputs {
        let dims = b.meta(x).shape;
        let spread = b.broadcast_to(g2, dims.dims())?;
        grads.push(Some(b.mul(spread, x)?));
    }
    Ok(grads)
}

/// One Adam or AdamW step of one parameter, in one pass over its elements:
/// the new parameter and both moments from the parameter, its gradient and
/// the old moments (`stagecraft::optim` uses it where the device has a
/// kernel for it). Written as separate elementwise ops, the update is
/// three kernels (the moments are both results and inputs of the
/// parameter's update, so fusion cannot merge them) and reads the moments
/// twice; its step is memory-bound (docs/performance.md).
///
/// Inputs: `param`, `grad`, `m`, `v` of one float dtype and shape, and
/// four rank-0 tensors of that dtype, so that a schedule changes values,
/// not the op: `lr`, `bias1 = 1 - beta1^t`, `bias2 = 1 - beta2^t` and
/// `decay` (AdamW's `1 - lr * weight_decay`; 1 for none). Attributes:
/// `beta1`, `beta2`, `eps`, and `weight_decay`, Adam's L2 term added to
/// the gradient (0 for AdamW). With `b1 = beta1`, `c1 = 1 - beta1` (each
/// rounded to the dtype once), likewise `b2`, `c2`, each step rounded as
/// the separate ops would:
///
/// ```text
/// g  = weight_decay == 0 ? grad : grad + param * weight_decay
/// m' = m * b1 + g * c1
/// v' = v * b2 + (g * g) * c2
/// p' = param * decay - (m' / bias1) / (sqrt(v' / bias2) + eps) * lr
/// ```
///
/// Outputs: `p'`, `m'`, `v'`, bit for bit what those ops give. An
/// optimizer's update is not differentiated: the op has no gradient.
pub static ADAM_UPDATE: OpDef = OpDef {
    name: "AdamUpdate",
    inputs: &["param", "grad", "m", "v", "lr", "bias1", "bias2", "decay"],
    variadic: false,
    outputs: 3,
    attrs: &[
        AttrSpec::required("beta1", AttrKind::Float),
        AttrSpec::required("beta2", AttrKind::Float),
        AttrSpec::required("eps", AttrKind::Float),
        AttrSpec::optional("weight_decay", AttrKind::Float, AttrDefault::Float(0.0)),
    ],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: adam_update_meta,
    grad: None,
};

fn adam_update_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let param = &inputs[0];
    if !matches!(param.dtype, DType::F32 | DType::F64) {
        return Err(Error::dtype(format!(
            "param must be f32 or f64, got {param}"
        )));
    }
    for (name, x) in ["grad", "m", "v"].iter().zip(&inputs[1..4]) {
        if x != param {
            return Err(Error::shape(format!(
                "{name} is {x} but param is {param}: they must match"
            )));
        }
    }
    for (name, x) in ["lr", "bias1", "bias2", "decay"].iter().zip(&inputs[4..8]) {
        if x.dtype != param.dtype || x.shape.rank() != 0 {
            return Err(Error::shape(format!(
                "{name} must be a rank-0 {} tensor, got {x}",
                param.dtype
            )));
        }
    }
    for beta in ["beta1", "beta2"] {
        let b = attrs.float(beta)?;
        if !(0.0..1.0).contains(&b) {
            return Err(Error::attribute(format!(
                "{beta} must lie in [0, 1), got {b}"
            )));
        }
    }
    for name in ["eps", "weight_decay"] {
        let x = attrs.float(name)?;
        if !(x.is_finite() && x >= 0.0) {
            return Err(Error::attribute(format!(
                "{name} must be finite and non-negative, got {x}"
            )));
        }
    }
    Ok(smallvec![param.clone(), param.clone(), param.clone()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;

    fn m(dtype: DType, dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(dtype, Shape::new(dims))
    }

    #[test]
    fn dropout_checks_key_and_probability() {
        let mut a = OpAttrs::new();
        a.set_float("p", 0.25);
        let x = m(DType::F32, &[3, 0, 2]);
        let key = m(DType::I64, &[2]);
        assert_eq!(DROPOUT.infer(&[x.clone(), key.clone()], &a).unwrap()[0], x);
        let err = DROPOUT
            .infer(&[x.clone(), m(DType::I32, &[2])], &a)
            .unwrap_err();
        assert!(err.to_string().contains("[seed, offset]"), "{err}");
        assert!(DROPOUT
            .infer(&[x.clone(), m(DType::I64, &[3])], &a)
            .is_err());
        assert!(DROPOUT
            .infer(&[m(DType::I32, &[3]), key.clone()], &a)
            .is_err());
        for p in [-0.1, 1.5, f64::NAN] {
            a.set_float("p", p);
            let err = DROPOUT.infer(&[x.clone(), key.clone()], &a).unwrap_err();
            assert!(err.to_string().contains("[0, 1]"), "{err}");
        }
        a.set_float("p", 1.0);
        assert!(DROPOUT.infer(&[x, key], &a).is_ok());
    }

    #[test]
    fn squared_norm_is_a_scalar_of_one_dtype() {
        let a = OpAttrs::new();
        let out = SQUARED_NORM
            .infer(
                &[
                    m(DType::F32, &[3, 4]),
                    m(DType::F32, &[]),
                    m(DType::F32, &[0]),
                ],
                &a,
            )
            .unwrap();
        assert_eq!(out[0], m(DType::F32, &[]));
        let err = SQUARED_NORM
            .infer(&[m(DType::F32, &[3]), m(DType::F64, &[3])], &a)
            .unwrap_err();
        assert!(err.to_string().contains("xs[1]"), "{err}");
        assert!(SQUARED_NORM.infer(&[m(DType::I64, &[3])], &a).is_err());
    }

    #[test]
    fn adam_update_checks_its_inputs_and_attributes() {
        let mut a = OpAttrs::new();
        a.set_float("beta1", 0.9)
            .set_float("beta2", 0.999)
            .set_float("eps", 1e-8);
        let p = m(DType::F32, &[3, 4]);
        let s = m(DType::F32, &[]);
        let mut inputs = vec![p.clone(), p.clone(), p.clone(), p.clone()];
        inputs.extend([s.clone(), s.clone(), s.clone(), s.clone()]);
        let out = ADAM_UPDATE.infer(&inputs, &a).unwrap();
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|o| *o == p));
        let mut wrong = inputs.clone();
        wrong[2] = m(DType::F32, &[4, 3]);
        let err = ADAM_UPDATE.infer(&wrong, &a).unwrap_err();
        assert!(err.to_string().contains("m is"), "{err}");
        let mut wrong = inputs.clone();
        wrong[5] = m(DType::F32, &[1]);
        let err = ADAM_UPDATE.infer(&wrong, &a).unwrap_err();
        assert!(err.to_string().contains("bias1"), "{err}");
        let ints: Vec<_> = inputs
            .iter()
            .map(|x| m(DType::I32, x.shape.dims()))
            .collect();
        assert!(ADAM_UPDATE.infer(&ints, &a).is_err());
        a.set_float("beta2", 1.0);
        let err = ADAM_UPDATE.infer(&inputs, &a).unwrap_err();
        assert!(err.to_string().contains("beta2"), "{err}");
        a.set_float("beta2", 0.999).set_float("weight_decay", -1.0);
        let err = ADAM_UPDATE.infer(&inputs, &a).unwrap_err();
        assert!(err.to_string().contains("weight_decay"), "{err}");
    }
}
