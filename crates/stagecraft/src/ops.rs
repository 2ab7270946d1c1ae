//! The op methods of `Tensor<T>`. Each is `#[track_caller]`: the caller's
//! source line travels with the op, so an error names it.

use crate::Tensor;
use smallvec::{smallvec, SmallVec};
use stagecraft_ops as ops;
use stagecraft_ops::{BinaryOp, OpAttrs, UnaryOp};
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::{
    normalize_axis, Element, Error, FloatElement, IndexElement, IntElement, Location, NumElement,
    Scalar,
};

mod attention;
mod everyday;
mod training;
mod transformer;
pub use attention::scaled_dot_product_attention;
pub use everyday::CumsumOptions;
pub use training::clip_grad_norm;
pub use transformer::{CrossEntropyOptions, Reduction};

macro_rules! unary_methods {
    ($bound:ident: $($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {
        impl<T: $bound> Tensor<T> {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self) -> Tensor<T> {
                    self.unary(&ops::$op, &OpAttrs::new(), Location::caller())
                }
            )*
        }
    };
}

unary_methods!(FloatElement:
    /// `e^x`, elementwise.
    exp => EXP,
    /// Natural logarithm, elementwise.
    log => LOG,
    /// Square root, elementwise.
    sqrt => SQRT,
    /// `1/sqrt(x)`, elementwise.
    rsqrt => RSQRT,
    /// Hyperbolic tangent, elementwise.
    tanh => TANH,
    /// Logistic sigmoid, elementwise.
    sigmoid => SIGMOID,
    /// Gaussian error linear unit (exact erf form), elementwise.
    gelu => GELU,
    /// Sine, elementwise.
    sin => SIN,
    /// Cosine, elementwise.
    cos => COS,
    /// Arcsine, elementwise (NaN outside `[-1, 1]`).
    asin => ASIN,
    /// Arccosine, elementwise (NaN outside `[-1, 1]`).
    acos => ACOS,
    /// Arctangent, elementwise.
    atan => ATAN,
    /// The error function, elementwise.
    erf => ERF,
    /// GELU's tanh approximation, `x·(1 + tanh(√(2/π)(x + 0.044715x³)))/2`
    /// (GPT-2's and BERT's form), elementwise.
    gelu_tanh => GELU_TANH,
    /// SiLU (swish), `x·sigmoid(x)`, elementwise.
    silu => SILU,
    /// Softplus, `ln(1 + e^x)`, elementwise, without overflow.
    softplus => SOFTPLUS,
    /// `ln(1 + x)`, elementwise, accurate near 0.
    log1p => LOG1P,
    /// `e^x - 1`, elementwise, accurate near 0.
    expm1 => EXPM1,
    /// `1/x`, elementwise.
    reciprocal => RECIPROCAL,
);

unary_methods!(NumElement:
    /// `max(x, 0)`, elementwise.
    relu => RELU,
    /// `|x|`, elementwise.
    abs => ABS,
    /// `-x`, elementwise.
    neg => NEG,
    /// -1, 0 or 1, elementwise.
    sign => SIGN,
    /// The largest integer not above `x`, elementwise (integers are their
    /// own floor).
    floor => FLOOR,
    /// The smallest integer not below `x`, elementwise.
    ceil => CEIL,
    /// The nearest integer, halves to even (as NumPy and PyTorch round),
    /// elementwise.
    round => ROUND,
    /// `x²`, elementwise (integers wrap).
    square => SQUARE,
);

impl<T: Element> Tensor<T> {
    /// Any unary elementwise op, named by its [`UnaryOp`] (for code that
    /// picks ops at run time: importers, generic tests). A dtype the op
    /// does not accept is an error of the op, as with its method.
    ///
    /// ```
    /// # use stagecraft::{Device, Tensor, UnaryOp};
    /// let x = Tensor::from_vec(vec![-1.5f32, 2.5], &[2], &Device::cpu()).unwrap();
    /// assert_eq!(x.apply_unary(UnaryOp::Round).to_vec().unwrap(), vec![-2.0, 2.0]);
    /// ```
    #[track_caller]
    pub fn apply_unary(&self, op: UnaryOp) -> Tensor<T> {
        self.unary(op.def(), &OpAttrs::new(), Location::caller())
    }

    /// Any binary elementwise op, named by its [`BinaryOp`], with
    /// broadcasting.
    #[track_caller]
    pub fn apply_binary(&self, op: BinaryOp, other: &Tensor<T>) -> Tensor<T> {
        self.binary(op.def(), other, Location::caller())
    }
}

impl<T: NumElement> Tensor<T> {
    /// Every element limited to `[min, max]`: `maximum(x, min)` then
    /// `minimum(.., max)`, so NaN stays NaN, `min > max` gives `max`
    /// everywhere (as PyTorch), and the gradient passes where
    /// `min ≤ x ≤ max`. Fuses with its neighbours.
    ///
    /// ```
    /// # use stagecraft::{Device, Tensor};
    /// let x = Tensor::from_vec(vec![-2.0f32, 0.5, 3.0], &[3], &Device::cpu()).unwrap();
    /// assert_eq!(x.clamp(-1.0, 1.0).to_vec().unwrap(), vec![-1.0, 0.5, 1.0]);
    /// ```
    #[track_caller]
    pub fn clamp(&self, min: T, max: T) -> Tensor<T> {
        self.maximum(&scalar_like(min, self))
            .minimum(&scalar_like(max, self))
    }
}

impl<T: FloatElement> Tensor<T> {
    /// Leaky ReLU, `x` where `x > 0` and `negative_slope·x` elsewhere,
    /// written as `max(x, 0) + negative_slope·min(0, x)` so that it fuses
    /// with its neighbours; the gradient is 1 for `x ≥ 0` and
    /// `negative_slope` below.
    ///
    /// ```
    /// # use stagecraft::{Device, Tensor};
    /// let x = Tensor::from_vec(vec![-2.0f32, 3.0], &[2], &Device::cpu()).unwrap();
    /// assert_eq!(x.leaky_relu(0.5).to_vec().unwrap(), vec![-1.0, 3.0]);
    /// ```
    #[track_caller]
    pub fn leaky_relu(&self, negative_slope: f64) -> Tensor<T> {
        let zero = scalar_like(T::from_scalar(Scalar::F64(0.0)), self);
        let slope = scalar_like(T::from_scalar(Scalar::F64(negative_slope)), self);
        let positive = self.maximum(&zero);
        let negative = zero.minimum(self).mul(&slope);
        positive.add(&negative)
    }

    /// ELU, `x` where `x > 0` and `alpha·(e^x - 1)` elsewhere, written as
    /// `max(x, 0) + min(0, alpha·expm1(x))` (for `alpha ≥ 0`) so that it
    /// fuses; the gradient is 1 for `x ≥ 0` and `alpha·e^x` below.
    ///
    /// ```
    /// # use stagecraft::{Device, Tensor};
    /// let x = Tensor::from_vec(vec![0.0f64, 2.0], &[2], &Device::cpu()).unwrap();
    /// assert_eq!(x.elu(1.0).to_vec().unwrap(), vec![0.0, 2.0]);
    /// ```
    #[track_caller]
    pub fn elu(&self, alpha: f64) -> Tensor<T> {
        let zero = scalar_like(T::from_scalar(Scalar::F64(0.0)), self);
        let alpha = scalar_like(T::from_scalar(Scalar::F64(alpha)), self);
        let positive = self.maximum(&zero);
        let negative = zero.minimum(&self.expm1().mul(&alpha));
        positive.add(&negative)
    }
}

macro_rules! binary_methods {
    ($bound:ident -> $out:ty: $($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {
        impl<T: $bound> Tensor<T> {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, other: &Tensor<T>) -> Tensor<$out> {
                    self.binary(&ops::$op, other, Location::caller())
                }
            )*
        }
    };
}

binary_methods!(NumElement -> T:
    /// Elementwise sum with broadcasting.
    add => ADD,
    /// Elementwise difference with broadcasting.
    sub => SUB,
    /// Elementwise product with broadcasting.
    mul => MUL,
    /// Elementwise quotient with broadcasting (integer division truncates;
    /// dividing an integer by zero is an error).
    div => DIV,
    /// Elementwise maximum with broadcasting (NaN propagates).
    maximum => MAXIMUM,
    /// Elementwise minimum with broadcasting (NaN propagates).
    minimum => MINIMUM,
);

binary_methods!(FloatElement -> T:
    /// Elementwise power with broadcasting.
    pow => POW,
);

binary_methods!(IntElement -> T:
    /// Bitwise and, elementwise with broadcasting.
    bitwise_and => BITWISE_AND,
    /// Bitwise or, elementwise with broadcasting.
    bitwise_or => BITWISE_OR,
    /// Bitwise exclusive or, elementwise with broadcasting.
    bitwise_xor => BITWISE_XOR,
    /// `self << other`, elementwise with broadcasting; an amount outside
    /// `0..bits` (the type's width) gives 0.
    shift_left => SHIFT_LEFT,
    /// `self >> other`, elementwise with broadcasting: arithmetic for
    /// signed types, logical for unsigned ones; an amount outside
    /// `0..bits` shifts every bit out (0, or -1 for a negative signed
    /// value).
    shift_right => SHIFT_RIGHT,
);

unary_methods!(IntElement:
    /// Bitwise not (every bit flipped), elementwise.
    bitwise_not => BITWISE_NOT,
);

binary_methods!(Element -> bool:
    /// `self == other`, elementwise with broadcasting.
    eq => EQUAL,
    /// `self != other`, elementwise with broadcasting.
    ne => NOT_EQUAL,
    /// `self < other`, elementwise with broadcasting.
    lt => LESS,
    /// `self <= other`, elementwise with broadcasting.
    le => LESS_EQUAL,
    /// `self > other`, elementwise with broadcasting.
    gt => GREATER,
    /// `self >= other`, elementwise with broadcasting.
    ge => GREATER_EQUAL,
);

impl Tensor<bool> {
    /// `self ? a : b`, elementwise with broadcasting of all three.
    #[track_caller]
    pub fn select<T: Element>(&self, a: &Tensor<T>, b: &Tensor<T>) -> Tensor<T> {
        let args = smallvec![self.handle.clone(), a.handle.clone(), b.handle.clone()];
        crate::tensor::run(&ops::SELECT, args, &OpAttrs::new(), Location::caller())
    }

    /// Logical and, elementwise with broadcasting.
    #[track_caller]
    pub fn and(&self, other: &Tensor<bool>) -> Tensor<bool> {
        self.binary(&ops::LOGICAL_AND, other, Location::caller())
    }

    /// Logical or, elementwise with broadcasting.
    #[track_caller]
    pub fn or(&self, other: &Tensor<bool>) -> Tensor<bool> {
        self.binary(&ops::LOGICAL_OR, other, Location::caller())
    }

    /// Logical not, elementwise.
    #[track_caller]
    pub fn not(&self) -> Tensor<bool> {
        self.unary(&ops::LOGICAL_NOT, &OpAttrs::new(), Location::caller())
    }
}

/// `cond ? a : b`, elementwise with broadcasting (same as
/// [`Tensor::select`]).
#[track_caller]
pub fn where_<T: Element>(cond: &Tensor<bool>, a: &Tensor<T>, b: &Tensor<T>) -> Tensor<T> {
    let args = smallvec![cond.handle.clone(), a.handle.clone(), b.handle.clone()];
    crate::tensor::run(&ops::SELECT, args, &OpAttrs::new(), Location::caller())
}

fn axes_attr(axes: &[isize]) -> SmallVec<[i64; 4]> {
    axes.iter().map(|&a| a as i64).collect()
}

impl<T: Element> Tensor<T> {
    /// Converts every element to `U` (floats to integers truncate toward
    /// zero and saturate, NaN becomes 0, nonzero becomes `true`).
    #[track_caller]
    pub fn cast<U: Element>(&self) -> Tensor<U> {
        let mut attrs = OpAttrs::new();
        attrs.set_dtype("dtype", U::DTYPE);
        self.unary(&ops::CAST, &attrs, Location::caller())
    }

    /// The same values with new dimensions (same number of elements).
    #[track_caller]
    pub fn reshape(&self, dims: &[usize]) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", dims);
        self.unary(&ops::RESHAPE, &attrs, Location::caller())
    }

    /// Swaps two axes (negative axes count from the end).
    #[track_caller]
    pub fn transpose(&self, a: isize, b: isize) -> Tensor<T> {
        let location = Location::caller();
        let rank = self.rank();
        match (normalize_axis(a, rank), normalize_axis(b, rank)) {
            (Ok(a), Ok(b)) => {
                let mut perm: SmallVec<[i64; 4]> = (0..rank as i64).collect();
                perm.swap(a, b);
                let mut attrs = OpAttrs::new();
                attrs.set_ints("perm", &perm);
                self.unary(&ops::TRANSPOSE, &attrs, location)
            }
            (Err(e), _) | (_, Err(e)) => self.fail("Transpose", location, e),
        }
    }

    /// Reorders the axes: output axis `i` is input axis `perm[i]`.
    #[track_caller]
    pub fn permute(&self, perm: &[isize]) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_ints("perm", &axes_attr(perm));
        self.unary(&ops::TRANSPOSE, &attrs, Location::caller())
    }

    /// Broadcasts to `dims` by NumPy rules.
    #[track_caller]
    pub fn broadcast_to(&self, dims: &[usize]) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", dims);
        self.unary(&ops::BROADCAST_TO, &attrs, Location::caller())
    }

    /// Removes the given axes, which must have size 1 (all size-1 axes when
    /// `axes` is empty).
    #[track_caller]
    pub fn squeeze(&self, axes: &[isize]) -> Tensor<T> {
        let location = Location::caller();
        let dims = self.dims().to_vec();
        let rank = dims.len();
        let mut drop = vec![false; rank];
        if axes.is_empty() {
            for (i, &d) in dims.iter().enumerate() {
                drop[i] = d == 1;
            }
        }
        for &axis in axes {
            match normalize_axis(axis, rank) {
                Ok(a) if dims[a] == 1 => drop[a] = true,
                Ok(a) => {
                    let e = Error::shape(format!(
                        "cannot squeeze axis {axis} of size {} in {:?}",
                        dims[a], dims
                    ));
                    return self.fail("Squeeze", location, e);
                }
                Err(e) => return self.fail("Squeeze", location, e),
            }
        }
        let kept: Vec<usize> = dims
            .iter()
            .zip(&drop)
            .filter(|(_, &d)| !d)
            .map(|(&x, _)| x)
            .collect();
        let mut attrs = OpAttrs::new();
        attrs.set_dims("shape", &kept);
        self.unary(&ops::RESHAPE, &attrs, location)
    }

    /// Inserts a size-1 axis at `axis` (`-1` appends).
    #[track_caller]
    pub fn unsqueeze(&self, axis: isize) -> Tensor<T> {
        let location = Location::caller();
        let mut dims = self.dims().to_vec();
        match normalize_axis(axis, dims.len() + 1) {
            Ok(a) => {
                dims.insert(a, 1);
                let mut attrs = OpAttrs::new();
                attrs.set_dims("shape", &dims);
                self.unary(&ops::RESHAPE, &attrs, location)
            }
            Err(e) => self.fail("Unsqueeze", location, e),
        }
    }

    /// Joins tensors along `axis`.
    #[track_caller]
    pub fn concat(tensors: &[&Tensor<T>], axis: isize) -> Tensor<T> {
        let args = tensors.iter().map(|t| t.handle.clone()).collect();
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis as i64);
        crate::tensor::run(&ops::CONCAT, args, &attrs, Location::caller())
    }

    /// A strided slice: per axis, elements `start, start+step, ...` before
    /// `end`; negative bounds count from the end and are clamped like
    /// Python slices; an end of `i64::MAX` reaches the end of the axis.
    /// `steps` may be empty (all 1).
    #[track_caller]
    pub fn slice(&self, starts: &[i64], ends: &[i64], steps: &[i64]) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_ints("starts", starts)
            .set_ints("ends", ends)
            .set_ints("steps", steps);
        self.unary(&ops::SLICE, &attrs, Location::caller())
    }

    /// `len` elements of `axis` from `start` (a slice of one axis).
    #[track_caller]
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Tensor<T> {
        let location = Location::caller();
        let rank = self.rank();
        match normalize_axis(axis, rank) {
            Ok(a) => {
                let mut starts: SmallVec<[i64; 4]> = smallvec![0; rank];
                // i64::MAX: to the end of the axis, however long.
                let mut ends: SmallVec<[i64; 4]> = smallvec![i64::MAX; rank];
                let dim = self.dims()[a];
                let bounds = start
                    .checked_add(len)
                    .filter(|&end| end <= dim)
                    .and_then(|end| Some((i64::try_from(start).ok()?, i64::try_from(end).ok()?)));
                let Some((first, end)) = bounds else {
                    let e = Error::shape(format!(
                        "narrow({axis}, {start}, {len}) is out of range for an axis of size {dim}"
                    ));
                    return self.fail("Slice", location, e);
                };
                starts[a] = first;
                ends[a] = end;
                let mut attrs = OpAttrs::new();
                attrs.set_ints("starts", &starts).set_ints("ends", &ends);
                self.unary(&ops::SLICE, &attrs, location)
            }
            Err(e) => self.fail("Slice", location, e),
        }
    }

    /// Entries along `axis` picked by `indices` (negative indices count from
    /// the end); out-of-range indices are an error.
    #[track_caller]
    pub fn index_select<I: IndexElement>(&self, axis: isize, indices: &Tensor<I>) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis as i64);
        let args = smallvec![self.handle.clone(), indices.handle.clone()];
        crate::tensor::run(&ops::GATHER, args, &attrs, Location::caller())
    }

    /// Same as [`Tensor::index_select`].
    #[track_caller]
    pub fn gather<I: IndexElement>(&self, axis: isize, indices: &Tensor<I>) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis as i64);
        let args = smallvec![self.handle.clone(), indices.handle.clone()];
        crate::tensor::run(&ops::GATHER, args, &attrs, Location::caller())
    }

    /// Pads each axis with `(before, after)` copies of `value`.
    #[track_caller]
    pub fn pad(&self, pads: &[(usize, usize)], value: f64) -> Tensor<T> {
        let flat: SmallVec<[usize; 8]> = pads.iter().flat_map(|&(a, b)| [a, b]).collect();
        let mut attrs = OpAttrs::new();
        attrs.set_dims("pads", &flat).set_float("value", value);
        self.unary(&ops::PAD, &attrs, Location::caller())
    }

    /// Coordinates of the nonzero elements, shape `[count, rank]`. The
    /// shape depends on the values, so `dims()` waits for them.
    #[track_caller]
    pub fn nonzero(&self) -> Tensor<i64> {
        self.unary(&ops::NONZERO, &OpAttrs::new(), Location::caller())
    }

    /// Prints `label: value` when the op runs, in program order with other
    /// side effects, and passes the tensor through.
    #[track_caller]
    pub fn print(&self, label: &str) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_str("label", label);
        self.unary(&ops::PRINT, &attrs, Location::caller())
    }

    fn fail<U: Element>(&self, op: &str, location: Location, err: Error) -> Tensor<U> {
        Tensor::error_at(op, location, self.device(), &[], err)
    }
}

macro_rules! reduce_methods {
    ($bound:ident: $($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {
        impl<T: $bound> Tensor<T> {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, axes: &[isize], keepdim: bool) -> Tensor<T> {
                    let mut attrs = OpAttrs::new();
                    attrs.set_ints("axes", &axes_attr(axes)).set_bool("keepdim", keepdim);
                    self.unary(&ops::$op, &attrs, Location::caller())
                }
            )*
        }
    };
}

reduce_methods!(NumElement:
    /// Sum over `axes` (every axis when empty); negative axes count from
    /// the end.
    sum => SUM,
    /// Maximum over `axes` (every axis when empty); NaN propagates.
    max => MAX,
    /// Minimum over `axes` (every axis when empty); NaN propagates.
    min => MIN,
    /// Product over `axes` (every axis when empty).
    prod => PROD,
);

reduce_methods!(FloatElement:
    /// Mean over `axes` (every axis when empty).
    mean => MEAN,
);

impl<T: NumElement> Tensor<T> {
    /// Index of the largest value along `axis` (first on ties).
    #[track_caller]
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Tensor<i64> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_int("axis", axis as i64)
            .set_bool("keepdim", keepdim);
        self.unary(&ops::ARGMAX, &attrs, Location::caller())
    }

    /// Index of the smallest value along `axis` (first on ties).
    #[track_caller]
    pub fn argmin(&self, axis: isize, keepdim: bool) -> Tensor<i64> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_int("axis", axis as i64)
            .set_bool("keepdim", keepdim);
        self.unary(&ops::ARGMIN, &attrs, Location::caller())
    }

    /// Sorts along `axis` (ascending, or descending), returning the values
    /// and the i64 position along `axis` each came from. The sort is
    /// stable (equal values keep their order), NaN sorts after every
    /// number (first when descending) and `-0.0` equals `0.0`. The
    /// gradient of the values goes back to the positions they came from.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f32>::from_vec(vec![3.0, 1.0, 2.0, 1.0], &[4], &Device::cpu())?;
    /// let (values, indices) = x.sort(-1, false);
    /// assert_eq!(values.to_vec()?, vec![1.0, 1.0, 2.0, 3.0]);
    /// assert_eq!(indices.to_vec()?, vec![1, 3, 2, 0]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn sort(&self, axis: isize, descending: bool) -> (Tensor<T>, Tensor<i64>) {
        let mut attrs = OpAttrs::new();
        attrs
            .set_int("axis", axis as i64)
            .set_bool("descending", descending);
        let args = smallvec![self.handle.clone()];
        crate::tensor::run_pair(&ops::SORT, args, &attrs, Location::caller())
    }

    /// The positions that sort `self` along `axis`: the indices of
    /// [`Tensor::sort`] (stable; an error names `Sort`).
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<i32>::from_vec(vec![5, 7, 5, 1], &[4], &Device::cpu())?;
    /// assert_eq!(x.argsort(0, true).to_vec()?, vec![1, 0, 2, 3]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn argsort(&self, axis: isize, descending: bool) -> Tensor<i64> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_int("axis", axis as i64)
            .set_bool("descending", descending);
        let args = smallvec![self.handle.clone()];
        crate::tensor::run_pair::<T, i64>(&ops::SORT, args, &attrs, Location::caller()).1
    }

    /// The `k` largest (or, with `largest == false`, smallest) entries
    /// along `axis` and their i64 positions. Ties go to the earlier
    /// position (the first `k` of the stable [`Tensor::sort`]); with
    /// `sorted` the entries come in that order, otherwise in the order
    /// they have in `self`. `k` larger than the axis is an error.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f64>::from_vec(vec![0.5, 4.0, -1.0, 4.0, 2.0], &[5], &Device::cpu())?;
    /// let (values, indices) = x.topk(3, 0, true, true);
    /// assert_eq!(values.to_vec()?, vec![4.0, 4.0, 2.0]);
    /// assert_eq!(indices.to_vec()?, vec![1, 3, 4]);
    /// let (_, in_place) = x.topk(3, 0, true, false);
    /// assert_eq!(in_place.to_vec()?, vec![1, 3, 4]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn topk(
        &self,
        k: usize,
        axis: isize,
        largest: bool,
        sorted: bool,
    ) -> (Tensor<T>, Tensor<i64>) {
        let mut attrs = OpAttrs::new();
        attrs
            .set_int("k", i64::try_from(k).unwrap_or(i64::MAX))
            .set_int("axis", axis as i64)
            .set_bool("largest", largest)
            .set_bool("sorted", sorted);
        let args = smallvec![self.handle.clone()];
        crate::tensor::run_pair(&ops::TOP_K, args, &attrs, Location::caller())
    }

    /// Matrix product with NumPy `matmul` semantics (batched, broadcast
    /// batch dimensions, vectors promoted).
    #[track_caller]
    pub fn matmul(&self, other: &Tensor<T>) -> Tensor<T> {
        self.binary(&ops::MATMUL, other, Location::caller())
    }

    /// The affine map of a PyTorch `nn.Linear`: `self · weightᵀ + bias`
    /// for `self: [.., in]`, `weight: [out, in]` and an optional `bias:
    /// [out]`, giving `[.., out]`.
    ///
    /// The weight keeps PyTorch's `[out, in]` layout (so checkpoints map
    /// one to one) and is never transposed in memory: the product is one
    /// `MatMul` with `transpose_b`, whose gradient rule folds the
    /// transposes into its own products. Leading dimensions are flattened
    /// into one batch of rows first, so the weight's gradient is a single
    /// `[out, N]·[N, in]` product rather than a batch of them summed.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let cpu = Device::cpu();
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[1, 2], &cpu)?;
    /// let w = Tensor::<f32>::from_vec(vec![1.0, 0.0, 1.0, 1.0, 0.0, 2.0], &[3, 2], &cpu)?;
    /// let b = Tensor::<f32>::from_vec(vec![0.5, 0.5, 0.5], &[3], &cpu)?;
    /// assert_eq!(x.linear(&w, Some(&b)).to_vec()?, vec![1.5, 3.5, 4.5]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn linear(&self, weight: &Tensor<T>, bias: Option<&Tensor<T>>) -> Tensor<T> {
        let location = Location::caller();
        let dims = self.dims().to_vec();
        let rows = if dims.len() > 2 {
            let inner = dims[dims.len() - 1];
            self.reshape(&[dims[..dims.len() - 1].iter().product(), inner])
        } else {
            self.clone()
        };
        let attrs = ops::matmul_attrs(false, true);
        let args = smallvec![rows.handle.clone(), weight.handle.clone()];
        let mut y: Tensor<T> = crate::tensor::run(&ops::MATMUL, args, &attrs, location);
        if dims.len() > 2 {
            let mut out = dims[..dims.len() - 1].to_vec();
            out.push(y.dims().last().copied().unwrap_or(0));
            y = y.reshape(&out);
        }
        match bias {
            Some(b) => crate::tensor::run(
                &ops::ADD,
                smallvec![y.handle, b.handle.clone()],
                &OpAttrs::new(),
                location,
            ),
            None => y,
        }
    }

    /// A tensor of `0, 1, ..., n-1`-style values: `start, start+step, ...`
    /// below `stop`.
    #[track_caller]
    pub fn arange(start: f64, stop: f64, step: f64, device: &crate::Device) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_float("start", start)
            .set_float("stop", stop)
            .set_float("step", step)
            .set_dtype("dtype", T::DTYPE);
        let location = Location::caller();
        crate::with_device(device, || {
            crate::tensor::run(&ops::ARANGE, SmallVec::new(), &attrs, location)
        })
    }
}

impl<T: FloatElement> Tensor<T> {
    /// Softmax along `axis`.
    #[track_caller]
    pub fn softmax(&self, axis: isize) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis as i64);
        self.unary(&ops::SOFTMAX, &attrs, Location::caller())
    }

    /// Log-softmax along `axis`.
    #[track_caller]
    pub fn log_softmax(&self, axis: isize) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs.set_int("axis", axis as i64);
        self.unary(&ops::LOG_SOFTMAX, &attrs, Location::caller())
    }

    /// 2-D convolution of `self: [N, C, H, W]` with `weight: [O, C/groups,
    /// KH, KW]`.
    #[track_caller]
    pub fn conv2d(&self, weight: &Tensor<T>, options: Conv2dOptions) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("stride", &options.stride)
            .set_dims("padding", &options.padding)
            .set_dims("dilation", &options.dilation)
            .set_int("groups", options.groups as i64);
        let args = smallvec![self.handle.clone(), weight.handle.clone()];
        crate::tensor::run(&ops::CONV2D, args, &attrs, Location::caller())
    }

    /// Variance over `axes` (every axis when empty): the mean squared
    /// deviation from the mean, times `n / (n - correction)` for `n`
    /// elements per result (`correction = 1` is the unbiased sample
    /// variance, PyTorch's default; `0` the population variance). `n ≤
    /// correction` gives infinity (NaN for constant values) and zero
    /// elements give NaN, as in PyTorch.
    ///
    /// Two passes: the deviations from the computed mean `m̂`, then
    /// `mean(d²) - mean(d)²`, whose second term removes the error of `m̂`
    /// to first order, so values far from zero keep their precision (see
    /// `docs/accuracy.md`). Composed of existing ops, so it has their
    /// gradients and fuses where they do.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f64>::from_vec(vec![1.0, 3.0, 5.0, 5.0], &[2, 2], &Device::cpu())?;
    /// assert_eq!(x.var(&[1], false, 1).to_vec()?, vec![2.0, 0.0]);
    /// assert_eq!(x.var(&[1], true, 0).dims(), &[2, 1]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn var(&self, axes: &[isize], keepdim: bool, correction: usize) -> Tensor<T> {
        self.variance("Var", axes, keepdim, correction, Location::caller())
    }

    /// Standard deviation: the square root of [`Tensor::var`] (same
    /// `correction`). Its gradient where the variance is 0 is NaN (the
    /// derivative of the square root there is infinite and meets a zero
    /// derivative of the variance), as in PyTorch.
    ///
    /// ```
    /// use stagecraft::{Device, Tensor};
    /// let x = Tensor::<f32>::from_vec(vec![2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0], &[8], &Device::cpu())?;
    /// assert_eq!(x.std(&[], false, 0).item()?, 2.0);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn std(&self, axes: &[isize], keepdim: bool, correction: usize) -> Tensor<T> {
        let location = Location::caller();
        let var = self.variance("Std", axes, keepdim, correction, location);
        var.unary(&ops::SQRT, &OpAttrs::new(), location)
    }

    fn variance(
        &self,
        name: &str,
        axes: &[isize],
        keepdim: bool,
        correction: usize,
        location: Location,
    ) -> Tensor<T> {
        let axes = axes_attr(axes);
        // An input that already failed passes its error on through the ops
        // below; its shape says nothing.
        let count = if self.handle.resolved_error().is_some() {
            1
        } else {
            match ops::reduction_axes(&axes, self.rank()) {
                Ok(resolved) => {
                    let dims: SmallVec<[usize; 4]> =
                        resolved.iter().map(|&a| self.dims()[a]).collect();
                    stagecraft_tensor::element_count(&dims)
                }
                Err(e) => return self.fail(name, location, e),
            }
        };
        let reduce = |x: &Tensor<T>, keep: bool| {
            let mut attrs = OpAttrs::new();
            attrs.set_ints("axes", &axes).set_bool("keepdim", keep);
            x.unary::<T>(&ops::MEAN, &attrs, location)
        };
        let mean = reduce(self, true);
        let d: Tensor<T> = self.binary(&ops::SUB, &mean, location);
        let squares: Tensor<T> = d.binary(&ops::MUL, &d, location);
        let mean_square = reduce(&squares, keepdim);
        // mean(d) is m - m̂ (the mean's rounding error, up to rounding),
        // and mean((x - m̂)²) - (m - m̂)² is the variance exactly.
        let offset = reduce(&d, keepdim);
        let offset_squared: Tensor<T> = offset.binary(&ops::MUL, &offset, location);
        let var: Tensor<T> = mean_square.binary(&ops::SUB, &offset_squared, location);
        // Rounding can leave a near-constant input's variance a hair below
        // zero, whose square root would be NaN.
        let var: Tensor<T> = var.binary(
            &ops::MAXIMUM,
            &scalar_like(T::from_scalar(Scalar::F64(0.0)), &var),
            location,
        );
        if correction == 0 {
            return var;
        }
        let scale = if count > correction {
            count as f64 / (count - correction) as f64
        } else {
            f64::INFINITY
        };
        var.binary(
            &ops::MUL,
            &scalar_like(T::from_scalar(Scalar::F64(scale)), &var),
            location,
        )
    }

    /// 1-D convolution (cross-correlation) of `self: [N, C, L]` with
    /// `weight: [O, C/groups, K]`, giving `[N, O, L']` with `L' = (L +
    /// 2·padding - dilation·(K-1) - 1) / stride + 1`. Runs as a
    /// [`Tensor::conv2d`] of height 1, whose gradients it has; bad shapes
    /// and attributes are errors naming `Conv1d`.
    ///
    /// ```
    /// use stagecraft::{Conv1dOptions, Device, Tensor};
    /// let d = Device::cpu();
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 1, 4], &d)?;
    /// let w = Tensor::<f32>::from_vec(vec![1.0, -1.0], &[1, 1, 2], &d)?;
    /// let y = x.conv1d(&w, Conv1dOptions { padding: 1, ..Default::default() });
    /// assert_eq!(y.to_vec()?, vec![-1.0, -1.0, -1.0, -1.0, 4.0]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn conv1d(&self, weight: &Tensor<T>, options: Conv1dOptions) -> Tensor<T> {
        let location = Location::caller();
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("stride", &[1, options.stride])
            .set_dims("padding", &[0, options.padding])
            .set_dims("dilation", &[1, options.dilation])
            .set_int("groups", i64::try_from(options.groups).unwrap_or(i64::MAX));
        let (xd, wd) = (self.dims(), weight.dims());
        let failed =
            self.handle.resolved_error().is_some() || weight.handle.resolved_error().is_some();
        if !failed {
            if xd.len() != 3 || wd.len() != 3 {
                let e = Error::shape(format!(
                    "conv1d needs x: [N, C, L] and w: [O, C/groups, K], got {xd:?} and {wd:?}"
                ));
                return self.fail("Conv1d", location, e);
            }
            let as_image = |m: &stagecraft_tensor::TensorMetadata| {
                let d = m.shape.dims();
                stagecraft_tensor::TensorMetadata::new(m.dtype, [d[0], d[1], 1, d[2]])
            };
            let metas = [
                as_image(self.handle.metadata()),
                as_image(weight.handle.metadata()),
            ];
            if let Err(e) = ops::CONV2D.infer(&metas, &attrs) {
                return self.fail("Conv1d", location, e);
            }
        }
        let image = |t: &Tensor<T>| {
            let d = t.dims();
            let dims = if d.len() == 3 {
                vec![d[0], d[1], 1, d[2]]
            } else {
                d.to_vec()
            };
            let mut shape = OpAttrs::new();
            shape.set_dims("shape", &dims);
            t.unary::<T>(&ops::RESHAPE, &shape, location)
        };
        let args = smallvec![image(self).handle.clone(), image(weight).handle.clone()];
        let y: Tensor<T> = crate::tensor::run(&ops::CONV2D, args, &attrs, location);
        let yd = y.dims();
        let dims = if yd.len() == 4 {
            vec![yd[0], yd[1], yd[3]]
        } else {
            yd.to_vec()
        };
        let mut shape = OpAttrs::new();
        shape.set_dims("shape", &dims);
        y.unary(&ops::RESHAPE, &shape, location)
    }

    /// Transposed 2-D convolution of `self: [N, C, H, W]` with `weight:
    /// [C, O/groups, KH, KW]` (PyTorch's layout), giving `[N, O, OH, OW]`
    /// with `OH = (H-1)·stride - 2·padding + dilation·(KH-1) +
    /// output_padding + 1`: the adjoint of [`Tensor::conv2d`] with the
    /// same options, so it maps a convolution's output shape back to its
    /// input's (`output_padding`, smaller than the stride, picks among the
    /// sizes a strided convolution maps to the same output).
    ///
    /// ```
    /// use stagecraft::{ConvTranspose2dOptions, Device, Tensor};
    /// let d = Device::cpu();
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[1, 1, 1, 2], &d)?;
    /// let w = Tensor::<f32>::ones(&[1, 1, 2, 2], &d);
    /// let options = ConvTranspose2dOptions { stride: [2, 2], ..Default::default() };
    /// let y = x.conv_transpose2d(&w, options);
    /// assert_eq!(y.dims(), &[1, 1, 2, 4]);
    /// assert_eq!(y.to_vec()?, vec![1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0]);
    /// # Ok::<(), stagecraft::Error>(())
    /// ```
    #[track_caller]
    pub fn conv_transpose2d(
        &self,
        weight: &Tensor<T>,
        options: ConvTranspose2dOptions,
    ) -> Tensor<T> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("stride", &options.stride)
            .set_dims("padding", &options.padding)
            .set_dims("output_padding", &options.output_padding)
            .set_dims("dilation", &options.dilation)
            .set_int("groups", i64::try_from(options.groups).unwrap_or(i64::MAX));
        let args = smallvec![self.handle.clone(), weight.handle.clone()];
        crate::tensor::run(&ops::CONV_TRANSPOSE2D, args, &attrs, Location::caller())
    }

    /// Max pooling of `self: [N, C, H, W]` (stride defaults to the kernel).
    #[track_caller]
    pub fn max_pool2d(&self, options: Pool2dOptions) -> Tensor<T> {
        self.unary(&ops::MAX_POOL2D, &options.attrs(None), Location::caller())
    }

    /// Average pooling of `self: [N, C, H, W]` (stride defaults to the
    /// kernel; padded zeros count unless `count_include_pad` is false).
    #[track_caller]
    pub fn avg_pool2d(&self, options: Pool2dOptions, count_include_pad: bool) -> Tensor<T> {
        self.unary(
            &ops::AVG_POOL2D,
            &options.attrs(Some(count_include_pad)),
            Location::caller(),
        )
    }

    /// Uniform random values in `[low, high)`, drawn from `rng`.
    #[track_caller]
    pub fn rand_uniform(
        dims: &[usize],
        low: f64,
        high: f64,
        rng: &mut crate::Rng,
        device: &crate::Device,
    ) -> Tensor<T> {
        let (seed, offset) = rng.advance(dims);
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("shape", dims)
            .set_dtype("dtype", T::DTYPE)
            .set_int("seed", seed as i64)
            .set_int("offset", offset as i64)
            .set_float("low", low)
            .set_float("high", high);
        let location = Location::caller();
        crate::with_device(device, || {
            crate::tensor::run(&ops::RANDOM_UNIFORM, SmallVec::new(), &attrs, location)
        })
    }

    /// Normal random values with `mean` and `std`, drawn from `rng`.
    #[track_caller]
    pub fn rand_normal(
        dims: &[usize],
        mean: f64,
        std: f64,
        rng: &mut crate::Rng,
        device: &crate::Device,
    ) -> Tensor<T> {
        let (seed, offset) = rng.advance(dims);
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("shape", dims)
            .set_dtype("dtype", T::DTYPE)
            .set_int("seed", seed as i64)
            .set_int("offset", offset as i64)
            .set_float("mean", mean)
            .set_float("std", std);
        let location = Location::caller();
        crate::with_device(device, || {
            crate::tensor::run(&ops::RANDOM_NORMAL, SmallVec::new(), &attrs, location)
        })
    }
}

impl<I: IndexElement> Tensor<I> {
    /// One-hot encoding into `depth` classes: shape `self ++ [depth]`.
    #[track_caller]
    pub fn one_hot<U: Element>(&self, depth: usize) -> Tensor<U> {
        let mut attrs = OpAttrs::new();
        attrs
            .set_int("depth", depth as i64)
            .set_dtype("dtype", U::DTYPE);
        self.unary(&ops::ONE_HOT, &attrs, Location::caller())
    }
}

/// Options of [`Tensor::conv2d`]: `(height, width)` pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Step between windows.
    pub stride: [usize; 2],
    /// Zero padding on each side.
    pub padding: [usize; 2],
    /// Spacing between kernel taps.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

/// Options of [`Tensor::conv1d`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv1dOptions {
    /// Step between windows.
    pub stride: usize,
    /// Zero padding on each side.
    pub padding: usize,
    /// Spacing between kernel taps.
    pub dilation: usize,
    /// Channel groups.
    pub groups: usize,
}

impl Default for Conv1dOptions {
    fn default() -> Self {
        Conv1dOptions {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

/// Options of [`Tensor::conv_transpose2d`]: `(height, width)` pairs, with
/// the meaning they have for the [`Tensor::conv2d`] it is the adjoint of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvTranspose2dOptions {
    /// Step between the convolution's windows (the output's upsampling).
    pub stride: [usize; 2],
    /// The convolution's zero padding, cropped from each side of the output.
    pub padding: [usize; 2],
    /// Extra rows and columns at the end of the output (below the stride).
    pub output_padding: [usize; 2],
    /// Spacing between kernel taps.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
}

impl Default for ConvTranspose2dOptions {
    fn default() -> Self {
        ConvTranspose2dOptions {
            stride: [1, 1],
            padding: [0, 0],
            output_padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

/// Options of the pooling ops: `(height, width)` pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dOptions {
    /// Window size.
    pub kernel: [usize; 2],
    /// Step between windows (`None`: the kernel size).
    pub stride: Option<[usize; 2]>,
    /// Padding on each side.
    pub padding: [usize; 2],
}

impl Pool2dOptions {
    /// A `kernel`-sized window with stride = kernel and no padding.
    pub fn new(kernel: [usize; 2]) -> Pool2dOptions {
        Pool2dOptions {
            kernel,
            stride: None,
            padding: [0, 0],
        }
    }

    fn attrs(&self, count_include_pad: Option<bool>) -> OpAttrs {
        let mut attrs = OpAttrs::new();
        attrs
            .set_dims("kernel", &self.kernel)
            .set_dims("padding", &self.padding);
        if let Some(stride) = self.stride {
            attrs.set_dims("stride", &stride);
        }
        if let Some(c) = count_include_pad {
            attrs.set_bool("count_include_pad", c);
        }
        attrs
    }
}

/// A scalar tensor of `value` on the same device as `like`, for mixing
/// tensors with Rust numbers.
pub(crate) fn scalar_like<T: Element>(value: T, like: &Tensor<T>) -> Tensor<T> {
    Tensor::from_handle(TensorHandle::available(
        like.device(),
        stagecraft_tensor::ScalarHostTensor::new(
            value.to_scalar(),
            stagecraft_tensor::Shape::scalar(),
        )
        .into(),
    ))
}
