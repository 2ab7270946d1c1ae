//! Matrix multiplication.

use super::{one, require_numeric, require_same_dtype};
use crate::attrs::AttrKind;
use crate::grad::{GradBuilder, GradContext, InputGrads};
use crate::op::*;
use stagecraft_tensor::{broadcast_shapes, Error, Result, Shape, TensorMetadata};

/// Batched matrix product with NumPy `matmul` semantics: `[..., m, k]` by
/// `[..., k, n]` gives `[..., m, n]` with broadcast batch dimensions; a 1-D
/// operand is a vector (its dimension is removed from the result).
///
/// `transpose_a` / `transpose_b` multiply by an operand's transpose (its
/// last two dimensions swapped) without materializing it: the GEMM reads
/// the operand with swapped strides. Gradients use them (`g @ bᵀ`,
/// `aᵀ @ g`), and a graph pass folds a user's explicit transpose into
/// them. Only operands of rank ≥ 2 can be transposed.
pub static MATMUL: OpDef = OpDef {
    name: "MatMul",
    inputs: &["a", "b"],
    variadic: false,
    outputs: 1,
    attrs: &[
        AttrSpec::optional("transpose_a", AttrKind::Bool, AttrDefault::Bool(false)),
        AttrSpec::optional("transpose_b", AttrKind::Bool, AttrDefault::Bool(false)),
    ],
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

/// The `transpose_a` and `transpose_b` flags of a matmul.
pub fn matmul_transposes(attrs: &Attrs<'_>) -> Result<(bool, bool)> {
    Ok((attrs.bool("transpose_a")?, attrs.bool("transpose_b")?))
}

/// `shape` as a matmul operand sees it: its last two dimensions swapped
/// when `transposed` (an error for a vector or scalar).
pub fn matmul_operand(shape: &Shape, transposed: bool, name: &str) -> Result<Shape> {
    if !transposed {
        return Ok(shape.clone());
    }
    let rank = shape.rank();
    if rank < 2 {
        return Err(Error::attribute(format!(
            "transpose_{name} needs an operand of rank >= 2, got {shape}"
        )));
    }
    let mut dims = shape.dims().to_vec();
    dims.swap(rank - 2, rank - 1);
    Ok(Shape::new(&dims))
}

/// The result shape of a matmul with its transpose flags.
pub fn matmul_result_shape(a: &Shape, b: &Shape, attrs: &Attrs<'_>) -> Result<Shape> {
    let (ta, tb) = matmul_transposes(attrs)?;
    let (a, b) = (matmul_operand(a, ta, "a")?, matmul_operand(b, tb, "b")?);
    Ok(matmul_shapes(&a, &b)?.4)
}

fn matmul_meta(inputs: &[TensorMetadata], attrs: &Attrs<'_>) -> Result<OutputMetas> {
    let (a, b) = (&inputs[0], &inputs[1]);
    let dtype = require_same_dtype(a, b)?;
    require_numeric("a", a)?;
    let out = matmul_result_shape(&a.shape, &b.shape, attrs)?;
    one(TensorMetadata::new(dtype, out))
}

/// A matmul's attributes with the given transpose flags (flags that are
/// off are left out, as a plain `a @ b` has none).
pub fn matmul_attrs(transpose_a: bool, transpose_b: bool) -> crate::OpAttrs {
    let mut attrs = crate::OpAttrs::new();
    if transpose_a {
        attrs.set_bool("transpose_a", true);
    }
    if transpose_b {
        attrs.set_bool("transpose_b", true);
    }
    attrs
}

/// With C = A·B, where A and B are `a` and `b` after their transpose flags:
/// dA = g·Bᵀ and dB = Aᵀ·g. The transposes are flags on the gradient
/// products, never materialized; for a transposed operand the gradient is
/// the transpose of dA (dAᵀ = B·gᵀ), again a single flagged product.
/// Vectors are promoted to matrices and broadcast batch dimensions summed
/// away.
fn matmul_grad(b: &mut dyn GradBuilder, ctx: &GradContext<'_>) -> Result<InputGrads> {
    let (x, y, g) = (ctx.inputs[0], ctx.inputs[1], ctx.grad()?);
    let (xs, ys) = (b.meta(x).shape, b.meta(y).shape);
    if !b.meta(x).dtype.is_float() {
        return Ok(smallvec::smallvec![None, None]);
    }
    let (ta, tb) = matmul_transposes(&ctx.attrs)?;
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
    let dx = if ta {
        b.op(&MATMUL, &[y2, g2], &matmul_attrs(tb, true))?
    } else {
        b.op(&MATMUL, &[g2, y2], &matmul_attrs(false, !tb))?
    };
    let dy = if tb {
        b.op(&MATMUL, &[g2, x2], &matmul_attrs(true, ta))?
    } else {
        b.op(&MATMUL, &[x2, g2], &matmul_attrs(!ta, false))?
    };
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
