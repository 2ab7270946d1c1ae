//! Matrix multiplication.

use super::{one, require_numeric, require_same_dtype};
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use stagecraft_tensor::{broadcast_shapes, Error, Result, Shape, TensorMetadata};

/// Batched matrix product with NumPy `matmul` semantics: `[..., m, k]` by
/// `[..., k, n]` gives `[..., m, n]` with broadcast batch dimensions; a 1-D
/// operand is a vector (its dimension is removed from the result).
pub static MATMUL: OpDef = OpDef {
    name: "MatMul",
    inputs: &["a", "b"],
    variadic: false,
    outputs: 1,
    attrs: &[],
    kind: OpKind::Other,
    effect: Effect::Pure,
    shape_kind: ShapeKind::Static,
    metadata: matmul_meta,
    grad: Some(matmul_grad),
};

/// The shapes of a matmul: `(batch, m, k, n)` after promoting vectors, and
/// the result shape.
pub fn matmul_shapes(a: &Shape, b: &Shape) -> Result<(Shape, usize, usize, usize, Shape)> {
    if a.rank() == 0 || b.rank() == 0 {
        return Err(Error::shape(format!(
            "matmul needs operands of rank >= 1, got {a} and {b}"
        )));
    }
    let (m, ka) = if a.rank() == 1 {
        (1, a[0])
    } else {
        (a[a.rank() - 2], a[a.rank() - 1])
    };
    let (kb, n) = if b.rank() == 1 {
        (b[0], 1)
    } else {
        (b[b.rank() - 2], b[b.rank() - 1])
    };
    if ka != kb {
        return Err(Error::shape(format!(
            "contraction dimensions differ: {a} @ {b} ({ka} vs {kb})"
        )));
    }
    let batch_a = Shape::new(&a.dims()[..a.rank().saturating_sub(2)]);
    let batch_b = Shape::new(&b.dims()[..b.rank().saturating_sub(2)]);
    let batch = broadcast_shapes(&batch_a, &batch_b).map_err(|_| {
        Error::shape(format!(
            "batch dimensions of {a} and {b} cannot be broadcast"
        ))
    })?;
    let mut out = batch.clone();
    if a.rank() > 1 {
        out.push(m);
    }
    if b.rank() > 1 {
        out.push(n);
    }
    Ok((batch, m, ka, n, out))
}

fn matmul_meta(inputs: &[TensorMetadata], _: &Attrs<'_>) -> Result<OutputMetas> {
    let (a, b) = (&inputs[0], &inputs[1]);
    let dtype = require_same_dtype(a, b)?;
    require_numeric("a", a)?;
    let (_, _, _, _, out) = matmul_shapes(&a.shape, &b.shape)?;
    one(TensorMetadata::new(dtype, out))
}

/// da = g bᵀ, db = aᵀ g, with vectors promoted to matrices and broadcast
/// batch dimensions summed away.
fn matmul_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, y, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let (xs, ys) = (b.meta(x).shape, b.meta(y).shape);
    if !b.meta(x).dtype.is_float() {
        return Ok(smallvec::smallvec![None, None]);
    }
    // Promote vectors: [k] as [1, k] on the left, [k, 1] on the right.
    let x2 = if xs.rank() == 1 {
        b.reshape(x, &[1, xs[0]])?
    } else {
        x
    };
    let y2 = if ys.rank() == 1 {
        b.reshape(y, &[ys[0], 1])?
    } else {
        y
    };
    let mut gdims: Vec<usize> = b.meta(g).shape.dims().to_vec();
    if xs.rank() == 1 {
        gdims.insert(gdims.len() - if ys.rank() == 1 { 0 } else { 1 }, 1);
    }
    if ys.rank() == 1 {
        gdims.push(1);
    }
    let g2 = b.reshape(g, &gdims)?;
    let yt = b.swap_last(y2)?;
    let dx = b.op(&MATMUL, &[g2, yt], &crate::OpAttrs::new())?;
    let xt = b.swap_last(x2)?;
    let dy = b.op(&MATMUL, &[xt, g2], &crate::OpAttrs::new())?;
    let x2s = b.meta(x2).shape;
    let y2s = b.meta(y2).shape;
    let dx = b.unbroadcast(dx, &x2s)?;
    let dy = b.unbroadcast(dy, &y2s)?;
    Ok(smallvec::smallvec![
        Some(b.reshape(dx, xs.dims())?),
        Some(b.reshape(dy, ys.dims())?)
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpAttrs;
    use stagecraft_tensor::DType;

    fn m(dims: &[usize]) -> TensorMetadata {
        TensorMetadata::new(DType::F32, dims)
    }

    #[test]
    fn matmul_shapes_follow_numpy() {
        let a = OpAttrs::new();
        let out = |x: &[usize], y: &[usize]| {
            MATMUL
                .infer(&[m(x), m(y)], &a)
                .map(|o| o[0].shape.dims().to_vec())
        };
        assert_eq!(out(&[2, 3], &[3, 4]).unwrap(), vec![2, 4]);
        assert_eq!(out(&[5, 2, 3], &[3, 4]).unwrap(), vec![5, 2, 4]);
        assert_eq!(out(&[5, 1, 2, 3], &[7, 3, 4]).unwrap(), vec![5, 7, 2, 4]);
        assert_eq!(out(&[3], &[3, 4]).unwrap(), vec![4]);
        assert_eq!(out(&[2, 3], &[3]).unwrap(), vec![2]);
        assert_eq!(out(&[3], &[3]).unwrap(), Vec::<usize>::new());
        assert_eq!(out(&[0, 3], &[3, 4]).unwrap(), vec![0, 4]);
        let err = out(&[2, 3], &[4, 5]).unwrap_err();
        assert!(err.to_string().contains("[2,3] @ [4,5]"), "{err}");
        assert!(out(&[], &[3]).is_err());
        assert!(out(&[2, 2, 3], &[3, 3, 4]).is_err());
        assert!(MATMUL
            .infer(&[m(&[2, 3]), TensorMetadata::new(DType::F64, [3, 4])], &a)
            .is_err());
    }
}
