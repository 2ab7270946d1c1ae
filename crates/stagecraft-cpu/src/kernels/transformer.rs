//! CPU kernels of the transformer ops: `Embedding`, `LayerNorm` and
//! `RmsNorm` with their backward ops, and `CrossEntropy` with its backward.
//!
//! Every kernel here works row by row over the last axis, which is
//! contiguous: a row comes from memory once and every pass over it
//! (statistics, then outputs) runs while it is in cache. Above
//! [`PARALLEL_THRESHOLD`] elements, groups of about [`CHUNK`] elements'
//! worth of rows go to the pool's threads, the calling thread taking a
//! share (`pool::for_each_chunk`).
//!
//! **Precision.** Per-element arithmetic runs in the type that holds the
//! data exactly and vectorizes widest: f32 for f32, f16 and bf16, f64 for
//! f64 ([`Float::C`]). Sums over a row or over rows accumulate in f64, in
//! eight interleaved partial sums (so the loops vectorize): a row's passes
//! run from L1 and are bounded by loads, and widening f32 to f64 is one
//! instruction per vector, so f64 sums cost little. In return a row's mean
//! and variance carry no error an f32 result could show, even where the
//! mean is large against the spread (residual streams), whereas f32
//! partial sums lose bits in proportion to that ratio and to the row's
//! length. The loss follows `Softmax`: exponentials and the log-sum-exp in
//! f64 (`Real::exp_wide`, a vectorizing polynomial for f32 and narrower),
//! each result rounded once.
//!
//! **Determinism.** Sums over rows are formed in an order the shape alone
//! fixes: `dweight` and `dbias` per block of rows (bounds set by the
//! shape), each block in row order, then the blocks' partial sums in
//! block order; a loss's sum or mean over the per-row losses in row order
//! after they are all computed. The bits never depend on how many threads
//! ran.

use super::elementwise::{nan_max, Real, CHUNK};
use super::fused::{isa, Isa};
use super::shape::{gather_rows, index_values, unravel};
use super::{first_dtype, out_meta, take};
use crate::{Inputs, Kernel, KernelContext, KernelRegistry, Outputs, PARALLEL_THRESHOLD};
use half::{bf16, f16};
use stagecraft_ops::{ignore_index, Attrs, LossReduction};
use stagecraft_tensor::{
    DType, DenseHostTensor, Element, Error, ErrorKind, Result, Shape, TensorMetadata,
};
use std::ops::{Add, Div, Mul, Sub};
use std::sync::Arc;

pub(crate) fn register(registry: &mut KernelRegistry) {
    use stagecraft_ops as ops;
    registry.add(&ops::EMBEDDING, embedding_factory);
    registry.add(&ops::LAYER_NORM, norm_factory);
    registry.add(&ops::RMS_NORM, norm_factory);
    registry.add(&ops::LAYER_NORM_GRAD, norm_grad_factory);
    registry.add(&ops::RMS_NORM_GRAD, norm_grad_factory);
    registry.add(&ops::CROSS_ENTROPY, cross_entropy_factory);
    registry.add(&ops::CROSS_ENTROPY_GRAD, cross_entropy_grad_factory);
}

/// At most this many blocks of rows in a backward pass: enough to keep a
/// few dozen threads busy, few enough that their partial sums of
/// `dweight` and `dbias` stay small next to the rows.
const MAX_BLOCKS: usize = 32;

// ---------------------------------------------------------------------------
// Element types.

/// The type per-element arithmetic runs in: f32 or f64.
pub(crate) trait Lane:
    Element
    + Copy
    + Send
    + Sync
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
{
    /// `v` rounded to this type.
    fn of(v: f64) -> Self;
    /// The value as f64 (exact).
    fn wide(self) -> f64;
    /// The correctly rounded square root (one instruction per vector).
    fn root(self) -> Self;
}

impl Lane for f32 {
    #[inline(always)]
    fn of(v: f64) -> f32 {
        v as f32
    }
    #[inline(always)]
    fn wide(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn root(self) -> f32 {
        self.sqrt()
    }
}

impl Lane for f64 {
    #[inline(always)]
    fn of(v: f64) -> f64 {
        v
    }
    #[inline(always)]
    fn wide(self) -> f64 {
        self
    }
    #[inline(always)]
    fn root(self) -> f64 {
        self.sqrt()
    }
}

/// A float element type and the [`Lane`] type its rows are computed in,
/// which is also the dtype of its statistics (`stagecraft_ops::stats_dtype`).
pub(crate) trait Float: Real {
    /// The arithmetic (and statistics) type.
    type C: Lane;
    /// The value in the arithmetic type (exact).
    fn load(self) -> Self::C;
    /// `v` rounded to this type once.
    fn store(v: Self::C) -> Self;
}

impl Float for f32 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> f32 {
        v
    }
}

impl Float for f64 {
    type C = f64;
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(v: f64) -> f64 {
        v
    }
}

impl Float for f16 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> f16 {
        f16::from_f32(v)
    }
}

impl Float for bf16 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

/// Picks `$make::<T>()` for a float dtype; other dtypes have no kernel
/// (the shape rules refuse them first, so this is a second guard).
macro_rules! float_kernel {
    ($attrs:expr, $dtype:expr, $make:ident) => {
        match $dtype {
            DType::F32 => Ok($make::<f32>()),
            DType::F64 => Ok($make::<f64>()),
            DType::F16 => Ok($make::<f16>()),
            DType::BF16 => Ok($make::<bf16>()),
            other => Err(Error::dtype(format!(
                "{} has no CPU kernel for {other}",
                $attrs.op().name
            ))),
        }
    };
}

// ---------------------------------------------------------------------------
// Sums and the row drivers.

/// Partial sums per row sum: eight independent chains, so the loops
/// vectorize and the rounding error grows with a row's length over 8.
const LANES: usize = 8;

/// The eight partial sums added in a fixed tree.
#[inline(always)]
fn total(acc: &[f64; LANES]) -> f64 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `Σ f(x)` over `xs` in f64.
#[inline(always)]
fn sum_of<T: Copy>(xs: &[T], f: impl Fn(T) -> f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        for k in 0..LANES {
            acc[k] += f(chunk[k]);
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += f(x);
    }
    total(&acc)
}

/// `Σ f(x, y)` over `xs` and `ys` (of one length) in f64, as
/// [`sum_of`].
#[inline(always)]
fn sum_of2<A: Copy, B: Copy>(xs: &[A], ys: &[B], f: impl Fn(A, B) -> f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut xc = xs.chunks_exact(LANES);
    let mut yc = ys.chunks_exact(LANES);
    for (cx, cy) in (&mut xc).zip(&mut yc) {
        for k in 0..LANES {
            acc[k] += f(cx[k], cy[k]);
        }
    }
    for ((a, &x), &y) in acc.iter_mut().zip(xc.remainder()).zip(yc.remainder()) {
        *a += f(x, y);
    }
    total(&acc)
}

/// Rows of `d` elements per parallel task.
fn rows_per_task(d: usize) -> usize {
    (CHUNK / d.max(1)).max(1)
}

/// `f` on every part, on the pool's threads too when `parallel`.
fn run_parts<P: Send>(parts: &mut [P], parallel: bool, f: impl Fn(&mut P) + Sync) {
    if parallel && parts.len() > 1 {
        crate::pool::for_each_chunk(parts, 1, |_, part| part.iter_mut().for_each(&f));
    } else {
        parts.iter_mut().for_each(f);
    }
}

/// `y` (rows of `d > 0` elements) and `per_row` (one entry per row) cut
/// into parts of about [`CHUNK`] elements: `(first row, rows, entries)`.
fn row_parts<'a, A, B>(
    y: &'a mut [A],
    d: usize,
    per_row: &'a mut [B],
) -> Vec<(usize, &'a mut [A], &'a mut [B])> {
    let rows = rows_per_task(d);
    y.chunks_mut(rows * d)
        .zip(per_row.chunks_mut(rows))
        .enumerate()
        .map(|(i, (y, s))| (i * rows, y, s))
        .collect()
}

/// Defines `$on(isa, args..)`, which runs `$body` (an `#[inline(always)]`
/// function of the same arguments) compiled for the instruction set
/// `isa` names, as `Softmax` does: the default build targets baseline
/// x86-64, whose SSE2 vectors hold two f64 or four f32 lanes against
/// AVX2's four or eight and AVX-512's eight or sixteen, and these loops
/// are bound by arithmetic while a row sits in L1, the loss's
/// exponentials above all. Measured on one core of the AVX-512
/// development machine (test profile, f32, SSE2 / AVX2 / AVX-512):
/// cross-entropy over 16×8192 logits 663 / 342 / 196 µs, its backward
/// 476 / 251 / 155 µs; layer norm over 64×768 42 / 39 / 39 µs, its
/// backward 68 / 54 / 55 µs. Every operation is the same IEEE operation
/// on every instruction set and the sums' order is spelled out (eight
/// partial sums), so the bits do not change.
macro_rules! multiversioned {
    ($on:ident => $body:ident<$($t:ident: $bound:ident),*; $($c:ident),*>($($arg:ident: $ty:ty),* $(,)?)) => {
        #[allow(clippy::too_many_arguments)]
        fn $on<$($t: $bound,)* $(const $c: bool,)*>(isa: Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            #[allow(clippy::too_many_arguments)]
            fn avx2<$($t: $bound,)* $(const $c: bool,)*>($($arg: $ty),*) {
                $body::<$($t,)* $($c,)*>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            #[allow(clippy::too_many_arguments)]
            fn avx512<$($t: $bound,)* $(const $c: bool,)*>($($arg: $ty),*) {
                $body::<$($t,)* $($c,)*>($($arg),*)
            }
            match isa {
                Isa::Baseline => $body::<$($t,)* $($c,)*>($($arg),*),
                // SAFETY: `isa()` reported AVX2, all `avx2` is compiled
                // to use.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::<$($t,)* $($c,)*>($($arg),*) },
                // SAFETY: as above, for AVX-512F.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512::<$($t,)* $($c,)*>($($arg),*) },
            }
        }
    };
}

/// Whether work over `elements` elements is split across threads.
fn parallel(elements: usize) -> bool {
    elements > PARALLEL_THRESHOLD
}

/// The next input, or an internal error (the shape rule counted them).
fn next_input(inputs: &mut impl Iterator<Item = DenseHostTensor>) -> Result<DenseHostTensor> {
    inputs
        .next()
        .ok_or_else(|| Error::internal("a transformer kernel is missing an input"))
}

/// An `Index` error for the entry `value` at flat `position` of a tensor
/// of `shape` (`what` names its role: "id", "target").
fn out_of_range(what: &str, value: i64, position: usize, shape: &Shape, valid: &str) -> Error {
    let at = unravel(position, shape.dims());
    Error::new(
        ErrorKind::Index,
        format!(
            "{what} {value} at position {:?} is out of range: {valid}",
            at.as_slice()
        ),
    )
}

// ---------------------------------------------------------------------------
// Embedding.

fn embedding_factory(_: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    let f: fn(&DenseHostTensor, &DenseHostTensor, &TensorMetadata) -> Result<DenseHostTensor> =
        crate::with_any_type!(first_dtype(inputs)?, T => embedding::<T>);
    Ok(Arc::new(move |inputs: Inputs, ctx: &KernelContext<'_>| {
        let [table, ids] = take(inputs)?;
        Ok(smallvec::smallvec![f(&table, &ids, out_meta(ctx)?)?])
    }))
}

/// The rows of `table` the ids pick, every id checked first: a bad one is
/// an error, never a half-written output.
fn embedding<T: Element>(
    table: &DenseHostTensor,
    ids: &DenseHostTensor,
    meta: &TensorMetadata,
) -> Result<DenseHostTensor> {
    let dims = table.shape().dims();
    let (rows, width) = (dims[0], dims[1]);
    let limit = i64::try_from(rows).unwrap_or(i64::MAX);
    let picks = index_values(ids)?
        .iter()
        .enumerate()
        .map(|(position, &id)| {
            if (0..limit).contains(&id) {
                Ok(id as usize)
            } else {
                let valid = format!("the table has {rows} rows, so ids lie in [0, {rows})");
                Err(out_of_range("id", id, position, ids.shape(), &valid))
            }
        })
        .collect::<Result<Vec<usize>>>()?;
    let mut out = DenseHostTensor::for_overwrite(meta.clone())?;
    if out.numel() > 0 {
        gather_rows(
            table.as_slice::<T>()?,
            rows,
            &picks,
            width,
            out.as_mut_slice::<T>()?,
        );
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// LayerNorm and RmsNorm.

/// Which norm and which parameters: the loops are compiled per
/// combination, so an absent parameter costs nothing.
#[derive(Clone, Copy, Debug)]
struct NormKind {
    /// Layer norm (subtract the mean) rather than RMS norm.
    centered: bool,
    has_weight: bool,
    has_bias: bool,
}

impl NormKind {
    fn of(attrs: &Attrs<'_>) -> Result<NormKind> {
        let op = attrs.op();
        let centered = op == &stagecraft_ops::LAYER_NORM || op == &stagecraft_ops::LAYER_NORM_GRAD;
        Ok(NormKind {
            centered,
            has_weight: attrs.bool("has_weight")?,
            has_bias: centered && attrs.bool("has_bias")?,
        })
    }
}

/// Calls `$f::<CENTERED, HAS_WEIGHT, HAS_BIAS>($args)` for a [`NormKind`].
macro_rules! by_kind {
    ($kind:expr, $f:ident::<$T:ty>($($arg:expr),*)) => {
        match ($kind.centered, $kind.has_weight, $kind.has_bias) {
            (true, false, false) => $f::<$T, true, false, false>($($arg),*),
            (true, true, false) => $f::<$T, true, true, false>($($arg),*),
            (true, false, true) => $f::<$T, true, false, true>($($arg),*),
            (true, true, true) => $f::<$T, true, true, true>($($arg),*),
            (false, false, _) => $f::<$T, false, false, false>($($arg),*),
            (false, true, _) => $f::<$T, false, true, false>($($arg),*),
        }
    };
}

fn norm_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    float_kernel!(attrs, first_dtype(inputs)?, norm_kernel)
}

fn norm_grad_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    // The first input is `g`, of x's dtype.
    float_kernel!(attrs, first_dtype(inputs)?, norm_grad_kernel)
}

fn norm_kernel<T: Float>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let kind = NormKind::of(&ctx.attrs)?;
        let eps = ctx.attrs.float("eps")?;
        let mut inputs = inputs.into_iter();
        let x = next_input(&mut inputs)?;
        let weight = kind
            .has_weight
            .then(|| next_input(&mut inputs))
            .transpose()?;
        let bias = kind.has_bias.then(|| next_input(&mut inputs)).transpose()?;
        let slice = |t: &Option<DenseHostTensor>| -> Result<Vec<T>> {
            // Parameters are one row; a copy keeps the loops' slices plain.
            t.as_ref().map_or(Ok(Vec::new()), |t| t.to_vec::<T>())
        };
        let (w, b) = (slice(&weight)?, slice(&bias)?);
        let [y_meta, stats_meta @ ..] = ctx.outputs else {
            return Err(Error::internal("a norm kernel without output metadata"));
        };
        let mut y = DenseHostTensor::for_overwrite(y_meta.clone())?;
        let d = x.shape().dims().last().copied().unwrap_or(1);
        let stats = if d == 0 {
            // No elements: 0/0 statistics, as a mean of nothing.
            vec![[T::C::of(f64::NAN); 2]; stats_meta[0].shape.numel()]
        } else {
            let xs = x.as_slice::<T>()?;
            let ys = y.as_mut_slice::<T>()?;
            by_kind!(
                kind,
                norm_rows::<T>(xs, &w, &b, eps, d, ys, parallel(xs.len()))
            )
        };
        let mut outputs: Outputs = smallvec::smallvec![y];
        // LayerNorm returns (mean, rstd), RmsNorm rstd alone.
        let first = if kind.centered { 0 } else { 1 };
        for (k, meta) in stats_meta.iter().enumerate() {
            let mut t = DenseHostTensor::for_overwrite(meta.clone())?;
            for (o, s) in t.as_mut_slice::<T::C>()?.iter_mut().zip(&stats) {
                *o = s[first + k];
            }
            outputs.push(t);
        }
        Ok(outputs)
    })
}

/// Normalizes every row of `x` (rows of `d > 0` elements) into `y`;
/// returns each row's `[mean, rstd]` (mean 0 for RMS norm).
fn norm_rows<T: Float, const CENTERED: bool, const HAS_W: bool, const HAS_B: bool>(
    x: &[T],
    w: &[T],
    b: &[T],
    eps: f64,
    d: usize,
    y: &mut [T],
    parallel: bool,
) -> Vec<[T::C; 2]> {
    let isa = isa();
    let mut stats = vec![[T::C::of(0.0); 2]; y.len() / d];
    let mut parts = row_parts(y, d, &mut stats);
    run_parts(&mut parts, parallel, |(first, y, s)| {
        norm_part_on::<T, CENTERED, HAS_W, HAS_B>(isa, x, w, b, eps, d, *first, y, s)
    });
    drop(parts);
    stats
}

/// Rows `first..` of a norm's forward: `y` and the rows' statistics.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn norm_part<T: Float, const CENTERED: bool, const HAS_W: bool, const HAS_B: bool>(
    x: &[T],
    w: &[T],
    b: &[T],
    eps: f64,
    d: usize,
    first: usize,
    y: &mut [T],
    stats: &mut [[T::C; 2]],
) {
    for (k, (y_row, s)) in y.chunks_exact_mut(d).zip(stats.iter_mut()).enumerate() {
        let r = first + k;
        *s = norm_row::<T, CENTERED, HAS_W, HAS_B>(&x[r * d..(r + 1) * d], w, b, eps, y_row);
    }
}

multiversioned!(norm_part_on => norm_part<T: Float; CENTERED, HAS_W, HAS_B>(
    x: &[T],
    w: &[T],
    b: &[T],
    eps: f64,
    d: usize,
    first: usize,
    y: &mut [T],
    stats: &mut [[T::C; 2]],
));

/// One row: the statistics in f64 (two passes over the cached row: the
/// mean, then the mean squared deviation from it), then
/// `y = (x - mean)·rstd·w + b` in the arithmetic type.
#[inline(always)]
fn norm_row<T: Float, const CENTERED: bool, const HAS_W: bool, const HAS_B: bool>(
    x: &[T],
    w: &[T],
    b: &[T],
    eps: f64,
    y: &mut [T],
) -> [T::C; 2] {
    let d = x.len();
    let n = d as f64;
    let (mean, var) = if CENTERED {
        let mean = sum_of(x, |v| v.wide()) / n;
        let var = sum_of(x, |v| {
            let c = v.wide() - mean;
            c * c
        }) / n;
        (mean, var)
    } else {
        (
            0.0,
            sum_of(x, |v| {
                let v = v.wide();
                v * v
            }) / n,
        )
    };
    let rstd = 1.0 / (var + eps).sqrt();
    let (m, r) = (T::C::of(mean), T::C::of(rstd));
    let y = &mut y[..d];
    let w = if HAS_W { &w[..d] } else { w };
    let b = if HAS_B { &b[..d] } else { b };
    for j in 0..d {
        let v = x[j].load();
        let c = if CENTERED { v - m } else { v };
        let mut out = c * r;
        if HAS_W {
            out = out * w[j].load();
        }
        if HAS_B {
            out = out + b[j].load();
        }
        y[j] = T::store(out);
    }
    [m, r]
}

fn norm_grad_kernel<T: Float>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let kind = NormKind::of(&ctx.attrs)?;
        let mut inputs = inputs.into_iter();
        let g = next_input(&mut inputs)?;
        let x = next_input(&mut inputs)?;
        let mean = if kind.centered {
            Some(next_input(&mut inputs)?)
        } else {
            None
        };
        let rstd = next_input(&mut inputs)?;
        let weight = kind
            .has_weight
            .then(|| next_input(&mut inputs))
            .transpose()?;
        let w = weight
            .as_ref()
            .map_or(Ok(Vec::new()), |t| t.to_vec::<T>())?;
        let rstd = rstd.as_slice::<T::C>()?;
        // RMS norm's rows are not centered: a mean of 0 leaves x as it is.
        let zeros;
        let mean = match &mean {
            Some(m) => m.as_slice::<T::C>()?,
            None => {
                zeros = vec![T::C::of(0.0); rstd.len()];
                &zeros
            }
        };
        let d = x.shape().dims().last().copied().unwrap_or(1);
        let mut dx = DenseHostTensor::for_overwrite(out_meta(ctx)?.clone())?;
        let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
        if d > 0 {
            let (gs, xs) = (g.as_slice::<T>()?, x.as_slice::<T>()?);
            let parallel = parallel(xs.len());
            let rows = NormRows {
                g: gs,
                x: xs,
                w: &w,
                mean,
                rstd,
            };
            by_kind!(
                kind,
                norm_grad_rows::<T>(
                    &rows,
                    d,
                    dx.as_mut_slice::<T>()?,
                    &mut dw,
                    &mut db,
                    parallel
                )
            );
        }
        let mut outputs: Outputs = smallvec::smallvec![dx];
        for (on, sums) in [(kind.has_weight, &dw), (kind.has_bias, &db)] {
            if on {
                let meta = TensorMetadata::new(g.dtype(), [d]);
                let mut t = DenseHostTensor::for_overwrite(meta)?;
                for (o, &s) in t.as_mut_slice::<T>()?.iter_mut().zip(sums.iter()) {
                    *o = T::narrow(s);
                }
                outputs.push(t);
            }
        }
        Ok(outputs)
    })
}

/// The inputs of a norm's backward, as slices.
struct NormRows<'a, T: Float> {
    g: &'a [T],
    x: &'a [T],
    /// The weight, empty when absent.
    w: &'a [T],
    mean: &'a [T::C],
    rstd: &'a [T::C],
}

/// One block of rows of a backward pass: where its rows start, its part
/// of `dx`, and its partial sums of `dweight` and `dbias`.
type GradBlock<'a, T> = (usize, &'a mut [T], Vec<f64>, Vec<f64>);

/// Every row's `dx` (rows of `d > 0` elements), and `dweight`/`dbias`
/// summed over the rows into `dw`/`db` (each `d` long) where present.
/// Rows go in blocks fixed by the shape (see the module docs).
fn norm_grad_rows<T: Float, const CENTERED: bool, const HAS_W: bool, const HAS_B: bool>(
    rows: &NormRows<'_, T>,
    d: usize,
    dx: &mut [T],
    dw: &mut [f64],
    db: &mut [f64],
    parallel: bool,
) {
    let n = dx.len() / d;
    let block = rows_per_task(d).max(n.div_ceil(MAX_BLOCKS));
    let sums = |on: bool| if on { vec![0.0; d] } else { Vec::new() };
    let mut parts: Vec<GradBlock<'_, T>> = dx
        .chunks_mut(block * d)
        .enumerate()
        .map(|(i, dx)| (i * block, dx, sums(HAS_W), sums(HAS_B)))
        .collect();
    let isa = isa();
    run_parts(&mut parts, parallel, |(first, dx, pw, pb)| {
        norm_grad_part_on::<T, CENTERED, HAS_W, HAS_B>(isa, rows, d, *first, dx, pw, pb)
    });
    for (_, _, pw, pb) in &parts {
        for (acc, &p) in dw.iter_mut().zip(pw.iter()) {
            *acc += p;
        }
        for (acc, &p) in db.iter_mut().zip(pb.iter()) {
            *acc += p;
        }
    }
}

/// Rows `first..` of a norm's backward: their `dx`, and their sums of
/// `g·xh` and `g` added into `pw` and `pb`.
#[inline(always)]
fn norm_grad_part<T: Float, const CENTERED: bool, const HAS_W: bool, const HAS_B: bool>(
    rows: &NormRows<'_, T>,
    d: usize,
    first: usize,
    dx: &mut [T],
    pw: &mut [f64],
    pb: &mut [f64],
) {
    let (mut xh, mut a) = (vec![T::C::of(0.0); d], vec![T::C::of(0.0); d]);
    for (k, dx_row) in dx.chunks_exact_mut(d).enumerate() {
        let r = first + k;
        let span = r * d..(r + 1) * d;
        norm_grad_row::<T, CENTERED, HAS_W, HAS_B>(
            &rows.g[span.clone()],
            &rows.x[span],
            rows.w,
            rows.mean[r],
            rows.rstd[r],
            dx_row,
            pw,
            pb,
            &mut xh,
            &mut a,
        );
    }
}

multiversioned!(norm_grad_part_on => norm_grad_part<T: Float; CENTERED, HAS_W, HAS_B>(
    rows: &NormRows<'_, T>,
    d: usize,
    first: usize,
    dx: &mut [T],
    pw: &mut [f64],
    pb: &mut [f64],
));

/// One row of the backward, with `xh = (x - mean)·rstd` and `a = g·w`
/// (kept in `xh` and `a`, scratch rows of `d`):
/// `dx = rstd·(a - mean(a) - xh·mean(a·xh))` (RMS norm: no `mean(a)`),
/// and `g·xh`, `g` added into the block's `dweight`, `dbias` sums. Each
/// step is its own loop over the cached row, which vectorizes: one loop
/// doing all of them did not, and took 8 ns an element against 1.4 (SSE2,
/// 64×768 f32).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn norm_grad_row<T: Float, const CENTERED: bool, const HAS_W: bool, const HAS_B: bool>(
    g: &[T],
    x: &[T],
    w: &[T],
    m: T::C,
    r: T::C,
    dx: &mut [T],
    dw: &mut [f64],
    db: &mut [f64],
    xh: &mut [T::C],
    a: &mut [T::C],
) {
    let d = x.len();
    let (g, dx, xh, a) = (&g[..d], &mut dx[..d], &mut xh[..d], &mut a[..d]);
    for (h, &v) in xh.iter_mut().zip(x) {
        let v = v.load();
        *h = (if CENTERED { v - m } else { v }) * r;
    }
    if HAS_W {
        for ((o, &gj), &wj) in a.iter_mut().zip(g).zip(&w[..d]) {
            *o = gj.load() * wj.load();
        }
    } else {
        for (o, &gj) in a.iter_mut().zip(g) {
            *o = gj.load();
        }
    }
    let n = d as f64;
    let mean_a = if CENTERED {
        sum_of(a, |v| v.wide()) / n
    } else {
        0.0
    };
    let mean_axh = sum_of2(a, xh, |p, q| p.wide() * q.wide()) / n;
    if HAS_W {
        for ((p, &gj), &h) in dw[..d].iter_mut().zip(g).zip(xh.iter()) {
            *p += gj.wide() * h.wide();
        }
    }
    if HAS_B {
        for (p, &gj) in db[..d].iter_mut().zip(g) {
            *p += gj.wide();
        }
    }
    let (c1, c2) = (T::C::of(mean_a), T::C::of(mean_axh));
    for ((o, &aj), &h) in dx.iter_mut().zip(a.iter()).zip(xh.iter()) {
        let t = aj - h * c2;
        let t = if CENTERED { t - c1 } else { t };
        *o = T::store(r * t);
    }
}

// ---------------------------------------------------------------------------
// CrossEntropy.

/// The row of a target that is ignored.
const IGNORED: usize = usize::MAX;

/// Every row's class, [`IGNORED`] for an ignored row; an `Index` error
/// names the first target that is neither a class nor the ignored value.
fn checked_targets(
    targets: &DenseHostTensor,
    classes: usize,
    ignore: Option<i64>,
) -> Result<Vec<usize>> {
    let limit = i64::try_from(classes).unwrap_or(i64::MAX);
    index_values(targets)?
        .iter()
        .enumerate()
        .map(|(position, &t)| {
            if Some(t) == ignore {
                Ok(IGNORED)
            } else if (0..limit).contains(&t) {
                Ok(t as usize)
            } else {
                let ignored = match ignore {
                    Some(i) => format!(" (or the ignore_index {i})"),
                    None => String::new(),
                };
                let valid = format!(
                    "there are {classes} classes, so targets lie in [0, {classes}){ignored}"
                );
                Err(out_of_range("target", t, position, targets.shape(), &valid))
            }
        })
        .collect()
}

/// `log Σ exp(x)` over a row, in f64 after subtracting the row's maximum:
/// no exponential overflows, and a NaN or an infinite maximum gives NaN
/// (as `LogSoftmax` does). Eight partial sums, so the loop vectorizes.
#[inline(always)]
fn log_sum_exp<T: Real>(row: &[T]) -> f64 {
    let max = max_of(row);
    max + sum_of(row, |x| T::exp_wide(x.wide() - max)).ln()
}

/// The largest value of a row in f64, a NaN if there is one; eight
/// partial maxima, so the loop vectorizes (which NaN, or which zero of
/// `±0`, wins does not matter to the log-sum-exp).
#[inline(always)]
fn max_of<T: Real>(xs: &[T]) -> f64 {
    let mut acc = [f64::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        for k in 0..LANES {
            acc[k] = nan_max(acc[k], chunk[k].wide());
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a = nan_max(*a, x.wide());
    }
    acc.iter().fold(f64::NEG_INFINITY, |m, &a| nan_max(m, a))
}

/// Rows `first..` of the loss: each row's `(lse, loss)`, the loss 0 for
/// an ignored row.
#[inline(always)]
fn loss_part<T: Float>(
    xs: &[T],
    c: usize,
    classes: &[usize],
    first: usize,
    out: &mut [(f64, f64)],
) {
    for (k, o) in out.iter_mut().enumerate() {
        let r = first + k;
        let row = &xs[r * c..(r + 1) * c];
        let lse = log_sum_exp(row);
        let loss = match classes[r] {
            IGNORED => 0.0,
            t => lse - row[t].wide(),
        };
        *o = (lse, loss);
    }
}

multiversioned!(loss_part_on => loss_part<T: Float;>(
    xs: &[T],
    c: usize,
    classes: &[usize],
    first: usize,
    out: &mut [(f64, f64)],
));

/// Rows `first..` of the loss's backward: `(exp(x - lse) - onehot)·share`
/// per row (without the one-hot term unless `subtract`), 0 for an ignored
/// row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn loss_grad_part<T: Float>(
    xs: &[T],
    c: usize,
    classes: &[usize],
    lse: &[T::C],
    shares: &[f64],
    subtract: bool,
    first: usize,
    dx: &mut [T],
) {
    for (k, row) in dx.chunks_exact_mut(c).enumerate() {
        let r = first + k;
        let t = classes[r];
        if t == IGNORED {
            row.fill(T::narrow(0.0));
            continue;
        }
        let (s, l) = (shares[r], lse[r].wide());
        let x = &xs[r * c..(r + 1) * c];
        for (o, &v) in row.iter_mut().zip(x) {
            *o = T::narrow(T::exp_wide(v.wide() - l) * s);
        }
        if subtract {
            // The target's entry again, with the 1 taken off in f64
            // before the one rounding.
            row[t] = T::narrow((T::exp_wide(x[t].wide() - l) - 1.0) * s);
        }
    }
}

multiversioned!(loss_grad_part_on => loss_grad_part<T: Float;>(
    xs: &[T],
    c: usize,
    classes: &[usize],
    lse: &[T::C],
    shares: &[f64],
    subtract: bool,
    first: usize,
    dx: &mut [T],
));

/// The number of classes and of rows of `logits`.
fn classes_and_rows(logits: &DenseHostTensor, targets: &DenseHostTensor) -> (usize, usize) {
    let classes = logits.shape().dims().last().copied().unwrap_or(1);
    (classes, targets.numel())
}

fn cross_entropy_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    float_kernel!(attrs, first_dtype(inputs)?, cross_entropy_kernel)
}

fn cross_entropy_grad_factory(attrs: &Attrs<'_>, inputs: &[TensorMetadata]) -> Result<Kernel> {
    float_kernel!(attrs, first_dtype(inputs)?, cross_entropy_grad_kernel)
}

fn cross_entropy_kernel<T: Float>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [logits, targets] = take(inputs)?;
        let reduction = LossReduction::of(&ctx.attrs)?;
        let (c, n) = classes_and_rows(&logits, &targets);
        let classes = checked_targets(&targets, c, ignore_index(&ctx.attrs)?)?;
        let xs = logits.as_slice::<T>()?;
        // Per row: (lse, loss), the loss 0 where the row is ignored.
        let mut rows = vec![(0.0, 0.0); n];
        let per_task = rows_per_task(c);
        let mut parts: Vec<(usize, &mut [(f64, f64)])> = rows
            .chunks_mut(per_task)
            .enumerate()
            .map(|(i, out)| (i * per_task, out))
            .collect();
        let isa = isa();
        run_parts(&mut parts, parallel(xs.len()), |(first, out)| {
            loss_part_on::<T>(isa, xs, c, &classes, *first, out)
        });
        drop(parts);
        let [loss_meta, lse_meta] = ctx.outputs else {
            return Err(Error::internal("CrossEntropy without its two outputs"));
        };
        let mut loss = DenseHostTensor::for_overwrite(loss_meta.clone())?;
        let out = loss.as_mut_slice::<T>()?;
        match reduction {
            LossReduction::None => {
                for (o, &(_, l)) in out.iter_mut().zip(&rows) {
                    *o = T::narrow(l);
                }
            }
            LossReduction::Sum | LossReduction::Mean => {
                let sum = rows.iter().fold(0.0, |s, &(_, l)| s + l);
                let count = classes.iter().filter(|&&t| t != IGNORED).count();
                // No rows counted: 0/0, NaN, as in PyTorch.
                let value = match reduction {
                    LossReduction::Mean => sum / count as f64,
                    _ => sum,
                };
                out[0] = T::narrow(value);
            }
        }
        let mut lse = DenseHostTensor::for_overwrite(lse_meta.clone())?;
        for (o, &(l, _)) in lse.as_mut_slice::<T::C>()?.iter_mut().zip(&rows) {
            *o = T::C::of(l);
        }
        Ok(smallvec::smallvec![loss, lse])
    })
}

fn cross_entropy_grad_kernel<T: Float>() -> Kernel {
    Arc::new(|inputs: Inputs, ctx: &KernelContext<'_>| {
        let [logits, targets, lse, g] = take(inputs)?;
        let reduction = LossReduction::of(&ctx.attrs)?;
        let subtract = ctx.attrs.bool("subtract_target")?;
        let (c, _) = classes_and_rows(&logits, &targets);
        let classes = checked_targets(&targets, c, ignore_index(&ctx.attrs)?)?;
        let (xs, lse, g) = (
            logits.as_slice::<T>()?,
            lse.as_slice::<T::C>()?,
            g.as_slice::<T>()?,
        );
        let count = classes.iter().filter(|&&t| t != IGNORED).count();
        // Each row's share of the incoming gradient (read only for rows
        // that are not ignored, so a count of 0 never divides).
        let shares: Vec<f64> = match reduction {
            LossReduction::None => g.iter().map(|v| v.wide()).collect(),
            LossReduction::Sum => vec![g[0].wide(); classes.len()],
            LossReduction::Mean => vec![g[0].wide() / count as f64; classes.len()],
        };
        let mut dx = DenseHostTensor::for_overwrite(out_meta(ctx)?.clone())?;
        if c > 0 {
            let out = dx.as_mut_slice::<T>()?;
            let parallel = parallel(out.len());
            let isa = isa();
            let per_task = rows_per_task(c);
            let mut parts: Vec<(usize, &mut [T])> = out
                .chunks_mut(per_task * c)
                .enumerate()
                .map(|(i, dx)| (i * per_task, dx))
                .collect();
            run_parts(&mut parts, parallel, |(first, dx)| {
                loss_grad_part_on::<T>(isa, xs, c, &classes, lse, &shares, subtract, *first, dx)
            });
        }
        Ok(smallvec::smallvec![dx])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::elementwise::tests::{tensor, values, Rng};
    use crate::kernels::runs_in_this_build;
    use crate::reference::transformer as reference;
    use stagecraft_ops::{OpAttrs, OpDef};

    const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];

    /// Runs `def`'s CPU kernel on `inputs` as the runtime would, returning
    /// every output after checking it has the promised metadata.
    fn run_all(
        def: &'static OpDef,
        inputs: Vec<DenseHostTensor>,
        attrs: &OpAttrs,
    ) -> Result<Vec<DenseHostTensor>> {
        let metas: Vec<TensorMetadata> = inputs.iter().map(|t| t.metadata().clone()).collect();
        let outputs = def.infer(&metas, attrs)?;
        let factory = crate::registry().get(def).expect("a kernel");
        let kernel = factory(&Attrs::new(attrs, def), &metas)?;
        let ctx = KernelContext {
            attrs: Attrs::new(attrs, def),
            outputs: &outputs,
        };
        let out = kernel(inputs.into_iter().collect(), &ctx)?;
        assert_eq!(out.len(), outputs.len(), "{} outputs", def.name);
        for (o, m) in out.iter().zip(&outputs) {
            assert_eq!(o.metadata(), m, "{} output metadata", def.name);
        }
        Ok(out.into_vec())
    }

    /// The unit roundoff of `dtype`.
    fn unit(dtype: DType) -> f64 {
        match dtype {
            DType::F64 => f64::EPSILON / 2.0,
            DType::F32 => f32::EPSILON as f64 / 2.0,
            DType::F16 => 2f64.powi(-11),
            _ => 2f64.powi(-8),
        }
    }

    /// How many roundings of `dtype` a result may carry: `base`, plus for
    /// f64 the growth of a sum of `len` terms in eight chains (summed in
    /// another order by the reference). For f32 and narrower the f64 sums
    /// are exact at the result's precision.
    fn roundings(dtype: DType, base: f64, len: usize) -> f64 {
        if dtype == DType::F64 {
            base + len as f64 / 4.0
        } else {
            base
        }
    }

    /// `|got - want| ≤ k·u·max(scale, |want|)` per element (`u` of
    /// `dtype`); NaN matches NaN, and a value past the dtype's range must
    /// have become the infinity of its sign.
    fn assert_near(dtype: DType, got: &[f64], want: &[f64], scale: &[f64], k: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let narrowed = rounded(dtype, want);
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if g == w || (g.is_nan() && w.is_nan()) || (g.is_infinite() && g == narrowed[i]) {
                continue;
            }
            let tol = k * unit(dtype) * scale[i].max(w.abs());
            assert!(
                (g - w).abs() <= tol,
                "{what} [{dtype}] element {i}: got {g}, want {w} (tolerance {tol})"
            );
        }
    }

    /// `values` rounded to `dtype`, as f64.
    fn rounded(dtype: DType, v: &[f64]) -> Vec<f64> {
        values(&tensor(dtype, v, &[v.len()]))
    }

    fn norm_attrs(has_weight: bool, has_bias: Option<bool>, eps: Option<f64>) -> OpAttrs {
        let mut a = OpAttrs::new();
        a.set_bool("has_weight", has_weight);
        if let Some(b) = has_bias {
            a.set_bool("has_bias", b);
        }
        if let Some(eps) = eps {
            a.set_float("eps", eps);
        }
        a
    }

    /// Shapes of `x` for the norm and loss tests: several ranks, rows of
    /// 1, 7 (less than a group of eight) and 64, no rows, and sizes past
    /// the parallel threshold (wide rows, and many short ones).
    const SHAPES: [&[usize]; 8] = [
        &[1],
        &[3, 7],
        &[2, 3, 8],
        &[0, 5],
        &[5, 1],
        &[4, 64],
        &[9, 5000],
        &[3000, 17],
    ];

    #[test]
    fn embedding_picks_rows_and_refuses_bad_ids() {
        let table_values: Vec<f64> = (0..12).map(|v| v as f64 * 0.5 - 2.0).collect();
        for dtype in FLOATS {
            let table = tensor(dtype, &table_values, &[4, 3]);
            for id_dtype in [DType::I32, DType::I64] {
                let ids = tensor(id_dtype, &[3.0, 0.0, 3.0, 1.0], &[2, 2]);
                let out = run_all(
                    &stagecraft_ops::EMBEDDING,
                    vec![table.clone(), ids],
                    &OpAttrs::new(),
                )
                .unwrap();
                let want = reference::embedding(&values(&table), 4, 3, &[3, 0, 3, 1]).unwrap();
                assert_eq!(values(&out[0]), want);
                for bad in [-1.0, 4.0] {
                    let ids = tensor(id_dtype, &[0.0, bad], &[2]);
                    let err = run_all(
                        &stagecraft_ops::EMBEDDING,
                        vec![table.clone(), ids],
                        &OpAttrs::new(),
                    )
                    .unwrap_err();
                    assert_eq!(err.kind(), ErrorKind::Index, "{err}");
                    assert!(
                        err.message().contains("id") && err.message().contains("[1]"),
                        "{err}"
                    );
                    assert!(
                        reference::embedding(&values(&table), 4, 3, &[0, bad as i64]).is_none()
                    );
                }
            }
        }
        // A large lookup (a parallel copy), and an empty one that still
        // checks its ids.
        let mut rng = Rng(7);
        let table = tensor(
            DType::F32,
            &rng.values(DType::F32, 100 * 64, false),
            &[100, 64],
        );
        let ids: Vec<i64> = (0..1000).map(|i| (i * 37) % 100).collect();
        let id_values: Vec<f64> = ids.iter().map(|&v| v as f64).collect();
        let out = run_all(
            &stagecraft_ops::EMBEDDING,
            vec![table.clone(), tensor(DType::I64, &id_values, &[10, 100])],
            &OpAttrs::new(),
        )
        .unwrap();
        assert_eq!(
            values(&out[0]),
            reference::embedding(&values(&table), 100, 64, &ids).unwrap()
        );
        let empty = tensor(DType::F32, &[], &[5, 0]);
        let err = run_all(
            &stagecraft_ops::EMBEDDING,
            vec![empty, tensor(DType::I64, &[5.0], &[1])],
            &OpAttrs::new(),
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Index, "{err}");
    }

    /// Checks the forward and backward of both norms, with every
    /// combination of parameters, against the f64 references.
    fn check_norms(dtype: DType, dims: &[usize], seed: u64) {
        let mut rng = Rng(seed);
        let numel: usize = dims.iter().product();
        let d = *dims.last().unwrap();
        // Odd seeds put the rows far from 0 against their spread, which
        // f32 sums would lose.
        let offset = if seed % 2 == 1 { 30.0 } else { 0.0 };
        let raw: Vec<f64> = rng
            .values(dtype, numel, false)
            .iter()
            .map(|v| v + offset)
            .collect();
        let xv = rounded(dtype, &raw);
        let gv = rounded(dtype, &rng.values(dtype, numel, false));
        let wv = rounded(dtype, &rng.values(dtype, d, false));
        let bv = rounded(dtype, &rng.values(dtype, d, false));
        let x = tensor(dtype, &xv, dims);
        let g = tensor(dtype, &gv, dims);
        let (w, b) = (tensor(dtype, &wv, &[d]), tensor(dtype, &bv, &[d]));
        let stats_dtype = stagecraft_ops::stats_dtype(dtype);
        let eps = 1e-5;
        for centered in [true, false] {
            let (fwd, bwd, name) = if centered {
                (
                    &stagecraft_ops::LAYER_NORM,
                    &stagecraft_ops::LAYER_NORM_GRAD,
                    "LayerNorm",
                )
            } else {
                (
                    &stagecraft_ops::RMS_NORM,
                    &stagecraft_ops::RMS_NORM_GRAD,
                    "RmsNorm",
                )
            };
            for (has_w, has_b) in [(false, false), (true, false), (false, true), (true, true)] {
                if !centered && has_b {
                    continue;
                }
                let what = format!("{name} {dims:?} weight {has_w} bias {has_b}");
                let bias_attr = centered.then_some(has_b);
                let mut inputs = vec![x.clone()];
                inputs.extend(has_w.then(|| w.clone()));
                inputs.extend(has_b.then(|| b.clone()));
                let out = run_all(fwd, inputs, &norm_attrs(has_w, bias_attr, Some(eps))).unwrap();
                let wr = has_w.then_some(&wv[..]);
                let br = has_b.then_some(&bv[..]);
                let want = reference::norm(&xv, d, wr, br, eps, centered);
                let row = |i: usize| i / d;
                // The mean's error grows with the row's mean magnitude,
                // not with the mean itself.
                let n_rows = numel / d.max(1);
                let magnitude: Vec<f64> = (0..n_rows)
                    .map(|r| xv[r * d..(r + 1) * d].iter().map(|v| v.abs()).sum::<f64>() / d as f64)
                    .collect();
                // y: a few roundings of the arithmetic type on the terms
                // of `(x - mean)·rstd·w + b` (the mean and rstd rounded too).
                let scale: Vec<f64> = (0..numel)
                    .map(|i| {
                        let (j, r) = (i % d, row(i));
                        (xv[i].abs() + magnitude[r]) * want.rstd[r] * wr.map_or(1.0, |w| w[j].abs())
                            + br.map_or(0.0, |b| b[j].abs())
                    })
                    .collect();
                let k = if stats_dtype == dtype { 10.0 } else { 2.0 };
                let y = values(&out[0]);
                assert_near(
                    dtype,
                    &y,
                    &want.y,
                    &scale,
                    roundings(dtype, k, d),
                    &format!("{what}: y"),
                );
                let rstd = values(out.last().unwrap());
                let k = roundings(stats_dtype, 2.0, d);
                assert_near(
                    stats_dtype,
                    &rstd,
                    &want.rstd,
                    &want.rstd,
                    k,
                    &format!("{what}: rstd"),
                );
                if centered {
                    let scale: Vec<f64> = want.mean.iter().map(|m| m.abs() + 5.0).collect();
                    let mean = values(&out[1]);
                    assert_near(
                        stats_dtype,
                        &mean,
                        &want.mean,
                        &scale,
                        k,
                        &format!("{what}: mean"),
                    );
                }
                // The backward, from the kernel's own statistics.
                let mut inputs = vec![g.clone(), x.clone()];
                inputs.extend(out[1..].iter().cloned());
                inputs.extend(has_w.then(|| w.clone()));
                let grads = run_all(bwd, inputs, &norm_attrs(has_w, bias_attr, None)).unwrap();
                let want_g = reference::norm_backward(&gv, &xv, d, wr, eps, centered);
                // dx = rstd·(a - mean(a) - xh·mean(a·xh)): the means are
                // sums of |a| and |a·xh| at most, and xh carries the error
                // of x - mean.
                let a = |i: usize| gv[i] * wr.map_or(1.0, |w| w[i % d]);
                let xh = |i: usize| (xv[i] - want.mean[row(i)]) * want.rstd[row(i)];
                let row_mean = |f: &dyn Fn(usize) -> f64, r: usize| {
                    (r * d..(r + 1) * d).map(f).sum::<f64>() / d as f64
                };
                let means: Vec<[f64; 3]> = (0..n_rows)
                    .map(|r| {
                        [
                            row_mean(&|i| a(i).abs(), r),
                            row_mean(&|i| (a(i) * xh(i)).abs(), r),
                            row_mean(&|i| a(i) * xh(i), r).abs(),
                        ]
                    })
                    .collect();
                let dx_scale: Vec<f64> = (0..numel)
                    .map(|i| {
                        let r = row(i);
                        let [ma, maxh, m2] = means[r];
                        let spread = (xv[i].abs() + magnitude[r]) * want.rstd[r];
                        want.rstd[r] * (a(i).abs() + ma + xh(i).abs() * maxh + spread * m2)
                    })
                    .collect();
                let dx = values(&grads[0]);
                let k = roundings(dtype, 16.0, d);
                assert_near(dtype, &dx, &want_g.dx, &dx_scale, k, &format!("{what}: dx"));
                let column_sum = |f: &dyn Fn(usize) -> f64| -> Vec<f64> {
                    (0..d)
                        .map(|j| (0..n_rows).map(|r| f(r * d + j)).sum())
                        .collect()
                };
                let mut next = 1;
                if has_w {
                    let scale = column_sum(&|i| {
                        gv[i].abs() * (xv[i].abs() + magnitude[row(i)]) * want.rstd[row(i)]
                    });
                    // In f64 the mean's own rounding (a sum of d terms)
                    // moves every xh of a row together.
                    let dw = values(&grads[next]);
                    let k = roundings(dtype, 8.0, n_rows + d);
                    assert_near(
                        dtype,
                        &dw,
                        &want_g.dw,
                        &scale,
                        k,
                        &format!("{what}: dweight"),
                    );
                    next += 1;
                }
                if has_b {
                    let scale = column_sum(&|i| gv[i].abs());
                    let db = values(&grads[next]);
                    let k = roundings(dtype, 2.0, n_rows);
                    assert_near(dtype, &db, &want_g.db, &scale, k, &format!("{what}: dbias"));
                }
            }
        }
    }

    #[test]
    fn norms_match_the_reference() {
        for dtype in FLOATS {
            for (i, dims) in SHAPES.iter().enumerate() {
                if runs_in_this_build(dtype, dims) {
                    check_norms(dtype, dims, i as u64 + 1);
                }
            }
        }
    }

    /// The bits do not depend on whether rows were split across threads:
    /// the parameter gradients sum per block of rows the shape fixes.
    #[test]
    fn norm_results_do_not_depend_on_threads() {
        let (n, d) = if cfg!(miri) { (40, 17) } else { (3000, 17) };
        let mut rng = Rng(11);
        let mut sample = |len: usize| -> Vec<f32> {
            rng.values(DType::F32, len, false)
                .iter()
                .map(|&v| v as f32)
                .collect()
        };
        let (x, g, w) = (sample(n * d), sample(n * d), sample(d));
        let forward = |parallel: bool| {
            let mut y = vec![0.0f32; n * d];
            let stats = norm_rows::<f32, true, true, false>(&x, &w, &[], 1e-5, d, &mut y, parallel);
            (y, stats)
        };
        let (y, stats) = forward(false);
        assert_eq!((y, stats.clone()), forward(true));
        let mean: Vec<f32> = stats.iter().map(|s| s[0]).collect();
        let rstd: Vec<f32> = stats.iter().map(|s| s[1]).collect();
        let rows = NormRows {
            g: &g,
            x: &x,
            w: &w,
            mean: &mean,
            rstd: &rstd,
        };
        let backward = |parallel: bool| {
            let (mut dx, mut dw, mut db) = (vec![0.0f32; n * d], vec![0.0; d], vec![0.0; d]);
            norm_grad_rows::<f32, true, true, true>(&rows, d, &mut dx, &mut dw, &mut db, parallel);
            (dx, dw, db)
        };
        assert_eq!(backward(false), backward(true));
    }

    #[test]
    fn norms_of_empty_and_constant_rows() {
        // Rows of no elements: NaN statistics, empty results.
        let x = tensor(DType::F32, &[], &[3, 0]);
        let out = run_all(
            &stagecraft_ops::LAYER_NORM,
            vec![x.clone()],
            &OpAttrs::new(),
        )
        .unwrap();
        assert!(values(&out[1])
            .iter()
            .chain(&values(&out[2]))
            .all(|v| v.is_nan()));
        let grads = run_all(
            &stagecraft_ops::LAYER_NORM_GRAD,
            vec![x.clone(), x, out[1].clone(), out[2].clone()],
            &norm_attrs(false, Some(true), None),
        )
        .unwrap();
        assert_eq!(grads[0].numel(), 0);
        assert_eq!(grads[1].numel(), 0);
        // A constant row normalizes to 0 (plus the bias); rstd = eps^-1/2.
        let x = tensor(DType::F64, &[2.5; 4], &[1, 4]);
        let b = tensor(DType::F64, &[1.0, 2.0, 3.0, 4.0], &[4]);
        let out = run_all(
            &stagecraft_ops::LAYER_NORM,
            vec![x, b],
            &norm_attrs(false, Some(true), Some(0.25)),
        )
        .unwrap();
        assert_eq!(values(&out[0]), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(values(&out[1]), vec![2.5]);
        assert_eq!(values(&out[2]), vec![2.0]);
    }

    fn loss_attrs(ignore: Option<i64>, reduction: LossReduction) -> OpAttrs {
        let mut a = OpAttrs::new();
        a.set_str("reduction", reduction.as_str());
        if let Some(i) = ignore {
            a.set_ints("ignore_index", &[i]);
        }
        a
    }

    fn check_loss(dtype: DType, dims: &[usize], seed: u64) {
        let mut rng = Rng(seed);
        let numel: usize = dims.iter().product();
        let c = *dims.last().unwrap();
        let lead = &dims[..dims.len() - 1];
        let n: usize = lead.iter().product();
        // Logits up to ±100: subtracting the maximum matters.
        let raw: Vec<f64> = rng
            .values(dtype, numel, false)
            .iter()
            .map(|v| v * 20.0)
            .collect();
        let xv = rounded(dtype, &raw);
        let x = tensor(dtype, &xv, dims);
        let ignore = -100;
        let targets: Vec<i64> = (0..n)
            .map(|r| {
                if r % 5 == 3 {
                    ignore
                } else {
                    (rng.next() % c as u64) as i64
                }
            })
            .collect();
        let target_values: Vec<f64> = targets.iter().map(|&v| v as f64).collect();
        let t = tensor(DType::I64, &target_values, lead);
        let stats_dtype = stagecraft_ops::stats_dtype(dtype);
        let counted = targets.iter().filter(|&&t| t != ignore).count();
        for reduction in [LossReduction::None, LossReduction::Mean, LossReduction::Sum] {
            let what = format!("CrossEntropy {dims:?} {reduction:?}");
            let attrs = loss_attrs(Some(ignore), reduction);
            let out = run_all(
                &stagecraft_ops::CROSS_ENTROPY,
                vec![x.clone(), t.clone()],
                &attrs,
            )
            .unwrap();
            let want = reference::cross_entropy(&xv, c, &targets, Some(ignore), reduction).unwrap();
            // Each loss is lse - logit in f64, rounded once; sums of them
            // in f64 too.
            let per_row: Vec<f64> = want.lse.iter().map(|l| l.abs() + 100.0).collect();
            let scale = match reduction {
                LossReduction::None => per_row.clone(),
                LossReduction::Sum => vec![per_row.iter().sum()],
                LossReduction::Mean => vec![per_row.iter().sum::<f64>() / counted.max(1) as f64],
            };
            let loss = values(&out[0]);
            let k = roundings(dtype, 2.0, c + n);
            assert_near(
                dtype,
                &loss,
                &want.loss,
                &scale,
                k,
                &format!("{what}: loss"),
            );
            let lse = values(&out[1]);
            let k = roundings(stats_dtype, 2.0, c);
            assert_near(
                stats_dtype,
                &lse,
                &want.lse,
                &per_row,
                k,
                &format!("{what}: lse"),
            );
            // The backward, for a gradient of the loss's shape.
            let gv = rounded(dtype, &rng.values(dtype, out[0].numel(), false));
            let g = tensor(dtype, &gv, out[0].shape().dims());
            let dx = run_all(
                &stagecraft_ops::CROSS_ENTROPY_GRAD,
                vec![x.clone(), t.clone(), out[1].clone(), g],
                &attrs,
            )
            .unwrap();
            let want_dx =
                reference::cross_entropy_backward(&xv, c, &targets, Some(ignore), reduction, &gv);
            // exp(x - lse) with lse rounded to the statistics' type: a
            // relative error of |lse|·u of that type, on top of one
            // rounding of the result.
            let share = |r: usize| match reduction {
                LossReduction::None => gv[r].abs(),
                LossReduction::Sum => gv[0].abs(),
                LossReduction::Mean => gv[0].abs() / counted.max(1) as f64,
            };
            let scale: Vec<f64> = (0..numel)
                .map(|i| {
                    let r = i / c;
                    share(r) * (1.0 + per_row[r] * unit(stats_dtype) / unit(dtype))
                })
                .collect();
            let k = roundings(dtype, 4.0, c);
            assert_near(
                dtype,
                &values(&dx[0]),
                &want_dx,
                &scale,
                k,
                &format!("{what}: dlogits"),
            );
        }
    }

    #[test]
    fn cross_entropy_matches_the_reference() {
        for dtype in FLOATS {
            for (i, dims) in SHAPES.iter().enumerate() {
                if runs_in_this_build(dtype, dims) {
                    check_loss(dtype, dims, i as u64 + 3);
                }
            }
        }
    }

    #[test]
    fn cross_entropy_edge_cases() {
        let ce = &stagecraft_ops::CROSS_ENTROPY;
        let logits = tensor(DType::F32, &[1.0, 2.0, 3.0, 0.0, 0.0, 0.0], &[2, 3]);
        // Every row ignored: the mean is NaN (0/0), the sum 0, and the
        // gradient 0.
        let t = tensor(DType::I32, &[7.0, 7.0], &[2]);
        let mean = loss_attrs(Some(7), LossReduction::Mean);
        let out = run_all(ce, vec![logits.clone(), t.clone()], &mean).unwrap();
        assert!(values(&out[0])[0].is_nan());
        let one = tensor(DType::F32, &[1.0], &[]);
        let inputs = vec![logits.clone(), t.clone(), out[1].clone(), one];
        let dx = run_all(&stagecraft_ops::CROSS_ENTROPY_GRAD, inputs, &mean).unwrap();
        assert_eq!(values(&dx[0]), vec![0.0; 6]);
        let sum = loss_attrs(Some(7), LossReduction::Sum);
        let out = run_all(ce, vec![logits.clone(), t], &sum).unwrap();
        assert_eq!(values(&out[0]), vec![0.0]);
        // Uniform logits: the loss is ln 3 whatever the target.
        let t = tensor(DType::I64, &[0.0, 2.0], &[2]);
        let none = loss_attrs(None, LossReduction::None);
        let out = run_all(ce, vec![logits.clone(), t.clone()], &none).unwrap();
        assert_eq!(values(&out[0])[1], 3.0f64.ln() as f32 as f64);
        // Huge logits do not overflow.
        let big = tensor(DType::F32, &[1e30, 0.0, -1e30, 88.0, 89.0, 90.0], &[2, 3]);
        let loss = values(&run_all(ce, vec![big, t.clone()], &none).unwrap()[0]);
        let want = -(2.0 - (1f64.exp() + 2f64.exp() + 1.0).ln());
        assert_eq!(loss[0], 0.0);
        assert!((loss[1] - want).abs() < 1e-6, "{loss:?} vs {want}");
        // A NaN logit makes its row's loss NaN and leaves the other.
        let nan = tensor(DType::F64, &[f64::NAN, 0.0, 0.0, 0.0, 0.0, 0.0], &[2, 3]);
        let loss = values(&run_all(ce, vec![nan, t], &none).unwrap()[0]);
        assert!(
            loss[0].is_nan() && (loss[1] - 3f64.ln()).abs() < 1e-15,
            "{loss:?}"
        );
        // Targets out of range, the ignored value aside, are Index errors.
        for (bad, ignore) in [
            (3.0, None),
            (-1.0, None),
            (-100.0, Some(-1)),
            (3.0, Some(3)),
        ] {
            let t = tensor(DType::I64, &[0.0, bad], &[2]);
            let result = run_all(
                ce,
                vec![logits.clone(), t],
                &loss_attrs(ignore, LossReduction::Mean),
            );
            if ignore == Some(bad as i64) {
                assert!(result.is_ok());
                continue;
            }
            let err = result.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Index, "{err}");
            assert!(err.message().contains("target"), "{err}");
        }
        // The backward checks its targets too.
        let inputs = vec![
            logits,
            tensor(DType::I64, &[0.0, 5.0], &[2]),
            tensor(DType::F32, &[0.0, 0.0], &[2]),
            tensor(DType::F32, &[1.0], &[]),
        ];
        let err = run_all(
            &stagecraft_ops::CROSS_ENTROPY_GRAD,
            inputs,
            &loss_attrs(None, LossReduction::Mean),
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Index, "{err}");
    }

    /// The loops give the same bits whatever instruction set they were
    /// compiled for: row lengths around the eight partial sums and the
    /// vector widths, NaN and infinite values, f32 and f64. Any NaN
    /// equals any NaN: IEEE 754 leaves the sign and payload of a NaN that
    /// arithmetic makes unspecified, and vector code may pick the other
    /// operand's (as in the differential suite's policy).
    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        fn check<T: Float + std::fmt::Debug>(values: &[f64]) {
            let mut isas = vec![isa()];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                isas.push(Isa::Avx2);
            }
            let canonical = |x: f64| {
                if x.is_nan() {
                    f64::NAN.to_bits()
                } else {
                    x.to_bits()
                }
            };
            let bits = |v: &[T]| -> Vec<u64> { v.iter().map(|x| canonical(x.wide())).collect() };
            let wide = |v: &[T::C]| -> Vec<u64> { v.iter().map(|x| canonical(x.wide())).collect() };
            for d in [1, 7, 8, 9, 31, 33] {
                let rows = values.len() / d / 2;
                let take = |at: usize| -> Vec<T> {
                    values[at..at + rows * d]
                        .iter()
                        .map(|&v| T::narrow(v))
                        .collect()
                };
                let (x, g) = (take(0), take(rows * d));
                let w: Vec<T> = values[..d]
                    .iter()
                    .map(|&v| T::narrow(v * 0.5 + 1.0))
                    .collect();
                let run = |isa: Isa| {
                    let mut y = vec![T::narrow(0.0); rows * d];
                    let mut stats = vec![[T::C::of(0.0); 2]; rows];
                    norm_part_on::<T, true, true, true>(
                        isa, &x, &w, &w, 1e-5, d, 0, &mut y, &mut stats,
                    );
                    let mean: Vec<T::C> = stats.iter().map(|s| s[0]).collect();
                    let rstd: Vec<T::C> = stats.iter().map(|s| s[1]).collect();
                    let norm = NormRows {
                        g: &g,
                        x: &x,
                        w: &w,
                        mean: &mean,
                        rstd: &rstd,
                    };
                    let (mut dx, mut pw, mut pb) =
                        (vec![T::narrow(0.0); rows * d], vec![0.0; d], vec![0.0; d]);
                    norm_grad_part_on::<T, true, true, true>(
                        isa, &norm, d, 0, &mut dx, &mut pw, &mut pb,
                    );
                    let classes: Vec<usize> = (0..rows)
                        .map(|r| if r % 3 == 2 { IGNORED } else { r % d })
                        .collect();
                    let mut loss = vec![(0.0, 0.0); rows];
                    loss_part_on::<T>(isa, &x, d, &classes, 0, &mut loss);
                    let lse: Vec<T::C> = loss.iter().map(|l| T::C::of(l.0)).collect();
                    let shares = vec![0.25; rows];
                    let mut dl = vec![T::narrow(0.0); rows * d];
                    loss_grad_part_on::<T>(isa, &x, d, &classes, &lse, &shares, true, 0, &mut dl);
                    let loss: Vec<u64> = loss
                        .iter()
                        .flat_map(|l| [canonical(l.0), canonical(l.1)])
                        .collect();
                    let sums: Vec<u64> = pw.iter().chain(&pb).map(|&v| canonical(v)).collect();
                    (
                        bits(&y),
                        wide(&mean),
                        wide(&rstd),
                        bits(&dx),
                        sums,
                        loss,
                        bits(&dl),
                    )
                };
                let baseline = run(Isa::Baseline);
                for &isa in &isas {
                    let got = run(isa);
                    assert_eq!(got.0, baseline.0, "{isa:?}, rows of {d}: y");
                    assert_eq!(got.1, baseline.1, "{isa:?}, rows of {d}: mean");
                    assert_eq!(got.2, baseline.2, "{isa:?}, rows of {d}: rstd");
                    assert_eq!(got.3, baseline.3, "{isa:?}, rows of {d}: dx");
                    assert_eq!(got.4, baseline.4, "{isa:?}, rows of {d}: dweight, dbias");
                    assert_eq!(got.5, baseline.5, "{isa:?}, rows of {d}: loss");
                    assert_eq!(got.6, baseline.6, "{isa:?}, rows of {d}: dlogits");
                }
            }
        }
        let n = if cfg!(miri) { 200 } else { 2000 };
        let values: Vec<f64> = (0..n)
            .map(|i| match i % 89 {
                0 => f64::NAN,
                1 => f64::INFINITY,
                _ => ((i * 7919) % 1000) as f64 / 37.0 - 13.0,
            })
            .collect();
        check::<f32>(&values);
        check::<f64>(&values);
    }
}
