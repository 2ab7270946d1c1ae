//! Elementwise kernels: unary math, broadcasting binary arithmetic and
//! logic, comparisons, select and cast.
//!
//! Broadcasting is planned once per call as a walk over rows (see [`Walk`]):
//! the innermost run of output elements along which every input is either
//! contiguous or constant becomes a plain slice loop that LLVM vectorises,
//! so same-shape and scalar operands are simply the one-row case.
//!
//! Unary and binary kernels write into an input's buffer when they hold its
//! last reference and it already has the output's dtype and shape: a chain
//! like `-((x * 2) + 1)` then runs in a single buffer.

use super::{out_meta, take};
use crate::isa::IsaLevel;
use crate::numeric::broadcast_strides;
use crate::{Inputs, Kernel, KernelContext, KernelRegistry, PARALLEL_THRESHOLD};
use half::{bf16, f16};
use smallvec::{smallvec, SmallVec};
use stagecraft_ops::scalar::{exp_to_narrow, f64_to_f32_odd, Num};
use stagecraft_ops::{
    Attrs, BinaryFn, BinaryOp, BinaryVisitor, CompareOp, OpKind, UnaryFn, UnaryOp, UnaryVisitor,
};
use stagecraft_tensor::{DType, DenseHostTensor, Element, Error, Result, Shape, TensorMetadata};
use std::marker::PhantomData;
use std::sync::Arc;

/// Elements per parallel task: enough work to amortise a rayon fork.
pub(crate) const CHUNK: usize = 1 << 14;

pub(crate) fn register(registry: &mut KernelRegistry) {
    use stagecraft_ops as ops;
    // Every unary and binary op's kernel derives from its definition.
    for op in UnaryOp::ALL {
        registry.add(op.def(), unary_factory);
    }
    for op in BinaryOp::ALL {
        registry.add(op.def(), binary_factory);
    }
    let compare = [
        &ops::EQUAL,
        &ops::NOT_EQUAL,
        &ops::LESS,
        &ops::LESS_EQUAL,
        &ops::GREATER,
        &ops::GREATER_EQUAL,
    ];
    for op in compare {
        registry.add(op, compare_factory);
    }
    registry.add(&ops::SELECT, select_factory);
    registry.add(&ops::CAST, cast_factory);
    registry.add(&ops::GELU_WITH_DERIVATIVE, gelu_with_derivative_factory);
    registry.add(&ops::BITCAST, bitcast_factory);
}

// ---------------------------------------------------------------------------
// Shared helpers (also used by the reduction kernels).

/// True when `x` may be overwritten to become an output of `meta`: no one
/// else holds its buffer and it already has the right dtype and shape.
pub(crate) fn reusable(x: &DenseHostTensor, meta: &TensorMetadata) -> bool {
    x.is_unique() && x.metadata() == meta
}

/// `out[i] = f(src[i])`, in parallel above the threshold, each part with
/// the loop for [`loop_level`] of the output type.
pub(crate) fn map_into<S, D, F>(out: &mut [D], src: &[S], f: F)
where
    S: Copy + Sync,
    D: Element,
    F: Map<S, D>,
{
    let level = loop_level::<D>(out.len());
    if out.len() > PARALLEL_THRESHOLD {
        crate::pool::for_each_chunk(out, CHUNK, |c, o| map_on(level, o, &src[c * CHUNK..], f));
    } else {
        map_on(level, out, src, f);
    }
}

// ---------------------------------------------------------------------------
// Loops compiled per instruction set.

/// Defines `$name(level, args...)`, which runs `$body(args...)` with its
/// loops compiled for `level`: the build targets baseline x86-64 (SSE2, two
/// f64 lanes), and a polynomial such as GELU's or `exp`'s runs several
/// times faster in AVX-512's eight. The results do not change: every
/// operation is still one IEEE operation per element (no contraction into
/// FMA, no reassociation), whatever the vector width.
///
/// `per $V` names the element type whose [`loop_level`] chose `level`:
/// for a type whose loops always run at baseline, the AVX copies are
/// behind a branch on a constant that is false for it, so rustc does not
/// instantiate them (eleven of the thirteen dtypes are such types).
macro_rules! multiversioned {
    ($(#[$doc:meta])* fn $name:ident<$($g:ident),*>($($arg:ident: $ty:ty),*)
        where [$($bounds:tt)*] => $body:ident per $V:ident) => {
        $(#[$doc])*
        fn $name<$($g),*>(level: IsaLevel, $($arg: $ty),*) where $($bounds)* {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            fn avx2<$($g),*>($($arg: $ty),*) where $($bounds)* {
                $body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512<$($g),*>($($arg: $ty),*) where $($bounds)* {
                $body($($arg),*)
            }
            if <$V as VectorLoops>::VECTOR_LOOPS {
                match level {
                    // SAFETY: `crate::isa::level` reports AVX2 only on a CPU
                    // that has it, which is all `avx2` is compiled to use.
                    #[cfg(target_arch = "x86_64")]
                    IsaLevel::Avx2 => unsafe { avx2($($arg),*) },
                    // SAFETY: as above, for AVX-512F.
                    #[cfg(target_arch = "x86_64")]
                    IsaLevel::Avx512 => unsafe { avx512($($arg),*) },
                    _ => $body($($arg),*),
                }
            } else {
                $body($($arg),*)
            }
        }
    };
}

/// Whether a type's element loops run with the kernels' instruction set
/// ([`loop_level`]): a constant, so that code for the other levels is
/// never instantiated for the types whose loops stay at baseline.
trait VectorLoops {
    const VECTOR_LOOPS: bool;
}

impl<T: Element> VectorLoops for T {
    const VECTOR_LOOPS: bool = matches!(T::DTYPE, DType::F32 | DType::F64);
}

/// The instruction set a loop over `n` elements of `T` runs with: the
/// kernels' level for the float types (their math vectorizes), baseline
/// for the rest and for short loops, where the call through the dispatch
/// would cost more than it saves.
#[inline(always)]
fn loop_level<T: Element>(n: usize) -> IsaLevel {
    const SHORT: usize = 64;
    if T::VECTOR_LOOPS && n >= SHORT {
        crate::isa::level()
    } else {
        IsaLevel::Baseline
    }
}

/// A function of one element that the loops call directly, so that it is
/// inlined into them. A closure or fn item is called through its `Fn`
/// shim, which LLVM leaves as a call per element once the function is
/// large (GELU's is), and the loop then does not vectorize.
pub(crate) trait Map<T, U = T>: Copy + Send + Sync {
    /// The function's value at `x`.
    fn map(self, x: T) -> U;
}

/// [`Map`] for a function of two elements.
pub(crate) trait Zip<T, U = T>: Copy + Send + Sync {
    /// The function's value at `(a, b)`.
    fn zip(self, a: T, b: T) -> U;
}

impl<T, U, C: Fn(T) -> U + Copy + Send + Sync> Map<T, U> for C {
    #[inline(always)]
    fn map(self, x: T) -> U {
        self(x)
    }
}

impl<T, U, C: Fn(T, T) -> U + Copy + Send + Sync> Zip<T, U> for C {
    #[inline(always)]
    fn zip(self, a: T, b: T) -> U {
        self(a, b)
    }
}

/// A unary op's definition ([`UnaryFn::eval`]) as a [`Map`].
pub(crate) struct UnaryEval<F>(pub(crate) PhantomData<fn() -> F>);

impl<F> Clone for UnaryEval<F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F> Copy for UnaryEval<F> {}

impl<T: Num, F: UnaryFn> Map<T> for UnaryEval<F> {
    #[inline(always)]
    fn map(self, x: T) -> T {
        F::eval::<T>(x)
    }
}

/// A binary op's definition ([`BinaryFn::eval`]) as a [`Zip`].
pub(crate) struct BinaryEval<F>(pub(crate) PhantomData<fn() -> F>);

impl<F> Clone for BinaryEval<F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F> Copy for BinaryEval<F> {}

impl<T: Num, F: BinaryFn> Zip<T> for BinaryEval<F> {
    #[inline(always)]
    fn zip(self, a: T, b: T) -> T {
        F::eval::<T>(a, b)
    }
}

/// `f` with its operands swapped: `Flipped(f).zip(b, a) = f.zip(a, b)`.
#[derive(Clone, Copy)]
struct Flipped<Z>(Z);

impl<T, U, Z: Zip<T, U>> Zip<T, U> for Flipped<Z> {
    #[inline(always)]
    fn zip(self, b: T, a: T) -> U {
        self.0.zip(a, b)
    }
}

#[inline(always)]
fn map_loop<S: Copy, D, F: Map<S, D>>(out: &mut [D], src: &[S], f: F) {
    for (o, &s) in out.iter_mut().zip(src) {
        *o = f.map(s);
    }
}

#[inline(always)]
fn update_loop<T: Copy, F: Map<T>>(xs: &mut [T], f: F) {
    for x in xs {
        *x = f.map(*x);
    }
}

multiversioned! {
    /// `out[i] = f(src[i])`.
    fn map_on<S, D, F>(out: &mut [D], src: &[S], f: F) where [S: Copy, D: Element, F: Map<S, D>] => map_loop per D
}

multiversioned! {
    /// `xs[i] = f(xs[i])`.
    fn update_on<T, F>(xs: &mut [T], f: F) where [T: Element, F: Map<T>] => update_loop per T
}

/// [`map_into`] in place.
fn update_unary<T: Element, F: Map<T>>(xs: &mut [T], f: F) {
    let level = loop_level::<T>(xs.len());
    if xs.len() > PARALLEL_THRESHOLD {
        crate::pool::for_each_chunk(xs, CHUNK, |_, c| update_on(level, c, f));
    } else {
        update_on(level, xs, f);
    }
}

/// True for a NaN (false for every non-float type).
#[inline(always)]
pub(crate) fn is_nan<T: PartialOrd>(v: T) -> bool {
    v.partial_cmp(&v).is_none()
}

/// The larger of two values; a NaN on either side wins.
#[inline(always)]
pub(crate) fn nan_max(a: f64, b: f64) -> f64 {
    if a > b || a.is_nan() {
        a
    } else {
        b
    }
}

/// The smaller of two values; a NaN on either side wins.
#[inline(always)]
pub(crate) fn nan_min(a: f64, b: f64) -> f64 {
    if a < b || a.is_nan() {
        a
    } else {
        b
    }
}

fn no_kernel(attrs: &Attrs<'_>, dtype: DType) -> Error {
    Error::dtype(format!("{} has no CPU kernel for {dtype}", attrs.op().name))
}

// ---------------------------------------------------------------------------
// Element traits.

/// Floating-point element types, computed through f64: evaluating a
/// function in f64 (glibc's functions are within 1 ULP there) and rounding
/// once keeps f32, f16 and bf16 results within 1 ULP of correctly rounded.
pub(crate) trait Real: Element {
    /// The value as f64 (exact).
    fn wide(self) -> f64;
    /// `v` rounded to this type (to nearest, ties to even).
    fn narrow(v: f64) -> Self;
    /// `e^x` in f64, accurate enough for a result rounded to this type:
    /// glibc's for f64, [`exp_to_narrow`] (which vectorizes) for f32 and
    /// narrower.
    #[inline(always)]
    fn exp_wide(x: f64) -> f64 {
        x.exp()
    }
    /// The values as f32, for the vector paths written for f32 alone
    /// (`None` for every other type).
    #[inline(always)]
    fn as_f32(_values: &[Self]) -> Option<&[f32]> {
        None
    }
    /// [`Real::as_f32`] for writing.
    #[inline(always)]
    fn as_f32_mut(_values: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

impl Real for f64 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self
    }
    #[inline(always)]
    fn narrow(v: f64) -> f64 {
        v
    }
}

impl Real for f32 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn narrow(v: f64) -> f32 {
        v as f32
    }
    #[inline(always)]
    fn as_f32(values: &[f32]) -> Option<&[f32]> {
        Some(values)
    }
    #[inline(always)]
    fn as_f32_mut(values: &mut [f32]) -> Option<&mut [f32]> {
        Some(values)
    }
    #[inline(always)]
    fn exp_wide(x: f64) -> f64 {
        exp_to_narrow(x)
    }
}

/// [`f64_to_f32_odd`] for an i64, exact beyond 2^53 too.
#[inline(always)]
fn i64_to_f32_odd(v: i64) -> f32 {
    let r = v as f32;
    let back = r as f64 as i128;
    let exact = v as i128;
    if back == exact {
        return r;
    }
    let toward_zero = if back.abs() > exact.abs() {
        f32::from_bits(r.to_bits() - 1)
    } else {
        r
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}

/// [`f64_to_f32_odd`] for any integer, exact for every value: through
/// [`i64_to_f32_odd`], a u64 above `i64::MAX` halved first with its low bit
/// kept as a sticky bit (which keeps the rounding to odd exact), then
/// doubled (exact in f32).
#[inline(always)]
fn int_to_f32_odd<T: Into<i128> + Copy>(v: T) -> f32 {
    let wide: i128 = v.into();
    match i64::try_from(wide) {
        Ok(small) => i64_to_f32_odd(small),
        Err(_) => {
            let halved = ((wide >> 1) | (wide & 1)) as i64;
            i64_to_f32_odd(halved) * 2.0
        }
    }
}

impl Real for f16 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self.to_f64()
    }
    #[inline(always)]
    fn narrow(v: f64) -> f16 {
        f16::from_f32(f64_to_f32_odd(v))
    }
    #[inline(always)]
    fn exp_wide(x: f64) -> f64 {
        exp_to_narrow(x)
    }
}

impl Real for bf16 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self.to_f64()
    }
    #[inline(always)]
    fn narrow(v: f64) -> bf16 {
        bf16::from_f32(f64_to_f32_odd(v))
    }
    #[inline(always)]
    fn exp_wide(x: f64) -> f64 {
        exp_to_narrow(x)
    }
}

/// A numeric element type with the arithmetic of the op definitions
/// ([`Num`]: integers wrap, floats round once; f16 and bf16 go through
/// f32, whose extra precision makes the double rounding of `+ - * /`
/// harmless).
pub(crate) trait Arith: Element + Num {}

impl<T: Element + Num> Arith for T {}

// ---------------------------------------------------------------------------
// Unary.

pub(crate) use stagecraft_ops::scalar::relu;

fn unary_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let OpKind::Unary(op) = attrs.op().kind else {
        return Err(Error::internal(format!(
            "{} is not a unary op",
            attrs.op().name
        )));
    };
    let dtype = inputs
        .first()
        .ok_or_else(|| Error::internal("unary op without input"))?
        .dtype;
    if !op.class().accepts(dtype) {
        return Err(no_kernel(attrs, dtype));
    }
    // A bool op's meaning is defined on 0 and 1, and gives 0 or 1.
    if dtype == DType::Bool {
        return Ok(op.visit(BoolUnaryKernel));
    }
    crate::with_numeric_type!(dtype, T => Ok(op.visit(UnaryKernel::<T>::new())),
        _ => Err(no_kernel(attrs, dtype)))
}

/// Makes the eager kernel of a unary op over `T` from its definition.
struct UnaryKernel<T>(std::marker::PhantomData<T>);

impl<T> UnaryKernel<T> {
    fn new() -> Self {
        UnaryKernel(std::marker::PhantomData)
    }
}

impl<T: Arith> UnaryVisitor for UnaryKernel<T> {
    type Output = Kernel;
    fn visit<F: UnaryFn>(self) -> Kernel {
        // Decided at compile time, so an op's loop is only instantiated for
        // the dtypes of its class (an integer `Exp` or a float `BitwiseNot`
        // would be dead code, and the many dtypes make it a lot of it).
        if const { F::CLASS.accepts(T::DTYPE) } {
            unary_kernel::<T, _>(UnaryEval::<F>(PhantomData))
        } else {
            class_mismatch(F::OP.def().name, T::DTYPE)
        }
    }
}

/// The kernel of an op for a dtype outside its class: never made, since
/// the factories check the class first, but an error rather than a panic
/// if it were.
fn class_mismatch(op: &'static str, dtype: DType) -> Kernel {
    Arc::new(move |_: Inputs, _: &KernelContext<'_>| {
        Err(Error::dtype(format!("{op} has no CPU kernel for {dtype}")))
    })
}

/// Makes the eager kernel of a bool unary op from its definition on 0/1.
struct BoolUnaryKernel;

impl UnaryVisitor for BoolUnaryKernel {
    type Output = Kernel;
    fn visit<F: UnaryFn>(self) -> Kernel {
        unary_kernel(|x: bool| F::eval::<u8>(x as u8) != 0)
    }
}

fn unary_kernel<T: Element, F: Map<T> + 'static>(f: F) -> Kernel {
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let meta = out_meta(ctx)?;
        if reusable(&x, meta) {
            let mut out = x;
            update_unary(out.as_mut_slice::<T>()?, f);
            return Ok(smallvec![out]);
        }
        let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
        map_into(out.as_mut_slice::<T>()?, x.as_slice::<T>()?, f);
        Ok(smallvec![out])
    })
}

// ---------------------------------------------------------------------------
// GELU with its derivative: one input, two outputs.

fn gelu_with_derivative_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = super::first_dtype(inputs)?;
    crate::with_float_type!(dtype, T => Ok(gelu_with_derivative_kernel::<T>()),
        _ => Err(no_kernel(attrs, dtype)))
}

fn gelu_with_derivative_kernel<T: Element + Num>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let meta = out_meta(ctx)?;
        let mut y = DenseHostTensor::for_overwrite(meta.clone())?;
        let mut d = DenseHostTensor::for_overwrite(meta.clone())?;
        let (xs, ys, ds) = (
            x.as_slice::<T>()?,
            y.as_mut_slice::<T>()?,
            d.as_mut_slice::<T>()?,
        );
        let level = loop_level::<T>(xs.len());
        if xs.len() > PARALLEL_THRESHOLD {
            let parts = ys
                .chunks_mut(CHUNK)
                .zip(ds.chunks_mut(CHUNK))
                .zip(xs.chunks(CHUNK));
            crate::pool::for_each_item_init(
                parts,
                xs.len().div_ceil(CHUNK),
                || (),
                |(), ((ys, ds), xs)| gelu_with_derivative_on(level, ys, ds, xs),
            );
        } else {
            gelu_with_derivative_on(level, ys, ds, xs);
        }
        Ok(smallvec![y, d])
    })
}

#[inline(always)]
fn gelu_with_derivative_loop<T: Num>(ys: &mut [T], ds: &mut [T], xs: &[T]) {
    for ((y, d), &x) in ys.iter_mut().zip(ds.iter_mut()).zip(xs) {
        (*y, *d) = stagecraft_ops::gelu_with_derivative_of(x);
    }
}

multiversioned! {
    /// `(ys[i], ds[i]) = (gelu(xs[i]), gelu'(xs[i]))`.
    fn gelu_with_derivative_on<T>(ys: &mut [T], ds: &mut [T], xs: &[T])
        where [T: Num + Element] => gelu_with_derivative_loop per T
}

// ---------------------------------------------------------------------------
// Broadcast walk.

/// How to visit the output of a broadcasting op with `N` inputs row by row.
///
/// The output's size-1 dims are dropped and neighbouring dims merged
/// wherever every input is either contiguous across both or broadcast
/// across both. The innermost merged dim is the row: along it each input
/// has stride 1 (it advances) or 0 (one value repeats). The remaining dims
/// are walked with per-input strides to find each row's start.
pub(crate) struct Walk<const N: usize> {
    outer: SmallVec<[usize; 4]>,
    outer_strides: [SmallVec<[usize; 4]>; N],
    inner: usize,
    /// Each input's stride along a row: 0 or 1.
    pub(crate) inner_strides: [usize; N],
}

impl<const N: usize> Walk<N> {
    /// Plans the walk over `out` for inputs that broadcast to it.
    pub(crate) fn new(out: &Shape, inputs: [&Shape; N]) -> Walk<N> {
        let full: [SmallVec<[usize; 4]>; N] = inputs.map(|s| broadcast_strides(s, out));
        let mut dims: SmallVec<[usize; 4]> = SmallVec::new();
        let mut strides: [SmallVec<[usize; 4]>; N] = std::array::from_fn(|_| SmallVec::new());
        for (axis, &d) in out.dims().iter().enumerate() {
            if d == 1 {
                continue;
            }
            // Products saturate: they can only overflow for a zero-size
            // output whose other dimensions are huge, and zero absorbs the
            // saturated values, so such a walk still visits nothing.
            let merge = !dims.is_empty()
                && strides
                    .iter()
                    .zip(&full)
                    .all(|(s, f)| s.last() == Some(&f[axis].saturating_mul(d)));
            if merge {
                if let Some(last) = dims.last_mut() {
                    *last = last.saturating_mul(d);
                }
                for (s, f) in strides.iter_mut().zip(&full) {
                    if let Some(last) = s.last_mut() {
                        *last = f[axis];
                    }
                }
            } else {
                dims.push(d);
                for (s, f) in strides.iter_mut().zip(&full) {
                    s.push(f[axis]);
                }
            }
        }
        match dims.pop() {
            Some(inner) => {
                let inner_strides = std::array::from_fn(|k| strides[k].pop().unwrap_or(0));
                Walk {
                    outer: dims,
                    outer_strides: strides,
                    inner,
                    inner_strides,
                }
            }
            // Every dim is 1: one element, read at offset 0 of each input.
            None => Walk {
                outer: dims,
                outer_strides: strides,
                inner: 1,
                inner_strides: [0; N],
            },
        }
    }

    /// Calls `row(out_part, offsets)` for consecutive runs of `out` that lie
    /// in one row, where `offsets[k]` is where input `k` starts for that run
    /// (it then advances by `inner_strides[k]` per element). Parallel above
    /// the threshold.
    pub(crate) fn run<U: Send>(&self, out: &mut [U], row: impl Fn(&mut [U], [usize; N]) + Sync) {
        if out.len() > PARALLEL_THRESHOLD {
            crate::pool::for_each_chunk(out, CHUNK, |i, part| self.run_from(part, i * CHUNK, &row));
        } else if !out.is_empty() {
            self.run_from(out, 0, &row);
        }
    }

    /// [`Walk::run`]'s serial walk over `out`, which starts at output
    /// element `start`. `row` is called through a pointer, so the walk is
    /// compiled once per element type rather than once per op and dtype,
    /// at the cost of one more call per row besides its loop's.
    fn run_from<U>(&self, out: &mut [U], start: usize, row: &dyn Fn(&mut [U], [usize; N])) {
        let rank = self.outer.len();
        let (mut index, mut base) = self.position(start);
        let mut col = start % self.inner;
        let mut done = 0;
        while done < out.len() {
            let len = (self.inner - col).min(out.len() - done);
            let mut offsets = base;
            for (offset, stride) in offsets.iter_mut().zip(self.inner_strides) {
                *offset += col * stride;
            }
            row(&mut out[done..done + len], offsets);
            done += len;
            col = 0;
            for axis in (0..rank).rev() {
                index[axis] += 1;
                for (b, s) in base.iter_mut().zip(&self.outer_strides) {
                    *b += s[axis];
                }
                if index[axis] < self.outer[axis] {
                    break;
                }
                for (b, s) in base.iter_mut().zip(&self.outer_strides) {
                    *b -= s[axis] * self.outer[axis];
                }
                index[axis] = 0;
            }
        }
    }

    /// The outer index of the row holding output element `start`, and
    /// where each input's part of that row begins. (Compiled once per `N`,
    /// not per caller's row loop like [`Walk::run_from`].)
    fn position(&self, start: usize) -> (SmallVec<[usize; 4]>, [usize; N]) {
        let rank = self.outer.len();
        let mut index: SmallVec<[usize; 4]> = SmallVec::from_elem(0, rank);
        let mut rest = start / self.inner;
        for axis in (0..rank).rev() {
            index[axis] = rest % self.outer[axis];
            rest /= self.outer[axis];
        }
        let mut base = [0; N];
        for (b, strides) in base.iter_mut().zip(&self.outer_strides) {
            *b = index.iter().zip(strides).map(|(i, s)| i * s).sum();
        }
        (index, base)
    }
}

/// One input of a row loop: its values and its stride along rows (0 or 1).
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    data: &'a [T],
    step: usize,
}

impl<'a, T: Element> Operand<'a, T> {
    /// `t`'s elements, read `step` apart.
    fn of(t: &'a DenseHostTensor, step: usize) -> Result<Operand<'a, T>> {
        Ok(Operand {
            data: t.as_slice::<T>()?,
            step,
        })
    }
}

/// `out[j] = f(a[oa + j·sa], b[ob + j·sb])` over one row, with a plain
/// slice loop for each stride combination.
#[inline(always)]
fn zip_row<T: Copy, U>(
    out: &mut [U],
    a: Operand<'_, T>,
    oa: usize,
    b: Operand<'_, T>,
    ob: usize,
    f: impl Zip<T, U>,
) {
    let n = out.len();
    match (a.step, b.step) {
        (0, 0) => {
            let (x, y) = (a.data[oa], b.data[ob]);
            for o in out.iter_mut() {
                *o = f.zip(x, y);
            }
        }
        (0, _) => {
            let x = a.data[oa];
            for (o, &y) in out.iter_mut().zip(&b.data[ob..ob + n]) {
                *o = f.zip(x, y);
            }
        }
        (_, 0) => {
            let y = b.data[ob];
            for (o, &x) in out.iter_mut().zip(&a.data[oa..oa + n]) {
                *o = f.zip(x, y);
            }
        }
        _ => {
            for ((o, &x), &y) in out
                .iter_mut()
                .zip(&a.data[oa..oa + n])
                .zip(&b.data[ob..ob + n])
            {
                *o = f.zip(x, y);
            }
        }
    }
}

/// The steps of `a` and `b` in one flat loop over a small output of shape
/// `out` (see [`flat_step`]); `None` when an operand needs a broadcast walk
/// or the output is large enough to split its work.
fn flat_steps(a: &Shape, b: &Shape, out: &Shape) -> Option<(usize, usize)> {
    if out.numel() >= PARALLEL_THRESHOLD {
        return None;
    }
    Some((flat_step(a, out)?, flat_step(b, out)?))
}

/// How an operand of `shape` is read along the flat elements of an output
/// of `out` without a broadcast walk: element by element (the same shape)
/// or its one element throughout; `None` when it needs the walk.
fn flat_step(shape: &Shape, out: &Shape) -> Option<usize> {
    if shape == out {
        Some(1)
    } else if shape.numel() == 1 {
        Some(0)
    } else {
        None
    }
}

/// `out[j] = f(out[j], other[o + j·step])` over one row: the in-place form
/// of [`zip_row`] when `out` holds the other operand.
#[inline(always)]
fn update_row<T: Copy>(out: &mut [T], other: Operand<'_, T>, o: usize, f: impl Zip<T>) {
    if other.step == 0 {
        let y = other.data[o];
        for v in out.iter_mut() {
            *v = f.zip(*v, y);
        }
    } else {
        let n = out.len();
        for (v, &y) in out.iter_mut().zip(&other.data[o..o + n]) {
            *v = f.zip(*v, y);
        }
    }
}

#[inline(always)]
fn zip_row_by_pair<T: Copy, F: Zip<T>>(
    out: &mut [T],
    (a, oa): (Operand<'_, T>, usize),
    (b, ob): (Operand<'_, T>, usize),
    f: F,
) {
    zip_row(out, a, oa, b, ob, f)
}

#[inline(always)]
fn update_row_by_pair<T: Copy, F: Zip<T>>(
    out: &mut [T],
    (other, o): (Operand<'_, T>, usize),
    f: F,
) {
    update_row(out, other, o, f)
}

multiversioned! {
    /// [`zip_row`] for a binary op's row.
    fn zip_row_on<T, F>(
        out: &mut [T],
        a: (Operand<'_, T>, usize),
        b: (Operand<'_, T>, usize),
        f: F
    ) where [T: Element, F: Zip<T>] => zip_row_by_pair per T
}

multiversioned! {
    /// [`update_row`] for a binary op's row.
    fn update_row_on<T, F>(out: &mut [T], other: (Operand<'_, T>, usize), f: F)
        where [T: Element, F: Zip<T>] => update_row_by_pair per T
}

// ---------------------------------------------------------------------------
// Binary.

fn binary_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let OpKind::Binary(op) = attrs.op().kind else {
        return Err(Error::internal(format!(
            "{} is not a binary op",
            attrs.op().name
        )));
    };
    let dtype = inputs
        .first()
        .ok_or_else(|| Error::internal("binary op without inputs"))?
        .dtype;
    if !op.class().accepts(dtype) {
        return Err(no_kernel(attrs, dtype));
    }
    if dtype == DType::Bool {
        return Ok(op.visit(BoolBinaryKernel));
    }
    crate::with_numeric_type!(dtype, T => Ok(op.visit(BinaryKernel::<T>::new())),
        _ => Err(no_kernel(attrs, dtype)))
}

/// Makes the eager kernel of a binary op over `T` from its definition.
struct BinaryKernel<T>(std::marker::PhantomData<T>);

impl<T> BinaryKernel<T> {
    fn new() -> Self {
        BinaryKernel(std::marker::PhantomData)
    }
}

impl<T: Arith> BinaryVisitor for BinaryKernel<T> {
    type Output = Kernel;
    fn visit<F: BinaryFn>(self) -> Kernel {
        // As for the unary ops: only the dtypes of the op's class.
        if const { F::CLASS.accepts(T::DTYPE) } {
            if F::ZERO_DIVISOR_IS_ERROR && !T::FLOAT {
                checked_divisor_kernel::<T, _>(BinaryEval::<F>(PhantomData))
            } else {
                binary_kernel::<T, _>(BinaryEval::<F>(PhantomData))
            }
        } else {
            class_mismatch(F::OP.def().name, T::DTYPE)
        }
    }
}

/// Makes the eager kernel of a bool binary op from its definition on 0/1.
struct BoolBinaryKernel;

impl BinaryVisitor for BoolBinaryKernel {
    type Output = Kernel;
    fn visit<F: BinaryFn>(self) -> Kernel {
        binary_kernel(|a: bool, b: bool| F::eval::<u8>(a as u8, b as u8) != 0)
    }
}

fn binary_kernel<T: Element, F: Zip<T> + 'static>(f: F) -> Kernel {
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [a, b] = take(inputs)?;
        Ok(smallvec![binary_apply(a, b, out_meta(ctx)?, f)?])
    })
}

/// An integer op that must not see a zero divisor (division): every
/// divisor element is checked first, so a zero divisor is an error rather
/// than a trap.
fn checked_divisor_kernel<T: Arith, F: Zip<T> + 'static>(f: F) -> Kernel {
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [a, b] = take(inputs)?;
        if let Some(i) = b.as_slice::<T>()?.iter().position(|v| *v == T::ZERO) {
            return Err(Error::invalid(format!(
                "integer division by zero: the divisor {} is 0 at flat index {i} \
                 (every divisor element must be nonzero)",
                b.metadata()
            )));
        }
        Ok(smallvec![binary_apply(a, b, out_meta(ctx)?, f)?])
    })
}

/// `f` over broadcast `a` and `b`, writing into `a`'s or `b`'s buffer when
/// that input is reusable for the output.
fn binary_apply<T, F>(
    a: DenseHostTensor,
    b: DenseHostTensor,
    meta: &TensorMetadata,
    f: F,
) -> Result<DenseHostTensor>
where
    T: Element,
    F: Zip<T>,
{
    let flipped = Flipped(f);
    if let Some((sa, sb)) = flat_steps(a.shape(), b.shape(), &meta.shape) {
        // Small operands of the output's shape or of one element (the
        // common eager case, `x * 0.9` among them): one flat loop; building
        // a broadcast walk would cost more than the math.
        let level = loop_level::<T>(meta.shape.numel());
        if reusable(&a, meta) {
            let mut out = a;
            let b = Operand::of(&b, sb)?;
            update_row_on(level, out.as_mut_slice::<T>()?, (b, 0), f);
            return Ok(out);
        }
        if reusable(&b, meta) {
            let mut out = b;
            let a = Operand::of(&a, sa)?;
            update_row_on(level, out.as_mut_slice::<T>()?, (a, 0), flipped);
            return Ok(out);
        }
        let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
        let (x, y) = (Operand::of(&a, sa)?, Operand::of(&b, sb)?);
        zip_row_on(level, out.as_mut_slice::<T>()?, (x, 0), (y, 0), f);
        return Ok(out);
    }
    let walk = Walk::new(&meta.shape, [a.shape(), b.shape()]);
    let [sa, sb] = walk.inner_strides;
    if reusable(&a, meta) {
        let mut out = a;
        let other = Operand {
            data: b.as_slice::<T>()?,
            step: sb,
        };
        walk.run(out.as_mut_slice::<T>()?, |o, [_, ob]| {
            update_row_on(loop_level::<T>(o.len()), o, (other, ob), f)
        });
        return Ok(out);
    }
    if reusable(&b, meta) {
        let mut out = b;
        let other = Operand {
            data: a.as_slice::<T>()?,
            step: sa,
        };
        walk.run(out.as_mut_slice::<T>()?, |o, [oa, _]| {
            update_row_on(loop_level::<T>(o.len()), o, (other, oa), flipped)
        });
        return Ok(out);
    }
    let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
    let x = Operand {
        data: a.as_slice::<T>()?,
        step: sa,
    };
    let y = Operand {
        data: b.as_slice::<T>()?,
        step: sb,
    };
    walk.run(out.as_mut_slice::<T>()?, |o, [oa, ob]| {
        zip_row_on(loop_level::<T>(o.len()), o, (x, oa), (y, ob), f)
    });
    Ok(out)
}

// ---------------------------------------------------------------------------
// Compare.

fn compare_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let OpKind::Compare(op) = attrs.op().kind else {
        return Err(Error::internal(format!(
            "{} is not a comparison",
            attrs.op().name
        )));
    };
    let dtype = inputs
        .first()
        .ok_or_else(|| Error::internal("comparison without inputs"))?
        .dtype;
    Ok(crate::with_any_type!(dtype, T => compare_kernel::<T>(op)))
}

fn compare_kernel<T: Element>(op: CompareOp) -> Kernel {
    match op {
        CompareOp::Eq => compare_with(|a: T, b: T| a == b),
        CompareOp::Ne => compare_with(|a: T, b: T| a != b),
        CompareOp::Lt => compare_with(|a: T, b: T| a < b),
        CompareOp::Le => compare_with(|a: T, b: T| a <= b),
        CompareOp::Gt => compare_with(|a: T, b: T| a > b),
        CompareOp::Ge => compare_with(|a: T, b: T| a >= b),
    }
}

fn compare_with<T, F>(f: F) -> Kernel
where
    T: Element,
    F: Fn(T, T) -> bool + Copy + Send + Sync + 'static,
{
    Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [a, b] = take(inputs)?;
        let meta = out_meta(ctx)?;
        let mut out = DenseHostTensor::zeros(meta.clone())?;
        if let Some((sa, sb)) = flat_steps(a.shape(), b.shape(), &meta.shape) {
            // One flat loop, as in `binary_apply`.
            let (x, y) = (Operand::of(&a, sa)?, Operand::of(&b, sb)?);
            zip_row(out.as_mut_slice::<bool>()?, x, 0, y, 0, f);
            return Ok(smallvec![out]);
        }
        let walk = Walk::new(&meta.shape, [a.shape(), b.shape()]);
        let [sa, sb] = walk.inner_strides;
        let (x, y) = (Operand::of(&a, sa)?, Operand::of(&b, sb)?);
        walk.run(out.as_mut_slice::<bool>()?, |o, [oa, ob]| {
            zip_row(o, x, oa, y, ob, f)
        });
        Ok(smallvec![out])
    })
}

// ---------------------------------------------------------------------------
// Select.

fn select_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let dtype = inputs
        .get(1)
        .ok_or_else(|| Error::internal("Select without value inputs"))?
        .dtype;
    Ok(crate::with_any_type!(dtype, T => select_kernel::<T>()))
}

fn select_kernel<T: Element>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [cond, a, b] = take(inputs)?;
        let meta = out_meta(ctx)?;
        let walk = Walk::new(&meta.shape, [cond.shape(), a.shape(), b.shape()]);
        let [sc, sa, sb] = walk.inner_strides;
        let c = cond.as_slice::<bool>()?;
        let (x, y) = (a.as_slice::<T>()?, b.as_slice::<T>()?);
        let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
        walk.run(out.as_mut_slice::<T>()?, |o, [oc, oa, ob]| {
            let n = o.len();
            if (sc, sa, sb) == (1, 1, 1) {
                let rows = c[oc..oc + n].iter().zip(&x[oa..oa + n]).zip(&y[ob..ob + n]);
                for (v, ((&k, &p), &q)) in o.iter_mut().zip(rows) {
                    *v = if k { p } else { q };
                }
            } else {
                for (j, v) in o.iter_mut().enumerate() {
                    *v = if c[oc + j * sc] {
                        x[oa + j * sa]
                    } else {
                        y[ob + j * sb]
                    };
                }
            }
        });
        Ok(smallvec![out])
    })
}

// ---------------------------------------------------------------------------
// Cast.

/// Conversions from one element type with the rules of `Scalar::cast`
/// (Rust `as`: floats to integers truncate toward zero and saturate, NaN
/// becomes 0, integers to narrower integers wrap; nonzero becomes `true`), except that
/// conversions to f16 and bf16 round the exact value correctly, where
/// `Scalar::cast` (through `half`'s `from_f64`) may be 1 ULP off near ties.
trait CastElem: Element {
    fn cast_bool(self) -> bool;
    fn cast_u8(self) -> u8;
    fn cast_i8(self) -> i8;
    fn cast_u16(self) -> u16;
    fn cast_i16(self) -> i16;
    fn cast_u32(self) -> u32;
    fn cast_u64(self) -> u64;
    fn cast_i32(self) -> i32;
    fn cast_i64(self) -> i64;
    fn cast_f16(self) -> f16;
    fn cast_bf16(self) -> bf16;
    fn cast_f32(self) -> f32;
    fn cast_f64(self) -> f64;
}

impl CastElem for bool {
    fn cast_bool(self) -> bool {
        self
    }
    fn cast_u8(self) -> u8 {
        self as u8
    }
    fn cast_i8(self) -> i8 {
        self as i8
    }
    fn cast_u16(self) -> u16 {
        self as u16
    }
    fn cast_i16(self) -> i16 {
        self as i16
    }
    fn cast_u32(self) -> u32 {
        self as u32
    }
    fn cast_u64(self) -> u64 {
        self as u64
    }
    fn cast_i32(self) -> i32 {
        self as i32
    }
    fn cast_i64(self) -> i64 {
        self as i64
    }
    fn cast_f16(self) -> f16 {
        if self {
            f16::ONE
        } else {
            f16::ZERO
        }
    }
    fn cast_bf16(self) -> bf16 {
        if self {
            bf16::ONE
        } else {
            bf16::ZERO
        }
    }
    fn cast_f32(self) -> f32 {
        self as u8 as f32
    }
    fn cast_f64(self) -> f64 {
        self as u8 as f64
    }
}

macro_rules! cast_int {
    ($t:ty) => {
        impl CastElem for $t {
            #[inline(always)]
            fn cast_bool(self) -> bool {
                self != 0
            }
            #[inline(always)]
            fn cast_u8(self) -> u8 {
                self as u8
            }
            #[inline(always)]
            fn cast_i8(self) -> i8 {
                self as i8
            }
            #[inline(always)]
            fn cast_u16(self) -> u16 {
                self as u16
            }
            #[inline(always)]
            fn cast_i16(self) -> i16 {
                self as i16
            }
            #[inline(always)]
            fn cast_u32(self) -> u32 {
                self as u32
            }
            #[inline(always)]
            fn cast_u64(self) -> u64 {
                self as u64
            }
            #[inline(always)]
            fn cast_i32(self) -> i32 {
                self as i32
            }
            #[inline(always)]
            fn cast_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn cast_f16(self) -> f16 {
                f16::from_f32(int_to_f32_odd(self))
            }
            #[inline(always)]
            fn cast_bf16(self) -> bf16 {
                bf16::from_f32(int_to_f32_odd(self))
            }
            #[inline(always)]
            fn cast_f32(self) -> f32 {
                self as f32
            }
            #[inline(always)]
            fn cast_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
cast_int!(u8);
cast_int!(i8);
cast_int!(u16);
cast_int!(i16);
cast_int!(u32);
cast_int!(u64);
cast_int!(i32);
cast_int!(i64);

macro_rules! cast_float {
    ($t:ty, $to_f32_odd:expr) => {
        impl CastElem for $t {
            #[inline(always)]
            fn cast_bool(self) -> bool {
                self != 0.0
            }
            #[inline(always)]
            fn cast_u8(self) -> u8 {
                self as u8
            }
            #[inline(always)]
            fn cast_i8(self) -> i8 {
                self as i8
            }
            #[inline(always)]
            fn cast_u16(self) -> u16 {
                self as u16
            }
            #[inline(always)]
            fn cast_i16(self) -> i16 {
                self as i16
            }
            #[inline(always)]
            fn cast_u32(self) -> u32 {
                self as u32
            }
            #[inline(always)]
            fn cast_u64(self) -> u64 {
                self as u64
            }
            #[inline(always)]
            fn cast_i32(self) -> i32 {
                self as i32
            }
            #[inline(always)]
            fn cast_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn cast_f16(self) -> f16 {
                f16::from_f32($to_f32_odd(self))
            }
            #[inline(always)]
            fn cast_bf16(self) -> bf16 {
                bf16::from_f32($to_f32_odd(self))
            }
            #[inline(always)]
            fn cast_f32(self) -> f32 {
                self as f32
            }
            #[inline(always)]
            fn cast_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
cast_float!(f32, std::convert::identity);
cast_float!(f64, f64_to_f32_odd);

macro_rules! cast_half {
    ($t:ty) => {
        impl CastElem for $t {
            #[inline(always)]
            fn cast_bool(self) -> bool {
                self.to_f32() != 0.0
            }
            #[inline(always)]
            fn cast_u8(self) -> u8 {
                self.to_f32() as u8
            }
            #[inline(always)]
            fn cast_i8(self) -> i8 {
                self.to_f32() as i8
            }
            #[inline(always)]
            fn cast_u16(self) -> u16 {
                self.to_f32() as u16
            }
            #[inline(always)]
            fn cast_i16(self) -> i16 {
                self.to_f32() as i16
            }
            #[inline(always)]
            fn cast_u32(self) -> u32 {
                self.to_f32() as u32
            }
            #[inline(always)]
            fn cast_u64(self) -> u64 {
                self.to_f32() as u64
            }
            #[inline(always)]
            fn cast_i32(self) -> i32 {
                self.to_f32() as i32
            }
            #[inline(always)]
            fn cast_i64(self) -> i64 {
                self.to_f32() as i64
            }
            #[inline(always)]
            fn cast_f16(self) -> f16 {
                f16::from_f32(self.to_f32())
            }
            #[inline(always)]
            fn cast_bf16(self) -> bf16 {
                bf16::from_f32(self.to_f32())
            }
            #[inline(always)]
            fn cast_f32(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn cast_f64(self) -> f64 {
                self.to_f64()
            }
        }
    };
}
cast_half!(f16);
cast_half!(bf16);

/// A cast destination: picks the matching [`CastElem`] conversion.
trait CastTarget: Element {
    fn cast_from<S: CastElem>(s: S) -> Self;
}

macro_rules! cast_target {
    ($t:ty, $method:ident) => {
        impl CastTarget for $t {
            #[inline(always)]
            fn cast_from<S: CastElem>(s: S) -> $t {
                s.$method()
            }
        }
    };
}
cast_target!(bool, cast_bool);
cast_target!(u8, cast_u8);
cast_target!(i8, cast_i8);
cast_target!(u16, cast_u16);
cast_target!(i16, cast_i16);
cast_target!(u32, cast_u32);
cast_target!(u64, cast_u64);
cast_target!(i32, cast_i32);
cast_target!(i64, cast_i64);
cast_target!(f16, cast_f16);
cast_target!(bf16, cast_bf16);
cast_target!(f32, cast_f32);
cast_target!(f64, cast_f64);

fn cast_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let to = attrs.dtype("dtype")?;
    let from = inputs
        .first()
        .ok_or_else(|| Error::internal("Cast without input"))?
        .dtype;
    if from == to {
        // Values are immutable, so the output may share the input's buffer.
        return Ok(Arc::new(|inputs: Inputs, _: &KernelContext<'_>| {
            let [x] = take(inputs)?;
            Ok(smallvec![x])
        }));
    }
    Ok(crate::with_any_type!(from, S => crate::with_any_type!(to, D => cast_kernel::<S, D>())))
}

/// Bitcast: the input's buffer under the output's metadata (no copy; to
/// bool, the bytes are checked to be 0 or 1).
fn bitcast_factory(_: &Attrs<'_>, _: &[TensorMetadata]) -> Result<Kernel> {
    Ok(Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let out = DenseHostTensor::from_buffer(out_meta(ctx)?.clone(), x.buffer().clone())?;
        Ok(smallvec![out])
    }))
}

fn cast_kernel<S: CastElem, D: CastTarget>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [x] = take(inputs)?;
        let mut out = DenseHostTensor::zeros(out_meta(ctx)?.clone())?;
        map_into(
            out.as_mut_slice::<D>()?,
            x.as_slice::<S>()?,
            D::cast_from::<S>,
        );
        Ok(smallvec![out])
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::reference::elementwise as reference;
    use proptest::prelude::*;
    use stagecraft_ops::{OpAttrs, OpDef};
    use stagecraft_tensor::{Buffer, Scalar};

    /// Runs `def`'s CPU kernel on `inputs` as the runtime would.
    pub(crate) fn run(
        def: &'static OpDef,
        inputs: Vec<DenseHostTensor>,
        attrs: &OpAttrs,
    ) -> Result<DenseHostTensor> {
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        let outputs = def.infer(&metas, attrs)?;
        let factory = crate::registry()
            .get(def)
            .ok_or_else(|| Error::internal(format!("no kernel for {}", def.name)))?;
        let kernel = factory(&Attrs::new(attrs, def), &metas)?;
        let ctx = KernelContext {
            attrs: Attrs::new(attrs, def),
            outputs: &outputs,
        };
        let mut out = kernel(inputs.into_iter().collect(), &ctx)?;
        assert_eq!(out.len(), 1);
        let out = out.remove(0);
        assert_eq!(out.metadata(), &outputs[0], "{} output metadata", def.name);
        Ok(out)
    }

    /// A tensor of `dtype` holding `values` converted with the `Cast` rules.
    pub(crate) fn tensor(dtype: DType, values: &[f64], dims: &[usize]) -> DenseHostTensor {
        let build = || -> stagecraft_tensor::Result<DenseHostTensor> {
            crate::with_any_type!(dtype, T => {
                let v: Vec<T> = values.iter().map(|&x| T::from_scalar(Scalar::F64(x))).collect();
                DenseHostTensor::from_slice(&v, dims)
            })
        };
        build().unwrap()
    }

    /// The values of `t` as f64.
    pub(crate) fn values(t: &DenseHostTensor) -> Vec<f64> {
        (0..t.numel())
            .map(|i| t.get_scalar(i).unwrap().to_f64())
            .collect()
    }

    /// Asserts `got` matches `want` to about 2 ULP of `dtype` relative to
    /// `scale[i]` (or to `|want[i]|` when `scale` is empty); NaN must match
    /// NaN and infinities exactly.
    pub(crate) fn assert_close_scaled(
        dtype: DType,
        got: &[f64],
        want: &[f64],
        scale: &[f64],
        what: &str,
    ) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let (rel, abs) = match dtype {
            DType::F64 => (1e-13, 1e-300),
            DType::F32 => (2f64.powi(-22), 2f64.powi(-148)),
            DType::F16 => (2f64.powi(-9), 2f64.powi(-23)),
            DType::BF16 => (2f64.powi(-6), 2f64.powi(-132)),
            _ => (0.0, 0.0),
        };
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if g == w || (g.is_nan() && w.is_nan()) {
                continue;
            }
            let s = scale.get(i).copied().unwrap_or(w.abs()).max(w.abs());
            assert!(
                w.is_finite() && g.is_finite() && (g - w).abs() <= rel * s + abs,
                "{what} [{dtype}]: element {i}: got {g}, want {w}"
            );
        }
    }

    pub(crate) fn assert_close(dtype: DType, got: &[f64], want: &[f64], what: &str) {
        assert_close_scaled(dtype, got, want, &[], what)
    }

    /// A small deterministic generator (xorshift64*).
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        /// Uniform in `[lo, hi)`.
        pub(crate) fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
            lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
        }
        /// `n` values suited to `dtype`: floats in [-5, 5) with some
        /// specials mixed in when `specials`, integers in [-100, 100),
        /// bools at random.
        pub(crate) fn values(&mut self, dtype: DType, n: usize, specials: bool) -> Vec<f64> {
            const SPECIAL: [f64; 6] = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0];
            (0..n)
                .map(|_| match dtype {
                    DType::Bool => (self.next() % 2) as f64,
                    DType::I32 | DType::I64 => (self.next() % 200) as f64 - 100.0,
                    // Every value of the 8-bit types, so wrapping shows.
                    DType::U8 => (self.next() % 256) as f64,
                    DType::I8 => (self.next() % 256) as f64 - 128.0,
                    // And of the 16-bit types.
                    DType::U16 => (self.next() % 65_536) as f64,
                    DType::I16 => (self.next() % 65_536) as f64 - 32_768.0,
                    // The wide unsigned types: small values (shift amounts
                    // in range) or any value exact in the f64s the tests
                    // compare (below 2^32 and 2^53).
                    DType::U32 | DType::U64 if self.next() & 1 == 0 => (self.next() % 80) as f64,
                    DType::U32 => (self.next() >> 32) as f64,
                    DType::U64 => (self.next() >> 11) as f64,
                    _ if specials && self.next() & 7 == 0 => SPECIAL[(self.next() % 6) as usize],
                    _ => self.uniform(-5.0, 5.0),
                })
                .collect()
        }
    }

    const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];
    const NUMERIC: [DType; 12] = [
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::U64,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    const SHAPES: &[&[usize]] = &[
        &[],
        &[0],
        &[1],
        &[7],
        &[3, 4],
        &[2, 0, 3],
        &[2, 3, 4],
        &[5, 1, 7],
        &[40_000],
    ];

    #[test]
    fn unary_ops_match_the_reference() {
        let none = OpAttrs::new();
        let mut rng = Rng(1);
        for &op in UnaryOp::ALL {
            let def = op.def();
            for dtype in DType::ALL {
                let meta = TensorMetadata::new(dtype, [2]);
                if def.infer(&[meta], &none).is_err() {
                    continue;
                }
                for dims in SHAPES {
                    let n: usize = dims.iter().product();
                    let x = tensor(dtype, &rng.values(dtype, n, true), dims);
                    let xs = values(&x);
                    let got = run(def, vec![x], &none).unwrap();
                    let want = reference::unary(op, dtype, &xs);
                    assert_close(
                        dtype,
                        &values(&got),
                        &want,
                        &format!("{} {dims:?}", def.name),
                    );
                }
            }
        }
    }

    /// `GeluWithDerivative`'s first output has `Gelu`'s bits, and its
    /// second is GELU's derivative (within the dtype's rounding, measured
    /// against the size of its two terms, which cancel near x = -0.75),
    /// for every float dtype and shape (40,000 elements run in parallel
    /// chunks), specials included.
    #[test]
    fn gelu_with_derivative_matches_gelu_and_its_derivative() {
        use stagecraft_ops::scalar::{gelu, gelu_derivative};
        let none = OpAttrs::new();
        let def = &stagecraft_ops::GELU_WITH_DERIVATIVE;
        let mut rng = Rng(7);
        for dtype in FLOATS {
            for dims in SHAPES {
                let n: usize = dims.iter().product();
                let x = tensor(dtype, &rng.values(dtype, n, true), dims);
                let xs = values(&x);
                let metas = [x.metadata().clone()];
                let outputs = def.infer(&metas, &none).unwrap();
                let factory = crate::registry().get(def).expect("kernel registered");
                let kernel = factory(&Attrs::new(&none, def), &metas).unwrap();
                let ctx = KernelContext {
                    attrs: Attrs::new(&none, def),
                    outputs: &outputs,
                };
                let out = kernel(smallvec![x.clone()], &ctx).unwrap();
                assert_eq!(out.len(), 2);
                assert_eq!(out[0].metadata(), &outputs[0]);
                assert_eq!(out[1].metadata(), &outputs[1]);
                let what = format!("GeluWithDerivative {dtype} {dims:?}");
                let gelu_alone = values(&run(&stagecraft_ops::GELU, vec![x], &none).unwrap());
                for (i, (got, want)) in values(&out[0]).iter().zip(&gelu_alone).enumerate() {
                    let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
                    assert!(same, "{what}: y[{i}] = {got:e}, Gelu gives {want:e}");
                }
                let want: Vec<f64> = xs.iter().map(|&x| gelu_derivative(x, gelu(x))).collect();
                let terms: Vec<f64> = xs
                    .iter()
                    .zip(&want)
                    .map(|(&x, &d)| d.abs() + (x * (-0.5 * x * x).exp()).abs())
                    .collect();
                assert_close_scaled(dtype, &values(&out[1]), &want, &terms, &what);
            }
        }
    }

    #[test]
    fn unary_specials() {
        let none = OpAttrs::new();
        let f = |def: &'static OpDef, xs: &[f64]| {
            values(&run(def, vec![tensor(DType::F64, xs, &[xs.len()])], &none).unwrap())
        };
        let s = f(
            &stagecraft_ops::SIGMOID,
            &[-800.0, -40.0, 0.0, 800.0, f64::NEG_INFINITY, f64::INFINITY],
        );
        assert_eq!(s[0], 0.0);
        assert!((s[1] - 4.248354255291589e-18).abs() < 1e-30, "{}", s[1]);
        assert_eq!(&s[2..], &[0.5, 1.0, 0.0, 1.0]);
        let g = f(
            &stagecraft_ops::GELU,
            &[-10.0, f64::NEG_INFINITY, f64::INFINITY, 0.0],
        );
        assert!(g[0] < 0.0 && g[0] > -1e-21, "gelu(-10) = {}", g[0]);
        assert_eq!(&g[1..], &[0.0, f64::INFINITY, 0.0]);
        let r = f(&stagecraft_ops::RSQRT, &[4.0, 0.0, -1.0]);
        assert_eq!(r[0], 0.5);
        assert_eq!(r[1], f64::INFINITY);
        assert!(r[2].is_nan());
        let sign = f(
            &stagecraft_ops::SIGN,
            &[f64::NAN, -0.0, 3.0, f64::NEG_INFINITY],
        );
        assert!(sign[0].is_nan());
        assert_eq!(&sign[1..], &[0.0, 1.0, -1.0]);
        assert!(f(&stagecraft_ops::RELU, &[f64::NAN])[0].is_nan());
        // Integers wrap instead of overflowing.
        let m = DenseHostTensor::from_slice(&[i32::MIN, -5, 7], [3]).unwrap();
        let neg = run(&stagecraft_ops::NEG, vec![m.clone()], &none).unwrap();
        assert_eq!(neg.to_vec::<i32>().unwrap(), vec![i32::MIN, 5, -7]);
        let abs = run(&stagecraft_ops::ABS, vec![m.clone()], &none).unwrap();
        assert_eq!(abs.to_vec::<i32>().unwrap(), vec![i32::MIN, 5, 7]);
        let sign = run(&stagecraft_ops::SIGN, vec![m], &none).unwrap();
        assert_eq!(sign.to_vec::<i32>().unwrap(), vec![-1, -1, 1]);
    }

    /// Distance from `got` to the exact `truth` in units of the f32 ULP at
    /// `truth`.
    fn ulps_f32(got: f32, truth: f64) -> f64 {
        if got as f64 == truth || (got.is_nan() && truth.is_nan()) {
            return 0.0;
        }
        let t = truth.abs();
        let ulp = if t < f32::MIN_POSITIVE as f64 {
            2f64.powi(-149)
        } else {
            let exponent = ((t.to_bits() >> 52) & 0x7ff) as i32 - 1023;
            2f64.powi(exponent - 23)
        };
        (got as f64 - truth).abs() / ulp
    }

    #[test]
    fn f32_transcendentals_are_within_2_ulp() {
        const N: usize = 100_000;
        let linear = |lo: f64, hi: f64| -> Vec<f32> {
            (0..N)
                .map(|i| (lo + (hi - lo) * i as f64 / N as f64) as f32)
                .collect()
        };
        let logarithmic = |lo: f64, hi: f64| -> Vec<f32> {
            (0..N)
                .map(|i| 10f64.powf(lo + (hi - lo) * i as f64 / N as f64) as f32)
                .collect()
        };
        type Truth = fn(f64) -> f64;
        let cases: [(&OpDef, Vec<f32>, Truth); 9] = [
            (&stagecraft_ops::EXP, linear(-87.0, 88.0), f64::exp),
            (&stagecraft_ops::LOG, logarithmic(-37.0, 38.0), f64::ln),
            (&stagecraft_ops::TANH, linear(-10.0, 10.0), f64::tanh),
            (&stagecraft_ops::SIGMOID, linear(-80.0, 80.0), |x| {
                1.0 / (1.0 + (-x).exp())
            }),
            (&stagecraft_ops::SIN, linear(-100.0, 100.0), f64::sin),
            (&stagecraft_ops::COS, linear(-100.0, 100.0), f64::cos),
            (&stagecraft_ops::GELU, linear(-10.0, 10.0), |x| {
                0.5 * x * libm::erfc(-x / std::f64::consts::SQRT_2)
            }),
            (&stagecraft_ops::SQRT, logarithmic(-37.0, 38.0), f64::sqrt),
            (&stagecraft_ops::RSQRT, logarithmic(-37.0, 37.0), |x| {
                1.0 / x.sqrt()
            }),
        ];
        for (def, xs, truth) in cases {
            let x = DenseHostTensor::from_slice(&xs, [N]).unwrap();
            let y = run(def, vec![x], &OpAttrs::new()).unwrap();
            let worst = y
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .zip(&xs)
                .map(|(&g, &x)| (ulps_f32(g, truth(x as f64)), x))
                .fold((0.0, 0.0f32), |a, b| if b.0 > a.0 { b } else { a });
            assert!(
                worst.0 <= 2.0,
                "{}: {} ULP at x = {}",
                def.name,
                worst.0,
                worst.1
            );
        }
    }

    /// Every binary op of the table that takes `dtype`.
    fn binary_ops(dtype: DType) -> Vec<(&'static OpDef, BinaryOp)> {
        BinaryOp::ALL
            .iter()
            .filter(|op| op.class().accepts(dtype))
            .map(|&op| (op.def(), op))
            .collect()
    }

    const PAIRS: &[(&[usize], &[usize])] = &[
        (&[], &[]),
        (&[3, 4], &[3, 4]),
        (&[3, 4], &[]),
        (&[], &[3, 4]),
        (&[1], &[5]),
        (&[3, 1], &[1, 4]),
        (&[2, 3, 4], &[4]),
        (&[2, 1, 4], &[3, 1]),
        (&[5, 1, 7], &[5, 6, 1]),
        (&[4, 1, 1, 3], &[2, 1, 3]),
        (&[0, 3], &[1, 3]),
        (&[2, 0], &[2, 1]),
        (&[300, 200], &[200]),
        (&[2, 40_000], &[2, 1]),
        (&[50_000], &[]),
        (&[], &[50_000]),
        (&[40, 1, 30], &[1, 50, 30]),
    ];

    /// Integer divisors drawn without zeros.
    fn nonzero(mut v: Vec<f64>) -> Vec<f64> {
        for x in &mut v {
            if *x == 0.0 {
                *x = 3.0;
            }
        }
        v
    }

    #[test]
    fn binary_ops_match_the_reference() {
        let none = OpAttrs::new();
        let mut rng = Rng(2);
        for dtype in DType::ALL {
            for (def, op) in binary_ops(dtype) {
                for (da, db) in PAIRS {
                    let na: usize = da.iter().product();
                    let nb: usize = db.iter().product();
                    let a = tensor(dtype, &rng.values(dtype, na, true), da);
                    let mut bv = rng.values(dtype, nb, true);
                    if dtype.is_int() {
                        bv = nonzero(bv);
                    }
                    let b = tensor(dtype, &bv, db);
                    let (av, bv) = (values(&a), values(&b));
                    let got = run(def, vec![a, b], &none).unwrap();
                    let (want, dims) = reference::binary(op, dtype, &av, da, &bv, db).unwrap();
                    assert_eq!(got.shape().dims(), dims.as_slice());
                    assert_close(
                        dtype,
                        &values(&got),
                        &want,
                        &format!("{} {da:?} {db:?}", def.name),
                    );
                }
            }
        }
    }

    /// Every instruction set this CPU has below its own, then its own.
    fn levels_here() -> Vec<IsaLevel> {
        let all = [IsaLevel::Baseline, IsaLevel::Avx2, IsaLevel::Avx512];
        let here: Vec<IsaLevel> = all
            .into_iter()
            .filter(|&l| l <= crate::isa::detected())
            .collect();
        if here.len() < all.len() {
            eprintln!(
                "note: this CPU has {}, so the loops above it are not compared",
                crate::isa::detected().name()
            );
        }
        here
    }

    fn same_bits<T: Real>(a: &[T], b: &[T]) -> bool {
        a.iter()
            .zip(b)
            .all(|(x, y)| x.wide().to_bits() == y.wide().to_bits() || (is_nan(*x) && is_nan(*y)))
    }

    /// Inputs across each op's interesting ranges, and the special values.
    fn samples<T: Real>() -> Vec<T> {
        let mut values: Vec<f64> = (0..997)
            .map(|i| (i as f64 - 498.0) * 0.0371)
            .chain([
                0.0,
                -0.0,
                1e-40,
                -1e-300,
                1e30,
                -1e30,
                f64::INFINITY,
                f64::NEG_INFINITY,
            ])
            .chain([f64::NAN, 0.5, -0.5, 1.0, -1.0, 20.0, -20.0, 100.0, -100.0])
            .collect();
        values.extend((0..200).map(|i| -15.0 + 0.15 * i as f64));
        values.into_iter().map(T::narrow).collect()
    }

    struct SameBitsOnEveryLevel<T>(PhantomData<T>);

    impl<T: Real + Arith> UnaryVisitor for SameBitsOnEveryLevel<T> {
        type Output = ();
        fn visit<F: UnaryFn>(self) {
            if !F::CLASS.accepts(T::DTYPE) {
                return;
            }
            let x = samples::<T>();
            let mut want = x.clone();
            map_on(
                IsaLevel::Baseline,
                &mut want,
                &x,
                UnaryEval::<F>(PhantomData),
            );
            for level in levels_here() {
                let mut got = x.clone();
                map_on(level, &mut got, &x, UnaryEval::<F>(PhantomData));
                let name = F::OP.def().name;
                assert!(same_bits(&got, &want), "{name} {:?} on {level:?}", T::DTYPE);
                let mut in_place = x.clone();
                update_on(level, &mut in_place, UnaryEval::<F>(PhantomData));
                assert!(same_bits(&in_place, &want), "{name} in place on {level:?}");
            }
        }
    }

    impl<T: Real + Arith> BinaryVisitor for SameBitsOnEveryLevel<T> {
        type Output = ();
        fn visit<F: BinaryFn>(self) {
            if !F::CLASS.accepts(T::DTYPE) {
                return;
            }
            let a = samples::<T>();
            let b: Vec<T> = a.iter().rev().copied().collect();
            let operand = |data| Operand { data, step: 1 };
            let f = BinaryEval::<F>(PhantomData);
            let mut want = a.clone();
            zip_row_on(
                IsaLevel::Baseline,
                &mut want,
                (operand(&a), 0),
                (operand(&b), 0),
                f,
            );
            for level in levels_here() {
                let mut got = a.clone();
                zip_row_on(level, &mut got, (operand(&a), 0), (operand(&b), 0), f);
                let name = F::OP.def().name;
                assert!(same_bits(&got, &want), "{name} {:?} on {level:?}", T::DTYPE);
                let mut in_place = b.clone();
                update_row_on(level, &mut in_place, (operand(&a), 0), Flipped(f));
                assert!(same_bits(&in_place, &want), "{name} flipped on {level:?}");
            }
        }
    }

    /// The loops compiled for AVX2 and AVX-512 give the baseline loop's
    /// bits for every float unary and binary op (no contraction into FMA,
    /// no reassociation), in place or not.
    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        for op in UnaryOp::ALL {
            op.visit(SameBitsOnEveryLevel::<f32>(PhantomData));
            op.visit(SameBitsOnEveryLevel::<f64>(PhantomData));
        }
        for op in BinaryOp::ALL {
            op.visit(SameBitsOnEveryLevel::<f32>(PhantomData));
            op.visit(SameBitsOnEveryLevel::<f64>(PhantomData));
        }
    }

    /// Operands of the output's shape or of one element take one flat
    /// loop, whichever side holds the single element and whether or not
    /// an operand's buffer can take the result; shared operands are left
    /// as they were.
    #[test]
    fn one_element_operands_take_the_flat_loop_and_match_the_reference() {
        let none = OpAttrs::new();
        let mut rng = Rng(5);
        let cases: &[(&[usize], &[usize])] = &[
            (&[3, 4], &[]),
            (&[], &[3, 4]),
            (&[2, 3], &[1, 1]),
            (&[1, 1, 1], &[5]),
            (&[1], &[1, 1]),
            (&[0, 3], &[1]),
            (&[1], &[0]),
        ];
        for &(da, db) in cases {
            for shared in [false, true] {
                let na: usize = da.iter().product();
                let nb: usize = db.iter().product();
                // The values as f32 holds them, for the reference.
                let av = values(&tensor(DType::F32, &rng.values(DType::F32, na, false), da));
                let bv = values(&tensor(DType::F32, &rng.values(DType::F32, nb, false), db));
                // Unique operands unless `shared`: a unique one of the
                // output's metadata takes the result in its own buffer.
                let fresh = || (tensor(DType::F32, &av, da), tensor(DType::F32, &bv, db));
                let what = format!("{da:?} {db:?} shared {shared}");
                let (a, b) = fresh();
                let kept = shared.then(|| (a.clone(), b.clone()));
                let got = run(&stagecraft_ops::SUB, vec![a, b], &none).unwrap();
                let (want, dims) =
                    reference::binary(BinaryOp::Sub, DType::F32, &av, da, &bv, db).unwrap();
                assert_eq!(got.shape().dims(), dims.as_slice(), "{what}");
                assert_close(DType::F32, &values(&got), &want, &what);
                if let Some((a, b)) = kept {
                    assert_eq!((values(&a), values(&b)), (av.clone(), bv.clone()), "{what}");
                }
                let less = run(&stagecraft_ops::LESS, vec![fresh().0, fresh().1], &none).unwrap();
                let (want, _) = reference::compare(CompareOp::Lt, &av, da, &bv, db).unwrap();
                assert_eq!(values(&less), want, "{what}");
            }
        }
    }

    #[test]
    fn integer_arithmetic_wraps_and_division_checks_zero() {
        let none = OpAttrs::new();
        let a = DenseHostTensor::from_slice(&[i64::MIN, i64::MAX, -7, 7], [4]).unwrap();
        let b = DenseHostTensor::from_slice(&[-1i64, 1, 2, -2], [4]).unwrap();
        let q = run(&stagecraft_ops::DIV, vec![a.clone(), b.clone()], &none).unwrap();
        assert_eq!(q.to_vec::<i64>().unwrap(), vec![i64::MIN, i64::MAX, -3, -3]);
        let s = run(&stagecraft_ops::ADD, vec![a.clone(), b.clone()], &none).unwrap();
        assert_eq!(s.to_vec::<i64>().unwrap(), vec![i64::MAX, i64::MIN, -5, 5]);
        let p = run(&stagecraft_ops::MUL, vec![a.clone(), b], &none).unwrap();
        assert_eq!(p.to_vec::<i64>().unwrap()[0], i64::MIN);
        let zero = DenseHostTensor::from_slice(&[1i32, 0, 2], [3]).unwrap();
        let x = DenseHostTensor::from_slice(&[5i32, 5, 5], [3]).unwrap();
        let err = run(&stagecraft_ops::DIV, vec![x.clone(), zero], &none).unwrap_err();
        assert!(
            err.message().contains("division by zero"),
            "{}",
            err.message()
        );
        assert!(err.message().contains("index 1"), "{}", err.message());
        let scalar_zero = DenseHostTensor::from_slice(&[0i32], []).unwrap();
        assert!(run(&stagecraft_ops::DIV, vec![x, scalar_zero], &none).is_err());
        // Float division by zero is IEEE, not an error.
        let f = run(
            &stagecraft_ops::DIV,
            vec![
                tensor(DType::F32, &[1.0, 0.0], &[2]),
                tensor(DType::F32, &[0.0], &[]),
            ],
            &none,
        )
        .unwrap();
        let fv = values(&f);
        assert_eq!(fv[0], f64::INFINITY);
        assert!(fv[1].is_nan());
    }

    #[test]
    fn maximum_and_minimum_propagate_nan() {
        let none = OpAttrs::new();
        for dtype in FLOATS {
            let a = tensor(dtype, &[f64::NAN, 1.0, 2.0, f64::NAN], &[4]);
            let b = tensor(dtype, &[1.0, f64::NAN, 3.0, f64::NAN], &[4]);
            for def in [&stagecraft_ops::MAXIMUM, &stagecraft_ops::MINIMUM] {
                let v = values(&run(def, vec![a.clone(), b.clone()], &none).unwrap());
                assert!(
                    v[0].is_nan() && v[1].is_nan() && v[3].is_nan(),
                    "{} {dtype}: {v:?}",
                    def.name
                );
                assert_eq!(
                    v[2],
                    if def == &stagecraft_ops::MAXIMUM {
                        3.0
                    } else {
                        2.0
                    }
                );
            }
        }
    }

    const COMPARE: [(&OpDef, CompareOp); 6] = [
        (&stagecraft_ops::EQUAL, CompareOp::Eq),
        (&stagecraft_ops::NOT_EQUAL, CompareOp::Ne),
        (&stagecraft_ops::LESS, CompareOp::Lt),
        (&stagecraft_ops::LESS_EQUAL, CompareOp::Le),
        (&stagecraft_ops::GREATER, CompareOp::Gt),
        (&stagecraft_ops::GREATER_EQUAL, CompareOp::Ge),
    ];

    #[test]
    fn comparisons_match_the_reference() {
        let none = OpAttrs::new();
        let mut rng = Rng(3);
        for dtype in DType::ALL {
            for (def, op) in COMPARE {
                for (da, db) in PAIRS {
                    let na: usize = da.iter().product();
                    let nb: usize = db.iter().product();
                    // Few distinct values, so that equality happens.
                    let round = |v: Vec<f64>| -> Vec<f64> {
                        v.into_iter()
                            .map(|x| if x.is_finite() { x.round() } else { x })
                            .collect()
                    };
                    let a = tensor(dtype, &round(rng.values(dtype, na, true)), da);
                    let b = tensor(dtype, &round(rng.values(dtype, nb, true)), db);
                    let (av, bv) = (values(&a), values(&b));
                    let got = run(def, vec![a, b], &none).unwrap();
                    assert_eq!(got.dtype(), DType::Bool);
                    let (want, dims) = reference::compare(op, &av, da, &bv, db).unwrap();
                    assert_eq!(got.shape().dims(), dims.as_slice());
                    assert_eq!(values(&got), want, "{} {dtype} {da:?} {db:?}", def.name);
                }
            }
        }
        let nan = tensor(DType::F32, &[f64::NAN], &[1]);
        let eq = run(
            &stagecraft_ops::EQUAL,
            vec![nan.clone(), nan.clone()],
            &none,
        )
        .unwrap();
        let ne = run(&stagecraft_ops::NOT_EQUAL, vec![nan.clone(), nan], &none).unwrap();
        assert_eq!(
            (
                eq.to_vec::<bool>().unwrap()[0],
                ne.to_vec::<bool>().unwrap()[0]
            ),
            (false, true)
        );
    }

    #[test]
    fn select_matches_the_reference() {
        let none = OpAttrs::new();
        let mut rng = Rng(4);
        let triples: &[(&[usize], &[usize], &[usize])] = &[
            (&[], &[], &[]),
            (&[4], &[4], &[4]),
            (&[3, 1], &[4], &[]),
            (&[], &[2, 3], &[3]),
            (&[2, 1, 3], &[1, 4, 1], &[2, 4, 3]),
            (&[0, 2], &[1, 2], &[2]),
            (&[300, 200], &[300, 200], &[300, 200]),
            (&[200], &[300, 1], &[]),
        ];
        for dtype in DType::ALL {
            for (dc, da, db) in triples {
                let n = |d: &[usize]| d.iter().product::<usize>();
                let c = tensor(DType::Bool, &rng.values(DType::Bool, n(dc), false), dc);
                let a = tensor(dtype, &rng.values(dtype, n(da), true), da);
                let b = tensor(dtype, &rng.values(dtype, n(db), true), db);
                let (cv, av, bv) = (values(&c), values(&a), values(&b));
                let got = run(&stagecraft_ops::SELECT, vec![c, a, b], &none).unwrap();
                let (want, dims) = reference::select(&cv, dc, &av, da, &bv, db).unwrap();
                assert_eq!(got.shape().dims(), dims.as_slice());
                assert_close(
                    dtype,
                    &values(&got),
                    &want,
                    &format!("Select {dtype} {dc:?} {da:?} {db:?}"),
                );
            }
        }
    }

    #[test]
    fn bitcast_reinterprets_bytes() {
        let mut attrs = OpAttrs::new();
        attrs.set_dtype("dtype", DType::I32);
        let x = DenseHostTensor::from_slice(&[1.0f32, -0.0], [2]).unwrap();
        let y = run(&stagecraft_ops::BITCAST, vec![x], &attrs).unwrap();
        assert_eq!(y.to_vec::<i32>().unwrap(), [0x3f80_0000, i32::MIN]);
        let mut attrs = OpAttrs::new();
        attrs.set_dtype("dtype", DType::I16);
        let x = DenseHostTensor::from_slice(&[65_535u16, 32_768, 7], [3]).unwrap();
        let y = run(&stagecraft_ops::BITCAST, vec![x], &attrs).unwrap();
        assert_eq!(y.to_vec::<i16>().unwrap(), [-1, i16::MIN, 7]);
        // To bool, only 0 and 1 are values.
        let mut attrs = OpAttrs::new();
        attrs.set_dtype("dtype", DType::Bool);
        let ok = DenseHostTensor::from_slice(&[0u8, 1], [2]).unwrap();
        let y = run(&stagecraft_ops::BITCAST, vec![ok], &attrs).unwrap();
        assert_eq!(y.to_vec::<bool>().unwrap(), [false, true]);
        let bad = DenseHostTensor::from_slice(&[2u8], [1]).unwrap();
        assert!(run(&stagecraft_ops::BITCAST, vec![bad], &attrs).is_err());
    }

    #[test]
    fn bitwise_kernels_at_range_edges() {
        let none = OpAttrs::new();
        let t = |v: &[u64]| DenseHostTensor::from_slice(v, [v.len()]).unwrap();
        let a = t(&[u64::MAX, 1 << 63, 0xF0F0, 5]);
        let b = t(&[1, 63, 4, 64]);
        let got = |def: &'static OpDef, x: Vec<DenseHostTensor>| {
            run(def, x, &none).unwrap().to_vec::<u64>().unwrap()
        };
        assert_eq!(
            got(&stagecraft_ops::SHIFT_LEFT, vec![a.clone(), b.clone()]),
            [u64::MAX - 1, 0, 0xF0F00, 0]
        );
        assert_eq!(
            got(&stagecraft_ops::SHIFT_RIGHT, vec![a.clone(), b.clone()]),
            [u64::MAX >> 1, 1, 0xF0F, 0]
        );
        assert_eq!(
            got(&stagecraft_ops::BITWISE_AND, vec![a.clone(), b.clone()]),
            [1, 0, 0, 0]
        );
        assert_eq!(
            got(&stagecraft_ops::BITWISE_XOR, vec![a.clone(), b.clone()]),
            [u64::MAX - 1, (1 << 63) | 63, 0xF0F4, 69]
        );
        assert_eq!(
            got(&stagecraft_ops::BITWISE_NOT, vec![a.clone()]),
            [0, u64::MAX >> 1, !0xF0F0, !5]
        );
        // Signed right shifts fill with the sign, also past the width.
        let x = DenseHostTensor::from_slice(&[-32_768i16, -1, 16_384], [3]).unwrap();
        let k = DenseHostTensor::from_slice(&[15i16, 3, 20], [3]).unwrap();
        let r = run(
            &stagecraft_ops::SHIFT_RIGHT,
            vec![x.clone(), k.clone()],
            &none,
        )
        .unwrap();
        assert_eq!(r.to_vec::<i16>().unwrap(), [-1, -1, 0]);
        let l = run(&stagecraft_ops::SHIFT_LEFT, vec![x, k], &none).unwrap();
        assert_eq!(l.to_vec::<i16>().unwrap(), [0, -8, 0]);
        // A float operand is refused by the op, not the kernel.
        let f = DenseHostTensor::from_slice(&[1.0f32], [1]).unwrap();
        let e = run(&stagecraft_ops::BITWISE_OR, vec![f.clone(), f], &none).unwrap_err();
        assert!(e.to_string().contains("integer"), "{e}");
    }

    #[test]
    fn cast_follows_scalar_cast_for_every_pair() {
        let specials = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            1.5,
            -2.7,
            0.1,
            1e-8,
            255.9,
            65504.0,
            70000.0,
            3e9,
            -3e9,
            1e20,
            -1e20,
            3e38,
            1e300,
            2147483647.0,
            -2147483648.0,
            9.007199254740993e15,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        let mut rng = Rng(5);
        for from in DType::ALL {
            let mut xs = specials.to_vec();
            xs.extend(rng.values(from, 40_000, true));
            let x = tensor(from, &xs, &[xs.len()]);
            let mut extra = vec![x.clone()];
            if from == DType::I64 {
                extra.push(
                    DenseHostTensor::from_slice(
                        &[i64::MIN, i64::MAX, (1 << 40) + 1, -(1 << 33) - 5],
                        [4],
                    )
                    .unwrap(),
                );
            }
            if from == DType::I32 {
                extra.push(
                    DenseHostTensor::from_slice(&[i32::MIN, i32::MAX, 16_777_217], [3]).unwrap(),
                );
            }
            // The range edges of the 16-bit and wide unsigned types, and
            // u64s beyond 2^63 (which must not pass through i64).
            let edges = match from {
                DType::U16 => Some(DenseHostTensor::from_slice(
                    &[0u16, 1, 255, 256, 32_768, u16::MAX],
                    [6],
                )),
                DType::I16 => Some(DenseHostTensor::from_slice(
                    &[i16::MIN, -129, -1, 128, 2049, i16::MAX],
                    [6],
                )),
                DType::U32 => Some(DenseHostTensor::from_slice(
                    &[u32::MAX, 1 << 31, 16_777_217, 65_536],
                    [4],
                )),
                DType::U64 => Some(DenseHostTensor::from_slice(
                    &[
                        u64::MAX,
                        1 << 63,
                        (1 << 63) + 1,
                        (1 << 63) + (1 << 39) + 1,
                        (1 << 53) + 1,
                        4_294_967_296,
                    ],
                    [6],
                )),
                _ => None,
            };
            if let Some(t) = edges {
                extra.push(t.unwrap());
            }
            for to in DType::ALL {
                let mut attrs = OpAttrs::new();
                attrs.set_dtype("dtype", to);
                for x in &extra {
                    let y = run(&stagecraft_ops::CAST, vec![x.clone()], &attrs).unwrap();
                    assert_eq!(y.dtype(), to);
                    for i in 0..x.numel() {
                        let want = x.get_scalar(i).unwrap().cast(to);
                        let got = y.get_scalar(i).unwrap();
                        let both_nan = got.to_f64().is_nan() && want.to_f64().is_nan();
                        let src = x.get_scalar(i).unwrap();
                        // Where `Scalar::cast` misrounds to f16/bf16, the
                        // kernel's value must be the nearest one.
                        let better = matches!(to, DType::F16 | DType::BF16)
                            && is_nearest(to, src.to_f64(), got);
                        assert!(
                            got == want || both_nan || better,
                            "{from}->{to}: {src} gave {got}, want {want}"
                        );
                    }
                    let want = reference::cast(&values(x), from, to);
                    if !matches!(from, DType::I64 | DType::U64) {
                        assert_close(to, &values(&y), &want, &format!("cast {from}->{to}"));
                    }
                }
            }
        }
    }

    /// True when `got` (an f16 or bf16, finite) is the representable value
    /// nearest to `v`, ties going to the even bit pattern.
    fn is_nearest(to: DType, v: f64, got: Scalar) -> bool {
        let bits = got.to_bits();
        let g = got.to_f64();
        if !g.is_finite() || bits & 0x7fff == 0 {
            return false;
        }
        let d = (g - v).abs();
        let even = bits & 1 == 0;
        [bits + 1, bits - 1].into_iter().all(|n| {
            let e = (Scalar::from_bits(to, n).to_f64() - v).abs();
            d < e || (d == e && even)
        })
    }

    #[test]
    fn half_rounding_is_correct_where_half_from_f64_is_not() {
        // 0xbe3c8005 is just past a bf16 tie; half's from_f64 drops the bits
        // that say so and rounds down.
        let v = f32::from_bits(0xbe3c_8005);
        let mut attrs = OpAttrs::new();
        attrs.set_dtype("dtype", DType::BF16);
        for x in [
            tensor(DType::F32, &[v as f64], &[1]),
            tensor(DType::F64, &[v as f64], &[1]),
        ] {
            let y = run(&stagecraft_ops::CAST, vec![x], &attrs).unwrap();
            assert_eq!(y.to_vec::<bf16>().unwrap()[0], bf16::from_f32(v));
        }
        assert_eq!(<bf16 as Real>::narrow(v as f64), bf16::from_f32(v));
        // Exhaustive over f16: every value halfway between neighbours, and
        // just either side of it, rounds correctly from f64.
        for bits in 0u16..0x7bff {
            let (lo, hi) = (
                f16::from_bits(bits).to_f64(),
                f16::from_bits(bits + 1).to_f64(),
            );
            let mid = (lo + hi) / 2.0;
            let even = if bits & 1 == 0 { bits } else { bits + 1 };
            assert_eq!(<f16 as Real>::narrow(mid).to_bits(), even, "tie at {mid}");
            let above = f64::from_bits(mid.to_bits() + 1);
            let below = f64::from_bits(mid.to_bits() - 1);
            assert_eq!(
                <f16 as Real>::narrow(above).to_bits(),
                bits + 1,
                "above {mid}"
            );
            assert_eq!(<f16 as Real>::narrow(below).to_bits(), bits, "below {mid}");
            assert_eq!(<f16 as Real>::narrow(-above).to_bits(), (bits + 1) | 0x8000);
        }
        assert_eq!(
            <i64 as CastElem>::cast_bf16(i64::MAX).to_f64(),
            2f64.powi(63)
        );
        assert_eq!(
            <i64 as CastElem>::cast_bf16(i64::MIN).to_f64(),
            -(2f64.powi(63))
        );
        assert_eq!(
            <i64 as CastElem>::cast_f16(i64::MIN).to_f64(),
            f64::NEG_INFINITY
        );
        // 2^62 + 2^54 + 1 is just above the bf16 tie between 2^62 and
        // 2^62 + 2^55: it must round up, not to even.
        let just_above_tie = (1i64 << 62) + (1 << 54) + 1;
        assert_eq!(
            <i64 as CastElem>::cast_bf16(just_above_tie).to_f64(),
            2f64.powi(62) + 2f64.powi(55)
        );
    }

    #[test]
    fn cast_to_the_same_dtype_shares_the_buffer() {
        let x = tensor(DType::F32, &[1.0, 2.0], &[2]);
        let keep = x.clone();
        let mut attrs = OpAttrs::new();
        attrs.set_dtype("dtype", DType::F32);
        let y = run(&stagecraft_ops::CAST, vec![x], &attrs).unwrap();
        assert!(y.buffer().ptr_eq(keep.buffer()));
    }

    fn address(t: &DenseHostTensor) -> usize {
        t.buffer().bytes().as_ptr() as usize
    }

    /// Runs `op` and reports whether the output landed in the buffer at
    /// `input_at` and whether any buffer was allocated meanwhile. The
    /// allocation counter is process-wide and other tests allocate on other
    /// threads, so a growth may be someone else's: a no-growth reading in
    /// any of several tries is what proves the kernel allocated nothing.
    fn reuses(
        make: impl Fn() -> Vec<DenseHostTensor>,
        def: &'static OpDef,
        which: usize,
    ) -> (bool, bool) {
        let mut same_buffer = true;
        for _ in 0..200 {
            let inputs = make();
            let at = address(&inputs[which]);
            let before = Buffer::allocation_count();
            let out = run(def, inputs, &OpAttrs::new()).unwrap();
            let after = Buffer::allocation_count();
            same_buffer &= address(&out) == at;
            if after == before {
                return (same_buffer, false);
            }
        }
        (same_buffer, true)
    }

    #[test]
    fn unique_inputs_are_overwritten_in_place() {
        let n = 50_000;
        let big = move || tensor(DType::F32, &vec![1.5; n], &[n]);
        let row = || tensor(DType::F32, &[2.0; 100], &[100]);
        let matrix = || tensor(DType::F32, &vec![1.0; 500 * 100], &[500, 100]);
        type Make = Box<dyn Fn() -> Vec<DenseHostTensor>>;
        let cases: Vec<(Make, &'static OpDef, usize)> = vec![
            (Box::new(move || vec![big()]), &stagecraft_ops::EXP, 0),
            (Box::new(move || vec![big()]), &stagecraft_ops::NEG, 0),
            (
                Box::new(move || vec![big(), big()]),
                &stagecraft_ops::ADD,
                0,
            ),
            (
                Box::new(move || vec![tensor(DType::F32, &[2.0], &[]), big()]),
                &stagecraft_ops::MUL,
                1,
            ),
            (
                Box::new(move || vec![big(), tensor(DType::F32, &[2.0], &[])]),
                &stagecraft_ops::SUB,
                0,
            ),
            (
                Box::new(move || vec![row(), matrix()]),
                &stagecraft_ops::SUB,
                1,
            ),
            (
                Box::new(move || vec![matrix(), row()]),
                &stagecraft_ops::DIV,
                0,
            ),
        ];
        for (make, def, which) in cases {
            let (same, allocated) = reuses(&make, def, which);
            assert!(same, "{}: output not in input {which}'s buffer", def.name);
            assert!(!allocated, "{}: allocated a buffer", def.name);
        }
        // And the values are right.
        let out = run(&stagecraft_ops::SUB, vec![row(), matrix()], &OpAttrs::new()).unwrap();
        assert!(out.as_slice::<f32>().unwrap().iter().all(|&v| v == 1.0));
        let out = run(&stagecraft_ops::DIV, vec![matrix(), row()], &OpAttrs::new()).unwrap();
        assert!(out.as_slice::<f32>().unwrap().iter().all(|&v| v == 0.5));
    }

    #[test]
    fn shared_inputs_are_not_overwritten() {
        let none = OpAttrs::new();
        let a = tensor(DType::F32, &[1.0, 2.0, 3.0], &[3]);
        let b = tensor(DType::F32, &[10.0, 20.0, 30.0], &[3]);
        let (keep_a, keep_b) = (a.clone(), b.clone());
        let c = run(&stagecraft_ops::ADD, vec![a, b], &none).unwrap();
        assert!(!c.buffer().ptr_eq(keep_a.buffer()) && !c.buffer().ptr_eq(keep_b.buffer()));
        assert_eq!(keep_a.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!(keep_b.to_vec::<f32>().unwrap(), vec![10.0, 20.0, 30.0]);
        assert_eq!(c.to_vec::<f32>().unwrap(), vec![11.0, 22.0, 33.0]);
        let e = run(&stagecraft_ops::EXP, vec![keep_a.clone()], &none).unwrap();
        assert!(!e.buffer().ptr_eq(keep_a.buffer()));
        assert_eq!(keep_a.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        // A unique input of the wrong shape (broadcast) or dtype is not reused.
        let small = tensor(DType::F32, &[1.0], &[1]);
        let at = address(&small);
        let out = run(
            &stagecraft_ops::ADD,
            vec![small, tensor(DType::F32, &[1.0, 2.0], &[2])],
            &none,
        )
        .unwrap();
        assert_ne!(address(&out), at);
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
        let bools = tensor(DType::F32, &[1.0, 2.0], &[2]);
        let at = address(&bools);
        let out = run(
            &stagecraft_ops::LESS,
            vec![bools, tensor(DType::F32, &[1.5], &[])],
            &none,
        )
        .unwrap();
        assert_ne!(address(&out), at);
        assert_eq!(out.to_vec::<bool>().unwrap(), vec![true, false]);
    }

    #[test]
    fn walk_merges_dims_and_splits_rows() {
        let out = Shape::new(&[2, 3, 4]);
        let w = Walk::new(&out, [&Shape::new(&[2, 3, 4]), &Shape::new(&[4])]);
        assert_eq!(
            (w.outer.as_slice(), w.inner, w.inner_strides),
            (&[6][..], 4, [1, 1])
        );
        let w = Walk::new(&out, [&Shape::new(&[2, 3, 4]), &Shape::new(&[2, 3, 4])]);
        assert_eq!((w.outer.len(), w.inner), (0, 24));
        let w = Walk::new(&out, [&Shape::new(&[2, 3, 1]), &Shape::new(&[])]);
        assert_eq!(
            (w.outer.as_slice(), w.inner, w.inner_strides),
            (&[6][..], 4, [0, 0])
        );
        // Runs that start mid-row (as parallel chunks do) see the right offsets.
        let w = Walk::new(&out, [&Shape::new(&[2, 1, 4]), &Shape::new(&[3, 1])]);
        for start in [0, 5, 11, 23] {
            let mut cells: Vec<[usize; 2]> = vec![[usize::MAX; 2]; 24 - start];
            w.run_from(&mut cells, start, &|part: &mut [[usize; 2]], offs| {
                for (j, cell) in part.iter_mut().enumerate() {
                    *cell = [
                        offs[0] + j * w.inner_strides[0],
                        offs[1] + j * w.inner_strides[1],
                    ];
                }
            });
            for (i, offs) in cells.iter().enumerate() {
                let flat = start + i;
                let (a, b, c) = (flat / 12, flat / 4 % 3, flat % 4);
                assert_eq!(*offs, [a * 4 + c, b], "element {flat} from {start}");
            }
        }
    }

    /// Two shapes that broadcast together: an output shape and, per input,
    /// each dim kept or set to 1 and some leading dims dropped.
    fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
        prop::collection::vec(0usize..5, 0..5).prop_flat_map(|out| {
            let rank = out.len();
            (
                Just(out),
                prop::collection::vec(any::<bool>(), rank),
                prop::collection::vec(any::<bool>(), rank),
                0..=rank,
                0..=rank,
            )
                .prop_map(|(out, ka, kb, drop_a, drop_b)| {
                    let pick = |keep: &[bool], drop: usize| -> Vec<usize> {
                        out.iter()
                            .zip(keep)
                            .skip(drop)
                            .map(|(&d, &k)| if k { d } else { 1 })
                            .collect()
                    };
                    (pick(&ka, drop_a), pick(&kb, drop_b))
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn broadcasting_binary_ops_match_the_reference((da, db) in broadcast_pair(), seed in any::<u64>(), dtype_pick in 0usize..10) {
            let dtype = NUMERIC[dtype_pick];
            let mut rng = Rng(seed | 1);
            let na: usize = da.iter().product();
            let nb: usize = db.iter().product();
            let a = tensor(dtype, &rng.values(dtype, na, true), &da);
            let b = tensor(dtype, &nonzero(rng.values(dtype, nb, true)), &db);
            let (av, bv) = (values(&a), values(&b));
            for (def, op) in binary_ops(dtype) {
                let got = run(def, vec![a.clone(), b.clone()], &OpAttrs::new()).unwrap();
                let (want, dims) = reference::binary(op, dtype, &av, &da, &bv, &db).unwrap();
                prop_assert_eq!(got.shape().dims(), dims.as_slice());
                assert_close(dtype, &values(&got), &want, def.name);
            }
            let got = run(&stagecraft_ops::LESS_EQUAL, vec![a, b], &OpAttrs::new()).unwrap();
            let (want, _) = reference::compare(CompareOp::Le, &av, &da, &bv, &db).unwrap();
            prop_assert_eq!(values(&got), want);
        }

        #[test]
        fn select_broadcasts_three_ways((dc, da) in broadcast_pair(), (_, db) in broadcast_pair(), seed in any::<u64>()) {
            let mut rng = Rng(seed | 1);
            let n = |d: &[usize]| d.iter().product::<usize>();
            prop_assume!(reference::broadcast_dims(&[&dc, &da, &db]).is_ok());
            let c = tensor(DType::Bool, &rng.values(DType::Bool, n(&dc), false), &dc);
            let a = tensor(DType::F32, &rng.values(DType::F32, n(&da), false), &da);
            let b = tensor(DType::F32, &rng.values(DType::F32, n(&db), false), &db);
            let (cv, av, bv) = (values(&c), values(&a), values(&b));
            let got = run(&stagecraft_ops::SELECT, vec![c, a, b], &OpAttrs::new()).unwrap();
            let (want, dims) = reference::select(&cv, &dc, &av, &da, &bv, &db).unwrap();
            prop_assert_eq!(got.shape().dims(), dims.as_slice());
            prop_assert_eq!(values(&got), want);
        }
    }
}
