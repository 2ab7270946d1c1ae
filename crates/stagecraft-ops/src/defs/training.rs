//! Ops only training uses: dropout from the counter-based random stream,
//! and the squared norm over a list of tensors that gradient clipping
//! reduces in one kernel.

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
}
