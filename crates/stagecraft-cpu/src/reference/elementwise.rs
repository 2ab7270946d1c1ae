//! Reference versions of the elementwise ops (unary math, broadcasting
//! binary arithmetic, comparisons, select and cast): flat `f64` vectors
//! plus dimensions, every element computed on its own from the textbook
//! formula and rounded to the dtype with the `Cast` rules.

use stagecraft_ops::{
    BinaryFn, BinaryOp, BinaryVisitor, CompareOp, UnaryFn, UnaryOp, UnaryVisitor,
};
use stagecraft_tensor::{DType, Error, Result, Scalar};

/// Rounds `v` to `dtype` and back (the `Cast` rules: floats round to
/// nearest, integers truncate toward zero and saturate).
pub fn round_to(dtype: DType, v: f64) -> f64 {
    Scalar::F64(v).cast(dtype).to_f64()
}

/// The multi-index of flat position `flat` in a tensor of `dims`.
fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut index = vec![0; dims.len()];
    for axis in (0..dims.len()).rev() {
        index[axis] = flat % dims[axis];
        flat /= dims[axis];
    }
    index
}

/// The flat position of the element of an input of `dims` that output
/// multi-index `out_index` reads under NumPy broadcasting.
fn broadcast_source(out_index: &[usize], dims: &[usize]) -> usize {
    let lead = out_index.len() - dims.len();
    let mut flat = 0;
    for (axis, &d) in dims.iter().enumerate() {
        let i = if d == 1 { 0 } else { out_index[lead + axis] };
        flat = flat * d + i;
    }
    flat
}

/// The NumPy broadcast of several shapes.
pub fn broadcast_dims(shapes: &[&[usize]]) -> Result<Vec<usize>> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1; rank];
    for shape in shapes {
        let lead = rank - shape.len();
        for (axis, &d) in shape.iter().enumerate() {
            let o = &mut out[lead + axis];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                return Err(Error::shape(format!("cannot broadcast {shapes:?}")));
            }
        }
    }
    Ok(out)
}

/// `op` applied to every element of `x` (values of `dtype`): floats
/// through the op's f64 meaning, rounded once to `dtype`; integers in
/// i64, wrapped to `dtype`; bools on 0 and 1.
pub fn unary(op: UnaryOp, dtype: DType, x: &[f64]) -> Vec<f64> {
    x.iter()
        .map(|&v| op.visit(UnaryValue { x: v, dtype }))
        .collect()
}

/// One element of the reference unary op.
struct UnaryValue {
    x: f64,
    dtype: DType,
}

impl UnaryVisitor for UnaryValue {
    type Output = f64;
    fn visit<F: UnaryFn>(self) -> f64 {
        let (x, dtype) = (self.x, self.dtype);
        if dtype.is_float() {
            round_to(dtype, F::eval::<f64>(x))
        } else if dtype == DType::Bool {
            F::eval::<u8>(x as u8) as f64
        } else {
            wrap_to(dtype, F::eval::<i64>(x as i64))
        }
    }
}

/// One element of the reference binary op.
struct BinaryValue {
    a: f64,
    b: f64,
    dtype: DType,
}

impl BinaryVisitor for BinaryValue {
    type Output = f64;
    fn visit<F: BinaryFn>(self) -> f64 {
        let (a, b, dtype) = (self.a, self.b, self.dtype);
        if dtype.is_float() {
            round_to(dtype, F::eval::<f64>(a, b))
        } else if dtype == DType::Bool {
            F::eval::<u8>(a as u8, b as u8) as f64
        } else {
            wrap_to(dtype, F::eval::<i64>(a as i64, b as i64))
        }
    }
}

/// An integer computed in i64, wrapped to the integer `dtype` (the
/// integer ops wrap on overflow).
fn wrap_to(dtype: DType, v: i64) -> f64 {
    Scalar::I64(v).cast(dtype).to_f64()
}

/// Calls `f(out_index, sources)` for every output element of the broadcast
/// of `shapes`, where `sources[k]` is the flat index into input `k`.
fn broadcast_each(shapes: &[&[usize]], mut f: impl FnMut(&[usize])) -> Result<Vec<usize>> {
    let out_dims = broadcast_dims(shapes)?;
    let numel: usize = out_dims.iter().product();
    for flat in 0..numel {
        let index = unravel(flat, &out_dims);
        let sources: Vec<usize> = shapes.iter().map(|s| broadcast_source(&index, s)).collect();
        f(&sources);
    }
    Ok(out_dims)
}

/// `op` on broadcast `a` (of `a_dims`) and `b` (of `b_dims`), both of
/// `dtype`; returns the values and the output dimensions. Integer division
/// by zero is an error.
pub fn binary(
    op: BinaryOp,
    dtype: DType,
    a: &[f64],
    a_dims: &[usize],
    b: &[f64],
    b_dims: &[usize],
) -> Result<(Vec<f64>, Vec<usize>)> {
    let mut out = Vec::new();
    let mut failure = None;
    let dims = broadcast_each(&[a_dims, b_dims], |src| {
        let (x, y) = (a[src[0]], b[src[1]]);
        if op.is_zero_divisor_error() && dtype.is_int() && y == 0.0 {
            failure = Some(Error::invalid("integer division by zero"));
        }
        out.push(op.visit(BinaryValue { a: x, b: y, dtype }));
    })?;
    match failure {
        Some(e) => Err(e),
        None => Ok((out, dims)),
    }
}

/// `op` on broadcast `a` and `b`; returns 0/1 values and the output
/// dimensions. NaN compares unequal to everything (IEEE).
pub fn compare(
    op: CompareOp,
    a: &[f64],
    a_dims: &[usize],
    b: &[f64],
    b_dims: &[usize],
) -> Result<(Vec<f64>, Vec<usize>)> {
    let mut out = Vec::new();
    let dims = broadcast_each(&[a_dims, b_dims], |src| {
        let (x, y) = (a[src[0]], b[src[1]]);
        let truth = match op {
            CompareOp::Eq => x == y,
            CompareOp::Ne => x != y,
            CompareOp::Lt => x < y,
            CompareOp::Le => x <= y,
            CompareOp::Gt => x > y,
            CompareOp::Ge => x >= y,
        };
        out.push(truth as u8 as f64);
    })?;
    Ok((out, dims))
}

/// `cond ? a : b` with all three broadcast; `cond` holds 0/1 values.
pub fn select(
    cond: &[f64],
    cond_dims: &[usize],
    a: &[f64],
    a_dims: &[usize],
    b: &[f64],
    b_dims: &[usize],
) -> Result<(Vec<f64>, Vec<usize>)> {
    let mut out = Vec::new();
    let dims = broadcast_each(&[cond_dims, a_dims, b_dims], |src| {
        out.push(if cond[src[0]] != 0.0 {
            a[src[1]]
        } else {
            b[src[2]]
        });
    })?;
    Ok((out, dims))
}

/// Each value of `x` (exactly representable in `from`) converted to `to`
/// by [`Scalar::cast`], the definition of the `Cast` op.
pub fn cast(x: &[f64], from: DType, to: DType) -> Vec<f64> {
    x.iter()
        .map(|&v| {
            let source = match from {
                DType::Bool => Scalar::Bool(v != 0.0),
                DType::U8 => Scalar::U8(v as u8),
                DType::I8 => Scalar::I8(v as i8),
                DType::U16 => Scalar::U16(v as u16),
                DType::I16 => Scalar::I16(v as i16),
                DType::U32 => Scalar::U32(v as u32),
                DType::U64 => Scalar::U64(v as u64),
                DType::I32 => Scalar::I32(v as i32),
                DType::I64 => Scalar::I64(v as i64),
                DType::F16 => Scalar::F16(half::f16::from_f64(v)),
                DType::BF16 => Scalar::BF16(half::bf16::from_f64(v)),
                DType::F32 => Scalar::F32(v as f32),
                DType::F64 | DType::List => Scalar::F64(v),
            };
            source.cast(to).to_f64()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_locates_sources() {
        let (v, d) = binary(
            BinaryOp::Sub,
            DType::F64,
            &[10.0, 20.0],
            &[2, 1],
            &[1.0, 2.0, 3.0],
            &[3],
        )
        .unwrap();
        assert_eq!(d, vec![2, 3]);
        assert_eq!(v, vec![9.0, 8.0, 7.0, 19.0, 18.0, 17.0]);
        assert!(broadcast_dims(&[&[2, 3], &[4]]).is_err());
        assert_eq!(broadcast_dims(&[&[], &[0, 1]]).unwrap(), vec![0, 1]);
    }

    #[test]
    fn formulas() {
        assert_eq!(
            unary(UnaryOp::Sign, DType::F32, &[-3.0, 0.0, 2.0]),
            vec![-1.0, 0.0, 1.0]
        );
        assert_eq!(
            unary(UnaryOp::Relu, DType::I32, &[-3.0, 4.0]),
            vec![0.0, 4.0]
        );
        assert!((unary(UnaryOp::Gelu, DType::F64, &[1.0])[0] - 0.8413447460685429).abs() < 1e-15);
        assert!(unary(UnaryOp::Gelu, DType::F64, &[-10.0])[0] < 0.0);
        assert!(binary(BinaryOp::Div, DType::I32, &[1.0], &[], &[0.0], &[]).is_err());
        assert_eq!(
            binary(BinaryOp::Div, DType::I32, &[-7.0], &[], &[2.0], &[])
                .unwrap()
                .0,
            vec![-3.0]
        );
        let (c, _) = compare(CompareOp::Ne, &[f64::NAN], &[1], &[f64::NAN], &[1]).unwrap();
        assert_eq!(c, vec![1.0]);
        let (s, d) = select(&[1.0, 0.0], &[2, 1], &[1.0], &[], &[5.0, 6.0], &[2]).unwrap();
        assert_eq!((s, d), (vec![1.0, 1.0, 5.0, 6.0], vec![2, 2]));
        assert_eq!(
            cast(&[-2.7, f64::NAN], DType::F32, DType::I32),
            vec![-2.0, 0.0]
        );
    }
}
