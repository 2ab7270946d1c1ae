//! Helpers shared by kernel families: dtype dispatch and broadcast indexing.

use smallvec::SmallVec;
use stagecraft_tensor::Shape;

/// Runs `$body` with `$T` bound to the Rust type of a floating-point dtype;
/// other dtypes evaluate `$otherwise`.
#[macro_export]
macro_rules! with_float_type {
    ($dtype:expr, $T:ident => $body:expr, _ => $otherwise:expr) => {
        match $dtype {
            stagecraft_tensor::DType::F32 => {
                type $T = f32;
                $body
            }
            stagecraft_tensor::DType::F64 => {
                type $T = f64;
                $body
            }
            stagecraft_tensor::DType::F16 => {
                type $T = half::f16;
                $body
            }
            stagecraft_tensor::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            _ => $otherwise,
        }
    };
}

/// Runs `$body` with `$T` bound to the Rust type of a numeric dtype
/// (integers and floats); `bool` and lists evaluate `$otherwise`.
#[macro_export]
macro_rules! with_numeric_type {
    ($dtype:expr, $T:ident => $body:expr, _ => $otherwise:expr) => {
        match $dtype {
            stagecraft_tensor::DType::U8 => {
                type $T = u8;
                $body
            }
            stagecraft_tensor::DType::I8 => {
                type $T = i8;
                $body
            }
            stagecraft_tensor::DType::U16 => {
                type $T = u16;
                $body
            }
            stagecraft_tensor::DType::I16 => {
                type $T = i16;
                $body
            }
            stagecraft_tensor::DType::U32 => {
                type $T = u32;
                $body
            }
            stagecraft_tensor::DType::U64 => {
                type $T = u64;
                $body
            }
            stagecraft_tensor::DType::I32 => {
                type $T = i32;
                $body
            }
            stagecraft_tensor::DType::I64 => {
                type $T = i64;
                $body
            }
            _ => $crate::with_float_type!($dtype, $T => $body, _ => $otherwise),
        }
    };
}

/// Runs `$body` with `$T` bound to the Rust type of an integer dtype;
/// other dtypes evaluate `$otherwise`.
#[macro_export]
macro_rules! with_int_type {
    ($dtype:expr, $T:ident => $body:expr, _ => $otherwise:expr) => {
        match $dtype {
            stagecraft_tensor::DType::U8 => {
                type $T = u8;
                $body
            }
            stagecraft_tensor::DType::I8 => {
                type $T = i8;
                $body
            }
            stagecraft_tensor::DType::U16 => {
                type $T = u16;
                $body
            }
            stagecraft_tensor::DType::I16 => {
                type $T = i16;
                $body
            }
            stagecraft_tensor::DType::U32 => {
                type $T = u32;
                $body
            }
            stagecraft_tensor::DType::I32 => {
                type $T = i32;
                $body
            }
            stagecraft_tensor::DType::U64 => {
                type $T = u64;
                $body
            }
            stagecraft_tensor::DType::I64 => {
                type $T = i64;
                $body
            }
            _ => $otherwise,
        }
    };
}

/// Runs `$body` with `$T` bound to the Rust type of any dtype.
#[macro_export]
macro_rules! with_any_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            stagecraft_tensor::DType::Bool => {
                type $T = bool;
                $body
            }
            stagecraft_tensor::DType::U8 => {
                type $T = u8;
                $body
            }
            stagecraft_tensor::DType::I8 => {
                type $T = i8;
                $body
            }
            stagecraft_tensor::DType::U16 => {
                type $T = u16;
                $body
            }
            stagecraft_tensor::DType::I16 => {
                type $T = i16;
                $body
            }
            stagecraft_tensor::DType::U32 => {
                type $T = u32;
                $body
            }
            stagecraft_tensor::DType::U64 => {
                type $T = u64;
                $body
            }
            stagecraft_tensor::DType::I32 => {
                type $T = i32;
                $body
            }
            stagecraft_tensor::DType::I64 => {
                type $T = i64;
                $body
            }
            stagecraft_tensor::DType::F16 => {
                type $T = half::f16;
                $body
            }
            stagecraft_tensor::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            stagecraft_tensor::DType::F32 => {
                type $T = f32;
                $body
            }
            stagecraft_tensor::DType::F64 => {
                type $T = f64;
                $body
            }
            stagecraft_tensor::DType::List => return Err($crate::numeric::list_operand()),
        }
    };
}

/// The error of a numeric kernel handed a list of tensors (only the list
/// ops take lists).
pub fn list_operand() -> stagecraft_tensor::Error {
    stagecraft_tensor::Error::dtype("this op does not take a list of tensors")
}

/// Element strides of `input` viewed as broadcast to `output` (NumPy
/// rules): 0 along broadcast dimensions. The result has `output`'s rank.
pub fn broadcast_strides(input: &Shape, output: &Shape) -> SmallVec<[usize; 4]> {
    let own = input.strides();
    let offset = output.rank() - input.rank();
    (0..output.rank())
        .map(|i| {
            if i < offset || input[i - offset] == 1 {
                0
            } else {
                own[i - offset]
            }
        })
        .collect()
}

/// Calls `f(output_index, input_offset)` for every element of `output` in
/// row-major order, where `input_offset` walks `strides` (from
/// [`broadcast_strides`]).
pub fn for_each_strided(output: &Shape, strides: &[usize], mut f: impl FnMut(usize, usize)) {
    let rank = output.rank();
    let numel = output.numel();
    if numel == 0 {
        return;
    }
    let dims = output.dims();
    let mut index: SmallVec<[usize; 4]> = SmallVec::from_elem(0, rank);
    let mut offset = 0usize;
    for i in 0..numel {
        f(i, offset);
        for axis in (0..rank).rev() {
            index[axis] += 1;
            offset += strides[axis];
            if index[axis] < dims[axis] {
                break;
            }
            offset -= strides[axis] * dims[axis];
            index[axis] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_walk_broadcasts() {
        let out = Shape::new(&[2, 3]);
        let strides = broadcast_strides(&Shape::new(&[3]), &out);
        assert_eq!(strides.as_slice(), &[0, 1]);
        let mut seen = vec![];
        for_each_strided(&out, &strides, |i, o| seen.push((i, o)));
        assert_eq!(seen, vec![(0, 0), (1, 1), (2, 2), (3, 0), (4, 1), (5, 2)]);
        let col = broadcast_strides(&Shape::new(&[2, 1]), &out);
        let mut offs = vec![];
        for_each_strided(&out, &col, |_, o| offs.push(o));
        assert_eq!(offs, vec![0, 0, 0, 1, 1, 1]);
    }
}
